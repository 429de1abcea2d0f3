"""Stand-ins for the parts of the NKI 0.6 API (aws-neuron/aws-neuron-sdk, nki/api/nki/language/__init__.py
and nki/api/nki/isa/__init__.py) that the emulator does not implement: they exist under their real names
with their real parameter names, and calling one raises NotImplementedError naming it, so a kernel that
needs one fails with a clear message instead of an AttributeError."""

import inspect


def not_emulated(qualname, parameters):
    """A function named like ``qualname`` whose signature lists ``parameters`` (space-separated, as in
    the stub) and which raises NotImplementedError when called."""

    def unemulated(*args, **kwargs):
        raise NotImplementedError(f"{qualname} is not emulated by the CPU NKI emulator (nki_emulator/)")

    unemulated.__name__ = unemulated.__qualname__ = qualname.rpartition(".")[2]
    unemulated.__doc__ = f"{qualname}: not emulated; calling it raises NotImplementedError."
    unemulated.__signature__ = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None) for name in parameters.split()])
    return unemulated


def module_getattr(module_name, unemulated_names):
    """A module ``__getattr__`` for constants (dtypes, operators) the emulator lacks: NotImplementedError
    naming them, AttributeError for anything else."""

    def __getattr__(name):
        if name in unemulated_names:
            raise NotImplementedError(f"{module_name}.{name} is not emulated by the CPU NKI emulator")
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

    return __getattr__


class UnemulatedDType:
    """An NKI dtype without a numpy counterpart here (tfloat32, the packed MX types): it exists and compares by
    identity, so a kernel can test ``dtype in (nl.float32, nl.float8_e4m3fn_x4)`` as nki-library's
    output_projection_cte_parameters.py does; allocating with it raises NotImplementedError."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"nki.language.{self.name}"

"""A CPU emulator of the new NKI dialect, standing in for ``nki`` (this module), ``nki.language``
(:mod:`.language`) and ``nki.isa`` (:mod:`.isa`) where the Neuron SDK cannot be installed.

Kernels run unmodified: ``kernel = nki.jit(fn)`` and ``kernel(*arrays, **scalars)`` or
``kernel[lnc](...)`` execute ``fn`` eagerly on numpy, instruction by instruction, enforcing the
documented hardware rules (they raise :class:`NkiValidationError`, naming the instruction and the
limit). ``nki.jit`` first checks the kernel's source against the NKI meta-programming subset of Python
(see :mod:`._subset`). Arguments may be numpy arrays or CPU torch tensors (bf16/fp8 included); results
come back as the same kind, and with torch tensors a kernel that returns one output gives it back bare,
not in a tuple, as TorchNeuron does. ``with nki_emulator.counting() as counts:`` records what the kernels did (see
:class:`Counts`); ``nki_emulator.estimate(counts.trace)`` prices it per engine (see :mod:`._cost`),
``nki_emulator.schedule(counts.trace)`` places it in time (see :mod:`._schedule`) and :mod:`.timeline` draws that
schedule. ``set_target("trn1" | "trn2" | "trn3")`` (or env ``NKI_EMULATOR_TARGET``; default
trn2) picks the generation whose limits apply; ``set_nki_version("0.4" | "0.5" | "0.6" | "0.7")`` (or env
``NKI_EMULATOR_NKI_VERSION``; default the contest's 0.4) the NKI release whose documented rules apply. When a kernel
runs, it and every helper it calls run under NKI 0.4's value model (see :mod:`._values`; ``VALUE_KINDS`` is its
table); from "0.7" on, kernels run as plain Python. Memory model: see :mod:`._memory`.

In tests, :func:`install` makes ``import nki`` give the real package when it imports, else this one.
"""

import functools
import sys
import threading

import numpy as np

from . import isa, language, timeline, typing
from ._cost import (ASSUMPTIONS, CALIBRATION_ASSUMPTIONS, ENGINE_SPECS, LAUNCH_S, estimate, instruction_seconds,
                    matmul_cycles)
from ._memory import MemoryRegion, NkiTensor, as_dtype, check_capacity, poison, wrap_host
from ._runtime import (Core, Counts, Instruction, Launch, NkiValidationError, counting, nki_since, nki_version, running,
                       set_nki_version,
                       set_target, target)
from ._schedule import (CENTRAL_ASSUMPTIONS, NOT_MODELLED, PESSIMISTIC_ASSUMPTIONS, calibrated_seconds,
                        central_estimate, pessimistic_estimate, schedule, schedule_figures)
from ._subset import check_kernel
from ._values import VALUE_KINDS, check_arguments, traced_callable

__all__ = ["jit", "simulate", "cpu_simulate", "install", "counting", "Counts", "Instruction", "set_target", "target",
           "set_nki_version", "nki_version",
           "NkiValidationError", "estimate", "instruction_seconds", "matmul_cycles", "ENGINE_SPECS", "ASSUMPTIONS",
           "schedule", "schedule_figures", "central_estimate", "pessimistic_estimate", "calibrated_seconds",
           "CENTRAL_ASSUMPTIONS", "PESSIMISTIC_ASSUMPTIONS",
           "NOT_MODELLED", "LAUNCH_S", "CALIBRATION_ASSUMPTIONS", "VALUE_KINDS",
           "language", "isa", "typing", "dtype"]

dtype = language.DType  # ``nki.dtype``: what kernel signatures annotate dtypes with (nki-library API docs)
__version__ = "0.6.0"  # the NKI release whose API this emulates (tests/test_nki_api.py)


def jit(fn=None, **options):
    """``nki.jit``: make ``fn`` a launchable kernel; usable as ``@nki.jit`` or ``@nki.jit(...)``.
    The kernel's source is checked against the NKI subset of Python here (NkiValidationError).
    Options of the real compiler (``mode``, ...) are accepted and ignored."""
    if fn is None:
        return jit
    return fn if isinstance(fn, Kernel) else Kernel(fn)


def simulate(kernel):
    """``nki.simulate``: a callable running ``kernel`` (a jit kernel, ``kernel[lnc]`` or a plain
    function) on the CPU with numpy arrays or torch tensors."""
    return kernel if isinstance(kernel, Kernel) else Kernel(kernel)


cpu_simulate = simulate  # the name nki-library's test harness calls (test/utils/simulation_setup.py simulate_kernel)


class Kernel:
    """A jit-wrapped kernel. ``kernel(...)`` runs on one NeuronCore; ``kernel[2](...)`` runs the two
    programs of a logical NeuronCore (``nl.program_id(0)`` 0 then 1, one after the other) sharing
    their ``nl.shared_hbm`` tensors, as the two physical cores of LNC=2 do."""

    def __init__(self, fn, lnc=1, grid=False, schedule_edges=None):
        if not nki_since("0.7"):  # NKI 0.7 specialises a kernel by running it as Python: the whole language
            check_kernel(fn)
        functools.update_wrapper(self, fn)
        self.fn, self.lnc, self.grid = fn, lnc, grid
        self.schedule_edges = schedule_edges or {}  # label -> labels it must follow (with_schedule)

    def __getitem__(self, lnc):
        if isinstance(lnc, bool) or lnc not in (1, 2):
            raise NkiValidationError(f"kernel[lnc]: the launch bracket takes one number, the LNC degree 1 or 2; "
                                     f"got {lnc!r}")
        return Kernel(self.fn, lnc, grid=True, schedule_edges=self.schedule_edges)

    def with_schedule(self, edges):
        """``kernel.with_schedule([("plus1", "recip"), ("act2", ["act0", "act1"])])``: the kernel with extra
        dependency edges for the compiler's scheduler: the instruction named by the first label (its ``name=``)
        runs after each one named by the second (aws-neuron-sdk 3afa0fdf nki/guides/how-to-scheduling-apis.rst,
        "Adding dependency edges"; KLR/KLR/NKI/Simplify.lean l. 512-525 reads them as pairs of strings). The trace
        carries them (Instruction.after) to nki_emulator/_schedule.py."""
        merged = {label: list(after) for label, after in self.schedule_edges.items()}
        for edge in edges:
            if not (isinstance(edge, tuple) and len(edge) == 2 and isinstance(edge[0], str)
                    and (isinstance(edge[1], str) or (isinstance(edge[1], list)
                                                      and all(isinstance(e, str) for e in edge[1])))):
                raise NkiValidationError(f"with_schedule: each edge is a pair (name, name or list of names) of "
                                         f"instruction names (KLR Simplify.lean: 'Schedule edge must be a pair', "
                                         f"'Schedule edge name must be a string'); got {edge!r}")
            merged.setdefault(edge[0], []).extend([edge[1]] if isinstance(edge[1], str) else edge[1])
        return Kernel(self.fn, self.lnc, self.grid, {label: tuple(after) for label, after in merged.items()})

    def _run_programs(self, args, kwargs):
        """Run the launch's programs (program 0 first, then the other where program 0 waits in a sendrecv or ends);
        the last program's return value is the kernel's."""
        launch = Launch()
        launch.schedule_edges = self.schedule_edges
        fn = self.fn
        if not nki_since("0.7"):  # up to 0.6 the front end traces the kernel with its own values; 0.7 runs Python
            check_arguments({**{f"argument {i}": a for i, a in enumerate(args)},
                             **{f"argument {k!r}": v for k, v in kwargs.items()}})
            fn = traced_callable(self.fn)
        results, errors = [None] * self.lnc, [None] * self.lnc
        holding = [threading.Event() for _ in range(self.lnc)]

        def program(program_id):
            with launch.baton:
                holding[program_id].set()
                core = Core(program_id, self.lnc, self.grid, launch)
                try:
                    with running(core):
                        results[program_id] = fn(*args, **kwargs)
                    check_capacity(core)
                except BaseException as error:  # re-raised in the caller's thread below
                    errors[program_id] = error
                finally:
                    launch.finished.add(program_id)
                    launch.baton.notify_all()

        if self.lnc == 1:
            program(0)
        else:
            threads = [threading.Thread(target=program, args=(i,), daemon=True) for i in range(self.lnc)]
            for thread, held in zip(threads, holding):
                thread.start()
                held.wait()  # program 0 takes the baton before program 1 starts
            for thread in threads:
                thread.join()
        for error in errors:
            if error is not None:
                raise error
        return results[-1]

    def __call__(self, *args, **kwargs):
        torch_out = any(_is_torch(a) for a in (*args, *kwargs.values()))
        args = tuple(_to_device(a, f"argument {i}") for i, a in enumerate(args))
        kwargs = {k: _to_device(v, f"argument {k!r}") for k, v in kwargs.items()}
        outputs = _to_host(self._run_programs(args, kwargs), torch_out)
        if torch_out and isinstance(outputs, tuple) and len(outputs) == 1:
            # TorchNeuron returns a kernel's only output bare, however the kernel wrapped it: one return type
            # gives one tensor, several a tuple (torch_neuronx/nki_hop.py, nki_kernel_wrapper's meta and
            # fake-tensor impls; torch_neuronx/python_ops/torch_mlir/nki_op_impl.py; public copy in
            # parmoham-aws/test-repo-parmoham).
            return outputs[0]
        return outputs


# ---- host <-> device -------------------------------------------------------------------------------

def _is_torch(x):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _torch_views():
    """torch dtypes that numpy lacks, carried bit for bit through a same-width integer:
    torch dtype -> (torch int dtype, numpy int dtype, ml_dtypes dtype)."""
    import torch

    return {torch.bfloat16: (torch.int16, np.int16, language.bfloat16),
            torch.float8_e4m3fn: (torch.uint8, np.uint8, language.float8_e4m3fn),
            torch.float8_e5m2: (torch.uint8, np.uint8, language.float8_e5m2)}


def _to_device(x, what):
    """A kernel argument: arrays become HBM tensors sharing the caller's memory (so in-place kernel
    writes show, as in nki.simulate); tuples are converted item by item; other values pass through."""
    if isinstance(x, list):
        raise NkiValidationError(f"nki.jit: {what} is a list; kernel arguments may be tuples, not lists")
    if isinstance(x, tuple):
        return tuple(_to_device(item, what) for item in x)
    if _is_torch(x):
        if x.device.type != "cpu":
            raise NkiValidationError(f"nki.jit: {what} is a torch tensor on {x.device}; the emulator needs CPU tensors")
        x = x.detach().contiguous()
        views = _torch_views()
        x = x.view(views[x.dtype][0]).numpy().view(views[x.dtype][2]) if x.dtype in views else x.numpy()
    if isinstance(x, np.ndarray):
        as_dtype(x.dtype, f"nki.jit {what}")
        return wrap_host(np.ascontiguousarray(x), MemoryRegion.shared_hbm, f"kernel {what} {x.shape} {x.dtype.name}")
    return x


def _to_host(result, torch_out):
    if isinstance(result, (tuple, list)):
        return tuple(_to_host(item, torch_out) for item in result)
    if not isinstance(result, NkiTensor):
        return result
    if result.buffer is not MemoryRegion.shared_hbm:
        # From NKI 0.3.0 on (every release emulated): aws-neuron-sdk 3afa0fdf release-notes/components/nki.rst l. 205,
        # a breaking change. The guides that return nl.hbm (how-to-scheduling-apis.rst l. 38, the kernel-optimization
        # tutorial) date from Neuron 2.28 (NKI 0.2.0, commit 86a92868), before it; nki-library's kernels, which run on
        # hardware, return every output in nl.shared_hbm.
        raise NkiValidationError(f"nki.jit: kernel outputs must be allocated in nl.shared_hbm; this one is in "
                                 f"{result.buffer.value} (NKI 0.3.0 on: \"Output tensors must use "
                                 "buffer=nl.shared_hbm. Using nl.hbm causes compilation failures.\", aws-neuron-sdk "
                                 "release-notes/components/nki.rst l. 205)")
    array = np.array(result._data)
    unwritten = poison(result)
    if unwritten is not None and array.dtype.kind not in "fV":
        raise NkiValidationError(f"nki.jit: {np.count_nonzero(unwritten)} elements of the output "
                                 f"{result._storage.label} were never written or were computed from memory never "
                                 "written; a float output would carry them as NaN (aws-neuron-sdk 3afa0fdf "
                                 f"nki/guides/nki_simulator.rst l. 212-221), a {array.dtype.name} one cannot")
    if not torch_out:
        return array
    import torch

    for torch_dtype, (_, np_int, np_dtype) in _torch_views().items():
        if array.dtype == np_dtype:
            return torch.from_numpy(array.view(np_int)).view(torch_dtype)
    return torch.from_numpy(array)


# ---- tests -----------------------------------------------------------------------------------------

def install():
    """Make ``import nki``, ``import nki.language``, ``import nki.isa`` work: if the Neuron SDK's nki
    imports (PyPI's placeholder raises ImportError), keep it and return it; otherwise register this
    emulator under those names and return it."""
    try:
        import nki
        import nki.isa
        import nki.language  # noqa: F401

        return nki
    except ImportError:
        pass
    # nki.isa.constants: the enums (engine, dge_mode, matmul_perf_mode, ...) under the module path nki-library imports
    # them from (output_projection_tkg.py; nki-library's test/utils/simulation_setup.py aliases it the same way)
    sys.modules.update({"nki": sys.modules[__name__], "nki.language": language, "nki.isa": isa, "nki.typing": typing,
                        "nki.isa.constants": isa})
    return sys.modules[__name__]

"""Stands in for ``nki.language`` (``nl``): dtypes, buffers, tensor creation, loops, SPMD ids, the
operator functions that ``nki.isa`` instructions take as ``op``, and the value-returning helpers
(``nl.add``, ``nl.exp``, ``nl.sum``, ``nl.load``, ``nl.matmul``, ...).

Each helper allocates its result in SBUF (PSUM for ``matmul``/``transpose``) and is built from
``nki.isa`` instructions, so it is counted and checked like the instructions it stands for.
Operators are plain functions: ``nl.add(a, b)`` computes, ``op=nl.add`` names the ALU operation.
Names such as ``max``, ``min``, ``sum``, ``abs`` and ``copy`` shadow Python builtins in this module,
as they do in the real one, so the code here does not use those builtins.
"""

import ast
import inspect
import math
import textwrap
import types

import numpy as np

from . import _memory, _runtime
from ._memory import DTYPES, HBM, ON_CHIP, PSUM_MIN_ALIGN, MemoryRegion, NkiTensor
from ._runtime import (PARTITIONS, PSUM_BANK_BYTES, NkiValidationError, current, nki_since, nki_version,
                       no_reorder_block, psum_num_banks, target)
from ._unemulated import UnemulatedDType, module_getattr, not_emulated

# ---- dtypes and buffers -----------------------------------------------------------------------------

DType = np.dtype  # the type of nl.float32 etc. here (the 0.6 stub declares DType = str; both only name dtypes)

bool_ = DTYPES["bool_"]
int8, int16, int32 = DTYPES["int8"], DTYPES["int16"], DTYPES["int32"]
uint8, uint16, uint32 = DTYPES["uint8"], DTYPES["uint16"], DTYPES["uint32"]
float16, float32, bfloat16 = DTYPES["float16"], DTYPES["float32"], DTYPES["bfloat16"]
float8_e4m3, float8_e4m3fn, float8_e5m2 = DTYPES["float8_e4m3"], DTYPES["float8_e4m3fn"], DTYPES["float8_e5m2"]

sbuf = MemoryRegion.sbuf
psum = MemoryRegion.psum
private_hbm = MemoryRegion.private_hbm
shared_hbm = MemoryRegion.shared_hbm
hbm = private_hbm


def is_hbm(buffer):
    return buffer in HBM


def is_on_chip(buffer):
    return buffer in ON_CHIP


def is_psum(buffer):
    return buffer is psum


def is_sbuf(buffer):
    return buffer is sbuf


class NKIObject:
    """Base class of kernel-side classes. As the NKI front end builds them (leanprover/KLR
    interop/klr/gather.c ``class``, l. 1570-1610, and KLR/NKI/Classes.lean ``genInitStandard``,
    l. 85-117), with or without ``@dataclass``, a class's fields are the names it assigns in its own
    body, annotated (``x: int = 1``, ``x: int``) or plain (``x = None``, as aws-neuron/nki-library's
    attention_cte.py ``AttnInternalBuffers`` and ``SectionParams`` declare theirs), in body order;
    such a class gets an ``__init__`` taking them positionally or by keyword, each defaulting to its
    class-level value or None, and calling ``__post_init__`` if the class has one; a class that writes
    its own ``__init__`` keeps it. Methods are not fields. The base takes keyword arguments only and
    sets them as attributes (the 0.6 stub's ``NKIObject.__init__(self, **kwargs)``)."""

    def __init__(self, **kwargs):
        for name, value in kwargs.items():
            setattr(self, name, value)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            return
        fields = _class_fields(cls)

        def __init__(self, *args, **kwargs):
            if len(args) > len(fields):
                raise TypeError(f"{cls.__name__}() takes {len(fields)} fields ({', '.join(fields)}), got {len(args)}")
            unknown = set(kwargs) - set(fields)
            if unknown:
                raise TypeError(f"{cls.__name__}() has no fields {sorted(unknown)}; its fields: {fields}")
            values = dict(zip(fields, args))
            for name in fields:
                if name in kwargs:
                    if name in values:
                        raise TypeError(f"{cls.__name__}() got field {name!r} twice")
                    values[name] = kwargs[name]
                # object.__setattr__: a @dataclass(frozen=True) class builds this way too (nki-library's
                # rmsnorm_quant.py, mlp_cte_tile_info.py declare their NKIObject parameter classes frozen)
                object.__setattr__(self, name, values.get(name, getattr(cls, name, None)))
            post_init = getattr(self, "__post_init__", None)
            if post_init is not None:
                post_init()

        __init__.__qualname__ = f"{cls.__qualname__}.__init__"
        cls.__init__ = __init__


def _class_fields(cls):
    """The names the class's own body assigns, in order, as gather.c's ``class`` reads them (it does not
    follow base classes): ``x = ...``, ``x: T = ...`` and ``x: T``. Without source to read: its
    annotations, then its other attributes that are not functions or descriptors."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    except (OSError, TypeError, SyntaxError, IndexError):
        names = list(cls.__dict__.get("__annotations__", {}))
        names += [name for name, value in cls.__dict__.items()
                  if not isinstance(value, (types.FunctionType, property, classmethod, staticmethod))]
    else:
        names = []
        for statement in body:
            targets = statement.targets if isinstance(statement, ast.Assign) else \
                [statement.target] if isinstance(statement, ast.AnnAssign) else []
            names += [target.id for target in targets if isinstance(target, ast.Name)]
    fields = []
    for name in names:
        if not name.startswith("__") and name not in fields:
            fields.append(name)
    return fields


class _TileSize:
    """Hardware tile-size constants (``nl.tile_size``); the SBUF ones follow the selected target."""

    pmax = PARTITIONS  # partitions of SBUF/PSUM
    psum_bank_fmax = PSUM_BANK_BYTES // 4  # fp32 elements in one PSUM bank row
    psum_fmax = psum_bank_fmax  # deprecated name of psum_bank_fmax
    psum_bank_fmax_bytes = PSUM_BANK_BYTES
    psum_num_banks = property(lambda self: psum_num_banks())
    # byte alignment of a free-dimension address: the NKI front end's constants (leanprover/KLR KLR/Trace.lean l. 48-49)
    psum_min_align = PSUM_MIN_ALIGN
    sbuf_min_align = 1
    gemm_stationary_fmax = 128  # nc_matmul stationary free size (M)
    gemm_moving_fmax = 512  # nc_matmul moving free size (N)
    bn_stats_fmax = 512

    # sbuf_fmax_bytes and total_available_sbuf_size: the usable SBUF per partition (aws-neuron-sdk 3afa0fdf
    # nki/api/nki.language.tile_size.rst l. 40-74); sbuf_size_bytes: the whole SBUF, all partitions
    sbuf_fmax_bytes = property(lambda self: target().sbuf_usable_bytes)
    sbuf_fmax = property(lambda self: target().sbuf_usable_bytes // 4)
    sbuf_size_bytes = property(lambda self: target().sbuf_partition_bytes * PARTITIONS)
    total_available_sbuf_size = sbuf_fmax_bytes


tile_size = _TileSize()

# ---- tensors, slices, loops, SPMD ---------------------------------------------------------------------


def ndarray(shape, dtype, buffer=sbuf, name="", address=None):
    """Allocate an uninitialised tensor (filled with NaN, integers with 4: never-written memory is poison).
    ``address``: ``(partition_offset, free_offset)`` of an on-chip tile, checked and kept (see _memory.allocate)."""
    return _memory.allocate(shape, dtype, buffer, name, address=address)


def zeros(shape, dtype, buffer=sbuf, name=""):
    return full(shape, 0, dtype, buffer, name)


def ones(shape, dtype, buffer=sbuf, name=""):
    return full(shape, 1, dtype, buffer, name)


def full(shape, fill_value, dtype, buffer=sbuf, name=""):
    """Allocate and fill: on chip with a ``nisa.memset``; in HBM the data is simply set up."""
    t = _memory.allocate(shape, dtype, buffer, name, what="full")
    if buffer in ON_CHIP:
        isa.memset(t, fill_value)
    else:
        _memory.write(t, np.full(t.shape, fill_value))
    return t


def shared_identity_matrix(n, dtype=uint8, dst=None):
    """An (n, n) identity matrix in SBUF of ``dtype`` (aws-neuron-sdk 3afa0fdf nki/api/nki/language/__init__.py
    l. 2061-2083): "the same behavior to nki.language.shared_constant", a constant the compiler places, here
    loaded into a new SBUF tile (or into ``dst``, an (n, n) SBUF tile) by one DMA from HBM."""
    if dst is None:
        dst = _memory.allocate((n, n), dtype, sbuf, "identity", what="shared_identity_matrix")
    elif dst.buffer is not sbuf or dst.shape != (n, n):
        raise NkiValidationError(f"shared_identity_matrix: dst must be an ({n}, {n}) SBUF tile, got {dst!r}")
    core = _runtime.begin("shared_identity_matrix")
    _memory.operand(core, "shared_identity_matrix", "dst", dst, (sbuf,), "the identity matrix is made in SBUF")
    _memory.write(dst, np.eye(n))
    _runtime.count_dma(dst.size * dst.dtype.itemsize)
    _runtime.count("shared_identity_matrix", "dma", n, n, dst)
    return dst


def ds(start, size):
    """``nl.ds(start, size)``: the slice ``start:start+size``."""
    return slice(start, start + size)


def affine_range(start, stop=None, step=1):
    """Alias of ``range``: every NKI loop is unrolled at trace time."""
    return range(start) if stop is None else range(start, stop, step)


sequential_range = static_range = affine_range


def program_id(axis=0):
    """Which core of the logical NeuronCore runs this program: 0, or 1 under ``kernel[2]``."""
    if axis != 0:
        raise NkiValidationError(f"program_id: the launch grid has one axis (the LNC degree), got axis={axis}")
    return current("program_id").program_id


def num_programs(axes=0):
    return current("num_programs").num_programs


def program_ndim():
    return 1 if current("program_ndim").grid else 0


def device_print(print_prefix, tensor):
    """Print a tensor's values now (on hardware: at run time, through the runtime's debug stream)."""
    current("device_print")
    print(print_prefix, _memory.read("device_print", "tensor", tensor))


# ---- operators --------------------------------------------------------------------------------------
# float32 numpy implementations, keyed by the nl function that names them. The ALU operators are the ISA's operator
# table (aws-neuron-sdk 3afa0fdf nki/api/nki.api.shared.rst l. 50-127, "Supported Math Operators for NKI ISA", the
# same in NKI 0.6 at a3247f5b); its bitvec and logical rows are not emulated (NotImplementedError).
# The activation functions are its activation table (l. 129-200, "Supported Activation Functions for NKI ISA").

ALU_BINARY = {}  # binary ALU operators (tensor_tensor, tensor_scalar, scalar_tensor_tensor, nl.add, ...)
ALU_UNARY = {}  # unary ALU operators, usable as tensor_scalar's op with operand 0
ACTIVATIONS = {}  # ScalarE activation functions (nisa.activation op)
COMPARISONS = {}  # comparison operators (affine_select cmp_op); they yield 1.0 / 0.0
REDUCTIONS = {}  # the table's "Legal Reduction op" = Y rows that the emulator computes -> numpy reduction
ACTIVATION_RANGES = {}  # activation -> valid input range (lo, hi) of ScalarE's approximation (|x| for reciprocal)
NOT_ON_HARDWARE = {}  # nl functions with no ISA operator behind them -> why (the release notes' known issues)


def _binary(name, fn, doc):
    def op(x, y, dtype=None):
        return _elementwise(op, x, y, dtype)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"{doc}, elementwise (VectorE: tensor_tensor, or tensor_scalar with a scalar/column operand)."
    ALU_BINARY[op] = fn
    return op


def _comparison(name, fn, sign):
    """A comparison yields NaN where an operand is NaN, so that poison (memory never written) is not laundered into
    0.0: in AWS's simulator "any operation involving NaN produces NaN" (aws-neuron-sdk 3afa0fdf
    nki/guides/nki_simulator.rst l. 217-218)."""
    def compare(x, y):
        return np.where(np.isnan(x) | np.isnan(y), np.float32(np.nan), fn(x, y).astype(np.float32))

    op = _binary(name, compare, f"1.0 where x {sign} y else 0.0 (NaN where either is NaN)")
    COMPARISONS[op] = ALU_BINARY[op]
    return op


add = _binary("add", np.add, "x + y")
subtract = _binary("subtract", np.subtract, "x - y")
multiply = _binary("multiply", np.multiply, "x * y")
maximum = _binary("maximum", np.maximum, "max(x, y)")
minimum = _binary("minimum", np.minimum, "min(x, y)")
power = _binary("power", np.power, "x ** y")
# Compared by magnitude, the signed value kept (nl stub l. 380-466 at 3afa0fdf); ALU operators on trn3 only
# (NKI 0.4.0 release notes, release-notes/components/nki.rst l. 23), checked where an instruction takes them.
abs_max = _binary("abs_max", lambda x, y: np.where(np.abs(x) > np.abs(y), x, y), "x if |x| > |y| else y")
abs_min = _binary("abs_min", lambda x, y: np.where(np.abs(x) < np.abs(y), x, y), "x if |x| < |y| else y")
TRN3_ONLY = (abs_max, abs_min)
equal = _comparison("equal", np.equal, "==")
not_equal = _comparison("not_equal", np.not_equal, "!=")
greater = _comparison("greater", np.greater, ">")
greater_equal = _comparison("greater_equal", np.greater_equal, ">=")
less = _comparison("less", np.less, "<")
less_equal = _comparison("less_equal", np.less_equal, "<=")

REDUCTIONS.update({add: np.sum, multiply: np.prod, maximum: np.max, minimum: np.min})
REDUCTION_NOT_EMULATED = (subtract,)  # legal reduction op ("Y", shared.rst l. 84) whose reduction order is undocumented


def _not_on_hardware(name, why):
    """An nl function the hardware has no instruction for: calling it, or naming it as an instruction's ``op``,
    raises NkiValidationError with the release notes' words."""

    def op(x, y, dtype=None):
        raise NkiValidationError(f"nl.{name}: {why}")

    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"nl.{name}: refused, {why}"
    NOT_ON_HARDWARE[op] = why
    return op


# aws-neuron-sdk 3afa0fdf release-notes/components/nki.rst l. 122 and 124, NKI 0.4.0 known issues (also 0.3.0,
# l. 254-256, and 0.6.0 at a3247f5b); nor does the operator table (shared.rst l. 50-127) list either operation.
_NO_DIVISION = ("not supported: 'Division is not available as a hardware instruction' and the ISA's operator table "
                "has no division (aws-neuron-sdk release-notes/components/nki.rst, NKI 0.3-0.6 known issues; "
                "nki/api/nki.api.shared.rst, Supported Math Operators). Multiply by a reciprocal: nisa.reciprocal, "
                "or nisa.activation(op=nl.reciprocal), then nl.multiply")
_NO_MODULO = ("not supported: 'Modulo operations are not available as hardware instructions. These APIs work in "
              "simulation but fail when compiled for Trainium hardware' (aws-neuron-sdk release-notes/components/"
              "nki.rst, NKI 0.3-0.6 known issues); the ISA's operator table has no modulo")
divide = _not_on_hardware("divide", _NO_DIVISION)
mod = _not_on_hardware("mod", _NO_MODULO)
fmod = _not_on_hardware("fmod", _NO_MODULO)


def _erf(x):
    """erf to ~1e-7 (Abramowitz & Stegun 7.1.26); numpy has none and ScalarE approximates it too."""
    t = 1.0 / (1.0 + 0.3275911 * np.abs(x))
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return np.sign(x) * (1.0 - poly * np.exp(-x * x))


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _gelu_apprx_sigmoid_dx(x):
    s = _sigmoid(1.702 * x)
    return s + 1.702 * x * s * (1.0 - s)


def _silu_dx(x):
    s = _sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


def _unary(name, fn, valid=None):
    """An activation function: ``op=nl.<name>`` in nisa.activation, or ``nl.<name>(x)`` as a helper.
    ``valid``: the input range of ScalarE's approximation; outside it hardware gives invalid results,
    and the emulator returns NaN there."""

    def op(x, dtype=None):
        return _apply_unary(op, x, dtype)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"{name}(x), elementwise, into a new SBUF tile."
    ACTIVATIONS[op] = fn
    if valid is not None:
        ACTIVATION_RANGES[op] = valid
    return op


exp = _unary("exp", np.exp)
log = _unary("log", np.log, (2.0 ** -64, 2.0 ** 64))
sqrt = _unary("sqrt", np.sqrt, (2.0 ** -116, 2.0 ** 118))
rsqrt = _unary("rsqrt", lambda x: 1.0 / np.sqrt(x), (2.0 ** -87, 2.0 ** 97))
reciprocal = _unary("reciprocal", lambda x: 1.0 / x, (2.0 ** -42, 2.0 ** 42))
tanh = _unary("tanh", np.tanh)
sigmoid = _unary("sigmoid", _sigmoid)
relu = _unary("relu", lambda x: np.maximum(x, 0.0))
gelu = _unary("gelu", lambda x: 0.5 * x * (1.0 + _erf(x * 0.7071067811865476)))
gelu_dx = _unary("gelu_dx", lambda x: 0.5 * (1.0 + _erf(x * 0.7071067811865476))
                 + x * np.exp(-0.5 * x * x) * 0.3989422804014327)
gelu_apprx_tanh = _unary("gelu_apprx_tanh",
                         lambda x: 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))))
gelu_apprx_sigmoid = _unary("gelu_apprx_sigmoid", lambda x: x * _sigmoid(1.702 * x))
gelu_apprx_sigmoid_dx = _unary("gelu_apprx_sigmoid_dx", _gelu_apprx_sigmoid_dx)
silu = _unary("silu", lambda x: x * _sigmoid(x))
silu_dx = _unary("silu_dx", _silu_dx)
softplus = _unary("softplus", lambda x: np.logaddexp(0.0, x))
mish = _unary("mish", lambda x: x * np.tanh(np.logaddexp(0.0, x)))
erf = _unary("erf", _erf)
erf_dx = _unary("erf_dx", lambda x: 1.1283791670955126 * np.exp(-x * x))
sin = _unary("sin", np.sin, (-math.pi, math.pi))
arctan = _unary("arctan", np.arctan, (-math.pi / 2, math.pi / 2))
sign = _unary("sign", np.sign)
abs = _unary("abs", np.abs)
square = _unary("square", np.square)

ALU_UNARY.update({op: ACTIVATIONS[op] for op in (abs, square, relu, rsqrt, reciprocal)})


def copy(x, dtype=None):
    """A copy of an SBUF or PSUM tile. NKI 0.4 and 0.5: on ScalarE (activation with op=nl.copy, through fp32) into
    the buffer ``x`` is in (aws-neuron-sdk 3afa0fdf nki/api/nki/language/__init__.py l. 1020-1033; release notes
    l. 136: cross-buffer copies are not supported). NKI 0.6: on VectorE (tensor_copy, bit-accurate when the dtype is
    kept) into SBUF (a3247f5b release-notes/components/nki.rst l. 43-45). As an activation ``op``, ``nl.copy`` is
    the identity."""
    if nki_since("0.6"):
        dst = _new_tile(x.shape, dtype or x.dtype)
        isa.tensor_copy(dst, x)
    else:
        dst = _new_tile(x.shape, dtype or x.dtype, x.buffer)
        isa.activation(dst, copy, x)
    return dst


ACTIVATIONS[copy] = lambda x: x

# ---- value-returning helpers --------------------------------------------------------------------------


def _new_tile(shape, dtype, buffer=sbuf):
    return _memory.allocate(shape, dtype, buffer, "")


def _elementwise(op, x, y, dtype):
    """``x op y``: two tiles of one shape -> tensor_tensor; a tile and a scalar -> tensor_scalar. The nl wrappers
    do not broadcast one tile against another, and nl.power takes no scalar exponent (aws-neuron-sdk 3afa0fdf
    release-notes/components/nki.rst l. 126-128, NKI 0.4.0 known issues; the same in 0.3 and 0.6)."""
    if isinstance(x, NkiTensor) and isinstance(y, NkiTensor):
        if x.shape != y.shape:
            raise NkiValidationError(f"nl.{op.__name__}: shapes {x.shape} and {y.shape} differ; 'Binary operations do "
                                     "not support broadcasting' (aws-neuron-sdk release-notes/components/nki.rst, NKI "
                                     f"{nki_version()} known issues): use nisa.tensor_scalar with a (P, 1) operand")
        dst = _new_tile(x.shape, dtype or (x.dtype if x.dtype == y.dtype else float32))
        isa.tensor_tensor(dst, x, y, op)
        return dst
    if not isinstance(x, NkiTensor) and not isinstance(y, NkiTensor):
        raise NkiValidationError(f"nl.{op.__name__}: needs at least one tile operand")
    if op is power:
        raise NkiValidationError(f"nl.power: 'nl.power(tile, scalar) is not supported' (aws-neuron-sdk release-notes/"
                                 f"components/nki.rst, NKI {nki_version()} known issues): pass two tiles")
    data, operand, reverse = (x, y, False) if isinstance(x, NkiTensor) else (y, x, True)
    dst = _new_tile(data.shape, dtype or data.dtype)
    isa.tensor_scalar(dst, data, op, operand, reverse0=reverse)
    return dst


def _apply_unary(op, x, dtype):
    """Activations run on ScalarE; reciprocal on VectorE and rsqrt on GpSimd, as nl does it."""
    dst = _new_tile(x.shape, dtype or x.dtype)
    if op is reciprocal:
        isa.reciprocal(dst, x)
    elif op is rsqrt:
        isa.tensor_scalar(dst, x, rsqrt, 0.0, engine=isa.engine.gpsimd)
    else:
        isa.activation(dst, op, x)
    return dst


def _axes(x, axis):
    return tuple(a % x.ndim for a in ((axis,) if isinstance(axis, int) else axis))


def _reduce(op, x, axis, dtype, keepdims):
    """Free-axis reduction with nisa.tensor_reduce into a new tile (at least (P, 1))."""
    axes = _axes(x, axis)
    shape = [1 if d in axes else n for d, n in enumerate(x.shape) if keepdims or d not in axes]
    dst = _new_tile(shape if len(shape) > 1 else shape + [1], dtype or x.dtype)
    isa.tensor_reduce(dst, op, x, axes, keepdims=keepdims)
    return dst


def sum(x, axis, dtype=None, keepdims=False):
    return _reduce(add, x, axis, dtype, keepdims)


def prod(x, axis, dtype=None, keepdims=False):
    return _reduce(multiply, x, axis, dtype, keepdims)


def max(x, axis, dtype=None, keepdims=False):
    return _reduce(maximum, x, axis, dtype, keepdims)


def min(x, axis, dtype=None, keepdims=False):
    return _reduce(minimum, x, axis, dtype, keepdims)


def mean(x, axis, dtype=None, keepdims=False):
    """Sum in float32 (tensor_reduce), then scale by 1/n (tensor_scalar)."""
    total = _reduce(add, x, axis, float32, keepdims)
    n = int(np.prod([x.shape[d] for d in _axes(x, axis)]))
    dst = _new_tile(total.shape, dtype or x.dtype)
    isa.tensor_scalar(dst, total, multiply, 1.0 / n)
    return dst


def load(src, dtype=None):
    """A new SBUF tile holding an HBM tensor (one dma_copy; the DMA converts dtype)."""
    dst = _new_tile(src.shape, dtype or src.dtype)
    isa.dma_copy(dst, src)
    return dst


def store(dst, value):
    """Write an SBUF tile to HBM (one dma_copy; PSUM tiles must be copied to SBUF first)."""
    isa.dma_copy(dst, value)


def transpose(x, dtype=None):
    """Swap the partition and free axes of a 2-D tile on TensorE; the result is in PSUM."""
    result = _new_tile((x.size // x.shape[0], x.shape[0]), x.dtype, psum)
    isa.nc_transpose(result, x)
    if dtype is None or _memory.as_dtype(dtype) == x.dtype:
        return result
    cast = _new_tile(result.shape, dtype, psum)
    isa.tensor_copy(cast, result)
    return cast


def broadcast_to(x, shape, dtype=None):
    """``x`` broadcast to ``shape`` by numpy's rules (same rank; each dim equal or from 1) in a new SBUF
    tile (the 0.6 stub; x in SBUF or PSUM; ``x`` itself when nothing changes). How the compiler lowers
    it is not documented; here free dims are broadcast by one VectorE copy of a stride-0 view, and the
    partition dim (from 1) by TensorE: a K=1 matmul of a row of ones with the row, one PSUM bank of
    columns at a time, copied to SBUF."""
    shape = tuple(int(n) for n in shape)
    dtype = _memory.as_dtype(dtype or x.dtype, "broadcast_to")
    if len(shape) != x.ndim or any(n != m and n != 1 for n, m in zip(x.shape, shape)):
        raise NkiValidationError(f"broadcast_to: cannot broadcast {x.shape} to {shape} (same rank, dims equal or 1)")
    if shape == x.shape and dtype == x.dtype:
        return x
    spread = x
    for dim in range(1, x.ndim):
        if x.shape[dim] != shape[dim]:
            spread = spread.broadcast(dim, shape[dim])
    if shape[0] == x.shape[0]:
        dst = _new_tile(shape, dtype)
        isa.tensor_copy(dst, spread)
        return dst
    operand = float32 if dtype == float32 else bfloat16  # TensorE pairs fp32 only with fp32
    row = _new_tile((1,) + shape[1:], operand)
    isa.tensor_copy(row, spread)
    row = row.reshape((1, row.size))
    ones = full((1, shape[0]), 1.0, operand)
    dst = _new_tile(shape, dtype)
    flat = dst.reshape((shape[0], row.size))
    for start in range(0, row.size, tile_size.psum_bank_fmax):
        width = row.size - start if row.size - start < tile_size.psum_bank_fmax else tile_size.psum_bank_fmax
        rows = _new_tile((shape[0], width), float32, psum)
        isa.nc_matmul(rows, ones, row[:, start:start + width], accumulate=False)
        isa.tensor_copy(flat[:, start:start + width], rows)
    return dst


def matmul(x, y, transpose_x=False):
    """``x.T @ y`` into a new float32 PSUM tile: x (K, M) and y (K, N) with the contraction K on partitions. Without
    ``transpose_x=True`` it is refused: "nki.language.matmul without transpose_x=True is not supported" (aws-neuron-sdk
    3afa0fdf release-notes/components/nki.rst l. 134, NKI 0.4.0 known issues; the same in 0.3 and 0.6)."""
    if not transpose_x:
        raise NkiValidationError(f"nl.matmul: without transpose_x=True it is not supported (aws-neuron-sdk release-"
                                 f"notes/components/nki.rst, NKI {nki_version()} known issues): pass x with the "
                                 "contraction dim on partitions and transpose_x=True")
    result = _new_tile((x.size // x.shape[0], y.size // y.shape[0]), float32, psum)
    isa.nc_matmul(result, x, y)
    return result


def no_reorder():
    """``with nl.no_reorder():``: the compiler's scheduler keeps the instructions issued inside the block (however
    deeply called) in program order (aws-neuron-sdk 3afa0fdf nki/guides/how-to-scheduling-apis.rst, "Using
    no_reorder"; the stub, nki/api/nki/language/__init__.py l. 1785-1807). The values are the same; the trace
    records the block (Instruction.no_reorder) for the scheduler (nki_emulator/_schedule.py)."""
    return no_reorder_block()


# ---- the rest of the NKI 0.6 nki.language API: present by name, not emulated -------------------------

bitwise_and = not_emulated("nki.language.bitwise_and", "x y dtype")
bitwise_or = not_emulated("nki.language.bitwise_or", "x y dtype")
bitwise_xor = not_emulated("nki.language.bitwise_xor", "x y dtype")
invert = not_emulated("nki.language.invert", "x dtype")
left_shift = not_emulated("nki.language.left_shift", "x y dtype")
right_shift = not_emulated("nki.language.right_shift", "x y dtype")
logical_and = not_emulated("nki.language.logical_and", "x y dtype")
logical_or = not_emulated("nki.language.logical_or", "x y dtype")
logical_xor = not_emulated("nki.language.logical_xor", "x y dtype")
logical_not = not_emulated("nki.language.logical_not", "x dtype")
cos = not_emulated("nki.language.cos", "x dtype")
tan = not_emulated("nki.language.tan", "x dtype")
ceil = not_emulated("nki.language.ceil", "x dtype")
floor = not_emulated("nki.language.floor", "x dtype")
trunc = not_emulated("nki.language.trunc", "x dtype")
negative = not_emulated("nki.language.negative", "x dtype")
var = not_emulated("nki.language.var", "x axis dtype keepdims")
all = not_emulated("nki.language.all", "x axis dtype")
softmax = not_emulated("nki.language.softmax", "x axis dtype")
rms_norm = not_emulated("nki.language.rms_norm", "x w axis n epsilon dtype compute_dtype")
where = not_emulated("nki.language.where", "condition x y dtype")
dropout = not_emulated("nki.language.dropout", "x rate dtype")
zeros_like = not_emulated("nki.language.zeros_like", "x dtype buffer name")
empty_like = not_emulated("nki.language.empty_like", "x dtype buffer name")
random_seed = not_emulated("nki.language.random_seed", "seed")
expand_dims = not_emulated("nki.language.expand_dims", "x axis")
load_transpose2d = not_emulated("nki.language.load_transpose2d", "src dtype")
gather_flattened = not_emulated("nki.language.gather_flattened", "data indices axis dtype")
dynamic_range = not_emulated("nki.language.dynamic_range", "start stop step")
fori_loop = not_emulated("nki.language.fori_loop", "lower upper body_fun step")
while_loop = not_emulated("nki.language.while_loop", "init body_fun")
shared_constant = not_emulated("nki.language.shared_constant", "constant")
rand = not_emulated("nki.language.rand", "shape dtype buffer name")

# dtypes without a numpy counterpart here: names to compare with, not to allocate
tfloat32, float8_e8m0fnu = UnemulatedDType("tfloat32"), UnemulatedDType("float8_e8m0fnu")
float8_e5m2_x4, float8_e4m3fn_x4 = UnemulatedDType("float8_e5m2_x4"), UnemulatedDType("float8_e4m3fn_x4")
float4_e2m1fn_x4 = UnemulatedDType("float4_e2m1fn_x4")
# operators the emulator's ALU lacks
__getattr__ = module_getattr("nki.language", ("average", "prelu", "bypass"))


from . import isa  # noqa: E402 -- last: nki.isa reads the operator functions defined above

"""Stands in for ``nki.isa`` (``nisa``): one function per hardware instruction, destination first.

Every instruction follows the same steps, in NKI's semantics:

1. check the operands: the buffers its engine can reach, partition count (<= 128, guaranteed by
   allocation), layouts (same partition count and elements per partition unless stated), dtypes;
2. read the inputs as float32 (never-written memory reads as NaN: poison) -- the engines compute in fp32;
3. compute on whole tiles with numpy;
4. write the destination, rounding to its dtype (bf16/fp16/fp8 via ml_dtypes);
5. count it on its engine.

Engines, as the NKI docs assign them (where an instruction can run on several, ``engine=`` chooses and
the default is the one named here): DMA: dma_copy. TensorE: nc_matmul, nc_transpose (VectorE with
``engine=nisa.vector_engine`` or when dst is not in PSUM). ScalarE: activation, activation_reduce.
VectorE: tensor_copy, memset, tensor_tensor, tensor_scalar, tensor_reduce, scalar_tensor_tensor,
reciprocal, bn_stats, bn_aggr. GpSimd: iota, affine_select; tensor_tensor with ``nl.power`` or with
all-int32/uint32 operands outside PSUM; tensor_scalar / tensor_copy / memset / tensor_tensor when
``engine=nisa.gpsimd_engine``.
"""

import functools
import inspect
import sys
from enum import Enum, IntEnum

import numpy as np

from . import language as nl
from ._memory import (HBM, ON_CHIP, PSUM, SBUF, FP32, NkiTensor, check_indirect, check_written, copy_bits, operand,
                      poison, read, write)
from ._runtime import (NkiValidationError, PARTITIONS, begin, count, count_dma, count_matmul, count_transpose, labelled,
                       nki_since, nki_version, target)
from ._unemulated import not_emulated


class engine(Enum):
    """Neuron Device engines."""

    unknown = 0
    tensor = 1
    scalar = 2
    gpsimd = 3
    dma = 4
    vector = 5
    sync = 6


tensor_engine, vector_engine, scalar_engine = engine.tensor, engine.vector, engine.scalar
gpsimd_engine, unknown_engine = engine.gpsimd, engine.unknown


class reduce_cmd(Enum):
    """ScalarE accumulation-register commands (nisa.activation)."""

    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(Enum):
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


constants = sys.modules[__name__]  # ``from nki.isa import constants``: the enums above (see nki_emulator.install)
_DGE = dge_mode  # the enum, under a name that the dge_mode arguments of the DMA instructions do not hide


class oob_mode(Enum):
    error = 0
    skip = 1


_OOB = oob_mode  # the enum, under a name that the oob_mode arguments of the DMA instructions do not hide


class matmul_perf_mode(Enum):
    none = 0
    double_row = 1


class dma_engine(Enum):
    """DMA queues a transfer can use (not modelled: every DMA is one ``dma`` instruction here)."""

    dma = 0
    gpsimd_dma = 1


_DMA_ENGINES = dma_engine  # the enum, under a name that sendrecv's dma_engine argument does not hide


class nc_version(IntEnum):
    """Ordered and comparable with ints, as nki-library compares it (``get_nc_version() >= nc_version.gen3``
    in attention_cte.py, mlp_cte_constants.py; ``>= 3`` in experimental/collectives/fgcc.py)."""

    gen2 = 2  # Trn1
    gen3 = 3  # Trn2
    gen4 = 4  # Trn3


def get_nc_version():
    """The NeuronCore version of the selected target (``nki_emulator.set_target``)."""
    return nc_version[target().nc_version]


# Which buffers each compute engine can reach, and why not the others.
_REACH = {
    "vector": (ON_CHIP, "VectorE reads and writes only SBUF and PSUM"),
    "scalar": (ON_CHIP, "ScalarE reads and writes only SBUF and PSUM"),
    "gpsimd": ((SBUF,), "GpSimd can access only SBUF (not PSUM)"),
}
_ENGINE_NAMES = {engine.tensor: "tensor", engine.vector: "vector", engine.scalar: "scalar", engine.gpsimd: "gpsimd"}


def _layout(t):
    """(partitions, elements per partition): the shape that engines actually see."""
    return t.shape[0], t.size // t.shape[0]


def _same_layout(instr, first, *others):
    """All tensors need the same partitions and elements per partition (free shapes may differ)."""
    (role, t) = first
    for other_role, other in others:
        if _layout(other) != _layout(t):
            raise NkiValidationError(
                f"{instr}: {other_role} is {_layout(other)[0]} partitions x {_layout(other)[1]} elements but "
                f"{role} is {_layout(t)[0]} x {_layout(t)[1]}; shapes must match (partitions x elements per partition)")


def _operands(core, instr, eng, **tensors):
    allowed, why = _REACH[eng]
    for role, t in tensors.items():
        if t is not None:
            operand(core, instr, role, t, allowed, why)


def _pick_engine(instr, requested, allowed, default):
    if requested is engine.unknown:
        return default
    name = _ENGINE_NAMES.get(requested)
    if name not in allowed:
        raise NkiValidationError(f"{instr}: cannot run on engine {requested!r}; allowed: {', '.join(allowed)}")
    return name


def _scalar_or_column(core, instr, role, value, partitions, eng, fp32_only):
    """A compile-time scalar, or a (P, 1) tile that broadcasts along the free axis."""
    if not hasattr(value, "shape"):
        return np.float32(value)
    operand(core, instr, role, value, *_REACH[eng])
    if value.shape[0] != partitions or value.size != partitions:
        raise NkiValidationError(f"{instr}: {role} must be a scalar or a ({partitions}, 1) tile, got {value.shape}")
    if fp32_only and value.dtype != FP32:
        raise NkiValidationError(f"{instr}: {role} tile must be float32, got {value.dtype.name}")
    return read(instr, role, value).reshape(partitions, 1)


def _quiet():
    """Engines produce inf/NaN silently; so does the emulator."""
    return np.errstate(all="ignore")


# ---- data movement ------------------------------------------------------------------------------------

def dma_copy(dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, engine=engine.unknown,
             name=None):
    """DMA ``dst = src`` between HBM and SBUF (or within either). Elements are copied in row-major order
    and only the counts must match; a dtype change goes through float32. PSUM is out of DMA's reach. An
    indirect side (``ap(vector_offset=)``) gathers or scatters rows; ``oob_mode`` refuses an index outside its dim
    or skips its row (see ``_memory.check_indirect``)."""
    dge_mode, oob_mode = _member(_DGE, dge_mode, "dma_copy"), _member(_OOB, oob_mode, "dma_copy")
    _check_dma_options("dma_copy", priority, dge_mode, engine)
    if dge_mode is _DGE.hwdge and dst.dtype != src.dtype:
        # NKI 0.3.0 breaking change: aws-neuron-sdk 3afa0fdf release-notes/components/nki.rst l. 189
        raise NkiValidationError(f"dma_copy: with dge_mode=hwdge src and dst need one dtype (got {src.dtype.name} and "
                                 f"{dst.dtype.name}); reinterpret with .view() or convert on an engine")
    core = begin("dma_copy")
    for role, t in (("dst", dst), ("src", src)):
        operand(core, "dma_copy", role, t, (SBUF,) + HBM,
                "DMA moves data only between HBM and SBUF; copy PSUM to SBUF with nisa.tensor_copy first")
    if dst.size != src.size:
        raise NkiValidationError(f"dma_copy: dst has {dst.size} elements ({dst.shape}), src has {src.size} "
                                 f"({src.shape}); the counts must match")
    for role, t in (("dst", dst), ("src", src)):
        check_indirect("dma_copy", role, t, oob_mode is _OOB.skip)
    for to, values in _row_pairs("dma_copy", dst, src):
        if dst.dtype == src.dtype:
            copy_bits(to, values)
        else:
            write(to, read("dma_copy", "src", values))
    count_dma(dst.size * dst.dtype.itemsize)
    rows = dst if dst.buffer is SBUF or src.buffer is not SBUF else src  # the SBUF side sets the rows
    count("dma_copy", "dma", *_layout(rows), dst, (src,))


def dma_compute(dst, srcs, reduce_op, scales=None, unique_indices=True, oob_mode=oob_mode.error, name=None):
    """Compute in the DMA engines, as the 0.4 stub states it (aws-neuron-sdk 3afa0fdf nki/api/nki/isa/__init__.py
    l. 2238-2318): ``dst = srcs[0] + srcs[1] + ...`` in float32, cast to dst's dtype; ``reduce_op`` nl.add only,
    every scale 1.0 (or None), 1 to 16 sources, all in HBM or SBUF with dst's element count. With an indirect side
    (``ap(vector_offset=)``) it is a read-modify-write, scatter or gather (see ``_check_read_modify_write``)."""
    instr, srcs, oob_mode = "dma_compute", list(srcs), _member(_OOB, oob_mode, "dma_compute")
    if reduce_op is not nl.add:
        raise NkiValidationError(f"{instr}: reduce_op must be nl.add, the only one supported (isa stub 3afa0fdf "
                                 f"l. 2246), got {getattr(reduce_op, '__name__', reduce_op)!r}")
    if not 1 <= len(srcs) <= 16:
        raise NkiValidationError(f"{instr}: takes 1 to 16 source tensors (isa stub 3afa0fdf l. 2289), got {len(srcs)}")
    if scales is not None and (len(scales) != len(srcs) or any(float(scale) != 1.0 for scale in scales)):
        raise NkiValidationError(f"{instr}: scales must be None or one 1.0 per source (\"all values in scales must be "
                                 f"1.0\", isa stub 3afa0fdf l. 2247-2249), got {list(scales)}")
    core = begin(instr)
    roles = [("dst", dst)] + [(f"srcs[{i}]", t) for i, t in enumerate(srcs)]
    for role, t in roles:
        operand(core, instr, role, t, (SBUF,) + HBM, "dma_compute reads and writes HBM or SBUF (isa stub l. 2276)")
        if t.size != dst.size:
            raise NkiValidationError(f"{instr}: {role} has {t.size} elements ({t.shape}), dst has {dst.size} "
                                     f"({dst.shape}); the element counts must match exactly (isa stub l. 2288)")
    if any(t._rows is not None for _, t in roles):
        _check_read_modify_write(dst, srcs, unique_indices)
    for role, t in roles:
        check_indirect(instr, role, t, oob_mode is _OOB.skip)
    total = read(instr, "srcs[0]", srcs[0]).reshape(-1).copy()
    for i, t in enumerate(srcs[1:], 1):
        total += read(instr, f"srcs[{i}]", t).reshape(-1)
    gathered = next((t for t in srcs if t._rows is not None and dst._rows is None), None)
    if gathered is not None and not gathered._rows.in_bounds.all():  # a skipped row leaves its dst row as it was
        total = total.reshape(gathered.shape[0], -1)
        total[~gathered._rows.in_bounds] = read(instr, "dst", dst).reshape(total.shape)[~gathered._rows.in_bounds]
    write(dst, total.reshape(dst.shape))
    count_dma(dst.size * dst.dtype.itemsize)
    rows = dst if dst.buffer is SBUF or all(t.buffer is not SBUF for t in srcs) else \
        next(t for t in srcs if t.buffer is SBUF)
    count(instr, "dma", *_layout(rows), dst, tuple(srcs))


def _same_view(a, b):
    return a._storage is b._storage and a.shape == b.shape and (
        np.array_equal(a._rows.offsets, b._rows.offsets) if a._rows is not None and b._rows is not None else
        a._rows is None and b._rows is None and a._data.strides == b._data.strides
        and a._data.__array_interface__["data"][0] == b._data.__array_interface__["data"][0])


def _check_read_modify_write(dst, srcs, unique_indices):
    """dma_compute with ``vector_offset`` (isa stub 3afa0fdf l. 2254-2274): a scatter RMW, dst an indirect HBM view,
    one source that same view, the other in SBUF; or a gather RMW, dst in SBUF, one source an indirect HBM view,
    the other dst itself. Both: exactly 2 sources, ``unique_indices`` True and the indices indeed unique."""
    where = "isa stub 3afa0fdf l. 2254-2274"
    if len(srcs) != 2 or not unique_indices:
        raise NkiValidationError(f"dma_compute: a read-modify-write through vector_offset needs exactly 2 sources and "
                                 f"unique_indices=True ({where}); got {len(srcs)} sources, unique_indices="
                                 f"{unique_indices}")
    scatter = dst._rows is not None and any(_same_view(t, dst) for t in srcs) and any(t.buffer is SBUF for t in srcs)
    gather = dst.buffer is SBUF and any(_same_view(t, dst) for t in srcs) and \
        any(t._rows is not None and t.buffer in HBM for t in srcs)
    if not (scatter or gather):
        raise NkiValidationError(f"dma_compute: with vector_offset it is either a scatter (dst an indirect HBM view, "
                                 f"one source the same view, the other in SBUF) or a gather (dst in SBUF, one source "
                                 f"dst, the other an indirect HBM view) ({where})")
    indirect = dst if scatter else next(t for t in srcs if t._rows is not None)
    indices = indirect._rows.indices
    if np.unique(indices).size != indices.size:
        raise NkiValidationError(f"dma_compute: vector_offset repeats an index ({sorted(indices.tolist())}); "
                                 f"non-unique indices are not supported yet, unique_indices must be True and hold "
                                 f"({where})")


def _row_pairs(instr, dst, src):
    """The (dst, src) pairs a DMA copies: the whole tensors, or, where src is a gather with rows to skip
    (``oob_mode.skip``), each in-bounds src row with its dst row."""
    rows = src._rows
    if rows is None or rows.in_bounds.all():
        return [(dst, src)]
    if dst.shape[0] != src.shape[0] or dst._rows is not None:
        raise NotImplementedError(f"{instr}: skipping out-of-bounds gathered rows into a dst of another row count or "
                                  f"an indirect dst ({dst.shape} from {src.shape}) is not emulated")
    written = src._written
    whole = (slice(None),) * (dst.ndim - 1)
    return [(dst._view((slice(i, i + 1),) + whole),
             NkiTensor(src._storage, src._data[i:i + 1], None if written is None else written[i:i + 1], None))
            for i in np.flatnonzero(rows.in_bounds)]


def _member(kind, value, instr):
    """An enum argument given as the member or as its value: nki-library passes ``dge_mode=3`` (core/qkv/qkv_tkg.py
    l. 66, ``_DGE_MODE_NONE = 3``), the stub's value of dge_mode.none (its members keep their values, aws-neuron-sdk
    d175686e)."""
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        raise NkiValidationError(f"{instr}: {value!r} is not a nki.isa.{kind.__name__} (one of "
                                 f"{', '.join(f'{m.name}={m.value}' for m in kind)})") from None


def _check_dma_options(instr, priority, mode, dma_engine_choice):
    """dma_copy / dma_transpose parameters (isa stub l. 314-324): priority 0-3 needs NeuronCore-v4 and a DGE; hardware
    DGE needs NeuronCore-v3; ``engine`` (sync or scalar) only with hardware DGE."""
    if priority is not None and (target().nc_version != "gen4" or mode is _DGE.none or priority not in range(4)):
        raise NkiValidationError(f"{instr}: priority (0-3) needs NeuronCore-v4 (trn3) and DGE on; target "
                                 f"{target().name}, dge_mode {mode.name}, priority {priority!r}")
    if mode is _DGE.hwdge and target().nc_version == "gen2":
        raise NkiValidationError(f"{instr}: dge_mode=hwdge needs NeuronCore-v3 or newer, not {target().name}")
    if dma_engine_choice is not engine.unknown and (mode is not _DGE.hwdge
                                                    or dma_engine_choice not in (engine.sync, engine.scalar)):
        raise NkiValidationError(f"{instr}: engine= (nki.isa.engine.sync or .scalar) is only valid with "
                                 "dge_mode=hwdge")


def tensor_copy(dst, src, engine=engine.unknown, name=None):
    """Copy an on-chip tile (e.g. evict PSUM to SBUF), casting to dst's dtype through float32;
    bit-exact when the dtypes match."""
    eng = _pick_engine("tensor_copy", engine, ("vector", "scalar", "gpsimd"), "vector")
    if eng == "scalar" and target().nc_version == "gen2":
        raise NkiValidationError("tensor_copy: ScalarE copy is not supported on trn1; use nisa.activation "
                                 "with op=nl.copy")
    core = begin("tensor_copy")
    _operands(core, "tensor_copy", eng, dst=dst, src=src)
    _same_layout("tensor_copy", ("src", src), ("dst", dst))
    if dst.dtype == src.dtype:
        copy_bits(dst, src)
    else:
        write(dst, read("tensor_copy", "src", src))
    count("tensor_copy", eng, *_layout(dst), dst, (src,))


def memset(dst, value, engine=engine.unknown, name=None):
    """Fill a tile with a constant (VectorE by default, or GpSimd)."""
    if hasattr(value, "shape"):  # "a compile-time constant value": isa stub l. 355
        raise NkiValidationError("memset: value must be a compile-time constant number, not a tile")
    eng = _pick_engine("memset", engine, ("vector", "gpsimd"), "vector")
    core = begin("memset")
    _operands(core, "memset", eng, dst=dst)
    write(dst, np.full(dst.shape, value))
    count("memset", eng, *_layout(dst), dst, ops=("zero",) if value == 0 else ())


# ---- TensorE --------------------------------------------------------------------------------------------

_MATMUL_INPUTS = ("float8_e4m3", "float8_e5m2", "bfloat16", "float16", "float32")


def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
              accumulate=None, tile_position=(), tile_size=(), perf_mode=matmul_perf_mode.none, name=None):
    """``dst[M, N] (PSUM) = / += stationary[K, M].T @ moving[K, N]`` on the 128x128 systolic array.

    K is the partition dim of both operands (<= 128), M the stationary's free size (<= 128; it becomes
    dst's partition dim), N the moving's free size (one PSUM bank row: <= 512 fp32 on trn1/trn2).
    Products accumulate in fp32. ``accumulate=None``: per PSUM element, the first matmul write
    overwrites and later ones add (an accumulation group); True/False force add/overwrite. The
    per-element record lasts as long as the tile, so a reused PSUM tile keeps adding: start a new
    group with a fresh tile or ``accumulate=False``.
    Inputs: fp8/bf16/fp16/fp32, fp32 only together with fp32; dst fp32 (bf16 allowed on trn3).
    """
    core = begin("nc_matmul")
    operand(core, "nc_matmul", "dst", dst, (PSUM,), "TensorE writes its result only to PSUM")
    for role, t in (("stationary", stationary), ("moving", moving)):
        operand(core, "nc_matmul", role, t, (SBUF,), "TensorE reads its operands only from SBUF")
    if perf_mode is not matmul_perf_mode.none:
        raise NkiValidationError("nc_matmul: perf_mode=double_row is not emulated")
    if bool(tile_position) != bool(tile_size):
        raise NkiValidationError("nc_matmul: tile_position and tile_size must be set together")
    rows, columns = tile_size or (PARTITIONS, PARTITIONS)
    if tile_size:
        _check_matmul_tiling(tile_position, tile_size)
    (k, m), (k_moving, n) = _layout(stationary), _layout(moving)
    n_max = target().psum_tile_bytes // dst.dtype.itemsize
    if k != k_moving:
        raise NkiValidationError(f"nc_matmul: stationary has {k} partitions and moving {k_moving}; the "
                                 "contraction dim K is the partition dim of both and must match")
    if k > rows:
        raise NkiValidationError(f"nc_matmul: contraction dim K={k} exceeds {rows} (PE array rows)")
    if m > columns:
        raise NkiValidationError(f"nc_matmul: stationary free size M={m} exceeds {columns} "
                                 "(nl.tile_size.gemm_stationary_fmax)")
    if n > n_max:
        raise NkiValidationError(f"nc_matmul: moving free size N={n} exceeds {n_max} on {target().name} "
                                 "(nl.tile_size.gemm_moving_fmax: one PSUM bank row)")
    _check_matmul_dtypes(dst, stationary, moving)
    if _layout(dst) != (m, n):
        raise NkiValidationError(f"nc_matmul: dst is {_layout(dst)[0]} partitions x {_layout(dst)[1]} elements; "
                                 f"stationary.T @ moving is {m} x {n}")
    with _quiet():  # poison (NaN) in an operand
        result = read("nc_matmul", "stationary", stationary).reshape(k, m).T \
            @ read("nc_matmul", "moving", moving).reshape(k, n)
    result, adds = _accumulated(dst, result.reshape(dst.shape), accumulate)
    write(dst, result)
    dst._matmul_written[...] = True
    wider = max(stationary.dtype, moving.dtype, key=lambda d: d.itemsize)
    count_matmul(k, m, n, wider.name)
    count("nc_matmul", "tensor", k, n, dst, (stationary, moving), stationary=m, accumulate=adds)


def _accumulated(dst, result, accumulate):
    """A matmul's ``result`` combined with what its PSUM ``dst`` holds, and whether it added: accumulate=None adds
    where an element is inside a running accumulation group (a matmul wrote it before), True always adds, False
    overwrites."""
    if accumulate is None:
        started = dst._matmul_written
        if started.all():
            return result + np.asarray(dst._data, np.float32), True
        if started.any():
            return np.where(started, result + np.asarray(dst._data, np.float32), result), True
        return result, False
    if accumulate:
        return result + read("nc_matmul", "dst (accumulate=True)", dst), True
    return result, False


def _check_matmul_tiling(tile_position, tile_size):
    """Tensor Engine tiling (isa stub, aws-neuron-sdk 3afa0fdf nki/api/nki/isa/__init__.py l. 418-437): rows and
    columns each split into 2x 64 (NeuronCore-v2 on) or 4x 32 (v3 on); a tile starts at a multiple of its size inside
    the 128x128 array. Column tiling is used by nki-library's qkv_tkg.py, so the param line's "start_column must be
    0" (l. 550) is not enforced."""
    sizes = (128, 64) if target().nc_version == "gen2" else (128, 64, 32)
    for what, size, start in zip(("row", "column"), tile_size, tile_position):
        if size not in sizes:
            raise NkiValidationError(f"nc_matmul: tile_size {what} size {size} is not one of {sizes} on "
                                     f"{target().name} (32 needs NeuronCore-v3 or newer)")
        if start % size or not 0 <= start < PARTITIONS:
            raise NkiValidationError(f"nc_matmul: tile_position start_{what} {start} must be a multiple of the "
                                     f"{what} size {size} below {PARTITIONS}")


def _check_matmul_dtypes(dst, stationary, moving):
    allowed = _MATMUL_INPUTS + (("float8_e4m3fn",) if target().nc_version == "gen4" else ())
    for role, t in (("stationary", stationary), ("moving", moving)):
        if t.dtype.name not in allowed:
            raise NkiValidationError(f"nc_matmul: {role} dtype {t.dtype.name} is not a TensorE input dtype on "
                                     f"{target().name} ({', '.join(allowed)})")
    if {stationary.dtype.name, moving.dtype.name} == {"float8_e4m3", "float8_e4m3fn"}:  # isa stub l. 472
        raise NkiValidationError("nc_matmul: float8_e4m3 (legacy) and float8_e4m3fn (OCP) cannot be mixed in one "
                                 "matmul")
    if (stationary.dtype == FP32) != (moving.dtype == FP32):
        raise NkiValidationError(f"nc_matmul: a float32 operand needs a float32 partner, got stationary "
                                 f"{stationary.dtype.name} and moving {moving.dtype.name}")
    if dst.dtype.name not in target().matmul_dst_dtypes:
        raise NkiValidationError(f"nc_matmul: dst dtype must be {' or '.join(target().matmul_dst_dtypes)} on "
                                 f"{target().name} (PSUM accumulation), got {dst.dtype.name}")


def nc_transpose(dst, data, engine=engine.unknown, name=None):
    """Swap partition and free axes (free axes flattened): dst[f, p] = data[p, f], bit-exact.

    TensorE (a matmul with an identity): data in SBUF up to 128x128, dst in PSUM. VectorE: up to
    32x32, SBUF or PSUM. dst has data's dtype. Default: TensorE when dst is in PSUM, else VectorE.
    """
    default = "tensor" if getattr(dst, "buffer", None) is PSUM else "vector"
    eng = _pick_engine("nc_transpose", engine, ("tensor", "vector"), default)
    core = begin("nc_transpose")
    if eng == "tensor":
        operand(core, "nc_transpose", "data", data, (SBUF,), "TensorE reads only SBUF")
        operand(core, "nc_transpose", "dst", dst, (PSUM,), "TensorE writes only PSUM")
        limit = PARTITIONS
    else:
        _operands(core, "nc_transpose", "vector", dst=dst, data=data)
        limit = 32
    p, f = _layout(data)
    if p > limit or f > limit:
        raise NkiValidationError(f"nc_transpose: {eng} engine transposes at most {limit}x{limit}, got {p}x{f}")
    if _layout(dst) != (f, p):
        raise NkiValidationError(f"nc_transpose: dst must be {f} partitions x {p} elements, got "
                                 f"{_layout(dst)[0]} x {_layout(dst)[1]}")
    if dst.dtype != data.dtype:
        raise NkiValidationError(f"nc_transpose: dst dtype {dst.dtype.name} must equal data dtype {data.dtype.name}")
    copy_bits(dst, data, lambda a: np.reshape(a, (p, f)).T)
    if eng == "tensor":
        count_transpose(p, f, data.dtype.name)
    count("nc_transpose", eng, p, f, dst, (data,))


# ---- ScalarE --------------------------------------------------------------------------------------------

def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=reduce_cmd.idle,
               name=None):
    """``dst = op(data * scale + bias)`` on ScalarE, in fp32. ``op``: a function of the activation table;
    ``scale``: scalar or float32 (P, 1) tile; ``bias``: (P, 1) tile of any dtype, or a scalar from trn2 on. The
    engine's 128 per-lane registers can reduce the activated values along the free axis, under ``reduce_cmd``
    (reset zeroes them, reduce combines this instruction's row results with them, reset_reduce does both);
    ``reduce_res`` (P, 1) receives the registers. ``reduce_op`` must be nl.add (isa stub l. 1076)."""
    _activation("activation", dst, op, data, bias, scale, reduce_op, reduce_res, reduce_cmd, (nl.add,))


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    """``activation`` plus a free-axis reduction of its result into ``reduce_res`` (P, 1): activation with
    ``reduce_cmd=reset_reduce``. ``reduce_op``: a legal reduction op, only nl.add on trn1 (isa stub l. 1173). The
    registers are first reset to zero (l. 1177), so nl.maximum yields max(0, row max) and nl.minimum min(0, row
    min), as the emulator computes. ``reduce_res=None`` keeps the result in the registers from NKI 0.6 on."""
    if reduce_res is None and not nki_since("0.6"):
        raise NkiValidationError(f"activation_reduce: reduce_res is required in NKI {nki_version()} (aws-neuron-sdk "
                                 "3afa0fdf nki/api/nki/isa/__init__.py l. 1158; None is accepted from NKI 0.6)")
    allowed = (nl.add,) if target().nc_version == "gen2" else None
    _activation("activation_reduce", dst, op, data, bias, scale, reduce_op, reduce_res, reduce_cmd.reset_reduce,
                allowed)


_ACTIVATION_TABLE = "aws-neuron-sdk nki/api/nki.api.shared.rst l. 129-200, Supported Activation Functions for NKI ISA"


def _activation(instr, dst, op, data, bias, scale, reduce_op, reduce_res, command, reduce_ops):
    if op not in nl.ACTIVATIONS:
        name = getattr(op, "__name__", repr(op))
        raise NkiValidationError(f"{instr}: op={name} is not a function of the activation table ({_ACTIVATION_TABLE}); "
                                 "e.g. nl.exp, nl.copy, nl.square, nl.tanh")
    if reduce_op is not None:
        _check_reduce_op(instr, "reduce_op", reduce_op, reduce_ops)
    if bias is not None and target().nc_version == "gen2":
        if not hasattr(bias, "shape"):  # isa stub l. 1134
            raise NkiValidationError(f"{instr}: bias must be a (P, 1) tile on trn1 (scalar bias needs trn2 or newer)")
        if op is nl.reciprocal:  # shared.rst l. 230
            raise NkiValidationError(f"{instr}: op=nl.reciprocal takes no bias on trn1 (NeuronCore-v2; aws-neuron-sdk "
                                     "nki/api/nki.api.shared.rst l. 230)")
    core = begin(instr)
    _operands(core, instr, "scalar", dst=dst, data=data, reduce_res=reduce_res)
    _same_layout(instr, ("data", data), ("dst", dst))
    p, f = _layout(data)
    x = read(instr, "data", data).reshape(p, f)
    x = x * _scalar_or_column(core, instr, "scale", scale, p, "scalar", fp32_only=True)
    if bias is not None:
        x = x + _scalar_or_column(core, instr, "bias", bias, p, "scalar", fp32_only=False)
    with _quiet():
        y = nl.ACTIVATIONS[op](x)
    if op in nl.ACTIVATION_RANGES:
        lo, hi = nl.ACTIVATION_RANGES[op]
        arg = np.abs(x) if op is nl.reciprocal else x
        y = np.where((arg >= lo) & (arg <= hi), y, np.float32(np.nan))
    write(dst, y)
    regs = core.activation_regs
    if command in (reduce_cmd.reset, reduce_cmd.reset_reduce):
        regs[:p] = 0.0  # "reduce_regs = 0" for every reduce_op: isa stub l. 1100 and 1177
    if command in (reduce_cmd.reduce, reduce_cmd.reset_reduce):
        reduce_op = reduce_op or nl.add
        regs[:p] = nl.ALU_BINARY[reduce_op](regs[:p], nl.REDUCTIONS[reduce_op](y, axis=1))
    if reduce_res is not None:
        if _layout(reduce_res) != (p, 1):
            raise NkiValidationError(f"{instr}: reduce_res must be a ({p}, 1) tile, got {reduce_res.shape}")
        write(reduce_res, regs[:p])
    count(instr, "scalar", p, f, dst, (data,), (op,), reads_accumulator=reduce_res is not None)


# ---- VectorE / GpSimd ------------------------------------------------------------------------------------

_OPERATOR_TABLE = "aws-neuron-sdk nki/api/nki.api.shared.rst l. 50-127, Supported Math Operators for NKI ISA"


def _check_alu_op(instr, role, op, unary_allowed=True):
    """``op`` must be a row of the ISA's operator table (binary, or unary where the instruction takes one); nl.divide,
    nl.mod and nl.fmod are refused with the release notes' words."""
    if op in nl.NOT_ON_HARDWARE:
        raise NkiValidationError(f"{instr}: {role}=nl.{op.__name__} is {nl.NOT_ON_HARDWARE[op]}")
    if op in nl.TRN3_ONLY and target().nc_version != "gen4":
        raise NkiValidationError(f"{instr}: {role}=nl.{op.__name__} runs on trn3 (NeuronCore-v4) only, not "
                                 f"{target().name} (aws-neuron-sdk release-notes/components/nki.rst, NKI 0.4.0)")
    if op in nl.ALU_BINARY or (unary_allowed and op in nl.ALU_UNARY):
        return
    name = getattr(op, "__name__", repr(op))
    raise NkiValidationError(f"{instr}: {role}={name} is not an operator of the ISA's operator table ({_OPERATOR_TABLE})"
                             f"{'' if unary_allowed else ' that takes two operands'}; e.g. nl.add, nl.multiply, "
                             "nl.maximum, nl.subtract")


def _check_reduce_op(instr, role, op, allowed=None):
    """``op`` must be marked "Legal Reduction op" = Y in the operator table (and among ``allowed`` if given)."""
    if allowed is not None and op not in allowed:
        names = ", ".join(f"nl.{o.__name__}" for o in allowed)
        raise NkiValidationError(f"{instr}: {role} must be {names}, got {getattr(op, '__name__', op)}")
    if op in nl.REDUCTION_NOT_EMULATED:
        raise NotImplementedError(f"{instr}: {role}=nl.{op.__name__} (a legal reduction op) is not emulated")
    if op not in nl.REDUCTIONS:
        raise NkiValidationError(f"{instr}: {role}={getattr(op, '__name__', op)} is not a legal reduction op (the "
                                 f"'Legal Reduction op' column of {_OPERATOR_TABLE}: nl.add, nl.subtract, "
                                 "nl.multiply, nl.maximum, nl.minimum and the bitwise/logical and, or, xor)")


def _alu(instr, op, x, operand_value, reverse):
    """One ALU step of tensor_scalar / scalar_tensor_tensor: ``x op operand`` (reversed if asked);
    unary operators ignore the operand."""
    _check_alu_op(instr, "op", op)
    if op in nl.ALU_UNARY:
        return nl.ALU_UNARY[op](x)
    fn = nl.ALU_BINARY[op]
    return fn(operand_value, x) if reverse else fn(x, operand_value)


def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    """``dst = data1 op data2`` elementwise in fp32. At most one input may be in PSUM."""
    integer = all(t.dtype.name in ("int32", "uint32") for t in (dst, data1, data2))
    in_psum = any(t.buffer is PSUM for t in (dst, data1, data2))
    default = "gpsimd" if op is nl.power or (integer and not in_psum) else "vector"
    eng = _pick_engine("tensor_tensor", engine, ("vector", "gpsimd"), default)
    core = begin("tensor_tensor")
    _operands(core, "tensor_tensor", eng, dst=dst, data1=data1, data2=data2)
    if data1.buffer is PSUM and data2.buffer is PSUM:
        raise NkiValidationError("tensor_tensor: data1 and data2 are both in PSUM; at most one input may be in PSUM")
    _same_layout("tensor_tensor", ("data1", data1), ("data2", data2), ("dst", dst))
    _check_alu_op("tensor_tensor", "op", op, unary_allowed=False)
    if op is nl.power and eng != "gpsimd":  # "nl.power. (Which runs on the GpSimd engine.)": isa stub l. 832
        raise NkiValidationError(f"tensor_tensor: op=nl.power runs on GpSimd only (aws-neuron-sdk nki/api/nki/isa/"
                                 f"__init__.py tensor_tensor), not on {eng}")
    x1, x2 = read("tensor_tensor", "data1", data1), read("tensor_tensor", "data2", data2)
    with _quiet():
        y = nl.ALU_BINARY[op](x1, x2.reshape(x1.shape))
    write(dst, y)
    count("tensor_tensor", eng, *_layout(dst), dst, (data1, data2), (op,))


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=engine.unknown, name=None):
    """``dst = (data op0 operand0) op1 operand1`` in fp32; each operand is a scalar or a float32 (P, 1)
    tile broadcast along the free axis; ``reverse`` puts the operand on the left. VectorE by default;
    ScalarE on trn2 only does (multiply[, add]) or (add); GpSimd only rsqrt."""
    eng = _pick_engine("tensor_scalar", engine, ("vector", "scalar", "gpsimd"), "vector")
    _check_alu_op("tensor_scalar", "op0", op0)
    if op0 in nl.ALU_UNARY and operand0 not in (None, 0):  # isa stub l. 911
        raise NkiValidationError(f"tensor_scalar: operand0 must be None or 0 when op0 is the unary "
                                 f"nl.{op0.__name__} (aws-neuron-sdk nki/api/nki/isa/__init__.py tensor_scalar)")
    if op1 is None and operand1 is not None:  # "op1 and operand1 ... must be None when unused": isa stub l. 876
        raise NkiValidationError("tensor_scalar: operand1 is given without op1; both must be None when unused")
    if op1 is not None:
        _check_alu_op("tensor_scalar", "op1", op1)
    if eng == "gpsimd" and op0 is not nl.rsqrt:
        raise NkiValidationError("tensor_scalar: GpSimd runs only op0=nl.rsqrt")
    if eng == "scalar" and target().nc_version == "gen3" and \
            (op0, op1) not in ((nl.multiply, nl.add), (nl.multiply, None), (nl.add, None)):
        raise NkiValidationError("tensor_scalar: ScalarE on trn2 supports only (multiply, add), (multiply,) "
                                 "and (add,)")
    core = begin("tensor_scalar")
    _operands(core, "tensor_scalar", eng, dst=dst, data=data)
    _same_layout("tensor_scalar", ("data", data), ("dst", dst))
    p, f = _layout(data)
    x = read("tensor_scalar", "data", data).reshape(p, f)
    with _quiet():
        y = _alu("tensor_scalar", op0, x,
                 _scalar_or_column(core, "tensor_scalar", "operand0", 0.0 if operand0 is None else operand0,
                                   p, eng, True), reverse0)
        if op1 is not None:
            y = _alu("tensor_scalar", op1, y,
                     _scalar_or_column(core, "tensor_scalar", "operand1", operand1, p, eng, True), reverse1)
    write(dst, y)
    count("tensor_scalar", eng, p, f, dst, (data,), (op0,) if op1 is None else (op0, op1))


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None):
    """``dst = (data op0 operand0) op1 operand1`` in fp32 on VectorE: operand0 a scalar or (P, 1) tile,
    operand1 a tile shaped like data. data and operand1 may not both be in PSUM."""
    _check_alu_op("scalar_tensor_tensor", "op0", op0)
    _check_alu_op("scalar_tensor_tensor", "op1", op1, unary_allowed=False)
    core = begin("scalar_tensor_tensor")
    _operands(core, "scalar_tensor_tensor", "vector", dst=dst, data=data, operand1=operand1)
    if data.buffer is PSUM and operand1.buffer is PSUM:
        raise NkiValidationError("scalar_tensor_tensor: data and operand1 are both in PSUM; at most one may be")
    _same_layout("scalar_tensor_tensor", ("data", data), ("operand1", operand1), ("dst", dst))
    p, f = _layout(data)
    x = read("scalar_tensor_tensor", "data", data).reshape(p, f)
    other = read("scalar_tensor_tensor", "operand1", operand1).reshape(p, f)
    with _quiet():
        y = _alu("scalar_tensor_tensor", op0, x,
                 _scalar_or_column(core, "scalar_tensor_tensor", "operand0", operand0, p, "vector", False), reverse0)
        y = _alu("scalar_tensor_tensor", op1, y, other, reverse1)
    write(dst, y)
    count("scalar_tensor_tensor", "vector", p, f, dst, (data, operand1), (op0, op1))


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    """Reduce ``data`` along trailing free axes (``axis``: int or tuple ending at the last dim; never
    the partition axis) with nl.add / nl.multiply / nl.maximum / nl.minimum, in fp32; ``negate``
    multiplies the result by -1. dst holds the remaining elements of each partition."""
    core = begin("tensor_reduce")
    _operands(core, "tensor_reduce", "vector", dst=dst, data=data)
    axes = tuple(sorted(a % data.ndim for a in ((axis,) if isinstance(axis, int) else axis)))
    if not axes or axes[0] == 0 or axes != tuple(range(axes[0], data.ndim)):
        raise NkiValidationError(f"tensor_reduce: axis {axis} must be the last contiguous free axes of a "
                                 f"{data.ndim}-d tile (partition axis 0 cannot be reduced)")
    _check_reduce_op("tensor_reduce", "op", op)
    y = nl.REDUCTIONS[op](read("tensor_reduce", "data", data), axis=axes)
    if negate:
        y = -y
    if _layout(dst) != (data.shape[0], y.size // data.shape[0]):
        raise NkiValidationError(f"tensor_reduce: dst {dst.shape} must hold {y.size // data.shape[0]} elements in "
                                 f"each of {data.shape[0]} partitions")
    write(dst, y)
    count("tensor_reduce", "vector", *_layout(data), dst, (data,), (op,))


def reciprocal(dst, data, name=None):
    """``dst = 1 / data`` on VectorE, in fp32."""
    core = begin("reciprocal")
    _operands(core, "reciprocal", "vector", dst=dst, data=data)
    _same_layout("reciprocal", ("data", data), ("dst", dst))
    with _quiet():
        write(dst, 1.0 / read("reciprocal", "data", data))
    count("reciprocal", "vector", *_layout(data), dst, (data,))


def _affine(instr, pattern, offset, channel_multiplier, partitions, free):
    """``offset + p * channel_multiplier + sum_i step_i * idx_i`` over ``pattern = [[step, num], ...]``
    (up to 4 dims, nums multiplying to the free size), as a (P, F) int64 array."""
    pattern = [(int(step), int(num)) for step, num in pattern]
    if not 1 <= len(pattern) <= 4 or int(np.prod([num for _, num in pattern])) != free:
        raise NkiValidationError(f"{instr}: pattern {pattern} must have 1-4 [step, num] pairs whose nums multiply "
                                 f"to the {free} elements per partition of dst")
    values = np.zeros([num for _, num in pattern], np.int64)
    for dim, (step, num) in enumerate(pattern):
        values = values + (np.arange(num) * step).reshape([-1 if d == dim else 1 for d in range(len(pattern))])
    return offset + np.arange(partitions)[:, None] * channel_multiplier + values.reshape(1, free)


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """GpSimd writes ``offset + p * channel_multiplier + sum_i step_i * idx_i`` (integer arithmetic)
    into an SBUF tile, cast to its dtype."""
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (offset, channel_multiplier)):
        raise NkiValidationError(f"iota: offset and channel_multiplier are int32 values (isa stub l. 1345), got "
                                 f"{offset!r} and {channel_multiplier!r}")
    core = begin("iota")
    _operands(core, "iota", "gpsimd", dst=dst)
    p, f = _layout(dst)
    write(dst, _affine("iota", pattern, offset, channel_multiplier, p, f))
    count("iota", "gpsimd", p, f, dst)


def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op=nl.equal, offset=0,
                  name=None):
    """GpSimd: ``dst = on_true_tile`` where ``cmp_op(affine value, 0)`` (the affine value as in iota),
    else ``on_false_value`` -- the causal mask. Both tiles in SBUF."""
    if hasattr(on_false_value, "shape"):  # "on_false_value must be float32": isa stub l. 1447, a scalar
        raise NkiValidationError("affine_select: on_false_value is a float32 scalar, not a tile")
    core = begin("affine_select")
    _operands(core, "affine_select", "gpsimd", dst=dst, on_true_tile=on_true_tile)
    _same_layout("affine_select", ("on_true_tile", on_true_tile), ("dst", dst))
    if cmp_op not in nl.COMPARISONS:
        raise NkiValidationError(f"affine_select: cmp_op must be an nl comparison (nl.greater_equal, ...), "
                                 f"got {cmp_op!r}")
    p, f = _layout(dst)
    keep = nl.COMPARISONS[cmp_op](_affine("affine_select", pattern, offset, channel_multiplier, p, f), 0) > 0
    values = read("affine_select", "on_true_tile", on_true_tile).reshape(p, f)
    write(dst, np.where(keep, values, np.float32(on_false_value)))
    count("affine_select", "gpsimd", p, f, dst, (on_true_tile,))


def bn_stats(dst, data, name=None):
    """Per partition, for the even- and the odd-indexed elements of ``data`` (at most 512 per
    partition, nl.tile_size.bn_stats_fmax): count, mean and variance*count -- 6 values, fp32 math."""
    core = begin("bn_stats")
    _operands(core, "bn_stats", "vector", dst=dst, data=data)
    p, f = _layout(data)
    if f > nl.tile_size.bn_stats_fmax:
        raise NkiValidationError(f"bn_stats: data has {f} elements per partition, more than "
                                 f"{nl.tile_size.bn_stats_fmax} (nl.tile_size.bn_stats_fmax)")
    if _layout(dst) != (p, 6):
        raise NkiValidationError(f"bn_stats: dst must hold 6 elements in each of {p} partitions, got {dst.shape}")
    x = read("bn_stats", "data", data).reshape(p, f)
    stats = []
    for half in (x[:, 0::2], x[:, 1::2]):
        n = half.shape[1]
        mean = half.mean(axis=1) if n else np.zeros(p, np.float32)
        m2 = ((half - mean[:, None]) ** 2).sum(axis=1) if n else np.zeros(p, np.float32)
        stats += [np.full(p, n, np.float32), mean, m2]
    write(dst, np.stack(stats, axis=1))
    count("bn_stats", "vector", p, f, dst, (data,))


def bn_aggr(dst, data, name=None):
    """Combine (count, mean, variance*count) triples from bn_stats into (mean, variance) per
    partition (population variance), fp32 math."""
    core = begin("bn_aggr")
    _operands(core, "bn_aggr", "vector", dst=dst, data=data)
    p, f = _layout(data)
    if f % 3 or _layout(dst) != (p, 2):
        raise NkiValidationError(f"bn_aggr: data needs a multiple of 3 elements per partition (got {f}) and dst "
                                 f"2 elements in each of {p} partitions (got {dst.shape})")
    triples = read("bn_aggr", "data", data).reshape(p, f // 3, 3)
    counts, means, m2 = triples[..., 0], triples[..., 1], triples[..., 2]
    total = counts.sum(axis=1)
    mean = (counts * means).sum(axis=1) / total
    variance = (m2 + counts * (means - mean[:, None]) ** 2).sum(axis=1) / total
    write(dst, np.stack([mean, variance], axis=1))
    count("bn_aggr", "vector", p, f, dst, (data,))


def dma_transpose(dst, src, axes=None, priority=None, dge_mode=dge_mode.unknown, oob_mode=oob_mode.error, name=None):
    """DMA transpose of ``src`` (HBM or SBUF) into ``dst`` (SBUF, src's dtype) with the permutation the stub gives
    per rank: (1, 0) for 2-D, (2, 1, 0) for 3-D, (3, 1, 2, 0) for 4-D (``axes``, if given, must be that one). A
    hardware-DGE transpose (``dge_mode=hwdge``) also needs a 2-byte dtype and the shape limits of its NKI version
    (isa stub l. 699-703); nki-library's attention_cte.py transposes fp32 and fp16 with the default dge_mode. A src
    made by ``ap(vector_offset=)`` is the indirect transpose (``_check_indirect_transpose``)."""
    permutations = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}
    dge_mode, oob_mode = _member(_DGE, dge_mode, "dma_transpose"), _member(_OOB, oob_mode, "dma_transpose")
    _check_dma_options("dma_transpose", priority, dge_mode, engine.unknown)
    if isinstance(src, NkiTensor) and src._rows is not None:
        _check_indirect_transpose(src, dge_mode)
    elif dge_mode is _DGE.swdge:
        # The stub allows unknown and hwdge for a direct transpose (3afa0fdf isa stub l. 697-699), swdge being the
        # indirect form's (l. 706-709); AWS's own kernels also transpose directly with dge_mode none (3), in every
        # public nki-library release (d2ad3a5: core/mlp/mlp_tkg/mlp_tkg_gate_up_projection.py l. 333 and 396, the
        # MoE TKG bias load; core/subkernels/norm_tkg_utils.py), so none runs here
        raise NkiValidationError("dma_transpose: dge_mode swdge is the indirect transpose's (src.ap(vector_offset=)); "
                                 "a direct transpose takes unknown or hwdge (isa stub 3afa0fdf l. 697-699)")
    if dge_mode is _DGE.hwdge:
        # NKI 0.4: src.shape[0] == 16 and src.shape[-1] % 128 == 0 (3afa0fdf isa stub l. 702-703); NKI 0.6 relaxed
        # them to src.shape[0] in {1, 2, 4, 8, 16} and src.shape[-1] <= 128 (a3247f5b release notes l. 37-39)
        rows_ok = src.shape[0] in ((1, 2, 4, 8, 16) if nki_since("0.6") else (16,))
        columns_ok = src.shape[-1] <= PARTITIONS if nki_since("0.6") else src.shape[-1] % PARTITIONS == 0
        if not (rows_ok and columns_ok) or src.dtype.itemsize != 2:
            raise NkiValidationError(f"dma_transpose: a hardware-DGE transpose of src {src.shape} breaks NKI "
                                     f"{nki_version()}'s limits: a 2-byte dtype (got {src.dtype.name}), limits on "
                                     "src.shape[0] and src.shape[-1] (aws-neuron-sdk nki/api/nki/isa/__init__.py "
                                     "dma_transpose; relaxed in NKI 0.6)")
    core = begin("dma_transpose")
    operand(core, "dma_transpose", "dst", dst, (SBUF,), "the DMA transpose writes only SBUF")
    operand(core, "dma_transpose", "src", src, (SBUF,) + HBM, "the DMA transpose reads HBM or SBUF")
    permutation = permutations.get(src.ndim)
    if permutation is None or (axes is not None and tuple(axes) != permutation):
        raise NkiValidationError(f"dma_transpose: supported axes are (1, 0), (2, 1, 0) and (3, 1, 2, 0) for 2-, 3- "
                                 f"and 4-d sources; got axes={axes} for a {src.ndim}-d source")
    if src.dtype != dst.dtype:
        raise NkiValidationError(f"dma_transpose: src and dst need one dtype, got {src.dtype.name} and "
                                 f"{dst.dtype.name}")
    expected = tuple(src.shape[a] for a in permutation)
    if dst.shape != expected:
        raise NkiValidationError(f"dma_transpose: dst must have shape {expected} (src {src.shape} permuted by "
                                 f"{permutation}), got {dst.shape}")
    check_indirect("dma_transpose", "src", src, oob_mode is _OOB.skip)
    if src._rows is not None and not src._rows.in_bounds.all():
        raise NotImplementedError("dma_transpose: skipping out-of-bounds rows of an indirect transpose "
                                  "(oob_mode.skip) is not emulated")
    copy_bits(dst, src, lambda a: np.transpose(a, permutation))
    count_dma(dst.size * dst.dtype.itemsize)
    count("dma_transpose", "dma", *_layout(dst), dst, (src,))


def _check_indirect_transpose(src, mode):
    """The "DMA Indirect Transpose Constraints" of the 0.4 stub (aws-neuron-sdk 3afa0fdf nki/api/nki/isa/__init__.py
    l. 706-722) for a src made by ``ap(vector_offset=indices)``; the rows it gathers are ``indices.T.flatten()[:
    src.shape[0]]`` (l. 724-726), as ``ap`` reads them."""
    indices = src._rows.index_tensor
    rules = [
        (mode in (_DGE.unknown, _DGE.swdge), f"dge_mode must be unknown or swdge, got {mode.name}"),
        (src.ndim != 4 or 1 in src.shape[1:3], f"a 4-d src needs shape[1] or shape[2] of 1, got {src.shape}"),
        (src.shape[-1] <= PARTITIONS and src.dtype.itemsize == 2, f"src.shape[-1] <= 128 and a 2-byte dtype, got "
                                                                  f"{src.shape} {src.dtype.name}"),
        (src.shape[0] % 16 == 0, f"src.shape[0] divisible by 16, got {src.shape[0]}"),
        (indices.ndim == 2 and indices.size >= src.shape[0], f"2-d indices with at least src.shape[0] entries, got "
                                                             f"{indices.shape}"),
        (indices.shape[0] in range(16, PARTITIONS + 1, 16)
         and (indices.shape[-1] == 1 or indices.shape[0] == PARTITIONS),
         f"indices.shape[0] in [16, 128] divisible by 16, exactly 128 with more than one column, got {indices.shape}"),
        (indices.dtype == np.uint32, f"uint32 indices, got {indices.dtype.name}"),
        (target().nc_version != "gen2", f"trn2 or newer, not {target().name}"),
    ]
    for holds, what in rules:
        if not holds:
            raise NkiValidationError(f"dma_transpose: an indirect transpose (src.ap(vector_offset=...)) needs {what} "
                                     "(isa stub 3afa0fdf l. 706-722)")


def tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0=False, reverse1=False, name=None):
    """VectorE scan along the free axis, per partition, in fp32 (the 0.6 stub's pseudo-code):
    ``dst[:, 0] = op1(op0(data0[:, 0], initial), data1[:, 0])``, then
    ``dst[:, i] = op1(op0(data0[:, i], dst[:, i-1]), data1[:, i])``. ``reverse0`` makes data0 the right
    operand of op0, ``reverse1`` makes data1 the left operand of op1. ``initial``: scalar or (P, 1)
    tile. data0 and data1 may not both be in PSUM."""
    core = begin("tensor_tensor_scan")
    _operands(core, "tensor_tensor_scan", "vector", dst=dst, data0=data0, data1=data1)
    if data0.buffer is PSUM and data1.buffer is PSUM:
        raise NkiValidationError("tensor_tensor_scan: data0 and data1 are both in PSUM; at most one may be")
    _same_layout("tensor_tensor_scan", ("data0", data0), ("data1", data1), ("dst", dst))
    for role, op in (("op0", op0), ("op1", op1)):  # "any binary arithmetic operator": isa stub l. 1662
        _check_alu_op("tensor_tensor_scan", role, op, unary_allowed=False)
    p, f = _layout(data0)
    x0 = read("tensor_tensor_scan", "data0", data0).reshape(p, f)
    x1 = read("tensor_tensor_scan", "data1", data1).reshape(p, f)
    state = _scalar_or_column(core, "tensor_tensor_scan", "initial", initial, p, "vector", fp32_only=False)
    first, second = nl.ALU_BINARY[op0], nl.ALU_BINARY[op1]
    result = np.empty((p, f), np.float32)
    with _quiet():
        for i in range(f):
            column = x0[:, i:i + 1]
            combined = first(state, column) if reverse0 else first(column, state)
            state = second(x1[:, i:i + 1], combined) if reverse1 else second(combined, x1[:, i:i + 1])
            result[:, i:i + 1] = state
    write(dst, result)
    count("tensor_tensor_scan", "vector", p, f, dst, (data0, data1), (op0, op1))


_VECTOR_REDUCE_OPS = {nl.add: nl.add, nl.multiply: nl.multiply, nl.maximum: nl.maximum, nl.minimum: nl.minimum,
                      nl.max: nl.maximum, nl.min: nl.minimum}


def tensor_scalar_reduce(dst, data, op0, operand0, reduce_op, reduce_res=None, reverse0=False,
                         reduce_cmd=reduce_cmd.reset_reduce, reduce_init=None, reduce_res_negate=False, name=None):
    """VectorE ``dst = data op0 operand0`` (as tensor_scalar, one arithmetic operator) plus a reduction of the result
    over all free axes into VectorE's per-lane accumulator registers: ``reset_reduce`` starts them at 0 in NKI 0.4
    and 0.5 (aws-neuron-sdk 3afa0fdf nki/api/nki/isa/__init__.py l. 2151: nl.max gives max(0, row max)) and at the
    identity of ``reduce_op`` from 0.6 (a3247f5b l. 2541: 0, 1, -inf, +inf for add, multiply, max, min);
    ``reduce`` keeps accumulating, ``load_reduce`` starts from ``reduce_init`` (scalar or float32 (P, 1) tile).
    ``reduce_res`` (P, 1) receives the registers: required before 0.6 (0.4 signature, l. 2125); from 0.6 it may be
    None, and ``reduce_res_negate`` negates what it receives. ``reverse0`` is documented as not supported yet."""
    if reverse0:
        raise NkiValidationError("tensor_scalar_reduce: reverse0 is not supported (aws-neuron-sdk nki/api/nki/isa/"
                                 "__init__.py tensor_scalar_reduce: 'not supported yet')")
    if not nki_since("0.6") and (reduce_res is None or reduce_res_negate):
        raise NkiValidationError(f"tensor_scalar_reduce: NKI {nki_version()} requires reduce_res and has no "
                                 "reduce_res_negate (aws-neuron-sdk 3afa0fdf nki/api/nki/isa/__init__.py l. 2125; both "
                                 "came in NKI 0.6)")
    _check_alu_op("tensor_scalar_reduce", "op0", op0)
    if reduce_op not in _VECTOR_REDUCE_OPS:
        raise NkiValidationError(f"tensor_scalar_reduce: reduce_op must be nl.add, nl.multiply, nl.max or nl.min "
                                 f"(isa stub l. 2138), got {getattr(reduce_op, '__name__', reduce_op)}")
    if reduce_cmd not in (_COMMANDS.reset_reduce, _COMMANDS.reduce, _COMMANDS.load_reduce):
        raise NkiValidationError(f"tensor_scalar_reduce: reduce_cmd must be reset_reduce, reduce or load_reduce, "
                                 f"got {reduce_cmd}")
    if (reduce_init is not None) != (reduce_cmd is _COMMANDS.load_reduce):
        raise NkiValidationError("tensor_scalar_reduce: reduce_init is given exactly when reduce_cmd is load_reduce")
    reduce_op = _VECTOR_REDUCE_OPS[reduce_op]
    core = begin("tensor_scalar_reduce")
    _operands(core, "tensor_scalar_reduce", "vector", dst=dst, data=data, reduce_res=reduce_res)
    _same_layout("tensor_scalar_reduce", ("data", data), ("dst", dst))
    p, f = _layout(data)
    x = read("tensor_scalar_reduce", "data", data).reshape(p, f)
    with _quiet():
        y = _alu("tensor_scalar_reduce", op0,
                 x, _scalar_or_column(core, "tensor_scalar_reduce", "operand0", 0.0 if operand0 is None else operand0,
                                      p, "vector", True), False)
    write(dst, y)
    regs = core.vector_regs
    if reduce_cmd is _COMMANDS.reset_reduce:
        regs[:p] = _REDUCE_IDENTITY[reduce_op] if nki_since("0.6") else 0.0
    elif reduce_cmd is _COMMANDS.load_reduce:
        initial = _scalar_or_column(core, "tensor_scalar_reduce", "reduce_init", reduce_init, p, "vector", True)
        regs[:p] = np.broadcast_to(initial, (p, 1)).reshape(p)
    with _quiet():
        regs[:p] = nl.ALU_BINARY[reduce_op](regs[:p], nl.REDUCTIONS[reduce_op](y, axis=1))
    if reduce_res is not None:
        if _layout(reduce_res) != (p, 1):
            raise NkiValidationError(f"tensor_scalar_reduce: reduce_res must be a ({p}, 1) tile, got "
                                     f"{reduce_res.shape}")
        write(reduce_res, -regs[:p] if reduce_res_negate else regs[:p])
    count("tensor_scalar_reduce", "vector", p, f, dst, (data,), (op0, reduce_op))


def _eight(instr, dst, data, vals=None):
    """Operand rules of the 8-wide VectorE search instructions (isa stub, aws-neuron-sdk 3afa0fdf
    nki/api/nki/isa/__init__.py max8 l. 2025-2042, nc_find_index8 l. 2705-2726): 8 to 16,384 elements per
    partition of ``data``, exactly 8 per partition in ``dst`` (and ``vals``)."""
    p, f = _layout(data)
    if not 8 <= f <= 16384:
        raise NkiValidationError(f"{instr}: data has {f} elements per partition; 8 to 16384 are allowed")
    for role, t in (("dst", dst), ("vals", vals)):
        if t is not None and _layout(t) != (p, 8):
            raise NkiValidationError(f"{instr}: {role} must hold 8 elements in each of {p} partitions, got {t.shape}")
    return p, f


def _poisoned_rows(*rows):
    """(P, 1): the partitions whose values (each a (P, n) array read by ``read``) carry poison. An instruction
    that sorts, searches or selects by value would drop a NaN; the whole row of its result is poison instead."""
    return np.logical_or.reduce([np.isnan(r).any(axis=1, keepdims=True) for r in rows])


def max8(dst, src, name=None):
    """The 8 largest values of each partition of ``src``, in descending order, on VectorE (fp32 compare)."""
    core = begin("max8")
    _operands(core, "max8", "vector", dst=dst, src=src)
    p, f = _eight("max8", dst, src)
    x = read("max8", "src", src).reshape(p, f)
    write(dst, np.where(_poisoned_rows(x), np.float32(np.nan), -np.sort(-x, axis=1)[:, :8]))
    count("max8", "vector", p, f, dst, (src,))


def _find_each(x, vals, reverse):
    """Per partition, the index of the first occurrence of each value of ``vals`` in ``x``; a repeated value takes
    the next occurrence, values are matched last to first when ``reverse`` (the hardware's tie-break, a3247f5b
    release-notes/components/nki.rst l. 74-77); an absent value gives -1."""
    found = np.full(vals.shape, -1, np.int64)
    order = range(vals.shape[1] - 1, -1, -1) if reverse else range(vals.shape[1])
    for row in range(x.shape[0]):
        taken = set()
        for j in order:
            for index in np.flatnonzero(x[row] == vals[row, j]):
                if index not in taken:
                    taken.add(index)
                    found[row, j] = index
                    break
    return found


def nc_find_index8(dst, data, vals, name=None):
    """Indices (uint16/uint32 ``dst``) of the first occurrence of each of the 8 ``vals`` per partition in ``data``;
    absent values (undefined on hardware) give all ones, as the NKI 0.6 simulator returns."""
    core = begin("nc_find_index8")
    _operands(core, "nc_find_index8", "vector", dst=dst, data=data, vals=vals)
    p, f = _eight("nc_find_index8", dst, data, vals)
    if dst.dtype.name not in ("uint16", "uint32"):
        raise NkiValidationError(f"nc_find_index8: dst must be uint16 or uint32, got {dst.dtype.name}")
    x = read("nc_find_index8", "data", data).reshape(p, f)
    wanted = read("nc_find_index8", "vals", vals).reshape(p, 8)
    found = _find_each(x, wanted, reverse=False)
    poisoned = np.broadcast_to(_poisoned_rows(x, wanted), found.shape)
    write(dst, np.where(found < 0, np.iinfo(dst.dtype).max, found), poisoned)
    count("nc_find_index8", "vector", p, f, dst, (data, vals))


def nc_match_replace8(dst, data, vals, imm, dst_idx=None, name=None):
    """``dst`` = ``data`` with the first occurrence of each of the 8 ``vals`` per partition replaced by ``imm``;
    ``dst_idx`` (optional) receives the matched indices."""
    core = begin("nc_match_replace8")
    _operands(core, "nc_match_replace8", "vector", dst=dst, data=data, vals=vals, dst_idx=dst_idx)
    p, f = _eight("nc_match_replace8", None, data, vals)
    _same_layout("nc_match_replace8", ("data", data), ("dst", dst))
    x = read("nc_match_replace8", "data", data).reshape(p, f)
    wanted = read("nc_match_replace8", "vals", vals).reshape(p, 8)
    found = _find_each(x, wanted, reverse=True)
    replaced = x.copy()
    rows = np.nonzero(found >= 0)
    replaced[rows[0], found[rows]] = np.float32(imm)
    poisoned = _poisoned_rows(x, wanted)
    write(dst, np.where(poisoned, np.float32(np.nan), replaced))
    if dst_idx is not None:
        _eight("nc_match_replace8", dst_idx, data)
        write(dst_idx, np.where(found < 0, np.iinfo(np.uint32).max, found), np.broadcast_to(poisoned, found.shape))
    count("nc_match_replace8", "vector", p, f, dst, (data, vals))


def _start_partition(t):
    storage = t._storage.array
    return t.offset // (storage.size // storage.shape[0])


def nc_stream_shuffle(dst, src, shuffle_mask, name=None):
    """VectorE cross-partition move inside each quadrant of 32 partitions (isa stub, aws-neuron-sdk 3afa0fdf
    nki/api/nki/isa/__init__.py l. 1686-1719): dst partition 32q + i takes src partition 32q + shuffle_mask[i], or
    is left as it is where the mask says 255. One dtype and one number of elements per partition; the views start
    at partition 0 when 96 or 128 partitions are active, 0 or 64 when 64 are, a multiple of 32 when 32 are."""
    if len(shuffle_mask) != 32 or any(not 0 <= int(m) < 32 and int(m) != 255 for m in shuffle_mask):
        raise NkiValidationError(f"nc_stream_shuffle: shuffle_mask must list 32 source partitions (0-31, or 255 to "
                                 f"keep the destination), got {list(shuffle_mask)}")
    core = begin("nc_stream_shuffle")
    _operands(core, "nc_stream_shuffle", "vector", dst=dst, src=src)
    if dst.dtype != src.dtype or _layout(dst)[1] != _layout(src)[1]:
        raise NkiValidationError(f"nc_stream_shuffle: dst {dst.shape} {dst.dtype.name} needs src's dtype and elements "
                                 f"per partition ({src.shape} {src.dtype.name})")
    active = -(-max(src.shape[0], dst.shape[0]) // 32) * 32
    starts = {128: (0,), 96: (0,), 64: (0, 64), 32: (0, 32, 64, 96)}[active]
    for role, t in (("src", src), ("dst", dst)):
        if _start_partition(t) not in starts:
            raise NkiValidationError(f"nc_stream_shuffle: {role} starts at partition {_start_partition(t)}; with "
                                     f"{active} active partitions it must start at one of {starts}")
    p, f = _layout(src)
    rows = np.array(read("nc_stream_shuffle", "src", src)).reshape(p, f)  # read first: dst may be src
    for row in range(dst.shape[0]):
        if int(shuffle_mask[row % 32]) == 255:
            continue
        source = row // 32 * 32 + int(shuffle_mask[row % 32])
        if source >= p:
            raise NkiValidationError(f"nc_stream_shuffle: dst partition {row} takes src partition {source}, beyond "
                                     f"src's {p}")
        write(dst[row:row + 1], rows[source])
    count("nc_stream_shuffle", "vector", p, f, dst, (src,))


_GATHER_WIDTHS = (1, 2, 4, 8, 16, 32)
_GPSIMD_CORE_PARTITIONS = 16
_GATHER_INDICES_PER_CORE = 4096


def local_gather(dst, src_buffer, index, num_elem_per_idx=1, num_valid_indices=None, name=None):
    """GpSimd gather inside each GpSimd core's 16 partitions, as the 0.4 stub and its numpy reference state it
    (aws-neuron-sdk 3afa0fdf nki/api/nki/isa/__init__.py l. 1472-1523; nki/test/test_nki_isa_local_gather.py
    l. 56-86): each core flattens its 16 partitions of ``index`` (uint16) column by column and keeps the first
    ``num_valid_indices``; every partition ``p`` of the core then reads, for each index ``i``, the
    ``num_elem_per_idx`` elements of its own ``src_buffer`` row starting at element ``i``: ``dst[p, j, e] =
    src[p, indices[j] + e]``. dst keeps src's dtype. An index past the row is refused: "Behavior of out-of-bound
    index access is undefined" (l. 1492)."""
    instr = "local_gather"
    core = begin(instr)
    _operands(core, instr, "gpsimd", dst=dst, src_buffer=src_buffer, index=index)
    partitions, row = _layout(src_buffer)
    per_core = index.size // max(1, partitions // _GPSIMD_CORE_PARTITIONS)
    valid = per_core if num_valid_indices is None else int(num_valid_indices)
    problem = None
    if index.shape[0] != partitions or partitions % _GPSIMD_CORE_PARTITIONS:
        problem = (f"src_buffer and index need one partition count, a multiple of 16 (got {partitions} and "
                   f"{index.shape[0]})")
    elif num_elem_per_idx not in _GATHER_WIDTHS:
        problem = f"num_elem_per_idx must be one of {_GATHER_WIDTHS}, got {num_elem_per_idx}"
    elif not 0 < valid <= min(per_core, _GATHER_INDICES_PER_CORE):
        problem = (f"num_valid_indices {valid} must be at most the {per_core} indices of a core's 16-partition index "
                   f"slice and at most {_GATHER_INDICES_PER_CORE}")
    elif index.dtype != np.uint16 or dst.dtype != src_buffer.dtype:
        problem = (f"index must be uint16 and dst must keep src_buffer's dtype (no casting); got index "
                   f"{index.dtype.name}, dst {dst.dtype.name}, src_buffer {src_buffer.dtype.name}")
    elif _layout(dst) != (partitions, valid * num_elem_per_idx):
        problem = (f"dst must hold {partitions} partitions x {valid * num_elem_per_idx} elements (num_valid_indices "
                   f"x num_elem_per_idx), got {dst.shape}")
    if problem:
        raise NkiValidationError(f"{instr}: {problem} (isa stub 3afa0fdf l. 1472-1516)")
    check_written(instr, "index", index)  # an address: poison there has no NaN to carry it
    source = np.asarray(src_buffer._data).reshape(partitions, row)
    unwritten = poison(src_buffer)
    unwritten = np.zeros(source.shape, np.bool_) if unwritten is None else unwritten.reshape(partitions, row)
    indices = read(instr, "index", index).astype(np.int64).reshape(partitions, -1)
    gathered = np.empty((partitions, valid, num_elem_per_idx), source.dtype)
    gathered_poison = np.zeros(gathered.shape, np.bool_)
    for first in range(0, partitions, _GPSIMD_CORE_PARTITIONS):
        rows = slice(first, first + _GPSIMD_CORE_PARTITIONS)
        starts = indices[rows].flatten(order="F")[:valid]
        if starts.max() + num_elem_per_idx > row:
            raise NkiValidationError(f"{instr}: index {starts.max()} (+ {num_elem_per_idx} elements) is past the "
                                     f"{row} elements of a src_buffer partition; behavior of out-of-bound index access "
                                     "is undefined (isa stub 3afa0fdf l. 1492)")
        at = starts[:, None] + np.arange(num_elem_per_idx)
        gathered[rows], gathered_poison[rows] = source[rows][:, at], unwritten[rows][:, at]
    write(dst, gathered, gathered_poison)  # bit for bit, never-written elements staying never written
    count(instr, "gpsimd", partitions, valid * num_elem_per_idx, dst, (src_buffer, index),
          ops=(f"num_elem_per_idx={num_elem_per_idx}",))


_RANGE_COMPARISONS = (nl.equal, nl.less, nl.less_equal, nl.greater, nl.greater_equal)
_FP32_MIN = float(np.finfo(np.float32).min)


def range_select(dst, on_true_tile, comp_op0, comp_op1, bound0, bound1, reduce_cmd=reduce_cmd.reset_reduce,
                 reduce_res=None, reduce_op=nl.maximum, range_start=0, on_false_value=_FP32_MIN, name=None):
    """VectorE: ``dst = on_true_tile`` where ``comp_op0(range_start + i, bound0)`` and ``comp_op1(range_start + i,
    bound1)`` for free index i, else ``on_false_value``; the row max goes into VectorE's accumulator registers under
    ``reduce_cmd`` (reset_reduce starts them at -inf) and to ``reduce_res``. As the isa stub lists (aws-neuron-sdk
    3afa0fdf nki/api/nki/isa/__init__.py l. 2365-2438): NeuronCore-v3 on; comparisons equal, less, less_equal,
    greater, greater_equal; float32 (P, 1) bounds; on_false_value FP32_MIN (-3.4028235e+38); reduce_op nl.maximum;
    range_start a compile-time integer."""
    if target().nc_version == "gen2":
        raise NkiValidationError("range_select: needs NeuronCore-v3 or newer (trn2, trn3), not trn1")
    for role, op in (("comp_op0", comp_op0), ("comp_op1", comp_op1)):
        if op not in _RANGE_COMPARISONS:
            raise NkiValidationError(f"range_select: {role} must be nl.equal, nl.less, nl.less_equal, nl.greater or "
                                     f"nl.greater_equal, got {getattr(op, '__name__', op)}")
    if np.float32(on_false_value) != np.float32(_FP32_MIN) or reduce_op is not nl.maximum:
        raise NkiValidationError(f"range_select: on_false_value must be FP32_MIN (-3.4028235e+38) and reduce_op "
                                 f"nl.maximum, got {on_false_value!r} and {getattr(reduce_op, '__name__', reduce_op)}")
    if not isinstance(range_start, (int, np.integer)):
        raise NkiValidationError(f"range_select: range_start must be a compile-time integer, got {range_start!r}")
    core = begin("range_select")
    _operands(core, "range_select", "vector", dst=dst, on_true_tile=on_true_tile, bound0=bound0, bound1=bound1,
              reduce_res=reduce_res)
    _same_layout("range_select", ("on_true_tile", on_true_tile), ("dst", dst))
    p, f = _layout(on_true_tile)
    for role, bound in (("bound0", bound0), ("bound1", bound1)):
        if _layout(bound) != (p, 1) or bound.dtype != FP32:
            raise NkiValidationError(f"range_select: {role} must be a float32 ({p}, 1) tile, got {bound.shape} "
                                     f"{bound.dtype.name}")
    index = np.float32(range_start) + np.arange(f, dtype=np.float32)[None, :]
    low, high = (read("range_select", role, bound).reshape(p, 1) for role, bound in (("bound0", bound0),
                                                                                      ("bound1", bound1)))
    keep = (nl.COMPARISONS[comp_op0](index, low) > 0) & (nl.COMPARISONS[comp_op1](index, high) > 0)
    selected = np.where(keep, read("range_select", "on_true_tile", on_true_tile).reshape(p, f),
                        np.float32(on_false_value))
    selected = np.where(_poisoned_rows(low, high), np.float32(np.nan), selected)  # a poisoned bound
    write(dst, selected)
    regs = core.vector_regs
    if reduce_cmd in (_COMMANDS.reset, _COMMANDS.reset_reduce):
        regs[:p] = -np.inf
    if reduce_cmd in (_COMMANDS.reduce, _COMMANDS.reset_reduce):
        regs[:p] = np.maximum(regs[:p], selected.max(axis=1))
    if reduce_res is not None:
        if _layout(reduce_res) != (p, 1):
            raise NkiValidationError(f"range_select: reduce_res must be a ({p}, 1) tile, got {reduce_res.shape}")
        write(reduce_res, regs[:p])
    count("range_select", "vector", p, f, dst, (on_true_tile,), (comp_op0, comp_op1, reduce_op))


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, name=None):
    """VectorE: ``dst = src`` where ``predicate`` is non-zero (zero with ``reverse_pred``), ``dst`` kept elsewhere; a
    scalar ``src`` is copied as a constant. As the isa stub lists (aws-neuron-sdk 3afa0fdf nki/api/nki/isa/__init__.py
    l. 369-392): src (a tile), dst and predicate of one layout, predicate uint8/uint16/uint32, src and dst of one
    dtype, src and predicate not both in PSUM."""
    core = begin("tensor_copy_predicated")
    tile_src = hasattr(src, "shape")
    _operands(core, "tensor_copy_predicated", "vector", dst=dst, src=src if tile_src else None, predicate=predicate)
    _same_layout("tensor_copy_predicated", ("dst", dst), ("predicate", predicate), *((("src", src),) if tile_src else ()))
    if predicate.dtype.name not in ("uint8", "uint16", "uint32"):
        raise NkiValidationError(f"tensor_copy_predicated: predicate must be uint8, uint16 or uint32, got "
                                 f"{predicate.dtype.name}")
    if tile_src and (src.dtype != dst.dtype or (src.buffer is PSUM and predicate.buffer is PSUM)):
        raise NkiValidationError("tensor_copy_predicated: src needs dst's dtype, and src and predicate may not both "
                                 "be in PSUM")
    p, f = _layout(dst)
    predicate_values = read("tensor_copy_predicated", "predicate", predicate).reshape(p, f)
    chosen = predicate_values != 0
    if reverse_pred:
        chosen = ~chosen
    values = np.asarray(src._data).reshape(p, f) if tile_src else np.full((p, f), src, dst.dtype)
    copied = poison(src) if tile_src else None
    kept = poison(dst)  # the elements not chosen keep dst's values, and stay never written where they were
    poisoned = np.isnan(predicate_values) | np.where(chosen, False if copied is None else copied.reshape(p, f),
                                                     False if kept is None else kept.reshape(p, f))
    write(dst, np.where(chosen, values, np.asarray(dst._data).reshape(p, f)), poisoned)
    count("tensor_copy_predicated", "vector", p, f, dst, (predicate,) + ((src,) if tile_src else ()))


_PARTITION_REDUCTIONS = {nl.add: np.sum, nl.maximum: np.max}


def tensor_partition_reduce(dst, op, data, name=None):
    """GpSimd: reduce ``data`` across its partitions into ``dst`` (one partition, data's free layout); op nl.add or
    nl.maximum (isa stub l. 992-997; bitwise_or/and, and average in 0.6, are not emulated)."""
    if op not in _PARTITION_REDUCTIONS:
        raise NkiValidationError(f"tensor_partition_reduce: op must be nl.add or nl.maximum (the emulated ones of add, "
                                 f"max, bitwise_or, bitwise_and), got {getattr(op, '__name__', op)}")
    core = begin("tensor_partition_reduce")
    _operands(core, "tensor_partition_reduce", "gpsimd", dst=dst, data=data)
    p, f = _layout(data)
    if _layout(dst) != (1, f):
        raise NkiValidationError(f"tensor_partition_reduce: dst must be 1 partition x {f} elements, got {dst.shape}")
    write(dst, _PARTITION_REDUCTIONS[op](read("tensor_partition_reduce", "data", data).reshape(p, f), axis=0))
    count("tensor_partition_reduce", "gpsimd", p, f, dst, (data,), (op,))


def core_barrier(data, cores, engine=engine.gpsimd, name=None):
    """Both cores of an LNC=2 launch wait here until the other arrives (isa stub l. 2183-2236): NeuronCore-v3 or
    newer, ``cores=(0, 1)``, ``data`` in shared HBM. What one core wrote to ``data`` before the barrier is then
    there for the other."""
    if target().nc_version == "gen2":
        raise NkiValidationError("core_barrier: needs NeuronCore-v3 or newer (trn2, trn3), not trn1")
    core = begin("core_barrier")
    if tuple(cores) != (0, 1) or core.num_programs != 2:
        raise NkiValidationError(f"core_barrier: synchronises the two cores of an LNC=2 launch, cores=(0, 1); got "
                                 f"cores={tuple(cores)} in a launch of {core.num_programs} program(s)")
    if getattr(data, "buffer", None) is not HBM[1]:
        raise NkiValidationError("core_barrier: data must be a tensor in shared HBM (nl.shared_hbm)")
    core.barriers += 1
    other = 1 - core.program_id
    core.launch.exchange(core.program_id, other, other, ("core_barrier", core.barriers), None)
    count("core_barrier", "gpsimd", 1, 1)


_GPSIMD_DMA_BYTES = {4: 1024, 2: 512, 1: 256}  # per partition, by element size: isa stub sendrecv


def sendrecv(src, dst, send_to_rank, recv_from_rank, pipe_id, dma_engine=dma_engine.dma, name=None):
    """Send ``src`` to the other core of an LNC=2 launch and receive its ``src`` into ``dst`` (isa stub, aws-neuron-sdk
    3afa0fdf nki/api/nki/isa/__init__.py l. 2507-2583): NeuronCore-v3 or newer, LNC=2, ranks 0 or 1, both tiles in
    SBUF with one dtype and one layout; ``dma_engine=gpsimd_dma`` moves at most 1024/512/256 bytes per partition
    for 4/2/1-byte types. Each program waits here until its partner's sendrecv on the same ``pipe_id``."""
    if target().nc_version == "gen2":
        raise NkiValidationError("sendrecv: needs NeuronCore-v3 or newer (trn2, trn3), not trn1")
    core = begin("sendrecv")
    for role, t in (("src", src), ("dst", dst)):
        operand(core, "sendrecv", role, t, (SBUF,), "sendrecv moves SBUF tiles only")
    if core.num_programs != 2 or {send_to_rank, recv_from_rank} - {0, 1}:
        raise NkiValidationError(f"sendrecv: runs between the two cores of an LNC=2 launch (kernel[2]), ranks 0 or 1; "
                                 f"this launch has {core.num_programs} program(s), ranks {send_to_rank} and "
                                 f"{recv_from_rank}")
    if src.dtype != dst.dtype:
        raise NkiValidationError(f"sendrecv: src and dst need one dtype, got {src.dtype.name} and {dst.dtype.name}")
    _same_layout("sendrecv", ("src", src), ("dst", dst))
    p, f = _layout(src)
    if dma_engine is _DMA_ENGINES.gpsimd_dma and f * src.dtype.itemsize > _GPSIMD_DMA_BYTES[src.dtype.itemsize]:
        raise NkiValidationError(f"sendrecv: dma_engine=gpsimd_dma moves at most "
                                 f"{_GPSIMD_DMA_BYTES[src.dtype.itemsize]} bytes per partition of {src.dtype.name}, "
                                 f"got {f * src.dtype.itemsize}")
    unwritten = poison(src)
    received, poisoned = core.launch.exchange(core.program_id, send_to_rank, recv_from_rank, pipe_id,
                                              (np.array(src._data), False if unwritten is None else unwritten))
    write(dst, received, poisoned)
    count_dma(dst.size * dst.dtype.itemsize)
    count("sendrecv", "dma", p, f, dst, (src,))


_COMMANDS = reduce_cmd  # the enum, under a name that tensor_scalar_reduce's reduce_cmd argument does not hide
_REDUCE_IDENTITY = {nl.add: 0.0, nl.multiply: 1.0, nl.maximum: -np.inf, nl.minimum: np.inf}


# ---- the rest of the NKI 0.6 nki.isa API: present by name, not emulated ------------------------------

class NkiInstruction:
    """Handle of an issued instruction (scheduling hints); not emulated."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("nki.isa.NkiInstruction is not emulated")

    def depends_on(self, *args, **kwargs):
        raise NotImplementedError("nki.isa.NkiInstruction.depends_on is not emulated")


class VirtualRegister:
    """A device register (dynamic loops); not emulated."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("nki.isa.VirtualRegister is not emulated")


get_nc_sub_version = not_emulated("nki.isa.get_nc_sub_version", "")
nc_matmul_mx = not_emulated("nki.isa.nc_matmul_mx", "dst stationary moving stationary_scale moving_scale "
                                                    "tile_position tile_size accumulate name")
tensor_scalar_cumulative = not_emulated("nki.isa.tensor_scalar_cumulative", "dst src op0 op1 imm0 imm1 reduce_cmd name")
activate2 = not_emulated("nki.isa.activate2", "dst op data imm0 imm1 op0 op1 relu_param reverse0 reverse1 reduce_op "
                                              "reduce_res reduce_cmd name")
nc_n_gather = not_emulated("nki.isa.nc_n_gather", "dst data indices name")
rng = not_emulated("nki.isa.rng", "dst engine name")
dropout = not_emulated("nki.isa.dropout", "dst data prob name")
set_rng_seed = not_emulated("nki.isa.set_rng_seed", "src_seeds name")
rand_set_state = not_emulated("nki.isa.rand_set_state", "src_seeds engine name")
rand_get_state = not_emulated("nki.isa.rand_get_state", "dst engine name")
rand2 = not_emulated("nki.isa.rand2", "dst min max name")
exponential = not_emulated("nki.isa.exponential", "dst src max_value reduce_res reduce_cmd reduce_init name")
sequence_bounds = not_emulated("nki.isa.sequence_bounds", "dst segment_ids name")
quantize_mx = not_emulated("nki.isa.quantize_mx", "dst src dst_scale name")
select_reduce = not_emulated("nki.isa.select_reduce", "dst predicate on_true on_false reduce_res reduce_cmd reduce_op "
                                                      "reverse_pred name")
register_alloc = not_emulated("nki.isa.register_alloc", "x")
register_move = not_emulated("nki.isa.register_move", "dst src")
register_load = not_emulated("nki.isa.register_load", "dst src")
register_store = not_emulated("nki.isa.register_store", "dst src")
nonzero_with_count = not_emulated("nki.isa.nonzero_with_count", "dst src index_offset padding_val name")
topk = not_emulated("nki.isa.topk", "val_dst idx_dst src n name")


def _record_name(fn):
    """``fn`` with its ``name=`` argument recorded as the instruction's label in the trace (what
    ``kernel.with_schedule`` edges name: aws-neuron-sdk 3afa0fdf nki/guides/how-to-scheduling-apis.rst)."""
    position = list(inspect.signature(fn).parameters).index("name")

    @functools.wraps(fn)
    def instruction(*args, **kwargs):
        with labelled(kwargs.get("name", args[position] if len(args) > position else None)):
            return fn(*args, **kwargs)

    return instruction


for _name, _fn in list(globals().items()):  # every emulated instruction that takes name=
    if inspect.isfunction(_fn) and _fn.__module__ == __name__ and not _name.startswith("_") \
            and "name" in inspect.signature(_fn).parameters:
        globals()[_name] = _record_name(_fn)

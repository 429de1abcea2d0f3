"""Trace, without computing anything, a kernel written in NKI's legacy dialect (``neuronxcc.nki``: ``nl.load`` /
``nl.store``, ``nl.arange`` indexing, engines left to the compiler), so that :mod:`.calibrate` can price kernels
whose public hardware timings were measured in that dialect (AccelOpt's NKIBench, trn1, fp32).

The emulator proper runs the NKI 0.4+ dialect only (the contest's); this is not an emulator of the legacy one: it
checks nothing and keeps no values. It records, in issue order, one :class:`~._runtime.Instruction` per instruction
the legacy call stands for, with the shapes, dtypes, buffers and tile rectangles the cost model and the scheduler
read, the way :func:`._runtime.count` records them for 0.4 kernels. What the compiler decided and the source does
not say is assumed, each assumption in :data:`ASSUMPTIONS`.

    trace = legacy_trace.run(kernel_source, input_arrays_or_shapes, generation="trn1")
"""

import contextlib
import itertools
import math
import sys
import types

import numpy as np

from ._cost import instruction_seconds
from ._memory import DTYPES
from ._runtime import Instruction, SbufTile

PARTITIONS = 128
ASSUMPTIONS = (
    "an instruction left to the compiler (engine=unknown_engine, nl.copy, nl.add/multiply/subtract with a scalar, "
    "tile arithmetic with a scalar) goes to whichever of VectorE and ScalarE is the less busy so far once it is "
    "added: a stand-in for the compiler's engine balancing, which the source does not record; on trn1 a ScalarE "
    "copy is an activation (nl.copy), as the ISA requires",
    "nl.matmul(x, y) without transpose_x: x is transposed on TensorE (an identity matmul into PSUM) and copied to "
    "SBUF before the matmul, as nl.matmul's documentation says the compiler does",
    "nl.loop_reduce and `tile[...] += tile` in SBUF: one VectorE tensor_tensor per call; `psum[...] += matmul`: "
    "the matmul accumulates in place",
    "a tile a call creates (its result not stored into a view) is a fresh SBUF tile; nl.zeros / nl.full outside "
    "PSUM is one memset per block, PSUM zeros (lazy_initialization) none",
    "a DMA's rows are the SBUF side's partitions (masked-off partitions dropped), as the emulator prices dma_copy; "
    "an instruction whose mask is the constant False is not issued",
    "nl.load_transpose2d is one DMA transpose (aws-neuron-sdk v2.23.0 general/nki/nki_perf_guide.rst, Opt #10: "
    "'much lower DMA bandwidth' than nl.load, no figure given), priced as the cost model prices dma_transpose",
    "a TensorE result (nc_matmul, nc_transpose) assigned into an SBUF tile is written to PSUM first and copied to "
    "SBUF by a tensor_copy the compiler inserts (TensorE writes only PSUM, [ISA] nc_transpose), engine balanced as "
    "above; nc_transpose of a tile up to 32x32 without an engine runs on VectorE, larger ones on TensorE (the only "
    "engine that takes them, [ISA] nc_transpose)",
    "an elementwise op of a tile with a one-column tile (nl.multiply(x, col)) is a tensor_scalar with the column as "
    "its per-partition operand, as the ISA's tensor_scalar takes it; nl.negative, nl.reciprocal and `c / tile` are "
    "tensor_scalar instructions (multiply by -1, divide reversed) with the engine left to the compiler",
    "direct allocation (ncc.sbuf.mod_alloc / ncc.psum.mod_alloc / ncc.psum.alloc): tiles allocated at one address "
    "(a block index modulo num_free_tiles) are one storage, so reusing it waits for its last reader",
)
_ALU = {"max": "maximum", "min": "minimum", "amax": "maximum", "amin": "minimum"}  # numpy's names for the ALU's


def _op_name(op):
    name = getattr(op, "__name__", None) or getattr(op, "name", None) or str(op)
    return _ALU.get(name, name)


class _Storage:
    """One on-chip block (the indices before par_dim pick it) or one HBM tensor: a serial for the scheduler; an
    SBUF block the compiler places (no direct allocation) is named by an SbufTile, which carries its size."""

    serials = itertools.count(1)

    def __init__(self, sbuf_rows=None):
        """``sbuf_rows``: (partitions, bytes per partition) of an SBUF block the compiler places."""
        self.serial = next(self.serials)
        if sbuf_rows:
            self.serial = SbufTile(self.serial, *sbuf_rows)


class Tensor:
    """An allocation: HBM (no partition dimension) or on chip (``par`` is the index of its par_dim); ``address``
    (direct allocation): the block's address, blocks at one address sharing their storage."""

    def __init__(self, shape, dtype, buffer, par=None, address=None):
        self.shape, self.dtype, self.buffer = tuple(int(s) for s in shape), np.dtype(dtype), buffer
        self.par, self.address = par, address
        self.blocks = {}

    @property
    def on_chip(self):
        return self.buffer in ("sbuf", "psum")

    def storage(self, block):
        if self.address is not None:
            return _state.addresses.setdefault((self.buffer, self.address(block)), _Storage()).serial
        if block not in self.blocks:
            sbuf = self.buffer == "sbuf"
            self.blocks[block] = _Storage(sbuf and (self.shape[self.par],
                                                    math.prod(self.shape[self.par + 1:]) * self.dtype.itemsize))
        return self.blocks[block].serial

    def __getitem__(self, key):
        return View.of(self, key)

    def __setitem__(self, key, value):
        _state.assign(View.of(self, key), value)

    def broadcast_to(self, shape):
        return self[...].broadcast_to(shape)

    def __iadd__(self, other):  # `psum_tile += nl.matmul(...)` on a name, not an index
        _state.assign(self[...], _Accumulate(other))
        return self

    # tile arithmetic on a whole tensor (`1.0 / sum_tile`): as on its whole view
    __add__ = lambda self, o: self[...] + o
    __radd__ = lambda self, o: o + self[...]
    __sub__ = lambda self, o: self[...] - o
    __rsub__ = lambda self, o: o - self[...]
    __mul__ = lambda self, o: self[...] * o
    __rmul__ = lambda self, o: o * self[...]
    __truediv__ = lambda self, o: self[...] / o
    __rtruediv__ = lambda self, o: o / self[...]
    __neg__ = lambda self: -self[...]

    def reshape(self, shape):  # an HBM tensor seen with another shape: the same bytes
        reshaped = Tensor(shape, self.dtype, self.buffer, self.par)
        reshaped.blocks = self.blocks
        return reshaped


def _components(tensor, key):
    """The index of each dimension as an int or an integer array, slices turned into aranges placed on the axes
    of the tile in order (legacy NKI: the first tile axis is the partition axis)."""
    key = key if isinstance(key, tuple) else (key,)
    if any(k is Ellipsis for k in key):
        at = key.index(Ellipsis)
        key = key[:at] + (slice(None),) * (len(tensor.shape) - len(key) + 1) + key[at + 1:]
    key = key + (slice(None),) * (len(tensor.shape) - len(key))
    axes = [i for i, k in enumerate(key) if isinstance(k, slice)]
    if axes and any(isinstance(k, np.ndarray) and k.ndim for k in key):
        raise NotImplementedError("legacy_trace: slices mixed with nl.arange indices")
    out = []
    for i, k in enumerate(key):
        if isinstance(k, slice):
            values = np.arange(*k.indices(tensor.shape[i]))
            out.append(values.reshape([-1 if a == i else 1 for a in axes]))
        else:
            out.append(np.asarray(k))
    return out


class View:
    """A tile or a piece of HBM that an instruction reads or writes: its rectangle (as Instruction.reads),
    partitions, elements per partition, dtype and buffer."""

    def __init__(self, tensor, rect, shape, partitions):
        self.tensor, self.rect, self.shape, self.partitions = tensor, rect, shape, partitions
        self.dtype, self.buffer = tensor.dtype, tensor.buffer

    @classmethod
    def of(cls, tensor, key):
        comps = _components(tensor, key)
        shape = np.broadcast_shapes(*(c.shape for c in comps)) or (1,)
        itemsize = tensor.dtype.itemsize
        if tensor.on_chip:
            p = tensor.par
            block = tuple(int(c) for c in comps[:p])
            free, dims = comps[p + 1:], tensor.shape[p + 1:]
            strides = [math.prod(dims[j + 1:]) for j in range(len(dims))]
            low = sum(int(c.min()) * s for c, s in zip(free, strides))
            high = sum(int(c.max()) * s for c, s in zip(free, strides))
            rect = (tensor.storage(block), int(comps[p].min()), int(comps[p].max()) + 1, low * itemsize,
                    (high + 1) * itemsize)
        else:
            strides = [math.prod(tensor.shape[j + 1:]) for j in range(len(tensor.shape))]
            low = sum(int(c.min()) * s for c, s in zip(comps, strides))
            high = sum(int(c.max()) * s for c, s in zip(comps, strides))
            rect = (tensor.storage(()), 0, 1, low * itemsize, (high + 1) * itemsize)
        return cls(tensor, rect, tuple(shape), shape[0])

    @property
    def free(self):
        return math.prod(self.shape[1:])

    def masked(self, mask):
        """The view with the partitions a mask leaves active (None: all)."""
        if mask is None or isinstance(mask, (bool, np.bool_)):  # a constant: all partitions or none
            return self if mask is None or mask else View(self.tensor, self.rect, self.shape, 0)
        rows = np.broadcast_to(np.asarray(mask), self.shape).reshape(self.shape[0], -1).any(axis=1)
        view = View(self.tensor, self.rect, self.shape, int(rows.sum()))
        return view

    def broadcast_to(self, shape):
        return View(self.tensor, self.rect, tuple(shape), shape[0])

    def __getitem__(self, key):  # a tile a call created, indexed again
        return self.tensor[key]

    def __setitem__(self, key, value):
        self.tensor[key] = value

    def __iadd__(self, other):
        return _Accumulate(other)

    def _binary(self, op, other, reverse=False):
        return _state.binary(op, (other, self) if reverse else (self, other))

    __add__ = lambda self, o: self._binary("add", o)
    __radd__ = lambda self, o: self._binary("add", o, True)
    __sub__ = lambda self, o: self._binary("subtract", o)
    __rsub__ = lambda self, o: self._binary("subtract", o, True)
    __mul__ = lambda self, o: self._binary("multiply", o)
    __rmul__ = lambda self, o: self._binary("multiply", o, True)
    __truediv__ = lambda self, o: self._binary("divide", o)
    __rtruediv__ = lambda self, o: self._binary("divide", o, True)  # `1.0 / tile`
    __neg__ = lambda self: self._binary("multiply", -1.0)


class _Accumulate:
    def __init__(self, value):
        self.value = value


class _Result(View):
    """What an instruction call returns: a fresh SBUF tile, unless the caller stores it into a view at once (then
    the recorded instruction is rewritten to write there)."""

    def __init__(self, index, shape, dtype, buffer="sbuf"):
        tensor = Tensor(shape, dtype, buffer, par=0)
        view = View.of(tensor, ...)
        super().__init__(tensor, view.rect, view.shape, view.partitions)
        self.index = index


class _State:
    def __init__(self, generation):
        self.generation, self.trace, self.busy = generation, [], {"vector": 0.0, "scalar": 0.0}
        self.addresses = {}  # direct allocation: (buffer, address) -> its storage

    def record(self, instruction):
        if instruction.partitions == 0:  # masked off entirely: not issued
            return
        self.trace.append(instruction)
        if instruction.engine in self.busy:
            self.busy[instruction.engine] += instruction_seconds(instruction, self.generation)

    def instruction(self, name, engine, partitions, free, dst_dtype, inputs, ops=(), stationary=0, buffer="sbuf"):
        views = [_whole(v) for v in inputs if isinstance(v, (View, Tensor))]
        return Instruction(name, engine, partitions, free, (np.dtype(dst_dtype).name, *(v.dtype.name for v in views)),
                           (buffer, *(v.buffer for v in views)), tuple(ops), stationary,
                           reads=tuple(v.rect for v in views))

    def balanced(self, make):
        """``make(engine)`` on whichever of VectorE and ScalarE is the less busy once it is added."""
        options = [make(e) for e in ("vector", "scalar")]
        return min(options, key=lambda i: self.busy[i.engine] + instruction_seconds(i, self.generation))

    def compute(self, name, engine, inputs, ops=(), dtype=None, shape=None, free=None, mask=None, data=None):
        inputs = [_whole(v) for v in inputs]
        data = data or inputs[0]
        shape = shape or data.shape
        dtype = dtype or data.dtype
        partitions = data.masked(mask).partitions
        free = data.free if free is None else free

        def make(e):
            named, named_ops = self._named(name, e, ops)
            return self.instruction(named, e, partitions, free, dtype, inputs, named_ops)
        instruction = make(engine) if engine else self.balanced(make)
        return self.result(instruction, shape, dtype)

    def result(self, instruction, shape, dtype, buffer="sbuf"):
        index = len(self.trace)
        out = _Result(index, shape, dtype, buffer)
        self.record(instruction._replace(writes=(out.rect, *instruction.writes)))
        if instruction.partitions == 0:  # masked off, not issued: nothing to store either
            out.partitions = 0
        return out

    def tensor_tensor(self, inputs, op, dtype=None):
        inputs = [_whole(v) for v in inputs]
        shape = np.broadcast_shapes(*(v.shape for v in inputs))
        return self.compute("tensor_tensor", "vector", list(inputs), ops=(op,), dtype=dtype, shape=shape,
                            free=math.prod(shape[1:]))

    def binary(self, op, operands, dtype=None, mask=None):
        """``op`` of two operands: two tiles (a tensor_tensor), or a tile and a scalar or a one-column tile (a
        tensor_scalar, its engine left to the compiler)."""
        x, y = (_whole(v) for v in operands)
        tiles = [v for v in (x, y) if isinstance(v, View)]
        if len(tiles) == 2 and (min(x.free, y.free) > 1 or x.free == y.free == 1):
            return self.tensor_tensor((x, y), op, dtype)
        data = max(tiles, key=lambda v: v.free)
        return self.compute("tensor_scalar", None, tiles, ops=(op,), dtype=dtype, mask=mask,
                            shape=data.shape, free=data.free, data=data)

    def dma(self, dst, src, mask=None):
        dst, src = _whole(dst), _whole(src)
        rows = (dst if dst.buffer == "sbuf" else src).masked(mask)
        return self.instruction("dma_copy", "dma", rows.partitions, rows.free, dst.dtype, [src],
                                buffer=dst.buffer)._replace(writes=(dst.rect,))

    def assign(self, view, value):
        accumulate = isinstance(value, _Accumulate)
        value = _whole(value.value if accumulate else value)
        if isinstance(value, View) and value.partitions == 0:  # its instruction was masked off: nothing to store
            return
        fresh = isinstance(value, _Result) and value.index == len(self.trace) - 1
        from_tensor_engine = fresh and self.trace[-1].engine == "tensor"
        if from_tensor_engine and view.buffer == "sbuf":  # TensorE writes PSUM: the compiler copies it to SBUF
            self.record(self._evict(view, value, accumulate))
        elif fresh and (not accumulate or from_tensor_engine):
            last = self.trace[-1]  # the call just recorded writes here (a matmul accumulates), not to a fresh tile
            self.trace[-1] = last._replace(writes=(view.rect, *last.writes[1:]),
                                           buffers=(view.buffer, *last.buffers[1:]), accumulate=accumulate)
        elif accumulate:
            self.record(self.instruction("tensor_tensor", "vector", view.partitions, view.free, view.dtype,
                                         [view, value], ("add",))._replace(writes=(view.rect,)))
        elif isinstance(value, View):  # a tile copied into a view
            self.record(self.instruction("tensor_copy", "vector", view.partitions, view.free, view.dtype,
                                         [value])._replace(writes=(view.rect,)))
        elif isinstance(value, (int, float)):  # a constant fill
            self.record(self.instruction("memset", "vector", view.partitions, view.free, view.dtype, [],
                                         ("zero",) if value == 0 else ())._replace(writes=(view.rect,)))
        else:
            raise NotImplementedError(f"legacy_trace: cannot store {type(value).__name__} into a tile")

    def _evict(self, view, psum, accumulate):
        """The copy (or, into an accumulating SBUF tile, the add) from a TensorE result's PSUM tile to ``view``."""
        if accumulate:
            return self.instruction("tensor_tensor", "vector", view.partitions, view.free, view.dtype, [view, psum],
                                    ("add",))._replace(writes=(view.rect,))

        def make(e):
            named, ops = self._named("tensor_copy", e, ())
            return self.instruction(named, e, view.partitions, view.free, view.dtype, [psum], ops)
        return self.balanced(make)._replace(writes=(view.rect,))

    def _named(self, name, engine, ops):
        """(name, ops) of an instruction on ``engine``: on trn1 a ScalarE copy is an activation (copy)."""
        if engine == "scalar" and name == "tensor_copy" and self.generation == "trn1":
            return "activation", ("copy",)
        return name, ops


_state = None


def _masked_off(mask):
    """A mask that is the constant False: the instruction is not issued (a TensorE mask is otherwise not priced)."""
    return isinstance(mask, (bool, np.bool_)) and not mask


def _whole(value):
    return value[...] if isinstance(value, Tensor) else value


def _new_tensor(shape, dtype, buffer, lazy=False, fill=True):
    par = next((i for i, s in enumerate(shape) if isinstance(s, _ParDim)), None)
    address = getattr(buffer, "address", None)
    buffer = getattr(buffer, "name", buffer) or "sbuf"
    if buffer in ("sbuf", "psum") and par is None:
        par = 0
    tensor = Tensor(shape, dtype, buffer, par, address)
    if fill and buffer == "sbuf" and not lazy:
        for block in itertools.product(*(range(s) for s in tensor.shape[:par])):
            view = tensor[block]
            _state.record(_state.instruction("memset", "vector", view.partitions, view.free, tensor.dtype, [], ())
                          ._replace(writes=(view.rect,)))
    return tensor


class _ParDim(int):
    pass


class _Buffer:
    """A buffer as passed to nl.ndarray; ``address(block)``: direct allocation's address of each block."""

    def __init__(self, name, address=None):
        self.name, self.address = name, address


def _allocator(name):
    """ncc.sbuf / ncc.psum: mod_alloc (a base and, per block index, how many tiles it rotates over) and alloc (a
    function of the block index)."""
    def mod_alloc(base_addr=0, base_bank=0, num_free_tiles=(), num_bank_tiles=()):
        rotate = tuple(num_free_tiles or num_bank_tiles)
        return _Buffer(name, lambda block: (base_addr, base_bank, tuple(
            b % (rotate[i] if i < len(rotate) else 1) for i, b in enumerate(block))))
    return types.SimpleNamespace(mod_alloc=mod_alloc, alloc=lambda address: _Buffer(
        name, lambda block: address(idx=block, pdim_size=None, fdim_size=None)))


class _Grid:
    """nl.mgrid[0:P, 0:F]: open index grids (they broadcast like numpy's mgrid), named .p and .x as well."""

    def __getitem__(self, key):
        return _GridIndex(np.ogrid[key])


class _GridIndex(tuple):
    p = property(lambda self: self[0])
    x = property(lambda self: self[1])


class _Op:
    """An operator both passed as op= (its name is what the trace records) and, for some, called as nl.add(x, y)."""

    def __init__(self, name, call=None):
        self.__name__, self.call = name, call

    def __call__(self, *args, **kwargs):
        return self.call(*args, **kwargs)


def _elementwise(op):
    return lambda x, y, dtype=None, mask=None: _state.binary(op, (x, y), dtype, mask)


def _activation(op):
    return lambda x, dtype=None, mask=None: _state.compute("activation", "scalar", [x], ops=(op,), dtype=dtype)


def _load(src, dtype=None, mask=None):
    dst = _Result(len(_state.trace), src.shape, dtype or src.dtype)
    _state.record(_state.dma(dst, src, mask))
    return dst


def _load_transpose2d(src, dtype=None, mask=None):
    """A DMA that writes the HBM rectangle (R, C) to SBUF as (C, R) (see ASSUMPTIONS)."""
    src = _whole(src)
    dtype = dtype or src.dtype
    dst = _Result(len(_state.trace), src.shape[::-1], dtype)
    rows = src.masked(mask)
    _state.record(_state.instruction("dma_transpose", "dma", src.free if rows.partitions else 0, src.shape[0],
                                     dtype, [src])._replace(writes=(dst.rect,)))
    return dst


def _matmul(x, y, transpose_x=False, mask=None):
    if not transpose_x:  # x (M, K) -> x.T (K, M): a TensorE transpose into PSUM, copied to SBUF
        t = _state.result(_state.instruction("nc_matmul", "tensor", x.partitions, PARTITIONS, np.float32, [x],
                                             stationary=x.free, buffer="psum"), (x.free, x.partitions), np.float32,
                          "psum")
        x = _state.compute("tensor_copy", None, [t], dtype=x.dtype)
    return _state.result(_state.instruction("nc_matmul", "tensor", x.partitions, y.free, np.float32, [x, y],
                                            stationary=x.free, buffer="psum"), (x.free, y.free), np.float32, "psum")


def _language():
    nl = types.ModuleType("neuronxcc.nki.language")
    nl.sbuf, nl.psum, nl.hbm, nl.shared_hbm, nl.private_hbm = (_Buffer(n) for n in (
        "sbuf", "psum", "private_hbm", "shared_hbm", "private_hbm"))
    nl.float32, nl.bfloat16, nl.float16, nl.int32 = np.float32, DTYPES["bfloat16"], np.float16, np.int32
    nl.float8_e4m3 = DTYPES["float8_e4m3"]
    nl.tile_size = types.SimpleNamespace(pmax=PARTITIONS, psum_fmax=512, gemm_stationary_fmax=128,
                                         gemm_moving_fmax=512)
    nl.par_dim = _ParDim
    nl.arange = np.arange
    nl.mgrid = _Grid()
    nl.ds = lambda start, size: slice(start, start + size)
    nl.program_id = lambda axis: 0  # one program of the launch grid is traced
    nl.affine_range = nl.sequential_range = nl.static_range = range
    for name in ("add", "subtract", "multiply", "maximum", "minimum", "divide"):
        setattr(nl, name, _Op(name, _elementwise(name)))
    for name in ("exp", "square", "rsqrt", "sqrt", "tanh", "sigmoid", "gelu", "silu", "relu", "log", "copy", "abs"):
        setattr(nl, name, _Op(name, _activation(name)))
    nl.max = _Op("maximum")
    nl.negative = lambda x, dtype=None, mask=None: _state.binary("multiply", (x, -1.0), dtype, mask)
    nl.reciprocal = lambda x, dtype=None, mask=None: _state.binary("divide", (1.0, x), dtype, mask)
    nl.load_transpose2d = _load_transpose2d
    nl.copy.call = lambda x, dtype=None, mask=None: _state.compute("tensor_copy", None, [x], dtype=dtype, mask=mask)
    nl.ndarray = lambda shape, dtype, buffer=None, name="": _new_tensor(shape, dtype, buffer, fill=False)
    nl.zeros = lambda shape, dtype, buffer=None, name="", lazy_initialization=False: _new_tensor(
        shape, dtype, buffer, lazy=lazy_initialization)
    nl.full = lambda shape, fill_value, dtype, buffer=None, name="": _new_tensor(shape, dtype, buffer)
    nl.load = _load
    nl.store = lambda dst, value, mask=None: _state.record(_state.dma(dst, value, mask))
    nl.sum = lambda x, axis, dtype=None, mask=None, keepdims=False: _state.compute(
        "tensor_reduce", "vector", [x], ops=("add",), dtype=dtype, shape=(x.shape[0], 1))
    nl.matmul = _matmul
    nl.loop_reduce = lambda x, op, loop_indices, mask=None, dtype=None: _state.compute(
        "tensor_tensor", "vector", [x], ops=(_op_name(op),), dtype=dtype)
    nl.shared_constant = lambda array, dtype=None: Tensor(np.shape(array), dtype or np.asarray(array).dtype,
                                                         "shared_hbm")
    return nl


_ENGINES = {"unknown_engine": None, "vector_engine": "vector", "scalar_engine": "scalar", "gpsimd_engine": "gpsimd",
            "tensor_engine": "tensor"}


def _isa():
    nisa = types.ModuleType("neuronxcc.nki.isa")
    for name in _ENGINES:
        setattr(nisa, name, name)

    def tensor_copy(src, mask=None, dtype=None, engine=None, **_):
        return _state.compute("tensor_copy", _ENGINES.get(engine), [src], dtype=dtype, mask=mask)

    def tensor_scalar(data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False, dtype=None,
                      mask=None, engine=None, **_):
        ops = (_op_name(op0),) + ((_op_name(op1),) if op1 is not None else ())
        inputs = [data] + [o for o in (operand0, operand1) if isinstance(o, (View, Tensor))]
        return _state.compute("tensor_scalar", _ENGINES.get(engine), inputs, ops=ops, dtype=dtype, mask=mask)

    def tensor_tensor(data1, data2, op, dtype=None, mask=None, **_):
        return _state.tensor_tensor((data1, data2), _op_name(op), dtype)

    def tensor_reduce(op, data, axis, mask=None, dtype=None, negate=False, keepdims=False, **_):
        return _state.compute("tensor_reduce", "vector", [data], ops=(_op_name(op),), dtype=dtype,
                              shape=(data.shape[0], 1))

    def reciprocal(data, mask=None, dtype=None, **_):
        return _state.compute("reciprocal", "vector", [data], dtype=dtype, mask=mask)

    def memset(shape, value, dtype, mask=None, engine=None, **_):
        return _state.result(_state.instruction("memset", "vector", shape[0], math.prod(shape[1:]), dtype, []),
                             tuple(shape), dtype)

    def tensor_tensor_scan(data0, data1, initial, op0, op1, dtype=None, mask=None, **_):
        return _state.compute("tensor_tensor_scan", "vector", [data0, data1], ops=(_op_name(op0), _op_name(op1)),
                              dtype=dtype)

    for fn in (tensor_copy, tensor_scalar, tensor_tensor, tensor_reduce, reciprocal, memset, tensor_tensor_scan):
        setattr(nisa, fn.__name__, fn)
    nisa.nc_matmul, nisa.nc_transpose, nisa.activation = _nc_matmul, _nc_transpose, _activation_call
    nisa.activation_reduce, nisa.tensor_scalar_reduce = _activation_reduce, _tensor_scalar_reduce
    nisa.reduce_cmd = types.SimpleNamespace(idle=0, reset=1, reduce=2, reset_reduce=3)
    nisa.nc_version = types.SimpleNamespace(gen2=2, gen3=3, gen4=4)
    nisa.get_nc_version = lambda: {"trn1": 2, "trn2": 3, "trn3": 4}[_state.generation]
    return nisa


def _nc_matmul(stationary, moving, is_transpose=False, mask=None, perf_mode=None, **_):
    stationary, moving = _whole(stationary), _whole(moving)
    # double row (trn2, fp8): two rows of 128 contracted per pass at twice the throughput ([ISA] 2.30 nc_matmul
    # perf_mode: "2x matmul throughput"): the time of one pass over the last (free) axis
    rows, m, n = ((stationary.partitions, stationary.shape[-1], moving.shape[-1]) if perf_mode else
                  (stationary.partitions, stationary.free, moving.free))
    return _state.result(_state.instruction("nc_matmul", "tensor", 0 if _masked_off(mask) else rows, n,
                                            np.float32, [stationary, moving], stationary=m, buffer="psum"),
                         (m, n), np.float32, "psum")


def _nc_transpose(data, mask=None, dtype=None, engine=None, **_):
    data = _whole(data)
    small = data.partitions <= 32 and data.free <= 32  # [ISA] nc_transpose: VectorE takes up to (32, 32)
    on_vector = engine == "vector_engine" or engine in (None, "unknown_engine") and small
    shape = (data.free, data.partitions)
    if on_vector:
        return _state.compute("nc_transpose", "vector", [data], dtype=dtype, shape=shape, mask=mask)
    dtype = dtype or data.dtype
    rows = 0 if _masked_off(mask) else data.partitions
    return _state.result(_state.instruction("nc_transpose", "tensor", rows, data.free, dtype, [data], buffer="psum"),
                         shape, dtype, "psum")


def _activation_call(op, data, bias=None, scale=1.0, mask=None, dtype=None, reduce_res=None, **_):
    inputs = [data] + [o for o in (bias, scale) if isinstance(o, (View, Tensor))]
    result = _state.compute("activation", "scalar", inputs, ops=(_op_name(op),), dtype=dtype, mask=mask)
    return _reduced_into(result, reduce_res, accumulator=True)


def _activation_reduce(op, data, reduce_op, reduce_res, bias=None, scale=1.0, mask=None, dtype=None, **_):
    return _activation_call(op, data, bias, scale, mask, dtype, reduce_res)


def _tensor_scalar_reduce(data, op0, operand0, reduce_op, reduce_res, reverse0=False, dtype=None, mask=None, **_):
    inputs = [data] + [o for o in (operand0,) if isinstance(o, (View, Tensor))]
    result = _state.compute("tensor_scalar_reduce", "vector", inputs, ops=(_op_name(op0), _op_name(reduce_op)),
                            dtype=dtype, mask=mask)
    return _reduced_into(result, reduce_res)


def _reduced_into(result, reduce_res, accumulator=False):
    """The instruction that made ``result`` also writes its free-axis reduction to ``reduce_res`` (ScalarE: from its
    accumulation registers, [ISA] activation_reduce's "+ MIN_II")."""
    if reduce_res is not None and result.partitions:
        last = _state.trace[-1]
        _state.trace[-1] = last._replace(writes=(*last.writes, _whole(reduce_res).rect),
                                         reads_accumulator=accumulator)
    return result


def _modules():
    nki = types.ModuleType("neuronxcc.nki")
    nki.language, nki.isa = _language(), _isa()
    nki.typing = types.ModuleType("neuronxcc.nki.typing")
    nki.compiler = types.ModuleType("neuronxcc.nki.compiler")
    nki.compiler.sbuf, nki.compiler.psum = _allocator("sbuf"), _allocator("psum")
    nki.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
    nki.trace = nki.jit
    neuronxcc = types.ModuleType("neuronxcc")
    neuronxcc.nki = nki
    return {"neuronxcc": neuronxcc, "neuronxcc.nki": nki, "neuronxcc.nki.language": nki.language,
            "neuronxcc.nki.isa": nki.isa, "neuronxcc.nki.typing": nki.typing, "neuronxcc.nki.compiler": nki.compiler}


@contextlib.contextmanager
def _legacy_modules():
    saved = {name: sys.modules.get(name) for name in _modules()}
    sys.modules.update(_modules())
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def run(source, inputs, generation="trn1", function="kernel"):
    """The trace of ``function`` in the legacy-dialect ``source`` called on HBM tensors shaped like ``inputs``
    (arrays; any other argument, such as a block size, is passed as it is), priced for engine balancing on
    ``generation``."""
    global _state
    _state = state = _State(generation)
    try:
        with _legacy_modules():
            namespace = {"__name__": "legacy_kernel"}
            exec(compile(source, "<legacy kernel>", "exec"), namespace)
            namespace[function](*(Tensor(a.shape, a.dtype, "shared_hbm") if isinstance(a, np.ndarray) else a
                                  for a in inputs))
    finally:  # a kernel that raises leaves no trace behind for the next run
        _state = None
    return [i._replace(launch=1) for i in state.trace]

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
from ._runtime import Instruction

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
    "a DMA's rows are the SBUF side's partitions (masked-off partitions dropped), as the emulator prices dma_copy",
)
_ALU = {"max": "maximum", "min": "minimum", "amax": "maximum", "amin": "minimum"}  # numpy's names for the ALU's


def _op_name(op):
    name = getattr(op, "__name__", None) or getattr(op, "name", None) or str(op)
    return _ALU.get(name, name)


class _Storage:
    """One on-chip block (the indices before par_dim pick it) or one HBM tensor: a serial for the scheduler."""

    serials = itertools.count(1)

    def __init__(self):
        self.serial = next(self.serials)


class Tensor:
    """An allocation: HBM (no partition dimension) or on chip (``par`` is the index of its par_dim)."""

    def __init__(self, shape, dtype, buffer, par=None):
        self.shape, self.dtype, self.buffer = tuple(int(s) for s in shape), np.dtype(dtype), buffer
        self.par = par
        self.blocks = {}

    @property
    def on_chip(self):
        return self.buffer in ("sbuf", "psum")

    def storage(self, block):
        return self.blocks.setdefault(block, _Storage()).serial

    def __getitem__(self, key):
        return View.of(self, key)

    def __setitem__(self, key, value):
        _state.assign(View.of(self, key), value)

    def broadcast_to(self, shape):
        return self[...].broadcast_to(shape)

    def __iadd__(self, other):  # `psum_tile += nl.matmul(...)` on a name, not an index
        _state.assign(self[...], _Accumulate(other))
        return self

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
        if mask is None or isinstance(mask, bool):
            return self
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

    def _scalar_op(self, op, other, reverse=False):
        if isinstance(other, View):
            return _state.tensor_tensor((other, self) if reverse else (self, other), op)
        return _state.compute("tensor_scalar", None, [self], ops=(op,))

    __add__ = lambda self, o: self._scalar_op("add", o)
    __radd__ = lambda self, o: self._scalar_op("add", o, True)
    __sub__ = lambda self, o: self._scalar_op("subtract", o)
    __rsub__ = lambda self, o: self._scalar_op("subtract", o, True)
    __mul__ = lambda self, o: self._scalar_op("multiply", o)
    __rmul__ = lambda self, o: self._scalar_op("multiply", o, True)
    __truediv__ = lambda self, o: self._scalar_op("divide", o)


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

    def record(self, instruction):
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

    def compute(self, name, engine, inputs, ops=(), dtype=None, shape=None, free=None, mask=None):
        inputs = [_whole(v) for v in inputs]
        data = inputs[0]
        shape = shape or data.shape
        dtype = dtype or data.dtype
        partitions = data.masked(mask).partitions
        free = data.free if free is None else free

        def make(e):
            scalar_copy = e == "scalar" and name == "tensor_copy" and self.generation == "trn1"
            return self.instruction("activation" if scalar_copy else name, e, partitions, free, dtype, inputs,
                                    ("copy",) if scalar_copy else ops)
        instruction = make(engine) if engine else self.balanced(make)
        return self.result(instruction, shape, dtype)

    def result(self, instruction, shape, dtype, buffer="sbuf"):
        index = len(self.trace)
        out = _Result(index, shape, dtype, buffer)
        self.record(instruction._replace(writes=(out.rect,)))
        return out

    def tensor_tensor(self, inputs, op, dtype=None):
        inputs = [_whole(v) for v in inputs]
        shape = np.broadcast_shapes(*(v.shape for v in inputs))
        return self.compute("tensor_tensor", "vector", list(inputs), ops=(op,), dtype=dtype, shape=shape,
                            free=math.prod(shape[1:]))

    def dma(self, dst, src, mask=None):
        dst, src = _whole(dst), _whole(src)
        rows = (dst if dst.buffer == "sbuf" else src).masked(mask)
        return self.instruction("dma_copy", "dma", rows.partitions, rows.free, dst.dtype, [src],
                                buffer=dst.buffer)._replace(writes=(dst.rect,))

    def assign(self, view, value):
        accumulate = isinstance(value, _Accumulate)
        value = value.value if accumulate else value
        value = _whole(value)
        fresh = isinstance(value, _Result) and value.index == len(self.trace) - 1
        if fresh and (not accumulate or self.trace[-1].engine == "tensor"):
            last = self.trace[-1]  # the call just recorded writes here (a matmul accumulates), not to a fresh tile
            self.trace[-1] = last._replace(writes=(view.rect,), buffers=(view.buffer, *last.buffers[1:]))
        elif accumulate:
            self.record(self.instruction("tensor_tensor", "vector", view.partitions, view.free, view.dtype,
                                         [view, value], ("add",))._replace(writes=(view.rect,)))
        elif isinstance(value, View):  # a tile copied into a view
            self.record(self.instruction("tensor_copy", "vector", view.partitions, view.free, view.dtype,
                                         [value])._replace(writes=(view.rect,)))
        else:
            raise NotImplementedError(f"legacy_trace: cannot store {type(value).__name__} into a tile")


_state = None


def _whole(value):
    return value[...] if isinstance(value, Tensor) else value


def _new_tensor(shape, dtype, buffer, lazy=False, fill=True):
    par = next((i for i, s in enumerate(shape) if isinstance(s, _ParDim)), None)
    buffer = getattr(buffer, "name", buffer) or "sbuf"
    if buffer in ("sbuf", "psum") and par is None:
        par = 0
    tensor = Tensor(shape, dtype, buffer, par)
    if fill and buffer == "sbuf" and not lazy:
        for block in itertools.product(*(range(s) for s in tensor.shape[:par])):
            view = tensor[block]
            _state.record(_state.instruction("memset", "vector", view.partitions, view.free, tensor.dtype, [], ())
                          ._replace(writes=(view.rect,)))
    return tensor


class _ParDim(int):
    pass


class _Buffer:
    def __init__(self, name):
        self.name = name


class _Op:
    """An operator both passed as op= (its name is what the trace records) and, for some, called as nl.add(x, y)."""

    def __init__(self, name, call=None):
        self.__name__, self.call = name, call

    def __call__(self, *args, **kwargs):
        return self.call(*args, **kwargs)


def _elementwise(op):
    def call(x, y, dtype=None, mask=None):
        if isinstance(x, View) and isinstance(y, View):
            return _state.tensor_tensor((x, y), op, dtype)
        tile = x if isinstance(x, View) else y
        return _state.compute("tensor_scalar", None, [tile], ops=(op,), dtype=dtype, mask=mask)
    return call


def _activation(op):
    return lambda x, dtype=None, mask=None: _state.compute("activation", "scalar", [x], ops=(op,), dtype=dtype)


def _load(src, dtype=None, mask=None):
    dst = _Result(len(_state.trace), src.shape, dtype or src.dtype)
    _state.record(_state.dma(dst, src, mask))
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
    nl.tile_size = types.SimpleNamespace(pmax=PARTITIONS, psum_fmax=512, gemm_stationary_fmax=128,
                                         gemm_moving_fmax=512)
    nl.par_dim = _ParDim
    nl.arange = np.arange
    nl.affine_range = nl.sequential_range = nl.static_range = range
    for name in ("add", "subtract", "multiply", "maximum", "minimum"):
        setattr(nl, name, _Op(name, _elementwise(name)))
    for name in ("exp", "square", "rsqrt", "sqrt", "tanh", "sigmoid", "gelu", "silu", "relu", "log", "copy"):
        setattr(nl, name, _Op(name, _activation(name)))
    nl.max, nl.divide = _Op("maximum"), _Op("divide")
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

    def nc_matmul(stationary, moving, is_transpose=False, mask=None, **_):
        return _state.result(_state.instruction("nc_matmul", "tensor", stationary.partitions, moving.free,
                                                np.float32, [stationary, moving], stationary=stationary.free,
                                                buffer="psum"), (stationary.free, moving.free), np.float32, "psum")

    def tensor_scalar(data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False, dtype=None,
                      mask=None, engine=None, **_):
        ops = (_op_name(op0),) + ((_op_name(op1),) if op1 is not None else ())
        inputs = [data] + [o for o in (operand0, operand1) if isinstance(o, View)]
        return _state.compute("tensor_scalar", _ENGINES.get(engine), inputs, ops=ops, dtype=dtype, mask=mask)

    def tensor_tensor(data1, data2, op, dtype=None, mask=None, **_):
        return _state.tensor_tensor((data1, data2), _op_name(op), dtype)

    def activation(op, data, bias=None, scale=1.0, mask=None, dtype=None, **_):
        inputs = [data] + [o for o in (bias, scale) if isinstance(o, View)]
        return _state.compute("activation", "scalar", inputs, ops=(_op_name(op),), dtype=dtype, mask=mask)

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

    for fn in (nc_matmul, tensor_scalar, tensor_tensor, activation, tensor_reduce, reciprocal, memset,
               tensor_tensor_scan):
        setattr(nisa, fn.__name__, fn)
    return nisa


def _modules():
    nki = types.ModuleType("neuronxcc.nki")
    nki.language, nki.isa = _language(), _isa()
    nki.typing = types.ModuleType("neuronxcc.nki.typing")
    nki.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
    nki.trace = nki.jit
    neuronxcc = types.ModuleType("neuronxcc")
    neuronxcc.nki = nki
    return {"neuronxcc": neuronxcc, "neuronxcc.nki": nki, "neuronxcc.nki.language": nki.language,
            "neuronxcc.nki.isa": nki.isa, "neuronxcc.nki.typing": nki.typing}


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
    (arrays), priced for engine balancing on ``generation``."""
    global _state
    _state = state = _State(generation)
    try:
        with _legacy_modules():
            namespace = {"__name__": "legacy_kernel"}
            exec(compile(source, "<legacy kernel>", "exec"), namespace)
            namespace[function](*(Tensor(np.shape(a), np.asarray(a).dtype, "shared_hbm") for a in inputs))
    finally:  # a kernel that raises leaves no trace behind for the next run
        _state = None
    return [i._replace(launch=1) for i in state.trace]

"""Memory: buffers, dtypes, tensors and views, and the bookkeeping behind the memory rules.

Model
-----
- Every allocation (``nl.ndarray`` or a kernel argument) is a *storage*: a numpy array of the tensor's
  dtype (bf16/fp8 through ``ml_dtypes``), a boolean *written* mask with one flag per byte (shape
  ``array.shape + (itemsize,)``, so that a view reinterpreting the bytes as another dtype, ``ap(dtype=)``,
  still tracks what was written), and for PSUM a *matmul-written* mask, one flag per element, that
  drives ``nc_matmul``'s overwrite-then-accumulate rule. New storage is
  filled with NaN (integers with 4), as the official simulator does (aws-neuron-sdk 3afa0fdf
  nki/guides/nki_simulator.rst l. 212-221). An element whose written flag is False is *poison*: it reads as
  NaN whatever its dtype, an instruction that read poison leaves its NaN results unwritten (so poison
  reaches integer tiles and survives copies, sorts and comparisons), and a kernel output that carries
  poison comes back as NaN, or is refused where its dtype has no NaN. Only an address computed from poison
  (``ap(scalar_offset=)``) is refused at once.
- An ``NkiTensor`` is a view: the same numpy view taken of the data and of the masks, so writes through
  any view land in the storage. Slicing follows NKI: on-chip tensors keep the partition dim (an
  integer index there keeps size 1) and stay at least 2-D; HBM tensors drop integer-indexed dims.
- Capacity is checked the way a compiler allocates: an on-chip tile is live from the first instruction
  that touches it to the last one (instruction indices on its core), occupying
  ``prod(shape[1:]) * itemsize`` bytes in every partition. When a kernel returns, the emulator finds
  the instruction with the most live bytes and raises if SBUF (per-target budget) or PSUM (nl.tile_size.psum_num_banks
  banks of 2 KiB per partition, each PSUM tile taking whole banks) was exceeded there. A tile allocated but never
  used costs nothing.
- Addresses: an on-chip tile sits at ``(first partition, first byte)`` (``nl.ndarray(address=)``, else (0, 0));
  every instruction operand is checked where it starts (``_check_on_chip_access``).
"""

import itertools
import os
import sys
from enum import Enum

import ml_dtypes
import numpy as np

from ._runtime import (NkiValidationError, PARTITIONS, PSUM_BANK_BYTES, PSUM_PARTITION_BYTES, SbufTile, current,
                       psum_num_banks, target)
from ._unemulated import UnemulatedDType


class MemoryRegion(Enum):
    """Where a tensor lives. ``nl.hbm`` is an alias of ``private_hbm``."""

    sbuf = "sbuf"
    psum = "psum"
    private_hbm = "private_hbm"
    shared_hbm = "shared_hbm"


SBUF, PSUM = MemoryRegion.sbuf, MemoryRegion.psum
HBM = (MemoryRegion.private_hbm, MemoryRegion.shared_hbm)
ON_CHIP = (SBUF, PSUM)

DTYPES = {
    "bool_": np.dtype(np.bool_),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "uint8": np.dtype(np.uint8),
    "uint16": np.dtype(np.uint16),
    "uint32": np.dtype(np.uint32),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3": np.dtype(ml_dtypes.float8_e4m3),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}
_SUPPORTED = set(DTYPES.values())
FP32 = DTYPES["float32"]


def as_dtype(dtype, what="dtype"):
    """Normalise an NKI dtype (``nl.bfloat16``, ``np.float32``, ``"bfloat16"``, a tensor's dtype)."""
    if isinstance(dtype, UnemulatedDType):
        raise NotImplementedError(f"{what}: {dtype} is not emulated by the CPU NKI emulator")
    try:
        result = DTYPES[dtype] if isinstance(dtype, str) and dtype in DTYPES else np.dtype(dtype)
    except TypeError:
        result = None
    if result not in _SUPPORTED:
        raise NkiValidationError(f"{what}: {dtype!r} is not an NKI dtype the emulator supports "
                                 f"({', '.join(DTYPES)})")
    return result


def _sentinel(dtype):
    return 4 if dtype.kind in "iu" else (False if dtype.kind == "b" else np.nan)


_PACKAGE = __name__.rpartition(".")[0]


def _caller_site():
    """file:line of the first frame outside the emulator (where the kernel allocated a tile)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_PACKAGE + "."):
        frame = frame.f_back
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}" if frame is not None else "?"


class _Liveness:
    """First and last instruction index at which an on-chip tile was touched (-1: never)."""

    __slots__ = ("first", "last", "nbytes", "buffer", "label")

    def __init__(self, nbytes, buffer, label):
        self.first = self.last = -1
        self.nbytes, self.buffer, self.label = nbytes, buffer, label


class _Storage:
    __slots__ = ("array", "written", "matmul_written", "unwritten", "buffer", "name", "label", "liveness", "serial",
                 "address")
    _serials = itertools.count()  # each storage's identity in the trace (Instruction.reads/writes)

    def __init__(self, array, buffer, name, label, initialised):
        self.array = array
        self.buffer = buffer
        self.name = name
        self.label = label  # for messages: name, shape, dtype, buffer, allocation site
        self.unwritten = 0 if initialised else array.nbytes  # bytes not yet written; 0: all of them
        self.written = None if initialised else np.zeros(array.shape + (array.itemsize,), np.bool_)
        self.matmul_written = np.zeros(array.shape, np.bool_) if buffer is PSUM else None
        self.liveness = None
        self.serial = next(_Storage._serials)
        self.address = (0, 0)  # on chip: (first partition, first byte in each partition), as nl.ndarray(address=)


class NkiTensor:
    """A view of a storage: shape, dtype and buffer of an NKI tensor (kernel argument or allocation)."""

    __slots__ = ("_storage", "_data", "_written", "_matmul_written", "_indirect", "_subscript", "_outside", "_rows")

    def __init__(self, storage, data, written, matmul_written, indirect=False, outside=None, rows=None):
        self._storage, self._data, self._written, self._matmul_written = storage, data, written, matmul_written
        self._indirect = indirect  # made by ap(scalar_offset=...): addressed through a runtime index
        self._rows = rows  # made by ap(vector_offset=...): a _VectorRows; _data is then a gathered copy
        self._outside = outside  # made by an ap() that leaves its storage: why (only an instruction refuses it)
        self._subscript = None  # made by t[key]: (KLR's shape of it, its integer-indexed dims, strided?)

    shape = property(lambda self: self._data.shape)
    dtype = property(lambda self: self._data.dtype)
    buffer = property(lambda self: self._storage.buffer)
    ndim = property(lambda self: self._data.ndim)
    size = property(lambda self: self._data.size)
    name = property(lambda self: self._storage.name)
    strides = property(lambda self: tuple(s // self.dtype.itemsize for s in self._data.strides))
    offset = property(lambda self: (self._data.__array_interface__["data"][0]
                                    - self._storage.array.__array_interface__["data"][0]) // self.dtype.itemsize)

    def get_pattern(self):
        """The view as ``[[stride, count], ...]`` in elements, one pair per dim: what ``ap`` takes."""
        pattern = []
        for stride, count in zip(self.strides, self.shape):
            pattern.append([stride, count])
        return pattern

    def is_contiguous(self):
        """Whether the view covers its elements in row-major order without gaps; on chip the partition
        dim does not count (partitions are separate memories)."""
        expected = 1
        first = 1 if self.buffer in ON_CHIP else 0
        for stride, count in reversed(list(zip(self.strides, self.shape))[first:]):
            if count != 1 and stride != expected:
                return False
            expected *= count
        return True

    def is_indirect(self):
        return self._indirect

    def slice(self, dim, start, end, step=1):
        """``t[..., start:end:step, ...]`` along ``dim``."""
        return self[(slice(None),) * dim + (slice(start, end, step),)]

    def select(self, dim, index):
        """``t[..., index, ...]`` along ``dim``, dropping it; a tensor index (dynamic) is not emulated."""
        if isinstance(index, NkiTensor):
            raise NotImplementedError("NkiTensor.select with a tensor index (dynamic select) is not emulated")
        return self.slice(dim, index, index + 1).squeeze_dim(dim)

    def expand_dim(self, dim):
        """A size-1 dim inserted at ``dim`` (not before an on-chip partition dim)."""
        self._check_not_partition("expand_dim", dim)
        return self.reshape(self.shape[:dim] + (1,) + self.shape[dim:])

    def squeeze_dim(self, dim):
        """The size-1 dim ``dim`` removed (not an on-chip partition dim)."""
        self._check_not_partition("squeeze_dim", dim)
        if self.shape[dim] != 1:
            raise NkiValidationError(f"squeeze_dim: dim {dim} of {self.shape} is not of size 1")
        return self.reshape(self.shape[:dim] + self.shape[dim + 1:])

    def flatten_dims(self, start_dim, end_dim):
        """Dims ``start_dim..end_dim`` (inclusive) merged into one; they must be contiguous."""
        self._check_not_partition("flatten_dims", start_dim)
        merged = int(np.prod(self.shape[start_dim:end_dim + 1]))
        return self.reshape(self.shape[:start_dim] + (merged,) + self.shape[end_dim + 1:])

    def reshape_dim(self, dim, shape):
        """Dim ``dim`` split into ``shape`` (one entry may be -1)."""
        shape = tuple(int(s) for s in shape)
        if -1 in shape:
            known = -int(np.prod(shape))
            shape = tuple(self.shape[dim] // known if s == -1 else s for s in shape)
        if int(np.prod(shape)) != self.shape[dim]:
            raise NkiValidationError(f"reshape_dim: {shape} does not multiply to dim {dim} of {self.shape}")
        if len(shape) > 1:
            self._check_not_partition("reshape_dim", dim)
        return self.reshape(self.shape[:dim] + shape + self.shape[dim + 1:])

    def broadcast(self, dim, size):
        """The size-1 dim ``dim`` repeated ``size`` times, without copying (a read-only view)."""
        self._check_not_partition("broadcast", dim)
        if self.shape[dim] != 1:
            raise NkiValidationError(f"broadcast: dim {dim} of {self.shape} is not of size 1")
        shape = self.shape[:dim] + (int(size),) + self.shape[dim + 1:]
        return self._view(fn=lambda a, trailing: np.broadcast_to(a, shape + a.shape[a.ndim - trailing:]))

    def view(self, dtype):
        """The same bytes as ``dtype``; the last dim (contiguous) scales by the ratio of item sizes."""
        new = as_dtype(dtype, "view")
        pattern = self.get_pattern()
        if pattern[-1][0] != 1:
            raise NkiValidationError(f"view: the last dim of {self.shape} must be contiguous")
        for pair in pattern[:-1]:
            pair[0] = pair[0] * self.dtype.itemsize // new.itemsize
        last_bytes = pattern[-1][1] * self.dtype.itemsize
        if last_bytes % new.itemsize:
            raise NkiValidationError(f"view: {last_bytes} bytes per row do not divide into {new.name}")
        pattern[-1][1] = last_bytes // new.itemsize
        return self.ap(pattern, offset=0, dtype=new)

    def _check_not_partition(self, what, dim):
        if self.buffer in ON_CHIP and dim == 0:
            raise NkiValidationError(f"{what}: dim 0 of an on-chip tensor is the partition dim, which stays")

    def rearrange(self, src_pattern, dst_pattern, fixed_sizes=None):
        raise NotImplementedError("NkiTensor.rearrange is not emulated")

    def vector_select(self, dim, vector_offset):
        raise NotImplementedError("NkiTensor.vector_select is not emulated")

    def indirect(self, index, num_elem=None):
        raise NotImplementedError("NkiTensor.indirect is not emulated")

    def reinterpret_cast(self, *args, **kwargs):
        raise NotImplementedError("NkiTensor.reinterpret_cast is not emulated")

    def __setitem__(self, key, value):
        raise NotImplementedError("NkiTensor.__setitem__ (t[...] = value) is not emulated; write with an nki.isa "
                                  "instruction")

    def __repr__(self):
        return f"NkiTensor(shape={self.shape}, dtype={self.dtype.name}, buffer={self.buffer.value}, " \
               f"name={self.name!r})"

    def _view(self, index=None, fn=None):
        """The same view of data and masks: a full numpy ``index`` (one entry per dim) or a view function
        ``fn(array, trailing)`` that leaves ``trailing`` extra dims at the end untouched (the written
        mask has one, its bytes)."""
        if self._rows is not None:
            # "Indirect views cannot be re-indirected, and the dimension that participates in the indirection cannot
            # be further sliced or selected" (current NkiTensor.is_indirect stub); the emulator refuses any reshaping
            raise NkiValidationError("an indirect view made by ap(vector_offset=...) cannot be sliced, reshaped or "
                                     "viewed again (its rows are runtime addresses; aws-neuron-sdk "
                                     "nki/api/nki/language/__init__.py NkiTensor.is_indirect); give ap() the whole "
                                     "pattern")
        if fn is None:
            def fn(a, trailing):
                return a[index]
        written = None if self._written is None else fn(self._written, 1)
        matmul_written = None if self._matmul_written is None else fn(self._matmul_written, 0)
        return NkiTensor(self._storage, fn(self._data, 0), written, matmul_written, outside=self._outside)

    def __getitem__(self, key):
        """NumPy-style basic indexing: ints, slices (step >= 1), ``...``, ``nl.ds``; returns a view.

        As the NKI front end reads a subscript (leanprover/KLR KLR/Trace/Term.lean ``toIndex'``,
        l. 252-279): an integer index is a coordinate in [0, size), so a negative one is refused,
        "index out of range of tensor dimension"; slice bounds may be negative (counted from the end).
        A subscript of a subscripted tensor (``t[b, h]``, then ``[a:c, :]`` of that) is refused where
        KLR refuses it or would lower it to another access than Python's; see ``_check_chained``."""
        key = key if isinstance(key, tuple) else (key,)
        if self._subscript is not None:
            self._check_chained(key)
        shape = self.shape
        ellipses = [at for at, k in enumerate(key) if k is Ellipsis]
        if len(ellipses) > 1:
            raise NkiValidationError("tensor index: at most one '...' is allowed")
        if ellipses:
            at = ellipses[0]
            key = key[:at] + (slice(None),) * (len(shape) - len(key) + 1) + key[at + 1:]
        if len(key) > len(shape):
            raise NkiValidationError(f"tensor index: {len(key)} indices for a {len(shape)}-d tensor")
        key = key + (slice(None),) * (len(shape) - len(key))
        index, integer_dims = [], []
        for dim, (k, n) in enumerate(zip(key, shape)):
            if isinstance(k, slice):
                index.append(_check_slice(k, n, dim))
            elif isinstance(k, (int, np.integer)) and not isinstance(k, bool):
                i = int(k)
                if not 0 <= i < n:
                    raise NkiValidationError(f"tensor index: {k} is out of bounds for dim {dim} of size {n}: index "
                                             "out of range of tensor dimension (the NKI front end takes no negative "
                                             "integer index of a tensor: leanprover/KLR KLR/Trace/Term.lean l. 278)")
                index.append(i)
                integer_dims.append(dim)
            else:
                raise NkiValidationError(f"tensor index: unsupported index {k!r} (use ints, slices or nl.ds)")
        on_chip = self.buffer in ON_CHIP
        if on_chip and integer_dims[:1] == [0]:  # the partition dim is kept, with size 1
            index[0] = slice(index[0], index[0] + 1)
            integer_dims.pop(0)
        if integer_dims and len(shape) - len(integer_dims) < (2 if on_chip else 1):
            last = integer_dims[-1]  # keep the last indexed dim at size 1 so the result stays >= 2-D (1-D)
            index[last] = slice(index[last], index[last] + 1)
        view = self._view(tuple(index))
        fixed = [dim for dim, k in enumerate(key) if not isinstance(k, slice)]
        if self._subscript is not None:  # a merged access: KLR reads its next subscript another way
            view._subscript = (None, self._subscript[1] + fixed, False)
        else:
            kept_shape = tuple(1 if dim in fixed else len(range(*index[dim].indices(n))) for dim, n in enumerate(shape))
            view._subscript = (kept_shape, fixed, any(isinstance(k, slice) and k.step not in (None, 1) for k in key))
        return view

    def _check_chained(self, key):
        """A subscript of ``self``, itself made by a subscript, as KLR traces it: KLR/Trace/Term.lean
        ``access`` (l. 436-443) reads the new indexes against the first subscript's shape with its
        integer-indexed dims kept at size 1 (KLR/Core/Tensor.lean ``AccessBasic.shape``, l. 407-410), then
        merges the two into one access pattern (KLR/Core/Indexing.lean ``Access.combine``, l. 183-197).
        Refused: a new slice with a step ("can't combine indecies with stride != 1", Indexing.lean
        l. 190); an index out of that kept shape ("index out of range of tensor dimension", Term.lean
        l. 270-279): so ``t[b, h][a:c, :]`` of a (B, H, S, d) tensor; and the cases KLR accepts but lowers
        to another access than Python's: an integer-indexed dim before a sliced one (``normWithAP``,
        Indexing.lean l. 170-181, pairs the new indexes with the wrong dims), or a first subscript with a
        step (``idxToAp``, Indexing.lean l. 69-82, drops it). Accepted: chains of slices, and chains after
        integer indexes of trailing dims only (``t[:, 3][0:4]``), which both read as Python reads them."""
        kept_shape, fixed, strided = self._subscript
        where = f"a subscript {_key_text(key)} of a subscripted tensor"
        if any(isinstance(k, slice) and k.step not in (None, 1) for k in key):
            raise NkiValidationError(f"tensor index: {where}: can't combine indecies with stride != 1 (leanprover/KLR "
                                     "KLR/Core/Indexing.lean l. 190); index the tensor once")
        if kept_shape is None and fixed:
            raise NkiValidationError(
                f"tensor index: {where} (the third in a row, after an integer index): the front end reads it against "
                "the whole tensor's shape (leanprover/KLR KLR/Trace/Term.lean l. 440-441); index the tensor once")
        if fixed and kept_shape is not None:
            if Ellipsis in key:
                at = key.index(Ellipsis)
                key = key[:at] + (slice(None),) * (len(kept_shape) - len(key) + 1) + key[at + 1:]
            full = tuple(key) + (slice(None),) * (len(kept_shape) - len(key))
            for k, n in zip(full, kept_shape):
                start, stop = (k.start or 0, n if k.stop is None else k.stop) if isinstance(k, slice) else (k, k + 1)
                start, stop = start + (n if start < 0 else 0), stop + (n if stop < 0 else 0)
                if len(full) > len(kept_shape) or not 0 <= start < stop <= n:
                    raise NkiValidationError(
                        f"tensor index: {where}: index out of range of tensor dimension (leanprover/KLR "
                        f"KLR/Trace/Term.lean l. 270-279: the front end reads it against the first subscript's shape "
                        f"with integer-indexed dims kept at size 1, here {kept_shape}); index the tensor once, e.g. "
                        "t[b, h, a:c, :]")
            if fixed != list(range(len(kept_shape) - len(fixed), len(kept_shape))):
                raise NkiValidationError(
                    f"tensor index: {where}: the front end pairs these indexes with other dims than Python does "
                    "(leanprover/KLR KLR/Core/Indexing.lean Access.normWithAP, l. 170-181); index the tensor once")
        if strided:
            raise NkiValidationError(f"tensor index: {where}: the front end drops the first subscript's step when it "
                                     "merges the two (leanprover/KLR KLR/Core/Indexing.lean idxToAp, l. 69-82); index "
                                     "the tensor once")

    def reshape(self, shape):
        """A view with another shape; needs a layout that allows it without copying. On-chip tensors
        keep their partition dim."""
        shape = tuple(int(s) for s in shape)
        if self.buffer in ON_CHIP and shape[:1] != self.shape[:1]:
            raise NkiValidationError(f"reshape: on-chip tensors keep their partition dim {self.shape[0]}, "
                                     f"got shape {shape}")
        try:
            return self._view(fn=lambda a, trailing: np.reshape(a, shape + a.shape[a.ndim - trailing:], copy=False))
        except ValueError as error:
            raise NkiValidationError(f"reshape: cannot view shape {self.shape} as {shape}: {error}") from None

    def permute(self, dims):
        """A view with dimensions reordered; on-chip tensors keep the partition dim first."""
        dims = tuple(dims)
        if sorted(dims) != list(range(self.ndim)) or (self.buffer in ON_CHIP and dims[0] != 0):
            raise NkiValidationError(f"permute: {dims} is not a permutation of the dims of {self.shape} "
                                     "that keeps an on-chip partition dim first")
        return self._view(fn=lambda a, trailing: a.transpose(dims + tuple(range(len(dims), a.ndim))))

    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None):
        """Explicit access pattern ``[[stride, count], ...]`` over this tensor's storage, as the NKI 0.6
        stub of ``NkiTensor.ap`` documents it (aws-neuron/aws-neuron-sdk,
        nki/api/nki/language/__init__.py): the view starts where this view starts, plus ``offset``
        elements; ``dtype`` reinterprets the storage's bytes (strides, counts and ``offset`` are then in
        elements of ``dtype``); ``scalar_offset``, a one-element integer tensor, adds its value times the
        stride of this view's dim ``indirect_dim`` (``vector_offset``, one index per row: ``_vector_view``). The
        emulator reads ``scalar_offset`` when ``ap`` is called, so the index must be written before the view is
        made. On-chip tensors: the first pair is the partition step, whose stride must be the storage's row length."""
        if vector_offset is not None or self._rows is not None:  # per-row indirection: see _vector_view
            return _vector_view(self, pattern, offset, scalar_offset, vector_offset, indirect_dim, dtype)
        storage = self._storage
        element = self.dtype if dtype is None else as_dtype(dtype, "ap")
        if element.itemsize != self.dtype.itemsize and storage.buffer is PSUM:
            raise NotImplementedError("NkiTensor.ap(dtype=...) changing the element size of a PSUM tensor is not "
                                      "emulated")
        strides, counts = [], []
        for stride, count in pattern:
            strides.append(int(stride))
            counts.append(int(count))
        start = self._data.__array_interface__["data"][0] - storage.array.__array_interface__["data"][0]
        start += (0 if offset is None else int(offset)) * element.itemsize
        if scalar_offset is not None:
            check_written("ap", "scalar_offset", scalar_offset)
            if scalar_offset.size != 1 or scalar_offset.dtype.kind not in "iu":
                raise NkiValidationError(f"ap: scalar_offset must be a one-element integer tensor, got "
                                         f"{scalar_offset.shape} {scalar_offset.dtype.name}")
            start += int(np.asarray(scalar_offset._data).reshape(-1)[0]) * self._data.strides[indirect_dim]
        row_bytes = storage.array.nbytes // storage.array.shape[0]
        if self.buffer in ON_CHIP and strides[0] * element.itemsize != row_bytes:
            raise NkiValidationError(f"ap: the partition stride of an on-chip tensor must be its row length "
                                     f"{row_bytes // element.itemsize}, got {strides[0]}")
        low = start + element.itemsize * sum((c - 1) * s for s, c in zip(strides, counts) if s < 0)
        high = start + element.itemsize * (1 + sum((c - 1) * s for s, c in zip(strides, counts) if s > 0))
        if min(counts) < 1 or start % element.itemsize:
            raise NkiValidationError(f"ap: pattern {pattern} starting at byte {start} is empty or not aligned to "
                                     f"{element.name}")
        if low < 0 or high > storage.array.nbytes:
            # A view may be made and left unused: nki-library's output_projection_tkg.py builds a stationary ap for
            # a column past its weights and skips the matmul (``if h_2_idx < cfg.h_2_size``). An instruction refuses.
            outside = (f"an access pattern {pattern} from byte {start} that leaves its storage of "
                       f"{storage.array.nbytes} bytes ({storage.label})")
            placeholder = np.zeros(counts, element)
            return NkiTensor(storage, placeholder, None, None, outside=outside)

        def strided(flat, bytes_per_entry, per_element):
            """The pattern over ``flat``, an array with one entry per ``bytes_per_entry`` bytes of storage;
            ``per_element`` > 0 adds a last dim of that many consecutive entries per element."""
            step = flat.itemsize * element.itemsize // bytes_per_entry
            trailing = [per_element] if per_element else []
            return np.lib.stride_tricks.as_strided(flat[start // bytes_per_entry:], counts + trailing,
                                                   [s * step for s in strides] + [flat.itemsize] * len(trailing))

        data = strided(storage.array.reshape(-1).view(np.uint8), 1, element.itemsize).view(element)[..., 0]
        written = None if storage.written is None else strided(storage.written.reshape(-1), 1, element.itemsize)
        matmul_written = None if storage.matmul_written is None else \
            strided(storage.matmul_written.reshape(-1), element.itemsize, 0)
        return NkiTensor(storage, data, written, matmul_written, indirect=scalar_offset is not None)


class _VectorRows:
    """Where a view made by ``ap(vector_offset=idx)`` lies in its storage: the byte offset of each element (the
    first pattern pair's position ``i`` replaced by ``idx[i]`` rows of the indexed dim) and, per row, whether
    ``idx[i]`` lies inside that dim. The view's ``_data`` and ``_written`` are copies gathered from the storage
    (again by each instruction that takes it, see ``operand``); ``write`` scatters them back, in-bounds rows only."""

    __slots__ = ("offsets", "in_bounds", "indices", "dim", "dim_size", "index_tensor")

    def __init__(self, offsets, in_bounds, indices, dim, dim_size, index_tensor):
        self.offsets, self.in_bounds, self.indices, self.dim, self.dim_size = offsets, in_bounds, indices, dim, dim_size
        self.index_tensor = index_tensor  # the vector_offset tensor (its shape and dtype: dma_transpose's rules)

    def _bytes(self, dtype):
        return self.offsets[..., None] + np.arange(dtype.itemsize)

    def gather(self, t):
        storage, dtype = t._storage, t._data.dtype
        at = self._bytes(dtype)
        t._data = storage.array.reshape(-1).view(np.uint8)[at].view(dtype)[..., 0]
        t._written = None if storage.written is None else storage.written.reshape(-1)[at]

    def scatter(self, t, poisoned=None):
        """Store ``t._data`` (just written) into the storage at the in-bounds rows; mark those bytes written, except
        the ``poisoned`` elements' (see ``write``)."""
        storage, keep = t._storage, self.in_bounds
        at = self._bytes(t._data.dtype)[keep]
        storage.array.reshape(-1).view(np.uint8)[at] = np.ascontiguousarray(t._data).view(np.uint8).reshape(
            t._data.shape + (-1,))[keep]
        if storage.written is None:
            return  # host memory: poison is carried by its NaN alone
        flags = storage.written.reshape(-1)
        before = int(np.count_nonzero(~flags[at]))
        written = np.ones(at.shape, np.bool_)
        if poisoned is not None:
            written &= ~np.reshape(poisoned, t._data.shape)[keep][..., None]
        flags[at] = written
        storage.unwritten += int(np.count_nonzero(~flags[at])) - before


def _vector_view(t, pattern, offset, scalar_offset, vector_offset, indirect_dim, dtype):
    """``t.ap(pattern, offset, vector_offset=idx, indirect_dim=d)``, as the 0.4 dma_copy stub describes vector
    indirection (aws-neuron-sdk 3afa0fdf nki/api/nki/isa/__init__.py l. 241-247): one index per partition, ``idx``
    an SBUF tensor of shape (P, 1), the indexed tensor in HBM; row ``i`` of the pattern's first pair starts at
    ``idx[i]`` times the stride of ``t``'s dim ``d`` ("indirect_dim: dimension in self.shape whose stride scales
    the indirect scalar/vector offset", the current stub, nki/api/nki/language/__init__.py ``NkiTensor.ap``). A
    2-D ``idx`` (P, N) is read column by column, ``idx.T.flatten()`` (the stub's indirect dma_transpose, l. 724).
    The emulator reads ``idx`` when ``ap`` is called."""
    if t._rows is not None:
        raise NotImplementedError("NkiTensor.ap of a view made by ap(vector_offset=...) is not emulated")
    if scalar_offset is not None:  # isa stub (3afa0fdf) dma_copy l. 253
        raise NkiValidationError("ap: vector_offset and scalar_offset are mutually exclusive")
    element, offset = t.dtype if dtype is None else as_dtype(dtype, "ap"), 0 if offset is None else int(offset)
    if t.buffer not in HBM:
        raise NkiValidationError(f"ap: vector_offset indexes an HBM tensor (\"The tensor being indexed ... must be in "
                                 f"HBM\", isa stub 3afa0fdf l. 247); this one is in {t.buffer.value}")
    if not isinstance(vector_offset, NkiTensor) or vector_offset.buffer is not SBUF or \
            vector_offset.dtype.kind not in "iu":
        raise NkiValidationError(f"ap: vector_offset must be an integer SBUF tensor of shape (P, 1) (isa stub 3afa0fdf "
                                 f"l. 245-246), got {vector_offset!r}")
    if not 0 <= indirect_dim < t.ndim:
        raise NkiValidationError(f"ap: indirect_dim {indirect_dim} is not a dim of {t.shape}")
    check_written("ap", "vector_offset", vector_offset)
    strides, counts = [int(s) for s, _ in pattern], [int(c) for _, c in pattern]
    columns = np.asarray(vector_offset._data).reshape(vector_offset.shape[0], -1).T.reshape(-1)
    if min(counts) < 1 or columns.size < counts[0]:
        raise NkiValidationError(f"ap: pattern {pattern} needs {counts[0]} indices, vector_offset "
                                 f"{vector_offset.shape} has {columns.size}")
    indices = columns[:counts[0]].astype(np.int64)
    start = t._data.__array_interface__["data"][0] - t._storage.array.__array_interface__["data"][0]
    start += offset * element.itemsize
    inner = np.zeros(counts[1:], np.int64)
    for axis, (stride, count) in enumerate(zip(strides[1:], counts[1:])):
        inner = inner + (np.arange(count) * stride * element.itemsize).reshape(
            (-1,) + (1,) * (len(counts) - 2 - axis))
    rows = start + indices * t._data.strides[indirect_dim]
    offsets = rows.reshape((-1,) + (1,) * inner.ndim) + inner
    last = offsets.reshape(counts[0], -1)
    in_bounds = (indices >= 0) & (indices < t.shape[indirect_dim]) & (last.min(axis=1) >= 0) & \
        (last.max(axis=1) + element.itemsize <= t._storage.array.nbytes)
    offsets[~in_bounds] = 0  # placeholders: an instruction refuses these rows or skips them (oob_mode)
    rows = _VectorRows(offsets, in_bounds, indices, indirect_dim, t.shape[indirect_dim], vector_offset)
    view = NkiTensor(t._storage, None, None, None, indirect=True, rows=rows)
    view._data = np.zeros(counts, element)  # the gathered values' dtype and shape, until operand() gathers
    rows.gather(view)
    return view


def check_indirect(instr, role, t, skip):
    """A DMA's ``oob_mode``: an index of a ``vector_offset`` view outside its dim is refused (``oob_mode.error``,
    the default) or its row left alone (``oob_mode.skip``) (isa stub 3afa0fdf dma_copy l. 318-323)."""
    rows = t._rows
    if rows is None or skip or rows.in_bounds.all():
        return
    bad = int(np.flatnonzero(~rows.in_bounds)[0])
    raise NkiValidationError(f"{instr}: {role}'s vector_offset index {rows.indices[bad]} (row {bad}) is out of bounds "
                             f"for dim {rows.dim} of size {rows.dim_size} (oob_mode.error raises on it; "
                             "oob_mode=nisa.oob_mode.skip skips such rows)")


def _key_text(key):
    return "[" + ", ".join(f"{k.start if k.start is not None else ''}:{k.stop if k.stop is not None else ''}"
                           if isinstance(k, slice) else "..." if k is Ellipsis else str(k) for k in key) + "]"


def _check_slice(k, n, dim):
    start, stop, step = k.start, k.stop, k.step
    start = 0 if start is None else int(start) + (n if start < 0 else 0)
    stop = n if stop is None else int(stop) + (n if stop < 0 else 0)
    step = 1 if step is None else int(step)
    # An empty slice makes an empty view, which only an instruction refuses (``operand``): nki-library's
    # cross_entropy.py takes ``targets_hbm[nl.ds(0, 0)]`` on the core that gets no positions, and runs.
    if not (0 <= start <= stop <= n and step >= 1):
        raise NkiValidationError(f"tensor index: slice {k.start}:{k.stop}:{k.step} is out of bounds "
                                 f"for dim {dim} of size {n}")
    return slice(start, stop, step)


def allocate(shape, dtype, buffer, name, what="ndarray", address=None):
    """New uninitialised storage on the running core (``nl.ndarray``), at ``address`` where one is given."""
    core = current(what)
    shape = tuple(int(s) for s in shape)
    dtype = as_dtype(dtype, what)
    if not isinstance(buffer, MemoryRegion):
        raise NkiValidationError(f"{what}: buffer must be nl.sbuf, nl.psum, nl.hbm or nl.shared_hbm, got {buffer!r}")
    if not shape or min(shape) < 1:
        raise NkiValidationError(f"{what}: shape {shape} needs at least one dim, all positive")
    site = _caller_site()
    label = f"{name or 'tile'} {shape} {dtype.name} in {buffer.value}, allocated at {site}"
    if buffer in ON_CHIP:
        _check_on_chip_shape(shape, dtype, buffer, what)
    if buffer is MemoryRegion.shared_hbm and core.shared_hbm_next < len(core.launch.shared_hbm):
        return _shared_alias(core, shape, dtype, what)
    storage = _Storage(np.full(shape, _sentinel(dtype), dtype), buffer, name, label, initialised=False)
    if address is not None and buffer in ON_CHIP:
        storage.address = _check_address(address, shape, dtype, buffer, what)
    if buffer in ON_CHIP:
        storage.liveness = _Liveness(storage.array.size // shape[0] * dtype.itemsize, buffer, label)
        core.tiles.append(storage.liveness)
    if buffer is SBUF and address is None:  # the compiler places it (and may spill it): the trace says its size
        storage.serial = SbufTile(storage.serial, shape[0], storage.liveness.nbytes)
    if buffer is MemoryRegion.shared_hbm:
        core.launch.shared_hbm.append(storage)
        core.shared_hbm_next += 1
    return NkiTensor(storage, storage.array, storage.written, storage.matmul_written)


def _check_on_chip_shape(shape, dtype, buffer, what):
    """Rules that a single on-chip tile must meet on its own."""
    if len(shape) < 2:
        raise NkiValidationError(f"{what}: on-chip tensors are at least 2-D (partition, free...), got {shape}")
    if shape[0] > PARTITIONS:
        raise NkiValidationError(f"{what}: partition dim {shape[0]} exceeds the {PARTITIONS} partitions of "
                                 f"{buffer.value.upper()} (nl.tile_size.pmax)")
    per_partition = int(np.prod(shape[1:])) * dtype.itemsize
    limit = target().psum_tile_bytes if buffer is PSUM else target().sbuf_usable_bytes
    if per_partition > limit:
        kind = "one PSUM bank" if buffer is PSUM else "an SBUF partition"
        raise NkiValidationError(f"{what}: a {shape} {dtype.name} tile needs {per_partition} bytes per partition, "
                                 f"more than {kind} holds on {target().name} ({limit} bytes)")


PSUM_MIN_ALIGN = 4  # nl.tile_size.psum_min_align: leanprover/KLR KLR/Trace.lean l. 48
_PSUM_ALIGN_SOURCE = "aws-neuron-sdk 3afa0fdf nki/api/nki.language.tile_size.rst l. 56-57; KLR/Trace.lean l. 48"
_BANK_SOURCE = "aws-neuron-sdk 3afa0fdf nki/migration/nki-beta2-migration-guide.rst l. 330-335"


def _check_address(address, shape, dtype, buffer, what):
    """``nl.ndarray(address=(partition_offset, free_offset))`` (nl stub, aws-neuron-sdk 3afa0fdf
    nki/api/nki/language/__init__.py l. 1979; free_offset in bytes): the tile inside the partitions and inside its
    buffer; in PSUM it starts at the beginning of a bank ("the compiler will throw an error otherwise") and stays
    inside that bank, or inside PSUM's 16 KiB where a tile may span banks (trn3)."""
    if not (isinstance(address, (tuple, list)) and len(address) == 2
            and all(isinstance(a, int) and not isinstance(a, bool) and a >= 0 for a in address)):
        raise NkiValidationError(f"{what}: address must be (partition_offset, free_offset), two ints >= 0, got "
                                 f"{address!r}")
    partition, free = address = tuple(address)
    row = int(np.prod(shape[1:])) * dtype.itemsize
    if partition + shape[0] > PARTITIONS:
        raise NkiValidationError(f"{what}: address {address} puts a {shape[0]}-partition tile past partition "
                                 f"{PARTITIONS - 1}")
    end = PSUM_PARTITION_BYTES if buffer is PSUM else target().sbuf_usable_bytes
    if free + row > end:
        raise NkiValidationError(f"{what}: address {address} with {row} bytes per partition ends at byte {free + row}, "
                                 f"past the {end} bytes of a {buffer.value.upper()} partition")
    if buffer is PSUM and free % PSUM_BANK_BYTES:
        raise NkiValidationError(f"{what}: a PSUM tile starts at the beginning of a bank; free_offset {free} is not a "
                                 f"multiple of {PSUM_BANK_BYTES} ({_BANK_SOURCE})")
    return partition, free


def _shared_alias(core, shape, dtype, what):
    """The n-th shared_hbm allocation of a program that another program of its launch made first: the same one."""
    storage = core.launch.shared_hbm[core.shared_hbm_next]
    core.shared_hbm_next += 1
    if storage.array.shape != shape or storage.array.dtype != dtype:
        raise NkiValidationError(f"{what}: program {core.program_id} allocated shared_hbm tensors that differ "
                                 "from the other program's; every program of an LNC launch must allocate the same ones")
    return NkiTensor(storage, storage.array, storage.written, None)


def wrap_host(array, buffer, label):
    """A kernel argument: host memory used in place, fully initialised."""
    storage = _Storage(array, buffer, "", label, initialised=True)
    return NkiTensor(storage, array, None, None)


def check_capacity(core):
    """Raise if the live on-chip tiles of ``core`` ever exceeded SBUF or PSUM capacity."""
    limits = {SBUF: target().sbuf_usable_bytes, PSUM: psum_num_banks() * PSUM_BANK_BYTES}
    for buffer, limit in limits.items():
        tiles = [t for t in core.tiles if t.buffer is buffer and t.first >= 0]
        events = sorted([(t.first, _footprint(t)) for t in tiles] + [(t.last + 1, -_footprint(t)) for t in tiles])
        live = peak = peak_at = 0
        for at, delta in events:
            live += delta
            if live > peak:
                peak, peak_at = live, at
        if peak > limit:
            alive = sorted((t for t in tiles if t.first <= peak_at <= t.last), key=lambda t: -_footprint(t))
            listing = "; ".join(f"{t.label} ({_footprint(t)} B/partition)" for t in alive[:4])
            raise NkiValidationError(
                f"{core.issued[peak_at]} (instruction #{peak_at}): {buffer.value.upper()} holds {peak} bytes per "
                f"partition of live tiles, over the {limit} bytes per partition a kernel may use on {target().name} "
                f"(nl.tile_size.total_available_sbuf_size for SBUF; for PSUM nl.tile_size.psum_num_banks whole "
                f"banks of 2 KiB, a tile taking whole banks: {_BANK_SOURCE}); largest live tiles: {listing}")


def _footprint(liveness):
    """Bytes per partition a live tile takes: SBUF its size; PSUM whole banks, since a PSUM tile starts at the
    beginning of a bank (_BANK_SOURCE)."""
    if liveness.buffer is not PSUM:
        return liveness.nbytes
    return -(-liveness.nbytes // PSUM_BANK_BYTES) * PSUM_BANK_BYTES


# ---- operand access used by the instructions ------------------------------------------------------

def operand(core, instr, role, t, allowed, why):
    """Check that ``t`` is a tensor in one of the ``allowed`` buffers and mark it used now."""
    if not isinstance(t, NkiTensor):
        raise NkiValidationError(f"{instr}: {role} must be an NKI tensor, got {type(t).__name__}")
    if t._storage.buffer not in allowed:
        raise NkiValidationError(f"{instr}: {role} is in {t._storage.buffer.value}, but {why}")
    if t.size == 0:
        raise NkiValidationError(f"{instr}: {role} is an empty view {t.shape}; an instruction needs at least one "
                                 "element")
    if t._outside is not None:
        raise NkiValidationError(f"{instr}: {role} is {t._outside}")
    if t._rows is not None:  # an indirect view reads the storage as it is now
        t._rows.gather(t)
    if t._storage.buffer in ON_CHIP:
        _check_on_chip_access(instr, role, t)
    core.accessed.append((role, t))  # for the trace's reads and writes (_runtime.count)
    liveness = t._storage.liveness
    if liveness is not None:
        if liveness.first < 0:
            liveness.first = core.now
        liveness.last = core.now
    return t


def poison(t):
    """Per element of ``t``: True where a byte was never written (poison), or None where every one was."""
    if not t._storage.unwritten:
        return None
    unwritten = ~t._written.all(axis=-1)
    return unwritten if unwritten.any() else None


_PARTITION_SOURCE = "aws-neuron-sdk 3afa0fdf nki/guides/architecture/trainium_inferentia2_arch.rst l. 704-713"
_PARTITION_STARTS = ((32, (0, 32, 64, 96)), (64, (0, 64)), (PARTITIONS, (0,)))  # up to n partitions: the starts


def _check_on_chip_access(instr, role, t):
    """Where an instruction may access an SBUF/PSUM tile. A PSUM access starts at a free-dimension address aligned to
    nl.tile_size.psum_min_align, 4 bytes. A compute engine's access (every instruction but the DMA ones, which move
    each partition as its own buffer: the same guide, l. 654-658) takes consecutive partitions, no partition
    striding, and starts at 0 for 65-128 partitions, at 0 or 64 for 33-64, at 0, 32, 64 or 96 for 1-32 (the guide,
    l. 704-713: "hardware does not allow P dimension striding")."""
    storage, data = t._storage, t._data
    row = storage.array.strides[0]
    offset = data.__array_interface__["data"][0] - storage.array.__array_interface__["data"][0]
    first_partition, first_byte = storage.address
    address = first_byte + offset % row
    if storage.buffer is PSUM and address % PSUM_MIN_ALIGN:
        raise NkiValidationError(f"{instr}: {role} starts at byte {address} of its PSUM partition, not a multiple of "
                                 f"{PSUM_MIN_ALIGN} (PSUM free-dimension addresses are {PSUM_MIN_ALIGN}-byte aligned, "
                                 f"nl.tile_size.psum_min_align: {_PSUM_ALIGN_SOURCE}); {storage.label}")
    if instr.startswith("dma_") or instr == "sendrecv":
        return
    count, start = data.shape[0], first_partition + offset // row
    if count > 1 and data.strides[0] != row:
        raise NkiValidationError(f"{instr}: {role} takes partitions with a step of {data.strides[0] // row}; an "
                                 "instruction accesses consecutive partitions, the hardware does not allow partition "
                                 f"striding ({_PARTITION_SOURCE}); {storage.label}")
    starts = next(allowed for most, allowed in _PARTITION_STARTS if count <= most)
    if start not in starts:
        raise NkiValidationError(f"{instr}: {role} accesses partitions {start}-{start + count - 1}; an access of "
                                 f"{count} partitions must start at partition {' or '.join(map(str, starts))} "
                                 f"({_PARTITION_SOURCE}); {storage.label}")


def check_written(instr, role, t):
    """Refuse a read of never-written memory where no NaN can carry it: an address (``ap(scalar_offset=)``)."""
    if poison(t) is not None:
        raise NkiValidationError(f"{instr}: {role} reads memory that was never written: {t._storage.label}; an "
                                 "address computed from it is arbitrary on a NeuronCore")


def read(instr, role, t):
    """The values of ``t`` as float32 (what the engines compute in). Memory never written reads as NaN, whatever
    the dtype (an integer tile holds the simulator's 4 there), and marks the instruction as reading poison."""
    values = np.asarray(t._data, np.float32)
    unwritten = poison(t)
    if unwritten is not None:
        values = np.where(unwritten, np.float32(np.nan), values)
        current(instr).read_poison = True
    return values


def write(t, values, poisoned=None):
    """Store ``values`` into ``t``, rounding to its dtype (float -> int rounds half to even and saturates), and
    mark the elements written, except the ``poisoned`` ones (a mask of ``t``'s elements, or False for none): those
    stay never written and hold the fill (NaN, integers 4). By default an instruction that read poison poisons the
    elements it computed as NaN, so poison follows NaN through arithmetic as in AWS's simulator (aws-neuron-sdk
    3afa0fdf nki/guides/nki_simulator.rst l. 212-221) and reaches integer tiles too."""
    data = t._data
    values = np.reshape(values, data.shape)
    if poisoned is None:
        poisoned = current("write").read_poison and values.dtype.kind == "f" and np.isnan(values)
    poisoned = np.reshape(poisoned, data.shape) if np.any(poisoned) else None
    if poisoned is not None:
        values = np.where(poisoned, _sentinel(data.dtype), values)
    if data.dtype.kind in "iu":
        info = np.iinfo(data.dtype)
        values = np.clip(np.rint(values), info.min, info.max)
    data[...] = values
    if t._rows is not None:
        t._rows.scatter(t, poisoned)
        return
    storage, written = t._storage, t._written
    if written is None or not (storage.unwritten or poisoned is not None):
        return  # host memory (a kernel argument) has no mask: poison written there is carried by its NaN alone
    before = written.size - np.count_nonzero(written)
    written[...] = True
    if poisoned is not None:
        written[poisoned] = False
    storage.unwritten += written.size - np.count_nonzero(written) - before


def copy_bits(dst, src, arrange=np.asarray):
    """``dst = arrange(src)`` bit for bit (same dtype), never-written elements staying never written."""
    unwritten = poison(src)
    write(dst, arrange(src._data), False if unwritten is None else arrange(unwritten))

"""Emulator state: the hardware target, the NeuronCore a kernel is running on, and instruction counts.

Every ``nki.isa`` instruction starts with :func:`begin`, which checks that a kernel is running and gives
the instruction the next index on its core (memory liveness is measured in these indices), and ends
with :func:`count`, which adds it to every open :func:`counting` context.
"""

import collections
import contextlib
import itertools
import os
import threading
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

KiB = 1024
PARTITIONS = 128  # nl.tile_size.pmax: SBUF and PSUM have 128 partitions
PSUM_PARTITION_BYTES = 16 * KiB  # 8 banks of 2 KiB per partition
PSUM_BANK_BYTES = 2 * KiB  # one bank row: 512 fp32 values
ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma")


class NkiValidationError(Exception):
    """A kernel broke a hardware rule (stands in for the real ``nki.isa.NkiValidationError``)."""


@dataclass(frozen=True)
class Target:
    """The limits that differ between NeuronCore generations."""

    name: str
    nc_version: str  # member name of nki.isa.nc_version
    sbuf_partition_bytes: int  # the SBUF memory of one partition (nl.tile_size.sbuf_size_bytes / 128)
    sbuf_usable_bytes: int  # what a kernel may allocate in one partition (nl.tile_size.total_available_sbuf_size)
    psum_tile_bytes: int  # widest PSUM tile: one bank, or the whole PSUM on NeuronCore-v4
    matmul_dst_dtypes: tuple  # nc_matmul may write these dtypes to PSUM


# The usable SBUF per partition is what the NKI front end sets nl.tile_size.total_available_sbuf_size to, per
# generation (leanprover/KLR KLR/Trace.lean l. 52-54: 180224, 212984, 245752); the compiler keeps the rest.
TARGETS = {
    "trn1": Target("trn1", "gen2", 192 * KiB, 180224, PSUM_BANK_BYTES, ("float32",)),
    "trn2": Target("trn2", "gen3", 224 * KiB, 212984, PSUM_BANK_BYTES, ("float32",)),
    "trn3": Target("trn3", "gen4", 256 * KiB, 245752, PSUM_PARTITION_BYTES, ("float32", "bfloat16")),
}
_TARGET_ALIASES = {"gen2": "trn1", "gen3": "trn2", "gen4": "trn3"}


def _lookup_target(name):
    key = _TARGET_ALIASES.get(name, name)
    if key not in TARGETS:
        raise ValueError(f"unknown NKI emulator target {name!r}; use one of trn1, trn2, trn3 (or gen2, gen3, gen4)")
    return TARGETS[key]


_target = _lookup_target(os.environ.get("NKI_EMULATOR_TARGET", "trn2"))


def set_target(name):
    """Select the hardware generation whose limits are enforced ("trn1", "trn2" or "trn3"); returns the
    previous target's name. The default is trn2, or the ``NKI_EMULATOR_TARGET`` environment variable."""
    global _target
    previous = _target.name
    _target = _lookup_target(name)
    return previous


def target():
    return _target


def psum_num_banks():
    """The PSUM banks a kernel may use per partition: 8, or 7 where the compiler lowers dma_transpose to PE transposes
    (``NKI_DMA_TRANSPOSE_AS_PE_TRANSPOSE=true`` on trn2 and later), which reserves bank 7 for nc_transpose
    (aws-neuron-sdk 3afa0fdf nki/api/nki.language.tile_size.rst l. 24-30, psum_num_banks)."""
    lowered = os.environ.get("NKI_DMA_TRANSPOSE_AS_PE_TRANSPOSE", "").lower() == "true"
    return PSUM_PARTITION_BYTES // PSUM_BANK_BYTES - (lowered and _target.nc_version != "gen2")


# The NKI release whose documented rules apply. The contest's is 0.4 (Neuron 2.30.0, aws-neuron-sdk 3afa0fdf); 0.6
# is the current one (Neuron 2.32.0, a3247f5b); 0.7 (Neuron 2.33) traces kernels as plain Python (see _values). A
# refusal that depends on it names it ("NKI 0.4").
NKI_VERSIONS = ("0.4", "0.5", "0.6", "0.7")


def _check_version(version):
    if version not in NKI_VERSIONS:
        raise ValueError(f"unknown NKI version {version!r} for the emulator; use one of {', '.join(NKI_VERSIONS)}")
    return version


_nki_version = _check_version(os.environ.get("NKI_EMULATOR_NKI_VERSION", "0.4"))


def set_nki_version(version):
    """Select the NKI release whose rules are enforced ("0.4", "0.5", "0.6" or "0.7"); returns the previous one. The
    default is the contest's 0.4, or the ``NKI_EMULATOR_NKI_VERSION`` environment variable."""
    global _nki_version
    previous, _nki_version = _nki_version, _check_version(version)
    return previous


def nki_version():
    return _nki_version


def nki_since(version):
    """Whether the selected NKI release is ``version`` or newer."""
    return NKI_VERSIONS.index(_nki_version) >= NKI_VERSIONS.index(version)


class Counts:
    """What kernels did while a :func:`counting` context was open.

    - ``instructions``: engine -> instruction count, for the engines "tensor", "vector", "scalar",
      "gpsimd" and "dma".
    - ``by_instruction``: instruction name (e.g. "nc_matmul", "dma_copy") -> count.
    - ``dma_bytes``: bytes written by ``dma_copy`` (its destination's size; equal to the bytes read
      unless the DMA converts dtype).
    - ``matmul_flops``: 2*K*M*N for every ``nc_matmul`` (transposes are not counted here).
    - ``matmul_shapes``: one ``(K, M, N, dtype)`` per ``nc_matmul`` (dtype: the wider input dtype's
      name); ``matmul_histogram()`` tallies them.
    - ``transposes``: one ``(partitions, free_size, dtype)`` per TensorE ``nc_transpose``.
    - ``trace``: one :class:`Instruction` per instruction, in issue order: what the cost model
      (:mod:`._cost`) prices.
    """

    def __init__(self):
        self.instructions = dict.fromkeys(ENGINES, 0)
        self.by_instruction = Counter()
        self.dma_bytes = 0
        self.matmul_flops = 0
        self.matmul_shapes = []
        self.transposes = []
        self.trace = []

    def matmul_histogram(self):
        return Counter(self.matmul_shapes)

    def __repr__(self):
        return (f"Counts(instructions={self.instructions}, dma_bytes={self.dma_bytes}, "
                f"matmul_flops={self.matmul_flops})")


class SbufTile(NamedTuple):
    """The identity of an SBUF tile the compiler places (allocated without ``address=``), as the first element of an
    Instruction.reads / writes rectangle names it in place of a bare storage serial, so that the spill model
    (._spill) knows its size: ``partitions`` x ``row_bytes`` bytes per partition, as the emulator's SBUF
    accounting counts it (_memory.check_capacity)."""

    serial: int
    partitions: int
    row_bytes: int


class Instruction(NamedTuple):
    """One executed instruction, as the cost model reads it."""

    name: str  # e.g. "nc_matmul"
    engine: str  # one of ENGINES
    partitions: int  # partitions streamed (nc_matmul: the contraction K; DMA: rows on the SBUF side)
    free: int  # elements per partition streamed (nc_matmul: the moving free size N)
    dtypes: tuple = ()  # dtype names: the destination first, then each tensor input
    buffers: tuple = ()  # "sbuf", "psum", "private_hbm" or "shared_hbm", for the same tensors
    ops: tuple = ()  # names of the operators applied (ALU ops, activation function); memset of 0: ("zero",)
    stationary: int = 0  # nc_matmul: the stationary free size M
    reads_accumulator: bool = False  # ScalarE also writes its accumulation registers out (reduce_res)
    # what the scheduler (._schedule) orders by: the tiles read and written, each a rectangle (storage serial, or
    # an SbufTile for an SBUF tile the compiler places; first partition, last partition + 1, first byte, last
    # byte + 1; HBM: partitions 0..1, bytes of the whole view), and the kernel launch the instruction belongs to
    reads: tuple = ()
    writes: tuple = ()
    launch: int = 0
    # what constrains the compiler's scheduler beyond the tiles (._schedule.list_schedule): the instruction's
    # ``name=`` (label), the labels it must follow (``kernel.with_schedule`` edges), the ``nl.no_reorder`` block it
    # was issued in (0: none), and whether an nc_matmul adds onto its PSUM tile (a later member of an
    # accumulation group)
    label: str = ""
    after: tuple = ()
    no_reorder: int = 0
    accumulate: bool = False


_counters = []  # the open counting() contexts
_launches = itertools.count(1)  # serial of each kernel launch (Launch), for the scheduler's launch boundaries


@contextlib.contextmanager
def counting():
    """``with nki_emulator.counting() as counts:`` counts every instruction issued inside the block."""
    counts = Counts()
    _counters.append(counts)
    try:
        yield counts
    finally:
        _counters.remove(counts)


def count_dma(nbytes):
    for counts in _counters:
        counts.dma_bytes += nbytes


def count_matmul(k, m, n, dtype_name):
    for counts in _counters:
        counts.matmul_flops += 2 * k * m * n
        counts.matmul_shapes.append((k, m, n, dtype_name))


def count_transpose(partitions, free, dtype_name):
    for counts in _counters:
        counts.transposes.append((partitions, free, dtype_name))


class Launch:
    """What the programs of one kernel launch share. ``shared_hbm``: the n-th ``nl.shared_hbm`` allocation of every
    program is the same storage, as both cores of a logical NeuronCore address the same shared HBM tensor.
    ``baton``: the programs of an LNC=2 launch run on threads, one at a time, handing over only where one waits for
    the other (``nisa.sendrecv``), so a launch runs the same way every time. ``mail``: what a sendrecv sent and its
    partner has not yet received, by (pipe_id, sender, receiver)."""

    def __init__(self):
        self.shared_hbm = []
        self.baton = threading.Condition()
        self.mail = {}
        self.finished = set()
        self.serial = next(_launches)  # Instruction.launch: where the scheduler starts a new kernel
        self.schedule_edges = {}  # label -> the labels it must follow (Kernel.with_schedule)
        self.labels = set()  # the labels issued so far

    def exchange(self, me, send_to, receive_from, pipe_id, payload):
        """Post ``payload`` for ``send_to`` and return what ``receive_from`` sent to this program on ``pipe_id``."""
        self.mail.setdefault((pipe_id, me, send_to), collections.deque()).append(payload)
        self.baton.notify_all()
        inbox = (pipe_id, receive_from, me)
        self.baton.wait_for(lambda: self.mail.get(inbox) or receive_from in self.finished)
        if not self.mail.get(inbox):
            raise NkiValidationError(f"sendrecv: program {me} waits on pipe_id {pipe_id} for program {receive_from}, "
                                     "which ended without sending to it (every sendrecv needs its partner's)")
        return self.mail[inbox].popleft()


class Core:
    """The NeuronCore that one program of a kernel launch runs on."""

    def __init__(self, program_id, num_programs, grid, launch):
        self.program_id = program_id
        self.num_programs = num_programs
        self.grid = grid  # launched with kernel[lnc](...) rather than kernel(...)
        self.launch = launch
        self.shared_hbm_next = 0
        self.barriers = 0  # core_barrier calls so far: the n-th meets the other core's n-th
        self.now = 0  # index of the instruction being issued
        self.issued = [None]  # instruction name by index
        self.tiles = []  # liveness records of the on-chip tiles allocated on this core
        # ScalarE's per-lane accumulation registers (nisa.activation reduce_cmd); undefined until reset.
        self.activation_regs = np.full(PARTITIONS, np.nan, np.float32)
        # VectorE's per-lane accumulation registers (nisa.tensor_scalar_reduce reduce_cmd); undefined until reset.
        self.vector_regs = np.full(PARTITIONS, np.nan, np.float32)
        self.accessed = []  # (role, tensor) of each operand of the instruction being issued (_memory.operand)
        self.no_reorder = 0  # the nl.no_reorder block being issued (its serial), 0 outside one
        self.read_poison = False  # the instruction being issued read memory never written (_memory.read)


_running = threading.local()  # .core: the core this thread's program runs on; .label: the issuing instruction's name=
_no_reorder_blocks = itertools.count(1)  # serial of each nl.no_reorder block (Instruction.no_reorder)


@contextlib.contextmanager
def no_reorder_block():
    """The block of ``with nl.no_reorder():``: the instructions issued inside it, however deeply called, carry its
    serial. A block inside another is part of the outer one (KLR/KLR/Trace/Types.lean l. 405-413, beginWithBlock /
    endWithBlock: only the outermost block opens and closes one)."""
    core = current("nl.no_reorder")
    outer = core.no_reorder
    core.no_reorder = outer or next(_no_reorder_blocks)
    try:
        yield
    finally:
        core.no_reorder = outer


@contextlib.contextmanager
def labelled(label):
    """While one ``nki.isa`` instruction with ``name=label`` is issued: its label goes into the trace (count)."""
    outer = getattr(_running, "label", None)
    _running.label = label
    try:
        yield
    finally:
        _running.label = outer


def current(what):
    """The running core; NKI calls are only meaningful inside a kernel."""
    core = getattr(_running, "core", None)
    if core is None:
        raise NkiValidationError(f"{what}: called outside a kernel; launch the kernel with nki.jit")
    return core


@contextlib.contextmanager
def running(core):
    if getattr(_running, "core", None) is not None:
        raise NkiValidationError("nki.jit: a kernel cannot launch another kernel; call sub-kernels as plain "
                                 "functions (they carry no @nki.jit)")
    _running.core = core
    try:
        yield core
    finally:
        _running.core = None


def begin(name):
    """Start instruction ``name`` on the running core: it gets the next instruction index."""
    core = current(name)
    core.now += 1
    core.issued.append(name)
    core.accessed = []
    core.read_poison = False
    return core


def count(name, engine, partitions, free, dst=None, inputs=(), ops=(), stationary=0, reads_accumulator=False,
          accumulate=False):
    """Record a finished instruction that streamed a (partitions x free) tile: its destination tensor,
    tensor inputs and operators (functions or names) go into the trace for the cost model."""
    core = getattr(_running, "core", None)
    label = getattr(_running, "label", None) or ""
    after = _schedule_edges(core, name, label) if core is not None and label else ()
    if not _counters:
        return
    tensors = [t for t in (dst, *inputs) if t is not None]
    accessed = core.accessed if core is not None else []
    writes = tuple(_region(t) for role, t in accessed if role in _WRITTEN_ROLES)
    reads = tuple(_region(t) for role, t in accessed if role not in _WRITTEN_ROLES)
    record = Instruction(name, engine, partitions, free, tuple(t.dtype.name for t in tensors),
                         tuple(t.buffer.value for t in tensors), tuple(getattr(op, "__name__", op) for op in ops),
                         stationary, reads_accumulator, reads, writes, core.launch.serial if core is not None else 0,
                         label, after, core.no_reorder if core is not None else 0, accumulate)
    for counts in _counters:
        counts.instructions[engine] += 1
        counts.by_instruction[name] += 1
        counts.trace.append(record)


def _schedule_edges(core, instruction, label):
    """The labels that the instruction named ``label`` must follow (Kernel.with_schedule), each issued before it."""
    after = core.launch.schedule_edges.get(label, ())
    missing = [name for name in after if name not in core.launch.labels]
    if missing:
        raise NkiValidationError(f"with_schedule: {instruction} name={label!r} must follow {missing[0]!r}, which the "
                                 "kernel has not issued before it; the emulator schedules the edges of with_schedule "
                                 "along program order: name an instruction issued earlier")
    core.launch.labels.add(label)
    return after


_WRITTEN_ROLES = ("dst", "reduce_res")  # every other operand role of an instruction is read


def _region(t):
    """The rectangle of memory a tensor view covers (see Instruction.reads). On chip: partitions x the bytes
    each partition's part of the view spans; in HBM: the bytes the whole view spans."""
    storage, data = t._storage, t._data
    if t._rows is not None:  # an ap(vector_offset=) view: rows anywhere in its (HBM) storage
        return storage.serial, 0, 1, 0, storage.array.nbytes
    offset = data.__array_interface__["data"][0] - storage.array.__array_interface__["data"][0]
    span = data.itemsize + sum((n - 1) * abs(s) for n, s in zip(data.shape[1:], data.strides[1:]))
    if storage.buffer.value in ("sbuf", "psum"):
        row = storage.array.strides[0]
        first = offset // row
        return storage.serial, first, first + (data.shape[0] - 1) * data.strides[0] // row + 1, offset % row, \
            offset % row + span
    span += (data.shape[0] - 1) * abs(data.strides[0]) if data.ndim else 0
    return storage.serial, 0, 1, offset, offset + span

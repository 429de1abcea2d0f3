"""The compiler's SBUF allocation modelled: what does not fit is spilled to HBM and reloaded, and a tile's bytes are
reused only once the tile that held them before is done with them.

:func:`with_spills` rewrites one kernel call's trace (``Counts.trace``) as the compiler must have compiled it, for
the schedules of :mod:`._schedule` (the central and the pessimistic figure; the optimistic one, the busiest engine's time, is
left without: a compiler may reorder a kernel so that it needs less SBUF than program order does). Per launch:

- **Live ranges** (program order): an SBUF tile that the compiler places (an ``SbufTile`` in the trace's
  rectangles: allocated without ``address=``, which pins a tile where the kernel says) is live from its first access
  to its last, and takes its bytes per partition: the emulator's own SBUF accounting
  (:func:`._memory.check_capacity`), so that a kernel the emulator accepts never spills. Capacity: the SBUF a
  kernel may use per partition, ``Target.sbuf_usable_bytes`` (leanprover/KLR KLR/Trace.lean l. 52-54: 180224 on
  trn1, 212984 on trn2).
- **Spills** (AWS's description: aws-neuron-sdk 3afa0fdf nki/deep-dives/nki_perf_guide.rst l. 142-164, Opt #2:
  an intermediate that does not fit in SBUF is saved to device memory by "compiler generated spilling" and
  reloaded where it is used, counted by the profiler's spill_save_bytes and spill_reload_bytes): before each
  instruction, once the tiles it touches are in SBUF, while the live tiles take more than the capacity, the one
  whose next access is furthest away goes out (Belady's MIN: L. A. Belady, "A study of
  replacement algorithms for a virtual-storage computer", IBM Systems Journal 5(2), 1966: the fewest reloads of
  any choice; the rule that M. Braun and S. Hack, "Register Spilling and Live-Range Splitting for SSA-Form
  Programs", CC 2009, spill by). A tile goes out with a ``spill_store`` (SBUF to HBM, after its last write; only if
  written since it last went out: its HBM copy is still good otherwise) and comes back with a ``spill_reload``
  (HBM to SBUF) before its next access, unless that access overwrites the whole tile without reading it. A tile
  that holds what one DMA loaded whole from HBM, unchanged since, is not stored: it comes back by a ``refetch``
  from where it was loaded (rematerialization: P. Briggs, K. D. Cooper, L. Torczon, "Rematerialization", PLDI
  1992: a value cheaper to recompute than to spill is recomputed; AccelOpt's matmul profile shows it, no bytes
  spilled and 9.26 GB of HBM traffic where its source loads 1.46 GB). Where the tile that a load brings in whole
  from HBM (and nothing else) is itself the one used furthest ahead, it is the one left out (Belady's MIN with
  bypass: the cache need not keep what it fetches): the load moves to just before the tile's next use, as the
  compiler's scheduler may move it (a load waits on its source alone), and no transfer is added. Each moves the
  whole tile: AWS does not
  document what the compiler spills; AccelOpt's profiles count bytes saved and reloaded (spill_save_bytes,
  spill_reload_bytes), which calibrate.py sets beside these.
- **Reuse**: each stay of a tile in SBUF (from its first access or reload to its last access or its store) takes
  bytes by next fit (the first gap from where the last placement ended, wrapping round), so that the bytes freed
  longest ago are reused first, as a compiler that keeps independent work apart would. The stay's first
  instruction then waits for the last instruction of every stay that held those bytes before (write after read
  on the bytes): the list schedule may run a tile's producer ahead of program order only as far as SBUF has room.
  A stay that finds no gap (fragmentation) is placed past the capacity and waits for nothing; ``unplaced`` counts
  them.

How the transfers are scheduled is :mod:`._schedule`'s: a spill_store on a DMA queue of its own, and a spill_reload
issued by the engine of the instruction it is inserted for, in that engine's turn, which waits for it, idle (a
blocking semaphore wait: aws-neuron-sdk v2.23.0 general/nki/tutorials/fused_mamba.rst l. 750-767); a refetch is an
ordinary load.

The edges are written into the trace as the schedule already reads them: a reuse edge is a one-byte token that
the earlier instruction reads and the later one writes (``("reuse", k)`` rectangles); a spilled tile's HBM copy is
``("spill", serial)``.
"""

import bisect
import heapq
import itertools
from collections import defaultdict

from ._runtime import TARGETS, Instruction, SbufTile

ASSUMPTIONS = (
    "SBUF spills: each SBUF tile the compiler places is live from its first access to its last in program order, "
    "at its bytes per partition (the emulator's SBUF accounting); where the live tiles exceed the SBUF a kernel may "
    "use (KLR/Trace.lean l. 52-54: 180224 B per partition on trn1, 212984 on trn2), the one whose next access is "
    "furthest away is spilled (Belady's MIN, the register allocator's choice): a DMA of the whole tile to HBM "
    "after its last write (once per change) and back before its next read, or, for a tile loaded whole from HBM "
    "and unchanged, no store and a refetch from where it was loaded (rematerialization), or, where that tile is the "
    "one a load is bringing in, the load moved to its next use (a bypass); the central and pessimistic figures "
    "schedule these transfers, the optimistic one does not",
    "SBUF reuse: each stay of a tile in SBUF takes its bytes by next fit (the bytes freed longest ago first), and "
    "its first instruction waits for the last one of the stays that held them before, so the list schedule runs "
    "ahead only as far as SBUF has room",
)


def _tiles(rects):
    return {r[0] for r in rects if isinstance(r[0], SbufTile)}


def _whole_tile(tile):
    return (tile, 0, tile.partitions, 0, tile.row_bytes)


def _writes_whole(instruction, tile):
    return any(r[0] == tile and r[1] <= 0 and r[2] >= tile.partitions and r[3] <= 0 and r[4] >= tile.row_bytes
               for r in instruction.writes)


def _overwrites(instruction, tile):
    """Whether ``instruction`` writes all of ``tile`` without reading it (its old value is dead)."""
    return tile not in _tiles(instruction.reads) and _writes_whole(instruction, tile)


def _transfer(name, tile, launch, source=None, writes=()):
    """A spill_store (SBUF to HBM), spill_reload (back) or refetch (from ``source``, the HBM rectangle it was
    loaded from) of the whole tile: one row per partition."""
    slot = (("spill", tile.serial), 0, 1, 0, tile.partitions * tile.row_bytes)
    if name == "spill_store":
        return Instruction(name, "dma", tile.partitions, tile.row_bytes, ("uint8", "uint8"), ("private_hbm", "sbuf"),
                           reads=(_whole_tile(tile),), writes=(slot,), launch=launch)
    return Instruction(name, "dma", tile.partitions, tile.row_bytes, ("uint8", "uint8"), ("sbuf", "private_hbm"),
                       reads=(source or slot,), writes=(_whole_tile(tile), *writes), launch=launch)


def _loaded_from(instruction, tile):
    """The HBM rectangle ``instruction`` loads all of ``tile`` from, if it is such a load (else None)."""
    loads = instruction.engine == "dma" and len(instruction.reads) == 1 and instruction.buffers[1].endswith("hbm")
    return instruction.reads[0] if loads and _writes_whole(instruction, tile) else None


class _Bytes:
    """Where each stay lies in a partition's bytes: next fit over the live stays, and the last stay that held
    each byte range (the output position of its last instruction), for the reuse edges."""

    def __init__(self, capacity):
        self.capacity, self.rover = capacity, 0
        self.live = []  # sorted (start, end) of the stays in SBUF
        self.history = []  # sorted, disjoint (start, end, position of the last instruction of the stay there)
        self.unplaced = 0

    def place(self, size):
        """Next fit: ``(start, the output positions whose stays held these bytes before)``."""
        start = self._gap(size, self.rover, self.capacity)
        if start is None:
            start = self._gap(size, 0, self.rover + size)
        if start is None:  # no gap big enough (fragmentation, or the instruction's own tiles exceed SBUF)
            self.unplaced += 1
            start = max([self.capacity] + [end for _, end in self.live])
        bisect.insort(self.live, (start, start + size))
        self.rover = start + size
        first, last = self._overlapping(start, start + size)
        return start, [position for _, _, position in self.history[first:last]]

    def _overlapping(self, start, end):
        """The slice of ``history`` whose ranges overlap [start, end)."""
        first = bisect.bisect_left(self.history, (start,))
        if first and self.history[first - 1][1] > start:
            first -= 1
        last = bisect.bisect_left(self.history, (end,), first)
        return first, last

    def _gap(self, size, low, high):
        """The first start >= low where ``size`` bytes fit among the live stays and end by min(high, capacity)."""
        at, start = bisect.bisect_left(self.live, (low, -1)), low
        if at and self.live[at - 1][1] > start:
            start = self.live[at - 1][1]
        while start + size <= min(high, self.capacity):
            if at == len(self.live) or self.live[at][0] >= start + size:
                return start
            start, at = max(start, self.live[at][1]), at + 1
        return None

    def free(self, start, size, position):
        """The stay at ``start`` ends with the instruction at output ``position``."""
        end = start + size
        del self.live[bisect.bisect_left(self.live, (start, end))]
        first, last = self._overlapping(start, end)
        pieces = self.history[first:last]
        kept = [(s, start, p) for s, e, p in pieces[:1] if s < start] + [(start, end, position)] + \
            [(end, e, p) for s, e, p in pieces[-1:] if e > end]
        self.history[first:last] = kept


class _Walk:
    """One launch in program order: which tiles are in SBUF and where, what goes out and comes back, and the trace
    as compiled (``out``)."""

    def __init__(self, instructions, capacity, tokens):
        self.instructions, self.capacity, self.tokens = instructions, capacity, tokens
        self.launch = instructions[0].launch if instructions else 0
        self.uses = defaultdict(list)  # tile -> the indices of the instructions that access it
        for i, instruction in enumerate(instructions):
            for tile in _tiles(instruction.reads) | _tiles(instruction.writes):
                self.uses[tile].append(i)
        self.next = dict.fromkeys(self.uses, 0)  # tile -> which of its uses comes next
        self.stay, self.used = {}, 0  # tile in SBUF -> its first byte; the bytes per partition they take
        self.dirty, self.in_hbm, self.last_position = set(), set(), {}
        self.source = {}  # tile -> the HBM rectangle it holds a copy of (loaded whole, unchanged since)
        self.deferred = {}  # tile -> the load of it that waits for the tile's next use (Belady left it out)
        self.heap = []  # (-index of the next access, serial, tile): Belady's victim first
        self.bytes, self.out, self.token_reads = _Bytes(capacity), [], defaultdict(list)
        self.moved = {"spill_store": 0, "spill_reload": 0, "refetch": 0}  # bytes

    def run(self):
        for instruction in self.instructions:
            self._step(instruction)
        return [instruction._replace(reads=instruction.reads + tuple(self.token_reads[p]))
                if p in self.token_reads else instruction for p, instruction in enumerate(self.out)]

    def _step(self, instruction):
        touched = sorted(_tiles(instruction.reads) | _tiles(instruction.writes))
        arriving = [tile for tile in touched if tile not in self.stay]
        self.used += sum(tile.row_bytes for tile in arriving)
        deferrable = self._deferrable(instruction, arriving, touched)
        if self._evict(set(touched), deferrable):  # the load moves to where its tile is next used
            self.deferred[deferrable], self.source[deferrable] = instruction, instruction.reads[0]
            self.next[deferrable] += 1
            return
        writes = ()
        for tile in arriving:
            load = self.deferred.pop(tile, None)
            if _overwrites(instruction, tile) or tile not in self.in_hbm and not load:
                writes += self._arrive(tile)  # (a deferred load whose value is overwritten unread is dropped)
            elif load:
                self.out.append(load._replace(writes=load.writes + self._arrive(tile)))
                self.last_position[tile] = len(self.out) - 1
            else:
                name = "refetch" if tile in self.source else "spill_reload"
                self._emit(_transfer(name, tile, self.launch, self.source.get(tile), self._arrive(tile)), tile)
            self.in_hbm.discard(tile)
        self.out.append(instruction._replace(writes=instruction.writes + writes))
        self._after(touched, instruction)

    def _deferrable(self, instruction, arriving, touched):
        """The tile a load brings in whole from HBM, where that is all the instruction does and the tile is used
        after it: Belady may leave it out of SBUF for now (a bypass), the load moving to the tile's next use."""
        tile = touched[0] if len(touched) == 1 and arriving else None
        used_after = tile and _loaded_from(instruction, tile) and self.next[tile] + 1 < len(self.uses[tile])
        return tile if used_after else None

    def _emit(self, transfer, tile):
        self.out.append(transfer)
        self.moved[transfer.name] += tile.partitions * tile.row_bytes
        self.last_position[tile] = len(self.out) - 1
        self.dirty.discard(tile)  # its HBM copy and the SBUF one agree

    def _arrive(self, tile):
        """Place ``tile``'s stay: the token rectangles its first instruction writes, one per earlier stay whose
        bytes it takes (that stay's last instruction reads it: the reuse edge)."""
        self.stay[tile], before = self.bytes.place(tile.row_bytes)
        tokens = tuple((("reuse", next(self.tokens)), 0, 1, 0, 1) for _ in dict.fromkeys(before))
        for position, token in zip(dict.fromkeys(before), tokens):
            self.token_reads[position].append(token)
        return tokens

    def _evict(self, touched, deferrable=None):
        """While the tiles in SBUF exceed it, spill the one whose next access is furthest away (Belady's MIN), of
        those the instruction does not touch, or, where that is ``deferrable`` (the tile a load brings in), leave
        that out instead: returns True then."""
        kept, deferred = [], False
        later = self.uses[deferrable][self.next[deferrable] + 1] if deferrable else -1
        while self.used > self.capacity:
            entry = self._victim(touched, kept)
            if entry is None or later > -entry[0]:
                kept += [entry] if entry else []
                if deferrable:
                    self.used, deferred = self.used - deferrable.row_bytes, True
                break
            tile = entry[2]
            self.used -= tile.row_bytes
            if tile in self.dirty and tile not in self.source:  # written since its HBM copy (if any) was made
                self._emit(_transfer("spill_store", tile, self.launch), tile)
            self.bytes.free(self.stay.pop(tile), tile.row_bytes, self.last_position[tile])
            self.in_hbm.add(tile)
        for entry in kept:
            heapq.heappush(self.heap, entry)
        return deferred

    def _victim(self, touched, kept):
        """The heap's valid entry used furthest ahead of the tiles not in ``touched`` (those go to ``kept``)."""
        while self.heap:
            entry = heapq.heappop(self.heap)
            tile = entry[2]
            if tile not in self.stay or -entry[0] != self.uses[tile][self.next[tile]]:
                continue  # out already, or accessed since: a stale entry
            if tile not in touched:
                return entry
            kept.append(entry)
        return None

    def _after(self, touched, instruction):
        position, written = len(self.out) - 1, _tiles(instruction.writes)
        for tile in touched:
            self.last_position[tile] = position
            self.next[tile] += 1
            if tile in written:
                self.dirty.add(tile)
                loaded_from = _loaded_from(instruction, tile)
                if loaded_from:
                    self.source[tile] = loaded_from
                else:
                    self.source.pop(tile, None)
            if self.next[tile] == len(self.uses[tile]):  # its last access: its bytes are free
                self.used -= tile.row_bytes
                self.bytes.free(self.stay.pop(tile), tile.row_bytes, position)
                self.dirty.discard(tile)
                self.source.pop(tile, None)
            else:
                heapq.heappush(self.heap, (-self.uses[tile][self.next[tile]], tile.serial, tile))


def with_spills(trace, generation):
    """``trace`` (one kernel call's, or several launches') as the compiler must have compiled it on ``generation``:
    spill transfers where the live SBUF tiles exceed what a kernel may use, reuse edges where a tile takes bytes
    another had (see the module docstring). Returns ``(trace, {"spill_store", "spill_reload", "refetch": bytes
    moved, "unplaced": stays that found no gap})``; a trace that names no SbufTile comes back as it is."""
    trace = list(trace)
    moved = {"spill_store": 0, "spill_reload": 0, "refetch": 0, "unplaced": 0}
    if not any(isinstance(r[0], SbufTile) for i in trace for r in i.reads + i.writes):
        return trace, moved
    capacity, tokens, out, first = TARGETS[generation].sbuf_usable_bytes, itertools.count(), [], 0
    for index in range(1, len(trace) + 1):
        if index == len(trace) or trace[index].launch != trace[first].launch:
            walk = _Walk(trace[first:index], capacity, tokens)
            out += walk.run()
            for key, value in (*walk.moved.items(), ("unplaced", walk.bytes.unplaced)):
                moved[key] += value
            first = index
    return out, moved

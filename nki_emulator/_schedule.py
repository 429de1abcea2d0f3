"""Schedules of a recorded trace: when each instruction would start and end on a NeuronCore.

The cost model (:mod:`._cost`) gives the overlap bound (the busiest engine: the optimistic figure) and the serial
bound. :func:`schedule` places each instruction of ``Counts.trace`` in time instead, two ways:

- ``order="list"`` (:func:`list_schedule`, the central figure): the compiler's scheduler modelled. The NKI compiler
  reorders instructions within their dependencies ("the automatic scheduler", [SCHED]); here a list scheduler over
  each launch's dependency graph does: whenever an engine or DMA queue can start an instruction, it starts, of those
  whose dependencies have ended, the next member of an accumulation group it is in, else the one issued first
  (oldest first). So program order is the priority, and an engine that would wait in program order runs later
  ready work meanwhile: the overlap of independent chains that the compiler finds. AWS does not publish its
  scheduler's rule. Critical path first (the longest path to the end first, Hu 1961; the "height" that LLVM's
  machine scheduler ranks by) was tried and dropped: on the kit's attention backward it ran later heads' loads and
  layout work ahead of the units waiting on them and came out slower than program order (114.6 against 99.6 us at
  the baseline, 88.4 oldest first), which a compiler evidently does not do to the hand order it is given. The
  dependencies: the tiles read and written (read after write, write after read and write after write, so a reused
  buffer orders its uses), ``kernel.with_schedule`` edges and ``nl.no_reorder`` blocks ([SCHED]; in a block each
  instruction follows the block's previous one on its engine, [KLR-NR]), and PSUM accumulation groups: an
  nc_matmul that adds onto a PSUM tile follows the one before it and, once its group has started, goes before
  other TensorE work. [ARCH] allows eight groups in flight, so keeping one together is the modelled compiler's
  choice (it errs slow where a group waits on an operand). The graph has every ordering the program's data
  imposes, and the SBUF reuse edges of :mod:`._spill` (a tile's bytes go to another only once its last access has
  ended): the schedule may run loads as early as the data and SBUF's room allow.
- ``order="program"`` (:func:`program_order_schedule`, the pessimistic figure): every engine runs its instructions
  in program order, as written.

Both schedules share the timing rules:

- each compute engine (TensorE, VectorE, ScalarE, GpSimd) runs one instruction at a time; an instruction starts
  when the tiles it reads have been written (read after write, plus DEPENDENCY_S when a compute engine wrote them),
  and the tiles it writes are no longer being read or written (write after read / write). Tiles are rectangles of
  partitions x bytes (``Instruction.reads`` / ``writes``), so two column slices of one tile do not wait for each
  other. Every allocation is its own tile, so a tile allocated inside a loop is a fresh one each iteration.
- both schedule the trace as the compiler must have compiled it (:func:`._spill.with_spills`): where the SBUF
  tiles live at once in program order exceed what a kernel may use, spill transfers out to HBM and back (Belady's
  choice of victim), and a tile placed in SBUF bytes another held waits for that one's last access.
- a DMA transfer waits in its queue (loads into SBUF, stores out of it and other copies are three queues, and spill
  stores a fourth: [MAMBA]) and pays the fixed cost DMA_FIXED_S, which transfers in flight overlap, then
  moves its bytes over the DMA engines that all transfers share (its cost-model time, in the first gap of their
  bandwidth long enough); each transfer is drawn on the lowest-numbered "dma queue" track free when it starts, so
  the tracks show how many were in flight.
- a new kernel launch starts when everything of the previous one has ended.
- a spill reload is issued by the engine that waits for it, and that engine waits for it, idle ([MAMBA]: "VectorE
  enters idle states due to a blocking semaphore wait for qSyncSpillReload0 activities"; "Computation and data
  movement are also not overlapped properly"; queues named after the engine that issues them, qVectorSpillReload0):
  the reload is an instruction of the engine of the instruction it was inserted for (the next one that touches its
  tile), taken in that engine's turn like its other instructions (in the list schedule, after the older ready
  ones; in program order, just before that instruction), and the engine starts nothing else until the transfer has
  ended. So a reload is not fetched ahead of its engine's work, as a load the program issues may be. Spill stores go
  on the spill queue, their issuer not waiting (the sources show waits on reloads). A refetch (_spill's reload of
  an unchanged input from where it came) is an ordinary load: AccelOpt's matmul profile counts no spill bytes for
  the re-reads it models.

Both are near-linear in the trace: a tile's accesses merge into one (a join node in the list schedule's graph)
beyond _MERGE_ABOVE, and the list schedule keeps its waiting and ready instructions in heaps.

Sources (aws-neuron/aws-neuron-sdk at HEAD, as in :mod:`._cost`, unless named):

- [PERF] nki/deep-dives/nki_perf_guide.rst, the chain of dependent one-element ScalarE instructions
  ("initiation interval ... around 189 ns (264 ScalarE cycles on NC-v2)") where the cost model charges
  MIN_II = 64 cycles: the 189 ns less those 64 cycles (46 ns) is the latency of a read-after-write edge.
- [DMA] nki/deep-dives/nki-dma-bandwidth-guide.rst, "Why Large Contiguous DMA Payloads Are Required": every
  DMA transfer incurs descriptor setup, synchronization and semaphore-to-start latency (~1300 ns).
- [SCHED] nki/guides/how-to-scheduling-apis.rst (the same at 3afa0fdf, NKI 0.4): "The extra dependency edges
  constrain the reordering that the automatic scheduler will do"; ``with_schedule`` and ``no_reorder``.
- [KLR-NR] leanprover/KLR KLR/Core/Operators.lean l. 1463-1466: an operator's engine "is used by the automatic
  dependency edge insertion under a no_reorder block".
- [MAMBA] aws-neuron-sdk tag v2.23.0 general/nki/tutorials/fused_mamba.rst l. 750-767 (HEAD:
  nki/guides/tutorials/fused_mamba.rst l. 752-769), the mamba_v2 profile at seq_len 8192: "new DMA activity rows
  qSyncSpillReload0 and qVectorSpillReload0, which are associated with data movement traffic for intermediate data
  spill from SBUF into device memory or reload back to SBUF"; "VectorE enters idle states due to a blocking
  semaphore wait for qSyncSpillReload0 activities"; and nki/deep-dives/nki_perf_guide.rst l. 351-366 (Opt #4): an
  instruction "blocked on S[47] (qSyncSpillReload0) ... is blocked by DMA activities for spilling", such as the
  transfer that "reloads the tensor named deltaU".
- [ARCH] nki/guides/architecture/trainium_inferentia2_arch.rst (3afa0fdf l. 834-837, 864-867): a matmul
  accumulation group; "TensorE can have up to eight outstanding matmul accumulation groups".

Not modelled: limits on DMA transfers in flight, the PSUM an early matmul would need (the list schedule may run
further ahead than PSUM allows; SBUF: :mod:`._spill`), SBUF/PSUM port contention; the two programs of an LNC=2
launch are scheduled on one core's engines (the estimates launch at LNC=1).
"""

import bisect
import heapq
import math
from collections import defaultdict
from typing import NamedTuple

from ._cost import ENGINE_SPECS, LAUNCH_S, MIN_II, STATIC_CYCLES, calibration_factor, estimate, instruction_seconds
from ._runtime import target as current_target
from ._spill import ASSUMPTIONS as SPILL_ASSUMPTIONS, with_spills

# [PERF]: a chain of dependent one-element ScalarE instructions issues one per ~189 ns (264 cycles on trn1); the
# calibrated figure charges each MIN_II + STATIC_CYCLES, so the read-after-write edge is the rest (~71 ns)
DEPENDENCY_S = 189e-9 - (MIN_II + STATIC_CYCLES) / ENGINE_SPECS["trn1"].scalar_hz
DMA_FIXED_S = 1.3e-6  # [DMA]: "semaphore-to-start latency (~1300 ns cross-engine)" per transfer
COMPUTE_TRACKS = ("tensor", "vector", "scalar", "gpsimd")
_MERGE_ABOVE = 32  # accesses kept per tile before they merge into one (keeps long traces linear)

_TIMING = ("an instruction waits for the tiles it reads to be written (+72 ns after a compute engine: [PERF]'s "
           "dependent chain less the instructions' MIN_II and static overhead) and for the tiles it writes to be "
           "free; DMA transfers wait in three queues (loads, stores, other copies) and a fourth for spill stores "
           "([MAMBA]: qSyncSpillReload0), each paying 1.3 us of fixed cost ([DMA]) overlapped with other transfers "
           "in flight, and share the DMA bandwidth; a spill reload is issued by the engine whose instruction it is "
           "inserted for, in that engine's turn, and the engine waits for it, idle ([MAMBA]: 'a blocking semaphore "
           "wait for qSyncSpillReload0 activities'); every allocation is its own buffer, as far as SBUF has room")
_CALIBRATED = ("each instruction's cost-model time times its calibrated factor (_cost.CALIBRATED; the table in "
               "docs/results.md), and a fixed cost per kernel launch (_cost.LAUNCH_S)")
CENTRAL_ASSUMPTIONS = (  # what the central estimate (central_estimate) assumes beyond the cost model
    "each kernel call is list-scheduled (nki_emulator/_schedule.py), the compiler's scheduler modelled: each engine "
    "and DMA queue starts, of the instructions whose dependencies have ended, the next of an accumulation group it "
    "is in, else the one issued first; dependencies: tiles read and written, with_schedule edges, no_reorder "
    "blocks; " + _TIMING,
    *SPILL_ASSUMPTIONS,
    _CALIBRATED,
)
PESSIMISTIC_ASSUMPTIONS = (  # the pessimistic estimate (pessimistic_estimate)
    "each kernel call is scheduled in program order: every engine runs its instructions as written; " + _TIMING,
    SPILL_ASSUMPTIONS[0],
    _CALIBRATED,
)
NOT_MODELLED = ("host dispatch idle (FrontierForge measured ~19% of a compiled K82s4 step idle on it; it would lower "
                "both figures); the compiler's fusions, and any reordering that would need less SBUF than program "
                "order (spills are priced as program order needs them: higher); the PSUM that the list schedule's "
                "look-ahead would need (it may run further ahead than PSUM allows: lower); SBUF/PSUM port "
                "contention (lower)")


class Slot(NamedTuple):
    """One scheduled instruction: its position in the trace as scheduled (the given one with _spill's transfers
    inserted, where SBUF overflows), name, track (an engine or "dma queue k"), times."""

    index: int
    name: str
    track: str
    start: float
    end: float


def _overlap(a, b):
    return a[1] < b[2] and b[1] < a[2] and a[3] < b[4] and b[3] < a[4]


def _covers(a, b):
    return a[1] <= b[1] and b[2] <= a[2] and a[3] <= b[3] and b[4] <= a[4]


def _merged(accesses):
    """Many accesses of one tile as one: the rectangle around them, at the latest of their times."""
    rect = (accesses[0][0][0], min(r[1] for r, *_ in accesses), max(r[2] for r, *_ in accesses),
            min(r[3] for r, *_ in accesses), max(r[4] for r, *_ in accesses))
    return [(rect, *(max(times) for times in zip(*(a[1:] for a in accesses))))]


class _Tiles:
    """Who wrote and who read each tile, and until when: the dependencies of the next instruction."""

    def __init__(self):
        self.writes = defaultdict(list)  # serial -> [(rect, end, visible: when a reader may start)]
        self.reads = defaultdict(list)  # serial -> [(rect, end)]

    def ready(self, reads, writes):
        """The earliest start that respects read after write, write after read and write after write."""
        t = 0.0
        for r in reads:
            t = max([t] + [visible for w, _, visible in self.writes[r[0]] if _overlap(r, w)])
        for w in writes:
            t = max([t] + [end for o, end, _ in self.writes[w[0]] if _overlap(w, o)]
                    + [end for o, end in self.reads[w[0]] if _overlap(w, o)])
        return t

    def record(self, reads, writes, end, visible):
        for r in reads:
            self.reads[r[0]].append((r, end))
            if len(self.reads[r[0]]) > _MERGE_ABOVE:
                self.reads[r[0]] = _merged(self.reads[r[0]])
        for w in writes:  # what this write covers is ordered before it: the later instructions wait on it alone
            self.writes[w[0]] = [a for a in self.writes[w[0]] if not _covers(w, a[0])] + [(w, end, visible)]
            self.reads[w[0]] = [a for a in self.reads[w[0]] if not _covers(w, a[0])]
            if len(self.writes[w[0]]) > _MERGE_ABOVE:
                self.writes[w[0]] = _merged(self.writes[w[0]])


class _Bandwidth:
    """When the shared DMA engines are busy: sorted, disjoint (start, end) intervals, touching ones merged."""

    def __init__(self):
        self.busy = []

    def reserve(self, ready, duration):
        """Book the first gap of ``duration`` seconds from ``ready`` on; returns its start."""
        at = bisect.bisect_right(self.busy, (ready, math.inf))
        start = max(ready, self.busy[at - 1][1]) if at else ready
        while at < len(self.busy) and self.busy[at][0] < start + duration:
            start, at = max(start, self.busy[at][1]), at + 1
        self.busy.insert(at, (start, start + duration))
        if at + 1 < len(self.busy) and self.busy[at + 1][0] <= start + duration:  # merge with the next
            self.busy[at:at + 2] = [(start, self.busy[at + 1][1])]
        if at and self.busy[at - 1][1] >= start:  # and with the one before
            self.busy[at - 1:at + 1] = [(self.busy[at - 1][0], self.busy[at][1])]
        return start


SPILL_TRANSFERS = ("spill_store", "spill_reload")  # _spill's transfers of spilled tiles (a refetch is a load)
# (a spill_reload goes on the spill queue only where the instruction it is inserted for is a DMA: _reload_issuers)


def _dma_queue(instruction):
    """[MAMBA]: the compiler's spill traffic has queues of its own ("qSyncSpillReload0", "qVectorSpillReload0"
    beside the program's "qSyncIO0"); the rest go by direction."""
    if instruction.name in SPILL_TRANSFERS:
        return "spill"
    sbuf_dst, sbuf_src = instruction.buffers[0] == "sbuf", "sbuf" in instruction.buffers[1:]
    return "load" if sbuf_dst and not sbuf_src else "store" if sbuf_src and not sbuf_dst else "copy"


def _reload_issuers(instructions):
    """{spill_reload node: the engine of the instruction it was inserted for (the next one that touches its tile)},
    where that runs on a compute engine: [MAMBA], that engine issues the reload and waits for it on a blocking
    semaphore, idle ("not overlapped")."""
    issuers = {}
    for node, instruction in enumerate(instructions):
        if instruction.name != "spill_reload":
            continue
        tile = instruction.writes[0][0]
        waiter = next((later for later in range(node + 1, len(instructions))
                       if any(r[0] == tile for r in instructions[later].reads + instructions[later].writes)), None)
        if waiter is not None and instructions[waiter].engine != "dma":
            issuers[node] = instructions[waiter].engine
    return issuers


_ORDER, _DATA, _JOIN = 0, 1, 2  # an edge waits for the end / for the result to be visible; or joins accesses


class _Graph:
    """The dependency graph of one kernel launch. Node k < n is the launch's k-th instruction; the nodes from n on
    join many accesses of one tile into one (_Accesses._merged), so that long traces stay linear."""

    def __init__(self, instructions):
        self.succs = [[] for _ in instructions]  # node -> [(successor, kind)]
        self.npreds = [0] * len(instructions)
        self.group_next = {}  # nc_matmul node -> the next member of its PSUM accumulation group

    def add(self, node, preds):
        """``preds``: {predecessor: kind}."""
        for pred, kind in preds.items():
            self.succs[pred].append((node, kind))
        self.npreds[node] = len(preds)

    def join(self, nodes):
        join = len(self.succs)
        self.succs.append([])
        self.npreds.append(0)
        self.add(join, dict.fromkeys(nodes, _JOIN))
        return join


class _Accesses:
    """Which nodes last wrote and have read each tile since: the predecessors of the next instruction (read after
    write, write after read, write after write), as _Tiles but by node rather than by time."""

    def __init__(self, graph):
        self.graph = graph
        self.writes = defaultdict(list)  # serial -> [(rect, node)]
        self.reads = defaultdict(list)

    def preds(self, reads, writes):
        preds = {}
        for r in reads:
            preds.update((node, _DATA) for w, node in self.writes[r[0]] if _overlap(r, w))
        for w in writes:
            for o, node in self.writes[w[0]] + self.reads[w[0]]:
                if _overlap(w, o):
                    preds.setdefault(node, _ORDER)
        return preds

    def record(self, node, reads, writes):
        for r in reads:
            self.reads[r[0]].append((r, node))
            if len(self.reads[r[0]]) > _MERGE_ABOVE:
                self.reads[r[0]] = self._merged(self.reads[r[0]])
        for w in writes:  # what this write covers is ordered before it: the later instructions wait on it alone
            self.writes[w[0]] = [a for a in self.writes[w[0]] if not _covers(w, a[0])] + [(w, node)]
            self.reads[w[0]] = [a for a in self.reads[w[0]] if not _covers(w, a[0])]
            if len(self.writes[w[0]]) > _MERGE_ABOVE:
                self.writes[w[0]] = self._merged(self.writes[w[0]])

    def _merged(self, accesses):
        rect = (accesses[0][0][0], min(r[1] for r, _ in accesses), max(r[2] for r, _ in accesses),
                min(r[3] for r, _ in accesses), max(r[4] for r, _ in accesses))
        return [(rect, self.graph.join(node for _, node in accesses))]


def _launch_graph(instructions):
    """The dependencies of one launch's instructions: tiles (_Accesses), ``with_schedule`` edges (after the last
    instruction of each label named), ``no_reorder`` blocks (each instruction after the block's previous one on its
    engine: KLR/KLR/Core/Operators.lean l. 1463-1466, the engine of an operator "is used by the automatic dependency
    edge insertion under a no_reorder block") and PSUM accumulation groups (an nc_matmul that adds onto a tile
    continues the group of the last nc_matmul that wrote the same rectangle)."""
    graph = _Graph(instructions)
    accesses, labelled, blocks, accumulating = _Accesses(graph), {}, {}, {}
    for node, instruction in enumerate(instructions):
        preds = accesses.preds(instruction.reads, instruction.writes)
        for label in instruction.after:
            if label not in labelled:
                raise ValueError(f"with_schedule edge: {instruction.name} {instruction.label!r} must follow "
                                 f"{label!r}, which no instruction before it in its launch is named")
            preds.setdefault(labelled[label], _ORDER)
        if instruction.no_reorder:
            block = (instruction.no_reorder, instruction.engine)
            if block in blocks:
                preds.setdefault(blocks[block], _ORDER)
            blocks[block] = node
        if instruction.name == "nc_matmul":
            for rect in instruction.writes:
                if instruction.accumulate and rect in accumulating:
                    graph.group_next[accumulating[rect]] = node
                accumulating[rect] = node
        graph.add(node, preds)
        accesses.record(node, instruction.reads, instruction.writes)
        if instruction.label:
            labelled[instruction.label] = node
    return graph


class _LaunchState:
    """What the list schedule of one launch knows as it goes: when each node ended and its result became visible,
    when each still-waiting node may start, and how many of its predecessors are still to finish."""

    def __init__(self, graph, n, resource, start_at):
        total = len(graph.succs)
        self.graph, self.n, self.resource = graph, n, resource
        self.ready_at, self.end, self.visible = [start_at] * total, [start_at] * total, [start_at] * total
        self.remaining = list(graph.npreds)
        # resource -> heap of (ready_at, node) whose preds are done; sorted, so that a tie between two resources
        # (_next_resource) goes the same way in every process (a set of strings iterates in a per-process order)
        self.pending = {r: [] for r in sorted(set(resource))}
        for node in range(n):
            if not self.remaining[node]:  # appended in order, at one time: already heaps
                self.pending[resource[node]].append((start_at, node))

    def finish(self, node):
        """``node`` has ended: its successors learn when they may start; those with no predecessor left wait."""
        stack = [node]
        while stack:
            done = stack.pop()
            for succ, kind in self.graph.succs[done]:
                if kind == _JOIN:
                    self.end[succ] = max(self.end[succ], self.end[done])
                    self.visible[succ] = max(self.visible[succ], self.visible[done])
                else:
                    self.ready_at[succ] = max(self.ready_at[succ],
                                              self.visible[done] if kind == _DATA else self.end[done])
                self.remaining[succ] -= 1
                if not self.remaining[succ]:
                    if succ >= self.n:  # a join ends with the last access it joins
                        stack.append(succ)
                    else:
                        heapq.heappush(self.pending[self.resource[succ]], (self.ready_at[succ], succ))


def _next_resource(state, ready, free):
    """The engine or DMA queue that can start an instruction soonest, and when."""
    best, best_t = None, math.inf
    for r, heap in state.pending.items():
        t = free[r] if ready[r] else max(free[r], heap[0][0]) if heap else math.inf
        if t < best_t:
            best, best_t = r, t
    if best is None:
        raise RuntimeError("list schedule: instructions left whose dependencies never end (a cycle)")
    return best, best_t


def _list_launch(instructions, first_index, generation, seconds, start_at, bandwidth, lanes):
    """List-schedule one launch from ``start_at``: whenever an engine or DMA queue can start something, it starts,
    of the instructions whose dependencies have ended, the next member of an accumulation group it is in, else the
    one issued first (oldest first). A spill reload is issued by the engine that waits for it ([MAMBA]), in that
    engine's turn, and holds it until the transfer has ended."""
    n, graph, issuers = len(instructions), _launch_graph(instructions), _reload_issuers(instructions)
    durations = [seconds(i, generation) for i in instructions]
    is_dma = [i.engine == "dma" for i in instructions]
    continuing = set(graph.group_next.values())
    resource = [issuers.get(node) or (_dma_queue(i) if dma else i.engine)
                for node, (i, dma) in enumerate(zip(instructions, is_dma))]
    state = _LaunchState(graph, n, resource, start_at)
    ready, free, slots = {r: [] for r in state.pending}, dict.fromkeys(state.pending, start_at), []
    for _ in range(n):
        r, start = _next_resource(state, ready, free)
        while state.pending[r] and state.pending[r][0][0] <= start:
            node = heapq.heappop(state.pending[r])[1]
            heapq.heappush(ready[r], (node not in continuing, node))
        node = heapq.heappop(ready[r])[1]
        if is_dma[node]:
            moving = bandwidth.reserve(start + DMA_FIXED_S, durations[node])
            start = moving - DMA_FIXED_S  # a queue's next transfer may pay its fixed cost meanwhile
            end = moving + durations[node]
            free[r] = end if node in issuers else start  # an engine that issued a reload waits for it
            state.end[node] = state.visible[node] = end
            track = _lane(lanes, start, end)
        else:
            end = free[r] = start + durations[node]
            state.end[node], state.visible[node], track = end, end + DEPENDENCY_S, r
        slots.append(Slot(first_index + node, instructions[node].name, track, start, end))
        state.finish(node)
    return slots


def list_schedule(trace, generation=None, seconds=instruction_seconds):
    """The central schedule: the compiler's scheduler modelled as a list scheduler over each launch's dependency
    graph (see the module docstring). Same arguments and result as :func:`schedule`."""
    generation = generation or current_target().name
    bandwidth, lanes, slots, makespan, launches, first = _Bandwidth(), [], [], 0.0, 0, 0
    for index in range(1, len(trace) + 1):
        if index == len(trace) or trace[index].launch != trace[first].launch:  # a launch starts after the last ends
            slots += _list_launch(trace[first:index], first, generation, seconds, makespan, bandwidth, lanes)
            makespan, launches, first = max([makespan] + [s.end for s in slots[-(index - first):]]), launches + 1, index
    slots.sort(key=lambda slot: slot.index)
    return {"slots": slots, "scheduled_s": makespan, "launches": launches}


def program_order_schedule(trace, generation=None, seconds=instruction_seconds):
    """The pessimistic schedule: every engine issues its instructions in program order, as written (the compiler
    reorders nothing). Same arguments and result as :func:`schedule`."""
    generation = generation or current_target().name
    free, issuers = dict.fromkeys(COMPUTE_TRACKS, 0.0), _reload_issuers(trace)
    queue_start, bandwidth, lanes, tiles, slots = {}, _Bandwidth(), [], _Tiles(), []
    launch, launches, launch_start, makespan, labelled = None, 0, 0.0, 0.0, {}
    for index, instruction in enumerate(trace):
        if instruction.launch != launch or launch is None:  # a new kernel starts after the last one has ended
            launch, launches, launch_start, labelled = instruction.launch, launches + 1, makespan, {}
            tiles = _Tiles()
        ready = max([launch_start, tiles.ready(instruction.reads, instruction.writes)]
                    + [labelled[label] for label in instruction.after])  # with_schedule edges
        duration = seconds(instruction, generation)
        if instruction.engine == "dma":
            issuer = issuers.get(index)  # a spill reload: issued by the engine that waits for it, in its turn
            after = free[issuer] if issuer else queue_start.get(_dma_queue(instruction), 0.0)
            moving = bandwidth.reserve(max(ready, after) + DMA_FIXED_S, duration)
            start, end = moving - DMA_FIXED_S, moving + duration
            if issuer:
                free[issuer] = end  # it waits for it
            else:
                queue_start[_dma_queue(instruction)] = start
            visible = end
            track = _lane(lanes, start, end)
        else:
            track = instruction.engine
            start = max(ready, free[track], launch_start)
            end = free[track] = start + duration
            visible = end + DEPENDENCY_S
        tiles.record(instruction.reads, instruction.writes, end, visible)
        if instruction.label:
            labelled[instruction.label] = end
        slots.append(Slot(index, instruction.name, track, start, end))
        makespan = max(makespan, end)
    return {"slots": slots, "scheduled_s": makespan, "launches": launches}


def _lane(lanes, start, end):
    """The "dma queue k" track of a transfer: the lowest-numbered one free when it starts."""
    lane = next((q for q, busy_until in enumerate(lanes) if busy_until <= start), len(lanes))
    lanes[lane:lane + 1] = [end]
    return f"dma queue {lane}"


ORDERS = {"list": list_schedule, "program": program_order_schedule}


def schedule(trace, generation=None, seconds=instruction_seconds, order="list"):
    """Schedule ``trace`` (``counts.trace``) on one NeuronCore of ``generation`` (default: the emulator's target).
    ``seconds(instruction, generation)`` prices each instruction (default: the cost model's). ``order``: "list" (the
    compiler's scheduler modelled: the central schedule) or "program" (each engine in program order: the pessimistic
    one). Both schedule the trace as compiled (_spill.with_spills: the spill transfers where the live SBUF tiles
    exceed what a kernel may use, and SBUF reuse as edges). Returns ``{"slots": [Slot] in the order of that trace
    (the given one, with spill_store / spill_reload / refetch transfers inserted where a tile goes out and comes
    back), "scheduled_s": when the last instruction ends, "launches": kernel launches, "spilled_bytes":
    {"spill_store", "spill_reload", "refetch": bytes moved, "unplaced": stays that found no gap}, "trace": that
    trace}``."""
    if order not in ORDERS:
        raise ValueError(f"schedule: order={order!r}; use one of {', '.join(ORDERS)}")
    generation = generation or current_target().name
    compiled, spilled = with_spills(trace, generation)
    return {**ORDERS[order](compiled, generation, seconds), "spilled_bytes": spilled, "trace": compiled}


def calibrated_seconds(instruction, generation):
    """The cost model's time times the calibrated factor for the instruction's engine (_cost.CALIBRATED), plus
    the static overhead of a VectorE, ScalarE or GpSimd instruction (_cost.STATIC_CYCLES)."""
    seconds = instruction_seconds(instruction, generation) * calibration_factor(instruction, generation)
    if instruction.engine in ("vector", "scalar", "gpsimd"):
        seconds += STATIC_CYCLES / ENGINE_SPECS[generation or current_target().name].hz(instruction.engine)
    return seconds


def _with_launches(result):
    return result["scheduled_s"] + LAUNCH_S * result["launches"]


def central_estimate(trace, generation=None):
    """The central estimate of a kernel call: its list schedule (the compiler's scheduler modelled) with the
    calibrated factors, plus LAUNCH_S per kernel launch. ``{"central_s", "scheduled_s" (that schedule, without the
    launches), "launches", "spilled_bytes" (with_spills' bytes stored, reloaded and refetched, and stays left
    unplaced)}``."""
    result = schedule(trace, generation, calibrated_seconds, "list")
    return {"central_s": _with_launches(result), "scheduled_s": result["scheduled_s"], "launches": result["launches"],
            "spilled_bytes": result["spilled_bytes"]}


def pessimistic_estimate(trace, generation=None):
    """The pessimistic estimate of a kernel call: as central_estimate, but every engine in program order (the
    compiler reorders nothing). ``{"pessimistic_s", "scheduled_s", "launches"}``."""
    result = schedule(trace, generation, calibrated_seconds, "program")
    return {"pessimistic_s": _with_launches(result), "scheduled_s": result["scheduled_s"],
            "launches": result["launches"]}


def schedule_figures(trace, generation=None):
    """A kernel call's three figures: ``optimistic_s`` (the overlap bound: the busiest engine, the cost model as it
    is), ``central_s`` (central_estimate: the list schedule, calibrated, with launches), ``pessimistic_s``
    (pessimistic_estimate: program order, calibrated, with launches); and ``scheduled_s`` (the list schedule with the
    cost model as it is, no launches), ``launches`` and ``spilled_bytes`` (the SBUF spills the two schedules
    include: _spill.with_spills)."""
    trace, generation = list(trace), generation or current_target().name
    compiled, spilled = with_spills(trace, generation)  # once for the three schedules
    central = list_schedule(compiled, generation, calibrated_seconds)
    return {"optimistic_s": estimate(trace, generation)["estimate_s"], "central_s": _with_launches(central),
            "pessimistic_s": _with_launches(program_order_schedule(compiled, generation, calibrated_seconds)),
            "scheduled_s": list_schedule(compiled, generation)["scheduled_s"], "launches": central["launches"],
            "spilled_bytes": spilled}

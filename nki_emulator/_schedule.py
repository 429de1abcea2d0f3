"""A schedule of a recorded trace: when each instruction would start and end on a NeuronCore.

The cost model (:mod:`._cost`) gives two bounds, the busiest engine (everything overlaps) and the sum
(nothing does). :func:`schedule` places each instruction of ``Counts.trace`` in time instead:

- each compute engine (TensorE, VectorE, ScalarE, GpSimd) is an in-order queue: an instruction starts when
  its engine has finished the one before it on that engine, and
- when the tiles it reads have been written (read after write, plus DEPENDENCY_S when a compute engine
  wrote them), and the tiles it writes are no longer being read or written (write after read / write).
  Tiles are rectangles of partitions x bytes (``Instruction.reads`` / ``writes``), so two column slices of
  one tile do not wait for each other. Every allocation is its own tile, so a tile allocated inside a loop is
  a fresh one each iteration, as if the compiler gave each iteration its own buffer (the best case).
- a DMA transfer waits in its queue (loads into SBUF, stores out of it and other copies are three queues, each
  in order) and pays the fixed cost DMA_FIXED_S, which transfers in flight overlap, then moves its bytes over the
  DMA engines that all transfers share (its cost-model time, in the first gap of their bandwidth long enough);
  each transfer is drawn on the lowest-numbered "dma queue" track free when it starts, so the tracks show how
  many were in flight.
- a new kernel launch starts when everything of the previous one has ended.

Sources (aws-neuron/aws-neuron-sdk at HEAD, as in :mod:`._cost`):

- [PERF] nki/deep-dives/nki_perf_guide.rst, the chain of dependent one-element ScalarE instructions
  ("initiation interval ... around 189 ns (264 ScalarE cycles on NC-v2)") where the cost model charges
  MIN_II = 64 cycles: the 189 ns less those 64 cycles (46 ns) is the latency of a read-after-write edge.
- [DMA] nki/deep-dives/nki-dma-bandwidth-guide.rst, "Why Large Contiguous DMA Payloads Are Required": every
  DMA transfer incurs descriptor setup, synchronization and semaphore-to-start latency (~1300 ns).

Not modelled: the compiler's own scheduling (it may reorder instructions across engines, hoist loads and
allocate fewer buffers than one per tile), limits on DMA transfers in flight, SBUF/PSUM port contention; the two
programs of an LNC=2 launch are scheduled on one core's engines (the estimates launch at LNC=1).
"""

import bisect
import math
from collections import defaultdict
from typing import NamedTuple

from ._cost import ENGINE_SPECS, LAUNCH_S, MIN_II, calibration_factor, instruction_seconds
from ._runtime import target as current_target

DEPENDENCY_S = 189e-9 - MIN_II / ENGINE_SPECS["trn1"].scalar_hz  # [PERF]: 264-cycle dependent chain, 143 ns extra
DMA_FIXED_S = 1.3e-6  # [DMA]: "semaphore-to-start latency (~1300 ns cross-engine)" per transfer
COMPUTE_TRACKS = ("tensor", "vector", "scalar", "gpsimd")
_MERGE_ABOVE = 32  # accesses kept per tile before they merge into one (keeps long traces linear)

CENTRAL_ASSUMPTIONS = (  # what the central estimate (central_estimate) assumes beyond the cost model
    "each kernel call is scheduled (nki_emulator/_schedule.py): every engine runs its instructions in issue order; "
    "an instruction waits for the tiles it reads to be written (+143 ns after a compute engine, [PERF]'s dependent "
    "chain) and for the tiles it writes to be free; DMA transfers wait in three in-order queues (loads, stores, "
    "other copies), each paying 1.3 us of fixed cost ([DMA]) overlapped with other transfers in flight, and share "
    "the DMA bandwidth; every allocation is its own buffer",
    "each instruction's cost-model time times its calibrated factor (_cost.CALIBRATED; the table in "
    "docs/results.md), and a fixed cost per kernel launch (_cost.LAUNCH_S)",
)
NOT_MODELLED = ("host dispatch idle (FrontierForge measured ~19% of a compiled K82s4 step idle on it; it would lower "
                "both figures); the compiler's own scheduling (it may interleave independent loop iterations that "
                "this schedule runs in program order, which would raise the central figure towards the optimistic "
                "one, and it fuses and spills, either way); SBUF/PSUM port contention (lower)")


class Slot(NamedTuple):
    """One scheduled instruction: its position in the trace, name, track (an engine or "dma queue k"), times."""

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


def _dma_queue(instruction):
    sbuf_dst, sbuf_src = instruction.buffers[0] == "sbuf", "sbuf" in instruction.buffers[1:]
    return "load" if sbuf_dst and not sbuf_src else "store" if sbuf_src and not sbuf_dst else "copy"


def schedule(trace, generation=None, seconds=instruction_seconds):
    """Schedule ``trace`` (``counts.trace``) on one NeuronCore of ``generation`` (default: the emulator's target).
    ``seconds(instruction, generation)`` prices each instruction (default: the cost model's).
    Returns ``{"slots": [Slot], "scheduled_s": when the last instruction ends, "launches": kernel launches}``."""
    generation = generation or current_target().name
    free = dict.fromkeys(COMPUTE_TRACKS, 0.0)
    queue_start, bandwidth, lanes, tiles, slots = {}, _Bandwidth(), [], _Tiles(), []
    launch, launches, launch_start, makespan = None, 0, 0.0, 0.0
    for index, instruction in enumerate(trace):
        if instruction.launch != launch or launch is None:  # a new kernel starts after the last one has ended
            launch, launches, launch_start = instruction.launch, launches + 1, makespan
            tiles = _Tiles()
        ready = max(launch_start, tiles.ready(instruction.reads, instruction.writes))
        duration = seconds(instruction, generation)
        if instruction.engine == "dma":
            queue = _dma_queue(instruction)
            moving = bandwidth.reserve(max(ready, queue_start.get(queue, 0.0)) + DMA_FIXED_S, duration)
            queue_start[queue] = moving - DMA_FIXED_S
            start, end = moving - DMA_FIXED_S, moving + duration
            visible = end
            lane = next((q for q, busy_until in enumerate(lanes) if busy_until <= start), len(lanes))
            lanes[lane:lane + 1] = [end]
            track = f"dma queue {lane}"
        else:
            track = instruction.engine
            start = max(ready, free[track], launch_start)
            end = free[track] = start + duration
            visible = end + DEPENDENCY_S
        tiles.record(instruction.reads, instruction.writes, end, visible)
        slots.append(Slot(index, instruction.name, track, start, end))
        makespan = max(makespan, end)
    return {"slots": slots, "scheduled_s": makespan, "launches": launches}


def calibrated_seconds(instruction, generation):
    """The cost model's time times the calibrated factor for the instruction's engine (_cost.CALIBRATED)."""
    return instruction_seconds(instruction, generation) * calibration_factor(instruction, generation)


def central_estimate(trace, generation=None):
    """The central estimate of a kernel call: the schedule with the calibrated factors, plus LAUNCH_S per
    kernel launch. ``{"central_s", "scheduled_s" (its schedule, without the launches), "launches"}``."""
    result = schedule(trace, generation, calibrated_seconds)
    return {"central_s": result["scheduled_s"] + LAUNCH_S * result["launches"], "scheduled_s": result["scheduled_s"],
            "launches": result["launches"]}


def schedule_figures(trace, generation=None):
    """What a kernel call's report adds to the bounds: ``scheduled_s`` (the schedule, the cost model as it is),
    ``central_s`` (central_estimate) and ``launches``."""
    central = central_estimate(trace, generation)
    return {"scheduled_s": schedule(trace, generation)["scheduled_s"], "central_s": central["central_s"],
            "launches": central["launches"]}

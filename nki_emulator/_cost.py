"""A per-engine cost model for the instructions the emulator records (``Counts.trace``).

Each :class:`~._runtime.Instruction` is priced on its engine from AWS's published numbers; a kernel
call's cost is then the busy time of each engine (TensorE, VectorE, ScalarE, GpSimd and the DMA
queues), its bottleneck (the busiest engine), an overlap bound (the engines run fully in parallel,
which a well-pipelined kernel approaches: the time of the busiest engine) and a serial bound (nothing
overlaps: the sum). The truth lies between the bounds.

Sources (aws-neuron/aws-neuron-sdk; [ISA] is the nki.isa stub at commit 77a1c5a8 (Nov 2025), the last
one that carries every instruction's "Estimated instruction cost"; the others are at HEAD):

- [ISA]   nki/api/nki/isa/__init__.py: per-instruction cycle formulas, MIN_II ~64 cycles,
          GPSIMD_START ~150 cycles
- [ARCH]  nki/guides/architecture/trainium_inferentia2_arch.rst: trn1 engine clocks (table under
          "NeuronCore-v2 Compute Engines"), TensorE "Performance Consideration" (MM_INIT_LATENCY 64,
          fp32 4x), VectorE "Cost Model" (N cycles per input tile), ScalarE "Pipelined Reduction"
          (ActReadAccumulator ~64 cycles), 16 DMA engines per core
- [TRN2]  nki/guides/architecture/trainium2_arch.rst: trn2 clocks (Compute Engine Specifications),
          "Built-in Transpose Support" (fp32 transpose 2x), "Vector Engine Performance Mode" (bf16/fp16
          tensor_copy / tensor_scalar 4x or 2x, tensor_tensor 2x), "DMA Transpose" (90% / 50%)
- [TRN3]  nki/guides/architecture/trainium3_arch.rst: trn3 clocks, ScalarE "Performance mode" (2x bf16)
- [DMA]   nki/deep-dives/nki-dma-bandwidth-guide.rst: bytes/ns per DMA engine and 16 engines per core
          per generation; bandwidth against bytes per partition
- [SHARED] nki/api/nki.api.shared.rst, "NKI Engine Selection": GpSimd rsqrt 4x slower than ScalarE
- [PERF]  nki/deep-dives/nki_perf_guide.rst: the worked examples the tests check (tests/test_cost_model.py)

Where the docs give no number, :data:`ASSUMPTIONS` says what is assumed instead. Not modelled:
dependencies and semaphore waits between engines and within one (a chain of tiny dependent ScalarE
instructions measured ~264 cycles each on trn1, [PERF] Opt #5a, where this model charges MIN_II = 64),
instruction issue and DMA latency (~1.3 us per transfer, [DMA]: hidden here behind queued transfers),
access-pattern strides (a minor stride over 16
bytes halves SBUF bandwidth, [ARCH]), SBUF/PSUM port sharing (VectorE/GpSimd on SBUF, VectorE/ScalarE
on PSUM: exclusive on trn1, shared with arbitration from trn2), compiler spills (the schedules add them:
_spill.py; this overlap bound does not), trn3's background
transposes and fast VectorE exp, and the fp8/MX matmul modes (not emulated).
"""

import math
from dataclasses import dataclass

import numpy as np

from ._memory import DTYPES
from ._runtime import ENGINES, target as current_target


@dataclass(frozen=True)
class EngineSpec:
    """Clocks (Hz) of the compute engines and the DMA queues of one NeuronCore."""

    tensor_hz: float
    vector_hz: float
    scalar_hz: float
    gpsimd_hz: float
    dma_queues: int
    dma_bytes_per_s: float  # per queue

    def hz(self, engine):
        return getattr(self, f"{engine}_hz")


ENGINE_SPECS = {  # clocks: [ARCH] / [TRN2] / [TRN3] engine tables; DMA: [DMA] "BW / Engine", "Engines / NC"
    "trn1": EngineSpec(2.8e9, 1.12e9, 1.4e9, 1.4e9, 16, 17e9),
    "trn2": EngineSpec(2.4e9, 0.96e9, 1.2e9, 1.2e9, 16, 23e9),
    "trn3": EngineSpec(2.4e9, 1.2e9, 1.2e9, 1.2e9, 16, 33e9),
}
MIN_II = 64  # [ISA] "minimum instruction initiation interval for small input tiles ... roughly 64 engine cycles"
MM_INIT = 64  # [ISA] nc_matmul max(min(64, N_stationary), N_moving); [ARCH] MM_INIT_LATENCY 64 cycles
GPSIMD_START = 150  # [ISA] affine_select: "instruction startup overhead on GpSimdE, roughly 150 engine cycles"
ACCUMULATOR_READ = 64  # [ARCH] ActReadAccumulator "roughly 64 ScalarE cycles"; [ISA] activation_reduce "+ MIN_II"
DMA_ROW_OVERHEAD_BYTES = 512  # ASSUMPTION, see ASSUMPTIONS
DMA_TRANSPOSE_EFFICIENCY = {"hbm": 0.9, "sbuf": 0.5}  # [TRN2] DMA Transpose: up to 90% (from HBM), 50% (SBUF2SBUF)

# Calibrated against public hardware timings (nki_emulator/calibrate.py; the table in docs/results.md): factors
# on the cost model's time where the measurements support one, and the fixed cost of a kernel launch. Only the
# central estimate (_schedule.central_estimate) applies them.
BF16_TENSOR_FACTOR = 1 / 0.8524  # SDK 2.23 matmul tutorial: the fully optimised bf16 matmul at 85.24% HFU on trn1
CALIBRATED = {  # (generation, engine, "16-bit" or "32-bit" inputs, or None for any) -> factor on the time
    **{(generation, "tensor", "16-bit"): BF16_TENSOR_FACTOR for generation in ENGINE_SPECS},
    # SDK 2.23 tiled bf16 matmul (rows of 256 B and 1 KiB): measured / the cost model's DMA time. Rows of 2 KiB and
    # more get none: AccelOpt's bmm (4 KiB rows) moved its bytes faster than the model, and [DMA] says such rows
    # approach peak
    ("trn1", "dma", "rows < 2 KiB"): 51.80 / 35.9,
}
SHORT_DMA_ROW_BYTES = 2048
LAUNCH_S = 18e-6  # fused_mamba.rst, mamba_v1's profile: ~13 us before its first input DMA, ~5 us after its last
# [PERF] Opt #5a: "the static instruction overhead in the order of ~100 cycles" of every VectorE, ScalarE and GpSimd
# instruction, which [ISA]'s max(MIN_II, N) leaves out; AWS's number, not a fit (the central figure adds it)
STATIC_CYCLES = 100
CALIBRATION_ASSUMPTIONS = (
    "calibrated: 16-bit TensorE instructions take 1.17x the [ISA] cycles: AWS's fully optimised bf16 matmul, "
    "TensorE-bound, reached 85.24% hardware FLOPs utilization on trn1 (SDK 2.23 matrix-multiplication tutorial, "
    "latency table: 6.97 ms at 4096x8192x8192); applied on trn2 and trn3 too, where no public bf16 TensorE-bound "
    "timing exists. fp32 matmuls ran within 1% of the [ISA] cycles on trn2 (kernel-optimization tutorial, "
    "versions 3-5: 28.20-28.41 ms against 27.96), so fp32 gets no factor",
    "calibrated: trn1 DMA transfers with rows under 2 KiB take 1.44x the cost model's time: the SDK 2.23 tiled "
    "bf16 matmul, DMA-bound (rows of 256 B and 1 KiB), ran 51.80 ms where the model's DMA time is 35.9 ms (~103 "
    "GB/s for its 5.3 GB, against 272 GB/s peak); rows of 2 KiB and more get no factor: AccelOpt's NKIBench bmm "
    "(trn1, rows of 4 KiB) moved 1.15 GB in 4.61 ms, faster than the model's 5.25 ms. On trn2 the model's DMA time "
    "matched the DMA-bound tiled fp32 matmul (rows of 512 B and 2 KiB; kernel-optimization version 2: 39.89 ms "
    "measured, 41.3 modelled): no trn2 factor",
    "calibrated: every VectorE, ScalarE and GpSimd instruction costs STATIC_CYCLES = 100 engine cycles more than "
    "[ISA]'s max(MIN_II, N): [PERF] Opt #5a's 'static instruction overhead in the order of ~100 cycles', taken as "
    "AWS gives it, not fitted (the calibration table with and without it is in docs/results.md)",
    "calibrated: a kernel launch costs 18 us: in fused_mamba.rst's profile of mamba_v1 (172.93 us; "
    "nki/img/mamba_v1_profile.png) the first input DMA starts ~13 us in and the last output DMA ends ~5 us before "
    "the end, the NEFF start-up and tear-down the tutorial names; inside a compiled graph a kernel likely pays "
    "less, so this errs long",
)

ASSUMPTIONS = CALIBRATION_ASSUMPTIONS + (
    "MIN_II bounds every VectorE and ScalarE instruction, also where [ISA]'s table omits it "
    "(tensor_reduce, scalar_tensor_tensor): max(MIN_II, formula)",
    "TensorE costs are [ISA]'s average for back-to-back instructions of one shape (pipelined), whatever "
    "the contraction K",
    "VectorE performance mode (trn2 on, [TRN2]) assumes the innermost free dimension is contiguous",
    "GpSimd tensor_tensor, tensor_copy, memset and tensor_scalar other than rsqrt: no documented cost; "
    "GPSIMD_START + N cycles per tensor input (its 128 lanes of 32-bit, one element per lane per cycle, [ARCH])",
    "dma_compute: no documented cost; each of its sources streams its rows through the DMA queues as a dma_copy of "
    "dst's rows would (k sources: k copies' time), the write overlapping the reads",
    "shared_identity_matrix: a constant the compiler places ([ISA] nki.language stub: 'the same behavior to "
    "shared_constant', which lives in HBM); counted as one DMA of its n rows into SBUF per call, though the compiler "
    "may share one per dtype",
    "DMA: each partition row on the SBUF side is one descriptor, the rows are spread over the 16 queues, and "
    "each row costs (row bytes + 512) / (bytes/s per queue). [DMA] gives no per-descriptor number, only that "
    "rows of >= 2 KiB approach peak and >= 4 KiB saturate: the 512-byte overhead puts them at 80% and 89%",
)

_FP16 = ("bfloat16", "float16")


def calibration_factor(instruction, generation):
    """The CALIBRATED factor for an instruction on ``generation``: by engine and the width of its inputs (a DMA
    transfer: by the bytes of its rows)."""
    if instruction.engine == "dma":
        short = instruction.free * _itemsize(instruction.dtypes[0]) < SHORT_DMA_ROW_BYTES
        return CALIBRATED.get((generation, "dma", "rows < 2 KiB" if short else "rows >= 2 KiB"), 1.0)
    width = "16-bit" if all(d in _FP16 for d in instruction.dtypes[1:] or instruction.dtypes) else "32-bit"
    by_engine = CALIBRATED.get((generation, instruction.engine, None), 1.0)
    return CALIBRATED.get((generation, instruction.engine, width), by_engine)


def _itemsize(name):
    return (DTYPES.get(name) or np.dtype(name)).itemsize


def matmul_cycles(stationary_free, moving_free, fp32=False):
    """[ISA] nc_matmul: max(min(64, N_stationary), N_moving) TensorE cycles, 4x for fp32 inputs."""
    return max(min(MM_INIT, stationary_free), moving_free) * (4 if fp32 else 1)


def _tensor_cycles(i, generation):
    fp32 = "float32" in i.dtypes[1:]
    if i.name == "nc_matmul":
        return matmul_cycles(i.stationary, i.free, fp32)
    # nc_transpose: [ISA] max(P, min(64, F)) for data (P, F); fp32 at the matmul's 4x on trn1, at 2x from trn2
    # on, whose transpose mode halves it ([TRN2] Built-in Transpose Support)
    return max(i.partitions, min(MM_INIT, i.free)) * ((4 if generation == "trn1" else 2) if fp32 else 1)


def _vector_cycles(i, generation):
    n, inputs, ops = i.free, i.buffers[1:], i.ops
    fp16 = all(d in _FP16 for d in i.dtypes)
    perf_mode = generation != "trn1" and fp16  # [TRN2] Vector Engine Performance Mode
    if i.name == "tensor_tensor":  # [ISA]: N with one input in PSUM, or bf16 add/multiply/subtract in SBUF, else 2N
        sbuf = all(b == "sbuf" for b in inputs)
        fast = inputs.count("psum") == 1 or (sbuf and fp16 and (perf_mode or ops[0] in ("add", "multiply", "subtract")))
        cycles = n if fast else 2 * n  # ([TRN2]: from trn2 on, every op gets the bf16/fp16 2x)
    elif i.name in ("tensor_copy", "tensor_scalar"):  # [ISA] N; [TRN2]: 4x all in SBUF, 2x with PSUM
        cycles = n / ((4 if all(b == "sbuf" for b in i.buffers) else 2) if perf_mode else 1)
    elif i.name == "memset":  # [ISA]: N/2 for a zero bf16/fp16 fill, else N
        cycles = n / 2 if ops == ("zero",) and fp16 else n
    elif i.name == "tensor_reduce":  # [ISA]: N/2 for bf16 in and out with add or maximum, else N
        cycles = n / 2 if all(d == "bfloat16" for d in i.dtypes) and ops[0] in ("add", "maximum") else n
    elif i.name == "scalar_tensor_tensor":  # [ISA]: N for bf16 (x - a) * y with N even, else 2N
        fast = all(d == "bfloat16" for d in i.dtypes[1:]) and ops == ("subtract", "multiply") and n % 2 == 0
        cycles = n if fast else 2 * n
    else:  # [ISA]: reciprocal 8N, bn_aggr 13N/3, tensor_tensor_scan 2N; bn_stats, nc_transpose, tensor_scalar_reduce N
        cycles = {"reciprocal": 8 * n, "bn_aggr": 13 * n / 3, "tensor_tensor_scan": 2 * n}.get(i.name, n)
    return max(MIN_II, cycles) + (MIN_II if i.name == "tensor_scalar_reduce" else 0)  # [ISA]: "+ MIN_II"


def _scalar_cycles(i, generation):
    n = i.free
    if i.name in ("tensor_copy", "tensor_scalar") and generation == "trn3" and all(d in _FP16 for d in i.dtypes):
        n = n / 2  # [TRN3] ScalarE performance mode
    return max(MIN_II, n) + (ACCUMULATOR_READ if i.reads_accumulator else 0)  # [ISA] activation max(MIN_II, N)


def _gpsimd_cycles(i, generation):
    if i.name in ("iota", "affine_select"):  # [ISA] GPSIMD_START + N
        return GPSIMD_START + i.free
    if i.name == "local_gather":
        return local_gather_cycles(i.free, int(i.ops[0].partition("=")[2]), _itemsize(i.dtypes[1]))
    if i.name == "tensor_scalar" and i.ops[0] == "rsqrt":  # [SHARED] 4x ScalarE's max(MIN_II, N)
        return 4 * max(MIN_II, i.free)
    return GPSIMD_START + i.free * max(1, len(i.dtypes) - 1)  # ASSUMPTION (see ASSUMPTIONS)


def local_gather_cycles(elements, per_index, dtype_size, t=4):
    """[ISA] local_gather: ``150 + (num_valid_indices * num_elem_per_idx) / C`` GpSimd cycles, ``C = ((28 + t *
    num_elem_per_idx) / (t * num_elem_per_idx)) / min(4 / dtype_size, num_elem_per_idx)``, t = 4; ``elements`` is
    num_valid_indices * num_elem_per_idx."""
    c = ((28 + t * per_index) / (t * per_index)) / min(4 / dtype_size, per_index)
    return GPSIMD_START + elements / c


def _dma_seconds(i, spec):
    row_bytes = i.free * _itemsize(i.dtypes[0])
    seconds = math.ceil(i.partitions / spec.dma_queues) * (row_bytes + DMA_ROW_OVERHEAD_BYTES) / spec.dma_bytes_per_s
    if i.name == "dma_transpose":
        seconds /= DMA_TRANSPOSE_EFFICIENCY["sbuf" if i.buffers[1] == "sbuf" else "hbm"]
    if i.name == "dma_compute":  # ASSUMPTION (see ASSUMPTIONS): each source streams through the queues as a copy
        seconds *= len(i.dtypes) - 1
    return seconds


_CYCLES = {"tensor": _tensor_cycles, "vector": _vector_cycles, "scalar": _scalar_cycles, "gpsimd": _gpsimd_cycles}


def instruction_seconds(instruction, generation=None):
    """Busy time of ``instruction``'s engine for it, in seconds, on ``generation`` ("trn1", "trn2",
    "trn3"; default: the emulator's target)."""
    generation = generation or current_target().name
    spec = ENGINE_SPECS[generation]
    if instruction.engine == "dma":
        return _dma_seconds(instruction, spec)
    return _CYCLES[instruction.engine](instruction, generation) / spec.hz(instruction.engine)


def estimate(trace, generation=None):
    """Per-engine busy seconds of a trace (``counts.trace``, or any iterable of Instructions) and what
    follows from them: ``{"engines": {engine: seconds}, "bottleneck": busiest engine, "estimate_s": its
    seconds (the overlap bound), "serial_s": their sum (the serial bound)}``."""
    engines = dict.fromkeys(ENGINES, 0.0)
    for instruction in trace:
        engines[instruction.engine] += instruction_seconds(instruction, generation)
    bottleneck = max(engines, key=engines.get)
    return {"engines": engines, "bottleneck": bottleneck, "estimate_s": engines[bottleneck],
            "serial_s": sum(engines.values())}

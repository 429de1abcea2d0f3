"""The emulator's per-engine cost model (nki_emulator/_cost.py): each engine's cost on hand-built
instructions against the numbers AWS's documents work out themselves, tiny kernels built to be bound by one
engine reported bound by it, and costs growing with shapes as the documented formulas say. Every number
here is a cycle count or a documented rate: nothing depends on the speed of this CPU."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import nki_emulator
import nki_emulator.isa as nisa
import nki_emulator.language as nl
from nki_emulator import ASSUMPTIONS, ENGINE_SPECS, Instruction, estimate, instruction_seconds, timeline
from nki_emulator._schedule import (DEPENDENCY_S, DMA_FIXED_S, LAUNCH_S, calibrated_seconds, central_estimate,
                                    pessimistic_estimate, schedule, schedule_figures)

BF16, FP32 = "bfloat16", "float32"


def matmul(m, n, dtype=BF16, k=128):
    return Instruction("nc_matmul", "tensor", k, n, (FP32, dtype, dtype), ("psum", "sbuf", "sbuf"), stationary=m)


def vector(name, n, inputs=1, dtype=FP32, buffers="sbuf", ops=("add",), partitions=128, engine="vector"):
    return Instruction(name, engine, partitions, n, (dtype,) * (1 + inputs), (buffers,) * (1 + inputs), ops)


def dma(partitions, row_bytes, name="dma_copy", src="shared_hbm"):
    return Instruction(name, "dma", partitions, row_bytes // 2, (BF16, BF16), ("sbuf", src))


def cycles(instruction, generation="trn2"):
    return instruction_seconds(instruction, generation) * ENGINE_SPECS[generation].hz(instruction.engine)


# ---- each engine against the documents' own numbers --------------------------------------------------------

@pytest.mark.parametrize("generation, dtype, documented_tflops", [
    ("trn1", BF16, 92), ("trn1", FP32, 23),  # trainium_inferentia2_arch: "92 TFLOPS ... 23 TFLOPS for FP32"
    ("trn2", BF16, 79), ("trn2", FP32, 20),  # trainium2_arch: "79 BF16/FP16/TF32 and 20 FP32 dense TFLOPS"
    ("trn3", BF16, 79), ("trn3", FP32, 20),  # trainium3_arch: the same
])
def test_a_full_matmul_tile_runs_at_the_documented_tensore_peak(generation, dtype, documented_tflops):
    seconds = instruction_seconds(matmul(128, 512, dtype), generation)
    assert 2 * 128 * 128 * 512 / seconds / 1e12 == pytest.approx(documented_tflops, rel=0.02)


def test_matrix_vector_costs_follow_the_perf_guides_fast_load_stationary_example():
    """nki_perf_guide Opt #7: a [1, 128] x [128, 128] product issues a matmul every ~64 cycles with the short
    side moving, every ~128 with it stationary."""
    assert cycles(matmul(128, 1)) == 64
    assert cycles(matmul(1, 128)) == 128


def test_transposes_cost_a_matmul_with_the_identity_and_fp32_is_cheaper_from_trn2():
    bf16 = Instruction("nc_transpose", "tensor", 128, 128, (BF16, BF16), ("psum", "sbuf"))
    fp32 = Instruction("nc_transpose", "tensor", 128, 128, (FP32, FP32), ("psum", "sbuf"))
    narrow = Instruction("nc_transpose", "tensor", 32, 16, (BF16, BF16), ("psum", "sbuf"))
    assert cycles(bf16) == 128 and cycles(narrow) == 32  # ISA: max(P, min(64, F))
    assert cycles(fp32, "trn1") == 4 * 128  # fp32 matmul rate on NeuronCore-v2
    assert cycles(fp32, "trn2") == 2 * 128  # trainium2_arch: transpose mode, "2x speedup in FP32 transpose"


def test_vectore_costs_n_cycles_per_input_tile_and_the_static_minimum_below_it():
    """trainium_inferentia2_arch, Vector Engine cost model: one input tile ~N cycles, two ~2N; ISA: MIN_II 64."""
    assert cycles(vector("tensor_scalar", 1024), "trn1") == 1024
    assert cycles(vector("tensor_tensor", 1024, inputs=2), "trn1") == 2048
    assert cycles(vector("tensor_scalar", 8), "trn1") == 64


def test_vectore_performance_mode_on_trn2_for_16_bit_data():
    """trainium2_arch, Vector Engine Performance Mode: tensor_copy / tensor_scalar 4x with everything in SBUF,
    2x with one side in PSUM; tensor_tensor 2x with both inputs in SBUF. None of it on trn1."""
    sbuf = vector("tensor_copy", 2048, dtype=BF16)
    psum = Instruction("tensor_copy", "vector", 128, 2048, (BF16, BF16), ("sbuf", "psum"))
    assert cycles(sbuf, "trn1") == 2048 and cycles(sbuf, "trn2") == 2048 / 4 and cycles(psum, "trn2") == 2048 / 2
    divide = vector("tensor_tensor", 2048, inputs=2, dtype=BF16, ops=("divide",))
    assert cycles(divide, "trn1") == 2 * 2048 and cycles(divide, "trn2") == 2048


def test_reciprocal_and_rsqrt_engine_choices_as_the_shared_api_page_prices_them():
    """nki.api.shared, NKI Engine Selection: VectorE reciprocal ~8x slower than ScalarE's for large tiles and
    comparable for small ones (by the page's own max(MIN_II, 8N), up to 8 elements); GpSimd rsqrt 4x slower."""
    scalar = Instruction("activation", "scalar", 128, 4096, (FP32, FP32), ("sbuf", "sbuf"), ("reciprocal",))
    assert cycles(vector("reciprocal", 4096)) == 8 * cycles(scalar)
    small = Instruction("activation", "scalar", 128, 8, (FP32, FP32), ("sbuf", "sbuf"), ("reciprocal",))
    assert cycles(vector("reciprocal", 8)) == cycles(small) == 64
    rsqrt = vector("tensor_scalar", 4096, engine="gpsimd", ops=("rsqrt",))
    assert cycles(rsqrt) == 4 * cycles(scalar)


def test_partition_count_does_not_change_vectore_time_so_two_half_tiles_cost_twice_one():
    """nki_perf_guide Opt #5b: a 64-partition instruction takes as long as a 128-partition one."""
    half = vector("tensor_reduce", 512, partitions=64)
    assert cycles(half) == cycles(vector("tensor_reduce", 512))
    assert estimate([half, half])["engines"]["vector"] == 2 * estimate([vector("tensor_reduce", 512)])["engines"]["vector"]


def in_sbuf(src):
    """An HBM tensor copied whole into SBUF (one DMA): the first instruction of the kernels here."""
    tile = nl.ndarray(src.shape, src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=src)
    return tile


def test_scalare_activation_costs_the_same_with_scale_and_bias_and_the_reduce_adds_the_readout():
    """trainium_inferentia2_arch, Scalar Engine: every activation costs the same whether or not scale/bias are
    used; activation_reduce adds ActReadAccumulator (~64 cycles); nki_perf_guide Opt #6: one fused
    activation is 3x faster than multiply, add and exp as three ScalarE instructions."""
    @nki_emulator.jit
    def kernel(x, bias):
        tile, column = in_sbuf(x), in_sbuf(bias)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        total = nl.ndarray(bias.shape, bias.dtype, buffer=nl.sbuf)
        nisa.activation(dst=out, op=nl.exp, data=tile)
        nisa.activation(dst=out, op=nl.exp, data=tile, bias=column, scale=0.5)
        nisa.activation_reduce(dst=out, op=nl.exp, data=tile, reduce_op=nl.add, reduce_res=total)
        result = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=result, src=out)
        return result

    with nki_emulator.counting() as counts:
        kernel(np.ones((128, 512), np.float32), np.zeros((128, 1), np.float32))
    plain, scaled, reduced = [cycles(i) for i in counts.trace if i.engine == "scalar"]
    assert plain == scaled == 512 and reduced == 512 + 64
    unfused = [Instruction(name, "scalar", 128, 512, (FP32, FP32), ("sbuf", "sbuf"), ops)
               for name, ops in (("tensor_scalar", ("multiply",)), ("tensor_scalar", ("add",)), ("activation", ("exp",)))]
    assert estimate(unfused)["engines"]["scalar"] == pytest.approx(3 * instruction_seconds(counts.trace[2]))


def test_gpsimd_instructions_pay_the_documented_startup():
    iota = Instruction("iota", "gpsimd", 128, 512, (FP32,), ("sbuf",))
    assert cycles(iota) == 150 + 512  # ISA iota / affine_select: GPSIMD_START (~150) + N


def test_local_gather_costs_the_isa_formula():
    """[ISA] local_gather: 150 + (num_valid_indices * num_elem_per_idx) / C GpSimd cycles, C = ((28 + 4e) / (4e)) /
    min(4 / dtype_size, e): fp32 with e = 1 gives C = 8; bf16 with e = 4 gives C = (44 / 16) / 2."""
    def gather(valid, per_index, dtype):
        return Instruction("local_gather", "gpsimd", 128, valid * per_index, (dtype, dtype, "uint16"),
                           ("sbuf",) * 3, (f"num_elem_per_idx={per_index}",))

    assert cycles(gather(256, 1, FP32)) == pytest.approx(150 + 256 / 8)
    assert cycles(gather(64, 4, BF16)) == pytest.approx(150 + 256 / (44 / 16 / 2))


def test_dma_compute_streams_each_source_as_a_copy():
    """An ASSUMPTION (no documented cost): k sources cost k copies of dst's rows."""
    rows = Instruction("dma_compute", "dma", 128, 1024, (BF16,) * 4, ("sbuf",) + ("shared_hbm",) * 3)
    assert instruction_seconds(rows) == pytest.approx(3 * instruction_seconds(dma(128, 2048)))
    assert any(line.startswith("dma_compute") for line in ASSUMPTIONS)


@pytest.mark.parametrize("generation, documented_gb_per_s", [("trn1", 272), ("trn2", 368), ("trn3", 528)])
def test_large_dmas_reach_the_documented_aggregate_bandwidth(generation, documented_gb_per_s):
    """nki-dma-bandwidth-guide: 16 engines per NeuronCore at 17 / 23 / 33 B/ns, 272 / 368 / 528 GB/s."""
    big = dma(128, 64 * 1024)
    assert 128 * 64 * 1024 / instruction_seconds(big, generation) / 1e9 == pytest.approx(documented_gb_per_s, rel=0.01)


def test_dma_efficiency_against_row_size_follows_the_bandwidth_guides_curve():
    """Under 256 B per partition "a small fraction of peak", from 2 KiB "approaches peak", at 4 KiB "saturates";
    fewer partitions use fewer of the 16 queues."""
    def efficiency(row_bytes, partitions=128):
        return partitions * row_bytes / instruction_seconds(dma(partitions, row_bytes)) / (16 * 23e9)

    assert efficiency(128) < 0.25 < efficiency(512) < efficiency(2048) < efficiency(4096)
    assert efficiency(2048) >= 0.75 and efficiency(4096) >= 0.85
    assert efficiency(4096, partitions=16) == pytest.approx(efficiency(4096))
    assert efficiency(4096, partitions=8) == pytest.approx(efficiency(4096) / 2)


def test_dma_transposes_run_at_the_documented_fraction_of_a_copy():
    """trainium2_arch DMA Transpose: up to 90% of DMA throughput from HBM, 50% SBUF to SBUF."""
    copy = instruction_seconds(dma(128, 4096))
    assert instruction_seconds(dma(128, 4096, "dma_transpose")) == pytest.approx(copy / 0.9)
    assert instruction_seconds(dma(128, 4096, "dma_transpose", src="sbuf")) == pytest.approx(copy / 0.5)


# ---- kernels built to be bound by one engine --------------------------------------------------------------

@nki_emulator.jit
def exp_many_times(x):
    """One load, 16 exps on ScalarE, one store: ScalarE-bound."""
    tile = in_sbuf(x)
    for _ in nl.affine_range(16):
        nisa.activation(dst=tile, op=nl.exp, data=tile, scale=0.0)
    result = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=result, src=tile)
    return result


@nki_emulator.jit
def copy_through(x):
    """Narrow rows in and out with one cheap op each: DMA-bound."""
    result = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range(x.shape[0] // 128):
        tile = nl.ndarray((128, x.shape[1]), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x[i * 128:(i + 1) * 128, :])
        nisa.tensor_scalar(dst=tile, data=tile, op0=nl.multiply, operand0=2.0)
        nisa.dma_copy(dst=result[i * 128:(i + 1) * 128, :], src=tile)
    return result


@nki_emulator.jit
def matmul_many_times(a, b):
    """One stationary against one moving tile, 16 times, one eviction: TensorE-bound."""
    stationary, moving = in_sbuf(a), in_sbuf(b)
    acc = nl.ndarray((a.shape[1], b.shape[1]), nl.float32, buffer=nl.psum)
    for _ in nl.affine_range(16):
        nisa.nc_matmul(dst=acc, stationary=stationary, moving=moving)
    out = nl.ndarray(acc.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=out, src=acc)
    result = nl.ndarray(acc.shape, nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=result, src=out)
    return result


def run_counted(kernel, *arrays):
    with nki_emulator.counting() as counts:
        kernel(*arrays)
    return estimate(counts.trace, "trn2")


@pytest.mark.parametrize("kernel, arrays, engine", [
    (exp_many_times, (np.zeros((128, 512), np.float32),), "scalar"),
    (copy_through, (np.ones((1024, 64), np.float32),), "dma"),
    (matmul_many_times, (np.ones((128, 128), np.float32).astype(nl.bfloat16),
                         np.ones((128, 512), np.float32).astype(nl.bfloat16)), "tensor"),
])
def test_a_kernel_built_to_be_bound_by_one_engine_is_reported_bound_by_it(kernel, arrays, engine):
    result = run_counted(kernel, *arrays)
    assert result["bottleneck"] == engine
    assert result["estimate_s"] == result["engines"][engine] == max(result["engines"].values())
    assert result["serial_s"] == pytest.approx(sum(result["engines"].values()))
    assert result["estimate_s"] < result["serial_s"]


def test_the_scalar_bound_kernel_costs_its_documented_cycles():
    result = run_counted(exp_many_times, np.zeros((128, 512), np.float32))
    assert result["engines"]["scalar"] == pytest.approx(16 * 512 / 1.2e9)  # 16 x max(64, 512) ScalarE cycles


# ---- estimates grow as the formulas say ------------------------------------------------------------------

def test_matmul_cost_is_flat_below_the_64_cycle_minimum_and_linear_in_the_moving_width_above():
    assert [cycles(matmul(128, n)) for n in (1, 32, 64, 128, 256, 512)] == [64, 64, 64, 128, 256, 512]
    assert [cycles(matmul(m, 512)) for m in (1, 32, 128)] == [512] * 3  # the stationary width is free above N
    assert cycles(matmul(128, 512, FP32)) == 4 * cycles(matmul(128, 512))


def test_elementwise_and_dma_costs_grow_linearly_past_their_fixed_costs():
    assert [cycles(vector("tensor_scalar", n)) for n in (16, 64, 256, 1024)] == [64, 64, 256, 1024]
    rows = [instruction_seconds(dma(p, 4096)) for p in (16, 32, 64, 128)]
    assert rows == pytest.approx([rows[0] * k for k in (1, 2, 4, 8)])


def test_a_kernels_engine_times_scale_with_its_work():
    small = run_counted(copy_through, np.ones((256, 512), np.float32))
    large = run_counted(copy_through, np.ones((1024, 512), np.float32))
    for engine in ("vector", "dma"):
        assert large["engines"][engine] == pytest.approx(4 * small["engines"][engine])


# ---- the schedule (nki_emulator/_schedule.py) on hand-built traces whose schedule is known ----------------------

def tile(serial, partitions=128, first_byte=0, last_byte=2048):
    return (serial, 0, partitions, first_byte, last_byte)


def on(instruction, reads=(), writes=(), launch=1):
    return instruction._replace(reads=tuple(reads), writes=tuple(writes), launch=launch)


def test_a_dependent_chain_runs_one_after_another_with_the_documented_latency_per_edge():
    step = vector("tensor_scalar", 512)
    chain = [on(step, [tile(n)], [tile(n + 1)]) for n in range(3)]  # each reads what the one before wrote
    d = instruction_seconds(step)
    result = schedule(chain, "trn2")
    assert [s.start for s in result["slots"]] == pytest.approx([0, d + DEPENDENCY_S, 2 * (d + DEPENDENCY_S)])
    assert result["scheduled_s"] == pytest.approx(3 * d + 2 * DEPENDENCY_S)
    # the same instructions on independent tiles: the engine's queue alone orders them, back to back
    assert schedule([on(step, [tile(10 + n)], [tile(20 + n)]) for n in range(3)], "trn2")["scheduled_s"] \
        == pytest.approx(3 * d)


def test_two_independent_engines_overlap_and_a_dependency_between_them_serialises_them():
    vec, act = vector("tensor_scalar", 1024), vector("activation", 512, engine="scalar", ops=("exp",))
    independent = [on(vec, [tile(1)], [tile(2)]), on(act, [tile(3)], [tile(4)])]
    result = schedule(independent, "trn2")
    assert {s.track for s in result["slots"]} == {"vector", "scalar"}
    assert result["scheduled_s"] == pytest.approx(estimate(independent, "trn2")["estimate_s"])  # the overlap bound
    dependent = [on(vec, [tile(1)], [tile(2)]), on(act, [tile(2)], [tile(4)])]
    assert schedule(dependent, "trn2")["scheduled_s"] == pytest.approx(
        estimate(dependent, "trn2")["serial_s"] + DEPENDENCY_S)
    # writing a tile that is still being read waits for the reader (write after read), without the latency
    overwrite = [on(vec, [tile(1)], [tile(2)]), on(act, [tile(3)], [tile(1)])]
    assert schedule(overwrite, "trn2")["scheduled_s"] == pytest.approx(estimate(overwrite, "trn2")["serial_s"])


def test_the_list_schedule_breaks_a_tie_between_two_queues_the_same_way_in_every_process():
    """A load and a store ready at once share the DMA bandwidth: the one started first ends first, whichever
    string hashing (PYTHONHASHSEED) the process has."""
    program = ("from nki_emulator import Instruction\nfrom nki_emulator._schedule import schedule\n"
               "load = Instruction('dma_copy', 'dma', 128, 1024, ('bfloat16',) * 2, ('sbuf', 'shared_hbm'), "
               "reads=((1, 0, 1, 0, 1),), writes=((2, 0, 128, 0, 2048),), launch=1)\n"
               "store = load._replace(buffers=('shared_hbm', 'sbuf'), reads=((3, 0, 128, 0, 2048),), "
               "writes=((4, 0, 1, 0, 1),))\n"
               "print([s.end for s in schedule([load, store], 'trn2')['slots']])\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ends = {subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True, cwd=root,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in (0, 1, 3)}
    assert len(ends) == 1


def test_disjoint_slices_of_one_tile_do_not_wait_for_each_other():
    vec, act = vector("tensor_scalar", 256), vector("activation", 256, engine="scalar", ops=("exp",))
    left, right = tile(1, first_byte=0, last_byte=1024), tile(1, first_byte=1024, last_byte=2048)
    trace = [on(vec, [tile(2)], [left]), on(act, [right], [tile(3)])]
    assert schedule(trace, "trn2")["scheduled_s"] == pytest.approx(estimate(trace, "trn2")["estimate_s"])


def test_a_dma_queue_overlaps_the_fixed_cost_of_transfers_and_moves_their_bytes_one_after_another():
    load = dma(128, 2048)
    d = instruction_seconds(load)
    transfers = [on(load, [tile(100 + n, 1)], [tile(n)]) for n in range(3)]
    result = schedule(transfers, "trn2")
    assert result["scheduled_s"] == pytest.approx(DMA_FIXED_S + 3 * d)
    assert [s.end for s in result["slots"]] == pytest.approx([DMA_FIXED_S + k * d for k in (1, 2, 3)])
    assert {s.track for s in result["slots"]} == {f"dma queue {q}" for q in range(3)}  # all three in flight
    # a compute instruction on the loaded tile waits for its transfer; the transfer after it does not
    use = vector("tensor_scalar", 512)
    trace = [transfers[0], on(use, [tile(0)], [tile(50)]), transfers[1]]
    slots = schedule(trace, "trn2")["slots"]
    assert slots[1].start == pytest.approx(slots[0].end)  # no compute latency after a DMA: its fixed cost has it
    assert slots[2].end == pytest.approx(DMA_FIXED_S + 2 * d)
    # a store waiting for compute holds up its own queue, not the loads behind it, which take the idle bandwidth
    store = Instruction("dma_copy", "dma", 128, 1024, (BF16, BF16), ("shared_hbm", "sbuf"))
    trace = [transfers[0], on(use, [tile(0)], [tile(50)]), on(store, [tile(50)], [tile(200, 1)]), transfers[1]]
    slots = schedule(trace, "trn2")["slots"]
    assert slots[3].end == pytest.approx(DMA_FIXED_S + 2 * d)  # as if the store were not there
    assert slots[2].start == pytest.approx(slots[1].end + DEPENDENCY_S)  # the store waits for what it stores


def test_a_new_kernel_launch_starts_after_the_last_one_ended_and_the_central_estimate_adds_the_launch_cost():
    vec, act = vector("tensor_scalar", 1024), vector("activation", 512, engine="scalar", ops=("exp",))
    trace = [on(vec, [tile(1)], [tile(2)]), on(act, [tile(3)], [tile(4)], launch=2)]
    result = schedule(trace, "trn2")
    assert result["launches"] == 2
    assert result["scheduled_s"] == pytest.approx(estimate(trace, "trn2")["serial_s"])
    central = central_estimate(trace, "trn2")
    assert central["central_s"] == pytest.approx(central["scheduled_s"] + 2 * LAUNCH_S)


def test_the_emulator_records_what_each_instruction_reads_and_writes_so_a_kernel_schedules_as_a_chain():
    with nki_emulator.counting() as counts:
        exp_many_times(np.zeros((128, 512), np.float32))
    load, *exps, store = counts.trace
    assert load.writes == exps[0].reads == exps[0].writes == store.reads  # one tile, in place
    assert load.writes[0][1:] == (0, 128, 0, 512 * 4)  # all 128 partitions, 512 fp32 each
    assert len({i.launch for i in counts.trace}) == 1
    result = schedule(counts.trace, "trn2")
    d = instruction_seconds(exps[0], "trn2")
    assert [s.track for s in result["slots"]] == ["dma queue 0"] + ["scalar"] * 16 + ["dma queue 0"]
    assert result["slots"][-2].end - result["slots"][1].start == pytest.approx(16 * d + 15 * DEPENDENCY_S)


# ---- the list schedule (the compiler's scheduler modelled) against program order ------------------------------

def track_order(result, track):
    return [s.index for s in sorted(result["slots"], key=lambda s: s.start) if s.track == track]


def test_the_list_schedule_interleaves_independent_chains_on_one_engine_where_program_order_runs_them_one_by_one():
    step = vector("tensor_scalar", 512)
    d = instruction_seconds(step)
    assert DEPENDENCY_S < d  # so the other chain fills each edge's wait completely
    chain = lambda first: [on(step, [tile(first + n)], [tile(first + n + 1)]) for n in range(3)]  # noqa: E731
    trace = chain(1) + chain(11)
    listed, program = schedule(trace, "trn2", order="list"), schedule(trace, "trn2", order="program")
    assert program["scheduled_s"] == pytest.approx(6 * d + 4 * DEPENDENCY_S)  # each edge waited out
    assert listed["scheduled_s"] == pytest.approx(6 * d)  # back to back: the overlap bound
    assert track_order(listed, "vector") == [0, 3, 1, 4, 2, 5]
    assert schedule(trace, "trn2")["scheduled_s"] == listed["scheduled_s"]  # the list schedule is the default


def test_the_list_schedule_runs_later_ready_work_while_an_instruction_waits_but_never_overwrites_an_unread_tile():
    step, long = vector("tensor_scalar", 512), vector("activation", 4096, engine="scalar", ops=("exp",))
    trace = [on(long, [tile(9)], [tile(10)]),
             on(step, [tile(10), tile(1)], [tile(2)]),  # reads tile 1 once the long instruction is done ...
             on(step, [tile(3)], [tile(1)]),  # ... which this one then overwrites
             on(step, [tile(5)], [tile(6)])]  # independent
    result = schedule(trace, "trn2")
    slots = result["slots"]
    assert track_order(result, "vector") == [3, 1, 2]  # the independent one first: reordered
    assert slots[2].start == pytest.approx(slots[1].end)  # write after read, without the latency
    assert schedule(trace, "trn2", order="program")["scheduled_s"] > result["scheduled_s"]


def test_a_tile_read_by_more_instructions_than_are_kept_apart_still_orders_its_next_write_after_every_read():
    step, write = vector("tensor_scalar", 512), vector("activation", 512, engine="scalar", ops=("exp",))
    readers = [on(step, [tile(1)], [tile(100 + n)]) for n in range(40)]  # beyond _MERGE_ABOVE: joined into one
    slots = schedule(readers + [on(write, [tile(2)], [tile(1)])], "trn2")["slots"]
    assert slots[-1].start == pytest.approx(max(s.end for s in slots[:-1]))


def test_a_psum_accumulation_group_stays_together_on_tensore():
    mm = matmul(128, 512)
    psum_a, psum_b = tile(50, last_byte=2048), tile(60, last_byte=2048)
    first = on(mm, [tile(1), tile(2)], [psum_a])
    other = on(mm, [tile(5), tile(6)], [psum_b])
    second = on(mm, [tile(3), tile(4)], [psum_a])._replace(accumulate=True)  # adds onto first's result
    assert track_order(schedule([first, other, second], "trn2"), "tensor") == [0, 2, 1]
    # the same second matmul overwriting instead (no group): issued first goes first
    assert track_order(schedule([first, other, second._replace(accumulate=False)], "trn2"), "tensor") == [0, 1, 2]


def test_a_no_reorder_block_keeps_program_order_on_its_engine_and_with_schedule_adds_an_edge():
    step, long = vector("tensor_scalar", 512), vector("activation", 4096, engine="scalar", ops=("exp",))
    trace = [on(long, [tile(9)], [tile(10)]), on(step, [tile(10)], [tile(2)]), on(step, [tile(3)], [tile(4)]),
             on(step, [tile(5)], [tile(6)])]  # the first vector instruction waits for ScalarE
    assert track_order(schedule(trace, "trn2"), "vector") == [2, 3, 1]
    blocked = trace[:1] + [i._replace(no_reorder=1) for i in trace[1:]]
    assert track_order(schedule(blocked, "trn2"), "vector") == [1, 2, 3]
    # an explicit edge: the last after the waiting one (by label), the middle one free to go ahead
    edged = [trace[0], trace[1]._replace(label="waits"), trace[2], trace[3]._replace(after=("waits",))]
    assert track_order(schedule(edged, "trn2"), "vector") == [2, 1, 3]


def test_the_emulator_marks_the_matmuls_that_add_onto_their_psum_tile_so_a_kernels_group_stays_together():
    a, b = np.ones((128, 128), np.float32).astype(nl.bfloat16), np.ones((128, 512), np.float32).astype(nl.bfloat16)
    with nki_emulator.counting() as counts:
        matmul_many_times(a, b)
    matmuls = [n for n, i in enumerate(counts.trace) if i.name == "nc_matmul"]
    assert [counts.trace[n].accumulate for n in matmuls] == [False] + [True] * 15  # the first overwrites, the rest add
    assert track_order(schedule(counts.trace, "trn2"), "tensor") == matmuls


@nki_emulator.jit
def recip_and_exp(t):
    """aws-neuron-sdk's how-to-scheduling-apis.rst example, its second instruction on ScalarE, its output in
    nl.shared_hbm (the guide's nl.hbm predates NKI 0.3.0, release-notes/components/nki.rst l. 205)."""
    x = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=x, src=t)
    a = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)
    b = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)
    with nl.no_reorder():
        nisa.reciprocal(dst=a, data=x, name="recip")
    nisa.activation(dst=b, op=nl.exp, data=x, name="exp")
    out = nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=b)
    return out


def test_a_kernels_instruction_names_no_reorder_blocks_and_with_schedule_edges_reach_the_schedule():
    x = np.ones((128, 256), np.float32)
    with nki_emulator.counting() as free:
        plain = recip_and_exp(x)
    with nki_emulator.counting() as edged:
        ordered = recip_and_exp.with_schedule([("exp", ["recip"])])(x)
    assert np.array_equal(plain, ordered)  # the same values
    load, recip, exp, store = edged.trace
    assert (recip.label, recip.no_reorder > 0, exp.label, exp.after, exp.no_reorder) == ("recip", True, "exp",
                                                                                          ("recip",), 0)
    assert free.trace[2].after == ()
    unordered, after = schedule(free.trace, "trn2")["slots"], schedule(edged.trace, "trn2")["slots"]
    assert unordered[2].start < unordered[1].end  # ScalarE and VectorE overlap
    assert after[2].start >= after[1].end  # the edge: exp waits for recip
    with pytest.raises(nki_emulator.NkiValidationError, match="each edge is a pair"):
        recip_and_exp.with_schedule([("exp", 3)])
    with pytest.raises(nki_emulator.NkiValidationError, match="has not issued before it"):
        recip_and_exp.with_schedule([("recip", "exp")])(x)


def test_the_three_figures_order_themselves_and_an_unknown_order_is_refused():
    step = vector("tensor_scalar", 512)
    trace = [on(step, [tile(first + n)], [tile(first + n + 1)]) for first in (1, 11) for n in range(3)]
    figures = schedule_figures(trace, "trn2")
    assert figures["optimistic_s"] == pytest.approx(estimate(trace, "trn2")["estimate_s"])
    assert figures["optimistic_s"] + LAUNCH_S <= figures["central_s"] < figures["pessimistic_s"]
    assert figures["pessimistic_s"] == pytest.approx(pessimistic_estimate(trace, "trn2")["pessimistic_s"])
    with pytest.raises(ValueError, match="order='issue'; use one of list, program"):
        schedule(trace, "trn2", order="issue")


def test_the_timeline_is_a_trace_event_file_with_one_event_per_instruction_and_one_track_per_engine(tmp_path):
    with nki_emulator.counting() as counts:
        copy_through(np.ones((256, 64), np.float32))
    result = schedule(counts.trace, "trn2")
    json_path, png_path = timeline.write(counts.trace, result, str(tmp_path), "copy_through")
    with open(json_path) as f:
        document = json.load(f)
    events = document["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert [e["name"] for e in slices] == [i.name for i in counts.trace]
    assert all(e["dur"] > 0 and e["ts"] >= 0 and {"pid", "tid"} <= e.keys() for e in slices)
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert set(tracks.values()) == {s.track for s in result["slots"]}  # one named track per engine / queue used
    assert {tracks[e["tid"]] for e in slices if e["name"] == "tensor_scalar"} == {"vector"}
    assert max(e["ts"] + e["dur"] for e in slices) == pytest.approx(1e6 * result["scheduled_s"])
    with open(png_path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_calibrated_factors_apply_to_their_engine_dtype_and_generation_only():
    bf16, fp32 = matmul(128, 512), matmul(128, 512, FP32)
    assert calibrated_seconds(bf16, "trn2") == pytest.approx(instruction_seconds(bf16, "trn2") / 0.8524)
    assert calibrated_seconds(fp32, "trn2") == instruction_seconds(fp32, "trn2")  # fp32 matched the hardware
    short_rows, long_rows = dma(128, 1024), dma(128, 2048)  # trn1's DMA factor is for rows under 2 KiB only
    assert calibrated_seconds(short_rows, "trn1") == pytest.approx(
        instruction_seconds(short_rows, "trn1") * 51.80 / 35.9)
    assert calibrated_seconds(long_rows, "trn1") == instruction_seconds(long_rows, "trn1")
    assert calibrated_seconds(short_rows, "trn2") == instruction_seconds(short_rows, "trn2")
    assert all(any(key in line for line in ASSUMPTIONS) for key in ("85.24%", "51.80 ms", "18 us"))  # cited


def test_the_calibrated_figure_adds_the_perf_guides_static_overhead_to_vector_scalar_and_gpsimd_only():
    """nki_perf_guide Opt #5a: "static instruction overhead in the order of ~100 cycles" per VectorE, ScalarE and
    GpSimd instruction; TensorE and DMA get none. A chain of dependent one-element ScalarE instructions then issues
    one per ~189 ns on trn1, the guide's measured 264 cycles."""
    hz = ENGINE_SPECS["trn2"].hz
    for engine in ("vector", "scalar", "gpsimd"):
        instruction = vector("tensor_scalar", 512, engine=engine)
        assert calibrated_seconds(instruction, "trn2") == pytest.approx(
            instruction_seconds(instruction, "trn2") + 100 / hz(engine))
    assert calibrated_seconds(matmul(128, 512, FP32), "trn2") == instruction_seconds(matmul(128, 512, FP32), "trn2")
    assert calibrated_seconds(dma(128, 4096), "trn2") == instruction_seconds(dma(128, 4096), "trn2")
    one = vector("activation", 1, engine="scalar", ops=("copy",), partitions=1)
    chain = [on(one, [tile(n)], [tile(n + 1)]) for n in range(11)]
    slots = schedule(chain, "trn1", calibrated_seconds)["slots"]
    assert (slots[-1].start - slots[0].start) / 10 == pytest.approx(189e-9, rel=0.01)

"""nki_emulator.legacy_trace: the instructions a legacy-dialect kernel (neuronxcc.nki) stands for, as calibrate.py
prices AccelOpt's NKIBench kernels with them. The kernels here are written for these tests in the two styles
NKIBench has: compiler-generated (nl.arange indices, blocks before par_dim) and hand-written (slices, fresh tiles)."""

import csv
import json
import pickle
import subprocess

import numpy as np
import pytest

from nki_emulator import calibrate, legacy_trace
from nki_emulator._cost import instruction_seconds
from nki_emulator._schedule import schedule

GENERATED = '''
import numpy as np
import neuronxcc.nki as nki
import neuronxcc.nki.language as nl
import neuronxcc.nki.isa as nisa

@nki.jit
def kernel(x, w):
    out = nl.ndarray((256, 512), dtype=np.float32, buffer=nl.shared_hbm)
    acc = nl.zeros((2, nl.par_dim(128), 512), dtype=np.float32, buffer=nl.psum, lazy_initialization=True)
    w_tile = nl.ndarray((nl.par_dim(128), 512), dtype=np.float32, buffer=nl.sbuf)
    ip, jf, kf = nl.arange(128)[:, None], nl.arange(512)[None, :], nl.arange(128)[None, :]
    w_tile[ip, jf] = nl.load(w[ip, jf])
    for i in nl.affine_range(2):
        x_tile = nl.load(x[ip, 128 * i + kf], mask=ip < ROWS)
        acc[i, ip, jf] += nisa.nc_matmul(x_tile, w_tile[ip, jf])
        y = nl.copy(acc[i, ip, jf])
        z = nisa.tensor_scalar(data=y, op0=nl.multiply, operand0=2.0, engine=nki.isa.unknown_engine)
        nl.store(out[128 * i + ip, jf], value=z)
    return out
'''

HAND_WRITTEN = '''
import neuronxcc.nki as nki
import neuronxcc.nki.language as nl
import neuronxcc.nki.isa as nisa

@nki.jit
def kernel(a, g):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    g_row = nl.load(g.reshape((1, 512))[0:1, 0:512])
    a_tile = nl.load(a[0:128, 0:512])
    total = nl.multiply(a_tile, g_row.broadcast_to((128, 512)))
    total[...] = nl.add(total, 1.0)
    acc = nl.zeros((128, 512), nl.float32, buffer=nl.psum)
    acc += nl.matmul(total[:, 0:128], a_tile)
    nl.store(out[0:128, 0:512], value=acc)
    return out
'''


def trace_of(source, *shapes, rows=128):
    return legacy_trace.run(source.replace("ROWS", str(rows)), [np.zeros(s, np.float32) for s in shapes], "trn1")


def test_generated_kernel_records_each_instruction_with_its_engine_shape_and_bytes():
    trace = trace_of(GENERATED, (128, 256), (128, 512))
    assert [(i.name, i.engine) for i in trace[:2]] == [("dma_copy", "dma")] * 2
    per_tile = [i.name for i in trace[1:6]]
    assert per_tile == ["dma_copy", "nc_matmul", per_tile[2], "tensor_scalar", "dma_copy"]
    matmul = trace[2]
    assert (matmul.partitions, matmul.stationary, matmul.free) == (128, 128, 512)  # K, M, N
    dma_bytes = sum(i.partitions * i.free * 4 for i in trace if i.engine == "dma")
    assert dma_bytes == 4 * (128 * 256 + 128 * 512 + 256 * 512)  # x, w and out, each once
    assert len(trace) == 11


def test_psum_blocks_are_separate_tiles_and_the_copy_reads_what_the_matmul_wrote():
    trace = trace_of(GENERATED, (128, 256), (128, 512))
    matmuls = [i for i in trace if i.name == "nc_matmul"]
    assert matmuls[0].writes[0][0] != matmuls[1].writes[0][0]  # acc[0] and acc[1]: two blocks
    copy = trace[trace.index(matmuls[0]) + 1]
    assert copy.reads == matmuls[0].writes
    assert schedule(trace, "trn1")["slots"][trace.index(copy)].start >= \
        schedule(trace, "trn1")["slots"][trace.index(matmuls[0])].end


def test_engines_left_to_the_compiler_go_to_the_less_busy_of_vector_and_scalar():
    trace = trace_of(GENERATED, (128, 256), (128, 512))
    copy, scale = trace[3], trace[4]
    # both engines idle: the copy goes where it is cheaper (ScalarE's faster clock on trn1), as an activation
    # (trn1 has no ScalarE tensor_copy); the next instruction then finds VectorE the less busy
    assert (copy.engine, copy.name, copy.ops) == ("scalar", "activation", ("copy",))
    assert scale.engine == "vector"
    busy = {e: sum(instruction_seconds(i, "trn1") for i in trace if i.engine == e) for e in ("vector", "scalar")}
    assert busy["vector"] > 0 and busy["scalar"] > 0


def test_a_mask_drops_the_rows_a_dma_moves():
    full = trace_of(GENERATED, (128, 256), (128, 512))
    masked = trace_of(GENERATED, (128, 256), (128, 512), rows=100)
    assert (full[1].partitions, masked[1].partitions) == (128, 100)


def test_hand_written_kernel_slices_fresh_tiles_and_names_that_accumulate():
    trace = trace_of(HAND_WRITTEN, (128, 512), (512,))
    assert [(i.name, i.engine) for i in trace[:5] + trace[6:]] == [
        ("dma_copy", "dma"), ("dma_copy", "dma"), ("tensor_tensor", "vector"), ("tensor_scalar", trace[3].engine),
        ("nc_matmul", "tensor"), ("nc_matmul", "tensor"), ("dma_copy", "dma")]
    load_g, _, product, plus_one, transpose, evict, matmul, store = trace
    assert evict.reads == transpose.writes and evict.writes[0] in matmul.reads  # x.T goes through SBUF
    assert (load_g.partitions, load_g.free) == (1, 512)
    assert load_g.writes[0] in product.reads  # the broadcast row is read where it was loaded
    assert plus_one.writes == product.writes  # `total[...] = ...` writes total, not a fresh tile
    assert (transpose.partitions, transpose.stationary) == (128, 128)  # nl.matmul transposes its x on TensorE
    assert store.reads == matmul.writes  # `acc += matmul` accumulates into acc


def test_bf16_tiles_are_priced_as_bf16():
    source = HAND_WRITTEN.replace("nl.load(a[0:128, 0:512])", "nl.load(a[0:128, 0:512], dtype=nl.bfloat16)")
    load_a = trace_of(source, (128, 512), (512,))[1]
    assert load_a.dtypes[0] == "bfloat16"
    assert instruction_seconds(load_a, "trn1") < instruction_seconds(trace_of(HAND_WRITTEN, (128, 512), (512,))[1],
                                                                     "trn1")  # half the bytes a row


def test_an_unsupported_index_is_refused_by_name():
    source = HAND_WRITTEN.replace("a[0:128, 0:512]", "a[0:128, nl.arange(512)[None, :]]")
    with pytest.raises(NotImplementedError, match="slices mixed with nl.arange"):
        trace_of(source, (128, 512), (512,))


def accelopt_checkout(tmp_path):
    """A tiny repository shaped like zhang677/AccelOpt: one NKIBench kernel, its reference and a profile row."""
    (tmp_path / "NKIBench" / "kernels").mkdir(parents=True)
    (tmp_path / "NKIBench" / "reference").mkdir()
    (tmp_path / "experiments" / "full_complete_local").mkdir(parents=True)
    (tmp_path / "NKIBench" / "kernels" / "scale_M256_0.py").write_text(GENERATED.replace("ROWS", "128"))
    (tmp_path / "NKIBench" / "reference" / "scale_M256_numpy_1.py").write_text(
        "import numpy as np\ndef get_inputs():\n    return [np.zeros((128, 256), np.float32), "
        "np.zeros((128, 512), np.float32)]\n")
    profile = {"latency": 0.05, "vector_engine_active_time_percent": 0.5, "scalar_engine_active_time_percent": 0.25,
               "hbm_read_bytes": 393216, "hbm_write_bytes": 524288, "spill_save_bytes": 0, "spill_reload_bytes": 0}
    row = ["scale", json.dumps({"M": 256}), "0", "", "/home/x/NKIBench/./kernels/scale_M256_0.py", "scale_M256",
           "scale_M256_ID0", json.dumps(profile)]
    with open(tmp_path / calibrate.ACCELOPT_PROFILE, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["problem", "values", "case_id", "task", "kernel", "case_name", "service_name", "profile"])
        writer.writerow(row)
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "fixture"], check=True)
    return tmp_path


def test_calibrate_prices_an_nkibench_checkout_laid_out_as_accelopt_lays_it_out(tmp_path, capsys):
    """calibrate.py --accelopt on a tiny repository shaped like zhang677/AccelOpt: the profile row's measured time,
    the traced kernel's estimates, and the engines / HBM table."""
    accelopt_checkout(tmp_path)
    calibrate.main(["--accelopt", str(tmp_path)])
    out = capsys.readouterr().out
    priced = next(line for line in out.splitlines() if line.startswith("| scale | [AO] scale_M256"))
    assert "| trn1 | 256 | float32 | 0.050 |" in priced
    engines = next(line for line in out.splitlines() if line.startswith("| scale |") and "/" in line)
    assert engines.endswith("| 1 / 1 (0) | 0 / 0 | 0 |")  # the trace moves the profile's 917,504 bytes: 1 MB either
    # way; it fits SBUF, so the model spills nothing, as the profile says
    assert engines.split("|")[2].strip().endswith("/ 0.025")  # VectorE active: 50% of 0.05 ms
    assert all(assumption in out for assumption in legacy_trace.ASSUMPTIONS)  # what the tracer assumed, printed


def traced(body, *shapes, generation="trn1", dtype=np.float32):
    """The trace of a legacy kernel whose body is ``body`` (indented 4), on inputs x, y, ... shaped ``shapes``."""
    names = ", ".join("xyzw"[:len(shapes)])
    source = ("import numpy as np\nimport neuronxcc.nki as nki\nimport neuronxcc.nki.language as nl\n"
              "import neuronxcc.nki.isa as nisa\nimport neuronxcc.nki.compiler as ncc\n\n"
              f"def kernel({names}):\n    out = nl.ndarray((128, 128), dtype=np.float32, buffer=nl.shared_hbm)\n"
              + body + "\n    return out\n")
    return legacy_trace.run(source, [np.zeros(s, dtype) for s in shapes], generation)


def test_nl_ds_slices_a_dynamic_range():
    load, = traced("    t = nl.load(x[nl.ds(128, 64), nl.ds(256, 128)])", (256, 512))
    assert (load.partitions, load.free) == (64, 128)
    assert load.reads[0][3:] == (4 * (128 * 512 + 256), 4 * ((128 + 63) * 512 + 256 + 128))  # bytes of the range


def test_nl_negative_is_a_tensor_scalar_multiply_by_minus_one():
    _, negate = traced("    t = nl.negative(nl.load(x[0:128, 0:64]))", (128, 64))
    assert (negate.name, negate.ops, negate.free) == ("tensor_scalar", ("multiply",), 64)


def test_nl_reciprocal_and_one_over_a_tile_are_a_reversed_divide():
    for body in ("    t = nl.reciprocal(nl.load(x[0:128, 0:1]))", "    t = 1.0 / nl.load(x[0:128, 0:1])",
                 "    s = nl.zeros((128, 1), dtype=np.float32)\n    t = 1.0 / s"):  # a whole tensor too
        divide = traced(body, (128, 1))[-1]
        assert (divide.name, divide.ops, divide.partitions) == ("tensor_scalar", ("divide",), 128)


def test_nl_load_transpose2d_is_one_dma_transpose_of_the_rectangle():
    dma, = traced("    t = nl.load_transpose2d(x[0:128, 0:64], dtype=nl.bfloat16)", (128, 64))
    assert (dma.name, dma.engine, dma.partitions, dma.free, dma.dtypes) == (
        "dma_transpose", "dma", 64, 128, ("bfloat16", "float32"))  # 64 partitions of 128 in SBUF


def test_nisa_nc_transpose_runs_on_tensor_engine_into_psum_and_small_tiles_on_vector_engine():
    _, big = traced("    t = nisa.nc_transpose(nl.load(x[0:128, 0:64]))", (128, 64))
    assert (big.name, big.engine, big.buffers[0], big.partitions, big.free) == ("nc_transpose", "tensor", "psum",
                                                                                 128, 64)
    _, small = traced("    t = nisa.nc_transpose(nl.load(x[0:32, 0:32]))", (32, 32))
    assert (small.engine, small.buffers[0]) == ("vector", "sbuf")


def test_a_tensor_engine_result_stored_into_sbuf_is_copied_there_from_psum():
    body = ("    a = nl.load(x[0:128, 0:128])\n    s = nl.ndarray((128, 128), dtype=np.float32, buffer=nl.sbuf)\n"
            "    s[...] = nisa.nc_transpose(a)\n    nl.store(out[0:128, 0:128], value=s)")
    _, transpose, copy, store = traced(body, (128, 128))
    assert transpose.buffers[0] == "psum" and copy.reads == transpose.writes  # the copy reads the PSUM tile
    assert copy.buffers == ("sbuf", "psum") and copy.writes == store.reads  # and writes the SBUF tile stored
    psum = body.replace("buffer=nl.sbuf", "buffer=nl.psum")
    assert [i.name for i in traced(psum, (128, 128))] == ["dma_copy", "nc_transpose", "dma_copy"]  # no copy


def test_nisa_tensor_copy_runs_on_the_engine_it_names():
    _, copy = traced("    t = nisa.tensor_copy(nl.load(x[0:128, 0:64]), engine=nisa.vector_engine)", (128, 64))
    assert (copy.name, copy.engine) == ("tensor_copy", "vector")


def test_nisa_reduce_cmd_and_reduce_res_write_the_row_sums_from_scalar_engine_accumulators():
    body = ("    s = nl.zeros((128, 1), dtype=np.float32)\n"
            "    e = nisa.activation(op=nl.exp, data=nl.load(x[0:128, 0:64]), reduce_op=nl.add, reduce_res=s,\n"
            "                        reduce_cmd=nisa.reduce_cmd.reset_reduce)\n    t = 1.0 / s")
    memset, _, exp, divide = traced(body, (128, 64))
    assert exp.reads_accumulator and memset.writes[0] in exp.writes  # it writes s
    assert divide.reads == memset.writes  # 1.0 / s reads what the exp wrote


def test_nisa_nc_matmul_takes_whole_tensors():
    body = ("    a = nl.ndarray((128, 128), dtype=np.float32, buffer=nl.sbuf)\n"
            "    b = nl.ndarray((128, 512), dtype=np.float32, buffer=nl.sbuf)\n    p = nisa.nc_matmul(a, b)")
    matmul, = traced(body, (1, 1))
    assert (matmul.partitions, matmul.stationary, matmul.free) == (128, 128, 512)


def test_a_one_column_operand_is_a_tensor_scalar_and_two_tiles_a_tensor_tensor():
    body = "    a = nl.load(x[0:128, 0:64])\n    c = nl.load(y[0:128, 0:1])\n    t = nl.multiply(a, c)\n    u = a * a"
    column, tiles = traced(body, (128, 64), (128, 1))[2:]
    assert (column.name, column.free, tiles.name) == ("tensor_scalar", 64, "tensor_tensor")


def test_a_constant_false_mask_issues_nothing():
    assert traced("    t = nl.load(x[0:128, 0:64], mask=(1 < 0))\n    u = nl.load(x[0:128, 0:64], mask=(0 < 1))",
                  (128, 64))[0].partitions == 128
    assert len(traced("    t = nl.load(x[0:128, 0:64], mask=(1 < 0))", (128, 64))) == 0


def test_direct_allocation_reuses_the_storage_at_one_address():
    body = ("    for i in nl.affine_range(3):\n"
            "        t = nl.ndarray((2, nl.par_dim(128), 64), dtype=np.float32,\n"
            "                       buffer=ncc.sbuf.mod_alloc(base_addr=0, num_free_tiles=(2,)))\n"
            "        t[i % 2] = nl.load(x[0:128, 0:64])")
    loads = traced(body, (128, 64))
    storage = [load.writes[0][0] for load in loads]
    assert storage[0] == storage[2] != storage[1]  # blocks 0, 1, 0 of one rotating pair


def test_nl_mgrid_indexes_like_aranges():
    load, = traced("    i = nl.mgrid[0:128, 0:64]\n    t = nl.load(x[i.p, 64 + i.x])", (128, 128))
    assert (load.partitions, load.free, load.reads[0][3]) == (128, 64, 4 * 64)


def test_double_row_matmul_prices_two_rows_per_pass():
    body = ("    a = nl.ndarray((nl.par_dim(128), 2, 128), dtype=nl.float8_e4m3, buffer=nl.sbuf)\n"
            "    b = nl.ndarray((nl.par_dim(128), 2, 512), dtype=nl.float8_e4m3, buffer=nl.sbuf)\n"
            "    p = nisa.nc_matmul(a, b, perf_mode='double_row_gen3')")
    matmul, = traced(body, (1, 1), generation="trn2")
    assert (matmul.partitions, matmul.stationary, matmul.free) == (128, 128, 512)  # K = 2 x 128 in one pass


def test_calibrate_prices_each_step_of_an_autocomp_trace_and_checks_the_sign_of_each_change(tmp_path, capsys):
    """calibrate.py --autocomp on a repository laid out as ucb-bar/autocomp: its trace file nests each step as the
    parent of the next (CodeCandidate(parent=..., code=..., score=ms)); the second step here does half the work."""
    kernel = ("@nki.jit\ndef test(q, k, v):\n    out = nl.ndarray((128, 64), dtype=np.float32, buffer=nl.shared_hbm)\n"
              "    for i in nl.affine_range(ROUNDS):\n        t = nl.exp(nl.load(q[0:128, 0:64]))\n"
              "    nl.store(out[0:128, 0:64], value=t)\n    return out\n")
    step = "CodeCandidate(parent={}, plan=None,\ncode='''{}''',\nscore={})"
    chain = step.format(step.format("None", kernel.replace("ROUNDS", "8"), 0.2), kernel.replace("ROUNDS", "4"), 0.1)
    (tmp_path / "examples" / "trn-tutorial").mkdir(parents=True)
    (tmp_path / calibrate.AUTOCOMP_TRACE).write_text(chain)
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "fixture"], check=True)

    calibrate.main(["--autocomp", str(tmp_path)])
    out = capsys.readouterr().out
    assert "| SD attention, step 0 | [AC] step 0 | trn1 | 4096x64 | float32 | 0.200 |" in out
    change = next(line for line in out.splitlines() if line.startswith("| SD attention, step 1 |") and "%" in line)
    assert change.startswith("| SD attention, step 1 | -50.0% | -") and change.endswith("| yes |")
    assert "1 of 1 changes with the measured sign" in out


def test_calibrate_counts_a_section_apart_and_takes_trace_steps_only_between_points_of_one_shape():
    """[FM]'s trace goes v1 -> v2 at seq_len 512, then v2 -> v3 at 8192: two steps; 512 -> 8192 is none. The
    scaling table's points (section) get their own table and count, not the main table's."""
    def row(kernel, seq_len, measured_ms, central_ms, trace=None, section=None):
        timing = {k: central_ms * 1e-3 for k in ("overlap_s", "scheduled_s", "central_s", "pessimistic_s", "serial_s")}
        point = dict(kernel=kernel, source="s", hardware="trn1", shape=dict(seq_len=seq_len), dtype="float32",
                     measured_s=measured_ms * 1e-3, trace=trace, **timing)
        return {**point, "section": section} if section else point

    rows = [row("v1", 512, 2.0, 2.0, "[FM]"), row("v2", 512, 1.5, 1.8, "[FM]"), row("other", 64, 1.0, 9.0),
            row("v2", 8192, 50.0, 40.0, "[FM]", "scaling"), row("v3", 8192, 25.0, 30.0, "[FM]", "scaling")]
    out = calibrate.table(rows)
    main, section = out.split("scaling, counted apart:")
    assert "2 of 3 central estimates within 25%" in main and "| v3 |" not in main
    assert "2 of 2 central estimates within 25%" in section
    assert "| v2 | -25.0% | -10.0% | yes |" in out and "| v3 | -50.0% | -25.0% | yes |" in out
    assert "2 of 2 changes with the measured sign" in out  # v2 at 512 -> v2 at 8192 is not a step


def test_a_matmul_added_onto_psum_is_marked_as_accumulating_for_the_scheduler():
    trace = trace_of(GENERATED, (128, 256), (128, 512))
    assert all(i.accumulate for i in trace if i.name == "nc_matmul")  # `acc[...] += nisa.nc_matmul(...)`
    body = ("    a = nl.ndarray((128, 128), dtype=np.float32, buffer=nl.sbuf)\n"
            "    b = nl.ndarray((128, 512), dtype=np.float32, buffer=nl.sbuf)\n    p = nisa.nc_matmul(a, b)")
    assert not traced(body, (1, 1))[0].accumulate


def test_calibrate_does_not_price_a_trace_cached_before_traces_named_sbuf_tiles(tmp_path, capsys):
    """A cached trace whose rectangles carry no SbufTile would be priced without spills: its file is not read."""
    repo, cache = accelopt_checkout(tmp_path / "repo"), tmp_path / "traces"
    calibrate.main(["--accelopt", str(repo), f"--cache={cache}"])
    first = capsys.readouterr().out
    [kept] = cache.iterdir()
    assert kept.name.endswith(calibrate.TRACE_FORMAT + ".pkl")
    with open(cache / kept.name.replace(calibrate.TRACE_FORMAT, ""), "wb") as f:  # the old name, an empty trace
        pickle.dump(([], ""), f)
    calibrate.main(["--accelopt", str(repo), f"--cache={cache}"])
    assert capsys.readouterr().out == first  # the kept trace again, not the old-format file

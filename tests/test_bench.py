import dataclasses
import json
import os

import pytest
import torch

import bench
import kernels
import train
from kit import compiled_cost, memory, runtime


def test_training_numbers_are_consistent_with_the_stated_formula(tmp_path):
    out = tmp_path / "bench.json"
    r = bench.main(["--n_layer=1", "--n_embd=64", "--n_head=2", "--n_kv_head=2", "--sequence_len=64", "--batch_size=2",
                    "--compile=false", "--bench_steps=2", "--bench_windows=2", "--bench_warmup=1",
                    "--peak_tflops=0.5", f"--json={out}"])
    saved = json.loads(out.read_text())
    for key in ("device", "tokens_per_s", "flops_per_token", "flops_per_s", "peak_flops", "mfu"):
        assert saved[key] == r[key]
    c = r["model_config"]
    matmul_params = c["n_layer"] * (4 * 64 * 64 + 2 * 64 * 256) + 64 * 384  # attention, MLP, padded head
    assert r["flops_per_token"] == 6 * matmul_params + 12 * 1 * 2 * 32 * 64
    assert r["peak_flops"] == 0.5e12
    assert r["flops_per_s"] == pytest.approx(r["tokens_per_s"] * r["flops_per_token"])
    assert r["mfu"] == pytest.approx(r["flops_per_s"] / 0.5e12)
    assert r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"]


def test_peak_per_rank_follows_the_logical_core_config(monkeypatch):
    monkeypatch.setattr(runtime, "trainium_generation", lambda: "trn2")
    for lnc, expected in (("1", 83.4e12), ("2", 166.8e12)):
        monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", lnc)
        runtime.peak_flops.cache_clear()
        assert runtime.peak_flops("neuron") == pytest.approx(expected)
    runtime.peak_flops.cache_clear()


def test_sweep_on_a_tiny_grid_writes_table_json_and_plot(tmp_path):
    prefix = tmp_path / "sweep"
    r = bench.main(["--sweep", "--sweep_grid=tiny", f"--sweep_out={prefix}", "--n_layer=1", "--n_embd=64",
                    "--n_head=2", "--n_kv_head=2", "--sequence_len=64", "--batch_size=2", "--compile=false",
                    "--bench_steps=1", "--bench_windows=1", "--bench_warmup=1"])
    rows = r["sweep"]
    assert {row["axis"] for row in rows} == {"n_embd", "head_dim", "sequence_len"}
    assert all(row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1 for row in rows)
    assert [row["head_dim"] for row in rows if row["axis"] == "head_dim"] == [32, 64]
    assert json.loads((tmp_path / "sweep.json").read_text()) == rows
    assert (tmp_path / "sweep.csv").read_text().count("\n") == len(rows) + 1
    assert (tmp_path / "sweep.png").stat().st_size > 1000
    # off Trainium the points are ranked by their estimated Trn2 tokens/s
    ranked = sorted(rows, key=lambda row: row["rank"])
    assert [row["rank"] for row in ranked] == list(range(1, len(rows) + 1))
    estimates = [row["trn2_estimate_tokens_per_s"] for row in ranked]
    assert estimates == sorted(estimates, reverse=True) and estimates[-1] > 0


def test_kernel_estimates_are_deterministic_and_labelled():
    from model import GPTConfig

    config = GPTConfig(sequence_len=128, n_layer=1, n_embd=128, n_head=2, n_kv_head=1)
    estimates = []
    for _ in range(2):
        cases = kernels.model_cases(config, batch_size=1, device="cpu", dtype=torch.bfloat16)
        run = []
        for name, _, _, make_inputs, call in cases:
            counts = bench.emulate(lambda *a: call(*a, "nki"), make_inputs(), backward=True)
            run.append((name, bench.kernel_estimate(counts)))
        estimates.append(run)
    assert estimates[0] == estimates[1]
    by_name = dict(estimates[0])
    assert by_name["attention"]["matmuls"] > 0 and 0 < by_name["attention"]["tensore_utilisation"] <= 1
    assert by_name["mlp (relu2)"]["matmul_flops"] >= 3 * 2 * 2 * 128 * 128 * 512  # fwd + bwd of both matmuls
    assert by_name["rms_norm"]["dma_bytes"] > 0 and by_name["rms_norm"]["engines"]["tensor"] == 0
    for estimate in by_name.values():
        engines = estimate["engines"]
        assert set(engines) == {"tensor", "vector", "scalar", "gpsimd", "dma"}
        assert estimate["estimate_s"] == engines[estimate["bottleneck"]] == max(engines.values())
        assert estimate["serial_s"] == pytest.approx(sum(engines.values()))


def test_kernels_json_has_engine_seconds_and_a_bottleneck_for_every_kernel(tmp_path):
    out = tmp_path / "kernels.json"
    bench.main(["--kernels", "--n_layer=1", "--n_embd=128", "--n_head=1", "--sequence_len=128", "--batch_size=1",
                "--compile=false", "--dtype=float32", f"--json={out}"])
    rows = json.loads(out.read_text())["kernels"]
    assert {(r["kernel"], r["direction"]) for r in rows} >= {("attention", "fwd+bwd"), ("rms_norm", "forward")}
    for r in rows:
        assert r["bottleneck"] in r["engines"] and 0 < r["estimate_s"] <= r["serial_s"]
        assert r["estimate_s"] <= r["scheduled_s"] and r["estimate_s"] <= r["central_s"]  # a schedule, not a bound
        assert r["optimistic_s"] == r["estimate_s"] <= r["pessimistic_s"]
        compiled = r["compiled"]  # the fallback, priced as the step estimate prices it
        assert compiled["bottleneck"] in compiled["engines"] and 0 < compiled["estimate_s"] <= compiled["serial_s"]
        assert r["choice"] == ("nki" if r["estimate_s"] < compiled["estimate_s"] else "torch") and r["priced"] == "nki"
    # a micro-step's calls of each op, which --first_hour weighs a kernel's gain by: one layer's attention, MLP and
    # rotary norms of q and k; one loss; the layer's two residual adds with their norms
    calls = {r["op"]: r["calls"] for r in rows}
    assert calls == {"attention": 1, "mlp": 1, "rope_norm": 2, "softcap_cross_entropy": 1, "add_rms_norm": 2,
                     "rms_norm": calls["rms_norm"]} and calls["rms_norm"] >= 1


def test_bench_kernels_with_a_value_is_the_model_setting_and_alone_the_measurement(monkeypatch):
    seen = []
    monkeypatch.setattr(memory, "print_plan", lambda cfg, model_cfg, world_size: seen.append(model_cfg.kernels))
    bench.main(["--memory", "--kernels=torch,attention:nki"])
    assert seen == ["torch,attention:nki"]
    with pytest.raises(ValueError, match="--kernels=atention:nki: 'atention' is not an op"):
        bench.main(["--memory", "--kernels=atention:nki"])


@pytest.mark.parametrize("tokens, faster", [(128, "torch"), (512, "nki")])
def test_auto_runs_the_mlp_the_way_the_cost_model_expects_faster_in_training(tokens, faster, capsys):
    """kernels._mlp_cost_problem is a cheap shape rule; bench --kernels prices the kernel by its emulated trace
    and the fallback as compiled plain ops. At d=512 they must agree, either side of the rule's threshold."""
    cfg, model_cfg = train.parse_args(["--n_layer=1", "--n_embd=512", "--n_head=4", f"--sequence_len={tokens}",
                                       "--batch_size=1", "--compile=false", "--dtype=float32", "--vocab_size=256"])
    rows = bench.measure_kernels(cfg, model_cfg, "cpu", "cpu", ops=("mlp",))
    by_direction = {r["direction"]: r for r in rows}
    assert by_direction["fwd+bwd"]["choice"] == by_direction["fwd+bwd"]["auto"] == faster
    assert by_direction["forward"]["auto"] == faster  # one rule for both: the forward runs what training runs
    bench.print_kernels(rows, on_trainium=False)
    assert f"--kernels=mlp:{faster}" in capsys.readouterr().out


def test_step_estimate_adds_up_and_grows_with_the_model_as_its_formulas_say(monkeypatch):
    from model import GPTConfig

    cfg, _ = train.parse_args(["--batch_size=2", "--total_batch_tokens=1024"])
    kernel_costs = {"attention": 1e-5, "mlp": 2e-5, "rms_norm": 1e-6, "rms_norm_fp32": 2e-6, "add_rms_norm": 3e-6,
                    "softcap_cross_entropy": 4e-6, "rope_norm": 5e-6}  # seconds per sequence: given, not emulated
    small, deep = (bench.step_estimate(cfg, GPTConfig(sequence_len=256, n_layer=n, n_embd=128, n_head=1,
                                                      vocab_size=512), 1, kernel_costs) for n in (2, 4))
    assert small["step_s"] == pytest.approx(sum(small["components"].values()))
    assert small["tokens_per_s"] == pytest.approx(1024 / small["step_s"]) and small["micro_steps"] == 2
    assert small["components"]["kernels: attention"] == pytest.approx(2 * 2 * 2 * 1e-5)  # micro-steps x layers x seqs
    assert small["components"]["kernels: add_rms_norm"] == pytest.approx(2 * 2 * 2 * 2 * 3e-6)  # two per layer
    unfused = bench.step_estimate(cfg, GPTConfig(sequence_len=256, n_layer=2, n_embd=128, n_head=1, vocab_size=512), 1,
                                  {**kernel_costs, "add_rms_norm": None})  # the residual adds as elementwise passes
    assert unfused["components"]["elementwise"] > small["components"]["elementwise"]
    assert unfused["components"]["kernels: rms_norm"] > small["components"]["kernels: rms_norm"]
    assert small["components"]["kernels: rope_norm"] == pytest.approx(2 * 2 * 2 * 5e-6)  # micro-steps x layers x seqs
    unfused_rope = bench.step_estimate(cfg, GPTConfig(sequence_len=256, n_layer=2, n_embd=128, n_head=1, vocab_size=512),
                                       1, {**kernel_costs, "rope_norm": None})  # rotary passes, QK-norm by rms_norm
    assert "kernels: rope_norm" not in unfused_rope["components"]
    assert unfused_rope["components"]["elementwise"] > small["components"]["elementwise"]
    assert unfused_rope["components"]["kernels: rms_norm"] > small["components"]["kernels: rms_norm"]
    for part in ("kernels: attention", "kernels: mlp", "projection matmuls", "elementwise"):
        assert deep["components"][part] == pytest.approx(2 * small["components"][part])  # per-layer work
    assert deep["components"]["head matmul"] == pytest.approx(small["components"]["head matmul"])
    assert small["components"]["kernels: softcap_cross_entropy"] == pytest.approx(2 * 2 * 4e-6)  # micro-steps x seqs
    assert small["components"]["gradient exchange"] == 0
    on_eight = bench.step_estimate(dataclasses.replace(cfg, total_batch_tokens=8192),
                                   GPTConfig(sequence_len=256, n_layer=2, n_embd=128, n_head=1, vocab_size=512), 8,
                                   kernel_costs)
    assert on_eight["micro_steps"] == 2 and on_eight["components"]["gradient exchange"] > 0
    unsharded = bench.step_estimate(dataclasses.replace(cfg, total_batch_tokens=8192, shard_optimizer="false"),
                                    GPTConfig(sequence_len=256, n_layer=2, n_embd=128, n_head=1, vocab_size=512), 8,
                                    kernel_costs)  # every rank updates everything
    assert on_eight["components"]["optimizer"] < unsharded["components"]["optimizer"] / 2
    with pytest.raises(ValueError, match="not a multiple"):
        bench.step_estimate(cfg, GPTConfig(sequence_len=256, n_layer=2, n_embd=128, n_head=1), 3, kernel_costs)


def test_step_estimate_prints_three_figures_and_the_references_priced_as_they_ran(monkeypatch, capsys):
    tiny = dict(bench.REFERENCE_RUNS[1], args=["--n_layer=1", "--n_embd=128", "--n_head=1", "--sequence_len=128",
                                                "--batch_size=1", "--total_batch_tokens=512"], ranks=2,
                measured_tokens_per_s=1000.0, host_idle=0.2, micro_batch_step_s={1: 0.2, 2: 0.3, 4: 0.5})
    monkeypatch.setattr(bench, "REFERENCE_RUNS", (tiny,))
    results = bench.main(["--step_estimate", "--n_layer=1", "--n_embd=128", "--n_head=1", "--sequence_len=128",
                          "--batch_size=1", "--compile=false"])
    reference, = results["references"]
    printed = capsys.readouterr().out
    figures = [results[key]["tokens_per_s"] for key in ("step_estimate", "central", "pessimistic")]
    assert figures[0] > figures[1] >= figures[2]  # scheduled, calibrated, launched; then no fusion
    for name, rate in zip(bench.FIGURES, figures):
        assert f"{name:<11} {rate:>10,.0f} tokens/s" in printed
    for key in ("as_ran", "with_kernels"):  # like with like: the run as it ran, the kit's kernels beside it
        assert reference[key]["optimistic"] >= reference[key]["central"] >= reference[key]["pessimistic"]
        assert " / ".join(f"{reference[key][f]:,.0f}" for f in bench.FIGURES) in printed
    assert reference["as_ran"]["central"] > reference["as_ran"]["pessimistic"]  # plain ops fused, then not
    assert reference["with_kernels"]["optimistic"] > reference["with_kernels"]["central"]  # kernels scheduled
    assert reference["measured_compute_tokens_per_s"] == pytest.approx(1000.0 / 0.8)  # the host idle taken out
    assert reference["central_over_measured_compute"] == pytest.approx(reference["as_ran"]["central"] / 1250.0)
    assert "host idle 20% of the step (measured)" in printed and "left out:" in printed
    points = reference["at_micro_batches"]
    assert [(k, step_s, compute_s) for k, step_s, compute_s, _ in points] == [
        (1, 0.2, pytest.approx(0.16)), (2, 0.3, pytest.approx(0.24)), (4, 0.5, pytest.approx(0.4))]
    priced = [priced_s for *_, priced_s in points]
    assert priced[0] < priced[1] < priced[2]  # the step grows by a micro-batch's forward and backward each
    assert "per micro-batch 100.0 ms measured, its compute 80.0" in printed  # through (1, 0.2), (2, 0.3), (4, 0.5)


def test_eager_dispatch_is_named_apart_with_the_ops_the_step_dispatches():
    cfg, model_cfg = train.parse_args(["--n_layer=1", "--n_embd=64", "--n_head=2", "--sequence_len=64",
                                       "--batch_size=1", "--total_batch_tokens=64"])
    one = bench.eager_ops_per_step(cfg, model_cfg)
    deeper = bench.eager_ops_per_step(cfg, dataclasses.replace(model_cfg, n_layer=2))
    two_micro_batches = bench.eager_ops_per_step(dataclasses.replace(cfg, total_batch_tokens=128), model_cfg)
    assert 0 < one < deeper and one < two_micro_batches < 2 * one  # a micro-batch more: its forward and backward
    row = {"eager": True, "step_tokens": 1000, "measured_tokens_per_s": 1000.0, "as_ran": {"central": 1250.0},
           "eager_ops_per_step": one}  # a 1 s step, 0.8 s of it priced
    line = bench._reference_overheads(row)
    assert f"eager dispatch: {one:,} ATen ops a step" in line and "leaves 200 ms (20%) to it" in line
    assert f"{2e5 / one:.1f} us an op" in line


def _hbm_values(op):
    """Values an op moves between HBM and SBUF."""
    return sum(count * i.partitions * i.free for count, i in op if i.engine == "dma")


def _elementwise(output, *inputs, elements=1024):
    return compiled_cost.Node(output, inputs, "elementwise", ((1, compiled_cost.instruction(
        "vector", "tensor_tensor" if len(inputs) > 1 else "tensor_scalar", elements, len(inputs), "float32")),))


def test_an_elementwise_chain_fuses_into_one_loop_nest_that_reads_and_writes_hbm_once():
    tensors = {name: (1024, "float32") for name in ("x", "w", "a", "b", "c")}
    nodes = [_elementwise("a", "x"), _elementwise("b", "a", "w"), _elementwise("c", "b")]
    fused, = compiled_cost.graph_ops(nodes, tensors, ["c"])
    assert _hbm_values(fused) == 3 * 1024  # x and w read once, c written once: a and b stay in SBUF
    unfused = compiled_cost.graph_ops(nodes, tensors, ["c"], fused=False)
    assert [_hbm_values(op) for op in unfused] == [2 * 1024, 3 * 1024, 2 * 1024]  # every pass an HBM round trip
    also_read = compiled_cost.graph_ops(nodes + [compiled_cost.Node("y", ("a", "w"), "matmul")],
                                        {**tensors, "y": (1024, "float32")}, ["c", "y"])
    assert _hbm_values(also_read[0]) == 4 * 1024  # a is read outside the loop nest: written out too
    # the chain as bench prices it: fused, cheaper than the pessimistic figure's round trips, same compute
    fused_passes = compiled_cost.passes(4096, one_input=2, two_input=1, scalar=1)
    compiled_cost.fusing.append(False)
    try:
        unfused_passes = compiled_cost.passes(4096, one_input=2, two_input=1, scalar=1)
    finally:
        compiled_cost.fusing.pop()
    assert _hbm_values(fused_passes) == 3 * 4096 and _hbm_values(unfused_passes) == (2 * 2 + 3 + 2) * 4096
    compute = [(count, i) for count, i in fused_passes if i.engine != "dma"]
    assert compute == [(count, i) for count, i in unfused_passes if i.engine != "dma"]


def test_fusion_stops_at_matmuls_and_at_another_number_of_values():
    tensors = {"x": (1024, "float32"), "a": (1024, "float32"), "s": (1024, "float32"), "b": (1024, "float32"),
               "small": (16, "float32"), "c": (16, "float32")}
    through_matmul = [_elementwise("a", "x"), compiled_cost.Node("s", ("a",), "matmul"), _elementwise("b", "s")]
    assert [len(g) for g in compiled_cost.fuse(through_matmul, tensors)] == [1, 1, 1]
    ops = compiled_cost.graph_ops(through_matmul, tensors, ["b"])
    assert [_hbm_values(op) for op in ops] == [2 * 1024] * 3  # a and s each written to HBM, then read back
    other_space = [_elementwise("a", "x"), _elementwise("c", "a", "small", elements=16)]
    assert [len(g) for g in compiled_cost.fuse(other_space, tensors)] == [1, 1]
    siblings = [_elementwise("a", "x"), _elementwise("b", "a"), _elementwise("s", "a", "b")]  # a read twice inside
    assert [len(g) for g in compiled_cost.fuse(siblings, tensors)] == [3]


def test_step_figures_are_ordered_optimistic_central_pessimistic():
    from model import GPTConfig

    cfg, _ = train.parse_args(["--batch_size=2", "--total_batch_tokens=2048"])
    config = GPTConfig(sequence_len=512, n_layer=2, n_embd=512, n_head=4, vocab_size=512, kernels="torch")
    costs = dict.fromkeys(kernels.KERNEL_OPS + ("rms_norm_fp32",))  # everything compiled: fusion decides
    rates = [bench.step_estimate(cfg, config, 1, costs, figure)["tokens_per_s"] for figure in bench.FIGURES]
    assert rates[0] > rates[1] > rates[2]  # calibrated TensorE (at these widths the matmuls bound), then unfused
    with pytest.raises(ValueError, match="figure='best': use one of optimistic, central, pessimistic"):
        bench.step_estimate(cfg, config, 1, costs, "best")


NANOGPT_STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nanogpt_standin")


def test_versus_nanogpt_times_both_in_turns_and_reports_the_ratio(monkeypatch):
    shapes, load = [], bench.load_nanogpt

    def load_and_record_config(folder):
        module = load(folder)
        make_config = module.GPTConfig
        module.GPTConfig = lambda **fields: shapes.append(fields) or make_config(**fields)
        return module

    monkeypatch.setattr(bench, "load_nanogpt", load_and_record_config)
    rows = bench.main([f"--versus_nanogpt={NANOGPT_STANDIN}", "--n_layer=1", "--n_embd=64", "--n_head=2",
                       "--sequence_len=64", "--batch_size=2", "--compile=false", "--bench_steps=2", "--bench_windows=3",
                       "--bench_warmup=1"])["versus_nanogpt"]
    assert [r["run"] for r in rows] == ["nanoGPT, eager", "this kit (train.py's step)"]  # no compiled row: --compile=false
    assert shapes == [dict(block_size=64, vocab_size=384, n_layer=1, n_head=2, n_embd=64, dropout=0.0, bias=False)]
    for r in rows:
        assert r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"]
        assert r["vs_nanogpt_eager"] == pytest.approx(r["tokens_per_s"] / rows[0]["tokens_per_s"])


def test_versus_nanogpt_names_a_missing_or_wrong_checkout(tmp_path):
    with pytest.raises(ValueError, match="no model.py there; clone https://github.com/karpathy/nanoGPT"):
        bench.main([f"--versus_nanogpt={tmp_path}", "--compile=false"])
    kit_root = os.path.dirname(os.path.dirname(NANOGPT_STANDIN))  # the kit's own model.py is no nanoGPT
    with pytest.raises(ValueError, match="its model.py is not nanoGPT's"):
        bench.main([f"--versus_nanogpt={kit_root}", "--compile=false"])

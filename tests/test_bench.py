import json
import os
import types

import pytest
import torch

import bench
import kernels
import train


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
    monkeypatch.setattr(train, "trainium_generation", lambda: "trn2")
    for lnc, expected in (("1", 83.4e12), ("2", 166.8e12)):
        monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", lnc)
        train.peak_flops.cache_clear()
        assert train.peak_flops("neuron") == pytest.approx(expected)
    train.peak_flops.cache_clear()


def counts(matmuls=(), transposes=()):
    flops = sum(2 * k * m * n for k, m, n, _ in matmuls)
    return types.SimpleNamespace(matmul_shapes=list(matmuls), transposes=list(transposes), matmul_flops=flops,
                                 instructions={"tensor": len(matmuls) + len(transposes)}, dma_bytes=0)


@pytest.mark.parametrize(
    "matmuls, cycles, utilisation",
    [
        ([(128, 128, 512, "bfloat16")], 512, 1.0),  # a full tile streams one column per cycle
        ([(128, 128, 32, "bfloat16")], 64, 0.5),  # narrow moving side: the fixed 64-cycle cost dominates
        ([(128, 32, 512, "bfloat16")], 512, 0.25),  # narrow stationary: 3/4 of the array idles
        ([(64, 128, 512, "bfloat16")], 512, 0.5),  # half the contraction rows
        ([(128, 128, 512, "float32")], 2048, 0.25),  # fp32 inputs run at a quarter of the rate
    ],
)
def test_tensore_estimate_cost_model(matmuls, cycles, utilisation):
    estimate = bench.tensore_estimate(counts(matmuls), peak_per_core=2 * 128 * 128 * 1e9)
    assert estimate["tensore_cycles"] == cycles
    assert estimate["tensore_utilisation"] == pytest.approx(utilisation)
    assert estimate["tensore_time_s"] == pytest.approx(cycles / 1e9)


def test_transposes_cost_tensore_time_but_no_flops():
    estimate = bench.tensore_estimate(counts([(128, 128, 512, "bfloat16")], [(128, 128, "bfloat16")]), 32768e9)
    assert estimate["tensore_cycles"] == 512 + 128
    assert estimate["tensore_utilisation"] == pytest.approx(512 / 640)


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


def test_kernel_estimates_are_deterministic_and_labelled():
    from model import GPTConfig

    config = GPTConfig(sequence_len=128, n_layer=1, n_embd=128, n_head=2, n_kv_head=1)
    estimates = []
    for _ in range(2):
        cases = bench.kernel_cases(config, batch_size=1, device="cpu", dtype=torch.bfloat16)
        run = []
        for name, _, _, make_inputs, call in cases:
            counts = bench.emulate(lambda *a: call(*a, "nki"), make_inputs(), backward=True)
            run.append((name, bench.tensore_estimate(counts, train.PEAK_FLOPS["trn2"])))
        estimates.append(run)
    assert estimates[0] == estimates[1]
    by_name = dict(estimates[0])
    assert by_name["attention"]["matmuls"] > 0 and 0 < by_name["attention"]["tensore_utilisation"] <= 1
    assert by_name["mlp (relu2)"]["matmul_flops"] >= 3 * 2 * 2 * 128 * 128 * 512  # fwd + bwd of both matmuls
    assert by_name["rms_norm"]["dma_bytes"] > 0


TINY_CHECK_MODEL = dict(sequence_len=128, n_layer=1, n_embd=128, n_head=2, n_kv_head=1, vocab_size=257)


def test_first_hour_check_passes_under_the_emulator(monkeypatch):
    monkeypatch.setattr(bench, "CHECK_MODEL", TINY_CHECK_MODEL)
    monkeypatch.setattr(bench, "CHECK_STEPS", 2)
    rows = bench.main(["--check", "--compile=false", "--dtype=float32", "--matrix_optimizer=adamw"])["check"]
    assert [r["check"] for r in rows if not r["passed"]] == []
    names = " | ".join(r["check"] for r in rows)
    for activation in kernels.MLP_ACTIVATIONS:
        assert f"mlp {activation} forward, no grad" in names and f"mlp {activation} forward+backward" in names
    for part in ("attention forward, no grad", "rms_norm weighted forward+backward", "Block (nki)", "2 training steps",
                 "causality"):
        assert part in names


def test_first_hour_check_reports_a_broken_kernel(monkeypatch):
    """An attention kernel that no longer masks the future: its checks and causality fail, each with its
    first error, and the rest still run. (Two of the kernel cases, to keep it short.)"""
    monkeypatch.setattr(bench, "CHECK_MODEL", TINY_CHECK_MODEL)
    monkeypatch.setattr(bench, "CHECK_STEPS", 1)
    monkeypatch.setattr(kernels, "_MASKED_SCORE", 0.0)
    all_cases = bench._kernel_checks
    monkeypatch.setattr(bench, "_kernel_checks",
                        lambda *a: [case for case in all_cases(*a) if case[0] in ("attention", "mlp relu2")])
    rows = {r["check"]: r for r in bench.main(["--check", "--compile=false", "--dtype=float32",
                                               "--matrix_optimizer=adamw"])["check"]}
    assert not rows["attention forward, no grad"]["passed"]
    assert "max |nki - torch|" in rows["attention forward, no grad"]["error"]
    assert not rows["causality of the model on nki"]["passed"]
    assert "changed logits at or before it" in rows["causality of the model on nki"]["error"]
    assert rows["mlp relu2 forward+backward"]["passed"] and "1 training steps, nki vs torch" in rows


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

"""kit/device_check.py (`bench.py --check`): the shapes it checks the kernels at, on a device and on the CPU;
the whole check under the emulator; a broken kernel reported; the inductor probe apart from this process."""
import dataclasses
import re

import pytest
import torch

import bench
import kernels
import train
from kit import device_check
from kernels import AttentionShape, CheckShapes

TINY_CHECK_MODEL = dict(sequence_len=128, n_layer=1, n_embd=128, n_head=2, n_kv_head=1, vocab_size=257)
# every path CPU_SHAPES reaches but at the smallest sizes, for the end-to-end tests: the MLP's 2 hidden tiles
# in 2 chunks
TINY_SHAPES = CheckShapes(attention=(AttentionShape(1, 2, 1, 128, 32),), batch=1, rows=67, dim=128, hidden=256,
                          activations=("relu2", "swiglu"), mlp_chunk_tiles=1, vocab=257, logit_softcap=15.0)
K82S4 = bench.REFERENCE_RUNS[1]["args"]  # head_dim 256, one KV head, d 1024, hidden 4096, 8 x 1024 per rank


def test_on_a_device_the_kernels_are_checked_at_the_runs_own_shapes():
    """Computed without running a kernel: the shapes, and the check names they give, for two presets."""
    cfg, model_cfg = train.parse_args(K82S4)
    model_cfg.vocab_size = 8192
    shapes = device_check.check_shapes(model_cfg, cfg.batch_size, on_device=True)
    assert shapes.attention == (AttentionShape(batch=8, n_head=4, n_kv_head=1, seq_len=1024, head_dim=256),)
    assert (shapes.batch, shapes.rows, shapes.dim, shapes.hidden) == (8, 1024, 1024, 4096)
    assert shapes.activations == ("leaky_relu2",) and shapes.vocab == 8192 and shapes.mlp_chunk_tiles == 0
    # the MLP at its width: the backward in several chunks, as kernels._mlp_chunk_tiles plans it there
    assert kernels.mlp_chunks(shapes, False, torch.bfloat16, backward=True) > 1
    names = [name for name, _, _ in device_check.planned_checks(cfg, model_cfg, "neuron", "cpu", train.train_step)]
    ops = {op for _, op, _ in device_check.planned_checks(cfg, model_cfg, "neuron", "cpu", train.train_step) if op}
    assert ops == set(kernels.KERNEL_OPS)
    for dtype in ("bf16", "fp32"):
        for direction in ("forward, no grad", "forward+backward"):
            assert f"attention {dtype} {direction} (4:1 heads of 256, T 1024, batch 8)" in names
            assert any(n.startswith(f"mlp leaky_relu2 {dtype} {direction} (8 x 1024 rows of 1024, hidden 4096")
                       for n in names)
    baseline_cfg, baseline = train.parse_args(["--preset=baseline", "--window_pattern=SSSL"])
    shapes = device_check.check_shapes(baseline, baseline_cfg.batch_size, on_device=True)
    assert shapes.attention == (AttentionShape(8, 5, 5, 1024, 128), AttentionShape(8, 5, 5, 1024, 128, window=256))
    assert (shapes.dim, shapes.hidden) == (640, 2560)


def test_on_the_cpu_the_smallest_shapes_reach_every_path_the_device_shapes_do():
    shapes = device_check.check_shapes(None, 8, on_device=False)
    assert shapes is device_check.CPU_SHAPES
    assert any(a.head_dim == 256 and a.n_kv_head == 1 for a in shapes.attention)  # two head-dim pieces, one KV head
    assert any(a.seq_len > kernels.KEY_BLOCK for a in shapes.attention)  # two score blocks: the ScalarE row max
    assert any(a.window is not None and a.window + 128 < a.seq_len for a in shapes.attention)  # blocks skipped
    assert any(a.n_head > a.n_kv_head > 0 and a.head_dim < 128 for a in shapes.attention)  # grouped, one piece
    for dtype in device_check.KERNEL_DTYPES:
        for activation in kernels.MLP_ACTIVATIONS:
            for backward in (False, True):
                assert kernels.mlp_chunks(shapes, activation == "swiglu", dtype, backward) == 2
    assert shapes.rows % 128 and shapes.vocab % 128 and shapes.batch > 1  # partial tiles, padded vocabulary
    assert {case.op for case in device_check.kernel_cases(shapes, torch.bfloat16, "cpu", 0)} == set(kernels.KERNEL_OPS)
    assert set(device_check.KERNEL_DTYPES) == {torch.bfloat16, torch.float32}


def test_check_passes_under_the_emulator_with_the_inductor_answer_from_its_own_interpreter(monkeypatch, capsys):
    """The whole check at tiny shapes. The inductor line comes from a fresh interpreter, so it does not depend
    on what this process compiled before: here even a broken torch.compile in this process leaves it a
    definite answer (in-process it said "could not run here")."""
    monkeypatch.setattr(device_check, "CHECK_MODEL", TINY_CHECK_MODEL)
    monkeypatch.setattr(device_check, "CHECK_STEPS", 2)
    monkeypatch.setattr(device_check, "CPU_SHAPES", TINY_SHAPES)

    def broken_compile(*args, **kwargs):
        raise RuntimeError("this process's compile state")

    monkeypatch.setattr(torch, "compile", broken_compile)  # --compile=false: nothing else here compiles
    rows = bench.main(["--check", "--compile=false", "--dtype=float32", "--matrix_optimizer=adamw"])["check"]
    printed = capsys.readouterr().out
    assert [r["check"] for r in rows if not r["passed"]] == [], printed
    seed = int(printed.split("seed ", 1)[1].split()[0])  # a fresh seed, printed with how to repeat it
    assert f"(the same inputs again: --seed={seed})" in printed, printed
    assert re.search(r"\ninductor: (fused bf16 transposes compile right|MISCOMPILES fused bf16 transposes)", printed), \
        printed
    names = [r["check"] for r in rows]
    for dtype in ("bf16", "fp32"):
        for direction in ("forward, no grad", "forward+backward"):
            for case in kernels.check_cases(torch.float32, "cpu", torch.Generator(), TINY_SHAPES):
                assert f"{case.name} {dtype} {direction} ({case.shape})" in names, (case, dtype, names)
    assert any("hidden 256 in 2/2 chunks" in n for n in names)
    for part in ("Block (nki) vs eager (torch)", "2 training steps, nki vs torch", "causality of the model on nki"):
        assert part in names
    assert {r["op"] for r in rows} == set(kernels.KERNEL_OPS) | {None}


def test_check_reports_a_broken_kernel_by_its_op(monkeypatch):
    """An attention kernel that no longer masks the future: its checks and causality fail, each with its
    first error, and the rest still run. (Two of the kernel cases in fp32, to keep it short.)"""
    monkeypatch.setattr(device_check, "CHECK_MODEL", TINY_CHECK_MODEL)
    monkeypatch.setattr(device_check, "CHECK_STEPS", 1)
    monkeypatch.setattr(device_check, "CPU_SHAPES", TINY_SHAPES)
    monkeypatch.setattr(device_check, "KERNEL_DTYPES", (torch.float32,))
    monkeypatch.setattr(device_check, "inductor_transpose_line", lambda: "inductor: not asked here")
    monkeypatch.setattr(kernels, "_MASKED_SCORE", 0.0)
    all_cases = device_check.kernel_cases
    monkeypatch.setattr(device_check, "kernel_cases",
                        lambda *a: [case for case in all_cases(*a) if case.name in ("attention", "mlp relu2")])
    rows = bench.main(["--check", "--compile=false", "--dtype=float32", "--matrix_optimizer=adamw"])["check"]
    by_name = {r["check"].split(" (")[0]: r for r in rows}
    attention = by_name["attention fp32 forward, no grad"]
    assert not attention["passed"] and attention["op"] == "attention" and "max |nki - torch|" in attention["error"]
    assert not by_name["causality of the model on nki"]["passed"]
    assert "changed logits at or before it" in by_name["causality of the model on nki"]["error"]
    assert by_name["mlp relu2 fp32 forward+backward"]["passed"] and "1 training steps, nki vs torch" in by_name


def test_check_repeats_its_numbers_with_the_same_seed_and_not_with_another():
    """--seed=N gives every kernel check the same inputs, so the same measured error; another seed others."""
    def measured(seed):
        case, = [case for case in device_check.kernel_cases(TINY_SHAPES, torch.float32, "cpu", seed)
                 if case.name == "mlp swiglu"]
        return device_check.check_kernel(case, True, seed)

    assert measured(11) == measured(11) != measured(12)


@pytest.mark.parametrize("forced", [1, 0])
def test_mlp_chunks_count_the_chunks_the_kernel_runs(forced, monkeypatch):
    """The chunk count the check names is the one the kernel runs: mlp_fwd_kernel gets that many chunk tiles."""
    shapes = dataclasses.replace(TINY_SHAPES, mlp_chunk_tiles=forced)
    seen = []
    run = kernels._run_kernel
    monkeypatch.setattr(kernels, "_run_kernel", lambda kernel, *args: seen.append(args[-1]) or run(kernel, *args))
    case, = [c for c in device_check.kernel_cases(shapes, torch.float32, "cpu", 0) if c.name == "mlp relu2"]
    with case.context():
        case.call(*case.make_inputs(), "nki")
    tiles = shapes.hidden // kernels.TILE
    assert -(-tiles // seen[0]) == kernels.mlp_chunks(shapes, False, torch.float32, backward=False)


def test_the_output_gradient_is_not_an_input_drawn_from_the_same_seed():
    """RMSNorm's dx cancels for an output gradient parallel to x. With x the first draw from the check's seed,
    an output gradient drawn from that seed too was x itself, and a sound kernel failed (0.163 against a
    tolerance of 4.8e-7)."""
    case, = [case for case in device_check.kernel_cases(TINY_SHAPES, torch.float32, "cpu", seed=5)
             if case.name == "rms_norm"]
    generator = torch.Generator().manual_seed(5)
    case = case._replace(make_inputs=lambda: (torch.randn(TINY_SHAPES.batch, TINY_SHAPES.rows, TINY_SHAPES.dim,
                                                          generator=generator),))
    device_check.check_kernel(case, grad=True, seed=5)

"""The kit's Muon, the schedule, and the rule that no op of a step sees a changed Python number."""
import dataclasses
import functools
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import train
from kit import optim
from model import GPT, GPTConfig


def random_with_singular_values(rows, cols, values, seed):
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, len(values), generator=g))
    v, _ = torch.linalg.qr(torch.randn(cols, len(values), generator=g))
    return u @ torch.diag(values) @ v.T, u, v


@pytest.mark.parametrize("rows, cols", [(64, 64), (256, 64), (48, 200)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_orthogonalize_keeps_singular_vectors_and_pulls_singular_values_to_one(rows, cols, dtype):
    values = torch.logspace(-3, 1, min(rows, cols))  # four decades, as gradients have
    g, u, v = random_with_singular_values(rows, cols, values, seed=rows + cols)
    x = optim.orthogonalize(g[None], dtype)[0].float()
    assert x.dtype == torch.float32 and x.shape == (rows, cols)
    # in the singular bases of g, x is diagonal where g's singular values stand above rounding (bf16 keeps
    # ~3 digits, so directions of values 1e4 below the largest are lost in it) and Polar Express's five
    # steps, tuned for values down to ~1e-3 of the Frobenius norm, bring those values into a band around 1
    kept = values > 0.1
    in_basis = (u.T @ x @ v)[kept][:, kept]
    off_diagonal = in_basis - torch.diag(torch.diagonal(in_basis))
    assert off_diagonal.norm() / in_basis.norm() < (0.03 if dtype == torch.bfloat16 else 1e-3)
    s = torch.diagonal(in_basis)
    assert s.min() > 0.8 and s.max() < 1.2


def reference_muon_step(p, grad, buf, second, lr, momentum, beta2, wd):
    """One matrix, written out from the method's description (not from optim.Muon's code)."""
    buf = momentum * buf + (1 - momentum) * grad
    nesterov = (1 - momentum) * grad + momentum * buf
    o = optim.orthogonalize(nesterov[None], torch.float32)[0]
    axis = 1 if p.shape[0] >= p.shape[1] else 0  # one statistic per row of the longer side
    second = beta2 * second + (1 - beta2) * (o ** 2).mean(dim=axis, keepdim=True)
    normed = o / second.clamp_min(1e-10).sqrt()
    normed = normed * o.norm() / normed.norm()
    decay = wd * p * ((normed * p) >= 0)
    scaled_lr = lr * math.sqrt(max(1.0, p.shape[0] / p.shape[1]))
    return p - scaled_lr * (normed + decay), buf, second


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_muon_matches_a_per_matrix_reference_over_three_steps(compiled, monkeypatch):
    """Compiled: traced and functionalised as in training (in-place updates of stacked state and of the
    parameters must survive it), through aot_eager: inductor's C++ build would take ~25 s here."""
    compile_traced = functools.partial(torch.compile, backend="aot_eager")
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compile_traced(fn, **kwargs))
    torch.manual_seed(0)
    shapes = [(32, 16), (32, 16), (16, 48), (24, 24)]
    params = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    reference = [p.detach().clone() for p in params]
    bufs = [torch.zeros(s) for s in shapes]
    seconds = [torch.zeros(s[0], 1) if s[0] >= s[1] else torch.zeros(1, s[1]) for s in shapes]
    muon = optim.Muon(params, lr=0.02, momentum=0.9, beta2=0.95, weight_decay=0.1, dtype=torch.float32, compile=compiled)
    for step in range(3):
        grads = [torch.randn(*s) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        muon.step()
        for i, g in enumerate(grads):
            reference[i], bufs[i], seconds[i] = reference_muon_step(reference[i], g, bufs[i], seconds[i], 0.02, 0.9, 0.95, 0.1)
        for p, want in zip(params, reference):
            torch.testing.assert_close(p.detach(), want, rtol=1e-4, atol=1e-5)


def test_schedule_warms_momentum_and_decays_weight_decay():
    cfg = train.TrainConfig(muon_momentum_start=0.85, muon_momentum=0.95, muon_momentum_warmup_steps=300,
                            weight_decay=0.2, warmup_steps=0, warmdown_frac=0.5)
    assert train.schedule(cfg, 0, 0.0) == {"lr_scale": 1.0, "momentum": 0.85, "weight_decay": 0.2, "extra_loss_weights": (),
                                           "batch_fraction": 1.0}
    mid = train.schedule(cfg, 150, 0.75)
    assert mid["momentum"] == pytest.approx(0.90) and mid["weight_decay"] == pytest.approx(0.05)
    assert mid["lr_scale"] == pytest.approx(0.5)
    assert train.schedule(cfg, 600, 1.0)["momentum"] == pytest.approx(0.95)


class OpRecorder(TorchDispatchMode):
    """Every op dispatched, with its non-tensor arguments (what a graph would be specialised on)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not str(func).startswith("profiler."):  # the optimizers' record_function markers compute nothing
            constants = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if not isinstance(a, torch.Tensor)]
            self.ops.append((str(func), repr(constants)))
        return func(*args, **kwargs)


def frontier_configs():
    """The frontier preset's levers at a tiny shape."""
    cfg, model_cfg = train.parse_args(["--preset=frontier", "--max_steps=20", "--warmup_steps=5",
                                       "--muon_momentum_warmup_steps=10", "--loss_chunks=2", "--compile=false"])
    model_cfg = dataclasses.replace(model_cfg, sequence_len=32, vocab_size=64, n_layer=2, n_embd=32, n_head=2, n_kv_head=1)
    return cfg, model_cfg


@pytest.mark.parametrize("recipe", ["muon", "adamw", "frontier"])
def test_a_step_sees_no_changed_python_number_when_hyperparameters_change(recipe):
    """On Neuron a changed Python scalar re-traces the step's graph; hyperparameters live in device
    tensors instead. Two steps at different learning rates, momenta, weight decays, MTP weights and
    schedule positions must dispatch the very same ops with the very same constants. (Uncompiled, as the
    optimizers run on Neuron: only CPU and CUDA compile Muon's update.) The frontier's
    batch warm-up changes how many micro-batches a step runs, never what each one dispatches."""
    torch.manual_seed(0)
    if recipe == "frontier":
        cfg, model_cfg = frontier_configs()
    else:
        cfg = train.TrainConfig(matrix_optimizer=recipe, weight_decay=0.1, warmup_steps=5,
                                muon_momentum_warmup_steps=10, max_steps=20, compile=False)
        model_cfg = GPTConfig(sequence_len=32, vocab_size=64, n_layer=1, n_embd=32, n_head=2, n_kv_head=1)
    model = GPT(model_cfg)
    optimizers = optim.make_optimizers(model, cfg, "cpu", torch.float32)
    ema = optim.WeightEMA(model, cfg.ema_decay, cfg.ema_every, cfg.ema_blend) if cfg.ema_decay else None
    batch = lambda: (torch.randint(0, 64, (2, 32)), torch.randint(-1, 64, (2, 32)))  # noqa: E731  -1: masked BOS
    train.train_step(model, model, optimizers, [batch()], "cpu", train.nullcontext(), cfg.grad_clip)  # creates state
    records, points = [], ((1, 0.05), (13, 0.15), (15, 0.9))  # warm-up, t+3's weight mid-fade, warm-down
    for step, progress in points:
        values = train.schedule(cfg, step, progress)
        with OpRecorder() as recorder:
            train.apply_schedule(optimizers, values, model)
            micro_batches = [batch() for _ in range(round(4 * values["batch_fraction"]))]
            train.train_step(model, model, optimizers, micro_batches, "cpu", train.nullcontext(), cfg.grad_clip)
            if ema:
                ema.update()
        records.append(recorder.ops)
    assert len({repr(train.schedule(cfg, s, p)) for s, p in points}) == 3
    assert len(records[0]) > 50
    if recipe == "frontier":  # 1, 2 and 4 micro-batches: the same set of ops, each with the same constants
        assert [train.schedule(cfg, s, p)["batch_fraction"] for s, p in points] == [0.25, 0.5, 1.0]
        assert 0 < train.schedule(cfg, 13, 0.15)["extra_loss_weights"][1] < 0.25
        assert set(records[0]) == set(records[1]) == set(records[2])
    else:
        assert records[0] == records[1] == records[2]

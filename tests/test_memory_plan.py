"""The memory plan (kit/memory.py memory_plan) against the tensors a real step holds, and train.py's refusal."""

import pytest
import torch

import kernels
import train
from kit import memory, optim, runtime
from model import GPT, GPTConfig

# each MLP, MHA and GQA, and the chunked loss over 3 targets
SHAPES = [dict(mlp=mlp, n_kv_head=kv) for mlp, kv in (("relu2", 4), ("leaky_relu2", 2), ("gelu", 4), ("swiglu", 2))]
SHAPES.append(dict(mlp="relu2", n_kv_head=4, loss_chunks=4, mtp_extra=2))


def saved_bytes(model, idx, bf16):
    """Bytes of the distinct storages autograd saves in one forward, the parameters and buffers left out."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in own:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        model(idx, idx)
    return sum(seen.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_planned_activations_equal_the_bytes_autograd_saves(monkeypatch, shape, dtype):
    # the plan is for flash attention (SDPA, NKI); fp32 on CPU would otherwise take BlockCausalAttention,
    # which keeps its T x T / 2 probabilities
    monkeypatch.setattr(kernels, "CPU_BLOCK_ATTENTION_MAX_LEN", 0)
    c = GPTConfig(vocab_size=300, n_layer=2, n_embd=128, n_head=4, sequence_len=24, kernels="torch", **shape)
    idx = torch.randint(0, c.vocab_size, (3, c.sequence_len), generator=torch.Generator().manual_seed(0))
    assert saved_bytes(GPT(c), idx, dtype == "bfloat16") == memory.activation_bytes(c, 3, dtype)


@pytest.mark.parametrize("matrix_optimizer", ["muon", "adamw"])
def test_planned_weights_gradients_and_state_equal_the_tensors_after_a_step(matrix_optimizer):
    cfg, c = train.parse_args(["--n_layer=2", "--n_embd=128", "--n_head=4", "--n_kv_head=2", "--sequence_len=32",
                               "--vocab_size=300", "--kernels=torch", "--dtype=float32", "--ema_decay=0.9",
                               f"--matrix_optimizer={matrix_optimizer}", "--residual_scalars=true",
                               "--compile=false"])  # Muon's update uncompiled: the same state, no compilation
    model = GPT(c)
    optimizers = optim.make_optimizers(model, cfg, "cpu", torch.float32)
    ema = optim.WeightEMA(model, cfg.ema_decay, cfg.ema_every, cfg.ema_blend)
    idx = torch.randint(0, c.vocab_size, (2, c.sequence_len))
    model(idx, idx).backward()
    grads = sum(p.grad.nbytes for p in model.parameters())
    for o in optimizers:
        o.step()
    state = sum(t.nbytes for o in optimizers for s in o.state.values() for t in s.values() if torch.is_tensor(t))
    plan = memory.memory_plan(cfg, c, world_size=1)
    assert plan["parameters"] == sum(p.nbytes for p in model.parameters())
    assert plan["gradients"] == grads
    assert plan["optimizer state"] == state
    assert plan["EMA weights"] == sum(t.nbytes for t in ema.average)
    assert "DDP gradient buckets" not in plan
    cfg.shard_optimizer = "false"
    assert "DDP gradient buckets" in memory.memory_plan(cfg, c, world_size=2)


def test_a_config_four_times_too_large_is_refused_before_the_model_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(train, "GPT", None)  # building the model would fail differently
    # as rank 0 of 64 (the plan is made before any collective)
    monkeypatch.setattr(runtime, "start_ranks", lambda device_type: runtime.Ranks(0, 64, "cpu", "cpu", None))
    fits = ["--preset=phase2", "--device=cpu", "--dtype=bfloat16", "--device_memory_gb=24", f"--out_dir={tmp_path}"]
    cfg, c = train.parse_args(fits)
    assert sum(memory.memory_plan(cfg, c, 64).values()) <= memory.FIT_FRACTION * 24 * memory.GiB
    larger = ["--n_embd=3072", "--n_head=24"]  # 4x the parameters (head_dim 128 kept)
    with pytest.raises(ValueError, match=r"smaller --batch_size.*--shard_optimizer=true with more than one rank.*smaller model"):
        train.main(fits + larger + ["--shard_optimizer=false"])
    with pytest.raises(ValueError, match=r"smaller --batch_size.*more ranks \(each holds a smaller share.*smaller model"):
        train.main(fits + larger)  # sharded, it does not fit 64 ranks either


def test_bench_memory_plans_phase2_on_64_ranks_within_24_gib(capsys):
    import bench

    bench.main(["--memory", "--preset=phase2", "--world_size=64"])  # python bench.py --memory ...: exits 1 if it fits nowhere
    out = capsys.readouterr().out
    assert "optimizer sharded" in out and "optimizer state (largest of 64 shares)" in out
    assert any(line.split()[:5] == ["Trn2", "rank,", "LNC=2", "24.0", "GiB,"] and "fits" in line for line in out.splitlines())
    assert float(next(line for line in out.splitlines() if line.strip().startswith("total")).split()[1]) < 24 * 0.9

"""Sliding-window attention end to end: GPTConfig.window_pattern (nanochat's per-layer pattern), the --flag,
the PyTorch paths (BlockCausalAttention on CPU in fp32, SDPA with a mask elsewhere), the NKI forward and
backward kernels under the emulator (they skip the key blocks wholly outside the window), dispatch that
falls back with the reason for a window the kernels do not take, the step estimate, training and scoring.
(What the kernels skip is counted in test_attention_kernels.py's
test_kernels_skip_masked_blocks_and_keep_tensor_engine_tiles_full.)

Tolerances as in test_attention_kernels.py: the references run in float64 on the very inputs the kernels get.
"""
import logging
import math

import pytest
import torch

import bench
import kernels
import nki_emulator
import train
from kit import checkpoint
from kit.device_check import refuse_degenerate
from model import GPT, GPTConfig
from tiny import TINY_RUN

TOLERANCES = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
LSE_TOLERANCE = dict(rtol=1e-5, atol=1e-4)


def visible(seq_len, window):
    """(T, T) bool: query i sees key j when i - window <= j <= i (window None: all j <= i)."""
    distance = torch.arange(seq_len)[:, None] - torch.arange(seq_len)
    return (distance >= 0) & (distance <= (seq_len if window is None else window))


def windowed_scores(q, k, window):
    """The scaled scores q k^T / sqrt(d), -inf outside the window, kv heads repeated for their query heads."""
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    return scores.masked_fill(~visible(q.size(2), window), float("-inf"))


def windowed_reference(q, k, v, window):
    """softmax(windowed_scores) v, written out: no kernel and no SDPA."""
    v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    return torch.softmax(windowed_scores(q, k, window), dim=-1) @ v


def random_qkv(batch, n_heads, n_kv_heads, seq_len, head_dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(batch, n_heads, seq_len, head_dim)] + [(batch, n_kv_heads, seq_len, head_dim)] * 2
    return [torch.randn(shape, generator=generator).to(dtype).requires_grad_() for shape in shapes]


def check_against_reference(q, k, v, window, mode, tolerance):
    """attention(window) forward and dq, dk, dv against the float64 reference; returns the output."""
    for t in (q, k, v):
        t.grad = None
    out = kernels.attention(q, k, v, mode=mode, window=window)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    out.backward(d_out)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = windowed_reference(q64, k64, v64, window)
    expected.backward(d_out.double())
    assert out.dtype == q.dtype and out.shape == expected.shape
    torch.testing.assert_close(out.double(), expected, **tolerance)
    degenerate_ok = window == 0  # each query sees only itself: out is v, dv is d_out
    if not degenerate_ok:
        refuse_degenerate("out", out, (q, k, v, d_out))
    for name, got, want in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        assert got.dtype == q.dtype and got.shape == want.shape, name
        if not degenerate_ok:
            refuse_degenerate(name, got, (q, k, v, d_out))
        torch.testing.assert_close(got.double(), want, **tolerance, msg=lambda m: f"{name}: {m}")
    return out


@pytest.fixture
def kernel_launches(monkeypatch):
    """(kernel name, window) of each NKI kernel launched while the test runs."""
    launched, run = [], kernels._run_kernel

    def run_and_record(kernel, *args):
        launched.append((kernel.__name__, args[-1]))
        return run(kernel, *args)

    monkeypatch.setattr(kernels, "_run_kernel", run_and_record)
    return launched


# ---- the NKI kernels ----------------------------------------------------------------------------------

# The bar: T 1024, window 256 (nanochat's S at T 1024), head_dim 128 and 256 (two head-dim pieces), one kv
# head. Then awkward ones: T 640 with window 128 (edges inside odd-width key blocks), and T 2304 with window
# 2048 (a window of 17 chunks: two key groups from a first key past 0, the forward's online rescale).
NKI_CASES = [
    # B, H, Hkv, S, d, window, dtype
    (1, 2, 1, 1024, 128, 256, torch.bfloat16),
    (1, 1, 1, 1024, 256, 256, torch.float32),
    (1, 1, 1, 1024, 128, 256, torch.float32),
    (1, 2, 1, 1024, 256, 256, torch.bfloat16),
    (1, 2, 1, 640, 64, 128, torch.bfloat16),
    (1, 1, 1, 2304, 64, 2048, torch.float32),
]


@pytest.mark.parametrize("batch, n_heads, n_kv_heads, seq_len, head_dim, window, dtype", NKI_CASES,
                         ids=[f"B{b}-H{h}-kv{kv}-S{s}-d{d}-w{w}-{str(t)[6:]}" for b, h, kv, s, d, w, t in NKI_CASES])
def test_nki_windowed_attention_matches_reference(batch, n_heads, n_kv_heads, seq_len, head_dim, window, dtype,
                                                  kernel_launches):
    q, k, v = random_qkv(batch, n_heads, n_kv_heads, seq_len, head_dim, dtype)
    check_against_reference(q, k, v, window, "nki", TOLERANCES[dtype])
    assert kernel_launches == [("flash_attention_fwd_kernel", window), ("flash_attention_bwd_kernel", window)]
    with torch.no_grad():  # the logsumexp the backward reads, of the windowed scores
        _, lse = kernels._flash_attention(q, k, v, 1.0 / math.sqrt(head_dim), window)
    lse_by_query = lse.transpose(-1, -2).reshape(batch, n_heads, seq_len)
    expected = torch.logsumexp(windowed_scores(q.detach().double(), k.detach().double(), window), dim=-1)
    torch.testing.assert_close(lse_by_query.double(), expected, **LSE_TOLERANCE)


# ---- dispatch: a window the kernels do not take runs PyTorch, and says why -----------------------------


@pytest.fixture
def fresh_fallback_log(monkeypatch):
    monkeypatch.setattr(kernels, "_fallbacks_logged", set())


def test_window_off_the_tile_falls_back_to_pytorch_with_the_reason(fresh_fallback_log, caplog, kernel_launches):
    """kernels=prefer (NKI wherever it fits, on any device) with window 200: PyTorch, logged once with the
    reason, the same numbers as kernels=torch; its twin with window 256 runs the kernels."""
    q, k, v = random_qkv(1, 2, 1, 512, 64, torch.float32)
    with caplog.at_level(logging.INFO, logger="kernels"):
        for _ in range(2):
            out = check_against_reference(q, k, v, 200, "prefer", TOLERANCES[torch.float32])
    assert not kernel_launches
    [record] = caplog.records
    assert record.levelno == logging.WARNING and "window=200 is not a multiple of 128" in record.getMessage()
    assert torch.equal(out, kernels.attention(q, k, v, mode="torch", window=200))
    check_against_reference(q, k, v, 256, "prefer", TOLERANCES[torch.float32])
    assert [name for name, _ in kernel_launches] == ["flash_attention_fwd_kernel", "flash_attention_bwd_kernel"]


def test_auto_on_trainium_and_nki_mode_refuse_a_window_off_the_tile(fresh_fallback_log, caplog):
    q, k, v = (t.detach() for t in random_qkv(1, 2, 1, 256, 64, torch.float32))
    problem = kernels._attention_shape_problem(q, k, v, 100)
    assert "window=100 is not a multiple of 128" in problem
    assert kernels._attention_shape_problem(q, k, v, 128) is None
    with caplog.at_level(logging.INFO, logger="kernels"):
        assert not kernels._use_nki("attention", "auto", "neuron", problem)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    with pytest.raises(ValueError, match="window=100 is not a multiple of 128"):
        kernels.attention(q, k, v, mode="nki", window=100)
    with pytest.raises(ValueError, match="window=-1"):
        kernels.attention(q, k, v, mode="torch", window=-1)


def test_a_window_that_reaches_key_0_from_every_query_is_plain_causal(kernel_launches):
    """window >= T - 1 hides nothing: the kernels run (no multiple of 128 needed) with the whole context."""
    q, k, v = random_qkv(1, 1, 1, 256, 64, torch.float32)
    check_against_reference(q, k, v, 255, "nki", TOLERANCES[torch.float32])
    assert kernel_launches == [("flash_attention_fwd_kernel", 256), ("flash_attention_bwd_kernel", 256)]


# ---- the PyTorch paths --------------------------------------------------------------------------------

# windows around CPU_QUERY_BLOCK (64): 0 (only itself), 1, 37, 64, 100 and 200 (edges inside blocks, and a
# block whose first query's window starts before key 0 while its last one's does not); ragged T; GQA.
CPU_CASES = [(1, 2, 2, 130, 16, 0), (2, 2, 1, 200, 32, 1), (1, 4, 2, 257, 16, 37), (1, 2, 2, 256, 8, 64),
             (1, 2, 1, 300, 16, 100), (1, 1, 1, 320, 8, 200)]


@pytest.mark.parametrize("batch, n_heads, n_kv_heads, seq_len, head_dim, window", CPU_CASES,
                         ids=[f"B{b}-H{h}-kv{kv}-S{s}-d{d}-w{w}" for b, h, kv, s, d, w in CPU_CASES])
def test_cpu_block_attention_with_a_window_matches_reference(batch, n_heads, n_kv_heads, seq_len, head_dim, window):
    q, k, v = random_qkv(batch, n_heads, n_kv_heads, seq_len, head_dim, torch.float32)
    out = check_against_reference(q, k, v, window, "torch", TOLERANCES[torch.float32])
    assert out.grad_fn.__class__.__name__ == "BlockCausalAttentionBackward", "the CPU fp32 path was not taken"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sdpa_with_a_window_matches_reference(dtype, monkeypatch):
    """bf16 (and fp32 past CPU_BLOCK_ATTENTION_MAX_LEN, made small here) take SDPA with the window's mask."""
    monkeypatch.setattr(kernels, "CPU_BLOCK_ATTENTION_MAX_LEN", 64)
    q, k, v = random_qkv(2, 4, 2, 160, 32, dtype)
    out = check_against_reference(q, k, v, 50, "torch", TOLERANCES[dtype])
    assert "BlockCausal" not in out.grad_fn.__class__.__name__


# ---- the model, the flag, the estimate, training and scoring -------------------------------------------


def test_window_pattern_tiles_over_the_layers_with_the_last_one_whole():
    config = GPTConfig(sequence_len=1024, n_layer=6, window_pattern="SSSL")
    assert config.attention_windows() == [256, 256, 256, None, 256, None]
    assert [block.attn.window for block in GPT(config).blocks] == [256, 256, 256, None, 256, None]
    assert GPTConfig(sequence_len=256, n_layer=2, window_pattern="S").attention_windows() == [128, None]
    assert GPTConfig(sequence_len=2048, n_layer=3, window_pattern="SL").attention_windows() == [512, None, None]
    assert GPTConfig(sequence_len=1000, n_layer=2, window_pattern="S").short_window == 256  # rounded up to 128
    whole = GPT(GPTConfig(sequence_len=1024, n_layer=6))  # attention FLOPs: a windowed layer counts its window
    assert whole.flops_per_token() - GPT(config).flops_per_token() == 4 * 12 * config.n_head * config.head_dim * 768


@pytest.mark.parametrize("pattern", ["", "SXL", "sssl"])
def test_a_bad_window_pattern_is_refused_with_the_fix(pattern):
    with pytest.raises(ValueError, match=f"window_pattern={pattern!r} must be letters L and S"):
        GPT(GPTConfig(window_pattern=pattern))


def test_the_flag_sets_the_pattern():
    _, model_cfg = train.parse_args(["--window_pattern=SSSL"])
    assert model_cfg.window_pattern == "SSSL"


def test_model_with_windowed_nki_attention_matches_torch(kernel_launches):
    """The model hands each layer's window to the kernels: loss and every gradient as on the PyTorch path."""
    generator = torch.Generator().manual_seed(0)
    idx, targets = (torch.randint(0, 100, (1, 512), generator=generator) for _ in range(2))

    def loss_and_grads(attention_mode):
        torch.manual_seed(0)
        model = GPT(GPTConfig(sequence_len=512, vocab_size=100, n_layer=2, n_head=2, n_kv_head=1, n_embd=128,
                              window_pattern="SL", kernels=f"torch,attention:{attention_mode}"))
        for block in model.blocks:  # the zero init of output projections would cut attention off from the loss
            torch.nn.init.normal_(block.attn.c_proj.weight, std=0.1)
        loss = model(idx, targets)
        loss.backward()
        return loss.detach(), {name: p.grad for name, p in model.named_parameters()}

    loss_nki, grads_nki = loss_and_grads("nki")
    assert sorted(kernel_launches) == [("flash_attention_bwd_kernel", 128), ("flash_attention_bwd_kernel", 512),
                                       ("flash_attention_fwd_kernel", 128), ("flash_attention_fwd_kernel", 512)]
    loss_torch, grads_torch = loss_and_grads("torch")
    torch.testing.assert_close(loss_nki, loss_torch, rtol=1e-4, atol=1e-5)
    for name, grad in grads_torch.items():
        torch.testing.assert_close(grads_nki[name], grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(kernels.nki is not nki_emulator, reason="the estimates run under the emulator")
def test_step_estimate_prices_each_layer_at_its_window():
    """Three S layers of four at T 1024 (window 256: 21 of the 36 causal key chunks) cost less than four L.
    (Four query heads: one alone is DMA-bound, loading the same K, V, Q and dO whatever the window.)"""
    def attention_cost(pattern):
        model_cfg = GPTConfig(sequence_len=1024, n_layer=4, n_head=4, n_kv_head=1, n_embd=512,
                              window_pattern=pattern, kernels="torch,attention:nki")
        return bench.kernel_step_costs(model_cfg, 1024)["attention"]

    whole, windowed = attention_cost("L"), attention_cost("SSSL")
    assert 0.6 * whole < windowed < 0.9 * whole


def test_train_with_a_window_pattern_and_score_it_as_trained(tmp_path):
    """python train.py --window_pattern=... trains on CPU; load_for_eval rebuilds the windows from the
    checkpoint's config: its logits are the trained model's, and differ from the same weights unwindowed."""
    result = train.main(TINY_RUN + ["--sequence_len=256", "--batch_size=2", "--window_pattern=SL", "--max_steps=3",
                                    "--warmup_steps=1", f"--out_dir={tmp_path}", f"--data_dir={tmp_path / 'data'}"])
    assert result["final_eval"]["val_bpb"] < result["first_eval"]["val_bpb"]
    model = checkpoint.load_for_eval(str(tmp_path / "final.pt"), "cpu")
    assert model.config.window_pattern == "SL" and [b.attn.window for b in model.blocks] == [128, None]
    state = torch.load(tmp_path / "final.pt", weights_only=True)
    trained = GPT(GPTConfig(**state["model_config"]))
    unwindowed = GPT(GPTConfig(**{**state["model_config"], "window_pattern": "L"}))
    for m in (trained, unwindowed):
        m.load_state_dict(state["model"])
    idx = torch.randint(0, 257, (1, 256), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), trained(idx), rtol=0, atol=0)
        assert not torch.allclose(model(idx)[:, 200:], unwindowed(idx)[:, 200:])

"""The NKI causal flash-attention kernels, run under nki.simulate (the CPU emulator here), through the
same PyTorch op and autograd glue that training on Trainium uses (kernels.attention with mode="nki").

Tolerances. The references run in float64 on the very inputs the kernels get (bf16 cases: the bf16-rounded
values), so the differences are the kernels' own error:
- float32 inputs: every matmul in fp32 and statistics in fp32; only summation order differs from the
  reference: rtol 1e-4, atol 1e-5.
- bfloat16 inputs: P and dS are rounded to bf16 before their matmuls and outputs are bf16 (relative
  step 2^-8): rtol 2e-2, atol 2e-2 on outputs and gradients of unit scale.
- logsumexp: fp32 whatever the inputs (scores accumulate in fp32 PSUM): rtol 1e-5, atol 1e-4.
"""
import importlib.util
import logging
import math
import sys
import types

import pytest
import torch

import kernels
import nki_emulator
from kit.device_check import refuse_degenerate
from model import GPT, GPTConfig
from reference import attention_logsumexp_reference, attention_reference

TOLERANCES = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
LSE_TOLERANCE = dict(rtol=1e-5, atol=1e-4)


@pytest.fixture
def kernel_launches(monkeypatch):
    """Names of the NKI kernels launched while the test runs."""
    launched, run = [], kernels._run_kernel

    def run_and_record(kernel, *args):
        launched.append(kernel.__name__)
        return run(kernel, *args)

    monkeypatch.setattr(kernels, "_run_kernel", run_and_record)
    return launched


def random_qkv(batch, n_heads, n_kv_heads, seq_len, head_dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(batch, n_heads, seq_len, head_dim)] + [(batch, n_kv_heads, seq_len, head_dim)] * 2
    return [torch.randn(shape, generator=generator).to(dtype).requires_grad_() for shape in shapes]


# Every listed value of each dimension appears, in mixed combinations: S 128/256/384/640/1024/2048/2176
# (384 and 640: 128 x an odd number, a key block narrower than 512; 1024: two full blocks; 2048: a full
# group of 4 blocks; 2176: past one group, so the forward's online rescale runs), d 64/128/256 (256: two
# head-dim pieces), heads (4,4)/(4,1)/(8,2)/(2,1)/(1,1) (one kv head, GQA 4:1), B 1/2/3, both dtypes.
# The S >= 2048 cases take ~1-2 s each; the others a fraction of that.
CASES = [
    # B, H, Hkv, S, d, dtype
    (1, 4, 4, 128, 64, torch.float32),
    (3, 4, 1, 256, 128, torch.bfloat16),
    (2, 8, 2, 384, 64, torch.float32),
    (1, 4, 1, 384, 256, torch.bfloat16),
    (1, 2, 1, 640, 256, torch.float32),
    (2, 4, 4, 256, 64, torch.bfloat16),
    (1, 2, 2, 1024, 128, torch.bfloat16),
    (1, 1, 1, 2048, 128, torch.bfloat16),
    (1, 1, 1, 2176, 64, torch.float32),
]


@pytest.mark.parametrize("batch, n_heads, n_kv_heads, seq_len, head_dim, dtype", CASES,
                         ids=[f"B{b}-H{h}-kv{kv}-S{s}-d{d}-{str(t)[6:]}" for b, h, kv, s, d, t in CASES])
def test_attention_matches_reference(batch, n_heads, n_kv_heads, seq_len, head_dim, dtype):
    q, k, v = random_qkv(batch, n_heads, n_kv_heads, seq_len, head_dim, dtype)
    out = kernels.attention(q, k, v, mode="nki")
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out.backward(d_out)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = attention_reference(q64, k64, v64)
    expected.backward(d_out.double())
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[dtype])
    refuse_degenerate("out", out, (q, k, v, d_out))  # whatever the tolerance: never zeros, a constant or an input
    for name, got, want in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        assert got.dtype == dtype and got.shape == want.shape, name
        refuse_degenerate(name, got, (q, k, v, d_out))
        torch.testing.assert_close(got.double(), want, **TOLERANCES[dtype], msg=lambda m: f"{name}: {m}")

    with torch.no_grad():  # the logsumexp the forward op hands to the backward: lse[b, h, p, t] is query t*128+p
        _, lse = kernels._flash_attention(q, k, v, 1.0 / math.sqrt(head_dim), seq_len)
    assert lse.dtype == torch.float32 and lse.shape == (batch, n_heads, 128, seq_len // 128)
    lse_by_query = lse.transpose(-1, -2).reshape(batch, n_heads, seq_len)
    torch.testing.assert_close(lse_by_query.double(), attention_logsumexp_reference(q64, k64), **LSE_TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_whose_scores_are_all_very_negative_stay_exact(dtype):
    """Every query scores every key it sees near -128 (scaled). ScalarE's reduce registers start a reduction
    from zero (nki.isa activation_reduce: "first resets those registers to zero"; the emulator does too), so
    a row max taken there would be 0, exp(-128) underflows in fp32 and the row sum is 0: NaN. S = 640 puts a
    second key block (where a max went to ScalarE) after the first."""
    generator = torch.Generator().manual_seed(0)
    seq_len, head_dim = 640, 64
    q = torch.full((1, 1, seq_len, head_dim), 4.0)
    k = -4.0 + 0.1 * torch.randn(1, 1, seq_len, head_dim, generator=generator)
    v = torch.randn(1, 1, seq_len, head_dim, generator=generator)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out = kernels.attention(q, k, v, mode="nki")
    d_out = torch.randn(out.shape, generator=generator).to(dtype)
    out.backward(d_out)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = attention_reference(q64, k64, v64)
    expected.backward(d_out.double())
    assert expected.isfinite().all() and (q64 @ k64.mT / 8).max() < -100
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[dtype])
    for name, got, want in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        torch.testing.assert_close(got.double(), want, **TOLERANCES[dtype], msg=lambda m: f"{name}: {m}")


def test_one_logical_core_launch_gives_the_same_result(monkeypatch):
    """The tests run kernel[2] (the Trn2 default, programs split the (batch, kv head) pairs); kernel[1]
    must agree bit for bit, including an odd number of pairs."""
    q, k, v = random_qkv(3, 2, 1, 256, 64, torch.bfloat16)
    two_cores = kernels.attention(q, k, v, mode="nki")
    two_cores.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    for t in (q, k, v):
        t.grad = None
    one_core = kernels.attention(q, k, v, mode="nki")
    one_core.sum().backward()
    assert torch.equal(one_core, two_cores)
    for before, t in zip(grads, (q, k, v)):
        assert torch.equal(t.grad, before)


def test_ops_pass_torch_library_opcheck():
    """Schema, fake (meta) implementations and autograd registration of both ops, as torch.compile
    relies on them; v as the model passes it, a (B, Hkv, T, D) view of a (B, T, Hkv, D) tensor."""
    q, k, _ = random_qkv(1, 2, 1, 128, 64, torch.float32)
    v = torch.randn(1, 128, 1, 64).transpose(1, 2).requires_grad_()
    args = (q, k, v, 0.125, 128)
    torch.library.opcheck(kernels._flash_attention, args)
    out, lse = kernels._flash_attention(*args)
    backward_op = torch.ops.nanogpt_trn.flash_attention_bwd
    torch.library.opcheck(backward_op, (q.detach(), k.detach(), v.detach(), out.detach(),
                                        torch.randn_like(out), lse, 0.125, 128))


@pytest.mark.skipif(kernels.nki is not nki_emulator, reason="counts what the emulator runs")
@pytest.mark.parametrize("window", [1024, 256], ids=["causal", "window256"])
def test_kernels_skip_masked_blocks_and_keep_tensor_engine_tiles_full(window):
    """What the kernels issue, counted by the emulator (d = 64 tells the matmul kinds apart): scores only
    for keys at or below the diagonal and in the query tile's window, in blocks of up to 512; the causal
    mask as one 128x128x128 matmul per query tile, the window's edge as one per tile whose window starts
    past key 0, and nothing else (the only affine_selects build their operands); every matmul 128 wide on
    the stationary side; transposes only where a contraction needs keys on the partitions."""
    head_dim, seq_len = 64, 1024
    n_tiles, reach = seq_len // 128, window // 128
    # (query tile, key chunk) pairs at or below the diagonal, in the window: 36 causal, 21 in a 256 window
    visible_chunks = sum(min(t + 1, reach + 1) for t in range(n_tiles))
    masks = n_tiles + max(0, n_tiles - reach)  # a diagonal per tile, an edge per tile from tile `reach` on
    q, k, v = (t.detach() for t in random_qkv(1, 1, 1, seq_len, head_dim, torch.bfloat16))

    def tally(counts):
        shapes = [(kk, m, n) for kk, m, n, _ in counts.matmul_shapes]
        assert all(m == 128 for _, m, _ in shapes) and max(n for _, _, n in shapes) == min(512, window + 128)
        assert counts.by_instruction["affine_select"] == (2 if window == seq_len else 3)
        return (sum(n for kk, _, n in shapes if kk == head_dim), shapes.count((128, 128, 128)),
                shapes.count((128, 128, head_dim)), len(counts.transposes))

    with nki_emulator.counting() as counts:
        out, lse = nki_emulator.simulate(kernels.flash_attention_fwd_kernel)(q, k, v, 0.125, window)
    # score columns, mask matmuls, P @ V chunk matmuls, P transposes + q and k turned into columns
    assert tally(counts) == (visible_chunks * 128, masks, visible_chunks, visible_chunks + 2 * n_tiles)

    with nki_emulator.counting() as counts:
        nki_emulator.simulate(kernels.flash_attention_bwd_kernel)(q, k, v, out, torch.randn_like(out), lse, 0.125,
                                                                 window)
    # scores and dP columns, mask matmuls, dV/dK/dQ chunk matmuls, dS transposes + 4 layout changes per head
    assert tally(counts) == (2 * visible_chunks * 128, masks, 3 * visible_chunks, visible_chunks + 4 * n_tiles)


# ---- the model with kernels="nki" against kernels="torch" --------------------------------------------


def small_config(**overrides):
    base = dict(sequence_len=128, vocab_size=100, n_layer=2, n_head=4, n_kv_head=2, n_embd=256)
    return GPTConfig(**{**base, **overrides})


def loss_and_grads(config, idx, targets, autocast):
    torch.manual_seed(0)
    model = GPT(config)
    for block in model.blocks:  # the zero init of output projections would cut attention off from the loss
        torch.nn.init.normal_(block.attn.c_proj.weight, std=0.1)
        torch.nn.init.normal_(block.mlp.c_proj.weight, std=0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(idx, targets)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("autocast, tolerance", [(False, dict(rtol=1e-4, atol=1e-5)),
                                                 (True, dict(rtol=5e-2, atol=5e-3))], ids=["fp32", "bf16-autocast"])
def test_model_with_nki_kernels_matches_torch(autocast, tolerance, kernel_launches):
    """Same loss and gradients of every parameter, in fp32 and under bf16 autocast (where both paths
    round differently: the torch path runs SDPA in bf16 too)."""
    generator = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 100, (2, 128), generator=generator)
    targets = torch.randint(0, 100, (2, 128), generator=generator)
    loss_nki, grads_nki = loss_and_grads(small_config(kernels="nki"), idx, targets, autocast)
    attention_launches = sorted(name for name in kernel_launches if "attention" in name)
    assert attention_launches == ["flash_attention_bwd_kernel"] * 2 + ["flash_attention_fwd_kernel"] * 2
    loss_torch, grads_torch = loss_and_grads(small_config(kernels="torch"), idx, targets, autocast)
    torch.testing.assert_close(loss_nki, loss_torch, **tolerance)
    for name, grad in grads_torch.items():
        assert grad.abs().max() > 0, f"{name} gets no gradient: the test would not see attention errors"
        torch.testing.assert_close(grads_nki[name], grad, **tolerance, msg=lambda m: f"{name}: {m}")


# ---- dispatch: which path runs, and the errors and logs when NKI cannot ---------------------------------


@pytest.fixture
def fresh_fallback_log(monkeypatch):
    monkeypatch.setattr(kernels, "_fallbacks_logged", set())


def test_torch_mode_and_auto_off_trainium_never_run_the_kernel(fresh_fallback_log, caplog, kernel_launches):
    q, k, v = random_qkv(1, 4, 2, 128, 64, torch.float32)
    expected = attention_reference(*(t.detach().double() for t in (q, k, v)))
    with caplog.at_level(logging.INFO, logger="kernels"):
        torch.testing.assert_close(kernels.attention(q, k, v, mode="torch").double(), expected, **TOLERANCES[torch.float32])
        assert not caplog.records
        for _ in range(2):
            torch.testing.assert_close(kernels.attention(q, k, v, mode="auto").double(), expected, **TOLERANCES[torch.float32])
    assert not kernel_launches
    assert len(caplog.records) == 1 and "not on a Trainium 'neuron' device" in caplog.records[0].getMessage()


def test_auto_on_trainium_falls_back_on_shapes_with_one_warning(fresh_fallback_log, caplog):
    q, k, v = random_qkv(1, 2, 2, 100, 64, torch.float32)
    problem = kernels._attention_shape_problem(q, k, v)
    assert "multiple of 128" in problem
    with caplog.at_level(logging.INFO, logger="kernels"):
        assert not kernels._use_nki("attention", "auto", "neuron", problem)
        assert not kernels._use_nki("attention", "auto", "neuron", problem)
        assert kernels._use_nki("attention", "auto", "neuron", None)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


@pytest.mark.parametrize("shape, message", [((1, 2, 100, 64), "multiple of 128"),
                                            ((1, 2, 128, 384), "head_dim=384 is not one the kernels take"),
                                            ((1, 1, 4096, 128), "over what the backward kernel's SBUF plan holds")])
def test_nki_mode_refuses_shapes_the_kernels_cannot_take(shape, message):
    q = torch.randn(shape)
    with pytest.raises(ValueError, match=message):
        kernels.attention(q, q, q, mode="nki")


def test_nki_mode_without_nki_says_what_to_do(monkeypatch):
    monkeypatch.setattr(kernels, "nki", None)
    monkeypatch.setattr(kernels, "NKI_IMPORT_ERROR", "ModuleNotFoundError: No module named 'nki'")
    q = torch.randn(1, 2, 128, 64)
    with pytest.raises(RuntimeError, match="not usable.*kernels='auto' or kernels='torch'"):
        kernels.attention(q, q, q, mode="nki")
    assert torch.equal(kernels.attention(q, q, q, mode="auto"), kernels.attention(q, q, q, mode="torch"))


@pytest.mark.parametrize("version, refused", [("0.3.0", True), ("0.2.0+1a2b3c", True), ("0.4.0b4+2581.ge7", False),
                                              ("0.5.0+1f0e", False), ("0.6.0", False), ("1.0", False), ("", False)])
def test_nki_older_than_0_4_is_refused(version, refused):
    problem = kernels._nki_version_problem(version)
    assert (problem is not None) == refused
    if refused:
        assert f"NKI {version} is older than 0.4" in problem and "Neuron SDK 2.30" in problem


def test_kernels_imported_with_nki_0_3_say_which_version_to_install(monkeypatch):
    """The check at import: with a fake NKI 0.3.0 importable, kernels.py (loaded afresh under another
    name) has no NKI, and kernels='nki' says which NKI it found and what to install."""
    fake = types.ModuleType("nki")
    fake.__version__ = "0.3.0"
    fake.isa, fake.language = types.ModuleType("nki.isa"), types.ModuleType("nki.language")
    monkeypatch.setitem(sys.modules, "nki", fake)
    monkeypatch.setitem(sys.modules, "nki.isa", fake.isa)
    monkeypatch.setitem(sys.modules, "nki.language", fake.language)
    spec = importlib.util.spec_from_file_location("kernels_with_nki_0_3", kernels.__file__)
    old_nki_kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old_nki_kernels)
    assert old_nki_kernels.nki is None
    q = torch.randn(1, 2, 128, 64)
    with pytest.raises(RuntimeError, match=r"NKI 0\.3\.0 is older than 0\.4.*install Neuron SDK 2\.30 or newer"):
        old_nki_kernels.attention(q, q, q, mode="nki")


def test_unknown_mode_is_refused():
    q = torch.randn(1, 2, 128, 64)
    with pytest.raises(ValueError, match="attention: mode='fast' is not a mode; pass one of auto, nki"):
        kernels.attention(q, q, q, mode="fast")


@pytest.mark.parametrize("overrides, message", [
    ({"kernels": "fast"}, "--kernels=fast: 'fast' is not a mode"),
    ({"kernels": "nki", "sequence_len": 200}, "sequence_len to be a multiple of 128"),
    ({"kernels": "nki", "n_embd": 1536, "n_head": 4, "n_kv_head": 4}, "head_dim <= 256"),
])
def test_config_refuses_kernel_settings_that_cannot_work(overrides, message):
    with pytest.raises(ValueError, match=message):
        GPT(small_config(**overrides))


# T around CPU_QUERY_BLOCK (64): one token, a partial single block, one block exactly, a ragged last
# block, several blocks; and grouped-query heads, which the CPU path expands before its blocks.
CPU_CASES = [(1, 2, 2, 1, 16), (2, 2, 1, 37, 32), (1, 4, 4, 64, 64), (2, 4, 2, 130, 64), (1, 2, 2, 256, 8)]


@pytest.mark.parametrize("batch, n_heads, n_kv_heads, seq_len, head_dim", CPU_CASES,
                         ids=[f"B{b}-H{h}-kv{kv}-S{s}-d{d}" for b, h, kv, s, d in CPU_CASES])
def test_cpu_block_causal_attention_matches_reference(batch, n_heads, n_kv_heads, seq_len, head_dim):
    """The fp32 CPU path (kernels.BlockCausalAttention behind kernels.attention): forward and all three
    gradients against the float64 reference."""
    q, k, v = random_qkv(batch, n_heads, n_kv_heads, seq_len, head_dim, torch.float32)
    out = kernels.attention(q, k, v, mode="torch")
    assert out.grad_fn.__class__.__name__ == "BlockCausalAttentionBackward", "the CPU fp32 path was not taken"
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(d_out)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = attention_reference(q64, k64, v64)
    expected.backward(d_out.double())
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[torch.float32])
    for name, got, want in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        assert got.shape == want.shape, name
        torch.testing.assert_close(got.double(), want, **TOLERANCES[torch.float32], msg=lambda m: f"{name}: {m}")


def test_cpu_attention_keeps_sdpa_for_bf16_and_long_contexts():
    q, k, v = random_qkv(1, 2, 2, 8, 16, torch.bfloat16)
    assert "BlockCausal" not in kernels.attention(q, k, v, mode="torch").grad_fn.__class__.__name__
    long = kernels.CPU_BLOCK_ATTENTION_MAX_LEN + 1
    q, k, v = (t.detach().requires_grad_() for t in random_qkv(1, 1, 1, long, 8, torch.float32))
    assert "BlockCausal" not in kernels.attention(q, k, v, mode="torch").grad_fn.__class__.__name__


# One small bf16 case of the reference tests above per op, for the kill matrix (tests/test_kill_matrix.py):
# KernelOp.tests names this file
KILL_MATRIX = {"attention": [
    ("attention test", lambda: test_attention_matches_reference(1, 4, 1, 384, 32, torch.bfloat16))]}

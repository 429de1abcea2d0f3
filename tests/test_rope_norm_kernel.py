"""The RoPE + QK-norm kernels (kernels.rope_norm, mode="nki"), run under nki.simulate (the CPU emulator here)
through the PyTorch op and autograd glue training uses, against float64 PyTorch math on the very inputs the
kernels get. Tolerances as in test_mlp_norm_kernels.py: 1e-5 in fp32, 2e-2 in bf16 (rounded intermediates,
as the model's PyTorch rotary rounds them)."""
import sys

import pytest
import torch

import nki_emulator
from kernels import rope_norm
from model import rotary_tables

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
emulated = pytest.mark.skipif(sys.modules["nki"] is not nki_emulator, reason="counts instructions in the emulator")


def reference(x, cos, sin, n_heads, eps=1e-6):
    """(B, T, H*D) -> (B, H, T, D): the half-split rotation, then x / sqrt(mean(x^2) + eps) per head."""
    batch, seq_len, width = x.shape
    heads = x.view(batch, seq_len, n_heads, width // n_heads).transpose(1, 2)
    half = width // n_heads // 2
    x1, x2 = heads[..., :half], heads[..., half:]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rotated * torch.rsqrt(rotated.square().mean(-1, keepdim=True) + eps)


# T 200 = 128 + 72 (a partial tile, one token per partition) and 640 = 512 + 128 (a (128, 4) block, then a
# tile); head_dim 64, 128, 256 and 2048 (kernels.ROPE_WIDE_HEAD); a GQA model's k (one head) beside its q (four).
CASES = [
    # batch, T, heads, head_dim, dtype
    (2, 200, 2, 64, torch.bfloat16),
    (1, 640, 1, 256, torch.bfloat16),
    (1, 512, 4, 64, torch.float32),
    (1, 512, 1, 64, torch.float32),
    (1, 130, 1, 128, torch.float32),
    (1, 1536, 1, 2048, torch.float32),  # the widest head: one token a partition, else the pipelines overflow SBUF
]


@pytest.mark.parametrize("batch, seq_len, n_heads, head_dim, dtype", CASES,
                         ids=[f"{b}x{t}-{h}x{d}-{str(dt)[6:]}" for b, t, h, d, dt in CASES])
def test_rope_norm_matches_reference(batch, seq_len, n_heads, head_dim, dtype):
    generator = torch.Generator().manual_seed(0)
    cos, sin = rotary_tables(seq_len, head_dim, 10000.0)
    x = (3 * torch.randn(batch, seq_len, n_heads * head_dim, generator=generator)).to(dtype).requires_grad_()
    y = rope_norm(x, cos, sin, n_heads, mode="nki")
    assert y.shape == (batch, n_heads, seq_len, head_dim) and y.dtype == dtype and y.is_contiguous()
    dy = torch.randn(y.shape, generator=generator).to(dtype)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    tables = cos.to(dtype).double(), sin.to(dtype).double()  # the tables in x's dtype, as the model casts them
    expected = reference(x64, *tables, n_heads)
    expected.backward(dy.double())
    tol = TOLERANCE[dtype]
    for name, got, want in (("y", y, expected), ("dx", x.grad, x64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item(), msg=name)


def test_rope_norm_fallback_is_the_models_rotary_then_rms_norm():
    cos, sin = rotary_tables(24, 32, 10000.0)
    x = torch.randn(2, 24, 3 * 32, dtype=torch.bfloat16)
    with nki_emulator.counting() as counts:  # auto: PyTorch here (not a neuron device)
        y = rope_norm(x, cos, sin, 3, mode="auto")
    assert sum(counts.instructions.values()) == 0
    x1, x2 = x.view(2, 24, 3, 32).transpose(1, 2).chunk(2, dim=-1)  # model.py's former apply_rotary, then norm
    cos, sin = cos.bfloat16(), sin.bfloat16()
    heads = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    assert torch.equal(y, torch.nn.functional.rms_norm(heads.float(), (32,), eps=1e-6).bfloat16())
    torch.testing.assert_close(y.float(), reference(x.float(), cos.float(), sin.float(), 3),
                               rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="rotary tables"):
        rope_norm(x, cos[:20], sin[:20], 3, mode="nki")


@emulated
def test_rope_norm_makes_one_pass_over_the_data():
    """Forward: x read, y written, the tables once per step; backward: x and dy read, dx written."""
    batch, seq_len, n_heads, head_dim = 1, 512, 2, 64
    cos, sin = rotary_tables(seq_len, head_dim, 10000.0)
    x = torch.randn(batch, seq_len, n_heads * head_dim, dtype=torch.bfloat16, requires_grad=True)
    with nki_emulator.counting() as forward:
        y = rope_norm(x, cos, sin, n_heads, mode="nki")
    with nki_emulator.counting() as backward:
        y.float().sum().backward()
    tables = 2 * seq_len * head_dim // 2 * 2
    assert forward.dma_bytes == 2 * x.numel() * 2 + tables
    assert backward.dma_bytes == 3 * x.numel() * 2 + tables
    assert forward.matmul_flops == backward.matmul_flops == 0


# One small bf16 case of the reference tests above, for the kill matrix (tests/test_kill_matrix.py): KernelOp.tests
# names this file
KILL_MATRIX = {"rope_norm": [
    ("rope_norm test", lambda: test_rope_norm_matches_reference(2, 200, 2, 64, torch.bfloat16))]}

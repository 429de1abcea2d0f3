"""The NKI MLP and RMSNorm kernels (and the residual add fused with RMSNorm), run under nki.simulate (the
CPU emulator here), through the same PyTorch op and autograd glue that training on Trainium uses
(kernels.mlp / kernels.rms_norm / kernels.add_rms_norm, mode="nki").

Tolerances. The references run in float64 on the very inputs the kernels get (bf16 cases: the bf16-rounded
values), so the differences are the kernels' own error. Values are compared against the largest reference
value (|got - want| <= tol * (|want| + max|want|)), since weight gradients sum over tokens and grow with N:
- float32: every matmul and every elementwise op in fp32; only summation order differs: tol 1e-5
  (observed: under 1e-6).
- bfloat16: matmul inputs bf16 (the activation and its gradient are rounded to bf16 before the matmuls
  that take them) and outputs bf16 (relative step 2^-8): tol 2e-2 (observed: about 5e-3).
"""
import sys

import pytest
import torch
import torch.nn as nn

import kernels
import nki_emulator
from kernels import add_rms_norm, mlp, rms_norm
from kit.device_check import refuse_degenerate
from model import GPT, GPTConfig
from reference import mlp_reference, rms_norm_reference

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
emulated = pytest.mark.skipif(sys.modules["nki"] is not nki_emulator, reason="counts instructions in the emulator")


def assert_close(got, want, dtype, name, inputs=()):
    """got against the float64 reference: |got - want| <= tol * (|want| + max |want|) everywhere
    (torch.testing.assert_close's rule with atol = tol * max |want|, in fewer passes: the weight gradients at
    d=1536, hidden=6144 are 9.4M values); and never zeros, a constant or one of `inputs`, whatever the tolerance."""
    assert got.dtype == dtype and got.shape == want.shape, name
    refuse_degenerate(name, got, inputs)
    tol = TOLERANCE[dtype]
    magnitude = want.abs()
    excess = ((got.double() - want).abs_() - tol * (magnitude + magnitude.max())).max().item()
    assert excess <= 0, f"{name}: off by {excess:.3g} more than {tol} x (|want| + {magnitude.max().item():.3g})"


def random_mlp(n_tokens, dim, hidden, activation, dtype, seed=0):
    """x as (2, n_tokens / 2, dim) and nn.Linear-layout weights scaled so that every activation is O(1)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [((2, n_tokens // 2, dim), 1.0), ((hidden, dim), dim ** -0.5), ((dim, hidden), hidden ** -0.5)]
    if activation == "swiglu":
        shapes.append(((hidden, dim), dim ** -0.5))
    tensors = [(torch.randn(shape, generator=generator) * scale).to(dtype).requires_grad_() for shape, scale in shapes]
    return tensors + [None] * (4 - len(tensors))


def check_mlp(x, w_up, w_down, w_gate, activation, dtype):
    """Forward and every gradient of the NKI MLP against the float64 reference on the same inputs."""
    out = mlp(x, w_up, w_down, activation, w_gate, mode="nki")
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(d_out)
    leaves = [t for t in (x, w_up, w_down, w_gate) if t is not None]
    leaves64 = [t.detach().to(dtype).double().requires_grad_() for t in leaves]
    expected = mlp_reference(*leaves64[:3], activation, *leaves64[3:])
    expected.backward(d_out.double())
    assert_close(out, expected, dtype, "y", leaves + [d_out])
    for name, leaf, leaf64 in zip(("dx", "dw_up", "dw_down", "dw_gate"), leaves, leaves64):
        assert_close(leaf.grad.to(dtype), leaf64.grad, dtype, name, leaves + [d_out])


# Every listed value appears, in mixed combinations: d 128/256/384, hidden 512/1024/1536, N 128/256/640
# (640: five 128-token tiles, three for one program, two for the other), each activation in both dtypes;
# each case takes about 0.3-1 s on the emulator, and runs each kernel's hidden units in one chunk.
# Then the widths people train, K82s4's d=1024, hidden=4096 and phase2's d=1536, hidden=6144 (a few
# seconds each), where the hidden units go in chunks (kernels._mlp_chunk_tiles; here forward 1, 4, 3 and 5
# chunks, backward 3, 8, 6 and 10: first, middle and last partial sums), each activation once, both dtypes
# at both widths. 128 tokens leave the second core of kernel[2] without any (it writes zero
# weight-gradient shares); 130 give it a 2-token tile. Last, 1100 tokens at d=640: the backward's software
# pipeline crosses from block to block of 256 tokens (3 on one core, the last of 128; 2 on the other, the last
# ragged), in one chunk and, SwiGLU in fp32, in two.
MLP_CASES = [
    # N, d, hidden, activation, dtype
    (640, 384, 512, "swiglu", torch.bfloat16),
    (128, 128, 512, "relu2", torch.float32),
    (256, 256, 1024, "gelu", torch.float32),
    (640, 128, 1536, "relu2", torch.bfloat16),
    (128, 384, 512, "gelu", torch.bfloat16),
    (256, 128, 1024, "swiglu", torch.float32),
    (640, 256, 512, "gelu", torch.float32),
    (256, 384, 1024, "relu2", torch.bfloat16),
    (128, 256, 1536, "swiglu", torch.float32),
    (640, 256, 512, "leaky_relu2", torch.bfloat16),
    (128, 384, 1024, "leaky_relu2", torch.float32),
    (128, 1024, 4096, "leaky_relu2", torch.bfloat16),
    (130, 1024, 4096, "swiglu", torch.float32),
    (128, 1536, 6144, "relu2", torch.bfloat16),
    (130, 1536, 6144, "gelu", torch.float32),
    (1100, 640, 512, "relu2", torch.bfloat16),
    (1100, 640, 2048, "swiglu", torch.float32),
]


@pytest.mark.parametrize("n_tokens, dim, hidden, activation, dtype", MLP_CASES,
                         ids=[f"N{n}-d{d}-h{h}-{a}-{str(t)[6:]}" for n, d, h, a, t in MLP_CASES])
def test_mlp_matches_reference(n_tokens, dim, hidden, activation, dtype):
    check_mlp(*random_mlp(n_tokens, dim, hidden, activation, dtype), activation, dtype)


def test_mlp_forward_backward_and_scoring_take_the_same_shapes():
    """One shape rule: wherever the MLP's NKI path is allowed at all, both kernels have an SBUF plan (a
    chunk of at least one hidden tile), so training, and scoring without gradients, run the same kernels.
    A width the backward cannot take is refused without gradients too."""
    for dim in range(128, 2048 + 1, 128):
        for gated in (False, True):
            for itemsize in (2, 4):
                for backward in (False, True):
                    assert kernels._mlp_chunk_tiles(dim, 128, gated, itemsize, backward) == 1, (dim, gated, itemsize)
    x = torch.zeros(1, 128, 2176)
    for grad in (False, True):
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match="2048"):
            mlp(x, torch.zeros(512, 2176, requires_grad=grad), torch.zeros(2176, 512), "relu2", mode="nki")


def test_mlp_takes_ragged_token_counts_and_one_logical_core(monkeypatch):
    """200 tokens: a partial 72-token tile at the end; kernel[1]: one program does all the tokens."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    check_mlp(*random_mlp(200, 128, 512, "swiglu", torch.bfloat16), "swiglu", torch.bfloat16)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    check_mlp(*random_mlp(200, 256, 512, "gelu", torch.float32), "gelu", torch.float32)


def test_mlp_under_autocast_multiplies_in_bf16_and_returns_fp32_weight_grads():
    """As in the model: fp32 activations and weights, bf16 autocast; the op casts like F.linear does."""
    x, w_up, w_down, _ = random_mlp(256, 128, 512, "relu2", torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mlp(x, w_up, w_down, "relu2", mode="nki")
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert all(t.grad.dtype == torch.float32 for t in (x, w_up, w_down))
    leaves64 = [t.detach().to(torch.bfloat16).double().requires_grad_() for t in (x, w_up, w_down)]
    expected = mlp_reference(*leaves64, "relu2")
    expected.sum().backward()
    assert_close(out, expected, torch.bfloat16, "y")
    for name, leaf, leaf64 in zip(("dx", "dw_up", "dw_down"), (x, w_up, w_down), leaves64):
        assert_close(leaf.grad.to(torch.bfloat16), leaf64.grad, torch.bfloat16, name)


@emulated
def test_mlp_hidden_activation_stays_on_chip():
    """HBM traffic is x, the weights (each core loads them once) and y; only with gradients on does the
    forward also write the pre-activation, once. Every matmul contracts a full 128 partitions, moving
    operands are up to 512 wide, and no matmul work is wasted."""
    n_tokens, dim, hidden, programs = 1024, 128, 512, 2
    x, w_up, w_down, _ = random_mlp(n_tokens, dim, hidden, "relu2", torch.bfloat16)
    for training in (False, True):
        with torch.set_grad_enabled(training), nki_emulator.counting() as counts:
            mlp(x, w_up, w_down, "relu2", mode="nki")
        saved = n_tokens * hidden if training else 0
        assert counts.dma_bytes == 2 * (2 * n_tokens * dim + programs * 2 * dim * hidden + saved)
        assert counts.matmul_flops == 2 * 2 * n_tokens * dim * hidden
        assert {k for k, *_ in counts.matmul_shapes} == {128}
        assert max(n for _, _, n, _ in counts.matmul_shapes) == 512


def test_leaky_relu2_torch_path_matches_reference():
    """The PyTorch fallback of leaky_relu2, forward and gradients, on both sides of zero."""
    x, w_up, w_down, _ = random_mlp(64, 32, 96, "leaky_relu2", torch.float64)
    out = mlp(x, w_up, w_down, "leaky_relu2", mode="torch")
    out.square().sum().backward()
    leaves = [t.detach().clone().requires_grad_() for t in (x, w_up, w_down)]
    expected = mlp_reference(*leaves, "leaky_relu2")
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected)
    for got, want in zip((x, w_up, w_down), leaves):
        torch.testing.assert_close(got.grad, want.grad)


def test_mlp_shape_limits():
    x, w_up, w_down, _ = random_mlp(256, 192, 512, "relu2", torch.float32)
    with pytest.raises(ValueError, match="multiples of 128"):
        mlp(x, w_up, w_down, "relu2", mode="nki")
    with nki_emulator.counting() as counts:  # auto falls back to PyTorch (here: not on a neuron device)
        y = mlp(x, w_up, w_down, "relu2", mode="auto")
    assert sum(counts.instructions.values()) == 0
    torch.testing.assert_close(y, mlp_reference(x, w_up, w_down, "relu2"))
    with pytest.raises(ValueError, match="2048"):  # dx of 128 tokens would not fit 4 PSUM banks
        mlp(torch.zeros(1, 128, 2176), torch.zeros(512, 2176), torch.zeros(2176, 512), "relu2", mode="nki")
    with pytest.raises(ValueError, match="w_gate"):
        mlp(x, w_up, w_down, "swiglu", mode="torch")


# RMSNorm: d 64 (a head, for QK-norm) to 384, N ragged and not, with and without a weight, both dtypes.
NORM_CASES = [
    # shape, weighted, dtype
    ((2, 320, 384), True, torch.float32),
    ((128, 128), False, torch.bfloat16),
    ((2, 128, 256), True, torch.bfloat16),
    ((2, 4, 25, 64), False, torch.float32),
    ((5, 20, 384), True, torch.bfloat16),
    ((640, 128), False, torch.float32),
]


@pytest.mark.parametrize("shape, weighted, dtype", NORM_CASES,
                         ids=[f"{'x'.join(map(str, s))}-{'w' if w else 'now'}-{str(t)[6:]}" for s, w, t in NORM_CASES])
def test_rms_norm_matches_reference(shape, weighted, dtype):
    generator = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=generator)).to(dtype).requires_grad_()
    weight = (1 + 0.5 * torch.randn(shape[-1], generator=generator)).requires_grad_() if weighted else None
    out = rms_norm(x, weight, mode="nki")
    d_out = torch.randn(shape, generator=generator).to(dtype)
    out.backward(d_out)
    x64 = x.detach().double().requires_grad_()
    weight64 = weight.detach().double().requires_grad_() if weighted else None
    expected = rms_norm_reference(x64, weight64)
    expected.backward(d_out.double())
    inputs = [x, weight, d_out]
    assert_close(out, expected, dtype, "y", inputs)
    assert_close(x.grad, x64.grad, dtype, "dx", inputs)
    if weighted:
        assert_close(weight.grad, weight64.grad, torch.float32, "dweight", inputs)


@emulated
def test_rms_norm_makes_one_pass_over_the_data():
    """Forward: read x, write y; backward: read x and dy, write dx (plus the weight and its gradient)."""
    rows, dim, programs = 512, 256, 2
    x = torch.randn(rows, dim, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(dim, requires_grad=True)
    with nki_emulator.counting() as forward:
        out = rms_norm(x, weight, mode="nki")
    with nki_emulator.counting() as backward:
        out.sum().backward()
    weight_bytes = programs * dim * 4
    assert forward.dma_bytes == 2 * rows * dim * 2 + weight_bytes
    assert backward.dma_bytes == 3 * rows * dim * 2 + 2 * weight_bytes


def test_rms_norm_shape_limits():
    with pytest.raises(ValueError, match="2048"):
        rms_norm(torch.zeros(4, 4096), mode="nki")
    x = torch.randn(4, 4096)
    torch.testing.assert_close(rms_norm(x, mode="auto"), rms_norm_reference(x))


# Residual add + RMSNorm: the model's mix (fp32 stream, bf16 branch) and one dtype throughout; d 64 to 384,
# rows ragged (200 = 128 + 72; 25 per sequence) and not; with and without a gradient reaching the sum.
ADD_NORM_CASES = [
    # shape, stream dtype, branch dtype, gradient of the sum
    ((2, 100, 256), torch.float32, torch.bfloat16, True),
    ((3, 128, 64), torch.float32, torch.float32, True),
    ((200, 384), torch.bfloat16, torch.bfloat16, True),
    ((5, 25, 128), torch.float32, torch.bfloat16, False),
    ((2, 400, 128), torch.float32, torch.bfloat16, True),  # 4 and 3 tiles a core: the pipelines' steady state
]


@pytest.mark.parametrize("shape, dtype, branch_dtype, sum_used", ADD_NORM_CASES,
                         ids=[f"{'x'.join(map(str, s))}-{str(d)[6:]}+{str(b)[6:]}{'' if u else '-sum-unused'}"
                              for s, d, b, u in ADD_NORM_CASES])
def test_add_rms_norm_matches_reference(shape, dtype, branch_dtype, sum_used):
    generator = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=generator)).to(dtype).requires_grad_()
    branch = torch.randn(shape, generator=generator).to(branch_dtype).requires_grad_()
    total, normed = add_rms_norm(x, branch, mode="nki")
    d_total = torch.randn(shape, generator=generator).to(dtype)
    d_normed = torch.randn(shape, generator=generator).to(branch_dtype)
    torch.autograd.backward((total, normed) if sum_used else (normed,), (d_total, d_normed) if sum_used else (d_normed,))
    x64, branch64 = (t.detach().double().requires_grad_() for t in (x, branch))
    total64 = x64 + branch64
    normed64 = rms_norm_reference(total64)
    torch.autograd.backward((total64, normed64) if sum_used else (normed64,),
                            (d_total.double(), d_normed.double()) if sum_used else (d_normed.double(),))
    assert_close(total, total64, dtype, "sum")
    assert_close(normed, normed64, branch_dtype, "norm")  # in the branch's (the matmul's) dtype
    assert_close(x.grad, x64.grad, dtype, "dx")
    assert_close(branch.grad, branch64.grad, branch_dtype, "dbranch")


@emulated
def test_add_rms_norm_makes_one_pass_over_the_data():
    """Forward: read x and the branch, write the sum and the norm; backward: read the sum, both gradients,
    write dx (and dx once more in the branch's dtype): no intermediate goes through HBM."""
    rows, dim = 512, 256
    x = torch.randn(rows, dim, requires_grad=True)
    branch = torch.randn(rows, dim, dtype=torch.bfloat16, requires_grad=True)
    with nki_emulator.counting() as forward:
        total, normed = add_rms_norm(x, branch, mode="nki")
    with nki_emulator.counting() as backward:
        (total.sum() + normed.float().sum()).backward()
    assert forward.dma_bytes == rows * dim * (4 + 2) * 2
    assert backward.dma_bytes == rows * dim * (4 + 2 + 4 + 4 + 2)
    assert forward.matmul_flops == backward.matmul_flops == 0


def test_add_rms_norm_shape_limits():
    x = torch.randn(4, 128)
    with pytest.raises(ValueError, match="cannot hold its sum"):  # a bf16 stream with an fp32 branch
        add_rms_norm(x.bfloat16(), x, mode="nki")
    with pytest.raises(ValueError, match="2048"):
        add_rms_norm(torch.zeros(4, 4096), torch.zeros(4, 4096), mode="nki")
    total, normed = add_rms_norm(x, x, mode="torch")
    torch.testing.assert_close(total, 2 * x)
    torch.testing.assert_close(normed, rms_norm_reference(2 * x))


def test_gpt_with_every_kernel_on_nki_matches_torch():
    """A small GPT, every attention, MLP and norm on the NKI kernels, against kernels="torch": same loss
    and gradients in fp32. (Its output projections start at zero; randomise them so that every gradient
    is nonzero.)"""
    config = dict(sequence_len=128, vocab_size=257, n_layer=2, n_head=2, n_kv_head=1, n_embd=128, mlp="relu2")
    torch.manual_seed(0)
    reference = GPT(GPTConfig(**config, kernels="torch"))
    for block in reference.blocks:
        for linear in (block.attn.c_proj, block.mlp.c_proj):
            nn.init.normal_(linear.weight, std=0.02)
    model = GPT(GPTConfig(**config, kernels="nki"))
    model.load_state_dict(reference.state_dict())
    idx = torch.randint(0, 257, (2, 128), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(idx, -1, dims=1)
    losses = []
    for net in (reference, model):
        loss = net(idx, targets)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    for (name, want), got in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-4 * want.grad.abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")


# One small bf16 case of the reference tests above per op, for the kill matrix (tests/test_kill_matrix.py):
# KernelOp.tests names this file
KILL_MATRIX = {
    "mlp": [("mlp leaky_relu2 test", lambda: test_mlp_matches_reference(200, 128, 256, "leaky_relu2", torch.bfloat16)),
            ("mlp gelu test", lambda: test_mlp_matches_reference(200, 128, 256, "gelu", torch.bfloat16))],
    "rms_norm": [("rms_norm test", lambda: test_rms_norm_matches_reference((3, 67, 128), True, torch.bfloat16))],
    "add_rms_norm": [("add_rms_norm test", lambda: test_add_rms_norm_matches_reference(
        (2, 100, 128), torch.float32, torch.bfloat16, True))],
}

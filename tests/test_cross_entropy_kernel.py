"""The head's softcap cross-entropy kernels (kernels.softcap_cross_entropy, mode="nki"), run under nki.simulate
(the CPU emulator here) through the PyTorch op and autograd glue training uses, against float64 PyTorch math on
the very inputs the kernels get. Tolerances as in test_mlp_norm_kernels.py: 1e-5 in fp32 (statistics fp32,
only summation order differs), 2e-2 in bf16 (the gradient is written in bf16, a relative step of 2^-8)."""
import sys

import pytest
import torch
import torch.nn.functional as F

import nki_emulator
from kernels import VOCAB_CHUNK, softcap_cross_entropy

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
emulated = pytest.mark.skipif(sys.modules["nki"] is not nki_emulator, reason="counts instructions in the emulator")


def reference(logits, targets, cap, vocab_size):
    """Per-position loss of cap * tanh(logits / cap) over the first vocab_size columns, 0 where ignored."""
    capped = cap * torch.tanh(logits[..., :vocab_size] / cap)
    return F.cross_entropy(capped.flatten(0, -2), targets.flatten(), ignore_index=-1,
                           reduction="none").view(targets.shape)


def random_head(shape, vocab_size, dtype, seed=0):
    """Logits of a padded head (vocab rounded up to 128) large enough that the cap bites; every 7th target
    ignored."""
    generator = torch.Generator().manual_seed(seed)
    padded = -(-vocab_size // 128) * 128
    logits = (8 * torch.randn(*shape, padded, generator=generator)).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab_size, shape, generator=generator)
    targets.view(-1)[::7] = -1
    return logits, targets


# vocab: two chunks with a short last one and padding; under one chunk; exactly one chunk, no padding.
# Rows: 200 (a 72-row last tile, the programs' shares unequal), 150 in two sequences, 130.
CASES = [
    # shape, vocab, dtype, reduction
    ((2, 100), VOCAB_CHUNK + 452, torch.bfloat16, "mean"),
    ((3, 50), 300, torch.float32, "none"),
    ((130,), VOCAB_CHUNK, torch.float32, "mean"),
    ((200,), 300, torch.bfloat16, "none"),
]


@pytest.mark.parametrize("shape, vocab_size, dtype, reduction", CASES,
                         ids=[f"{'x'.join(map(str, s))}-V{v}-{str(d)[6:]}-{r}" for s, v, d, r in CASES])
def test_softcap_cross_entropy_matches_reference(shape, vocab_size, dtype, reduction):
    logits, targets = random_head(shape, vocab_size, dtype)
    loss = softcap_cross_entropy(logits, targets, 15.0, vocab_size, reduction, mode="nki")
    d_loss = torch.randn(loss.shape, generator=torch.Generator().manual_seed(1))
    loss.backward(d_loss)
    logits64 = logits.detach().double().requires_grad_()
    expected = reference(logits64, targets, 15.0, vocab_size)
    if reduction == "mean":
        expected = expected.sum() / (targets >= 0).sum()
    expected.backward(d_loss.double())
    tol = TOLERANCE[dtype]
    assert loss.dtype == torch.float32 and logits.grad.dtype == dtype
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    torch.testing.assert_close(logits.grad.double(), logits64.grad, rtol=tol, atol=tol * logits64.grad.abs().max().item())
    assert (logits.grad[..., vocab_size:] == 0).all()  # the padding columns
    assert (logits.grad[targets < 0] == 0).all()  # the ignored positions


@emulated
def test_softcap_cross_entropy_reads_the_logits_once_each_way():
    """Forward: the logits once (their vocab columns), 9 bytes a row in and out (target, loss, logsumexp);
    backward: the logits once more and their gradient written once, padding included."""
    rows, vocab_size = 256, 300
    logits, targets = random_head((rows,), vocab_size, torch.bfloat16)
    with nki_emulator.counting() as forward:
        loss = softcap_cross_entropy(logits, targets, 15.0, vocab_size, mode="nki")
    with nki_emulator.counting() as backward:
        loss.backward()
    padded = logits.size(-1)
    assert forward.dma_bytes == rows * vocab_size * 2 + rows * (4 + 4 + 4)
    assert backward.dma_bytes == rows * vocab_size * 2 + rows * padded * 2 + rows * (4 + 4 + 4)
    assert forward.matmul_flops == backward.matmul_flops == 0


def test_softcap_cross_entropy_limits_and_fallback():
    logits, targets = random_head((4,), 200, torch.float32)
    with pytest.raises(ValueError, match="logit_softcap=0"):  # no bound on the logits: the kernels do not apply
        softcap_cross_entropy(logits, targets, 0.0, 200, mode="nki")
    with pytest.raises(ValueError, match="vocab_size=300"):
        softcap_cross_entropy(logits, targets, 15.0, 300, mode="nki")
    with nki_emulator.counting() as counts:  # auto: PyTorch here (not a neuron device), the same numbers
        loss = softcap_cross_entropy(logits, targets, 0.0, 200, "none", mode="auto")
    assert sum(counts.instructions.values()) == 0
    expected = F.cross_entropy(logits[:, :200].float(), targets, ignore_index=-1, reduction="none")
    torch.testing.assert_close(loss, expected)


# One small bf16 case of the reference tests above, for the kill matrix (tests/test_kill_matrix.py): KernelOp.tests
# names this file
KILL_MATRIX = {"softcap_cross_entropy": [
    ("softcap_cross_entropy test",
     lambda: test_softcap_cross_entropy_matches_reference((200,), 300, torch.bfloat16, "none"))]}

"""Plain-math references that tests compare against: no fused kernels, only matmuls and elementwise ops,
so torch.utils.flop_counter sees every matmul and a kernel is never checked against itself."""
import math

import torch


def attention_reference(q, k, v):
    """Causal softmax(q k^T / sqrt(d)) v, with each kv head repeated for its group of query heads.
    q: (B, H, T, D); k, v: (B, Hkv, T, D)."""
    group = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    T = q.size(2)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v


def attention_logsumexp_reference(q, k):
    """logsumexp over keys of the causal scores q k^T / sqrt(d) (what a flash-attention forward keeps for
    its backward), shape (B, H, T); kv heads repeated as in attention_reference."""
    group = q.size(1) // k.size(1)
    k = k.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    T = q.size(2)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return torch.logsumexp(scores.masked_fill(~causal, float("-inf")), dim=-1)


def mlp_reference(x, w_up, w_down, activation, w_gate=None):
    """act(x @ w_up^T) @ w_down^T with the activations written out: relu2 = relu(h)^2, leaky_relu2 =
    (h if h > 0 else 0.35 h)^2, gelu = the tanh approximation, swiglu = silu(x @ w_gate^T) * h. Weights in
    nn.Linear layout (out, in)."""
    h = x @ w_up.T
    if activation == "relu2":
        act = torch.clamp(h, min=0) ** 2
    elif activation == "leaky_relu2":
        act = torch.where(h > 0, h, 0.35 * h) ** 2
    elif activation == "gelu":
        act = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
    elif activation == "swiglu":
        gate = x @ w_gate.T
        act = gate * torch.sigmoid(gate) * h
    else:
        raise ValueError(f"unknown activation {activation!r}")
    return act @ w_down.T


def rms_norm_reference(x, weight=None, eps=1e-6):
    """x / sqrt(mean(x^2) + eps) over the last dim (times weight), computed in at least fp32."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    y = x.to(dtype) * torch.rsqrt((x.to(dtype) ** 2).mean(dim=-1, keepdim=True) + eps)
    return (y if weight is None else y * weight).to(x.dtype)

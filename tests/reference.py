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

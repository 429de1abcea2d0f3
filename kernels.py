"""
The three operations a GPT spends its time in: causal attention, the MLP and RMSNorm.

model.py calls only `attention`, `mlp` and `rms_norm` from this file. Each is a seam: today every call
runs its PyTorch path (F.scaled_dot_product_attention, F.rms_norm, plain matmuls), which is also the
fallback on any machine without Trainium. The NKI kernels that replace them on Trainium plug in behind
the same signatures.

Layouts follow PyTorch conventions at this boundary; a kernel that wants another layout (NKI attention
wants the head dim on the partition axis) changes it inside its own wrapper.
"""
import torch
import torch.nn.functional as F

MLP_ACTIVATIONS = ("relu2", "gelu", "swiglu")


def attention(q, k, v):
    """Causal self-attention with grouped-query heads.

    q: (B, n_head, T, head_dim); k, v: (B, n_kv_head, T, head_dim) with n_kv_head dividing n_head.
    Returns (B, n_head, T, head_dim). Softmax scale is 1/sqrt(head_dim).
    """
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.size(1) != q.size(1))


def mlp(x, w_up, w_down, activation, w_gate=None):
    """y = act(x @ w_up.T) @ w_down.T, weights in nn.Linear layout (out_features, in_features).

    activation: "relu2" (relu(h)^2), "gelu" (tanh approximation) or "swiglu" (silu(x @ w_gate.T) *
    (x @ w_up.T); needs w_gate).
    """
    h = F.linear(x, w_up)
    if activation == "relu2":
        h = F.relu(h).square()
    elif activation == "gelu":
        h = F.gelu(h, approximate="tanh")
    elif activation == "swiglu":
        h = F.silu(F.linear(x, w_gate)) * h
    else:
        raise ValueError(f"unknown MLP activation {activation!r}; choose one of {MLP_ACTIVATIONS}")
    return F.linear(h, w_down)


def rms_norm(x, weight=None, eps=1e-6):
    """RMSNorm over the last dim, statistics in fp32 whatever the input dtype."""
    return F.rms_norm(x.float(), (x.size(-1),), weight, eps).type_as(x)

"""
The memory plan: what one rank holds in training, from the config alone, and the refusal of a run that
cannot fit, before anything is built.
"""
import os
import sys

import torch

from kit import optim, runtime
from model import GPT, has_value_embed

GiB = 2**30
HBM_PER_CORE_GIB = {"trn1": 16, "trn2": 12}  # a Trn1 chip's 32 GiB over 2 cores, a Trn2 chip's 96 GiB over 8
FIT_FRACTION = 0.9  # the plan must fit in this share of a rank's memory: the rest is the runtime's and transients'


def activation_bytes(c, batch_size, dtype):
    """Bytes autograd saves for backward in one micro-batch's forward (n = batch_size * sequence_len tokens,
    s = 2 bytes under bf16 autocast, 4 in fp32; C = n_embd, q = n_head * head_dim, kv = n_kv_head * head_dim,
    h = hidden_dim, V = vocab_size). Counted per op from model.py on the PyTorch path with flash attention
    (SDPA, NKI), which keeps out and its logsumexp, not the T x T probabilities:

        tokens 8n (int64); embedding norm 4nC + 4n (its fp32 input and 1/rms)
        per layer: norms 2 (4nC + 4n); q/k norms 4n(q + kv) + 4n(H + Hkv) (fp32 inputs, 1/rms);
          q, k, v after norm s n (q + 2 kv); attention out s n q + logsumexp 4nH; c_proj input s n q;
          inputs of c_q, c_k, c_v: s nC once in fp32, 3 s nC under autocast (each linear casts its own copy);
          MLP input s nC (2 s nC for swiglu under autocast), hidden: relu2 2, leaky_relu2 3, gelu 2, swiglu 4
          times s n h;
          bf16 copies of the rotary tables 4 T head_dim / 2 x 2 bytes
        head: final norm 4nC + 4n, its input s nC, the softcapped logits and log-softmax 8nV, 4 (the loss weight);
          with loss_chunks the fp32 x and the targets instead, 4nC + 8n (1 + mtp_extra), and 12 (1 + mtp_extra)
          of the loss's scalars
        under autocast: the bf16 copy of every matmul weight, 2 bytes x matmul parameters (freed after backward),
          but the head's with loss_chunks (its function casts inside)

    Exact for the plain model and loss_chunks (a test counts the saved tensors). Approximate: value embeddings (their
    looked-up rows, 4n kv + s n kv per layer that has one), residual scalars (4nC per layer), the MTP loss
    without loss_chunks (as the plain head); NKI's MLP kernel saves its own choice of the hidden. Not counted:
    transients that live within one op (the logits' gradient, attention scores inside the kernel)."""
    n, T, C, D = batch_size * c.sequence_len, c.sequence_len, c.n_embd, c.head_dim
    H, Hkv, h, V = c.n_head, c.n_kv_head, c.hidden_dim, c.vocab_size
    q, kv, bf16 = H * D, Hkv * D, dtype == "bfloat16"
    s = 2 if bf16 else 4
    hidden = {"relu2": 2, "leaky_relu2": 3, "gelu": 2, "swiglu": 4}[c.mlp]
    norms = 2 * (4 * n * C + 4 * n) + 4 * n * (q + kv) + 4 * n * (H + Hkv)
    attention = (3 if bf16 else 1) * s * n * C + s * n * (q + 2 * kv) + s * n * q + 4 * n * H + s * n * q
    mlp = (2 if c.mlp == "swiglu" and bf16 else 1) * s * n * C + hidden * s * n * h
    layer = norms + attention + mlp + (4 * T * D if bf16 else 0)
    ve_layers = sum(has_value_embed(i, c.n_layer) for i in range(c.n_layer)) if c.value_embeds else 0
    levers = ve_layers * (4 + s) * n * kv + (c.n_layer * 4 * n * C if c.residual_scalars else 0)
    targets = 1 + c.mtp_extra
    loss = 4 * n * C + 8 * n * targets + 12 * targets if c.loss_chunks else s * n * C + 8 * n * V + 4
    head = 4 * n * C + 4 * n + loss
    with torch.device("meta"):
        matmul = GPT(c).num_params(matmul_only=True) - (c.padded_vocab_size * C if c.loss_chunks else 0)
    weight_copies = 2 * matmul if bf16 else 0
    return 8 * n + 4 * n * C + 4 * n + c.n_layer * layer + levers + head + weight_copies


def shards_optimizer(cfg, world_size):
    """Whether this run shards its optimizer (--shard_optimizer; auto: with more than one rank)."""
    return cfg.shard_optimizer == "true" or (cfg.shard_optimizer == "auto" and world_size > 1)


def memory_plan(cfg, model_cfg, world_size):
    """{part: bytes} one rank holds in training. Weights and gradients fp32 (4 bytes a parameter); AdamW 2
    fp32 moments + a 4-byte step per tensor; Muon a fp32 momentum per entry and NorMuon's fp32 second
    moment per row of the longer side (max(rows, cols)). Unsharded, all of the optimizer state, and with
    more than one rank DDP's gradient buckets (a second fp32 copy of the gradients); sharded
    (optim.Sharding, `shard_layout`), the optimizer state of the rank that owns the most and the exchange
    buffer (world_size segments, which hold the whole tensors' gradients, plus the rank's own), the tables'
    gradients beside it. An EMA is a copy of the weights; activations are one micro-batch's
    (`activation_bytes`; micro-batches run one at a time)."""
    with torch.device("meta"):
        model = GPT(model_cfg)
    _, _, matrices, _ = optim.split_parameters(model)
    muon = {id(p) for p in matrices} if cfg.matrix_optimizer == "muon" else set()
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    plan = {"parameters": 4 * n_params}
    sharded = shards_optimizer(cfg, world_size)
    layout = optim.shard_layout([tuple(p.shape) for p in params], optim.whole_tensors(model, cfg), world_size if sharded else 1)
    state = [0] * world_size
    for p, pieces in zip(params, layout):
        for rank, _, _, n in pieces:
            state[rank] += 4 * (n + max(p.shape)) if id(p) in muon else 8 * n + 4  # Muon's matrices are whole
    if sharded:  # the whole tensors' gradients live in the exchange buffer; the tables' blocks are copied there
        plan["gradients (of tables cut in rows)"] = 4 * sum(p.numel() for p, pieces in zip(params, layout) if len(pieces) > 1)
        plan[f"optimizer state (largest of {world_size} shares)"] = max(state)
        plan["gradient exchange buffer"] = 4 * (world_size + 1) * max(optim.shard_loads(layout, world_size))
    else:
        plan["gradients"] = 4 * n_params
        plan["optimizer state"] = state[0]
        if world_size > 1:
            plan["DDP gradient buckets"] = 4 * n_params
    if cfg.ema_decay:
        plan["EMA weights"] = 4 * n_params
    plan[f"activations (micro-batch {cfg.batch_size})"] = activation_bytes(model_cfg, cfg.batch_size, cfg.dtype)
    return plan


def device_memory(device_type):
    """Bytes of memory one rank has, or None where unknown: Trainium HBM per core x NEURON_LOGICAL_NC_CONFIG,
    the GPU's total, or a CPU's RAM shared by the ranks on this machine."""
    if device_type == "neuron":
        generation = runtime.trainium_generation()
        cores = 1 if generation == "trn1" else int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2"))
        return HBM_PER_CORE_GIB[generation] * cores * GiB if generation in HBM_PER_CORE_GIB else None
    if device_type == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks_here


def check_memory(cfg, model_cfg, world_size, device_type):
    """Refuses, before anything is built, a run whose plan exceeds FIT_FRACTION of a rank's memory
    (--device_memory_gb, else the device's), naming the fixes."""
    memory = cfg.device_memory_gb * GiB if cfg.device_memory_gb else device_memory(device_type)
    plan = memory_plan(cfg, model_cfg, world_size)
    total = sum(plan.values())
    if memory is None or total <= FIT_FRACTION * memory:
        return plan
    parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in plan.items())
    if shards_optimizer(cfg, world_size):
        sharding = "more ranks (each holds a smaller share of the optimizer state)"
    else:
        sharding = "--shard_optimizer=true with more than one rank (each rank then keeps 1/ranks of the optimizer state)"
    raise ValueError(f"this run needs {total / GiB:.2f} GiB per rank ({parts}) but a rank has {memory / GiB:.1f} GiB "
                     f"({FIT_FRACTION:.0%} of it usable); use a smaller --batch_size (micro-batch; --total_batch_tokens "
                     f"is kept by more micro-steps), {sharding}, or a smaller model")


def print_plan(cfg, model_cfg, world_size):
    """`python bench.py --memory`: memory_plan's table for one rank, against the memory of a Trn2 rank at
    LNC=1 and 2 and of this machine's device; exits 1 (SystemExit) if it fits none. dtype auto plans bf16, the
    Trainium choice."""
    cfg.dtype = "bfloat16" if cfg.dtype == "auto" else cfg.dtype
    plan = memory_plan(cfg, model_cfg, world_size)
    total = sum(plan.values())
    with torch.device("meta"):
        n_params = GPT(model_cfg).num_params()
    how = ("optimizer sharded: each rank keeps the state of its share" if shards_optimizer(cfg, world_size)
           else "optimizer not sharded: every rank keeps all of its state")
    print(f"memory plan per rank: {n_params / 1e6:.1f}M parameters, {world_size} rank(s), {cfg.dtype} activations; "
          f"{how}")
    for part, size in plan.items():
        print(f"  {part:<40} {size / GiB:8.2f} GiB")
    print(f"  {'total':<40} {total / GiB:8.2f} GiB")
    here = runtime.detect_device()
    devices = {"Trn2 rank, LNC=2": 24 * GiB, "Trn2 rank, LNC=1": 12 * GiB,
               f"this machine's {here}": cfg.device_memory_gb * GiB or device_memory(here)}
    fits = {}
    for name, capacity in devices.items():
        fits[name] = capacity is not None and total <= FIT_FRACTION * capacity
        room = f"{capacity / GiB:.1f} GiB, {'fits' if fits[name] else 'does NOT fit'}" if capacity else "unknown"
        print(f"  {name:<40} {room} (the plan may use {FIT_FRACTION:.0%})")
    if not any(fits.values()):
        sys.exit("error: the plan fits no device listed; use a smaller --batch_size, more ranks with "
                 "--shard_optimizer=true, or a smaller model")
    return {"memory_plan": plan, "total": total, "fits": fits}

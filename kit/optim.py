"""
The optimizers: Muon (Polar Express orthogonalisation, NorMuon, cautious weight decay) for the hidden
matrices, AdamW for the tables, the head and the scalars, and an EMA of the weights.
"""
import torch


# Polar Express coefficients for five iterations (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932;
# the values nanochat and the Trainium Frontier baseline use): each step's odd quintic is tuned to pull
# every singular value towards 1 as fast as possible, where Newton-Schulz keeps one fixed polynomial.
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def orthogonalize(g, dtype):
    """The nearest semi-orthogonal matrix to each g (B, m, n): U V^T of its SVD, approximately, by the
    Polar Express iteration in `dtype` (bf16 where the device multiplies it fast, else fp32). Works on the
    wide orientation so X @ X^T is the smaller Gram matrix."""
    x = g.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)  # singular values into (0, 1)
    for a, b, c in POLAR_EXPRESS:
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


class Muon(torch.optim.Optimizer):
    """Muon for the hidden matrices, as the Trainium Frontier baseline (nanochat, Jan 2026) runs it:

    1. Nesterov momentum on the gradient;
    2. orthogonalisation by Polar Express (`orthogonalize`), in the compute dtype;
    3. NorMuon (arXiv:2510.05491): each row (of the longer side) divided by the root of a running mean
       of its squared update (beta2), then the whole update rescaled back to its norm before the step;
    4. the step, lr x sqrt(max(1, rows / cols)) so tall matrices move as much per entry as square ones,
       with cautious weight decay: decay only the entries where the update and the weight agree in sign.

    Matrices of one shape are stacked and updated together (batched matmuls, fewer ops). lr, momentum
    and weight_decay are 0-d tensors on the parameters' device that train.py's `apply_schedule` rewrites
    each step, so the ops of a step never see a changed Python number (see there). torch.optim.Muon has
    none of 2-4 and always orthogonalises in bf16, which is ~50x slower than fp32 on CPUs without bf16
    hardware.
    """

    def __init__(self, params, lr, momentum, beta2, weight_decay, dtype, compile=False):
        params = list(params)
        shapes = sorted({tuple(p.shape) for p in params})
        device = params[0].device
        groups = [dict(params=[p for p in params if tuple(p.shape) == s]) for s in shapes]
        defaults = dict(lr=torch.tensor(lr, device=device), momentum=torch.tensor(momentum, device=device),
                        weight_decay=torch.tensor(weight_decay, device=device), beta2=beta2)
        super().__init__(groups, defaults)
        for group in self.param_groups:  # each group its own tensors (defaults are shared by reference)
            for key in ("lr", "momentum", "weight_decay"):
                group[key] = group[key].clone()
        self.dtype = dtype
        # compiled, the update is a few fused loops around the batched matmuls (CPU: 29 -> 24 ms a step at
        # the default model, measured interleaved); one graph per matrix shape, so at most a handful
        self.update = torch.compile(muon_update, dynamic=False) if compile else muon_update

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            params = group["params"]
            state = self.state[params[0]]  # the group's stacked state lives with its first matrix
            if not state:
                state["momentum"] = torch.zeros((len(params), *params[0].shape), device=params[0].device)
                # NorMuon's second moment: one value per row of the longer side
                rows, cols = params[0].shape
                state["second_moment"] = torch.zeros_like(state["momentum"][..., :1] if rows >= cols else state["momentum"][..., :1, :])
            self.update(params, state["momentum"], state["second_moment"], group["lr"], group["momentum"],
                        group["weight_decay"], group["beta2"], self.dtype)


def muon_update(params, buf, second, lr, momentum, weight_decay, beta2, dtype):
    """One Muon step for matrices of one shape, stacked: (K, rows, cols). See `Muon`."""
    grads = torch.stack([p.grad for p in params])
    buf.lerp_(grads, 1 - momentum)
    update = orthogonalize(grads.lerp_(buf, momentum), dtype).to(buf.dtype)
    if beta2:
        norm = update.norm(dim=(-2, -1), keepdim=True)
        second.lerp_(update.square().mean(dim=-1 if second.size(-1) == 1 else -2, keepdim=True), 1 - beta2)
        update = update * second.clamp_min(1e-10).rsqrt()
        update = update * (norm / update.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-10))
    weights = torch.stack(params)
    decay = weight_decay * weights * ((update * weights) >= 0)
    lr = lr * max(1.0, grads.size(-2) / grads.size(-1)) ** 0.5
    torch._foreach_copy_(params, list((weights - lr * (update + decay)).unbind(0)))


def split_parameters(model):
    """(lookup tables, head, hidden matrices, 0-D/1-D parameters), each a list: who optimises what."""
    named = dict(model.named_parameters())
    head = named.pop("lm_head.weight")
    embeddings = [named.pop(n) for n in list(named) if n == "wte.weight" or n.startswith("value_embeds.")]
    matrices = [p for p in named.values() if p.ndim == 2]
    scalars = [p for p in named.values() if p.ndim < 2]
    return embeddings, head, matrices, scalars


def make_optimizers(model, cfg, device_type, dtype):
    """Muon for the hidden matrices; AdamW for the lookup tables and the head (whose rows see very different
    gradient scales) and for any 0-D or 1-D parameter. Every hyperparameter the schedule changes is a 0-d
    tensor on the device (AdamW takes a tensor lr when fused, or capturable on Neuron)."""
    embeddings, head, matrices, scalars = split_parameters(model)
    device = head.device
    fused = device_type in ("cpu", "cuda")
    adamw_kwargs = dict(betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0, fused=fused or None,
                        capturable=not fused, foreach=None if fused else True)
    # nanochat's dmodel_lr_scale: AdamW's lrs were tuned at width 768, and a wider model's tables take smaller steps
    width_scale = (model.config.n_embd / 768) ** -0.5 if cfg.adamw_width_lr_scaling else 1.0
    groups = [{"params": embeddings, "lr": cfg.embedding_lr * width_scale}, {"params": [head], "lr": cfg.head_lr * width_scale}]
    if scalars:  # beta1 0.9 for the scalars: both baseline-derived forks (K82s4, 35c9) use (0.9, 0.95)
        groups.append({"params": scalars, "lr": cfg.scalar_lr, "betas": (0.9, 0.95)})
    if cfg.matrix_optimizer == "adamw":
        groups.append({"params": matrices, "lr": cfg.matrix_lr, "weight_decay": cfg.weight_decay})
    optimizers = [torch.optim.AdamW([{**g, "lr": torch.tensor(g["lr"], device=device)} for g in groups], **adamw_kwargs)]
    if cfg.matrix_optimizer == "muon":
        optimizers.append(Muon(matrices, cfg.matrix_lr, cfg.muon_momentum, cfg.muon_beta2, cfg.weight_decay, dtype,
                               compile=cfg.compile and device_type in ("cpu", "cuda")))
    for o in optimizers:
        for group in o.param_groups:
            group["peak_lr"] = group["lr"].item()
    return optimizers


class WeightEMA:
    """An exponential moving average of the weights, updated every `every` steps with decay^every (the span
    of a per-step EMA at 1/every of its cost); finish() makes the model (1 - blend) * live + blend * EMA.
    FrontierForge: decay 0.99 every 32 steps, blend 0.6, -0.0005 val_bpb (marker2601/trainium-simulator docs/FINDINGS.md). Its Python
    numbers are fixed for the run, so each update is the same ops with the same constants."""

    def __init__(self, model, decay, every, blend):
        self.params = list(model.parameters())
        self.average = [p.detach().clone() for p in self.params]
        self.weight, self.blend = 1 - decay**every, blend

    @torch.no_grad()
    def update(self):
        torch._foreach_lerp_(self.average, [p.detach() for p in self.params], self.weight)

    @torch.no_grad()
    def finish(self):
        torch._foreach_lerp_([p.detach() for p in self.params], self.average, self.blend)

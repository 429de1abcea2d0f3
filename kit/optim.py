"""
The optimizers: Muon (Polar Express orthogonalisation, NorMuon, cautious weight decay) for the hidden
matrices, AdamW for the tables, the head and the scalars, and an EMA of the weights.
"""
import functools
import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


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

    def stacked_state(self, group):
        """The group's state, stacked (K, ...) and kept with its first matrix: the momentum, and NorMuon's
        second moment, one value per row of the longer side. Created as zeros on first use."""
        params = group["params"]
        state = self.state[params[0]]
        if not state:
            state["momentum"] = torch.zeros((len(params), *params[0].shape), dtype=params[0].dtype, device=params[0].device)
            rows, cols = params[0].shape
            state["second_moment"] = torch.zeros_like(state["momentum"][..., :1] if rows >= cols else state["momentum"][..., :1, :])
        return state

    def param_states(self):
        """{matrix: {"momentum", "second_moment"}}: each matrix's rows of the stacked state, as views (a
        checkpoint keyed by parameter reads and writes them in place, whatever the stacking)."""
        views = {}
        for group in self.param_groups:
            state = self.stacked_state(group)
            for i, p in enumerate(group["params"]):
                views[p] = {"momentum": state["momentum"][i], "second_moment": state["second_moment"][i]}
        return views

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            state = self.stacked_state(group)
            self.update(group["params"], state["momentum"], state["second_moment"], group["lr"], group["momentum"],
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


def make_optimizers(model, cfg, device_type, dtype, share=None):
    """Muon for the hidden matrices; AdamW for the lookup tables and the head (whose rows see very different
    gradient scales) and for any 0-D or 1-D parameter. Every hyperparameter the schedule changes is a 0-d
    tensor on the device (AdamW takes a tensor lr when fused, or capturable on Neuron). share: with
    sharding, what this rank steps on for each parameter (`Sharding.share`); the rest gets no optimizer
    state here, and a group or optimizer left without tensors is left out."""
    embeddings, head, matrices, scalars = split_parameters(model)
    share = share or (lambda p: [p])
    embeddings, head, matrices, scalars = ([t for p in part for t in share(p)] for part in (embeddings, [head], matrices, scalars))
    device = next(model.parameters()).device
    fused = device_type in ("cpu", "cuda")
    adamw_kwargs = dict(betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0, fused=fused or None,
                        capturable=not fused, foreach=None if fused else True)
    # nanochat's dmodel_lr_scale: AdamW's lrs were tuned at width 768, and a wider model's tables take smaller steps
    width_scale = (model.config.n_embd / 768) ** -0.5 if cfg.adamw_width_lr_scaling else 1.0
    groups = [{"params": embeddings, "lr": cfg.embedding_lr * width_scale}, {"params": head, "lr": cfg.head_lr * width_scale},
              # beta1 0.9 for the scalars: both baseline-derived forks (K82s4, 35c9) use (0.9, 0.95)
              {"params": scalars, "lr": cfg.scalar_lr, "betas": (0.9, 0.95)}]
    if cfg.matrix_optimizer == "adamw":
        groups.append({"params": matrices, "lr": cfg.matrix_lr, "weight_decay": cfg.weight_decay})
    groups = [{**g, "lr": torch.tensor(g["lr"], device=device)} for g in groups if g["params"]]
    optimizers = [torch.optim.AdamW(groups, **adamw_kwargs)] if groups else []
    if cfg.matrix_optimizer == "muon" and matrices:
        optimizers.append(Muon(matrices, cfg.matrix_lr, cfg.muon_momentum, cfg.muon_beta2, cfg.weight_decay, dtype,
                               compile=cfg.compile and device_type in ("cpu", "cuda")))
    for o in optimizers:
        for group in o.param_groups:
            group["peak_lr"] = group["lr"].item()
    return optimizers


def param_states(optimizers):
    """{parameter: {name: tensor}}: every parameter's optimizer state, created as zeros where no step has
    made it yet, as the tensors the optimizers step on (Muon's as views of its stacks). A checkpoint keyed
    by parameter name is saved from and loaded into these in place, for any split of the parameters over
    ranks. (torch.distributed.checkpoint.state_dict's optimizer helpers create missing state by running a
    step with lr set to a host 0.0, and would see Muon's stacks as one parameter's state.)"""
    states = {}
    for o in optimizers:
        if isinstance(o, Muon):
            states.update(o.param_states())
            continue
        on_device = o.defaults["fused"] or o.defaults["capturable"]  # where torch's AdamW keeps its step count
        for group in o.param_groups:
            for p in group["params"]:
                if not o.state[p]:
                    o.state[p] = {"step": torch.zeros((), device=p.device if on_device else "cpu"),
                                  "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                states[p] = o.state[p]
    return states


def shard_layout(shapes, whole, world_size):
    """How the parameters of these shapes are shared over the ranks: for each, a list of pieces
    (rank, first row, end row, elements). A tensor marked `whole` (Muon's matrices: orthogonalisation needs the
    whole matrix; 0-D and 1-D ones) goes to one rank, the largest first to the least loaded so far
    (longest-processing-time scheduling); any other (AdamW's tables, head and matrices, updated entry by
    entry) is cut into world_size blocks of rows as torch.chunk cuts it. Every rank's share of the elements,
    and so of the exchange and of the optimizer state, is then close to 1/world_size of the whole."""
    numel = [math.prod(shape) for shape in shapes]
    loads, pieces = [0] * world_size, [None] * len(shapes)
    for i, shape in enumerate(shapes):
        if not whole[i] and world_size > 1:
            rows = -(-shape[0] // world_size)
            pieces[i] = []
            for r in range(world_size):
                first, end = min(shape[0], r * rows), min(shape[0], (r + 1) * rows)
                pieces[i].append((r, first, end, (end - first) * numel[i] // shape[0]))
                loads[r] += pieces[i][-1][3]
    for i in sorted(range(len(shapes)), key=lambda i: (-numel[i], i)):
        if pieces[i] is None:
            rank = min(range(world_size), key=lambda r: (loads[r], r))
            pieces[i] = [(rank, 0, shapes[i][0] if shapes[i] else 1, numel[i])]
            loads[rank] += numel[i]
    return pieces


def shard_loads(layout, world_size):
    """Elements each rank owns under `layout` (shard_layout): the longest is the exchange buffer's segment."""
    loads = [0] * world_size
    for pieces in layout:
        for rank, _, _, elements in pieces:
            loads[rank] += elements
    return loads


def whole_tensors(model, cfg):
    """For each parameter of model (in order), whether sharding must keep it whole (see shard_layout)."""
    muon = {id(p) for p in split_parameters(model)[2]} if cfg.matrix_optimizer == "muon" else set()
    return [id(p) in muon or p.ndim < 2 for p in model.parameters()]


class Sharding:
    """Sharded optimizer state and update (ZeRO stage 2, Rajbhandari et al. 2020, arXiv:1910.02054, shared
    out as nanochat's DistMuon and DistAdamW share it, nanochat/optim.py): each Muon matrix and each small
    tensor is owned whole by one rank, each AdamW table by all ranks in blocks of rows (`shard_layout`).
    Only the owner keeps a piece's optimizer state and updates it, so each matrix is orthogonalised by
    exactly one rank, exactly as in one process. A step:

    1. `reduce_gradients`: the gradients are in one flat buffer laid out rank by rank (each rank's
       segment padded with zeros to the longest): a whole tensor's gradient accumulates there in backward
       (its .grad is a view of the buffer, as DDP's gradient_as_bucket_view), a table's blocks of rows are
       copied in. The buffer is reduce-scattered so each rank receives the sum of its own segment only,
       averaged, and clipped by the global norm (one all-reduce of one number);
    2. the rank's optimizers step on its pieces (`share`: the parameter itself or a view of its rows),
       whose .grad are views of the received segment;
    3. `gather_parameters`: every rank's updated pieces are all-gathered through the same buffer, which
       is then zeroed for the next step's gradients.

    The two collectives move what DDP's one all-reduce moves. torch.distributed's ZeroRedundancyOptimizer
    keeps DDP's all-reduce of every gradient and drives one optimizer class, and FSDP2's fully_shard
    splits every tensor along dim 0, so Muon would orthogonalise slices of a matrix: neither fits.
    reduce_scatter_tensor and all_gather_into_tensor are what FSDP2 itself runs on, on gloo, NCCL and
    TorchNeuron's "neuron" backend (which supports DDP, FSDP2 and DTensor: "How to use torch.distributed
    on Neuron", awsdocs-neuron torch/guides/torch-distributed). With one rank no collective runs."""

    def __init__(self, model, cfg, rank, world_size, group=None):
        self.params, self.rank, self.world_size, self.group = list(model.parameters()), rank, world_size, group
        if len({(p.dtype, p.device) for p in self.params}) != 1:
            raise ValueError("sharding packs all parameters into one buffer: they must share one dtype and device")
        layout = shard_layout([tuple(p.shape) for p in self.params], whole_tensors(model, cfg), world_size)
        self.segment = max(shard_loads(layout, world_size))
        p0 = self.params[0]
        self.flat = torch.zeros(world_size * self.segment, dtype=p0.dtype, device=p0.device)
        self.received = torch.zeros(self.segment, dtype=p0.dtype, device=p0.device)  # this rank's segment
        # per piece: the parameter, its rows, its place in the flat buffer; and this rank's own pieces
        self.pieces, self.owned, self.in_received, self.rows_of, used = [], [], [], {}, [0] * world_size
        for p, pieces in zip(self.params, layout):
            for r, first, end, n in pieces:
                rows = slice(first, end) if len(pieces) > 1 else slice(None)
                self.pieces.append((p, rows, self.flat[r * self.segment + used[r]:][:n].view_as(p.detach()[rows]), r))
                if r == rank:
                    mine = p if len(pieces) == 1 else p.detach()[rows]  # a view: AdamW updates the rows in place
                    self.owned.append(mine)
                    self.rows_of[mine] = (p, rows)
                    self.in_received.append(self.received[used[r]:][:n].view_as(mine))
                used[r] += n
        # the whole tensors' gradients live in the buffer; the tables', cut in rows, are copied into it
        self.grad_views = [(p, view) for p, rows, view, _ in self.pieces if rows == slice(None)]
        self.copied = [(p, rows, view) for p, rows, view, _ in self.pieces if rows != slice(None)]
        # the other ranks' pieces, where gather_parameters copies them from the buffer
        self.theirs = [(p.detach()[rows], view) for p, rows, view, r in self.pieces if r != rank]
        self.arm_gradients()
        if world_size > 1:  # every rank starts from rank 0's weights, as DDP makes them
            for p in self.params:
                dist.broadcast(p.detach(), 0, group=group)

    def arm_gradients(self):
        """Zero the buffer and point the whole tensors' .grad at it, for backward to accumulate into."""
        self.flat.zero_()
        for p, view in self.grad_views:
            p.grad = view

    @functools.cache
    def device_mesh(self):
        """The ranks as a 1-D DeviceMesh, for the DTensors a sharded checkpoint describes the tables' rows with."""
        return init_device_mesh(self.params[0].device.type, (self.world_size,))

    def share(self, param):
        """The tensors this rank's optimizers step on for `param`: itself, a view of its rows, or none."""
        return [t for t, (p, _) in self.rows_of.items() if p is param]

    @torch.no_grad()
    def reduce_gradients(self, grad_clip):
        """Step 1: the mean gradient of this rank's pieces, clipped to norm grad_clip (0: not clipped);
        returns the global gradient norm before clipping (as torch.nn.utils.clip_grad_norm_ does)."""
        for p, rows, view in self.copied:
            if p.grad is not None:
                view.copy_(p.grad[rows])
        for p in self.params:
            p.grad = None
        if self.world_size > 1:
            dist.reduce_scatter_tensor(self.received, self.flat, group=self.group)
            self.received.div_(self.world_size)
        else:
            self.received.copy_(self.flat)
        norm_squared = self.received.square().sum()  # the padding is zeros
        if self.world_size > 1:
            dist.all_reduce(norm_squared, group=self.group)
        norm = norm_squared.sqrt()
        if grad_clip:
            self.received.mul_((grad_clip / (norm + 1e-6)).clamp(max=1.0))
        for mine, grad in zip(self.owned, self.in_received):
            mine.grad = grad
        return norm

    @torch.no_grad()
    def gather_parameters(self):
        """Step 3: every rank's updated pieces, on every rank; then the buffer is armed for the next step."""
        if self.world_size > 1:
            torch._foreach_copy_(self.in_received, self.owned)
            dist.all_gather_into_tensor(self.flat, self.received, group=self.group)
            torch._foreach_copy_([t for t, _ in self.theirs], [v for _, v in self.theirs])
        self.arm_gradients()


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

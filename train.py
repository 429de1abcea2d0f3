"""
Train a GPT from scratch. One process:

    python train.py                              # small model on built-in Shakespeare, a few CPU minutes
    python train.py --n_layer=6 --max_steps=500  # any config field, as --field=value
    python train.py --help                       # every field with its default

Data-parallel, one rank per device (NeuronCore, GPU or CPU process):

    torchrun --standalone --nproc_per_node=4 train.py

The learning-rate schedule follows training progress: step / max_steps, or elapsed training time /
time_budget_s (the competition's fixed wall-clock budget). The training clock excludes start-up, the
first `startup_steps` steps (compilation), evaluation and checkpointing.
"""
import dataclasses
import difflib
import functools
import glob
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import data
from model import GPT, GPTConfig


def opt(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    # data
    dataset: str = opt("shakespeare", "shakespeare (built in) or a dataset prepared by data.py")
    tokenizer: str = opt("bytes", "bytes (257 ids, offline) | gpt2 | bpe<N> | competition (see data.py)")
    data_dir: str = opt("data_cache", "where token shards are prepared and read")
    # batch: tokens per optimizer step = batch_size * sequence_len * world_size * accumulation steps
    batch_size: int = opt(16, "sequences per micro-batch per rank")
    total_batch_tokens: int = opt(0, "tokens per optimizer step; 0 = one micro-batch per rank")
    # optimisation: Muon for hidden matrices, AdamW for embedding and head
    matrix_optimizer: str = opt("muon", "muon (the kit's own) | adamw, for the attention and MLP matrices")
    matrix_lr: float = opt(0.02, "learning rate of the attention and MLP matrices")
    embedding_lr: float = opt(0.3, "AdamW learning rate of the token embedding")
    head_lr: float = opt(0.004, "AdamW learning rate of lm_head")
    scalar_lr: float = opt(0.2, "AdamW learning rate of 0-D/1-D parameters (gates, residual scalars), if any")
    weight_decay: float = opt(0.0, "weight decay of the matrices (Muon: cautious, decayed to 0 with progress)")
    muon_momentum: float = opt(0.95, "Muon's Nesterov momentum after its warm-up")
    muon_momentum_start: float = opt(0.85, "Muon's momentum at step 0")
    muon_momentum_warmup_steps: int = opt(300, "steps over which Muon's momentum rises to muon_momentum")
    muon_beta2: float = opt(0.9, "NorMuon's decay of the per-row second moment; 0 turns NorMuon off")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this; 0 disables")
    warmup_steps: int = opt(10, "linear learning-rate warmup, in optimizer steps")
    warmdown_frac: float = opt(0.4, "final fraction of progress over which the lr decays linearly")
    final_lr_frac: float = opt(0.0, "lr at the end of warmdown, as a fraction of the peak")
    max_steps: int = opt(0, "stop after this many optimizer steps; 0 = no step limit")
    time_budget_s: float = opt(150.0, "stop after this much training time; 0 = no time limit")
    startup_steps: int = opt(1, "first steps kept off the training clock (compilation, warm-up)")
    # evaluation and logging
    eval_every: int = opt(0, "evaluate every N steps; 0 = only before and after training")
    eval_tokens: int = opt(65536, "validation tokens per evaluation")
    log_every: int = opt(10, "print and log a training line every N steps")
    sample_tokens: int = opt(300, "tokens of text sampled at the end; 0 = none")
    # checkpoints
    out_dir: str = opt("out", "log.jsonl, checkpoints and final.pt go here")
    checkpoint_every: int = opt(0, "write out_dir/ckpt_<step>.pt every N steps; 0 = only final.pt")
    keep_checkpoints: int = opt(2, "periodic checkpoints kept on disk (oldest deleted first)")
    resume: str = opt("", "'latest' (newest checkpoint in out_dir) or a checkpoint path")
    # system
    device: str = opt("auto", "auto | neuron | cuda | cpu")
    dtype: str = opt("auto", "matmul precision: auto (bf16 where the device multiplies it fast) | bfloat16 | float32")
    peak_tflops: float = opt(0.0, "peak TFLOP/s of one rank for MFU; 0 = device table (measured on CPU)")
    compile_cache_dir: str = opt("neuron_cache", "persistent Neuron compilation cache (reused across runs)")
    compile: bool = opt(True, "torch.compile the training forward/backward (needs a C++ compiler on CPU)")
    seed: int = opt(1337, "seed of initialisation and data order")
    # recipe levers (README "Presets"): all off by default, on in --preset=frontier
    adamw_width_lr_scaling: bool = opt(False, "scale embedding and head AdamW lrs by (n_embd / 768)^-0.5, as the baseline does")
    data_order: str = opt("shuffled", "shuffled (every window, random order) | stream (in order, as the contest's loader)")
    row_pool: int = opt(0, "with data_order=stream: draw rows from a pool of about this many micro-batches; 0 = off")
    mask_bos_targets: bool = opt(False, "ignore training targets that are the document separator (unpredictable)")
    batch_warmup: str = opt("", "smaller steps early: FRACTION@PROGRESS,... e.g. 0.25@0.06,0.5@0.2 (of total_batch_tokens)")
    mtp_weights: str = opt("", "initial loss weights of the extra targets t+2, t+3, ... (model's mtp_extra of them)")
    mtp_fade: str = opt("", "progress at which each extra target's weight has faded to 0, e.g. 0.45,0.2")
    ema_decay: float = opt(0.0, "per-step decay of an EMA of the weights blended into the final model; 0 = off")
    ema_every: int = opt(1, "update the EMA every N steps (with decay^N)")
    ema_blend: float = opt(1.0, "final weights = (1 - blend) * live + blend * EMA")


# One-flag configurations, applied before any other --field=value.
#
# baseline: the organiser's Trainium Frontier baseline (aws-neuron/trainium-frontier train.py, which is not
# public), as far as public sources establish it. Sources, cited per value:
#   [R] the organiser's README, embedded in poojithdevan4D/trainium-research-context
#       01-governing-rules-protocol-and-mission.md
#   [L] that team's "unmodified baseline, real reference run", 03-experiment-log.jsonl, first row: 1 rank,
#       eager, seq_len 1024, 800 steps, 52.4M tokens, 59.6M params, ~51k tokens/s
#   [K] marker2601/trainium-simulator recipes/K82s4/train.py, [P] poojithdevan4D/trainium-research-context
#       04-train-research-35c9.py: both are modified baselines; a value is taken from them when both agree,
#       or when one keeps it as an untouched constant
#   [A] karpathy/autoresearch train.py, which the baseline's names and shape follow (DEPTH x ASPECT_RATIO 64 =
#       640, HEAD_DIM 128, EMBEDDING_LR, WARMDOWN_RATIO, ...; CONTEST.md: autoresearch's prepare.py is the
#       contest's ancestor)
#   [?] not established: the value is the best guess named with it and may differ from the baseline
# Launch on one Trn2 chip, 30 minutes:
#   NEURON_LOGICAL_NC_CONFIG=1 torchrun --standalone --nproc_per_node=8 train.py --preset=baseline --dataset=... 
BASELINE = dict(
    n_layer=10, n_embd=640, n_head=5, n_kv_head=5,  # depth 10, 5 full-MHA heads of 128: 59.6M params at vocab 8192 [R, L]
    mlp="relu2", logit_softcap=15.0,  # ReLU^2 MLP 4x, tanh softcap 15 [R; K, P: LOGIT_SOFTCAP = 15.0]
    sequence_len=1024,  # [L: seq_len 1024; K: SEQ_LEN = 1024]; the scorer evaluates at 1024 (CONTEST.md)
    rope_base=100000.0,  # [K, P: ROPE_BASE = 100000]
    wte_init_std=0.8, matrix_init_scale=0.68,  # wte N(0, 0.8) [K: FF_WTE_STD 0.8], q/k/v/fc init x0.68 [issue 16]; head N(0, 0.001) is the kit's too [K: FF_HEAD_STD]
    total_batch_tokens=65536,  # 52.4M tokens / 800 steps [L]
    batch_size=8,  # sequences per rank per micro-step: 8 ranks x 8 x 1024 = one micro-step per step [K: FF_MB 8; FINDINGS.md "one 65,536-token micro-batch"]
    embedding_lr=0.3, head_lr=0.006, scalar_lr=0.2,  # AdamW [K: 0.30, 0.006, 0.20; P: 0.3, 0.006, 0.2]
    # AdamW betas (0.8, 0.95) for embedding and head [P: EMBED_ADAMW_BETA2 = 0.95; A], (0.9, 0.95) for scalars
    # [K, P], eps 1e-10, no weight decay [A; K's small decays are tuned] (fixed in make_optimizers)
    residual_scalars=True,  # per-layer resid/x0 scalars: the README's AdamW "scalars" [R]; K builds them in every
    # block (init 1 and 0.05; the kit keeps nanochat's 0.1 [?]) and trains them at scalar_lr with the other scalars
    adamw_width_lr_scaling=True,  # embedding and head lr x (640/768)^-0.5 [R lineage: nanochat's dmodel_lr_scale; issue 16]
    matrix_lr=0.025,  # Muon [K: MATRIX_LR = 0.025, an untouched constant; P has 0.02, which that team tuned]
    matrix_optimizer="muon", muon_momentum_start=0.85, muon_momentum=0.95, muon_momentum_warmup_steps=300,  # [P: MUON_MOMENTUM_WARMUP_STEPS = 300; issue 16]
    muon_beta2=0.9,  # NorMuon [P: MUON_BETA2 = 0.9]; Polar Express, cautious WD, lr x sqrt(max(1, rows/cols)): the kit's Muon
    weight_decay=0.2,  # cautious, decayed linearly to 0 [P: WEIGHT_DECAY = 0.2, WD_DECAY_TO_ZERO = True; A: 0.2; K's 0.02 is tuned]
    warmup_steps=0,  # [P: WARMUP_STEPS = 0; A: WARMUP_RATIO = 0.0; K's 20 is tuned]
    warmdown_frac=0.5, final_lr_frac=0.0,  # [?: A's WARMDOWN_RATIO 0.5, FINAL_LR_FRAC 0.0; the README says the baseline's
    # warmdown is "tuned for the training budget"; P has 0.75 / 0.05 and K 0.7, both tuned]
    grad_clip=1.0,  # [P: GRAD_CLIP = 1.0] [?: K has none]
    time_budget_s=1800.0, startup_steps=5,  # 30 minutes [R]; prepare.py's TRAIN_STARTUP_STEPS_EXCLUDED = 5 [K, P]
    compile=False,  # "The baseline is eager-mode" [R]
    data_order="stream",  # the contest's loader streams documents in order, every epoch alike [P: _document_batches docstring]
    eval_tokens=1048576, log_every=20, checkpoint_every=250, sample_tokens=200,
)

# frontier: the baseline plus the levers competitors measured on Trn2 near the baseline's scale (val_bpb deltas
# from FrontierForge, marker2601/trainium-simulator docs/FINDINGS.md). Not tuned together at this scale.
FRONTIER = dict(
    BASELINE,
    mtp_extra=2, mtp_weights="0.5,0.25", mtp_fade="0.45,0.2",  # 3-token MTP (1, 0.5, 0.25), t+3 faded out by 20%, t+2 by 45% of the run: -0.0043
    data_order="stream", row_pool=256,  # row pool of 256 micro-batches: -0.0023
    batch_warmup="0.25@0.06,0.5@0.2", batch_size=2,  # 1/4 then 1/2 of the batch until 6% then 20% of the run: -0.0019;
    # batch_size 2 so a quarter-step is whole micro-batches on 1, 4 or 8 ranks
    mlp="leaky_relu2",  # LeakyReLU(0.35)^2: -0.0017 (kernels.py's leaky_relu2)
    ema_decay=0.99, ema_every=32, ema_blend=0.6,  # EMA every 32 steps, 0.6 blend at the end: -0.0005
    value_embeds=True,  # gated value embeddings: both forks have them (nanochat's design); not measured alone
    mask_bos_targets=True,  # both forks' loaders; not measured alone
    loss_chunks=8,  # fused chunked softcap CE: -2.8% step time
    compile=True,  # both forks compile the step ("compile and static-loss work", FINDINGS.md)
)

# The frontier's levers by name, each the fields it sets (bench.py --ablation turns them on one at a time).
FRONTIER_LEVERS = {
    "mtp": ("mtp_extra", "mtp_weights", "mtp_fade"),
    "row_pool": ("row_pool",),
    "batch_warmup": ("batch_warmup", "batch_size"),
    "leaky_relu2": ("mlp",),
    "ema": ("ema_decay", "ema_every", "ema_blend"),
    "value_embeds": ("value_embeds",),
    "mask_bos": ("mask_bos_targets",),
    "chunked_ce": ("loss_chunks",),
}

PRESETS = {
    "baseline": BASELINE,
    "frontier": FRONTIER,
    "trn2": BASELINE,  # the old name of the baseline's shape
}


def parse_args(argv):
    """--field=value for any TrainConfig or GPTConfig field, after the fields of --preset=NAME if given;
    unknown names get a close match suggested."""
    train_cfg, model_cfg = TrainConfig(), GPTConfig()
    presets = [a.partition("=")[2] for a in argv if a.startswith("--preset=")]
    argv = [a for a in argv if not a.startswith("--preset=")]
    for name in presets:
        if name not in PRESETS:
            sys.exit(f"error: unknown --preset={name}; presets: {', '.join(PRESETS)}")
        argv = [f"--{k}={v}" for k, v in PRESETS[name].items()] + argv
    owners = {f.name: cfg for cfg in (train_cfg, model_cfg) for f in dataclasses.fields(cfg)}
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        print(f"  --preset=NAME            apply a preset first: {', '.join(PRESETS)}")
        for cfg in (model_cfg, train_cfg):
            for f in dataclasses.fields(cfg):
                print(f"  --{f.name}={getattr(cfg, f.name)!s:<14} {f.metadata.get('help', '')}")
        sys.exit(0)
    for arg in argv:
        key, sep, value = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or not sep:
            sys.exit(f"error: arguments are --field=value, got {arg!r}")
        if key not in owners:
            near = difflib.get_close_matches(key, owners, n=1)
            sys.exit(f"error: unknown config field --{key}" + (f"; did you mean --{near[0]}?" if near else "") + " (--help lists all)")
        cfg = owners[key]
        kind = type(getattr(cfg, key))
        try:
            parsed = {"true": True, "false": False}[value.lower()] if kind is bool else kind(value)
        except (KeyError, ValueError):
            sys.exit(f"error: --{key}={value!r} is not a valid {kind.__name__} (default {getattr(cfg, key)!r})")
        setattr(cfg, key, parsed)
    return train_cfg, model_cfg


# -----------------------------------------------------------------------------
# devices

# Dense bf16 peak FLOP/s of one physical NeuronCore or one GPU (TRAINIUM.md). On Trn2/Trn3 a rank drives a
# logical core of NEURON_LOGICAL_NC_CONFIG physical cores (2 by default: 166.8 TFLOP/s per Trn2 rank).
PEAK_FLOPS = {"trn1": 95e12, "trn2": 83.4e12, "trn3": 84e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}


def detect_device():
    try:
        import torch_neuronx  # noqa: F401  registers the "neuron" device
        return "neuron"
    except ImportError:  # not installed, or the PyPI placeholder
        return "cuda" if torch.cuda.is_available() else "cpu"


def setup_distributed(device_type):
    """Under torchrun (which sets RANK, LOCAL_RANK, WORLD_SIZE) joins the process group with the device's
    backend and binds one device per rank. Returns (rank, world_size, device)."""
    if "RANK" not in os.environ:
        return 0, 1, device_type
    dist.init_process_group(backend={"neuron": "neuron", "cuda": "nccl"}.get(device_type, "gloo"))
    local_rank = int(os.environ["LOCAL_RANK"])
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return dist.get_rank(), dist.get_world_size(), f"cuda:{local_rank}"
    # TorchNeuron gives each torchrun process its own logical core, addressed as plain "neuron"
    return dist.get_rank(), dist.get_world_size(), device_type


def configure_neuron_compiler(cfg):
    """Defaults for neuronx-cc that a user's own NEURON_CC_FLAGS replace entirely: -O1 (without it,
    competitors measured half the throughput), bf16 matmuls to match autocast, and a persistent cache so
    a second run skips the ~14-minute first compilation."""
    cast = "--auto-cast=matmult --auto-cast-type=bf16" if cfg.dtype == "bfloat16" else "--auto-cast=none"
    cache = os.path.abspath(cfg.compile_cache_dir)
    os.environ.setdefault("NEURON_CC_FLAGS", f"--optlevel=1 {cast} --cache_dir={cache}")
    os.environ.setdefault("NEURON_COMPILE_CACHE_URL", cache)


def cpu_matmul_gflops(n=256, repeats=3):
    """{dtype: GFLOP/s} of an n x n matmul in bf16 and fp32 on one thread, the two interleaved and the best
    of `repeats` kept, so a busy machine slows both alike (~0.1 s even where bf16 is slow)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    operands = {dtype: (torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)) for dtype in (torch.bfloat16, torch.float32)}
    best = dict.fromkeys(operands, float("inf"))
    for _ in range(repeats + 1):  # the first round pays for library set-up, and is as good as any other
        for dtype, (a, b) in operands.items():
            t0 = time.perf_counter()
            a @ b
            best[dtype] = min(best[dtype], time.perf_counter() - t0)
    torch.set_num_threads(threads)
    return {dtype: 2 * n**3 / seconds / 1e9 for dtype, seconds in best.items()}


def resolve_dtype(requested, device_type):
    """(bfloat16 | float32, why). auto picks bf16 only where the device multiplies it fast: always on
    Trainium (TensorE runs fp32 at a quarter of the bf16 rate), on GPUs that support it, and on CPUs that
    measure bf16 at least as fast as fp32 (AMX or AVX512-BF16). Elsewhere (AVX2, most ARM) bf16 falls to
    a scalar path ~50x slower than fp32. CPUs are measured rather than recognised by their flags because
    what counts is the path this torch build takes."""
    if requested != "auto":
        return requested, "--dtype asked for it"
    if device_type == "neuron":
        return "bfloat16", "Trainium's TensorEngine runs bf16 at 4x its fp32 rate"
    if device_type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bfloat16", f"{torch.cuda.get_device_name()} supports bf16"
        return "float32", f"{torch.cuda.get_device_name()} has no bf16"
    rates = cpu_matmul_gflops()
    bf16, fp32 = rates[torch.bfloat16], rates[torch.float32]
    return "bfloat16" if bf16 >= fp32 else "float32", (
        f"this CPU ({torch.backends.cpu.get_cpu_capability()}) multiplies bf16 at {bf16:.1f} GFLOP/s and fp32 at "
        f"{fp32:.1f} (one thread, measured now)")


def choose_dtype(cfg, device_type, group=None):
    """Resolves cfg.dtype in place, rank 0's choice binding every rank (`group`: a gloo group under
    torchrun), and returns the reason."""
    choice = [resolve_dtype(cfg.dtype, device_type)]
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0, group=group)
    cfg.dtype, reason = choice[0]
    return reason


def synchronize(device_type):
    if device_type == "cuda":
        torch.cuda.synchronize()
    elif device_type == "neuron":
        torch.neuron.synchronize()


def trainium_generation():
    """trn1, trn2 or trn3, from the EC2 instance type that the DMI product name holds (e.g. trn2.3xlarge)."""
    try:
        with open("/sys/devices/virtual/dmi/id/product_name") as f:
            product = f.read().strip()
    except OSError:
        product = ""
    return next((g for g in ("trn1", "trn3", "trn2") if product.startswith(g)), "trn2")


@functools.lru_cache  # measured once per process, so every MFU in a run divides by the same number
def peak_flops(device_type, dtype=torch.bfloat16, override_tflops=0.0):
    """Peak FLOP/s of one rank's device. A CPU has no datasheet number here, so it is measured: the best
    of a few large matmuls in the compute dtype (so MFU compares like with like)."""
    if override_tflops:
        return override_tflops * 1e12
    if device_type == "neuron":
        generation = trainium_generation()
        cores_per_rank = 1 if generation == "trn1" else int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2"))
        return PEAK_FLOPS[generation] * cores_per_rank
    if device_type == "cuda":
        name = torch.cuda.get_device_name()
        return next((v for k, v in PEAK_FLOPS.items() if k in name), float("nan"))
    n = 256  # grown until one matmul takes 50 ms (2048 at most), so a slow dtype costs a second, not minutes
    while True:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        if best > 0.05 or n >= 2048:
            return 2 * n**3 / best
        n *= 2


# -----------------------------------------------------------------------------
# optimisation

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
    and weight_decay are 0-d tensors on the parameters' device that `apply_schedule` rewrites each step,
    so the ops of a step never see a changed Python number (see `apply_schedule`). torch.optim.Muon has
    none of 2-4 and always orthogonalises in bf16, which is ~50x slower than fp32 on CPUs without bf16
    hardware.
    """

    def __init__(self, params, lr, momentum, beta2, weight_decay, dtype):
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

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            params = group["params"]
            grads = torch.stack([p.grad for p in params])  # (K, rows, cols)
            state = self.state[params[0]]  # the group's stacked state lives with its first matrix
            if not state:
                state["momentum"] = torch.zeros_like(grads)
                # NorMuon's second moment: one value per row of the longer side
                rows_longer = grads.size(-2) >= grads.size(-1)
                state["second_moment"] = torch.zeros_like(grads[..., :1] if rows_longer else grads[..., :1, :])
            buf, second = state["momentum"], state["second_moment"]
            momentum = group["momentum"]
            buf.lerp_(grads, 1 - momentum)
            update = orthogonalize(grads.lerp_(buf, momentum), self.dtype).float()
            if group["beta2"]:
                norm = update.norm(dim=(-2, -1), keepdim=True)
                second.lerp_(update.square().mean(dim=-1 if second.size(-1) == 1 else -2, keepdim=True), 1 - group["beta2"])
                update = update * second.clamp_min(1e-10).rsqrt()
                update = update * (norm / update.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-10))
            weights = torch.stack(params)
            decay = group["weight_decay"] * weights * ((update * weights) >= 0)
            lr = group["lr"] * max(1.0, grads.size(-2) / grads.size(-1)) ** 0.5
            torch._foreach_copy_(params, list((weights - lr * (update + decay)).unbind(0)))


def make_optimizers(model, cfg, device_type, dtype):
    """Muon for the hidden matrices; AdamW for the lookup tables and the head (whose rows see very different
    gradient scales) and for any 0-D or 1-D parameter. Every hyperparameter the schedule changes is a 0-d
    tensor on the device (AdamW takes a tensor lr when fused, or capturable on Neuron)."""
    named = dict(model.named_parameters())
    head = named.pop("lm_head.weight")
    embeddings = [named.pop(n) for n in list(named) if n == "wte.weight" or n.startswith("value_embeds.")]
    matrices = [p for p in named.values() if p.ndim == 2]
    scalars = [p for p in named.values() if p.ndim < 2]
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
        optimizers.append(Muon(matrices, cfg.matrix_lr, cfg.muon_momentum, cfg.muon_beta2, cfg.weight_decay, dtype))
    for o in optimizers:
        for group in o.param_groups:
            group["peak_lr"] = group["lr"].item()
    return optimizers


def lr_multiplier(cfg, step, progress):
    """Linear warmup over warmup_steps, constant, then linear warmdown over the last warmdown_frac of
    progress (0 at the start of training, 1 at max_steps or time_budget_s)."""
    warmup = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    if progress < 1 - cfg.warmdown_frac:
        return warmup
    left = max(0.0, 1 - progress) / cfg.warmdown_frac
    return warmup * (cfg.final_lr_frac + (1 - cfg.final_lr_frac) * left)


def schedule(cfg, step, progress):
    """This step's scheduled values: the lr multiplier, Muon's momentum (warmed up from
    muon_momentum_start over muon_momentum_warmup_steps, as the baseline does), Muon's weight decay
    (linearly to zero at the end of training, nanochat's rule), the MTP weights and the batch fraction."""
    warm = min(1.0, step / cfg.muon_momentum_warmup_steps) if cfg.muon_momentum_warmup_steps else 1.0
    return {"lr_scale": lr_multiplier(cfg, step, progress),
            "momentum": cfg.muon_momentum_start + warm * (cfg.muon_momentum - cfg.muon_momentum_start),
            "weight_decay": cfg.weight_decay * (1 - progress),
            "mtp_weights": mtp_weights(cfg, progress),
            "batch_fraction": next((f for f, until in batch_warmup_phases(cfg) if progress < until), 1.0)}


def floats(text):
    return [float(v) for v in text.split(",") if v.strip()]


def mtp_weights(cfg, progress):
    """Each extra target's weight fades linearly to 0 by its mtp_fade progress, the farthest target first
    and each fade starting where the farther one's ended (FrontierForge: t+3 over 0-20% of the run, t+2
    over 20-45%, then plain next-token prediction; they step the fade in 4 levels per phase)."""
    weights, ends = floats(cfg.mtp_weights), floats(cfg.mtp_fade)
    starts = ends[1:] + [0.0]
    return tuple(w * min(1.0, max(0.0, (end - progress) / (end - start))) for w, end, start in zip(weights, ends, starts))


def batch_warmup_phases(cfg):
    """[(fraction of total_batch_tokens, progress until which it holds), ...] from FRACTION@PROGRESS,..."""
    phases = []
    for part in filter(None, cfg.batch_warmup.split(",")):
        fraction, _, until = part.partition("@")
        phases.append((float(fraction), float(until)))
    return phases


def validate_levers(cfg, model_cfg, accum_steps):
    """The recipe levers' settings, checked before any data or model is built."""
    problems = []
    if cfg.data_order not in ("shuffled", "stream"):
        problems.append(f"--data_order={cfg.data_order!r}: use shuffled or stream")
    if cfg.row_pool < 0 or (cfg.row_pool and cfg.data_order != "stream"):
        problems.append(f"--row_pool={cfg.row_pool} needs --data_order=stream (shuffled data is already fully mixed) and >= 0")
    try:
        weights, ends, phases = floats(cfg.mtp_weights), floats(cfg.mtp_fade), batch_warmup_phases(cfg)
    except ValueError as e:
        raise ValueError(f"--mtp_weights, --mtp_fade and --batch_warmup are numbers like 0.5,0.25 / 0.45,0.2 / 0.25@0.06 ({e})")
    if len(weights) != model_cfg.mtp_extra or len(ends) != model_cfg.mtp_extra:
        problems.append(f"--mtp_weights and --mtp_fade need one value per extra target (--mtp_extra={model_cfg.mtp_extra}), "
                        f"got {len(weights)} and {len(ends)}")
    if any(not 0 < e <= 1 for e in ends) or ends != sorted(ends, reverse=True) or len(set(ends)) != len(ends):
        problems.append(f"--mtp_fade={cfg.mtp_fade!r}: progress points in (0, 1], decreasing (the farthest target fades first)")
    for fraction, until in phases:
        micro = fraction * accum_steps
        if not (0 < until < 1 and 0 < fraction < 1 and abs(micro - round(micro)) < 1e-9 and round(micro) >= 1):
            problems.append(f"--batch_warmup phase {fraction}@{until}: the fraction of the step's {accum_steps} micro-batch(es) "
                            f"must be a whole number >= 1 and 0 < progress < 1; lower --batch_size for more micro-batches per step")
    if [u for _, u in phases] != sorted(u for _, u in phases):
        problems.append(f"--batch_warmup={cfg.batch_warmup!r}: phases in order of progress")
    if not (0 <= cfg.ema_decay < 1 and cfg.ema_every >= 1 and 0 <= cfg.ema_blend <= 1):
        problems.append("--ema_decay in [0, 1), --ema_every >= 1, --ema_blend in [0, 1]")
    if problems:
        raise ValueError("invalid recipe: " + "; ".join(problems))


def apply_schedule(optimizers, values, model=None):
    """Writes this step's values into the 0-d device tensors the optimizers read (and the model's MTP
    weights), each by a copy from a host tensor. Nothing in the step then takes a Python number that
    changes from step to step: on Neuron a changed scalar argument re-traces and recompiles (a competitor
    measured 408 vs 918 steps in 900 s on Trn2 until their hyperparameters became device tensors;
    CONTEST.md)."""
    for o in optimizers:
        for group in o.param_groups:
            group["lr"].copy_(torch.tensor(group["peak_lr"] * values["lr_scale"]), non_blocking=True)
            if isinstance(o, Muon):
                group["momentum"].copy_(torch.tensor(values["momentum"]), non_blocking=True)
                group["weight_decay"].copy_(torch.tensor(values["weight_decay"]), non_blocking=True)
    if model is not None and model.mtp_weights.numel():
        model.mtp_weights.copy_(torch.tensor(values["mtp_weights"]), non_blocking=True)


class WeightEMA:
    """An exponential moving average of the weights, updated every `every` steps with decay^every (the span
    of a per-step EMA at 1/every of its cost); finish() makes the model (1 - blend) * live + blend * EMA.
    FrontierForge: decay 0.99 every 32 steps, blend 0.6, -0.0005 val_bpb (docs/FINDINGS.md). Its Python
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


def compute_dtype(cfg):
    return torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32


def autocast_context(cfg, device_type):
    """bf16 matmuls under autocast; weights and optimizer state stay fp32."""
    return torch.autocast(device_type, dtype=torch.bfloat16) if cfg.dtype == "bfloat16" else nullcontext()


def wrap_for_training(raw_model, cfg, device_type, device):
    """The module the training step calls: compiled if asked, and DDP-wrapped under torchrun."""
    model = raw_model
    if cfg.compile:
        # the Neuron backend needs one graph for the whole step: fail loudly on a graph break
        model = torch.compile(raw_model, backend="neuron", fullgraph=True) if device_type == "neuron" else torch.compile(raw_model)
    if dist.is_initialized():
        model = DDP(model, device_ids=[torch.device(device).index] if device_type == "cuda" else None)
    return model


def train_step(model, raw_model, optimizers, micro_batches, device, autocast, grad_clip):
    """One optimizer step: gradients accumulated over the micro-batches, clipped, applied. Returns the
    mean loss and the gradient norm as device tensors, so nothing here waits for the device."""
    ddp = isinstance(model, DDP)
    loss_sum = torch.zeros((), device=device)
    # a tensor, not a Python number: batch warm-up changes how many micro-batches a step has
    share = torch.tensor(1 / len(micro_batches)).to(device, non_blocking=True)
    for i, (x, y) in enumerate(micro_batches):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        # with DDP, gradients are all-reduced only on the last micro-step
        sync = model.no_sync() if ddp and i < len(micro_batches) - 1 else nullcontext()
        with sync:
            with autocast:
                loss = model(x, y) * share
            loss.backward()
        loss_sum += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip or math.inf)
    for o in optimizers:
        o.step()
    raw_model.zero_grad(set_to_none=True)
    return loss_sum, grad_norm


# -----------------------------------------------------------------------------
# checkpoints

def save_checkpoint(path, model, optimizers, step, train_time, loader, train_cfg, model_cfg):
    """Written to a temporary file, fsynced, then renamed over the target: a crash at any moment leaves
    either the old checkpoint or the new one, never a torn file."""
    state = {
        "model": model.state_dict(),
        "optimizers": [o.state_dict() for o in optimizers],
        "step": step,
        "train_time": train_time,
        "loader": loader.state_dict(),
        "rng": torch.get_rng_state(),
        "train_config": asdict(train_cfg),
        "model_config": asdict(model_cfg),
    }
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    os.fsync(dir_fd)  # make the rename itself durable
    os.close(dir_fd)


def check_disk_space(out_dir, n_params, keep_checkpoints):
    """Refuse to start a run whose checkpoints cannot fit: weights plus up to two optimizer moments in
    fp32, for the kept periodic checkpoints, final.pt and the temporary file of the next write."""
    checkpoint_bytes = 3 * 4 * n_params
    needed = checkpoint_bytes * (keep_checkpoints + 2)
    free = shutil.disk_usage(out_dir).free
    if free < needed:
        raise OSError(
            f"{out_dir} has {free / 2**30:.2f} GiB free but checkpoints need about {needed / 2**30:.2f} GiB "
            f"({keep_checkpoints} kept + final + one being written, ~{checkpoint_bytes / 2**20:.0f} MiB each); "
            "free space, choose another --out_dir or lower --keep_checkpoints"
        )


def periodic_checkpoints(out_dir):
    return sorted(glob.glob(os.path.join(out_dir, "ckpt_*.pt")))


def load_checkpoint(path, device="cpu"):
    """Tensors and plain containers only (weights_only=True): a checkpoint can never run code."""
    return torch.load(path, map_location=device, weights_only=True)


def inference_model(weights, model_config, device):
    """A single-device GPT in eval mode for evaluation and sampling. Its kernels are "auto" whatever the
    training run chose: prompts come in any length, and "nki" would refuse lengths that are not a
    multiple of 128 (or any machine without NKI)."""
    model = GPT(GPTConfig(**{**model_config, "kernels": "auto"}))
    model.load_state_dict(weights)
    return model.to(device).eval()


def load_for_eval(checkpoint_path, device="cpu"):
    """The competition's entry point: a single-device model in eval mode whose forward(idx) returns
    causal next-token logits, from any checkpoint this script wrote."""
    state = load_checkpoint(checkpoint_path, device)
    return inference_model(state["model"], state["model_config"], device)


# -----------------------------------------------------------------------------
# evaluation

@torch.no_grad()
def evaluate(model, batches, token_bytes, device, autocast):
    """Mean val loss over all target tokens, and val_bpb = nats / (ln 2 * bytes) over the target tokens
    that stand for bytes (document boundaries stand for none). Sums are reduced over all ranks."""
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # nats, tokens, nats of byte tokens, bytes
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with autocast:
            loss = model(x, y, loss_reduction="none").double()
        nbytes = token_bytes[y]
        sums += torch.stack([loss.sum(), torch.tensor(float(y.numel()), device=device, dtype=torch.float64),
                             loss[nbytes > 0].sum(), nbytes.sum().double()])
    if dist.is_initialized():
        dist.all_reduce(sums)
    model.train()
    nats, tokens, byte_nats, nbytes = sums.tolist()
    return {"val_loss": nats / tokens, "val_bpb": byte_nats / (math.log(2) * nbytes)}


# -----------------------------------------------------------------------------
# the training run

class Logger:
    """Prints on rank 0 and appends one JSON object per event to <out_dir>/log.jsonl."""

    def __init__(self, out_dir, enabled, append):
        self.file = open(os.path.join(out_dir, "log.jsonl"), "a" if append else "w") if enabled else None

    def __call__(self, event, text, **fields):
        if self.file:
            print(text, flush=True)
            self.file.write(json.dumps({"event": event, **fields}) + "\n")
            self.file.flush()


class StopSignal:
    """SIGTERM (what schedulers send) or Ctrl-C asks training to checkpoint and stop after the current
    step; a second Ctrl-C interrupts at once."""

    def __enter__(self):
        self.received = False
        self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame):
        self.received = True
        signal.signal(signal.SIGINT, signal.default_int_handler)


def resolve_resume(cfg):
    if cfg.resume != "latest":
        if not os.path.exists(cfg.resume):
            raise FileNotFoundError(f"--resume={cfg.resume}: no such checkpoint")
        return cfg.resume
    found = periodic_checkpoints(cfg.out_dir)
    if not found:
        raise FileNotFoundError(f"--resume=latest: no ckpt_*.pt in {cfg.out_dir}; pass a checkpoint path instead")
    return found[-1]


def main(argv):
    cfg, model_cfg = parse_args(argv)
    logging.basicConfig(format="%(name)s: %(message)s")
    # --- checks that need no data, model or device: fail before any expensive work
    enc = data.get_tokenizer(cfg.tokenizer, cfg.dataset, cfg.data_dir)
    model_cfg.vocab_size = enc.n_vocab
    model_cfg.validate()
    if not (cfg.max_steps or cfg.time_budget_s):
        raise ValueError("set --max_steps or --time_budget_s (or both), otherwise training never stops")
    if cfg.matrix_optimizer not in ("muon", "adamw"):
        raise ValueError(f"--matrix_optimizer={cfg.matrix_optimizer!r}: use muon or adamw")
    if cfg.keep_checkpoints < 1:
        raise ValueError(f"--keep_checkpoints={cfg.keep_checkpoints}: keep at least 1 (the one just written)")
    if cfg.dtype not in ("auto", "bfloat16", "float32"):
        raise ValueError(f"--dtype={cfg.dtype!r}: use auto, bfloat16 or float32")
    device_type = detect_device() if cfg.device == "auto" else cfg.device
    if device_type not in ("neuron", "cuda", "cpu"):
        raise ValueError(f"--device={device_type!r}: use auto, neuron, cuda or cpu")

    rank, world_size, device = setup_distributed(device_type)
    ddp = dist.is_initialized()
    # every rank must agree each step on the clock and on a stop request; a CPU-side gloo group does that
    # without making the host wait for the accelerator
    control = dist.new_group(backend="gloo") if ddp else None
    dtype_reason = choose_dtype(cfg, device_type, control)
    if device_type == "neuron":
        configure_neuron_compiler(cfg)
    master = rank == 0
    if master:  # kernels.py says once, at INFO, why an operation runs on PyTorch instead of NKI
        logging.getLogger("kernels").setLevel(logging.INFO)
    micro_tokens = cfg.batch_size * model_cfg.sequence_len * world_size
    total_tokens = cfg.total_batch_tokens or micro_tokens
    if total_tokens % micro_tokens:
        raise ValueError(
            f"total_batch_tokens={total_tokens} is not a multiple of batch_size * sequence_len * world_size = "
            f"{cfg.batch_size} * {model_cfg.sequence_len} * {world_size} = {micro_tokens}"
        )
    accum_steps = total_tokens // micro_tokens
    validate_levers(cfg, model_cfg, accum_steps)
    resume_path = resolve_resume(cfg) if cfg.resume else None
    state = load_checkpoint(resume_path) if resume_path else None
    if state and state["model_config"] != asdict(model_cfg):
        diff = {k: (v, asdict(model_cfg).get(k)) for k, v in state["model_config"].items() if asdict(model_cfg).get(k) != v}
        raise ValueError(f"{resume_path} holds a different model (field: (checkpoint, now) = {diff}); pass the same flags")
    torch.manual_seed(cfg.seed)

    # --- data: rank 0 prepares the shards once, the others wait for it
    if master:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with torch.device("meta"):  # parameter count without allocating anything
            check_disk_space(cfg.out_dir, GPT(model_cfg).num_params(), cfg.keep_checkpoints)
    elif ddp:
        dist.barrier()  # released below, once rank 0 has the shards
    data_path = data.prepare(cfg.dataset, cfg.tokenizer, cfg.data_dir)
    if master and ddp:
        dist.barrier()
    loader = data.TokenLoader(data.shard_paths(data_path, "train"), cfg.batch_size, model_cfg.sequence_len,
                              rank, world_size, cfg.seed, enc.n_vocab, shuffle=cfg.data_order == "shuffled",
                              row_pool=cfg.row_pool, ignore_target=enc.eot_token if cfg.mask_bos_targets else None)
    val_batches = data.eval_batches(data.shard_paths(data_path, "val"), cfg.batch_size, model_cfg.sequence_len,
                                    cfg.eval_tokens, rank, world_size, enc.n_vocab)
    token_bytes = data.token_bytes(enc).to(device)

    # --- model and optimizers, fresh or from a checkpoint
    raw_model = GPT(model_cfg).to(device)
    optimizers = make_optimizers(raw_model, cfg, device_type, compute_dtype(cfg))
    step, train_time = 0, 0.0
    if state:
        raw_model.load_state_dict(state["model"])
        for o, s in zip(optimizers, state["optimizers"]):
            o.load_state_dict(s)
        step, train_time = state["step"], state["train_time"]
        loader.load_state_dict(state["loader"])
        torch.set_rng_state(state["rng"])
        del state  # its tensors now live in the model and optimizers
    ema = WeightEMA(raw_model, cfg.ema_decay, cfg.ema_every, cfg.ema_blend) if cfg.ema_decay else None
    model = wrap_for_training(raw_model, cfg, device_type, device)
    autocast = autocast_context(cfg, device_type)
    flops_per_token = raw_model.flops_per_token()
    peak = peak_flops(device_type, compute_dtype(cfg), cfg.peak_tflops) * world_size
    log = Logger(cfg.out_dir, master, append=bool(cfg.resume))
    log("config", f"{raw_model.num_params():,} parameters, {flops_per_token / 1e6:.1f} MFLOP/token, {world_size} "
        f"rank(s) on {device_type}, {accum_steps} micro-step(s) of {micro_tokens:,} tokens per step; computing in "
        f"{cfg.dtype} because {dtype_reason}", train_config=asdict(cfg), model_config=asdict(model_cfg),
        world_size=world_size, device=device_type, dtype_reason=dtype_reason)

    def run_eval():
        # the uncompiled model: eval's no_grad forward would otherwise cost a second compilation
        metrics = evaluate(raw_model, val_batches, token_bytes, device, autocast)
        log("eval", f"step {step}: val_loss {metrics['val_loss']:.4f}, val_bpb {metrics['val_bpb']:.4f}", step=step, **metrics)
        return metrics

    def checkpoint(path):
        if master:
            save_checkpoint(path, raw_model, optimizers, step, train_time, loader, cfg, model_cfg)

    first_eval = run_eval()
    steps_this_run, startup_time = 0, 0.0
    interval_time, interval_tokens = 0.0, 0
    with StopSignal() as stop_signal:
        while True:
            progress = max(step / cfg.max_steps if cfg.max_steps else 0.0, train_time / cfg.time_budget_s if cfg.time_budget_s else 0.0)
            if progress >= 1:
                break
            t0 = time.perf_counter()
            scheduled = schedule(cfg, step, progress)
            apply_schedule(optimizers, scheduled, raw_model)
            lr_scale = scheduled["lr_scale"]
            micro_batches = [next(loader) for _ in range(round(accum_steps * scheduled["batch_fraction"]))]
            loss, grad_norm = train_step(model, raw_model, optimizers, micro_batches, device, autocast, cfg.grad_clip)
            step, steps_this_run = step + 1, steps_this_run + 1
            if ema and step % cfg.ema_every == 0:
                ema.update()
            dt, stopping = time.perf_counter() - t0, stop_signal.received
            if ddp:  # the slowest rank's step time and any rank's signal, so all ranks decide alike
                agreed = torch.tensor([dt, float(stopping)], dtype=torch.float64)
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=control)
                dt, stopping = agreed[0].item(), bool(agreed[1].item())
            do_log = step % cfg.log_every == 0 or step == cfg.max_steps
            do_eval = cfg.eval_every and step % cfg.eval_every == 0
            do_checkpoint = (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or stopping
            if do_log or do_eval or do_checkpoint:  # the only device-to-host syncs of the loop
                stats = torch.stack([loss, grad_norm.to(loss)])
                if ddp:
                    dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                loss_value, norm_value = stats.tolist()
                if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
                    raise FloatingPointError(
                        f"step {step}: loss {loss_value}, gradient norm {norm_value}; training stopped and no "
                        f"checkpoint was written past the last good one in {cfg.out_dir}. Try a lower --matrix_lr "
                        f"or --embedding_lr, a smaller --grad_clip, or --dtype=float32"
                    )
            if steps_this_run <= cfg.startup_steps:
                startup_time += dt
            else:
                train_time += dt
                interval_time += dt
                interval_tokens += len(micro_batches) * micro_tokens
            if do_log:
                tokens_per_s = interval_tokens / interval_time if interval_time else 0.0
                mfu = tokens_per_s * flops_per_token / peak
                speed = f"{tokens_per_s:,.0f} tok/s | MFU {100 * mfu:.1f}%" if interval_time else "start-up step"
                log("train", f"step {step} | loss {loss_value:.4f} | lr x{lr_scale:.3f} | {speed} | {train_time:.1f}s",
                    step=step, loss=loss_value, grad_norm=norm_value, lr_scale=lr_scale, tokens_per_s=tokens_per_s,
                    mfu=mfu, train_time=train_time, startup_time=startup_time)
                interval_time, interval_tokens = 0.0, 0
            if do_eval:
                run_eval()
            if do_checkpoint:
                checkpoint(os.path.join(cfg.out_dir, f"ckpt_{step:07d}.pt"))
                if master:
                    for old in periodic_checkpoints(cfg.out_dir)[: -cfg.keep_checkpoints]:
                        os.remove(old)
            if stopping:
                log("stopped", f"stopped by a signal at step {step}; resume with --resume=latest", step=step)
                if ddp:
                    dist.destroy_process_group()
                return {"first_eval": first_eval, "final_eval": None, "step": step}

    if ema:
        ema.finish()
    final_eval = run_eval()
    checkpoint(os.path.join(cfg.out_dir, "final.pt"))
    log("done", f"{step} steps in {train_time:.1f}s of training (+{startup_time:.1f}s start-up steps); val_bpb "
        f"{first_eval['val_bpb']:.4f} -> {final_eval['val_bpb']:.4f}", step=step, train_time=train_time,
        startup_time=startup_time, **final_eval)
    if master and cfg.sample_tokens:
        prompt = torch.tensor([[enc.eot_token]], device=device)
        sampler = inference_model(raw_model.state_dict(), asdict(model_cfg), device)
        with autocast:
            out = sampler.generate(prompt, cfg.sample_tokens, temperature=0.8, generator=torch.Generator(device).manual_seed(cfg.seed))
        print("-" * 40 + "\n" + enc.decode(out[0, 1:].tolist()) + "\n" + "-" * 40)
    if ddp:
        dist.destroy_process_group()
    return {"first_eval": first_eval, "final_eval": final_eval, "step": step}


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ValueError, OSError, FloatingPointError) as e:
        sys.exit(f"error: {e}")

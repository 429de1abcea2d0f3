"""
Train a GPT from scratch. One process:

    python train.py                              # small model on built-in Shakespeare, a few CPU minutes
    python train.py --n_layer=6 --max_steps=500  # any config field, --field=value or --field value
    python train.py --help                       # every field with its default

Data-parallel, one rank per device (NeuronCore, GPU or CPU process):

    torchrun --standalone --nproc_per_node=4 train.py

The learning-rate schedule follows training progress: step / max_steps, or elapsed training time /
time_budget_s (the competition's fixed wall-clock budget). The training clock excludes start-up, the
first `startup_steps` steps (compilation), evaluation and checkpointing.
"""
import dataclasses
import difflib
import errno
import functools
import glob
import json
import logging
import math
import os
import pickle
import shutil
import signal
import sys
import time
import zipfile
from contextlib import nullcontext, suppress
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import data
from model import GPT, TYPE_NAMES, GPTConfig, opt


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
    resume: str = opt("", "'latest' (newest checkpoint in out_dir of this run's config) or a checkpoint path")
    resume_any_config: bool = opt(False, "let --resume=latest take a checkpoint whose run config differs from now")
    start_over: bool = opt(False, "start a new run in a used out_dir; its files move to out_dir/old_<time>/")
    # system
    device: str = opt("auto", "auto | neuron | cuda | cpu")
    dtype: str = opt("auto", "matmul precision: auto (bf16 where the device multiplies it fast) | bfloat16 | float32")
    peak_tflops: float = opt(0.0, "peak TFLOP/s of one rank for MFU; 0 = device table (measured on CPU)")
    compile_cache_dir: str = opt("neuron_cache", "persistent Neuron compilation cache (reused across runs)")
    compile: bool = opt(True, "torch.compile the training forward/backward (needs a C++ compiler on CPU)")
    seed: int = opt(1337, "seed of initialisation and data order")
    deterministic: bool = opt(False, "deterministic algorithms only (see README: what is bit-exact)")


# One-flag configurations. trn2: the Trainium Frontier baseline's shape (depth 10, width 640, 2048 context,
# ~60M parameters with its 8,192-token vocabulary) for one Trn2 chip and a 30-minute budget:
#   NEURON_LOGICAL_NC_CONFIG=2 torchrun --standalone --nproc_per_node=4 train.py --preset=trn2
# 524,288 tokens per step = 8 sequences x 2048 x 4 ranks x 8 micro-steps (or 8 ranks x 4 micro-steps).
PRESETS = {
    "trn2": dict(n_layer=10, n_embd=640, n_head=5, n_kv_head=5, sequence_len=2048, batch_size=8,
                 total_batch_tokens=524288, time_budget_s=1800.0, startup_steps=2, eval_tokens=1048576,
                 log_every=20, checkpoint_every=250, sample_tokens=200),
}


def split_flags(argv):
    """[(name, value)] from --name=value and --name value alike (the convention of data.py's argparse);
    --help stays a lone flag."""
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            pairs.append(("help", None))
        elif not arg.startswith("--") or arg == "--":
            sys.exit(f"error: arguments are --field=value or --field value, got {arg!r}")
        elif "=" in arg:
            pairs.append(tuple(arg[2:].split("=", 1)))
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            pairs.append((arg[2:], argv[i + 1]))
            i += 1
        else:
            sys.exit(f"error: {arg} needs a value: {arg}=VALUE or {arg} VALUE")
        i += 1
    return pairs


def print_help():
    print(__doc__)
    rows = [("--preset=NAME", f"apply a preset first: {', '.join(PRESETS)}")]
    for title, cls in (("model", GPTConfig), ("training", TrainConfig)):
        rows.append((f"{title}:", ""))
        rows += [(f"--{f.name}={str(f.default).lower() if isinstance(f.default, bool) else f.default}", f.metadata["help"])
                 for f in dataclasses.fields(cls)]
    width = max(len(flag) for flag, _ in rows)
    for flag, text in rows:
        print(f"  {flag:<{width}}  {text}" if text else f"\n{flag}")


def parse_args(argv):
    """--field=value (or --field value) for any TrainConfig or GPTConfig field, after the fields of
    --preset=NAME if given; unknown names get a close match suggested."""
    pairs = split_flags(argv)
    if ("help", None) in pairs:
        print_help()
        sys.exit(0)
    for name in [v for k, v in pairs if k == "preset"]:
        if name not in PRESETS:
            sys.exit(f"error: unknown --preset={name}; presets: {', '.join(PRESETS)}")
        pairs = [(k, str(v)) for k, v in PRESETS[name].items()] + pairs
    owners = {f.name: (cls, f) for cls in (TrainConfig, GPTConfig) for f in dataclasses.fields(cls)}
    values = {TrainConfig: {}, GPTConfig: {}}
    for key, value in pairs:
        if key == "preset":
            continue
        if key not in owners:
            near = difflib.get_close_matches(key, owners, n=1)
            sys.exit(f"error: unknown config field --{key}" + (f"; did you mean --{near[0]}?" if near else "") + " (--help lists all)")
        cls, f = owners[key]
        kind = type(f.default)
        try:
            values[cls][key] = {"true": True, "false": False}[value.lower()] if kind is bool else kind(value)
        except (KeyError, ValueError):
            sys.exit(f"error: --{key}={value!r} is not a valid {kind.__name__} (default {f.default!r})")
    # built from all values at once, so GPTConfig resolves n_kv_head=0 against the final n_head
    return TrainConfig(**values[TrainConfig]), GPTConfig(**values[GPTConfig])


# (low, high) inclusive, high None for no bound: numbers outside are refused before any data, model or device work
RANGES = {
    "batch_size": (1, None), "total_batch_tokens": (0, None),
    "matrix_lr": (0, None), "embedding_lr": (0, None), "head_lr": (0, None), "scalar_lr": (0, None),
    "weight_decay": (0, None), "muon_momentum": (0, 1), "muon_momentum_start": (0, 1),
    "muon_momentum_warmup_steps": (0, None), "muon_beta2": (0, 1), "grad_clip": (0, None),
    "warmup_steps": (0, None), "warmdown_frac": (0, 1), "final_lr_frac": (0, 1),
    "max_steps": (0, None), "time_budget_s": (0, None), "startup_steps": (0, None),
    "eval_every": (0, None), "eval_tokens": (1, None), "log_every": (1, None), "sample_tokens": (0, None),
    "checkpoint_every": (0, None), "keep_checkpoints": (1, None), "peak_tflops": (0, None),
    "seed": (0, 2**63 - 1),  # numpy's generator takes no negative seed
}
CHOICES = {"matrix_optimizer": ("muon", "adamw"), "device": ("auto", "neuron", "cuda", "cpu"),
           "dtype": ("auto", "bfloat16", "float32")}


def validate_config(cfg, model_cfg):
    """Every field's type, range and choices, all problems in one message with the fix. Needs no data,
    model or device, so main calls it first. (The tokenizer is checked when it is loaded.)"""
    problems = []
    for f in dataclasses.fields(cfg):
        value, kind = getattr(cfg, f.name), type(f.default)
        if not isinstance(value, (int, float) if kind is float else kind) or (kind is not bool and isinstance(value, bool)):
            problems.append(f"--{f.name}={value!r} must be {TYPE_NAMES[kind]}")
        elif f.name in RANGES:
            low, high = RANGES[f.name]
            if not (low <= value and (high is None or value <= high) and math.isfinite(value)):
                problems.append(f"--{f.name}={value} must be " + (f"between {low} and {high}" if high is not None else f">= {low}"))
        elif f.name in CHOICES and value not in CHOICES[f.name]:
            problems.append(f"--{f.name}={value!r}: use {' or '.join(CHOICES[f.name])}")
    if not problems:
        if not (cfg.max_steps or cfg.time_budget_s):
            problems.append("set --max_steps or --time_budget_s (or both), otherwise training never stops")
        if cfg.muon_momentum >= 1 or cfg.muon_momentum_start >= 1 or cfg.muon_beta2 >= 1:
            problems.append("Muon's momenta and --muon_beta2 must be below 1 (a decay of 1 never forgets)")
        if not cfg.out_dir:
            problems.append("--out_dir must name a folder")
    if problems:
        raise ValueError("; ".join(problems) + " (--help lists every field)")
    model_cfg.validate()


def check_device(device_type):
    """Refuse a device this machine lacks, before data preparation and model building."""
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device=cuda: no CUDA device is available to this torch ({torch.__version__}, "
                         f"built with CUDA {torch.version.cuda}); use --device=cpu or --device=auto")
    if device_type == "neuron":
        try:
            import torch_neuronx  # noqa: F401  registers the "neuron" device
        except ImportError as e:
            raise ValueError(f"--device=neuron needs torch_neuronx ({e}); install the Neuron SDK or use --device=auto") from e


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


def configure_determinism(cfg):
    """--deterministic: torch's deterministic kernels everywhere (an error where an op has none) and
    Inductor's deterministic mode (no benchmark-picked kernels, whose choice can vary run to run).
    Results are then the same bit for bit across runs on one machine with one torch build and the same
    thread count (OMP_NUM_THREADS): reductions split over threads add in another order with another count."""
    if not cfg.deterministic:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition for deterministic matmuls
    torch.use_deterministic_algorithms(True)
    import torch._inductor.config as inductor_config

    inductor_config.deterministic = True
    inductor_config.fallback_random = True  # random ops in compiled code draw what eager would


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
    """Muon for the hidden matrices; AdamW for the lookup table and the head (whose rows see very different
    gradient scales) and for any 0-D or 1-D parameter. Every hyperparameter the schedule changes is a 0-d
    tensor on the device (AdamW takes a tensor lr when fused, or capturable on Neuron)."""
    named = dict(model.named_parameters())
    embedding, head = named.pop("wte.weight"), named.pop("lm_head.weight")
    matrices = [p for p in named.values() if p.ndim == 2]
    scalars = [p for p in named.values() if p.ndim < 2]
    device = embedding.device
    fused = device_type in ("cpu", "cuda")
    adamw_kwargs = dict(betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0, fused=fused or None,
                        capturable=not fused, foreach=None if fused else True)
    groups = [{"params": [embedding], "lr": cfg.embedding_lr}, {"params": [head], "lr": cfg.head_lr}]
    if scalars:
        groups.append({"params": scalars, "lr": cfg.scalar_lr})
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
    muon_momentum_start over muon_momentum_warmup_steps, as the baseline does) and Muon's weight decay
    (linearly to zero at the end of training, nanochat's rule)."""
    warm = min(1.0, step / cfg.muon_momentum_warmup_steps) if cfg.muon_momentum_warmup_steps else 1.0
    return {"lr_scale": lr_multiplier(cfg, step, progress),
            "momentum": cfg.muon_momentum_start + warm * (cfg.muon_momentum - cfg.muon_momentum_start),
            "weight_decay": cfg.weight_decay * (1 - progress)}


def apply_schedule(optimizers, values):
    """Writes this step's values into the 0-d device tensors the optimizers read, each by a copy from a
    host tensor. Nothing in the step then takes a Python number that changes from step to step: on Neuron
    a changed scalar argument re-traces and recompiles (a competitor measured 408 vs 918 steps in 900 s
    on Trn2 until their hyperparameters became device tensors; CONTEST.md)."""
    for o in optimizers:
        for group in o.param_groups:
            group["lr"].copy_(torch.tensor(group["peak_lr"] * values["lr_scale"]), non_blocking=True)
            if isinstance(o, Muon):
                group["momentum"].copy_(torch.tensor(values["momentum"]), non_blocking=True)
                group["weight_decay"].copy_(torch.tensor(values["weight_decay"]), non_blocking=True)


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
    for i, (x, y) in enumerate(micro_batches):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        # with DDP, gradients are all-reduced only on the last micro-step
        sync = model.no_sync() if ddp and i < len(micro_batches) - 1 else nullcontext()
        with sync:
            with autocast:
                loss = model(x, y) / len(micro_batches)
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
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:  # a full disk shows as either, depending on where the write stops
        with suppress(FileNotFoundError):  # the half-written file would only take space; the previous one is untouched
            os.remove(tmp)
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
        reason = e.strerror if isinstance(e, OSError) else str(e).splitlines()[0]
        raise OSError(f"cannot write checkpoint {path} ({reason}; {free / 2**20:.1f} MiB "
                      "free there); the previous checkpoints are intact: free space and resume with --resume=latest") from e
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


class CheckpointError(ValueError):
    """A file that is not a usable checkpoint; the message names it and says why."""


CHECKPOINT_KEYS = ("model", "optimizers", "step", "train_time", "loader", "rng", "train_config", "model_config")


def load_checkpoint(path, device="cpu", keys=CHECKPOINT_KEYS, mmap=False):
    """Tensors and plain containers only (weights_only=True): a checkpoint can never run code. Every way a
    file can be unusable (empty, cut short, not a checkpoint, a pickled object, keys missing) raises
    CheckpointError naming it; torch's own advice for some of these (weights_only=False) would be unsafe.
    mmap: map the tensors instead of reading them, to look at a checkpoint's configs cheaply."""
    size = os.path.getsize(path)  # a missing file raises FileNotFoundError, which names it
    if size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes): it was never written; use another checkpoint")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive whose directory is at its end
        raise CheckpointError(f"checkpoint {path} ({size:,} bytes) is not a PyTorch checkpoint: truncated, or another "
                              "kind of file; use another checkpoint")
    try:
        state = torch.load(path, map_location=device, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:  # torch's message advises weights_only=False: not for a file like this
        what = next((line.strip() for line in str(e).splitlines() if "unsupported" in line.lower()), "unknown content")
        raise CheckpointError(f"checkpoint {path} holds objects other than tensors and plain containers, refused "
                              f"unloaded ({what}); only load files you trust") from e
    except RuntimeError as e:  # the zip reader's errors: a damaged archive whose directory survived
        raise CheckpointError(f"checkpoint {path} is damaged ({str(e).splitlines()[0]}); use another checkpoint") from e
    missing = [k for k in keys if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {', '.join(missing)}: it was not written by this train.py")
    return state


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
    state = load_checkpoint(checkpoint_path, device, keys=("model", "model_config"))
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
    """Prints on rank 0 and appends one JSON object per event to <out_dir>/log.jsonl. Each line goes out
    in one write, and a write that fails is cut back off, so a crash leaves at most one torn last line;
    appending (a resumed run) first cuts such a line off and then writes a "resume" marker."""

    def __init__(self, out_dir, enabled, append):
        self.path = os.path.join(out_dir, "log.jsonl")
        self.file = None
        if not enabled:
            return
        self.file = open(self.path, "ab" if append else "wb", buffering=0)
        if append:
            torn = self._cut_torn_line()
            self._write({"event": "resume", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torn_bytes_dropped": torn})

    def _cut_torn_line(self):
        """Drops an unterminated last line (a crash mid-write) so new lines do not run on from it; returns
        its length. Read whole: this happens once per resume, and a log is a few MB at most."""
        with open(self.path, "rb") as f:
            content = f.read()
        keep = content.rfind(b"\n") + 1
        os.truncate(self.path, keep)
        return len(content) - keep

    def _write(self, record):
        line = (json.dumps(record) + "\n").encode()
        start = self.file.tell()
        try:
            done = 0
            while done < len(line):  # an unbuffered write may take part of the line
                done += self.file.write(line[done:])
        except OSError as e:
            with suppress(OSError):  # not to leave half a line; if this fails too, the next resume cuts it
                self.file.truncate(start)
            hint = "; free space and resume with --resume=latest" if e.errno == errno.ENOSPC else ""
            raise OSError(f"cannot write {self.path}: {e.strerror}{hint}") from e

    def __call__(self, event, text, **fields):
        if self.file:
            print(text, flush=True)
            self._write({"event": event, **fields})


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


# TrainConfig fields a resumed run may change without becoming another run: how long it goes on, what it
# logs and saves, and where it runs. Any other difference makes a checkpoint another run's.
RESUME_MAY_CHANGE = {"max_steps", "time_budget_s", "startup_steps", "eval_every", "eval_tokens", "log_every",
                     "sample_tokens", "out_dir", "checkpoint_every", "keep_checkpoints", "resume", "resume_any_config",
                     "start_over", "device", "peak_tflops", "compile_cache_dir", "compile", "data_dir", "deterministic"}


def config_differences(state, cfg, model_cfg):
    """(incompatible, other): 'field (checkpoint X, now Y)' for the differences that make the checkpoint
    unloadable (model shape, optimizer kind) and for the rest of the run config."""
    def differ(saved, now, skip=()):
        return [f"{k} (checkpoint {saved[k]!r}, now {v!r})" for k, v in now.items()
                if k in saved and k not in skip and saved[k] != v]

    now = asdict(cfg)
    skip = RESUME_MAY_CHANGE | {"matrix_optimizer"} | ({"dtype"} if cfg.dtype == "auto" else set())
    incompatible = differ(state["model_config"], asdict(model_cfg))
    incompatible += differ(state["train_config"], {"matrix_optimizer": cfg.matrix_optimizer})
    return incompatible, differ(state["train_config"], now, skip)


def is_rank0():
    return int(os.environ.get("RANK", "0")) == 0  # torchrun sets it, also before the process group exists


def say(text):
    if is_rank0():
        print(text, flush=True)


def resolve_resume(cfg, model_cfg):
    """The checkpoint to resume from. An explicit path is taken if it can be loaded into this run (another
    model shape or matrix optimizer cannot); --resume=latest takes the newest periodic checkpoint of out_dir
    whose run config matches this one (any loadable one with --resume_any_config), saying which it took
    and which it skipped and why."""
    if cfg.resume != "latest":
        if not os.path.exists(cfg.resume):
            raise FileNotFoundError(f"--resume={cfg.resume}: no such checkpoint")
        incompatible, other = config_differences(load_checkpoint(cfg.resume, mmap=True), cfg, model_cfg)
        if incompatible:
            raise CheckpointError(f"{cfg.resume} holds a different model or optimizer: {'; '.join(incompatible)}; "
                                  "pass the flags it was trained with")
        if other:
            say(f"resuming from {cfg.resume}, which was trained with other settings: {'; '.join(other)}")
        return cfg.resume
    found = periodic_checkpoints(cfg.out_dir)
    if not found:
        raise FileNotFoundError(f"--resume=latest: no ckpt_*.pt in {cfg.out_dir}; pass a checkpoint path instead")
    skipped = []
    for path in reversed(found):
        try:
            incompatible, other = config_differences(load_checkpoint(path, mmap=True), cfg, model_cfg)
        except CheckpointError as e:  # a damaged newest checkpoint should not hide a good older one
            skipped.append(f"{path}: {e}")
            continue
        if incompatible or (other and not cfg.resume_any_config):
            skipped.append(f"{path}: another run config: {'; '.join(incompatible + other)}")
            continue
        say(f"resuming from {path}" + (f" (its run config differs: {'; '.join(other)})" if other else "")
            + "".join(f"\n  skipped {s}" for s in skipped))
        return path
    hint = " or --resume_any_config=true to accept other settings" if not cfg.resume_any_config else ""
    raise CheckpointError(f"--resume=latest: no checkpoint in {cfg.out_dir} fits this run; pass the flags it was "
                          f"trained with{hint} (skipped {' | '.join(skipped)})")


RUN_FILES = ("log.jsonl", "final.pt", "ckpt_*.pt")


def check_out_dir(cfg):
    """A new run never writes over another run's files: with them in out_dir it is refused, or with
    --start_over they are moved to out_dir/old_<time>/ (by rank 0; the other ranks only check)."""
    if cfg.resume or not os.path.isdir(cfg.out_dir):
        return
    found = sorted(os.path.basename(p) for pattern in RUN_FILES for p in glob.glob(os.path.join(cfg.out_dir, pattern)))
    if not found:
        return
    listed = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    if not cfg.start_over:
        raise ValueError(f"--out_dir={cfg.out_dir} holds another run's files ({listed}): continue that run with "
                         "--resume=latest, choose a new --out_dir, or pass --start_over=true to move them aside")
    if is_rank0():
        old = os.path.join(cfg.out_dir, time.strftime("old_%Y%m%d-%H%M%S"))
        os.makedirs(old)
        for name in found:
            os.replace(os.path.join(cfg.out_dir, name), os.path.join(old, name))
        say(f"--start_over: moved {listed} to {old}/")


def main(argv):
    cfg, model_cfg = parse_args(argv)
    logging.basicConfig(format="%(name)s: %(message)s")
    # --- checks that need no data, model or device: fail before any expensive work
    validate_config(cfg, model_cfg)
    configure_determinism(cfg)
    enc = data.get_tokenizer(cfg.tokenizer, cfg.dataset, cfg.data_dir)
    model_cfg.vocab_size = enc.n_vocab
    model_cfg.validate()
    device_type = detect_device() if cfg.device == "auto" else cfg.device
    check_device(device_type)
    check_out_dir(cfg)  # after the other checks: with --start_over it moves files

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
    resume_path = resolve_resume(cfg, model_cfg) if cfg.resume else None
    state = load_checkpoint(resume_path) if resume_path else None
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
                              rank, world_size, cfg.seed, enc.n_vocab)
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
            apply_schedule(optimizers, scheduled)
            lr_scale = scheduled["lr_scale"]
            micro_batches = [next(loader) for _ in range(accum_steps)]
            loss, grad_norm = train_step(model, raw_model, optimizers, micro_batches, device, autocast, cfg.grad_clip)
            step, steps_this_run = step + 1, steps_this_run + 1
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
                interval_tokens += total_tokens
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
    # the foreseeable failures (bad flags, files, devices, data, a full disk, a diverged run) carry their
    # fix in one line; anything else is a bug and keeps its traceback
    except (ValueError, OSError, FloatingPointError, data.DataError) as e:
        sys.exit(f"error: {e}")

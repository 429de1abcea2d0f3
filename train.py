"""
Train a GPT from scratch. One process:

    python train.py                              # small model on built-in Shakespeare, a few CPU minutes
    python train.py --n_layer=6 --max_steps=500  # any config field, --field=value or --field value
    python train.py --help                       # every field with its default

Data-parallel, one rank per device (NeuronCore, GPU or CPU process):

    torchrun --standalone --nproc_per_node=4 train.py

Beside the contest's prepare.py (the AWS Trainium Frontier kit), a bare `train.py` trains on the contest's
data and tokenizer under the contest's clock (competition mode); `--export_submission=PATH` writes this
kit as the one-file train.py that the contest takes.

The clock is the contest's: device-synchronised wall-clock time from the end of the first `startup_steps`
steps (compilation), with start-up beyond `startup_cap_s` charged too. Evaluations, checkpoints and the
final save are on it; the run stops early enough for the final save to land inside `time_budget_s`.
The learning-rate schedule follows progress: step / max_steps or charged time / time_budget_s.
"""
import ast
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
import statistics
import sys
import time
from contextlib import nullcontext, suppress
from dataclasses import asdict, dataclass
from types import SimpleNamespace
import zipfile

PROCESS_START = time.monotonic()  # the contest charges start-up from the process's start
# The Neuron compiler's flags, for every entry point (bench.py and evaluate.py import this module before they
# compile anything): TorchNeuron reads NEURON_CC_FLAGS each time it compiles a graph or an op, not at import
# (torch_neuronx/csrc/core/KernelExecution.cpp, GetCompileAdditionalArgs: getenv("NEURON_CC_FLAGS"); public
# copy in parmoham-aws/test-repo-parmoham), and puts them in the compile cache's key. Competitors measured
# half the throughput without -O1 (marker2601/trainium-simulator docs/FINDINGS.md). Precision is left to the
# graph (autocast), not to the compiler. A user's own setting wins.
os.environ.setdefault("NEURON_CC_FLAGS", "--optlevel=1 --auto-cast=none")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from kernels import preview_fallbacks  # noqa: E402
from model import GPT, TYPE_NAMES, GPTConfig, opt  # noqa: E402


@dataclass
class TrainConfig:
    # data
    dataset: str = opt("shakespeare", "shakespeare (built in) or a dataset prepared by data.py")
    tokenizer: str = opt("bytes", "bytes (257 ids, offline) | gpt2 | bpe<N> | competition (see data.py)")
    data_dir: str = opt("data_cache", "where token shards are prepared and read")
    # batch: tokens per optimizer step = batch_size * sequence_len * world_size * accumulation steps
    batch_size: int = opt(8, "sequences per micro-batch per rank")
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
    time_budget_s: float = opt(150.0, "charged seconds the run may take, final save included; 0 = no limit")
    startup_steps: int = opt(1, "first steps before the clock starts (compilation); the contest's is 5")
    startup_cap_s: float = opt(900.0, "start-up (process start to the clock's start) beyond this is charged")
    # evaluation and logging
    eval_every: int = opt(0, "evaluate every N steps; 0 = only before and after training")
    charge_evals: bool = opt(True, "periodic evaluations and checkpoints count against time_budget_s")
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
    compile: bool = opt(True, "torch.compile the training forward/backward (needs a C++ compiler on CPU)")
    seed: int = opt(1337, "seed of initialisation and data order")
    deterministic: bool = opt(False, "deterministic algorithms only (see README: what is bit-exact)")
    # the contest (AWS Trainium Frontier)
    competition_dir: str = opt("", "folder of the contest's prepare.py; '' = beside train.py (then it is used)")
    export_submission: str = opt("", "write this kit as one train.py for upload, these flags its defaults")
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


def cpu_matmul_gflops(n=256, repeats=3):
    """{dtype: GFLOP/s} of an n x n F.linear (the op nn.Linear runs, which in bf16 takes oneDNN where a plain
    bf16 matmul may not) in bf16 and fp32 on one thread, the two interleaved and the best of `repeats`
    kept, so a busy machine slows both alike (~0.1 s even where bf16 is slow)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    operands = {dtype: (torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)) for dtype in (torch.bfloat16, torch.float32)}
    best = dict.fromkeys(operands, float("inf"))
    for _ in range(repeats + 1):  # the first round pays for library set-up, and is as good as any other
        for dtype, (a, b) in operands.items():
            t0 = time.perf_counter()
            F.linear(a, b)
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
    of a few large F.linear calls (nn.Linear's op) in the compute dtype, so MFU compares like with like."""
    if override_tflops:
        return override_tflops * 1e12
    if device_type == "neuron":
        generation = trainium_generation()
        cores_per_rank = 1 if generation == "trn1" else int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2"))
        return PEAK_FLOPS[generation] * cores_per_rank
    if device_type == "cuda":
        name = torch.cuda.get_device_name()
        return next((v for k, v in PEAK_FLOPS.items() if k in name), float("nan"))
    for n in (1024, 2048):  # 2048 only where 1024 is quick: a slow dtype then costs seconds, not minutes
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            F.linear(a, b)
            best = min(best, time.perf_counter() - t0)
        if best > 0.1:
            break
    return 2 * n**3 / best


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
        optimizers.append(Muon(matrices, cfg.matrix_lr, cfg.muon_momentum, cfg.muon_beta2, cfg.weight_decay, dtype,
                               compile=cfg.compile and device_type in ("cpu", "cuda")))
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


def wrap_for_training(raw_model, cfg, device_type, device, example):
    """The module the training step calls: compiled if asked, and DDP-wrapped under torchrun. `example`:
    arguments of one forward call (their shapes, dtypes and devices: the kernels' fallbacks are decided and
    logged on them before compilation, as they cannot be from inside the compiled graph)."""
    model = raw_model
    if cfg.compile:
        with autocast_context(cfg, device_type):
            preview_fallbacks(raw_model, *example)
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

def write_atomically(path, payload):
    """torch.save to a temporary file, fsync, rename over the target, fsync the folder: a crash at any
    moment leaves the old file or the new one, never a torn one. A full disk names the file."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        os.fsync(dir_fd)  # make the rename itself durable
        os.close(dir_fd)
    except (OSError, RuntimeError) as e:  # a full disk shows as either, depending on where the write stops
        with suppress(FileNotFoundError):  # the half-written file would only take space
            os.remove(tmp)
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
        reason = e.strerror if isinstance(e, OSError) else str(e).splitlines()[0]
        raise OSError(f"cannot write {path} ({reason}; {free / 2**20:.1f} MiB free there); the previous file there "
                      "and earlier checkpoints are intact: free space and resume with --resume=latest") from e


def save_checkpoint(path, model, optimizers, step, train_time, loader_state, train_cfg, model_cfg):
    """Everything a run needs to continue exactly: weights, optimizer state, step, charged time, data
    position, RNG and both configs."""
    write_atomically(path, {
        "model": model.state_dict(),
        "optimizers": [o.state_dict() for o in optimizers],
        "step": step,
        "train_time": train_time,
        "loader": loader_state,
        "rng": torch.get_rng_state(),
        "train_config": asdict(train_cfg),
        "model_config": asdict(model_cfg),
    })


def save_final(path, model, model_cfg, train_cfg, step, train_time):
    """final.pt: the weights and the configs, no optimizer state (a third of a resumable checkpoint); the
    scorer's load_for_eval reads the weights and model config, evaluate.py the tokenizer named in the run
    config. Refuses non-finite weights rather than write a model that scores NaN."""
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise FloatingPointError(f"not writing {path}: parameters {bad[:3]} hold non-finite values")
    write_atomically(path, {"model": model.state_dict(), "model_config": asdict(model_cfg),
                            "train_config": asdict(train_cfg), "step": step, "train_time": train_time})


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
    if "optimizers" in missing and isinstance(state, dict) and {"model", "model_config"} <= state.keys():
        raise CheckpointError(f"checkpoint {path} holds the weights only (a final.pt, for evaluation); resume from "
                              "a ckpt_*.pt (written with --checkpoint_every or by a stop signal)")
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {', '.join(missing)}: it was not written by this train.py")
    return state


def inference_model(weights, model_config, device):
    """A single-device GPT in eval mode for evaluation and sampling, on the kernels the run trained with,
    except that "nki" becomes "auto": prompts come in any length, and "nki" would refuse one that is not a
    multiple of 128 (or a machine without NKI) where "auto" falls back to PyTorch for it and logs why once.
    A --kernels=torch run is scored on PyTorch, paying no NKI compilation for the scorer's shapes."""
    kernels = "torch" if model_config.get("kernels") == "torch" else "auto"
    model = GPT(GPTConfig(**{**model_config, "kernels": kernels}))
    model.load_state_dict(weights)
    return model.to(device).eval()


def load_for_eval(checkpoint_path, device="cpu"):
    """The contest's scoring hook: a frozen, single-device model whose forward(idx) returns causal
    next-token logits (B, T, vocab) for any T (rotary tables grow on demand), from final.pt or any
    checkpoint this script wrote. The scorer applies no autocast (CONTEST.md), so on Trainium and GPUs
    the weights themselves are bf16 and the model computes in bf16; on a CPU it stays fp32."""
    device, state = torch.device(device), load_checkpoint(checkpoint_path, "cpu", keys=("model", "model_config"))
    model = inference_model(state["model"], state["model_config"], "cpu")
    if device.type in ("cuda", "neuron"):
        model = model.to(torch.bfloat16)
    return model.to(device).requires_grad_(False)


# -----------------------------------------------------------------------------
# evaluation

@torch.no_grad()
def evaluate(model, batches, token_bytes, device, autocast, stop=None, group=None):
    """Mean val loss over all target tokens, and val_bpb = nats / (ln 2 * bytes) over the target tokens
    that stand for bytes (document boundaries stand for none). Sums are reduced over all ranks (`group`: a
    CPU (gloo) group under torchrun). A stop request (`stop.received`) ends it early: the numbers then
    cover the batches done. The per-token losses are summed on the CPU in float64: a Neuron device narrows
    float64 to 32 bits (torch_neuronx python_ops/base.py), and the byte mask is a product, not an index,
    so no shape depends on the data."""
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64)  # nats, tokens, nats of byte tokens, bytes
    token_bytes = token_bytes.cpu().double()
    for x, y in batches:
        if stop is not None and stop.received:
            break
        with autocast:
            loss = model(x.to(device), y.to(device), loss_reduction="none").float().cpu().double()
        nbytes = token_bytes[y.cpu()]
        sums += torch.stack([loss.sum(), torch.tensor(float(y.numel()), dtype=torch.float64),
                             (loss * (nbytes > 0)).sum(), nbytes.sum()])
    if dist.is_initialized():
        dist.all_reduce(sums, group=group)
    model.train()
    nats, tokens, byte_nats, nbytes = sums.tolist()
    return {"val_loss": nats / max(tokens, 1), "val_bpb": byte_nats / (math.log(2) * max(nbytes, 1))}


# -----------------------------------------------------------------------------
# the contest's contract: its prepare.py, its clock, the one-file submission

def find_prepare(cfg):
    """The contest's prepare.py as a module, or None. Looked for in --competition_dir, else beside this
    script, which is where the organiser's kit keeps it; with it there a bare `train.py` (the contest's
    launch string takes no flags) trains on the contest's data."""
    folder = cfg.competition_dir or os.path.dirname(os.path.abspath(__file__))
    if not os.path.isfile(os.path.join(folder, "prepare.py")):
        if cfg.competition_dir:
            raise FileNotFoundError(f"--competition_dir={cfg.competition_dir} has no prepare.py")
        return None
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import prepare

    return prepare


class KitCorpus:
    """The kit's own corpora and tokenizers (data.py): shards prepared once by rank 0, then read by every
    rank, and a held-out split for val_bpb."""

    def __init__(self, cfg):
        import data  # the kit's data path; a submission reads the contest's data through prepare.py

        self.data, self.cfg = data, cfg
        self.enc = data.get_tokenizer(cfg.tokenizer, cfg.dataset, cfg.data_dir)
        self.vocab_size, self.decode, self.bos_id = self.enc.n_vocab, self.enc.decode, self.enc.eot_token

    def load(self, batch_size, sequence_len, rank, world_size, device, master):
        cfg, data = self.cfg, self.data
        if not master and dist.is_initialized():
            dist.barrier()  # released below, once rank 0 has the shards
        path = data.prepare(cfg.dataset, cfg.tokenizer, cfg.data_dir)
        if master and dist.is_initialized():
            dist.barrier()
        self.loader = data.TokenLoader(data.shard_paths(path, "train"), batch_size, sequence_len, rank, world_size,
                                       cfg.seed, self.vocab_size, shuffle=cfg.data_order == "shuffled",
                                       row_pool=cfg.row_pool, ignore_target=self.bos_id if cfg.mask_bos_targets else None)
        self.val_batches = data.eval_batches(data.shard_paths(path, "val"), batch_size, sequence_len,
                                             cfg.eval_tokens, rank, world_size, self.vocab_size)
        self.token_bytes = data.token_bytes(self.enc).to(device)

    def next_batch(self):
        return next(self.loader)

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state):
        self.loader.load_state_dict(state)


class ContestCorpus:
    """The contest's data through its prepare.py: its tokenizer (vocabulary 8,192, BOS 8188) and its own
    make_dataloader, the organiser's loader, chosen over the evaluator-layout loader FrontierForge wrote
    because it needs only prepare.py's public names. No validation data is read inside the run: the
    contest's review rejected in-script evaluation on it (CONTEST.md); `python evaluate.py` scores a
    checkpoint with prepare.py's own evaluate_bpb instead."""

    val_batches = token_bytes = decode = None

    def __init__(self, prepare, mask_bos_targets=False):
        self.prepare, self.mask_bos_targets = prepare, mask_bos_targets
        self.tokenizer = prepare.ensure_tokenizer(build_if_missing=False)
        self.vocab_size, self.bos_id = self.tokenizer.get_vocab_size(), self.tokenizer.get_bos_token_id()

    def load(self, batch_size, sequence_len, rank, world_size, device, master):  # the loader shards by rank itself
        self.batches = self.prepare.make_dataloader(self.tokenizer, batch_size, sequence_len, "train", device)

    def next_batch(self):
        x, y, _ = next(self.batches)
        if self.mask_bos_targets:  # the next document's BOS cannot be predicted; the same constant every step
            y = y.masked_fill(y == self.bos_id, -1)
        return x, y

    def state_dict(self):  # the organiser's loader has no position to save: a resumed run starts it anew
        return None

    def load_state_dict(self, state):
        pass


def apply_contest_rules(cfg, prepare):
    """The constants the contest's prepare.py fixes, and the harness's output folder, over any flag."""
    cfg.time_budget_s = float(prepare.TRAIN_TIME_BUDGET_SECONDS)
    cfg.startup_steps = int(prepare.TRAIN_STARTUP_STEPS_EXCLUDED)
    cfg.startup_cap_s = float(prepare.TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS)
    cfg.out_dir = os.environ.get("NEURON_COMPETITION_R1_OUT_DIR", cfg.out_dir)  # the baseline's --out-dir default
    cfg.eval_every, cfg.sample_tokens = 0, 0


class ChargedClock:
    """The contest's training clock (prepare.py's TRAIN_* constants, as the baseline-derived train.py files
    of FrontierForge, recipes/K82s4/train.py, and poojith's ledger apply them; CONTEST.md "Clock"):
    wall-clock seconds from the end of the `excluded_steps`-th step of this process, plus whatever of the
    start-up before it (from the process's start) exceeds `startup_cap_s`. Everything after that moment
    is charged (steps, evaluations, checkpoints, the final save) except what `exclude` takes off.
    `already` carries the charged time of the run a checkpoint resumes."""

    def __init__(self, budget_s, excluded_steps, startup_cap_s, already=0.0, process_start=PROCESS_START,
                 now=time.monotonic):
        self.budget_s, self.excluded_steps, self.startup_cap_s = budget_s, excluded_steps, startup_cap_s
        self.already, self.process_start, self.now = already, process_start, now
        self.started = None
        self.startup_s = self.excluded_s = 0.0

    def steps_done(self, steps_this_run):
        """Called after each synchronised step (and with 0 before the first)."""
        if self.started is None and steps_this_run >= self.excluded_steps:
            now = self.now()
            self.startup_s = now - self.process_start
            self.started = now - max(0.0, self.startup_s - self.startup_cap_s)

    def exclude(self, seconds):
        self.excluded_s += seconds

    def charged(self):
        running = self.now() - self.started - self.excluded_s if self.started is not None else 0.0
        return self.already + running

    def out_of_time(self, charged, next_step_s, reserve_s):
        """True when one more step and the final save would not fit in the budget (`charged`: the value the
        ranks agreed on)."""
        return bool(self.budget_s) and self.started is not None and charged + next_step_s + reserve_s >= self.budget_s



SUBMISSION_ARGS = []  # export_submission writes the exporting run's flags here: the upload's defaults
# What the one-file submission leaves out: the kit's own data path (and with it data.py and its downloads)
# and the exporter, each replaced by a stand-in that says why ("" = nothing left refers to it).
KIT_ONLY = {
    "KitCorpus": "def KitCorpus(cfg):\n    raise FileNotFoundError(\"no prepare.py beside this train.py: a submission "
                 "trains on the contest's data only\")\n",
    "export_submission": "def export_submission(*args):\n    raise ValueError(\"export from the kit's train.py\")\n",
    "bundle_source": "",
    "check_submission": "",
    "check_causality": "",
    "SUBMISSION_LIMIT_BYTES": "",
    "SUBMISSION_IMPORTS": "",
    "KIT_ONLY": "",
}


def bundle_source(train_path, argv):
    """This kit as one train.py: kernels.py and model.py in place of `from model import ...`, module-qualified
    names (`kernels.mlp`) made plain, the KIT_ONLY definitions (and so data.py, with its downloads) left
    out, and `argv` baked in as SUBMISSION_ARGS. Comments and docstrings are kept, so it reads as the kit
    does. Raises ValueError where the pieces would clash."""
    folder = os.path.dirname(os.path.abspath(train_path))
    texts = {name: open(os.path.join(folder, f"{name}.py")).read() for name in ("kernels", "model", "train")}

    def defined_names(node):
        return {n for n in [getattr(node, "name", None)] + [t.id for t in getattr(node, "targets", [])
                                                            if isinstance(t, ast.Name)] if n}

    def body(name, inline=None):
        """A module's text, top-level statement by statement (each with the comments above it)."""
        text, tree = texts[name], ast.parse(texts[name])
        lines, out, previous_end, inlined = text.splitlines(keepends=True), [], 0, False
        for node in tree.body:
            start, end = node.lineno - 1, node.end_lineno
            while start > previous_end and lines[start - 1].lstrip().startswith(("#", "@")):
                start -= 1  # comments and decorators belong to the statement below them
            chunk, gap = "".join(lines[start:end]), "".join(lines[previous_end:start])
            previous_end = end
            names = defined_names(node)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and node is tree.body[0]:
                if name != "train":  # other modules' docstrings become comments
                    chunk = "".join(f"# {line}".rstrip() + "\n" for line in node.value.value.strip().splitlines())
            elif isinstance(node, (ast.Import, ast.ImportFrom)) and {a.name.split(".")[0] for a in node.names} & {"kernels", "model", "data"} \
                    or isinstance(node, ast.ImportFrom) and node.module in ("model", "kernels", "data"):
                chunk, inlined = (inline() if inline and not inlined else ""), True  # inlined at the first import
            elif names & set(KIT_ONLY):
                chunk = KIT_ONLY[(names & set(KIT_ONLY)).pop()]
            elif names == {"SUBMISSION_ARGS"}:
                chunk = f"SUBMISSION_ARGS = {argv!r}  # the flags of the run that exported this file\n"
            out.append(gap + chunk)
        out.append("".join(lines[previous_end:]))
        return "".join(out)

    defined = {}
    for name in ("kernels", "model", "train"):
        for node in ast.parse(texts[name]).body:
            for n in defined_names(node) - set(KIT_ONLY):
                if n in defined and defined[n] != name:
                    raise ValueError(f"{n} is defined in both {defined[n]}.py and {name}.py")
                defined[n] = name
    model_text = body("model").replace("kernels.", "")
    kernels_text = body("kernels")
    source = body("train", inline=lambda: f"\n# ===== kernels.py =====\n{kernels_text}\n# ===== model.py =====\n{model_text}\n# ===== train.py =====\n")
    check_submission(source)
    return source


SUBMISSION_LIMIT_BYTES = 262_144  # the contest portal's limit for train.py (FrontierForge, CONTEST.md)
SUBMISSION_IMPORTS = {"torch", "numpy", "nki", "torch_neuronx", "prepare"}


def check_submission(source):
    """What the contest takes: one file under the portal's size limit, importing only the standard
    library, torch, numpy, the Neuron stack and prepare.py, with no download code and nothing of the
    kit's own data path. Raises ValueError naming the first problem."""
    size = len(source.encode())
    if size > SUBMISSION_LIMIT_BYTES:
        raise ValueError(f"the submission is {size:,} bytes; the contest takes at most {SUBMISSION_LIMIT_BYTES:,}")
    tree = ast.parse(source)
    for node in ast.walk(tree):
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) else []
        for module in modules:
            top = module.split(".")[0]
            if top not in SUBMISSION_IMPORTS and top not in sys.stdlib_module_names or top in ("urllib", "http", "socket", "requests"):
                raise ValueError(f"the submission imports {module}, which the contest's environment may lack or forbids")
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    leftovers = sorted(used & ({"data", "urlopen", "hf_hub_download"} | {k for k, v in KIT_ONLY.items() if not v}))
    if leftovers:
        raise ValueError(f"the submission still refers to {leftovers}, which it leaves out")
    if "def load_for_eval" not in source:
        raise ValueError("the submission defines no load_for_eval, which the scorer calls")


def check_causality(model, vocab_size, length, device, prepare=None, tokenizer=None):
    """Raises ValueError unless the model's logits at each position depend only on the tokens up to it:
    with the contest's prepare.py through its own causality_check (what the contest runs); otherwise by
    changing the tokens after several positions t, which must move no logit at or before t beyond float
    noise, and must move some logit after it (else the check itself is blind)."""
    if prepare is not None:
        result = prepare.causality_check(model, tokenizer, 1, length, device)
        if not result["passed"]:
            raise ValueError(f"prepare.py's causality_check failed: {result}")
        return
    generator = torch.Generator().manual_seed(3)
    idx = torch.randint(0, vocab_size, (1, length), generator=generator)
    with torch.no_grad():
        logits = model(idx.to(device)).float()
        for t in (0, length // 2 - 1, length // 2, length - 2):
            changed = idx.clone()
            changed[:, t + 1:] = torch.randint(0, vocab_size, (1, length - t - 1), generator=generator)
            other = model(changed.to(device)).float()
            leak = (other[:, :t + 1] - logits[:, :t + 1]).abs().max().item()
            if leak > 1e-5 * logits.abs().max().item():
                raise ValueError(f"changing tokens after position {t} changed logits at or before it by {leak:.3g}")
            if torch.equal(other[:, t + 1:], logits[:, t + 1:]):
                raise ValueError(f"changing tokens after position {t} changed no later logit: the check is blind")


def export_submission(cfg, model_cfg, argv, vocab_size, prepare, tokenizer):
    """Writes the one-file train.py after a causality check of the model it would train."""
    path = cfg.export_submission
    torch.manual_seed(cfg.seed)
    model = GPT(dataclasses.replace(model_cfg, vocab_size=vocab_size)).eval()
    for block in model.blocks:  # zero-initialised output projections would hide a leak
        for linear in (block.attn.c_proj, block.mlp.c_proj):
            torch.nn.init.normal_(linear.weight, std=0.02)
    try:
        check_causality(model, vocab_size, min(model_cfg.sequence_len, 256), "cpu", prepare, tokenizer)
    except ValueError as e:
        raise ValueError(f"not exporting: the model is not causal ({e})") from e
    # the contest's prepare.py sits beside the uploaded file, wherever this machine keeps its copy
    flags = [a for a in argv if not a.startswith(("--export_submission", "--competition_dir"))]
    source = bundle_source(__file__, flags)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(source)
    print(f"wrote {path}: {len(source.encode()):,} bytes (limit {SUBMISSION_LIMIT_BYTES:,}), defaults {flags}; "
          f"causality check passed")


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
    """SIGTERM (what schedulers send) or Ctrl-C asks the run to stop at its next safe point (after the
    current step, evaluation batch or save) with a resumable checkpoint or a finished final.pt; a second
    Ctrl-C interrupts at once. Installed for the whole run, start-up included."""

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


class Stopped(Exception):
    """A stop signal arrived before there was anything worth saving."""


# TrainConfig fields a resumed run may change without becoming another run: how long it goes on, what it
# logs and saves, and where it runs. Any other difference makes a checkpoint another run's.
RESUME_MAY_CHANGE = {"max_steps", "time_budget_s", "startup_steps", "eval_every", "eval_tokens", "log_every",
                     "sample_tokens", "out_dir", "checkpoint_every", "keep_checkpoints", "resume", "resume_any_config",
                     "start_over", "device", "peak_tflops", "compile", "data_dir", "deterministic", "startup_cap_s",
                     "charge_evals", "competition_dir", "export_submission"}


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


def setup(cfg, model_cfg, stop, argv):
    """Everything before the first step, cheapest checks first. Returns the run's state as a namespace
    (None after --export_submission, which trains nothing)."""
    run = SimpleNamespace(cfg=cfg, model_cfg=model_cfg, stop=stop)
    validate_config(cfg, model_cfg)
    configure_determinism(cfg)
    prepare = find_prepare(cfg)
    if prepare is not None:
        apply_contest_rules(cfg, prepare)
    corpus = ContestCorpus(prepare, cfg.mask_bos_targets) if prepare is not None else KitCorpus(cfg)
    model_cfg.vocab_size = corpus.vocab_size
    model_cfg.validate()
    device_type = detect_device() if cfg.device == "auto" else cfg.device
    check_device(device_type)
    if cfg.export_submission:
        export_submission(cfg, model_cfg, argv, corpus.vocab_size, prepare, getattr(corpus, "tokenizer", None))
        return None
    check_out_dir(cfg)  # after the other checks: with --start_over it moves files

    rank, world_size, device = setup_distributed(device_type)
    vars(run).update(rank=rank, world_size=world_size, device=device, device_type=device_type, master=rank == 0,
                     ddp=dist.is_initialized(), prepare=prepare, corpus=corpus)
    # every rank must agree each step on the clock and on a stop request; a CPU-side gloo group does that
    # without making the host wait for the accelerator
    run.control = dist.new_group(backend="gloo") if run.ddp else None
    dtype_reason = choose_dtype(cfg, device_type, run.control)
    if run.master:  # kernels.py says once, at INFO, why an operation runs on PyTorch instead of NKI
        logging.getLogger("kernels").setLevel(logging.INFO)
    micro_tokens = cfg.batch_size * model_cfg.sequence_len * world_size
    run.total_tokens = cfg.total_batch_tokens or micro_tokens
    if run.total_tokens % micro_tokens:
        raise ValueError(
            f"total_batch_tokens={run.total_tokens} is not a multiple of batch_size * sequence_len * world_size = "
            f"{cfg.batch_size} * {model_cfg.sequence_len} * {world_size} = {micro_tokens}"
        )
    run.accum_steps = run.total_tokens // micro_tokens
    validate_levers(cfg, model_cfg, run.accum_steps)
    if prepare is not None and cfg.row_pool:
        raise ValueError("--row_pool reorders the kit's loader; the contest's make_dataloader streams its own rows. "
                         "Pass --row_pool=0 in competition mode")
    resume_path = resolve_resume(cfg, model_cfg) if cfg.resume else None
    state = load_checkpoint(resume_path) if resume_path else None
    torch.manual_seed(cfg.seed)

    if run.master:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with torch.device("meta"):  # parameter count without allocating anything
            check_disk_space(cfg.out_dir, GPT(model_cfg).num_params(), cfg.keep_checkpoints)
    if prepare is not None and run.master:
        print(f"competition mode: {prepare.__file__}'s data, tokenizer and clock (budget {cfg.time_budget_s:.0f} s, "
              f"{cfg.startup_steps} start-up steps excluded, start-up beyond {cfg.startup_cap_s:.0f} s charged); "
              f"no evaluation inside the run; final.pt goes to {cfg.out_dir}", flush=True)
    corpus.load(cfg.batch_size, model_cfg.sequence_len, rank, world_size, device, run.master)
    if stop.received:
        raise Stopped("stopped by a signal while preparing data; nothing was trained, nothing to save")

    run.raw_model = GPT(model_cfg).to(device)
    run.optimizers = make_optimizers(run.raw_model, cfg, device_type, compute_dtype(cfg))
    run.step, already_charged = 0, 0.0
    if state:
        run.raw_model.load_state_dict(state["model"])
        for o, s in zip(run.optimizers, state["optimizers"]):
            o.load_state_dict(s)
        run.step, already_charged = state["step"], state["train_time"]
        corpus.load_state_dict(state["loader"])
        torch.set_rng_state(state["rng"])
        del state  # its tensors now live in the model and optimizers
    run.ema = WeightEMA(run.raw_model, cfg.ema_decay, cfg.ema_every, cfg.ema_blend) if cfg.ema_decay else None
    tokens = torch.zeros(cfg.batch_size, model_cfg.sequence_len, dtype=torch.long, device=device)
    run.model = wrap_for_training(run.raw_model, cfg, device_type, device, (tokens, tokens))
    run.autocast = autocast_context(cfg, device_type)
    run.flops_per_token = run.raw_model.flops_per_token()
    run.peak = peak_flops(device_type, compute_dtype(cfg), cfg.peak_tflops) * world_size
    run.log = Logger(cfg.out_dir, run.master, append=bool(cfg.resume))
    run.log("config", f"{run.raw_model.num_params():,} parameters, {run.flops_per_token / 1e6:.1f} MFLOP/token, "
            f"{world_size} rank(s) on {device_type}, {run.accum_steps} micro-step(s) of {micro_tokens:,} tokens per "
            f"step; computing in {cfg.dtype} because {dtype_reason}", train_config=asdict(cfg),
            model_config=asdict(model_cfg), world_size=world_size, device=device_type, dtype_reason=dtype_reason)
    run.reserve_s = measure_final_save(run)
    run.clock = ChargedClock(cfg.time_budget_s, cfg.startup_steps, cfg.startup_cap_s, already_charged)
    run.first_eval = run_eval(run) if corpus.val_batches is not None else None
    return run


def measure_final_save(run):
    """Seconds the final save will take, measured once by writing the same payload: the reserve the loop
    keeps so that final.pt lands inside the budget (twice the measurement, plus a second)."""
    path = os.path.join(run.cfg.out_dir, "final.pt.timing")
    t0 = time.monotonic()
    if run.master:
        save_final(path, run.raw_model, run.model_cfg, run.cfg, 0, 0.0)
        os.remove(path)
    reserve = 2 * (time.monotonic() - t0) + 1.0
    if run.ddp:  # every rank stops on the same step, so every rank keeps rank 0's reserve
        agreed = torch.tensor([reserve], dtype=torch.float64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=run.control)
        reserve = agreed.item()
    return reserve


def run_eval(run):
    # the uncompiled model: eval's no_grad forward would otherwise cost a second compilation
    metrics = evaluate(run.raw_model, run.corpus.val_batches, run.corpus.token_bytes, run.device, run.autocast, run.stop,
                       run.control)
    run.log("eval", f"step {run.step}: val_loss {metrics['val_loss']:.4f}, val_bpb {metrics['val_bpb']:.4f}",
            step=run.step, **metrics)
    return metrics


def checkpoint(run):
    path = os.path.join(run.cfg.out_dir, f"ckpt_{run.step:07d}.pt")
    if run.master:
        save_checkpoint(path, run.raw_model, run.optimizers, run.step, run.clock.charged(), run.corpus.state_dict(),
                        run.cfg, run.model_cfg)
        for old in periodic_checkpoints(run.cfg.out_dir)[: -run.cfg.keep_checkpoints]:
            os.remove(old)
    return path


def next_step_estimate(step_times):
    """Seconds the budget must still hold for one more step: the slowest of the last ten timed steps. (A
    median let one slow step of a loaded machine run past the end: 151.4 s charged of a 150 s budget.)
    Until a step after the start-up ones is timed there is no estimate: a start-up step's time includes
    compilation, and taken as the next step's it would end a short budget before training."""
    return max(step_times[-10:], default=0.0)


def train_loop(run):
    """Steps until the step limit, the budget (keeping the final save's reserve) or a stop signal. Each step
    is synchronised with the device before the clock is read, as the contest's clock is. Ranks agree after
    every step, on one all-reduce of host numbers, on the charged time (so they schedule alike), the loss,
    a non-finite value or a signal on any rank, and whether the budget has room for another step."""
    cfg, clock = run.cfg, run.clock
    steps_this_run, step_times, charged = 0, [], clock.charged()
    interval_time, interval_tokens = 0.0, 0
    clock.steps_done(0)
    while not (cfg.max_steps and run.step >= cfg.max_steps):
        t0 = time.monotonic()
        progress = max(run.step / cfg.max_steps if cfg.max_steps else 0.0, charged / cfg.time_budget_s if cfg.time_budget_s else 0.0)
        scheduled = schedule(cfg, run.step, progress)
        apply_schedule(run.optimizers, scheduled, run.raw_model)
        micro_batches = [run.corpus.next_batch() for _ in range(round(run.accum_steps * scheduled["batch_fraction"]))]
        loss, grad_norm = train_step(run.model, run.raw_model, run.optimizers, micro_batches, run.device,
                                     run.autocast, cfg.grad_clip)
        synchronize(run.device_type)
        run.step, steps_this_run = run.step + 1, steps_this_run + 1
        if run.ema and run.step % cfg.ema_every == 0:
            run.ema.update()
        if run.prepare is not None:  # the contest's own record of the step just finished (0-based, as the baseline)
            run.prepare.record_step_boundary(run.step - 1)
        loss_value, norm_value = torch.stack([loss, grad_norm.to(loss)]).tolist()
        finite = math.isfinite(loss_value) and math.isfinite(norm_value)
        dt = time.monotonic() - t0
        clock.steps_done(steps_this_run)
        if steps_this_run > cfg.startup_steps:
            step_times.append(dt)
            step_tokens = run.total_tokens * len(micro_batches) // run.accum_steps  # fewer during a batch warm-up
            interval_time, interval_tokens = interval_time + dt, interval_tokens + step_tokens
        t_side = time.monotonic()  # evaluations and checkpoints: never of a non-finite model
        if finite and cfg.eval_every and run.step % cfg.eval_every == 0 and run.corpus.val_batches is not None:
            run_eval(run)
        if finite and cfg.checkpoint_every and run.step % cfg.checkpoint_every == 0:
            checkpoint(run)
        if not cfg.charge_evals:
            clock.exclude(time.monotonic() - t_side)
        next_step_s = next_step_estimate(step_times)
        decision = [clock.charged(), next_step_s, loss_value, float(not finite), float(run.stop.received)]
        if run.ddp:  # the mean over ranks; a flag raised on any rank stays above zero
            agreed = torch.tensor(decision, dtype=torch.float64)
            dist.all_reduce(agreed, group=run.control)
            decision = (agreed / run.world_size).tolist()
        charged, next_step_s, loss_value, nonfinite, stopping = decision[0], decision[1], decision[2], decision[3] > 0, decision[4] > 0
        if nonfinite:
            raise FloatingPointError(
                f"step {run.step}: loss {loss_value}, gradient norm {norm_value}; training stopped and no "
                f"checkpoint was written past the last good one in {cfg.out_dir}. Try a lower --matrix_lr "
                f"or --embedding_lr, a smaller --grad_clip, or --dtype=float32")
        if run.step % cfg.log_every == 0 or run.step == cfg.max_steps or steps_this_run == 1:
            tokens_per_s = interval_tokens / interval_time if interval_time else 0.0
            mfu = tokens_per_s * run.flops_per_token / run.peak
            speed = f"{tokens_per_s:,.0f} tok/s | MFU {100 * mfu:.1f}%" if interval_time else "start-up step"
            run.log("train", f"step {run.step} | loss {loss_value:.4f} | lr x{scheduled['lr_scale']:.3f} | {speed} | "
                    f"charged {charged:.1f}s", step=run.step, loss=loss_value, grad_norm=norm_value,
                    lr_scale=scheduled["lr_scale"], tokens_per_s=tokens_per_s, mfu=mfu, train_time=charged,
                    startup_time=clock.startup_s)
            interval_time, interval_tokens = 0.0, 0
        if stopping:
            return "signal"
        if clock.out_of_time(charged, next_step_s, run.reserve_s):
            return "budget"
    return "steps"


def finish(run, ended_by):
    """The final save (inside the budget), then, off the clock and only with the kit's own data, the final
    evaluation and a sample."""
    cfg, clock = run.cfg, run.clock
    if ended_by == "signal":
        path = checkpoint(run)
        run.log("stopped", f"stopped by a signal at step {run.step}; {path} written, resume with --resume=latest",
                step=run.step)
        return {"first_eval": run.first_eval, "final_eval": None, "step": run.step}
    if run.ema:  # the final model is the blend of the live weights and their average
        run.ema.finish()
    if run.master:
        save_final(os.path.join(cfg.out_dir, "final.pt"), run.raw_model, run.model_cfg, cfg, run.step, clock.charged())
    if run.ddp:
        dist.barrier()
    charged = clock.charged()
    final_eval = run_eval(run) if run.corpus.val_batches is not None and not run.stop.received else None
    if run.stop.received:  # a signal during the evaluation: final.pt is safe, the numbers would be partial
        final_eval = None
    summary = f"{run.step} steps, {charged:.1f}s charged of a {cfg.time_budget_s:.0f}s budget (final save included; " \
              f"start-up {clock.startup_s:.1f}s, reserve kept {run.reserve_s:.1f}s)"
    if final_eval and run.first_eval:
        summary += f"; val_bpb {run.first_eval['val_bpb']:.4f} -> {final_eval['val_bpb']:.4f}"
    run.log("done", summary, step=run.step, train_time=charged, startup_time=clock.startup_s, ended_by=ended_by,
            **(final_eval or {}))
    if run.master and cfg.sample_tokens and run.corpus.decode and not run.stop.received:
        prompt = torch.tensor([[run.corpus.bos_id]], device=run.device)
        sampler = inference_model(run.raw_model.state_dict(), asdict(run.model_cfg), run.device)
        with run.autocast:
            out = sampler.generate(prompt, cfg.sample_tokens, temperature=0.8,
                                   generator=torch.Generator().manual_seed(cfg.seed))
        print("-" * 40 + "\n" + run.corpus.decode(out[0, 1:].tolist()) + "\n" + "-" * 40)
    return {"first_eval": run.first_eval, "final_eval": final_eval, "step": run.step}


def main(argv):
    cfg, model_cfg = parse_args(SUBMISSION_ARGS + list(argv))
    logging.basicConfig(format="%(name)s: %(message)s")
    with StopSignal() as stop:
        try:
            run = setup(cfg, model_cfg, stop, argv)
            if run is None:  # --export_submission
                return None
            return finish(run, train_loop(run) if not stop.received else "signal")
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except Stopped as e:  # a requested stop, not a failure
        print(e, file=sys.stderr)
    # the foreseeable failures (bad flags, files, devices, data, a full disk, a diverged run) carry their
    # fix in one line; anything else is a bug and keeps its traceback
    except (ValueError, OSError, FloatingPointError) as e:
        sys.exit(f"error: {e}")

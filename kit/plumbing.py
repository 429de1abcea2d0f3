"""
What every entry point (train.py, bench.py, evaluate.py) needs around the model: flags and config
checks, the device, its dtype and peak, distributed start-up, checkpoints (written atomically, read
safely), resume, the run's log and stop signals.
"""
import os

# The Neuron compiler's flags, for every entry point (each imports this module before it compiles anything):
# TorchNeuron reads NEURON_CC_FLAGS each time it compiles a graph or an op, not at import
# (torch_neuronx/csrc/core/KernelExecution.cpp, GetCompileAdditionalArgs: getenv("NEURON_CC_FLAGS"); public
# copy in parmoham-aws/test-repo-parmoham), and puts them in the compile cache's key. Competitors measured
# half the throughput without -O1 (marker2601/trainium-simulator docs/FINDINGS.md). Precision is left to the
# graph (autocast), not to the compiler. A user's own setting wins.
os.environ.setdefault("NEURON_CC_FLAGS", "--optlevel=1 --auto-cast=none")

import collections  # noqa: E402
import dataclasses  # noqa: E402
import difflib  # noqa: E402
import errno  # noqa: E402
import functools  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pickle  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import zipfile  # noqa: E402
from contextlib import nullcontext, suppress  # noqa: E402
from dataclasses import asdict  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kit import optim  # noqa: E402
from model import GPT, TYPE_NAMES, GPTConfig, has_value_embed  # noqa: E402


# -----------------------------------------------------------------------------
# flags and config checks

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


def print_help(doc, configs, presets):
    print(doc)
    rows = [("--preset=NAME", f"apply a preset first: {', '.join(presets)}")]
    for title, cls in configs.items():
        rows.append((f"{title}:", ""))
        rows += [(f"--{f.name}={str(f.default).lower() if isinstance(f.default, bool) else f.default}", f.metadata["help"])
                 for f in dataclasses.fields(cls)]
    width = max(len(flag) for flag, _ in rows)
    for flag, text in rows:
        print(f"  {flag:<{width}}  {text}" if text else f"\n{flag}")


def parse_flags(argv, configs, presets, doc):
    """{title: config} for `configs` ({title: dataclass}) from --field=value (or --field value) for any of
    their fields, after the fields of --preset=NAME if given; unknown names get a close match suggested.
    --help prints `doc` and every field with its default and help."""
    pairs = split_flags(argv)
    if ("help", None) in pairs:
        print_help(doc, configs, presets)
        sys.exit(0)
    for name in [v for k, v in pairs if k == "preset"]:
        if name not in presets:
            sys.exit(f"error: unknown --preset={name}; presets: {', '.join(presets)}")
        pairs = [(k, str(v)) for k, v in presets[name].items()] + pairs
    owners = {f.name: (title, f) for title, cls in configs.items() for f in dataclasses.fields(cls)}
    values = {title: {} for title in configs}
    for key, value in pairs:
        if key == "preset":
            continue
        if key not in owners:
            near = difflib.get_close_matches(key, owners, n=1)
            sys.exit(f"error: unknown config field --{key}" + (f"; did you mean --{near[0]}?" if near else "") + " (--help lists all)")
        title, f = owners[key]
        kind = type(f.default)
        try:
            values[title][key] = {"true": True, "false": False}[value.lower()] if kind is bool else kind(value)
        except (KeyError, ValueError):
            sys.exit(f"error: --{key}={value!r} is not a valid {kind.__name__} (default {f.default!r})")
    # built from all values at once, so GPTConfig resolves n_kv_head=0 against the final n_head
    return {title: cls(**values[title]) for title, cls in configs.items()}


def validate_config(cfg, model_cfg):
    """Every field's type, and its range or choices as its `opt` declares them, all problems in one message
    with the fix. Needs no data, model or device, so train.py's main calls it first. (The tokenizer is
    checked when it is loaded.)"""
    problems = []
    for f in dataclasses.fields(cfg):
        value, kind = getattr(cfg, f.name), type(f.default)
        low, high = f.metadata.get("bounds", (None, None))
        choices = f.metadata.get("choices")
        if not isinstance(value, (int, float) if kind is float else kind) or (kind is not bool and isinstance(value, bool)):
            problems.append(f"--{f.name}={value!r} must be {TYPE_NAMES[kind]}")
        elif low is not None and not (low <= value and (high is None or value <= high) and math.isfinite(value)):
            problems.append(f"--{f.name}={value} must be " + (f"between {low} and {high}" if high is not None else f">= {low}"))
        elif choices and value not in choices:
            problems.append(f"--{f.name}={value!r}: use {' or '.join(choices)}")
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


# -----------------------------------------------------------------------------
# devices, ranks, dtypes and peaks

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


# Dense bf16 peak FLOP/s of one physical NeuronCore or one GPU, as AWS and NVIDIA publish them. On Trn2/Trn3
# a rank drives a logical core of NEURON_LOGICAL_NC_CONFIG physical cores (2 by default: 166.8 TFLOP/s per Trn2 rank).
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


def device_type(requested):
    """The device type to run on: --device's, or for "auto" the best this machine has; refused if it lacks it."""
    chosen = detect_device() if requested == "auto" else requested
    check_device(chosen)
    return chosen


# Where this process runs: its rank among world_size, its device, and `control`, a CPU (gloo) group on which
# every rank agrees each step on the clock and on a stop request without making the host wait for the
# accelerator (None in a single process).
Ranks = collections.namedtuple("Ranks", "rank world_size device device_type control")


def start_ranks(device_type):
    """Under torchrun (which sets RANK, LOCAL_RANK, WORLD_SIZE) joins the process group with the device's
    backend and binds one device per rank; a single process is rank 0 of 1."""
    if "RANK" not in os.environ:
        return Ranks(0, 1, device_type, device_type, None)
    dist.init_process_group(backend={"neuron": "neuron", "cuda": "nccl"}.get(device_type, "gloo"))
    local_rank = int(os.environ["LOCAL_RANK"])
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    # TorchNeuron gives each torchrun process its own logical core, addressed as plain "neuron"
    device = f"cuda:{local_rank}" if device_type == "cuda" else device_type
    return Ranks(dist.get_rank(), dist.get_world_size(), device, device_type, dist.new_group(backend="gloo"))


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


def compute_dtype(cfg):
    return torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32


def autocast_context(cfg, device_type):
    """bf16 matmuls under autocast; weights and optimizer state stay fp32."""
    return torch.autocast(device_type, dtype=torch.bfloat16) if cfg.dtype == "bfloat16" else nullcontext()


# -----------------------------------------------------------------------------
# the memory plan: what one rank holds, from the config alone

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
        generation = trainium_generation()
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


def optimizer_state(model, optimizers, sharding=None, distributed=False):
    """{parameter name: {state name: tensor}} for the parameters these optimizers update: keyed by name,
    not by the optimizers' own numbering, so a checkpoint loads into any split of the parameters over ranks
    (optim.Sharding) and into one process alike. The schedule's values are not saved: it rewrites them.
    distributed: a table shared out by rows appears as a DTensor of its whole shape, sharded on dim 0 as
    the rows are, and its step count replicated: torch.distributed.checkpoint then writes each rank's rows
    and gives any other split of them, or the whole, on load. Otherwise the state of this rank's rows."""
    names = {p: name for name, p in model.named_parameters()}
    states = {}
    for tensor, state in optim.param_states(optimizers).items():
        if tensor in names:
            states[names[tensor]] = state
            continue
        param, _ = sharding.rows_of[tensor]
        if distributed:
            # imported here, not at the top: torch.distributed.tensor takes ~1 s to import (measured on a 2-core
            # Xeon), which every process (evaluate.py, each test's) would pay, and only sharded checkpoints use it
            from torch.distributed.tensor import DTensor, Replicate, Shard

            mesh = sharding.device_mesh()
            state = {k: DTensor.from_local(v, mesh, [Shard(0)] if v.ndim else [Replicate()], run_check=False,
                                           shape=param.shape if v.ndim else v.shape, stride=param.stride() if v.ndim else ())
                     for k, v in state.items()}
        states[names[param]] = state
    return states


def run_state(step, train_time, loader_state, train_cfg, model_cfg):
    """What a checkpoint holds besides tensors: step, charged time, data position, RNG and both configs."""
    return {"step": step, "train_time": train_time, "loader": loader_state, "rng": torch.get_rng_state(),
            "train_config": asdict(train_cfg), "model_config": asdict(model_cfg)}


def save_checkpoint(path, model, optimizers, step, train_time, loader_state, train_cfg, model_cfg):
    """One file with everything a run needs to continue exactly: weights, optimizer state, step, charged
    time, data position, RNG and both configs."""
    write_atomically(path, {"model": model.state_dict(), "optimizers": optimizer_state(model, optimizers),
                            **run_state(step, train_time, loader_state, train_cfg, model_cfg)})


def save_sharded_checkpoint(path, model, optimizers, sharding, group, run):
    """A folder written by every rank through torch.distributed.checkpoint: the weights (identical on every
    rank, written once) and each rank's own optimizer state, keyed by parameter name so that any number of
    ranks can load it; `run` (run_state) goes beside it in meta.pt, written by rank 0. It is written as
    PATH.tmp and renamed when complete, so a crash leaves the previous checkpoints as they were."""
    import torch.distributed.checkpoint as dcp  # imported where used, as DTensor is (optimizer_state)

    tmp = f"{path}.tmp"
    state = optimizer_state(model, optimizers, sharding, distributed=group is not None)
    dcp.save({"model": model.state_dict(), "optimizers": state}, checkpoint_id=tmp, process_group=group, no_dist=group is None)
    if group is None or dist.get_rank() == 0:
        write_atomically(os.path.join(tmp, "meta.pt"), run)
        if os.path.exists(path):  # the same step written before: this one replaces it
            shutil.rmtree(path)
        os.replace(tmp, path)
    if group is not None:
        dist.barrier(group=group)


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


def make_out_dir(cfg, model_cfg):
    """Rank 0's: out_dir, refused if the run's checkpoints cannot fit there."""
    os.makedirs(cfg.out_dir, exist_ok=True)
    with torch.device("meta"):  # parameter count without allocating anything
        check_disk_space(cfg.out_dir, GPT(model_cfg).num_params(), cfg.keep_checkpoints)


def restore(state, raw_model, optimizers, sharding, corpus, ranks):
    """Puts a checkpoint's weights, this rank's optimizer state, the data position and RNG back; returns
    (step, charged time). A sharded checkpoint (a folder) is read through torch.distributed.checkpoint,
    which reads each rank just what it now holds, whatever the number of ranks that wrote it; from a file,
    a rank that holds a table's block of rows takes those rows of its state."""
    if "folder" in state:
        import torch.distributed.checkpoint as dcp  # imported where used, as DTensor is (optimizer_state)

        distributed = sharding is not None and ranks.control is not None
        dcp.load({"model": raw_model.state_dict(), "optimizers": optimizer_state(raw_model, optimizers, sharding, distributed)},
                 checkpoint_id=state["folder"], process_group=ranks.control, no_dist=ranks.control is None)
    elif not isinstance(state["optimizers"], dict):
        raise CheckpointError("this checkpoint keeps its optimizer state by position (an earlier version of this kit); "
                              "start the run again, or train it on with the kit that wrote it")
    else:
        raw_model.load_state_dict(state["model"])
        names = {p: name for name, p in raw_model.named_parameters()}
        with torch.no_grad():
            for tensor, tensors in optim.param_states(optimizers).items():
                param, rows = (tensor, slice(None)) if tensor in names else sharding.rows_of[tensor]
                for key, target in tensors.items():
                    saved = state["optimizers"][names[param]][key]
                    target.copy_(saved[rows] if saved.ndim else saved)
    corpus.load_state_dict(state["loader"])
    torch.set_rng_state(state["rng"])
    return state["step"], state["train_time"]


def write_checkpoint(cfg, raw_model, optimizers, sharding, corpus, ranks, step, charged):
    """out_dir/ckpt_<step>.pt (by rank 0), or with a sharded optimizer the folder ckpt_<step>.dcp (by every
    rank), keeping the newest keep_checkpoints; returns its path."""
    path = os.path.join(cfg.out_dir, f"ckpt_{step:07d}.{'dcp' if sharding is not None else 'pt'}")
    if sharding is not None:
        run = run_state(step, charged, corpus.state_dict(), cfg, raw_model.config)
        save_sharded_checkpoint(path, raw_model, optimizers, sharding, ranks.control, run)
    elif ranks.rank == 0:
        save_checkpoint(path, raw_model, optimizers, step, charged, corpus.state_dict(), cfg, raw_model.config)
    if ranks.rank == 0:
        for old in periodic_checkpoints(cfg.out_dir)[: -cfg.keep_checkpoints]:
            shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)
    return path


def measure_final_save(cfg, raw_model, ranks):
    """Seconds the final save will take, measured once by writing the same payload: the reserve the loop
    keeps so that final.pt lands inside the budget (twice the measurement, plus a second)."""
    path = os.path.join(cfg.out_dir, "final.pt.timing")
    t0 = time.monotonic()
    if ranks.rank == 0:
        save_final(path, raw_model, raw_model.config, cfg, 0, 0.0)
        os.remove(path)
    reserve = 2 * (time.monotonic() - t0) + 1.0
    if ranks.control is not None:  # every rank stops on the same step, so every rank keeps rank 0's reserve
        agreed = torch.tensor([reserve], dtype=torch.float64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=ranks.control)
        reserve = agreed.item()
    return reserve


def periodic_checkpoints(out_dir):
    """The periodic checkpoints in out_dir, oldest first: files, and complete folders of sharded ones."""
    return sorted(glob.glob(os.path.join(out_dir, "ckpt_*.pt")) + glob.glob(os.path.join(out_dir, "ckpt_*.dcp")),
                  key=os.path.basename)


class CheckpointError(ValueError):
    """A file that is not a usable checkpoint; the message names it and says why."""


RUN_KEYS = ("step", "train_time", "loader", "rng", "train_config", "model_config")
CHECKPOINT_KEYS = ("model", "optimizers") + RUN_KEYS


def load_checkpoint(path, device="cpu", keys=CHECKPOINT_KEYS, mmap=False):
    """Tensors and plain containers only (weights_only=True): a checkpoint file can never run code. Every way a
    file can be unusable (empty, cut short, not a checkpoint, a pickled object, keys missing) raises
    CheckpointError naming it; torch's own advice for some of these (weights_only=False) would be unsafe.
    mmap: map the tensors instead of reading them, to look at a checkpoint's configs cheaply. A sharded
    checkpoint's folder gives its meta.pt, and "folder", its path, for `restore` to read the tensors from.
    (torch.distributed.checkpoint reads the folder's .metadata with pickle, torch/distributed/checkpoint/
    filesystem.py: resume only from folders you wrote.)"""
    if str(path).endswith(".dcp") and os.path.isdir(path):
        if not os.path.exists(os.path.join(path, ".metadata")):
            raise CheckpointError(f"sharded checkpoint {path} lacks its .metadata: it was not completely written; "
                                  "use another checkpoint")
        return {**load_checkpoint(os.path.join(path, "meta.pt"), device, RUN_KEYS, mmap), "folder": path}
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
    checkpoint this script wrote. The scorer applies no autocast, so on Trainium and GPUs
    the weights themselves are bf16 and the model computes in bf16; on a CPU it stays fp32."""
    device, state = torch.device(device), load_checkpoint(checkpoint_path, "cpu", keys=("model", "model_config"))
    model = inference_model(state["model"], state["model_config"], "cpu")
    if device.type in ("cuda", "neuron"):
        model = model.to(torch.bfloat16)
    return model.to(device).requires_grad_(False)


# -----------------------------------------------------------------------------
# the run's log, its speed and stop signals

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


class SpeedMeter:
    """Tokens per second and MFU over the timed steps since the last read (start-up steps are not timed).
    The peak is measured (on a CPU) when the meter is made, before the clock starts."""

    def __init__(self, raw_model, cfg, ranks):
        peak = peak_flops(ranks.device_type, compute_dtype(cfg), cfg.peak_tflops) * ranks.world_size
        self.flops_per_peak = raw_model.flops_per_token() / peak
        self.seconds, self.tokens, self.last = 0.0, 0, {"tokens_per_s": 0.0, "mfu": 0.0}

    def add(self, seconds, tokens):
        self.seconds, self.tokens = self.seconds + seconds, self.tokens + tokens

    def read(self):
        """The interval's speed as text, starting the next interval; fields() then gives its numbers."""
        timed = self.seconds > 0
        tokens_per_s = self.tokens / self.seconds if timed else 0.0
        self.last = {"tokens_per_s": tokens_per_s, "mfu": tokens_per_s * self.flops_per_peak}
        self.seconds, self.tokens = 0.0, 0
        return f"{tokens_per_s:,.0f} tok/s | MFU {100 * self.last['mfu']:.1f}%" if timed else "start-up step"

    def fields(self):
        return self.last


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


# -----------------------------------------------------------------------------
# resume, and the output folder

def config_differences(state, cfg, model_cfg):
    """(incompatible, other): 'field (checkpoint X, now Y)' for the differences that make the checkpoint
    unloadable (model shape, optimizer kind) and for the rest of the run config."""
    def differ(saved, now, skip=()):
        return [f"{k} (checkpoint {saved[k]!r}, now {v!r})" for k, v in now.items()
                if k in saved and k not in skip and saved[k] != v]

    now = asdict(cfg)
    # what a field's `opt` marks resumable (how long the run goes on, what it logs and saves, where it runs)
    may_change = {f.name for f in dataclasses.fields(cfg) if f.metadata.get("resumable")}
    skip = may_change | {"matrix_optimizer"} | ({"dtype"} if cfg.dtype == "auto" else set())
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
        raise FileNotFoundError(f"--resume=latest: no ckpt_*.pt or ckpt_*.dcp in {cfg.out_dir}; pass a checkpoint path instead")
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


RUN_FILES = ("log.jsonl", "final.pt", "ckpt_*.pt", "ckpt_*.dcp")


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

"""
What every entry point (train.py, bench.py, evaluate.py) needs first: the Neuron compiler's flags, flags and
config checks, the device, its dtype and peak, distributed start-up and ranks, the run's log, speed and stop
signals. (cf. nanochat's nanochat/common.py)
"""
import os

# The Neuron compiler's flags, for every entry point (each imports this module before it compiles anything):
# TorchNeuron reads NEURON_CC_FLAGS each time it compiles a graph or an op, not at import
# (torch_neuronx/csrc/core/KernelExecution.cpp, GetCompileAdditionalArgs: getenv("NEURON_CC_FLAGS"); public
# copy in parmoham-aws/test-repo-parmoham), and puts them in the compile cache's key. Competitors measured
# half the throughput without -O1 (marker2601/trainium-simulator docs/FINDINGS.md). Precision is left to the
# graph (autocast), not to the compiler. A user's own setting wins.
os.environ.setdefault("NEURON_CC_FLAGS", "--optlevel=1 --auto-cast=none")
# Fail loudly: a torch.compile(backend="neuron") graph that fails to compile or run raises, instead of running
# the graph op by op at a fraction of the speed (torch_neuronx/neuron_dynamo_backend/backend.py,
# execution_wrapper: _getenv_bool("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", False) in the public copy in
# parmoham-aws/test-repo-parmoham; the TorchNeuron docs, torch/reference/env-vars, give True as the default from
# SDK 2.33, so older releases such as the contest's 2.11.3 beta may fall back silently). A user's own setting wins.
os.environ.setdefault("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "1")

import collections  # noqa: E402
import dataclasses  # noqa: E402
import difflib  # noqa: E402
import errno  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from contextlib import nullcontext, suppress  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from model import TYPE_NAMES  # noqa: E402


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


def cpu_fallbacks(device_type):
    """A line naming the ATen ops TorchNeuron ran on the CPU during this process (eager ops without a Neuron
    kernel fall back to the CPU silently, even with TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION), or None off
    Trainium or where the installed torch_neuronx does not expose the list. The list is
    torch_neuronx.get_fallback_ops() (torch_neuronx/__init__.py, backed by FallbackOpTracker in
    torch_neuronx/csrc/core/NeuronOpTracking.h; public copy in parmoham-aws/test-repo-parmoham)."""
    if device_type != "neuron":
        return None
    import torch_neuronx

    get_fallback_ops = getattr(torch_neuronx, "get_fallback_ops", None)
    if get_fallback_ops is None:
        return "CPU fallbacks: this torch_neuronx has no get_fallback_ops(); they cannot be listed"
    ops = sorted(set(get_fallback_ops()))
    return (f"CPU fallbacks: TorchNeuron ran {len(ops)} op(s) on the CPU: {', '.join(ops)}" if ops
            else "CPU fallbacks: none (every op ran on the NeuronCores)")


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


def is_rank0():
    return int(os.environ.get("RANK", "0")) == 0  # torchrun sets it, also before the process group exists


def say(text):
    if is_rank0():
        print(text, flush=True)


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

"""
What every entry point (train.py, bench.py, evaluate.py) needs first: the Neuron compiler's flags, the device,
its dtype and peak, distributed start-up and ranks, the run's log (with what it says at start and end) and
stop signals. (cf. nanochat's nanochat/common.py)
"""
import os
import sys
import time

# CPU threads: beside a busy core libgomp's spinning threads wait for it (fp32 0.30x of quiet on a 2-core Xeon;
# PASSIVE with threads on the free cores 0.49x, but PASSIVE alone halved quiet speed: docs/training.md). Set
# only beside a busy core, before torch loads (OpenMP reads them once). Your settings win.
def busy_cores_elsewhere(seconds=0.05):
    """How many cores other processes kept busy over `seconds` (this process sleeps meanwhile); None where
    /proc/stat cannot be read (not Linux)."""
    def totals():
        with open("/proc/stat") as stat:
            fields = [int(n) for n in stat.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]  # all jiffies, idle + iowait
    try:
        total0, idle0 = totals()
        time.sleep(seconds)
        total1, idle1 = totals()
    except (OSError, ValueError, IndexError):
        return None
    cores = os.cpu_count() or 1
    return cores * (1 - (idle1 - idle0) / max(total1 - total0, 1))


def chosen_wait_policy(busy_cores):
    """PASSIVE where at least half a core was busy elsewhere at start-up, else None (libgomp's default)."""
    return "PASSIVE" if busy_cores is not None and busy_cores >= 0.5 else None


OMP_BUSY_CORES = None if "OMP_WAIT_POLICY" in os.environ or "torch" in sys.modules else busy_cores_elsewhere()
OMP_WAIT_POLICY_BY_KIT = chosen_wait_policy(OMP_BUSY_CORES) is not None
if OMP_WAIT_POLICY_BY_KIT:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) - round(OMP_BUSY_CORES))))

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
import errno  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import signal  # noqa: E402
from contextlib import nullcontext, suppress  # noqa: E402
from dataclasses import asdict  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402



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
# the run's log, what it says at start and end, and stop signals

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


def omp_wait_policy():
    """How OpenMP's threads wait, as the start-up line says it: the kit's choice and why, or the user's."""
    if OMP_WAIT_POLICY_BY_KIT:
        return (f"OMP_WAIT_POLICY=PASSIVE, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} (the kit's: "
                f"{OMP_BUSY_CORES:.1f} cores busy elsewhere at start-up)")
    if "OMP_WAIT_POLICY" in os.environ:
        return f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']} (yours)"
    if OMP_BUSY_CORES is not None:
        return f"OMP_WAIT_POLICY unset (libgomp's default: {OMP_BUSY_CORES:.1f} cores busy elsewhere at start-up)"
    return "OMP_WAIT_POLICY unset (torch loaded first, or no /proc/stat)"


def log_config(log, cfg, trainee, ranks, batch, dtype_reason):
    """The run's start-up line: the model, the ranks, the batch, the compute dtype, on a CPU how its threads
    wait (omp_wait_policy); and in the log, what each kernel op runs and why (kernels.preview_fallbacks)."""
    raw_model, sharded = trainee.raw_model, " (optimizer sharded)" if trainee.sharding is not None else ""
    threads = f"; {omp_wait_policy()}" if ranks.device_type == "cpu" else ""
    log("config", f"{raw_model.num_params():,} parameters, {raw_model.flops_per_token() / 1e6:.1f} MFLOP/token, "
        f"{ranks.world_size} rank(s) on {ranks.device_type}{sharded}, {batch.micro_steps} micro-step(s) of {batch.tokens // batch.micro_steps:,} "
        f"tokens per step; computing in {cfg.dtype} because {dtype_reason}{threads}", train_config=asdict(cfg),
        model_config=asdict(raw_model.config), world_size=ranks.world_size, device=ranks.device_type,
        dtype_reason=dtype_reason, kernels=raw_model.kernels_ran, omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"))


def epoch_plan(cfg, train_tokens, total_tokens):
    """(line, log fields), before training: the epochs --max_steps plans, else the step the data repeats from."""
    if train_tokens is None:
        return ("training data: the token count is not known (the contest's make_dataloader streams its shards and exposes "
                "none); the organiser's loader may repeat its shards", dict(train_tokens=None, epoch_steps=None, planned_epochs=None))
    epoch_steps, epochs = train_tokens / total_tokens, cfg.max_steps * total_tokens / train_tokens if cfg.max_steps else None
    text = f"training data: {train_tokens:,} tokens, one epoch is {epoch_steps:,.1f} steps of {total_tokens:,} tokens; "
    if epochs is None:
        text += f"the data starts repeating in step {train_tokens // total_tokens + 1:,}"
    else:
        order = "a new order" if cfg.data_order == "shuffled" or cfg.row_pool else "the same order"
        text += f"{cfg.max_steps:,} steps are {epochs:.2f} epochs: " + (
            f"the data is read {math.ceil(epochs)} times, each epoch in {order}" if epochs > 1 else "no window is read twice")
    text += " (at full steps; --batch_warmup's smaller early steps read less)" if cfg.batch_warmup else ""
    return text, dict(train_tokens=train_tokens, epoch_steps=epoch_steps, planned_epochs=epochs)


def summary(cfg, step, charged, clock, reserve_s, first_eval, final_eval):
    text = (f"{step} steps, {charged:.1f}s charged of a {cfg.time_budget_s:.0f}s budget (final save included; "
            f"start-up {clock.startup_s:.1f}s, reserve kept {reserve_s:.1f}s)")
    if final_eval and first_eval:
        text += f"; val_bpb {first_eval['val_bpb']:.4f} -> {final_eval['val_bpb']:.4f}"
    return text

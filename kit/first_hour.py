"""
`python bench.py --first_hour --preset=baseline`: the whole first device session in one command.

Every question a paid run depends on, each step in a child process with its own timeout, so that one failure
or hang cannot hide the rest: the versions, each kernel op alone (the fused ones too), `bench.py --check` at
the run's shapes, 20 compiled steps on PyTorch and on the kernels, sharded ranks with a checkpoint resumed
on one, load_for_eval. All under the LNC and rank count of the paid run (paid_launch). One table at the end,
exit code 1 if any step failed, each compiled run's cold start-up against the contest's start-up cap, and the
paid run's launch string: every kernel op that passed stays on, and each one that failed gets `op:torch`, as
does each whose kernel failed to build inside a training step (the step then went on on PyTorch and passed:
its log says so), and each whose start-up past the cap outweighs its gain over the budget (startup_costs).

Off Trainium the same steps rehearse on the CPU and the emulator at FIRST_HOUR_TINY shapes, one micro-step
of 256 tokens per step, so that it passes on any 2-core CPU. A timeout there is the rehearsal's, not a
kernel's: it is reported, and never turns a kernel off for the device.
"""
import argparse
import glob
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from unittest import mock

import torch

import kernels
import nki_emulator
from kit import checkpoint, device_check, runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# FIRST_HOUR_STEPS training steps of 2 sequences of 128 tokens on 2 layers; total_batch_tokens 512 makes a
# step 2 micro-steps in one process and 1 on each of 2 ranks (a preset's 65,536 would be 256 micro-steps)
FIRST_HOUR_TINY = ["--n_layer=2", "--n_embd=128", "--n_head=2", "--n_kv_head=1", "--sequence_len=128", "--batch_size=2",
                   "--total_batch_tokens=512", "--tokenizer=bytes", "--dataset=shakespeare"]
FIRST_HOUR_STEPS = 20
# seconds each step may take: (on Trainium, where a cold compile of a graph takes up to ~15 min; off it)
FIRST_HOUR_TIMEOUTS = {"versions": (120, 60), "kernel": (1800, 300), "check": (3600, 1200), "gains": (3600, 600),
                       "train": (2400, 600), "ranks": (2400, 300), "resume": (1800, 200), "eval": (1800, 180)}
# a script run with the CPU emulator standing in for `nki` (as bench.py itself does): python -c EMULATED_RUN script args
EMULATED_RUN = ("import os, runpy, sys; sys.argv = sys.argv[1:]; sys.path.insert(0, os.path.dirname(sys.argv[0])); "
                "import nki_emulator; nki_emulator.install(); runpy.run_path(sys.argv[0], run_name='__main__')")
ODD_EVAL_LEN = 777  # "an odd T": the scorer's context is 1024, a model must also take any other length
# The contest runs on one Trn2 chip, 8 physical NeuronCores; its launch string is LNC=1 with 8 ranks
# (kit/contest.py, above BASELINE). A rank drives NEURON_LOGICAL_NC_CONFIG of them.
CHIP_CORES, CONTEST_LNC = 8, 1


def add_flags(parser):
    parser.add_argument("--first_hour", action="store_true", help="the whole first device session: versions, each "
                        "kernel op alone, --check, 20 compiled steps on torch and on the kernels, sharded ranks with a "
                        "checkpoint resumed on 1, load_for_eval timings, under the paid run's LNC and ranks; each step "
                        "a child process with its own timeout; one table, the exit code and the first paid run's "
                        "flags, per op (off Trainium: tiny, on CPU; kit/first_hour.py)")
    parser.add_argument("--first_hour_step", help=argparse.SUPPRESS)  # one step of --first_hour, in its child process
    parser.add_argument("--first_hour_checkpoint", help=argparse.SUPPRESS)


def paid_launch():
    """(LNC, ranks) of the paid run: NEURON_LOGICAL_NC_CONFIG where the user set it, else the contest's
    LNC=1; as many ranks as fill the chip."""
    lnc = int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", CONTEST_LNC))
    if lnc not in (1, 2):
        raise ValueError(f"NEURON_LOGICAL_NC_CONFIG={lnc}: a Trn2 rank drives 1 or 2 NeuronCores; set 1 (the "
                         "contest's launch) or 2")
    return lnc, CHIP_CORES // lnc


def nki_front_end(version):
    """Which NKI front end a version string means: KLR's parser up to NKI 0.6, a Python tracer from 0.7
    (Neuron 2.33 release notes; the parser's rules are the stricter, which the kernels keep)."""
    match = re.match(r"(\d+)\.(\d+)", version or "")
    if match is None:
        return "unknown front end"
    if (int(match[1]), int(match[2])) >= (0, 7):
        return "tracer front end (NKI >= 0.7)"
    return "parser front end (NKI <= 0.6, KLR)"


def versions():
    def version(package):
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    nki_version = getattr(kernels.nki, "__version__", None)
    emulated = kernels.nki is nki_emulator
    where = f"NKI {nki_version}" + (" (the CPU emulator: no Neuron SDK here)" if emulated else "")
    return (f"{where}, {nki_front_end(nki_version)}; torch {torch.__version__}; "
            f"torch-neuronx {version('torch-neuronx') or 'not installed'}; "
            f"neuronx-cc {version('neuronx-cc') or 'not installed'}")


def kernel_alone(model_cfg, batch_size, device_type, device, op):
    """Run the NKI kernels of `op` (one of kernels.KERNEL_OPS) alone, forward and backward, in bf16 at the
    shapes --check uses (on a device the run's); one "front end ok / backend ok" per kernel. On the emulator the
    front end is nki.jit's check of the kernel source against KLR's Python subset and the backend the emulated
    run; on a NeuronCore nki.jit and the call (a compiler error carries an NCC_ code, so it is the backend's;
    any other, the front end's)."""
    results = {}
    run = kernels._run_kernel

    def launch(kernel, *args):
        name = kernel.__name__
        try:
            kernels.nki.jit(kernel)[kernels._logical_core_degree()]
        except Exception as error:
            results[name] = f"front end FAILED ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
            raise
        try:
            outputs = run(kernel, *args)
        except Exception as error:
            stage = "front end ok / backend" if device_type != "neuron" or "NCC_" in str(error) else "front end"
            results[name] = f"{stage} FAILED ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
            raise
        results[name] = "front end ok / backend ok"
        return outputs

    shapes = device_check.check_shapes(model_cfg, batch_size, device_type == "neuron")
    if op not in kernels.OPS:
        raise ValueError(f"kernel:{op}: not a kernel op; the ops are {', '.join(kernels.KERNEL_OPS)}")
    cases = kernels.OPS[op].check_cases(shapes, torch.bfloat16, device, torch.Generator().manual_seed(0))
    try:
        with mock.patch.object(kernels, "_run_kernel", launch):
            for case in cases:
                inputs = [t.requires_grad_() if t is not None and t.is_floating_point() else t
                          for t in case.make_inputs()]
                with case.context():
                    case.call(*inputs, "nki").float().sum().backward()
    finally:
        print("; ".join(f"{name}: {result}" for name, result in results.items()) or "no kernel ran")
    return all(result.endswith("backend ok") for result in results.values())


def load_for_eval_timings(checkpoint_path, batch_size, device_type, device):
    """Time one load_for_eval forward at (batch, 1024) and at (batch, ODD_EVAL_LEN), the scorer's way (no
    autocast, no grad)."""
    t0 = time.perf_counter()
    model = checkpoint.load_for_eval(checkpoint_path, device)
    parts = [f"load {time.perf_counter() - t0:.1f} s"]
    vocab = model.config.vocab_size
    for length in (1024, ODD_EVAL_LEN):
        idx = torch.randint(0, vocab, (batch_size, length), device=device)
        with torch.no_grad():
            t0 = time.perf_counter()
            logits = model(idx)
            runtime.synchronize(device_type)
        if logits.shape[:2] != (batch_size, length) or not torch.isfinite(logits.float()).all():
            raise AssertionError(f"forward at {batch_size} x {length}: logits {tuple(logits.shape)}, finite: "
                                 f"{bool(torch.isfinite(logits.float()).all())}")
        parts.append(f"{batch_size} x {length}: {time.perf_counter() - t0:.2f} s")
    print("; ".join(parts))
    return True


def run_one(step, checkpoint_path, cfg, model_cfg, device_type, device):
    """One step of --first_hour in its own process (bench.py --first_hour_step=STEP): prints its result line
    last; returns whether it passed."""
    if step == "versions":
        print(versions())
        return True
    if step.startswith("kernel:"):
        return kernel_alone(model_cfg, cfg.batch_size, device_type, device, step.split(":", 1)[1])
    if step == "eval":
        return load_for_eval_timings(checkpoint_path, cfg.batch_size, device_type, device)
    raise ValueError(f"--first_hour_step={step}: not a step of --first_hour")


def plan(passthrough, on_trainium, out_dir, lnc, ranks):
    """The steps: (name, command, timeout in seconds). `passthrough`: the user's train.py flags (e.g.
    --preset=baseline); off Trainium FIRST_HOUR_TINY shapes follow them. On Trainium the training steps run on
    `ranks` ranks, as the paid run will; the environment gives every step the paid run's LNC (run_first_hour)."""
    python = sys.executable
    bench_py, train_py = os.path.join(ROOT, "bench.py"), os.path.join(ROOT, "train.py")
    shapes = list(passthrough) + ([] if on_trainium else FIRST_HOUR_TINY)
    run_flags = [f"--data_dir={os.path.join(out_dir, 'data')}", "--time_budget_s=0", "--sample_tokens=0",
                 "--eval_tokens=4096", "--log_every=5", "--compile=true"]
    timeout = {name: pair[0 if on_trainium else 1] for name, pair in FIRST_HOUR_TIMEOUTS.items()}
    step = [python, bench_py, "--first_hour_step"]
    steps = [("versions", step + ["versions"] + shapes, timeout["versions"])]
    for op in kernels.KERNEL_OPS:
        steps.append((f"kernels: {op}", step + [f"kernel:{op}"] + shapes, timeout["kernel"]))
    steps.append(("bench.py --check", [python, bench_py, "--check", f"--json={check_json(out_dir)}", *passthrough],
                  timeout["check"]))
    shapes_only = [a for a in shapes if not a.startswith("--kernels")]  # bench.py's own --kernels measures them
    steps.append(("bench.py --kernels (each kernel's gain)", [python, bench_py, "--kernels", *shapes_only,
                                                              f"--json={gains_json(out_dir)}"], timeout["gains"]))
    torchrun = [python, "-m", "torch.distributed.run", "--standalone"]
    # off Trainium auto is the PyTorch path: there the kernels run under the emulator, installed as `nki` first
    if on_trainium:
        launchers = dict.fromkeys(("torch", "auto"), torchrun + [f"--nproc_per_node={ranks}", train_py])
    else:
        launchers = {"torch": [python, train_py], "nki": [python, "-c", EMULATED_RUN, train_py]}
    for kernels_mode, launcher in launchers.items():
        steps.append((f"{FIRST_HOUR_STEPS} compiled steps, --kernels={kernels_mode}",
                      launcher + shapes + run_flags + [f"--kernels={kernels_mode}", f"--max_steps={FIRST_HOUR_STEPS}",
                                                       f"--out_dir={os.path.join(out_dir, 'steps_' + kernels_mode)}"],
                      timeout["train"]))
    ranks_dir = os.path.join(out_dir, "ranks")
    # off Trainium these steps ask only about sharding and checkpoints: uncompiled (a CPU compile per rank is slow)
    sharded = shapes + run_flags + [f"--out_dir={ranks_dir}", "--checkpoint_every=2"]
    sharded += [] if on_trainium else ["--compile=false"]
    shard_ranks = ranks if on_trainium else 2
    steps.append((f"{shard_ranks} ranks, sharded optimizer, checkpoint",
                  torchrun + [f"--nproc_per_node={shard_ranks}", train_py] + sharded
                  + ["--shard_optimizer=true", "--max_steps=4"], timeout["ranks"]))
    steps.append(("resume it on 1 rank", [python, train_py] + sharded + ["--resume=latest", "--max_steps=6"],
                  timeout["resume"]))
    steps.append((f"load_for_eval forward at B x 1024 and B x {ODD_EVAL_LEN}",
                  step + ["eval", f"--first_hour_checkpoint={os.path.join(ranks_dir, 'final.pt')}"] + shapes,
                  timeout["eval"]))
    return steps


def check_json(out_dir):
    return os.path.join(out_dir, "check.json")


def gains_json(out_dir):
    return os.path.join(out_dir, "kernels.json")


def run_step(name, command, timeout_s, env=None):
    """One step in its own process group, killed whole at its timeout; its output streams through. Returns a
    row: step, passed, timed_out, seconds, detail (its last output line, or why it failed)."""
    t0 = time.perf_counter()
    print(f"\n=== {name} (timeout {timeout_s} s): {' '.join(command)}", flush=True)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, env=env)
    lines = []

    def read():
        for line in process.stdout:
            print(line, end="", flush=True)
            lines.append(line.rstrip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)  # the whole group: torchrun's workers too
        process.wait()
        code = None
    reader.join(timeout=10)
    seconds = time.perf_counter() - t0
    last = next((line for line in reversed(lines) if line.strip()), "")
    if code is None:
        detail = f"TIMED OUT after {timeout_s} s; last line: {last[:160]}"
    elif code:
        detail = f"exit code {code}: {last[:200]}"
    else:
        detail = last[:200]
    return {"step": name, "passed": code == 0, "timed_out": code is None, "seconds": seconds, "detail": detail}


def _says_no(row, on_trainium):
    """Whether a step's failure speaks against the device: any failure there; in a CPU rehearsal, any but a
    timeout (the emulator's speed says nothing about a NeuronCore)."""
    return not row["passed"] and (on_trainium or not row.get("timed_out"))


def build_failures(work):
    """{op: reason} for each kernel op whose NKI kernel failed to build in a training run under `work`: the
    run went on with that op on PyTorch (kit/build.py) and its step passed, so only the run's log.jsonl
    tells (its "kernel_fallback" events, and "graph_fallback" where the whole compiled graph failed to build
    with the op's kernels in it, written when it happens: the run may end after).
    A line cut off by a killed run is skipped."""
    failures = {}
    for log in sorted(glob.glob(os.path.join(work, "*", "log.jsonl"))):
        run = os.path.basename(os.path.dirname(log))
        with open(log) as f:
            for line in f:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                # a kernel's failure names its op; the whole graph's, every op it sent to PyTorch
                ops = {"kernel_fallback": [event.get("op")], "graph_fallback": event.get("ops", [])}.get(event.get("event"), [])
                for op in ops:
                    failures.setdefault(op, f"training run '{run}' went on on PyTorch: {event['why']}")
    return failures


def paid_run_kernels(rows, check_rows, on_trainium, fallbacks=None):
    """(the paid run's --kernels value, reasons): "auto" for every kernel op that passed alone and in
    --check, "op:torch" for each that failed; all "torch" where the training steps on the kernels failed
    though every op passed alone. `check_rows`: --check's rows (each with its op), None where it gave none;
    `fallbacks`: build_failures(), the ops whose kernel failed to build inside a training step."""
    failed, fallbacks = {}, fallbacks or {}
    for op in kernels.KERNEL_OPS:
        why = [f"step '{r['step']}' failed: {r['detail']}" for r in rows
               if r["step"] == f"kernels: {op}" and _says_no(r, on_trainium)]
        why += [f"--check {r['check']}: {r['error']}" for r in check_rows or () if r["op"] == op and not r["passed"]]
        why += [fallbacks[op]] if op in fallbacks else []
        if why:
            failed[op] = f"{op}: {why[0]}"
    reasons = list(failed.values())
    if check_rows is None:
        reasons.append("--check left no per-op results; its step's output says why")
    on_kernels = [r for r in rows if "compiled steps, --kernels=" in r["step"] and "--kernels=torch" not in r["step"]]
    if not failed and any(_says_no(r, on_trainium) for r in on_kernels):
        return "torch", reasons + ["the training steps on the kernels failed though every op passed alone: "
                                   "PyTorch until that step's output is understood"]
    if len(failed) == len(kernels.KERNEL_OPS):
        return "torch", reasons
    return ",".join(["auto"] + [f"{op}:torch" for op in failed]) if failed else "auto", reasons


def kernel_gains(kernel_rows):
    """{op: seconds its NKI kernels save in one micro-step, forward and backward, at its calls per micro-step}
    from bench.py --kernels's rows: measured against the compiled PyTorch path on a device, estimated for a Trn2
    elsewhere (the kernel's trace against the fallback as compiled plain ops); an op's cases averaged."""
    saved = {}
    for r in kernel_rows or ():
        if r["direction"] == "fwd+bwd" and "nki_unavailable" not in r:
            nki_s, torch_s = (r["nki_s"], r["torch_s"]) if "nki_s" in r else (r["estimate_s"], r["compiled"]["estimate_s"])
            saved.setdefault(r["op"], []).append(r["calls"] * (torch_s - nki_s))
    return {op: sum(values) / len(values) for op, values in saved.items()}


def compiled_runs(work):
    """{run folder: its cold start-up (s), tokens/s of its last timed steps, micro-steps and tokens per optimizer
    step}, from the log.jsonl of each compiled training run under `work` (steps_*) that got past its start-up."""
    runs = {}
    for log in sorted(glob.glob(os.path.join(work, "steps_*", "log.jsonl"))):
        with open(log) as f:
            events = [json.loads(line) for line in f if line.endswith("\n")]  # a killed run's torn line left out
        config = next((e for e in events if e["event"] == "config"), None)
        timed = [e for e in events if e["event"] == "train" and e.get("tokens_per_s")]
        started = [e["startup_time"] for e in events if e.get("startup_time")]
        if config and started:
            t, m = config["train_config"], config["model_config"]
            micro_tokens = t["batch_size"] * m["sequence_len"] * config["world_size"]
            step_tokens = t["total_batch_tokens"] or micro_tokens
            runs[os.path.basename(os.path.dirname(log))] = {
                "startup_s": started[0], "tokens_per_s": timed[-1]["tokens_per_s"] if timed else None,
                "micro_steps": step_tokens // micro_tokens, "step_tokens": step_tokens}
    return runs


def startup_report(runs, cap_s):
    """One line per compiled run: its start-up (cold where the machine's compile cache held none of its graphs,
    as in a first session) against the contest's start-up cap (TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS, 900 s;
    prepare.py charges start-up past it to the run: docs/contest.md)."""
    lines = []
    for name, run in runs.items():
        s = run["startup_s"]
        lines.append(f"cold start-up of {name}: {s:.0f} s of the {cap_s:.0f} s cap, " + (
            f"{s - cap_s:.0f} s past it (charged to the run)" if s > cap_s else f"{cap_s - s:.0f} s to spare"))
    return lines


def startup_costs(rows, runs, gains, budget_s, cap_s):
    """{op: why} for each kernel op whose start-up past the cap outweighs its gain over the training budget.
    The run on the kernels (steps_auto, or steps_nki in a rehearsal) gives the start-up, past the cap by
    `excess`; each op's kernels add about what its step alone took beyond the bare `versions` step (its kernels'
    cold compile, on a device); its gain is its saved seconds per micro-step (kernel_gains) as a share of the
    PyTorch run's step, times `budget_s`. Ops with the least gain per second of start-up go first, each charged
    what of its start-up still lies past the cap, until none does; an op without a gain estimate is kept."""
    kernel_run = runs.get("steps_auto") or runs.get("steps_nki")
    torch_run = runs.get("steps_torch")
    seconds = {r["step"]: r["seconds"] for r in rows}
    if not kernel_run or not torch_run or not torch_run["tokens_per_s"] or "versions" not in seconds:
        return {}
    excess = kernel_run["startup_s"] - cap_s
    step_s = torch_run["step_tokens"] / torch_run["tokens_per_s"]
    added = {op: max(0.0, seconds.get(f"kernels: {op}", 0.0) - seconds["versions"]) for op in gains}
    gain_s = {op: budget_s * gains[op] * torch_run["micro_steps"] / step_s for op in gains}
    off = {}
    for op in sorted(gains, key=lambda op: gain_s[op] / max(added[op], 1e-9)):
        charged = min(added[op], excess)
        if charged > 0 and gain_s[op] < charged:
            off[op] = (f"its kernels add about {added[op]:.0f} s of start-up, {charged:.0f} s of it past the "
                       f"{cap_s:.0f} s start-up cap (charged to the run), for about {gain_s[op]:.0f} s of training "
                       f"gained over the {budget_s:.0f} s budget")
            excess -= charged
    return off


def paid_run_command(rows, check_rows, passthrough, on_trainium, lnc, ranks, fallbacks=None):
    """The first paid run's launch string, and the reasons for any op it runs on PyTorch."""
    setting, reasons = paid_run_kernels(rows, check_rows, on_trainium, fallbacks)
    flags = " ".join([a for a in passthrough if not a.startswith("--kernels")] + [f"--kernels={setting}"])
    command = f"NEURON_LOGICAL_NC_CONFIG={lnc} torchrun --standalone --nproc_per_node={ranks} train.py {flags}"
    return command if on_trainium else f"(on a Trn2) {command}", reasons


def print_table(rows, command, reasons, seconds, startup_lines=()):
    print(f"\nfirst device session: {sum(r['passed'] for r in rows)} of {len(rows)} steps passed in {seconds:.0f} s")
    print(f"{'step':<52} {'result':<6} {'s':>7}  detail")
    for r in rows:
        print(f"{r['step']:<52} {'pass' if r['passed'] else 'FAIL':<6} {r['seconds']:>7.1f}  {r['detail']}")
    code = 0 if all(r["passed"] for r in rows) else 1
    print(f"exit code {code}")
    for line in startup_lines:
        print(line)
    for reason in reasons:
        print(f"on PyTorch: {reason}")
    print(f"first paid run: {command}")
    return code


def run_first_hour(passthrough, budget_s, cap_s, out_dir=None):
    """Every step of plan() in turn under the paid run's LNC; returns the rows, the paid run's launch
    string, the reasons for each op it keeps off NKI, the seconds it all took and a line per compiled run on
    its cold start-up against the cap. `budget_s`, `cap_s`: the paid run's --time_budget_s and --startup_cap_s.
    Off Trainium the start-ups are the CPU's: reported, never turning a kernel off."""
    on_trainium = runtime.detect_device() == "neuron"
    lnc, ranks = paid_launch()
    env = {**os.environ, "NEURON_LOGICAL_NC_CONFIG": str(lnc)}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="first_hour_", dir=out_dir) as work:
        rows = [run_step(*step, env=env) for step in plan(passthrough, on_trainium, work, lnc, ranks)]
        check_rows, kernel_rows = read_rows(check_json(work), "check"), read_rows(gains_json(work), "kernels")
        runs, fallbacks = compiled_runs(work), build_failures(work)
    if on_trainium:
        fallbacks = {**startup_costs(rows, runs, kernel_gains(kernel_rows), budget_s, cap_s), **fallbacks}
    command, reasons = paid_run_command(rows, check_rows, passthrough, on_trainium, lnc, ranks, fallbacks)
    return rows, command, reasons, time.perf_counter() - t0, startup_report(runs, cap_s)


def read_rows(path, key):
    """The rows a step wrote to the JSON file `path` under `key`, or None where it wrote none."""
    try:
        with open(path) as f:
            return json.load(f)[key]
    except (OSError, ValueError, KeyError):
        return None

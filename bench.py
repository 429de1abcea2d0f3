"""
Throughput, MFU and kernel efficiency, measured on the device at hand.

    python bench.py                                   # train.py's default model: tokens/s and MFU
    python bench.py --n_layer=8 --n_embd=512 --json=bench.json
    torchrun --standalone --nproc_per_node=4 bench.py # per rank and for the whole job
    python bench.py --kernels                         # each kernel against its PyTorch fallback (+ Trn2 estimate)
    python bench.py --step_estimate --preset=baseline # a whole Trn2 training step, estimated from the cost model
    python bench.py --versus_nanogpt=../nanoGPT       # tokens/s against nanoGPT's model at the same shapes
    python bench.py --sweep --sweep_out=sweep         # shape choices -> sweep.csv, sweep.json, sweep.png
    python bench.py --first_hour --preset=baseline    # kit/first_hour.py: the whole first Trainium session
    python bench.py --check                           # kit/device_check.py: NKI against PyTorch on this device
    python bench.py --memory --preset=phase2 --world_size=64  # kit/memory.py: per-rank memory plan
    OMP_NUM_THREADS=1 python bench.py --ablation      # kit/ablation.py: val_bpb of each frontier lever (CPU)

The last four run the programs in kit/ named. Every train.py field is accepted as --field=value (so
--preset=baseline works too).

Training throughput runs train.py's own optimizer step (same compile, autocast and optimizers) on random
tokens, leaves out --bench_warmup steps (compilation), synchronises the device before every timer read
and reports the median and spread of --bench_windows timed windows.

MFU = model FLOPs per token x tokens/s / peak FLOP/s of the ranks used. Model FLOPs per token is
GPT.flops_per_token(): 6 x matmul parameters + 12 x n_layer x n_head x head_dim x sequence_len (PaLM
appendix B; attention at full, non-causal length). Peaks: dense bf16 datasheet numbers per rank
(runtime.PEAK_FLOPS; a Trn2 rank at NEURON_LOGICAL_NC_CONFIG=2 is two physical cores), a measured matmul
on CPU, or --peak_tflops.

Estimates for Trn2 without a Trn2 (--kernels, --step_estimate, --sweep off Trainium): the NKI kernels run
under the CPU emulator, whose cost model (nki_emulator/_cost.py, each formula with its AWS source) prices
every instruction on its engine; a kernel call gets a busy time per engine, a bottleneck, an overlap bound
(the busiest engine: estimate_s) and a serial bound (the sum: serial_s). A whole training step adds what the
compiler generates around the kernels, priced with the same table (kit/compiled_cost.py); its assumptions
are STEP_ASSUMPTIONS (there too), the compiler's fusion of elementwise chains included (FUSION_RULES). Both print
a range: the optimistic figure above (overlap bound), a central one (each kernel call list-scheduled as the
compiler would, nki_emulator/_schedule.py, with the factors and launch cost calibrated against public hardware
timings, nki_emulator/calibrate.py) and a pessimistic one (kernels in program order; in a step, no fusion either:
every compiled elementwise pass an HBM round trip). --step_estimate also prices the public Trn2 runs as they ran
(no NKI kernels) beside the kit with its kernels. Estimates, not measurements: host dispatch is left out (named
beside the public runs).
"""
import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from unittest import mock

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# The CPU emulator of NKI (nki_emulator/, beside this file), with the cost model behind every Trn2 estimate here.
import nki_emulator  # noqa: E402

if {"--kernels", "--check", "--sweep", "--step_estimate", "--first_hour_step"} & set(sys.argv[1:]):
    # Off Trainium these run (and count) the NKI kernels under the emulator, which has to stand in for `nki`
    # before kernels.py imports it. (Where the Neuron SDK is installed it is used.)
    nki_emulator.install()

import data  # noqa: E402
import kernels  # noqa: E402
import train  # noqa: E402
from kit import ablation, build, device_check, first_hour, flags, memory, optim, runtime, sweep_files  # noqa: E402
from kit.compiled_cost import (ADAMW_PASSES, ENGINES, MUON_PASSES, STEP_ASSUMPTIONS,  # noqa: E402
                               compiled_estimate, compiled_ops, fusing, gemm, linear, op_seconds, passes,
                               pricing)
from model import GPT

PE_FLOPS_PER_CYCLE = 2 * 128 * 128  # one multiply-add per processing element of the systolic array
TRN2 = nki_emulator.ENGINE_SPECS["trn2"]  # what every estimate here is for: one Trn2 NeuronCore


# -----------------------------------------------------------------------------
# whole-model training throughput

def timed_windows(run, steps, windows, warmup, sync):
    """Seconds per window of `steps` calls, after `warmup` untimed calls; the device is synchronised
    before each clock read so queued work is counted where it ran."""
    for _ in range(warmup):
        run()
    sync()
    seconds = []
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(steps):
            run()
        sync()
        seconds.append(time.perf_counter() - t0)
    return seconds


def measure_training(cfg, model_cfg, steps, windows, warmup, device_type, device):
    torch.manual_seed(cfg.seed)
    raw_model = GPT(model_cfg).to(device)
    shape = (cfg.batch_size, model_cfg.sequence_len)
    batch = [(torch.randint(0, model_cfg.vocab_size, shape), torch.randint(0, model_cfg.vocab_size, shape))]
    model = build.wrap_for_training(raw_model, cfg, device_type, device, [t.to(device) for t in batch[0]])
    optimizers = optim.make_optimizers(raw_model, cfg, device_type, runtime.compute_dtype(cfg))
    autocast = runtime.autocast_context(cfg, device_type)

    def step():
        train.train_step(model, raw_model, optimizers, batch, device, autocast, cfg.grad_clip)

    t0 = time.perf_counter()
    seconds = timed_windows(step, steps, windows, warmup, lambda: runtime.synchronize(device_type))
    tokens = steps * cfg.batch_size * model_cfg.sequence_len
    rates = [tokens / s for s in seconds]
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    per_rank = statistics.median(rates)
    if dist.is_initialized():  # the job's rate is the sum over ranks; each rank's median is reported too
        gathered = [None] * world_size
        dist.all_gather_object(gathered, per_rank)
    else:
        gathered = [per_rank]
    flops_per_token = raw_model.flops_per_token()
    peak = runtime.peak_flops(device_type, runtime.compute_dtype(cfg), cfg.peak_tflops)
    job_tokens_per_s = sum(gathered)
    return {
        "device": device_type,
        "world_size": world_size,
        "dtype": cfg.dtype,
        "peak_source": "--peak_tflops" if cfg.peak_tflops else (f"measured {cfg.dtype} matmul" if device_type == "cpu" else f"{cfg.dtype} datasheet"),
        "params": raw_model.num_params(),
        "tokens_per_s": job_tokens_per_s,
        "tokens_per_s_per_rank": gathered,
        "tokens_per_s_min": min(rates) * world_size,
        "tokens_per_s_max": max(rates) * world_size,
        "flops_per_token": flops_per_token,
        "flops_per_s": job_tokens_per_s * flops_per_token,
        "peak_flops": peak * world_size,
        "mfu": job_tokens_per_s * flops_per_token / (peak * world_size),
        "warmup_and_timing_s": time.perf_counter() - t0,
        "model_config": dataclasses.asdict(model_cfg),
    }


def print_training(r, steps, windows):
    print(f"device            {r['device']} x {r['world_size']} rank(s)")
    print(f"parameters        {r['params']:,}")
    print(f"tokens/s          {r['tokens_per_s']:,.0f}  (median of {windows} windows of {steps} steps; "
          f"min {r['tokens_per_s_min']:,.0f}, max {r['tokens_per_s_max']:,.0f})")
    if r["world_size"] > 1:
        print(f"tokens/s per rank {', '.join(f'{x:,.0f}' for x in r['tokens_per_s_per_rank'])}")
    print(f"FLOPs/token       {r['flops_per_token'] / 1e6:.2f} M  (6 x matmul params + 12 x L x H x d x T)")
    print(f"achieved FLOP/s   {r['flops_per_s'] / 1e12:.3f} T")
    print(f"peak FLOP/s       {r['peak_flops'] / 1e12:.3f} T  ({r['peak_source']})")
    print(f"MFU               {100 * r['mfu']:.1f}%")


# -----------------------------------------------------------------------------
# against nanoGPT: the same shapes, steps interleaved in one process

def load_nanogpt(folder):
    """karpathy/nanoGPT's model.py from a checkout the user made (the kit never copies or downloads it)."""
    path = os.path.join(folder, "model.py")
    if not os.path.isfile(path):
        raise ValueError(f"--versus_nanogpt={folder}: there is no model.py there; clone "
                         "https://github.com/karpathy/nanoGPT and pass its folder")
    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = getattr(module, "GPTConfig", None)
    if not (dataclasses.is_dataclass(config) and "block_size" in {f.name for f in dataclasses.fields(config)}
            and hasattr(getattr(module, "GPT", None), "configure_optimizers")):
        raise ValueError(f"--versus_nanogpt={folder}: its model.py is not nanoGPT's (no GPTConfig with block_size, "
                         "or no GPT.configure_optimizers); pass the folder of a karpathy/nanoGPT clone")
    return module


def measure_versus_nanogpt(cfg, model_cfg, folder, steps, windows, warmup, device_type, device):
    """Tokens/s of train.py's step and of nanoGPT's (its GPT at the same n_layer, n_head, n_embd, context,
    padded vocab and batch; bias off, dropout 0, its configure_optimizers' AdamW at its train.py defaults,
    grad clip 1; eager as its --compile=False, and compiled as its default unless --compile=false).
    Windows of each run in turn, so a machine whose speed drifts slows all of them alike; all under the
    kit's autocast setting. The models have the same matmul FLOPs per token, so the ratio of tokens/s is
    the ratio of model FLOP/s."""
    if dist.is_initialized():
        raise ValueError("--versus_nanogpt compares single processes; run it without torchrun")
    nanogpt = load_nanogpt(folder)
    config = nanogpt.GPTConfig(block_size=model_cfg.sequence_len, vocab_size=model_cfg.padded_vocab_size,
                               n_layer=model_cfg.n_layer, n_head=model_cfg.n_head, n_embd=model_cfg.n_embd,
                               dropout=0.0, bias=False)
    autocast = runtime.autocast_context(cfg, device_type)
    shape = (cfg.batch_size, model_cfg.sequence_len)
    x, y = (torch.randint(0, model_cfg.vocab_size, shape, device=device) for _ in range(2))

    def nanogpt_step(model, raw, optimizer):
        with autocast:
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    runs = {}
    for name, compiled in (("nanoGPT, eager", False), ("nanoGPT, torch.compile", True))[: 1 + cfg.compile]:
        torch.manual_seed(cfg.seed)
        raw = nanogpt.GPT(config).to(device)
        optimizer = raw.configure_optimizers(0.1, 6e-4, (0.9, 0.95), device_type)
        model = torch.compile(raw) if compiled else raw
        runs[name] = functools.partial(nanogpt_step, model, raw, optimizer)
    torch.manual_seed(cfg.seed)
    raw_model = GPT(model_cfg).to(device)
    model = build.wrap_for_training(raw_model, cfg, device_type, device, (x.to(device), y.to(device)))
    optimizers = optim.make_optimizers(raw_model, cfg, device_type, runtime.compute_dtype(cfg))
    runs["this kit (train.py's step)"] = lambda: train.train_step(model, raw_model, optimizers, [(x, y)], device, autocast, cfg.grad_clip)
    sync = functools.partial(runtime.synchronize, device_type)
    seconds = {name: [] for name in runs}
    for run in runs.values():
        timed_windows(run, 0, 0, warmup, sync)
    for _ in range(windows):
        for name, run in runs.items():
            seconds[name] += timed_windows(run, steps, 1, 0, sync)
    tokens = steps * cfg.batch_size * model_cfg.sequence_len
    rates = {name: statistics.median(tokens / s for s in times) for name, times in seconds.items()}
    base = rates["nanoGPT, eager"]
    return [{"run": name, "tokens_per_s": rate, "vs_nanogpt_eager": rate / base,
             "tokens_per_s_min": tokens / max(seconds[name]), "tokens_per_s_max": tokens / min(seconds[name])}
            for name, rate in rates.items()]


def print_versus(rows, model_cfg, batch_size):
    print(f"same shapes: {model_cfg.n_layer} layers, width {model_cfg.n_embd}, {model_cfg.n_head} heads, "
          f"{model_cfg.sequence_len} tokens, batch {batch_size}, vocab {model_cfg.padded_vocab_size}")
    print(f"{'run':28} {'tokens/s':>10} {'(min':>9} {'max)':>9}  vs nanoGPT eager")
    for r in rows:
        print(f"{r['run']:28} {r['tokens_per_s']:10,.0f} {r['tokens_per_s_min']:9,.0f} {r['tokens_per_s_max']:9,.0f}"
              f"  {r['vs_nanogpt_eager']:.2f}x")


# -----------------------------------------------------------------------------
# kernels: NKI against the PyTorch fallback

def kernel_estimate(counts):
    """One kernel call on one Trn2 NeuronCore, from the emulator's trace (cost model in the module docstring):
    busy seconds per engine, the bottleneck, estimate_s (overlap bound) and serial_s (serial bound), and
    TensorE use = matmul FLOPs / (TensorE seconds x its peak)."""
    estimate = nki_emulator.estimate(counts.trace, "trn2")
    tensor_s = estimate["engines"]["tensor"]
    return {
        **estimate,
        **nki_emulator.schedule_figures(counts.trace, "trn2"),  # optimistic_s, central_s, pessimistic_s, scheduled_s
        "tensore_utilisation": counts.matmul_flops / (tensor_s * PE_FLOPS_PER_CYCLE * TRN2.tensor_hz) if tensor_s else 0.0,
        "matmuls": len(counts.matmul_shapes),
        "transposes": len(counts.transposes),
        "instructions": dict(counts.instructions),
        "dma_bytes": counts.dma_bytes,
        "matmul_flops": counts.matmul_flops,
    }


def time_call(call, inputs, backward, device_type, steps=5, windows=3):
    def run():
        out = call(*inputs)
        if backward:
            out.float().square().mean().backward()

    return statistics.median(timed_windows(run, steps, windows, 2, lambda: runtime.synchronize(device_type))) / steps


def emulate(call, inputs, backward):
    """Runs the NKI path under the emulator on CPU and returns its counts. The kernels launch as on an LNC=1
    rank, one NeuronCore doing the whole call, which is what the estimates price."""
    with mock.patch.dict(os.environ, NEURON_LOGICAL_NC_CONFIG="1"), nki_emulator.counting() as counts:
        out = call(*inputs)
        if backward:
            out.float().square().mean().backward()
    return counts


def _compiled_fallback(model_cfg, name, batch_size, backward):
    """The compiled plain ops of one call of kernel op `name` at these shapes, priced as the step estimate prices
    them (compiled_ops): estimate_s, serial_s, engines, bottleneck."""
    ops = compiled_ops(name, model_cfg, batch_size)
    estimate = compiled_estimate(ops["forward"] + (ops["backward"] if backward else []))
    return {**estimate, "serial_s": sum(estimate["engines"].values())}


def kernel_calls(cfg, model_cfg):
    """{op: calls of kernels.<op> in one micro-step}: the model's forward on fake tensors (shapes only), each
    op's public function counted (model.py calls them through the module); each call is one forward and one
    backward of its kernels in training."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls, inside = dict.fromkeys(kernels.KERNEL_OPS, 0), []

    def counted(op, function):
        def call(*args, **kwargs):  # the model's calls only, not a PyTorch path's calls of another op
            calls[op] += not inside
            inside.append(op)
            try:
                return function(*args, **kwargs)
            finally:
                inside.pop()
        return call

    with FakeTensorMode(), mock.patch.multiple(kernels, **{op: counted(op, getattr(kernels, op)) for op in calls}):
        tokens = torch.zeros(cfg.batch_size, model_cfg.sequence_len, dtype=torch.long)
        GPT(model_cfg)(tokens, tokens)
    return calls


def measure_kernels(cfg, model_cfg, device_type, device, ops=kernels.KERNEL_OPS, timeline=None):
    """Each kernel op forward and forward + backward at the run's shapes (--batch_size sequences). On Trainium:
    the NKI kernel and the compiled PyTorch fallback both timed (torch.compile, fullgraph). Elsewhere: the
    PyTorch path timed here, and both priced for one Trn2 NeuronCore, the kernel by its emulated trace
    (kernel_estimate; where the kernel refuses the shapes, `nki_unavailable` says why) and the fallback as
    compiled plain ops ("compiled"). Every row carries `engines` and `bottleneck`: the kernel's, or the
    fallback's where the kernel cannot run (`priced` says which). `choice` is the faster of the two, "nki" or "torch"; `auto`, what
    kernels=auto runs on a Trn2 there. `ops`: the kernel ops to measure. `timeline`: a folder for each emulated
    call's schedule (nki_emulator/timeline.py: a trace-event .json for Perfetto and a .png). `calls`: how
    many times a micro-step calls the op (kernel_calls)."""
    dtype = runtime.compute_dtype(cfg)
    calls = kernel_calls(cfg, model_cfg)
    peak = runtime.peak_flops(device_type, dtype, cfg.peak_tflops)
    on_trainium = device_type == "neuron"
    rows = []
    cases = kernels.model_cases(model_cfg, cfg.batch_size, device, dtype)
    for name, fwd_flops, train_flops, make_inputs, call in cases:
        if name.split()[0] not in ops:
            continue
        for direction, flops in (("forward", fwd_flops), ("fwd+bwd", train_flops)):
            backward = direction == "fwd+bwd"
            row = {"kernel": name, "op": name.split()[0], "direction": direction, "flops": flops,
                   "calls": calls[name.split()[0]]}
            inputs = make_inputs()
            torch_call = lambda *a: call(*a, "torch")  # noqa: E731
            if on_trainium:  # the fallback as training runs it: one compiled graph
                torch_call = torch.compile(torch_call, backend="neuron", fullgraph=True)
            seconds = time_call(torch_call, inputs, backward, device_type)
            row.update(torch_s=seconds, torch_flops_per_s=flops / seconds, torch_fraction_of_peak=flops / seconds / peak)
            if name == "rms_norm":  # no matmul work: its figure of merit is bandwidth
                x = inputs[0]
                row["torch_bytes_per_s"] = (5 if backward else 2) * x.numel() * x.element_size() / seconds
            if on_trainium:
                try:
                    nki_call = torch.compile(lambda *a: call(*a, "nki"), backend="neuron", fullgraph=True)
                    seconds = time_call(nki_call, make_inputs(), backward, device_type)
                except (RuntimeError, ValueError) as e:  # a shape the kernel cannot take: say why
                    row.update(nki_unavailable=str(e).splitlines()[0], choice="torch")
                else:
                    row.update(nki_s=seconds, nki_flops_per_s=flops / seconds, nki_fraction_of_peak=flops / seconds / peak,
                               choice="nki" if seconds < row["torch_s"] else "torch")
            else:
                _price_on_trn2(row, model_cfg, cfg.batch_size, name, direction, call, make_inputs, timeline)
            row["auto"] = auto_choice(row, model_cfg, cfg.batch_size * model_cfg.sequence_len)
            rows.append(row)
    return rows


def _price_on_trn2(row, model_cfg, batch_size, name, direction, call, make_inputs, timeline):
    """Off Trainium, measure_kernels' pricing of one op and direction for one Trn2 NeuronCore, into `row`: the
    fallback as compiled plain ops ("compiled") and the kernel by its emulated trace (kernel_estimate), or
    `nki_unavailable` with the fallback's engines and bottleneck where the kernel refuses the shapes; `priced`,
    which was used, and `choice`, the faster. With `timeline`, writes the emulated call's schedule there."""
    # estimated for Trn2 as training runs there: bf16 inputs, whatever this CPU computes in
    backward = direction == "fwd+bwd"
    row["compiled"] = _compiled_fallback(model_cfg, row["op"], batch_size, backward)
    cpu_inputs = [t.detach().cpu().to(torch.bfloat16).requires_grad_() if t is not None else None
                  for t in make_inputs()]
    try:
        counts = emulate(lambda *a: call(*a, "nki"), cpu_inputs, backward)
    except (RuntimeError, ValueError) as e:  # a shape the kernel cannot take: say why
        row.update(nki_unavailable=str(e).splitlines()[0], choice="torch", priced="compiled",
                   **{k: row["compiled"][k] for k in ("engines", "bottleneck")})
    else:
        row.update(kernel_estimate(counts), priced="nki")
        if timeline:
            central = nki_emulator.schedule(counts.trace, "trn2", nki_emulator.calibrated_seconds)
            nki_emulator.timeline.write(counts.trace, central, timeline,
                                        f"{row['op']}_{direction.replace('+', '_')}", f"{name} {direction}")
        row["choice"] = "nki" if row["estimate_s"] < row["compiled"]["estimate_s"] else "torch"


def _cost_declines(op, model_cfg, tokens):
    """Whether op's cost rule (KernelOp.cost_problem) declines its kernel at `tokens` tokens per call."""
    rule = kernels.OPS[op].cost_problem
    return rule is not None and rule(model_cfg, tokens) is not None


def auto_choice(row, model_cfg, tokens):
    """What kernels=auto runs on a Trn2 at the row's shapes: the kernel where it takes them, unless its cost
    rule declines them."""
    return "torch" if "nki_unavailable" in row or _cost_declines(row["op"], model_cfg, tokens) else "nki"


def kernels_choice(rows):
    """The --kernels=... value the rows imply: per op, the faster path forward + backward, as training runs."""
    return ",".join(f"{r['op']}:{r['choice']}" for r in rows if r["direction"] == "fwd+bwd")


ENGINE_LETTERS = dict(zip(ENGINES, "TVSGD"))


def print_kernels(rows, on_trainium):
    if not on_trainium:
        print("NKI on one Trn2 NeuronCore, ESTIMATED from the emulator's instructions (nki_emulator/_cost.py), and "
              "the compiled PyTorch fallback priced as plain ops (compiled_ops): us busy per engine (T TensorE, V "
              "VectorE, S ScalarE, G GpSimd, D DMA), the bottleneck, the overlap bound (est: busiest engine, the "
              "optimistic figure), the central figure (central: the compiler's scheduler modelled, a list schedule "
              "over the dependencies, with the calibrated factors and launch cost, nki_emulator._cost.CALIBRATED), "
              "the pessimistic figure (pessim: the same in program order) and the serial bound (sum); 'torch ms' is "
              "this machine's PyTorch path. Not modelled: host dispatch idle, the compiler's fusions")
    print(f"{'kernel':<16} {'pass':<8} {'torch ms':>9} {'TFLOP/s':>8} {'of peak':>8}   "
          + ("NKI ms  TFLOP/s  of peak  faster" if on_trainium else
             f"{'est us':>7} {'central':>7} {'pessim':>7} {'serial':>7}  {'bound':<7}"
             + "".join(f"{e:>8}" for e in ENGINE_LETTERS.values())
             + "  TensorE use   compiled us  bound   faster"))
    for r in rows:
        if r["flops"]:
            rate = f"{r['torch_flops_per_s'] / 1e12:>8.3f} {100 * r['torch_fraction_of_peak']:>7.1f}%"
        elif "torch_bytes_per_s" in r:  # x read and y written forward; x, dy read and dx written again backward
            rate = f"{r['torch_bytes_per_s'] / 1e9:>5.1f} GB/s        "
        else:
            rate = " " * 17
        line = f"{r['kernel']:<16} {r['direction']:<8} {1e3 * r['torch_s']:>9.3f} {rate}   "
        if "nki_unavailable" in r:
            line += f"n/a: {r['nki_unavailable']}"
        elif on_trainium:
            line += (f"{1e3 * r['nki_s']:.3f}  {r['nki_flops_per_s'] / 1e12:.3f}  {100 * r['nki_fraction_of_peak']:.1f}%"
                     f"  {r['choice']}")
        else:
            line += (f"{1e6 * r['estimate_s']:>7.1f} {1e6 * r['central_s']:>7.1f} {1e6 * r['pessimistic_s']:>7.1f} "
                     f"{1e6 * r['serial_s']:>7.1f}  {r['bottleneck']:<7}"
                     + "".join(f"{1e6 * r['engines'][e]:>8.1f}" for e in ENGINE_LETTERS)
                     + f"  {100 * r['tensore_utilisation']:>10.0f}%")
        if not on_trainium:
            line += f"   {1e6 * r['compiled']['estimate_s']:>11.1f}  {r['compiled']['bottleneck']:<7} {r['choice']}"
        print(line)
    how = "measured here" if on_trainium else "by the cost model's estimates, not measured"
    print(f"\nfaster at these shapes ({how}): --kernels={kernels_choice(rows)}")
    differ = [r["op"] for r in rows if r["direction"] == "fwd+bwd" and r["auto"] != r["choice"]]
    print(f"kernels=auto runs {'the same' if not differ else 'otherwise for ' + ', '.join(differ)} on a Trn2 at "
          "these shapes (its rules: kernels.py, _mlp_cost_problem; docs/results.md)")


# -----------------------------------------------------------------------------
# a whole training step on Trn2, estimated: the kernels' costs plus what the compiler generates around them

def kernel_schedules(trace):
    """{figure: (seconds, launches)} of a kernel call's calibrated schedule: central, the list schedule (the
    compiler's scheduler modelled, nki_emulator.central_estimate); pessimistic, every engine in program order
    (nki_emulator.pessimistic_estimate)."""
    central, pessimistic = (estimate(trace, "trn2") for estimate in (nki_emulator.central_estimate,
                                                                     nki_emulator.pessimistic_estimate))
    return {"central": (central["scheduled_s"], central["launches"]),
            "pessimistic": (pessimistic["scheduled_s"], pessimistic["launches"])}


def kernel_step_costs(model_cfg, tokens_per_call, figure="optimistic"):
    """kernel_step_figures at one figure."""
    return kernel_step_figures(model_cfg, tokens_per_call, (figure,))[figure]


def kernel_step_figures(model_cfg, tokens_per_call, figures=None):
    """{figure: {kernel: seconds}}: one call of each NKI kernel, forward + backward, for one sequence (optimistic:
    estimate_s; central and pessimistic: its calibrated schedule (kernel_schedules) plus its launches' cost shared
    by the call's sequences), or None where the kernel does not run on Trn2: its kernels mode is torch, it refuses
    the shapes, or (kernels=auto) the cost rule declines it at `tokens_per_call` (KernelOp.cost_problem). The
    kernel part of step_estimate; each kernel is emulated once for the `figures` asked (default: all three)."""
    if kernels.nki is not nki_emulator:
        raise ValueError("the Trn2 estimates run the kernels under the NKI emulator, which stands in for nki only "
                         "where the Neuron SDK is not installed; run them on a machine without it")
    figures = figures or tuple(FIGURES)
    modes, costs = kernels.parse_kernels(model_cfg.kernels), {figure: {} for figure in figures}
    per_sequence = model_cfg.sequence_len / tokens_per_call  # a call's launches shared by its sequences
    for name, _, _, make_inputs, call in kernels.model_cases(model_cfg, 1, "cpu", torch.bfloat16):
        name = name.split()[0]
        op = "rms_norm" if name == "rms_norm_fp32" else name  # the stream's norms are rms_norm's op
        mode = modes[op]
        inputs = [t.detach().to(torch.bfloat16).requires_grad_() if t is not None else None for t in make_inputs()]

        def seconds(run):  # one sequence's forward + backward: {figure: the overlap bound, or the schedule}
            counts = emulate(run, inputs, backward=True)
            scheduled = kernel_schedules(counts.trace) if set(figures) - {"optimistic"} else {}
            return {"optimistic": nki_emulator.estimate(counts.trace, "trn2")["estimate_s"],  # the overlap bound
                    **{figure: scheduled_s + launches * nki_emulator.LAUNCH_S * per_sequence
                       for figure, (scheduled_s, launches) in scheduled.items()}}

        if mode == "torch" or (mode == "auto" and _cost_declines(op, model_cfg, tokens_per_call)):
            for figure in figures:
                costs[figure][name] = None
            continue
        try:
            if name == "attention":  # each layer at its window (a window skips key blocks): the layers' mean
                windows = model_cfg.attention_windows()
                at = {w: seconds(lambda *a: call(*a, "nki", window=w)) for w in set(windows)}
                for figure in figures:
                    costs[figure][name] = statistics.fmean(at[w][figure] for w in windows)
            else:
                at = seconds(lambda *a: call(*a, "nki"))
                for figure in figures:
                    costs[figure][name] = at[figure]
        except (RuntimeError, ValueError):  # a shape the kernel cannot take: compiled plain ops instead
            for figure in figures:
                costs[figure][name] = None
    return costs


def _layer_ops(c, sequences, kernel_costs):
    """{component: seconds} of one micro-step of `sequences` sequences through all blocks, forward + backward."""
    T, C, L = c.sequence_len, c.n_embd, c.n_layer
    N, kv = sequences * T, c.n_kv_head * c.head_dim
    seconds = {}

    def add(component, op, times=L):
        seconds[component] = seconds.get(component, 0.0) + times * op_seconds(op)

    for projection in (linear(N, C, C + 2 * kv), linear(N, C, C)):  # q, k, v; output projection
        for op in projection.values():
            add("projection matmuls", op)
    # model.Block fuses each residual add with the norm of its sum, where that norm comes next: not where the
    # residual scalars rescale x between blocks (then each block norms its input itself)
    if kernel_costs["add_rms_norm"] is None:
        fused_adds, plain_adds, stream_norms = 0, 2 * L, 2 * L + 2  # x twice per block, the embedding, the final norm
    elif c.residual_scalars:
        fused_adds, plain_adds, stream_norms = L + 1, L - 1, L + 1  # the embedding, each block's input
    else:
        fused_adds, plain_adds, stream_norms = 2 * L, 0, 2  # the embedding, the first block's input
    rope_fused = kernel_costs["rope_norm"] is not None  # else the rotary's passes, and QK-norm by rms_norm
    for direction in ("forward", "backward"):  # rotary on q and k; residuals (the kernels change layouts on chip)
        if not rope_fused:
            add("elementwise", passes(N * (C + kv), one_input=1, two_input=3, dtype="bfloat16"))
        add("elementwise", passes(N * C, two_input=1), plain_adds)
    if fused_adds:
        seconds["kernels: add_rms_norm"] = fused_adds * sequences * kernel_costs["add_rms_norm"]
    if rope_fused:
        seconds["kernels: rope_norm"] = L * sequences * kernel_costs["rope_norm"]
    qk_norm_elements = 0 if rope_fused else L * (N * C + N * kv)
    stream_norm_elements = stream_norms * N * C
    norm_elements = stream_norm_elements + qk_norm_elements
    for name in ("rms_norm", "attention", "mlp"):
        if kernel_costs[name] is None:
            ops = compiled_ops(name, c, sequences, norm_elements)
            for op in ops["forward"] + ops["backward"]:
                add(f"{name} (compiled)", op, 1 if name == "rms_norm" else L)
        elif name == "rms_norm":
            seconds["kernels: rms_norm"] = (kernel_costs["rms_norm_fp32"] * stream_norm_elements
                                            + kernel_costs["rms_norm"] * qk_norm_elements) / (T * C)
        else:
            seconds[f"kernels: {name}"] = L * sequences * kernel_costs[name]
    return seconds


FIGURES = {  # the step's three figures: how each prices the kernels and the compiled ops around them
    "optimistic": "kernels at their busiest engine, no launch cost; elementwise chains fused (FUSION_RULES)",
    "central": "kernels list-scheduled, calibrated, launch cost; elementwise chains fused (FUSION_RULES)",
    "pessimistic": "kernels in program order, calibrated, launch cost; every elementwise pass an HBM round trip",
}


def step_figures(cfg, model_cfg, ranks=1):
    """{figure: step_estimate} for the three FIGURES, the kernels emulated once."""
    costs = kernel_step_figures(model_cfg, cfg.batch_size * model_cfg.sequence_len)
    return {figure: step_estimate(cfg, model_cfg, ranks, costs[figure], figure) for figure in FIGURES}


def step_estimate(cfg, model_cfg, ranks=1, kernel_costs=None, figure="optimistic"):
    """One optimizer step of train.py on `ranks` LNC=1 Trn2 NeuronCores, estimated (STEP_ASSUMPTIONS):
    {component: seconds per step}, step_s, tokens_per_s (the job's), params. `figure`: one of FIGURES (central:
    CENTRAL_ASSUMPTIONS; pessimistic: no fusion of the compiled elementwise passes); `kernel_costs`: seconds per
    sequence of each kernel (default: kernel_step_costs at this figure)."""
    if figure not in FIGURES:
        raise ValueError(f"figure={figure!r}: use one of {', '.join(FIGURES)}")
    if kernel_costs is None:
        kernel_costs = kernel_step_costs(model_cfg, cfg.batch_size * model_cfg.sequence_len, figure)
    pricing.append(nki_emulator.calibrated_seconds if figure != "optimistic" else pricing[0])
    fusing.append(figure != "pessimistic")
    try:
        return {**_step_seconds(cfg, model_cfg, ranks, kernel_costs), "figure": figure}
    finally:
        pricing.pop()
        fusing.pop()


def _step_seconds(cfg, c, ranks, kernel_costs):
    """step_estimate at the pricing and fusion in force."""
    with torch.device("meta"):  # shapes only
        model = GPT(dataclasses.replace(c))
    micro_tokens = cfg.batch_size * c.sequence_len * ranks
    step_tokens = cfg.total_batch_tokens or micro_tokens
    if step_tokens % micro_tokens:
        raise ValueError(f"total_batch_tokens={step_tokens} is not a multiple of batch_size * sequence_len * ranks "
                         f"= {micro_tokens}")
    micro_steps, N, V = step_tokens // micro_tokens, cfg.batch_size * c.sequence_len, c.padded_vocab_size
    seconds = {k: micro_steps * v for k, v in _layer_ops(c, cfg.batch_size, kernel_costs).items()}
    head = linear(N, c.n_embd, V)
    seconds["head matmul"] = micro_steps * sum(op_seconds(op) for op in head.values())
    if kernel_costs["softcap_cross_entropy"] is not None and not (c.mtp_extra or c.loss_chunks):  # (levers: their own loss)
        seconds["kernels: softcap_cross_entropy"] = micro_steps * cfg.batch_size * kernel_costs["softcap_cross_entropy"]
    else:
        head_ops = compiled_ops("softcap_cross_entropy", c, cfg.batch_size)
        seconds["head softcap + cross-entropy"] = micro_steps * sum(
            op_seconds(op) for op in head_ops["forward"] + head_ops["backward"])
    params = sum(p.numel() for p in model.parameters())
    seconds["embedding lookup"] = micro_steps * 2 * op_seconds(passes(N * c.n_embd, one_input=1))
    seconds["optimizer"], exchanged = _optimizer_seconds(cfg, model, ranks)
    # the gradients: clipped (a norm, then a scale: two passes apart) and accumulated once a micro-step after the first
    seconds["optimizer"] += ((2 if cfg.grad_clip else 0) * op_seconds(passes(params, one_input=1))
                             + (micro_steps - 1) * op_seconds(passes(params, two_input=1)))
    seconds["gradient exchange"] = 2 * (ranks - 1) / ranks * 4 * exchanged / (TRN2.dma_queues * TRN2.dma_bytes_per_s)
    step_s = sum(seconds.values())
    return {"components": seconds, "step_s": step_s, "tokens_per_s": step_tokens / step_s, "ranks": ranks,
            "step_tokens": step_tokens, "micro_steps": micro_steps, "params": params,
            "kernel_costs_s": kernel_costs}


def _optimizer_seconds(cfg, model, ranks):
    """The busiest rank's optimizer update (Muon and AdamW on its share, optim.shard_layout) and the elements the
    gradients' exchange moves per rank."""
    shapes = [tuple(p.shape) for p in model.parameters()]
    muon = {id(p) for p in optim.split_parameters(model)[2]} if cfg.matrix_optimizer == "muon" else set()
    sharded = memory.shards_optimizer(cfg, ranks)
    layout = optim.shard_layout(shapes, optim.whole_tensors(model, cfg), ranks if sharded else 1)
    shares = [([], 0) for _ in range(ranks if sharded else 1)]  # per rank: its Muon matrices' shapes, AdamW elements
    for p, pieces in zip(model.parameters(), layout):
        for rank, _, _, elements in pieces:
            shares[rank] = (shares[rank][0] + [tuple(p.shape)], shares[rank][1]) if id(p) in muon else (shares[rank][0], shares[rank][1] + elements)
    optimizer_s = []
    for share_matrices, adamw_elements in shares:
        t = op_seconds(passes(adamw_elements, *ADAMW_PASSES))
        for shape in set(share_matrices):  # stacked by shape, as optim.Muon does; wide orientation (m <= n)
            m, n = sorted(shape)
            k = share_matrices.count(shape)
            gemms = [gemm(m, n, m, k), gemm(m, m, m, k), gemm(m, m, n, k)]
            t += 5 * sum(op_seconds(g) for g in gemms) + op_seconds(passes(k * m * n, *MUON_PASSES))
            t += 5 * (op_seconds(passes(k * m * m, two_input=1, dtype="bfloat16"))
                      + op_seconds(passes(k * m * n, two_input=1, dtype="bfloat16")))
        optimizer_s.append(t)
    exchanged = ranks * max(optim.shard_loads(layout, ranks)) if sharded else sum(math.prod(s) for s in shapes)
    return max(optimizer_s), exchanged


def print_step_estimate(r, model_cfg):
    c = model_cfg
    print(f"ESTIMATE of one training step on {r['ranks']} Trn2 NeuronCore(s) at LNC=1: {c.n_layer} layers, width "
          f"{c.n_embd}, {c.n_head}/{c.n_kv_head} heads of {c.head_dim}, seq {c.sequence_len}, vocab {c.padded_vocab_size}, "
          f"{r['params'] / 1e6:.1f}M params, {r['step_tokens']:,} tokens/step in {r['micro_steps']} micro-step(s)")
    for name, seconds in sorted(r["components"].items(), key=lambda kv: -kv[1]):
        print(f"  {name:<30} {1e3 * seconds:9.2f} ms  {100 * seconds / r['step_s']:5.1f}%")
    print(f"  {'step':<30} {1e3 * r['step_s']:9.2f} ms  -> {r['tokens_per_s']:,.0f} tokens/s")


def _mfu(r, model_cfg):
    """MFU of a step estimate r: model FLOPs per token (GPT.flops_per_token) x tokens/s over its ranks' peak."""
    with torch.device("meta"):
        flops = GPT(dataclasses.replace(model_cfg)).flops_per_token()
    return r["tokens_per_s"] * flops / (r["ranks"] * runtime.PEAK_FLOPS["trn2"])


def print_step_range(figures, model_cfg):
    """The three figures ({figure: step_estimate}), with what the central one assumes and what none models."""
    print("\nthe Trn2 step as a range (one number misleads; docs/results.md, calibration):")
    for name, r in figures.items():
        print(f"  {name:<11} {r['tokens_per_s']:>10,.0f} tokens/s  {100 * _mfu(r, model_cfg):4.0f}% MFU  "
              f"step {1e3 * r['step_s']:8.2f} ms  ({FIGURES[name]})")
    print(f"  not modelled: {nki_emulator.NOT_MODELLED}")
    print("  the central figure assumes (its factors: the 'calibrated:' entries of the assumptions below):")
    for line in nki_emulator.CENTRAL_ASSUMPTIONS:
        print(f"  - {line}")
    print("  the pessimistic figure assumes:")
    for line in nki_emulator.PESSIMISTIC_ASSUMPTIONS[:1]:  # (its factors: the central figure's)
        print(f"  - {line}")


# Public measurements on Trn2, each set beside the estimate for its shapes; the estimate is not fitted to them.
# Each ran without NKI kernels (kernels_as_ran); host_idle: the share of the measured step the host left the
# device idle, where measured; eager: every op dispatched from Python (no torch.compile).
REFERENCE_RUNS = (
    dict(name="organiser's baseline (eager), 1 rank", ranks=1, measured_tokens_per_s=800 * 65536 / 1023.7,
         args=["--preset=baseline"], kernels_as_ran="torch", eager=True, host_idle=None,
         source="github poojithdevan4D/trainium-research-context 03-experiment-log.jsonl, first row (unmodified "
                "baseline, LNC=1, 1 rank, eager): 800 steps of 65,536 tokens in 1,023.7 s"),
    dict(name="FrontierForge K59/K82s4 shape (compiled), 8 ranks", ranks=8, measured_tokens_per_s=285_000,
         args=["--preset=baseline", "--n_layer=9", "--n_embd=1024", "--n_head=4", "--n_kv_head=1",
               "--mlp=leaky_relu2", "--total_batch_tokens=262144", "--batch_size=8"],
         kernels_as_ran="torch", eager=False, host_idle=0.19,
         # step seconds at k micro-batches of 65,536 tokens (8 ranks x 8 x 1024), the per-phase means of one run
         micro_batch_step_s={1: 0.296835, 2: 0.510163, 4: 0.934132},
         source="github marker2601/trainium-simulator docs/FINDINGS.md ('about 285k tokens/s on a 124M-parameter "
                "model ... about 19% of the time idle on host dispatch'); research/sim-data/chipC/C40_cold_K59/"
                "train.log: LNC=1 x 8 ranks, 262,144 tokens/step at 277-286k tokens/s; ffsim/gpu/configs/"
                "schedule-K60-TT1793.json, step_seconds_input: that log's mean step at 1, 2 and 4 micro-batches; "
                "recipes/K82s4/train.py: depth 9, head_dim 256, 1 KV head, 8 x 1024 per rank"),
)


def _reference_config(ref, kernels_setting=None):
    cfg, model_cfg = train.parse_args(ref["args"] + ([f"--kernels={kernels_setting}"] if kernels_setting else []))
    model_cfg.vocab_size = 8192
    return cfg, model_cfg


class _OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def eager_ops_per_step(cfg, model_cfg, ranks=1):
    """ATen ops one eager optimizer step of train.py dispatches on one of `ranks` ranks (each a launch an eager
    run's host sends the device), counted on CPU at 32 values a head, a context of 64 and one sequence a
    micro-batch: the count follows the step's graph (depth, heads, micro-batches, optimizers), not its sizes."""
    micro_steps = (cfg.total_batch_tokens or 1) // (cfg.batch_size * model_cfg.sequence_len * ranks) or 1
    small = dataclasses.replace(model_cfg, n_embd=32 * model_cfg.n_head, sequence_len=64, vocab_size=256,
                                mlp_hidden=0, kernels="torch")
    small_cfg = dataclasses.replace(cfg, batch_size=1, total_batch_tokens=64 * micro_steps, compile=False)
    torch.manual_seed(0)
    model = GPT(small)
    optimizers = optim.make_optimizers(model, small_cfg, "cpu", torch.float32)
    batch = [tuple(torch.randint(0, 256, (1, 64)) for _ in range(2)) for _ in range(micro_steps)]
    with _OpCounter() as counter:
        train.train_step(model, model, optimizers, batch, "cpu", contextlib.nullcontext(), small_cfg.grad_clip)
    return counter.ops


def reference_estimates():
    """Each REFERENCE_RUNS entry, its shapes at the contest's 8,192-token vocab, priced as it ran (its kernels
    setting: as_ran) and with the kit's kernels (with_kernels), each {figure: tokens/s}; measured_compute_tokens_per_s
    (the measured rate with the host idle taken out, where measured); at_micro_batches: (k, measured step s, its
    compute, the central as-ran step s) per micro-batch count measured."""
    rows = []
    for ref in REFERENCE_RUNS:
        (cfg, as_ran), (_, kit) = _reference_config(ref, ref["kernels_as_ran"]), _reference_config(ref)
        priced = {key: step_figures(cfg, model_cfg, ref["ranks"])
                  for key, model_cfg in (("as_ran", as_ran), ("with_kernels", kit))}
        compute_share = 1 - (ref["host_idle"] or 0)
        central = priced["as_ran"]["central"]
        micro_tokens = central["step_tokens"] // central["micro_steps"]
        points = [(k, step_s, step_s * compute_share, step_estimate(
            dataclasses.replace(cfg, total_batch_tokens=k * micro_tokens), as_ran, ref["ranks"],
            central["kernel_costs_s"], "central")["step_s"]) for k, step_s in ref.get("micro_batch_step_s", {}).items()]
        if ref["eager"]:
            ref = {**ref, "eager_ops_per_step": eager_ops_per_step(cfg, as_ran, ref["ranks"])}
        rows.append({**{k: v for k, v in ref.items() if k != "args"}, "params": central["params"],
                     "step_tokens": central["step_tokens"],
                     **{key: {f: r["tokens_per_s"] for f, r in figures.items()} for key, figures in priced.items()},
                     "mfu_with_kernels": {f: _mfu(r, kit) for f, r in priced["with_kernels"].items()},
                     "measured_compute_tokens_per_s": ref["measured_tokens_per_s"] / compute_share,
                     "central_over_measured_compute": central["tokens_per_s"] * compute_share
                     / ref["measured_tokens_per_s"], "at_micro_batches": points})
    return rows


def _reference_overheads(r):
    """What the measured run spent outside the priced compute, named: host idle (measured) or eager dispatch."""
    if r["eager"]:
        step_s = r["step_tokens"] / r["measured_tokens_per_s"]
        left_s = step_s - r["step_tokens"] / r["as_ran"]["central"]
        return (f"eager dispatch: {r['eager_ops_per_step']:,} ATen ops a step (train.py's step at these shapes, "
                f"counted on CPU), host work overlapped with the device (asynchronous), not added; the measured step "
                f"leaves {1e3 * left_s:.0f} ms ({100 * left_s / step_s:.0f}%) to it, "
                f"{1e6 * left_s / r['eager_ops_per_step']:.1f} us an op")
    return f"host idle {100 * r['host_idle']:.0f}% of the step (measured), taken out: compute ran at " \
           f"{r['measured_compute_tokens_per_s']:,.0f} tokens/s"


def _line(points):
    """(intercept, slope) of the least-squares line through (x, y) points."""
    fit = statistics.linear_regression(*zip(*points))
    return fit.intercept, fit.slope


def print_references(rows):
    print("\npublic Trn2 runs, priced as they ran (no NKI kernels: --kernels=torch), and the kit with its kernels "
          "at the same shapes (contest vocab 8,192); tokens/s optimistic / central / pessimistic:")
    print("| run (Trn2, LNC=1) | params | measured | as ran | central / measured compute | with the kit's kernels "
          "| MFU (central, kernels) | measured in |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        figures = {key: " / ".join(f"{r[key][f]:,.0f}" for f in FIGURES) for key in ("as_ran", "with_kernels")}
        print(f"| {r['name']} | {r['params'] / 1e6:.1f}M | {r['measured_tokens_per_s']:,.0f} | {figures['as_ran']} | "
              f"{r['central_over_measured_compute']:.2f}x | {figures['with_kernels']} | "
              f"{100 * r['mfu_with_kernels']['central']:.0f}% | {r['source']} |")
    for r in rows:
        print(f"- {r['name']}: {_reference_overheads(r)}")
        for k, step_s, compute_s, priced_s in r["at_micro_batches"]:
            print(f"  {k} micro-batch(es): measured {1e3 * step_s:.1f} ms a step, its compute {1e3 * compute_s:.1f}, "
                  f"priced as it ran (central) {1e3 * priced_s:.1f} ms ({compute_s / priced_s:.2f}x the measured rate)")
        if len(r["at_micro_batches"]) > 1:  # a line through the points: the per-micro-batch and the per-step parts
            (measured_fixed, measured_each), (compute_fixed, compute_each), (priced_fixed, priced_each) = (
                _line([(p[0], p[column]) for p in r["at_micro_batches"]]) for column in (1, 2, 3))
            print(f"  a line through them: per micro-batch {1e3 * measured_each:.1f} ms measured, its compute "
                  f"{1e3 * compute_each:.1f}, priced {1e3 * priced_each:.1f} ({compute_each / priced_each:.2f}x); per "
                  f"step besides, {1e3 * measured_fixed:.1f} ms measured, its compute {1e3 * compute_fixed:.1f}, priced "
                  f"{1e3 * priced_fixed:.1f} (the optimizer, the exchange)")
    print("\nassumptions of the estimate:")
    for line in STEP_ASSUMPTIONS + nki_emulator.ASSUMPTIONS:
        print(f"- {line}")


# -----------------------------------------------------------------------------
# shape sweep

SWEEPS = {  # one choice varied at a time around the base config; multiples of 128 and not
    "default": {"n_embd": [192, 256, 320, 384, 512], "head_dim": [32, 64, 128], "n_kv_head": [1, 2, 4],
                "mlp_hidden": [640, 768, 1024, 1536], "sequence_len": [128, 192, 256, 512]},
    "tiny": {"n_embd": [64, 128], "head_dim": [32, 64], "sequence_len": [64, 128]},
}


def sweep_configs(model_cfg, grid):
    """(axis, value, config) for each point: head_dim changes n_head (n_kv_head follows when it must)."""
    for axis, values in SWEEPS[grid].items():
        for value in values:
            cfg = dataclasses.replace(model_cfg)
            if axis == "head_dim":
                cfg.n_head = cfg.n_embd // value
                cfg.n_kv_head = cfg.n_head if cfg.n_head % cfg.n_kv_head else cfg.n_kv_head
            elif axis == "n_kv_head":
                cfg.n_kv_head = value
            else:
                setattr(cfg, axis, value)
            try:
                cfg.validate()
            except ValueError as e:
                print(f"sweep: skipping {axis}={value}: {e}")
                continue
            yield axis, value, cfg


def run_sweep(cfg, model_cfg, args, device_type, device, ranks=1):
    """Each sweep point measured here; off Trainium also estimated on Trn2 (step_estimate, `ranks` LNC=1
    ranks). The points are ranked by tokens/s: measured on Trainium, estimated for Trn2 elsewhere."""
    estimated = device_type != "neuron"
    rows = []
    for axis, value, point in sweep_configs(model_cfg, args.sweep_grid):
        r = measure_training(cfg, point, args.bench_steps, args.bench_windows, args.bench_warmup, device_type, device)
        rows.append({"axis": axis, "value": value, "n_embd": point.n_embd, "n_head": point.n_head,
                     "n_kv_head": point.n_kv_head, "head_dim": point.head_dim, "mlp_hidden": point.hidden_dim,
                     "sequence_len": point.sequence_len, "tokens_per_s": r["tokens_per_s"],
                     "flops_per_token": r["flops_per_token"], "mfu": r["mfu"]})
        line = f"{axis:>12} = {value:<6} {r['tokens_per_s']:>12,.0f} tok/s   MFU {100 * r['mfu']:5.1f}%"
        if estimated:
            rows[-1]["trn2_estimate_tokens_per_s"] = step_estimate(cfg, point, ranks)["tokens_per_s"]
            line += f"   Trn2 ESTIMATE {rows[-1]['trn2_estimate_tokens_per_s']:>10,.0f} tok/s"
        print(line)
    key = "trn2_estimate_tokens_per_s" if estimated else "tokens_per_s"
    for place, row in enumerate(sorted(rows, key=lambda row: -row[key]), 1):
        row["rank"] = place
    print(f"ranked by {'estimated Trn2' if estimated else 'measured'} tokens/s: "
          + ", ".join(f"{row['axis']}={row['value']}" for row in sorted(rows, key=lambda row: row["rank"])))
    return rows


# -----------------------------------------------------------------------------

def _parser():
    """bench.py's command line: its own flags and those of the kit/ programs it runs (device_check, first_hour,
    ablation); main passes what it leaves (train.py's fields) to train.parse_args."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Any train.py field is accepted, as --field=value or --field value.")
    parser.add_argument("--bench_steps", type=int, default=10, help="optimizer steps per timed window")
    parser.add_argument("--bench_windows", type=int, default=3, help="timed windows (median reported)")
    parser.add_argument("--bench_warmup", type=int, default=3, help="untimed steps first (compilation)")
    parser.add_argument("--kernels", nargs="?", const=True, default=False, help="alone: each kernel against its "
                        "compiled PyTorch fallback at the run's shapes, and the --kernels=... choice that implies; "
                        "with a value (--kernels=auto, torch, nki or per op, attention:nki,mlp:torch): the model's "
                        "kernels setting, as train.py takes it")
    parser.add_argument("--sweep", action="store_true", help="measure MFU over a grid of shape choices (off "
                        "Trainium also ranked by estimated Trn2 tokens/s)")
    parser.add_argument("--step_estimate", action="store_true", help="estimate one training step on Trn2 from the "
                        "emulator's cost model, and the public Trn2 measurements beside their estimates")
    parser.add_argument("--memory", action="store_true", help="per-rank memory plan (arithmetic only; --vocab_size "
                        "is the vocabulary, no tokenizer is loaded) against Trn2 and this machine's device")
    parser.add_argument("--world_size", type=int, default=int(os.environ.get("WORLD_SIZE", "1")), help="ranks --memory plans for")
    parser.add_argument("--ranks", type=int, default=0, help="LNC=1 ranks the Trn2 estimates assume; 0 = this job's")
    parser.add_argument("--sweep_grid", default="default", choices=list(SWEEPS))
    parser.add_argument("--sweep_out", default="sweep", help="prefix of the sweep's .csv/.json/.png")
    parser.add_argument("--versus_nanogpt", metavar="DIR", help="tokens/s against karpathy/nanoGPT's model.py in "
                        "DIR (a checkout of yours) at the same shapes, steps interleaved in one process")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--timeline", metavar="DIR", help="with --kernels off Trainium: each emulated kernel call's "
                        "schedule as a trace-event .json (open in ui.perfetto.dev) and a .png in DIR")
    for program in (device_check, first_hour, ablation):  # the programs in kit/ that bench.py runs
        program.add_flags(parser)
    return parser


def _run_mode(args, cfg, model_cfg, rank, ranks, device_type, device):
    """The measurement the flags ask for (--step_estimate, --sweep, --first_hour_step, --check, --versus_nanogpt,
    --kernels, else training throughput), printed on rank 0; returns its results dict, as main returns it."""
    if args.step_estimate:
        figures = step_figures(cfg, model_cfg, ranks)
        results = {"step_estimate": figures["optimistic"], "central": figures["central"],
                   "pessimistic": figures["pessimistic"], "references": reference_estimates()}
        if rank == 0:
            print_step_estimate(results["step_estimate"], model_cfg)
            print_step_range(figures, model_cfg)
            print_references(results["references"])
    elif args.sweep:
        results = {"sweep": run_sweep(cfg, model_cfg, args, device_type, device, ranks)}
        if rank == 0:
            sweep_files.write_sweep(results["sweep"], args.sweep_out, sweep_files.sweep_title(cfg, model_cfg, device_type))
    elif args.first_hour_step:
        results = {"check": [{"passed": first_hour.run_one(args.first_hour_step, args.first_hour_checkpoint, cfg,
                                                           model_cfg, device_type, device)}]}
    elif args.check:
        results = {"check": device_check.run_checks(cfg, model_cfg, device_type, device, train.train_step)}
        if rank == 0:
            device_check.print_checks(results["check"], device_type)
    elif args.versus_nanogpt:
        results = {"versus_nanogpt": measure_versus_nanogpt(cfg, model_cfg, args.versus_nanogpt, args.bench_steps,
                                                            args.bench_windows, args.bench_warmup, device_type, device)}
        print_versus(results["versus_nanogpt"], model_cfg, cfg.batch_size)
    elif args.kernels:
        results = {"kernels": measure_kernels(cfg, model_cfg, device_type, device, timeline=args.timeline)}
        if rank == 0:
            print_kernels(results["kernels"], device_type == "neuron")
    else:
        results = measure_training(cfg, model_cfg, args.bench_steps, args.bench_windows, args.bench_warmup, device_type, device)
        if rank == 0:
            print_training(results, args.bench_steps, args.bench_windows)
    return results


def main(argv):
    args, rest = _parser().parse_known_args(argv)
    if isinstance(args.kernels, str):  # --kernels=VALUE is the model's setting, not the measurement
        rest, args.kernels = rest + [f"--kernels={args.kernels}"], False
    if args.first_hour:  # before any device work: the steps do it, each in its own process
        cfg = train.parse_args(rest)[0]  # the paid run's budget and start-up cap
        rows, paid_run, reasons, seconds, startups = first_hour.run_first_hour(rest, cfg.time_budget_s, cfg.startup_cap_s)
        first_hour.print_table(rows, paid_run, reasons, seconds, startups)
        return {"first_hour": rows, "first_paid_run": paid_run}
    if args.ablation:  # any other --field=value (e.g. --data_dir) goes to every run
        return ablation.run_ablation(args.ablation_seeds, args.ablation_steps, train.main, rest)
    cfg, model_cfg = train.parse_args(rest)
    if args.check:
        device_check.draw_seed(cfg, rest)
    flags.validate_config(cfg, model_cfg)
    if args.memory:
        return memory.print_plan(cfg, model_cfg, args.world_size)
    model_cfg.vocab_size = data.get_tokenizer(cfg.tokenizer, cfg.dataset, cfg.data_dir).n_vocab
    model_cfg.validate()
    rank, world_size, device, device_type, control = runtime.start_ranks(runtime.device_type(cfg.device))
    dtype_reason = runtime.choose_dtype(cfg, device_type, control)
    if rank == 0:
        print(f"computing in {cfg.dtype} because {dtype_reason}")
    ranks = args.ranks or world_size
    results = _run_mode(args, cfg, model_cfg, rank, ranks, device_type, device)
    fallbacks = runtime.cpu_fallbacks(device_type)  # on neuron: which ops TorchNeuron ran on the CPU
    if fallbacks and rank == 0:
        print(fallbacks)
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.json}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return results


if __name__ == "__main__":
    try:
        results = main(sys.argv[1:])
    except (ValueError, OSError, data.DataError) as e:  # as train.py: the foreseeable in one line
        sys.exit(f"error: {e}")
    sys.exit(1 if any(not row["passed"] for row in [*results.get("check", ()), *results.get("first_hour", ())]) else 0)

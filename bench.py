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
are STEP_ASSUMPTIONS (there too). Both print a range: the optimistic figure above (overlap bound) and a central one, each
kernel call scheduled (nki_emulator/_schedule.py: in-order engines, the tiles' dependencies, DMA fixed cost) with
the factors and launch cost calibrated against public hardware timings (nki_emulator/calibrate.py). Estimates, not
measurements: host dispatch and the compiler's own scheduling are left out.
"""
import argparse
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

# The CPU emulator of NKI (nki_emulator/, beside this file), with the cost model behind every Trn2 estimate here.
import nki_emulator  # noqa: E402

if {"--kernels", "--check", "--sweep", "--step_estimate", "--first_hour_step"} & set(sys.argv[1:]):
    # Off Trainium these run (and count) the NKI kernels under the emulator, which has to stand in for `nki`
    # before kernels.py imports it. (Where the Neuron SDK is installed it is used.)
    nki_emulator.install()

import data  # noqa: E402
import kernels  # noqa: E402
import train  # noqa: E402
from kit import ablation, device_check, first_hour, flags, memory, optim, runtime, sweep_files  # noqa: E402
from kit.compiled_cost import (ADAMW_PASSES, ENGINES, MUON_PASSES, STEP_ASSUMPTIONS,  # noqa: E402
                               compiled_estimate, compiled_ops, gemm, linear, op_seconds, passes, pricing)
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
    model = train.wrap_for_training(raw_model, cfg, device_type, device, [t.to(device) for t in batch[0]])
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
    model = train.wrap_for_training(raw_model, cfg, device_type, device, (x.to(device), y.to(device)))
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


def measure_kernels(cfg, model_cfg, device_type, device, ops=kernels.KERNEL_OPS, timeline=None):
    """Each kernel op forward and forward + backward at the run's shapes (--batch_size sequences). On Trainium:
    the NKI kernel and the compiled PyTorch fallback both timed (torch.compile, fullgraph). Elsewhere: the
    PyTorch path timed here, and both priced for one Trn2 NeuronCore, the kernel by its emulated trace
    (kernel_estimate; where the kernel refuses the shapes, `nki_unavailable` says why) and the fallback as
    compiled plain ops ("compiled"). Every row carries `engines` and `bottleneck`: the kernel's, or the
    fallback's where the kernel cannot run (`priced` says which). `choice` is the faster of the two, "nki" or "torch"; `auto`, what
    kernels=auto runs on a Trn2 there. `ops`: the kernel ops to measure. `timeline`: a folder for each emulated
    call's schedule (nki_emulator/timeline.py: a trace-event .json for Perfetto and a .png)."""
    dtype = runtime.compute_dtype(cfg)
    peak = runtime.peak_flops(device_type, dtype, cfg.peak_tflops)
    on_trainium = device_type == "neuron"
    rows = []
    cases = kernels.model_cases(model_cfg, cfg.batch_size, device, dtype)
    for name, fwd_flops, train_flops, make_inputs, call in cases:
        if name.split()[0] not in ops:
            continue
        for direction, flops in (("forward", fwd_flops), ("fwd+bwd", train_flops)):
            backward = direction == "fwd+bwd"
            row = {"kernel": name, "op": name.split()[0], "direction": direction, "flops": flops}
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
                # estimated for Trn2 as training runs there: bf16 inputs, whatever this CPU computes in
                row["compiled"] = _compiled_fallback(model_cfg, row["op"], cfg.batch_size, backward)
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
            row["auto"] = auto_choice(row, model_cfg, cfg.batch_size * model_cfg.sequence_len)
            rows.append(row)
    return rows


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

def kernel_step_costs(model_cfg, tokens_per_call, central=False):
    """Seconds of one call of each NKI kernel, forward + backward, for one sequence (estimate_s; central: its
    calibrated schedule plus its launches' cost shared by the call's sequences), or None where
    the kernel does not run on Trn2: its kernels mode is torch, it refuses the shapes, or (kernels=auto) the
    cost rule declines it at `tokens_per_call` (KernelOp.cost_problem). The kernel part of step_estimate."""
    if kernels.nki is not nki_emulator:
        raise ValueError("the Trn2 estimates run the kernels under the NKI emulator, which stands in for nki only "
                         "where the Neuron SDK is not installed; run them on a machine without it")
    modes, costs = kernels.parse_kernels(model_cfg.kernels), {}
    for name, _, _, make_inputs, call in kernels.model_cases(model_cfg, 1, "cpu", torch.bfloat16):
        name = name.split()[0]
        op = "rms_norm" if name == "rms_norm_fp32" else name  # the stream's norms are rms_norm's op
        mode = modes[op]
        if mode == "torch" or (mode == "auto" and _cost_declines(op, model_cfg, tokens_per_call)):
            costs[name] = None
            continue
        inputs = [t.detach().to(torch.bfloat16).requires_grad_() if t is not None else None for t in make_inputs()]

        def seconds(run):  # one sequence's forward + backward: the overlap bound, or (central) the schedule
            counts = emulate(run, inputs, backward=True)
            if not central:
                return kernel_estimate(counts)["estimate_s"]
            c = nki_emulator.central_estimate(counts.trace, "trn2")
            per_sequence = model_cfg.sequence_len / tokens_per_call  # a call's launches shared by its sequences
            return c["scheduled_s"] + c["launches"] * nki_emulator.LAUNCH_S * per_sequence

        try:
            if name == "attention":  # each layer at its window (a window skips key blocks): the layers' mean
                windows = model_cfg.attention_windows()
                at = {w: seconds(lambda *a: call(*a, "nki", window=w)) for w in set(windows)}
                costs[name] = statistics.fmean(at[w] for w in windows)
            else:
                costs[name] = seconds(lambda *a: call(*a, "nki"))
        except (RuntimeError, ValueError):  # a shape the kernel cannot take: compiled plain ops instead
            costs[name] = None
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


def step_estimate(cfg, model_cfg, ranks=1, kernel_costs=None, central=False):
    """One optimizer step of train.py on `ranks` LNC=1 Trn2 NeuronCores, estimated (STEP_ASSUMPTIONS):
    {component: seconds per step}, step_s, tokens_per_s (the job's), params. `central`: the central figure
    (CENTRAL_ASSUMPTIONS) instead of the optimistic one."""
    if central:
        pricing.append(nki_emulator.calibrated_seconds)
        try:
            return step_estimate(cfg, model_cfg, ranks, kernel_costs or kernel_step_costs(
                model_cfg, cfg.batch_size * model_cfg.sequence_len, central=True))
        finally:
            pricing.pop()
    c = model_cfg
    kernel_costs = kernel_step_costs(c, cfg.batch_size * c.sequence_len) if kernel_costs is None else kernel_costs
    with torch.device("meta"):  # shapes only
        model = GPT(dataclasses.replace(c))
    shapes = [tuple(p.shape) for p in model.parameters()]
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
    params = sum(math.prod(s) for s in shapes)
    seconds["embedding lookup"] = micro_steps * 2 * op_seconds(passes(N * c.n_embd, one_input=1))
    muon = {id(p) for p in optim.split_parameters(model)[2]} if cfg.matrix_optimizer == "muon" else set()
    # each rank's pieces (optim.shard_layout): the shapes of its Muon matrices, and its AdamW elements
    sharded = memory.shards_optimizer(cfg, ranks)
    layout = optim.shard_layout(shapes, optim.whole_tensors(model, cfg), ranks if sharded else 1)
    shares = [([], 0) for _ in range(ranks if sharded else 1)]
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
    seconds["optimizer"] = max(optimizer_s)
    seconds["optimizer"] += op_seconds(passes(params, one_input=2 if cfg.grad_clip else 0, two_input=micro_steps - 1))
    exchanged = ranks * max(optim.shard_loads(layout, ranks)) if sharded else params
    seconds["gradient exchange"] = 2 * (ranks - 1) / ranks * 4 * exchanged / (TRN2.dma_queues * TRN2.dma_bytes_per_s)
    step_s = sum(seconds.values())
    return {"components": seconds, "step_s": step_s, "tokens_per_s": step_tokens / step_s, "ranks": ranks,
            "step_tokens": step_tokens, "micro_steps": micro_steps, "params": params,
            "kernel_costs_s": kernel_costs}


def print_step_estimate(r, model_cfg):
    c = model_cfg
    print(f"ESTIMATE of one training step on {r['ranks']} Trn2 NeuronCore(s) at LNC=1: {c.n_layer} layers, width "
          f"{c.n_embd}, {c.n_head}/{c.n_kv_head} heads of {c.head_dim}, seq {c.sequence_len}, vocab {c.padded_vocab_size}, "
          f"{r['params'] / 1e6:.1f}M params, {r['step_tokens']:,} tokens/step in {r['micro_steps']} micro-step(s)")
    for name, seconds in sorted(r["components"].items(), key=lambda kv: -kv[1]):
        print(f"  {name:<30} {1e3 * seconds:9.2f} ms  {100 * seconds / r['step_s']:5.1f}%")
    print(f"  {'step':<30} {1e3 * r['step_s']:9.2f} ms  -> {r['tokens_per_s']:,.0f} tokens/s")


def print_step_range(optimistic, central, model_cfg):
    """The optimistic and the central figure, with what the central one assumes and what neither models."""
    with torch.device("meta"):
        flops = GPT(dataclasses.replace(model_cfg)).flops_per_token()
    peak = optimistic["ranks"] * runtime.PEAK_FLOPS["trn2"]
    print("\nthe Trn2 step as a range (one number misleads; docs/results.md, calibration):")
    for name, r, how in (("optimistic", optimistic, "every kernel at its busiest engine, no launch cost"),
                         ("central", central, "kernels scheduled, calibrated factors, launch cost")):
        print(f"  {name:<10} {r['tokens_per_s']:>10,.0f} tokens/s  {100 * r['tokens_per_s'] * flops / peak:4.0f}% MFU  "
              f"step {1e3 * r['step_s']:8.2f} ms  ({how})")
    print(f"  not modelled: {nki_emulator.NOT_MODELLED}")
    print("  the central figure assumes (its factors: the 'calibrated:' entries of the assumptions below):")
    for line in nki_emulator.CENTRAL_ASSUMPTIONS:
        print(f"  - {line}")


# Public measurements on Trn2, each set beside the estimate for its shapes; the estimate is not fitted to them.
REFERENCE_RUNS = (
    dict(name="organiser's baseline (eager), 1 rank", ranks=1, measured_tokens_per_s=800 * 65536 / 1023.7,
         args=["--preset=baseline"],
         source="github poojithdevan4D/trainium-research-context 03-experiment-log.jsonl, first row (unmodified "
                "baseline, LNC=1, 1 rank, eager): 800 steps of 65,536 tokens in 1,023.7 s"),
    dict(name="FrontierForge K59/K82s4 shape (compiled), 8 ranks", ranks=8, measured_tokens_per_s=285_000,
         args=["--preset=baseline", "--n_layer=9", "--n_embd=1024", "--n_head=4", "--n_kv_head=1",
               "--mlp=leaky_relu2", "--total_batch_tokens=262144", "--batch_size=8"],
         source="github marker2601/trainium-simulator docs/FINDINGS.md ('about 285k tokens/s on a 124M-parameter "
                "model'); research/sim-data/chipC/C40_cold_K59/train.log: LNC=1 x 8 ranks, 262,144 tokens/step at "
                "277-286k tokens/s; recipes/K82s4/train.py: depth 9, head_dim 256, 1 KV head, 8 x 1024 per rank"),
)


def reference_estimates():
    """Each REFERENCE_RUNS entry with its estimate (tokens/s), its shapes at the contest's 8,192-token vocab."""
    rows = []
    for ref in REFERENCE_RUNS:
        cfg, model_cfg = train.parse_args(ref["args"])
        model_cfg.vocab_size = 8192
        r = step_estimate(cfg, model_cfg, ref["ranks"])
        rows.append({**{k: v for k, v in ref.items() if k != "args"}, "estimate_tokens_per_s": r["tokens_per_s"],
                     "estimate_step_s": r["step_s"], "params": r["params"],
                     "estimate_over_measured": r["tokens_per_s"] / ref["measured_tokens_per_s"]})
    return rows


def print_references(rows):
    print("\n| run (Trn2, LNC=1) | params | tokens/s: estimate / measured | ratio | measured in |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['params'] / 1e6:.1f}M | {r['estimate_tokens_per_s']:,.0f} / "
              f"{r['measured_tokens_per_s']:,.0f} | {r['estimate_over_measured']:.2f}x | {r['source']} |")
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

def main(argv):
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
    args, rest = parser.parse_known_args(argv)
    if isinstance(args.kernels, str):  # --kernels=VALUE is the model's setting, not the measurement
        rest, args.kernels = rest + [f"--kernels={args.kernels}"], False
    if args.first_hour:  # before any device work: the steps do it, each in its own process
        rows, paid_run, reasons, seconds = first_hour.run_first_hour(rest)
        first_hour.print_table(rows, paid_run, reasons, seconds)
        return {"first_hour": rows, "first_paid_run": paid_run}
    if args.ablation:  # any other --field=value (e.g. --data_dir) goes to every run
        return ablation.run_ablation(args.ablation_seeds, args.ablation_steps, rest)
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
    if args.step_estimate:
        results = {"step_estimate": step_estimate(cfg, model_cfg, ranks), "references": reference_estimates(),
                   "central": step_estimate(cfg, model_cfg, ranks, central=True)}
        if rank == 0:
            print_step_estimate(results["step_estimate"], model_cfg)
            print_step_range(results["step_estimate"], results["central"], model_cfg)
            print_references(results["references"])
    elif args.sweep:
        results = {"sweep": run_sweep(cfg, model_cfg, args, device_type, device, ranks)}
        if rank == 0:
            sweep_files.write_sweep(results["sweep"], args.sweep_out, sweep_files.sweep_title(cfg, model_cfg, device_type))
    elif args.first_hour_step:
        results = {"check": [{"passed": first_hour.run_one(args.first_hour_step, args.first_hour_checkpoint, cfg,
                                                           model_cfg, device_type, device)}]}
    elif args.check:
        results = {"check": device_check.run_checks(cfg, model_cfg, device_type, device)}
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

"""
Throughput, MFU and kernel efficiency, measured on the device at hand.

    python bench.py                                   # train.py's default model: tokens/s and MFU
    python bench.py --n_layer=8 --n_embd=512 --json=bench.json
    torchrun --standalone --nproc_per_node=4 bench.py # per rank and for the whole job
    python bench.py --first_hour --preset=baseline    # the whole first Trainium session, step by step, one table
    python bench.py --check                           # NKI against PyTorch on this device: is everything right?
    python bench.py --kernels                         # each kernel against its PyTorch fallback (+ Trn2 estimate)
    python bench.py --step_estimate --preset=baseline # a whole Trn2 training step, estimated from the cost model
    python bench.py --memory --preset=phase2 --world_size=64  # per-rank memory plan, before anything expensive
    python bench.py --versus_nanogpt=../nanoGPT       # tokens/s against nanoGPT's model at the same shapes
    python bench.py --sweep --sweep_out=sweep         # shape choices -> sweep.csv, sweep.json, sweep.png
    OMP_NUM_THREADS=1 python bench.py --ablation      # val_bpb: baseline, frontier, each lever alone (CPU)

Every train.py field is accepted as --field=value (so --preset=baseline works too).

Training throughput runs train.py's own optimizer step (same compile, autocast and optimizers) on random
tokens, leaves out --bench_warmup steps (compilation), synchronises the device before every timer read
and reports the median and spread of --bench_windows timed windows.

MFU = model FLOPs per token x tokens/s / peak FLOP/s of the ranks used. Model FLOPs per token is
GPT.flops_per_token(): 6 x matmul parameters + 12 x n_layer x n_head x head_dim x sequence_len (PaLM
appendix B; attention at full, non-causal length). Peaks: dense bf16 datasheet numbers per rank
(runtime.PEAK_FLOPS; a Trn2 rank at NEURON_LOGICAL_NC_CONFIG=2 is two physical cores), a measured matmul
on CPU, or --peak_tflops.

Estimates for Trn2 without a Trn2 (--kernels, --step_estimate, --sweep off Trainium): the NKI kernels run
under the CPU emulator, which records every instruction with its engine, tile shape, dtypes and buffers;
its cost model (nki_emulator/_cost.py, each formula with its AWS source) prices each instruction on
its engine: TensorE (nc_matmul max(min(64, M), N) cycles, 4x for fp32), VectorE and ScalarE (about N
cycles per input tile, at least 64), GpSimd and the 16 DMA queues. A kernel call then has a busy time per
engine, a bottleneck, an overlap bound (the busiest engine: estimate_s) and a serial bound (the sum:
serial_s). A whole training step adds what the compiler generates around the kernels (projection and head
matmuls, elementwise ops, the optimizer, the gradients' exchange), priced with the same table; its
assumptions are STEP_ASSUMPTIONS. `--step_estimate` prints it, with the two public Trn2 measurements
beside their estimates. Both print a range: the optimistic figure above (overlap bound) and a central one, each
kernel call scheduled (nki_emulator/_schedule.py: in-order engines, the tiles' dependencies, DMA fixed cost) with
the factors and launch cost calibrated against public hardware timings (nki_emulator/calibrate.py). Estimates, not
measurements: host dispatch and the compiler's own scheduling are left out.
"""
import argparse
import contextlib
import csv
import dataclasses
import functools
import importlib.util
import json
import math
import os
import random
import statistics
import sys
import time
import traceback
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
from kit import contest, flags, memory, optim, runtime  # noqa: E402
from model import GPT, rotary_tables

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
        **nki_emulator.schedule_figures(counts.trace, "trn2"),  # scheduled_s, central_s (calibrated + launches)
        "tensore_utilisation": counts.matmul_flops / (tensor_s * PE_FLOPS_PER_CYCLE * TRN2.tensor_hz) if tensor_s else 0.0,
        "matmuls": len(counts.matmul_shapes),
        "transposes": len(counts.transposes),
        "instructions": dict(counts.instructions),
        "dma_bytes": counts.dma_bytes,
        "matmul_flops": counts.matmul_flops,
    }


def kernel_cases(model_cfg, batch_size, device, dtype):
    """(name, useful FLOPs of forward, FLOPs of forward+backward, make_inputs, call) at the model's shapes.
    Attention counts its causal half; RMSNorm has no matmul FLOPs (it is memory-bound)."""
    B, T, C, H, Hkv, D = batch_size, model_cfg.sequence_len, model_cfg.n_embd, model_cfg.n_head, model_cfg.n_kv_head, model_cfg.head_dim
    N, hidden = B * T, model_cfg.hidden_dim
    n_up = 2 if model_cfg.mlp == "swiglu" else 1

    def tensor(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype).requires_grad_()

    attention_flops = 2 * B * H * T * T * D  # q k^T and p v over the causal half: 2 x (2 B H T^2 D) / 2
    mlp_flops = 2 * N * C * hidden * (n_up + 1)
    tables = [t.to(device) for t in rotary_tables(T, D, model_cfg.rope_base)]
    return [
        ("attention", attention_flops, 3.5 * attention_flops,  # backward recomputes P: 5 matmuls to forward's 2
         lambda: (tensor(B, H, T, D), tensor(B, Hkv, T, D), tensor(B, Hkv, T, D)),
         lambda q, k, v, mode, window=None: kernels.attention(q, k, v, mode=mode, window=window)),
        (f"mlp ({model_cfg.mlp})", mlp_flops, 3 * mlp_flops,
         lambda: (tensor(B, T, C), tensor(hidden, C, scale=C ** -0.5), tensor(C, hidden, scale=hidden ** -0.5),
                  tensor(hidden, C, scale=C ** -0.5) if n_up == 2 else None),
         lambda x, w_up, w_down, w_gate, mode: kernels.mlp(x, w_up, w_down, model_cfg.mlp, w_gate, mode=mode)),
        ("rms_norm", 0, 0, lambda: (tensor(B, T, C),), lambda x, mode: kernels.rms_norm(x, mode=mode)),
        # the residual stream is fp32 under autocast, and so are the norms on it; a branch (a matmul's output)
        # is in the matmul dtype. add_rms_norm's two outputs are summed so that both get a gradient.
        ("rms_norm_fp32", 0, 0, lambda: (tensor(B, T, C),), lambda x, mode: kernels.rms_norm(x.float(), mode=mode)),
        ("add_rms_norm", 0, 0, lambda: (tensor(B, T, C), tensor(B, T, C)),
         lambda x, branch, mode: sum(o.float() for o in kernels.add_rms_norm(x.float(), branch, mode=mode))),
        ("softcap_cross_entropy", 0, 0, lambda: (tensor(B, T, model_cfg.padded_vocab_size, scale=8.0),),
         lambda logits, mode: kernels.softcap_cross_entropy(
             logits, torch.arange(B * T, device=logits.device).view(B, T) % model_cfg.vocab_size,
             model_cfg.logit_softcap, model_cfg.vocab_size, "none", mode=mode)),
        # q and k of one attention layer, as one op: the step prices them together
        ("rope_norm", 0, 0, lambda: (tensor(B, T, H * D), tensor(B, T, Hkv * D)),
         lambda q, k, mode: torch.cat((kernels.rope_norm(q, *tables, H, mode=mode).flatten(),
                                       kernels.rope_norm(k, *tables, Hkv, mode=mode).flatten()))),
    ]


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
    for name, fwd_flops, train_flops, make_inputs, call in kernel_cases(model_cfg, cfg.batch_size, device, dtype):
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
                        nki_emulator.timeline.write(counts.trace, nki_emulator.schedule(counts.trace, "trn2"), timeline,
                                                    f"{row['op']}_{direction.replace('+', '_')}", f"{name} {direction}")
                    row["choice"] = "nki" if row["estimate_s"] < row["compiled"]["estimate_s"] else "torch"
            row["auto"] = auto_choice(row, model_cfg, cfg.batch_size * model_cfg.sequence_len)
            rows.append(row)
    return rows


def auto_choice(row, model_cfg, tokens):
    """What kernels=auto runs on a Trn2 at the row's shapes: the kernel where it takes them, unless its cost
    rule (kernels._mlp_cost_problem, the only op that has one) declines them."""
    gated = model_cfg.mlp == "swiglu"
    declined = row["op"] == "mlp" and kernels._mlp_cost_problem(tokens, model_cfg.n_embd, gated) is not None
    return "torch" if "nki_unavailable" in row or declined else "nki"


def kernels_choice(rows):
    """The --kernels=... value the rows imply: per op, the faster path forward + backward, as training runs."""
    return ",".join(f"{r['op']}:{r['choice']}" for r in rows if r["direction"] == "fwd+bwd")


ENGINE_LETTERS = {"tensor": "T", "vector": "V", "scalar": "S", "gpsimd": "G", "dma": "D"}


def print_kernels(rows, on_trainium):
    if not on_trainium:
        print("NKI on one Trn2 NeuronCore, ESTIMATED from the emulator's instructions (nki_emulator/_cost.py), and "
              "the compiled PyTorch fallback priced as plain ops (compiled_ops): us busy per engine (T TensorE, V "
              "VectorE, S ScalarE, G GpSimd, D DMA), the bottleneck, the overlap bound (est: busiest engine, the "
              "optimistic figure), the schedule (sched: engines in order, dependencies, DMA fixed cost), the central "
              "figure (central: the schedule with the calibrated factors and launch cost, nki_emulator._cost."
              "CALIBRATED) and the serial bound (sum); 'torch ms' is this machine's PyTorch path. Not modelled: host "
              "dispatch idle, the compiler's own scheduling")
    print(f"{'kernel':<16} {'pass':<8} {'torch ms':>9} {'TFLOP/s':>8} {'of peak':>8}   "
          + ("NKI ms  TFLOP/s  of peak  faster" if on_trainium else
             f"{'est us':>7} {'sched':>7} {'central':>7} {'serial':>7}  {'bound':<7}"
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
            line += (f"{1e6 * r['estimate_s']:>7.1f} {1e6 * r['scheduled_s']:>7.1f} {1e6 * r['central_s']:>7.1f} "
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

STEP_ASSUMPTIONS = (  # every assumption of step_estimate, in one place (--step_estimate prints them)
    "ranks are LNC=1 NeuronCores of Trn2, priced with the emulator's cost model (nki_emulator/_cost.py)",
    "NKI kernels (attention, MLP, RMSNorm, the residual add fused with RMSNorm, the head's softcap "
    "cross-entropy, RoPE fused with QK-norm; forward + backward) cost their "
    "emulated trace for one sequence at the overlap bound (busiest engine), times the sequences of a step; "
    "without the RoPE + QK-norm kernel, RMSNorm on q and k costs the same per element as on the model's rows, in "
    "bf16, after the rotary's elementwise passes; on the residual "
    "stream and the embedding, which stay fp32 under autocast, the norm and the fused residual add + norm are "
    "priced on fp32 rows (a branch added to the stream is bf16)",
    "an op without its kernel (kernels=torch, or shapes the kernel refuses, e.g. head_dim > 256) is compiled as "
    "plain ops: its matmuls, plus elementwise passes (attention: the full T x T scores in fp32, mask, max, exp, "
    "normalise, cast forward, 2 passes backward)",
    "matmuls outside the kernels (q/k/v/o projections, lm_head, Muon's) tile into 128 x 128 x 512 bf16 nc_matmuls "
    "at the ISA cost; the backward is the two matmuls for dX and dW; each PSUM tile is evicted once, by VectorE and "
    "ScalarE in turn; the operands and the result cross HBM once",
    "elementwise ops outside the kernels run as one 128-partition instruction each at the cost model's "
    "VectorE/ScalarE rates, and each reads its inputs from HBM and writes its result to HBM (no fusion across "
    "ops); without its kernel the head's softcap and cross-entropy are 5 fp32 passes over the logits forward "
    "and 5 backward",
    "within an op the engines overlap (its time is its busiest engine); ops run one after another",
    "Muon (optim.muon_update): 5 Polar Express iterations of 3 bf16 matmuls, 15 one-input and 6 two-input fp32 "
    "passes per matrix element; AdamW: 3 one-input and 5 two-input fp32 passes per parameter; gradient clipping "
    "2 passes; accumulation 1 two-input pass per micro-step after the first. Sharded (optim.Sharding, the default "
    "with more than one rank), the optimizer work of the busiest rank's share (optim.shard_layout); else all of it",
    "the gradients' exchange through one core's DMA queues as ring collectives: sharded, a reduce-scatter and an "
    "all-gather of the padded buffer, 2 (R - 1) / R x 4 bytes x R x the longest share; DDP, one all-reduce, "
    "2 (R - 1) / R x 4 bytes x parameters",
    "left out: host dispatch and eager per-op launch (where measured runs lose most), compilation, data "
    "loading, dependencies between ops' engines, compiler fusion and spills, the levers' extra work (value "
    "embeddings, multi-token prediction, EMA, batch warm-up)",
)
MUON_PASSES = (15, 6)  # one-input, two-input fp32 passes per element: counted in optim.muon_update
ADAMW_PASSES = (3, 5)  # lerp of m, v; sqrt, divide, step (torch's AdamW)
HEAD_PASSES = {"forward": ((3, 0), 2), "backward": ((3, 1), 1)}  # ((VectorE 1-, 2-input), ScalarE) over the logits


def _instruction(engine, name, elements, inputs, dtype, ops=("add",)):
    """`elements` values through one instruction on 128 partitions (the compiler's ideal tiling)."""
    return nki_emulator.Instruction(name, engine, 128, math.ceil(elements / 128), (dtype,) * (1 + inputs),
                                    ("sbuf",) * (1 + inputs), ops)


def _hbm(elements, dtype):
    """`elements` values moved between HBM and SBUF in 128-partition rows."""
    return nki_emulator.Instruction("dma_copy", "dma", 128, math.ceil(elements / 128), (dtype, dtype),
                                    ("sbuf", "shared_hbm"))


def _passes(elements, one_input=0, two_input=0, scalar=0, dtype="float32"):
    """Elementwise passes over `elements` values, each reading its inputs from HBM and writing to HBM."""
    op = [(one_input, _instruction("vector", "tensor_scalar", elements, 1, dtype, ("multiply",))),
          (two_input, _instruction("vector", "tensor_tensor", elements, 2, dtype, ("multiply",))),
          (scalar, _instruction("scalar", "activation", elements, 1, dtype, ("exp",)))]
    return op + [(2 * one_input + 3 * two_input + 2 * scalar, _hbm(elements, dtype))]


def _gemm(m, k, n, batch=1):
    """(m, k) @ (k, n), `batch` times, in bf16: the tiles as nc_matmuls, their PSUM evictions, the HBM traffic."""
    out_tiles = batch * math.ceil(m / 128) * math.ceil(n / 512)
    tiles, width = out_tiles * math.ceil(k / 128), min(n, 512)
    matmul = nki_emulator.Instruction("nc_matmul", "tensor", min(k, 128), width, ("float32", "bfloat16", "bfloat16"),
                                      ("psum", "sbuf", "sbuf"), stationary=min(m, 128))
    evict = [nki_emulator.Instruction("tensor_copy", engine, min(m, 128), width, ("bfloat16", "float32"), ("sbuf", "psum"))
             for engine in ("vector", "scalar")]
    return [(tiles, matmul), (out_tiles / 2, evict[0]), (out_tiles / 2, evict[1]),
            (1, _hbm(batch * (m * k + k * n + m * n), "bfloat16"))]


def _linear(tokens, fan_in, fan_out):
    """A bias-free linear layer over `tokens` rows: forward, and backward's dX and dW."""
    return {"forward": _gemm(tokens, fan_in, fan_out),
            "backward": _gemm(tokens, fan_out, fan_in) + _gemm(fan_out, tokens, fan_in)}


_pricing = [nki_emulator.instruction_seconds]  # how compiled ops are priced: the cost model, or (central) calibrated


def _engine_seconds(op):
    """{engine: busy seconds} of an op, over (count, instruction) pairs."""
    engines = dict.fromkeys(ENGINE_LETTERS, 0.0)
    for count, instruction in op:
        engines[instruction.engine] += count * _pricing[-1](instruction, "trn2")
    return engines


def _op_seconds(op):
    """An op's time: its busiest engine."""
    return max(_engine_seconds(op).values())


def compiled_ops(name, c, sequences, norm_elements=None):
    """{"forward": ops, "backward": ops} of kernel op `name` (one of kernels.KERNEL_OPS) compiled as plain
    ops instead (STEP_ASSUMPTIONS), for one layer and `sequences` sequences; each op a list of (count,
    instruction). RMSNorm is priced over `norm_elements` values (default: the sequences' residual stream)."""
    T, C, H, D = c.sequence_len, c.n_embd, c.n_head, c.head_dim
    N, hidden, n_up = sequences * T, c.hidden_dim, 2 if c.mlp == "swiglu" else 1
    if name == "attention":  # full T x T scores: q k^T and p v forward; dP (a qk), dV, dQ, dK (pv's) backward
        scores = sequences * H * T * T
        qk, pv = _gemm(T, D, T, sequences * H), _gemm(T, T, D, sequences * H)
        return {"forward": [qk, pv, _passes(scores, one_input=3, two_input=1, scalar=1)],  # mask, max, exp, normalise, cast
                "backward": [qk, pv, pv, pv, _passes(scores, one_input=1, two_input=1)]}
    if name == "mlp":  # the activation: 2 one-input passes forward (e.g. relu, square), 1 one- and 2 two-input backward
        up, down = _linear(N, C, hidden), _linear(N, hidden, C)
        return {"forward": [up["forward"]] * n_up + [down["forward"], _passes(N * hidden, one_input=2, dtype="bfloat16")],
                "backward": [up["backward"]] * n_up + [down["backward"],
                                                        _passes(N * hidden, one_input=1, two_input=2, dtype="bfloat16")]}
    if name == "rms_norm":  # forward: mean of squares, scale, cast; backward: 4 one-input and 1 two-input passes
        elements = N * C if norm_elements is None else norm_elements
        return {"forward": [_passes(elements, one_input=3)], "backward": [_passes(elements, one_input=4, two_input=1)]}
    if name == "add_rms_norm":  # the residual add as a two-input pass, then the norm of the sum; backward: the
        # norm's passes and the sum of the two gradients that reach the sum
        norm = compiled_ops("rms_norm", c, sequences)
        return {direction: [_passes(N * C, two_input=1)] + norm[direction] for direction in ("forward", "backward")}
    if name == "softcap_cross_entropy":
        return {direction: [_passes(N * c.vocab_size, *vector, scalar)]
                for direction, (vector, scalar) in HEAD_PASSES.items()}
    if name == "rope_norm":  # q and k: the rotary's bf16 passes each way, then QK-norm's
        elements = N * (H + c.n_kv_head) * D
        norm = compiled_ops("rms_norm", c, sequences, elements)
        return {direction: [_passes(elements, one_input=1, two_input=3, dtype="bfloat16")] + norm[direction]
                for direction in ("forward", "backward")}
    raise ValueError(f"no compiled pricing for kernel op {name!r}")


def compiled_estimate(ops):
    """A sequence of ops run one after another: estimate_s (the sum of each op's busiest engine), the engines'
    busy seconds summed over the ops, and the bottleneck (the busiest engine overall)."""
    engines = dict.fromkeys(ENGINE_LETTERS, 0.0)
    for op in ops:
        for engine, seconds in _engine_seconds(op).items():
            engines[engine] += seconds
    return {"estimate_s": sum(_op_seconds(op) for op in ops), "engines": engines,
            "bottleneck": max(engines, key=engines.get)}


def kernel_step_costs(model_cfg, tokens_per_call, central=False):
    """Seconds of one call of each NKI kernel, forward + backward, for one sequence (estimate_s; central: its
    calibrated schedule plus its launches' cost shared by the call's sequences), or None where
    the kernel does not run on Trn2: its kernels mode is torch, it refuses the shapes, or (kernels=auto) the
    cost rule declines it at `tokens_per_call` (kernels._mlp_cost_problem). The kernel part of step_estimate."""
    if kernels.nki is not nki_emulator:
        raise ValueError("the Trn2 estimates run the kernels under the NKI emulator, which stands in for nki only "
                         "where the Neuron SDK is not installed; run them on a machine without it")
    modes, costs = kernels.parse_kernels(model_cfg.kernels), {}
    for name, _, _, make_inputs, call in kernel_cases(model_cfg, 1, "cpu", torch.bfloat16):
        name = name.split()[0]
        declined = name == "mlp" and kernels._mlp_cost_problem(tokens_per_call, model_cfg.n_embd,
                                                               model_cfg.mlp == "swiglu") is not None
        mode = modes["rms_norm" if name == "rms_norm_fp32" else name]  # the stream's norms are rms_norm's op
        if mode == "torch" or (mode == "auto" and declined):
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
        seconds[component] = seconds.get(component, 0.0) + times * _op_seconds(op)

    for projection in (_linear(N, C, C + 2 * kv), _linear(N, C, C)):  # q, k, v; output projection
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
            add("elementwise", _passes(N * (C + kv), one_input=1, two_input=3, dtype="bfloat16"))
        add("elementwise", _passes(N * C, two_input=1), plain_adds)
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
        _pricing.append(nki_emulator.calibrated_seconds)
        try:
            return step_estimate(cfg, model_cfg, ranks, kernel_costs or kernel_step_costs(
                model_cfg, cfg.batch_size * model_cfg.sequence_len, central=True))
        finally:
            _pricing.pop()
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
    head = _linear(N, c.n_embd, V)
    seconds["head matmul"] = micro_steps * sum(_op_seconds(op) for op in head.values())
    if kernel_costs["softcap_cross_entropy"] is not None and not (c.mtp_extra or c.loss_chunks):  # (levers: their own loss)
        seconds["kernels: softcap_cross_entropy"] = micro_steps * cfg.batch_size * kernel_costs["softcap_cross_entropy"]
    else:
        seconds["head softcap + cross-entropy"] = micro_steps * sum(
            _op_seconds(_passes(N * c.vocab_size, *vector, scalar)) for vector, scalar in HEAD_PASSES.values())
    params = sum(math.prod(s) for s in shapes)
    seconds["embedding lookup"] = micro_steps * 2 * _op_seconds(_passes(N * c.n_embd, one_input=1))
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
        t = _op_seconds(_passes(adamw_elements, *ADAMW_PASSES))
        for shape in set(share_matrices):  # stacked by shape, as optim.Muon does; wide orientation (m <= n)
            m, n = sorted(shape)
            k = share_matrices.count(shape)
            gemms = [_gemm(m, n, m, k), _gemm(m, m, m, k), _gemm(m, m, n, k)]
            t += 5 * sum(_op_seconds(g) for g in gemms) + _op_seconds(_passes(k * m * n, *MUON_PASSES))
            t += 5 * (_op_seconds(_passes(k * m * m, two_input=1, dtype="bfloat16"))
                      + _op_seconds(_passes(k * m * n, two_input=1, dtype="bfloat16")))
        optimizer_s.append(t)
    seconds["optimizer"] = max(optimizer_s)
    seconds["optimizer"] += _op_seconds(_passes(params, one_input=2 if cfg.grad_clip else 0, two_input=micro_steps - 1))
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


def sweep_title(cfg, model_cfg, device_type):
    """What a plot read on its own needs: the device, the dtype and the shape every point varies from."""
    name = torch.cuda.get_device_name() if device_type == "cuda" else runtime.trainium_generation() if device_type == "neuron" else "CPU"
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    return (f"MFU on {device_type} ({name}, {ranks} rank(s)), {cfg.dtype}; base: {model_cfg.n_layer} layers, n_embd "
            f"{model_cfg.n_embd}, {model_cfg.n_head}/{model_cfg.n_kv_head} heads, seq {model_cfg.sequence_len}, batch {cfg.batch_size}")


def write_sweep(rows, prefix, title):
    with open(f"{prefix}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with open(f"{prefix}.json", "w") as f:
        json.dump(rows, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"wrote {prefix}.csv and {prefix}.json (install matplotlib for {prefix}.png)")
        return
    axes_names = list(dict.fromkeys(r["axis"] for r in rows))
    # one y-range for all panels, so a taller curve means a higher MFU, not a different scale
    fig, axes = plt.subplots(1, len(axes_names), figsize=(3.2 * len(axes_names), 3.4), squeeze=False, sharey=True)
    for ax, name in zip(axes[0], axes_names):
        points = [r for r in rows if r["axis"] == name]
        ax.plot([r["value"] for r in points], [100 * r["mfu"] for r in points], "o-")
        ax.set_xlabel(name)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("MFU %")
    axes[0][0].set_ylim(bottom=0)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(f"{prefix}.png", dpi=100)
    print(f"wrote {prefix}.csv, {prefix}.json and {prefix}.png")


# -----------------------------------------------------------------------------
# ablation: does each frontier lever train, and is it wired right?

# A small model on the built-in Shakespeare (bytes), fp32 on one CPU thread: a few minutes for all rows.
ABLATION_SHAPE = ["--n_layer=2", "--n_embd=64", "--n_head=2", "--n_kv_head=2", "--sequence_len=64", "--batch_size=8",
                  "--total_batch_tokens=2048", "--time_budget_s=0", "--eval_tokens=16384", "--sample_tokens=0",
                  "--compile=false", "--dtype=float32", "--device=cpu", "--log_every=100000", "--checkpoint_every=0"]
FULL_RUN_STEPS = 2400  # about what FrontierForge's 30-minute runs did, which the step-counted settings assume


def ablation_rows(steps):
    """(name, train.py arguments) for the baseline, the frontier and the baseline with each lever alone. The
    settings counted in steps (Muon's momentum warm-up, the EMA's span) shrink with the run, so they cover
    the same share of it as in a full run; everything else is the presets' own values."""
    scale = steps / FULL_RUN_STEPS
    short = {"muon_momentum_warmup_steps": max(1, round(300 * scale))}
    short_ema = {"ema_every": max(1, round(32 * scale)), "ema_decay": round(0.99 ** (1 / scale), 4)}
    rows = [("baseline", {}), ("frontier", {name: contest.FRONTIER[name] for fields in contest.FRONTIER_LEVERS.values() for name in fields})]
    rows += [(f"+ {lever}", {f: contest.FRONTIER[f] for f in fields}) for lever, fields in contest.FRONTIER_LEVERS.items()]
    args = []
    for name, levers in rows:
        levers = {**levers, **short, **(short_ema if levers.get("ema_decay") else {})}
        levers.pop("batch_size", None)  # the ablation's shape fixes the micro-batch
        args.append((name, ["--preset=baseline", *(f"--{k}={v}" for k, v in levers.items())]))
    return args


def spread(values):
    return statistics.stdev(values) if len(values) > 1 else 0.0


def run_ablation(seeds, steps, extra=()):
    """val_bpb of every ablation row for each seed (extra: more train.py arguments for every run), as a
    markdown table of mean, spread and change from the baseline. It checks that each lever trains and is
    wired right at this scale; it measures nothing about Trn2, where the levers' gains were measured at far
    larger scale (docs/results.md, "Ablation")."""
    import contextlib
    import io
    import tempfile
    started = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory() as out:
        for row, (name, args) in enumerate(ablation_rows(steps)):
            for seed in range(1, seeds + 1):
                argv = [*args, *ABLATION_SHAPE, f"--max_steps={steps}", f"--seed={seed}",
                        f"--out_dir={os.path.join(out, f'{row}-{seed}')}", *extra]  # a fresh folder per run
                with contextlib.redirect_stdout(io.StringIO()):
                    final = train.main(argv)["final_eval"]["val_bpb"]
                results.setdefault(name, []).append(final)
            print(f"{name:>16}: {' '.join(f'{v:.4f}' for v in results[name])}", file=sys.stderr, flush=True)
    # a seed fixes the initialisation and the data order, so each row is compared with the baseline seed by seed
    print(f"| config | val_bpb (mean of {seeds} seeds) | sd | vs baseline, paired by seed (mean, sd) | per seed |")
    print("|---|---|---|---|---|")
    for name, values in results.items():
        deltas = [v - b for v, b in zip(values, results["baseline"])]
        delta = "" if name == "baseline" else f"{statistics.mean(deltas):+.4f} ({spread(deltas):.4f})"
        print(f"| {name} | {statistics.mean(values):.4f} | {spread(values):.4f} | {delta} | {', '.join(f'{v:.4f}' for v in values)} |")
    print(f"\n{seeds} seeds x {len(results)} configs, {steps} steps of 2,048 tokens each, in "
          f"{time.perf_counter() - started:.0f} s (torch.get_num_threads() = {torch.get_num_threads()})")
    return results


# -----------------------------------------------------------------------------
# first-hour check: does everything work on this machine? (--check)

# The model the check builds: two layers, grouped-query heads of 64, two 128-query tiles per sequence.
CHECK_MODEL = dict(sequence_len=256, n_layer=2, n_embd=128, n_head=2, n_kv_head=1, vocab_size=257)
CHECK_STEPS = 20
# The kernel checks' shapes are ragged wherever the kernels allow it: an odd batch, T = 3 x 128, grouped
# heads 4:1, and token counts that leave the last 128-row tile partial.
CHECK_BATCH, CHECK_KERNEL_LEN, CHECK_HEADS, CHECK_KV_HEADS, CHECK_ROWS = 3, 384, 4, 1, 67
# How far NKI may honestly be from PyTorch, measured per check rather than fixed per dtype (a fixed 1e-4 in
# fp32 failed a sound run at step 13 with 1.2e-4). PyTorch's own error is measured against the PyTorch path
# in float64 on the CPU: for a kernel, for a Block, and for the whole training run (whose losses amplify
# every rounding difference step by step, so its error is far above a single op's). Two paths that each
# round about that much differ by up to twice it, and the kernels round in other places (bf16 P and dS
# before their matmuls): HONEST_FACTOR times PyTorch's error, never under a few rounding steps.
HONEST_FACTOR = 4


def _error(got, want):
    """max |got - want| / max |want|: the measure of every check."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def _tolerance(torch_error, dtype):
    return HONEST_FACTOR * max(torch_error, torch.finfo(dtype).eps)


def _close(what, got, want, tolerance):
    error = _error(got, want)
    if not error <= tolerance:  # also catches NaN
        raise AssertionError(f"{what}: max |nki - torch| / max |torch| = {error:.3g}, over {tolerance:.3g} "
                             f"({HONEST_FACTOR} x PyTorch's own error here)")
    return error, tolerance


def refuse_degenerate(what, got, inputs):
    """AssertionError if `got` is all zeros, one constant, not finite, or bit-equal to one of `inputs`,
    whatever a tolerance would say: what an untouched output, a kernel that skipped its work or one that
    copied its input through looks like (after Neuron SDK 2.32 four of six aws-neuron/nki-samples kernels
    exited 0 with all-zero outputs: aws-neuron/nki-samples#134)."""
    values = got.detach().float()
    if values.numel() == 0:
        return
    if not torch.isfinite(values).all():
        raise AssertionError(f"{what}: {int((~torch.isfinite(values)).sum())} of {values.numel()} values are not "
                             "finite (NaN is what an output the kernel never wrote holds under the emulator)")
    if not values.any():
        raise AssertionError(f"{what}: all {values.numel()} values are zero")
    if values.numel() > 1 and values.min() == values.max():
        raise AssertionError(f"{what}: all {values.numel()} values are {values.flatten()[0].item():g}")
    for i, tensor in enumerate(inputs):
        if tensor is not None and tensor.shape == got.shape and torch.equal(tensor.detach().to(got), got.detach()):
            raise AssertionError(f"{what}: equal to input {i}, bit for bit")


def _kernel_checks(dtype, device, seed):
    """(name, inputs, call(*inputs, mode) -> output) for each NKI kernel at ragged shapes (CHECK_BATCH ...),
    every MLP activation and RMSNorm with and without a weight; random inputs drawn from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    dim, head_dim = CHECK_MODEL["n_embd"], CHECK_MODEL["n_embd"] // CHECK_HEADS
    hidden = 4 * dim

    def tensor(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(device)

    def attention_inputs():
        return (tensor(CHECK_BATCH, CHECK_HEADS, CHECK_KERNEL_LEN, head_dim),
                tensor(CHECK_BATCH, CHECK_KV_HEADS, CHECK_KERNEL_LEN, head_dim),
                tensor(CHECK_BATCH, CHECK_KV_HEADS, CHECK_KERNEL_LEN, head_dim))

    cases = [("attention", attention_inputs, lambda q, k, v, mode: kernels.attention(q, k, v, mode=mode))]
    for activation in kernels.MLP_ACTIVATIONS:
        def mlp_inputs(activation=activation):
            gate = tensor(hidden, dim, scale=dim ** -0.5) if activation == "swiglu" else None
            return (tensor(CHECK_BATCH, CHECK_ROWS, dim), tensor(hidden, dim, scale=dim ** -0.5),
                    tensor(dim, hidden, scale=hidden ** -0.5), gate)

        cases.append((f"mlp {activation}", mlp_inputs, lambda x, w_up, w_down, w_gate, mode, activation=activation:
                      kernels.mlp(x, w_up, w_down, activation, w_gate, mode=mode)))
    cases.append(("rms_norm", lambda: (tensor(CHECK_BATCH, CHECK_ROWS, dim),),
                  lambda x, mode: kernels.rms_norm(x, mode=mode)))
    cases.append(("rms_norm weighted",
                  lambda: (tensor(CHECK_BATCH, CHECK_ROWS, dim), (1 + 0.5 * torch.randn(dim, generator=generator)).to(device)),
                  lambda x, w, mode: kernels.rms_norm(x, w, mode=mode)))
    cases.append(("add_rms_norm", lambda: (tensor(CHECK_BATCH, CHECK_ROWS, dim), tensor(CHECK_BATCH, CHECK_ROWS, dim)),
                  lambda x, branch, mode: torch.stack(kernels.add_rms_norm(x, branch, mode=mode))))
    vocab = CHECK_MODEL["vocab_size"]  # padded to a multiple of 128: the kernel skips the padding columns
    targets = torch.randint(-1, vocab, (CHECK_BATCH, CHECK_ROWS), generator=generator).to(device)  # -1: ignored
    cases.append(("softcap_cross_entropy",
                  lambda: (tensor(CHECK_BATCH, CHECK_ROWS, math.ceil(vocab / 128) * 128, scale=8.0),),
                  lambda logits, mode: kernels.softcap_cross_entropy(logits, targets, 15.0, vocab, "none", mode=mode)))
    cos, sin = (t.to(device) for t in rotary_tables(CHECK_ROWS, head_dim, 10000.0))  # not inputs: no gradient
    cases.append(("rope_norm", lambda: (tensor(CHECK_BATCH, CHECK_ROWS, CHECK_HEADS * head_dim),),
                  lambda x, mode: kernels.rope_norm(x, cos, sin, CHECK_HEADS, mode=mode)))
    return cases


def _run_both(call, inputs, grad, seed):
    """Outputs (and with grad, the gradients of every input for one random output gradient, drawn from
    `seed`) for mode="nki", mode="torch" and the float64 reference (mode="torch" on the CPU). (A loss like
    out.square().mean() would not do: its gradient is parallel to the output, which RMSNorm's dx cancels to
    almost nothing.) Also returns the output gradient, for refuse_degenerate."""
    results, d_out = [], None
    for mode, cast in (("nki", None), ("torch", None), ("torch", torch.float64)):
        leaves = [t.detach().clone() if t is not None else None for t in inputs]
        if cast is not None:
            leaves = [t.cpu().to(cast) if t is not None else None for t in leaves]
        leaves = [t.requires_grad_(grad) if t is not None else None for t in leaves]
        with torch.set_grad_enabled(grad):
            out = call(*leaves, mode)
            if grad:
                d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
                out.backward(d_out.to(out))
        results.append([out] + ([t.grad for t in leaves if t is not None] if grad else []))
    return results, d_out


def _check_kernel(call, inputs, grad, seed=0):
    """Every output and gradient of the NKI path against PyTorch's; returns the largest error measured
    (its number repeats with the same --seed)."""
    (nki_results, torch_results, exact_results), d_out = _run_both(call, inputs, grad, seed)
    names = ["output"] + [f"gradient of input {i}" for i in range(len(nki_results) - 1)]
    worst = None
    for name, got, want, exact in zip(names, nki_results, torch_results, exact_results):
        if got.shape != want.shape or got.dtype != want.dtype:
            raise AssertionError(f"{name}: NKI gives {tuple(got.shape)} {got.dtype}, PyTorch {tuple(want.shape)} "
                                 f"{want.dtype}")
        refuse_degenerate(name, got, [*inputs, d_out])
        error, tolerance = _close(name, got, want, _tolerance(_error(want.cpu(), exact), want.dtype))
        if worst is None or error / tolerance > worst[0] / worst[1]:
            worst = (error, tolerance)
    return f"largest error {worst[0]:.3g} (tolerance {worst[1]:.3g})"


def _check_model_config(model_cfg, kernels_mode):
    from model import GPTConfig

    return GPTConfig(**{**CHECK_MODEL, "mlp": model_cfg.mlp, "kernels": kernels_mode})


def _check_compiled_block(cfg, model_cfg, device_type, device):
    """model.Block with every kernel on NKI, compiled as train.py compiles it (the Neuron backend on
    Trainium; not at all with --compile=false), against the same Block eager on PyTorch: output and
    parameter gradients; PyTorch's own error from the Block in float64 on the CPU."""
    from model import Block

    results = []
    for mode, exact in (("nki", False), ("torch", False), ("torch", True)):
        config = _check_model_config(model_cfg, mode)
        torch.manual_seed(cfg.seed)
        block = Block(config)
        for linear in (block.attn.c_proj, block.mlp.c_proj):  # nonzero, so that every gradient is
            torch.nn.init.normal_(linear.weight, std=0.02)
        where, dtype = ("cpu", torch.float64) if exact else (device, torch.float32)
        block = block.to(where, dtype)
        cos, sin = (t.to(where, dtype) for t in rotary_tables(config.sequence_len, config.head_dim, config.rope_base))
        x = torch.randn(2, config.sequence_len, config.n_embd, generator=torch.Generator().manual_seed(cfg.seed + 1)).to(where, dtype)
        run = train.wrap_for_training(block, cfg, device_type, device, (x, cos, sin)) if mode == "nki" else block
        with runtime.autocast_context(cfg, device_type) if not exact else contextlib.nullcontext():
            out = torch.cat(run(x, cos, sin), dim=-1)  # the new residual stream and its norm
        out.float().square().mean().backward()
        results.append([out] + [p.grad for p in block.parameters()])
    dtype = runtime.compute_dtype(cfg)
    for i, (got, want, exact) in enumerate(zip(*results)):
        _close("output" if i == 0 else f"gradient of parameter {i - 1}", got, want,
               _tolerance(_error(want.cpu(), exact), dtype))


@contextlib.contextmanager
def _float64_by_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _training_losses(cfg, model_cfg, mode, device_type, device, exact=False):
    """Losses of CHECK_STEPS steps of train.py's optimizer step on fixed random tokens; `exact`: the
    PyTorch path uncompiled on the CPU with everything (weights, optimizer state, hyperparameter tensors,
    Muon's orthogonalisation) in float64."""
    from model import GPT

    if exact:
        cfg, device_type, device = dataclasses.replace(cfg, dtype="float32", compile=False), "cpu", "cpu"
    torch.manual_seed(cfg.seed)
    raw_model = GPT(_check_model_config(model_cfg, mode)).to(device, torch.float64 if exact else None)
    with _float64_by_default() if exact else contextlib.nullcontext():
        tokens = torch.randint(0, CHECK_MODEL["vocab_size"], (2, CHECK_MODEL["sequence_len"] + 1),
                               generator=torch.Generator().manual_seed(cfg.seed + 2))
        batch = [(tokens[:, :-1], tokens[:, 1:])]
        model = train.wrap_for_training(raw_model, cfg, device_type, device, [t.to(device) for t in batch[0]])
        optimizers = optim.make_optimizers(raw_model, cfg, device_type,
                                           torch.float64 if exact else runtime.compute_dtype(cfg))
        autocast = runtime.autocast_context(cfg, device_type)
        losses = []
        for _ in range(CHECK_STEPS):
            loss, _ = train.train_step(model, raw_model, optimizers, batch, device, autocast, cfg.grad_clip)
            losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64)


def _check_training(cfg, model_cfg, device_type, device):
    nki_losses = _training_losses(cfg, model_cfg, "nki", device_type, device)
    torch_losses = _training_losses(cfg, model_cfg, "torch", device_type, device)
    exact_losses = _training_losses(cfg, model_cfg, "torch", device_type, device, exact=True)
    # rounding differences grow chaotically as training goes on, so two sound runs part by a ratio that
    # varies from step to step (a per-step bound failed a sound fp32 run at 5.9x): every step is held to the
    # largest difference PyTorch itself shows against float64 over the run
    tolerance = _tolerance(((torch_losses - exact_losses).abs() / exact_losses.abs()).max().item(),
                           runtime.compute_dtype(cfg))
    for step in range(CHECK_STEPS):
        _close(f"loss of step {step + 1} (NKI {nki_losses[step]:.4f}, PyTorch {torch_losses[step]:.4f})",
               nki_losses[step], torch_losses[step], tolerance)
    if not nki_losses[-1] < nki_losses[0]:
        raise AssertionError(f"the loss did not fall in {CHECK_STEPS} steps: {nki_losses.tolist()}")
    return f"last loss {nki_losses[-1]:.6f} on nki, {torch_losses[-1]:.6f} on torch"


def _check_causality(cfg, model_cfg, device_type, device):
    """The whole model on NKI kernels: changing the tokens after position t changes no logit at or
    before t (bitwise, apart from float noise far below what any leak would cause)."""
    from model import GPT

    torch.manual_seed(cfg.seed)
    model = GPT(_check_model_config(model_cfg, "nki")).to(device)
    for block in model.blocks:  # nonzero output projections, so that attention reaches the logits
        for linear in (block.attn.c_proj, block.mlp.c_proj):
            torch.nn.init.normal_(linear.weight, std=0.02)
    with runtime.autocast_context(cfg, device_type):
        contest.check_causality(model, CHECK_MODEL["vocab_size"], CHECK_MODEL["sequence_len"], device)


def _two_transposes(a, b):
    return (a.view(4, 256, 64).transpose(-1, -2).contiguous(), b.view(4, 256, 64).transpose(-1, -2).contiguous())


def inductor_transpose_line():
    """One line: does this machine's inductor miscompile two 16-bit transposes fused into one C++ kernel?
    PyTorch's inductor (2.13, 2.14) gets ~96% of the values wrong on some AVX512 CPUs: a PyTorch bug (the
    same transposed-tile fast path was disabled for BF16 on SVE256 for correctness: pytorch/pytorch#173190),
    which the kit keeps out of its own compiled graphs, but a user's own compiled code may meet. Workaround:
    torch._inductor.config.cpp.simdlen = 256 (docs/troubleshooting.md). One small compile, a few seconds."""
    a, b = (torch.randn(1024, 64, generator=torch.Generator().manual_seed(i)).bfloat16() for i in (0, 1))
    try:
        compiled = torch.compile(_two_transposes, fullgraph=True, dynamic=False)(a, b)
    except Exception as error:  # no C++ compiler, say: the line says so and the check goes on
        return f"inductor: the fused bf16 transpose repro could not run here ({type(error).__name__}: {error})"
    wrong = sum(int((got != want).sum()) for got, want in zip(compiled, _two_transposes(a, b)))
    if wrong:
        return (f"inductor: MISCOMPILES fused bf16 transposes on this CPU ({wrong} of {2 * a.numel()} values wrong; "
                "a PyTorch bug the kit avoids; in your own compiled code set "
                "torch._inductor.config.cpp.simdlen = 256, see docs/troubleshooting.md)")
    return "inductor: fused bf16 transposes compile right on this CPU (the kit avoids the pattern anyway)"


def run_checks(cfg, model_cfg, device_type, device):
    """Every check, each caught on its own so that one failure does not hide the others; returns rows of
    (check, passed, seconds, first line of the error), and prints each failure's traceback. First the seed
    of this run's random inputs (--seed repeats them) and the inductor line."""
    print(f"seed {cfg.seed} (the same inputs again: --seed={cfg.seed})", flush=True)
    t0 = time.perf_counter()
    print(f"{inductor_transpose_line()} [{time.perf_counter() - t0:.1f} s]", flush=True)
    dtype = runtime.compute_dtype(cfg)
    checks = []
    for name, inputs, call in _kernel_checks(dtype, device, cfg.seed):
        for grad in (False, True):  # fresh inputs for each check: a stale output of an earlier call is wrong here
            checks.append((f"{name} {'forward+backward' if grad else 'forward, no grad'}",
                           lambda call=call, inputs=inputs, grad=grad: _check_kernel(call, inputs(), grad, cfg.seed)))
    checks += [
        (f"Block (nki{', compiled' if cfg.compile else ''}) vs eager (torch)",
         lambda: _check_compiled_block(cfg, model_cfg, device_type, device)),
        (f"{CHECK_STEPS} training steps, nki vs torch", lambda: _check_training(cfg, model_cfg, device_type, device)),
        ("causality of the model on nki", lambda: _check_causality(cfg, model_cfg, device_type, device)),
    ]
    rows = []
    for name, check in checks:
        t0 = time.perf_counter()
        try:
            detail = check()
        except Exception as error:  # reported in the table and by the exit code; the traceback goes to stderr
            traceback.print_exc()
            message = str(error).strip().splitlines()
            rows.append({"check": name, "passed": False, "seconds": time.perf_counter() - t0,
                         "error": f"{type(error).__name__}: {message[0] if message else ''}"})
        else:
            rows.append({"check": name, "passed": True, "seconds": time.perf_counter() - t0, "error": detail or ""})
        print(f"{'PASS' if rows[-1]['passed'] else 'FAIL'}  {name}", flush=True)
    return rows


def print_checks(rows, device_type):
    where = "NKI kernels on the NeuronCores" if device_type == "neuron" else "NKI kernels under the CPU emulator"
    print(f"\nfirst-hour check on {device_type} ({where})")
    print(f"{'check':<44} {'result':<6} {'s':>6}  measured, or the first error")
    for r in rows:
        print(f"{r['check']:<44} {'pass' if r['passed'] else 'FAIL':<6} {r['seconds']:>6.1f}  {r['error']}")
    failed = sum(not r["passed"] for r in rows)
    print(f"{len(rows) - failed} passed, {failed} failed")


# -----------------------------------------------------------------------------
# the whole first device session in one command (--first_hour)
#
# Every question a paid run depends on, each step in a child process with its own timeout, so that one
# failure or hang cannot hide the rest; one table at the end, exit code 1 if any step failed, and the flags
# for the first paid run. Off Trainium the same steps run on the CPU and the emulator at FIRST_HOUR_TINY
# shapes (a few minutes on 2 cores).

FIRST_HOUR_TINY = ["--n_layer=2", "--n_embd=128", "--n_head=2", "--n_kv_head=1", "--sequence_len=128", "--batch_size=2",
                   "--tokenizer=bytes", "--dataset=shakespeare"]
FIRST_HOUR_STEPS = 20
# seconds each step may take: (on Trainium, where a cold compile of a graph takes up to ~15 min; off it)
FIRST_HOUR_TIMEOUTS = {"versions": (120, 60), "kernel": (1800, 180), "check": (3600, 900), "train": (2400, 400),
                       "ranks": (2400, 300), "resume": (1800, 200), "eval": (1800, 180)}
# a script run with the CPU emulator standing in for `nki` (as bench.py itself does): python -c EMULATED_RUN script args
EMULATED_RUN = ("import os, runpy, sys; sys.argv = sys.argv[1:]; sys.path.insert(0, os.path.dirname(sys.argv[0])); "
                "import nki_emulator; nki_emulator.install(); runpy.run_path(sys.argv[0], run_name='__main__')")
ODD_EVAL_LEN = 777  # "an odd T": the scorer's context is 1024, a model must also take any other length


def nki_front_end(version):
    """Which NKI front end a version string means: KLR's parser up to NKI 0.6, a Python tracer from 0.7
    (Neuron 2.33 release notes; the parser's rules are the stricter, which the kernels keep)."""
    import re

    match = re.match(r"(\d+)\.(\d+)", version or "")
    if match is None:
        return "unknown front end"
    return "tracer front end (NKI >= 0.7)" if (int(match[1]), int(match[2])) >= (0, 7) else "parser front end (NKI <= 0.6, KLR)"


def first_hour_versions():
    import importlib.metadata

    def version(package):
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    nki_version = getattr(kernels.nki, "__version__", None)
    emulated = kernels.nki is nki_emulator
    where = f"NKI {nki_version}" + (" (the CPU emulator: no Neuron SDK here)" if emulated else "")
    return (f"{where}, {nki_front_end(nki_version)}; torch {torch.__version__}; "
            f"torch-neuronx {version('torch-neuronx') or 'not installed'}; neuronx-cc {version('neuronx-cc') or 'not installed'}")


def first_hour_kernel(model_cfg, batch_size, device_type, device, op):
    """Run the NKI kernels of `op` (attention, mlp, rms_norm) alone, forward and backward, at the model's
    shapes; one "front end ok / backend ok" per kernel. On the emulator the front end is nki.jit's check of
    the kernel source against KLR's Python subset and the backend the emulated run; on a NeuronCore nki.jit
    and the call (a compiler error carries an NCC_ code, so it is the backend's; any other, the front end's)."""
    results = {}
    run = kernels._run_kernel

    def launch(kernel, *args):
        name = kernel.__name__
        try:
            kernels._jitted(kernel, kernels._logical_core_degree())
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

    dtype = torch.bfloat16
    case = next(c for c in kernel_cases(model_cfg, batch_size, device, dtype) if c[0].split()[0] == op)
    _, _, _, make_inputs, call = case
    try:
        with mock.patch.object(kernels, "_run_kernel", launch):
            inputs = make_inputs()
            out = call(*inputs, "nki")
            out.float().sum().backward()
    finally:
        print("; ".join(f"{name}: {result}" for name, result in results.items()) or "no kernel ran")
    return all(result.endswith("backend ok") for result in results.values())


def first_hour_eval(checkpoint_path, batch_size, device_type, device):
    """Time one load_for_eval forward at (batch, 1024) and at (batch, ODD_EVAL_LEN), the scorer's way (no
    autocast, no grad)."""
    t0 = time.perf_counter()
    model = train.load_for_eval(checkpoint_path, device)
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


def first_hour_plan(passthrough, on_trainium, out_dir):
    """The steps: (name, command, timeout in seconds). `passthrough`: the user's train.py flags (e.g.
    --preset=baseline); off Trainium FIRST_HOUR_TINY shapes follow them."""
    python, here = sys.executable, os.path.dirname(os.path.abspath(__file__))
    bench_py, train_py = os.path.join(here, "bench.py"), os.path.join(here, "train.py")
    shapes = list(passthrough) + ([] if on_trainium else FIRST_HOUR_TINY)
    run_flags = [f"--data_dir={os.path.join(out_dir, 'data')}", "--time_budget_s=0", "--sample_tokens=0",
                 "--eval_tokens=4096", "--log_every=5", "--compile=true"]
    timeout = {name: pair[0 if on_trainium else 1] for name, pair in FIRST_HOUR_TIMEOUTS.items()}
    step = [python, bench_py, "--first_hour_step"]
    steps = [("versions", step + ["versions"] + shapes, timeout["versions"])]
    for op in ("attention", "mlp", "rms_norm"):
        steps.append((f"kernels: {op}", step + [f"kernel:{op}"] + shapes, timeout["kernel"]))
    steps.append(("bench.py --check", [python, bench_py, "--check"] + list(passthrough), timeout["check"]))
    # off Trainium auto is the PyTorch path: there the kernels run under the emulator, installed as `nki` first
    auto, on_kernels = ("auto", [python, train_py]) if on_trainium else ("nki", [python, "-c", EMULATED_RUN, train_py])
    for kernels_mode, launcher in (("torch", [python, train_py]), (auto, on_kernels)):
        steps.append((f"{FIRST_HOUR_STEPS} compiled steps, --kernels={kernels_mode}",
                      launcher + shapes + run_flags + [f"--kernels={kernels_mode}",
                       f"--max_steps={FIRST_HOUR_STEPS}", f"--out_dir={os.path.join(out_dir, 'steps_' + kernels_mode)}"],
                      timeout["train"]))
    ranks_dir = os.path.join(out_dir, "ranks")
    # off Trainium these steps ask only about sharding and checkpoints: uncompiled (a CPU compile per rank is slow)
    sharded = shapes + run_flags + [f"--out_dir={ranks_dir}", "--checkpoint_every=2"] + ([] if on_trainium else ["--compile=false"])
    steps.append(("2 ranks, sharded optimizer, checkpoint",
                  [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", train_py] + sharded
                  + ["--shard_optimizer=true", "--max_steps=4"], timeout["ranks"]))
    steps.append(("resume it on 1 rank", [python, train_py] + sharded + ["--resume=latest", "--max_steps=6"],
                  timeout["resume"]))
    steps.append((f"load_for_eval forward at B x 1024 and B x {ODD_EVAL_LEN}",
                  step + ["eval", f"--first_hour_checkpoint={os.path.join(ranks_dir, 'final.pt')}"] + shapes,
                  timeout["eval"]))
    return steps


def run_step(name, command, timeout_s):
    """One step in its own process group, killed whole at its timeout; its output streams through. Returns a
    row: step, passed, seconds, detail (its last output line, or why it failed)."""
    import subprocess

    t0 = time.perf_counter()
    print(f"\n=== {name} (timeout {timeout_s} s): {' '.join(command)}", flush=True)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    lines = []

    def read():
        for line in process.stdout:
            print(line, end="", flush=True)
            lines.append(line.rstrip())

    import threading

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
    return {"step": name, "passed": code == 0, "seconds": seconds, "detail": detail}


def first_hour_flags(rows, passthrough, on_trainium):
    """The launch string of the first paid run, from what passed: the NKI kernels if their 20 compiled steps
    ran, else the PyTorch path."""
    kernels_ok = any(r["passed"] for r in rows if "--kernels=auto" in r["step"] or "--kernels=nki" in r["step"])
    flags = " ".join(list(passthrough) + [f"--kernels={'auto' if kernels_ok else 'torch'}"])
    if on_trainium:
        return f"NEURON_LOGICAL_NC_CONFIG=2 torchrun --standalone --nproc_per_node=4 train.py {flags}"
    return f"(on a Trn2) NEURON_LOGICAL_NC_CONFIG=2 torchrun --standalone --nproc_per_node=4 train.py {flags}"


def print_first_hour(rows, flags, seconds):
    print(f"\nfirst device session: {sum(r['passed'] for r in rows)} of {len(rows)} steps passed in {seconds:.0f} s")
    print(f"{'step':<52} {'result':<6} {'s':>7}  detail")
    for r in rows:
        print(f"{r['step']:<52} {'pass' if r['passed'] else 'FAIL':<6} {r['seconds']:>7.1f}  {r['detail']}")
    code = 0 if all(r["passed"] for r in rows) else 1
    print(f"exit code {code}")
    print(f"first paid run: {flags}")
    return code


def run_first_hour(passthrough, out_dir):
    import tempfile

    on_trainium = runtime.detect_device() == "neuron"
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="first_hour_", dir=out_dir) as work:
        rows = [run_step(*step) for step in first_hour_plan(passthrough, on_trainium, work)]
    flags = first_hour_flags(rows, passthrough, on_trainium)
    return rows, flags, time.perf_counter() - t0


def first_hour_step(step, checkpoint_path, cfg, model_cfg, device_type, device):
    """One step of --first_hour, in its own process: prints its result line last; returns whether it passed."""
    if step == "versions":
        print(first_hour_versions())
        return True
    if step.startswith("kernel:"):
        return first_hour_kernel(model_cfg, 1, device_type, device, step.split(":", 1)[1])
    if step == "eval":
        return first_hour_eval(checkpoint_path, cfg.batch_size, device_type, device)
    raise ValueError(f"--first_hour_step={step}: not a step of --first_hour")


# -----------------------------------------------------------------------------
# the memory plan (--memory)

def print_memory(cfg, model_cfg, world_size):
    """memory.memory_plan's table for one rank, against the memory of a Trn2 rank at LNC=1 and 2 and of this
    machine's device; exits 1 (SystemExit) if it fits none. dtype auto plans bf16, the Trainium choice."""
    cfg.dtype = "bfloat16" if cfg.dtype == "auto" else cfg.dtype
    plan = memory.memory_plan(cfg, model_cfg, world_size)
    total = sum(plan.values())
    with torch.device("meta"):
        n_params = GPT(model_cfg).num_params()
    how = ("optimizer sharded: each rank keeps the state of its share" if memory.shards_optimizer(cfg, world_size)
           else "optimizer not sharded: every rank keeps all of its state")
    print(f"memory plan per rank: {n_params / 1e6:.1f}M parameters, {world_size} rank(s), {cfg.dtype} activations; {how}")
    for part, size in plan.items():
        print(f"  {part:<40} {size / memory.GiB:8.2f} GiB")
    print(f"  {'total':<40} {total / memory.GiB:8.2f} GiB")
    here = runtime.detect_device()
    devices = {"Trn2 rank, LNC=2": 24 * memory.GiB, "Trn2 rank, LNC=1": 12 * memory.GiB,
               f"this machine's {here}": cfg.device_memory_gb * memory.GiB or memory.device_memory(here)}
    fits = {}
    for name, capacity in devices.items():
        fits[name] = capacity is not None and total <= memory.FIT_FRACTION * capacity
        room = f"{capacity / memory.GiB:.1f} GiB, {'fits' if fits[name] else 'does NOT fit'}" if capacity else "unknown"
        print(f"  {name:<40} {room} (the plan may use {memory.FIT_FRACTION:.0%})")
    if not any(fits.values()):
        sys.exit("error: the plan fits no device listed; use a smaller --batch_size, more ranks with "
                 "--shard_optimizer=true, or a smaller model")
    return {"memory_plan": plan, "total": total, "fits": fits}


# -----------------------------------------------------------------------------

def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Any train.py field is accepted, as --field=value or --field value.")
    parser.add_argument("--bench_steps", type=int, default=10, help="optimizer steps per timed window")
    parser.add_argument("--bench_windows", type=int, default=3, help="timed windows (median reported)")
    parser.add_argument("--bench_warmup", type=int, default=3, help="untimed steps first (compilation)")
    parser.add_argument("--check", action="store_true", help="first-hour check: kernels, compiled Block, training "
                        "and causality, NKI against PyTorch; exit code 1 if anything fails")
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
    parser.add_argument("--ablation", action="store_true", help="val_bpb of baseline, frontier and each lever alone (CPU)")
    parser.add_argument("--ablation_seeds", type=int, default=3)
    parser.add_argument("--ablation_steps", type=int, default=80)
    parser.add_argument("--first_hour", action="store_true", help="the whole first device session: versions, each "
                        "kernel alone, --check, 20 compiled steps on torch and on the kernels, 2 sharded ranks with a "
                        "checkpoint resumed on 1, load_for_eval timings; each step a child process with its own "
                        "timeout; one table, the exit code and the first paid run's flags (off Trainium: tiny, on CPU)")
    parser.add_argument("--first_hour_step", help=argparse.SUPPRESS)  # one step of --first_hour, in its child process
    parser.add_argument("--first_hour_checkpoint", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    if isinstance(args.kernels, str):  # --kernels=VALUE is the model's setting, not the measurement
        rest, args.kernels = rest + [f"--kernels={args.kernels}"], False
    if args.first_hour:  # before any device work: the steps do it, each in its own process
        rows, paid_run, seconds = run_first_hour(rest, None)
        print_first_hour(rows, paid_run, seconds)
        return {"first_hour": rows, "first_paid_run": paid_run}
    if args.ablation:  # any other --field=value (e.g. --data_dir) goes to every run
        return run_ablation(args.ablation_seeds, args.ablation_steps, rest)
    cfg, model_cfg = train.parse_args(rest)
    if args.check and not any(a == "--seed" or a.startswith("--seed=") for a in rest):
        cfg.seed = random.SystemRandom().randrange(2 ** 31)  # a fresh one each run, printed, so it can be repeated
    flags.validate_config(cfg, model_cfg)
    if args.memory:
        return print_memory(cfg, model_cfg, args.world_size)
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
            write_sweep(results["sweep"], args.sweep_out, sweep_title(cfg, model_cfg, device_type))
    elif args.first_hour_step:
        results = {"check": [{"passed": first_hour_step(args.first_hour_step, args.first_hour_checkpoint, cfg, model_cfg,
                                                        device_type, device)}]}
    elif args.check:
        results = {"check": run_checks(cfg, model_cfg, device_type, device)}
        if rank == 0:
            print_checks(results["check"], device_type)
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

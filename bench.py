"""
Steady-state training throughput and MFU of a model config on the current device.

    python bench.py                          # train.py's default model
    python bench.py --n_layer=8 --n_embd=512 --json=bench.json
    python bench.py --bench_steps=20 --bench_windows=5

Runs the exact optimizer step train.py runs (same compile, autocast, optimizers) on random tokens,
excludes the first --bench_warmup steps (compilation), synchronises the device before reading each timer,
and reports the median and spread over several timed windows.

MFU = model FLOPs per token x tokens/s / peak FLOP/s. Model FLOPs per token is GPT.flops_per_token():
6 x matmul parameters + 12 x n_layer x n_head x head_dim x sequence_len (PaLM appendix B; attention at full,
non-causal length). Peak: the device's dense bf16 datasheet number (train.PEAK_FLOPS); a CPU has none, so
its peak is measured with a large matmul in the training dtype and labelled "measured".
"""
import argparse
import dataclasses
import json
import statistics
import sys
import time
from contextlib import nullcontext

import torch

import train
from model import GPT


def measure(cfg, model_cfg, steps, windows, warmup):
    device = train.detect_device() if cfg.device == "auto" else cfg.device
    torch.manual_seed(cfg.seed)
    raw_model = GPT(model_cfg).to(device)
    model = torch.compile(raw_model) if cfg.compile else raw_model
    optimizers = train.make_optimizers(raw_model, cfg, device)
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    autocast = torch.autocast(device, dtype=dtype) if cfg.dtype == "bfloat16" else nullcontext()
    shape = (cfg.batch_size, model_cfg.sequence_len)
    batch = [(torch.randint(0, model_cfg.vocab_size, shape), torch.randint(0, model_cfg.vocab_size, shape))]

    def run(n):
        for _ in range(n):
            train.train_step(model, raw_model, optimizers, batch, device, autocast, cfg.grad_clip)
        train.synchronize(device)

    t0 = time.perf_counter()
    run(warmup)
    warmup_s = time.perf_counter() - t0
    rates = []
    for _ in range(windows):
        t0 = time.perf_counter()
        run(steps)
        rates.append(steps * cfg.batch_size * model_cfg.sequence_len / (time.perf_counter() - t0))
    tokens_per_s = statistics.median(rates)
    flops_per_token = raw_model.flops_per_token()
    peak = train.peak_flops(device, dtype)
    return {
        "device": device,
        "peak_source": "measured matmul" if device == "cpu" else "datasheet",
        "params": raw_model.num_params(),
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_min": min(rates),
        "tokens_per_s_max": max(rates),
        "flops_per_token": flops_per_token,
        "flops_per_s": tokens_per_s * flops_per_token,
        "peak_flops": peak,
        "mfu": tokens_per_s * flops_per_token / peak,
        "warmup_s": warmup_s,
        "model_config": dataclasses.asdict(model_cfg),
    }


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Any train.py field is accepted as --field=value.")
    parser.add_argument("--bench_steps", type=int, default=10, help="optimizer steps per timed window")
    parser.add_argument("--bench_windows", type=int, default=3, help="timed windows (median reported)")
    parser.add_argument("--bench_warmup", type=int, default=3, help="untimed steps first (compilation)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args, rest = parser.parse_known_args(argv)
    cfg, model_cfg = train.parse_args(rest)
    model_cfg.vocab_size = train.data.get_tokenizer(cfg.tokenizer).n_vocab
    model_cfg.validate()
    r = measure(cfg, model_cfg, args.bench_steps, args.bench_windows, args.bench_warmup)
    print(f"device            {r['device']}")
    print(f"parameters        {r['params']:,}")
    print(f"tokens/s          {r['tokens_per_s']:,.0f}  (median of {args.bench_windows} windows of "
          f"{args.bench_steps} steps; min {r['tokens_per_s_min']:,.0f}, max {r['tokens_per_s_max']:,.0f})")
    print(f"FLOPs/token       {r['flops_per_token'] / 1e6:.2f} M  (6 x matmul params + 12 x L x H x d x T)")
    print(f"achieved FLOP/s   {r['flops_per_s'] / 1e12:.3f} T")
    print(f"peak FLOP/s       {r['peak_flops'] / 1e12:.3f} T  ({r['peak_source']})")
    print(f"MFU               {100 * r['mfu']:.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return r


if __name__ == "__main__":
    main(sys.argv[1:])

"""
`OMP_NUM_THREADS=1 python bench.py --ablation`: does each frontier lever train, and is it wired right? val_bpb
of the baseline, the frontier and the baseline with each lever alone, a few seeds each, on the CPU.
"""
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time

import torch

from kit import contest

# A small model on the built-in Shakespeare (bytes), fp32 on one CPU thread: a few minutes for all rows.
ABLATION_SHAPE = ["--n_layer=2", "--n_embd=64", "--n_head=2", "--n_kv_head=2", "--sequence_len=64", "--batch_size=8",
                  "--total_batch_tokens=2048", "--time_budget_s=0", "--eval_tokens=16384", "--sample_tokens=0",
                  "--compile=false", "--dtype=float32", "--device=cpu", "--log_every=100000", "--checkpoint_every=0"]
FULL_RUN_STEPS = 2400  # about what FrontierForge's 30-minute runs did, which the step-counted settings assume


def add_flags(parser):
    parser.add_argument("--ablation", action="store_true", help="val_bpb of baseline, frontier and each lever alone "
                        "(CPU; kit/ablation.py)")
    parser.add_argument("--ablation_seeds", type=int, default=3)
    parser.add_argument("--ablation_steps", type=int, default=80)


def ablation_rows(steps):
    """(name, train.py arguments) for the baseline, the frontier and the baseline with each lever alone. The
    settings counted in steps (Muon's momentum warm-up, the EMA's span) shrink with the run, so they cover
    the same share of it as in a full run; everything else is the presets' own values."""
    scale = steps / FULL_RUN_STEPS
    short = {"muon_momentum_warmup_steps": max(1, round(300 * scale))}
    short_ema = {"ema_every": max(1, round(32 * scale)), "ema_decay": round(0.99 ** (1 / scale), 4)}
    levers = contest.FRONTIER_LEVERS
    every = {name: contest.FRONTIER[name] for fields in levers.values() for name in fields}
    rows = [("baseline", {}), ("frontier", every)]
    rows += [(f"+ {lever}", {f: contest.FRONTIER[f] for f in fields}) for lever, fields in levers.items()]
    args = []
    for name, levers in rows:
        levers = {**levers, **short, **(short_ema if levers.get("ema_decay") else {})}
        levers.pop("batch_size", None)  # the ablation's shape fixes the micro-batch
        args.append((name, ["--preset=baseline", *(f"--{k}={v}" for k, v in levers.items())]))
    return args


def spread(values):
    return statistics.stdev(values) if len(values) > 1 else 0.0


def run_ablation(seeds, steps, train_main, extra=()):
    """val_bpb of every ablation row for each seed, each a run of `train_main` (train.py's main, handed in by
    bench.py, the program: nothing in kit/ imports train.py; extra: more train.py arguments for every run), as a
    markdown table of mean, spread and change from the baseline. It checks that each lever trains and is
    wired right at this scale; it measures nothing about Trn2, where the levers' gains were measured at far
    larger scale (docs/results.md, "Ablation")."""
    started = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory() as out:
        for row, (name, args) in enumerate(ablation_rows(steps)):
            for seed in range(1, seeds + 1):
                argv = [*args, *ABLATION_SHAPE, f"--max_steps={steps}", f"--seed={seed}",
                        f"--out_dir={os.path.join(out, f'{row}-{seed}')}", *extra]  # a fresh folder per run
                with contextlib.redirect_stdout(io.StringIO()):
                    final = train_main(argv)["final_eval"]["val_bpb"]
                results.setdefault(name, []).append(final)
            print(f"{name:>16}: {' '.join(f'{v:.4f}' for v in results[name])}", file=sys.stderr, flush=True)
    # a seed fixes the initialisation and the data order, so each row is compared with the baseline seed by seed
    print(f"| config | val_bpb (mean of {seeds} seeds) | sd | vs baseline, paired by seed (mean, sd) | per seed |")
    print("|---|---|---|---|---|")
    for name, values in results.items():
        deltas = [v - b for v, b in zip(values, results["baseline"])]
        delta = "" if name == "baseline" else f"{statistics.mean(deltas):+.4f} ({spread(deltas):.4f})"
        each = ", ".join(f"{v:.4f}" for v in values)
        print(f"| {name} | {statistics.mean(values):.4f} | {spread(values):.4f} | {delta} | {each} |")
    print(f"\n{seeds} seeds x {len(results)} configs, {steps} steps of 2,048 tokens each, in "
          f"{time.perf_counter() - started:.0f} s (torch.get_num_threads() = {torch.get_num_threads()})")
    return results


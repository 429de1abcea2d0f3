"""Calibration of the cost model and the schedule against public hardware timings of public NKI kernels.

Run by hand, not in CI (it needs checkouts, and takes minutes: the kernels run at their measured shapes):

    git clone https://github.com/aws-neuron/aws-neuron-sdk   # or any checkout / bare git dir of it
    git clone https://github.com/zhang677/AccelOpt              # NKIBench: 14 kernels timed on trn1
    OPENBLAS_NUM_THREADS=1 python -m nki_emulator.calibrate --sdk=aws-neuron-sdk --accelopt=AccelOpt --cache=traces \
        [--only=mamba]

(one BLAS thread: the kernels issue many small matmuls, which threads only slow down; about 15 minutes of one
core for the 13 SDK points, under two minutes for AccelOpt's 14, which are only traced; with --cache a second run
prices the kept traces again in a minute)

For each point it reads the kernel's source from the checkout (never copied into this repository: it goes to a
temporary folder and is imported from there), runs it under the emulator on the point's target and dtype at the
measured shape, and prints one row of the table in docs/results.md: measured, the overlap bound (busiest engine),
the schedule (nki_emulator._schedule) with the cost model as it is, the central estimate (the schedule with the
calibrated factors, _cost.CALIBRATED, plus its launches), the serial bound, and the central estimate's error.

The points: the tutorials' timings of kernels AWS publishes. The kernel-optimization tutorial's are in the NKI 0.6
dialect the emulator runs. The SDK 2.23 matrix-multiplication tutorial timed legacy-dialect kernels (nl.load /
nl.store / nl.matmul): the script runs the same algorithm as the SDK ports it to the 0.6 dialect at HEAD
(nki/examples/matrix_multiplication/matrix_multiplication_nki_kernels.py: same loops, tiles and blocks), a port by
AWS, not a rewrite here. The fused-mamba tutorial's kernels are traced as they were timed, in the legacy dialect at
tag v2.23.0 (HEAD's 0.6 port broadcasts B and C with extra matmuls and copies the timed kernels did not issue), by
nki_emulator.legacy_trace, which records their instructions without computing them. So are AccelOpt's NKIBench
kernels (zhang677/AccelOpt, profiled on trn1.32xlarge in fp32; their latencies, engine active times and HBM bytes in
experiments/full_complete_local/profile_results.csv; legacy dialect, mostly compiler-generated), each point's
inputs shaped by its NKIBench reference module.
"""

import argparse
import csv
import importlib.util
import inspect
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

import nki_emulator
from nki_emulator import legacy_trace
from nki_emulator._cost import _itemsize, estimate
from nki_emulator._schedule import central_estimate, schedule

SDK_TUTORIAL = "nki/guides/tutorials/kernel-optimization.rst"
SDK_MATMUL = "nki/examples/matrix_multiplication/matrix_multiplication_nki_kernels.py"
SDK_MAMBA = "v2.23.0:general/nki/examples/fused_mamba/mamba_nki_kernels.py"  # the legacy kernels the tutorial timed
KOPT = ("aws-neuron-sdk nki/guides/tutorials/kernel-optimization.rst, profile of version {} "
        "(nki/img/how-to/v{}-full.png, trn2, fp32)")
MM223 = ("aws-neuron-sdk v2.23.0 general/nki/tutorials/matrix_multiplication.rst, latency table ({}; trn1.32xlarge, "
         "bf16)")
MAMBA = "aws-neuron-sdk nki/guides/tutorials/fused_mamba.rst ({})"

# kernel, source, hardware, (file, function or code-block index), shape, dtype, measured seconds
POINTS = [
    *[dict(kernel=f"matmul v{v} ({what})", source=KOPT.format(v, v), hardware="trn2", code=("rst", v - 1),
           shape=dict(M=4096, K=8192, N=8192), dtype="float32", measured_s=ms * 1e-3)
      for v, what, ms in ((2, "tiled", 39.89), (3, "hoisted loads", 28.20), (4, "blocked M, N", 28.41),
                          (5, "blocked M, N, K", 28.30))],
    *[dict(kernel=f"matmul {name.strip('_')}", source=MM223.format(row), hardware="trn1", code=("matmul", name),
           shape=dict(M=4096, K=8192, N=8192), dtype="bfloat16", measured_s=ms * 1e-3)
      for name, row, ms in (("nki_matmul_tiled_", "Original Tiled", 51.80),
                            ("nki_matmul_hoist_load_", "Optimization 1", 42.96),
                            ("nki_matmul_block_free_dimension_", "Optimization 2", 22.07),
                            ("nki_matmul_fully_optimized_", "Optimization 3", 6.97))],
    *[dict(kernel=kernel, source=MAMBA.format(what), hardware="trn1", code=("legacy", SDK_MAMBA, kernel),
           shape=dict(batch=1, channels=channels, seq_len=seq_len, state=16), dtype="float32", measured_s=seconds)
      for kernel, what, channels, seq_len, seconds in (
          ("mamba_v1", "toy example: 172.93 usec", 256, 512, 172.93e-6),
          ("mamba_v1", "4K channels: 2.34 ms", 4096, 512, 2.34e-3),
          ("mamba_v2", "loop reordering, 4K channels: 1.61 ms", 4096, 512, 1.61e-3),
          ("mamba_v3", "scaling table, seq_len 2048: 6.6 ms", 4096, 2048, 6.6e-3),
          ("mamba_v3", "scaling table, seq_len 4096: 13.3 ms", 4096, 4096, 13.3e-3))],
]


ACCELOPT_PROFILE = "experiments/full_complete_local/profile_results.csv"


def accelopt_points(repo):
    """One point per row of AccelOpt's profile table: the kernel it names, timed on trn1 (fp32), with the profile's
    engine active times and HBM bytes for the second table."""
    references = _git(repo, "ls-tree", "--name-only", "HEAD", "NKIBench/reference/").split()
    points = []
    for row in csv.DictReader(_git_show(repo, f"HEAD:{ACCELOPT_PROFILE}").splitlines()):
        profile, kernel = json.loads(row["profile"]), "NKIBench/" + row["kernel"].split("NKIBench/./")[1]
        stem = kernel.rsplit("/", 1)[1].rsplit("_0.py", 1)[0]
        reference = next(r for r in references if r.rsplit("/", 1)[1].startswith(f"{stem}_numpy_"))
        latency = profile["latency"] * 1e-3
        points.append(dict(kernel=row["problem"], source=f"[AO] {row['case_name']}", hardware="trn1",
                           code=("accelopt", kernel, reference), shape=json.loads(row["values"]), dtype="float32",
                           measured_s=latency,
                           measured_engines_s={e: profile[f"{name}_engine_active_time_percent"] * latency
                                               for e, name in (("vector", "vector"), ("scalar", "scalar"))},
                           measured_hbm_bytes=profile["hbm_read_bytes"] + profile["hbm_write_bytes"],
                           measured_spill_bytes=profile["spill_save_bytes"] + profile["spill_reload_bytes"]))
    return points


def _git(repo, *args):
    git_dir = os.path.join(repo, ".git") if os.path.isdir(os.path.join(repo, ".git")) else repo
    return subprocess.run(["git", "--git-dir", git_dir, *args], check=True, capture_output=True, text=True).stdout


def _git_show(repo, revision_path):
    return _git(repo, "show", revision_path)


def _import(source, name, folder):
    path = os.path.join(folder, f"{name}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rst_kernels(rst):
    """The tutorial's code blocks that define a jit kernel, dedented, in order."""
    blocks = re.findall(r"\.\. code-block:: python\n\n((?:[ \t]+.*\n|\n)+)", rst)
    kernels = []
    for block in blocks:
        lines = block.splitlines()
        indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
        code = "\n".join(line[indent:] for line in lines)
        if "@nki.jit" in code:
            kernels.append(code)
    return kernels


def load_kernel(code, sdk, folder):
    kind, which = code
    if kind == "rst":
        return _import(_rst_kernels(_git_show(sdk, f"HEAD:{SDK_TUTORIAL}"))[which], f"kopt_{which}", folder) \
            .matrix_multiply_kernel
    return getattr(_import(_git_show(sdk, f"HEAD:{SDK_MATMUL}"), kind, folder), which)


def inputs(point):
    dtype = nki_emulator.language.bfloat16 if point["dtype"] == "bfloat16" else np.float32
    rng = np.random.default_rng(0)
    s = point["shape"]
    if "M" in s:
        return [rng.random((s["K"], s["M"]), np.float32).astype(dtype), rng.random((s["K"], s["N"]), np.float32)
                .astype(dtype)]
    b, c, t, n = s["batch"], s["channels"], s["seq_len"], s["state"]
    return [rng.random((b, c, t), np.float32) * 0.1, rng.random((b, c, t), np.float32), -rng.random((c, n), np.float32),
            rng.random((b, n, t), np.float32), rng.random((b, n, t), np.float32)]


def legacy_trace_of(point, sources, folder):
    """The trace of a legacy-dialect kernel (nki_emulator.legacy_trace): the SDK tutorial's own (on the point's
    inputs) or an NKIBench kernel (on inputs its reference module makes, numpy only)."""
    kind, *where = point["code"]
    if kind == "legacy":
        revision_path, function = where
        return legacy_trace.run(_git_show(sources["sdk"], revision_path), inputs(point), point["hardware"],
                                function=function), ""
    kernel, reference = where
    module = _import(_git_show(sources["accelopt"], f"HEAD:{reference}"), "nkibench_reference", folder)
    arrays = module.get_inputs()
    if hasattr(module, "transform_to_nki_inputs"):
        arrays = module.transform_to_nki_inputs(arrays)
    return legacy_trace.run(_git_show(sources["accelopt"], f"HEAD:{kernel}"), arrays, point["hardware"]), ""


def trace_of(point, sources, folder, cache):
    """The point's trace and a note on what the emulator refused once it was whole; kept in `cache` (a folder) when
    given, so that the table can be priced again (other factors) without running the kernels again. ``sources``:
    {"sdk": checkout, "accelopt": checkout}."""
    traced = point["code"][0] in ("legacy", "accelopt")  # by legacy_trace, not run
    name = f"{'legacy_' if traced else ''}{point['kernel']}_{point['shape']}"
    path = cache and os.path.join(cache, re.sub(r"\W+", "_", name) + ".pkl")
    if path and os.path.exists(path):
        with open(path, "rb") as f:
            return pickle.load(f)
    if traced:
        result = legacy_trace_of(point, sources, folder)
        if path:
            os.makedirs(cache, exist_ok=True)
            with open(path, "wb") as f:
                pickle.dump(result, f)
        return result
    kernel = load_kernel(point["code"], sources["sdk"], folder)
    fn = getattr(kernel, "fn", kernel)
    defaults = {p.name: p.default for p in inspect.signature(fn).parameters.values() if p.default is not p.empty}
    previous = nki_emulator.set_target(point["hardware"])
    try:
        with nki_emulator.counting() as counts:
            try:
                kernel(*inputs(point), **defaults)  # the emulator's jit, as KLR, applies no defaults: pass them
                note = ""
            except nki_emulator.NkiValidationError as e:
                # Raised only once the kernel has run, its trace whole: a private-HBM output (the tutorial's nl.hbm)
                # or the emulator's SBUF accounting (every tile live from first to last use, none reused), which
                # the compiler's allocator, reusing buffers, does not share. Neither changes what is priced.
                if not any(why in str(e) for why in ("outputs must be allocated", "per partition of live tiles")):
                    raise
                note = str(e).split(";")[0]
    finally:
        nki_emulator.set_target(previous)
    if path:
        os.makedirs(cache, exist_ok=True)
        with open(path, "wb") as f:
            pickle.dump((counts.trace, note), f)
    return counts.trace, note


def price(point, trace, note):
    bounds = estimate(trace, point["hardware"])
    return {"overlap_s": bounds["estimate_s"], "serial_s": bounds["serial_s"], "bottleneck": bounds["bottleneck"],
            "engines_s": bounds["engines"], "scheduled_s": schedule(trace, point["hardware"])["scheduled_s"],
            "central_s": central_estimate(trace, point["hardware"])["central_s"], "instructions": len(trace),
            "source_hbm_bytes": sum(i.partitions * i.free * _itemsize(i.dtypes[0]) for i in trace
                                    if i.engine == "dma"), "note": note}


def table(rows):
    lines = ["| kernel | source | hw | shape | dtype | measured | overlap | scheduled | central | serial | central / "
             "measured |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shape = "x".join(str(v) for v in r["shape"].values())
        times = " | ".join(f"{1e3 * r[k]:.3f}" for k in ("measured_s", "overlap_s", "scheduled_s", "central_s",
                                                           "serial_s"))
        lines.append(f"| {r['kernel']} | {r['source']} | {r['hardware']} | {shape} | {r['dtype']} | {times} | "
                     f"{r['central_s'] / r['measured_s']:.2f} |")
    within = sum(abs(r["central_s"] / r["measured_s"] - 1) <= 0.25 for r in rows)
    lines.append(f"\n{within} of {len(rows)} central estimates within 25% of the measured time (times in ms)")
    profiled = [r for r in rows if "measured_engines_s" in r]
    if profiled:  # AccelOpt's profiles also say how long VectorE and ScalarE were active and what crossed HBM
        lines += ["", "| kernel | VectorE: model / active (ms) | ScalarE: model / active (ms) | HBM MB: source / "
                  "profile (spilled) |", "|---|---|---|---|"]
        for r in profiled:
            engines = " | ".join(f"{1e3 * r['engines_s'][e]:.3f} / {1e3 * r['measured_engines_s'][e]:.3f}"
                                 for e in ("vector", "scalar"))
            lines.append(f"| {r['kernel']} | {engines} | {r['source_hbm_bytes'] / 1e6:.0f} / "
                         f"{r['measured_hbm_bytes'] / 1e6:.0f} ({r['measured_spill_bytes'] / 1e6:.0f}) |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdk", default="", help="a checkout (or bare git dir) of aws-neuron/aws-neuron-sdk")
    parser.add_argument("--accelopt", default="", help="a checkout (or bare git dir) of zhang677/AccelOpt")
    parser.add_argument("--only", default="", help="run only the points whose kernel name contains this")
    parser.add_argument("--json", default="", help="also write the rows here")
    parser.add_argument("--cache", default="", help="a folder to keep each point's trace in (pickle), so that a "
                        "second run prices them again without running the kernels")
    args = parser.parse_args(argv)
    if not (args.sdk or args.accelopt):
        parser.error("give --sdk=<aws-neuron-sdk checkout>, --accelopt=<AccelOpt checkout>, or both")
    nki_emulator.install()
    points = (POINTS if args.sdk else []) + (accelopt_points(args.accelopt) if args.accelopt else [])
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for point in points:
            if args.only not in point["kernel"]:
                continue
            started = time.time()
            rows.append({**point, **price(point, *trace_of(point, vars(args), folder, args.cache))})
            print(f"{point['kernel']} {point['shape']}: {time.time() - started:.0f} s to emulate", file=sys.stderr)
            if args.json:  # after each point: a long run keeps what it has
                with open(args.json, "w") as f:
                    json.dump([{k: v for k, v in r.items() if k != "code"} for r in rows], f, indent=1)
    print(table(rows))
    if any(point["code"][0] in ("legacy", "accelopt") for point in rows):
        print("\nThe legacy-dialect kernels were traced, not run (nki_emulator/legacy_trace.py), assuming:")
        print("\n".join(f"- {assumption}" for assumption in legacy_trace.ASSUMPTIONS))


if __name__ == "__main__":
    main()

"""Calibration of the cost model and the schedule against public hardware timings of public NKI kernels.

Run by hand, not in CI (it needs checkouts, and takes minutes: the kernels run at their measured shapes):

    git clone https://github.com/aws-neuron/aws-neuron-sdk   # or any checkout / bare git dir of it
    git clone https://github.com/zhang677/AccelOpt              # NKIBench: 14 kernels timed on trn1
    OPENBLAS_NUM_THREADS=1 python -m nki_emulator.calibrate --sdk=aws-neuron-sdk --accelopt=AccelOpt --cache=traces \
        [--only=mamba]

(one BLAS thread: the kernels issue many small matmuls, which threads only slow down; about 15 minutes of one
core for the 13 SDK points and the fused-mamba scaling table's 17 rows, under two minutes for AccelOpt's 14, which
are only traced; with --cache a second run prices the kept traces again in a minute)

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
import ast
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
from nki_emulator._memory import DTYPES
from nki_emulator._schedule import schedule_figures

SDK_TUTORIAL = "nki/guides/tutorials/kernel-optimization.rst"
SDK_MATMUL = "nki/examples/matrix_multiplication/matrix_multiplication_nki_kernels.py"
SDK_MAMBA = "v2.23.0:general/nki/examples/fused_mamba/mamba_nki_kernels.py"  # the legacy kernels the tutorial timed
KOPT = ("aws-neuron-sdk nki/guides/tutorials/kernel-optimization.rst, profile of version {} "
        "(nki/img/how-to/v{}-full.png, trn2, fp32)")
MM223 = ("aws-neuron-sdk v2.23.0 general/nki/tutorials/matrix_multiplication.rst, latency table ({}; trn1.32xlarge, "
         "bf16)")
MAMBA = "aws-neuron-sdk nki/guides/tutorials/fused_mamba.rst ({})"
FM_TRACE = "[FM] mamba v1 -> v2 (4K channels), v2 -> v3 (seq_len 8192)"
SCALING = "the fused-mamba tutorial's scaling table"


def _mamba_point(kernel, what, channels, seq_len, seconds, trace=None, section=None):
    """A timing of the fused-mamba tutorial's kernels: traced as timed (legacy dialect, tag v2.23.0), fp32, trn1."""
    return dict(kernel=kernel, source=MAMBA.format(what), hardware="trn1", code=("legacy", SDK_MAMBA, kernel),
                shape=dict(batch=1, channels=channels, seq_len=seq_len, state=16), dtype="float32",
                measured_s=seconds, trace=trace, section=section)


# The fused-mamba tutorial's scaling table, every row (l. 861-923: 4K channels, seq_len 512 to 8192, mamba_v2 and
# mamba_v3; v2 at 512 is the 1.61 ms point below), counted apart (SCALING_POINTS): two kernels at nine lengths would
# outweigh every other kernel of the table; POINTS takes v3 at 2048 and 4096 from it. It checks the spill model
# where the tutorial says v2 spills as seq_len grows ("severe fragmentation in SBUF and excessive data movements to
# spill/reload", l. 769-771) and v3 does not. The tutorial's last optimisation step, v2 -> v3 at seq_len 8192 ("48%
# reduction in latency compared to no seq_len tiling"), is the second step of the [FM] trace.
MAMBA_SCALING = {"mamba_v2": {1024: 4.4, 2048: 8.9, 3072: 13.1, 4096: 17.6, 5120: 23.7, 6144: 27.5, 7168: 41.3,
                              8192: 52.2},
                 "mamba_v3": {512: 1.6, 1024: 3.3, 2048: 6.6, 3072: 10.1, 4096: 13.3, 5120: 17.3, 6144: 19.6,
                              7168: 24.2, 8192: 27.8}}


def _scaling_point(kernel, seq_len, trace=None, section=None):
    """A row of the fused-mamba tutorial's scaling table (4K channels)."""
    ms = MAMBA_SCALING[kernel][seq_len]
    return _mamba_point(kernel, f"scaling table, seq_len {seq_len}: {ms} ms", 4096, seq_len, ms * 1e-3, trace, section)


# kernel, source, hardware, (file, function or code-block index), shape, dtype, measured seconds
POINTS = [
    *[dict(kernel=f"matmul v{v} ({what})", source=KOPT.format(v, v), hardware="trn2", code=("rst", v - 1),
           shape=dict(M=4096, K=8192, N=8192), dtype="float32", measured_s=ms * 1e-3, trace="[KO] matmul v2-v5")
      for v, what, ms in ((2, "tiled", 39.89), (3, "hoisted loads", 28.20), (4, "blocked M, N", 28.41),
                          (5, "blocked M, N, K", 28.30))],
    *[dict(kernel=f"matmul {name.strip('_')}", source=MM223.format(row), hardware="trn1", code=("matmul", name),
           shape=dict(M=4096, K=8192, N=8192), dtype="bfloat16", measured_s=ms * 1e-3, trace="[MM] matmul")
      for name, row, ms in (("nki_matmul_tiled_", "Original Tiled", 51.80),
                            ("nki_matmul_hoist_load_", "Optimization 1", 42.96),
                            ("nki_matmul_block_free_dimension_", "Optimization 2", 22.07),
                            ("nki_matmul_fully_optimized_", "Optimization 3", 6.97))],
    *[_mamba_point(kernel, what, channels, seq_len, seconds, trace=FM_TRACE if channels == 4096 else None)
      for kernel, what, channels, seq_len, seconds in (
          ("mamba_v1", "toy example: 172.93 usec", 256, 512, 172.93e-6),
          ("mamba_v1", "4K channels: 2.34 ms", 4096, 512, 2.34e-3),
          ("mamba_v2", "loop reordering, 4K channels: 1.61 ms", 4096, 512, 1.61e-3))],
    *[_scaling_point("mamba_v3", seq_len) for seq_len in (2048, 4096)],
]

SCALING_POINTS = [_scaling_point(kernel, seq_len, trace=FM_TRACE if seq_len == 8192 else None, section=SCALING)
                  for kernel, row in MAMBA_SCALING.items() for seq_len in row]


SAMPLES_REVISION = "fc5c69f^"  # aws-neuron/nki-samples, the last commit with its performance thresholds
SAMPLES = "[NS] {}: {}"  # aws-neuron/nki-samples test/unit/<file> at SAMPLES_REVISION


def _samples_point(kernel, test, threshold, file, function, shapes, dtype, hardware="trn1", extra=(), **bounds):
    """A threshold of nki-samples' performance tests: `assert latency <= threshold` (a bound, not a measurement).
    ``low_s`` (where given): the bound before the commit that raised it after a run went over it, so that the run
    lies in (low_s, high_s]; without it, only high_s is known."""
    return dict(kernel=kernel, source=SAMPLES.format(test, threshold), hardware=hardware,
                code=("samples", f"src/nki_samples/reference/{file}", function, shapes, dtype, extra),
                shape=dict(zip("abcd", shapes[0])), dtype="/".join(dict.fromkeys(np.atleast_1d(dtype))), **bounds)


# The thresholds (microseconds, nc_latency): test file, parameters and the assert, at SAMPLES_REVISION; each raised
# bound names the commit that raised it. The suite's perf tests ran on trn1 (test_double_row_matmul.py carried
# `xfail(fail=['trn1'])` from a5e9d8c, then returned early off trn2, 97d5adb); no instance is named for the others,
# so they are priced on trn1.
SD = "fused_self_attn_for_SD_small_head_size"
ALLOCATED = "allocated_fused_self_attn_for_SD_small_head_size"
SAMPLES_POINTS = [
    _samples_point("SD attention, small head", "test_SD_attention_small_head.py",
                   "p1 <= 1.05 x 675 us (600 before f80015e, 'the test fluctuate')", "attention.py", SD,
                   ((1, 128, 4096), (1, 4096, 128), (1, 4096, 128)), "float32", low_s=630e-6, high_s=708.75e-6),
    _samples_point("SD attention, small head", "test_SD_attention_small_head.py",
                   "p1 <= 1.05 x 536 us (480 before 87846b2)", "attention.py", SD,
                   ((1, 128, 4096), (1, 4096, 128), (1, 4096, 128)), "bfloat16", low_s=504e-6, high_s=562.8e-6),
    _samples_point("SD attention, small head", "test_SD_attention_small_head.py",
                   "p1 <= 1.05 x 600 us (520 before f80015e)", "attention.py", SD,
                   ((1, 64, 4096), (1, 4096, 64), (1, 4096, 64)), "float16", low_s=546e-6, high_s=630e-6),
    _samples_point("SD attention, allocated", "test_allocated_SD_attention_small_head.py",
                   "p50 <= 1.05 x 410 us", "allocated_attention.py", ALLOCATED,
                   ((1, 128, 4096), (1, 128, 4096), (1, 4096, 128)), "float32", high_s=430.5e-6),
    _samples_point("SD attention, allocated", "test_allocated_SD_attention_small_head.py",
                   "p50 <= 1.05 x 380 us (350 before 3a99c91, 'Relax flaky latency checks')",
                   "allocated_attention.py", ALLOCATED, ((1, 128, 4096), (1, 128, 4096), (1, 4096, 128)), "bfloat16",
                   low_s=367.5e-6, high_s=399e-6),
    _samples_point("SD attention, allocated", "test_allocated_SD_attention_small_head.py",
                   "p50 <= 1.05 x 586 us", "allocated_attention.py", ALLOCATED,
                   ((1, 128, 5120), (1, 128, 5120), (1, 5120, 128)), "bfloat16", high_s=615.3e-6),
    *[_samples_point("fused RMSNorm + QKV", "test_rmsnorm_qkv.py", f"p50 <= {us} us", "allocated_fused_linear.py",
                     "allocated_fused_rms_norm_qkv", ((1, seqlen, dim), (dim, head)), dtype, high_s=us * 1e-6)
      for seqlen, dim, head, dtype, us in ((128, 512, 512, "float16", 25), (512, 1024, 384, "bfloat16", 40),
                                           (128, 1024, 512, "bfloat16", 28))],
    _samples_point("double-row fp8 matmul", "test_double_row_matmul.py", "p99 <= 320 us, trn2 only",
                   "double_row_matmul.py", "quantized_double_row_matmul",
                   ((512, 16384), (8192, 2048), (128, 1024)), ("bfloat16", "float8_e4m3", "bfloat16"),
                   hardware="trn2", extra=(2, 2, 16), high_s=320e-6),
]
for _point in SAMPLES_POINTS:  # a bracket is priced against its middle; a bare bound has no measured time
    _point["measured_s"] = (_point["low_s"] + _point["high_s"]) / 2 if "low_s" in _point else None

AUTOCOMP_TRACE = "examples/trn-tutorial/5_sd_attention_trace.py"
# the harness it ran under (harnesses/trn-tutorial-nki1/5_sdattention_test.py): these imports, q, k, v of
# (4096, 64) float32, the kernel's defaults (bf16 matmuls), p99 of nc_latency; trn1, as the README configures
# the trn-tutorial-nki1 problems (TrnHardwareConfig("trn1.2xlarge"))
AUTOCOMP_HEADER = ("import numpy as np\nimport neuronxcc.nki as nki\nimport neuronxcc.nki.language as nl\n"
                   "import neuronxcc.nki.isa as nisa\nfrom neuronxcc.nki.language import par_dim\n")


def autocomp_points(repo):
    """One point per step of autocomp's SD-attention optimisation trace: the step's kernel and its measured p99
    latency (the trace's `score`, ms), in the order the search took them."""
    node = ast.parse(_git_show(repo, f"HEAD:{AUTOCOMP_TRACE}"), mode="eval").body
    steps = []
    while isinstance(node, ast.Call):  # CodeCandidate(parent=..., code=..., score=...), the newest outermost
        fields = {k.arg: k.value for k in node.keywords}
        steps.append((ast.literal_eval(fields["code"]), ast.literal_eval(fields["score"])))
        node = fields["parent"]
    return [dict(kernel=f"SD attention, step {i}", source=f"[AC] step {i}", hardware="trn1",
                 code=("autocomp", code), shape=dict(seqlen=4096, d_head=64), dtype="float32",
                 measured_s=score * 1e-3, trace="[AC] SD attention")
            for i, (code, score) in enumerate(reversed(steps))]


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


def _zeros(shapes, dtypes):
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,) * len(shapes)
    return [np.zeros(shape, DTYPES[dtype]) for shape, dtype in zip(shapes, dtypes)]


def legacy_trace_of(point, sources, folder):
    """The trace of a legacy-dialect kernel (nki_emulator.legacy_trace): the SDK tutorial's own (on the point's
    inputs), an nki-samples kernel or an autocomp step (on inputs shaped as their tests shape them) or an NKIBench
    kernel (on inputs its reference module makes, numpy only)."""
    kind, *where = point["code"]
    if kind == "samples":
        path, function, shapes, dtypes, extra = where
        return legacy_trace.run(_git_show(sources["samples"], f"{SAMPLES_REVISION}:{path}"),
                                _zeros(shapes, dtypes) + list(extra), point["hardware"], function=function), ""
    if kind == "autocomp":
        return legacy_trace.run(AUTOCOMP_HEADER + where[0], _zeros([(4096, 64)] * 3, "float32"), point["hardware"],
                                function="test"), ""
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


LEGACY_KINDS = ("legacy", "accelopt", "samples", "autocomp")
# in a cached trace's name: traces kept before their rectangles named SBUF tiles (SbufTile) would be priced
# without the spill model's transfers, so they are not read back
TRACE_FORMAT = "_sbuf_tiles"


def trace_of(point, sources, folder, cache):
    """The point's trace and a note on what the emulator refused once it was whole; kept in `cache` (a folder) when
    given, so that the table can be priced again (other factors) without running the kernels again. ``sources``:
    {"sdk": checkout, "accelopt": checkout}."""
    traced = point["code"][0] in LEGACY_KINDS  # by legacy_trace, not run
    name = f"{'legacy_' if traced else ''}{point['kernel']}_{point['shape']}_{point['dtype']}"
    path = cache and os.path.join(cache, re.sub(r"\W+", "_", name) + TRACE_FORMAT + ".pkl")
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
    bounds, figures = estimate(trace, point["hardware"]), schedule_figures(trace, point["hardware"])
    priced = {"overlap_s": bounds["estimate_s"], "serial_s": bounds["serial_s"], "bottleneck": bounds["bottleneck"],
              "engines_s": bounds["engines"], "scheduled_s": figures["scheduled_s"], "central_s": figures["central_s"],
              "pessimistic_s": figures["pessimistic_s"], "instructions": len(trace),
              "source_hbm_bytes": sum(i.partitions * i.free * _itemsize(i.dtypes[0]) for i in trace
                                      if i.engine == "dma"), "note": note,
              "spilled_bytes": figures["spilled_bytes"]["spill_store"] + figures["spilled_bytes"]["spill_reload"],
              "refetched_bytes": figures["spilled_bytes"]["refetch"]}
    return priced


def _measured(r):
    """The measured column: a time, the bracket a raised bound leaves, or a bare bound."""
    if "low_s" in r:
        return f"{1e3 * r['low_s']:.3f}-{1e3 * r['high_s']:.3f}"
    return f"{1e3 * r['measured_s']:.3f}" if r["measured_s"] else f"<= {1e3 * r['high_s']:.3f}"


def table(rows):
    """The points' table and its count, then each section's (points counted apart: `section`), the optimisation
    traces' signs over all of them, and AccelOpt's profiles beside the model's engines and bytes."""
    lines = _rows_table([r for r in rows if not r.get("section")])
    for section in dict.fromkeys(r["section"] for r in rows if r.get("section")):
        lines += ["", f"{section}, counted apart:", ""] + _rows_table([r for r in rows if r.get("section") == section])
    lines += trace_signs(rows, "central_s")
    profiled = [r for r in rows if "measured_engines_s" in r]
    if profiled:  # AccelOpt's profiles also say how long VectorE and ScalarE were active and what crossed HBM
        lines += ["", "| kernel | VectorE: model / active (ms) | ScalarE: model / active (ms) | HBM MB: source / "
                  "profile (spilled) | spilled MB: model / profile | refetched MB: model |",
                  "|---|---|---|---|---|---|"]
        for r in profiled:
            engines = " | ".join(f"{1e3 * r['engines_s'][e]:.3f} / {1e3 * r['measured_engines_s'][e]:.3f}"
                                 for e in ("vector", "scalar"))
            lines.append(f"| {r['kernel']} | {engines} | {r['source_hbm_bytes'] / 1e6:.0f} / "
                         f"{r['measured_hbm_bytes'] / 1e6:.0f} ({r['measured_spill_bytes'] / 1e6:.0f}) | "
                         f"{r['spilled_bytes'] / 1e6:,.0f} / {r['measured_spill_bytes'] / 1e6:,.0f} | "
                         f"{r['refetched_bytes'] / 1e6:,.0f} |")
    return "\n".join(lines)


def _rows_table(rows):
    lines = ["| kernel | source | hw | shape | dtype | measured | overlap | scheduled | central | program order | "
             "serial | central / measured |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shape = "x".join(str(v) for v in r["shape"].values())
        times = " | ".join(f"{1e3 * r[k]:.3f}" for k in ("overlap_s", "scheduled_s", "central_s", "pessimistic_s",
                                                           "serial_s"))
        ratio = f"{r['central_s'] / r['measured_s']:.2f}" if r["measured_s"] else \
            f"{r['central_s'] / r['high_s']:.2f} of the bound"
        lines.append(f"| {r['kernel']} | {r['source']} | {r['hardware']} | {shape} | {r['dtype']} | {_measured(r)} | "
                     f"{times} | {ratio} |")
    return lines + ["\n(times in ms; a bracket is priced against its middle)"] + summary(rows, "central_s")


def summary(rows, key):
    """How many of the ``key`` estimates are within 25% of the measured times and at most 1.25x the bare bounds."""
    timed, bounds = [r for r in rows if r["measured_s"]], [r for r in rows if not r["measured_s"]]
    within = sum(abs(r[key] / r["measured_s"] - 1) <= 0.25 for r in timed)
    lines = [f"{within} of {len(timed)} {key[:-2]} estimates within 25% of the measured time"]
    if bounds:
        under = sum(r[key] <= 1.25 * r["high_s"] for r in bounds)
        lines.append(f"{under} of {len(bounds)} {key[:-2]} estimates at most 1.25x the bound where only a bound is "
                     "known")
    return lines


SAME = 0.005  # a modelled change under 0.5% is no change: it has neither sign


def trace_signs(rows, key="central_s"):
    """For each optimisation trace (points sharing a `trace`, in order): each step's measured and modelled change,
    and how many modelled changes have the measured change's sign. A step is a kernel and the next one at the same
    shape: a trace may go on at another shape ([FM]'s v2 -> v3 was timed at seq_len 8192), which is not a step."""
    lines = []
    for name in dict.fromkeys(r["trace"] for r in rows if r.get("trace")):
        points = [r for r in rows if r.get("trace") == name]
        steps = [(a, b) for a, b in zip(points, points[1:]) if a["shape"] == b["shape"]]
        lines += ["", f"{name}: step | measured change | {key[:-2]} change | same sign", "|---|---|---|---|"]
        right = 0
        for before, after in steps:
            measured = after["measured_s"] / before["measured_s"] - 1
            modelled = after[key] / before[key] - 1
            same = abs(modelled) >= SAME and np.sign(measured) == np.sign(modelled)
            right += same
            lines.append(f"| {after['kernel']} | {100 * measured:+.1f}% | {100 * modelled:+.1f}% | "
                         f"{'yes' if same else 'no'} |")
        lines.append(f"{right} of {len(steps)} changes with the measured sign")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdk", default="", help="a checkout (or bare git dir) of aws-neuron/aws-neuron-sdk")
    parser.add_argument("--accelopt", default="", help="a checkout (or bare git dir) of zhang677/AccelOpt")
    parser.add_argument("--samples", default="", help="a checkout (or bare git dir) of aws-neuron/nki-samples")
    parser.add_argument("--autocomp", default="", help="a checkout (or bare git dir) of ucb-bar/autocomp")
    parser.add_argument("--only", default="", help="run only the points whose kernel name contains this")
    parser.add_argument("--json", default="", help="also write the rows here")
    parser.add_argument("--cache", default="", help="a folder to keep each point's trace in (pickle), so that a "
                        "second run prices them again without running the kernels")
    args = parser.parse_args(argv)
    if not (args.sdk or args.accelopt or args.samples or args.autocomp):
        parser.error("give one or more of --sdk=<aws-neuron-sdk checkout>, --accelopt=<AccelOpt checkout>, "
                     "--samples=<nki-samples checkout>, --autocomp=<autocomp checkout>")
    nki_emulator.install()
    points = ((POINTS + SCALING_POINTS if args.sdk else [])
              + (accelopt_points(args.accelopt) if args.accelopt else [])
              + (SAMPLES_POINTS if args.samples else []) + (autocomp_points(args.autocomp) if args.autocomp else []))
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
    if any(point["code"][0] in LEGACY_KINDS for point in rows):
        print("\nThe legacy-dialect kernels were traced, not run (nki_emulator/legacy_trace.py), assuming:")
        print("\n".join(f"- {assumption}" for assumption in legacy_trace.ASSUMPTIONS))


if __name__ == "__main__":
    main()

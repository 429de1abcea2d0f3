"""
Does this machine's inductor miscompile two 16-bit transposes fused into one C++ kernel? PyTorch's inductor
(2.13, 2.14) gets ~96% of the values wrong on some AVX512 CPUs: a PyTorch bug (the same transposed-tile fast
path was disabled for BF16 on SVE256 for correctness: pytorch/pytorch#173190), which the kit keeps out of its
own compiled graphs, but a user's own compiled code may meet. Workaround: torch._inductor.config.cpp.simdlen =
256 (docs/troubleshooting.md).

`inductor_transpose_line()` runs the repro in a fresh interpreter, so that its answer depends on neither what
the calling process compiled before (dynamo's caches, inductor's settings) nor a compile worker pool on a busy
CPU; `python kit/inductor_probe.py` is that interpreter.
"""
import os
import subprocess
import sys

PROBE_TIMEOUT_S = 600  # one small compile takes a few seconds; a CPU shared with other work may take far longer
RIGHT = "inductor: fused bf16 transposes compile right on this CPU (the kit avoids the pattern anyway)"


def _two_transposes(a, b):
    return a.view(4, 256, 64).transpose(-1, -2).contiguous(), b.view(4, 256, 64).transpose(-1, -2).contiguous()


def _probe():
    import torch

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
    return RIGHT


def inductor_transpose_line(timeout_s=PROBE_TIMEOUT_S):
    """One line, starting "inductor: ", with the repro's answer from a fresh interpreter; one C++ compile
    thread, so that no compile worker pool is started."""
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    try:
        done = subprocess.run([sys.executable, os.path.abspath(__file__)], capture_output=True, text=True,
                              timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return f"inductor: the fused bf16 transpose repro could not run here (no answer in {timeout_s} s)"
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"inductor: the fused bf16 transpose repro could not run here (exit code {done.returncode}: {why})"
    return lines[-1]


if __name__ == "__main__":
    print(_probe())

"""The parts of the kit a learner need not read to follow a training step, one room per concern: the contest's
contract and presets (contest.py); the one-file exporter (export.py); flags and config checks (flags.py); devices, ranks,
dtypes, peaks, the log and stop signals (runtime.py); the memory plan (memory.py); checkpoints, resume and the
output folder (checkpoint.py) and their bytes, digests and safe reading (checkpoint_io.py); the optimizers (optim.py);
the module a training step calls, built again where a kernel or the whole graph fails to build (build.py); and the
programs bench.py runs beside its measurements, none of which imports train.py (bench.py hands them its step or
main): the device check (device_check.py, with inductor_probe.py), the first device session (first_hour.py), the
ablation (ablation.py), the sweep's files (sweep_files.py) and the step estimate's prices of compiled plain ops
(compiled_cost.py)."""
import os

# NKI_EMULATOR=1: where the Neuron SDK is not installed, the kit's CPU emulator of NKI stands in for `nki` (as in the
# tests), so that --kernels=nki trains on a laptop (docs/kernels.md). Here because every entry point imports kit/
# before kernels.py imports `nki`, and because the one-file submission, which has no emulator, leaves this file out.
if os.environ.get("NKI_EMULATOR") == "1":
    import nki_emulator

    nki_emulator.install()

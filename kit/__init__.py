"""The parts of the kit a learner need not read to follow a training step, one room per concern: the contest's
contract and presets (contest.py); the one-file exporter (export.py); flags and config checks (flags.py); devices, ranks,
dtypes, peaks, the log and stop signals (runtime.py); the memory plan (memory.py); checkpoints, resume and the
output folder (checkpoint.py) and their bytes, digests and safe reading (checkpoint_io.py); the optimizers (optim.py);
and the programs bench.py runs beside its measurements: the device check (device_check.py, with inductor_probe.py), the
first device session (first_hour.py), the ablation (ablation.py), the sweep's files (sweep_files.py) and the step
estimate's prices of compiled plain ops (compiled_cost.py)."""

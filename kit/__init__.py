"""The parts of the kit a learner need not read to follow a training step, one room per concern: the contest's
contract, presets and the one-file exporter (contest.py); flags and config checks (flags.py); devices, ranks,
dtypes, peaks, the log and stop signals (runtime.py); the memory plan (memory.py); checkpoints, resume and the
output folder (checkpoint.py) and their bytes, digests and safe reading (checkpoint_io.py); and the optimizers (optim.py)."""

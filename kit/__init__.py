"""The parts of the kit a learner need not read to follow a training step: the contest's contract and the
one-file exporter (contest.py), flags, devices, checkpoints and fault handling (plumbing.py), and the
optimizers (optim.py). train.py imports them as `from kit import contest, optim, plumbing`."""

"""pytest setup: ``import nki`` gives the Neuron SDK where it is installed, else the CPU emulator."""
import os

# The emulator runs many small numpy matmuls; on 2 cores OpenBLAS's own threads fight torch's and make
# each ~5x slower. Must be set before numpy is first imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# The tests' models are tiny: one thread is faster than two that wait on each other, and unlike a team
# of spinning OpenMP threads it does not slow down 7x when something else is busy on the machine (measured
# on a loaded 2-core CPU: 54 s -> 8 s for the same test). Subprocesses inherit it. Before torch's import.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import nki_emulator  # noqa: E402

nki_emulator.install()

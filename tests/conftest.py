"""pytest setup: ``import nki`` gives the Neuron SDK where it is installed, else the CPU emulator."""
import os

# The emulator runs many small numpy matmuls; on 2 cores OpenBLAS's own threads fight torch's and make
# each ~5x slower. Must be set before numpy is first imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import nki_emulator  # noqa: E402

nki_emulator.install()

"""pytest setup: ``import nki`` gives the Neuron SDK where it is installed, else the CPU emulator."""
import nki_emulator

nki_emulator.install()

"""The kill matrix: deliberately wrong variants of the kit's own NKI kernels, each of which the kernel
tests and `bench.py --check` must catch (docs/kernels.md has the table).

The faults are injected at the instruction level, not by editing kernel source: for the duration of a run
each one wraps an emulator instruction (nki_emulator.isa, which kernels.py reaches as `nisa`) and bends what
it does, the way a wrong kernel would. So they survive a rewrite of the kernels: whatever the attention, MLP
or RMSNorm kernel looks like, its last output write, its first matmul, its mask and its scales are found by
what the instructions do. Each fault counts the instructions it bent; a fault that bent nothing in a
kernel (the kernel no longer uses that instruction) fails the test instead of passing it silently, so the
matrix is revisited when a kernel changes.

The wrong variants:
- skipped_last_tile: the last DMA write into each output tensor of a program is undone (its region goes
  back to the NaN the emulator fills new HBM tensors with: "a kernel that forgot its ragged last tile").
- causal_mask_dropped: nisa.affine_select keeps every element (the mask builder becomes a copy).
- stale_psum: the first nc_matmul of each program accumulates onto what its PSUM tile already held
  (accumulate flipped to True over a tile holding that very product, as a loop that reuses a bank leaves it).
- wrong_scale: every ScalarE activation with a scalar scale other than 1 runs at twice that scale.
- half_dx_unwritten: a backward kernel writes only the first half of the rows of each write into its
  first output (dq, dx).
- swapped_op: the VectorE ALU op nl.maximum runs as nl.add (relu(x) = max(x, 0) becomes x).
"""
import contextlib
import importlib
from unittest import mock

import numpy as np
import pytest
import torch

import kernels
import nki_emulator
from kit import device_check
from nki_emulator import isa as emulated_isa
from nki_emulator import language as emulated_nl
from nki_emulator._memory import HBM

pytestmark = pytest.mark.skipif(kernels.nki is not nki_emulator, reason="injects faults into the CPU emulator")


class _Run:
    """What one fault needs to know while kernels run: the kernel of the current program and how many
    instructions the fault bent, per kernel."""

    def __init__(self):
        self.kernel = None
        self.hits = {}
        self.on_program_end = []
        self.program_state = {}

    def hit(self):
        self.hits[self.kernel] = self.hits.get(self.kernel, 0) + 1


@contextlib.contextmanager
def _tracking(run):
    """Patch the emulator so `run` knows which kernel each program belongs to and gets a call at the end
    of each program (before the outputs go back to the host)."""
    kernel_call, running = nki_emulator.Kernel.__call__, nki_emulator.running

    def call(self, *args, **kwargs):
        previous, run.kernel = run.kernel, self.fn.__name__
        try:
            return kernel_call(self, *args, **kwargs)
        finally:
            run.kernel = previous

    @contextlib.contextmanager
    def program(core):
        run.program_state = {}
        with running(core) as entered:
            yield entered
            for hook in run.on_program_end:
                hook()

    with mock.patch.object(nki_emulator.Kernel, "__call__", call), mock.patch.object(nki_emulator, "running", program):
        yield


def _is_output(tensor):
    """An HBM tensor the kernel allocated (its outputs); arguments come in initialised, without a mask."""
    return tensor.buffer in HBM and tensor._storage.written is not None


def skipped_last_tile(run):
    dma_copy = emulated_isa.dma_copy

    def copy(dst, src, *args, **kwargs):
        if _is_output(dst):  # remember what was there, so the program's last write into it can be undone
            run.program_state.setdefault("last", {})[id(dst._storage)] = (dst, dst._data.copy(), dst._written.copy())
        return dma_copy(dst, src, *args, **kwargs)

    def undo_last_writes():
        for dst, data, written in run.program_state.get("last", {}).values():
            dst._data[...], dst._written[...] = data, written
            run.hit()

    run.on_program_end.append(undo_last_writes)
    return [mock.patch.object(emulated_isa, "dma_copy", copy)]


def causal_mask_dropped(run):
    affine_select = emulated_isa.affine_select

    def keep_everything(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op=None, offset=0, **kw):
        run.hit()  # 0 >= 0 everywhere: dst = on_true_tile
        return affine_select(dst, [[0, count] for _, count in pattern], 0, on_true_tile, on_false_value,
                             cmp_op=emulated_nl.greater_equal, offset=0)

    return [mock.patch.object(emulated_isa, "affine_select", keep_everything)]


def stale_psum(run):
    nc_matmul = emulated_isa.nc_matmul

    def matmul(dst, stationary, moving, *args, **kwargs):
        if run.program_state.get("matmuls", 0) == 0 and dst.buffer is emulated_nl.psum:
            run.program_state["matmuls"] = 1
            nc_matmul(dst, stationary, moving, accumulate=False)  # the stale partial sums
            run.hit()
            kwargs["accumulate"] = True
            return nc_matmul(dst, stationary, moving, **kwargs)
        run.program_state["matmuls"] = run.program_state.get("matmuls", 0) + 1
        return nc_matmul(dst, stationary, moving, *args, **kwargs)

    return [mock.patch.object(emulated_isa, "nc_matmul", matmul)]


def wrong_scale(run):
    patches = []
    for name in ("activation", "activation_reduce"):
        original = getattr(emulated_isa, name)

        def scaled(*args, _original=original, **kwargs):
            scale = kwargs.get("scale", 1.0)
            if isinstance(scale, (int, float)) and scale != 1.0:
                kwargs["scale"] = 2.0 * scale
                run.hit()
            return _original(*args, **kwargs)

        patches.append(mock.patch.object(emulated_isa, name, scaled))
    return patches


def half_dx_unwritten(run):
    dma_copy, ndarray = emulated_isa.dma_copy, emulated_nl.ndarray

    def allocate(shape, dtype, buffer=emulated_nl.sbuf, *args, **kwargs):
        tensor = ndarray(shape, dtype, buffer, *args, **kwargs)
        if buffer in HBM and "first_output" not in run.program_state:
            run.program_state["first_output"] = tensor._storage
        return tensor

    def copy(dst, src, *args, **kwargs):
        if "bwd" not in run.kernel or dst._storage is not run.program_state.get("first_output") or dst.shape[0] < 2:
            return dma_copy(dst, src, *args, **kwargs)
        run.hit()  # the write goes through, then its second half of rows is put back as it was
        half, data, written = dst.shape[0] // 2, dst._data.copy(), dst._written.copy()
        dma_copy(dst, src, *args, **kwargs)
        dst._data[half:], dst._written[half:] = data[half:], written[half:]

    return [mock.patch.object(emulated_nl, "ndarray", allocate), mock.patch.object(emulated_isa, "dma_copy", copy)]


def swapped_op(run):
    patches = []
    for name, op_keys in (("tensor_tensor", ("op",)), ("tensor_scalar", ("op0", "op1")),
                          ("scalar_tensor_tensor", ("op0", "op1")), ("tensor_reduce", ("op",))):
        original = getattr(emulated_isa, name)
        positions = {"tensor_tensor": {"op": 3}, "tensor_scalar": {"op0": 2, "op1": 5},
                     "scalar_tensor_tensor": {"op0": 2, "op1": 4}, "tensor_reduce": {"op": 1}}[name]

        def swapped(*args, _original=original, _positions=positions, **kwargs):
            args = list(args)
            for key, position in _positions.items():
                if position < len(args) and args[position] is emulated_nl.maximum:
                    args[position] = emulated_nl.add
                    run.hit()
                elif kwargs.get(key) is emulated_nl.maximum:
                    kwargs[key] = emulated_nl.add
                    run.hit()
            return _original(*args, **kwargs)

        patches.append(mock.patch.object(emulated_isa, name, swapped))
    return patches


FAULTS = {fault.__name__: fault for fault in (skipped_last_tile, causal_mask_dropped, stale_psum, wrong_scale,
                                              half_dx_unwritten, swapped_op)}


@contextlib.contextmanager
def injected(fault):
    """Run the block with `fault` (a name in FAULTS) bent into the emulator; yields the run, whose .hits
    says how many instructions were bent in each kernel."""
    run = _Run()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_tracking(run))
        for patch in FAULTS[fault](run):
            stack.enter_context(patch)
        yield run


# -----------------------------------------------------------------------------
# the matrix: every fault against the kernel tests and against bench.py --check's kernel checks

def _kernel_test_cases():
    """(name, run) for one small bf16 case of each op's reference tests, through the tests' own functions: the
    KILL_MATRIX entry of the test file its declaration names (KernelOp.tests)."""
    cases = []
    for op in kernels.OPS.values():
        cases += importlib.import_module(op.tests.removesuffix(".py")).KILL_MATRIX[op.name]
    return cases


def _check_cases():
    """(name, run) for the kernel checks of bench.py --check (forward+backward, kit/device_check.py) at the
    cases each op's declaration gives the kill matrix (KernelOp.kill_matrix), at its check shapes."""
    generator = torch.Generator().manual_seed(7)
    return [(f"--check {case.name}", lambda case=case: device_check.check_kernel(case, grad=True))
            for case in kernels.check_cases(torch.bfloat16, "cpu", generator)
            if case.name in kernels.OPS[case.op].kill_matrix]


def kill_matrix(fault):
    """{case: "caught" | "MISSED" | "n/a"} for `fault`: n/a where the fault bent no instruction of that
    case's kernels. Caught means the case's comparison failed (AssertionError); an emulator error does not
    count, since on a NeuronCore there is none."""
    results = {}
    for name, case in _kernel_test_cases() + _check_cases():
        with injected(fault) as run:
            try:
                case()
            except AssertionError:
                outcome = "caught"
            else:
                outcome = "MISSED"
        results[name] = outcome if run.hits else "n/a"
    return results


def test_every_case_passes_without_a_fault():
    """The control: "caught" means something only if the same cases pass on the right kernels."""
    for name, case in _kernel_test_cases() + _check_cases():
        case()


@pytest.mark.parametrize("fault", FAULTS)
def test_every_wrong_kernel_is_caught_by_the_tests_and_the_check(fault):
    results = kill_matrix(fault)
    assert "MISSED" not in results.values(), f"{fault}: {results}"
    applied = [name for name, outcome in results.items() if outcome == "caught"]
    assert any(name.startswith("--check") for name in applied), \
        f"{fault} bent no instruction of the checked kernels (has a kernel stopped using it?): {results}"
    assert any(not name.startswith("--check") for name in applied), f"{fault}: {results}"


def test_an_output_the_kernel_never_wrote_comes_back_nan():
    """The kernels allocate their outputs in HBM (nl.ndarray(buffer=nl.shared_hbm)); the emulator fills new
    tensors with NaN, as the official simulator does, so a region no instruction wrote reaches the
    comparisons as NaN and fails them (on a NeuronCore it holds whatever was there before)."""
    def half_written(x):
        out = emulated_nl.ndarray(x.shape, x.dtype, buffer=emulated_nl.shared_hbm)
        tile = emulated_nl.ndarray((64, x.shape[1]), x.dtype)
        emulated_isa.dma_copy(tile, x[0:64, :])
        emulated_isa.dma_copy(out[0:64, :], tile)
        return out

    out = nki_emulator.simulate(nki_emulator.jit(half_written))(torch.ones(128, 8))
    assert torch.equal(out[:64], torch.ones(64, 8)) and out[64:].isnan().all()
    with pytest.raises(AssertionError, match="not finite"):
        device_check.refuse_degenerate("out", out, [])


@pytest.mark.parametrize("output, message", [(torch.zeros(4, 3), "all 12 values are zero"),
                                             (torch.full((4, 3), 2.5), "all 12 values are 2.5"),
                                             (torch.arange(12.0).view(4, 3), "equal to input 1")])
def test_degenerate_outputs_fail_whatever_the_tolerance(output, message):
    inputs = [torch.randn(4, 3), torch.arange(12.0).view(4, 3)]
    with pytest.raises(AssertionError, match=message):
        device_check.refuse_degenerate("out", output, inputs)
    device_check.refuse_degenerate("out", torch.randn(4, 3), inputs)  # an ordinary output passes

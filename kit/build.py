"""
The module a training step calls: compiled, DDP-wrapped, and built again where a kernel or the whole graph fails
to build (docs/troubleshooting.md, "Devices and NKI").
"""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import kernels
from kit import runtime


def wrap_for_training(raw_model, cfg, device_type, device, example, sharded=False):
    """The module the training step calls: compiled if asked, and DDP-wrapped under torchrun unless the
    optimizer is sharded (optim.Sharding then exchanges the gradients itself). `example`:
    arguments of one forward call (their shapes, dtypes and devices: the kernels' fallbacks are decided and
    logged on them before compilation, as they cannot be from inside the compiled graph, and kept in
    raw_model.kernels_ran for the checkpoints)."""
    model = raw_model
    with runtime.autocast_context(cfg, device_type):  # what each kernel op runs, logged and kept for scoring
        raw_model.kernels_ran = kernels.preview_fallbacks(raw_model, *example)
    if cfg.compile:
        # the Neuron backend needs one graph for the whole step: fail loudly on a graph break
        model = torch.compile(raw_model, backend="neuron", fullgraph=True) if device_type == "neuron" else torch.compile(raw_model)
    if dist.is_initialized() and not sharded:
        model = DDP(model, device_ids=[torch.device(device).index] if device_type == "cuda" else None)
    return model


def error_chain(error):
    """`error` and the errors behind it, outermost first (each one's __cause__, else its __context__)."""
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


def kernel_build_failure(error):
    """The kernels.KernelBuildError behind `error`, or None: a compiler may have wrapped it (dynamo's
    BackendCompilerFailed keeps it as its context)."""
    return next((e for e in error_chain(error) if isinstance(e, kernels.KernelBuildError)), None)


GRAPH_BUILD_ERRORS = ("BackendCompilerFailed", "NEFFCompilationError")
GRAPH_BUILD_MESSAGES = ("Neuron backend NEFF execution setup failed", "NCC_")


def graph_build_failure(error):
    """The error in `error`'s chain that says the compiler failed to build the compiled graph itself, outside any
    kernel's trace, or None: dynamo's BackendCompilerFailed (torch/_dynamo/exc.py: a backend raised while
    compiling a graph it was given); TorchNeuron's NEFFCompilationError ("raised when NEFF compilation fails")
    or the RuntimeError its backend raises from any error of a graph's compile, which the backward graph's
    compile (at the first backward) raises unwrapped (torch_neuronx/neuron_dynamo_backend/exceptions.py, and
    backend.py, neuron_backend_fx_compiler; public copy in parmoham-aws/test-repo-parmoham); a neuronx-cc
    error code, NCC_..."""
    return next((e for e in error_chain(error) if type(e).__name__ in GRAPH_BUILD_ERRORS
                 or any(m in str(e) for m in GRAPH_BUILD_MESSAGES)), None)


def root_cause(error):
    """The error at the bottom of `error`'s chain (a compiler's own, under dynamo's wrapper): its type and first line."""
    *_, error = error_chain(error)
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}" + (f": {lines[0][:300]}" if lines else "")


def fallbacks_for(error, raw_model, build_s, startup_s, cap_s):
    """(log event, the line that says it, its fields, {op: why}) for the ops `error` sends to PyTorch, or None
    where it is no build failure that turning kernels off could survive: a kernel's own (its op), or the
    compiled graph's (every op still on NKI, as raw_model.kernels_ran says; with none, nothing is left to turn
    off). `build_s`: how long the failed build took, which a rebuild takes again; `startup_s`: the start-up so
    far (from the process's start), against the start-up cap `cap_s`."""
    failure = kernel_build_failure(error)
    if failure is not None:
        return None if failure.op in kernels.BUILD_FAILURES else (
            "kernel_fallback", f"warning: {failure.op}: {failure.why}; {failure.op} runs on PyTorch for the rest of the "
            "run (docs/troubleshooting.md)", dict(op=failure.op, why=failure.why), {failure.op: failure.why})
    if graph_build_failure(error) is None:
        return None
    on_nki = [op for op, record in raw_model.kernels_ran.items() if "nki" in record["ran"] and op not in kernels.BUILD_FAILURES]
    if not on_nki:
        return None
    why = f"the compiled graph failed to build with NKI kernels in it: {root_cause(error)}"
    over = ", past it: the excess is charged to the run" if startup_s + build_s > cap_s else ""
    return ("graph_fallback", f"warning: {why}; building it once more with every op on PyTorch (on NKI until now: "
            f"{', '.join(on_nki)}): start-up {startup_s:.0f} s, about {startup_s + build_s:.0f} s after the rebuild, "
            f"against the {cap_s:.0f} s start-up cap{over} (docs/troubleshooting.md)",
            dict(ops=on_nki, why=why, startup_time=startup_s), dict.fromkeys(on_nki, why))


def surviving_build_failures(work, trainee, log, clock):
    """(work(trainee.model), the trainee to go on with), for the first call of the kernels: their build. A
    paid run cannot be retried, so a build failure does not end it (fallbacks_for): an NKI kernel that fails
    to build (kernels.KernelBuildError) sends its op to PyTorch for the rest of the run, and a compiled graph
    that fails to build as a whole sends every op still on NKI there, once. Each is said in one line and kept
    in kernels.BUILD_FAILURES, which the per-op record of the checkpoints then gives as the reason; the failed
    try's gradients are dropped, the module the step calls is built again (compiled: dynamo forgets the old
    graph and compiles once more, before the clock starts) and `work` runs again, on the same batches. The
    PyTorch path computes the same function. Any other failure, or one after the first call, ends the run as
    before. Every rank runs the same kernels at the same shapes, so the ranks fail, and fall back, alike."""
    while True:
        started = clock.now()
        try:
            return work(trainee.model), trainee
        except Exception as error:
            failed_at = clock.now()
            fallbacks = fallbacks_for(error, trainee.raw_model, failed_at - started, failed_at - clock.process_start,
                                      clock.startup_cap_s)
            if fallbacks is None:
                raise
        event, text, fields, fallen = fallbacks
        kernels.BUILD_FAILURES.update(fallen)
        log(event, text, **fields)
        trainee.raw_model.zero_grad(set_to_none=True)
        if trainee.sharding is not None:
            trainee.sharding.arm_gradients()
        torch._dynamo.reset()
        trainee = trainee._replace(model=trainee.rebuild())

"""An NKI kernel that fails to build at its first call does not end a run: its op goes on on PyTorch, said in
one line and in the checkpoint's per-op record; compiled, the graph is built once more. The failures are the
emulator's own refusals (a tile of 256 partitions), injected by swapping a kernel for one that makes it. Nor
does a compiled graph that fails to build as a whole, outside any kernel (injected by a compiler backend that
refuses it): it is built once more with every op on PyTorch."""
import collections
import functools
import json
import os
import re
from unittest import mock

import pytest
import torch

import kernels
import nki.language as nl
import train
from kit import build
from tiny import TINY_RUN

REAL_FWD, REAL_BWD = kernels.flash_attention_fwd_kernel, kernels.flash_attention_bwd_kernel
COMPILE = torch.compile
REFUSAL = "NKI kernel failed to build: NkiValidationError: ndarray: partition dim 256 exceeds the 128 partitions"
# attention on NKI (even "nki", which otherwise means NKI or an error), the rest on PyTorch: fast under the emulator
RUN = TINY_RUN + ["--n_layer=1", "--sequence_len=128", "--batch_size=1", "--eval_tokens=128", "--max_steps=2",
                  "--kernels=torch,attention:nki"]


def flash_attention_fwd_kernel(q, k, v, scale, window):  # the op's name in the kernel's, as kernels._kernel_op reads it
    nl.ndarray((256, 1), dtype=nl.float32, buffer=nl.sbuf)  # 256 partitions of 128: refused at its first call
    return REAL_FWD(q, k, v, scale, window)


def flash_attention_bwd_kernel(q, k, v, out, d_out, lse, scale, window):
    nl.ndarray((256, 1), dtype=nl.float32, buffer=nl.sbuf)
    return REAL_BWD(q, k, v, out, d_out, lse, scale, window)


def refused_in_a_window(q, k, v, scale, window):  # no op's name: flash_attention_fwd_kernel's name is given below
    nl.ndarray((128 * (1 + (window < q.shape[2])), 1), dtype=nl.float32, buffer=nl.sbuf)  # a window: 256 partitions
    return REAL_FWD(q, k, v, scale, window)


@pytest.fixture(autouse=True)
def fresh_kernels(monkeypatch):
    """No fallback, build or compiled graph of another test carries over; whatever a test injects, the
    injected kernel is a function the process has never run."""
    torch._dynamo.reset()
    monkeypatch.setattr(kernels, "BUILD_FAILURES", {})
    monkeypatch.setattr(kernels, "_built_kernels", set())
    monkeypatch.setattr(kernels, "_fallbacks_logged", set())


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data"))


def attention(batch, seq_len=128, window=None):
    q = torch.randn(batch, 1, seq_len, 32, generator=torch.Generator().manual_seed(batch))
    return kernels.attention(q, q, q, mode="nki", window=window)


def test_a_kernels_first_call_failure_names_its_op_and_a_later_failure_passes_through(monkeypatch):
    monkeypatch.setattr(kernels, "flash_attention_fwd_kernel", flash_attention_fwd_kernel)
    with pytest.raises(kernels.KernelBuildError, match=f"attention: {REFUSAL}") as error:
        attention(1)
    assert error.value.op == "attention" and error.value.why.startswith(REFUSAL)
    monkeypatch.setattr(kernels, "flash_attention_fwd_kernel", REAL_FWD)
    attention(1)  # built and run: a later failure of this variant is the kernel's, not its build's
    monkeypatch.setattr(kernels, "nki", mock.Mock(wraps=kernels.nki, simulate=mock.Mock(side_effect=MemoryError)))
    with pytest.raises(MemoryError):
        attention(1)


def test_each_variant_of_a_kernel_is_a_build_of_its_own(monkeypatch):
    """The compiler specialises a kernel on its scalar arguments and input shapes: the windowed attention of
    a window_pattern's short layers, or a new batch, is built at its own first call, after the full one."""
    monkeypatch.setattr(kernels, "flash_attention_fwd_kernel", functools.wraps(REAL_FWD)(refused_in_a_window))
    attention(1, seq_len=256)
    attention(2, seq_len=256)  # a new shape: built too
    with pytest.raises(kernels.KernelBuildError, match=f"attention: {REFUSAL}"):
        attention(1, seq_len=256, window=128)


def test_every_kernel_names_its_op():
    with open(kernels.__file__) as f:
        launched = set(re.findall(r"_run_kernel\((\w+_kernel),", f.read()))
    found = {name: kernels._kernel_op(getattr(kernels, name)) for name in launched}
    assert found["flash_attention_bwd_kernel"] == "attention" and found["add_rms_norm_fwd_kernel"] == "add_rms_norm"
    assert found["rms_norm_bwd_kernel"] == "rms_norm" and set(found.values()) == set(kernels.KERNEL_OPS)


Trainee = collections.namedtuple("Trainee", "model raw_model sharding rebuild")
CLOCK = train.ChargedClock(0, 1, 900.0)


def test_only_a_build_failure_is_survived_and_each_op_falls_back_once():
    """A build failure, even wrapped by a compiler, falls back and the work runs again on the rebuilt module;
    any other error, and a second build failure of an op already on PyTorch, ends the run."""
    raw_model = torch.nn.Linear(2, 2)
    raw_model(torch.ones(2)).sum().backward()  # the failed try's gradients: dropped
    trainee, logged, tries = Trainee("first", raw_model, None, lambda: "rebuilt"), [], []

    def work(model):
        tries.append(model)
        if len(tries) == 1:
            try:
                raise kernels.KernelBuildError("mlp", ValueError("no such instruction"))
            except kernels.KernelBuildError:
                raise RuntimeError("backend compiler failed") from None  # as dynamo wraps it: the context kept
        return "done"

    result, trainee = build.surviving_build_failures(work, trainee, lambda *a, **fields: logged.append(fields), CLOCK)
    assert (result, trainee.model, tries) == ("done", "rebuilt", ["first", "rebuilt"])
    why = "NKI kernel failed to build: ValueError: no such instruction"
    assert kernels.BUILD_FAILURES == {"mlp": why} and logged == [{"op": "mlp", "why": why}]
    assert raw_model.weight.grad is None
    with pytest.raises(kernels.KernelBuildError):  # mlp again: on PyTorch already, so not a build of it
        build.surviving_build_failures(lambda _: fails_to_build("mlp"), trainee, logged.append, CLOCK)
    with pytest.raises(ZeroDivisionError):
        build.surviving_build_failures(lambda _: 1 / 0, trainee, logged.append, CLOCK)
    assert len(logged) == 1


def fails_to_build(op):
    raise kernels.KernelBuildError(op, RuntimeError("again"))


def run(out_dir, data_dir, *extra):
    return train.main(RUN + [f"--out_dir={out_dir}", f"--data_dir={data_dir}", *extra])


def events(out_dir, kind):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [e for e in map(json.loads, f) if e["event"] == kind]


@pytest.mark.parametrize("compiled, failing, sharded", [(False, flash_attention_fwd_kernel, False),
                                                       (False, flash_attention_bwd_kernel, True),
                                                       (True, flash_attention_bwd_kernel, False)])
def test_a_run_whose_attention_kernel_fails_to_build_finishes_on_pytorch_attention(tmp_path, data_dir, monkeypatch,
                                                                                    capsys, compiled, failing, sharded):
    """The forward fails in the first evaluation; the backward inside the first step, after gradients of the
    layers above reached the (sharded optimizer's) buffer; compiled (AOT autograd, as the Neuron backend),
    inside the first step's graph, which is then compiled once more. Each run trains on PyTorch attention,
    with the losses and gradient norms of a run on PyTorch from the start, and final.pt says why."""
    compiles = []

    def compile_as_for_neuron(model, **_):
        if isinstance(model, torch.nn.Module):  # the model; Muon's update is compiled too on CPU
            compiles.append(model)
        return COMPILE(model, backend="aot_eager_default_partitioner", fullgraph=True)

    monkeypatch.setattr(train.torch, "compile", compile_as_for_neuron)
    monkeypatch.setattr(kernels, failing.__name__, failing)
    shard = f"--shard_optimizer={str(sharded).lower()}"
    result = run(tmp_path / "fell_back", data_dir, f"--compile={compiled}", shard)
    [fallback] = events(tmp_path / "fell_back", "kernel_fallback")
    assert fallback["op"] == "attention" and fallback["why"].startswith(REFUSAL)
    said = [line for line in capsys.readouterr().out.splitlines() if "failed to build" in line]
    assert said == [f"warning: attention: {fallback['why']}; attention runs on PyTorch for the rest of the run "
                    "(docs/troubleshooting.md)"]
    record = torch.load(tmp_path / "fell_back" / "final.pt", weights_only=True)["kernels"]
    assert record["attention"] == {"ran": "torch", "why": fallback["why"]}
    assert len(compiles) == (2 if compiled else 0) and kernels.BUILD_FAILURES == {}  # rebuilt once; gone with the run
    assert train.load_for_eval(str(tmp_path / "fell_back" / "final.pt")).config.kernels == "torch"

    on_torch = run(tmp_path / "torch", data_dir, "--compile=false", shard, "--kernels=torch")
    steps = [[(e["loss"], e["grad_norm"]) for e in events(tmp_path / out, "train")] for out in ("fell_back", "torch")]
    assert len(steps[0]) == 2 and steps[0] == [pytest.approx(s, rel=1e-6) for s in steps[1]]
    assert result["final_eval"]["val_bpb"] == pytest.approx(on_torch["final_eval"]["val_bpb"], rel=1e-6)


class NEFFCompilationError(Exception):
    """TorchNeuron's error for a graph the Neuron compiler fails to build (by its name, as build.py knows it)."""


def test_a_graph_build_failure_is_told_by_the_compilers_own_errors_anywhere_in_the_chain():
    try:
        try:
            raise RuntimeError("Neuron backend NEFF execution setup failed with unexpected error: E")
        except RuntimeError:
            raise ValueError("in the first step") from None  # the context kept, as a wrapper keeps it
    except ValueError as wrapped:
        assert str(build.graph_build_failure(wrapped)).startswith("Neuron backend NEFF")
    assert build.graph_build_failure(RuntimeError("[NCC_EVRF007] the compiler gave up")) is not None
    assert isinstance(build.graph_build_failure(NEFFCompilationError("E")), NEFFCompilationError)
    assert build.graph_build_failure(RuntimeError("CUDA out of memory")) is None
    assert build.graph_build_failure(ZeroDivisionError()) is None


def test_a_graph_that_fails_to_build_is_built_once_more_with_every_op_that_was_on_nki_on_pytorch():
    """Said in one line with the start-up so far and after a rebuild as long as the failed build, against
    the cap; the ops already on PyTorch keep their own reason; a graph that fails again without a kernel
    in it ends the run."""
    raw_model = torch.nn.Linear(2, 2)
    raw_model.kernels_ran = {"attention": {"ran": "nki", "why": "kernels=nki"}, "mlp": {"ran": "torch", "why": "kernels=torch"},
                             "rms_norm": {"ran": "nki and torch", "why": "..."}}
    seconds = iter([300.0, 700.0, 720.0])  # the failed build from 300 s to 700 s of start-up; the rebuild's start
    clock = train.ChargedClock(0, 1, 900.0, process_start=0.0, now=lambda: next(seconds))
    logged, tries = [], []

    def work(model):
        tries.append(model)
        if len(tries) == 1:  # TorchNeuron's wrapper of the compiler's error: the compiler's is the reason
            raise NEFFCompilationError("NEFF compilation failed") from RuntimeError("[NCC_EXTP004] too many "
                                                                                   "instructions in the graph")
        return "trained"

    result, _ = build.surviving_build_failures(work, Trainee("first", raw_model, None, lambda: "rebuilt"),
                                               lambda event, text, **fields: logged.append((event, text, fields)), clock)
    why = ("the compiled graph failed to build with NKI kernels in it: RuntimeError: [NCC_EXTP004] too many "
           "instructions in the graph")
    assert (result, tries) == ("trained", ["first", "rebuilt"])
    assert kernels.BUILD_FAILURES == {"attention": why, "rms_norm": why}
    [(event, text, fields)] = logged
    assert event == "graph_fallback" and fields["ops"] == ["attention", "rms_norm"] and fields["why"] == why
    assert text == (f"warning: {why}; building it once more with every op on PyTorch (on NKI until now: attention, rms_norm): "
                    "start-up 700 s, about 1100 s after the rebuild, against the 900 s start-up cap, past it: the excess "
                    "is charged to the run (docs/troubleshooting.md)")
    raw_model.kernels_ran = {op: {"ran": "torch", "why": why} for op in ("attention", "rms_norm")}  # as rebuilt
    clock.now = lambda: 800.0
    with pytest.raises(NEFFCompilationError):  # no kernel left to turn off: the graph's own failure ends the run
        build.surviving_build_failures(fails_to_compile, Trainee("second", raw_model, None, lambda: "again"),
                                       logged.append, clock)
    assert len(logged) == 1


def fails_to_compile(model):
    raise NEFFCompilationError("[NCC_EXTP004] too many instructions in the graph")


def refuses_nki_ops(graph, example_inputs):
    """A compiler backend that fails to build any graph with an NKI kernel's op in it, as a Neuron compile error
    of the whole graph would, outside any kernel's trace; it compiles the rest as AOT autograd does."""
    if any("nanogpt_trn" in str(node.target) for node in graph.graph.nodes):
        raise RuntimeError("[NCC_INLA001] the graph around the kernels failed to build (injected)")
    from torch._dynamo.backends.debugging import aot_eager_default_partitioner
    return aot_eager_default_partitioner(graph, example_inputs)


def test_a_compiled_run_whose_graph_fails_to_build_finishes_on_pytorch(tmp_path, data_dir, monkeypatch, capsys):
    """The first step's graph, with attention's NKI kernel in it, fails to build; the run builds it once more
    with attention on PyTorch, and trains as a run on PyTorch from the start does; final.pt says why."""
    compiles = []

    def compile_refusing_kernels(model, **_):
        if isinstance(model, torch.nn.Module):  # the model; Muon's update is compiled too on CPU
            compiles.append(model)
            return COMPILE(model, backend=refuses_nki_ops, fullgraph=True)
        return COMPILE(model, backend="aot_eager_default_partitioner", fullgraph=True)

    monkeypatch.setattr(build.torch, "compile", compile_refusing_kernels)
    run(tmp_path / "rebuilt", data_dir, "--compile=true")
    [fallback] = events(tmp_path / "rebuilt", "graph_fallback")
    assert fallback["ops"] == ["attention"] and fallback["why"].endswith(
        "RuntimeError: [NCC_INLA001] the graph around the kernels failed to build (injected)") and not events(tmp_path / "rebuilt", "kernel_fallback")
    said = [line for line in capsys.readouterr().out.splitlines() if "failed to build" in line]
    assert len(said) == 1 and said[0].startswith(f"warning: {fallback['why']}; building it once more with every op on PyTorch")
    record = torch.load(tmp_path / "rebuilt" / "final.pt", weights_only=True)["kernels"]
    assert record["attention"] == {"ran": "torch", "why": fallback["why"]} and record["mlp"]["why"] == "kernels=torch"
    assert len(compiles) == 2 and kernels.BUILD_FAILURES == {}
    run(tmp_path / "torch", data_dir, "--compile=false", "--kernels=torch")
    steps = [[(e["loss"], e["grad_norm"]) for e in events(tmp_path / out, "train")] for out in ("rebuilt", "torch")]
    assert len(steps[0]) == 2 and steps[0] == [pytest.approx(s, rel=1e-5) for s in steps[1]]

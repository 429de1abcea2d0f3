"""The configuration Trainium runs, on any CPU: bf16 autocast, torch.compile(fullgraph=True) and the NKI
kernels (here under the emulator, which computes bf16 in software), with no eager call first.

The Neuron backend hands dynamo's graph to AOT autograd (`aot_autograd(fw_compiler=...,
keep_inference_input_mutations=True, decompositions=...)`, torch_neuronx/neuron_dynamo_backend/backend.py;
public copy in parmoham-aws/test-repo-parmoham), which traces forward and backward through the kernels' fake
implementations and functionalises the graph. PyTorch's "aot_eager_default_partitioner" is that same call
with the graph then run eagerly (torch/_dynamo/backends/debugging.py), so it tests the contracts the Neuron
backend relies on (fake shapes, dtypes and strides, autograd registration) without a compiler; fullgraph
alone (a graph break) is dynamo's, which the "eager" backend checks fastest. Each test starts with a fresh
dynamo and a fresh fallback log, so nothing compiled or logged by an earlier test helps it through.

Tolerance: both paths compute in bf16 and round in different places (the kernels keep P and dS in bf16
before their matmuls; PyTorch's softmax and matmuls round elsewhere), so they agree to a few bf16 steps
(2^-8 relative): 2e-2 of the largest value, as bench.py --check allows in bf16.
"""
import dataclasses
import logging

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import kernels
import train
from kit import optim, runtime
from model import GPT, Block, GPTConfig, rotary_tables

BF16_TOLERANCE = 2e-2
TINY = GPTConfig(sequence_len=128, vocab_size=257, n_layer=2, n_embd=128, n_head=2, n_kv_head=1)
MODELS = {  # tiny versions of the default model, the organiser's baseline shape and the frontier levers
    "default": {},
    "baseline": dict(n_embd=256, n_head=2, n_kv_head=2, rope_base=100000.0, matrix_init_scale=0.68),
    "frontier": dict(mlp="leaky_relu2", value_embeds=True, residual_scalars=True, mtp_extra=2, loss_chunks=2),
}


@pytest.fixture(autouse=True)
def fresh_compiler_and_log(monkeypatch):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    monkeypatch.setattr(kernels, "_fallbacks_logged", set())


def config(model, mode):
    return dataclasses.replace(TINY, **MODELS[model], kernels=mode)


def relative_error(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def compile_for_trainium(module, *example, backend="aot_eager_default_partitioner"):
    """As kit/build.py (wrap_for_training) compiles for the Neuron backend: fallbacks previewed, then one graph."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kernels.preview_fallbacks(module, *example)
    return torch.compile(module, backend=backend, fullgraph=True)


def nonzero_projections(model):
    for block in model.modules():
        if isinstance(block, Block):  # zero at init: then attention and the MLP would reach no gradient
            for linear in (block.attn.c_proj, block.mlp.c_proj):
                torch.nn.init.normal_(linear.weight, std=0.02)


def test_a_block_on_nki_compiled_in_bf16_matches_pytorch():
    cfg = config("default", "nki")
    cos, sin = rotary_tables(cfg.sequence_len, cfg.head_dim, cfg.rope_base)
    x = torch.randn(2, cfg.sequence_len, cfg.n_embd, generator=torch.Generator().manual_seed(1))
    results = []
    for mode in ("nki", "torch"):
        torch.manual_seed(0)
        block = Block(dataclasses.replace(cfg, kernels=mode))
        nonzero_projections(block)
        run = compile_for_trainium(block, x, cos, sin) if mode == "nki" else block
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = torch.cat(run(x, cos, sin), dim=-1)  # the new residual stream and its norm
        out.float().square().mean().backward()
        results.append([out] + [p.grad for p in block.parameters()])
    for got, want in zip(*results):
        assert got.isfinite().all() and relative_error(got, want) < BF16_TOLERANCE


@pytest.mark.parametrize("model", ["default", "frontier"])
def test_training_steps_on_nki_compiled_in_bf16_match_pytorch(model):
    """train.py's optimizer step (Muon and AdamW, in bf16) on a GPT compiled in one graph: the first step's
    loss and gradients come from the compiled kernels without any eager call before them."""
    cfg = train.TrainConfig(dtype="bfloat16", compile=False)  # the optimizers eager, as on Neuron
    tokens = torch.randint(0, TINY.vocab_size, (2, TINY.sequence_len + 1), generator=torch.Generator().manual_seed(2))
    batch = [(tokens[:, :-1], tokens[:, 1:])]
    losses = {}
    for mode in ("nki", "torch"):
        torch.manual_seed(0)
        raw_model = GPT(config(model, mode))
        nonzero_projections(raw_model)
        run = compile_for_trainium(raw_model, *batch[0]) if mode == "nki" else raw_model
        optimizers = optim.make_optimizers(raw_model, cfg, "cpu", torch.bfloat16)
        autocast = runtime.autocast_context(cfg, "cpu")
        losses[mode] = torch.stack([train.train_step(run, raw_model, optimizers, batch, "cpu", autocast, 1.0)[0]
                                    for _ in range(3)])
    assert losses["nki"].isfinite().all() and losses["nki"][-1] < losses["nki"][0]
    assert relative_error(losses["nki"], losses["torch"]) < BF16_TOLERANCE
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # the steps reuse the first graph


@pytest.mark.parametrize("mode", ["auto", "nki", "torch"])
@pytest.mark.parametrize("model", list(MODELS))
def test_every_model_compiles_to_one_graph_under_bf16_autocast(model, mode, caplog):
    """Forward and backward in one graph. With kernels="auto" on a CPU every operation falls back: the
    reason is logged once, before compilation, and nothing logs from inside the graph."""
    torch.manual_seed(0)
    raw_model = GPT(config(model, mode))
    idx = torch.randint(0, TINY.vocab_size, (1, TINY.sequence_len))
    with caplog.at_level(logging.INFO, logger="kernels"):
        run = compile_for_trainium(raw_model, idx, idx, backend="eager")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = run(idx, idx)
    loss.backward()
    assert loss.isfinite() and torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    fallbacks = [r.getMessage() for r in caplog.records if r.name == "kernels"]
    reason = "using the PyTorch path: tensors are on cpu, not on a Trainium 'neuron' device"
    ops = ["rms_norm", "rope_norm", "attention", "add_rms_norm", "mlp"] + (["softcap_cross_entropy"] if model != "frontier" else [])
    assert fallbacks == ([f"{op}: {reason}" for op in ops] if mode == "auto" else [])  # frontier: the chunked loss


def test_a_per_op_kernels_setting_runs_each_op_its_way_in_one_graph_and_previews_the_record(caplog):
    """attention on NKI, the MLP and the norms on PyTorch: one graph, forward and backward; the MLP under
    "auto" on a CPU falls back and says why once, before compilation; preview_fallbacks returns per op what ran."""
    setting = "torch,attention:nki,mlp:auto"
    model = GPT(config("default", setting))
    idx = torch.randint(0, TINY.vocab_size, (1, TINY.sequence_len))
    with torch.autocast("cpu", dtype=torch.bfloat16), caplog.at_level(logging.INFO, logger="kernels"):
        record = kernels.preview_fallbacks(model, idx, idx)
    assert {op: entry["ran"] for op, entry in record.items()} == {"attention": "nki", "mlp": "torch", "rms_norm": "torch",
                                                                  "add_rms_norm": "torch", "softcap_cross_entropy": "torch",
                                                                  "rope_norm": "torch"}
    assert "tensors are on cpu" in record["mlp"]["why"] and record["rms_norm"]["why"] == "kernels=torch"
    assert kernels.scoring_kernels(record) == ("auto,attention:prefer,mlp:torch,rms_norm:torch,add_rms_norm:torch,"
                                              "softcap_cross_entropy:torch,rope_norm:torch")
    with caplog.at_level(logging.INFO, logger="kernels"):
        run = compile_for_trainium(model, idx, idx, backend="eager")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = run(idx, idx)
        loss.backward()
    assert loss.isfinite() and torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert model.blocks[0].attn.c_proj.weight.grad.abs().sum() > 0  # through the NKI attention
    assert [r.getMessage() for r in caplog.records if r.name == "kernels"] == [
        "mlp: using the PyTorch path: tensors are on cpu, not on a Trainium 'neuron' device"]


def test_value_embeddings_keep_attention_in_bf16():
    """The value-embedding table is fp32: mixed into v unconverted, it turned v (and attention) fp32 under
    autocast, which the NKI kernels refuse."""
    torch.manual_seed(0)
    model = GPT(config("frontier", "nki"))
    seen = []
    attention = kernels.attention
    idx = torch.randint(0, TINY.vocab_size, (1, TINY.sequence_len))
    with pytest.MonkeyPatch.context() as patch, torch.autocast("cpu", dtype=torch.bfloat16):
        patch.setattr(kernels, "attention",
                      lambda q, k, v, mode, window: seen.append(v.dtype) or attention(q, k, v, mode, window))
        model(idx)
    assert seen == [torch.bfloat16] * TINY.n_layer


def test_a_head_dim_256_gpt_on_nki_compiled_in_bf16_matches_pytorch():
    """The best public recipe's attention shape (one kv head of 256) in the Trainium configuration: the
    attention kernels contract the head dim in two 128-partition pieces, forward and backward."""
    cfg = dataclasses.replace(TINY, n_layer=1, n_embd=256, n_head=1, n_kv_head=1)
    assert cfg.head_dim == 256
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.sequence_len + 1), generator=torch.Generator().manual_seed(3))
    idx, targets = tokens[:, :-1], tokens[:, 1:]
    results = {}
    for mode in ("nki", "torch"):
        torch.manual_seed(0)
        model = GPT(dataclasses.replace(cfg, kernels=mode))
        nonzero_projections(model)
        run = compile_for_trainium(model, idx, targets) if mode == "nki" else model
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = run(idx, targets)
        loss.backward()
        results[mode] = [loss.detach()] + [p.grad for p in model.parameters()]
    for got, want in zip(results["nki"], results["torch"]):
        assert got.isfinite().all() and relative_error(got, want) < BF16_TOLERANCE


LAYOUT_VIEWS = {"view", "_unsafe_view", "reshape", "expand", "squeeze", "unsqueeze", "slice", "select", "alias",
                "detach"}
TRANSPOSES = {"transpose", "permute", "t"}
COPIES = {"clone", "contiguous", "copy", "_to_copy"}


def aten_name(node):
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None, None
    namespace, name = target._schema.name.split("::")
    return namespace, name


def transposed_copies_into_kernels(graph):
    """(kernel op, chain) for each kernel op input made by a copy of a transposed tensor, the pattern
    inductor miscompiles for 16-bit dtypes on some AVX512 CPUs (docs/troubleshooting.md); chain lists
    the layout ops between the input and the op, nearest first."""
    found = []
    for node in graph.nodes:
        namespace, name = aten_name(node)
        if namespace != "nanogpt_trn":
            continue
        for source in node.all_input_nodes:
            chain = []
            while aten_name(source)[1] in LAYOUT_VIEWS | TRANSPOSES | COPIES:
                chain.append(aten_name(source)[1])
                source = source.args[0]
            if TRANSPOSES & set(chain) and COPIES & set(chain):
                found.append((name, chain))
    return found


def test_no_transposed_copy_feeds_a_kernel_in_the_compiled_graphs():
    """The forward and backward graphs AOT autograd hands to the backend (as the Neuron backend gets them)
    for a GPT on NKI kernels in bf16: every layout change happens inside the kernels, so no
    transpose/permute + copy feeds any kernel op, and inductor never meets two fused
    16-bit transposes around them."""
    graphs = []

    def record(graph_module, example_inputs):
        graphs.append(graph_module.graph)
        return make_boxed_func(graph_module.forward)

    torch.manual_seed(0)
    model = GPT(config("default", "nki"))
    idx = torch.randint(0, TINY.vocab_size, (1, TINY.sequence_len))
    run = compile_for_trainium(model, idx, idx, backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = run(idx, idx)
    loss.backward()
    assert len(graphs) == 2  # forward, backward
    ops = [sorted({aten_name(n)[1] for n in g.nodes if aten_name(n)[0] == "nanogpt_trn"}) for g in graphs]
    kernel_ops = ("add_rms_norm", "flash_attention", "mlp", "rms_norm", "rope_norm", "softcap_cross_entropy")
    assert ops == [[f"{op}_fwd" for op in kernel_ops], [f"{op}_bwd" for op in kernel_ops]]
    for graph in graphs:
        assert transposed_copies_into_kernels(graph) == []


def test_cpu_fallbacks_are_named_on_neuron_only(monkeypatch):
    """At the end of a run on neuron the ops TorchNeuron ran on the CPU are listed (its get_fallback_ops()),
    or it says the installed torch_neuronx cannot list them; off Trainium nothing is said."""
    import sys
    import types

    assert runtime.cpu_fallbacks("cpu") is None
    monkeypatch.setitem(sys.modules, "torch_neuronx", types.SimpleNamespace(
        get_fallback_ops=lambda: ["aten::nonzero", "aten::_unique2", "aten::nonzero"]))
    assert runtime.cpu_fallbacks("neuron") == \
        "CPU fallbacks: TorchNeuron ran 2 op(s) on the CPU: aten::_unique2, aten::nonzero"
    monkeypatch.setitem(sys.modules, "torch_neuronx", types.SimpleNamespace(get_fallback_ops=lambda: []))
    assert runtime.cpu_fallbacks("neuron") == "CPU fallbacks: none (every op ran on the NeuronCores)"
    monkeypatch.setitem(sys.modules, "torch_neuronx", types.SimpleNamespace())
    assert "cannot be listed" in runtime.cpu_fallbacks("neuron")

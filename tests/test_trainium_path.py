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
    """As train.wrap_for_training compiles for the Neuron backend: fallbacks previewed, then one graph."""
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
            out = run(x, cos, sin)
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
    assert fallbacks == ([f"{op}: {reason}" for op in ("rms_norm", "attention", "mlp")] if mode == "auto" else [])


def test_a_per_op_kernels_setting_runs_each_op_its_way_in_one_graph_and_previews_the_record(caplog):
    """attention on NKI, the MLP and the norms on PyTorch: one graph, forward and backward; the MLP under
    "auto" on a CPU falls back and says why once, before compilation; preview_fallbacks returns per op what ran."""
    setting = "torch,attention:nki,mlp:auto"
    model = GPT(config("default", setting))
    idx = torch.randint(0, TINY.vocab_size, (1, TINY.sequence_len))
    with torch.autocast("cpu", dtype=torch.bfloat16), caplog.at_level(logging.INFO, logger="kernels"):
        record = kernels.preview_fallbacks(model, idx, idx)
    assert {op: entry["ran"] for op, entry in record.items()} == {"attention": "nki", "mlp": "torch", "rms_norm": "torch"}
    assert "tensors are on cpu" in record["mlp"]["why"] and record["rms_norm"]["why"] == "kernels=torch"
    assert kernels.scoring_kernels(record) == "auto,attention:prefer,mlp:torch,rms_norm:torch"
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
        patch.setattr(kernels, "attention", lambda q, k, v, mode: seen.append(v.dtype) or attention(q, k, v, mode))
        model(idx)
    assert seen == [torch.bfloat16] * TINY.n_layer

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import kernels
from model import GPT, GPTConfig
from reference import attention_reference


def tiny_config(**overrides):
    base = dict(sequence_len=32, vocab_size=100, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
    return GPTConfig(**{**base, **overrides})


def test_shapes_and_padded_vocab():
    torch.manual_seed(0)
    model = GPT(tiny_config())
    assert model.lm_head.weight.shape[0] == 128 and model.wte.weight.shape[0] == 128
    idx = torch.randint(0, 100, (3, 17))
    assert model(idx).shape == (3, 17, 100)
    assert model(idx, idx).shape == ()
    assert model(idx, idx, loss_reduction="none").shape == (3, 17)


def test_per_token_loss_averages_to_mean_loss():
    torch.manual_seed(0)
    model = GPT(tiny_config())
    idx, targets = torch.randint(0, 100, (2, 32)), torch.randint(0, 100, (2, 32))
    torch.testing.assert_close(model(idx, targets, loss_reduction="none").mean(), model(idx, targets))


def test_causal_future_tokens_never_change_earlier_logits():
    torch.manual_seed(0)
    model = GPT(tiny_config())
    for block in model.blocks:  # the zero init of output projections would hide any leak
        torch.nn.init.normal_(block.attn.c_proj.weight, std=0.1)
        torch.nn.init.normal_(block.mlp.c_proj.weight, std=0.1)
    idx = torch.randint(0, 100, (2, 32))
    changed = idx.clone()
    changed[:, 20:] = torch.randint(0, 100, (2, 12))
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_initial_loss_is_near_ln_vocab():
    torch.manual_seed(0)
    model = GPT(tiny_config(vocab_size=300))
    idx = torch.randint(0, 300, (4, 32))
    assert abs(model(idx, idx).item() - math.log(300)) < 0.05


@pytest.mark.parametrize("mlp", ["relu2", "gelu", "swiglu"])
@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_tiny_model_overfits_one_batch(mlp, n_kv_head):
    torch.manual_seed(0)
    model = GPT(tiny_config(mlp=mlp, n_kv_head=n_kv_head))
    idx = torch.randint(0, 100, (4, 32))
    targets = torch.roll(idx, -1, dims=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = model(idx, targets).item()
    for _ in range(60):
        loss = model(idx, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.1 * first


def test_swiglu_hidden_keeps_parameters_of_a_4x_mlp():
    config = tiny_config(n_embd=384, n_head=6, n_kv_head=6, mlp="swiglu")
    assert config.hidden_dim % 128 == 0
    assert abs(3 * config.hidden_dim - 2 * 4 * 384) <= 3 * 128


@pytest.mark.parametrize("overrides", [{}, {"n_kv_head": 4, "mlp": "swiglu"}, {"n_layer": 3, "n_embd": 128, "mlp_hidden": 384}])
def test_flops_per_token_matches_flop_counter(monkeypatch, overrides):
    # the counter does not see inside the fused SDPA kernel, so count attention through plain matmuls
    monkeypatch.setattr(kernels, "attention", lambda q, k, v, mode, window: attention_reference(q, k, v))
    torch.manual_seed(0)
    model = GPT(tiny_config(**overrides))
    B, T = 2, model.config.sequence_len
    idx = torch.randint(0, 100, (B, T))
    with FlopCounterMode(display=False) as counter:
        model(idx, idx).backward()
    expected = model.flops_per_token() * B * T
    assert counter.get_total_flops() == pytest.approx(expected, rel=0.03)


def test_generate_appends_tokens_and_greedy_is_deterministic():
    torch.manual_seed(0)
    model = GPT(tiny_config())
    prompt = torch.randint(0, 100, (2, 5))
    out = model.generate(prompt, 40, temperature=0)  # longer than sequence_len: the context is cropped
    assert out.shape == (2, 45) and torch.equal(out[:, :5], prompt)
    assert torch.equal(out, model.generate(prompt, 40, temperature=0))
    assert int(out.max()) < 100  # padded vocab entries are never sampled
    sampled = model.generate(prompt, 10, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(0))
    assert sampled.shape == (2, 15)


def test_generate_runs_one_shape_and_matches_growing_the_context():
    """Each forward sees (B, sequence_len), padded while the context is shorter, and picks what a
    forward over exactly the tokens so far picks."""
    torch.manual_seed(0)
    model = GPT(tiny_config())
    shapes = []
    model.register_forward_pre_hook(lambda module, args: shapes.append(tuple(args[0].shape)))
    prompt = torch.randint(0, 100, (2, 5))
    out = model.generate(prompt, 40, temperature=0)
    assert set(shapes) == {(2, model.config.sequence_len)} and len(shapes) == 40
    with torch.no_grad():
        for t in range(5, 45):
            context = out[:, max(0, t - model.config.sequence_len):t]
            assert torch.equal(model(context)[:, -1].argmax(-1), out[:, t])


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"n_embd": 65}, "not divisible by n_head"),
        ({"n_kv_head": 3}, "not divisible by n_kv_head"),
        ({"mlp": "tanh"}, "mlp='tanh'"),
        ({"n_layer": 0}, "n_layer=0 must be positive"),
    ],
)
def test_bad_config_raises_clear_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        GPT(tiny_config(**overrides))

"""--preset=baseline against the organiser's baseline, --preset=frontier's levers, each lever's wiring."""
import dataclasses
import math

import numpy as np
import pytest
import torch

import data
import train
from kit import contest, flags, optim
from model import GPT, GPTConfig


def resolved(preset, *extra):
    return train.parse_args([f"--preset={preset}", *extra])


def test_baseline_preset_is_the_organisers_baseline():
    cfg, model_cfg = resolved("baseline")
    with torch.device("meta"):
        n_params = GPT(dataclasses.replace(model_cfg, vocab_size=8192)).num_params()
    assert round(n_params / 1e6, 1) == 59.6
    assert (model_cfg.n_layer, model_cfg.n_embd, model_cfg.head_dim, model_cfg.n_kv_head) == (10, 640, 128, 5)
    assert (model_cfg.mlp, model_cfg.logit_softcap, model_cfg.sequence_len, model_cfg.rope_base) == ("relu2", 15.0, 1024, 100000.0)
    assert cfg.total_batch_tokens == 65536 and cfg.compile is False and cfg.data_order == "stream"
    # Muon: Polar Express and NorMuon (beta2 0.9) with cautious weight decay, momentum 0.85 -> 0.95 over 300 steps
    assert (cfg.matrix_optimizer, cfg.muon_beta2, cfg.weight_decay) == ("muon", 0.9, 0.2)
    assert [train.schedule(cfg, s, 0.0)["momentum"] for s in (0, 150, 300, 600)] == pytest.approx([0.85, 0.9, 0.95, 0.95])
    # no lever of the frontier preset
    off = train.TrainConfig()
    for name in ("row_pool", "mask_bos_targets", "batch_warmup", "mtp_weights", "ema_decay"):
        assert getattr(cfg, name) == getattr(off, name)
    assert (model_cfg.value_embeds, model_cfg.mtp_extra, model_cfg.loss_chunks) == (False, 0, 0)
    assert resolved("trn2") == (cfg, model_cfg)


def test_baseline_learning_rates_and_init_as_built():
    """The resolved optimizers and initial weights, at the baseline's width with one layer and a small vocab."""
    cfg, model_cfg = resolved("baseline")
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(model_cfg, n_layer=1, vocab_size=1024))
    adamw, muon = optim.make_optimizers(model, cfg, "cpu", torch.float32)
    width_scale = (640 / 768) ** -0.5  # embedding and head lrs scaled by (width / 768)^-0.5, the scalars' not
    assert [g["peak_lr"] for g in adamw.param_groups] == pytest.approx([0.3 * width_scale, 0.006 * width_scale, 0.2])
    assert [g["betas"] for g in adamw.param_groups] == [(0.8, 0.95), (0.8, 0.95), (0.9, 0.95)]
    assert adamw.param_groups[2]["params"] == [model.resid_lambdas, model.x0_lambdas] and adamw.defaults["eps"] == 1e-10
    assert isinstance(muon, optim.Muon) and all(g["peak_lr"] == pytest.approx(0.025) for g in muon.param_groups)
    assert model.wte.weight.std().item() == pytest.approx(0.8, rel=0.02)
    assert model.lm_head.weight.std().item() == pytest.approx(0.001, rel=0.02)
    c_fc = model.blocks[0].mlp.c_fc.weight
    assert c_fc.abs().max().item() == pytest.approx(0.68 * math.sqrt(3 / 640), rel=0.01)


def test_frontier_is_the_baseline_plus_every_lever():
    base_cfg, base_model = resolved("baseline")
    cfg, model_cfg = resolved("frontier")
    assert (model_cfg.mlp, model_cfg.value_embeds, model_cfg.residual_scalars) == ("leaky_relu2", True, True)
    assert (model_cfg.mtp_extra, cfg.mtp_weights, cfg.mtp_fade, model_cfg.loss_chunks > 0) == (2, "0.5,0.25", "0.45,0.2", True)
    assert (cfg.row_pool, cfg.mask_bos_targets, cfg.batch_warmup) == (256, True, "0.25@0.06,0.5@0.2")
    assert (cfg.ema_decay, cfg.ema_every, cfg.ema_blend) == (0.99, 32, 0.6)
    for name in ("n_layer", "n_embd", "sequence_len", "rope_base", "wte_init_std", "matrix_init_scale"):
        assert getattr(model_cfg, name) == getattr(base_model, name)
    for name in ("total_batch_tokens", "matrix_lr", "head_lr", "embedding_lr", "weight_decay", "warmdown_frac"):
        assert getattr(cfg, name) == getattr(base_cfg, name)
    for ranks in (1, 4, 8):  # the batch warm-up's quarter steps are whole micro-batches at 1, 4 or 8 ranks
        flags.validate_levers(cfg, model_cfg, cfg.total_batch_tokens // (cfg.batch_size * 1024 * ranks))


def test_mtp_weights_fade_farthest_target_first():
    cfg, _ = resolved("frontier")
    fade = {p: train.schedule(cfg, 0, p)["extra_loss_weights"] for p in (0.0, 0.1, 0.2, 0.325, 0.45, 0.9)}
    expected = {0.0: (0.5, 0.25), 0.1: (0.5, 0.125), 0.2: (0.5, 0.0), 0.325: (0.25, 0.0), 0.45: (0.0, 0.0), 0.9: (0.0, 0.0)}
    for p, weights in expected.items():
        assert fade[p] == pytest.approx(weights)


def tiny(**overrides):
    return GPTConfig(**{**dict(sequence_len=16, vocab_size=50, n_layer=2, n_head=2, n_kv_head=1, n_embd=32), **overrides})


def test_chunked_softcap_loss_matches_plain_loss_and_gradients():
    torch.manual_seed(0)
    targets = torch.randint(0, 50, (3, 16))
    targets[0, :5] = -1
    losses, grads = [], []
    for chunks in (0, 3):  # 48 rows in chunks of 16
        torch.manual_seed(1)
        model = GPT(tiny(mtp_extra=2, loss_chunks=chunks))
        torch.nn.init.normal_(model.lm_head.weight, std=0.5)  # logits big enough for the softcap to bend
        model.extra_loss_weights.copy_(torch.tensor([0.5, 0.25]))
        idx = torch.randint(0, 50, (3, 16), generator=torch.Generator().manual_seed(2))
        loss = model(idx, targets)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
        per_token = model.eval()(idx, targets, loss_reduction="none")
        assert per_token.shape == (3, 16) and (per_token[0, :5] == 0).all()
    torch.testing.assert_close(losses[0], losses[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_mtp_adds_later_targets_in_training_only():
    torch.manual_seed(0)
    model = GPT(tiny(mtp_extra=2))
    plain = GPT(tiny())
    plain.load_state_dict(model.state_dict())
    idx = torch.randint(0, 50, (2, 16))
    targets = torch.roll(idx, -1, dims=1)
    assert torch.allclose(model(idx, targets), plain(idx, targets))  # weights 0: the plain next-token loss
    model.extra_loss_weights.copy_(torch.tensor([0.5, 0.25]))
    assert model(idx, targets) > plain(idx, targets) + 0.5  # t+2 and t+3 are much harder to guess
    model.eval(), plain.eval()
    torch.testing.assert_close(model(idx, targets, loss_reduction="none"), plain(idx, targets, loss_reduction="none"))


def test_value_embeds_and_residual_scalars_are_causal_and_optimised_apart():
    torch.manual_seed(0)
    model = GPT(tiny(value_embeds=True, residual_scalars=True, n_layer=3))
    assert sorted(model.value_embeds) == ["0", "2"]  # alternate layers, the last always
    for block in model.blocks:
        torch.nn.init.normal_(block.attn.c_proj.weight, std=0.1)
        if block.attn.ve_gate is not None:
            torch.nn.init.normal_(block.attn.ve_gate.weight, std=0.5)
    idx = torch.randint(0, 50, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 50
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])
    adamw, muon = optim.make_optimizers(model, train.TrainConfig(), "cpu", torch.float32)
    groups = {id(p): g["peak_lr"] for g in adamw.param_groups for p in g["params"]}
    cfg = train.TrainConfig()
    assert groups[id(model.value_embeds["0"].weight)] == pytest.approx(cfg.embedding_lr)
    assert groups[id(model.x0_lambdas)] == groups[id(model.resid_lambdas)] == pytest.approx(cfg.scalar_lr)
    assert any(p is model.blocks[0].attn.ve_gate.weight for g in muon.param_groups for p in g["params"])


@pytest.fixture
def shard(tmp_path):
    tokens = np.arange(4000) % 200
    tokens[::37] = 256  # the separator
    path = str(tmp_path / "train_000000.bin")
    data.write_shard(path, tokens)
    return path


def windows_of_an_epoch(loader, n):
    return [tuple(loader.windows[i]) for i in loader._order[:n]]


def test_row_pool_shuffles_the_stream_only_locally(shard):
    stream = data.TokenLoader([shard], 4, 16, shuffle=False)
    pooled = data.TokenLoader([shard], 4, 16, shuffle=False, row_pool=2, seed=3)
    n = pooled.per_rank
    order = pooled._order
    assert sorted(order) == list(range(n)) and list(order) != list(stream._order)  # every window once, reordered
    assert np.abs(order - np.arange(n)).max() <= 2 * 4  # never further than the pool (2 batches of 4 rows)
    with pytest.raises(ValueError, match="data_order=stream"):
        data.TokenLoader([shard], 4, 16, row_pool=2)


def test_bos_targets_are_masked_in_training_batches(shard):
    x, y = next(data.TokenLoader([shard], 8, 64, ignore_target=256, shuffle=False))
    assert (y == -1).any() and not (y == 256).any()
    assert (x[:, 1:][y[:, :-1] == -1] == 256).all()  # the inputs still hold the separator


@pytest.mark.parametrize("overrides, message", [
    (["--row_pool=8"], "needs --data_order=stream"),
    (["--mtp_weights=0.5"], "one value per extra target"),
    (["--mtp_extra=2", "--mtp_weights=0.5,0.25", "--mtp_fade=0.2,0.45"], "decreasing"),
    (["--batch_warmup=0.3@0.1"], "whole number"),
    (["--batch_warmup=half@0.1"], "numbers like"),
    (["--ema_decay=1.5"], "ema_decay in"),
])
def test_bad_lever_settings_name_the_fix(overrides, message):
    cfg, model_cfg = train.parse_args(overrides)
    with pytest.raises(ValueError, match=message):
        flags.validate_levers(cfg, model_cfg, accum_steps=4)


def test_weight_ema_blends_the_average_into_the_model():
    model = torch.nn.Linear(2, 2, bias=False)
    torch.nn.init.zeros_(model.weight)
    ema = optim.WeightEMA(model, decay=0.5, every=2, blend=0.6)  # each update moves the average 1 - 0.5^2 = 3/4
    with torch.no_grad():
        model.weight.fill_(4.0)
    ema.update()
    assert torch.allclose(ema.average[0], torch.full((2, 2), 3.0))
    ema.finish()
    assert torch.allclose(model.weight, torch.full((2, 2), 0.4 * 4.0 + 0.6 * 3.0))


def test_frontier_differs_from_baseline_only_by_its_named_levers():
    lever_fields = {f for fields in contest.FRONTIER_LEVERS.values() for f in fields}
    changed = {k for k, v in contest.FRONTIER.items() if contest.BASELINE.get(k) != v}
    assert changed == lever_fields | {"compile"}


def test_every_ablation_row_is_a_valid_run():
    from kit import ablation
    rows = dict(ablation.ablation_rows(80))
    assert set(rows) == {"baseline", "frontier"} | {f"+ {lever}" for lever in contest.FRONTIER_LEVERS}
    for name, args in rows.items():
        cfg, model_cfg = train.parse_args([*args, *ablation.ABLATION_SHAPE, "--max_steps=80"])
        flags.validate_levers(cfg, model_cfg, cfg.total_batch_tokens // (cfg.batch_size * model_cfg.sequence_len))
        assert cfg.muon_momentum_warmup_steps == 10 and (cfg.ema_every, cfg.ema_decay) in ((1, 0.0), (1, 0.7397))
    frontier_cfg, frontier_model = train.parse_args(rows["frontier"])
    assert (frontier_cfg, frontier_model) == train.parse_args(["--preset=frontier", "--compile=false", "--batch_size=8",
                                                               *rows["frontier"][1:]])


def test_model_levers_compile_to_one_graph_that_the_mtp_fade_does_not_recompile():
    """fullgraph=True, as the Neuron backend compiles the step: no graph break in the levers, and writing
    new MTP weights into the buffer reuses the graph (a Python number would re-trace it)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps the counts of graphs that earlier tests compiled
    torch.manual_seed(0)
    model = GPT(tiny(value_embeds=True, residual_scalars=True, mtp_extra=2, loss_chunks=2))
    idx, targets = torch.randint(0, 50, (2, 16)), torch.randint(-1, 50, (2, 16))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for weights in ([0.5, 0.25], [0.3, 0.0]):
        model.extra_loss_weights.copy_(torch.tensor(weights))
        torch.testing.assert_close(compiled(idx, targets), model(idx, targets))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def fake_prepare(batches):
    """The few names of the contest's prepare.py that competition mode reads before training."""
    from types import SimpleNamespace
    tokenizer = SimpleNamespace(get_vocab_size=lambda: 64, get_bos_token_id=lambda: 60)
    return SimpleNamespace(ensure_tokenizer=lambda build_if_missing: tokenizer, make_dataloader=lambda *a: iter(batches),
                           TRAIN_TIME_BUDGET_SECONDS=60, TRAIN_STARTUP_STEPS_EXCLUDED=5,
                           TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS=900)


def test_competition_mode_masks_bos_targets_and_refuses_a_row_pool(monkeypatch, tmp_path):
    y = torch.tensor([[5, 60, 7], [60, 1, 2]])
    corpus = contest.ContestCorpus(fake_prepare([(y, y, {})]), mask_bos_targets=True)
    corpus.load(2, 3, 0, 1, "cpu", True)
    assert corpus.next_batch()[1].tolist() == [[5, -1, 7], [-1, 1, 2]]
    monkeypatch.setattr(contest, "find_prepare", lambda cfg: fake_prepare([]))
    with pytest.raises(ValueError, match="--row_pool=0 in competition mode"):
        train.main(["--data_order=stream", "--row_pool=8", "--dtype=float32", f"--out_dir={tmp_path}"])


def test_the_ablation_runs_every_seed_of_a_row_in_its_own_folder(monkeypatch, tmp_path, capsys):
    from kit import ablation
    rows = ablation.ablation_rows(2)
    monkeypatch.setattr(ablation, "ablation_rows", lambda steps: [rows[0], rows[-1]])  # baseline and + chunked_ce
    results = ablation.run_ablation(seeds=2, steps=2, train_main=train.main, extra=[f"--data_dir={tmp_path}", "--eval_tokens=2048"])
    assert list(results) == ["baseline", "+ chunked_ce"] and all(len(v) == 2 and all(map(math.isfinite, v)) for v in results.values())
    assert "| + chunked_ce |" in capsys.readouterr().out

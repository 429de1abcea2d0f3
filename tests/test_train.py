import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import data
import evaluate
import kernels
import train
from kit import checkpoint, flags, runtime
from model import GPTConfig, opt
from tiny import TINY_RUN

TINY = TINY_RUN + ["--warmup_steps=2"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data"))


def run(out_dir, data_dir, *extra):
    return train.main(TINY + [f"--out_dir={out_dir}", f"--data_dir={data_dir}", *extra])


def events(out_dir, kind):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [e for e in map(json.loads, f) if e["event"] == kind]


def test_a_few_steps_reduce_loss_and_val_bpb(tmp_path, data_dir):
    result = run(tmp_path, data_dir, "--max_steps=30", "--total_batch_tokens=512")
    losses = [e["loss"] for e in events(tmp_path, "train")]
    assert len(losses) == 30 and losses[-1] < losses[0] - 1.0
    assert result["final_eval"]["val_bpb"] < result["first_eval"]["val_bpb"] - 1.0
    assert os.path.exists(tmp_path / "final.pt")
    [plan] = events(tmp_path, "data")  # the data's size, stated before training
    windows = (len(data.read_shard(data.shard_paths(data.prepare("shakespeare", "bytes", data_dir), "train")[0])) - 1) // 64
    assert windows - 4 < plan["train_tokens"] / 64 <= windows  # whole micro-batches of 4 windows
    assert plan["planned_epochs"] == 30 * 512 / plan["train_tokens"]


def test_resume_continues_with_exactly_the_same_losses(tmp_path, data_dir):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run(full, data_dir, "--max_steps=6", "--checkpoint_every=3", "--keep_checkpoints=5")
    assert sorted(os.listdir(full)) == ["ckpt_0000003.pt", "ckpt_0000006.pt", "final.pt", "log.jsonl"]
    os.makedirs(resumed)
    shutil.copy(full / "ckpt_0000003.pt", resumed)
    run(resumed, data_dir, "--max_steps=6", "--resume=latest")
    uninterrupted = [(e["step"], e["loss"]) for e in events(full, "train")][3:]
    continued = [(e["step"], e["loss"]) for e in events(resumed, "train")]
    assert continued == uninterrupted


def test_keeps_only_the_last_checkpoints(tmp_path, data_dir):
    run(tmp_path, data_dir, "--max_steps=4", "--checkpoint_every=1", "--keep_checkpoints=2")
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("ckpt")) == ["ckpt_0000003.pt", "ckpt_0000004.pt"]


def test_load_for_eval_reproduces_the_trained_model_on_its_kernels(tmp_path, data_dir):
    run(tmp_path, data_dir, "--max_steps=3", "--kernels=torch")
    state = torch.load(tmp_path / "final.pt", weights_only=True)
    model = train.load_for_eval(str(tmp_path / "final.pt"), "cpu")
    assert not model.training and model.config.kernels == "torch"  # scored on the path it trained on
    assert state["kernels"] == {op: {"ran": "torch", "why": "kernels=torch"}
                                for op in ("rms_norm", "attention", "add_rms_norm", "mlp", "softcap_cross_entropy",
                                           "rope_norm")}
    # a run from before the per-op record is scored on "auto": NKI where the kernels take the shapes, PyTorch
    # (logged) elsewhere
    trained_on_nki = checkpoint.inference_model(state["model"], {**state["model_config"], "kernels": "nki"}, "cpu")
    assert trained_on_nki.config.kernels == "auto"
    reference = train.GPT(train.GPTConfig(**state["model_config"]))
    reference.load_state_dict(state["model"])
    idx = torch.randint(0, 257, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), reference(idx), rtol=0, atol=0)
        assert model(idx).shape == (2, 64, 257)


def test_resume_with_another_model_shape_is_refused(tmp_path, data_dir):
    run(tmp_path, data_dir, "--max_steps=1", "--checkpoint_every=1")
    with pytest.raises(ValueError, match="no checkpoint .* fits this run.*n_embd"):
        run(tmp_path, data_dir, "--max_steps=2", "--resume=latest", "--n_embd=128")


def test_lr_schedule_warms_up_holds_and_warms_down():
    cfg = train.TrainConfig(warmup_steps=4, warmdown_frac=0.5, final_lr_frac=0.1)
    assert train.lr_multiplier(cfg, 0, 0.0) == pytest.approx(0.25)
    assert train.lr_multiplier(cfg, 10, 0.3) == 1.0
    assert train.lr_multiplier(cfg, 10, 0.75) == pytest.approx(0.55)
    assert train.lr_multiplier(cfg, 10, 1.0) == pytest.approx(0.1)


def test_the_epoch_plan_says_how_often_the_data_is_read():
    cfg = train.TrainConfig(max_steps=1000)
    text, fields = runtime.epoch_plan(cfg, 220_000, 512)
    assert text == ("training data: 220,000 tokens, one epoch is 429.7 steps of 512 tokens; 1,000 steps are 2.33 "
                    "epochs: the data is read 3 times, each epoch in a new order")
    assert fields == {"train_tokens": 220_000, "epoch_steps": 220_000 / 512, "planned_epochs": 1000 * 512 / 220_000}
    assert runtime.epoch_plan(dataclasses.replace(cfg, data_order="stream"), 220_000, 512)[0].endswith("in the same order")
    assert runtime.epoch_plan(cfg, 512_000, 512)[0].endswith("1,000 steps are 1.00 epochs: no window is read twice")
    assert runtime.epoch_plan(train.TrainConfig(), 220_000, 512)[0].endswith("the data starts repeating in step 430")
    text, fields = runtime.epoch_plan(cfg, None, 512)
    assert "not known" in text and "may repeat its shards" in text and fields["planned_epochs"] is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--n_layers=3"], "did you mean --n_layer"),
        (["--n_layer=three"], "not a valid int"),
        (["--compile=maybe"], "not a valid bool"),
        (["n_layer=3"], "arguments are --field=value"),
    ],
)
def test_bad_arguments_exit_with_the_fix(argv, message):
    with pytest.raises(SystemExit, match=message):
        train.parse_args(argv)


def test_help_lists_every_field(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "--matrix_lr=0.02" in out and "--n_kv_head=" in out and "--time_budget_s=" in out


def score(path, sequence_len, batch_size, tokens):
    """val_bpb of a checkpoint as evaluate.py bpb computes it: load_for_eval on the run's held-out split."""
    return evaluate.main(["bpb", f"--checkpoint={path}", f"--sequence_len={sequence_len}", f"--batch_size={batch_size}",
                          f"--tokens={tokens}", "--device=cpu"])["val_bpb"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_for_eval_scores_the_final_model_as_training_evaluated_it(tmp_path, data_dir, dtype):
    """fp32 weights; a bf16 run's forward computes under bf16 autocast inside the module (the scorer applies
    none), so scoring reproduces the training run's own final val_bpb."""
    result = run(tmp_path, data_dir, "--max_steps=3", f"--dtype={dtype}")
    model = train.load_for_eval(str(tmp_path / "final.pt"), "cpu")
    assert isinstance(model, checkpoint.AutocastGPT) == (dtype == "bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with torch.no_grad():  # the logits of a bf16 run carry bf16 rounding from the autocast inside
        plain = checkpoint.inference_model(model.state_dict(), dataclasses.asdict(model.config), "cpu")
        idx = torch.randint(0, 257, (2, 64))
        assert (model(idx) == plain(idx)).all() == (dtype == "float32")
        compiled = torch.compile(model, backend="eager", fullgraph=True)  # a scorer may compile it: one graph
        torch.testing.assert_close(compiled(idx), model(idx), rtol=0, atol=0)
    assert score(tmp_path / "final.pt", 64, 4, 2048) == pytest.approx(result["final_eval"]["val_bpb"], abs=1e-4)


def test_an_auto_run_whose_mlp_fell_back_in_training_is_scored_on_the_pytorch_mlp(tmp_path, data_dir, monkeypatch):
    """kernels=auto as on Trainium (the kernels emulated here): at 128 tokens per call the cost rule keeps a
    gated MLP of d=256 on PyTorch while attention and the norms run NKI. Scoring ("prefer" would take the
    kernel for the MLP's forward) follows the checkpoint's per-op record: NKI norms, the PyTorch MLP."""
    monkeypatch.setattr(kernels, "AUTO_NKI_DEVICES", ("neuron", "cpu"))
    monkeypatch.setattr(kernels, "_fallbacks_logged", set())
    result = run(tmp_path, data_dir, "--max_steps=2", "--kernels=auto", "--sequence_len=128", "--n_embd=256",
                 "--mlp=swiglu", "--batch_size=1", "--eval_tokens=256")
    record = torch.load(tmp_path / "final.pt", weights_only=True)["kernels"]
    assert {op: entry["ran"] for op, entry in record.items()} == {"rms_norm": "nki", "attention": "nki", "mlp": "torch",
                                                                  "add_rms_norm": "nki", "softcap_cross_entropy": "nki",
                                                                  "rope_norm": "nki"}
    assert "128 tokens per call and d=256 (gated)" in record["mlp"]["why"]
    calls = []
    for op in ("_mlp_op", "_rms_norm_op"):
        monkeypatch.setattr(kernels, op, functools.partial(lambda run_op, name, *a: calls.append(name) or run_op(*a),
                                                          getattr(kernels, op), op))
    model = train.load_for_eval(str(tmp_path / "final.pt"), "cpu")
    assert model.config.kernels == ("auto,attention:prefer,mlp:torch,rms_norm:prefer,add_rms_norm:prefer,"
                                    "softcap_cross_entropy:prefer,rope_norm:prefer")
    with torch.no_grad():
        model(torch.randint(0, 257, (1, 128)))
    assert "_mlp_op" not in calls and "_rms_norm_op" in calls
    assert score(tmp_path / "final.pt", 128, 1, 256) == pytest.approx(result["final_eval"]["val_bpb"], abs=1e-4)


def test_batch_that_does_not_divide_is_refused_before_training(tmp_path, data_dir):
    with pytest.raises(ValueError, match="not a multiple of batch_size"):
        run(tmp_path, data_dir, "--max_steps=1", "--total_batch_tokens=1000")
    assert not os.path.exists(tmp_path / "log.jsonl")


def test_a_run_with_nki_kernels_evaluates_and_samples_at_any_length(tmp_path, data_dir):
    # trained under the emulator with kernels="nki"; evaluation lengths need not be multiples of 128
    run(tmp_path, data_dir, "--max_steps=2", "--kernels=nki", "--sequence_len=128", "--n_embd=128",
        "--batch_size=2", "--sample_tokens=5")
    model = train.load_for_eval(str(tmp_path / "final.pt"), "cpu")
    with torch.no_grad():
        assert model(torch.randint(0, 257, (1, 50))).shape == (1, 50, 257)


def test_the_emulator_switch_trains_a_laptop_run_on_every_nki_kernel(tmp_path, data_dir):
    """NKI_EMULATOR=1 python train.py --kernels=nki, as docs/kernels.md gives it, in a process of its own with
    no Neuron SDK: every op's kernels run under the emulator (final.pt's record says so) and the loss falls."""
    command = [sys.executable, os.path.join(ROOT, "train.py"), "--kernels=nki", "--n_layer=1", "--n_embd=128",
               "--n_head=1", "--sequence_len=128", "--batch_size=1", "--max_steps=8", "--warmup_steps=2",
               "--eval_tokens=128", "--compile=false", "--dtype=float32", "--time_budget_s=0", "--sample_tokens=0",
               "--log_every=1", f"--out_dir={tmp_path}", f"--data_dir={data_dir}"]
    proc = subprocess.run(command, env={**os.environ, "NKI_EMULATOR": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = torch.load(tmp_path / "final.pt", weights_only=True)["kernels"]
    assert set(record) == set(kernels.KERNEL_OPS) and all(r["ran"] == "nki" for r in record.values()), record
    losses = [e["loss"] for e in events(tmp_path, "train")]
    assert len(losses) == 8 and losses[-1] < losses[0] - 1.0


def test_a_config_field_is_declared_once_on_its_line(capsys):
    """A field added with nothing but its dataclass line is parsed, listed in --help, range-checked and
    compared on resume (unless it says a resumed run may change it)."""
    def config_with(field):
        extended = dataclasses.make_dataclass("Extended", [("warmup_tokens", int, field)], bases=(train.TrainConfig,))
        return {"model": GPTConfig, "training": extended}

    configs = config_with(opt(0, "tokens of a new warm-up", bounds=(0, None)))
    cfg = flags.parse_flags(["--warmup_tokens=5"], configs, {}, "")["training"]
    assert cfg.warmup_tokens == 5
    flags.validate_config(cfg, GPTConfig())
    with pytest.raises(ValueError, match="--warmup_tokens=-1 must be >= 0"):
        flags.validate_config(flags.parse_flags(["--warmup_tokens=-1"], configs, {}, "")["training"], GPTConfig())
    with pytest.raises(SystemExit):
        flags.parse_flags(["--help"], configs, {}, "")
    assert "--warmup_tokens=0" in capsys.readouterr().out
    saved = {"train_config": dataclasses.asdict(cfg), "model_config": dataclasses.asdict(GPTConfig())}
    changed = dataclasses.replace(cfg, warmup_tokens=6)
    assert checkpoint.config_differences(saved, changed, GPTConfig()) == ([], ["warmup_tokens (checkpoint 5, now 6)"])
    resumable = config_with(opt(0, "tokens of a new warm-up", resumable=True))["training"]
    assert checkpoint.config_differences(saved, resumable(warmup_tokens=6), GPTConfig()) == ([], [])


@pytest.mark.parametrize("users", [None, "ACTIVE"])
def test_cpu_threads_wait_passively_unless_the_user_says_otherwise(users):
    """OMP_WAIT_POLICY=PASSIVE, set before torch loads (OpenMP reads it then), only where it is not set: a
    spinning OpenMP team ran at a third of its speed beside one busy core of two (docs/training.md)."""
    spy = ("import os, sys\n"
           "class Spy:\n"
           "    seen = []\n"
           "    def find_spec(self, name, path=None, target=None):\n"
           "        if name == 'torch' and not Spy.seen:\n"
           "            Spy.seen.append(os.environ.get('OMP_WAIT_POLICY'))\n"
           "sys.meta_path.insert(0, Spy())\n"
           "import train\n"
           "print(Spy.seen[0], '|', train.runtime.omp_wait_policy())\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env |= {"OMP_WAIT_POLICY": users} if users else {}
    result = subprocess.run([sys.executable, "-c", spy], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    at_torch_import, said = result.stdout.strip().split(" | ")
    if users:
        assert (at_torch_import, said) == (users, "OMP_WAIT_POLICY=ACTIVE (yours)")
    else:  # the kit's choice follows the load it saw, which the test cannot fix: what torch saw is what it says
        assert at_torch_import in ("PASSIVE", "None"), at_torch_import
        assert said.startswith("OMP_WAIT_POLICY=PASSIVE, OMP_NUM_THREADS=" if at_torch_import == "PASSIVE" else
                               "OMP_WAIT_POLICY unset (libgomp's default: "), said


def test_the_wait_policy_is_passive_only_beside_a_busy_core():
    """PASSIVE halved quiet fp32 tokens/s on a 2-core Xeon and doubled them beside a busy core (docs/training.md):
    the kit chooses it from the cores other processes keep busy."""
    assert runtime.chosen_wait_policy(None) is None  # no /proc/stat: libgomp's default
    assert runtime.chosen_wait_policy(0.1) is None
    assert runtime.chosen_wait_policy(0.5) == runtime.chosen_wait_policy(1.0) == "PASSIVE"
    busy = runtime.busy_cores_elsewhere(0.01)
    assert busy is None or 0 <= busy <= os.cpu_count()

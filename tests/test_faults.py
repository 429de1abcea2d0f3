"""Nothing lost under faults: kills during a save, SIGTERM, non-finite losses, a full disk, a failed periodic save."""
import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import namedtuple

import pytest
import torch

import data
import train
from kit import checkpoint, checkpoint_io, runtime
from tiny import TINY_RUN

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = TINY_RUN


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data"))


SAVE_FOREVER = """
import sys, torch, train
from kit import checkpoint
from model import GPT, GPTConfig
model = GPT(GPTConfig(n_layer=4, n_embd=256, sequence_len=64))
cfg, model_cfg = train.parse_args([])
step = 0
while True:
    checkpoint.save_checkpoint(sys.argv[1], model, [], step, 0.0, {"epoch": 0, "position": 0}, cfg, model_cfg)
    step += 1
    if step == 1:
        print("saved", flush=True)
"""


def test_a_kill_during_save_leaves_a_loadable_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    for delay in (0.05, 0.23, 0.41):
        proc = subprocess.Popen([sys.executable, "-c", SAVE_FOREVER, path], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "saved"
        time.sleep(delay)
        proc.kill()  # SIGKILL: no handler, no cleanup, possibly mid-write
        proc.wait()
        state = checkpoint_io.load_checkpoint(path)
        assert state["step"] >= 0 and state["model"]["wte.weight"].shape == (384, 256)


def test_sigterm_writes_a_checkpoint_and_resume_continues(tmp_path, data_dir):
    out = tmp_path / "out"
    cmd = [sys.executable, "train.py", *TINY, "--max_steps=100000", f"--out_dir={out}", f"--data_dir={data_dir}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 900  # only a guard against a hang: a slow machine just waits longer
    while not (os.path.exists(out / "log.jsonl") and '"event": "train"' in (out / "log.jsonl").read_text()):
        assert proc.poll() is None and time.time() < deadline, "training never got under way"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    assert "stopped by a signal" in output
    [written] = [f for f in os.listdir(out) if f.startswith("ckpt_")]
    stopped_at = checkpoint_io.load_checkpoint(out / written)["step"]
    assert stopped_at >= 1
    train.main(TINY + [f"--max_steps={stopped_at + 2}", "--resume=latest", f"--out_dir={out}", f"--data_dir={data_dir}"])
    steps = [e["step"] for e in map(json.loads, open(out / "log.jsonl")) if e["event"] == "train"]
    assert steps[-2:] == [stopped_at + 1, stopped_at + 2]


def test_nan_at_a_known_step_stops_and_keeps_the_last_good_checkpoint(tmp_path, data_dir, monkeypatch):
    real_step, calls = train.train_step, []

    def poisoned_step(model, raw_model, *args):
        calls.append(1)
        if len(calls) == 4:
            with torch.no_grad():
                raw_model.lm_head.weight[0, 0] = float("nan")
        return real_step(model, raw_model, *args)

    monkeypatch.setattr(train, "train_step", poisoned_step)
    args = TINY + ["--max_steps=10", "--checkpoint_every=1", "--keep_checkpoints=5", f"--out_dir={tmp_path}", f"--data_dir={data_dir}"]
    with pytest.raises(FloatingPointError, match=r"step 4: loss nan.*lower --matrix_lr"):
        train.main(args)
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".pt")) == [f"ckpt_000000{i}.pt" for i in (1, 2, 3)]
    last_good = checkpoint_io.load_checkpoint(tmp_path / "ckpt_0000003.pt")
    assert all(torch.isfinite(t).all() for t in last_good["model"].values())


def test_a_full_disk_is_refused_before_training(tmp_path, data_dir, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(checkpoint_io.shutil, "disk_usage", lambda path: Usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(OSError, match="GiB free but checkpoints need"):
        train.main(TINY + ["--max_steps=2", f"--out_dir={tmp_path}", f"--data_dir={data_dir}"])
    assert not os.path.exists(tmp_path / "log.jsonl")


def test_checkpoints_load_tensors_only(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"model": {}, "evil": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(checkpoint_io.CheckpointError, match="holds objects other than tensors"):
        checkpoint_io.load_checkpoint(tmp_path / "evil.pt")


@pytest.mark.parametrize("phase", ["preparing data", "first evaluation", "final evaluation"])
def test_a_signal_in_any_phase_leaves_a_final_pt_or_a_resumable_checkpoint(tmp_path, data_dir, monkeypatch, phase):
    """SIGTERM outside the training loop: before anything is trained the run says so and saves nothing;
    during the first evaluation it writes a checkpoint to resume from; during the final one final.pt is
    already safe. No phase ends in a traceback or a lost run."""
    real_evaluate, real_load, evaluations = train.evaluate, data.KitCorpus.load, []

    def evaluate(*args, **kwargs):
        evaluations.append(1)
        if (phase, len(evaluations)) in (("first evaluation", 1), ("final evaluation", 2)):
            signal.raise_signal(signal.SIGTERM)
        return real_evaluate(*args, **kwargs)

    def load(self, *args):
        real_load(self, *args)
        if phase == "preparing data":
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(train, "evaluate", evaluate)
    monkeypatch.setattr(data.KitCorpus, "load", load)
    args = TINY + ["--max_steps=3", f"--out_dir={tmp_path}", f"--data_dir={data_dir}"]
    if phase == "preparing data":
        with pytest.raises(runtime.Stopped, match="nothing was trained"):
            train.main(args)
        assert not [f for f in os.listdir(tmp_path) if f.endswith(".pt")]
        return
    result = train.main(args)
    assert result["final_eval"] is None
    if phase == "first evaluation":
        assert os.listdir(tmp_path).count("ckpt_0000000.pt") == 1 and not os.path.exists(tmp_path / "final.pt")
        train.main(TINY + ["--max_steps=3", "--resume=latest", f"--out_dir={tmp_path}", f"--data_dir={data_dir}"])
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert final["step"] == 3 and all(torch.isfinite(t).all() for t in final["model"].values())


def test_a_nan_on_the_last_step_between_log_lines_is_caught_before_final_pt(tmp_path, data_dir, monkeypatch):
    real_step, calls = train.train_step, []

    def poisoned_step(model, raw_model, *args):
        calls.append(1)
        if len(calls) == 4:  # the last step of the run, not a logging step
            with torch.no_grad():
                raw_model.lm_head.weight[0, 0] = float("nan")
        return real_step(model, raw_model, *args)

    monkeypatch.setattr(train, "train_step", poisoned_step)
    args = TINY + ["--max_steps=4", "--log_every=10", "--checkpoint_every=2", f"--out_dir={tmp_path}", f"--data_dir={data_dir}"]
    with pytest.raises(FloatingPointError, match="step 4: loss nan"):
        train.main(args)
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".pt")) == ["ckpt_0000002.pt"]


# A train.py run in which torch.distributed.checkpoint's first write fails on rank 1 (as a device or DTensor
# failure would, inside the save's collective steps), launched under torchrun by the test below
FAILING_SHARDED_SAVE = """
import os, sys
sys.path.insert(0, sys.argv[1])
from torch.distributed.checkpoint import filesystem
import train

real_write, calls = filesystem._FileSystemWriter.write_data, []

def write_data(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 1 and os.environ["RANK"] == "1":
        raise RuntimeError("injected failure of the device's write")
    return real_write(self, *args, **kwargs)

filesystem._FileSystemWriter.write_data = write_data
train.main(sys.argv[2:])
"""


def test_a_failed_sharded_save_warns_and_the_run_goes_on_with_consolidated_saves(tmp_path, data_dir):
    """2 gloo ranks, sharded: the save of step 2 fails on rank 1 only; every rank learns it, the run goes
    on, the next periodic save is a consolidated ckpt_*.pt from rank 0 holding every parameter's whole
    state, and final.pt is written. Nothing that looks like a checkpoint is left of the failed one."""
    script, out = tmp_path / "failing.py", tmp_path / "out"
    script.write_text(FAILING_SHARDED_SAVE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), ROOT, *TINY,
           "--max_steps=4", "--checkpoint_every=2", f"--out_dir={out}", f"--data_dir={data_dir}"]
    result = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["ckpt_0000004.pt", "final.pt", "log.jsonl"]
    [warning] = [e for e in map(json.loads, open(out / "log.jsonl")) if e["event"] == "checkpoint_failed"]
    assert warning["step"] == 2 and warning["consolidate_next"]
    assert "rank 1: " in warning["cause"] and "injected failure of the device's write" in warning["cause"]
    assert "ckpt_0000002.dcp" in warning["cause"] and "next checkpoints are consolidated" in result.stdout
    saved = checkpoint_io.load_checkpoint(out / "ckpt_0000004.pt")  # its digests check out
    model = torch.load(out / "final.pt", weights_only=True)["model"]
    assert saved["step"] == 4 and set(saved["optimizers"]) == set(model)
    # a table cut in rows over the ranks, joined again (its values: tests/test_sharding.py)
    assert saved["optimizers"]["wte.weight"]["exp_avg"].shape == model["wte.weight"].shape


def test_a_full_disk_at_one_periodic_save_warns_and_the_run_goes_on(tmp_path, data_dir, monkeypatch, capsys):
    real_save = torch.save

    def full_at_step_2(state, f):  # the disk is full for the save of step 2 of 4, then space is freed
        if f.name.endswith("ckpt_0000002.pt.tmp"):
            f.write(b"PK\x03\x04 partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(state, f)

    monkeypatch.setattr(torch, "save", full_at_step_2)
    train.main(TINY + ["--max_steps=4", "--checkpoint_every=1", "--keep_checkpoints=5", f"--out_dir={tmp_path}",
                       f"--data_dir={data_dir}"])
    assert sorted(os.listdir(tmp_path)) == ["ckpt_0000001.pt", "ckpt_0000003.pt", "ckpt_0000004.pt", "final.pt", "log.jsonl"]
    [warning] = [e for e in map(json.loads, open(tmp_path / "log.jsonl")) if e["event"] == "checkpoint_failed"]
    assert warning["step"] == 2 and not warning["consolidate_next"]
    assert re.search(f"cannot write {tmp_path}/ckpt_0000002.pt .No space left on device", warning["cause"])
    assert "warning: the checkpoint of step 2 was not written" in capsys.readouterr().out
    assert checkpoint_io.load_checkpoint(tmp_path / "ckpt_0000004.pt")["step"] == 4

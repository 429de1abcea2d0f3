"""Data-parallel training on CPU (gloo) under torchrun, against a single process doing the same work."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tiny import TINY_RUN

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = TINY_RUN + ["--warmup_steps=2"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data"))


def launch(ranks, out_dir, data_dir, *extra):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] if ranks else [sys.executable]
    cmd = launcher + [os.path.join(ROOT, "train.py"), *TINY, f"--out_dir={out_dir}", f"--data_dir={data_dir}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def losses(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [(e["step"], e["loss"]) for e in map(json.loads, f) if e["event"] == "train"]


def test_two_ranks_match_one_process_with_twice_the_accumulation(tmp_path, data_dir):
    same_work = ["--total_batch_tokens=512", "--max_steps=5"]  # Muon orthogonalises in fp32 here
    stdout = launch(2, tmp_path / "ddp", data_dir, *same_work)  # 2 ranks x 1 micro-step of 4 x 64 tokens
    launch(0, tmp_path / "single", data_dir, *same_work)  # 1 rank x 2 micro-steps
    assert stdout.count("val_bpb") == 3  # first eval, final eval, summary: printed once, by rank 0 only
    ddp = torch.load(tmp_path / "ddp" / "final.pt", weights_only=True)["model"]
    single = torch.load(tmp_path / "single" / "final.pt", weights_only=True)["model"]
    for name in single:
        torch.testing.assert_close(ddp[name], single[name], rtol=1e-4, atol=1e-5, msg=name)
    for (step_a, a), (step_b, b) in zip(losses(tmp_path / "ddp"), losses(tmp_path / "single")):
        assert step_a == step_b and a == pytest.approx(b, rel=1e-5)
    assert sorted(os.listdir(tmp_path / "ddp")) == ["final.pt", "log.jsonl"]
    assert len(losses(tmp_path / "ddp")) == 5  # one log line per step, not one per rank


def test_resume_under_two_ranks_continues_exactly(tmp_path, data_dir):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    launch(2, full, data_dir, "--max_steps=6", "--checkpoint_every=3")
    os.makedirs(resumed)
    shutil.copy(full / "ckpt_0000003.pt", resumed)
    launch(2, resumed, data_dir, "--max_steps=6", "--resume=latest")
    assert losses(resumed) == losses(full)[3:]

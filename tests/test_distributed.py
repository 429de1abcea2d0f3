"""Data-parallel training on CPU (gloo) under torchrun, against a single process doing the same work."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import train
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


SAME_WORK = ["--total_batch_tokens=1024", "--max_steps=4", "--checkpoint_every=2"]  # 4 x 256 tokens a step


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("one_process")
    train.main(TINY + [f"--out_dir={out}", f"--data_dir={data_dir}", *SAME_WORK])  # 1 rank x 4 micro-steps, in-process
    return out


def assert_same_run(out_dir, reference, from_step=0):
    for (step_a, a), (step_b, b) in zip(losses(out_dir), losses(reference)[from_step:], strict=True):
        assert step_a == step_b and a == pytest.approx(b, rel=1e-5)
    ours = torch.load(out_dir / "final.pt", weights_only=True)["model"]
    theirs = torch.load(reference / "final.pt", weights_only=True)["model"]
    for name in theirs:  # fp32 rounding, which differs with the order of the sums, moves AdamW's near-zero
        # gradient entries by up to a whole step in the first steps (its update is nearly their sign): so each
        # tensor to 1e-3 of its largest entry here; tests/test_sharding.py checks the same steps in float64
        assert (ours[name] - theirs[name]).abs().max() <= 1e-3 * theirs[name].abs().max(), name


def test_four_sharded_ranks_match_one_process_and_resume_at_two(tmp_path, data_dir, one_process):
    """The bar: 4 ranks with --shard_optimizer=true step for step as one process (fp32, losses within 1e-5
    relative); their sharded checkpoint resumed at 2 ranks continues as the uninterrupted run (one process
    reading it, a file resumed sharded, and DDP's step: tests/test_sharding.py)."""
    four, two = tmp_path / "four", tmp_path / "two"
    stdout = launch(4, four, data_dir, *SAME_WORK, "--shard_optimizer=true")  # 4 ranks x 1 micro-step
    assert stdout.count("val_bpb") == 3  # first eval, final eval, summary: printed once, by rank 0 only
    assert sorted(os.listdir(four)) == ["ckpt_0000002.dcp", "ckpt_0000004.dcp", "final.pt", "log.jsonl"]
    assert len(losses(four)) == 4  # one log line per step, not one per rank
    assert_same_run(four, one_process)
    os.makedirs(two)
    shutil.copytree(four / "ckpt_0000002.dcp", two / "ckpt_0000002.dcp")
    launch(2, two, data_dir, *SAME_WORK, "--resume=latest")  # 2 ranks x 2 micro-steps, sharded (auto)
    assert_same_run(two, one_process, from_step=2)

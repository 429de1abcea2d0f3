"""Foreseeable mistakes and failures end in one line that names the flag or file and the fix, with no
traceback, and nothing already saved is lost: bad flags, used out_dirs, resuming another run, bad
checkpoints of every kind, a full disk, a torn log, shards that do not match their manifest, bad input files."""
import dataclasses
import errno
import json
import logging
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import data
import evaluate
import kernels
import train
from kit import checkpoint, checkpoint_io, flags, runtime
from tiny import TINY_RUN

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = TINY_RUN + ["--warmup_steps=2"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data"))


def run(out_dir, data_dir, *extra):
    return train.main(TINY + [f"--out_dir={out_dir}", f"--data_dir={data_dir}", *extra])


def cli(script, *args):
    """(exit code, stderr) of `python script args`; its stdout is not looked at."""
    proc = subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stderr


# Runs `script`'s `if __name__ == "__main__":` block once for each argument list, in one process, and prints
# [exit code, stderr] of each as Python would have ended it: a SystemExit with a message prints it and exits 1,
# an uncaught exception prints its traceback. One interpreter start instead of one per case.
CLI_RUNNER = """
import contextlib, io, json, runpy, sys, traceback
script, results = sys.argv[1], []
for args in json.loads(sys.argv[2]):
    sys.argv, err, code = [script, *args], io.StringIO(), 0
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) or e.code is None else print(e.code, file=sys.stderr) or 1
        except BaseException:
            traceback.print_exc()
            code = 1
    results.append([code or 0, err.getvalue()])
print(json.dumps(results))
"""


def cli_cases(script, cases):
    """[(exit code, stderr)] of `python script *args` for each args in cases, in one process (CLI_RUNNER)."""
    proc = subprocess.run([sys.executable, "-c", CLI_RUNNER, script, json.dumps(cases)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [tuple(r) for r in json.loads(proc.stdout.strip().splitlines()[-1])]


def assert_one_line_error(rc, stderr, *needles):
    assert rc != 0 and "Traceback" not in stderr, stderr
    line = stderr.strip().splitlines()[-1]
    assert line.startswith("error: "), stderr
    for needle in needles:
        assert needle in line, line


def snapshot(directory):
    """{name: bytes} of a folder's files, to show that a refused or failed command changed none."""
    return {name: open(os.path.join(directory, name), "rb").read()
            for name in sorted(os.listdir(directory)) if os.path.isfile(os.path.join(directory, name))}


def log_events(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]  # fails on a torn line


# --- flags ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "argv, message",
    [
        (["--n_head=0"], "n_head=0 must be positive"),
        (["--batch_size=0"], "--batch_size=0 must be >= 1"),
        (["--log_every=0"], "--log_every=0 must be >= 1"),
        (["--eval_tokens=-5"], "--eval_tokens=-5 must be >= 1"),
        (["--seed=-1"], "--seed=-1 must be between 0"),
        (["--matrix_lr=nan"], "--matrix_lr=nan must be >= 0"),
        (["--warmdown_frac=2"], "--warmdown_frac=2.0 must be between 0 and 1"),
        (["--muon_momentum=1"], "must be below 1"),
        (["--dtype=fp8"], "--dtype='fp8': use auto or bfloat16 or float32"),
        (["--n_kv_head=3"], "n_head=2 is not divisible by n_kv_head=3"),
        (["--rope_base=0"], "rope_base=0.0 must be > 1"),
        (["--max_steps=0", "--time_budget_s=0"], "training never stops"),
    ],
)
def test_bad_values_are_refused_with_the_fix_before_any_work(argv, message):
    cfg, model_cfg = train.parse_args(argv)
    with pytest.raises(ValueError, match=re.escape(message)):
        flags.validate_config(cfg, model_cfg)


def test_wrong_types_from_code_are_refused():
    cfg, model_cfg = train.TrainConfig(batch_size="8", compile="yes"), train.GPTConfig(n_layer=2.5)
    with pytest.raises(ValueError, match="--batch_size='8' must be an integer; --compile='yes' must be true or false"):
        flags.validate_config(cfg, model_cfg)
    with pytest.raises(ValueError, match="n_layer=2.5 must be an integer"):
        model_cfg.validate()


def test_both_flag_conventions_and_n_kv_head_following_n_head():
    cfg, model_cfg = train.parse_args(["--n_layer", "3", "--dtype=float32", "--seed", "7", "--n_head", "8", "--n_embd=256"])
    assert (model_cfg.n_layer, cfg.dtype, cfg.seed) == (3, "float32", 7)
    assert model_cfg.n_kv_head == 8  # the default 0 means "same as n_head"
    flags.validate_config(cfg, model_cfg)
    assert train.parse_args(["--n_kv_head=2", "--n_head=8"])[1].n_kv_head == 2
    with pytest.raises(SystemExit, match="--max_steps needs a value"):
        train.parse_args(["--max_steps"])


def test_help_describes_every_field_in_aligned_columns(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  --")]
    names = {f.name for cls in (train.TrainConfig, train.GPTConfig) for f in dataclasses.fields(cls)}
    assert {row.split()[0].split("=")[0][2:] for row in rows} == names | {"preset"}
    starts = [re.match(r"  \S+\s+", row).end() for row in rows]  # where each description starts
    assert len(set(starts)) == 1 and all(len(row[start:]) > 10 for row, start in zip(rows, starts))


def test_bad_flags_and_a_missing_device_print_one_line_without_a_traceback(tmp_path):
    cases = [
        (["--n_head=0"], ["n_head=0 must be positive"]),
        (["--log_every", "0"], ["--log_every=0 must be >= 1"]),
        (["--device=cuda", "--max_steps=1", f"--out_dir={tmp_path}"], ["--device=cuda: no CUDA device"]),
        (["--resume=nowhere.pt", f"--out_dir={tmp_path}"], ["--resume=nowhere.pt: no such checkpoint"]),
        # a fresh interpreter: no Neuron SDK here, and no emulator unless asked for (docs/kernels.md)
        (["--kernels=attention:nki", f"--out_dir={tmp_path}"], ["kernels='attention:nki' runs attention on NKI, which "
                                                                "is not usable here", "NKI_EMULATOR=1 python train.py"]),
    ]
    for (rc, stderr), (_, needles) in zip(cli_cases("train.py", [args for args, _ in cases]), cases, strict=True):
        assert_one_line_error(rc, stderr, *needles)
    assert os.listdir(tmp_path) == []  # refused before data preparation or any file was written


# --- out_dir and resume ----------------------------------------------------------------------------------

def test_a_new_run_into_a_used_out_dir_is_refused_or_moves_the_old_files_aside(tmp_path, data_dir):
    run(tmp_path, data_dir, "--max_steps=2", "--checkpoint_every=1")
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=r"holds another run's files \(ckpt_0000001.pt, ckpt_0000002.pt, final.pt, "
                                         r"log.jsonl\).*--resume=latest.*--start_over=true"):
        run(tmp_path, data_dir, "--max_steps=2", "--seed=2")
    assert snapshot(tmp_path) == before
    run(tmp_path, data_dir, "--max_steps=1", "--seed=2", "--start_over=true")
    [old] = [d for d in os.listdir(tmp_path) if d.startswith("old_")]
    assert snapshot(tmp_path / old) == before  # the first run, whole
    assert log_events(tmp_path)[0]["train_config"]["seed"] == 2 and "ckpt_0000002.pt" not in os.listdir(tmp_path)


def test_resume_latest_takes_the_newest_checkpoint_of_this_run_config(tmp_path, data_dir, capsys):
    run(tmp_path, data_dir, "--max_steps=2", "--checkpoint_every=1", "--keep_checkpoints=5")
    other = torch.load(tmp_path / "ckpt_0000002.pt", weights_only=True)
    other["train_config"]["seed"], other["step"] = 99, 3
    torch.save(other, tmp_path / "ckpt_0000003.pt")  # the newest, from another run (seed 99)
    (tmp_path / "ckpt_0000004.pt").write_bytes(b"")  # and a newer one still, never written
    run(tmp_path, data_dir, "--max_steps=3", "--resume=latest")
    out = capsys.readouterr().out
    assert f"resuming from {tmp_path}/ckpt_0000002.pt" in out
    assert "skipped" in out and "ckpt_0000004.pt is empty" in out and "seed (checkpoint 99, now 1337)" in out
    resumed = [e for e in log_events(tmp_path) if e["event"] in ("resume", "train")][-2:]
    assert resumed[0]["event"] == "resume" and resumed[1]["step"] == 3
    # every checkpoint is where it was; with the override, the seed-99 checkpoint is accepted
    assert {"ckpt_0000002.pt", "ckpt_0000003.pt", "ckpt_0000004.pt"} <= set(os.listdir(tmp_path))
    os.remove(tmp_path / "ckpt_0000004.pt")
    with pytest.raises(checkpoint_io.CheckpointError, match="matrix_optimizer \\(checkpoint 'muon', now 'adamw'\\)"):
        run(tmp_path, data_dir, "--max_steps=4", f"--resume={tmp_path / 'ckpt_0000003.pt'}", "--matrix_optimizer=adamw")
    run(tmp_path, data_dir, "--max_steps=4", "--resume=latest", "--seed=5", "--resume_any_config=true")
    assert "resuming from" in capsys.readouterr().out


def test_resume_latest_with_only_other_runs_checkpoints_is_refused(tmp_path, data_dir):
    run(tmp_path, data_dir, "--max_steps=1", "--checkpoint_every=1")
    with pytest.raises(checkpoint_io.CheckpointError, match=r"no checkpoint .* fits this run.*--resume_any_config=true.*seed "
                                                    r"\(checkpoint 1337, now 3\)"):
        run(tmp_path, data_dir, "--max_steps=2", "--resume=latest", "--seed=3")


# --- bad checkpoints ------------------------------------------------------------------------------------

class Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("good")
    run(out, data_dir, "--max_steps=1", "--checkpoint_every=1")
    return out / "ckpt_0000001.pt"


def zero_64_bytes_at_60_percent(content):
    at = int(0.6 * len(content))
    assert content[at:at + 64] != bytes(64)  # else the damage would change nothing
    return content[:at] + bytes(64) + content[at + 64:]


def bad_checkpoints(directory, good):
    """{kind: (path, what its error says)} for every way a checkpoint file can be unusable."""
    content = good.read_bytes()
    files = {"empty": (b"", "is empty"), "random": (os.urandom(4096), "is not a PyTorch checkpoint"),
             "truncated": (content[: len(content) // 2], "is not a PyTorch checkpoint")}
    paths = {}
    for kind, (payload, message) in files.items():
        (directory / f"{kind}.pt").write_bytes(payload)
        paths[kind] = (directory / f"{kind}.pt", message)
    (directory / "damaged.pt").write_bytes(zero_64_bytes_at_60_percent(content))
    paths["damaged"] = (directory / "damaged.pt", "is damaged")
    torch.save({"model": {}}, directory / "keys.pt")
    paths["missing keys"] = (directory / "keys.pt", "lacks optimizers, step")
    torch.save({"model": {}, "evil": Payload()}, directory / "pickle.pt")
    paths["pickled object"] = (directory / "pickle.pt", "holds objects other than tensors")
    return paths


def test_each_bad_checkpoint_kind_is_named_with_the_reason(tmp_path, good_checkpoint):
    for kind, (path, message) in bad_checkpoints(tmp_path, good_checkpoint).items():
        with pytest.raises(checkpoint_io.CheckpointError, match=f"checkpoint {path} .*{message}"):
            checkpoint_io.load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="nowhere.pt"):
        checkpoint_io.load_checkpoint(tmp_path / "nowhere.pt")
    with pytest.raises(checkpoint_io.CheckpointError, match="final.pt .*weights only.*ckpt_"):
        checkpoint_io.load_checkpoint(good_checkpoint.parent / "final.pt")
    assert checkpoint_io.load_checkpoint(good_checkpoint)["step"] == 1


def test_an_unfinished_sharded_checkpoint_and_an_old_format_are_named(tmp_path, data_dir, good_checkpoint):
    unfinished = tmp_path / "ckpt_0000001.dcp"  # a folder whose ranks did not all finish: no .metadata
    unfinished.mkdir()
    with pytest.raises(checkpoint_io.CheckpointError, match=f"sharded checkpoint {unfinished} lacks its .metadata"):
        checkpoint_io.load_checkpoint(str(unfinished))
    old = torch.load(good_checkpoint, weights_only=True)
    old["optimizers"] = [{"state": {}, "param_groups": []}]  # by position, as the kit wrote it before
    del old["sha256"]  # which was before checkpoints carried digests
    torch.save(old, tmp_path / "old.pt")
    with pytest.raises(checkpoint_io.CheckpointError, match="keeps its optimizer state by position.*start the run again"):
        run(tmp_path / "out", data_dir, "--max_steps=2", f"--resume={tmp_path / 'old.pt'}")


def test_damaged_checkpoints_are_named_and_never_resumed_from(tmp_path, data_dir, capsys):
    """The bar: 64 bytes zeroed at 60% of the newest periodic checkpoint and of final.pt. --resume=latest
    says it skipped the damaged one and continues from the one before; load_for_eval and evaluate.py name
    the damaged final.pt; an explicit --resume of the damaged one is refused, naming it."""
    run(tmp_path, data_dir, "--max_steps=3", "--checkpoint_every=1")
    for name in ("ckpt_0000003.pt", "final.pt"):
        (tmp_path / name).write_bytes(zero_64_bytes_at_60_percent((tmp_path / name).read_bytes()))
    for load in (lambda p: train.load_for_eval(str(p), torch.device("cpu")),
                 lambda p: evaluate.load_checkpoint_and_tokenizer(str(p), "cpu", data_dir)):
        with pytest.raises(checkpoint_io.CheckpointError, match=rf"checkpoint {tmp_path}/final.pt is damaged: tensor \S+ "
                                                             "has sha256 [0-9a-f]{64}, expected [0-9a-f]{64}"):
            load(tmp_path / "final.pt")
    with pytest.raises(checkpoint_io.CheckpointError, match=f"checkpoint {tmp_path}/ckpt_0000003.pt is damaged"):
        run(tmp_path, data_dir, "--max_steps=4", f"--resume={tmp_path / 'ckpt_0000003.pt'}")
    capsys.readouterr()
    run(tmp_path, data_dir, "--max_steps=4", "--checkpoint_every=1", "--resume=latest")
    said = capsys.readouterr().out
    assert f"resuming from {tmp_path}/ckpt_0000002.pt\n  skipped {tmp_path}/ckpt_0000003.pt: checkpoint" in said
    assert [e["step"] for e in log_events(tmp_path) if e["event"] == "train"][-2:] == [3, 4]  # from step 2 on
    assert checkpoint_io.load_checkpoint(tmp_path / "ckpt_0000003.pt")["step"] == 3  # written again, intact


def test_digests_name_what_changed_and_old_checkpoints_load_with_a_note(tmp_path, good_checkpoint, capsys):
    state = torch.load(good_checkpoint, weights_only=True)
    state["model"]["lm_head.weight"][0, 0] += 1  # changed after the digests were taken
    torch.save(state, tmp_path / "edited.pt")
    with pytest.raises(checkpoint_io.CheckpointError, match="edited.pt is damaged: tensor model/lm_head.weight has sha256"):
        checkpoint_io.load_checkpoint(tmp_path / "edited.pt")
    state = torch.load(good_checkpoint, weights_only=True)
    state["step"] = 7  # a plain value is covered too
    torch.save(state, tmp_path / "step.pt")
    with pytest.raises(checkpoint_io.CheckpointError, match="step.pt is damaged: its configs, counters and structure have"):
        checkpoint_io.load_checkpoint(tmp_path / "step.pt")
    del state["sha256"]  # as written before checkpoints carried digests
    torch.save(state, tmp_path / "old.pt")
    assert checkpoint_io.load_checkpoint(tmp_path / "old.pt")["step"] == 7
    assert capsys.readouterr().out == (f"note: checkpoint {tmp_path / 'old.pt'} carries no sha256 digests (written "
                                       "before checkpoints had them): its bytes are not checked\n")


def test_a_sharded_folder_proves_every_file(tmp_path, capsys):
    from kit import optim
    from model import GPT, GPTConfig

    cfg, model_cfg = train.TrainConfig(), GPTConfig(sequence_len=16, vocab_size=70, n_layer=1, n_embd=32, n_head=2)
    model = GPT(model_cfg)
    folder = tmp_path / "ckpt_0000001.dcp"
    checkpoint.save_sharded_checkpoint(str(folder), model, optim.make_optimizers(model, cfg, "cpu", torch.float32),
                                       None, None, checkpoint.run_state(1, 0.0, None, cfg, model_cfg))
    listed = (folder / "SHA256SUMS").read_text().split()[1::2]
    assert listed == sorted(n for n in os.listdir(folder) if n != "SHA256SUMS") and "meta.pt" in listed and ".metadata" in listed
    assert checkpoint_io.load_checkpoint(str(folder))["step"] == 1
    data_file = next(folder / n for n in listed if n.endswith(".distcp"))
    content = bytearray(data_file.read_bytes())
    content[len(content) // 2] ^= 1  # one bit (the untrained model's projections are zeros, as at 60%)
    data_file.write_bytes(content)
    with pytest.raises(checkpoint_io.CheckpointError, match=f"sharded checkpoint {folder} is damaged: {data_file.name} has "
                                                         "sha256 [0-9a-f]{64}, expected [0-9a-f]{64}"):
        checkpoint_io.load_checkpoint(str(folder))
    data_file.unlink()
    with pytest.raises(checkpoint_io.CheckpointError, match=f"{data_file.name} has sha256 none .the file is missing"):
        checkpoint_io.load_checkpoint(str(folder))
    capsys.readouterr()
    (folder / "SHA256SUMS").unlink()  # a folder written before the digests: loads with a note
    assert checkpoint_io.load_checkpoint(str(folder))["step"] == 1
    assert "carries no sha256 digests" in capsys.readouterr().out


def test_bad_checkpoints_on_the_command_line_print_one_line(tmp_path, good_checkpoint):
    cases = bad_checkpoints(tmp_path, good_checkpoint)
    kinds = ("empty", "random", "truncated", "pickled object", "damaged")
    runs = [TINY + ["--max_steps=2", f"--resume={cases[kind][0]}", f"--out_dir={tmp_path / 'out'}"] for kind in kinds]
    for (rc, stderr), kind in zip(cli_cases("train.py", runs), kinds, strict=True):
        path, message = cases[kind]
        assert_one_line_error(rc, stderr, str(path), message)
        assert "pwned" not in stderr and "weights_only=False" not in stderr


# --- a full disk and a torn log ---------------------------------------------------------------------------

def test_a_full_disk_names_the_file_and_loses_nothing_saved(tmp_path, data_dir, monkeypatch):
    run(tmp_path, data_dir, "--max_steps=2", "--checkpoint_every=1")
    saved = snapshot(tmp_path)

    real_save = torch.save

    def disk_full_save(state, f):  # the disk fills up mid-run: every save writes a part, then fails
        if "timing" in f.name:  # the start-up's timing of the final save still fits
            return real_save(state, f)
        f.write(b"PK\x03\x04 partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(train.torch, "save", disk_full_save)
    # the periodic saves of steps 3 and 4 are warnings (tests/test_faults.py); the final save must land
    with pytest.raises(OSError, match=f"cannot write {tmp_path}/final.pt .No space left.*intact: free space, then --resume=latest"):
        run(tmp_path, data_dir, "--max_steps=4", "--checkpoint_every=1", "--resume=latest")
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    monkeypatch.undo()
    for name in ("ckpt_0000001.pt", "ckpt_0000002.pt", "final.pt"):
        assert (tmp_path / name).read_bytes() == saved[name]
    log_before = (tmp_path / "log.jsonl").read_bytes()

    real_open = open

    def open_on_a_full_disk(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if str(path).endswith("log.jsonl") and "a" in mode:
            class Full:  # half of the first line is written, then the disk is full
                def __getattr__(self, name):
                    return getattr(f, name)

                def write(self, b):
                    f.write(b[: len(b) // 2])
                    raise OSError(errno.ENOSPC, "No space left on device")
            return Full()
        return f

    monkeypatch.setattr(runtime, "open", open_on_a_full_disk, raising=False)
    with pytest.raises(OSError, match=f"cannot write {tmp_path}/log.jsonl: No space left on device; free space"):
        run(tmp_path, data_dir, "--max_steps=3", "--resume=latest")
    monkeypatch.undo()
    assert (tmp_path / "log.jsonl").read_bytes() == log_before  # the half line was cut back off


def test_a_folder_without_permission_names_the_fix(tmp_path, monkeypatch):
    def refused(path, *args, **kwargs):  # as a folder this user may not write (root ignores chmod)
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(checkpoint_io, "open", refused, raising=False)
    with pytest.raises(OSError, match=f"cannot write {tmp_path}/final.pt .Permission denied.*make {tmp_path} writable"):
        checkpoint_io.write_atomically(str(tmp_path / "final.pt"), {"step": 1})
    assert os.listdir(tmp_path) == []


def test_a_torn_last_log_line_is_cut_on_resume_and_a_marker_written(tmp_path, data_dir):
    run(tmp_path, data_dir, "--max_steps=2", "--checkpoint_every=2")
    with open(tmp_path / "log.jsonl", "ab") as f:
        f.write(b'{"event": "train", "step": 3, "lo')  # a crash mid-line
    run(tmp_path, data_dir, "--max_steps=3", "--resume=latest")
    events = log_events(tmp_path)  # every line parses
    marker = next(e for e in events if e["event"] == "resume")
    assert marker["torn_bytes_dropped"] == len(b'{"event": "train", "step": 3, "lo')
    assert [e["step"] for e in events if e["event"] == "train"] == [1, 2, 3]


# --- data ----------------------------------------------------------------------------------------------

@pytest.fixture
def prepared(tmp_path, data_dir):
    """A copy of the prepared Shakespeare shards, to damage."""
    source = data.prepare("shakespeare", "bytes", data_dir)
    copy = tmp_path / os.path.basename(source)
    shutil.copytree(source, copy)
    return copy


def test_shards_are_checked_against_their_manifest(prepared):
    assert data.shard_paths(prepared, "train")
    manifest = json.loads((prepared / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0]["tokens"] += 1
    (prepared / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(data.DataError, match="train_000.bin holds .* tokens but manifest.json lists"):
        data.shard_paths(prepared, "train")
    data.write_shard(prepared / "val_009.bin", np.arange(100))
    with pytest.raises(data.DataError, match=r"not listed: \['val_009.bin'\]"):
        data.shard_paths(prepared, "val")
    with pytest.raises(data.DataError, match="with 257 ids, but the model's vocabulary has 300"):
        data.TokenLoader([prepared / "val_000.bin"], 2, 64, vocab_size=300)
    renamed = prepared.parent / "shakespeare-gpt2"
    os.rename(prepared, renamed)
    with pytest.raises(data.DataError, match="made by the bytes tokenizer"):
        data.shard_paths(renamed, "val")
    os.remove(renamed / "manifest.json")
    with pytest.raises(data.DataError, match="manifest.json is missing"):
        data.shard_paths(renamed, "val")


def test_data_errors_print_one_line_naming_the_file(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"plain text\n")
    (tmp_path / "b.txt").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe binary")
    rc, stderr = cli("data.py", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "--data_dir", str(tmp_path / "d"), "--workers", "1")
    assert_one_line_error(rc, stderr, f"{tmp_path / 'b.txt'} is not UTF-8 text")


def test_an_offline_gpt2_tokenizer_is_one_error(monkeypatch):
    def offline(name):
        raise ConnectionError("no network")

    monkeypatch.setattr(data.tiktoken, "get_encoding", offline)
    with pytest.raises(data.DataError, match=r"could not load the GPT-2 encoding \(ConnectionError\).*--tokenizer=bytes"):
        data.get_tokenizer("gpt2")


# --- information, not noise ----------------------------------------------------------------------------

@pytest.mark.parametrize("setting, problem", [
    ("attention:nkx", "'nkx' is not a mode"), ("attn:nki", "'attn' is not an op"),
    ("mlp:torch,auto", "the mode for every op (auto) must come first"), ("mlp:torch,mlp:nki", "mlp is given twice"),
])
def test_a_bad_kernels_setting_is_one_line_naming_the_flag_and_the_fix(setting, problem):
    cfg, model_cfg = train.parse_args([f"--kernels={setting}"])
    with pytest.raises(ValueError) as error:
        flags.validate_config(cfg, model_cfg)
    message = str(error.value)
    assert f"--kernels={setting}: {problem}" in message and "\n" not in message
    assert "e.g. --kernels=attention:nki,mlp:torch" in message and "attention, mlp, rms_norm" in message


def test_a_kernels_setting_gives_every_op_a_mode():
    assert kernels.parse_kernels("auto") == {op: "auto" for op in kernels.KERNEL_OPS}
    assert kernels.parse_kernels("attention:nki, mlp:torch") == {**dict.fromkeys(kernels.KERNEL_OPS, "auto"),
                                                                 "attention": "nki", "mlp": "torch"}
    assert kernels.parse_kernels("torch,rms_norm:prefer") == {**dict.fromkeys(kernels.KERNEL_OPS, "torch"),
                                                              "rms_norm": "prefer"}


def test_auto_declines_the_nki_mlp_where_the_cost_model_expects_the_compiled_ops_faster(monkeypatch, caplog):
    """On a neuron device: below MLP_MIN_TOKENS the MLP falls back, with the reason, once; a gated MLP counts
    as 1.5x as wide; kernels=nki or prefer take the kernel; on a CPU "auto" falls back for the device."""
    monkeypatch.setattr(kernels, "_fallbacks_logged", set())
    few, many = kernels._mlp_cost_problem(128, 512, False), kernels._mlp_cost_problem(256, 512, False)
    assert many is None and kernels._mlp_cost_problem(128, 256, False) is None
    assert kernels._mlp_cost_problem(128, 256, True) is not None and kernels._mlp_cost_problem(256, 256, True) is None
    assert kernels._mlp_cost_problem(256, 2048, False) is not None and kernels._mlp_cost_problem(512, 2048, False) is None
    with caplog.at_level(logging.INFO, logger="kernels"):
        for _ in range(2):
            assert not kernels._use_nki("mlp", "auto", "neuron", None, few)
        assert kernels._use_nki("mlp", "auto", "neuron", None, many)
        assert kernels._use_nki("mlp", "prefer", "cpu", None, few) and kernels._use_nki("mlp", "nki", "cpu", None, few)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, f"mlp: using the PyTorch path: {few}")]
    assert "128 tokens per call and d=512" in few and "--kernels=mlp:nki" in few


def test_prefer_falls_back_only_for_shapes_the_kernel_refuses_and_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_fallbacks_logged", set())
    x = torch.randn(2, 100, 64)  # rows of 64 fit RMSNorm; a sequence of 100 does not fit attention's tiles
    with caplog.at_level(logging.INFO, logger="kernels"):
        assert kernels._use_nki("rms_norm", "prefer", "cpu", kernels._rms_norm_shape_problem(x))
        for _ in range(2):
            assert not kernels._use_nki("attention", "prefer", "cpu", kernels._attention_shape_problem(x[:, None], x[:, None], x[:, None]))
    assert [(r.levelno, "not a multiple of 128" in r.getMessage()) for r in caplog.records] == [(logging.WARNING, True)]


def test_missing_nki_is_said_once_for_all_kernels(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "nki", None)
    monkeypatch.setattr(kernels, "_fallbacks_logged", set())
    with caplog.at_level(logging.INFO, logger="kernels"):
        for op in ("attention", "mlp", "rms_norm", "attention"):
            assert not kernels._use_nki(op, "auto", "cpu")
    assert [(r.levelno, "all kernels" in r.getMessage()) for r in caplog.records] == [(logging.INFO, True)]


def test_deterministic_turns_on_torch_and_inductor_determinism(monkeypatch):
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "deterministic", False)
    try:
        runtime.configure_determinism(train.TrainConfig(deterministic=True))
        assert torch.are_deterministic_algorithms_enabled() and inductor_config.deterministic
    finally:
        torch.use_deterministic_algorithms(False)

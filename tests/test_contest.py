"""The contest's contract: its clock, competition mode beside prepare.py, and the one-file submission."""
import ast
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

import kernels
import train
from kit import checkpoint, contest, export
from model import GPT
from tiny import TINY_MODEL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = TINY_MODEL + ["--warmup_steps=2"]
CHUNKED = TINY + ["--loss_chunks=2"]  # the fused chunked loss: the run never calls softcap_cross_entropy


def model_ops():
    """The kernel ops model.py calls (`kernels.<op>(...)` in its source); an op declared in kernels.py that the
    model does not use is not among them."""
    with open(os.path.join(os.path.dirname(kernels.__file__), "model.py")) as f:
        source = f.read()
    return {op for op in kernels.KERNEL_OPS if f"kernels.{op}(" in source}


class FakeTime:
    def __init__(self, start=100.0):
        self.t = start

    def __call__(self):
        return self.t


def test_the_clock_starts_after_the_excluded_steps_and_charges_start_up_beyond_the_cap():
    now = FakeTime()
    clock = train.ChargedClock(budget_s=60, excluded_steps=2, startup_cap_s=10, process_start=100.0, now=now)
    clock.steps_done(0)
    now.t = 104.0
    clock.steps_done(1)
    assert clock.started is None and clock.charged() == 0.0  # compilation steps are free
    now.t = 106.0
    clock.steps_done(2)
    assert clock.charged() == 0.0 and clock.startup_s == 6.0  # within the cap: nothing charged
    now.t = 136.0
    assert clock.charged() == 30.0

    slow = FakeTime()
    late = train.ChargedClock(budget_s=60, excluded_steps=2, startup_cap_s=10, process_start=100.0, now=slow)
    slow.t = 125.0
    late.steps_done(2)
    assert late.charged() == 15.0  # 25 s of start-up, 15 s over the cap


def test_the_clock_stops_a_run_so_that_one_more_step_and_the_final_save_fit():
    now = FakeTime()
    clock = train.ChargedClock(budget_s=100, excluded_steps=0, startup_cap_s=900, process_start=100.0, now=now)
    clock.steps_done(0)
    now.t = 185.0
    assert not clock.out_of_time(clock.charged(), next_step_s=4.0, reserve_s=10.0)  # 85 + 4 + 10 < 100
    now.t = 187.0
    assert clock.out_of_time(clock.charged(), next_step_s=4.0, reserve_s=10.0)  # 87 + 4 + 10 >= 100
    clock.exclude(5.0)  # e.g. an evaluation kept off the clock
    assert clock.charged() == 82.0 and not clock.out_of_time(clock.charged(), 4.0, 10.0)
    resumed = train.ChargedClock(100, 0, 900, already=40.0, process_start=100.0, now=now)
    resumed.steps_done(0)
    assert resumed.charged() == 40.0


@pytest.mark.parametrize("budget_s", [20.0 + 0.37 * i for i in range(20)])
def test_jittered_steps_never_run_the_charged_time_past_the_budget(budget_s):
    """train_loop's stop rule on a fake clock: steps of 0.1 s with one of 1.5 s in every five (a loaded
    machine), a final save of 0.05 s and the reserve train.py keeps for it (twice that, plus 1 s). The
    median of recent steps let a slow step run past the end; the slowest recent step does not."""
    now = FakeTime()
    clock = train.ChargedClock(budget_s, excluded_steps=0, startup_cap_s=900, process_start=100.0, now=now)
    save_s, step_times = 0.05, []
    reserve_s = 2 * save_s + 1.0
    clock.steps_done(0)
    for step in range(10_000):
        now.t += 1.5 if step % 5 == 4 else 0.1
        step_times.append(1.5 if step % 5 == 4 else 0.1)
        if clock.out_of_time(clock.charged(), train.next_step_estimate(step_times), reserve_s):
            break
    now.t += save_s
    assert clock.charged() <= budget_s


def test_a_slow_start_up_step_does_not_stand_for_the_steps_after_it(tmp_path, monkeypatch):
    """The start-up step's time includes compilation. Taken as the next step's estimate, it ended a
    20 s budget after the start-up step (57 s of bf16 compilation on a CPU)."""
    step, calls = train.train_step, []

    def compiling_first(*args):
        calls.append(args)
        if len(calls) == 1:
            time.sleep(3.0)  # longer than the whole budget
        return step(*args)

    monkeypatch.setattr(train, "train_step", compiling_first)
    result = train.main(TINY + ["--time_budget_s=2", "--startup_steps=1", "--eval_tokens=2048", "--sample_tokens=0",
                                f"--out_dir={tmp_path / 'out'}", f"--data_dir={tmp_path / 'data'}"])
    assert result["step"] >= 3 and len(calls) == result["step"]


@pytest.fixture
def contest_dir(tmp_path):
    folder = tmp_path / "contest"
    folder.mkdir()
    shutil.copy(os.path.join(ROOT, "tests", "contest_prepare.py"), folder / "prepare.py")
    return folder


def run(cmd, cwd, **env):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def losses(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [(e["step"], e["loss"]) for e in map(json.loads, f) if e["event"] == "train"]


def test_the_exported_file_alone_trains_bare_under_torchrun_inside_the_budget(contest_dir, tmp_path):
    exported = contest_dir / "train.py"
    train.main(CHUNKED + [f"--export_submission={exported}", f"--competition_dir={contest_dir}"])
    source = exported.read_text()
    assert len(source.encode()) <= export.SUBMISSION_LIMIT_BYTES
    assert not re.search(r"\bimport data\b", source) and "urllib" not in source and "class KitCorpus" not in source
    assert f"SUBMISSION_ARGS = {CHUNKED!r}" in source
    # what the run cannot reach is left out (and yet the file runs, below): the op it never calls, the exporter
    assert "def softcap_cross_entropy_fwd_kernel(" not in source and "def mlp_fwd_kernel(" in source
    assert "def bundle_source(" not in source and "def check_causality(" not in source
    assert source.index('os.environ["OMP_WAIT_POLICY"] = "PASSIVE"') < source.index("\nimport torch")  # before it loads

    # the contest's launch string: no flags; only the exported file and prepare.py in the folder
    step_log = tmp_path / "steps.txt"
    budget = {"CONTEST_BUDGET_S": "6", "CONTEST_EXCLUDED_STEPS": "2", "CONTEST_STEP_LOG": str(step_log)}
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"],
        contest_dir, **budget)
    final = contest_dir / "out" / "final.pt"
    state = torch.load(final, weights_only=True)
    assert set(state) == {"model", "model_config", "train_config", "step", "train_time", "sha256", "kernels"}  # no optimizer state
    assert set(state["kernels"]) == model_ops() - {"softcap_cross_entropy"}  # what each op ran on
    boundaries = [line.split() for line in step_log.read_text().splitlines()]
    assert [int(i) for i, _ in boundaries] == list(range(state["step"]))  # one record per step
    clock_start = float(boundaries[1][1])  # end of the second (last excluded) step
    assert os.path.getmtime(final) - clock_start <= 6.0  # the save landed inside the budget
    assert state["step"] > 4

    # the unbundled kit, pointed at the same prepare.py, takes the very same steps
    kit_out = tmp_path / "kit"
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *CHUNKED,
         f"--competition_dir={contest_dir}", "--max_steps=4"], ROOT, NEURON_COMPETITION_R1_OUT_DIR=str(kit_out))
    bundled = losses(contest_dir / "out")
    assert losses(kit_out) == bundled[:4] and bundled[0][1] > bundled[-1][1]

    # what the scorer does: import the submitted file, load the model, check it is causal and frozen
    score = ("import torch, prepare, train; m = train.load_for_eval('out/final.pt', torch.device('cpu')); "
             "assert not any(p.requires_grad for p in m.parameters()) and not m.training; "
             "assert prepare.causality_check(m, None, 2, 64, 'cpu')['passed']; "
             "print(prepare.evaluate_bpb(m, None, 4, 64, 'cpu', split='public_val', max_tokens=4096)['val_bpb'])\n"
             # the submitted file checks the digests too: a copy of final.pt with one bit changed is refused
             "b = bytearray(open('out/final.pt', 'rb').read()); b[len(b) // 2] ^= 1; open('damaged.pt', 'wb').write(b)\n"
             "try:\n    train.load_for_eval('damaged.pt', torch.device('cpu'))\n"
             "except ValueError as e:\n    assert 'damaged.pt is damaged' in str(e), e\n"
             "else:\n    raise AssertionError('the submission loaded damaged bytes')")
    bpb = float(run([sys.executable, "-c", score], contest_dir).stdout.split()[-1])
    assert 0 < bpb < 10
    # the kit's local evaluation command reports the scorer's number
    import evaluate

    local = evaluate.main(["bpb", f"--checkpoint={final}", f"--competition_dir={contest_dir}", "--sequence_len=64",
                           "--batch_size=4", "--tokens=4096"])
    assert f"{local['val_bpb']:.4f}" == f"{bpb:.4f}"


def test_evaluate_bpb_on_the_kits_data_equals_the_runs_own_final_evaluation(tmp_path):
    out = tmp_path / "out"
    result = train.main(TINY + ["--max_steps=3", "--time_budget_s=0", "--eval_tokens=2048", "--sample_tokens=0",
                                f"--out_dir={out}", f"--data_dir={tmp_path / 'data'}"])
    import evaluate

    again = evaluate.main(["bpb", f"--checkpoint={out / 'final.pt'}", "--sequence_len=64", "--batch_size=4",
                           "--tokens=2048"])
    assert again["val_bpb"] == pytest.approx(result["final_eval"]["val_bpb"], rel=1e-6)


def test_the_submission_check_refuses_what_the_contest_would():
    ok = "import torch\ndef load_for_eval(path, device):\n    pass\n"
    export.check_submission(ok)
    for source, problem in [
        (ok + "import urllib.request\n", "urllib"),
        (ok + "import tiktoken\n", "tiktoken"),
        (ok + "x = data.prepare()\n", "data"),
        ("import torch\n", "load_for_eval"),
        (ok + "x = left_out(1)\n", "reads left_out but defines none"),
        (ok + "#" * export.SUBMISSION_LIMIT_BYTES, "at most"),
    ]:
        with pytest.raises(ValueError, match=problem):
            export.check_submission(source)


def test_load_for_eval_gives_a_frozen_model_for_contexts_beyond_training(tmp_path):
    from model import GPT, GPTConfig

    config = GPTConfig(sequence_len=32, vocab_size=100, n_layer=1, n_embd=32, n_head=2, n_kv_head=1)
    torch.manual_seed(0)
    model = GPT(config)
    for block in model.blocks:
        torch.nn.init.normal_(block.attn.c_proj.weight, std=0.1)
    checkpoint.save_final(str(tmp_path / "final.pt"), model, config, train.TrainConfig(), step=3, train_time=1.0)
    loaded = train.load_for_eval(str(tmp_path / "final.pt"), torch.device("cpu"))
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    idx = torch.randint(0, 100, (1, 300))  # ~10x the training context
    long = loaded(idx)
    assert long.shape == (1, 300, 100) and torch.isfinite(long).all()
    torch.testing.assert_close(long[:, :32], model(idx[:, :32]))  # the first 32 positions are unchanged


def test_a_model_with_non_finite_weights_is_never_saved_as_final(tmp_path):
    from model import GPT, GPTConfig

    config = GPTConfig(sequence_len=32, vocab_size=100, n_layer=1, n_embd=32, n_head=2, n_kv_head=1)
    model = GPT(config)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="lm_head.weight"):
        checkpoint.save_final(str(tmp_path / "final.pt"), model, config, train.TrainConfig(), 1, 1.0)
    assert not os.path.exists(tmp_path / "final.pt")


def test_the_causality_check_catches_a_model_that_looks_ahead(monkeypatch):
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=32, vocab_size=100, n_layer=1, n_embd=32, n_head=2)).eval()
    for linear in (model.blocks[0].attn.c_proj, model.blocks[0].mlp.c_proj):
        torch.nn.init.normal_(linear.weight, std=0.1)
    contest.check_causality(model, 100, 32, "cpu")
    import kernels

    monkeypatch.setattr(kernels, "attention",  # attention without its causal mask
                        lambda q, k, v, mode, window: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    with pytest.raises(ValueError, match="changed logits at or before it"):
        contest.check_causality(model, 100, 32, "cpu")


def test_the_submission_leaves_out_docstrings_comments_and_help_texts_and_keeps_all_code():
    text = ('"""Module."""\nimport dataclasses  # why\n# a comment line\ns = "# not a comment"\n'
            'def f(x):\n    """Adds one.\n\n    Layouts: none.\n    """\n    return x + 1  # why\n\n\n'
            'class C:\n    """A whole body."""\n\n\n'
            'def opt(default, help):\n    return default\n\n\n'
            'WIDTH = opt(64, "the width, which a bare launch never shows")\n')
    cut = export.for_submission(text)
    assert '"""' not in cut and "#" not in cut.replace('"# not a comment"', "") and "bare launch" not in cut
    assert 'WIDTH = opt(64, "")' in cut and 's = "# not a comment"' in cut and "class C:\n    pass\n" in cut
    namespace = {}
    exec(cut, namespace)
    assert namespace["f"](1) == 2 and namespace["C"].__doc__ is None and namespace["WIDTH"] == 64


def test_the_submission_is_the_kits_code_headed_by_its_commit_and_frozen_flags():
    """No comment or docstring of the kit's is left (the kit's files keep them); its head names the kit's commit
    and the flags it froze; every inlined kernel is there, the code the kit's own."""
    source = export.bundle_source(export.contest.KIT_ROOT, ["--preset=frontier", "--n_layer=4"])
    head = source.splitlines()[:4]
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert commit and commit in head[1] and head[2].endswith("--preset=frontier --n_layer=4")
    assert "\n\n\n" not in source and "# The operations a GPT spends its time in" not in source
    assert "def rope_norm_bwd_kernel(" in source and "def without_docstrings(" not in source
    tree = ast.parse(source)
    assert ast.get_docstring(tree).startswith("The kit as one file")
    assert not any(ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef)))
    assert all(n.args[1].value == "" for n in ast.walk(tree) if isinstance(n, ast.Call)
               and getattr(n.func, "id", None) == "opt" and len(n.args) > 1)


def test_the_submission_keeps_what_the_run_reaches_and_nothing_else():
    """Reachability from train.py's main and the scorer's load_for_eval: an op the run never calls becomes a
    stand-in that says so, and its kernels, glue and shape rules go with it; the exporter goes; every other
    op's kernels stay."""
    whole = export.bundle_source(contest.KIT_ROOT, [])
    pruned = export.bundle_source(contest.KIT_ROOT, [], ["softcap_cross_entropy"])

    def op_definitions(source, op):  # the op's kernels, glue and rules: top-level names that mention it
        names = set().union(*(export.defined_names(node) for node in ast.parse(source).body))
        return {name for name in names if op in name.lower() and name != op}

    assert len(op_definitions(whole, "softcap_cross_entropy")) >= 3  # its kernels, op and rules
    assert op_definitions(pruned, "softcap_cross_entropy") == set()
    for op in model_ops() - {"softcap_cross_entropy"}:
        assert op_definitions(pruned, op) == op_definitions(whole, op) != set()
    assert "def load_for_eval(" in pruned and "def main(" in pruned
    assert "def reachable_names(" not in whole and "FRONTIER_LEVERS" not in whole  # exporter and ablation: unreached
    namespace = {}
    exec(export.unused_op_stub("softcap_cross_entropy"), namespace)
    with pytest.raises(NotImplementedError, match="export again with the flags that do"):
        namespace["softcap_cross_entropy"](1, 2)
    with pytest.raises(ValueError, match="defines no function attention_v2"):
        export.bundle_source(contest.KIT_ROOT, [], ["attention_v2"])


def test_the_exporter_finds_the_ops_the_run_calls():
    from model import GPT, GPTConfig

    config = GPTConfig(sequence_len=32, vocab_size=100, n_layer=1, n_embd=32, n_head=2, n_kv_head=1)
    assert export.ops_called(GPT(config), 2) == model_ops()
    chunked = GPT(GPTConfig(**{**config.__dict__, "loss_chunks": 2}))
    assert export.ops_called(chunked, 2) == model_ops() - {"softcap_cross_entropy"}
    assert chunked.training  # left as it was found


def test_the_log_and_evaluate_info_say_what_each_op_ran(tmp_path, capsys):
    """log.jsonl's first record holds the per-op kernels record final.pt keeps; `evaluate.py info` prints it
    with the step, the configs and the digest status, of a final.pt, of a sharded folder and of a damaged copy."""
    import evaluate

    out = tmp_path / "out"
    train.main(TINY + ["--max_steps=2", "--time_budget_s=0", "--eval_tokens=2048", "--sample_tokens=0",
                       "--checkpoint_every=2", "--shard_optimizer=true", f"--out_dir={out}",
                       f"--data_dir={tmp_path / 'data'}"])
    with open(out / "log.jsonl") as f:
        first = json.loads(f.readline())
    record = torch.load(out / "final.pt", weights_only=True)["kernels"]
    assert first["event"] == "config" and first["kernels"] == record and set(record) == model_ops()
    capsys.readouterr()

    info = evaluate.main(["info", f"--checkpoint={out / 'final.pt'}"])
    printed = capsys.readouterr().out
    assert info["step"] == 2 and info["digests"] == "intact" and info["kernels"] == record
    assert "a final checkpoint" in printed and "step 2," in printed and "digests: intact" in printed
    assert f"  attention  " in printed and record["attention"]["why"] in printed and "n_layer=2" in printed

    folder = evaluate.main(["info", f"--checkpoint={out / 'ckpt_0000002.dcp'}"])
    assert "sharded" in folder["kind"] and folder["step"] == 2 and folder["digests"] == "intact"

    damaged = bytearray((out / "final.pt").read_bytes())
    damaged[len(damaged) // 2] ^= 1
    (tmp_path / "damaged.pt").write_bytes(damaged)
    assert evaluate.main(["info", f"--checkpoint={tmp_path / 'damaged.pt'}"])["digests"].startswith("damaged: ")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(SystemExit, match="notes.txt .* is not a PyTorch checkpoint"):
        evaluate.cli(["info", f"--checkpoint={tmp_path / 'notes.txt'}"])


def test_tab_indentation_changes_no_code_and_no_string():
    text = ('def f(x):\n    if x:\n        s = """a\n    kept\n        as is"""\n'
            '        t = (f"""{x}\n    also kept""", g(1,\n                   2))\n'
            '        return s + t[0]\n    return ""\n')
    tabbed = export.tab_indented(text)
    assert ast.dump(ast.parse(tabbed)) == ast.dump(ast.parse(text))
    assert "\n\t\ts = " in tabbed and "\n    kept\n        as is" in tabbed and "\n    also kept" in tabbed
    assert "\n\t\t\t\t   2))" in tabbed  # a continuation line: its alignment in tabs and the spaces left over


def test_the_frontier_export_leaves_room_and_names_every_path_it_leaves_out(capsys, monkeypatch):
    """At --preset=frontier, the ops the model never calls and the paths a submission never takes
    (SUBMISSION_UNTAKEN) become stand-ins that raise with the fix; each is named in the summary."""
    monkeypatch.setattr(contest, "check_causality", lambda *args: None)  # its own tests check it; here: seconds
    # the ops a frontier model calls do not depend on its depth: two layers instead of ten, seconds less
    monkeypatch.setattr(export, "GPT", lambda config: GPT(dataclasses.replace(config, n_layer=2)))
    cfg, model_cfg = train.parse_args(["--preset=frontier"])
    cfg.export_submission = os.devnull
    contest.export_submission(cfg, model_cfg, ["--preset=frontier"], 8192, None, None)
    printed = capsys.readouterr().out
    size = int(re.search(r"([\d,]+) bytes", printed)[1].replace(",", ""))
    left = int(re.search(r"([\d,]+) left under", printed)[1].replace(",", ""))
    # the forker's room: at least 80 KiB under the portal's limit
    assert left == export.SUBMISSION_LIMIT_BYTES - size >= 81_920
    assert "softcap_cross_entropy" in printed
    for name in [*export.SUBMISSION_UNTAKEN, "KernelOp.check_cases", "KernelOp.model_cases"]:
        assert name in printed
    namespace = {}
    exec(export.untaken_path_stub("resume_state", "why"), namespace)
    with pytest.raises(NotImplementedError, match="resume_state: this submission leaves it out \\(why\\)"):
        namespace["resume_state"]()


def test_a_declaration_field_no_reached_code_reads_becomes_none_and_what_it_named_drops_out():
    text = ("import dataclasses\n@dataclasses.dataclass\nclass Record:\n    run: object\n    check: object\n"
            "def kernel(): pass\ndef check_case(): pass\nOP = declare(Record(run=kernel, check=check_case))\n"
            "def declare(r): return r\ndef main():\n    return OP.run()\n")
    trees = {"m": ast.parse(text)}
    assert {"kernel", "check_case"} <= export.reachable_names(trees, {})
    unread = export.unread_declaration_fields(trees, export.reachable_names(trees, {}))
    assert [field for field, _ in unread["m"]] == ["Record.check"]  # OP.run is read; nothing reads .check
    pruned = export.with_spans_replaced(text, [position for _, position in unread["m"]], "None")
    assert "OP = declare(Record(run=kernel, check=None))" in pruned
    reached = export.reachable_names({"m": ast.parse(pruned)}, {})
    assert "kernel" in reached and "check_case" not in reached
    # in the kit: each op's --check and bench cases drop out; the kernels, which the run launches, stay
    left_out = []
    source = export.bundle_source(contest.KIT_ROOT, [], [], left_out)
    assert "KernelOp.check_cases" in left_out and "KernelOp.kernels" not in left_out
    assert "def _mlp_check_cases(" not in source and "def mlp_bwd_kernel(" in source

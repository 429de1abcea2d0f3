"""CORE evaluation (evaluate.py) on a tiny bundle built here in the reference's file format."""
import copy
import hashlib
import itertools
import json
import math
import os
import random
import re
import socket
import zipfile
from contextlib import nullcontext
from dataclasses import asdict, replace

import pytest
import torch
import torch.nn.functional as F

import data
import evaluate
import train
from model import GPT, GPTConfig

ENC = data.get_tokenizer("bytes")

# ---------------------------------------------------------------------------------------------------------
# a tiny bundle: core.yaml, eval_meta_data.csv and eval_data/*.jsonl, one task of each type plus a 0-shot one.
# Gold answers are balanced over the choices, so a model that always picks the same choice scores chance.

def multiple_choice_examples(n):
    return [{"query": f"Question: what is {i} plus {i % 3}?", "choices": [str(i + k) for k in range(4)], "gold": i % 4}
            for i in range(n)]


def schema_examples(n):
    names = ["Ann", "Bob", "Cleo", "Dev"]
    return [{"context_options": [f"{names[i % 4]} had {i} apples and", f"{names[(i + 1) % 4]} had no apples and"],
             "continuation": f"gave {i} away.", "gold": i % 2} for i in range(n)]


def language_modeling_examples(n):
    return [{"context": f"Count on from {i}: {i} {i + 1} ", "continuation": f"{i + 2} {i + 3}"} for i in range(n)]


TASKS = [  # label, type, few-shot, delimiter (None: the default, a space), random baseline in %, examples
    ("tiny_mc", "multiple_choice", 2, "\nAnswer: ", 25, multiple_choice_examples(12)),
    ("tiny_mc_zeroshot", "multiple_choice", 0, None, 25, multiple_choice_examples(8)),
    ("tiny_schema", "schema", 1, None, 50, schema_examples(10)),
    ("tiny_lm", "language_modeling", 2, None, 0, language_modeling_examples(9)),
]


def write_bundle(directory):
    os.makedirs(os.path.join(directory, "eval_data", "sub"))
    lines = ["icl_tasks:"]
    for label, kind, shots, delimiter, _, examples in TASKS:
        lines += [f"- label: {label}", f"  dataset_uri: sub/{label}.jsonl", f"  num_fewshot: [{shots}]",
                  f"  icl_task_type: {kind}"]
        if delimiter is not None:
            lines.append(f"  continuation_delimiter: {json.dumps(delimiter)}")
        with open(os.path.join(directory, "eval_data", "sub", f"{label}.jsonl"), "w") as f:
            f.writelines(json.dumps(e) + "\n" for e in examples)
    with open(os.path.join(directory, "core.yaml"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(directory, "eval_meta_data.csv"), "w") as f:
        f.write("Eval Task,Task Category,Random baseline\n")
        f.writelines(f"{label},test,{baseline}\n" for label, _, _, _, baseline, _ in TASKS)
    return directory


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: one thread runs them faster than two, and is not slowed by another process's load."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return write_bundle(str(tmp_path_factory.mktemp("core") / "eval_bundle"))


@pytest.fixture(scope="module")
def tasks(bundle):
    return evaluate.load_tasks(bundle)


# ---------------------------------------------------------------------------------------------------------
# prompts, written out from the reference's templates: each shot is rendered with its right answer and
# followed by a blank line; language-modelling contexts are stripped, and so is the prompt without the answer

def test_multiple_choice_prompts():
    shots = [{"query": "Q: 1+1?", "choices": ["2", "5"], "gold": 0}, {"query": "Q: 2+3?", "choices": ["4", "5"], "gold": 1}]
    item = {"query": "Q: 2+2?", "choices": ["3", "4"], "gold": 1}
    assert evaluate.render_multiple_choice(item, "\nA: ", shots) == [
        "Q: 1+1?\nA: 2\n\nQ: 2+3?\nA: 5\n\nQ: 2+2?\nA: 3",
        "Q: 1+1?\nA: 2\n\nQ: 2+3?\nA: 5\n\nQ: 2+2?\nA: 4",
    ]
    assert evaluate.render_multiple_choice(item, " ", []) == ["Q: 2+2? 3", "Q: 2+2? 4"]


def test_schema_prompts():
    shots = [{"context_options": ["Ann", "Bob"], "continuation": "ran.", "gold": 1}]
    item = {"context_options": ["The cat", "The dog"], "continuation": "barked.", "gold": 1}
    assert evaluate.render_schema(item, " ", shots) == ["Bob ran.\n\nThe cat barked.", "Bob ran.\n\nThe dog barked."]


def test_language_modeling_prompts():
    shots = [{"context": " Alpha beta  ", "continuation": "gamma"}]
    item = {"context": "One two ", "continuation": "three"}
    assert evaluate.render_language_modeling(item, " ", shots) == ["Alpha beta gamma\n\nOne two", "Alpha beta gamma\n\nOne two three"]
    assert evaluate.render_language_modeling(item, ": ", []) == ["One two:", "One two: three"]


def test_fewshot_examples_follow_the_reference_draw():
    examples = list(range(20))
    for idx, k in [(7, 3), (0, 10), (19, 10), (5, 19)]:
        # the reference: random.Random(1234 + idx).sample(list of the indices other than idx, k)
        expected = random.Random(1234 + idx).sample([i for i in range(20) if i != idx], k)
        assert evaluate.fewshot_examples(examples, idx, k) == expected
    assert evaluate.fewshot_examples(examples, 7, 0) == []


def spans(task_type, prompts, max_len=None):
    token_lists = [[ENC.eot_token] + ENC.encode_ordinary(p) for p in prompts]
    return [(ENC.decode(t[:s]), ENC.decode(t[s:e])) for t, s, e in evaluate.example_rows(task_type, token_lists, max_len)]


def test_scored_spans_of_each_task_type():
    bos = "<|endoftext|>"
    # multiple choice: everything after the choices' common token prefix (here " ca" is shared)
    assert spans("multiple_choice", ["Q? cat", "Q? car"]) == [(f"{bos}Q? ca", "t"), (f"{bos}Q? ca", "r")]
    # schema: the common token suffix, after each context option
    assert spans("schema", ["Ann ran.", "Bob ran."]) == [(f"{bos}Ann", " ran."), (f"{bos}Bob", " ran.")]
    # language modelling: one sequence, scored where the prompt without the continuation ends
    assert spans("language_modeling", ["One two", "One two three"]) == [(f"{bos}One two", " three")]


def test_long_prompts_are_cut_from_the_left():
    tokens, start, end = evaluate.crop(list(range(10)), 6, 10, max_len=6)
    assert (tokens, start, end) == ([4, 5, 6, 7, 8, 9], 2, 6)
    # a continuation longer than the context: the first kept token has no prediction, so scoring starts after it
    assert evaluate.crop(list(range(10)), 2, 10, max_len=6) == ([4, 5, 6, 7, 8, 9], 1, 6)
    assert evaluate.crop([1, 2, 3], 1, 3, max_len=6) == ([1, 2, 3], 1, 3)


def test_bundle_loading_shuffles_as_the_reference_and_reads_baselines(bundle, tasks):
    assert [t["label"] for t in tasks] == [label for label, *_ in TASKS]
    expected = multiple_choice_examples(12)
    random.Random(1337).shuffle(expected)
    assert tasks[0]["examples"] == expected
    assert (tasks[0]["delimiter"], tasks[2]["delimiter"], tasks[0]["num_fewshot"]) == ("\nAnswer: ", " ", 2)
    assert [t["baseline"] for t in tasks] == [0.25, 0.25, 0.5, 0.0]
    assert evaluate.load_tasks(bundle, max_per_task=5)[0]["examples"] == expected[:5]
    with pytest.raises(ValueError, match="--max_per_task > 2"):
        evaluate.load_tasks(bundle, max_per_task=2)


def test_a_missing_bundle_is_named_with_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an unpacked CORE eval bundle.*--bundle_dir"):
        evaluate.load_tasks(str(tmp_path))
    (tmp_path / "notes.txt").write_text("a folder of something else")
    with pytest.raises(FileNotFoundError, match="has no core.yaml: point --bundle_dir at an unpacked eval bundle"):
        evaluate.ensure_bundle(str(tmp_path))  # refused before any download, and the folder is left alone
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_bundle_download_is_verified_unpacked_and_cached(tmp_path, monkeypatch):
    archive = tmp_path / "served" / "eval_bundle.zip"
    write_bundle(str(tmp_path / "src" / "eval_bundle"))
    os.makedirs(archive.parent)
    with zipfile.ZipFile(archive, "w") as z:
        for folder, _, files in os.walk(tmp_path / "src"):
            for name in files:
                path = os.path.join(folder, name)
                z.write(path, os.path.relpath(path, tmp_path / "src"))
    monkeypatch.setattr(evaluate, "BUNDLE_URL", archive.as_uri())
    monkeypatch.setattr(evaluate, "BUNDLE_SHA256", "0" * 64)
    target = str(tmp_path / "cache" / "eval_bundle")
    monkeypatch.setattr(data.time, "sleep", lambda seconds: None)  # download()'s waits between attempts
    with pytest.raises(ValueError, match="expected 0000.*update BUNDLE_SHA256"):  # not the pinned bundle: refused
        evaluate.ensure_bundle(target)
    assert not os.path.exists(target)
    monkeypatch.setattr(evaluate, "BUNDLE_SHA256", hashlib.sha256(archive.read_bytes()).hexdigest())
    assert evaluate.ensure_bundle(target) == target
    assert len(evaluate.load_tasks(target)) == len(TASKS)
    assert os.listdir(tmp_path / "cache") == ["eval_bundle"]  # the archive is removed once unpacked
    archive.unlink()
    evaluate.ensure_bundle(target)  # cached: nothing is downloaded


# ---------------------------------------------------------------------------------------------------------
# scores: a model that always prefers the right answer, one with no preference, ranks against one process

class FakeModel(torch.nn.Module):
    """Uniform logits, except on the sequences in `known`, whose every next token it predicts confidently.
    It has no context length: the evaluator reads none (the cropping length is max_len's)."""

    def __init__(self, known=()):
        super().__init__()
        self.known = {tuple(k) for k in known}

    def forward(self, idx):
        logits = torch.zeros(*idx.shape, ENC.n_vocab)
        for b, row in enumerate(idx.tolist()):
            while row[-1] == ENC.eot_token:  # right padding; every sequence starts with BOS and ends otherwise
                row.pop()
            if tuple(row) in self.known:
                logits[b, torch.arange(len(row) - 1), row[1:]] = 10.0
        return logits


def gold_sequences(tasks, max_len=None):
    """The token sequence (cropped to max_len if given) of each example's right answer."""
    gold = []
    for task in tasks:
        for idx, item in enumerate(task["examples"]):
            prompts = evaluate.example_prompts(task, idx)
            rows = evaluate.example_rows(task["type"], [[ENC.eot_token] + ENC.encode_ordinary(p) for p in prompts], max_len)
            gold.append(rows[0 if task["type"] == "language_modeling" else item["gold"]][0])
    return gold


@pytest.mark.parametrize("max_len", [None, 48])  # None: prompts scored whole, as the reference; 48: most cut from the left
def test_a_model_that_prefers_the_right_answer_scores_one(tasks, max_len):
    model = FakeModel(gold_sequences(tasks, max_len))
    report = evaluate.evaluate_core(model, ENC, tasks, "cpu", batch_tokens=256, max_len=max_len)
    assert all(r["accuracy"] == 1.0 and r["centred"] == 1.0 for r in report["tasks"].values()), report
    assert report["core"] == 1.0


def test_a_uniform_model_scores_zero(tasks):
    report = evaluate.evaluate_core(FakeModel(), ENC, tasks, "cpu")
    # every choice ties, so the first wins: chance on balanced answers; argmax never reproduces a continuation
    assert [r["accuracy"] for r in report["tasks"].values()] == [0.25, 0.25, 0.5, 0.0]
    assert report["core"] == pytest.approx(0.0, abs=1e-12)
    assert report["tasks"]["tiny_mc"]["examples"] == 12
    lm = [evaluate.example_prompts(tasks[3], i)[1] for i in range(9)]
    assert report["tasks"]["tiny_lm"]["tokens"] == sum(1 + len(p.encode()) for p in lm)  # BOS + one token per byte


def test_the_lowest_loss_wins_by_the_reference_rule(tasks):
    """list.index(min(losses)): a choice with no tokens of its own (here "1", a byte prefix of "10") has a NaN
    mean loss, which wins when it comes first (min() keeps it) and never after."""
    task = dict(tasks[1], examples=[{"query": "Q:", "choices": ["1", "10"], "gold": 0},
                                    {"query": "Q:", "choices": ["10", "1"], "gold": 1}])
    assert evaluate.evaluate_task(FakeModel(), ENC, task, "cpu", nullcontext(), 256)[:2] == (1, 2)


def tiny_checkpoint(path):
    torch.manual_seed(0)
    config = GPTConfig(sequence_len=96, n_layer=1, n_head=2, n_kv_head=1, n_embd=32)
    model = GPT(config)
    with torch.no_grad():  # nanochat's init zeroes the output projections and nearly zeroes the head: make it opinionated
        for p in model.parameters():
            p.normal_(0, 0.5)
    torch.save({"model": model.state_dict(), "model_config": asdict(config), "train_config": asdict(train.TrainConfig())}, path)
    return path


def reference_style_correct(model, task, max_len=None):
    """Right answers when each example is scored on its own, padded only to its longest sequence, with the
    reference's per-sequence slicing: the scoring that batching across examples must not change."""
    correct = 0
    for idx, item in enumerate(task["examples"]):
        prompts = evaluate.example_prompts(task, idx)
        rows = evaluate.example_rows(task["type"], [[ENC.eot_token] + ENC.encode_ordinary(p) for p in prompts], max_len)
        ids = torch.full((len(rows), max(len(t) for t, _, _ in rows)), ENC.eot_token)
        for i, (tokens, _, _) in enumerate(rows):
            ids[i, : len(tokens)] = torch.tensor(tokens)
        with torch.no_grad():
            logits = model(ids)
        losses = F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten(), reduction="none").view(ids.shape)
        if task["type"] == "language_modeling":
            _, s, e = rows[0]
            correct += bool((logits[0].argmax(-1)[s - 1 : e - 1] == ids[0, s:e]).all())
        else:
            means = [losses[i, s - 1 : e - 1].mean().item() for i, (_, s, e) in enumerate(rows)]
            correct += means.index(min(means)) == item["gold"]
    return correct


def test_batching_across_examples_changes_no_score(tmp_path, tasks):
    model, enc = evaluate.load_checkpoint_and_tokenizer(tiny_checkpoint(str(tmp_path / "tiny.pt")), "cpu")
    assert max(len(p) for p in evaluate.example_prompts(tasks[0], 0)) > model.config.sequence_len  # runs past its context
    for task, max_len in itertools.product(tasks, (None, model.config.sequence_len)):
        expected = reference_style_correct(model, task, max_len)
        for static_shapes in (False, True):  # True: Trainium's lengths and filler rows
            correct, _, _ = evaluate.evaluate_task(model, enc, task, "cpu", nullcontext(), 300, static_shapes, max_len=max_len)
            assert correct == expected, (task["label"], max_len, static_shapes)


def test_core_estimate_counts_the_tokens_scored_and_their_forward_flops(tmp_path, tasks):
    model, enc = evaluate.load_checkpoint_and_tokenizer(tiny_checkpoint(str(tmp_path / "tiny.pt")), "cpu")
    for max_len in (None, model.config.sequence_len):
        report = evaluate.evaluate_core(model, enc, tasks, "cpu", max_len=max_len)
        tokens, seconds = evaluate.core_estimate(model, enc, tasks, max_len, peak=1e12, mfu=0.5)
        assert tokens == report["tokens"]
        lengths = [len(t) for task in tasks for rows in evaluate.task_rows(enc, task, range(len(task["examples"])), max_len)
                   for t, _, _ in rows]
        assert sum(lengths) == tokens and (max(lengths) > 96) == (max_len is None)
        forward = copy.copy(model)  # flops_per_token() / 3 at each sequence's length: the forward FLOPs per token
        flops = 0
        for n in lengths:
            forward.config = replace(model.config, sequence_len=n)
            flops += n * forward.flops_per_token() / 3
        assert seconds == pytest.approx(flops / (1e12 * 0.5), rel=1e-12)


def test_prompts_are_scored_whole_unless_cropped_to_the_context(tmp_path, bundle, tasks, capsys):
    checkpoint = tiny_checkpoint(str(tmp_path / "tiny.pt"))
    lengths = [1 + len(p.encode()) for i in range(12) for p in evaluate.example_prompts(tasks[0], i)]  # BOS + a token per byte
    assert max(lengths) > 96  # the tiny model's context
    for flags, expected in [([], sum(lengths)), (["--crop_to_context"], sum(min(n, 96) for n in lengths))]:
        report = evaluate.main(["core", "--checkpoint", checkpoint, f"--bundle_dir={bundle}", *flags])
        assert report["tasks"]["tiny_mc"]["tokens"] == expected and report["crop_to_context"] == bool(flags)
        estimate = re.search(r"CORE: ~([\d,]+) tokens, ~([\d.]+) min at 20% of [\d,.]+ TFLOP/s \(estimate\)",
                             capsys.readouterr().out)
        assert int(estimate[1].replace(",", "")) == report["tokens"]
        assert math.isclose(float(estimate[2]), report["estimated_seconds"] / 60, abs_tol=0.05)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_as_rank(rank, argv, port):
    """What torchrun gives each worker, without its start-up cost: forked, so nothing is imported again."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    evaluate.main(argv)


def test_two_ranks_match_one_process(tmp_path, bundle, tasks, capfd):
    checkpoint = tiny_checkpoint(str(tmp_path / "tiny.pt"))
    model, enc = evaluate.load_checkpoint_and_tokenizer(checkpoint, "cpu")
    single = evaluate.evaluate_core(model, enc, tasks, "cpu", batch_tokens=512)
    report_path = tmp_path / "report.json"
    argv = ["core", "--checkpoint", checkpoint, f"--bundle_dir={bundle}", "--batch_tokens=512", f"--out={report_path}"]
    torch.multiprocessing.start_processes(run_as_rank, args=(argv, free_port()), nprocs=2, start_method="fork")
    sharded = json.loads(report_path.read_text())
    assert sharded["world_size"] == 2 and sharded["dtype"] == "float32"
    for label, r in single["tasks"].items():
        assert [sharded["tasks"][label][k] for k in ("correct", "examples", "tokens")] == [r["correct"], r["examples"], r["tokens"]]
    assert sharded["core"] == pytest.approx(single["core"], abs=1e-12)
    assert len({r["accuracy"] for r in single["tasks"].values()}) > 1  # a real model, not a constant one
    assert capfd.readouterr().out.count("CORE ") == 1  # printed by rank 0 only


def test_bad_input_is_one_line_with_the_fix(tmp_path, bundle):
    with pytest.raises(SystemExit) as exit:  # sys.exit(message): the message on stderr, status 1, no traceback
        evaluate.cli(["core", f"--checkpoint={tmp_path}/missing.pt"])
    assert exit.value.code == (f"error: no checkpoint at {tmp_path}/missing.pt; train one (python train.py writes "
                               "out/final.pt) or pass --checkpoint=PATH")
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    with pytest.raises(SystemExit, match="notes.pt is not a checkpoint written by train.py"):
        evaluate.cli(["core", f"--checkpoint={tmp_path}/notes.pt"])
    checkpoint = tiny_checkpoint(str(tmp_path / "tiny.pt"))
    with pytest.raises(SystemExit, match="use --max_per_task > 2"):
        evaluate.cli(["core", "--checkpoint", checkpoint, f"--bundle_dir={bundle}", "--max_per_task=2"])


def test_help_documents_the_command(capsys):
    with pytest.raises(SystemExit):
        evaluate.main(["--help"])
    assert "python evaluate.py core --checkpoint=out/final.pt" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        evaluate.main(["core", "--help"])
    out = capsys.readouterr().out
    assert all(flag in out for flag in ("--checkpoint", "--bundle_dir", "--max_per_task", "--batch_tokens", "--crop_to_context", "--dtype"))

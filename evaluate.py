"""
Evaluate a saved checkpoint: val_bpb (`bpb`) and the CORE suite (`core`); or say what it holds (`info`).

    python evaluate.py bpb --checkpoint=out/final.pt                      # val_bpb at context 1024
    python evaluate.py bpb --competition_dir=PATH                         # the contest's own evaluate_bpb
    python evaluate.py core --checkpoint=out/final.pt                     # the whole CORE suite
    python evaluate.py core --checkpoint out/final.pt --max_per_task=100  # a quick, approximate pass
    torchrun --standalone --nproc_per_node=4 evaluate.py core --checkpoint=out/final.pt   # data-parallel
    python evaluate.py core --help                                        # every flag
    python evaluate.py info --checkpoint=out/final.pt                     # its config, step, kernels, digests

CORE is the DCLM paper's 22-task in-context suite (HellaSwag, ARC, PIQA, Winograd, LAMBADA, BoolQ, ...), run
rule for rule as nanochat's scripts/base_eval.py and nanochat/core_eval.py run it, so its numbers compare with
nanochat's (to ~1e-7: the reference takes each accuracy as a float32 mean; it departs only where the reference
would fail or score nothing: see crop() and continuation_spans()). Every example is scored by
log-likelihood, nothing is generated. Three task types:
- multiple choice: one prompt per choice, sharing the question; the choice with the lowest mean loss over its
  own tokens wins;
- schema: one prompt per context option, sharing the continuation; the option under which the continuation
  has the lowest mean loss wins;
- language modelling: right only if greedy (argmax) decoding reproduces every token of the continuation.
Each task's examples are shuffled with a fixed seed, its few-shot examples drawn from the others with a seed
per example, prompts start with the BOS token and are scored whole, however long (the model's rotary tables
grow; nanochat's own GPT is not cropped either); --crop_to_context cuts them from the left to the model's
context, as the reference does for a model that declares a max_seq_len. A task's
accuracy is centred by its random baseline, (accuracy - baseline) / (1 - baseline), so chance scores 0 and
perfect 1; CORE is the mean of the 22 centred accuracies.

The eval bundle (nanochat's eval_bundle.zip: core.yaml, eval_meta_data.csv, eval_data/*.jsonl) is downloaded
once into --bundle_dir (resumable, sha256-checked) and unpacked there; a machine that has it already points
--bundle_dir at the unpacked folder. Before scoring, rank 0 counts the tokens the suite will run
and prints an estimate of its time from the model's FLOPs and the devices' peak (see core_estimate()).
Under torchrun each rank scores every world_size-th example and the per-task counts are summed. Rank 0
prints a line per task and writes a JSON report (default: next to the checkpoint, <name>_core.json).
"""
import argparse
import csv
import dataclasses
import json
import math
import os
import random
import sys
import tempfile
import textwrap
import time
import zipfile
from contextlib import nullcontext

from kit import runtime  # before torch: it sets the environment torch reads as it loads (OMP_WAIT_POLICY)

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

import data
import train
from kit import checkpoint, checkpoint_io, contest

BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"  # nanochat's EVAL_BUNDLE_URL
# nanochat publishes no checksum; this sha256 is the one several independent public projects recorded for
# the archive at that URL. If the download ever differs, the bundle changed upstream and scores are no longer
# comparable with published ones, so it is refused rather than used.
BUNDLE_SHA256 = "90a7c19e28ee7a52b4f6e1f87658deb9fde7f63deba2379045bdb1fe9ea5d200"
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
SHUFFLE_SEED = 1337  # the reference's order of each task's examples (which --max_per_task keeps the head of)
FEWSHOT_SEED = 1234  # + the example's index: the reference's few-shot draw
ASSUMED_MFU = 0.20  # of peak, for the time estimate: what the baseline's training throughput implies on Trn2


# -----------------------------------------------------------------------------
# the bundle: download, unpack, load

def ensure_bundle(bundle_dir):
    """Downloads and unpacks the bundle into bundle_dir unless core.yaml is already there. The unpacked
    folder is moved into place whole, so its presence means it is complete."""
    if os.path.exists(os.path.join(bundle_dir, "core.yaml")):
        return bundle_dir
    if os.path.isdir(bundle_dir) and os.listdir(bundle_dir):  # never replace a folder that holds something else
        raise FileNotFoundError(f"{bundle_dir} has no core.yaml: point --bundle_dir at an unpacked eval bundle, or at "
                                "a new folder to download it into")
    archive = os.path.abspath(bundle_dir).rstrip(os.sep) + ".zip"
    print(f"downloading the CORE eval bundle to {archive}")
    try:
        with tqdm(unit="B", unit_scale=True, total=0, desc="eval_bundle.zip") as bar:
            data.download(BUNDLE_URL, archive, sha256=BUNDLE_SHA256, progress=data._Progress(bar))
    except RuntimeError as e:  # network failure after retries: the partial file is kept for the next run
        raise ConnectionError(f"{e}; or pass --bundle_dir=PATH to an unpacked eval_bundle folder") from None
    except data.ChecksumError as e:
        raise ValueError(f"{e}: not the bundle published CORE scores come from; if it changed upstream on purpose, "
                         "update BUNDLE_SHA256 in evaluate.py, or pass --bundle_dir=PATH to an unpacked copy") from None
    parent = os.path.dirname(os.path.abspath(bundle_dir))
    with tempfile.TemporaryDirectory(dir=parent) as tmp:
        with zipfile.ZipFile(archive) as z:
            z.extractall(tmp)
        unpacked = os.path.join(tmp, "eval_bundle")
        if not os.path.exists(os.path.join(unpacked, "core.yaml")):
            raise ValueError(f"{archive} has no eval_bundle/core.yaml: it is not nanochat's eval bundle")
        if os.path.isdir(bundle_dir):  # empty, as checked above
            os.rmdir(bundle_dir)
        os.replace(unpacked, bundle_dir)
    os.remove(archive)  # the unpacked folder is the cache
    return bundle_dir


def load_tasks(bundle_dir, max_per_task=-1):
    """The tasks of core.yaml in order: dicts of label, type, num_fewshot, delimiter, baseline (a fraction)
    and examples (shuffled as the reference does, then cut to max_per_task if that is positive)."""
    import yaml  # evaluation only; the training path never needs it

    paths = {name: os.path.join(bundle_dir, name) for name in ("core.yaml", "eval_meta_data.csv", "eval_data")}
    missing = [p for p in paths.values() if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(f"{bundle_dir} is not an unpacked CORE eval bundle (missing {', '.join(missing)}); "
                                "point --bundle_dir at one, or at an empty folder to download it there")
    with open(paths["core.yaml"], encoding="utf-8") as f:
        config = yaml.safe_load(f)
    with open(paths["eval_meta_data.csv"], encoding="utf-8") as f:
        baselines = {row["Eval Task"]: float(row["Random baseline"]) / 100 for row in csv.DictReader(f)}
    tasks = []
    for spec in config["icl_tasks"]:
        if spec["icl_task_type"] not in TASK_TYPES:
            raise ValueError(f"task {spec['label']}: unknown type {spec['icl_task_type']!r} (known: {', '.join(TASK_TYPES)})")
        if spec["label"] not in baselines:
            raise ValueError(f"task {spec['label']} has no random baseline in {paths['eval_meta_data.csv']}")
        with open(os.path.join(paths["eval_data"], spec["dataset_uri"]), encoding="utf-8") as f:
            examples = [json.loads(line) for line in f if line.strip()]
        random.Random(SHUFFLE_SEED).shuffle(examples)
        if max_per_task > 0:
            examples = examples[:max_per_task]
        num_fewshot = spec["num_fewshot"][0]
        if num_fewshot >= len(examples):
            raise ValueError(f"task {spec['label']} draws {num_fewshot} few-shot examples from the others but has only "
                             f"{len(examples)} examples; use --max_per_task > {num_fewshot} (or -1 for all)")
        tasks.append(dict(label=spec["label"], type=spec["icl_task_type"], num_fewshot=num_fewshot,
                          delimiter=spec.get("continuation_delimiter", " "), baseline=baselines[spec["label"]],
                          examples=examples))
    return tasks


# -----------------------------------------------------------------------------
# prompts: the reference's templates, written out as string concatenation.
# Every few-shot example is rendered with its right answer and followed by a blank line.

def fewshot_examples(examples, idx, k):
    """k other examples, drawn with a seed that depends only on the example's index. The reference samples
    from the list of the other indices; sample() picks positions by the population's length alone, so
    drawing positions in range(n - 1) and skipping idx gives the same examples without building that list
    (which would cost O(n) per example, O(n^2) per task)."""
    if k == 0:
        return []
    positions = random.Random(FEWSHOT_SEED + idx).sample(range(len(examples) - 1), k)
    return [examples[p + (p >= idx)] for p in positions]


def render_multiple_choice(item, delimiter, shots):
    """One prompt per choice: the shots, then the query, the delimiter and that choice."""
    context = "".join(f"{s['query']}{delimiter}{s['choices'][s['gold']]}\n\n" for s in shots)
    return [f"{context}{item['query']}{delimiter}{choice}" for choice in item["choices"]]


def render_schema(item, delimiter, shots):
    """One prompt per context option, each followed by the same continuation."""
    context = "".join(f"{s['context_options'][s['gold']]}{delimiter}{s['continuation']}\n\n" for s in shots)
    return [f"{context}{option}{delimiter}{item['continuation']}" for option in item["context_options"]]


def render_language_modeling(item, delimiter, shots):
    """[prompt without the continuation, prompt with it]. Contexts are stripped (some carry trailing spaces),
    and so is the prompt without, so that its tokens end where the continuation's begin."""
    context = "".join(f"{s['context'].strip()}{delimiter}{s['continuation']}\n\n" for s in shots)
    prompt = f"{context}{item['context'].strip()}{delimiter}"
    return [prompt.strip(), prompt + item["continuation"]]


RENDER = {"multiple_choice": render_multiple_choice, "schema": render_schema, "language_modeling": render_language_modeling}


def common_length(sequences, from_end=False):
    """Length of the prefix (or suffix) that all the sequences share. os.path.commonprefix takes lists too and
    walks only the smallest and the largest (the others share whatever those two share): 10x faster than
    comparing every sequence at every position, on 10-shot prompts of thousands of tokens."""
    if from_end:
        sequences = [s[::-1] for s in sequences]
    return len(os.path.commonprefix(sequences))


def continuation_spans(task_type, token_lists):
    """(start, end) of the scored tokens of each sequence: the tokens after the shared prefix (multiple choice),
    the shared suffix (schema), or what the prompt with the continuation adds (language modelling; only that
    sequence is scored). Returns (sequences, spans)."""
    if task_type == "multiple_choice":
        start = common_length(token_lists)
        return token_lists, [(start, len(t)) for t in token_lists]
    if task_type == "schema":
        suffix = common_length(token_lists, from_end=True)
        return token_lists, [(len(t) - suffix, len(t)) for t in token_lists]
    without, with_continuation = token_lists
    # the reference asserts that `without` is a token prefix of `with`; where it is, this is len(without)
    start = common_length([without, with_continuation])
    return [with_continuation], [(start, len(with_continuation))]


def crop(tokens, start, end, max_len):
    """Keeps the last max_len tokens, as the reference does for a model with a max_seq_len. The first kept
    token has no prediction, so at most max_len - 1 continuation tokens are scored (the reference would
    score an empty span there: a NaN loss, or an LM example counted right)."""
    cut = max(0, len(tokens) - max_len)
    return tokens[cut:], max(start - cut, 1), end - cut


def example_prompts(task, idx):
    """The prompts of one example, its few-shot examples first."""
    shots = fewshot_examples(task["examples"], idx, task["num_fewshot"])
    return RENDER[task["type"]](task["examples"][idx], task["delimiter"], shots)


def example_rows(task_type, token_lists, max_len=None):
    """[(tokens, start, end)]: the sequences scored for one example (BOS + prompt tokens, cropped to max_len
    if given) and the span of each that is scored."""
    rows = [(t, s, e) for t, (s, e) in zip(*continuation_spans(task_type, token_lists))]
    return [crop(*row, max_len) for row in rows] if max_len else rows


def task_rows(enc, task, indices, max_len=None):
    """The rows of each example of the task at indices, its prompts tokenised in one call (threaded)."""
    prompts = [example_prompts(task, idx) for idx in indices]
    tokens = iter(enc.encode_ordinary_batch([p for example in prompts for p in example]))
    return [example_rows(task["type"], [[enc.eot_token] + next(tokens) for _ in p], max_len) for p in prompts]


def core_estimate(model, enc, tasks, max_len, peak, mfu=ASSUMED_MFU):
    """(tokens, seconds): the tokens the suite will score (unpadded; its prompts are rendered and tokenised
    for this, once more than for scoring) and the time their forward FLOPs take at mfu of peak FLOP/s.
    A sequence of n tokens costs n * (2 * N_matmul + 4 * n_layer * n_head * head_dim * n), the forward third
    of flops_per_token() at context n (attention counted at full length, as there)."""
    c = model.config
    per_token, per_position = 2 * model.num_params(matmul_only=True), 4 * c.n_layer * c.n_head * c.head_dim
    lengths = [len(tokens) for task in tasks for rows in task_rows(enc, task, range(len(task["examples"])), max_len)
               for tokens, _, _ in rows]
    return sum(lengths), sum(n * (per_token + per_position * n) for n in lengths) / (peak * mfu)


# -----------------------------------------------------------------------------
# scoring

@torch.no_grad()
def score_rows(model, rows, device, autocast, batch_tokens, bos, static_shapes=False, progress=None):
    """[(mean loss over the span, whether argmax reproduces the span)] for rows of (tokens, start, end).
    Rows are scored longest first in batches of about batch_tokens, right-padded with BOS (a causal model's
    outputs at earlier positions do not see it) to a multiple of 8 tokens. With static_shapes (Trainium),
    to a multiple of 128, where NKI attention applies, and every batch of a length is filled up to the same
    number of rows, so one compiled graph per length serves the whole suite."""
    multiple = 128 if static_shapes else 8
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    results = [None] * len(rows)
    i = 0
    while i < len(order):
        width = math.ceil(len(rows[order[i]][0]) / multiple) * multiple
        n_rows = max(1, batch_tokens // width)
        batch = order[i : i + n_rows]
        shape = (n_rows if static_shapes else len(batch), width)
        idx = torch.full(shape, bos, dtype=torch.long)
        in_span = torch.zeros(shape, dtype=torch.bool)  # positions whose next token is scored; none in filler rows
        for b, r in enumerate(batch):
            tokens, start, end = rows[r]
            idx[b, : len(tokens)] = torch.tensor(tokens)
            in_span[b, start - 1 : end - 1] = True
        idx, in_span = idx.to(device), in_span.to(device)
        with autocast:
            logits = model(idx)
        targets = torch.roll(idx, -1, dims=1)
        losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none").view(idx.shape)
        mean_loss = (losses * in_span).sum(1) / in_span.sum(1)
        exact = ((logits.argmax(-1) == targets) | ~in_span).all(1)
        for r, loss, ok in zip(batch, mean_loss.tolist(), exact.tolist()):
            results[r] = (loss, ok)
        if progress is not None:
            progress.update(len(batch))
        i += len(batch)
    return results


def evaluate_task(model, enc, task, device, autocast, batch_tokens, static_shapes=False, rank=0, world_size=1,
                  progress=None, max_len=None):
    """(correct, examples, tokens scored) over the whole task, this rank having scored examples rank,
    rank + world_size, ...; the token count (unpadded sequence lengths) is what the time depends on.
    Prompts are cut to max_len tokens if given (--crop_to_context), else scored whole as the reference does."""
    mine = range(rank, len(task["examples"]), world_size)
    per_example = task_rows(enc, task, mine, max_len)
    rows = [row for example in per_example for row in example]
    if progress is not None:
        progress.reset(total=len(rows))
    scores = iter(score_rows(model, rows, device, autocast, batch_tokens, enc.eot_token, static_shapes, progress))
    correct = 0
    for idx, example in zip(mine, per_example):
        results = [next(scores) for _ in example]
        if task["type"] == "language_modeling":
            correct += results[0][1]
        else:  # the lowest mean loss wins, by the reference's list.index(min(losses)): a tie goes to the first,
            # and a choice with no tokens of its own (a token prefix of another: a NaN loss) wins only if first
            losses = [loss for loss, _ in results]
            correct += min(range(len(losses)), key=losses.__getitem__) == task["examples"][idx]["gold"]
    # fp32: Trainium has no fp64, and the counts of examples are exact (< 2^24); the token count is near enough
    counts = torch.tensor([correct, len(mine), sum(len(tokens) for tokens, _, _ in rows)], dtype=torch.float32, device=device)
    if world_size > 1:
        dist.all_reduce(counts)
    return tuple(round(c) for c in counts.tolist())


def centred(accuracy, baseline):
    """0 at the task's random baseline, 1 at perfect accuracy."""
    return (accuracy - baseline) / (1 - baseline)


def evaluate_core(model, enc, tasks, device, autocast=nullcontext(), batch_tokens=16384, static_shapes=False,
                  rank=0, world_size=1, show_progress=False, max_len=None):
    """{"tasks": {label: per-task results}, "core": mean centred accuracy}, identical on every rank."""
    results = {}
    with tqdm(unit="seq", disable=not show_progress, leave=False, dynamic_ncols=True) as bar:
        for task in tasks:
            bar.set_description(task["label"])
            t0 = time.time()
            correct, total, tokens = evaluate_task(model, enc, task, device, autocast, batch_tokens, static_shapes,
                                                   rank, world_size, bar if show_progress else None, max_len)
            accuracy = correct / total
            results[task["label"]] = dict(type=task["type"], num_fewshot=task["num_fewshot"], examples=total,
                                          correct=correct, tokens=tokens, accuracy=accuracy, baseline=task["baseline"],
                                          centred=centred(accuracy, task["baseline"]), seconds=round(time.time() - t0, 2))
            if show_progress:
                r = results[task["label"]]
                bar.write(f"{task['label']:<34} {r['num_fewshot']:>2}-shot {task['type']:<17} {total:>6} examples  "
                          f"accuracy {accuracy:.4f}  centred {r['centred']:+.4f}  {r['seconds']:7.1f}s")
    core = sum(r["centred"] for r in results.values()) / len(results)
    return {"tasks": results, "core": core, "tokens": sum(r["tokens"] for r in results.values())}


# -----------------------------------------------------------------------------
# command line

def load_checkpoint_and_tokenizer(path, device, data_dir=None):
    """The model (through load_for_eval, the competition's entry point) and the tokenizer it was
    trained with, resolved from the checkpoint's training config as train.py resolves it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}; train one (python train.py writes out/final.pt) or pass --checkpoint=PATH")
    try:  # memory-mapped: reading the config costs no second copy of the weights (load_for_eval checks the digests)
        train_config = checkpoint_io.load_checkpoint(path, keys=("train_config",), mmap=True, verify=False)["train_config"]
    except checkpoint_io.CheckpointError as e:
        raise ValueError(f"{path} is not a checkpoint written by train.py ({e}); pass the final.pt or ckpt_*.pt "
                         "of a training run") from None
    model = checkpoint.load_for_eval(path, device)  # before the config is used: damaged bytes are named first
    enc = data.get_tokenizer(train_config["tokenizer"], train_config["dataset"], data_dir or train_config["data_dir"])
    if model.config.vocab_size != enc.n_vocab:
        raise ValueError(f"{path} has a {model.config.vocab_size}-token vocabulary but its tokenizer "
                         f"{train_config['tokenizer']} has {enc.n_vocab}; pass the --data_dir it was trained with")
    return model, enc


def run_core(args):
    rank, world_size, device, device_type, _ = runtime.start_ranks(runtime.device_type(args.device))
    dtype = args.dtype if args.dtype != "auto" else "float32" if device_type == "cpu" else "bfloat16"
    model, enc = load_checkpoint_and_tokenizer(args.checkpoint, device, args.data_dir)
    if rank == 0:
        ensure_bundle(args.bundle_dir)
    if world_size > 1:
        dist.barrier()  # the others wait for rank 0's download
    tasks = load_tasks(args.bundle_dir, args.max_per_task)
    autocast = torch.autocast(device_type, dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext()
    max_len = model.config.sequence_len if args.crop_to_context else None
    if rank == 0:
        print(f"CORE: {len(tasks)} tasks, {sum(len(t['examples']) for t in tasks):,} examples; {args.checkpoint} "
              f"({model.num_params():,} parameters, context {model.config.sequence_len}, prompts "
              f"{'cut to it' if max_len else 'whole'}) on {world_size} x {device_type}, {dtype}")
        peak = world_size * runtime.peak_flops(device_type, torch.bfloat16 if dtype == "bfloat16" else torch.float32)
        tokens, estimate = core_estimate(model, enc, tasks, max_len, peak)
        print(f"CORE: ~{tokens:,} tokens, ~{estimate / 60:.1f} min at {100 * ASSUMED_MFU:.0f}% of {peak / 1e12:,.1f} "
              "TFLOP/s (estimate)")
    t0 = time.time()
    static_shapes = device_type == "neuron"  # each new input shape costs a compilation there
    report = evaluate_core(model, enc, tasks, device, autocast, args.batch_tokens, static_shapes, rank, world_size,
                           show_progress=rank == 0, max_len=max_len)
    seconds = time.time() - t0
    report.update(checkpoint=os.path.abspath(args.checkpoint), bundle=os.path.abspath(args.bundle_dir),
                  max_per_task=args.max_per_task, crop_to_context=args.crop_to_context, world_size=world_size,
                  device=device_type, dtype=dtype, seconds=round(seconds, 1))
    if rank == 0:
        report["estimated_seconds"] = round(estimate, 1)
        out = args.out or os.path.splitext(args.checkpoint)[0] + "_core.json"
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"CORE {report['core']:.4f} over {len(tasks)} tasks in {seconds:.0f}s ({report['tokens']:,} tokens, "
              f"{report['tokens'] / seconds:,.0f}/s); report: {out}")
    if world_size > 1:
        dist.destroy_process_group()
    return report


def run_bpb(args):
    """val_bpb of a checkpoint. With the contest's prepare.py (--competition_dir, or beside train.py) it is its
    own evaluate_bpb, the scorer's function, on the public validation shard, called as the baseline-derived
    train.py files call it (FrontierForge recipes/K82s4/train.py), so the number is computed as the
    leaderboard's is; otherwise the kit's evaluation on the held-out split of the data it was trained on."""
    device_type = runtime.device_type(args.device)
    device = "cuda" if device_type == "cuda" else device_type
    prepare = contest.find_prepare(train.TrainConfig(competition_dir=args.competition_dir))
    model = checkpoint.load_for_eval(args.checkpoint, device)
    if prepare is not None:
        tokenizer = prepare.ensure_tokenizer(build_if_missing=False)
        val_bpb = prepare.evaluate_bpb(model, tokenizer, args.batch_size, args.sequence_len, device, split="public_val",
                                       max_tokens=args.tokens)["val_bpb"]
        source = f"{prepare.__file__}'s evaluate_bpb, public validation shard"
    else:
        saved = checkpoint_io.load_checkpoint(args.checkpoint, keys=("train_config",), mmap=True, verify=False)["train_config"]
        names = {f.name for f in dataclasses.fields(train.TrainConfig)}
        cfg = train.TrainConfig(**{k: v for k, v in saved.items() if k in names})
        cfg.eval_tokens, cfg.batch_size = args.tokens, args.batch_size
        corpus = train.kit_corpus(cfg)
        corpus.load(args.batch_size, args.sequence_len, 0, 1, device, True)
        val_bpb = train.evaluate(model, corpus.val_batches, corpus.token_bytes, device, nullcontext())["val_bpb"]
        source = f"the held-out split of {cfg.dataset} ({cfg.tokenizer} tokens)"
    print(f"val_bpb {val_bpb:.4f}: {args.checkpoint} at context {args.sequence_len}, {args.tokens:,} tokens of {source}")
    return {"val_bpb": val_bpb}


def run_info(args):
    """A checkpoint's kind, step, charged time, digest status, per-op kernels record and both configs, printed;
    nothing is loaded onto a device and no data is read. Returns what it printed, as a dict."""
    info = checkpoint.describe_checkpoint(args.checkpoint)
    train_time = f", {info['train_time']:.1f} s charged" if info["train_time"] is not None else ""
    lines = [f"{info['path']}: {info['kind']}", f"step {info['step']:,}{train_time}", f"digests: {info['digests']}",
             "kernels (what each op ran in training, and why):"]
    record = info["kernels"] or {}
    width = max(map(len, record), default=0)
    lines += [f"  {op:<{width}}  {r['ran']:<13}  {r['why']}" for op, r in record.items()] or ["  not recorded"]
    for title in ("model_config", "train_config"):
        settings = ", ".join(f"{k}={v!r}" for k, v in info[title].items())
        lines += [f"{title}:", textwrap.fill(settings, 118, initial_indent="  ", subsequent_indent="  ")]
    print("\n".join(lines))
    return info


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    bpb = commands.add_parser("bpb", help="val_bpb, through the contest's own evaluate_bpb where prepare.py is found",
                              description=run_bpb.__doc__)
    bpb.add_argument("--checkpoint", default="out/final.pt", help="a checkpoint written by train.py (default: %(default)s)")
    bpb.add_argument("--competition_dir", default="", help="folder of the contest's prepare.py ('' = beside train.py)")
    bpb.add_argument("--sequence_len", type=int, default=1024, help="context of the evaluation (the scorer's: %(default)s)")
    bpb.add_argument("--batch_size", type=int, default=8, help="sequences per forward pass (default: %(default)s)")
    bpb.add_argument("--tokens", type=int, default=1_048_576, help="validation tokens to score (default: %(default)s)")
    bpb.add_argument("--device", default="auto", choices=["auto", "neuron", "cuda", "cpu"])
    core = commands.add_parser("core", help="the CORE suite (22 in-context tasks), as nanochat runs it",
                               description="Score a checkpoint on the CORE suite; see `python evaluate.py --help`.")
    core.add_argument("--checkpoint", default="out/final.pt", help="a checkpoint written by train.py (default: %(default)s)")
    core.add_argument("--bundle_dir", default=os.path.join("data_cache", "eval_bundle"),
                      help="the unpacked eval bundle; downloaded here if absent (default: %(default)s)")
    core.add_argument("--max_per_task", type=int, default=-1, help="examples per task, -1 = all (fewer: faster, approximate)")
    core.add_argument("--batch_tokens", type=int, default=16384, help="tokens per forward pass per rank (default: %(default)s)")
    core.add_argument("--crop_to_context", action="store_true",
                      help="cut prompts from the left to the model's training context (the reference scores them whole)")
    core.add_argument("--device", default="auto", choices=["auto", "neuron", "cuda", "cpu"],
                      help="auto: neuron where the Neuron SDK is installed, else cuda if present, else cpu")
    core.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                      help="auto: bf16 autocast on neuron/cuda, fp32 on cpu")
    core.add_argument("--data_dir", help="where the checkpoint's trained tokenizer lives (default: its training run's)")
    core.add_argument("--out", help="the JSON report (default: <checkpoint without .pt>_core.json)")
    info = commands.add_parser("info", description=run_info.__doc__,
                               help="what a checkpoint holds: its config, step, kernels record and digest status")
    info.add_argument("--checkpoint", default="out/final.pt",
                      help="final.pt, a ckpt_*.pt or a sharded ckpt_*.dcp folder (default: %(default)s)")
    args = parser.parse_args(argv)
    return {"core": run_core, "bpb": run_bpb, "info": run_info}[args.command](args)


def cli(argv=None):
    """main(), with bad input (a missing checkpoint or bundle, a wrong path) reported as one line, no traceback."""
    try:
        return main(argv)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    cli()

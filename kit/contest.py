"""
The contest's contract (AWS Trainium Frontier): its prepare.py as the data source and the rule book, the
presets with their sources, and the exporter that writes this kit as the one train.py the contest takes
(the contest's clock is train.py's ChargedClock, beside the loop it times).
"""
import ast
import builtins
import dataclasses
import importlib.util
import io
import os
import re
import sys
import tokenize

import torch

import kernels
from model import GPT


# One-flag configurations, applied before any other --field=value.
#
# baseline: the organiser's Trainium Frontier baseline (aws-neuron/trainium-frontier train.py, which is not
# public), as far as public sources establish it. Sources, cited per value:
#   [R] the organiser's README, embedded in poojithdevan4D/trainium-research-context
#       01-governing-rules-protocol-and-mission.md
#   [L] that team's "unmodified baseline, real reference run", 03-experiment-log.jsonl, first row: 1 rank,
#       eager, seq_len 1024, 800 steps, 52.4M tokens, 59.6M params, ~51k tokens/s
#   [K] marker2601/trainium-simulator recipes/K82s4/train.py, [P] poojithdevan4D/trainium-research-context
#       04-train-research-35c9.py: both are modified baselines; a value is taken from them when both agree,
#       or when one keeps it as an untouched constant
#   [A] karpathy/autoresearch train.py, which the baseline's names and shape follow (DEPTH x ASPECT_RATIO 64 =
#       640, HEAD_DIM 128, EMBEDDING_LR, WARMDOWN_RATIO, ...; autoresearch's prepare.py is the
#       contest's ancestor)
#   [?] not established: the value is the best guess named with it and may differ from the baseline
# Launch on one Trn2 chip, 30 minutes:
#   NEURON_LOGICAL_NC_CONFIG=1 torchrun --standalone --nproc_per_node=8 train.py --preset=baseline --dataset=... 
BASELINE = dict(
    n_layer=10, n_embd=640, n_head=5, n_kv_head=5,  # depth 10, 5 full-MHA heads of 128: 59.6M params at vocab 8192 [R, L]
    mlp="relu2", logit_softcap=15.0,  # ReLU^2 MLP 4x, tanh softcap 15 [R; K, P: LOGIT_SOFTCAP = 15.0]
    sequence_len=1024,  # [L: seq_len 1024; K: SEQ_LEN = 1024]; the scorer evaluates at 1024
    rope_base=100000.0,  # [K, P: ROPE_BASE = 100000]
    wte_init_std=0.8, matrix_init_scale=0.68,  # wte N(0, 0.8) [K: FF_WTE_STD 0.8], q/k/v/fc init x0.68 [?: reported for the baseline, no public line found]; head N(0, 0.001) is the kit's too [K: FF_HEAD_STD]
    total_batch_tokens=65536,  # 52.4M tokens / 800 steps [L]
    batch_size=8,  # sequences per rank per micro-step: 8 ranks x 8 x 1024 = one micro-step per step [K: FF_MB 8; K's repo docs/FINDINGS.md "one 65,536-token micro-batch"]
    embedding_lr=0.3, head_lr=0.006, scalar_lr=0.2,  # AdamW [K: 0.30, 0.006, 0.20; P: 0.3, 0.006, 0.2]
    # AdamW betas (0.8, 0.95) for embedding and head [P: EMBED_ADAMW_BETA2 = 0.95; A], (0.9, 0.95) for scalars
    # [K, P], eps 1e-10, no weight decay [A; K's small decays are tuned] (fixed in make_optimizers)
    residual_scalars=True,  # per-layer resid/x0 scalars: the README's AdamW "scalars" [R]; K builds them in every
    # block (init 1 and 0.05; the kit keeps nanochat's 0.1 [?]) and trains them at scalar_lr with the other scalars
    adamw_width_lr_scaling=True,  # embedding and head lr x (640/768)^-0.5 [R lineage: nanochat's dmodel_lr_scale]
    matrix_lr=0.025,  # Muon [K: MATRIX_LR = 0.025, an untouched constant; P has 0.02, which that team tuned]
    matrix_optimizer="muon", muon_momentum_start=0.85, muon_momentum=0.95, muon_momentum_warmup_steps=300,  # [P: MUON_MOMENTUM_WARMUP_STEPS = 300]
    muon_beta2=0.9,  # NorMuon [P: MUON_BETA2 = 0.9]; Polar Express, cautious WD, lr x sqrt(max(1, rows/cols)): the kit's Muon
    weight_decay=0.2,  # cautious, decayed linearly to 0 [P: WEIGHT_DECAY = 0.2, WD_DECAY_TO_ZERO = True; A: 0.2; K's 0.02 is tuned]
    warmup_steps=0,  # [P: WARMUP_STEPS = 0; A: WARMUP_RATIO = 0.0; K's 20 is tuned]
    warmdown_frac=0.5, final_lr_frac=0.0,  # [?: A's WARMDOWN_RATIO 0.5, FINAL_LR_FRAC 0.0; the README says the baseline's
    # warmdown is "tuned for the training budget"; P has 0.75 / 0.05 and K 0.7, both tuned]
    grad_clip=1.0,  # [P: GRAD_CLIP = 1.0] [?: K has none]
    time_budget_s=1800.0, startup_steps=5,  # 30 minutes [R]; prepare.py's TRAIN_STARTUP_STEPS_EXCLUDED = 5 [K, P]
    compile=False,  # "The baseline is eager-mode" [R]
    data_order="stream",  # the contest's loader streams documents in order, every epoch alike [P: _document_batches docstring]
    eval_tokens=1048576, log_every=20, checkpoint_every=250, sample_tokens=200,
)


# frontier: the baseline plus the levers competitors measured on Trn2 near the baseline's scale (val_bpb deltas
# from FrontierForge, marker2601/trainium-simulator docs/FINDINGS.md). Not tuned together at this scale.
FRONTIER = dict(
    BASELINE,
    mtp_extra=2, mtp_weights="0.5,0.25", mtp_fade="0.45,0.2",  # 3-token MTP (1, 0.5, 0.25), t+3 faded out by 20%, t+2 by 45% of the run: -0.0043
    data_order="stream", row_pool=256,  # row pool of 256 micro-batches: -0.0023
    batch_warmup="0.25@0.06,0.5@0.2", batch_size=2,  # 1/4 then 1/2 of the batch until 6% then 20% of the run: -0.0019;
    # batch_size 2 so a quarter-step is whole micro-batches on 1, 4 or 8 ranks
    mlp="leaky_relu2",  # LeakyReLU(0.35)^2: -0.0017 (kernels.py's leaky_relu2)
    ema_decay=0.99, ema_every=32, ema_blend=0.6,  # EMA every 32 steps, 0.6 blend at the end: -0.0005
    value_embeds=True,  # gated value embeddings: both forks have them (nanochat's design); not measured alone
    mask_bos_targets=True,  # both forks' loaders; not measured alone
    loss_chunks=8,  # fused chunked softcap CE: -2.8% step time
    compile=True,  # both forks compile the step ("compile and static-loss work", marker2601/trainium-simulator docs/FINDINGS.md)
)


# The frontier's levers by name, each the fields it sets (bench.py --ablation turns them on one at a time).
FRONTIER_LEVERS = {
    "mtp": ("mtp_extra", "mtp_weights", "mtp_fade"),
    "row_pool": ("row_pool",),
    "batch_warmup": ("batch_warmup", "batch_size"),
    "leaky_relu2": ("mlp",),
    "ema": ("ema_decay", "ema_every", "ema_blend"),
    "value_embeds": ("value_embeds",),
    "mask_bos": ("mask_bos_targets",),
    "chunked_ce": ("loss_chunks",),
}


# phase2: Phase 2 of the contest, one trn2.48xlarge (16 chips) for 4 hours at the contest's vocabulary of 8,192.
# Compute: 16 chips x 667 TFLOP/s dense bf16 (8 cores x 83.4) x an assumed MFU of 30% x 14,400 s = 4.6e19 FLOPs,
# about nanochat's GPT-2-grade run (dev/LEADERBOARD.md, 4.3e19 FLOPs). Compute-optimal size (Chinchilla, Hoffmann
# et al. 2022): D = 20 N tokens and C = 6 N D give N = sqrt(C / 120) = 6.2e8 parameters and D = 1.2e10 tokens
# (~860k tokens/s). 22 layers of width 1536 (12 heads of 128, multiples of 128 throughout): 623M block
# parameters, 648M with the embedding and head. Steps of 2^20 tokens; micro-batch 4 so one LNC=2 rank (24 GiB)
# holds it: `python bench.py --memory --preset=phase2 --world_size=64` (docs/training.md "Memory plan": 13.98 GiB
# with the optimizer sharded, the default under torchrun; at 128 LNC=1 ranks (12 GiB) with --batch_size=1, 10.19).
# The data: 1.2e10 tokens is more than most prepared corpora, so the start-up line says how many epochs that is.
# Learning rates are the baseline's, not tuned at this size. Launch:
#   NEURON_LOGICAL_NC_CONFIG=2 torchrun --standalone --nproc_per_node=64 train.py --preset=phase2
#   NEURON_LOGICAL_NC_CONFIG=1 torchrun --standalone --nproc_per_node=128 train.py --preset=phase2 --batch_size=1
PHASE2 = dict(
    BASELINE,
    n_layer=22, n_embd=1536, n_head=12, n_kv_head=12, vocab_size=8192,
    total_batch_tokens=1048576, batch_size=4,  # 64 ranks x 4 x 1024 = 4 micro-steps per step
    time_budget_s=14400.0, checkpoint_every=1000,
)


PRESETS = {
    "baseline": BASELINE,
    "frontier": FRONTIER,
    "phase2": PHASE2,
    "trn2": BASELINE,  # the old name of the baseline's shape
}


def load_prepare(folder):
    """The contest's prepare.py in `folder`, imported as the module `prepare`, the name the contest's own code
    imports it by, so that the run and the contest share one module (a prepare.py from another folder replaces
    it). It is autoresearch's descendant: ensure_tokenizer() (or Tokenizer.from_directory()) gives a Tokenizer
    holding a tiktoken Encoding (.enc) and its BOS id, and DATA_DIR holds the parquet shards it downloaded,
    VAL_FILENAME the one held out for validation."""
    path = os.path.realpath(os.path.join(folder, "prepare.py"))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no contest prepare.py in {os.path.dirname(path)}; pass --competition_dir=FOLDER with it")
    loaded = sys.modules.get("prepare")
    if loaded is not None and os.path.realpath(getattr(loaded, "__file__", "") or "") == path:
        return loaded
    spec = importlib.util.spec_from_file_location("prepare", path)
    module = sys.modules["prepare"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def competition_mode(cfg):
    """The contest's prepare.py (find_prepare) with its rules applied to cfg over any flag, or None."""
    prepare = find_prepare(cfg)
    if prepare is not None:
        apply_contest_rules(cfg, prepare)
    return prepare


def find_prepare(cfg):
    """The contest's prepare.py as a module, or None. Looked for in --competition_dir, else beside train.py
    (KIT_ROOT), which is where the organiser's kit keeps it; with it there a bare `train.py` (the contest's
    launch string takes no flags) trains on the contest's data."""
    if cfg.competition_dir or os.path.isfile(os.path.join(KIT_ROOT, "prepare.py")):
        return load_prepare(cfg.competition_dir or KIT_ROOT)
    return None


class ContestCorpus:
    """The contest's data through its prepare.py: its tokenizer (vocabulary 8,192, BOS 8188) and its own
    make_dataloader, the organiser's loader, chosen over the evaluator-layout loader FrontierForge wrote
    because it needs only prepare.py's public names. No validation data is read inside the run: the
    contest's review rejected in-script evaluation on it; `python evaluate.py` scores a
    checkpoint with prepare.py's own evaluate_bpb instead."""

    val_batches = token_bytes = decode = None

    def __init__(self, prepare, mask_bos_targets=False):
        self.prepare, self.mask_bos_targets = prepare, mask_bos_targets
        self.tokenizer = prepare.ensure_tokenizer(build_if_missing=False)
        self.vocab_size, self.bos_id = self.tokenizer.get_vocab_size(), self.tokenizer.get_bos_token_id()

    def load(self, batch_size, sequence_len, rank, world_size, device, master):  # the loader shards by rank itself
        self.batches = self.prepare.make_dataloader(self.tokenizer, batch_size, sequence_len, "train", device)

    def tokens_per_epoch(self):  # make_dataloader streams its shards and exposes no count
        return None

    def next_batch(self):
        x, y, _ = next(self.batches)
        if self.mask_bos_targets:  # the next document's BOS cannot be predicted; the same constant every step
            y = y.masked_fill(y == self.bos_id, -1)
        return x, y

    def record_step(self, step):  # the contest's own record of the step just finished (0-based, as the baseline's)
        self.prepare.record_step_boundary(step - 1)

    def state_dict(self):  # the organiser's loader has no position to save: a resumed run starts it anew
        return None

    def load_state_dict(self, state):
        pass


def apply_contest_rules(cfg, prepare):
    """The constants the contest's prepare.py fixes, and the harness's output folder, over any flag."""
    cfg.time_budget_s = float(prepare.TRAIN_TIME_BUDGET_SECONDS)
    cfg.startup_steps = int(prepare.TRAIN_STARTUP_STEPS_EXCLUDED)
    cfg.startup_cap_s = float(prepare.TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS)
    cfg.out_dir = os.environ.get("NEURON_COMPETITION_R1_OUT_DIR", cfg.out_dir)  # the baseline's --out-dir default
    cfg.eval_every, cfg.sample_tokens = 0, 0


def announce(cfg, prepare):
    """Says, once, what competition mode fixes (nothing without prepare.py)."""
    if prepare is not None:
        print(f"competition mode: {prepare.__file__}'s data, tokenizer and clock (budget {cfg.time_budget_s:.0f} s, "
              f"{cfg.startup_steps} start-up steps excluded, start-up beyond {cfg.startup_cap_s:.0f} s charged); "
              f"no evaluation inside the run; final.pt goes to {cfg.out_dir}", flush=True)


# The kit's root, where train.py and prepare.py's usual place are; in the one-file submission, that file's folder.
KIT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBMISSION_ARGS = []  # export_submission writes the exporting run's flags here: the upload's defaults
# What the one-file submission replaces: the kit's own data path (and with it data.py and its downloads) and the
# exporter, each by a stand-in that says why. What nothing else in the file reaches then drops out by itself.
KIT_ONLY = {
    "kit_corpus": "def kit_corpus(cfg):\n    raise FileNotFoundError(\"no prepare.py beside this train.py: a submission "
                  "trains on the contest's data only\")\n",
    "export_submission": "def export_submission(*args):\n    raise ValueError(\"export from the kit's train.py\")\n",
    "KIT_ROOT": "KIT_ROOT = os.path.dirname(os.path.abspath(__file__))  # this file's folder\n",
}
# The paths the submission's run never takes, each with why: a stand-in that raises with the fix replaces it.
SUBMISSION_UNTAKEN = {
    "run_eval": "its data is the contest's prepare.py, which gives no validation data to the run",
    "sample": "competition mode (always on in a submission) sets sample_tokens=0",
    "resume_state": "the contest launches it bare, never with --resume; resume a run with the kit's train.py",
    "restore": "it restores only what resume_state loads, which this file leaves out",
}
ENTRY_POINTS = ("main", "load_for_eval")  # train.py's run and the contest scorer's hook: what the file must reach
# The files the submission is made of, in the order they are inlined, at train.py's first import of them (after
# its clock's start): each before its first importer, as a module's names are used at its import only by the
# modules after it (model.py's kernels.KERNEL_OPS ...); runtime.py first, before any torch import, as in train.py
BUNDLED = {"runtime": "kit/runtime.py", "contest": "kit/contest.py", "kernels": "kernels.py", "model": "model.py",
           "flags": "kit/flags.py", "optim": "kit/optim.py", "memory": "kit/memory.py",
           "checkpoint_io": "kit/checkpoint_io.py", "checkpoint": "kit/checkpoint.py", "build": "kit/build.py",
           "train": "train.py"}


def defined_names(node):
    """The names a top-level statement defines: a def's or class's, an assignment's, or those of an `if` made
    of nothing else (kernels.py's `if nki is not None: _mlp_op = ...`)."""
    branches = node.body + node.orelse if isinstance(node, ast.If) else []
    if branches and all(defined_names(n) and not isinstance(n, ast.If) for n in branches):
        return set().union(*map(defined_names, branches))
    targets = getattr(node, "targets", [getattr(node, "target", None)])
    return {n for n in [getattr(node, "name", None)] + [t.id for t in targets if isinstance(t, ast.Name)] if n}


def referenced_names(node):
    """Every name `node` may use from the one file's namespace: bare names, and attributes, which reach the
    inlined modules' names (`kernels.mlp`, `runtime.say`); an attribute of anything else only keeps a
    definition that happens to share its name."""
    augmented = {id(n.target) for n in ast.walk(node) if isinstance(n, ast.AugAssign)}  # `x += 1` reads x
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
            if isinstance(n, ast.Attribute) or isinstance(n, ast.Name)
            and (not isinstance(n.ctx, ast.Store) or id(n) in augmented)}  # a binding uses no definition


def reachable_names(trees, replaced):
    """The top-level definitions of the bundled modules (`trees`: {module: ast}) that the run can reach: from
    the ENTRY_POINTS and every statement that defines nothing (imports, the `__main__` block, module-level
    calls), through every name each reached definition refers to. `replaced` ({name: text}): definitions that
    become their stand-in, so what only they referred to is not reached through them."""
    definitions, roots = {}, set(ENTRY_POINTS)
    for tree in trees.values():
        for node in tree.body:
            if bundled_import(node) is not None or is_reexport(node):
                continue
            names = defined_names(node)
            for name in names:
                definitions.setdefault(name, []).append(node)
            if not names:
                roots |= referenced_names(node)
    reached, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in reached or name not in definitions:
            continue
        reached.add(name)
        for node in definitions[name]:
            todo += referenced_names(ast.parse(replaced[name]) if name in replaced else node)
    return reached


def unused_op_stub(op):
    """The stand-in for kernels.py's public function of an op the exported run never calls (its kernels, glue
    and shape rules then drop out): a clear error, should other flags ever call it."""
    return (f"def {op}(*args, **kwargs):  # this file's run never calls it, so its kernels are left out\n"
            f"    raise NotImplementedError(\"{op}: this submission leaves it out, as the run it was exported for "
            f"never calls it; export again with the flags that do\")\n")


def untaken_path_stub(name, why):
    """The stand-in for a definition the submission's run never reaches (SUBMISSION_UNTAKEN): says why."""
    return (f"def {name}(*args, **kwargs):  # left out of this submission: {why}\n"
            f"    raise NotImplementedError(\"{name}: this submission leaves it out ({why}); "
            f"run the kit's train.py for it\")\n")


def bundled_import(node):
    """For a top-level import of bundled modules, the statement that stands for it in the one file: their
    names are already this file's, so `import kernels` or `from kit import contest` makes the module's name
    mean this file's module (`kernels.mlp` then finds the inlined mlp), and `from model import GPT` needs
    nothing. None for any other statement."""
    if isinstance(node, ast.Import) and all(a.name in BUNDLED for a in node.names):
        return " = ".join(a.asname or a.name for a in node.names) + " = sys.modules[__name__]  # inlined here\n"
    if isinstance(node, ast.ImportFrom) and node.module == "kit":
        unlisted = [a.name for a in node.names if a.name not in BUNDLED]
        if unlisted:
            raise ValueError(f"kit/{unlisted[0]}.py is imported but not in BUNDLED: the submission would lack it")
        return " = ".join(a.asname or a.name for a in node.names) + " = sys.modules[__name__]  # inlined here\n"
    if isinstance(node, ast.ImportFrom) and node.module in BUNDLED:
        return ""
    return None


def is_reexport(node):
    """`name = module.name` of a bundled module (train.py's load_for_eval): in the one file it is that name."""
    return isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
        and isinstance(node.value, ast.Attribute) and isinstance(node.value.value, ast.Name) \
        and node.value.value.id in BUNDLED and node.value.attr == node.targets[0].id


def bundle_source(root, argv, unused_ops=(), left_out=None):
    """This kit as one train.py: the BUNDLED modules in order, each module's imports of the others made
    names for the one file's module (`bundled_import`), the KIT_ONLY and SUBMISSION_UNTAKEN definitions and
    `unused_ops` (kernel ops the run never calls) replaced by stand-ins, only the definitions the run can reach
    (`reachable_names`: so no data preparation, no exporter, no kernels of an op it never calls), and `argv`
    baked in as SUBMISSION_ARGS; declaration fields no reached code reads become None
    (`unread_declaration_fields`), each added to `left_out` (a list) as Record.field. Comments are kept, so
    it reads as the kit does (section rules and blank lines shortened, a tab a level: `tab_indented`); the
    inlined modules' docstrings become their first paragraph as comments and their functions' and classes'
    are left out (`without_docstrings`); their whole text stays in the kit's files. Raises
    ValueError where two modules define one name."""
    texts = {name: open(os.path.join(root, path)).read() for name, path in BUNDLED.items()}
    trees = {name: ast.parse(text) for name, text in texts.items()}
    defined = {}
    for name, tree in trees.items():
        for node in tree.body:
            for n in set() if is_reexport(node) else defined_names(node):
                if n in defined and defined[n] != name:
                    raise ValueError(f"{n} is defined in both {BUNDLED[defined[n]]} and {BUNDLED[name]}")
                defined[n] = name
    missing = [op for op in unused_ops if defined.get(op) != "kernels"]
    if missing:
        raise ValueError(f"kernels.py defines no function {missing[0]}, the op's name: the exporter leaves out an op "
                         "by replacing its public function")
    replaced = {**KIT_ONLY, **{name: untaken_path_stub(name, why) for name, why in SUBMISSION_UNTAKEN.items()},
                **{op: unused_op_stub(op) for op in unused_ops}}
    keep = reachable_names(trees, replaced)
    while unread := unread_declaration_fields(trees, keep):  # until what they named is no longer reached
        for name, fields in unread.items():
            texts[name] = with_values_none(texts[name], [position for _, position in fields])
            if left_out is not None:
                left_out += sorted({field for field, _ in fields} - set(left_out))
            trees[name] = ast.parse(texts[name])
        keep = reachable_names(trees, replaced)
    modules = "".join(f"\n# ===== {BUNDLED[name]} =====\n"
                      f"{module_text(without_docstrings(texts[name]), argv, keep, replaced)}"
                      for name in BUNDLED if name != "train")
    source = module_text(texts["train"], argv, keep, replaced, inline=modules + "\n# ===== train.py =====\n")
    # section rules (# ---, # ===) in 5 characters instead of 78, one blank line between definitions instead of two
    source = tab_indented(re.sub(r"\n\n\n+", "\n\n", SECTION_RULE.sub(lambda rule: rule[0][:5], source)))
    check_submission(source)
    return source


def unread_declaration_fields(trees, keep):
    """{module: [(Record.field, its value's (lineno, col_offset, end_lineno, end_col_offset))]} of the keyword
    arguments in the
    reached declarations, `NAME = f(Record(field=value, ...))` or `NAME = Record(...)` with Record a bundled
    dataclass (kernels.py's `ATTENTION_OP = _declare(KernelOp(...))`), whose field no reached code reads as
    an attribute (KernelOp.check_cases, .model_cases: what --check and bench.py read): their values become
    None in the one file, so what only they named (each op's check and model cases) drops out."""
    records = {node.name for tree in trees.values() for node in tree.body if isinstance(node, ast.ClassDef)
               and any("dataclass" in ast.unparse(d) for d in node.decorator_list)}
    declarations, read = [], set()
    for name, tree in trees.items():
        for node in tree.body:
            if not defined_names(node) & keep:
                continue
            call = getattr(node, "value", None) if isinstance(node, ast.Assign) else None
            if isinstance(call, ast.Call) and len(call.args) == 1 and isinstance(call.args[0], ast.Call):
                call = call.args[0]  # _declare(KernelOp(...))
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in records:
                declarations.append((name, call))
            else:
                read |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
    unread = {}
    for name, call in declarations:
        for keyword in call.keywords:
            value = keyword.value
            if keyword.arg not in read and not (isinstance(value, ast.Constant) and value.value is None):
                unread.setdefault(name, []).append((f"{call.func.id}.{keyword.arg}", (
                    value.lineno, value.col_offset, value.end_lineno, value.end_col_offset)))
    return unread


def with_values_none(text, positions):
    """`text` with each span of `positions` (ast's 1-based lines, UTF-8 byte columns) replaced by None."""
    lines = [line.encode() for line in text.splitlines(keepends=True)]
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    data = b"".join(lines)
    for first, first_col, last, last_col in sorted(positions, reverse=True):
        data = data[:starts[first - 1] + first_col] + b"None" + data[starts[last - 1] + last_col:]
    return data.decode()


def without_docstrings(text):
    """`text` without its functions' and classes' docstrings (one that is a class's whole body stays): the kit
    with every kernel's layout notes is over the portal's limit; they stay in the kit's files, and the
    comments, which say why, stay in the submission."""
    lines = text.splitlines(keepends=True)
    cuts = []
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and len(body) > 1 and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            cuts.append((body[0].lineno - 1, body[0].end_lineno))
    for first, last in sorted(cuts, reverse=True):  # from the bottom: earlier line numbers hold
        del lines[first:last]
    return "".join(lines)


def tab_indented(source):
    """`source` with each four spaces of indentation written as one tab (a quarter of the bytes, the same code
    and layout in an editor); lines inside a multi-line string keep their spaces, which are its text."""
    inside_strings, f_string_starts = set(), []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == FSTRING_START:  # Python 3.12+ splits an f-string into tokens: its start to its end
            f_string_starts.append(token.start[0])
        first = f_string_starts.pop() if token.type == FSTRING_END else token.start[0]
        if token.type in (tokenize.STRING, FSTRING_END) and token.end[0] > first:
            inside_strings.update(range(first + 1, token.end[0] + 1))
    lines = source.splitlines(keepends=True)
    for number, line in enumerate(lines, 1):
        spaces = len(line) - len(line.lstrip(" "))
        if spaces >= 4 and number not in inside_strings:
            lines[number - 1] = "\t" * (spaces // 4) + line[spaces - spaces % 4:]
    return "".join(lines)


FSTRING_START, FSTRING_END = getattr(tokenize, "FSTRING_START", -1), getattr(tokenize, "FSTRING_END", -1)


def module_text(text, argv, keep, replaced, inline=None):
    """A module's text, top-level statement by statement (each with the comments above it): those defining
    nothing in `keep` left out, those in `replaced` replaced; `inline`, for train.py, the other modules'
    texts, put at its first import of them."""
    tree = ast.parse(text)
    lines, out, previous_end = text.splitlines(keepends=True), [], 0
    for node in tree.body:
        start, end = node.lineno - 1, node.end_lineno
        while start > previous_end and lines[start - 1].lstrip().startswith(("#", "@")):
            start -= 1  # comments and decorators belong to the statement below them
        chunk, gap = "".join(lines[start:end]), "".join(lines[previous_end:start])
        previous_end = end
        names = defined_names(node)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and node is tree.body[0]:
            if inline is None:  # other modules' docstrings become comments: their first paragraph
                first = node.value.value.strip().split("\n\n")[0]
                chunk = "".join(f"# {line}".rstrip() + "\n" for line in first.splitlines())
        elif bundled_import(node) is not None:
            chunk, inline = (inline or "") + bundled_import(node), ""
        elif is_reexport(node) or names and not names & keep:
            chunk = ""
        elif names & set(replaced):
            chunk = replaced[(names & set(replaced)).pop()]
        elif names == {"SUBMISSION_ARGS"}:
            chunk = f"SUBMISSION_ARGS = {argv!r}  # the flags of the run that exported this file\n"
        out.append(gap + chunk)
    out.append("".join(lines[previous_end:]))
    return "".join(out)


SECTION_RULE = re.compile(r"^# (-{20,}|={20,})$", re.MULTILINE)
SUBMISSION_LIMIT_BYTES = 262_144  # the contest portal's limit for train.py (FrontierForge, marker2601/trainium-simulator)


SUBMISSION_IMPORTS = {"torch", "numpy", "nki", "torch_neuronx", "prepare"}


def check_submission(source):
    """What the contest takes: one file under the portal's size limit, importing only the standard
    library, torch, numpy, the Neuron stack and prepare.py, with no download code, and defining every name
    it reads. Raises ValueError naming the first problem."""
    size = len(source.encode())
    if size > SUBMISSION_LIMIT_BYTES:
        raise ValueError(f"the submission is {size:,} bytes; the contest takes at most {SUBMISSION_LIMIT_BYTES:,}")
    tree = ast.parse(source)
    for node in ast.walk(tree):
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) else []
        for module in modules:
            top = module.split(".")[0]
            if top not in SUBMISSION_IMPORTS and top not in sys.stdlib_module_names or top in ("urllib", "http", "socket", "requests"):
                raise ValueError(f"the submission imports {module}, which the contest's environment may lack or forbids")
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    leftovers = sorted(used & {"data", "urlopen", "hf_hub_download"})
    if leftovers:
        raise ValueError(f"the submission still refers to {leftovers}, which it leaves out")
    unbound = sorted(free_names(tree))
    if unbound:
        raise ValueError(f"the submission reads {', '.join(unbound)} but defines none of them: a definition the "
                         "exporter left out is still used")
    if "def load_for_eval" not in source:
        raise ValueError("the submission defines no load_for_eval, which the scorer calls")


def free_names(tree):
    """The names `tree` reads that nothing in it binds (no definition, assignment, argument, import or
    `except ... as`) and that are not builtins: each a NameError waiting for the line that reads it."""
    bound = set(dir(builtins)) | {"__file__", "__name__"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load) or isinstance(node, ast.arg):
            bound.add(node.id if isinstance(node, ast.Name) else node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {a.asname or a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound


def check_causality(model, vocab_size, length, device, prepare=None, tokenizer=None):
    """Raises ValueError unless the model's logits at each position depend only on the tokens up to it:
    with the contest's prepare.py through its own causality_check (what the contest runs); otherwise by
    changing the tokens after several positions t, which must move no logit at or before t beyond float
    noise, and must move some logit after it (else the check itself is blind)."""
    if prepare is not None:
        result = prepare.causality_check(model, tokenizer, 1, length, device)
        if not result["passed"]:
            raise ValueError(f"prepare.py's causality_check failed: {result}")
        return
    generator = torch.Generator().manual_seed(3)
    idx = torch.randint(0, vocab_size, (1, length), generator=generator)
    with torch.no_grad():
        logits = model(idx.to(device)).float()
        for t in (0, length // 2 - 1, length // 2, length - 2):
            changed = idx.clone()
            changed[:, t + 1:] = torch.randint(0, vocab_size, (1, length - t - 1), generator=generator)
            other = model(changed.to(device)).float()
            leak = (other[:, :t + 1] - logits[:, :t + 1]).abs().max().item()
            if leak > 1e-5 * logits.abs().max().item():
                raise ValueError(f"changing tokens after position {t} changed logits at or before it by {leak:.3g}")
            if torch.equal(other[:, t + 1:], logits[:, t + 1:]):
                raise ValueError(f"changing tokens after position {t} changed no later logit: the check is blind")


def ops_called(model, batch_size):
    """The kernel ops `model` calls in the exported run: a training step's forward, the evaluation's and the
    scorer's (kernels.preview_fallbacks, on fake tensors: nothing is computed)."""
    tokens = torch.zeros(batch_size, model.config.sequence_len, dtype=torch.long)
    training = model.training
    try:
        called = set(kernels.preview_fallbacks(model.train(), tokens, tokens))
        model.eval()
        called |= set(kernels.preview_fallbacks(model, tokens))
        called |= set(kernels.preview_fallbacks(model, tokens, tokens, "none"))
    finally:
        model.train(training)
    return called


def export_submission(cfg, model_cfg, argv, vocab_size, prepare, tokenizer):
    """Writes the one-file train.py after a causality check of the model it would train, leaving out the
    kernel ops that model never calls; says how many bytes are left under the portal's limit."""
    path = cfg.export_submission
    torch.manual_seed(cfg.seed)
    model = GPT(dataclasses.replace(model_cfg, vocab_size=vocab_size)).eval()
    for block in model.blocks:  # zero-initialised output projections would hide a leak
        for linear in (block.attn.c_proj, block.mlp.c_proj):
            torch.nn.init.normal_(linear.weight, std=0.02)
    try:
        check_causality(model, vocab_size, min(model_cfg.sequence_len, 256), "cpu", prepare, tokenizer)
    except ValueError as e:
        raise ValueError(f"not exporting: the model is not causal ({e})") from e
    unused = [op for op in kernels.KERNEL_OPS if op not in ops_called(model, cfg.batch_size)]
    # the contest's prepare.py sits beside the uploaded file, wherever this machine keeps its copy
    flags = [a for a in argv if not a.startswith(("--export_submission", "--competition_dir"))]
    unread = []
    source = bundle_source(KIT_ROOT, flags, unused, unread)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(source)
    size = len(source.encode())
    print(f"wrote {path}: {size:,} bytes, {SUBMISSION_LIMIT_BYTES - size:,} left under the portal's "
          f"{SUBMISSION_LIMIT_BYTES:,}; defaults {flags}; kernel ops left out (never called): "
          f"{', '.join(unused) or 'none'}; paths left out (never taken in a submission): "
          f"{', '.join(SUBMISSION_UNTAKEN)}; declaration fields it never reads (None): {', '.join(unread) or 'none'}; "
          "causality check passed")

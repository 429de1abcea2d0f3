"""
The exporter: this kit as the one train.py the contest takes (`python train.py --export_submission=PATH`).

The file is generated, never edited: the bundled modules inlined in import order, only what the exported run
reaches (from train.py's main and the scorer's load_for_eval), without comments, docstrings and --help texts,
which a bare launch never shows (the kit's files keep them all), headed by the kit's commit and the flags it
froze as the run's defaults. What is left under the portal's 262,144 bytes is the forker's room.
"""
import ast
import builtins
import dataclasses
import io
import os
import re
import subprocess
import sys
import tokenize

import torch

import kernels
from kit import contest
from model import GPT

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
    (`unread_declaration_fields`), each added to `left_out` (a list) as Record.field. What a bare launch never
    shows is left out (`for_submission`: comments, docstrings, --help texts), the indentation is tabs
    (`tab_indented`), and the file opens with `provenance`: the kit's commit and `argv`. Raises ValueError
    where two modules define one name."""
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
            texts[name] = with_spans_replaced(texts[name], [position for _, position in fields], "None")
            if left_out is not None:
                left_out += sorted({field for field, _ in fields} - set(left_out))
            trees[name] = ast.parse(texts[name])
        keep = reachable_names(trees, replaced)
    texts = {name: for_submission(text) for name, text in texts.items()}
    modules = "".join(f"\n# ===== {BUNDLED[name]} =====\n{module_text(texts[name], argv, keep, replaced)}"
                      for name in BUNDLED if name != "train")
    source = module_text(texts["train"], argv, keep, replaced, inline=modules + "\n# ===== train.py =====\n")
    source = provenance(root, argv) + tab_indented(re.sub(r"\n\s*\n(\s*\n)+", "\n\n", source))
    check_submission(source)
    return source


def provenance(root, argv):
    """The one file's head: the kit's commit it was made from, the flags it froze as its defaults, and a
    docstring for its --help."""
    git = ["git", "-C", root]
    try:
        commit = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        changed = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit, changed = "unknown (the kit was not a git checkout)", ""
    flags = " ".join(argv).replace("\n", " ") or "none"
    return (f"# One-file train.py generated by the nanoGPT-for-Trainium kit's exporter (kit/export.py); do not edit.\n"
            f"# Kit commit: {commit}{' with uncommitted changes' if changed else ''}\n"
            f"# Frozen flags (the run's defaults; flags given at launch still apply): {flags}\n"
            '"""The kit as one file: comments, docstrings and --help texts are left out; the kit\'s files have them."""\n')


def for_submission(text):
    """A module's text without what a bare launch never shows: its docstrings, comments and the help texts of
    its config fields (`opt(default, help, ...)`'s second argument). The code is unchanged (the same AST but
    for those strings), and so is every message it prints."""
    text = without_docstrings(text)
    helps = [node.args[1] for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Name) and node.func.id == "opt" and len(node.args) > 1]
    text = with_spans_replaced(text, [(h.lineno, h.col_offset, h.end_lineno, h.end_col_offset) for h in helps], '""')
    return without_comments(text)


def without_comments(text):
    """`text` without its comments: a line that held only a comment goes, a comment after code goes with the
    spaces before it. Text inside strings is never a comment token, so it stays."""
    lines = text.splitlines(keepends=True)
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            row, column = token.start
            code = lines[row - 1][:column].rstrip()
            lines[row - 1] = code + "\n" if code else ""
    return "".join(lines)


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


def with_spans_replaced(text, positions, by):
    """`text` with each span of `positions` (ast's 1-based lines, UTF-8 byte columns) replaced by `by`."""
    lines = [line.encode() for line in text.splitlines(keepends=True)]
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    data = b"".join(lines)
    for first, first_col, last, last_col in sorted(positions, reverse=True):
        data = data[:starts[first - 1] + first_col] + by.encode() + data[starts[last - 1] + last_col:]
    return data.decode()


def without_docstrings(text):
    """`text` without its docstrings: the module's, its functions' and its classes' (one that is a whole body
    becomes `pass`)."""
    lines = text.splitlines(keepends=True)
    cuts = []
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            indent = " " * body[0].col_offset
            cuts.append((body[0].lineno - 1, body[0].end_lineno, [] if len(body) > 1 else [indent + "pass\n"]))
    for first, last, stand_in in sorted(cuts, reverse=True):  # from the bottom: earlier line numbers hold
        lines[first:last] = stand_in
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
    """A module's text, top-level statement by statement (each with its decorators): those defining
    nothing in `keep` left out, those in `replaced` replaced; `inline`, for train.py, the other modules'
    texts, put at its first import of them."""
    tree = ast.parse(text)
    lines, out, previous_end = text.splitlines(keepends=True), [], 0
    for node in tree.body:
        start, end = node.lineno - 1, node.end_lineno
        while start > previous_end and lines[start - 1].lstrip().startswith("@"):
            start -= 1  # decorators belong to the statement below them
        chunk, gap = "".join(lines[start:end]), "".join(lines[previous_end:start])
        previous_end = end
        names = defined_names(node)
        if bundled_import(node) is not None:
            chunk, inline = (inline or "") + bundled_import(node), ""
        elif is_reexport(node) or names and not names & keep:
            chunk = ""
        elif names & set(replaced):
            chunk = replaced[(names & set(replaced)).pop()]
        elif names == {"SUBMISSION_ARGS"}:
            chunk = f"SUBMISSION_ARGS = {argv!r}\n"
        out.append(gap + chunk)
    out.append("".join(lines[previous_end:]))
    return "".join(out)


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
        contest.check_causality(model, vocab_size, min(model_cfg.sequence_len, 256), "cpu", prepare, tokenizer)
    except ValueError as e:
        raise ValueError(f"not exporting: the model is not causal ({e})") from e
    unused = [op for op in kernels.KERNEL_OPS if op not in ops_called(model, cfg.batch_size)]
    # the contest's prepare.py sits beside the uploaded file, wherever this machine keeps its copy
    flags = [a for a in argv if not a.startswith(("--export_submission", "--competition_dir"))]
    unread = []
    source = bundle_source(contest.KIT_ROOT, flags, unused, unread)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(source)
    size = len(source.encode())
    print(f"wrote {path}: {size:,} bytes, {SUBMISSION_LIMIT_BYTES - size:,} left under the portal's "
          f"{SUBMISSION_LIMIT_BYTES:,}; defaults {flags}; kernel ops left out (never called): "
          f"{', '.join(unused) or 'none'}; paths left out (never taken in a submission): "
          f"{', '.join(SUBMISSION_UNTAKEN)}; declaration fields it never reads (None): {', '.join(unread) or 'none'}; "
          "causality check passed")

"""
Flags and config checks: --field=value (or --field value) for the config dataclasses' fields, --help, each
field's rule as its `opt` declares it, the rules between fields, the recipe levers' list-valued flags, and
the batch a run asks for at its number of ranks. All before any data, model or device is touched.
"""
import collections
import dataclasses
import difflib
import sys

from model import field_problems


def split_flags(argv):
    """[(name, value)] from --name=value and --name value alike (the convention of data.py's argparse);
    --help stays a lone flag."""
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            pairs.append(("help", None))
        elif not arg.startswith("--") or arg == "--":
            sys.exit(f"error: arguments are --field=value or --field value, got {arg!r}")
        elif "=" in arg:
            pairs.append(tuple(arg[2:].split("=", 1)))
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            pairs.append((arg[2:], argv[i + 1]))
            i += 1
        else:
            sys.exit(f"error: {arg} needs a value: {arg}=VALUE or {arg} VALUE")
        i += 1
    return pairs


def print_help(doc, configs, presets):
    print(doc)
    rows = [("--preset=NAME", f"apply a preset first: {', '.join(presets)}")]
    for title, cls in configs.items():
        rows.append((f"{title}:", ""))
        rows += [(f"--{f.name}={str(f.default).lower() if isinstance(f.default, bool) else f.default}", f.metadata["help"])
                 for f in dataclasses.fields(cls)]
    width = max(len(flag) for flag, _ in rows)
    for flag, text in rows:
        print(f"  {flag:<{width}}  {text}" if text else f"\n{flag}")


def parse_flags(argv, configs, presets, doc):
    """{title: config} for `configs` ({title: dataclass}) from --field=value (or --field value) for any of
    their fields, after the fields of --preset=NAME if given; unknown names get a close match suggested.
    --help prints `doc` and every field with its default and help."""
    pairs = split_flags(argv)
    if ("help", None) in pairs:
        print_help(doc, configs, presets)
        sys.exit(0)
    for name in [v for k, v in pairs if k == "preset"]:
        if name not in presets:
            sys.exit(f"error: unknown --preset={name}; presets: {', '.join(presets)}")
        pairs = [(k, str(v)) for k, v in presets[name].items()] + pairs
    owners = {f.name: (title, f) for title, cls in configs.items() for f in dataclasses.fields(cls)}
    values = {title: {} for title in configs}
    for key, value in pairs:
        if key == "preset":
            continue
        if key not in owners:
            near = difflib.get_close_matches(key, owners, n=1)
            sys.exit(f"error: unknown config field --{key}" + (f"; did you mean --{near[0]}?" if near else "") + " (--help lists all)")
        title, f = owners[key]
        kind = type(f.default)
        try:
            values[title][key] = {"true": True, "false": False}[value.lower()] if kind is bool else kind(value)
        except (KeyError, ValueError):
            sys.exit(f"error: --{key}={value!r} is not a valid {kind.__name__} (default {f.default!r})")
    # built from all values at once, so GPTConfig resolves n_kv_head=0 against the final n_head
    return {title: cls(**values[title]) for title, cls in configs.items()}


def validate_config(cfg, model_cfg):
    """Every field's type, and its range or choices as its `opt` declares them, all problems in one message
    with the fix. Needs no data, model or device, so train.py's main calls it first. (The tokenizer is
    checked when it is loaded.)"""
    problems = field_problems(cfg, "--")
    if not problems:
        if not (cfg.max_steps or cfg.time_budget_s):
            problems.append("set --max_steps or --time_budget_s (or both), otherwise training never stops")
        if cfg.muon_momentum >= 1 or cfg.muon_momentum_start >= 1 or cfg.muon_beta2 >= 1:
            problems.append("Muon's momenta and --muon_beta2 must be below 1 (a decay of 1 never forgets)")
        if not cfg.out_dir:
            problems.append("--out_dir must name a folder")
    if problems:
        raise ValueError("; ".join(problems) + " (--help lists every field)")
    model_cfg.validate()


def floats(text):
    return [float(v) for v in text.split(",") if v.strip()]


def batch_warmup_phases(cfg):
    """[(fraction of total_batch_tokens, progress until which it holds), ...] from FRACTION@PROGRESS,..."""
    phases = []
    for part in filter(None, cfg.batch_warmup.split(",")):
        fraction, _, until = part.partition("@")
        phases.append((float(fraction), float(until)))
    return phases


def validate_levers(cfg, model_cfg, accum_steps):
    """The recipe levers' settings, checked before any data or model is built."""
    problems = []
    if cfg.row_pool < 0 or (cfg.row_pool and cfg.data_order != "stream"):
        problems.append(f"--row_pool={cfg.row_pool} needs --data_order=stream (shuffled data is already fully mixed) and >= 0")
    try:
        weights, ends, phases = floats(cfg.mtp_weights), floats(cfg.mtp_fade), batch_warmup_phases(cfg)
    except ValueError as e:
        raise ValueError(f"--mtp_weights, --mtp_fade and --batch_warmup are numbers like 0.5,0.25 / 0.45,0.2 / 0.25@0.06 ({e})")
    if len(weights) != model_cfg.mtp_extra or len(ends) != model_cfg.mtp_extra:
        problems.append(f"--mtp_weights and --mtp_fade need one value per extra target (--mtp_extra={model_cfg.mtp_extra}), "
                        f"got {len(weights)} and {len(ends)}")
    if any(not 0 < e <= 1 for e in ends) or ends != sorted(ends, reverse=True) or len(set(ends)) != len(ends):
        problems.append(f"--mtp_fade={cfg.mtp_fade!r}: progress points in (0, 1], decreasing (the farthest target fades first)")
    for fraction, until in phases:
        micro = fraction * accum_steps
        if not (0 < until < 1 and 0 < fraction < 1 and abs(micro - round(micro)) < 1e-9 and round(micro) >= 1):
            problems.append(f"--batch_warmup phase {fraction}@{until}: the fraction of the step's {accum_steps} micro-batch(es) "
                            f"must be a whole number >= 1 and 0 < progress < 1; lower --batch_size for more micro-batches per step")
    if [u for _, u in phases] != sorted(u for _, u in phases):
        problems.append(f"--batch_warmup={cfg.batch_warmup!r}: phases in order of progress")
    if not (0 <= cfg.ema_decay < 1 and cfg.ema_every >= 1 and 0 <= cfg.ema_blend <= 1):
        problems.append("--ema_decay in [0, 1), --ema_every >= 1, --ema_blend in [0, 1]")
    if problems:
        raise ValueError("invalid recipe: " + "; ".join(problems))


# One optimizer step's batch: its tokens over all ranks, and the micro-batches each rank runs for it (a batch
# warm-up runs a fraction of them).
Batch = collections.namedtuple("Batch", "tokens micro_steps")


def check_batch(cfg, model_cfg, world_size, prepare):
    """The Batch, refused unless whole, and the recipe levers checked, before any data or model is built."""
    micro_tokens = cfg.batch_size * model_cfg.sequence_len * world_size
    total_tokens = cfg.total_batch_tokens or micro_tokens
    if total_tokens % micro_tokens:
        raise ValueError(
            f"total_batch_tokens={total_tokens} is not a multiple of batch_size * sequence_len * world_size = "
            f"{cfg.batch_size} * {model_cfg.sequence_len} * {world_size} = {micro_tokens}"
        )
    validate_levers(cfg, model_cfg, total_tokens // micro_tokens)
    if prepare is not None and cfg.row_pool:
        raise ValueError("--row_pool reorders the kit's loader; the contest's make_dataloader streams its own rows. "
                         "Pass --row_pool=0 in competition mode")
    return Batch(total_tokens, total_tokens // micro_tokens)

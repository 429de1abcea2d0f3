"""
Train a GPT from scratch. One process:

    python train.py                              # small model on built-in Shakespeare, a few CPU minutes
    python train.py --n_layer=6 --max_steps=500  # any config field, --field=value or --field value
    python train.py --help                       # every field with its default

Data-parallel, one rank per device (NeuronCore, GPU or CPU process):

    torchrun --standalone --nproc_per_node=4 train.py

Beside the contest's prepare.py (the AWS Trainium Frontier kit), a bare `train.py` trains on its data and
tokenizer under its clock (competition mode); `--export_submission=PATH` writes the one-file train.py it takes.

The clock is the contest's: device-synchronised wall-clock time from the end of the first `startup_steps`
steps (compilation), with start-up beyond `startup_cap_s` charged too. Evaluations, checkpoints and the
final save are on it; the run stops early enough for the final save to land inside `time_budget_s`.
The learning-rate schedule follows progress: step / max_steps or charged time / time_budget_s.
This file is the trainer; the model is model.py (kernels: kernels.py), the data data.py, and what a learner
need not read is kit/: the contest (contest.py), flags, devices and the log (runtime.py), the memory plan
(memory.py), checkpoints and resume (checkpoint.py) and the optimizers (optim.py).
"""
import functools
import logging
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

from kit import contest, checkpoint, memory, optim, runtime  # contest first: the contest's clock counts from the process's start
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from kernels import preview_fallbacks
from model import GPT, GPTConfig, opt


@dataclass
class TrainConfig:
    # data
    dataset: str = opt("shakespeare", "shakespeare (built in) or a dataset prepared by data.py")
    tokenizer: str = opt("bytes", "bytes (257 ids, offline) | gpt2 | bpe<N> | competition (see data.py)")
    data_dir: str = opt("data_cache", "where token shards are prepared and read", resumable=True)
    # batch: tokens per optimizer step = batch_size * sequence_len * world_size * accumulation steps
    batch_size: int = opt(8, "sequences per micro-batch per rank", bounds=(1, None))
    total_batch_tokens: int = opt(0, "tokens per optimizer step; 0 = one micro-batch per rank", bounds=(0, None))
    # optimisation: Muon for hidden matrices, AdamW for embedding and head
    matrix_optimizer: str = opt("muon", "muon (the kit's own) | adamw, for the attention and MLP matrices", choices=("muon", "adamw"))
    matrix_lr: float = opt(0.02, "learning rate of the attention and MLP matrices", bounds=(0, None))
    embedding_lr: float = opt(0.3, "AdamW learning rate of the token embedding", bounds=(0, None))
    head_lr: float = opt(0.004, "AdamW learning rate of lm_head", bounds=(0, None))
    scalar_lr: float = opt(0.2, "AdamW learning rate of 0-D/1-D parameters (gates, residual scalars), if any", bounds=(0, None))
    weight_decay: float = opt(0.0, "weight decay of the matrices (Muon: cautious, decayed to 0 with progress)", bounds=(0, None))
    muon_momentum: float = opt(0.95, "Muon's Nesterov momentum after its warm-up", bounds=(0, 1))
    muon_momentum_start: float = opt(0.85, "Muon's momentum at step 0", bounds=(0, 1))
    muon_momentum_warmup_steps: int = opt(300, "steps over which Muon's momentum rises to muon_momentum", bounds=(0, None))
    muon_beta2: float = opt(0.9, "NorMuon's decay of the per-row second moment; 0 turns NorMuon off", bounds=(0, 1))
    grad_clip: float = opt(1.0, "clip the global gradient norm to this; 0 disables", bounds=(0, None))
    shard_optimizer: str = opt("auto", "each rank keeps the optimizer state of, and updates, its share of the parameters: "
                               "auto (with more than one rank) | true | false (DDP: every rank all of it)",
                               choices=("auto", "true", "false"), resumable=True)
    warmup_steps: int = opt(10, "linear learning-rate warmup, in optimizer steps", bounds=(0, None))
    warmdown_frac: float = opt(0.4, "final fraction of progress over which the lr decays linearly", bounds=(0, 1))
    final_lr_frac: float = opt(0.0, "lr at the end of warmdown, as a fraction of the peak", bounds=(0, 1))
    max_steps: int = opt(0, "stop after this many optimizer steps; 0 = no step limit", bounds=(0, None), resumable=True)
    time_budget_s: float = opt(150.0, "charged seconds the run may take, final save included; 0 = no limit", bounds=(0, None), resumable=True)
    startup_steps: int = opt(1, "first steps before the clock starts (compilation); the contest's is 5", bounds=(0, None), resumable=True)
    startup_cap_s: float = opt(900.0, "start-up (process start to the clock's start) beyond this is charged", resumable=True)
    # evaluation and logging
    eval_every: int = opt(0, "evaluate every N steps; 0 = only before and after training", bounds=(0, None), resumable=True)
    charge_evals: bool = opt(True, "periodic evaluations and checkpoints count against time_budget_s", resumable=True)
    eval_tokens: int = opt(65536, "validation tokens per evaluation", bounds=(1, None), resumable=True)
    log_every: int = opt(10, "print and log a training line every N steps", bounds=(1, None), resumable=True)
    sample_tokens: int = opt(300, "tokens of text sampled at the end; 0 = none", bounds=(0, None), resumable=True)
    # checkpoints
    out_dir: str = opt("out", "log.jsonl, checkpoints and final.pt go here", resumable=True)
    checkpoint_every: int = opt(0, "write out_dir/ckpt_<step>.pt every N steps; 0 = only final.pt", bounds=(0, None), resumable=True)
    keep_checkpoints: int = opt(2, "periodic checkpoints kept on disk (oldest deleted first)", bounds=(1, None), resumable=True)
    resume: str = opt("", "'latest' (newest checkpoint in out_dir of this run's config) or a checkpoint path", resumable=True)
    resume_any_config: bool = opt(False, "let --resume=latest take a checkpoint whose run config differs from now", resumable=True)
    start_over: bool = opt(False, "start a new run in a used out_dir; its files move to out_dir/old_<time>/", resumable=True)
    # system
    device: str = opt("auto", "auto | neuron | cuda | cpu", choices=("auto", "neuron", "cuda", "cpu"), resumable=True)
    dtype: str = opt("auto", "matmul precision: auto (bf16 where the device multiplies it fast) | bfloat16 | float32",
                     choices=("auto", "bfloat16", "float32"))
    device_memory_gb: float = opt(0.0, "GiB of memory per rank the memory plan checks against; 0 = the device's", bounds=(0, None), resumable=True)
    peak_tflops: float = opt(0.0, "peak TFLOP/s of one rank for MFU; 0 = device table (measured on CPU)", bounds=(0, None), resumable=True)
    compile: bool = opt(True, "torch.compile the training forward/backward (needs a C++ compiler on CPU)", resumable=True)
    seed: int = opt(1337, "seed of initialisation and data order", bounds=(0, 2**63 - 1))  # numpy's generator takes no negative seed
    deterministic: bool = opt(False, "deterministic algorithms only (see docs/training.md: what is bit-exact)", resumable=True)
    # the contest (AWS Trainium Frontier)
    competition_dir: str = opt("", "folder of the contest's prepare.py; '' = beside train.py (then it is used)", resumable=True)
    export_submission: str = opt("", "write this kit as one train.py for upload, these flags its defaults", resumable=True)
    # recipe levers (docs/training.md "Presets"): all off by default, on in --preset=frontier
    adamw_width_lr_scaling: bool = opt(False, "scale embedding and head AdamW lrs by (n_embd / 768)^-0.5, as the baseline does")
    data_order: str = opt("shuffled", "shuffled (every window, random order) | stream (in order, as the contest's loader)",
                          choices=("shuffled", "stream"))
    row_pool: int = opt(0, "with data_order=stream: draw rows from a pool of about this many micro-batches; 0 = off")
    mask_bos_targets: bool = opt(False, "ignore training targets that are the document separator (unpredictable)")
    batch_warmup: str = opt("", "smaller steps early: FRACTION@PROGRESS,... e.g. 0.25@0.06,0.5@0.2 (of total_batch_tokens)")
    mtp_weights: str = opt("", "initial loss weights of the extra targets t+2, t+3, ... (model's mtp_extra of them)")
    mtp_fade: str = opt("", "progress at which each extra target's weight has faded to 0, e.g. 0.45,0.2")
    ema_decay: float = opt(0.0, "per-step decay of an EMA of the weights blended into the final model; 0 = off")
    ema_every: int = opt(1, "update the EMA every N steps (with decay^N)")
    ema_blend: float = opt(1.0, "final weights = (1 - blend) * live + blend * EMA")


# the contest's scoring hook, which the scorer looks up in train.py
load_for_eval = checkpoint.load_for_eval


def parse_args(argv):
    """(TrainConfig, GPTConfig) from --field=value or --field value for any of their fields, after the fields
    of --preset=NAME (kit/contest.py's PRESETS) if given; --help lists every field."""
    configs = runtime.parse_flags(argv, {"model": GPTConfig, "training": TrainConfig}, contest.PRESETS, __doc__)
    return configs["training"], configs["model"]


# -----------------------------------------------------------------------------
# the schedule


def lr_multiplier(cfg, step, progress):
    """Linear warmup over warmup_steps, constant, then linear warmdown over the last warmdown_frac of
    progress (0 at the start of training, 1 at max_steps or time_budget_s)."""
    warmup = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    if progress < 1 - cfg.warmdown_frac:
        return warmup
    left = max(0.0, 1 - progress) / cfg.warmdown_frac
    return warmup * (cfg.final_lr_frac + (1 - cfg.final_lr_frac) * left)


def schedule(cfg, step, progress):
    """This step's scheduled values: the lr multiplier, Muon's momentum (warmed up from
    muon_momentum_start over muon_momentum_warmup_steps, as the baseline does), Muon's weight decay
    (linearly to zero at the end of training, nanochat's rule), the MTP weights and the batch fraction."""
    warm = min(1.0, step / cfg.muon_momentum_warmup_steps) if cfg.muon_momentum_warmup_steps else 1.0
    return {"lr_scale": lr_multiplier(cfg, step, progress),
            "momentum": cfg.muon_momentum_start + warm * (cfg.muon_momentum - cfg.muon_momentum_start),
            "weight_decay": cfg.weight_decay * (1 - progress),
            "mtp_weights": mtp_weights(cfg, progress),
            "batch_fraction": next((f for f, until in batch_warmup_phases(cfg) if progress < until), 1.0)}


def floats(text):
    return [float(v) for v in text.split(",") if v.strip()]


def mtp_weights(cfg, progress):
    """Each extra target's weight fades linearly to 0 by its mtp_fade progress, the farthest target first
    and each fade starting where the farther one's ended (FrontierForge: t+3 over 0-20% of the run, t+2
    over 20-45%, then plain next-token prediction; they step the fade in 4 levels per phase)."""
    weights, ends = floats(cfg.mtp_weights), floats(cfg.mtp_fade)
    starts = ends[1:] + [0.0]
    return tuple(w * min(1.0, max(0.0, (end - progress) / (end - start))) for w, end, start in zip(weights, ends, starts))


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


def apply_schedule(optimizers, values, model=None):
    """Writes this step's values into the 0-d device tensors the optimizers read (and the model's MTP
    weights), each by a copy from a host tensor. Nothing in the step then takes a Python number that
    changes from step to step: on Neuron a changed scalar argument re-traces and recompiles (a competitor
    measured 408 vs 918 steps in 900 s on Trn2 until their hyperparameters became device tensors)."""
    for o in optimizers:
        for group in o.param_groups:
            group["lr"].copy_(torch.tensor(group["peak_lr"] * values["lr_scale"]), non_blocking=True)
            if isinstance(o, optim.Muon):
                group["momentum"].copy_(torch.tensor(values["momentum"]), non_blocking=True)
                group["weight_decay"].copy_(torch.tensor(values["weight_decay"]), non_blocking=True)
    if model is not None and model.mtp_weights.numel():
        model.mtp_weights.copy_(torch.tensor(values["mtp_weights"]), non_blocking=True)


def wrap_for_training(raw_model, cfg, device_type, device, example, sharded=False):
    """The module the training step calls: compiled if asked, and DDP-wrapped under torchrun unless the
    optimizer is sharded (optim.Sharding then exchanges the gradients itself). `example`:
    arguments of one forward call (their shapes, dtypes and devices: the kernels' fallbacks are decided and
    logged on them before compilation, as they cannot be from inside the compiled graph; what each op runs
    becomes raw_model.kernels_ran, which the checkpoints keep so that scoring runs each op as training did)."""
    model = raw_model
    with runtime.autocast_context(cfg, device_type):  # what each kernel op runs, logged and kept for scoring
        raw_model.kernels_ran = preview_fallbacks(raw_model, *example)
    if cfg.compile:
        # the Neuron backend needs one graph for the whole step: fail loudly on a graph break
        model = torch.compile(raw_model, backend="neuron", fullgraph=True) if device_type == "neuron" else torch.compile(raw_model)
    if dist.is_initialized() and not sharded:
        model = DDP(model, device_ids=[torch.device(device).index] if device_type == "cuda" else None)
    return model


def train_step(model, raw_model, optimizers, micro_batches, device, autocast, grad_clip, sharding=None):
    """One optimizer step: gradients accumulated over the micro-batches, clipped, applied. Returns the
    mean loss and the gradient norm as device tensors, so nothing here waits for the device. With
    `sharding` (optim.Sharding) each rank receives, clips and applies only its share of the gradients,
    then gathers everyone's updated parameters."""
    ddp = isinstance(model, DDP)
    loss_sum = torch.zeros((), device=device)
    # a tensor, not a Python number: batch warm-up changes how many micro-batches a step has
    share = torch.tensor(1 / len(micro_batches)).to(device, non_blocking=True)
    for i, (x, y) in enumerate(micro_batches):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        # with DDP, gradients are all-reduced only on the last micro-step
        sync = model.no_sync() if ddp and i < len(micro_batches) - 1 else nullcontext()
        with sync:
            with autocast:
                loss = model(x, y) * share
            loss.backward()
        loss_sum += loss.detach()
    if sharding is None:  # the whole gradient, all-reduced by DDP (or one process's own)
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip or math.inf)
    else:
        grad_norm = sharding.reduce_gradients(grad_clip)
    for o in optimizers:
        o.step()
    if sharding is None:
        raw_model.zero_grad(set_to_none=True)
    else:  # which also zeroes the gradients, in place
        sharding.gather_parameters()
    return loss_sum, grad_norm


# -----------------------------------------------------------------------------
# evaluation

@torch.no_grad()
def evaluate(model, batches, token_bytes, device, autocast, stop=None, group=None):
    """Mean val loss over all target tokens, and val_bpb = nats / (ln 2 * bytes) over the target tokens
    that stand for bytes (document boundaries stand for none). Sums are reduced over all ranks (`group`: a
    CPU (gloo) group under torchrun). A stop request (`stop.received`) ends it early: the numbers then
    cover the batches done. The per-token losses are summed on the CPU in float64: a Neuron device narrows
    float64 to 32 bits (torch_neuronx python_ops/base.py), and the byte mask is a product, not an index,
    so no shape depends on the data."""
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64)  # nats, tokens, nats of byte tokens, bytes
    token_bytes = token_bytes.cpu().double()
    for x, y in batches:
        if stop is not None and stop.received:
            break
        with autocast:
            loss = model(x.to(device), y.to(device), loss_reduction="none").float().cpu().double()
        nbytes = token_bytes[y.cpu()]
        sums += torch.stack([loss.sum(), torch.tensor(float(y.numel()), dtype=torch.float64),
                             (loss * (nbytes > 0)).sum(), nbytes.sum()])
    if dist.is_initialized():
        dist.all_reduce(sums, group=group)
    model.train()
    nats, tokens, byte_nats, nbytes = sums.tolist()
    return {"val_loss": nats / max(tokens, 1), "val_bpb": byte_nats / (math.log(2) * max(nbytes, 1))}


# -----------------------------------------------------------------------------
# the data


class KitCorpus:
    """The kit's own corpora and tokenizers (data.py): shards prepared once by rank 0, then read by every
    rank, and a held-out split for val_bpb."""

    def __init__(self, cfg):
        import data  # the kit's data path; a submission reads the contest's data through prepare.py

        self.data, self.cfg = data, cfg
        self.enc = data.get_tokenizer(cfg.tokenizer, cfg.dataset, cfg.data_dir)
        self.vocab_size, self.decode, self.bos_id = self.enc.n_vocab, self.enc.decode, self.enc.eot_token

    def load(self, batch_size, sequence_len, rank, world_size, device, master):
        cfg, data = self.cfg, self.data
        if not master and dist.is_initialized():
            dist.barrier()  # released below, once rank 0 has the shards
        path = data.prepare(cfg.dataset, cfg.tokenizer, cfg.data_dir)
        if master and dist.is_initialized():
            dist.barrier()
        self.loader = data.TokenLoader(data.shard_paths(path, "train"), batch_size, sequence_len, rank, world_size,
                                       cfg.seed, self.vocab_size, shuffle=cfg.data_order == "shuffled",
                                       row_pool=cfg.row_pool, ignore_target=self.bos_id if cfg.mask_bos_targets else None)
        self.val_batches = data.eval_batches(data.shard_paths(path, "val"), batch_size, sequence_len,
                                             cfg.eval_tokens, rank, world_size, self.vocab_size)
        self.token_bytes = data.token_bytes(self.enc).to(device)

    def tokens_per_epoch(self):
        return self.loader.tokens_per_epoch()

    def next_batch(self):
        return next(self.loader)

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state):
        self.loader.load_state_dict(state)


# -----------------------------------------------------------------------------
# the training run


def find_data(cfg, model_cfg):
    """(prepare.py, corpus): the contest's data, tokenizer and rules where its prepare.py is found, else the
    kit's own corpus (data.py); the model's vocabulary is the tokenizer's."""
    prepare = contest.find_prepare(cfg)
    if prepare is not None:
        contest.apply_contest_rules(cfg, prepare)
    corpus = contest.ContestCorpus(prepare, cfg.mask_bos_targets) if prepare is not None else KitCorpus(cfg)
    model_cfg.vocab_size = corpus.vocab_size
    model_cfg.validate()
    return prepare, corpus


def check_batch(cfg, model_cfg, world_size, prepare):
    """(tokens per step, micro-batches per step), refused unless whole, and the recipe levers checked, before
    any data or model is built."""
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
    return total_tokens, total_tokens // micro_tokens


def log_config(log, cfg, raw_model, ranks, accum_steps, total_tokens, dtype_reason):
    sharded = " (optimizer sharded)" if memory.shards_optimizer(cfg, ranks.world_size) else ""
    log("config", f"{raw_model.num_params():,} parameters, {raw_model.flops_per_token() / 1e6:.1f} MFLOP/token, "
        f"{ranks.world_size} rank(s) on {ranks.device_type}{sharded}, {accum_steps} micro-step(s) of {total_tokens // accum_steps:,} "
        f"tokens per step; computing in {cfg.dtype} because {dtype_reason}", train_config=asdict(cfg),
        model_config=asdict(raw_model.config), world_size=ranks.world_size, device=ranks.device_type, dtype_reason=dtype_reason)


def epoch_plan(cfg, train_tokens, total_tokens):
    """(line, log fields), before training: the epochs --max_steps plans, else the step the data repeats from."""
    if train_tokens is None:
        return ("training data: the token count is not known (the contest's make_dataloader streams its shards and exposes "
                "none); the organiser's loader may repeat its shards", dict(train_tokens=None, epoch_steps=None, planned_epochs=None))
    epoch_steps, epochs = train_tokens / total_tokens, cfg.max_steps * total_tokens / train_tokens if cfg.max_steps else None
    text = f"training data: {train_tokens:,} tokens, one epoch is {epoch_steps:,.1f} steps of {total_tokens:,} tokens; "
    if epochs is None:
        text += f"the data starts repeating in step {train_tokens // total_tokens + 1:,}"
    else:
        order = "a new order" if cfg.data_order == "shuffled" or cfg.row_pool else "the same order"
        text += f"{cfg.max_steps:,} steps are {epochs:.2f} epochs: " + (
            f"the data is read {math.ceil(epochs)} times, each epoch in {order}" if epochs > 1 else "no window is read twice")
    text += " (at full steps; --batch_warmup's smaller early steps read less)" if cfg.batch_warmup else ""
    return text, dict(train_tokens=train_tokens, epoch_steps=epoch_steps, planned_epochs=epochs)


def run_eval(raw_model, corpus, ranks, autocast, stop, log, step):
    # the uncompiled model: eval's no_grad forward would otherwise cost a second compilation
    metrics = evaluate(raw_model, corpus.val_batches, corpus.token_bytes, ranks.device, autocast, stop, ranks.control)
    log("eval", f"step {step}: val_loss {metrics['val_loss']:.4f}, val_bpb {metrics['val_bpb']:.4f}", step=step, **metrics)
    return metrics


def next_step_estimate(step_times):
    """Seconds the budget must still hold for one more step: the slowest of the last ten timed steps. (A
    median let one slow step of a loaded machine run past the end: 151.4 s charged of a 150 s budget.)
    Until a step after the start-up ones is timed there is no estimate: a start-up step's time includes
    compilation, and taken as the next step's it would end a short budget before training."""
    return max(step_times[-10:], default=0.0)


def agree(ranks, charged, next_step_s, loss, nonfinite, stopping):
    """What every rank acts on after a step, from one all-reduce of host numbers: the charged time and the
    next step's estimate (so the ranks schedule and stop alike), the loss, and whether any rank saw a
    non-finite value or a stop signal (the mean over ranks of a flag raised anywhere stays above zero)."""
    decision = [charged, next_step_s, loss, float(nonfinite), float(stopping)]
    if ranks.control is not None:
        agreed = torch.tensor(decision, dtype=torch.float64)
        dist.all_reduce(agreed, group=ranks.control)
        decision = (agreed / ranks.world_size).tolist()
    return decision[0], decision[1], decision[2], decision[3] > 0, decision[4] > 0


def train_loop(cfg, step, model, raw_model, optimizers, sharding, ema, corpus, accum_steps, total_tokens, ranks, autocast,
               clock, reserve_s, stop, log, prepare, run_side_work):
    """Steps from `step` until the step limit, the budget (keeping the final save's reserve) or a stop
    signal; returns (step, why it ended). Each step is synchronised with the device before the clock is
    read, as the contest's clock is. `run_side_work(step)`: the periodic evaluation and checkpoint."""
    steps_this_run, step_times, charged, meter = 0, [], clock.charged(), runtime.SpeedMeter(raw_model, cfg, ranks)
    clock.steps_done(0)
    while not (cfg.max_steps and step >= cfg.max_steps):
        t0 = time.monotonic()
        progress = max(step / cfg.max_steps if cfg.max_steps else 0.0, charged / cfg.time_budget_s if cfg.time_budget_s else 0.0)
        scheduled = schedule(cfg, step, progress)
        apply_schedule(optimizers, scheduled, raw_model)
        micro_batches = [corpus.next_batch() for _ in range(round(accum_steps * scheduled["batch_fraction"]))]
        loss, grad_norm = train_step(model, raw_model, optimizers, micro_batches, ranks.device, autocast, cfg.grad_clip, sharding)
        runtime.synchronize(ranks.device_type)
        step, steps_this_run = step + 1, steps_this_run + 1
        if ema and step % cfg.ema_every == 0:
            ema.update()
        if prepare is not None:  # the contest's own record of the step just finished (0-based, as the baseline)
            prepare.record_step_boundary(step - 1)
        loss_value, norm_value = torch.stack([loss, grad_norm.to(loss)]).tolist()
        finite = math.isfinite(loss_value) and math.isfinite(norm_value)
        dt = time.monotonic() - t0
        clock.steps_done(steps_this_run)
        if steps_this_run > cfg.startup_steps:
            step_times.append(dt)
            meter.add(dt, total_tokens * len(micro_batches) // accum_steps)  # fewer tokens during a batch warm-up
        if finite:  # evaluations and checkpoints: never of a non-finite model
            t_side = time.monotonic()
            run_side_work(step)
            if not cfg.charge_evals:
                clock.exclude(time.monotonic() - t_side)
        charged, next_step_s, loss_value, nonfinite, stopping = agree(
            ranks, clock.charged(), next_step_estimate(step_times), loss_value, not finite, stop.received)
        if nonfinite:
            raise FloatingPointError(
                f"step {step}: loss {loss_value}, gradient norm {norm_value}; training stopped and no "
                f"checkpoint was written past the last good one in {cfg.out_dir}. Try a lower --matrix_lr "
                f"or --embedding_lr, a smaller --grad_clip, or --dtype=float32")
        if step % cfg.log_every == 0 or step == cfg.max_steps or steps_this_run == 1:
            log("train", f"step {step} | loss {loss_value:.4f} | lr x{scheduled['lr_scale']:.3f} | {meter.read()} | "
                f"charged {charged:.1f}s", step=step, loss=loss_value, grad_norm=norm_value, lr_scale=scheduled["lr_scale"],
                train_time=charged, startup_time=clock.startup_s, **meter.fields())
        if stopping:
            return step, "signal"
        if clock.out_of_time(charged, next_step_s, reserve_s):
            return step, "budget"
    return step, "steps"


def final_save(cfg, step, raw_model, ema, ranks, clock):
    """final.pt, inside the budget: the EMA blended in first, written by rank 0 while the others wait.
    Returns the charged time with it."""
    if ema:  # the final model is the blend of the live weights and their average
        ema.finish()
    if ranks.rank == 0:
        checkpoint.save_final(os.path.join(cfg.out_dir, "final.pt"), raw_model, raw_model.config, cfg, step, clock.charged())
    if ranks.control is not None:
        dist.barrier()
    return clock.charged()


def sample(cfg, raw_model, corpus, device, autocast):
    """Prints cfg.sample_tokens of text from the trained model, from a document's start."""
    prompt = torch.tensor([[corpus.bos_id]], device=device)
    sampler = checkpoint.inference_model(raw_model.state_dict(), asdict(raw_model.config), device, raw_model.kernels_ran)
    with autocast:
        out = sampler.generate(prompt, cfg.sample_tokens, temperature=0.8, generator=torch.Generator().manual_seed(cfg.seed))
    print("-" * 40 + "\n" + corpus.decode(out[0, 1:].tolist()) + "\n" + "-" * 40)


def main(argv):
    """One run, top to bottom: the checks that need nothing, the data, the ranks, the model, the loop, the end.
    Returns {"first_eval", "final_eval", "step"} (None after --export_submission, which trains nothing)."""
    cfg, model_cfg = parse_args(contest.SUBMISSION_ARGS + list(argv))
    logging.basicConfig(format="%(name)s: %(message)s")
    with runtime.StopSignal() as stop:
        try:
            # checks that need no data, model or device, cheapest first
            runtime.validate_config(cfg, model_cfg)
            runtime.configure_determinism(cfg)
            prepare, corpus = find_data(cfg, model_cfg)
            device_type = runtime.device_type(cfg.device)
            if cfg.export_submission:
                return contest.export_submission(cfg, model_cfg, argv, corpus.vocab_size, prepare, getattr(corpus, "tokenizer", None))
            checkpoint.check_out_dir(cfg)  # after the other checks: with --start_over it moves files

            # the ranks, the batch, the data
            ranks = runtime.start_ranks(device_type)
            master, device = ranks.rank == 0, ranks.device
            dtype_reason = runtime.choose_dtype(cfg, device_type, ranks.control)
            if master:  # kernels.py says once, at INFO, why an operation runs on PyTorch instead of NKI
                logging.getLogger("kernels").setLevel(logging.INFO)
            total_tokens, accum_steps = check_batch(cfg, model_cfg, ranks.world_size, prepare)
            state = checkpoint.resume_state(cfg, model_cfg) if cfg.resume else None
            memory.check_memory(cfg, model_cfg, ranks.world_size, device_type)  # refuses what cannot fit
            torch.manual_seed(cfg.seed)
            if master:
                checkpoint.make_out_dir(cfg, model_cfg)
                contest.announce(cfg, prepare)
            corpus.load(cfg.batch_size, model_cfg.sequence_len, ranks.rank, ranks.world_size, device, master)
            if stop.received:
                raise runtime.Stopped("stopped by a signal while preparing data; nothing was trained, nothing to save")

            # the model, its optimizers, the step
            raw_model = GPT(model_cfg).to(device)
            sharded = memory.shards_optimizer(cfg, ranks.world_size)
            sharding = optim.Sharding(raw_model, cfg, ranks.rank, ranks.world_size) if sharded else None
            optimizers = optim.make_optimizers(raw_model, cfg, device_type, runtime.compute_dtype(cfg),
                                               share=sharding.share if sharded else None)
            step, charged_before = checkpoint.restore(state, raw_model, optimizers, sharding, corpus, ranks) if state else (0, 0.0)
            del state  # its tensors now live in the model and optimizers
            ema = optim.WeightEMA(raw_model, cfg.ema_decay, cfg.ema_every, cfg.ema_blend) if cfg.ema_decay else None
            tokens = torch.zeros(cfg.batch_size, model_cfg.sequence_len, dtype=torch.long, device=device)
            model = wrap_for_training(raw_model, cfg, device_type, device, (tokens, tokens), sharded)
            autocast = runtime.autocast_context(cfg, device_type)
            log = runtime.Logger(cfg.out_dir, master, append=bool(cfg.resume))
            log_config(log, cfg, raw_model, ranks, accum_steps, total_tokens, dtype_reason)
            plan, plan_fields = epoch_plan(cfg, corpus.tokens_per_epoch(), total_tokens)
            log("data", plan, **plan_fields)

            # the loop, on the contest's clock
            reserve_s = checkpoint.measure_final_save(cfg, raw_model, ranks)
            clock = contest.ChargedClock(cfg.time_budget_s, cfg.startup_steps, cfg.startup_cap_s, charged_before)
            evaluating = corpus.val_batches is not None
            evaluate_now = functools.partial(run_eval, raw_model, corpus, ranks, autocast, stop, log)
            first_eval = evaluate_now(step) if evaluating else None
            checkpoints = checkpoint.Checkpoints(cfg, raw_model, optimizers, sharding, corpus, ranks, log)

            def side_work(step):
                if evaluating and cfg.eval_every and step % cfg.eval_every == 0:
                    evaluate_now(step)
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    checkpoints.periodic(step, clock.charged())  # a failure is a warning: training goes on

            ended_by = "signal"
            if not stop.received:
                step, ended_by = train_loop(cfg, step, model, raw_model, optimizers, sharding, ema, corpus, accum_steps,
                                            total_tokens, ranks, autocast, clock, reserve_s, stop, log, prepare, side_work)

            # the end: the final save inside the budget, then off the clock the final evaluation and a sample
            if ended_by == "signal":
                path = checkpoints.write(step, clock.charged())
                log("stopped", f"stopped by a signal at step {step}; {path} written, resume with --resume=latest", step=step)
                return {"first_eval": first_eval, "final_eval": None, "step": step}
            charged = final_save(cfg, step, raw_model, ema, ranks, clock)
            final_eval = evaluate_now(step) if evaluating and not stop.received else None
            if stop.received:  # a signal during the evaluation: final.pt is safe, the numbers would be partial
                final_eval = None
            log("done", summary(cfg, step, charged, clock, reserve_s, first_eval, final_eval), step=step,
                train_time=charged, startup_time=clock.startup_s, ended_by=ended_by, **(final_eval or {}))
            fallbacks = runtime.cpu_fallbacks(device_type)  # on neuron: which ops TorchNeuron ran on the CPU
            if fallbacks:
                log("cpu_fallbacks", fallbacks)
            if master and cfg.sample_tokens and corpus.decode and not stop.received:
                sample(cfg, raw_model, corpus, device, autocast)
            return {"first_eval": first_eval, "final_eval": final_eval, "step": step}
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def summary(cfg, step, charged, clock, reserve_s, first_eval, final_eval):
    text = (f"{step} steps, {charged:.1f}s charged of a {cfg.time_budget_s:.0f}s budget (final save included; "
            f"start-up {clock.startup_s:.1f}s, reserve kept {reserve_s:.1f}s)")
    if final_eval and first_eval:
        text += f"; val_bpb {first_eval['val_bpb']:.4f} -> {final_eval['val_bpb']:.4f}"
    return text


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except runtime.Stopped as e:  # a requested stop, not a failure
        print(e, file=sys.stderr)
    # the foreseeable failures (bad flags, files, devices, data, a full disk, a diverged run) carry their
    # fix in one line; anything else is a bug and keeps its traceback
    except (ValueError, OSError, FloatingPointError) as e:
        sys.exit(f"error: {e}")

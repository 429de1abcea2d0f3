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
need not read is kit/, one file per concern (kit/__init__.py lists them).
"""
import time

PROCESS_START = time.monotonic()  # the contest's clock counts start-up from the process's start, imports included

from kit import runtime  # noqa: E402  before torch: it sets the environment torch reads as it loads (OMP_WAIT_POLICY)
import collections  # noqa: E402
import functools  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from contextlib import nullcontext  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import kernels  # noqa: E402
from kit import build, checkpoint, contest, flags, memory, optim  # noqa: E402
from model import GPT, GPTConfig, opt  # noqa: E402


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
    configs = flags.parse_flags(argv, {"model": GPTConfig, "training": TrainConfig}, contest.PRESETS, __doc__)
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
    (linearly to zero at the end of training, nanochat's rule), the extra MTP targets' weights and the batch fraction."""
    warm = min(1.0, step / cfg.muon_momentum_warmup_steps) if cfg.muon_momentum_warmup_steps else 1.0
    return {"lr_scale": lr_multiplier(cfg, step, progress),
            "momentum": cfg.muon_momentum_start + warm * (cfg.muon_momentum - cfg.muon_momentum_start),
            "weight_decay": cfg.weight_decay * (1 - progress),
            "extra_loss_weights": extra_loss_weights(cfg, progress),
            "batch_fraction": next((f for f, until in flags.batch_warmup_phases(cfg) if progress < until), 1.0)}


def extra_loss_weights(cfg, progress):
    """This step's loss weight of each extra MTP target: its --mtp_weights value faded linearly to 0 by its
    mtp_fade progress, the farthest target first and each fade starting where the farther one's ended
    (FrontierForge: t+3 over 0-20% of the run, t+2 over 20-45%, then plain next-token prediction; they step
    the fade in 4 levels per phase)."""
    weights, ends = flags.floats(cfg.mtp_weights), flags.floats(cfg.mtp_fade)
    starts = ends[1:] + [0.0]
    return tuple(w * min(1.0, max(0.0, (end - progress) / (end - start))) for w, end, start in zip(weights, ends, starts))


def apply_schedule(optimizers, values, model=None):
    """Writes this step's values into the 0-d device tensors the optimizers read (and the model's
    extra_loss_weights), each by a copy from a host tensor. Nothing in the step then takes a Python number
    that changes from step to step: on Neuron a changed scalar argument re-traces and recompiles (a competitor
    measured 408 vs 918 steps in 900 s on Trn2 until their hyperparameters became device tensors)."""
    for o in optimizers:
        for group in o.param_groups:
            group["lr"].copy_(torch.tensor(group["peak_lr"] * values["lr_scale"]), non_blocking=True)
            if isinstance(o, optim.Muon):
                group["momentum"].copy_(torch.tensor(values["momentum"]), non_blocking=True)
                group["weight_decay"].copy_(torch.tensor(values["weight_decay"]), non_blocking=True)
    if model is not None and model.extra_loss_weights.numel():
        model.extra_loss_weights.copy_(torch.tensor(values["extra_loss_weights"]), non_blocking=True)


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

def kit_corpus(cfg):
    """The kit's own corpora and tokenizers (data.KitCorpus); a submission reads the contest's data only."""
    import data  # imported here: the one-file submission leaves data.py (and its downloads) out

    return data.KitCorpus(cfg)


def open_corpus(cfg, model_cfg, prepare):
    """The contest's data and tokenizer where its prepare.py was found, else the kit's own corpus (data.py);
    the model's vocabulary is the tokenizer's."""
    corpus = contest.ContestCorpus(prepare, cfg.mask_bos_targets) if prepare is not None else kit_corpus(cfg)
    model_cfg.vocab_size = corpus.vocab_size
    return corpus


# -----------------------------------------------------------------------------
# the loop, its clock and its speed

class ChargedClock:
    """The contest's training clock (prepare.py's TRAIN_* constants, as the baseline-derived train.py files
    of FrontierForge, recipes/K82s4/train.py, and poojith's ledger apply them):
    wall-clock seconds from the end of the `excluded_steps`-th step of this process, plus whatever of the
    start-up before it (from the process's start) exceeds `startup_cap_s`. Everything after that moment
    is charged (steps, evaluations, checkpoints, the final save) except what `exclude` takes off.
    `already` carries the charged time of the run a checkpoint resumes."""

    def __init__(self, budget_s, excluded_steps, startup_cap_s, already=0.0, process_start=PROCESS_START,
                 now=time.monotonic):
        self.budget_s, self.excluded_steps, self.startup_cap_s = budget_s, excluded_steps, startup_cap_s
        self.already, self.process_start, self.now = already, process_start, now
        self.started = None
        self.startup_s = self.excluded_s = 0.0

    def steps_done(self, steps_this_run):
        """Called after each synchronised step (and with 0 before the first)."""
        if self.started is None and steps_this_run >= self.excluded_steps:
            now = self.now()
            self.startup_s = now - self.process_start
            self.started = now - max(0.0, self.startup_s - self.startup_cap_s)

    def exclude(self, seconds):
        self.excluded_s += seconds

    def charged(self):
        running = self.now() - self.started - self.excluded_s if self.started is not None else 0.0
        return self.already + running

    def out_of_time(self, charged, next_step_s, reserve_s):
        """True when one more step and the final save would not fit in the budget (`charged`: the value the
        ranks agreed on)."""
        return bool(self.budget_s) and self.started is not None and charged + next_step_s + reserve_s >= self.budget_s


class SpeedMeter:
    """Tokens per second and MFU over the timed steps since the last read (start-up steps are not timed).
    The peak is measured (on a CPU) when the meter is made, before the clock starts."""

    def __init__(self, raw_model, cfg, ranks):
        peak = runtime.peak_flops(ranks.device_type, runtime.compute_dtype(cfg), cfg.peak_tflops) * ranks.world_size
        self.flops_per_peak = raw_model.flops_per_token() / peak
        self.seconds, self.tokens, self.last = 0.0, 0, {"tokens_per_s": 0.0, "mfu": 0.0}

    def add(self, seconds, tokens):
        self.seconds, self.tokens = self.seconds + seconds, self.tokens + tokens

    def read(self):
        """The interval's speed as text, starting the next interval; fields() then gives its numbers."""
        timed = self.seconds > 0
        tokens_per_s = self.tokens / self.seconds if timed else 0.0
        self.last = {"tokens_per_s": tokens_per_s, "mfu": tokens_per_s * self.flops_per_peak}
        self.seconds, self.tokens = 0.0, 0
        return f"{tokens_per_s:,.0f} tok/s | MFU {100 * self.last['mfu']:.1f}%" if timed else "start-up step"

    def fields(self):
        return self.last


# What the loop answers to: the contest's clock, the seconds it keeps for the final save, the stop signal
# and the run's log.
Watch = collections.namedtuple("Watch", "clock reserve_s stop log")


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


def periodic_work(cfg, evaluate_now, checkpoints, clock, step):
    """The evaluation (`evaluate_now`, None without validation data) and checkpoint due after `step`, on the
    clock unless --charge_evals=false."""
    t0 = time.monotonic()
    if evaluate_now is not None and cfg.eval_every and step % cfg.eval_every == 0:
        evaluate_now(step)
    if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
        checkpoints.periodic(step, clock.charged())  # a failure is a warning: training goes on
    if not cfg.charge_evals:
        clock.exclude(time.monotonic() - t0)


def train_loop(cfg, step, trainee, corpus, batch, ranks, autocast, watch, run_side_work):
    """Steps from `step` until the step limit, the budget (keeping the final save's reserve) or a stop
    signal; returns (step, why it ended). Each step is synchronised with the device before the clock is
    read, as the contest's clock is. `run_side_work(step)`: the periodic evaluation and checkpoint."""
    clock, meter = watch.clock, SpeedMeter(trainee.raw_model, cfg, ranks)
    steps_this_run, step_times, charged = 0, [], clock.charged()
    clock.steps_done(0)
    while not (cfg.max_steps and step >= cfg.max_steps):
        t0 = time.monotonic()
        progress = max(step / cfg.max_steps if cfg.max_steps else 0.0, charged / cfg.time_budget_s if cfg.time_budget_s else 0.0)
        scheduled = schedule(cfg, step, progress)
        apply_schedule(trainee.optimizers, scheduled, trainee.raw_model)
        micro_batches = [corpus.next_batch() for _ in range(round(batch.micro_steps * scheduled["batch_fraction"]))]

        def this_step(model):  # on the module given: a failed build builds another
            return train_step(model, trainee.raw_model, trainee.optimizers, micro_batches, ranks.device, autocast,
                              cfg.grad_clip, trainee.sharding)
        if steps_this_run == 0:  # the backward kernels build here (and all of them with no evaluation before)
            (loss, grad_norm), trainee = build.surviving_build_failures(this_step, trainee, watch.log, clock)
        else:
            loss, grad_norm = this_step(trainee.model)
        runtime.synchronize(ranks.device_type)
        step, steps_this_run = step + 1, steps_this_run + 1
        if trainee.ema and step % cfg.ema_every == 0:
            trainee.ema.update()
        corpus.record_step(step)
        loss_value, norm_value = torch.stack([loss, grad_norm.to(loss)]).tolist()
        finite = math.isfinite(loss_value) and math.isfinite(norm_value)
        dt = time.monotonic() - t0
        clock.steps_done(steps_this_run)
        if steps_this_run > cfg.startup_steps:
            step_times.append(dt)
            meter.add(dt, batch.tokens * len(micro_batches) // batch.micro_steps)  # fewer tokens during a batch warm-up
        if finite:  # evaluations and checkpoints: never of a non-finite model
            run_side_work(step)
        charged, next_step_s, loss_value, nonfinite, stopping = agree(
            ranks, clock.charged(), next_step_estimate(step_times), loss_value, not finite, watch.stop.received)
        if nonfinite:
            raise FloatingPointError(f"step {step}: loss {loss_value}, gradient norm {norm_value}; training stopped and "
                                     f"no checkpoint was written past the last good one in {cfg.out_dir}. Try a lower "
                                     "--matrix_lr or --embedding_lr, a smaller --grad_clip, or --dtype=float32")
        if step % cfg.log_every == 0 or step == cfg.max_steps or steps_this_run == 1:
            watch.log("train", f"step {step} | loss {loss_value:.4f} | lr x{scheduled['lr_scale']:.3f} | {meter.read()} | "
                      f"charged {charged:.1f}s", step=step, loss=loss_value, grad_norm=norm_value, lr_scale=scheduled["lr_scale"],
                      train_time=charged, startup_time=clock.startup_s, **meter.fields())
        if stopping:
            return step, "signal"
        if clock.out_of_time(charged, next_step_s, watch.reserve_s):
            return step, "budget"
    return step, "steps"


# -----------------------------------------------------------------------------
# the run

# What a step trains: the module it calls (compiled, DDP-wrapped), the model itself, its optimizers, the
# optimizer's sharding over the ranks and the weights' EMA (each None when off), and how the module is
# built (again after a kernel or the graph failed to build: kit/build.py).
Trainee = collections.namedtuple("Trainee", "model raw_model optimizers sharding ema rebuild")


def make_trainee(cfg, model_cfg, ranks, corpus, state):
    """(Trainee, step, charged time so far): the model and its optimizers (sharded over the ranks or not),
    a checkpoint's `state` put back (the data position too), the EMA started from those weights, and the
    module the step calls."""
    raw_model = GPT(model_cfg).to(ranks.device)
    sharded = memory.shards_optimizer(cfg, ranks.world_size)
    sharding = optim.Sharding(raw_model, cfg, ranks.rank, ranks.world_size) if sharded else None
    optimizers = optim.make_optimizers(raw_model, cfg, ranks.device_type, runtime.compute_dtype(cfg),
                                       share=sharding.share if sharded else None)
    step, charged = checkpoint.restore(state, raw_model, optimizers, sharding, corpus, ranks) if state else (0, 0.0)
    ema = optim.WeightEMA(raw_model, cfg.ema_decay, cfg.ema_every, cfg.ema_blend) if cfg.ema_decay else None
    tokens = torch.zeros(cfg.batch_size, model_cfg.sequence_len, dtype=torch.long, device=ranks.device)
    rebuild = functools.partial(build.wrap_for_training, raw_model, cfg, ranks.device_type, ranks.device, (tokens, tokens),
                                sharded)
    return Trainee(rebuild(), raw_model, optimizers, sharding, ema, rebuild), step, charged


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
            # checks that need no data, model or device, cheapest first, on the config the contest's rules made
            prepare = contest.competition_mode(cfg)
            flags.validate_config(cfg, model_cfg)
            runtime.configure_determinism(cfg)
            corpus = open_corpus(cfg, model_cfg, prepare)
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
            batch = flags.check_batch(cfg, model_cfg, ranks.world_size, prepare)
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
            trainee, step, charged_before = make_trainee(cfg, model_cfg, ranks, corpus, state)
            del state  # its tensors now live in the model and optimizers
            raw_model, autocast = trainee.raw_model, runtime.autocast_context(cfg, device_type)
            log = runtime.Logger(cfg.out_dir, master, append=bool(cfg.resume))
            runtime.log_config(log, cfg, trainee, ranks, batch, dtype_reason)
            plan, plan_fields = runtime.epoch_plan(cfg, corpus.tokens_per_epoch(), batch.tokens)
            log("data", plan, **plan_fields)

            # the loop, on the contest's clock
            reserve_s = checkpoint.measure_final_save(cfg, raw_model, ranks)
            clock = ChargedClock(cfg.time_budget_s, cfg.startup_steps, cfg.startup_cap_s, charged_before)
            evaluating = corpus.val_batches is not None
            evaluate_now = functools.partial(run_eval, raw_model, corpus, ranks, autocast, stop, log)
            first_eval = None
            if evaluating:  # the forward kernels' first call: they build here
                first_eval, trainee = build.surviving_build_failures(lambda _: evaluate_now(step), trainee, log, clock)
            checkpoints = checkpoint.Checkpoints(cfg, raw_model, trainee.optimizers, trainee.sharding, corpus, ranks, log)
            side_work = functools.partial(periodic_work, cfg, evaluate_now if evaluating else None, checkpoints, clock)
            ended_by = "signal"
            if not stop.received:
                watch = Watch(clock, reserve_s, stop, log)
                step, ended_by = train_loop(cfg, step, trainee, corpus, batch, ranks, autocast, watch, side_work)

            # the end: the final save inside the budget, then off the clock the final evaluation and a sample
            if ended_by == "signal":
                path = checkpoints.write(step, clock.charged())
                log("stopped", f"stopped by a signal at step {step}; {path} written, resume with --resume=latest", step=step)
                return {"first_eval": first_eval, "final_eval": None, "step": step}
            charged = final_save(cfg, step, raw_model, trainee.ema, ranks, clock)
            final_eval = evaluate_now(step) if evaluating and not stop.received else None
            final_eval = None if stop.received else final_eval  # a signal during it: final.pt is safe, the numbers partial
            log("done", runtime.summary(cfg, step, charged, clock, reserve_s, first_eval, final_eval), step=step,
                train_time=charged, startup_time=clock.startup_s, ended_by=ended_by, **(final_eval or {}))
            if fallbacks := runtime.cpu_fallbacks(device_type):  # on neuron: which ops TorchNeuron ran on the CPU
                log("cpu_fallbacks", fallbacks)
            if master and cfg.sample_tokens and corpus.decode and not stop.received:
                sample(cfg, raw_model, corpus, device, autocast)
            return {"first_eval": first_eval, "final_eval": final_eval, "step": step}
        finally:
            kernels.BUILD_FAILURES.clear()  # the next run in this process builds every kernel again
            if dist.is_initialized():
                dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except runtime.Stopped as e:  # a requested stop, not a failure
        print(e, file=sys.stderr)
    # the foreseeable failures (bad flags, files, devices, data, a full disk, a diverged run) carry their
    # fix in one line; anything else is a bug and keeps its traceback
    except (ValueError, OSError, FloatingPointError) as e:
        sys.exit(f"error: {e}")

"""
Checkpoints: what each holds (weights, optimizer state keyed by parameter name, the run's position and the
per-op kernels record), restored on any number of ranks; periodic checkpoints and the final save; resume and
the output folder; `load_for_eval`, the contest's scoring hook. The bytes are written and read, digests
included, by kit/checkpoint_io.py.
(cf. nanochat's nanochat/checkpoint_manager.py)
"""
import dataclasses
import glob
import os
import shutil
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

import kernels
from kit import checkpoint_io, optim, runtime
from model import GPT, GPTConfig


def optimizer_state(model, optimizers, sharding=None, distributed=False):
    """{parameter name: {state name: tensor}} for the parameters these optimizers update: keyed by name,
    not by the optimizers' own numbering, so a checkpoint loads into any split of the parameters over ranks
    (optim.Sharding) and into one process alike. The schedule's values are not saved: it rewrites them.
    distributed: a table shared out by rows appears as a DTensor of its whole shape, sharded on dim 0 as
    the rows are, and its step count replicated: torch.distributed.checkpoint then writes each rank's rows
    and gives any other split of them, or the whole, on load. Otherwise the state of this rank's rows."""
    names = {p: name for name, p in model.named_parameters()}
    states = {}
    for tensor, state in optim.param_states(optimizers).items():
        if tensor in names:
            states[names[tensor]] = state
            continue
        param, _ = sharding.rows_of[tensor]
        if distributed:
            # imported here, not at the top: torch.distributed.tensor takes ~1 s to import (measured on a 2-core
            # Xeon), which every process (evaluate.py, each test's) would pay, and only sharded checkpoints use it
            from torch.distributed.tensor import DTensor, Replicate, Shard

            mesh = sharding.device_mesh()
            state = {k: DTensor.from_local(v, mesh, [Shard(0)] if v.ndim else [Replicate()], run_check=False,
                                           shape=param.shape if v.ndim else v.shape, stride=param.stride() if v.ndim else ())
                     for k, v in state.items()}
        states[names[param]] = state
    return states


def run_state(step, train_time, loader_state, train_cfg, model_cfg):
    """What a checkpoint holds besides tensors: step, charged time, data position, RNG and both configs."""
    return {"step": step, "train_time": train_time, "loader": loader_state, "rng": torch.get_rng_state(),
            "train_config": asdict(train_cfg), "model_config": asdict(model_cfg)}


def save_checkpoint(path, model, optimizers, step, train_time, loader_state, train_cfg, model_cfg):
    """One file with everything a run needs to continue exactly: weights, optimizer state, step, charged
    time, data position, RNG and both configs."""
    checkpoint_io.write_atomically(path, {"model": model.state_dict(), "optimizers": optimizer_state(model, optimizers),
                            **run_state(step, train_time, loader_state, train_cfg, model_cfg), "kernels": model.kernels_ran})


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written, on any rank: every rank raises it alike. Nothing that looks
    complete was left behind."""


def describe(e):
    """One line for an exception: its type and first line; for torch.distributed.checkpoint's, the first
    failing rank's own."""
    failures = getattr(e, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
    if isinstance(failures, dict) and failures:
        rank, (first, _) = next(iter(failures.items()))
        return f"torch.distributed.checkpoint failed on rank {rank}: {describe(first)}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def on_every_rank(group, work, errors=(Exception,)):
    """work() on this rank, then every rank learns whether any failed: a failure anywhere raises
    CheckpointWriteError on every rank, naming the first failing rank and its cause, so that no rank goes
    on to a collective the others will not join (it would wait forever). Returns work()'s result."""
    try:
        result, failure = work(), None
    except errors as e:
        result, failure = None, describe(e)
    if group is not None:  # one small all-gather on the CPU (gloo) control group
        reports = [None] * dist.get_world_size(group)
        dist.all_gather_object(reports, failure, group=group)
        # torch.distributed.checkpoint's failure reaches every rank, naming the one where it happened
        failure = next((f if "failed on rank" in f else f"rank {r}: {f}" for r, f in enumerate(reports) if f), None)
    if failure:
        raise CheckpointWriteError(failure)
    return result


def save_sharded_checkpoint(path, model, optimizers, sharding, group, run):
    """A folder written by every rank through torch.distributed.checkpoint: the weights (identical on every
    rank, written once) and each rank's own optimizer state, keyed by parameter name so that any number of
    ranks can load it; `run` (run_state) goes beside it in meta.pt, and last the digests of every file
    (checkpoint_io.FOLDER_DIGESTS), written by rank 0. It is written as PATH.tmp and renamed when complete, so a crash
    leaves the previous checkpoints as they were. A failure on any rank, in building the DTensors, in
    torch.distributed.checkpoint or in the files, raises CheckpointWriteError on every rank (each step
    ends in the ranks' agreement, `on_every_rank`) and removes PATH.tmp."""
    import torch.distributed.checkpoint as dcp  # imported where used, as DTensor is (optimizer_state)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    tmp, writer = f"{path}.tmp", group is None or dist.get_rank() == 0
    try:
        state = on_every_rank(group, lambda: optimizer_state(model, optimizers, sharding, distributed=group is not None))
        on_every_rank(group, lambda: dcp.save({"model": model.state_dict(), "optimizers": state}, checkpoint_id=tmp,
                                              process_group=group, no_dist=group is None),
                      errors=(Exception, CheckpointException))

        def finish():
            if writer:
                checkpoint_io.write_atomically(os.path.join(tmp, "meta.pt"), {**run, "kernels": model.kernels_ran})
                checkpoint_io.write_folder_digests(tmp)
                if os.path.exists(path):  # the same step written before: this one replaces it
                    shutil.rmtree(path)
                os.replace(tmp, path)

        on_every_rank(group, finish)
    except CheckpointWriteError as e:
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(f"cannot write sharded checkpoint {path}: {e}") from None


def consolidated_optimizer_state(model, optimizers, sharding, group):
    """optimizer_state of the whole model, as one process holds it, on rank 0 (None on the others): every
    rank's pieces gathered over `group` (the CPU control group) in host memory, a table's blocks of rows
    joined in order and each whole tensor's state taken from the rank that owns it. Needs no DTensor and
    no torch.distributed.checkpoint: the fallback when a sharded save failed."""
    names = {p: name for name, p in model.named_parameters()}

    def pieces_here():  # {name: (first row, {state name: tensor on the CPU})}
        return {names[sharding.rows_of[tensor][0]]: (sharding.rows_of[tensor][1].start or 0,
                                                     {k: v.detach().cpu() for k, v in state.items()})
                for tensor, state in optim.param_states(optimizers).items()}

    mine = on_every_rank(group, pieces_here)
    parts = [mine]
    if group is not None:
        parts = [None] * dist.get_world_size(group) if dist.get_rank() == 0 else None
        dist.gather_object(mine, parts, dst=0, group=group)
        if dist.get_rank() != 0:
            return None
    pieces = {}
    for part in parts:
        for name, piece in part.items():
            pieces.setdefault(name, []).append(piece)
    states = {}
    for name in names.values():
        if name in pieces:
            blocks = [state for _, state in sorted(pieces[name], key=lambda piece: piece[0])]
            states[name] = {k: torch.cat([b[k] for b in blocks]) if v.ndim else v for k, v in blocks[0].items()}
    return states


def save_final(path, model, model_cfg, train_cfg, step, train_time):
    """final.pt: the weights and the configs, no optimizer state (a third of a resumable checkpoint); the
    scorer's load_for_eval reads the weights and model config, evaluate.py the tokenizer named in the run
    config, and `kernels`, per op what ran in training (model.kernels_ran). Refuses non-finite weights rather than write a model that scores NaN."""
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise FloatingPointError(f"not writing {path}: parameters {bad[:3]} hold non-finite values")
    checkpoint_io.write_atomically(path, {"model": model.state_dict(), "model_config": asdict(model_cfg),
                            "train_config": asdict(train_cfg), "step": step, "train_time": train_time,
                            "kernels": model.kernels_ran})


def check_disk_space(out_dir, n_params, keep_checkpoints):
    """Refuse to start a run whose checkpoints cannot fit: weights plus up to two optimizer moments in
    fp32, for the kept periodic checkpoints, final.pt and the temporary file of the next write."""
    checkpoint_bytes = 3 * 4 * n_params
    needed = checkpoint_bytes * (keep_checkpoints + 2)
    free = shutil.disk_usage(out_dir).free
    if free < needed:
        raise OSError(
            f"{out_dir} has {free / 2**30:.2f} GiB free but checkpoints need about {needed / 2**30:.2f} GiB "
            f"({keep_checkpoints} kept + final + one being written, ~{checkpoint_bytes / 2**20:.0f} MiB each); "
            "free space, choose another --out_dir or lower --keep_checkpoints"
        )


def make_out_dir(cfg, model_cfg):
    """Rank 0's: out_dir, refused if the run's checkpoints cannot fit there."""
    os.makedirs(cfg.out_dir, exist_ok=True)
    with torch.device("meta"):  # parameter count without allocating anything
        check_disk_space(cfg.out_dir, GPT(model_cfg).num_params(), cfg.keep_checkpoints)


def restore(state, raw_model, optimizers, sharding, corpus, ranks):
    """Puts a checkpoint's weights, this rank's optimizer state, the data position and RNG back; returns
    (step, charged time). A sharded checkpoint (a folder) is read through torch.distributed.checkpoint,
    which reads each rank just what it now holds, whatever the number of ranks that wrote it; from a file,
    a rank that holds a table's block of rows takes those rows of its state."""
    if "folder" in state:
        import torch.distributed.checkpoint as dcp  # imported where used, as DTensor is (optimizer_state)

        distributed = sharding is not None and ranks.control is not None
        dcp.load({"model": raw_model.state_dict(), "optimizers": optimizer_state(raw_model, optimizers, sharding, distributed)},
                 checkpoint_id=state["folder"], process_group=ranks.control, no_dist=ranks.control is None)
    elif not isinstance(state["optimizers"], dict):
        raise checkpoint_io.CheckpointError("this checkpoint keeps its optimizer state by position (an earlier "
                                            "version of this kit); start the run again, or train it on with the "
                                            "kit that wrote it")
    else:
        raw_model.load_state_dict(state["model"])
        names = {p: name for name, p in raw_model.named_parameters()}
        with torch.no_grad():
            for tensor, tensors in optim.param_states(optimizers).items():
                param, rows = (tensor, slice(None)) if tensor in names else sharding.rows_of[tensor]
                for key, target in tensors.items():
                    saved = state["optimizers"][names[param]][key]
                    target.copy_(saved[rows] if saved.ndim else saved)
    corpus.load_state_dict(state["loader"])
    torch.set_rng_state(state["rng"])
    return state["step"], state["train_time"]


def write_checkpoint(cfg, raw_model, optimizers, sharding, corpus, ranks, step, charged, consolidate=False):
    """out_dir/ckpt_<step>.pt (by rank 0), or with a sharded optimizer the folder ckpt_<step>.dcp (by every
    rank), keeping the newest keep_checkpoints; returns its path. consolidate: a sharded optimizer's state
    is gathered to rank 0, which writes one ckpt_<step>.pt (consolidated_optimizer_state)."""
    folder = sharding is not None and not consolidate
    path = os.path.join(cfg.out_dir, f"ckpt_{step:07d}.{'dcp' if folder else 'pt'}")
    if folder:
        run = run_state(step, charged, corpus.state_dict(), cfg, raw_model.config)
        save_sharded_checkpoint(path, raw_model, optimizers, sharding, ranks.control, run)
    elif sharding is not None:
        states = consolidated_optimizer_state(raw_model, optimizers, sharding, ranks.control)
        if ranks.rank == 0:
            checkpoint_io.write_atomically(path, {"model": raw_model.state_dict(), "optimizers": states,
                                    **run_state(step, charged, corpus.state_dict(), cfg, raw_model.config)})
    elif ranks.rank == 0:
        save_checkpoint(path, raw_model, optimizers, step, charged, corpus.state_dict(), cfg, raw_model.config)
    if ranks.rank == 0:
        for old in periodic_checkpoints(cfg.out_dir)[: -cfg.keep_checkpoints]:
            shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)
    return path


class Checkpoints:
    """The run's resumable checkpoints. `write`: one that must land (a stop signal's), raising if it cannot.
    `periodic`: one that cannot end the run: if it fails (an exception from torch.distributed.checkpoint or
    DTensor, a full disk, no permission) it is logged as a warning naming the cause, nothing that looks
    complete is left behind, and training goes on; the final save still happens. After a sharded save
    failed, the next ones are consolidated files written by rank 0, which need neither DTensor nor
    torch.distributed.checkpoint (every rank learns of a sharded failure, so all switch together)."""

    def __init__(self, cfg, raw_model, optimizers, sharding, corpus, ranks, log):
        self.cfg, self.raw_model, self.optimizers, self.sharding = cfg, raw_model, optimizers, sharding
        self.corpus, self.ranks, self.log, self.consolidate = corpus, ranks, log, False

    def write(self, step, charged):
        return write_checkpoint(self.cfg, self.raw_model, self.optimizers, self.sharding, self.corpus, self.ranks,
                                step, charged, self.consolidate)

    def periodic(self, step, charged):
        try:
            return self.write(step, charged)
        except Exception as e:  # whatever the cause, it is logged and the run goes on
            sharded = self.sharding is not None and not self.consolidate and isinstance(e, CheckpointWriteError)
            self.consolidate |= sharded
            then = ("; the next checkpoints are consolidated ckpt_*.pt files written by rank 0" if sharded else "")
            cause = str(e) if isinstance(e, OSError) else describe(e)
            self.log("checkpoint_failed", f"warning: the checkpoint of step {step} was not written ({cause}); training "
                     f"goes on, the earlier checkpoints are intact{then}", step=step, cause=cause, consolidate_next=self.consolidate)
            return None


def measure_final_save(cfg, raw_model, ranks):
    """Seconds the final save will take, measured once by writing the same payload: the reserve the loop
    keeps so that final.pt lands inside the budget (twice the measurement, plus a second)."""
    path = os.path.join(cfg.out_dir, "final.pt.timing")
    t0 = time.monotonic()
    if ranks.rank == 0:
        save_final(path, raw_model, raw_model.config, cfg, 0, 0.0)
        os.remove(path)
    reserve = 2 * (time.monotonic() - t0) + 1.0
    if ranks.control is not None:  # every rank stops on the same step, so every rank keeps rank 0's reserve
        agreed = torch.tensor([reserve], dtype=torch.float64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=ranks.control)
        reserve = agreed.item()
    return reserve


def periodic_checkpoints(out_dir):
    """The periodic checkpoints in out_dir, oldest first: files, and complete folders of sharded ones."""
    return sorted(glob.glob(os.path.join(out_dir, "ckpt_*.pt")) + glob.glob(os.path.join(out_dir, "ckpt_*.dcp")),
                  key=os.path.basename)


def inference_model(weights, model_config, device, kernels_ran=None, autocast_dtype=None):
    """A single-device GPT in eval mode for evaluation and sampling, each kernel op as training ran it (the
    per-op record `kernels_ran`, through kernels.scoring_kernels); without one, "nki" becomes "auto".
    autocast_dtype: the forward computes under it, as training did (AutocastGPT)."""
    if kernels_ran:
        setting = kernels.scoring_kernels(kernels_ran)
    else:
        setting = "torch" if model_config.get("kernels") == "torch" else "auto"
    config = GPTConfig(**{**model_config, "kernels": setting})
    model = GPT(config) if autocast_dtype is None else AutocastGPT(config, autocast_dtype)
    model.load_state_dict(weights)
    model.kernels_ran = kernels_ran
    return model.to(device).eval()


class AutocastGPT(GPT):
    """A GPT whose forward runs under its training's autocast (fp32 weights, norms and logits), for a scorer
    that applies none; a context around each call, so the forward stays pure and stateless."""

    def __init__(self, config, autocast_dtype):
        super().__init__(config)
        self.autocast_dtype = autocast_dtype

    def forward(self, idx, targets=None, loss_reduction="mean"):
        with torch.autocast(idx.device.type, dtype=self.autocast_dtype):
            return super().forward(idx, targets, loss_reduction)


def load_for_eval(checkpoint_path, device="cpu"):
    """The contest's scoring hook: a frozen, single-device model whose forward(idx) returns causal
    next-token logits (B, T, vocab) for any T (rotary tables grow on demand), from final.pt or any
    checkpoint this script wrote. It computes as training did: each kernel op on its trained path (the
    `kernels` record) and a bf16 run under bf16 autocast inside the forward (AutocastGPT; a whole-model
    bf16 cast moved val_bpb by 2.3e-4 at the baseline's shapes: docs/results.md)."""
    device = torch.device(device)
    state = checkpoint_io.load_checkpoint(checkpoint_path, keys=("model", "model_config"))
    trained_in = state.get("train_config", {}).get("dtype")
    model = inference_model(state["model"], state["model_config"], "cpu", state.get("kernels"),
                            torch.bfloat16 if trained_in == "bfloat16" else None)
    return model.to(device).requires_grad_(False)


def describe_checkpoint(path):
    """What a checkpoint is, as `python evaluate.py info` prints it: its kind, step, charged seconds, both
    configs, the per-op kernels record (what each op ran in training, and why) and its digest status. A file
    that is no checkpoint raises CheckpointError naming it."""
    state = checkpoint_io.load_checkpoint(path, keys=("step", "train_config", "model_config"), mmap=True, verify=False)
    if "folder" in state:
        files = len(os.listdir(path))
        kind = f"a sharded resumable checkpoint ({files} files: weights, optimizer state by rank, run state)"
    elif "optimizers" in state:
        kind = "a resumable checkpoint (weights, optimizer state, data position)"
    else:
        kind = "a final checkpoint (weights and configs, no optimizer state)"
    return {"path": str(path), "kind": kind, "step": state["step"], "train_time": state.get("train_time"),
            "model_config": state["model_config"], "train_config": state["train_config"],
            "kernels": state.get("kernels"), "digests": checkpoint_io.digest_status(path)}


# -----------------------------------------------------------------------------
# resume, and the output folder

def config_differences(state, cfg, model_cfg):
    """(incompatible, other): 'field (checkpoint X, now Y)' for the differences that make the checkpoint
    unloadable (model shape, optimizer kind) and for the rest of the run config."""
    def differ(saved, now, skip=()):
        return [f"{k} (checkpoint {saved[k]!r}, now {v!r})" for k, v in now.items()
                if k in saved and k not in skip and saved[k] != v]

    now = asdict(cfg)
    # what a field's `opt` marks resumable (how long the run goes on, what it logs and saves, where it runs)
    may_change = {f.name for f in dataclasses.fields(cfg) if f.metadata.get("resumable")}
    skip = may_change | {"matrix_optimizer"} | ({"dtype"} if cfg.dtype == "auto" else set())
    incompatible = differ(state["model_config"], asdict(model_cfg))
    incompatible += differ(state["train_config"], {"matrix_optimizer": cfg.matrix_optimizer})
    return incompatible, differ(state["train_config"], now, skip)


def resume_state(cfg, model_cfg):
    """The loaded checkpoint to resume from. An explicit path is taken if it can be loaded into this run
    (another model shape or matrix optimizer cannot) and its bytes match their digests; --resume=latest
    takes the newest intact periodic checkpoint of out_dir whose run config matches this one (any loadable
    one with --resume_any_config), saying which it took and which it skipped and why: damaged bytes are
    never resumed from. The configs are compared first, from the memory-mapped file, so that only a
    candidate is hashed."""
    def load(path):
        state = checkpoint_io.load_checkpoint(path, mmap=True, verify=False)
        incompatible, other = config_differences(state, cfg, model_cfg)
        if not incompatible and (cfg.resume != "latest" or not other or cfg.resume_any_config):
            state = checkpoint_io.load_checkpoint(path, mmap=True)  # hashed only once its configs fit
        return state, incompatible, other

    if cfg.resume != "latest":
        if not os.path.exists(cfg.resume):
            raise FileNotFoundError(f"--resume={cfg.resume}: no such checkpoint")
        state, incompatible, other = load(cfg.resume)
        if incompatible:
            raise checkpoint_io.CheckpointError(f"{cfg.resume} holds a different model or optimizer: "
                                                f"{'; '.join(incompatible)}; pass the flags it was trained with")
        if other:
            runtime.say(f"resuming from {cfg.resume}, which was trained with other settings: {'; '.join(other)}")
        return state
    found = periodic_checkpoints(cfg.out_dir)
    if not found:
        raise FileNotFoundError(f"--resume=latest: no ckpt_*.pt or ckpt_*.dcp in {cfg.out_dir}; pass a checkpoint path instead")
    skipped, unusable = [], 0
    for path in reversed(found):
        try:
            state, incompatible, other = load(path)
        except checkpoint_io.CheckpointError as e:  # a damaged newest checkpoint must not hide a good older one
            skipped.append(f"{path}: {e}")
            unusable += 1
            continue
        if incompatible or (other and not cfg.resume_any_config):
            skipped.append(f"{path}: another run config: {'; '.join(incompatible + other)}")
            continue
        runtime.say(f"resuming from {path}" + (f" (its run config differs: {'; '.join(other)})" if other else "")
                    + "".join(f"\n  skipped {s}" for s in skipped))
        return state
    if unusable == len(found):
        raise checkpoint_io.CheckpointError(f"--resume=latest: every checkpoint in {cfg.out_dir} is damaged or "
                                            f"unreadable, none is resumed from; start again with --start_over=true "
                                            f"or pass an intact checkpoint (skipped {' | '.join(skipped)})")
    hint = " or --resume_any_config=true to accept other settings" if not cfg.resume_any_config else ""
    raise checkpoint_io.CheckpointError(f"--resume=latest: no checkpoint in {cfg.out_dir} fits this run; pass the "
                                        f"flags it was trained with{hint} (skipped {' | '.join(skipped)})")


RUN_FILES = ("log.jsonl", "final.pt", "ckpt_*.pt", "ckpt_*.dcp")


def check_out_dir(cfg):
    """A new run never writes over another run's files: with them in out_dir it is refused, or with
    --start_over they are moved to out_dir/old_<time>/ (by rank 0; the other ranks only check)."""
    if cfg.resume or not os.path.isdir(cfg.out_dir):
        return
    found = sorted(os.path.basename(p) for pattern in RUN_FILES for p in glob.glob(os.path.join(cfg.out_dir, pattern)))
    if not found:
        return
    listed = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    if not cfg.start_over:
        raise ValueError(f"--out_dir={cfg.out_dir} holds another run's files ({listed}): continue that run with "
                         "--resume=latest, choose a new --out_dir, or pass --start_over=true to move them aside")
    if runtime.is_rank0():
        old = os.path.join(cfg.out_dir, time.strftime("old_%Y%m%d-%H%M%S"))
        os.makedirs(old)
        for name in found:
            os.replace(os.path.join(cfg.out_dir, name), os.path.join(old, name))
        runtime.say(f"--start_over: moved {listed} to {old}/")

"""
Checkpoints: written atomically, read safely (tensors only), restored on any number of ranks; periodic
checkpoints and the final save; resume and the output folder; `load_for_eval`, the contest's scoring hook.
(cf. nanochat's nanochat/checkpoint_manager.py)
"""
import dataclasses
import glob
import os
import pickle
import shutil
import time
import zipfile
from contextlib import suppress
from dataclasses import asdict

import torch
import torch.distributed as dist

import kernels
from kit import optim, runtime
from model import GPT, GPTConfig


# -----------------------------------------------------------------------------
# checkpoints

def write_atomically(path, payload):
    """torch.save to a temporary file, fsync, rename over the target, fsync the folder: a crash at any
    moment leaves the old file or the new one, never a torn one. A full disk names the file."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        os.fsync(dir_fd)  # make the rename itself durable
        os.close(dir_fd)
    except (OSError, RuntimeError) as e:  # a full disk shows as either, depending on where the write stops
        with suppress(FileNotFoundError):  # the half-written file would only take space
            os.remove(tmp)
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
        reason = e.strerror if isinstance(e, OSError) else str(e).splitlines()[0]
        raise OSError(f"cannot write {path} ({reason}; {free / 2**20:.1f} MiB free there); the previous file there "
                      "and earlier checkpoints are intact: free space and resume with --resume=latest") from e


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
    write_atomically(path, {"model": model.state_dict(), "optimizers": optimizer_state(model, optimizers),
                            **run_state(step, train_time, loader_state, train_cfg, model_cfg), "kernels": model.kernels_ran})


def save_sharded_checkpoint(path, model, optimizers, sharding, group, run):
    """A folder written by every rank through torch.distributed.checkpoint: the weights (identical on every
    rank, written once) and each rank's own optimizer state, keyed by parameter name so that any number of
    ranks can load it; `run` (run_state) goes beside it in meta.pt, written by rank 0. It is written as
    PATH.tmp and renamed when complete, so a crash leaves the previous checkpoints as they were."""
    import torch.distributed.checkpoint as dcp  # imported where used, as DTensor is (optimizer_state)

    tmp = f"{path}.tmp"
    state = optimizer_state(model, optimizers, sharding, distributed=group is not None)
    dcp.save({"model": model.state_dict(), "optimizers": state}, checkpoint_id=tmp, process_group=group, no_dist=group is None)
    if group is None or dist.get_rank() == 0:
        write_atomically(os.path.join(tmp, "meta.pt"), {**run, "kernels": model.kernels_ran})
        if os.path.exists(path):  # the same step written before: this one replaces it
            shutil.rmtree(path)
        os.replace(tmp, path)
    if group is not None:
        dist.barrier(group=group)


def save_final(path, model, model_cfg, train_cfg, step, train_time):
    """final.pt: the weights and the configs, no optimizer state (a third of a resumable checkpoint); the
    scorer's load_for_eval reads the weights and model config, evaluate.py the tokenizer named in the run
    config, and `kernels`, per op what ran in training (NKI or PyTorch, and why: model.kernels_ran), which
    scoring follows. Refuses non-finite weights rather than write a model that scores NaN."""
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise FloatingPointError(f"not writing {path}: parameters {bad[:3]} hold non-finite values")
    write_atomically(path, {"model": model.state_dict(), "model_config": asdict(model_cfg),
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
        raise CheckpointError("this checkpoint keeps its optimizer state by position (an earlier version of this kit); "
                              "start the run again, or train it on with the kit that wrote it")
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


def write_checkpoint(cfg, raw_model, optimizers, sharding, corpus, ranks, step, charged):
    """out_dir/ckpt_<step>.pt (by rank 0), or with a sharded optimizer the folder ckpt_<step>.dcp (by every
    rank), keeping the newest keep_checkpoints; returns its path."""
    path = os.path.join(cfg.out_dir, f"ckpt_{step:07d}.{'dcp' if sharding is not None else 'pt'}")
    if sharding is not None:
        run = run_state(step, charged, corpus.state_dict(), cfg, raw_model.config)
        save_sharded_checkpoint(path, raw_model, optimizers, sharding, ranks.control, run)
    elif ranks.rank == 0:
        save_checkpoint(path, raw_model, optimizers, step, charged, corpus.state_dict(), cfg, raw_model.config)
    if ranks.rank == 0:
        for old in periodic_checkpoints(cfg.out_dir)[: -cfg.keep_checkpoints]:
            shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)
    return path


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


class CheckpointError(ValueError):
    """A file that is not a usable checkpoint; the message names it and says why."""


RUN_KEYS = ("step", "train_time", "loader", "rng", "train_config", "model_config")
CHECKPOINT_KEYS = ("model", "optimizers") + RUN_KEYS


def load_checkpoint(path, device="cpu", keys=CHECKPOINT_KEYS, mmap=False):
    """Tensors and plain containers only (weights_only=True): a checkpoint file can never run code. Every way a
    file can be unusable (empty, cut short, not a checkpoint, a pickled object, keys missing) raises
    CheckpointError naming it; torch's own advice for some of these (weights_only=False) would be unsafe.
    mmap: map the tensors instead of reading them, to look at a checkpoint's configs cheaply. A sharded
    checkpoint's folder gives its meta.pt, and "folder", its path, for `restore` to read the tensors from.
    (torch.distributed.checkpoint reads the folder's .metadata with pickle, torch/distributed/checkpoint/
    filesystem.py: resume only from folders you wrote.)"""
    if str(path).endswith(".dcp") and os.path.isdir(path):
        if not os.path.exists(os.path.join(path, ".metadata")):
            raise CheckpointError(f"sharded checkpoint {path} lacks its .metadata: it was not completely written; "
                                  "use another checkpoint")
        return {**load_checkpoint(os.path.join(path, "meta.pt"), device, RUN_KEYS, mmap), "folder": path}
    size = os.path.getsize(path)  # a missing file raises FileNotFoundError, which names it
    if size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes): it was never written; use another checkpoint")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive whose directory is at its end
        raise CheckpointError(f"checkpoint {path} ({size:,} bytes) is not a PyTorch checkpoint: truncated, or another "
                              "kind of file; use another checkpoint")
    try:
        state = torch.load(path, map_location=device, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:  # torch's message advises weights_only=False: not for a file like this
        what = next((line.strip() for line in str(e).splitlines() if "unsupported" in line.lower()), "unknown content")
        raise CheckpointError(f"checkpoint {path} holds objects other than tensors and plain containers, refused "
                              f"unloaded ({what}); only load files you trust") from e
    except RuntimeError as e:  # the zip reader's errors: a damaged archive whose directory survived
        raise CheckpointError(f"checkpoint {path} is damaged ({str(e).splitlines()[0]}); use another checkpoint") from e
    missing = [k for k in keys if not isinstance(state, dict) or k not in state]
    if "optimizers" in missing and isinstance(state, dict) and {"model", "model_config"} <= state.keys():
        raise CheckpointError(f"checkpoint {path} holds the weights only (a final.pt, for evaluation); resume from "
                              "a ckpt_*.pt (written with --checkpoint_every or by a stop signal)")
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {', '.join(missing)}: it was not written by this train.py")
    return state


def inference_model(weights, model_config, device, kernels_ran=None, autocast_dtype=None):
    """A single-device GPT in eval mode for evaluation and sampling, each kernel op run as training ran it:
    `kernels_ran` is the checkpoint's per-op record (kernels.preview_fallbacks), and kernels.scoring_kernels
    turns it into the setting: an op that trained on NKI runs NKI wherever the kernel takes the scorer's shapes
    (PyTorch elsewhere, logged once), an op that trained on PyTorch runs PyTorch. Without a record (a
    checkpoint from before it was kept) "nki" becomes "auto" and "torch" stays. autocast_dtype: the forward
    computes under this autocast, as training did (AutocastGPT), the weights staying fp32."""
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
    """A GPT whose forward runs under the autocast its training ran under (bf16 matmuls, fp32 weights,
    norms, residual stream and logits), for a scorer that applies no autocast of its own. The autocast is a
    context around each call, so the forward stays pure and stateless."""

    def __init__(self, config, autocast_dtype):
        super().__init__(config)
        self.autocast_dtype = autocast_dtype

    def forward(self, idx, targets=None, loss_reduction="mean"):
        with torch.autocast(idx.device.type, dtype=self.autocast_dtype):
            return super().forward(idx, targets, loss_reduction)


def load_for_eval(checkpoint_path, device="cpu"):
    """The contest's scoring hook: a frozen, single-device model whose forward(idx) returns causal
    next-token logits (B, T, vocab) for any T (rotary tables grow on demand), from final.pt or any
    checkpoint this script wrote. It computes as training did: each kernel op on the path it trained on
    (the checkpoint's `kernels` record; inference_model), and, for a run that trained in bf16, under bf16
    autocast inside its forward with fp32 weights (AutocastGPT), since the scorer applies no autocast.
    (A whole-model bf16 cast instead would put the norms, residual stream and logits in bf16, which
    training never did: docs/results.md measures both.)"""
    device = torch.device(device)
    state = load_checkpoint(checkpoint_path, "cpu", keys=("model", "model_config"))
    trained_in = state.get("train_config", {}).get("dtype")
    model = inference_model(state["model"], state["model_config"], "cpu", state.get("kernels"),
                            torch.bfloat16 if trained_in == "bfloat16" else None)
    return model.to(device).requires_grad_(False)


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


def resolve_resume(cfg, model_cfg):
    """The checkpoint to resume from. An explicit path is taken if it can be loaded into this run (another
    model shape or matrix optimizer cannot); --resume=latest takes the newest periodic checkpoint of out_dir
    whose run config matches this one (any loadable one with --resume_any_config), saying which it took
    and which it skipped and why."""
    if cfg.resume != "latest":
        if not os.path.exists(cfg.resume):
            raise FileNotFoundError(f"--resume={cfg.resume}: no such checkpoint")
        incompatible, other = config_differences(load_checkpoint(cfg.resume, mmap=True), cfg, model_cfg)
        if incompatible:
            raise CheckpointError(f"{cfg.resume} holds a different model or optimizer: {'; '.join(incompatible)}; "
                                  "pass the flags it was trained with")
        if other:
            runtime.say(f"resuming from {cfg.resume}, which was trained with other settings: {'; '.join(other)}")
        return cfg.resume
    found = periodic_checkpoints(cfg.out_dir)
    if not found:
        raise FileNotFoundError(f"--resume=latest: no ckpt_*.pt or ckpt_*.dcp in {cfg.out_dir}; pass a checkpoint path instead")
    skipped = []
    for path in reversed(found):
        try:
            incompatible, other = config_differences(load_checkpoint(path, mmap=True), cfg, model_cfg)
        except CheckpointError as e:  # a damaged newest checkpoint should not hide a good older one
            skipped.append(f"{path}: {e}")
            continue
        if incompatible or (other and not cfg.resume_any_config):
            skipped.append(f"{path}: another run config: {'; '.join(incompatible + other)}")
            continue
        runtime.say(f"resuming from {path}" + (f" (its run config differs: {'; '.join(other)})" if other else "")
            + "".join(f"\n  skipped {s}" for s in skipped))
        return path
    hint = " or --resume_any_config=true to accept other settings" if not cfg.resume_any_config else ""
    raise CheckpointError(f"--resume=latest: no checkpoint in {cfg.out_dir} fits this run; pass the flags it was "
                          f"trained with{hint} (skipped {' | '.join(skipped)})")


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

"""
The contest's contract (AWS Trainium Frontier): its prepare.py as the data source and the rule book, the
presets with their sources, and the causality check (the exporter that writes this kit as the one train.py the
contest takes is kit/export.py; the contest's clock is train.py's ChargedClock, beside the loop it times).
"""
import importlib.util
import os
import sys

import torch


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


def export_submission(cfg, model_cfg, argv, vocab_size, prepare, tokenizer):
    """Writes this kit as the one train.py the contest takes: kit/export.py, which the one file leaves out."""
    from kit import export  # the exporter imports this module: imported when used, not at start-up

    return export.export_submission(cfg, model_cfg, argv, vocab_size, prepare, tokenizer)

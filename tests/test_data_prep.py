"""Data preparation, offline: BPE training and its tiktoken export, parallel tokenisation into shards with a
manifest, downloads from a local HTTP server (redirect with the hub's checksum headers, Range resume,
dropped connections, checksum mismatches), and the adapter for the contest's own prepare.py."""
import hashlib
import http.server
import json
import os
import pickle
import random
import re
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import rustbpe
import tiktoken
import torch

import data


def random_text(rng, n):
    """Text from every corner of Unicode: ASCII words and digits, accents and combining marks, CJK, right-to-
    left scripts, emoji, astral and private-use code points, control characters and odd whitespace."""
    pools = [(0x61, 0x7A), (0x20, 0x7E), (0xC0, 0x24F), (0x300, 0x36F), (0x590, 0x6FF), (0x4E00, 0x9FFF),
             (0x1F300, 0x1FAFF), (0x10000, 0x10FFFF), (0xE000, 0xF8FF), (0x0, 0x1F)]
    out = []
    for _ in range(n):
        lo, hi = rng.choice(pools)
        c = rng.randint(lo, hi)
        out.append(chr(c) if not 0xD800 <= c <= 0xDFFF else "?")
        if rng.random() < 0.15:
            out.append(rng.choice([" ", "\n", "\r\n", "\t", "  ", "\n\n", "\u00a0", "\u2028", "123", "'s", "<|endoftext|>"]))
    return "".join(out)


@pytest.fixture(scope="module")
def docs():
    """About 300 documents: slices of the plays (so BPE has real words to merge) and random Unicode."""
    rng = random.Random(0)
    plays = "\n".join(list(data.shakespeare_plays().values())[:3])
    out = []
    for i in range(300):
        start = rng.randrange(len(plays) - 3000)
        prose = plays[start : start + rng.randint(50, 2500)]
        out.append(prose if i % 3 else prose + random_text(rng, rng.randint(1, 200)))
    return out


def write_parquet(path, texts, row_group_size=25):
    pq.write_table(pa.table({"text": texts}), path, row_group_size=row_group_size)


# -----------------------------------------------------------------------------
# tokenizers

@pytest.fixture(scope="module")
def bpe(docs):
    return data.train_bpe(docs, 512)


def test_bpe_is_byte_level_and_round_trips_any_text(bpe):
    assert bpe.n_vocab == 512 and bpe.eot_token == 511 and bpe.name == "bpe512"
    assert {bpe.decode_single_token_bytes(i) for i in range(256)} == {bytes([b]) for b in range(256)}
    rng = random.Random(1)
    for _ in range(300):
        text = random_text(rng, rng.randint(0, 400))
        ids = bpe.encode_ordinary(text)
        assert bpe.decode(ids) == text
        assert bpe.eot_token not in ids  # a literal "<|endoftext|>" in a document stays text
    for _ in range(50):  # any byte string, valid UTF-8 or not, has an encoding that gives it back
        raw = rng.randbytes(rng.randint(1, 300))
        assert bpe.decode_bytes(bpe._encode_bytes(raw)) == raw


def test_bpe_matches_its_trainers_own_encoding(docs, bpe):
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(iter(docs), 511, pattern=data.BPE_SPLIT_PATTERN)
    assert {bytes(t): r for t, r in trainer.get_mergeable_ranks()} == bpe._mergeable_ranks  # training is deterministic
    rng = random.Random(2)
    samples = docs[:100] + [random_text(rng, 300) for _ in range(100)]
    for text in samples:
        assert bpe.encode_ordinary(text) == trainer.encode(text)
    prose = docs[1::3]
    assert sum(len(t.encode()) for t in prose) / sum(len(bpe.encode_ordinary(t)) for t in prose) > 2  # real merges


def test_tokenizer_files_round_trip_and_are_checked(tmp_path, docs, bpe):
    data.save_tokenizer(bpe, tmp_path, trainer="rustbpe")
    lines = (tmp_path / "tokenizer.tiktoken").read_bytes().splitlines()
    assert len(lines) == 511 and lines[65] == b"QQ== 65"  # tiktoken's rank format: base64(bytes) rank
    loaded = data.load_tokenizer(tmp_path)
    assert isinstance(loaded, tiktoken.Encoding)
    assert loaded._mergeable_ranks == bpe._mergeable_ranks and loaded._special_tokens == {data.EOT: 511}
    assert all(loaded.encode_ordinary(t) == bpe.encode_ordinary(t) for t in docs[:50])
    table = data.token_bytes(loaded)
    assert int(table[loaded.eot_token]) == 0
    ids = loaded.encode_ordinary(docs[0])
    assert int(table[ids].sum()) == len(docs[0].encode())
    (tmp_path / "tokenizer.tiktoken").write_bytes(b"\n".join(lines[:-1]) + b"\n")
    with pytest.raises(ValueError, match="corrupt"):
        data.load_tokenizer(tmp_path)


def test_tokenizer_names():
    assert data.tokenizer_name("bpe") == "bpe8192" and data.tokenizer_name("bpe512") == "bpe512"
    with pytest.raises(ValueError, match="unknown tokenizer"):
        data.tokenizer_name("sentencepiece")
    with pytest.raises(ValueError, match="at least 257"):
        data.tokenizer_name("bpe100")
    with pytest.raises(FileNotFoundError, match="python data.py nowhere --tokenizer=bpe8192"):
        data.get_tokenizer("bpe", "nowhere", "/nonexistent")


def test_training_path_does_not_import_preparation_packages():
    code = "import sys, data; print(sorted(m for m in ('pyarrow', 'rustbpe') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("entry_point", ["bench", "evaluate"])  # each imports train.py, where it is set
def test_every_entry_point_sets_the_neuron_compiler_flags_before_compiling(entry_point):
    """TorchNeuron reads NEURON_CC_FLAGS at each compilation, so importing an entry point must set it; and
    TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=1, so a graph that fails to compile raises instead of running
    op by op."""
    code = (f"import os, {entry_point}; print(os.environ['NEURON_CC_FLAGS']); "
            "print(os.environ['TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION'])")
    env = {k: v for k, v in os.environ.items() if k not in ("NEURON_CC_FLAGS", "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.split()[-3:] == ["--optlevel=1", "--auto-cast=none", "1"]


# -----------------------------------------------------------------------------
# a local corpus through the whole path

@pytest.fixture(scope="module")
def corpus(tmp_path_factory, docs):
    """Train files of every kind (jsonl, parquet in row groups, txt, md) and a parquet validation file."""
    root = tmp_path_factory.mktemp("corpus")
    train = {"a.jsonl": docs[:100], "b.parquet": docs[100:200], "c.txt": [docs[200]], "d.md": [docs[201]]}
    with open(root / "a.jsonl", "w") as f:
        for i, doc in enumerate(train["a.jsonl"]):
            f.write(json.dumps({"id": i, "text": doc}) + ("\n\n" if i == 50 else "\n"))
    write_parquet(root / "b.parquet", train["b.parquet"])
    (root / "c.txt").write_text(docs[200], encoding="utf-8")
    (root / "d.md").write_text(docs[201], encoding="utf-8")
    write_parquet(root / "val.parquet", docs[202:])
    return root, [d for name in sorted(train) for d in train[name]], docs[202:]


def split_documents(tokens, separator):
    starts = np.flatnonzero(tokens == separator)
    assert starts[0] == 0  # the stream starts with a document
    return [tokens[a + 1 : b] for a, b in zip(starts, list(starts[1:]) + [len(tokens)])]


def test_local_corpus_to_shards_manifest_and_loader(tmp_path, corpus, monkeypatch):
    root, train_docs, val_docs = corpus
    monkeypatch.setattr(data, "JSONL_CHUNK", 4096)  # several byte-range tasks per .jsonl file
    files = [str(root / n) for n in ("a.jsonl", "b.parquet", "c.txt", "d.md")]
    out = data.prepare("mini", "bpe512", str(tmp_path), files=files, val_files=[str(root / "val.parquet")],
                       workers=2, shard_tokens=20_000)
    manifest = json.loads((tmp_path / "mini-bpe512" / "manifest.json").read_text())
    enc = data.get_tokenizer("bpe512", "mini", str(tmp_path))
    assert manifest["tokenizer"]["n_vocab"] == enc.n_vocab == 512
    assert manifest["tokenizer"]["separator_id"] == enc.eot_token and manifest["workers"] == 2
    assert [s["sha256"] for s in manifest["sources"]] == [data.file_sha256(p) for p in files + [str(root / "val.parquet")]]
    table = data.token_bytes(enc)
    for split, expected in (("train", train_docs), ("val", val_docs)):
        info = manifest["splits"][split]
        paths = data.shard_paths(out, split)
        assert [os.path.basename(p) for p in paths] == [s["file"] for s in info["shards"]]
        assert [data.file_sha256(p) for p in paths] == [s["sha256"] for s in info["shards"]]
        shards = [data.read_shard(p, enc.n_vocab) for p in paths]
        assert all(s[0] == enc.eot_token for s in shards)  # shards are cut between documents
        stream = np.concatenate(shards)
        decoded = [enc.decode(d.tolist()) for d in split_documents(stream, enc.eot_token)]
        assert decoded == expected  # every document, in order, exactly
        assert info["documents"] == len(expected) and info["tokens"] == len(stream)
        assert info["bytes"] == sum(len(d.encode()) for d in expected) == int(table[torch.from_numpy(stream.astype(np.int64))].sum())
    assert len(manifest["splits"]["train"]["shards"]) > 2

    x, y = next(data.TokenLoader(data.shard_paths(out, "train"), 4, 64, vocab_size=enc.n_vocab))
    assert x.shape == y.shape == (4, 64) and torch.equal(x[:, 1:], y[:, :-1])
    stamp = os.path.getmtime(data.shard_paths(out, "train")[0])
    assert data.prepare("mini", "bpe512", str(tmp_path)) == out  # as train.py calls it: found, not redone
    assert os.path.getmtime(data.shard_paths(out, "train")[0]) == stamp

    # the command line, one process, into another folder: the same tokenizer and byte-identical shards
    other = tmp_path / "again"
    data.main([*files, f"--val_files={root / 'val.parquet'}", "--name=mini", "--tokenizer=bpe512",
               f"--data_dir={other}", "--workers=1", "--shard_tokens=20000"])
    again = json.loads((other / "mini-bpe512" / "manifest.json").read_text())
    assert again["splits"] == manifest["splits"]
    assert (other / "mini-bpe512" / "tokenizer.tiktoken").read_bytes() == (tmp_path / "mini-bpe512" / "tokenizer.tiktoken").read_bytes()


def test_a_single_file_needs_a_validation_file(tmp_path, corpus):
    root, _, _ = corpus
    with pytest.raises(ValueError, match="at least two files"):
        data.prepare("one", "bytes", str(tmp_path), files=[str(root / "b.parquet")])
    with pytest.raises(FileNotFoundError, match="no such file"):
        data.prepare("two", "bytes", str(tmp_path), files=[str(root / "missing.jsonl"), str(root / "b.parquet")])


# -----------------------------------------------------------------------------
# downloads, against a local server that answers like the Hugging Face hub

class Hub(http.server.BaseHTTPRequestHandler):
    """/resolve/<name> redirects to /cdn/<name> with X-Linked-Etag (sha256) and X-Linked-Size, as the hub
    does for large files; /cdn/<name> serves the bytes, honouring "Range: bytes=N-"."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        hub = self.server
        hub.log.append((self.path, self.headers.get("Range")))
        kind, _, name = self.path.lstrip("/").partition("/")
        if name not in hub.files:
            self.send_error(404)
            return
        body = hub.files[name]
        if kind == "resolve":
            self.send_response(302)
            self.send_header("Location", f"/cdn/{name}")
            self.send_header("X-Linked-Etag", f'"{hub.etags.get(name, hashlib.sha256(body).hexdigest())}"')
            self.send_header("X-Linked-Size", str(len(body)))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        start = int(re.fullmatch(r"bytes=(\d+)-", self.headers["Range"]).group(1)) if self.headers.get("Range") else 0
        if start >= len(body) and start:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(body)}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        drop = hub.drop_after.pop(name, None)  # hang up after this many bytes, once
        self.wfile.write(body[start:] if drop is None else body[start : start + drop])


@pytest.fixture
def hub(tmp_path, docs):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    served = tmp_path / "served"
    served.mkdir()
    write_parquet(served / "train.parquet", docs[:150])
    write_parquet(served / "val.parquet", docs[150:])
    server.files = {n: (served / n).read_bytes() for n in ("train.parquet", "val.parquet")}
    server.etags, server.drop_after, server.log = {}, {}, []
    server.url = f"http://127.0.0.1:{server.server_address[1]}/resolve"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("have", [1000, "all"])
def test_download_resumes_a_partial_file(tmp_path, hub, have):
    body = hub.files["train.parquet"]
    have = len(body) if have == "all" else have
    path = tmp_path / "train.parquet"
    (tmp_path / "train.parquet.partial").write_bytes(body[:have])
    sha = data.download(f"{hub.url}/train.parquet", str(path), retry_wait=0)
    assert path.read_bytes() == body and sha == hashlib.sha256(body).hexdigest()
    assert not os.path.exists(f"{path}.partial")
    assert hub.log == [("/resolve/train.parquet", f"bytes={have}-"), ("/cdn/train.parquet", f"bytes={have}-")]


def test_download_resumes_after_the_connection_drops(tmp_path, hub):
    hub.drop_after["train.parquet"] = 3000
    path = tmp_path / "train.parquet"
    data.download(f"{hub.url}/train.parquet", str(path), retry_wait=0)
    assert path.read_bytes() == hub.files["train.parquet"]
    assert [r for p, r in hub.log if p.startswith("/cdn")] == [None, "bytes=3000-"]


def test_a_checksum_mismatch_is_refused(tmp_path, hub):
    hub.etags["train.parquet"] = "0" * 64
    path = tmp_path / "train.parquet"
    with pytest.raises(data.ChecksumError, match="sha256 .* expected 0000"):
        data.download(f"{hub.url}/train.parquet", str(path), retries=2, retry_wait=0)
    assert not path.exists() and not os.path.exists(f"{path}.partial")
    assert len([p for p, _ in hub.log if p.startswith("/cdn")]) == 2  # tried again from scratch, then gave up


def test_a_corrupt_partial_file_is_downloaded_again(tmp_path, hub):
    body = hub.files["train.parquet"]
    path = tmp_path / "train.parquet"
    (tmp_path / "train.parquet.partial").write_bytes(b"x" * 1000)  # not the file's first 1000 bytes
    data.download(f"{hub.url}/train.parquet", str(path), retry_wait=0)
    assert path.read_bytes() == body
    assert [r for p, r in hub.log if p.startswith("/cdn")] == ["bytes=1000-", None]


def test_a_missing_file_fails_at_once(tmp_path, hub):
    with pytest.raises(data.DataError, match="404"):
        data.download(f"{hub.url}/nope.parquet", str(tmp_path / "nope.parquet"), retry_wait=0)
    assert len(hub.log) == 1


def test_remote_dataset_downloads_verifies_and_prepares(tmp_path, hub, docs):
    out = data.prepare("remote", "bytes", str(tmp_path), base_url=hub.url, files=["train.parquet"],
                       val_files=["val.parquet"], workers=2)
    raw = tmp_path / "raw" / "remote"
    sums = data.read_sha256sums(raw / "SHA256SUMS")
    assert sums == {n: hashlib.sha256(b).hexdigest() for n, b in hub.files.items()}
    manifest = json.loads((tmp_path / "remote-bytes" / "manifest.json").read_text())
    assert [(s["url"], s["sha256"]) for s in manifest["sources"]] == [(f"{hub.url}/{n}", sums[n]) for n in ("train.parquet", "val.parquet")]
    enc = data.get_tokenizer("bytes")
    val = data.read_shard(data.shard_paths(out, "val")[0])
    assert [enc.decode(d.tolist()) for d in split_documents(val, enc.eot_token)] == docs[150:]

    # a later run re-checks the files it has: a damaged one is fetched again, an intact one is not
    (raw / "val.parquet").write_bytes(b"damaged")
    hub.log.clear()
    data.download_files(hub.url, ["train.parquet", "val.parquet"], str(raw), retry_wait=0)
    assert (raw / "val.parquet").read_bytes() == hub.files["val.parquet"]
    assert [p for p, _ in hub.log] == ["/resolve/val.parquet", "/cdn/val.parquet"]

    # asked for other files, the prepared dataset is made again (no stale shards left behind)
    assert data.prepare("remote", "bytes", str(tmp_path), base_url=hub.url, files=["val.parquet"],
                        val_files=["train.parquet"], workers=1) == out
    val = np.concatenate([data.read_shard(p) for p in data.shard_paths(out, "val")])
    assert [enc.decode(d.tolist()) for d in split_documents(val, enc.eot_token)] == docs[:150]


# -----------------------------------------------------------------------------
# the contest's own prepare.py: its parquet shards and its tokenizer

FAKE_PREPARE = '''
"""Stands in for the contest's prepare.py: autoresearch's layout and Tokenizer interface."""
import os
import pickle

CACHE_DIR = os.path.dirname(os.path.abspath(__file__))
DATA_DIR = os.path.join(CACHE_DIR, "data")
TOKENIZER_DIR = os.path.join(CACHE_DIR, "tokenizer")
VAL_FILENAME = "shard_00002.parquet"
BOS_TOKEN = "<|reserved_0|>"


class Tokenizer:
    def __init__(self, enc):
        self.enc = enc
        self.bos_token_id = enc.encode_single_token(BOS_TOKEN)

    @classmethod
    def from_directory(cls, tokenizer_dir=TOKENIZER_DIR):
        with open(os.path.join(tokenizer_dir, "tokenizer.pkl"), "rb") as f:
            return cls(pickle.load(f))

    def get_bos_token_id(self):
        return self.bos_token_id


def ensure_tokenizer(build_if_missing=True):
    return Tokenizer.from_directory()
'''


def test_the_contests_data_and_tokenizer(tmp_path, docs):
    contest = tmp_path / "contest"
    (contest / "data").mkdir(parents=True)
    (contest / "tokenizer").mkdir()
    (contest / "prepare.py").write_text(textwrap.dedent(FAKE_PREPARE))
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(iter(docs), 400 - 4, pattern=data.BPE_SPLIT_PATTERN)
    ranks = {bytes(t): r for t, r in trainer.get_mergeable_ranks()}
    theirs = tiktoken.Encoding("rustbpe", pat_str=trainer.get_pattern(), mergeable_ranks=ranks,
                               special_tokens={f"<|reserved_{i}|>": len(ranks) + i for i in range(4)})
    with open(contest / "tokenizer" / "tokenizer.pkl", "wb") as f:
        pickle.dump(theirs, f)
    parts = [docs[:100], docs[100:200], docs[200:]]
    for i, part in enumerate(parts):
        write_parquet(contest / "data" / f"shard_{i:05d}.parquet", part)

    out = data.prepare("competition", "competition", str(tmp_path / "cache"), competition_dir=str(contest), workers=2)
    enc = data.get_tokenizer("competition", "competition", str(tmp_path / "cache"))
    bos = len(ranks)
    assert enc.n_vocab == theirs.n_vocab == 400 and enc.eot_token == bos
    assert enc._special_tokens == {data.EOT: bos, "<|reserved_1|>": bos + 1, "<|reserved_2|>": bos + 2, "<|reserved_3|>": bos + 3}
    for split, expected in (("train", parts[0] + parts[1]), ("val", parts[2])):
        stream = np.concatenate([data.read_shard(p, enc.n_vocab) for p in data.shard_paths(out, split)])
        want = [t for doc in expected for t in [bos] + theirs.encode_ordinary(doc)]
        assert stream.tolist() == want  # exactly the contest's token ids
    table = data.token_bytes(enc)
    assert table[bos:].tolist() == [0, 0, 0, 0] and table[:bos].min() >= 1

import os

import numpy as np
import pytest
import torch

import data


@pytest.fixture(scope="module")
def enc():
    return data.get_tokenizer("bytes")


def test_byte_tokenizer_round_trip(enc):
    text = "O, what a rogue and peasant slave am I!\n  Ünïcödé — ✓ 'tis\t"
    ids = enc.encode_ordinary(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert enc.decode(ids) == text
    assert enc.n_vocab == 257 and enc.eot_token == 256


def test_token_bytes_counts_utf8_bytes_and_zero_for_special(enc):
    table = data.token_bytes(enc)
    assert table.shape == (257,)
    assert torch.all(table[:256] == 1) and table[enc.eot_token] == 0
    ids = enc.encode_ordinary("héllo") + [enc.eot_token]
    assert int(table[ids].sum()) == len("héllo".encode())


def test_shard_round_trip_and_dtype(tmp_path):
    small, large = np.arange(1000) % 257, np.array([0, 70000, 5])
    data.write_shard(tmp_path / "a.bin", small)
    data.write_shard(tmp_path / "b.bin", large)
    a, b = data.read_shard(tmp_path / "a.bin", 257), data.read_shard(tmp_path / "b.bin")
    assert a.dtype == np.uint16 and np.array_equal(a, small)
    assert b.dtype == np.uint32 and np.array_equal(b, large)


def corrupt(path, offset, payload):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(payload)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: corrupt(p, 0, b"NOTTOKEN"), "not a token shard"),
        (lambda p: corrupt(p, 8, (7).to_bytes(4, "little")), "format version 7"),
        (lambda p: corrupt(p, 12, (3).to_bytes(4, "little")), "3 bytes per token"),
        (lambda p: os.truncate(p, os.path.getsize(p) - 10), "truncated or corrupt"),
        (lambda p: os.truncate(p, 10), "shorter than its header"),
        (lambda p: None, ">= vocab_size 200"),
    ],
)
def test_bad_shards_are_rejected_with_the_reason(tmp_path, damage, message):
    path = tmp_path / "s.bin"
    data.write_shard(path, np.arange(256))
    damage(path)
    with pytest.raises(ValueError, match=message):
        data.read_shard(path, vocab_size=200)


def test_missing_shard_says_how_to_make_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="python data.py"):
        data.read_shard(tmp_path / "nope.bin")


@pytest.fixture
def shard(tmp_path):
    path = tmp_path / "train_000.bin"
    data.write_shard(path, np.arange(8 * 64 * 5 + 1) % 257)
    return [path]


def windows_of(loader, steps):
    return {tuple(x[i, :3].tolist()) for _ in range(steps) for x, _ in [next(loader)] for i in range(x.size(0))}


def test_targets_are_inputs_shifted_by_one(shard):
    x, y = next(data.TokenLoader(shard, 4, 64, vocab_size=257))
    assert x.shape == y.shape == (4, 64) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_ranks_see_disjoint_windows_that_together_match_one_rank(shard):
    ranks = [data.TokenLoader(shard, 2, 64, rank=r, world_size=4, seed=3) for r in range(4)]
    seen = [windows_of(loader, 4) for loader in ranks]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not seen[i] & seen[j]
    single = data.TokenLoader(shard, 8, 64, seed=3)  # one rank taking all four ranks' micro-batches
    assert set().union(*seen) == windows_of(single, 4)


def test_loader_is_deterministic_and_resumes_from_its_state(shard):
    a, b = data.TokenLoader(shard, 3, 64, seed=1), data.TokenLoader(shard, 3, 64, seed=1)
    for _ in range(5):
        next(a)
    b.load_state_dict(a.state_dict())
    for _ in range(20):  # across the epoch boundary
        assert torch.equal(next(a)[0], next(b)[0])
    other_seed = data.TokenLoader(shard, 3, 64, seed=2)
    assert not torch.equal(next(other_seed)[0], next(data.TokenLoader(shard, 3, 64, seed=1))[0])


def window_list(loaders, batches):
    """The windows `batches` batches of each loader read, each by its first token (unique in the shard)."""
    return sorted(int(t) for loader in loaders for _ in range(batches) for t in next(loader)[0][:, 0])


def test_resume_at_another_world_size_reads_the_next_unseen_windows(shard):
    # 40 windows: 10 per rank at world size 4 (5 batches of 2), 20 per rank at world size 2
    four = [data.TokenLoader(shard, 2, 64, rank=r, world_size=4, seed=3) for r in range(4)]
    read = window_list(four, 2)
    two = [data.TokenLoader(shard, 2, 64, rank=r, world_size=2, seed=3) for r in range(2)]
    for loader in two:
        loader.load_state_dict(four[0].state_dict())  # rank 0's, as a checkpoint holds it
    rest_of_epoch = window_list(two, 6)  # 3 batches at world size 4
    assert rest_of_epoch == window_list(four, 3)
    assert sorted(read + rest_of_epoch) == window_list([data.TokenLoader(shard, 40, 64)], 1)  # each window once
    assert window_list(two, 2) == window_list(four, 1)  # and on into the next epoch alike


def test_a_state_without_world_size_resumes_at_the_same_world_size(shard):
    a, b = (data.TokenLoader(shard, 2, 64, rank=1, world_size=4, seed=3) for _ in range(2))
    next(a)
    b.load_state_dict({"epoch": a.epoch, "position": a.position})  # as saved before world_size was
    assert torch.equal(next(a)[0], next(b)[0])


def test_resume_at_a_world_size_that_cannot_split_the_position_is_refused(shard):
    four = data.TokenLoader(shard, 2, 64, rank=0, world_size=4)
    next(four)  # 8 windows read, which 3 ranks cannot split
    with pytest.raises(ValueError, match="world size 4 after 8 windows .* divides 8, or at world size 4"):
        data.TokenLoader(shard, 2, 64, world_size=3).load_state_dict(four.state_dict())
    pooled = data.TokenLoader(shard, 2, 64, world_size=4, shuffle=False, row_pool=2)
    next(pooled)
    with pytest.raises(ValueError, match="row_pool=2 the epoch's order differs at world size 2"):
        data.TokenLoader(shard, 2, 64, world_size=2, shuffle=False, row_pool=2).load_state_dict(pooled.state_dict())


def test_too_little_data_for_the_batch_is_a_clear_error(shard):
    with pytest.raises(ValueError, match="fewer than batch_size"):
        data.TokenLoader(shard, 32, 64, world_size=2)


def test_prepare_builds_the_default_corpus_once(tmp_path):
    path = data.prepare("shakespeare", "bytes", str(tmp_path))
    train = data.read_shard(data.shard_paths(path, "train")[0], 257)
    val = data.read_shard(data.shard_paths(path, "val")[0], 257)
    assert len(train) > 4_000_000 and len(val) > 200_000
    enc = data.get_tokenizer("bytes")
    text = enc.decode(val[:2000].tolist())
    assert text.startswith("<|endoftext|>") and "**" not in text
    stamp = os.path.getmtime(data.shard_paths(path, "train")[0])
    assert data.prepare("shakespeare", "bytes", str(tmp_path)) == path
    assert os.path.getmtime(data.shard_paths(path, "train")[0]) == stamp

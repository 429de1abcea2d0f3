"""The compiler's SBUF allocation modelled (nki_emulator/_spill.py) on hand-built traces whose spills are known: a
trace whose live SBUF tiles exceed what a kernel may use gets spill transfers and finishes later, its twin that fits
gets none; the tile spilled is the one used furthest ahead (Belady's MIN); a tile reuses bytes only after the tile
that held them is done; the engine that waits for a spill reload issues it in its turn and idles until it ends, while
a twin that fits fills its waits as before; and traces of real kernels name the tiles the compiler places."""

import numpy as np
import pytest

import nki_emulator
import nki_emulator.isa as nisa
import nki_emulator.language as nl
from nki_emulator import Instruction, legacy_trace, timeline
from nki_emulator._runtime import TARGETS, SbufTile
from nki_emulator._schedule import list_schedule, program_order_schedule, schedule
from nki_emulator._spill import with_spills

FP32 = "float32"
TRN2_SBUF = TARGETS["trn2"].sbuf_usable_bytes  # 212984 bytes per partition


def whole(tile):
    return (tile, 0, tile.partitions, 0, tile.row_bytes)


def load(tile, hbm):
    """A DMA of ``tile`` in from its own HBM tensor ``hbm`` (a serial)."""
    return Instruction("dma_copy", "dma", tile.partitions, tile.row_bytes // 4, (FP32, FP32), ("sbuf", "shared_hbm"),
                       reads=((hbm, 0, 1, 0, tile.partitions * tile.row_bytes),), writes=(whole(tile),), launch=1)


def fill(tile):
    """A memset of all of ``tile``: a value computed on chip, which has no copy in HBM."""
    return Instruction("memset", "vector", tile.partitions, tile.row_bytes // 4, (FP32,), ("sbuf",), ("zero",),
                       writes=(whole(tile),), launch=1)


def add_into(tile, total):
    """``total += tile`` on VectorE (a small accumulator that stays in SBUF)."""
    return Instruction("tensor_tensor", "vector", tile.partitions, tile.row_bytes // 4, (FP32,) * 3, ("sbuf",) * 3,
                       ("add",), reads=(whole(tile), whole(total)), writes=(whole(total),), launch=1)


def three_tiles_then_uses(row_bytes, use_order="abc", make=fill):
    """Fill (or load) a, b, c, then add each into a total in ``use_order``, then a once more."""
    tiles = {name: SbufTile(serial, 128, row_bytes) for serial, name in enumerate("abc", 1)}
    total = SbufTile(9, 128, 4)
    trace = [fill(tiles[name]) if make is fill else load(tiles[name], 100 + k) for k, name in enumerate("abc")]
    return tiles, trace + [add_into(tiles[name], total) for name in use_order + "a"]


def spills(trace):
    return [(i.name, i.reads[0][0] if i.name == "spill_store" else i.writes[0][0]) for i in trace
            if i.name in ("spill_store", "spill_reload", "refetch")]


def test_a_trace_whose_live_tiles_exceed_sbuf_spills_one_and_finishes_later_its_twin_that_fits_does_not():
    tiles, trace = three_tiles_then_uses(80_000)  # 3 x 80,000 bytes per partition > 212,984
    compiled, moved = with_spills(trace, "trn2")
    assert len(compiled) == len(trace) + 4  # b out (c needs room) and back; a out (b needs room) and back
    assert moved["spill_store"] == moved["spill_reload"] == 2 * 128 * 80_000
    for order in ("list", "program"):
        plain = (list_schedule if order == "list" else program_order_schedule)(trace, "trn2")["scheduled_s"]
        assert schedule(trace, "trn2", order=order)["scheduled_s"] > plain  # the spill transfers take time
    _, fits = three_tiles_then_uses(70_000)  # 3 x 70,000 < 212,984: the same instructions, narrower
    compiled, moved = with_spills(fits, "trn2")
    assert compiled == fits and moved == {"spill_store": 0, "spill_reload": 0, "refetch": 0, "unplaced": 0}
    assert schedule(fits, "trn2")["scheduled_s"] == list_schedule(fits, "trn2")["scheduled_s"]


@pytest.mark.parametrize("use_order, first_out", [("abc", "b"), ("bac", "a")])
def test_the_tile_spilled_is_the_one_whose_next_use_is_furthest_away(use_order, first_out):
    tiles, trace = three_tiles_then_uses(80_000, use_order)
    compiled, _ = with_spills(trace, "trn2")
    assert spills(compiled)[0] == ("spill_store", tiles[first_out])  # for c, the one of a and b used later
    reload = next(p for p, i in enumerate(compiled) if i.name == "spill_reload" and i.writes[0][0] == tiles[first_out])
    use = next(p for p, i in enumerate(compiled) if i.name == "tensor_tensor" and i.reads[0][0] == tiles[first_out])
    assert reload < use  # back before its next read


def test_a_tile_not_written_since_it_went_out_is_not_stored_again_and_a_dead_value_is_not_reloaded():
    a, b, c = (SbufTile(serial, 128, 150_000) for serial in (1, 2, 3))  # no two of them fit at once
    total = SbufTile(9, 128, 4)
    trace = [fill(a), add_into(a, total), fill(b), add_into(b, total), add_into(a, total), fill(c),
             add_into(c, total), add_into(a, total)]
    # a goes out for b (stored: written since), comes back, goes out for c (only read since: its HBM copy is good)
    assert spills(with_spills(trace, "trn2")[0]) == [("spill_store", a), ("spill_reload", a), ("spill_reload", a)]
    overwritten = trace[:4] + [fill(a)] + trace[5:]  # a filled afresh where it was read: its old value is dead
    assert spills(with_spills(overwritten, "trn2")[0]) == [("spill_store", a), ("spill_store", a),
                                                           ("spill_reload", a)]


def test_a_tile_loaded_whole_from_hbm_and_unchanged_is_not_stored_but_loaded_again_from_where_it_came():
    a, b, total = SbufTile(1, 128, 150_000), SbufTile(2, 128, 150_000), SbufTile(9, 128, 4)
    trace = [load(a, 100), add_into(a, total), load(b, 101), add_into(b, total), add_into(a, total)]
    compiled, moved = with_spills(trace, "trn2")
    assert spills(compiled) == [("refetch", a)]  # a makes room for b, no store: HBM still has it
    assert moved["spill_store"] == moved["spill_reload"] == 0 and moved["refetch"] == 128 * 150_000
    assert next(i for i in compiled if i.name == "refetch").reads == trace[0].reads  # from where it was loaded


def test_a_load_whose_tile_is_used_furthest_ahead_waits_for_that_use_instead_of_pushing_another_out():
    tiles, trace = three_tiles_then_uses(80_000, make=load)  # c, loaded third, is used after a and b
    compiled, moved = with_spills(trace, "trn2")
    assert len(compiled) == len(trace) and moved == {"spill_store": 0, "spill_reload": 0, "refetch": 0,
                                                     "unplaced": 0}  # the same transfers, in another order
    load_c = next(p for p, i in enumerate(compiled) if i.name == "dma_copy" and i.writes[0][0] == tiles["c"])
    assert load_c == 4 and compiled[5].reads[:2] == trace[5].reads  # moved to just before its use (a bypass)


def reuse_trace(second_row_bytes):
    """A tile read by a long reduce, then a second tile loaded: independent but for SBUF room."""
    first, second, out = SbufTile(1, 128, 150_000), SbufTile(2, 128, second_row_bytes), SbufTile(3, 128, 4)
    long_read = Instruction("tensor_reduce", "vector", 128, 37_500, (FP32, FP32), ("sbuf", "sbuf"), ("add",),
                            reads=(whole(first),), writes=(whole(out),), launch=1)
    return [load(first, 100), long_read, load(second, 101), add_into(second, out)]


def test_a_tile_takes_the_bytes_of_one_that_died_only_after_its_last_reader_ends():
    trace = reuse_trace(150_000)  # both cannot be in SBUF at once: the second takes the first's bytes
    unlimited = list_schedule(trace, "trn2")["slots"]
    assert unlimited[2].start < unlimited[1].end  # with a buffer each, the second load would run under the reduce
    slots = schedule(trace, "trn2")["slots"]
    assert slots[2].start >= slots[1].end and spills(with_spills(trace, "trn2")[0]) == []
    roomy = schedule(reuse_trace(50_000), "trn2")["slots"]  # room for both: it runs ahead as before
    assert roomy[2].start < roomy[1].end


def with_later_work(row_bytes):
    """three_tiles_then_uses, then 40 small memsets on VectorE that depend on nothing, issued last."""
    tiles, trace = three_tiles_then_uses(row_bytes)
    return tiles, trace + [fill(SbufTile(20 + k, 128, 4)) for k in range(40)]


def waiter_of(trace, reload):
    """The instruction a spill_reload was inserted for: the next one that touches its tile."""
    tile = trace[reload].writes[0][0]
    return next(p for p in range(reload + 1, len(trace)) if tile in {r[0] for r in trace[p].reads + trace[p].writes})


@pytest.mark.parametrize("order", ["list", "program"])
def test_the_engine_that_waits_for_a_spill_reload_issues_it_in_its_turn_and_runs_nothing_until_it_has_ended(order):
    # fused_mamba.rst (v2.23.0 l. 764-767): "VectorE enters idle states due to a blocking semaphore wait for
    # qSyncSpillReload0 activities ... Computation and data movement are also not overlapped properly": the later
    # memsets, ready all along, do not fill the wait, and the reload does not start under the engine's earlier work
    _, trace = with_later_work(80_000)
    result = schedule(trace, "trn2", order=order)
    compiled, slots = result["trace"], result["slots"]
    reloads = [p for p, i in enumerate(compiled) if i.name == "spill_reload"]
    assert len(reloads) == 2
    for reload in reloads:
        waiter = waiter_of(compiled, reload)
        assert slots[waiter].track == "vector" and slots[waiter].start >= slots[reload].end
        assert not [s for s in slots if s.track == "vector" and s.start < slots[reload].end
                    and s.end > slots[reload].start]


def test_a_twin_that_fits_sbuf_fills_its_waits_with_later_work_as_before():
    _, trace = with_later_work(70_000)  # the same instructions, narrower: no spill
    result = schedule(trace, "trn2")
    assert result["trace"] == trace and result["slots"] == list_schedule(trace, "trn2")["slots"]
    adds = [s for s in result["slots"] if s.name == "tensor_tensor"]
    assert any(s.name == "memset" and s.index > adds[-1].index and s.start < adds[-1].start for s in result["slots"])


def test_a_timeline_of_a_spilling_trace_draws_its_spill_transfers():
    _, trace = three_tiles_then_uses(80_000)
    events = timeline.trace_events(trace, schedule(trace, "trn2"), "spills")["traceEvents"]
    drawn = [e for e in events if e["ph"] == "X"]
    assert {"spill_store", "spill_reload"} <= {e["name"] for e in drawn}
    assert len(drawn) == len(trace) + 4  # each instruction and transfer, once


def tiles_of(trace):
    return {r[0] for i in trace for r in i.reads + i.writes if isinstance(r[0], SbufTile)}


def test_the_emulators_and_the_legacy_tracers_traces_name_the_sbuf_tiles_the_compiler_places():
    @nki_emulator.jit
    def double(a):
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        tile = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=a)
        nisa.tensor_scalar(dst=tile, data=tile, op0=nl.multiply, operand0=2.0)
        nisa.dma_copy(dst=out, src=tile)
        return out

    with nki_emulator.counting() as counts:
        double(np.ones((128, 64), np.float32))
    assert tiles_of(counts.trace) == {SbufTile(next(iter(tiles_of(counts.trace))).serial, 128, 256)}
    source = ("import neuronxcc.nki as nki\nimport neuronxcc.nki.language as nl\n@nki.jit\ndef kernel(a):\n"
              "    out = nl.ndarray((128, 64), dtype=a.dtype, buffer=nl.shared_hbm)\n"
              "    t = nl.load(a[0:128, 0:64])\n    nl.store(out[0:128, 0:64], value=t * 2.0)\n    return out\n")
    traced = legacy_trace.run(source, [np.ones((128, 64), np.float32)], "trn1")
    assert {t.row_bytes for t in tiles_of(traced)} == {256} and len(tiles_of(traced)) == 2  # t and t * 2.0

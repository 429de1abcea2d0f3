"""Sharded optimizer state and update (kit/optim.py Sharding) on 4 CPU ranks (gloo), against one process and
DDP doing the same work; and its layout and memory plan. `python -m torch.distributed.run --nproc_per_node=4
tests/test_sharding.py OUT` runs the ranks' side (what the test below launches) and writes what it measured."""
import contextlib
import copy
import re
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANKS = 4


def test_layout_shares_every_element_once_and_keeps_matrices_whole():
    from kit import optim

    shapes = [(128, 32), (32, 32), (32, 32), (128, 32), (32,), (), (70, 32)]
    whole = [False, True, True, True, True, True, False]
    layout = optim.shard_layout(shapes, whole, RANKS)
    loads = [0] * RANKS
    for shape, keep, pieces in zip(shapes, whole, layout):
        rows = shape[0] if shape else 1
        assert [(first, end) for _, first, end, _ in pieces] == ([(0, rows)] if keep else
                                                                   [(min(rows, r * -(-rows // RANKS)), min(rows, (r + 1) * -(-rows // RANKS))) for r in range(RANKS)])
        for rank, first, end, elements in pieces:
            assert elements == (end - first) * (shape[1] if len(shape) > 1 else 1)
            loads[rank] += elements
    assert sum(loads) == sum(torch.Size(s).numel() for s in shapes)
    assert optim.shard_loads(layout, RANKS) == loads
    assert max(loads) - min(loads) <= 128 * 32  # at most the largest whole tensor apart


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharding") / "measured.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}", __file__, str(out)]
    result = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("recipe", ["muon", "adamw"])
def test_sharded_steps_equal_one_process_and_ddp(measured, recipe):
    """3 steps of 2 micro-batches on each of 4 ranks, clipped, with weight decay: the parameters of every
    rank equal those of one process that accumulates all 8 micro-batches, and those of DDP (in float64 to
    1e-12; in fp32 as closely as DDP does)."""
    m, exact = measured[recipe], measured[recipe]["float64"]
    assert max(exact["sharded_vs_one_process"]) < 1e-12 and max(exact["ddp_vs_one_process"]) < 1e-12
    # in fp32 as close to one process as DDP is (AdamW's first steps amplify rounding: see run_rank)
    assert max(m["sharded_vs_one_process"]) <= max(2e-5, 2 * max(m["ddp_vs_one_process"]))
    assert max(m["ranks_apart"]) == 0.0 == max(exact["ranks_apart"])  # every rank holds the same parameters
    assert m["clipped"]  # the clip was active, so the global norm was right on every rank
    norms = m["grad_norms"]
    assert norms["sharded"] == pytest.approx(norms["one_process"], rel=1e-5)


@pytest.mark.parametrize("recipe", ["muon", "adamw"])
def test_checkpoints_move_between_one_process_and_sharded_ranks(measured, recipe):
    """After 3 steps, one process's checkpoint file resumed on 4 sharded ranks (each taking its rows of every
    table), and the 4 ranks' sharded folder resumed in one process, take the 4th step as the one process
    does (float64, to 1e-12): weights and optimizer state both came back."""
    exact = measured[recipe]["float64"]
    assert exact["file_resumed_sharded"] < 1e-12 and exact["folder_resumed_in_one_process"] < 1e-12
    assert exact["consolidated_vs_one_process"] < 1e-12  # the state rank 0 gathers when a sharded save failed


def test_each_matrix_is_orthogonalised_by_exactly_one_rank(measured):
    m = measured["muon"]
    assert sum(m["orthogonalised_per_rank"]) == m["matrices"] * m["steps"]
    assert all(n > 0 for n in m["orthogonalised_per_rank"])  # the work is shared out
    assert m["orthogonalised_one_process"] == m["matrices"] * m["steps"]


@pytest.mark.parametrize("recipe", ["muon", "adamw"])
def test_per_rank_state_is_about_a_quarter_and_is_what_the_plan_says(measured, recipe):
    m = measured[recipe]
    assert max(m["state_bytes_per_rank"]) <= m["state_bytes_one_process"] / 3
    assert sum(m["state_bytes_per_rank"]) == pytest.approx(m["state_bytes_one_process"], rel=0.01)  # + step counts
    assert max(m["state_bytes_per_rank"]) == m["plan"]["optimizer state (largest of 4 shares)"]
    assert m["exchange_bytes"] == m["plan"]["gradient exchange buffer"]
    assert m["state_bytes_one_process"] == m["plan_one_process"]["optimizer state"]


def test_a_sharded_step_sees_no_changed_python_number(measured):
    """As test_optimizer's rule: two steps at other learning rates, momenta and weight decays dispatch the
    same ops with the same constants, collectives included."""
    assert measured["muon"]["same_dispatch"] and measured["muon"]["collectives_dispatched"] >= 3


# ---- the ranks' side ----------------------------------------------------------------------------------------

class NoPosition:
    """A corpus with no data position to restore (the checkpoints here are of models alone)."""

    def load_state_dict(self, state):
        assert state is None


def run_rank(out_path):
    sys.path.insert(0, ROOT)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import train
    from kit import checkpoint, checkpoint_io, memory, optim, runtime
    from model import GPT, GPTConfig
    from test_optimizer import OpRecorder

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = {"who": None, "one process": 0, "sharded": 0}  # matrices orthogonalised, by whose step
    orthogonalize = optim.orthogonalize

    def counting(g, dtype):
        if counts["who"]:
            counts[counts["who"]] += g.shape[0]
        return orthogonalize(g, dtype)

    optim.orthogonalize = counting
    def measure(recipe, dtype):
        cfg = train.TrainConfig(matrix_optimizer=recipe, weight_decay=0.1, grad_clip=0.05, warmup_steps=2,
                                muon_momentum_warmup_steps=3, max_steps=6, compile=False, dtype="float32")
        model_cfg = GPTConfig(sequence_len=16, vocab_size=70, n_layer=2, n_embd=32, n_head=2, n_kv_head=1)
        torch.manual_seed(0)
        one = GPT(model_cfg).to(dtype)
        sharded, replica = copy.deepcopy(one), copy.deepcopy(one)
        one_opts = optim.make_optimizers(one, cfg, "cpu", dtype)
        sharding = optim.Sharding(sharded, cfg, rank, world)
        opts = optim.make_optimizers(sharded, cfg, "cpu", dtype, share=sharding.share)
        ddp = DDP(replica)
        ddp_opts = optim.make_optimizers(replica, cfg, "cpu", dtype)
        data = torch.Generator().manual_seed(1)
        m = {"grad_norms": {}, "steps": 3, "clipped": False}
        counts["one process"] = counts["sharded"] = 0
        records = []
        for step in range(m["steps"]):
            values = train.schedule(cfg, step, step / cfg.max_steps)
            batches = [(torch.randint(0, 70, (2, 16), generator=data), torch.randint(0, 70, (2, 16), generator=data))
                       for _ in range(2 * world)]  # the same on every rank
            mine = batches[2 * rank: 2 * rank + 2]
            for opt_list, model in ((one_opts, one), (ddp_opts, replica)):
                train.apply_schedule(opt_list, values, model)
            counts["who"] = "one process"
            _, one_norm = train.train_step(one, one, one_opts, batches, "cpu", train.nullcontext(), cfg.grad_clip)
            counts["who"] = None
            train.train_step(ddp, replica, ddp_opts, mine, "cpu", train.nullcontext(), cfg.grad_clip)
            counts["who"] = "sharded"
            recording = recipe == "muon" and dtype == torch.float32  # the dispatch record: one run is enough
            with OpRecorder() if recording else contextlib.nullcontext() as recorder:
                train.apply_schedule(opts, values, sharded)
                _, norm = train.train_step(sharded, sharded, opts, mine, "cpu", train.nullcontext(), cfg.grad_clip, sharding)
            counts["who"] = None
            records.append(recorder.ops if recording else [])
            m["clipped"] |= one_norm.item() > cfg.grad_clip
            m["grad_norms"] = {"one_process": one_norm.item(), "sharded": norm.item()}
        m["orthogonalised_one_process"] = counts["one process"]

        def apart(a, b):
            return [((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a.parameters(), b.parameters())]

        m["sharded_vs_one_process"], m["ddp_vs_one_process"] = max(apart(sharded, one)), max(apart(replica, one))
        flat = torch.cat([p.detach().flatten() for p in sharded.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        m["ranks_apart"] = max((g - flat).abs().max().item() for g in gathered)
        state = sum(t.nbytes for s in optim.param_states(opts).values() for t in s.values())
        m["state_bytes_one_process"] = sum(t.nbytes for s in optim.param_states(one_opts).values() for t in s.values())
        m["exchange_bytes"] = sharding.flat.nbytes + sharding.received.nbytes
        m["matrices"] = len(optim.split_parameters(one)[2])
        m["plan"] = memory.memory_plan(cfg, model_cfg, world)
        m["plan_one_process"] = memory.memory_plan(cfg, model_cfg, 1)
        everyone = [None] * world
        dist.all_gather_object(everyone, {"state": state, "orthogonalised": counts["sharded"],
                                          "apart": m["sharded_vs_one_process"]})
        m["state_bytes_per_rank"] = [e["state"] for e in everyone]
        m["orthogonalised_per_rank"] = [e["orthogonalised"] for e in everyone]
        m["sharded_vs_one_process"] = [e["apart"] for e in everyone]
        m["ddp_vs_one_process"] = [m["ddp_vs_one_process"]]
        m["ranks_apart"] = [m["ranks_apart"]]
        # a collective's process group and op come as new wrapper objects each call: their addresses differ
        steps = [re.sub(r" object at 0x[0-9a-f]+", " object", repr(r)) for r in records[1:]]
        m["same_dispatch"] = steps[0] == steps[1]
        m["collectives_dispatched"] = sum("c10d" in op for op, _ in records[2])

        if dtype != torch.float64:
            return m
        # checkpoints after the 3 steps: one process's file read by the 4 sharded ranks, and the sharded ranks'
        # folder read by one process (each rank here); then one more step of each against the one process's
        saved = os.path.join(os.path.dirname(out_path), f"{recipe}-{dtype}".replace("torch.", ""))
        if rank == 0:
            checkpoint.save_checkpoint(saved + ".pt", one, one_opts, 3, 0.0, None, cfg, model_cfg)
        checkpoint.save_sharded_checkpoint(saved + ".dcp", sharded, opts, sharding, dist.group.WORLD,
                                         checkpoint.run_state(3, 0.0, None, cfg, model_cfg))
        # the fallback after a failed sharded save: every rank's pieces gathered on rank 0, as one process holds them
        consolidated = checkpoint.consolidated_optimizer_state(sharded, opts, sharding, dist.group.WORLD)
        m["consolidated_vs_one_process"] = None  # measured on rank 0, which writes the results
        if rank == 0:
            whole = checkpoint.optimizer_state(one, one_opts)
            assert consolidated.keys() == whole.keys()
            m["consolidated_vs_one_process"] = max(((consolidated[n][k] - v).abs().max() / v.abs().max().clamp(min=1e-30)).item()
                                                   for n in whole for k, v in whole[n].items())
        ranks = runtime.Ranks(rank, world, "cpu", "cpu", dist.group.WORLD)
        from_file, from_folder = GPT(model_cfg).to(dtype), GPT(model_cfg).to(dtype)
        file_sharding = optim.Sharding(from_file, cfg, rank, world)
        file_opts = optim.make_optimizers(from_file, cfg, "cpu", dtype, share=file_sharding.share)
        folder_opts = optim.make_optimizers(from_folder, cfg, "cpu", dtype)
        checkpoint.restore(checkpoint_io.load_checkpoint(saved + ".pt"), from_file, file_opts, file_sharding, NoPosition(), ranks)
        checkpoint.restore(checkpoint_io.load_checkpoint(saved + ".dcp"), from_folder, folder_opts, None, NoPosition(), ranks)
        values = train.schedule(cfg, m["steps"], m["steps"] / cfg.max_steps)
        batches = [(torch.randint(0, 70, (2, 16), generator=data), torch.randint(0, 70, (2, 16), generator=data))
                   for _ in range(2 * world)]
        for opt_list, model, micro_batches, share in ((one_opts, one, batches, None), (folder_opts, from_folder, batches, None),
                                                      (file_opts, from_file, batches[2 * rank: 2 * rank + 2], file_sharding)):
            train.apply_schedule(opt_list, values, model)
            train.train_step(model, model, opt_list, micro_batches, "cpu", train.nullcontext(), cfg.grad_clip, share)
        m["file_resumed_sharded"], m["folder_resumed_in_one_process"] = max(apart(from_file, one)), max(apart(from_folder, one))
        return m

    results = {}
    for recipe in ("muon", "adamw"):
        results[recipe] = measure(recipe, torch.float32)
        # AdamW's first steps are nearly sign(gradient) (eps 1e-10): fp32 rounding of a near-zero gradient
        # entry, which differs with the order of the sums, moves its weight by a whole step either way
        exact = measure(recipe, torch.float64)
        results[recipe]["float64"] = {k: exact[k] for k in ("sharded_vs_one_process", "ddp_vs_one_process", "ranks_apart",
                                                             "file_resumed_sharded", "folder_resumed_in_one_process",
                                                             "consolidated_vs_one_process")}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_rank(sys.argv[1])

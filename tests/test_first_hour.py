"""kit/first_hour.py (`bench.py --first_hour`): the step runner, the plan, the paid run's launch and its
per-op kernels from fabricated rows and run folders (the whole session was run by hand: docs/results.md)."""
import collections
import json
import os
import sys

import pytest
import torch

import kernels
import train
from kit import build, first_hour, runtime


@pytest.mark.parametrize("version, front_end", [("0.4.0b4+2581.ge7", "parser"), ("0.6.0", "parser"),
                                                ("0.7.1", "tracer"), ("1.0", "tracer"), ("", "unknown")])
def test_first_hour_names_the_nki_front_end(version, front_end):
    assert first_hour.nki_front_end(version).startswith(front_end)


def test_steps_run_in_children_with_their_own_timeouts_and_end_in_one_table(capsys):
    """The step runner on three cheap children (one passes, one fails, one hangs past its timeout and is
    killed) and the table."""
    rows = [first_hour.run_step("passes", [sys.executable, "-c", "print('all right')"], 60),
            first_hour.run_step("fails", [sys.executable, "-c", "import sys; print('broken'); sys.exit(3)"], 60),
            first_hour.run_step("hangs", [sys.executable, "-c", "import time; print('waiting', flush=True); "
                                                                "time.sleep(60)"], 2)]
    assert [(r["passed"], r["timed_out"]) for r in rows] == [(True, False), (False, False), (False, True)]
    assert rows[0]["detail"] == "all right" and rows[1]["detail"] == "exit code 3: broken"
    assert rows[2]["detail"].startswith("TIMED OUT after 2 s; last line: waiting") and rows[2]["seconds"] < 30
    capsys.readouterr()
    assert first_hour.print_table(rows, "COMMAND", ["mlp: why"], 1.0) == 1
    table = capsys.readouterr().out
    assert "1 of 3 steps passed" in table and "exit code 1" in table and "first paid run: COMMAND" in table
    assert "on PyTorch: mlp: why" in table


def _train_args(command):
    """The train.py flags of a plan step's command."""
    return command[next(i for i, a in enumerate(command) if a.endswith("train.py")) + 1:]


def test_the_plan_runs_every_kernel_op_alone_and_on_a_device_the_paid_runs_ranks(tmp_path):
    plan = first_hour.plan(["--preset=baseline"], False, str(tmp_path), 1, 8)
    names = [name for name, _, _ in plan]
    assert names[:len(kernels.KERNEL_OPS) + 3] == (["versions"] + [f"kernels: {op}" for op in kernels.KERNEL_OPS]
                                                   + ["bench.py --check", "bench.py --kernels (each kernel's gain)"])
    assert any("--kernels=torch" in n for n in names) and any("--kernels=nki" in n for n in names)
    assert any("2 ranks" in n for n in names) and any("resume" in n for n in names) and "load_for_eval" in names[-1]
    assert all(set(first_hour.FIRST_HOUR_TINY) <= set(command) for name, command, _ in plan
               if name != "bench.py --check")
    check = dict((name, command) for name, command, _ in plan)["bench.py --check"]
    assert f"--json={first_hour.check_json(str(tmp_path))}" in check  # the per-op results the flags are drawn from
    gains = dict((name, command) for name, command, _ in first_hour.plan(["--kernels=nki"], False, str(tmp_path), 1, 8))
    gains = gains["bench.py --kernels (each kernel's gain)"]  # measures, rather than taking the model's --kernels=nki
    assert gains[2] == "--kernels" and not any(a.startswith("--kernels=") for a in gains)
    assert gains[-1] == f"--json={first_hour.gains_json(str(tmp_path))}"
    on_trainium = first_hour.plan(["--preset=baseline"], True, str(tmp_path), 1, 8)
    assert not any(set(first_hour.FIRST_HOUR_TINY) & set(command) for _, command, _ in on_trainium)
    training = [command for name, command, _ in on_trainium if "compiled steps" in name or "sharded" in name]
    assert len(training) == 3 and all("--nproc_per_node=8" in command for command in training)
    assert any("--kernels=auto" in name for name, _, _ in on_trainium)


def test_the_cpu_rehearsal_trains_one_or_two_micro_steps_a_step_whatever_the_preset(tmp_path):
    """A preset's 65,536 tokens a step at the rehearsal's 2 x 128 would be 256 emulated micro-steps a step
    (20 steps timed out at 400 s on a 2-core EPYC); the rehearsal's own batch keeps a step small."""
    for preset in ("baseline", "frontier", "phase2"):
        for name, command, timeout in first_hour.plan([f"--preset={preset}"], False, str(tmp_path), 1, 8):
            if "train.py" in " ".join(command) and name.startswith(str(first_hour.FIRST_HOUR_STEPS)):
                cfg, model_cfg = train.parse_args(_train_args(command))
                tokens_per_micro_step = cfg.batch_size * model_cfg.sequence_len
                assert cfg.total_batch_tokens // tokens_per_micro_step <= 2, (preset, name)
                assert model_cfg.n_layer == 2 and model_cfg.sequence_len == 128


def test_the_paid_run_has_the_contests_lnc_and_fills_the_chip(monkeypatch):
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    assert first_hour.paid_launch() == (1, 8)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    assert first_hour.paid_launch() == (2, 4)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "4")
    with pytest.raises(ValueError, match="NEURON_LOGICAL_NC_CONFIG=4: a Trn2 rank drives 1 or 2"):
        first_hour.paid_launch()


def _rows(failed=(), timed_out=(), on_kernels_passed=True):
    """Fabricated step rows: every kernel op's step and the training steps, some failed or timed out."""
    rows = [{"step": f"kernels: {op}", "passed": op not in failed and op not in timed_out, "timed_out": op in timed_out,
             "detail": "TIMED OUT" if op in timed_out else "front end ok / backend FAILED"}
            for op in kernels.KERNEL_OPS]
    rows.append({"step": "20 compiled steps, --kernels=torch", "passed": True, "timed_out": False, "detail": ""})
    rows.append({"step": "20 compiled steps, --kernels=auto", "passed": on_kernels_passed, "timed_out": False,
                 "detail": "exit code 1"})
    return rows


def _check_rows(failed=()):
    return [{"check": f"{op} bf16 forward+backward (shapes)", "op": op, "passed": op not in failed,
             "error": "AssertionError: max |nki - torch|"} for op in kernels.KERNEL_OPS] + \
           [{"check": "causality of the model on nki", "op": None, "passed": True, "error": ""}]


def test_the_paid_run_keeps_every_kernel_that_passed_and_turns_off_each_that_failed():
    setting, reasons = first_hour.paid_run_kernels(_rows(), _check_rows(), on_trainium=True)
    assert (setting, reasons) == ("auto", [])
    setting, reasons = first_hour.paid_run_kernels(_rows(failed=["mlp"]), _check_rows(["rope_norm"]), True)
    assert setting == "auto,mlp:torch,rope_norm:torch"
    assert reasons[0].startswith("mlp: step 'kernels: mlp' failed") and reasons[1].startswith("rope_norm: --check")
    assert kernels.parse_kernels(setting)["attention"] == "auto"  # a setting train.py takes
    every = first_hour.paid_run_kernels(_rows(failed=kernels.KERNEL_OPS), _check_rows(), True)[0]
    assert every == "torch"
    # the training steps on the kernels failed though each op passed alone: PyTorch, saying why
    setting, reasons = first_hour.paid_run_kernels(_rows(on_kernels_passed=False), _check_rows(), True)
    assert setting == "torch" and "training steps on the kernels failed" in reasons[-1]


def test_a_rehearsal_timeout_never_turns_a_kernel_off_for_the_device():
    rows = _rows(timed_out=["attention"])
    rows[-1].update(passed=False, timed_out=True)  # the emulated training steps ran out of time too
    assert first_hour.paid_run_kernels(rows, _check_rows(), on_trainium=False)[0] == "auto"
    assert first_hour.paid_run_kernels(rows, _check_rows(), on_trainium=True)[0] == "auto,attention:torch"
    # a real failure in the rehearsal still counts: the emulator refused the kernel
    assert first_hour.paid_run_kernels(_rows(failed=["softcap_cross_entropy"]), None, False)[0] == \
        "auto,softcap_cross_entropy:torch"


def test_the_paid_run_command_is_the_contests_launch_with_the_users_flags():
    command, reasons = first_hour.paid_run_command(_rows(failed=["attention"]), _check_rows(),
                                                   ["--preset=baseline", "--kernels=nki"], True, 1, 8)
    assert command == ("NEURON_LOGICAL_NC_CONFIG=1 torchrun --standalone --nproc_per_node=8 train.py --preset=baseline "
                       "--kernels=auto,attention:torch")
    off_device, _ = first_hour.paid_run_command(_rows(), None, ["--preset=baseline"], False, 2, 4)
    assert off_device.startswith("(on a Trn2) NEURON_LOGICAL_NC_CONFIG=2 torchrun --standalone --nproc_per_node=4 ")


def fallback_run(run_dir, op, monkeypatch):
    """A run folder whose log says what train.py's says when `op`'s kernel fails to build in its first step
    (which then passes on PyTorch), ending in a line cut off by a kill."""
    monkeypatch.setattr(kernels, "BUILD_FAILURES", {})
    os.makedirs(run_dir)
    log = runtime.Logger(run_dir, enabled=True, append=False)
    log("config", "config line", kernels={op: {"ran": "nki", "why": "kernels=auto"}})
    tries = []

    def first_step(model):
        tries.append(model)
        if len(tries) == 1:
            raise kernels.KernelBuildError(op, ValueError("no such instruction"))

    trainee = collections.namedtuple("Trainee", "model raw_model sharding rebuild")(
        "compiled", torch.nn.Linear(1, 1), None, lambda: "rebuilt")
    build.surviving_build_failures(first_step, trainee, log, train.ChargedClock(0, 1, 900.0))
    with open(os.path.join(run_dir, "log.jsonl"), "a") as f:
        f.write('{"event": "train", "lo')


def test_an_op_whose_kernel_failed_to_build_in_a_training_step_goes_to_pytorch(tmp_path, monkeypatch):
    """The training step on the kernels passed, on PyTorch for an op whose kernel failed to build: only the
    run's log tells, and the paid run must not build it again."""
    fallback_run(str(tmp_path / "steps_auto"), "attention", monkeypatch)
    for folder in ("steps_torch", "data"):
        os.makedirs(tmp_path / folder)
    runtime.Logger(str(tmp_path / "steps_torch"), enabled=True, append=False)("config", "config line")
    failures = first_hour.build_failures(str(tmp_path))
    why = "NKI kernel failed to build: ValueError: no such instruction"
    assert failures == {"attention": f"training run 'steps_auto' went on on PyTorch: {why}"}
    for on_trainium in (True, False):  # the emulator refused the kernel: that counts in a rehearsal too
        setting, reasons = first_hour.paid_run_kernels(_rows(), _check_rows(), on_trainium, failures)
        assert (setting, reasons) == ("auto,attention:torch", [f"attention: {failures['attention']}"])
    assert first_hour.build_failures(str(tmp_path / "data")) == {}


def test_the_ops_a_compiled_graph_that_failed_to_build_sent_to_pytorch_stay_there(tmp_path):
    os.makedirs(tmp_path / "steps_auto")
    log = runtime.Logger(str(tmp_path / "steps_auto"), enabled=True, append=False)
    log("graph_fallback", "warning line", ops=["attention", "mlp"], why="the compiled graph failed to build: E")
    failures = first_hour.build_failures(str(tmp_path))
    assert failures == dict.fromkeys(["attention", "mlp"], "training run 'steps_auto' went on on PyTorch: the "
                                                           "compiled graph failed to build: E")
    assert first_hour.paid_run_kernels(_rows(), _check_rows(), True, failures)[0] == "auto,attention:torch,mlp:torch"


def test_the_session_reads_the_training_runs_logs_before_it_removes_them(tmp_path, monkeypatch):
    """run_first_hour's wiring: a step (standing in for the training steps) leaves a fallback in its run's
    log, and the paid run's launch string turns that op off."""
    fallback = json.dumps({"event": "kernel_fallback", "op": "mlp", "why": "NKI kernel failed to build: E"})
    writes_log = ("import os, sys; os.makedirs(sys.argv[1]); "
                  "open(os.path.join(sys.argv[1], 'log.jsonl'), 'w').write(sys.argv[2] + chr(10))")
    monkeypatch.setattr(first_hour, "plan", lambda passthrough, on_trainium, work, lnc, ranks: [
        ("20 compiled steps, --kernels=auto", [sys.executable, "-c", writes_log,
                                               os.path.join(work, "steps_auto"), fallback], 60)])
    rows, command, reasons, _, startups = first_hour.run_first_hour(["--preset=baseline"], 1800.0, 900.0, out_dir=str(tmp_path))
    assert rows[0]["passed"] and command.endswith("--preset=baseline --kernels=auto,mlp:torch")
    assert "mlp: training run 'steps_auto' went on on PyTorch: NKI kernel failed to build: E" in reasons
    assert os.listdir(tmp_path) == [] and startups == []  # the session's folder is gone; no run got past its start-up


def test_a_fused_kernel_runs_alone(capsys):
    from model import GPTConfig

    assert first_hour.kernel_alone(GPTConfig(), 1, "cpu", "cpu", "add_rms_norm")
    assert capsys.readouterr().out.strip() == ("add_rms_norm_fwd_kernel: front end ok / backend ok; "
                                               "add_rms_norm_bwd_kernel: front end ok / backend ok")
    with pytest.raises(ValueError, match="kernel:norm: not a kernel op; the ops are attention, mlp"):
        first_hour.kernel_alone(GPTConfig(), 1, "cpu", "cpu", "norm")


def test_each_kernels_gain_is_its_saving_per_call_times_its_calls_measured_or_estimated():
    device = [{"op": "mlp", "direction": "fwd+bwd", "calls": 4, "nki_s": 0.001, "torch_s": 0.003},
              {"op": "mlp", "direction": "forward", "calls": 4, "nki_s": 0.0, "torch_s": 1.0},  # training runs both
              {"op": "attention", "direction": "fwd+bwd", "calls": 4, "nki_unavailable": "head_dim 512", "torch_s": 1.0}]
    assert first_hour.kernel_gains(device) == {"mlp": pytest.approx(0.008)}
    estimated = [{"op": "attention", "direction": "fwd+bwd", "calls": 2, "estimate_s": 0.002, "compiled": {"estimate_s": 0.001}},
                 {"op": "attention", "direction": "fwd+bwd", "calls": 2, "estimate_s": 0.001, "compiled": {"estimate_s": 0.004}}]
    assert first_hour.kernel_gains(estimated) == {"attention": pytest.approx(0.002)}  # its two cases averaged
    assert first_hour.kernel_gains(None) == {}


def compiled_run(work, name, startup_s, tokens_per_s=65536.0):
    """A compiled training run's folder: its config event, a start-up step, a timed step, a torn last line."""
    os.makedirs(os.path.join(work, name))
    log = runtime.Logger(os.path.join(work, name), enabled=True, append=False)
    log("config", "config line", train_config={"batch_size": 8, "total_batch_tokens": 65536},
        model_config={"sequence_len": 1024}, world_size=8)
    log("train", "step 1", step=1, startup_time=0.0, tokens_per_s=0.0)  # the clock not started yet
    log("train", "step 20", step=20, startup_time=startup_s, tokens_per_s=tokens_per_s)
    with open(os.path.join(work, name, "log.jsonl"), "a") as f:
        f.write('{"event": "done", "startup_ti')


def test_each_compiled_runs_cold_start_up_is_reported_against_the_cap(tmp_path):
    compiled_run(str(tmp_path), "steps_torch", 497.0)
    compiled_run(str(tmp_path), "steps_auto", 951.0)
    runs = first_hour.compiled_runs(str(tmp_path))
    assert runs["steps_auto"] == {"startup_s": 951.0, "tokens_per_s": 65536.0, "micro_steps": 1, "step_tokens": 65536}
    assert first_hour.startup_report(runs, 900.0) == [
        "cold start-up of steps_auto: 951 s of the 900 s cap, 51 s past it (charged to the run)",
        "cold start-up of steps_torch: 497 s of the 900 s cap, 403 s to spare"]


def _startup_rows():
    """Each kernel op's step alone and the bare versions step: each op's kernels add what their step took beyond it."""
    seconds = {"versions": 20.0, "kernels: attention": 100.0, "kernels: mlp": 80.0, "kernels: rms_norm": 50.0}
    return [{"step": step, "passed": True, "timed_out": False, "seconds": s, "detail": ""} for step, s in seconds.items()]


def test_a_kernel_whose_start_up_past_the_cap_outweighs_its_gain_over_the_budget_goes_to_pytorch():
    """The run on the kernels starts up 100 s past the cap; a step of the PyTorch run takes 1 s. The ops with
    least gain per second of start-up go first: mlp (60 s of start-up, all past the cap, for 6 s of training
    gained), then rms_norm (30 s for 6 s); attention's 500 s gained outweigh the 10 s still past the cap."""
    runs = {"steps_torch": {"startup_s": 497.0, "tokens_per_s": 65536.0, "micro_steps": 1, "step_tokens": 65536},
            "steps_auto": {"startup_s": 1000.0, "tokens_per_s": 90000.0, "micro_steps": 1, "step_tokens": 65536}}
    gains = {"attention": 0.5, "mlp": 0.006, "rms_norm": 0.006}  # seconds a micro-step, over a 1000 s budget
    off = first_hour.startup_costs(_startup_rows(), runs, gains, 1000.0, 900.0)
    assert list(off) == ["mlp", "rms_norm"]
    assert off["mlp"] == ("its kernels add about 60 s of start-up, 60 s of it past the 900 s start-up cap "
                          "(charged to the run), for about 6 s of training gained over the 1000 s budget")
    assert off["rms_norm"].startswith("its kernels add about 30 s of start-up, 30 s of it past")
    setting, reasons = first_hour.paid_run_kernels(_rows(), _check_rows(), True, off)
    assert setting == "auto,mlp:torch,rms_norm:torch" and reasons == [f"{op}: {why}" for op, why in off.items()]
    runs["steps_auto"]["startup_s"] = 839.0  # inside the cap: its start-up costs the run nothing
    assert first_hour.startup_costs(_startup_rows(), runs, gains, 1000.0, 900.0) == {}
    runs["steps_auto"]["startup_s"] = 1000.0
    assert first_hour.startup_costs(_startup_rows(), runs, gains, 100_000.0, 900.0) == {}  # a long budget pays for them

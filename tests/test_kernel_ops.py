"""Rules every NKI kernel in kernels.py keeps, whatever op it belongs to: the on-chip memory plans fit the
target's usable SBUF, PSUM tiles fit the banks, the kernels get dense inputs, and no instruction uses an
operator the hardware lacks."""
import ast
import contextlib
import dataclasses
import importlib
import inspect
import math
import pathlib
from unittest import mock

import pytest
import torch

import kernels
import nki_emulator
from nki_emulator import _memory, _runtime

pytestmark = pytest.mark.skipif(kernels.nki is not nki_emulator, reason="measures what the emulator runs")

PSUM_BANKS, PSUM_BANK_BYTES = 8, 2048  # per partition (the NKI architecture guide's PSUM section)


@contextlib.contextmanager
def on_chip_peaks():
    """{"sbuf": peak live bytes per partition, "psum": peak live PSUM banks} over the kernels run in the
    block, tiles counted from first to last use as the emulator counts capacity; a PSUM tile takes whole
    banks, as the compiler allocates them."""
    peaks = {"sbuf": 0, "psum": 0}
    check_capacity = nki_emulator.check_capacity

    def measure(core):
        for buffer, key, size in ((_memory.SBUF, "sbuf", lambda t: t.nbytes),
                                  (_memory.PSUM, "psum", lambda t: math.ceil(t.nbytes / PSUM_BANK_BYTES))):
            tiles = [t for t in core.tiles if t.buffer is buffer and t.first >= 0]
            live = 0
            for _, change in sorted([(t.first, size(t)) for t in tiles] + [(t.last + 1, -size(t)) for t in tiles]):
                live += change
                peaks[key] = max(peaks[key], live)
        return check_capacity(core)

    with mock.patch.object(nki_emulator, "check_capacity", measure):
        yield peaks


def limit_sbuf(monkeypatch, limit):
    """The emulator's SBUF per partition cut to `limit` bytes (every SBUF figure of its target)."""
    target = _runtime.target()
    cut = {field.name: limit for field in dataclasses.fields(target) if field.name.startswith("sbuf_")}
    monkeypatch.setattr(_runtime, "_target", dataclasses.replace(target, **cut))


def random(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()


def test_attention_backward_packs_its_psum_accumulators_into_the_banks():
    """At d = 256 and a full 512-key block, dK and dV take 4 (128, 256) fp32 chunks each: as separate
    tiles, 8 banks on their own, 9 with the scores live."""
    q, k, v = random(1, 1, 512, 256), random(1, 1, 512, 256), random(1, 1, 512, 256)
    with on_chip_peaks() as peaks:
        kernels.attention(q, k, v, mode="nki").float().sum().backward()
    assert peaks["psum"] <= PSUM_BANKS, peaks


@pytest.mark.parametrize("activation", ["relu2", "swiglu"])
def test_mlp_sbuf_plan_bounds_what_the_kernels_keep_live(monkeypatch, activation):
    """With SBUF_BUDGET cut so that the hidden units go in several chunks, and the emulator's SBUF cut to
    that budget, the kernels run: what _mlp_chunk_tiles' plan counts is what they hold."""
    dim, hidden, budget = 256, 1024, 40 * 1024
    monkeypatch.setattr(kernels, "SBUF_BUDGET", budget)
    assert kernels._mlp_chunk_tiles(dim, hidden, activation == "swiglu", 2, backward=True) < hidden // 128
    x, w_up, w_down = random(200, dim), random(hidden, dim), random(dim, hidden)
    w_gate = random(hidden, dim) if activation == "swiglu" else None
    limit_sbuf(monkeypatch, budget)
    with on_chip_peaks() as peaks:
        kernels.mlp(x, w_up, w_down, activation, w_gate, mode="nki").float().sum().backward()
    limit_sbuf(monkeypatch, peaks["sbuf"] - 1)  # the twin: one byte less than the kernels held, refused
    with pytest.raises(nki_emulator.NkiValidationError, match="SBUF"):
        kernels.mlp(x, w_up, w_down, activation, w_gate, mode="nki").float().sum().backward()


def test_attention_sbuf_plan_bounds_what_the_kernels_keep_live(monkeypatch):
    seq_len, head_dim = 512, 128
    q, k, v = random(1, 2, seq_len, head_dim), random(1, 1, seq_len, head_dim), random(1, 1, seq_len, head_dim)
    with on_chip_peaks() as peaks:
        kernels.attention(q, k, v, mode="nki").float().sum().backward()
    limit_sbuf(monkeypatch, peaks["sbuf"] - 1)  # one byte less than the kernels held: the emulator refuses them,
    with pytest.raises(nki_emulator.NkiValidationError, match="SBUF"):
        kernels.attention(q, k, v, mode="nki").float().sum().backward()
    monkeypatch.setattr(kernels, "SBUF_BUDGET", peaks["sbuf"] - 1)  # and the shape rule's plan, held to it, too
    assert "SBUF plan" in kernels._attention_shape_problem(q, k, v)


def test_the_sbuf_budget_is_within_the_usable_sbuf_of_a_trn2():
    assert kernels.SBUF_BUDGET <= kernels.SBUF_USABLE_BYTES["trn2"]
    longest = torch.empty(1, 1, 4096, 128, dtype=torch.bfloat16, device="meta")  # the longest S it promises
    assert kernels._attention_shape_problem(longest, longest, longest) is None


def test_kernels_get_dense_inputs(monkeypatch):
    """The model hands attention v as a transposed view of c_v's output, and the gradient of attention's
    output arrives as a transposed view of c_proj's input gradient; a kernel reads its HBM arguments as
    dense arrays, so every tensor must reach it contiguous."""
    simulate = nki_emulator.simulate

    def dense_only(kernel):
        def launch(*args):
            for position, arg in enumerate(args):
                assert not isinstance(arg, torch.Tensor) or arg.is_contiguous(), \
                    f"{kernel}: argument {position} {tuple(arg.shape)} is not contiguous"
            return simulate(kernel)(*args)
        return launch

    monkeypatch.setattr(nki_emulator, "simulate", dense_only)
    B, T, H, D = 1, 128, 2, 64
    q, k = random(B, H, T, D), random(B, H, T, D)
    v_rows = random(B, T, H, D)
    out = kernels.attention(q, k, v_rows.transpose(1, 2), mode="nki")
    out.transpose(1, 2).reshape(B, T, H * D).float().square().sum().backward()  # as model.py reads it
    assert v_rows.grad is not None


def test_no_operator_the_hardware_lacks():
    """Division and remainders are not in the ISA's operator table (aws-neuron-sdk nki/api/nki.api.shared.rst,
    "Supported Math Operators for NKI ISA"); the release notes' known issues: they work in simulation and fail
    on hardware."""
    tree = ast.parse(pathlib.Path(kernels.__file__).read_text())
    used = [node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "nl" and node.attr in ("divide", "mod", "fmod")]
    assert used == []


# ---- the declarations: every op is declared whole, and the lists come from them ----------------------------

ROOT = pathlib.Path(kernels.__file__).parent


def declaration_problems(op):
    """What op's declaration (kernels.KernelOp) lacks, each naming the part and where it goes; docs/kernels.md,
    "Adding a kernel op", lists the parts."""
    problems = []
    if getattr(kernels, op.name, None) is not op.call or "mode" not in inspect.signature(op.call).parameters:
        problems.append(f"call: kernels.{op.name}(..., mode=...) is the op model.py calls, declared as call=")
    if not op.kernels:
        problems.append("kernels: the NKI kernel functions, forward first")
    for kernel in op.kernels:
        doc = kernel.__doc__ or ""
        if "SBUF" not in doc or "PSUM" not in doc:
            problems.append(f"kernels: {kernel.__name__}'s docstring states no SBUF and PSUM plan")
    for part in ("torch_path", "shape_problem", "check_cases", "model_cases", "plain_ops"):
        if not callable(getattr(op, part)):
            problems.append(f"{part}: not a function")
    if op.cost_problem is not None and not callable(op.cost_problem):
        problems.append("cost_problem: a function (config, tokens), or None where the kernels run wherever they "
                        "take the shapes")
    if op.name not in kernels.KERNEL_OPS or kernels.parse_kernels(f"{op.name}:nki")[op.name] != "nki":
        problems.append("name: not in KERNEL_OPS (declare it with _declare)")
    cases = op.check_cases(kernels.CheckShapes(), torch.float32, "cpu", torch.Generator())
    names = [case.name for case in cases]
    if not cases or not all(isinstance(case, kernels.CheckCase) and case.op == op.name for case in cases) \
            or len(set(names)) != len(names):
        problems.append(f"check_cases: no CheckCase(op={op.name!r}, ...), or two with one name: {names}")
    from model import GPTConfig

    config = GPTConfig(sequence_len=128, n_layer=1, n_embd=128, n_head=2, n_kv_head=1, vocab_size=257)
    model_cases = op.model_cases(config, 1, "cpu", torch.float32)
    if not model_cases or not all(case[0].startswith(op.name) and len(case) == 5 for case in model_cases):
        problems.append("model_cases: no (name, FLOPs forward, FLOPs forward + backward, make_inputs, call) at a "
                        "model's shapes, or a name that does not start with the op's")
    if callable(op.plain_ops):
        from kit import compiled_cost

        plain = op.plain_ops(config, 1, None, compiled_cost.PLAIN)
        if set(plain) != {"forward", "backward"} or not all(compiled_cost.compiled_estimate(ops)["estimate_s"] > 0
                                                            for ops in plain.values()):
            problems.append("plain_ops: no {\"forward\": ops, \"backward\": ops} that kit/compiled_cost.py prices "
                            "above 0")
    if not op.kill_matrix or not set(op.kill_matrix) <= set(names):
        problems.append(f"kill_matrix: names none of its check cases {names}, or one that is not among them")
    test_file = ROOT / "tests" / op.tests
    if not test_file.exists():
        problems.append(f"tests: tests/{op.tests}, its float64 reference tests, does not exist")
    elif not importlib.import_module(op.tests.removesuffix(".py")).__dict__.get("KILL_MATRIX", {}).get(op.name):
        problems.append(f"tests: tests/{op.tests} has no KILL_MATRIX[{op.name!r}] (one small bf16 case of its tests)")
    ops_list = (ROOT / "docs" / "kernels.md").read_text().split("`kernels.KERNEL_OPS`")[0].rsplit("the ops are", 1)[-1]
    if f"`{op.name}`" not in ops_list:
        problems.append(f"docs: docs/kernels.md's ops list (\"the ops are ..., `kernels.KERNEL_OPS`\", under "
                        f"\"Kernels and the NKI emulator\") does not name `{op.name}`")
    return problems


@pytest.mark.parametrize("name", kernels.OPS)
def test_every_op_is_declared_whole(name):
    assert declaration_problems(kernels.OPS[name]) == []


def test_a_declaration_missing_a_part_is_named():
    """The check above against a declaration that forgot its tests and its docs."""
    broken = dataclasses.replace(kernels.OPS["rope_norm"], name="rope_norm_copy", tests="test_no_such_file.py")
    problems = declaration_problems(broken)
    assert any(p.startswith("tests:") for p in problems) and any(p.startswith("docs:") for p in problems)
    assert any(p.startswith("name:") for p in problems) and any(p.startswith("call:") for p in problems)


@pytest.mark.parametrize("name", kernels.OPS)
def test_each_check_case_passes_in_fp32(name):
    """What bench.py --check compares for the op (its check_cases), in fp32 here (the kill matrix runs the bf16
    ones): NKI against PyTorch, forward and backward."""
    from kit import device_check

    generator = torch.Generator().manual_seed(0)
    for case in kernels.OPS[name].check_cases(kernels.CheckShapes(), torch.float32, "cpu", generator):
        device_check.check_kernel(case, grad=True)


def test_an_undeclared_op_says_how_to_declare_it():
    with pytest.raises(ValueError, match=r"not a declared kernel op.*_declare\(KernelOp"):
        kernels._use_nki("no_such_op", "auto", "cpu")

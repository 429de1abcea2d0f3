"""
The operations a GPT spends its time in: causal attention, the MLP and RMSNorm, plus the elementwise work
next to them fused into kernels of its own: the residual add with the RMSNorm after it, the head's
softcap with its cross-entropy, and RoPE with QK-norm.

Read by op. First what every op shares: the declarations and the dispatch between NKI and PyTorch (`_use_nki`), the
launch path (`_run_kernel`), the hardware constants, the helpers the kernels share and `_pipeline`, the one way a
kernel here software-pipelines (the attention forward does). Then one section per op, read top to bottom: the
function model.py calls (`attention`, `mlp`, `rms_norm`, `add_rms_norm`, `softcap_cross_entropy`, `rope_norm`), its
NKI kernels (their state in `nl.NKIObject` classes, each pipeline's schedule a table in its kernel's docstring), the
PyTorch op around them, its PyTorch fallback, its shape and cost rules, the small inputs its checks use, the plain
ops its fallback is priced as, and last its declaration (`KernelOp`), from which `KERNEL_OPS`, the per-op record,
`bench.py --check` / `--first_hour` / `--kernels`, the step estimate and the kill matrix take their lists.
docs/kernels.md, "Adding a kernel op", lists the steps for a new one.

Each op takes `mode`, the model's `kernels` setting: one mode, or one per op as `parse_kernels` reads a
setting such as "attention:nki,mlp:torch" ({op: mode}). Each op picks its path with `_use_nki`:

- "torch": always the PyTorch path (F.scaled_dot_product_attention, or `BlockCausalAttention` for fp32 on
  CPU; F.rms_norm; plain matmuls; x + branch; tanh and F.cross_entropy; the half-split rotary).
- "auto": the NKI kernel on a Trainium ("neuron") device where it takes the shapes and the cost model
  expects it to beat the compiled plain ops (`_mlp_cost_problem`; docs/results.md); otherwise the PyTorch
  path, logging why once per operation and reason.
- "nki": the NKI kernel or a clear error. Off Trainium the kernel runs on the CPU under `nki.simulate`
  (in the tests: the project's NKI emulator), which is how the kernels and their glue are tested here.
- "prefer": the NKI kernel wherever NKI is usable and the kernel takes the shapes, on any device; else
  PyTorch, logged once as a warning. Scoring runs an op that trained on NKI so.


Layouts follow PyTorch conventions at this boundary; a kernel that wants another layout (NKI attention
wants the head dim on the partition axis) changes it inside its own wrapper. Each NKI kernel is a plain
function over `nl`/`nisa`, launched by `_run_kernel` and registered as a PyTorch op pair (forward,
backward, autograd) by `_register_kernel_ops`: through `torch_neuronx.nki_op` on Trainium, through
`torch.library.custom_op` elsewhere.

For CUDA readers. A NeuronCore has no threads to program: each instruction runs on one engine over a
whole tile, whose first axis is the 128 partitions (like 128 lanes, each with its own slice of memory)
and whose other axes are the free axes. HBM is global memory; SBUF (24 MiB, 128 partitions) is the
shared memory every engine reads and writes; PSUM (16 KiB a partition, 8 banks of 2 KiB) is where
TensorE's matmuls accumulate, in fp32, like an accumulator fragment. The engines run in parallel,
synchronised by the compiler. The instructions used here (nki.isa):

  nc_matmul(dst, stationary, moving)   TensorE  dst (PSUM) (+)= stationary.T @ moving, contracting over the
                                                partitions: stationary up to 128 x 128, moving 128 x 512
  nc_transpose(dst, data)              TensorE  dst (PSUM) = data.T (a matmul with the identity)
  activation(dst, op, data, bias, scale)  ScalarE  dst = op(data * scale + bias), op exp/tanh/copy/...; scale
                                                and bias per partition; may sum each row into registers
  activation_reduce(..., reduce_res)   ScalarE  activation plus each row's sum into reduce_res
  tensor_tensor(dst, data1, data2, op) VectorE or GpSimd  elementwise dst = data1 op data2
  tensor_scalar(dst, data, op0, operand0, op1, operand1)  VectorE or GpSimd  dst = (data op0 a) op1 b, a and
                                                b scalars or one value per partition
  scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1)  VectorE  dst = (data op0 a) op1 tensor
  tensor_reduce(dst, op, data, axis)   VectorE  reduce along free axes (a row max or sum per partition)
  tensor_copy(dst, src)                VectorE  copy with a dtype cast (PSUM -> SBUF evictions)
  reciprocal(dst, data)                VectorE  1 / data
  memset(dst, value), iota(dst, ...)   fill with a constant / with an affine index pattern
  affine_select(dst, pattern, ...)     GpSimd   keep on_true_tile where an affine function of (partition,
                                                index) passes cmp_op, else a constant (mask building)
  dma_copy(dst, src)                   DMA      copy between HBM and SBUF (like a bulk async copy)
"""
import contextlib
import dataclasses
import functools
import logging
import math
import os
import re
import typing

import torch
import torch.nn.functional as F


def _nki_version_problem(version):
    """None if NKI `version` runs these kernels, else why not and the fix. NKI 0.4.0 (Neuron SDK 2.30) is
    the oldest that does: nc_matmul's accumulate= came in 0.3.0 and nki.simulate takes torch tensors from
    0.4.0 on (aws-neuron/aws-neuron-sdk: release-notes/components/nki.rst; nki/api/nki/__init__.py at
    539a73c5 and 3afa0fdf); every other nl/nisa name and keyword used here has the same signature in the
    0.4, 0.5 and 0.6 stubs. `version` is nki.__version__, "0.5.0+..." or "0.4.0b4+..." in public Trn2
    samples (littlemex/aws-neuron-samples); the stubs do not declare it, so one that does not read as
    major.minor is let through."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or (int(match[1]), int(match[2])) >= (0, 4):
        return None
    return (f"NKI {version} is older than 0.4, the oldest these kernels run on; install Neuron SDK 2.30 or "
            "newer (NKI 0.4+)")


try:
    import nki
    import nki.isa as nisa
    import nki.language as nl

    NKI_IMPORT_ERROR = _nki_version_problem(getattr(nki, "__version__", ""))
except ImportError as error:  # not installed, or PyPI's placeholder package (it raises "WRONG PACKAGE")
    NKI_IMPORT_ERROR = f"{type(error).__name__}: {error}"


if NKI_IMPORT_ERROR is not None:
    nki = nl = nisa = None
_NKIObject = object if nl is None else nl.NKIObject  # the base of the kernels' state classes (NKI 0.4's classes)


try:
    import torch_neuronx  # registers the "neuron" device and provides nki_op
except ImportError:
    torch_neuronx = None


logger = logging.getLogger("kernels")  # by name: the one-file submission runs this code as __main__


# -----------------------------------------------------------------------------
# one declaration per op, and the dispatch between NKI and PyTorch


class AttentionShape(typing.NamedTuple):
    batch: int
    n_head: int
    n_kv_head: int
    seq_len: int
    head_dim: int
    window: int | None = None  # earlier keys each query sees (attention), None for all


@dataclasses.dataclass(frozen=True)
class CheckShapes:
    """The shapes the kernel checks run at (KernelOp.check_cases). attention: one entry per attention shape
    (RoPE + QK-norm runs at each without a window too); the row kernels (MLP, norms, cross-entropy) take
    (batch, rows, dim) inputs; mlp_chunk_tiles: hidden tiles per MLP chunk, 0 for the kernels' own choice
    (_mlp_chunk_tiles). The defaults are small and ragged wherever the kernels allow it: an odd batch,
    T = 3 x 128, grouped heads 4:1, token counts that leave the last 128-row tile partial, a vocabulary that
    is not a multiple of 128 (kit/device_check.py's CPU_SHAPES adds the paths the device shapes reach)."""
    attention: tuple = (AttentionShape(3, 4, 1, 384, 32),)
    batch: int = 3
    rows: int = 67
    dim: int = 128
    hidden: int = 512
    activations: tuple = ()  # the MLP's activations to check, () for every one (MLP_ACTIVATIONS)
    mlp_chunk_tiles: int = 0
    vocab: int = 257
    logit_softcap: float = 15.0


class CheckCase(typing.NamedTuple):
    """One input of an op's checks (KernelOp.check_cases): what --check, --first_hour, test_kernel_ops and
    the kill matrix compare NKI with PyTorch on."""
    op: str  # the KERNEL_OPS entry the case checks
    name: str
    shape: str  # the shapes, in words, for --check's table
    make_inputs: object  # () -> fresh inputs
    call: object  # (*inputs, mode) -> output
    context: object = contextlib.nullcontext  # around the call and its backward


@dataclasses.dataclass(frozen=True)
class KernelOp:
    """What the kit knows of one kernel op, declared at the end of the op's section (`_declare`).

    name: the op in --kernels, `_use_nki` and the per-op record (preview_fallbacks), and in KERNEL_OPS.
    call: the public function model.py calls, `call(..., mode=)`; `torch_path`: its PyTorch fallback.
    kernels: its NKI kernel functions (nl/nisa), forward first; each docstring states its layouts, limits
        and SBUF and PSUM plan.
    shape_problem: the shape rule, None where the kernels take the arguments, else why not and the fix.
    cost_problem(config, tokens): the cost rule kernels=auto heeds, at a model's shapes (a GPTConfig) with
        `tokens` per call: None where the cost model expects the kernels faster, else why not (the op's public
        function applies it; bench.py's --kernels and step estimate ask it). None: the kernels run wherever
        they take the shapes.
    check_cases(shapes, dtype, device, generator): [CheckCase], what --check (kit/device_check.py),
        --first_hour, test_kernel_ops and the kill matrix compare NKI with PyTorch on, forward and backward,
        at CheckShapes; inputs drawn from `generator`, in `dtype` on `device`.
    model_cases(config, batch_size, device, dtype): [(case name, useful FLOPs forward, forward + backward,
        make_inputs, call(*inputs, mode))] at a model's shapes (a GPTConfig: what bench.py --kernels, the step
        estimate and --first_hour run), inputs requiring grad; the name starts with the op's.
    plain_ops(config, sequences, elements, plain): the op compiled as plain ops instead, as the step estimate
        and --kernels price its fallback (kit/compiled_cost.py, STEP_ASSUMPTIONS): {"forward": ops,
        "backward": ops} for one layer of `sequences` sequences, each op built with `plain`'s gemm, linear and
        passes; `elements`: the values a norm runs over where not the residual stream's (None).
    kill_matrix: the check cases the kill matrix (tests/test_kill_matrix.py) runs each wrong kernel against.
    tests: the file in tests/ that compares the op with float64 references; its KILL_MATRIX[name] gives the
        kill matrix one small bf16 case of them.
    """
    name: str
    call: object
    kernels: tuple
    torch_path: object
    shape_problem: object
    cost_problem: object
    check_cases: object
    model_cases: object
    plain_ops: object
    kill_matrix: tuple
    tests: str


OPS = {}  # name -> KernelOp, in the order of the sections below; KERNEL_OPS (at the end) lists the names


def _declare(op):
    """Adds `op` to OPS and returns it, for the section's NAME_OP = _declare(KernelOp(...)): the public op
    names itself through it (`_use_nki(NAME_OP.name, ...)`), so a one-file export that leaves an op out
    (kit/contest.py) leaves its declaration, and with it its kernels, out too."""
    if op.name in OPS:
        raise ValueError(f"kernel op {op.name!r} is declared twice")
    OPS[op.name] = op
    return op


def check_cases(dtype, device, generator, shapes=CheckShapes()):
    """Every CheckCase of every op (KernelOp.check_cases), in declaration order."""
    return [case for op in OPS.values() for case in op.check_cases(shapes, dtype, device, generator)]


def model_cases(config, batch_size, device, dtype):
    """Every op's KernelOp.model_cases at the shapes of `config` (a GPTConfig) with `batch_size` sequences."""
    cases = []
    for op in OPS.values():
        cases += op.model_cases(config, batch_size, device, dtype)
    return cases


def _model_drawing(device, dtype):
    """draw(*shape, scale=1.0): standard normal values times scale, in dtype on device, requiring grad."""
    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype).requires_grad_()
    return draw


def _drawing(dtype, device, generator):
    """draw(*shape, scale=1.0): standard normal values times scale from `generator`, in dtype on device."""
    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(device)
    return draw


KERNEL_MODES = ("auto", "nki", "torch", "prefer")
AUTO_NKI_DEVICES = ("neuron",)  # where kernels=auto runs NKI kernels (the tests add "cpu" to run auto emulated)


def parse_kernels(setting):
    """{op: mode} from a kernels setting: a mode ("auto"), op:mode pairs ("attention:nki,mlp:torch", the
    others "auto"), or both, the mode first ("torch,attention:nki"); else ValueError with the fix. Plain
    string operations: torch.compile traces it."""
    usage = (f"write one mode of {', '.join(KERNEL_MODES)} for every op, or op:mode pairs for the ops "
             f"{', '.join(KERNEL_OPS)} (e.g. --kernels=attention:nki,mlp:torch)")
    if not isinstance(setting, str):
        raise ValueError(f"--kernels={setting!r} is not a string; {usage}")
    modes, named = dict.fromkeys(KERNEL_OPS, "auto"), []
    for position, item in enumerate(setting.split(",")):
        op, colon, mode = item.strip().rpartition(":")
        if mode not in KERNEL_MODES:
            raise ValueError(f"--kernels={setting}: {mode!r} is not a mode; {usage}")
        if not colon:
            if position:
                raise ValueError(f"--kernels={setting}: the mode for every op ({mode}) must come first; {usage}")
            modes = dict.fromkeys(KERNEL_OPS, mode)
        elif op not in KERNEL_OPS:
            raise ValueError(f"--kernels={setting}: {op!r} is not an op; {usage}")
        elif op in named:
            raise ValueError(f"--kernels={setting}: {op} is given twice; {usage}")
        else:
            modes[op] = mode
            named.append(op)
    return modes


_fallbacks_logged = set()
_choices = None  # while preview_fallbacks runs: {op: {"nki" or "torch": [reasons]}}
BUILD_FAILURES = {}  # {op: why} of the ops whose NKI kernel failed to build in this run: PyTorch from then on
# (train.py fills it after a KernelBuildError and empties it when the run ends)


def _use_nki(op_name, setting, device_type, shape_problem=None, cost_problem=None):
    """Whether `op_name` runs its NKI kernel on tensors of `device_type`, for kernels=`setting`: one mode for
    every op, or parse_kernels' {op: mode} (the model parses its setting once, at construction).

    shape_problem: None when the kernel takes these shapes, else which limit they break and the fix.
    cost_problem: None when the cost model expects the kernel faster, else why not; only "auto" heeds it.
    "nki" raises when the kernel cannot run (RuntimeError without NKI, ValueError on shapes); "auto" and
    "prefer" fall back to PyTorch and log why, once per (op, reason): a warning on a neuron device or under
    "prefer", info elsewhere. An op in BUILD_FAILURES runs on PyTorch in every mode, unlogged here (train.py
    said it when the kernel failed). While preview_fallbacks runs, each choice and its reason are noted.
    """
    if op_name not in OPS:
        raise ValueError(f"{op_name!r} is not a declared kernel op ({', '.join(OPS)}); declare it with "
                         "NAME_OP = _declare(KernelOp(...)) at the end of its section of kernels.py (docs/kernels.md, "
                         "\"Adding a kernel op\")")
    mode = setting[op_name] if isinstance(setting, dict) else setting
    if mode not in KERNEL_MODES:
        raise ValueError(f"{op_name}: mode={mode!r} is not a mode; pass one of {', '.join(KERNEL_MODES)}, or "
                         "parse_kernels(setting) for a setting per op such as 'attention:nki,mlp:torch'")
    use_nki, fell_back = False, True
    if mode == "torch" or op_name in BUILD_FAILURES:  # chosen, not fallen back (train.py said a failure)
        reason, fell_back = "kernels=torch" if mode == "torch" else BUILD_FAILURES[op_name], False
    elif nki is None:
        if mode == "nki":
            raise RuntimeError(f"{op_name}: kernels='nki' needs NKI, which is not usable ({NKI_IMPORT_ERROR}); "
                               "use kernels='auto' or kernels='torch' on machines without the Neuron SDK")
        reason = f"NKI is not usable ({NKI_IMPORT_ERROR})"
    elif shape_problem is not None:
        if mode == "nki":
            raise ValueError(f"{op_name}: kernels='nki' cannot run the NKI kernel: {shape_problem}; or use "
                             "kernels='auto' to fall back to PyTorch for such shapes")
        reason = shape_problem
    elif mode == "auto" and device_type not in AUTO_NKI_DEVICES:
        reason = f"tensors are on {device_type}, not on a Trainium 'neuron' device"
    elif mode == "auto" and cost_problem is not None:
        reason = cost_problem
    else:
        use_nki, fell_back = True, False
        reason = (f"kernels={mode}: the NKI kernel takes these shapes"
                  + (" and the cost model expects it faster" if mode == "auto" else ""))
    if torch.compiler.is_compiling():  # no log call (a graph break), no global read (a guard): preview_fallbacks
        return use_nki  # made this choice before compiling, and said it
    key = reason if nki is None else (op_name, reason)  # NKI missing holds for every op alike: said once
    if fell_back and key not in _fallbacks_logged:
        _fallbacks_logged.add(key)
        level = logging.WARNING if device_type == "neuron" or mode == "prefer" else logging.INFO
        logger.log(level, "%s: using the PyTorch path: %s", "all kernels" if nki is None else op_name, reason)
    if _choices is not None:
        reasons = _choices.setdefault(op_name, {}).setdefault("nki" if use_nki else "torch", [])
        if reason not in reasons:
            reasons.append(reason)
    return use_nki


def preview_fallbacks(module, *inputs):
    """Make every kernel choice of `module(*inputs)` now, logging each fallback, without computing anything:
    the call runs on fake tensors (shapes, dtypes and devices only), so it takes the very branches that
    torch.compile traces. Call it before compiling, under the same autocast: inside a compiled region
    `_use_nki` cannot log (torch.compile(fullgraph=True) refuses a graph break), and a global it wrote there
    would be guarded on and cost a recompilation.

    Returns per op what ran, {op: {"ran": "nki", "torch" or "nki and torch", "why": reasons}}: the record
    checkpoints keep for scoring (`scoring_kernels`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    global _choices
    _choices = {}
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            module(*inputs)
        return {op: {"ran": " and ".join(ran), "why": "; ".join(r for reasons in ran.values() for r in reasons)}
                for op, ran in _choices.items()}
    finally:
        _choices = None


def scoring_kernels(record):
    """The kernels setting that runs each op as `record` (preview_fallbacks) says training did: "prefer"
    where it ran NKI, "torch" where not; ops it does not name "auto". One mode when every op it names ran one
    way: an op training never called (one declared after the run, or one this model does not use) follows
    the others."""
    modes = {op: "prefer" if "nki" in record[op]["ran"] else "torch" for op in KERNEL_OPS if op in record}
    if len(set(modes.values())) == 1:
        return next(iter(modes.values()))
    return ",".join(["auto"] + [f"{op}:{mode}" for op, mode in modes.items()])


# -----------------------------------------------------------------------------
# launching and registering the kernels, shared by every op


def _logical_core_degree():
    """LNC degree to launch kernels with; it must match the runtime's NEURON_LOGICAL_NC_CONFIG (Trn2
    default 2). Off Trainium the emulator runs the programs one after the other, exercising the split."""
    return int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2"))


class KernelBuildError(Exception):
    """An NKI kernel failed at its first call: a compile or trace error (under the emulator, any exception of
    its first run). `op`: its op in KERNEL_OPS, which can run on PyTorch instead; `why`: the record's reason.
    Not a RuntimeError: bench.py takes those from the glue as "the kernel cannot take these shapes"."""

    def __init__(self, op, cause):
        lines = str(cause).strip().splitlines()
        self.op = op
        self.why = f"NKI kernel failed to build: {type(cause).__name__}" + (f": {lines[0]}" if lines else "")
        super().__init__(f"{op}: {self.why}")


_launches = {}  # (kernel, LNC) -> nki.jit(kernel)[LNC], jitted once per process
_built_kernels = set()  # each kernel variant (_run_kernel's `variant`) that has run once in this process


def _run_kernel(kernel, *args):
    """Launch the NKI kernel function `kernel` on `args` (tensors and Python scalars) and return its outputs,
    always as a tuple (TorchNeuron hands a single output back bare: torch_neuronx/nki_hop.py, public copy
    parmoham-aws/test-repo-parmoham), on the inputs' device: jitted on the NeuronCores of a neuron device,
    elsewhere on the CPU under nki.simulate (the emulator in the tests). An exception at the first call of a
    kernel variant in this process (its build: trace and compile; under the emulator its first run) comes out
    as KernelBuildError naming the op; at any later call, as it is.

    Every tensor goes in contiguous (a kernel indexes HBM as dense row-major arrays; the model's v is a
    transposed view), copied here inside the op, where the compiled graph does not see it (a transpose + copy
    feeding the op is what inductor miscompiles in 16 bits on some CPUs)."""
    args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    lnc = _logical_core_degree()
    # what a build is specialised on, one build each: the kernel, the LNC, the scalar arguments and the tensors'
    # shapes and dtypes (a sliding window's attention is a build of its own, a new shape is compiled anew)
    variant = (kernel, lnc, *((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args))
    try:
        launch = _launches.get((kernel, lnc))
        if launch is None:
            launch = _launches[kernel, lnc] = nki.jit(kernel)[lnc]
        if device.type == "neuron":
            outputs = launch(*args)
        else:
            outputs = nki.simulate(launch)(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
    except Exception as error:
        if variant in _built_kernels:  # it ran before: not a build failure, nothing to fall back from
            raise
        # the op whose declaration lists a kernel of this name (by name: a test may launch a stand-in)
        op = next(op.name for op in OPS.values() if kernel.__name__ in [k.__name__ for k in op.kernels])
        raise KernelBuildError(op, error) from error
    _built_kernels.add(variant)
    if isinstance(outputs, torch.Tensor):
        outputs = (outputs,)
    return tuple(out.to(device) for out in outputs)


def _register_kernel_ops(name, forward, forward_fake, backward, backward_fake, setup_context, vjp):
    """Register a differentiable NKI operation as two PyTorch ops, nanogpt_trn::<name>_fwd and <name>_bwd, and
    return the forward op, which autograd differentiates through `vjp(backward_op, ctx, *output_grads)` after
    `setup_context(ctx, inputs, output)` saved what it needs. `forward` and `backward` (functions with type
    annotations, which call `_run_kernel`) are registered with `torch_neuronx.nki_op` on Trainium, with
    `torch.library.custom_op` elsewhere; each fake (same signature, returning empty tensors of the outputs'
    shapes and dtypes) gives torch.compile and meta tensors the shapes without running the kernel."""
    ops = []
    for impl, fake, direction in ((forward, forward_fake, "fwd"), (backward, backward_fake, "bwd")):
        qualname = f"nanogpt_trn::{name}_{direction}"
        if torch_neuronx is not None:
            op = torch_neuronx.nki_op(qualname, mutates_args=())(impl)
        else:
            op = torch.library.custom_op(qualname, impl, mutates_args=())
        op.register_fake(fake)
        ops.append(op)
    ops[0].register_autograd(functools.partial(vjp, ops[1]), setup_context=setup_context)
    return ops[0]


# -----------------------------------------------------------------------------
# hardware constants and the helpers the kernels share
#
# The row-wise kernels (MLP, the norms, the loss) put tokens (rows) on the 128 partitions, TILE at a time;
# a program of an LNC launch takes a contiguous share of the rows. Any row count works: the last tile may
# be short.

TILE = 128  # the partition count: rows per tile (tokens, queries per query tile, keys per key chunk)
BANK_FP32 = 512  # fp32 values in one PSUM bank row = widest matmul moving operand (Trn1/Trn2)
# Bytes per SBUF partition a kernel may use: nl.tile_size.total_available_sbuf_size, what the NKI front end
# leaves of the 24 MiB (Trn2) after its own reservations (leanprover/KLR, KLR/Trace.lean lines 52-54)
SBUF_USABLE_BYTES = {"trn1": 180_224, "trn2": 212_984, "trn3": 245_752}
# What the kernels plan to use on the Trn2 they are tuned for: the plans (_mlp_chunk_tiles,
# _attention_shape_problem) are rounded up, and 16,376 bytes (8%) of the usable figure stay free for the
# compiler's buffering (192 KiB, what the plans were sized and tested at). Trn1's 180,224 is below it.
SBUF_BUDGET = SBUF_USABLE_BYTES["trn2"] - 16_376
_KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def _spans(start, stop, most, even=False):
    """(offset, length) of the consecutive pieces of [start, stop), each at most `most` long; even: as few
    pieces as possible, as even as possible."""
    size = math.ceil((stop - start) / math.ceil((stop - start) / most)) if even else most
    spans = []
    for offset in range(start, stop, size):
        spans.append((offset, min(size, stop - offset)))
    return spans


def _program_rows(n_rows):
    """The [start, stop) rows this program handles: whole 128-row tiles, split evenly between the
    programs of an LNC launch (kernel[2] runs one program on each physical core)."""
    tiles = math.ceil(n_rows / TILE)
    per_program = math.ceil(tiles / nl.num_programs())
    start = min(n_rows, nl.program_id(0) * per_program * TILE)
    return start, min(n_rows, start + per_program * TILE)


def _load_tile(src, rows, cols):
    """src[rows, cols] (two slices) into a new SBUF tile, one DMA."""
    tile = nl.ndarray((rows.stop - rows.start, cols.stop - cols.start), src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=src[rows, cols])
    return tile


def _load_row_pieces(src, row_start, row_count, cols):
    """src[row_start : row_start + row_count, cols] into SBUF as tiles of at most 128 rows, one row per
    partition (one DMA each)."""
    pieces = []
    for span in _spans(row_start, row_start + row_count, TILE):
        start, count = span
        piece = nl.ndarray((count, cols.stop - cols.start), src.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=piece, src=src[start:start + count, cols])
        pieces.append(piece)
    return pieces


def _sbuf_tiles(count, shape, dtype):
    """`count` new SBUF tiles of one shape and dtype."""
    tiles = []
    for _ in range(count):
        tiles.append(nl.ndarray(shape, dtype, buffer=nl.sbuf))
    return tiles


def _transpose_pieces_into(dst_tiles, dst_col, pieces):
    """Write the transpose of the stacked row pieces (at most 512 rows in all) into columns
    dst_col.. of dst_tiles, where dst_tiles[c] receives columns c*128 .. c*128+127 of the pieces.
    TensorE flips the pieces' blocks of one column tile side by side into a PSUM bank (up to four
    128x128 flips), and one copy per bank brings them back to SBUF."""
    width = 0
    for piece in pieces:
        width += piece.shape[0]
    for c in range(len(dst_tiles)):
        dst = dst_tiles[c]
        flipped = nl.ndarray((TILE, width), dst.dtype, buffer=nl.psum)
        offset = 0
        for piece in pieces:
            rows = piece.shape[0]
            nisa.nc_transpose(dst=flipped[:, offset:offset + rows], data=piece[:, c * TILE:(c + 1) * TILE])
            offset += rows
        nisa.tensor_copy(dst=dst[:, dst_col:dst_col + width], src=flipped)


def _matmul_into_psum(stationaries, movings, stationary_cols=None, moving_cols=None):
    """sum_k stationaries[k][:, stationary_cols].T @ movings[k][:, moving_cols] (None: whole tiles) into a new
    fp32 PSUM tile [M, N]: the first matmul overwrites, the others accumulate (said explicitly rather than left
    to accumulate=None's first-write detection, which the ISA and architecture docs word differently)."""
    result = None
    for k in range(len(stationaries)):
        stationary = stationaries[k] if stationary_cols is None else stationaries[k][:, stationary_cols]
        moving = movings[k] if moving_cols is None else movings[k][:, moving_cols]
        if k == 0:
            result = nl.ndarray((stationary.shape[1], moving.shape[1]), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=result, stationary=stationary, moving=moving, accumulate=k > 0)
    return result


def _evict(dst, src, on_scalar):
    """PSUM -> SBUF copy on ScalarE or VectorE: callers alternate to keep the two balanced."""
    if on_scalar:
        nisa.activation(dst=dst, op=nl.copy, data=src)
    else:
        nisa.tensor_copy(dst=dst, src=src)


def _constant_column(value):
    """A [128, 1] fp32 column of `value`: a per-partition operand (activation bias, ones for a matmul)."""
    column = nl.ndarray((TILE, 1), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=column, value=value)
    return column


def _reciprocal_rms(x_tile, eps, squares):
    """1 / sqrt(mean(x^2) + eps) of each row of x_tile, a fp32 (rows, 1) column. ScalarE squares and sums
    in one instruction (`squares` (rows, d) receives the squares, which nobody reads); the column's mean +
    eps is VectorE's and its rsqrt GpSimd's (nl.rsqrt's engine), which leaves ScalarE the wide passes."""
    rows, dim = x_tile.shape
    sum_sq = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
    nisa.activation_reduce(dst=squares, op=nl.square, data=x_tile, reduce_op=nl.add, reduce_res=sum_sq)
    mean_sq = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=mean_sq, data=sum_sq, op0=nl.multiply, operand0=1.0 / dim, op1=nl.add, operand1=eps)
    rstd = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=rstd, data=mean_sq, op0=nl.rsqrt, operand0=0.0, engine=nisa.gpsimd_engine)
    return rstd


def _pipeline(units, stages, kernel):
    """Issue `units` through `stages` software-pipelined, the one convention of every pipelined kernel here:
    at step t, each (stage, lag) of `stages` in its order runs stage(units[t - lag], kernel) where that unit
    exists. A unit's stage k reads what its stage k - 1 made a step (or more) before, so no engine, each
    running its instructions in issue order, waits on the chain it has just started (nki-library's
    attention_cte.py pipelines its group loop by hand the same way). A negative lag runs a stage ahead."""
    first, last = 0, 0
    for entry in stages:
        first, last = min(first, entry[1]), max(last, entry[1])
    for step in range(first, len(units) + last):
        for entry in stages:
            stage, lag = entry
            if 0 <= step - lag < len(units):
                stage(units[step - lag], kernel)



# =============================================================================
# attention: causal flash attention with grouped-query heads
#
# Notation: S sequence length, d head dim, G = n_head / n_kv_head query heads per kv head. A "tile" is
# 128 rows (queries or keys, one per partition); a "block" is up to 512 keys, the widest matmul moving
# operand and one PSUM bank of fp32 scores; a "group" is up to 4 blocks (2048 keys) whose scores sit in
# PSUM together and share one row max. Every HBM tensor is (B, heads, S, d), as PyTorch holds it. On chip
# a head is kept two ways: *_rows (128, S/128, d), tile t on partition p = position t*128 + p (rows
# straight from HBM, 128 per DMA), and *_cols, one (d_piece, S) tile per piece of the head dim (d on the
# partitions, as TensorE contracts over partitions; made from the rows by TensorE transposes).


def attention(q, k, v, mode="auto", window=None):
    """Causal self-attention with grouped-query heads, optionally in a sliding window.

    q: (B, n_head, T, head_dim); k, v: (B, n_kv_head, T, head_dim) with n_kv_head dividing n_head.
    window: query i sees keys i - window .. i (FA3's window_size=(window, 0), as nanochat), None for all
    keys up to i. Returns (B, n_head, T, head_dim). Softmax scale is 1/sqrt(head_dim). The NKI path takes T
    a multiple of 128, head_dim <= 256, T x head_dim within the backward's SBUF plan and a window that is a
    multiple of 128 (see `_attention_shape_problem`). The PyTorch path is SDPA (with a mask for a window),
    except fp32 on CPU up to CPU_BLOCK_ATTENTION_MAX_LEN tokens, where `BlockCausalAttention` is faster.
    """
    seq_len = q.size(-2)
    if window is not None and window < 0:
        raise ValueError(f"window={window}: the earlier keys a query sees, >= 0; None for all of them")
    if window is not None and window >= seq_len - 1:  # it reaches key 0 from every query
        window = None
    if _use_nki(ATTENTION_OP.name, mode, q.device.type, _attention_shape_problem(q, k, v, window)):
        return _attention_nki(q, k, v, window)
    return _attention_torch(q, k, v, window)


KEY_BLOCK = 512  # keys per score block: nl.tile_size.gemm_moving_fmax, one PSUM bank of fp32
KEY_GROUP = 4 * KEY_BLOCK  # keys whose scores share a row max: 4 of PSUM's 8 banks
ATTENTION_MAX_HEAD_DIM = 2 * TILE  # two pieces of the head dim: P @ V's (128, d) fp32 result is half a bank
_MASKED_SCORE = -1e30  # added to scores outside the causal window; exp() of it scaled is exactly 0


def _limits_and_mask(kernel, k, window):
    """Both kernels' entry: their limits asserted (`_attention_shape_problem` says the same to the glue), then
    the mask operands into the kernel's state: 128x128 tiles whose matmul identity.T @ bias adds a bias onto a
    partly visible key chunk's scores in PSUM (`_scores`), the bias `diagonal` (0 where key <= query, i.e. free
    index <= partition, _MASKED_SCORE above) or, where a window starts after key 0, `edge` (0 where key >=
    query - window, _MASKED_SCORE below). TensorE adds it, so masking costs one small matmul instead of a
    PSUM->SBUF copy plus a GpSimd affine_select (which cannot read PSUM) on the busiest engines."""
    batch, n_heads, seq_len, head_dim = kernel.q.shape
    assert k.shape[0] == batch and k.shape[2] == seq_len and k.shape[3] == head_dim and n_heads % k.shape[1] == 0, \
        "q (B, H, S, d) and k, v (B, Hkv, S, d) with Hkv dividing H"
    assert head_dim <= ATTENTION_MAX_HEAD_DIM and (head_dim <= TILE or head_dim % 2 == 0), \
        "head_dim up to 256, even above 128"
    assert seq_len % TILE == 0, "the sequence length must be a multiple of 128"
    assert window >= TILE and window % TILE == 0, "the window must be a positive multiple of 128 keys"
    dtype = kernel.q.dtype
    kernel.window = window
    kernel.identity = nl.ndarray((TILE, TILE), dtype=dtype, buffer=nl.sbuf)
    nisa.affine_select(dst=kernel.identity, pattern=[[-1, TILE]], channel_multiplier=1,
                       on_true_tile=nl.ones((TILE, TILE), dtype=dtype), on_false_value=0.0, cmp_op=nl.equal)
    kernel.diagonal = nl.ndarray((TILE, TILE), dtype=dtype, buffer=nl.sbuf)
    nisa.affine_select(dst=kernel.diagonal, pattern=[[-1, TILE]], channel_multiplier=1,
                       on_true_tile=nl.zeros((TILE, TILE), dtype=dtype), on_false_value=_MASKED_SCORE,
                       cmp_op=nl.greater_equal)
    if window <= seq_len - TILE:  # some query tile's window starts after key 0
        kernel.edge = nl.ndarray((TILE, TILE), dtype=dtype, buffer=nl.sbuf)
        nisa.affine_select(dst=kernel.edge, pattern=[[1, TILE]], channel_multiplier=-1,
                           on_true_tile=nl.zeros((TILE, TILE), dtype=dtype), on_false_value=_MASKED_SCORE,
                           cmp_op=nl.greater_equal)


def _load_rows(src, b, h, dtype):
    """HBM src[b, h] (S, d) -> SBUF rows (128, S/128, d), one 128-row DMA per tile, each indexing the
    kernel argument once (nki-library style: no view of a view of an HBM tensor)."""
    seq_len, head_dim = src.shape[2], src.shape[3]
    rows = nl.ndarray((TILE, seq_len // TILE, head_dim), dtype=dtype, buffer=nl.sbuf)
    for t in range(seq_len // TILE):
        nisa.dma_copy(dst=rows[:, t, :], src=src[b, h, t * TILE:(t + 1) * TILE, :])
    return rows


def _load_cols(src, b, h, dtype, rows=None, on_scalar=True):
    """HBM src[b, h] (S, d) -> cols: one (size, S) tile per piece of the head dim, as few equal pieces of at most
    128 as d needs (nki-library's attention_bwd.py tiles d the same way); TensorE transposes into PSUM, ScalarE
    (`on_scalar`) or VectorE copies out. Given the head's `rows` (`_load_rows`), 4 of their tiles a bank. Else
    512 positions per DMA, row-major into (128, 4, d): partition p gets positions 4p..4p+3, one contiguous
    4d-element run on both sides (a quarter of the descriptors of 128-row DMAs); slot j goes to the j-th 128
    columns of a bank (a PSUM write starts 4-byte aligned, nl.tile_size.psum_min_align: slot j of interleaved
    bf16 columns would start at byte 2j), and one copy writes them to every 4th SBUF column (positions 4p + j),
    so the columns come out in position order."""
    seq_len, head_dim = src.shape[2], src.shape[3]
    n_pieces = (head_dim + TILE - 1) // TILE
    size = head_dim // n_pieces
    pieces = []
    for p in range(n_pieces):
        pieces.append(nl.ndarray((size, seq_len), dtype=dtype, buffer=nl.sbuf))
    if rows is not None:
        for p in range(n_pieces):
            for first in range(0, seq_len // TILE, 4):
                count = min(4, seq_len // TILE - first)
                transposed = nl.ndarray((size, count * TILE), dtype=dtype, buffer=nl.psum)
                for t in range(count):
                    nisa.nc_transpose(dst=transposed[:, t * TILE:(t + 1) * TILE],
                                      data=rows[:, first + t, p * size:(p + 1) * size])
                _evict(pieces[p][:, first * TILE:(first + count) * TILE], transposed, on_scalar)
        return tuple(pieces)
    for start in range(0, seq_len, KEY_BLOCK):
        per_partition = min(KEY_BLOCK, seq_len - start) // TILE
        staged = nl.ndarray((TILE, per_partition, head_dim), dtype=dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=staged, src=src[b, h, start:start + per_partition * TILE, :])
        for p in range(n_pieces):
            transposed = nl.ndarray((size, per_partition, TILE), dtype=dtype, buffer=nl.psum)
            for j in range(per_partition):
                nisa.nc_transpose(dst=transposed[:, j, :], data=staged[:, j, p * size:(p + 1) * size])
            slot_major = pieces[p].ap([[seq_len, size], [1, per_partition], [per_partition, TILE]], offset=start)
            _evict(slot_major, transposed, on_scalar)
    return tuple(pieces)


def _scores(scores, q_cols, k_cols, query_tile, start, kernel):
    """scores (128 queries, width keys, PSUM fp32) = q.T @ k over the head-dim pieces, unscaled, for
    query tile `query_tile` and the keys from `start`; on the block that holds the diagonal (always its last
    128 keys) the kernel's causal bias is accumulated onto those keys, on the block that starts the
    tile's window (its first 128 keys) the window's edge bias. Every matmul says `accumulate=`: a mask adds
    into a slice of a tile the first matmul wrote, which accumulate=None would detect per location by the
    ISA doc but per bank by the architecture guide."""
    width = scores.shape[1]
    queries = slice(query_tile * TILE, (query_tile + 1) * TILE)
    for piece in range(len(q_cols)):
        nisa.nc_matmul(dst=scores, stationary=q_cols[piece][:, queries], moving=k_cols[piece][:, start:start + width],
                       accumulate=piece > 0)
    if start + width == (query_tile + 1) * TILE:
        nisa.nc_matmul(dst=scores[:, width - TILE:width], stationary=kernel.identity, moving=kernel.diagonal,
                       accumulate=True)
    if start == query_tile * TILE - kernel.window:
        nisa.nc_matmul(dst=scores[:, 0:TILE], stationary=kernel.identity, moving=kernel.edge, accumulate=True)


class AttentionFwd(_NKIObject):
    """What every stage of flash_attention_fwd_kernel reads: its operands and outputs (HBM)."""
    q = None
    k = None
    v = None
    out = None
    lse = None  # (B, H, 128, S/128) fp32
    scale = None
    window = None  # the mask operands (`_limits_and_mask`)
    identity = None
    diagonal = None
    edge = None


class FwdQueryTile(_NKIObject):
    """One 128-query tile of the forward's stream and what its stages make, stage by stage."""
    b = None
    h = None
    kv_head = None
    query_tile = None
    previous = None  # the stream's tile before: its pair's K and V and its head's Q and statistics carry on
    groups = None  # the first key of each group of up to KEY_GROUP keys the tile sees (blocks nobody sees skipped)
    group = 0  # the group the stages work on
    # the load: K cols and V rows by the pair's first tile, Q cols and the row statistics by the head's first
    k_cols = None
    v_rows = None
    q_cols = None
    neg_max_all = None  # (128, S/128) fp32: -scale * row max of every query of the head
    sum_all = None  # (128, S/128) fp32: the row sums
    # scores: one PSUM bank per block of up to 512 keys
    starts = None
    scores = None
    # softmax: the running -scale * max and, past the first group, the online rescale alpha; P and its row sum
    neg_max = None
    alpha = None
    probs = None
    group_sum = None
    # transposes and their copy: P^T in PSUM, then in SBUF
    transposed = None
    probs_t = None
    # values: P @ V summed over the groups (PSUM for one group, else SBUF), and the row sum
    out_acc = None
    row_sum = None


def _fwd_query_tiles(q, k, window):
    """The program's stream of query tiles: (batch, kv head) pairs split over the programs of an LNC launch,
    outer, then their query heads, then the heads' 128-query tiles."""
    n_heads, seq_len = q.shape[1], q.shape[2]
    n_kv_heads, n_tiles = k.shape[1], seq_len // TILE
    tiles = []
    for pair in range(nl.program_id(0), q.shape[0] * n_kv_heads, nl.num_programs(0)):
        b, kv_head = divmod(pair, n_kv_heads)
        for h in range(kv_head * (n_heads // n_kv_heads), (kv_head + 1) * (n_heads // n_kv_heads)):
            for query_tile in range(n_tiles):
                groups = []
                for group_start in range(max(0, query_tile * TILE - window), (query_tile + 1) * TILE, KEY_GROUP):
                    groups.append(group_start)
                tiles.append(FwdQueryTile(b=b, h=h, kv_head=kv_head, query_tile=query_tile, groups=groups,
                                          previous=tiles[-1] if len(tiles) > 0 else None))
    return tiles


def _fwd_load(tile, kernel):
    """Stage 0: a pair's first tile loads its K cols and V rows, a head's first its Q cols and makes its
    statistics' tiles; the others take them from the tile before."""
    dtype, n_tiles = kernel.q.dtype, kernel.q.shape[2] // TILE
    pair_first = tile.previous is None or tile.previous.kv_head != tile.kv_head or tile.previous.b != tile.b
    if pair_first:
        tile.k_cols = _load_cols(kernel.k, tile.b, tile.kv_head, dtype)
        tile.v_rows = _load_rows(kernel.v, tile.b, tile.kv_head, dtype)
    else:
        tile.k_cols = tile.previous.k_cols
        tile.v_rows = tile.previous.v_rows
    if tile.query_tile == 0:
        tile.q_cols = _load_cols(kernel.q, tile.b, tile.h, dtype)
        tile.neg_max_all = nl.ndarray((TILE, n_tiles), dtype=nl.float32, buffer=nl.sbuf)
        tile.sum_all = nl.ndarray((TILE, n_tiles), dtype=nl.float32, buffer=nl.sbuf)
    else:
        tile.q_cols = tile.previous.q_cols
        tile.neg_max_all = tile.previous.neg_max_all
        tile.sum_all = tile.previous.sum_all


def _fwd_scores(tile, kernel):
    """Stage 1 of a group: its score blocks (up to 512 keys each, one PSUM bank) on TensorE."""
    group_start = tile.groups[tile.group]
    group_stop = min(group_start + KEY_GROUP, (tile.query_tile + 1) * TILE)
    tile.starts = []
    tile.scores = []
    for start in range(group_start, group_stop, KEY_BLOCK):
        block = nl.ndarray((TILE, min(KEY_BLOCK, group_stop - start)), dtype=nl.float32, buffer=nl.psum)
        _scores(block, tile.q_cols, tile.k_cols, tile.query_tile, start, kernel)
        tile.starts.append(start)
        tile.scores.append(block)


def _fwd_softmax(tile, kernel):
    """Stage 2 of a group: the row max (VectorE), p = exp(scale * s - scale * max) on ScalarE reading PSUM,
    the row sum over the group's blocks built up in ScalarE's reduce registers and read once, with the last
    block; past the first group, alpha = exp(scale * (old max - new max)) of the online softmax. A single
    group writes its statistics straight into the head's tiles."""
    single_group, last_group = len(tile.groups) == 1, tile.group == len(tile.groups) - 1
    column = slice(tile.query_tile, tile.query_tile + 1)
    n_blocks = len(tile.scores)
    block_max = nl.ndarray((TILE, n_blocks), dtype=nl.float32, buffer=nl.sbuf)
    for j in range(n_blocks):
        # on VectorE: ScalarE's reduce registers start a reduction from zero (the isa docstring of
        # activation_reduce), so their max of a row whose scores are all negative would be 0, and
        # exp(scale * s - 0) underflows to a zero row sum where the scores are very negative
        nisa.tensor_reduce(dst=block_max[:, j:j + 1], op=nl.maximum, data=tile.scores[j], axis=1)
    group_neg_max = tile.neg_max_all[:, column] if single_group else nl.ndarray((TILE, 1), dtype=nl.float32,
                                                                                buffer=nl.sbuf)
    if n_blocks == 1:
        nisa.tensor_scalar(dst=group_neg_max, data=block_max, op0=nl.multiply, operand0=-kernel.scale)
    else:
        group_max = nl.ndarray((TILE, 1), dtype=nl.float32, buffer=nl.sbuf)  # on GpSimd: VectorE is the busiest
        for j in range(1, n_blocks):
            nisa.tensor_tensor(dst=group_max, data1=block_max[:, 0:1] if j == 1 else group_max,
                               data2=block_max[:, j:j + 1], op=nl.maximum, engine=nisa.gpsimd_engine)
        nisa.tensor_scalar(dst=group_neg_max, data=group_max, op0=nl.multiply, operand0=-kernel.scale)
    if tile.group == 0:
        tile.neg_max = group_neg_max
    else:  # the online softmax across groups: alpha = exp(scale * (old max - new max))
        new_neg_max = tile.neg_max_all[:, column] if last_group else nl.ndarray((TILE, 1), dtype=nl.float32,
                                                                                buffer=nl.sbuf)
        nisa.tensor_tensor(dst=new_neg_max, data1=tile.neg_max, data2=group_neg_max, op=nl.minimum)
        tile.alpha = nl.ndarray((TILE, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=tile.alpha, op=nl.exp, data=tile.neg_max, bias=new_neg_max, scale=-1.0)
        tile.neg_max = new_neg_max
    tile.group_sum = tile.sum_all[:, column] if single_group else nl.ndarray((TILE, 1), dtype=nl.float32,
                                                                            buffer=nl.sbuf)
    tile.probs = []
    for j in range(n_blocks):
        block_probs = nl.ndarray(tile.scores[j].shape, dtype=kernel.q.dtype, buffer=nl.sbuf)
        nisa.activation(dst=block_probs, op=nl.exp, data=tile.scores[j], bias=tile.neg_max, scale=kernel.scale,
                        reduce_op=nl.add, reduce_res=tile.group_sum if j == n_blocks - 1 else None,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce if j == 0 else nisa.reduce_cmd.reduce)
        tile.probs.append(block_probs)


def _fwd_transposes(tile, kernel):
    """Stage 3 of a group: p @ v contracts over keys, which must sit on the partitions: TensorE transposes
    p chunk by chunk into PSUM, one (128, n, 128) tile per block of n chunks, [:, c, :] = chunk c transposed."""
    tile.transposed = []
    for j in range(len(tile.probs)):
        count = tile.probs[j].shape[1] // TILE
        transposed = nl.ndarray((TILE, count, TILE), dtype=kernel.q.dtype, buffer=nl.psum)
        for c in range(count):
            nisa.nc_transpose(dst=transposed[:, c, :], data=tile.probs[j][:, c * TILE:(c + 1) * TILE])
        tile.transposed.append(transposed)


def _fwd_probs_t(tile, kernel):
    """Stage 4 of a group: P^T copied out of PSUM, one copy a block, VectorE and ScalarE by turns (VectorE reads
    bf16 from PSUM at twice ScalarE's rate, [TRN2] performance mode, but it also makes the row maxes)."""
    tile.probs_t = []
    for j in range(len(tile.transposed)):
        tile.probs_t.append(nl.ndarray(tile.transposed[j].shape, dtype=kernel.q.dtype, buffer=nl.sbuf))
        _evict(tile.probs_t[j], tile.transposed[j], (tile.query_tile + j) % 2 == 1)


def _fwd_values(tile, kernel):
    """Stage 5 of a group: P @ V accumulated in one PSUM tile over the group; past the first group, what the
    earlier groups summed rescaled to the new max."""
    head_dim = tile.v_rows.shape[2]
    group_out = nl.ndarray((TILE, head_dim), dtype=nl.float32, buffer=nl.psum)
    for j in range(len(tile.probs_t)):
        for c in range(tile.probs_t[j].shape[1]):
            nisa.nc_matmul(dst=group_out, stationary=tile.probs_t[j][:, c, :],
                           moving=tile.v_rows[:, tile.starts[j] // TILE + c, :], accumulate=j > 0 or c > 0)
    if len(tile.groups) == 1:
        tile.out_acc = group_out
        tile.row_sum = tile.group_sum
    elif tile.group == 0:
        tile.out_acc = nl.ndarray((TILE, head_dim), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=tile.out_acc, src=group_out)
        tile.row_sum = tile.group_sum
    else:  # rescale what the earlier groups summed to the new max
        new_sum = tile.sum_all[:, tile.query_tile:tile.query_tile + 1] if tile.group == len(tile.groups) - 1 \
            else nl.ndarray((TILE, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=new_sum, data=tile.row_sum, op0=nl.multiply, operand0=tile.alpha,
                                  op1=nl.add, operand1=tile.group_sum)
        tile.row_sum = new_sum
        nisa.scalar_tensor_tensor(dst=tile.out_acc, data=tile.out_acc, op0=nl.multiply, operand0=tile.alpha,
                                  op1=nl.add, operand1=group_out)


def _fwd_store(tile, kernel):
    """Stage 6 of a tile: out = acc * (1 / sum), its 128 rows to out[b, h]. No division on the hardware
    (nki.api.shared.rst's ISA operator table; the release notes' known issues): one VectorE reciprocal of the
    (128, 1) row sums, then a multiply from PSUM. The head's last tile also writes its lse = log(sum) -
    (-scale * max), one ScalarE and one VectorE instruction for the head."""
    rows = slice(tile.query_tile * TILE, (tile.query_tile + 1) * TILE)
    inverse_sum = nl.ndarray((TILE, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=inverse_sum, data=tile.row_sum)
    out_tile = nl.ndarray((TILE, tile.out_acc.shape[1]), dtype=kernel.out.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=out_tile, data=tile.out_acc, op0=nl.multiply, operand0=inverse_sum)
    nisa.dma_copy(dst=kernel.out[tile.b, tile.h, rows, :], src=out_tile)
    if tile.query_tile == kernel.q.shape[2] // TILE - 1:
        log_sum = nl.ndarray(tile.sum_all.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=log_sum, op=nl.log, data=tile.sum_all)  # sum >= 1: the max itself contributes exp(0)
        lse_tile = nl.ndarray(tile.sum_all.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=lse_tile, data1=log_sum, data2=tile.neg_max_all, op=nl.subtract)
        nisa.dma_copy(dst=kernel.lse[tile.b, tile.h, :, :], src=lse_tile)


def flash_attention_fwd_kernel(q, k, v, scale, window):
    """Causal flash attention forward, grouped-query heads, optionally in a sliding window.

    Inputs (HBM), as the model holds them: q (B, H, S, d), k and v (B, Hkv, S, d); all bf16 (or all fp32:
    then every matmul runs in fp32, 4x slower, for testing). scale is the softmax scale; query i sees keys
    i - window .. i (FA3's window_size (window, 0)). Returns out (B, H, S, d) in the input dtype and lse
    (B, H, 128, S/128) fp32, the logsumexp of the scaled scores of query t*128 + p at [b, h, p, t], which
    the backward needs. Limits (asserted at entry): d <= 256, even above 128 (one or two equal pieces of <= 128
    on the partitions); S a multiple of 128; Hkv divides H (query head h uses kv head h // (H / Hkv));
    window a multiple of 128 (S or more: every key up to the query). S is also limited by the backward's
    SBUF plan (flash_attention_bwd_kernel).

    Layouts change on chip, not in the PyTorch graph: q and k come in 512 positions per DMA
    (`_load_cols`) and TensorE transposes them into cols (d on the partitions, as the score matmul
    contracts over d), ScalarE copying them out of PSUM; v comes in rows of 128 positions, as P @ V
    wants it (keys on the partitions).

    Work: (batch, kv head) pairs are split over the programs of an LNC launch (kernel[2] on Trn2); K and V
    of a pair are loaded once and serve its G query heads. For each 128-query tile i, keys [0, 128(i+1))
    go in blocks of up to 512: S = q_tile.T @ k_block (one 128x128x512 matmul per head-dim piece,
    accumulating in a PSUM bank), the causal bias accumulated by TensorE onto the last 128 keys of the
    diagonal block only (blocks wholly above the diagonal are skipped); with a window, keys start at
    128i - window, the first 128 of them masked the same way (the blocks before are skipped). Per group of
    up to 4 blocks (2048 keys): one row max (a VectorE reduce per block, one combine; not ScalarE's reduce
    registers, which start from zero and so would clamp an all-negative row's max to 0), exp on ScalarE
    reading PSUM with the row sum accumulated in its reduce registers over the group's blocks, P cast to
    the input dtype and transposed in 128x128 chunks on TensorE (each block's chunks copied out in one
    instruction, VectorE and ScalarE by turns, which keeps the two engines level), then P @ V as
    128x128xd matmuls accumulating in one PSUM tile over the group; out = acc * (1 / sum) (a VectorE
    reciprocal of the row sums, then one multiply from PSUM: the hardware has no divide). Groups after the
    first (S > 2048) rescale the running sum and output once each (online softmax). A head's row statistics
    stay in (128, S/128) tiles, so lse = log(sum) - (-scale * max) is one ScalarE and one VectorE
    instruction per head.

    Schedule: the program's query tiles form one stream (`_fwd_query_tiles`) through seven stages, each
    unit a query tile, issued by `_pipeline` (step t runs each stage on tile t - lag, in the table's order):

        S <= 1024                            1024 < S <= 2048
        stage             lag  engines       stage             lag  engines
        _fwd_load          0   DMA, PE, ACT  _fwd_load          0   DMA, PE, ACT
        _fwd_scores        0   PE            _fwd_store         2   DVE, DMA (ACT: lse)
        _fwd_store         5   DVE, DMA      _fwd_transposes    1   PE
        _fwd_values        4   PE            _fwd_probs_t       1   DVE / ACT
        _fwd_probs_t       3   DVE / ACT     _fwd_values        1   PE
        _fwd_transposes    2   PE            _fwd_scores        0   PE
        _fwd_softmax       1   DVE, ACT      _fwd_softmax       0   DVE, ACT

    Prologue: the first steps run only the stages whose tile exists (step 0: load and scores of tile 0);
    steady step: every stage, on the tiles t - lag; epilogue: the last tiles' later stages. Above 1024 the
    P^T copy and P @ V run a step after the scores, so a tile's four score banks are free before the next
    tile's scores. Above S = KEY_GROUP (2048) a tile's groups carry the online softmax: tiles and their
    groups go in order, unpipelined.

    SBUF per partition (bf16): K cols and V rows per pair, Q cols per head, 2S*d/128 bytes each (8 KiB at
    S = 2048, d = 256), plus a group's P tiles and the load staging (~10 KiB): under the backward's plan
    (`_attention_shape_problem`), which bounds S. PSUM, each tile in whole 2 KiB banks: at S <= 1024 two
    tiles' scores (2 banks each), one tile's P^T (a bank per 512 keys), the output tile and Q's layout
    transposes: at most 8 of the 8 banks; at S <= 2048 one tile's scores (4), then its P^T (4) once they are
    copied out, the output tile and the layout transposes: at most 6; above, a group's scores 4 banks, P^T,
    the output tile and the layout transposes one each: at most 7. Per full 512-key block at d = 128
    TensorE spends 640 ns (scores, P^T, P @ V), VectorE 533 on a row max, ScalarE 576 cycles on the exp, the
    P^T copy 256 VectorE or 576 ScalarE cycles: split as above, both land near TensorE (docs/results.md has
    the counts and schedules at the model's shapes).
    """
    batch, n_heads, seq_len, head_dim = q.shape
    out = nl.ndarray((batch, n_heads, seq_len, head_dim), dtype=q.dtype, buffer=nl.shared_hbm)
    lse = nl.ndarray((batch, n_heads, TILE, seq_len // TILE), dtype=nl.float32, buffer=nl.shared_hbm)
    kernel = AttentionFwd(q=q, k=k, v=v, out=out, lse=lse, scale=scale)
    _limits_and_mask(kernel, k, window)
    tiles = _fwd_query_tiles(q, k, window)
    if seq_len > KEY_GROUP:  # a tile's groups carry its online softmax: in order
        for t in range(len(tiles)):
            _fwd_load(tiles[t], kernel)
            for group in range(len(tiles[t].groups)):
                tiles[t].group = group
                _fwd_scores(tiles[t], kernel)
                _fwd_softmax(tiles[t], kernel)
                _fwd_transposes(tiles[t], kernel)
                _fwd_probs_t(tiles[t], kernel)
                _fwd_values(tiles[t], kernel)
            _fwd_store(tiles[t], kernel)
    elif seq_len <= 2 * KEY_BLOCK:  # one group a tile: the schedules of the docstring's table
        _pipeline(tiles, ((_fwd_load, 0), (_fwd_scores, 0), (_fwd_store, 5), (_fwd_values, 4), (_fwd_probs_t, 3),
                          (_fwd_transposes, 2), (_fwd_softmax, 1)), kernel)
    else:
        _pipeline(tiles, ((_fwd_load, 0), (_fwd_store, 2), (_fwd_transposes, 1), (_fwd_probs_t, 1), (_fwd_values, 1),
                          (_fwd_scores, 0), (_fwd_softmax, 0)), kernel)
    return out, lse


class AttentionBwd(_NKIObject):
    """flash_attention_bwd_kernel's state: its operands, outputs and mask operands, then the tiles of the (batch,
    kv head) pair, the query head and the key block its loops are at, each replaced as the loops move on."""
    q = None
    dq = None
    dk = None
    dv = None
    scale = None
    group = None  # query heads per kv head
    window = None  # the mask operands (`_limits_and_mask`)
    identity = None
    diagonal = None
    edge = None
    # the pair's
    b = None
    kv_head = None
    k_rows = None
    k_cols = None
    v_cols = None
    dk_rows = None  # dK and dV of the pair in the input dtype, (128, S/128, d), written by the group's last head
    dv_rows = None
    dk_sum = None  # with G > 1: the fp32 sums over the group's heads before the last
    dv_sum = None
    # the query head's
    h = None
    q_rows = None
    q_cols = None
    do_rows = None
    do_cols = None
    neg_lse = None  # (128, S/128) fp32
    neg_delta = None  # -D = -rowsum(dO * O), (128, S/128) fp32
    dq_acc = None  # dQ's fp32 sum, (128, S/128, d)
    # the key block's: its 128-key chunks (a slice), a (128 keys, d) fp32 PSUM accumulator of dK and of dV per chunk
    chunks = None
    block_dk = None
    block_dv = None


def _bwd_scores(kernel, query_tile, first, width):
    """Query tile `query_tile` against the key block's keys first .. first + width: S and dP over the d pieces,
    P recomputed from lse, dS = P * (dP - D) unscaled (ScalarE takes dP - D out of PSUM, so VectorE's product
    has both inputs in SBUF in the input dtype: its fast case, N cycles, not 2N); dV += P.T @ dO and
    dK += dS.T @ Q into the block's PSUM slots (chunk c's sum starts at the query tile on its diagonal, the
    first that sees its keys). The block's first tile makes the slots, packed into as few banks as hold them
    (4 a bank at d = 128, 2 at d = 256): the compiler gives each PSUM tile whole banks, so 8 separate tiles
    would leave no bank for the scores. Returns dS (SBUF)."""
    queries, column = slice(query_tile * TILE, (query_tile + 1) * TILE), slice(query_tile, query_tile + 1)
    dtype, head_dim, chunks = kernel.q.dtype, kernel.q.shape[3], kernel.chunks
    scores = nl.ndarray((TILE, width), dtype=nl.float32, buffer=nl.psum)
    _scores(scores, kernel.q_cols, kernel.k_cols, query_tile, first, kernel)
    dprobs = nl.ndarray((TILE, width), dtype=nl.float32, buffer=nl.psum)
    for piece in range(len(kernel.do_cols)):
        nisa.nc_matmul(dst=dprobs, stationary=kernel.do_cols[piece][:, queries],
                       moving=kernel.v_cols[piece][:, first:first + width], accumulate=piece > 0)
    probs = nl.ndarray((TILE, width), dtype=dtype, buffer=nl.sbuf)
    nisa.activation(dst=probs, op=nl.exp, data=scores, bias=kernel.neg_lse[:, column], scale=kernel.scale)
    shifted = nl.ndarray((TILE, width), dtype=dtype, buffer=nl.sbuf)
    nisa.activation(dst=shifted, op=nl.copy, data=dprobs, bias=kernel.neg_delta[:, column])
    dscores = nl.ndarray((TILE, width), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=dscores, data1=shifted, data2=probs, op=nl.multiply)
    if query_tile == chunks.start:
        n_chunks = chunks.stop - chunks.start
        per_bank = min(n_chunks, BANK_FP32 // head_dim)
        block_dk = []
        block_dv = []
        for bank_first in range(0, n_chunks, per_bank):
            dk_bank = nl.ndarray((TILE, min(per_bank, n_chunks - bank_first), head_dim), dtype=nl.float32,
                                 buffer=nl.psum)
            dv_bank = nl.ndarray(dk_bank.shape, dtype=nl.float32, buffer=nl.psum)
            for c in range(dk_bank.shape[1]):
                block_dk.append(dk_bank[:, c, :])
                block_dv.append(dv_bank[:, c, :])
        kernel.block_dk = block_dk
        kernel.block_dv = block_dv
    skipped = first // TILE - chunks.start
    for c in range(width // TILE):
        chunk = slice(c * TILE, (c + 1) * TILE)
        started = query_tile > first // TILE + c
        nisa.nc_matmul(dst=kernel.block_dv[skipped + c], stationary=probs[:, chunk],
                       moving=kernel.do_rows[:, query_tile, :], accumulate=started)
        nisa.nc_matmul(dst=kernel.block_dk[skipped + c], stationary=dscores[:, chunk],
                       moving=kernel.q_rows[:, query_tile, :], accumulate=started)
    return dscores


def _bwd_dq(kernel, query_tile, first, dscores, block_last):
    """dS transposed chunk by chunk for dQ = dS @ K, which contracts over keys. On the block's last tile, the
    head's dK and dV of the block onto the pair's, scaled: the output rows on the group's last head, stored then,
    else the fp32 sums (added on GpSimd, which cannot read PSUM: VectorE makes dS). Then dQ of the tile from
    this block into the head's SBUF sum, opened by the tile's first block: after its diagonal block, its last,
    scaled and stored."""
    i, chunks, n_chunks = query_tile, kernel.chunks, dscores.shape[1] // TILE
    dscores_t = nl.ndarray((TILE, n_chunks, TILE), dtype=dscores.dtype, buffer=nl.psum)
    for c in range(n_chunks):
        nisa.nc_transpose(dst=dscores_t[:, c, :], data=dscores[:, c * TILE:(c + 1) * TILE])
    dscores_t_sbuf = nl.ndarray(dscores_t.shape, dtype=dscores.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=dscores_t_sbuf, src=dscores_t)
    first_head, last_head = kernel.h % kernel.group == 0, kernel.h % kernel.group == kernel.group - 1
    for g in range(2 if block_last else 0):  # dK, dV: on the block's last tile
        rows, sums = (kernel.dk_rows, kernel.dv_rows)[g], (kernel.dk_sum, kernel.dv_sum)[g]
        block = (kernel.block_dk, kernel.block_dv)[g]
        for c in range(chunks.start, chunks.stop):
            target = rows[:, c, :] if last_head else sums[:, c, :]
            scaled = target if first_head else nl.ndarray(target.shape, dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=scaled, op=nl.copy, data=block[c - chunks.start], scale=(kernel.scale, 1.0)[g])
            if not first_head:
                nisa.tensor_tensor(dst=target, data1=scaled, data2=sums[:, c, :], op=nl.add,
                                   engine=nisa.engine.gpsimd)
            if last_head:
                nisa.dma_copy(dst=(kernel.dk, kernel.dv)[g][kernel.b, kernel.kv_head, c * TILE:(c + 1) * TILE, :],
                              src=target)
    dq_block = nl.ndarray((TILE, kernel.q.shape[3]), dtype=nl.float32, buffer=nl.psum)
    for c in range(n_chunks):
        nisa.nc_matmul(dst=dq_block, stationary=dscores_t_sbuf[:, c, :],
                       moving=kernel.k_rows[:, first // TILE + c, :], accumulate=c > 0)
    row = kernel.dq_acc[:, i, :]
    if first == max(0, i * TILE - kernel.window):  # the tile's first block: its dQ sum starts here
        nisa.tensor_copy(dst=row, src=dq_block)
    else:
        nisa.tensor_tensor(dst=row, data1=row, data2=dq_block, op=nl.add)
    if chunks.start <= i < chunks.stop:  # the tile's diagonal block, its last: dQ is final
        dq_tile = nl.ndarray(row.shape, dtype=kernel.dq.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=dq_tile, data=row, op0=nl.multiply, operand0=kernel.scale)
        nisa.dma_copy(dst=kernel.dq[kernel.b, kernel.h, i * TILE:(i + 1) * TILE, :], src=dq_tile)


def flash_attention_bwd_kernel(q, k, v, out, d_out, lse, scale, window):
    """Causal flash attention backward, grouped-query heads, optionally in a sliding window: dQ, dK, dV.

    Inputs (HBM): q, k, v, scale, window as for flash_attention_fwd_kernel; out (B, H, S, d) and lse
    (B, H, 128, S/128) from it; d_out (B, H, S, d). Returns dq (B, H, S, d), dk and dv (B, Hkv, S, d) in the
    input dtype, dk and dv summed over the G query heads of each kv head. Limits: the forward's (asserted at
    entry, `_limits_and_mask`), and SBUF's: ~42 S*d/128 bytes per partition in bf16 (68 in fp32), so
    S*d <= 4096*128 in bf16 and 2048*128 in fp32 (`_attention_shape_problem`).

    Work, in plain nested loops (nki-library's attention_bwd.py loops in natural order too; docs/results.md
    compares a software pipeline): (batch, kv head) pairs split over the LNC programs. Per pair: K rows (for
    dQ) and cols (for scores), V cols (for dP), cols made by TensorE transposes. Per query head: Q and dO rows
    and cols, -lse, -D = -rowsum(dO * O) (product on GpSimd, idle otherwise, sum on VectorE), an fp32 dQ
    accumulator. Per key block (<= 512 keys), the 128-query tiles that see it, one after another (chunks nobody
    sees skipped): P = exp(scale * q.T k - lse) (ScalarE from PSUM), dP = dO V^T, dS = P * (dP - D)
    (`_bwd_scores`); dV += P^T dO and dK += dS^T Q accumulate in PSUM over the query tiles, dQ += dS K needs
    dS transposed (TensorE, copied out by VectorE) and is added into SBUF (`_bwd_dq`). The softmax scale is
    applied when dQ and dK are written; a pair's first head writes dK and dV from PSUM, later ones add onto
    them (ScalarE copy, GpSimd add), the last in the input dtype. A tile's dQ is stored after its diagonal
    block, a block's dK, dV once final.

    SBUF per partition, per S*d/128 elements, bf16: per pair K rows + cols, V cols, dK, dV rows 2 bytes
    each (with G > 1 fp32 sums, 8); per head Q, dO rows + cols 2 each, dQ 4, two heads at a time: 42 bytes
    plus ~6 KiB, 178,176 at S = 4096, d = 128 (SBUF_BUDGET 196,608). PSUM, whole 2 KiB banks: scores, dP,
    dS^T, dQ (or a head's transposes) one each, dK and dV one each at d = 128, two at d = 256: at most 8 of 8.
    """
    batch, n_heads, seq_len, head_dim = q.shape
    n_kv_heads, n_tiles, dtype = k.shape[1], seq_len // TILE, q.dtype
    rows = (TILE, n_tiles, head_dim)
    kernel = AttentionBwd(q=q, scale=scale, group=n_heads // n_kv_heads,
                          dq=nl.ndarray((batch, n_heads, seq_len, head_dim), dtype=dtype, buffer=nl.shared_hbm),
                          dk=nl.ndarray((batch, n_kv_heads, seq_len, head_dim), dtype=dtype, buffer=nl.shared_hbm),
                          dv=nl.ndarray((batch, n_kv_heads, seq_len, head_dim), dtype=dtype, buffer=nl.shared_hbm))
    _limits_and_mask(kernel, k, window)
    for pair in range(nl.program_id(0), batch * n_kv_heads, nl.num_programs(0)):
        b, kv_head = divmod(pair, n_kv_heads)
        kernel.b = b
        kernel.kv_head = kv_head
        kernel.k_rows = _load_rows(k, b, kv_head, dtype)
        kernel.k_cols = _load_cols(k, b, kv_head, dtype, kernel.k_rows, False)
        kernel.v_cols = _load_cols(v, b, kv_head, dtype)
        kernel.dk_rows = nl.ndarray(rows, dtype=dtype, buffer=nl.sbuf)
        kernel.dv_rows = nl.ndarray(rows, dtype=dtype, buffer=nl.sbuf)
        if kernel.group > 1:
            kernel.dk_sum = nl.ndarray(rows, dtype=nl.float32, buffer=nl.sbuf)
            kernel.dv_sum = nl.ndarray(rows, dtype=nl.float32, buffer=nl.sbuf)
        for h in range(kv_head * kernel.group, (kv_head + 1) * kernel.group):
            kernel.h = h
            kernel.q_rows = _load_rows(q, b, h, dtype)
            kernel.q_cols = _load_cols(q, b, h, dtype, kernel.q_rows, False)
            kernel.do_rows = _load_rows(d_out, b, h, dtype)
            kernel.do_cols = _load_cols(d_out, b, h, dtype, kernel.do_rows, True)
            lse_tile = nl.ndarray((TILE, n_tiles), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=lse_tile, src=lse[b, h, :, :])
            kernel.neg_lse = nl.ndarray((TILE, n_tiles), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=kernel.neg_lse, data=lse_tile, op0=nl.multiply, operand0=-1.0)
            out_rows = _load_rows(out, b, h, dtype)
            kernel.neg_delta = nl.ndarray((TILE, n_tiles), dtype=nl.float32, buffer=nl.sbuf)
            for first in range(0, n_tiles, 2):
                tiles = slice(first, min(first + 2, n_tiles))
                products = nl.ndarray((TILE, tiles.stop - first, head_dim), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=products, data1=kernel.do_rows[:, tiles, :], data2=out_rows[:, tiles, :],
                                   op=nl.multiply, engine=nisa.engine.gpsimd)
                nisa.tensor_reduce(dst=kernel.neg_delta[:, tiles], op=nl.add, data=products, axis=2, negate=True)
            kernel.dq_acc = nl.ndarray(rows, dtype=nl.float32, buffer=nl.sbuf)
            for start in range(0, seq_len, KEY_BLOCK):
                kernel.chunks = slice(start // TILE, min(start + KEY_BLOCK, seq_len) // TILE)
                tiles_stop = min(n_tiles, kernel.chunks.stop + window // TILE)
                for i in range(kernel.chunks.start, tiles_stop):  # the query tiles that see the block
                    first = max(start, i * TILE - window)
                    width = min(start + KEY_BLOCK, (i + 1) * TILE) - first
                    _bwd_dq(kernel, i, first, _bwd_scores(kernel, i, first, width), i == tiles_stop - 1)
    return kernel.dq, kernel.dk, kernel.dv


# attention: the PyTorch ops around the kernels, the PyTorch path, the shape rule, the checks


def _attention_shape_problem(q, k, v, window=None):
    """None when the attention kernels take these tensors and window (`attention`'s); else what is wrong and
    how to fix it."""
    batch, n_heads, seq_len, head_dim = q.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[2:] != q.shape[2:] or n_heads % k.shape[1]:
        return (f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not causal self-attention "
                "shapes (B, H, T, D) and (B, Hkv, T, D) with Hkv dividing H")
    if head_dim > ATTENTION_MAX_HEAD_DIM or (head_dim > TILE and head_dim % 2):
        return (f"head_dim={head_dim} is not one the kernels take: up to {ATTENTION_MAX_HEAD_DIM} (contracted in "
                "two 128-partition pieces), and even above 128; use such a head_dim")
    # The sequence length varies from call to call (generation, short evaluations), so these messages do
    # not quote it: "auto" logs each distinct reason once.
    if seq_len % TILE:
        return "the sequence length is not a multiple of 128, the kernels' tile; use such a sequence_len"
    if q.dtype not in (torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q, k, v are {q.dtype}, {k.dtype}, {v.dtype}; the kernels take all bfloat16 or all float32"
    if window is not None and (window < TILE or window % TILE):
        return (f"window={window} is not a multiple of 128 keys, the kernels' tile (they skip or mask whole "
                "128-key chunks); use such a window (window_pattern's S windows are)")
    # the backward's SBUF plan (its docstring), per S*d/128 elements: 13 bytes per input-dtype byte (two query
    # heads' Q, dO rows and cols; the pair's K rows and cols, V cols, dK and dV rows) and 16 (dQ, fp32 dK, dV
    # sums), plus 6 KiB of per-block tiles. The forward needs less.
    if seq_len * head_dim // TILE * (13 * q.element_size() + 16) + 6 * 1024 > SBUF_BUDGET:
        return (f"the sequence length is over what the backward kernel's SBUF plan holds at head_dim={head_dim} "
                "(sequence_len x head_dim up to 4096 x 128 in bfloat16, 2048 x 128 in float32: K, V, Q, dO, O "
                "and the fp32 dQ, dK, dV of a head stay on chip); use a shorter sequence_len or a smaller head_dim")
    return None


def _flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             scale: float, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _run_kernel(flash_attention_fwd_kernel, q, k, v, scale, window)


def _flash_attention_forward_fake(q, k, v, scale, window):
    batch, n_heads, seq_len, head_dim = q.shape
    return (q.new_empty(batch, n_heads, seq_len, head_dim),
            q.new_empty(batch, n_heads, TILE, seq_len // TILE, dtype=torch.float32))


def _flash_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                              d_out: torch.Tensor, lse: torch.Tensor, scale: float,
                              window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _run_kernel(flash_attention_bwd_kernel, q, k, v, out, d_out, lse, scale, window)


def _flash_attention_backward_fake(q, k, v, out, d_out, lse, scale, window):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _flash_attention_setup_context(ctx, inputs, output):
    q, k, v, scale, window = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.mark_non_differentiable(lse)  # an output only for the backward's sake
    ctx.scale, ctx.window = scale, window


def _flash_attention_vjp(backward_op, ctx, d_out, d_lse):  # d_lse: None, lse is non-differentiable
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = backward_op(q, k, v, out, d_out.to(out.dtype), lse, ctx.scale, ctx.window)
    return dq, dk, dv, None, None


if nki is not None:
    _flash_attention = _register_kernel_ops(
        "flash_attention", _flash_attention_forward, _flash_attention_forward_fake, _flash_attention_backward,
        _flash_attention_backward_fake, _flash_attention_setup_context, _flash_attention_vjp)


CPU_QUERY_BLOCK = 64  # queries per block; at T=256, d=64 on an AVX2 EPYC, fwd+bwd of a layer (B=8, H=2)
# took 7.8 ms with blocks of 64, 8.4 with 32, 8.0 with 128, and 10.4 ms in SDPA's flash kernel
CPU_BLOCK_ATTENTION_MAX_LEN = 2048  # measured faster than SDPA up to here (x1.4 at T=256, x1.1 at 2048); it
# keeps T*T/2 probabilities per head for backward, so longer contexts use SDPA's O(T) memory
def _cpu_query_blocks(seq_len, window):
    """(start, end, first key) of each block of CPU_QUERY_BLOCK queries: the keys it scores are first .. end."""
    for start in range(0, seq_len, CPU_QUERY_BLOCK):
        yield start, min(start + CPU_QUERY_BLOCK, seq_len), 0 if window is None else max(0, start - window)


class BlockCausalAttention(torch.autograd.Function):
    """Exact causal attention for short contexts on CPU, optionally in a sliding window (`attention`'s).
    SDPA's flash kernel keeps only the logsumexp and recomputes scores and softmax in backward; at short T
    memory is cheap and the recomputation is not. Queries go in blocks of CPU_QUERY_BLOCK; block i scores
    only the keys from its first query's window start to its own end, with one batched matmul over all
    batch x heads, so masked scores are computed only on the diagonal blocks and the blocks where a window
    starts, and the softmax of every block is kept for backward (T x T / 2 floats per head without a
    window: 2 MB a layer at B=8, H=2, T=256).

    q, k, v: (B, H, T, d), H equal for all three (GQA expands k and v first). `attention` uses it for
    fp32 on CPU; bf16 stays on SDPA, whose speed against this on bf16 hardware has not been measured.
    Backward is the flash-attention identity dS = P * (dP - rowsum(dO * O)).
    """

    @staticmethod
    def forward(ctx, q, k, v, window):
        shape, (T, d) = q.shape, q.shape[-2:]
        scale = d ** -0.5
        q, k, v = (q * scale).reshape(-1, T, d), k.reshape(-1, T, d), v.reshape(-1, T, d)
        block = CPU_QUERY_BLOCK
        above_diagonal = torch.full((block, block), -math.inf, dtype=q.dtype, device=q.device).triu_(1)
        before_window = above_diagonal.mT.contiguous()  # from where query 0's window starts: key c < query r
        probs, outs = [], []
        for start, end, first in _cpu_query_blocks(T, window):
            rows = end - start
            scores = torch.bmm(q[:, start:end], k[:, first:end].mT)  # (B*H, rows, keys first .. end)
            scores[:, :, start - first:] += above_diagonal[:rows, :rows]
            edge = None if window is None else start - window  # where the block's first query's window starts
            if edge is not None and edge + rows > 0:
                cut = max(0, -edge)  # the edge tile's columns before key 0
                scores[:, :, edge + cut - first:edge + rows - first] += before_window[:rows, cut:rows]
            p = torch.softmax(scores, dim=-1)
            probs.append(p)
            outs.append(torch.bmm(p, v[:, first:end]))
        out = torch.cat(outs, dim=1)
        ctx.save_for_backward(q, k, v, out, *probs)
        ctx.shape, ctx.window = shape, window
        return out.view(shape)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, *probs = ctx.saved_tensors  # q is pre-scaled, so dK needs no scale
        T, d = q.shape[-2:]
        d_out = d_out.reshape(out.shape)
        d_out_dot_out = (d_out * out).sum(dim=-1, keepdim=True)  # rowsum(P * dP), per query
        dq_blocks, dk, dv = [], torch.zeros_like(k), torch.zeros_like(v)
        for p, (start, end, first) in zip(probs, _cpu_query_blocks(T, ctx.window)):
            d_out_block = d_out[:, start:end]
            dv[:, first:end].baddbmm_(p.mT, d_out_block)
            d_scores = torch.bmm(d_out_block, v[:, first:end].mT).sub_(d_out_dot_out[:, start:end]).mul_(p)
            dq_blocks.append(torch.bmm(d_scores, k[:, first:end]))
            dk[:, first:end].baddbmm_(d_scores.mT, q[:, start:end])
        dq = torch.cat(dq_blocks, dim=1).mul_(d ** -0.5)
        return dq.view(ctx.shape), dk.view(ctx.shape), dv.view(ctx.shape), None


def _attention_nki(q, k, v, window):
    # as they come, no copies in the graph: the kernels change layouts on chip, and _run_kernel makes
    # v (the model's transposed view of a (B, T, Hkv, D) tensor) dense inside the op
    seq_len = q.size(-2)
    out, _ = _flash_attention(q, k, v, 1.0 / math.sqrt(q.size(-1)), seq_len if window is None else window)
    return out


def _attention_torch(q, k, v, window):
    seq_len = q.size(-2)
    if q.device.type == "cpu" and q.dtype == torch.float32 and seq_len <= CPU_BLOCK_ATTENTION_MAX_LEN:
        groups = q.size(1) // k.size(1)
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return BlockCausalAttention.apply(q, k, v, window)
    mask = None
    if window is not None:  # key j visible to query i: i - window <= j <= i
        distance = torch.arange(seq_len, device=q.device)[:, None] - torch.arange(seq_len, device=q.device)
        mask = (distance >= 0) & (distance <= window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                          enable_gqa=k.size(1) != q.size(1))


def _heads_in_words(a):
    return f"{a.n_head}:{a.n_kv_head} heads of {a.head_dim}, T {a.seq_len}, batch {a.batch}"


def _attention_check_cases(shapes, dtype, device, generator):
    """One case per attention shape."""
    draw = _drawing(dtype, device, generator)
    return [CheckCase("attention", "attention",
                      _heads_in_words(a) + (f", window {a.window}" if a.window is not None else ""),
                      lambda a=a: (draw(a.batch, a.n_head, a.seq_len, a.head_dim),
                                   draw(a.batch, a.n_kv_head, a.seq_len, a.head_dim),
                                   draw(a.batch, a.n_kv_head, a.seq_len, a.head_dim)),
                      lambda q, k, v, mode, a=a: attention(q, k, v, mode=mode, window=a.window))
            for a in shapes.attention]


def _attention_model_cases(c, batch_size, device, dtype):
    """The causal half of q k^T and p v forward; the backward recomputes P: 5 matmuls to the forward's 2."""
    draw = _model_drawing(device, dtype)
    B, T, D = batch_size, c.sequence_len, c.head_dim
    flops = 2 * B * c.n_head * T * T * D
    return [("attention", flops, 3.5 * flops,
             lambda: (draw(B, c.n_head, T, D), draw(B, c.n_kv_head, T, D), draw(B, c.n_kv_head, T, D)),
             lambda q, k, v, mode, window=None: attention(q, k, v, mode=mode, window=window))]


def _attention_plain_ops(c, sequences, elements, plain):
    """Full T x T scores: q k^T and p v forward, then mask, max, exp, normalise, cast; backward dP (a q k^T),
    dV, dQ, dK (p v's) and 2 passes over the scores."""
    T, H, D = c.sequence_len, c.n_head, c.head_dim
    scores = sequences * H * T * T
    qk, pv = plain.gemm(T, D, T, sequences * H), plain.gemm(T, T, D, sequences * H)
    return {"forward": [qk, pv, plain.passes(scores, one_input=3, two_input=1, scalar=1)],
            "backward": [qk, pv, pv, pv, plain.passes(scores, one_input=1, two_input=1)]}


ATTENTION_OP = _declare(KernelOp(
    name="attention", call=attention,
    kernels=(flash_attention_fwd_kernel, flash_attention_bwd_kernel),
    torch_path=_attention_torch, shape_problem=_attention_shape_problem, cost_problem=None,
    check_cases=_attention_check_cases, model_cases=_attention_model_cases, plain_ops=_attention_plain_ops,
    kill_matrix=("attention",),
    tests="test_attention_kernels.py"))


# =============================================================================
# mlp: y = act(x @ w_up.T) @ w_down.T, forward and backward
#
# Both kernels sweep the hidden units in chunks of whole 128-unit tiles, as many as SBUF holds (the glue
# picks the chunk, _mlp_chunk_tiles): a chunk's weights are loaded once and stay on chip while all of
# the program's tokens stream past, so HBM sees each weight once per call. What sums over the hidden
# units (y forward, dx backward) sums over a chunk in PSUM; with several chunks each chunk adds its share
# to an fp32 partial sum in HBM (_finish_rows) and the last writes the result. What sums over the tokens
# (the weight gradients) accumulates over a block's tokens in PSUM, then in fp32 SBUF over the blocks,
# and leaves the chip once per weight tile, at the end of its chunk.


def mlp(x, w_up, w_down, activation, w_gate=None, mode="auto"):
    """y = act(x @ w_up.T) @ w_down.T, weights in nn.Linear layout (out_features, in_features).

    activation: "relu2" (relu(h)^2), "leaky_relu2" (leaky_relu(h, LEAKY_RELU2_SLOPE)^2), "gelu" (tanh
    approximation) or "swiglu" (silu(x @ w_gate.T) * (x @ w_up.T); needs w_gate). Matmuls run in the
    autocast dtype where autocast is on, as F.linear's do. The NKI kernels (mlp_fwd_kernel, mlp_bwd_kernel)
    take x as (tokens, d), d and hidden multiples of 128 with d <= 2048, the same shapes with and without
    gradients (_mlp_shape_problem).
    """
    if activation not in MLP_ACTIVATIONS:
        raise ValueError(f"unknown MLP activation {activation!r}; choose one of {MLP_ACTIVATIONS}")
    if (activation == "swiglu") != (w_gate is not None):
        raise ValueError(f"activation {activation!r} {'needs' if activation == 'swiglu' else 'takes no'} w_gate")
    device = x.device.type  # the dtype F.linear would multiply in: autocast's where it is on, else x's
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    if _use_nki(MLP_OP.name, mode, device, _mlp_shape_problem(x, w_up, dtype),
                _mlp_cost_problem(x.numel() // x.size(-1), x.size(-1), w_gate is not None)):
        return _mlp_nki(x, w_up, w_down, activation, w_gate, dtype)
    return _mlp_torch(x, w_up, w_down, activation, w_gate)


MLP_ACTIVATIONS = ("relu2", "leaky_relu2", "gelu", "swiglu")
MLP_BLOCK_TOKENS = 512  # tokens per forward block: the widest matmul moving operand
LEAKY_RELU2_SLOPE = 0.35  # leaky_relu2: (x if x > 0 else 0.35 x)^2


def mlp_fwd_kernel(x, w_up, w_down, w_gate, activation, save_preactivation, chunk_tiles):
    """MLP forward on one NeuronCore (or, launched as kernel[2], half of the tokens on each core).

    x (N, d); w_up, w_gate (hidden, d) and w_down (d, hidden) in nn.Linear layout, all one dtype (bf16
    for speed; fp32 runs fp32 matmuls, 4x slower on TensorE); w_gate is None unless activation is
    "swiglu". Returns y (N, d) in x's dtype and, when save_preactivation, the pre-activations for the
    backward: x @ w_up.T (and x @ w_gate.T) as (hidden, N) arrays, the layout the kernel computes them in.
    chunk_tiles: hidden tiles (128 units) per chunk, from _mlp_chunk_tiles. Limits: those of
    _mlp_shape_problem (d <= 2048, as the backward); any N (a program with no tokens issues nothing).

    Layout: per chunk, w_up[chunk].T (and w_gate's) as d/128 tiles [128 of d, chunk units] and w_down[:, chunk].T as
    tiles [128 units, d], transposed on TensorE once per chunk, 512 units at a time as the chunk's first block
    reaches them (TensorE starts on the first 512 units while the DMA brings the next). Per block of 512 tokens, x.T
    (d/128 tiles [128, 512], TensorE transposes, four per PSUM bank); then for each hidden tile of the chunk hT =
    w_up.T[:, tile].T @ x.T, a [128 units, 512 tokens] PSUM bank (stationary 128 x 128, moving 512 wide, contracting
    d over 128-row tiles), activated straight out of PSUM into SBUF in the matmul dtype. act.T stays in SBUF for the
    whole block: it is exactly the stationary operand the down projection wants, y[128 tokens, <=512 of d] +=
    act.T[128 units, 128 tokens].T @ w_down.T[128 units, <=512], so the hidden activation never goes to HBM (unless
    saved for the backward) and needs no transpose. With several chunks each adds its share of y to an fp32 partial
    sum in HBM (_finish_rows).

    SBUF per partition (_mlp_chunk_tiles): per hidden tile of a chunk, (2, or 3 for SwiGLU) * d * itemsize of weights
    and 512 * itemsize of act.T; plus x.T of a block (4 d itemsize), fp32 activation scratch and y's rows. bf16:
    d=640, hidden=2560 (baseline) and d=1024, hidden=4096 (K82s4) in one chunk (20 and 32 tiles); d=1536,
    hidden=6144 (phase2) in 3 chunks of 16. Every plan is within SBUF_BUDGET (196,608), under the 212,984 bytes
    usable on a Trn2 partition. PSUM: one bank per live hidden tile (two for SwiGLU), the transposes' bank and up to
    four banks of y.

    Engines, per hidden tile and 512-token block: TensorE 8 d cycles of matmul (12 d for SwiGLU), all
    128-deep with 512-wide moving operands but the down projection's when d is not a multiple of 512;
    ScalarE and VectorE each at most two [128, 512] passes (the activation: relu2 relu on ScalarE and
    relu(u) * u on VectorE reading u from PSUM; leaky_relu2 a u on ScalarE's free scale, the max on
    VectorE, the square on ScalarE; the saved pre-activation's PSUM eviction on the less busy one).
    """
    assert x.shape[1] % TILE == 0 and w_up.shape[0] % TILE == 0 and x.shape[1] <= 4 * BANK_FP32, \
        "d and hidden must be multiples of 128, d at most 2048"
    n_tokens, dim = x.shape
    hidden = w_up.shape[0]
    weights = [w_up, w_gate] if w_gate is not None else [w_up]
    y = nl.ndarray((n_tokens, dim), x.dtype, buffer=nl.shared_hbm)
    saved = []  # with save_preactivation: x @ w.T of each of `weights`, (hidden, N)
    for _ in range(len(weights) if save_preactivation else 0):
        saved.append(nl.ndarray((hidden, n_tokens), x.dtype, buffer=nl.shared_hbm))
    program_start, program_stop = _program_rows(n_tokens)
    chunks = _spans(0, hidden // TILE, chunk_tiles, even=True)
    partial = None  # this program's rows of y in fp32 while several chunks add their shares
    if len(chunks) > 1:
        partial = nl.ndarray((max(1, program_stop - program_start), dim), nl.float32, buffer=nl.private_hbm)
    save_on_scalar = [activation in ("relu2", "swiglu"), False]  # per saved output: the engine less busy
    for k in range(len(chunks)):
        first_tile, tiles = chunks[k]
        units = slice(first_tile * TILE, (first_tile + tiles) * TILE)
        weights_t = []  # w_up's (and w_gate's) d/128 tiles [128, chunk units]
        for _ in weights:
            weights_t.append(_sbuf_tiles(dim // TILE, (TILE, tiles * TILE), w_up.dtype))
        w_down_t = []  # chunk tiles [128 units, d]
        blocks = _spans(program_start, program_stop, MLP_BLOCK_TOKENS)
        for b in range(len(blocks)):
            block_start, block_tokens = blocks[b]
            block = slice(block_start, block_start + block_tokens)
            x_t = _sbuf_tiles(dim // TILE, (TILE, block_tokens), x.dtype)
            _transpose_pieces_into(x_t, 0, _load_row_pieces(x, block_start, block_tokens, slice(0, dim)))
            act_t = []  # the chunk's tiles [128 units, block_tokens] of the block's hidden activation
            for j in range(tiles):
                tile = slice(j * TILE, (j + 1) * TILE)
                if b == 0 and tile.start % BANK_FP32 == 0:  # the next 512 units' weights, as the first block needs them
                    w_down_t += _mlp_load_weight_group(weights, w_down, weights_t, units, tile.start)
                pre = []  # x @ w.T of each of `weights` for this tile: fp32 PSUM [128 units, block tokens]
                for w in range(len(weights)):
                    pre.append(_matmul_into_psum(weights_t[w], x_t, stationary_cols=tile))
                for w in range(len(saved)):  # staged in SBUF: DMA cannot read PSUM
                    staged = nl.ndarray(pre[w].shape, x.dtype, buffer=nl.sbuf)
                    _evict(staged, pre[w], save_on_scalar[w])
                    nisa.dma_copy(dst=saved[w][units.start + tile.start:units.start + tile.stop, block], src=staged)
                act_t.append(_mlp_activation(activation, pre, x.dtype))
            _mlp_down_projection(y, partial, act_t, w_down_t, block, program_start, k, len(chunks))
    if len(saved) == 0:
        return y  # one output: TorchNeuron hands it back bare
    if len(saved) == 2:
        return y, saved[0], saved[1]
    return y, saved[0]


def _mlp_load_weight_group(weights, w_down, weights_t, units, start):
    """The chunk's (`units`') next <= 512 hidden units' weights, from its unit `start`, into SBUF: w_up's (and
    w_gate's) transposed into columns start.. of weights_t (d/128 tiles [128, chunk units]); returns
    w_down[:, group].T as tiles [128 units, d]."""
    dim = w_down.shape[0]
    group = slice(units.start + start, min(units.start + start + BANK_FP32, units.stop))
    for w in range(len(weights)):
        _transpose_pieces_into(weights_t[w], start, _load_row_pieces(
            weights[w], group.start, group.stop - group.start, slice(0, dim)))
    w_down_group = _sbuf_tiles((group.stop - group.start) // TILE, (TILE, dim), w_down.dtype)
    for d_rows in _spans(0, dim, BANK_FP32):  # w_down[:, group].T, 512 rows of d at a time
        _transpose_pieces_into(w_down_group, d_rows[0], _load_row_pieces(w_down, d_rows[0], d_rows[1], group))
    return w_down_group


def _mlp_down_projection(y, partial, act_t, w_down_t, block, program_start, chunk, n_chunks):
    """One chunk's share of y[block]: per 128 tokens, act_t (tiles [128 units, tokens]).T @ w_down_t ([128, d])."""
    for piece in _spans(0, block.stop - block.start, TILE):
        offset, tokens = piece
        sums = []  # this chunk's share of y for the piece's tokens, one PSUM bank per 512 columns
        for columns in _spans(0, y.shape[1], BANK_FP32):
            sums.append(_matmul_into_psum(act_t, w_down_t, slice(offset, offset + tokens),
                                          slice(columns[0], columns[0] + columns[1])))
        rows = slice(block.start + offset, block.start + offset + tokens)
        _finish_rows(y, partial, rows, program_start, sums, chunk, n_chunks, offset // TILE)


def _finish_rows(dst, partial, rows, program_start, sums, chunk, chunks, turn):
    """Chunk number `chunk` of `chunks` hands over its share of dst[rows, :], the fp32 PSUM tiles `sums`
    (one per 512 columns). One chunk: dst[rows] = sums. Several: the first stores its share in the fp32
    `partial`, the later ones add what is there (VectorE, reading PSUM), and the last writes dst. Plain
    evictions alternate between VectorE and ScalarE (by `turn` and column)."""
    dim = dst.shape[1]
    last = chunk == chunks - 1
    local = slice(rows.start - program_start, rows.stop - program_start)
    out = nl.ndarray((rows.stop - rows.start, dim), dst.dtype if last else nl.float32, buffer=nl.sbuf)
    previous = _load_tile(partial, local, slice(0, dim)) if chunk > 0 else None
    col = 0
    for c in range(len(sums)):
        cols = slice(col, col + sums[c].shape[1])
        if previous is not None:
            nisa.tensor_tensor(dst=out[:, cols], data1=sums[c], data2=previous[:, cols], op=nl.add)
        else:
            _evict(out[:, cols], sums[c], (turn + c) % 2)
        col = cols.stop
    nisa.dma_copy(dst=dst[rows, :] if last else partial[local, :], src=out)


def _mlp_activation(activation, pre, dtype):
    """act of one [128, tokens] tile of pre-activations, pre = [up] or, for SwiGLU, [up, gate] (fp32 PSUM),
    into SBUF in `dtype`. Every VectorE instruction here reads one operand from PSUM, which runs it at one
    element per cycle (fp32 SBUF operands on both sides would take two)."""
    up = pre[0]
    act = nl.ndarray(up.shape, dtype, buffer=nl.sbuf)
    if activation == "gelu":
        nisa.activation(dst=act, op=nl.gelu_apprx_tanh, data=up)
    elif activation == "relu2":  # relu(u) * u = relu(u)^2
        relu = nl.ndarray(up.shape, nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=relu, op=nl.relu, data=up)
        nisa.tensor_tensor(dst=act, data1=relu, data2=up, op=nl.multiply)
    elif activation == "leaky_relu2":  # leaky(u) = max(u, slope u) for 0 < slope < 1; then squared
        scaled = nl.ndarray(up.shape, nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=scaled, op=nl.copy, data=up, scale=LEAKY_RELU2_SLOPE)
        leaky = nl.ndarray(up.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=leaky, data1=scaled, data2=up, op=nl.maximum)
        nisa.activation(dst=act, op=nl.square, data=leaky)
    else:  # swiglu: silu(gate) * up
        silu = nl.ndarray(up.shape, nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=silu, op=nl.silu, data=pre[1])
        nisa.tensor_tensor(dst=act, data1=silu, data2=up, op=nl.multiply)
    return act


def _mlp_bwd_block_tokens(dim):
    """Tokens per backward block: dx for the whole block stays in PSUM while a chunk's hidden tiles
    are swept, 128 tokens x <=512 of d per bank, and we give it at most 4 of the 8 banks."""
    return TILE * (4 // math.ceil(dim / BANK_FP32))


def mlp_bwd_kernel(dy, x, w_up, w_down, w_gate, up_saved, gate_saved, activation, chunk_tiles):
    """MLP backward from the pre-activations the forward saved (gate_saved, like w_gate, None unless
    SwiGLU). dy, x (N, d); weights as in the forward; up_saved, gate_saved (hidden, N); chunk_tiles:
    hidden tiles per chunk (_mlp_chunk_tiles).

    Returns dx (N, d) in x's dtype and per-program partial weight gradients in fp32, which the caller
    sums over the first axis: dw_up (and dw_gate) (programs, hidden, d) and dw_down TRANSPOSED,
    (programs, hidden, d). Each program (core) takes a contiguous share of the tokens, so each holds only
    its share of the weight gradients, and no core waits for the other.

    Saving versus recomputing the pre-activation: we save it (hidden x N in the matmul dtype per MLP,
    twice for SwiGLU). Recomputing it would cost one more up (and gate) projection in the backward,
    about +20% TensorE work, for memory that HBM (24 GiB per logical core) has to spare at this scale.

    Per chunk of hidden units, its weights load once: w_down[:, chunk] as d/128 stationary tiles
    [128 of d, chunk units], w_up[chunk] (and w_gate's) as tiles [128 units, d]. Then per block of B
    tokens (512 for d <= 512, 256 for d <= 1024, 128 for d <= 2048: dx of the block fills at most 4
    PSUM banks) and hidden tile j of the chunk:
      daT[j, tokens]   = sum over 128-row tiles c of w_down[c, j].T @ dyT[c, tokens]   (PSUM, one bank)
      dhT              = daT * act'(hT)   from the saved hT, on ScalarE/VectorE, SBUF
      dx[tokens, :]   += dhT[j, 128 tokens].T @ w_up[j, :]  in PSUM over the chunk's hidden tiles
      dw_up[j, :]     += dh[tokens, j].T @ x[tokens, :]    in PSUM over the block's 128-token pieces,
      dw_down.T[j, :] += act[tokens, j].T @ dy[tokens, :]  then into the chunk's fp32 SBUF tiles
    The weight gradients contract over tokens, so dhT and actT are flipped on TensorE (128x128 each).
    dx leaves per block (_finish_rows: through an fp32 partial sum in HBM when there are several
    chunks); each chunk's weight gradients leave once, one DMA per 128-unit tile.

    SBUF per partition (_mlp_chunk_tiles): per hidden tile of a chunk, (2, or 3) * d * (itemsize + 4) (weights and
    fp32 accumulators); plus dy, dy.T and x of a block and the next block's dy and x (5 B d itemsize / 128: the
    compiler may overlap blocks), the elementwise and flipped tiles of three tiles, dx's rows. bf16:
    d=640, hidden=2560 (baseline) in one chunk of 20 tiles; d=1024, hidden=4096 (K82s4) in 3 chunks of 11, 11, 10;
    d=1536, hidden=6144 (phase2) in 6 chunks of 8 (SwiGLU: 10 of 5): within SBUF_BUDGET (196,608), under the 212,984
    bytes usable on a Trn2 partition. PSUM: dx (<= 4 banks), daT, the flips and one weight-gradient bank: 7 of 8.
    Limits: those of _mlp_shape_problem (d <= 2048, multiples of 128); any N.

    Engines, per hidden tile and block (B tokens): TensorE 4 matmul groups of 2 B d 128 FLOPs (6 for
    SwiGLU), 4 B d / 128 cycles, plus 2 (3) B/128 flips; VectorE the weight-gradient additions, d
    cycles per gradient (the first block's are ScalarE copies), and one or two one-cycle-per-element
    passes of the activation's derivative (relu2: d_up = 2 relu(u) * daT reading daT from PSUM;
    leaky_relu2: three); ScalarE the flips' evictions and the activation's scaled copies. So VectorE
    runs at about 2 d + 3 B cycles against TensorE's 4 B d / 128 + 2 B at 2.5x its clock: for d >= 512
    TensorE sets the pace.

    Order: per chunk, block after block, hidden tile after hidden tile (`_mlp_bwd_hidden_tile`): the plain
    form (a software pipeline across the tiles was within the model's error of it under the compiler's list
    schedule, docs/results.md).
    """
    assert x.shape[1] % TILE == 0 and w_up.shape[0] % TILE == 0 and x.shape[1] <= 4 * BANK_FP32, \
        "d and hidden must be multiples of 128, d at most 2048"
    n_tokens, dim = x.shape
    hidden = w_up.shape[0]
    programs, program = nl.num_programs(), nl.program_id(0)
    dx = nl.ndarray((n_tokens, dim), x.dtype, buffer=nl.shared_hbm)
    grads = [nl.ndarray((programs, hidden, dim), nl.float32, buffer=nl.shared_hbm),  # dw_up
             nl.ndarray((programs, hidden, dim), nl.float32, buffer=nl.shared_hbm)]  # dw_down, transposed
    if w_gate is not None:
        grads.append(nl.ndarray((programs, hidden, dim), nl.float32, buffer=nl.shared_hbm))  # dw_gate
    program_start, program_stop = _program_rows(n_tokens)
    chunks = _spans(0, hidden // TILE, chunk_tiles, even=True)
    kernel = MlpBwd(dy=dy, x=x, up_saved=up_saved, gate_saved=gate_saved, activation=activation, dx=dx, grads=grads,
                    weights=[w_up, w_gate] if w_gate is not None else [w_up], program_start=program_start,
                    blocks=_spans(program_start, program_stop, _mlp_bwd_block_tokens(dim)), n_chunks=len(chunks))
    if len(chunks) > 1:  # dx's rows of this program in fp32 while several chunks add their shares
        kernel.partial = nl.ndarray((max(1, program_stop - program_start), dim), nl.float32,
                                    buffer=nl.private_hbm)
    if len(kernel.blocks) == 0:  # this program got no tokens (N <= 128 on two cores): its shares are zero
        zeros = nl.ndarray((TILE, dim), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=zeros, value=0.0)
        for g in range(len(grads)):
            for j in range(hidden // TILE):
                nisa.dma_copy(dst=grads[g][program, j * TILE:(j + 1) * TILE, :], src=zeros)
        chunks = []
    for k in range(len(chunks)):
        kernel.chunk = k
        kernel.units = chunks[k][0] * TILE
        kernel.tiles = chunks[k][1]
        kernel.accumulators = []  # per gradient, the chunk's fp32 tiles [128 units, d]
        for _ in grads:
            kernel.accumulators.append(_sbuf_tiles(kernel.tiles, (TILE, dim), nl.float32))
        kernel.weight_rows = [[], []]  # the chunk's rows of w_up (and w_gate), tiles [128 units, d]
        first_block = _mlp_bwd_block(dy, x, kernel.blocks[0])
        kernel.w_down_cols = []  # w_down[:, chunk] as d/128 stationary tiles [128 of d, chunk units]
        for c in range(dim // TILE):
            kernel.w_down_cols.append(_load_tile(w_down, slice(c * TILE, (c + 1) * TILE),
                                                 slice(kernel.units, kernel.units + kernel.tiles * TILE)))
        for b in range(len(kernel.blocks)):
            block = first_block if b == 0 else _mlp_bwd_block(dy, x, kernel.blocks[b])
            for j in range(kernel.tiles):  # tile after tile (docstring: Order)
                _mlp_bwd_hidden_tile(kernel, block, b, j)
    if w_gate is not None:
        return dx, grads[0], grads[1], grads[2]
    return dx, grads[0], grads[1]


class MlpBwd(_NKIObject):
    """What _mlp_bwd_hidden_tile reads; the chunk's fields change from chunk to chunk."""
    dy = None
    x = None
    up_saved = None
    gate_saved = None
    activation = None
    dx = None
    grads = None  # dw_up, dw_down transposed (and dw_gate): (programs, hidden, d) fp32 in HBM
    weights = None  # w_up (and w_gate)
    program_start = None
    blocks = None  # the program's (start, tokens) blocks
    n_chunks = None
    partial = None  # dx's rows in fp32 while several chunks add their shares (_finish_rows)
    chunk = None  # the chunk's index, first hidden unit and 128-unit tiles
    units = None
    tiles = None
    accumulators = None  # per gradient, the chunk's fp32 tiles [128 units, d]
    weight_rows = None  # the chunk's rows of w_up (and w_gate), tiles [128 units, d], loaded by the first block
    w_down_cols = None  # w_down[:, chunk] as d/128 stationary tiles [128 of d, chunk units]


class MlpBwdBlock(_NKIObject):
    """A backward block of tokens (`_mlp_bwd_block`)."""
    rows = None  # a slice of the tokens
    dy = None  # 128-token row pieces
    x = None
    dy_t = None  # d/128 tiles [128, tokens]
    pieces = None  # (offset, tokens) of the row pieces
    columns = None  # (col, width) of the bank-wide column spans
    dx_acc = None  # dx in PSUM: per piece, one tile per column span


def _mlp_bwd_hidden_tile(kernel, block, b, j):
    """Hidden tile j of the chunk for block b (an MlpBwdBlock): daT on TensorE and the activation's derivative
    from the saved pre-activation (ScalarE, VectorE); the flips (TensorE, evicted by ScalarE) and the dx
    matmuls, and after the block's last tile its dx out of PSUM (_finish_rows); the weight-gradient matmuls
    (TensorE) added into the chunk's fp32 tiles (VectorE), each leaving for HBM in the last block. The first
    block loads the weight rows as its tiles need them."""
    saved = slice(kernel.units + j * TILE, kernel.units + (j + 1) * TILE)
    if b == 0:
        for w in range(len(kernel.weights)):
            kernel.weight_rows[w].append(_load_tile(kernel.weights[w], saved, slice(0, kernel.x.shape[1])))
    d_act = _matmul_into_psum(kernel.w_down_cols, block.dy_t, slice(j * TILE, (j + 1) * TILE))
    gate = _load_tile(kernel.gate_saved, saved, block.rows) if kernel.gate_saved is not None else None
    up = _load_tile(kernel.up_saved, saved, block.rows)
    act, scale, d_up, d_gate = _mlp_activation_backward(kernel.activation, up, gate, d_act, kernel.x.dtype)
    d_pre = [d_up, d_gate]
    flips = [_token_major(d_up, block.x, 1.0), _token_major(act, block.dy, scale)]
    for w in range(len(kernel.weights)):
        if w:
            flips.append(_token_major(d_pre[w], block.x, 1.0))
        _accumulate_dx(block, d_pre[w], kernel.weight_rows[w][j], accumulate=j > 0 or w > 0)
    for p in range(len(block.pieces) if j == kernel.tiles - 1 else 0):  # the block's dx is complete
        offset, tokens = block.pieces[p]
        rows = slice(block.rows.start + offset, block.rows.start + offset + tokens)
        _finish_rows(kernel.dx, kernel.partial, rows, kernel.program_start, block.dx_acc[p], kernel.chunk,
                     kernel.n_chunks, p)
    pieces = [block.x, block.dy, block.x]
    for g in range(len(kernel.grads)):
        _accumulate_weight_grad(kernel.accumulators[g][j], flips[g], pieces[g], b == 0)
        if b == len(kernel.blocks) - 1:  # complete
            nisa.dma_copy(dst=kernel.grads[g][nl.program_id(0), saved, :], src=kernel.accumulators[g][j])


def _mlp_bwd_block(dy, x, span):
    """A backward block (MlpBwdBlock): its dy and x as 128-token row pieces, dy.T (d/128 tiles [128, tokens],
    TensorE transposes) and its dx accumulators in PSUM, one tile per 128-token piece and bank-wide column
    span (allocated here, first written by the block's first dx matmuls)."""
    block_start, block_tokens = span
    dim = x.shape[1]
    block = MlpBwdBlock(rows=slice(block_start, block_start + block_tokens),
                        dy=_load_row_pieces(dy, block_start, block_tokens, slice(0, dim)),
                        x=_load_row_pieces(x, block_start, block_tokens, slice(0, dim)),
                        dy_t=_sbuf_tiles(dim // TILE, (TILE, block_tokens), x.dtype),
                        pieces=_spans(0, block_tokens, TILE), columns=_spans(0, dim, BANK_FP32), dx_acc=[])
    _transpose_pieces_into(block.dy_t, 0, block.dy)
    for piece in block.pieces:
        row_of_banks = []
        for columns in block.columns:
            row_of_banks.append(nl.ndarray((piece[1], columns[1]), nl.float32, buffer=nl.psum))
        block.dx_acc.append(row_of_banks)
    return block


def _accumulate_dx(block, d_pre, weight_rows, accumulate):
    """The block's dx accumulators (PSUM) (+)= d_pre[128 hidden, piece's tokens].T @ weight_rows[128 hidden,
    column span]: one hidden tile's share of dx = d_pre.T @ w. `accumulate` False only for the chunk's first."""
    for p in range(len(block.pieces)):
        offset, tokens = block.pieces[p]
        for c in range(len(block.columns)):
            col, width = block.columns[c]
            nisa.nc_matmul(dst=block.dx_acc[p][c], stationary=d_pre[:, offset:offset + tokens],
                           moving=weight_rows[:, col:col + width], accumulate=accumulate)


def _token_major(hidden_t, pieces, scale):
    """scale * hidden_t [128 hidden, tokens] flipped to put its tokens on the partitions, as the weight
    gradients' stationary operands: one [<=128 tokens, 128 hidden] slice per token piece of `pieces`. Up to
    four flips share a PSUM bank and one ScalarE eviction, which applies `scale` for free; only the last
    piece of all may be short."""
    flipped = nl.ndarray((TILE, len(pieces) * TILE), hidden_t.dtype, buffer=nl.psum)
    token_major = nl.ndarray(flipped.shape, hidden_t.dtype, buffer=nl.sbuf)
    stationaries = []
    offset = 0
    full = 0  # columns of the full 128-token pieces, which come first
    for i in range(len(pieces)):
        tokens, slot = pieces[i].shape[0], slice(i * TILE, (i + 1) * TILE)
        nisa.nc_transpose(dst=flipped[:tokens, slot], data=hidden_t[:, offset:offset + tokens])
        stationaries.append(token_major[:tokens, slot])
        offset += tokens
        if tokens == TILE:
            full += TILE
    if full:
        nisa.activation(dst=token_major[:, :full], op=nl.copy, data=flipped[:, :full], scale=scale)
    if full < flipped.shape[1]:
        tokens = pieces[-1].shape[0]
        nisa.activation(dst=token_major[:tokens, full:], op=nl.copy, data=flipped[:tokens, full:], scale=scale)
    return stationaries


def _accumulate_weight_grad(acc, stationaries, pieces, first):
    """acc [128 hidden, d] (fp32 SBUF) (+)= the token-major slices (_token_major) @ the stacked token pieces
    [tokens, d]; `first` (the program's first block) overwrites. The pieces' products accumulate in PSUM,
    then one VectorE add (or, first, a ScalarE copy) per bank."""
    for span in _spans(0, acc.shape[1], BANK_FP32):
        col, width = span
        grad = _matmul_into_psum(stationaries, pieces, moving_cols=slice(col, col + width))
        if first:
            nisa.activation(dst=acc[:, col:col + width], op=nl.copy, data=grad)
        else:
            nisa.tensor_tensor(dst=acc[:, col:col + width], data1=acc[:, col:col + width], data2=grad, op=nl.add)


_GELU_C = math.sqrt(2 / math.pi)  # gelu_tanh(x) = x * sigmoid(2c (x + k x^3))
_GELU_K = 0.044715


def _mlp_activation_backward(activation, up, gate, d_act, dtype):
    """From the saved pre-activations (SBUF [128, tokens]) and dL/d act (fp32 PSUM): act itself (for
    dw_down) as `act_scale` * the returned tile, and the pre-activations' gradients d_up, d_gate (None
    unless SwiGLU), in `dtype`. Intermediates stay fp32 except where said."""
    shape = up.shape
    act = nl.ndarray(shape, dtype, buffer=nl.sbuf)
    d_up = nl.ndarray(shape, dtype, buffer=nl.sbuf)
    d_gate = None
    act_scale = 1.0
    if activation == "relu2":  # act = relu(u)^2 = (2 relu(u) / 2)^2, act' = 2 relu(u): ScalarE's free scales
        relu2x = nl.ndarray(shape, nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=relu2x, op=nl.relu, data=up, scale=2.0)
        nisa.activation(dst=act, op=nl.square, data=relu2x, scale=0.5)
        nisa.tensor_tensor(dst=d_up, data1=relu2x, data2=d_act, op=nl.multiply)
    elif activation == "leaky_relu2":
        # with m = max(u, a^2 u) (0 < a < 1): act = max(u, a u)^2 = u m and act' = 2 m. The scaled copies
        # are ScalarE's; VectorE's operands are all in `dtype` (bf16: one element per cycle, and 2 u exact)
        # or in PSUM. 4 act is returned (2u * 2m), its 1/4 applied by the flip's eviction.
        twice = nl.ndarray(shape, dtype, buffer=nl.sbuf)
        nisa.activation(dst=twice, op=nl.copy, data=up, scale=2.0)
        low = nl.ndarray(shape, dtype, buffer=nl.sbuf)
        nisa.activation(dst=low, op=nl.copy, data=up, scale=2 * LEAKY_RELU2_SLOPE ** 2)
        slope = nl.ndarray(shape, dtype, buffer=nl.sbuf)  # 2 m
        nisa.tensor_tensor(dst=slope, data1=twice, data2=low, op=nl.maximum)
        nisa.tensor_tensor(dst=d_up, data1=slope, data2=d_act, op=nl.multiply)
        nisa.tensor_tensor(dst=act, data1=twice, data2=slope, op=nl.multiply)
        act_scale = 0.25
    elif activation == "gelu":
        _gelu_tanh_backward(up, d_act, act, d_up)
    else:  # swiglu: act = silu(g) u; d_up = d_act silu(g); d_gate = d_act u silu'(g)
        d_gate = nl.ndarray(shape, dtype, buffer=nl.sbuf)
        silu = nl.ndarray(shape, nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=silu, op=nl.silu, data=gate)
        silu_dx = nl.ndarray(shape, nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=silu_dx, op=nl.silu_dx, data=gate)
        nisa.tensor_tensor(dst=act, data1=silu, data2=up, op=nl.multiply)
        nisa.tensor_tensor(dst=d_up, data1=silu, data2=d_act, op=nl.multiply)
        u_d_act = nl.ndarray(shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=u_d_act, data1=up, data2=d_act, op=nl.multiply)
        nisa.tensor_tensor(dst=d_gate, data1=u_d_act, data2=silu_dx, op=nl.multiply)
    return act, act_scale, d_up, d_gate


def _gelu_tanh_backward(up, d_act, act, d_up):
    """The tanh GELU's act and d_up = d_act act'(u) from up (SBUF [128, tokens]) and d_act (fp32 PSUM); fp32 inside."""
    shape = up.shape
    # act = u s with s = sigmoid(z), z = 2c (u + k u^3); act' = s (1 + (1 - s) 2c u (1 + 3k u^2)).
    # ScalarE has no derivative of the tanh approximation (gelu_dx is the erf GELU's), so build it.
    nisa.activation(dst=act, op=nl.gelu_apprx_tanh, data=up)
    u2 = nl.ndarray(shape, nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=u2, op=nl.square, data=up)
    cubic = nl.ndarray(shape, nl.float32, buffer=nl.sbuf)  # (u + k u^3) / k
    nisa.scalar_tensor_tensor(dst=cubic, data=u2, op0=nl.add, operand0=1 / _GELU_K, op1=nl.multiply, operand1=up)
    s = nl.ndarray(shape, nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=s, op=nl.sigmoid, data=cubic, scale=2 * _GELU_C * _GELU_K)
    one_minus_s = nl.ndarray(shape, nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=one_minus_s, op=nl.sigmoid, data=cubic, scale=-2 * _GELU_C * _GELU_K)
    poly = nl.ndarray(shape, nl.float32, buffer=nl.sbuf)  # (u + 3k u^3) / (3k)
    nisa.scalar_tensor_tensor(dst=poly, data=u2, op0=nl.add, operand0=1 / (3 * _GELU_K), op1=nl.multiply, operand1=up)
    slope = nl.ndarray(shape, nl.float32, buffer=nl.sbuf)  # (1 - s) 2c u (1 + 3k u^2)
    nisa.scalar_tensor_tensor(dst=slope, data=one_minus_s, op0=nl.multiply, operand0=6 * _GELU_C * _GELU_K,
                              op1=nl.multiply, operand1=poly)
    s_d_act = nl.ndarray(shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=s_d_act, data1=s, data2=d_act, op=nl.multiply)
    nisa.scalar_tensor_tensor(dst=d_up, data=slope, op0=nl.add, operand0=1.0, op1=nl.multiply, operand1=s_d_act)


# mlp: the PyTorch ops around the kernels, the PyTorch path, the shape and cost rules, the checks


def _mlp_chunk_tiles(dim, hidden, gated, itemsize, backward):
    """Hidden tiles (of 128 units) per chunk of the MLP kernels: as many as SBUF_BUDGET holds, at most all.
    For d <= 2048 (_mlp_shape_problem) that is at least one, even in fp32 with SwiGLU's three projections.
    The SBUF plan: the bytes per partition the kernels keep live per hidden tile of a chunk and besides,
    the accounting in their docstrings, rounded up (the emulator measures a little less; SBUF_BUDGET keeps
    a margin below the usable 212,984 bytes of a Trn2 partition for the compiler's buffering)."""
    projections = 3 if gated else 2
    if backward:
        block = _mlp_bwd_block_tokens(dim)
        per_tile = projections * dim * (itemsize + 4)  # the chunk's weight slices, its fp32 gradient accumulators
        # dy, dy.T, x of two blocks; three hidden tiles' elementwise and flipped tiles; dx's rows, partial sums
        besides = 5 * dim * block * itemsize // TILE + block * (14 * itemsize + 16) + 8 * dim
    else:
        per_tile = projections * dim * itemsize + MLP_BLOCK_TOKENS * itemsize  # transposed weights; act.T of a block
        # x.T of a block; fp32 activation scratch and the saved pre-activations' staging; y's rows and partial sums
        besides = 4 * dim * itemsize + MLP_BLOCK_TOKENS * (8 + 2 * itemsize) + 8 * dim
    return min(hidden // TILE, (SBUF_BUDGET - besides - 8 * 1024) // per_tile)


def _mlp_shape_problem(x, w_up, dtype):
    """None if the NKI MLP takes these shapes, else what stops it. One rule for the forward and the
    backward, so that a model scores (no grad) on the very kernels it trained on."""
    dim, hidden = x.size(-1), w_up.size(0)
    if dtype not in _KERNEL_DTYPES:
        return f"the kernels multiply in bfloat16 or float32, not {dtype}"
    if dim % TILE or hidden % TILE:
        return (f"d={dim} and hidden={hidden} must be multiples of {TILE}, the partition tile; choose n_embd and "
                "mlp_hidden so")
    if dim > 4 * BANK_FP32:
        return (f"d={dim} is over {4 * BANK_FP32}, as wide as the backward's dx accumulators in PSUM go; use a "
                "smaller n_embd")
    if x.numel() == 0:
        return "there are no tokens"
    return None


# Fewest tokens per call from which the cost model expects the NKI MLP (forward + backward) to beat the
# compiled plain ops, by width: d, or 1.5 d gated. From bench.py --kernels (docs/results.md): below them
# the weights' DMA traffic is not paid back. One rule for forward and backward, as _mlp_shape_problem's.
MLP_MIN_TOKENS = ((256, 128), (768, 256), (2048, 512))  # (width up to, tokens from); 2048: the kernels' widest d


def _mlp_cost_problem(tokens, dim, gated):
    """None where the cost model expects the NKI MLP to beat the compiled plain ops, else why not."""
    width = dim * 3 // 2 if gated else dim
    fewest = next((count for widest, count in MLP_MIN_TOKENS if width <= widest), MLP_MIN_TOKENS[-1][1])
    if tokens >= fewest:
        return None
    return (f"at {tokens} tokens per call and d={dim}{' (gated)' if gated else ''} the cost model expects the "
            f"compiled PyTorch MLP to be faster (NKI pays off from {fewest} tokens: bench.py --kernels); use a "
            "larger --batch_size, or --kernels=mlp:nki")


def _mlp_forward(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, w_gate: torch.Tensor | None,
                 activation: str, save_preactivation: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    chunk = _mlp_chunk_tiles(x.size(1), w_up.size(0), w_gate is not None, x.element_size(), backward=False)
    y, *saved = _run_kernel(mlp_fwd_kernel, x, w_up, w_down, w_gate, activation, save_preactivation, chunk)
    saved += [x.new_empty(0) for _ in range(2 - len(saved))]  # the op always returns three tensors
    return y, *saved


def _mlp_forward_fake(x, w_up, w_down, w_gate, activation, save_preactivation):
    saved = [x.new_empty(w_up.size(0), x.size(0)) if save_preactivation and weight is not None else x.new_empty(0)
             for weight in (w_up, w_gate)]
    return torch.empty_like(x), *saved


def _mlp_backward(dy: torch.Tensor, x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                  w_gate: torch.Tensor | None, up_saved: torch.Tensor, gate_saved: torch.Tensor | None,
                  activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    chunk = _mlp_chunk_tiles(x.size(1), w_up.size(0), w_gate is not None, x.element_size(), backward=True)
    dx, *grads = _run_kernel(mlp_bwd_kernel, dy, x, w_up, w_down, w_gate, up_saved, gate_saved, activation, chunk)
    grads += [x.new_empty(0) for _ in range(3 - len(grads))]
    return dx, *grads


def _mlp_backward_fake(dy, x, w_up, w_down, w_gate, up_saved, gate_saved, activation):
    partials = (_logical_core_degree(), w_up.size(0), x.size(1))
    grads = [x.new_empty(partials, dtype=torch.float32) if weight is not None else x.new_empty(0)
             for weight in (w_up, w_down, w_gate)]
    return torch.empty_like(x), *grads


def _mlp_setup_context(ctx, inputs, output):
    x, w_up, w_down, w_gate, activation, _ = inputs
    _, up_saved, gate_saved = output
    ctx.save_for_backward(x, w_up, w_down, w_gate, up_saved, gate_saved if w_gate is not None else None)
    ctx.mark_non_differentiable(up_saved, gate_saved)  # outputs only for the backward's sake
    ctx.set_materialize_grads(False)  # so autograd does not allocate (hidden, N) zero gradients for them
    ctx.activation = activation


def _mlp_vjp(backward_op, ctx, dy, _up_saved_grad, _gate_saved_grad):
    x, w_up, w_down, w_gate, up_saved, gate_saved = ctx.saved_tensors
    dx, dw_up, dw_down_t, dw_gate = backward_op(dy.to(x.dtype).contiguous(), x, w_up, w_down, w_gate, up_saved,
                                                gate_saved, ctx.activation)
    # the kernel returns each core's share of the weight gradients (fp32), and w_down's transposed
    dw_gate = dw_gate.sum(0).to(w_gate.dtype) if w_gate is not None else None
    return dx, dw_up.sum(0).to(w_up.dtype), dw_down_t.sum(0).t().to(w_down.dtype), dw_gate, None, None


if nki is not None:
    _mlp_op = _register_kernel_ops("mlp", _mlp_forward, _mlp_forward_fake, _mlp_backward, _mlp_backward_fake,
                                   _mlp_setup_context, _mlp_vjp)


def _mlp_nki(x, w_up, w_down, activation, w_gate, dtype):
    training = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w_up, w_down, w_gate))
    rows = x.reshape(-1, x.size(-1)).to(dtype).contiguous()
    weights = [w.to(dtype).contiguous() if w is not None else None for w in (w_up, w_down, w_gate)]
    y, _, _ = _mlp_op(rows, *weights, activation, training)
    return y.view(*x.shape[:-1], y.size(-1))


def _mlp_torch(x, w_up, w_down, activation, w_gate):
    h = F.linear(x, w_up)
    if activation == "relu2":
        h = F.relu(h).square()
    elif activation == "leaky_relu2":
        h = F.leaky_relu(h, LEAKY_RELU2_SLOPE).square()
    elif activation == "gelu":
        h = F.gelu(h, approximate="tanh")
    else:
        h = F.silu(F.linear(x, w_gate)) * h
    return F.linear(h, w_down)


def mlp_chunks(shapes, gated, dtype, backward):
    """How many hidden chunks the MLP kernel runs at these CheckShapes."""
    per_chunk = shapes.mlp_chunk_tiles or _mlp_chunk_tiles(shapes.dim, shapes.hidden, gated, dtype.itemsize, backward)
    return math.ceil(shapes.hidden // TILE / per_chunk)


@contextlib.contextmanager
def _forced_mlp_chunk_tiles(tiles):
    """The MLP kernels run `tiles` hidden tiles per chunk, so that the partial sums between chunks run at
    widths where they would plan one chunk (the checks' small shapes)."""
    global _mlp_chunk_tiles
    planned = _mlp_chunk_tiles
    _mlp_chunk_tiles = lambda *_, **__: tiles  # noqa: E731
    try:
        yield
    finally:
        _mlp_chunk_tiles = planned


def _mlp_check_cases(shapes, dtype, device, generator):
    """One case per activation, with the hidden chunks it runs in words."""
    draw = _drawing(dtype, device, generator)
    B, N, dim, hidden = shapes.batch, shapes.rows, shapes.dim, shapes.hidden
    context = functools.partial(_forced_mlp_chunk_tiles, shapes.mlp_chunk_tiles) if shapes.mlp_chunk_tiles \
        else contextlib.nullcontext
    cases = []
    for activation in shapes.activations or MLP_ACTIVATIONS:
        gated = activation == "swiglu"
        chunks = "/".join(str(mlp_chunks(shapes, gated, dtype, backward)) for backward in (False, True))
        cases.append(CheckCase(
            "mlp", f"mlp {activation}", f"{B} x {N} rows of {dim}, hidden {hidden} in {chunks} chunks fwd/bwd",
            lambda gated=gated: (draw(B, N, dim), draw(hidden, dim, scale=dim ** -0.5),
                                 draw(dim, hidden, scale=hidden ** -0.5),
                                 draw(hidden, dim, scale=dim ** -0.5) if gated else None),
            lambda x, w_up, w_down, w_gate, mode, activation=activation: mlp(x, w_up, w_down, activation, w_gate,
                                                                             mode=mode),
            context))
    return cases


def _mlp_model_cases(c, batch_size, device, dtype):
    draw = _model_drawing(device, dtype)
    B, T, C, hidden = batch_size, c.sequence_len, c.n_embd, c.hidden_dim
    gated = c.mlp == "swiglu"
    flops = 2 * B * T * C * hidden * (3 if gated else 2)
    return [(f"mlp ({c.mlp})", flops, 3 * flops,
             lambda: (draw(B, T, C), draw(hidden, C, scale=C ** -0.5), draw(C, hidden, scale=hidden ** -0.5),
                      draw(hidden, C, scale=C ** -0.5) if gated else None),
             lambda x, w_up, w_down, w_gate, mode: mlp(x, w_up, w_down, c.mlp, w_gate, mode=mode))]


def _mlp_plain_ops(c, sequences, elements, plain):
    """Its matmuls (two up for swiglu), and the activation: 2 one-input passes forward (e.g. relu, square),
    1 one- and 2 two-input backward."""
    N, C, hidden, n_up = sequences * c.sequence_len, c.n_embd, c.hidden_dim, 2 if c.mlp == "swiglu" else 1
    up, down = plain.linear(N, C, hidden), plain.linear(N, hidden, C)
    return {"forward": [up["forward"]] * n_up + [down["forward"], plain.passes(N * hidden, one_input=2,
                                                                                dtype="bfloat16")],
            "backward": [up["backward"]] * n_up + [down["backward"], plain.passes(N * hidden, one_input=1,
                                                                                   two_input=2, dtype="bfloat16")]}


MLP_OP = _declare(KernelOp(
    name="mlp", call=mlp,
    kernels=(mlp_fwd_kernel, mlp_bwd_kernel),
    torch_path=_mlp_torch, shape_problem=_mlp_shape_problem,
    cost_problem=lambda c, tokens: _mlp_cost_problem(tokens, c.n_embd, c.mlp == "swiglu"),
    check_cases=_mlp_check_cases, model_cases=_mlp_model_cases, plain_ops=_mlp_plain_ops,
    kill_matrix=("mlp leaky_relu2", "mlp gelu"),
    tests="test_mlp_norm_kernels.py"))


# =============================================================================
# rms_norm: y = x / sqrt(mean(x^2) + eps) * weight over the last dim, forward and backward


def rms_norm(x, weight=None, eps=1e-6, mode="auto"):
    """RMSNorm over the last dim, statistics in fp32 whatever the input dtype; weight None or (d,).
    The NKI kernels (rms_norm_fwd_kernel, rms_norm_bwd_kernel) take x as (rows, d)."""
    if _use_nki(RMS_NORM_OP.name, mode, x.device.type, _rms_norm_shape_problem(x)):
        return _rms_norm_nki(x, weight, eps)
    return _rms_norm_torch(x, weight, eps)


RMS_NORM_MAX_DIM = 2048  # the backward's weight gradient accumulates in PSUM, 512 per bank, 4 banks


def rms_norm_fwd_kernel(x, weight, eps):
    """RMSNorm forward. x (N, d) bf16 or fp32; weight None or (d,) fp32. Returns y (N, d) in x's dtype.

    Rows go on the partitions, 128 per tile, the whole of d along the free axis, so the statistic is a
    per-partition reduction: ScalarE squares the tile and sums each row in the same instruction (fp32);
    1/rms is a [128, 1] column (VectorE's mean + eps, GpSimd's rsqrt: the engines that are idle here);
    VectorE writes x * rstd in one tensor_scalar (bf16 in SBUF: 4 elements per cycle), or with a weight
    x * rstd * weight in one scalar_tensor_tensor. The weight is broadcast to all partitions once per
    call with a K=1 matmul against a row of ones. One read of x and one write of y: the HBM traffic of a
    copy. Nothing is saved for the backward, which recomputes rstd from the x it reads anyway.

    SBUF per partition: x and y tiles (2 * d * itemsize), plus 4d for the weight: under 24 KiB at d = 2048. PSUM:
    only the one-off broadcast. Limits: d <= 2048; any N (the last tile may be partial); programs of an LNC launch
    split the rows. Engines per 128-row tile (cycles, bf16, no weight): ScalarE d + 64, VectorE d/4 + 64, GpSimd
    256, TensorE idle, DMA 2 x 8 rows per queue x (2d + 512) bytes at 23 GB/s: DMA-bound at every d. With a weight
    VectorE makes 2d cycles, about DMA's time.
    """
    assert x.shape[1] <= RMS_NORM_MAX_DIM, "rows of at most 2048 values (RMS_NORM_MAX_DIM)"
    n_rows, dim = x.shape
    y = nl.ndarray((n_rows, dim), x.dtype, buffer=nl.shared_hbm)
    weighted = weight is not None
    weight_rows = _broadcast_to_partitions(weight) if weighted else None
    program_start, program_stop = _program_rows(n_rows)
    for span in _spans(program_start, program_stop, TILE):
        row, rows = span
        x_tile = _load_tile(x, slice(row, row + rows), slice(0, dim))
        out = nl.ndarray((rows, dim), x.dtype, buffer=nl.sbuf)
        rstd = _reciprocal_rms(x_tile, eps, squares=out)
        if not weighted:
            nisa.tensor_scalar(dst=out, data=x_tile, op0=nl.multiply, operand0=rstd)
        else:
            nisa.scalar_tensor_tensor(dst=out, data=x_tile, op0=nl.multiply, operand0=rstd, op1=nl.multiply,
                                      operand1=weight_rows[:rows])
        nisa.dma_copy(dst=y[row:row + rows, :], src=out)
    return y


def rms_norm_bwd_kernel(dy, x, weight, eps):
    """RMSNorm backward. dy, x (N, d); weight None or (d,) fp32. Returns dx (N, d) in x's dtype and,
    with a weight, per-program partial weight gradients (programs, d) in fp32 for the caller to sum.

    With r = rstd and g = r * dy * weight:  dx = g - r^2 * mean(x * g) * x,  dweight = sum_rows(dy * x * r).
    Per 128-row tile, r is recomputed as in the forward (one ScalarE pass). Without a weight (the model's
    case) dx = r (dy + c x) with c = -r^2 mean(x dy): VectorE's x * dy, summed per row by ScalarE's
    accumulator; VectorE's c x + dy; ScalarE's r * that, a free scale. In bf16 these intermediates are
    bf16, so VectorE streams them at one element per cycle (x * c at four): dx is rounded about three
    times instead of once, within bf16's step. With a weight, g (VectorE), x * g / d (VectorE) summed by
    ScalarE, dx (VectorE), all fp32. The weight gradient sums over rows, which lie on the partitions: a
    matmul with a column of ones does that cross-partition sum on TensorE, accumulating over all of a
    program's tiles in PSUM (fp32 operands: exact, and the matmul is only one row tall). One read of x
    and dy and one write of dx.

    Order: tile after tile, the plain form (under the compiler's list schedule a software pipeline across
    tiles was within the model's error of it, docs/results.md; nki-library's rmsnorm_quant.py goes tile
    after tile too).

    SBUF per partition: per tile x, dy, dx and one (three with a weight) [128, d] intermediates: at most 40 d bytes
    with the compiler's buffering. PSUM: d / 512 banks for the weight gradient. Limits as for the forward. Engines
    per tile (cycles, bf16, no weight): ScalarE 3d + 128, VectorE 2.25 d + 192, GpSimd 256, DMA 3 x 8 rows per queue
    x (2d + 512) bytes at 23 GB/s: about level. With a weight VectorE makes 4 passes of 2d cycles: VectorE-bound,
    ~3x DMA.
    """
    assert x.shape[1] <= RMS_NORM_MAX_DIM, "rows of at most 2048 values (RMS_NORM_MAX_DIM)"
    n_rows, dim = x.shape
    programs, program = nl.num_programs(), nl.program_id(0)
    dx = nl.ndarray((n_rows, dim), x.dtype, buffer=nl.shared_hbm)
    if weight is not None:
        dweight = nl.ndarray((programs, dim), nl.float32, buffer=nl.shared_hbm)
        weight_rows = _broadcast_to_partitions(weight)
        ones_column = _constant_column(1.0)
        dweight_acc = []  # one PSUM bank row per 512 columns, accumulated over the program's row tiles
        for span in _spans(0, dim, BANK_FP32):
            dweight_acc.append(nl.ndarray((1, span[1]), nl.float32, buffer=nl.psum))
    program_start, program_stop = _program_rows(n_rows)
    spans = _spans(program_start, program_stop, TILE)
    for s in range(len(spans)):
        row, count = spans[s]
        rows = slice(row, row + count)
        # r (_reciprocal_rms) and the product whose row sums give the coefficient of x: x dy, or with a
        # weight g = r dy weight and x g / d
        x_tile, dy_tile = _load_tile(x, rows, slice(0, dim)), _load_tile(dy, rows, slice(0, dim))
        out = nl.ndarray((count, dim), x.dtype, buffer=nl.sbuf)  # dx's rows
        product = nl.ndarray((count, dim), x.dtype if weight is None else nl.float32, buffer=nl.sbuf)
        rstd = _reciprocal_rms(x_tile, eps, squares=product)
        if weight is None:
            nisa.tensor_tensor(dst=product, data1=x_tile, data2=dy_tile, op=nl.multiply)
        else:
            g = nl.ndarray((count, dim), nl.float32, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(dst=g, data=dy_tile, op0=nl.multiply, operand0=rstd, op1=nl.multiply,
                                      operand1=weight_rows[:count])
            nisa.scalar_tensor_tensor(dst=product, data=x_tile, op0=nl.multiply, operand0=1.0 / dim,
                                      op1=nl.multiply, operand1=g)
        # the row sums (ScalarE's accumulator) and c = -r^2 mean(x dy) (or of x g)
        neg_mean = nl.ndarray((count, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation_reduce(dst=product, op=nl.copy, data=product, reduce_op=nl.add, reduce_res=neg_mean,
                               scale=-1.0 / dim if weight is None else -1.0)
        x_coef = nl.ndarray((count, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=x_coef, data=neg_mean, op0=nl.multiply, operand0=rstd, op1=nl.multiply,
                           operand1=rstd)
        if weight is None:  # dx = r (dy + c x), the last scale ScalarE's
            nisa.tensor_scalar(dst=out, data=x_tile, op0=nl.multiply, operand0=x_coef)
            nisa.tensor_tensor(dst=product, data1=out, data2=dy_tile, op=nl.add)
            nisa.activation(dst=out, op=nl.copy, data=product, scale=rstd)
        else:  # dx = c x + g; the weight gradient's dy x r summed over the rows by a matmul with ones
            _rms_norm_weighted_dx(out, x_tile, dy_tile, rstd, x_coef, g, ones_column, dweight_acc, s > 0)
        nisa.dma_copy(dst=dx[rows, :], src=out)
    if weight is None:
        return dx  # one output: TorchNeuron hands it back bare
    _store_dweight_partial(dweight[program:program + 1, :], dweight_acc, program_start == program_stop)
    return dx, dweight


def _rms_norm_weighted_dx(out, x_tile, dy_tile, rstd, x_coef, g, ones_column, dweight_acc, accumulate):
    """A weighted tile's dx = c x + g into out (c: x_coef [rows, 1]); dy x r summed over its rows into dweight_acc."""
    count, dim = x_tile.shape
    nisa.scalar_tensor_tensor(dst=out, data=x_tile, op0=nl.multiply, operand0=x_coef, op1=nl.add, operand1=g)
    normed_dy = nl.ndarray((count, dim), nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=normed_dy, data=x_tile, op0=nl.multiply, operand0=rstd, op1=nl.multiply,
                              operand1=dy_tile)
    for c in range(len(dweight_acc)):
        col = c * BANK_FP32
        nisa.nc_matmul(dst=dweight_acc[c], stationary=ones_column[:count],
                       moving=normed_dy[:, col:col + dweight_acc[c].shape[1]], accumulate=accumulate)


def _store_dweight_partial(dweight_row, dweight_acc, no_rows):
    """The program's partial weight gradient, dweight_acc's PSUM rows (zeros if it had no rows), to its dweight row."""
    partial = nl.ndarray(dweight_row.shape, nl.float32, buffer=nl.sbuf)
    if no_rows:
        nisa.memset(dst=partial, value=0.0)
    else:
        for c in range(len(dweight_acc)):
            col = c * BANK_FP32
            nisa.tensor_copy(dst=partial[:, col:col + dweight_acc[c].shape[1]], src=dweight_acc[c])
    nisa.dma_copy(dst=dweight_row, src=partial)


def _broadcast_to_partitions(vector):
    """A (d,) fp32 vector from HBM copied into all 128 partitions of an SBUF tile [128, d]: a K=1 matmul of
    a row of ones (stationary) with the vector (moving), one PSUM bank at a time."""
    dim = vector.shape[0]
    row = nl.ndarray((1, dim), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=row, src=vector)
    ones_row = nl.ndarray((1, TILE), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones_row, value=1.0)
    rows = nl.ndarray((TILE, dim), nl.float32, buffer=nl.sbuf)
    for span in _spans(0, dim, BANK_FP32):
        col, width = span
        nisa.tensor_copy(dst=rows[:, col:col + width], src=_matmul_into_psum([ones_row], [row[:, col:col + width]]))
    return rows


# rms_norm: the PyTorch ops around the kernels, the PyTorch path, the shape rule, the checks


def _rms_norm_shape_problem(x):
    """None if the NKI RMSNorm takes x, else what stops it."""
    if x.dtype not in _KERNEL_DTYPES:
        return f"the kernels take bfloat16 or float32, not {x.dtype}"
    if x.size(-1) > RMS_NORM_MAX_DIM:
        return (f"rows of {x.size(-1)} are over {RMS_NORM_MAX_DIM}, as wide as the weight gradient's PSUM "
                "accumulators go; use a smaller n_embd")
    if x.numel() == 0:
        return "there are no rows"
    return None


def _rms_norm_forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    (y,) = _run_kernel(rms_norm_fwd_kernel, x, weight, eps)
    return y


def _rms_norm_forward_fake(x, weight, eps):
    return torch.empty_like(x)


def _rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    dx, *dweight = _run_kernel(rms_norm_bwd_kernel, dy, x, weight, eps)
    return dx, dweight[0] if dweight else x.new_empty(0)


def _rms_norm_backward_fake(dy, x, weight, eps):
    dweight = x.new_empty((_logical_core_degree(), x.size(1)), dtype=torch.float32) if weight is not None \
        else x.new_empty(0)
    return torch.empty_like(x), dweight


def _rms_norm_setup_context(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_norm_vjp(backward_op, ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dweight = backward_op(dy.to(x.dtype).contiguous(), x, weight, ctx.eps)
    return dx, dweight.sum(0) if weight is not None else None, None  # summed over the cores' shares


if nki is not None:
    _rms_norm_op = _register_kernel_ops("rms_norm", _rms_norm_forward, _rms_norm_forward_fake, _rms_norm_backward,
                                        _rms_norm_backward_fake, _rms_norm_setup_context, _rms_norm_vjp)


def _rms_norm_nki(x, weight, eps):
    rows = x.reshape(-1, x.size(-1)).contiguous()
    return _rms_norm_op(rows, weight.float() if weight is not None else None, eps).view(x.shape)


def _rms_norm_torch(x, weight, eps):
    return F.rms_norm(x.float(), (x.size(-1),), weight, eps).type_as(x)


def _rows_in_words(shapes):
    return f"{shapes.batch} x {shapes.rows} rows of {shapes.dim}"


def _rms_norm_check_cases(shapes, dtype, device, generator):
    draw = _drawing(dtype, device, generator)
    rows = (shapes.batch, shapes.rows, shapes.dim)
    return [CheckCase("rms_norm", "rms_norm", _rows_in_words(shapes), lambda: (draw(*rows),),
                      lambda x, mode: rms_norm(x, mode=mode)),
            CheckCase("rms_norm", "rms_norm weighted", _rows_in_words(shapes),
                      lambda: (draw(*rows), (1 + 0.5 * torch.randn(shapes.dim, generator=generator)).to(device)),
                      lambda x, w, mode: rms_norm(x, w, mode=mode))]


def _rms_norm_model_cases(c, batch_size, device, dtype):
    """No matmul FLOPs (memory-bound). The residual stream is fp32 under autocast, and so are the norms on it:
    rms_norm_fp32."""
    draw = _model_drawing(device, dtype)
    shape = (batch_size, c.sequence_len, c.n_embd)
    return [("rms_norm", 0, 0, lambda: (draw(*shape),), lambda x, mode: rms_norm(x, mode=mode)),
            ("rms_norm_fp32", 0, 0, lambda: (draw(*shape),), lambda x, mode: rms_norm(x.float(), mode=mode))]


def _rms_norm_plain_ops(c, sequences, elements, plain):
    """Forward: the mean of squares, scale, cast; backward: 4 one-input and 1 two-input passes; over the
    residual stream unless `elements` says otherwise."""
    elements = sequences * c.sequence_len * c.n_embd if elements is None else elements
    return {"forward": [plain.passes(elements, one_input=3)],
            "backward": [plain.passes(elements, one_input=4, two_input=1)]}


RMS_NORM_OP = _declare(KernelOp(
    name="rms_norm", call=rms_norm,
    kernels=(rms_norm_fwd_kernel, rms_norm_bwd_kernel),
    torch_path=_rms_norm_torch, shape_problem=_rms_norm_shape_problem, cost_problem=None,
    check_cases=_rms_norm_check_cases, model_cases=_rms_norm_model_cases, plain_ops=_rms_norm_plain_ops,
    kill_matrix=("rms_norm weighted",),
    tests="test_mlp_norm_kernels.py"))


# =============================================================================
# add_rms_norm: s = x + branch and y = s / sqrt(mean(s^2) + eps), forward and backward (fused, s makes no
# extra round trip through HBM; backward, s's later gradient is added in the same pass)


def add_rms_norm(x, branch, eps=1e-6, mode="auto"):
    """(s, rms_norm(s)) with s = x + branch: a residual add and the RMSNorm (no weight) of its sum.

    One pass over the rows on NKI (add_rms_norm_fwd_kernel, add_rms_norm_bwd_kernel take them as (rows, d)).
    The norm comes back in x's dtype on the PyTorch path, in branch's on NKI: under autocast the matmul
    dtype, which is what the matmul reading the norm would round it to anyway."""
    if _use_nki(ADD_RMS_NORM_OP.name, mode, x.device.type, _add_rms_norm_shape_problem(x, branch)):
        return _add_rms_norm_nki(x, branch, eps)
    return _add_rms_norm_torch(x, branch, eps, mode)



def add_rms_norm_fwd_kernel(x, branch, eps):
    """Residual add and the RMSNorm after it, one pass over the rows.

    x (N, d), the residual stream, bf16 or fp32; branch (N, d), the sub-block's output, bf16 or fp32.
    Returns s = x + branch (N, d) in x's dtype and y = s * rstd(s) (N, d) in branch's dtype: the dtype of
    the matmul that made the branch, which is the one the next matmul takes (under bf16 autocast: the
    rounding autocast would apply to y anyway).

    Rows on the partitions, 128 per tile, the whole of d along the free axis (as rms_norm_fwd_kernel).
    Per tile: VectorE adds the two tiles (fp32 inside, rounded to x's dtype, as PyTorch's x + branch);
    ScalarE squares s and sums each row in one instruction, then the [rows, 1] mean and rsqrt (VectorE,
    GpSimd: _reciprocal_rms), then writes s * rstd.
    rstd comes from the rounded s, the tensor the unfused norm would read. Nothing is saved for the
    backward beyond s itself (an output), from which it recomputes rstd.

    HBM traffic: read x and branch, write s and y, once each (fp32 stream, bf16 branch: 12 bytes a value;
    apart: 18, the norm's output fp32, and 6 more where autocast casts it for the next matmul). SBUF per
    partition: x, branch, s, y tiles (at most 4 * 4d bytes), double-buffered by the compiler: under 64 KiB
    at d = 2048. PSUM: none. Limits: d <= 2048; any N (the last tile may be
    partial); the programs of an LNC launch split the rows. TensorE is idle; per tile VectorE makes one
    pass and ScalarE two, both under the tile's DMA time, so the kernel runs at HBM bandwidth.
    """
    assert branch.shape == x.shape and x.shape[1] <= RMS_NORM_MAX_DIM, \
        "x and branch must be (N, d) alike, d at most 2048 (RMS_NORM_MAX_DIM)"
    n_rows, dim = x.shape
    total = nl.ndarray((n_rows, dim), x.dtype, buffer=nl.shared_hbm)
    normed = nl.ndarray((n_rows, dim), branch.dtype, buffer=nl.shared_hbm)
    program_start, program_stop = _program_rows(n_rows)
    for span in _spans(program_start, program_stop, TILE):
        row, rows = span
        tile_rows = slice(row, row + rows)
        x_tile = _load_tile(x, tile_rows, slice(0, dim))
        branch_tile = _load_tile(branch, tile_rows, slice(0, dim))
        sum_tile = nl.ndarray((rows, dim), x.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=sum_tile, data1=x_tile, data2=branch_tile, op=nl.add)
        nisa.dma_copy(dst=total[tile_rows, :], src=sum_tile)
        out = nl.ndarray((rows, dim), branch.dtype, buffer=nl.sbuf)
        rstd = _reciprocal_rms(sum_tile, eps, squares=out)
        nisa.activation(dst=out, op=nl.copy, data=sum_tile, scale=rstd)
        nisa.dma_copy(dst=normed[tile_rows, :], src=out)
    return total, normed


def add_rms_norm_bwd_kernel(d_total, d_normed, total, eps):
    """Backward of add_rms_norm_fwd_kernel.

    total (N, d), the s the forward returned; d_normed (N, d), the
    gradient of y, in y's dtype; d_total (N, d), the gradient that reached s from later in the stream, in
    s's dtype, or None when nothing read s. Returns dx (N, d) in s's dtype, the gradient of both x and
    branch, and, where y's dtype differs from s's, the same values once more in y's dtype for the branch
    (a second write of half the bytes, instead of a cast pass over dx after the kernel).

    With r = rstd(s):  dx = d_total + r * dy - r^3 * mean(s * dy) * s.
    Per 128-row tile: r recomputed (ScalarE squares and sums, as in the forward); s * dy (VectorE) summed
    per row by ScalarE's accumulator, scaled by -1/d; its product with r^3 ([rows, 1], tiny); then
    VectorE s * coef + d_total and dx = dy * r + that (two fused multiply-adds, fp32 inside).

    Order: tile after tile, the plain form (a software pipeline across tiles was within the model's error
    of it under the compiler's list schedule, docs/results.md).

    HBM traffic: read s, dy and d_total, write dx (and d_branch) once each. SBUF per partition: s, dy, d_total, dx,
    d_branch tiles and one fp32 scratch, at most 24 * d bytes. PSUM: none. Limits as for the
    forward. Per tile VectorE makes three passes and ScalarE three (two with one dtype throughout), TensorE none;
    DMA, at 16 bytes a value for an fp32 stream and bf16 branch, is the bottleneck, VectorE close behind.
    """
    assert d_normed.shape == total.shape and total.shape[1] <= RMS_NORM_MAX_DIM, \
        "total and d_normed must be (N, d) alike, d at most 2048 (RMS_NORM_MAX_DIM)"
    n_rows, dim = total.shape
    dx = nl.ndarray((n_rows, dim), total.dtype, buffer=nl.shared_hbm)
    split = d_normed.dtype != total.dtype
    d_branch = nl.ndarray((n_rows, dim), d_normed.dtype, buffer=nl.shared_hbm) if split else None
    program_start, program_stop = _program_rows(n_rows)
    for span in _spans(program_start, program_stop, TILE):
        row, count = span
        rows = slice(row, row + count)
        scratch = nl.ndarray((count, dim), nl.float32, buffer=nl.sbuf)  # s * dy, then s * coef + d_total
        s_tile, dy_tile = _load_tile(total, rows, slice(0, dim)), _load_tile(d_normed, rows, slice(0, dim))
        d_total_tile = _load_tile(d_total, rows, slice(0, dim)) if d_total is not None else None
        rstd = _reciprocal_rms(s_tile, eps, squares=scratch)
        nisa.tensor_tensor(dst=scratch, data1=s_tile, data2=dy_tile, op=nl.multiply)
        # the row sums of s * dy (ScalarE's accumulator), the coefficient -r^3 mean(s dy)
        neg_mean = nl.ndarray((count, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation_reduce(dst=scratch, op=nl.copy, data=scratch, reduce_op=nl.add, reduce_res=neg_mean,
                               scale=-1.0 / dim)
        r_squared = nl.ndarray((count, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=r_squared, data1=rstd, data2=rstd, op=nl.multiply)
        s_coef = nl.ndarray((count, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=s_coef, data=neg_mean, op0=nl.multiply, operand0=rstd, op1=nl.multiply,
                           operand1=r_squared)
        if d_total is None:
            nisa.tensor_scalar(dst=scratch, data=s_tile, op0=nl.multiply, operand0=s_coef)
        else:
            nisa.scalar_tensor_tensor(dst=scratch, data=s_tile, op0=nl.multiply, operand0=s_coef, op1=nl.add,
                                      operand1=d_total_tile)
        out = nl.ndarray((count, dim), total.dtype, buffer=nl.sbuf)  # dx = dy * r + (s * coef + d_total)
        nisa.scalar_tensor_tensor(dst=out, data=dy_tile, op0=nl.multiply, operand0=rstd, op1=nl.add,
                                  operand1=scratch)
        nisa.dma_copy(dst=dx[rows, :], src=out)
        if split:
            out_branch = nl.ndarray(out.shape, d_normed.dtype, buffer=nl.sbuf)
            nisa.activation(dst=out_branch, op=nl.copy, data=out)  # on ScalarE, which has one pass less
            nisa.dma_copy(dst=d_branch[rows, :], src=out_branch)
    if split:
        return dx, d_branch
    return dx  # one output: TorchNeuron hands it back bare


# add_rms_norm: the PyTorch ops around the kernels, the PyTorch path, the shape rule, the checks


def _add_rms_norm_shape_problem(x, branch):
    """None if the fused residual add + RMSNorm kernels take x and branch, else what stops them."""
    if branch.shape != x.shape:
        return f"the branch {tuple(branch.shape)} is not the residual's shape {tuple(x.shape)}"
    if branch.dtype not in _KERNEL_DTYPES:
        return f"the kernels take bfloat16 or float32, not {branch.dtype}"
    if torch.promote_types(x.dtype, branch.dtype) != x.dtype:
        return f"the residual stream ({x.dtype}) cannot hold its sum with a {branch.dtype} branch"
    return _rms_norm_shape_problem(x)


def _add_rms_norm_forward(x: torch.Tensor, branch: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _run_kernel(add_rms_norm_fwd_kernel, x, branch, eps)


def _add_rms_norm_forward_fake(x, branch, eps):
    return torch.empty_like(x), torch.empty_like(branch)


def _add_rms_norm_backward(d_total: torch.Tensor | None, d_normed: torch.Tensor, total: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    dx, *d_branch = _run_kernel(add_rms_norm_bwd_kernel, d_total, d_normed, total, eps)
    return dx, d_branch[0] if d_branch else dx.new_empty(0)


def _add_rms_norm_backward_fake(d_total, d_normed, total, eps):
    d_branch = torch.empty_like(d_normed) if d_normed.dtype != total.dtype else total.new_empty(0)
    return torch.empty_like(total), d_branch


def _add_rms_norm_setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[0])  # s: the backward recomputes rstd from it
    ctx.eps = inputs[2]
    ctx.set_materialize_grads(False)  # no zeros for an s that nothing after it read (the last block's)


def _add_rms_norm_vjp(backward_op, ctx, d_total, d_normed):
    (total,) = ctx.saved_tensors
    if d_normed is None:  # only s was used: the norm adds nothing to its gradient
        return d_total, d_total, None
    d_total = d_total.to(total.dtype).contiguous() if d_total is not None else None
    dx, d_branch = backward_op(d_total, d_normed.contiguous(), total, ctx.eps)
    return dx, d_branch if d_branch.numel() else dx, None


if nki is not None:
    _add_rms_norm_op = _register_kernel_ops("add_rms_norm", _add_rms_norm_forward, _add_rms_norm_forward_fake,
                                            _add_rms_norm_backward, _add_rms_norm_backward_fake,
                                            _add_rms_norm_setup_context, _add_rms_norm_vjp)


def _add_rms_norm_nki(x, branch, eps):
    rows = x.reshape(-1, x.size(-1)).contiguous()
    total, normed = _add_rms_norm_op(rows, branch.reshape(rows.shape).contiguous(), eps)
    return total.view(x.shape), normed.view(x.shape)


def _add_rms_norm_torch(x, branch, eps, mode):
    total = x + branch
    return total, rms_norm(total, eps=eps, mode=mode)


def _add_rms_norm_check_cases(shapes, dtype, device, generator):
    """As the model calls it: the residual stream in fp32 (under autocast too), a branch in the matmuls'
    dtype; the norm compared as the next matmul takes it, in the branch's dtype (the kernel returns it so)."""
    draw = _drawing(dtype, device, generator)
    rows = (shapes.batch, shapes.rows, shapes.dim)

    def call(x, branch, mode):
        total, normed = add_rms_norm(x, branch, mode=mode)
        return torch.cat((total.flatten(), normed.to(branch.dtype).to(total.dtype).flatten()))

    return [CheckCase("add_rms_norm", "add_rms_norm", _rows_in_words(shapes) + ", an fp32 stream",
                      lambda: (draw(*rows).float(), draw(*rows)), call)]


def _add_rms_norm_model_cases(c, batch_size, device, dtype):
    """The stream fp32, the branch (a matmul's output) in the matmul dtype; the two outputs summed, so that
    both get a gradient."""
    draw = _model_drawing(device, dtype)
    shape = (batch_size, c.sequence_len, c.n_embd)
    return [("add_rms_norm", 0, 0, lambda: (draw(*shape), draw(*shape)),
             lambda x, branch, mode: sum(o.float() for o in add_rms_norm(x.float(), branch, mode=mode)))]


def _add_rms_norm_plain_ops(c, sequences, elements, plain):
    """The residual add as a two-input pass, then the norm of the sum; backward: the norm's passes and the
    sum of the two gradients that reach the sum."""
    norm = _rms_norm_plain_ops(c, sequences, None, plain)
    return {direction: [plain.passes(sequences * c.sequence_len * c.n_embd, two_input=1)] + norm[direction]
            for direction in ("forward", "backward")}


ADD_RMS_NORM_OP = _declare(KernelOp(
    name="add_rms_norm", call=add_rms_norm,
    kernels=(add_rms_norm_fwd_kernel, add_rms_norm_bwd_kernel),
    torch_path=_add_rms_norm_torch, shape_problem=_add_rms_norm_shape_problem, cost_problem=None,
    check_cases=_add_rms_norm_check_cases, model_cases=_add_rms_norm_model_cases,
    plain_ops=_add_rms_norm_plain_ops, kill_matrix=("add_rms_norm",),
    tests="test_mlp_norm_kernels.py"))


# =============================================================================
# softcap_cross_entropy: the head's loss, nll = logsumexp(cap tanh(z / cap)) - cap tanh(z_target / cap),
# forward and backward (apart: several fp32 passes over the logits through HBM each way; fused: the logits
# read once each way)


def softcap_cross_entropy(logits, targets, cap, vocab_size, reduction="mean", mode="auto"):
    """Cross-entropy of softcapped logits, cap * tanh(logits / cap) (no cap when cap is 0).

    As F.cross_entropy(..., ignore_index=-1) gives it: the mean over kept targets, or with reduction="none"
    each position's loss (0 where ignored). logits (..., V_padded) as the head makes them, of which only the
    first vocab_size columns count (the rest are padding and get a zero gradient); targets (...), -1 = ignore.
    On NKI (softcap_cross_entropy_fwd_kernel / _bwd_kernel, rows (N, V_padded)) the logits are read once
    forward and once backward, never converted to fp32 in HBM; the statistics are fp32 either way."""
    if _use_nki(SOFTCAP_CROSS_ENTROPY_OP.name, mode, logits.device.type,
                _softcap_cross_entropy_shape_problem(logits, targets, cap, vocab_size)):
        return _softcap_cross_entropy_nki(logits, targets, cap, vocab_size, reduction)
    return _softcap_cross_entropy_torch(logits, targets, cap, vocab_size, reduction)


VOCAB_CHUNK = 2048  # logits columns per step: 4 KiB rows of bf16 per DMA, ~40 KiB of SBUF per partition


def _vocab_iota():
    """[128, VOCAB_CHUNK] fp32 tile whose every row is 0, 1, ..., VOCAB_CHUNK - 1.

    The column index within a chunk, which one compare against a row's target (shifted by the chunk's
    start) turns into the one-hot."""
    columns = nl.ndarray((TILE, VOCAB_CHUNK), nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=columns, pattern=[[1, VOCAB_CHUNK]], offset=0, channel_multiplier=0)
    return columns


def _load_targets(targets, tile_rows, rows):
    """A tile's targets (int32 in HBM, -1 = ignored) as an fp32 column, exact below 2^24, and 1.0 / 0.0 for
    kept / ignored."""
    raw = _load_tile(targets, tile_rows, slice(0, 1))
    target = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=target, src=raw)
    kept = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=kept, data=target, op0=nl.greater_equal, operand0=0.0)
    return target, kept


def _chunk_target(target, start):
    """target - start: where a chunk starting at column `start` holds the row's target (else out of range)."""
    shifted = nl.ndarray(target.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=shifted, data=target, op0=nl.subtract, operand0=float(start))
    return shifted


def softcap_cross_entropy_fwd_kernel(logits, targets, vocab, cap):
    """Softcap cross-entropy forward: each row's loss and logsumexp, the logits read once.

    logits (N, V_padded) bf16 or fp32, the head's raw output; columns from
    `vocab` on are padding and ignored; targets (N, 1) int32, -1 = ignored; cap > 0. Returns nll (N, 1) fp32,
    the loss of each row (0 where ignored), and lse (N, 1) fp32, the logsumexp of its capped logits, which the
    backward needs.

    The cap bounds every capped logit by cap, so exp(cap t - cap) with t = tanh(z / cap) never overflows and
    the largest term is at least exp(-2 cap): the logsumexp needs no running max, only a running sum,
    lse = cap + log(sum_j exp(cap t_j - cap)) (fp32 statistics throughout).

    Rows on the partitions, 128 per tile; the vocabulary in chunks of VOCAB_CHUNK columns. Per chunk: one
    DMA; ScalarE t = tanh(z / cap) (fp32), then exp(cap t - cap) with its row sum in the same instruction;
    VectorE picks t at the target (one compare of a column-index iota against the shifted target, times t,
    in one instruction), which ScalarE's accumulator sums. Per tile: lse, nll = lse - cap t_target.

    HBM: the logits read once; 8 bytes a row written. SBUF per partition: the chunk's logits, t, exp and the
    pick (2 + 3 * 4 bytes a column: 28 KiB) and the iota (8 KiB); PSUM: none. Limits: cap > 0 (without the
    bound the sum would need a running max: the PyTorch path runs), vocab < 2^24; any N, any vocab (the
    last chunk may be short). Engines per chunk: ScalarE 3 passes, VectorE one of two inputs (costed as 2),
    TensorE none: ScalarE is the bottleneck, VectorE at 87% of it, the DMA of bf16 logits at a third (the
    emulator at 1024 x 8192). The running sums are [rows, 1] updates, one per chunk.
    """
    assert cap > 0 and 0 < vocab <= logits.shape[1], "a softcap > 0 and a vocab within the logits' width"
    n_rows = logits.shape[0]
    nll = nl.ndarray((n_rows, 1), nl.float32, buffer=nl.shared_hbm)
    lse = nl.ndarray((n_rows, 1), nl.float32, buffer=nl.shared_hbm)
    columns = _vocab_iota()
    neg_cap = _constant_column(-cap)
    program_start, program_stop = _program_rows(n_rows)
    for span in _spans(program_start, program_stop, TILE):
        row, rows = span
        tile_rows = slice(row, row + rows)
        target, kept = _load_targets(targets, tile_rows, rows)
        total = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)  # sum of exp(cap t - cap) so far
        picked = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)  # t at the target so far
        for chunk in _spans(0, vocab, VOCAB_CHUNK):
            start, width = chunk
            z = _load_tile(logits, tile_rows, slice(start, start + width))
            t = nl.ndarray((rows, width), nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=t, op=nl.tanh, data=z, scale=1.0 / cap)
            exps = nl.ndarray((rows, width), nl.float32, buffer=nl.sbuf)
            chunk_total = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
            nisa.activation_reduce(dst=exps, op=nl.exp, data=t, reduce_op=nl.add, reduce_res=chunk_total,
                                   bias=neg_cap[:rows], scale=cap)
            at_target = nl.ndarray((rows, width), nl.float32, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(dst=at_target, data=columns[:rows, :width], op0=nl.equal,
                                      operand0=_chunk_target(target, start), op1=nl.multiply, operand1=t)
            chunk_picked = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)  # summed by ScalarE: VectorE is busier
            nisa.activation_reduce(dst=at_target, op=nl.copy, data=at_target, reduce_op=nl.add, reduce_res=chunk_picked)
            if start == 0:
                nisa.tensor_copy(dst=total, src=chunk_total)
                nisa.tensor_copy(dst=picked, src=chunk_picked)
            else:
                nisa.tensor_tensor(dst=total, data1=total, data2=chunk_total, op=nl.add)
                nisa.tensor_tensor(dst=picked, data1=picked, data2=chunk_picked, op=nl.add)
        log_total = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=log_total, op=nl.log, data=total)  # total >= exp(-2 cap): in log's range
        lse_tile = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=lse_tile, data=log_total, op0=nl.add, operand0=float(cap))
        nisa.dma_copy(dst=lse[tile_rows, :], src=lse_tile)
        loss = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)  # lse - cap t_target
        nisa.scalar_tensor_tensor(dst=loss, data=picked, op0=nl.multiply, operand0=-float(cap), op1=nl.add,
                                  operand1=lse_tile)
        kept_loss = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)  # 0 where ignored
        nisa.tensor_tensor(dst=kept_loss, data1=loss, data2=kept, op=nl.multiply)
        nisa.dma_copy(dst=nll[tile_rows, :], src=kept_loss)
    return nll, lse


def softcap_cross_entropy_bwd_kernel(logits, targets, lse, d_nll, vocab, cap):
    """Softcap cross-entropy backward: d_logits, the logits read once and it written once.

    logits, targets, vocab, cap as for the forward; lse (N, 1) from it;
    d_nll (N, 1) fp32, the gradient of each row's loss. Returns d_logits (N, V_padded) in the logits' dtype,
    zero in the padding columns and in ignored rows.

    With t = tanh(z / cap), p = exp(cap t - lse) (the softmax) and g = d_nll for kept rows, 0 for ignored:
    d_z = g (p - onehot(target)) (1 - t^2), the chain through the cap's tanh.
    Per chunk: one DMA in, one out; ScalarE t, p (bias -lse), t^2 and 1 - t^2; VectorE onehot - p (the iota
    compared with the shifted target, minus p: one instruction), then that times -g times (1 - t^2), written
    in the logits' dtype.

    HBM: the logits read once, d_logits written once. SBUF per partition: the chunk's logits and gradient,
    t, p, t^2, 1 - t^2 and onehot - p (2 * 2 + 5 * 4 bytes a column at bf16: 48 KiB) and the iota (8 KiB);
    PSUM: none. Limits as for the forward. Engines per chunk: ScalarE 4 passes, VectorE two of two inputs
    (costed 2 each), TensorE none: VectorE is the bottleneck, ScalarE at 80% of it, the DMA at a fifth (the
    emulator at 1024 x 8192).
    """
    assert cap > 0 and 0 < vocab <= logits.shape[1], "a softcap > 0 and a vocab within the logits' width"
    n_rows, padded = logits.shape
    d_logits = nl.ndarray((n_rows, padded), logits.dtype, buffer=nl.shared_hbm)
    columns = _vocab_iota()
    ones = _constant_column(1.0)
    if padded > vocab:
        zeros = nl.ndarray((TILE, padded - vocab), logits.dtype, buffer=nl.sbuf)
        nisa.memset(dst=zeros, value=0.0)
    program_start, program_stop = _program_rows(n_rows)
    for span in _spans(program_start, program_stop, TILE):
        row, rows = span
        tile_rows = slice(row, row + rows)
        target, kept = _load_targets(targets, tile_rows, rows)
        neg_g = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)  # -g
        nisa.scalar_tensor_tensor(dst=neg_g, data=_load_tile(d_nll, tile_rows, slice(0, 1)), op0=nl.multiply,
                                  operand0=-1.0, op1=nl.multiply, operand1=kept)
        neg_lse = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=neg_lse, data=_load_tile(lse, tile_rows, slice(0, 1)), op0=nl.multiply, operand0=-1.0)
        for chunk in _spans(0, vocab, VOCAB_CHUNK):
            start, width = chunk
            z = _load_tile(logits, tile_rows, slice(start, start + width))
            t = nl.ndarray((rows, width), nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=t, op=nl.tanh, data=z, scale=1.0 / cap)
            probs = nl.ndarray((rows, width), nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=probs, op=nl.exp, data=t, bias=neg_lse, scale=cap)
            t_squared = nl.ndarray((rows, width), nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=t_squared, op=nl.square, data=t)
            slope = nl.ndarray((rows, width), nl.float32, buffer=nl.sbuf)  # 1 - t^2
            nisa.activation(dst=slope, op=nl.copy, data=t_squared, bias=ones[:rows], scale=-1.0)
            onehot_minus_p = nl.ndarray((rows, width), nl.float32, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(dst=onehot_minus_p, data=columns[:rows, :width], op0=nl.equal,
                                      operand0=_chunk_target(target, start), op1=nl.subtract, operand1=probs)
            out = nl.ndarray((rows, width), logits.dtype, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(dst=out, data=onehot_minus_p, op0=nl.multiply, operand0=neg_g,
                                      op1=nl.multiply, operand1=slope)
            nisa.dma_copy(dst=d_logits[tile_rows, start:start + width], src=out)
        if padded > vocab:
            nisa.dma_copy(dst=d_logits[tile_rows, vocab:padded], src=zeros[:rows])
    return d_logits


# softcap_cross_entropy: the PyTorch ops around the kernels, the PyTorch path, the shape rule, the checks


def _softcap_cross_entropy_shape_problem(logits, targets, cap, vocab_size):
    """None if the softcap cross-entropy kernels take these, else what stops them."""
    if logits.dtype not in _KERNEL_DTYPES:
        return f"the kernels take bfloat16 or float32 logits, not {logits.dtype}"
    if not cap:
        return ("logit_softcap=0: the kernels rely on the cap's bound on the logits (no running max); set "
                "logit_softcap > 0")
    if not 0 < vocab_size <= logits.size(-1) or vocab_size >= 2 ** 24:
        return f"vocab_size={vocab_size} must be in 1..{min(logits.size(-1), 2 ** 24 - 1)} (the logits' width)"
    if targets.shape != logits.shape[:-1]:
        return f"targets {tuple(targets.shape)} do not match the logits {tuple(logits.shape)}"
    if logits.numel() == 0:
        return "there are no rows"
    return None


def _softcap_cross_entropy_forward(logits: torch.Tensor, targets: torch.Tensor, vocab: int,
                                   cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _run_kernel(softcap_cross_entropy_fwd_kernel, logits, targets, vocab, cap)


def _softcap_cross_entropy_forward_fake(logits, targets, vocab, cap):
    column = logits.new_empty((logits.size(0), 1), dtype=torch.float32)
    return column, torch.empty_like(column)


def _softcap_cross_entropy_backward(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                                    d_nll: torch.Tensor, vocab: int, cap: float) -> torch.Tensor:
    (d_logits,) = _run_kernel(softcap_cross_entropy_bwd_kernel, logits, targets, lse, d_nll, vocab, cap)
    return d_logits


def _softcap_cross_entropy_backward_fake(logits, targets, lse, d_nll, vocab, cap):
    return torch.empty_like(logits)


def _softcap_cross_entropy_setup_context(ctx, inputs, output):
    logits, targets, ctx.vocab, ctx.cap = inputs
    ctx.save_for_backward(logits, targets, output[1])
    ctx.mark_non_differentiable(output[1])  # lse: an output only for the backward's sake


def _softcap_cross_entropy_vjp(backward_op, ctx, d_nll, _d_lse):
    logits, targets, lse = ctx.saved_tensors
    return backward_op(logits, targets, lse, d_nll.float().contiguous(), ctx.vocab, ctx.cap), None, None, None


if nki is not None:
    _softcap_cross_entropy_op = _register_kernel_ops(
        "softcap_cross_entropy", _softcap_cross_entropy_forward, _softcap_cross_entropy_forward_fake,
        _softcap_cross_entropy_backward, _softcap_cross_entropy_backward_fake, _softcap_cross_entropy_setup_context,
        _softcap_cross_entropy_vjp)


def _softcap_cross_entropy_nki(logits, targets, cap, vocab_size, reduction):
    rows = logits.reshape(-1, logits.size(-1)).contiguous()
    nll, _ = _softcap_cross_entropy_op(rows, targets.reshape(-1, 1).to(torch.int32), vocab_size, float(cap))
    if reduction == "none":
        return nll.view(targets.shape)
    return nll.sum() if reduction == "sum" else nll.sum() / (targets >= 0).sum()  # mean: over the kept targets


def _softcap_cross_entropy_torch(logits, targets, cap, vocab_size, reduction):
    logits = logits[..., :vocab_size].float()  # padding columns never win
    if cap:
        logits = cap * torch.tanh(logits / cap)
    loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=-1, reduction=reduction)
    return loss.view(targets.shape) if reduction == "none" else loss


def _softcap_cross_entropy_check_cases(shapes, dtype, device, generator):
    """Logits padded to a multiple of 128 columns (the kernel skips the padding) and some targets ignored."""
    draw = _drawing(dtype, device, generator)
    B, N, vocab, padded = shapes.batch, shapes.rows, shapes.vocab, math.ceil(shapes.vocab / TILE) * TILE
    targets = torch.randint(-1, vocab, (B, N), generator=generator).to(device)  # -1: ignored
    return [CheckCase("softcap_cross_entropy", "softcap_cross_entropy",
                      f"{B} x {N} rows, vocab {vocab} padded to {padded}", lambda: (draw(B, N, padded, scale=8.0),),
                      lambda logits, mode: softcap_cross_entropy(logits, targets, shapes.logit_softcap, vocab, "none",
                                                                 mode=mode))]


def _softcap_cross_entropy_model_cases(c, batch_size, device, dtype):
    draw = _model_drawing(device, dtype)
    B, T = batch_size, c.sequence_len
    return [("softcap_cross_entropy", 0, 0, lambda: (draw(B, T, c.padded_vocab_size, scale=8.0),),
             lambda logits, mode: softcap_cross_entropy(
                 logits, torch.arange(B * T, device=logits.device).view(B, T) % c.vocab_size, c.logit_softcap,
                 c.vocab_size, "none", mode=mode))]


HEAD_PASSES = {"forward": ((3, 0), 2), "backward": ((3, 1), 1)}  # ((VectorE 1-, 2-input), ScalarE) over the logits


def _softcap_cross_entropy_plain_ops(c, sequences, elements, plain):
    """HEAD_PASSES: the softcap and the cross-entropy as fp32 passes over the logits."""
    return {direction: [plain.passes(sequences * c.sequence_len * c.vocab_size, *vector, scalar)]
            for direction, (vector, scalar) in HEAD_PASSES.items()}


SOFTCAP_CROSS_ENTROPY_OP = _declare(KernelOp(
    name="softcap_cross_entropy", call=softcap_cross_entropy,
    kernels=(softcap_cross_entropy_fwd_kernel, softcap_cross_entropy_bwd_kernel),
    torch_path=_softcap_cross_entropy_torch, shape_problem=_softcap_cross_entropy_shape_problem, cost_problem=None,
    check_cases=_softcap_cross_entropy_check_cases, model_cases=_softcap_cross_entropy_model_cases,
    plain_ops=_softcap_cross_entropy_plain_ops,
    kill_matrix=("softcap_cross_entropy",),
    tests="test_cross_entropy_kernel.py"))


# =============================================================================
# rope_norm: RoPE + QK-norm from the projection's (B, T, H*D) rows into attention's (B, H, T, D) heads


def rope_norm(x, cos, sin, n_heads, eps=1e-6, mode="auto"):
    """rms_norm(rotary(heads)) of x (B, T, n_heads * D): RoPE, then QK-norm, into (B, n_heads, T, D).

    x (B, T, n_heads * D) as a q or k projection makes it; cos, sin (T, D / 2). Returns (B, n_heads, T, D)
    contiguous in x's dtype, attention's layout. On NKI (rope_norm_fwd_kernel, rope_norm_bwd_kernel) one pass
    over x each way, the layout changed by the kernel's stores; the PyTorch path views x as heads, rotates
    the pairs (x[..., i], x[..., i + D/2]) (the "half split" convention) and norms them through `rms_norm`
    (its own op)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if _use_nki(ROPE_NORM_OP.name, mode, x.device.type, _rope_norm_shape_problem(x, cos, n_heads)):
        return _rope_norm_nki(x, cos, sin, n_heads, eps)
    return _rope_norm_torch(x, cos, sin, n_heads, eps, mode)


ROPE_NORM_MAX_WIDTH = 2048  # H * D: three steps' (128, 4, H * D) fp32 x tiles in SBUF, beside the heads' tiles
ROPE_WIDE_HEAD = 256  # widest head dim taken 4 tokens a partition (_rope_steps)


def _rope_steps(batch, seq_len, head_dim):
    """This program's (b, start, partitions, tokens per partition) steps.

    At head_dim <= ROPE_WIDE_HEAD, 512 tokens go as (128, 4), 4 consecutive tokens per partition (one
    contiguous run in x, in each head of y and in the tables), where they make whole 128-token tiles; else
    (and for wider heads, whose tiles, three steps of them buffered, would not fit SBUF at 4 tokens a
    partition) 128-token tiles, one token per partition. The steps of all sequences are split evenly
    between the programs of an LNC launch."""
    per_part = 4 if head_dim <= ROPE_WIDE_HEAD else 1
    steps = []
    for b in range(batch):
        for span in _spans(0, seq_len, per_part * TILE):
            start, width = span
            if width % TILE == 0:
                steps.append((b, start, TILE, width // TILE))
            else:
                for piece in _spans(start, start + width, TILE):
                    steps.append((b, piece[0], piece[1], 1))
    per_program = math.ceil(len(steps) / nl.num_programs())
    first = min(len(steps), nl.program_id(0) * per_program)
    mine = []
    for s in range(first, min(len(steps), first + per_program)):
        mine.append(steps[s])
    return mine


def _slots(tile):
    """tile[:, j, :] of a (P, J, D) tile, for each slot j: one (token, head) per partition each."""
    slots = []
    for j in range(tile.shape[1]):
        slots.append(tile[:, j, :])
    return slots


def _rotate_head(dst, src, cos_sin, inverse):
    """dst = rope of the head src (both (P, J, D)), sin negated if `inverse`, each step rounded.

    The half split: (x1 cos - x2 sin, x2 cos + x1 sin), rounded to dst's dtype after each product and sum
    as the model's PyTorch rotary rounds. GpSimd makes the sin products, VectorE the rest."""
    cos_tile, sin_tile = cos_sin
    half = cos_tile.shape[2]
    x1, x2, out1, out2 = src[:, :, 0:half], src[:, :, half:2 * half], dst[:, :, 0:half], dst[:, :, half:2 * half]
    sin_x2 = nl.ndarray(cos_tile.shape, dst.dtype, buffer=nl.sbuf)
    sin_x1 = nl.ndarray(cos_tile.shape, dst.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=sin_x2, data1=x2, data2=sin_tile, op=nl.multiply, engine=nisa.gpsimd_engine)
    nisa.tensor_tensor(dst=sin_x1, data1=x1, data2=sin_tile, op=nl.multiply, engine=nisa.gpsimd_engine)
    nisa.tensor_tensor(dst=out1, data1=x1, data2=cos_tile, op=nl.multiply)
    nisa.tensor_tensor(dst=out1, data1=out1, data2=sin_x2, op=nl.add if inverse else nl.subtract)
    nisa.tensor_tensor(dst=out2, data1=x2, data2=cos_tile, op=nl.multiply)
    nisa.tensor_tensor(dst=out2, data1=out2, data2=sin_x1, op=nl.subtract if inverse else nl.add)


def _load_rope_step(src, cos, sin, b, tokens, parts):
    """src[b, tokens] and the tokens' cos and sin, as (parts, J, .) tiles."""
    tiles = []
    for t in (src[b, tokens, :], cos[tokens, :], sin[tokens, :]):
        tile = nl.ndarray((parts, (tokens.stop - tokens.start) // parts, t.shape[-1]), src.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=t)
        tiles.append(tile)
    return tiles[0], (tiles[1], tiles[2])


def _slot_mean_squares(slots, eps, squares):
    """mean(x^2) + eps of each slot, a fp32 (P, len(slots)) tile: ScalarE squares and sums each slot (into
    `squares`, slots of the same shapes, unread), the mean is one VectorE instruction for all the slots."""
    parts, dim, count = slots[0].shape[0], slots[0].shape[1], len(slots)
    sum_sq = nl.ndarray((parts, count), nl.float32, buffer=nl.sbuf)
    for c in range(count):
        nisa.activation_reduce(dst=squares[c], op=nl.square, data=slots[c], reduce_op=nl.add,
                               reduce_res=sum_sq[:, c:c + 1])
    mean_sq = nl.ndarray((parts, count), nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=mean_sq, data=sum_sq, op0=nl.multiply, operand0=1.0 / dim, op1=nl.add, operand1=eps)
    return mean_sq


def _slot_rsqrt(mean_sq):
    """1 / sqrt of each value of a (P, n) tile: one GpSimd instruction (nl.rsqrt's engine)."""
    rstd = nl.ndarray(mean_sq.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=rstd, data=mean_sq, op0=nl.rsqrt, operand0=0.0, engine=nisa.gpsimd_engine)
    return rstd


def rope_norm_fwd_kernel(x, cos, sin, n_heads, eps):
    """RoPE, then RMSNorm (no weight) of each head, from projection rows into attention's head layout.

    x (B, T, H * D) bf16 or fp32, a q or k projection as its matmul wrote it; cos, sin (T, D / 2) in x's
    dtype. Returns y (B, H, T, D): z = rope(x) rounded to x's dtype (as the model's PyTorch path rounds it),
    y = z / sqrt(mean(z^2) + eps).

    Per step (_rope_steps: 128 partitions x 4 tokens): one DMA brings every head of the tokens, one each
    cos and sin, for all heads; per head VectorE and GpSimd rotate (_rotate_head) into the head's own tile;
    ScalarE squares and sums each (token, head), VectorE and GpSimd make rstd, ScalarE writes z * rstd (its
    free scale); one DMA per head stores (128, 4, D) into y[b, h]: the layout change is the store's access
    pattern. Each head has its own tiles because the schedule orders accesses to one tile by the byte range
    they span, and a head's slice of a (P, 4, H D) tile spans its neighbours' bytes. HBM traffic: x read
    once, y written once (apart: the rotary's four bf16 passes and the norm's read and write). SBUF per
    partition: x of up to three steps and two head tiles per unit in flight (one token a partition above
    ROPE_WIDE_HEAD). PSUM, TensorE: none. GpSimd, VectorE, ScalarE and DMA about equally busy. Limits
    (asserted here): H D <= 2048, D even; any T.

    Order: step after step (`_rope_steps`), head after head: the plain form (a software pipeline across units was
    within the model's error of it under the compiler's list schedule, docs/results.md; nki-library's rope.py goes
    in natural order). The per-head tiles are what made it fast, not the pipeline.
    """
    assert x.shape[2] <= ROPE_NORM_MAX_WIDTH and x.shape[2] // n_heads % 2 == 0, \
        "n_heads * head_dim at most 2048 (ROPE_NORM_MAX_WIDTH), head_dim even"
    batch, seq_len, width = x.shape
    dim = width // n_heads
    y = nl.ndarray((batch, n_heads, seq_len, dim), x.dtype, buffer=nl.shared_hbm)
    steps = _rope_steps(batch, seq_len, dim)
    for s in range(len(steps)):
        b, start, parts, per_part = steps[s]
        tokens = slice(start, start + parts * per_part)
        x_all, cos_sin = _load_rope_step(x, cos, sin, b, tokens, parts)
        for h in range(n_heads):
            z = nl.ndarray((parts, per_part, dim), x.dtype, buffer=nl.sbuf)  # rope(x), then its squares
            out = nl.ndarray((parts, per_part, dim), x.dtype, buffer=nl.sbuf)
            _rotate_head(z, x_all[:, :, h * dim:(h + 1) * dim], cos_sin, False)
            rstd = _slot_rsqrt(_slot_mean_squares(_slots(z), eps, _slots(out)))
            z_slots, out_slots = _slots(z), _slots(out)
            for c in range(len(z_slots)):
                nisa.activation(dst=out_slots[c], op=nl.copy, data=z_slots[c], scale=rstd[:, c:c + 1])
            nisa.dma_copy(dst=y[b, h, tokens, :], src=out)
    return y


def rope_norm_bwd_kernel(dy, x, cos, sin, eps):
    """Backward of rope_norm_fwd_kernel: dx (B, T, H * D) from dy (B, H, T, D) in x's dtype.

    The rotation R is orthogonal, so rms(R x) = rms(x) = 1/r and y = r R x: with g = R^T dy (rope with -sin),
    dx = r (g + c x), c = -r^2 mean(x g), RMSNorm's backward of x applied to g.
    Per step: x, cos and sin once; per head of the step (a unit), in the head's own tiles: dy (one DMA),
    rotated back by GpSimd and VectorE; r from x (ScalarE squares and sums, VectorE's mean, GpSimd's
    rsqrt); GpSimd's x g, summed per token by ScalarE's accumulator scaled by -1/D; c in two tiny
    instructions; VectorE's x c and + g; ScalarE's r * that; one DMA stores the head's columns of dx.
    HBM traffic: x and dy read, dx written, once each. SBUF per partition: three steps' x and up to nine
    head tiles in flight (heads wider than ROPE_WIDE_HEAD go one token a partition for this: 4 tokens of one
    2048-wide fp32 head would need 229,424 bytes), within SBUF_BUDGET. PSUM, TensorE: none. GpSimd and
    VectorE about equally busy, ~1.4x the DMA time. Limits as for the forward (asserted here).

    Order: step after step, head after head, as the forward's.
    """
    assert dy.shape[1] * dy.shape[3] <= ROPE_NORM_MAX_WIDTH and dy.shape[3] % 2 == 0, \
        "n_heads * head_dim at most 2048 (ROPE_NORM_MAX_WIDTH), head_dim even"
    batch, n_heads, seq_len, dim = dy.shape
    dx = nl.ndarray((batch, seq_len, n_heads * dim), x.dtype, buffer=nl.shared_hbm)
    steps = _rope_steps(batch, seq_len, dim)
    for s in range(len(steps)):
        b, start, parts, per_part = steps[s]
        tokens = slice(start, start + parts * per_part)
        x_all, cos_sin = _load_rope_step(x, cos, sin, b, tokens, parts)
        for h in range(n_heads):
            dy_head = nl.ndarray((parts, per_part, dim), x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=dy_head, src=dy[b, h, tokens, :])
            out = _rope_norm_bwd_head(x_all[:, :, h * dim:(h + 1) * dim], dy_head, cos_sin, eps)
            nisa.dma_copy(dst=dx[b, tokens, h * dim:(h + 1) * dim], src=out)
    return dx


def _rope_norm_bwd_head(x_head, dy_head, cos_sin, eps):
    """dx of one head of a step, (P, J, D) in x's dtype: g = rope^-1(dy) (GpSimd, VectorE); r from x (ScalarE
    squares and sums, VectorE's mean, GpSimd's rsqrt); x g (GpSimd) summed per token by ScalarE's accumulator
    scaled by -1/D; c = -r^2 mean(x g) in two tiny instructions; x c + g (VectorE); r times that (ScalarE)."""
    shape, dtype, dim = x_head.shape, dy_head.dtype, x_head.shape[2]
    g = nl.ndarray(shape, dtype, buffer=nl.sbuf)
    scratch = nl.ndarray(shape, dtype, buffer=nl.sbuf)  # the squares, x g, then x c + g
    out = nl.ndarray(shape, dtype, buffer=nl.sbuf)
    _rotate_head(g, dy_head, cos_sin, True)
    mean_sq = _slot_mean_squares(_slots(x_head), eps, _slots(scratch))
    nisa.tensor_tensor(dst=scratch, data1=x_head, data2=g, op=nl.multiply, engine=nisa.gpsimd_engine)
    rstd = _slot_rsqrt(mean_sq)
    x_slots, scratch_slots, out_slots = _slots(x_head), _slots(scratch), _slots(out)
    neg_mean = nl.ndarray(rstd.shape, nl.float32, buffer=nl.sbuf)  # -mean(x g)
    for c in range(len(x_slots)):
        nisa.activation_reduce(dst=scratch_slots[c], op=nl.copy, data=scratch_slots[c], reduce_op=nl.add,
                               reduce_res=neg_mean[:, c:c + 1], scale=-1.0 / dim)
    x_coef = nl.ndarray(rstd.shape, nl.float32, buffer=nl.sbuf)  # c = -r^2 mean(x g)
    nisa.tensor_tensor(dst=x_coef, data1=neg_mean, data2=rstd, op=nl.multiply)
    nisa.tensor_tensor(dst=x_coef, data1=x_coef, data2=rstd, op=nl.multiply)
    for c in range(len(x_slots)):
        nisa.tensor_scalar(dst=out_slots[c], data=x_slots[c], op0=nl.multiply, operand0=x_coef[:, c:c + 1])
    nisa.tensor_tensor(dst=scratch, data1=out, data2=g, op=nl.add)
    for c in range(len(scratch_slots)):
        nisa.activation(dst=out_slots[c], op=nl.copy, data=scratch_slots[c], scale=rstd[:, c:c + 1])
    return out


# rope_norm: the PyTorch ops around the kernels, the PyTorch path, the shape rule, the checks


def _rope_norm_shape_problem(x, cos, n_heads):
    """None if the RoPE + QK-norm kernels take x and the tables, else what stops them."""
    if x.size(-1) > ROPE_NORM_MAX_WIDTH:
        return f"n_heads * head_dim = {x.size(-1)} is over {ROPE_NORM_MAX_WIDTH} (SBUF); use fewer or smaller heads"
    if cos.shape != (x.size(1), x.size(-1) // n_heads // 2):
        return f"the rotary tables {tuple(cos.shape)} are not (T, head_dim / 2) for x {tuple(x.shape)}"
    return _rms_norm_shape_problem(x)


def _rope_norm_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
                       eps: float) -> torch.Tensor:
    return _run_kernel(rope_norm_fwd_kernel, x, cos, sin, n_heads, eps)[0]


def _rope_norm_forward_fake(x, cos, sin, n_heads, eps):
    return x.new_empty((x.size(0), n_heads, x.size(1), x.size(2) // n_heads))


def _rope_norm_backward(dy: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        eps: float) -> torch.Tensor:
    return _run_kernel(rope_norm_bwd_kernel, dy, x, cos, sin, eps)[0]


def _rope_norm_backward_fake(dy, x, cos, sin, eps):
    return torch.empty_like(x)


def _rope_norm_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3])
    ctx.eps = inputs[4]


def _rope_norm_vjp(backward_op, ctx, dy):
    x, cos, sin = ctx.saved_tensors
    return backward_op(dy.to(x.dtype).contiguous(), x, cos, sin, ctx.eps), None, None, None, None


if nki is not None:
    _rope_norm_op = _register_kernel_ops("rope_norm", _rope_norm_forward, _rope_norm_forward_fake, _rope_norm_backward,
                                         _rope_norm_backward_fake, _rope_norm_setup_context, _rope_norm_vjp)


def _rope_norm_nki(x, cos, sin, n_heads, eps):
    return _rope_norm_op(x.contiguous(), cos.contiguous(), sin.contiguous(), n_heads, eps)


def _rope_norm_torch(x, cos, sin, n_heads, eps, mode):
    x1, x2 = x.view(*x.shape[:2], n_heads, -1).transpose(1, 2).chunk(2, dim=-1)
    return rms_norm(torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1), eps=eps, mode=mode)


def _rotary_angles(seq_len, head_dim, generator=None):
    """cos and sin of random angles, (seq_len, head_dim / 2) each: tables a rotation could have (the kernels'
    backward relies on cos^2 + sin^2 = 1), without model.py, which the submission leaves out of this file."""
    angles = torch.rand(seq_len, head_dim // 2, generator=generator) * (2 * math.pi)
    return angles.cos(), angles.sin()


def _rope_norm_check_cases(shapes, dtype, device, generator):
    """q and k of one layer, as the model calls it, at each attention shape without a window (it takes none)."""
    draw = _drawing(dtype, device, generator)
    cases = []
    for a in shapes.attention:
        if a.window is not None:
            continue
        tables = [t.to(device) for t in _rotary_angles(a.seq_len, a.head_dim, generator)]  # not inputs
        cases.append(CheckCase(
            "rope_norm", "rope_norm", _heads_in_words(a),
            lambda a=a: (draw(a.batch, a.seq_len, a.n_head * a.head_dim), draw(a.batch, a.seq_len,
                                                                               a.n_kv_head * a.head_dim)),
            lambda q, k, mode, a=a, tables=tables: torch.cat(
                (rope_norm(q, *tables, a.n_head, mode=mode).flatten(),
                 rope_norm(k, *tables, a.n_kv_head, mode=mode).flatten()))))
    return cases


def _rope_norm_model_cases(c, batch_size, device, dtype):
    """q and k of one attention layer as one case: the step prices them together."""
    draw = _model_drawing(device, dtype)
    B, T, D = batch_size, c.sequence_len, c.head_dim
    tables = [t.to(device) for t in _rotary_angles(T, D)]
    return [("rope_norm", 0, 0, lambda: (draw(B, T, c.n_head * D), draw(B, T, c.n_kv_head * D)),
             lambda q, k, mode: torch.cat((rope_norm(q, *tables, c.n_head, mode=mode).flatten(),
                                           rope_norm(k, *tables, c.n_kv_head, mode=mode).flatten())))]


def _rope_norm_plain_ops(c, sequences, elements, plain):
    """q and k: the rotary's bf16 passes each way, then QK-norm's (rms_norm's) over them."""
    elements = sequences * c.sequence_len * (c.n_head + c.n_kv_head) * c.head_dim
    norm = _rms_norm_plain_ops(c, sequences, elements, plain)
    return {direction: [plain.passes(elements, one_input=1, two_input=3, dtype="bfloat16")] + norm[direction]
            for direction in ("forward", "backward")}


ROPE_NORM_OP = _declare(KernelOp(
    name="rope_norm", call=rope_norm,
    kernels=(rope_norm_fwd_kernel, rope_norm_bwd_kernel),
    torch_path=_rope_norm_torch, shape_problem=_rope_norm_shape_problem, cost_problem=None,
    check_cases=_rope_norm_check_cases, model_cases=_rope_norm_model_cases, plain_ops=_rope_norm_plain_ops,
    kill_matrix=("rope_norm",),
    tests="test_rope_norm_kernel.py"))


KERNEL_OPS = tuple(OPS)  # what a per-op kernels setting may name: every declared op, in declaration order

"""
What the compiler generates around the NKI kernels, priced for one Trn2 NeuronCore with the emulator's cost
model (nki_emulator/_cost.py): bf16 matmuls tiled into nc_matmuls, elementwise passes on VectorE and ScalarE,
HBM traffic, and the compiler's fusion of elementwise chains (FUSION_RULES, fuse). An op is a list of (count,
instruction); its time is its busiest engine. bench.py's step estimate
prices the projections, the head, the optimizer and every kernel op's compiled fallback (compiled_ops) with
it; the step estimate's assumptions, these prices' included, are STEP_ASSUMPTIONS.
"""
import math
import types
from typing import NamedTuple

import kernels
import nki_emulator

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma")
# How the compiler fuses the elementwise work around the matmuls (fuse). Sources: aws-neuron/aws-neuron-sdk at
# 3afa0fdf (Neuron 2.30.0): [STAGES] nki/index.rst l. 29-36, the compiler's stages; [FUSE] nki/deep-dives/
# nki_perf_guide.rst l. 150-182, Opt #2 "Fuse operations"; [EAGER] frameworks/torch/pytorch-native-overview.rst l. 35.
FUSION_RULES = (
    "fusion 1: a chain of elementwise ops over the same values, each consuming the one before, is one loop nest: "
    "it reads its inputs from HBM once and writes its results once, its intermediates stay in SBUF (the compiler "
    "does operator fusion in its XLA front end and loop fusion on the loop nests, nki/index.rst l. 29-36; the "
    "fused form is 'load, op0, op1, store', nki_perf_guide.rst l. 150-178)",
    "fusion 2: the row reductions inside those chains (softmax's max and sum, RMSNorm's mean of squares, the "
    "cross-entropy's log-sum-exp) do not end them: a reduction runs within a partition, and the rows reduced here "
    "(the width, a head, the context, the contest's 8,192-token vocab: at most 32 KiB in fp32) stay in the "
    "212,984 bytes of SBUF a partition offers (KLR Trace.lean l. 52-54) for the ops after it",
    "fusion 3: a matmul's result goes to HBM and its consumers read it back: no fusion through a matmul; "
    "attention's T x T scores spill (nki_perf_guide.rst l. 180-182: one head's scores 'overflow SBUF in "
    "common Transformer models with a context length in the thousands')",
    "fusion 4: eager mode fuses the same chains: TorchNeuron's Adaptive Eager Execution 'applies optimizations "
    "such as operator fusion' (pytorch-native-overview.rst l. 35); the organiser's eager baseline ran 1.28 s a "
    "step, faster than its unfused device time (1.94 s central, every pass an HBM round trip)",
)
STEP_ASSUMPTIONS = (  # every assumption of step_estimate, in one place (--step_estimate prints them)
    "ranks are LNC=1 NeuronCores of Trn2, priced with the emulator's cost model (nki_emulator/_cost.py)",
    "NKI kernels (attention, MLP, RMSNorm, the residual add fused with RMSNorm, the head's softcap "
    "cross-entropy, RoPE fused with QK-norm; forward + backward) cost their "
    "emulated trace for one sequence at the overlap bound (busiest engine), times the sequences of a step; "
    "without the RoPE + QK-norm kernel, RMSNorm on q and k costs the same per element as on the model's rows, in "
    "bf16, after the rotary's elementwise passes; on the residual "
    "stream and the embedding, which stay fp32 under autocast, the norm and the fused residual add + norm are "
    "priced on fp32 rows (a branch added to the stream is bf16)",
    "an op without its kernel (kernels=torch, or shapes the kernel refuses, e.g. head_dim > 256) is compiled as "
    "plain ops: its matmuls, plus elementwise passes (attention: the full T x T scores in fp32, mask, max, exp, "
    "normalise, cast forward, 2 passes backward)",
    "matmuls outside the kernels (q/k/v/o projections, lm_head, Muon's) tile into 128 x 128 x 512 bf16 nc_matmuls "
    "at the ISA cost; the backward is the two matmuls for dX and dW; each PSUM tile is evicted once, by VectorE and "
    "ScalarE in turn; the operands and the result cross HBM once",
    "elementwise ops outside the kernels run as one 128-partition instruction each at the cost model's "
    "VectorE/ScalarE rates, fused as FUSION_RULES say (the pessimistic figure: not fused, each reads its inputs "
    "from HBM and writes its result back); without its kernel the head's softcap and cross-entropy are 5 fp32 "
    "passes over the logits forward and 5 backward",
    "within an op (a fused loop nest, or a matmul) the engines overlap (its time is its busiest engine); ops run "
    "one after another",
    "Muon (optim.muon_update): 5 Polar Express iterations of 3 bf16 matmuls, 15 one-input and 6 two-input fp32 "
    "passes per matrix element; AdamW: 3 one-input and 5 two-input fp32 passes per parameter; gradient clipping "
    "2 passes apart (a norm over all gradients, then a scale); accumulation 1 two-input pass per micro-step after "
    "the first. Sharded (optim.Sharding, the default "
    "with more than one rank), the optimizer work of the busiest rank's share (optim.shard_layout); else all of it",
    "the gradients' exchange through one core's DMA queues as ring collectives: sharded, a reduce-scatter and an "
    "all-gather of the padded buffer, 2 (R - 1) / R x 4 bytes x R x the longest share; DDP, one all-reduce, "
    "2 (R - 1) / R x 4 bytes x parameters",
    *FUSION_RULES,
    "left out: host dispatch idle and eager dispatch (bench.py names them beside the public runs: a measured "
    "host idle share is taken out of the measured rate; an eager run's dispatch is host work overlapped with the "
    "device), compilation, data loading, dependencies between ops' engines, the compiler's spills in the "
    "compiled ops (the kernels' are priced) and its instruction selection (each op stays one instruction), the levers' extra work (value embeddings, "
    "multi-token prediction, EMA, batch warm-up)",
)
MUON_PASSES = (15, 6)  # one-input, two-input fp32 passes per element: counted in optim.muon_update
ADAMW_PASSES = (3, 5)  # lerp of m, v; sqrt, divide, step (torch's AdamW)


def instruction(engine, name, elements, inputs, dtype, ops=("add",)):
    """`elements` values through one instruction on 128 partitions (the compiler's ideal tiling)."""
    return nki_emulator.Instruction(name, engine, 128, math.ceil(elements / 128), (dtype,) * (1 + inputs),
                                    ("sbuf",) * (1 + inputs), ops)


def hbm(elements, dtype):
    """`elements` values moved between HBM and SBUF in 128-partition rows."""
    return nki_emulator.Instruction("dma_copy", "dma", 128, math.ceil(elements / 128), (dtype, dtype),
                                    ("sbuf", "shared_hbm"))


class Node(NamedTuple):
    """One op of a compiled graph. `kind`: "elementwise" (its loop runs over its output's values; an input may
    be one value a row, broadcast) or "matmul" (anything the compiler does not fuse through); `compute`: its
    (count, Instruction) pairs on the compute engines."""
    output: str
    inputs: tuple
    kind: str
    compute: tuple = ()


def fuse(nodes, tensors):
    """The loop nests the compiler makes of `nodes` (in program order), as lists of nodes (FUSION_RULES): a node
    joins the loop nest of its latest producer where neither is a matmul and both loop over as many values; else
    it starts one. `tensors`: {name: (elements, dtype)}."""
    groups, home = [], {}
    for node in nodes:
        producers = [home[name] for name in node.inputs if name in home]
        latest = max(producers, default=None)
        group = groups[latest] if latest is not None else None
        if group and node.kind != "matmul" and all(n.kind != "matmul" for n in group) \
                and tensors[node.output][0] == tensors[group[0].output][0]:
            group.append(node)
        else:
            groups.append([node])
            latest = len(groups) - 1
        home[node.output] = latest
    return groups


def group_op(group, nodes, tensors, outputs):
    """One fused loop nest as an op: its nodes' compute, each tensor it reads from outside read from HBM once, and
    each tensor it makes that is read outside it (or is one of the graph's `outputs`) written to HBM once."""
    made = [n.output for n in group]
    read_outside = {name for n in nodes if n not in group for name in n.inputs} | set(outputs)
    reads = dict.fromkeys(name for n in group for name in n.inputs if name not in made)
    writes = [name for name in made if name in read_outside]
    op = [pair for n in group for pair in n.compute]
    return op + [(1, hbm(tensors[name][0], tensors[name][1])) for name in [*reads, *writes]]


def graph_ops(nodes, tensors, outputs, fused=True):
    """The ops a graph runs as: one per fused loop nest, or (fused=False) one per node, each its own loop."""
    groups = fuse(nodes, tensors) if fused else [[n] for n in nodes]
    return [group_op(group, nodes, tensors, outputs) for group in groups]


def chain(elements, one_input=0, two_input=0, scalar=0, dtype="float32"):
    """Elementwise passes over `elements` values as a graph: one value read, each pass applied to the last one's
    result (a two-input pass also reads an operand of the same size), one value written."""
    tensors, nodes, last = {"x": (elements, dtype)}, [], "x"
    kinds = ([("vector", "tensor_scalar", 1, ("multiply",))] * one_input
             + [("vector", "tensor_tensor", 2, ("multiply",))] * two_input
             + [("scalar", "activation", 1, ("exp",))] * scalar)
    for step, (engine, name, inputs, ops) in enumerate(kinds):
        operands = (last,) + ((f"operand{step}",) if inputs == 2 else ())
        tensors.update({f"operand{step}": (elements, dtype), f"t{step}": (elements, dtype)})
        nodes.append(Node(f"t{step}", operands, "elementwise", ((1, instruction(engine, name, elements, inputs,
                                                                                  dtype, ops)),)))
        last = f"t{step}"
    return nodes, tensors, [last]


def passes(elements, one_input=0, two_input=0, scalar=0, dtype="float32"):
    """Elementwise passes over `elements` values (chain), as the compiler builds them: one fused loop nest
    (unless fusing[-1] is False: then each pass reads its inputs from HBM and writes its result back)."""
    return [pair for op in graph_ops(*chain(elements, one_input, two_input, scalar, dtype), fused=fusing[-1])
            for pair in op]


def gemm(m, k, n, batch=1):
    """(m, k) @ (k, n), `batch` times, in bf16: the tiles as nc_matmuls, their PSUM evictions, the HBM traffic."""
    out_tiles = batch * math.ceil(m / 128) * math.ceil(n / 512)
    tiles, width = out_tiles * math.ceil(k / 128), min(n, 512)
    matmul = nki_emulator.Instruction("nc_matmul", "tensor", min(k, 128), width, ("float32", "bfloat16", "bfloat16"),
                                      ("psum", "sbuf", "sbuf"), stationary=min(m, 128))
    evict = [nki_emulator.Instruction("tensor_copy", engine, min(m, 128), width, ("bfloat16", "float32"),
                                      ("sbuf", "psum")) for engine in ("vector", "scalar")]
    return [(tiles, matmul), (out_tiles / 2, evict[0]), (out_tiles / 2, evict[1]),
            (1, hbm(batch * (m * k + k * n + m * n), "bfloat16"))]


def linear(tokens, fan_in, fan_out):
    """A bias-free linear layer over `tokens` rows: forward, and backward's dX and dW."""
    return {"forward": gemm(tokens, fan_in, fan_out),
            "backward": gemm(tokens, fan_out, fan_in) + gemm(fan_out, tokens, fan_in)}


PLAIN = types.SimpleNamespace(gemm=gemm, linear=linear, passes=passes)  # what KernelOp.plain_ops builds ops with
pricing = [nki_emulator.instruction_seconds]  # how compiled ops are priced: the cost model, or (central) calibrated
fusing = [True]  # whether elementwise chains fuse (FUSION_RULES), or (pessimistic) each pass crosses HBM


def engine_seconds(op):
    """{engine: busy seconds} of an op, over (count, instruction) pairs."""
    engines = dict.fromkeys(ENGINES, 0.0)
    for count, instruction in op:
        engines[instruction.engine] += count * pricing[-1](instruction, "trn2")
    return engines


def op_seconds(op):
    """An op's time: its busiest engine."""
    return max(engine_seconds(op).values())


def compiled_ops(name, c, sequences, norm_elements=None):
    """{"forward": ops, "backward": ops} of kernel op `name` (one of kernels.KERNEL_OPS) compiled as plain
    ops instead (STEP_ASSUMPTIONS), for one layer and `sequences` sequences, as its declaration says
    (KernelOp.plain_ops); each op a list of (count, instruction). RMSNorm is priced over `norm_elements` values
    (default: the sequences' residual stream)."""
    return kernels.OPS[name].plain_ops(c, sequences, norm_elements, PLAIN)


def compiled_estimate(ops):
    """A sequence of ops run one after another: estimate_s (the sum of each op's busiest engine), the engines'
    busy seconds summed over the ops, and the bottleneck (the busiest engine overall)."""
    engines = dict.fromkeys(ENGINES, 0.0)
    for op in ops:
        for engine, seconds in engine_seconds(op).items():
            engines[engine] += seconds
    return {"estimate_s": sum(op_seconds(op) for op in ops), "engines": engines,
            "bottleneck": max(engines, key=engines.get)}

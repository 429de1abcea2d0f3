"""
What the compiler generates around the NKI kernels, priced for one Trn2 NeuronCore with the emulator's cost
model (nki_emulator/_cost.py): bf16 matmuls tiled into nc_matmuls, elementwise passes on VectorE and ScalarE,
HBM traffic. An op is a list of (count, instruction); its time is its busiest engine. bench.py's step estimate
prices the projections, the head, the optimizer and every kernel op's compiled fallback (compiled_ops) with
it; the step estimate's assumptions, these prices' included, are STEP_ASSUMPTIONS.
"""
import math
import types

import kernels
import nki_emulator

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma")
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
    "VectorE/ScalarE rates, and each reads its inputs from HBM and writes its result to HBM (no fusion across "
    "ops); without its kernel the head's softcap and cross-entropy are 5 fp32 passes over the logits forward "
    "and 5 backward",
    "within an op the engines overlap (its time is its busiest engine); ops run one after another",
    "Muon (optim.muon_update): 5 Polar Express iterations of 3 bf16 matmuls, 15 one-input and 6 two-input fp32 "
    "passes per matrix element; AdamW: 3 one-input and 5 two-input fp32 passes per parameter; gradient clipping "
    "2 passes; accumulation 1 two-input pass per micro-step after the first. Sharded (optim.Sharding, the default "
    "with more than one rank), the optimizer work of the busiest rank's share (optim.shard_layout); else all of it",
    "the gradients' exchange through one core's DMA queues as ring collectives: sharded, a reduce-scatter and an "
    "all-gather of the padded buffer, 2 (R - 1) / R x 4 bytes x R x the longest share; DDP, one all-reduce, "
    "2 (R - 1) / R x 4 bytes x parameters",
    "left out: host dispatch and eager per-op launch (where measured runs lose most), compilation, data "
    "loading, dependencies between ops' engines, compiler fusion and spills, the levers' extra work (value "
    "embeddings, multi-token prediction, EMA, batch warm-up)",
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


def passes(elements, one_input=0, two_input=0, scalar=0, dtype="float32"):
    """Elementwise passes over `elements` values, each reading its inputs from HBM and writing to HBM."""
    op = [(one_input, instruction("vector", "tensor_scalar", elements, 1, dtype, ("multiply",))),
          (two_input, instruction("vector", "tensor_tensor", elements, 2, dtype, ("multiply",))),
          (scalar, instruction("scalar", "activation", elements, 1, dtype, ("exp",)))]
    return op + [(2 * one_input + 3 * two_input + 2 * scalar, hbm(elements, dtype))]


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

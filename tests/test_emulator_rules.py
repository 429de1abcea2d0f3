"""The emulator's documented rules, one pair of kernels per rule: one breaks the rule and is refused with the source
named in the message, its twin differs in that one point and runs. Each rule's source (file and line) is cited in
nki_emulator/ beside the check and in docs/kernels.md's rule table. Default target trn2, default NKI 0.4 (the
contest's); a pair that needs another names it. Tiny shapes: the whole file runs in a few seconds."""

from typing import NamedTuple

import ml_dtypes
import numpy as np
import pytest

import nki_emulator
import nki_emulator.isa as nisa
import nki_emulator.language as nl
from nki_emulator import NkiValidationError


@pytest.fixture(autouse=True)
def _defaults():
    target, version = nki_emulator.set_target("trn2"), nki_emulator.set_nki_version("0.4")
    yield
    nki_emulator.set_target(target)
    nki_emulator.set_nki_version(version)


def x_in(shape=(8, 16), dtype=np.float32):
    return np.random.default_rng(0).uniform(0.5, 2.0, shape).astype(dtype)


# ---- helpers the kernels share (inside the NKI subset, as kernels' helpers must be) ----------------------------

def load(x, dtype=None):
    tile = nl.ndarray(x.shape, dtype or x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=x)
    return tile


def sbuf(shape, dtype=nl.float32):
    return nl.ndarray(shape, dtype, buffer=nl.sbuf)


def psum(shape, dtype=nl.float32):
    return nl.ndarray(shape, dtype, buffer=nl.psum)


def store(t):
    out = nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


# ---- operator and activation tables (nki.api.shared.rst) and the release notes' known issues ------------------

def tensor_tensor_with(op):
    def kernel(x):
        t = load(x)
        nisa.tensor_tensor(dst=t, data1=t, data2=t, op=op)
    return kernel


def tensor_scalar_with(op0, operand0):
    def kernel(x):
        t = load(x)
        nisa.tensor_scalar(dst=t, data=t, op0=op0, operand0=operand0)
    return kernel


def tensor_scalar_operand1_without_op1(x):
    t = load(x)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=3.0, operand1=2.0)


def tensor_scalar_operand1_with_op1(x):
    t = load(x)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=3.0, op1=nl.multiply, operand1=2.0)


def scalar_tensor_tensor_divide(x):
    t = load(x)
    nisa.scalar_tensor_tensor(dst=t, data=t, op0=nl.multiply, operand0=2.0, op1=nl.divide, operand1=t)


def scalar_tensor_tensor_add(x):
    t = load(x)
    nisa.scalar_tensor_tensor(dst=t, data=t, op0=nl.multiply, operand0=2.0, op1=nl.add, operand1=t)


def scan_with_unary(x):
    t = load(x)
    nisa.tensor_tensor_scan(dst=t, data0=t, data1=t, initial=0.0, op0=nl.abs, op1=nl.add)


def scan_with_binary(x):
    t = load(x)
    nisa.tensor_tensor_scan(dst=t, data0=t, data1=t, initial=0.0, op0=nl.multiply, op1=nl.add)


def reduce_with(op):
    def kernel(x):
        nisa.tensor_reduce(dst=sbuf((x.shape[0], 1)), op=op, data=load(x), axis=1)
    return kernel


def power_on_vector(x):
    t = load(x)
    nisa.tensor_tensor(dst=t, data1=t, data2=t, op=nl.power, engine=nisa.engine.vector)


def power_on_gpsimd(x):
    t = load(x)
    nisa.tensor_tensor(dst=t, data1=t, data2=t, op=nl.power)


def activation_of_add(x):
    t = load(x)
    nisa.activation(dst=t, op=nl.add, data=t)


def activation_of_exp(x):
    t = load(x)
    nisa.activation(dst=t, op=nl.exp, data=t)


def activation_reduce_max_cmd(x):
    t = load(x)
    nisa.activation(dst=t, op=nl.exp, data=t, reduce_op=nl.maximum, reduce_res=sbuf((x.shape[0], 1)),
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)


def activation_reduce_add_cmd(x):
    t = load(x)
    nisa.activation(dst=t, op=nl.exp, data=t, reduce_op=nl.add, reduce_res=sbuf((x.shape[0], 1)),
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)


def activation_reduce_max(x):
    t = load(x)
    nisa.activation_reduce(dst=t, op=nl.copy, data=t, reduce_op=nl.maximum, reduce_res=sbuf((x.shape[0], 1)))


def activation_reduce_add(x):
    t = load(x)
    nisa.activation_reduce(dst=t, op=nl.copy, data=t, reduce_op=nl.add, reduce_res=sbuf((x.shape[0], 1)))


def activation_reduce_no_res(x):
    t = load(x)
    nisa.activation_reduce(dst=t, op=nl.copy, data=t, reduce_op=nl.add, reduce_res=None)


def reciprocal_with_bias(x):
    t = load(x)
    nisa.activation(dst=t, op=nl.reciprocal, data=t, bias=load(x[:, 0:1]))


def reciprocal_without_bias(x):
    t = load(x)
    nisa.activation(dst=t, op=nl.reciprocal, data=t)


def exp_with_scalar_bias(x):
    t = load(x)
    nisa.activation(dst=t, op=nl.exp, data=t, bias=1.0)


def exp_with_tile_bias(x):
    t = load(x)
    nisa.activation(dst=t, op=nl.exp, data=t, bias=load(x[:, 0:1]))


def scalar_reduce_without_res(x):
    t = load(x)
    nisa.tensor_scalar_reduce(dst=t, data=t, op0=nl.multiply, operand0=2.0, reduce_op=nl.add, reduce_res=None)


def scalar_reduce_with_res(x):
    t = load(x)
    nisa.tensor_scalar_reduce(dst=t, data=t, op0=nl.multiply, operand0=2.0, reduce_op=nl.add,
                              reduce_res=sbuf((x.shape[0], 1)))


def scalar_reduce_negated(x):
    t = load(x)
    nisa.tensor_scalar_reduce(dst=t, data=t, op0=nl.multiply, operand0=2.0, reduce_op=nl.add,
                              reduce_res=sbuf((x.shape[0], 1)), reduce_res_negate=True)


def wrapper_divide(x):
    t = load(x)
    nl.divide(t, t)


def wrapper_fmod(x):
    nl.fmod(load(x), 2.0)


def wrapper_multiply(x):
    t = load(x)
    nl.multiply(t, t)


def wrapper_power_scalar(x):
    nl.power(load(x), 2.0)


def wrapper_power_tiles(x):
    t = load(x)
    nl.power(t, t)


def wrapper_add_broadcast(x):
    t = load(x)
    nl.add(t, load(x[:, 0:1]))


def wrapper_add_scalar(x):
    nl.add(load(x), 1.0)


def wrapper_matmul(x):
    t = load(x)
    nl.matmul(t, t)


def wrapper_matmul_transposed(x):
    t = load(x)
    nl.matmul(t, t, transpose_x=True)


def store_psum(x):
    product = nl.matmul(load(x), load(x), transpose_x=True)
    out = nl.ndarray(product.shape, product.dtype, buffer=nl.shared_hbm)
    nl.store(out, nl.copy(product))  # NKI 0.4: nl.copy keeps PSUM (ScalarE); NKI 0.6: it copies to SBUF


# ---- Tensor Engine ---------------------------------------------------------------------------------------------

def matmul_tiled(rows, start):
    def kernel(x):
        t = load(x, nl.bfloat16)
        nisa.nc_matmul(dst=psum((x.shape[1], x.shape[1])), stationary=t, moving=t, tile_position=(start, 0),
                       tile_size=(rows, 128))
    return kernel


def matmul_fp8(second):
    def kernel(x):
        a = load(x, nl.float8_e4m3)
        b = load(x, second)
        nisa.nc_matmul(dst=psum((x.shape[1], x.shape[1])), stationary=a, moving=b)
    return kernel


def matmul_moving(width):
    def kernel(x):
        stationary, moving = sbuf((8, 8), nl.bfloat16), sbuf((8, width), nl.bfloat16)
        nisa.memset(dst=stationary, value=1.0)
        nisa.memset(dst=moving, value=1.0)
        nisa.nc_matmul(dst=psum((8, width)), stationary=stationary, moving=moving)
    return kernel


# ---- DMA --------------------------------------------------------------------------------------------------------

def dma_hwdge(dtype):
    def kernel(x):
        nisa.dma_copy(dst=sbuf(x.shape, dtype), src=x, dge_mode=nisa.dge_mode.hwdge)
    return kernel


def dma_priority(x):
    nisa.dma_copy(dst=sbuf(x.shape), src=x, priority=1)


def dma_plain(x):
    nisa.dma_copy(dst=sbuf(x.shape), src=x)


def dma_sync_engine(x):
    nisa.dma_copy(dst=sbuf(x.shape), src=x, engine=nisa.engine.sync)


def dma_transpose_hwdge(x):  # src (8, 128): NKI 0.4 needs 16 rows, NKI 0.6 takes 1, 2, 4, 8 or 16
    nisa.dma_transpose(dst=sbuf((x.shape[1], x.shape[0]), x.dtype), src=x, dge_mode=nisa.dge_mode.hwdge)


# ---- memory: budgets and views ----------------------------------------------------------------------------------

def sbuf_tiles(live_together):
    """Two tiles of 106,496 bytes per partition: 212,992 together, 8 over trn2's usable 212,984 (leanprover/KLR
    KLR/Trace.lean l. 53). The twin frees the first (its last use) before the second is first used."""
    def kernel(x):
        a = nl.ndarray((128, 26624), nl.float32, buffer=nl.sbuf)
        b = nl.ndarray((128, 26624), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=a, value=0.0)
        if live_together:
            nisa.memset(dst=b, value=1.0)
            nisa.tensor_tensor(dst=a, data1=a, data2=b, op=nl.add)
        else:
            nisa.tensor_scalar(dst=a, data=a, op0=nl.add, operand0=1.0)
            nisa.memset(dst=b, value=1.0)
    return kernel


def psum_tiles(count, width=512):
    """``count`` PSUM tiles of ``width`` fp32 per partition, all live at once: at 512 each is a whole bank; at 1, 9
    of them fit 16 KiB by bytes, not by banks."""
    def kernel(x):
        tiles = []
        for i in range(count):
            tile = nl.ndarray((128, width), nl.float32, buffer=nl.psum)
            nisa.memset(dst=tile, value=0.0)
            tiles.append(tile)
        for i in range(count):
            nisa.tensor_copy(dst=sbuf((128, width)), src=tiles[i])
    return kernel


def psum_tile(width):
    def kernel(x):
        nisa.memset(dst=nl.ndarray((8, width), nl.float32, buffer=nl.psum), value=0.0)
    return kernel


def instruction_on_empty_view(x):
    t = load(x)
    nisa.tensor_copy(dst=t[0:0], src=t[0:0])


def instruction_on_view(x):
    t = load(x)
    nisa.tensor_copy(dst=t[0:1], src=t[0:1])


def ap_past_the_storage_used(x):
    t = load(x)
    nisa.tensor_copy(dst=sbuf((8, 17)), src=t.ap([[16, 8], [1, 17]], offset=0))  # the last row runs 1 past the end


def ap_past_the_storage_unused(x):  # made and skipped, as nki-library's output_projection_tkg.py does
    t = load(x)
    unused = t.ap([[16, 8], [1, 17]], offset=0)
    nisa.tensor_copy(dst=sbuf((8, 16)), src=t.ap([[16, 8], [1, 16]], offset=0))


# ---- GpSimd / VectorE immediates ---------------------------------------------------------------------------------

def iota_offset(offset):
    def kernel(x):
        nisa.iota(dst=sbuf((8, 16), nl.int32), pattern=[[1, 16]], offset=offset)
    return kernel


def memset_with_tile(x):
    t = load(x)
    nisa.memset(dst=t, value=load(x))


def memset_with_number(x):
    nisa.memset(dst=load(x), value=1.5)


def affine_select_false(value_is_tile):
    def kernel(x):
        t = load(x)
        nisa.affine_select(dst=t, pattern=[[-1, x.shape[1]]], channel_multiplier=1, on_true_tile=t,
                           on_false_value=load(x) if value_is_tile else -1e9, cmp_op=nl.greater_equal)
    return kernel


def scalar_copy(x):
    t = load(x)
    nisa.tensor_copy(dst=t, src=t, engine=nisa.engine.scalar)


def vector_copy(x):
    t = load(x)
    nisa.tensor_copy(dst=t, src=t, engine=nisa.engine.vector)


# ---- addresses as the hardware takes them --------------------------------------------------------------------------

def bf16_transpose_into_psum_at(element):
    """A bf16 TensorE transpose into a PSUM tile starting at ``element``: byte 2*element of the partition."""
    def kernel(x):
        t = load(x, nl.bfloat16)
        flipped = nl.ndarray((16, 16), nl.bfloat16, buffer=nl.psum)
        nisa.nc_transpose(dst=flipped[:, element:element + 8], data=t)
    return kernel


def psum_tile_at(address, shape=(128, 512)):
    def kernel(x):
        nisa.memset(dst=nl.ndarray(shape, nl.float32, buffer=nl.psum, address=address), value=0.0)
    return kernel


def sbuf_tile_at(address):
    def kernel(x):
        nisa.memset(dst=nl.ndarray((32, 16), nl.float32, buffer=nl.sbuf, address=address), value=0.0)
    return kernel


def copy_partitions(start, stop, step=1, instruction="tensor_copy"):
    """A copy of partitions start..stop-1 (every ``step``-th) of a 128-partition tile into themselves."""
    def kernel(x):
        t = sbuf((128, 4))
        nisa.memset(dst=t, value=1.0)
        window = t[start:stop:step, :]
        if instruction == "tensor_copy":
            nisa.tensor_copy(dst=window, src=window)
        elif instruction == "activation":
            nisa.activation(dst=window, op=nl.exp, data=window)
        else:
            nisa.dma_copy(dst=window, src=window)
    return kernel


def output_in(buffer):
    def kernel(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=buffer)
        nisa.dma_copy(dst=out, src=load(x))
        return out
    return kernel


def integer_output_rows(rows):
    """An int32 tile written in its first 4 partitions only, then rows 0..rows-1 of it returned."""
    def kernel(x):
        t = nl.ndarray((8, 4), nl.int32, buffer=nl.sbuf)
        nisa.iota(t[0:4, :], [[1, 4]], offset=0, channel_multiplier=4)
        out = nl.ndarray((rows, 4), nl.int32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t[0:rows, :])
        return out
    return kernel


class Rule(NamedTuple):
    broken: object
    twin: object
    match: tuple  # fragments of the refusal: what broke, and its source
    target: str = "trn2"
    version: str = "0.4"
    twin_target: str = None  # the twin's one difference, where it is the generation or the NKI release
    twin_version: str = None


RULES = {
    "divide is no ISA operator": Rule(tensor_tensor_with(nl.divide), tensor_tensor_with(nl.multiply),
                                      ("nl.divide", "Division is not available as a hardware instruction", "nki.rst")),
    "mod is no ISA operator": Rule(tensor_scalar_with(nl.mod, 3.0), tensor_scalar_with(nl.add, 3.0), ("nl.mod", "Modulo", "fail when compiled")),
    "fmod is no ISA operator": Rule(tensor_scalar_with(nl.fmod, 3.0), tensor_scalar_with(nl.add, 3.0), ("nl.fmod", "Modulo", "nki.rst")),
    "divide in scalar_tensor_tensor": Rule(scalar_tensor_tensor_divide, scalar_tensor_tensor_add, ("nl.divide",)),
    "ALU op outside the operator table": Rule(tensor_scalar_with(nl.exp, 0.0), tensor_scalar_with(nl.abs, 0.0), ("exp", "nki.api.shared.rst")),
    "abs_max runs on trn3 only": Rule(tensor_scalar_with(nl.abs_max, 1.0), tensor_scalar_with(nl.abs_max, 1.0),
                                      ("abs_max", "trn3"), twin_target="trn3"),
    "scan ops are binary": Rule(scan_with_unary, scan_with_binary, ("abs", "two operands")),
    "reduction op not legal (power)": Rule(reduce_with(nl.power), reduce_with(nl.add), ("power", "Legal Reduction")),
    "reduction op not legal (equal)": Rule(reduce_with(nl.equal), reduce_with(nl.add), ("equal", "Legal Reduction")),
    "power runs on GpSimd": Rule(power_on_vector, power_on_gpsimd, ("nl.power", "GpSimd")),
    "unary op0 takes operand0 0": Rule(tensor_scalar_with(nl.abs, 2.0), tensor_scalar_with(nl.abs, 0.0), ("operand0", "unary")),
    "operand1 needs op1": Rule(tensor_scalar_operand1_without_op1, tensor_scalar_operand1_with_op1, ("operand1",)),
    "activation outside the table": Rule(activation_of_add, activation_of_exp, ("op=add", "activation table")),
    "activation reduce_op is add": Rule(activation_reduce_max_cmd, activation_reduce_add_cmd, ("reduce_op", "nl.add")),
    "activation_reduce add only on trn1": Rule(activation_reduce_max, activation_reduce_max, ("reduce_op", "nl.add"),
                                               target="trn1", twin_target="trn2"),
    "reciprocal takes no bias on trn1": Rule(reciprocal_with_bias, reciprocal_without_bias, ("reciprocal", "bias",
                                                                                             "shared.rst l. 230"),
                                             target="trn1"),
    "scalar bias needs trn2": Rule(exp_with_scalar_bias, exp_with_tile_bias, ("bias", "trn1"), target="trn1"),
    "activation_reduce needs reduce_res before 0.6": Rule(activation_reduce_no_res, activation_reduce_no_res,
                                                          ("reduce_res", "NKI 0.4"), twin_version="0.6"),
    "tensor_scalar_reduce needs reduce_res before 0.6": Rule(scalar_reduce_without_res, scalar_reduce_with_res,
                                                             ("reduce_res", "NKI 0.4")),
    "reduce_res_negate came in 0.6": Rule(scalar_reduce_negated, scalar_reduce_negated, ("reduce_res_negate", "NKI 0.4"),
                                          twin_version="0.6"),
    "nl.divide": Rule(wrapper_divide, wrapper_multiply, ("nl.divide", "Division")),
    "nl.fmod": Rule(wrapper_fmod, wrapper_multiply, ("nl.fmod", "simulation but fail when compiled")),
    "nl.power takes no scalar exponent": Rule(wrapper_power_scalar, wrapper_power_tiles, ("nl.power", "NKI 0.4")),
    "nl wrappers do not broadcast": Rule(wrapper_add_broadcast, wrapper_add_scalar, ("broadcasting", "NKI 0.4")),
    "nl.matmul needs transpose_x": Rule(wrapper_matmul, wrapper_matmul_transposed, ("transpose_x=True", "NKI 0.4")),
    "nl.copy keeps PSUM before 0.6; nl.store takes no PSUM": Rule(store_psum, store_psum, ("dma_copy", "psum"),
                                                                 twin_version="0.6"),
    "matmul tile rows of 32 need trn2": Rule(matmul_tiled(32, 0), matmul_tiled(32, 0), ("tile_size", "trn1"),
                                             target="trn1", twin_target="trn2"),
    "matmul tile size is 128, 64 or 32": Rule(matmul_tiled(48, 0), matmul_tiled(64, 0), ("tile_size", "48")),
    "matmul tile position is a multiple": Rule(matmul_tiled(32, 48), matmul_tiled(32, 64), ("tile_position", "48")),
    "fp8 e4m3 and e4m3fn do not mix": Rule(matmul_fp8(nl.float8_e4m3fn), matmul_fp8(nl.float8_e4m3),
                                           ("float8_e4m3fn", "mixed"), target="trn3"),
    "matmul moving free size is one bank": Rule(matmul_moving(513), matmul_moving(512), ("513", "one PSUM bank")),
    "hwdge DMA keeps the dtype": Rule(dma_hwdge(nl.bfloat16), dma_hwdge(nl.float32), ("hwdge", "dtype")),
    "hwdge needs trn2": Rule(dma_hwdge(nl.float32), dma_hwdge(nl.float32), ("hwdge", "trn1"), target="trn1",
                             twin_target="trn2"),
    "DMA priority needs trn3": Rule(dma_priority, dma_priority, ("priority", "trn2"), twin_target="trn3"),
    "DMA engine needs hwdge": Rule(dma_sync_engine, dma_plain, ("engine=", "hwdge")),
    "hwdge transpose rows before 0.6": Rule(dma_transpose_hwdge, dma_transpose_hwdge, ("dma_transpose", "NKI 0.4"),
                                            twin_version="0.6"),
    "SBUF usable budget, by liveness": Rule(sbuf_tiles(True), sbuf_tiles(False), ("SBUF", "212992", "212984")),
    "PSUM holds 8 banks": Rule(psum_tiles(9), psum_tiles(8), ("PSUM", "18432", "16384")),
    "a PSUM tile is one bank": Rule(psum_tile(513), psum_tile(512), ("PSUM bank", "2052")),
    "an instruction takes no access pattern past its storage": Rule(ap_past_the_storage_used,
                                                                    ap_past_the_storage_unused, ("leaves its storage",)),
    "an instruction takes no empty view": Rule(instruction_on_empty_view, instruction_on_view, ("empty view",)),
    "iota offset is int32": Rule(iota_offset(0.5), iota_offset(1), ("iota", "int32")),
    "memset value is a constant": Rule(memset_with_tile, memset_with_number, ("memset", "constant")),
    "affine_select on_false_value is a scalar": Rule(affine_select_false(True), affine_select_false(False),
                                                     ("on_false_value",)),
    "ScalarE copy needs trn2": Rule(scalar_copy, vector_copy, ("tensor_copy", "trn1"), target="trn1"),
    "PSUM free addresses are 4-byte aligned": Rule(bf16_transpose_into_psum_at(1), bf16_transpose_into_psum_at(2),
                                                   ("byte 2", "psum_min_align", "tile_size.rst l. 56-57")),
    "a PSUM tile starts at a bank": Rule(psum_tile_at((0, 1024)), psum_tile_at((0, 2048)),
                                         ("beginning of a bank", "nki-beta2-migration-guide.rst")),
    "a PSUM tile ends inside PSUM": Rule(psum_tile_at((0, 16384), (128, 8)), psum_tile_at((0, 14336), (128, 8)),
                                         ("16416", "16384", "PSUM partition")),
    "a tile at an address stays inside the partitions": Rule(sbuf_tile_at((100, 0)), sbuf_tile_at((96, 0)),
                                                             ("past partition 127",)),
    "a tile's address counts in its start partition": Rule(sbuf_tile_at((16, 0)), sbuf_tile_at((32, 0)),
                                                           ("memset", "partitions 16-47")),
    "an address is two offsets": Rule(sbuf_tile_at((0, -4)), sbuf_tile_at([0, 4]), ("two ints >= 0",)),
    "PSUM is counted by whole banks": Rule(psum_tiles(9, width=1), psum_tiles(8, width=1),
                                           ("PSUM", "18432", "16384", "whole banks")),
    "up to 32 partitions start at 0/32/64/96": Rule(copy_partitions(16, 48), copy_partitions(32, 64),
                                                    ("partitions 16-47", "0 or 32 or 64 or 96", "arch.rst l. 704-713")),
    "33-64 partitions start at 0 or 64": Rule(copy_partitions(32, 80, instruction="activation"),
                                              copy_partitions(64, 112, instruction="activation"),
                                              ("partitions 32-79", "0 or 64")),
    "over 64 partitions start at 0": Rule(copy_partitions(32, 128), copy_partitions(0, 96), ("partitions 32-127",)),
    "a DMA is not held to partition starts": Rule(copy_partitions(16, 48), copy_partitions(16, 48, instruction="dma"),
                                                  ("tensor_copy", "partitions 16-47")),
    "no partition striding": Rule(copy_partitions(0, 128, 2), copy_partitions(0, 64),
                                  ("a step of 2", "partition striding")),
    "outputs in nl.shared_hbm": Rule(output_in(nl.hbm), output_in(nl.shared_hbm),
                                     ("nl.shared_hbm", "private_hbm", "nki.rst l. 205")),
    "an integer output carries no poison": Rule(integer_output_rows(8), integer_output_rows(4),
                                                ("16 elements of the output", "never written", "int32")),
}


@pytest.mark.parametrize("name", list(RULES))
def test_rule_refuses_the_breaking_kernel_and_runs_its_twin(name):
    rule = RULES[name]
    x = x_in((8, 128)) if rule.broken is dma_transpose_hwdge else x_in()
    nki_emulator.set_target(rule.target)
    nki_emulator.set_nki_version(rule.version)
    with pytest.raises(NkiValidationError) as refusal:
        nki_emulator.jit(rule.broken)(x)
    for fragment in rule.match:
        assert fragment in str(refusal.value), str(refusal.value)
    nki_emulator.set_target(rule.twin_target or rule.target)
    nki_emulator.set_nki_version(rule.twin_version or rule.version)
    nki_emulator.jit(rule.twin)(x.astype(ml_dtypes.bfloat16) if rule.twin is dma_transpose_hwdge else x)


# ---- values the hardware computes that a reader might not expect ---------------------------------------------------

def row_max_kernels(x):
    """ScalarE's and VectorE's row max of rows that are all negative."""
    t = load(x)
    scalar_max, vector_max = sbuf((x.shape[0], 1)), sbuf((x.shape[0], 1))
    nisa.activation_reduce(dst=sbuf(x.shape), op=nl.copy, data=t, reduce_op=nl.maximum, reduce_res=scalar_max)
    nisa.tensor_scalar_reduce(dst=sbuf(x.shape), data=t, op0=nl.multiply, operand0=1.0, reduce_op=nl.max,
                              reduce_res=vector_max)
    maxima = sbuf((x.shape[0], 2))
    nisa.tensor_copy(dst=maxima[:, 0:1], src=scalar_max)
    nisa.tensor_copy(dst=maxima[:, 1:2], src=vector_max)
    return store(maxima)


def test_register_reductions_start_from_zero_as_documented():
    """activation_reduce resets its registers to zero (isa stub l. 1177), so nl.maximum of a negative row is 0; so
    does tensor_scalar_reduce's reset_reduce in NKI 0.4 (l. 2151), while 0.6 starts from the identity (-inf)."""
    x = -x_in()
    maxima = nki_emulator.jit(row_max_kernels)(x)
    np.testing.assert_array_equal(maxima, np.zeros_like(maxima))
    nki_emulator.set_nki_version("0.6")
    maxima = nki_emulator.jit(row_max_kernels)(x)
    np.testing.assert_array_equal(maxima[:, 0], 0.0)
    np.testing.assert_array_equal(maxima[:, 1], x.max(axis=1))


def test_bank_7_is_reserved_when_dma_transposes_become_pe_transposes(monkeypatch):
    """nl.tile_size.psum_num_banks is 7 with NKI_DMA_TRANSPOSE_AS_PE_TRANSPOSE=true on trn2 and later, 8 otherwise
    (tile_size.rst l. 24-30); the PSUM budget follows it."""
    assert nl.tile_size.psum_num_banks == 8 and nl.tile_size.psum_min_align == 4
    nki_emulator.jit(psum_tiles(8, width=1))(x_in())
    monkeypatch.setenv("NKI_DMA_TRANSPOSE_AS_PE_TRANSPOSE", "true")
    assert nl.tile_size.psum_num_banks == 7
    with pytest.raises(NkiValidationError, match="16384 bytes per partition of live tiles, over the 14336"):
        nki_emulator.jit(psum_tiles(8, width=1))(x_in())
    nki_emulator.jit(psum_tiles(7, width=1))(x_in())
    nki_emulator.set_target("trn1")
    assert nl.tile_size.psum_num_banks == 8


def test_version_and_target_settings_are_checked():
    with pytest.raises(ValueError, match="0.4, 0.5, 0.6"):
        nki_emulator.set_nki_version("0.9")
    assert nki_emulator.set_nki_version("0.6") == "0.4" and nki_emulator.nki_version() == "0.6"


def abs_extremes(x, y):
    a, b = load(x), load(y)
    out = sbuf((x.shape[0], 2 * x.shape[1]))
    nisa.tensor_tensor(dst=out[:, 0:x.shape[1]], data1=a, data2=b, op=nl.abs_max)
    nisa.tensor_tensor(dst=out[:, x.shape[1]:], data1=a, data2=b, op=nl.abs_min)
    return store(out)


def test_abs_max_and_abs_min_keep_the_signed_value_on_trn3():
    """nl stub (3afa0fdf l. 380, 424): abs_max(-5, 3) is -5, abs_min(-5, 3) is 3."""
    nki_emulator.set_target("trn3")
    x, y = np.array([[-5.0, 2.0]], np.float32), np.array([[3.0, -4.0]], np.float32)
    np.testing.assert_array_equal(nki_emulator.jit(abs_extremes)(x, y), [[-5.0, -4.0, 3.0, 2.0]])

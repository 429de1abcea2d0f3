"""Tests of the CPU NKI emulator (nki_emulator/): every instruction against numpy on random data,
every hardware rule with a kernel that breaks it, and two small kernels in the documented NKI style
(a tiled matmul and a row softmax). These use the emulator directly, so they run whether or not the
Neuron SDK's nki is installed."""

import inspect
import math
import os
import sys

import ml_dtypes
import numpy as np
import pytest
import torch

import nki_emulator
import nki_emulator.isa as nisa
import nki_emulator.language as nl
from nki_emulator import NkiValidationError, _subset

jit = nki_emulator.jit
DTYPES = [np.float32, ml_dtypes.bfloat16]


@pytest.fixture(autouse=True)
def _default_target():
    previous = nki_emulator.set_target("trn2")
    yield
    nki_emulator.set_target(previous)


def rand(shape, dtype=np.float32, low=-2.0, high=2.0, seed=0):
    return np.random.default_rng(seed).uniform(low, high, shape).astype(np.float32).astype(dtype)


def f32(x):
    return np.asarray(x, np.float32)


def check(out, expected, dtype, atol=1e-5):
    """``out`` equals numpy's fp32 result rounded once to ``dtype`` (a little slack for op order)."""
    assert out.dtype == np.dtype(dtype)
    rtol = 1e-5 if np.dtype(dtype) == np.float32 else 8e-3
    np.testing.assert_allclose(f32(out), f32(np.asarray(expected, np.float32).astype(dtype)),
                               rtol=rtol, atol=max(atol, rtol))


def run(body, *inputs, out_dtype=None):
    """Run ``body(*sbuf_tiles) -> tile`` in a kernel: inputs are DMA'd to SBUF, the result (evicted
    from PSUM if needed) DMA'd back to HBM. NKI has no ``*args``: the kernel takes the inputs as one
    tuple, and ``spread`` (a test instrument, like ``body``) unpacks the tiles for ``body``."""

    def spread(tiles):
        return body(*tiles)

    @jit
    def kernel(hbm_inputs):
        tiles = []
        for x in hbm_inputs:
            tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=tile, src=x)
            tiles.append(tile)
        result = spread(tiles)
        if result.buffer == nl.psum:
            evicted = nl.ndarray(result.shape, result.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=evicted, src=result)
            result = evicted
        out = nl.ndarray(result.shape, out_dtype or result.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=result)
        return out

    return kernel(inputs)


def raises(kernel_fn, *args, match):
    """The kernel must fail with an NkiValidationError whose message contains every string in ``match``."""
    with pytest.raises(NkiValidationError) as error:
        jit(kernel_fn)(*args)
    for fragment in match:
        assert fragment in str(error.value), str(error.value)
    return str(error.value)


# ---- instructions against numpy ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_dma_copy_and_tensor_copy(dtype):
    x = rand((128, 384), dtype)
    check(run(lambda t: t, x), x, dtype)

    def cast(t):  # tensor_copy converts through fp32 and rounds to the destination dtype
        dst = nl.ndarray(t.shape, nl.float8_e4m3, buffer=nl.sbuf)
        nisa.tensor_copy(dst=dst, src=t)
        return dst

    out = run(cast, x)
    np.testing.assert_array_equal(f32(out), f32(f32(x).astype(ml_dtypes.float8_e4m3)))


def test_dma_converts_dtype_and_rounds_to_nearest_even():
    x = np.array([[1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -9), 3.0e38]], np.float32)

    @jit
    def kernel(x):
        tile = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x)  # a converting DMA is allowed (fp32 -> bf16)
        out = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=tile)
        return out

    np.testing.assert_array_equal(kernel(x), x.astype(ml_dtypes.bfloat16))
    assert kernel(x)[0, 1] == np.float32(1 + 4 * 2 ** -8)


def test_fp8_and_int_rounding_on_write():
    x = np.array([[0.3, 2.5, -3.5, 300.0, 1e10, -7.49]], np.float32)
    for dtype in (nl.float8_e4m3, nl.float8_e5m2):
        out = run(lambda t: t, x, out_dtype=dtype)
        np.testing.assert_array_equal(f32(out), f32(x.astype(dtype)))
    # float -> int: round half to even, saturate
    np.testing.assert_array_equal(run(lambda t: t, x, out_dtype=nl.int16), [[0, 2, -4, 300, 32767, -7]])


@pytest.mark.parametrize("dtype", DTYPES)
def test_memset(dtype):
    def body(t):
        dst = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)
        nisa.memset(dst=dst, value=0.1)
        return dst

    check(run(body, rand((64, 100), dtype)), np.full((64, 100), 0.1), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nc_matmul_accumulates_per_location(dtype):
    a, b, c = rand((128, 96), dtype, seed=1), rand((128, 300), dtype, seed=2), rand((64, 300), dtype, seed=3)
    a2 = rand((64, 96), dtype, seed=4)

    def body(a, b, c, a2):
        acc = nl.ndarray((96, 300), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc, stationary=a, moving=b)  # first write: overwrites the NaN fill
        nisa.nc_matmul(dst=acc, stationary=a2, moving=c)  # accumulates (K=64 this time)
        nisa.nc_matmul(dst=acc[0:96, 0:100], stationary=a2, moving=c[:, 0:100])  # still accumulates
        return acc

    expected = f32(a).T @ f32(b) + f32(a2).T @ f32(c)
    expected[:, 0:100] += f32(a2).T @ f32(c[:, 0:100])
    np.testing.assert_allclose(run(body, a, b, c, a2), expected, rtol=1e-5, atol=1e-4)


def test_nc_matmul_accumulate_flags():
    a, b = rand((128, 128), seed=5), rand((128, 512), seed=6)

    def body(a, b):
        acc = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(acc, a, b)
        nisa.nc_matmul(acc, a, b, accumulate=False)  # overwrite
        nisa.nc_matmul(acc, a, b, accumulate=True)  # add
        return acc

    np.testing.assert_allclose(run(body, a, b), 2 * (a.T @ b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nc_transpose_into_psum_keeps_dtype(dtype):
    x = rand((128, 96), dtype)

    def body(t):
        dst = nl.ndarray((96, 128), t.dtype, buffer=nl.psum)  # bf16 PSUM tile: allowed for transposes
        nisa.nc_transpose(dst=dst, data=t)
        return dst

    out = run(body, x)
    np.testing.assert_array_equal(out, x.T)

    def vector_transpose(t):
        dst = nl.ndarray((32, 16), t.dtype, buffer=nl.sbuf)
        nisa.nc_transpose(dst=dst, data=t[0:16, 0:32], engine=nisa.vector_engine)
        return dst

    np.testing.assert_array_equal(run(vector_transpose, x), x[0:16, 0:32].T)


ACTIVATIONS = {
    nl.exp: np.exp, nl.tanh: np.tanh, nl.sigmoid: lambda v: 1 / (1 + np.exp(-v)), nl.relu: lambda v: np.maximum(v, 0),
    nl.silu: lambda v: v / (1 + np.exp(-v)), nl.square: np.square, nl.copy: lambda v: v,
    nl.gelu_apprx_tanh: lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3))),
    nl.gelu: lambda v: v * 0.5 * (1 + np.vectorize(__import__("math").erf)(v / np.sqrt(2))),
    nl.log: np.log, nl.rsqrt: lambda v: 1 / np.sqrt(v),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(ACTIVATIONS), ids=lambda op: op.__name__)
def test_activation(op, dtype):
    """dst = op(data * scale + bias) with a (P, 1) bias column and a scalar scale."""
    x, bias = rand((128, 200), dtype, low=0.5, high=2.0), rand((128, 1), np.float32, low=0.0, high=1.0, seed=9)

    def body(t, b):
        dst = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)
        nisa.activation(dst=dst, op=op, data=t, bias=b, scale=0.5)
        return dst

    check(run(body, x, bias), ACTIVATIONS[op](f32(x) * 0.5 + bias), dtype)


def test_activation_out_of_range_input_is_invalid():
    x = np.array([[0.0, 1.0, 2.0 ** 70]], np.float32)

    def body(t):
        dst = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)
        nisa.activation(dst=dst, op=nl.log, data=t)  # log is valid on [2^-64, 2^64] only
        return dst

    out = run(body, x)
    assert np.isnan(out[0, 0]) and out[0, 1] == 0 and np.isnan(out[0, 2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_reduce_and_registers(dtype):
    x, scale = rand((128, 256), dtype), rand((128, 1), np.float32, low=0.5, high=1.0, seed=3)
    expected = np.exp(f32(x) * scale)

    def fused(t, s):
        dst = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)
        total = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation_reduce(dst=dst, op=nl.exp, data=t, reduce_op=nl.add, reduce_res=total, scale=s)
        return total

    np.testing.assert_allclose(run(fused, x, scale)[:, 0], expected.sum(axis=1), rtol=1e-5)

    def chained(t, s):  # ScalarE registers: reset_reduce on the first half, reduce on the second
        dst = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)
        total = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=dst[:, 0:128], op=nl.exp, data=t[:, 0:128], scale=s, reduce_op=nl.add,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.activation(dst=dst[:, 128:256], op=nl.exp, data=t[:, 128:256], scale=s, reduce_op=nl.add,
                        reduce_res=total, reduce_cmd=nisa.reduce_cmd.reduce)
        return total

    np.testing.assert_allclose(run(chained, x, scale)[:, 0], expected.sum(axis=1), rtol=1e-5)

    def running_max(t, s):
        dst = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)
        top = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation_reduce(dst=dst, op=nl.copy, data=t, reduce_op=nl.maximum, reduce_res=top)
        return top

    np.testing.assert_array_equal(run(running_max, x, scale)[:, 0], f32(x).max(axis=1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensor_reduce(dtype):
    x = rand((128, 4, 64), dtype)

    def body(t):
        rows = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=rows, op=nl.add, data=t, axis=(1, 2))
        maxes = nl.ndarray((128, 4), t.dtype, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=maxes, op=nl.maximum, data=t, axis=2, negate=True)
        both = nl.ndarray((128, 5), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(both[:, 0:1], rows)
        nisa.tensor_copy(both[:, 1:5], maxes)
        return both

    out = run(body, x)
    np.testing.assert_allclose(out[:, 0], f32(x).sum(axis=(1, 2)), rtol=1e-5, atol=1e-4)
    check(out[:, 1:].astype(dtype), -f32(x).max(axis=2), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensor_scalar(dtype):
    x, column = rand((128, 300), dtype), rand((128, 1), np.float32, seed=4)

    def body(t, c):
        dst = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)
        # (c - t) * 3, with the column operand broadcast along the free axis
        nisa.tensor_scalar(dst=dst, data=t, op0=nl.subtract, operand0=c, reverse0=True, op1=nl.multiply, operand1=3.0)
        return dst

    check(run(body, x, column), (column - f32(x)) * 3.0, dtype)

    def gpsimd_rsqrt(t, c):
        dst = nl.ndarray(t.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=dst, data=t, op0=nl.rsqrt, operand0=0.0, engine=nisa.gpsimd_engine)
        return dst

    np.testing.assert_allclose(run(gpsimd_rsqrt, np.abs(x) + 1, column), 1 / np.sqrt(f32(np.abs(x) + 1)), rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [nl.add, nl.subtract, nl.multiply, nl.maximum, nl.power, nl.greater_equal],
                         ids=lambda op: op.__name__)
def test_tensor_tensor(op, dtype):
    a, b = rand((128, 256), dtype, low=0.5 if op is nl.power else -2.0, seed=1), rand((128, 256), dtype, low=0.5, seed=2)
    expected = {nl.add: np.add, nl.subtract: np.subtract, nl.multiply: np.multiply, nl.maximum: np.maximum,
                nl.power: np.power, nl.greater_equal: lambda u, v: (u >= v).astype(np.float32)}[op]

    def body(x, y):
        dst = nl.ndarray((128, 2, 128), x.dtype, buffer=nl.sbuf)  # same elements per partition suffice
        nisa.tensor_tensor(dst=dst, data1=x, data2=y, op=op)
        return dst

    check(run(body, a, b).reshape(128, 256), expected(f32(a), f32(b)), dtype)


def test_tensor_tensor_reads_one_psum_operand_and_rounds_once():
    a, b, c = (rand((128, 128), ml_dtypes.bfloat16, seed=s) for s in (1, 2, 3))

    def body(x, y, z):
        product = nl.ndarray((128, 128), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(product, x, y)
        dst = nl.ndarray((128, 128), nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=dst, data1=product, data2=z, op=nl.add)  # fp32 sum, one bf16 rounding
        return dst

    expected = (f32(a).T @ f32(b) + f32(c)).astype(ml_dtypes.bfloat16)
    np.testing.assert_allclose(f32(run(body, a, b, c)), f32(expected), rtol=8e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scalar_tensor_tensor(dtype):
    """dS = P * (dP - D): the attention-backward step."""
    p_, dp, d = rand((128, 512), dtype, seed=1), rand((128, 512), dtype, seed=2), rand((128, 1), dtype, seed=3)

    def body(probs, grad, rowsum):
        dst = nl.ndarray(probs.shape, probs.dtype, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=dst, data=grad, op0=nl.subtract, operand0=rowsum, op1=nl.multiply,
                                  operand1=probs)
        return dst

    check(run(body, p_, dp, d), (f32(dp) - f32(d)) * f32(p_), dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_iota(dtype):
    def body(t):
        dst = nl.ndarray((128, 4, 64), dtype, buffer=nl.sbuf)
        nisa.iota(dst, pattern=[[-1, 4], [2, 64]], offset=5, channel_multiplier=3)
        return dst

    p, i, j = np.meshgrid(np.arange(128), np.arange(4), np.arange(64), indexing="ij")
    np.testing.assert_array_equal(run(body, rand((1, 1))), (5 + 3 * p - i + 2 * j).astype(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_affine_select_causal_mask(dtype):
    scores = rand((128, 512), dtype)
    q_start, k_start = 256, 128  # query rows 256..383 against key columns 128..639

    def body(s):
        dst = nl.ndarray(s.shape, s.dtype, buffer=nl.sbuf)
        # keep where (q_start + p) - (k_start + j) >= 0
        nisa.affine_select(dst, pattern=[[-1, 512]], channel_multiplier=1, on_true_tile=s, on_false_value=-9999.0,
                           cmp_op=nl.greater_equal, offset=q_start - k_start)
        return dst

    q, k = np.meshgrid(np.arange(q_start, q_start + 128), np.arange(k_start, k_start + 512), indexing="ij")
    check(run(body, scores), np.where(q >= k, f32(scores), -9999.0), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reciprocal(dtype):
    x = rand((128, 64), dtype, low=0.5, high=4)

    def body(t):
        dst = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)
        nisa.reciprocal(dst=dst, data=t)
        return dst

    check(run(body, x), 1 / f32(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bn_stats_bn_aggr(dtype):
    x = rand((128, 1024), dtype, low=-1, high=3)

    def body(t):
        stats = nl.ndarray((128, 12), nl.float32, buffer=nl.sbuf)
        for i in range(2):  # bn_stats takes at most 512 elements per partition
            nisa.bn_stats(dst=stats[:, i * 6:(i + 1) * 6], data=t[:, nl.ds(i * 512, 512)])
        mean_var = nl.ndarray((128, 2), nl.float32, buffer=nl.sbuf)
        nisa.bn_aggr(dst=mean_var, data=stats)
        return mean_var

    out = run(body, x)
    np.testing.assert_allclose(out[:, 0], f32(x).mean(axis=1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[:, 1], f32(x).var(axis=1), rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_language_helpers(dtype):
    x, y = rand((64, 128), dtype, seed=1), rand((64, 256), dtype, seed=2)

    def to_sbuf(t):
        if t.buffer == nl.sbuf:
            return t
        evicted = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=evicted, src=t)
        return evicted

    @jit
    def kernel(x, y):
        a, b = nl.load(x), nl.load(y)
        product = nl.matmul(a, b, transpose_x=True)  # x.T @ y, the contraction on partitions
        e = nl.exp(nl.multiply(a, 0.5))
        row_max = nl.max(e, axis=1)
        centred = nl.subtract(e, nl.broadcast_to(row_max, e.shape))  # the wrappers do not broadcast themselves
        stats = nl.add(nl.sum(centred, axis=1, dtype=nl.float32), nl.mean(a, axis=1))
        outs = []
        for t in (nl.copy(product), nl.transpose(a), stats):
            outs.append(nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm))
            nl.store(outs[-1], to_sbuf(t))
        return tuple(outs)

    product, transposed, stats = kernel(x, y)
    check(product, f32(x).T @ f32(y), np.float32)  # matmul results are fp32 (PSUM)
    np.testing.assert_array_equal(transposed, x.T)
    e = f32(np.exp(f32(x) * 0.5).astype(dtype))
    centred = (e - e.max(axis=1, keepdims=True)).astype(dtype)
    np.testing.assert_allclose(stats[:, 0], f32(centred).sum(axis=1) + f32(x).mean(axis=1), rtol=2e-2, atol=2e-2)


# ---- views -------------------------------------------------------------------------------------------------

def test_views_write_through_and_follow_nki_indexing():
    q = rand((2, 3, 64, 512))  # (B, H, d, S) as attention kernels lay it out

    @jit
    def kernel(q):
        assert q[1, 2, :, nl.ds(128, 128)].shape == (64, 128)  # HBM: integer indices drop dims
        assert q[1, 2, 5, 7].shape == (1,)
        tile = nl.ndarray((64, 4, 128), nl.float32, buffer=nl.sbuf)
        assert tile[0, 0, 10].shape == (1, 1)  # on chip: the partition dim stays, result stays 2-D
        assert tile[:, 1].shape == (64, 128) and tile[:, 1, 3].shape == (64, 1)
        for t in range(4):
            nisa.dma_copy(dst=tile[:, t, :], src=q[1, 2, :, nl.ds(t * 128, 128)])
        out = nl.ndarray((64, 512), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out.reshape((64, 4, 128)), src=tile)  # HBM reshape is a view
        return out

    np.testing.assert_array_equal(kernel(q), q[1, 2])

    @jit
    def strided(q):  # an explicit access pattern: rows 0..63 of q[0, 1], every other column
        tile = nl.ndarray((64, 256), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=q.ap([[512, 64], [2, 256]], offset=(0 * 3 + 1) * 64 * 512))
        out = nl.ndarray((64, 256), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=tile)
        return out

    np.testing.assert_array_equal(strided(q), q[0, 1, :, ::2])


def test_view_errors():
    def out_of_bounds(x):
        return x[:, 0:600]

    raises(out_of_bounds, rand((4, 512)), match=["slice 0:600", "512"])

    def non_contiguous_reshape(x):
        tile = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf)
        return tile[:, 0:256].reshape((128, 2, 64, 2)).permute((0, 2, 1, 3)).reshape((128, 256))

    raises(non_contiguous_reshape, rand((1, 1)), match=["reshape"])

    def partition_reshape(x):
        return nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf).reshape((256, 256))

    raises(partition_reshape, rand((1, 1)), match=["reshape", "partition dim 128"])


def test_indexing_follows_the_nki_front_end():
    """leanprover/KLR KLR/Trace/Term.lean toIndex' and access, KLR/Core/Indexing.lean Access.combine."""
    q = rand((2, 3, 256, 64))  # (B, H, S, d)

    def negative_integer(q):
        return q[-1, 0]

    raises(negative_integer, q, match=["-1", "index out of range of tensor dimension"])

    def chained_rows(q):  # t[b, h] then a slice of its rows: read against (1, 1, 256, 64)
        return q[1, 2][0:128, :]

    raises(chained_rows, q, match=["[0:128, :]", "index out of range of tensor dimension", "(1, 1, 256, 64)"])

    def chained_after_middle_integer(q):  # in range of the kept shape, but KLR pairs it with other dims
        return q[:, 1][0:1]

    raises(chained_after_middle_integer, q, match=["other dims than Python"])

    def chained_with_step(q):
        return q[0:2][:, :, 0:256:2]

    raises(chained_with_step, q, match=["can't combine indecies with stride != 1"])

    @jit
    def accepted(q):
        assert q[1, 2, 128:256, :].shape == (128, 64)  # index once, the nki-library way
        assert q[0:2, :, -128:, :].shape == (2, 3, 128, 64)  # negative slice bounds count from the end
        assert q[0:2, 1:3][1, 0, 0:128].shape == (128, 64)  # a chain of slices, then any index
        assert q[:, :, :, 3][1, 0:2, 0:16].shape == (2, 16)  # an integer index of the last dim only, then any
        tile = nl.ndarray((128, 4, 64), nl.float32, buffer=nl.sbuf)
        assert tile[:, 1:3][:, 0].shape == (128, 64)
        return q

    accepted(q)


# ---- the hardware rules --------------------------------------------------------------------------------

def test_partition_dim_limit():
    def kernel(x):
        nl.ndarray((256, 512), nl.float32, buffer=nl.sbuf)

    raises(kernel, rand((1, 1)), match=["ndarray", "partition dim 256", "128 partitions"])


def _matmul_operands(k=128, m=128, n=512, dst_shape=None, dtype=nl.bfloat16, dst_dtype=nl.float32, tile_position=(),
                     tile_size=()):
    def kernel(x):
        stationary = nl.zeros((k, m), dtype, buffer=nl.sbuf)
        moving = nl.zeros((k, n), dtype, buffer=nl.sbuf)
        dst = nl.ndarray(dst_shape or (m, n), dst_dtype, buffer=nl.psum)
        nisa.nc_matmul(dst, stationary, moving, tile_position=tile_position, tile_size=tile_size)

    return kernel


def test_matmul_size_limits():
    raises(_matmul_operands(m=256, dst_shape=(128, 512)), rand((1, 1)), match=["nc_matmul", "M=256", "128"])
    raises(_matmul_operands(n=1024, dst_shape=(128, 512)), rand((1, 1)), match=["nc_matmul", "N=1024", "512"])
    raises(_matmul_operands(tile_position=(0, 0), tile_size=(64, 128)), rand((1, 1)),
           match=["nc_matmul", "K=128", "64"])  # with PE row tiling the array has 64 rows
    raises(_matmul_operands(dst_shape=(64, 512)), rand((1, 1)), match=["nc_matmul", "dst is 64 partitions"])

    def k_mismatch(x):
        dst = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst, nl.zeros((64, 128), nl.bfloat16), nl.zeros((128, 512), nl.bfloat16))

    raises(k_mismatch, rand((1, 1)), match=["nc_matmul", "64 partitions", "128"])


def test_matmul_dtype_rules():
    raises(_matmul_operands(dst_dtype=nl.bfloat16, n=256), rand((1, 1)), match=["nc_matmul", "dst dtype", "float32"])

    def mixed_fp32(x):
        dst = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst, nl.zeros((128, 128), nl.float32), nl.zeros((128, 512), nl.bfloat16))

    raises(mixed_fp32, rand((1, 1)), match=["nc_matmul", "float32 operand needs a float32 partner"])
    raises(_matmul_operands(dtype=nl.int32), rand((1, 1)), match=["nc_matmul", "int32"])

    nki_emulator.set_target("trn3")  # bf16 PSUM results, and wider moving tiles, from NeuronCore-v4 on
    jit(_matmul_operands(dst_dtype=nl.bfloat16, n=1024))(rand((1, 1)))


def test_psum_tile_is_at_most_one_bank():
    def kernel(x):
        nl.ndarray((128, 1024), nl.float32, buffer=nl.psum)

    raises(kernel, rand((1, 1)), match=["ndarray", "4096 bytes per partition", "2048 bytes"])


def test_psum_capacity_counts_live_tiles():
    def nine_banks(x):
        tiles = []
        for _ in range(9):
            tiles.append(nl.ndarray((128, 512), nl.float32, buffer=nl.psum))
        for t in tiles:
            nisa.memset(t, 0.0)
        sink = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf)
        for t in tiles:
            nisa.tensor_copy(sink, t)

    message = raises(nine_banks, rand((1, 1)), match=["memset (instruction #9)", "PSUM", "18432", "16384"])
    assert "allocated at test_nki_emulator.py" in message

    def loop(x):  # a tile per iteration: dead after its last use, so 8 banks are never exceeded
        for i in range(20):
            acc = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
            nisa.memset(acc, float(i))
            nisa.tensor_copy(nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf), acc)

    jit(loop)(rand((1, 1)))


def test_sbuf_budget_per_target():
    def kernel(x):  # two 100 KiB-per-partition tiles live together: 200 KiB
        a = nl.zeros((128, 25600), nl.float32, buffer=nl.sbuf)
        b = nl.zeros((128, 25600), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(a, a, b, nl.add)

    jit(kernel)(rand((1, 1)))  # fits trn2's usable 212,984 bytes (leanprover/KLR KLR/Trace.lean l. 53)
    nki_emulator.set_target("trn1")
    raises(kernel, rand((1, 1)), match=["SBUF", "204800", "180224", "trn1"])

    def one_huge_tile(x):
        nl.ndarray((128, 60000), nl.float32, buffer=nl.sbuf)

    raises(one_huge_tile, rand((1, 1)), match=["ndarray", "240000 bytes per partition", "180224"])


def test_engines_reach_only_their_buffers():
    def matmul_into_sbuf(x):
        nisa.nc_matmul(nl.ndarray((128, 512), nl.float32), nl.zeros((128, 128), nl.bfloat16),
                       nl.zeros((128, 512), nl.bfloat16))

    raises(matmul_into_sbuf, rand((1, 1)), match=["nc_matmul", "dst is in sbuf", "PSUM"])

    def dma_from_psum(x):
        out = nl.ndarray((128, 512), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(out, nl.zeros((128, 512), nl.float32, buffer=nl.psum))

    raises(dma_from_psum, rand((1, 1)), match=["dma_copy", "src is in psum"])

    def gpsimd_on_psum(x):
        nisa.iota(nl.ndarray((128, 512), nl.float32, buffer=nl.psum), pattern=[[1, 512]])

    raises(gpsimd_on_psum, rand((1, 1)), match=["iota", "GpSimd", "PSUM"])

    def gpsimd_copy_from_psum(x):
        src = nl.zeros((128, 512), nl.float32, buffer=nl.psum)
        nisa.tensor_copy(nl.ndarray((128, 512), nl.float32), src, engine=nisa.gpsimd_engine)

    raises(gpsimd_copy_from_psum, rand((1, 1)), match=["tensor_copy", "GpSimd"])

    def two_psum_inputs(x):
        a = nl.zeros((128, 256), nl.float32, buffer=nl.psum)
        b = nl.zeros((128, 256), nl.float32, buffer=nl.psum)
        nisa.tensor_tensor(nl.ndarray((128, 256), nl.float32), a, b, nl.add)

    raises(two_psum_inputs, rand((1, 1)), match=["tensor_tensor", "both in PSUM"])

    def activation_on_hbm(x):
        nisa.activation(nl.ndarray(x.shape, x.dtype), nl.exp, x)

    raises(activation_on_hbm, rand((4, 4)), match=["activation", "data is in shared_hbm", "ScalarE"])


def test_shape_and_dtype_mismatches():
    def elementwise(x):
        nisa.tensor_tensor(nl.ndarray((128, 512), nl.float32), nl.zeros((128, 512), nl.float32),
                           nl.zeros((128, 256), nl.float32), nl.add)

    raises(elementwise, rand((1, 1)), match=["tensor_tensor", "data2 is 128 partitions x 256", "128 x 512"])

    def dma_count(x):
        nisa.dma_copy(nl.ndarray((4, 8), nl.float32), x)

    raises(dma_count, rand((4, 4)), match=["dma_copy", "dst has 32 elements", "src has 16"])

    def transpose_dtype(x):
        nisa.nc_transpose(nl.ndarray((128, 128), nl.float32, buffer=nl.psum), nl.zeros((128, 128), nl.bfloat16))

    raises(transpose_dtype, rand((1, 1)), match=["nc_transpose", "float32 must equal data dtype bfloat16"])

    def transpose_size(x):
        nisa.nc_transpose(nl.ndarray((64, 64), nl.float32), nl.zeros((64, 64), nl.float32), engine=nisa.vector_engine)

    raises(transpose_size, rand((1, 1)), match=["nc_transpose", "32x32"])

    def bf16_operand(x):
        column = nl.zeros((128, 1), nl.bfloat16)
        nisa.tensor_scalar(nl.ndarray((128, 8), nl.float32), nl.zeros((128, 8), nl.float32), nl.add, column)

    raises(bf16_operand, rand((1, 1)), match=["tensor_scalar", "operand0 tile must be float32"])

    def reduce_partition_axis(x):
        nisa.tensor_reduce(nl.ndarray((1, 8), nl.float32), nl.add, nl.zeros((128, 8), nl.float32), axis=0)

    raises(reduce_partition_axis, rand((1, 1)), match=["tensor_reduce", "partition axis 0"])

    def bn_stats_width(x):
        nisa.bn_stats(nl.ndarray((128, 6), nl.float32), nl.zeros((128, 1024), nl.float32))

    raises(bn_stats_width, rand((1, 1)), match=["bn_stats", "1024", "512"])


def test_never_written_lanes_may_be_read_and_dropped_and_reach_an_output_as_nan():
    """As AWS's simulator (aws-neuron-sdk 3afa0fdf nki/guides/nki_simulator.rst l. 212-221): new memory holds NaN,
    NaN propagates, and an output computed from memory never written carries it. A kernel may read lanes it never
    wrote and drop them, as nki-library's kernels do."""
    @jit
    def half_written(x, keep_rows):
        tile = nl.ndarray((128, 8), nl.float32, buffer=nl.sbuf, name="half")
        nisa.dma_copy(dst=tile[0:64, :], src=x)
        exp = nl.ndarray((128, 8), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=exp, op=nl.exp, data=tile)  # reads 64 partitions never written
        top = nl.ndarray((128, 8), nl.float32, buffer=nl.sbuf)
        nisa.max8(dst=top, src=exp)
        out = nl.ndarray((keep_rows, 16), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[:, 0:8], src=exp[0:keep_rows, :])
        nisa.dma_copy(dst=out[:, 8:16], src=top[0:keep_rows, :])
        return out

    x = rand((64, 8))
    out = half_written(x, 64)  # the poisoned lanes are dropped: the output is clean
    np.testing.assert_allclose(out[:, 0:8], np.exp(x), rtol=1e-6)
    np.testing.assert_allclose(out[:, 8:16], -np.sort(-np.exp(x), axis=1), rtol=1e-6)
    out = half_written(x, 128)  # they reach it: NaN, max8's sort included
    assert not np.isnan(out[:64]).any() and np.isnan(out[64:]).all()


def test_poison_survives_what_would_drop_a_nan():
    """A comparison, a max or an integer tile would otherwise hide the NaN: poison passes them."""
    @jit
    def laundered(x, op):
        tile = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile[:, 0:2], src=x)
        result = nl.ndarray((1, 4), nl.int32 if op is None else nl.float32, buffer=nl.sbuf)
        if op is None:
            nisa.tensor_copy(dst=result, src=tile)
        else:
            nisa.tensor_scalar(dst=result, data=tile, op0=op, operand0=0.0)
        out = nl.ndarray((1, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.tensor_copy(dst=tile, src=result)
        nisa.dma_copy(dst=out, src=tile)
        return out

    for op in (nl.greater, nl.maximum, None):
        out = laundered(np.ones((1, 2), np.float32), op)
        assert not np.isnan(out[:, 0:2]).any() and np.isnan(out[:, 2:]).all(), op


def test_poison_where_no_nan_can_carry_it():
    """An integer output carrying poison is refused, as is an address read from memory never written; a PSUM tile
    never written accumulates into NaN."""
    def integer_output(x):
        tile = nl.ndarray((1, 4), nl.int32, buffer=nl.sbuf, name="ints")
        nisa.iota(tile[:, 0:2], [[1, 2]], offset=0)
        out = nl.ndarray((1, 4), nl.int32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=tile)
        return out

    raises(integer_output, rand((1, 1)), match=["2 elements of the output", "never written", "int32 one cannot"])

    @jit
    def accumulate_on_garbage(x):
        acc = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(acc, nl.zeros((128, 128), nl.bfloat16), nl.zeros((128, 512), nl.bfloat16), accumulate=True)
        tile = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=tile, src=acc)
        out = nl.ndarray((128, 512), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=tile)
        return out

    assert np.isnan(accumulate_on_garbage(rand((1, 1)))).all()

    def address_from_garbage(x):
        index = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf, name="index")
        x.ap([[1, 1]], scalar_offset=index)

    raises(address_from_garbage, rand((4, 1)), match=["scalar_offset reads memory that was never written", "index"])

    @jit
    def unwritten_output(x):  # unwritten HBM output elements come back as NaN (garbage on hardware)
        out = nl.ndarray((2, 2), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(out[0:1, :], x)
        return out

    out = unwritten_output(rand((1, 2)))
    assert not np.isnan(out[0]).any() and np.isnan(out[1]).all()


def test_scratch_in_private_hbm_and_empty_views():
    """Scratch in nl.hbm serves, an output must be in nl.shared_hbm (aws-neuron-sdk release-notes/components/nki.rst
    l. 205); an empty slice is a view (nki-library's cross_entropy.py on the core without positions) that no
    instruction may take."""
    def through_hbm(x):
        tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x)
        scratch = nl.ndarray(x.shape, x.dtype, buffer=nl.hbm)
        unused = x[0:0]
        assert unused.shape == (0, 4)
        nisa.dma_copy(dst=scratch, src=tile)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=scratch)
        return out

    x = rand((4, 4))
    np.testing.assert_array_equal(jit(through_hbm)(x), x)

    def copies_nothing(x):
        nisa.dma_copy(dst=nl.ndarray((1, 4), x.dtype, buffer=nl.sbuf)[0:0], src=x[0:0])

    raises(copies_nothing, x, match=["dma_copy", "empty view"])


def test_launch_rules():
    with pytest.raises(NkiValidationError, match="outside a kernel"):
        nl.ndarray((128, 128), nl.float32)
    def load(x):
        return nl.load(x)

    raises(load, rand((4, 4)), match=["nki.jit", "shared_hbm", "sbuf"])

    def identity(x):
        return x

    with pytest.raises(NkiValidationError, match="LNC degree 1 or 2"):
        jit(identity)[3]

    inner = jit(identity)

    def launches_another(x):
        return inner(x)

    raises(launches_another, rand((1, 1)), match=["cannot launch another kernel"])


# ---- kernels in the documented style ---------------------------------------------------------------------

@jit
def tiled_matmul_kernel(lhsT, rhs):
    """result = lhsT.T @ rhs, tiled 128 (K) x 128 (M) x up to 512 (N), accumulating over K in PSUM."""
    K, M = lhsT.shape
    _, N = rhs.shape
    TILE_K, TILE_M, TILE_N = nl.tile_size.pmax, nl.tile_size.gemm_stationary_fmax, nl.tile_size.gemm_moving_fmax
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // TILE_M):
        for n0 in range(0, N, TILE_N):
            n_size = min(TILE_N, N - n0)
            res_psum = nl.ndarray((TILE_M, n_size), nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // TILE_K):
                lhsT_tile = nl.ndarray((TILE_K, TILE_M), dtype=lhsT.dtype, buffer=nl.sbuf)
                rhs_tile = nl.ndarray((TILE_K, n_size), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=lhsT_tile, src=lhsT[k * TILE_K:(k + 1) * TILE_K, m * TILE_M:(m + 1) * TILE_M])
                nisa.dma_copy(dst=rhs_tile, src=rhs[k * TILE_K:(k + 1) * TILE_K, nl.ds(n0, n_size)])
                nisa.nc_matmul(dst=res_psum, stationary=lhsT_tile, moving=rhs_tile)
            res_sb = nl.ndarray(res_psum.shape, dtype=result.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res_sb, src=res_psum)
            nisa.dma_copy(dst=result[m * TILE_M:(m + 1) * TILE_M, nl.ds(n0, n_size)], src=res_sb)
    return result


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiled_matmul_kernel_and_counts(dtype):
    a, b = rand((256, 384), dtype, seed=1), rand((384, 640), dtype, seed=2)
    with nki_emulator.counting() as counts:
        out = tiled_matmul_kernel(np.ascontiguousarray(a.T), b)
    check(out, f32(a) @ f32(b), dtype, atol=1e-4)  # fp32 sums over K=384 in another order

    size = np.dtype(dtype).itemsize
    assert counts.instructions == {"tensor": 12, "vector": 4, "scalar": 0, "gpsimd": 0, "dma": 28}
    assert counts.by_instruction["nc_matmul"] == 12 and counts.by_instruction["tensor_copy"] == 4
    assert counts.matmul_flops == 2 * 256 * 384 * 640
    assert counts.matmul_histogram() == {(128, 128, 512, np.dtype(dtype).name): 6,
                                         (128, 128, 128, np.dtype(dtype).name): 6}
    loaded = 2 * 3 * 128 * 128 * 2 + 2 * 3 * 128 * 640  # lhsT tiles per (m, n-tile, k); rhs per (m, k)
    assert counts.dma_bytes == (loaded + 256 * 640) * size


@jit
def softmax_kernel(x):
    """Row softmax: rows on partitions, 128 rows per tile; exp and row sum fused on ScalarE."""
    rows, cols = x.shape
    out = nl.ndarray((rows, cols), dtype=x.dtype, buffer=nl.shared_hbm)
    for r in nl.affine_range(rows // nl.tile_size.pmax):
        tile = nl.ndarray((nl.tile_size.pmax, cols), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x[nl.ds(r * 128, 128), :])
        neg_max = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=neg_max, op=nl.maximum, data=tile, axis=1, negate=True)
        exps = nl.ndarray((128, cols), dtype=nl.float32, buffer=nl.sbuf)
        sums = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation_reduce(dst=exps, op=nl.exp, data=tile, reduce_op=nl.add, reduce_res=sums, bias=neg_max)
        inv = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=inv, data=sums)
        probs = nl.ndarray((128, cols), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=probs, data=exps, op0=nl.multiply, operand0=inv)
        nisa.dma_copy(dst=out[nl.ds(r * 128, 128), :], src=probs)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_kernel(dtype):
    x = rand((256, 1000), dtype, low=-8, high=8)
    with nki_emulator.counting() as counts:
        out = softmax_kernel(x)
    e = np.exp(f32(x) - f32(x).max(axis=1, keepdims=True))
    check(out, e / e.sum(axis=1, keepdims=True), dtype)
    assert counts.instructions == {"tensor": 0, "vector": 6, "scalar": 2, "gpsimd": 0, "dma": 4}


# ---- the NKI subset of Python, as KLR's front end takes it (nki_emulator/_subset.py) ---------------
#
# Each refused_* kernel holds one construct the front end refuses, marked "# refused: <its words>"; the
# check must name that line, the function and those words.

def refused_tuple_loop_target(x):
    for a, b in ((1, 2), (3, 4)):  # refused: expecting simple variable
        x = x + a + b
    return x


def refused_for_else(x):
    for i in range(2):  # refused: for-orelse is not supported in NKI
        x = x + i
    else:
        x = x + 1
    return x


def refused_while_else(x):
    while x < 2:  # refused: while-orelse is not supported in NKI
        x = x + 1
    else:
        x = 0
    return x


def refused_attribute_in_a_tuple_target(x):
    x.first, y = 1, 2  # refused: expecting simple variable
    return y


def refused_subscript_in_a_tuple_target(x):
    sizes = [0, 0]
    sizes[0], y = 1, 2  # refused: expecting pattern
    return y


def refused_two_mutations_at_once(x):
    a, b = [0], [0]
    a[0] = b[0] = x  # refused: mutating assignments must be in separate statements
    return a


def refused_list_target(x):
    [a, b] = (1, 2)  # refused: mutation not supported
    return a + b


def refused_star_argument(x):
    shape = (2, 3)
    return nl.ndarray((*shape,), nl.float32)  # refused: tuple expansion is not supported


def refused_keyword_expansion(x):
    options = {"buffer": nl.sbuf}
    return nl.ndarray((2, 3), nl.float32, **options)  # refused: keyword expansion is not supported


def refused_varargs(*tensors):  # refused: varargs are not supported in NKI
    return tensors[0]


@pytest.mark.skip  # refused: unsupported decorator pytest.mark.skip
def refused_decorator(x):
    return x


def refused_matmul_operator(x):
    return x @ x  # refused: the matmul operator is not supported in NKI


def refused_chained_in(x):
    return 1 in (1, 2) in ((1, 2),)  # refused: the 'in' operator is not supported in NKI


def refused_identity_test(x, flag=False):
    if flag is True:  # refused: the 'is' operator is not supported in NKI, use ==
        return x
    return x


def refused_identity_test_against_a_value(x, flag=False):
    return flag is not False  # refused: the 'is not' operator is not supported in NKI, use !=


def refused_computed_dict_key(x):
    key = "rows"
    return {key: x}  # refused: expecting string


def refused_ellipsis_value(x):
    return ...  # refused: invalid use of ellipsis


def refused_wide_integer(x):
    return x + 4294967296  # refused: integer value (4294967296) is too large


def refused_format_spec(x):
    assert x, f"{x:>8}"  # refused: NKI does no support format specifiers
    return x


def refused_with_statement(x):
    with open("log") as log:  # refused: NKI only supports with statements with a single, simple function call
        log.write(x)
    return x


def refused_with_context(x):
    with nl.sequential_range():  # refused: invalid with context nl.sequential_range (only no_reorder
        pass
    return x


def refused_raise(x):
    if x < 0:
        raise ValueError(x)  # refused: NKI does not support 'raise' statements
    return x


def refused_del(x):
    y = x
    del y  # refused: NKI does not support 'del' statements
    return x


def refused_import(x):
    import os  # refused: NKI does not support 'import' statements within a function
    return os.sep


def refused_try(x):
    try:  # refused: NKI does not support 'try' statements
        return x
    finally:
        pass


def refused_global(x):
    global TILES  # refused: NKI does not support 'global' statements
    return x


def refused_match(x):
    match x:  # refused: NKI does not support 'match' statements
        case _:
            return x


def refused_nested_def(x):
    def inner():  # refused: NKI does not support inner function definitions
        return x

    return inner()


def refused_lambda(x):
    return (lambda y: y)(x)  # refused: unsupported expression (a lambda


def refused_list_comprehension(x):
    return [n for n in x.shape]  # refused: unsupported expression (a list comprehension


def refused_generator(x):
    return tuple(n for n in x.shape)  # refused: unsupported expression (a generator expression


def refused_walrus(x):
    if (n := len(x.shape)) > 1:  # refused: unsupported expression (an assignment expression :=)
        return n
    return x


def refused_set_literal(x):
    return {1, 2}  # refused: unsupported expression (a set literal


def refused_builtin_outside_klr(x):
    pairs = []
    for pair in zip(x.shape, x.shape):  # refused: zip is not one of NKI's Python builtins
        pairs.append(pair)
    return pairs


def refused_math_function(x):
    return math.log(x)  # refused: math.log is not in NKI's math library


def refused_range_as_a_value(x):
    return len(range(x))  # refused: range() outside a for-loop header


def refused_range_arguments(x):
    for i in nl.affine_range(0, x, 1, 1):  # refused: invalid range arguments
        x = x + i
    return x


def refused_min_of_three(x):
    return min(x, 1, 2)  # refused: invalid arguments (min() takes one sequence or two numbers)


_WIDE_GLOBAL = 2 ** 40
_WIDE_IN_A_TUPLE = (1, -2 ** 33)
_NARROW_GLOBALS = (2 ** 31 - 1, -2 ** 31, 0.5, "rows", None)


def refused_wide_global(x):
    return x + _WIDE_GLOBAL  # refused: integer value (1099511627776) is too large (the global _WIDE_GLOBAL)


def refused_wide_global_in_a_tuple(x):
    return x + _WIDE_IN_A_TUPLE[0]  # refused: integer value (-8589934592) is too small


def refused_numpy_function(x):
    return np.exp(x)  # refused: name numpy.exp not found


def refused_builtin_function_of_a_module(x):
    return sys.getrecursionlimit()  # refused: sys.getrecursionlimit is a builtin function, which the front end


def refused_missing_module_attribute(x):
    return math.tau + np.not_there  # refused: name numpy.not_there not found


def refused_iterating_a_dict(x):
    for key in {"rows": 1}:  # refused: not an iterable object (a dict
        x = x + 1
    return x


REFUSED = [kernel for name, kernel in globals().items() if name.startswith("refused_")]


@pytest.mark.parametrize("kernel", REFUSED, ids=lambda kernel: kernel.__name__)
def test_jit_refuses_what_the_nki_front_end_refuses_in_its_words_naming_line_and_function(kernel):
    lines, first_line = inspect.getsourcelines(kernel)
    [(line, words)] = [(first_line + i, text.split("# refused: ")[1].strip()) for i, text in enumerate(lines)
                       if "# refused: " in text]
    with pytest.raises(NkiValidationError) as error:
        jit(kernel)
    assert f"test_nki_emulator.py:{line} in {kernel.__name__}: {words}" in str(error.value), str(error.value)


def helper_looping_over_pairs(pairs):
    total = 0
    for first, second in pairs:
        total += first * second
    return total


def kernel_calling_a_helper(x):
    return x + helper_looping_over_pairs(((1, 2), (3, 4)))


def accepted_globals_and_module_constants(x):
    """What the front end takes (leanprover/KLR interop/klr/gather.c reference, const_expr, value): int32
    globals, floats, strings, module constants such as np.pi and sys.maxsize... of int32 range only,
    negative list indexes (KLR/Trace/Term.lean listAccess), and a dict's items()."""
    largest, smallest, half, label, nothing = _NARROW_GLOBALS
    total = 0
    for item in {"a": 1, "b": 2}.items():
        total = total + item[1]
    # len of a string is refused when traced (KLR/Trace/Python.lean builtin.python.len): a string is compared instead
    return largest + smallest + half + np.pi + 4 * (label == "rows") + 1 * (os.sep == "/") + _NARROW_GLOBALS[-2 + 1 - 2] \
        + total


def test_jit_accepts_what_the_front_end_takes_from_globals_and_modules():
    kernel = jit(accepted_globals_and_module_constants)  # inside the subset
    assert kernel(1.0) == pytest.approx(-1 + 0.5 + math.pi + 4 + 1 + 0.5 + 3)


def test_jit_checks_the_helpers_a_kernel_calls():
    with pytest.raises(NkiValidationError) as error:
        jit(kernel_calling_a_helper)
    line = helper_looping_over_pairs.__code__.co_firstlineno + 2
    assert f"test_nki_emulator.py:{line} in helper_looping_over_pairs: expecting simple variable" in str(error.value)


def _row_spans(n_rows, tile_rows):
    """(start, count) of each tile of at most tile_rows rows: nki-library's helpers hand back tuples."""
    full, rest = divmod(n_rows, tile_rows)
    spans = []
    for t in range(full):
        spans.append((t * tile_rows, tile_rows))
    if rest:
        spans.append((full * tile_rows, rest))
    return spans


def _scale_into(dst, src, scale, bias=None):
    if bias is None:
        nisa.tensor_scalar(dst=dst, data=src, op0=nl.multiply, operand0=scale)
    else:
        nisa.tensor_scalar(dst=dst, data=src, op0=nl.multiply, operand0=scale, op1=nl.add, operand1=bias)


def _copy_out(dst, src):
    nisa.dma_copy(dst=dst, src=src)


def scale_pair_kernel(x, y, scale, *, bias=None, col_tile=512, store=_copy_out):
    """(x, y) * scale (+ bias), tiled 128 rows by col_tile columns, in the style of nki-library's kernels:
    tuple assignment, `is None`, conditional expressions, helpers (one passed as a value), nl.ds, min, len,
    divmod, //, %, math.ceil, nested loops over ranges, a loop over a tuple of tensors by index, a keyword-only
    parameter (KLR accepts them), a dict with string keys, an assert with an f-string."""
    assert len(x.shape) == 2 and x.shape == y.shape, f"x {x.shape} and y {y.shape} must match"
    n_rows, n_cols = x.shape
    sizes = {"rows": nl.tile_size.pmax, "cols": min(col_tile, n_cols)}
    full_col_tiles = n_cols // sizes["cols"]
    inputs, outputs = (x, y), []
    for i in range(len(inputs)):
        outputs.append(nl.ndarray(inputs[i].shape, inputs[i].dtype, buffer=nl.shared_hbm))
    for i in range(len(inputs)):
        src, dst = inputs[i], outputs[i]
        for span in _row_spans(n_rows, sizes["rows"]):
            row, rows = span
            for c in nl.affine_range(math.ceil(n_cols / sizes["cols"])):
                width = sizes["cols"] if c < full_col_tiles else n_cols % sizes["cols"]
                cols = nl.ds(c * sizes["cols"], width)
                tile = nl.ndarray((rows, width), src.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=tile, src=src[row:row + rows, cols])
                scaled = nl.ndarray(tile.shape, src.dtype, buffer=nl.sbuf)
                _scale_into(scaled, tile, scale, bias)
                store(dst[row:row + rows, cols], scaled)
    return outputs[0], outputs[1]


def test_jit_accepts_kernels_in_the_style_of_nki_library():
    x, y = rand((300, 700), seed=1), rand((300, 700), seed=2)
    kernel = jit(scale_pair_kernel)
    out_x, out_y = kernel(x, y, 0.5, bias=None, col_tile=512, store=_copy_out)
    np.testing.assert_allclose(out_x, x * 0.5, rtol=1e-6)
    np.testing.assert_allclose(out_y, y * 0.5, rtol=1e-6)
    out_x, _ = kernel(x, y, 0.5, bias=1.0, col_tile=256, store=_copy_out)
    np.testing.assert_allclose(out_x, x * 0.5 + 1.0, rtol=1e-6)


def test_a_kernel_takes_its_defaults_as_nki_librarys_tests_call_it():
    """nki-library's tests call kernels with the generator's keywords only (test/utils/unit_test_framework.py
    run_test; cross_entropy_backward without inplace=): the kernel's own defaults apply, as a helper's do."""
    x, y = rand((128, 64), seed=1), rand((128, 64), seed=2)
    out_x, _ = jit(scale_pair_kernel)(x, y, 0.5)  # bias=None, col_tile=512, store=_copy_out from its signature
    np.testing.assert_allclose(out_x, x * 0.5, rtol=1e-6)
    with pytest.raises(TypeError, match="scale"):  # a parameter without a default still needs an argument
        jit(scale_pair_kernel)(x, y)


def test_every_kernel_in_kernels_py_is_inside_the_subset(monkeypatch):
    import kernels

    monkeypatch.setattr(_subset, "_checked", set())  # check again what earlier tests' launches passed
    names = [name for name in vars(kernels) if name.endswith("_kernel") and not name.startswith("_")]
    assert len(names) == 12, names  # attention, MLP, RMSNorm, add + RMSNorm, softcap cross-entropy, RoPE + QK-norm: fwd and bwd
    for name in names:
        _subset.check_kernel(getattr(kernels, name))


# ---- frameworks, LNC, targets, install -------------------------------------------------------------------

@jit
def scale_kernel(x, factor=2.0):
    """out = x * factor, the rows split between the programs of an LNC launch."""
    rows, cols = x.shape
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    share = rows // nl.num_programs()
    start = nl.program_id(0) * share
    tile = nl.load(x[nl.ds(start, share), :])
    nl.store(out[nl.ds(start, share), :], nl.multiply(tile, factor))
    return out


def test_torch_tensors_round_trip():
    x = torch.randn(128, 64).to(torch.bfloat16)
    out = scale_kernel(x, factor=3.0)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    assert torch.equal(out, (x.float() * 3.0).to(torch.bfloat16))
    out32 = scale_kernel(torch.ones(4, 4), 2.0)
    assert out32.dtype == torch.float32 and torch.equal(out32, torch.full((4, 4), 2.0))


def test_lnc2_programs_share_outputs():
    x = rand((256, 32))
    with nki_emulator.counting() as counts:
        out = nki_emulator.simulate(scale_kernel[2])(x, factor=0.5)
    np.testing.assert_array_equal(out, x * 0.5)
    assert counts.instructions["dma"] == 4  # each program loads and stores its half


def test_set_target():
    assert nki_emulator.set_target("gen4") == "trn2"
    assert nl.tile_size.sbuf_fmax_bytes == 245752 and nisa.get_nc_version() == nisa.nc_version.gen4
    # nki-library compares versions: attention_cte.py ">= nisa.nc_version.gen4", experimental/collectives ">= 3"
    assert nisa.get_nc_version() >= nisa.nc_version.gen3 and nisa.get_nc_version() >= 3
    assert nki_emulator.set_target("trn1") == "trn3"
    with pytest.raises(ValueError, match="trn1, trn2, trn3"):
        nki_emulator.set_target("trn9")


def test_install_falls_back_on_the_pypi_placeholder(tmp_path, monkeypatch):
    (tmp_path / "nki").mkdir()
    (tmp_path / "nki" / "__init__.py").write_text('raise ImportError("WRONG PACKAGE")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("nki", "nki.language", "nki.isa"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert nki_emulator.install() is nki_emulator
    import nki.language

    assert nki.language is nl


def test_install_makes_import_nki_work():
    module = nki_emulator.install()
    import nki
    import nki.isa
    import nki.language as language

    assert module is nki
    if nki is nki_emulator:  # no Neuron SDK here: the emulator stands in for all three modules
        assert language is nl and nki.isa is nisa and sys.modules["nki.language"] is nl

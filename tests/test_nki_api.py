"""The emulator against the NKI 0.6 API as AWS documents it.

1. API surface: every function, class (with its members) and keyword of the 0.6 stubs of ``nki``,
   ``nki.language`` and ``nki.isa`` (aws-neuron/aws-neuron-sdk @ 81ce03a, nki/api/nki/__init__.py,
   nki/api/nki/language/__init__.py, nki/api/nki/isa/__init__.py), recorded below as facts, is either
   implemented by the emulator with the same keywords or raises NotImplementedError naming it; never
   AttributeError.
2. Conformance: what the emulator added for official new-dialect kernels, each checked against the
   semantics the stubs, the language guide (nki/get-started/nki-language-guide.rst) and the migration
   guide (nki/migration/index.rst) state: pseudo-code, examples and rules.
"""
import dataclasses
import inspect

import ml_dtypes
import numpy as np
import pytest
import torch

import nki_emulator
import nki_emulator.isa as nisa
import nki_emulator.language as nl
from nki_emulator import NkiValidationError

MODULES = {"nki": nki_emulator, "nki.language": nl, "nki.isa": nisa}


@pytest.fixture
def nki_06():
    """Rules of NKI 0.6 (the current release) instead of the default, the contest's 0.4."""
    previous = nki_emulator.set_nki_version("0.6")
    yield
    nki_emulator.set_nki_version(previous)

# name -> keywords (functions), None (constants), or a tuple of members ("method(keywords)" or attribute)
NKI_0_6_API = {
    "nki": {
        "jit": "fn",
        "simulate": "kernel",
    },
    "nki.language": {
        "DType": None,
        "bool_": None,
        "int8": None,
        "int16": None,
        "int32": None,
        "uint8": None,
        "uint16": None,
        "uint32": None,
        "float16": None,
        "float32": None,
        "bfloat16": None,
        "tfloat32": None,
        "float8_e4m3": None,
        "float8_e4m3fn": None,
        "float8_e5m2": None,
        "float8_e5m2_x4": None,
        "float8_e4m3fn_x4": None,
        "float8_e8m0fnu": None,
        "float4_e2m1fn_x4": None,
        "sbuf": None,
        "psum": None,
        "hbm": None,
        "private_hbm": None,
        "shared_hbm": None,
        "tile_size": None,
        "average": None,
        "prelu": None,
        "bypass": None,
        "MemoryRegion": ('sbuf', 'psum', 'private_hbm', 'shared_hbm'),
        "NKIObject": ('__init__()',),
        "NkiTensor": (
            'shape', 'strides', 'offset', 'name', 'dtype', 'buffer', 'ndim', 'size',
            '__init__(shape dtype storage buffer name)', 'is_contiguous()', 'get_pattern()', 'is_indirect()',
            '__getitem__(key)', 'permute(dims)', 'broadcast(dim size)', 'expand_dim(dim)', 'squeeze_dim(dim)',
            'reshape_dim(dim shape)', 'flatten_dims(start_dim end_dim)', 'reshape(shape)',
            'rearrange(src_pattern dst_pattern fixed_sizes)', '__setitem__(key value)',
            'slice(dim start end step)', 'select(dim index)', 'vector_select(dim vector_offset)',
            'ap(pattern offset scalar_offset vector_offset indirect_dim dtype)', 'view(dtype)',
            'reinterpret_cast', 'indirect(index num_elem)',
        ),
        "_TileSize": (
            'pmax', 'psum_fmax', 'psum_bank_fmax', 'psum_bank_fmax_bytes', 'gemm_stationary_fmax',
            'gemm_moving_fmax', 'bn_stats_fmax', 'psum_min_align', 'sbuf_min_align', 'psum_num_banks()',
            'sbuf_size_bytes()', 'sbuf_fmax()', 'sbuf_fmax_bytes()', 'total_available_sbuf_size()',
        ),
        "is_hbm": "buffer",
        "is_on_chip": "buffer",
        "is_psum": "buffer",
        "is_sbuf": "buffer",
        "add": "x y dtype",
        "subtract": "x y dtype",
        "multiply": "x y dtype",
        "divide": "x y dtype",
        "maximum": "x y dtype",
        "minimum": "x y dtype",
        "abs_max": "x y dtype",
        "abs_min": "x y dtype",
        "abs": "x dtype",
        "square": "x dtype",
        "power": "x y dtype",
        "equal": "x y dtype",
        "not_equal": "x y dtype",
        "less": "x y dtype",
        "less_equal": "x y dtype",
        "greater": "x y dtype",
        "greater_equal": "x y dtype",
        "bitwise_and": "x y dtype",
        "bitwise_or": "x y dtype",
        "bitwise_xor": "x y dtype",
        "invert": "x dtype",
        "left_shift": "x y dtype",
        "right_shift": "x y dtype",
        "logical_and": "x y dtype",
        "logical_or": "x y dtype",
        "logical_xor": "x y dtype",
        "logical_not": "x dtype",
        "exp": "x dtype",
        "log": "x dtype",
        "sqrt": "x dtype",
        "rsqrt": "x dtype",
        "tanh": "x dtype",
        "sigmoid": "x dtype",
        "relu": "x dtype",
        "gelu": "x dtype",
        "gelu_apprx_sigmoid": "x dtype",
        "gelu_apprx_tanh": "x dtype",
        "gelu_dx": "x dtype",
        "gelu_apprx_sigmoid_dx": "x dtype",
        "silu": "x dtype",
        "silu_dx": "x dtype",
        "softplus": "x dtype",
        "mish": "x dtype",
        "erf": "x dtype",
        "erf_dx": "x dtype",
        "reciprocal": "x dtype",
        "copy": "x dtype",
        "sin": "x dtype",
        "cos": "x dtype",
        "tan": "x dtype",
        "arctan": "x dtype",
        "ceil": "x dtype",
        "floor": "x dtype",
        "trunc": "x dtype",
        "negative": "x dtype",
        "sign": "x dtype",
        "fmod": "x y dtype",
        "mod": "x y dtype",
        "sum": "x axis dtype keepdims",
        "max": "x axis dtype keepdims",
        "min": "x axis dtype keepdims",
        "mean": "x axis dtype keepdims",
        "prod": "x axis dtype keepdims",
        "var": "x axis dtype keepdims",
        "all": "x axis dtype",
        "softmax": "x axis dtype",
        "rms_norm": "x w axis n epsilon dtype compute_dtype",
        "where": "condition x y dtype",
        "dropout": "x rate dtype",
        "ones": "shape dtype buffer name",
        "full": "shape fill_value dtype buffer name",
        "zeros_like": "x dtype buffer name",
        "empty_like": "x dtype buffer name",
        "random_seed": "seed",
        "expand_dims": "x axis",
        "broadcast_to": "x shape dtype",
        "transpose": "x dtype",
        "matmul": "x y transpose_x",
        "no_reorder": "",
        "load_transpose2d": "src dtype",
        "gather_flattened": "data indices axis dtype",
        "ds": "start size",
        "affine_range": "start stop step",
        "sequential_range": "start stop step",
        "static_range": "start stop step",
        "dynamic_range": "start stop step",
        "fori_loop": "lower upper body_fun step",
        "while_loop": "init body_fun",
        "ndarray": "shape dtype buffer name address",
        "zeros": "shape dtype buffer name",
        "load": "src dtype",
        "store": "dst value",
        "program_id": "axis",
        "num_programs": "axes",
        "program_ndim": "",
        "shared_constant": "constant",
        "shared_identity_matrix": "n dtype dst",
        "device_print": "print_prefix tensor",
        "rand": "shape dtype buffer name",
    },
    "nki.isa": {
        "tensor_engine": None,
        "vector_engine": None,
        "scalar_engine": None,
        "gpsimd_engine": None,
        "unknown_engine": None,
        "engine": ('tensor', 'vector', 'scalar', 'gpsimd', 'dma', 'sync', 'unknown'),
        "reduce_cmd": ('idle', 'reset', 'reduce', 'reset_reduce', 'load_reduce'),
        "dge_mode": ('unknown', 'swdge', 'hwdge', 'none'),
        "oob_mode": ('error', 'skip'),
        "matmul_perf_mode": ('none', 'double_row'),
        "nc_version": ('gen2', 'gen3', 'gen4'),
        "dma_engine": ('dma', 'gpsimd_dma'),
        "NkiInstruction": ('__init__(handle)', 'depends_on()'),
        "NkiValidationError": (),
        "VirtualRegister": ('__init__(state frozen)',),
        "get_nc_sub_version": "",
        "get_nc_version": "",
        "dma_copy": "dst src priority oob_mode dge_mode engine name",
        "tensor_copy": "dst src engine name",
        "memset": "dst value engine name",
        "tensor_copy_predicated": "dst src predicate reverse_pred name",
        "nc_matmul": ('dst stationary moving is_stationary_onezero is_moving_onezero is_transpose '
                      'accumulate tile_position tile_size perf_mode name'),
        "nc_matmul_mx": "dst stationary moving stationary_scale moving_scale tile_position tile_size accumulate name",
        "nc_transpose": "dst data engine name",
        "dma_transpose": "dst src axes priority dge_mode oob_mode name",
        "tensor_tensor": "dst data1 data2 op engine name",
        "tensor_scalar": "dst data op0 operand0 reverse0 op1 operand1 reverse1 engine name",
        "tensor_reduce": "dst op data axis negate keepdims name",
        "tensor_partition_reduce": "dst op data name",
        "tensor_scalar_cumulative": "dst src op0 op1 imm0 imm1 reduce_cmd name",
        "activation": "dst op data bias scale reduce_op reduce_res reduce_cmd name",
        "activation_reduce": "dst op data reduce_op reduce_res bias scale name",
        "activate2": ('dst op data imm0 imm1 op0 op1 relu_param reverse0 reverse1 reduce_op reduce_res '
                      'reduce_cmd name'),
        "iota": "dst pattern offset channel_multiplier name",
        "affine_select": "dst pattern channel_multiplier on_true_tile on_false_value cmp_op offset name",
        "local_gather": "dst src_buffer index num_elem_per_idx num_valid_indices name",
        "nc_n_gather": "dst data indices name",
        "bn_stats": "dst data name",
        "bn_aggr": "dst data name",
        "tensor_tensor_scan": "dst data0 data1 initial op0 op1 reverse0 reverse1 name",
        "nc_stream_shuffle": "dst src shuffle_mask name",
        "rng": "dst engine name",
        "dropout": "dst data prob name",
        "set_rng_seed": "src_seeds name",
        "rand_set_state": "src_seeds engine name",
        "rand_get_state": "dst engine name",
        "rand2": "dst min max name",
        "exponential": "dst src max_value reduce_res reduce_cmd reduce_init name",
        "reciprocal": "dst data name",
        "max8": "dst src name",
        "sequence_bounds": "dst segment_ids name",
        "scalar_tensor_tensor": "dst data op0 operand0 op1 operand1 reverse0 reverse1 name",
        "tensor_scalar_reduce": ('dst data op0 operand0 reduce_op reduce_res reverse0 reduce_cmd reduce_init '
                                 'reduce_res_negate name'),
        "core_barrier": "data cores engine name",
        "dma_compute": "dst srcs reduce_op scales unique_indices oob_mode name",
        "quantize_mx": "dst src dst_scale name",
        "range_select": ('dst on_true_tile comp_op0 comp_op1 bound0 bound1 reduce_cmd reduce_res reduce_op '
                         'range_start on_false_value name'),
        "select_reduce": "dst predicate on_true on_false reduce_res reduce_cmd reduce_op reverse_pred name",
        "sendrecv": "src dst send_to_rank recv_from_rank pipe_id dma_engine name",
        "register_alloc": "x",
        "register_move": "dst src",
        "register_load": "dst src",
        "register_store": "dst src",
        "nc_find_index8": "dst data vals name",
        "nc_match_replace8": "dst data vals imm dst_idx name",
        "nonzero_with_count": "dst src index_offset padding_val name",
        "topk": "val_dst idx_dst src n name",
    },
}

# The emulator builds tensors on its own storage; kernels make them with nl.ndarray, as the stub advises.
CONSTRUCTOR_EXCEPTIONS = {("nki.language", "NkiTensor", "__init__")}


def lookup(owner, name):
    """getattr, turning NotImplementedError into a marker (the name exists but is not emulated)."""
    try:
        return getattr(owner, name)
    except NotImplementedError as error:
        return error


def keywords_problem(qualname, fn, keywords):
    """None if ``fn`` accepts every keyword of the stub, else what is missing."""
    parameters = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    missing = [k for k in keywords.split() if k not in parameters]
    return f"{qualname}: lacks keywords {missing}" if missing else None


def emulated(qualname, fn):
    """Call ``fn`` with no arguments: NotImplementedError naming it means 'not emulated'; anything else
    (a result, a missing-argument TypeError, 'called outside a kernel') means it is implemented."""
    try:
        fn()
    except NotImplementedError as error:
        assert qualname.rpartition(".")[2] in str(error), (qualname, str(error))
        return False
    except (TypeError, NkiValidationError):
        pass
    return True


def test_every_name_of_the_0_6_api_is_implemented_or_raises_not_implemented():
    problems, implemented, missing = [], [], []
    for module_name, names in NKI_0_6_API.items():
        module = MODULES[module_name]
        for name, spec in names.items():
            qualname = f"{module_name}.{name}"
            try:
                value = lookup(module, name)
            except AttributeError as error:
                problems.append(f"{qualname}: AttributeError {error}")
                continue
            if isinstance(value, NotImplementedError):
                assert name in str(value), (qualname, str(value))
                missing.append(qualname)
            elif isinstance(spec, str):
                problems.append(keywords_problem(qualname, value, spec))
                (implemented if emulated(qualname, value) else missing).append(qualname)
            elif isinstance(spec, tuple):
                owner = nl.tile_size if name == "_TileSize" else value
                for member in spec:
                    member_name, _, member_keywords = member.partition("(")
                    try:
                        attribute = lookup(owner, member_name)
                    except AttributeError as error:
                        problems.append(f"{qualname}.{member_name}: AttributeError {error}")
                        continue
                    if member_keywords and callable(attribute) and \
                            (module_name, name, member_name) not in CONSTRUCTOR_EXCEPTIONS:
                        problems.append(keywords_problem(f"{qualname}.{member_name}", attribute,
                                                         member_keywords.rstrip(")")))
                implemented.append(qualname)
            else:
                implemented.append(qualname)
    problems = [p for p in problems if p]
    assert problems == []
    print(f"NKI 0.6 API: {len(implemented)} names implemented, {len(missing)} raise NotImplementedError")
    for must_have in ("nki.isa.tensor_tensor_scan", "nki.isa.dma_transpose", "nki.isa.tensor_scalar_reduce",
                      "nki.isa.nc_matmul", "nki.language.ndarray"):
        assert must_have in implemented


# ---- outputs as TorchNeuron hands them back (parmoham-aws/test-repo-parmoham: torch_neuronx/nki_hop.py) ----

def copy_kernel(x, as_tuple, outputs):
    results = []
    for _ in range(outputs):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=x)
        results.append(out)
    if outputs == 1 and not as_tuple:
        return results[0]
    return tuple(results)


def test_one_output_comes_back_bare_on_torch_tensors_however_the_kernel_wraps_it():
    kernel = nki_emulator.jit(copy_kernel)
    x = torch.arange(6.0).reshape(2, 3)
    for as_tuple in (False, True):
        out = kernel(x, as_tuple, 1)
        assert isinstance(out, torch.Tensor) and torch.equal(out, x)
    two = kernel(x, True, 2)
    assert isinstance(two, tuple) and len(two) == 2
    numpy_out = kernel(x.numpy(), True, 1)  # standalone numpy launch: the kernel's own tuple
    assert isinstance(numpy_out, tuple) and len(numpy_out) == 1


# ---- NkiTensor.ap and the view methods (0.6 stub of NkiTensor) ---------------------------------------------

def run_on_sbuf(body, x, out_shape, out_dtype=None):
    """DMA x into an SBUF tile, let ``body(tile, out_sbuf)`` fill an SBUF tile of out_shape, return it."""

    def kernel(x):
        tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x)
        result = nl.ndarray(out_shape, out_dtype or x.dtype, buffer=nl.sbuf)
        body(tile, result)
        out = nl.ndarray(out_shape, out_dtype or x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=result)
        return out

    return nki_emulator.jit(kernel)(x)


def test_ap_offset_is_relative_to_the_view_and_none_keeps_the_view_start():
    x = np.arange(128 * 32, dtype=np.float32).reshape(128, 32)

    def body(tile, result):
        view = tile[:, 8:32]  # starts at element 8 of each partition
        nisa.tensor_copy(dst=result[:, 0:4], src=view.ap([[32, 128], [1, 4]]))  # offset None: the view's start
        nisa.tensor_copy(dst=result[:, 4:8], src=view.ap([[32, 128], [1, 4]], offset=2))  # 2 past it

    out = run_on_sbuf(body, x, (128, 8))
    np.testing.assert_array_equal(out[:, 0:4], x[:, 8:12])
    np.testing.assert_array_equal(out[:, 4:8], x[:, 10:14])


def test_ap_dtype_reinterprets_bytes_and_scalar_offset_scales_by_the_dim_stride():
    """The stub's example shape: a (128, 32) fp32 tile read as bf16 with partition stride 64; and a
    scalar index tensor selecting a row of an HBM tensor through indirect_dim=0."""
    x = np.random.default_rng(0).standard_normal((128, 32)).astype(np.float32)

    def body(tile, result):
        nisa.tensor_copy(dst=result, src=tile.ap(pattern=[[64, 128], [1, 16]], dtype=nl.bfloat16))

    out = run_on_sbuf(body, x, (128, 16), out_dtype=nl.bfloat16)
    np.testing.assert_array_equal(out.view(np.uint16), x.view(np.uint16)[:, 0:16])

    def gather_row(table, index):
        idx = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx, src=index)
        row = nl.ndarray((1, table.shape[1]), table.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=row, src=table.ap([[table.shape[1], 1], [1, table.shape[1]]], scalar_offset=idx,
                                            indirect_dim=0))
        out = nl.ndarray((1, table.shape[1]), table.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=row)
        return out

    table = np.arange(5 * 7, dtype=np.float32).reshape(5, 7)
    np.testing.assert_array_equal(nki_emulator.jit(gather_row)(table, np.array([[3]], np.int32)), table[3:4])


def test_view_methods_follow_the_stub_examples(nki_06):  # the view methods came with NKI 0.5 (_values.py)
    @nki_emulator.jit
    def kernel(x):
        t = nl.ndarray((128, 4, 6), nl.float32, buffer=nl.sbuf)
        assert t.reshape((128, 24)).shape == (128, 24)
        flat = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
        assert flat.slice(1, 8, 24, 1).shape == (128, 16) and flat.slice(1, 0, 64, 2).shape == (128, 32)
        assert flat.view(nl.uint8).shape == (128, 256) and flat.view(nl.int32).shape == (128, 64)
        assert nl.ndarray((128, 256), nl.uint8).view(nl.float32).shape == (128, 64)
        assert flat.expand_dim(1).shape == (128, 1, 64)
        assert nl.ndarray((128, 1, 64), nl.float32).squeeze_dim(1).shape == (128, 64)
        assert nl.ndarray((128, 1, 64), nl.float32).broadcast(1, 8).shape == (128, 8, 64)
        assert nl.ndarray((128, 24), nl.float32).reshape_dim(1, (4, -1)).shape == (128, 4, 6)
        assert nl.ndarray((128, 2, 3, 4), nl.float32).flatten_dims(1, 2).shape == (128, 6, 4)
        assert nl.ndarray((128, 8, 64), nl.float32).select(1, 3).shape == (128, 64)
        assert flat[:, 8:24].get_pattern() == [[64, 128], [1, 16]] and flat[:, 8:24].offset == 8
        assert flat.is_contiguous() and not flat[:, 0:64:2].is_contiguous() and flat[:, 0:8].is_contiguous()
        return x

    kernel(np.zeros((1, 1), np.float32))

    def partition_dim_moved(x):
        nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf).expand_dim(0)

    with pytest.raises(NkiValidationError, match="partition dim"):  # on chip, the partition dim stays first
        nki_emulator.jit(partition_dim_moved)(np.zeros((1, 1), np.float32))


# ---- classes (language guide, "Class Support") and small names ---------------------------------------------

class Plain(nl.NKIObject):
    x: int
    y: bool = False

    def toggle(self):
        self.y = not self.y


@dataclasses.dataclass
class Decorated(nl.NKIObject):
    x: int
    y: bool = False

    def __post_init__(self):
        self.described = f"x={self.x}"


def test_nkiobject_classes_get_keyword_constructors_with_and_without_dataclass():
    for cls in (Plain, Decorated):
        c = cls(1)
        assert (c.x, c.y) == (1, False)
        c = cls(x=2, y=True)
        assert (c.x, c.y) == (2, True)
        assert cls().x is None  # fields without a class-level default start as None
    c = Plain(1)
    c.toggle()
    assert c.y is True  # the guide's example: "prints 1 True"
    assert Decorated(x=3).described == "x=3"  # __post_init__ runs
    with pytest.raises(TypeError):
        Plain(z=1)


class PlainAttributes(nl.NKIObject):
    """Fields as plain class attributes, no annotations, no @dataclass: nki-library's attention_cte.py
    AttnInternalBuffers and SectionParams, built from keyword arguments."""
    section_idx = None
    section_offset = 0
    scale: float = 1.0

    def offset_of(self, tile):
        return self.section_offset + tile


@dataclasses.dataclass
class DecoratedPlainAttributes(nl.NKIObject):
    q_sb = None
    k_sb = None


def test_nkiobject_plain_class_attributes_are_fields_built_from_keywords():
    c = PlainAttributes(section_idx=2, section_offset=512)
    assert (c.section_idx, c.section_offset, c.scale) == (2, 512, 1.0)
    assert c.offset_of(3) == 515  # methods are not fields
    assert (PlainAttributes(1, 2, 0.5).section_idx, PlainAttributes().section_offset) == (1, 0)  # body order
    buffers = DecoratedPlainAttributes(k_sb="k")
    assert (buffers.q_sb, buffers.k_sb) == (None, "k")
    buffers.q_sb = "q"  # nki-library fills its buffer objects field by field
    assert DecoratedPlainAttributes().q_sb is None
    with pytest.raises(TypeError, match="no fields"):
        PlainAttributes(offset_of=1)


@dataclasses.dataclass(frozen=True)
class Frozen(nl.NKIObject):
    """As nki-library's rmsnorm_quant.py RmsNormQuantKernelArgs: frozen, with a __post_init__ that checks."""
    eps: float = 1e-6
    lower_bound: float = 0.0

    def __post_init__(self):
        assert self.eps > 0


def test_frozen_nkiobject_dataclasses_build_and_stay_frozen():
    args = Frozen(eps=1e-5)
    assert (args.eps, args.lower_bound) == (1e-5, 0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.eps = 1.0


def test_typing_dtype_and_deprecated_tile_size_names():
    import nki_emulator.typing as nt

    assert nt.tensor[128, 512].shape == (128, 512)
    assert isinstance(nl.float32, nki_emulator.dtype)
    # deprecated in 0.4, same value: the usable SBUF bytes per partition (migration guide)
    assert nl.tile_size.total_available_sbuf_size == nl.tile_size.sbuf_fmax_bytes == 212984  # KLR Trace.lean l. 53


# ---- instructions added for official kernels: semantics from their stub docstrings ------------------------

def scan_reference(data0, data1, initial, op0, op1, reverse0, reverse1):
    """The stub's pseudo-code for tensor_tensor_scan, with its operand-order flags."""
    result = np.empty_like(data0)
    previous = np.broadcast_to(initial, (data0.shape[0],)).astype(np.float32)
    for i in range(data0.shape[1]):
        combined = op0(previous, data0[:, i]) if reverse0 else op0(data0[:, i], previous)
        previous = op1(data1[:, i], combined) if reverse1 else op1(combined, data1[:, i])
        result[:, i] = previous
    return result


@pytest.mark.parametrize("op0, op1, reverse0, reverse1, initial", [
    (nl.multiply, nl.add, False, False, 0.0),  # the mamba tutorial's h_t = a_t * h_{t-1} + b_t
    (nl.subtract, nl.subtract, True, True, "tile"),
])
def test_tensor_tensor_scan_follows_the_stub_pseudo_code(op0, op1, reverse0, reverse1, initial):
    rng = np.random.default_rng(1)
    data0, data1 = rng.uniform(-1, 1, (128, 37)).astype(np.float32), rng.uniform(-1, 1, (128, 37)).astype(np.float32)
    start = rng.uniform(-1, 1, (128, 1)).astype(np.float32)

    @nki_emulator.jit
    def kernel(a, b, start):
        tiles = []
        for src in (a, b, start):
            tile = nl.ndarray(src.shape, src.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=tile, src=src)
            tiles.append(tile)
        result = nl.ndarray(a.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor_scan(dst=result, data0=tiles[0], data1=tiles[1], initial=tiles[2] if initial == "tile"
                                else initial, op0=op0, op1=op1, reverse0=reverse0, reverse1=reverse1)
        out = nl.ndarray(a.shape, nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=result)
        return out

    numpy_ops = {nl.multiply: np.multiply, nl.add: np.add, nl.subtract: np.subtract}
    expected = scan_reference(data0, data1, start[:, 0] if initial == "tile" else initial, numpy_ops[op0],
                              numpy_ops[op1], reverse0, reverse1)
    np.testing.assert_allclose(kernel(data0, data1, start), expected, rtol=1e-5, atol=1e-5)


def test_tensor_scalar_reduce_computes_and_accumulates_across_calls(nki_06):
    """result = data op0 operand0; reduce_res = reduce_op over the free axis; reduce_cmd.reduce keeps
    accumulating, load_reduce starts from reduce_init, reduce_res_negate (NKI 0.6) negates only what is written."""
    rng = np.random.default_rng(2)
    a, b = rng.uniform(0.5, 1.5, (64, 40)).astype(np.float32), rng.uniform(0.5, 1.5, (64, 40)).astype(np.float32)

    @nki_emulator.jit
    def kernel(a, b):
        tiles = []
        for src in (a, b):
            tile = nl.ndarray(src.shape, src.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=tile, src=src)
            tiles.append(tile)
        scaled = nl.ndarray(a.shape, nl.float32, buffer=nl.sbuf)
        sums = nl.ndarray((a.shape[0], 3), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_reduce(dst=scaled, data=tiles[0], op0=nl.multiply, operand0=3.0, reduce_op=nl.add,
                                  reduce_res=sums[:, 0:1])
        nisa.tensor_scalar_reduce(dst=scaled, data=tiles[1], op0=nl.multiply, operand0=3.0, reduce_op=nl.add,
                                  reduce_res=sums[:, 1:2], reduce_cmd=nisa.reduce_cmd.reduce, reduce_res_negate=True)
        nisa.tensor_scalar_reduce(dst=scaled, data=tiles[1], op0=nl.add, operand0=1.0, reduce_op=nl.max,
                                  reduce_res=sums[:, 2:3], reduce_cmd=nisa.reduce_cmd.load_reduce, reduce_init=2.25)
        out = nl.ndarray((a.shape[0], 3 + a.shape[1]), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[:, 0:3], src=sums)
        nisa.dma_copy(dst=out[:, 3:], src=scaled)
        return out

    out = kernel(a, b)
    np.testing.assert_allclose(out[:, 0], 3 * a.sum(1), rtol=1e-5)
    np.testing.assert_allclose(out[:, 1], -3 * (a.sum(1) + b.sum(1)), rtol=1e-5)
    np.testing.assert_allclose(out[:, 2], np.maximum(2.25, (b + 1).max(1)), rtol=1e-6)
    np.testing.assert_allclose(out[:, 3:], b + 1, rtol=1e-6)


@pytest.mark.parametrize("shape, permutation", [((16, 96), (1, 0)), ((4, 8, 32), (2, 1, 0)),
                                                ((2, 3, 4, 16), (3, 1, 2, 0))])
def test_dma_transpose_permutes_as_the_stub_lists(shape, permutation):
    x = np.random.default_rng(3).standard_normal(shape).astype(ml_dtypes.bfloat16)
    out_shape = tuple(shape[a] for a in permutation)

    @nki_emulator.jit
    def kernel(x):
        tile = nl.ndarray(out_shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=tile, src=x)
        out = nl.ndarray(out_shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=tile)
        return out

    np.testing.assert_array_equal(kernel(x), np.transpose(x, permutation))
    # any dtype with the default dge_mode (nki-library's attention_cte.py transposes fp32 q and k this way)
    np.testing.assert_array_equal(kernel(x.astype(np.float32)), np.transpose(x.astype(np.float32), permutation))


def test_average_pool_in_the_tutorial_style():
    """A 2-D average pool over a (C, H, W) tensor written as the average_pool2d tutorial does it
    (nki/examples/average_pool2d): one 5-D access pattern groups each pool window last, nl.sum reduces
    those two axes, a tensor_scalar scales; nki.typing annotates the input."""
    import nki_emulator.typing as nt

    def avg_pool(in_tensor: nt.tensor[8, 12, 12], pool: int):
        channels, height, width = in_tensor.shape
        tile = nl.ndarray(in_tensor.shape, in_tensor.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=in_tensor)
        windows = tile.ap([[height * width, channels], [pool * width, height // pool], [pool, width // pool],
                           [width, pool], [1, pool]])
        sums = nl.sum(windows, axis=[3, 4])
        scaled = nl.ndarray(sums.shape, sums.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=scaled, data=sums, op0=nl.multiply, operand0=1.0 / (pool * pool))
        out = nl.ndarray(sums.shape, in_tensor.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=scaled)
        return out

    x = np.random.default_rng(4).standard_normal((8, 12, 12)).astype(np.float32)
    expected = x.reshape(8, 4, 3, 4, 3).mean(axis=(2, 4))
    np.testing.assert_allclose(nki_emulator.jit(avg_pool)(x, 3), expected, rtol=1e-5, atol=1e-6)


def test_broadcast_to_follows_numpy_rules_across_free_and_partition_dims():
    """nl.broadcast_to as the mamba tutorial (nki/examples/fused_mamba) uses it: a (1, seq) row to every
    partition, and a (P, 1) column along the free axis; numpy's rules, same rank."""
    row, column = np.arange(600, dtype=np.float32).reshape(1, 600), np.arange(128, dtype=np.float32).reshape(128, 1)

    @nki_emulator.jit
    def kernel(row, column):
        outs = []
        for case in ((row, (128, 600)), (column, (128, 16))):
            src, shape = case
            tile = nl.ndarray(src.shape, src.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=tile, src=src)
            out = nl.ndarray(shape, src.dtype, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=out, src=nl.broadcast_to(tile, shape))
            outs.append(out)
        return outs[0], outs[1]

    spread_row, spread_column = kernel(row, column)
    np.testing.assert_array_equal(spread_row, np.broadcast_to(row, (128, 600)))
    np.testing.assert_array_equal(spread_column, np.broadcast_to(column, (128, 16)))

    def wrong_rank(row, column):
        tile = nl.ndarray(row.shape, row.dtype, buffer=nl.sbuf)
        nl.broadcast_to(tile, (4, 1, 600))

    with pytest.raises(NkiValidationError, match="cannot broadcast"):
        nki_emulator.jit(wrong_rank)(row, column)


def _exchange_rows(x):
    """Each core of an LNC=2 launch sends its half of x's rows to the other (nki-library's rmsnorm_tkg shard_on_h)."""
    half = x.shape[0] // 2
    rank = nl.program_id(0)
    mine = nl.ndarray((half, x.shape[1]), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=mine, src=x[rank * half:(rank + 1) * half, :])
    theirs = nl.ndarray((half, x.shape[1]), x.dtype, buffer=nl.sbuf)
    nisa.sendrecv(src=mine, dst=theirs, send_to_rank=1 - rank, recv_from_rank=1 - rank, pipe_id=0)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out[rank * half:(rank + 1) * half, :], src=theirs)
    return out


def test_sendrecv_swaps_tiles_between_the_cores_of_an_lnc2_launch():
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    out = nki_emulator.jit(_exchange_rows)[2](x)
    np.testing.assert_array_equal(out, np.concatenate([x[2:], x[:2]]))  # each core stored the other's half
    with pytest.raises(NkiValidationError, match="LNC=2"):
        nki_emulator.jit(_exchange_rows)(x)
    previous = nki_emulator.set_target("trn1")
    try:
        with pytest.raises(NkiValidationError, match="NeuronCore-v3"):
            nki_emulator.jit(_exchange_rows)[2](x)
    finally:
        nki_emulator.set_target(previous)


def _to_hbm(tiles):
    """The kernel's outputs: each SBUF tile copied to a new shared HBM tensor."""
    outs = []
    for t in tiles:
        outs.append(nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm))
        nisa.dma_copy(dst=outs[-1], src=t)
    return tuple(outs)


def _search8(x, vals):
    data = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=data, src=x)
    wanted = nl.ndarray(vals.shape, vals.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=wanted, src=vals)
    top = nl.ndarray((x.shape[0], 8), nl.float32, buffer=nl.sbuf)
    nisa.max8(dst=top, src=data)
    where = nl.ndarray((x.shape[0], 8), nl.uint32, buffer=nl.sbuf)
    nisa.nc_find_index8(dst=where, data=data, vals=wanted)
    replaced = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.nc_match_replace8(dst=replaced, data=data, vals=top, imm=-1.0)
    return _to_hbm((top, where, replaced))


def test_max8_find_index8_and_match_replace8():
    """The stub's semantics (max8 l. 2025, nc_find_index8 l. 2705, nc_match_replace8 l. 2728 at 3afa0fdf): the 8
    largest per partition in descending order; each value's first index, a repeated value its next occurrence."""
    x = np.random.default_rng(4).permutation(64).reshape(4, 16).astype(np.float32)
    x[0, 3] = x[0, 9] = 100.0  # a repeated maximum
    vals = np.sort(x, axis=1)[:, -8:][:, ::-1].copy()
    top, where, replaced = nki_emulator.jit(_search8)(x, vals)
    np.testing.assert_array_equal(top, vals)
    np.testing.assert_array_equal(np.take_along_axis(x, where.astype(np.int64), axis=1), vals)
    assert sorted(where[0, :2]) == [3, 9]
    assert (replaced == -1.0).sum(axis=1).tolist() == [8, 8, 8, 8]
    np.testing.assert_array_equal(np.sort(replaced, axis=1)[:, 8:], np.sort(x, axis=1)[:, :8])


def _shuffle_and_select(x, bounds):
    data = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=data, src=x)
    lows = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=lows, src=bounds[:, 0:1])
    highs = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=highs, src=bounds[:, 1:2])
    shuffled = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    mask = []
    for i in range(32):
        mask.append(31 - i)
    nisa.nc_stream_shuffle(dst=shuffled, src=data, shuffle_mask=mask)
    selected = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    row_max = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.sbuf)
    nisa.range_select(dst=selected, on_true_tile=data, comp_op0=nl.greater_equal, comp_op1=nl.less, bound0=lows,
                      bound1=highs, reduce_res=row_max, range_start=2)
    return _to_hbm((shuffled, selected, row_max))


def test_nc_stream_shuffle_and_range_select():
    """nc_stream_shuffle (3afa0fdf isa stub l. 1686): partition 32q + i takes 32q + mask[i]; range_select (l. 2365):
    keep where comp_op0(range_start + i, bound0) and comp_op1(range_start + i, bound1), else FP32_MIN; row max."""
    x = np.random.default_rng(5).standard_normal((64, 8)).astype(np.float32)
    bounds = np.tile(np.array([[3.0, 7.0]], np.float32), (64, 1))
    shuffled, selected, row_max = nki_emulator.jit(_shuffle_and_select)(x, bounds)
    np.testing.assert_array_equal(shuffled, np.concatenate([x[31::-1], x[:31:-1]]))
    index = 2 + np.arange(8)
    keep = (index >= 3) & (index < 7)
    np.testing.assert_array_equal(selected, np.where(keep, x, np.finfo(np.float32).min))
    np.testing.assert_array_equal(row_max[:, 0], x[:, keep].max(axis=1))


def _halves_then_barrier(x):
    """Each core writes its half of a shared tensor, then (after core_barrier) reads the whole of it."""
    half = x.shape[0] // 2
    rank = nl.program_id(0)
    shared = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    tile = nl.ndarray((half, x.shape[1]), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=x[rank * half:(rank + 1) * half, :])
    nisa.dma_copy(dst=shared[rank * half:(rank + 1) * half, :], src=tile)
    nisa.core_barrier(data=shared, cores=(0, 1))
    whole = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=whole, src=shared)
    total = nl.ndarray((1, x.shape[1]), x.dtype, buffer=nl.sbuf)
    nisa.tensor_partition_reduce(total, nl.add, whole)
    mask = nl.ndarray(x.shape, nl.uint8, buffer=nl.sbuf)
    nisa.iota(dst=mask, pattern=[[0, x.shape[1]]], offset=0, channel_multiplier=1)  # partition p: value p
    picked = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.memset(dst=picked, value=-1.0)
    nisa.tensor_copy_predicated(dst=picked, src=whole, predicate=mask)  # all rows but row 0
    out = nl.ndarray((x.shape[0] + 1, x.shape[1]), x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out[0:x.shape[0], :], src=picked)
    nisa.dma_copy(dst=out[x.shape[0]:, :], src=total)
    return out


def test_core_barrier_partition_reduce_and_predicated_copy():
    """core_barrier (3afa0fdf isa stub l. 2183): what each core wrote before it is there for the other after it;
    tensor_partition_reduce (l. 992) sums across partitions; tensor_copy_predicated (l. 369) copies where the
    predicate is non-zero."""
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    out = nki_emulator.jit(_halves_then_barrier)[2](x)
    np.testing.assert_array_equal(out[0], -1.0)
    np.testing.assert_array_equal(out[1:4], x[1:])
    np.testing.assert_array_equal(out[4], x.sum(axis=0))


# ---- the API nki-library's second tier uses: vector_offset, dma_compute, local_gather, shared_identity_matrix ----

def _gather_rows(data, indices, oob_mode=nisa.oob_mode.error):
    """The 0.4 dma_copy stub's indirect gather example (aws-neuron-sdk 3afa0fdf isa stub l. 255-282), its oob_mode
    passed on; the dst starts zeroed so that skipped rows show."""
    P, F = indices.shape[0], data.shape[1]
    idx = nl.ndarray((P, 1), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=indices)
    dst = nl.ndarray((P, F), dtype=data.dtype, buffer=nl.sbuf)
    nisa.memset(dst=dst, value=0)
    nisa.dma_copy(dst=dst, src=data.ap(pattern=[[F, P], [1, F]], vector_offset=idx, indirect_dim=0),
                  oob_mode=oob_mode)
    return _to_hbm((dst,))[0]


def _scatter_rows(src_data, indices, output):
    """The stub's indirect scatter example (l. 284-309): row p of src_data lands in output row indices[p]."""
    P, F = src_data.shape
    src = nl.ndarray((P, F), dtype=src_data.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=src, src=src_data)
    idx = nl.ndarray((P, 1), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=indices)
    nisa.dma_copy(dst=output.ap(pattern=[[F, P], [1, F]], vector_offset=idx, indirect_dim=0), src=src)
    return output


def test_vector_offset_gathers_and_scatters_rows_as_the_dma_copy_stub_examples():
    data = np.arange(10 * 6, dtype=np.float32).reshape(10, 6)
    indices = np.array([[7], [0], [9], [7]], np.uint32)
    np.testing.assert_array_equal(nki_emulator.jit(_gather_rows)(data, indices), data[indices[:, 0]])
    rows = np.random.default_rng(5).standard_normal((4, 6)).astype(np.float32)
    scatter_to = np.array([[2], [8], [5], [0]], np.uint32)
    expected = np.full((10, 6), -1.0, np.float32)
    expected[scatter_to[:, 0]] = rows
    np.testing.assert_array_equal(nki_emulator.jit(_scatter_rows)(rows, scatter_to, np.full((10, 6), -1.0, np.float32)),
                                  expected)


def test_vector_offset_scales_by_the_indexed_dims_stride_not_the_patterns():
    """nki-library's router_topk.py (l. 1050-1052) indexes a 1-D (T*E,) tensor with flattened indices through a
    pattern whose first stride is not the tensor's: the index times the stride of ``indirect_dim`` in the tensor
    ("dimension in self.shape whose stride scales the indirect scalar/vector offset", NkiTensor.ap stub)."""

    def kernel(flat, indices):
        idx = nl.ndarray((4, 1), nl.uint32, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx, src=indices)
        dst = nl.ndarray((4, 1), flat.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=dst, src=flat.ap([[3, 4], [1, 1]], offset=0, vector_offset=idx, indirect_dim=0))
        return _to_hbm((dst,))[0]

    flat = np.arange(40, dtype=np.float32)
    indices = np.array([[13], [2], [39], [20]], np.uint32)
    np.testing.assert_array_equal(nki_emulator.jit(kernel)(flat, indices)[:, 0], flat[indices[:, 0]])


def test_vector_offset_out_of_bounds_is_refused_or_skipped_by_oob_mode():
    data = np.arange(10 * 6, dtype=np.float32).reshape(10, 6)
    indices = np.array([[3], [10], [1], [4]], np.uint32)  # row 10 of a 10-row tensor
    with pytest.raises(NkiValidationError, match="out of bounds.*oob_mode"):
        nki_emulator.jit(_gather_rows)(data, indices)
    out = nki_emulator.jit(_gather_rows)(data, indices, nisa.oob_mode.skip)
    np.testing.assert_array_equal(out[[0, 2, 3]], data[[3, 1, 4]])
    np.testing.assert_array_equal(out[1], 0)  # the skipped row keeps the dst's zeros


def _scatter_partly_written(base, rows_written, indices):
    """Rows of an int32 tile, only the first ``rows_written`` of them ever written, scattered into a copy of base."""
    out = nl.ndarray(base.shape, base.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=base)
    tile = nl.ndarray((4, base.shape[1]), base.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile[0:rows_written, :], src=base[0:rows_written, :])
    idx = nl.ndarray((4, 1), nl.uint32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=indices)
    nisa.dma_copy(dst=out.ap([[base.shape[1], 4], [1, base.shape[1]]], vector_offset=idx, indirect_dim=0), src=tile)
    return out


def test_a_scatter_carries_never_written_rows_as_poison_to_the_output():
    """Poison follows a scatter (aws-neuron-sdk 3afa0fdf nki/guides/nki_simulator.rst l. 212-221): an int32 output
    that receives a never-written row is refused; with every row written the same scatter runs."""
    base = np.arange(8 * 3, dtype=np.int32).reshape(8, 3)
    indices = np.array([[7], [5], [2], [0]], np.uint32)
    expected = base.copy()
    expected[indices[:, 0]] = base[:4]
    np.testing.assert_array_equal(nki_emulator.jit(_scatter_partly_written)(base, 4, indices), expected)
    with pytest.raises(NkiValidationError, match="3 elements of the output .* never written"):
        nki_emulator.jit(_scatter_partly_written)(base, 3, indices)


def _indirect_then(data, indices, then):
    idx = nl.ndarray((2, 1), nl.uint32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=indices)
    view = data.ap([[data.shape[1], 2], [1, data.shape[1]]], vector_offset=idx, indirect_dim=0)
    if then == "slice":
        view = view[0:1, :]
    elif then == "scalar_offset":
        data.ap([[data.shape[1], 2], [1, data.shape[1]]], vector_offset=idx, scalar_offset=idx[0:1, :])
    tile = nl.ndarray(view.shape, data.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=view)
    return _to_hbm((tile,))[0]


def test_an_indirect_view_is_taken_whole_and_without_a_scalar_offset():
    """The current NkiTensor.is_indirect stub: the indirect dim "cannot be further sliced or selected"; the 0.4
    dma_copy stub (l. 253): "vector_offset and scalar_offset are mutually exclusive"."""
    data, indices = np.arange(12, dtype=np.float32).reshape(4, 3), np.array([[3], [1]], np.uint32)
    np.testing.assert_array_equal(nki_emulator.jit(_indirect_then)(data, indices, "nothing"), data[[3, 1]])
    with pytest.raises(NkiValidationError, match="cannot be sliced"):
        nki_emulator.jit(_indirect_then)(data, indices, "slice")
    with pytest.raises(NkiValidationError, match="mutually exclusive"):
        nki_emulator.jit(_indirect_then)(data, indices, "scalar_offset")


def test_vector_offset_indexes_only_hbm_tensors_with_sbuf_integer_indices():
    """"idx_tensor is an SBUF tensor of shape (P, 1) ... The tensor being indexed ... must be in HBM" (3afa0fdf isa
    stub l. 245-247); the legal twin is the gather above."""

    def kernel(x, indices, on_chip, index_dtype):
        table = x
        if on_chip:
            table = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=table, src=x)
        idx = nl.ndarray((2, 1), index_dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx, src=indices)
        table.ap([[4, 2], [1, 4]], vector_offset=idx, indirect_dim=0)
        return x

    x, indices = np.zeros((4, 4), np.float32), np.array([[1], [0]], np.uint32)
    with pytest.raises(NkiValidationError, match="must be in HBM"):
        nki_emulator.jit(kernel)(x, indices, True, nl.uint32)
    with pytest.raises(NkiValidationError, match="integer SBUF tensor"):
        nki_emulator.jit(kernel)(x, indices, False, nl.float32)
    nki_emulator.jit(kernel)(x, indices, False, nl.uint32)


def _dma_sum(tensors, reduce_op=nl.add, scales=None):
    out = nl.ndarray(tensors[0].shape, nl.bfloat16, buffer=nl.shared_hbm)
    nisa.dma_compute(out, tensors, reduce_op=reduce_op, scales=scales)
    return out


def test_dma_compute_adds_its_sources_in_fp32_and_casts_to_dst():
    """The 0.4 stub (3afa0fdf isa stub l. 2238-2252): dst = srcs[0] + srcs[1] + ..., computed in float32, cast
    to dst's dtype; sources in HBM or SBUF, any dtype, the element counts equal."""
    rng = np.random.default_rng(6)
    a, b = rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal((4, 8)).astype(ml_dtypes.bfloat16)
    c = rng.standard_normal((4, 8)).astype(np.float16)
    out = nki_emulator.jit(_dma_sum)((a, b, c))
    expected = (a.astype(np.float32) + b.astype(np.float32) + c.astype(np.float32)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("options, message", [({"reduce_op": nl.maximum}, "must be nl.add"),
                                              ({"scales": (1.0, 2.0)}, "scales must be None or one 1.0"),
                                              ({"scales": (1.0,)}, "scales must be None or one 1.0")])
def test_dma_compute_refuses_what_its_stub_does_not_support(options, message):
    a = np.ones((2, 4), np.float32)
    with pytest.raises(NkiValidationError, match=message):
        nki_emulator.jit(_dma_sum)((a, a), **options)
    with pytest.raises(NkiValidationError, match="1 to 16 source"):
        nki_emulator.jit(_dma_sum)((a,) * 17)
    with pytest.raises(NkiValidationError, match="element counts must match"):
        nki_emulator.jit(_dma_sum)((a, np.ones((2, 3), np.float32)))
    np.testing.assert_array_equal(nki_emulator.jit(_dma_sum)((a,) * 16), np.full((2, 4), 16.0))


def _scatter_add(table, rows, indices, unique_indices=True):
    """The stub's scatter read-modify-write (l. 2259-2262): table[indices] += rows, dst an indirect HBM view."""
    P, F = rows.shape
    src = nl.ndarray((P, F), rows.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=src, src=rows)
    idx = nl.ndarray((P, 1), nl.uint32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=indices)
    view = table.ap([[F, P], [1, F]], vector_offset=idx, indirect_dim=0)
    nisa.dma_compute(view, [view, src], reduce_op=nl.add, unique_indices=unique_indices)
    return table


def test_dma_compute_scatter_read_modify_write_with_unique_indices():
    rng = np.random.default_rng(7)
    table, rows = rng.standard_normal((8, 4)).astype(np.float32), rng.standard_normal((3, 4)).astype(np.float32)
    indices = np.array([[6], [1], [3]], np.uint32)
    expected = table.copy()
    expected[indices[:, 0]] += rows
    np.testing.assert_allclose(nki_emulator.jit(_scatter_add)(table.copy(), rows, indices), expected, rtol=1e-6)
    with pytest.raises(NkiValidationError, match="repeats an index"):
        nki_emulator.jit(_scatter_add)(table.copy(), rows, np.array([[6], [1], [6]], np.uint32))
    with pytest.raises(NkiValidationError, match="unique_indices=True"):
        nki_emulator.jit(_scatter_add)(table.copy(), rows, indices, False)


def _gather_add(table, rows, indices, oob_mode=nisa.oob_mode.error):
    """The stub's gather read-modify-write (l. 2264-2267): acc(SBUF) = acc + table[indices], dst in SBUF."""
    P, F = rows.shape
    acc = nl.ndarray((P, F), rows.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=acc, src=rows)
    idx = nl.ndarray((P, 1), nl.uint32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=indices)
    view = table.ap([[F, P], [1, F]], vector_offset=idx, indirect_dim=0)
    nisa.dma_compute(acc, (view, acc), reduce_op=nl.add, oob_mode=oob_mode)
    return _to_hbm((acc,))[0]


def test_dma_compute_gather_read_modify_write_and_its_skipped_rows():
    rng = np.random.default_rng(13)
    table, rows = rng.standard_normal((8, 4)).astype(np.float32), rng.standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_allclose(nki_emulator.jit(_gather_add)(table, rows, np.array([[6], [1], [3]], np.uint32)),
                               rows + table[[6, 1, 3]], rtol=1e-6)
    past_the_end = np.array([[6], [8], [3]], np.uint32)
    with pytest.raises(NkiValidationError, match="out of bounds"):
        nki_emulator.jit(_gather_add)(table, rows, past_the_end)
    out = nki_emulator.jit(_gather_add)(table, rows, past_the_end, nisa.oob_mode.skip)
    np.testing.assert_allclose(out, np.stack([rows[0] + table[6], rows[1], rows[2] + table[3]]), rtol=1e-6)


def _local_gather(src_buffer, index, num_elem_per_idx, num_valid_indices, output_shape):
    """The 0.4 SDK's local_gather example (nki/test/test_nki_isa_local_gather.py l. 18-38), in the 0.4 dialect."""
    src = nl.ndarray(src_buffer.shape, src_buffer.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=src, src=src_buffer)
    idx = nl.ndarray(index.shape, index.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=index)
    out = nl.ndarray(output_shape, src_buffer.dtype, buffer=nl.sbuf)
    nisa.local_gather(dst=out, src_buffer=src, index=idx, num_elem_per_idx=num_elem_per_idx,
                      num_valid_indices=num_valid_indices)
    return _to_hbm((out,))[0]


def test_local_gather_matches_the_sdk_examples_numpy_semantics():
    """The numpy reference of nki/test/test_nki_isa_local_gather.py (l. 44-86, 3afa0fdf), at its shapes: each
    core of 16 partitions flattens its index slice column by column, and every partition reads its own row."""
    rng = np.random.default_rng(8)
    src_buffer = (rng.random((128, 512, 4)) * 100).astype(np.float32)
    index_per_core = rng.integers(0, 512, (16, 4)).astype(np.uint16)
    index = np.tile(index_per_core, (8, 1))
    num_elem_per_idx, num_valid_indices, output_shape = 4, 64, (128, 4, 16, 4)
    out = nki_emulator.jit(_local_gather)(src_buffer, index * num_elem_per_idx, num_elem_per_idx, num_valid_indices,
                                          output_shape)
    expected = np.empty((128, num_valid_indices, num_elem_per_idx), np.float32)
    for core in range(8):
        rows = slice(16 * core, 16 * (core + 1))
        indices_1d = index[rows].flatten(order="F")[:num_valid_indices]
        expected[rows] = np.take(src_buffer[rows], indices_1d, axis=1)
    np.testing.assert_array_equal(out, expected.reshape(output_shape))


@pytest.mark.parametrize("index, width, valid, message", [
    (np.zeros((32, 2), np.uint32), 1, None, "index must be uint16"),
    (np.zeros((32, 2), np.uint16), 3, None, "num_elem_per_idx must be one of"),
    (np.zeros((32, 2), np.uint16), 1, 33, "num_valid_indices 33 must be at most the 32"),
    (np.full((32, 2), 60, np.uint16), 8, None, "past the 64 elements"),
])
def test_local_gather_refuses_what_its_stub_rules_out(index, width, valid, message):
    """The stub's three tile-size constraints, uint16 indices (3afa0fdf isa stub l. 1503-1516), and an index past
    a partition's row ("Behavior of out-of-bound index access is undefined", l. 1492)."""
    src = np.zeros((32, 64), np.float32)  # a core's 16 partitions of 2 indices each: 32 indices per core
    with pytest.raises(NkiValidationError, match=message):
        nki_emulator.jit(_local_gather)(src, index, width, valid, (32, (valid or 32) * width))


def test_shared_identity_matrix_is_an_sbuf_identity_that_transposes_through_a_matmul():
    """The 0.4 language stub (l. 2061-2083): an (n, n) identity in SBUF of the dtype asked; nki-library uses it as a
    matmul operand to transpose (core/moe/moe_tkg/all_expert_impl.py l. 180, 311)."""
    x = np.random.default_rng(9).standard_normal((32, 16)).astype(np.float32)

    @nki_emulator.jit
    def kernel(x):
        identity = nl.shared_identity_matrix(n=32, dtype=nl.float32)
        assert identity.buffer == nl.sbuf and identity.shape == (32, 32) and identity.dtype == nl.float32
        tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x)
        product = nl.ndarray((16, 32), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=product, stationary=tile, moving=identity)  # tile.T @ I
        result = nl.ndarray((16, 32), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=result, src=product)
        return _to_hbm((identity, result))

    with nki_emulator.counting() as counts:
        identity, transposed = kernel(x)
    loads = [i for i in counts.trace if i.name == "shared_identity_matrix"]
    assert [(i.engine, i.partitions, i.free) for i in loads] == [("dma", 32, 32)]  # priced as one DMA of its rows
    np.testing.assert_array_equal(identity, np.eye(32))
    np.testing.assert_allclose(transposed, x.T, rtol=1e-6)

    def into(x, buffer):
        tile = nl.ndarray((8, 8), nl.bfloat16, buffer=buffer)
        nl.shared_identity_matrix(8, dtype=nl.bfloat16, dst=tile)
        return _to_hbm((tile,))[0] if buffer == nl.sbuf else x

    np.testing.assert_array_equal(nki_emulator.jit(into)(x, nl.sbuf).astype(np.float32), np.eye(8))
    with pytest.raises(NkiValidationError, match=r"dst must be an \(8, 8\) SBUF tile"):
        nki_emulator.jit(into)(x, nl.psum)


def _indirect_transpose(src_hbm, idx_hbm, dge_mode=nisa.dge_mode.unknown):
    """The 0.4 stub's indirect transpose with 1-D indices (3afa0fdf isa stub l. 728-751), at 16 rows."""
    rows, columns = src_hbm.shape[0], src_hbm.shape[1]
    idx = nl.ndarray(idx_hbm.shape, idx_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=idx_hbm)
    dst = nl.ndarray((columns, idx_hbm.shape[0]), src_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_transpose(dst=dst, src=src_hbm.ap(pattern=[[columns, idx_hbm.shape[0]], [1, columns]],
                                               vector_offset=idx, indirect_dim=0), axes=(1, 0), dge_mode=dge_mode)
    return _to_hbm((dst,))[0]


def test_indirect_dma_transpose_gathers_rows_then_transposes():
    """``flat_indices = indices.T.flatten()[:src.shape[0]]; dst = src[flat_indices, :].T`` (l. 724-726)."""
    src = np.random.default_rng(10).standard_normal((40, 32)).astype(ml_dtypes.bfloat16)
    indices = np.random.default_rng(11).permutation(40)[:16].reshape(16, 1).astype(np.uint32)
    np.testing.assert_array_equal(nki_emulator.jit(_indirect_transpose)(src, indices), src[indices[:, 0]].T)
    with pytest.raises(NkiValidationError, match="dge_mode must be unknown or swdge"):
        nki_emulator.jit(_indirect_transpose)(src, indices, nisa.dge_mode.hwdge)
    with pytest.raises(NkiValidationError, match="uint32 indices"):
        nki_emulator.jit(_indirect_transpose)(src, indices.astype(np.int32))


def test_dma_enum_arguments_are_taken_by_value_and_a_direct_transpose_refuses_swdge():
    """nki-library passes ``dge_mode=3`` (dge_mode.none by value; core/qkv/qkv_tkg.py l. 66) and transposes directly
    with it (core/mlp/mlp_tkg/mlp_tkg_gate_up_projection.py l. 333); swdge is the indirect transpose's (isa stub
    3afa0fdf l. 697-709)."""
    x = np.random.default_rng(12).standard_normal((16, 32)).astype(ml_dtypes.bfloat16)

    def kernel(x, dge_mode):
        tile = nl.ndarray((32, 16), x.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=tile, src=x, dge_mode=dge_mode)
        return _to_hbm((tile,))[0]

    np.testing.assert_array_equal(nki_emulator.jit(kernel)(x, 3), x.T)
    with pytest.raises(NkiValidationError, match="swdge is the indirect transpose"):
        nki_emulator.jit(kernel)(x, nisa.dge_mode.swdge)
    with pytest.raises(NkiValidationError, match="not a nki.isa.dge_mode"):
        nki_emulator.jit(kernel)(x, 7)

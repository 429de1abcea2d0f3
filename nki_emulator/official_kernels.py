"""Run aws-neuron/nki-library's kernels, unmodified, under this emulator against their ``*_torch.py`` references,
called as nki-library's own tests call them: keyword arguments from the test's input generator (a kernel's
defaulted parameters left out), ``kernel[lnc](...)`` with the test's LNC degree, the test's tolerances.

Not part of CI (it needs a checkout of nki-library, which CI has no network to fetch). Run by hand:

    git clone https://github.com/aws-neuron/nki-library /tmp/nki-library
    python -m nki_emulator.official_kernels /tmp/nki-library [name-filter]

It prints one line per case (pass, fail and why) and a total; ``NKI_EMULATOR_NKI_VERSION=0.6`` checks them under the
current release's rules instead of the contest's 0.4. The cases follow the tests' parameter lists in
``test/integration/nkilib/...`` (named per case), at their smaller shapes so that the run stays minutes on a CPU.
No nki-library code is copied here: kernels and references are imported from the checkout.
"""

import ast
import importlib
import importlib.util
import linecache
import sys
import time
import traceback
import types

import ml_dtypes
import numpy as np

import nki_emulator

CORE = "nkilib_src.nkilib.core."
_CHECKOUT = []  # the nki-library checkout (main's argument)
BF16, FP16, FP32 = ml_dtypes.bfloat16, np.float16, np.float32  # np.dtype(FP32) is nl.float32 (the emulator's)


def _randn(shape, dtype, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32).astype(dtype)


def _call_reference(reference, inputs):
    """The reference on float32 torch tensors (bf16/fp8/fp16 widened), as nki-library's torch_ref_wrapper calls
    it (test/utils/unit_test_framework.py); its outputs, in order, as float32 numpy arrays."""
    import torch

    def to_torch(value):
        if isinstance(value, np.ndarray):
            return torch.from_numpy(value if value.dtype.kind in "iub" else np.asarray(value, np.float32))
        return value

    result = reference(**{name: to_torch(value) for name, value in inputs.items()})
    values = result.values() if isinstance(result, dict) else result if isinstance(result, (tuple, list)) else [result]
    return [v.float().numpy() if isinstance(v, torch.Tensor) else np.asarray(v, np.float32) for v in values]


def _outputs(result):
    if result is None:
        return []
    return [np.asarray(r, np.float32) for r in (result if isinstance(result, (tuple, list)) else [result])]


# ---- nki-library's test files, where they cannot be imported ------------------------------------------------------
# Most test modules import nki-library's test framework (test/utils/common_dataclasses.py and what it imports), which
# needs AWS-internal packages (aws_embedded_metrics, ...). Their input generators, wrapper kernels and goldens are
# still plain functions: ``_test_module`` runs such a file statement by statement, keeping what loads here, and
# ``_captured_test`` runs a test's own ``run_*_test`` function with a stand-in for its UnitTestFramework that records
# what the test would run (kernel, torch reference, inputs, tolerances) instead of running it.

class _Unavailable:
    """A name a test file imports that does not load here (a type in an annotation, a framework class)."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"<{self.name}: not importable here>"


def _test_module(relative_path):
    """The namespace of nki-library's test file ``relative_path`` (under the checkout's ``test/``): each top-level
    statement executed alone, imports that fail bound to ``_Unavailable``, statements that fail skipped (test
    classes and parameter tables that need the framework)."""
    path = f"{_CHECKOUT[0]}/test/{relative_path}"
    tree = ast.parse(open(path).read(), path)
    namespace = {"__name__": "nki_library_test_" + relative_path.replace("/", "_")[:-3], "__file__": path}
    for node in tree.body:
        try:
            exec(compile(ast.Module([node], []), path, "exec"), namespace)
        except ImportError:
            for alias in node.names:
                namespace[(alias.asname or alias.name).partition(".")[0]] = _Unavailable(alias.name)
        except Exception:  # noqa: BLE001 -- a statement of the test framework's, not needed by the cases
            pass
    return namespace


class _UnitTestFramework:
    """Stands in for nki-library's test/utils/unit_test_framework.py ``UnitTestFramework``: records the test."""

    recorded = []

    def __init__(self, test_manager, kernel_entry, torch_ref, kernel_input_generator, output_tensor_descriptor,
                 **options):
        self.kernel, self.reference, self.make_inputs = kernel_entry, torch_ref, kernel_input_generator

    def run_test(self, test_config, compiler_args, rtol, atol, **options):
        self.lnc, self.rtol, self.atol = compiler_args.logical_nc_config, rtol, atol
        _UnitTestFramework.recorded.append(self)


def _captured_test(relative_path, function, lnc, **arguments):
    """(kernel, reference, inputs(), lnc, rtol, atol) of the test function ``function`` of a test file that runs its
    case through UnitTestFramework, called with ``arguments`` and a CompilerArgs of ``lnc``."""
    namespace = _test_module(relative_path)
    namespace.update(UnitTestFramework=_UnitTestFramework, torch_ref_wrapper=lambda reference: reference)
    namespace[function](test_manager=None, compiler_args=types.SimpleNamespace(logical_nc_config=lnc), **arguments)
    test = _UnitTestFramework.recorded.pop()

    def inputs():
        return {name.replace(".must_alias_input", ""): value for name, value in test.make_inputs(None).items()}

    return test.kernel, lambda values: _call_reference(test.reference, values), inputs, test.lnc, test.rtol, test.atol


# ---- the cases: (name, kernel "module:function", reference "module:function", inputs(), lnc, rtol, atol) ------

def _cumsum(batch, hidden, ndim, seq_len, dtype):  # test/integration/nkilib/core/cumsum/test_cumsum.py
    shape = (batch, seq_len, hidden) if ndim == 3 else (batch, hidden)
    return {"x": _randn(shape, dtype, 42)}


def _rmsnorm_tkg(batch, seqlen, hidden, hidden_actual, hidden_dim_tp, shard_on_h, dtype):
    # test/integration/nkilib/core/subkernels/test_rmsnorm_tkg.py generate_inputs
    return {"input": _randn((batch, seqlen, hidden), dtype, 42), "gamma": _randn((1, hidden), dtype, 43),
            "output": np.zeros((128, batch * seqlen, hidden // 128), dtype), "hidden_actual": hidden_actual,
            "hidden_dim_tp": hidden_dim_tp, "shard_on_h": shard_on_h}


def _layernorm_tkg(batch, seqlen, hidden, shard_on_h, dtype):
    # test/integration/nkilib/core/subkernels/test_layernorm_tkg.py generate_inputs
    return {"input": _randn((batch, seqlen, hidden), dtype, 42), "gamma": _randn((1, hidden), dtype, 43),
            "output": np.zeros((128, batch * seqlen, hidden // 128), dtype), "beta": _randn((1, hidden), dtype, 44),
            "shard_on_h": shard_on_h}


def _attention_bwd(batch, q_heads, kv_heads, seq_len, head_dim, dtype, causal, sinks=False):
    # test/integration/nkilib/core/attention/test_attention_bwd.py generate_inputs (one sink per head or none; no
    # window or packing)
    import torch

    module = importlib.import_module(CORE + "attention.attention_bwd_torch")
    q = _randn((batch, q_heads, head_dim, seq_len), dtype, 1)
    k, v = _randn((batch, kv_heads, head_dim, seq_len), dtype, 2), _randn((batch, kv_heads, head_dim, seq_len), dtype, 3)
    dy = _randn((batch, q_heads, head_dim, seq_len), dtype, 4)
    sink = np.repeat(_randn((1, q_heads), dtype, 5), batch, axis=0) if sinks else None
    scale = 1.0 if causal else None  # as the test's minimal configurations set it
    widen = lambda a: torch.from_numpy(np.asarray(a, np.float32))  # noqa: E731
    o, lse, _ = module.compute_o_lse(widen(q), widen(k), widen(v), causal, True, softmax_scale=scale,
                                     sliding_window=-1, sinks=widen(sink) if sinks else None, bound_min=None,
                                     bound_max=None)
    return {"q_ref": q, "k_ref": k, "v_ref": v, "o_ref": o.float().numpy().astype(dtype), "dy_ref": dy,
            "lse_ref": lse.float().numpy(), "sinks_ref": sink, "use_causal_mask": causal, "mixed_precision": True,
            "softmax_scale": scale, "sliding_window": -1, "bound_min": None, "bound_max": None}


def _cross_entropy(positions, vocab, dtype, **options):
    # test/integration/nkilib/experimental/loss/test_cross_entropy_{forward,backward}.py generate_kernel_inputs
    rng = np.random.default_rng(42)
    inputs = {"logits_hbm": rng.standard_normal((positions, vocab)).astype(np.float32).astype(dtype),
              "targets_hbm": rng.integers(0, vocab, positions, dtype=np.int32)}
    if "reduction" in options:  # the backward takes the forward's log-sum-exp
        module = importlib.import_module("nkilib_src.nkilib.experimental.loss.cross_entropy_torch")
        logits, targets = _torch_logits(inputs)
        inputs["lse_state_hbm"] = module.cross_entropy_forward_torch_ref(logits, targets)[1].float().numpy().astype(dtype)
    return {**inputs, **options, "dtype": np.dtype(dtype)}  # nl.bfloat16 / nl.float32, as the tests pass them


def _torch_logits(inputs):
    """The logits in their own dtype and the targets as int64, as the cross-entropy tests' goldens take them."""
    import torch

    logits = inputs["logits_hbm"]
    as_torch = torch.from_numpy(np.asarray(logits, np.float32))
    return (as_torch.to(torch.bfloat16) if logits.dtype == BF16 else as_torch), \
        torch.from_numpy(inputs["targets_hbm"]).long()


def _cross_entropy_forward_reference(inputs):
    module = importlib.import_module("nkilib_src.nkilib.experimental.loss.cross_entropy_torch")
    return [t.float().numpy() for t in module.cross_entropy_forward_torch_ref(*_torch_logits(inputs))]


def _cross_entropy_backward_reference(inputs):
    module = importlib.import_module("nkilib_src.nkilib.experimental.loss.cross_entropy_torch")
    return [module.cross_entropy_backward_torch_ref(*_torch_logits(inputs), inputs["reduction"]).float().numpy()]


def _rope(d_head, batch, heads, seq, contiguous_layout, relayout_in_sbuf):
    # test/integration/nkilib/core/embeddings/test_rope.py generate_kernel_inputs
    half = d_head // 2
    return {"x_in": _randn((d_head, batch, heads, seq), BF16, 1), "cos": _randn((half, batch, seq), BF16, 2),
            "sin": _randn((half, batch, seq), BF16, 3), "lnc_shard": True, "contiguous_layout": contiguous_layout,
            "relayout_in_sbuf": relayout_in_sbuf}


def _cascaded_max(batch, seqlen, vocab, dtype):  # test/integration/nkilib/core/max/test_cascaded_max.py
    return {"input_tensor": _randn((batch, seqlen, vocab), dtype, 42)}


def _rope_hf(batch, q_heads, kv_heads, seq, head_dim, dtype, backward):
    # test/integration/nkilib/core/embeddings/test_rope_hf.py _generate_inputs (separate cos/sin)
    q, k = _randn((batch, q_heads, seq, head_dim), dtype, 1), _randn((batch, kv_heads, seq, head_dim), dtype, 2)
    return {"q": q, "k": k, "q_out": np.zeros_like(q), "k_out": np.zeros_like(k), "backward": backward,
            "cos": _randn((batch, seq, head_dim), dtype, 3), "sin": _randn((batch, seq, head_dim), dtype, 4)}


def _attention_cte(bs, seq_q, seq_kv, d, dtype, causal, tp_q, tp_k, tp_out, cache_softmax, sliding_window=0,
                   sink=False):
    # test/integration/nkilib/core/attention/test_attention_cte.py build_attention_cte_input (no prefix cache, no CP)
    rng = np.random.default_rng(7)  # np_random_sample: uniform in [0, 1)

    def sample(shape):
        return rng.random(shape).astype(np.float32).astype(dtype)

    return {"q": sample((bs, seq_q, d) if tp_q else (bs, d, seq_q)), "k": sample((bs, seq_kv, d) if tp_k else
                                                                               (bs, d, seq_kv)),
            "v": sample((bs, seq_kv, d)), "scale": 1.0 if sliding_window else d ** -0.5, "causal_mask": causal, "k_prior": None,
            "v_prior": None, "prior_used_len": None,
            "sink": rng.uniform(15.0, 25.0, (bs, 1)).astype(np.float32) if sink else None,
            "sliding_window": sliding_window, "tp_q": tp_q, "tp_k": tp_k, "tp_out": tp_out, "cp_offset": None,
            "global_cp_deg": None, "cp_strided_q_slicing": False, "cache_softmax": cache_softmax,
            "softmax_dtype": np.dtype(FP32), "mm_out_dtype": np.dtype(FP32), "bound_min": None, "bound_max": None}


def _attention_cte_reference(inputs):
    """attention_cte_torch_ref as the test's attention_cte_forward_golden calls it: torch tensors, float32 softmax."""
    import torch

    module = importlib.import_module(CORE + "attention.attention_cte_torch")
    tensors = {name: torch.from_numpy(np.asarray(value, np.float32)) if isinstance(value, np.ndarray) else value
               for name, value in inputs.items() if name not in ("mm_out_dtype", "softmax_dtype")}
    result = module.attention_cte_torch_ref(**tensors, softmax_dtype=torch.float32)
    return [t.float().numpy() for t in (result if isinstance(result, tuple) else (result,))]


def _output_projection_tkg(batch, heads, seq, d_head, hidden, bias, transpose_out):
    # test/integration/nkilib/core/output_projection/test_output_proj_tkg.py build_output_proj_tkg_input (no quant.)
    quantization = importlib.import_module(CORE + "utils.common_types").QuantizationType
    return {"attention": _randn((d_head, batch, heads, seq), BF16, 1), "weight": _randn((d_head * heads, hidden), BF16, 2),
            "bias": (100 * _randn((1, hidden), np.float32, 3)).astype(BF16) if bias else None,
            "quantization_type": quantization.NONE, "weight_scale": None, "input_scale": None,
            "TRANSPOSE_OUT": transpose_out, "OUT_IN_SB": False}


def _output_projection_cte(batch, seq, hidden, heads, d_head, bias):
    # test/integration/nkilib/core/output_projection/test_output_proj_cte.py generate_output_proj_cte_inputs
    quantization = importlib.import_module(CORE + "utils.common_types").QuantizationType
    rng = np.random.default_rng(11)  # np_random_sample: uniform in [0, 1)
    return {"attention": rng.random((batch, heads, d_head, seq)).astype(np.float32).astype(BF16),
            "weight": rng.random((heads * d_head, hidden)).astype(np.float32).astype(BF16),
            "bias": (100 * _randn((1, hidden), np.float32, 3)).astype(BF16) if bias else None,
            "quantization_type": quantization.NONE, "input_scales": None, "weight_scales": None}


BF16_EPS = 2.0 ** -7

CASES = [
    ("cumsum 1x256 fp32", "cumsum.cumsum:cumsum", "cumsum.cumsum_torch:cumsum_torch_ref",
     lambda: _cumsum(1, 256, 2, 1, FP32), 2, 1e-3, 1e-3),
    ("cumsum 64x4x1024 bf16", "cumsum.cumsum:cumsum", "cumsum.cumsum_torch:cumsum_torch_ref",
     lambda: _cumsum(64, 1024, 3, 4, BF16), 2, 1e-2, 1e-3),
    ("cumsum 128x2048 fp32", "cumsum.cumsum:cumsum", "cumsum.cumsum_torch:cumsum_torch_ref",
     lambda: _cumsum(128, 2048, 2, 1, FP32), 2, 1e-3, 1e-3),
    ("rmsnorm_tkg lnc1 1x1x8192", "subkernels.rmsnorm_tkg:rmsnorm_tkg",
     "subkernels.rmsnorm_torch:rmsnorm_tkg_torch_ref_lnc1",
     lambda: _rmsnorm_tkg(1, 1, 8192, None, False, False, FP16), 1, 2e-2, 1e-5),
    ("rmsnorm_tkg lnc1 1x4x2048 actual 1920", "subkernels.rmsnorm_tkg:rmsnorm_tkg",
     "subkernels.rmsnorm_torch:rmsnorm_tkg_torch_ref_lnc1",
     lambda: _rmsnorm_tkg(1, 4, 2048, 1920, False, False, FP16), 1, 2e-2, 1e-5),
    ("rmsnorm_tkg lnc2 2x8x8192", "subkernels.rmsnorm_tkg:rmsnorm_tkg", "subkernels.rmsnorm_torch:rmsnorm_tkg_torch_ref",
     lambda: _rmsnorm_tkg(2, 8, 8192, None, False, False, FP16), 2, 2e-2, 1e-5),
    ("rmsnorm_tkg lnc2 4x1x3072 shard_on_h", "subkernels.rmsnorm_tkg:rmsnorm_tkg",
     "subkernels.rmsnorm_torch:rmsnorm_tkg_torch_ref",
     lambda: _rmsnorm_tkg(4, 1, 3072, None, False, True, FP16), 2, 2e-2, 1e-5),
    ("rmsnorm_tkg lnc2 1x1x4096 hidden_dim_tp", "subkernels.rmsnorm_tkg:rmsnorm_tkg",
     "subkernels.rmsnorm_torch:rmsnorm_tkg_torch_ref_lnc1",
     lambda: _rmsnorm_tkg(1, 1, 4096, 3072, True, False, FP16), 1, 2e-2, 1e-5),
    ("layernorm_tkg lnc1 1x8x8192", "subkernels.layernorm_tkg:layernorm_tkg",
     "subkernels.layernorm_torch:layernorm_tkg_torch_ref_lnc1",
     lambda: _layernorm_tkg(1, 8, 8192, False, FP16), 1, 2e-2, 1e-5),
    ("layernorm_tkg lnc2 2x8x8192", "subkernels.layernorm_tkg:layernorm_tkg",
     "subkernels.layernorm_torch:layernorm_tkg_torch_ref",
     lambda: _layernorm_tkg(2, 8, 8192, False, FP16), 2, 2e-2, 1e-5),
    ("layernorm_tkg lnc2 4x1x3072 shard_on_h", "subkernels.layernorm_tkg:layernorm_tkg",
     "subkernels.layernorm_torch:layernorm_tkg_torch_ref",
     lambda: _layernorm_tkg(4, 1, 3072, True, FP16), 2, 2e-2, 1e-5),
    ("attention_bwd 1x1x1 S512 d128 causal", "attention.attention_bwd:attention_bwd",
     "attention.attention_bwd_torch:attention_bwd_torch_ref",
     lambda: _attention_bwd(1, 1, 1, 512, 128, BF16, True), 1, 2e-2, 1e-5),
    ("attention_bwd 1x2x1 S256 d64 non-causal", "attention.attention_bwd:attention_bwd",
     "attention.attention_bwd_torch:attention_bwd_torch_ref",
     lambda: _attention_bwd(1, 2, 1, 256, 64, BF16, False), 1, 2e-2, 1e-5),
    ("attention_bwd lnc2 2x2x1 S256 d128 causal", "attention.attention_bwd:attention_bwd",
     "attention.attention_bwd_torch:attention_bwd_torch_ref",
     lambda: _attention_bwd(2, 2, 1, 256, 128, BF16, True), 2, 2e-2, 1e-5),
    ("attention_bwd 1x2x1 S256 d64 causal sink", "attention.attention_bwd:attention_bwd",
     "attention.attention_bwd_torch:attention_bwd_torch_ref",
     lambda: _attention_bwd(1, 2, 1, 256, 64, BF16, True, sinks=True), 1, 2e-2, 1e-5),
    ("rope d64 B1 H1 S16 contiguous", "embeddings.rope:RoPE", "embeddings.rope_torch:rope_torch_ref",
     lambda: _rope(64, 1, 1, 16, True, False), 2, BF16_EPS, 1e-3),
    ("rope d128 B8 H8 S128 relayout", "embeddings.rope:RoPE", "embeddings.rope_torch:rope_torch_ref",
     lambda: _rope(128, 8, 8, 128, False, True), 2, BF16_EPS, 1e-3),
    ("cascaded_max lnc1 1x1x3168", "max.cascaded_max:cascaded_max", "max.cascaded_max_torch:cascaded_max_torch_ref",
     lambda: _cascaded_max(1, 1, 3168, FP32), 1, 1e-5, 1e-5),
    ("cascaded_max lnc2 8x5x4058", "max.cascaded_max:cascaded_max", "max.cascaded_max_torch:cascaded_max_torch_ref",
     lambda: _cascaded_max(8, 5, 4058, FP32), 2, 1e-5, 1e-5),
    ("cascaded_max lnc2 65x1x3168", "max.cascaded_max:cascaded_max", "max.cascaded_max_torch:cascaded_max_torch_ref",
     lambda: _cascaded_max(65, 1, 3168, FP32), 2, 1e-5, 1e-5),
    ("rope_hf lnc1 1x32x8 S256 d128 fp32", "embeddings.rope_hf:rope_hf", "embeddings.rope_hf_torch:rope_hf_torch_ref",
     lambda: _rope_hf(1, 32, 8, 256, 128, FP32, False), 1, 1e-6, 1e-6),
    ("rope_hf lnc2 1x32x8 S512 d64 fp32", "embeddings.rope_hf:rope_hf", "embeddings.rope_hf_torch:rope_hf_torch_ref",
     lambda: _rope_hf(1, 32, 8, 512, 64, FP32, False), 2, 1e-6, 1e-6),
    ("rope_hf lnc2 backward fp32", "embeddings.rope_hf:rope_hf", "embeddings.rope_hf_torch:rope_hf_torch_ref",
     lambda: _rope_hf(1, 32, 8, 256, 128, FP32, True), 2, 1e-6, 1e-6),
    ("attention_cte lnc2 1x256x256 d64 causal", "attention.attention_cte:attention_cte", _attention_cte_reference,
     lambda: _attention_cte(1, 256, 256, 64, BF16, True, True, False, False, False), 2, 2e-2, 1e-5),
    ("attention_cte lnc2 2x512x512 d128 tp_k tp_out cache_softmax", "attention.attention_cte:attention_cte",
     _attention_cte_reference,
     lambda: _attention_cte(2, 512, 512, 128, BF16, False, False, True, True, True), 2, 2e-2, 1e-5),
    ("attention_cte lnc1 1x384x384 d128 window 128 sink", "attention.attention_cte:attention_cte",
     _attention_cte_reference,
     lambda: _attention_cte(1, 384, 384, 128, FP32, True, True, False, False, False, 128, True), 1, 2e-2, 1e-5),
    ("output_projection_tkg 4x8x4 d64 H3072 bias transposed", "output_projection.output_projection_tkg:"
     "output_projection_tkg", "output_projection.output_projection_tkg_torch:output_projection_tkg_torch_ref",
     lambda: _output_projection_tkg(4, 8, 4, 64, 3072, True, True), 2, 2e-2, 1e-5),
    ("output_projection_tkg 4x10x8 d128 H602 bias", "output_projection.output_projection_tkg:output_projection_tkg",
     "output_projection.output_projection_tkg_torch:output_projection_tkg_torch_ref",
     lambda: _output_projection_tkg(4, 10, 8, 128, 602, True, False), 2, 2e-2, 1e-5),
    ("output_projection_cte 1x16 H5120 10 heads d128 bias", "output_projection.output_projection_cte:"
     "output_projection_cte", "output_projection.output_projection_cte.output_projection_cte_torch:"
     "output_projection_cte_torch_ref", lambda: _output_projection_cte(1, 16, 5120, 10, 128, True), 2, 2e-2, 1e-5),
    ("output_projection_cte 1x128 H3072 16 heads d64 bias", "output_projection.output_projection_cte:"
     "output_projection_cte", "output_projection.output_projection_cte.output_projection_cte_torch:"
     "output_projection_cte_torch_ref", lambda: _output_projection_cte(1, 128, 3072, 16, 64, True), 2, 2e-2, 1e-5),
    ("cross_entropy_forward 1 position V32128 bf16", "nkilib_src.nkilib.experimental.loss:cross_entropy_forward",
     _cross_entropy_forward_reference,
     lambda: _cross_entropy(1, 32128, BF16, positions_per_batch=1, chunk_size=32128), 2, 1e-2, 1e-2),
    ("cross_entropy_forward 256 positions V32128 bf16", "nkilib_src.nkilib.experimental.loss:cross_entropy_forward",
     _cross_entropy_forward_reference,
     lambda: _cross_entropy(256, 32128, BF16, positions_per_batch=64, chunk_size=32128), 2, 1e-2, 1e-2),
    ("cross_entropy_backward 1 position V32128 bf16 mean",
     "nkilib_src.nkilib.experimental.loss:cross_entropy_backward", _cross_entropy_backward_reference,
     lambda: _cross_entropy(1, 32128, BF16, reduction="mean", positions_per_batch=1, chunk_size=16384), 2, 1e-2, 1e-2),
    ("cross_entropy_backward 256 positions V32128 fp32 sum",
     "nkilib_src.nkilib.experimental.loss:cross_entropy_backward", _cross_entropy_backward_reference,
     lambda: _cross_entropy(256, 32128, FP32, reduction="sum", positions_per_batch=64, chunk_size=8192), 2, 1e-5, 1e-5),
]


def _resolve(spec):
    if callable(spec):
        return spec
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(CORE + module if not module.startswith("nkilib_src") else module), name)


def run_case(kernel_spec, reference_spec, make_inputs, lnc, rtol, atol):
    """None if the kernel's outputs match the reference within the test's tolerances, else why not."""
    inputs = make_inputs()
    kernel = _resolve(kernel_spec)
    # the kernel gets copies: the emulator works in the caller's memory, and an in-place kernel (cross_entropy's
    # backward) would overwrite the reference's inputs, as on a device it does not overwrite the host's
    copies = {name: value.copy() if isinstance(value, np.ndarray) else value for name, value in inputs.items()}
    outputs = _outputs(nki_emulator.simulate(kernel)[lnc](**copies))
    expected = reference_spec(inputs) if callable(reference_spec) else _call_reference(_resolve(reference_spec), inputs)
    if len(outputs) != len(expected):
        return f"{len(outputs)} outputs, the reference has {len(expected)}"
    for i, (out, ref) in enumerate(zip(outputs, expected)):
        if out.shape != ref.shape and out.size == ref.size:
            out = out.reshape(ref.shape)
        if out.shape != ref.shape:
            return f"output {i}: shape {out.shape}, reference {ref.shape}"
        # nki-library's maxAllClose, "max" mode (test/integration/nkilib/utils/comparators.py): |out - ref| <= atol
        # + rtol * max|ref|, every element
        error = np.abs(out - ref)
        bad = ~(error <= atol + rtol * np.nanmax(np.abs(ref)))
        if bad.any():
            return f"output {i}: {bad.sum()} of {bad.size} values off (max abs error {np.nanmax(error):.3g})"
    return None


def _neuron_dtypes_stand_in():
    """nki-library's MX reference helpers (core/utils/mx_torch_common.py) and its tests' helpers
    (test/utils/mx_utils.py, test/integration/nkilib/...) import AWS's neuron_dtypes, which is not on PyPI; where it
    is missing, its ``static_cast`` (a dtype conversion) and ``sizeinbytes`` stand in, and its packed MX dtypes are
    the emulator's names for them, so the non-MX references that import those modules load. The MX paths are not
    among the cases."""
    try:
        import neuron_dtypes  # noqa: F401
    except ImportError:
        language = nki_emulator.language
        stand_in = types.ModuleType("neuron_dtypes")
        stand_in.static_cast = lambda array, dtype: np.asarray(array).astype(dtype)
        stand_in.sizeinbytes = lambda dtype: np.dtype(dtype).itemsize
        for packed in ("float8_e4m3fn_x4", "float8_e5m2_x4", "float4_e2m1fn_x4"):
            setattr(stand_in, packed, getattr(language, packed))
        sys.modules["neuron_dtypes"] = stand_in


def _nki_dtype_stand_in():
    """nki-library's QKV test helper (test/integration/nkilib/core/qkv/test_qkv_common.py) takes fp8 dtypes from
    ``nki.dtype``, a module of the Neuron SDK's nki package outside the API stubs; where the emulator stands in for
    nki, its dtypes (nki.language's) stand in for that module."""
    if "nki.dtype" not in sys.modules:
        module = types.ModuleType("nki.dtype")
        for name in nki_emulator.language.DTYPES:
            setattr(module, name, getattr(nki_emulator.language, name))
        sys.modules["nki.dtype"] = module


def _scipy_special_stand_in():
    """nki-library's test helpers (test/integration/nkilib/utils/test_kernel_common.py, whose numpy activations the
    MLP goldens use) import ``erf`` and ``expit`` from scipy.special; where scipy is missing, torch's (float64) stand
    in."""
    try:
        import scipy.special  # noqa: F401
    except ImportError:
        import torch

        def elementwise(fn):
            return lambda x: fn(torch.from_numpy(np.asarray(x, np.float64))).numpy()

        special = types.ModuleType("scipy.special")
        special.erf, special.expit = elementwise(torch.special.erf), elementwise(torch.special.expit)
        package = types.ModuleType("scipy")
        package.special = special
        sys.modules.update({"scipy": package, "scipy.special": special})


def _neuronxcc_typing_stand_in():
    """router_topk.py annotates its in-place outputs ``nt.mutable_tensor`` from the Neuron compiler's
    ``neuronxcc.nki.typing`` (not on PyPI); where it is missing, this emulator's ``nki.typing`` stands in, with
    ``mutable_tensor`` an annotation like ``tensor`` (annotations are not checked here)."""
    try:
        import neuronxcc.nki.typing  # noqa: F401
    except ImportError:
        from nki_emulator import typing as emulated_typing

        typing_module = types.ModuleType("neuronxcc.nki.typing")
        typing_module.tensor = typing_module.mutable_tensor = emulated_typing.tensor
        package, nki_package = types.ModuleType("neuronxcc"), types.ModuleType("neuronxcc.nki")
        package.nki, nki_package.typing = nki_package, typing_module
        sys.modules.update({"neuronxcc": package, "neuronxcc.nki": nki_package, "neuronxcc.nki.typing": typing_module})


def _import_mlp_dispatcher():
    """nki-library's ``mlp`` (core/mlp/mlp.py), the kernel its MLP tests call. At d2ad3a5 (NKI Lib 2026-04-13) the
    file does not parse: the tail of its docstring, l. 191-201, is pasted again after the closing quotes (l. 202-213,
    an IndentationError). Where the import fails so, the module is compiled from its own text with that pasted copy
    left out (docstring text only; no code changes), under its module name."""
    name = CORE + "mlp.mlp"
    try:
        return importlib.import_module(name)
    except IndentationError:
        pass
    spec = importlib.util.find_spec(name)
    lines = open(spec.origin).read().split("\n")
    start = next(i for i, line in enumerate(lines) if line.strip() == "TKG mode supports:")
    end = next(i for i in range(start, len(lines)) if lines[i].strip() == '"""') + 1
    block = lines[start:end]
    if lines[end + 1:end + 1 + len(block)] != block:
        raise ImportError(f"{spec.origin}: does not parse, and not for the pasted docstring this script repairs")
    text = "\n".join(lines[:end] + lines[end + 1 + len(block):])
    source_name = f"{spec.origin} (pasted docstring lines {end + 2}-{end + 1 + len(block)} left out)"
    linecache.cache[source_name] = (len(text), None, text.splitlines(True), source_name)  # for inspect (the subset)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    exec(compile(text, source_name, "exec"), module.__dict__)
    return module


def main(argv):
    if not argv:
        sys.exit("usage: python -m nki_emulator.official_kernels PATH_TO_NKI_LIBRARY_CHECKOUT [name-filter]")
    sys.path.insert(0, f"{argv[0]}/src")
    sys.path.insert(0, argv[0])  # nki-library's test helpers (test/integration/...), imported by some cases
    _CHECKOUT.append(argv[0])
    nki_emulator.install()
    _neuron_dtypes_stand_in()
    _neuronxcc_typing_stand_in()
    _scipy_special_stand_in()
    if sys.modules.get("nki") is nki_emulator:
        _nki_dtype_stand_in()
    wanted = argv[1] if len(argv) > 1 else ""
    passed = total = 0
    for name, kernel_spec, reference_spec, make_inputs, lnc, rtol, atol in CASES:
        if wanted not in name:
            continue
        total += 1
        start = time.perf_counter()
        try:
            why = run_case(kernel_spec, reference_spec, make_inputs, lnc, rtol, atol)
        except Exception as error:  # a refusal or a crash: report it and go on with the next case
            frame = traceback.extract_tb(error.__traceback__)[-1]
            why = f"{type(error).__name__}: {error} ({frame.filename.rpartition('/')[2]}:{frame.lineno})"
        passed += why is None
        print(f"{'pass' if why is None else 'FAIL'}  {name}  ({time.perf_counter() - start:.1f} s)"
              + ("" if why is None else f": {why}"), flush=True)
    print(f"{passed} of {total} cases pass")
    return 0 if passed == total else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

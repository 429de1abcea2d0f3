"""Run aws-neuron/nki-library's kernels, unmodified, under this emulator against their ``*_torch.py`` references,
called as nki-library's own tests call them: keyword arguments from the test's input generator (a kernel's
defaulted parameters left out), ``kernel[lnc](...)`` with the test's LNC degree, the test's tolerances.

Not part of CI (it needs a checkout of nki-library, which CI has no network to fetch). Run by hand:

    git clone https://github.com/aws-neuron/nki-library /tmp/nki-library
    git clone https://github.com/aws-neuron/aws-neuron-sdk /tmp/sdk && git -C /tmp/sdk checkout 3afa0fdf
    python -m nki_emulator.official_kernels /tmp/nki-library [name-filter] [--sdk /tmp/sdk]

It prints one line per case (pass, fail and why) and a total; ``NKI_EMULATOR_NKI_VERSION=0.6`` checks them under the
current release's rules instead of the contest's 0.4. The cases follow the tests' parameter lists in
``test/integration/nkilib/...`` (named per case), at their smaller shapes so that the run stays minutes on a CPU.
The second tier (MLP, QKV, attention and MoE for token generation, router top-k, RMSNorm + FP8) uses the tests'
own input generators, wrapper kernels and goldens, imported from the checkout's ``test/`` or, where a test module
needs nki-library's test framework (AWS-internal packages), run statement by statement from its file; the mamba
cases need ``--sdk``, an aws-neuron-sdk checkout at NKI 0.4 (3afa0fdf), for its fused_mamba tutorial.
No nki-library code is copied here: kernels and references are imported from the checkouts.
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
_SDK = []  # an aws-neuron-sdk checkout at 3afa0fdf (--sdk), for the mamba tutorial's kernels
BF16, FP16, FP32 = ml_dtypes.bfloat16, np.float16, np.float32  # np.dtype(FP32) is nl.float32 (the emulator's)


def _randn(shape, dtype, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32).astype(dtype)


def _call_reference(reference, inputs):
    """The reference on float32 torch tensors (bf16/fp8/fp16 widened, uint32 as int32), as nki-library's
    torch_ref_wrapper calls it (test/utils/unit_test_framework.py l. 303-333); its outputs, in order, as float32
    numpy arrays."""
    import torch

    def to_torch(value):
        if isinstance(value, np.ndarray):
            if value.dtype == np.uint32:  # "torch doesn't support uint32" (l. 318-320)
                return torch.from_numpy(value.astype(np.int32))
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

    def __getattr__(self, attribute):  # a default value such as ``Platforms.TRN2``
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return _Unavailable(f"{self.name}.{attribute}")

    def __repr__(self):
        return f"<{self.name}: not importable here>"


def _test_module(relative_path, stand_ins=None):
    """The namespace of nki-library's test file ``relative_path`` (under the checkout's ``test/``), as
    ``_load_statements`` leaves it."""
    return _load_statements(f"{_CHECKOUT[0]}/test/{relative_path}", stand_ins)


def _load_statements(path, stand_ins=None):
    """The namespace of the Python file ``path``, each top-level statement executed alone: a name whose import
    fails bound to its entry in ``stand_ins`` or else to ``_Unavailable``, statements that fail skipped (test
    classes and parameter tables that need the framework)."""
    stand_ins = stand_ins or {}
    tree = ast.parse(open(path).read(), path)
    namespace = {"__name__": "loaded_" + path.rpartition("/")[2][:-3], "__file__": path}
    for node in tree.body:
        try:
            exec(compile(ast.Module([node], []), path, "exec"), namespace)
        except ImportError:
            for alias in node.names:
                name = (alias.asname or alias.name).partition(".")[0]
                namespace[name] = stand_ins.get(name, _Unavailable(alias.name))
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


def _compiler_args(logical_nc_config, **options):
    """Stands in for nki-library's test/utils/common_dataclasses.py CompilerArgs: the LNC degree (the cases give it;
    the platform is the emulator's target)."""
    return types.SimpleNamespace(logical_nc_config=logical_nc_config)


def _captured_test(relative_path, function, **arguments):
    """(kernel, reference, inputs(), lnc, rtol, atol) of the test function ``function`` of a test file that runs its
    case through UnitTestFramework, called with ``arguments``."""
    namespace = _test_module(relative_path, {"UnitTestFramework": _UnitTestFramework, "CompilerArgs": _compiler_args,
                                             "torch_ref_wrapper": lambda reference: reference})
    namespace[function](test_manager=None, **arguments)
    test = _UnitTestFramework.recorded.pop()

    def inputs():
        return {name.replace(".must_alias_input", ""): value for name, value in test.make_inputs(None).items()}

    return test.kernel, lambda values: _call_reference(test.reference, values), inputs, test.lnc, test.rtol, test.atol


# ---- the cases: (name, kernel "module:function", reference "module:function", inputs(), lnc, rtol, atol[, unpack]) --

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


# ---- the second tier: MLP, QKV, attention and MoE for token generation, router top-k, RMSNorm + FP8, the SDK's mamba

TESTS = "test.integration.nkilib.core."  # nki-library's test helpers that import here
QKV_CTE_TEST = "integration/nkilib/core/qkv/test_qkv_cte.py"


def _router_topk(T, H, E, k, sigmoid=False, bias=True, pre_norm=False, norm_topk=False, column_tiling=False,
                 scatter=False, pe_bias=False, shard_on_tokens=False, output_in_sbuf=False, x_in_sbuf=False,
                 x_hbm_layout=0, x_sb_layout=0):
    """test/integration/nkilib/core/router_topk/test_router_topk.py test_router_topk: its base configurations and
    layouts, generate_router_topk_inputs, router_topk_kernel_wrapper (a kernel that calls router_topk), its torch
    wrapper, LNC 2 (CompilerArgs' default on trn2), rtol 2e-2, atol 1e-5."""
    def case():
        common = importlib.import_module(TESTS + "router_topk.test_router_topk_common")
        act_fn = importlib.import_module(CORE + "utils.common_types").RouterActFnType
        arguments = (T, H, E, k, act_fn.SIGMOID if sigmoid else act_fn.SOFTMAX, bias, pre_norm, norm_topk,
                     column_tiling, scatter, pe_bias, shard_on_tokens, output_in_sbuf, x_in_sbuf, x_hbm_layout,
                     x_sb_layout)

        def inputs():
            generated = common.generate_router_topk_inputs(*arguments)
            return {name.replace(".must_alias_input", ""): value for name, value in generated.items()}

        return (common.router_topk_kernel_wrapper, lambda values: _call_reference(common.router_topk_torch_wrapper,
                                                                                  values), inputs, 2, 2e-2, 1e-5)
    return (case,)


def _mlp(lnc, batch, seqlen, hidden, intermediate, norm, fused_add=False, store_add=False, biases=False, cte=False,
         fp8=None):
    """test_mlp_tkg.py run_mlp_tkg_test / test_mlp_cte.py run_mlp_cte_test: build_fused_norm_mlp's inputs (bf16,
    SiLU, the test's column-tiling defaults), the ``mlp`` kernel, golden_mlp (test_mlp_common.py; no torch
    reference exists for the MLP), rtol 2e-2, atol 1e-5. ``fp8``: a QuantizationType name, fp8_e4m3 weights from
    the TKG test's random_lhs_and_random_bound_weight_tensor_generator(0, 241), golden_quant_mlp."""
    def case():
        common = importlib.import_module(TESTS + "mlp.test_mlp_common")
        types_ = importlib.import_module(CORE + "utils.common_types")
        norm_type, lnc_degree = getattr(types_.NormType, norm), (lnc if lnc > 1 else None) if cte else lnc
        options = dict(batch=batch, seqlen=seqlen, hidden=hidden, intermediate=intermediate, dtype=BF16,
                       fused_add=fused_add, norm_type=norm_type, store_add=store_add, gate_bias=biases,
                       up_bias=biases, down_bias=biases, lnc_degree=lnc_degree,
                       tensor_generator=common.gaussian_tensor_generator())
        if fp8:
            options.update(quant_dtype=np.dtype(ml_dtypes.float8_e4m3),
                           quantization_type=getattr(types_.QuantizationType, fp8),
                           tensor_generator=common.random_lhs_and_random_bound_weight_tensor_generator(0, 241))

        def reference(values):
            if fp8:
                golden = common.golden_quant_mlp(
                    inp_np=values, norm_type=norm_type, fused_add=fused_add, store_add=store_add, dtype=BF16,
                    quant_dtype=options["quant_dtype"], quantization_type=options["quantization_type"],
                    skip_gate=False, act_fn_type=types_.ActFnType.SiLU, lnc=lnc_degree, quantize_activation=True)
            else:
                golden = common.golden_mlp(values, norm_type, fused_add, store_add, BF16, lnc=lnc_degree)
            return [np.asarray(v, np.float32) for v in golden.values()]

        return _import_mlp_dispatcher().mlp, reference, lambda: common.build_fused_norm_mlp(**options), lnc, 2e-2, 1e-5
    return (case,)


def _qkv(lnc, batch, seqlen, hidden, fused_qkv_dim, norm, fused_add=False, hidden_actual=None, heads=(None, None),
         d_head=None, layout="BSD", norm_bias=False, qkv_bias=False, eps=1e-6, dtype=BF16, cache=None, cte=False):
    """test_qkv_tkg.py run_qkv_tkg_test / test_qkv_cte.py run_qkv_cte_test: build_qkv_input (test_qkv_common.py)
    and the ``qkv`` kernel. References: for token generation qkv_tkg_torch_ref, as the TKG test's torch golden calls
    it; for context encoding, whose kernel returns no fused residual, the CTE test's golden_func_fused_add_qkv (no
    torch reference exists for it). ``cache``: (num_blocks, block_size, k_scale, v_scale) of
    test_qkv_cte_block_kv_cache (its slot mapping, fp8 caches)."""
    def case():
        common = importlib.import_module(TESTS + "qkv.test_qkv_common")
        types_ = importlib.import_module(CORE + "utils.common_types")
        common.nt = sys.modules["nki.dtype"]  # its ``import nki.dtype as nt`` finds nki_emulator.dtype, a type
        options = dict(batch=batch, seqlen=seqlen, hidden_dim=hidden, fused_qkv_dim=fused_qkv_dim, dtype=dtype,
                       hidden_actual=hidden_actual, d_head=d_head, eps=eps, norm_type=getattr(types_.NormType, norm),
                       fused_add=fused_add, output_layout=getattr(types_.QKVOutputLayout, layout), lnc_degree=lnc,
                       norm_bias=norm_bias, qkv_bias=qkv_bias, num_q_heads=heads[0], num_kv_heads=heads[1])
        if cache:
            num_blocks, block_size, k_scale, v_scale = cache
            options.update(fp8_kv_cache=True, k_scale_val=k_scale, v_scale_val=v_scale, use_block_kv=True,
                           num_blocks=num_blocks, block_size=block_size,
                           slot_mapping=np.arange(seqlen - 1, -1, -1, dtype=np.int32).reshape(batch, seqlen))

        def inputs():
            values = {**common.build_qkv_input(**options), "is_h_dim_4h_transposed": False}
            if cache:  # run_qkv_cte_test drops them for the KV-cache kernel
                values = {name.replace(".must_alias_input", ""): value for name, value in values.items()
                          if name not in ("quantization_type", "qkv_w_scale", "qkv_in_scale")}
            return values

        golden = _test_module(QKV_CTE_TEST)["golden_func_fused_add_qkv"] if cte else None
        return "qkv.qkv:qkv", _cte_golden(golden, options) if cte else _qkv_torch_reference, inputs, lnc, \
            1e-1 if cache else 2e-2, 1e-5
    return (case,)


def _qkv_torch_reference(values):
    """qkv_tkg_torch_ref with the inputs as test_qkv_tkg.py's torch golden passes them (its l. 640-661)."""
    import torch

    module = importlib.import_module(CORE + "qkv.qkv_tkg_torch")
    widen = lambda a: None if a is None else torch.from_numpy(np.asarray(a, np.float32))  # noqa: E731
    result = module.qkv_tkg_torch_ref(
        hidden=widen(values["input"]), qkv_w=widen(values["fused_qkv_weights"]),
        norm_w=widen(values["gamma_norm_weights"]), fused_add=values["fused_residual_add"],
        mlp_prev=widen(values["mlp_prev"]), attn_prev=widen(values["attention_prev"]), d_head=values["d_head"],
        num_kv_heads=values["num_kv_heads"], num_q_heads=values["num_q_heads"], output_layout=values["output_layout"],
        eps=values["norm_eps"], norm_type=values["fused_norm_type"], quantization_type=values["quantization_type"],
        qkv_w_scale=widen(values["qkv_w_scale"]), qkv_in_scale=widen(values["qkv_in_scale"]),
        output_in_sbuf=values["store_output_in_sbuf"], qkv_bias=widen(values["bias"]),
        norm_bias=widen(values["layer_norm_bias"]), hidden_actual=values["hidden_actual"])
    return [t.float().numpy() for t in result.values()]


def _cte_golden(golden, options):
    """test_qkv_cte.py's golden_func_fused_add_qkv as run_qkv_cte_test calls it."""
    cache = {name: options.get(name) for name in ("k_scale_val", "v_scale_val", "num_blocks", "block_size",
                                                  "slot_mapping")}

    def reference(values):
        expected = golden(inp_np=values, dtype=options["dtype"], fused_add=options["fused_add"],
                          norm_type=options["norm_type"], eps=options["eps"], head_dim=options["d_head"],
                          output_layout=options["output_layout"], hidden_actual=options["hidden_actual"],
                          num_q_heads=options["num_q_heads"], num_kv_heads=options["num_kv_heads"],
                          fp8_kv_cache=options.get("fp8_kv_cache", False),
                          use_block_kv=options.get("use_block_kv", False), **cache)
        return [np.asarray(v, np.float32) for v in expected.values()]
    return reference


def _attention_tkg(lnc, *shape, dtype=BF16, test_sink=False, sliding_window=0, **flags):
    """test/integration/nkilib/core/attention/test_attention_tkg.py run_attention_tkg_test with an AttnTKGConfig of
    ``shape`` (bs, q_head, s_active, curr_sprior, full_sprior, d_head, block_len) and ``flags``, as its fast
    configurations list them: its inputs, attn_tkg_wrapper, attention_tkg_torch_ref and tolerances."""
    def case():
        config = importlib.import_module(CORE + "attention.attention_tkg_utils").AttnTKGConfig(*shape, **flags)
        return _captured_test("integration/nkilib/core/attention/test_attention_tkg.py", "run_attention_tkg_test",
                              compiler_args=_compiler_args(lnc), cfg=config, dtype=np.dtype(dtype),
                              test_sink=test_sink, fp8_kv=False, sliding_window=sliding_window)
    return (case,)


def _moe_tkg(tokens, hidden, intermediate, expert, top_k, act_fn, all_expert, dtype=FP16, bias=False,
             scale="POST_SCALE"):
    """test/integration/nkilib/core/moe/moe_tkg/test_moe_tkg.py _run_moe_tkg_test (LNC 2, clamped, as its
    _STD_CONFIGS): build_moe_tkg's inputs, the moe_tkg kernel, moe_tkg_torch_ref, rtol 2e-2, atol 1e-5."""
    def case():
        types_ = importlib.import_module(CORE + "utils.common_types")
        return _captured_test("integration/nkilib/core/moe/moe_tkg/test_moe_tkg.py", "_run_moe_tkg_test", vnc=2,
                              tokens=tokens, hidden=hidden, intermediate=intermediate, expert=expert, top_k=top_k,
                              act_fn=getattr(types_.ActFnType, act_fn), all_expert=all_expert, dtype=np.dtype(dtype),
                              scale_mode=getattr(types_.ExpertAffinityScaleMode, scale), clamp=True, bias=bias)
    return (case,)


def _rmsnorm_quant(seqlen, quant_only, quantization, lower_bound=0.0, generator="gaussian_tensor_generator"):
    """test/integration/nkilib/core/rmsnorm/test_rmsnorm_quant.py test_rmsnorm_quant_lnc_unit (LNC 2, batch 1, hidden
    16384, bf16 into fp8_e4m3): build_rmsnorm_quant_kernel_input, rmsnorm_quant_kernel, and its validator: the
    output's fp8 values (and, for ROW, the fp32 dequantization scale in each row's last 4 bytes) against
    rmsnorm_quant_ref (numpy; no torch reference exists), rtol 0.072 (values) and 0.007 (scales), maxAllClose's
    default atol 1e-8."""
    batch, hidden = 1, 16384

    def case():
        test = _test_module("integration/nkilib/core/rmsnorm/test_rmsnorm_quant.py")
        quant = getattr(importlib.import_module(CORE + "utils.common_types").QuantizationType, quantization)
        generate = test[generator]()
        generate = test["static_scale_wrapper"](generate) if quantization == "STATIC" else generate

        def inputs():
            return test["build_rmsnorm_quant_kernel_input"](
                lnc_degree=2, batch=batch, seqlen=seqlen, hidden_dim=hidden, dtype=BF16, lower_bound=lower_bound,
                tensor_gen=generate, quant_type=quant, quant_only=quant_only)

        def reference(values):
            expected = test["rmsnorm_quant_ref"](values["hidden"], values["ln_w"], values["input_dequant_scale"],
                                                 lower_bound, quant_only, quant, values["kargs"].eps)
            return [np.asarray(v, np.float32) for v in expected if v is not None]

        def unpack(raw):
            fp8 = np.asarray(raw).view(np.uint8).reshape(batch, seqlen, -1).view(ml_dtypes.float8_e4m3)
            values = [fp8[:, :, :hidden].astype(np.float32)]
            if quantization == "ROW":
                values.append(np.ascontiguousarray(fp8[:, :, hidden:]).view(np.float32))
            return values

        rtol = (0.072, 0.007) if quantization == "ROW" else 0.072
        return "rmsnorm.rmsnorm_quant:rmsnorm_quant_kernel", reference, inputs, 2, rtol, 1e-8, unpack
    return (case,)


def _mamba(version, random_inputs):
    """aws-neuron-sdk 3afa0fdf (NKI 0.4) nki/examples/fused_mamba/mamba_nki_kernels.py ``mamba_v1/2/3`` against
    mamba_torch.py's ``mamba_layer`` (its torch_xla import skipped), at the tutorial's toy size (batch 1, 256
    channels, seq_len 512, state 16) and tolerance (torch.allclose atol/rtol 1e-2): its all-ones inputs (A = -1),
    or random ones (delta in [0, 0.5), A in -[0.5, 1.5))."""
    def case():
        if not _SDK:
            raise FileNotFoundError("the mamba cases need --sdk PATH, an aws-neuron-sdk checkout at 3afa0fdf")
        folder = f"{_SDK[0]}/nki/examples/fused_mamba"
        spec = importlib.util.spec_from_file_location("mamba_nki_kernels", f"{folder}/mamba_nki_kernels.py")
        kernels = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(kernels)
        layer = _load_statements(f"{folder}/mamba_torch.py")["mamba_layer"]
        return getattr(kernels, version), lambda values: _call_reference(layer, values), \
            lambda: _mamba_inputs(random_inputs), 1, 1e-2, 1e-2
    return (case,)


def _mamba_inputs(random_inputs, batch=1, channels=256, seq_len=512, state=16):
    rng = np.random.default_rng(0)
    if not random_inputs:
        ones = {"delta": (batch, channels, seq_len), "u": (batch, channels, seq_len), "A": (channels, state),
                "B": (batch, state, seq_len), "C": (batch, state, seq_len)}
        return {name: np.ones(shape, FP32) * (-1 if name == "A" else 1) for name, shape in ones.items()}
    return {"delta": rng.uniform(0, 0.5, (batch, channels, seq_len)).astype(FP32),
            "u": rng.standard_normal((batch, channels, seq_len)).astype(FP32),
            "A": -rng.uniform(0.5, 1.5, (channels, state)).astype(FP32),
            "B": rng.standard_normal((batch, state, seq_len)).astype(FP32),
            "C": rng.standard_normal((batch, state, seq_len)).astype(FP32)}


CASES += [
    ("router_topk T4 H3072 E128 k4 softmax bias", *_router_topk(4, 3072, 128, 4)),
    ("router_topk T4 H3072 E128 k4 indirect scatter", *_router_topk(4, 3072, 128, 4, scatter=True)),
    ("router_topk T8 H8192 E128 k8 sigmoid pre-norm norm-top-k scatter x T,H",
     *_router_topk(8, 8192, 128, 8, sigmoid=True, pre_norm=True, norm_topk=True, scatter=True, x_hbm_layout=1)),
    ("router_topk T48 H3072 E128 k4 shard on tokens", *_router_topk(48, 3072, 128, 4, shard_on_tokens=True)),
    ("router_topk T4 H3072 E128 k4 PE bias broadcast", *_router_topk(4, 3072, 128, 4, pe_bias=True)),
    ("router_topk T32 H256 E128 k4 sigmoid column tiling scatter",
     *_router_topk(32, 256, 128, 4, sigmoid=True, column_tiling=True, scatter=True)),
    ("mlp_tkg lnc2 1x1 H2048 I512 rmsnorm", *_mlp(2, 1, 1, 2048, 512, "RMS_NORM")),
    ("mlp_tkg lnc2 2x4 H4096 I1024 layernorm", *_mlp(2, 2, 4, 4096, 1024, "LAYER_NORM")),
    ("mlp_tkg lnc2 64x1 H3072 I135 rmsnorm", *_mlp(2, 64, 1, 3072, 135, "RMS_NORM")),
    ("mlp_tkg lnc1 1x1 H4096 I896 fused add stored, biases (dma_compute)",
     *_mlp(1, 1, 1, 4096, 896, "RMS_NORM", fused_add=True, store_add=True, biases=True)),
    ("mlp_tkg lnc2 1x1 H16384 I896 fp8 row quantization", *_mlp(2, 1, 1, 16384, 896, "NO_NORM", fp8="ROW")),
    ("mlp_cte lnc1 1x512 H1024 I448 fused add (dma_compute)", *_mlp(1, 1, 512, 1024, 448, "RMS_NORM", True, cte=True)),
    ("mlp_cte lnc2 1x512 H1024 I448 fused add", *_mlp(2, 1, 512, 1024, 448, "RMS_NORM", True, cte=True)),
    ("qkv_tkg lnc1 1x4 H4096 actual 3072 fused add (dma_compute)",
     *_qkv(1, 4, 1, 4096, 896, "RMS_NORM", True, 3072, (5, 1), 128)),
    ("qkv_tkg lnc1 1x5 H8192 layernorm bias", *_qkv(1, 1, 5, 8192, 384, "LAYER_NORM", heads=(1, 1), d_head=128,
                                                    norm_bias=True)),
    ("qkv_tkg lnc2 8x5 H3072 qkv bias d64", *_qkv(2, 8, 5, 3072, 640, "RMS_NORM", heads=(8, 1), d_head=64,
                                                 qkv_bias=True)),
    ("qkv_tkg lnc2 1x1 H8192 NBSd", *_qkv(2, 1, 1, 8192, 768, "NO_NORM", heads=(2, 2), d_head=128, layout="NBSd")),
    ("qkv_tkg lnc2 1x1 H8192 fused add eps 77", *_qkv(2, 1, 1, 8192, 512, "RMS_NORM", True, heads=(2, 1), d_head=128,
                                                      eps=77.0)),
    ("qkv_cte lnc1 1x128 H512 fp32 fused add (dma_compute)",
     *_qkv(1, 1, 128, 512, 512, "RMS_NORM", True, dtype=FP32, cte=True)),
    ("qkv_cte lnc1 1x512 H1024 actual 768 fused add", *_qkv(1, 1, 512, 1024, 256, "RMS_NORM", True, 768, cte=True)),
    ("qkv_cte lnc2 1x512 H2048 fp8 block KV cache (vector_offset scatter)",
     *_qkv(2, 1, 512, 2048, 384, "NO_NORM", heads=(1, 1), d_head=128, cache=(64, 128, 1.67, 1.67), cte=True)),
    ("attention_tkg lnc1 1x1x1 prior 128 d64 in SBUF",
     *_attention_tkg(1, 1, 1, 1, 128, 256, 64, 0, tp_k_prior=True, qk_in_sb=True, k_out_in_sb=True,
                     out_in_sb=True)),
    ("attention_tkg lnc2 8x4x4 prior 128 d64 sink",
     *_attention_tkg(2, 8, 4, 4, 128, 256, 64, 0, tp_k_prior=True, qk_in_sb=True, k_out_in_sb=True, out_in_sb=True,
                     test_sink=True)),
    ("attention_tkg lnc2 4x2x7 prior 256 d128 rope pos ids",
     *_attention_tkg(2, 4, 2, 7, 256, 16384, 128, 0, tp_k_prior=True, use_pos_id=True, fuse_rope=True)),
    ("attention_tkg lnc2 4x1x5 prior 1024 d128 window 128",
     *_attention_tkg(2, 4, 1, 5, 1024, 10240, 128, 0, tp_k_prior=True, use_pos_id=True, fuse_rope=True,
                     sliding_window=128)),
    ("attention_tkg lnc2 4x1x5 prior 8192 block KV 16 (indirect dma_transpose) sink",
     *_attention_tkg(2, 4, 1, 5, 8192, 8192, 128, 16, tp_k_prior=True, strided_mm1=False, qk_in_sb=True,
                     k_out_in_sb=True, out_in_sb=True, test_sink=True)),
    ("moe_tkg T4 H512 I128 E4 all experts (shared_identity_matrix)", *_moe_tkg(4, 512, 128, 4, None, "SiLU", True)),
    ("moe_tkg T4 H512 I128 E4 all experts bias", *_moe_tkg(4, 512, 128, 4, None, "SiLU", True, bias=True)),
    ("moe_tkg T4 H512 I128 E4 top-1 (local_gather)", *_moe_tkg(4, 512, 128, 4, 1, "Swish", False)),
    ("moe_tkg T4 H512 I128 E4 top-4 bias", *_moe_tkg(4, 512, 128, 4, 4, "Swish", False, bias=True)),
    ("moe_tkg T32 H512 I256 E8 top-2 bf16 (local_gather, T > 16)",
     *_moe_tkg(32, 512, 256, 8, 2, "Swish", False, dtype=BF16)),
    ("rmsnorm_quant 1x2 H16384 row quant only", *_rmsnorm_quant(2, True, "ROW")),
    ("rmsnorm_quant 1x2 H16384 row bound 0.5", *_rmsnorm_quant(2, False, "ROW", 0.5)),
    ("rmsnorm_quant 1x160 H16384 row duplicate rows", *_rmsnorm_quant(160, False, "ROW", 0.0,
                                                                       "duplicate_row_rmsnorm_inp_generator")),
    ("rmsnorm_quant 1x2 H16384 static", *_rmsnorm_quant(2, False, "STATIC")),
    ("rmsnorm_quant 1x160 H16384 static quant only", *_rmsnorm_quant(160, True, "STATIC")),
    ("mamba_v1 toy all-ones", *_mamba("mamba_v1", False)),
    ("mamba_v2 toy random", *_mamba("mamba_v2", True)),
    ("mamba_v3 toy random", *_mamba("mamba_v3", True)),
]

def _resolve(spec):
    if callable(spec):
        return spec
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(CORE + module if not module.startswith("nkilib_src") else module), name)


def run_case(kernel_spec, reference_spec, make_inputs, lnc, rtol, atol, unpack=None):
    """None if the kernel's outputs match the reference within the test's tolerances, else why not. ``rtol`` may
    give one tolerance per output; ``unpack`` turns the kernel's raw outputs into what the test compares."""
    inputs = make_inputs()
    kernel = _resolve(kernel_spec)
    # the kernel gets copies: the emulator works in the caller's memory, and an in-place kernel (cross_entropy's
    # backward) would overwrite the reference's inputs, as on a device it does not overwrite the host's
    copies = {name: value.copy() if isinstance(value, np.ndarray) else value for name, value in inputs.items()}
    result = nki_emulator.simulate(kernel)[lnc](**copies)
    outputs = _outputs(result if unpack is None else unpack(result))
    expected = reference_spec(inputs) if callable(reference_spec) else _call_reference(_resolve(reference_spec), inputs)
    if len(outputs) != len(expected):
        return f"{len(outputs)} outputs, the reference has {len(expected)}"
    rtols = rtol if isinstance(rtol, tuple) else (rtol,) * len(outputs)
    for i, (out, ref, rtol) in enumerate(zip(outputs, expected, rtols)):
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
    if "--sdk" in argv:
        at = argv.index("--sdk")
        _SDK.append(argv[at + 1])
        argv = argv[:at] + argv[at + 2:]
    if not argv:
        sys.exit("usage: python -m nki_emulator.official_kernels PATH_TO_NKI_LIBRARY_CHECKOUT [name-filter] "
                 "[--sdk PATH_TO_AWS_NEURON_SDK_CHECKOUT_AT_3afa0fdf]")
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
    for name, *case in CASES:
        if wanted not in name:
            continue
        total += 1
        start = time.perf_counter()
        try:
            why = run_case(*(case[0]() if len(case) == 1 else case))  # a second-tier case is built when it runs
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

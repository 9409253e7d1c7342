"""A bfloat16 model on the CPU (--dtype=bfloat16): the step's layout of its weights
(cpu_layout.bfloat16_views), the matmuls of decode rows (the C++ kernel: float32 products of the
exact weights) and of prompt chunks (bfloat16 products, float32 sums), and an engine that serves
it with float32 activations and KV cache, against the float32 model with the same rounded weights."""
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import cpu_kernels
from checkpoints.convert import convert_checkpoint
from checkpoints.load import load_config, load_params
from jaxserve.core.request import SamplingParams
from jaxserve.engine import Engine, EngineConfig
from jaxserve.executor import device_setup
from jaxserve.models import cpu_layout
from jaxserve.models import quantization as qz
from tests.tiny_models import make_tiny_hf_model

SEED = int(os.environ.get("JAXSERVE_TEST_SEED", "20261205"))

pytestmark = [pytest.mark.slow,  # engines and the C++ kernels: out of `make test-quick`
              pytest.mark.skipif(not cpu_kernels.available(), reason="no AVX-512 CPU or no C++ compiler")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("bfloat16")
    model = make_tiny_hf_model(str(path / "hf"), vocab_size=128, seed=3)
    with torch.no_grad():  # spread the logits: a random head gives near-uniform ones
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(str(path / "hf"), safe_serialization=True)
    convert_checkpoint(str(path / "hf"), str(path / "converted"))
    config = load_config(str(path / "converted"))
    return config, load_params(str(path / "converted"), jnp.bfloat16)


def make_engine(config, params, **overrides):
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=128, page_size=8, num_pages=64, max_model_len=256,
               warmup=False, enable_prefix_caching=False)
    return Engine(config, params, None, EngineConfig(**{**cfg, **overrides}))


def test_views_keep_activations_in_float32(tiny):
    config, params = tiny
    views = cpu_layout.layer_views(params, prompt_dtype="bfloat16")
    for name, w in params["layers"].items():
        view = views["layers"][name]
        if w.ndim == 3:
            assert isinstance(view, qz.StripMatrix) and view.shape == w.shape, name
            # The stored weight as its uint16 bits (the layer scan slices those), in w's own memory:
            assert view.w.dtype == jnp.uint16 and view.w.unsafe_buffer_pointer() == w.unsafe_buffer_pointer(), name
            np.testing.assert_array_equal(np.asarray(view.matrix), np.asarray(w))
            assert view.kernel.prompt_dtype == "bfloat16", name
            np.testing.assert_array_equal(np.asarray(cpu_kernels.unpack_bf16(view.kernel.packed, w.shape[-1])),
                                          np.asarray(w))
        else:
            assert view.dtype == jnp.float32, name
    assert views["final_norm"].dtype == jnp.float32
    lm_head = views["lm_head"]  # tied or not: the kernel's layout of [hidden, vocab]
    assert lm_head.shape == (config.hidden_size, config.vocab_size)
    added = qz.tree_bytes(views) - qz.tree_bytes([w for w in params["layers"].values() if w.ndim == 3]) \
        - qz.tree_bytes([params[n] for n in ("embed", "lm_head") if n in params])
    assert cpu_layout.layer_views_bytes(params) == added
    float_params = jax.tree.map(lambda a: a.astype(jnp.float32), params)
    float_head = cpu_layout.layer_views(float_params)["lm_head"]  # float32: the strips alone (test_cpu_float32_strips)
    assert float_head.w is None and float_head.kernel.packed.dtype == jnp.float32


def test_prompt_attention_multiplies_in_bfloat16_where_the_prompt_matmuls_do(tiny):
    """A prompt chunk's step (more than MAX_ROWS rows) of a bfloat16 model, or of quantized
    weights with bfloat16 or int8 prompts, calls the prefill attention kernel with bf16 set; a
    float32 model's, a float32-prompt one's and a decode-sized step's call it without."""
    config, params = tiny
    float_params = jax.tree.map(lambda a: a.astype(jnp.float32), params)
    int8 = qz.quantize_params(float_params, "int8", config)
    rows = cpu_kernels.MAX_ROWS + 1
    for weights, prompt_dtype, want in ((params, "bfloat16", True), (params, "float32", False),
                                        (float_params, "bfloat16", False), (int8, "int8", True),
                                        (int8, "bfloat16", True), (int8, "float32", False)):
        layers = cpu_layout.layer_views(weights, prompt_dtype=prompt_dtype)["layers"]
        assert cpu_layout.bf16_prompt_attention(layers, rows) == want, prompt_dtype
        assert not cpu_layout.bf16_prompt_attention(layers, cpu_kernels.MAX_ROWS)
    engine = make_engine(config, params, dtype="bfloat16")  # what the engine's forward reads
    assert cpu_layout.bf16_prompt_attention(engine.runner._step_params["layers"], rows)


@pytest.mark.parametrize("rows", [1, 5, cpu_kernels.MAX_ROWS, cpu_kernels.MAX_ROWS + 3])
def test_bfloat16_matrix_linear(rows):
    """Decode rows: the exact weights times float32 rows (float32 sums); prompt rows: both
    rounded to bfloat16 where the CPU multiplies bfloat16; the tied lm_head's layout alone too."""
    rng = np.random.default_rng([SEED, rows])
    w = jnp.asarray(rng.standard_normal((3, 96, 80)) / 10, jnp.bfloat16)  # [L, in, out]
    matrix = cpu_layout._bfloat16_matrix_jit(w)
    matrix = qz.StripMatrix(w, dataclasses.replace(matrix.kernel, prompt_dtype="bfloat16"), 80)
    x = rng.standard_normal((rows, 96)).astype(np.float32)
    exact = x.astype(np.float64) @ np.asarray(w[1], np.float64)
    rounded = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64) @ np.asarray(w[1], np.float64)
    expected = exact if rows <= cpu_kernels.MAX_ROWS else rounded
    as_bits = qz.StripMatrix(cpu_layout.bits_of(w), matrix.kernel, 80)  # as bfloat16_views holds it
    for weight in (matrix, as_bits, qz.StripMatrix(None, matrix.kernel, 80)):
        at_layer = jax.jit(lambda x, m, layer: qz.linear(
            x, qz.StripMatrix(m.w if m.w is None else m.w[layer], dataclasses.replace(m.kernel, layer=layer), 80)))
        got = np.asarray(at_layer(jnp.asarray(x), weight, jnp.int32(1)))
        assert got.dtype == np.float32
        assert np.abs(got - expected).max() < 1e-5 * np.abs(expected).max(), f"seed {SEED}"


def test_engine_serves_bfloat16_weights_with_float32_activations(tiny):
    """Prompt logprobs of a bfloat16 engine against a float32 engine on the same (rounded)
    weights: equal to float32 rounding for a prompt the decode kernel multiplies (<= MAX_ROWS
    rows a step), close for a longer one whose chunk multiplies in bfloat16, its matmuls and its
    attention (this random model's sharp logits: up to ~0.07 apart); greedy tokens equal."""
    config, params = tiny
    engine = make_engine(config, params, dtype="bfloat16")
    reference = make_engine(config, jax.tree.map(lambda a: a.astype(jnp.float32), params))
    assert engine.runner.kv_cache_dtype == jnp.float32
    rng = np.random.default_rng(SEED)
    short = rng.integers(3, 128, 40).tolist()
    long = rng.integers(3, 128, 120).tolist()
    scores = SamplingParams(max_tokens=0, prompt_logprobs=0)
    for prompt, tolerance in ((short, 1e-4), (long, 0.1)):
        ours, theirs = (e.generate([prompt], scores)[0].prompt_logprobs for e in (engine, reference))
        diff = max(abs(a.logprob - b.logprob) for a, b in zip(ours, theirs))
        assert diff < tolerance, f"seed {SEED}: {len(prompt)}-token prompt, logprobs differ by {diff}"
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert engine.generate([short], greedy)[0].token_ids == reference.generate([short], greedy)[0].token_ids


def test_planner_counts_the_kernel_layout_and_float32_cache(tiny):
    config, params = tiny
    cfg = EngineConfig(dtype="bfloat16", max_num_seqs=4, max_model_len=256, page_size=8)
    plan = device_setup.plan_engine(config, cfg, params, device_memory_bytes=1 << 30)
    assert plan.kv_cache_dtype == "float32" and plan.weight_dtype == "bfloat16"
    assert plan.weights_bytes == qz.tree_bytes(params) + cpu_layout.layer_views_bytes(params)

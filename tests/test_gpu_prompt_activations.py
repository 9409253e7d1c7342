"""8-bit activations for prompt chunks on an accelerator (--gpu_prompt_dtype, issue 54): the
per-row int8 and float8 e4m3 quantization and 8-bit products of prompt_matmul, against numpy's
emulation of the same arithmetic and against the float product; which weights take it
(prompt_activations.mark) and the flag's refusal otherwise; decode rows unchanged;
and an engine on this CPU running the same XLA code as the GPU step, its prompt logprobs next to
the same weights without it. The GPU build's 8-bit dots are checked in tests/test_gpu_compile.py.
Set JAXSERVE_TEST_SEED to draw other inputs."""
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from checkpoints.convert import convert_checkpoint
from checkpoints.load import load_config, load_params
from jaxserve.config import ModelConfig
from jaxserve.core.request import SamplingParams
from jaxserve.engine import Engine, EngineConfig
from jaxserve.models import prompt_activations, prompt_matmul
from jaxserve.models import quantization as qz
from jaxserve.planning import memory
from tests.tiny_models import make_tiny_hf_model

SEED = int(os.environ.get("JAXSERVE_TEST_SEED", "20261205"))

pytestmark = pytest.mark.slow  # engines: out of `make test-quick`


def fp8_weight(w: np.ndarray) -> qz.QuantArray:
    """A float [..., in, out] weight as an fp8 checkpoint stores it: e4m3 codes, one float32 scale
    per output channel (max |w| / 448)."""
    scale = np.abs(w).max(axis=-2, keepdims=True) / prompt_matmul.FP8_MAX
    return qz.QuantArray(jnp.asarray((w / scale).astype(ml_dtypes.float8_e4m3fn)), jnp.asarray(scale, jnp.float32))


def test_quantization_fp8_is_e4m3_per_output_channel():
    """--quantization=fp8: codes in e4m3, one float16 scale per output channel (max |w| / 448),
    round to nearest: each weight within half an e4m3 step (2^-4 of its binade) of its value."""
    rng = np.random.default_rng(SEED)
    w = (rng.standard_normal((2, 64, 48)) / 8).astype(np.float32)
    weight = qz.quantize(jnp.asarray(w), qz.parse_format("fp8"))
    assert weight.q.dtype == jnp.float8_e4m3fn and weight.scale.shape == (2, 1, 48) and weight.zero is None
    assert qz.weight_format(weight) == qz.parse_format("fp8")
    scale = np.asarray(weight.scale, np.float32)
    np.testing.assert_allclose(scale, np.abs(w).max(-2, keepdims=True) / 448, rtol=1e-3)
    back = np.asarray(qz.dequantize(weight))
    assert np.all(np.abs(back - w) <= np.abs(w) * 2.0**-4 + scale * 2.0**-9), f"seed {SEED}"
    with pytest.raises(ValueError, match="not one to quantize into"):
        qz.parse_format("fp8_f32")
    # The planner: a byte and a float16 scale per output channel, as int8 (not the KV cache's "fp8" alias).
    config = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_q_heads=4,
                         num_kv_heads=2, head_dim=16)
    assert memory.normalize_dtype("fp8", memory.WEIGHT_DTYPES) == "fp8"
    assert memory.weights_bytes(config, "fp8") == memory.weights_bytes(config, "int8") < memory.weights_bytes(config)


def emulated(x, weight, activations):
    """numpy: each row of x quantized as the kernel does, times the codes, sums in float64, scaled."""
    x = np.asarray(x, np.float64)
    amax = np.abs(x).max(-1, keepdims=True)
    if activations == "int8":
        scale = np.where(amax > 0, amax / 127, 1.0)
        codes = np.clip(np.round(x / scale), -127, 127)
    else:
        scale = np.where(amax > 0, amax / prompt_matmul.FP8_MAX, 1.0)
        codes = (x / scale).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    q = np.asarray(weight.q.astype(jnp.float32), np.float64)
    return codes @ q * scale * np.asarray(weight.scale, np.float64)[0]


@pytest.mark.parametrize("activations", ["int8", "fp8"])
def test_quantized_activations_linear(activations):
    rng = np.random.default_rng([SEED, activations == "fp8"])
    x = rng.standard_normal((80, 96)).astype(np.float32)
    x[3] = 0.0  # a zero row: scale 1, zero codes
    w = (rng.standard_normal((96, 72)) / 10).astype(np.float32)
    weight = qz.quantize(jnp.asarray(w), qz.QuantFormat(8, None)) if activations == "int8" else fp8_weight(w)
    got = np.asarray(jax.jit(prompt_matmul.quantized_activations_linear, static_argnums=3)(
        jnp.asarray(x), weight.q, weight.scale, activations))
    want = emulated(x, weight, activations)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), f"seed {SEED}"
    assert not got[3].any()
    exact = x.astype(np.float64) @ np.asarray(qz.dequantize(weight), np.float64)  # the weights' own values
    error = np.abs(got - exact).max() / np.abs(exact).max()
    assert error < (0.02 if activations == "int8" else 0.08), f"seed {SEED}: {activations} error {error:.3g}"


def test_with_prompt_activations_marks_the_weights_that_take_it():
    rng = np.random.default_rng(SEED)
    w = jnp.asarray(rng.standard_normal((2, 64, 32)) / 10, jnp.float32)
    int8 = qz.quantize(w, qz.QuantFormat(8, None))
    grouped = qz.quantize(w, qz.QuantFormat(8, 32))  # scales per group of inputs: not per channel
    params = {"layers": {"wq": int8, "wk": grouped, "attn_norm": jnp.ones((2, 64))}, "embed": jnp.zeros((10, 64))}
    marked = prompt_activations.mark(params, "int8")
    assert marked["layers"]["wq"].prompt_activations == "int8"
    assert marked["layers"]["wk"] is grouped and marked["layers"]["attn_norm"] is params["layers"]["attn_norm"]
    assert prompt_activations.mark(params, "bfloat16") is params
    with pytest.raises(ValueError, match=r"--gpu_prompt_dtype=fp8 needs a float8"):
        prompt_activations.mark(params, "fp8")
    with pytest.raises(ValueError, match=r"--gpu_prompt_dtype=int8 needs --quantization=int8"):
        prompt_activations.mark({**params, "layers": {"wq": w}}, "int8")
    fp8 = {"layers": {"wq": fp8_weight(np.asarray(w))}}
    assert prompt_activations.mark(fp8, "fp8")["layers"]["wq"].prompt_activations == "fp8"


@pytest.mark.parametrize("rows", [1, 64, 65])
def test_only_prompt_chunks_quantize_their_activations(rows):
    """Up to 64 rows (decode steps): the weight dequantized, as without the flag; more: 8-bit."""
    rng = np.random.default_rng([SEED, rows])
    weight = qz.quantize(jnp.asarray(rng.standard_normal((64, 48)) / 10, jnp.float32), qz.QuantFormat(8, None))
    x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)
    marked = qz.QuantArray(weight.q, weight.scale, prompt_activations="int8")
    jaxpr = str(jax.make_jaxpr(qz.linear)(x, marked))
    assert ("preferred_element_type=int32" in jaxpr) == (rows > 64)
    plain = np.asarray(qz.linear(x, weight))
    got = np.asarray(qz.linear(x, marked))
    if rows <= 64:
        np.testing.assert_array_equal(got, plain)
    else:
        np.testing.assert_allclose(got, emulated(x, weight, "int8"), rtol=0, atol=1e-5 * np.abs(plain).max())


@pytest.fixture(scope="module")
def tiny_int8(tmp_path_factory):
    path = tmp_path_factory.mktemp("w8a8")
    make_tiny_hf_model(str(path / "hf"), vocab_size=256, seed=11)
    convert_checkpoint(str(path / "hf"), str(path / "converted"))
    return load_config(str(path / "converted")), load_params(str(path / "converted"), jnp.float32)


def test_engine_prompt_logprobs_with_int8_activations(tiny_int8):
    """The step's code for an accelerator, run by XLA on this CPU (the CPU kernels off: their
    layouts would take the decode rows): a 150-token prompt's logprobs next to the same int8
    weights with float32 activations, within the 8-bit activations' noise."""
    config, params = tiny_int8
    base = dict(max_num_seqs=2, max_num_batched_tokens=256, page_size=8, num_pages=64, max_model_len=256,
                warmup=False, enable_prefix_caching=False, quantization="int8", cpu_int8_activations=False)
    w8a8 = Engine(config, params, None, EngineConfig(**base, gpu_prompt_dtype="int8"))
    w8a16 = Engine(config, params, None, EngineConfig(**base))
    assert all(w.prompt_activations == "int8" for w in w8a8.runner.params["layers"].values()
               if isinstance(w, qz.QuantArray))
    prompt = np.random.default_rng(SEED).integers(3, 256, 150).tolist()
    scores = SamplingParams(max_tokens=0, prompt_logprobs=0)
    ours, theirs = (e.generate([prompt], scores)[0].prompt_logprobs for e in (w8a8, w8a16))
    diffs = np.array([abs(a.logprob - b.logprob) for a, b in zip(ours, theirs)])
    assert 0 < diffs.max() < 0.1, f"seed {SEED}: logprobs differ by up to {diffs.max():.3g}"
    with pytest.raises(ValueError, match="--gpu_prompt_dtype=int8 needs"):
        Engine(config, params, None, EngineConfig(**{**base, "quantization": None}, gpu_prompt_dtype="int8"))


def test_engine_prompt_logprobs_with_fp8_weights_and_activations(tiny_int8):
    """--quantization=fp8 with --gpu_prompt_dtype=fp8 (vLLM's dynamic fp8): the prompt's
    logprobs next to the same fp8 weights with float32 activations."""
    config, params = tiny_int8
    base = dict(max_num_seqs=2, max_num_batched_tokens=256, page_size=8, num_pages=64, max_model_len=256,
                warmup=False, enable_prefix_caching=False, quantization="fp8")
    w8a8 = Engine(config, params, None, EngineConfig(**base, gpu_prompt_dtype="fp8"))
    w8a16 = Engine(config, params, None, EngineConfig(**base))
    prompt = np.random.default_rng([SEED, 8]).integers(3, 256, 150).tolist()
    scores = SamplingParams(max_tokens=0, prompt_logprobs=0)
    ours, theirs = (e.generate([prompt], scores)[0].prompt_logprobs for e in (w8a8, w8a16))
    diffs = np.array([abs(a.logprob - b.logprob) for a, b in zip(ours, theirs)])
    assert 0 < diffs.max() < 0.3, f"seed {SEED}: logprobs differ by up to {diffs.max():.3g}"

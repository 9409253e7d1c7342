"""The attention backend a GPU gets by default follows what the installed jax offers
(pallas_kernels.dispatch.attention_backend): the Triton kernels while jax ships the Pallas Triton
lowering and it compiles there, else the Mosaic GPU kernels on Hopper, else the XLA path. Upstream
deprecates the Triton lowering since jax 0.11; these tests hide it (as a jax without it would be)
or break it, and the engine must still choose and serve.

The choice is checked on a GPU faked to the dispatch (a Hopper or an Ampere device); the engine test
serves for real on this machine's platform (on the GPU with bench/gpu_check.sh: the Mosaic kernels
compiled), its greedy tokens against the plain-jnp reference attention's up to near-ties.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.gpu_check_report import compare_greedy, top2_gap
from pallas_kernels import compat, dispatch

pytestmark = pytest.mark.slow  # an engine serves in one of them: out of `make test-quick`

SEED = 20261205


class FakeGpu:
    """What dispatch reads of a device: its kind and compute capability."""

    def __init__(self, compute_capability: str):
        self.compute_capability = compute_capability
        self.device_kind = f"a GPU of compute capability {compute_capability}"
        self.platform = "gpu"


@pytest.fixture
def fresh_probe():
    """dispatch's once-per-process Triton verdict, forgotten before and after the test."""
    dispatch.triton_unusable_reason.cache_clear()
    yield
    dispatch.triton_unusable_reason.cache_clear()


@pytest.fixture
def triton_hidden(monkeypatch, fresh_probe):
    """This jax as if it shipped no Pallas Triton lowering: importing it fails."""
    import jax.experimental.pallas as pallas

    monkeypatch.setitem(sys.modules, "jax.experimental.pallas.triton", None)
    monkeypatch.delattr(pallas, "triton", raising=False)
    assert not compat.has_pallas_triton()


def fake_gpu(monkeypatch, compute_capability: str) -> None:
    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    monkeypatch.setattr(dispatch.jax, "devices", lambda *a: [FakeGpu(compute_capability)])


def mosaic_or_xla() -> str:
    return "mosaic" if compat.has_mosaic_gpu() else "xla"


def test_without_triton_hopper_takes_the_mosaic_kernels_and_ampere_the_xla_path(triton_hidden, monkeypatch):
    fake_gpu(monkeypatch, "9.0")
    assert dispatch.attention_backend() == mosaic_or_xla()
    assert "has no Pallas Triton lowering" in dispatch.triton_unusable_reason()
    dispatch.triton_unusable_reason.cache_clear()
    fake_gpu(monkeypatch, "8.0")
    assert dispatch.attention_backend() == "xla"
    assert dispatch.attention_backend("mosaic") == "mosaic"  # a backend named explicitly still wins


def test_a_triton_that_does_not_compile_is_not_the_default(fresh_probe, monkeypatch):
    if not compat.has_pallas_triton():
        pytest.skip(f"jax {jax.__version__} ships no Triton lowering (the test above covers it)")
    fake_gpu(monkeypatch, "9.0")

    def broken():
        raise RuntimeError("ptxas exited with status 255")

    monkeypatch.setattr(dispatch, "_compile_triton_probe", broken)
    assert dispatch.attention_backend() == mosaic_or_xla()
    assert "ptxas exited with status 255" in dispatch.triton_unusable_reason()
    dispatch.triton_unusable_reason.cache_clear()
    monkeypatch.setattr(dispatch, "_compile_triton_probe", lambda: None)
    assert dispatch.attention_backend() == "pallas" and dispatch.triton_unusable_reason() is None


def test_the_probe_is_the_triton_decode_kernel(fresh_probe):
    """The probe's program holds the Triton kernel's call: lowered for CUDA here, compiled on a GPU."""
    if not compat.has_pallas_triton():
        pytest.skip(f"jax {jax.__version__} ships no Triton lowering")
    if dispatch.on_gpu():
        assert dispatch.triton_unusable_reason() is None
        return
    from jaxserve import compat as jaxserve_compat
    from pallas_kernels import paged_decode

    text = jaxserve_compat.lower_for_cuda(paged_decode.paged_decode_attention, *dispatch.triton_probe_args())
    assert any(target in text for target in ("triton_kernel_call", "__gpu$xla.gpu.triton")), text[:2000]
    assert dispatch.triton_unusable_reason() is None  # off a GPU only the lowering's presence is asked


def greedy(engine, prompts) -> dict:
    from jaxserve.core.request import SamplingParams

    results = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2))
    return {"tokens": [list(r.token_ids) for r in results],
            "gaps": [[top2_gap(dict(p.top)) for p in r.logprobs] for r in results]}


def test_an_engine_serves_with_the_triton_backend_hidden(triton_hidden, monkeypatch):
    """With no Triton lowering the engine takes the platform's default (on a Hopper GPU the Mosaic
    kernels, on the CPU the XLA path) and its greedy tokens are the reference attention's up to
    near-ties, one engine at a time, each with a small fixed KV pool."""
    import gc

    from jaxserve.config import ModelConfig
    from jaxserve.engine import Engine, EngineConfig
    from jaxserve.models import weights

    monkeypatch.delenv("JAXSERVE_ATTENTION_BACKEND", raising=False)
    config = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_q_heads=4,
                         num_kv_heads=2, head_dim=64, max_position_embeddings=256)
    params = weights.random_params(config, dtype=jnp.bfloat16, seed=SEED % 1000)
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (3, 20, 9, 14, 11, 6)]  # one prefill step
    expected = "xla"
    if dispatch.on_gpu() and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9"):
        expected = mosaic_or_xla()
    runs = {}
    for backend in (None, "reference"):
        engine = Engine(config, params, None, EngineConfig(
            attention_backend=backend, dtype="bfloat16", page_size=16, num_pages=64, max_num_seqs=8,
            max_num_prefill_seqs=8, max_num_batched_tokens=64, max_model_len=128, warmup=False), model_name="no-triton")
        assert engine.runner.backend == (backend or expected)
        runs[backend or "default"] = greedy(engine, prompts)
        del engine
        gc.collect()
    result = compare_greedy(runs["default"]["tokens"], runs["reference"]["tokens"], runs["reference"]["gaps"])
    assert result["status"] == "ok", result

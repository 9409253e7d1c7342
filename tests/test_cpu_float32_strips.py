"""A float32 model on one CPU: its matrices in the C++ kernel's strips alone
(cpu_layout.float32_views, cpu_kernels.f32_matmul for every row count), the stored matrices
freed from the runner, the planner's count of the one copy (a tied lm_head's), and the step's
logits against the same step on the stored matrices (XLA's dots). Set JAXSERVE_TEST_SEED to draw
other inputs."""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
from checkpoints.convert import convert_checkpoint
from checkpoints.load import load_config, load_params
from jaxserve.engine import Engine, EngineConfig
from jaxserve.executor import device_setup
from jaxserve.models import cpu_layout, llama
from jaxserve.models import quantization as qz
from tests.tiny_models import make_tiny_hf_model

SEED = int(os.environ.get("JAXSERVE_TEST_SEED", "20261205"))

pytestmark = [pytest.mark.slow,  # engines and the C++ kernels: out of `make test-quick`
              pytest.mark.skipif(not cpu_kernels.available(), reason="no AVX-512 CPU or no C++ compiler")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("float32_strips")
    make_tiny_hf_model(str(path / "hf"), vocab_size=300, seed=5)  # 300: the last strip padded
    convert_checkpoint(str(path / "hf"), str(path / "converted"))
    return load_config(str(path / "converted")), load_params(str(path / "converted"), jnp.float32)


@pytest.mark.parametrize("tied", [False, True], ids=["lm_head", "tied"])
def test_views_are_the_strips_alone(tiny, tied):
    config, params = tiny
    if tied:  # the lm_head tied to the embedding
        params = {name: w for name, w in params.items() if name != "lm_head"}
    views = cpu_layout.layer_views(params)
    for name, w in params["layers"].items():
        view = views["layers"][name]
        if w.ndim == 3:
            assert isinstance(view, qz.StripMatrix) and view.w is None and view.shape == w.shape, name
            assert view.kernel.packed.dtype == jnp.float32, name
            np.testing.assert_array_equal(np.asarray(cpu_kernels.unpack_f32(view.kernel.packed, w.shape[-1])),
                                          np.asarray(w))
        else:
            assert view is w, name  # norms and biases as they are
    assert views["embed"] is params["embed"]
    head = views["lm_head"]  # the lm_head (a tied one: the embedding transposed) in strips
    assert head.shape == (config.hidden_size, config.vocab_size)
    np.testing.assert_array_equal(np.asarray(cpu_kernels.unpack_f32(head.kernel.packed, config.vocab_size)),
                                  np.asarray(params["embed"]).T if tied else np.asarray(params["lm_head"]))
    # The planner: what the views add is a tied lm_head's copy and the strips' padding.
    added = cpu_layout.layer_views_bytes(params)
    assert added == qz.tree_bytes(views) - qz.tree_bytes(params)
    assert added >= (qz.tree_bytes(params["embed"]) if tied else 0)
    # The runner keeps the strips as its weights; the stored matrices are read by nothing.
    left = cpu_layout.stored_params_left(params, views)
    assert left["layers"] is views["layers"] and left["embed"] is params["embed"]
    assert ("lm_head" in left) != tied and (tied or left["lm_head"] is views["lm_head"])
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    assert cpu_layout.stored_params_left(bf16, cpu_layout.layer_views(bf16)) is bf16  # bfloat16: both kept


@pytest.mark.parametrize("rows", [1, 7, cpu_kernels.MAX_ROWS + 1, 512])
def test_strip_matrix_linear_any_rows(rows):
    """Decode rows and prompt chunks alike: the kernel's float32 sums of x @ w, at the layer index."""
    rng = np.random.default_rng([SEED, rows])
    w = jnp.asarray(rng.standard_normal((3, 96, 80)) / 10, jnp.float32)  # [L, in, out]
    matrix = cpu_layout._float32_matrix_jit(w)
    x = rng.standard_normal((rows, 96)).astype(np.float32)
    expected = x.astype(np.float64) @ np.asarray(w[2], np.float64)
    at_layer = jax.jit(lambda x, m, layer: qz.linear(
        x, qz.StripMatrix(None, qz.KernelLayout(m.kernel.packed, None, layer=layer), 80)))
    got = np.asarray(at_layer(jnp.asarray(x), matrix, jnp.int32(2)))
    assert got.dtype == np.float32
    assert np.abs(got - expected).max() < 1e-5 * np.abs(expected).max(), f"seed {SEED}"
    assert "jaxserve_f32_matmul" in at_layer.lower(jnp.asarray(x), matrix, jnp.int32(2)).as_text()


def test_step_logits_equal_the_stored_matrices(tiny):
    """A mixed step (prefill chunk + decode rows) on the strips against the same step on the
    stored matrices under the layer scan: float32 rounding apart."""
    config, params = tiny
    page_size, max_pages, num_pages = 8, 8, 40
    rng = np.random.default_rng(SEED)
    prefill_len, decode_lens = 20, np.array([9, 30], np.int32)
    tables = rng.permutation(np.arange(1, num_pages))[:3 * max_pages].reshape(3, max_pages).astype(np.int32)
    positions = np.concatenate([decode_lens - 1, np.arange(prefill_len)]).astype(np.int32)
    rows = np.concatenate([[0, 1], np.full(prefill_len, 2)])
    batch = dict(
        token_ids=rng.integers(3, config.vocab_size, positions.size).astype(np.int32), positions=positions,
        slot_mapping=(tables[rows, positions // page_size] * page_size + positions % page_size).astype(np.int32),
        decode_block_table=tables[:2], decode_seq_lens=decode_lens,
        prefill_block_table=tables[2:], prefill_seq_lens=np.array([prefill_len], np.int32),
        prefill_query_start_loc=np.array([0, prefill_len], np.int32),  # within the prefill tokens
        logits_indices=np.array([0, 1, 1 + prefill_len], np.int32))
    forward = jax.jit(functools.partial(llama.forward, config=config, backend="xla"))

    def logits(step_params):
        cache = llama.init_kv_cache(config, llama.KVCacheSpec(num_pages, page_size), jnp.float32)
        cache = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape) / 4, a.dtype), cache)  # earlier K/V
        return np.asarray(forward(step_params, jax.tree.map(jnp.copy, cache), batch)[0]), cache

    rng = np.random.default_rng([SEED, 1])
    strips, _ = logits(cpu_layout.layer_views(params))
    rng = np.random.default_rng([SEED, 1])
    stored, _ = logits(params)
    assert np.abs(strips - stored).max() < 1e-4 * np.abs(stored).max(), f"seed {SEED}"


def test_engine_frees_the_stored_matrices_and_plans_them(tiny):
    config, params = tiny
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, page_size=8, num_pages=32, max_model_len=128,
                       warmup=False, enable_prefix_caching=False)
    engine = Engine(config, params, None, cfg)
    matrices = [name for name, w in params["layers"].items() if w.ndim == 3]
    assert all(isinstance(engine.runner.params["layers"][name], qz.StripMatrix) for name in matrices)
    plan = device_setup.plan_engine(config, cfg, params, device_memory_bytes=1 << 30)
    assert engine.weights_bytes == plan.weights_bytes == qz.tree_bytes(params) + cpu_layout.layer_views_bytes(params)

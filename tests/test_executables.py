"""Saved step executables: a restart loads every warm-up shape instead of compiling it, serves the
same tokens, and a folder saved for another engine (or missing a shape) is refused by name."""
import os

import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.core.request import SamplingParams
from jaxserve.engine import Engine, EngineConfig
from jaxserve.executor import executables
from jaxserve.models import weights
from tests.test_engine import recorded_compilations, run_staggered

pytestmark = pytest.mark.slow  # engines and their saved executables: out of `make test-quick`

TINY = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_layers=1,
                   num_q_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=256,
                   eos_token_ids=(2,))
ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=16, max_num_prefill_seqs=1, page_size=8,
              num_pages=24, max_model_len=64, warmup=True)  # few shapes: each engine here compiles them all
SAMPLING = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=10, temperature=0.9, seed=7, repetition_penalty=1.3, ignore_eos=True,
                           logit_bias={5: 4.0}, logprobs=2)]


@pytest.fixture(scope="module")
def params():
    return weights.random_params(TINY, seed=3)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("JAXSERVE_COMPILATION_CACHE", raising=False)
    monkeypatch.delenv("JAXSERVE_EXECUTABLES_CACHE", raising=False)  # the suite's conftest turns the store off
    return tmp_path / "cache" / "executables"


def serve_some(engine, seed=11):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, TINY.vocab_size, rng.integers(1, 40)).tolist() for _ in range(6)]
    return [run_staggered(engine, prompts, sampling) for sampling in SAMPLING]


def test_a_restart_loads_every_shape_and_serves_the_same_tokens(params, cache, monkeypatch):
    with monkeypatch.context() as m:  # no store: the shapes fill jax's persistent compilation cache
        m.setattr(executables, "default_directory", lambda: None)
        expected = serve_some(Engine(TINY, params, None, EngineConfig(**ENGINE)))
    # The store saves them compiled afresh (an executable the persistent cache served cannot be
    # saved: loaded back it fails with "Function ... not found" on the CPU).
    first = Engine(TINY, params, None, EngineConfig(**ENGINE))
    store = first.runner.executables.store
    total = store.saved
    assert total > 0 and store.loaded == 0
    assert sorted(os.listdir(cache)) == [store.fingerprint]
    assert serve_some(first) == expected
    del first

    with recorded_compilations() as without_warmup:  # what building an engine traces (its KV cache)
        Engine(TINY, params, None, EngineConfig(**{**ENGINE, "warmup": False}))
    with recorded_compilations() as compiles:  # tracing counts: warm-up traces, lowers and compiles nothing
        second = Engine(TINY, params, None, EngineConfig(**ENGINE))
        assert len(compiles) == len(without_warmup)
        assert (second.runner.executables.store.loaded, second.runner.executables.store.saved) == (total, 0)
        assert serve_some(second) == expected
        assert len(compiles) == len(without_warmup)  # and serving compiles nothing either


def test_without_a_warm_up_each_shape_is_saved_when_first_used_and_loaded_by_the_next_engine(params, cache):
    no_warmup = EngineConfig(**{**ENGINE, "warmup": False})  # as `jaxserve generate` runs
    first = Engine(TINY, params, None, no_warmup)
    expected = serve_some(first)
    store = first.runner.executables.store
    used = len(first.runner.executables.keys("forward")) + len(first.runner.executables.keys("sample"))
    assert store.saved == used > 2 and store.loaded == 0
    assert sorted(os.listdir(cache)) == [store.fingerprint]

    with recorded_compilations() as building:  # what building an engine traces (its KV cache)
        second = Engine(TINY, params, None, no_warmup)
    with recorded_compilations() as serving:
        assert serve_some(second) == expected
    assert building and not serving  # no step shape traced, lowered or compiled again
    assert (second.runner.executables.store.loaded, second.runner.executables.store.saved) == (used, 0)


def test_the_store_is_beside_a_compilation_cache_named_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_COMPILATION_CACHE", str(tmp_path / "run" / "xla"))
    monkeypatch.delenv("JAXSERVE_EXECUTABLES_CACHE", raising=False)
    assert executables.default_directory() == str(tmp_path / "run" / "executables")


def test_other_flags_are_another_folder_and_old_folders_are_pruned(params, cache, monkeypatch):
    monkeypatch.setattr(executables, "CACHE_FOLDERS_KEPT", 1)
    folders = []
    for max_num_seqs in (1, 2):
        engine = Engine(TINY, params, None, EngineConfig(**{**ENGINE, "max_num_seqs": max_num_seqs}))
        folders.append(engine.runner.executables.store.fingerprint)
        assert engine.runner.executables.store.loaded == 0  # nothing another engine saved is loaded
    assert len(set(folders)) == 2
    assert os.listdir(cache) == folders[1:]  # the least recently used one is gone


def test_a_torn_file_is_compiled_again(params, cache, caplog):
    store = Engine(TINY, params, None, EngineConfig(**ENGINE)).runner.executables.store
    victim = sorted(f for f in os.listdir(store.directory) if f.endswith(".exe"))[0]
    with open(os.path.join(store.directory, victim), "r+b") as f:
        f.truncate(100)
    again = Engine(TINY, params, None, EngineConfig(**ENGINE)).runner.executables.store
    assert (again.loaded, again.saved) == (store.saved - 1, 1)
    assert "could not load the saved executable" in caplog.text


def test_explicit_folder_saved_then_loaded_strictly(params, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_COMPILATION_CACHE", "")  # no automatic store: only the explicit folder
    folder = str(tmp_path / "exe")
    saver = Engine(TINY, params, None, EngineConfig(**ENGINE, save_executables=folder)).runner
    saved = saver.executables.store
    assert saved.saved == saver.warmup_state.total > 0 and os.path.exists(os.path.join(folder, "manifest.json"))
    num_prompt_shapes = len(saver.prompt_logprob_buckets)  # a saved folder is complete: these too
    assert sorted(saver.executables.keys("prompt_logprobs")) == list(saver.prompt_logprob_buckets) and num_prompt_shapes
    engine = Engine(TINY, params, None, EngineConfig(**ENGINE, executables=folder))
    loaded = engine.runner.executables.store
    assert (loaded.loaded, loaded.saved) == (saved.saved, 0)  # every shape, the prompt-logprob ones last
    result = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    assert len(result.prompt_logprobs) == 3 and (loaded.loaded, loaded.saved) == (saved.saved, 0)
    at_start = Engine(TINY, params, None, EngineConfig(**ENGINE, executables=folder, warmup_prompt_logprobs=True))
    assert (at_start.runner.executables.store.loaded, at_start.runner.executables.store.saved) == (saved.saved, 0)

    with pytest.raises(executables.ExecutablesMismatch, match=r"saved for another engine \(buckets: saved"):
        Engine(TINY, params, None, EngineConfig(**{**ENGINE, "max_num_seqs": 1}, executables=folder))
    with pytest.raises(executables.ExecutablesMismatch, match="no manifest.json"):
        Engine(TINY, params, None, EngineConfig(**ENGINE, executables=str(tmp_path / "nothing")))
    os.remove(os.path.join(folder, sorted(f for f in os.listdir(folder) if f.endswith(".exe"))[0]))
    with pytest.raises(executables.ExecutablesMismatch, match="has no executable for the shape"):
        Engine(TINY, params, None, EngineConfig(**ENGINE, executables=folder, warmup_prompt_logprobs=True))


def test_the_fingerprint_follows_jax_devices_and_source(monkeypatch):
    env = executables.environment()
    assert {"jax", "jaxlib", "platform", "devices", "xla_flags", "source"} <= set(env)
    store = executables.ExecutableStore("/nonexistent", {"model": "x"}, mode="save")
    monkeypatch.setattr(executables, "source_digest", lambda: "edited")
    assert executables.ExecutableStore("/nonexistent", {"model": "x"}, mode="save").fingerprint != store.fingerprint


def test_a_step_compiled_for_a_one_device_mesh_runs_on_that_devices_arrays():
    """What `plan --save_executables` relies on for a one-GPU engine: an executable compiled for
    replicated arguments over a mesh of one device (the abstract GPU's, there) describes its
    arguments as an unsharded engine's arrays on that device do, and once saved and loaded runs
    on them."""
    import pickle

    import jax
    import jax.numpy as jnp
    from jax.experimental import serialize_executable
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    device = jax.devices()[0]
    mesh_replicated = NamedSharding(Mesh(np.array([[device]]), ("data", "model")), PartitionSpec())
    x = jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4)  # [3, 4] on the device, unsharded
    abstract = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=mesh_replicated)
    assert executables.abstract_signature({"x": abstract}) == executables.abstract_signature({"x": x})
    step = jax.jit(lambda a, b: (a @ b.T + 1.0, b * 2.0), donate_argnums=(1,))
    with executables.persistent_cache_off():
        compiled = step.lower(abstract, abstract).compile()
        loaded = serialize_executable.deserialize_and_load(*pickle.loads(pickle.dumps(
            serialize_executable.serialize(compiled))))
    expected = (np.asarray(x) @ np.asarray(x).T + 1.0, np.asarray(x) * 2.0)
    out = loaded(x, jnp.array(x))
    np.testing.assert_array_equal(np.asarray(out[0]), expected[0])
    np.testing.assert_array_equal(np.asarray(out[1]), expected[1])
    out = loaded(np.asarray(x), np.asarray(x))  # host arrays, as the runner passes a step's batch
    np.testing.assert_array_equal(np.asarray(out[0]), expected[0])

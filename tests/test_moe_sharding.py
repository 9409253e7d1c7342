"""Mixture-of-experts models under tensor parallelism, on fake CPU devices.

The routed experts are split on their intermediate size (jaxserve.parallel.sharding.shard_experts),
the router replicated, Qwen2-MoE's shared expert split like a dense MLP. A tiny random Mixtral and
a tiny random Qwen2-MoE must give one device's logits (float32) at TP 2 and 4 (TP 4 also
replicates their 2 KV heads) and its greedy tokens through the engine at TP 2 (TP 4's engine
runs only add compile time: the step is the same `llama.forward`). As tests/test_sharding.py does, the multi-device runs
happen in one subprocess started with --xla_force_host_platform_device_count before jax is
imported; it prints its measurements as JSON.
"""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from jaxserve.config import ModelConfig
from jaxserve.parallel import sharding
from tests.moe_fake_devices import prefill_logits, worker_results
from tests.test_sharding import REPO, SMALL_ENGINE, _greedy_tokens

pytestmark = pytest.mark.slow  # fake devices in subprocesses: out of `make test-quick`

BASE = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, num_experts_per_tok=2)
FAMILIES = {
    "mixtral": {"architectures": ["MixtralForCausalLM"], "num_local_experts": 4},
    "qwen2_moe": {"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4, "moe_intermediate_size": 24,
                  "norm_topk_prob": False, "shared_expert_intermediate_size": 40},
}
TENSOR_PARALLEL_SIZES = (1, 2, 4)
ENGINE_TENSOR_PARALLEL_SIZES = (1, 2)


def moe_config(family: str) -> ModelConfig:
    return ModelConfig.from_hf_dict({**BASE, **FAMILIES[family]})


# ---- the subprocess ---------------------------------------------------------------------------
def _family_runs(family: str) -> dict:
    import numpy as np

    from jaxserve.engine import Engine, EngineConfig
    from jaxserve.models import weights
    from jaxserve.parallel import data_parallel
    config = moe_config(family)
    params = weights.random_params(config, seed=11)
    prompts = [np.random.default_rng(n).integers(3, config.vocab_size, n).tolist() for n in (5, 17, 9)]
    runs = {}
    for tp in TENSOR_PARALLEL_SIZES:
        logits, layout = prefill_logits(config, params, tp)
        runs[f"tp{tp}"] = {"logits": logits, "layout": layout}
        if tp in ENGINE_TENSOR_PARALLEL_SIZES:
            cfg = EngineConfig(**SMALL_ENGINE, num_pages=24, tensor_parallel_size=tp)
            engine = data_parallel.build_engine(Engine, config, None, cfg, model_name=family,
                                                load_params=lambda shardings: params)
            runs[f"tp{tp}"]["tokens"] = _greedy_tokens(engine, prompts, max_tokens=12)
    return runs


def _worker() -> None:
    import jax
    assert jax.device_count() >= max(TENSOR_PARALLEL_SIZES), jax.devices()
    print(json.dumps({family: _family_runs(family) for family in FAMILIES}))


@pytest.fixture(scope="module")
def results():
    return worker_results("tests.test_moe_sharding")


# ---- tests ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_moe_logits_match_one_device(results, family, tp):
    import numpy as np
    single, split = results[family]["tp1"], results[family][f"tp{tp}"]
    expected = np.asarray(single["logits"])
    np.testing.assert_allclose(np.asarray(split["logits"]), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tensor_parallel_moe_greedy_tokens_match_one_device(results, family):
    single, split = results[family]["tp1"]["tokens"], results[family]["tp2"]["tokens"]
    assert len({tuple(t) for t in single}) == 3 and all(len(t) == 12 for t in single)
    assert split == single


@pytest.mark.parametrize("family", list(FAMILIES))
def test_experts_are_split_on_their_intermediate_size_and_the_router_replicated(results, family):
    config = moe_config(family)
    E, D, F = config.num_experts, config.hidden_size, config.moe_intermediate_size
    for tp in (2, 4):
        layout = results[family][f"tp{tp}"]["layout"]
        assert layout["w_gate_exps"] == [[config.num_layers, E, D, F // tp]]
        assert layout["w_down_exps"] == [[config.num_layers, E, F // tp, D]]
        assert layout["router"] == [[config.num_layers, D, E]]


def test_planner_holds_half_the_expert_bytes_per_device_at_tp2():
    from jaxserve.planning import memory
    config = moe_config("qwen2_moe")
    one, two = memory.count_params(config, 1), memory.count_params(config, 2)
    assert one["experts"] == config.num_layers * config.num_experts * 3 * 32 * 24
    assert two["experts"] * 2 == one["experts"]
    assert two["routers"] == one["routers"]  # the router and the shared expert's gate: replicated
    shared = config.num_layers * 3 * 32 * 40
    assert one["linear"] - two["linear"] == shared // 2 + config.num_layers * (32 * 32 + 32 * 16)  # shared + attention
    assert memory.weights_bytes(config, "float32", 2) < memory.weights_bytes(config, "float32", 1)


def test_plan_splits_a_mixtral_8x7b_over_eight_devices(tmp_path):
    from tests.test_moe import MIXTRAL_8X7B
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MIXTRAL_8X7B))
    proc = subprocess.run([sys.executable, "-m", "jaxserve.commands.cli", "plan", f"--config={path}",
                           "--tensor_parallel_size=8", "--target=h100", "--format=json"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads(proc.stdout[:proc.stdout.rindex("}") + 1])
    assert plan["tensor_parallel_size"] == 8
    L, D, E = 32, 4096, 8
    replicated = L * 2 * D + D + L * D * E  # the norms and the routers; everything else is split 8 ways
    assert plan["num_params"] == 46_702_792_704
    assert plan["weights_bytes"] == 2 * ((plan["num_params"] - replicated) // 8 + replicated)  # bfloat16


def test_a_split_the_experts_do_not_divide_is_refused_by_name():
    config = moe_config("qwen2_moe")
    assert sharding.tensor_parallel_problem(config, 4) is None
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        sharding.check_tensor_parallel(dataclasses.replace(config, moe_intermediate_size=30), 4)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        sharding.check_tensor_parallel(dataclasses.replace(config, shared_expert_intermediate_size=42), 4)
    assert 4 in sharding.valid_tensor_parallel_sizes(config)

"""Expert parallelism (--enable_expert_parallel) for mixture-of-experts models, on fake CPU devices.

Each device of a replica holds E/n whole routed experts (jaxserve.parallel.sharding's "experts"
axis over "model"), every device routes every token and computes only its own experts' pairs, and
the partial sums are all-reduced (jaxserve.models.moe). Tiny random Mixtral, Qwen3-MoE and
Qwen2-MoE models of 8 experts must give one device's logits (float32) at TP 2 and 4 (TP 4 also
replicates their 2 KV heads); Qwen3-MoE's experts have an intermediate size (18) that 4 devices
cannot split: only expert parallelism runs it there. Through the engine, greedy tokens must be one
device's for Qwen2-MoE (routed and shared experts) at TP 2 x DP 2 (two replicas, each spreading its
experts over its own 2 devices: data parallelism is independent replicas, data_parallel.py). More
engine runs would only add compile time: the engine's step is the same `llama.forward` the logits
compare. Router ties (exact, and one ulp apart) at the top-k boundary route alike on every
device, the lower expert first, and a layer whose tied experts decide tokens' second expert gives
one device's output under expert parallelism. As tests/test_moe_sharding.py
does, the multi-device runs happen in one subprocess started with
--xla_force_host_platform_device_count before jax is imported; it prints its results as JSON.
"""
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.parallel import sharding
from jaxserve.planning import memory
from tests.moe_fake_devices import prefill_logits, worker_results
from tests.test_sharding import REPO, SMALL_ENGINE, TINY, _greedy_tokens

pytestmark = pytest.mark.slow  # fake devices in subprocesses: out of `make test-quick`

BASE = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, num_experts_per_tok=2)
FAMILIES = {
    "mixtral": {"architectures": ["MixtralForCausalLM"], "num_local_experts": 8},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8, "moe_intermediate_size": 18,
                  "norm_topk_prob": True},
    "qwen2_moe": {"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 8, "moe_intermediate_size": 24,
                  "norm_topk_prob": False, "shared_expert_intermediate_size": 40},
}
LOGIT_SIZES = (2, 4)  # expert-parallel TP sizes whose logits are compared with one device's
# family: {run: (tensor_parallel_size, data_parallel_size)}, each against the family's one-device engine
ENGINE_RUNS = {"qwen2_moe": {"ep2x2": (2, 2)}}
LAYOUT_NAMES = ("w_gate_exps", "w_up_exps", "w_down_exps", "router", "wq", "w_gate")
ENGINE_CASES = [(family, run) for family, runs in ENGINE_RUNS.items() for run in runs]


def moe_config(family: str) -> ModelConfig:
    return ModelConfig.from_hf_dict({**BASE, **FAMILIES[family]})


# ---- the subprocess ---------------------------------------------------------------------------
def _family_runs(family: str) -> dict:
    from jaxserve.engine import Engine
    from jaxserve.models import weights
    from jaxserve.parallel import data_parallel
    config = moe_config(family)
    params = weights.random_params(config, seed=11)
    prompts = [np.random.default_rng(n).integers(3, config.vocab_size, n).tolist() for n in (5, 17, 9)]
    runs = {}
    for tp in (1, *LOGIT_SIZES):
        logits, layout = prefill_logits(config, params, tp, expert_parallel=True, layout_names=LAYOUT_NAMES)
        runs[f"tp{tp}"] = {"logits": logits, "layout": layout}
    engines = {"tp1": (1, 1), **ENGINE_RUNS[family]} if family in ENGINE_RUNS else {}
    for name, (tp, dp) in engines.items():
        cfg = EngineConfig(**SMALL_ENGINE, num_pages=24, tensor_parallel_size=tp, data_parallel_size=dp,
                           enable_expert_parallel=tp > 1)
        engine = data_parallel.build_engine(Engine, config, None, cfg, model_name=family,
                                            load_params=lambda shardings: params)
        runs.setdefault(name, {})["tokens"] = _greedy_tokens(engine, prompts, max_tokens=12)
    return runs


def _tie_layer():
    """One Mixtral layer's weights (8 experts) whose router columns 0, 1 and 2 are equal (exact
    ties, often at the top-2 boundary: the tie decides the second expert) and rows h [16, D]."""
    from jaxserve.models import weights
    config = moe_config("mixtral")
    params = weights.random_params(config, seed=3)
    lp = {name: np.array(params["layers"][name][0]) for name in ("router", *sharding.EXPERT_WEIGHTS)}
    lp["router"][:, 1] = lp["router"][:, 2] = lp["router"][:, 0] = 3 * lp["router"][:, 0]  # [D, E]
    h = np.random.default_rng(3).standard_normal((16, config.hidden_size)).astype(np.float32)  # [T, D]
    return config, lp, h


def _tie_runs() -> dict:
    """Router ties on every device: each device's own top-2 of tests/test_moe.py's near-tie logits
    (a shard_map over the expert-parallel mesh, [devices, T, 2]), and `_tie_layer`'s mixture-of-
    experts MLP on one device and under expert parallelism."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jaxserve.models import moe
    from jaxserve.models.quantization import linear
    from tests.test_moe import near_tie_logits
    config, lp, h = _tie_layer()
    logits = jnp.asarray(near_tie_logits())
    runs = {"router_logits": np.asarray(linear(jnp.asarray(h), jnp.asarray(lp["router"]))).tolist(),
            "mlp_tp1": np.asarray(jax.jit(lambda w, x: moe.sparse_mlp(w, x, config))(lp, h)).tolist()}
    for tp in LOGIT_SIZES:
        mesh = sharding.make_mesh(config, tp, expert_parallel=True)
        each_device = jax.shard_map(lambda x: moe.route(x, 2, True)[1][None], mesh=mesh, in_specs=P(),
                                    out_specs=P(sharding.MODEL_AXIS), check_vma=False)
        runs[f"route_tp{tp}"] = np.asarray(jax.jit(each_device)(logits)).tolist()
        run_config = sharding.ModelShardings.create(config, mesh, expert_parallel=True).model_config
        runs[f"mlp_tp{tp}"] = np.asarray(jax.jit(lambda w, x: moe.sparse_mlp(w, x, run_config, mesh))(lp, h)).tolist()
    return runs


def _worker() -> None:
    import jax
    assert jax.device_count() >= 4, jax.devices()
    print(json.dumps({**{family: _family_runs(family) for family in FAMILIES}, "ties": _tie_runs()}))


@pytest.fixture(scope="module")
def results():
    return worker_results("tests.test_moe_expert_parallel")


# ---- on fake devices ----------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("tp", LOGIT_SIZES)
def test_expert_parallel_logits_match_one_device(results, family, tp):
    expected = np.asarray(results[family]["tp1"]["logits"])
    got = np.asarray(results[family][f"tp{tp}"]["logits"])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("family, run", ENGINE_CASES)
def test_expert_parallel_greedy_tokens_match_one_device(results, family, run):
    single = results[family]["tp1"]["tokens"]
    assert len({tuple(t) for t in single}) == 3 and all(len(t) == 12 for t in single)
    assert results[family][run]["tokens"] == single


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_device_holds_whole_experts_and_attention_stays_split(results, family):
    config = moe_config(family)
    L, E, D, F = config.num_layers, config.num_experts, config.hidden_size, config.moe_intermediate_size
    for tp in LOGIT_SIZES:
        layout = results[family][f"tp{tp}"]["layout"]
        assert layout["w_gate_exps"] == [[L, E // tp, D, F]]
        assert layout["w_up_exps"] == [[L, E // tp, D, F]]
        assert layout["w_down_exps"] == [[L, E // tp, F, D]]
        assert layout["router"] == [[L, D, E]]  # replicated: every device routes every token
        assert layout["wq"] == [[L, D, config.q_size // tp]]  # attention keeps its head split
        if config.shared_expert_intermediate_size:  # Qwen2-MoE's shared expert: split like a dense MLP
            assert layout["w_gate"] == [[L, D, config.shared_expert_intermediate_size // tp]]
        # What the planner says one device holds is what it holds.
        run = memory.parallel_model(config, EngineConfig(tensor_parallel_size=tp, enable_expert_parallel=True))
        assert layout["per_device_bytes"] == memory.weights_bytes(run, "float32", tp)


def test_router_ties_route_alike_on_every_device_lower_index_first(results):
    """Exact and one-ulp near ties at the top-k boundary: every device of the expert-parallel
    mesh picks the same experts, the stable order of the probabilities (lower index first)."""
    import jax

    from tests.test_moe import near_tie_logits, stable_top_k
    expected = stable_top_k(np.asarray(jax.nn.softmax(near_tie_logits(), axis=-1)), 2)
    for tp in LOGIT_SIZES:
        each_device = np.asarray(results["ties"][f"route_tp{tp}"])
        assert each_device.shape == (tp, *expected.shape)
        for device in range(tp):
            np.testing.assert_array_equal(each_device[device], expected, err_msg=f"tp {tp}, device {device}")


def test_exactly_tied_experts_under_expert_parallel_give_one_devices_output(results):
    """Tokens whose second expert is decided by an exact three-way tie: one device gives the numpy reference
    (the lower expert), and the expert-parallel devices, each routing for itself, give the same."""
    from tests.test_moe import reference_moe
    config, lp, h = _tie_layer()
    logits = np.asarray(results["ties"]["router_logits"], np.float32)  # [T, E]
    top = np.sort(logits, axis=-1)[:, ::-1]
    assert (top[:, 1] == top[:, 2]).sum() >= 3  # tokens whose second expert the tie decides (0 or 1 of 0, 1, 2)
    expected = reference_moe(h, logits, lp["w_gate_exps"], lp["w_up_exps"], lp["w_down_exps"], 2, True)
    flipped = reference_moe(h, logits[:, ::-1], *(lp[name][::-1] for name in sharding.EXPERT_WEIGHTS), 2, True)
    assert np.abs(flipped - expected).max() > 1e-2  # ties to the higher expert: another answer
    one = np.asarray(results["ties"]["mlp_tp1"])
    np.testing.assert_allclose(one, expected, rtol=1e-4, atol=1e-5)
    for tp in LOGIT_SIZES:
        np.testing.assert_allclose(np.asarray(results["ties"][f"mlp_tp{tp}"]), one, rtol=1e-5, atol=1e-6,
                                   err_msg=f"tp {tp}")


# ---- in this process ----------------------------------------------------------------------------
def test_the_devices_partial_sums_add_up_to_every_pair_computed_once():
    """routed_experts over each device's slice of whole experts (first_expert = r * E/n) adds up
    to the one-device result, whatever the routing: spread, all pairs on one device's experts, or
    all on one expert; and a slice alone leaves out exactly the other experts' pairs."""
    import jax.numpy as jnp

    from jaxserve.models import moe
    rng = np.random.default_rng(7)
    T, D, F, E, k, n = 11, 6, 5, 8, 2, 4
    h = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    wg, wu = (jnp.asarray(rng.standard_normal((E, D, F)), jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((E, F, D)), jnp.float32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (T, k)), jnp.float32)
    routings = {"spread": np.stack([rng.permutation(E)[:k] for _ in range(T)]),
                "one device": np.stack([rng.permutation(2)[:k] + 4 for _ in range(T)]),  # experts 4, 5
                "one expert": np.stack([[3, 3]] * T)}
    G = E // n
    for name, experts in routings.items():
        experts = jnp.asarray(experts, jnp.int32)
        whole = np.asarray(moe.routed_experts(h, weights, experts, wg, wu, wd))  # [T, D]
        parts = [np.asarray(moe.routed_experts(h, weights, experts, wg[r * G:(r + 1) * G], wu[r * G:(r + 1) * G],
                                               wd[r * G:(r + 1) * G], first_expert=r * G)) for r in range(n)]
        np.testing.assert_allclose(sum(parts), whole, rtol=1e-5, atol=1e-5, err_msg=name)
        for r, part in enumerate(parts):  # each part: only the pairs routed to that device's experts
            mine = np.asarray((experts >= r * G) & (experts < (r + 1) * G), np.float32)  # [T, k]
            only = moe.routed_experts(h, weights * mine, experts, wg, wu, wd)
            np.testing.assert_allclose(part, np.asarray(only), rtol=1e-5, atol=1e-5, err_msg=f"{name}, device {r}")


def test_experts_that_do_not_divide_over_the_devices_are_refused_by_name():
    config = dataclasses.replace(moe_config("mixtral"), num_experts=6)
    assert sharding.expert_parallel_problem(config, 2) is None
    with pytest.raises(ValueError, match=r"routed experts \(6\).*not divisible"):
        sharding.with_expert_parallel(config, True, 4)
    with pytest.raises(memory.MemoryPlanError, match=r"routed experts \(6\)"):
        memory.parallel_model(config, EngineConfig(tensor_parallel_size=4, enable_expert_parallel=True))


def test_a_dense_model_is_refused():
    with pytest.raises(ValueError, match="needs a mixture-of-experts model.*dense"):
        sharding.with_expert_parallel(TINY, True, 2)
    assert sharding.with_expert_parallel(TINY, False, 2) is TINY  # without the flag nothing changes
    from jaxserve.engine import Engine
    from jaxserve.parallel import data_parallel
    cfg = EngineConfig(**SMALL_ENGINE, num_pages=8, enable_expert_parallel=True)
    loaded = []
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):  # before any weight is read
        data_parallel.build_engine(Engine, TINY, None, cfg, model_name="tiny", load_params=loaded.append)
    assert loaded == []


def test_expert_parallel_runs_a_split_the_intermediate_size_refuses():
    config = moe_config("qwen3_moe")  # moe_intermediate_size 18: not over 4 devices
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        sharding.check_tensor_parallel(config, 4)
    assert sharding.expert_parallel_problem(config, 4) is None
    assert 4 in sharding.valid_tensor_parallel_sizes(dataclasses.replace(config, expert_parallel=True))


@pytest.mark.parametrize("tp", [2, 4])
def test_the_planner_holds_whole_experts_per_device(tp):
    config = moe_config("qwen2_moe")
    L, E, D, F = config.num_layers, config.num_experts, config.hidden_size, config.moe_intermediate_size
    cfg = EngineConfig(tensor_parallel_size=tp, enable_expert_parallel=True)
    run = memory.parallel_model(config, cfg)
    assert run.expert_parallel and not config.expert_parallel
    split, spread = memory.count_params(config, tp), memory.count_params(run, tp)
    assert spread["experts"] == L * (E // tp) * 3 * D * F  # E/n whole experts
    assert split["experts"] == L * E * 3 * D * (F // tp)  # without the flag: every expert's 1/n slice
    assert {k: v for k, v in spread.items() if k != "experts"} == {k: v for k, v in split.items() if k != "experts"}
    # The activations: every device's sorted rows carry the whole F under expert parallelism.
    tokens, k = 64, config.num_experts_per_tok
    kwargs = dict(compute_dtype="float32", max_num_batched_tokens=tokens, max_num_seqs=1, max_context_len=64,
                  tensor_parallel_size=tp)
    assert (memory._mlp_bytes(run, tokens, tp, 4) - memory._mlp_bytes(config, tokens, tp, 4)
            == 3 * tokens * k * (F - F // tp) * 4)
    assert memory.activation_bytes(run, **kwargs) >= memory.activation_bytes(config, **kwargs)
    # plan_memory applies the flag itself.
    plan_cfg = dataclasses.replace(cfg, dtype="float32", num_pages=16, max_model_len=64)
    assert (memory.plan_memory(config, plan_cfg, device_memory_bytes=1 << 30).weights_bytes
            == memory.weights_bytes(run, "float32", tp))


def test_plan_refuses_expert_parallel_for_a_dense_model_with_exit_2(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY.to_hf_dict()))
    proc = subprocess.run([sys.executable, "-m", "jaxserve.commands.cli", "plan", f"--config={path}",
                           "--tensor_parallel_size=2", "--enable_expert_parallel", "--target=h100"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "--enable_expert_parallel needs a mixture-of-experts model" in proc.stderr

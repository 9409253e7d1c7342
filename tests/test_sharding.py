"""Tensor and data parallelism on 8 fake CPU devices.

The pytest session already runs jax on one device, so the multi-device checks run in subprocesses
(`_worker`, two at once) started with --xla_force_host_platform_device_count=8 before jax is
imported; they print their measurements as JSON and the tests below assert on them.
"""
import asyncio
import json
import os
import subprocess
import sys

import pytest

from jaxserve.config import ModelConfig
from jaxserve.core.outputs import EngineStats
from jaxserve.parallel import sharding

pytestmark = pytest.mark.slow  # fake devices in subprocesses: out of `make test-quick`

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_FAKE_DEVICES = 8
FAKE_DEVICES_ENV = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={NUM_FAKE_DEVICES}",
                    "JAX_PLATFORMS": "cpu"}
# 8 query heads over 2 KV heads: TP 4 and 8 replicate KV heads; tied embeddings (vocab-parallel).
TINY = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_q_heads=8,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=512, eos_token_ids=(2,),
                   tie_word_embeddings=True)
SMOLLM2_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land"]
# Every prompt of a test fits in the first step: each engine compiles two step shapes.
SMALL_ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_num_prefill_seqs=4, page_size=16,
                    max_model_len=64, warmup=False)


# ---- the subprocess ---------------------------------------------------------------------------
def _kv_layout(engine) -> dict:
    k = engine.runner.kv_cache["k"]
    return {"total_bytes": k.nbytes, "per_device_bytes": sharding.per_device_bytes(k),
            "shard_shapes": sorted({tuple(s.data.shape) for s in k.addressable_shards}),
            "num_devices": len(k.sharding.device_set)}


def _greedy_tokens(engine, prompts, max_tokens=16) -> list:
    from jaxserve.core.request import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [r.token_ids for r in engine.generate(prompts, params)]


def _serve_through_router(engine, prompts) -> list:
    """The prompts as concurrent server requests over AsyncEngine replicas behind the router."""
    from jaxserve.async_engine import AsyncEngine
    from jaxserve.core.request import SamplingParams
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    router = AsyncEngine(engine.replicas)

    async def one(i):
        return [t for out in [o async for o in router.generate(f"r{i}", prompts[i], params)]
                for t in out.new_token_ids]

    async def main():
        await router.start()
        try:
            return await asyncio.gather(*(one(i) for i in range(len(prompts))))
        finally:
            await router.shutdown()
    return asyncio.run(main())


def _tiny_runs() -> dict:
    import jax
    import numpy as np
    from jax import monitoring

    from jaxserve.engine import Engine, EngineConfig
    from jaxserve.models import weights
    from jaxserve.parallel import data_parallel
    params = weights.random_params(TINY, seed=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, TINY.vocab_size, n).tolist() for n in (5, 17, 30, 9)]
    runs = {}
    for tp, dp in [(1, 1), (2, 1), (4, 1), (8, 1), (2, 2)]:
        warmup = (tp, dp) == (2, 1)  # this one also counts compilations after warm-up
        cfg = EngineConfig(**{**SMALL_ENGINE, "warmup": warmup}, num_pages=24, tensor_parallel_size=tp,
                           data_parallel_size=dp)
        engine = data_parallel.build_engine(Engine, TINY, None, cfg, model_name="tiny",
                                            load_params=lambda shardings: params)
        compiles = []
        listener = lambda event, _, **kw: compiles.append(event) if "compile" in event else None
        monitoring.register_event_duration_secs_listener(listener)
        try:
            run = {"tokens": _greedy_tokens(engine, prompts)}
        finally:
            monitoring.unregister_event_duration_listener(listener)
        run["num_compile_events"] = len(compiles)
        if dp == 1:
            # (one CPU device: a float32 wq is the C++ kernel's strips, the same bytes when 64 columns divide it)
            wq = jax.tree.leaves(engine.runner.params["layers"]["wq"])[0]
            run.update(kv=_kv_layout(engine), wq_per_device_bytes=sharding.per_device_bytes(wq),
                       wq_bytes=wq.nbytes)
        else:
            run["replica_devices"] = [sorted(d.id for d in e.runner.kv_cache["k"].sharding.device_set)
                                      for e in engine.replicas]
            run["served_tokens"] = _serve_through_router(engine, prompts)
        runs[f"tp{tp}_dp{dp}"] = run
    return runs


def _tiny_quantized_runs() -> dict:
    """Weights quantized at load time, then split: int8 per output channel over 1, 2 and 4
    devices (4 replicates KV heads); int4 (groups of 32) over 2 devices, where w_down's 3 input
    groups cannot be split."""
    import jax

    from jaxserve.engine import Engine, EngineConfig
    from jaxserve.models import quantization as qz
    from jaxserve.models import weights
    from jaxserve.parallel import data_parallel
    params = weights.random_params(TINY, seed=3)
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 9)]
    runs = {}
    for quantization, tp in [("int8", 1), ("int8", 2), ("int8", 4), ("int4", 2)]:
        # Float activations: one device's CPU step would round them to int8 (cpu_kernels), a split one not.
        cfg = EngineConfig(**SMALL_ENGINE, num_pages=24, tensor_parallel_size=tp, quantization=quantization,
                           cpu_int8_activations=False)
        try:
            engine = data_parallel.build_engine(Engine, TINY, None, cfg, model_name="tiny",
                                                load_params=lambda shardings: params)
        except ValueError as e:
            runs[f"{quantization}_tp{tp}"] = {"error": str(e)}
            continue
        w_down = engine.runner.params["layers"]["w_down"]
        shardings = sharding.ModelShardings.create(TINY, sharding.make_mesh(TINY, tp))
        quantized = qz.quantize_params(params, quantization, TINY)
        runs[f"{quantization}_tp{tp}_bytes"] = {  # planned per-device bytes vs what placing holds
            "planned": shardings.per_device_bytes(quantized),
            "placed": sum(sharding.per_device_bytes(a) for a in jax.tree.leaves(shardings.place(quantized)))}
        runs[f"{quantization}_tp{tp}"] = {
            "tokens": _greedy_tokens(engine, prompts),
            "w_down_q_shards": sorted({tuple(s.data.shape) for s in w_down.q.addressable_shards}),
            "w_down_scale_shards": sorted({tuple(s.data.shape) for s in w_down.scale.addressable_shards})}
    return runs


def _tiny_speculative_runs() -> dict:
    """Speculative decoding on a sharded target (ngram; a draft, the target itself, on the first
    device of each replica) and multi-step decoding, against one device without either."""
    from jaxserve.engine import Engine, EngineConfig
    from jaxserve.models import weights
    from jaxserve.parallel import data_parallel
    params = weights.random_params(TINY, seed=3)
    prompts = [([7, 90, 31, 5] * 10)[:n] for n in (9, 21, 30, 14)]
    runs = {}
    for name, tp, dp, method in [("plain", 1, 1, None), ("ngram_tp2", 2, 1, "ngram"),
                                 ("draft_tp2", 2, 1, "draft"), ("draft_dp2_tp2", 2, 2, "draft"),
                                 ("multi_step_tp2", 2, 1, None)]:
        cfg = EngineConfig(**SMALL_ENGINE, num_pages=24, tensor_parallel_size=tp, data_parallel_size=dp,
                           speculative_method=method, speculative_model="self" if method == "draft" else None,
                           prompt_lookup_min=1, num_scheduler_steps=4 if name == "multi_step_tp2" else 1)
        engine = data_parallel.build_engine(
            lambda *args, **kwargs: Engine(*args, **kwargs, draft_model=(TINY, params) if method == "draft" else None),
            TINY, None, cfg, model_name="tiny", load_params=lambda shardings: params)
        run = {"tokens": _greedy_tokens(engine, prompts, max_tokens=20)}
        stats = engine.stats()
        run.update(proposed=stats.spec_proposed_tokens, accepted=stats.spec_accepted_tokens)
        if dp == 1:
            run["max_tokens_per_row_and_call"] = max(r.num_output_tokens // max(r.num_decode_rows, 1)
                                                     for r in engine.step_records)
        runs[name] = run
    return runs


def _smollm2_runs(model_dir: str) -> dict:
    import tempfile

    from checkpoints.convert import convert_checkpoint
    from checkpoints.default_model import smollm2_gguf_path
    from jaxserve.engine import Engine, EngineConfig
    from serve.prompts import encode_text
    from jaxserve.models import quantization as qz
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:  # Q4_1 blocks copied into an int4 checkpoint
        int4_dir = os.path.join(tmp, "int4")
        convert_checkpoint(smollm2_gguf_path(), int4_dir, quantization="int4")
        for name, directory, tp in [("tp1", model_dir, 1), ("tp3", model_dir, 3),
                                    ("int4_tp1", int4_dir, 1), ("int4_tp3", int4_dir, 3)]:
            engine = Engine.from_model(directory, EngineConfig(**SMALL_ENGINE, num_pages=16, tensor_parallel_size=tp,
                                                               cpu_int8_activations=False))  # as above
            prompts = [encode_text(engine.tokenizer, p) for p in SMOLLM2_PROMPTS]
            embed, wo = engine.runner.params["embed"], engine.runner.params["layers"]["wo"]
            runs[name] = {"tokens": _greedy_tokens(engine, prompts), "kv": _kv_layout(engine),
                          "embed_shard_shapes": sorted({tuple(s.data.shape) for s in embed.addressable_shards})}
            if isinstance(wo, qz.QuantArray):
                runs[name]["wo_shards"] = {k: sorted({tuple(s.data.shape) for s in v.addressable_shards})
                                           for k, v in wo.stored().items()}
    return runs


# The runs, in two groups that run as two subprocesses at once (each compiles one shape at a time,
# so together they keep two cores busy): the tiny model's, and SmolLM2's (about as long).
WORKER_GROUPS = {"tiny": ("tiny", "tiny_quantized", "tiny_speculative"), "smollm2": ("smollm2",)}


def _worker(model_dir: str, group: str) -> None:
    import jax
    assert jax.device_count() == NUM_FAKE_DEVICES, jax.devices()
    runs = {"tiny": _tiny_runs, "tiny_quantized": _tiny_quantized_runs, "tiny_speculative": _tiny_speculative_runs,
            "smollm2": lambda: _smollm2_runs(model_dir)}
    print(json.dumps({name: runs[name]() for name in WORKER_GROUPS[group]}))


@pytest.fixture(scope="module")
def results():
    from checkpoints import default_model
    model_dir = default_model.resolve_model("smollm2")
    code = "import sys; from tests.test_sharding import _worker; _worker(sys.argv[1], sys.argv[2])"
    procs = {group: subprocess.Popen([sys.executable, "-c", code, model_dir, group], cwd=REPO, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env={**os.environ, **FAKE_DEVICES_ENV})
             for group in WORKER_GROUPS}
    merged = {}
    try:
        for group, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=600)
            assert proc.returncode == 0, f"{group}: {stderr[-4000:]}"
            merged.update(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return merged


# ---- tensor parallel ----------------------------------------------------------------------------
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_greedy_tokens_match_one_device(results, tp):
    single = results["tiny"]["tp1_dp1"]["tokens"]
    assert len({tuple(t) for t in single}) == len(single) and all(len(t) == 16 for t in single)
    assert results["tiny"][f"tp{tp}_dp1"]["tokens"] == single


def test_sharded_step_does_not_compile_after_warmup(results):
    assert results["tiny"]["tp2_dp1"]["num_compile_events"] == 0
    assert results["tiny"]["tp4_dp1"]["num_compile_events"] > 0  # the counter sees compiles without it


def test_data_parallel_times_tensor_parallel_matches_one_device(results):
    run = results["tiny"]["tp2_dp2"]
    assert run["tokens"] == results["tiny"]["tp1_dp1"]["tokens"]
    assert run["replica_devices"] == [[0, 1], [2, 3]]  # each replica on its own device group
    assert run["served_tokens"] == run["tokens"]  # concurrent requests through the server's router


def test_speculative_and_multi_step_decoding_on_sharded_targets_keep_greedy_output(results):
    runs = results["tiny_speculative"]
    for name in ("ngram_tp2", "draft_tp2", "draft_dp2_tp2"):
        assert runs[name]["tokens"] == runs["plain"]["tokens"], name
        assert runs[name]["proposed"] > 0, name
    assert runs["draft_tp2"]["accepted"] >= 0.9 * runs["draft_tp2"]["proposed"]  # the target as its own draft
    assert runs["multi_step_tp2"]["tokens"] == runs["plain"]["tokens"]
    assert runs["multi_step_tp2"]["max_tokens_per_row_and_call"] == 4


@pytest.mark.parametrize("tp", [1, 2])
def test_kv_pages_and_weights_per_device_are_one_over_tp(results, tp):
    run, single = results["tiny"][f"tp{tp}_dp1"], results["tiny"]["tp1_dp1"]
    assert run["kv"]["num_devices"] == tp
    assert run["kv"]["per_device_bytes"] * tp == single["kv"]["total_bytes"]
    assert run["kv"]["shard_shapes"] == [[2 * 24, 16, TINY.num_kv_heads // tp, 16]]
    assert run["wq_per_device_bytes"] * tp == single["wq_bytes"]


@pytest.mark.parametrize("tp", [4, 8])
def test_kv_heads_replicated_when_tp_exceeds_them(results, tp):
    """As in vLLM: each device holds the one KV head its query heads read, not a slice of one."""
    run, single = results["tiny"][f"tp{tp}_dp1"], results["tiny"]["tp1_dp1"]
    assert run["kv"]["shard_shapes"] == [[2 * 24, 16, 1, 16]]
    assert run["kv"]["per_device_bytes"] * TINY.num_kv_heads == single["kv"]["total_bytes"]
    assert run["wq_per_device_bytes"] * tp == single["wq_bytes"]


def test_smollm2_tp3_matches_tp1_with_weights_restored_into_shards(results):
    tp1, tp3 = results["smollm2"]["tp1"], results["smollm2"]["tp3"]
    assert all(len(t) == 16 for t in tp1["tokens"])
    assert tp3["tokens"] == tp1["tokens"]
    assert tp3["embed_shard_shapes"] == [[49152 // 3, 576]]  # vocabulary-parallel embedding
    assert tp3["kv"]["per_device_bytes"] * 3 == tp1["kv"]["total_bytes"]
    assert tp3["kv"]["shard_shapes"] == [[30 * 16, 16, 1, 64]]


def test_quantized_weights_split_over_devices_give_the_same_tokens(results):
    runs = results["tiny_quantized"]
    single = runs["int8_tp1"]
    for tp in (2, 4):
        run = runs[f"int8_tp{tp}"]
        assert run["tokens"] == single["tokens"], tp
        # w_down [L, 96, 64] is row-parallel: codes split over its inputs, per-channel scales whole
        assert run["w_down_q_shards"] == [[2, 96 // tp, 64]]
        assert run["w_down_scale_shards"] == [[2, 1, 64]]
        assert runs[f"int8_tp{tp}_bytes"]["planned"] == runs[f"int8_tp{tp}_bytes"]["placed"], tp
    assert "w_down: 3 quantization groups" in runs["int4_tp2"]["error"]
    assert "tensor_parallel_size=2" in runs["int4_tp2"]["error"]


def test_smollm2_int4_checkpoint_restored_into_shards_matches_one_device(results):
    tp1, tp3 = results["smollm2"]["int4_tp1"], results["smollm2"]["int4_tp3"]
    assert all(len(t) == 16 for t in tp1["tokens"])
    assert tp3["tokens"] == tp1["tokens"]
    # wo [30, 576, 576] in groups of 32: 18 groups, 6 per device; codes packed two per byte
    assert tp3["wo_shards"]["q"] == [[30, 576 // 2 // 3, 576]]
    assert tp3["wo_shards"]["scale"] == [[30, 18 // 3, 576]] == tp3["wo_shards"]["zero"]
    assert tp1["wo_shards"]["q"] == [[30, 576 // 2, 576]]


def test_cli_refuses_a_split_that_does_not_divide(tmp_path):
    from checkpoints import default_model
    default_model.resolve_model("smollm2")
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"id": 1, "prompt": "Hello"}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve.commands.cli", "generate", "--model=smollm2", "--tensor_parallel_size=2",
         f"--input={prompts}", f"--output={tmp_path / 'out.jsonl'}"],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, **FAKE_DEVICES_ENV})
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "num_attention_heads (9) is not divisible" in proc.stderr
    assert "valid sizes: 1, 3" in proc.stderr  # 9 would split the MLP (1536) unevenly
    assert not (tmp_path / "out.jsonl").exists()


# ---- data parallel replicas of one device each -------------------------------------------------
def _one_device_replica_runs() -> dict:
    """Greedy tokens of one engine and of two replicas of one device each (tensor_parallel_size 1),
    per weights' format; each replica's CPU step reads layer_views' layouts, not the stored tree:
    float32 the C++ kernel's strips in place of the stored matrices, bfloat16 strips beside them,
    int8 with float activations per-layer views with the transposed layout, int8 with int8
    activations the kernel's layout beside the codes."""
    import jax

    from jaxserve.engine import Engine, EngineConfig
    from jaxserve.models import weights
    from jaxserve.parallel import data_parallel
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 30, 9)]
    runs = {}
    for name, dtype, quantization, int8_activations in [
            ("float32", "float32", None, True), ("bfloat16", "bfloat16", None, True),
            ("int8", "float32", "int8", False), ("int8_kernel", "float32", "int8", True)]:
        params = weights.random_params(TINY, dtype=jax.numpy.dtype(dtype), seed=3)
        for dp in (1, 2):
            cfg = EngineConfig(**SMALL_ENGINE, num_pages=24, dtype=dtype, quantization=quantization,
                               cpu_int8_activations=int8_activations, data_parallel_size=dp)
            engine = data_parallel.build_engine(Engine, TINY, None, cfg, model_name="tiny",
                                                load_params=lambda shardings: params)
            run = {"tokens": _greedy_tokens(engine, prompts, max_tokens=8)}
            if dp == 2:
                step_layers = [replica.runner._step_params["layers"] for replica in engine.replicas]
                run["replica_devices"] = [sorted(d.id for d in r.runner.kv_cache["k"].sharding.device_set)
                                          for r in engine.replicas]
                run["step_layers"] = [type(layers).__name__ if isinstance(layers, tuple) else
                                      type(layers["wq"]).__name__ + ("+kernel" if layers["wq"].kernel else "")
                                      for layers in step_layers]
            runs[f"{name}_dp{dp}"] = run
    runs.update(_one_device_replica_lora_runs(prompts))
    return runs


def _one_device_replica_lora_runs(prompts) -> dict:
    """Greedy tokens with --enable_lora, every other prompt through an adapter: one engine and two
    replicas of one device each, each replica's slab on its own device."""
    import tempfile

    from jaxserve.core.request import SamplingParams
    from jaxserve.engine import Engine, EngineConfig
    from jaxserve.models import weights
    from jaxserve.parallel import data_parallel
    from tests.test_lora_adapters import write_adapter
    params = weights.random_params(TINY, seed=3)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        write_adapter(tmp, targets=("q_proj", "down_proj"), config=TINY)
        for dp in (1, 2):
            cfg = EngineConfig(**SMALL_ENGINE, num_pages=24, dtype="float32", data_parallel_size=dp,
                               enable_lora=True, lora_modules=(f"tiny-lora={tmp}",))
            engine = data_parallel.build_engine(Engine, TINY, None, cfg, model_name="tiny",
                                                load_params=lambda shardings: params)
            sampling = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                       lora_name="tiny-lora" if i % 2 else None) for i in range(len(prompts))]
            runs[f"lora_dp{dp}"] = {"tokens": [r.token_ids for r in engine.generate(prompts, sampling)]}
    return runs


def test_data_parallel_replicas_of_one_cpu_device_match_one_engine():
    """data_parallel_size 2, tensor_parallel_size 1: each replica's step is jitted for its device
    with the shardings of the weights it reads (it once took those of the stored tree, which
    layer_views changes: "3 vs 4 child keys", no token), keeps one device's CPU layouts, and
    decodes as one engine does (int8 activations: a near tie may flip with the step's rounding,
    so only that it decodes)."""
    code = ("import json; from tests.test_sharding import _one_device_replica_runs; "
            "print(json.dumps(_one_device_replica_runs()))")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, step_layers in [("float32", "StripMatrix+kernel"), ("bfloat16", "StripMatrix+kernel"),
                              ("int8", "tuple"), ("int8_kernel", "QuantArray+kernel")]:
        single, replicas = runs[f"{name}_dp1"], runs[f"{name}_dp2"]
        assert all(len(t) == 8 for t in single["tokens"] + replicas["tokens"]), name
        if name != "int8_kernel":
            assert replicas["tokens"] == single["tokens"], name
        assert replicas["replica_devices"] == [[0], [1]], name
        assert replicas["step_layers"] == [step_layers] * 2, name  # one CPU device's fast path kept
    lora, lora_replicas = runs["lora_dp1"]["tokens"], runs["lora_dp2"]["tokens"]
    assert all(len(t) == 8 for t in lora + lora_replicas) and lora_replicas == lora
    assert [t for i, t in enumerate(lora) if i % 2] != [t for i, t in enumerate(runs["float32_dp1"]["tokens"]) if i % 2]


# ---- host-side rules (one device) ---------------------------------------------------------------
def test_head_split_rules():
    smollm2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                          num_q_heads=9, num_kv_heads=3, head_dim=64)
    assert sharding.valid_tensor_parallel_sizes(smollm2) == [1, 3]  # 1536 / 9 is not whole
    with pytest.raises(ValueError, match=r"num_attention_heads \(9\) is not divisible"):
        sharding.check_tensor_parallel(smollm2, 2)
    assert sharding.sharded_model_config(smollm2, 3).num_kv_heads == 3
    assert sharding.sharded_model_config(TINY, 2).num_kv_heads == 2
    assert sharding.sharded_model_config(TINY, 8).num_kv_heads == 8  # each KV head 4 times
    odd_kv = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1,
                         num_q_heads=12, num_kv_heads=4, head_dim=16)
    with pytest.raises(ValueError, match="must divide one another"):
        sharding.check_tensor_parallel(odd_kv, 6)
    odd_mlp = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=100, num_layers=1,
                          num_q_heads=8, num_kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match=r"intermediate_size \(100\)"):
        sharding.check_tensor_parallel(odd_mlp, 8)
    with pytest.raises(ValueError, match="needs 16 devices"):
        sharding.make_mesh(TINY, 8, 2)


def test_partition_specs_cover_every_weight():
    from jax.sharding import PartitionSpec as P
    specs = sharding.param_partition_specs(TINY, 4)
    assert specs["embed"] == P("model", None) and "lm_head" not in specs
    assert specs["layers"]["wq"] == P(None, None, "model") and specs["layers"]["wo"] == P(None, "model", None)
    assert specs["layers"]["attn_norm"] == P(None, None) and specs["final_norm"] == P(None)  # replicated
    assert specs["layers"]["w_gate"] == P(None, None, "model") and specs["layers"]["w_down"] == P(None, "model", None)
    odd_vocab = ModelConfig(vocab_size=250, hidden_size=64, intermediate_size=96, num_layers=1,
                            num_q_heads=8, num_kv_heads=2, head_dim=16)
    assert sharding.param_partition_specs(odd_vocab, 4)["lm_head"] == P(None, None)  # replicated


class _StubCore:
    """An engine core that runs each request for two steps, its deltas carrying the core's name."""

    def __init__(self, name, num_running):
        from types import SimpleNamespace
        self.name, self.num_running, self.requests, self._left = name, num_running, [], {}
        self.tokenizer, self.model_name, self.grammar_compiler = None, "stub", None
        self.loras = self.pooler = self.image_processor = None  # no LoRA adapters; a generating text engine
        self.config, self.limits = SimpleNamespace(max_waiting_requests=8), SimpleNamespace(max_seq_len=64)

    def stats(self):
        return EngineStats(self.num_running, 1, 2, 10, 0, 0, 0)

    def make_request(self, request_id, prompt_token_ids, params, multimodal=None):
        from jaxserve.core.request import Request, SamplingParams
        return Request(request_id, list(prompt_token_ids), SamplingParams(max_tokens=2))

    def add(self, request):
        self.requests.append(request.request_id)
        self._left[request.request_id] = 2

    def has_unfinished(self):
        return bool(self._left)

    def step(self):
        import time
        from jaxserve.core.outputs import RequestOutput
        time.sleep(0.01)  # the requests stay in flight a while
        outputs = []
        for request_id in list(self._left):
            self._left[request_id] -= 1
            finished = not self._left[request_id]
            outputs.append(RequestOutput(request_id, [], self.name, finished, "stop" if finished else None, 2, 0))
            if finished:
                del self._left[request_id]
        return outputs

    def abort(self, request_id):
        self._left.pop(request_id, None)

    def fail_all(self, message):
        return []

    def stop_warmup(self):
        pass

    def executor_failure(self):
        return None


def test_async_client_sends_each_request_to_the_least_busy_replica():
    from jaxserve.async_engine import AsyncEngine
    a, b = _StubCore("a", 3), _StubCore("b", 1)
    router = AsyncEngine([a, b])

    async def consume(request_id):
        return [out.new_text async for out in router.generate(request_id, [1, 2], None)]

    async def main():
        await router.start()
        try:
            return await asyncio.gather(*(consume(f"r{i}") for i in range(4)))
        finally:
            await router.shutdown()

    outputs = asyncio.run(main())
    assert sorted(a.requests + b.requests) == ["r0", "r1", "r2", "r3"]
    assert len(a.requests) == len(b.requests) == 2  # balanced while all four are in flight
    assert all(len(set(o)) == 1 and len(o) == 2 for o in outputs)
    assert router.stats() == EngineStats(4, 2, 4, 20, 0, 0, 0)

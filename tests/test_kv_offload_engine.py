"""KV offload through the engine: the host (and disk) tier's copies of real K/V pages give exactly
the tokens recomputing them gives, for float and int8 caches; the faults (a full host tier, a
disk path that cannot be used, failed copies, a request aborted after its pages were restored)
leave no page or block behind."""
import dataclasses

import numpy as np
import pytest

from jaxserve.config import SettingError
from jaxserve.core.request import SamplingParams
from jaxserve.engine import EngineConfig

from tests.test_engine import GREEDY, TINY, make_engine, params, recorded_compilations  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow  # engines: out of `make test-quick`

# One page of TINY (page_size 8): 2 layers x K and V x 8 tokens x 2 heads x 16 x float32.
PAGE_BYTES = 2 * 2 * 8 * 2 * 16 * 4
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)


def conversations(seed, num=6, turns=3, first=60, later=20):
    """Round-robin multi-turn chats over `engine`: each turn's prompt is the history so far (its
    outputs included) plus new tokens. Returns the outputs, turn by turn."""
    rng = np.random.default_rng(seed)
    starts = [rng.integers(3, TINY.vocab_size, first).tolist() for _ in range(num)]
    added = [[rng.integers(3, TINY.vocab_size, later).tolist() for _ in range(num)] for _ in range(turns)]

    def run(engine, params=GREEDY):
        histories, outputs = [list(s) for s in starts], []
        for turn in range(turns):
            for i in range(num):
                tokens = engine.generate([histories[i]], params)[0].token_ids
                outputs.append(tokens)
                histories[i] += list(tokens) + added[turn][i]
        return outputs
    return run


def assert_nothing_held(engine):
    assert engine.allocator.num_used_pages == 0 and not engine.has_unfinished()
    assert engine.offload.tiers.host.num_pending == 0 and not engine.offload.tiers.host._pins
    assert not engine.runner.kv_store._pending


@pytest.mark.parametrize("cache, extra", [
    ("auto", {}),
    ("int8", {}),
    ("fp8", {}),
    ("auto", {"kv_offloading_size": 10 * PAGE_BYTES / 2**30, "kv_offloading_disk_size": 1e-3}),  # disk under 10 pages
])
def test_conversations_evicted_between_turns_get_the_tokens_recomputing_gives(params, cache, extra, tmp_path):
    seed = 3
    run = conversations(seed)
    # 29 usable pages of 8 tokens: two or three of the six conversations, so every turn finds its
    # conversation's pages evicted from the device.
    baseline = make_engine(params, num_pages=30, kv_cache_dtype=cache, enable_prefix_caching=False)
    settings = {"kv_offloading_size": 0.01, **extra}
    if "kv_offloading_disk_size" in extra:
        settings["kv_offloading_disk_path"] = str(tmp_path / "tier")
    offloading = make_engine(params, num_pages=30, kv_cache_dtype=cache, **settings)
    assert run(offloading) == run(baseline), f"seed {seed}"
    stats = offloading.stats()
    restored = stats.kv_offload_host_hit_tokens + stats.kv_offload_disk_hit_tokens
    assert restored > 0 and stats.prefix_cache_hit_tokens < restored, f"seed {seed}"
    assert offloading.num_computed_tokens < baseline.num_computed_tokens - restored // 2
    page_bytes = offloading.offload.page_bytes
    assert stats.kv_offload_bytes_to_device == restored // 8 * page_bytes
    assert stats.kv_offload_bytes_to_host == offloading.offload.tiers.counters.saved_pages * page_bytes > 0
    if "kv_offloading_disk_path" in settings:
        assert stats.kv_offload_disk_hit_tokens > 0 and stats.kv_offload_bytes_to_disk > 0
        assert stats.kv_offload_disk_pages_total == int(1e-3 * 2**30) // page_bytes
        assert list((tmp_path / "tier").iterdir()) == []  # the mapped files are unlinked
    assert_nothing_held(offloading)


def test_seeded_sampling_is_the_same_with_restored_pages(params):
    seed = 4
    run = conversations(seed, num=5)
    baseline = make_engine(params, num_pages=30, enable_prefix_caching=False)
    offloading = make_engine(params, num_pages=30, kv_offloading_size=0.01)
    assert run(offloading, SEEDED) == run(baseline, SEEDED), f"seed {seed}"
    assert offloading.stats().kv_offload_host_hit_tokens > 0


def test_a_host_tier_too_small_to_keep_up_drops_pages_and_changes_no_token(params):
    seed = 5
    run = conversations(seed)
    baseline = make_engine(params, num_pages=30, enable_prefix_caching=False)
    # Two blocks: a step that evicts more pages finds them pending and drops the rest.
    offloading = make_engine(params, num_pages=30, kv_offloading_size=2 * PAGE_BYTES / 2**30)
    assert run(offloading) == run(baseline), f"seed {seed}"
    assert offloading.stats().kv_offload_dropped_pages > 0 and offloading.offload.tiers.host.num_used == 2
    assert_nothing_held(offloading)


def test_failed_copies_fail_only_the_steps_requests_and_forget_what_they_restored(params, monkeypatch, caplog):
    seed = 6
    run = conversations(seed, turns=2)
    engine = make_engine(params, num_pages=30, kv_offloading_size=0.01)
    expected = run(make_engine(params, num_pages=30, enable_prefix_caching=False))
    assert run(engine) == expected
    start = engine.runner.kv_store.start
    calls = {"n": 0}

    def failing_start(kv_cache, transfers):
        calls["n"] += 1
        if transfers.restores and calls["n"] < 100:
            raise RuntimeError("injected transfer failure")
        return start(kv_cache, transfers)
    monkeypatch.setattr(engine.runner.kv_store, "start", failing_start)
    first = np.random.default_rng(seed).integers(3, TINY.vocab_size, 60).tolist()  # conversation 0's start
    history = first + list(expected[0]) + [5] * 20
    failed = engine.generate([history], GREEDY)[0]
    assert failed.finish_reason == "error" and "injected transfer failure" in caplog.text
    assert engine.allocator.num_used_pages == 0
    monkeypatch.setattr(engine.runner.kv_store, "start", start)  # the engine goes on
    again = engine.generate([history], GREEDY)[0]
    reference = make_engine(params, num_pages=30, enable_prefix_caching=False).generate([history], GREEDY)[0]
    assert again.token_ids == reference.token_ids
    assert_nothing_held(engine)


def test_a_request_aborted_after_its_pages_were_restored_leaves_nothing_held(params):
    seed = 8
    rng = np.random.default_rng(seed)
    engine = make_engine(params, num_pages=30, kv_offloading_size=0.01, max_num_batched_tokens=16)
    prompt = rng.integers(3, TINY.vocab_size, 96).tolist()
    engine.generate([prompt], GREEDY)
    engine.generate([rng.integers(3, TINY.vocab_size, 200).tolist()], GREEDY)  # evicts the first prompt
    engine.add_request("again", prompt + [7] * 40, GREEDY)
    engine.step()  # restores the prompt's pages and computes one chunk of the rest
    assert engine.offload.tiers.counters.host_hit_pages >= 10
    engine.abort("again")
    assert_nothing_held(engine)


def test_a_disk_tier_that_cannot_be_made_is_refused_naming_the_flag(params, tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    with pytest.raises(ValueError, match="--kv_offloading_disk_path=.*cannot keep the disk tier there"):
        make_engine(params, kv_offloading_size=0.01, kv_offloading_disk_path=str(not_a_folder / "tier"))
    with pytest.raises(ValueError, match="--kv_offloading_disk_path=.*only .* GiB is free"):
        make_engine(params, kv_offloading_size=0.01, kv_offloading_disk_path=str(tmp_path), kv_offloading_disk_size=1e6)
    with pytest.raises(ValueError, match="--kv_offloading_size holds no KV page"):
        make_engine(params, kv_offloading_size=1e-9)
    with pytest.raises(ValueError, match="--kv_offloading_size=1e\\+06 GiB is more host memory than is available"):
        make_engine(params, kv_offloading_size=1e6)


@pytest.mark.parametrize("settings, message", [
    ({"kv_offloading_size": 1.0, "kv_offloading_backend": "lmcache"}, "kv_offloading_backend=native"),
    ({"kv_offloading_disk_path": "/tmp/x"}, "needs --kv_offloading_size"),
    ({"kv_offloading_size": 1.0, "enable_prefix_caching": False}, "enable_prefix_caching=false"),
    ({"kv_offloading_size": 0.0}, "--kv_offloading_size must be > 0"),
])
def test_settings_that_cannot_work_are_refused(settings, message):
    with pytest.raises(SettingError, match=message):
        EngineConfig(**settings)


def test_no_compilation_for_the_copies_after_warmup(params):
    run = conversations(9, num=4, turns=2)
    engine = make_engine(params, num_pages=30, kv_offloading_size=0.01, warmup=True, max_num_seqs=2,
                         max_num_batched_tokens=32)
    with recorded_compilations() as events:
        run(engine)
    assert engine.stats().kv_offload_host_hit_tokens > 0
    assert events == []


def test_through_the_server_a_client_gone_after_its_restore_leaves_nothing_held(params):
    """The metrics say it: after a client disconnects from a turn whose history was restored, no
    page is held, the host tier still holds the conversation, and the engine serves on."""
    import requests

    from checkpoints import default_model, load
    from jaxserve.engine import Engine
    from jaxserve.models import weights
    from tests.test_server_engine import LiveServer

    tokenizer = load.load_tokenizer(default_model.resolve_model("smollm2"))
    config = dataclasses.replace(TINY, vocab_size=len(tokenizer), eos_token_ids=(tokenizer.eos_token_id,))
    engine = Engine(config, weights.random_params(config, seed=3), tokenizer, EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=16, page_size=8, num_pages=30, max_model_len=256, warmup=False,
        kv_offloading_size=0.01), model_name="tiny")
    live = LiveServer(engine)
    try:
        rng = np.random.default_rng(10)
        history = rng.integers(3, TINY.vocab_size, 100).tolist()

        def complete(prompt, max_tokens=4):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
            return requests.post(live.url + "/v1/completions", json=body, timeout=60).json()
        first = complete(history)
        assert first["usage"]["completion_tokens"] == 4
        complete(rng.integers(3, TINY.vocab_size, 200).tolist())  # evicts the history's pages
        body = {"model": "tiny", "prompt": history + [9] * 30, "max_tokens": 90, "stream": True,
                "temperature": 0.0, "ignore_eos": True}
        with requests.post(live.url + "/v1/completions", json=body, stream=True, timeout=60) as r:
            assert next(line for line in r.iter_lines() if line).startswith(b"data: ")
        assert wait_for(lambda: live.metric("jaxserve_kv_pages_used") == 0)
        # The history's 12 full pages: those the long prompt evicted come back from the host tier.
        restored = live.metric("jaxserve_external_prefix_cache_hits_total")
        assert restored >= 64 and restored + live.metric("jaxserve_prefix_cache_hits_total") >= 96
        assert live.metric("jaxserve_kv_offload_pages_used") >= restored // 8
        assert engine.offload.tiers.host.num_pending == 0 and not engine.offload.tiers.host._pins
        assert complete(history + [9] * 30)["usage"]["completion_tokens"] == 4  # serves on
    finally:
        live.close()


def wait_for(condition, timeout_s=20.0):
    import time
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("cache", ["auto", "int8"])
def test_the_planner_counts_the_tiers_pages_as_the_engine_makes_them(params, cache, tmp_path):
    from jaxserve.planning import memory

    cfg = EngineConfig(page_size=8, num_pages=30, max_model_len=256, kv_cache_dtype=cache, warmup=False,
                       kv_offloading_size=0.003, kv_offloading_disk_path=str(tmp_path), kv_offloading_disk_size=0.002)
    plan = memory.plan_engine(TINY, cfg, device_memory_bytes=8 << 30, on_gpu=False)
    engine = make_engine(params, num_pages=30, kv_cache_dtype=cache, kv_offloading_size=0.003,
                         kv_offloading_disk_path=str(tmp_path), kv_offloading_disk_size=0.002)
    assert plan.kv_offload_host_pages == engine.offload.tiers.host.num_blocks > 0
    assert plan.kv_offload_disk_pages == engine.offload.tiers.disk.num_blocks > 0
    assert plan.kv_offload_host_bytes == int(0.003 * 2**30)

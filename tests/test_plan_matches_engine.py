"""`jaxserve plan` reports the KV pool `jaxserve serve` allocates for the same flags.

Both come from one place: the engine flags' defaults are EngineConfig's, and the page count is
`jaxserve.planning.memory.plan_engine` for plan and for the engine. Each case runs the plan command and
builds the engine the way `serve` does (build_async_engine from the serve flags; warm-up off,
which does not change the pool), on the tiny converted model of tests/conftest.py.
"""
import json

import pytest
from absl import flags

from jaxserve.commands import cli
from jaxserve.commands import engine_flags
from jaxserve.commands import serve as serve_command
from jaxserve.engine import EngineConfig
from jaxserve.planning import memory

pytestmark = pytest.mark.slow  # engines: out of `make test-quick`

NON_DEFAULT = ["--max_num_seqs=8", "--page_size=8", "--max_model_len=128", "--dtype=bfloat16",
               "--kv_cache_dtype=int8"]


def plan(model_dir, argv, capsys) -> dict:
    assert cli.main(["jaxserve", "plan", f"--model={model_dir}", *argv]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def serve_engine(model_dir, argv):
    """The engine `jaxserve serve --model=model_dir *argv` builds (not started, not warmed up)."""
    from jaxserve.async_engine import build_async_engine

    fv = flags.FlagValues()
    serve_command.define_flags(fv)
    fv(["jaxserve serve", f"--model={model_dir}", *argv])
    return build_async_engine(fv.model, **engine_flags.engine_kwargs(fv), warmup=False).engine


def assert_same_pool(planned: dict, engine) -> None:
    assert engine.allocator.num_pages == engine.runner.num_pages == planned["num_pages"]  # null page included
    assert engine.kv_cache_bytes == planned["kv_cache_bytes"]
    assert engine.max_model_len == planned["max_model_len"]
    assert engine.config.max_num_seqs == planned["max_num_seqs"]
    assert engine.config.max_num_batched_tokens == planned["max_num_batched_tokens"]


@pytest.mark.parametrize("argv", [[], NON_DEFAULT], ids=["defaults", "non_default"])
def test_plan_reports_the_pool_serve_allocates(tiny_chat_model_dir, argv, capsys):
    planned = plan(tiny_chat_model_dir, argv, capsys)
    assert_same_pool(planned, serve_engine(tiny_chat_model_dir, argv))
    if not argv:  # the defaults are EngineConfig's; on the CPU the pool is capped at what they can use
        defaults = EngineConfig()
        assert planned["max_num_seqs"] == defaults.max_num_seqs
        assert planned["max_num_batched_tokens"] == defaults.max_num_batched_tokens
        assert planned["max_model_len"] == 256  # the tiny model's context, under the 2048 default
        assert planned["num_pages"] == defaults.max_num_seqs * 256 // defaults.page_size + 1
    else:
        # bfloat16 weights on the CPU: float32 activations (jaxserve.models.cpu_layout.bfloat16_views)
        assert planned["kv_cache_dtype"] == "int8" and planned["weight_dtype"] == "bfloat16"
        assert planned["compute_dtype"] == "float32"
        assert planned["num_pages"] == 8 * 128 // 8 + 1


@pytest.mark.parametrize("argv", [["--memory_utilization=0.8"], ["--quantization=int8"],
                                  ["--quantization=int4", "--quantize_embedding"], ["--speculative_method=draft"]])
def test_plan_matches_serve_when_memory_decides(tiny_chat_model_dir, argv, capsys, monkeypatch):
    """A budget too small for the CPU cap: the page count is what fits, the same in both (with a
    draft model, the model as its own draft: its weights and its cache of every page counted too)."""
    if argv == ["--speculative_method=draft"]:
        argv = [*argv, f"--speculative_model={tiny_chat_model_dir}"]
    roomy = plan(tiny_chat_model_dir, [*argv, "--device_memory_gb=64"], capsys)
    draft_scratch_bytes = roomy["draft_kv_cache_bytes"] - roomy["num_pages"] * roomy["draft_kv_bytes_per_page"]
    needed = (roomy["weights_bytes"] + roomy["draft_weights_bytes"] + draft_scratch_bytes + roomy["activation_bytes"]
              + 256 * memory.MiB)  # the minimum reserve
    utilization = roomy["memory_utilization"]
    per_page = roomy["kv_bytes_per_page"] + roomy["draft_kv_bytes_per_page"]
    budget = int((needed + 100 * per_page) / utilization) + 1
    monkeypatch.setattr(memory, "device_memory_budget_bytes", lambda device=None: budget)
    planned = plan(tiny_chat_model_dir, argv, capsys)
    assert planned["device_memory_bytes"] == budget
    assert 90 < planned["num_pages"] < roomy["num_pages"]  # memory decided, not the cap
    if "--speculative_method=draft" in argv:  # the model is its own draft: the same bytes again
        # (the target's bytes as loaded, a float32 model's strips of its tied lm_head in them; the draft's estimated)
        assert planned["draft_weights_bytes"] == pytest.approx(planned["weights_bytes"], rel=0.01)
        assert planned["draft_kv_bytes_per_page"] == planned["kv_bytes_per_page"]
    assert_same_pool(planned, serve_engine(tiny_chat_model_dir, argv))

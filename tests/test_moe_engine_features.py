"""What else meets a mixture-of-experts model in the engine: prefix caching, n-gram speculative
decoding and multi-step decoding give a tiny Qwen2-MoE (routed experts and a gated shared expert)
the greedy tokens of the plain engine, as they do a dense model."""
from __future__ import annotations

import numpy as np
import pytest

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core.request import SamplingParams
from jaxserve.engine import Engine
from jaxserve.models import weights

SEED = 11
MOE = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_layers=2, num_q_heads=4, num_kv_heads=2,
                  head_dim=8, max_position_embeddings=256, eos_token_ids=(2,), architecture="Qwen2MoeForCausalLM",
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=False,
                  shared_expert_intermediate_size=24)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=8, num_pages=48, max_model_len=128,
              warmup=False)


@pytest.fixture(scope="module")
def params():
    return weights.random_params(MOE, seed=SEED)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(SEED)
    prefix = rng.integers(3, MOE.vocab_size, 24).tolist()  # shared: the second request finds it cached
    repeated = rng.integers(3, MOE.vocab_size, 6).tolist() * 4  # repeats: n-gram proposals to verify
    return [prefix + rng.integers(3, MOE.vocab_size, 5).tolist(), prefix + rng.integers(3, MOE.vocab_size, 7).tolist(),
            repeated]


def run(params, prompts, **overrides):
    engine = Engine(MOE, params, None, EngineConfig(**{**ENGINE, **overrides}))
    return [engine.generate([p], GREEDY)[0].token_ids for p in prompts], engine.stats()


@pytest.fixture(scope="module")
def reference(params, prompts):
    tokens, _ = run(params, prompts, enable_prefix_caching=False)
    return tokens


def test_prefix_caching_keeps_the_tokens(params, prompts, reference):
    tokens, stats = run(params, prompts, enable_prefix_caching=True)
    assert tokens == reference, f"seed {SEED}"
    assert stats.prefix_cache_hit_tokens >= 16  # the second prompt's two full pages of the prefix


def test_ngram_speculation_keeps_the_tokens(params, prompts, reference):
    tokens, stats = run(params, prompts, enable_prefix_caching=False, speculative_method="ngram",
                        num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3)
    assert tokens == reference, f"seed {SEED}"
    assert stats.spec_verify_steps > 0 and stats.spec_proposed_tokens > 0


def test_multi_step_decoding_keeps_the_tokens(params, prompts, reference):
    tokens, _ = run(params, prompts, enable_prefix_caching=False, num_scheduler_steps=4)
    assert tokens == reference, f"seed {SEED}"

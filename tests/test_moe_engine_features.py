"""What else meets a mixture-of-experts model in the engine: prefix caching, n-gram speculative
decoding and multi-step decoding give a tiny Qwen2-MoE (routed experts and a gated shared expert)
the greedy tokens of the plain engine, as they do a dense model; structured output (a JSON schema,
a regex) gives a tiny Qwen2-MoE with SmolLM2's tokenizer transformers' greedy tokens under the
grammar's masks, step by step."""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core.request import SamplingParams
from jaxserve.core.structured_output import StructuredOutputParams
from jaxserve.engine import Engine
from jaxserve.models import weights
from tests.test_moe import make_moe_model
from tests.test_structured_output import REGEXES, SCHEMAS
from tests.tiny_models import copy_smollm2_tokenizer, hf_logits

pytestmark = pytest.mark.slow  # engines: out of `make test-quick`

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


# ---- structured output -------------------------------------------------------------------------
CONSTRAINED = [("json_schema", SCHEMAS["enums, integer bounds, booleans"], "guided_json"),
               ("regex", REGEXES[0], "guided_regex")]


@pytest.fixture(scope="module")
def moe_with_tokenizer(tmp_path_factory):
    """(a transformers Qwen2-MoE with SmolLM2's vocabulary, an Engine on its conversion)."""
    from checkpoints.convert import convert_checkpoint
    hf_dir = str(tmp_path_factory.mktemp("moe_tok_hf"))
    model = make_moe_model(hf_dir, "qwen2_moe", vocab_size=49152)
    copy_smollm2_tokenizer(hf_dir)
    converted = str(tmp_path_factory.mktemp("moe_tok") / "model")
    convert_checkpoint(hf_dir, converted)
    return model, Engine.from_model(converted, EngineConfig(**{**ENGINE, "max_model_len": 160}))


def masked_greedy_reference(model, engine, prompt: list[int], constraint, max_tokens: int) -> list[int]:
    """Greedy over transformers' logits step by step, each step's argmax taken over the tokens
    the constraint's grammar allows there (the engine's host-side grammar state, advanced by each
    chosen token); ends at an end-of-sequence token or after `max_tokens`."""
    state = engine.grammar_compiler.new_state(constraint)
    ids, out = list(prompt), []
    words = np.zeros(engine.grammar_compiler.num_words, np.int32)
    while len(out) < max_tokens:
        logits = hf_logits(model, np.asarray([ids]))[0, -1]  # [V]
        state.fill_bitmask(words)
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:logits.shape[0]].astype(bool)  # [V]
        token = int(np.argmax(np.where(allowed, logits, -np.inf)))
        out.append(token)
        assert state.accept(token)
        if token in engine.eos_token_ids:
            break
        ids.append(token)
    return out


@pytest.mark.parametrize("kind, spec, param", CONSTRAINED, ids=[c[0] for c in CONSTRAINED])
def test_structured_output_gives_the_grammar_masked_greedy_tokens_of_transformers(moe_with_tokenizer, kind, spec,
                                                                                 param):
    """A JSON schema / a regex on the tiny MoE model: the output is complete and valid, and its
    tokens are transformers' greedy ones under the same grammar's masks."""
    model, engine = moe_with_tokenizer
    prompt = engine.tokenizer.encode("Answer in the requested format:")
    constraint = StructuredOutputParams(kind, spec, param)
    result = engine.generate([prompt], SamplingParams(max_tokens=64, temperature=0.0,
                                                      structured_output=constraint))[0]
    assert result.finish_reason == "stop", result.text
    if kind == "json_schema":
        jsonschema.validate(json.loads(result.text), spec)
    else:
        assert re.fullmatch(spec, result.text, re.ASCII), result.text
    expected = masked_greedy_reference(model, engine, prompt, StructuredOutputParams(kind, spec, param), 64)
    assert result.token_ids == expected, (result.text, engine.tokenizer.decode(expected))

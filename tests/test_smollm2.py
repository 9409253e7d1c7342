"""The real default model: SmolLM2-135M-Instruct from its GGUF, against transformers."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import default_model, load
from jaxserve.core.request import SamplingParams
from jaxserve.engine import Engine, EngineConfig
from jaxserve.models import llama
from serve.prompts import encode_chat
from tests.tiny_models import hf_logits, prefill_batch

pytestmark = pytest.mark.slow  # SmolLM2 against transformers: out of `make test-quick`

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers.", "Explain what a KV cache is in one sentence.",
             "Say hello in Spanish."]


@pytest.fixture(scope="module")
def model_dir():
    return default_model.resolve_model("smollm2")


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM
    gguf = default_model.smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                 torch_dtype="float32")
    return model.eval()


@pytest.fixture(scope="module")
def engine(model_dir):
    config = load.load_config(model_dir)
    params = load.load_params(model_dir, jnp.float32)
    return Engine(config, params, load.load_tokenizer(model_dir),
                  EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, num_pages=160,
                               max_model_len=512, warmup=False))


def chat_ids(engine, question):
    return encode_chat(engine.tokenizer, [{"role": "user", "content": question}])


def test_logits_at_every_position_match_transformers(engine, hf_model):
    ids = chat_ids(engine, QUESTIONS[0])
    seed = 0
    rng = np.random.default_rng(seed)
    batch, _, num_pages = prefill_batch([len(ids)], 16, 8, 1, rng)
    batch["token_ids"] = np.asarray(ids, np.int32)
    config = engine.model_config
    cache = llama.init_kv_cache(config, llama.KVCacheSpec(num_pages, 16), jnp.float32)
    logits, _ = jax.jit(lambda p, c, b: llama.forward(p, c, b, config=config))(
        engine.runner.params, cache, batch)
    expected = hf_logits(hf_model, np.asarray([ids]))[0]
    np.testing.assert_allclose(np.asarray(logits), expected, rtol=1e-3, atol=1e-3 * np.abs(expected).max(),
                               err_msg=f"seed {seed}")


def test_greedy_32_tokens_equal_transformers(engine, hf_model):
    import torch
    ids = chat_ids(engine, QUESTIONS[1])
    with torch.no_grad():
        hf_out = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
    expected = hf_out[0, len(ids):].tolist()
    got = engine.generate([ids], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0]
    assert got.token_ids == expected


def test_batch_invariance_on_smollm2(engine):
    prompts = [chat_ids(engine, q) for q in QUESTIONS]
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    alone = [engine.generate([p], greedy)[0].token_ids for p in prompts]
    outputs = {i: [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending:  # one arrival per step, so prefills land in the middle of others' decodes
            i, p = pending.pop(0)
            engine.add_request(f"s{i}", p, greedy)
        for out in engine.step():
            outputs[int(out.request_id[1:])].extend(out.new_token_ids)
    assert [outputs[i] for i in range(len(prompts))] == alone
    assert engine.allocator.num_used_pages == 0


def test_chat_completion_text(engine):
    out = engine.generate([chat_ids(engine, QUESTIONS[0])], SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"

"""Embeddings and classifier scores from jaxserve's model functions against transformers (float32).

Tiny random Llama, Qwen2 and Qwen3 decoders published the sentence-transformers way (the bare
`XModel` that sentence-transformers saves, `modules.json`, `1_Pooling/config.json`, `2_Normalize`;
and Qwen3-Embedding's way, a `Qwen3ForCausalLM` config over the bare tensors), converted by
jaxserve; their hidden states computed by `jaxserve.models.llama.forward` (the CPU's XLA path),
pooled by `jaxserve.pooling.poolers`, combined and finished by `jaxserve.pooling.accumulate`, must
equal transformers' pooled, normalized `last_hidden_state` (cosine >= 0.99999), whole prompts in
one step and prompts prefilled in chunks over several steps. Tiny random
`LlamaForSequenceClassification` and `Qwen3ForSequenceClassification` checkpoints give
transformers' scores through the score head kept at conversion.
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import ConversionError
from checkpoints.convert import convert_checkpoint
from checkpoints.load import load_config, load_params
from checkpoints.pooling_checkpoint import load_score_head
from jaxserve.models import llama
from jaxserve.pooling import poolers
from jaxserve.pooling.accumulate import PooledPrompt, finish_embedding
from jaxserve.pooling.config import resolve_pooler

pytestmark = pytest.mark.slow  # models against transformers, conversions and compiles: out of `make test-quick`

SEED = 5151
PAGE_SIZE, MAX_PAGES = 4, 8
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {"llama": ("LlamaConfig", "Llama"), "qwen2": ("Qwen2Config", "Qwen2"), "qwen3": ("Qwen3Config", "Qwen3")}
ST_MODES = {"LAST": "pooling_mode_lasttoken", "MEAN": "pooling_mode_mean_tokens", "CLS": "pooling_mode_cls_token"}


def tiny_model(family: str, head: str, seed: int = SEED, **fields):
    """A random transformers model of `family` with `head` ("Model", "ForSequenceClassification"),
    its norms and biases nonzero so that a missing one shows."""
    import torch
    import transformers
    config_cls, prefix = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**BASE, **fields})
    torch.manual_seed(seed)
    model = getattr(transformers, prefix + head)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def write_json(path: str, data) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f)


def publish_sentence_transformers(folder: str, model, pooling_type: str, normalize: bool,
                                  extra_modules=()) -> None:
    """Saves `model` as sentence-transformers saves a decoder: the bare model, modules.json,
    the Pooling config, a Normalize module."""
    model.save_pretrained(folder, safe_serialization=True)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(folder, "2_Normalize"), exist_ok=True)
    write_json(os.path.join(folder, "modules.json"), modules + list(extra_modules))
    pooling = {name: False for name in ST_MODES.values()}
    pooling.update({ST_MODES[pooling_type]: True, "word_embedding_dimension": model.config.hidden_size,
                    "include_prompt": True})
    write_json(os.path.join(folder, "1_Pooling", "config.json"), pooling)


def reference_embedding(model, ids: np.ndarray, pooling_type: str, normalize: bool) -> np.ndarray:
    """sentence-transformers' embedding of one prompt, from transformers' last_hidden_state."""
    import torch
    with torch.no_grad():
        hidden = model(torch.as_tensor(ids[None], dtype=torch.long)).last_hidden_state[0]  # [N, D]
        pooled = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]
        if normalize:
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
        return pooled.numpy()


def prefill_step(chunks):
    """One step's prefill batch: chunks (token ids of the whole prompt, start, end, its pages [MAX_PAGES])."""
    token_ids, positions, slots, starts = [], [], [], [0]
    for ids, start, end, pages in chunks:
        pos = np.arange(start, end)
        token_ids.append(ids[start:end])
        positions.append(pos)
        slots.append(pages[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE)
        starts.append(starts[-1] + end - start)
    batch = dict(token_ids=np.concatenate(token_ids), positions=np.concatenate(positions),
                 slot_mapping=np.concatenate(slots), decode_block_table=np.zeros((0, MAX_PAGES)),
                 decode_seq_lens=np.zeros(0), prefill_block_table=np.stack([c[3] for c in chunks]),
                 prefill_seq_lens=np.asarray([c[2] for c in chunks]), prefill_query_start_loc=np.asarray(starts),
                 logits_indices=np.asarray(starts[1:]) - 1)
    return {k: jnp.asarray(v, jnp.int32) for k, v in batch.items()}


def jaxserve_pooled(converted: str, prompts: list[np.ndarray], chunk_plan: list[list[int]], pooling_type: str,
                    score_head=None, activation: str = "identity") -> list[np.ndarray]:
    """Each prompt prefilled in the chunks its `chunk_plan` row gives (chunk ends), the prompts'
    chunks batched step by step; pooled per chunk on device, combined per prompt on the host."""
    config = load_config(converted)
    params = load_params(converted, jnp.float32)
    num_pages = 1 + len(prompts) * MAX_PAGES
    kv = llama.init_kv_cache(config, llama.KVCacheSpec(num_pages=num_pages, page_size=PAGE_SIZE), jnp.float32)
    pages = [1 + i * MAX_PAGES + np.arange(MAX_PAGES) for i in range(len(prompts))]
    pooled = [PooledPrompt("LAST" if score_head is not None else pooling_type, len(ids)) for ids in prompts]

    @jax.jit
    def step(params, kv, batch):
        rows = batch["token_ids"].shape[0]
        _, kv, hidden = llama.forward(params, kv, batch, config=config, backend="xla", prefill_hidden_rows=rows)
        normed = poolers.final_hidden(params, hidden, config)  # [T, D]
        if score_head is None:
            return poolers.chunk_partials(normed, batch["prefill_query_start_loc"], pooling_type), kv
        last = poolers.chunk_partials(normed, batch["prefill_query_start_loc"], "LAST")
        return poolers.classify(last, score_head, activation), kv

    for step_index in range(max(len(plan) for plan in chunk_plan)):
        chunks, owners = [], []
        for i, plan in enumerate(chunk_plan):
            if step_index < len(plan):
                start = plan[step_index - 1] if step_index else 0
                chunks.append((prompts[i], start, plan[step_index], pages[i]))
                owners.append(i)
        partials, kv = step(params, kv, prefill_step(chunks))
        for row, (i, (_, start, end, _)) in enumerate(zip(owners, chunks)):
            pooled[i].add(np.asarray(partials[row]), start, end - start)
    return [p.pooled() for p in pooled]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "qwen3-causal-config"])
def st_model(request, tmp_path_factory):
    """(name, torch base model, Hugging Face folder, converted directory) for each pooling type."""
    family = request.param.split("-")[0]
    model = tiny_model(family, "Model")
    built = {}
    for pooling_type, normalize in (("LAST", True), ("MEAN", True), ("CLS", False)):
        root = tmp_path_factory.mktemp(f"{request.param}_{pooling_type}")
        hf_dir = str(root / "hf")
        publish_sentence_transformers(hf_dir, model, pooling_type, normalize)
        if request.param.endswith("causal-config"):  # Qwen3-Embedding: a causal config over the bare tensors
            config_path = os.path.join(hf_dir, "config.json")
            config = json.load(open(config_path))
            write_json(config_path, {**config, "architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": True})
        convert_checkpoint(hf_dir, str(root / "converted"))
        built[pooling_type] = (normalize, hf_dir, str(root / "converted"))
    return request.param, model, built


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_embeddings_equal_transformers_pooled_hidden_states(st_model, pooling_type):
    name, model, built = st_model
    normalize, hf_dir, converted = built[pooling_type]
    hidden = load_config(converted).hidden_size
    pooler = resolve_pooler(converted, hidden)
    assert pooler == resolve_pooler(hf_dir, hidden)
    assert (pooler.pooling_type, pooler.normalize) == (pooling_type, normalize)
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(3, BASE["vocab_size"], n) for n in (13, 5, 1, 22)]
    whole = [[len(p)] for p in prompts]
    chunked = [[4, 9, 13], [5], [1], [3, 4, 11, 22]]  # several chunks, over steps shared with other prompts
    for plan in (whole, chunked):
        pooled = jaxserve_pooled(converted, prompts, plan, pooler.pooling_type)
        for ids, vector, chunks in zip(prompts, pooled, plan):
            got = finish_embedding(vector, pooler.normalize)
            expected = reference_embedding(model, ids, pooling_type, normalize)
            cosine = got @ expected / (np.linalg.norm(got) * np.linalg.norm(expected))
            message = f"{name} {pooling_type}, {len(ids)} tokens in chunks ending {chunks}, seed {SEED}"
            assert cosine >= 0.99999, message
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5, err_msg=message)


def test_matryoshka_dimensions_are_the_first_values_renormalized(st_model):
    name, model, built = st_model
    _, _, converted = built["LAST"]
    ids = np.random.default_rng(SEED).integers(3, BASE["vocab_size"], 9)
    [vector] = jaxserve_pooled(converted, [ids], [[4, 9]], "LAST")
    expected = reference_embedding(model, ids, "LAST", normalize=False)[:16]
    expected /= np.linalg.norm(expected)
    np.testing.assert_allclose(finish_embedding(vector, True, 16), expected, rtol=1e-4, atol=1e-5,
                               err_msg=f"{name}, seed {SEED}")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("num_labels", [1, 3])
def test_a_sequence_classifier_gives_transformers_scores(tmp_path, family, num_labels):
    import torch
    model = tiny_model(family, "ForSequenceClassification", num_labels=num_labels)
    with torch.no_grad():  # transformers starts the head small: scale it so scores spread over (0, 1)
        model.score.weight.mul_(10.0)
    model.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    convert_checkpoint(str(tmp_path / "hf"), str(tmp_path / "converted"))
    converted = str(tmp_path / "converted")
    pooler = resolve_pooler(converted, BASE["hidden_size"])
    assert pooler.classifier.num_labels == num_labels
    assert pooler.classifier.activation == ("sigmoid" if num_labels == 1 else "softmax")
    head = jnp.asarray(load_score_head(converted))
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(3, BASE["vocab_size"], n) for n in (7, 12, 2)]
    got = jaxserve_pooled(converted, prompts, [[3, 7], [12], [1, 2]], "LAST", head, pooler.classifier.activation)
    raw = jaxserve_pooled(converted, prompts, [[7], [5, 12], [2]], "LAST", head, "identity")
    for ids, scores, logits in zip(prompts, got, raw):
        with torch.no_grad():
            expected = model(torch.as_tensor(ids[None], dtype=torch.long)).logits[0]  # [num_labels]
        activated = torch.sigmoid(expected) if num_labels == 1 else torch.softmax(expected, -1)
        message = f"{family}, {num_labels} labels, {len(ids)} tokens, seed {SEED}"
        np.testing.assert_allclose(logits, expected.numpy(), rtol=1e-4, atol=1e-5, err_msg=message)
        np.testing.assert_allclose(scores, activated.numpy(), rtol=1e-4, atol=1e-6, err_msg=message)
    assert len({round(float(s[0]), 4) for s in got}) == len(prompts)  # scores that differ, so order means something


def test_chunk_partials_leave_padding_out():
    rng = np.random.default_rng(SEED)
    hidden = jnp.asarray(rng.standard_normal((10, 3)), jnp.float32)  # 7 rows of chunks, 3 rows of padding
    starts = jnp.asarray([0, 3, 3, 7], jnp.int32)  # chunks [0, 3), [3, 3) (empty), [3, 7)
    h = np.asarray(hidden)
    np.testing.assert_allclose(poolers.chunk_partials(hidden, starts, "MEAN"),
                               [h[:3].sum(0), np.zeros(3), h[3:7].sum(0)], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(poolers.chunk_partials(hidden, starts, "LAST"), [h[2], np.zeros(3), h[6]])
    np.testing.assert_allclose(poolers.chunk_partials(hidden, starts, "CLS"), [h[0], np.zeros(3), h[3]])


def test_unservable_pooling_checkpoints_are_refused_at_conversion(tmp_path):
    model = tiny_model("llama", "Model")
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    publish_sentence_transformers(str(tmp_path / "dense"), model, "MEAN", True, extra_modules=[dense])
    with pytest.raises(ConversionError, match="3_Dense"):
        convert_checkpoint(str(tmp_path / "dense"), str(tmp_path / "out1"))
    publish_sentence_transformers(str(tmp_path / "bert"), model, "MEAN", True)
    config_path = str(tmp_path / "bert" / "config.json")
    write_json(config_path, {**json.load(open(config_path)), "architectures": ["BertModel"]})
    with pytest.raises(ConversionError, match="unsupported architecture 'BertModel'"):
        convert_checkpoint(str(tmp_path / "bert"), str(tmp_path / "out2"))
    assert not os.path.exists(tmp_path / "out1") and not os.path.exists(tmp_path / "out2")


QWEN3_RERANKER_PROMPT = (  # the prompt Qwen publishes for Qwen3-Reranker, with its default instruction
    '<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct '
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n<Instruct>: Given a web '
    'search query, retrieve relevant passages that answer the query\n<Query>: {query}\n<Document>: {document}'
    '<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n')


def test_a_query_and_document_pair_as_one_prompt():
    """With the Qwen3-Reranker score template: Qwen's published prompt, encoded without extra special
    tokens; without a template: the tokenizer's pair encoding (SmolLM2's: the two texts' tokens)."""
    from transformers import AutoTokenizer

    from checkpoints.default_model import resolve_model
    from serve.pair_prompts import encode_pair, pair_text
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "examples", "qwen3_reranker_score_template.jinja")) as f:
        template = f.read()
    query, document = "What is JAX?", "JAX is a library for array computing."
    expected = QWEN3_RERANKER_PROMPT.format(query=query, document=document)
    assert pair_text(tokenizer, query, document, template) == expected
    expected_ids = tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert encode_pair(tokenizer, query, document, template) == expected_ids
    ids = lambda text: tokenizer(text)["input_ids"]
    assert encode_pair(tokenizer, query, document) == ids(query) + ids(document)

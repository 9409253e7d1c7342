"""The pooling runner end to end: embeddings, scores, reranking and classes through the server.

Tiny random Qwen3 and Llama decoders published the sentence-transformers way (last-token and mean
pooling, normalized; SmolLM2's tokenizer) are served with --runner=pooling: /v1/embeddings must
equal transformers' pooled, normalized `last_hidden_state` (cosine >= 0.99999) for text and
token-id inputs, in requests sent together with other embedding, score and rerank requests;
/score and /rerank must give the cosines of the embeddings, the documents in their order; the
official `openai` client's embeddings.create works unchanged. Tiny random
Qwen3ForSequenceClassification (one label) and LlamaForSequenceClassification (three labels) give
transformers' activated scores through /score, /rerank and /classify. Bad input is a 400 naming
its field, and the server serves the next request at once; each runner refuses the other's routes.
"""
import concurrent.futures
import os

import numpy as np
import pytest
import requests

from checkpoints.convert import convert_checkpoint
from jaxserve.config import EngineConfig
from jaxserve.engine import Engine
from serve.app import ServerConfig
from tests.test_pooling_models import publish_sentence_transformers, reference_embedding, tiny_model
from tests.test_server_engine import LiveServer
from tests.tiny_models import copy_smollm2_tokenizer

pytestmark = pytest.mark.slow  # engines, servers and transformers references

SEED = 5353
VOCAB = 49152  # SmolLM2's tokenizer
ENGINE = dict(runner="pooling", max_num_seqs=8, max_num_batched_tokens=64, page_size=8, num_pages=160,
              max_model_len=128)
TEXTS = ["The capital of France is Paris.", "JAX compiles numerical programs with XLA.",
         "A reranker orders documents by relevance.", "Paris is in France.", "hi"]
EMBEDDERS = {"qwen3": "LAST", "llama": "MEAN"}  # family -> its sentence-transformers pooling
CLASSIFIERS = {"qwen3": 1, "llama": 3}  # family -> num_labels


def build(root, family: str, head: str, **fields) -> tuple[object, str]:
    model = tiny_model(family, head, seed=SEED, vocab_size=VOCAB, **fields)
    hf_dir = str(root / "hf")
    if head == "Model":
        publish_sentence_transformers(hf_dir, model, EMBEDDERS[family], normalize=True)
    else:
        model.save_pretrained(hf_dir, safe_serialization=True)
    copy_smollm2_tokenizer(hf_dir)
    convert_checkpoint(hf_dir, str(root / "converted"))
    return model, str(root / "converted")


@pytest.fixture(scope="module", params=sorted(EMBEDDERS))
def embedder(request, tmp_path_factory):
    """(family, torch model, live pooling server, converted directory) of an embedding model."""
    model, converted = build(tmp_path_factory.mktemp(f"embed_{request.param}"), request.param, "Model")
    live = LiveServer(Engine.from_model(converted, EngineConfig(**ENGINE)), ServerConfig(drain_timeout_s=2.0))
    yield request.param, model, live, converted
    live.close()


def post(server, path: str, body: dict) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=120)


def expected_embedding(family: str, model, ids) -> np.ndarray:
    return reference_embedding(model, np.asarray(ids), EMBEDDERS[family], normalize=True)


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_embeddings_equal_transformers_for_text_and_token_ids_beside_other_requests(embedder):
    family, model, server, _ = embedder
    tokenizer = server.async_engine.tokenizer
    rng = np.random.default_rng(SEED)
    id_inputs = [[int(t) for t in rng.integers(3, VOCAB, n)] for n in (1, 7, 40, 128)]  # 128: the whole context
    bodies = [{"input": TEXTS}, {"input": id_inputs}, {"input": TEXTS[0]}, {"input": id_inputs[2]}]
    others = [("/score", {"text_1": TEXTS[0], "text_2": TEXTS[1:]}),
              ("/v1/rerank", {"query": TEXTS[3], "documents": TEXTS[:3]})] * 2
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(post, server, "/v1/embeddings", body) for body in bodies]
        futures += [pool.submit(post, server, path, body) for path, body in others]
        responses = [f.result() for f in futures]
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    expected_inputs = [[tokenizer(t)["input_ids"] for t in TEXTS], id_inputs, [tokenizer(TEXTS[0])["input_ids"]],
                       [id_inputs[2]]]
    for body, response, inputs in zip(bodies, responses, expected_inputs):
        data = response.json()
        assert [d["index"] for d in data["data"]] == list(range(len(inputs)))
        assert data["usage"]["prompt_tokens"] == sum(map(len, inputs))
        for ids, item in zip(inputs, data["data"]):
            got = np.asarray(item["embedding"])
            assert got.shape == (model.config.hidden_size,)
            assert cosine(got, expected_embedding(family, model, ids)) >= 0.99999, \
                f"{family}, {len(ids)} tokens, seed {SEED}"
            assert abs(np.linalg.norm(got) - 1.0) < 1e-5


def test_scores_and_rerank_order_are_the_embeddings_cosines(embedder):
    family, model, server, _ = embedder
    tokenizer = server.async_engine.tokenizer
    vectors = {t: expected_embedding(family, model, tokenizer(t)["input_ids"]) for t in TEXTS}
    query, documents = TEXTS[3], TEXTS[:3] + TEXTS[4:]
    expected = [cosine(vectors[query], vectors[d]) for d in documents]
    scores = post(server, "/score", {"text_1": query, "text_2": documents}).json()["data"]
    np.testing.assert_allclose([s["score"] for s in scores], expected, atol=1e-5, err_msg=f"{family}, seed {SEED}")
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = post(server, path, {"query": query, "documents": documents, "top_n": 3}).json()
        order = sorted(range(len(documents)), key=lambda i: -expected[i])[:3]
        assert [r["index"] for r in body["results"]] == order, f"{path}, {family}"
        np.testing.assert_allclose([r["relevance_score"] for r in body["results"]],
                                   [expected[i] for i in order], atol=1e-5)
        assert body["results"][0]["document"] == {"text": documents[order[0]]}


def test_the_openai_client_embeds_unchanged(embedder):
    from openai import OpenAI
    family, model, server, _ = embedder
    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    ids = client.embeddings.create(model=server.async_engine.model_name, input=TEXTS[:2])  # base64 by default
    floats = client.embeddings.create(model=server.async_engine.model_name, input=TEXTS[:2], encoding_format="float")
    tokenizer = server.async_engine.tokenizer
    for text, a, b in zip(TEXTS, ids.data, floats.data):
        expected = expected_embedding(family, model, tokenizer(text)["input_ids"])
        assert cosine(a.embedding, expected) >= 0.99999 and cosine(b.embedding, expected) >= 0.99999
    short = client.embeddings.create(model=server.async_engine.model_name, input=TEXTS[0], dimensions=16)
    full = expected_embedding(family, model, tokenizer(TEXTS[0])["input_ids"])  # normalized; the first 16, again
    np.testing.assert_allclose(short.data[0].embedding, full[:16] / np.linalg.norm(full[:16]), atol=1e-5)
    assert ids.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in TEXTS[:2])


def test_bad_input_is_a_400_naming_the_field_and_the_server_goes_on(embedder):
    family, model, server, _ = embedder
    hidden = model.config.hidden_size
    cases = [({"input": []}, "input"), ({"input": [[]]}, "input[0]"), ({"input": list(range(3, 140))}, "input"),
             ({"input": [[1, VOCAB]]}, "input[0]"), ({"input": "x", "dimensions": 0}, "dimensions"),
             ({"input": "x", "dimensions": hidden + 1}, "dimensions"),
             ({"input": ["a"] * 100_000}, "input"), ({"input": "x", "encoding_format": "hex"}, "encoding_format")]
    for body, param in cases:
        response = post(server, "/v1/embeddings", body)
        assert response.status_code == 400, (body if len(str(body)) < 200 else param, response.text)
        assert response.json()["error"]["param"] == param, response.text
    assert post(server, "/classify", {"input": "x"}).status_code == 400  # an embedding model has no classes
    refused = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert refused.status_code == 400 and "--runner" in refused.json()["error"]["message"]
    card = requests.get(server.url + "/v1/models", timeout=30).json()["data"][0]
    assert (card["runner"], card["tasks"]) == ("pooling", ["embed", "score"])
    assert post(server, "/v1/embeddings", {"input": "still here"}).status_code == 200


@pytest.mark.parametrize("family", sorted(CLASSIFIERS))
def test_a_sequence_classifier_gives_transformers_scores(tmp_path, family):
    import torch
    num_labels = CLASSIFIERS[family]
    model, converted = build(tmp_path, family, "ForSequenceClassification", num_labels=num_labels)
    server = LiveServer(Engine.from_model(converted, EngineConfig(**ENGINE)), ServerConfig(drain_timeout_s=2.0))
    try:
        tokenizer = server.async_engine.tokenizer

        def reference(ids):
            with torch.no_grad():
                logits = model(torch.as_tensor([ids])).logits[0].float()
            return (torch.sigmoid(logits) if num_labels == 1 else torch.softmax(logits, -1)).numpy()

        classes = post(server, "/classify", {"input": TEXTS}).json()["data"]
        for text, item in zip(TEXTS, classes):
            np.testing.assert_allclose(item["probs"], reference(tokenizer(text)["input_ids"]), rtol=1e-4, atol=1e-5,
                                       err_msg=f"{family}, seed {SEED}")
        if num_labels == 1:
            pairs = [tokenizer(text=TEXTS[3], text_pair=d)["input_ids"] for d in TEXTS[:3]]
            expected = [float(reference(ids)[0]) for ids in pairs]
            scores = post(server, "/score", {"text_1": TEXTS[3], "text_2": TEXTS[:3]}).json()["data"]
            np.testing.assert_allclose([s["score"] for s in scores], expected, rtol=1e-4, atol=1e-5)
            ranked = post(server, "/rerank", {"query": TEXTS[3], "documents": TEXTS[:3]}).json()["results"]
            assert [r["index"] for r in ranked] == sorted(range(3), key=lambda i: -expected[i])
        else:
            assert post(server, "/score", {"text_1": "a", "text_2": "b"}).status_code == 400
        assert post(server, "/v1/embeddings", {"input": "x"}).status_code == 400
    finally:
        server.close()
    with pytest.raises(Exception, match="--runner=pooling"):  # a classifier has no LM head to generate with
        Engine.from_model(converted, EngineConfig(**{**ENGINE, "runner": "generate"}))


def test_a_generating_server_refuses_the_pooling_routes():
    from tests.test_server import FakeEngine
    from tests.test_server import LiveServer as FakeServer
    server = FakeServer(FakeEngine(), ServerConfig())
    try:
        url = f"http://127.0.0.1:{server.port}"
        for path in ("/v1/embeddings", "/score", "/rerank", "/classify"):
            response = requests.post(url + path, json={"input": "x"}, timeout=30)
            assert response.status_code == 400 and "--runner=pooling" in response.json()["error"]["message"], path
        card = requests.get(url + "/v1/models", timeout=30).json()["data"][0]
        assert card["runner"] == "generate"
    finally:
        server.close()


def test_generate_with_the_pooling_runner_writes_embeddings_as_jsonl(tmp_path, embedder):
    import json

    from jaxserve.commands import cli
    family, model, server, converted = embedder
    tokenizer = server.async_engine.tokenizer
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": text}) + "\n" for i, text in enumerate(TEXTS)))
    assert cli.main(["jaxserve", "generate", f"--model={converted}", f"--input={inp}", f"--output={out}",
                     "--runner=pooling", "--max_model_len=128", "--num_pages=160", "--noprogress"]) == 0
    lines = {line["id"]: line for line in map(json.loads, out.read_text().splitlines())}
    assert sorted(lines) == list(range(len(TEXTS)))
    for i, text in enumerate(TEXTS):
        ids = tokenizer(text)["input_ids"]
        assert lines[i]["num_prompt_tokens"] == len(ids)
        assert cosine(lines[i]["embedding"], expected_embedding(family, model, ids)) >= 0.99999

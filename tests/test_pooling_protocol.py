"""The pooling routes' request validation and response shapes (serve.pooling_protocol). Quick: no model."""
import base64

import numpy as np
import pytest

from serve.pooling_protocol import (EmbeddingRequest, PoolingLimits, RerankRequest, classify_response,
                                    embedding_response, encode_base64, parse_classify_request,
                                    parse_embedding_request, parse_inputs, parse_rerank_request, parse_score_request,
                                    prompt_tokens, rerank_response, score_response)
from serve.protocol import ProtocolError

LIMITS = PoolingLimits(vocab_size=100, hidden_size=32, max_model_len=64, max_inputs_per_request=8)
MODEL = "tiny-embed"
SEED = 7070


def refused(parse, body, param, status=400, limits=LIMITS):
    with pytest.raises(ProtocolError) as raised:
        parse(body, MODEL, limits)
    assert (raised.value.status, raised.value.param) == (status, param), raised.value.message
    return raised.value.message


@pytest.mark.parametrize("value, expected", [
    ("hello", ["hello"]), (["a", "b"], ["a", "b"]), ([5, 6, 7], [[5, 6, 7]]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_the_four_shapes_of_input(value, expected):
    request = parse_embedding_request({"input": value, "model": MODEL}, MODEL, LIMITS)
    assert request == EmbeddingRequest(MODEL, expected, "float", None, None, None, True)


@pytest.mark.parametrize("body, param, words", [
    ({"input": []}, "input", "non-empty"),
    ({"input": ""}, "input", "must not be empty"),
    ({}, "input", "required"),
    ({"input": ["a", ""]}, "input[1]", "must not be empty"),
    ({"input": [[1, 2], []]}, "input[1]", "must not be empty"),
    ({"input": [1, 100]}, "input", "token id 100 is not in the vocabulary"),
    ({"input": [[1], [-1]]}, "input[1]", "token id -1"),
    ({"input": ["a", [1]]}, "input", "only strings or only token-id lists"),
    ({"input": ["x"] * 9}, "input", "at most 8 inputs, got 9"),
    ({"input": [True, 1]}, "input", "only strings or only token-id lists"),
    ({"input": [[1, True]]}, "input[0]", "list of integer token ids"),
    ({"input": "\ud800"}, "input", "lone surrogate"),
    ({"input": "a", "dimensions": 0}, "dimensions", "in [1, 32], got 0"),
    ({"input": "a", "dimensions": 33}, "dimensions", "in [1, 32], got 33"),
    ({"input": "a", "dimensions": 4.5}, "dimensions", "integer"),
    ({"input": "a", "encoding_format": "bytes"}, "encoding_format", "float, base64"),
    ({"input": "a", "truncate_prompt_tokens": 65}, "truncate_prompt_tokens", "in [-1, 64]"),
    ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "at least 1"),
    ({"input": "a", "normalize": "yes"}, "normalize", "boolean"),
    ({"input": "a", "user": 3}, "user", "string"),
    ({"input": "a", "priority": 2}, "priority", "not supported"),
])
def test_bad_embedding_requests_are_400s_naming_the_field(body, param, words):
    assert words in refused(parse_embedding_request, body, param)


def test_unknown_model_is_404_and_a_big_batch_stays_a_400():
    refused(parse_embedding_request, {"input": "a", "model": "other"}, "model", status=404)
    message = refused(parse_embedding_request, {"input": ["x"] * 100_000}, "input")
    assert "at most 8" in message


def test_matryoshka_sizes_bound_dimensions():
    limits = PoolingLimits(100, 32, 64, matryoshka_dimensions=(8, 16, 32))
    assert parse_embedding_request({"input": "a", "dimensions": 16}, MODEL, limits).dimensions == 16
    refused(parse_embedding_request, {"input": "a", "dimensions": 12}, "dimensions", limits=limits)


def test_truncation_and_the_context():
    request = parse_embedding_request({"input": "a", "truncate_prompt_tokens": -1}, MODEL, LIMITS)
    assert request.truncate_prompt_tokens == LIMITS.max_model_len
    assert prompt_tokens(range(10), 0, 3, LIMITS) == [7, 8, 9]  # the last tokens kept, as vLLM
    assert prompt_tokens(range(70), 0, 64, LIMITS) == list(range(6, 70))
    with pytest.raises(ProtocolError, match="maximum context length is 64 tokens. However, 'input' 2 has 65"):
        prompt_tokens(range(65), 2, None, LIMITS)
    with pytest.raises(ProtocolError, match="no tokens"):
        prompt_tokens([], 0, None, LIMITS)


def test_score_pairs_one_against_many_or_in_order():
    one = parse_score_request({"text_1": "q", "text_2": ["a", "b"]}, MODEL, LIMITS)
    assert one.pairs == [("q", "a"), ("q", "b")]
    assert parse_score_request({"text_1": ["q"], "text_2": "a"}, MODEL, LIMITS).pairs == [("q", "a")]
    assert parse_score_request({"text_1": ["p", "q"], "text_2": ["a", "b"]}, MODEL, LIMITS).pairs == [
        ("p", "a"), ("q", "b")]
    assert "as many as 'text_2' (3), got 2" in refused(
        parse_score_request, {"text_1": ["p", "q"], "text_2": ["a", "b", "c"]}, "text_1")
    refused(parse_score_request, {"text_1": "q"}, "text_2")
    refused(parse_score_request, {"text_1": "q", "text_2": []}, "text_2")
    refused(parse_score_request, {"text_1": "q", "text_2": ["a"] * 9}, "text_2")
    refused(parse_score_request, {"text_1": 5, "text_2": "a"}, "text_1")


def test_rerank_requests():
    request = parse_rerank_request({"query": "q", "documents": ["a", {"text": "b"}, "c"], "top_n": 2},
                                   MODEL, LIMITS)
    assert request == RerankRequest(MODEL, "q", ["a", "b", "c"], 2, True, None)
    assert parse_rerank_request({"query": "q", "documents": ["a"], "top_n": 5}, MODEL, LIMITS).top_n == 1
    assert parse_rerank_request({"query": "q", "documents": ["a", "b"]}, MODEL, LIMITS).top_n == 2
    refused(parse_rerank_request, {"documents": ["a"]}, "query")
    refused(parse_rerank_request, {"query": "q", "documents": []}, "documents")
    refused(parse_rerank_request, {"query": "q", "documents": ["a", {"txt": "b"}]}, "documents[1].text")
    refused(parse_rerank_request, {"query": "q", "documents": ["a"], "top_n": -1}, "top_n")
    refused(parse_rerank_request, {"query": "q", "documents": ["a"] * 9}, "documents")
    refused(parse_rerank_request, {"query": "q", "documents": ["a"], "return_documents": 1}, "return_documents")


def test_classify_requests():
    request = parse_classify_request({"input": ["good", "bad"]}, MODEL, LIMITS)
    assert request.inputs == ["good", "bad"] and request.add_special_tokens
    refused(parse_classify_request, {"input": []}, "input")
    refused(parse_classify_request, {"input": "a", "use_activation": False}, "use_activation")


def test_embedding_response_float_and_base64_as_openai_decodes_it():
    rng = np.random.default_rng(SEED)
    vectors = [rng.standard_normal(5).astype(np.float32) for _ in range(2)]
    floats = embedding_response(MODEL, vectors, "float", prompt_tokens=9)
    assert floats["object"] == "list" and floats["model"] == MODEL and floats["id"].startswith("embd-")
    assert floats["usage"] == {"prompt_tokens": 9, "total_tokens": 9}
    assert [d["index"] for d in floats["data"]] == [0, 1] and floats["data"][0]["object"] == "embedding"
    np.testing.assert_array_equal(floats["data"][1]["embedding"], vectors[1])
    encoded = embedding_response(MODEL, vectors, "base64", prompt_tokens=9)["data"][1]["embedding"]
    # the openai client: np.frombuffer(base64.b64decode(data), dtype="float32")
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(encoded), dtype="float32"), vectors[1])
    assert base64.b64decode(encode_base64(np.array([1.0]))) == b"\x00\x00\x80\x3f"  # little-endian


def test_rerank_results_sorted_by_relevance_with_their_index():
    request = RerankRequest(MODEL, "q", ["a", "b", "c", "d"], 3, True, None)
    response = rerank_response(request, [0.1, 0.9, 0.5, 0.9], prompt_tokens=20)
    assert [(r["index"], r["relevance_score"], r["document"]["text"]) for r in response["results"]] == [
        (1, 0.9, "b"), (3, 0.9, "d"), (2, 0.5, "c")]
    assert response["usage"] == {"total_tokens": 20} and response["model"] == MODEL
    bare = rerank_response(RerankRequest(MODEL, "q", ["a", "b"], 2, False, None), [0.2, 0.3], 4)
    assert bare["results"] == [{"index": 1, "relevance_score": 0.3}, {"index": 0, "relevance_score": 0.2}]


def test_score_and_classify_responses():
    scores = score_response(MODEL, [0.25, 0.75], prompt_tokens=6)
    assert [(d["index"], d["score"], d["object"]) for d in scores["data"]] == [(0, 0.25, "score"), (1, 0.75, "score")]
    classes = classify_response(MODEL, [np.array([0.2, 0.8]), np.array([0.6, 0.4])], ["neg", "pos"], 4)
    assert [(d["index"], d["label"], d["num_classes"]) for d in classes["data"]] == [(0, "pos", 2), (1, "neg", 2)]
    np.testing.assert_allclose(classes["data"][0]["probs"], [0.2, 0.8], rtol=1e-6)
    assert classes["usage"]["prompt_tokens"] == 4


def test_parse_inputs_names_its_own_field():
    with pytest.raises(ProtocolError) as raised:
        parse_inputs([], LIMITS, param="queries")
    assert raised.value.param == "queries"

"""The pooling routes' requests and responses: embeddings, scores, reranking and classes.

- `POST /v1/embeddings` (OpenAI): `input` a string, a list of strings, a token-id list or a list of
  them; `encoding_format` float or base64 (little-endian float32, as OpenAI's client decodes it);
  `dimensions` (matryoshka: the first n, renormalized); vLLM's `truncate_prompt_tokens` (-1: the
  model's context; k: the last k tokens), `add_special_tokens` and `normalize`; `user` is ignored.
- `POST /score` (vLLM): `text_1` and `text_2`, each a string or a list: one text against each of
  the others, or pairs in order.
- `POST /rerank`, `/v1/rerank`, `/v2/rerank` (Jina / Cohere / vLLM): `query`, `documents` (strings
  or {"text": ...}), `top_n` (0 or absent: all), `return_documents` (default true, as vLLM).
- `POST /classify` (vLLM): `input` as for embeddings.
Every problem is a `serve.protocol.ProtocolError` (400 naming the field; 404 for an unknown
model), before any work: an empty input, a token id outside the vocabulary, `dimensions` 0 or
above the hidden size, more inputs than `PoolingLimits.max_inputs_per_request`; once tokenized,
`prompt_tokens` truncates and refuses an input past the context. Responses are built in
OpenAI's, vLLM's and Jina's shapes. No jax here.
"""
from __future__ import annotations

import base64
import dataclasses
import time
import uuid
from typing import Any, Sequence

import numpy as np

from jaxserve.core.request import is_valid_unicode
from serve.protocol import ProtocolError, check_field_support, is_false, only_null, printable

DEFAULT_MAX_INPUTS_PER_REQUEST = 2048  # OpenAI's bound on one embeddings request's inputs
ENCODING_FORMATS = ("float", "base64")
# vLLM's pooling fields jaxserve does not implement, each with the test of its neutral value
# (serve.protocol.check_field_support: anything else is a 400 naming the field).
_UNSUPPORTED = {"priority": lambda v: v == 0 and v is not False, "request_id": only_null, "cache_salt": only_null,
                "mm_processor_kwargs": lambda v: v == {}, "use_activation": lambda v: v is True,
                "embed_dtype": lambda v: v == "float32", "return_tokens_as_token_ids": is_false}
_SERVED_EMBEDDING = {"model", "input", "encoding_format", "dimensions", "user", "truncate_prompt_tokens",
                     "add_special_tokens", "normalize"}
_SERVED_SCORE = {"model", "text_1", "text_2", "truncate_prompt_tokens", "user"}
_SERVED_RERANK = {"model", "query", "documents", "top_n", "return_documents", "truncate_prompt_tokens", "user"}
_SERVED_CLASSIFY = {"model", "input", "truncate_prompt_tokens", "add_special_tokens", "user"}


@dataclasses.dataclass(frozen=True)
class PoolingLimits:
    """What the served model and server bound, checked here so that each is a 400 naming its field."""
    vocab_size: int
    hidden_size: int
    max_model_len: int
    max_inputs_per_request: int = DEFAULT_MAX_INPUTS_PER_REQUEST
    matryoshka_dimensions: tuple[int, ...] | None = None  # the sizes the model declares (None: any)


@dataclasses.dataclass(frozen=True)
class EmbeddingRequest:
    model: str
    inputs: list[str | list[int]]
    encoding_format: str  # "float" or "base64"
    dimensions: int | None  # None: the model's (its pooler config's, else the hidden size)
    normalize: bool | None  # None: the model's
    truncate_prompt_tokens: int | None  # tokens kept from the end of each input (None: no truncation)
    add_special_tokens: bool = True


@dataclasses.dataclass(frozen=True)
class ScoreRequest:
    model: str
    pairs: list[tuple[str, str]]  # (text_1, text_2), in the response's order
    truncate_prompt_tokens: int | None


@dataclasses.dataclass(frozen=True)
class RerankRequest:
    model: str
    query: str
    documents: list[str]
    top_n: int  # results returned, best first (the number of documents when 0 or larger)
    return_documents: bool
    truncate_prompt_tokens: int | None


@dataclasses.dataclass(frozen=True)
class ClassifyRequest:
    model: str
    inputs: list[str | list[int]]
    truncate_prompt_tokens: int | None
    add_special_tokens: bool = True


def _checked_body(body: Any, served_models: str | tuple[str, ...], served_fields: set[str]) -> str:
    """The model a request names (the first served one when it names none), its fields checked."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    served = (served_models,) if isinstance(served_models, str) else tuple(served_models)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ProtocolError("'model' must be a string", param="model")
    if model is not None and model not in served:
        raise ProtocolError(f"The model `{printable(model)}` does not exist", status=404, param="model",
                            code="model_not_found")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise ProtocolError("'user' must be a string", param="user")
    check_field_support(body, _UNSUPPORTED, served_fields)
    return model if model is not None else served[0]


def _integer(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"'{name}' must be an integer, got {printable(repr(value), 40)}", param=name)
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ProtocolError(f"'{name}' must be {bound}, got {value}", param=name)
    return value


def _boolean(body: dict, name: str, default: bool | None) -> bool | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ProtocolError(f"'{name}' must be a boolean, got {printable(repr(value), 40)}", param=name)
    return value


def _truncation(body: dict, limits: PoolingLimits) -> int | None:
    """vLLM's `truncate_prompt_tokens`: -1 (the model's context) or 1 .. max_model_len."""
    value = _integer(body, "truncate_prompt_tokens", -1, limits.max_model_len)
    if value == 0:
        raise ProtocolError("'truncate_prompt_tokens' must be -1 (the model's context) or at least 1, got 0",
                            param="truncate_prompt_tokens")
    return limits.max_model_len if value == -1 else value


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"'{param}' must be a string", param=param)
    if not value:
        raise ProtocolError(f"'{param}' must not be empty", param=param)
    if not is_valid_unicode(value):
        raise ProtocolError(f"'{param}' is not valid Unicode: it holds a lone surrogate", param=param)
    return value


def _token_ids(value: list, param: str, vocab_size: int) -> list[int]:
    if not value:
        raise ProtocolError(f"'{param}' must not be empty", param=param)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ProtocolError(f"'{param}' must be a list of integer token ids", param=param)
    bad = next((t for t in value if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ProtocolError(f"'{param}': token id {bad} is not in the vocabulary [0, {vocab_size})", param=param)
    return value


def _bounded(count: int, param: str, limits: PoolingLimits) -> None:
    if count > limits.max_inputs_per_request:
        raise ProtocolError(f"'{param}' may hold at most {limits.max_inputs_per_request} inputs, got {count}",
                            param=param, code="too_many_inputs")


def parse_inputs(value: Any, limits: PoolingLimits, param: str = "input") -> list[str | list[int]]:
    """OpenAI's `input`: a string, a token-id list, or a list of strings or of token-id lists."""
    if value is None:
        raise ProtocolError(f"'{param}' is required", param=param)
    if isinstance(value, str):
        return [_text(value, param)]
    if not isinstance(value, list) or not value:
        raise ProtocolError(f"'{param}' must be a non-empty string, list of strings, token-id list or list of "
                            f"token-id lists", param=param)
    if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        return [_token_ids(value, param, limits.vocab_size)]
    _bounded(len(value), param, limits)
    if all(isinstance(item, str) for item in value):
        return [_text(item, f"{param}[{i}]") for i, item in enumerate(value)]
    if all(isinstance(item, list) for item in value):
        return [_token_ids(item, f"{param}[{i}]", limits.vocab_size) for i, item in enumerate(value)]
    raise ProtocolError(f"'{param}' must hold only strings or only token-id lists", param=param)


def parse_embedding_request(body: Any, served_models: str | tuple[str, ...], limits: PoolingLimits) -> EmbeddingRequest:
    """Validates a /v1/embeddings body."""
    model = _checked_body(body, served_models, _SERVED_EMBEDDING)
    encoding = body.get("encoding_format") or "float"
    if encoding not in ENCODING_FORMATS:
        raise ProtocolError(f"'encoding_format' must be one of {', '.join(ENCODING_FORMATS)}, got "
                            f"{printable(str(encoding), 40)!r}", param="encoding_format")
    dimensions = _integer(body, "dimensions", 1, limits.hidden_size)
    if dimensions is not None and limits.matryoshka_dimensions and dimensions not in limits.matryoshka_dimensions:
        raise ProtocolError(f"'dimensions' must be one of {list(limits.matryoshka_dimensions)} for this model, "
                            f"got {dimensions}", param="dimensions")
    return EmbeddingRequest(model, parse_inputs(body.get("input"), limits), encoding, dimensions,
                            _boolean(body, "normalize", None), _truncation(body, limits),
                            _boolean(body, "add_special_tokens", True))


def _texts(value: Any, param: str) -> list[str]:
    if isinstance(value, str):
        return [_text(value, param)]
    if not isinstance(value, list) or not value:
        raise ProtocolError(f"'{param}' must be a string or a non-empty list of strings", param=param)
    return [_text(item, f"{param}[{i}]") for i, item in enumerate(value)]


def parse_score_request(body: Any, served_models: str | tuple[str, ...], limits: PoolingLimits) -> ScoreRequest:
    """Validates a /score body: `text_1` against each of `text_2` (one text_1), or pairs in order."""
    model = _checked_body(body, served_models, _SERVED_SCORE)
    for name in ("text_1", "text_2"):
        if body.get(name) is None:
            raise ProtocolError(f"'{name}' is required", param=name)
        if isinstance(body[name], list):
            _bounded(len(body[name]), name, limits)
    first, second = _texts(body["text_1"], "text_1"), _texts(body["text_2"], "text_2")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ProtocolError(f"'text_1' must hold one text or as many as 'text_2' ({len(second)}), got {len(first)}",
                            param="text_1")
    return ScoreRequest(model, list(zip(first, second)), _truncation(body, limits))


def parse_rerank_request(body: Any, served_models: str | tuple[str, ...], limits: PoolingLimits) -> RerankRequest:
    """Validates a /rerank, /v1/rerank or /v2/rerank body."""
    model = _checked_body(body, served_models, _SERVED_RERANK)
    if body.get("query") is None:
        raise ProtocolError("'query' is required", param="query")
    query = _text(body["query"], "query")
    documents = body.get("documents")
    if not isinstance(documents, list) or not documents:
        raise ProtocolError("'documents' must be a non-empty list of strings or {\"text\": ...} objects",
                            param="documents")
    _bounded(len(documents), "documents", limits)
    texts = []
    for i, document in enumerate(documents):
        if isinstance(document, dict):
            document = document.get("text")
        texts.append(_text(document, f"documents[{i}]" + ("" if isinstance(documents[i], str) else ".text")))
    top_n = _integer(body, "top_n", 0) or len(texts)
    return RerankRequest(model, query, texts, min(top_n, len(texts)), _boolean(body, "return_documents", True),
                         _truncation(body, limits))


def parse_classify_request(body: Any, served_models: str | tuple[str, ...], limits: PoolingLimits) -> ClassifyRequest:
    """Validates a /classify body."""
    model = _checked_body(body, served_models, _SERVED_CLASSIFY)
    return ClassifyRequest(model, parse_inputs(body.get("input"), limits), _truncation(body, limits),
                           _boolean(body, "add_special_tokens", True))


def prompt_tokens(token_ids: Sequence[int], index: int, truncate: int | None, limits: PoolingLimits,
                  param: str = "input") -> list[int]:
    """An input's tokens once encoded: the last `truncate` kept (vLLM truncates from the left),
    then refused when empty or past the model's context."""
    tokens = list(token_ids)
    if truncate is not None:
        tokens = tokens[-truncate:]
    if not tokens:
        raise ProtocolError(f"'{param}' {index} encodes to no tokens", param=param)
    if len(tokens) > limits.max_model_len:
        raise ProtocolError(f"This model's maximum context length is {limits.max_model_len} tokens. However, "
                            f"'{param}' {index} has {len(tokens)} tokens. Please reduce the length of the input, "
                            f"or set truncate_prompt_tokens.", param=param, code="context_length_exceeded")
    return tokens


def encode_base64(vector: np.ndarray) -> str:
    """An embedding as OpenAI's base64: the bytes of its little-endian float32 values."""
    return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")


def _envelope(prefix: str, model: str) -> dict[str, Any]:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model}


def _usage(prompt_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}


def embedding_response(model: str, embeddings: Sequence[np.ndarray], encoding_format: str,
                       prompt_tokens: int) -> dict[str, Any]:
    """OpenAI's embeddings list: one object per input, in input order."""
    encode = encode_base64 if encoding_format == "base64" else (lambda v: np.asarray(v, np.float32).tolist())
    data = [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(embeddings)]
    return {**_envelope("embd", model), "data": data, "usage": _usage(prompt_tokens)}


def score_response(model: str, scores: Sequence[float], prompt_tokens: int) -> dict[str, Any]:
    """vLLM's /score list: one score per pair, in pair order."""
    data = [{"object": "score", "index": i, "score": float(s)} for i, s in enumerate(scores)]
    return {**_envelope("score", model), "data": data, "usage": _usage(prompt_tokens)}


def rerank_response(request: RerankRequest, scores: Sequence[float], prompt_tokens: int) -> dict[str, Any]:
    """The Jina / Cohere / vLLM rerank results: the `top_n` best documents, highest
    relevance_score first (ties: the earlier document first), each with its index."""
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))[:request.top_n]
    results = []
    for i in order:
        result = {"index": i, "relevance_score": float(scores[i])}
        if request.return_documents:
            result["document"] = {"text": request.documents[i]}
        results.append(result)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": request.model, "results": results,
            "usage": {"total_tokens": prompt_tokens}}


def classify_response(model: str, probabilities: Sequence[np.ndarray], labels: Sequence[str],
                      prompt_tokens: int) -> dict[str, Any]:
    """vLLM's /classify list: each input's label (the most probable) and every label's probability."""
    data = []
    for i, probs in enumerate(probabilities):
        values = np.asarray(probs, np.float32)
        data.append({"index": i, "label": labels[int(np.argmax(values))], "probs": values.tolist(),
                     "num_classes": len(values)})
    return {**_envelope("classify", model), "data": data, "usage": _usage(prompt_tokens)}

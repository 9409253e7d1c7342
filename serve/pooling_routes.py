"""The pooling routes: /v1/embeddings, /score, /rerank (+ /v1/rerank, /v2/rerank) and /classify.

A pooling server (--runner=pooling, `EngineClient.pooling`) answers them; a generating server
answers each with a 400 naming --runner, as a pooling server answers the completion routes.
Each request is parsed and tokenized in the server's prepare threads (serve.pooling_protocol: every
problem a 400 naming its field), then each input is one engine request (`pooling_params()`), at
most IN_FLIGHT_PER_REQUEST of one HTTP request in the engine at once, so a request of many inputs
queues behind itself, not in front of the others; the finished deltas' pooled vectors are finished
here (`finish_embedding`: dimensions, normalization) and shaped by serve.pooling_protocol.
An embedding model scores a pair by the cosine of the two embeddings; a classifier
(*ForSequenceClassification) by its head on the pair's prompt (serve.pair_prompts.encode_pair).
"""
from __future__ import annotations

import asyncio
import uuid
from typing import Any, Awaitable, Callable

import numpy as np
from aiohttp import web

from jaxserve.core.engine_client import EngineClient, PoolingService
from jaxserve.core.outputs import EngineUnavailableError, QueueFullError
from jaxserve.core.request import InvalidRequestError, pooling_params
from jaxserve.pooling.accumulate import cosine_scores, finish_embedding
from serve import pooling_protocol as protocol
from serve.pair_prompts import encode_pair
from serve.protocol import ProtocolError

IN_FLIGHT_PER_REQUEST = 64  # inputs of one HTTP request in the engine at once (the rest wait here)
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")
SCORE_PATHS = ("/score", "/v1/score")


def generation_refusal() -> ProtocolError:
    """The 400 of a completion route on a pooling server."""
    return ProtocolError("this server pools (--runner=pooling): it serves /v1/embeddings, /score, /rerank and "
                         "/classify; start it with --runner=generate for completions", code="wrong_runner")


def add_routes(app: web.Application, state: Callable[[web.Request], Any],
               read_json: Callable[[web.Request], Awaitable[Any]]) -> None:
    """Routes the pooling endpoints of `app`; `state(request)` is the server's ServerState (engine,
    model names, prepare threads), `read_json(request)` the body parsed (400s for bad JSON)."""
    def route(prepare: Callable, respond: Callable):
        async def handle(request: web.Request) -> web.Response:
            server = state(request)
            service = _service(server.engine)
            if server.draining:
                raise ProtocolError("the server is shutting down", status=503, error_type="server_error",
                                    code="shutting_down")
            body = await read_json(request)
            loop = asyncio.get_running_loop()
            parsed, prompts = await loop.run_in_executor(server.prepare_pool, prepare, server, service, body)
            vectors = await pool_prompts(server.engine, prompts)
            return web.json_response(respond(service, parsed, vectors, sum(map(len, prompts))))
        return handle

    app.router.add_post("/v1/embeddings", route(_prepare_embeddings, _embeddings))
    app.router.add_post("/classify", route(_prepare_classify, _classes))
    for path in SCORE_PATHS:
        app.router.add_post(path, route(_prepare_score, _scores))
    for path in RERANK_PATHS:
        app.router.add_post(path, route(_prepare_rerank, _reranked))


def _service(engine: EngineClient) -> PoolingService:
    if engine.pooling is None:
        raise ProtocolError("this server generates (--runner=generate): start it with --runner=pooling for "
                            "embeddings, scores, reranking and classes", code="wrong_runner")
    return engine.pooling


def limits(server, service: PoolingService) -> protocol.PoolingLimits:
    return protocol.PoolingLimits(service.vocab_size, service.hidden_size, server.engine.max_model_len,
                                  service.max_inputs_per_request, service.pooler.matryoshka_dimensions)


def _encode(server, inputs: list, truncate: int | None, bounds: protocol.PoolingLimits,
            add_special_tokens: bool = True, param: str = "input") -> list[list[int]]:
    """Each input's token ids (texts tokenized), truncated and checked against the context."""
    tokenizer = server.engine.tokenizer
    out = []
    for i, item in enumerate(inputs):
        ids = item if isinstance(item, list) else tokenizer(item, add_special_tokens=add_special_tokens)["input_ids"]
        out.append(protocol.prompt_tokens(ids, i, truncate, bounds, param))
    return out


def _need(service: PoolingService, classifier: bool, route: str) -> None:
    if (service.pooler.classifier is not None) != classifier:
        what = "a classification model (*ForSequenceClassification)" if classifier else "an embedding model"
        raise ProtocolError(f"{route} needs {what}; this server's model is "
                            f"{'a classifier' if service.pooler.classifier else 'an embedding model'}",
                            code="wrong_model_kind")


def _prepare_embeddings(server, service, body):
    bounds = limits(server, service)
    request = protocol.parse_embedding_request(body, server.model_names, bounds)
    _need(service, False, "/v1/embeddings")
    return request, _encode(server, request.inputs, request.truncate_prompt_tokens, bounds, request.add_special_tokens)


def _embeddings(service, request, vectors, num_tokens):
    pooler = service.pooler
    normalize = pooler.normalize if request.normalize is None else request.normalize
    dimensions = request.dimensions or pooler.dimensions
    embeddings = [finish_embedding(v, normalize, dimensions) for v in vectors]
    return protocol.embedding_response(request.model, embeddings, request.encoding_format, num_tokens)


def _prepare_classify(server, service, body):
    bounds = limits(server, service)
    request = protocol.parse_classify_request(body, server.model_names, bounds)
    _need(service, True, "/classify")
    return request, _encode(server, request.inputs, request.truncate_prompt_tokens, bounds, request.add_special_tokens)


def _classes(service, request, vectors, num_tokens):
    return protocol.classify_response(request.model, vectors, service.pooler.classifier.labels, num_tokens)


def _pair_prompts(server, service, pairs: list[tuple[str, str]], truncate: int | None,
                  bounds: protocol.PoolingLimits) -> list[list[int]]:
    """A classifier's prompts: each pair as one prompt. An embedding model's: every distinct text
    once (the score then pairs their embeddings)."""
    if service.pooler.classifier is not None:
        if service.pooler.classifier.num_labels != 1:
            raise ProtocolError(f"scoring needs a one-label classifier; this one has "
                                f"{service.pooler.classifier.num_labels} labels (use /classify)",
                                code="wrong_model_kind")
        ids = [encode_pair(server.engine.tokenizer, first, second) for first, second in pairs]
        return [protocol.prompt_tokens(p, i, truncate, bounds, "text_2") for i, p in enumerate(ids)]
    texts = list(dict.fromkeys(text for pair in pairs for text in pair))
    return _encode(server, texts, truncate, bounds, param="text_2")


def pair_scores(service: PoolingService, pairs: list[tuple[str, str]], vectors: list[np.ndarray]) -> np.ndarray:
    """[pairs] float32: a classifier's activated score of each pair's prompt, or the cosine of an
    embedding model's two embeddings (`vectors` in _pair_prompts' order)."""
    if service.pooler.classifier is not None:
        return np.asarray([v[0] for v in vectors], np.float32)
    texts = list(dict.fromkeys(text for pair in pairs for text in pair))
    index = {text: i for i, text in enumerate(texts)}
    stacked = np.stack(vectors)
    return cosine_scores(stacked[[index[a] for a, _ in pairs]], stacked[[index[b] for _, b in pairs]])


def _prepare_score(server, service, body):
    bounds = limits(server, service)
    request = protocol.parse_score_request(body, server.model_names, bounds)
    return request, _pair_prompts(server, service, request.pairs, request.truncate_prompt_tokens, bounds)


def _scores(service, request, vectors, num_tokens):
    return protocol.score_response(request.model, pair_scores(service, request.pairs, vectors), num_tokens)


def _prepare_rerank(server, service, body):
    bounds = limits(server, service)
    request = protocol.parse_rerank_request(body, server.model_names, bounds)
    pairs = [(request.query, document) for document in request.documents]
    return request, _pair_prompts(server, service, pairs, request.truncate_prompt_tokens, bounds)


def _reranked(service, request, vectors, num_tokens):
    pairs = [(request.query, document) for document in request.documents]
    return protocol.rerank_response(request, pair_scores(service, pairs, vectors), num_tokens)


async def pool_prompts(engine: EngineClient, prompts: list[list[int]]) -> list[np.ndarray]:
    """Each prompt pooled by the engine (its finished delta's vector), in order; at most
    IN_FLIGHT_PER_REQUEST in the engine at once. A refusal is a ProtocolError: 400 (admission,
    naming the input), 429 (the engine's queue is full), 503 (the engine is not running); a request
    the engine failed, 500. On any error or a cancellation the prompts still in flight are aborted."""
    window = asyncio.Semaphore(IN_FLIGHT_PER_REQUEST)
    prefix = f"pool-{uuid.uuid4().hex}"

    async def pool_one(index: int, ids: list[int]) -> np.ndarray:
        async with window:
            try:
                stream = engine.generate(f"{prefix}-{index}", ids, pooling_params())
            except InvalidRequestError as e:
                raise ProtocolError(f"input {index}: {e}", param="input", code=e.code) from None
            except QueueFullError as e:
                raise ProtocolError(f"the server is at capacity, retry later ({e})", status=429,
                                    error_type="rate_limit_error", code="queue_full") from None
            except EngineUnavailableError as e:
                raise ProtocolError(str(e), status=503, error_type="server_error",
                                    code="engine_unavailable") from None
            final = None
            try:
                async for output in stream:
                    final = output
            finally:
                await stream.aclose()
            if final is None or final.pooled is None:
                message = final.error if final is not None and final.error else "the input was not pooled"
                raise ProtocolError(f"input {index}: {message}", status=500, error_type="server_error",
                                    code="internal_error")
            return final.pooled

    tasks = [asyncio.ensure_future(pool_one(i, ids)) for i, ids in enumerate(prompts)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()

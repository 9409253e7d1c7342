"""The aiohttp application: OpenAI-compatible routes, SSE streaming, /health, /metrics.

Every refusal is an OpenAI-style JSON error body; anything unexpected becomes a logged 500 with a
generic message. A client that disconnects cancels its handler, which aborts its engine requests.
On shutdown the server stops accepting, lets in-flight requests finish for `drain_timeout_s`,
then ends the rest with an error event.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import hmac
import json
import logging
import time
from typing import Any, Callable

from aiohttp import web

from jaxserve.core.engine_client import EngineClient
from jaxserve.core.outputs import EngineUnavailableError, QueueFullError
from jaxserve.core.request import InvalidRequestError
from serve import lora_routes, pooling_routes, tokenize_routes, web_ui
from serve.chat_output import choice_output_factory
from serve.connections import BodyTimeout, MalformedBody, read_body
from serve.fanout import ChoiceFanout, ServerStopping
from serve.images import MediaSettings, ServerImages
from serve.metrics import ServerMetrics
from serve.prompts import check_prompt_chars, max_token_chars, prompt_token_ids
from serve.protocol import (GenerationRequest, ProtocolError, admission_error, build_sampling_params, error_body,
                            parse_chat_request, parse_completion_request)
from serve.reasoning import REASONING_PARSERS
from serve.responses import (ResponsesRequest, ResponsesShaper, client_error, not_stored_error,
                             parse_responses_request, responses_call_ids, sse_events)
from serve.shaping import SSE_DONE, ChoiceState, ResponseShaper, select_best, sse_event, total_usage
from serve.structured import resolve_auto_tool_choice
from serve.tool_parsers import TOOL_PARSERS, ToolCallParser, mistral_call_id, vllm_call_id

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics"})  # reachable without the API key
_SEED_LIMIT = 2**63


@dataclasses.dataclass
class ServerConfig:
    api_key: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    drain_timeout_s: float = 30.0  # how long in-flight requests may run on after a shutdown signal
    retry_after_s: int = 1  # the Retry-After of a 429 (engine queue full)
    manage_engine: bool = True  # start the engine with the app and shut it down with it
    served_model_names: tuple[str, ...] = ()  # ids clients may name, the first reported; () = engine's
    num_prepare_threads: int = 2  # JSON parsing and tokenizing run here, never on the event loop
    web_ui: bool = True  # the chat page at / (serve/web_ui.py); open without the API key
    allowed_origins: tuple[str, ...] = ()  # CORS on the /v1 routes for these origins; () = same-origin only
    # Sampling values for fields a request omits (jaxserve.core.request.SAMPLING_DEFAULT_FIELDS, checked
    # by the caller): the model's generation_config.json and --default_sampling.
    sampling_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    # tool_choice "auto" and reasoning (vLLM's flags; see serve.structured.resolve_auto_tool_choice)
    tool_call_parser: str | None = None  # None: the format the chat template asks for
    enable_auto_tool_choice: bool | None = None  # None: "auto" wherever the template renders tools
    reasoning_parser: str | None = None  # serve/reasoning.py's REASONING_PARSERS; None: no reasoning split
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter answer (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    allow_runtime_lora_updating: bool = False
    # where images may come from and how many a prompt may hold (serve/images.py)
    media: MediaSettings = dataclasses.field(default_factory=MediaSettings)


class ServerState:
    def __init__(self, engine: EngineClient, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.model_names = tuple(config.served_model_names) or (engine.model_name,)
        self.lora_enabled = engine.lora_enabled
        self.metrics = ServerMetrics(engine.stats, self.model_names[0], engine.max_model_len)
        engine.add_step_listener(self.metrics.observe_step)  # step time and tokens per step (serve/metrics.py)
        self.active: set[ChoiceFanout] = set()
        self.draining = False
        self.created = int(time.time())
        self.token_text = functools.lru_cache(maxsize=65536)(lambda token_id: engine.tokenizer.decode([token_id]))
        self.max_token_chars = max_token_chars(engine.tokenizer)
        # ToolConfigError (a ValueError) for tool flags the chat template cannot serve
        self.auto_tools = resolve_auto_tool_choice(engine.tokenizer, config.tool_call_parser,
                                                   config.enable_auto_tool_choice)
        self.tool_format = TOOL_PARSERS[self.auto_tools.format]() if self.auto_tools.format else None
        self.new_call_id = mistral_call_id if self.auto_tools.format == "mistral" else vllm_call_id
        if config.reasoning_parser is not None and config.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, got "
                             f"{config.reasoning_parser!r}")
        self.reasoning = REASONING_PARSERS[config.reasoning_parser]() if config.reasoning_parser else None
        self.prepare_pool = concurrent.futures.ThreadPoolExecutor(config.num_prepare_threads,
                                                                  thread_name_prefix="jaxserve-prepare")
        self.images = ServerImages(engine.image_service, config.media, self.model_names[0], self.prepare_pool)

    def prepare(self, raw: bytes, is_chat: bool, parse: Callable | None = None) -> tuple[GenerationRequest, list]:
        """Body bytes -> (request, [(prompt token ids, sampling parameters, None)] one per prompt);
        ProtocolError on bad input. Cheap checks first: no text is tokenized that could not fit in
        the context. A chat request with images comes back with [] (its images are loaded next,
        then `prepare_images`)."""
        return self._guarded(self._prepare, raw, is_chat, parse)

    def prepare_images(self, request: GenerationRequest, images: list[bytes]) -> list:
        """A request with images, once they are fetched (ServerImages.load): [(prompt token ids with
        the image tokens, sampling parameters, its MultimodalInputs)]."""
        return self._guarded(lambda: self._with_params(request, [self.images.prompt(self.engine.tokenizer, request,
                                                                                   images)]))

    @staticmethod
    def _guarded(prepare: Callable, *args: Any) -> Any:
        """`prepare(*args)`, where whatever fails but a ProtocolError (a library meeting input it
        cannot take) is a 400 when it is the input's depth, else a 500 logged on one line: never a
        traceback."""
        try:
            return prepare(*args)
        except ProtocolError:
            raise
        except RecursionError:
            raise ProtocolError("the request is nested too deeply to process") from None
        except Exception as e:
            logger.error("preparing a request failed: %s: %s", type(e).__name__, str(e)[:500])
            raise ProtocolError("the server could not prepare this request", status=500, error_type="server_error",
                                code="internal_error") from None

    def _prepare(self, raw: bytes, is_chat: bool, parse: Callable | None = None) -> tuple[GenerationRequest, list]:
        body = _parse_json(raw)
        parse = parse or (parse_chat_request if is_chat else parse_completion_request)
        adapters = self.lora_names()
        request = parse(body, self.model_names + adapters)
        if request.tools is not None and request.tools.choice == "auto":
            if self.auto_tools.refusal is not None:
                raise ProtocolError(self.auto_tools.refusal, param="tool_choice")
            if self.auto_tools.format == "mistral":  # [TOOL_CALLS] is a special token: keep it in the text (vLLM)
                request.sampling.setdefault("skip_special_tokens", False)
        check_prompt_chars(request, self.engine.max_model_len, self.max_token_chars)
        if request.images:
            return request, []
        prompts = [(prompt_token_ids(self.engine.tokenizer, request, i), None) for i in range(request.num_prompts)]
        return request, self._with_params(request, prompts)

    def _with_params(self, request: GenerationRequest, prompts: list) -> list:
        """[(prompt ids, images)] -> [(prompt ids, sampling parameters, images)]; a structured-output
        grammar compiled here, in the prepare threads."""
        adapters = self.lora_names()
        prepared = []
        for prompt_ids, images in prompts:
            params = build_sampling_params(request, len(prompt_ids), self.engine.max_model_len,
                                           self.config.sampling_defaults)
            if request.model in adapters:  # a LoRA adapter's name picks it
                params.lora_name = request.model
            prepared.append((prompt_ids, params, images))
        if prepared and prepared[0][1].structured_output is not None:  # one grammar for every prompt
            try:  # compiled here, in the pool: admission on the event loop then finds it compiled
                self.engine.compile_structured_output(prepared[0][1])
            except InvalidRequestError as e:
                raise admission_error(e, request) from None
        return prepared

    def lora_names(self) -> tuple[str, ...]:
        """The LoRA adapters served, by the names requests pick them with."""
        return tuple(module.name for module in self.engine.lora_modules())

    def model_cards(self) -> list[dict[str, Any]]:
        """/v1/models: the served names, then every LoRA adapter (`parent` the base model's id,
        `root` its folder, as vLLM lists them)."""
        cards = [self.model_card(name) for name in self.model_names]
        for module in self.engine.lora_modules():
            cards.append({**self.model_card(module.name), "root": module.path,
                          "parent": module.base_model_name or self.model_names[0]})
        return cards

    def model_card(self, name: str) -> dict[str, Any]:
        """OpenAI's model object with vLLM's fields (`root`, `parent`, `max_model_len`, `permission`:
        `vllm bench serve` reads `root`); `root` is the served model's public id, never a path."""
        return {"id": name, "object": "model", "created": self.created, "owned_by": "jaxserve",
                "root": self.model_names[0], "parent": None, "max_model_len": self.engine.max_model_len,
                "permission": [{"id": f"modelperm-{name}", "object": "model_permission", "created": self.created,
                                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                                "organization": "*", "group": None, "is_blocking": False}],
                "sampling_defaults": dict(self.config.sampling_defaults), **self.runner_fields()}

    def runner_fields(self) -> dict[str, Any]:
        """What the model card says the runner serves: vLLM's runner name and its tasks."""
        pooling = self.engine.pooling
        if pooling is None:
            return {"runner": "generate", "tasks": ["generate"]}
        return {"runner": "pooling", "tasks": ["classify", "score"] if pooling.pooler.classifier else ["embed", "score"]}


STATE = web.AppKey("jaxserve_state", ServerState)


def create_app(engine: EngineClient, config: ServerConfig | None = None) -> web.Application:
    """The app serving `engine` (jaxserve.core.engine_client.EngineClient: what it needs of one)."""
    config = config or ServerConfig()
    # CORS preflights (only with allowed_origins) are answered before the API-key check.
    middlewares = [_error_middleware, *web_ui.cors_middlewares(config.allowed_origins), _auth_middleware]
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=middlewares)
    app[STATE] = ServerState(engine, config)
    web_ui.setup(app, page=config.web_ui, allowed_origins=config.allowed_origins)
    app.router.add_post("/v1/completions", handle_completions)
    app.router.add_post("/v1/chat/completions", handle_chat_completions)
    app.router.add_post("/v1/responses", handle_responses)
    app.router.add_get("/v1/responses/{response_id:.+}", handle_stored_response)
    app.router.add_delete("/v1/responses/{response_id:.+}", handle_stored_response)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/v1/models/{model_id:.+}", handle_model)
    app.router.add_post("/v1/load_lora_adapter", handle_load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", handle_unload_lora_adapter)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/metrics", handle_metrics)
    pooling_routes.add_routes(app, lambda request: request.app[STATE], _read_json)
    tokenize_routes.add_routes(app, lambda request: request.app[STATE], _read_body, _parse_json)
    app.on_startup.append(_start_engine)
    app.on_shutdown.append(_drain)
    app.on_cleanup.append(_stop_engine)
    app.on_cleanup.append(_stop_prepare_pool)
    return app


def _json_error(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(body, status=status, headers=headers)


def _from_http_exception(request: web.Request, e: web.HTTPException) -> web.Response:
    messages = {
        404: f"no route for {request.method} {request.path}",
        405: f"method {request.method} is not allowed on {request.path}",
        413: f"the request body is larger than {request.app[STATE].config.max_body_bytes} bytes",
    }
    codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
    headers = {k: v for k, v in e.headers.items() if k.lower() in ("allow", "retry-after")}
    body = error_body(messages.get(e.status, e.reason), "invalid_request_error", code=codes.get(e.status))
    return _json_error(e.status, body, headers)


@web.middleware
async def _error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        response = await handler(request)
    except asyncio.CancelledError:  # the client went away
        _count_request(request, 499)
        raise
    except ProtocolError as e:
        response = _json_error(e.status, e.body(), e.headers)
    except web.HTTPException as e:
        response = _from_http_exception(request, e)
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        response = _json_error(500, error_body("internal server error", "server_error", code="internal_error"))
    _count_request(request, response.status)
    return response


def _count_request(request: web.Request, status: int) -> None:
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    request.app[STATE].metrics.http_requests.labels(route=route, status=str(status)).inc()


@web.middleware
async def _auth_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    api_key = request.app[STATE].config.api_key
    if api_key and request.path not in OPEN_PATHS and not web_ui.is_public(request):
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        # Header bytes that are not UTF-8 arrive as surrogate escapes: compare them as the raw bytes.
        token_bytes = token.strip().encode("utf-8", "surrogateescape")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token_bytes, api_key.encode()):
            raise ProtocolError("invalid or missing API key (send 'Authorization: Bearer <key>')", status=401,
                                code="invalid_api_key", headers={"WWW-Authenticate": 'Bearer realm="jaxserve"'})
    return await handler(request)


async def handle_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": state.model_cards()})


async def handle_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    model_id = request.match_info["model_id"]
    card = next((card for card in state.model_cards() if card["id"] == model_id), None)
    if card is None:
        raise ProtocolError(f"The model `{model_id[:100]}` does not exist", status=404, param="model",
                            code="model_not_found")
    return web.json_response(card)


async def handle_load_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    lora_routes.check_route(allowed=state.config.allow_runtime_lora_updating, enabled=state.lora_enabled)
    name, path = lora_routes.lora_fields(_parse_json(await _read_body(request)), ("lora_name", "lora_path"))
    return web.Response(text=await lora_routes.load_adapter(state.engine, state.model_names, name, path))


async def handle_unload_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    lora_routes.check_route(allowed=state.config.allow_runtime_lora_updating, enabled=state.lora_enabled)
    (name,) = lora_routes.lora_fields(_parse_json(await _read_body(request)), ("lora_name",))
    return web.Response(text=await lora_routes.unload_adapter(state.engine, name))


def engine_is_alive(engine: EngineClient) -> bool:
    """`engine.is_alive()`; an engine whose check raises is not alive (the error is logged)."""
    try:
        return bool(engine.is_alive())
    except Exception:
        logger.exception("health check failed")
        return False


async def handle_health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.draining:
        return web.json_response({"status": "shutting down"}, status=503)
    if not engine_is_alive(state.engine):
        return web.json_response({"status": "engine not running"}, status=503)
    health = state.engine.health()
    warmup = health.get("warmup")
    if warmup is not None and not warmup["ready"]:  # requests are taken, but wait for their shapes
        status = "warm-up failed" if warmup.get("error") else "warming up"
        return web.json_response({"status": status, **health}, status=503)
    return web.json_response({"status": "ok", **health})


async def handle_metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def handle_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, is_chat=False)


async def handle_chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, is_chat=True)


async def handle_responses(request: web.Request) -> web.StreamResponse:
    """The Responses API: a chat generation in its shapes (serve/responses.py); refusals name its fields."""
    try:
        return await _generate(request, is_chat=True, parse=parse_responses_request)
    except ProtocolError as e:
        raise client_error(e) from None


async def handle_stored_response(request: web.Request) -> web.Response:
    raise not_stored_error(request.match_info["response_id"])  # responses are never stored


def _parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise ProtocolError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ProtocolError("the request body is nested too deeply") from None


async def _read_json(request: web.Request) -> Any:
    return _parse_json(await _read_body(request))


async def _read_body(request: web.Request) -> bytes:
    """The body, within the server's body timeout (see serve.connections)."""
    try:
        return await read_body(request)
    except BodyTimeout as e:
        raise ProtocolError(e.message, status=408, code="request_timeout", headers={"Connection": "close"}) from None
    except MalformedBody as e:
        raise ProtocolError(e.message, code="bad_http_request", headers={"Connection": "close"}) from None


async def _generate(request: web.Request, *, is_chat: bool, parse: Callable | None = None) -> web.StreamResponse:
    arrival_time = time.monotonic()
    state = request.app[STATE]
    engine = state.engine
    if state.draining:
        raise ProtocolError("the server is shutting down", status=503, error_type="server_error", code="shutting_down")
    if engine.pooling is not None:
        raise pooling_routes.generation_refusal()
    raw = await _read_body(request)
    loop = asyncio.get_running_loop()
    req, prepared = await loop.run_in_executor(state.prepare_pool, state.prepare, raw, is_chat, parse)
    if req.images:  # fetched here; decoded, processed and placed in the prompt in the prepare threads
        images = await state.images.load(req, engine.max_model_len)
        prepared = await loop.run_in_executor(state.prepare_pool, state.prepare_images, req, images)
    # Prompt p's candidates are sequences p * best_of .. (p + 1) * best_of - 1; candidate j's seed is seed + j.
    sequences = []
    for prompt_ids, params, images in prepared:
        if req.best_of > req.n and params.logprobs is None:
            params = dataclasses.replace(params, logprobs=0)  # best_of ranks by the sampled tokens' logprobs
        sequences += [(prompt_ids, dataclasses.replace(params, seed=(params.seed + j) % _SEED_LIMIT)
                       if params.seed is not None and j else params, images) for j in range(req.best_of)]
    echoed = None  # each prompt's (text, token ids): for echo, and for return_token_ids (the ids alone)
    if req.echo or req.return_token_ids:
        echoed = [(p if isinstance(p, str) else engine.tokenizer.decode(ids), ids) if req.echo else ("", ids)
                  for p, (ids, _, _) in zip(req.prompts or [None], prepared)]
    if isinstance(req, ResponsesRequest):
        shaper = ResponsesShaper(req, prepared[0][1], functools.partial(
            ToolCallParser.for_request, req.tools, state.tool_format, responses_call_ids(state.new_call_id)))
    else:
        shaper = ResponseShaper(is_chat=is_chat, model=req.model, token_text=state.token_text,
                                want_logprobs=req.logprobs is not None, include_usage=req.include_usage,
                                continuous_usage=req.continuous_usage,
                                prompts=echoed, choices_per_prompt=req.n, echo=req.echo,
                                want_prompt_logprobs=req.prompt_logprobs is not None,
                                want_token_ids=req.return_token_ids,
                                output_parser=choice_output_factory(req, tool_format=state.tool_format,
                                                                    new_call_id=state.new_call_id,
                                                                    reasoning=state.reasoning))
    trackers = state.metrics.trackers(arrival_time, [(len(ids), params.max_tokens) for ids, params, _ in prepared],
                                      choices_per_prompt=req.best_of, n=req.n)
    fanout = ChoiceFanout(engine, shaper.response_id, sequences,
                          on_output=lambda i, output: trackers[i].observe(output))
    state.active.add(fanout)
    try:
        try:
            await fanout.start()
        except QueueFullError as e:
            raise ProtocolError(f"the server is at capacity, retry later ({e})", status=429,
                                error_type="rate_limit_error", code="queue_full",
                                headers={"Retry-After": str(state.config.retry_after_s)}) from None
        except InvalidRequestError as e:  # the engine's admission check
            error = admission_error(e, req)
            if req.num_prompts > 1:  # name the prompt of a batch
                error.message = f"prompt {fanout.num_admitted // req.best_of}: {error.message}"
            raise error from None
        except ValueError as e:
            raise ProtocolError(str(e)) from None
        except ServerStopping as e:
            raise ProtocolError(str(e), status=503, error_type="server_error", code="shutting_down") from None
        except EngineUnavailableError as e:  # not running, or its executor failed (a multi-host job)
            raise ProtocolError(str(e), status=503, error_type="server_error", code="engine_unavailable") from None
        for _, params, _ in prepared:
            if params.lora_name is not None:
                state.metrics.lora_requests.labels(lora_name=params.lora_name).inc()
        if req.stream:
            stream = _stream_responses(request, fanout, shaper) if isinstance(req, ResponsesRequest) else \
                _stream(request, fanout, shaper, req)
            return await stream
        return await _collect(fanout, shaper, req)
    finally:
        state.active.discard(fanout)
        try:
            await fanout.close()
        finally:  # the client's disconnect can cancel this task while it closes (after a failed write)
            for tracker in trackers[:fanout.num_admitted]:
                tracker.finish("abort")  # counts only the admitted choices that did not finish


async def _collect(fanout: ChoiceFanout, shaper: ResponseShaper, req: GenerationRequest) -> web.Response:
    choices = [ChoiceState() for _ in range(fanout.num_choices)]
    try:
        async for index, output in fanout.outputs():
            choices[index].add(output)
    except ServerStopping as e:
        raise ProtocolError(str(e), status=503, error_type="server_error", code="shutting_down") from None
    for choice in choices:
        if choice.finish_reason == "error" and choice.error_param is not None:  # the request's own input
            raise ProtocolError(choice.error, param=choice.error_param)
        if choice.finish_reason == "error":
            logger.error("generation failed: %s", choice.error)
            raise ProtocolError(f"generation failed: {choice.error}", status=500, error_type="server_error",
                                code="generation_error")
        if choice.finish_reason in (None, "abort"):
            raise ProtocolError("the request was aborted", status=503, error_type="server_error", code="aborted")
    usage = total_usage(choices, req.best_of)  # every candidate's tokens count, as OpenAI bills best_of
    if req.best_of > req.n:
        choices = select_best(choices, req.best_of, req.n)
    return web.json_response(shaper.full_response(choices, usage))


async def _stream(request: web.Request, fanout: ChoiceFanout, shaper: ResponseShaper,
                  req: GenerationRequest) -> web.StreamResponse:
    """Streams every choice (best_of equals n here), choice index = sequence index (p * n + j)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)
    choices = [ChoiceState() for _ in range(fanout.num_choices)]
    try:
        if shaper.is_chat:
            for index in range(fanout.num_choices):
                await response.write(sse_event(shaper.role_chunk(index)))
        failure = None
        async for index, output in fanout.outputs():
            choices[index].add(output)
            if output.finished and output.finish_reason == "error" and output.error_param is not None:
                failure = error_body(output.error, "invalid_request_error", param=output.error_param)
                break
            if output.finished and output.finish_reason in ("error", "abort"):
                failure = error_body(f"generation ended: {output.error or output.finish_reason}", "server_error",
                                     code=output.finish_reason)
                break
            if output.new_text or output.new_logprobs or output.finished or output.prompt_logprobs is not None:
                await response.write(sse_event(shaper.delta_chunk(index, output)))
        if failure is None and any(c.finish_reason is None for c in choices):
            failure = error_body("the request was aborted", "server_error", code="aborted")
        if failure is None and shaper.include_usage:
            await response.write(sse_event(shaper.usage_chunk(choices, req.n)))
    except ConnectionError:
        return response  # the client went away; the caller's close() aborts the engine requests
    except ServerStopping as e:
        failure = error_body(str(e), "server_error", code="shutting_down")
    except Exception:
        logger.exception("streaming failed")
        failure = error_body("internal server error", "server_error", code="internal_error")
    try:
        if failure is not None:
            await response.write(sse_event(failure))
        await response.write(SSE_DONE)
        await response.write_eof()
    except ConnectionError:
        pass
    return response


async def _stream_responses(request: web.Request, fanout: ChoiceFanout, shaper: ResponsesShaper) -> web.StreamResponse:
    """A Responses API stream: its lifecycle events around the output items' deltas, ending with
    `response.completed` / `response.incomplete`, or `response.failed` (serve/responses.py)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)
    try:
        await response.write(sse_events(shaper.opening_events()))
        async for _, output in fanout.outputs():
            await response.write(sse_events(shaper.output_events(output)))
        closing = [] if shaper.finished else shaper.failure_events("the request was aborted")
    except ConnectionError:
        return response  # the client went away; the caller's close() aborts the engine request
    except ServerStopping as e:
        closing = shaper.failure_events(str(e))
    except Exception:
        logger.exception("streaming failed")
        closing = shaper.failure_events("internal server error")
    try:
        await response.write(sse_events(closing))
        await response.write_eof()
    except ConnectionError:
        pass
    return response


async def _start_engine(app: web.Application) -> None:
    state = app[STATE]
    if state.config.manage_engine:
        await state.engine.start()


async def _drain(app: web.Application) -> None:
    """Refuses new requests, waits for in-flight ones up to the drain timeout, then stops the rest."""
    state = app[STATE]
    state.draining = True
    deadline = time.monotonic() + state.config.drain_timeout_s
    while state.active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for fanout in list(state.active):
        fanout.stop("the server is shutting down")


async def _stop_engine(app: web.Application) -> None:
    state = app[STATE]
    if state.config.manage_engine:
        await state.engine.shutdown()


async def _stop_prepare_pool(app: web.Application) -> None:
    app[STATE].prepare_pool.shutdown(wait=False, cancel_futures=True)

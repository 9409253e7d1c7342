"""One streamed request to an OpenAI-compatible server, timed on the client's clock.

`send` posts a completions or chat request with `stream: true` and `stream_options.include_usage`,
reads the server-sent events and returns a `RequestRecord`: the send time, the arrival time of
every chunk that carried text, the end time, the usage the server reported and the generated text.
Nothing raises out of it: a refused connection, an HTTP error status, an error event, a `data:` line
that is not JSON or a stream that ends without `data: [DONE]` all come back as a record with
`error` set. `probe` asks `/v1/models` before a run, so that a server that is down is one clear
message rather than a run of failures. A completions stream that carries each chunk's `token_ids`
(vLLM's `return_token_ids`) also leaves the reply's token ids in the record, and `tokenize` asks a
server's /tokenize (vLLM's, which jaxserve serves too): the `multiturn` dataset builds each
conversation's history from them.

A pooled keep-alive connection can be closed by the server just as the client reuses it (llama.cpp's
server does this under load): the write fails ("Can not write request body") or the server
disconnects before answering. Such a request never got a response, so `send` sends it once more, on a
fresh connection, and counts the retry in the record (`retries`); its `start` stays the first send,
so the retry's cost is in its TTFT. A failure after the response began is never retried.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import aiohttp

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
ERROR_TEXT_LIMIT = 300  # characters of a server's error body kept in a record


class ServerUnreachable(RuntimeError):
    """The server did not answer at all (connection refused, no route, DNS, timeout)."""


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """What one request asks for; `prompt` is text, or token ids (completions only)."""

    prompt: str | list[int]
    prompt_len: int
    max_tokens: int


@dataclasses.dataclass
class RequestRecord:
    """The client-side timeline of one request: `perf_counter` seconds."""

    prompt_len: int
    start: float = 0.0
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # chunks with text, in order
    end: float = 0.0
    text: str = ""
    usage_completion_tokens: int | None = None  # from the final usage chunk, when sent
    error: str | None = None
    retries: int = 0  # sends again after the connection closed before any response (see the module docstring)
    token_ids: list[int] | None = None  # the reply's token ids, when the stream carried them (vLLM's return_token_ids)
    usage_cached_tokens: int | None = None  # the usage chunk's prompt_tokens_details.cached_tokens, when sent

    @property
    def ok(self) -> bool:
        return self.error is None


def request_body(endpoint: str, model: str, spec: RequestSpec, *, temperature: float,
                 ignore_eos: bool) -> dict:
    """The JSON body for `endpoint` ("completions" or "chat"), vLLM's benchmark fields."""
    body = {"model": model, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if endpoint == "chat":
        if not isinstance(spec.prompt, str):
            raise ValueError("the chat endpoint needs text prompts, not token ids (give a --tokenizer)")
        body["messages"] = [{"role": "user", "content": spec.prompt}]
        body["max_completion_tokens"] = spec.max_tokens
    else:
        body["prompt"] = spec.prompt
        body["max_tokens"] = spec.max_tokens
    return body


def chunk_text(endpoint: str, event: dict) -> str:
    """The text one streamed event carries (completions `text`, chat `delta.content` or the
    reasoning a reasoning parser splits off)."""
    pieces = []
    for choice in event.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        if endpoint == "chat":
            delta = choice.get("delta") or {}
            pieces += [delta.get(k) or "" for k in ("reasoning_content", "reasoning", "content")
                       if isinstance(delta.get(k), str)]
        elif isinstance(choice.get("text"), str):
            pieces.append(choice["text"])
    return "".join(pieces)


def chunk_token_ids(event: dict) -> list[int] | None:
    """The token ids one streamed completions event carries in its choices' `token_ids` (vLLM's
    `return_token_ids`: each chunk's new tokens), else None (a server that does not send them)."""
    found = None
    for choice in event.get("choices") or []:
        ids = choice.get("token_ids") if isinstance(choice, dict) else None
        if isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            found = (found or []) + ids
    return found


def _error_message(status: int, body: str) -> str:
    """`HTTP 400: message` from an OpenAI-style {"error": {"message": ...}} body, else the raw text."""
    message = body.strip()
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error", parsed.get("message"))
        if isinstance(error, dict):
            error = error.get("message")
        message = str(error) if error else message
    return f"HTTP {status}: {str(message)[:ERROR_TEXT_LIMIT]}"


def _event_error(event: dict) -> str | None:
    """The message of an error event sent inside the stream, else None."""
    error = event.get("error")
    if error is None:
        return None
    message = error.get("message") if isinstance(error, dict) else error
    return f"error event in the stream: {str(message)[:ERROR_TEXT_LIMIT]}"


async def _read_stream(response: aiohttp.ClientResponse, endpoint: str, record: RequestRecord) -> None:
    """Fills `record` from the SSE body; sets `record.error` on a malformed or failed stream."""
    pieces = []
    async for raw in response.content:
        line = raw.decode("utf-8", errors="replace").strip()
        if not line.startswith("data:"):
            continue  # blank separators, `: keep-alive` comments, `event:` lines
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            record.text = "".join(pieces)
            return
        try:
            event = json.loads(payload)
        except ValueError:
            record.error = f"malformed SSE: a data line is not JSON: {payload[:80]!r}"
            return
        if not isinstance(event, dict):
            record.error = f"malformed SSE: a data line is not a JSON object: {payload[:80]!r}"
            return
        if (message := _event_error(event)) is not None:
            record.error = message
            return
        ids = chunk_token_ids(event)
        if ids is not None:
            record.token_ids = (record.token_ids or []) + ids
        text = chunk_text(endpoint, event)
        if text:
            record.chunk_times.append(time.perf_counter())
            pieces.append(text)
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            record.usage_completion_tokens = usage["completion_tokens"]
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                record.usage_cached_tokens = details["cached_tokens"]
    record.text = "".join(pieces)
    record.error = "malformed SSE: the stream ended without data: [DONE]"


async def send(session: aiohttp.ClientSession, url: str, endpoint: str, body: dict,
               prompt_len: int) -> RequestRecord:
    """Posts `body` to `url` and times its stream; every failure is kept in the record's `error`.
    A connection that closes before any response is retried once (see the module docstring)."""
    record = RequestRecord(prompt_len=prompt_len, start=time.perf_counter())
    while True:
        responded = False
        try:
            async with session.post(url, json=body) as response:
                responded = True
                if response.status != 200:
                    record.error = _error_message(response.status, await response.text(errors="replace"))
                else:
                    await _read_stream(response, endpoint, record)
        except asyncio.TimeoutError:
            record.error = "the request timed out (--request_timeout_s)"
        except aiohttp.ClientError as e:
            if not responded and record.retries < MAX_RETRIES and _closed_before_response(e):
                record.retries += 1
                continue
            record.error = f"{type(e).__name__}: {e}"
        record.end = time.perf_counter()
        return record


MAX_RETRIES = 1  # sends again of a request whose connection closed before any response


def _closed_before_response(error: aiohttp.ClientError) -> bool:
    """A kept-alive connection the server had closed: the request body could not be written, or
    the server disconnected without answering. A connection that could not be opened at all
    (refused, no route) is not one: sending again would not help."""
    if isinstance(error, aiohttp.ClientConnectorError):
        return False
    return isinstance(error, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError))


async def probe(session: aiohttp.ClientSession, base_url: str) -> list[str]:
    """The model ids `/v1/models` lists (empty when it answers otherwise, e.g. 404). Raises
    ServerUnreachable when nothing answers."""
    try:
        async with session.get(base_url + "/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as response:
            if response.status != 200:
                return []
            try:
                listing = await response.json(content_type=None)
            except ValueError:
                return []
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        raise ServerUnreachable(f"cannot reach {base_url}: {e or type(e).__name__} (is the server running?)") from None
    data = listing.get("data") if isinstance(listing, dict) else None
    return [m["id"] for m in data or [] if isinstance(m, dict) and isinstance(m.get("id"), str)]


async def tokenize(session: aiohttp.ClientSession, base_url: str, model: str, text: str) -> list[int]:
    """The server's own token ids of `text` without special tokens added (vLLM's POST /tokenize,
    which jaxserve serves too); ValueError when it does not answer with them."""
    body = {"model": model, "prompt": text, "add_special_tokens": False}
    try:
        async with session.post(base_url + "/tokenize", json=body) as response:
            raw = await response.text(errors="replace")
            status = response.status
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise ValueError(f"{base_url}/tokenize: {type(e).__name__}: {e}") from None
    try:
        tokens = json.loads(raw).get("tokens") if status == 200 else None
    except (ValueError, AttributeError):
        tokens = None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        problem = _error_message(status, raw) if status != 200 else "no 'tokens' list in the answer"
        raise ValueError(f"{base_url}/tokenize: {problem}")
    return tokens

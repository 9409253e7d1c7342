"""Connection hygiene for the aiohttp server: a connection cap, request-head and body timeouts,
quiet handling of malformed HTTP, and a rate limit on asyncio's accept-error logging.

`LimitedAppRunner` is an `aiohttp.web.AppRunner` whose connections are `_GuardedRequestHandler`s:
- beyond `max_connections` open connections a new one gets a minimal 503 JSON and is closed at
  once, so a flood of idle sockets cannot exhaust the process's file descriptors;
- a connection must deliver a complete request head within `header_timeout_s` (slowloris);
  idle keep-alive connections close after `keepalive_timeout_s` (aiohttp's own keepalive timer);
- a request aiohttp's parser rejects gets an OpenAI-style JSON 400 and one WARNING line, not a
  text/plain 400 and an ERROR traceback;
- an `Expect` header other than `100-continue` gets a JSON 417 (aiohttp answers it in plain text,
  before the app's middlewares see the request);
- while it runs, asyncio's "socket.accept() out of system resource" errors are logged as at most
  one WARNING per `LOG_INTERVAL_S` instead of one traceback per failed accept().

The body timeout needs the handler's cooperation (aiohttp has no server-side body deadline): read
bodies with `read_body`, which raises `BodyTimeout` (an HTTP 408) when the body is too slow and
`MalformedBody` (an HTTP 400) when it cannot be decoded.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import re
import resource
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, HttpProcessingError

logger = logging.getLogger(__name__)

FD_TARGET = 65536  # raise the soft RLIMIT_NOFILE to this (or the hard limit if lower), as vLLM does
FD_RESERVE = 256  # descriptors kept back from the connection cap: model files, logs, pipes, and the up
#                   to `backlog` (128) sockets asyncio accepts in one loop tick before any is refused
LOG_INTERVAL_S = 5.0  # at most one WARNING per this many seconds for repeated accept errors / refusals
_REASON_CHARS = 200  # malformed-request reasons are cut to this length in the log line and the JSON


@dataclasses.dataclass(frozen=True)
class ConnectionLimits:
    """Per-connection limits of the HTTP server (every field has a command-line-friendly default)."""

    max_connections: int | None = None
    """Open connections beyond which new ones get a 503 and are closed. None: the soft RLIMIT_NOFILE
    (after raising it towards the hard limit) minus FD_RESERVE; a larger value is lowered to that."""
    header_timeout_s: float = 10.0
    """Time a connection may take to deliver a complete request line + headers: from connect for
    its first request; from the first byte of a later request on a keep-alive connection (bytes
    pipelined while the previous request is still being handled fall to keepalive_timeout_s)."""
    body_timeout_s: float = 30.0
    """Time `read_body` waits for a whole request body before raising BodyTimeout (HTTP 408)."""
    keepalive_timeout_s: float = 30.0
    """Idle time after a response before a keep-alive connection is closed (aiohttp's
    keepalive_timeout, which also runs from connect, so it bounds the first request head as well).
    Longer than common client pool expiries (httpx: 5 s), so clients close idle connections first."""
    max_line_size: int = 8190
    """Longest request line, in bytes (aiohttp's max_line_size); longer ones get a 400."""
    max_field_size: int = 8190
    """Longest header line, in bytes (aiohttp's max_field_size); longer ones get a 400."""

    def __post_init__(self) -> None:
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {self.max_connections}")
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_line_size", "max_field_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


def raise_fd_limit(target: int = FD_TARGET) -> int:
    """Raises the soft RLIMIT_NOFILE to min(target, hard limit) if it is lower; returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            logger.info("raised the open-file limit from %d to %d", soft, want)
            soft = want
        except (ValueError, OSError) as e:
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, want, e)
    return target if soft == resource.RLIM_INFINITY else soft


def resolve_limits(limits: ConnectionLimits | None = None) -> ConnectionLimits:
    """`limits` with max_connections filled in from (and capped by) the process's descriptor limit,
    after raising the soft limit; call it at server start, in the serving process."""
    limits = limits or ConnectionLimits()
    fd_limit = raise_fd_limit()
    ceiling = max(1, fd_limit - min(FD_RESERVE, fd_limit // 2))  # small limits keep half in reserve
    wanted = limits.max_connections
    if wanted is not None and wanted > ceiling:
        logger.warning("max_connections %d is above what %d open files allow; using %d", wanted, fd_limit, ceiling)
    return dataclasses.replace(limits, max_connections=ceiling if wanted is None else min(wanted, ceiling))


class _Throttle:
    """Lets one event through per `interval_s` and counts the ones it holds back."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._next = -math.inf
        self._held_back = 0

    def admit(self, now: float) -> int | None:
        """None if the event should stay quiet; else how many were held back since the last one."""
        if now < self._next:
            self._held_back += 1
            return None
        held_back, self._held_back = self._held_back, 0
        self._next = now + self.interval_s
        return held_back


def _held_back_note(held_back: int) -> str:
    return f" ({held_back} more since the last such warning)" if held_back else ""


class AcceptErrorFilter:
    """A loop exception handler: accept() failures (EMFILE & co.) become one WARNING per interval;
    every other context goes on to the handler that was installed before (or asyncio's default)."""

    _MESSAGES = ("socket.accept() out of system resource", "Error on transport creation for incoming connection")

    def __init__(self, previous: Any = None, interval_s: float = LOG_INTERVAL_S) -> None:
        self.previous = previous
        self._throttle = _Throttle(interval_s)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if not str(context.get("message", "")).startswith(self._MESSAGES):
            if self.previous is not None:
                self.previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        held_back = self._throttle.admit(loop.time())
        if held_back is not None:
            logger.warning("%s (%s)%s", context["message"], context.get("exception"), _held_back_note(held_back))


def _error_body(message: str, error_type: str, code: str) -> dict[str, Any]:
    # The shape of serve.protocol.error_body, repeated here so this module stands on aiohttp alone.
    return {"error": {"message": message, "type": error_type, "param": None, "code": code}}


def _busy_response() -> bytes:
    """The whole 503 a refused connection gets, written before its request is even read."""
    body = json.dumps(_error_body("the server has too many open connections; retry shortly", "server_error",
                                  "too_many_connections")).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\nRetry-After: 1\r\n\r\n")
    return head.encode() + body


_BUSY = _busy_response()


class _GuardedServer(web.Server):
    """aiohttp's Server making `_GuardedRequestHandler`s and counting the connections they admit."""

    def __init__(self, handler: Any, *, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.limits = limits
        self.open_connections = 0
        self._refusals = _Throttle()

    def __call__(self) -> web.RequestHandler:
        return _GuardedRequestHandler(self, loop=self._loop, **self._kwargs)

    def refuse(self, transport: asyncio.BaseTransport) -> None:
        """Answers a 503 and closes, without reading the request: the cheapest way to shed a connection."""
        transport.write(_BUSY)  # type: ignore[attr-defined]
        transport.close()  # after the 503 is flushed
        held_back = self._refusals.admit(self._loop.time())
        if held_back is not None:
            logger.warning("connection limit reached (%d open): refusing new connections with a 503%s",
                           self.open_connections, _held_back_note(held_back))


class _GuardedRequestHandler(web.RequestHandler):
    """aiohttp's per-connection protocol plus the connection cap, the request-head timeout and quiet
    JSON answers to malformed requests."""

    __slots__ = ("_gate", "_admitted", "_head_timer")

    def __init__(self, manager: _GuardedServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._gate = manager  # aiohttp drops self._manager on connection_lost; the count needs it after
        self._admitted = False
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        gate = self._gate
        if gate.open_connections >= gate.limits.max_connections:
            gate.refuse(transport)  # aiohttp never sees this connection
            return
        gate.open_connections += 1
        self._admitted = True
        super().connection_made(transport)
        self._arm_head_timer()  # the first request head, counted from connect

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._admitted:
            return
        self._admitted = False
        self._gate.open_connections -= 1
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._admitted:  # a refused connection: its 503 is on the way, its request is not read
            return
        if data and self._head_timer is None and self._waiting_for_request():
            self._arm_head_timer()  # first bytes of the next request on a keep-alive connection
        super().data_received(data)
        if self._messages:  # a complete head (or a parse error) is queued for the handler
            self._cancel_head_timer()

    def _waiting_for_request(self) -> bool:
        # The same "idle" test as aiohttp's keepalive timer: the request loop waits for a message.
        return self._waiter is not None and not self._waiter.done()

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self._loop.call_later(self._gate.limits.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._waiting_for_request():
            logger.debug("closing %s: no complete request head within %g s", self.peername,
                         self._gate.limits.header_timeout_s)
            self.force_close()

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """Parser errors: a JSON 4xx and one WARNING line. Anything else (a handler bug that escaped
        the app's middleware) keeps aiohttp's handling, traceback included."""
        if not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        reason = _short_reason(exc)
        if isinstance(exc, BadHttpMethod) and self._request_count == 1:
            # Like aiohttp: non-HTTP (e.g. TLS) bytes on a fresh connection are scanner noise, not news.
            logger.debug("malformed HTTP request from %s: %s", request.remote, reason)
        else:
            logger.warning("malformed HTTP request from %s: %s", request.remote, reason)
        body = _error_body(f"malformed HTTP request: {reason}", "invalid_request_error", "bad_http_request")
        response = web.json_response(body, status=status, headers={"Connection": "close"})
        response.force_close()  # the parser's state is unknown after an error
        return response


def _short_reason(exc: HttpProcessingError) -> str:
    """The parser's reason in one short line, without the request bytes aiohttp echoes into it."""
    lines = (exc.message or "").strip().splitlines()
    text = re.split(r":\s*(?:bytearray\()?b['\"]", lines[0] if lines else "", maxsplit=1)[0].rstrip(" :.")
    return f"{type(exc).__name__}: {text}"[:_REASON_CHARS] if text else type(exc).__name__


def _json_expectation_failed(handler: Any) -> Any:
    """`handler` (the app's) behind a check of the Expect header: HTTP/1.1 defines only
    `100-continue` (which aiohttp answers, then the app handles the request); any other value is
    a JSON 417 here, where aiohttp would raise its text/plain one ahead of the app's middlewares."""
    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        expect = request.headers.get("Expect")
        if expect and expect.lower() != "100-continue" and request.version >= (1, 1):
            body = _error_body(f"unsupported Expect header {expect[:100]!r}: only '100-continue' is supported",
                               "invalid_request_error", "expectation_failed")
            return web.json_response(body, status=417)
        return await handler(request)
    return handle


class LimitedAppRunner(web.AppRunner):
    """`web.AppRunner` serving through `_GuardedRequestHandler`s under `limits` (resolved: see
    `resolve_limits`), with `AcceptErrorFilter` as the loop's exception handler from setup() to cleanup()."""

    def __init__(self, app: web.Application, *, limits: ConnectionLimits, **kwargs: Any) -> None:
        if limits.max_connections is None:
            raise ValueError("resolve the limits first (resolve_limits)")
        super().__init__(app, keepalive_timeout=limits.keepalive_timeout_s, max_line_size=limits.max_line_size,
                         max_field_size=limits.max_field_size, **kwargs)
        self.limits = limits
        self._accept_filter: AcceptErrorFilter | None = None

    async def _make_server(self) -> web.Server:
        # aiohttp's Server hard-codes RequestHandler as the protocol, so rebuild the Server the app
        # made (same handler, request factory and handler arguments) as the subclass that uses ours.
        server = await super()._make_server()
        handler = _json_expectation_failed(server.request_handler)
        return _GuardedServer(handler, request_factory=server.request_factory,
                              handler_cancellation=server.handler_cancellation, limits=self.limits,
                              **server._kwargs)

    async def setup(self) -> None:
        await super().setup()
        loop = asyncio.get_running_loop()
        self._accept_filter = AcceptErrorFilter(loop.get_exception_handler())
        loop.set_exception_handler(self._accept_filter)

    async def cleanup(self) -> None:
        try:
            await super().cleanup()
        finally:
            loop = asyncio.get_running_loop()
            if self._accept_filter is not None and loop.get_exception_handler() is self._accept_filter:
                loop.set_exception_handler(self._accept_filter.previous)
            self._accept_filter = None


class BodyTimeout(web.HTTPRequestTimeout):
    """The request body did not arrive within the body timeout: an HTTP 408 (as an aiohttp
    HTTPException, so code that does not catch it still answers 408). `message` says why."""

    def __init__(self, timeout_s: float) -> None:
        self.message = f"the request body did not arrive within {timeout_s:g} s"
        super().__init__(text=self.message)
        self.force_close()


class MalformedBody(web.HTTPBadRequest):
    """The request body could not be decoded (bad chunked framing found by the payload parser, a bad
    gzip/deflate body): an HTTP 400 (as an aiohttp HTTPException). `message` says why."""

    def __init__(self, reason: str) -> None:
        self.message = f"malformed request body: {reason}"[:_REASON_CHARS]
        super().__init__(text=self.message)
        self.force_close()


DEFAULT_BODY_TIMEOUT_S = ConnectionLimits().body_timeout_s


async def read_body(request: web.BaseRequest, timeout_s: float | None = None) -> bytes:
    """`await request.read()` bounded by `timeout_s` (default: the body_timeout_s of the server that
    accepted the connection, else DEFAULT_BODY_TIMEOUT_S); raises BodyTimeout when it runs out and
    MalformedBody when the body cannot be decoded (the rest, e.g. a 413 over client_max_size, passes).

    After either, the connection is closed once the response has been written.
    """
    if timeout_s is None:
        protocol = request.protocol
        guarded = isinstance(protocol, _GuardedRequestHandler)
        timeout_s = protocol._gate.limits.body_timeout_s if guarded else DEFAULT_BODY_TIMEOUT_S
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except web.RequestPayloadError as e:
        _abandon_body(request)
        raise MalformedBody(str(e).replace("\n", " ")) from None
    except TimeoutError:
        _abandon_body(request)
        raise BodyTimeout(timeout_s) from None


def _abandon_body(request: web.BaseRequest) -> None:
    # After the response, aiohttp reads what is left of an unfinished body for up to its
    # lingering_time (10 s), and logs a traceback if that read raises anything but a TimeoutError or
    # a cancellation. A TimeoutError on the stream makes it give up quietly and close the connection
    # once the response is out.
    request.content.set_exception(asyncio.TimeoutError())

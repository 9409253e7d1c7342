"""Connection hygiene (serve/connections.py) against a minimal aiohttp app on a loopback port.

Hostile clients over raw sockets: silent and slow request heads, slow bodies, more connections
than the cap, malformed HTTP; plus the accept-error log filter and a server under a real low
open-file limit in a subprocess. Every test also checks that nothing logged a traceback.
"""
from __future__ import annotations

import asyncio
import gzip
import json
import logging
import os
import resource
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from aiohttp import web

from serve.connections import (FD_RESERVE, AcceptErrorFilter, BodyTimeout, ConnectionLimits, MalformedBody,
                               read_body, resolve_limits)
from serve.server import start_server

pytestmark = pytest.mark.slow  # servers in subprocesses: out of `make test-quick`

REPO_ROOT = Path(__file__).resolve().parents[1]
FAST = ConnectionLimits(max_connections=20, header_timeout_s=0.5, body_timeout_s=0.5, keepalive_timeout_s=2.0)
HEALTH = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"


def error_json(status: int, message: str, code: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    return web.json_response(body, status=status, headers={"Connection": "close"})


def make_app() -> web.Application:
    """/health, POST /echo (reads its body with read_body, mapped to JSON as serve/app.py should),
    and /broken (a handler bug with no middleware to catch it)."""

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def echo(request: web.Request) -> web.Response:
        try:
            body = await read_body(request)
        except BodyTimeout as e:
            return error_json(408, e.message, "request_timeout")
        except MalformedBody as e:
            return error_json(400, e.message, "bad_http_request")
        return web.json_response({"bytes": len(body)})

    async def broken(request: web.Request) -> web.Response:
        raise RuntimeError("a handler bug")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/echo", echo)
    app.router.add_get("/broken", broken)
    return app


class Served:
    """`start_server` on 127.0.0.1:0 in a thread with its own event loop."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner, self.port = self.call(start_server(make_app(), "127.0.0.1", 0, limits))

    def call(self, coro, timeout: float = 10):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def open_connections(self) -> int:
        return self.runner.server.open_connections

    def connect(self, timeout: float = 5.0) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout)

    def close(self) -> None:
        if self.runner.server is not None:
            self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture
def serve():
    servers: list[Served] = []

    def make(limits: ConnectionLimits = FAST) -> Served:
        servers.append(Served(limits))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.WARNING)
    return caplog


def assert_no_tracebacks(caplog) -> None:
    for record in caplog.records:
        assert record.exc_info is None and not record.exc_text, f"traceback logged: {record.getMessage()}"
        assert "Traceback" not in record.getMessage()
        assert record.levelno < logging.ERROR, f"error logged: {record.getMessage()}"


def warnings_from(caplog, name: str = "serve.connections") -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == name]


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP response (status, lower-cased headers, body by Content-Length) from a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response head: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in header_lines)}
    length = int(headers.get("content-length", 0))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside a response body"
        body += chunk
    return int(status_line.split()[1]), headers, body[:length]


def wait_closed(sock: socket.socket, timeout: float) -> float:
    """Seconds until the server closes `sock` (reading and dropping anything it still sends)."""
    start = time.monotonic()
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except socket.timeout:
        pytest.fail(f"the server kept the connection open for {timeout} s")
    return time.monotonic() - start


def wait_until(predicate, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the server"
        time.sleep(0.01)


def get_health(server: Served) -> float:
    """Seconds a fresh connection takes to get /health's 200."""
    start = time.monotonic()
    with server.connect() as sock:
        sock.sendall(HEALTH)
        status, _, body = read_response(sock)
    assert status == 200 and json.loads(body) == {"status": "ok"}
    return time.monotonic() - start


# --- request-head and keep-alive timeouts ---------------------------------------------------------

@pytest.mark.parametrize("sent", [b"", b"GET /hea", b"GET /health HTTP/1.1\r\nHost: t\r\n"],
                         ids=["nothing", "partial-request-line", "headers-without-end"])
def test_an_incomplete_request_head_is_closed_after_the_header_timeout(serve, logs, sent):
    server = serve()
    with server.connect() as sock:
        sock.sendall(sent)
        assert 0.4 < wait_closed(sock, timeout=3) < 1.5
    wait_until(lambda: server.open_connections() == 0)
    assert_no_tracebacks(logs)


def test_dribbling_a_request_head_does_not_extend_the_header_timeout(serve, logs):
    server = serve()
    with server.connect() as sock:
        start = time.monotonic()
        sock.settimeout(0.1)
        closed = False
        for byte in b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 100:  # one byte per 0.1 s: 10+ s if allowed
            try:
                sock.send(bytes([byte]))
                closed = sock.recv(1) == b""
            except socket.timeout:
                pass
            except (BrokenPipeError, ConnectionResetError):
                closed = True
            if closed:
                break
        assert closed and 0.4 < time.monotonic() - start < 1.5
    assert_no_tracebacks(logs)


def test_keepalive_connection_idles_past_the_header_timeout_then_closes_after_keepalive(serve, logs):
    server = serve()
    with server.connect() as sock:
        sock.sendall(HEALTH)
        assert read_response(sock)[0] == 200
        time.sleep(1.0)  # idle for more than header_timeout_s (0.5 s), less than keepalive_timeout_s (2 s)
        sock.sendall(HEALTH)
        assert read_response(sock)[0] == 200
        assert 1.5 < wait_closed(sock, timeout=5) < 3.0  # keepalive_timeout_s = 2
    assert_no_tracebacks(logs)


def test_a_later_request_head_gets_the_header_timeout_from_its_first_byte(serve, logs):
    server = serve()
    with server.connect() as sock:
        sock.sendall(HEALTH)
        assert read_response(sock)[0] == 200
        time.sleep(0.7)
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # and nothing more
        assert 0.4 < wait_closed(sock, timeout=3) < 1.0  # well before the keep-alive timeout (2 s)
    assert_no_tracebacks(logs)


# --- request bodies ----------------------------------------------------------------------------

def test_a_slow_body_gets_a_408_after_the_body_timeout_and_the_connection_closes(serve, logs):
    server = serve()
    with server.connect() as sock:
        start = time.monotonic()
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n{")
        sock.settimeout(0.1)
        head = b""
        for _ in range(30):  # dribble a byte per 0.1 s until the server answers (0.5 s body timeout)
            try:
                head = sock.recv(65536)
                break
            except socket.timeout:
                sock.send(b" ")
        assert head.startswith(b"HTTP/1.1 408 "), head
        assert 0.4 < time.monotonic() - start < 1.5
        body = json.loads(head.partition(b"\r\n\r\n")[2])
        assert body["error"]["code"] == "request_timeout" and "0.5 s" in body["error"]["message"]
        assert wait_closed(sock, timeout=2) < 0.5  # no lingering on a body the server gave up on
    wait_until(lambda: server.open_connections() == 0)
    assert_no_tracebacks(logs)


def test_a_body_that_arrives_in_time_is_read(serve, logs):
    server = serve()
    with server.connect() as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhel")
        time.sleep(0.2)
        sock.sendall(b"lo")
        status, _, body = read_response(sock)
    assert status == 200 and json.loads(body) == {"bytes": 5}
    assert_no_tracebacks(logs)


def test_an_undecodable_body_is_a_malformed_body(serve, logs):
    server = serve()
    garbage = b"this is not gzip"
    with server.connect() as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Encoding: gzip\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(garbage), garbage))
        status, headers, body = read_response(sock)
    assert status == 400 and headers["connection"] == "close"
    assert json.loads(body)["error"]["message"].startswith("malformed request body:")
    with server.connect() as sock:  # and a good gzip body is decoded
        good = gzip.compress(b"hello")
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Encoding: gzip\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(good), good))
        assert json.loads(read_response(sock)[2]) == {"bytes": 5}
    assert_no_tracebacks(logs)


def test_a_bad_chunk_after_the_head_ends_with_the_body_timeout(serve, logs):
    """When the head arrived in an earlier packet, aiohttp's parser drops the body's stream on a bad
    chunk instead of failing it: read_body's timeout is what answers (408) and closes."""
    server = serve()
    with server.connect() as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
        time.sleep(0.1)
        sock.sendall(b"zz\r\nabc\r\n0\r\n\r\n")
        status, _, body = read_response(sock)
        assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
        assert wait_closed(sock, timeout=2) < 0.5
    assert_no_tracebacks(logs)


# --- the connection cap ------------------------------------------------------------------------

def test_connections_beyond_the_cap_get_a_503_and_are_closed(serve, logs):
    server = serve(ConnectionLimits(max_connections=20, header_timeout_s=10, keepalive_timeout_s=10))
    keepalive = server.connect()
    keepalive.sendall(HEALTH)
    assert read_response(keepalive)[0] == 200
    held = [server.connect() for _ in range(19)]
    extra: list[socket.socket] = []
    try:
        wait_until(lambda: server.open_connections() == 20)
        for _ in range(10):
            extra.append(server.connect())
            status, headers, body = read_response(extra[-1])
            assert status == 503 and headers["connection"] == "close" and headers["retry-after"] == "1"
            assert json.loads(body)["error"]["code"] == "too_many_connections"
            assert wait_closed(extra[-1], timeout=2) < 0.5
        assert server.open_connections() == 20

        start = time.monotonic()  # the established keep-alive connection is still served at the cap
        keepalive.sendall(HEALTH)
        assert read_response(keepalive)[0] == 200 and time.monotonic() - start < 1.0

        for sock in held:
            sock.close()
        held.clear()
        wait_until(lambda: server.open_connections() == 1, timeout=1.0)
        assert get_health(server) < 1.0
    finally:
        for sock in [keepalive, *held, *extra]:
            sock.close()
    refusals = [m for m in warnings_from(logs) if "connection limit reached" in m]
    assert len(refusals) == 1  # ten refusals, one line (rate-limited)
    assert_no_tracebacks(logs)


# --- malformed HTTP ----------------------------------------------------------------------------

MALFORMED = {
    "long-request-line": b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: t\r\n\r\n",
    "long-header": b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
    "negative-content-length": b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: -1\r\n\r\n",
    "bad-chunk-size": b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
}


@pytest.mark.parametrize("request_bytes", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_http_gets_a_json_4xx_and_one_warning(serve, logs, request_bytes):
    server = serve()
    with server.connect() as sock:
        sock.sendall(request_bytes)
        status, headers, body = read_response(sock)
        assert status in (400, 413, 431) and headers["connection"] == "close"
        assert headers["content-type"].startswith("application/json")
        error = json.loads(body)["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "bad_http_request"
        assert error["param"] is None and error["message"].startswith("malformed HTTP request: ")
        assert len(error["message"]) < 300 and "aaaa" not in error["message"]  # no echo of the request
        wait_closed(sock, timeout=2)
    records = [r for r in logs.records if r.levelno >= logging.WARNING]
    assert len(records) == 1 and records[0].name == "serve.connections"
    assert "malformed HTTP request from 127.0.0.1" in records[0].getMessage()
    assert_no_tracebacks(logs)
    assert get_health(server) < 1.0  # and the server carries on


def test_tls_bytes_on_the_http_port_get_a_json_400_without_a_warning(serve, logs):
    server = serve()
    with server.connect() as sock:
        sock.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(32))
        status, _, body = read_response(sock)
    assert status == 400 and json.loads(body)["error"]["code"] == "bad_http_request"
    assert not [r for r in logs.records if r.levelno >= logging.WARNING]


def test_a_handler_bug_reaching_aiohttp_still_logs_its_traceback(serve, logs):
    server = serve()
    with server.connect() as sock:
        sock.sendall(b"GET /broken HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_response(sock)[0] == 500
    bugs = [r for r in logs.records if r.exc_info and isinstance(r.exc_info[1], RuntimeError)]
    assert len(bugs) == 1 and str(bugs[0].exc_info[1]) == "a handler bug"


# --- the accept-error filter -------------------------------------------------------------------

EMFILE_CONTEXT = {"message": "socket.accept() out of system resource",
                  "exception": OSError(24, "Too many open files")}


def test_the_server_loop_rate_limits_accept_errors_and_forwards_the_rest(serve, logs):
    server = serve()
    handler = server.loop.get_exception_handler()
    assert isinstance(handler, AcceptErrorFilter)
    for _ in range(1000):
        handler(server.loop, dict(EMFILE_CONTEXT))
    assert warnings_from(logs) == ["socket.accept() out of system resource ([Errno 24] Too many open files)"]
    assert_no_tracebacks(logs)

    handler(server.loop, {"message": "some other loop error"})  # goes on to asyncio's default handler
    forwarded = [r for r in logs.records if r.name == "asyncio"]
    assert len(forwarded) == 1 and forwarded[0].getMessage() == "some other loop error"
    assert forwarded[0].levelno == logging.ERROR

    server.call(server.runner.cleanup())
    assert server.loop.get_exception_handler() is None  # the one before start_server is back


class _StubLoop:
    def __init__(self) -> None:
        self.now = 100.0
        self.forwarded: list[dict] = []

    def time(self) -> float:
        return self.now

    def default_exception_handler(self, context: dict) -> None:
        self.forwarded.append(context)


def test_accept_error_filter_logs_once_per_interval_with_a_count(logs):
    loop = _StubLoop()
    accept_filter = AcceptErrorFilter(interval_s=5.0)
    for step in range(100):  # 100 errors over 9.9 s
        loop.now = 100.0 + step * 0.1
        accept_filter(loop, dict(EMFILE_CONTEXT))
    transport_error = {"message": "Error on transport creation for incoming connection",
                       "exception": OSError(23, "Too many open files in system")}
    loop.now = 120.0
    accept_filter(loop, transport_error)
    assert warnings_from(logs) == [
        "socket.accept() out of system resource ([Errno 24] Too many open files)",
        "socket.accept() out of system resource ([Errno 24] Too many open files) (49 more since the last such "
        "warning)",
        "Error on transport creation for incoming connection ([Errno 23] Too many open files in system) (49 more "
        "since the last such "
        "warning)",
    ]
    previous_calls = []
    chained = AcceptErrorFilter(previous=lambda lp, ctx: previous_calls.append(ctx))
    chained(loop, {"message": "unrelated"})
    accept_filter(loop, {"message": "unrelated"})
    assert previous_calls == [{"message": "unrelated"}] and loop.forwarded == [{"message": "unrelated"}]


# --- limits ------------------------------------------------------------------------------------

def test_resolve_limits_derives_and_caps_max_connections_from_the_fd_limit(logs):
    default = resolve_limits()
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert default.max_connections == soft - min(FD_RESERVE, soft // 2)
    assert resolve_limits(ConnectionLimits(max_connections=10**9)).max_connections == default.max_connections
    assert len(warnings_from(logs)) == 1
    assert resolve_limits(ConnectionLimits(max_connections=7)).max_connections == 7
    assert resolve_limits(ConnectionLimits(header_timeout_s=3)).header_timeout_s == 3
    for bad in ({"max_connections": 0}, {"header_timeout_s": 0}, {"body_timeout_s": -1}, {"max_line_size": 0}):
        with pytest.raises(ValueError):
            ConnectionLimits(**bad)


# --- a real low open-file limit ----------------------------------------------------------------

LOW_FD_SERVER = textwrap.dedent("""
    import asyncio, logging, resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))  # soft and hard: start_server cannot raise it
    from aiohttp import web
    from serve.server import serve_until_stopped

    async def health(request):
        return web.json_response({"status": "ok"})

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    app = web.Application()
    app.router.add_get("/health", health)
    asyncio.run(serve_until_stopped(app, "127.0.0.1", 0, on_ready=lambda port: print(port, flush=True)))
""")


def test_a_flood_under_a_low_fd_limit_is_shed_quietly_and_health_recovers():
    proc = subprocess.Popen([sys.executable, "-c", LOW_FD_SERVER], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    held: list[socket.socket] = []
    try:
        port = int(proc.stdout.readline())  # blocks until the server is ready (or exits: int('') fails)
        failed = 0
        for _ in range(300):  # more than the 256 descriptors the server may hold
            try:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            except OSError:
                failed += 1
        time.sleep(0.5)
        assert proc.poll() is None and failed < 50
        for sock in held:
            sock.close()
        held.clear()
        time.sleep(0.2)

        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(HEALTH)
            status, _, body = read_response(sock)
        elapsed = time.monotonic() - start
        assert status == 200 and json.loads(body) == {"status": "ok"}
        assert elapsed < 1.5  # at worst asyncio's 1 s pause of accept() after an EMFILE
    finally:
        for sock in held:
            sock.close()
        proc.terminate()
        try:
            _, stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "ERROR" not in stderr, stderr[-3000:]
    warning_lines = [line for line in stderr.splitlines() if line.startswith("WARNING")]
    assert 1 <= len(warning_lines) <= 6, stderr[-3000:]
    assert "at most 128 connections" in stderr  # 256 descriptors, half kept in reserve

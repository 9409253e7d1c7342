"""No request can hurt another: hostile input against a live `jaxserve serve` on the tiny model.

One server process (real engine, SmolLM2's tokenizer, an API key, an open-file limit of 1024 and a
KV pool smaller than max_model_len) takes every reproduction of the operator's report. Each test
checks the refusal (or the survival), that streams running on the same server meanwhile finish with
every token, and that the server's log gained no traceback.
"""
from __future__ import annotations

import json
import queue
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests

pytestmark = pytest.mark.slow  # servers, raw sockets: out of `make test-quick`

API_KEY = "hostile-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PAGE_SIZE, NUM_PAGES = 8, 30
POOL_TOKENS = (NUM_PAGES - 1) * PAGE_SIZE  # 232: page 0 is the null page; the model's context is 256
FD_LIMIT = 1024
HEADER_TIMEOUT_S = 6.0  # how long the slowloris test waits for the server to close idle connections
_SERVE = "import sys; from jaxserve.commands import cli; sys.exit(cli.main(['jaxserve', 'serve', *sys.argv[1:]]))"


class ServeProcess:
    """`jaxserve serve` in a subprocess; its stderr lines are collected as they come."""

    def __init__(self, args: list[str], fd_limit: int):
        root = Path(__file__).resolve().parents[1]
        self.process = subprocess.Popen([sys.executable, "-c", _SERVE, *args], cwd=root, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)
        # As `ulimit -n` would, before the server starts listening (it cannot raise a hard limit).
        resource.prlimit(self.process.pid, resource.RLIMIT_NOFILE, (fd_limit, fd_limit))
        self.lines: list[str] = []
        ports: queue.Queue = queue.Queue()

        def read():
            for line in self.process.stderr:
                self.lines.append(line)
                match = re.search(r"serving on http://[\d.]+:(\d+)", line)
                if match:
                    ports.put(int(match.group(1)))
            ports.put(None)
        threading.Thread(target=read, daemon=True).start()
        port = ports.get(timeout=300)
        assert port is not None, "the server did not start:\n" + "".join(self.lines)
        self.url = f"http://127.0.0.1:{port}"
        self.port = port

    def log_since(self, mark: int) -> str:
        return "".join(self.lines[mark:])

    def metric(self, name: str, labels: str = "") -> float:
        """The sample `name` whose labels include `labels` ('{a="b"}'; every sample also has model_name)."""
        text = requests.get(self.url + "/metrics", timeout=10).text
        wanted = re.findall(r'(\w+)="([^"]*)"', labels)
        for line in text.splitlines():
            match = re.fullmatch(rf"{re.escape(name)}(?:\{{(.*)\}})? ([-+0-9.eE]+)", line)
            if match and all(f'{key}="{value}"' in (match.group(1) or "") for key, value in wanted):
                return float(match.group(2))
        return 0.0

    def close(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir):
    live = ServeProcess([f"--model={tiny_chat_model_dir}", "--port=0", f"--api_key={API_KEY}",
                         "--served_model_name=tiny,smollm2", f"--page_size={PAGE_SIZE}", f"--num_pages={NUM_PAGES}",
                         "--max_num_seqs=4", "--max_num_batched_tokens=64", "--max_waiting_requests=64",
                         f"--header_timeout_s={HEADER_TIMEOUT_S}", "--drain_timeout_s=2"], FD_LIMIT)
    yield live
    live.close()


@pytest.fixture
def clean_log(server):
    """Asserts that the server logged no traceback while the test ran."""
    mark = len(server.lines)
    yield
    time.sleep(0.2)  # let the last lines arrive
    log = server.log_since(mark)
    assert "Traceback" not in log and " ERROR " not in log, log


def post(server, path: str, body, headers=None, timeout: float = 60) -> requests.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(server.url + path, data=data, timeout=timeout,
                         headers={"Content-Type": "application/json", **AUTH, **(headers or {})})


class Streams:
    """`n` streaming completions running in threads while a test attacks the server;
    `check()` asserts that each one got all of its tokens and finished with "length"."""

    def __init__(self, server, n: int = 3, max_tokens: int = 40):
        self.max_tokens = max_tokens
        self.results: list = [None] * n
        self.texts: list = [None] * n  # each stream's text (greedy: what it would be alone)
        self.threads = [threading.Thread(target=self._run, args=(server, i), daemon=True) for i in range(n)]
        for thread in self.threads:
            thread.start()

    def _run(self, server, index: int) -> None:
        body = {"model": "tiny", "prompt": f"stream {index}:", "max_tokens": self.max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0.0, "stream_options": {"include_usage": True}}
        try:
            with requests.post(server.url + "/v1/completions", json=body, headers=AUTH, stream=True,
                               timeout=120) as response:
                # Bytes lines: str.splitlines would also split generated text at U+2028 and the like.
                events = [line[6:].decode() for line in response.iter_lines() if line.startswith(b"data: ")]
            chunks = [json.loads(e) for e in events[:-1]]
            reasons = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
            self.texts[index] = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
            self.results[index] = (events[-1], chunks[-1]["usage"]["completion_tokens"], reasons[-1])
        except Exception as e:  # reported by check()
            self.results[index] = repr(e)

    def check(self) -> None:
        for thread in self.threads:
            thread.join(120)
        assert self.results == [("[DONE]", self.max_tokens, "length")] * len(self.threads)


HOSTILE_BODIES = [  # (body, param): each passed the old validation or crashed it
    ({"prompt": "x", "max_tokens": 3, "top_k": 2147483648}, "top_k"),  # overflowed the step's int32 array
    ({"prompt": "x", "max_tokens": 3, "repetition_penalty": 1e-300}, "repetition_penalty"),  # 0 in float32
    ({"prompt": "x", "max_tokens": 3, "repetition_penalty": 1e308}, "repetition_penalty"),  # inf in float32
    ({"prompt": "x", "max_tokens": 3, "stop_token_ids": [10**12]}, "stop_token_ids"),
    ({"prompt": "x", "max_tokens": 3, "stop_token_ids": list(range(5000))}, "stop_token_ids"),
    ({"prompt": "x", "max_tokens": 3, "stop": ["s" * 100_000]}, "stop"),
    ({"prompt": "x", "max_tokens": 3, "logprobs": 10**6}, "logprobs"),
    ({"prompt": [0, 10**15], "max_tokens": 3}, "prompt"),
    ({"prompt": "\ud800", "max_tokens": 3}, "prompt"),  # a lone surrogate: was a 500 with a traceback
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ({"prompt": "x", "max_tokens": 3, "seed": 2**64}, "seed"),
]


def test_hostile_values_are_400_naming_the_field_and_streams_finish(server, clean_log):
    streams = Streams(server)
    for body, param in HOSTILE_BODIES * 2:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = post(server, path, {"model": "tiny", **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param
    streams.check()
    assert requests.get(server.url + "/health", timeout=5).json()["num_step_failures"] == 0


def _health_latencies(server, stop: threading.Event) -> list[float]:
    latencies = []
    while not stop.is_set():
        start = time.monotonic()
        assert requests.get(server.url + "/health", timeout=10).status_code == 200
        latencies.append(time.monotonic() - start)
        time.sleep(0.05)
    return latencies


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "tiny", "prompt": "word " * 1_600_000}),  # 8 MB of text
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "word " * 1_600_000}]}),
])
def test_a_huge_prompt_is_refused_before_tokenizing_and_health_answers_within_1s(server, clean_log, path, body):
    rss_before = psutil.Process(server.process.pid).memory_info().rss
    streams = Streams(server)
    stop, latencies = threading.Event(), []
    poller = threading.Thread(target=lambda: latencies.extend(_health_latencies(server, stop)), daemon=True)
    poller.start()
    start = time.monotonic()
    r = post(server, path, body)
    elapsed = time.monotonic() - start
    stop.set()
    poller.join(30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "characters" in r.json()["error"]["message"]
    assert latencies and max(latencies) < 1.0, (latencies, elapsed)
    streams.check()
    growth = psutil.Process(server.process.pid).memory_info().rss - rss_before
    assert growth < 200 * 2**20, f"RSS grew by {growth / 2**20:.0f} MiB"  # tokenizing it took ~950 MiB


def test_the_effective_context_is_advertised_and_max_tokens_never_silently_truncated(server, clean_log):
    models = requests.get(server.url + "/v1/models", headers=AUTH, timeout=10).json()["data"]
    assert [m["id"] for m in models] == ["tiny", "smollm2"]
    assert {m["max_model_len"] for m in models} == {POOL_TOKENS}  # the pool, not the model's 256
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 250})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert f"maximum context length is {POOL_TOKENS} tokens (the KV cache holds {POOL_TOKENS} tokens; " \
           "max_model_len is 256)" in r.json()["error"]["message"]
    prompt = [1, 2, 3]
    r = post(server, "/v1/completions", {"model": "smollm2", "prompt": prompt, "ignore_eos": True,
                                         "max_tokens": POOL_TOKENS - len(prompt)}, timeout=120)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["model"] == "smollm2"
    assert answer["usage"]["completion_tokens"] == POOL_TOKENS - len(prompt)
    assert answer["choices"][0]["finish_reason"] == "length"
    path_id = post(server, "/v1/completions", {"model": server.process.args[3][len("--model="):], "prompt": "x"})
    assert path_id.status_code == 404  # a filesystem path is never a model id


def _raw_request(server, data: bytes, read_timeout: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=read_timeout) as sock:
        sock.sendall(data)
        received = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return received
            received += chunk


def _status_and_json(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


def test_a_non_utf8_authorization_header_is_401(server, clean_log):
    raw = _raw_request(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
                               b"Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
    status, body = _status_and_json(raw)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("data", [
    b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",  # request line over 8 KB
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 9000 + b"\r\n\r\n",  # header over 8 KB
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
])
def test_malformed_http_is_a_json_400_and_one_warning(server, clean_log, data):
    mark = len(server.lines)
    status, body = _status_and_json(_raw_request(server, data))
    assert status == 400 and body["error"]["code"] == "bad_http_request"
    time.sleep(0.2)
    warnings = [line for line in server.lines[mark:] if "WARNING" in line]
    assert len(warnings) == 1 and "malformed HTTP request" in warnings[0]


def _post_with_expect(server, path: bytes, expect: bytes) -> bytes:
    body = b'{"model": "tiny", "prompt": "x", "max_tokens": 1}'
    return _raw_request(server, b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nExpect: " + expect + b"\r\n"
                        b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Type: application/json\r\n"
                        b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)


@pytest.mark.parametrize("path", [b"/v1/completions", b"/no/such/route"])
def test_an_unknown_expectation_is_a_json_417(server, clean_log, path):
    status, body = _status_and_json(_post_with_expect(server, path, b"banana"))
    assert status == 417 and body["error"]["code"] == "expectation_failed", body
    assert "banana" in body["error"]["message"] and body["error"]["type"] == "invalid_request_error"


def test_100_continue_is_still_answered_before_the_request(server, clean_log):
    raw = _post_with_expect(server, b"/v1/completions", b"100-continue")
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"
    assert raw.startswith(interim), raw[:200]
    status, body = _status_and_json(raw[len(interim):])
    assert status == 200 and body["usage"]["completion_tokens"] == 1, body


def _open_idle(server, count: int, first_bytes: bytes = b"") -> list[socket.socket]:
    """`count` connections to the server, each sent `first_bytes` (if any) right after it connects."""
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        if first_bytes:
            sock.sendall(first_bytes)
        sockets.append(sock)
    return sockets


def test_half_open_connections_are_closed_and_a_flood_past_the_fd_limit_is_shed(server, clean_log):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1400:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))  # this process holds 1100+ sockets
    streams = Streams(server)
    mark = len(server.lines)
    idle = _open_idle(server, 300)
    idle[0].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # a partial head (slowloris)
    start = time.monotonic()
    assert requests.get(server.url + "/health", timeout=5).status_code == 200
    assert time.monotonic() - start < 1.0
    for sock in idle:  # the server closes each one after the header timeout
        sock.settimeout(HEADER_TIMEOUT_S + 10)
        assert sock.recv(1) == b""
        sock.close()
    cap = int(re.search(r"at most (\d+) connections", "".join(server.lines)).group(1))
    assert cap < FD_LIMIT
    with requests.Session() as kept_alive:  # a client connected before the flood keeps being served
        assert kept_alive.get(server.url + "/health", timeout=5).status_code == 200
        # Past the server's 1024 open files. Each flood connection asks for /health at once and keeps
        # the connection open (keep-alive, 30 s), so an admitted one holds its slot however long the
        # flood takes to open; the ones past the cap get a 503 without being read.
        flood = _open_idle(server, 1100, first_bytes=b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            start = time.monotonic()
            assert kept_alive.get(server.url + "/health", timeout=5).status_code == 200
            assert time.monotonic() - start < 1.0
            answers = []
            for sock in flood:
                sock.settimeout(10)
                answers.append(sock.recv(12))
            assert set(answers) <= {b"HTTP/1.1 200", b"HTTP/1.1 503"}, set(answers)
            assert answers.count(b"HTTP/1.1 200") < cap  # the kept-alive client holds a slot as well
            assert answers.count(b"HTTP/1.1 503") > len(flood) - cap
        finally:
            for sock in flood:
                sock.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # once the flood is gone, a fresh connection is served again
        try:
            if requests.get(server.url + "/health", timeout=1).status_code == 200:
                break
        except requests.RequestException:
            pass
        time.sleep(0.1)
    assert requests.get(server.url + "/health", timeout=1).status_code == 200
    streams.check()
    warnings = [line for line in server.lines[mark:] if "WARNING" in line]
    assert 1 <= len(warnings) <= 3, warnings  # one line for the refusals, not one per connection


def test_requests_cancelled_while_queued_count_as_aborted(server, clean_log):
    aborted_before = server.metric("jaxserve_requests_finished_total", '{finish_reason="abort"}')
    # Each blocker needs almost the whole KV pool, so they run one at a time (~0.5 s each) and the
    # requests below stay queued behind them for seconds.
    blockers = Streams(server, n=8, max_tokens=POOL_TOKENS - 32)
    time.sleep(0.3)
    body = json.dumps({"model": "tiny", "prompt": "queued", "max_tokens": 20, "stream": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() +
               b"\r\n\r\n" + body)
    cancelled = []
    for _ in range(5):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.sendall(request)
        cancelled.append(sock)
    time.sleep(0.1)
    num_unanswered = 0  # a stream's headers go out with its first token: no bytes yet = still queued
    for sock in cancelled:
        sock.setblocking(False)
        try:
            sock.recv(1)
        except BlockingIOError:
            num_unanswered += 1
        sock.close()
    assert num_unanswered >= 1, "no request was still queued when its client went away"
    blockers.check()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and server.metric(
            "jaxserve_requests_finished_total", '{finish_reason="abort"}') < aborted_before + 5:
        time.sleep(0.1)
    assert server.metric("jaxserve_requests_finished_total", '{finish_reason="abort"}') == aborted_before + 5
    assert server.metric("jaxserve_kv_pages_used") == 0

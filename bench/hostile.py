"""Hostile requests for the soak test (bench/soak.py --hostile_every_s): a fixed list of requests a
hardened server must refuse with a 4xx without hurting anyone else, and the checks of their answers.

Kinds (`KINDS`), each with the answer it must get:
  - JSON requests the admission check refuses (400): top_k beyond int32, a repetition_penalty of
    1e-300, lone surrogates in a prompt and in a chat message, a ~4 MB prompt (refused as
    context_length_exceeded before any tokenizing), max_tokens beyond the context, an unknown
    model (404), a body that is not JSON;
  - malformed HTTP sent over a raw socket (400 bad_http_request, JSON body): a 9 KB request line,
    a 9 KB header, `Content-Length: -1`;
  - half-open connections: a few TCP connections that send nothing; the server must close each of
    them within its header timeout (plus some slack). A socket still open at the deadline is closed
    by the client and counted as unexpected;
  - grammars and tools: a 3000-rule chain grammar (200: it once overflowed the compiler's stack), a
    new runaway regex each time (400: past the grammar memory budget), a self-recursive grammar and a
    recursive required `$ref` schema (400), a tool_choice naming a list (400), tool-call arguments
    nested 900 deep (400).

`Hostile.fire()` sends the next kind of a seeded shuffle of the list (every kind once per round);
`Hostile.report()` counts them by kind and status. Anything else than the expected answer (a 5xx,
another status, no JSON error body, a connection error, a socket left open) is "unexpected".
"""
from __future__ import annotations

import asyncio
import collections
import json
import random
import time
from typing import Any, Callable
from urllib.parse import urlsplit

import aiohttp

HUGE_PROMPT_BYTES = 4_000_000  # well under the server's 8 MiB body limit, far over any context
LONG_FIELD_BYTES = 9 * 1024  # over aiohttp's 8190-byte request-line and header-field limits
NUM_HALF_OPEN = 3  # sockets per half-open burst
RAW_READ_TIMEOUT_S = 15.0  # a raw-socket request must be answered (and closed) within this
# 3000 rules in a chain (62 KB): overflowed llguidance's stack on a default-sized thread (SIGSEGV)
RULE_CHAIN_3000 = "start: r0\n" + "".join(f'r{i}: "t{i} " r{i + 1}\n' for i in range(3000)) + 'r3000: "end"\n'


class Expect:
    """An expected answer: `status`, and where given the error `code` of the JSON body.
    status None: the server closes the connection (with or without a 4xx)."""

    def __init__(self, status: int | None, code: str | None = None):
        self.status, self.code = status, code

    def __str__(self) -> str:
        if self.status is None:
            return "closed by the server"
        return f"{self.status}{' ' + self.code if self.code else ''}"


def _json_body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()  # ensure_ascii: a lone surrogate travels as "\ud800"


def _huge_prompt_body() -> bytes:
    words = "the quick brown fox jumps over the lazy dog "
    text = (words * (HUGE_PROMPT_BYTES // len(words) + 1))[:HUGE_PROMPT_BYTES]
    return _json_body(prompt=text, max_tokens=4)


def _raw(host: str, head: str, body: bytes = b"") -> bytes:
    return (head.replace("{host}", host) + "\r\n\r\n").encode() + body


class Hostile:
    """Sends hostile requests to `url` and checks the answers (see the module docstring)."""

    def __init__(self, url: str, seed: int, max_model_len: int | None, header_timeout_s: float,
                 close_slack_s: float = 10.0):
        self.url = url
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        self.rng = random.Random(f"hostile-{seed}")  # its own stream: the normal load stays the same
        self.close_deadline_s = header_timeout_s + close_slack_s
        too_many = (max_model_len or 1 << 20) + 1
        host = f"{self.host}:{self.port}"
        ctx = Expect(400, "context_length_exceeded")
        bad_http = Expect(400, "bad_http_request")
        completions, chat = "/v1/completions", "/v1/chat/completions"
        # name -> (how to send it, its argument, the answer it must get)
        self.kinds: dict[str, tuple[Callable, Any, Expect]] = {
            "top_k_int32_overflow": (self._post, (completions, _json_body(prompt="Hi", max_tokens=4, top_k=2**31)),
                                     Expect(400)),
            "repetition_penalty_1e-300": (self._post, (completions, _json_body(
                prompt="Hi", max_tokens=4, repetition_penalty=1e-300)), Expect(400)),
            "lone_surrogate_prompt": (self._post, (completions, _json_body(prompt="a\ud800b", max_tokens=4)),
                                      Expect(400)),
            "lone_surrogate_chat": (self._post, ("/v1/chat/completions", _json_body(
                messages=[{"role": "user", "content": "\ud800"}], max_tokens=4)), Expect(400)),
            "prompt_4mb": (self._post, (completions, _huge_prompt_body()), ctx),
            "max_tokens_over_context": (self._post, (completions, _json_body(prompt="Hi", max_tokens=too_many)),
                                        ctx),
            "unknown_model": (self._post, (completions, _json_body(prompt="Hi", max_tokens=4, model="no-such")),
                              Expect(404, "model_not_found")),
            "body_not_json": (self._post, (completions, b'{"prompt": "Hi", "max_tokens":'), Expect(400)),
            "request_line_9kb": (self._raw, _raw(host, f"GET /health?{'a' * LONG_FIELD_BYTES} HTTP/1.1\r\n"
                                                       "Host: {host}"), bad_http),
            "header_9kb": (self._raw, _raw(host, f"GET /health HTTP/1.1\r\nHost: {{host}}\r\n"
                                                 f"X-Padding: {'a' * LONG_FIELD_BYTES}"), bad_http),
            "content_length_-1": (self._raw, _raw(host, "POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
                                                        "Content-Type: application/json\r\nContent-Length: -1",
                                                  b'{"prompt": "Hi"}'), bad_http),
            "half_open_sockets": (self._half_open, NUM_HALF_OPEN, Expect(None)),
            # Grammars and tools (each crashed, poisoned or stalled the server once):
            "grammar_rule_chain_3000": (self._post, (completions, _json_body(
                prompt="Hi", max_tokens=4, guided_grammar=RULE_CHAIN_3000)), Expect(200)),
            "grammar_runaway_regex": (self._post_runaway_regex, completions, Expect(400)),
            "grammar_self_recursive": (self._post, (completions, _json_body(
                prompt="Hi", max_tokens=4, guided_grammar='start: "a" start')), Expect(400)),
            "schema_recursive_ref": (self._post, (completions, _json_body(prompt="Hi", max_tokens=4, guided_json={
                "type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]})), Expect(400)),
            "tool_choice_name_list": (self._post, (chat, _json_body(
                messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice={"type": "function", "function": {"name": ["f"]}})), Expect(400)),
            "tool_call_arguments_nested": (self._post, (chat, _json_body(messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
                    "name": "f", "arguments": '{"a":' * 900 + "1" + "}" * 900}}]},
                {"role": "tool", "tool_call_id": "c", "content": "ok"}], max_tokens=4)), Expect(400)),
        }
        self._runaway_regexes = 0
        self._round: list[str] = []
        self.sent: collections.Counter = collections.Counter()
        self.statuses: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.unexpected: collections.Counter = collections.Counter()
        self.close_s: dict[str, list[float]] = collections.defaultdict(list)
        self.problems: list[str] = []  # the first few unexpected answers, for the report
        self.tasks: set[asyncio.Task] = set()
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "Hostile":
        # A connection per request: the server closes some of them after the answer.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                             timeout=aiohttp.ClientTimeout(total=60))
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.session.close()

    def fire(self) -> None:
        """Starts the next hostile request in the background (see `wait`)."""
        if not self._round:
            self._round = list(self.kinds)
            self.rng.shuffle(self._round)
        name = self._round.pop()
        task = asyncio.create_task(self._one(name))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def wait(self) -> None:
        """Waits for every hostile request still in flight (half-open sockets take the longest)."""
        if self.tasks:
            await asyncio.gather(*self.tasks)

    async def _one(self, name: str) -> None:
        send, argument, expect = self.kinds[name]
        try:
            answers = await send(argument)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as e:
            answers = [dict(status=None, code=None, error=f"{type(e).__name__}: {e}")]
        for answer in answers:
            self.sent[name] += 1
            status = answer.get("status")
            self.statuses[name][str(status) if status is not None else answer.get("outcome", "error")] += 1
            if "close_s" in answer:
                self.close_s[name].append(answer["close_s"])
            problem = self._check(answer, expect)
            if problem:
                self.unexpected[name] += 1
                if len(self.problems) < 10:
                    self.problems.append(f"{name}: {problem}")

    @staticmethod
    def _check(answer: dict, expect: Expect) -> str | None:
        """None when `answer` is the expected one, else what is wrong with it."""
        if answer.get("error"):
            return answer["error"]
        status = answer.get("status")
        if expect.status is None:  # half-open: closed by the server, with nothing or a 4xx
            if answer.get("outcome") != "closed":
                return f"{answer.get('outcome')} after {answer.get('close_s', 0):.1f}s"
            return None if status is None or 400 <= status < 500 else f"closed with HTTP {status}"
        if status != expect.status:
            return f"HTTP {status} (expected {expect})"
        if status == 200:  # a request the server must survive and serve
            return None
        if answer.get("code") is _NOT_JSON:
            return f"HTTP {status} without a JSON error body"
        if expect.code and answer.get("code") != expect.code:
            return f"HTTP {status} code {answer.get('code')!r} (expected {expect.code!r})"
        return None

    async def _post(self, argument: tuple[str, bytes]) -> list[dict]:
        path, body = argument
        async with self.session.post(self.url + path, data=body,
                                     headers={"Content-Type": "application/json"}) as response:
            text = await response.read()
        return [dict(status=response.status, code=_error_code(text))]

    async def _post_runaway_regex(self, path: str) -> list[dict]:
        """A regex whose first token mask takes about a second and 150 MiB, a new one each time
        (a refusal cached by the server would not exercise its budgets again)."""
        self._runaway_regexes += 1
        letters = "".join(chr(ord("a") + int(d)) for d in str(self._runaway_regexes))
        return await self._post((path, _json_body(prompt="Hi", max_tokens=4, guided_regex=f"({letters}{{1000}}){{1000}}")))

    async def _raw(self, request: bytes) -> list[dict]:
        """Writes `request` on a fresh socket and reads the answer until the server closes."""
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            try:
                writer.write(request)
                await writer.drain()
            except ConnectionError:
                pass  # the server may answer and close before reading everything; read what it said
            data = await asyncio.wait_for(_read_to_eof(reader), RAW_READ_TIMEOUT_S)
        finally:
            writer.close()
        head, _, body = data.partition(b"\r\n\r\n")
        status_line = head.split(b"\r\n", 1)[0].split()
        status = int(status_line[1]) if len(status_line) >= 2 and status_line[1].isdigit() else None
        if status is None:
            return [dict(status=None, code=None, error=f"no HTTP answer ({len(data)} bytes)")]
        return [dict(status=status, code=_error_code(body))]

    async def _half_open(self, count: int) -> list[dict]:
        """Opens `count` sockets that send nothing; each answer says whether the server closed it in time."""
        return list(await asyncio.gather(*(self._one_half_open() for _ in range(count))))

    async def _one_half_open(self) -> dict:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        start = time.monotonic()
        try:
            data = await asyncio.wait_for(_read_to_eof(reader), self.close_deadline_s)
        except asyncio.TimeoutError:
            return dict(status=None, outcome="still open", close_s=time.monotonic() - start)
        finally:
            writer.close()
        status_line = data.split(b"\r\n", 1)[0].split()
        status = int(status_line[1]) if len(status_line) >= 2 and status_line[1].isdigit() else None
        return dict(status=status, outcome="closed", close_s=time.monotonic() - start)

    def report(self) -> dict:
        """Per kind: sent, expected answer, statuses seen, unexpected count (and close times)."""
        kinds = {}
        for name, (_, _, expect) in self.kinds.items():
            entry = dict(sent=self.sent[name], expected=str(expect), statuses=dict(self.statuses[name]),
                         unexpected=self.unexpected[name])
            if self.close_s[name]:
                entry.update(close_s_min=min(self.close_s[name]), close_s_max=max(self.close_s[name]))
            kinds[name] = entry
        return dict(sent=sum(self.sent.values()), unexpected=sum(self.unexpected.values()),
                    close_deadline_s=self.close_deadline_s, kinds=kinds, problems=self.problems)


_NOT_JSON = object()


def _error_code(body: bytes) -> Any:
    """The `error.code` of an OpenAI-style JSON error body (None when it has none); _NOT_JSON otherwise."""
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return _NOT_JSON
    return error.get("code") if isinstance(error, dict) else _NOT_JSON


async def _read_to_eof(reader: asyncio.StreamReader) -> bytes:
    chunks = []
    try:
        while chunk := await reader.read(65536):
            chunks.append(chunk)
    except ConnectionError:
        pass  # a reset is a close too
    return b"".join(chunks)

"""The OpenAI-compatible server against a deterministic FakeEngine, on a loopback port.

The FakeEngine implements the AsyncEngine interface (generate / abort / stats / start / shutdown)
with a byte-level tokenizer, a bounded waiting queue and page accounting, so the tests can check
what the server does to the engine (aborts, pages back to 0) as well as what clients see.
"""
from __future__ import annotations

import asyncio
import functools
import http.client
import json
import math
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from jaxserve.commands import cli
from jaxserve.commands import engine_flags
from jaxserve.commands import serve as serve_command
from jaxserve.core.outputs import EngineStats, QueueFullError, RequestMetrics, RequestOutput, TokenLogprob
from jaxserve.core.request import RequestLimits, check_request
from serve.app import ServerConfig, create_app
from serve.metrics import ServerMetrics, token_count_buckets
from serve.server import serve_until_stopped

pytestmark = pytest.mark.slow  # servers, a SIGTERM subprocess: out of `make test-quick`

MODEL = "fake-model"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@functools.lru_cache(maxsize=None)
def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (GPT-2 byte alphabet) plus <s> (BOS, id 0) and </s> (EOS, id 1)."""
    vocab = {"<s>": 0, "</s>": 1}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def letter_ids() -> list[int]:
    return [byte_tokenizer().convert_tokens_to_ids(c) for c in "abcdefghijklmnopqrstuvwxyz"]


def fake_token_ids(prompt_ids: list[int], count: int, seed: int | None) -> list[int]:
    letters = letter_ids()
    return [letters[(sum(prompt_ids) + 7 * i + (seed or 0)) % 26] for i in range(count)]


def fake_text(prompt_ids: list[int], count: int, seed: int | None = None) -> str:
    return byte_tokenizer().decode(fake_token_ids(prompt_ids, count, seed))


class _FakeStream:
    """The fake's deltas; closed before the first one, it still ends the request (as RequestStream does)."""

    def __init__(self, deltas, closed_before_start) -> None:
        self.deltas, self.closed_before_start, self.started = deltas, closed_before_start, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        self.started = True
        return await self.deltas.__anext__()

    async def aclose(self) -> None:
        if not self.started:
            self.started = True
            self.closed_before_start()
        await self.deltas.aclose()


class FakeEngine:
    """Deterministic token streams; at most `max_running` run, `max_waiting` wait, more raise QueueFullError."""

    EOS = 1

    def __init__(self, *, max_model_len: int = 256, max_running: int = 8, max_waiting: int = 8,
                 token_delay_s: float = 0.001, page_size: int = 4, num_pages: int = 1024,
                 eos_after: int | None = None, fail_after: int | None = None, refuse: str | None = None) -> None:
        self.tokenizer = byte_tokenizer()
        self.model_name = MODEL
        self.max_model_len = max_model_len
        self.pooling = None  # a generating engine
        self.image_service = None  # a text model
        self.max_running, self.max_waiting = max_running, max_waiting
        self.token_delay_s = token_delay_s
        self.page_size, self.num_pages = page_size, num_pages
        self.eos_after, self.fail_after, self.refuse = eos_after, fail_after, refuse
        self.num_running = self.num_waiting = self.kv_pages_used = 0
        self.prefix_queried = self.prefix_hits = 0
        self.prompts: list[list[int]] = []
        self.health_report: dict = {}  # what health() adds (e.g. the warm-up's progress)
        self.params: list[Any] = []
        self.aborted: list[str] = []
        self.abort_calls: list[str] = []
        self.alive = False
        self.shutdown_calls = 0
        self._abort_requested: set[str] = set()
        self._slots: asyncio.Semaphore | None = None

    async def start(self) -> None:
        self._slots = asyncio.Semaphore(self.max_running)
        self.alive = True

    async def shutdown(self) -> None:
        self.alive = False
        self.shutdown_calls += 1

    def is_alive(self) -> bool:
        return self.alive

    def health(self) -> dict:
        return self.health_report

    def add_step_listener(self, listener) -> None:
        """The fake runs no steps: the listener is never called."""

    lora_enabled = False

    def lora_modules(self) -> list:
        return []

    async def load_lora_adapter(self, name: str, path: str) -> None:
        raise ValueError("LoRA is not enabled")

    async def unload_lora_adapter(self, name: str) -> None:
        raise ValueError("LoRA is not enabled")

    def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)
        self._abort_requested.add(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(self.num_running, self.num_waiting, self.kv_pages_used, self.num_pages, 0,
                           self.prefix_queried, self.prefix_hits)

    def generate(self, request_id: str, prompt_token_ids: list[int], params: Any, multimodal: Any = None):
        """Admission now (as AsyncEngine.generate), then the stream of deltas."""
        assert multimodal is None, "a text model's server passes no images"
        check_request(prompt_token_ids, params, RequestLimits(len(self.tokenizer), self.max_model_len,
                                                              self.max_model_len))
        if self.refuse:
            raise ValueError(self.refuse)
        if self.num_running + self.num_waiting >= self.max_running + self.max_waiting:
            raise QueueFullError(f"{self.num_waiting} requests waiting")
        self.prompts.append(list(prompt_token_ids))
        self.params.append(params)
        self.num_waiting += 1

        def closed_before_start():
            self.num_waiting -= 1
            self.aborted.append(request_id)
        return _FakeStream(self._deltas(request_id, prompt_token_ids, params), closed_before_start)

    async def _deltas(self, request_id: str, prompt_token_ids: list[int], params: Any):
        self.prefix_queried += len(prompt_token_ids)
        self.prefix_hits += len(prompt_token_ids) // 2
        num_prompt = len(prompt_token_ids)
        waiting, running, finished, pages = True, False, False, 0
        try:
            await self._slots.acquire()
            waiting, running = False, True
            self.num_waiting -= 1
            self.num_running += 1
            tokens = fake_token_ids(prompt_token_ids, params.max_tokens, params.seed)
            text = ""
            for i, token in enumerate(tokens):
                await asyncio.sleep(self.token_delay_s)
                if self.fail_after is not None and i == self.fail_after:
                    raise RuntimeError("the fake device fell over")
                if request_id in self._abort_requested:
                    finished = True
                    yield RequestOutput(request_id, [], "", True, "abort", num_prompt, i)
                    return
                reason = None
                if self.eos_after is not None and i == self.eos_after and not params.ignore_eos:
                    token, reason = self.EOS, "stop"
                new_pages = math.ceil((num_prompt + i + 1) / self.page_size)
                self.kv_pages_used += new_pages - pages
                pages = new_pages
                new_text = "" if reason else self.tokenizer.decode([token])
                for stop in params.stop:
                    if stop in text + new_text:
                        new_text = (text + new_text)[: (text + new_text).index(stop)][len(text):]
                        reason = "stop"
                text += new_text
                if i == len(tokens) - 1 and reason is None:
                    reason = "length"
                logprobs = None
                if params.logprobs is not None:
                    logprobs = [TokenLogprob(token, -0.5, [(token, -0.5), (self.EOS, -2.0)][: params.logprobs])]
                finished = reason is not None
                yield RequestOutput(request_id, [token], new_text, finished, reason, num_prompt, i + 1,
                                    new_logprobs=logprobs)
                if finished:
                    return
        finally:
            self.num_waiting -= waiting
            if running:
                self.num_running -= 1
                self._slots.release()
            self.kv_pages_used -= pages
            self._abort_requested.discard(request_id)
            if not finished:
                self.aborted.append(request_id)


class LiveServer:
    """The app on a loopback port, served by `serve_until_stopped` in a thread with its own loop."""

    def __init__(self, engine: FakeEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(config), self.loop).result(timeout=10)

    async def _start(self, config: ServerConfig) -> int:
        self.stop_event = asyncio.Event()
        ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.task = asyncio.create_task(serve_until_stopped(create_app(self.engine, config), "127.0.0.1", 0,
                                                            stop=self.stop_event, on_ready=ready.set_result))
        return await ready

    def stop(self, wait: bool = True) -> None:
        self.loop.call_soon_threadsafe(self.stop_event.set)
        if wait:
            self.wait_stopped()

    def wait_stopped(self) -> None:
        asyncio.run_coroutine_threadsafe(asyncio.wait_for(asyncio.shield(self.task), 30), self.loop).result()

    def close(self) -> None:
        if not self.task.done():
            self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=api_key, max_retries=0,
                             timeout=20)

    def request(self, method: str, path: str, body: Any = None, headers: dict | None = None):
        """(status, headers, parsed JSON or raw text) over a fresh connection."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=20)
        raw = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
        conn.request(method, path, body=raw, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        data = response.read().decode()
        conn.close()
        is_json = response.getheader("Content-Type", "").startswith("application/json")
        return response.status, dict(response.getheaders()), json.loads(data) if is_json else data

    def open_stream(self, path: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=20)
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        return conn, conn.getresponse()


def read_events(response: http.client.HTTPResponse, limit: int | None = None) -> list[str]:
    """SSE `data:` payloads, checking the `data: ...` + blank line framing."""
    events = []
    while limit is None or len(events) < limit:
        line = response.readline().decode()
        if not line:
            break
        assert line.startswith("data: ") and line.endswith("\n"), line
        assert response.readline() == b"\n"
        events.append(line[len("data: "):-1])
        if events[-1] == "[DONE]":
            break
    return events


def wait_until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


@pytest.fixture
def make_server():
    servers = []

    def make(config: ServerConfig | None = None, **engine_kwargs) -> LiveServer:
        server = LiveServer(FakeEngine(**engine_kwargs), config or ServerConfig(drain_timeout_s=5.0))
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def server(make_server) -> LiveServer:
    return make_server()


def encode(text: str) -> list[int]:
    return byte_tokenizer().encode(text)


def chat_prompt_ids(messages: list[dict]) -> list[int]:
    tokenizer = byte_tokenizer()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_completion_with_the_openai_client(server):
    result = server.client().completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0)
    assert result.object == "text_completion" and result.model == MODEL
    assert result.choices[0].text == fake_text(encode("Hello"), 5)
    assert result.choices[0].finish_reason == "length" and result.choices[0].index == 0
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.total_tokens) == (6, 5, 11)
    assert server.engine.prompts == [encode("Hello")]
    assert server.engine.params[0].temperature == 0.0 and server.engine.params[0].max_tokens == 5


def test_completion_defaults_to_16_tokens_and_accepts_token_ids(server):
    result = server.client().completions.create(model=MODEL, prompt=[40, 41, 42])
    assert result.choices[0].text == fake_text([40, 41, 42], 16)
    assert server.engine.prompts == [[40, 41, 42]]


def test_completion_stream_with_usage(server):
    chunks = list(server.client().completions.create(model=MODEL, prompt="Hello", max_tokens=6, stream=True,
                                                     stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == fake_text(encode("Hello"), 6)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == 6


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_return_token_ids_gives_the_prompt_and_each_choices_ids_as_vllm_does(server, chat, stream):
    """vLLM's return_token_ids: each choice's generated ids (streamed: each chunk's), and the
    prompt's ids (a completion choice's; a chat response's own, in the first chunk when streamed)."""
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": MODEL, "max_tokens": 5, "n": 2, "seed": 3, "return_token_ids": True, "stream": stream,
            **({"messages": messages} if chat else {"prompt": "Hello"})}
    prompt_ids = chat_prompt_ids(messages) if chat else encode("Hello")
    expected = [fake_token_ids(prompt_ids, 5, 3 + j) for j in range(2)]
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not stream:
        status, _, data = server.request("POST", path, body)
        assert status == 200, data
        assert [c["token_ids"] for c in data["choices"]] == expected
        if chat:
            assert data["prompt_token_ids"] == prompt_ids
        else:
            assert [c["prompt_token_ids"] for c in data["choices"]] == [prompt_ids, prompt_ids]
        return
    conn, response = server.open_stream(path, body)
    chunks = [json.loads(e) for e in read_events(response) if e != "[DONE]"]
    conn.close()
    for j in range(2):
        mine = [c for c in chunks if c["choices"] and c["choices"][0]["index"] == j]
        assert [t for c in mine for t in c["choices"][0]["token_ids"]] == expected[j]
        first = mine[0] if chat else mine[0]["choices"][0]
        assert first["prompt_token_ids"] == prompt_ids
        assert all("prompt_token_ids" not in c and "prompt_token_ids" not in c["choices"][0] for c in mine[1:])


def test_without_return_token_ids_no_ids_are_sent(server):
    status, _, data = server.request("POST", "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 3})
    assert status == 200 and "token_ids" not in data["choices"][0] and "prompt_token_ids" not in data["choices"][0]
    status, _, data = server.request("POST", "/v1/completions", {"model": MODEL, "prompt": "Hello",
                                                                 "return_token_ids": "yes"})
    assert status == 400 and data["error"]["param"] == "return_token_ids"


@pytest.mark.parametrize("chat", [False, True])
def test_stream_with_continuous_usage_stats_as_guidellm_sends_it(server, chat):
    """vLLM's stream_options.continuous_usage_stats: every content chunk carries the choice's usage
    so far; the last chunk the whole response's."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    client = server.client()
    if chat:
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=5, stream=True, stream_options=options))
        content = [c for c in chunks[1:-1] if c.choices]  # after the role chunk
    else:
        chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, stream=True,
                                                stream_options=options))
        content = [c for c in chunks[:-1] if c.choices]
    counts = [c.usage.completion_tokens for c in content]
    assert counts == sorted(counts) and counts[-1] == 5 and len(content) >= 2
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in content)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert content[0].usage.prompt_tokens == chunks[-1].usage.prompt_tokens


def test_chat_with_the_openai_client(server):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    result = server.client().chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=4)
    assert result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == fake_text(chat_prompt_ids(messages), 4)
    assert server.engine.prompts == [chat_prompt_ids(messages)]
    # no max tokens: the rest of the context
    server.client().chat.completions.create(model=MODEL, messages=messages)
    assert server.engine.params[-1].max_tokens == 256 - len(chat_prompt_ids(messages))


def test_chat_stream(server):
    messages = [{"role": "user", "content": "hi"}]
    chunks = list(server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                                          stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        fake_text(chat_prompt_ids(messages), 5)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 5 and len({c.id for c in chunks}) == 1


def test_raw_sse_framing_ends_with_done(server):
    conn, response = server.open_stream("/v1/completions", {"prompt": "abc", "max_tokens": 3, "stream": True})
    assert response.status == 200
    assert response.getheader("Content-Type").startswith("text/event-stream")
    events = read_events(response)
    conn.close()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 3 and all(c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert "usage" not in chunks[0]


def test_n_choices_get_distinct_seeds_and_indices(server):
    result = server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=4, n=3, seed=10)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert [c.text for c in result.choices] == [fake_text(encode("Hi"), 4, seed) for seed in (10, 11, 12)]
    assert result.usage.completion_tokens == 12 and result.usage.prompt_tokens == 3

    chunks = list(server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                          max_tokens=3, n=2, stream=True))
    by_index: dict[int, str] = {}
    finishes = []
    for chunk in chunks:
        choice = chunk.choices[0]
        by_index[choice.index] = by_index.get(choice.index, "") + (choice.delta.content or "")
        if choice.finish_reason:
            finishes.append(choice.index)
    assert sorted(finishes) == [0, 1] and set(by_index) == {0, 1}
    assert all(len(text) == 3 for text in by_index.values())


def test_stop_and_eos(make_server):
    server = make_server(eos_after=2)
    prompt_ids = encode("Hey")
    expected = fake_text(prompt_ids, 2)
    result = server.client().completions.create(model=MODEL, prompt="Hey", max_tokens=8)
    assert (result.choices[0].text, result.choices[0].finish_reason) == (expected, "stop")
    result = server.client().completions.create(model=MODEL, prompt="Hey", max_tokens=8,
                                                extra_body={"ignore_eos": True})
    assert len(result.choices[0].text) == 8
    stop = fake_text(prompt_ids, 2)[1]
    result = server.client().completions.create(model=MODEL, prompt="Hey", max_tokens=8, stop=[stop])
    assert result.choices[0].text == expected[:1] and result.choices[0].finish_reason == "stop"


def test_logprobs(server):
    result = server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=3, logprobs=2)
    logprobs = result.choices[0].logprobs
    assert "".join(logprobs.tokens) == result.choices[0].text
    assert logprobs.token_logprobs == [-0.5] * 3 and logprobs.text_offset == [0, 1, 2]
    assert all(set(top) == {token, "</s>"} for top, token in zip(logprobs.top_logprobs, logprobs.tokens))
    result = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                     max_tokens=2, logprobs=True, top_logprobs=1)
    content = result.choices[0].logprobs.content
    assert "".join(c.token for c in content) == result.choices[0].message.content
    assert all(len(c.top_logprobs) == 1 and c.bytes == list(c.token.encode()) for c in content)
    assert server.engine.params[-1].logprobs == 1


def test_models_and_health(server):
    status, _, body = server.request("GET", "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == [MODEL]
    assert server.request("GET", "/health")[:1] == (200,)
    assert [m.id for m in server.client().models.list()] == [MODEL]
    server.engine.alive = False
    assert server.request("GET", "/health")[0] == 503


def test_health_is_503_while_the_first_shapes_compile(server):
    warmup = {"ready": False, "compiled": 3, "total": 20, "error": None}
    server.engine.health_report = {"warmup": warmup}
    status, _, body = server.request("GET", "/health")
    assert (status, body) == (503, {"status": "warming up", "warmup": warmup})
    server.engine.health_report = {"warmup": {**warmup, "error": "RuntimeError: out of memory"}}
    status, _, body = server.request("GET", "/health")
    assert status == 503 and body["status"] == "warm-up failed"
    server.engine.health_report = {"warmup": {**warmup, "ready": True, "compiled": 9}}
    status, _, body = server.request("GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["warmup"]["compiled"] == 9


def test_model_entries_carry_vllms_fields(server):
    """`vllm bench serve` without --model takes `data[0].root`; vLLM's entries also have parent,
    max_model_len and permission."""
    entry = server.request("GET", "/v1/models")[2]["data"][0]
    assert entry["root"] == MODEL and entry["parent"] is None and entry["max_model_len"] == 256
    assert entry["permission"][0]["object"] == "model_permission" and entry["permission"][0]["allow_sampling"]
    assert server.request("GET", f"/v1/models/{MODEL}")[2] == entry


BAD_REQUESTS = [
    ("POST", "/v1/completions", b"{not json", 400, None),
    ("POST", "/v1/completions", b"\xff\xfe", 400, None),
    ("POST", "/v1/completions", [1, 2], 400, None),
    ("POST", "/v1/completions", b"[" * 100_000, 400, None),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("POST", "/v1/completions", {"prompt": ["a", 3]}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": ["a", "b"], "best_of": 2, "stream": True}, 400, "best_of"),
    ("POST", "/v1/completions", {"prompt": "x", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("POST", "/v1/completions", {"prompt": "x", "use_beam_search": True}, 400, "use_beam_search"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "store": True}, 400, "store"),
    ("POST", "/tokenize", {"prompt": 3}, 400, "prompt"),
    ("POST", "/tokenize", {"prompt": "x" * 1100}, 400, "prompt"),  # cannot fit even at 4 characters a token
    ("POST", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("GET", "/v1/models/nope", None, 404, "model"),
    ("POST", "/v1/completions", {"prompt": [5, 999999]}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": "x" * 300}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 255}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"model": "other", "prompt": "x"}, 404, "model"),
    ("POST", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("POST", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("POST", "/v1/nowhere", {}, 404, None),
    ("GET", "/v1/completions", None, 405, None),
]


def test_every_bad_request_gets_an_openai_error_and_the_server_stays_up(server):
    for method, path, body, expected_status, param in BAD_REQUESTS:
        status, headers, payload = server.request(method, path, body)
        assert status == expected_status, (path, body, payload)
        assert headers["Content-Type"].startswith("application/json")
        assert set(payload["error"]) == {"message", "type", "param", "code"}, payload
        assert payload["error"]["param"] == param and payload["error"]["message"]
    assert server.engine.prompts == []
    assert server.request("GET", "/health")[0] == 200
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=MODEL, prompt="x", top_p=2)
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="nope", prompt="x")
    assert server.client().completions.create(model=MODEL, prompt="x", max_tokens=1).choices[0].text


def test_body_size_limit_is_413_json(make_server):
    server = make_server(ServerConfig(max_body_bytes=2048))
    status, _, payload = server.request("POST", "/v1/completions", {"prompt": "x" * 5000})
    assert status == 413 and payload["error"]["code"] == "request_too_large"
    assert server.request("POST", "/v1/completions", {"prompt": "ok", "max_tokens": 1})[0] == 200


def test_engine_refusal_is_400_and_engine_failure_is_500(make_server):
    server = make_server(refuse="this engine refuses")
    status, _, payload = server.request("POST", "/v1/completions", {"prompt": "x"})
    assert status == 400 and payload["error"]["message"] == "this engine refuses"
    server = make_server(fail_after=0)
    status, _, payload = server.request("POST", "/v1/completions", {"prompt": "x"})
    assert status == 500 and payload["error"] == {"message": "internal server error", "type": "server_error",
                                                  "param": None, "code": "internal_error"}
    assert "fell over" not in json.dumps(payload)
    server.engine.fail_after = 2
    conn, response = server.open_stream("/v1/completions", {"prompt": "x", "stream": True})
    events = read_events(response)
    conn.close()
    assert response.status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "server_error"
    assert server.request("GET", "/health")[0] == 200
    assert server.engine.kv_pages_used == 0


def test_full_queue_is_429_with_retry_after(make_server):
    server = make_server(ServerConfig(retry_after_s=3), max_running=1, max_waiting=0, token_delay_s=0.02)
    conn, response = server.open_stream("/v1/completions", {"prompt": "x", "max_tokens": 100, "stream": True})
    assert read_events(response, limit=1)
    status, headers, payload = server.request("POST", "/v1/completions", {"prompt": "y"})
    assert status == 429 and headers["Retry-After"] == "3"
    assert payload["error"]["type"] == "rate_limit_error" and payload["error"]["code"] == "queue_full"
    with pytest.raises(openai.RateLimitError):
        server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "z"}])
    conn.close()
    assert wait_until(lambda: server.engine.num_running == 0)
    assert server.client().completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text


def test_a_refused_choice_aborts_the_accepted_ones(make_server):
    server = make_server(max_running=1, max_waiting=0, token_delay_s=0.02)
    status, headers, payload = server.request("POST", "/v1/completions", {"prompt": "x", "n": 2, "max_tokens": 50})
    assert status == 429 and "Retry-After" in headers
    assert len(server.engine.prompts) == 1
    assert len(server.engine.aborted) == 1 and server.engine.aborted[0].endswith("-0")
    assert server.engine.kv_pages_used == 0 and server.engine.num_running == 0


def test_client_disconnect_mid_stream_aborts_and_frees_pages(make_server):
    server = make_server(token_delay_s=0.02)
    conn, response = server.open_stream("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "long story"}], "max_tokens": 200, "stream": True})
    events = read_events(response, limit=4)
    assert len(events) == 4 and server.engine.kv_pages_used > 0
    assert server.engine.num_running == 1
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert wait_until(lambda: len(server.engine.aborted) == 1)
    assert wait_until(lambda: server.engine.kv_pages_used == 0 and server.engine.num_running == 0)


def test_an_abort_is_counted_when_the_disconnect_cancels_the_close(make_server, monkeypatch):
    """A write to a client that went away fails first, then aiohttp cancels the handler, which may
    then be closing the engine streams: the abort is still counted, once (the web page's Stop once
    left jaxserve_requests_finished_total without it). The cancellation is made to land there."""
    from serve import fanout

    close = fanout.ChoiceFanout.close

    async def close_then_cancelled(self):
        await close(self)
        raise asyncio.CancelledError  # the cancellation, landing while the handler closes

    monkeypatch.setattr(fanout.ChoiceFanout, "close", close_then_cancelled)
    server = make_server(token_delay_s=0.02)
    aborted = ("jaxserve_requests_finished_total", (("finish_reason", "abort"),))
    conn, response = server.open_stream("/v1/completions", {"prompt": "abc", "max_tokens": 200, "stream": True})
    read_events(response, limit=2)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert wait_until(lambda: server.engine.kv_pages_used == 0 and server.engine.num_running == 0)
    assert wait_until(lambda: metric_samples(server).get(aborted) == 1)
    time.sleep(0.2)
    assert metric_samples(server).get(aborted) == 1


def test_client_disconnect_before_a_non_streaming_answer_aborts(make_server):
    server = make_server(token_delay_s=0.02)
    sock = socket.create_connection(("127.0.0.1", server.port))
    body = json.dumps({"prompt": "x", "max_tokens": 200}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    assert wait_until(lambda: server.engine.kv_pages_used > 0)
    sock.close()
    assert wait_until(lambda: server.engine.aborted != [] and server.engine.kv_pages_used == 0)


def metric_samples(server: LiveServer) -> dict[tuple, float]:
    status, headers, text = server.request("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == MODEL, sample  # every sample names the served model (as vLLM)
            samples[(sample.name, tuple(sorted(labels.items())))] = sample.value
    return samples


def test_metrics_move_with_traffic(make_server):
    server = make_server(token_delay_s=0.02)
    before = metric_samples(server)
    assert before[("jaxserve_kv_pages_used", ())] == 0
    assert before[("jaxserve_kv_pages_capacity", ())] == server.engine.num_pages
    assert before[("jaxserve_generation_tokens_total", ())] == 0

    conn, response = server.open_stream("/v1/completions", {"prompt": "abc", "max_tokens": 50, "stream": True})
    read_events(response, limit=2)
    during = metric_samples(server)
    assert during[("jaxserve_num_requests_running", ())] == 1 and during[("jaxserve_kv_pages_used", ())] > 0
    conn.close()
    assert wait_until(lambda: server.engine.kv_pages_used == 0)

    server.client().completions.create(model=MODEL, prompt="abc", max_tokens=4)
    server.request("POST", "/v1/completions", {"prompt": "x", "top_p": 9})
    after = metric_samples(server)
    route = ("route", "/v1/completions")
    assert after[("jaxserve_http_requests_total", (route, ("status", "200")))] >= 1
    assert after[("jaxserve_http_requests_total", (route, ("status", "400")))] == 1
    assert after[("jaxserve_requests_finished_total", (("finish_reason", "length"),))] == 1
    assert after[("jaxserve_requests_finished_total", (("finish_reason", "abort"),))] == 1
    assert after[("jaxserve_generation_tokens_total", ())] >= 6
    assert after[("jaxserve_prompt_tokens_total", ())] == 2 * len(encode("abc"))
    assert after[("jaxserve_time_to_first_token_seconds_count", ())] == 2
    assert after[("jaxserve_e2e_request_latency_seconds_count", ())] == 2
    assert after[("jaxserve_time_per_output_token_seconds_count", ())] == 2
    assert after[("jaxserve_request_success_total", (("finished_reason", "length"),))] == 1  # vLLM's name and label
    assert after[("jaxserve_request_success_total", (("finished_reason", "abort"),))] == 1
    assert after[("jaxserve_inter_token_latency_seconds_count", ())] >= 4  # every delta after the first
    assert after[("jaxserve_request_generation_tokens_sum", ())] == after[("jaxserve_generation_tokens_total", ())]
    assert after[("jaxserve_request_prompt_tokens_sum", ())] == 2 * len(encode("abc"))
    assert after[("jaxserve_request_params_max_tokens_sum", ())] == 50 + 4
    assert after[("jaxserve_request_params_n_count", ())] == 2
    assert after[("jaxserve_prefix_cache_hit_rate", ())] == 0.5  # the fake engine hits half of every prompt
    assert after[("jaxserve_prefix_cache_queries_total", ())] == 2 * len(encode("abc"))
    assert after[("jaxserve_num_requests_running", ())] == 0


def test_the_engine_phase_times_of_a_finished_delta_feed_the_phase_histograms():
    metrics = ServerMetrics(lambda: EngineStats(0, 0, 0, 10, 0, 0, 0), MODEL, max_model_len=100)
    first, second = metrics.trackers(0.0, [(3, 5)], choices_per_prompt=2, n=2)
    phases = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.25, finished_time=13.0)
    first.observe(RequestOutput("a", [7, 8], "xy", True, "length", 3, 2, metrics=phases))
    second.observe(RequestOutput("b", [], "", True, "abort", 3, 0,
                                 metrics=RequestMetrics(10.0, None, None, 10.125)))  # never scheduled
    samples = {(s.name, s.labels.get("le")): s.value
               for family in text_string_to_metric_families(metrics.render()[0].decode()) for s in family.samples}
    for phase, seconds in (("queue", 0.5), ("prefill", 0.75), ("decode", 1.75), ("inference", 2.5)):
        assert samples[(f"jaxserve_request_{phase}_time_seconds_sum", None)] == seconds
        assert samples[(f"jaxserve_request_{phase}_time_seconds_count", None)] == 1  # not the one never scheduled
    assert samples[("jaxserve_request_max_num_generation_tokens_sum", None)] == 2  # once the prompt's last choice ends
    assert samples[("jaxserve_request_params_n_sum", None)] == 2
    assert [le for name, le in samples if name == "jaxserve_request_prompt_tokens_bucket"] == [
        "1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "+Inf"]  # 1-2-5 buckets up to max_model_len
    assert token_count_buckets(300)[-1] == 500 and token_count_buckets(None)[-1] == 1_000_000


def test_api_key(make_server):
    server = make_server(ServerConfig(api_key="sesame"))
    status, _, payload = server.request("POST", "/v1/completions", {"prompt": "x"})
    assert status == 401 and payload["error"]["code"] == "invalid_api_key"
    status, _, _ = server.request("GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert status == 401
    assert server.request("GET", "/v1/models", headers={"Authorization": "Bearer sesame"})[0] == 200
    assert server.request("GET", "/health")[0] == 200 and server.request("GET", "/metrics")[0] == 200
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").completions.create(model=MODEL, prompt="x")
    assert server.client("sesame").completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text
    assert server.engine.prompts == [encode("x")]


def test_shutdown_lets_in_flight_streams_finish(make_server):
    server = make_server(ServerConfig(drain_timeout_s=10), token_delay_s=0.01)
    conn, response = server.open_stream("/v1/completions", {"prompt": "x", "max_tokens": 30, "stream": True})
    first = read_events(response, limit=1)
    server.stop(wait=False)
    assert wait_until(lambda: _refuses_connections(server.port))
    events = first + read_events(response)
    conn.close()
    server.wait_stopped()
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == fake_text(encode("x"), 30)
    assert server.engine.aborted == [] and server.engine.shutdown_calls == 1


def test_shutdown_ends_streams_cleanly_after_the_drain_timeout(make_server):
    server = make_server(ServerConfig(drain_timeout_s=0.2), token_delay_s=0.05)
    conn, response = server.open_stream("/v1/completions", {"prompt": "x", "max_tokens": 200, "stream": True})
    read_events(response, limit=1)
    server.stop()
    events = read_events(response)
    conn.close()
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "shutting_down"
    assert len(server.engine.aborted) == 1 and server.engine.kv_pages_used == 0
    assert server.engine.shutdown_calls == 1


def _refuses_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return False
    except OSError:
        return True


def _fake_engine_module(built: list) -> types.ModuleType:
    module = types.ModuleType("jaxserve.async_engine")

    def build_async_engine(model: str, **engine_kwargs) -> FakeEngine:
        if model != MODEL:
            raise ValueError(f"no such model: {model}")
        built.append(engine_kwargs)
        return FakeEngine(token_delay_s=0.02)

    module.build_async_engine = build_async_engine
    return module


def test_serve_command_flags_and_bad_model(monkeypatch, capsys):
    built: list = []
    monkeypatch.setitem(sys.modules, "jaxserve.async_engine", _fake_engine_module(built))
    assert cli.main(["jaxserve", "serve", "--port=70000"]) == 2
    assert cli.main(["jaxserve", "serve", "--max_num_seqs=0"]) == 2
    assert cli.main(["jaxserve", "serve", "--model=missing", "--max_num_seqs=4", "--noenable_prefix_caching"]) == 2
    assert "no such model: missing" in capsys.readouterr().err
    fv = serve_command.flags.FlagValues()
    serve_command.define_flags(fv)
    fv(["serve", "--num_pages=64", "--dtype=float32"])
    assert (fv.host, fv.port, fv.model, fv.api_key) == ("127.0.0.1", 8000, "smollm2", None)
    assert engine_flags.engine_kwargs(fv) == {"num_pages": 64, "dtype": "float32"}


_SERVE_SCRIPT = """
import sys
from tests.test_server import _fake_engine_module
built = []
sys.modules["jaxserve.async_engine"] = _fake_engine_module(built)
from jaxserve.commands import cli
code = cli.main(["jaxserve", "serve", *sys.argv[1:]])
print("engine kwargs:", built, file=sys.stderr)
sys.exit(code)
"""


def test_sigterm_drains_in_flight_streams_then_exits_0():
    root = Path(__file__).resolve().parents[1]
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVE_SCRIPT, f"--model={MODEL}", "--port=0", "--max_num_seqs=3",
         "--drain_timeout_s=20", "--generation_config=none"],
        cwd=root, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stderr], daemon=True).start()
    try:
        port = None
        deadline = time.monotonic() + 60
        while port is None and time.monotonic() < deadline:
            match = re.search(r"serving on http://127\.0\.0\.1:(\d+)", lines.get(timeout=60))
            port = int(match.group(1)) if match else None
        assert port is not None
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "x", "max_tokens": 25, "stream": True}),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        events = read_events(response, limit=1)
        process.send_signal(signal.SIGTERM)
        events += read_events(response)
        conn.close()
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    logged = []
    while not lines.empty():
        logged.append(lines.get())
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == fake_text(encode("x"), 25)
    # the flag given, serve's own CPU default of the prefill bound beside decoding streams, and its
    # warm-up in the background
    assert ("engine kwargs: [{'max_num_seqs': 3, 'long_prefill_token_threshold': 32, 'background_warmup': True}]"
            in "".join(logged))


# ---- batched prompts, best_of, sampling defaults, the rest of the surface -------------------------
def test_batched_prompts_get_one_choice_each_times_n(server):
    prompts = ["ab", "cde"]
    result = server.client().completions.create(model=MODEL, prompt=prompts, max_tokens=3, n=2, seed=5)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert [c.text for c in result.choices] == [fake_text(encode(p), 3, seed) for p in prompts for seed in (5, 6)]
    assert server.engine.prompts == [encode("ab")] * 2 + [encode("cde")] * 2
    assert result.usage.prompt_tokens == len(encode("ab")) + len(encode("cde"))
    assert result.usage.completion_tokens == 12

    chunks = list(server.client().completions.create(model=MODEL, prompt=[[40, 41], [42]], max_tokens=2,
                                                     stream=True, stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        texts[chunk.choices[0].index] = texts.get(chunk.choices[0].index, "") + chunk.choices[0].text
    assert texts == {0: fake_text([40, 41], 2), 1: fake_text([42], 2)}
    assert (chunks[-1].choices, chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == ([], 3, 4)


def test_a_refused_prompt_of_a_batch_is_named_and_the_admitted_ones_abort(server):
    status, _, body = server.request("POST", "/v1/completions", {"prompt": ["ok", [1, 999999]], "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "prompt" and body["error"]["message"].startswith("prompt 1: ")
    assert wait_until(lambda: len(server.engine.aborted) == 1 and server.engine.kv_pages_used == 0)


def test_best_of_runs_every_candidate_and_returns_n(server):
    result = server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=4, n=1, best_of=3, seed=1)
    assert len(result.choices) == 1 and result.choices[0].index == 0 and result.choices[0].logprobs is None
    assert [p.logprobs for p in server.engine.params] == [0, 0, 0]  # ranked by the sampled tokens' logprobs
    assert [p.seed for p in server.engine.params] == [1, 2, 3]
    assert result.usage.completion_tokens == 12 and result.usage.prompt_tokens == len(encode("Hi"))


def test_sampling_defaults_fill_what_a_request_omits(make_server):
    defaults = {"temperature": 0.2, "top_p": 0.9, "top_k": 7}
    server = make_server(ServerConfig(sampling_defaults=defaults))
    server.client().completions.create(model=MODEL, prompt="x", max_tokens=1)
    server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                            temperature=0.0, top_p=1.0)
    omitted, given = server.engine.params
    assert (omitted.temperature, omitted.top_p, omitted.top_k) == (0.2, 0.9, 7)
    assert (given.temperature, given.top_p, given.top_k) == (0.0, 1.0, 7)
    status, _, body = server.request("GET", "/v1/models")
    assert body["data"][0]["sampling_defaults"] == defaults  # the defaults in effect are visible


def test_serve_reads_the_models_generation_config_and_the_flag(tmp_path, monkeypatch):
    with open(tmp_path / "generation_config.json", "w") as f:
        json.dump({"temperature": 0.6, "top_p": 0.95, "top_k": 0, "max_new_tokens": 64, "do_sample": True,
                   "repetition_penalty": 500, "eos_token_id": [1, 2]}, f)

    def defaults(*args):
        fv = serve_command.flags.FlagValues()
        serve_command.define_flags(fv)
        fv(["serve", *args])
        return serve_command.sampling_defaults(fv)

    monkeypatch.setattr("checkpoints.default_model.resolve_model", lambda model: str(tmp_path))
    got, line = defaults()
    assert got == {"temperature": 0.6, "top_p": 0.95, "top_k": 0, "max_tokens": 64}  # repetition_penalty refused
    assert "generation_config.json" in line and '"temperature": 0.6' in line
    got, line = defaults('--default_sampling={"temperature": 0.1, "presence_penalty": 0.5}')
    assert got == {"temperature": 0.1, "top_p": 0.95, "top_k": 0, "max_tokens": 64, "presence_penalty": 0.5}
    assert "--default_sampling" in line
    assert defaults("--generation_config=none")[0] == {}
    assert defaults(f"--generation_config={tmp_path}")[0]["temperature"] == 0.6


@pytest.mark.parametrize("flag, message", [
    ("--default_sampling={bad", "not valid JSON"),
    ('--default_sampling={"seed": 1}', "'seed' cannot be a sampling default"),
    ('--default_sampling={"temperature": 9}', "temperature must be in [0, 2]"),
    ("--generation_config=/no/such/folder", "is not 'auto', 'none' or a folder"),
])
def test_bad_sampling_default_flags_exit_2(flag, message, capsys):
    assert cli.main(["jaxserve", "serve", flag]) == 2
    assert message in capsys.readouterr().err


def test_tokenize_detokenize_and_model_by_id(server):
    status, _, body = server.request("POST", "/tokenize", {"model": MODEL, "prompt": "héllo"})
    assert status == 200 and body == {"tokens": encode("héllo"), "count": len(encode("héllo")), "max_model_len": 256,
                                      "token_strs": None}
    messages = [{"role": "user", "content": "x"}]
    status, _, body = server.request("POST", "/tokenize", {"messages": messages})
    assert body["tokens"] == chat_prompt_ids(messages)
    status, _, body = server.request("POST", "/detokenize", {"tokens": encode("héllo")[1:]})
    assert (status, body) == (200, {"prompt": "héllo"})
    status, _, body = server.request("GET", f"/v1/models/{MODEL}")
    assert status == 200 and body["id"] == MODEL and body["object"] == "model"
    assert server.client().models.retrieve(MODEL).id == MODEL


def test_hub_style_served_names_work_by_id(make_server):
    server = make_server(ServerConfig(served_model_names=("org/model-a", "alias")))
    assert server.request("GET", "/v1/models/org/model-a")[2]["id"] == "org/model-a"
    assert server.request("GET", "/v1/models/alias")[0] == 200
    assert server.request("GET", "/v1/models/org")[0] == 404
    assert server.client().completions.create(model="org/model-a", prompt="x", max_tokens=1).model == "org/model-a"


def test_unknown_fields_are_ignored_and_logged_unsupported_ones_refused(server, caplog):
    with caplog.at_level("WARNING", logger="serve.protocol"):
        result = server.client().completions.create(model=MODEL, prompt="x", max_tokens=2,
                                                    extra_body={"my_custom_field": 1})
    assert result.choices[0].text and "'my_custom_field'" in caplog.text
    with pytest.raises(openai.BadRequestError, match="'bad_words' is not supported"):
        server.client().completions.create(model=MODEL, prompt="x", extra_body={"bad_words": ["x"]})


def test_prompt_tokens_are_counted_once_per_prompt_and_kv_usage_is_a_fraction(make_server):
    server = make_server(token_delay_s=0.02)
    server.client().completions.create(model=MODEL, prompt=["ab", "c"], max_tokens=2, n=3)
    samples = metric_samples(server)
    assert samples[("jaxserve_prompt_tokens_total", ())] == len(encode("ab")) + len(encode("c"))
    assert samples[("jaxserve_requests_finished_total", (("finish_reason", "length"),))] == 6
    assert samples[("jaxserve_kv_cache_usage_perc", ())] == 0.0
    conn, response = server.open_stream("/v1/completions", {"prompt": "abc", "max_tokens": 50, "stream": True})
    read_events(response, limit=2)
    during = metric_samples(server)
    used, total = during[("jaxserve_kv_pages_used", ())], during[("jaxserve_kv_pages_capacity", ())]
    assert used > 0 and during[("jaxserve_kv_cache_usage_perc", ())] == used / total
    conn.close()
    assert wait_until(lambda: server.engine.kv_pages_used == 0)


def test_cors_covers_tokenize_and_detokenize(make_server):
    server = make_server(ServerConfig(allowed_origins=("http://ui.example",)))
    origin = {"Origin": "http://ui.example"}
    status, headers, _ = server.request("OPTIONS", "/tokenize", headers={**origin,
                                                                         "Access-Control-Request-Method": "POST"})
    assert status == 204 and headers["Access-Control-Allow-Origin"] == "http://ui.example"
    status, headers, body = server.request("POST", "/detokenize", {"tokens": encode("hi")[1:]}, headers=origin)
    assert (status, body["prompt"]) == (200, "hi") and headers["Access-Control-Allow-Origin"] == "http://ui.example"

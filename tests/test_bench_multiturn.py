"""`jaxserve bench serve --dataset_name=multiturn`: conversations whose turns repeat their history.

Host-only (no model, no jax): the conversations' random tokens and the per-turn statistics are
checked exactly; the run order, the concurrency and the history (each later prompt = the previous
prompt + the reply's token ids + new tokens) against an in-process send function, a fake
vLLM-like server on a loopback port (it returns each chunk's `token_ids`, or refuses the field as
jaxserve does and tokenizes on /tokenize), and jaxserve's own HTTP server on the tests'
FakeEngine. Timing bounds are coarse: asyncio.sleep never returns early, so a delay the fake sleeps
is a lower bound.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import pytest
from aiohttp import web

from jaxserve.benchmarks import runner
from jaxserve.benchmarks.client import RequestRecord
from jaxserve.benchmarks.datasets import (RANDOM_TOKEN_LOW, Conversation, multiturn_conversations, next_turn_prompt,
                                          random_requests)
from jaxserve.benchmarks.results import format_summary, ttft_by_turn
from tests.test_bench_serve import bench

VOCAB = 500  # tests.test_bench_serve.bench's --random_vocab_size


# --- the conversations' tokens ------------------------------------------------------------------

def test_conversations_are_seeded_and_start_with_the_random_datasets_prompts():
    conversations = multiturn_conversations(5, 3, 16, 6, 4, seed=3, vocab_size=VOCAB, prefix_len=2)
    assert conversations == multiturn_conversations(5, 3, 16, 6, 4, seed=3, vocab_size=VOCAB, prefix_len=2)
    other = multiturn_conversations(5, 3, 16, 6, 4, seed=4, vocab_size=VOCAB, prefix_len=2)
    assert [c.first_prompt for c in other] != [c.first_prompt for c in conversations]
    assert [c.turn_inputs for c in other] != [c.turn_inputs for c in conversations]
    firsts = random_requests(5, 16, 4, seed=3, vocab_size=VOCAB, prefix_len=2)
    assert [c.first_prompt for c in conversations] == [r.prompt for r in firsts]
    for c in conversations:
        assert len(c.first_prompt) == 18 and c.first_prompt[:2] == conversations[0].first_prompt[:2]
        assert [len(new) for new in c.turn_inputs] == [6, 6] and c.output_len == 4
        assert all(RANDOM_TOKEN_LOW <= t < VOCAB for new in c.turn_inputs for t in new)
    assert len({tuple(new) for c in conversations for new in c.turn_inputs}) == 10  # each turn draws its own
    # the number of turns changes no first prompt
    assert [c.first_prompt for c in multiturn_conversations(5, 1, 16, 6, 4, seed=3, vocab_size=VOCAB,
                                                            prefix_len=2)] == [r.prompt for r in firsts]
    assert next_turn_prompt([1, 2], [3], [4, 5]) == [1, 2, 3, 4, 5]


def test_round_robin_order():
    assert runner.round_robin(3, 2) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert runner.round_robin(1, 3) == [(0, 0), (0, 1), (0, 2)]


# --- runner.send_conversations against an in-process send function ---------------------------

class FakeTurns:
    """send_turn / reply_tokens for send_conversations: replies are token ids that depend on the
    prompt; `fail` holds the (conversation, turn)s answered with an error."""

    def __init__(self, conversations: list[Conversation], fail=(), delay_s: float = 0.01):
        self.conversations, self.fail, self.delay_s = conversations, set(fail), delay_s
        self.sent: list[tuple[int, int, list[int]]] = []  # (conversation, turn, prompt) in send order
        self.spans: dict[tuple[int, int], tuple[float, float]] = {}
        self.active = self.peak = 0

    def reply(self, prompt: list[int], count: int) -> list[int]:
        return [1000 + (sum(prompt) + 7 * i) % 97 for i in range(count)]

    async def send_turn(self, prompt: list[int], max_tokens: int) -> RequestRecord:
        c = next(i for i, conv in enumerate(self.conversations) if prompt[:len(conv.first_prompt)] == conv.first_prompt)
        t = sum(sent_c == c for sent_c, _, _ in self.sent)
        self.sent.append((c, t, list(prompt)))
        self.active += 1
        self.peak = max(self.peak, self.active)
        start = time.perf_counter()
        await asyncio.sleep(self.delay_s)
        self.active -= 1
        self.spans[c, t] = (start, time.perf_counter())
        if (c, t) in self.fail:
            return RequestRecord(len(prompt), start, [], time.perf_counter(), error="HTTP 500: boom")
        record = RequestRecord(len(prompt), start, [start + self.delay_s / 2], time.perf_counter(), "x", max_tokens)
        record.token_ids = self.reply(prompt, max_tokens)
        return record

    async def reply_tokens(self, record: RequestRecord) -> tuple[list[int], str]:
        return record.token_ids, "token_ids"

    def run(self, max_concurrency: int = 1) -> list[runner.Turn]:
        turns, duration = asyncio.run(runner.send_conversations(self.conversations, self.send_turn,
                                                                self.reply_tokens, max_concurrency))
        assert duration > 0
        return turns


def expected_prompts(conversations: list[Conversation], reply) -> dict[tuple[int, int], list[int]]:
    """Every turn's prompt: the previous prompt, `reply(previous prompt, output_len)`, the new tokens."""
    prompts = {}
    for c, conv in enumerate(conversations):
        prompt = conv.first_prompt
        for t in range(1 + len(conv.turn_inputs)):
            prompts[c, t] = prompt
            if t < len(conv.turn_inputs):
                prompt = next_turn_prompt(prompt, reply(prompt, conv.output_len), conv.turn_inputs[t])
    return prompts


@pytest.mark.parametrize("max_concurrency", [1, 2])
def test_turns_go_round_robin_and_repeat_their_history(max_concurrency):
    conversations = multiturn_conversations(3, 3, 8, 2, 3, seed=1, vocab_size=VOCAB)
    fake = FakeTurns(conversations)
    turns = fake.run(max_concurrency)
    assert [(c, t) for c, t, _ in fake.sent] == runner.round_robin(3, 3)
    assert [(turn.conversation, turn.turn) for turn in turns] == runner.round_robin(3, 3)
    prompts = expected_prompts(conversations, fake.reply)
    assert all(prompt == prompts[c, t] for c, t, prompt in fake.sent)
    assert len(prompts[0, 2]) == 8 + 2 * (3 + 2)
    assert fake.peak == max_concurrency
    for c in range(3):  # a conversation's next turn starts after its previous one ended
        assert all(fake.spans[c, t + 1][0] >= fake.spans[c, t][1] for t in range(2))
    assert [turn.history_source for turn in turns] == ["token_ids"] * 6 + [None] * 3  # last turns: not appended
    assert [turn.reply_len for turn in turns] == [3] * 6 + [None] * 3


def test_a_failed_turn_ends_its_conversation():
    conversations = multiturn_conversations(3, 3, 8, 2, 3, seed=2, vocab_size=VOCAB)
    fake = FakeTurns(conversations, fail={(1, 0)})
    turns = fake.run()
    assert [(c, t) for c, t, _ in fake.sent] == [(0, 0), (1, 0), (2, 0), (0, 1), (2, 1), (0, 2), (2, 2)]
    errors = {(turn.conversation, turn.turn): turn.record.error for turn in turns}
    assert errors[1, 0] == "HTTP 500: boom"
    assert errors[1, 1] == errors[1, 2] == "not sent: an earlier turn of this conversation failed"
    assert sum(error is None for error in errors.values()) == 6


def test_replies_without_token_ids_are_tokenized_again():
    class Chars:
        def encode(self, text, add_special_tokens=True):
            assert not add_special_tokens
            return [ord(ch) for ch in text]

    record = RequestRecord(3, text="hi!")
    assert asyncio.run(runner.ReplyTokens(None, "", "m", Chars())(record)) == ([104, 105, 33], "tokenizer")
    record.token_ids = [7, 8]
    assert asyncio.run(runner.ReplyTokens(None, "", "m", Chars())(record)) == ([7, 8], "token_ids")


# --- the per-turn statistics, exactly ------------------------------------------------------------

def test_ttft_by_turn_statistics():
    ttfts_ms = [[100, 200, 400], [10, 20, 90], [30, 50, 70]]  # [turn][conversation]
    records, turn_of = [], []
    for t, values in enumerate(ttfts_ms):
        for c, ms in enumerate(values):
            records.append(RequestRecord(5, 10.0 * c, [10.0 * c + ms / 1e3], 10.0 * c + 1.0))
            turn_of.append(t)
    records += [RequestRecord(5, 0.0, [], 0.1, error="HTTP 500: boom"), RequestRecord(5, 0.0, [], 0.5)]
    turn_of += [1, 2]  # a failed request and one without a first chunk: no TTFT
    stats = ttft_by_turn(turn_of, records, 3, percentiles=[50])
    rows = stats["ttft_by_turn_ms"]
    assert [(row["turn"], row["count"]) for row in rows] == [(1, 3), (2, 3), (3, 3)]
    for row, values in zip(rows, ttfts_ms):
        assert row["mean_ttft_ms"] == pytest.approx(np.mean(values))
        assert row["median_ttft_ms"] == pytest.approx(np.median(values))
        assert row["p99_ttft_ms"] == pytest.approx(np.percentile(values, 99))
        assert row["p50_ttft_ms"] == pytest.approx(np.median(values))  # 99 always, and the percentiles asked
    assert rows[0]["p99_ttft_ms"] == pytest.approx(200 + 0.98 * 200)  # numpy's linear interpolation
    assert stats["mean_ttft_later_turns_ms"] == pytest.approx(270 / 6)  # turns 2 and 3 pooled
    single = ttft_by_turn([0], records[:1], 1)
    assert single["mean_ttft_later_turns_ms"] is None and single["ttft_by_turn_ms"][0]["count"] == 1
    empty = ttft_by_turn([0, 1], records[-2:], 2)["ttft_by_turn_ms"]
    assert [row["count"] for row in empty] == [0, 0] and empty[1]["mean_ttft_ms"] is None


def test_the_summary_prints_the_turns():
    stats = ttft_by_turn([0, 1], [RequestRecord(5, 0.0, [0.25], 1.0), RequestRecord(5, 0.0, [0.0625], 1.0)], 2)
    result = {"completed": 2, "failed": 0, "duration": 2.0, "total_input_tokens": 10, "total_output_tokens": 4,
              "request_throughput": 1.0, "output_throughput": 2.0, "total_token_throughput": 7.0, **stats}
    printed = format_summary(result, [], [99.0])
    assert "TTFT by turn (ms)" in printed
    lines = printed.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("Turn"))
    assert lines[header].split() == ["Turn", "Count", "Mean", "Median", "P99", "Cached"]
    assert lines[header + 1].split() == ["1", "1", "250.00", "250.00", "250.00", "n/a"]  # no cached count sent
    assert any(l.startswith("Mean TTFT of turns 2..2 (ms):") and l.split()[-1] == "62.50" for l in lines)


# --- end to end against a fake server ------------------------------------------------------------

class FakeVLLM:
    """A streaming /v1/completions in a thread that answers token-id prompts with `reply(prompt)`,
    one chunk per token (its text: the character of code point id), each with its `token_ids`
    when the request asks `return_token_ids` (vLLM's field). `refuse_token_ids`: a 400 naming the
    field instead (jaxserve's answer), and /tokenize maps characters back to ids (`merge`: one
    token fewer, as a tokenizer that merges). The first chunk waits `hit_s` when the prompt
    starts with a history it served (prompt + reply), else `miss_s`, and says in its usage how many
    prompt tokens it found so (`prompt_tokens_details.cached_tokens`): a prefix cache. `gate`: the
    first `gate` requests also wait (at most GATE_TIMEOUT_S) until that many are in flight, so
    that a client sending them concurrently shows it whatever the machine's load."""

    GATE_TIMEOUT_S = 10.0

    def __init__(self, *, refuse_token_ids=False, tokenize=True, merge=False, hit_s=0.005, miss_s=0.15, gate=0):
        self.refuse_token_ids, self.tokenize, self.merge = refuse_token_ids, tokenize, merge
        self.hit_s, self.miss_s, self.gate = hit_s, miss_s, gate
        self.gate_open = asyncio.Event()
        self.bodies: list[dict] = []  # every request, refused ones too
        self.replies: list[list[int]] = []  # per served request, in order
        self.histories: list[list[int]] = []
        self.active = self.peak = 0
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=10)
        self.url = f"http://127.0.0.1:{self.port}"

    async def _start(self) -> int:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        if self.tokenize:
            app.router.add_post("/tokenize", self._tokenize)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    async def _models(self, request):
        return web.json_response({"data": [{"id": "fake"}]})

    @staticmethod
    def reply(prompt: list[int], count: int) -> list[int]:
        return [1000 + (sum(prompt) + 7 * i) % 97 for i in range(count)]

    async def _tokenize(self, request):
        body = await request.json()
        assert body["add_special_tokens"] is False and body["model"] == "fake"
        ids = [ord(ch) for ch in body["prompt"]]
        return web.json_response({"tokens": ids[:-1] if self.merge else ids, "count": len(ids)})

    async def _completions(self, request):
        body = await request.json()
        self.bodies.append(body)
        if self.refuse_token_ids and body.get("return_token_ids") is not None:
            return web.json_response({"error": {"message": "'return_token_ids' is not supported by this server"}},
                                     status=400)
        prompt, count = body["prompt"], body["max_tokens"]
        ids = self.reply(prompt, count)
        cached = max((len(h) for h in self.histories if prompt[:len(h)] == h), default=0)
        self.replies.append(ids)
        self.histories.append(prompt + ids)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        self.active += 1
        self.peak = max(self.peak, self.active)
        if len(self.replies) <= self.gate:  # one of the first `gate`: wait for the others
            if self.active >= self.gate:
                self.gate_open.set()
            try:
                await asyncio.wait_for(self.gate_open.wait(), self.GATE_TIMEOUT_S)
            except asyncio.TimeoutError:
                pass  # never that many at once: `peak` says so
        await asyncio.sleep(self.hit_s if cached else self.miss_s)
        for token in ids:
            choice = {"index": 0, "text": chr(token)}
            if body.get("return_token_ids"):
                choice["token_ids"] = [token]
            await response.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
        usage = {"prompt_tokens": len(prompt), "completion_tokens": count, "total_tokens": len(prompt) + count,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        await response.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        self.active -= 1
        return response

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def fake_vllm():
    servers = []

    def make(**kwargs) -> FakeVLLM:
        servers.append(FakeVLLM(**kwargs))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


MULTITURN = ("--dataset_name=multiturn", "--multiturn_conversations=3", "--multiturn_turns=3",
             "--random_input_len=12", "--multiturn_turn_input_len=5", "--random_output_len=4", "--seed=11")


def check_prompts(prompts: list[list[int]], reply, concurrent: bool = False) -> None:
    """The prompts arrived round-robin, each later one the previous prompt + reply + new tokens.
    `concurrent`: requests in flight together travel on connections of their own, so the server
    may see them in either order: then each conversation's prompts arrived in its turns' order."""
    conversations = multiturn_conversations(3, 3, 12, 5, 4, seed=11, vocab_size=VOCAB)
    expected = expected_prompts(conversations, reply)
    if not concurrent:
        assert prompts == [expected[c, t] for c, t in runner.round_robin(3, 3)]
        return
    first = {c: expected[c, 0] for c in range(3)}
    by_conversation = {c: [p for p in prompts if p[:len(first[c])] == first[c]] for c in range(3)}
    assert by_conversation == {c: [expected[c, t] for t in range(3)] for c in range(3)}
    assert len(prompts) == 9


def test_against_a_server_that_returns_token_ids(fake_vllm, tmp_path, capsys):
    server, out = fake_vllm(), tmp_path / "r.json"
    assert bench(server.url, *MULTITURN, "--save_detailed", f"--result_json={out}") == 0
    assert len(server.bodies) == 9 and server.peak == 1  # one request at a time by default
    check_prompts([b["prompt"] for b in server.bodies], FakeVLLM.reply)
    body = server.bodies[-1]
    assert body["return_token_ids"] is True and body["skip_special_tokens"] is False
    assert body["ignore_eos"] is True and body["max_tokens"] == 4 and body["stream"] is True
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"], result["max_concurrency"]) == (9, 0, 1)
    assert (result["dataset_name"], result["num_prompts"], result["input_token_source"]) == ("multiturn", 9,
                                                                                            "token_ids")
    assert [result[f"multiturn_{key}"] for key in ("conversations", "turns", "turn_input_len")] == [3, 3, 5]
    assert result["multiturn_history_source"] == {"token_ids": 6}
    assert result["multiturn_retokenized_length_mismatches"] == 0
    assert result["turns"] == [1, 1, 1, 2, 2, 2, 3, 3, 3] and result["conversations"] == [0, 1, 2] * 3
    rows = result["ttft_by_turn_ms"]
    assert [(row["turn"], row["count"]) for row in rows] == [(1, 3), (2, 3), (3, 3)]
    # the usage's cached tokens: the whole previous prompt and reply (12 + 4, then 16 + 5 + 4)
    assert [row["mean_cached_tokens"] for row in rows] == [0, 16, 25]
    # turn 1 misses the fake's cache (150 ms sleep); later turns repeat a served history (5 ms)
    assert rows[0]["median_ttft_ms"] >= 149 and rows[0]["p99_ttft_ms"] >= 149
    assert result["mean_ttft_later_turns_ms"] < 149 and all(row["mean_ttft_ms"] < 149 for row in rows[1:])
    assert result["mean_ttft_later_turns_ms"] == pytest.approx(np.mean(result["ttfts"][3:]) * 1e3)
    printed = capsys.readouterr().out
    assert "TTFT by turn (ms)" in printed and "Mean TTFT of turns 2..3 (ms):" in printed


def test_max_concurrency_keeps_each_conversation_in_order(fake_vllm, tmp_path):
    server = fake_vllm(hit_s=0.05, miss_s=0.05, gate=3)
    assert bench(server.url, *MULTITURN, "--max_concurrency=3", f"--result_json={tmp_path / 'r.json'}") == 0
    assert server.peak == 3  # the three conversations' turns overlap, each conversation's in order
    check_prompts([b["prompt"] for b in server.bodies], FakeVLLM.reply, concurrent=True)
    assert json.loads((tmp_path / "r.json").read_text())["max_concurrency"] == 3


@pytest.mark.parametrize("merge", [False, True])
def test_a_server_refusing_return_token_ids_gets_replies_tokenized(fake_vllm, tmp_path, capsys, merge):
    server, out = fake_vllm(refuse_token_ids=True, merge=merge), tmp_path / "r.json"
    assert bench(server.url, *MULTITURN, f"--result_json={out}") == 0
    assert len(server.bodies) == 10  # the first asked for token ids, was refused and sent again without
    assert server.bodies[0]["return_token_ids"] is True
    assert all("return_token_ids" not in b for b in server.bodies[1:])
    prompts = [b["prompt"] for b in server.bodies[1:]]
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (9, 0)
    assert result["multiturn_history_source"] == {"server_tokenize": 6}
    if merge:  # each reply came back a token short: the histories differ, and the run says so
        assert result["multiturn_retokenized_length_mismatches"] == 6
        assert "6 of 6 replies tokenized again to another number of tokens" in capsys.readouterr().err
        with pytest.raises(AssertionError):
            check_prompts(prompts, FakeVLLM.reply)
        check_prompts(prompts, lambda prompt, count: FakeVLLM.reply(prompt, count)[:-1])
    else:
        assert result["multiturn_retokenized_length_mismatches"] == 0
        check_prompts(prompts, FakeVLLM.reply)


def test_no_token_ids_and_no_tokenize_is_exit_2(fake_vllm, capsys):
    server = fake_vllm(refuse_token_ids=True, tokenize=False)
    assert bench(server.url, *MULTITURN) == 2
    err = capsys.readouterr().err
    assert "/tokenize: HTTP 404" in err and "give --tokenizer" in err and "Traceback" not in err


def test_against_jaxserves_own_server(tmp_path):
    """jaxserve's HTTP server on the tests' FakeEngine: the token ids it returns (vLLM's
    return_token_ids) make each history, and the prompts the engine got repeat, each later one,
    the tokens it generated."""
    from serve.app import ServerConfig  # the server's modules load in seconds: only this test needs them
    from tests.test_server import FakeEngine, LiveServer, fake_token_ids  # the same reason
    server = LiveServer(FakeEngine(token_delay_s=0.001), ServerConfig(drain_timeout_s=5.0))
    try:
        out = tmp_path / "r.json"
        assert bench(f"http://127.0.0.1:{server.port}", *MULTITURN, "--random_vocab_size=258",
                     f"--result_json={out}") == 0
        result = json.loads(out.read_text())
        assert (result["completed"], result["failed"], result["model_id"]) == (9, 0, "fake-model")
        assert result["multiturn_history_source"] == {"token_ids": 6}
        assert all(p.ignore_eos and p.max_tokens == 4 for p in server.engine.params)
        conversations = multiturn_conversations(3, 3, 12, 5, 4, seed=11, vocab_size=258)
        expected = expected_prompts(conversations, lambda prompt, count: fake_token_ids(prompt, count, None))
        assert server.engine.prompts == [expected[c, t] for c, t in runner.round_robin(3, 3)]
    finally:
        server.close()


# --- flags ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (("--dataset_name=multiturn", "--endpoint=chat"), "only --endpoint=completions"),
    (("--dataset_name=multiturn", "--request_rate=5"), "--request_rate does not apply"),
    (("--dataset_name=multiturn", "--num_prompts=10"), "--num_prompts does not apply"),
    (("--dataset_name=multiturn", "--sweep_max_concurrency=1,2"), "runs one level"),
    (("--dataset_name=multiturn", "--random_range_ratio=0.5"), "--random_range_ratio does not apply"),
    (("--multiturn_turns=3",), "--multiturn_turns needs --dataset_name=multiturn"),
    (("--dataset_name=multiturn", "--multiturn_turns=0"), "--multiturn_turns"),
    (("--dataset_name=multiturn", "--multiturn_conversations=0"), "--multiturn_conversations"),
    (("--dataset_name=multiturn", "--multiturn_turn_input_len=-1"), "--multiturn_turn_input_len"),
])
def test_bad_flags_exit_2(fake_vllm, capsys, args, message):
    server = fake_vllm()
    assert bench(server.url, *args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert server.bodies == []

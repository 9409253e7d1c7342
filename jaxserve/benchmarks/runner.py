"""Sending a run's requests: arrival times (`--request_rate`, `--burstiness`) and `--max_concurrency`.

`arrival_offsets` is vLLM's schedule: request 0 at once, then gaps drawn from a gamma distribution
with shape `burstiness` and mean 1/`request_rate` (burstiness 1 is a Poisson process; lower is
burstier, higher is more even), all requests at once for an infinite rate. `send_all` sends request
i at its offset; with a `max_concurrency` a request that arrives while that many are in flight
waits for one to finish, as vLLM's semaphore does.

`send_conversations` runs the `multiturn` dataset: round-robin over the conversations (every
conversation's turn 1, then every turn 2, ...), at most `max_concurrency` turns at a time (1:
strictly one after the other), a conversation's next turn only after its previous one, whose prompt
and reply the next prompt repeats (`datasets.next_turn_prompt`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from typing import Awaitable, Callable, Sequence

import aiohttp
import numpy as np

from jaxserve.benchmarks.client import RequestRecord, send, tokenize
from jaxserve.benchmarks.datasets import Conversation, next_turn_prompt


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Seconds after the start at which each request is sent: [num_requests], non-decreasing."""
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    if not request_rate > 0 or not burstiness > 0:
        raise ValueError(f"request_rate and burstiness must be > 0, got {request_rate} and {burstiness}")
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness),
                                             size=max(num_requests - 1, 0))  # [num_requests - 1]
    return np.concatenate([[0.0], np.cumsum(gaps)])


async def send_all(session: aiohttp.ClientSession, url: str, endpoint: str, bodies: Sequence[dict],
                   prompt_lens: Sequence[int], offsets: Sequence[float], max_concurrency: int | None = None,
                   on_done: Callable[[], None] | None = None) -> tuple[list[RequestRecord], float]:
    """(the records in request order, the run's duration in seconds: first send to last end)."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def one(i: int) -> RequestRecord:
        delay = start + offsets[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if limit is None:
            record = await send(session, url, endpoint, bodies[i], prompt_lens[i])
        else:
            async with limit:
                record = await send(session, url, endpoint, bodies[i], prompt_lens[i])
        if on_done is not None:
            on_done()
        return record

    records = await asyncio.gather(*(one(i) for i in range(len(bodies))))
    return list(records), time.perf_counter() - start


# --- multi-turn conversations ------------------------------------------------------------------

@dataclasses.dataclass
class Turn:
    """One turn of one conversation (both 0-based) and how its reply entered the history."""

    conversation: int
    turn: int
    record: RequestRecord
    history_source: str | None = None  # "token_ids", "tokenizer" or "server_tokenize"; None: not appended
    reply_len: int | None = None  # tokens of the reply appended to the history


def round_robin(num_conversations: int, num_turns: int) -> list[tuple[int, int]]:
    """(conversation, turn) in send order: every conversation's turn 1, then every turn 2, ..."""
    return [(c, t) for t in range(num_turns) for c in range(num_conversations)]


class TurnSender:
    """Sends one turn's token-id prompt with a body from `make_body(prompt_ids, max_tokens)`, asking
    for the reply's token ids as vLLM allows (`return_token_ids`: each streamed chunk carries its
    `token_ids`, as jaxserve's server sends them too) until a server refuses that field with a 400
    naming it; the refused request is sent again without it, once, and so is every later one. It
    never reached the engine, so nothing of it is timed or cached."""

    FIELD = "return_token_ids"

    def __init__(self, session: aiohttp.ClientSession, url: str, make_body: Callable[[list[int], int], dict]):
        self.session, self.url, self.make_body = session, url, make_body
        self.ask_token_ids = True

    async def __call__(self, prompt: list[int], max_tokens: int) -> RequestRecord:
        asked = self.ask_token_ids
        body = self.make_body(prompt, max_tokens) | ({self.FIELD: True} if asked else {})
        record = await send(self.session, self.url, "completions", body, len(prompt))
        if asked and (record.error or "").startswith("HTTP 400") and self.FIELD in record.error:
            self.ask_token_ids = False
            body.pop(self.FIELD)
            record = await send(self.session, self.url, "completions", body, len(prompt))
        return record


class ReplyTokens:
    """A reply's token ids for the next turn's prompt: those the stream carried (exact), else the
    reply's text tokenized again, by the local tokenizer when there is one, else by the server's
    /tokenize (its own tokenizer). Tokenizing again is exact only where the model's tokens are
    the text's own tokenization; `Turn.reply_len` against the usage's count shows where not. The
    requests ask for `skip_special_tokens: false`, so that special tokens the model generates
    stay in the text and tokenize back to themselves."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str, tokenizer=None):
        self.session, self.base_url, self.model, self.tokenizer = session, base_url, model, tokenizer

    async def __call__(self, record: RequestRecord) -> tuple[list[int], str]:
        if record.token_ids is not None:
            return record.token_ids, "token_ids"
        if self.tokenizer is not None:
            return self.tokenizer.encode(record.text, add_special_tokens=False), "tokenizer"
        try:
            ids = await tokenize(self.session, self.base_url, self.model, record.text) if record.text else []
        except ValueError as e:
            raise ValueError(f"the server sent no token ids of its reply, and tokenizing the reply failed ({e}): "
                             "give --tokenizer (the served model's) to tokenize replies here") from None
        return ids, "server_tokenize"


async def send_conversations(conversations: Sequence[Conversation],
                             send_turn: Callable[[list[int], int], Awaitable[RequestRecord]],
                             reply_tokens: Callable[[RequestRecord], Awaitable[tuple[list[int], str]]],
                             max_concurrency: int = 1, on_done: Callable[[], None] | None = None
                             ) -> tuple[list[Turn], float]:
    """(the turns in send order, `round_robin`'s, the run's duration in seconds). A failed turn
    ends its conversation: its later turns are failed records, never sent."""
    num_turns = 1 + len(conversations[0].turn_inputs) if conversations else 0
    order = round_robin(len(conversations), num_turns)
    turns: list[Turn | None] = [None] * len(order)
    prompts = [c.first_prompt for c in conversations]  # each conversation's next prompt
    ended = [False] * len(conversations)
    previous: list[asyncio.Task | None] = [None] * len(conversations)
    limit = asyncio.Semaphore(max_concurrency)
    start = time.perf_counter()

    async def one(index: int, c: int, t: int) -> None:
        try:
            record = await send_turn(prompts[c], conversations[c].output_len)
            turns[index] = turn = Turn(c, t, record)
            if not record.ok:
                ended[c] = True
            elif t + 1 < num_turns:
                reply, turn.history_source = await reply_tokens(record)
                turn.reply_len = len(reply)
                prompts[c] = next_turn_prompt(prompts[c], reply, conversations[c].turn_inputs[t])
        finally:
            limit.release()
            if on_done is not None:
                on_done()

    for index, (c, t) in enumerate(order):
        if previous[c] is not None:
            await previous[c]  # the conversation's previous turn, its reply in the history
        if ended[c]:
            turns[index] = Turn(c, t, RequestRecord(0, error="not sent: an earlier turn of this conversation failed"))
            if on_done is not None:
                on_done()
            continue
        await limit.acquire()
        previous[c] = asyncio.create_task(one(index, c, t))
    await asyncio.gather(*(task for task in previous if task is not None))
    return list(turns), time.perf_counter() - start

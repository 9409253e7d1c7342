"""Sending a run's requests: arrival times (`--request_rate`, `--burstiness`) and `--max_concurrency`.

`arrival_offsets` is vLLM's schedule: request 0 at once, then gaps drawn from a gamma distribution
with shape `burstiness` and mean 1/`request_rate` (burstiness 1 is a Poisson process; lower is
burstier, higher is more even), all requests at once for an infinite rate. `send_all` sends request
i at its offset; with a `max_concurrency` a request that arrives while that many are in flight
waits for one to finish, as vLLM's semaphore does.
"""
from __future__ import annotations

import asyncio
import math
import time
from typing import Callable, Sequence

import aiohttp
import numpy as np

from jaxserve.benchmarks.client import RequestRecord, send


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

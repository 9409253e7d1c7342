"""The n choices behind one HTTP request: `ChoiceFanout` admits each as an engine request and
merges their deltas in arrival order; `ServerStopping` ends them at shutdown."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable

from jaxserve.core.engine_client import DeltaStream, EngineClient
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.request import SamplingParams

logger = logging.getLogger(__name__)

_END = object()  # a choice's generator ended


async def _close_quietly(stream: DeltaStream) -> None:
    try:
        await stream.aclose()
    except Exception:
        logger.exception("closing an engine stream failed")


class ServerStopping(Exception):
    """The server gave up on this request while shutting down."""


class ChoiceFanout:
    """Runs the engine requests behind one HTTP request (prompts x choices) and merges their deltas
    in arrival order.

    `start()` admits every choice (the engine's synchronous `generate`: a refusal raises there, and
    the choices already admitted are aborted), then waits for each choice's first event, so an early
    failure surfaces before the HTTP response is committed. `close()` (always called) cancels what
    is still running: the engine aborts those requests and frees their pages.
    """

    def __init__(self, engine: EngineClient, request_id: str, sequences: list[tuple[list[int], SamplingParams, Any]],
                 on_output: Callable[[int, RequestOutput], None] | None = None) -> None:
        """`sequences`: (prompt token ids, sampling parameters, the prompt's images: MultimodalInputs
        or None) of each engine request, in choice order."""
        self.engine = engine
        self.request_ids = [f"{request_id}-{i}" if len(sequences) > 1 else request_id for i in range(len(sequences))]
        self.sequences = sequences
        self.on_output = on_output
        self._events: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._buffered: list[tuple[int, Any]] = []
        self._tasks: list[asyncio.Task] = []
        self._stop_reason: str | None = None
        self.num_admitted = 0  # choices the engine accepted (each ends with a finish reason)

    @property
    def num_choices(self) -> int:
        return len(self.sequences)

    async def _pump(self, index: int, stream: DeltaStream) -> None:
        try:
            async for output in stream:
                if self.on_output is not None:
                    self.on_output(index, output)
                self._events.put_nowait((index, output))
            self._events.put_nowait((index, _END))
        except Exception as e:  # handed to the consumer, which decides the HTTP outcome
            self._events.put_nowait((index, e))
        finally:
            await _close_quietly(stream)

    async def start(self) -> None:
        """Admits every choice, then waits for each one's first event. Re-raises an engine refusal
        (after aborting the choices already admitted) or an early failure."""
        streams = []
        try:
            for index, (token_ids, params, images) in enumerate(self.sequences):
                streams.append(self.engine.generate(self.request_ids[index], token_ids, params, images))
                self.num_admitted += 1
        except BaseException:
            for stream in streams:
                await _close_quietly(stream)
            raise
        self._tasks = [asyncio.create_task(self._pump(i, stream)) for i, stream in enumerate(streams)]
        started: set[int] = set()
        while len(started) < self.num_choices:
            index, event = await self._next_event()
            if isinstance(event, Exception):
                raise event
            started.add(index)
            self._buffered.append((index, event))

    async def _next_event(self) -> tuple[int, Any]:
        index, event = await self._events.get()
        if index < 0:
            raise ServerStopping(self._stop_reason)
        return index, event

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yields (choice index, delta) until every choice has finished.

        Raises the engine's exception if one fails mid-way, ServerStopping after `stop()`.
        A generator that ends without a finished delta counts as aborted.
        """
        num_open = self.num_choices
        while num_open:
            if self._stop_reason is not None:
                raise ServerStopping(self._stop_reason)
            index, event = self._buffered.pop(0) if self._buffered else await self._next_event()
            if isinstance(event, Exception):
                raise event
            if event is _END:
                num_open -= 1
                continue
            yield index, event

    def stop(self, reason: str) -> None:
        """Ends the iteration with ServerStopping (used at shutdown once the drain time is over)."""
        self._stop_reason = reason
        self._events.put_nowait((-1, None))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

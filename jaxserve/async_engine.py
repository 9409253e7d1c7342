"""AsyncEngine: an `Engine` stepping in a background thread, feeding asyncio consumers.

Each request is one async iterator of deltas; the event loop never waits on the device.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import AsyncIterator

from jaxserve.engine import Engine, EngineConfig
from jaxserve.outputs import EngineStats, QueueFullError, RequestOutput
from jaxserve.request import SamplingParams

log = logging.getLogger(__name__)


class AsyncEngine:
    """Runs an `Engine` in a background thread; asyncio callers stream deltas per request."""

    def __init__(self, engine: Engine, max_waiting_requests: int | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.max_waiting_requests = max_waiting_requests or engine.config.max_waiting_requests
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._num_pending_adds = 0
        self._stats = engine.stats()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30)

    def stats(self) -> EngineStats:
        return self._stats

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Deltas of one request. Raises ValueError / QueueFullError before the first delta.

        Stopping the iteration early (client gone, task cancelled) aborts the request."""
        self.engine.check_request(prompt_token_ids, params)
        if self._stats.num_waiting + self._num_pending_adds >= self.max_waiting_requests:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting_requests} requests)")
        if request_id in self._queues:
            raise ValueError(f"duplicate request id {request_id!r}")
        if not self.is_alive():
            raise RuntimeError("the engine is not running")
        deltas: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = deltas
        self._num_pending_adds += 1
        self._commands.put(("add", request_id, list(prompt_token_ids), params))
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                out = await deltas.get()
                finished = out.finished
                yield out
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wakeup.set()

    # ---- engine thread --------------------------------------------------------------------
    def _publish(self, outputs: list[RequestOutput]) -> None:
        def deliver():
            for out in outputs:
                q = self._queues.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)
        if outputs and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(deliver)

    def _drain_commands(self) -> None:
        outputs = []
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                _, request_id, prompt, params = command
                self._num_pending_adds -= 1
                try:
                    self.engine.add_request(request_id, prompt, params)
                except ValueError as e:
                    outputs.append(RequestOutput(request_id, [], "", True, "error", len(prompt), 0,
                                                 error=str(e)))
            else:
                out = self.engine.abort(command[1])
                if out is not None:
                    outputs.append(out)
        self._publish(outputs)

    def _run(self) -> None:
        while not self._stopping:
            self._drain_commands()
            self._stats = self.engine.stats()
            if not self.engine.has_unfinished():
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a failed step must not take the server down
                log.exception("engine step failed")
                outputs = self.engine.fail_all(f"engine step failed: {type(e).__name__}: {e}")
            self._publish(outputs)
        self._publish(self.engine.fail_all("the server is shutting down"))
        self._stats = self.engine.stats()


def build_async_engine(model: str, **engine_kwargs) -> AsyncEngine:
    """The server's factory: an AsyncEngine (not yet started) for a model name or path."""
    engine_kwargs = {k: v for k, v in engine_kwargs.items() if v is not None}
    max_waiting = engine_kwargs.get("max_waiting_requests")
    engine = Engine.from_model(model, EngineConfig(**engine_kwargs))
    replicas = getattr(engine, "replicas", None)  # data parallel: one AsyncEngine per replica
    if replicas is not None:
        from jaxserve.data_parallel import DataParallelAsyncEngine
        return DataParallelAsyncEngine([AsyncEngine(e, max_waiting) for e in replicas])
    return AsyncEngine(engine, max_waiting)

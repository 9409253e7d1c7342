"""AsyncEngine: an `Engine` stepping in a background thread, feeding asyncio consumers.

Each request is admitted synchronously and then is one async iterator of deltas (a
`RequestStream`); the event loop never waits on the device. An `EngineClient`
(jaxserve/core/engine_client.py): what the server needs of an engine.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Callable

from jaxserve.core.outputs import EngineStats, QueueFullError, RequestOutput, StepRecord
from jaxserve.core.request import SamplingParams
from jaxserve.engine import Engine, EngineConfig
from jaxserve.parallel.data_parallel import DataParallelAsyncEngine, DataParallelEngine

log = logging.getLogger(__name__)


class AsyncEngine:
    """Runs an `Engine` in a background thread; asyncio callers stream deltas per request."""

    def __init__(self, engine: Engine, max_waiting_requests: int | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.limits.max_seq_len  # the context a request can really use
        self.max_waiting_requests = max_waiting_requests or engine.config.max_waiting_requests
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._num_pending_adds = 0  # added by callers, not yet taken by the engine thread
        self._pending_lock = threading.Lock()
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
        self.engine.stop_warmup()  # the shapes not compiled yet would hold the process's exit
        if self.engine.grammar_compiler is not None:  # its sandbox process
            self.engine.grammar_compiler.close()

    def stats(self) -> EngineStats:
        return self._stats

    def add_step_listener(self, listener: Callable[[StepRecord], None]) -> None:
        """`listener(record)` after every engine step that ran; it runs on the engine thread."""
        self.engine.add_step_listener(listener)

    def health(self) -> dict:
        """What /health reports beyond liveness: failed steps, the last one's error and, while
        it compiles, the warm-up's progress (serve.app answers 503 until it is "ready")."""
        report = {"num_step_failures": self.engine.num_step_failures, "last_step_error": self.engine.last_step_error}
        warmup = self.engine.warmup_status()
        if warmup is not None:
            report["warmup"] = warmup
        return report

    def compile_structured_output(self, params: SamplingParams) -> None:
        """Compiles the params' structured-output grammar (InvalidRequestError if it cannot be
        used); thread-safe, for the server's thread pool: admission then finds it compiled."""
        self.engine.compile_structured_output(params)

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> "RequestStream":
        """Admits one request and returns the stream of its deltas.

        Admission happens here, synchronously: InvalidRequestError (a ValueError, the engine's one
        admission check), QueueFullError or RuntimeError (engine not running) mean the engine never
        saw the request. Closing the stream before its last delta aborts the request."""
        request = self.engine.make_request(request_id, prompt_token_ids, params)
        with self._pending_lock:
            if self._stats.num_waiting + self._num_pending_adds >= self.max_waiting_requests:
                raise QueueFullError(f"the waiting queue is full ({self.max_waiting_requests} requests)")
            if request_id in self._queues:
                raise ValueError(f"duplicate request id {request_id!r}")
            if not self.is_alive():
                raise RuntimeError("the engine is not running")
            deltas: asyncio.Queue = asyncio.Queue()
            self._queues[request_id] = deltas
            self._num_pending_adds += 1
        self._commands.put(("add", request))
        self._wakeup.set()
        return RequestStream(request_id, deltas, self._release)

    def _release(self, request_id: str, abort: bool) -> None:
        self._queues.pop(request_id, None)
        if abort:
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

    def _drain_commands(self) -> list[RequestOutput]:
        """Applies the queued adds and aborts; returns the deltas they produced."""
        outputs = []
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                request = command[1]
                with self._pending_lock:
                    self._num_pending_adds -= 1
                try:
                    self.engine.add(request)
                except ValueError as e:
                    outputs.append(RequestOutput(request.request_id, [], "", True, "error",
                                                 request.num_prompt_tokens, 0, error=str(e)))
            else:
                out = self.engine.abort(command[1])
                if out is not None:
                    outputs.append(out)
        return outputs

    def _publish_with_stats(self, outputs: list[RequestOutput]) -> None:
        """Stats first: a client that sees a request end also sees its pages returned."""
        self._stats = self.engine.stats()
        self._publish(outputs)

    def _run(self) -> None:
        while not self._stopping:
            self._publish_with_stats(self._drain_commands())
            if not self.engine.has_unfinished():
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()  # a failed step fails its own requests and recovers
            except Exception as e:  # only if recovering failed too: nothing else may stop the thread
                log.exception("the engine could not recover from a failed step")
                outputs = self.engine.fail_all(f"engine step failed: {type(e).__name__}: {e}")
            self._publish_with_stats(outputs)
        self._publish_with_stats(self.engine.fail_all("the server is shutting down"))


class RequestStream:
    """Async iterator over the deltas of one admitted request, ending after its finished delta.

    `aclose()` before that aborts the request (its pages return); calling it again, or after the
    end, does nothing. Callbacks added with `add_done_callback` run once, at the end or close."""

    def __init__(self, request_id: str, deltas: asyncio.Queue, release: Callable[[str, bool], None]) -> None:
        self.request_id = request_id
        self._deltas = deltas
        self._release = release
        self._done = False
        self._callbacks: list[Callable[[], None]] = []

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        output = await self._deltas.get()
        if output.finished:
            self._end(abort=False)
        return output

    async def aclose(self) -> None:
        self._end(abort=True)

    def _end(self, abort: bool) -> None:
        if self._done:
            return
        self._done = True
        self._release(self.request_id, abort)
        for callback in self._callbacks:
            callback()


def build_async_engine(model: str, **engine_kwargs) -> AsyncEngine:
    """The server's factory: an AsyncEngine (not yet started) for a model name or path.
    `engine_kwargs`: EngineConfig fields (None: the default)."""
    config = EngineConfig(**{k: v for k, v in engine_kwargs.items() if v is not None})
    engine = Engine.from_model(model, config)
    if isinstance(engine, DataParallelEngine):  # one AsyncEngine per replica
        return DataParallelAsyncEngine([AsyncEngine(e) for e in engine.replicas])
    return AsyncEngine(engine)

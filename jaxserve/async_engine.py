"""AsyncEngine: the one async client of the engine cores, for asyncio callers (the server).

It drives one `Engine` core, or the replicas of data parallelism, each stepping in its own
background thread (`_CoreLoop`); each request goes to the core with the fewest in flight. A
request is admitted synchronously and then is one async iterator of deltas (a `RequestStream`);
the event loop never waits on the device. A multi-host job is behind the executor seam (each
core's runner sends its steps to the other processes): a core whose executor failed for good
makes the client not alive, and new requests are refused. An `EngineClient`
(jaxserve/core/engine_client.py): what the server needs of an engine.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import Callable, Sequence

from jaxserve.core.engine_client import ImageService, PoolingService
from jaxserve.core.outputs import EngineStats, EngineUnavailableError, QueueFullError, RequestOutput, StepRecord
from jaxserve.core.request import SamplingParams
from jaxserve.engine import Engine, EngineConfig
from jaxserve.parallel.data_parallel import sum_stats

log = logging.getLogger(__name__)


class AsyncEngine:
    """Engine cores stepping in background threads; asyncio callers stream deltas per request."""

    def __init__(self, engines: Engine | Sequence[Engine], max_waiting_requests: int | None = None):
        """`engines`: one Engine, or the replicas of data parallelism (each with its own devices,
        KV pool and scheduler). `max_waiting_requests`: each core's bound on queued requests
        (default: its config's)."""
        self.replicas: list[Engine] = [engines] if isinstance(engines, Engine) else list(engines)
        self.engine = self.replicas[0]
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.limits.max_seq_len  # the context a request can really use
        self.lora_enabled = self.engine.loras is not None
        self.pooling = None if self.engine.pooler is None else PoolingService(
            self.engine.pooler, self.engine.model_config.hidden_size, self.engine.model_config.vocab_size,
            self.engine.config.max_inputs_per_request)
        self.image_service = ImageService.of(self.engine)  # None: a text model
        self._loops = [_CoreLoop(e, max_waiting_requests or e.config.max_waiting_requests) for e in self.replicas]
        self._owner: dict[str, _CoreLoop] = {}  # request id -> the core it runs on, while in flight
        self._pricers = None  # step_pricing.StepPricer per core, once a step listener is added

    def is_alive(self) -> bool:
        """Every core steps and no executor failed for good."""
        return all(loop.is_alive() for loop in self._loops) and self._failure() is None

    def _failure(self) -> str | None:
        return next(filter(None, (e.executor_failure() for e in self.replicas)), None)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for core in self._loops:
            core.start(loop)

    async def shutdown(self) -> None:
        await asyncio.gather(*(asyncio.get_running_loop().run_in_executor(None, core.stop) for core in self._loops))
        for engine in self.replicas:
            if engine.grammar_compiler is not None:  # its sandbox process
                engine.grammar_compiler.close()

    def stats(self) -> EngineStats:
        stats = [core.stats for core in self._loops]
        return stats[0] if len(stats) == 1 else sum_stats(stats)

    def add_step_listener(self, listener: Callable[[StepRecord], None]) -> None:
        """`listener(record)` after every step that ran on any core, on that core's thread, the
        record priced against the roofline (step_pricing.StepPricer)."""
        from jaxserve.executor.step_pricing import StepPricer  # jax lives behind the engine
        if self._pricers is None:
            self._pricers = [StepPricer.for_engine(e) for e in self.replicas]
        for engine, pricer in zip(self.replicas, self._pricers):
            engine.add_step_listener(pricer.priced(listener))

    def health(self) -> dict:
        """What /health reports beyond liveness: failed steps, the last one's error, what the
        executor adds (a multi-host job: its processes and failure) and, while it compiles, the
        warm-up's progress (serve.app answers 503 until it is "ready": every core ready)."""
        errors = [e.last_step_error for e in self.replicas if e.last_step_error]
        report = {"num_step_failures": sum(e.num_step_failures for e in self.replicas),
                  "last_step_error": errors[-1] if errors else None}
        for engine in self.replicas:
            report.update(engine.executor_health())
        warmups = [w for w in (e.warmup_status() for e in self.replicas) if w is not None]
        if len(warmups) == 1:
            report["warmup"] = warmups[0]
        elif warmups:
            failed = [w["error"] for w in warmups if w["error"]]
            report["warmup"] = {"ready": all(w["ready"] for w in warmups),
                                "compiled": sum(w["compiled"] for w in warmups),
                                "total": sum(w["total"] for w in warmups), "error": failed[0] if failed else None}
        return report

    def compile_structured_output(self, params: SamplingParams) -> None:
        """Compiles the params' structured-output grammar (InvalidRequestError if it cannot be
        used); thread-safe, for the server's thread pool: admission then finds it compiled (the
        replicas share the tokenizer: one compile serves all)."""
        self.engine.compile_structured_output(params)

    # ---- LoRA adapters --------------------------------------------------------------------
    def lora_modules(self) -> list:
        """The LoRA adapters served (lora_registry.LoRAModule; none without --enable_lora)."""
        return self.engine.lora_modules()

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Serves the adapter in folder `path` as `name` on every core: read and checked in a
        worker thread, then registered on each core's own thread between steps (LoRAError or
        ValueError, the engine's, when it cannot be; nothing changes then)."""
        loop = asyncio.get_running_loop()
        adapter = await loop.run_in_executor(None, self.engine.read_lora_adapter, path)
        done = []
        try:
            for core in self._loops:
                await asyncio.wrap_future(core.call(core.engine.load_lora_adapter, name, path, adapter))
                done.append(core)
        except BaseException:
            for core in done:  # the replicas serve the same adapters
                await asyncio.wrap_future(core.call(core.engine.unload_lora_adapter, name))
            raise

    async def unload_lora_adapter(self, name: str) -> None:
        """Stops serving adapter `name` on every core (LoRANotFoundError when none has it)."""
        for core in self._loops:
            await asyncio.wrap_future(core.call(core.engine.unload_lora_adapter, name))

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 multimodal=None) -> "RequestStream":
        """Admits one request on the core with the fewest in flight and returns the stream of its
        deltas. `multimodal`: the prompt's images (jaxserve.multimodal.inputs.MultimodalInputs), or None.

        Admission happens here, synchronously: InvalidRequestError (a ValueError, the engine's one
        admission check), another ValueError (a duplicate id), QueueFullError or
        EngineUnavailableError (not running, or the executor failed) mean the engine never saw the
        request. Closing the stream before its last delta aborts the request."""
        failure = self._failure()
        if failure is not None:
            raise EngineUnavailableError(failure)
        if request_id in self._owner:
            raise ValueError(f"duplicate request id {request_id!r}")
        core = min(self._loops, key=lambda c: c.num_in_flight)
        deltas = core.admit(request_id, prompt_token_ids, params, multimodal)
        self._owner[request_id] = core
        return RequestStream(request_id, deltas, self._release)

    def _release(self, request_id: str, abort: bool) -> None:
        core = self._owner.pop(request_id, None)
        if core is not None:
            core.release(request_id, abort)

    def abort(self, request_id: str) -> None:
        core = self._owner.get(request_id)
        if core is not None:
            core.abort(request_id)


class _CoreLoop:
    """One engine core stepping in its own thread: adds and aborts reach it as commands, its
    deltas go back to the event loop's queues."""

    def __init__(self, engine: Engine, max_waiting_requests: int):
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.stats = engine.stats()  # refreshed by the thread after every step: cheap to read anywhere
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._num_pending_adds = 0  # added by callers, not yet taken by the engine thread
        self._pending_lock = threading.Lock()

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ends the thread (its unfinished requests end with an error delta), then the warm-up:
        the shapes not compiled yet would hold the process's exit."""
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(30)
        self.engine.stop_warmup()

    def admit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
              multimodal=None) -> asyncio.Queue:
        """Checks the request (the engine's admission) and queues it for the thread; the queue
        its deltas will arrive on."""
        request = self.engine.make_request(request_id, prompt_token_ids, params, multimodal)
        with self._pending_lock:
            if self.stats.num_waiting + self._num_pending_adds >= self.max_waiting_requests:
                raise QueueFullError(f"the waiting queue is full ({self.max_waiting_requests} requests)")
            if request_id in self._queues:
                raise ValueError(f"duplicate request id {request_id!r}")
            if not self.is_alive():
                raise EngineUnavailableError("the engine is not running")
            deltas: asyncio.Queue = asyncio.Queue()
            self._queues[request_id] = deltas
            self._num_pending_adds += 1
        self._commands.put(("add", request))
        self._wakeup.set()
        return deltas

    def release(self, request_id: str, abort: bool) -> None:
        self._queues.pop(request_id, None)
        if abort:
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wakeup.set()

    def call(self, function: Callable, *args) -> concurrent.futures.Future:
        """`function(*args)` on the core's thread between two steps (at once, here, before the
        thread runs or after it ended); its result or exception in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.is_alive():
            _run_into(future, function, args)
            return future
        self._commands.put(("call", future, function, args))
        self._wakeup.set()
        return future

    # ---- the core's thread ----------------------------------------------------------------
    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Stats first: a client that sees a request end also sees its pages returned."""
        self.stats = self.engine.stats()

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
            elif command[0] == "call":
                _run_into(*command[1:])
            else:
                out = self.engine.abort(command[1])
                if out is not None:
                    outputs.append(out)
        return outputs

    def _run(self) -> None:
        while not self._stopping:
            self._publish(self._drain_commands())
            if not self.engine.has_unfinished():
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()  # a failed step fails its own requests and recovers
            except Exception as e:  # only if recovering failed too: nothing else may stop the thread
                log.exception("the engine could not recover from a failed step")
                outputs = self.engine.fail_all(f"engine step failed: {type(e).__name__}: {e}")
            self._publish(outputs)
        self._publish(self._drain_commands())  # (their requests then end below; no call waits forever)
        self._publish(self.engine.fail_all("the server is shutting down"))


def _run_into(future: concurrent.futures.Future, function: Callable, args: tuple) -> None:
    try:
        future.set_result(function(*args))
    except Exception as e:
        future.set_exception(e)


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
    """The server's factory: an AsyncEngine (not yet started) over a model name or path's engine
    cores (one, or data parallelism's replicas). `engine_kwargs`: EngineConfig fields (None: the
    default)."""
    config = EngineConfig(**{k: v for k, v in engine_kwargs.items() if v is not None})
    engine = Engine.from_model(model, config)
    return AsyncEngine(getattr(engine, "replicas", engine))

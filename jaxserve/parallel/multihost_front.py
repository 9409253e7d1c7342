"""Multi-host serving, the step across processes: process 0's `Front` sends every step to the
workers and runs it, the workers `follow` (jaxserve.parallel.multihost explains the job, its
joining and the step channel).

`Front.attach` gives each runner of the front a `FrontTransport`: the runner's step goes to the
workers (packed, through `multihost.StepChannel`) and then runs on global, replicated copies of its
host arrays (`run_global_step`); the outputs are read from the local shard. `LivenessMonitor`
follows jax.distributed's heartbeats; a lost process, a worker's failed step or a step past its
timeout fail the job for good (`Front.failure`); the transport says so to the engine, and the
server's async client then refuses requests and /health answers 503.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

import numpy as np

# jax itself is imported inside the functions, as in multihost (the CLI imports both modules to
# define its flags, before the jax platform is chosen).
from jaxserve.core import structured_output
from jaxserve.core.step import Bucket
from jaxserve.parallel import multihost

log = logging.getLogger(__name__)


# ---- the step on global arrays ----------------------------------------------------------------
def _local_value(x):
    """A global step output as a local array: the addressable copy of a replicated array, else
    gathered from every process (all processes do this in the same order)."""
    import jax
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return x
    if x.is_fully_replicated:
        return x.addressable_data(0)
    from jax.experimental import multihost_utils
    return multihost_utils.process_allgather(x, tiled=True)


def run_global_step(run_step, replicated, bucket, arrays, sampling, prompt_rows):
    """`run_step` (a runner's `ModelRunner.run_step`) on global, replicated copies of the step's
    host arrays; returns its outputs as local arrays, computed."""
    import jax

    put = lambda a: jax.make_array_from_process_local_data(replicated, np.asarray(a))
    arrays = {k: put(v) for k, v in arrays.items()}
    sampling = {k: put(v) for k, v in sampling.items()}
    prompt_rows = None if prompt_rows is None else {k: put(v) for k, v in prompt_rows.items()}
    out = run_step(bucket, arrays, sampling, (), prompt_rows)
    return jax.block_until_ready(jax.tree.map(_local_value, out))


def _replicated_sharding(runner):
    from jax.sharding import NamedSharding, PartitionSpec
    return NamedSharding(runner.kv_cache["k"].sharding.mesh, PartitionSpec())


def engine_replicas(engine) -> list:
    """The Engine replicas of an Engine, a DataParallelEngine or an AsyncEngine."""
    return list(getattr(engine, "replicas", [engine]))


def _check_supported(engine) -> None:
    """ValueError for engine settings whose device calls bypass the step transport (so they would run
    on the front alone): speculative decoding, multi-step decoding, and a vision-language model (its
    images' encoder inputs are not sent to the other processes)."""
    cfg = engine.config
    if engine.model_config.multimodal_architecture:
        raise ValueError("vision-language models (image input) are not supported across several processes yet")
    if cfg.speculative_method:
        raise ValueError("speculative decoding is not supported across several processes yet")
    if cfg.num_scheduler_steps > 1:
        raise ValueError("multi-step decoding (num_scheduler_steps > 1) is not supported across several processes yet")


# ---- liveness -------------------------------------------------------------------------------
class LivenessMonitor:
    """Every process runs one: a thread taking part in rounds of the coordination service's
    GetAliveTasks over all processes (`get_live_nodes`). A round ends when every live process has
    joined it; a process whose heartbeats stopped for the heartbeat timeout is left out of it (and
    a round that waited for it ends then). So `live` follows jax.distributed's own heartbeats."""

    def __init__(self, client, num_processes: int, interval_s: float = 0.25):
        self._client, self._all = client, list(range(num_processes))
        self.live: set[int] = set(self._all)
        self.last_round = time.monotonic()
        self.error: str | None = None
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxserve-liveness", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                live = set(self._client.get_live_nodes(self._all))
            except Exception as e:
                self.error = f"{type(e).__name__}: {e}"
                return
            if live != self.live:
                log.warning("live processes: %s of %d", sorted(live), len(self._all))
            self.live, self.last_round = live, time.monotonic()
            self._stop.wait(self.interval_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ends the rounds after the current one (which needs the other processes' monitors)."""
        self._stop.set()
        self._thread.join(timeout_s)


# ---- process 0 --------------------------------------------------------------------------------
class Front:
    """Process 0's side: sends every step to the workers before running it, waits for it with a
    bound, and fails the job loudly when a process is lost or a step fails or hangs."""

    def __init__(self, step_timeout_s: float = multihost.DEFAULT_STEP_TIMEOUT_S,
                 heartbeat_timeout_s: int = multihost.DEFAULT_HEARTBEAT_TIMEOUT_S, client=None):
        import jax
        self._client = client or multihost.coordinator_client()
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.num_processes = jax.process_count()
        self.step_timeout_s = step_timeout_s
        self.channel = multihost.StepChannel(self._client)
        self._lock = threading.Lock()
        self._device = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-multihost-step")
        self.failure: str | None = None
        self.monitor = LivenessMonitor(self._client, self.num_processes)
        self._wait(self._device.submit(multihost.warm_up_broadcast))  # (the workers' `follow` does the same first)
        self.compilations = multihost.count_compilations()  # after warm-up: should stay 0
        self.num_steps = 0
        self.broadcast_seconds = 0.0  # packing + sending, summed over steps
        self.broadcast_bytes = 0
        self._stopped = False

    def attach(self, engine) -> None:
        """Routes the steps of every replica of `engine` through this front (each runner's
        transport: `FrontTransport`)."""
        for index, replica in enumerate(engine_replicas(engine)):
            _check_supported(replica)
            replica.runner.use_transport(FrontTransport(self, index, _replicated_sharding(replica.runner)))

    def route_step(self, index: int, replicated, run_step, bucket, arrays, sampling, grammars, prompt_rows):
        """Replica `index`'s step: its grammar bitmasks filled, sent to the workers, then
        `run_step` (the runner's) run here on global copies of its inputs (`run_global_step`),
        waited for with the job's bounds. multihost.MultiHostError once the job failed."""
        self._raise_if_failed()
        structured_output.fill_bitmasks(grammars, sampling["token_bitmask"])  # before sending
        with self._lock:
            self._raise_if_failed()
            start = time.perf_counter()
            payload = multihost.pack(multihost.StepMessage("step", index, (bucket.num_decode, bucket.num_prefill_tokens,
                                                       bucket.pages_per_seq), arrays, sampling, prompt_rows))
            large = self.channel.send(payload)
            self.broadcast_seconds += time.perf_counter() - start
            self.broadcast_bytes += len(payload)
            self.num_steps += 1
            # Every collective (a large message's broadcast, the step) runs in the device
            # thread: a lost process can block it forever, never the engine's thread.
            future = self._device.submit(self._device_step, large, run_step, replicated, bucket, arrays,
                                         sampling, prompt_rows)
            return self._wait(future)

    def _device_step(self, large, *step):
        if large is not None:
            start = time.perf_counter()
            multihost.broadcast_bytes(large, len(large))
            self.broadcast_seconds += time.perf_counter() - start
        return run_global_step(*step)

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise multihost.MultiHostError(self.failure)

    def _fail(self, message: str) -> multihost.MultiHostError:
        if self.failure is None:
            self.failure = message
            log.error("multi-host job failed: %s", message)
        return multihost.MultiHostError(self.failure)

    def _lost_and_reports(self) -> tuple[list[int], dict[int, str]]:
        """Processes the liveness rounds left out, and the errors workers reported."""
        lost = [i for i in range(self.num_processes) if i not in self.monitor.live]
        reports = {}
        try:
            for key, value in self._client.key_value_dir_get(f"{multihost.KEY_PREFIX}/error"):
                reports[int(key.rsplit("/", 1)[1])] = value
        except Exception:
            pass
        return lost, reports

    def problems(self) -> str | None:
        """What is wrong with the job now (lost processes, workers' reported errors), or None."""
        if self.monitor.error is not None:
            return f"cannot reach the coordinator: {self.monitor.error}"
        lost, reports = self._lost_and_reports()
        return self._describe(lost, reports) if lost or reports else None

    def _describe(self, lost: list[int], reports: dict[int, str], own: str | None = None) -> str:
        n = self.num_processes
        parts = [f"lost process {i} of {n} (no heartbeat within {self.heartbeat_timeout_s}s)" for i in lost]
        parts += [f"process {i} of {n} failed: {text}" for i, text in sorted(reports.items()) if i not in lost]
        if own is not None:
            parts.append(f"the step failed on process 0: {own}")
        return "; ".join(parts)

    def _diagnose(self, own: str | None) -> str:
        """The failure as precisely as the job can tell within a heartbeat timeout. A lost process
        breaks the others' collectives at once, so their errors (and their exits) come first:
        wait for the liveness rounds to name a process that was lost without reporting an error,
        the cause, before blaming the processes that merely saw it go."""
        deadline = time.monotonic() + self.heartbeat_timeout_s + 4 * self.monitor.interval_s + 1
        while self.monitor.error is None:
            lost, reports = self._lost_and_reports()
            silent = [i for i in lost if i not in reports]
            if silent or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if self.monitor.error is not None:
            return f"cannot reach the coordinator: {self.monitor.error}"
        if silent:  # the others' errors are its consequence
            then = self._describe([], reports, own)
            return self._describe(silent, {}) + (f" (then: {then})" if then else "")
        return self._describe([], reports, own)

    def _wait(self, future):
        started = time.monotonic()
        while True:
            try:
                return future.result(timeout=multihost.POLL_S)
            except concurrent.futures.TimeoutError:
                pass
            except Exception as e:
                raise self._fail(self._diagnose(f"{type(e).__name__}: {e}")) from e
            if self.problems() is not None:
                raise self._fail(self._diagnose(None))
            if time.monotonic() - started > self.step_timeout_s:
                raise self._fail(f"a step did not finish within {self.step_timeout_s:g}s on every process "
                                 f"(all {self.num_processes} processes still send heartbeats: one of them hangs)")

    def stop(self) -> None:
        """Tells the workers to exit (once; not after a failure, when they may be gone)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            log.info("process 0: %d steps sent to %d processes (%.0f bytes and %.3f ms of packing and sending per "
                     "step), %d compilations after warm-up", self.num_steps, self.num_processes,
                     self.broadcast_bytes / max(self.num_steps, 1),
                     1000 * self.broadcast_seconds / max(self.num_steps, 1), self.compilations())
            if self.failure is None:
                try:
                    self.channel.send(multihost.pack(multihost.StepMessage("stop")), may_broadcast=False)
                    self._wait_for_workers_to_leave()
                except Exception as e:
                    log.error("could not tell the workers to stop: %s", e)
        self._device.shutdown(wait=False)

    def _wait_for_workers_to_leave(self, timeout_s: float = 30.0) -> None:
        """Waits (bounded) until the workers have disconnected (`leave`), so that none of them
        still needs the coordinator, which lives in this process."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.monitor.live <= {0} or self.monitor.error is not None:
                return
            time.sleep(0.05)
        log.warning("workers still connected %.0fs after the stop message", timeout_s)


class FrontTransport:
    """One replica's step transport on process 0 (`ModelRunner.use_transport`): every step
    goes through the front to every process; a failed job recovers nothing (touching the
    devices again would need every process)."""

    def __init__(self, front: Front, index: int, replicated):
        self.front, self.index, self.replicated = front, index, replicated

    def run(self, run_step, bucket, arrays, sampling, grammars, prompt_rows):
        return self.front.route_step(self.index, self.replicated, run_step, bucket, arrays, sampling, grammars,
                                     prompt_rows)

    def can_recover(self) -> bool:
        return self.front.failure is None

    def failure(self) -> str | None:
        return None if self.front.failure is None else f"the multi-host job failed: {self.front.failure}"

    def health(self) -> dict:
        return {"num_processes": self.front.num_processes, "multihost_failure": self.front.failure}


# ---- the workers ------------------------------------------------------------------------------
_worker_monitor: LivenessMonitor | None = None


def follow(engine, *, idle_wait_s: float = 1.0) -> int:
    """A worker's loop: runs every step process 0 sends, on the runner of the replica it names,
    until the stop message. Returns the number of steps run. multihost.MultiHostError when process 0 is
    lost; a step that fails here is reported to process 0 (which fails the job) and re-raised."""
    import jax

    client = multihost.coordinator_client()
    pid = jax.process_index()
    runners = []
    for replica in engine_replicas(engine):
        _check_supported(replica)
        runners.append((replica.runner.run_step, _replicated_sharding(replica.runner)))
    channel = multihost.StepChannel(client)
    global _worker_monitor
    _worker_monitor = monitor = LivenessMonitor(client, jax.process_count())

    def front_alive():  # (the coordinator lives in process 0: a lost front also fails the step channel)
        if monitor.error is not None:
            raise multihost.MultiHostError(f"lost the coordinator (process 0): {monitor.error}")
        if 0 not in monitor.live:
            raise multihost.MultiHostError("lost process 0 (the front): no heartbeat within the timeout")

    multihost.warm_up_broadcast()  # (process 0's Front does the same first)
    compilations = multihost.count_compilations()
    steps = 0
    log.info("process %d: following process 0's steps", pid)
    while True:
        message = multihost.unpack(channel.receive(idle_wait_s, front_alive))
        if message.kind == "stop":
            log.info("process %d: stop after %d steps followed, %d compilations after warm-up", pid, steps,
                     compilations())
            return steps
        run_step, replicated = runners[message.replica]
        try:
            run_global_step(run_step, replicated, Bucket(*message.bucket), message.arrays, message.sampling,
                            message.prompt_rows)
        except Exception as e:
            text = f"{type(e).__name__}: {e}"[:2000]
            try:
                client.key_value_set(f"{multihost.KEY_PREFIX}/error/{pid}", text)
            except Exception:
                pass
            raise
        steps += 1


def leave() -> None:
    """A worker's clean exit from the job (after the stop message): disconnects from the
    coordinator while process 0 still runs it (a disconnect at interpreter exit could find it
    gone, which the runtime treats as fatal)."""
    import jax
    if _worker_monitor is not None:
        _worker_monitor.stop()
    try:
        jax.distributed.shutdown()
    except Exception as e:
        log.warning("leaving the job: %s", e)

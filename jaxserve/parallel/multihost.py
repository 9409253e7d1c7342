"""Multi-host serving: one model over several processes joined by jax.distributed, one front.

Every process (one per host) runs the same command with the same flags. `join` connects them
through JAX's distributed runtime (the coordinator is process 0); `jax.devices()` then lists the
devices of every process, the mesh spans them and the checkpoint is restored straight into each
process's shards (orbax reads only what a process's devices hold).

Roles, all processes in lockstep (the front's and the workers' code: jaxserve.parallel.multihost_front;
here: joining the job, the step message and its channel):
  process 0, the front: the HTTP server or the input file, the scheduler, the sampler's host side.
    Each step the runner packs (`ModelRunner.run_step`'s inputs: bucket, step arrays, sampling
    arrays, prompt-logprob rows, grammar bitmasks filled in first) are sent to the others as one
    packed buffer through the distributed runtime's key-value store (`StepChannel`; large ones as
    device broadcasts), then process 0 runs the step itself. `Front.attach` gives each runner
    this as its step transport (`FrontTransport`).
  the other processes, workers: `follow` receives each step and calls the same compiled step on
    the same inputs, until process 0 sends stop (or is lost).
The step's inputs become global arrays (replicated, `jax.make_array_from_process_local_data`)
and its outputs (replicated) are read from the local shard, so the front's runner code is
unchanged. Steps are serialised by one lock in the front (data-parallel replicas step in
threads), so every process issues the same computations in the same order.

Why the key-value store and not `multihost_utils.broadcast_one_to_all` (bench/multihost.py,
bench/RESULTS.md "Multi-host"): for the sizes of real steps (a few KiB) the store costs 0.4-0.8 ms
per step against 0.7-3.7 ms for the device collective, which also makes every process wait for
the slowest before the step; the store compiles nothing whatever the message's size, where the
device broadcast compiles one function per shape; and a worker's get has a timeout, which is how
it notices a lost front. The store's gRPC path compresses and copies, though (23-26 ms per MiB
here), so a message over KV_MAX_BYTES only announces its size in the store and its bytes follow
as fixed 1 MiB device broadcasts (about 4-4.5 ms each here; one shape, compiled before the first
step).

Failure is loud: the job runs with the coordination service's recoverable mode, so a lost
process does not kill the others. Every process takes part in rounds of the coordinator's
GetAliveTasks (`LivenessMonitor`; a round leaves out a process whose heartbeats stopped for
`heartbeat_timeout_s`), and the front waits for each step in a separate thread (a collective with
a lost process may never return), polling those rounds and the workers' error reports. A lost
process, a worker's failed step or a step past `step_timeout_s` fail the job for good: that
step's requests end with an error naming the process, every later step fails at once, and the
server's /health answers 503.
A failed job does not try to recover (the processes' KV caches could no longer be kept equal).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import struct
import sys
from typing import Callable, Mapping

import numpy as np

# jax itself is imported inside the functions: the CLI imports this module to define its flags,
# before the jax platform is chosen (jaxserve.platforms) and before `join` may configure jax.
from jaxserve import environment

log = logging.getLogger(__name__)

ENV_VARS = (environment.COORDINATOR_ADDRESS, environment.NUM_PROCESSES, environment.PROCESS_ID)
KEY_PREFIX = "jaxserve"
DEFAULT_HEARTBEAT_TIMEOUT_S = 10
DEFAULT_STEP_TIMEOUT_S = 300.0
DEFAULT_INIT_TIMEOUT_S = 300
POLL_S = 0.2  # how often a waiting front checks the job's health
KEYS_PER_BLOCK = 256  # step keys are deleted a block at a time


class MultiHostError(RuntimeError):
    """The multi-host job failed (a process lost, hung, or a step that failed on some process)."""


# ---- joining ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class JoinOptions:
    """How this process joins a job. coordinator_address None with `auto`: jax.distributed finds
    the job from the cluster's environment (SLURM, Open MPI)."""
    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    auto: bool = False
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S
    init_timeout_s: int = DEFAULT_INIT_TIMEOUT_S


def detected_cluster(environ: Mapping[str, str] = environment.process_environment()) -> str | None:
    """The cluster whose environment jax.distributed can read the job from (SLURM, Open MPI)
    when it describes more than one process; else None."""
    def count(name):
        try:
            return int(environ.get(name, "1"))
        except ValueError:
            return 1
    if "SLURM_JOB_ID" in environ and count("SLURM_NTASKS") > 1:
        return "SLURM"
    if "OMPI_MCA_orte_hnp_uri" in environ and count("OMPI_COMM_WORLD_SIZE") > 1:
        return "Open MPI"
    return None


_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


def resolve_join_options(coordinator_address: str | None = None, num_processes: int | None = None,
                         process_id: int | None = None, *, heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
                         init_timeout_s: int = DEFAULT_INIT_TIMEOUT_S,
                         environ: Mapping[str, str] = environment.process_environment()) -> JoinOptions | None:
    """The job this process belongs to: each of the three settings from its flag, else from
    $JAXSERVE_COORDINATOR_ADDRESS / $JAXSERVE_NUM_PROCESSES / $JAXSERVE_PROCESS_ID; without a
    coordinator, auto-detected from SLURM or Open MPI; None for a single process.
    ValueError (a one-line message) for settings that cannot describe a job."""
    values = [coordinator_address, num_processes, process_id]
    for i, name in enumerate(ENV_VARS):
        if values[i] is None and environ.get(name):
            if i == 0:
                values[i] = environ[name]
            else:
                try:
                    values[i] = int(environ[name])
                except ValueError:
                    raise ValueError(f"${name} must be an integer, got {environ[name]!r}") from None
    address, n, pid = values
    if heartbeat_timeout_s < 1:
        raise ValueError(f"the heartbeat timeout must be at least 1 s, got {heartbeat_timeout_s}")
    if address is None:
        cluster = detected_cluster(environ)
        if cluster is not None:
            return JoinOptions(None, n, pid, auto=True, heartbeat_timeout_s=heartbeat_timeout_s,
                               init_timeout_s=init_timeout_s)
        if n is not None and n > 1 or pid is not None and pid > 0:
            raise ValueError("--num_processes / --process_id need --coordinator_address=host:port (process 0's "
                             "address; or $JAXSERVE_COORDINATOR_ADDRESS, or a SLURM / Open MPI job)")
        return None
    if not _ADDRESS.match(address):
        raise ValueError(f"--coordinator_address must be host:port, got {address!r}")
    if n is None or pid is None:
        raise ValueError("--coordinator_address needs --num_processes and --process_id (or their $JAXSERVE_ "
                         "variables)")
    if n < 1:
        raise ValueError(f"--num_processes must be at least 1, got {n}")
    if not 0 <= pid < n:
        raise ValueError(f"--process_id must be in [0, {n - 1}] for --num_processes={n}, got {pid}")
    return JoinOptions(address, n, pid, heartbeat_timeout_s=heartbeat_timeout_s, init_timeout_s=init_timeout_s)


def initialize(options: JoinOptions | None = None) -> bool:
    """Joins a multi-host job as `options` say, else as $JAXSERVE_COORDINATOR_ADDRESS (host:port of
    process 0), $JAXSERVE_NUM_PROCESSES and $JAXSERVE_PROCESS_ID say, else as a SLURM / Open MPI
    job's environment says; then jax.devices() lists the devices of every host. Must run before
    jax touches a device. Returns whether this process is part of a multi-host job.
    ValueError for settings that cannot describe a job."""
    import jax

    if jax.distributed.is_initialized():
        return True
    options = options or resolve_join_options()
    if options is None:
        return False
    join(options)
    return True


def join(options: JoinOptions) -> None:
    """jax.distributed.initialize for `options`, in the coordination service's recoverable mode
    (a lost process is reported, not fatal to the others) with its heartbeat timeout. Must run
    before jax touches a device."""
    import jax

    jax.config.update("jax_enable_recoverability", True)
    # Each step shape is compiled once, by process 0, and its binary shared with the others
    # through the key-value store. (JAX's persistent cache is written by process 0 only, and a
    # shape process 0 found there would never be shared: it stays off in a job.)
    jax.config.update("jax_enable_compilation_cache", False)
    jax.config.update("jax_share_binary_between_hosts", True)
    kwargs = dict(initialization_timeout=options.init_timeout_s,
                  heartbeat_timeout_seconds=options.heartbeat_timeout_s,
                  shutdown_timeout_seconds=max(5, options.heartbeat_timeout_s))
    if options.auto:
        jax.distributed.initialize(num_processes=options.num_processes, process_id=options.process_id, **kwargs)
    else:
        jax.distributed.initialize(options.coordinator_address, num_processes=options.num_processes,
                                   process_id=options.process_id, **kwargs)
    log.info("joined the multi-host job as process %d of %d (%d local, %d global devices)",
             jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())


def is_multihost() -> bool:
    """Whether this process is one of several in a jax.distributed job."""
    import jax
    return jax.distributed.is_initialized() and jax.process_count() > 1


def coordinator_client():
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None:
        raise MultiHostError("jax.distributed is not initialized")
    return client


def agree_min(name: str, value: int, timeout_s: float = 300.0) -> int:
    """The smallest `value` over all processes (every process calls it with the same `name`),
    through the key-value store: no device computation, nothing compiled."""
    import jax
    client = coordinator_client()
    client.key_value_set(f"{KEY_PREFIX}/agree/{name}/{jax.process_index()}", str(int(value)))
    return min(int(client.blocking_key_value_get(f"{KEY_PREFIX}/agree/{name}/{i}", int(timeout_s * 1000)))
               for i in range(jax.process_count()))


# ---- the step message -------------------------------------------------------------------------
@dataclasses.dataclass
class StepMessage:
    """One step as the front sends it: which replica, its bucket and the `run_step` inputs."""
    kind: str  # "step" or "stop"
    replica: int = 0
    bucket: tuple[int, int, int] | None = None  # (num_decode, num_prefill_tokens, pages_per_seq)
    arrays: dict[str, np.ndarray] | None = None
    sampling: dict[str, np.ndarray] | None = None
    prompt_rows: dict[str, np.ndarray] | None = None


_GROUPS = ("arrays", "sampling", "prompt_rows")


FILL_MIN_BYTES = 1024  # larger arrays holding one value throughout are sent as that value


def pack(message: StepMessage) -> bytes:
    """One buffer: a 4-byte header length, a JSON header (kind, replica, bucket, each array's
    group, name, dtype, shape and, for a large array of one value, that value), then the other
    arrays' bytes back to back. (The grammar bitmask [rows, vocab / 32] is all ones unless a row
    has a grammar: most steps send 0 of its bytes.)"""
    entries, chunks = [], []
    for group in _GROUPS:
        for name, array in (getattr(message, group) or {}).items():
            array = np.ascontiguousarray(array)
            entry = [group, name, array.dtype.str, list(array.shape)]
            if array.nbytes >= FILL_MIN_BYTES and (array == array.flat[0]).all():
                entry.append(array.flat[0].item())
            else:
                chunks.append(array.tobytes())
            entries.append(entry)
    header = json.dumps({"kind": message.kind, "replica": message.replica, "bucket": message.bucket,
                         "groups": [g for g in _GROUPS if getattr(message, g) is not None],
                         "entries": entries}).encode()
    return b"".join([struct.pack("<I", len(header)), header, *chunks])


def unpack(payload: bytes) -> StepMessage:
    """The StepMessage of a `pack`ed buffer (arrays are read-only views of it)."""
    (size,) = struct.unpack_from("<I", payload)
    header = json.loads(payload[4:4 + size])
    message = StepMessage(header["kind"], header["replica"],
                          None if header["bucket"] is None else tuple(header["bucket"]))
    for group in header["groups"]:
        setattr(message, group, {})
    offset = 4 + size
    for group, name, dtype, shape, *fill in header["entries"]:
        dtype = np.dtype(dtype)
        if fill:
            getattr(message, group)[name] = np.full(shape, fill[0], dtype)
            continue
        count = int(np.prod(shape, dtype=np.int64))
        getattr(message, group)[name] = np.frombuffer(payload, dtype, count, offset).reshape(shape)
        offset += count * dtype.itemsize
    if offset != len(payload):
        raise MultiHostError(f"step message of {len(payload)} bytes, {offset} described")
    return message


# Larger step messages go as device broadcasts (bench/multihost.py); $JAXSERVE_MULTIHOST_KV_MAX_BYTES
# overrides it (the same value on every process).
KV_MAX_BYTES = environment.multihost_kv_max_bytes()
CHUNK_BYTES = 1 << 20  # the one compiled shape of those broadcasts


class StepChannel:
    """Process 0 -> the others, one message per step. Through the distributed runtime's
    key-value store (keys `jaxserve/step/<block>/<seq>`; a block is deleted once every process
    is two blocks past it, which the lockstep guarantees), except that a message over
    KV_MAX_BYTES only announces its size there and its bytes follow as `broadcast_bytes`
    collectives: the store's gRPC path compresses and copies (23-26 ms per MiB here, against
    about 4 ms per MiB chunk for the device broadcast), while below ~128 KiB the store is the
    cheaper one (0.4-0.5 ms for 1-8 KiB against 0.6-3.4 ms)."""

    def __init__(self, client=None):
        self._client = client or coordinator_client()
        self.seq = 0

    def _key(self, seq: int) -> str:
        return f"{KEY_PREFIX}/step/{seq // KEYS_PER_BLOCK}/{seq}"

    def send(self, payload: bytes, may_broadcast: bool = True) -> bytes | None:
        """Puts the message (or, for a large one, its size) in the store. Returns the bytes the
        caller must then send with `broadcast_bytes` (large messages), else None."""
        seq = self.seq
        if seq % KEYS_PER_BLOCK == 0 and seq >= 2 * KEYS_PER_BLOCK:
            self._client.key_value_delete(f"{KEY_PREFIX}/step/{seq // KEYS_PER_BLOCK - 2}")
        large = may_broadcast and len(payload) > KV_MAX_BYTES
        self._client.key_value_set_bytes(self._key(seq), b"B" + struct.pack("<Q", len(payload)) if large
                                         else b"K" + payload)
        self.seq += 1
        return payload if large else None

    def receive(self, wait_s: float = 1.0, on_idle: Callable[[], None] | None = None) -> bytes:
        """The next message (a large one fetched with `broadcast_bytes`); waits in `wait_s`
        slices, calling `on_idle` between them (which raises to stop waiting). MultiHostError
        when the coordinator cannot be reached."""
        while True:
            try:
                message = self._client.blocking_key_value_get_bytes(self._key(self.seq), int(wait_s * 1000))
            except Exception as e:  # the runtime raises XlaRuntimeError for both
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise MultiHostError(f"lost the coordinator (process 0): {e}") from None
                if on_idle is not None:
                    on_idle()
                continue
            self.seq += 1
            if message[:1] == b"B":
                return broadcast_bytes(None, struct.unpack_from("<Q", message, 1)[0])
            return message[1:]


def broadcast_bytes(payload: bytes | None, size: int) -> bytes:
    """Process 0's `payload` (None elsewhere) on every process, in CHUNK_BYTES chunks through
    `multihost_utils.broadcast_one_to_all` (one compiled shape; every process must call this
    with the same size, in the same order as its other collectives)."""
    from jax.experimental import multihost_utils

    out = []
    for start in range(0, max(size, 1), CHUNK_BYTES):
        chunk = np.zeros(CHUNK_BYTES, np.uint8)
        if payload is not None:
            piece = np.frombuffer(payload, np.uint8, min(CHUNK_BYTES, size - start), start)
            chunk[:len(piece)] = piece
        out.append(np.asarray(multihost_utils.broadcast_one_to_all(chunk)).tobytes())
    return b"".join(out)[:size]


def warm_up_broadcast() -> None:
    """Compiles the chunk broadcast; every process calls it once, before any step."""
    import jax
    broadcast_bytes(b"\0" if jax.process_index() == 0 else None, 1)


def count_compilations():
    """Starts counting XLA compilations in this process; returns a function that reads the count."""
    from jax import monitoring
    events = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(duration)
    monitoring.register_event_duration_secs_listener(listener)
    return lambda: len(events)


def rss_bytes() -> int | None:
    """This process's resident set size (Linux /proc); None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def exit_now(code: int) -> None:
    """Ends the process now (output flushed), skipping interpreter shutdown: after a failed job
    a thread may be stuck in a collective with a lost process, which a normal exit would join."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)

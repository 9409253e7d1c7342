"""ModelRunner: ScheduledBatch -> fixed-shape numpy arrays -> one jitted step -> sampled ids.

The runner works from the scheduler's plain step data (`jaxserve.scheduler.ScheduledBatch`) alone; it never
sees a `Request`. Shapes come from a small set of buckets (`BucketSet`): decode rows x prefill
tokens x block table width (one full width on the XLA CPU path, whose cost follows the longest
context present); every step pads to the smallest bucket that holds it, so after warm-up no step
compiles again. The KV cache is donated to the step and updated in place.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import device_setup, sampler
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.outputs import StepInputError
from jaxserve.models import llama
from jaxserve.scheduler import ScheduledBatch

log = logging.getLogger(__name__)


def geometric_buckets(low: int, high: int, factor: int = 2) -> tuple[int, ...]:
    """low, factor*low, factor**2*low, ... capped by high (which is always included)."""
    sizes, size = [], min(low, high)
    while size < high:
        sizes.append(size)
        size *= factor
    sizes.append(high)
    return tuple(sizes)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One compiled step shape."""
    num_decode: int  # decode rows
    num_prefill_tokens: int  # prefill tokens (0: no prefill part)
    pages_per_seq: int  # block table width: pages per sequence the step may read


@dataclasses.dataclass(frozen=True)
class BucketSet:
    """The step shapes an engine compiles: every combination of its decode rows, prefill tokens
    and block-table widths (but not the empty step).

    Rows and tokens double from bucket to bucket, so a step pays for at most twice its work (on
    CPU a decode step's cost grows with its rows: 16 running sequences in a 32-row bucket took
    twice as long); context buckets are coarser (x4), as few steps need them. The XLA CPU path
    has one table width, since its cost follows the longest context present, not the width."""
    decode: tuple[int, ...]
    prefill: tuple[int, ...]
    pages: tuple[int, ...]
    max_num_prefill_seqs: int

    @classmethod
    def create(cls, *, backend: str, max_num_seqs: int, max_num_batched_tokens: int,
               max_num_prefill_seqs: int, max_model_len: int, page_size: int) -> "BucketSet":
        max_pages_per_seq = -(-max_model_len // page_size)
        pages = ((max_pages_per_seq,) if backend == "xla" else
                 geometric_buckets(-(-256 // page_size), max_pages_per_seq, 4))
        return cls((0,) + geometric_buckets(8, max_num_seqs, 2),
                   (0,) + geometric_buckets(32, max_num_batched_tokens, 2), pages, max_num_prefill_seqs)

    def all(self) -> list[Bucket]:
        return [Bucket(d, p, n) for d in self.decode for p in self.prefill for n in self.pages if d or p]

    def smallest_and_largest(self) -> list[Bucket]:
        """The corner shapes: smallest and largest of each kind (a compile check CI can afford)."""
        def ends(sizes):  # 0 (no part of that kind) where allowed, the smallest size, the largest
            nonzero = [size for size in sizes if size]
            return sorted({size for size in sizes if size == 0} | {nonzero[0], nonzero[-1]})
        return [Bucket(d, p, n) for d in ends(self.decode) for p in ends(self.prefill) for n in ends(self.pages)
                if d or p]

    def fit(self, num_decode: int, num_prefill_tokens: int, pages_per_seq: int) -> Bucket:
        """The smallest bucket that holds a step."""
        return Bucket(next(b for b in self.decode if b >= num_decode),
                      next(b for b in self.prefill if b >= num_prefill_tokens),
                      next(b for b in self.pages if b >= pages_per_seq))

    def empty_batch(self, bucket: Bucket) -> dict[str, np.ndarray]:
        """All-padding arrays of one bucket's shapes (padding tokens write into the null page)."""
        dec, pre, P = bucket.num_decode, bucket.num_prefill_tokens, bucket.pages_per_seq
        num_prefill_seqs = self.max_num_prefill_seqs if pre else 0
        T = dec + pre
        return dict(
            token_ids=np.zeros(T, np.int32),  # [T]
            positions=np.zeros(T, np.int32),  # [T]
            slot_mapping=np.zeros(T, np.int32),  # [T]
            decode_block_table=np.zeros((dec, P), np.int32),  # [num_decode, pages]
            decode_seq_lens=np.zeros(dec, np.int32),  # [num_decode]
            prefill_block_table=np.zeros((num_prefill_seqs, P), np.int32),  # [num_prefill_seqs, pages]
            prefill_seq_lens=np.zeros(num_prefill_seqs, np.int32),  # [num_prefill_seqs]
            prefill_query_start_loc=np.zeros(num_prefill_seqs + 1, np.int32),  # [num_prefill_seqs + 1]
            logits_indices=np.zeros(dec + num_prefill_seqs, np.int32))  # [rows]


@dataclasses.dataclass
class StepOutput:
    """Host copies of what one step sampled, one row per row of its batch (decode rows, then
    prefill chunks), and what the step cost."""
    token_ids: np.ndarray  # int32[num_rows]
    logprobs: np.ndarray | None  # float32[num_rows]; None when no row asked for logprobs
    top_ids: np.ndarray | None  # int32[num_rows, max_logprobs]
    top_logprobs: np.ndarray | None  # float32[num_rows, max_logprobs]
    bucket: Bucket  # the compiled shape the step ran in
    device_seconds: float  # jitted forward + sampler: host arrays in, sampled ids out
    host_seconds: float  # the runner's host work: packing the arrays, slicing the results


class ModelRunner:
    """Owns the weights and the KV cache on device; runs one step per ScheduledBatch."""

    def __init__(self, config: ModelConfig, params, engine_config: EngineConfig, *, num_pages: int,
                 max_model_len: int, shardings=None):
        """The step of `config`'s model under `engine_config` (page size, limits, attention backend,
        KV cache dtype, max_logprobs) over a pool of `num_pages` pages (null page included) for
        sequences of at most `max_model_len`; on the mesh of `shardings` when given."""
        page_size, max_num_seqs = engine_config.page_size, engine_config.max_num_seqs
        max_num_batched_tokens, max_num_prefill_seqs = engine_config.max_num_batched_tokens, engine_config.max_num_prefill_seqs
        max_logprobs = engine_config.max_logprobs
        backend = device_setup.attention_backend(engine_config.attention_backend)
        kv_dtype = device_setup.kv_cache_dtype(engine_config.kv_cache_dtype)
        self.config = config
        # Sharded: weights placed on the mesh; the step runs `shardings.model_config` (the same
        # model, with KV heads replicated when tensor parallelism exceeds them).
        self.params = params if shardings is None else shardings.place(params)
        step_config = config if shardings is None else shardings.model_config
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_model_len = max_model_len
        self.max_pages_per_seq = -(-max_model_len // page_size)
        self.max_num_prefill_seqs = max_num_prefill_seqs
        self.max_logprobs = max_logprobs
        self.backend = backend
        self.buckets = BucketSet.create(
            backend=backend, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_num_prefill_seqs=max_num_prefill_seqs, max_model_len=max_model_len, page_size=page_size)
        dtype = kv_dtype or jax.tree_util.tree_leaves(params)[0].dtype
        cache_sharding = None if shardings is None else shardings.kv_cache
        self._new_kv_cache = functools.partial(
            llama.init_kv_cache, step_config, llama.KVCacheSpec(num_pages, page_size), dtype, cache_sharding)
        self.kv_cache = self._new_kv_cache()
        # Two jitted functions per step, both on device (logits never reach the host): the
        # sampler's shapes depend only on the number of rows, so it compiles far fewer times.
        forward = functools.partial(llama.forward, config=step_config, backend=backend,
                                    mesh=None if shardings is None else shardings.mesh)
        if shardings is None:
            self._forward = jax.jit(forward, donate_argnums=(1,))
        else:  # one step for the whole mesh; logits gathered (replicated) for the sampler
            kv = {"k": shardings.kv_cache, "v": shardings.kv_cache}
            param_shardings = jax.tree.map(lambda a: a.sharding, self.params)  # quantized leaves: per array
            self._forward = jax.jit(forward, donate_argnums=(1,),
                                    in_shardings=(param_shardings, kv, shardings.replicated),
                                    out_shardings=(shardings.replicated, kv))
        sample = functools.partial(sampler.sample, max_logprobs=max_logprobs)
        self._sample = jax.jit(sample) if shardings is None else jax.jit(
            sample, in_shardings=shardings.replicated, out_shardings=shardings.replicated)
        self._compiled_forward: dict[Bucket, jax.stages.Compiled] = {}  # filled by warmup()
        self._compiled_sample: dict[tuple[int, bool], jax.stages.Compiled] = {}  # (rows, penalties)

    # ---- shapes ---------------------------------------------------------------------------
    def bucket_for(self, num_decode: int, num_prefill_tokens: int, pages_per_seq: int) -> Bucket:
        return self.buckets.fit(num_decode, num_prefill_tokens, pages_per_seq)

    def all_buckets(self) -> list[Bucket]:
        return self.buckets.all()

    # ---- host arrays ----------------------------------------------------------------------
    def _slots(self, page_ids: Sequence[int], start: int, stop: int) -> np.ndarray:
        """KV slots (page * page_size + offset) of positions start .. stop - 1. int32[stop - start]."""
        positions = np.arange(start, stop)
        pages = np.asarray(page_ids, np.int32)[positions // self.page_size]
        return pages * self.page_size + positions % self.page_size

    def build_batch(self, batch: ScheduledBatch) -> tuple[Bucket, dict[str, np.ndarray], list]:
        """Pads the batch into its bucket. Returns (bucket, step arrays, the ScheduledRow of each
        sampled row: decode rows at 0.., prefill chunks at bucket.num_decode..; None for padding)."""
        bucket = self.bucket_for(len(batch.decode), batch.num_prefill_tokens, batch.max_pages_per_seq)
        arrays = self.empty_batch(bucket)
        dec_bucket = bucket.num_decode
        token_ids, positions, slot_mapping = arrays["token_ids"], arrays["positions"], arrays["slot_mapping"]
        decode_block_table, decode_seq_lens = arrays["decode_block_table"], arrays["decode_seq_lens"]
        prefill_block_table, prefill_seq_lens = arrays["prefill_block_table"], arrays["prefill_seq_lens"]
        query_start_loc, logits_indices = arrays["prefill_query_start_loc"], arrays["logits_indices"]
        query_start_loc[:] = batch.num_prefill_tokens
        rows: list = [None] * len(logits_indices)

        for i, row in enumerate(batch.decode):
            token_ids[i] = row.token_ids[0]
            positions[i] = row.start
            slot_mapping[i] = row.page_ids[row.start // self.page_size] * self.page_size + row.start % self.page_size
            decode_block_table[i, :len(row.page_ids)] = row.page_ids
            decode_seq_lens[i] = row.end
            logits_indices[i] = i
            rows[i] = row
        offset = 0
        for j, row in enumerate(batch.prefill):
            n = len(row.token_ids)
            t0 = dec_bucket + offset
            token_ids[t0:t0 + n] = row.token_ids
            positions[t0:t0 + n] = np.arange(row.start, row.end)
            slot_mapping[t0:t0 + n] = self._slots(row.page_ids, row.start, row.end)
            prefill_block_table[j, :len(row.page_ids)] = row.page_ids
            prefill_seq_lens[j] = row.end
            query_start_loc[j] = offset
            offset += n
            logits_indices[dec_bucket + j] = t0 + n - 1
            rows[dec_bucket + j] = row
        return bucket, arrays, rows

    def empty_batch(self, bucket: Bucket) -> dict[str, np.ndarray]:
        return self.buckets.empty_batch(bucket)

    def _sampling_inputs(self, rows: list) -> dict[str, np.ndarray]:
        try:
            return sampler.build_sampling_inputs([None if row is None else row.sampling for row in rows],
                                                 len(rows), self.max_model_len)
        except sampler.RowInputError as e:
            raise StepInputError(rows[e.row_index].request_id, str(e)) from e

    # ---- device ---------------------------------------------------------------------------
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Runs one step: host arrays in, sampled ids (and logprobs) out; the only crossing.

        Raises StepInputError naming the request whose inputs could not be packed (nothing ran);
        any other exception comes from the device step (see `recover`)."""
        start = time.perf_counter()
        bucket, arrays, rows = self.build_batch(batch)
        sampling = self._sampling_inputs(rows)
        device_start = time.perf_counter()
        out = jax.device_get(self._run_step(bucket, arrays, sampling))
        device_seconds = time.perf_counter() - device_start
        keep = list(range(len(batch.decode))) + [bucket.num_decode + j for j in range(len(batch.prefill))]
        want_logprobs = any(row.sampling is not None and row.sampling.params.logprobs is not None
                            for row in batch.rows)
        names = ("token_ids", "logprobs", "top_ids", "top_logprobs") if want_logprobs else ("token_ids",)
        kept = {name: np.asarray(out[name])[keep] for name in names}
        return StepOutput(token_ids=kept["token_ids"], logprobs=kept.get("logprobs"), top_ids=kept.get("top_ids"),
                          top_logprobs=kept.get("top_logprobs"), bucket=bucket, device_seconds=device_seconds,
                          host_seconds=time.perf_counter() - start - device_seconds)

    def recover(self) -> bool:
        """After a failed step: rebuilds the KV cache if the step consumed it (donated buffers
        are deleted once a call takes them). Returns whether it was rebuilt, i.e. every cached
        K/V is lost and the requests that had any must be recomputed."""
        if not any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(self.kv_cache)):
            return False
        self.kv_cache = self._new_kv_cache()
        return True

    def warmup(self) -> int:
        """Compiles the step for every bucket, ahead of time and on all cores. Returns the count.

        XLA compiles with the GIL released, so a thread per core compiles that many shapes at
        once; the executables are kept and used by `execute`, so serving never compiles."""
        start = time.perf_counter()
        buckets = self.all_buckets()

        def compile_bucket(bucket):
            batch = self.empty_batch(bucket)
            self._compiled_forward[bucket] = self._forward.lower(self.params, self.kv_cache, batch).compile()

        def compile_sampler(num_rows, penalties):
            logits = jax.ShapeDtypeStruct((num_rows, self.config.vocab_size), jnp.float32)
            sampling = sampler.build_sampling_inputs([None] * num_rows, num_rows, self.max_model_len, penalties)
            self._compiled_sample[num_rows, penalties] = self._sample.lower(logits, sampling).compile()

        row_counts = sorted({len(self.empty_batch(b)["logits_indices"]) for b in buckets})
        samplers = [(n, penalties) for n in row_counts for penalties in (False, True)]
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            jobs = [pool.submit(compile_bucket, b) for b in buckets]
            jobs += [pool.submit(compile_sampler, n, penalties) for n, penalties in samplers]
            for job in jobs:
                job.result()
        log.info("warm-up compiled %d step shapes and %d sampler shapes (with and without penalties) in "
                 "%.1fs", len(buckets), len(samplers), time.perf_counter() - start)
        return len(buckets)

    def _run_step(self, bucket: Bucket, arrays, sampling) -> dict[str, jax.Array]:
        forward = self._compiled_forward.get(bucket, self._forward)
        logits, self.kv_cache = forward(self.params, self.kv_cache, arrays)
        key = (logits.shape[0], sampler.has_histories(sampling))
        return self._compiled_sample.get(key, self._sample)(logits, sampling)

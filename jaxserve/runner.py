"""ModelRunner: StepPlan -> fixed-shape numpy arrays -> one jitted step -> sampled ids.

Shapes come from a small set of buckets (`BucketSet`): decode rows x prefill tokens x block table
width (one full width on the XLA CPU path, whose cost follows the longest context present); every
step pads to the smallest bucket that
holds it, so after warm-up no step compiles again. The KV cache is donated to the step and
updated in place.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import sampler
from jaxserve.config import ModelConfig
from jaxserve.outputs import StepInputError
from jaxserve.models import llama
from jaxserve.scheduler import StepPlan

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
    num_pages: int  # block table width: pages per sequence the step may read


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

    def fit(self, num_decode: int, num_prefill_tokens: int, num_pages: int) -> Bucket:
        """The smallest bucket that holds a step."""
        return Bucket(next(b for b in self.decode if b >= num_decode),
                      next(b for b in self.prefill if b >= num_prefill_tokens),
                      next(b for b in self.pages if b >= num_pages))

    def empty_batch(self, bucket: Bucket) -> dict[str, np.ndarray]:
        """All-padding arrays of one bucket's shapes (padding tokens write into the null page)."""
        dec, pre, P = bucket.num_decode, bucket.num_prefill_tokens, bucket.num_pages
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
    """Host copies of what one step sampled: one row per decode request, then one per prefill chunk."""
    token_ids: np.ndarray  # int32[num_rows]
    logprobs: np.ndarray | None  # float32[num_rows]
    top_ids: np.ndarray | None  # int32[num_rows, max_logprobs]
    top_logprobs: np.ndarray | None  # float32[num_rows, max_logprobs]
    device_seconds: float


class ModelRunner:
    """Owns the weights and the KV cache on device; runs one step per StepPlan."""

    def __init__(self, config: ModelConfig, params, *, num_pages: int, page_size: int,
                 max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_num_prefill_seqs: int, backend: str, max_logprobs: int = 20,
                 kv_dtype=None, shardings=None):
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
        self._compiled_sample: dict[int, jax.stages.Compiled] = {}

    # ---- shapes ---------------------------------------------------------------------------
    def bucket_for(self, num_decode: int, num_prefill_tokens: int, num_pages: int) -> Bucket:
        return self.buckets.fit(num_decode, num_prefill_tokens, num_pages)

    def all_buckets(self) -> list[Bucket]:
        return self.buckets.all()

    # ---- host arrays ----------------------------------------------------------------------
    def _slots(self, page_ids: list[int], start: int, stop: int) -> np.ndarray:
        positions = np.arange(start, stop)
        pages = np.asarray(page_ids, np.int32)[positions // self.page_size]
        return pages * self.page_size + positions % self.page_size

    def build_batch(self, plan: StepPlan) -> tuple[Bucket, dict[str, np.ndarray], list]:
        """Pads the plan into its bucket. Returns (bucket, batch arrays, per-row requests)."""
        num_prefill_tokens = sum(n for _, n in plan.prefill)
        num_pages = max(len(r.page_ids) for r in plan.decode + [r for r, _ in plan.prefill])
        bucket = self.bucket_for(len(plan.decode), num_prefill_tokens, num_pages)
        batch = self.empty_batch(bucket)
        dec_bucket = bucket.num_decode
        token_ids, positions, slot_mapping = batch["token_ids"], batch["positions"], batch["slot_mapping"]
        decode_block_table, decode_seq_lens = batch["decode_block_table"], batch["decode_seq_lens"]
        prefill_block_table, prefill_seq_lens = batch["prefill_block_table"], batch["prefill_seq_lens"]
        query_start_loc, logits_indices = batch["prefill_query_start_loc"], batch["logits_indices"]
        query_start_loc[:] = num_prefill_tokens
        rows: list = [None] * len(logits_indices)

        for i, req in enumerate(plan.decode):
            pos = req.num_computed_tokens
            token_ids[i] = req.all_token_ids[pos]
            positions[i] = pos
            slot_mapping[i] = self._slots(req.page_ids, pos, pos + 1)[0]
            decode_block_table[i, :len(req.page_ids)] = req.page_ids
            decode_seq_lens[i] = pos + 1
            logits_indices[i] = i
            rows[i] = req
        offset = 0
        for j, (req, n) in enumerate(plan.prefill):
            start = req.num_computed_tokens
            t0 = dec_bucket + offset
            token_ids[t0:t0 + n] = req.all_token_ids[start:start + n]
            positions[t0:t0 + n] = np.arange(start, start + n)
            slot_mapping[t0:t0 + n] = self._slots(req.page_ids, start, start + n)
            prefill_block_table[j, :len(req.page_ids)] = req.page_ids
            prefill_seq_lens[j] = start + n
            query_start_loc[j] = offset
            offset += n
            logits_indices[dec_bucket + j] = t0 + n - 1
            rows[dec_bucket + j] = req
        return bucket, batch, rows

    def empty_batch(self, bucket: Bucket) -> dict[str, np.ndarray]:
        return self.buckets.empty_batch(bucket)

    def _sampling_inputs(self, rows: list) -> dict[str, np.ndarray]:
        row_params = [None if req is None else _row_params(req) for req in rows]
        try:
            return sampler.build_sampling_inputs(row_params, len(rows), self.max_model_len)
        except sampler.RowInputError as e:
            raise StepInputError(rows[e.row_index], str(e)) from e

    # ---- device ---------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepOutput:
        """Runs one step: host arrays in, sampled ids (and logprobs) out; the only crossing.

        Raises StepInputError naming the request whose inputs could not be packed (nothing ran);
        any other exception comes from the device step (see `recover`)."""
        bucket, batch, rows = self.build_batch(plan)
        sampling = self._sampling_inputs(rows)
        start = time.perf_counter()
        out = jax.device_get(self._run_step(bucket, batch, sampling))
        elapsed = time.perf_counter() - start
        num_dec = len(plan.decode)
        dec_bucket = batch["decode_seq_lens"].shape[0]
        keep = list(range(num_dec)) + [dec_bucket + j for j in range(len(plan.prefill))]
        want_logprobs = any(req is not None and req.params.logprobs is not None for req in rows)
        return StepOutput(
            token_ids=np.asarray(out["token_ids"])[keep],
            logprobs=np.asarray(out["logprobs"])[keep] if want_logprobs else None,
            top_ids=np.asarray(out["top_ids"])[keep] if want_logprobs else None,
            top_logprobs=np.asarray(out["top_logprobs"])[keep] if want_logprobs else None,
            device_seconds=elapsed)

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

        def compile_sampler(num_rows):
            logits = jax.ShapeDtypeStruct((num_rows, self.config.vocab_size), jnp.float32)
            sampling = sampler.build_sampling_inputs([None] * num_rows, num_rows, self.max_model_len)
            self._compiled_sample[num_rows] = self._sample.lower(logits, sampling).compile()

        row_counts = sorted({len(self.empty_batch(b)["logits_indices"]) for b in buckets})
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            jobs = [pool.submit(compile_bucket, b) for b in buckets]
            jobs += [pool.submit(compile_sampler, n) for n in row_counts]
            for job in jobs:
                job.result()
        log.info("warm-up compiled %d step shapes and %d sampler shapes in %.1fs", len(buckets),
                 len(row_counts), time.perf_counter() - start)
        return len(buckets)

    def _run_step(self, bucket: Bucket, batch, sampling) -> dict[str, jax.Array]:
        forward = self._compiled_forward.get(bucket, self._forward)
        logits, self.kv_cache = forward(self.params, self.kv_cache, batch)
        return self._compiled_sample.get(logits.shape[0], self._sample)(logits, sampling)


def _row_params(req) -> sampler.RowParams:
    return sampler.RowParams(req.params, seed=req.seed, step=req.num_output_tokens,
                             prompt_token_ids=req.prompt_token_ids, output_token_ids=req.output_token_ids)

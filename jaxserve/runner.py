"""ModelRunner: StepPlan -> fixed-shape numpy arrays -> one jitted step -> sampled ids.

Shapes come from a small set of buckets: decode rows (`decode_buckets`) x prefill tokens
(`prefill_buckets`); every step pads to the smallest bucket that holds it, so after warm-up no
step compiles again. The KV cache is donated to the step and updated in place.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import sampler
from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve.scheduler import StepPlan

log = logging.getLogger(__name__)


def power_of_two_buckets(low: int, high: int) -> tuple[int, ...]:
    """low, 2*low, 4*low, ... capped by high (which is always included)."""
    sizes, size = [], low
    while size < high:
        sizes.append(size)
        size *= 2
    sizes.append(high)
    return tuple(sizes)


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
        self.params = params
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_model_len = max_model_len
        self.max_pages_per_seq = -(-max_model_len // page_size)
        self.max_num_prefill_seqs = max_num_prefill_seqs
        self.max_logprobs = max_logprobs
        self.backend = backend
        self.decode_buckets = (0,) + power_of_two_buckets(min(8, max_num_seqs), max_num_seqs)
        self.prefill_buckets = (0,) + power_of_two_buckets(min(32, max_num_batched_tokens),
                                                           max_num_batched_tokens)
        dtype = kv_dtype or jax.tree_util.tree_leaves(params)[0].dtype
        cache_sharding = None if shardings is None else shardings.kv_cache
        self.kv_cache = llama.init_kv_cache(
            config, llama.KVCacheSpec(num_pages, page_size), dtype, cache_sharding)
        self._step = jax.jit(functools.partial(_step, config=config, backend=backend,
                                               max_logprobs=max_logprobs),
                             donate_argnums=(1,))

    # ---- shapes ---------------------------------------------------------------------------
    def bucket_for(self, num_decode: int, num_prefill_tokens: int) -> tuple[int, int]:
        dec = next(b for b in self.decode_buckets if b >= num_decode)
        pre = next(b for b in self.prefill_buckets if b >= num_prefill_tokens)
        return dec, pre

    def all_buckets(self) -> list[tuple[int, int]]:
        return [(d, p) for d in self.decode_buckets for p in self.prefill_buckets if d or p]

    # ---- host arrays ----------------------------------------------------------------------
    def _slots(self, page_ids: list[int], start: int, stop: int) -> np.ndarray:
        positions = np.arange(start, stop)
        pages = np.asarray(page_ids, np.int32)[positions // self.page_size]
        return pages * self.page_size + positions % self.page_size

    def build_batch(self, plan: StepPlan) -> tuple[dict[str, np.ndarray], list]:
        """Pads the plan into its bucket. Returns (batch arrays, per-row sampling params)."""
        num_decode = len(plan.decode)
        num_prefill_tokens = sum(n for _, n in plan.prefill)
        dec_bucket, pre_bucket = self.bucket_for(num_decode, num_prefill_tokens)
        num_prefill_seqs = self.max_num_prefill_seqs if pre_bucket else 0
        T = dec_bucket + pre_bucket
        P = self.max_pages_per_seq
        token_ids = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        slot_mapping = np.zeros(T, np.int32)  # padding writes land in the null page
        decode_block_table = np.zeros((dec_bucket, P), np.int32)
        decode_seq_lens = np.zeros(dec_bucket, np.int32)
        prefill_block_table = np.zeros((num_prefill_seqs, P), np.int32)
        prefill_seq_lens = np.zeros(num_prefill_seqs, np.int32)
        query_start_loc = np.full(num_prefill_seqs + 1, num_prefill_tokens, np.int32)
        logits_indices = np.zeros(dec_bucket + num_prefill_seqs, np.int32)
        rows: list = [None] * (dec_bucket + num_prefill_seqs)

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
        batch = dict(token_ids=token_ids, positions=positions, slot_mapping=slot_mapping,
                     decode_block_table=decode_block_table, decode_seq_lens=decode_seq_lens,
                     prefill_block_table=prefill_block_table, prefill_seq_lens=prefill_seq_lens,
                     prefill_query_start_loc=query_start_loc, logits_indices=logits_indices)
        return batch, rows

    def _sampling_inputs(self, rows: list) -> dict[str, np.ndarray]:
        row_params = [None if req is None else sampler.RowParams.from_request(req) for req in rows]
        return sampler.build_sampling_inputs(row_params, len(rows), self.max_model_len)

    # ---- device ---------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepOutput:
        """Runs one step: host arrays in, sampled ids (and logprobs) out; the only crossing."""
        batch, rows = self.build_batch(plan)
        sampling = self._sampling_inputs(rows)
        start = time.perf_counter()
        out, self.kv_cache = self._step(self.params, self.kv_cache, batch, sampling)
        out = jax.device_get(out)
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

    def warmup(self) -> int:
        """Compiles the step for every bucket (empty plans padded to each shape). Returns the count."""
        start = time.perf_counter()
        buckets = self.all_buckets()
        for dec, pre in buckets:
            batch, sampling = self.dummy_inputs(dec, pre)
            out, self.kv_cache = self._step(self.params, self.kv_cache, batch, sampling)
            jax.block_until_ready(out)
        log.info("warm-up compiled %d step shapes in %.1fs", len(buckets), time.perf_counter() - start)
        return len(buckets)

    def dummy_inputs(self, dec: int, pre: int):
        num_prefill_seqs = self.max_num_prefill_seqs if pre else 0
        P, T = self.max_pages_per_seq, dec + pre
        batch = dict(token_ids=np.zeros(T, np.int32), positions=np.zeros(T, np.int32),
                     slot_mapping=np.zeros(T, np.int32),
                     decode_block_table=np.zeros((dec, P), np.int32),
                     decode_seq_lens=np.zeros(dec, np.int32),
                     prefill_block_table=np.zeros((num_prefill_seqs, P), np.int32),
                     prefill_seq_lens=np.zeros(num_prefill_seqs, np.int32),
                     prefill_query_start_loc=np.zeros(num_prefill_seqs + 1, np.int32),
                     logits_indices=np.zeros(dec + num_prefill_seqs, np.int32))
        rows = [None] * (dec + num_prefill_seqs)
        return batch, sampler.build_sampling_inputs(rows, len(rows), self.max_model_len)


def _step(params, kv_cache, batch, sampling, *, config, backend, max_logprobs):
    logits, kv_cache = llama.forward(params, kv_cache, batch, config=config, backend=backend)
    out = sampler.sample(logits, sampling, max_logprobs=max_logprobs)
    return out, kv_cache

"""Speculative decoding with a draft model: a second, smaller model in the same engine.

The draft has its own paged K/V cache laid out like the target's: the same pages (page ids, page
size) plus a few scratch pages per proposing row. Its cache is kept in step with the target's by
*mirroring*: after every target step the draft's forward runs on the very same step arrays
(tokens, positions, slots, block tables), so for every position the target has computed the
draft holds its own K/V in the same slot. Prefix caching, preemption and recomputation need no
bookkeeping of their own: a page means the same tokens in both caches.

Proposing (`propose`) is one k-step pass per target step, over the rows that will be verified:
step i feeds the row's last token (i = 0) or its previous proposal, at position n - 1 + i, and
draws the next token with the sampler and the parameters the target will use at that position,
including the random key of (seed, output step). So a draft that agrees with the target proposes
exactly the token the target then draws, and the target (jaxserve.speculative.verification) accepts it.
Positions past the row's allocated pages write into the row's scratch pages; the step's K/V there
is thrown away (the verification step's mirror writes the real one). The k steps stay on the
device: each step's sampled ids are the next step's input, and one `device_get` returns them all.
Penalties read the history as of the pass's start (the draft does not see its own proposals
there; the target does, so such proposals are only accepted less often).
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
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.core.step import Bucket, geometric_buckets, row_params, uses_penalties
from jaxserve.executor import decode_loop, executable_cache, sampler, step_functions
from jaxserve.models import cpu_layout, llama
from jaxserve.speculative import verification

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DraftShape:
    """One compiled proposal step: rows x block-table width (the target's, plus scratch pages)."""
    num_rows: int
    pages_per_seq: int


class DraftProposer:
    """A draft model mirroring the target's steps and proposing k tokens per decoding row."""

    def __init__(self, config: ModelConfig, params, target_runner, *, max_rows: int, num_speculative_tokens: int,
                 eos_token_ids: Sequence[int]) -> None:
        """`config`/`params`: the draft model (same vocabulary as the target). `target_runner`:
        the target's ModelRunner, whose page pool, buckets and backend the draft follows; the
        draft runs unsharded on the replica's first device. Up to `max_rows` rows propose per step."""
        if config.vocab_size != target_runner.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({config.vocab_size} tokens) differs from the "
                             f"target's ({target_runner.config.vocab_size}); a draft must share the tokenizer")
        self.config = config
        self.target = target_runner
        self.k = num_speculative_tokens
        self.page_size = target_runner.page_size
        self.num_target_pages = target_runner.num_pages
        self.scratch_pages_per_row = verification.draft_scratch_pages_per_row(num_speculative_tokens, self.page_size)
        self.row_buckets = geometric_buckets(1, max_rows)
        num_pages = self.num_target_pages + max_rows * self.scratch_pages_per_row
        self.max_model_len = target_runner.max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        # The first device of the target replica (data parallel replicas: each its own).
        device = min(jax.tree_util.tree_leaves(target_runner.params)[0].sharding.device_set, key=lambda d: d.id)
        self.params = jax.device_put(params, device)
        self._step_params = cpu_layout.layer_views(
            self.params, int8_activations=target_runner.cpu_int8_activations, prompt_dtype=target_runner.cpu_prompt_dtype,
            float32_attention=target_runner.backend in cpu_layout.FLOAT32_ATTENTION_BACKENDS)
        self.params = cpu_layout.stored_params_left(self.params, self._step_params)
        dtype = target_runner.kv_cache_dtype  # an int8 / fp8 target cache: the draft's is too
        self._new_kv_cache = functools.partial(llama.init_kv_cache, config, llama.KVCacheSpec(num_pages, self.page_size),
                                               dtype, jax.sharding.SingleDeviceSharding(device))
        self.kv_cache = self._new_kv_cache()
        # The target's forward and multi-step kinds (jaxserve.executor.step_functions), of the draft model.
        self._functions = step_functions.build(config, self.params, backend=target_runner.backend,
                                               page_size=self.page_size,
                                               verify_row_tokens=target_runner.buckets.verify_row_tokens)
        # "mirror" + target Bucket, "propose" + (DraftShape, penalties): filled by warmup().
        self.executables = executable_cache.ExecutableCache()

    # ---- keeping the cache in step --------------------------------------------------------
    def mirror(self, bucket: Bucket, arrays: dict[str, np.ndarray]) -> None:
        """Runs the draft over the target step's arrays (dispatched, not waited for): the draft's
        K/V of the step's tokens lands in the same slots as the target's."""
        forward = self.executables.get("mirror", bucket) or self._functions.forward_for(bucket)
        _, self.kv_cache = forward(self._step_params, self.kv_cache, arrays)

    def recover(self) -> None:
        """After a failed step: a fresh cache (the target's was rebuilt; every request recomputes)."""
        if any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(self.kv_cache)):
            self.kv_cache = self._new_kv_cache()

    # ---- proposing ------------------------------------------------------------------------
    def _shape(self, num_rows: int) -> DraftShape:
        rows = next(b for b in self.row_buckets if b >= num_rows)
        return DraftShape(rows, self.target.max_pages_per_seq + self.scratch_pages_per_row)

    def _inputs(self, requests: Sequence, shape: DraftShape, penalties: bool):
        """`decode_loop.pack_inputs` of a proposal pass: each request's last token at its position,
        its pages and then its scratch pages, sampled as the target will sample there."""
        rows = []
        for r, request in enumerate(requests):
            scratch = self.num_target_pages + r * self.scratch_pages_per_row + np.arange(self.scratch_pages_per_row)
            rows.append((request.token_id_at(request.num_tokens - 1), request.num_tokens - 1,
                         list(request.page_ids) + scratch.tolist(), row_params(request)))
        return decode_loop.pack_inputs(rows, num_rows=shape.num_rows, table_width=shape.pages_per_seq,
                                       num_steps=self.k, history_len=self.max_model_len, penalties=penalties,
                                       bias=sampler.ALWAYS_BIAS, eos_token_ids=self.eos_token_ids)

    def propose(self, requests: Sequence, k: int) -> list[list[int]]:
        """Up to `k` proposed tokens for each request (decoding: its last token not yet computed)."""
        if not requests:
            return []
        shape = self._shape(len(requests))
        penalties = any(uses_penalties(r.params) for r in requests)
        arrays, sampling = self._inputs(requests, shape, penalties)
        propose = self.executables.get("propose", (shape, penalties)) or self._functions.multi_step
        proposals, self.kv_cache = propose(self._step_params, self.kv_cache, arrays, sampling, np.int32(self.k))
        proposals = np.asarray(jax.device_get(proposals))
        return [proposals[r, :k].tolist() for r in range(len(requests))]

    # ---- compiling ------------------------------------------------------------------------
    def warmup(self, target_buckets: Sequence[Bucket]) -> int:
        """Compiles the mirror of every target bucket and the proposal pass for every row bucket
        (with and without penalties; the bias stage always runs, as the target's). Returns the number
        of shapes."""
        start = time.perf_counter()

        def compile_mirror(bucket):
            forward = self._functions.forward_for(bucket)
            self.executables.put("mirror", bucket, forward.lower(self._step_params, self.kv_cache,
                                                                 self.target.empty_batch(bucket)).compile())

        def compile_propose(rows, penalties):
            shape = self._shape(rows)
            arrays, sampling = self._inputs([], shape, penalties)
            self.executables.put("propose", (shape, penalties), self._functions.multi_step.lower(
                self._step_params, self.kv_cache, arrays, sampling, np.int32(self.k)).compile())

        variants = [(rows, p) for rows in self.row_buckets for p in (False, True)]
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            jobs = [pool.submit(compile_mirror, b) for b in target_buckets]
            jobs += [pool.submit(compile_propose, *v) for v in variants]
            for job in jobs:
                job.result()
        log.info("draft warm-up compiled %d mirror and %d proposal shapes in %.1fs", len(target_buckets),
                 len(variants), time.perf_counter() - start)
        return len(target_buckets) + len(variants)

"""The pooling math over one step's prefill chunks (jax; jittable, every shape static).

A step's prefill tokens are one flat [T, D] block of residual-stream rows (what
`jaxserve.models.llama.forward` returns with `prefill_hidden_rows`: before the final norm), chunk s
holding rows `query_start_loc[s] .. query_start_loc[s + 1] - 1`. A prompt may be prefilled in
several chunks over several steps, so the device pools each chunk on its own and the host combines
a prompt's chunks (`jaxserve.pooling.accumulate`):
- `final_hidden`: the final norm of every row, in float32: the hidden state transformers'
  `last_hidden_state` and sentence-transformers pool;
- `chunk_partials`: per chunk, its last row (LAST), its first row (CLS: the prompt's first chunk's
  is the one kept) or the sum of its rows (MEAN: the host adds the chunks' sums and divides by the
  prompt's length);
- `classify`: a `*ForSequenceClassification` score head on rows (each chunk's last row: the prompt's
  final chunk's is the one kept) and its activation.
A chunk with no tokens (a padding chunk of the step's bucket) pools to zeros. `pooled_step` is
the pooling runner's whole step: the forward, then the chunks pooled (jaxserve.executor.runner).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models.llama import rms_norm


def final_hidden(params: dict, x: jax.Array, config: ModelConfig) -> jax.Array:
    """Residual-stream rows x [T, D] -> final-normed hidden states [T, D] float32."""
    normed = rms_norm(x, params["final_norm"], config.rms_norm_eps, config.norm_weight_offset)
    return normed.astype(jnp.float32)


def chunk_partials(hidden: jax.Array, query_start_loc: jax.Array, pooling_type: str) -> jax.Array:
    """hidden [T, D] (rows past query_start_loc[-1] are padding), query_start_loc [S + 1] int32
    -> [S, D] float32: each chunk's last row (LAST), first row (CLS) or row sum (MEAN)."""
    hidden = hidden.astype(jnp.float32)
    starts, ends = query_start_loc[:-1], query_start_loc[1:]  # [S] each
    nonempty = (ends > starts)[:, None]  # [S, 1]
    if pooling_type == "LAST":
        return jnp.where(nonempty, hidden[jnp.maximum(ends - 1, 0)], 0.0)
    if pooling_type == "CLS":
        return jnp.where(nonempty, hidden[jnp.minimum(starts, hidden.shape[0] - 1)], 0.0)
    if pooling_type == "MEAN":
        rows = jnp.arange(hidden.shape[0], dtype=query_start_loc.dtype)  # [T]
        chunk = jnp.searchsorted(ends, rows, side="right")  # [T]: the chunk of each row; S past the last
        return jax.ops.segment_sum(hidden, chunk, num_segments=starts.shape[0])  # rows of chunk S dropped
    raise ValueError(f"unknown pooling type {pooling_type!r}")


def apply_activation(logits: jax.Array, activation: str) -> jax.Array:
    """logits [..., L] -> sigmoid, softmax over labels, or unchanged ("identity")."""
    if activation == "sigmoid":
        return jax.nn.sigmoid(logits)
    if activation == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    if activation == "identity":
        return logits
    raise ValueError(f"unknown activation {activation!r}")


def classify(last_hidden: jax.Array, score_weight: jax.Array, activation: str) -> jax.Array:
    """Final-normed last-token rows [S, D], the score head [L, D] -> activated scores [S, L] float32."""
    logits = jnp.einsum("sd,ld->sl", last_hidden.astype(jnp.float32), score_weight.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    return apply_activation(logits, activation)


def pooled_step(params: dict, kv_cache: dict, batch: dict, score_head: jax.Array | None, *, forward: Callable,
                config: ModelConfig, pooling_type: str, activation: str) -> tuple[jax.Array, dict]:
    """The pooling runner's step: `forward` (llama.forward, its static arguments bound) over a
    batch of prefill chunks only, computing no logits (batch["logits_indices"] is empty), then each
    chunk pooled: [S, D] float32 partials, or with a `score_head` [L, D] each chunk's last row
    scored and activated, [S, L]. Returns (pooled, kv_cache)."""
    num_prefill = batch["token_ids"].shape[0] - batch["decode_seq_lens"].shape[0]  # static: the bucket's
    _, kv_cache, rows = forward(params, kv_cache, batch, prefill_hidden_rows=num_prefill)  # rows [T, D]
    query_start_loc = batch["prefill_query_start_loc"]
    if score_head is not None:  # a classifier reads the last row of each chunk
        last = final_hidden(params, chunk_partials(rows, query_start_loc, "LAST"), config)  # [S, D]
        return classify(last, score_head, activation), kv_cache
    if pooling_type == "MEAN":  # the norm of every row, then the sums
        return chunk_partials(final_hidden(params, rows, config), query_start_loc, "MEAN"), kv_cache
    # LAST, CLS: one row per chunk, normed (a padding chunk's zeros stay zeros)
    return final_hidden(params, chunk_partials(rows, query_start_loc, pooling_type), config), kv_cache

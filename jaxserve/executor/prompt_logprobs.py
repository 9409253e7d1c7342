"""Prompt logprobs on device: the logprob, rank and top-k alternatives of prompt tokens.

The step's forward returns the residual-stream rows of its prefill tokens (`llama.forward`'s
`prefill_hidden_rows`); `compute` takes the rows of the prompt positions whose logprobs are wanted
(at most the runner's `prompt_logprob_rows` per step, padded to a bucket), turns them into logits
with the model's own head (`llama.final_logits`: final norm, lm_head, soft cap) and returns only
what the host needs: per row the logprob and rank of the next prompt token and the top-k. The
[rows, vocab] logits never leave the device.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.executor import sampler
from jaxserve.models import llama

_TOP_BLOCK = 64


def head_params(params: dict) -> dict:
    """The weights `compute` reads: the final norm and the output head (the embedding when tied)."""
    names = ("final_norm", "lm_head") if "lm_head" in params else ("final_norm", "embed")
    return {name: params[name] for name in names}


def compute(head: dict, hidden: jax.Array, indices: jax.Array, targets: jax.Array, *, config,
            max_logprobs: int) -> dict[str, jax.Array]:
    """hidden [H, D] (a step's prefill rows), indices [P] into it, targets [P] (the token each
    row predicts) -> logprobs f32[P] and ranks i32[P] (1 = the most likely) of the targets,
    top_ids i32[P, max_logprobs] and top_logprobs f32[P, max_logprobs] (best first). Raw
    log_softmax of the model's logits, as the sampler's logprobs."""
    logits = llama.final_logits(head, hidden[indices], config)  # [P, V] float32
    log_normalizer = jax.nn.logsumexp(logits, -1)  # [P]
    target_logits = jnp.take_along_axis(logits, targets[:, None], 1)  # [P, 1]
    ranks = 1 + jnp.sum(logits > target_logits, -1, dtype=jnp.int32)
    num_rows = logits.shape[0]
    if max_logprobs:
        top_values, top_ids = sampler._top_k(logits, max_logprobs, _TOP_BLOCK)
    else:
        top_values, top_ids = jnp.zeros((num_rows, 0), jnp.float32), jnp.zeros((num_rows, 0), jnp.int32)
    return {"logprobs": target_logits[:, 0] - log_normalizer, "ranks": ranks, "top_ids": top_ids,
            "top_logprobs": top_values - log_normalizer[:, None]}

"""Several decode steps in one device call: each step's sampled tokens are the next step's input.

Used where the host has nothing to decide between the steps: the engine's multi-step decoding
(`EngineConfig.num_scheduler_steps`: one host round trip per n tokens of every row) and the draft
model's proposal pass (jaxserve.speculative.draft_proposer). The loop is a `lax.fori_loop` over a dynamic
number of steps, so one compiled shape serves every count up to the sampling inputs' length.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.executor import sampler


def pack_inputs(rows: Sequence[tuple], *, num_rows: int, table_width: int, num_steps: int, history_len: int,
                penalties: bool, bias: bool, eos_token_ids=()) -> tuple[dict, dict]:
    """Host arrays of `decode_steps` for `rows`, each (last token id, its position, the row's
    block-table pages, its RowParams for the first step), padded to `num_rows` x `table_width`.
    Step i samples output step + i; no step asks for logprobs. Raises sampler.RowInputError
    naming a row whose parameters do not fit (the caller knows its request)."""
    arrays = dict(token_ids=np.zeros(num_rows, np.int32), positions=np.zeros(num_rows, np.int32),
                  block_table=np.zeros((num_rows, table_width), np.int32), seq_lens=np.zeros(num_rows, np.int32))
    for i, (token_id, position, page_ids, _) in enumerate(rows):
        arrays["token_ids"][i] = token_id
        arrays["positions"][i] = position
        arrays["block_table"][i, :len(page_ids)] = page_ids
        arrays["seq_lens"][i] = position + 1
    steps = []
    for step in range(num_steps):
        step_rows = [dataclasses.replace(params, step=params.step + step) for *_, params in rows]
        steps.append(sampler.build_sampling_inputs(step_rows, num_rows, history_len, penalties, bias, eos_token_ids))
        steps[-1]["num_logprobs"][:] = -1
    sampling = {name: np.stack([s[name] for s in steps]) for name in steps[0]}  # [num_steps, num_rows, ...]
    return arrays, sampling


def decode_steps(step_logits: Callable, kv_cache, arrays: dict, sampling: dict, num_steps, *, page_size: int):
    """Runs `num_steps` decode steps (at most `sampling`'s leading axis) on device.

    step_logits(kv_cache, batch) -> (logits float32[rows, vocab], kv_cache): one forward over a
      decode-only batch (the keys of `llama.forward`'s batch).
    arrays: token_ids int32[rows] (each row's last token, not yet in the cache), positions
      int32[rows] (its position), block_table int32[rows, pages] (holding every position the steps
      write), seq_lens int32[rows] (positions + 1; 0: a padding row, which writes to the null page).
    sampling: the sampler inputs of each step (`sampler.build_sampling_inputs`; token histories,
      if any, stay as given: the steps' own draws are not added), stacked on a leading
      [max_steps] axis.
    Returns (tokens int32[rows, max_steps]: step i's draws in column i, zeros past num_steps;
    kv_cache with the K/V of the input tokens of every step)."""
    rows, max_steps = arrays["token_ids"].shape[0], jax.tree_util.tree_leaves(sampling)[0].shape[0]
    table = arrays["block_table"]
    active = arrays["seq_lens"] > 0

    def step(i, carry):
        tokens, kv_cache, drawn = carry
        positions = arrays["positions"] + i
        pages = jnp.take_along_axis(table, (positions // page_size)[:, None], 1)[:, 0]  # [rows]
        batch = dict(token_ids=tokens, positions=positions,
                     slot_mapping=jnp.where(active, pages * page_size + positions % page_size, 0),
                     decode_block_table=table, decode_seq_lens=jnp.where(active, arrays["seq_lens"] + i, 0),
                     prefill_block_table=jnp.zeros((0, table.shape[1]), jnp.int32),
                     prefill_seq_lens=jnp.zeros((0,), jnp.int32), prefill_query_start_loc=jnp.zeros((1,), jnp.int32),
                     logits_indices=jnp.arange(rows, dtype=jnp.int32))
        logits, kv_cache = step_logits(kv_cache, batch)
        tokens = sampler.sample(logits, jax.tree.map(lambda a: a[i], sampling), max_logprobs=0)["token_ids"]
        return tokens, kv_cache, jax.lax.dynamic_update_index_in_dim(drawn, tokens, i, axis=1)

    drawn = jnp.zeros((rows, max_steps), jnp.int32)
    _, kv_cache, drawn = jax.lax.fori_loop(0, num_steps, step, (arrays["token_ids"], kv_cache, drawn))
    return drawn, kv_cache

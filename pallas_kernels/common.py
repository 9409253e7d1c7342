"""What the production attention paths share: the attention options (softmax scale, logit
soft-cap, sliding window) and the per-sequence query layout of the XLA path.

Layout: k_pages, v_pages: [num_pages, page_size, num_kv_heads, head_dim] (or quantized caches,
see kv_quant); page 0 is the null page. block_table: int32[num_seqs, max_pages_per_seq];
seq_lens: int32[num_seqs] (0 = padding row).

Attention options, the same on every entry point (dispatch, Pallas kernels, XLA path, reference):
  scale (static float | None): scores = scale * q.k; None means head_dim ** -0.5 (Gemma 2 passes
    query_pre_attn_scalar ** -0.5).
  logit_soft_cap (static float | None): scores = cap * tanh(scores / cap), after the scale and
    before masking and softmax (Gemma 2's attn_logit_softcapping); None means no cap.
  sliding_window (dynamic int32 scalar | None): a query at position p attends the keys at
    positions k with p - window < k <= p, i.e. at most `window` keys, itself included. This is
    transformers' sliding-window causal mask (masking_utils.sliding_window_overlay,
    `kv_idx > q_idx - sliding_window`, and'ed with the causal mask) with `window` =
    config.sliding_window of Mistral and Gemma 2. The window is an operand, not a static, so the
    layers of one `lax.scan` may differ (Gemma alternates local and global layers): a value <= 0
    (NO_WINDOW) means no window at run time; None means no window and traces no window code.
"""

import jax.numpy as jnp

from pallas_kernels import kv_quant

NO_WINDOW = 0  # any sliding_window <= 0: full causal attention
_UNLIMITED = jnp.iinfo(jnp.int32).max  # a window no sequence reaches


def check_heads(q, k_pages):
    """ValueError unless q's heads divide evenly over the pages' KV heads with the same head_dim."""
    k_pages = kv_quant.values(k_pages)
    num_q_heads, num_kv_heads = q.shape[-2], k_pages.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if q.shape[-1] != k_pages.shape[-1]:
        raise ValueError(f"head_dim of q ({q.shape[-1]}) != head_dim of pages ({k_pages.shape[-1]})")


def softmax_scale(scale, head_dim: int) -> float:
    """The static softmax scale: `scale`, else head_dim ** -0.5."""
    return head_dim**-0.5 if scale is None else float(scale)


def soft_cap(scores, cap):
    """cap * tanh(scores / cap), or scores unchanged when cap is None."""
    return scores if cap is None else cap * jnp.tanh(scores / cap)


def window_size(sliding_window):
    """int32 scalar window with NO_WINDOW (any value <= 0) replaced by one no sequence reaches,
    so that the masks below need no special case."""
    window = jnp.asarray(sliding_window, jnp.int32).reshape(())
    return jnp.where(window > 0, window, _UNLIMITED)


def in_window(query_pos, key_pos, window):
    """Causal sliding-window visibility: key_pos <= query_pos < key_pos + window (broadcasts).
    window: from window_size. Written as a difference so that no sum overflows int32."""
    return (key_pos <= query_pos) & (query_pos - key_pos < window)


def first_visible_key(query_pos, window):
    """Smallest key position a query at query_pos (>= 0) sees: max(0, query_pos - window + 1)."""
    return jnp.maximum(query_pos - window + 1, 0)


def queries_per_sequence(q, seq_lens, query_start_loc, num_seqs, num_kv_heads):
    """Ragged queries [num_tokens, heads, d] laid out per sequence.

    Returns q_padded [s, num_tokens, kv, group, d] float32 (zeros where invalid), the position of
    each query in its sequence query_pos [s, num_tokens] and query_valid [s, num_tokens]."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    starts = query_start_loc[:num_seqs]  # [s]
    query_lens = query_start_loc[1 : num_seqs + 1] - starts  # [s]
    slot = jnp.arange(num_tokens)  # index of a query inside its sequence
    token_index = jnp.clip(starts[:, None] + slot[None, :], 0, num_tokens - 1)  # [s, q]
    query_valid = (slot[None, :] < query_lens[:, None]) & (seq_lens[:, None] > 0)  # [s, q]
    q_padded = q[token_index].astype(jnp.float32)  # [s, q, heads, d]
    q_padded = q_padded.reshape(num_seqs, num_tokens, num_kv_heads, group, head_dim)
    q_padded = jnp.where(query_valid[:, :, None, None, None], q_padded, 0.0)
    query_pos = (seq_lens - query_lens)[:, None] + slot[None, :]  # [s, q]
    return q_padded, query_pos, query_valid


def to_ragged(out, query_start_loc):
    """Per-sequence results [s, num_tokens, heads, d] back to the ragged layout [num_tokens, heads, d]:
    token t reads row (its sequence, t - start of that sequence); tokens past the last sequence are 0."""
    num_seqs, num_tokens = out.shape[:2]
    starts = query_start_loc[:num_seqs]
    tokens = jnp.arange(num_tokens)
    seq_of_token = jnp.searchsorted(query_start_loc[1 : num_seqs + 1], tokens, side="right")
    token_valid = tokens < query_start_loc[num_seqs]
    seq_of_token = jnp.clip(seq_of_token, 0, num_seqs - 1)
    slot_of_token = jnp.clip(tokens - starts[seq_of_token], 0, num_tokens - 1)
    return jnp.where(token_valid[:, None, None], out[seq_of_token, slot_of_token], 0.0)


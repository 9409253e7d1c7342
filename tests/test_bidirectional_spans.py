"""Bidirectional attention among an image's tokens inside causal prefill attention (Gemma 3's
vision-language model): ragged attention's `key_limit` operand, each query token's highest
visible key position (a token of an image span [s, e) gets e - 1, any other its own position).

The reference (pallas_kernels.reference) against a dense-mask float64 numpy formulation, then
every backend against the reference on the same seeded random problems: several sequences, each
a chunk after a cached prefix (or a whole prompt, or one decode-like token), image spans at a
chunk's start, middle and end, spans crossing page boundaries, a span that is the whole chunk,
spans of one token, a sliding window, GQA; NaN in every page slot no sequence owns and in the
padding tokens (whose key limits are garbage). key_limit equal to the positions gives the causal
result bit for bit, and without key_limit the default path's program has no trace of it.
The Mosaic GPU kernel's checks live in tests/test_mosaic_kernels.py (its interpreter needs the
rehearsal environment's jax); they reuse `span_problem` and `reference_out` from here.
"""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
from pallas_kernels import dispatch, ragged_prefill, reference, xla_paged

pytestmark = pytest.mark.slow  # the Pallas kernel in interpret mode and the C++ kernel: out of `make test-quick`

SEED = int(os.environ.get("JAXSERVE_TEST_SEED", "20260117"))
INTERPRET = jax.default_backend() != "gpu"
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 1e-2}


@dataclasses.dataclass(frozen=True)
class SpanCase:
    page_size: int
    head_dim: int
    group: int  # query heads per KV head
    num_kv_heads: int
    dtype: type = jnp.float32


CASES = [
    SpanCase(8, 64, 1, 2),
    SpanCase(16, 64, 3, 2),  # GQA with a group that is not a power of two
    SpanCase(16, 128, 4, 1, jnp.bfloat16),
    SpanCase(8, 32, 2, 2),
]


def case_id(case):
    return f"ps{case.page_size}-d{case.head_dim}-g{case.group}-kv{case.num_kv_heads}-{jnp.dtype(case.dtype).name}"


def _spans(rng, cached, query_len, page_size):
    """Image spans [s, e) in positions, all inside the chunk [cached, cached + query_len), not
    overlapping: one at the chunk's start, one in its middle crossing a page boundary when it can,
    one at its end (each only when there is room), in random sizes; sometimes the whole chunk."""
    first, end = cached, cached + query_len
    if query_len >= 2 and rng.random() < 0.15:
        return [(first, end)]
    spans = []
    if query_len >= 3:
        spans.append((first, first + int(rng.integers(1, max(2, query_len // 4) + 1))))  # at the chunk's start
        tail = int(rng.integers(1, max(2, query_len // 4) + 1))
        spans.append((end - tail, end))  # at the chunk's end
        lo, hi = spans[0][1] + 1, spans[1][0] - 1  # the middle one leaves a causal token either side
        if hi - lo >= 2:
            boundary = (lo // page_size + 1) * page_size  # the first page boundary after lo
            if lo < boundary < hi:  # across it
                s = int(rng.integers(lo, boundary))
                e = int(rng.integers(boundary + 1, hi + 1))
            else:
                s = int(rng.integers(lo, hi))
                e = int(rng.integers(s + 1, hi + 1))
            spans.insert(1, (s, e))
    return spans


def span_problem(case, rng, window=None):
    """A random ragged batch with image spans. Returns (args, key_limit, positions, details):
    args (q, k_pages, v_pages, block_table, seq_lens, query_start_loc) as jnp arrays, key_limit
    and each token's position int32[num_tokens] (padding tokens: garbage limits), and the numpy
    arrays the dense oracle reads."""
    ps = case.page_size
    # (cached tokens, query tokens): a long chunk after a cached prefix starting mid-page, a whole
    # prompt, a padding row, a one-token step, a chunk starting on a page boundary, a short prompt.
    layout = [(int(rng.integers(1, 3 * ps)), int(rng.integers(3 * ps, 5 * ps))),
              (0, int(rng.integers(2 * ps, 4 * ps))), (0, 0), (int(rng.integers(ps, 4 * ps)), 1),
              (2 * ps, int(rng.integers(ps, 3 * ps))), (0, int(rng.integers(3, ps)))]
    layout = [layout[i] for i in rng.permutation(len(layout))]
    seq_lens = np.array([c + n if n else 0 for c, n in layout], np.int32)
    query_lens = np.array([n for _, n in layout], np.int32)
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    num_tokens = int(query_start_loc[-1]) + int(rng.integers(1, 6))
    num_heads, d, kv = case.group * case.num_kv_heads, case.head_dim, case.num_kv_heads

    pages_needed = [-(-int(n) // ps) for n in seq_lens]
    max_pages = max(pages_needed) + 1
    num_pages = sum(pages_needed) + 3
    k_pages = np.full((num_pages, ps, kv, d), np.nan, np.float32)
    v_pages = np.full_like(k_pages, np.nan)
    free = 1 + rng.permutation(num_pages - 1)  # page 0: the null page
    block_table = np.zeros((len(seq_lens), max_pages), np.int32)
    for row, (length, count) in enumerate(zip(seq_lens, pages_needed)):
        block_table[row, :count], free = free[:count], free[count:]
        for pos in range(int(length)):
            page, offset = block_table[row, pos // ps], pos % ps
            k_pages[page, offset] = rng.standard_normal((kv, d))
            v_pages[page, offset] = rng.standard_normal((kv, d))

    q = np.full((num_tokens, num_heads, d), np.nan, np.float32)
    q[: query_start_loc[-1]] = rng.standard_normal((query_start_loc[-1], num_heads, d))
    positions = np.zeros(num_tokens, np.int32)
    key_limit = rng.integers(-5, 10_000, num_tokens).astype(np.int32)  # padding tokens: garbage
    spans = []
    for row, ((cached, query_len), start) in enumerate(zip(layout, query_start_loc)):
        positions[start:start + query_len] = cached + np.arange(query_len)
        key_limit[start:start + query_len] = positions[start:start + query_len]
        for s, e in _spans(rng, cached, query_len, ps) if query_len else []:
            key_limit[start + s - cached:start + e - cached] = e - 1
            spans.append((row, s, e))
    dtype = jnp.dtype(case.dtype)
    args = (jnp.asarray(q.astype(dtype)), jnp.asarray(k_pages.astype(dtype)), jnp.asarray(v_pages.astype(dtype)),
            jnp.asarray(block_table), jnp.asarray(seq_lens), jnp.asarray(query_start_loc))
    details = dict(seq_lens=seq_lens, query_lens=query_lens, query_start_loc=query_start_loc, spans=spans)
    return args, jnp.asarray(key_limit), jnp.asarray(positions), details


def dense_oracle(args, spans=None, window=None, scale=None, cap=None, key_limit=None):
    """float64 attention from a dense [query, key] mask per sequence, transformers' way: causal
    (k <= p) or'ed with the image mask (query and key in the same image span, `spans` of
    (row, s, e) in positions), and'ed with the window (p - k < window); or, given `key_limit`
    instead of spans, k <= max(p, key_limit) below the sequence's length."""
    q, k_pages, v_pages, block_table, seq_lens, query_start_loc = (np.asarray(a, np.float64) if i < 3 else
                                                                   np.asarray(a) for i, a in enumerate(args))
    num_kv, d = k_pages.shape[2], k_pages.shape[3]
    scale = d**-0.5 if scale is None else scale
    group = q.shape[1] // num_kv
    out = np.zeros_like(q)
    for row, length in enumerate(seq_lens):
        first, last = int(query_start_loc[row]), int(query_start_loc[row + 1])
        if length == 0 or last == first:
            continue
        keys = k_pages[block_table[row]].reshape(-1, num_kv, d)[:length]
        values = v_pages[block_table[row]].reshape(-1, num_kv, d)[:length]
        query_pos = length - (last - first) + np.arange(last - first)  # [n]
        key_pos = np.arange(length)
        if spans is not None:
            same_image = np.zeros((last - first, length), bool)
            for span_row, s, e in spans:
                if span_row == row:
                    inside_q, inside_k = (query_pos >= s) & (query_pos < e), (key_pos >= s) & (key_pos < e)
                    same_image |= inside_q[:, None] & inside_k[None, :]
        else:
            same_image = key_pos[None, :] <= np.maximum(key_limit[first:last], query_pos)[:, None]
        mask = (key_pos[None, :] <= query_pos[:, None]) | same_image
        if window is not None and window > 0:
            mask &= query_pos[:, None] - key_pos[None, :] < window
        for i in range(last - first):
            for head in range(q.shape[1]):
                scores = keys[mask[i], head // group] @ q[first + i, head] * scale
                if cap is not None:
                    scores = cap * np.tanh(scores / cap)
                weights = np.exp(scores - scores.max())
                out[first + i, head] = weights @ values[mask[i], head // group] / weights.sum()
    return out


def close(actual, expected, dtype, label):
    actual = np.asarray(actual, np.float64)
    assert np.isfinite(actual).all(), f"{label}: non-finite output (seed {SEED})"
    error = np.abs(actual - np.asarray(expected, np.float64)).max() / np.abs(expected).max()
    assert error < TOLERANCE[dtype], f"{label}: relative error {error:.2e} (seed {SEED})"


def options_of(window, scale=None, cap=None):
    """The options as the implementations take them: the window an int32 scalar operand."""
    return dict(sliding_window=None if window is None else jnp.int32(window), scale=scale, logit_soft_cap=cap)


def reference_out(args, key_limit, window=None, **static):
    return np.asarray(jax.jit(lambda *a, key_limit: reference.ragged_paged_attention(
        *a, key_limit=key_limit, **options_of(window, **static)))(*args, key_limit=key_limit), np.float64)


def backends():
    """name -> function(*args, key_limit=..., **options) of every implementation tested here."""
    found = {
        "xla": functools.partial(xla_paged.ragged_paged_attention, pages_per_block=2, query_chunk=16),
        "xla-defaults": xla_paged.ragged_paged_attention,
        "interpret": functools.partial(ragged_prefill.ragged_paged_attention, interpret=INTERPRET),
        "interpret-small-tiles": functools.partial(ragged_prefill.ragged_paged_attention, interpret=INTERPRET,
                                                   block_q=4, pages_per_block=1),
    }
    if cpu_kernels.available():
        found["cpu-kernel"] = functools.partial(dispatch.ragged_attention, "xla")
    return found


WINDOWS = [None, 0, 5, 37]  # none traced, the no-window operand, shorter than an image, longer


@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"window{w}")
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_reference_matches_the_dense_mask(case, window):
    rng = np.random.default_rng([SEED, CASES.index(case), WINDOWS.index(window)])
    args, key_limit, _, details = span_problem(case, rng, window)
    assert details["spans"], "the problem has image spans"
    got = reference_out(args, key_limit, window)
    want = dense_oracle(args, details["spans"], window)
    close(got, want, case.dtype, f"reference {case_id(case)} window {window}")
    assert not got[int(details["query_start_loc"][-1]):].any(), f"padding tokens not zero (seed {SEED})"
    causal = reference_out(args, None, window)
    assert not np.allclose(got[:int(details["query_start_loc"][-1])], causal[:int(details["query_start_loc"][-1])])


@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"window{w}")
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_backends_match_the_reference(case, window):
    rng = np.random.default_rng([SEED, CASES.index(case), WINDOWS.index(window), 1])
    args, key_limit, _, details = span_problem(case, rng, window)
    want = reference_out(args, key_limit, window)
    takes_cpu = cpu_kernels.takes_prefill_attention(*args[:3])
    for name, function in backends().items():
        if name == "cpu-kernel" and not takes_cpu:
            continue
        out = jax.jit(lambda *a, key_limit: function(*a, key_limit=key_limit, **options_of(window)))(
            *args, key_limit=key_limit)
        assert out.shape == args[0].shape and out.dtype == args[0].dtype, name
        close(out, want, case.dtype, f"{name} {case_id(case)} window {window}")
        tail = np.asarray(out, np.float32)[int(details["query_start_loc"][-1]):]
        assert not tail.any(), f"{name}: padding tokens not zero (seed {SEED})"


@pytest.mark.parametrize("case", CASES[1:2], ids=case_id)
def test_soft_cap_and_scale_with_spans(case):
    rng = np.random.default_rng([SEED, 50])
    args, key_limit, _, details = span_problem(case, rng, 9)
    static = dict(scale=0.2, cap=4.0)
    want = reference_out(args, key_limit, 9, **static)
    close(want, dense_oracle(args, details["spans"], 9, **static), case.dtype, "reference soft cap")
    for name, function in backends().items():
        out = jax.jit(lambda *a, key_limit: function(*a, key_limit=key_limit, **options_of(9, **static)))(
            *args, key_limit=key_limit)
        close(out, want, case.dtype, f"{name} soft cap")


@pytest.mark.parametrize("window", [None, 6], ids=lambda w: f"window{w}")
def test_key_limit_at_the_positions_is_causal_bit_for_bit(window):
    """Each backend with key_limit = the tokens' positions gives exactly its causal result."""
    case = CASES[1]
    rng = np.random.default_rng([SEED, 60, window or 0])
    args, _, positions, _ = span_problem(case, rng, window)
    for name, function in {**backends(), "reference": reference.ragged_paged_attention}.items():
        causal = jax.jit(lambda *a: function(*a, **options_of(window)))(*args)
        limited = jax.jit(lambda *a, key_limit: function(*a, key_limit=key_limit, **options_of(window)))(
            *args, key_limit=positions)
        assert np.array_equal(np.asarray(causal), np.asarray(limited)), f"{name} (seed {SEED})"


def test_a_key_limit_below_the_position_still_sees_the_causal_keys():
    """key_limit is a lower bound of nothing: a limit below a query's position (or past its
    sequence) leaves it causal (or capped at the sequence's last key)."""
    case = CASES[1]  # chunks of up to 80 queries: several query blocks of every backend
    args, _, positions, details = span_problem(case, np.random.default_rng([SEED, 70]))
    low, high = positions - 3, positions + 10_000
    want = reference_out(args, None)
    valid = int(details["query_start_loc"][-1])
    for name, function in backends().items():
        out = jax.jit(lambda *a, key_limit: function(*a, key_limit=key_limit))(*args, key_limit=low)
        np.testing.assert_allclose(np.asarray(out)[:valid], want[:valid], atol=2e-5, err_msg=f"{name} low")
    everything = reference_out(args, high)  # every key of the sequence
    close(everything, dense_oracle(args, key_limit=np.asarray(high)), case.dtype, "reference, limits past the sequence")
    for name, function in backends().items():
        out = jax.jit(lambda *a, key_limit: function(*a, key_limit=key_limit))(*args, key_limit=high)
        close(out, everything, case.dtype, f"{name}, limits past the sequence")


@pytest.mark.parametrize("backend", ["xla", "reference", "interpret"])
def test_without_key_limit_the_program_is_the_causal_one(backend):
    """key_limit=None adds nothing to the lowered program: the same text as a call without the
    argument, and no key-limit operand or target in it (the C++ kernel's causal handler)."""
    case = CASES[1]
    args, key_limit, _, _ = span_problem(case, np.random.default_rng([SEED, 80]))
    plain = jax.jit(lambda *a: dispatch.ragged_attention(backend, *a)).lower(*args).as_text()
    with_none = jax.jit(lambda *a: dispatch.ragged_attention(backend, *a, key_limit=None)).lower(*args).as_text()
    limited = jax.jit(lambda *a, key_limit: dispatch.ragged_attention(backend, *a, key_limit=key_limit)).lower(
        *args, key_limit=key_limit).as_text()
    assert plain == with_none
    assert plain != limited
    if backend == "xla" and cpu_kernels.takes_prefill_attention(*args[:3]):
        assert "jaxserve_ragged_prefill_attention_key_limit" in limited
        assert "jaxserve_ragged_prefill_attention" in plain and "key_limit" not in plain


def test_dispatch_passes_key_limit_to_every_backend():
    """dispatch.ragged_attention(..., key_limit=...) gives the reference's answer through the
    backends that run here."""
    case = CASES[0]
    args, key_limit, _, _ = span_problem(case, np.random.default_rng([SEED, 90]), 11)
    want = reference_out(args, key_limit, 11)
    for backend in ("reference", "xla", "interpret"):
        out = jax.jit(lambda *a, key_limit: dispatch.ragged_attention(
            backend, *a, key_limit=key_limit, max_query_len=64, **options_of(11)))(*args, key_limit=key_limit)
        close(out, want, case.dtype, f"dispatch {backend}")

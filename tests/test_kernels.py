"""Paged attention kernels (interpret mode), the XLA CPU path and the references against a
float64 numpy oracle: a dense softmax over a mask built from the query and key positions.

Inputs are random draws from generators seeded with SEED and the test's own numbers (the seed is
in every failure message): permuted block tables, lengths around page boundaries, padding rows in
random places, and NaN in every page slot no sequence owns (page 0, unused pages, tails of partly
filled pages) and in padding queries; with a sliding window also in every slot before the window
of a sequence's first query, and pages wholly before it replaced by the null page. Outputs must be
finite, padding must be exactly zero, and the error small.
"""

import ast
import dataclasses
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import (
    common, dispatch, kv_quant, mosaic_decode, mosaic_ragged, paged_decode, ragged_prefill, reference, xla_paged,
)

pytestmark = pytest.mark.slow  # the Pallas kernels in interpret mode: out of `make test-quick`

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
# Interpret mode on CPU; on a GPU the kernels run natively (bench/gpu_check.sh).
INTERPRET = jax.default_backend() != "gpu"
SEED = 20250611  # every generator here is seeded from it (and the test's own numbers)


@dataclasses.dataclass(frozen=True)
class Case:
    page_size: int
    head_dim: int
    group: int  # query heads per KV head
    num_kv_heads: int
    dtype: type
    tiles: dict  # kernel block sizes; {} means the production defaults


# Every page size, head_dim, GQA ratio and dtype shows up; small tiles force several key
# blocks, query blocks and context splits at test sizes.
CASES = [
    Case(8, 64, 1, 2, jnp.float32, {"pages_per_block": 2}),
    Case(16, 128, 4, 1, jnp.bfloat16, {}),
    Case(32, 64, 3, 2, jnp.float32, {}),
    Case(16, 64, 3, 1, jnp.bfloat16, {"pages_per_block": 1}),
    Case(8, 128, 4, 2, jnp.float32, {}),
    Case(32, 128, 1, 1, jnp.bfloat16, {"pages_per_block": 1}),
]


def case_id(case):
    dtype = jnp.dtype(case.dtype).name
    return f"ps{case.page_size}-d{case.head_dim}-g{case.group}-kv{case.num_kv_heads}-{dtype}"


def context_lengths(page_size, rng):
    """1, page_size-1, page_size, page_size+1, a long one, and a padding row, shuffled."""
    long = int(rng.integers(6 * page_size, 9 * page_size))
    lengths = np.array([1, page_size - 1, page_size, page_size + 1, long, 0], np.int32)
    return lengths[rng.permutation(len(lengths))]


def paged_inputs(case, seq_lens, rng):
    """Random pages holding each sequence's context, NaN everywhere else, and a block table."""
    page_size, num_kv, head_dim = case.page_size, case.num_kv_heads, case.head_dim
    pages_needed = [-(-int(n) // page_size) for n in seq_lens]
    max_pages = max(pages_needed) + 1
    num_pages = sum(pages_needed) + 4
    shape = (num_pages, page_size, num_kv, head_dim)
    k_pages = np.full(shape, np.nan, np.float32)
    v_pages = np.full(shape, np.nan, np.float32)
    free = 1 + rng.permutation(num_pages - 1)  # page 0 is the null page
    block_table = np.zeros((len(seq_lens), max_pages), np.int32)
    for row, (length, count) in enumerate(zip(seq_lens, pages_needed)):
        block_table[row, :count], free = free[:count], free[count:]
        for position in range(int(length)):
            page, offset = block_table[row, position // page_size], position % page_size
            k_pages[page, offset] = rng.standard_normal((num_kv, head_dim))
            v_pages[page, offset] = rng.standard_normal((num_kv, head_dim))
    return in_dtype(k_pages, case.dtype), in_dtype(v_pages, case.dtype), block_table


def in_dtype(array, dtype):
    """numpy array rounded to `dtype` (no XLA compile involved)."""
    return np.asarray(array).astype(jnp.dtype(dtype))


def visible_keys(query_pos, key_pos, window=None):
    """The mask of transformers' sliding-window causal attention: k <= p and k > p - window
    (window None or <= 0: causal only). Broadcasts over numpy arrays."""
    visible = key_pos <= query_pos
    if window is not None and window > 0:
        visible = visible & (key_pos > query_pos - window)
    return visible


def oracle(q, k_pages, v_pages, block_table, seq_lens, query_lens, *, window=None, scale=None, cap=None):
    """float64 attention; q: [num_seqs, max_query_len, q_heads, d] -> same shape.
    Query i of sequence `row` sits at position seq_len - query_len + i; it soft-maxes
    cap * tanh(scale * q.k / cap) (or scale * q.k) over the keys visible_keys allows."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    num_kv, head_dim = k_pages.shape[2], k_pages.shape[3]
    scale = head_dim**-0.5 if scale is None else scale
    group = q.shape[2] // num_kv
    out = np.zeros_like(q)
    for row, (length, query_len) in enumerate(zip(seq_lens, query_lens)):
        if length == 0:
            continue
        keys = k_pages[block_table[row]].reshape(-1, num_kv, head_dim)[:length]  # [len, kv, d]
        values = v_pages[block_table[row]].reshape(-1, num_kv, head_dim)[:length]
        for i in range(query_len):
            mask = visible_keys(length - query_len + i, np.arange(length), window)  # [len]
            for head in range(q.shape[2]):
                scores = keys[mask, head // group] @ q[row, i, head] * scale
                if cap is not None:
                    scores = cap * np.tanh(scores / cap)
                weights = np.exp(scores - scores.max())
                out[row, i, head] = weights @ values[mask, head // group] / weights.sum()
    return out


def assert_close(actual, expected, dtype, label):
    actual = np.asarray(actual, np.float64)
    assert np.isfinite(actual).all(), f"{label}: non-finite output (seed {SEED})"
    error = np.abs(actual - expected).max() / np.abs(expected).max()
    assert error < TOLERANCE[dtype], f"{label}: relative error {error:.2e} (seed {SEED})"


@dataclasses.dataclass(frozen=True)
class Options:
    """Attention options of one run: window (None: no window argument at all), scale, cap."""
    window: int | None = None
    scale: float | None = None
    cap: float | None = None

    def static(self):
        return dict(scale=self.scale, logit_soft_cap=self.cap)

    def oracle(self):
        return dict(window=self.window, scale=self.scale, cap=self.cap)

    def operand(self):
        """The window as the implementations get it: an int32 scalar array (or None)."""
        return None if self.window is None else jnp.int32(self.window)


def jitted(function, options, **tiles):
    """`function` jitted with the static options and tiles bound and the window as an operand."""
    return jax.jit(lambda *args, window: function(*args, sliding_window=window, **options.static(), **tiles))


def garbage_before_window(k_pages, v_pages, block_table, seq_lens, query_lens, window):
    """Copies of the pages with NaN in every slot before the window of each sequence's first
    query, and a block table whose pages wholly before it are the null page (which is NaN): what
    an allocator that frees the pages no query can see leaves. Nothing changes without a window."""
    k_pages, v_pages, block_table = k_pages.copy(), v_pages.copy(), block_table.copy()
    if window is None or window <= 0:
        return k_pages, v_pages, block_table
    page_size = k_pages.shape[1]
    for row, (length, query_len) in enumerate(zip(seq_lens, query_lens)):
        first_visible = max(0, int(length) - int(query_len) - window + 1)
        for position in range(first_visible):
            page, offset = block_table[row, position // page_size], position % page_size
            k_pages[page, offset] = np.nan
            v_pages[page, offset] = np.nan
        block_table[row, : first_visible // page_size] = 0
    return k_pages, v_pages, block_table


def quantized_cache(pages, kind: str):
    """A `kind` ("int8" or "fp8") cache (kv_quant) of float pages, written slot by slot, and the
    float32 values it holds (NaN stays NaN)."""
    num_pages, page_size, num_kv, head_dim = pages.shape
    cache = kv_quant.write_rows(
        kv_quant.zeros(pages.shape, kv_quant.KV_CACHE_DTYPES[kind]),
        jnp.asarray(np.asarray(pages, np.float32).reshape(-1, num_kv, head_dim)),
        jnp.arange(num_pages * page_size, dtype=jnp.int32),
    )
    return cache, np.asarray(kv_quant.dequantize(*kv_quant.split(cache), jnp.float32))


def decode_problem(case, rng, window=None, kv_dtype=None):
    """Random decode inputs (one query per sequence) and the oracle's pages; kv_dtype "int8" or
    "fp8": the implementations get quantized pages, the oracle the values they hold.

    Returns args (q, k, v, block_table, seq_lens) for the implementations, the float pages and
    block table the oracle reads, and seq_lens."""
    seq_lens = context_lengths(case.page_size, rng)
    k_pages, v_pages, block_table = paged_inputs(case, seq_lens, rng)
    k_pages, v_pages, block_table = garbage_before_window(
        k_pages, v_pages, block_table, seq_lens, (seq_lens > 0).astype(int), window)
    q = rng.standard_normal((len(seq_lens), case.group * case.num_kv_heads, case.head_dim))
    q[seq_lens == 0] = np.nan  # padding rows may hold garbage
    q = in_dtype(q, case.dtype)
    k_cache, v_cache = k_pages, v_pages
    if kv_dtype:
        (k_cache, k_pages), (v_cache, v_pages) = quantized_cache(k_pages, kv_dtype), quantized_cache(v_pages, kv_dtype)
    args = (jnp.asarray(q), k_cache, v_cache, jnp.asarray(block_table), jnp.asarray(seq_lens))
    return args, (k_pages, v_pages, block_table), seq_lens


def check_decode(case, rng, options=Options(), kv_dtype=None, label="decode"):
    """Pallas kernel, XLA path and reference against the oracle on one random decode problem."""
    args, (k_pages, v_pages, block_table), seq_lens = decode_problem(case, rng, options.window, kv_dtype)
    q = np.asarray(args[0])
    expected = oracle(q[:, None], k_pages, v_pages, block_table, seq_lens, (seq_lens > 0).astype(int),
                      **options.oracle())[:, 0]
    kernel_tiles = dict(case.tiles, num_splits=3) if case.tiles else {}
    xla_blocks = case.tiles.get("pages_per_block", xla_paged.DECODE_PAGES_PER_BLOCK)
    outputs = {
        "kernel": jitted(paged_decode.paged_decode_attention, options, interpret=INTERPRET, **kernel_tiles),
        "reference": jitted(reference.paged_decode_attention, options),
        "xla": jitted(xla_paged.paged_decode_attention, options, pages_per_block=xla_blocks),
    }
    for name, function in outputs.items():
        out = function(*args, window=options.operand())
        assert out.shape == q.shape and out.dtype == q.dtype, name
        assert_close(out, expected, case.dtype, f"{label} {name} {options}")
        assert np.all(np.asarray(out, np.float32)[seq_lens == 0] == 0), f"{name}: padding row not zero (seed {SEED})"


def ragged_batch(seq_lens, page_size, rng):
    """Query lengths mixing decode tokens, whole prefills and prefill chunks; padding at the end."""
    query_lens = np.zeros_like(seq_lens)
    for row, length in enumerate(seq_lens):
        if length > 0:
            query_lens[row] = rng.choice([1, length, max(1, length // 2), min(length, page_size + 1)])
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    num_tokens = int(query_start_loc[-1]) + int(rng.integers(1, 5))
    return query_lens, query_start_loc, num_tokens


def ragged_problem(case, rng, window=None, kv_dtype=None):
    """Random ragged inputs (decode tokens, whole prefills and chunks starting mid-sequence) and
    the oracle's answer. Returns args (q, k, v, block_table, seq_lens, query_start_loc) for the
    implementations and the expected output [num_tokens, heads, d] as a function of the options."""
    seq_lens = context_lengths(case.page_size, rng)
    k_pages, v_pages, block_table = paged_inputs(case, seq_lens, rng)
    query_lens, query_start_loc, num_tokens = ragged_batch(seq_lens, case.page_size, rng)
    k_pages, v_pages, block_table = garbage_before_window(
        k_pages, v_pages, block_table, seq_lens, query_lens, window)
    num_heads = case.group * case.num_kv_heads
    q = np.full((num_tokens, num_heads, case.head_dim), np.nan)  # padding tokens stay NaN
    q[: query_start_loc[-1]] = rng.standard_normal((query_start_loc[-1], num_heads, case.head_dim))
    q = in_dtype(q, case.dtype)
    k_cache, v_cache = k_pages, v_pages
    if kv_dtype:
        (k_cache, k_pages), (v_cache, v_pages) = quantized_cache(k_pages, kv_dtype), quantized_cache(v_pages, kv_dtype)
    max_query_len = int(query_lens.max())
    q_padded = np.zeros((len(seq_lens), max_query_len, num_heads, case.head_dim))
    for row, (start, count) in enumerate(zip(query_start_loc, query_lens)):
        q_padded[row, :count] = q[start : start + count].astype(np.float64)

    def expected(options):
        padded = oracle(q_padded, k_pages, v_pages, block_table, seq_lens, query_lens, **options.oracle())
        out = np.zeros((num_tokens, num_heads, case.head_dim))
        for row, (start, count) in enumerate(zip(query_start_loc, query_lens)):
            out[start : start + count] = padded[row, :count]
        return out

    args = (jnp.asarray(q), k_cache, v_cache, jnp.asarray(block_table), jnp.asarray(seq_lens),
            jnp.asarray(query_start_loc))
    return args, expected


def check_ragged(case, rng, options=Options(), kv_dtype=None, label="ragged"):
    """Pallas kernel, XLA path and reference against the oracle on one random ragged batch
    (decode tokens, whole prefills and chunks starting mid-sequence)."""
    args, expected_of = ragged_problem(case, rng, options.window, kv_dtype)
    q, query_start_loc, expected = np.asarray(args[0]), np.asarray(args[5]), expected_of(options)
    kernel_tiles = dict(case.tiles, block_q=2) if case.tiles else {}
    xla_blocks = case.tiles.get("pages_per_block", 3)  # several blocks, a width not dividing the table
    outputs = {
        "kernel": jitted(ragged_prefill.ragged_paged_attention, options, interpret=INTERPRET, **kernel_tiles),
        "reference": jitted(reference.ragged_paged_attention, options),
        "xla": jitted(xla_paged.ragged_paged_attention, options, pages_per_block=xla_blocks),
    }
    for name, function in outputs.items():
        out = function(*args, window=options.operand())
        assert out.shape == q.shape and out.dtype == q.dtype, name
        assert_close(out, expected, case.dtype, f"{label} {name} {options}")
        tail = np.asarray(out, np.float32)[query_start_loc[-1] :]
        assert np.all(tail == 0), f"{name}: padding tokens not zero (seed {SEED})"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_paged_decode_matches_oracle(case):
    check_decode(case, np.random.default_rng([SEED, CASES.index(case), 0]))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_ragged_matches_oracle(case):
    check_ragged(case, np.random.default_rng([SEED, CASES.index(case), 1]))


def test_split_range_shares_the_visible_blocks_out_evenly():
    """A decode split's blocks come from the sequence's own length (and window), never the table's
    width: the splits of a sequence cover exactly its blocks from the first visible one to its
    last, in order, without overlap, each at most max(MIN_BLOCKS_PER_SPLIT, ceil(visible / splits))."""
    rng = np.random.default_rng([SEED, 40])
    for _ in range(300):
        seq_len, num_splits, keys_per_block = int(rng.integers(0, 3000)), int(rng.integers(1, 12)), int(rng.choice([16, 64]))
        first_key = int(rng.integers(0, max(seq_len, 1)))
        ranges = [tuple(int(x) for x in paged_decode.split_range(jnp.int32(seq_len), jnp.int32(split), num_splits,
                                                                 keys_per_block, jnp.int32(first_key)))
                  for split in range(num_splits)]
        seq_blocks = -(-seq_len // keys_per_block)
        walked = [block for first, end in ranges for block in range(first, end)]
        assert walked == list(range(min(first_key // keys_per_block, seq_blocks), seq_blocks)), (
            seq_len, num_splits, keys_per_block, first_key, ranges, SEED)
        share = max(paged_decode.MIN_BLOCKS_PER_SPLIT, -(-len(walked) // num_splits))
        assert all(end - first <= share for first, end in ranges), (ranges, share, SEED)


@pytest.mark.parametrize("window", [None, "pages"])
def test_paged_decode_over_a_table_far_wider_than_the_contexts(window):
    """Every decode step of an engine on these kernels has the longest context's table width: a
    table 8x wider than the batch needs (the extra entries the NaN null page) gives the oracle's
    result at every split count."""
    case = CASES[3]
    rng = np.random.default_rng([SEED, CASES.index(case), 41])
    window = window and 2 * case.page_size + 3
    args, (k_pages, v_pages, block_table), seq_lens = decode_problem(case, rng, window)
    wide = jnp.pad(args[3], ((0, 0), (0, 7 * args[3].shape[1])))
    q = np.asarray(args[0])
    options = Options(window=window)
    expected = oracle(q[:, None], k_pages, v_pages, block_table, seq_lens, (seq_lens > 0).astype(int),
                      **options.oracle())[:, 0]
    for num_splits in (1, 3, 8):
        function = jitted(paged_decode.paged_decode_attention, options, interpret=INTERPRET,
                          pages_per_block=1, num_splits=num_splits)
        out = function(args[0], args[1], args[2], wide, args[4], window=options.operand())
        assert_close(out, expected, case.dtype, f"wide table, {num_splits} splits, window {window}")


# Windows relative to the batch of context_lengths (1, page-1, page, page+1, a long one, padding),
# each on a case with several context splits and key blocks (f32 MHA, bf16 GQA 3 in turn): one key;
# a few pages, so pages before the window are skipped and the window crosses a page boundary;
# exactly the long sequence; longer than every sequence; the no-window sentinel.
WINDOWS = {
    "one": (CASES[0], lambda page_size, longest: 1),
    "pages": (CASES[3], lambda page_size, longest: 2 * page_size + 3),
    "equal": (CASES[0], lambda page_size, longest: longest),
    "larger": (CASES[3], lambda page_size, longest: longest + 5),
    "sentinel": (CASES[0], lambda page_size, longest: common.NO_WINDOW),
}


def window_problem(kind, salt):
    """(case, window, generator) for a window kind; the window is computed from the lengths the
    generator's first draw (context_lengths) will give."""
    case, window_of = WINDOWS[kind]
    numbers = [SEED, CASES.index(case), salt]
    longest = int(context_lengths(case.page_size, np.random.default_rng(numbers)).max())
    return case, window_of(case.page_size, longest), np.random.default_rng(numbers)


@pytest.mark.parametrize("kind", WINDOWS)
def test_paged_decode_sliding_window_matches_oracle(kind):
    case, window, rng = window_problem(kind, 2)
    check_decode(case, rng, Options(window=window))


@pytest.mark.parametrize("kind", WINDOWS)
def test_ragged_sliding_window_matches_oracle(kind):
    case, window, rng = window_problem(kind, 3)
    check_ragged(case, rng, Options(window=window))


@pytest.mark.parametrize("check", [check_decode, check_ragged], ids=["decode", "ragged"])
def test_sliding_window_on_int8_pages(check):
    """int8 pages with per-token scales (kv_quant), compared on the values they hold."""
    case = CASES[2]  # production tiles
    check(case, np.random.default_rng([SEED, 2, 4]), Options(window=case.page_size + 5), kv_dtype="int8")


SOFT_CAP_OPTIONS = [Options(scale=0.7, cap=2.0), Options(window=11, scale=0.3, cap=5.0)]


@pytest.mark.parametrize("options", SOFT_CAP_OPTIONS, ids=str)
@pytest.mark.parametrize("check", [check_decode, check_ragged], ids=["decode", "ragged"])
def test_soft_cap_and_scale_match_oracle(check, options):
    """Gemma 2 style: a custom softmax scale and tanh soft-capping (which saturates at these
    scales: |scale * q.k| reaches several times the cap), with and without a window."""
    case = CASES[4]
    check(case, np.random.default_rng([SEED, 4, 5, SOFT_CAP_OPTIONS.index(options)]), options)


def test_oracle_mask_is_transformers_sliding_window_mask():
    """The oracle's mask is transformers' (Mistral, Gemma 2): sliding_window_overlay and'ed
    with the causal mask; window 3 lets a query see itself and the two keys before it."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    query_pos, key_pos = np.arange(12)[:, None], np.arange(12)[None, :]
    for window in (1, 2, 3, 5, 12, 20):
        theirs = masking_utils.sliding_window_overlay(window)(0, 0, query_pos, key_pos)
        theirs = theirs & masking_utils.causal_mask_function(0, 0, query_pos, key_pos)
        assert np.array_equal(visible_keys(query_pos, key_pos, window), theirs), window
    assert np.array_equal(visible_keys(query_pos, key_pos, 3)[4], [0, 0, 1, 1, 1] + [0] * 7)


@pytest.mark.parametrize("window", [1, 3, 6])
def test_sliding_window_sees_exactly_the_last_window_keys(window):
    """Zero queries weigh every visible key alike and V is one-hot in the key position, so each
    output row is 1 / |visible| exactly on the visible keys: the mask read straight off."""
    page_size, length, head_dim = 4, 13, 16
    num_pages = 6
    rng = np.random.default_rng([SEED, 6, window])
    k_pages = rng.standard_normal((num_pages, page_size, 1, head_dim)).astype(np.float32)
    v_pages = np.zeros((num_pages, page_size, 1, head_dim), np.float32)
    block_table = np.array([[3, 1, 5, 2]], np.int32)  # position t in page block_table[t // 4]
    for position in range(length):
        v_pages[block_table[0, position // page_size], position % page_size, 0, position] = 1.0
    seq_lens = np.array([length], np.int32)
    query_start_loc = np.array([0, length], np.int32)
    expected = visible_keys(np.arange(length)[:, None], np.arange(head_dim)[None, :], window)
    expected = expected / expected.sum(axis=1, keepdims=True)  # [length, head_dim]

    q = jnp.zeros((length, 2, head_dim), jnp.float32)
    pages = (jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(block_table), jnp.asarray(seq_lens))
    ragged = {
        "kernel": functools.partial(ragged_prefill.ragged_paged_attention, interpret=INTERPRET,
                                    block_q=2, pages_per_block=1),
        "xla": functools.partial(xla_paged.ragged_paged_attention, pages_per_block=1),
        "reference": reference.ragged_paged_attention,
    }
    for name, function in ragged.items():
        out = function(q, *pages, jnp.asarray(query_start_loc), sliding_window=jnp.int32(window))
        np.testing.assert_allclose(out[:, 0], expected, atol=1e-6, err_msg=f"ragged {name} (seed {SEED})")
        np.testing.assert_allclose(out[:, 1], expected, atol=1e-6, err_msg=f"ragged {name} (seed {SEED})")
    decode = {
        "kernel": functools.partial(paged_decode.paged_decode_attention, interpret=INTERPRET,
                                    pages_per_block=1, num_splits=2),
        "xla": functools.partial(xla_paged.paged_decode_attention, pages_per_block=1),
        "reference": reference.paged_decode_attention,
    }
    for name, function in decode.items():
        out = function(q[:1], *pages, sliding_window=jnp.int32(window))
        np.testing.assert_allclose(out[0, 0], expected[-1], atol=1e-6, err_msg=f"decode {name} (seed {SEED})")


@pytest.mark.parametrize("backend", ["interpret", "xla"])
def test_sliding_window_is_an_operand_that_may_change_per_layer(backend):
    """Gemma alternates local and global layers inside one lax.scan: the window is a traced
    int32 operand, one value per layer, and <= 0 means no window."""
    case = CASES[0]
    rng = np.random.default_rng([SEED, 7])
    args, _, _ = decode_problem(case, rng)
    windows = np.array([0, 3, -1, 2 * case.page_size + 1], np.int32)

    def layer(carry, window):
        return carry, dispatch.decode_attention(backend, *args, sliding_window=window)

    _, per_layer = jax.jit(lambda w: jax.lax.scan(layer, None, w))(jnp.asarray(windows))
    for index, window in enumerate(windows):
        alone = dispatch.decode_attention(backend, *args, sliding_window=int(window))
        np.testing.assert_allclose(np.asarray(per_layer[index]), np.asarray(alone), rtol=1e-5, atol=1e-6,
                                   err_msg=f"layer {index}, window {window} (seed {SEED})")
    no_window = dispatch.decode_attention(backend, *args)
    np.testing.assert_allclose(np.asarray(per_layer[0]), np.asarray(no_window), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(per_layer[2]), np.asarray(no_window), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(per_layer[1]), np.asarray(no_window)), "window 3 changed nothing"


def test_pallas_kernels_import_only_jax_numpy_the_standard_library_and_itself():
    """The kernels stand alone (besides the CPU kernels, which import only jax, numpy and the
    standard library); production modules do not load the test oracle at import."""
    import cpu_kernels
    for path in pathlib.Path(cpu_kernels.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and not node.level else []
            for module in names:
                assert module.split(".")[0] in {"jax", "numpy"} | set(sys.stdlib_module_names), module
    allowed = {"jax", "numpy", "pallas_kernels", "cpu_kernels"} | set(sys.stdlib_module_names)
    package = pathlib.Path(pallas_kernels.__file__).parent
    files = sorted(package.glob("*.py"))
    assert {path.name for path in files} >= {"dispatch.py", "paged_decode.py", "ragged_prefill.py"}
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [] if node.level else [node.module]  # relative: the package itself
            else:
                continue
            for module in modules:
                assert module.split(".")[0] in allowed, f"{path.name}:{node.lineno} imports {module}"
        if path.name != "reference.py":
            for node in tree.body:  # module level: what importing the module loads
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pallas_kernels"):
                    names = {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
                    assert "pallas_kernels.reference" not in names, f"{path.name} imports the test oracle"


def test_write_kv_scatters_rows_and_keeps_the_rest():
    rng = np.random.default_rng([SEED, 99])
    num_pages, page_size, num_kv, head_dim, num_tokens = 6, 8, 2, 64, 7
    k_pages = jnp.asarray(rng.standard_normal((num_pages, page_size, num_kv, head_dim)), jnp.bfloat16)
    v_pages = jnp.asarray(rng.standard_normal((num_pages, page_size, num_kv, head_dim)), jnp.bfloat16)
    slots = rng.choice(np.arange(page_size, num_pages * page_size), num_tokens - 2, replace=False)
    slot_mapping = np.concatenate([slots, [0, 3]]).astype(np.int32)  # two padding tokens -> page 0
    k = rng.standard_normal((num_tokens, num_kv, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_tokens, num_kv, head_dim)).astype(np.float32)
    expected_k = np.asarray(k_pages, np.float32).reshape(-1, num_kv, head_dim).copy()
    expected_v = np.asarray(v_pages, np.float32).reshape(-1, num_kv, head_dim).copy()
    expected_k[slots] = np.asarray(jnp.asarray(k[:-2], jnp.bfloat16), np.float32)
    expected_v[slots] = np.asarray(jnp.asarray(v[:-2], jnp.bfloat16), np.float32)

    write = jax.jit(dispatch.write_kv, donate_argnums=(0, 1))
    new_k, new_v = write(k_pages, v_pages, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slot_mapping))
    assert new_k.shape == k_pages.shape and new_k.dtype == jnp.bfloat16
    flat_k = np.asarray(new_k, np.float32).reshape(-1, num_kv, head_dim)
    flat_v = np.asarray(new_v, np.float32).reshape(-1, num_kv, head_dim)
    real = np.arange(page_size, num_pages * page_size)  # page 0 may hold either padding write
    np.testing.assert_array_equal(flat_k[real], expected_k[real])
    np.testing.assert_array_equal(flat_v[real], expected_v[real])


def test_write_kv_updates_donated_pages_in_place():
    pages = jax.ShapeDtypeStruct((64, 16, 2, 64), jnp.float32)
    rows = jax.ShapeDtypeStruct((8, 2, 64), jnp.float32)
    slots = jax.ShapeDtypeStruct((8,), jnp.int32)
    write = jax.jit(dispatch.write_kv, donate_argnums=(0, 1))
    compiled = write.lower(pages, pages, rows, rows, slots).compile()
    stats = compiled.memory_analysis()
    page_bytes = 64 * 16 * 2 * 64 * 4
    assert stats.alias_size_in_bytes == 2 * page_bytes
    assert stats.temp_size_in_bytes < page_bytes // 8


@pytest.mark.parametrize("backend", dispatch.BACKENDS + tuple(dispatch.BACKEND_ALIASES))
def test_dispatch_routes_to_the_chosen_implementation(backend, monkeypatch):
    calls = []

    def recorder(name):
        return lambda *args, **kwargs: calls.append((name, len(args), kwargs)) or name

    for module in (paged_decode, ragged_prefill, mosaic_decode, mosaic_ragged, reference, xla_paged):
        for kind, function in (("decode", "paged_decode_attention"), ("ragged", "ragged_paged_attention")):
            monkeypatch.setattr(module, function, recorder(f"{module.__name__}.{kind}"), raising=False)
    decode_args = ("q", "k", "v", "table", "lens")
    ragged_args = decode_args + ("starts",)
    options = dict(sliding_window="window", scale=0.5, logit_soft_cap=30.0)
    decoded = dispatch.decode_attention(backend, *decode_args, **options)
    ragged = dispatch.ragged_attention(backend, *ragged_args, **options)
    modules = {"reference": ("reference",) * 2, "xla": ("xla_paged",) * 2,
               "mosaic": ("mosaic_decode", "mosaic_ragged"), "mosaic_interpret": ("mosaic_decode", "mosaic_ragged")}
    decode_module, ragged_module = modules.get(backend, ("paged_decode", "ragged_prefill"))
    assert decoded == f"pallas_kernels.{decode_module}.decode"
    assert ragged == f"pallas_kernels.{ragged_module}.ragged"
    assert [c[1] for c in calls] == [5, 6]
    for _, _, kwargs in calls:
        assert {name: kwargs[name] for name in options} == options
        assert kwargs.get("interpret", False) == backend.endswith("interpret")
    with pytest.raises(ValueError):
        dispatch.decode_attention("cuda", *decode_args)


@pytest.mark.parametrize("window", [None, 9])
def test_xla_path_results_do_not_depend_on_the_other_rows_or_the_table_width(window):
    """The engine's CPU path loops from the first block any row's window reaches to the longest
    sequence of the call: a row's result must be bit-for-bit the same alone, next to other rows,
    and with a wider block table."""
    case = Case(8, 64, 3, 2, jnp.float32, {})
    rng = np.random.default_rng([SEED, 99])
    seq_lens = np.array([5, 70, 17, 0, 33], np.int32)
    k_pages, v_pages, block_table = paged_inputs(case, seq_lens, rng)
    q = in_dtype(rng.standard_normal((len(seq_lens), 6, 64)), case.dtype)
    decode = jax.jit(functools.partial(xla_paged.paged_decode_attention, sliding_window=window))
    together = np.asarray(decode(q, k_pages, v_pages, block_table, seq_lens))
    wide_table = np.pad(block_table, ((0, 0), (0, 7)))
    wide = np.asarray(decode(q, k_pages, v_pages, wide_table, seq_lens))
    for row in np.flatnonzero(seq_lens):
        alone = np.asarray(decode(q[row:row + 1], k_pages, v_pages, block_table[row:row + 1], seq_lens[row:row + 1]))
        assert_same_result(alone[0], together[row], f"row {row} (seed {SEED})")
    assert_same_result(wide, together, "wider table")


def assert_same_result(actual, expected, label):
    """Bit for bit on the CPU; on a GPU XLA picks its kernels per shape, so results of the same row
    in batches of other shapes agree to float32 rounding there (a CPU-only invariant otherwise)."""
    if jax.default_backend() == "cpu":
        assert np.array_equal(actual, expected), label
    else:
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6, err_msg=label)


def xla_against_oracle(case, rng, options, *, decode, label, **tiles):
    """The XLA path alone (with `tiles`) against the float64 oracle on one random problem: decode
    (one query per sequence) or a ragged batch of decode tokens, prefills and chunks."""
    seq_lens = context_lengths(case.page_size, rng)
    k_pages, v_pages, block_table = paged_inputs(case, seq_lens, rng)
    if decode:
        query_lens = (seq_lens > 0).astype(np.int32)
        query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
        num_tokens = len(seq_lens)
    else:
        query_lens, query_start_loc, num_tokens = ragged_batch(seq_lens, case.page_size, rng)
    k_pages, v_pages, block_table = garbage_before_window(k_pages, v_pages, block_table, seq_lens, query_lens,
                                                          options.window)
    num_heads = case.group * case.num_kv_heads
    q_padded = np.zeros((len(seq_lens), max(int(query_lens.max()), 1), num_heads, case.head_dim))
    if decode:
        q = in_dtype(rng.standard_normal((len(seq_lens), num_heads, case.head_dim)), case.dtype)
        q_padded[:, 0] = np.asarray(q, np.float64)
        expected = oracle(q_padded, k_pages, v_pages, block_table, seq_lens, query_lens, **options.oracle())[:, 0]
        expected[seq_lens == 0] = 0
        function = jitted(xla_paged.paged_decode_attention, options, **tiles)
        out = function(jnp.asarray(q), k_pages, v_pages, jnp.asarray(block_table), jnp.asarray(seq_lens),
                       window=options.operand())
    else:
        q = np.full((num_tokens, num_heads, case.head_dim), np.nan)
        q[: query_start_loc[-1]] = rng.standard_normal((query_start_loc[-1], num_heads, case.head_dim))
        q = in_dtype(q, case.dtype)
        for row, (start, count) in enumerate(zip(query_start_loc, query_lens)):
            q_padded[row, :count] = q[start : start + count].astype(np.float64)
        padded = oracle(q_padded, k_pages, v_pages, block_table, seq_lens, query_lens, **options.oracle())
        expected = np.zeros((num_tokens, num_heads, case.head_dim))
        for row, (start, count) in enumerate(zip(query_start_loc, query_lens)):
            expected[start : start + count] = padded[row, :count]
        function = jitted(xla_paged.ragged_paged_attention, options, **tiles)
        out = function(jnp.asarray(q), k_pages, v_pages, jnp.asarray(block_table), jnp.asarray(seq_lens),
                       jnp.asarray(query_start_loc), window=options.operand())
    assert out.shape == q.shape and out.dtype == q.dtype, label
    assert_close(out, expected, case.dtype, f"{label} {options} {tiles}")
    if not decode:
        assert np.all(np.asarray(out, np.float32)[query_start_loc[-1] :] == 0), f"{label}: padding tokens not zero"


def test_xla_decode_block_size_follows_the_rows():
    """Few rows take large blocks (fewer loop steps), many rows small ones (a block of every row
    stays in the cache): SmolLM2's KV heads (3 x 64) at page size 16."""
    pages = {rows: xla_paged.decode_pages_per_block(rows, 16, 3, 64) for rows in (1, 2, 4, 8, 16, 32, 64)}
    assert pages == {1: 16, 2: 16, 4: 16, 8: 8, 16: 4, 32: 2, 64: 2}


@pytest.mark.parametrize("pages_per_block", [None, 1, 3, 16])
def test_xla_decode_every_block_size_matches_the_oracle(pages_per_block):
    """Blocks wider than the table (padded with null pages), one page, a width not dividing the
    table, the automatic choice; with a window and a soft cap on one case each."""
    for index, (case, options) in enumerate([
            (CASES[0], Options()), (CASES[2], Options(window=2 * CASES[2].page_size + 3)),
            (CASES[4], Options(scale=0.3, cap=20.0)), (CASES[1], Options(window=5, cap=30.0))]):
        rng = np.random.default_rng([SEED, 1600, index])
        xla_against_oracle(case, rng, options, decode=True, label=f"decode case {index}",
                           pages_per_block=pages_per_block)


@pytest.mark.parametrize("query_chunk", [1, 3, 8])
def test_xla_ragged_query_chunks_match_the_oracle(query_chunk):
    """The CPU prefill path walks each sequence's queries in chunks over the key blocks of its
    causal triangle: chunks that split sequences at any offset, with windows, a soft cap and GQA."""
    for index, (case, options) in enumerate([
            (CASES[0], Options()), (CASES[2], Options(window=2 * CASES[2].page_size + 3)),
            (CASES[4], Options(scale=0.3, cap=20.0)), (CASES[1], Options(window=1))]):
        rng = np.random.default_rng([SEED, 1700, index])
        xla_against_oracle(case, rng, options, decode=False, label=f"ragged case {index}",
                           query_chunk=query_chunk, pages_per_block=2)


def test_xla_ragged_results_do_not_depend_on_the_other_sequences():
    """A prefill chunk's result is bit-for-bit the same alone and next to other sequences, padding
    rows included (whose chunks the loop skips)."""
    case = Case(8, 64, 3, 2, jnp.float32, {})
    rng = np.random.default_rng([SEED, 1800])
    seq_lens = np.array([21, 40, 0], np.int32)
    query_lens = np.array([21, 13, 0], np.int32)
    k_pages, v_pages, block_table = paged_inputs(case, seq_lens, rng)
    starts = np.array([0, 21, 34, 34], np.int32)
    q = in_dtype(rng.standard_normal((40, 6, 64)), case.dtype)
    ragged = jax.jit(functools.partial(xla_paged.ragged_paged_attention, query_chunk=8))
    together = np.asarray(ragged(q, k_pages, v_pages, block_table, seq_lens, starts))
    for row in (0, 1):
        start, count = starts[row], query_lens[row]
        alone = np.asarray(ragged(q[start:start + count], k_pages, v_pages, block_table[row:row + 1],
                                  seq_lens[row:row + 1], np.array([0, count], np.int32)))
        assert_same_result(alone, together[start:start + count], f"row {row} (seed {SEED})")
    assert np.all(together[34:] == 0)


def test_engine_refuses_the_mosaic_kernels_on_operands_they_do_not_take():
    """--attention_backend=mosaic with float32 weights (the CPU's default), or a head_dim the
    kernels do not take, is a ValueError naming the flags to change when the engine is built,
    before any step is traced (the CLI turns it into exit 2); the Triton backend takes the model."""
    from jaxserve.config import ModelConfig
    from jaxserve.engine import Engine, EngineConfig
    from jaxserve.models import weights

    config = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_q_heads=2,
                         num_kv_heads=1, head_dim=64, max_position_embeddings=64)
    for dtype, head_dim, reason in (("float32", 64, "float16 or bfloat16"), ("bfloat16", 32, "head_dim 32")):
        model = dataclasses.replace(config, head_dim=head_dim)
        params = weights.random_params(model, dtype=jnp.dtype(dtype))
        with pytest.raises(ValueError, match=f"--attention_backend=mosaic: .*{reason}.*--attention_backend=pallas"):
            Engine(model, params, None, EngineConfig(attention_backend="mosaic", dtype=dtype, max_model_len=64,
                                                     warmup=False))
    params = weights.random_params(config, dtype=jnp.bfloat16)
    engine = Engine(config, params, None, EngineConfig(attention_backend="triton", dtype="bfloat16", max_model_len=64,
                                                       warmup=False))
    assert engine.runner.backend == "pallas"

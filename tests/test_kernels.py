"""Paged attention kernels (interpret mode), the XLA CPU path and the references against a
float64 numpy oracle.

Inputs are fresh random draws each run (the seed is in every failure message): permuted block
tables, lengths around page boundaries, padding rows in random places, and NaN in every page
slot no sequence owns (page 0, unused pages, tails of partly filled pages) and in padding
queries. Outputs must be finite, padding must be exactly zero, and the error small.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch, paged_decode, ragged_prefill, reference, xla_paged

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
# Interpret mode on CPU; on a GPU the kernels run natively (bench/gpu_check.sh).
INTERPRET = jax.default_backend() != "gpu"
SEED = np.random.SeedSequence().entropy % 2**32


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


def oracle(q, k_pages, v_pages, block_table, seq_lens, query_lens):
    """float64 attention; q: [num_seqs, max_query_len, q_heads, d] -> same shape."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    num_kv, head_dim = k_pages.shape[2], k_pages.shape[3]
    group = q.shape[2] // num_kv
    out = np.zeros_like(q)
    for row, (length, query_len) in enumerate(zip(seq_lens, query_lens)):
        if length == 0:
            continue
        keys = k_pages[block_table[row]].reshape(-1, num_kv, head_dim)[:length]  # [len, kv, d]
        values = v_pages[block_table[row]].reshape(-1, num_kv, head_dim)[:length]
        for i in range(query_len):
            position = length - query_len + i
            for head in range(q.shape[2]):
                scores = keys[: position + 1, head // group] @ q[row, i, head] * head_dim**-0.5
                weights = np.exp(scores - scores.max())
                out[row, i, head] = weights @ values[: position + 1, head // group] / weights.sum()
    return out


def assert_close(actual, expected, dtype, label):
    actual = np.asarray(actual, np.float64)
    assert np.isfinite(actual).all(), f"{label}: non-finite output (seed {SEED})"
    error = np.abs(actual - expected).max() / np.abs(expected).max()
    assert error < TOLERANCE[dtype], f"{label}: relative error {error:.2e} (seed {SEED})"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_paged_decode_matches_oracle(case):
    rng = np.random.default_rng([SEED, CASES.index(case), 0])
    seq_lens = context_lengths(case.page_size, rng)
    k_pages, v_pages, block_table = paged_inputs(case, seq_lens, rng)
    q = rng.standard_normal((len(seq_lens), case.group * case.num_kv_heads, case.head_dim))
    q[seq_lens == 0] = np.nan  # padding rows may hold garbage
    q = in_dtype(q, case.dtype)
    query_lens = (seq_lens > 0).astype(int)
    expected = oracle(q[:, None], k_pages, v_pages, block_table, seq_lens, query_lens)[:, 0]
    args = tuple(map(jnp.asarray, (q, k_pages, v_pages, block_table, seq_lens)))
    tiles = dict(case.tiles, num_splits=3) if case.tiles else {}
    kernel_out = paged_decode.paged_decode_attention(*args, interpret=INTERPRET, **tiles)
    reference_out = jax.jit(reference.paged_decode_attention)(*args)
    xla_blocks = case.tiles.get("pages_per_block", xla_paged.DECODE_PAGES_PER_BLOCK)
    xla_out = jax.jit(functools.partial(xla_paged.paged_decode_attention, pages_per_block=xla_blocks))(*args)
    for label, out in (("kernel", kernel_out), ("reference", reference_out), ("xla", xla_out)):
        assert out.shape == q.shape and out.dtype == q.dtype, label
        assert_close(out, expected, case.dtype, f"decode {label}")
        assert np.all(np.asarray(out, np.float32)[seq_lens == 0] == 0), f"{label}: padding row not zero"


def ragged_batch(seq_lens, page_size, rng):
    """Query lengths mixing decode tokens, whole prefills and prefill chunks; padding at the end."""
    query_lens = np.zeros_like(seq_lens)
    for row, length in enumerate(seq_lens):
        if length > 0:
            query_lens[row] = rng.choice([1, length, max(1, length // 2), min(length, page_size + 1)])
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    num_tokens = int(query_start_loc[-1]) + int(rng.integers(1, 5))
    return query_lens, query_start_loc, num_tokens


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_ragged_matches_oracle(case):
    rng = np.random.default_rng([SEED, CASES.index(case), 1])
    seq_lens = context_lengths(case.page_size, rng)
    k_pages, v_pages, block_table = paged_inputs(case, seq_lens, rng)
    query_lens, query_start_loc, num_tokens = ragged_batch(seq_lens, case.page_size, rng)
    num_heads = case.group * case.num_kv_heads
    q = np.full((num_tokens, num_heads, case.head_dim), np.nan)  # padding tokens stay NaN
    q[: query_start_loc[-1]] = rng.standard_normal((query_start_loc[-1], num_heads, case.head_dim))
    q = in_dtype(q, case.dtype)
    max_query_len = int(query_lens.max())
    q_padded = np.zeros((len(seq_lens), max_query_len, num_heads, case.head_dim))
    for row, (start, count) in enumerate(zip(query_start_loc, query_lens)):
        q_padded[row, :count] = q[start : start + count].astype(np.float64)
    padded_expected = oracle(q_padded, k_pages, v_pages, block_table, seq_lens, query_lens)
    expected = np.zeros((num_tokens, num_heads, case.head_dim))
    for row, (start, count) in enumerate(zip(query_start_loc, query_lens)):
        expected[start : start + count] = padded_expected[row, :count]

    args = tuple(map(jnp.asarray, (q, k_pages, v_pages, block_table, seq_lens, query_start_loc)))
    tiles = dict(case.tiles, block_q=2) if case.tiles else {}
    kernel_out = ragged_prefill.ragged_paged_attention(*args, interpret=INTERPRET, **tiles)
    reference_out = jax.jit(reference.ragged_paged_attention)(*args)
    xla_blocks = case.tiles.get("pages_per_block", 3)  # several blocks, a width not dividing the table
    xla_out = jax.jit(functools.partial(xla_paged.ragged_paged_attention, pages_per_block=xla_blocks))(*args)
    for label, out in (("kernel", kernel_out), ("reference", reference_out), ("xla", xla_out)):
        assert out.shape == q.shape and out.dtype == q.dtype, label
        assert_close(out, expected, case.dtype, f"ragged {label}")
        tail = np.asarray(out, np.float32)[query_start_loc[-1] :]
        assert np.all(tail == 0), f"{label}: padding tokens not zero"


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

    write = jax.jit(reference.write_kv, donate_argnums=(0, 1))
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
    write = jax.jit(reference.write_kv, donate_argnums=(0, 1))
    compiled = write.lower(pages, pages, rows, rows, slots).compile()
    stats = compiled.memory_analysis()
    page_bytes = 64 * 16 * 2 * 64 * 4
    assert stats.alias_size_in_bytes == 2 * page_bytes
    assert stats.temp_size_in_bytes < page_bytes // 8


def test_attention_backend_choice(monkeypatch):
    monkeypatch.delenv(dispatch.BACKEND_ENV_VAR, raising=False)
    on_gpu = jax.default_backend() == "gpu"
    assert dispatch.attention_backend() == ("pallas" if on_gpu else "xla")
    monkeypatch.setenv(dispatch.BACKEND_ENV_VAR, "Interpret")
    assert dispatch.attention_backend() == "interpret"
    assert dispatch.attention_backend("reference") == "reference"
    with pytest.raises(ValueError, match="unknown attention backend"):
        dispatch.attention_backend("cuda-magic")
    monkeypatch.setenv(dispatch.BACKEND_ENV_VAR, "fast")
    with pytest.raises(ValueError, match=dispatch.BACKEND_ENV_VAR):
        dispatch.attention_backend()


@pytest.mark.parametrize("backend", dispatch.BACKENDS)
def test_dispatch_routes_to_the_chosen_implementation(backend, monkeypatch):
    calls = []

    def recorder(name):
        return lambda *args, **kwargs: calls.append((name, len(args), kwargs)) or name

    for module in (paged_decode, ragged_prefill, reference, xla_paged):
        for kind, function in (("decode", "paged_decode_attention"), ("ragged", "ragged_paged_attention")):
            monkeypatch.setattr(module, function, recorder(f"{module.__name__}.{kind}"), raising=False)
    decode_args = ("q", "k", "v", "table", "lens")
    ragged_args = decode_args + ("starts",)
    decoded = dispatch.decode_attention(backend, *decode_args, scale=0.5)
    ragged = dispatch.ragged_attention(backend, *ragged_args, scale=0.5)
    plain = {"reference": "pallas_kernels.reference", "xla": "pallas_kernels.xla_paged"}
    assert decoded == f"{plain.get(backend, 'pallas_kernels.paged_decode')}.decode"
    assert ragged == f"{plain.get(backend, 'pallas_kernels.ragged_prefill')}.ragged"
    assert [c[1] for c in calls] == [5, 6]
    for _, _, kwargs in calls:
        assert kwargs["scale"] == 0.5
        assert kwargs.get("interpret", False) == (backend == "interpret")
    with pytest.raises(ValueError):
        dispatch.decode_attention("triton", *decode_args)


def test_xla_path_results_do_not_depend_on_the_other_rows_or_the_table_width():
    """The engine's CPU path loops to the longest sequence of the call: a row's result must be
    bit-for-bit the same alone, next to longer rows, and with a wider block table."""
    case = Case(8, 64, 3, 2, jnp.float32, {})
    rng = np.random.default_rng([SEED, 99])
    seq_lens = np.array([5, 70, 17, 0, 33], np.int32)
    k_pages, v_pages, block_table = paged_inputs(case, seq_lens, rng)
    q = in_dtype(rng.standard_normal((len(seq_lens), 6, 64)), case.dtype)
    decode = jax.jit(xla_paged.paged_decode_attention)
    together = np.asarray(decode(q, k_pages, v_pages, block_table, seq_lens))
    wide_table = np.pad(block_table, ((0, 0), (0, 7)))
    wide = np.asarray(decode(q, k_pages, v_pages, wide_table, seq_lens))
    for row in np.flatnonzero(seq_lens):
        alone = np.asarray(decode(q[row:row + 1], k_pages, v_pages, block_table[row:row + 1], seq_lens[row:row + 1]))
        assert np.array_equal(alone[0], together[row]), f"row {row} (seed {SEED})"
    assert np.array_equal(wide, together)

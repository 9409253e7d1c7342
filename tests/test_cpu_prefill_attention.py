"""The C++ prefill attention kernel (cpu_kernels.ragged_prefill_attention, the "xla" backend's
ragged attention on the CPU) against the test oracle, pallas_kernels.reference."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
from pallas_kernels import dispatch, reference

SEED = int(os.environ.get("JAXSERVE_TEST_SEED", "20261205"))

pytestmark = [pytest.mark.slow,  # builds the kernels, runs them against the oracle: out of `make test-quick`
              pytest.mark.skipif(not cpu_kernels.available(), reason="no AVX-512 VNNI CPU or no C++ compiler")]

PAGES, PAGE_SIZE, WIDTH = 96, 16, 20


def _case(rng, num_q_heads, num_kv_heads, head_dim, lens, query_lens, extra_tokens=5):
    """Random queries and pages, each sequence's pages a random draw (shuffled) from the cache;
    query_start_loc from query_lens (padding rows: seq_len 0, no queries), `extra_tokens`
    tokens past the last sequence."""
    lens, query_lens = np.asarray(lens, np.int32), np.asarray(query_lens, np.int32)
    starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    tokens = int(starts[-1]) + extra_tokens
    q = rng.standard_normal((tokens, num_q_heads, head_dim)).astype(np.float32)
    k, v = (rng.standard_normal((PAGES, PAGE_SIZE, num_kv_heads, head_dim)).astype(np.float32) for _ in range(2))
    table = np.stack([rng.permutation(np.arange(1, PAGES))[:WIDTH] for _ in lens]).astype(np.int32)
    return tuple(jnp.asarray(a) for a in (q, k, v, table, lens, starts))


def _check(args, options, what):
    attend = jax.jit(lambda *a: dispatch.ragged_attention("xla", *a, **options))
    assert cpu_kernels.takes_prefill_attention(*args[:3])
    assert "jaxserve_ragged_prefill_attention" in attend.lower(*args).as_text()
    got = np.asarray(attend(*args))
    want = np.asarray(reference.ragged_paged_attention(*args, **options))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=f"seed {SEED}, {what}")
    return got


# Sequences: a whole prompt (3 query blocks and a part), a chunk after 70 cached tokens starting
# mid-page, a padding row, 1-token queries (after 0 and after 200 cached tokens), a chunk of 33
# after 16 (one page), a chunk of 2 at the end of a long context.
LENS = [100, 107, 0, 1, 201, 49, 300]
QUERY_LENS = [100, 37, 0, 1, 1, 33, 2]


@pytest.mark.parametrize("heads", [(4, 4, 64), (9, 3, 64), (8, 2, 128), (6, 2, 24), (4, 1, 136)],
                         ids=lambda h: f"q{h[0]}-kv{h[1]}-d{h[2]}")
def test_prefill_attention_matches_the_reference(heads):
    """GQA groups 1, 3, 4, head_dim 64 and 128 (and 24, 136: not a multiple of 16), cached
    contexts and query lengths of every kind (LENS), pages shuffled in the table; the padding
    row's and the tokens past the last sequence give zeros."""
    rng = np.random.default_rng([SEED, heads[0], heads[2]])
    args = _case(rng, *heads, LENS, QUERY_LENS)
    got = _check(args, {}, f"heads {heads}")
    assert not got[int(np.sum(QUERY_LENS)):].any()  # tokens of no sequence


@pytest.mark.parametrize("options", [{"sliding_window": 40}, {"sliding_window": 1}, {"sliding_window": 0},
                                     {"scale": 0.3, "logit_soft_cap": 5.0},
                                     {"sliding_window": 70, "scale": 0.2, "logit_soft_cap": 3.0}],
                         ids=["window40", "window1", "no-window", "scale-softcap", "all"])
def test_prefill_attention_options(options):
    """A sliding window (its operand: 0 means none), and scale with a logit soft cap."""
    rng = np.random.default_rng([SEED, 7, len(options)])
    if "sliding_window" in options:
        options = {**options, "sliding_window": jnp.int32(options["sliding_window"])}
    _check(_case(rng, 9, 3, 64, LENS, QUERY_LENS), options, f"options {options}")


BF16_CPU = "avx512_bf16" in cpu_kernels.cpu_flags().split()


def _bf16(a):
    return jnp.asarray(a, jnp.bfloat16).astype(jnp.float32)


@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 136), (6, 2, 23)], ids=lambda h: f"q{h[0]}-kv{h[1]}-d{h[2]}")
@pytest.mark.parametrize("options", [{}, {"sliding_window": 40, "scale": 0.2, "logit_soft_cap": 3.0}],
                         ids=["causal", "window-softcap"])
def test_prefill_attention_in_bfloat16_products(heads, options):
    """bf16_products (a bfloat16 or int8 model's prompt): queries (scaled), keys and values rounded
    to bfloat16, products of pairs summed in float32, the softmax weights rounded to bfloat16 for
    the values' products. Against the reference on the rounded operands (the weights' rounding
    left: a few bfloat16 steps of the output's scale), and within bfloat16's error of the float32
    result; a head_dim that is odd or not a multiple of 16 pads its pairs with zeros. Where the
    CPU has no AVX-512 BF16 the kernel computes in float32: equal to the float32 call."""
    rng = np.random.default_rng([SEED, 11, heads[2], len(options)])
    if "sliding_window" in options:
        options = {**options, "sliding_window": jnp.int32(options["sliding_window"])}
    q, k, v, table, lens, starts = _case(rng, *heads, LENS, QUERY_LENS)
    attend = jax.jit(lambda *a: dispatch.ragged_attention("xla", *a, **options, bf16_products=True))
    got = np.asarray(attend(q, k, v, table, lens, starts))
    exact = np.asarray(reference.ragged_paged_attention(q, k, v, table, lens, starts, **options))
    if not BF16_CPU:
        np.testing.assert_allclose(got, exact, atol=1e-5, rtol=1e-5, err_msg=f"seed {SEED}")
        return
    scale = float(options.get("scale") or heads[2] ** -0.5)
    rounded_q = _bf16(q * scale) / scale  # the kernel rounds the scaled queries
    want = np.asarray(reference.ragged_paged_attention(rounded_q, _bf16(k), _bf16(v), table, lens, starts, **options))
    assert np.abs(got - want).max() < 2e-2, f"seed {SEED}: {np.abs(got - want).max()}"
    assert np.abs(got - want).mean() < 2e-3, f"seed {SEED}: {np.abs(got - want).mean()}"
    assert np.abs(got - exact).mean() < 4e-3, f"seed {SEED}"
    assert np.abs(got - exact).mean() > 1e-5, "no bfloat16 rounding: the float32 path ran"
    assert not got[int(np.sum(QUERY_LENS)):].any()  # tokens of no sequence


def test_prefill_attention_in_bfloat16_products_with_key_limits():
    """The key-limit handler (bidirectional image spans) takes bf16_products as the causal one:
    a span of sequence 0's tokens sees the whole span, against the reference on the rounded
    operands."""
    rng = np.random.default_rng([SEED, 12])
    q, k, v, table, lens, starts = _case(rng, 9, 3, 64, LENS, QUERY_LENS, extra_tokens=0)
    positions = np.concatenate([np.arange(n - m, n) for n, m in zip(LENS, QUERY_LENS)]).astype(np.int32)
    key_limit = positions.copy()
    key_limit[10:20] = 19  # tokens 10-19 of sequence 0: one image
    key_limit = jnp.asarray(key_limit)
    attend = jax.jit(lambda *a: dispatch.ragged_attention("xla", *a[:6], key_limit=a[6], bf16_products=True))
    got = np.asarray(attend(q, k, v, table, lens, starts, key_limit))
    scale = 64 ** -0.5
    operands = (_bf16(q * scale) / scale, _bf16(k), _bf16(v)) if BF16_CPU else (q, k, v)
    want = np.asarray(reference.ragged_paged_attention(*operands, table, lens, starts, key_limit=key_limit))
    assert np.abs(got - want).max() < (2e-2 if BF16_CPU else 1e-5), f"seed {SEED}"
    causal = np.asarray(attend(q, k, v, table, lens, starts, jnp.asarray(positions)))
    assert np.abs(got[10:19] - causal[10:19]).max() > 0.05  # the span's tokens see later ones


def test_prefill_attention_does_not_depend_on_the_other_sequences():
    """A sequence's result is the same bits alone and next to others (one task per block of its
    own queries), and other operands keep XLA's path."""
    rng = np.random.default_rng([SEED, 8])
    q, k, v, table, lens, starts = _case(rng, 6, 2, 64, [90, 40, 0, 130], [90, 5, 0, 64], extra_tokens=0)
    attend = jax.jit(lambda *a: dispatch.ragged_attention("xla", *a))
    together = np.asarray(attend(q, k, v, table, lens, starts))
    for row in (0, 1, 3):
        first, last = int(starts[row]), int(starts[row + 1])
        alone = np.asarray(attend(q[first:last], k, v, table[row:row + 1], lens[row:row + 1],
                                  jnp.asarray([0, last - first], jnp.int32)))
        assert np.array_equal(alone, together[first:last]), f"seed {SEED}, sequence {row}"
    assert not cpu_kernels.takes_prefill_attention(q, {"pages": k.astype(jnp.int8), "scales": k[..., :1]}, v)
    assert not cpu_kernels.takes_prefill_attention(q.astype(jnp.bfloat16), k, v)


def test_prefill_attention_refuses_pages_outside_the_cache():
    """A block table entry past the cache (or a length past the table) is an error of the call,
    not a read outside the buffers."""
    q = jnp.zeros((3, 2, 16), jnp.float32)
    k = jnp.zeros((4, 8, 1, 16), jnp.float32)
    starts = jnp.asarray([0, 3], jnp.int32)
    attend = jax.jit(lambda *a: dispatch.ragged_attention("xla", *a))
    with pytest.raises(Exception, match="outside the cache"):
        np.asarray(attend(q, k, k, jnp.asarray([[1, 4]], jnp.int32), jnp.asarray([9], jnp.int32), starts))
    with pytest.raises(Exception, match="exceeds its block table"):
        np.asarray(attend(q, k, k, jnp.asarray([[1, 2]], jnp.int32), jnp.asarray([17], jnp.int32), starts))
    assert np.asarray(attend(q, k, k, jnp.asarray([[1, 4]], jnp.int32), jnp.asarray([8], jnp.int32), starts)).shape \
        == (3, 2, 16)

"""The Mosaic GPU attention kernels (pallas_kernels.mosaic_decode, mosaic_ragged) in Mosaic GPU's
interpreter, against the float64 oracle of tests/test_kernels.py on the same random problems
(permuted block tables, lengths around page boundaries, NaN in every slot no sequence owns and
before each window, padding rows), with the interpreter's race detector on; whole tiny models'
greedy tokens through the engine; and the kernels compiled for sm_90a without a GPU (ptxas's
registers and spills).

The interpreter is in jax >= 0.11: this file runs in the environment shaped like the lent GPU
machine (.venv-gpu-rehearsal, Python 3.12, jax 0.11.2: `make test-gpu-rehearsal`) and skips on
the older jax of the main test environment.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import compat

if not compat.has_mosaic_gpu():
    pytest.skip(f"Mosaic GPU's interpreter needs jax >= 0.11 (this is {jax.__version__}); these tests run in "
                ".venv-gpu-rehearsal (make test-gpu-rehearsal)", allow_module_level=True)

from pallas_kernels import dispatch, kv_quant, mosaic_common, mosaic_decode, mosaic_ragged  # noqa: E402
from tests.test_kernels import (  # noqa: E402
    CASES, SEED, SOFT_CAP_OPTIONS, WINDOWS, Case, Options, case_id, context_lengths, decode_problem,
    jitted, oracle, ragged_problem,
)

TOLERANCE = {jnp.bfloat16: 2e-2, jnp.float16: 1e-2}
# The Triton kernels' cases in 16-bit (the Mosaic kernels take bfloat16 and float16 pages only),
# then the head layouts of the models jaxserve serves: SmolLM2 (9 query heads over 3 KV heads,
# head_dim 64), Llama-3 / Mistral (group 4, 128), Qwen2.5-7B (group 7, 128), Gemma-2 (group 2,
# head_dim 256), in float16 a group of 8.
MOSAIC_CASES = [dataclasses.replace(case, dtype=jnp.bfloat16, tiles={}) for case in CASES] + [
    Case(16, 64, 3, 3, jnp.bfloat16, {}),
    Case(16, 128, 4, 2, jnp.bfloat16, {}),
    Case(16, 128, 7, 1, jnp.bfloat16, {}),
    Case(16, 256, 2, 1, jnp.bfloat16, {}),
    Case(8, 64, 8, 1, jnp.float16, {}),
]


@pytest.fixture(autouse=True)
def no_races():
    """Every test here ends with the interpreter's race detector silent."""
    yield
    assert not compat.mosaic_races_found(), "Mosaic GPU's interpreter reported a data race (see RACE DETECTED above)"


def close(out, expected, case, label):
    """Finite, and within the 16-bit tolerance of the oracle relative to its largest value."""
    actual = np.asarray(out, np.float64)
    assert np.isfinite(actual).all(), f"{label}: non-finite output (seed {SEED})"
    error = np.abs(actual - expected).max() / np.abs(expected).max()
    assert error < TOLERANCE[case.dtype], f"{label}: relative error {error:.2e} (seed {SEED})"


def check_decode(case, rng, options=Options(), num_splits=None, label="mosaic decode"):
    args, (k_pages, v_pages, block_table), seq_lens = decode_problem(case, rng, options.window)
    q = np.asarray(args[0])
    expected = oracle(q[:, None], k_pages, v_pages, block_table, seq_lens, (seq_lens > 0).astype(int),
                      **options.oracle())[:, 0]
    function = jitted(mosaic_decode.paged_decode_attention, options, interpret=True, num_splits=num_splits)
    out = function(*args, window=options.operand())
    assert out.shape == q.shape and out.dtype == q.dtype
    close(out, expected, case, f"{label} {case_id(case)} {options} splits={num_splits}")
    assert np.all(np.asarray(out, np.float32)[seq_lens == 0] == 0), f"padding row not zero (seed {SEED})"


def check_ragged(case, rng, options=Options(), label="mosaic ragged"):
    args, expected_of = ragged_problem(case, rng, options.window)
    q, query_start_loc = np.asarray(args[0]), np.asarray(args[5])
    out = jitted(mosaic_ragged.ragged_paged_attention, options, interpret=True)(*args, window=options.operand())
    assert out.shape == q.shape and out.dtype == q.dtype
    close(out, expected_of(options), case, f"{label} {case_id(case)} {options}")
    assert np.all(np.asarray(out, np.float32)[query_start_loc[-1]:] == 0), f"padding tokens not zero (seed {SEED})"


@pytest.mark.parametrize("case", MOSAIC_CASES, ids=case_id)
def test_mosaic_decode_matches_oracle(case):
    """Default splits, then 3 splits (several programs per sequence, their partials merged)."""
    rng = np.random.default_rng([SEED, MOSAIC_CASES.index(case), 10])
    check_decode(case, rng)
    check_decode(case, rng, num_splits=3)


@pytest.mark.parametrize("case", MOSAIC_CASES, ids=case_id)
def test_mosaic_ragged_matches_oracle(case):
    check_ragged(case, np.random.default_rng([SEED, MOSAIC_CASES.index(case), 11]))


@pytest.mark.parametrize("kind", WINDOWS)
def test_mosaic_sliding_window_matches_oracle(kind):
    """The Triton kernels' window kinds (one key, a few pages, exactly the longest sequence, longer
    than every sequence, the no-window sentinel) on their cases in bfloat16."""
    case, window_of = WINDOWS[kind]
    case = dataclasses.replace(case, dtype=jnp.bfloat16, tiles={})
    numbers = [SEED, 12, list(WINDOWS).index(kind)]
    window = window_of(case.page_size, int(context_lengths(case.page_size, np.random.default_rng(numbers)).max()))
    check_decode(case, np.random.default_rng(numbers), Options(window=window), num_splits=2)
    check_ragged(case, np.random.default_rng(numbers), Options(window=window))


@pytest.mark.parametrize("options", SOFT_CAP_OPTIONS, ids=str)
def test_mosaic_soft_cap_and_scale_match_oracle(options):
    case = Case(8, 128, 4, 2, jnp.bfloat16, {})
    numbers = [SEED, 13, SOFT_CAP_OPTIONS.index(options)]
    check_decode(case, np.random.default_rng(numbers), options)
    check_ragged(case, np.random.default_rng(numbers), options)


def test_mosaic_results_do_not_depend_on_the_block_table_order():
    """The same contexts through two different permutations of the free pages give the same output
    bit for bit: the kernel reads pages only through the table."""
    case = Case(16, 64, 4, 2, jnp.bfloat16, {})
    outputs = []
    for salt in (0, 1):
        rng = np.random.default_rng([SEED, 14])
        seq_lens = context_lengths(case.page_size, rng)
        contexts = rng.standard_normal((2, len(seq_lens), int(seq_lens.max()), case.num_kv_heads, case.head_dim))
        q = jnp.asarray(rng.standard_normal((len(seq_lens), case.group * case.num_kv_heads, case.head_dim)),
                        jnp.bfloat16)
        pages_needed = [-(-int(n) // case.page_size) for n in seq_lens]
        num_pages = sum(pages_needed) + 2
        order = 1 + np.random.default_rng([SEED, 15, salt]).permutation(num_pages - 1)
        k_pages = np.zeros((num_pages, case.page_size, case.num_kv_heads, case.head_dim))
        v_pages = np.zeros_like(k_pages)
        block_table = np.zeros((len(seq_lens), max(pages_needed) + 1), np.int32)
        for row, (length, count) in enumerate(zip(seq_lens, pages_needed)):
            block_table[row, :count], order = order[:count], order[count:]
            for position in range(int(length)):
                page, offset = block_table[row, position // case.page_size], position % case.page_size
                k_pages[page, offset], v_pages[page, offset] = contexts[0, row, position], contexts[1, row, position]
        outputs.append(np.asarray(mosaic_decode.paged_decode_attention(
            q, jnp.asarray(k_pages, jnp.bfloat16), jnp.asarray(v_pages, jnp.bfloat16), jnp.asarray(block_table),
            jnp.asarray(seq_lens), interpret=True), np.float32))
    np.testing.assert_array_equal(outputs[0], outputs[1])


@pytest.mark.parametrize("pages, dtype, head_dim, page_size, reason", [
    ("float", jnp.float32, 64, 16, "float16 or bfloat16"),
    ("int8", jnp.bfloat16, 64, 16, "int8 pages"),
    ("fp8", jnp.bfloat16, 64, 16, "fp8 pages"),
    ("float", jnp.bfloat16, 96, 16, "head_dim 96"),
    ("float", jnp.bfloat16, 64, 128, "page_size 128"),
])
def test_mosaic_kernels_refuse_what_they_do_not_take(pages, dtype, head_dim, page_size, reason):
    """A clear ValueError (and the same reason from dispatch.unsupported_operands, which the
    engine asks before it builds a step), never a wrong answer or a lowering crash."""
    q = jnp.zeros((2, 4, head_dim), dtype)
    shape = (4, page_size, 2, head_dim)
    cache = {"float": lambda: jnp.zeros(shape, dtype), "int8": lambda: kv_quant.zeros(shape, jnp.int8),
             "fp8": lambda: kv_quant.zeros(shape, kv_quant.FP8)}[pages]()
    assert reason in dispatch.unsupported_operands("mosaic", q, cache)
    assert dispatch.unsupported_operands("pallas", q, cache) is None
    table, lens = jnp.ones((2, 2), jnp.int32), jnp.array([3, 1], jnp.int32)
    with pytest.raises(ValueError, match=reason):
        mosaic_decode.paged_decode_attention(q, cache, cache, table, lens, interpret=True)
    with pytest.raises(ValueError, match=reason):
        mosaic_ragged.ragged_paged_attention(q, cache, cache, table, lens, jnp.array([0, 1, 2], jnp.int32),
                                             interpret=True)


def test_dispatch_names_both_kernel_families():
    """"triton" is the Pallas Triton backend by its other name; "mosaic" and "mosaic_interpret"
    route decode and ragged attention to the Mosaic kernels (same answers as the oracle above)."""
    assert dispatch.attention_backend("Triton") == "pallas"
    assert dispatch.attention_backend("mosaic") == "mosaic"
    case = Case(16, 64, 2, 2, jnp.bfloat16, {})
    args, (k_pages, v_pages, block_table), seq_lens = decode_problem(case, np.random.default_rng([SEED, 16]))
    direct = mosaic_decode.paged_decode_attention(*args, interpret=True)
    np.testing.assert_array_equal(np.asarray(dispatch.decode_attention("mosaic_interpret", *args), np.float32),
                                  np.asarray(direct, np.float32))

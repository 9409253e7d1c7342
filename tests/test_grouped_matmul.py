"""The Pallas grouped-matmul kernel (interpret mode on the CPU) and the CPU's XLA loop over the
same work items (pallas_kernels.xla_grouped) against jax.lax.ragged_dot.

Inputs are seeded random draws (SEED and the case's own numbers); group-size patterns cover empty
groups, one group owning every row, boundaries in the middle of a tile, several groups inside
one tile, row counts that are not a multiple of the tile, and sizes that sum to less than the
rows (the rest must come out exactly zero). The matrices of empty groups hold NaN where a test
shows that no path reads them. The schedule of (tile, group) work items is checked
on its own: every owned row is stored by exactly one item, and the items fit the grid.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import environment
from jaxserve.models import moe
from pallas_kernels import dispatch, xla_grouped
from pallas_kernels import grouped_matmul as gmm

pytestmark = pytest.mark.slow  # the Pallas kernel in interpret mode: out of `make test-quick`

SEED = 20261202
INTERPRET = jax.default_backend() != "gpu"  # on a GPU the kernel runs compiled
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}  # relative to the output's scale
# A float32 dot at default precision: exact to float32 on the CPU; TF32 (a 10-bit mantissa) on a GPU.
DEFAULT_PRECISION_ATOL = 1e-4 if jax.default_backend() == "cpu" else 5e-3

# (name, group sizes, rows M, K, N, blocks or {} for the defaults)
CASES = [
    ("empty-groups-mid-tile", [0, 5, 0, 0, 13, 1, 0], 19, 32, 48, dict(block_m=16, block_n=16)),
    ("one-group-has-all", [0, 0, 40, 0], 40, 64, 32, dict(block_m=16)),
    ("sum-below-rows", [7, 0, 9], 37, 16, 64, dict(block_m=16, block_k=16)),
    ("many-groups-per-tile", [1, 2, 0, 3, 1, 1, 4, 2, 0, 1, 2, 3], 20, 32, 32, dict(block_m=16)),
    ("decode-two-rows", [0, 1, 0, 0, 0, 1, 0, 0], 2, 64, 128, {}),
    ("prefill-default-tiles", [70, 0, 3, 61, 1, 0, 65], 200, 128, 256, {}),
]
DTYPES = [jnp.float32, jnp.bfloat16]
BF16_CASES = {"many-groups-per-tile", "decode-two-rows", "prefill-default-tiles"}  # bf16: fewer, for time
PAIRS = [(case, dtype) for case in CASES for dtype in DTYPES if dtype == jnp.float32 or case[0] in BF16_CASES]


def draw(case, dtype, seed):
    _, sizes, rows, k, n, _ = case
    rng = np.random.default_rng([SEED, seed])
    lhs = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32)


def expected(lhs, rhs, group_sizes):
    """ragged_dot in float32 at full precision on the (already rounded) inputs."""
    return np.asarray(jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), group_sizes,
                                         precision=jax.lax.Precision.HIGHEST))


@pytest.mark.parametrize("case,dtype", PAIRS, ids=[f"{c[0]}-{jnp.dtype(d).name}" for c, d in PAIRS])
def test_kernel_matches_ragged_dot(case, dtype):
    seed = CASES.index(case) * 10 + DTYPES.index(dtype)
    lhs, rhs, group_sizes = draw(case, dtype, seed)
    out = gmm.grouped_matmul(lhs, rhs, group_sizes, interpret=INTERPRET, **case[5])
    assert out.shape == (lhs.shape[0], rhs.shape[2]) and out.dtype == lhs.dtype
    want = expected(lhs, rhs, group_sizes)
    got = np.asarray(out.astype(jnp.float32))
    owned = int(np.sum(case[1]))
    assert np.all(got[owned:] == 0), f"rows past the groups must be zero (seed {seed})"
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE[dtype] * scale, err_msg=f"seed {seed}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_xla_loop_matches_ragged_dot(case, dtype):
    seed = 100 + CASES.index(case) * 10 + DTYPES.index(dtype)
    lhs, rhs, group_sizes = draw(case, dtype, seed)
    out = jax.jit(xla_grouped.grouped_matmul, static_argnames="block_m")(
        lhs, rhs, group_sizes, block_m=case[5].get("block_m"))
    assert out.shape == (lhs.shape[0], rhs.shape[2]) and out.dtype == lhs.dtype
    want = expected(lhs, rhs, group_sizes)
    got = np.asarray(out.astype(jnp.float32))
    assert np.all(got[int(np.sum(case[1])):] == 0), f"rows past the groups must be zero (seed {seed})"
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE[dtype] * scale, err_msg=f"seed {seed}")


@pytest.mark.parametrize("path", ["kernel", "xla-loop"])
def test_the_matrices_of_empty_groups_are_never_read(path):
    """A decode step reads only the experts it routes to: NaN in every other expert's matrix stays out."""
    case = CASES[0]  # groups 0, 2, 3 and 6 are empty
    lhs, rhs, group_sizes = draw(case, jnp.float32, 60)
    empty = np.asarray(case[1]) == 0
    poisoned = jnp.where(jnp.asarray(empty)[:, None, None], jnp.nan, rhs)
    if path == "kernel":
        out = gmm.grouped_matmul(lhs, poisoned, group_sizes, interpret=INTERPRET, **case[5])
    else:
        out = jax.jit(xla_grouped.grouped_matmul)(lhs, poisoned, group_sizes)
    np.testing.assert_allclose(np.asarray(out), expected(lhs, rhs, group_sizes), rtol=0, atol=1e-5)


@pytest.mark.parametrize("items_last_first", [False, True], ids=["items-in-order", "items-last-first"])
def test_no_work_item_stores_rows_of_another(items_last_first):
    """Tiles crossed by many group boundaries, the items run first-to-last and last-to-first: a
    program storing one row too many on either side overwrites a row already stored by another."""
    case = ("boundaries", [1, 2, 0, 3, 1, 1, 4, 2, 0, 1, 2, 3, 7], 30, 16, 16, dict(block_m=16))
    lhs, rhs, group_sizes = draw(case, jnp.float32, 50 + items_last_first)
    out = gmm.grouped_matmul(lhs, rhs, group_sizes, interpret=INTERPRET, items_last_first=items_last_first,
                             **case[5])
    np.testing.assert_allclose(np.asarray(out), expected(lhs, rhs, group_sizes), rtol=0, atol=1e-5)


def test_float32_output_of_bfloat16_inputs():
    lhs, rhs, group_sizes = draw(CASES[0], jnp.bfloat16, 99)
    out = gmm.grouped_matmul(lhs, rhs, group_sizes, preferred_element_type=jnp.float32, interpret=INTERPRET,
                             block_m=16, block_n=16)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), expected(lhs, rhs, group_sizes), rtol=0, atol=1e-5)


@pytest.mark.parametrize("block_m", [16, 64])
def test_work_items_store_every_owned_row_once(block_m):
    rng = np.random.default_rng([SEED, block_m])
    num_groups, rows = 12, 300  # fixed shapes: one compile of the schedule
    num_items = -(-rows // block_m) + num_groups - 1
    schedule = jax.jit(gmm.work_items, static_argnums=(1, 2, 3))
    for trial in range(20):
        sizes = rng.integers(0, 25, num_groups) * (rng.random(num_groups) < 0.6)  # sum <= 288 < rows
        group, tile, start, end = map(np.asarray, schedule(jnp.asarray(sizes, jnp.int32), rows, block_m, num_items))
        owner = np.full(rows, -1)
        for g, t, s, e in zip(group, tile, start, end):
            if e <= s:
                continue
            assert t * block_m <= s < e <= (t + 1) * block_m, (trial, g, t, s, e)
            assert np.all(owner[s:e] == -1), f"rows {s}:{e} stored twice (trial {trial})"
            owner[s:e] = g
        want = np.concatenate([np.repeat(np.arange(num_groups), sizes), np.full(rows - sizes.sum(), -1)])
        np.testing.assert_array_equal(owner, want, err_msg=f"trial {trial}: {sizes.tolist()}")


def test_operands_the_kernel_does_not_take_are_refused_and_dispatch_falls_back():
    lhs = jnp.ones((8, 24), jnp.float32)  # K = 24: not a multiple of 16
    rhs = jnp.ones((2, 24, 32), jnp.float32)
    sizes = jnp.asarray([3, 5], jnp.int32)
    assert not gmm.supports(lhs, rhs)
    with pytest.raises(ValueError, match="multiples of 16"):
        gmm.grouped_matmul(lhs, rhs, sizes, interpret=True)
    np.testing.assert_allclose(dispatch.grouped_matmul(lhs, rhs, sizes, backend="interpret"),
                               jax.lax.ragged_dot(lhs, rhs, sizes), rtol=1e-6)


def test_backend_choice(monkeypatch):
    monkeypatch.delenv(environment.GROUPED_MATMUL_BACKEND, raising=False)
    assert environment.grouped_matmul_backend() is None
    assert dispatch.grouped_matmul_backend() == "xla"  # not measured better on a GPU yet: XLA by default
    monkeypatch.setenv(environment.GROUPED_MATMUL_BACKEND, " Pallas ")
    assert dispatch.grouped_matmul_backend(environment.grouped_matmul_backend()) == "pallas"
    assert dispatch.grouped_matmul_backend("interpret") == "interpret"
    assert dispatch.grouped_matmul_backend("RAGGED_DOT") == "ragged_dot"
    monkeypatch.setenv(environment.GROUPED_MATMUL_BACKEND, "triton")
    with pytest.raises(ValueError, match="unknown grouped matmul backend 'triton'"):
        dispatch.grouped_matmul_backend(environment.grouped_matmul_backend())


def test_saved_executables_follow_the_backend_choice(monkeypatch):
    from jaxserve.executor import executables

    monkeypatch.delenv(environment.GROUPED_MATMUL_BACKEND, raising=False)
    default = executables.environment()["grouped_matmul"]
    monkeypatch.setenv(environment.GROUPED_MATMUL_BACKEND, "pallas")
    assert (default, executables.environment()["grouped_matmul"]) == ("xla", "pallas")


def test_pallas_backend_is_the_kernel_on_a_gpu_and_the_xla_path_elsewhere():
    lhs, rhs, group_sizes = draw(CASES[0], jnp.float32, 7)
    got = np.asarray(jax.jit(lambda *a: dispatch.grouped_matmul(*a, backend="pallas"))(lhs, rhs, group_sizes))
    if INTERPRET:  # not a GPU: the program is the "xla" backend's, bit for bit
        xla = jax.jit(lambda *a: dispatch.grouped_matmul(*a, backend="xla"))(lhs, rhs, group_sizes)
        np.testing.assert_array_equal(got, np.asarray(xla))
    np.testing.assert_allclose(got, expected(lhs, rhs, group_sizes), rtol=0, atol=1e-5)


def test_on_the_cpu_the_xla_backend_is_the_loop_and_ragged_dot_stays_selectable():
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU's lowering")
    lhs, rhs, group_sizes = draw(CASES[0], jnp.float32, 8)
    texts = {b: jax.jit(lambda *a, b=b: dispatch.grouped_matmul(*a, backend=b)).lower(lhs, rhs, group_sizes)
             .compile().as_text() for b in ("xla", "ragged_dot")}
    assert " while(" in texts["xla"] and " while(" not in texts["ragged_dot"]


def test_routed_experts_through_the_interpreted_kernel(monkeypatch):
    """moe.routed_experts with the kernel or the CPU loop gives ragged_dot's mixture (top-2 of 8)."""
    rng = np.random.default_rng([SEED, 8])
    tokens, dim, ffn, num_experts = 5, 32, 48, 8
    h = jnp.asarray(rng.standard_normal((tokens, dim)), jnp.float32)
    weights, experts = moe.route(jnp.asarray(rng.standard_normal((tokens, num_experts)), jnp.float32), 2, True)
    w_gate, w_up = (jnp.asarray(rng.standard_normal((num_experts, dim, ffn)) / 6, jnp.float32) for _ in range(2))
    w_down = jnp.asarray(rng.standard_normal((num_experts, ffn, dim)) / 7, jnp.float32)
    monkeypatch.setenv(environment.GROUPED_MATMUL_BACKEND, "ragged_dot")
    want = moe.routed_experts(h, weights, experts, w_gate, w_up, w_down)
    for backend in ("xla", "interpret"):
        monkeypatch.setenv(environment.GROUPED_MATMUL_BACKEND, backend)
        got = moe.routed_experts(h, weights, experts, w_gate, w_up, w_down)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=DEFAULT_PRECISION_ATOL,
                                   err_msg=backend)

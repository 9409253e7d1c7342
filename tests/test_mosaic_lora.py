"""The Mosaic GPU multi-LoRA kernel (pallas_kernels/mosaic_lora.py) in Mosaic GPU's interpreter
(race detection on), against the plain-jnp reference on seeded random inputs: decode and prefill
row counts (one row, a partial block of 64, several blocks, a block of base rows only), ranks 16 to
128, odd and even numbers of K blocks, bfloat16 and float16, slot 0 in every case; a stacked
[L, S, ...] slab read at a layer index, directly and through pallas_kernels.dispatch's
"mosaic_interpret" backend; what the kernel refuses and dispatch's fallback for it; the "mosaic"
backend's choice of the kernel for CUDA. On a GPU the kernel runs compiled instead.

The interpreter is in jax >= 0.11: this file runs in the environment shaped like the lent GPU
machine (.venv-gpu-rehearsal, jax 0.11.2) and skips on the older jax of the main test environment.
The kernel compiled for sm_90a: tests/test_mosaic_kernels.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import compat

if not compat.has_mosaic_gpu():
    pytest.skip(f"Mosaic GPU's interpreter needs jax >= 0.11 (this is {jax.__version__}); these tests run in "
                ".venv-gpu-rehearsal", allow_module_level=True)

from jaxserve import compat as jaxserve_compat  # noqa: E402
from pallas_kernels import dispatch, mosaic_lora, reference  # noqa: E402

pytestmark = pytest.mark.slow  # the kernel in Mosaic GPU's interpreter: out of `make test-quick`

SEED = 20261206
INTERPRET = jax.default_backend() != "gpu"  # on a GPU the kernel runs compiled
MOSAIC_BACKEND = "mosaic_interpret" if INTERPRET else "mosaic"
TOLERANCE = {jnp.bfloat16: 2e-2, jnp.float16: 1e-2}  # relative to the largest output: the shrunk row is rounded

CASES = [  # (name, rows T, K, rank R, N, slots S, dtype)
    ("decode-smollm2-k", 32, 576, 16, 192, 5, jnp.bfloat16),  # 9 K blocks, 3 column blocks
    ("one-row", 1, 64, 16, 64, 2, jnp.bfloat16),
    ("prefill-3-blocks", 150, 320, 32, 128, 4, jnp.float16),  # the middle block all base rows
    ("rank-64", 9, 128, 64, 256, 3, jnp.bfloat16),
    ("rank-128", 64, 1024, 128, 128, 3, jnp.float16),
]


@pytest.fixture(autouse=True)
def no_races():
    """Every test here ends with the interpreter's race detector silent."""
    yield
    if INTERPRET:
        assert not compat.mosaic_races_found(), "Mosaic GPU's interpreter reported a data race (see RACE DETECTED)"


def draw(case, seed, layers=None):
    """x [T, K], a [(L,) S, K, R], b [(L,) S, R, N] (slot 0 zeros), slots int32 [T] with row 0 a
    base row and, past 128 rows, rows 64-127 all base rows."""
    _, rows, k, rank, n, slots, dtype = case
    rng = np.random.default_rng([SEED, seed])
    stack = () if layers is None else (layers,)
    x = rng.standard_normal((rows, k))
    a = rng.standard_normal(stack + (slots, k, rank)) / np.sqrt(k)
    b = rng.standard_normal(stack + (slots, rank, n)) / np.sqrt(rank)
    a[..., 0, :, :], b[..., 0, :, :] = 0.0, 0.0  # slot 0: the zero adapter
    ids = rng.integers(0, slots, rows).astype(np.int32)
    ids[0] = 0
    if rows > 128:
        ids[64:128] = 0
    return jnp.asarray(x, dtype), jnp.asarray(a, dtype), jnp.asarray(b, dtype), jnp.asarray(ids)


def expected(x, a, b, ids):
    return np.asarray(reference.lora_update(*(t.astype(jnp.float32) for t in (x, a, b)), ids))


def check(out, x, b, ids, want, dtype, label):
    assert out.shape == (x.shape[0], b.shape[-1]) and out.dtype == x.dtype, label
    got = np.asarray(out, np.float32)
    assert np.isfinite(got).all(), f"{label}: non-finite output"
    assert not got[np.asarray(ids) == 0].any(), f"{label}: base rows (slot 0) must be exactly zero"
    error = np.abs(got - want).max() / max(1.0, np.abs(want).max())
    assert error < TOLERANCE[dtype], f"{label}: relative error {error:.2e}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_kernel_matches_the_reference(case):
    seed = CASES.index(case)
    x, a, b, ids = draw(case, seed)
    assert mosaic_lora.supports(x, a, b)
    out = mosaic_lora.lora_update(x, a, b, ids, interpret=INTERPRET)
    check(out, x, b, ids, expected(x, a, b, ids), case[-1], f"{case[0]} (seed [{SEED}, {seed}])")


def test_smaller_blocks_give_the_same_answer():
    """block_k 32 (an odd count of K blocks: the buffers alternate unevenly across slots) and
    block_n 64 on the decode case."""
    case = CASES[0]
    x, a, b, ids = draw(case, 10)
    out = mosaic_lora.lora_update(x, a, b, ids, interpret=INTERPRET, block_k=32, block_n=64)
    check(out, x, b, ids, expected(x, a, b, ids), case[-1], f"block_k=32 block_n=64 (seed [{SEED}, 10])")


def test_a_stacked_slab_at_a_layer_index():
    """a [L, S, K, R], b [L, S, R, N] and a traced layer: the kernel reads that layer's matrices (the
    reference is handed the slices), and dispatch's Mosaic backend gives the kernel's result."""
    case = ("stacked", 70, 192, 16, 64, 3, jnp.bfloat16)
    x, a, b, ids = draw(case, 20, layers=3)
    for layer in (0, 2):
        label = f"layer {layer} (seed [{SEED}, 20])"
        want = expected(x, a[layer], b[layer], ids)
        direct = jax.jit(lambda *args: mosaic_lora.lora_update(*args, interpret=INTERPRET))(
            x, a, b, ids, jnp.int32(layer))
        check(direct, x, b, ids, want, jnp.bfloat16, label)
        routed = jax.jit(lambda *args: dispatch.lora_update(MOSAIC_BACKEND, *args))(x, a, b, ids, jnp.int32(layer))
        np.testing.assert_array_equal(np.asarray(routed, np.float32), np.asarray(direct, np.float32), err_msg=label)


@pytest.mark.parametrize("what, dtypes, rank, k", [
    ("float32", (jnp.float32,) * 3, 16, 64),
    ("rank 8", (jnp.bfloat16,) * 3, 8, 64),
    ("rank 12", (jnp.bfloat16,) * 3, 12, 64),
    ("rank 256", (jnp.bfloat16,) * 3, 256, 64),
    ("mixed dtypes", (jnp.bfloat16, jnp.float16, jnp.bfloat16), 16, 64),
    ("K 96 at rank 64", (jnp.bfloat16,) * 3, 64, 96),
])
def test_refused_operands_raise_and_dispatch_falls_back(what, dtypes, rank, k):
    """supports() is false, the kernel raises a ValueError (never a wrong answer), and the Mosaic
    backends give the reference's result through the other paths."""
    rng = np.random.default_rng([SEED, 30])
    x = jnp.asarray(rng.standard_normal((5, k)), dtypes[0])
    a = jnp.asarray(rng.standard_normal((3, k, rank)) / np.sqrt(k), dtypes[1]).at[0].set(0)
    b = jnp.asarray(rng.standard_normal((3, rank, 64)) / np.sqrt(rank), dtypes[2]).at[0].set(0)
    ids = jnp.asarray([0, 1, 2, 1, 0], jnp.int32)
    assert not mosaic_lora.supports(x, a, b), what
    with pytest.raises(ValueError, match="Mosaic LoRA kernel takes"):
        mosaic_lora.lora_update(x, a, b, ids, interpret=INTERPRET)
    want = np.asarray(reference.lora_update(x, a, b, ids).astype(jnp.float32))
    for backend in ("mosaic_interpret", "mosaic"):
        got = np.asarray(jax.jit(lambda *args, backend=backend: dispatch.lora_update(backend, *args))(x, a, b, ids))
        np.testing.assert_allclose(got.astype(np.float32), want, rtol=0, atol=2e-2 * max(1.0, np.abs(want).max()),
                                   err_msg=f"{what}, {backend} (seed [{SEED}, 30])")


def test_the_mosaic_backend_puts_the_mosaic_kernel_in_a_cuda_program():
    """Lowered for CUDA (jax.export, no GPU needed): "mosaic" runs the Mosaic GPU kernel where it
    takes the operands and the Triton kernel for float32 ones; "pallas" keeps the Triton kernel."""
    def lowered(backend, dtype):
        specs = [jax.ShapeDtypeStruct(s, d) for s, d in (((32, 576), dtype), ((5, 576, 16), dtype),
                                                         ((5, 16, 192), dtype), ((32,), jnp.int32))]
        return jaxserve_compat.lower_for_cuda(lambda *args: dispatch.lora_update(backend, *args), *specs)

    mosaic = lowered("mosaic", jnp.bfloat16)
    assert "mosaic_gpu" in mosaic and "lora_bgmv_mosaic" in mosaic and "triton" not in mosaic
    if compat.has_pallas_triton():
        assert "lora_bgmv" in lowered("mosaic", jnp.float32) and "mosaic_gpu" not in lowered("mosaic", jnp.float32)
        pallas = lowered("pallas", jnp.bfloat16)
        assert "lora_bgmv" in pallas and "mosaic_gpu" not in pallas

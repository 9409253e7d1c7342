"""The multi-LoRA update's XLA path (pallas_kernels/xla_lora.py) and Pallas kernel
(pallas_kernels/lora_bgmv.py; interpret mode off a GPU, compiled on one) against the plain-jnp
reference, on seeded random inputs: decode and prefill row counts, ranks 8 to 64, a base row (slot 0)
in every case, float32 and bfloat16; dispatch's fallback and its choice of the kernel for CUDA.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import compat
from pallas_kernels import dispatch, lora_bgmv, reference, xla_lora

pytestmark = pytest.mark.slow  # the Pallas kernel in interpret mode: out of `make test-quick`

SEED = 20261205
INTERPRET = jax.default_backend() != "gpu"  # on a GPU the kernel runs compiled

KERNEL_CASES = [  # (name, rows T, K, rank R, N, slots S)
    ("decode-smollm2-k", 32, 576, 16, 192, 5),
    ("one-row", 1, 96, 8, 48, 3),
    ("prefill-down", 40, 1536, 16, 576, 4),
    ("rank-64", 9, 128, 64, 256, 2),
]


def draw(case, dtype, seed):
    _, rows, k, rank, n, slots = case
    rng = np.random.default_rng([SEED, seed])
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    a = rng.standard_normal((slots, k, rank)) / np.sqrt(k)
    b = rng.standard_normal((slots, rank, n)) / np.sqrt(rank)
    a[0], b[0] = 0.0, 0.0  # slot 0: the zero adapter
    ids = rng.integers(0, slots, rows).astype(np.int32)
    ids[0] = 0  # a base row in every case (one-row: only that)
    return x, jnp.asarray(a, dtype), jnp.asarray(b, dtype), jnp.asarray(ids)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("path", ["xla", "kernel"])
def test_update_matches_the_reference(case, dtype, path):
    seed = KERNEL_CASES.index(case) * 10 + (dtype == jnp.bfloat16)
    x, a, b, ids = draw(case, dtype, seed)
    if path == "xla":
        out = jax.jit(xla_lora.lora_update)(x, a, b, ids)
    else:
        out = lora_bgmv.lora_update(x, a, b, ids, interpret=INTERPRET)
    assert out.shape == (x.shape[0], b.shape[2]) and out.dtype == x.dtype
    got = np.asarray(out.astype(jnp.float32))
    want = np.asarray(jax.jit(reference.lora_update)(*(t.astype(jnp.float32) for t in (x, a, b)), ids))
    base_rows = np.asarray(ids) == 0
    assert not got[base_rows].any(), f"base rows must be exactly zero (seed {seed})"
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2  # bfloat16: the shrunk row is rounded to it
    np.testing.assert_allclose(got, want, rtol=0, atol=tolerance * max(1.0, np.abs(want).max()), err_msg=f"seed {seed}")


def test_dispatch_falls_back_to_xla_for_what_the_kernel_does_not_take():
    x, a, b, ids = draw(("odd-rank", 6, 48, 16, 32, 3), jnp.float32, 99)
    a, b = a[:, :, :12], b[:, :12]  # rank 12: not a power of two
    assert not lora_bgmv.supports(x, a, b)
    want = np.asarray(reference.lora_update(x, a, b, ids))
    for backend in ("interpret", "pallas", "xla"):
        got = np.asarray(jax.jit(lambda *args, backend=backend: dispatch.lora_update(backend, *args))(x, a, b, ids))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=f"{backend}, seed 99")


def test_the_pallas_backend_puts_the_kernel_in_a_cuda_program():
    """Lowered for CUDA (jax.export, no GPU needed), the "pallas" backend's update is the Triton
    kernel and the "xla" backend's is not."""
    specs = [jax.ShapeDtypeStruct(s, d) for s, d in (((32, 576), jnp.bfloat16), ((5, 576, 16), jnp.bfloat16),
                                                     ((5, 16, 192), jnp.bfloat16), ((32,), jnp.int32))]
    texts = {backend: compat.lower_for_cuda(lambda *args, backend=backend: dispatch.lora_update(backend, *args), *specs)
             for backend in ("xla", "pallas")}
    kernels = {backend: [t for t in compat.PALLAS_GPU_CUSTOM_CALL_TARGETS if f"@{t}(" in text]
               for backend, text in texts.items()}
    assert kernels["pallas"] and "lora_bgmv" in texts["pallas"], "no Pallas kernel in the lowered module"
    assert not kernels["xla"]

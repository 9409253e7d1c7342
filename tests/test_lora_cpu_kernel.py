"""The multi-LoRA update's C++ CPU kernel (cpu_kernels/lora_update.cc) against the plain-jnp
reference (pallas_kernels.reference.lora_update) on seeded random inputs: ranks 8 to 64 (and
ranks that are not a multiple of 16), mixes of slots (every slot, one, none, slots left empty
between used ones), padding rows on slot 0, a stacked slab read at a layer index; dispatch's
choice of it for the CPU and its fallback to XLA's form where the kernel is not built or does
not take the operands. Set JAXSERVE_TEST_SEED to draw other inputs.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
from pallas_kernels import dispatch, reference

SEED = int(os.environ.get("JAXSERVE_TEST_SEED", "20261205"))

pytestmark = pytest.mark.slow  # builds the CPU kernels: out of `make test-quick`
needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="no AVX-512 VNNI CPU or no C++ compiler")

CASES = [  # (name, rows T, K, rank R, N, slots S, slot mix)
    ("smollm2-q", 32, 576, 16, 576, 5, "cycle"),
    ("smollm2-down", 32, 1536, 16, 576, 5, "random"),
    ("rank-8-one-row", 1, 96, 8, 48, 3, "random"),
    ("rank-12-odd-sizes", 7, 100, 12, 70, 3, "random"),
    ("rank-20", 13, 64, 20, 130, 4, "random"),
    ("rank-64", 9, 128, 64, 256, 2, "random"),
    ("one-adapter", 24, 192, 16, 192, 5, "one"),
    ("empty-middle-slots", 20, 64, 16, 80, 6, "ends"),
    ("all-base", 8, 64, 16, 64, 3, "base"),
]


def draw(case, seed, layers=None):
    """x [T, K], a [(L,) S, K, R], b [(L,) S, R, N] float32 (slot 0 zeros), slots int32 [T];
    the last quarter of the rows are padding rows on slot 0."""
    _, rows, k, rank, n, num_slots, mix = case
    rng = np.random.default_rng([SEED, seed])
    lead = () if layers is None else (layers,)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    a = (rng.standard_normal(lead + (num_slots, k, rank)) / np.sqrt(k)).astype(np.float32)
    b = (rng.standard_normal(lead + (num_slots, rank, n)) / np.sqrt(rank)).astype(np.float32)
    a[..., 0, :, :], b[..., 0, :, :] = 0.0, 0.0  # slot 0: the zero adapter
    slots = {"cycle": np.arange(rows) % num_slots,
             "random": rng.integers(0, num_slots, rows),
             "one": np.full(rows, num_slots - 1),
             "ends": np.where(np.arange(rows) % 2 == 0, 1, num_slots - 1),
             "base": np.zeros(rows)}[mix].astype(np.int32)
    slots[rows - rows // 4:] = 0  # padding rows
    return jnp.asarray(x), jnp.asarray(a), jnp.asarray(b), jnp.asarray(slots)


def check(got, x, a, b, slots, seed):
    want = np.asarray(reference.lora_update(x, a, b, slots))
    got = np.asarray(got)
    assert got.shape == want.shape and got.dtype == np.float32, f"seed {seed}"
    assert not got[np.asarray(slots) == 0].any(), f"rows on slot 0 must be exactly zero (seed {seed})"
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(1.0, np.abs(want).max()),
                               err_msg=f"seed {seed} (JAXSERVE_TEST_SEED={SEED})")


@needs_kernels
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_kernel_matches_the_reference(case):
    seed = CASES.index(case)
    x, a, b, slots = draw(case, seed)
    check(jax.jit(cpu_kernels.lora_update)(x, a, b, slots), x, a, b, slots, seed)


@needs_kernels
@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: c[0])
def test_a_stacked_slab_is_read_at_the_layer_index(case):
    seed = 100 + CASES.index(case)
    x, a, b, slots = draw(case, seed, layers=3)
    update = jax.jit(cpu_kernels.lora_update)
    for layer in range(3):
        check(update(x, a, b, slots, jnp.int32(layer)), x, a[layer], b[layer], slots, seed)


@needs_kernels
def test_a_row_does_not_depend_on_the_others():
    """A row's update is the same to the bit whatever the other rows' slots and values (each
    row's sums run in one order: no batch-dependent results)."""
    case = ("mixed", 16, 192, 16, 320, 5, "random")
    x, a, b, slots = draw(case, 200)
    update = jax.jit(cpu_kernels.lora_update)
    full = np.asarray(update(x, a, b, slots))
    rng = np.random.default_rng([SEED, 201])
    other_slots = jnp.asarray(rng.integers(0, 5, 16).astype(np.int32)).at[3].set(slots[3])
    other_x = jnp.asarray(rng.standard_normal(x.shape).astype(np.float32)).at[3].set(x[3])
    np.testing.assert_array_equal(np.asarray(update(other_x, a, b, other_slots))[3], full[3],
                                  err_msg=f"seed 200 (JAXSERVE_TEST_SEED={SEED})")
    np.testing.assert_array_equal(np.asarray(update(x[3:4], a, b, slots[3:4]))[0], full[3])


@needs_kernels
def test_slots_and_layers_outside_the_slab_fail_the_call():
    x, a, b, slots = draw(("small", 4, 32, 8, 16, 3, "random"), 300, layers=2)
    update = jax.jit(cpu_kernels.lora_update)
    with pytest.raises(Exception, match="slot is outside the slab"):
        np.asarray(update(x, a, b, slots.at[1].set(3), jnp.int32(0)))
    with pytest.raises(Exception, match="layer index outside"):
        np.asarray(update(x, a, b, slots, jnp.int32(2)))


@needs_kernels
@pytest.mark.parametrize("stacked", [False, True], ids=["one-layer", "stacked"])
def test_dispatch_runs_the_kernel_on_the_cpu(stacked):
    """The "xla" backend's update lowered for the CPU is the kernel, reading a stacked slab's
    layer in place (no slice of it), and equals the reference."""
    x, a, b, slots = draw(CASES[0], 400, layers=2 if stacked else None)
    layer = jnp.int32(1) if stacked else None
    update = jax.jit(lambda x, a, b, slots, layer: dispatch.lora_update("xla", x, a, b, slots, layer=layer))
    hlo = update.lower(x, a, b, slots, layer).compile().as_text()
    assert "jaxserve_lora_update" in hlo and ("dynamic-slice" not in hlo or not stacked)
    check(update(x, a, b, slots, layer), x, a[1] if stacked else a, b[1] if stacked else b, slots, 400)


@pytest.mark.parametrize("why", ["not built", "bfloat16"])
def test_dispatch_falls_back_to_xla_without_the_kernel(monkeypatch, why):
    """Where the kernels are not built (a CPU without AVX-512 VNNI, no compiler,
    JAXSERVE_CPU_KERNELS=0), or for a bfloat16 slab, the CPU runs xla_lora's form: no kernel
    call in the program, the same result."""
    x, a, b, slots = draw(CASES[0], 500, layers=2)
    if why == "not built":
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    else:
        a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    update = jax.jit(lambda x, a, b, slots, layer: dispatch.lora_update("xla", x, a, b, slots, layer=layer))
    assert "jaxserve_lora_update" not in update.lower(x, a, b, slots, jnp.int32(1)).as_text()
    got = update(x, a, b, slots, jnp.int32(1))
    want = reference.lora_update(x, a[1].astype(jnp.float32), b[1].astype(jnp.float32), slots)
    tolerance = 1e-5 if why == "not built" else 2e-2  # bfloat16: the shrunk rows rounded to it
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                               atol=tolerance * max(1.0, float(np.abs(want).max())), err_msg="seed 500")


def test_a_cuda_program_has_no_cpu_kernel():
    """Lowered for CUDA (jax.export, no GPU needed), a float32 stacked slab's update is not the
    CPU kernel on either backend ("pallas": the Triton kernel; "xla": XLA's form)."""
    from jaxserve import compat
    specs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((32, 576), (3, 5, 576, 16), (3, 5, 16, 192))]
    specs += [jax.ShapeDtypeStruct((32,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32)]
    for backend in ("xla", "pallas"):
        text = compat.lower_for_cuda(
            lambda x, a, b, slots, layer, backend=backend: dispatch.lora_update(backend, x, a, b, slots, layer=layer),
            *specs)
        assert "jaxserve_lora_update" not in text, backend
        assert ("lora_bgmv" in text) == (backend == "pallas"), backend

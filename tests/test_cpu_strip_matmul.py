"""The C++ CPU kernel of float32 rows times a weight in strips (cpu_kernels/strip_matmul.cc), its
bfloat16 (`bf16_matmul`) and float32 (`f32_matmul`) weights, against float64 numpy of
x @ w.astype(float32), on seeded random inputs: every row count of its register blocks and their
remainders (1 to 64 rows; float32 also a prompt chunk's 512), K and N that are not multiples of
the strip, leading axes on x, a stacked weight read at a layer index (in a jitted `jax.lax.scan`
too), the layouts of `pack_bf16` and `pack_f32`, and the calls it refuses. Set
JAXSERVE_TEST_SEED to draw other inputs.
"""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels

SEED = int(os.environ.get("JAXSERVE_TEST_SEED", "20261205"))

pytestmark = pytest.mark.slow  # builds the CPU kernels: out of `make test-quick`
needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="no AVX-512 VNNI CPU or no C++ compiler")

ROWS = [1, 2, 3, 4, 5, 6, 7, 17, 64]
SHAPES = [(96, 100), (576, 192), (576, 1536), (97, 33), (1536, 576)]  # (K, N)


class Format:
    """One weight format of the kernel: its dtype, packing and call."""
    def __init__(self, dtype, pack, matmul, target):
        self.dtype, self.pack, self.matmul, self.target = dtype, pack, matmul, target


BF16 = Format(jnp.bfloat16, cpu_kernels.pack_bf16, cpu_kernels.bf16_matmul, "jaxserve_bf16_matmul")
F32 = Format(jnp.float32, cpu_kernels.pack_f32, cpu_kernels.f32_matmul, "jaxserve_f32_matmul")
FORMATS = pytest.mark.parametrize("fmt", [BF16, F32], ids=["bf16", "f32"])


def draw(rows, k, n, seed, layers=None, dtype=jnp.bfloat16):
    """x [rows, K] float32 and w [(L,) K, N] of `dtype` (values of a trained layer's scale)."""
    rng = np.random.default_rng([SEED, seed])
    x = rng.standard_normal((rows, k)).astype(np.float32)
    lead = () if layers is None else (layers,)
    w = jnp.asarray(rng.standard_normal(lead + (k, n)) / np.sqrt(k), dtype)
    return jnp.asarray(x), w


def check(got, x, w, seed):
    """Within float32 accumulation of the exact products: K terms of |x| |w| each."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w.astype(jnp.float32), np.float64)
    want = x64 @ w64
    bound = 4 * x64.shape[-1] * np.finfo(np.float32).eps * (np.abs(x64) @ np.abs(w64))
    got = np.asarray(got)
    assert got.shape == want.shape and got.dtype == np.float32, f"seed {seed}"
    excess = np.abs(got - want) - bound
    assert excess.max() <= 0, (f"seed {seed} (JAXSERVE_TEST_SEED={SEED}): off by "
                               f"{np.abs(got - want).max():.3g} at {np.unravel_index(excess.argmax(), got.shape)}")
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max(),
                               err_msg=f"seed {seed} (JAXSERVE_TEST_SEED={SEED})")


def test_pack_bf16_lays_out_strips_of_interleaved_halves():
    """Strip s, input i, element 2j + t of half h is column s*64 + h*32 + t*16 + j; the last
    strip zero-padded; leading axes kept."""
    k, n = 3, 100
    w = jnp.arange(2 * k * n, dtype=jnp.float32).reshape(2, k, n).astype(jnp.bfloat16)  # exact below 256
    packed = np.asarray(cpu_kernels.pack_bf16(w).astype(jnp.float32))
    assert packed.shape == (2, 2, k, cpu_kernels.STRIP)
    w = np.asarray(w.astype(jnp.float32))
    for s in range(2):
        for h in range(2):
            for t in range(2):
                for j in range(16):
                    column = s * 64 + h * 32 + t * 16 + j
                    want = w[:, :, column] if column < n else 0
                    np.testing.assert_array_equal(packed[:, s, :, h * 32 + 2 * j + t], want)


def test_pack_f32_lays_out_strips_in_order():
    """Strip s, input i, element j is column s*64 + j; the last strip zero-padded; leading axes
    kept; unpack_f32 gives the weight back."""
    k, n = 3, 100
    w = jnp.arange(2 * k * n, dtype=jnp.float32).reshape(2, k, n)
    packed = np.asarray(cpu_kernels.pack_f32(w))
    assert packed.shape == (2, 2, k, cpu_kernels.STRIP)
    for s in range(2):
        for j in range(cpu_kernels.STRIP):
            column = s * 64 + j
            np.testing.assert_array_equal(packed[:, s, :, j], np.asarray(w)[:, :, column] if column < n else 0)
    np.testing.assert_array_equal(np.asarray(cpu_kernels.unpack_f32(jnp.asarray(packed), n)), np.asarray(w))


@needs_kernels
@FORMATS
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("rows", ROWS)
def test_kernel_is_x_times_the_float32_weight(rows, shape, fmt):
    seed = 100 * SHAPES.index(shape) + rows
    x, w = draw(rows, *shape, seed, dtype=fmt.dtype)
    got = jax.jit(fmt.matmul, static_argnums=2)(x, fmt.pack(w), shape[1])
    check(got, x, w, seed)


@needs_kernels
@pytest.mark.parametrize("rows", [65, 512, 515])
def test_a_float32_weight_takes_any_number_of_rows(rows):
    """A prompt chunk's rows: the float32 kernel has no row limit."""
    seed = 7000 + rows
    x, w = draw(rows, 576, 192, seed, dtype=jnp.float32)
    check(jax.jit(cpu_kernels.f32_matmul, static_argnums=2)(x, cpu_kernels.pack_f32(w), 192), x, w, seed)


@needs_kernels
def test_leading_axes_of_x_are_kept_and_a_bfloat16_x_is_widened():
    x, w = draw(12, 96, 100, 1000)
    packed = cpu_kernels.pack_bf16(w)
    got = cpu_kernels.bf16_matmul(x.reshape(3, 4, 96), packed, 100)
    assert got.shape == (3, 4, 100)
    check(got.reshape(12, 100), x, w, 1000)
    x16 = x.astype(jnp.bfloat16)
    check(cpu_kernels.bf16_matmul(x16, packed, 100), x16.astype(jnp.float32), w, 1000)


@needs_kernels
@FORMATS
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_a_stacked_weight_is_read_at_the_layer_index(rows, fmt):
    seed = 2000 + rows
    x, w = draw(rows, 576, 192, seed, layers=3, dtype=fmt.dtype)
    packed = fmt.pack(w)
    assert packed.shape == (3, 3, 576, cpu_kernels.STRIP)
    matmul = jax.jit(fmt.matmul, static_argnums=2)
    for layer in range(3):
        check(matmul(x, packed, 192, jnp.int32(layer)), x, w[layer], seed)
    hlo = matmul.lower(x, packed, 192, jnp.int32(1)).compile().as_text()
    assert fmt.target in hlo and "dynamic-slice" not in hlo


@needs_kernels
@FORMATS
def test_a_layer_scan_reads_each_layer_in_place(fmt):
    """Under jit, a scan over the layer index: each step's product with its layer's weight."""
    layers, rows, k, n = 4, 3, 96, 100
    x, w = draw(rows, k, n, 3000, layers=layers, dtype=fmt.dtype)
    packed = fmt.pack(w)

    @jax.jit
    def scanned(x, packed):
        def body(carry, layer):
            return carry, fmt.matmul(x, packed, n, layer)
        return jax.lax.scan(body, 0, jnp.arange(layers, dtype=jnp.int32))[1]

    got = scanned(x, packed)
    assert got.shape == (layers, rows, n)
    for layer in range(layers):
        check(got[layer], x, w[layer], 3000)
    hlo = scanned.lower(x, packed).compile().as_text()
    layer_slice = rf"= {'bf16' if fmt is BF16 else 'f32'}\[{packed.shape[1]},{k},{cpu_kernels.STRIP}\]"
    assert not re.search(layer_slice, hlo)  # no layer of the stack copied out of it


@needs_kernels
@FORMATS
def test_a_row_does_not_depend_on_the_others(fmt):
    """A row's result is the same to the bit whatever the other rows and their count."""
    x, w = draw(17, 576, 192, 4000, dtype=fmt.dtype)
    packed = fmt.pack(w)
    matmul = jax.jit(fmt.matmul, static_argnums=2)
    full = np.asarray(matmul(x, packed, 192))
    for rows in (1, 6, 9):
        np.testing.assert_array_equal(np.asarray(matmul(x[5:5 + rows], packed, 192)), full[5:5 + rows],
                                      err_msg=f"seed 4000 (JAXSERVE_TEST_SEED={SEED})")


@needs_kernels
def test_refused_calls():
    x, w = draw(4, 96, 100, 5000, layers=2)
    packed = cpu_kernels.pack_bf16(w)
    with pytest.raises(Exception, match="layer index outside"):
        np.asarray(jax.jit(cpu_kernels.bf16_matmul, static_argnums=2)(x, packed, 100, jnp.int32(2)))
    with pytest.raises(ValueError, match="at most"):
        cpu_kernels.bf16_matmul(jnp.zeros((cpu_kernels.MAX_ROWS + 1, 96)), packed, 100, 0)
    with pytest.raises(ValueError):
        cpu_kernels.bf16_matmul(x, packed, 100)  # a stacked weight without a layer
    with pytest.raises(ValueError):
        cpu_kernels.bf16_matmul(x[:, :64], packed, 100, 0)  # K of x is not the weight's


@needs_kernels
def test_takes_bf16_matmul():
    x, w = draw(4, 96, 100, 6000)
    packed = cpu_kernels.pack_bf16(w)
    assert cpu_kernels.takes_bf16_matmul(x, packed)
    assert not cpu_kernels.takes_bf16_matmul(x, packed, layer=0)
    assert cpu_kernels.takes_bf16_matmul(x, packed[None], layer=0)
    assert not cpu_kernels.takes_bf16_matmul(jnp.zeros((cpu_kernels.MAX_ROWS + 1, 96)), packed)
    assert not cpu_kernels.takes_bf16_matmul(x, packed.astype(jnp.float32))


@needs_kernels
def test_f32_matmul_refuses_a_layer_outside_the_stack():
    x, w = draw(4, 96, 100, 6000, dtype=jnp.float32)
    packed = cpu_kernels.pack_f32(w)
    with pytest.raises(Exception, match="layer index outside"):
        np.asarray(jax.jit(cpu_kernels.f32_matmul, static_argnums=2)(x, packed[None], 100, jnp.int32(1)))
    with pytest.raises(ValueError):
        cpu_kernels.f32_matmul(x, packed[None], 100)  # a stacked weight without a layer

"""The CPU kernels (cpu_kernels): the int8-activation quantized matmul against a numpy
model of what it computes, its layout, where the CPU step uses it, and how it is built."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dataclasses

import cpu_kernels
from jaxserve.models import cpu_layout, prompt_matmul
from jaxserve.models import quantization as qz
from pallas_kernels import dispatch

SEED = int(os.environ.get("JAXSERVE_TEST_SEED", "20261130"))

pytestmark = [pytest.mark.slow,  # builds the kernels, runs them against numpy: out of `make test-quick`
              pytest.mark.skipif(not cpu_kernels.available(), reason="no AVX-512 VNNI CPU or no C++ compiler")]

FORMATS = ["int8", "int8_g64", "int8_zp", "int8_g32_zp", "int4", "int4_g64", "int4_g32_sym", "int4_g128_sym"]


def quantized_rows(x: np.ndarray) -> np.ndarray:
    """What the kernel multiplies: each block of cpu_kernels.BLOCK inputs of a row rounded to
    int8 steps of its largest magnitude / 127."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // cpu_kernels.BLOCK, cpu_kernels.BLOCK).astype(np.float32)
    top = np.abs(blocks).max(-1, keepdims=True)
    inverse = np.where(top > 0, np.float32(127) / np.where(top > 0, top, 1), 0).astype(np.float32)
    codes = np.round(blocks * inverse)  # in float32, ties to even, as the kernel rounds
    return (codes.astype(np.float64) * (top / np.float32(127))).reshape(rows, k)


@pytest.mark.parametrize("name", FORMATS)
def test_quantized_matmul_is_the_weight_times_the_int8_rows(name):
    """Every row count (a decode step's register blocks of 1-4 rows and their remainders, a
    prompt chunk's tiles of 6 and blocks of 48 rows), output widths that are not a multiple of the strip, several groups; against float64 numpy."""
    rng = np.random.default_rng([SEED, FORMATS.index(name)])
    for k, n in [(256, 80), (384, 200), (128, 64)]:
        if qz.parse_format(name).group_size and k % qz.parse_format(name).group_size:
            continue
        w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
        weight = qz.quantize(w, qz.parse_format(name))
        assert cpu_layout.kernel_takes(weight)
        kernel_weight = jax.jit(cpu_layout.with_kernel_layout)(weight)
        kernel_weight = dataclasses.replace(  # prompt chunks in the kernel too
            kernel_weight, kernel=dataclasses.replace(kernel_weight.kernel, prompt_dtype="int8"))
        dequantized = np.asarray(qz.dequantize(weight), np.float64)
        for rows in (1, 2, 3, 4, 5, 7, 9, 64, 65, 101, 150):  # past 64: the prompt tiles, blocks of 48 rows
            x = rng.standard_normal((rows, k)).astype(np.float32)
            x[0, :cpu_kernels.BLOCK] = 0.0  # an all-zero block
            got = np.asarray(jax.jit(qz.linear)(jnp.asarray(x), kernel_weight))
            expected = quantized_rows(x) @ dequantized
            scale = np.abs(expected).max()
            assert np.abs(got - expected).max() < 2e-6 * scale, f"seed {SEED}, {name} {k}x{n}, {rows} rows"
            exact = x.astype(np.float64) @ dequantized
            assert np.abs(got - exact).max() < 0.02 * scale, f"seed {SEED}: int8 rows far from float"


@pytest.mark.parametrize("name", ["int8_g32_zp", "int4", "int4_g32_sym"])
def test_a_stacked_weight_is_read_at_the_layer_index(name):
    """A weight stacked on a layer axis with a "layer" index (traced, as in the layer scan)
    multiplies exactly as that layer's own weight; an index outside the stack fails the call
    instead of reading outside it."""
    rng = np.random.default_rng([SEED, 5, FORMATS.index(name)])
    layers = [qz.quantize(rng.standard_normal((128, 96)).astype(np.float32), qz.parse_format(name)) for _ in range(3)]
    stacked = jax.jit(cpu_layout.with_kernel_layout)(jax.tree.map(lambda *a: jnp.stack(a), *layers))
    x = jnp.asarray(rng.standard_normal((2, 128)).astype(np.float32))
    at_layer = jax.jit(lambda x, weight, layer: qz.linear(
        x, dataclasses.replace(weight, kernel=dataclasses.replace(weight.kernel, layer=layer))))
    for layer, weight in enumerate(layers):
        own = np.asarray(jax.jit(qz.linear)(x, jax.jit(cpu_layout.with_kernel_layout)(weight)))
        assert np.array_equal(np.asarray(at_layer(x, stacked, jnp.int32(layer))), own), layer
    with pytest.raises(Exception, match="outside the stacked weight"):
        np.asarray(at_layer(x, stacked, jnp.int32(3)))


@pytest.mark.parametrize("name", ["int8", "int4_g32_sym", "int8_g32_zp"])
def test_a_group_of_weights_is_one_call_equal_to_one_call_each(name):
    """quantization.linear_group (a layer's q, k and v; its gate and up): weights of one format on
    one input in one kernel call (x quantized once, the strips of all the weights one list of
    tasks), bit-equal to a call each, at decode and prompt row counts and at a stacked weight's
    layer index. Weights the kernel does not take together (another format, a bfloat16 prompt
    chunk) fall back to a call each, with the same results."""
    rng = np.random.default_rng([SEED, 7, FORMATS.index(name)])
    fmt = qz.parse_format(name)
    stacks = [jax.jit(cpu_layout.with_kernel_layout)(jax.tree.map(lambda *a: jnp.stack(a), *[
        qz.quantize((rng.standard_normal((128, n)) / np.sqrt(128)).astype(np.float32), fmt) for _ in range(2)]))
        for n in (96, 32, 200)]
    stacks = [dataclasses.replace(w, kernel=dataclasses.replace(w.kernel, prompt_dtype="int8")) for w in stacks]

    def at(weights, layer):
        return [dataclasses.replace(w, kernel=dataclasses.replace(w.kernel, layer=layer)) for w in weights]
    grouped = jax.jit(lambda x, weights, layer: qz.linear_group(x, at(weights, layer)))
    separate = jax.jit(lambda x, weights, layer: [qz.linear(x, w) for w in at(weights, layer)])
    for rows in (1, 4, 9, 64, 65, 150):
        x = jnp.asarray(rng.standard_normal((rows, 128)).astype(np.float32))
        for layer in (0, 1):
            lowered = grouped.lower(x, stacks, jnp.int32(layer)).as_text()
            assert lowered.count("stablehlo.custom_call") == 1 and "jaxserve_quantized_matmul_group" in lowered
            got = grouped(x, stacks, jnp.int32(layer))
            for g, want in zip(got, separate(x, stacks, jnp.int32(layer)), strict=True):
                assert np.array_equal(np.asarray(g), np.asarray(want)), f"seed {SEED}: {rows} rows, layer {layer}"
    x = jnp.asarray(rng.standard_normal((65, 128)).astype(np.float32))
    mixed = [stacks[0], dataclasses.replace(stacks[1], kernel=dataclasses.replace(stacks[1].kernel,
                                                                                 prompt_dtype="bfloat16"))]
    assert "jaxserve_quantized_matmul_group" not in grouped.lower(x, mixed, jnp.int32(0)).as_text()
    for g, want in zip(grouped(x, mixed, jnp.int32(0)), separate(x, mixed, jnp.int32(0)), strict=True):
        assert np.array_equal(np.asarray(g), np.asarray(want))


@pytest.mark.parametrize("prompt_dtype", ["int8", "bfloat16", "float32"])
@pytest.mark.parametrize("name", ["int8", "int4", "int8_g64"])
def test_prompt_chunks_multiply_in_the_prompt_dtype(name, prompt_dtype):
    """More rows than a decode step's (a prompt chunk) multiply in the kernel layout's
    prompt_dtype (EngineConfig.cpu_prompt_dtype): int8, in the C++ kernel, the rows quantized to
    int8 per block of inputs as a decode step's (every format the kernel takes); bfloat16 out of
    the kernel, the rows and the weight rounded to bfloat16; float32 out of it, the dequantized
    weight, as without the layout. Up to MAX_ROWS rows are the kernel's whatever the choice."""
    rng = np.random.default_rng([SEED, 1, len(name)])
    w = (rng.standard_normal((128, 96)) / np.sqrt(128)).astype(np.float32)
    weight = qz.quantize(w, qz.parse_format(name))
    kernel_weight = cpu_layout.with_kernel_layout(weight)
    kernel_weight = dataclasses.replace(kernel_weight, kernel=dataclasses.replace(kernel_weight.kernel,
                                                                                  prompt_dtype=prompt_dtype))
    x = rng.standard_normal((cpu_kernels.MAX_ROWS + 1, 128)).astype(np.float32)
    x[3] = 0.0  # a zero row: scale 1, no division by zero
    hlo = jax.jit(qz.linear).lower(jnp.asarray(x), kernel_weight).as_text()
    assert ("jaxserve_quantized_matmul" in hlo) == (prompt_dtype == "int8")
    got = np.asarray(jax.jit(qz.linear)(jnp.asarray(x), kernel_weight))
    dequantized = np.asarray(qz.dequantize(weight), np.float64)
    exact = x.astype(np.float64) @ dequantized
    if prompt_dtype == "int8":
        expected = quantized_rows(x) @ dequantized
        assert np.abs(got - expected).max() < 2e-6 * np.abs(expected).max(), f"seed {SEED}"
    elif prompt_dtype == "bfloat16":
        rounded = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)
        expected = rounded(x) @ rounded(dequantized)
        assert np.abs(got - expected).max() < 1e-5 * np.abs(expected).max(), f"seed {SEED}"
    else:
        np.testing.assert_allclose(got, np.asarray(qz.linear(jnp.asarray(x), weight)), rtol=1e-6)
    assert not got[3].any()
    assert np.abs(got - exact).max() < 0.02 * np.abs(exact).max(), f"seed {SEED}: far from float"
    assert "jaxserve_quantized_matmul" in jax.jit(qz.linear).lower(x[:cpu_kernels.MAX_ROWS], kernel_weight).as_text()


@pytest.mark.parametrize("amx", [False, True])
def test_auto_prompt_dtype_takes_the_vnni_kernel_for_per_channel_int8(monkeypatch, amx):
    """--cpu_prompt_dtype=auto: a per-channel int8 weight's prompt chunks in the VNNI kernel where
    the CPU has no AMX (faster than bfloat16 there, bench/RESULTS.md), other formats and AMX CPUs
    in bfloat16 (on a CPU with bfloat16 instructions); an explicit choice is kept."""
    monkeypatch.setattr(prompt_matmul, "cpu_has_amx", lambda: amx)
    monkeypatch.setattr(prompt_matmul, "cpu_has_bfloat16", lambda: True)
    want = "bfloat16" if amx else "int8"
    assert cpu_layout.prompt_compute_dtype("int8", True) == want
    assert cpu_layout.prompt_compute_dtype("int8_g32", True) == "bfloat16"
    assert cpu_layout.prompt_compute_dtype("int4", True) == "bfloat16"
    assert cpu_layout.prompt_compute_dtype("int4", True, "int8") == "int8"
    assert cpu_layout.prompt_compute_dtype("int8", False) == "float32"
    assert cpu_layout.prompt_compute_dtype("bfloat16", True) == "bfloat16"
    rng = np.random.default_rng([SEED, 7])
    params = {"embed": rng.standard_normal((32, 64)).astype(np.float32),
              "layers": {name: qz.quantize(rng.standard_normal((2, 64, 96)).astype(np.float32), qz.parse_format(fmt))
                         for name, fmt in (("wq", "int8"), ("w_up", "int4"))}}
    marked = cpu_layout.layer_views(jax.device_put(params))["layers"]
    marked = marked[0] if isinstance(marked, tuple) else marked
    assert (marked["wq"].kernel.prompt_dtype, marked["w_up"].kernel.prompt_dtype) == (want, "bfloat16")


def test_pack_lays_out_strips_of_four_inputs():
    """The layout quantized_matmul.cc reads: [strips, K / 4, STRIP, 4] (int8 levels) and
    [strips, K / 8, STRIP, 4] with inputs 8i + t and 8i + 4 + t in the low and high nibbles."""
    k, n = 16, 70  # two strips, the second zero-padded
    levels = (np.arange(k * n).reshape(k, n) % 251).astype(np.uint8)
    packed = np.asarray(cpu_kernels.pack(jnp.asarray(levels), 8))
    assert packed.shape == (2, k // 4, cpu_kernels.STRIP, 4)
    for i, c, t in [(0, 0, 0), (3, 5, 2), (1, 69, 3)]:
        assert packed[c // 64, i, c % 64, t] == levels[4 * i + t, c]
    assert not packed[1, :, n - 64:].any()
    nibbles = levels % 16
    packed = np.asarray(cpu_kernels.pack(jnp.asarray(nibbles), 4))
    assert packed.shape == (2, k // 8, cpu_kernels.STRIP, 4)
    for i, c, t in [(0, 0, 0), (1, 66, 3), (1, 7, 1)]:
        byte = packed[c // 64, i, c % 64, t]
        assert (byte & 0xF, byte >> 4) == (nibbles[8 * i + t, c], nibbles[8 * i + 4 + t, c])


def test_formats_the_kernel_does_not_take():
    rng = np.random.default_rng([SEED, 2])
    w = rng.standard_normal((96, 32)).astype(np.float32)
    assert cpu_layout.kernel_takes(qz.quantize(w, qz.parse_format("int4")))
    assert not cpu_layout.kernel_takes(qz.quantize(w[:48], qz.parse_format("int8")))  # 48 inputs: not BLOCKs
    weight = qz.quantize(w, qz.parse_format("int4"))
    fp8 = qz.QuantArray(jnp.asarray(w).astype(jnp.float8_e4m3fn), weight.scale[:1])
    assert not cpu_layout.kernel_takes(fp8)
    assert not cpu_layout.kernel_takes(dataclasses.replace(weight, zero=jnp.zeros_like(weight.zero, jnp.uint8)))  # integer zero
    assert not cpu_layout.kernel_takes(dataclasses.replace(weight, scale=weight.scale.astype(jnp.float32)))
    assert not cpu_layout.kernel_takes(dataclasses.replace(weight, perm=jnp.arange(96)))
    assert not cpu_layout.kernel_takes(w)


def test_build_and_its_failure(monkeypatch, tmp_path, caplog):
    """The library is compiled into $JAXSERVE_KERNEL_CACHE once; a compiler that fails leaves
    available() False with a warning (XLA's formulation then); JAXSERVE_CPU_KERNELS=0: off."""
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path))
    path = cpu_kernels._build()
    assert os.path.dirname(path) == str(tmp_path) and os.path.getsize(path) > 0
    assert cpu_kernels._build() == path  # cached: built once
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path / "other"))
    monkeypatch.setenv("CXX", "/bin/false")
    with pytest.raises(OSError, match="failed"):
        cpu_kernels._build()
    assert cpu_kernels._load() is False
    assert "CPU kernels unavailable" in caplog.text and not list((tmp_path / "other").glob("*.so"))
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("JAXSERVE_CPU_KERNELS", "0")
    assert cpu_kernels._load() is False
    assert not list((tmp_path / "other").glob("*.so"))  # off: not even built


# ---- decode attention ---------------------------------------------------------------------------

@pytest.mark.parametrize("options", [{}, {"sliding_window": 40}, {"scale": 0.3, "logit_soft_cap": 5.0}],
                         ids=["plain", "window", "scale-softcap"])
def test_paged_decode_attention_matches_the_reference(options):
    """The kernel against the test oracle (whole context at once): GQA, random page order,
    padding rows, contexts from 1 to past one task's 128 keys, head_dim not a multiple of 16,
    query heads in one pass over the keys (3, 8 a KV head) or several (a 136-wide head)."""
    from pallas_kernels import reference
    rng = np.random.default_rng([SEED, 3])
    for num_q_heads, num_kv_heads, head_dim in [(9, 3, 64), (4, 4, 24), (16, 2, 16), (4, 2, 136)]:
        pages, page_size, width = 60, 8, 40
        lens = np.array([300, 0, 1, 128, 129, 17], np.int32)
        q = jnp.asarray(rng.standard_normal((len(lens), num_q_heads, head_dim)).astype(np.float32))
        k, v = (jnp.asarray(rng.standard_normal((pages, page_size, num_kv_heads, head_dim)).astype(np.float32))
                for _ in range(2))
        table = jnp.asarray(np.stack([rng.permutation(np.arange(1, pages))[:width] for _ in lens]).astype(np.int32))
        if "sliding_window" in options:
            options = {**options, "sliding_window": jnp.int32(options["sliding_window"])}
        assert cpu_kernels.takes_decode_attention(q, k, v)
        got = jax.jit(lambda *a: dispatch.decode_attention("xla", *a, **options))(q, k, v, table, jnp.asarray(lens))
        assert "jaxserve_paged_decode_attention" in jax.jit(
            lambda *a: dispatch.decode_attention("xla", *a, **options)).lower(q, k, v, table, jnp.asarray(lens)).as_text()
        want = reference.paged_decode_attention(q, k, v, table, jnp.asarray(lens), **options)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-4, err_msg=f"seed {SEED}")
        assert not np.asarray(got)[1].any()  # the padding row


def test_decode_attention_rows_do_not_depend_on_each_other():
    """A row's result is the same bits alone and next to other rows (tasks per row, fixed
    chunks), and quantized caches keep XLA's path."""
    rng = np.random.default_rng([SEED, 4])
    q = jnp.asarray(rng.standard_normal((4, 4, 32)).astype(np.float32))
    k, v = (jnp.asarray(rng.standard_normal((30, 16, 2, 32)).astype(np.float32)) for _ in range(2))
    table = jnp.asarray(rng.permutation(np.arange(1, 30))[:28].reshape(4, 7).astype(np.int32))
    lens = jnp.asarray([100, 7, 0, 112], jnp.int32)
    attend = jax.jit(lambda *a: dispatch.decode_attention("xla", *a))
    together = np.asarray(attend(q, k, v, table, lens))
    for row in range(4):
        alone = np.asarray(attend(q[row:row + 1], k, v, table[row:row + 1], lens[row:row + 1]))
        assert np.array_equal(alone[0], together[row]), row
    assert not cpu_kernels.takes_decode_attention(q, {"pages": k.astype(jnp.int8), "scales": k[..., :1]}, v)
    assert not cpu_kernels.takes_decode_attention(q.astype(jnp.bfloat16), k, v)
    wide = jnp.zeros((1, 1, cpu_kernels.MAX_HEAD_DIM + 16), jnp.float32)
    assert not cpu_kernels.takes_decode_attention(wide, wide[None], wide[None])


def test_decode_attention_refuses_pages_outside_the_cache():
    """A block table entry past the cache (or a length past the table) is an error of the call,
    not a read outside the buffers."""
    q = jnp.zeros((1, 2, 16), jnp.float32)
    k = jnp.zeros((4, 8, 1, 16), jnp.float32)
    attend = jax.jit(lambda *a: dispatch.decode_attention("xla", *a))
    with pytest.raises(Exception, match="outside the cache"):
        np.asarray(attend(q, k, k, jnp.asarray([[1, 4]], jnp.int32), jnp.asarray([9], jnp.int32)))
    with pytest.raises(Exception, match="exceeds its block table"):
        np.asarray(attend(q, k, k, jnp.asarray([[1, 2]], jnp.int32), jnp.asarray([17], jnp.int32)))
    assert np.asarray(attend(q, k, k, jnp.asarray([[1, 4]], jnp.int32), jnp.asarray([8], jnp.int32))).shape == (1, 2, 16)


def test_a_kernel_call_registers_the_kernels_itself():
    """In a fresh process, a kernel call traced before anything asked `available()` (a jitted
    `linear` on a weight laid out by hand) registers the library first, instead of failing at
    run time with no FFI handler."""
    import subprocess
    import sys
    code = ("import jax, jax.numpy as jnp, numpy as np\n"
            "from jaxserve.models import cpu_layout, quantization as qz\n"
            "w = cpu_layout.with_kernel_layout(qz.quantize(np.ones((64, 32), np.float32), qz.parse_format('int4')))\n"
            "print(float(jax.jit(qz.linear)(jnp.ones((1, 64), jnp.float32), w)[0, 0]))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert abs(float(result.stdout.split()[-1]) - 64.0) < 1.0  # 64 ones times ones, int8-rounded

"""The kernels with Gemma 2's options (a sliding window operand, logit soft-capping, a custom
scale) compiled for Hopper on this CPU machine, down to ptxas: the window's dynamic loop start
and the soft-cap's tanh must not make the shipped tiles spill.

Needs the gpu-compile extra: `.venv-gpu-compile/bin/python -m pytest tests/test_kernel_gpu_compile.py`."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxserve.planning import gpu_compile
from pallas_kernels.paged_decode import paged_decode_attention
from pallas_kernels.ragged_prefill import ragged_paged_attention

pytestmark = [pytest.mark.slow, pytest.mark.skipif(  # compiles for a GPU: out of `make test-quick`
    not gpu_compile.is_available(),
    reason=f"the gpu-compile extra is not in this environment (run it in .venv-gpu-compile; {gpu_compile.INSTALL_HINT})")]

GEMMA2_2B = (8, 4, 256)  # query heads, KV heads, head_dim
OPTIONS = dict(scale=256**-0.5, logit_soft_cap=50.0)


def test_windowed_soft_capped_kernels_do_not_spill_on_sm90a():
    heads, kv_heads, head_dim = GEMMA2_2B
    mesh = gpu_compile.gpu_mesh("h100", 1)
    replicated = NamedSharding(mesh, P())

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    pages = spec((1024, 16, kv_heads, head_dim), jnp.bfloat16)
    window = spec((), jnp.int32)
    decode = [spec((64, heads, head_dim), jnp.bfloat16), pages, pages, spec((64, 64), jnp.int32),
              spec((64,), jnp.int32), window]
    ragged = [spec((512, heads, head_dim), jnp.bfloat16), pages, pages, spec((4, 64), jnp.int32),
              spec((4,), jnp.int32), spec((5,), jnp.int32), window]

    def windowed(function):
        return jax.jit(lambda *args: function(*args[:-1], sliding_window=args[-1], **OPTIONS))

    reports = (gpu_compile.kernel_reports(windowed(paged_decode_attention), decode, mesh, "h100")
               + gpu_compile.kernel_reports(windowed(ragged_paged_attention), ragged, mesh, "h100"))
    assert sorted(r.name for r in reports) == ["paged_decode_attention", "ragged_paged_attention"]
    for r in reports:
        assert r.gpu == "sm_90a" and 0 < r.shared_memory_bytes <= 232448, r
    if jax.__version__.startswith("0.10."):  # later XLA dumps no PTX
        for r in reports:
            assert 0 < r.registers <= 255 and r.spill_store_bytes == r.spill_load_bytes == 0, r




def test_ragged_kernel_with_key_limits_does_not_spill_on_sm90a():
    """The ragged kernel with image spans' key limits (Gemma 3: bidirectional attention among an
    image's tokens) besides Gemma 2's window, soft-cap and scale, at the same sizes."""
    heads, kv_heads, head_dim = GEMMA2_2B
    mesh = gpu_compile.gpu_mesh("h100", 1)
    replicated = NamedSharding(mesh, P())

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    pages = spec((1024, 16, kv_heads, head_dim), jnp.bfloat16)
    ragged = [spec((512, heads, head_dim), jnp.bfloat16), pages, pages, spec((4, 64), jnp.int32),
              spec((4,), jnp.int32), spec((5,), jnp.int32), spec((512,), jnp.int32), spec((), jnp.int32)]
    function = jax.jit(lambda *a: ragged_paged_attention(*a[:6], key_limit=a[6], sliding_window=a[7], **OPTIONS))
    (r,) = gpu_compile.kernel_reports(function, ragged, mesh, "h100")
    assert r.name == "ragged_paged_attention" and r.gpu == "sm_90a" and 0 < r.shared_memory_bytes <= 232448, r
    if jax.__version__.startswith("0.10."):  # later XLA dumps no PTX
        assert 0 < r.registers <= 255 and r.spill_store_bytes == r.spill_load_bytes == 0, r
    print(f"key limits {r.name}: {r.registers} registers, spills {r.spill_store_bytes} B, "
          f"{r.shared_memory_bytes} B shared memory")


LORA_SHAPES = {  # (rows, K, rank, N, slots): a decode step's projections with 4 adapters plus the zero slot
    "smollm2_decode_down": (32, 1536, 16, 576, 5),
    "smollm2_decode_kv": (32, 576, 16, 192, 5),
    "llama3_8b_prefill_gate": (512, 4096, 64, 14336, 9),
}


@pytest.mark.parametrize("shape", sorted(LORA_SHAPES))
def test_lora_kernel_at_its_default_blocks_does_not_spill_on_sm90a(shape):
    from pallas_kernels.lora_bgmv import lora_update  # the multi-LoRA update (jaxserve.models.lora)

    rows, k, rank, n, slots = LORA_SHAPES[shape]
    mesh = gpu_compile.gpu_mesh("h100", 1)
    replicated = NamedSharding(mesh, P())
    args = [jax.ShapeDtypeStruct(s, d, sharding=replicated) for s, d in (
        ((rows, k), jnp.bfloat16), ((slots, k, rank), jnp.bfloat16), ((slots, rank, n), jnp.bfloat16),
        ((rows,), jnp.int32))]
    (report,) = gpu_compile.kernel_reports(jax.jit(lora_update), args, mesh, "h100")
    assert report.name == "lora_bgmv" and report.gpu == "sm_90a" and report.threads == 128, report  # 4 warps
    assert report.grid[0] == rows and report.grid[1] >= 1, report  # a program per (row, block of outputs)
    assert report.shared_memory_bytes <= 232448, report
    if jax.__version__.startswith("0.10."):  # later XLA dumps no PTX
        assert 0 < report.registers <= 255 and report.spill_store_bytes == report.spill_load_bytes == 0, report

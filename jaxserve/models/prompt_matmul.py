"""The matmuls of prompt chunks on the CPU, in int8 or bfloat16 instead of float32.

A prompt chunk (more rows than cpu_kernels.MAX_ROWS, a decode step's) is compute-bound:
SmolLM2's 500-token chunk is 106 GFLOP of matmuls, and float32 is the slowest way to do them.
Measured at 500 rows ([576, 1536] and [1536, 576], `jaxserve.planning.probe`, bench/RESULTS.md):
on an AMD Zen 4 CPU (AVX-512 VNNI and BF16, no AMX) float32 ~200 GFLOP/s, XLA's bfloat16 dot
~370, its int8 dot ~260, the C++ VNNI kernel ~550-650 G operations/s; on an Intel CPU with AMX,
XLA's bfloat16 dot ~1650 and its int8 dot ~3000 (AMX tiles). So with int8 activations
(EngineConfig.cpu_int8_activations) a quantized weight multiplies a prompt chunk:

* `--cpu_prompt_dtype=int8`: in the C++ kernel (cpu_kernels.quantized_matmul), as a decode
  step's rows: the rows of x quantized to int8 per block of 32 inputs (symmetric, dynamic), VNNI
  dot products with the weight codes read at their size, every format the kernel takes (int8
  and int4, per channel or in groups);
* `--cpu_prompt_dtype=bfloat16`: `bfloat16_linear` on the weight dequantized to bfloat16 (where
  the CPU has bfloat16 instructions, `cpu_has_bfloat16`; elsewhere XLA converts bfloat16 element
  by element and float32 is faster);
* `--cpu_prompt_dtype=auto` (the default, `resolve`): int8 for a per-channel int8 weight
  (`--quantization=int8`) where the kernels are built and the CPU has no AMX (there the kernel
  is the faster; grouped formats gain little or lose from its per-group scales); else bfloat16
  where the CPU has it, else float32;
* `--cpu_prompt_dtype=float32`: XLA's float32 dot on the weight dequantized to float32;

and a bfloat16 weight (`--dtype=bfloat16` on the CPU) multiplies one in `bfloat16_linear` too
(float32: converted). `cpu_layout.layer_views` writes the choice into each weight's kernel layout.

On an accelerator (EngineConfig.gpu_prompt_dtype; `prompt_activations.mark` marks the
weights), a prompt chunk's activations may be quantized per row for the tensor cores'
integer or float8 products: `quantized_activations_linear`, int8 rows times per-channel int8
weights (int32 sums), or e4m3 rows (one scale per row, max |x| / 448) times e4m3 weights (float32
sums); XLA:GPU runs both dots in its Triton GEMM fusions on the 8-bit operands.

What each costs in accuracy is in docs/quantization.md, measured (bench/prompt_compute.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import cpu_kernels

# Flags in /proc/cpuinfo of CPUs that multiply bfloat16 in hardware (AVX-512 BF16, AMX).
BFLOAT16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_has_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (its /proc/cpuinfo flags, read once;
    False where there are none, e.g. not Linux)."""
    return any(flag in cpu_kernels.cpu_flags().split() for flag in BFLOAT16_CPU_FLAGS)


# Flags of CPUs with AMX tiles, where XLA:CPU's bfloat16 dot outruns the VNNI kernel.
AMX_CPU_FLAGS = ("amx_bf16",)


@functools.cache
def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles for bfloat16 (its /proc/cpuinfo flags, read once)."""
    return any(flag in cpu_kernels.cpu_flags().split() for flag in AMX_CPU_FLAGS)


def resolve(prompt_dtype: str, per_channel_int8: bool = False) -> str:
    """EngineConfig.cpu_prompt_dtype with "auto" decided for this CPU and a weight: int8 (the C++
    VNNI kernel) for a per-channel int8 weight (`per_channel_int8`) where the kernels are built
    and the CPU has no AMX; else bfloat16 where the CPU multiplies it in hardware; else float32."""
    if prompt_dtype != "auto":
        return prompt_dtype
    if per_channel_int8 and not cpu_has_amx() and cpu_kernels.available():
        return "int8"
    return "bfloat16" if cpu_has_bfloat16() else "float32"


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., K] float -> (codes int8 [..., K], scale float32 [..., 1]): symmetric, one scale per
    row (max |x| / 127; a zero row gets scale 1 and zero codes)."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    return jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8), scale


FP8_MAX = 448.0  # the largest float8 e4m3fn


def quantize_rows_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., K] float -> (codes float8_e4m3fn [..., K], scale float32 [..., 1]): one scale per
    row (max |x| / 448; a zero row gets scale 1)."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return jnp.clip(x / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn), scale


def quantized_activations_linear(x: jax.Array, q: jax.Array, scale: jax.Array, activations: str) -> jax.Array:
    """x [..., K] @ w for w = q * scale, q int8 or float8_e4m3fn [K, N], scale [1, N] (per output
    channel): the rows of x quantized to `activations` ("int8" or "fp8", one scale per row), an
    8-bit dot accumulated in int32 / float32, both scales applied in float32 -> [..., N] in x's
    dtype."""
    if activations == "int8":
        return int8_linear(x, q, scale)
    codes, row_scale = quantize_rows_fp8(x)
    acc = jax.lax.dot_general(codes, q, (((codes.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return (acc * row_scale * scale[0].astype(jnp.float32)).astype(x.dtype)


def int8_linear(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """x [..., K] @ w for w = q * scale, q int8 [K, N], scale [1, N] (one per output channel):
    x quantized per row to int8, an int8 dot accumulated in int32, scaled in float32 -> [..., N]
    in x's dtype."""
    codes, row_scale = quantize_rows(x)
    acc = jnp.matmul(codes, q, preferred_element_type=jnp.int32)  # [..., N]
    return (acc.astype(jnp.float32) * row_scale * scale[0].astype(jnp.float32)).astype(x.dtype)


def bfloat16_linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, N], both rounded to bfloat16, accumulated in float32 -> x's dtype."""
    return jnp.matmul(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                      preferred_element_type=jnp.float32).astype(x.dtype)

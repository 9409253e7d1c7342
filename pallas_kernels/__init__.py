"""Paged attention for jaxserve: Pallas kernels, a plain-XLA path for CPU, the KV write, and the
plain-jnp test oracle (pallas_kernels.reference, not imported here); and the grouped matmul of
mixture-of-experts layers (a Pallas kernel, or XLA's ragged_dot); and the multi-LoRA update.

Stands alone: imports only jax, numpy, the standard library and itself.
KV pages per layer: [num_pages, page_size, num_kv_heads, head_dim]; page 0 is the null page.
Attention options shared by every entry point (sliding_window, scale, logit_soft_cap): see
pallas_kernels.common.

Modules: dispatch (the KV write and the backend choice), paged_decode and ragged_prefill (Pallas kernels through
the Triton lowering, sharing pallas_common), mosaic_decode and mosaic_ragged (Pallas Mosaic GPU kernels for Hopper,
sharing mosaic_common), xla_paged (CPU path), common (masks, options, query layout), kv_quant (int8 / fp8
pages), compat (jax-version shims), reference (test oracle), grouped_matmul (the experts' grouped-matmul kernel; the
models call it through dispatch.grouped_matmul), lora_bgmv and xla_lora (the multi-LoRA update: a Pallas kernel and
the CPU path, through dispatch.lora_update).
"""

from pallas_kernels.common import NO_WINDOW
from pallas_kernels.dispatch import attention_backend, decode_attention, ragged_attention, write_kv
from pallas_kernels.paged_decode import paged_decode_attention
from pallas_kernels.ragged_prefill import ragged_paged_attention

__all__ = [
    "NO_WINDOW",
    "attention_backend",
    "decode_attention",
    "paged_decode_attention",
    "ragged_attention",
    "ragged_paged_attention",
    "write_kv",
]

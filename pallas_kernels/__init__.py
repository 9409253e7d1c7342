"""Paged attention for jaxserve: Pallas kernels, a plain-XLA path for CPU, the plain-jnp references
(the oracle of the tests), and the KV write.

KV pages per layer: [num_pages, page_size, num_kv_heads, head_dim]; page 0 is the null page.
"""

from pallas_kernels.dispatch import attention_backend, decode_attention, ragged_attention
from pallas_kernels.paged_decode import paged_decode_attention
from pallas_kernels.ragged_prefill import ragged_paged_attention
from pallas_kernels.reference import paged_decode_attention as reference_paged_decode_attention
from pallas_kernels.reference import ragged_paged_attention as reference_ragged_paged_attention
from pallas_kernels.reference import write_kv

__all__ = [
    "attention_backend",
    "decode_attention",
    "paged_decode_attention",
    "ragged_attention",
    "ragged_paged_attention",
    "reference_paged_decode_attention",
    "reference_ragged_paged_attention",
    "write_kv",
]

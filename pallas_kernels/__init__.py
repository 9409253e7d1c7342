"""Paged attention for jaxserve: Pallas kernels, their plain-jnp references, and the KV write."""

from pallas_kernels.reference import paged_decode_attention as reference_paged_decode_attention
from pallas_kernels.reference import ragged_paged_attention as reference_ragged_paged_attention
from pallas_kernels.reference import write_kv

__all__ = [
    "reference_paged_decode_attention",
    "reference_ragged_paged_attention",
    "write_kv",
]

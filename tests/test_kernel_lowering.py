"""The Pallas kernels lower for CUDA on a machine without a GPU (jax.export, platforms=['cuda'])."""

import jax
import jax.numpy as jnp
import pytest

from jaxserve import compat
from pallas_kernels import dispatch

# (head_dim, query heads per KV head, page_size, dtype): Llama-3-8B-like, odd GQA, MHA.
SHAPES = [
    (128, 4, 16, jnp.bfloat16),
    (64, 3, 8, jnp.float32),
    (128, 1, 32, jnp.bfloat16),
]
NUM_KV_HEADS, NUM_PAGES, MAX_PAGES, NUM_SEQS, NUM_TOKENS = 2, 64, 12, 4, 96


def page_specs(head_dim, page_size, dtype):
    pages = jax.ShapeDtypeStruct((NUM_PAGES, page_size, NUM_KV_HEADS, head_dim), dtype)
    table = jax.ShapeDtypeStruct((NUM_SEQS, MAX_PAGES), jnp.int32)
    lens = jax.ShapeDtypeStruct((NUM_SEQS,), jnp.int32)
    return pages, pages, table, lens


def pallas_custom_calls(module_text):
    return [target for target in compat.PALLAS_GPU_CUSTOM_CALL_TARGETS if f"@{target}(" in module_text]


@pytest.mark.parametrize("head_dim,group,page_size,dtype", SHAPES)
def test_decode_kernel_lowers_for_cuda(head_dim, group, page_size, dtype):
    q = jax.ShapeDtypeStruct((NUM_SEQS, group * NUM_KV_HEADS, head_dim), dtype)

    def decode(*args):
        return dispatch.decode_attention("pallas", *args)

    text = compat.lower_for_cuda(decode, q, *page_specs(head_dim, page_size, dtype))
    assert pallas_custom_calls(text), "no Pallas GPU kernel call in the lowered module"
    assert "paged_decode" in text


@pytest.mark.parametrize("head_dim,group,page_size,dtype", SHAPES)
def test_ragged_kernel_lowers_for_cuda(head_dim, group, page_size, dtype):
    q = jax.ShapeDtypeStruct((NUM_TOKENS, group * NUM_KV_HEADS, head_dim), dtype)
    starts = jax.ShapeDtypeStruct((NUM_SEQS + 1,), jnp.int32)

    def ragged(*args):
        return dispatch.ragged_attention("pallas", *args)

    text = compat.lower_for_cuda(ragged, q, *page_specs(head_dim, page_size, dtype), starts)
    assert pallas_custom_calls(text), "no Pallas GPU kernel call in the lowered module"
    assert "ragged" in text


@pytest.mark.parametrize("head_dim,group,page_size,dtype", SHAPES)
def test_ragged_kernel_with_key_limits_lowers_for_cuda(head_dim, group, page_size, dtype):
    """With image spans' key limits (one more operand) and a window operand."""
    q = jax.ShapeDtypeStruct((NUM_TOKENS, group * NUM_KV_HEADS, head_dim), dtype)
    starts = jax.ShapeDtypeStruct((NUM_SEQS + 1,), jnp.int32)
    limits = jax.ShapeDtypeStruct((NUM_TOKENS,), jnp.int32)
    window = jax.ShapeDtypeStruct((), jnp.int32)

    def ragged(q, k, v, table, lens, starts, limits, window):
        return dispatch.ragged_attention("pallas", q, k, v, table, lens, starts, key_limit=limits,
                                         sliding_window=window)

    text = compat.lower_for_cuda(ragged, q, *page_specs(head_dim, page_size, dtype), starts, limits, window)
    assert pallas_custom_calls(text), "no Pallas GPU kernel call in the lowered module"


def test_reference_lowers_without_pallas_calls():
    q = jax.ShapeDtypeStruct((NUM_SEQS, 4 * NUM_KV_HEADS, 128), jnp.bfloat16)

    def decode(*args):
        return dispatch.decode_attention("reference", *args)

    text = compat.lower_for_cuda(decode, q, *page_specs(128, 16, jnp.bfloat16))
    assert not pallas_custom_calls(text)


@pytest.mark.parametrize("kind", ["decode", "ragged"])
def test_kernels_with_window_and_soft_cap_lower_for_cuda(kind):
    """Gemma 2's options: the window an int32 operand (the loops start at a traced block), the
    soft-cap's tanh and a custom scale inside the kernel."""
    head_dim, group, page_size, dtype = SHAPES[0]
    options = dict(scale=256**-0.5, logit_soft_cap=50.0)
    window = jax.ShapeDtypeStruct((), jnp.int32)
    pages = page_specs(head_dim, page_size, dtype)
    if kind == "decode":
        q = jax.ShapeDtypeStruct((NUM_SEQS, group * NUM_KV_HEADS, head_dim), dtype)

        def attention(q, k, v, table, lens, window):
            return dispatch.decode_attention("pallas", q, k, v, table, lens, sliding_window=window, **options)

        text = compat.lower_for_cuda(attention, q, *pages, window)
    else:
        q = jax.ShapeDtypeStruct((NUM_TOKENS, group * NUM_KV_HEADS, head_dim), dtype)
        starts = jax.ShapeDtypeStruct((NUM_SEQS + 1,), jnp.int32)

        def attention(q, k, v, table, lens, starts, window):
            return dispatch.ragged_attention(
                "pallas", q, k, v, table, lens, starts, sliding_window=window, **options)

        text = compat.lower_for_cuda(attention, q, *pages, starts, window)
    assert pallas_custom_calls(text), "no Pallas GPU kernel call in the lowered module"

"""The one place that decides which attention implementation runs.

Backends:
  "pallas"     the Pallas kernels compiled for the GPU (Triton lowering, see jaxserve.compat);
  "interpret"  the same kernels in Pallas interpret mode (runs anywhere, slowly: for tests);
  "xla"        plain XLA that loops over the context a few pages at a time (xla_paged.py): the
               fast path on CPU;
  "reference"  the plain-jnp oracle in reference.py (the whole context at once).
Default: "pallas" when jax's default backend is a GPU with the Pallas GPU lowering available,
"xla" otherwise. An explicit override, else the JAXSERVE_ATTENTION_BACKEND environment
variable, wins.
"""

import os

import jax

from jaxserve import compat
from pallas_kernels import paged_decode, ragged_prefill, reference, xla_paged

BACKENDS = ("pallas", "interpret", "xla", "reference")
BACKEND_ENV_VAR = "JAXSERVE_ATTENTION_BACKEND"


def attention_backend(override: str | None = None) -> str:
    """Backend name to use: `override`, else $JAXSERVE_ATTENTION_BACKEND, else by platform."""
    choice = override or os.environ.get(BACKEND_ENV_VAR) or None
    if choice is not None:
        choice = choice.strip().lower()
        if choice not in BACKENDS:
            source = "override" if override else BACKEND_ENV_VAR
            raise ValueError(
                f"unknown attention backend {choice!r} from {source}; expected one of {BACKENDS}"
            )
        return choice
    if jax.default_backend() in ("gpu", "cuda", "rocm") and compat.has_pallas_triton():
        return "pallas"
    return "xla"


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")


def decode_attention(backend: str, q, k_pages, v_pages, block_table, seq_lens, *, scale=None):
    """paged_decode_attention through `backend` (see reference.paged_decode_attention)."""
    _check_backend(backend)
    if backend == "reference":
        return reference.paged_decode_attention(q, k_pages, v_pages, block_table, seq_lens, scale=scale)
    if backend == "xla":
        return xla_paged.paged_decode_attention(q, k_pages, v_pages, block_table, seq_lens, scale=scale)
    return paged_decode.paged_decode_attention(
        q, k_pages, v_pages, block_table, seq_lens, scale=scale, interpret=backend == "interpret"
    )


def ragged_attention(
    backend: str, q, k_pages, v_pages, block_table, seq_lens, query_start_loc, *, scale=None
):
    """ragged_paged_attention through `backend` (see reference.ragged_paged_attention)."""
    _check_backend(backend)
    if backend in ("reference", "xla"):
        module = reference if backend == "reference" else xla_paged
        return module.ragged_paged_attention(
            q, k_pages, v_pages, block_table, seq_lens, query_start_loc, scale=scale
        )
    return ragged_prefill.ragged_paged_attention(
        q, k_pages, v_pages, block_table, seq_lens, query_start_loc,
        scale=scale, interpret=backend == "interpret",
    )

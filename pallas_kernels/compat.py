"""The jax-version shims the Pallas kernels need (0.10.x here, 0.11.x on GPU).

The kernels are written for the Triton lowering of Pallas (selected by passing Triton compiler
params, whatever `jax_pallas_use_mosaic_gpu` says). Upstream marks that lowering deprecated since
jax 0.11 in favour of Mosaic GPU, whose `pallas_call` path is itself deprecated for
`plgpu.kernel`; the gather-by-page-table loads these kernels rely on map directly onto Triton
pointers, so Triton stays the choice until a Mosaic GPU port is written and measured on hardware.
If a jax release drops the Triton lowering, `pallas_gpu_compiler_params` raises a clear error and
`pallas_kernels.dispatch` does not pick the "pallas" backend.
"""

import contextlib
import warnings

import jax
from jax.experimental import pallas as pl


def squeezed_block_dim():
    """Marker for a BlockSpec dimension of size 1 that the kernel does not see."""
    return getattr(pl, "squeezed", None)


def pallas_gpu_compiler_params(num_warps: int, num_stages: int):
    """Compiler params that select the Triton lowering of `pl.pallas_call` on GPU."""
    try:
        from jax.experimental.pallas import triton as pallas_triton
    except ImportError as error:  # a jax without the Triton lowering
        raise NotImplementedError(
            f"jax {jax.__version__} has no Pallas Triton lowering; use the 'xla' or 'reference' "
            "attention backend"
        ) from error
    return pallas_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def has_pallas_triton() -> bool:
    """Whether this jax still ships the Pallas Triton lowering."""
    try:
        from jax.experimental.pallas import triton as pallas_triton
    except ImportError:
        return False
    return pallas_triton is not None


@contextlib.contextmanager
def quiet_pallas_deprecations():
    """Silences the DeprecationWarning newer jax emits for the Triton lowering."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*[Tt]riton.*")
        warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*pallas.*")
        yield


def masked_store(ref, value, mask):
    """Stores `value` into `ref` (a whole ref or a `ref.at[...]` view) where `mask` is true only:
    the Triton lowering's masked store, which its interpreter runs too."""
    from jax.experimental.pallas import triton as pallas_triton
    store = getattr(pallas_triton, "store", None)
    if store is not None:
        return store(ref, value, mask=mask)
    return pl.store(ref, (), value, mask=mask)  # a jax whose Triton module has no store of its own

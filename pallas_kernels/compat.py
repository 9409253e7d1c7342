"""The jax-version shims the Pallas kernels need (0.10.x here, 0.11.x on GPU).

Two kernel families: paged_decode / ragged_prefill are written for the Triton lowering of Pallas
(selected by passing Triton compiler params), which upstream marks deprecated since jax 0.11;
mosaic_decode / mosaic_ragged are written for Mosaic GPU (`plgpu.kernel`, Hopper's TMA and
wgmma), whose API and CPU interpreter this project uses from jax 0.11 on (`mosaic_gpu` says
NotImplementedError before). If a jax release drops the Triton lowering,
`pallas_gpu_compiler_params` raises a clear error and `pallas_kernels.dispatch` picks the Mosaic
kernels on Hopper. Private jax state (the interpreter's race detector) is read here only.
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


def mosaic_gpu():
    """jax's Pallas Mosaic GPU module (`plgpu`), with its CPU interpreter (jax >= 0.11);
    NotImplementedError on a jax without them."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError as error:
        raise NotImplementedError(f"jax {jax.__version__} has no Pallas Mosaic GPU backend") from error
    if not hasattr(plgpu, "InterpretGPUParams"):
        raise NotImplementedError(f"jax {jax.__version__}'s Pallas Mosaic GPU has no interpreter; the Mosaic "
                                  "kernels need jax >= 0.11")
    return plgpu


def has_mosaic_gpu() -> bool:
    """Whether this jax has the Pallas Mosaic GPU backend the Mosaic kernels are written for."""
    try:
        mosaic_gpu()
    except NotImplementedError:
        return False
    return True


def mosaic_interpret_params():
    """Mosaic GPU interpreter settings for the kernels' tests: race detection on."""
    return mosaic_gpu().InterpretGPUParams(detect_races=True)


def mosaic_races_found() -> bool:
    """Whether Mosaic GPU's interpreter has reported a data race (printed "RACE DETECTED") since
    the process started: it keeps that in private state, which moves between jax releases."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    try:
        return bool(gpu_callbacks.get_races().races_found)
    except AssertionError:  # no kernel interpreted yet
        return False

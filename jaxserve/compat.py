"""The one place that knows about differences between jax versions (0.10.x here, 0.11.x on GPU).

Everything else in jaxserve and pallas_kernels imports these helpers instead of probing jax.

Pallas GPU lowering: the kernels are written for the Triton lowering of Pallas (selected by
passing Triton compiler params, whatever `jax_pallas_use_mosaic_gpu` says). Upstream marks that
lowering deprecated since jax 0.11 in favour of Mosaic GPU, whose `pallas_call` path is itself
deprecated for `plgpu.kernel`; the gather-by-page-table loads these kernels rely on map directly
onto Triton pointers, so Triton stays the choice until a Mosaic GPU port is written and measured
on hardware. If a jax release drops the Triton lowering, `pallas_gpu_compiler_params` raises a
clear error and `pallas_kernels.dispatch` falls back to the reference on GPU.
"""

import contextlib
import dataclasses
import warnings

import jax
from jax.experimental import pallas as pl

PALLAS_GPU_LOWERING = "triton"

# Custom-call targets a Pallas GPU kernel lowers to, across jax versions and both lowerings.
PALLAS_GPU_CUSTOM_CALL_TARGETS = (
    "__gpu$xla.gpu.triton",  # Triton lowering, jaxlib <= 0.10.2 (Triton IR compiled by XLA)
    "triton_kernel_call_ffi",  # Triton lowering, newer jaxlib (compiled at lowering time)
    "triton_kernel_call",
    "mosaic_gpu_v2",  # Mosaic GPU lowering
    "mosaic_gpu",
)

# A Hopper part: the compute capability the Triton lowering assumes when no GPU is attached.
_ABSTRACT_CUDA_DEVICE_KIND = "NVIDIA H100 80GB HBM3"
_ABSTRACT_CUDA_COMPUTE_CAPABILITY = "9.0"


def squeezed_block_dim():
    """Marker for a BlockSpec dimension of size 1 that the kernel does not see."""
    return getattr(pl, "squeezed", None)


def pallas_gpu_compiler_params(num_warps: int, num_stages: int):
    """Compiler params that select the Triton lowering of `pl.pallas_call` on GPU."""
    try:
        from jax.experimental.pallas import triton as pallas_triton
    except ImportError as error:  # a jax without the Triton lowering
        raise NotImplementedError(
            f"jax {jax.__version__} has no Pallas Triton lowering; use the 'reference' attention backend"
        ) from error
    return pallas_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def has_pallas_triton() -> bool:
    """Whether this jax still ships the Pallas Triton lowering."""
    try:
        from jax.experimental.pallas import triton  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def quiet_pallas_deprecations():
    """Silences the DeprecationWarning newer jax emits for the Triton lowering."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*[Tt]riton.*")
        warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*pallas.*")
        yield


def _abstract_cuda_device():
    """A jax.sharding.AbstractDevice for a CUDA GPU, filling whichever fields this jax defines."""
    abstract_device_type = getattr(jax.sharding, "AbstractDevice", None)
    if abstract_device_type is None:
        return None
    known = {
        "device_kind": _ABSTRACT_CUDA_DEVICE_KIND,
        "num_cores": None,
        "platform": "cuda",
        "compute_capability": _ABSTRACT_CUDA_COMPUTE_CAPABILITY,
    }
    try:
        if dataclasses.is_dataclass(abstract_device_type):
            names = [field.name for field in dataclasses.fields(abstract_device_type) if field.init]
            return abstract_device_type(**{name: known.get(name) for name in names})
        return abstract_device_type(
            device_kind=_ABSTRACT_CUDA_DEVICE_KIND, num_cores=None, platform="cuda"
        )
    except (TypeError, ValueError):  # a signature this module does not know: lower without it
        return None


@contextlib.contextmanager
def abstract_cuda_target():
    """Context in which tracing and lowering see a CUDA GPU although none is attached."""
    device = _abstract_cuda_device()
    use_abstract_mesh = getattr(jax.sharding, "use_abstract_mesh", None)
    if device is None or use_abstract_mesh is None:
        yield
        return
    mesh = jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=device)
    with use_abstract_mesh(mesh):
        yield


def lower_for_cuda(function, *arg_specs) -> str:
    """StableHLO text of `function` exported for CUDA; works on a machine without a GPU.

    arg_specs: jax.ShapeDtypeStruct (or arrays) for the positional arguments.
    """
    disabled = [jax.export.DisabledSafetyCheck.custom_call(t) for t in PALLAS_GPU_CUSTOM_CALL_TARGETS]
    jitted = function if hasattr(function, "trace") else jax.jit(function)
    with abstract_cuda_target(), quiet_pallas_deprecations():
        exported = jax.export.export(jitted, platforms=["cuda"], disabled_checks=disabled)(*arg_specs)
    return exported.mlir_module()

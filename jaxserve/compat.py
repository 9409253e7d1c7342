"""What jaxserve knows about differences between jax versions (0.10.x here, 0.11.x on GPU),
beyond the kernels' own shims (pallas_kernels.compat): the custom-call targets a Pallas GPU kernel
lowers to, and lowering for CUDA on a machine without a GPU (tests, gpu_compile).

Pallas GPU lowering: the kernels use the Triton lowering of Pallas; see pallas_kernels.compat for
why, and for what happens on a jax without it.
"""

import contextlib
import dataclasses

import jax

from pallas_kernels.compat import quiet_pallas_deprecations

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

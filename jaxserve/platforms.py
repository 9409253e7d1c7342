"""Which jax platform to start, decided before jax is imported (no jax here).

With jax's CUDA plugin installed on a machine without an NVIDIA GPU (the `gpu-compile` extra, for
compiling the GPU build on a CPU machine), jax would try CUDA first at start-up and log a
traceback before it falls back to the CPU; the plugin needs JAX_PLATFORMS=cpu there.
"""
from __future__ import annotations

import importlib.util
import os

from jaxserve import environment

CUDA_PLUGINS = ("xla_cuda12", "xla_cuda13")  # jax's CUDA 12 and CUDA 13 plugins (jax[cuda12], jax[cuda13])


def default_to_cpu_without_gpu() -> None:
    """Sets JAX_PLATFORMS=cpu when it is unset, jax's CUDA plugin is installed and the machine has
    no NVIDIA GPU (no /dev/nvidiactl). Call before jax is imported; a no-op anywhere else."""
    if environment.jax_platforms_chosen() or os.path.exists("/dev/nvidiactl"):
        return
    if importlib.util.find_spec("jax_plugins") and any(importlib.util.find_spec(f"jax_plugins.{plugin}")
                                                       for plugin in CUDA_PLUGINS):
        os.environ["JAX_PLATFORMS"] = "cpu"

"""Finding jax's CUDA plugin and ptxas without a GPU: CUDA 12's and CUDA 13's wheels alike."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # subprocesses: out of `make test-quick`

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _fake_package(root: pathlib.Path, dotted: str) -> pathlib.Path:
    """A namespace-package folder `dotted` under `root` (no __init__ above the leaf), as the wheels lay out."""
    folder = root.joinpath(*dotted.split("."))
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    return folder


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="a machine with an NVIDIA GPU keeps its platform")
@pytest.mark.parametrize("plugin", ["xla_cuda12", "xla_cuda13"])
def test_a_cuda_plugin_without_a_gpu_means_the_cpu(tmp_path, plugin):
    _fake_package(tmp_path, f"jax_plugins.{plugin}")
    code = ("import os; from jaxserve import platforms; platforms.default_to_cpu_without_gpu(); "
            "print(os.environ.get('JAX_PLATFORMS'))")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "cpu"


@pytest.mark.parametrize("package", ["nvidia.cuda_nvcc", "nvidia.cu13"])
def test_ptxas_of_either_nvcc_wheel_is_found(tmp_path, package):
    """CUDA 12's nvidia-cuda-nvcc-cu12 puts ptxas in nvidia/cuda_nvcc/bin, CUDA 13's in nvidia/cu13/bin."""
    ptxas = _fake_package(tmp_path, package) / "bin" / "ptxas"
    ptxas.parent.mkdir()
    ptxas.write_text("#!/bin/sh\n")
    ptxas.chmod(0o755)
    code = ("import sys; from jaxserve.planning import gpu_compile; "
            f"gpu_compile.PTXAS_PACKAGES = tuple(p for p in gpu_compile.PTXAS_PACKAGES if p == {package!r}); "
            "print(gpu_compile.ptxas_path())")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]), JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == str(ptxas)

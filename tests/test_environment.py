"""The environment variables jaxserve reads: all through jaxserve.environment (cpu_kernels, below
jaxserve, reads its own in one function), each named in that module's docstring and in
docs/commands.md; and the engine flags named in docs/commands.md."""
from __future__ import annotations

import ast
import pathlib
import re

import jax
import pytest

from jaxserve import environment
from jaxserve.commands import engine_flags
from jaxserve.executor.device_setup import attention_backend
from tests.test_layout import ROOT, module_name, project_modules

# Modules that touch os.environ: the one reader, cpu_kernels' (see jaxserve.environment), and two
# that set a variable for jax or transformers before they are imported.
TOUCH_THE_ENVIRONMENT = {"jaxserve.environment", "cpu_kernels", "jaxserve.platforms", "jaxserve.commands.cli"}


def environ_uses(path: pathlib.Path) -> int:
    return sum(isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
               and isinstance(node.value, ast.Name) and node.value.id == "os"
               for node in ast.walk(ast.parse(path.read_text())))


def test_only_the_environment_module_reads_variables():
    readers = {module_name(p) for p in project_modules() if environ_uses(p)}
    assert readers <= TOUCH_THE_ENVIRONMENT, f"read os.environ outside jaxserve.environment: {readers - TOUCH_THE_ENVIRONMENT}"


def test_every_variable_is_documented():
    named = set()
    for path in project_modules():
        named |= set(re.findall(r"JAXSERVE_[A-Z_]*[A-Z]", path.read_text()))
    docs = (ROOT / "docs" / "commands.md").read_text()
    assert named and not {v for v in named if v not in environment.__doc__}
    assert not {v for v in named if v not in docs}, "JAXSERVE_ variables missing from docs/commands.md"


def test_every_engine_flag_is_in_the_docs():
    docs = (ROOT / "docs" / "commands.md").read_text()
    assert not [name for name in engine_flags.ENGINE_FLAGS if f"--{name}" not in docs]


def test_attention_backend_choice(monkeypatch):
    monkeypatch.delenv(environment.ATTENTION_BACKEND, raising=False)
    on_gpu = jax.default_backend() == "gpu"
    assert attention_backend(None) == ("pallas" if on_gpu else "xla")
    monkeypatch.setenv(environment.ATTENTION_BACKEND, "Interpret")
    assert attention_backend(None) == "interpret"
    assert attention_backend("reference") == "reference"
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention_backend("cuda-magic")
    monkeypatch.setenv(environment.ATTENTION_BACKEND, "fast")
    with pytest.raises(ValueError, match=environment.ATTENTION_BACKEND):
        attention_backend(None)


def test_cache_root_and_the_compilation_cache(monkeypatch, tmp_path):
    monkeypatch.setenv(environment.CACHE, str(tmp_path))
    monkeypatch.delenv(environment.COMPILATION_CACHE, raising=False)
    assert environment.cache_root() == str(tmp_path)
    assert environment.compilation_cache_dir() == str(tmp_path / "xla")
    monkeypatch.setenv(environment.COMPILATION_CACHE, "")
    assert environment.compilation_cache_dir() is None


def test_the_automatic_executable_store_can_be_switched_off(monkeypatch, tmp_path):
    from jaxserve.executor import executables
    monkeypatch.setenv(environment.CACHE, str(tmp_path))
    monkeypatch.delenv(environment.COMPILATION_CACHE, raising=False)
    monkeypatch.delenv(environment.EXECUTABLES_CACHE, raising=False)
    assert environment.executables_cache() and executables.default_directory() == str(tmp_path / "executables")
    monkeypatch.setenv(environment.EXECUTABLES_CACHE, "0")
    assert not environment.executables_cache() and executables.default_directory() is None
    assert environment.compilation_cache_dir() == str(tmp_path / "xla")  # the compilation cache stays on
    monkeypatch.setenv(environment.EXECUTABLES_CACHE, "1")
    assert executables.default_directory() == str(tmp_path / "executables")

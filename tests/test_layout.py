"""The package's shape (README, "Architecture"): which room may import which, and a jax-free core.

Read from the source with `ast` (imports inside functions count too), so the checks cost
milliseconds; the jax-free check imports the host modules in a fresh interpreter.
"""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Rooms from the bottom up: a module may import its own room and the rooms listed before it.
LAYERS = [
    ("pallas_kernels", "cpu_kernels"),  # kernels: jax only
    ("jaxserve.environment", "jaxserve.compat", "jaxserve.platforms", "jaxserve.settings", "jaxserve.setting_checks",
     "jaxserve.moe_config", "jaxserve.config"),
    ("jaxserve.core", "jaxserve.speculative.verification", "jaxserve.speculative.ngram",
     "jaxserve.pooling.config", "jaxserve.pooling.accumulate", "jaxserve.multimodal"),  # host side, no jax
    # device side: model code, the step and its setup, parallelism, the draft model, memory planning
    ("jaxserve.models", "jaxserve.executor", "jaxserve.parallel", "jaxserve.speculative.draft_proposer",
     "jaxserve.planning", "jaxserve.pooling.poolers"),
    ("checkpoints",),
    ("jaxserve.engine", "jaxserve.async_engine"),
    ("serve",),
    ("jaxserve.commands",),
    # the user benchmarks, modes of `jaxserve bench`: an HTTP client, and in-process engine runs
    # (with the engine flags of jaxserve.commands.engine_flags)
    ("jaxserve.benchmarks",),
]
HOST_ROOMS = ("jaxserve.core", "jaxserve.speculative.verification", "jaxserve.speculative.ngram", "jaxserve.config",
              "jaxserve.moe_config", "jaxserve.settings", "jaxserve.setting_checks", "jaxserve.environment", "jaxserve.pooling.config",
              "jaxserve.pooling.accumulate", "jaxserve.multimodal")


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> list[pathlib.Path]:
    return sorted(p for package in ("jaxserve", "serve", "checkpoints", "pallas_kernels", "cpu_kernels")
                  for p in (ROOT / package).rglob("*.py"))


def imported_names(path: pathlib.Path) -> set[str]:
    """Every module the file imports, at the top or in a function (`from a import b` gives a.b
    where a.b is a module of the project, else a)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            for alias in node.names:
                candidate = ROOT.joinpath(*node.module.split("."), alias.name)
                if candidate.with_suffix(".py").exists() or (candidate / "__init__.py").exists():
                    names.add(f"{node.module}.{alias.name}")
    return names


def layer_of(name: str) -> int | None:
    for index, rooms in enumerate(LAYERS):
        if any(name == room or name.startswith(room + ".") for room in rooms):
            return index
    return None


def test_every_module_has_a_room():
    packages = ("jaxserve", "jaxserve.speculative", "jaxserve.pooling")
    homeless = [module_name(p) for p in project_modules()
                if layer_of(module_name(p)) is None and module_name(p) not in packages]
    assert not homeless, f"modules in no room of LAYERS: {homeless}"


def test_imports_point_down():
    upward = []
    for path in project_modules():
        own = layer_of(module_name(path))
        for name in imported_names(path):
            target = layer_of(name)
            if own is not None and target is not None and target > own:
                upward.append(f"{module_name(path)} -> {name}")
    assert not upward, "imports that run up the layers:\n" + "\n".join(sorted(upward))


def test_host_rooms_import_no_device_code():
    for path in project_modules():
        name = module_name(path)
        if any(name == room or name.startswith(room + ".") for room in HOST_ROOMS):
            device = {n for n in imported_names(path) if n == "jax" or n.startswith(("jax.", "jaxlib", "flax"))}
            assert not device, f"{name} imports {device}"


def test_the_device_side_sees_the_step_contract_not_the_scheduler():
    """The runner, sampler, draft model... work from core/step.py's plain data, never the scheduler."""
    device = LAYERS[3]
    for path in project_modules():
        name = module_name(path)
        if any(name == room or name.startswith(room + ".") for room in device):
            assert "jaxserve.core.scheduler" not in imported_names(path), f"{name} imports the scheduler"

def test_host_modules_do_not_import_jax():
    host = [module_name(p) for p in project_modules()
            if any(module_name(p) == room or module_name(p).startswith(room + ".") for room in HOST_ROOMS)]
    host += ["serve.protocol", "serve.prompts", "serve.shaping", "serve.tool_parsers", "serve.reasoning",
             "serve.pooling_protocol", "serve.pair_prompts", "serve.images", "serve.tokenize_routes",
             "jaxserve.benchmarks.datasets", "jaxserve.benchmarks.client", "jaxserve.benchmarks.results",
             "jaxserve.benchmarks.runner", "jaxserve.benchmarks.sweep", "jaxserve.benchmarks.plot",
             "jaxserve.benchmarks.server_metrics", "jaxserve.benchmarks.serve",
             "checkpoints.lora_adapter"]  # LoRA adapters are read and checked on the host
    code = (f"import importlib, sys; [importlib.import_module(m) for m in {host!r}]; "
            "assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


LIBRARY = ("jaxserve", "serve")  # the style limits below hold in these packages
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 600


def library_modules() -> list[pathlib.Path]:
    return sorted(p for package in LIBRARY for p in (ROOT / package).rglob("*.py"))


def test_functions_and_modules_stay_short():
    long = []
    for path in library_modules():
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long.append(f"{module_name(path)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{module_name(path)}.{node.name}: {lines} lines")
    assert not long, f"over {MAX_FUNCTION_LINES} lines a function or {MAX_MODULE_LINES} a module:\n" + "\n".join(long)


def test_function_level_imports_say_why():
    """An import inside a function hides an arrow of the graph: it is there for an optional
    dependency, a cycle or start-up order, and its line (or the line above) says which."""
    silent = []
    for path in library_modules():
        lines = path.read_text().splitlines()
        # A module-wide reason for its jax imports: "# jax itself is imported inside the functions: why".
        jax_deferred = any(line.startswith("# jax itself is imported inside the functions") for line in lines)
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(node):
                    if not isinstance(sub, (ast.Import, ast.ImportFrom)):
                        continue
                    module = sub.module if isinstance(sub, ast.ImportFrom) else sub.names[0].name
                    if jax_deferred and (module == "jax" or module.startswith("jax.")):
                        continue
                    if not _import_says_why(lines, sub.lineno - 1):
                        silent.append(f"{path.relative_to(ROOT)}:{sub.lineno}: {lines[sub.lineno - 1].strip()}")
    assert not silent, "function-level imports without a reason:\n" + "\n".join(sorted(set(silent)))


def _import_says_why(lines: list[str], index: int) -> bool:
    """A comment on the import's line, on another import of its block, or on the line above the block."""
    start = end = index
    while start > 0 and lines[start - 1].strip().startswith(("import ", "from ")):
        start -= 1
    while end + 1 < len(lines) and lines[end + 1].strip().startswith(("import ", "from ")):
        end += 1
    return any("#" in line for line in lines[start:end + 1]) or lines[start - 1].strip().startswith("#")


def test_no_assignment_to_another_objects_private_attribute():
    """Seams, not patches: nothing sets `other._name` (only `self._name` / `cls._name`)."""
    patches = []
    for path in library_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                if (isinstance(target, ast.Attribute) and target.attr.startswith("_")
                        and not target.attr.startswith("__")
                        and not (isinstance(target.value, ast.Name) and target.value.id in ("self", "cls"))):
                    patches.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{target.attr}")
    assert not patches, "assignments to another object's private attribute:\n" + "\n".join(patches)


def test_no_script_shadows_an_installed_module():
    """`python bench/x.py` puts bench/ first on sys.path (and pytest puts tests/ there), so a file
    named like an installed package replaces it for every library that imports it: transformers'
    tokenizer loading imports `kernels` (the hub kernels package it depends on), which a
    bench/kernels.py once answered."""
    import importlib.metadata  # only this test reads the installed distributions
    installed = importlib.metadata.packages_distributions()
    shadows = [f"{path.relative_to(ROOT)} shadows {path.stem!r} of {', '.join(installed[path.stem])}"
               for folder in ("bench", "tests") for path in sorted((ROOT / folder).glob("*.py"))
               if path.stem in installed]
    assert not shadows, "\n".join(shadows)


# ---- the test suite's split ---------------------------------------------------------------------
# The modules `make test-quick` runs (`pytest -m "not slow"`): host-side and unit tests, no engine,
# no model server (HTTP clients meet in-process fakes), no subprocess but a bare `python -c` import
# check. tests/conftest.py
# still marks, in these, each test that uses a server or engine fixture. Every other module says
# `pytestmark = pytest.mark.slow` itself; a new module goes in one group or the other.
QUICK_TEST_MODULES = {
    "test_bench_datasets", "test_bench_multiturn", "test_kv_offload", "test_bench_serve", "test_buckets", "test_engine_client",
    "test_environment", "test_pooling_config", "test_pooling_protocol",
    "test_grammar_sandbox", "test_kernel_lowering", "test_layout", "test_lora_registry", "test_lora_adapters",
    "test_memory", "test_metrics_names",
    "test_output_processor", "test_page_allocator", "test_predict", "test_progress", "test_protocol",
    "test_reasoning", "test_request", "test_responses", "test_sampler", "test_scheduler", "test_settings",
    "test_shape_choice", "test_step_diagnosis", "test_tool_parsers", "test_tools",
    "test_image_processing", "test_multimodal_media", "test_encoder_cache",
}


def marked_slow(path: pathlib.Path) -> bool:
    """Whether the module assigns `pytestmark` a value that holds `pytest.mark.slow`."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            if any(isinstance(n, ast.Attribute) and n.attr == "slow" and isinstance(n.value, ast.Attribute)
                   and n.value.attr == "mark" for n in ast.walk(node.value)):
                return True
    return False


def test_every_test_module_is_marked_slow_or_listed_as_quick():
    modules = {path.stem: marked_slow(path) for path in (ROOT / "tests").glob("test_*.py")}
    neither = sorted(name for name, slow in modules.items() if not slow and name not in QUICK_TEST_MODULES)
    both = sorted(name for name, slow in modules.items() if slow and name in QUICK_TEST_MODULES)
    assert not neither, f"mark these `pytestmark = pytest.mark.slow` or list them in QUICK_TEST_MODULES: {neither}"
    assert not both, f"marked slow and listed as quick: {both}"
    assert QUICK_TEST_MODULES <= modules.keys(), f"listed, not there: {sorted(QUICK_TEST_MODULES - modules.keys())}"

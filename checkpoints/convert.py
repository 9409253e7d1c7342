"""Convert a Hugging Face folder or a GGUF file into a jaxserve model directory.

Output layout: `config.json` (ModelConfig.to_hf_dict), `params/` (orbax checkpoint of the pytree
in `checkpoints.layout`), tokenizer files, `jaxserve.json` (format version, source). A
vision-language model adds `vision/` (orbax checkpoint of its tower's and projector's params, the
pytree of jaxserve.models.qwen_vision / siglip, float in the conversion's dtype: `--quantization`
applies to the language model only) and its image processor files (`preprocessor_config.json`,
`processor_config.json`; the chat template goes with the tokenizer files). The directory
is assembled next to the destination and renamed into place at the end, so a failed conversion
leaves nothing behind.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time

import ml_dtypes
import numpy as np

from checkpoints import FORMAT_VERSION, MARKER_FILE, PARAMS_DIR, VISION_DIR, ConversionError
from checkpoints.gguf_source import GGUFSource
from checkpoints.hf_source import HFSource
from checkpoints.layout import ParamBuffers
from checkpoints.pooling_checkpoint import save_pooling_files
from jaxserve.config import ModelConfig
from jaxserve.core.progress import Progress

logger = logging.getLogger(__name__)

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "float16": np.dtype(np.float16)}


def open_source(path: str) -> HFSource | GGUFSource:
    """The conversion source at `path`: a Hugging Face model folder or a `.gguf` file."""
    if os.path.isdir(path):
        return HFSource(path)
    if not os.path.exists(path):
        raise ConversionError(f"{path}: no such file or directory")
    if path.endswith(".gguf"):
        return GGUFSource(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ConversionError(f"{path}: cannot read ({e.strerror or e})") from None
    if magic == b"GGUF":
        return GGUFSource(path)
    raise ConversionError(f"{path}: neither a Hugging Face model folder nor a GGUF file")


def dtype_from_name(name: str) -> np.dtype:
    if name not in DTYPES:
        raise ConversionError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def convert_checkpoint(source_path: str, output_dir: str, dtype: str | None = None,
                       overwrite: bool = False, quantization: str | None = None) -> ModelConfig:
    """Converts `source_path` into `output_dir`; returns the model's config.

    `dtype` (float32, bfloat16, float16) defaults to float32 for GGUF sources and to the
    embedding table's dtype for Hugging Face sources. `quantization` ("int8", "int4", ... see
    jaxserve.models.quantization) stores the linear layers quantized (checkpoints.quantized).
    Raises ConversionError on bad input.
    """
    fmt = None
    if quantization:
        from jaxserve.models.quantization import parse_format
        try:
            fmt = parse_format(quantization)
        except ValueError as e:
            raise ConversionError(str(e)) from None
    output_dir = os.path.abspath(output_dir)
    if os.path.exists(output_dir) and not overwrite:
        raise ConversionError(f"{output_dir}: already exists")
    target_dtype = None if dtype is None else dtype_from_name(dtype)
    source = open_source(source_path)
    target_dtype = target_dtype or source.default_dtype()
    if target_dtype.name not in DTYPES:
        raise ConversionError(f"{source_path}: source dtype {target_dtype.name} is not a supported float dtype")
    parent = os.path.dirname(output_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}.tmp-", dir=parent)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes it private; the result is a normal directory
    except OSError as e:
        raise ConversionError(f"{output_dir}: cannot create ({e.strerror or e})") from None
    start = time.perf_counter()
    logger.info("conversion: %s -> %s (%s, once; later starts load the result)", source_path, output_dir,
                target_dtype.name if fmt is None else fmt.name)
    try:
        if isinstance(source, HFSource):  # embedding and reranking checkpoints (first: refused in a moment)
            save_pooling_files(source, staging)
        formats = _save_params(source, target_dtype, source_path, os.path.join(staging, PARAMS_DIR), fmt)
        has_tokenizer = source.save_tokenizer(staging)
        _write_json(os.path.join(staging, "config.json"), source.config.to_hf_dict())
        vision = _save_vision(source, target_dtype, staging) if source.config.multimodal_architecture else None
        _write_json(os.path.join(staging, MARKER_FILE), {
            "format_version": FORMAT_VERSION, "source": os.path.abspath(source_path),
            "source_format": source.kind, "dtype": target_dtype.name, "has_tokenizer": has_tokenizer,
            **({"vision": vision} if vision else {}),
            **({"quantization": formats} if formats else {}),
            **({"source_quantization": source.published.describe()} if getattr(source, "published", None) else {}),
        })
        _move_into_place(staging, output_dir)
        logger.info("conversion: done in %.0f s", time.perf_counter() - start)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(e, OSError):
            raise ConversionError(f"{output_dir}: cannot write ({e})") from None
        raise
    return source.config


def _save_params(source, dtype: np.dtype, source_path: str, params_dir: str, fmt=None) -> dict[str, str]:
    """Writes the parameters; returns {linear leaf: quantization format name} ({} when float)."""
    import orbax.checkpoint as ocp

    if getattr(source, "published", None) is not None:  # published quantized: kept as stored
        from checkpoints.prequantized import leaf_formats as published_formats
        from checkpoints.quantized import QuantizedParamBuffers
        if fmt is not None:
            raise ConversionError(f"{source_path}: the checkpoint is already quantized "
                                  f"({source.published.describe()}); convert it without --quantization "
                                  f"to keep its weights as published")
        leaf_fmts, _ = published_formats(source)
        buffers = QuantizedParamBuffers(source.config, dtype, source_path, leaf_fmts)
        tensors, formats = source.tensors(), {leaf: f.name for leaf, f in leaf_fmts.items()}
    elif fmt is None:
        buffers, tensors, formats = ParamBuffers(source.config, dtype, source_path), source.tensors(), {}
    else:
        from checkpoints.quantized import QuantizedParamBuffers, leaf_formats
        leaf_fmts, direct = leaf_formats(source, fmt)
        buffers = QuantizedParamBuffers(source.config, dtype, source_path, leaf_fmts)
        tensors = source.tensors(keep_blocks=frozenset(direct)) if direct else source.tensors()
        formats = {leaf: f.name for leaf, f in leaf_fmts.items()}
    with Progress(source.num_tensors(), "conversion", "tensors read", logger) as progress:
        for file, name, slot, layer, tensor, transpose in tensors:
            buffers.put(slot, layer, tensor, name, transpose, source_file=file)
            progress.advance()
    params = buffers.finish(source.describe_missing)
    logger.info("conversion: %d tensors read in %.0f s; writing the checkpoint", progress.done, progress.elapsed_s())
    with _numpy_checkpointer(ocp) as checkpointer:
        checkpointer.save(params_dir, args=ocp.args.PyTreeSave(params, save_args=_save_args(ocp, params, source.config)))
    return formats


def _save_vision(source, dtype: np.dtype, staging: str) -> dict:
    """Writes a vision-language model's vision params (`vision/`) and image processor files into
    the directory being assembled (its config.json already written); returns the marker's
    "vision" entry. The image processor is read back once here, so settings it cannot honour
    (Gemma 3's pan-and-scan, ...) are refused at conversion rather than at the first image."""
    import orbax.checkpoint as ocp

    from jaxserve.multimodal.image_processing import load_image_processor
    params = source.vision_params(dtype)
    with _numpy_checkpointer(ocp) as checkpointer:
        checkpointer.save(os.path.join(staging, VISION_DIR), args=ocp.args.PyTreeSave(params))
    has_processor = source.save_processor(staging)
    if has_processor:
        try:
            load_image_processor(staging)
        except (ValueError, TypeError, KeyError) as e:
            raise ConversionError(f"{source.folder}: the image processor cannot be served ({e})") from None
    else:
        logger.warning("conversion: %s has no preprocessor_config.json: the vision tower is converted, but images "
                       "cannot be processed until the image processor files are copied beside it", source.folder)
    return {"architecture": source.config.multimodal_architecture, "dtype": dtype.name,
            "has_image_processor": has_processor}


def _save_args(ocp, params: dict, config: ModelConfig) -> dict:
    """orbax's SaveArgs of every array: a routed expert weight ([L, E, ...], and each array of a
    quantized one) is stored one chunk per (layer, expert), so that a process that restores only
    its own experts (expert parallelism over several processes) reads and decompresses only their
    chunks; every other array is one chunk."""
    import jax

    from jaxserve.models import weights
    experts = {info.name for info in weights.weight_infos(config).values() if info.per_layer and info.per_expert}
    whole = lambda array: ocp.SaveArgs()
    per_expert = lambda array: ocp.SaveArgs(shard_axes=(0, 1) if np.ndim(array) >= 2 else ())
    return {**{name: jax.tree.map(whole, leaf) for name, leaf in params.items() if name != "layers"},
            "layers": {name: jax.tree.map(per_expert if name in experts else whole, leaf)
                       for name, leaf in params["layers"].items()}}


def _numpy_checkpointer(ocp):
    """A checkpointer that writes numpy leaves without the defensive copy orbax makes for async saves
    (we wait for the save, so the copy would only double the peak memory)."""
    try:
        import jax
        from orbax.checkpoint import type_handlers
        registry = type_handlers.create_type_handler_registry(
            (jax.Array, type_handlers.ArrayHandler()),
            (np.ndarray, type_handlers.NumpyHandler(deepcopy_host_arrays=False)))
        return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=registry))
    except (AttributeError, TypeError):  # other orbax versions: keep the default handler
        return ocp.Checkpointer(ocp.PyTreeCheckpointHandler())


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def _move_into_place(staging: str, output_dir: str) -> None:
    if not os.path.exists(output_dir):
        os.rename(staging, output_dir)
        return
    retired = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}.old-", dir=os.path.dirname(output_dir))
    os.rename(output_dir, os.path.join(retired, "model"))
    os.rename(staging, output_dir)
    shutil.rmtree(retired, ignore_errors=True)

"""Load a converted model directory: config, parameters (orbax) and tokenizer."""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

from checkpoints import FORMAT_VERSION, MARKER_FILE, PARAMS_DIR, ConversionError
from jaxserve.config import ConfigError, ModelConfig


def check_model_dir(model_dir: str) -> dict:
    """The `jaxserve.json` marker of a converted directory; ConversionError if it is not one."""
    marker_path = os.path.join(model_dir, MARKER_FILE)
    if not os.path.isfile(marker_path):
        raise ConversionError(f"{model_dir}: not a converted jaxserve model directory (no {MARKER_FILE})")
    try:
        with open(marker_path) as f:
            marker = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConversionError(f"{marker_path}: unreadable ({e})") from None
    if marker.get("format_version") != FORMAT_VERSION:
        raise ConversionError(
            f"{model_dir}: format version {marker.get('format_version')}, expected {FORMAT_VERSION}; convert it again")
    return marker


def load_config(model_dir: str) -> ModelConfig:
    check_model_dir(model_dir)
    try:
        return ModelConfig.from_json_file(os.path.join(model_dir, "config.json"))
    except ConfigError as e:
        raise ConversionError(f"{model_dir}: {e}") from None


def load_params(model_dir: str, dtype, shardings=None) -> dict:
    """The parameter pytree as jax arrays of `dtype`, cast while restoring.

    `shardings`: a pytree of `jax.sharding.Sharding` matching the parameters (default: all on the
    first device).
    """
    import orbax.checkpoint as ocp

    config = load_config(model_dir)
    shapes = config.param_shapes()
    dtype = jnp.dtype(dtype)
    formats = check_model_dir(model_dir).get("quantization")
    if formats:  # linear leaves stored as int8 / int4 dicts keep their dtypes; the rest is cast
        from jaxserve.quantization import checkpoint_structs
        if shardings is None:
            target = checkpoint_structs(shapes, dtype, formats, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        else:
            from jaxserve.sharding import quantized_checkpoint_shardings
            structs = checkpoint_structs(shapes, dtype, formats)
            try:
                array_shardings = quantized_checkpoint_shardings(shardings, structs)
            except ValueError as e:
                raise ConversionError(f"{model_dir}: {e}") from None
            target = jax.tree.map(lambda a, sharding: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                                  structs, array_shardings)
    else:
        if shardings is None:
            device_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            shardings = jax.tree.map(lambda _: device_sharding, shapes, is_leaf=lambda x: isinstance(x, tuple))
        try:
            target = jax.tree.map(lambda shape, sharding: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding),
                                  shapes, shardings, is_leaf=lambda x: isinstance(x, tuple))
        except ValueError as e:
            raise ConversionError(f"shardings do not match the parameter tree of {model_dir}: {e}") from None
    params_dir = os.path.abspath(os.path.join(model_dir, PARAMS_DIR))
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(params_dir, target)
    except (OSError, ValueError, KeyError) as e:
        raise ConversionError(f"{params_dir}: cannot restore the parameters ({e})") from None


def load_tokenizer(model_dir: str):
    """The Hugging Face tokenizer saved with the model (local files only); None when the source
    had no tokenizer files (token ids in, token ids out)."""
    marker = check_model_dir(model_dir)
    if not marker.get("has_tokenizer", True):
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:  # transformers raises many types for broken tokenizer files
        raise ConversionError(f"{model_dir}: cannot load the tokenizer ({e})") from None

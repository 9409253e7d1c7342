"""Open a converted model directory once, then load its tokenizer and parameters (orbax).

`open_model(name_or_path)` resolves a model name or path to a converted directory (converting a
GGUF or Hugging Face source into the cache on first use), reads its `jaxserve.json` marker and
its config once, and returns a `ModelSource`; the tokenizer and the weights load from it.
jax (and so jaxserve.models, jaxserve.parallel), orbax and transformers are imported only to load
the weights or the tokenizer: opening a directory stays light.

On disk a quantized leaf is the dict of its arrays by name; loaded, a
jaxserve.models.quantization.QuantArray (`quantization.to_stored` / `from_stored`).

A vision-language model (ModelConfig.multimodal_architecture set) also has its vision tower's and projector's
params in `vision/` (orbax, float) and its image processor files: `ModelSource.vision_tower`,
`load_vision_params` and `load_image_processor` read them.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os

from checkpoints import FORMAT_VERSION, MARKER_FILE, PARAMS_DIR, VISION_DIR, ConversionError
from checkpoints.default_model import resolve_model, served_model_name
from jaxserve.config import ConfigError, ModelConfig

logger = logging.getLogger(__name__)


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


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A converted model directory, opened: its marker and config read once; the tokenizer and
    the weights are loaded on request."""
    path: str
    name: str  # the public id (checkpoints.default_model.served_model_name), never a path
    marker: dict
    config: ModelConfig

    @classmethod
    def open(cls, model_dir: str, name: str | None = None) -> "ModelSource":
        """Reads the marker and the config of a converted directory; ConversionError if it is not
        one or its config cannot be served."""
        marker = check_model_dir(model_dir)
        try:
            config = ModelConfig.from_json_file(os.path.join(model_dir, "config.json"))
        except ConfigError as e:
            raise ConversionError(f"{model_dir}: {e}") from None
        return cls(model_dir, name or served_model_name(model_dir), marker, config)

    @property
    def quantization(self) -> dict[str, str]:
        """{linear leaf: format name} of the leaves stored quantized; {} for float weights."""
        return self.marker.get("quantization") or {}

    def param_shapes(self) -> dict:
        """The parameter tree of shapes (tuples) of this model: the one place loading asks for them."""
        from jaxserve.models import weights
        return weights.param_shapes(self.config)

    def load_tokenizer(self):
        """The Hugging Face tokenizer saved with the model (local files only); None when the source
        had no tokenizer files (token ids in, token ids out)."""
        if not self.marker.get("has_tokenizer", True):
            return None
        try:
            return _tokenizer_class(self.path).from_pretrained(self.path, local_files_only=True)
        except Exception as e:  # transformers raises many types for broken tokenizer files
            raise ConversionError(f"{self.path}: cannot load the tokenizer ({e})") from None

    def abstract_params(self, dtype, sharding=None) -> dict:
        """The checkpoint's arrays as jax.ShapeDtypeStructs: float leaves in `dtype`, leaves stored
        quantized as QuantArrays in their own dtypes; all with `sharding` (default: none)."""
        import jax.numpy as jnp

        from jaxserve.models.quantization import checkpoint_structs
        return checkpoint_structs(self.param_shapes(), jnp.dtype(dtype), self.quantization, sharding)

    def load_params(self, dtype, shardings=None) -> dict:
        """The parameter pytree as jax arrays, float leaves cast to `dtype` while restoring (leaves
        stored quantized come back as QuantArrays in their own dtypes).

        `shardings`: a pytree of `jax.sharding.Sharding` matching the float parameters (default:
        all on the first device).
        """
        import jax
        import orbax.checkpoint as ocp

        from jaxserve.models import quantization

        if shardings is None:
            target = self.abstract_params(dtype, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        else:
            from jaxserve.parallel.sharding import quantized_checkpoint_shardings
            structs = self.abstract_params(dtype)
            try:
                array_shardings = quantized_checkpoint_shardings(shardings, structs)
            except ValueError as e:  # quantization groups that do not split over the devices
                raise ConversionError(f"{self.path}: {e}") from None
            except (KeyError, TypeError) as e:
                raise ConversionError(f"shardings do not match the parameter tree of {self.path}: {e!r}") from None
            try:
                target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                      structs, array_shardings)
            except ValueError as e:
                raise ConversionError(f"shardings do not match the parameter tree of {self.path}: {e}") from None
        params_dir = os.path.abspath(os.path.join(self.path, PARAMS_DIR))
        read_before = file_bytes_read()
        try:
            with ocp.StandardCheckpointer() as checkpointer:
                restored = checkpointer.restore(params_dir, quantization.to_stored(target))
        except (OSError, ValueError, KeyError) as e:
            raise ConversionError(f"{params_dir}: cannot restore the parameters ({e})") from None
        read_after = file_bytes_read()
        # under several processes: only the chunks of which this one's devices hold a part
        if read_before is not None and read_after is not None:
            logger.info("weights restored: %.2f MiB read from %s", (read_after - read_before) / 2**20, params_dir)
        return quantization.from_stored(restored)

    def vision_tower(self):
        """(module, vision config) of a vision-language model's tower: jaxserve.models.qwen_vision
        or siglip, whose `forward(params, vision_config, ...)` the loaded params go to.
        ConversionError for a text model."""
        from checkpoints.layout import vision_tower
        return vision_tower(self.config)

    def load_vision_params(self, dtype=None, sharding=None) -> dict:
        """A vision-language model's vision params (the tower's and the projector's) as jax arrays
        in `dtype` (default: as converted), all with `sharding` (default: on the first device).
        ConversionError for a text model or a directory converted without them."""
        import jax
        import jax.numpy as jnp
        import orbax.checkpoint as ocp

        from checkpoints.layout import vision_param_shapes
        if not self.config.multimodal_architecture:
            raise ConversionError(f"{self.path}: {self.config.architecture} is a text model: it has no vision params")
        vision_dir = os.path.abspath(os.path.join(self.path, VISION_DIR))
        if not os.path.isdir(vision_dir):
            raise ConversionError(f"{self.path}: no {VISION_DIR}/ (the vision params): convert the checkpoint again")
        dtype = jnp.dtype(dtype or (self.marker.get("vision") or {}).get("dtype") or self.marker.get("dtype"))
        sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding),
                              vision_param_shapes(self.config), is_leaf=lambda x: isinstance(x, tuple))
        try:
            with ocp.StandardCheckpointer() as checkpointer:
                return checkpointer.restore(vision_dir, target)
        except (OSError, ValueError, KeyError) as e:
            raise ConversionError(f"{vision_dir}: cannot restore the vision params ({e})") from None

    def load_image_processor(self):
        """The image processor of a vision-language model (jaxserve.multimodal.image_processing:
        QwenVLImageProcessor or Gemma3ImageProcessor) from the files converted with it.
        ConversionError for a text model or settings it cannot honour."""
        from jaxserve.multimodal.image_processing import load_image_processor
        if not self.config.multimodal_architecture:
            raise ConversionError(f"{self.path}: {self.config.architecture} is a text model: it takes no images")
        try:
            return load_image_processor(self.path)
        except (OSError, ValueError) as e:
            raise ConversionError(f"{self.path}: cannot load the image processor ({e})") from None


def file_bytes_read() -> int | None:
    """Bytes this process has read from local files through tensorstore so far (orbax's restores
    read through it: compressed chunks and the checkpoint's index), or None where this tensorstore
    does not count them."""
    import tensorstore as ts
    collect = getattr(ts, "experimental_collect_matching_metrics", None)
    if collect is None:
        return None
    metrics = collect("/tensorstore/kvstore/file/bytes_read")
    return int(sum(v.get("value", 0) for m in metrics for v in m["values"]))


def open_model(name_or_path: str) -> ModelSource:
    """The model `name_or_path` names ("smollm2", a converted directory, a `.gguf` file or a
    Hugging Face folder; see checkpoints.default_model.resolve_model), opened once."""
    return ModelSource.open(resolve_model(name_or_path), served_model_name(name_or_path))


# One-call helpers on a converted directory (each opens it).
def load_config(model_dir: str) -> ModelConfig:
    return ModelSource.open(model_dir).config


def load_params(model_dir: str, dtype, shardings=None) -> dict:
    return ModelSource.open(model_dir).load_params(dtype, shardings)


def load_tokenizer(model_dir: str):
    return ModelSource.open(model_dir).load_tokenizer()


def load_vision_params(model_dir: str, dtype=None, sharding=None) -> dict:
    return ModelSource.open(model_dir).load_vision_params(dtype, sharding)


def load_image_processor(model_dir: str):
    return ModelSource.open(model_dir).load_image_processor()


def _tokenizer_class(path: str):
    """The transformers class that loads the tokenizer in `path`: the `tokenizer_class` its
    tokenizer_config.json names, as AutoTokenizer would pick, imported by name (AutoTokenizer's own
    import brings in transformers' model configurations, and with them torch where it is installed:
    seconds of every start); AutoTokenizer where the file names none or transformers lacks it."""
    import transformers  # the tokenizer needs it; loaded only when a tokenizer is
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        name = None
    try:
        return getattr(transformers, name) if isinstance(name, str) else transformers.AutoTokenizer
    except (AttributeError, ImportError):
        return transformers.AutoTokenizer

"""A Hugging Face model folder (config.json + safetensors shards) as a conversion source.

A vision-language checkpoint (jaxserve.config.MULTIMODAL_ARCHITECTURES) converts its language
model as its text family does: the language model's tensors are read under a text model's names
whatever layout the folder has (`LanguageModelNames`: transformers 5's `model.language_model.*`,
the published Gemma 3's `language_model.model.*`, the published Qwen2.5-VL's `model.*`), and the
vision tower's and projector's tensors (`visual.*`, `vision_tower.*`, `multi_modal_projector.*`,
with or without transformers 5's `model.` in front) go to `vision_params` instead.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Iterator

import numpy as np

from checkpoints import ConversionError
from checkpoints.layout import describe_slot, expert_slot, source_names, vision_tower
from checkpoints.pooling_checkpoint import decoder_config, head_tensors, with_model_prefix
from checkpoints.safetensors_file import SafetensorsFile
from jaxserve.config import MULTIMODAL_ARCHITECTURES, ConfigError, ModelConfig
from jaxserve.models import weights

_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")
_LAYER_PREFIX = "model.layers.{layer}."
_IGNORED = re.compile(r".*rotary_emb\.inv_freq")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)
# A vision-language model's image processor settings (jaxserve.multimodal.image_processing reads them).
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
# The language model's tensors of a vision-language checkpoint -> a text model's names (first match).
_LM_RENAMES = (("model.language_model.", "model."), ("language_model.model.", "model."),
               ("language_model.lm_head.", "lm_head."))
# The vision tower's and projector's tensors (transformers 5's names, then the published ones).
_VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.",
                    "model.multi_modal_projector.", "multi_modal_projector.")
# Vision tensors a tower does not use: SigLIP's pooling head (Gemma 3 reads the last hidden state).
_UNUSED_VISION = re.compile(r"(model\.)?vision_tower\.(vision_model\.)?head\..*")
# Fields of transformers' base config that say nothing about the model (dropped from the completed config).
_GENERIC_FIELDS = ("_name_or_path", "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder",
                   "output_attentions", "output_hidden_states", "problem_type", "return_dict", "dtype",
                   "torch_dtype", "transformers_version")


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ConversionError(f"{path}: cannot read ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path}: not valid JSON ({e})") from None


class HFSource:
    """Reads `config.json` and the safetensors shards (listed by the index when there is one)."""

    kind = "hf"

    def __init__(self, folder: str):
        self.folder = folder
        config_path = os.path.join(folder, "config.json")
        if not os.path.isfile(config_path):
            raise ConversionError(f"{config_path}: no such file (not a Hugging Face model folder?)")
        hf_config = _read_json(config_path)
        generation_path = os.path.join(folder, "generation_config.json")
        if os.path.isfile(generation_path):
            hf_config = _merge_generation_eos(hf_config, _read_json(generation_path))
        self.multimodal = str((hf_config.get("architectures") or [""])[0]) in MULTIMODAL_ARCHITECTURES
        if self.multimodal:
            hf_config = complete_multimodal_config(hf_config)
        self.hf_config = hf_config  # as published: a pooling checkpoint's architecture and labels
        self._head_tensors = head_tensors(hf_config)  # a classifier's score head: checkpoints.pooling_checkpoint
        try:
            self.config = ModelConfig.from_hf_dict(decoder_config(hf_config))
        except ConfigError as e:
            raise ConversionError(f"{config_path}: {e}") from None
        self._whole_names, self._layer_names = source_names(self.config, "hf")
        self._fused_names = weights.fused_expert_names(self.config)
        self.files = with_model_prefix([SafetensorsFile(p) for p in self._shard_paths()])
        if self.multimodal:
            self.files = [LanguageModelNames(file) for file in self.files]
        self._owner = {}
        for file in self.files:
            for name in file.names():
                if name in self._owner:
                    raise ConversionError(f"{file.path}: tensor {name!r} also appears in {self._owner[name].path}")
                self._owner[name] = file
        # a checkpoint published quantized (compressed-tensors, GPTQ, AWQ): checkpoints.prequantized
        self.published, self._published_codes, self._published_skip = None, {}, set()
        if hf_config.get("quantization_config"):
            from checkpoints.prequantized import PublishedQuantization
            self.published = PublishedQuantization(hf_config["quantization_config"], config_path)
            self._find_published_weights()

    def _find_published_weights(self) -> None:
        """Which weights are stored quantized: their code tensor's name -> (weight name, PublishedWeight);
        the names of their other tensors (read with the codes) in _published_skip."""
        names = set(self._owner)
        known = {name: transposed for name, (_, transposed) in self._whole_names.items()}
        for layer in range(self.config.num_layers):
            prefix = _LAYER_PREFIX.format(layer=layer)
            known.update({prefix + name: transposed for name, (_, transposed) in self._layer_names.items()})
        for name, is_linear in known.items():  # the linear layers are the transposed weights
            if not name.endswith(".weight"):
                continue
            module = name.removesuffix(".weight")
            weight = self.published.module_weight(module, is_linear, names, self._owner)
            self._published_skip.update(f"{module}.{part}" for part in self.published.aux_parts(weight)
                                        if f"{module}.{part}" in names)
            if weight is None:
                continue
            codes = f"{module}.{next(iter(weight.parts))}"
            self._published_codes[codes] = (name, weight)
            bias = f"{module}.bias"  # GPTQ writers may save an all-zero bias the model does not have
            if bias in names and bias not in known and not np.any(self._owner[bias].read(bias)):
                self._published_skip.add(bias)

    def published_weights(self) -> dict:
        """{weight name: PublishedWeight} of the weights stored quantized ({} for a float checkpoint)."""
        return dict(self._published_codes.values())

    def _shard_paths(self) -> list[str]:
        index_path = os.path.join(self.folder, "model.safetensors.index.json")
        if os.path.isfile(index_path):
            weight_map = _read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConversionError(f"{index_path}: no weight_map")
            paths = [os.path.join(self.folder, n) for n in sorted(set(weight_map.values()))]
            for path in paths:
                if not os.path.isfile(path):
                    raise ConversionError(f"{path}: no such file (listed in {index_path})")
            return paths
        names = sorted(n for n in os.listdir(self.folder) if n.endswith(".safetensors"))
        preferred = [n for n in names if n.startswith("model")]  # e.g. skip Mistral's consolidated.safetensors
        paths = [os.path.join(self.folder, n) for n in (preferred or names)]
        if not paths:
            raise ConversionError(f"{self.folder}: no *.safetensors files (PyTorch .bin checkpoints are not supported)")
        return paths

    def default_dtype(self) -> np.dtype:
        """The float dtype of the source's embedding table (float64 sources give float32)."""
        name = self.describe_missing("embed", None)
        if name not in self._owner:
            raise ConversionError(f"{self.folder}: missing tensor {name!r}")
        dtype = self._owner[name].dtype(name)
        return np.dtype(np.float32) if dtype == np.float64 else dtype

    def num_tensors(self) -> int:
        """How many tensors the files hold (an upper bound of what `tensors` yields)."""
        return sum(len(file.names()) for file in self.files)

    def tensors(self) -> Iterator[tuple[str, str, str, int | None, np.ndarray, bool]]:
        """(file, source name, slot, layer, tensor, transpose) for every weight, file by file."""
        for file in self.files:
            for name in file.names():
                tensor = None
                if name in self._published_skip or name in self._head_tensors:
                    continue
                if self.multimodal and name.startswith(_VISION_PREFIXES):  # vision_params reads these
                    continue
                if name in self._published_codes:
                    name, tensor = self._published_codes[name]
                if _IGNORED.fullmatch(name) or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                    continue
                match = _LAYER_NAME.fullmatch(name)
                if match and match.group(2) in self._fused_names:
                    yield from self._unfused(file, name, int(match.group(1)), self._fused_names[match.group(2)])
                    continue
                if match and match.group(2) in self._layer_names:
                    layer, (slot, transpose) = int(match.group(1)), self._layer_names[match.group(2)]
                elif name in self._whole_names:
                    layer, (slot, transpose) = None, self._whole_names[name]
                else:
                    raise ConversionError(f"{file.path}: unexpected tensor {name!r}")
                yield file.path, name, slot, layer, file.read(name) if tensor is None else tensor, transpose

    def _unfused(self, file, name: str, layer: int, fused: tuple[tuple[str, ...], bool]):
        """The per-expert slots (see `tensors`) of one of transformers 5's fused expert tensors
        (jaxserve.models.weights.fused_expert_names), or the whole router it names."""
        paths, transpose = fused
        tensor = file.read(name)
        if paths == ("layers/router",):
            yield file.path, name, paths[0], layer, tensor, transpose
            return
        if tensor.ndim != 3 or tensor.shape[0] != self.config.num_experts or tensor.shape[1] % len(paths):
            raise ConversionError(f"{file.path}: tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                  f"[{self.config.num_experts} experts, {len(paths)} x rows, columns]")
        rows = tensor.shape[1] // len(paths)
        for expert in range(tensor.shape[0]):
            for i, path in enumerate(paths):
                yield (file.path, name, expert_slot(path, expert), layer, tensor[expert, i * rows:(i + 1) * rows],
                       transpose)

    def describe_missing(self, slot: str, layer: int | None) -> str:
        return describe_slot(self._whole_names, self._layer_names, _LAYER_PREFIX, slot, layer)

    def vision_params(self, dtype: np.dtype) -> dict:
        """A vision-language model's tower and projector weights (numpy, `dtype`), in the pytree of
        jaxserve.models.qwen_vision / siglip (`params_from_state_dict`). ConversionError naming a
        missing tensor, one of the wrong shape, or a vision tensor the tower does not use."""
        module, vision_config = vision_tower(self.config)
        state = _VisionTensors({name: file for file in self.files for name in file.names()
                                if name.startswith(_VISION_PREFIXES)})
        try:
            params = module.params_from_state_dict(state, vision_config, dtype)
        except KeyError as e:
            raise ConversionError(f"{self.folder}: missing vision tensor: {e.args[0]}") from None
        except ValueError as e:
            raise ConversionError(f"{self.folder}: vision tensor {e}") from None
        unused = sorted(name for name in state.files if name not in state.read and not _UNUSED_VISION.fullmatch(name))
        if unused:
            where = state.files[unused[0]].path
            raise ConversionError(f"{where}: unexpected tensor {unused[0]!r} for this vision_config"
                                  + (f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""))
        return params

    def _copy_files(self, names, output_dir: str) -> list[str]:
        """Copies those of `names` the folder has into `output_dir`; returns the names copied."""
        copied = [name for name in names if os.path.isfile(os.path.join(self.folder, name))]
        for name in copied:
            shutil.copyfile(os.path.join(self.folder, name), os.path.join(output_dir, name))
        return copied

    def save_processor(self, output_dir: str) -> bool:
        """Copies a vision-language model's image processor files; False when the folder has none."""
        return bool(self._copy_files(PROCESSOR_FILES, output_dir))

    def save_tokenizer(self, output_dir: str) -> bool:
        """Copies the tokenizer files; False when the folder has none (a generation config alone is none)."""
        return bool(set(self._copy_files(TOKENIZER_FILES, output_dir)) - {"generation_config.json"})


def _merge_generation_eos(hf_config: dict, generation: dict) -> dict:
    """Adds generation_config's eos ids (instruct models often list extra stop ids there)."""
    def as_list(value):
        return [] if value is None else (list(value) if isinstance(value, list) else [value])
    eos = as_list(hf_config.get("eos_token_id"))
    extra = [i for i in as_list(generation.get("eos_token_id")) if i not in eos]
    return {**hf_config, "eos_token_id": eos + extra} if extra else hf_config


def complete_multimodal_config(hf_config: dict) -> dict:
    """A vision-language config.json with transformers' defaults filled in, in transformers 5's
    shape (the language model under `text_config`): a published Gemma 3 config names only the
    fields that differ from its config class's defaults (heads, vocabulary, head_dim are not in
    it). Read by transformers' own config class, so the numbers are the ones transformers runs
    the model with; the dict as published where transformers cannot read it (ModelConfig then
    names what is missing)."""
    model_type = hf_config.get("model_type") or MULTIMODAL_ARCHITECTURES[hf_config["architectures"][0]][0]
    try:
        import transformers
        config_class = transformers.CONFIG_MAPPING[model_type]
        completed = json.loads(config_class.from_dict(hf_config).to_json_string(use_diff=False))
    except Exception:  # noqa: BLE001 - transformers raises many types; ModelConfig judges the published dict
        return hf_config
    completed = {k: v for k, v in completed.items() if k not in _GENERIC_FIELDS}
    for key in ("text_config", "vision_config"):
        if isinstance(completed.get(key), dict):
            completed[key] = {k: v for k, v in completed[key].items() if k not in _GENERIC_FIELDS + ("architectures",)}
    return completed


def _lm_name(name: str) -> str:
    """A vision-language checkpoint's tensor name as a text model's (vision tensors unchanged)."""
    for old, new in _LM_RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


class LanguageModelNames:
    """A safetensors file of a vision-language checkpoint whose language model's tensors are read
    under a text model's names (`model.language_model.layers.0...` as `model.layers.0...`,
    `language_model.lm_head.weight` as `lm_head.weight`); the vision tensors keep theirs."""

    def __init__(self, file):
        self.file = file
        self.path = file.path
        self._source = {}
        for name in file.names():
            ours = _lm_name(name)
            if ours in self._source:
                raise ConversionError(f"{file.path}: tensors {self._source[ours]!r} and {name!r} are both {ours!r}")
            self._source[ours] = name

    def names(self) -> list[str]:
        return list(self._source)

    def dtype(self, name: str) -> np.dtype:
        return self.file.dtype(self._source[name])

    def raw_dtype(self, name: str) -> str:
        return self.file.raw_dtype(self._source[name])

    def shape(self, name: str) -> tuple[int, ...]:
        return self.file.shape(self._source[name])

    def read(self, name: str) -> np.ndarray:
        return self.file.read(self._source[name])


class _VisionTensors:
    """The vision tensors of a checkpoint as the read-only mapping `params_from_state_dict` looks
    names up in; each read when asked for, and remembered as read."""

    def __init__(self, files: dict):
        self.files = files  # {name: the file holding it}
        self.read: set[str] = set()

    def __contains__(self, name) -> bool:
        return name in self.files

    def __getitem__(self, name: str) -> np.ndarray:
        self.read.add(name)
        return self.files[name].read(name)

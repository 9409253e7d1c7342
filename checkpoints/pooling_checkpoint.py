"""What embedding and reranking checkpoints add to a Hugging Face folder's conversion.

Three shapes of published folder pool rather than generate:
- a bare decoder, as sentence-transformers saves one (`LlamaModel`, `Qwen2Model`, ...: tensors
  named `layers.0...`, `embed_tokens.weight`, `norm.weight`, no LM head), or a `*ForCausalLM`
  config over such tensors (Qwen3-Embedding): read under a full model's `model.` names
  (`ModelPrefixed`), the architecture as its `*ForCausalLM` with the embedding tied;
- a `*ForSequenceClassification` checkpoint (a converted Qwen3-Reranker, a Llama classifier): the
  decoder as its `*ForCausalLM` (embedding tied: no LM head is published), and its score head
  `score.weight` [num_labels, hidden] kept beside the parameters, in `score.npy` (float32);
- either with sentence-transformers files (`modules.json`, the Pooling module's `config.json`,
  `2_Normalize`), copied to the same paths.
The published config's pooling fields go to `pooling.json` (jaxserve.pooling.config reads it and
the sentence-transformers files to resolve the pooler); a folder whose pooling cannot be served
(a Dense module, max pooling, a score head of the wrong shape) is refused at conversion, naming
the file and field.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np

from checkpoints import ConversionError
from jaxserve.config import SUPPORTED_ARCHITECTURES
from jaxserve.pooling.config import (CLASSIFIER_SUFFIX, POOLING_FILE, ST_CONFIG_FILE, ST_MODULES_FILE,
                                     PoolerConfigError, is_classifier, published_pooling_fields, resolve_pooler,
                                     sentence_transformers_modules)

BASE_MODEL_SUFFIX = "Model"
HEAD_TENSORS = ("score.weight",)
SCORE_FILE = "score.npy"
_PREFIX = "model."


def decoder_config(hf_config: dict) -> dict:
    """The config the decoder is converted from: a bare `XModel` or an `XForSequenceClassification`
    whose `XForCausalLM` is supported is read as that, its embedding tied (it publishes no LM
    head); any other config unchanged (ModelConfig refuses an unsupported architecture by name)."""
    architecture = str((hf_config.get("architectures") or [""])[0])
    for suffix in (CLASSIFIER_SUFFIX, BASE_MODEL_SUFFIX):
        causal = architecture.removesuffix(suffix) + "ForCausalLM"
        if architecture.endswith(suffix) and causal in SUPPORTED_ARCHITECTURES:
            return {**hf_config, "architectures": [causal], "tie_word_embeddings": True}
    return hf_config


def head_tensors(hf_config: dict) -> tuple[str, ...]:
    """The tensors of the published config's pooling head (kept out of the decoder's parameters)."""
    return HEAD_TENSORS if is_classifier(hf_config) else ()


class ModelPrefixed:
    """A safetensors file of a bare decoder, its tensors read under a full model's names
    (`layers.0.mlp...` as `model.layers.0.mlp...`)."""

    def __init__(self, file):
        self.file = file
        self.path = file.path

    def names(self) -> list[str]:
        return [_PREFIX + name for name in self.file.names()]

    def dtype(self, name: str) -> np.dtype:
        return self.file.dtype(name.removeprefix(_PREFIX))

    def raw_dtype(self, name: str) -> str:
        return self.file.raw_dtype(name.removeprefix(_PREFIX))

    def shape(self, name: str) -> tuple[int, ...]:
        return self.file.shape(name.removeprefix(_PREFIX))

    def read(self, name: str) -> np.ndarray:
        return self.file.read(name.removeprefix(_PREFIX))


def with_model_prefix(files: list) -> list:
    """`files` as they are, or each under `ModelPrefixed` when they hold a bare decoder (no tensor
    named `model.*`, some named `layers.*` or `embed_tokens.*`)."""
    names = [name for file in files for name in file.names()]
    bare = (not any(name.startswith(_PREFIX) for name in names)
            and any(name.startswith(("layers.", "embed_tokens.")) for name in names))
    return [ModelPrefixed(file) for file in files] if bare else files


def save_pooling_files(source, output_dir: str) -> None:
    """Writes what pooling reads into a converted directory being assembled: `pooling.json`, the
    score head (`score.npy`) of a classifier, the sentence-transformers files. Nothing for a
    plain causal checkpoint without sentence-transformers files."""
    folder, hf_config, config = source.folder, source.hf_config, source.config
    modules_path = os.path.join(folder, ST_MODULES_FILE)
    if not is_classifier(hf_config) and not os.path.isfile(modules_path) and decoder_config(hf_config) is hf_config:
        return
    try:
        pooler = resolve_pooler(folder, config.hidden_size)  # refuses what cannot be served, naming it
        modules = sentence_transformers_modules(folder) or []
    except PoolerConfigError as e:
        raise ConversionError(str(e)) from None
    _write_json(os.path.join(output_dir, POOLING_FILE), published_pooling_fields(hf_config))
    for name in (ST_MODULES_FILE, ST_CONFIG_FILE):
        if os.path.isfile(os.path.join(folder, name)):
            shutil.copyfile(os.path.join(folder, name), os.path.join(output_dir, name))
    for module in modules:
        _copy_module_configs(os.path.join(folder, module.get("path", "")), os.path.join(output_dir, module["path"]))
    if is_classifier(hf_config):
        np.save(os.path.join(output_dir, SCORE_FILE), _score_head(source, pooler.classifier.num_labels))


def _copy_module_configs(source_dir: str, target_dir: str) -> None:
    """A sentence-transformers module's JSON files (Pooling's config.json; Normalize has none)."""
    os.makedirs(target_dir, exist_ok=True)
    if os.path.isdir(source_dir):
        for name in os.listdir(source_dir):
            if name.endswith(".json"):
                shutil.copyfile(os.path.join(source_dir, name), os.path.join(target_dir, name))


def _score_head(source, num_labels: int) -> np.ndarray:
    """The classifier's `score.weight` [num_labels, hidden] as float32, its shape checked."""
    name = HEAD_TENSORS[0]
    owner = next((file for file in source.files if name in file.names()), None)
    if owner is None:
        raise ConversionError(f"{source.folder}: missing tensor {name!r} (the score head of a "
                              f"{CLASSIFIER_SUFFIX} checkpoint)")
    head = np.asarray(owner.read(name), np.float32)
    expected = (num_labels, source.config.hidden_size)
    if head.shape != expected:
        raise ConversionError(f"{owner.path}: tensor {name!r} has shape {head.shape}, expected {expected} "
                              f"(num_labels x hidden_size)")
    return head


def load_score_head(model_dir: str) -> np.ndarray | None:
    """A converted classifier's score head [num_labels, hidden] float32 (None: not a classifier)."""
    path = os.path.join(model_dir, SCORE_FILE)
    if not os.path.isfile(path):
        return None
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ConversionError(f"{path}: cannot read the score head ({e})") from None


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def pooling_model(model_dir: str, hidden_size: int, runner: str, pooler_flag=None):
    """How the converted model in `model_dir` is served under --runner `runner`: (PoolerConfig,
    score head [labels, hidden] or None) for "pooling" (--pooler_config `pooler_flag` first, then
    the checkpoint's files: jaxserve.pooling.config.resolve_pooler), (None, None) for "generate".
    ConversionError naming the reason: a field of the pooler that cannot be served, or a classifier
    (its score head in score.npy, no LM head) asked to generate."""
    if runner != "pooling":
        if os.path.isfile(os.path.join(model_dir, SCORE_FILE)):
            raise ConversionError(f"{model_dir} is a {CLASSIFIER_SUFFIX} checkpoint (a score head, no LM head): "
                                  "serve it with --runner=pooling")
        return None, None
    try:
        pooler = resolve_pooler(model_dir, hidden_size, pooler_flag)
    except PoolerConfigError as e:
        raise ConversionError(f"{model_dir}: {e}") from None
    head = load_score_head(model_dir) if pooler.classifier is not None else None
    if pooler.classifier is not None and head is None:
        raise ConversionError(f"{model_dir}: a {CLASSIFIER_SUFFIX} config without its score head ({SCORE_FILE}): "
                              "convert the checkpoint again")
    return pooler, head

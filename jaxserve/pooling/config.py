"""How a model pools: its checkpoint's sentence-transformers files, `--pooler_config`, or the default.

Resolution, field by field, as vLLM merges them: a field set in `--pooler_config` (vLLM's JSON:
`pooling_type` LAST/MEAN/CLS, `normalize`, `dimensions`, `use_activation`) wins; else the
checkpoint's sentence-transformers files decide (`modules.json` listing a Transformer, a Pooling
module whose `config.json` names last token, mean or CLS, and a Normalize module or none); else
the default for a decoder model, last token and normalized. A `*ForSequenceClassification`
checkpoint is a classifier (`Classifier`): its score head reads the last token, and its activation
is transformers' and vLLM's (sigmoid for one label, softmax otherwise; `problem_type` and a
sentence-transformers CrossEncoder's `activation_fn` where the config has them). Anything that
cannot be served as asked is a PoolerConfigError naming the file and field.

A converted model directory keeps the published config's pooling fields in `pooling.json`
(`published_pooling_fields`; its own `config.json` is the decoder's) and the sentence-transformers
files at their published paths, so a Hugging Face folder and its conversion resolve alike.
No jax here.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

POOLING_TYPES = ("LAST", "MEAN", "CLS")
POOLING_FILE = "pooling.json"  # in a converted directory: the published config's pooling fields
ST_MODULES_FILE = "modules.json"
ST_CONFIG_FILE = "config_sentence_transformers.json"
CLASSIFIER_SUFFIX = "ForSequenceClassification"
# The published config's fields that pooling reads (kept in pooling.json at conversion).
PUBLISHED_FIELDS = ("architectures", "id2label", "num_labels", "problem_type", "sentence_transformers",
                    "matryoshka_dimensions")
FLAG_FIELDS = ("pooling_type", "normalize", "dimensions", "use_activation")
ACTIVATIONS = ("sigmoid", "softmax", "identity")
# sentence-transformers Pooling modes -> pooling types (boolean fields, or one `pooling_mode` string)
_ST_MODE_FIELDS = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                   "pooling_mode_cls_token": "CLS"}
_ST_MODE_NAMES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}
_ST_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                         "pooling_mode_weightedmean_tokens")
_ST_MODULE_KINDS = ("Transformer", "Pooling", "Normalize")


class PoolerConfigError(ValueError):
    """A pooling setting or checkpoint file that cannot be served; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Classifier:
    """A `*ForSequenceClassification` score head: [num_labels, hidden] on the last token's
    final-normed hidden state, then `activation`."""
    num_labels: int
    labels: tuple[str, ...]  # id2label in label order
    activation: str  # one of ACTIVATIONS


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    """How a model pools. `dimensions`: the default embedding size (None: the hidden size), a
    request's own `dimensions` overriding it; `matryoshka_dimensions`: the sizes the checkpoint
    declares (None: any size up to the hidden size)."""
    pooling_type: str  # one of POOLING_TYPES
    normalize: bool
    dimensions: int | None = None
    classifier: Classifier | None = None
    matryoshka_dimensions: tuple[int, ...] | None = None
    sources: tuple[tuple[str, str], ...] = ()  # (field, where its value came from), for the start-up log


def parse_pooler_flag(value: str | dict | None) -> dict[str, Any]:
    """`--pooler_config` (JSON text or a dict) -> the fields it sets, each checked."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise PoolerConfigError(f"--pooler_config is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise PoolerConfigError("--pooler_config must be a JSON object")
    fields = {k: v for k, v in value.items() if v is not None}
    if "seq_pooling_type" in fields:  # vLLM's newer name of the same field
        fields.setdefault("pooling_type", fields.pop("seq_pooling_type"))
    unknown = sorted(set(fields) - set(FLAG_FIELDS))
    if unknown:
        raise PoolerConfigError(f"--pooler_config: field {unknown[0]!r} is not supported "
                                f"(supported: {', '.join(FLAG_FIELDS)})")
    if "pooling_type" in fields and fields["pooling_type"] not in POOLING_TYPES:
        raise PoolerConfigError(f"--pooler_config: pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                                f"got {fields['pooling_type']!r}")
    for name in ("normalize", "use_activation"):
        if name in fields and not isinstance(fields[name], bool):
            raise PoolerConfigError(f"--pooler_config: {name} must be true or false, got {fields[name]!r}")
    dims = fields.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
        raise PoolerConfigError(f"--pooler_config: dimensions must be a positive integer, got {dims!r}")
    return fields


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise PoolerConfigError(f"{path}: cannot read ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise PoolerConfigError(f"{path}: not valid JSON ({e})") from None


def sentence_transformers_modules(folder: str) -> list[dict] | None:
    """The modules of `modules.json` (None: not a sentence-transformers folder), each checked to be
    one that pooling serves: the Transformer at the folder's root, then Pooling, and Normalize."""
    path = os.path.join(folder, ST_MODULES_FILE)
    if not os.path.isfile(path):
        return None
    modules = _read_json(path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise PoolerConfigError(f"{path}: must be a list of module objects")
    for module in modules:
        kind = str(module.get("type", ""))
        if not kind.startswith("sentence_transformers.") or kind.rsplit(".", 1)[-1] not in _ST_MODULE_KINDS:
            raise PoolerConfigError(f"{path}: module {module.get('path', '')!r} of type {kind!r} is not "
                                    f"supported (only {', '.join(_ST_MODULE_KINDS)} modules)")
        if kind.endswith(".Transformer") and module.get("path", "") != "":
            raise PoolerConfigError(f"{path}: the Transformer module must be the folder itself, "
                                    f"not {module.get('path')!r}")
    return modules


def sentence_transformers_pooling(folder: str, hidden_size: int) -> dict[str, Any] | None:
    """{"pooling_type", "normalize"} from a sentence-transformers folder (None: not one)."""
    modules = sentence_transformers_modules(folder)
    if modules is None:
        return None
    pooling = [m for m in modules if str(m["type"]).endswith(".Pooling")]
    if len(pooling) != 1:
        raise PoolerConfigError(f"{os.path.join(folder, ST_MODULES_FILE)}: expected one Pooling module, "
                                f"found {len(pooling)}")
    path = os.path.join(folder, str(pooling[0].get("path", "")), "config.json")
    config = _read_json(path)
    if not isinstance(config, dict):
        raise PoolerConfigError(f"{path}: must be a JSON object")
    width = config.get("word_embedding_dimension")
    if width is not None and width != hidden_size:
        raise PoolerConfigError(f"{path}: word_embedding_dimension is {width}, the model's hidden size {hidden_size}")
    if config.get("include_prompt", True) is not True:
        raise PoolerConfigError(f"{path}: include_prompt false is not supported")
    on = [name for name in (*_ST_MODE_FIELDS, *_ST_UNSUPPORTED_MODES) if config.get(name) is True]
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        if mode not in _ST_MODE_NAMES:
            raise PoolerConfigError(f"{path}: pooling_mode {mode!r} is not supported "
                                    f"(supported: {', '.join(_ST_MODE_NAMES)})")
        pooling_type = _ST_MODE_NAMES[mode]
    elif len(on) != 1 or on[0] in _ST_UNSUPPORTED_MODES:
        unsupported = [name for name in on if name in _ST_UNSUPPORTED_MODES]
        what = f"{unsupported[0]} is not supported" if unsupported else f"{len(on)} pooling modes are on"
        raise PoolerConfigError(f"{path}: {what} (exactly one of {', '.join(_ST_MODE_FIELDS)} must be true)")
    else:
        pooling_type = _ST_MODE_FIELDS[on[0]]
    normalize = any(str(m["type"]).endswith(".Normalize") for m in modules)
    return {"pooling_type": pooling_type, "normalize": normalize}


def published_pooling_fields(hf_config: dict) -> dict:
    """The fields of a published `config.json` that pooling reads (what `pooling.json` keeps)."""
    return {name: hf_config[name] for name in PUBLISHED_FIELDS if name in hf_config}


def published_config(folder: str) -> dict:
    """A converted directory's `pooling.json`, or a Hugging Face folder's `config.json` ({} if neither)."""
    for name in (POOLING_FILE, "config.json"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            config = _read_json(path)
            if not isinstance(config, dict):
                raise PoolerConfigError(f"{path}: must be a JSON object")
            return config
    return {}


def is_classifier(hf_config: dict) -> bool:
    architectures = hf_config.get("architectures") or [""]
    return str(architectures[0]).endswith(CLASSIFIER_SUFFIX)


def classifier_from_hf_config(hf_config: dict, use_activation: bool | None = None) -> Classifier | None:
    """The score head a `*ForSequenceClassification` config declares (None: not a classifier)."""
    if not is_classifier(hf_config):
        return None
    id2label = hf_config.get("id2label") or {}
    if not isinstance(id2label, dict):
        raise PoolerConfigError("config.json: id2label must be an object")
    num_labels = hf_config.get("num_labels") or len(id2label) or 2  # transformers' default: two labels
    if not isinstance(num_labels, int) or num_labels < 1 or (id2label and len(id2label) != num_labels):
        raise PoolerConfigError(f"config.json: num_labels {num_labels!r} does not match id2label's "
                                f"{len(id2label)} labels")
    try:
        labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(num_labels))
    except TypeError:
        raise PoolerConfigError("config.json: id2label must map label indices to names") from None
    activation = "identity" if use_activation is False else classification_activation(hf_config, num_labels)
    return Classifier(num_labels, labels, activation)


def classification_activation(hf_config: dict, num_labels: int) -> str:
    """A CrossEncoder's `sentence_transformers.activation_fn` where set; else by `problem_type`
    (regression: none, multi-label: sigmoid); else sigmoid for one label, softmax for more."""
    st = hf_config.get("sentence_transformers") or {}
    function = st.get("activation_fn") if isinstance(st, dict) else None
    if function:
        name = str(function).rsplit(".", 1)[-1].lower()
        if name not in ACTIVATIONS:
            raise PoolerConfigError(f"config.json: sentence_transformers.activation_fn {function!r} is not "
                                    f"supported (Sigmoid, Softmax or Identity)")
        return name
    problem = hf_config.get("problem_type")
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification" or num_labels == 1:
        return "sigmoid"
    return "softmax"


def resolve_pooler(folder: str, hidden_size: int, flag: str | dict | None = None) -> PoolerConfig:
    """How the model in `folder` (a Hugging Face folder or a converted directory) pools, under
    `--pooler_config` `flag`: see the module docstring for the order."""
    chosen = parse_pooler_flag(flag)
    published = published_config(folder)
    classifier = classifier_from_hf_config(published, chosen.get("use_activation"))
    st = sentence_transformers_pooling(folder, hidden_size) or {}
    default = {"pooling_type": "LAST", "normalize": classifier is None, "dimensions": None}
    values, sources = {}, []
    for name, fallback in default.items():
        source = "--pooler_config" if name in chosen else ST_MODULES_FILE if name in st else "default"
        values[name] = chosen.get(name, st.get(name, fallback))
        sources.append((name, source))
    if classifier is not None and values["pooling_type"] != "LAST":
        raise PoolerConfigError(f"pooling_type {values['pooling_type']} ({dict(sources)['pooling_type']}): "
                                f"a {CLASSIFIER_SUFFIX} score head reads the last token (LAST)")
    matryoshka = published.get("matryoshka_dimensions")
    if matryoshka is not None:
        if not isinstance(matryoshka, list) or not all(isinstance(d, int) and 0 < d <= hidden_size
                                                       for d in matryoshka):
            raise PoolerConfigError(f"config.json: matryoshka_dimensions must be a list of sizes in "
                                    f"[1, {hidden_size}], got {matryoshka!r}")
        matryoshka = tuple(matryoshka)
    dims = values["dimensions"]
    if dims is not None and (dims > hidden_size or (matryoshka and dims not in matryoshka)):
        allowed = f"one of {list(matryoshka)}" if matryoshka else f"at most the hidden size {hidden_size}"
        raise PoolerConfigError(f"--pooler_config: dimensions must be {allowed}, got {dims}")
    return PoolerConfig(values["pooling_type"], values["normalize"], dims, classifier, matryoshka, tuple(sources))

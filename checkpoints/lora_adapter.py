"""PEFT LoRA adapters read from disk and checked against the base model (host side: numpy, no jax).

An adapter folder, as `peft`'s `save_pretrained` writes it, holds `adapter_config.json` and
`adapter_model.safetensors` with, per adapted projection of layer i,

    base_model.model.model.layers.{i}.{self_attn|mlp}.{name}.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.{self_attn|mlp}.{name}.lora_B.weight   [out, r]

and the adapted projection is W x + scaling * B (A x), scaling = lora_alpha / r (rsLoRA,
`use_rslora`: lora_alpha / sqrt(r)). `load_adapter` returns the update in jaxserve's layout
(`jaxserve.models.weights`: matrices stored for `x @ W`, stacked on a leading layer axis):
per projection, A [L, in, r] and B [L, r, out] with the scaling folded into B, so that the
update is (x @ A[l]) @ B[l]; layers the adapter does not adapt hold zeros.

Supported: any subset of the projections q, k, v, o (attention) and gate, up, down (the dense
MLP), named in `target_modules` as a list, a regular expression over the module names (as PEFT
matches it) or "all-linear"; `layers_to_transform`, `exclude_modules`; float32, float16 and
bfloat16 tensors.
Refused with a `LoRAError` that names the reason: a path that is not an adapter folder, a
missing or pickled (`.bin`) weights file, corrupt safetensors, DoRA, `modules_to_save`,
embedding or lm_head LoRA, LoRA biases, per-module ranks or alphas (`rank_pattern`,
`alpha_pattern`), a rank over the server's maximum, MLP LoRA on a mixture-of-experts model,
tensors whose shapes do not fit the base model or the config's rank, a config whose targets
and the tensors in the file disagree, non-finite values.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np

from checkpoints import ConversionError
from checkpoints.safetensors_file import SafetensorsFile
from jaxserve.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"

# PEFT's module name -> (jaxserve's weight name, the module's parent in a decoder layer)
PROJECTIONS = {
    "q_proj": ("wq", "self_attn"), "k_proj": ("wk", "self_attn"), "v_proj": ("wv", "self_attn"),
    "o_proj": ("wo", "self_attn"),
    "gate_proj": ("w_gate", "mlp"), "up_proj": ("w_up", "mlp"), "down_proj": ("w_down", "mlp"),
}
WEIGHT_NAMES = tuple(weight for weight, _ in PROJECTIONS.values())  # the slab's order
_MODULE_OF = {weight: module for module, (weight, _) in PROJECTIONS.items()}  # for messages: PEFT's names
MLP_WEIGHTS = ("w_gate", "w_up", "w_down")
# Tensor names of one adapted projection of one layer.
_TENSOR = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# Config keys whose non-default value asks for something not supported here: key -> reason.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora) is not supported",
    "modules_to_save": "modules_to_save (fully trained copies of modules) is not supported",
    "rank_pattern": "per-module ranks (rank_pattern) are not supported",
    "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
    "lora_bias": "LoRA biases (lora_bias) are not supported",
    "trainable_token_indices": "trainable tokens (trainable_token_indices) are not supported",
    "fan_in_fan_out": "fan_in_fan_out weights are not supported",
    "layer_replication": "layer_replication is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "target_parameters": "LoRA on parameters (target_parameters) is not supported",
    "use_qalora": "QALoRA (use_qalora) is not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
}


class LoRAError(ValueError):
    """An adapter that cannot be served; the message names the path and the reason."""


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection LoRA can adapt, by jaxserve weight name (GQA: k and v have
    num_kv_heads * head_dim outputs): jaxserve.models.lora.projection_shapes without jax (the
    tests hold the two equal)."""
    D, F, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    return {"wq": (D, q), "wk": (D, kv), "wv": (D, kv), "wo": (q, D), "w_gate": (D, F), "w_up": (D, F),
            "w_down": (F, D)}


def adaptable_weights(config: ModelConfig) -> tuple[str, ...]:
    """The projections an adapter of `config`'s model may adapt (a mixture of experts: attention only)."""
    return tuple(w for w in WEIGHT_NAMES if not (config.is_moe and w in MLP_WEIGHTS))


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    """One adapter in jaxserve's layout (see the module docstring)."""

    path: str
    rank: int
    scaling: float  # folded into `b` already
    weights: dict[str, tuple[np.ndarray, np.ndarray]]  # name -> (A [L, in, rank], B [L, rank, out]) float32
    layers: tuple[int, ...]  # the layers it adapts (the others hold zeros)

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(self.weights)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    def padded(self, max_rank: int, names: tuple[str, ...], shapes: dict[str, tuple[int, int]],
               num_layers: int) -> dict[str, dict[str, np.ndarray]]:
        """Every projection of `names` as a slab slot holds it: {name: {"a": [L, in, max_rank],
        "b": [L, max_rank, out]}} float32, zero-padded past the rank (zeros where not adapted)."""
        out = {}
        for name in names:
            d_in, d_out = shapes[name]
            a = np.zeros((num_layers, d_in, max_rank), np.float32)
            b = np.zeros((num_layers, max_rank, d_out), np.float32)
            if name in self.weights:
                a[:, :, :self.rank], b[:, :self.rank, :] = self.weights[name]
            out[name] = {"a": a, "b": b}
        return out


def load_adapter(path: str, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """The PEFT adapter in folder `path` for a base model of `config`, ranks up to `max_rank`.
    LoRAError when it cannot be served as it is (the reasons: module docstring)."""
    settings = read_config(path)
    rank, alpha = settings["r"], settings["lora_alpha"]
    if rank > max_rank:
        raise LoRAError(f"{path}: rank {rank} is over the maximum LoRA rank {max_rank} (--max_lora_rank)")
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    expected = _expected(path, settings, config)
    tensors = _read_tensors(path, config)
    found = set(tensors)
    if found - expected:
        layer, name = min(found - expected)
        raise LoRAError(f"{path}: the weights adapt {_MODULE_OF[name]} of layer {layer}, which adapter_config.json does not "
                        f"target (target_modules / layers_to_transform)")
    if expected - found:
        layer, name = min(expected - found)
        raise LoRAError(f"{path}: adapter_config.json targets {_MODULE_OF[name]} of layer {layer}, which has no LoRA weights")
    shapes = weight_shapes(config)
    weights = {}
    for name in sorted({name for _, name in found}, key=WEIGHT_NAMES.index):
        d_in, d_out = shapes[name]
        a = np.zeros((config.num_layers, d_in, rank), np.float32)
        b = np.zeros((config.num_layers, rank, d_out), np.float32)
        for (layer, other), pair in tensors.items():
            if other == name:
                a[layer], b[layer] = _layer_update(path, layer, name, pair, rank, (d_in, d_out))
        weights[name] = (a, b * np.float32(scaling))
    return LoRAAdapter(path, rank, scaling, weights, tuple(sorted({layer for layer, _ in found})))


def read_config(path: str) -> dict:
    """adapter_config.json of folder `path`, checked for what is not supported."""
    if not os.path.isdir(path):
        raise LoRAError(f"{path}: no such adapter folder" if not os.path.exists(path) else
                        f"{path}: not a folder (an adapter is a folder with {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        with open(os.path.join(path, CONFIG_FILE)) as f:
            settings = json.load(f)
    except FileNotFoundError:
        raise LoRAError(f"{path}: no {CONFIG_FILE}: not a PEFT adapter folder") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAError(f"{path}: {CONFIG_FILE} cannot be read ({e})") from None
    if not isinstance(settings, dict):
        raise LoRAError(f"{path}: {CONFIG_FILE} is not a JSON object")
    peft_type = settings.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"{path}: a {peft_type} adapter; only LoRA adapters are supported")
    for key, reason in _UNSUPPORTED.items():
        if settings.get(key):
            raise LoRAError(f"{path}: {reason}")
    if settings.get("bias", "none") != "none":
        raise LoRAError(f"{path}: trained biases (bias={settings['bias']!r}) are not supported")
    rank, alpha = settings.get("r"), settings.get("lora_alpha", settings.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAError(f"{path}: {CONFIG_FILE} has no valid rank r (got {rank!r})")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoRAError(f"{path}: {CONFIG_FILE} has no valid lora_alpha (got {alpha!r})")
    return {**settings, "lora_alpha": alpha}


def _expected(path: str, settings: dict, config: ModelConfig) -> set[tuple[int, str]]:
    """The (layer, weight name) pairs the config adapts, matched against the base model's module
    names as PEFT matches them: `target_modules` a list (a name equal to or ending in an entry), a
    regular expression (a full match) or "all-linear"; then `layers_to_transform` and `exclude_modules`."""
    modules, exclude = settings.get("target_modules"), settings.get("exclude_modules") or []
    valid = lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(m, str) for m in v))  # noqa: E731
    if not valid(modules) or not modules or not valid(exclude):
        raise LoRAError(f"{path}: {CONFIG_FILE} has no valid target_modules / exclude_modules (got {modules!r}, "
                        f"{exclude!r})")

    def matches(patterns, name: str) -> bool:
        if patterns == "all-linear":  # every nn.Linear but the output layer
            return name not in ("lm_head", "model.embed_tokens")
        if isinstance(patterns, str):
            return re.fullmatch(patterns, name) is not None
        return any(name == p or name.endswith("." + p) for p in patterns)

    for other in ("model.embed_tokens", "lm_head"):
        if matches(modules, other) and not matches(exclude, other):
            raise LoRAError(f"{path}: embedding or lm_head LoRA ({other}) is not supported")
    layers = _layers(path, settings, config)
    expected, names = set(), set()
    for layer in range(config.num_layers):
        for module, (name, parent) in PROJECTIONS.items():
            full = f"model.layers.{layer}.{parent}.{module}"
            if matches(modules, full) and not matches(exclude, full):
                names.add(full)
                if layer in layers:
                    expected.add((layer, name))
    if isinstance(modules, list):
        unknown = [m for m in modules if not any(n == m or n.endswith("." + m) for n in names)]
        if unknown:
            raise LoRAError(f"{path}: target module(s) {unknown} not supported; supported: {', '.join(PROJECTIONS)} "
                            f"or 'all-linear'")
    if not expected:
        raise LoRAError(f"{path}: target_modules {modules!r} selects none of {', '.join(PROJECTIONS)}")
    refused = sorted(_MODULE_OF[name] for name in {name for _, name in expected} - set(adaptable_weights(config)))
    if refused:
        raise LoRAError(f"{path}: LoRA on the MLP ({', '.join(refused)}) of a mixture-of-experts model is not "
                        f"supported (attention projections only)")
    return expected


def _layers(path: str, settings: dict, config: ModelConfig) -> tuple[int, ...]:
    """The layers the config adapts (`layers_to_transform`: an index or a list; default every layer)."""
    chosen = settings.get("layers_to_transform")
    if chosen is None:
        return tuple(range(config.num_layers))
    chosen = [chosen] if isinstance(chosen, int) else chosen
    if not isinstance(chosen, list) or not all(isinstance(i, int) and 0 <= i < config.num_layers for i in chosen):
        raise LoRAError(f"{path}: layers_to_transform {settings['layers_to_transform']!r} is not a list of layers "
                        f"of a {config.num_layers}-layer model")
    return tuple(chosen)


def _read_tensors(path: str, config: ModelConfig) -> dict[tuple[int, str], dict[str, np.ndarray]]:
    """{(layer, weight name): {"A": array, "B": array}} of the weights file (arrays as stored)."""
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.exists(file):
        if os.path.exists(os.path.join(path, PICKLE_FILE)):
            raise LoRAError(f"{path}: {PICKLE_FILE} is a pickle, which is not loaded (it can run code); save the "
                            f"adapter as {WEIGHTS_FILE} (save_pretrained(..., safe_serialization=True))")
        raise LoRAError(f"{path}: no {WEIGHTS_FILE}")
    try:
        weights = SafetensorsFile(file)
        tensors: dict[tuple[int, str], dict[str, np.ndarray]] = {}
        for tensor in weights.names():
            layer, name, side = _tensor_key(path, tensor, config)
            tensors.setdefault((layer, name), {})[side] = weights.read(tensor)
    except ConversionError as e:
        raise LoRAError(f"{path}: {WEIGHTS_FILE} cannot be read: {e}") from None
    for (layer, name), pair in tensors.items():
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"{path}: {_MODULE_OF[name]} of layer {layer} has lora_{''.join(pair)} but not both lora_A and lora_B")
    return tensors


def _tensor_key(path: str, tensor: str, config: ModelConfig) -> tuple[int, str, str]:
    """(layer, weight name, "A" or "B") of a tensor name; LoRAError for anything else."""
    match = _TENSOR.fullmatch(tensor)
    if match is None:
        if "embed_tokens" in tensor or "lm_head" in tensor:
            raise LoRAError(f"{path}: embedding or lm_head LoRA ({tensor}) is not supported")
        if "lora_magnitude_vector" in tensor:
            raise LoRAError(f"{path}: DoRA ({tensor}) is not supported")
        raise LoRAError(f"{path}: unexpected tensor {tensor!r} in {WEIGHTS_FILE}")
    layer, parent, module, side = int(match[1]), match[2], match[3], match[4]
    if module not in PROJECTIONS or PROJECTIONS[module][1] != parent:
        raise LoRAError(f"{path}: LoRA on {parent}.{module} is not supported; supported: {', '.join(PROJECTIONS)}")
    if layer >= config.num_layers:
        raise LoRAError(f"{path}: tensor {tensor!r} is for layer {layer}; the base model has {config.num_layers}")
    return layer, PROJECTIONS[module][0], side


def _layer_update(path: str, layer: int, name: str, pair: dict[str, np.ndarray], rank: int,
                  shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """One layer's (A [in, r], B [r, out]) float32 from PEFT's lora_A [r, in] and lora_B [out, r],
    checked against the config's rank and the base model's shape."""
    d_in, d_out = shape
    a, b = pair["A"], pair["B"]
    if a.shape != (rank, d_in) or b.shape != (d_out, rank):
        raise LoRAError(f"{path}: {_MODULE_OF[name]} of layer {layer} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; "
                        f"rank {rank} over the base model needs [{rank}, {d_in}] and [{d_out}, {rank}]")
    a, b = np.asarray(a, np.float32).T, np.asarray(b, np.float32).T
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise LoRAError(f"{path}: {_MODULE_OF[name]} of layer {layer} holds non-finite values")
    return a, b

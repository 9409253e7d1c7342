"""Buffers that conversion sources fill tensor by tensor, and the source names of each slot.

The parameter tree, its shapes and the Hugging Face / llama.cpp names of every weight are declared
once, in `jaxserve.models.weights`; a slot is a weight's path ("embed", "layers/wq", ...).
"""
from __future__ import annotations

import numpy as np

from checkpoints import ConversionError
from jaxserve.config import ModelConfig
from jaxserve.models import weights


def _leaf_names(shapes: dict) -> list[str]:
    names = [k for k in shapes if k != "layers"]
    return names + [f"layers/{k}" for k in shapes["layers"]]


def expert_slot(path: str, expert: int) -> str:
    """The slot of one expert's slice of a per-expert weight: "layers/w_up_exps[3]"."""
    return f"{path}[{expert}]"


def split_slot(slot: str) -> tuple[str, int | None]:
    """"layers/w_up_exps[3]" -> ("layers/w_up_exps", 3); a slot without an expert -> (slot, None)."""
    if slot.endswith("]") and "[" in slot:
        path, expert = slot[:-1].split("[", 1)
        return path, int(expert)
    return slot, None


class ParamBuffers:
    """Preallocated parameter arrays in the output dtype, filled one source tensor at a time.

    Every `put` checks the source tensor's shape; `finish` checks that every slot was filled once.
    A mixture-of-experts weight stored one tensor per expert has a slot per expert (`expert_slot`).
    A per-layer weight stacked over some layers only (a mixed model's dense or sparse MLP layers,
    jaxserve.models.weights.LayerKinds) takes those layers' tensors, each at its row of the stack.
    """

    def __init__(self, config: ModelConfig, dtype: np.dtype, source_file: str):
        self.config = config
        self.source_file = source_file
        shapes = weights.param_shapes(config)
        self.arrays = {k: np.empty(s, dtype) for k, s in shapes.items() if k != "layers"}
        self.arrays["layers"] = {k: np.empty(s, dtype) for k, s in shapes["layers"].items()}
        self._filled: dict[tuple[str, int | None], str] = {}
        infos = weights.weight_infos(config).values()
        self._num_experts = {info.path: info.shape[1] for info in infos if info.per_expert}
        self._stacks = {info.path: info for info in infos if info.per_layer}

    def row(self, name: str, layer: int) -> int | None:
        """The row of model layer `layer` in the stack of slot `name` (None: that layer has no such weight)."""
        return self._stacks[split_slot(name)[0]].row_of(layer)

    def slot_shape(self, name: str, layer: int | None) -> tuple[int, ...]:
        """Shape of one slot: a whole leaf, or one layer of a stacked leaf (`name` like 'layers/wq'),
        or one expert of one layer ('layers/w_up_exps[3]')."""
        name, expert = split_slot(name)
        if layer is None:
            return self.arrays[name].shape
        shape = self.arrays["layers"][name.split("/", 1)[1]].shape[1:]
        return shape if expert is None else shape[1:]

    def has_slot(self, name: str) -> bool:
        name, expert = split_slot(name)
        if expert is not None and not 0 <= expert < self._num_experts.get(name, 0):
            return False
        if name.startswith("layers/"):
            return name.split("/", 1)[1] in self.arrays["layers"]
        return name in self.arrays

    def put(self, name: str, layer: int | None, tensor: np.ndarray, source_name: str, transpose: bool,
            source_file: str | None = None) -> None:
        """Store `tensor` (in the source's orientation) into slot `name` (of `layer`)."""
        where = source_file or self.source_file
        if not self.has_slot(name):
            raise ConversionError(f"{where}: unexpected tensor {source_name!r} for this config")
        if layer is not None and not 0 <= layer < self.config.num_layers:
            raise ConversionError(
                f"{where}: tensor {source_name!r} is for layer {layer}, but the model has "
                f"{self.config.num_layers} layers")
        if layer is not None and self.row(name, layer) is None:
            kind = "dense" if layer in self.config.mlp_only_layers else "mixture-of-experts"
            raise ConversionError(f"{where}: unexpected tensor {source_name!r}: layer {layer}'s MLP is {kind} in "
                                  f"this config (its mlp_only_layers / decoder_sparse_step)")
        key = (name, layer)
        if key in self._filled:
            raise ConversionError(
                f"{where}: tensor {source_name!r} duplicates {self._filled[key]!r}")
        slot = self.slot_shape(name, layer)
        expected = tuple(reversed(slot)) if transpose else slot
        if tuple(tensor.shape) != expected:
            raise ConversionError(
                f"{where}: tensor {source_name!r} has shape {tuple(tensor.shape)}, expected {expected}")
        self.store(name, layer, tensor, transpose)
        self._filled[key] = source_name

    def store(self, name: str, layer: int | None, tensor: np.ndarray, transpose: bool) -> None:
        """Writes a checked tensor into its slot (subclasses may store it another way)."""
        if hasattr(tensor, "dequantize"):  # a published quantized weight kept float (checkpoints.prequantized)
            tensor = tensor.dequantize()
        value = tensor.T if transpose else tensor
        name, expert = split_slot(name)
        if layer is None:
            self.arrays[name][...] = value
        elif expert is None:
            self.arrays["layers"][name.split("/", 1)[1]][self.row(name, layer)] = value
        else:
            self.arrays["layers"][name.split("/", 1)[1]][self.row(name, layer), expert] = value

    def finish(self, describe_missing) -> dict:
        """The filled pytree; `describe_missing(name, layer)` names the absent source tensor."""
        for leaf in _leaf_names(self.arrays):
            layers = self._stacks[leaf].stack_layers if leaf.startswith("layers/") else [None]
            slots = ([expert_slot(leaf, e) for e in range(self._num_experts[leaf])] if leaf in self._num_experts
                     else [leaf])
            for layer in layers:
                for name in slots:
                    if (name, layer) not in self._filled:
                        raise ConversionError(
                            f"{self.source_file}: missing tensor {describe_missing(name, layer)!r}")
        return self.arrays


def source_names(config: ModelConfig, fmt: str) -> tuple[dict, dict]:
    """The tensor names of `config`'s weights in a source format ("hf" or "gguf"), as two maps to
    (slot, transposed): whole-model names ("model.norm.weight") and per-layer names without their
    layer prefix ("self_attn.q_proj.weight" of "model.layers.{i}."). A weight stored one tensor per
    expert has one name per expert, each to its own slot (`expert_slot`); one stored as a single
    tensor of every expert (GGUF's `ffn_*_exps`) maps to the weight's path, which its source
    splits into the experts' slots."""
    whole, per_layer = {}, {}
    for info in weights.weight_infos(config).values():
        name = getattr(info, fmt)
        if name is None:
            continue
        if "{expert}" in name:
            for expert in range(info.shape[1]):
                per_layer[name.format(expert=expert)] = (expert_slot(info.path, expert), info.transposed)
        else:
            (per_layer if info.per_layer else whole)[name] = (info.path, info.transposed)
    return whole, per_layer


def describe_slot(whole: dict, per_layer: dict, layer_prefix: str, slot: str, layer: int | None) -> str:
    """The source name of `slot` (of `layer`), for messages about a missing tensor (an expert's
    slot of a weight stored as one tensor of every expert: that tensor's name)."""
    for wanted in (slot, split_slot(slot)[0]):
        for table, prefix in ((whole, ""), (per_layer, layer_prefix.format(layer=layer))):
            for name, (candidate, _) in table.items():
                if candidate == wanted:
                    return prefix + name
    return slot


def vision_tower(config: ModelConfig):
    """(module, vision config) of a vision-language model's tower: `jaxserve.models.qwen_vision`
    (Qwen2.5-VL) or `jaxserve.models.siglip` (Gemma 3, its projector included), and that module's
    VisionConfig read from `config`'s vision section. ConversionError for a text model, or a
    vision config the tower cannot compute (naming the field)."""
    from jaxserve.models import vision
    if config.multimodal_architecture not in vision.TOWERS:
        raise ConversionError(f"{config.architecture} is a text model: it has no vision tower")
    try:
        module, vision_config = vision.tower(config)
    except KeyError as e:
        raise ConversionError(f"vision_config is missing the field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ConversionError(f"vision_config: {e}") from None
    out = getattr(vision_config, "out_hidden_size", getattr(vision_config, "text_hidden_size", None))
    if out != config.hidden_size:
        raise ConversionError(f"the vision tower's output size {out} is not the language model's hidden_size "
                              f"{config.hidden_size}")
    return module, vision_config


def vision_param_shapes(config: ModelConfig) -> dict:
    """The vision params pytree of shapes (tuples) of a vision-language model."""
    from jaxserve.models import vision
    module, vision_config = vision_tower(config)
    return vision.param_shapes(module.weight_decls(vision_config))

"""A `.gguf` file (llama.cpp) as a conversion source: metadata -> ModelConfig, tensors dequantized.

llama.cpp stores the rows of Q and K of `llama` models permuted (rotary pairs interleaved instead
of split in halves); `_unpermute_rows` restores the Hugging Face order.

Mixture-of-experts files, as llama.cpp's converter writes them: Mixtral is arch "llama" with
`llama.expert_count` (its Q/K permuted like Llama's), Qwen2-MoE "qwen2moe", Qwen3-MoE "qwen3moe".
A sparse layer holds its router `ffn_gate_inp` [E, D], its experts as one tensor each
`ffn_{gate,up,down}_exps` [E, out, in] (split into the experts' slots here) and, for
Qwen2-MoE, the shared expert `ffn_*_shexp` with its gate `ffn_gate_inp_shexp` ([D] or [1, D]).
Config: `{arch}.expert_count`, `expert_used_count`, `expert_feed_forward_length` (an expert's
intermediate size; Mixtral's is `feed_forward_length`), `expert_shared_feed_forward_length`.
Whether the top-k weights are renormalised: `{arch}.expert_weights_norm` where the file has it,
else llama.cpp's own choice per architecture (`_NORM_TOPK_DEFAULT`: Mixtral and Qwen3-MoE yes,
Qwen2-MoE no). A layer without a router (`ffn_gate`/`ffn_up`/`ffn_down` instead) is a dense
MLP layer (ModelConfig.mlp_only_layers). Quantized expert tensors are dequantized to float, as
every other tensor of a file converted without --quantization; with it, Q8_0 / Q4_0 / Q4_1 expert
tensors are copied block for block into each expert's slot, as the other matrices are
(checkpoints.quantized).
"""
from __future__ import annotations

import os
import re
from typing import Iterator

import gguf
import numpy as np

from checkpoints import ConversionError
from checkpoints.gguf_tokenizer import build_tokenizer
from checkpoints.layout import describe_slot, expert_slot, source_names
from checkpoints.rope_freqs import llama3_scaling_from_factors
from jaxserve.config import ConfigError, ModelConfig
from jaxserve.models import weights

Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
                   Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# general.architecture -> (HF architecture, Q/K rows permuted by llama.cpp); "llama" with experts: Mixtral
ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False),
                 "qwen2moe": ("Qwen2MoeForCausalLM", False), "qwen3moe": ("Qwen3MoeForCausalLM", False)}
_MOE_ARCHS = ("qwen2moe", "qwen3moe")
# llama.cpp's top-k renormalisation where a file has no `{arch}.expert_weights_norm` (its graph of
# each architecture: llama (Mixtral) and qwen3moe renormalise, qwen2moe does not)
_NORM_TOPK_DEFAULT = {"llama": True, "qwen3moe": True, "qwen2moe": False}
_ROUTER = "ffn_gate_inp.weight"
_SHARED_GATE = "ffn_gate_inp_shexp.weight"

_LAYER_PREFIX = "blk.{layer}."
_ROPE_PERMUTED = {"attn_q.weight": "q", "attn_q.bias": "q", "attn_k.weight": "kv", "attn_k.bias": "kv"}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")
_ROPE_FREQS = "rope_freqs.weight"


def _unpermute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K permutation on the leading (output) axis (of GGUF blocks too)."""
    if hasattr(rows, "with_rows"):  # checkpoints.quantized.GGUFBlocks: rows of blocks
        return rows.with_rows(_unpermute_rows(rows.data, num_heads))
    half = rows.shape[0] // num_heads // 2
    grouped = rows.reshape(num_heads, half, 2, *rows.shape[1:])
    return grouped.swapaxes(1, 2).reshape(rows.shape)


def _shortest_float(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


class GGUFSource:
    """Reads model metadata and tensors of one GGUF file (memory-mapped)."""

    kind = "gguf"

    def __init__(self, path: str):
        self.path = path
        if not os.path.isfile(path):
            raise ConversionError(f"{path}: no such file")
        try:
            self.reader = gguf.GGUFReader(path)
        except Exception as e:  # the reader raises assorted errors on truncated or foreign files
            raise ConversionError(f"{path}: not a readable GGUF file, truncated or corrupt ({e})") from None
        self.tensors_by_name = {t.name: t for t in self.reader.tensors}
        if (self._field("split.count") or 1) > 1:
            raise ConversionError(f"{path}: split GGUF files are not supported; merge the parts first "
                                  "(llama-gguf-split --merge)")
        self.gguf_arch = self._field("general.architecture", required=True)
        if self.gguf_arch not in ARCHITECTURES:
            raise ConversionError(
                f"{path}: unsupported architecture {self.gguf_arch!r}; supported: {', '.join(ARCHITECTURES)}")
        self.architecture, self.permuted_qk = ARCHITECTURES[self.gguf_arch]
        self.num_experts = int(self._field(f"{self.gguf_arch}.expert_count") or 0)
        if self.gguf_arch == "llama" and self.num_experts > 0:  # llama.cpp's Mixtral
            self.architecture = "MixtralForCausalLM"
        if self.gguf_arch in _MOE_ARCHS and self.num_experts < 1:
            raise ConversionError(f"{path}: {self.gguf_arch} file without {self.gguf_arch}.expert_count")
        try:
            self.config = self._read_config()
        except (TypeError, ValueError) as e:
            if isinstance(e, ConversionError):
                raise
            raise ConversionError(f"{path}: malformed model metadata ({e})") from None
        self._whole_names, self._layer_names = source_names(self.config, "gguf")
        self._stacked_experts = {info.path for info in weights.weight_infos(self.config).values() if info.per_expert}

    def _field(self, key: str, required: bool = False, default=None):
        field = self.reader.get_field(key)
        if field is None:
            if required:
                raise ConversionError(f"{self.path}: missing metadata {key!r}")
            return default
        return field.contents()

    def _read_config(self) -> ModelConfig:
        arch = self.gguf_arch
        hidden = int(self._field(f"{arch}.embedding_length", required=True))
        num_heads = int(self._field(f"{arch}.attention.head_count", required=True))
        num_kv_heads = self._field(f"{arch}.attention.head_count_kv", default=num_heads)
        if isinstance(num_kv_heads, list):
            if len(set(num_kv_heads)) != 1:
                raise ConversionError(f"{self.path}: per-layer head_count_kv {num_kv_heads} is not supported")
            num_kv_heads = num_kv_heads[0]
        head_dim = int(self._field(f"{arch}.attention.key_length", default=hidden // num_heads))
        rotary_dim = self._field(f"{arch}.rope.dimension_count", default=head_dim)
        if rotary_dim != head_dim:
            raise ConversionError(f"{self.path}: partial rotary (rope.dimension_count {rotary_dim} != "
                                  f"head dim {head_dim}) is not supported")
        scaling_type = self._field(f"{arch}.rope.scaling.type", default="none")
        if scaling_type not in ("none", ""):
            raise ConversionError(f"{self.path}: rope scaling type {scaling_type!r} is not supported")
        rope_theta = _shortest_float(self._field(f"{arch}.rope.freq_base", default=10000.0))
        tokens = self.reader.get_field("tokenizer.ggml.tokens")
        vocab_size = len(tokens.data) if tokens is not None else self._field(f"{arch}.vocab_size")
        if vocab_size is None:
            raise ConversionError(f"{self.path}: no tokenizer.ggml.tokens and no {arch}.vocab_size metadata")
        eos_ids = []
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            value = self._field(f"tokenizer.ggml.{key}")
            if value is not None and int(value) not in eos_ids:
                eos_ids.append(int(value))
        bos = self._field("tokenizer.ggml.bos_token_id")
        hf_dict = {
            "architectures": [self.architecture],
            "vocab_size": int(vocab_size),
            "hidden_size": hidden,
            "intermediate_size": int(self._field(f"{arch}.feed_forward_length", required=True)),
            "num_hidden_layers": int(self._field(f"{arch}.block_count", required=True)),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(num_kv_heads),
            "head_dim": head_dim,
            "rms_norm_eps": _shortest_float(self._field(f"{arch}.attention.layer_norm_rms_epsilon", default=1e-5)),
            "rope_theta": rope_theta,
            "rope_scaling": self._rope_scaling(rope_theta, head_dim),
            "max_position_embeddings": int(self._field(f"{arch}.context_length", default=2048)),
            "tie_word_embeddings": "output.weight" not in self.tensors_by_name,
            "attention_bias": "blk.0.attn_q.bias" in self.tensors_by_name,
            "bos_token_id": None if bos is None else int(bos),
            "eos_token_id": eos_ids,
        }
        if self.num_experts:
            hf_dict.update(self._moe_fields(hf_dict))
        try:
            return ModelConfig.from_hf_dict(hf_dict)
        except ConfigError as e:
            raise ConversionError(f"{self.path}: {e}") from None

    def _moe_fields(self, hf_dict: dict) -> dict:
        """The config.json fields of a mixture-of-experts file (see the module docstring)."""
        arch = self.gguf_arch
        top_k = self._field(f"{arch}.expert_used_count", required=True)
        norm = self._field(f"{arch}.expert_weights_norm")
        scale = self._field(f"{arch}.expert_weights_scale")
        if scale not in (None, 0.0, 1.0):  # llama.cpp: 0 (unset) and 1 leave the weights as they are
            raise ConversionError(f"{self.path}: {arch}.expert_weights_scale={scale} is not supported")
        gating = self._field(f"{arch}.expert_gating_func")
        if gating not in (None, int(gguf.ExpertGatingFuncType.SOFTMAX)):
            raise ConversionError(f"{self.path}: {arch}.expert_gating_func={gating} is not supported (softmax only)")
        fields = {"num_experts_per_tok": int(top_k)}
        if arch == "llama":
            if norm is not None and not norm:
                raise ConversionError(f"{self.path}: {arch}.expert_weights_norm=false is not supported for Mixtral")
            return {**fields, "num_local_experts": self.num_experts}
        num_layers = hf_dict["num_hidden_layers"]
        dense = [i for i in range(num_layers) if f"blk.{i}.{_ROUTER}" not in self.tensors_by_name]
        sparse = [i for i in range(num_layers) if i not in dense]
        size = self._field(f"{arch}.expert_feed_forward_length")
        if size is None and sparse:  # older files: from the first sparse layer's experts [E, F, D]
            gate = self.tensors_by_name.get(f"blk.{sparse[0]}.ffn_gate_exps.weight")
            size = None if gate is None or len(gate.shape) != 3 else int(gate.shape[1])
        if size is None:
            raise ConversionError(f"{self.path}: no {arch}.expert_feed_forward_length metadata")
        fields.update(num_experts=self.num_experts, moe_intermediate_size=int(size), mlp_only_layers=dense,
                      norm_topk_prob=bool(_NORM_TOPK_DEFAULT[arch] if norm is None else norm))
        if arch == "qwen2moe":
            shared = self._field(f"{arch}.expert_shared_feed_forward_length")
            if shared is None:
                gate = self.tensors_by_name.get(f"blk.{sparse[0]}.ffn_gate_shexp.weight") if sparse else None
                shared = None if gate is None else int(gate.shape[1])
            fields.update(shared_expert_intermediate_size=0 if shared is None else int(shared),
                          qkv_bias=hf_dict["attention_bias"])
        return fields

    def _rope_scaling(self, rope_theta: float, head_dim: int) -> dict | None:
        tensor = self.tensors_by_name.get(_ROPE_FREQS)
        if tensor is None:
            return None
        factors = self._dequantize(tensor)
        try:
            return llama3_scaling_from_factors(factors, rope_theta, head_dim)
        except ValueError as e:
            raise ConversionError(f"{self.path}: tensor {_ROPE_FREQS!r}: {e}") from None

    def default_dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    def _dequantize(self, tensor) -> np.ndarray:
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise ConversionError(
                f"{self.path}: tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}; "
                f"supported: {', '.join(t.name for t in SUPPORTED_TYPES)}")
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # [rows, cols] = [out, in]
        expected = tuple(int(n) for n in reversed(tensor.shape))
        if values.size != int(np.prod(expected)):
            raise ConversionError(f"{self.path}: tensor {tensor.name!r} data does not match its shape {expected}")
        return values.reshape(expected)

    def tensor_kinds(self) -> dict[str, set[str]]:
        """{slot: GGML type names of its tensors} for the per-layer slots."""
        kinds: dict[str, set[str]] = {}
        for tensor in self.reader.tensors:
            match = _LAYER_NAME.fullmatch(tensor.name)
            if match and match.group(2) in self._layer_names:
                kinds.setdefault(self._layer_names[match.group(2)][0], set()).add(tensor.tensor_type.name)
        return kinds

    def _blocks(self, tensor):
        from checkpoints.quantized import gguf_blocks
        try:
            blocks = gguf_blocks(tensor)
        except ValueError:
            blocks = None
        if blocks is None or blocks.shape != tuple(int(n) for n in reversed(tensor.shape)):
            raise ConversionError(f"{self.path}: tensor {tensor.name!r} data does not match its shape")
        return blocks

    def num_tensors(self) -> int:
        """How many tensors the file holds (an upper bound of what `tensors` yields)."""
        return len(self.reader.tensors)

    def tensors(self, keep_blocks: frozenset[str] = frozenset()
                ) -> Iterator[tuple[str, str, str, int | None, np.ndarray, bool]]:
        """(file, gguf name, slot, layer, tensor as [out, in], transpose) for every weight, in file order.

        Tensors of the slots in `keep_blocks` come as checkpoints.quantized.GGUFBlocks (undequantized)."""
        for tensor in self.reader.tensors:
            name = tensor.name
            if name == _ROPE_FREQS:
                continue
            if name == "output.weight" and self.config.tie_word_embeddings:
                continue
            match = _LAYER_NAME.fullmatch(name)
            if match and match.group(2) in self._layer_names:
                layer, (slot, transpose) = int(match.group(1)), self._layer_names[match.group(2)]
            elif name in self._whole_names:
                layer, (slot, transpose) = None, self._whole_names[name]
            else:
                raise ConversionError(f"{self.path}: unexpected tensor {name!r}")
            if slot in self._stacked_experts:
                yield from self._experts(tensor, slot, layer, transpose, slot in keep_blocks)
                continue
            values = self._blocks(tensor) if slot in keep_blocks else self._dequantize(tensor)
            permuted = _ROPE_PERMUTED.get(match.group(2)) if match else None
            if self.permuted_qk and permuted:
                heads = self.config.num_q_heads if permuted == "q" else self.config.num_kv_heads
                if values.shape[0] % (2 * heads) == 0:  # otherwise the shape check reports it
                    values = _unpermute_rows(values, heads)
            if match and match.group(2) == _SHARED_GATE and values.ndim == 1:
                values = values[None, :]  # llama.cpp declares it [D]; the weight is [1, D]
            yield self.path, name, slot, layer, values, transpose

    def _experts(self, tensor, slot: str, layer: int, transpose: bool, keep_blocks: bool = False):
        """The per-expert slots of one `ffn_*_exps` tensor [E, out, in] of every expert: float
        [out, in] each, or with `keep_blocks` each expert's rows of GGUF blocks."""
        shape = tuple(int(n) for n in reversed(tensor.shape))  # [E, out, in]
        if len(shape) != 3 or shape[0] != self.config.num_experts:
            raise ConversionError(f"{self.path}: tensor {tensor.name!r} has shape {shape}, expected "
                                  f"[{self.config.num_experts} experts, out, in]")
        if keep_blocks:
            from checkpoints.quantized import GGUFBlocks, gguf_block_bytes
            data = np.asarray(tensor.data, np.uint8).reshape(shape[0], shape[1], -1, gguf_block_bytes(tensor))
            per_expert = [GGUFBlocks(tensor.tensor_type.name, rows) for rows in data]
        else:
            per_expert = self._dequantize(tensor).reshape(shape)
        for expert, values in enumerate(per_expert):
            yield self.path, tensor.name, expert_slot(slot, expert), layer, values, transpose

    def describe_missing(self, slot: str, layer: int | None) -> str:
        return describe_slot(self._whole_names, self._layer_names, _LAYER_PREFIX, slot, layer)

    def save_tokenizer(self, output_dir: str) -> bool:
        """Builds a Hugging Face tokenizer (chat template included) from the GGUF metadata (no torch:
        checkpoints.gguf_tokenizer); False when the file has no vocabulary."""
        try:
            tokenizer = build_tokenizer(self.reader)
        except Exception as e:  # GGUFTokenizerError, or what tokenizers raises for metadata it cannot take
            raise ConversionError(f"{self.path}: cannot build the tokenizer from GGUF metadata ({e})") from None
        if tokenizer is None:
            return False
        tokenizer.save_pretrained(output_dir)
        return True

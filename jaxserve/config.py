"""Model and engine configuration.

`ModelConfig` is read from a Hugging Face `config.json` dict (the converter writes one for every
checkpoint, GGUF sources included). `EngineConfig` holds the serving knobs.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class ConfigError(ValueError):
    """A model configuration that jaxserve cannot serve."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF llama3 dict: factor, low/high_freq_factor, original_max_position_embeddings
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2-style q/k/v biases
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"

    @property
    def q_size(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def param_shapes(self) -> dict[str, Any]:
        """The one declaration of the weights: a pytree of shapes, for `x @ W` (transposed from
        Hugging Face's [out, in]), per-layer weights stacked on a leading layer axis."""
        L, D, F, V = self.num_layers, self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.q_size, self.kv_size
        layers = {"attn_norm": (L, D), "wq": (L, D, q), "wk": (L, D, kv), "wv": (L, D, kv), "wo": (L, q, D),
                  "mlp_norm": (L, D), "w_gate": (L, D, F), "w_up": (L, D, F), "w_down": (L, F, D)}
        if self.attention_bias:
            layers.update(bq=(L, q), bk=(L, kv), bv=(L, kv))
        shapes = {"embed": (V, D), "layers": layers, "final_norm": (D,)}
        if not self.tie_word_embeddings:
            shapes["lm_head"] = (D, V)
        return shapes

    def num_params(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = 2 * d + d * (self.q_size + 2 * self.kv_size) + self.q_size * d + 3 * d * f
        if self.attention_bias:
            per_layer += self.q_size + 2 * self.kv_size
        lm_head = 0 if self.tie_word_embeddings else d * v
        return v * d + self.num_layers * per_layer + d + lm_head

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            num_q_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            head_dim = cfg.get("head_dim") or hidden // num_q_heads
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            # transformers >= 5 folds rope_theta and the scaling dict into `rope_parameters`.
            rope_params = cfg.get("rope_parameters") or {}
            rope_theta = float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0)))
            rope_scaling = cfg.get("rope_scaling") or (rope_params or None)
            if rope_scaling is not None:
                rope_scaling = {k: v for k, v in rope_scaling.items() if k != "rope_theta"}
                kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
                if kind not in ("llama3", "default", None):
                    raise ConfigError(f"unsupported rope_scaling type {kind!r}")
                if kind in ("default", None):
                    rope_scaling = None
            config = cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_q_heads=num_q_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_q_heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                architecture=arch,
            )
        except KeyError as e:
            raise ConfigError(f"config is missing the field {e.args[0]!r}") from None
        if config.num_q_heads % config.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({config.num_q_heads}) is not a multiple of num_key_value_heads ({config.num_kv_heads})")
        return config

    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                           "Qwen2ForCausalLM": "qwen2"}[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_q_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
        }

    @classmethod
    def from_json_file(cls, path: str) -> "ModelConfig":
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: no such file")
        try:
            with open(path) as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(data)

"""A mixture-of-experts model's fields of ModelConfig (jaxserve.config), read from and written to
a Hugging Face config.json (transformers 4 and 5 names); ConfigError, the refusal of a model
configuration, lives here so that both modules raise it. No jax.
"""
from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A model configuration that jaxserve cannot serve."""


def moe_fields(cfg: dict[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields ({} for a dense family), from transformers 4 or 5
    names: the expert count is `num_local_experts` (Mixtral; Qwen3-MoE under transformers 5) or
    `num_experts` (Qwen2/3-MoE under transformers 4). Mixtral always renormalises its top-k
    weights; the Qwen families do where `norm_topk_prob` says. The Qwen families may mix dense MLP
    layers with sparse ones, by transformers' rule (the same for both): layer i is sparse iff
    i is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0; the dense ones are
    kept as ModelConfig.mlp_only_layers. A model without any sparse layer is refused."""
    if arch not in ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
        return {}
    experts = cfg.get("num_local_experts") if arch == "MixtralForCausalLM" else None
    experts = int(experts or cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 2)
    if experts < 1 or not 1 <= top_k <= experts:
        raise ConfigError(f"{arch} needs num_experts >= 1 and 1 <= num_experts_per_tok <= num_experts, "
                          f"got {experts} experts and top-{top_k}")
    if arch == "MixtralForCausalLM":
        return dict(num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
                    moe_intermediate_size=int(cfg["intermediate_size"]))
    dense_layers = dense_mlp_layers(cfg, num_layers)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    if arch == "Qwen2MoeForCausalLM" and shared < 1:
        raise ConfigError(f"shared_expert_intermediate_size={shared!r}: Qwen2-MoE needs its shared expert")
    size = cfg.get("moe_intermediate_size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"moe_intermediate_size must be a positive integer, got {size!r}")
    return dict(num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                moe_intermediate_size=size, shared_expert_intermediate_size=shared, mlp_only_layers=dense_layers)


def dense_mlp_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The Qwen MoE layers whose MLP is dense: in `mlp_only_layers` (entries past the last layer
    name no layer, as in transformers), or not a multiple of `decoder_sparse_step` (counting from 1)."""
    step = cfg.get("decoder_sparse_step")
    step = 1 if step is None else step
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ConfigError(f"decoder_sparse_step must be a positive integer, got {step!r}")
    listed = cfg.get("mlp_only_layers") or []
    if not isinstance(listed, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in listed):
        raise ConfigError(f"mlp_only_layers must be a list of layer indices, got {listed!r}")
    dense = tuple(i for i in range(num_layers) if i in listed or (i + 1) % step)
    if len(dense) == num_layers:
        raise ConfigError(f"decoder_sparse_step={step}, mlp_only_layers={list(listed)}: no layer of the "
                          f"{num_layers} is a mixture-of-experts layer (serve it as a dense model)")
    return dense


def moe_hf_fields(config) -> dict[str, Any]:
    """The config.json fields of a mixture-of-experts model (both transformers 4 and 5 read them);
    the dense layers as `mlp_only_layers`, with decoder_sparse_step 1."""
    if config.architecture == "MixtralForCausalLM":
        return {"num_local_experts": config.num_experts, "num_experts_per_tok": config.num_experts_per_tok}
    out = {"num_experts": config.num_experts, "num_experts_per_tok": config.num_experts_per_tok,
           "moe_intermediate_size": config.moe_intermediate_size, "norm_topk_prob": config.norm_topk_prob,
           "decoder_sparse_step": 1, "mlp_only_layers": list(config.mlp_only_layers)}
    if config.architecture == "Qwen2MoeForCausalLM":
        out.update(shared_expert_intermediate_size=config.shared_expert_intermediate_size,
                   qkv_bias=config.attention_bias)
    return out

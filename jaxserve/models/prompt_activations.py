"""Which quantized weights multiply prompt chunks with 8-bit activations on an accelerator
(EngineConfig.gpu_prompt_dtype): int8 rows with per-channel int8 weights, float8 e4m3 rows with
e4m3 weights. `mark` sets the choice on each weight that takes it (a static field of its
QuantArray, so the step's trace sees it); `quantization.linear` then multiplies a prompt chunk in
prompt_matmul.quantized_activations_linear."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxserve.models import quantization


def takes(weight, activations: str) -> bool:
    """Whether a weight's prompt matmuls can take activations quantized to `activations` ("int8":
    an int8 weight with one scale per output channel and no zero point, --quantization=int8; "fp8":
    a float8 e4m3 one, per output channel) on an accelerator (no act-order permutation)."""
    if not isinstance(weight, quantization.QuantArray) or weight.perm is not None or weight.zero is not None \
            or weight.scale.shape[-2] != 1:
        return False
    return weight.q.dtype == {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[activations]


def mark(params: dict, activations: str) -> dict:
    """`params` with each quantized linear weight of the layers (and an untied lm_head) that
    `takes` marked to multiply prompt chunks with activations quantized to `activations`
    (EngineConfig.gpu_prompt_dtype: "int8" or "fp8"; "bfloat16": unchanged).
    ValueError naming the flag if no weight takes it (nothing would change)."""
    if activations == "bfloat16":
        return params

    def marked_weight(w):
        return dataclasses.replace(w, prompt_activations=activations) if takes(w, activations) else w

    layers = {name: marked_weight(w) for name, w in params["layers"].items()}
    marked = sum(layers[name] is not w for name, w in params["layers"].items())
    if not marked:
        need = "--quantization=int8 (per-channel int8 weights)" if activations == "int8" else \
            "a float8 (e4m3, per output channel) checkpoint"
        raise ValueError(f"--gpu_prompt_dtype={activations} needs {need}; this model's linear weights are "
                         f"{sorted(set(quantization.params_formats(params).values())) or ['float']}")
    out = {**params, "layers": layers}
    if "lm_head" in params:
        out["lm_head"] = marked_weight(params["lm_head"])
    return out

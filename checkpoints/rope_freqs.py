"""Recover Hugging Face `rope_scaling` (llama3 type) from llama.cpp's `rope_freqs` tensor.

llama.cpp stores llama3 rope scaling as one divisor per rotary frequency instead of the four
parameters. The divisors are a function of those parameters, so we try the parameter sets that
Llama 3.x releases use and keep the one that reproduces the tensor.
"""
from __future__ import annotations

import numpy as np

from jaxserve.config import rope_inv_freq

_CANDIDATES = tuple(
    {"low_freq_factor": low, "high_freq_factor": high, "original_max_position_embeddings": original}
    for original in (8192, 4096, 2048, 16384, 32768, 131072)
    for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 4.0))
)


def llama3_frequency_divisors(rope_theta: float, head_dim: int, scaling: dict) -> np.ndarray:
    """The per-frequency divisors that llama3 scaling applies: [head_dim // 2]."""
    scaling = {"rope_type": "llama3", **scaling}
    return rope_inv_freq(rope_theta, head_dim, None) / rope_inv_freq(rope_theta, head_dim, scaling)


def llama3_scaling_from_factors(factors: np.ndarray, rope_theta: float, head_dim: int) -> dict | None:
    """The llama3 `rope_scaling` dict matching `factors` ([head_dim // 2]); None when they are all 1.

    Raises ValueError when no llama3 parameter set reproduces them.
    """
    factors = np.asarray(factors, np.float64).reshape(-1)
    if factors.shape != (head_dim // 2,):
        raise ValueError(f"rope_freqs has {factors.size} values, expected {head_dim // 2}")
    if np.allclose(factors, 1.0, rtol=1e-6, atol=0):
        return None
    factor = float(np.round(factors.max(), 4))
    for candidate in _CANDIDATES:
        scaling = {"rope_type": "llama3", "factor": factor, **candidate}
        if np.allclose(llama3_frequency_divisors(rope_theta, head_dim, scaling), factors, rtol=1e-4, atol=0):
            return scaling
    raise ValueError("rope_freqs does not match llama3 rope scaling")

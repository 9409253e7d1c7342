"""Qwen2.5-VL's M-RoPE tables on the device: `mrope_tables` gives cos and sin [T, 1, head_dim // 2]
in the layout of `jaxserve.models.llama.rope_tables` (half-split rotation): frequency j uses the
temporal, height or width position according to the band of `mrope_section` (e.g. [16, 24, 24]
for head_dim 128) it falls in. Where the three positions agree (text), this is the 1-D RoPE table.
The positions themselves come from the host: jaxserve.multimodal.mrope.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxserve.multimodal.mrope import section_of_frequency


def mrope_tables(positions, inv_freq: np.ndarray, mrope_section):
    """cos, sin [T, 1, head_dim // 2] float32 (jaxserve.models.llama.rope_tables's layout) of
    positions [3, T] (a jax or numpy integer array) with `inv_freq` [head_dim // 2]."""
    axis = section_of_frequency(mrope_section, len(inv_freq))  # [hd/2]
    pos = jnp.asarray(positions).astype(jnp.float32)  # [3, T]
    angles = pos[axis, :].T * jnp.asarray(inv_freq, jnp.float32)[None, :]  # [T, hd/2]
    return jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]

"""The multi-LoRA update in plain XLA: the CPU's form of pallas_kernels.dispatch.lora_update
where the C++ kernel (cpu_kernels.lora_update, each row through its own slot only) does not run
(not built, or a slab that is not float32), and the form for a platform with no kernel.

    y[t] = (x[t] @ a[slots[t]]) @ b[slots[t]]          x [T, K], a [S, K, R], b [S, R, N]

Slot 0 is the zero adapter of base rows (its matrices are zeros) and is not computed. Every
other slot's A multiplies every row in one dot ([T, K] x [K, (S-1) R]), a one-hot mask of the
rows' slots keeps each row's own R columns, and one dot by the stacked B ([(S-1) R, N]) adds
them up: two dense dots instead of a per-row gather of the matrices. On the 2-core CPU, 30
layers of SmolLM2-135M's seven projections, 32 rows, 4 adapters of rank 16 (bench/lora_decode.py
--forms, bench/RESULTS.md): this form costs about 1.2x the base matmuls alone, a per-row gather of
A and B 1.8x, jax.lax.ragged_dot over rows sorted by slot 1.6x (its CPU lowering is dense per
group, see xla_grouped.py). The FLOPs grow with the slots: (S-1) R (K + N) per row. The C++
kernel does R (K + N) per row and reads each used slot once: in a SmolLM2-135M-shaped decode step
of 32 rows on 4 adapters it adds 9-14 ms, this form 25-33 ms (bench/RESULTS.md, Multi-LoRA decode step).
"""

import jax
import jax.numpy as jnp


def lora_update(x, a, b, slots):
    """x [T, K], a [S, K, R], b [S, R, N], slots int32[T] in [0, S) -> [T, N] in x's dtype,
    accumulated in float32 (slot 0: zeros)."""
    num_slots = a.shape[0]
    if num_slots == 1:
        return jnp.zeros((x.shape[0], b.shape[-1]), x.dtype)
    shrunk = jnp.einsum("tk,skr->tsr", x, a[1:], preferred_element_type=jnp.float32)  # [T, S-1, R]
    own = slots[:, None] == jnp.arange(1, num_slots, dtype=slots.dtype)  # [T, S-1]
    shrunk = jnp.where(own[:, :, None], shrunk, 0.0).astype(b.dtype)
    return jnp.einsum("tsr,srn->tn", shrunk, b[1:], preferred_element_type=jnp.float32).astype(x.dtype)

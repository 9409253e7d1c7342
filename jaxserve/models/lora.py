"""The device slab of LoRA adapters, and their update inside the model's step.

The slab holds up to `max_loras` adapters at once, each in a fixed slot, over every projection it
was made for (`names`, jaxserve weight names: wq, wk, wv, wo, w_gate, w_up, w_down):

    slab[name]["a"]   [L, S, in, R]     S = max_loras + 1 slots, R = max_lora_rank
    slab[name]["b"]   [L, S, R, out]    the adapter's scaling folded in (checkpoints.lora_adapter)

Slot 0 is the zero adapter, the slot of base-model rows; an adapter of rank r < R fills its
first r columns of A and rows of B and leaves zeros after them, and zeros in the layers and
projections it does not adapt, so every adapter of the slab runs the same computation. Shapes
never change: `write_slot` and `clear_slot` are jitted once per slab shape (the slot index is a
traced scalar, the slab donated: updated in place) and loading or swapping an adapter never
recompiles the step.

In the step (jaxserve.models.llama.forward with a slab), every token row carries its slot
(batch["lora_slots"], int32[T]) and each adapted projection adds

    y[t] += (x[t] @ A[l, slot[t]]) @ B[l, slot[t]]

through pallas_kernels.dispatch.lora_update (one gathered batched matmul per projection, the
BGMV of Punica and S-LoRA: the Pallas kernel on a GPU, the C++ kernel of cpu_kernels on the
CPU, each row through its own slot, the layer's slices read in place), over float
and quantized base weights alike (the LoRA arrays are float, `lora_dtype`). `LayerLoRA` is one
layer's view of the slab: it reads the layer's slices where the update runs (on the CPU, a step
with every row on slot 0 reads none and runs no update).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models import weights
from jaxserve.models.quantization import linear, linear_group
from pallas_kernels import dispatch

Slab = dict  # {name: {"a": [L, S, in, R], "b": [L, S, R, out]}}

# The projections an adapter may adapt, in jaxserve's weight names.
NAMES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
MLP_NAMES = ("w_gate", "w_up", "w_down")


def adaptable_names(config: ModelConfig) -> tuple[str, ...]:
    """The projections of NAMES a slab for `config`'s model holds: all seven, or the attention's
    four for a mixture of experts (its MLP is not adapted)."""
    return tuple(n for n in NAMES if not (config.is_moe and n in MLP_NAMES))


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of every adaptable projection, as the weights declare them (jaxserve.models.weights:
    stored for x @ W, so GQA's wk and wv have num_kv_heads * head_dim outputs)."""
    infos = weights.weight_infos(config)
    return {name: infos[f"layers/{name}"].shape[1:] for name in adaptable_names(config)}


def slab_shapes(config: ModelConfig, max_loras: int, max_rank: int,
                names: tuple[str, ...] | None = None) -> dict[str, dict[str, tuple[int, ...]]]:
    """The slab's array shapes (max_loras adapters plus the zero slot) over `names` (default:
    every adaptable projection)."""
    L, S, R = config.num_layers, max_loras + 1, max_rank
    shapes = projection_shapes(config)
    return {name: {"a": (L, S, shapes[name][0], R), "b": (L, S, R, shapes[name][1])}
            for name in names or adaptable_names(config)}


def slab_bytes(config: ModelConfig, max_loras: int, max_rank: int, dtype=jnp.float32,
               names: tuple[str, ...] | None = None) -> int:
    """The slab's size in bytes (for the memory planner)."""
    leaves = [s for pair in slab_shapes(config, max_loras, max_rank, names).values() for s in pair.values()]
    return sum(int(np.prod(s)) for s in leaves) * jnp.dtype(dtype).itemsize


def init_slab(config: ModelConfig, max_loras: int, max_rank: int, dtype=jnp.float32,
              names: tuple[str, ...] | None = None, sharding=None) -> Slab:
    """A slab of zeros: every slot the zero adapter."""
    shapes = slab_shapes(config, max_loras, max_rank, names)
    zeros = lambda: {name: {k: jnp.zeros(s, dtype) for k, s in pair.items()} for name, pair in shapes.items()}  # noqa: E731
    return jax.jit(zeros, out_shardings=sharding)()


@functools.partial(jax.jit, donate_argnums=0)
def _write(slab: Slab, slot: jax.Array, arrays: Slab) -> Slab:
    """slab with slot `slot` (int32 scalar) replaced by `arrays` ({name: {"a": [L, in, R], "b": [L, R, out]}})."""
    return jax.tree.map(lambda s, new: s.at[:, slot].set(new.astype(s.dtype)), slab, arrays)


@functools.partial(jax.jit, donate_argnums=0)
def _clear(slab: Slab, slot: jax.Array) -> Slab:
    return jax.tree.map(lambda s: s.at[:, slot].set(jnp.zeros((), s.dtype)), slab)


def write_slot(slab: Slab, slot: int, arrays: dict[str, dict[str, np.ndarray]]) -> Slab:
    """`slab` (donated: do not use it after) with the adapter `arrays` in slot `slot` (1..max_loras):
    every projection of the slab, padded to its rank (checkpoints.lora_adapter.LoRAAdapter.padded).
    ValueError for slot 0 (the zero adapter), a slot past the slab, or arrays that do not fit."""
    _check_slot(slab, slot)
    expected = {name: {k: v[:1] + v[2:] for k, v in pair.items()} for name, pair in _shapes(slab).items()}
    got = {name: {k: tuple(np.shape(v)) for k, v in pair.items()} for name, pair in arrays.items()}
    if got != expected:
        raise ValueError(f"adapter arrays {got} do not fit the slab's slots {expected}")
    return _write(slab, jnp.int32(slot), arrays)


def clear_slot(slab: Slab, slot: int) -> Slab:
    """`slab` (donated) with slot `slot` (1..max_loras) back to the zero adapter."""
    _check_slot(slab, slot)
    return _clear(slab, jnp.int32(slot))


def num_slots(slab: Slab) -> int:
    """Slots of the slab, the zero slot included (max_loras + 1)."""
    return next(iter(slab.values()))["a"].shape[1]


def _shapes(slab: Slab) -> dict[str, dict[str, tuple[int, ...]]]:
    return {name: {k: tuple(v.shape) for k, v in pair.items()} for name, pair in slab.items()}


def _check_slot(slab: Slab, slot: int) -> None:
    if not 1 <= slot < num_slots(slab):
        raise ValueError(f"LoRA slot {slot} is not one of the slab's adapter slots 1..{num_slots(slab) - 1} "
                         f"(slot 0 is the zero adapter)")


@dataclasses.dataclass(frozen=True)
class LayerLoRA:
    """One layer's view of the slab in the step, and the rows' slots."""

    slab: Slab  # the whole slab, [L, S, ...] each
    layer: jax.Array  # int32 scalar: the layer whose slices the updates read
    slots: jax.Array  # int32[T]: each token row's slot (0: the base model)
    backend: str  # the attention backend's name (pallas_kernels.dispatch.lora_update)

    def linear(self, x: jax.Array, weight, name: str) -> jax.Array:
        """x [T, in] @ weight (float or quantized, quantization.linear) plus each row's update
        when the slab has projection `name` -> [T, out] in x's dtype."""
        return self.with_update(x, linear(x, weight), name)

    def with_update(self, x: jax.Array, y: jax.Array, name: str) -> jax.Array:
        """y [T, out] (x's projection `name`) plus each row's update when the slab has `name`."""
        return y if name not in self.slab else y + self.update(x, name).astype(y.dtype)

    def update(self, x: jax.Array, name: str) -> jax.Array:
        """Each row's (x @ A[slot]) @ B[slot] at this layer -> [T, out]. On the CPU a step
        without a row on an adapter skips the update and the read of the layer's slices (a
        `lax.cond`, whose predicate a GPU would have to read back to the host: not there)."""
        pair = self.slab[name]

        def dense():  # the layer's a [S, in, R] and b [S, R, out] of the stacked slab
            return dispatch.lora_update(self.backend, x, pair["a"], pair["b"], self.slots, layer=self.layer)

        def skippable():
            zeros = jnp.zeros((x.shape[0], pair["b"].shape[-1]), x.dtype)
            return jax.lax.cond(jnp.any(self.slots > 0), dense, lambda: zeros)

        return jax.lax.platform_dependent(cpu=skippable, default=dense)


def project(x: jax.Array, lp: dict, name: str, lora: LayerLoRA | None) -> jax.Array:
    """x @ lp[name] (quantization.linear), plus the rows' LoRA updates with a slab."""
    return linear(x, lp[name]) if lora is None else lora.linear(x, lp[name], name)


def project_group(x: jax.Array, lp: dict, names: tuple[str, ...], lora: LayerLoRA | None) -> list[jax.Array]:
    """[project(x, lp, name, lora) for name in names], the base projections in one kernel call
    where they can be (quantization.linear_group)."""
    ys = linear_group(x, [lp[name] for name in names])
    return ys if lora is None else [lora.with_update(x, y, name) for y, name in zip(ys, names)]

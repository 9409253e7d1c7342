"""The mixture-of-experts MLP: router, top-k, the routed experts as grouped matmuls, a shared expert.

Mixtral, Qwen3-MoE and Qwen2-MoE (jaxserve.config.ModelConfig's num_experts and the fields after
it; the weights are declared in jaxserve.models.weights). For the normed residual rows h [T, D]:

  probs   = softmax(h @ router)                      [T, E] float32, over all E experts
  weights, experts = top_k(probs, k)                 [T, k] each
  weights /= sum(weights)                            where config.norm_topk_prob (always for Mixtral)
  out[t]  = sum_j weights[t, j] * SwiGLU_{experts[t, j]}(h[t])
          + sigmoid(h[t] @ shared_gate) * SwiGLU_shared(h[t])     (Qwen2-MoE's shared expert)

Ties in top-k: `jax.lax.top_k` returns the lower expert index first among equal probabilities,
so a token whose router scores tie goes to the same experts on every run and every device.

The experts run as grouped matmuls (`jax.lax.ragged_dot`) over the T * k (token, expert) pairs
sorted by expert: the group sizes are a device array [E] that sums to T * k, so every pair is
computed (no token is dropped and no capacity limit is needed) while the step keeps fixed
shapes: T is the bucket's token count, and the sorted rows are always exactly T * k (a padding row is
routed like any other; its output is never read).
`jax.lax.ragged_dot(lhs, rhs, group_sizes)` has the same signature in jax 0.10 and 0.11 (no shim).

Tensor parallelism (a `mesh`, see jaxserve.parallel.sharding): the router and the routing are
replicated; every device runs the routed experts on its slice of their intermediate size F
(gate/up split on their columns, down on its rows) under `jax.shard_map`, and the [T, D] float32
partial sums are added over the "model" axis (`sharding.shard_experts`). Per-device code rather
than XLA's partitioning: on GPU ragged_dot lowers to XLA's ragged-dot (or a Pallas kernel), so
the split is explicit whatever the lowering, and the one all-reduce is of [T, D], not of the
T * k sorted rows. The shared expert is a dense SwiGLU, split like the dense MLP by XLA.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models.quantization import linear
from jaxserve.parallel import sharding
from pallas_kernels import dispatch

_ACTIVATIONS = {"silu": jax.nn.silu}


def route(router_logits: jax.Array, top_k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """router_logits [T, E] -> (weights [T, k] float32, experts [T, k] int32): the top-k of the
    softmax over all E experts (lower index first on ties), renormalised to sum to 1 when asked."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)  # [T, E]
    weights, experts = jax.lax.top_k(probs, top_k)  # [T, k] each, descending; ties: lower index first
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def routed_experts(h: jax.Array, weights: jax.Array, experts: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                   w_down: jax.Array, activation=jax.nn.silu, out_dtype=None) -> jax.Array:
    """sum_j weights[t, j] * SwiGLU_{experts[t, j]}(h[t]) -> [T, D] in `out_dtype` (default h's).

    h [T, D]; weights, experts [T, k]; w_gate, w_up [E, D, F]; w_down [E, F, D]. The T * k pairs
    are sorted by expert (stable: by token within an expert), the experts' matmuls run grouped
    over the sorted rows, and each row's output is scaled by its weight and added back to its token.
    Given a slice of F (w_gate, w_up [E, D, F/n], w_down [E, F/n, D]) it returns that slice's
    partial sum: the result is linear in the down projection's rows.
    """
    T, k = experts.shape
    num_experts = w_gate.shape[0]
    flat_experts = experts.reshape(T * k)  # [T*k]
    order = jnp.argsort(flat_experts, stable=True)  # [T*k]: the pairs sorted by expert
    token_of = order // k  # [T*k]: the token of each sorted pair
    group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)  # [E], sums to T*k
    rows = h[token_of]  # [T*k, D]
    gate = dispatch.grouped_matmul(rows, w_gate, group_sizes)  # [T*k, F]
    up = dispatch.grouped_matmul(rows, w_up, group_sizes)  # [T*k, F]
    out = dispatch.grouped_matmul(activation(gate) * up, w_down, group_sizes)  # [T*k, D]
    scaled = out.astype(jnp.float32) * weights.reshape(T * k)[order][:, None]  # [T*k, D]
    combined = jnp.zeros((T, h.shape[1]), jnp.float32).at[token_of].add(scaled)  # [T, D]
    return combined.astype(out_dtype or h.dtype)


def sparse_mlp(lp: dict, h: jax.Array, config: ModelConfig, mesh: jax.sharding.Mesh | None = None) -> jax.Array:
    """One layer's mixture-of-experts MLP of the normed rows h [T, D] -> [T, D] (no residual);
    with a `mesh`, the routed experts split over its "model" axis (see the module docstring)."""
    activation = _ACTIVATIONS[config.hidden_act]
    with jax.named_scope("moe"):
        router_logits = linear(h, lp["router"])  # [T, E]
        weights, experts = route(router_logits, config.num_experts_per_tok, config.norm_topk_prob)
        experts_fn = functools.partial(routed_experts, activation=activation, out_dtype=jnp.float32)
        if mesh is not None:
            experts_fn = sharding.shard_experts(experts_fn, mesh, config)
        out = experts_fn(h, weights, experts, lp["w_gate_exps"], lp["w_up_exps"],
                         lp["w_down_exps"]).astype(h.dtype)  # [T, D]
        if config.shared_expert_intermediate_size:
            shared = linear(activation(linear(h, lp["w_gate"])) * linear(h, lp["w_up"]), lp["w_down"])  # [T, D]
            gate = jax.nn.sigmoid(linear(h, lp["shared_gate"]).astype(jnp.float32))  # [T, 1]
            out = out + (gate * shared.astype(jnp.float32)).astype(out.dtype)
        return out

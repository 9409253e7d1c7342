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

The experts run as grouped matmuls (`pallas_kernels.dispatch.grouped_matmul`: on the CPU an XLA
loop over (row tile, expert) work items that reads only the routed experts' weights, on a GPU
`jax.lax.ragged_dot` or the Pallas kernel, `$JAXSERVE_GROUPED_MATMUL_BACKEND`) over the T * k (token, expert) pairs
sorted by expert: the group sizes are a device array [E] that sums to T * k, so every pair is
computed (no token is dropped and no capacity limit is needed) while the step keeps fixed
shapes: T is the bucket's token count, and the sorted rows are always exactly T * k (a padding row is
routed like any other; its output is never read).

Quantized experts (int8 / int4 and the published formats, jaxserve.models.quantization: a
QuantArray [E, in, out] per layer): on the CPU each work item multiplies its tile by one
expert's codes through `linear`, so a step still reads only the routed experts, at their stored
size; on a GPU the layer's experts are dequantized to float for ragged_dot or the Pallas kernel.

Tensor parallelism (a `mesh`, see jaxserve.parallel.sharding): the router and the routing are
replicated; every device runs the routed experts on its slice of their intermediate size F
(gate/up split on their columns, down on its rows) under `jax.shard_map`, and the [T, D] float32
partial sums are added over the "model" axis (`sharding.shard_experts`). Per-device code rather
than XLA's partitioning: the grouped matmul is a loop, XLA's ragged-dot or a Pallas kernel, so
the split is explicit whatever the lowering, and the one all-reduce is of [T, D], not of the
T * k sorted rows. The shared expert is a dense SwiGLU, split like the dense MLP by XLA.

Expert parallelism (EngineConfig.enable_expert_parallel, config.expert_parallel): the n devices
of a replica's "model" axis each hold E/n whole experts (full F; device r the experts
[r E/n, (r+1) E/n)), attention keeping its head split. Every device still computes the router
and the top-k of every token (replicated, [T, E] is small), sorts the T * k pairs so that those
routed to its own experts come first (by expert, then token) and the others last, and runs the
grouped matmuls with the E/n local group sizes: the other devices' pairs are in no group (their
rows come out of the grouped matmul as zeros, and are masked besides). The partial sums [T, D] float32
are added over the axis by the same one all-reduce as under tensor parallelism.

Why replicated tokens and one all-reduce rather than an all-to-all dispatch and combine: under
tensor parallelism the residual stream is already replicated on every device of the replica
(attention's output projection ends in an all-reduce), so every device already has every token
and the "all-gather of tokens" costs nothing. An all-to-all would have to send each device the
rows routed to its experts in fixed-size buffers; with no token dropped a buffer must hold all
T * k rows (any routing may send every pair to one device), so each device would send
(n - 1) T k rows of D and receive as many back, in two collectives, against about 2 T rows of D
for the all-reduce, and the shapes would be no smaller. The step keeps the same fixed shapes as
on one device (T * k sorted rows on every device, every pair
computed by the device that holds its expert, no capacity limit). What EP changes is what each
device holds: E/n whole experts rather than a 1/n slice of all E (the same bytes), and the
grouped matmuls' shapes: E/n groups of the full F instead of E groups of F/n. jax's own
ragged_dot lowers, on the CPU and in XLA for GPU, to one dense dot over a [groups, rows, D]
masked copy of the rows (every expert's weights read, whatever the routing), which is why the
CPU default is the work-item loop and the GPU has the Pallas kernel (bench/moe_decode.py,
bench/moe_parallel.py). What each device computes for the rows outside its groups is the
backend's; the result is the same. The cost of EP here: every
device's sorted rows carry the full F ([T * k, F] gate and up), n times TP's (the planner
counts it, jaxserve.planning.memory).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxserve import environment
from jaxserve.config import ModelConfig
from jaxserve.models.quantization import QuantArray, dequantize_in_input_order, linear
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
                   w_down: jax.Array, activation=jax.nn.silu, out_dtype=None, first_expert=0) -> jax.Array:
    """sum_j weights[t, j] * SwiGLU_{experts[t, j]}(h[t]) -> [T, D] in `out_dtype` (default h's),
    over the pairs whose expert is one of those given.

    h [T, D]; weights, experts [T, k] (global expert indices); w_gate, w_up [G, D, F]; w_down
    [G, F, D]: experts first_expert .. first_expert + G - 1 (all E from 0 on one device). The
    T * k pairs are sorted by expert (stable: by token within an expert), the pairs of other experts
    last and in no group, the experts' matmuls run grouped over the sorted rows, and each row's
    output is scaled by its weight (0 for the other experts' pairs) and added back to its token.
    Given a slice of F (w_gate, w_up [E, D, F/n], w_down [E, F/n, D]) it returns that slice's
    partial sum: the result is linear in the down projection's rows; given G = E/n whole experts
    (`first_expert` may be traced: the device's index times G) it returns their partial sum.
    """
    T, k = experts.shape
    num_local = w_gate.shape[0]
    local = experts.reshape(T * k) - first_expert  # [T*k]: index among the given experts
    held = (local >= 0) & (local < num_local)  # [T*k]: pairs this call computes
    key = jnp.where(held, local, num_local)  # [T*k]: the others sort last, into group `num_local`
    order = jnp.argsort(key, stable=True)  # [T*k]: the pairs sorted by expert
    token_of = order // k  # [T*k]: the token of each sorted pair
    group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)  # [G], sums to <= T*k
    rows = h[token_of]  # [T*k, D]
    gate = _grouped(rows, w_gate, group_sizes)  # [T*k, F]
    up = _grouped(rows, w_up, group_sizes)  # [T*k, F]
    out = _grouped(activation(gate) * up, w_down, group_sizes)  # [T*k, D]
    pair_weight = jnp.where(held, weights.reshape(T * k), 0.0)[order]  # [T*k]: 0 past the groups
    scaled = jnp.where(held[order][:, None], out.astype(jnp.float32) * pair_weight[:, None], 0.0)  # [T*k, D]
    combined = jnp.zeros((T, h.shape[1]), jnp.float32).at[token_of].add(scaled)  # [T, D]
    return combined.astype(out_dtype or h.dtype)


def _grouped(rows: jax.Array, experts_weight, group_sizes: jax.Array) -> jax.Array:
    """rows [M, K] sorted by expert @ the experts' matrices [G, K, N], float or quantized (a
    QuantArray [G, K, N]: each expert's slice multiplied at its stored size by `linear` on the CPU,
    its float matrices elsewhere) -> [M, N] in rows' dtype."""
    backend = environment.grouped_matmul_backend()  # read as the step is traced
    if not isinstance(experts_weight, QuantArray):
        return dispatch.grouped_matmul(rows, experts_weight, group_sizes, backend)
    return dispatch.grouped_matmul(rows, experts_weight, group_sizes, backend, product=linear,
                                   dense=lambda w: dequantize_in_input_order(w, rows.dtype))


def sparse_mlp(lp: dict, h: jax.Array, config: ModelConfig, mesh: jax.sharding.Mesh | None = None) -> jax.Array:
    """One layer's mixture-of-experts MLP of the normed rows h [T, D] -> [T, D] (no residual);
    with a `mesh`, the routed experts split over its "model" axis: on their intermediate size, or
    whole experts per device with config.expert_parallel (see the module docstring)."""
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

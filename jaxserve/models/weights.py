"""The one declaration of a model's weights, and everything that derives from it.

`Weights` is an NNX module whose `nnx.Param`s are the model's weights. Each carries its metadata:

  axes   logical axis of every dimension: "layers" (or "moe_layers" / "dense_layers", below), "vocab", "embed" (hidden size), "q" (query
         heads x head_dim), "kv" (KV heads x head_dim), "ffn" (intermediate size), "head_dim";
         mixture-of-experts models: "experts" (routed experts), "expert_ffn" (an expert's
         intermediate size), "router" (the router's experts, or the shared expert's one gate)
  role   "embedding" (embed, lm_head), "linear" (a decoder matrix: the quantizable set), "norm",
         "bias", "experts" (the routed experts' matrices, [L, E, in, out]), "router"
  hf     the Hugging Face tensor name (per-layer weights: the part after "model.layers.{i}."); an
         expert's own tensor has "{expert}" where its index goes (one tensor per expert, as
         transformers' save_pretrained and the published checkpoints write them)
  gguf   the llama.cpp tensor name (per-layer: the part after "blk.{i}."); None: not in GGUF files.
         A routed expert weight is one GGUF tensor of every expert, [E, out, in] (`ffn_*_exps`)
  transposed  stored for `x @ W`, i.e. transposed from the [out, in] of both file formats

Per-layer weights are stacked on a leading "layers" axis (the step scans over it) and sit under
`layers/`. A mixture-of-experts model whose MLP layers are not all sparse (Qwen2/3-MoE's
`mlp_only_layers`, `decoder_sparse_step`) stacks each kind's own MLP weights over only the layers
of that kind: a leading "moe_layers" axis (the router, the experts, Qwen2-MoE's shared expert;
ModelConfig.sparse_layers) or "dense_layers" (the dense SwiGLU `dense_w_gate`, `dense_w_up`,
`dense_w_down`; ModelConfig.mlp_only_layers), so no layer holds the other kind's weights and
no memory goes to padding. `LayerKinds` says how the step reads them (see its docstring). From this one declaration come: the shapes (`param_shapes`), random weights
(`random_params`), the tensor-parallel partition specs (`jaxserve.parallel.sharding` maps logical axes to
mesh axes), the quantizable set (`quantizable_leaves`), the planner's per-device byte counts
(`jaxserve.planning.memory`) and the checkpoint names (`checkpoints/`). The computation is
`jaxserve.models.llama.forward`.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig

Params = dict


@dataclasses.dataclass(frozen=True)
class WeightInfo:
    """One declared weight (see the module docstring for the fields)."""

    path: str  # "embed", "final_norm", "lm_head" or "layers/<name>"
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    role: str
    hf: str
    gguf: str | None
    transposed: bool
    stack_layers: tuple[int, ...] = ()  # per-layer weights: the model layer of each row of the stack, in order

    def row_of(self, layer: int) -> int | None:
        """The row of model layer `layer` in this per-layer weight's stack (None: not held there)."""
        try:
            return self.stack_layers.index(layer)
        except ValueError:
            return None

    @property
    def per_layer(self) -> bool:
        return self.path.startswith("layers/")

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def per_expert(self) -> bool:
        """One source tensor per expert (`hf` has "{expert}"): [L, E, ...] filled expert by expert."""
        return "{expert}" in self.hf


class Weights(nnx.Module):
    """The weights of a Llama-family decoder (Llama, Mistral, Qwen2/3, Gemma 2/3; the
    mixture-of-experts Mixtral, Qwen2-MoE and Qwen3-MoE), declared once."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        L, D, F, V, hd = (config.num_layers, config.hidden_size, config.intermediate_size, config.vocab_size,
                          config.head_dim)
        q, kv = config.q_size, config.kv_size
        # Gemma's norms scale by (1 + weight): their neutral value is 0.
        norm_init = "zeros" if config.norm_weight_offset else "ones"

        def param(shape, axes, role, hf, gguf, init=None, transposed=False):
            init = init or {"norm": norm_init, "bias": "zeros"}.get(role, "normal")
            return nnx.Param(_init(init, shape, transposed, dtype, rngs), axes=axes, role=role, hf=hf, gguf=gguf,
                             transposed=transposed)

        self.embed = param((V, D), ("vocab", "embed"), "embedding", "model.embed_tokens.weight", "token_embd.weight")
        self.final_norm = param((D,), ("embed",), "norm", "model.norm.weight", "output_norm.weight")
        if not config.tie_word_embeddings:
            self.lm_head = param((D, V), ("embed", "vocab"), "embedding", "lm_head.weight", "output.weight",
                                 transposed=True)

        def matrix(shape, axes, hf, gguf):
            return param((L, *shape), ("layers", *axes), "linear", hf, gguf, transposed=True)

        def vector(size, axis, role, hf, gguf):
            return param((L, size), ("layers", axis), role, hf, gguf)

        layers = {
            "attn_norm": vector(D, "embed", "norm", "input_layernorm.weight", "attn_norm.weight"),
            "wq": matrix((D, q), ("embed", "q"), "self_attn.q_proj.weight", "attn_q.weight"),
            "wk": matrix((D, kv), ("embed", "kv"), "self_attn.k_proj.weight", "attn_k.weight"),
            "wv": matrix((D, kv), ("embed", "kv"), "self_attn.v_proj.weight", "attn_v.weight"),
            "wo": matrix((q, D), ("q", "embed"), "self_attn.o_proj.weight", "attn_output.weight"),
        }
        if config.is_moe:
            layers.update(_expert_weights(config, param))
            if config.mlp_only_layers:  # the dense layers of a mixed model, on their own stack
                Ld = len(config.mlp_only_layers)
                dense = lambda shape, axes, hf, gguf: param((Ld, *shape), ("dense_layers", *axes), "linear", hf, gguf,
                                                            transposed=True)
                layers.update(
                    dense_w_gate=dense((D, F), ("embed", "ffn"), "mlp.gate_proj.weight", "ffn_gate.weight"),
                    dense_w_up=dense((D, F), ("embed", "ffn"), "mlp.up_proj.weight", "ffn_up.weight"),
                    dense_w_down=dense((F, D), ("ffn", "embed"), "mlp.down_proj.weight", "ffn_down.weight"))
        else:
            layers.update(
                w_gate=matrix((D, F), ("embed", "ffn"), "mlp.gate_proj.weight", "ffn_gate.weight"),
                w_up=matrix((D, F), ("embed", "ffn"), "mlp.up_proj.weight", "ffn_up.weight"),
                w_down=matrix((F, D), ("ffn", "embed"), "mlp.down_proj.weight", "ffn_down.weight"))
        if config.sandwich_norms:  # Gemma 2/3: a norm before and after both attention and the MLP
            layers.update(
                attn_post_norm=vector(D, "embed", "norm", "post_attention_layernorm.weight", None),
                mlp_norm=vector(D, "embed", "norm", "pre_feedforward_layernorm.weight", None),
                mlp_post_norm=vector(D, "embed", "norm", "post_feedforward_layernorm.weight", None))
        else:
            layers["mlp_norm"] = vector(D, "embed", "norm", "post_attention_layernorm.weight", "ffn_norm.weight")
        if config.attention_bias:  # Qwen2
            layers.update(bq=vector(q, "q", "bias", "self_attn.q_proj.bias", "attn_q.bias"),
                          bk=vector(kv, "kv", "bias", "self_attn.k_proj.bias", "attn_k.bias"),
                          bv=vector(kv, "kv", "bias", "self_attn.v_proj.bias", "attn_v.bias"))
        if config.qk_norm:  # Qwen3, Gemma 3: RMSNorm over each head of q and k
            layers.update(q_norm=vector(hd, "head_dim", "norm", "self_attn.q_norm.weight", "attn_q_norm.weight"),
                          k_norm=vector(hd, "head_dim", "norm", "self_attn.k_norm.weight", "attn_k_norm.weight"))
        self.layers = nnx.Dict(layers)

    def params(self) -> Params:
        """The weights as a plain nested dict of arrays (the checkpoint and step-function format)."""
        return nnx.to_pure_dict(nnx.state(self, nnx.Param))


def _expert_weights(config: ModelConfig, param) -> dict:
    """A mixture-of-experts layer's weights (jaxserve.models.moe): the router [D, E], the routed
    experts' SwiGLU matrices stacked on an "experts" axis, and Qwen2-MoE's shared expert with its
    sigmoid gate [D, 1]. Mixtral names them `block_sparse_moe.{gate, experts.N.w1/w3/w2}`, the
    Qwen families `mlp.{gate, experts.N.gate_proj/up_proj/down_proj}`; llama.cpp `ffn_gate_inp`,
    `ffn_{gate,up,down}_exps` (every expert in one tensor) and the shared expert's `*_shexp`, its
    gate `ffn_gate_inp_shexp`. Stacked on "layers", or on
    "moe_layers" (the sparse layers only) in a model with dense MLP layers too."""
    D, E, F = config.hidden_size, config.num_experts, config.moe_intermediate_size
    L, stack = len(config.sparse_layers), "moe_layers" if config.mlp_only_layers else "layers"
    mixtral = config.architecture == "MixtralForCausalLM"
    prefix = "block_sparse_moe" if mixtral else "mlp"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")

    def expert(shape, axes, name, gguf):
        return param((L, E, *shape), (stack, "experts", *axes), "experts",
                     f"{prefix}.experts.{{expert}}.{name}.weight", gguf, transposed=True)

    out = {
        "router": param((L, D, E), (stack, "embed", "router"), "router", f"{prefix}.gate.weight",
                        "ffn_gate_inp.weight", transposed=True),
        "w_gate_exps": expert((D, F), ("embed", "expert_ffn"), names[0], "ffn_gate_exps.weight"),
        "w_up_exps": expert((D, F), ("embed", "expert_ffn"), names[1], "ffn_up_exps.weight"),
        "w_down_exps": expert((F, D), ("expert_ffn", "embed"), names[2], "ffn_down_exps.weight"),
    }
    if config.shared_expert_intermediate_size:
        S = config.shared_expert_intermediate_size
        shared = lambda shape, axes, role, hf, gguf: param((L, *shape), (stack, *axes), role, hf, gguf,
                                                           transposed=True)
        out.update(
            w_gate=shared((D, S), ("embed", "ffn"), "linear", "mlp.shared_expert.gate_proj.weight",
                          "ffn_gate_shexp.weight"),
            w_up=shared((D, S), ("embed", "ffn"), "linear", "mlp.shared_expert.up_proj.weight", "ffn_up_shexp.weight"),
            w_down=shared((S, D), ("ffn", "embed"), "linear", "mlp.shared_expert.down_proj.weight",
                          "ffn_down_shexp.weight"),
            shared_gate=shared((D, 1), ("embed", "router"), "router", "mlp.shared_expert_gate.weight",
                               "ffn_gate_inp_shexp.weight"))
    return out


def fused_expert_names(config: ModelConfig) -> dict[str, tuple[tuple[str, ...], bool]]:
    """transformers 5's own layout of the experts (what `save_pretrained(save_original_format=False)`
    writes; the default writes one tensor per expert, as declared above), per layer:
    {name: (the weights it holds, split evenly on its second axis in this order, transposed)}.
    `mlp.experts.gate_up_proj` [E, 2F, D] is the gate's rows then the up projection's,
    `mlp.experts.down_proj` [E, D, F]; Mixtral's router is `mlp.gate.weight` there."""
    if not config.is_moe:
        return {}
    names = {"mlp.experts.gate_up_proj": (("layers/w_gate_exps", "layers/w_up_exps"), True),
             "mlp.experts.down_proj": (("layers/w_down_exps",), True)}
    if config.architecture == "MixtralForCausalLM":
        names["mlp.gate.weight"] = (("layers/router",), True)
    return names


def _init(kind: str, shape: tuple[int, ...], transposed: bool, dtype, rngs: nnx.Rngs) -> jax.Array:
    if kind == "ones":
        return jnp.ones(shape, dtype)
    if kind == "zeros":
        return jnp.zeros(shape, dtype)
    fan_in = shape[-2] if transposed else shape[-1]  # matrices [..., in, out]: in; embed [V, D]: D
    return (jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)


def weight_infos(config: ModelConfig) -> dict[str, WeightInfo]:
    """{path: WeightInfo} of every weight of `config`'s model, sorted by path (no arrays are
    built: the module is traced abstractly)."""
    module = nnx.eval_shape(lambda: Weights(config, rngs=nnx.Rngs(0)))
    infos = {}
    for path, variable in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        meta = variable.get_metadata()
        key = "/".join(str(p) for p in path)
        axes = tuple(meta["axes"])
        infos[key] = WeightInfo(path=key, shape=tuple(variable.get_value().shape), axes=axes,
                                role=meta["role"], hf=meta["hf"], gguf=meta["gguf"], transposed=meta["transposed"],
                                stack_layers=stack_layers(config, axes[0]) if key.startswith("layers/") else ())
    return infos


# The leading axes of per-layer weights, by the layers they stack.
LAYER_STACKS = ("layers", "moe_layers", "dense_layers")


def stack_layers(config: ModelConfig, axis: str) -> tuple[int, ...]:
    """The model layers a per-layer stack with leading axis `axis` holds, in row order."""
    if axis == "layers":
        return tuple(range(config.num_layers))
    if axis == "moe_layers":
        return config.sparse_layers
    if axis == "dense_layers":
        return config.mlp_only_layers
    raise ValueError(f"not a layer stack axis: {axis!r}")


@dataclasses.dataclass(frozen=True)
class LayerKinds:
    """How the step reads a model whose layers do not all have the same weights (dense and sparse
    MLP layers mixed): the layer scan slices the weights every layer has ("layers" stacks), and a
    layer of kind k reads its own weights at its row of kind k's stacks, passed to the scan
    whole. `jaxserve.models.cpu_layout.LayerWeights` runs the rest of the layer under a
    `jax.lax.switch` over the kinds (two branches, not one a layer: the step's size stays flat in
    the depth), and a branch sees its kind's weights under the names a uniform model's layer has
    (`reads`): a dense layer's `dense_w_gate` as `w_gate`. So the layer code is the one of dense
    and of all-sparse models (jaxserve.models.llama.mlp_block tells a sparse layer by its
    router), only the branch taken runs (a select would run both MLPs), and every shape is fixed.
    Why not one stack of every layer's MLP weights: a dense layer would hold all E experts'
    worth of zeros, a sparse one a zero dense MLP (Qwen3-MoE's dense MLP is 4-8x an expert)."""

    kinds: tuple[str, ...]  # the kinds' stack axes, e.g. ("dense_layers", "moe_layers")
    kind_of: tuple[int, ...]  # [L] each layer's kind (an index into `kinds`)
    row_of: tuple[int, ...]  # [L] each layer's row in its kind's stacks
    leaves: dict[str, int]  # the stored name of every kind's weight -> its kind
    reads: dict[str, str]  # stored name -> the name the layer code reads it by

    def own_weights(self, kind: int) -> dict[str, str]:
        """{stored name: read name} of kind `kind`'s own weights."""
        return {name: self.reads[name] for name, k in self.leaves.items() if k == kind}


def layer_kinds(config: ModelConfig) -> LayerKinds | None:
    """The kinds of layer of `config`'s model (see LayerKinds); None when every layer's weights
    are on the one "layers" stack (every dense model, and mixture-of-experts models whose layers
    are all sparse)."""
    if not config.mixed_mlp_layers:
        return None
    kinds = ("dense_layers", "moe_layers")
    kind_of, row_of = [], []
    for layer in range(config.num_layers):
        kind = kinds.index("dense_layers" if layer in config.mlp_only_layers else "moe_layers")
        kind_of.append(kind)
        row_of.append(stack_layers(config, kinds[kind]).index(layer))
    leaves, reads = {}, {}
    for info in weight_infos(config).values():
        if info.per_layer and info.axes[0] in kinds:
            leaves[info.name] = kinds.index(info.axes[0])
            reads[info.name] = info.name.removeprefix("dense_")
    return LayerKinds(kinds, tuple(kind_of), tuple(row_of), leaves, reads)


def tree_of(infos: dict[str, WeightInfo], leaf) -> dict:
    """The parameter tree ({"embed": ..., "layers": {...}}) with `leaf(info)` at every weight."""
    tree: dict = {}
    for info in infos.values():
        node = tree.setdefault("layers", {}) if info.per_layer else tree
        node[info.name] = leaf(info)
    return tree


def param_shapes(config: ModelConfig) -> dict:
    """The parameter tree of shapes (tuples)."""
    return tree_of(weight_infos(config), lambda info: info.shape)


def linear_leaves(config: ModelConfig) -> tuple[str, ...]:
    """Names (under layers/) of the decoder matrices, the routed experts' aside."""
    return tuple(info.name for info in weight_infos(config).values() if info.role == "linear")


def quantizable_leaves(config: ModelConfig) -> tuple[str, ...]:
    """Names (under layers/) of the weights that quantization applies to: the decoder matrices
    and a mixture-of-experts model's routed experts ([L, E, in, out], quantized per expert like a
    matrix). Routers, embeddings, norms and biases stay float."""
    return tuple(info.name for info in weight_infos(config).values() if info.role in ("linear", "experts"))


def num_params(config: ModelConfig) -> int:
    return sum(math.prod(info.shape) for info in weight_infos(config).values())


def random_params(config: ModelConfig, dtype=jnp.float32, seed: int = 0) -> Params:
    """Random weights for tests and benchmarks (a random-weight model of any shape)."""
    return Weights(config, dtype=dtype, rngs=nnx.Rngs(seed)).params()

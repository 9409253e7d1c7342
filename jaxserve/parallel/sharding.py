"""Device mesh and partition rules for tensor and data parallelism.

Mesh axes ("data", "model"): `data` indexes model replicas, `model` the devices one replica is
sharded over (tensor parallelism). Each replica runs on its own `(1, tensor_parallel_size)`
sub-mesh (`replica_meshes`), with its own engine, scheduler and KV pool (see data_parallel.py).

Tensor-parallel layout of one replica (L layers, D hidden, F intermediate, V vocabulary), from
the logical axes each weight declares (jaxserve.models.weights; `logical_axis_rules`):
  wq, wk, wv [L, D, heads*hd], w_gate, w_up [L, D, F]   column-sharded (last axis over "model")
  wo [L, Hq*hd, D], w_down [L, F, D]                    row-sharded (middle axis over "model")
  bq, bk, bv [L, heads*hd]                               sharded like their weights
  embed [V, D] on V, lm_head [D, V] on V                 vocabulary-parallel (replicated when V
                                                         does not divide); logits are gathered
  norms (q_norm / k_norm over head_dim too)              replicated
  mixture of experts (E routed experts of intermediate size F'): w_gate_exps, w_up_exps
    [L, E, D, F'] on F', w_down_exps [L, E, F', D] on F' (logical axis "expert_ffn"); the router
    [L, D, E] and Qwen2-MoE's shared-expert gate [L, D, 1] replicated; its shared expert
    w_gate / w_up / w_down like the dense MLP. The routed experts run under `shard_experts`
    (per-device code, one all-reduce of their [T, D] partial sums). Expert parallel
    (EngineConfig.enable_expert_parallel; ModelConfig.expert_parallel on the config the step
    runs): the logical axis "experts" goes over "model" instead of "expert_ffn", so each device
    holds E/TP whole experts [L, E/TP, D, F'] (E must divide; F' need not); the rest as above.
    Data parallelism stays independent replicas: each spreads its experts over its own TP devices.
  quantized linear QuantArray(q, scale[, zero, perm]) (jaxserve.models.quantization): q as its
    float weight; scale and zero [L, groups, out] too, except per-output-channel scales of a
    row-sharded weight (one group: replicated); a row-sharded weight's groups must divide evenly
    over the devices. Quantized routed experts [L, E, in, out] likewise (`quantized_specs`);
    act-order experts only under expert parallelism
  KV cache [L*pages, page_size, kv_heads, hd]            sharded on kv_heads (dim 2)
so every device holds 1/TP of the weights and of the KV pages. When TP exceeds the KV heads,
KV heads are replicated the way vLLM does it: the model runs with TP KV heads, head j holding
the checkpoint's head j // (TP / num_kv_heads), so each device holds the one KV head its query
heads read. Attention itself is per-device code (Pallas kernels or the jnp reference) under
`jax.shard_map`, as are the routed experts; everything else is partitioned by XLA from the
weight shardings.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.models import weights
from jaxserve.models.quantization import QuantArray

DATA_AXIS = "data"
MODEL_AXIS = "model"
AXES = (DATA_AXIS, MODEL_AXIS)

HEADS_SPEC = P(None, MODEL_AXIS, None)  # [tokens, heads, head_dim]
KV_CACHE_SPEC = P(None, None, MODEL_AXIS, None)  # [L * pages, page_size, kv_heads, head_dim]


def tensor_parallel_problem(config: ModelConfig, tensor_parallel_size: int) -> str | None:
    """Why `config` cannot be split over `tensor_parallel_size` devices, or None if it can."""
    tp = tensor_parallel_size
    if tp < 1:
        return f"tensor_parallel_size must be >= 1, got {tp}"
    if config.num_q_heads % tp:
        return f"num_attention_heads ({config.num_q_heads}) is not divisible by it"
    if config.num_kv_heads % tp and tp % config.num_kv_heads:
        return (f"num_key_value_heads ({config.num_kv_heads}) and it must divide one another "
                f"(KV heads are split, or replicated when there are fewer than devices)")
    if config.is_moe:  # the experts' intermediate sizes are split (intermediate_size is not a weight's)
        if config.expert_parallel:  # whole experts per device instead
            if config.num_experts % tp:
                return (f"with --enable_expert_parallel the routed experts ({config.num_experts}) are spread over "
                        f"the devices, and {config.num_experts} is not divisible by it")
        elif config.moe_intermediate_size % tp:
            return (f"the experts' intermediate size (moe_intermediate_size, {config.moe_intermediate_size}) "
                    f"is not divisible by it")
        if config.shared_expert_intermediate_size % tp:
            return (f"shared_expert_intermediate_size ({config.shared_expert_intermediate_size}) "
                    f"is not divisible by it")
        if not config.mixed_mlp_layers:  # only the dense layers of a mixed model have intermediate_size
            return None
    if config.intermediate_size % tp:
        return f"intermediate_size ({config.intermediate_size}) is not divisible by it"
    return None


def expert_parallel_problem(config: ModelConfig, tensor_parallel_size: int) -> str | None:
    """Why --enable_expert_parallel cannot run `config` over `tensor_parallel_size` devices, or None."""
    if not config.is_moe:
        return (f"--enable_expert_parallel needs a mixture-of-experts model; {config.architecture} is dense "
                f"(it has no routed experts to spread over devices)")
    problem = tensor_parallel_problem(dataclasses.replace(config, expert_parallel=True), tensor_parallel_size)
    return None if problem is None else f"cannot use tensor_parallel_size={tensor_parallel_size}: {problem}"


def with_expert_parallel(config: ModelConfig, enabled: bool, tensor_parallel_size: int) -> ModelConfig:
    """`config` with its routed experts spread over the devices when `enabled` (ModelConfig.expert_parallel);
    ValueError naming the problem when that cannot be done (a dense model, experts that do not divide)."""
    if not enabled:
        return config
    problem = expert_parallel_problem(config, tensor_parallel_size)
    if problem is not None:
        raise ValueError(problem)
    return dataclasses.replace(config, expert_parallel=True)


def valid_tensor_parallel_sizes(config: ModelConfig) -> list[int]:
    return [tp for tp in range(1, config.num_q_heads + 1) if tensor_parallel_problem(config, tp) is None]


def check_tensor_parallel(config: ModelConfig, tensor_parallel_size: int) -> None:
    """Raises ValueError with the sizes that would work when the model cannot be split."""
    problem = tensor_parallel_problem(config, tensor_parallel_size)
    if problem is not None:
        sizes = ", ".join(map(str, valid_tensor_parallel_sizes(config)))
        raise ValueError(f"cannot use tensor_parallel_size={tensor_parallel_size} for this model: "
                         f"{problem}; valid sizes: {sizes}")


def sharded_model_config(config: ModelConfig, tensor_parallel_size: int) -> ModelConfig:
    """The config the sharded step runs: KV heads replicated up to TP when TP exceeds them."""
    check_tensor_parallel(config, tensor_parallel_size)
    if tensor_parallel_size <= config.num_kv_heads:
        return config
    return dataclasses.replace(config, num_kv_heads=tensor_parallel_size)


def make_mesh(config: ModelConfig, tensor_parallel_size: int = 1, data_parallel_size: int = 1,
              devices=None, expert_parallel: bool = False) -> Mesh:
    """A (data_parallel_size, tensor_parallel_size) mesh over the first devices; over the devices
    of several processes (jax.distributed), every replica spans every process (see
    `_process_spanning_grid`). `expert_parallel`: the split is checked for whole experts per device.

    Raises ValueError when the model cannot be split that way or there are too few devices."""
    check_tensor_parallel(with_expert_parallel(config, expert_parallel, tensor_parallel_size), tensor_parallel_size)
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
    devices = list(jax.devices() if devices is None else devices)
    needed = tensor_parallel_size * data_parallel_size
    if needed > len(devices):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} x data_parallel_size="
                         f"{data_parallel_size} needs {needed} devices, but only {len(devices)} "
                         f"{devices[0].platform} device(s) are visible" + (
                             "; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N"
                             if devices[0].platform == "cpu" else ""))
    processes = sorted({d.process_index for d in devices})
    if len(processes) > 1:
        return Mesh(_process_spanning_grid(devices, processes, tensor_parallel_size, data_parallel_size), AXES)
    grid = np.array(devices[:needed], dtype=object).reshape(data_parallel_size, tensor_parallel_size)
    return Mesh(grid, AXES)


def check_parallel_sizes(tensor_parallel_size: int, data_parallel_size: int, num_processes: int) -> None:
    """ValueError unless every model replica spans every process: the tensor-parallel size must
    be a multiple of the number of processes (each step runs on every process in lockstep)."""
    if num_processes > 1 and tensor_parallel_size % num_processes:
        raise ValueError(
            f"with {num_processes} processes --tensor_parallel_size must be a multiple of {num_processes} "
            f"(every replica spans every process; got {tensor_parallel_size}). For replicas on separate "
            f"hosts run one server per host behind a load balancer")


def _process_spanning_grid(devices, processes, tp: int, dp: int) -> np.ndarray:
    """Devices of several processes (jax.distributed): every replica (row) takes tp / processes
    devices of each process, so that every process runs every step (jaxserve.parallel.multihost's
    lockstep); within a process, consecutive local devices."""
    check_parallel_sizes(tp, dp, len(processes))
    per_process = tp // len(processes)
    local = {p: sorted((d for d in devices if d.process_index == p), key=lambda d: d.id) for p in processes}
    short = [p for p in processes if len(local[p]) < dp * per_process]
    if short:
        raise ValueError(f"tensor_parallel_size={tp} x data_parallel_size={dp} over {len(processes)} processes "
                         f"needs {dp * per_process} devices in each, but process {short[0]} has {len(local[short[0]])}")
    rows = [[d for p in processes for d in local[p][r * per_process:(r + 1) * per_process]] for r in range(dp)]
    return np.array(rows, dtype=object)


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One (1, tensor_parallel_size) mesh per data-parallel replica (row of `mesh`)."""
    return [Mesh(mesh.devices[i:i + 1], AXES) for i in range(mesh.shape[DATA_AXIS])]


def logical_axis_rules(config: ModelConfig, tensor_parallel_size: int) -> dict[str, str | None]:
    """Mesh axis of each logical weight axis (jaxserve.models.weights): heads, KV heads, the
    intermediate size and each routed expert's over "model"; the vocabulary too when it divides;
    the rest (experts and router axes included) replicated. With config.expert_parallel the routed
    experts' "experts" axis goes over "model" instead of their "expert_ffn" (whole experts per device)."""
    vocab = MODEL_AXIS if config.vocab_size % tensor_parallel_size == 0 else None
    experts, expert_ffn = (MODEL_AXIS, None) if config.expert_parallel else (None, MODEL_AXIS)
    return {"q": MODEL_AXIS, "kv": MODEL_AXIS, "ffn": MODEL_AXIS, "experts": experts, "expert_ffn": expert_ffn,
            "vocab": vocab}


def param_partition_specs(config: ModelConfig, tensor_parallel_size: int) -> dict:
    """PartitionSpec of every weight (the parameter tree), from the weights' logical axes."""
    rules = logical_axis_rules(config, tensor_parallel_size)
    return weights.tree_of(weights.weight_infos(config), lambda info: P(*(rules.get(a) for a in info.axes)))


def _holds_kv_heads(info: weights.WeightInfo) -> bool:
    """A projection to KV heads (or its bias): repeated when KV heads are replicated."""
    return "kv" in info.axes


@dataclasses.dataclass(frozen=True)
class ModelShardings:
    """Where one replica's weights, KV cache and step inputs live on its mesh."""
    mesh: Mesh
    source_config: ModelConfig  # the checkpoint's config
    model_config: ModelConfig  # the config the step runs (KV heads possibly replicated)
    params: dict  # NamedSharding per weight, for the weights of `model_config`
    kv_cache: NamedSharding  # each of the K and V caches
    replicated: NamedSharding

    @classmethod
    def create(cls, config: ModelConfig, mesh: Mesh, expert_parallel: bool = False) -> "ModelShardings":
        """The layout of `config` on `mesh`; `expert_parallel` (EngineConfig.enable_expert_parallel):
        whole routed experts per device. ValueError when the model cannot be split that way."""
        tp = mesh.shape[MODEL_AXIS]
        run_config = sharded_model_config(with_expert_parallel(config, expert_parallel, tp), tp)
        named = lambda spec: NamedSharding(mesh, spec)
        params = jax.tree.map(named, param_partition_specs(run_config, tp),
                              is_leaf=lambda x: isinstance(x, P))
        return cls(mesh, config, run_config, params, named(KV_CACHE_SPEC), named(P()))

    @property
    def tensor_parallel_size(self) -> int:
        return self.mesh.shape[MODEL_AXIS]

    @property
    def expert_parallel(self) -> bool:
        return self.model_config.expert_parallel

    @property
    def kv_head_replicas(self) -> int:
        """Copies of each checkpoint KV head in the running model (1: no replication)."""
        return self.model_config.num_kv_heads // self.source_config.num_kv_heads

    def checkpoint_shardings(self) -> dict:
        """Shardings to restore the checkpoint into (its shapes): the running layout, except
        that KV projections to be replicated are restored whole, then expanded by `place`."""
        shardings = jax.tree.map(lambda s: s, self.params)
        if self.kv_head_replicas > 1:
            for name in self._kv_leaves():
                shardings["layers"][name] = self.replicated
        return shardings

    def _kv_leaves(self) -> set[str]:
        return {info.name for info in weights.weight_infos(self.source_config).values()
                if info.per_layer and _holds_kv_heads(info)}

    def _expands(self, name: str, weight) -> bool:
        """Whether `place` repeats this checkpoint KV projection's heads (KV heads replicated)."""
        return (self.kv_head_replicas > 1 and name in self._kv_leaves()
                and weight.shape[-1] == self.source_config.kv_size)

    def per_device_bytes(self, params: dict) -> int:
        """Bytes one device holds of `params` (float or quantized leaves) once `place`d, KV
        projections expanded when KV heads are replicated."""
        def leaf_bytes(array, sharding, replicas=1):
            shape = (*array.shape[:-1], array.shape[-1] * replicas)
            return math.prod(sharding.shard_shape(shape)) * jnp.dtype(array.dtype).itemsize

        targets = quantized_checkpoint_shardings(self.params, params)
        total = 0
        for name, weight in params.items():
            if name != "layers":
                total += leaf_bytes(weight, targets[name])
        for name, weight in params["layers"].items():
            replicas = self.kv_head_replicas if self._expands(name, weight) else 1
            total += sum(jax.tree.leaves(jax.tree_util.tree_map_with_path(  # perm: over inputs, not repeated
                lambda path, a, t: leaf_bytes(a, t, 1 if _is_perm(path) else replicas),
                weight, targets["layers"][name])))
        return int(total)

    def place(self, params: dict) -> dict:
        """The weights laid out for the step: moved into their shardings (a no-op for arrays
        already there), KV projections expanded when KV heads are replicated.
        ValueError when a quantized weight's groups cannot be split over the devices."""
        layers = {}
        for name, weight in params["layers"].items():
            target = leaf_shardings(self.params["layers"][name], weight, name)
            if self._expands(name, weight):
                weight = jax.tree_util.tree_map_with_path(
                    lambda path, w, t: w if _is_perm(path) else _repeat_heads(
                        jax.device_put(w, self.replicated), self.kv_head_replicas, self.model_config.head_dim, t),
                    weight, target)
            layers[name] = jax.device_put(weight, target)
        placed = {name: jax.device_put(weight, self.params[name])
                  for name, weight in params.items() if name != "layers"}
        return {**placed, "layers": layers}


def _is_perm(path) -> bool:
    """Whether a tree path ends at the `perm` of a QuantArray (act-order: an input order)."""
    return bool(path) and getattr(path[-1], "name", None) == "perm"


def leaf_shardings(float_sharding: NamedSharding, weight, name: str = "weight"):
    """The sharding of one weight: `float_sharding` itself for a float array; for a QuantArray
    (see jaxserve.models.quantization) a QuantArray with one sharding per stored array
    (`quantized_specs`)."""
    if not isinstance(weight, QuantArray):
        return float_sharding
    mesh = float_sharding.mesh
    specs = quantized_specs(float_sharding.spec, weight, name, mesh.shape[MODEL_AXIS])
    return QuantArray(**{key: NamedSharding(mesh, spec) for key, spec in specs.items()})


def quantized_specs(float_spec: P, weight: QuantArray, name: str, devices: int) -> dict[str, P]:
    """{stored array name: its PartitionSpec} of a QuantArray [..., in, out] whose float weight is
    split as `float_spec` over `devices` devices of the model axis.

    q is split like the float weight. scale / zero [..., groups, out] follow it on the output
    axis; on the input axis (row-parallel weights) they are split with the input when there are
    several groups (which must divide evenly over the devices), and replicated when there is one
    (per output channel: every device applies the same scales to its partial sums). An act-order
    `perm` [..., in] is replicated: the input is gathered in its order before the matmul, which
    a routed expert's per-device code (`shard_experts`) cannot do, so an act-order expert split
    on its input is a ValueError. ValueError too when the groups do not divide."""
    ndim = weight.q.ndim
    spec = tuple(float_spec) + (None,) * (ndim - len(float_spec))
    inputs_split = spec[-2] == MODEL_AXIS
    if weight.perm is not None and inputs_split and name in EXPERT_WEIGHTS:
        raise ValueError(f"{name}: act-order (GPTQ desc_act) expert weights cannot be split on their input "
                         f"over tensor_parallel_size={devices}; serve with --enable_expert_parallel (whole "
                         f"experts per device) or use a checkpoint without act-order")
    specs = {}
    for key, array in weight.stored().items():
        array_spec = spec
        if key == "perm":
            array_spec = (*spec[:-2], None)
        elif key != "q" and inputs_split:
            groups = array.shape[-2]
            if groups == 1:
                array_spec = (*spec[:-2], None, spec[-1])
            elif groups % devices:
                raise ValueError(
                    f"{name}: {groups} quantization groups over its input cannot be split over "
                    f"tensor_parallel_size={devices}; use a group size that gives a multiple of "
                    f"{devices} groups (e.g. a larger or smaller _g32/_g64/_g128) or per-channel int8")
        specs[key] = P(*array_spec)
    return specs


def quantized_checkpoint_shardings(float_shardings: dict, structs: dict) -> dict:
    """Per-array shardings for weights whose linear leaves may be quantized: `structs` is their
    tree of arrays or abstract arrays (quantized leaves as QuantArrays), `float_shardings` the float layout."""
    layers = {name: leaf_shardings(float_shardings["layers"][name], struct, name)
              for name, struct in structs["layers"].items()}
    return {**{k: v for k, v in float_shardings.items() if k != "layers"}, "layers": layers}


def _repeat_heads(weight, replicas: int, head_dim: int, sharding: NamedSharding) -> jax.Array:
    """[..., heads * head_dim] -> [..., heads * replicas * head_dim], each head `replicas` times."""
    def repeat(w):
        *lead, width = w.shape
        heads = w.reshape(*lead, width // head_dim, head_dim)
        return jnp.repeat(heads, replicas, axis=-2).reshape(*lead, width * replicas)
    return jax.jit(repeat, out_shardings=sharding)(weight)


def shard_attention(attend, mesh: Mesh):
    """Runs `attend` per device over the model axis.

    attend(q, k, v, k_cache, v_cache, *page_tables) -> (out, k_cache, v_cache), with q, k, v and
    out [tokens, heads, head_dim] split on heads, the caches split on KV heads, and the page
    tables (block tables, lengths, slot mapping) replicated. The kernels are per-device code,
    so each device sees only its heads."""
    @functools.wraps(attend)
    def wrapped(q, k, v, k_cache, v_cache, *page_tables):
        in_specs = (HEADS_SPEC,) * 3 + (KV_CACHE_SPEC,) * 2 + (P(),) * len(page_tables)
        mapped = jax.shard_map(attend, mesh=mesh, in_specs=in_specs,
                               out_specs=(HEADS_SPEC, KV_CACHE_SPEC, KV_CACHE_SPEC), check_vma=False)
        return mapped(q, k, v, k_cache, v_cache, *page_tables)
    return wrapped


EXPERT_WEIGHTS = ("w_gate_exps", "w_up_exps", "w_down_exps")


def shard_experts(routed, mesh: Mesh, config: ModelConfig):
    """Runs `routed` per device over the model axis, its partial sums added over it.

    routed(h, weights, experts, w_gate, w_up, w_down, first_expert) -> [T, D] float32, with h
    [T, D] and the routing weights, experts [T, k] replicated, and one layer's expert weights
    (w_gate, w_up [E, D, F'], w_down [E, F', D]) split as their declaration says
    (`param_partition_specs`, less the layers axis); `first_expert` is the global index of the
    device's first expert. Tensor parallel (on F'): each device computes its slice of F' for every
    (token, expert) pair, first_expert 0. Expert parallel (config.expert_parallel, on E): each
    device holds E/n whole experts from first_expert = device index * E/n and computes only the
    pairs routed to them. Either way the device's result is a partial sum of the output,
    all-reduced once ([T, D] float32)."""
    tp = mesh.shape[MODEL_AXIS]
    float_specs = {name: P(*param_partition_specs(config, tp)["layers"][name][1:]) for name in EXPERT_WEIGHTS}
    local_experts = config.num_experts // tp if config.expert_parallel else config.num_experts

    def per_device(h, weights, experts, w_gate, w_up, w_down):
        first_expert = jax.lax.axis_index(MODEL_AXIS) * local_experts if config.expert_parallel else 0
        partial = routed(h, weights, experts, w_gate, w_up, w_down, first_expert=first_expert)  # [T, D]
        return jax.lax.psum(partial, MODEL_AXIS)

    @functools.wraps(routed)
    def sharded(h, weights, experts, *expert_weights):
        weight_specs = tuple(QuantArray(**quantized_specs(float_specs[name], w, name, tp))
                             if isinstance(w, QuantArray) else float_specs[name]
                             for name, w in zip(EXPERT_WEIGHTS, expert_weights))
        return jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P(), *weight_specs), out_specs=P(),
                             check_vma=False)(h, weights, experts, *expert_weights)
    return sharded


def per_device_bytes(array: jax.Array) -> int:
    """Bytes of `array` held by its largest addressable shard."""
    return max(math.prod(s.data.shape) for s in array.addressable_shards) * array.dtype.itemsize

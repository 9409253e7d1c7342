"""Memory planner: how many KV pages fit next to the weights, the activations and the runtime.

`plan_engine` is the one sizing of an engine: `jaxserve plan` prints it and the engine allocates
its `num_pages` for the same EngineConfig. Pure host code (no jax at import time; the
quantization formats and the tensor-parallel split rules are jaxserve.models.quantization's and
jaxserve.parallel.sharding's, imported when used). Every byte count is per device: with tensor parallelism
the attention heads, the MLP columns and the vocabulary are split over `tensor_parallel_size`
devices, norms are replicated, and KV heads are split (or replicated when there are fewer KV
heads than devices). A mixture-of-experts model's routed experts are split on their
intermediate size, or, with EngineConfig.enable_expert_parallel, held whole, E / tensor_parallel_size
experts per device (`parallel_model`; the step's sorted rows then carry the full intermediate size).

    usable      = device_memory_bytes * memory_utilization
    kv_budget   = usable - weights_bytes - activation_bytes - runtime_reserve_bytes
    num_pages   = kv_budget // kv_bytes_per_page          (page 0, the null page, included)
    max_concurrent_seqs = (num_pages - 1) // ceil(max_model_len / page_size)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxserve import environment
from jaxserve.config import KERNEL_BACKENDS, EngineConfig, ModelConfig
from jaxserve.planning.budgets import device_memory_budget_bytes, host_memory_budget_bytes  # noqa: F401 (their home before)
from jaxserve.planning.vision_memory import vision_memory

MiB = 1 << 20
GiB = 1 << 30

FLOAT_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_DTYPE_BYTES = {**FLOAT_DTYPE_BYTES, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}
# int8 KV pages carry one float32 scale per token and KV head (pallas_kernels.kv_quant).
KV_SCALE_BYTES = {"int8": 4}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
                 "fp8": "float8_e4m3fn"}

# Softmax of the reference attention keeps two float32 arrays of the score shape alive at once:
# the scores (output of the QK^T einsum) and the exponentiated weights fed to the PV einsum.
ATTENTION_SCORE_COPIES = 2
# Logits [max_num_seqs, vocab] in float32, plus one same-sized working copy in the sampler
# (log-softmax / sort for top-k and top-p).
LOGITS_COPIES = 2
# The GPU build (Pallas kernels), calibrated on XLA's memory analysis of the steps compiled for an
# H100 (jax 0.10.2; bench/RESULTS.md, "GPU build compiled on the CPU machine"): the sampler's
# temporaries are 3.3 float32 copies of its logits, and the layer scan keeps one layer's slice of
# the stacked linear weights in temporaries next to the activations.
GPU_LOGITS_COPIES = 1 + 3.5


class MemoryPlanError(ValueError):
    """The requested configuration does not fit in the memory budget (or makes no sense)."""


# Weight dtypes: a float dtype, or a jaxserve.models.quantization format name (int8, int4, int4_g64,
# int8_g32_zp, ...; see quantization.parse_format), which stores the decoder's linear layers
# quantized and the rest (embeddings, lm_head, norms, biases) in QUANTIZED_COMPUTE_DTYPE.
WEIGHT_DTYPES = tuple(FLOAT_DTYPE_BYTES) + ("int8", "int4")
QUANTIZED_COMPUTE_DTYPE = "bfloat16"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device memory plan; every *_bytes field is in bytes on one device."""
    device_memory_bytes: int
    memory_utilization: float
    usable_bytes: int
    weight_dtype: str  # a float dtype, or the quantization format of the linear layers
    compute_dtype: str  # activations and the weights that are not quantized
    kv_cache_dtype: str
    tensor_parallel_size: int
    page_size: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    num_params: int  # whole model, all devices
    weights_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_page: int
    activation_bytes: int
    runtime_reserve_bytes: int
    kv_cache_bytes: int  # num_pages * kv_bytes_per_page
    num_pages: int  # null page included
    pages_per_seq: int
    max_concurrent_seqs: int  # sequences of max_model_len tokens that fit at once
    # Speculative decoding with a draft model (on the first device, unsharded): its weights and
    # its K/V of every page (same page ids as the target's, plus its scratch pages).
    draft_weights_bytes: int = 0
    draft_kv_bytes_per_page: int = 0
    draft_kv_cache_bytes: int = 0  # (num_pages + its scratch pages) * draft_kv_bytes_per_page
    lora_slab_bytes: int = 0  # --enable_lora: the adapters' device slab (lora_slab_bytes)
    # A vision-language model (jaxserve.planning.vision_memory): its tower's weights, the image-embedding
    # pool of the encoder cache, and the activations of the encoder's largest call.
    vision_weights_bytes: int = 0
    image_pool_bytes: int = 0
    vision_activation_bytes: int = 0
    # KV offload (--kv_offloading_size): host memory (and disk) outside this budget, in pages of
    # the whole model (every device's share of a page: what one host block holds).
    kv_offload_host_bytes: int = 0
    kv_offload_host_pages: int = 0
    kv_offload_disk_bytes: int = 0
    kv_offload_disk_pages: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def normalize_dtype(name: str, allowed) -> str:
    """The canonical name of `name` among `allowed`; with `allowed=WEIGHT_DTYPES` every
    quantization format (quant_format) is allowed too. MemoryPlanError for anything else."""
    canonical = DTYPE_ALIASES.get(name.lower(), name.lower())
    if canonical in allowed:
        return canonical
    if allowed is WEIGHT_DTYPES:  # a format's own name ("fp8": float8 weights, not the KV dtype's alias)
        return quant_format(name.lower()).name
    raise MemoryPlanError(f"unknown dtype {name!r}; expected one of {', '.join(allowed)}")


def quant_format(weight_dtype: str):
    """The `jaxserve.models.quantization.QuantFormat` a weight dtype names, or None for a float dtype.
    MemoryPlanError for a name that is neither."""
    if weight_dtype in FLOAT_DTYPE_BYTES:
        return None
    from jaxserve.models.quantization import parse_format  # imports jax: only when quantized weights are planned
    try:
        return parse_format(weight_dtype)
    except ValueError as e:
        raise MemoryPlanError(f"unknown weight dtype {weight_dtype!r}: expected one of "
                              f"{', '.join(FLOAT_DTYPE_BYTES)} or a quantization format ({e})") from None


def _compute_dtype(weight_dtype: str) -> str:
    return QUANTIZED_COMPUTE_DTYPE if quant_format(weight_dtype) else weight_dtype


def resolve_kv_cache_dtype(kv_cache_dtype: str, weight_dtype: str) -> str:
    """'auto' follows the compute dtype of the weights (bfloat16 for quantized weights)."""
    if kv_cache_dtype.lower() == "auto":
        return _compute_dtype(normalize_dtype(weight_dtype, WEIGHT_DTYPES))
    return normalize_dtype(kv_cache_dtype, tuple(KV_DTYPE_BYTES))


def kv_heads_per_device(model: ModelConfig, tensor_parallel_size: int) -> int:
    """KV heads on each of `tensor_parallel_size` devices (replicated when fewer than devices).
    MemoryPlanError when the model cannot be split that way (jaxserve.parallel.sharding's rules)."""
    from jaxserve.parallel import sharding  # imports jax: the split rules live with the partition rules
    try:
        sharding.check_tensor_parallel(model, tensor_parallel_size)
    except ValueError as e:
        raise MemoryPlanError(str(e)) from None
    return max(1, model.num_kv_heads // tensor_parallel_size)


def parallel_model(model: ModelConfig, cfg: EngineConfig) -> ModelConfig:
    """`model` as the engine of `cfg` lays it out: with cfg.enable_expert_parallel, its
    ModelConfig.expert_parallel set (whole experts per device), which every count below follows.
    MemoryPlanError for a dense model or experts that do not divide over the devices."""
    from jaxserve.parallel import sharding  # imports jax: the split rules live with the partition rules
    try:
        return sharding.with_expert_parallel(model, cfg.enable_expert_parallel, cfg.tensor_parallel_size)
    except ValueError as e:
        raise MemoryPlanError(str(e)) from None


def _device_weights(model: ModelConfig, tp: int) -> list[tuple[str, tuple[int, ...]]]:
    """(role, shape on one device) of every weight, from the model's one declaration
    (jaxserve.models.weights) and the partition rules: with KV heads replicated up to `tp`, every
    axis the rules split is divided over the devices."""
    kv_heads_per_device(model, tp)  # MemoryPlanError when the model cannot be split this way
    from jaxserve.models import weights
    from jaxserve.parallel import sharding  # imports jax, as the declaration does
    run = sharding.sharded_model_config(model, tp)
    rules = sharding.logical_axis_rules(run, tp)
    return [(info.role, tuple(math.ceil(n / tp) if rules.get(axis) else n for n, axis in zip(info.shape, info.axes)))
            for info in weights.weight_infos(run).values()]


def _linear_shapes(model: ModelConfig, tp: int) -> list[tuple[int, int]]:
    """(in_features, out_features) on one device of every linear layer in one decoder layer (a
    model with dense and sparse MLP layers: of one layer of each kind, an upper bound of either)."""
    return [shape[1:] for role, shape in _device_weights(model, tp) if role == "linear"]


def _linear_stacks(model: ModelConfig, tp: int) -> list[tuple[int, int, int]]:
    """(layers, in_features, out_features) on one device of every stacked linear weight: a mixed
    model's dense MLP (and its sparse layers' shared expert) stack only the layers of their kind."""
    return [shape for role, shape in _device_weights(model, tp) if role == "linear"]


def _linear_bytes(in_features: int, out_features: int, weight_dtype: str) -> int:
    fmt = quant_format(weight_dtype)
    if fmt is None:
        return in_features * out_features * FLOAT_DTYPE_BYTES[weight_dtype]
    from jaxserve.models.quantization import quantized_dtypes  # imports jax: float plans start without it
    group = fmt.group_size or in_features
    packed = math.ceil(in_features * out_features * fmt.bits / 8)
    per_group = sum(dtype.itemsize for key, dtype in quantized_dtypes(fmt).items() if key != "q")  # scale, zero
    return packed + math.ceil(in_features / group) * out_features * per_group


def count_params(model: ModelConfig, tensor_parallel_size: int = 1) -> dict[str, int]:
    """Parameters held by one device, by kind: linear (decoder matrices), embeddings (embed and
    lm_head), norms and biases; a mixture-of-experts model's experts (every routed expert's
    matrices: a 1/tp slice of each, or E/tp whole experts with model.expert_parallel) and routers too."""
    kinds = {"linear": "linear", "embedding": "embeddings", "norm": "norms", "bias": "biases",
             "experts": "experts", "router": "routers"}
    counts = dict.fromkeys(kinds.values(), 0)
    for role, shape in _device_weights(model, tensor_parallel_size):
        counts[kinds[role]] += math.prod(shape)
    return counts


def weights_bytes(model: ModelConfig, weight_dtype: str = "bfloat16", tensor_parallel_size: int = 1,
                  int8_embedding: bool = False) -> int:
    """Bytes of the parameters on one device, quantization scales included.

    Quantized formats store only the decoder's linear layers and a mixture-of-experts model's
    routed experts (every expert on the device, each a matrix of its own) in int8/int4 (plus their
    scales and zero points: int8 per output channel, int4 in groups of 32 with a zero point, as the
    engine); embeddings, lm_head, norms, biases and routers stay in the compute dtype (bfloat16). `int8_embedding`
    (EngineConfig.quantize_embedding, one device): the embedding in int8 with a float32 scale per
    vocabulary row, an untied lm_head in int8 with a float16 scale per output.
    """
    weight_dtype = normalize_dtype(weight_dtype, WEIGHT_DTYPES)
    tp = tensor_parallel_size
    counts = count_params(model, tp)
    linear = sum(layers * _linear_bytes(i, o, weight_dtype) for layers, i, o in _linear_stacks(model, tp))
    linear += sum(math.prod(shape[:2]) * _linear_bytes(*shape[2:], weight_dtype)  # [L, E, in, out]
                  for role, shape in _device_weights(model, tp) if role == "experts")
    float_bytes = FLOAT_DTYPE_BYTES[_compute_dtype(weight_dtype)]
    rest = (counts["norms"] + counts["biases"] + counts["routers"]) * float_bytes
    if not int8_embedding:
        return linear + rest + counts["embeddings"] * float_bytes
    heads = 1 if model.tie_word_embeddings else 2
    return linear + rest + counts["embeddings"] + model.vocab_size * (4 + 2 * (heads - 1))


def kv_bytes_per_token(model: ModelConfig, kv_cache_dtype: str = "bfloat16",
                       tensor_parallel_size: int = 1) -> int:
    """K and V of one token over all layers on one device: 2 x layers x kv_heads x head_dim x bytes
    (plus the per-token, per-head scale of int8 pages)."""
    kv_dtype = normalize_dtype(kv_cache_dtype, tuple(KV_DTYPE_BYTES))
    kv_heads = kv_heads_per_device(model, tensor_parallel_size)
    per_head = model.head_dim * KV_DTYPE_BYTES[kv_dtype] + KV_SCALE_BYTES.get(kv_dtype, 0)
    return 2 * model.num_layers * kv_heads * per_head


def activation_bytes(
    model: ModelConfig,
    *,
    compute_dtype: str = "bfloat16",
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_context_len: int,
    tensor_parallel_size: int = 1,
    max_prefill_seqs: int = 1,
    backend: str = "reference",
    weight_dtype: str | None = None,
    kv_dtype: str = "auto",
    pooling: bool = False,
) -> int:
    """Peak live activations of the largest step bucket on one device.

    The layers run under a scan, so only one layer's intermediates are alive at a time; the
    attention, MLP and logits phases do not overlap. With T tokens per step, S sequences,
    C = max_context_len (block-table width x page size), P prefill sequences, a = compute-dtype
    bytes and per-device hq, hkv, f (heads, KV heads, intermediate size):

        residual  = 2 T d a                              residual stream + normed copy
        attention = T (hq + 2 hkv) hd a                  q, k, v
                  + 2 * P hq T C * 4                     reference scores and softmax weights (f32)
                  + 2 P C hkv hd * 4                     K and V gathered from the pages (f32)
                  + 2 P T hq hd * 4                      padded queries and their output (f32)
        mlp       = 3 T f a                              gate, up and silu(gate) * up
                    (mixture of experts, k experts per token, f an expert's intermediate size per device:
                    T k d a + 3 T k f a + T k d * 4 + T d * 4, the rows sorted by expert, their
                    gate, up and product, their weighted outputs and the combined rows in
                    float32; plus a shared expert's 3 T f_shared a)
        logits    = 2 S vocab * 4                        logits + the sampler's working copy
        peak      = residual + max(attention, mlp, logits)

    The prefill part of a step goes through the reference ragged attention, which pads the
    queries per prefill sequence: its scores are [P, hq, T, C]. The decode part goes through
    the paged-decode kernel, whose working set is small next to these terms.

    With `backend="pallas"` (the GPU build) both attention parts are kernels that keep their
    blocks on chip: attention = T (2 hq + 2 hkv) hd a (q, k, v and the output); the scan's slice
    of one layer's linear weights (in `weight_dtype`) adds to the step; T is the largest bucket,
    max_num_seqs decode rows + max_num_batched_tokens prefill tokens; and the sampler phase is
    GPU_LOGITS_COPIES float32 copies of the logits:

        peak      = max(layer weights + residual + max(attention, mlp), logits)

    `backend="mosaic"` is the same build with the Mosaic GPU kernels, which over int8 pages
    (`kv_dtype`) also gather each sequence's K and V scales into one float32 array per call
    (pallas_kernels.mosaic_common.sequence_scales): attention += (S + P) hkv 2 C * 4.

    The pooling runner (`pooling`, --runner=pooling) has no decode rows and no logits: S is 0 in
    every term and the logits phase is gone (its pooled rows, P x d, are noise next to the rest).
    """
    tp = tensor_parallel_size
    max_num_seqs = 0 if pooling else max_num_seqs  # (the pooling runner: prefill chunks only)
    a = FLOAT_DTYPE_BYTES[normalize_dtype(compute_dtype, tuple(FLOAT_DTYPE_BYTES))]
    tokens, seqs, context = max_num_batched_tokens, max_num_seqs, max_context_len
    hd = model.head_dim
    hq = model.num_q_heads // tp
    hkv = kv_heads_per_device(model, tp)
    p = max_prefill_seqs
    if backend in KERNEL_BACKENDS:
        tokens = max_num_seqs + max_num_batched_tokens
        stored = normalize_dtype(weight_dtype or compute_dtype, WEIGHT_DTYPES)
        layer_weights = (sum(_linear_bytes(i, o, stored) for i, o in _linear_shapes(model, tp))
                         + _expert_layer_bytes(model, tp, stored))
        attention = tokens * (2 * hq + 2 * hkv) * hd * a
        if backend == "mosaic" and KV_SCALE_BYTES.get(kv_dtype):
            attention += (seqs + p) * hkv * 2 * context * KV_SCALE_BYTES[kv_dtype]
        step = (layer_weights + 2 * tokens * model.hidden_size * a
                + max(attention, _mlp_bytes(model, tokens, tp, a, gpu=True)))
        return int(max(step, 0 if pooling else GPU_LOGITS_COPIES * (seqs + p) * model.vocab_size * 4))
    residual = 2 * tokens * model.hidden_size * a
    attention = (tokens * (hq + 2 * hkv) * hd * a
                 + ATTENTION_SCORE_COPIES * p * hq * tokens * context * 4
                 + 2 * p * context * hkv * hd * 4
                 + 2 * p * tokens * hq * hd * 4)
    mlp = _mlp_bytes(model, tokens, tp, a)
    logits = LOGITS_COPIES * seqs * model.vocab_size * 4
    return residual + max(attention, mlp, logits)


def _mlp_bytes(model: ModelConfig, tokens: int, tp: int, a: int, gpu: bool = False) -> int:
    """The MLP's live activations of a step of `tokens` tokens (see activation_bytes). On a GPU
    whose grouped matmul is XLA's ragged-dot (the default, $JAXSERVE_GROUPED_MATMUL_BACKEND unset,
    xla or ragged_dot), each of the experts' matmuls also holds a masked copy of its rows per local
    expert, [E_local, T k, max(d, f)] (seen in its deviceless compile, bench/RESULTS.md); the
    Pallas kernel holds none."""
    if not model.is_moe:
        return 3 * tokens * math.ceil(model.intermediate_size / tp) * a
    rows, d = tokens * model.num_experts_per_tok, model.hidden_size  # the sorted rows: on every device
    # Expert parallel: every device's rows carry the whole F (its own pairs in groups, the others' zeros).
    f = model.moe_intermediate_size if model.expert_parallel else math.ceil(model.moe_intermediate_size / tp)
    routed = rows * d * a + 3 * rows * f * a + rows * d * 4 + tokens * d * 4
    if gpu and (environment.grouped_matmul_backend() or "xla").lower() in ("xla", "ragged_dot"):
        local_experts = model.num_experts // tp if model.expert_parallel else model.num_experts
        routed += local_experts * rows * max(d, f) * a
    sparse = routed + 3 * tokens * math.ceil(model.shared_expert_intermediate_size / tp) * a
    if model.mixed_mlp_layers:  # its dense layers' MLP runs in its own layers' step
        return max(sparse, 3 * tokens * math.ceil(model.intermediate_size / tp) * a)
    return sparse


def _expert_layer_bytes(model: ModelConfig, tp: int, stored: str) -> int:
    """Bytes of one layer's experts and routers on one device as the GPU step reads them (0 for a
    dense model): the experts stored in `stored` (a float dtype or a quantization format) and,
    quantized, the float copy of one matmul's experts [E_local, in, out] that the GPU's grouped
    matmul multiplies (jaxserve.models.moe); routers in the compute dtype."""
    a = FLOAT_DTYPE_BYTES[_compute_dtype(stored)]
    experts = [shape[1:] for role, shape in _device_weights(model, tp) if role == "experts"]  # [E, in, out] each
    routers = sum(math.prod(shape[1:]) for role, shape in _device_weights(model, tp) if role == "router")
    held = sum(e * _linear_bytes(i, o, stored) for e, i, o in experts)
    dequantized = max((math.prod(shape) for shape in experts), default=0) * a if quant_format(stored) else 0
    return held + dequantized + routers * a


def _require_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise MemoryPlanError(f"{name} must be positive, got {value}")


def format_bytes(num_bytes: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes} B"


def estimated_backend(cfg: EngineConfig) -> str:
    """activation_bytes' backend for an engine: its GPU kernels' family (pallas, mosaic), else the
    reference attention's."""
    return cfg.attention_backend if cfg.attention_backend in KERNEL_BACKENDS else "reference"


def _checked_dtypes(model: ModelConfig, cfg: EngineConfig, device_memory_bytes: int,
                    runtime_reserve_fraction: float, activations_dtype: str | None) -> tuple[str, str, str]:
    """plan_memory's input checks (MemoryPlanError on nonsense); the (weight, compute, KV cache)
    dtypes it plans with (compute: `activations_dtype` when given, else cfg.dtype)."""
    if cfg.dtype is None:
        raise MemoryPlanError("plan_memory needs the config's dtype (EngineConfig.for_platform fills it in)")
    _require_positive(device_memory_bytes=device_memory_bytes, page_size=cfg.page_size,
                      max_model_len=cfg.model_len(model), max_num_batched_tokens=cfg.max_num_batched_tokens,
                      max_num_seqs=cfg.max_num_seqs, max_prefill_seqs=cfg.max_num_prefill_seqs)
    if not 0 <= runtime_reserve_fraction < 1:
        raise MemoryPlanError(f"runtime_reserve_fraction must be in [0, 1), got {runtime_reserve_fraction}")
    weight_dtype = normalize_dtype(cfg.quantization or cfg.dtype, WEIGHT_DTYPES)
    compute_dtype = normalize_dtype(activations_dtype or cfg.dtype, tuple(FLOAT_DTYPE_BYTES))
    kv_dtype = (compute_dtype if cfg.kv_cache_dtype.lower() == "auto"
                else normalize_dtype(cfg.kv_cache_dtype, tuple(KV_DTYPE_BYTES)))
    kv_heads_per_device(model, cfg.tensor_parallel_size)  # validates the head split
    return weight_dtype, compute_dtype, kv_dtype


def plan_memory(
    model: ModelConfig, cfg: EngineConfig, *,
    device_memory_bytes: int,
    measured_weights_bytes: int | None = None,
    max_num_pages: int | None = None,
    draft_model: ModelConfig | None = None,
    draft_scratch_pages: int = 0,
    runtime_reserve_fraction: float = 0.05,
    min_runtime_reserve_bytes: int = 256 * MiB,
    activations_dtype: str | None = None,
) -> MemoryPlan:
    """Sizes the KV page pool of one device for `cfg`, whose dtype must be set (for_platform
    fills it in): the activations and, with kv_cache_dtype "auto", the KV cache in cfg.dtype;
    the linear layers in cfg.quantization when it names a format; the Pallas build's activations
    when cfg.attention_backend is a GPU kernel one (pallas, mosaic), else the reference attention's; the context
    cfg.model_len(model). `measured_weights_bytes` (the loaded weights, e.g. quantized ones)
    replaces the estimate. `max_num_pages` caps the pool; cfg.num_pages fixes it (the estimates
    are still reported, the fit checks are skipped). `draft_model`: a speculative-decoding draft
    on this device: its weights (in the compute dtype) and a K/V cache of the same pages plus
    `draft_scratch_pages` come out of the same budget. `activations_dtype`: the activations' (and
    "auto" KV cache's) dtype when not cfg.dtype (a bfloat16 model on the CPU: float32).

    Raises MemoryPlanError (a ValueError) on nonsense input, when the weights alone do not fit,
    or when not even one sequence of max_model_len fits next to them."""
    model = parallel_model(model, cfg)
    weight_dtype, compute_dtype, kv_dtype = _checked_dtypes(model, cfg, device_memory_bytes, runtime_reserve_fraction,
                                                            activations_dtype)
    max_model_len, page_size, num_pages = cfg.model_len(model), cfg.page_size, cfg.num_pages
    memory_utilization, tp = cfg.memory_utilization, cfg.tensor_parallel_size

    usable = int(device_memory_bytes * memory_utilization)
    reserve = max(int(usable * runtime_reserve_fraction), min_runtime_reserve_bytes)
    weights = (weights_bytes(model, weight_dtype, tp, cfg.quantize_embedding) if measured_weights_bytes is None
               else measured_weights_bytes)
    draft_weights = draft_per_page = 0
    if draft_model is not None:
        draft_weights = weights_bytes(draft_model, compute_dtype, 1)
        draft_per_page = kv_bytes_per_token(draft_model, kv_dtype, 1) * page_size
    # What stays whatever the pool's size: the weights, a draft's weights and scratch pages, a LoRA slab.
    lora = lora_slab_bytes(model, cfg) if cfg.enable_lora else 0
    vision = vision_memory(model, cfg, compute_dtype, FLOAT_DTYPE_BYTES[compute_dtype])  # {} for a text model
    resident = weights + draft_weights + draft_scratch_pages * draft_per_page + lora + sum(vision.values())
    if resident > usable - reserve and num_pages is None:
        raise MemoryPlanError(
            f"the weights do not fit: they need {format_bytes(resident)} per device, but only "
            f"{format_bytes(max(usable - reserve, 0))} is available ({format_bytes(device_memory_bytes)}"
            f" x {memory_utilization} minus a {format_bytes(reserve)} runtime reserve); use a smaller "
            f"weight dtype, more tensor-parallel devices or a larger memory budget")

    pages_per_seq = math.ceil(max_model_len / page_size)
    activations = activation_bytes(
        model, compute_dtype=compute_dtype, max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=cfg.max_num_seqs, max_context_len=pages_per_seq * page_size, tensor_parallel_size=tp,
        max_prefill_seqs=cfg.max_num_prefill_seqs, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
        backend=estimated_backend(cfg), pooling=cfg.runner == "pooling")
    per_token = kv_bytes_per_token(model, kv_dtype, tp)
    per_page = per_token * page_size
    kv_budget = usable - resident - activations - reserve
    fits = max(kv_budget, 0) // (per_page + draft_per_page)
    if num_pages is None and fits < 1 + pages_per_seq:
        raise MemoryPlanError(
            f"no room for the KV cache of one sequence of {max_model_len} tokens: it needs "
            f"{format_bytes((1 + pages_per_seq) * (per_page + draft_per_page))}, but after the weights "
            f"({format_bytes(resident)}), the activations ({format_bytes(activations)}) and the runtime "
            f"reserve ({format_bytes(reserve)}) only {format_bytes(max(kv_budget, 0))} is left; lower "
            f"max_model_len, max_num_batched_tokens or max_num_seqs, or give more memory")
    if num_pages is None:
        num_pages = fits if max_num_pages is None else min(fits, max_num_pages)
    return MemoryPlan(
        device_memory_bytes=int(device_memory_bytes), memory_utilization=float(memory_utilization),
        usable_bytes=usable, weight_dtype=weight_dtype, compute_dtype=compute_dtype, kv_cache_dtype=kv_dtype,
        tensor_parallel_size=tp, page_size=page_size, max_model_len=max_model_len,
        max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
        num_params=sum(count_params(model, 1).values()), weights_bytes=weights,
        kv_bytes_per_token=per_token, kv_bytes_per_page=per_page, activation_bytes=activations,
        runtime_reserve_bytes=reserve, kv_cache_bytes=num_pages * per_page, num_pages=num_pages,
        pages_per_seq=pages_per_seq, max_concurrent_seqs=(num_pages - 1) // pages_per_seq,
        draft_weights_bytes=draft_weights, draft_kv_bytes_per_page=draft_per_page,
        draft_kv_cache_bytes=(num_pages + draft_scratch_pages) * draft_per_page, lora_slab_bytes=lora,
        **vision, **kv_offload_tiers(model, cfg, kv_dtype))


def kv_offload_tiers(model: ModelConfig, cfg: EngineConfig, kv_dtype: str) -> dict[str, int]:
    """The KV offload tiers' sizes (MemoryPlan's kv_offload_* fields): --kv_offloading_size and
    --kv_offloading_disk_size in bytes and in whole pages of every layer and device."""
    if cfg.kv_offloading_size is None:
        return {}
    whole_page = kv_bytes_per_token(model, kv_dtype, 1) * cfg.page_size
    host = int(cfg.kv_offloading_size * GiB)
    disk = int(cfg.kv_offloading_disk_size * GiB) if cfg.kv_offloading_disk_path else 0
    return {"kv_offload_host_bytes": host, "kv_offload_host_pages": host // whole_page,
            "kv_offload_disk_bytes": disk, "kv_offload_disk_pages": disk // whole_page}


def lora_slab_bytes(model: ModelConfig, cfg: EngineConfig) -> int:
    """Bytes of the LoRA slab of jaxserve.models.lora on one device: A [L, S, in, R] and B
    [L, S, R, out] of every adaptable projection (a mixture of experts: attention only), S =
    max_loras + 1 slots, R = max_lora_rank, in lora_dtype ("auto": the compute dtype)."""
    D, F, q, kv = model.hidden_size, model.intermediate_size, model.q_size, model.kv_size
    shapes = [(D, q), (D, kv), (D, kv), (q, D)] + ([] if model.is_moe else [(D, F), (D, F), (F, D)])
    dtype = cfg.dtype if cfg.lora_dtype == "auto" else cfg.lora_dtype
    itemsize = FLOAT_DTYPE_BYTES[normalize_dtype(dtype or "float32", FLOAT_DTYPE_BYTES)]
    slots, rank = cfg.max_loras + 1, cfg.max_lora_rank
    return model.num_layers * slots * rank * sum(i + o for i, o in shapes) * itemsize


def plan_engine(model: ModelConfig, cfg: EngineConfig, *, device_memory_bytes: int, on_gpu: bool,
                measured_weights_bytes: int | None = None, draft_model: ModelConfig | None = None) -> MemoryPlan:
    """The one sizing of an engine: the plan `jaxserve plan` reports and the KV pool (`num_pages`)
    and context (`max_model_len`) the engine allocates for the same `cfg` on one device.

    `cfg` is the engine's `EngineConfig`; the platform defaults it leaves open (dtype,
    attention backend) are a GPU's when `on_gpu`, else the CPU's. The weights are quantized
    when `cfg.quantization` names a format; `measured_weights_bytes` (the loaded weights' bytes
    on one device) replaces the estimate. A `cfg.num_pages` is taken as it is. On the CPU the
    pool is capped at what max_num_seqs sequences of max_model_len tokens can use, so that a
    laptop-sized run does not zero gigabytes it will never touch. With speculative_method="draft",
    `draft_model` (the draft's config) is planned on the same device.
    """
    cfg = cfg.for_platform(on_gpu)
    cap = None
    if not on_gpu and cfg.page_size > 0:
        cap = cfg.max_num_seqs * math.ceil(cfg.model_len(model) / cfg.page_size) + 1  # + the null page
    # On one CPU a bfloat16 model's step keeps its activations in float32 (cpu_layout.bfloat16_views).
    cpu_bfloat16 = not on_gpu and cfg.dtype == "bfloat16" and cfg.tensor_parallel_size == 1 \
        and cfg.attention_backend in ("xla", "reference")  # cpu_layout.FLOAT32_ATTENTION_BACKENDS
    return plan_memory(
        model, cfg, device_memory_bytes=device_memory_bytes, measured_weights_bytes=measured_weights_bytes,
        max_num_pages=cap, draft_model=draft_model if cfg.speculative_method == "draft" else None,
        draft_scratch_pages=draft_scratch_pages(cfg) if draft_model is not None else 0,
        activations_dtype="float32" if cpu_bfloat16 else None)


def draft_scratch_pages(cfg: EngineConfig) -> int:
    """The pages a draft model's cache has beyond the target's: scratch for the positions its
    proposal pass writes past a row's pages (jaxserve.speculative.draft_proposer), for every row that verifies."""
    from jaxserve.speculative import verification  # host code, no jax
    return verification.max_verify_rows(cfg) * verification.draft_scratch_pages_per_row(
        cfg.num_speculative_tokens, cfg.page_size)

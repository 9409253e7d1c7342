"""Model and engine configuration.

`ModelConfig` is read from a Hugging Face `config.json` dict (the converter writes one for every
checkpoint, GGUF sources included). `EngineConfig` holds the serving knobs and is the one source
of their defaults, their flags' help texts and bounds (`setting`, jaxserve.settings), and checks
them all when it is made (`EngineConfig.check`): a setting that cannot work is a `SettingError`
naming its flag, raised before anything loads.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

from jaxserve.moe_config import ConfigError, moe_fields, moe_hf_fields
from jaxserve.setting_checks import (check_kv_offload_settings, check_lora_settings, check_pooling_settings,
                                    check_speculation)
from jaxserve.settings import SettingError, bound_problem, parse_bucket_sizes, setting

# Hugging Face architecture -> model_type; every one runs through jaxserve.models.llama.forward.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text",
    # Mixture-of-experts families (jaxserve.models.moe).
    "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe",
}
# Vision-language checkpoints: architecture -> (model_type, its language model's family, {ModelConfig
# field: config.json name} of its image token ids). The towers: jaxserve.models.qwen_vision, siglip.
MULTIMODAL_ARCHITECTURES = {
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2ForCausalLM", dict(
        image_token_id="image_token_id", image_start_token_id="vision_start_token_id",
        image_end_token_id="vision_end_token_id", video_token_id="video_token_id")),
    "Gemma3ForConditionalGeneration": ("gemma3", "Gemma3ForCausalLM", dict(image_token_id="image_token_index",
        image_start_token_id="boi_token_index", image_end_token_id="eoi_token_index"))}
_QWEN_ARCHS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES) + tuple(MULTIMODAL_ARCHITECTURES)
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
_ROPE_TYPES = ("default", "llama3", "linear")


# --attention_backend: pallas_kernels.dispatch's names ("triton" is "pallas", Pallas' Triton lowering).
ATTENTION_BACKENDS = ("pallas", "triton", "interpret", "mosaic", "mosaic_interpret", "xla", "reference")
KERNEL_BACKENDS = ("pallas", "triton", "mosaic")  # the compiled GPU kernels (the planner: memory.activation_bytes)
DEFAULT_MAX_MODEL_LEN = 2048  # max_model_len when none is given (at most the model's context)
# SmolLM2 on 2 cores, 8 decoding streams beside a 2000-token prompt: their longest gap between tokens
# 2.16 s unbounded, 0.43 s at 64, 0.25 s at 32 (4.4x a decode step); that prompt's TTFT 6.5 s -> 11.0 s.
CPU_SERVE_LONG_PREFILL_TOKEN_THRESHOLD = 32
MAX_SCHEDULER_STEPS = 64  # decode steps one multi-step call may take (jaxserve.executor.decode_loop)
MAX_SPECULATIVE_TOKENS = 16  # tokens proposed per row and step at most (jaxserve.speculative)
MAX_LORAS = 256  # LoRA slots of one slab at most
MAX_LORA_RANK = 512  # vLLM's highest --max-lora-rank
RUNNERS = ("generate", "pooling")  # --runner, vLLM's names
DEFAULT_MAX_INPUTS_PER_REQUEST = 2048  # OpenAI's bound on one embeddings request's inputs


@dataclasses.dataclass
class EngineConfig:
    """The engine's settings, and the one source of their defaults: every field declared with
    `setting` is a flag of `jaxserve serve`, `generate` and `plan` (jaxserve/commands/engine_flags.py
    defines them from these fields), and `jaxserve.planning.memory.plan_engine` sizes the KV pool
    from the whole config. Made, it is checked (`check`): SettingError naming the flag for a value
    out of its bounds or settings that do not combine; a bucket list given as text is parsed then."""
    # Scheduling.
    max_num_seqs: int = setting(32, "most sequences in one step", minimum=1)
    max_num_batched_tokens: int = setting(512, "token budget of one step (decode tokens + prefill chunks)",
                                          minimum=1)
    max_num_prefill_seqs: int = setting(8, "most prefill chunks in one step", minimum=1)
    # Prefill tokens a step may carry beside decoding rows (all its chunks together), at the cost
    # of offline throughput too (more, smaller steps); a step without decoding rows still takes the
    # whole budget. None: no bound (the rest of max_num_batched_tokens, as vLLM). `jaxserve serve`
    # on the CPU defaults it to CPU_SERVE_LONG_PREFILL_TOKEN_THRESHOLD (bench/prefill_interference.py).
    long_prefill_token_threshold: int | None = setting(
        None, "most prefill tokens a step carries beside decoding sequences (bounds their time per output token "
        "while a long prompt is prefilled; costs that prompt's time to first token)", minimum=1,
        unset=f"serve on CPU: {CPU_SERVE_LONG_PREFILL_TOKEN_THRESHOLD}; otherwise no bound")
    # The step shapes (jaxserve.core.step.BucketSet): explicit lists replace the geometric rule's sizes.
    # Given as the flag's text ("8,16,32") or a sequence; held as the parsed tuple (parse_bucket_sizes).
    decode_buckets: tuple[int, ...] | None = setting(
        None, "decode rows of the compiled step shapes: comma-separated, ascending, the last equal to "
        "--max_num_seqs (`jaxserve plan --measure_buckets` measures which are worth compiling here)",
        unset="8, 16, 32, ... doubling up to --max_num_seqs; on CPU also 1, 2, 4 for decode-only steps")
    prefill_buckets: tuple[int, ...] | None = setting(
        None, "prefill tokens of the compiled step shapes: comma-separated, ascending, the last equal to "
        "--max_num_batched_tokens (see --decode_buckets)", unset="32, 64, 128, ... doubling up to "
        "--max_num_batched_tokens")
    max_waiting_requests: int = setting(1024, "bound of the waiting queue", minimum=1)
    # Multi-step decoding (jaxserve.executor.decode_loop): the host sees the tokens, and stops, after the call.
    num_scheduler_steps: int = setting(
        1, "multi-step decoding: decode steps per device call when every running sequence decodes (1: one step "
        "per call; tokens then reach the client n at a time)", minimum=1, maximum=MAX_SCHEDULER_STEPS)
    # The KV cache.
    page_size: int = setting(16, "tokens per KV cache page", minimum=1, vllm_name="block_size")
    num_pages: int | None = setting(None, "KV cache pages per layer, null page included", minimum=2,
                                    unset="what the memory planner fits (`jaxserve plan` shows it)",
                                    vllm_name="num_gpu_blocks_override")
    max_model_len: int | None = setting(None, "longest prompt + completion, in tokens", minimum=1,
                                        unset=f"min(the model's context, {DEFAULT_MAX_MODEL_LEN})")
    enable_prefix_caching: bool = setting(True, "share KV pages of common prompt prefixes")
    # KV offload (jaxserve.core.kv_offload, jaxserve.executor.kv_transfer; docs/kv_offload.md): pages the
    # prefix cache evicts are kept in host memory (and on disk) and copied back on a prefix hit.
    kv_offloading_size: float | None = setting(
        None, "KV offload: GiB of host memory that keeps the KV pages the prefix cache evicts, copied back "
        "when a later request's prefix hits them (per model replica)", minimum=0.0, exclusive_minimum=True,
        unset="no KV offload")
    kv_offloading_backend: str = setting(
        "native", "KV offload: what keeps the offloaded pages (native: jaxserve's host tier)",
        choices=("native", "lmcache"))
    kv_offloading_disk_path: str | None = setting(
        None, "KV offload: a folder for a disk tier under the host tier (the host tier's evicted pages go there)",
        unset="no disk tier")
    kv_offloading_disk_size: float = setting(
        10.0, "KV offload: GiB of the disk tier (--kv_offloading_disk_path)", minimum=0.0, exclusive_minimum=True)
    # The weights' float dtype; EngineConfig.for_platform fills in the platform's.
    dtype: str | None = setting(None, "weights, activations and KV cache dtype (bfloat16 on the CPU: the weights "
                                "and the prompts' matmuls; activations and the KV cache stay float32)",
                                choices=("float32", "bfloat16", "float16"), unset="float32 on CPU, bfloat16 on GPU")
    attention_backend: str | None = setting(None, "attention implementation",
                                            choices=ATTENTION_BACKENDS, unset="pallas on GPU, xla on CPU")
    max_logprobs: int = setting(20, "the most logprobs (and prompt logprobs) one request may ask for", minimum=0)
    memory_utilization: float = setting(
        0.9, "fraction of the device's memory budget (on CPU: half the available RAM) the weights, activations "
        "and KV pages may use", minimum=0.0, exclusive_minimum=True, maximum=1.0,
        vllm_name="gpu_memory_utilization")
    # Not a flag: each command decides (serve compiles every shape, generate only what it runs
    # unless it saves or loads executables); tests and benchmarks set it.
    warmup: bool = True
    # Not a flag: `jaxserve serve` sets it. The warm-up goes on in the background once the shapes a
    # first request needs are compiled (ModelRunner.warmup), so the server answers meanwhile.
    background_warmup: bool = False
    # Compiled step executables (jaxserve.executor.executables): None keeps them automatically beside the
    # compilation cache.
    executables: str | None = setting(
        None, "load the compiled step shapes from this folder (written by --save_executables) instead of compiling "
        "them; refused when they were saved for another jax, device, model or engine flags",
        unset="kept automatically beside the compilation cache")
    save_executables: str | None = setting(
        None, "compile every step shape and save the executables in this folder, for --executables")
    # The prompt-logprob shapes (jaxserve.executor.warmup): compiled last, after every step shape, unless this
    # puts them among the shapes compiled before the server is ready.
    warmup_prompt_logprobs: bool = setting(
        False, "compile the prompt-logprob shapes (8 .. 256 rows) before the server is ready, with the first "
        "requests' shapes; otherwise they compile last, in the background, and a request asking for "
        "prompt_logprobs before its shape is compiled waits for it (the warm-up takes that shape next)")
    # Parallelism (jaxserve.parallel): an Engine is one replica; from_model builds data_parallel_size of them.
    tensor_parallel_size: int = setting(
        1, "devices each model replica is split over (attention heads, MLP, vocabulary)", minimum=1)
    data_parallel_size: int = setting(1, "model replicas, each on its own tensor_parallel_size devices", minimum=1)
    # jaxserve.parallel.sharding (expert parallelism) and jaxserve.models.moe; checked against the model by
    # sharding.expert_parallel_problem when the replica's shardings are made and by the planner.
    enable_expert_parallel: bool = setting(
        False, "mixture-of-experts models: spread each layer's routed experts over the tensor_parallel_size devices "
        "of a replica (whole experts, E / tensor_parallel_size per device) instead of splitting every expert's "
        "intermediate size; attention keeps its tensor-parallel split")
    # Quantization (jaxserve.models.quantization), after loading.
    quantization: str | None = setting(
        None, "quantize the linear layers after loading: int8 (per output channel), int4 (groups of 32 with a "
        "zero point); also int8_g32|64|128, int4_g64|128, _zp for int8 with a zero point, _sym for symmetric "
        "int4; fp8 (float8 e4m3, per output channel)", unset="as stored")
    # jaxserve.models.quantization.quantize_embedding.
    quantize_embedding: bool = setting(
        False, "also quantize the token embedding to int8 (one scale per vocabulary row) and with it the tied "
        "lm_head (an untied one per output channel); one device per replica (no tensor parallelism)")
    kv_cache_dtype: str = setting("auto", "KV cache storage: auto (the weights' float dtype), int8 "
                                  "(per-token-per-head scales) or fp8 (e4m3fn)", choices=("auto", "int8", "fp8"))
    # Steps of up to 64 rows (cpu_kernels, as llama.cpp does), prompt chunks as cpu_prompt_dtype
    # says (jaxserve.models.prompt_matmul); False: XLA dequantizes the weights to float32, as on
    # every other device.
    cpu_int8_activations: bool = setting(
        True, "quantized weights on the CPU: steps of up to 64 rows multiply int8-quantized activations with the "
        "weight codes in integer dot products (faster decoding; about 0.5% noise on the logits), and prompt chunks "
        "multiply as --cpu_prompt_dtype says; false: float32 activations, the weights dequantized by XLA")
    # Prompt chunks' matmuls on quantized or bfloat16 weights (jaxserve.models.prompt_matmul).
    cpu_prompt_dtype: str = setting(
        "auto", "the CPU's matmuls of prompt chunks (more than 64 rows) on quantized or bfloat16 weights: int8 (the "
        "decode kernel's int8 activations per 32 inputs, VNNI), bfloat16, float32, or auto (int8 for --quantization=int8 "
        "on CPUs without AMX, else bfloat16 where the CPU has it, else float32); see docs/quantization.md",
        choices=("auto", "float32", "bfloat16", "int8"))
    # Accelerators: the matmuls of prompt chunks on quantized weights (jaxserve.models.prompt_matmul).
    gpu_prompt_dtype: str = setting(
        "bfloat16", "an accelerator's matmuls of prompt chunks (more than 64 rows) on quantized weights: bfloat16 "
        "(the weights dequantized), int8 (per-channel int8 weights, --quantization=int8, times activations "
        "quantized to int8 per row: int8 tensor cores) or fp8 (float8 e4m3 weights, an fp8 checkpoint, times "
        "activations quantized to e4m3 per row); see docs/quantization.md", choices=("bfloat16", "int8", "fp8"))
    # Speculative decoding (jaxserve.speculative.verification).
    speculative_method: str | None = setting(
        None, "speculative decoding: ngram (prompt lookup: propose what followed the last n tokens earlier in the "
        "sequence) or draft (a smaller model with the same tokenizer, --speculative_model)",
        choices=("ngram", "draft"), unset="off")
    num_speculative_tokens: int = setting(4, "speculative decoding: most tokens proposed per sequence and step",
                                          minimum=1, maximum=MAX_SPECULATIVE_TOKENS)
    speculative_model: str | None = setting(
        None, "the draft model of --speculative_method=draft (anything --model takes)", unset="none")
    prompt_lookup_min: int = setting(2, "speculative_method=ngram: shortest n-gram matched", minimum=1)
    prompt_lookup_max: int = setting(5, "speculative_method=ngram: longest n-gram matched (tried first)",
                                     minimum=1)
    # The device's ceilings (jaxserve.planning.predict): `plan --predict` uses them instead of a GPU
    # preset or the CPU probe; the engine rates each step's achieved bytes/s and FLOP/s against them.
    memory_bandwidth_gbps: float | None = setting(
        None, "memory bandwidth of one device in GB/s (1e9 bytes/s), for the roofline of plan --predict and the "
        "step utilization metrics", unset="the GPU preset of the device; on CPU: plan probes, the engine reports none")
    peak_tflops: float | None = setting(
        None, "peak dense FLOP/s of one device in TFLOP/s (1e12), in the compute dtype", unset="as memory_bandwidth_gbps")
    interconnect_gbps: float | None = setting(
        None, "all-reduce bandwidth of one device to its tensor-parallel peers in GB/s", unset="the GPU preset's NVLink")
    speculative_disable_by_batch_size: int | None = setting(
        None, "speculative decoding: no speculation in steps with more running sequences", minimum=1, unset="never")
    # Multi-LoRA (jaxserve.core.lora_registry, jaxserve.models.lora): adapters in the slots of a device slab.
    enable_lora: bool = setting(False, "serve LoRA adapters over the base model (--lora_modules; a request picks "
                                "one by its model name)")
    lora_modules: tuple | None = setting(
        None, "LoRA adapters served from the start: NAME=PATH (a PEFT folder), or vLLM's JSON form "
        '{"name": ..., "path": ..., "base_model_name": ...}; repeat the flag or separate by commas', repeated=True,
        unset="none")
    max_loras: int = setting(1, "LoRA: most distinct adapters in one step (the device slab's slots)", minimum=1,
                             maximum=MAX_LORAS)
    max_lora_rank: int = setting(16, "LoRA: highest adapter rank served (the slab's width)", minimum=1,
                                 maximum=MAX_LORA_RANK)
    max_cpu_loras: int | None = setting(
        None, "LoRA: adapters kept loaded in host memory (least recently used evicted, reloaded from their path "
        "when asked again); at least --max_loras", minimum=1, unset="--max_loras")
    lora_dtype: str = setting("auto", "LoRA: dtype of the adapter slab (auto: the model's compute dtype)",
                              choices=("auto", "float32", "bfloat16", "float16"))
    # The pooling runner (jaxserve.pooling, docs/pooling.md): prefill and pool instead of decoding.
    runner: str = setting("generate", "what the engine runs: generate (tokens) or pooling (embeddings, scores, "
                          "reranking and classes: /v1/embeddings, /score, /rerank, /classify)", choices=RUNNERS)
    pooler_config: str | dict | None = setting(
        None, "runner=pooling: how the model pools, vLLM's JSON (pooling_type LAST|MEAN|CLS, normalize, dimensions, "
        "use_activation)", unset="the checkpoint's sentence-transformers files, else the last token, normalized")
    max_inputs_per_request: int = setting(
        DEFAULT_MAX_INPUTS_PER_REQUEST, "runner=pooling: most inputs (or documents) in one request; more is a 400",
        minimum=1)

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raises SettingError naming the flag of the first setting that cannot work: a value out
        of its Flag's bounds or choices, a bad bucket list (parsed into its tuple here), or settings
        that do not combine. Runs whenever a config is made (dataclasses.replace too)."""
        for field in dataclasses.fields(self):
            value, flag = getattr(self, field.name), field.metadata.get("flag")
            problem = None if flag is None or value is None else bound_problem(field.name, value, flag)
            if problem:
                raise SettingError(problem)
        if self.decode_buckets is not None:
            self.decode_buckets = parse_bucket_sizes(self.decode_buckets, "decode_buckets", self.max_num_seqs,
                                                     "max_num_seqs")
        if self.prefill_buckets is not None:
            self.prefill_buckets = parse_bucket_sizes(self.prefill_buckets, "prefill_buckets",
                                                      self.max_num_batched_tokens, "max_num_batched_tokens")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise SettingError(f"--max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                               f"({self.max_num_seqs}): every running sequence decodes a token in each step (raise "
                               "--max_num_batched_tokens or lower --max_num_seqs)")
        if self.quantize_embedding and self.tensor_parallel_size * self.data_parallel_size > 1:
            raise SettingError("--quantize_embedding needs the weights on one device: --tensor_parallel_size and "
                               f"--data_parallel_size 1, got {self.tensor_parallel_size} and {self.data_parallel_size}")
        check_speculation(self)
        self.lora_modules = check_lora_settings(self)
        check_pooling_settings(self)
        check_kv_offload_settings(self)

    @property
    def speculative_tokens(self) -> int:
        """Tokens proposed per row and step at most: 0 without speculation."""
        return self.num_speculative_tokens if self.speculative_method else 0

    def for_platform(self, on_gpu: bool) -> "EngineConfig":
        """This config with the platform defaults filled in where it leaves them open: dtype
        bfloat16 and the Pallas kernels on a GPU, float32 and the blocked XLA attention on the CPU."""
        return dataclasses.replace(self, dtype=self.dtype or ("bfloat16" if on_gpu else "float32"),
                                   attention_backend=self.attention_backend or ("pallas" if on_gpu else "xla"))

    def model_len(self, model_config) -> int:
        """The longest sequence served: max_model_len (default: DEFAULT_MAX_MODEL_LEN), at most
        the model's context."""
        context = model_config.max_position_embeddings
        return min(self.max_model_len or DEFAULT_MAX_MODEL_LEN, context)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder of the Llama family. Every field that changes the math is here; a Hugging Face
    config field that changes it and is not implemented is refused by `from_hf_dict`, never ignored."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3", factor, low/high_freq_factor,
    #                                    original_max_position_embeddings} or {"rope_type": "linear", factor}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2-style q/k/v biases
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of q and k, before RoPE
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and after the MLP as well
    norm_weight_offset: float = 0.0  # Gemma: RMSNorm scales by (1 + weight)
    hidden_act: str = "silu"  # the gate's activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU)
    embedding_multiplier: float = 1.0  # Gemma: sqrt(hidden_size), applied in the compute dtype
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale is this ** -0.5 (else head_dim's)
    attn_logit_softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the output logits
    sliding_window: int | None = None  # a query sees the last `sliding_window` positions, itself included
    layer_types: tuple[str, ...] | None = None  # per layer: full_attention | sliding_attention
    rope_local_theta: float | None = None  # Gemma 3: RoPE base of the sliding layers (unscaled)
    # Mixture of experts (jaxserve.models.moe); num_experts 0: a dense MLP of intermediate_size.
    num_experts: int = 0  # routed experts of every layer's MLP
    num_experts_per_tok: int = 0  # top-k: experts each token goes to
    moe_intermediate_size: int = 0  # intermediate size of each expert's SwiGLU
    norm_topk_prob: bool = False  # the k chosen softmax probabilities renormalised to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a shared SwiGLU behind a sigmoid gate (0: none)
    # Qwen2/3-MoE: the layers whose MLP is dense (of intermediate_size) rather than sparse, from
    # their configs' mlp_only_layers and decoder_sparse_step; (): every layer is sparse.
    mlp_only_layers: tuple[int, ...] = ()
    # A vision-language checkpoint (MULTIMODAL_ARCHITECTURES; `architecture` is its language model's family): the
    # tower's HF `vision_config`; Qwen2.5-VL's M-RoPE bands (jaxserve.models.mrope; not in llama.forward yet: text
    # positions make it the 1-D RoPE); image token ids (Qwen's video one: refused); Gemma 3's tokens per image.
    multimodal_architecture: str | None = None
    vision_config: dict | None = None
    mrope_section: tuple[int, ...] | None = None
    image_token_id: int | None = None
    image_start_token_id: int | None = None
    image_end_token_id: int | None = None
    video_token_id: int | None = None
    mm_tokens_per_image: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is a mixture of experts (none for a dense model)."""
        if not self.is_moe:
            return ()
        return tuple(i for i in range(self.num_layers) if i not in self.mlp_only_layers)

    @property
    def mixed_mlp_layers(self) -> bool:
        """Dense and sparse MLP layers in one model (see jaxserve.models.weights.LayerKinds)."""
        return self.is_moe and bool(self.mlp_only_layers)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_windows(self) -> list[int]:
        """The sliding window of every layer; 0 where a layer attends to the whole context."""
        types = self.layer_types or (SLIDING_ATTENTION if self.sliding_window else FULL_ATTENTION,) * self.num_layers
        return [self.sliding_window if t == SLIDING_ATTENTION else 0 for t in types]

    def rope_inv_freq(self, sliding: bool = False) -> np.ndarray:
        """Inverse rotary frequencies [head_dim // 2] of a full-attention layer (or, with `sliding`,
        of a sliding-window layer: Gemma 3 gives those their own unscaled base)."""
        if sliding and self.rope_local_theta is not None:
            return rope_inv_freq(self.rope_local_theta, self.head_dim, None).astype(np.float32)
        return rope_inv_freq(self.rope_theta, self.head_dim, self.rope_scaling).astype(np.float32)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch, mm_arch = archs[0], None
        if arch in MULTIMODAL_ARCHITECTURES:  # the language model: under text_config, or at the top level
            if not isinstance(cfg.get("vision_config"), dict):
                raise ConfigError(f"unsupported architecture {arch!r} without a vision_config")
            mm_arch, arch = arch, MULTIMODAL_ARCHITECTURES[arch][1]
            cfg = {**(cfg.get("text_config") or {}), **{k: v for k, v in cfg.items() if k != "text_config"}}
        if arch not in ARCHITECTURES:
            raise ConfigError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        gemma = arch.startswith("Gemma")
        try:
            num_q_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            num_layers = int(cfg["num_hidden_layers"])
            head_dim = cfg.get("head_dim") or hidden // num_q_heads
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            rope_theta, rope_scaling, rope_local_theta, mrope_section = _rope(cfg, arch)
            sliding_window, layer_types = _attention_layout(cfg, arch, num_layers)
            act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
            if act not in _ACTIVATIONS:
                raise ConfigError(f"unsupported activation {act!r}; supported: {', '.join(_ACTIVATIONS)}")
            for field, harmless in (("mlp_bias", False), ("use_bidirectional_attention", False),
                                    ("partial_rotary_factor", 1.0)):
                if cfg.get(field) not in (None, harmless):
                    raise ConfigError(f"{field}={cfg[field]!r} is not supported")
            moe = moe_fields(cfg, arch, num_layers)
            config = cls(
                vocab_size=int(cfg["vocab_size"]), hidden_size=hidden, intermediate_size=int(cfg["intermediate_size"]),
                num_layers=num_layers, num_q_heads=num_q_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_q_heads), head_dim=int(head_dim),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)), rope_theta=rope_theta, rope_scaling=rope_scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
                attention_bias=bool(cfg.get("qkv_bias", True) if arch == "Qwen2MoeForCausalLM"
                                    else cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
                bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids, architecture=arch,
                qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
                sandwich_norms=gemma, norm_weight_offset=1.0 if gemma else 0.0, hidden_act=act,
                embedding_multiplier=hidden ** 0.5 if gemma else 1.0,
                query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]) if gemma else None,
                attn_logit_softcap=_optional_float(cfg.get("attn_logit_softcapping")),
                final_logit_softcap=_optional_float(cfg.get("final_logit_softcapping")),
                sliding_window=sliding_window, layer_types=layer_types, rope_local_theta=rope_local_theta,
                **moe, **_multimodal_fields(cfg, arch, mm_arch, mrope_section, int(head_dim)))
        except KeyError as e:
            raise ConfigError(f"config is missing the field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"malformed config ({e})") from None
        if config.num_q_heads % config.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({config.num_q_heads}) is not a multiple of num_key_value_heads ({config.num_kv_heads})")
        if config.is_moe and config.hidden_act != "silu":
            raise ConfigError(f"hidden_act={config.hidden_act!r} is not supported for {config.architecture} (silu only)")
        if config.attention_bias and config.architecture not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM",
                                                                 "LlamaForCausalLM"):
            raise ConfigError(f"attention_bias is not supported for {config.architecture}")
        return config

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face config.json of this model (`from_hf_dict` reads it back unchanged)."""
        gemma = self.architecture.startswith("Gemma")
        out = {
            "architectures": [self.architecture], "model_type": ARCHITECTURES[self.architecture],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_q_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings, "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias, "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids), "hidden_activation" if gemma else "hidden_act": self.hidden_act,
            "sliding_window": self.sliding_window,
        }
        if self.layer_types is not None:
            out["layer_types"] = list(self.layer_types)
        if self.architecture in _QWEN_ARCHS:
            out["use_sliding_window"] = self.sliding_window is not None
        if self.is_moe:
            out.update(moe_hf_fields(self))
        if gemma:
            scalar = self.query_pre_attn_scalar
            out.update(query_pre_attn_scalar=int(scalar) if scalar == int(scalar) else scalar,  # transformers wants an int
                       attn_logit_softcapping=self.attn_logit_softcap,
                       final_logit_softcapping=self.final_logit_softcap)
        if self.rope_local_theta is not None:
            out["rope_local_base_freq"] = self.rope_local_theta
        if self.multimodal_architecture:  # flat (the language model's fields on top), as published Qwen2.5-VL
            model_type, _, ids = MULTIMODAL_ARCHITECTURES[self.multimodal_architecture]
            mrope = {"rope_scaling": {**(self.rope_scaling or {}), "mrope_section": list(self.mrope_section or ())}}
            out.update(architectures=[self.multimodal_architecture], model_type=model_type,
                       vision_config=self.vision_config, mm_tokens_per_image=self.mm_tokens_per_image,
                       **(mrope if self.mrope_section else {}), **{b: getattr(self, a) for a, b in ids.items()})
        return out

    @classmethod
    def from_json_file(cls, path: str) -> "ModelConfig":
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: no such file")
        try:
            with open(path) as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(data)

    # How the step lays out the routed experts, never read from a checkpoint: set only on the
    # config a sharded replica runs (jaxserve.parallel.sharding.sharded_model_config, from
    # EngineConfig.enable_expert_parallel): True spreads whole experts over the replica's devices.
    expert_parallel: bool = False


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


def _rope(cfg: dict[str, Any], arch: str) -> tuple[float, dict | None, float | None, list | None]:
    """(rope_theta, rope_scaling, rope_local_theta, mrope_section) from transformers 4 fields
    (rope_theta, rope_scaling, rope_local_base_freq) or transformers 5's `rope_parameters` (flat, or
    per layer type for Gemma 3). Qwen2.5-VL's type "mrope" is the default RoPE on three position axes."""
    params = cfg.get("rope_parameters") or {}
    local = None
    if FULL_ATTENTION in params or SLIDING_ATTENTION in params:  # per layer type (Gemma 3)
        local_params = params.get(SLIDING_ATTENTION) or {}
        if _rope_type(local_params) != "default":
            raise ConfigError(f"unsupported rope_parameters for sliding layers: {local_params}")
        local = float(local_params.get("rope_theta", 10000.0))
        params = params.get(FULL_ATTENTION) or {}
    elif cfg.get("rope_local_base_freq") is not None:
        local = float(cfg["rope_local_base_freq"])
    elif arch == "Gemma3ForCausalLM":
        local = 10000.0  # transformers' default for Gemma 3
    theta = float(cfg.get("rope_theta") or params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (params or None)
    section = (scaling or {}).get("mrope_section")
    if scaling is not None:
        if scaling.get("mrope_interleaved"):
            raise ConfigError(f"mrope_interleaved={scaling['mrope_interleaved']!r} is not supported")
        scaling = {k: v for k, v in scaling.items()  # type "mrope" with its section: the default RoPE on 3 axes
                   if k not in ("rope_theta", "mrope_section") and (v != "mrope" or section is None)}
        kind = _rope_type(scaling)
        if kind not in _ROPE_TYPES:
            raise ConfigError(f"unsupported rope_scaling type {kind!r}; supported: {', '.join(_ROPE_TYPES)}")
        scaling = None if kind == "default" else {**scaling, "rope_type": kind}
    return theta, scaling, local, section


def _multimodal_fields(cfg: dict[str, Any], arch: str, mm_arch: str | None, section, head_dim: int) -> dict:
    """ModelConfig's vision-language fields ({} for a text model, which may not have an mrope_section)."""
    qwen_vl = mm_arch == "Qwen2_5_VLForConditionalGeneration"
    if section is not None and not qwen_vl:
        raise ConfigError(f"mrope_section is not supported for {mm_arch or arch}")
    if qwen_vl and (not isinstance(section, (list, tuple)) or len(section) != 3 or sum(section) != head_dim // 2):
        raise ConfigError(f"{mm_arch} needs mrope_section in rope_scaling / rope_parameters: three integers "
                          f"summing to head_dim // 2 = {head_dim // 2}, got {section!r}")
    if mm_arch is None:
        return {}
    ids = {ours: cfg.get(theirs) for ours, theirs in MULTIMODAL_ARCHITECTURES[mm_arch][2].items()}
    ids["mm_tokens_per_image"] = None if qwen_vl else int(cfg.get("mm_tokens_per_image", 256))
    return dict(multimodal_architecture=mm_arch, vision_config=dict(cfg["vision_config"]),
                mrope_section=section and tuple(int(s) for s in section), **{k: v and int(v) for k, v in ids.items()})


def _rope_type(params: dict) -> str:
    return params.get("rope_type", params.get("type")) or "default"


def _attention_layout(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types): which layers attend through a sliding window, and its size."""
    window = cfg.get("sliding_window")
    if arch in _QWEN_ARCHS and not cfg.get("use_sliding_window", False):
        window = None  # Qwen configs carry a window that only applies with use_sliding_window
    if arch == "LlamaForCausalLM" and window is not None:
        raise ConfigError("sliding_window is not supported for LlamaForCausalLM")
    types = cfg.get("layer_types")
    if types is None:
        if arch == "Gemma2ForCausalLM":
            types = [SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(num_layers)]
        elif arch == "Gemma3ForCausalLM":
            pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
            types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)]
        elif arch in _QWEN_ARCHS and window is not None:
            first = int(cfg.get("max_window_layers", num_layers))
            types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers)]
    if types is not None:
        types = tuple(types)
        if len(types) != num_layers or not set(types) <= {FULL_ATTENTION, SLIDING_ATTENTION}:
            raise ConfigError(f"layer_types must list {FULL_ATTENTION} or {SLIDING_ATTENTION} for each of "
                              f"the {num_layers} layers, got {list(types)}")
        if window is None:  # no window: every layer attends to the whole context
            types = None
        elif all(t == FULL_ATTENTION for t in types):
            types, window = None, None
        elif all(t == SLIDING_ATTENTION for t in types):
            types = None
    if window is not None and (isinstance(window, bool) or int(window) < 1):
        raise ConfigError(f"sliding_window must be a positive integer, got {window!r}")
    return (None if window is None else int(window)), types


def rope_inv_freq(theta: float, head_dim: int, scaling: dict | None) -> np.ndarray:
    """Inverse rotary frequencies [head_dim // 2] (float64), scaled as `scaling` says: "linear"
    divides every frequency by the factor; "llama3" divides the low ones by it and interpolates
    the middle band (the formula of Meta's Llama 3.1 release)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if not scaling:
        return inv_freq
    factor = float(scaling["factor"])
    if _rope_type(scaling) == "linear":
        return inv_freq / factor
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    smoothed = inv_freq * ((1.0 - smooth) / factor + smooth)
    scaled = np.where(wavelen > original / low, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= original / high) & (wavelen <= original / low)
    return np.where(is_medium, smoothed, scaled)

"""The CPU step's weight layouts: how the weights are laid out and read for the step on one CPU
device, beside the layout they are stored in.

Under the layer scan, XLA materializes each layer's slice of a stacked weight before a dot reads
it (a dynamic-slice of an operand is a copy): for a step of few rows that copy costs more than
the matmul itself. And XLA:CPU converts every code of a quantized weight to float before a
matrix-matrix dot. `layer_views` lays the weights out around both, with two layouts of a
QuantArray's numbers beside its stored ones, both read by `quantization.linear`:
* `with_kernel_layout`: the C++ kernel's (cpu_kernels.quantized_matmul), which multiplies int8
  rows by the codes at their size, reading a stacked layout at the layer index;
* `transposed`: codes [out, in], whose dequantization XLA fuses into a one-row product.
A float model's matrices go into the C++ kernel's strips of 64 output columns instead
(`StripMatrix`, cpu_kernels' strip_matmul.cc): a float32 model's in those alone
(`float32_views`), a bfloat16 model's beside the stored ones (`bfloat16_views`).
`LayerWeights` is how `jaxserve.models.llama.forward` reads the layers of whichever layout
`layer_views` gave.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import cpu_kernels
from jaxserve.models import prompt_matmul
from jaxserve.models.quantization import (KernelLayout, QuantArray, QuantEmbedding, StripMatrix, TransposedLayout,
                                          parse_format, tree_bytes)

Params = dict[str, Any]
# The attention backends whose CPU path takes float32 operands (`layer_views`' float32_attention).
FLOAT32_ATTENTION_BACKENDS = ("xla", "reference")


# ---- the layouts of one weight ------------------------------------------------------------------

def kernel_takes(weight) -> bool:
    """Whether the CPU kernel takes this QuantArray (or, stacked, its layers): int8 or int4 codes
    in the stored layout, float16 scale and zero (the --quantization formats), no act-order
    permutation, groups a multiple of cpu_kernels.BLOCK inputs."""
    if not isinstance(weight, QuantArray) or weight.perm is not None:
        return False
    q, scale, zero = weight.q, weight.scale, weight.zero
    if q.ndim < 2 or q.dtype not in (jnp.int8, jnp.uint8) or scale.dtype != cpu_kernels.SCALE_DTYPE \
            or (zero is not None and zero.dtype != cpu_kernels.SCALE_DTYPE):
        return False
    return (weight.shape[-2] // scale.shape[-2]) % cpu_kernels.BLOCK == 0


def prompt_compute_dtype(weight_dtype: str, int8_activations: bool, prompt_dtype: str = "auto") -> str:
    """What a prompt chunk's matmuls multiply in on this CPU (quantization.linear, prompt_matmul)
    for linear layers stored as `weight_dtype` (a float dtype or a format name), with
    EngineConfig.cpu_int8_activations and cpu_prompt_dtype: "int8", "bfloat16" or "float32"."""
    if weight_dtype in ("float32", "float16"):
        return "float32"
    if weight_dtype == "bfloat16":
        chosen = prompt_matmul.resolve(prompt_dtype)
        return "float32" if chosen == "float32" else "bfloat16"
    fmt = parse_format(weight_dtype, stored=True)
    takes = not (fmt.float8 or fmt.act_order or fmt.integer_zero or fmt.scale_dtype != "float16"
                 or (fmt.group_size or cpu_kernels.BLOCK) % cpu_kernels.BLOCK)  # kernel_takes, by format name
    if not (int8_activations and takes and cpu_kernels.available()):
        return "float32"
    return prompt_matmul.resolve(prompt_dtype, (fmt.bits, fmt.group_size, fmt.zero_point) == (8, None, False))


def per_channel_int8(weight: QuantArray) -> bool:
    """Whether a weight is `--quantization=int8`'s: int8 codes, one scale per output channel, no zero."""
    return weight.q.dtype == jnp.int8 and weight.zero is None and weight.scale.shape[-2] == 1


def kernel_layout(weight: QuantArray) -> KernelLayout:
    """The levels, scales and zeros of `weight` (`kernel_takes` it) in the CPU kernel's layout
    (`cpu_kernels.pack` and `pack_groups`): a copy at their own size. Every weight is
    level * scale + offset, with level u = the int4 code, or q + 128 for int8."""
    q = weight.q
    if q.dtype == jnp.uint8:
        packed = cpu_kernels.pack(_int4_codes(q, weight.scale.shape[-2]), 4)
    else:
        packed = cpu_kernels.pack(q.view(jnp.uint8) ^ jnp.uint8(0x80), 8)
    zero = None if weight.zero is None else cpu_kernels.pack_groups(weight.zero)
    return KernelLayout(packed, cpu_kernels.pack_groups(weight.scale), zero)


def with_kernel_layout(weight: QuantArray) -> QuantArray:
    """`weight` with its `kernel_layout` added, which `linear` reads for up to
    cpu_kernels.MAX_ROWS rows."""
    return dataclasses.replace(weight, kernel=_kernel_layout_jit(weight))


def _int4_codes(q: jax.Array, num_groups: int) -> jax.Array:
    """Packed int4 codes [..., in / 2, out] -> one code a byte [..., in, out], in the inputs' order."""
    *lead, rows, out = q.shape
    packed = q.reshape(*lead, num_groups, rows // num_groups, out)
    return jnp.concatenate([packed & 0xF, packed >> 4], axis=-2).reshape(*lead, 2 * rows, out)


def transposed_layout(weight: QuantArray) -> TransposedLayout:
    """The layout of `weight`'s numbers whose dequantization XLA:CPU fuses into a matrix-vector
    product: q [..., out, in] (int8 / fp8 codes, or int4 codes unpacked to one uint8 each),
    scale (and zero) [..., out, groups] (float scales and zeros as float32).

    XLA:CPU never fuses a producer into a matrix-matrix dot, so `linear` on the stored [in, out]
    layout writes the weight out in float32 and multiplies that (4 bytes written and read again
    per weight, on top of the 1 read). For a single row, though, XLA emits `x @ w.T` with w
    [out, in] as one loop over the output (a dot per contiguous row of w) and fuses w's
    elementwise producers into it: the codes are read once and converted in registers
    (tests/test_quantization.py checks the compiled HLO). Packed int4 codes in that loop run
    slower than the stored layout's two dots (the nibble unpacking does not vectorize there),
    so int4 codes are unpacked here: the step reads a byte per int4 weight, as for int8.
    With several rows the stored layout is as fast or faster (2, 4, 8 rows measured), so the
    CPU step keeps both (`layer_views`) and `linear` reads this one for a single row."""
    swap = lambda a: jnp.swapaxes(a, -1, -2)
    floats = lambda a: a if jnp.issubdtype(a.dtype, jnp.integer) else a.astype(jnp.float32)
    q = weight.q
    if q.dtype == jnp.uint8:
        q = _int4_codes(q, weight.scale.shape[-2])
    zero = None if weight.zero is None else floats(swap(weight.zero))
    return TransposedLayout(swap(q), floats(swap(weight.scale)), zero)


def transposed(weight: QuantArray) -> QuantArray:
    """`weight` with its `transposed_layout` added, which `linear` reads for a single row."""
    return dataclasses.replace(weight, transposed=_transposed_jit(weight))


def lm_head_kernel_weight(embed: QuantEmbedding) -> QuantArray:
    """The tied lm_head of a QuantEmbedding as a per-output-channel int8 weight [D, V] (float16
    scales) for the CPU kernel: `kernel_takes` tells whether it takes it."""
    return QuantArray(embed.q.T, embed.scale.T.astype(cpu_kernels.SCALE_DTYPE))


def embedding_kernel_layout(embed: QuantEmbedding) -> KernelLayout:
    """A QuantEmbedding's tied lm_head in the CPU kernel's layout (a copy of the codes and their
    scales), which `quantization.embedding_logits` reads for up to cpu_kernels.MAX_ROWS rows."""
    return kernel_layout(lm_head_kernel_weight(embed))


_transposed_jit = jax.jit(transposed_layout)
_kernel_layout_jit = jax.jit(kernel_layout)
_embedding_kernel_layout_jit = jax.jit(embedding_kernel_layout)


# ---- the layers as the CPU step reads them ------------------------------------------------------

def layer_views(params: Params, int8_activations: bool = True, prompt_dtype: str = "auto",
                float32_attention: bool = True) -> Params:
    """`_layer_views`, every kernel layout in it marked with what prompt chunks multiply in
    (EngineConfig.cpu_prompt_dtype, "auto" decided for this CPU: jaxserve.models.prompt_matmul).
    `float32_attention`: the step's attention takes float32 operands (the XLA path and the
    reference), so a bfloat16 model may keep its activations in float32 (`bfloat16_views`); not
    for the GPU kernels run on the CPU (interpret mode), which take 16-bit ones."""
    views = _layer_views(params, int8_activations, float32_attention)
    if views is params:
        return params

    def mark(weight):
        if isinstance(weight, (QuantArray, StripMatrix)) and weight.kernel is not None:
            chosen = prompt_matmul.resolve(prompt_dtype, isinstance(weight, QuantArray) and per_channel_int8(weight))
            return dataclasses.replace(weight, kernel=dataclasses.replace(weight.kernel, prompt_dtype=chosen))
        return weight

    mark_all = lambda layers: {name: mark(w) for name, w in layers.items()}  # noqa: E731
    layers = views["layers"]
    layers = tuple(map(mark_all, layers)) if isinstance(layers, tuple) else mark_all(layers)
    return {**views, "layers": layers, **({"lm_head": mark(views["lm_head"])} if "lm_head" in views else {})}


def bf16_prompt_attention(layers, num_tokens: int) -> bool:
    """Whether the prefill attention of a step of `num_tokens` rows may multiply in bfloat16
    (dispatch.ragged_attention's bf16_products): the step is a prompt chunk's (more rows than
    cpu_kernels.MAX_ROWS) and the layers multiply those in bfloat16 or int8 (their kernel layouts'
    prompt_dtype, as `layer_views` marked them), so the prompt is computed at that precision
    anyway. A float32 model's attention, and a smaller step's, stays float32."""
    if num_tokens <= cpu_kernels.MAX_ROWS:
        return False
    def prompt_dtype(weight) -> str:  # a float32 strip multiplies in float32 whatever it is marked
        float32 = isinstance(weight, StripMatrix) and weight.kernel.packed.dtype == jnp.float32
        return "float32" if float32 else weight.kernel.prompt_dtype

    dtypes = {prompt_dtype(weight) for weight in jax.tree.leaves(
        layers, is_leaf=lambda leaf: isinstance(leaf, (QuantArray, StripMatrix)))
        if isinstance(weight, (QuantArray, StripMatrix)) and weight.kernel is not None}
    return bool(dtypes) and dtypes <= {"bfloat16", "int8"}


def _layer_views(params: Params, int8_activations: bool, float32_attention: bool = True) -> Params:
    """`params` as the CPU step reads its weights in place, without a copy of a layer's slice.

    A float model (every matrix float32, or bfloat16 with `float32_attention`): its matrices in
    the C++ kernel's strips, read at the layer index (`float32_views`, `bfloat16_views`). A
    quantized one, two ways around the scan's slice copies, on one CPU device:
    * every weight matrix quantized in a format the CPU kernel takes, with `int8_activations`
      (EngineConfig.cpu_int8_activations): "layers" stays stacked, each matrix with the kernel's
      layout added (`with_kernel_layout`: the codes once more, at their size, the one cost in
      memory); `forward` passes those layouts whole with the layer index, which the kernel reads
      at (an int8 embedding's tied lm_head gets the layout too). A step's arguments stay few:
      each is a cost of every call (1325 arrays of SmolLM2 per layer took 2.4 ms of a 7.3 ms int4
      step to pass, 49 take 0.25 ms);
    * else "layers" becomes a tuple of per-layer dicts whose arrays are views of the stacked
      arrays' layer slices (a jax array can alias host memory: no copy), which `forward` reads
      under a switch on the layer index; quantized weights also get the layout a single row
      reads (`transposed`, a copy, whose dequantization XLA fuses into the matmul; int4 codes at
      a byte each, float32 scales), or the kernel's when some other matrix keeps the views.
    Anywhere else (an accelerator, sharded weights, a slice jax would not alias), `params` is
    returned unchanged and the scan slices the stacked arrays."""
    def on_one_cpu(leaf):
        devices = leaf.devices() if isinstance(leaf, jax.Array) else ()
        return len(devices) == 1 and next(iter(devices)).platform == "cpu"

    if not jax.tree.leaves(params["layers"]) or not all(map(on_one_cpu, jax.tree.leaves(params["layers"]))):
        return params
    if float32_attention and _float_matrices(params, jnp.bfloat16):
        return bfloat16_views(params)
    if _float_matrices(params, jnp.float32):
        return float32_views(params)
    if int8_activations and _kernel_takes_every_matrix(params["layers"]):
        layers = {name: with_kernel_layout(w) if isinstance(w, QuantArray) else w
                  for name, w in params["layers"].items()}
        return _with_lm_head_kernel_layout({**params, "layers": layers})
    per_layer = _per_layer_views({name: _cpu_layout(w, int8_activations) for name, w in params["layers"].items()})
    if per_layer is None:
        return params
    views = {**params, "layers": per_layer}
    return _with_lm_head_kernel_layout(views) if int8_activations else views


def _float_matrices(params: Params, dtype) -> bool:
    """Whether every matrix of the model is a float array of `dtype` (no quantized weight, no
    routed experts) and the C++ kernels are built: `bfloat16_views` / `float32_views` take it."""
    matrices = [w for w in params["layers"].values() if isinstance(w, QuantArray) or w.ndim > 2]
    matrices += [params[name] for name in ("embed", "lm_head") if name in params]
    return bool(matrices) and all(not isinstance(w, (QuantArray, QuantEmbedding)) and w.ndim in (2, 3)
                                  and w.dtype == dtype for w in matrices) \
        and all(w.ndim == 3 for w in params["layers"].values() if w.ndim > 2) and cpu_kernels.available()


def bfloat16_views(params: Params) -> Params:
    """A bfloat16 model as the CPU step reads it: each matrix a `StripMatrix` (its stored
    layout and a copy in the C++ kernel's, read at the layer index: float32 rows times bfloat16
    weights at memory speed, where XLA:CPU takes 5-30x longer), the lm_head too (a tied one in the
    kernel's layout only), and the norms and biases in float32: the residual stream, attention
    and the "auto" KV cache stay float32, and only the weights' storage and the prompt's matmuls
    (jaxserve.models.prompt_matmul) are bfloat16."""
    as_float32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    layers = {name: _bfloat16_matrix_jit(w) if w.ndim == 3 else as_float32(w) for name, w in params["layers"].items()}
    views = {**{name: as_float32(w) if w.ndim == 1 else w for name, w in params.items() if name != "layers"},
             "layers": layers}
    views["lm_head"] = _bfloat16_matrix_jit(params["lm_head"]) if "lm_head" in params \
        else _tied_lm_head_jit(params["embed"])
    return views


def _bfloat16_matrix_jit(w: jax.Array) -> StripMatrix:
    """A bfloat16 [..., in, out] weight with the kernel's layout beside it, the weight held as its
    uint16 bits (`bits_of`: the same memory, no copy)."""
    return StripMatrix(bits_of(w), KernelLayout(_pack_bf16_jit(w), None), w.shape[-1])


def bits_of(w: jax.Array) -> jax.Array:
    """A bfloat16 array's uint16 bits: on one CPU device a view of the same buffer (no copy),
    else (abstract, or jax would copy) jax's bitcast. A bfloat16 array the layer scan slices is
    converted to float32 whole by XLA:CPU before the scan and each slice back to bfloat16 in it
    (SmolLM2's 500-token bfloat16 prompt: 120 of its 245 ms); uint16 is sliced as it is, and
    StripMatrix.matrix bitcasts the slice back."""
    if isinstance(w, jax.Array) and not isinstance(w, jax.core.Tracer) and len(w.devices()) == 1:
        (device,) = w.devices()
        host = _host_buffer(w) if device.platform == "cpu" else None
        bits = None if host is None else _aliased(host.view(np.uint16), device)
        if bits is not None:
            return bits
    return jax.lax.bitcast_convert_type(w, jnp.uint16)


def _host_buffer(array: jax.Array) -> np.ndarray | None:
    """A CPU device array's own buffer as numpy (no copy); None where numpy would get a copy."""
    host = np.asarray(array)
    return host if host.__array_interface__["data"][0] == array.unsafe_buffer_pointer() else None


def _aliased(view: np.ndarray, device) -> jax.Array | None:
    """Host memory (a view of a CPU device buffer) as a jax array on `device`, the same memory;
    None where jax would copy it (alignment)."""
    array = jax.device_put(view, device)
    return array if array.unsafe_buffer_pointer() == view.__array_interface__["data"][0] else None


def _tied_lm_head_jit(embed: jax.Array) -> StripMatrix:
    """The lm_head tied to a bfloat16 embedding [V, D]: its [D, V] in the kernel's layout only."""
    return StripMatrix(None, KernelLayout(_pack_transposed_bf16_jit(embed), None), embed.shape[0])


_pack_bf16_jit = jax.jit(cpu_kernels.pack_bf16)
_pack_transposed_bf16_jit = jax.jit(lambda w: cpu_kernels.pack_bf16(w.T))


def float32_views(params: Params) -> Params:
    """A float32 model as the CPU step reads it: each matrix (the lm_head, a tied one too) a
    `StripMatrix` in the C++ kernel's strips only (cpu_kernels.f32_matmul multiplies every row
    count, faster than XLA:CPU's dot: bench/RESULTS.md), read at the layer index;
    norms, biases and the embedding as they are. The stored matrices are then read by nothing
    (`stored_params_left` lets the runner drop them): the strips replace them, and only a tied
    lm_head's are a copy (of the embedding, transposed)."""
    layers = {name: _float32_matrix_jit(w) if w.ndim == 3 else w for name, w in params["layers"].items()}
    return {**params, "layers": layers, "lm_head": _float32_lm_head(params)}


def _float32_lm_head(params: Params) -> StripMatrix:
    """The lm_head in the kernel's strips: params["lm_head"]'s, or the tied embedding's (a copy)."""
    return _float32_matrix_jit(params["lm_head"]) if "lm_head" in params else _float32_tied_lm_head_jit(params["embed"])


@jax.jit
def _float32_matrix_jit(w: jax.Array) -> StripMatrix:
    """A float32 [..., in, out] weight in the kernel's strips (a copy; nothing else kept)."""
    return StripMatrix(None, KernelLayout(cpu_kernels.pack_f32(w), None), w.shape[-1])


@jax.jit
def _float32_tied_lm_head_jit(embed: jax.Array) -> StripMatrix:
    """The lm_head tied to a float32 embedding [V, D]: its [D, V] in strips, transposed in the same
    program as the packing (no transposed copy of the embedding made first)."""
    return _float32_matrix_jit(embed.T)


def stored_params_left(params: Params, views: Params) -> Params:
    """`params` with each entry that `views` (layer_views') replaced by a layout of its own
    (float32_views' strips) given as that layout instead: what the runner keeps as its weights,
    so that the stored matrices no one reads any more are freed (an untied float32 lm_head that
    _with_lm_head_kernel_layout put in strips too). Anything else unchanged."""
    def strips_alone(w) -> bool:
        return isinstance(w, StripMatrix) and w.w is None and w.kernel.packed.dtype == jnp.float32
    replaced = {}
    if any(map(strips_alone, jax.tree.leaves(views["layers"], is_leaf=lambda w: isinstance(w, StripMatrix)))):
        replaced["layers"] = views["layers"]
    if "lm_head" in params and strips_alone(views.get("lm_head")):
        replaced["lm_head"] = views["lm_head"]
    return {**params, **replaced} if replaced else params


def _per_layer_views(layers: Params) -> tuple[Params, ...] | None:
    """The layers' weights as one dict per layer of views of the stacked arrays' slices; None
    when some array cannot be viewed so (not stacked on the layer axis, or jax would copy it)."""
    leaves, treedef = jax.tree.flatten(layers)
    num_layers = leaves[0].shape[0]
    per_layer = [[] for _ in range(num_layers)]
    for leaf in leaves:
        if leaf.shape[0] != num_layers:
            return None
        (device,) = leaf.devices()
        host = _host_buffer(leaf)
        if host is None:
            return None
        for layer, view in enumerate(host):
            array = _aliased(view, device)
            if array is None:  # keep the stacked weights
                return None
            per_layer[layer].append(array)
    return tuple(jax.tree.unflatten(treedef, arrays) for arrays in per_layer)


def layer_views_bytes(params: Params, int8_activations: bool = True) -> int:
    """Bytes `layer_views` adds beside `params` (arrays or abstract arrays) on one CPU device:
    the kernel's or the transposed layout of the quantized weights, and of an int8 embedding's
    tied lm_head, a bfloat16 model's matrices in the kernel's layout (and its norms in float32), or
    a float32 model's strips less the matrices they replace (a tied lm_head's copy and the strips'
    padding; so too a quantized model's float32 lm_head, `_with_lm_head_kernel_layout`). Views
    themselves cost nothing. For the memory planner."""
    if _float_matrices(params, jnp.float32):  # the strips replace the matrices; a tied lm_head's are a copy
        return tree_bytes(jax.eval_shape(float32_views, params)) - tree_bytes(params)
    if _float_matrices(params, jnp.bfloat16):
        shared = [w for w in params["layers"].values() if w.ndim == 3]  # the matrices' stored layout
        shared += [params[name] for name in ("embed", "lm_head") if name in params]
        return tree_bytes(jax.eval_shape(bfloat16_views, params)) - tree_bytes(shared)
    added = 0
    for weight in params["layers"].values():
        if isinstance(weight, QuantArray):
            layout = jax.eval_shape(functools.partial(_cpu_layout, int8_activations=int8_activations), weight)
            added += tree_bytes((layout.transposed, layout.kernel))
    if int8_activations:  # the lm_head's layout: a copy (tied), or strips that replace it
        added += tree_bytes(jax.eval_shape(_with_lm_head_kernel_layout, params)) - tree_bytes(params)
    return added


def _kernel_takes_every_matrix(layers: Params) -> bool:
    """Whether every weight matrix of the layers is quantized in a format the CPU kernel takes
    (and the kernel is built): then the layers stay stacked, with the kernel's layout beside
    the stored one, and no matrix is sliced out of its stack in the step."""
    for weight in layers.values():
        if _routed_experts(weight):  # read one expert at a time by the grouped matmul
            return False
        if isinstance(weight, QuantArray):
            if not kernel_takes(weight):
                return False
        elif weight.ndim > 2:  # a float matrix [L, in, out] (norms and biases are [L, n])
            return False
    return cpu_kernels.available()


def _routed_experts(weight) -> bool:
    """Whether a stacked weight is a mixture-of-experts layer's routed experts [L, E, in, out]."""
    return (weight.q if isinstance(weight, QuantArray) else weight).ndim == 4


def _lm_head_takes_kernel(params: Params) -> bool:
    """Whether the model's lm_head is an int8 embedding's tied one that the CPU kernel takes."""
    embed = params["embed"]
    return isinstance(embed, QuantEmbedding) and "lm_head" not in params \
        and kernel_takes(jax.eval_shape(lm_head_kernel_weight, embed)) and cpu_kernels.available()


def _with_lm_head_kernel_layout(params: Params) -> Params:
    """The lm_head of a quantized model with int8 activations, in a CPU kernel's layout too: an
    int8 embedding's tied one in the VNNI kernel's, when it takes it; a float32 one (tied: a copy
    of the embedding, transposed, as float32_views makes) in cpu_kernels.f32_matmul's strips, which
    multiply the few rows of a step at memory speed (SmolLM2's [576, 49152] at 2 rows: 3.1 ms,
    XLA:CPU's dot 6.3; at 8 rows 3.6 and 8.0; at one row both 3.4)."""
    embed = params["embed"]
    if _lm_head_takes_kernel(params):
        return {**params, "embed": dataclasses.replace(embed, kernel=_embedding_kernel_layout_jit(embed))}
    head = params.get("lm_head", embed)  # (an abstract array too: layer_views_bytes)
    if cpu_kernels.available() and not isinstance(head, (QuantArray, QuantEmbedding, StripMatrix)) \
            and head.ndim == 2 and head.dtype == jnp.float32:
        return {**params, "lm_head": _float32_lm_head(params)}
    return params


def _cpu_layout(weight, int8_activations: bool):
    """A stacked weight with what the CPU step's few-row matmuls read besides its stored layout
    (routed experts: none, the grouped matmul reads their stored codes)."""
    if _routed_experts(weight):
        return weight
    if int8_activations and kernel_takes(weight) and cpu_kernels.available():
        return with_kernel_layout(weight)
    if isinstance(weight, QuantArray):
        return transposed(weight)
    return weight


@dataclasses.dataclass(frozen=True)
class LayerWeights:
    """How the layer scan of the step reads the layers' weights, in any layout `layer_views` gives:
    * stacked (`scanned`): the scan slices each array layer by layer; kernel layouts (`whole`)
      are passed whole with the layer index instead, which the kernel reads at (a slice of a
      stacked weight is a copy);
    * per layer (`per_layer`): a switch on the layer index whose branch i reads layer i's own
      arrays, which the dots then read in place.
    A model with kinds of layer (jaxserve.models.weights.LayerKinds: dense and sparse MLP layers
    mixed) keeps each kind's own weights stacked over its layers only (`own`, passed whole): a
    part that reads them runs under a switch over the kinds, whose branch reads the layer's row
    of its kind's stacks (a dynamic slice, as the scan's own) under the names a uniform layer
    has. (`layer_views` keeps such a model's weights stacked: `_per_layer_views` wants every
    array on the one "layers" stack.)"""
    scanned: Params | None  # what the scan slices, [L, ...] each (None: per-layer weights)
    whole: dict[str, KernelLayout]  # the stacked kernel layouts of the QuantArrays that have one
    per_layer: tuple[Params, ...] | None  # layer_views' per-layer dicts (None: stacked weights)
    own: Params = dataclasses.field(default_factory=dict)  # kinds' own stacks, [L_kind, ...] each
    kinds: Any = None  # weights.LayerKinds, or None: every layer has the same weights

    @classmethod
    def of(cls, layers: Params | tuple[Params, ...], kinds=None) -> "LayerWeights":
        """`kinds`: weights.layer_kinds(config) of the model (None: every layer has the same weights)."""
        if isinstance(layers, (list, tuple)):
            return cls(None, {}, tuple(layers))
        own = {name: w for name, w in layers.items() if kinds is not None and name in kinds.leaves}
        layers = {name: w for name, w in layers.items() if name not in own}
        whole = {name: w.kernel for name, w in layers.items()
                 if isinstance(w, (QuantArray, StripMatrix)) and w.kernel is not None}
        scanned = {name: dataclasses.replace(w, kernel=None) if name in whole else w for name, w in layers.items()}
        return cls(scanned, whole, None, own, kinds if own else None)

    def apply(self, part: Callable, lp: Params | None, layer_idx: jax.Array, *args, own_weights: bool = True):
        """part(this layer's weights, *args): on the scan's slice `lp` of the stacked weights
        (with the kernel layouts whole, read at `layer_idx`), or under a switch on `layer_idx`;
        with kinds of layer and `own_weights` (the part reads a kind's own weights), under a
        switch on the layer's kind, its own weights added."""
        if self.per_layer is not None:
            return jax.lax.switch(layer_idx, [functools.partial(part, w) for w in self.per_layer], *args)
        if self.whole:
            lp = {**lp, **{name: dataclasses.replace(lp[name], kernel=dataclasses.replace(kernel, layer=layer_idx))
                           for name, kernel in self.whole.items()}}
        if self.kinds is None or not own_weights:
            return part(lp, *args)
        kind = jnp.asarray(self.kinds.kind_of, jnp.int32)[layer_idx]  # scalar: this layer's kind
        row = jnp.asarray(self.kinds.row_of, jnp.int32)[layer_idx]  # scalar: its row in that kind's stacks

        def branch(k, *args):
            own = {read: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, row, keepdims=False), self.own[name])
                   for name, read in self.kinds.own_weights(k).items()}
            return part({**lp, **own}, *args)

        return jax.lax.switch(kind, [functools.partial(branch, k) for k in range(len(self.kinds.kinds))], *args)

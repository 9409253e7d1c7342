"""The model's one entry to this package: the KV cache write (`write_kv`) and the one place that
decides which attention implementation runs.

Backends:
  "pallas"     the Pallas kernels compiled for the GPU through Pallas' Triton lowering
               (paged_decode.py, ragged_prefill.py; "triton" is the same backend by its other name);
  "interpret"  the same kernels in Pallas interpret mode (runs anywhere, slowly: for tests);
  "mosaic"     the Pallas Mosaic GPU kernels (mosaic_decode.py, mosaic_ragged.py: TMA and wgmma,
               Hopper only; bfloat16/float16 queries over 16-bit, int8 or fp8 pages, see
               mosaic_common.unsupported), jax >= 0.11;
  "mosaic_interpret"  the same kernels in Mosaic GPU's interpreter (on the CPU, with race
               detection: for tests);
  "xla"        plain XLA that loops over the context a few pages at a time (xla_paged.py); on
               the CPU, decode and prefill attention over float32 pages run in C++ kernels
               instead (cpu_kernels, when built): the fast path on CPU;
  "reference"  the plain-jnp test oracle in reference.py (the whole context at once), loaded
               only when this backend is asked for.
Default on a GPU: what the installed jax offers there. "pallas" while the Triton lowering is
there and works (it is deprecated upstream since jax 0.11; the Mosaic kernels have not run on
hardware yet): present, and a one-block decode kernel compiles on this GPU (`triton_unusable_reason`,
probed once per process); else "mosaic" on a Hopper GPU (compute capability 9.x) with Mosaic GPU,
else "xla"; "xla" off a GPU. A backend named explicitly wins (jaxserve passes
EngineConfig.attention_backend, else $JAXSERVE_ATTENTION_BACKEND:
jaxserve.executor.device_setup.attention_backend).

Grouped matmul (the routed experts of a mixture-of-experts layer, `grouped_matmul`):
  "xla"         the default: plain XLA. Lowered for the CPU, a loop over the work items in use
                (xla_grouped.py: only the groups with rows are read; jax's own CPU lowering of
                ragged_dot reads every group's matrix and does G times the FLOPs: a 1-row decode
                step of a 16-expert model 13-35x slower, bench/RESULTS.md); for any other platform
                jax.lax.ragged_dot (XLA's GPU lowering). The Pallas kernel is not the GPU
                default: it has not been measured against ragged_dot on a GPU yet;
  "ragged_dot"  jax.lax.ragged_dot on every platform (to compare);
  "pallas"      the Pallas kernel (grouped_matmul.py) when the program is lowered for a CUDA GPU,
                "xla" on any other platform;
  "interpret"   the Pallas kernel in interpret mode (runs anywhere, slowly: for tests).
Chosen by $JAXSERVE_GROUPED_MATMUL_BACKEND, read when the model is traced (a jitted step keeps
the choice it was traced with).

Multi-LoRA update (`lora_update`: each row through its own adapter's low-rank matrices), by the
attention backend's name, when the program is lowered for a CUDA GPU: "mosaic" runs the Mosaic GPU
kernel (mosaic_lora.py: 16-bit operands, ranks 16-128, jax >= 0.11) where it takes the operands,
else the Triton kernel (lora_bgmv.py) while this jax has that lowering, else the XLA path
(xla_lora.py); "pallas" runs the Triton kernel where it takes them, else the XLA path. Lowered for
any other platform both run the XLA path. "interpret" runs the Triton kernel in interpret mode and
"mosaic_interpret" the Mosaic kernel in Mosaic GPU's interpreter (operands they do not take: the
XLA path); "reference" the plain-jnp oracle; every other backend the XLA path. Lowered for the
CPU, the XLA path is the C++ kernel (cpu_kernels.lora_update: each row through its own slot only)
for float32 operands when the kernels are built, xla_lora's dense form otherwise.

Attention options (the same on every backend, see pallas_kernels.common): sliding_window, an
int32 scalar operand (<= 0: no window) or None; scale and logit_soft_cap, static floats or None.
"""

import functools

import jax
import jax.numpy as jnp

import cpu_kernels
from pallas_kernels import compat, kv_quant, mosaic_common, mosaic_decode, mosaic_ragged, paged_decode, ragged_prefill
from pallas_kernels import lora_bgmv, mosaic_lora, xla_grouped, xla_lora, xla_paged
from pallas_kernels import grouped_matmul as grouped_matmul_kernel
from pallas_kernels.common import softmax_scale

BACKENDS = ("pallas", "interpret", "mosaic", "mosaic_interpret", "xla", "reference")
BACKEND_ALIASES = {"triton": "pallas"}
MOSAIC_BACKENDS = ("mosaic", "mosaic_interpret")
GROUPED_MATMUL_BACKENDS = ("xla", "ragged_dot", "pallas", "interpret")


def attention_backend(choice: str | None = None) -> str:
    """Backend name to use: `choice` (any case), else by platform. ValueError for an unknown name."""
    if choice:
        choice = choice.strip().lower()
        choice = BACKEND_ALIASES.get(choice, choice)
        if choice not in BACKENDS:
            raise ValueError(f"unknown attention backend {choice!r}; expected one of "
                             f"{BACKENDS + tuple(BACKEND_ALIASES)}")
        return choice
    if on_gpu():
        if triton_unusable_reason() is None:
            return "pallas"
        if compat.has_mosaic_gpu() and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9"):
            return "mosaic"
    return "xla"


def on_gpu() -> bool:
    """Whether jax's default backend is a GPU."""
    return jax.default_backend() in ("gpu", "cuda", "rocm")


@functools.cache
def triton_unusable_reason() -> str | None:
    """Why the Triton kernels cannot be this machine's default, None when they can: this jax ships
    no Pallas Triton lowering, or (on a GPU, checked once per process) the decode kernel does not
    compile there at a one-block shape (a Triton that jax can no longer drive, a missing compiler).
    Off a GPU only the first is asked: nothing there would compile them."""
    if not compat.has_pallas_triton():
        return f"jax {jax.__version__} has no Pallas Triton lowering"
    if not on_gpu():
        return None
    try:
        _compile_triton_probe()
    except Exception as error:  # whatever stops the kernel from compiling stops it from serving
        return f"the Triton decode kernel does not compile on {jax.devices()[0].device_kind}: " \
               f"{type(error).__name__}: {str(error)[:400]}"
    return None


def triton_probe_args() -> tuple:
    """The probe's operands: one sequence of 4 bfloat16 query heads over one KV head (head_dim
    64) and a table of one page of 16 keys."""
    bf16, i32 = jax.numpy.bfloat16, jax.numpy.int32
    pages = jax.ShapeDtypeStruct((2, 16, 1, 64), bf16)
    return (jax.ShapeDtypeStruct((1, 4, 64), bf16), pages, pages, jax.ShapeDtypeStruct((1, 1), i32),
            jax.ShapeDtypeStruct((1,), i32))


def _compile_triton_probe() -> None:
    """Compiles (does not run) the Triton decode kernel on triton_probe_args()."""
    with compat.quiet_pallas_deprecations():
        jax.jit(paged_decode.paged_decode_attention).lower(*triton_probe_args()).compile()


def unsupported_operands(backend: str, q, k_pages) -> str | None:
    """Why `backend` cannot take these operands (abstract or concrete arrays: q [.., heads, d],
    k_pages [pages, page_size, kv_heads, d] or a quantized cache), None when it can. Only the
    Mosaic kernels refuse some; the engine asks this before it builds a step."""
    if BACKEND_ALIASES.get(backend, backend) in MOSAIC_BACKENDS:
        return mosaic_common.unsupported(q, k_pages)
    return None


def cost_grows_with_table_width(backend: str, kv_dtype=None) -> bool:
    """Whether `backend`'s attention over pages of `kv_dtype` (None: the queries' float dtype)
    costs more for a wider block table than the contexts in it need, so that an engine should
    compile steps at several table widths. The Triton and Mosaic kernels walk only the pages a
    context has (their decode splits are cut from each sequence's length) and the XLA path loops
    over the longest context present; but the Mosaic kernels over int8 pages first gather the
    scales of the whole table (mosaic_common.sequence_scales), and the reference reads every page."""
    backend = BACKEND_ALIASES.get(backend, backend)
    if backend == "reference":
        return True
    return backend in MOSAIC_BACKENDS and kv_dtype is not None and jax.numpy.dtype(kv_dtype) == kv_quant.INT8


def _plain_module(backend: str):
    """The plain-XLA module of a non-Pallas backend; ValueError for an unknown backend."""
    if backend == "xla":
        return xla_paged
    if backend == "reference":
        from pallas_kernels import reference  # the test oracle: loaded only when asked for
        return reference
    raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")


def decode_attention(
    backend: str, q, k_pages, v_pages, block_table, seq_lens, *,
    sliding_window=None, scale: float | None = None, logit_soft_cap: float | None = None,
):
    """Paged attention of one query token per sequence through `backend` (a name of BACKENDS or
    BACKEND_ALIASES: "triton" and "mosaic" pick the two GPU kernel families).

    q: [num_seqs, num_q_heads, head_dim]; k_pages, v_pages: [num_pages, page_size, num_kv_heads,
    head_dim] (or quantized caches); block_table: int32[num_seqs, max_pages]; seq_lens:
    int32[num_seqs] (0: padding row). Returns [num_seqs, num_q_heads, head_dim] in q's dtype.
    """
    options = dict(sliding_window=sliding_window, scale=scale, logit_soft_cap=logit_soft_cap)
    backend = BACKEND_ALIASES.get(backend, backend)
    if backend in MOSAIC_BACKENDS:
        return mosaic_decode.paged_decode_attention(
            q, k_pages, v_pages, block_table, seq_lens, interpret=backend == "mosaic_interpret", **options)
    if backend in ("pallas", "interpret"):
        return paged_decode.paged_decode_attention(
            q, k_pages, v_pages, block_table, seq_lens, interpret=backend == "interpret", **options
        )
    if backend == "xla" and cpu_kernels.takes_decode_attention(q, k_pages, v_pages):
        # Lowered for the CPU: the C++ kernel (cpu_kernels); for any other platform: XLA's loop.
        window = -1 if sliding_window is None else sliding_window
        return jax.lax.platform_dependent(
            q, k_pages, v_pages, block_table, seq_lens, window,
            cpu=lambda *args: cpu_kernels.paged_decode_attention(
                *args[:5], window=args[5], scale=softmax_scale(scale, q.shape[-1]), soft_cap=logit_soft_cap),
            default=lambda *args: xla_paged.paged_decode_attention(*args[:5], **options))
    return _plain_module(backend).paged_decode_attention(
        q, k_pages, v_pages, block_table, seq_lens, **options
    )


def ragged_attention(
    backend: str, q, k_pages, v_pages, block_table, seq_lens, query_start_loc, *,
    sliding_window=None, scale: float | None = None, logit_soft_cap: float | None = None,
    max_query_len: int | None = None, key_limit=None, bf16_products: bool = False,
):
    """Causal paged attention of a ragged batch of query tokens through `backend`.

    q: [num_tokens, num_q_heads, head_dim]; the tokens of sequence i are
    q[query_start_loc[i]:query_start_loc[i+1]] (int32[num_seqs + 1]), the last tokens of its
    seq_lens[i]; other arguments as in decode_attention. Returns q's shape and dtype.
    max_query_len (static, optional): no sequence has more query tokens; the XLA path then
    works through the queries in chunks of that size (many short sequences, as in speculative
    verification, would otherwise each pay for a chunk of PREFILL_QUERY_CHUNK queries).
    key_limit (int32[num_tokens] or None): the highest key position each query token may see,
    for bidirectional attention among the tokens of an image (Gemma 3): a token of an image span
    [s, e) (positions in its sequence, the whole span in this step's chunk) gets e - 1, any other
    token its own position; a query at position p then sees the keys k <= max(p, key_limit) of its
    sequence, a sliding window still asking p - k < window. None (the default): causal, the same
    code and compiled programs as without the argument (it is passed to no backend).
    bf16_products: the CPU kernel's products in bfloat16 (cpu_kernels.ragged_prefill_attention),
    for a model whose prompt matmuls are in bfloat16 or int8; other backends ignore it.
    """
    options = dict(sliding_window=sliding_window, scale=scale, logit_soft_cap=logit_soft_cap)
    if key_limit is not None:
        options["key_limit"] = jnp.asarray(key_limit, jnp.int32)
    backend = BACKEND_ALIASES.get(backend, backend)
    if backend in MOSAIC_BACKENDS:
        return mosaic_ragged.ragged_paged_attention(
            q, k_pages, v_pages, block_table, seq_lens, query_start_loc,
            interpret=backend == "mosaic_interpret", **options)
    if backend in ("pallas", "interpret"):
        return ragged_prefill.ragged_paged_attention(
            q, k_pages, v_pages, block_table, seq_lens, query_start_loc,
            interpret=backend == "interpret", **options,
        )
    if backend == "xla" and max_query_len:
        options["query_chunk"] = min(xla_paged.PREFILL_QUERY_CHUNK, max_query_len)
    if backend == "xla" and cpu_kernels.takes_prefill_attention(q, k_pages, v_pages):
        # Lowered for the CPU: the C++ kernel (cpu_kernels); for any other platform: XLA's loops.
        window = -1 if sliding_window is None else sliding_window
        limits = () if key_limit is None else (options.pop("key_limit"),)  # operands only when given
        return jax.lax.platform_dependent(
            q, k_pages, v_pages, block_table, seq_lens, query_start_loc, window, *limits,
            cpu=lambda *args: cpu_kernels.ragged_prefill_attention(
                *args[:6], window=args[6], scale=softmax_scale(scale, q.shape[-1]), soft_cap=logit_soft_cap,
                bf16_products=bf16_products, **({"key_limit": args[7]} if limits else {})),
            default=lambda *args: xla_paged.ragged_paged_attention(
                *args[:6], **options, **({"key_limit": args[7]} if limits else {})))
    return _plain_module(backend).ragged_paged_attention(
        q, k_pages, v_pages, block_table, seq_lens, query_start_loc, **options
    )


def write_kv(k_pages, v_pages, k, v, slot_mapping):
    """Scatters new K/V rows into their slots; in place under jit with donated pages.

    k, v: [num_tokens, num_kv_heads, head_dim]; slot_mapping: int32[num_tokens] holding
    page * page_size + offset (padding tokens point into page 0).
    Returns (k_pages, v_pages) with the same shapes and dtypes (quantized caches quantize the rows).
    """
    return kv_quant.write_rows(k_pages, k, slot_mapping), kv_quant.write_rows(v_pages, v, slot_mapping)


def grouped_matmul_backend(choice: str | None = None) -> str:
    """Grouped-matmul backend to use: `choice` (any case; the engine passes
    $JAXSERVE_GROUPED_MATMUL_BACKEND, jaxserve.environment), else "xla". ValueError for an unknown name."""
    choice = (choice or "xla").strip().lower()
    if choice not in GROUPED_MATMUL_BACKENDS:
        raise ValueError(f"unknown grouped matmul backend {choice!r} ($JAXSERVE_GROUPED_MATMUL_BACKEND or the "
                         f"caller); expected one of {GROUPED_MATMUL_BACKENDS}")
    return choice


def grouped_matmul(lhs, rhs, group_sizes, backend: str | None = None, *, product=None, dense=None):
    """jax.lax.ragged_dot(lhs, rhs, group_sizes) through `backend` (see the module docstring).

    lhs [M, K] with its rows sorted by group; rhs [G, K, N]; group_sizes int32[G] summing to at
    most M. Returns [M, N] in lhs's dtype; rows past sum(group_sizes) are zero. Operands the
    kernel does not take (pallas_kernels.grouped_matmul.supports) go to the "xla" path.

    `rhs` may also be a pytree that stands for the [G, K, N] matrices (a quantized weight: every
    leaf with the leading G axis), given with `product(rows [m, K], rhs_g) -> [m, N]`, the rows
    times group g's matrix (rhs_g: every leaf indexed at g), and `dense(rhs) -> [G, K, N]`, its
    float matrices. The CPU's work-item loop calls `product` per item, so it reads only the groups
    in use, each at its stored size; every other backend multiplies `dense(rhs)`.
    """
    backend = grouped_matmul_backend(backend)
    if product is not None:
        matrices = lambda: dense(rhs)  # noqa: E731  only where a branch needs the float matrices
        cpu = lambda: xla_grouped.grouped_matmul(lhs, rhs, group_sizes, product=product)  # noqa: E731
        if backend == "ragged_dot":
            return jax.lax.ragged_dot(lhs, matrices(), group_sizes)
        if backend == "interpret":
            return grouped_matmul(lhs, matrices(), group_sizes, backend)
        gpu = lambda: grouped_matmul(lhs, matrices(), group_sizes, backend)  # noqa: E731
        return jax.lax.platform_dependent(cpu=cpu, default=gpu)
    if backend == "ragged_dot":
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)
    takes = grouped_matmul_kernel.supports(lhs, rhs)
    if backend == "interpret" and takes:
        return grouped_matmul_kernel.grouped_matmul(lhs, rhs, group_sizes, interpret=True)
    branches = dict(cpu=xla_grouped.grouped_matmul, default=jax.lax.ragged_dot)
    if backend == "pallas" and takes:
        branches["cuda"] = grouped_matmul_kernel.grouped_matmul  # the Triton kernel lowers for CUDA only
    return jax.lax.platform_dependent(lhs, rhs, group_sizes, **branches)


def lora_update(backend: str, x, a, b, slots, layer=None):
    """The low-rank updates of rows that each carry their adapter's slot, through `backend`'s
    implementation (see the module docstring): y[t] = (x[t] @ a[slots[t]]) @ b[slots[t]].

    x [T, K]; a [S, K, R], b [S, R, N] (slot 0: the zero adapter); slots int32[T] in [0, S).
    With `layer` (an int32 scalar), a and b are stacked on a leading layer axis ([L, S, ...]) and
    that layer's slices are used (the C++ kernel and the Mosaic kernel read them in place; the
    others slice them).
    Returns [T, N] in x's dtype (float32 accumulation)."""
    backend = BACKEND_ALIASES.get(backend, backend)
    if layer is None:  # one layer: a stack of one
        a, b, layer = a[None], b[None], 0
    layer = jnp.asarray(layer, jnp.int32)  # a, b: [L, S, K, R], [L, S, R, N]

    def at_layer(update):  # update(x, a [S, K, R], b [S, R, N], slots) on the layer's slices
        return lambda x, a, b, slots, layer: update(
            x, *(jax.lax.dynamic_index_in_dim(t, layer, keepdims=False) for t in (a, b)), slots)

    if backend == "reference":
        from pallas_kernels import reference  # the test oracle: loaded only when asked for
        return at_layer(reference.lora_update)(x, a, b, slots, layer)
    layer_a, layer_b = (jax.ShapeDtypeStruct(t.shape[1:], t.dtype) for t in (a, b))
    takes = lora_bgmv.supports(x, layer_a, layer_b)
    mosaic_takes = backend in MOSAIC_BACKENDS and compat.has_mosaic_gpu() and mosaic_lora.supports(
        x, layer_a, layer_b)
    if backend == "interpret" and takes:
        return at_layer(functools.partial(lora_bgmv.lora_update, interpret=True))(x, a, b, slots, layer)
    if backend == "mosaic_interpret" and mosaic_takes:
        return mosaic_lora.lora_update(x, a, b, slots, layer, interpret=True)
    branches = dict(cpu=at_layer(xla_lora.lora_update), default=at_layer(xla_lora.lora_update))
    if backend == "mosaic" and mosaic_takes:
        branches["cuda"] = mosaic_lora.lora_update  # Hopper only, as the Mosaic attention kernels
    elif backend in ("pallas", "mosaic") and takes and compat.has_pallas_triton():
        branches["cuda"] = at_layer(lora_bgmv.lora_update)  # the Triton lowering lowers for CUDA only
    if cpu_kernels.takes_lora_update(x, a, b):
        branches["cpu"] = cpu_kernels.lora_update  # the layer's slices read in place
    return jax.lax.platform_dependent(x, a, b, slots, layer, **branches)

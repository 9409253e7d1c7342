"""Batched sampling on device: penalties, temperature, top-k / top-p / min-p, seeded draws, logprobs.

`build_sampling_inputs` (host, numpy) packs per-row parameters into fixed-shape arrays; `sample`
runs inside the engine's jitted step. Semantics follow vLLM: repetition penalty over prompt +
output tokens (positive logits divided, negative multiplied), then frequency and presence
penalties over output tokens; temperature < GREEDY_TEMPERATURE is the first argmax of the
penalized logits; otherwise a draw from softmax(penalized / temperature) cut by top_k, then
top_p (smallest set of the top-k distribution with mass >= top_p), then min_p (probability >=
min_p * max probability). Cuts are value thresholds: tokens tied with the last kept one stay.
Logprobs are of the raw model distribution (before penalties and temperature), as vLLM's default.

Nothing sorts the vocabulary, and every result is exact: argmax and the draw (Gumbel-max: a
block by its mass, then a token in it) take about one pass; top_k / top_p read the
NUM_CANDIDATES largest values, and only rows whose cut lies beyond them run an exact 32-step
bisection over the row. Stages no row needs are skipped under `lax.cond`; a row's result never
depends on the other rows, and its random key only on (seed, step).

Penalties need each row's token history, two `[rows, history_len]` arrays. They exist only in
the inputs of a step where some row has a penalty, and their presence is static (the inputs'
structure): the common step without penalties neither builds nor transfers them, and runs a
compiled variant without the penalty stage.

Logit biases work the same way: `bias_ids` / `bias_values` (`[rows, bias_width]`, a row's
`logit_bias` entries, plus its EOS and stop tokens at -inf while it has fewer than `min_tokens`
output tokens) exist only in a step where some row has one, and are added to the logits first
(before the penalties, as vLLM's logits processors). A step without them runs a variant without
that stage.

Structured output: `token_bitmask` (int32[rows, ceil(vocab / 32)], one bit per token) is always
present in the engine's inputs, all ones except on the rows of requests with a grammar, whose
allowed tokens the runner writes in; the sampler sets the other tokens to -inf before drawing (the
greedy pick included), a stage skipped at run time (`lax.cond`) when every bit is set. So one
compiled variant serves steps with and without grammar rows. Logprobs stay those of the raw
logits, as without a grammar.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.request import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS
from jaxserve.core.step import RowParams

# The sampler's logit-bias stage runs in every step (a row without entries pads it): it costs
# under 0.1 ms per call at 1-8 rows beside a ~20 ms SmolLM2 decode step (bench/sampler_variants.py),
# and so each row count compiles two sampler variants (with and without penalties), not four.
ALWAYS_BIAS = True

GREEDY_TEMPERATURE = 1e-5
NUM_CANDIDATES = 64
_CANDIDATE_BLOCK = 16
_SAMPLE_BLOCK = 256
_LOGPROB_BLOCK = 64
_MASK64 = (1 << 64) - 1
_NO_BIAS_ID = np.iinfo(np.int32).max  # padding of bias_ids: out of range, dropped by the scatter
_ROW_FIELDS = (  # SamplingParams field, dtype, value of padding rows
    ("temperature", np.float32, 0.0), ("top_k", np.int32, 0), ("top_p", np.float32, 1.0),
    ("min_p", np.float32, 0.0), ("repetition_penalty", np.float32, 1.0),
    ("presence_penalty", np.float32, 0.0), ("frequency_penalty", np.float32, 0.0))


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def row_key_data(seed: int, step: int) -> tuple[int, int]:
    """Raw threefry key words of one draw; a function of (seed, step) only."""
    mixed = _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))
    return mixed >> 32, mixed & 0xFFFFFFFF


class RowInputError(ValueError):
    """Packing one row's parameters failed; `row_index` says which (the caller knows its request)."""

    def __init__(self, row_index: int, message: str) -> None:
        super().__init__(f"row {row_index}: {message}")
        self.row_index = row_index


def bias_width(num_eos_token_ids: int) -> int:
    """Columns of `bias_ids` / `bias_values`: what admission lets one row need (its logit_bias,
    and while min_tokens holds, its stop token ids and the engine's EOS ids)."""
    return MAX_LOGIT_BIAS + MAX_STOP_TOKEN_IDS + num_eos_token_ids


def bias_entries(row: RowParams, eos_token_ids=()) -> list[tuple[int, float]]:
    """(token id, added logit) of one row this step: its logit_bias, and -inf on its stop tokens
    (EOS unless ignore_eos, and stop_token_ids) while it has fewer than min_tokens outputs."""
    params = row.params
    entries = list((params.logit_bias or {}).items())
    if row.step < params.min_tokens:
        masked = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        entries += [(token_id, -np.inf) for token_id in sorted(masked)]
    return entries


def build_sampling_inputs(rows: list[RowParams | None], num_rows: int, history_len: int,
                          penalties: bool | None = None, bias: bool | None = None,
                          eos_token_ids=(), vocab_size: int | None = None) -> dict[str, np.ndarray]:
    """Pack per-row parameters into fixed-shape arrays; None rows (and rows past len(rows)) pad.

    The values were checked at admission (`request.check_request`); should one still not fit its
    array, RowInputError names the row, so only its request fails.
    The token histories `prompt_ids` / `output_ids` (int32[num_rows, history_len], -1 padded) are
    included when `penalties` is True, or when it is None and some row has a penalty; only rows
    with a penalty fill theirs (nothing reads the others).
    `num_logprobs` is -1 where the row wants no logprobs.
    The logit biases `bias_ids` / `bias_values` (`[num_rows, bias_width(len(eos_token_ids))]`)
    are included likewise: when `bias` is True, or when it is None and some row has an entry
    (`bias_entries`, which masks `eos_token_ids` for rows short of min_tokens).
    With `vocab_size`, `token_bitmask` (int32[num_rows, ceil(vocab_size / 32)]) allows every
    token; the runner writes the allowed tokens of each structured-output row into it.
    """
    if len(rows) > num_rows:
        raise ValueError(f"{len(rows)} rows do not fit in num_rows={num_rows}")
    entries = [[] if row is None else bias_entries(row, eos_token_ids) for row in rows]
    any_bias = any(entries)
    if bias is None:
        bias = any_bias
    elif any_bias and not bias:
        raise ValueError("a row has a logit bias or min_tokens: its inputs need the bias arrays (bias=True)")
    any_penalties = any(row is not None and row.has_penalties for row in rows)
    if penalties is None:
        penalties = any_penalties
    elif any_penalties and not penalties:
        raise ValueError("a row has a penalty: its inputs need the token histories (penalties=True)")
    inputs = {name: np.full(num_rows, padding, dtype) for name, dtype, padding in _ROW_FIELDS}  # [num_rows]
    inputs["keys"] = np.zeros((num_rows, 2), np.uint32)  # [num_rows, 2]: threefry key words
    inputs["num_logprobs"] = np.full(num_rows, -1, np.int32)  # [num_rows]
    if penalties:
        inputs["prompt_ids"] = np.full((num_rows, history_len), -1, np.int32)  # [num_rows, history_len]
        inputs["output_ids"] = np.full((num_rows, history_len), -1, np.int32)  # [num_rows, history_len]
    if bias:
        width = bias_width(len(eos_token_ids))
        inputs["bias_ids"] = np.full((num_rows, width), _NO_BIAS_ID, np.int32)  # [num_rows, width]
        inputs["bias_values"] = np.zeros((num_rows, width), np.float32)  # [num_rows, width]
    if vocab_size is not None:  # every token allowed; the runner fills the rows of grammar requests
        inputs["token_bitmask"] = np.full((num_rows, -(-vocab_size // 32)), -1, np.int32)  # [num_rows, words]
    for row_index, row in enumerate(rows):
        if row is not None:
            try:
                _pack_row(inputs, row_index, row, history_len)
                if entries[row_index]:
                    _pack_bias(inputs, row_index, entries[row_index])
            except (ValueError, TypeError, OverflowError) as e:
                raise RowInputError(row_index, f"{type(e).__name__}: {e}") from e
    return inputs


def has_histories(inputs: dict) -> bool:
    """Whether sampling inputs carry token histories (static: the compiled variant with penalties)."""
    return "output_ids" in inputs


def has_bias(inputs: dict) -> bool:
    """Whether sampling inputs carry logit biases (static: the compiled variant with the bias stage)."""
    return "bias_ids" in inputs


def _pack_bias(inputs: dict[str, np.ndarray], row_index: int, entries: list[tuple[int, float]]) -> None:
    width = inputs["bias_ids"].shape[1]
    if len(entries) > width:
        raise ValueError(f"{len(entries)} logit bias entries exceed bias_width={width}")
    ids, values = zip(*entries)
    inputs["bias_ids"][row_index, :len(entries)] = ids
    inputs["bias_values"][row_index, :len(entries)] = values


def _pack_row(inputs: dict[str, np.ndarray], row_index: int, row: RowParams, history_len: int) -> None:
    params = row.params
    for name, _, _ in _ROW_FIELDS:
        inputs[name][row_index] = getattr(params, name)
    inputs["top_k"][row_index] = max(params.top_k, 0)
    inputs["keys"][row_index] = row_key_data(row.seed, row.step)
    if params.logprobs is not None:
        inputs["num_logprobs"][row_index] = params.logprobs
    if row.has_penalties:
        for name, token_ids in (("prompt_ids", row.prompt_token_ids), ("output_ids", row.output_token_ids)):
            if len(token_ids) > history_len:
                raise ValueError(f"{len(token_ids)} {name} exceed history_len={history_len}")
            inputs[name][row_index, :len(token_ids)] = token_ids


def _blocked(x, block):
    """[rows, vocab] -> [rows, num_blocks, block], padding the vocab with -inf."""
    num_rows, vocab = x.shape
    padded = -(-vocab // block) * block
    if padded != vocab:
        x = jnp.pad(x, ((0, 0), (0, padded - vocab)), constant_values=-jnp.inf)
    return x.reshape(num_rows, padded // block, block)


def _argmax(x):
    """First index of the row maximum, via block maxima (cheaper than argmax on XLA:CPU)."""
    blocks = _blocked(x, _SAMPLE_BLOCK)  # [rows, num_blocks, block]
    best_block = jnp.argmax(jnp.max(blocks, -1), -1)  # [rows]
    inside = jnp.take_along_axis(blocks, best_block[:, None, None], 1)[:, 0]  # [rows, block]
    return (best_block * _SAMPLE_BLOCK + jnp.argmax(inside, -1)).astype(jnp.int32)


def _top_k(x, k, block):
    """Exact (values, ids) of the k largest per row, sorted; searches only the k best blocks."""
    num_rows = x.shape[0]
    blocks = _blocked(x, block)  # [rows, num_blocks, block]
    if 2 * k > blocks.shape[1]:
        values, ids = jax.lax.top_k(x, k)
        return values, ids.astype(jnp.int32)
    _, top_blocks = jax.lax.top_k(jnp.max(blocks, -1), k)  # [rows, k]
    gathered = jnp.take_along_axis(blocks, top_blocks[:, :, None], 1)  # [rows, k, block]
    values, positions = jax.lax.top_k(gathered.reshape(num_rows, k * block), k)
    block_ids = jnp.take_along_axis(top_blocks, positions // block, 1)
    return values, (block_ids * block + positions % block).astype(jnp.int32)


def _ordered_key(x):
    """float32 -> int32 with the same order (for exact bisection over values)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _from_ordered_key(key):
    bits = jnp.where(key < 0, key ^ 0x7FFFFFFF, key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _bisect_threshold(values, weights, target):
    """Largest value t per row with sum(weights[values >= t]) >= target (-inf if none).

    Exact: bisects the int32 image of float32 order, one comparison pass per bit.
    weights None counts tokens.
    """
    low = jnp.full(values.shape[:1], _ordered_key(jnp.float32(-jnp.inf)))  # [rows]
    high = _ordered_key(jnp.max(values, -1)) + 1

    def halve(_, bounds):
        low, high = bounds
        middle = (low >> 1) + (high >> 1) + (low & high & 1)
        above = values >= _from_ordered_key(middle)[:, None]
        if weights is None:
            reached = jnp.sum(above, -1, dtype=jnp.float32)
        else:
            reached = jnp.sum(jnp.where(above, weights, 0.0), -1)
        reaches = reached >= target
        return jnp.where(reaches, middle, low), jnp.where(reaches, high, middle)

    low, _ = jax.lax.fori_loop(0, 32, halve, (low, high))
    return _from_ordered_key(low)


def apply_penalties(logits, inputs):
    """Repetition, frequency and presence penalties. [rows, vocab] -> [rows, vocab]."""
    num_rows, vocab = logits.shape

    def flat_ids(history):  # [rows, history] -> [rows * history] into [rows * (vocab + 1)]
        ids = jnp.where((history < 0) | (history >= vocab), vocab, history)
        return (ids + jnp.arange(num_rows)[:, None] * (vocab + 1)).reshape(-1)

    def per_row(flat):  # [rows * (vocab + 1)] -> [rows, vocab]
        return flat.reshape(num_rows, vocab + 1)[:, :vocab]

    size = num_rows * (vocab + 1)
    output_counts = per_row(jnp.zeros(size, jnp.float32).at[flat_ids(inputs["output_ids"])].add(1.0))
    in_prompt = per_row(jnp.zeros(size, jnp.bool_).at[flat_ids(inputs["prompt_ids"])].set(True))
    seen = in_prompt | (output_counts > 0)
    repetition = inputs["repetition_penalty"][:, None]
    penalized = jnp.where(logits > 0, logits / repetition, logits * repetition)
    logits = jnp.where(seen, penalized, logits)
    logits = logits - inputs["frequency_penalty"][:, None] * output_counts
    return logits - inputs["presence_penalty"][:, None] * (output_counts > 0)


def apply_bias(logits, inputs):
    """Adds each row's bias entries to its logits (padding ids fall outside and are dropped)."""
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, inputs["bias_ids"]].add(inputs["bias_values"], mode="drop")


def _penalized_logits(logits, inputs):
    """Logit biases, then penalties, where the inputs carry them (identity for rows without)."""
    if has_bias(inputs):
        logits = apply_bias(logits, inputs)
    return apply_penalties(logits, inputs) if has_histories(inputs) else logits


def apply_token_bitmask(logits, bitmask):
    """-inf where a row's bitmask (int32[rows, words]; bit t % 32 of word t // 32: token t) is 0."""
    num_rows, vocab = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [rows, words, 32]
    allowed = bits.reshape(num_rows, -1)[:, :vocab] != 0
    return jnp.where(allowed, logits, -jnp.inf)


def _allowed_logits(logits, inputs):
    """Structured output: the grammar rows' bitmasks applied, skipped when every bit is set (no
    row of the step has a grammar)."""
    if "token_bitmask" not in inputs:
        return logits
    bitmask = inputs["token_bitmask"]
    return jax.lax.cond(jnp.any(bitmask != -1), lambda: apply_token_bitmask(logits, bitmask), lambda: logits)


def _is_sampling(inputs):
    return inputs["temperature"] >= GREEDY_TEMPERATURE


def _scaled_logits(penalized, inputs):
    temperature = jnp.where(_is_sampling(inputs), inputs["temperature"], 1.0)
    return penalized / temperature[:, None]


def _exact_where_needed(needs_search, cut, search):
    """Replace `cut` by the exact `search()` on the rows that need it; skipped if none does."""
    return jax.lax.cond(jnp.any(needs_search),
                        lambda: jnp.where(needs_search, search(), cut), lambda: cut)


def _top_k_top_p_cut(scaled, inputs, is_sampling):
    """Per-row value cut of top_k then top_p (-inf where off). [rows, vocab] -> [rows]."""
    vocab = scaled.shape[1]
    top_k, top_p = inputs["top_k"], inputs["top_p"]
    candidates, _ = _top_k(scaled, min(NUM_CANDIDATES, vocab), _CANDIDATE_BLOCK)  # [rows, C]
    num_candidates = candidates.shape[1]
    k_on = (top_k > 0) & (top_k < vocab)
    k_in_candidates = k_on & (top_k <= num_candidates)
    kth = jnp.take_along_axis(candidates, jnp.clip(top_k - 1, 0, num_candidates - 1)[:, None], 1)
    k_cut = _exact_where_needed(
        is_sampling & k_on & ~k_in_candidates, jnp.where(k_in_candidates, kth[:, 0], -jnp.inf),
        lambda: _bisect_threshold(scaled, None, top_k.astype(jnp.float32)))

    # Materialize the per-row values: XLA:CPU would otherwise redo their gathers per element.
    k_cut, candidates = jax.lax.optimization_barrier((k_cut, candidates))
    row_max = candidates[:, :1]
    kept = scaled >= k_cut[:, None]  # [rows, vocab]
    log_mass = row_max + jnp.log(jnp.sum(jnp.where(kept, jnp.exp(scaled - row_max), 0.0), -1,
                                         keepdims=True))  # [rows, 1]
    candidate_probs = jnp.where(candidates >= k_cut[:, None], jnp.exp(candidates - log_mass), 0.0)
    mass_before = jnp.cumsum(candidate_probs, -1) - candidate_probs  # [rows, C]
    in_nucleus = (mass_before < top_p[:, None]) & (candidate_probs > 0)
    p_on = top_p < 1.0
    p_cut = jnp.where(p_on, jnp.min(jnp.where(in_nucleus, candidates, jnp.inf), -1), -jnp.inf)
    fits = k_in_candidates | (jnp.sum(candidate_probs, -1) >= top_p)
    p_cut = _exact_where_needed(
        is_sampling & p_on & ~fits, p_cut,
        lambda: _bisect_threshold(scaled, jnp.where(kept, jnp.exp(scaled - log_mass), 0.0), top_p))
    return jnp.maximum(k_cut, p_cut)


def _keep_threshold(scaled, inputs, is_sampling):
    """Per-row smallest kept scaled logit; never above the row maximum. [rows]."""
    truncates = is_sampling & (((inputs["top_k"] > 0) & (inputs["top_k"] < scaled.shape[1]))
                               | (inputs["top_p"] < 1.0))
    cut = jax.lax.cond(jnp.any(truncates), lambda: _top_k_top_p_cut(scaled, inputs, is_sampling),
                       lambda: jnp.full(scaled.shape[:1], -jnp.inf))
    row_max = jnp.max(scaled, -1)
    min_p_cut = row_max + jnp.log(inputs["min_p"])  # -inf where min_p == 0
    return jnp.minimum(jnp.maximum(cut, min_p_cut), row_max)


def allowed_tokens(logits, inputs):
    """bool[rows, vocab]: tokens a sampling row may draw after penalties and truncation."""
    scaled = _scaled_logits(_penalized_logits(logits, inputs), inputs)
    return scaled >= _keep_threshold(scaled, inputs, _is_sampling(inputs))[:, None]


def _categorical(masked, keys):
    """One draw per row from softmax(masked): a block by its mass, then a token inside it."""
    blocks = _blocked(masked - jnp.max(masked, -1, keepdims=True), _SAMPLE_BLOCK)
    num_blocks = blocks.shape[1]
    block_log_mass = jnp.log(jnp.sum(jnp.exp(blocks), -1))  # [rows, num_blocks]
    gumbel = jax.vmap(lambda key: jax.random.gumbel(
        jax.random.wrap_key_data(key, impl="threefry2x32"), (num_blocks + _SAMPLE_BLOCK,)))(keys)
    block = jnp.argmax(block_log_mass + gumbel[:, :num_blocks], -1)  # [rows]
    inside = jnp.take_along_axis(blocks, block[:, None, None], 1)[:, 0]  # [rows, block]
    return (block * _SAMPLE_BLOCK + jnp.argmax(inside + gumbel[:, num_blocks:], -1)).astype(jnp.int32)


def _draw(penalized, inputs, is_sampling):
    scaled = _scaled_logits(penalized, inputs)
    threshold = _keep_threshold(scaled, inputs, is_sampling)
    masked = jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)
    return _categorical(masked, inputs["keys"])


def _logprobs(logits, token_ids, max_logprobs):
    log_normalizer = jax.nn.logsumexp(logits, -1)  # [rows]
    chosen = jnp.take_along_axis(logits, token_ids[:, None], 1)[:, 0] - log_normalizer
    if max_logprobs == 0:
        return chosen, jnp.zeros((logits.shape[0], 0), jnp.int32), jnp.zeros((logits.shape[0], 0))
    top_values, top_ids = _top_k(logits, max_logprobs, _LOGPROB_BLOCK)
    return chosen, top_ids, top_values - log_normalizer[:, None]


def sample(logits, inputs: dict[str, jax.Array], *, max_logprobs: int) -> dict[str, jax.Array]:
    """Sample one token per row. Pure and jit-able; `max_logprobs` is static.

    logits: float32[rows, vocab]; inputs: the arrays of `build_sampling_inputs` (the bias and
    penalty stages are compiled in only when they carry biases and token histories).
    Returns token_ids i32[rows]; logprobs f32[rows] (raw log_softmax of the sampled token);
    top_ids i32[rows, max_logprobs] and top_logprobs f32[rows, max_logprobs] (raw, best first).
    The logprob outputs are zeros when no row of the batch has num_logprobs >= 0.
    """
    num_rows, vocab = logits.shape
    if not 0 <= max_logprobs <= vocab:
        raise ValueError(f"max_logprobs={max_logprobs} must be in [0, vocab={vocab}]")
    logits = logits.astype(jnp.float32)
    penalized = _allowed_logits(_penalized_logits(logits, inputs), inputs)
    is_sampling = _is_sampling(inputs)
    greedy_ids = _argmax(penalized)
    token_ids = jax.lax.cond(
        jnp.any(is_sampling),
        lambda: jnp.where(is_sampling, _draw(penalized, inputs, is_sampling), greedy_ids),
        lambda: greedy_ids)
    logprobs, top_ids, top_logprobs = jax.lax.cond(
        jnp.any(inputs["num_logprobs"] >= 0),
        lambda: _logprobs(logits, token_ids, max_logprobs),
        lambda: (jnp.zeros(num_rows, jnp.float32), jnp.zeros((num_rows, max_logprobs), jnp.int32),
                 jnp.zeros((num_rows, max_logprobs), jnp.float32)))
    return {"token_ids": token_ids, "logprobs": logprobs, "top_ids": top_ids,
            "top_logprobs": top_logprobs}

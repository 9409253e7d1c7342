"""Structured output: grammars that constrain what a request may generate (no jax).

A request's `SamplingParams.structured_output` names one constraint: a JSON schema (OpenAI's
`response_format` `json_schema`, vLLM's `guided_json`), any JSON object (`json_object`), a regular
expression (`guided_regex`), a choice of strings (`guided_choice`) or a Lark / GBNF grammar
(`guided_grammar`). The grammar library is llguidance: its wheel has no dependencies (3 MB, one
abi3 build for every Python), where xgrammar's needs torch and triton at run time; its per-token
mask costs are in bench/structured_output.py and bench/RESULTS.md.

The life of a constraint:
- admission: `check_structured_output` checks its shape (`request.check_sampling_params` calls it);
  `GrammarCompiler.compile` compiles it against the model's tokenizer (a bad schema, regex or
  grammar is an InvalidRequestError naming the client's field). The server compiles in its thread
  pool, before the engine admits the request, and the compiled grammar rides on the params.
- regexes (`guided_regex`, schema patterns) read `\\d` as [0-9]; JSON is written as json.dumps
  does (", " and ": ", no other whitespace; a schema may override it with llguidance's "x-guidance").
- each request (each of n choices) gets its own `GrammarState`, a copy of the compiled matcher.
- each step, the runner writes the state's allowed tokens into the row's bitmask (`fill_bitmasks`),
  which the jitted sampler applies; the engine then advances the state with the sampled token.
  The state depends only on the output tokens, so it survives preemption and recompute untouched.
- the grammar allows EOS only where its output is complete, so a request that reaches max_tokens
  first ends with finish_reason "length", never with an incomplete output called complete.
"""
from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 65536  # a schema / regex / grammar's text; llguidance's parser limits bound the rest
MAX_CHOICES = 1024
# JSON as json.dumps writes it (", " and ": ", no other whitespace): a model cannot wander off
# into whitespace, and every output of a bounded schema ends. A schema may override this with
# llguidance's "x-guidance" key.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 256  # compiled grammars kept, keyed by their text (tools repeat the same schemas)


class StructuredOutputError(ValueError):
    """A constraint that cannot be used; `param` names the client's field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(eq=False)
class StructuredOutputParams:
    """One constraint on a request's output. `spec`: the JSON schema (a dict, or its JSON text)
    for "json_schema", None for "json_object", the pattern for "regex", the list of strings for
    "choice", the Lark or GBNF text for "grammar". `param` is the client's field, named in refusals.
    `compiled` is filled at admission (`GrammarCompiler.compile`) and shared by the n choices."""

    kind: str
    spec: Any = None
    param: str = "response_format"
    compiled: Any = dataclasses.field(default=None, repr=False)

    def key(self) -> str:
        """The constraint as text: what the compiled-grammar cache is keyed by."""
        spec = self.spec if isinstance(self.spec, str) else json.dumps(self.spec, sort_keys=True)
        return f"{self.kind}\0{spec}"


def check_structured_output(value: Any) -> None:
    """The shape of a constraint (what needs no tokenizer); StructuredOutputError naming the field."""
    if not isinstance(value, StructuredOutputParams):
        raise StructuredOutputError("structured_output must be a StructuredOutputParams", "structured_output")
    param, spec = value.param, value.spec
    if value.kind not in KINDS:
        raise StructuredOutputError(f"unknown structured output kind {value.kind!r} (one of {', '.join(KINDS)})",
                                    param)
    if value.kind == "json_schema":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError as e:
                raise StructuredOutputError(f"'{param}' is not valid JSON: {e}", param) from None
        if not isinstance(spec, (dict, bool)):
            raise StructuredOutputError(f"'{param}' must be a JSON schema (an object)", param)
        if len(json.dumps(spec)) > MAX_SPEC_CHARS:
            raise StructuredOutputError(f"'{param}' is longer than {MAX_SPEC_CHARS} characters", param)
    elif value.kind == "choice":
        if (not isinstance(spec, list) or not 1 <= len(spec) <= MAX_CHOICES
                or not all(isinstance(s, str) and s for s in spec)):
            raise StructuredOutputError(f"'{param}' must be a list of 1 to {MAX_CHOICES} non-empty strings", param)
        if sum(len(s) for s in spec) > MAX_SPEC_CHARS:
            raise StructuredOutputError(f"'{param}' is longer than {MAX_SPEC_CHARS} characters", param)
    elif value.kind in ("regex", "grammar"):
        if not isinstance(spec, str) or not spec:
            raise StructuredOutputError(f"'{param}' must be a non-empty string", param)
        if len(spec) > MAX_SPEC_CHARS:
            raise StructuredOutputError(f"'{param}' is longer than {MAX_SPEC_CHARS} characters", param)
    if any(_is_surrogate_text(s) for s in _strings(spec)):
        raise StructuredOutputError(f"'{param}' is not valid Unicode: it holds a lone surrogate", param)


def _strings(value: Any):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _is_surrogate_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _grammar_text(value: StructuredOutputParams) -> str:
    """The llguidance grammar of a constraint (its errors surface when a matcher is built)."""
    import llguidance
    kind, spec = value.kind, value.spec
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
    if kind == "regex":  # \d is [0-9] (as in JSON Schema's patterns), not every Unicode digit
        return llguidance.LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(spec, 'd')}/")
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in spec))
    return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF converted to Lark


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe (the server compiles in its pool).

    `vocab_size` is the model's (rows of its logits, possibly more than the tokenizer's tokens: the
    extra ids are never allowed); `eos_token_ids` are the tokens that end an output (allowed where
    the grammar is complete)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._executor = None

    @property
    def num_words(self) -> int:
        """int32 words of one row's bitmask."""
        return bitmask_words(self.vocab_size)

    def _tokenizer(self):
        with self._lock:  # built once (about 0.3 s for a 50k vocabulary), on first use
            if self._ll_tokenizer is None:
                import llguidance.hf
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None)
            return self._ll_tokenizer

    def compile(self, value: StructuredOutputParams) -> Any:
        """Compiles `value` (once: the result is kept in `value.compiled` and in a cache keyed by
        its text). Raises StructuredOutputError naming the client's field when it cannot be used."""
        if value.compiled is not None:
            return value.compiled
        import llguidance
        key = value.key()
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
        if compiled is None:
            try:
                grammar = _grammar_text(value)
            except (ValueError, TypeError) as e:
                raise StructuredOutputError(f"'{value.param}' cannot be used: {_first_line(e)}", value.param) from None
            limits = llguidance.LLParserLimits(verbose_errors=False)
            compiled = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0, limits=limits)
            if compiled.is_error():  # the matcher is built with the GIL released
                raise StructuredOutputError(f"'{value.param}' cannot be used: {_first_line(compiled.get_error())}",
                                            value.param)
            with self._lock:
                self._cache[key] = compiled
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        value.compiled = compiled
        return compiled

    def new_state(self, value: StructuredOutputParams) -> "GrammarState":
        """A fresh matcher state for one request (a copy of the compiled grammar: microseconds)."""
        return GrammarState(self.compile(value).deep_copy())

    def executor(self):
        """llguidance's thread pool for filling many rows' masks at once."""
        with self._lock:
            if self._executor is None:
                import llguidance
                self._executor = llguidance.LLExecutor(num_threads=2)
            return self._executor


def _first_line(error: Any) -> str:
    """llguidance's message on one line: its first lines (the grammar excerpt after them is left out)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()][:4]
    return " ".join(lines)[:500] or "invalid"


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


class GrammarState:
    """One request's position in its grammar. The runner reads it (`fill_bitmasks`); the engine
    advances it with each sampled token (`accept`)."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.executor = None  # set by the engine: the compiler's llguidance executor

    def accept(self, token_id: int) -> bool:
        """Advances past one sampled token; False (and `error` set) if the grammar does not allow it."""
        return bool(self.matcher.consume_token(int(token_id)))

    @property
    def error(self) -> str | None:
        return _first_line(self.matcher.get_error()) if self.matcher.is_error() else None

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Writes the allowed next tokens into `row` (int32[bitmask_words], bit t % 32 of word
        t // 32 set where token t is allowed)."""
        if row.dtype != np.int32 or not row.flags["C_CONTIGUOUS"]:
            raise ValueError("a bitmask row must be a contiguous int32 array")
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)


def fill_bitmasks(states: Sequence[tuple[int, GrammarState]], bitmask: np.ndarray) -> None:
    """Fills `bitmask[row]` for every (row, state): the allowed tokens of each row's next draw.
    Many rows are filled by llguidance's thread pool in one call (the GIL released)."""
    if not states:
        return
    if bitmask.dtype != np.int32 or bitmask.ndim != 2 or not bitmask.flags["C_CONTIGUOUS"]:
        raise ValueError("the bitmask must be a contiguous int32 [rows, words] array")
    executor = states[0][1].executor
    if len(states) > 1 and executor is not None:
        try:
            executor.unsafe_compute_mask_ptr([(state.matcher, row) for row, state in states], bitmask.ctypes.data,
                                             bitmask.shape[1] * 4, bitmask.shape[0])
            return
        except Exception:  # row by row: only a row whose state fails is left out
            pass
    for row, state in states:
        try:
            state.fill_bitmask(bitmask[row])
        except Exception:  # nothing allowed: its draw is rejected by its grammar and that request fails alone
            bitmask[row] = 0

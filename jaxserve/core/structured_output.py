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

import copy
import dataclasses
import json
import threading
import urllib.parse
from collections import OrderedDict, deque
from typing import Any, Sequence

import numpy as np

from jaxserve.core import grammar_sandbox

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 65536  # a schema / regex / grammar's text; llguidance's parser limits bound the rest
MAX_CHOICES = 1024
CACHE_BYTES = 256 << 20  # compiled grammars kept (tools repeat the same schemas), by the memory each took
MAX_FAILED = 4096  # constraints remembered as unusable, refused again without compiling


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
        loop = reference_loop(spec)
        if loop is not None:
            raise StructuredOutputError(f"'{param}' describes no value: {loop}", param)
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


# Keywords whose values are JSON data, not schemas (a "$ref" key there is data).
_DATA_KEYWORDS = ("const", "enum", "default", "examples")


def reference_loop(schema: Any) -> str | None:
    """Why no value can match `schema` because of its references, or None: a subschema that
    refers to itself (through "$ref", "allOf", or every branch of an "anyOf" / "oneOf") before
    saying anything a value could be, e.g. {"$ref": "#"}. llguidance accepts some of these (one
    nested in a tool's arguments, say) and fails after the first tokens; some it refuses with its
    internal "NoExtensionBias". Local references only ("#" and "#/json/pointer", from the nearest
    enclosing "$id"); others are left to the grammar compiler. Linear in the schema's size."""
    nodes = _subschemas(schema)
    edges = {key: _schema_edges(node, base) for key, (node, base, _) in nodes.items()}
    # Productive subschemas (whose meaning does not run in a circle), as for a grammar's rules:
    # a subschema is productive once every subschema it requires is and one branch of each choice is.
    needed = {key: len(conj) + len(groups) for key, (conj, groups) in edges.items()}
    waiting: dict[int, list[tuple[int, int | None]]] = {}  # child -> (parent, its choice group or None)
    for key, (conj, groups) in edges.items():
        for child in conj:
            waiting.setdefault(child, []).append((key, None))
        for index, group in enumerate(groups):
            for child in group:
                waiting.setdefault(child, []).append((key, index))
    productive, chosen = set(), set()
    queue = deque(key for key, count in needed.items() if count == 0)
    while queue:
        key = queue.popleft()
        productive.add(key)
        for parent, group in waiting.get(key, ()):
            if group is not None:
                if (parent, group) in chosen:
                    continue
                chosen.add((parent, group))
            needed[parent] -= 1
            if needed[parent] == 0:
                queue.append(parent)
    for key, (node, _, pointer) in nodes.items():  # document order: the first one named
        if key not in productive:
            how = (f'"$ref": {json.dumps(node["$ref"])}' if "$ref" in node else
                   "through " + next(word for word in ("allOf", "anyOf", "oneOf") if word in node))
            return (f"the schema at '#{pointer}' refers back to itself ({how}) before saying what a value is, "
                    "so no output can match it")
    return None


def _subschemas(schema: Any) -> dict[int, tuple[dict, dict, str]]:
    """Every object of the schema that is a schema: id -> (it, the schema its "#" means, its JSON
    pointer), in document order."""
    found: dict[int, tuple[dict, dict, str]] = {}
    stack = [(schema, schema, "")]
    while stack:
        node, base, pointer = stack.pop()
        if isinstance(node, list):
            stack.extend((item, base, f"{pointer}/{i}") for i, item in reversed(list(enumerate(node))))
        elif isinstance(node, dict) and id(node) not in found:
            base = node if pointer and isinstance(node.get("$id"), str) else base
            found[id(node)] = (node, base, pointer)
            stack.extend((value, base, f"{pointer}/{_escape(key)}") for key, value in reversed(node.items())
                         if key not in _DATA_KEYWORDS)
    return found


def _schema_edges(node: dict, base: dict) -> tuple[list[int], list[list[int]]]:
    """(the subschemas `node` requires a value to match too, its choices of subschemas), as ids."""
    all_of = node.get("allOf")
    required = [id(s) for s in all_of if isinstance(s, dict)] if isinstance(all_of, list) else []
    target = _resolve(node.get("$ref"), base)
    if isinstance(target, dict):
        required.append(id(target))
    choices = [[id(s) if isinstance(s, dict) else -1 for s in node[word]] for word in ("anyOf", "oneOf")
               if isinstance(node.get(word), list) and node[word]]
    # A branch that is not an object (true, false) is none of the subschemas: it counts as productive.
    return required, [group for group in choices if -1 not in group]


def _resolve(ref: Any, base: dict) -> Any:
    """The subschema a local "$ref" ("#", "#/a/b") names from `base`; None for any other."""
    if not isinstance(ref, str) or not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/"):
        return None
    node: Any = base
    for part in ref[2:].split("/") if len(ref) > 1 else ():
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _escape(key: str) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


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


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe (the server compiles in its pool).

    A constraint the compiler has not seen is tried first in a child process
    (jaxserve.core.grammar_sandbox: a crash, a runaway or a memory hog is refused there), then compiled
    here on a thread with a stack sized for the longest grammars, its first token mask built (so
    the engine's first step with it does not pay for its lexer). Compiled grammars are cached by
    the memory they took, up to CACHE_BYTES; constraints that cannot be used are remembered as
    such, never cached as usable.

    `vocab_size` is the model's (rows of its logits, possibly more than the tokenizer's tokens: the
    extra ids are never allowed); `eos_token_ids` are the tokens that end an output (allowed where
    the grammar is complete)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 timeout_s: float = grammar_sandbox.DEFAULT_TIMEOUT_S,
                 max_bytes: int = grammar_sandbox.DEFAULT_MAX_BYTES, cache_bytes: int = CACHE_BYTES) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.timeout_s, self.max_bytes, self.cache_bytes = timeout_s, max_bytes, cache_bytes
        self._ll_tokenizer = None
        self._sandbox = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # key -> (matcher, bytes)
        self.cached_bytes = 0
        self._failed: OrderedDict[str, str] = OrderedDict()  # key -> why it cannot be used
        self._executor = None

    @property
    def num_words(self) -> int:
        """int32 words of one row's bitmask."""
        return bitmask_words(self.vocab_size)

    def _tokenizer_json(self) -> str:
        backend = copy.copy(self._hf_tokenizer.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        return backend.to_str()

    def _tokenizer(self):
        with self._lock:  # built once (about 0.3 s for a 50k vocabulary), on first use
            if self._ll_tokenizer is None:
                import llguidance  # on first use: a machine without it serves everything but grammars
                tokenizer_json = self._tokenizer_json()  # a few MB of JSON: serialized once, for both
                self._ll_tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=self.vocab_size,
                                                            eos_token=self.eos_token_ids or None)
                self._sandbox = grammar_sandbox.GrammarSandbox(tokenizer_json, self.vocab_size,
                                                               self.eos_token_ids, self.timeout_s, self.max_bytes)
            return self._ll_tokenizer

    def close(self) -> None:
        """Stops the sandbox's child process (a later compile starts another)."""
        if self._sandbox is not None:
            self._sandbox.close()

    def compile(self, value: StructuredOutputParams) -> Any:
        """Compiles `value` (once: the result is kept in `value.compiled` and in a cache keyed by
        its text). Raises StructuredOutputError naming the client's field when it cannot be used."""
        if value.compiled is not None:
            return value.compiled
        key = value.key()
        with self._lock:
            failure = self._failed.get(key)
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
        if failure is not None:
            raise StructuredOutputError(failure, value.param)
        if entry is None:
            tokenizer = self._tokenizer()
            try:
                grammar, cost = self._sandbox.check(value.kind, value.spec)
                compiled = grammar_sandbox.run_on_big_stack(grammar_sandbox.build_matcher, tokenizer, grammar)
            except grammar_sandbox.GrammarRejected as e:
                message = f"'{value.param}' cannot be used: {_in_words(str(e))}"
                if not e.transient:  # refused from now on without compiling
                    self.forget(value, message)
                raise StructuredOutputError(message, value.param) from None
            entry = (compiled, cost)
            with self._lock:
                if key not in self._cache:
                    self._cache[key] = entry
                    self.cached_bytes += cost
                while self.cached_bytes > self.cache_bytes and len(self._cache) > 1:
                    self.cached_bytes -= self._cache.popitem(last=False)[1][1]
        value.compiled = entry[0]
        return value.compiled

    def forget(self, value: StructuredOutputParams, reason: str) -> None:
        """Marks `value` unusable (`reason` is what a later request with it is told): out of the
        cache, and refused from now on without compiling. The engine calls this when a request's
        grammar fails while generating (a limit of the grammar engine met after the first token)."""
        key = value.key()
        with self._lock:
            entry = self._cache.pop(key, None)
            if entry is not None:
                self.cached_bytes -= entry[1]
            self._failed[key] = reason
            self._failed.move_to_end(key)
            while len(self._failed) > MAX_FAILED:
                self._failed.popitem(last=False)

    def new_state(self, value: StructuredOutputParams) -> "GrammarState":
        """A fresh matcher state for one request (a copy of the compiled grammar: microseconds)."""
        return GrammarState(self.compile(value).deep_copy(), value)

    def executor(self):
        """llguidance's thread pool for filling many rows' masks at once."""
        with self._lock:
            if self._executor is None:
                import llguidance  # on first use: a machine without it serves everything but grammars
                self._executor = llguidance.LLExecutor(num_threads=2)
            return self._executor


def _in_words(reason: str) -> str:
    """llguidance's reason for refusing a grammar, in words where it gives only an internal name."""
    if reason.startswith("NoExtensionBias"):  # its first token mask is empty, and EOS is not allowed
        return "no output can match it (the grammar allows no first token)"
    return reason


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


class GrammarState:
    """One request's position in its grammar. The runner reads it (`fill_bitmasks`); the engine
    advances it with each sampled token (`accept`)."""

    def __init__(self, matcher: Any, constraint: StructuredOutputParams | None = None) -> None:
        self.matcher = matcher
        self.constraint = constraint  # what the compiler forgets if this state fails
        self.executor = None  # set by the engine: the compiler's llguidance executor

    def accept(self, token_id: int) -> bool:
        """Advances past one sampled token; False (and `error` set) if the grammar does not allow it."""
        return bool(self.matcher.consume_token(int(token_id)))

    @property
    def error(self) -> str | None:
        return grammar_sandbox.first_line(self.matcher.get_error()) if self.matcher.is_error() else None

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

"""jaxserve.core.grammar_sandbox: grammars tried in a child process first. A fuzz of the grammar shapes
that recurse in llguidance (rule chains, nesting, alternations, repeats, schema references), each
as large as the 64 KB limit allows, never crashes the child; crashes, runaways and memory hogs are
refused with a reason, and the child comes back for the next grammar."""
import json
import os
import random
import re
import time

import pytest

from jaxserve.core.grammar_sandbox import COMPILE_STACK_BYTES, GrammarRejected, GrammarSandbox, run_on_big_stack
from jaxserve.core.structured_output import MAX_SPEC_CHARS


def _largest(make) -> str:
    """make(n) for the largest n whose text fits in MAX_SPEC_CHARS."""
    low, high = 1, 200_000
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if len(make(mid)) <= MAX_SPEC_CHARS else (low, mid - 1)
    return make(low)


def _defs(n, node):
    return json.dumps({"$ref": "#/$defs/d0", "$defs": {**{f"d{i}": node(i) for i in range(n)}, f"d{n}": {"type": "string"}}})


SHAPES = {  # name -> (kind, n -> spec): what recursion in the grammar compiler looks like at its largest
    "rule_chain": ("grammar", lambda n: "start: r0\n" + "".join(f'r{i}: "t{i} " r{i + 1}\n' for i in range(n))
                   + f'r{n}: "end"\n'),
    "unit_chain": ("grammar", lambda n: "start: a0\n" + "".join(f"a{i}: a{i + 1}\n" for i in range(n)) + f'a{n}: "x"\n'),
    "alternation_chain": ("grammar", lambda n: "start: a0\n" + "".join(f'a{i}: a{i + 1} | "x"\n' for i in range(n))
                          + f'a{n}: "x"\n'),
    "left_chain": ("grammar", lambda n: "start: a0\n" + "".join(f'a{i}: a{i + 1} "x"\n' for i in range(n))
                   + f'a{n}: "x"\n'),
    "repeat_chain": ("grammar", lambda n: "start: a0\n" + "".join(f"a{i}: a{i + 1}*\n" for i in range(n))
                     + f'a{n}: "x"\n'),
    "gbnf_chain": ("grammar", lambda n: "root ::= r0\n" + "".join(f'r{i} ::= "t" r{i + 1}\n' for i in range(n))
                   + f'r{n} ::= "e"\n'),
    "nested_groups": ("grammar", lambda n: "start: " + '("a" ' * n + ")" * n + "\n"),
    "nested_alternations": ("grammar", lambda n: "start: " + '("a" | ' * n + '"b"' + ")" * n + "\n"),
    "nested_repeats": ("grammar", lambda n: "start: " + "(" * n + '"a"' + ")*" * n + "\n"),
    "wide_alternation": ("grammar", lambda n: "start: " + " | ".join(f'"w{i}"' for i in range(n)) + "\n"),
    "regex_nesting": ("regex", lambda n: "(" * n + "a" + ")*" * n),
    "regex_alternation": ("regex", lambda n: "|".join(f"w{i}" for i in range(n))),
    "schema_nesting": ("json_schema", lambda n: '{"type":"object","properties":{"a":' * n + '{"type":"string"}'
                       + "}}" * n),
    "schema_ref_chain": ("json_schema", lambda n: _defs(n, lambda i: {"type": "object", "properties": {
        "n": {"$ref": f"#/$defs/d{i + 1}"}}})),
    "schema_ref_aliases": ("json_schema", lambda n: _defs(n, lambda i: {"$ref": f"#/$defs/d{i + 1}"})),
    "schema_ref_arrays": ("json_schema", lambda n: _defs(n, lambda i: {"type": "array", "items": {
        "$ref": f"#/$defs/d{i + 1}"}})),
}


@pytest.fixture(scope="module")
def sandbox(tiny_chat_model_dir):
    from checkpoints.load import load_tokenizer

    tokenizer = load_tokenizer(tiny_chat_model_dir)
    backend = tokenizer.backend_tokenizer
    box = GrammarSandbox(backend.to_str(), 49152, [tokenizer.eos_token_id], timeout_s=60.0)
    yield box
    box.close()


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_largest_grammar_of_each_recursive_shape_never_crashes_the_compiler(sandbox, shape):
    kind, make = SHAPES[shape]
    spec = _largest(make)
    restarts = sandbox.num_restarts
    try:
        grammar, cost = sandbox.check(kind, spec)
        assert grammar and cost >= len(grammar)
    except GrammarRejected as e:  # a limit of llguidance's own: refused with its reason
        assert "crashed" not in str(e) and "longer than" not in str(e), str(e)
    assert sandbox.num_restarts == restarts  # the child lived through it


def test_random_mixtures_of_the_shapes_never_crash_the_compiler(sandbox):
    """Grammars made of three of the Lark shapes at random sizes, one after another in one start rule."""
    seed = int(os.environ.get("TEST_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    lark_shapes = [name for name, (kind, _) in SHAPES.items() if kind == "grammar" and "gbnf" not in name]
    restarts = sandbox.num_restarts
    for trial in range(6):
        parts, rules = [], []
        for index, name in enumerate(rng.sample(lark_shapes, 3)):
            text = re.sub(r"\b([ar]\d+)\b", rf"p{index}_\1", SHAPES[name][1](rng.randint(20, 1200)))
            text = text.replace("start:", f"part{index}:")
            parts.append(f"part{index}")
            rules.append(text)
        grammar = "start: " + " ".join(parts) + "\n" + "".join(rules)
        if len(grammar) > MAX_SPEC_CHARS:
            continue
        try:
            sandbox.check("grammar", grammar)
        except GrammarRejected as e:
            assert "crashed" not in str(e), f"seed {seed}, trial {trial}: {e}"
        assert sandbox.num_restarts == restarts, f"seed {seed}, trial {trial}"


def _stack_hungry(depth):
    return 1 if depth == 0 else 1 + _stack_hungry(depth - 1)


def test_the_compile_thread_has_its_big_stack():
    import sys
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(200_000)
    try:
        assert run_on_big_stack(_stack_hungry, 100_000) == 100_001  # ~100 frames per MiB would overflow 8 MiB
    finally:
        sys.setrecursionlimit(limit)
    assert COMPILE_STACK_BYTES >= 64 << 20
    with pytest.raises(ZeroDivisionError):
        run_on_big_stack(lambda: 1 / 0)


def test_a_crash_a_runaway_and_a_memory_hog_are_refused_and_the_child_restarts(sandbox):
    regex = "(f{1000}){1000}"  # its first mask: about a second and 150 MiB (a plain regex: about 14 MiB)
    small = GrammarSandbox(json.loads(sandbox._hello)["tokenizer"], 49152, [2],
                           timeout_s=60.0, max_bytes=96 << 20)
    try:
        with pytest.raises(GrammarRejected, match="needs more than 96 MiB"):
            small.check("regex", regex)
        restarts = small.num_restarts
        assert small.check("regex", "[a-z]+")[1] > 0  # a new child answers the next one
        assert small.num_restarts == restarts
        small.max_bytes, small.timeout_s = 1 << 30, 0.05
        start = time.monotonic()
        with pytest.raises(GrammarRejected, match="longer than 0.05 s"):
            small.check("regex", "(g{1000}){1000}")
        assert time.monotonic() - start < 5
        small.timeout_s = 60.0
        small.check("regex", "[0-9]+")
        os.kill(small._child.pid, 9)  # as a crash of the grammar engine would end it
        small._child.wait()
        assert small.check("regex", "[0-9]*x")[1] > 0  # a dead child is replaced before the next job
    finally:
        small.close()

"""Structured output on the engine: JSON schemas, regexes, choices and grammars sampled at
temperature 1 (seeded) on a tiny random model with SmolLM2's vocabulary all validate; an output
that cannot be completed ends with "length"; grammar state survives preemption; a bad constraint
is refused at admission naming its field; a failing grammar fails only its own request."""
import json
import re

import jsonschema
import pytest

from jaxserve.core.request import InvalidRequestError, SamplingParams
from jaxserve.core.structured_output import GrammarCompiler, StructuredOutputParams
from jaxserve.engine import Engine, EngineConfig

pytestmark = pytest.mark.slow  # engines and servers: out of `make test-quick`

NUM_SAMPLES = 20
# Bounded schemas (strings with maxLength, arrays with maxItems, no extra properties): every path
# through them ends within max_tokens, so a random model must finish each output with "stop".
SCHEMAS = {
    "nested object": {
        "type": "object", "additionalProperties": False, "required": ["name", "address"],
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                        "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
    "array of bounded integers": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                                  "minItems": 1, "maxItems": 4},
    "enums, integer bounds, booleans": {
        "type": "object", "additionalProperties": False, "required": ["color", "count", "ok", "tags"],
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "count": {"type": "integer", "minimum": 10, "maximum": 99},
                       "ok": {"type": "boolean"},
                       "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}},
}
REGEXES = [r"[A-Z][a-z]{2,5} [0-9]{1,3}", r"(yes|no)!{1,3}", r"\d{4}-\d{2}-\d{2}"]
CHOICES = ["alpha", "beta gamma", "δέλτα", 'a "quoted" one']
LARK = 'start: num ("+" num)? ("+" num)?\nnum: /[0-9]{1,3}/'
GBNF = 'root ::= "(" ("yes" | "no") ")"'


@pytest.fixture(scope="module")
def engine(tiny_chat_model_dir):
    return Engine.from_model(tiny_chat_model_dir, EngineConfig(
        max_num_seqs=32, max_num_batched_tokens=128, page_size=8, num_pages=800, max_model_len=256, warmup=False))


def constraints():
    """(label, constraint, validator of a finished output's text)."""
    cases = []
    for name, schema in SCHEMAS.items():
        cases.append((name, StructuredOutputParams("json_schema", schema, "guided_json"),
                      lambda text, schema=schema: jsonschema.validate(json.loads(text), schema)))
    for pattern in REGEXES:
        cases.append((pattern, StructuredOutputParams("regex", pattern, "guided_regex"),
                      lambda text, pattern=pattern: _assert(re.fullmatch(pattern, text, re.ASCII), text)))
    cases.append(("choice", StructuredOutputParams("choice", CHOICES, "guided_choice"),
                  lambda text: _assert(text in CHOICES, text)))
    cases.append(("lark", StructuredOutputParams("grammar", LARK, "guided_grammar"),
                  lambda text: _assert(re.fullmatch(r"[0-9]{1,3}(\+[0-9]{1,3}){0,2}", text), text)))
    cases.append(("gbnf", StructuredOutputParams("grammar", GBNF, "guided_grammar"),
                  lambda text: _assert(text in ("(yes)", "(no)"), text)))
    return cases


def _assert(condition, text):
    assert condition, text


def test_sampled_outputs_all_validate(engine):
    """20 seeded samples at temperature 1 per constraint, all constraints in one batch: every one
    ends with "stop" (the grammar allowed EOS) and validates."""
    prompt = engine.tokenizer.encode("Answer in the requested format:")
    cases = constraints()
    params = [SamplingParams(max_tokens=96, temperature=1.0, seed=seed, structured_output=constraint)
              for _, constraint, _ in cases for seed in range(NUM_SAMPLES)]
    results = engine.generate([prompt] * len(params), params)
    for i, result in enumerate(results):
        label, _, validate = cases[i // NUM_SAMPLES]
        seed = i % NUM_SAMPLES
        assert result.finish_reason == "stop", (label, seed, result.text)
        assert result.token_ids[-1] in engine.eos_token_ids, (label, seed)
        validate(result.text)
    for label_index, (label, _, _) in enumerate(cases):  # sampling, not a forced single answer
        texts = {r.text for r in results[label_index * NUM_SAMPLES:(label_index + 1) * NUM_SAMPLES]}
        assert len(texts) > 1, label
    assert engine.allocator.num_used_pages == 0


def test_json_object_outputs_are_complete_or_end_with_length(engine):
    """Any JSON object: the random model rarely closes one, but none is called complete unless it
    parses, and every one that ends with "stop" is an object."""
    prompt = engine.tokenizer.encode("JSON:")
    json_object = StructuredOutputParams("json_object", None, "response_format")
    results = engine.generate([prompt] * NUM_SAMPLES, [
        SamplingParams(max_tokens=24, temperature=1.0, seed=seed, structured_output=json_object)
        for seed in range(NUM_SAMPLES)])
    for seed, result in enumerate(results):
        assert result.text.startswith("{"), seed
        if result.finish_reason == "stop":
            assert isinstance(json.loads(result.text), dict), (seed, result.text)
        else:
            assert result.finish_reason == "length" and len(result.token_ids) == 24
            with pytest.raises(ValueError):
                json.loads(result.text)


def test_too_few_tokens_end_with_length_never_with_incomplete_json(engine):
    prompt = engine.tokenizer.encode("JSON:")
    schema = SCHEMAS["nested object"]
    results = engine.generate([prompt] * 4, [
        SamplingParams(max_tokens=5, temperature=1.0, seed=seed,
                       structured_output=StructuredOutputParams("json_schema", schema, "guided_json"))
        for seed in range(4)])
    for result in results:
        assert result.finish_reason == "length" and len(result.token_ids) == 5
        with pytest.raises(ValueError):
            json.loads(result.text)


def test_grammar_state_survives_preemption_and_batching(engine, tiny_chat_model_dir):
    """Seeded structured outputs are the same alone, in a batch, and in a pool so small that
    requests are preempted and recomputed (the grammar state depends on output tokens only)."""
    prompt = engine.tokenizer.encode("Data:")
    constraint = StructuredOutputParams("json_schema", SCHEMAS["enums, integer bounds, booleans"], "guided_json")
    params = [SamplingParams(max_tokens=64, temperature=1.0, seed=seed, structured_output=constraint)
              for seed in range(8)]
    alone = [engine.generate([prompt], [p])[0].token_ids for p in params[:3]]
    batched = engine.generate([prompt] * len(params), params)
    tight = Engine.from_model(tiny_chat_model_dir, EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=32, page_size=8, num_pages=16, max_model_len=256, warmup=False))
    preempted = tight.generate([prompt] * len(params), params)
    assert tight.scheduler.num_preemptions > 0
    assert [r.token_ids for r in batched[:3]] == alone
    assert [r.token_ids for r in preempted] == [r.token_ids for r in batched]
    for result in preempted:
        assert result.finish_reason == "stop"
        jsonschema.validate(json.loads(result.text), constraint.spec)


@pytest.mark.parametrize("constraint,message", [
    (StructuredOutputParams("regex", "[0-9", "guided_regex"), "unclosed"),
    (StructuredOutputParams("json_schema", {"type": "strin"}, "response_format.json_schema.schema"), "strin"),
    (StructuredOutputParams("json_schema", "{not json", "guided_json"), "not valid JSON"),
    (StructuredOutputParams("json_schema", {"$ref": "#/defs/missing"}, "guided_json"), "missing"),
    (StructuredOutputParams("grammar", "start: undefined_rule", "guided_grammar"), "undefined_rule"),
    (StructuredOutputParams("choice", [], "guided_choice"), "non-empty strings"),
    (StructuredOutputParams("choice", ["ok", 3], "guided_choice"), "non-empty strings"),
    (StructuredOutputParams("regex", "", "guided_regex"), "non-empty"),
    (StructuredOutputParams("regex", "a" * 70000, "guided_regex"), "longer than"),
    (StructuredOutputParams("regex", "\ud800", "guided_regex"), "Unicode"),
    (StructuredOutputParams("xml", "<a/>", "structured_outputs.xml"), "unknown structured output kind"),
])
def test_a_bad_constraint_is_refused_at_admission_naming_its_field(engine, constraint, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as info:
        engine.add_request("bad", [5, 6, 7], SamplingParams(structured_output=constraint))
    assert info.value.param == constraint.param
    assert not engine.has_unfinished()


def test_structured_output_is_refused_where_it_cannot_work(engine):
    from jaxserve.config import ModelConfig
    from jaxserve.models import weights
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_q_heads=2,
                         num_kv_heads=1, head_dim=16, max_position_embeddings=64)
    no_tokenizer = Engine(config, weights.random_params(config, seed=0), None,
                          EngineConfig(num_pages=16, page_size=8, max_num_seqs=4, max_num_batched_tokens=32,
                                       warmup=False))
    regex = StructuredOutputParams("regex", "[a-z]+", "guided_regex")
    with pytest.raises(InvalidRequestError, match="tokenizer") as info:
        no_tokenizer.add_request("x", [1, 2], SamplingParams(structured_output=regex))
    assert info.value.param == "guided_regex"
    with pytest.raises(InvalidRequestError) as info:  # min_tokens could outlast the grammar
        engine.add_request("x", [5, 6], SamplingParams(min_tokens=2, structured_output=regex))
    assert info.value.param == "min_tokens"


def test_compiled_grammars_are_cached_and_shared(engine):
    """One compile per distinct constraint text (tools repeat their schemas); each request gets its
    own state, so n choices advance independently."""
    compiler = engine.grammar_compiler
    first = StructuredOutputParams("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}})
    second = StructuredOutputParams("json_schema", {"properties": {"a": {"type": "integer"}}, "type": "object"})
    assert compiler.compile(first) is compiler.compile(second)  # same schema, keys in another order
    one, two = compiler.new_state(first), compiler.new_state(first)
    token = engine.tokenizer.encode("{", add_special_tokens=False)[0]
    assert one.accept(token)
    assert two.matcher.get_error() == "" and not two.matcher.is_accepting()
    assert isinstance(GrammarCompiler(engine.tokenizer, 49152, [2]).num_words, int)


def test_a_grammar_that_fails_fails_only_its_request(engine):
    """Should a grammar state reject a sampled token, its request ends with an error; the request
    beside it finishes as it would alone."""
    prompt = engine.tokenizer.encode("x")
    regex = StructuredOutputParams("regex", "[0-9]{2,6}", "guided_regex")
    good_params = SamplingParams(max_tokens=10, temperature=1.0, seed=3, structured_output=regex)
    alone = engine.generate([prompt], [good_params])[0].token_ids
    bad = engine.add_request("bad", prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=4,
                                                          structured_output=regex))
    bad.grammar.accept = lambda token_id: False
    engine.add_request("good", prompt, good_params)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert outputs["bad"][-1].finish_reason == "error" and "structured output" in outputs["bad"][-1].error
    assert [t for o in outputs["good"] for t in o.new_token_ids] == alone
    assert outputs["good"][-1].finish_reason == "stop"
    assert engine.allocator.num_used_pages == 0


# ---- through the server ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_chat_model_dir):
    from tests.test_server_engine import LiveServer
    live = LiveServer(Engine.from_model(tiny_chat_model_dir, EngineConfig(
        max_num_seqs=16, max_num_batched_tokens=128, page_size=8, num_pages=400, max_model_len=256, warmup=False)))
    live.model = live.async_engine.model_name
    yield live
    live.close()


def test_response_format_json_schema_streamed_and_not(server):
    """OpenAI's response_format with n > 1 and a seed: each choice validates, and the stream of
    each choice adds up to the same text."""
    import openai
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    schema = SCHEMAS["enums, integer bounds, booleans"]
    kwargs = dict(model=server.model, messages=[{"role": "user", "content": "Describe it."}], n=3, seed=21,
                  temperature=1.0, max_tokens=80,
                  response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}})
    whole = c.chat.completions.create(**kwargs)
    texts = [choice.message.content for choice in whole.choices]
    for choice in whole.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
    streamed = ["", "", ""]
    for chunk in c.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts


@pytest.mark.parametrize("field,value,check", [
    ("guided_choice", ["left", "right"], lambda text: text in ("left", "right")),
    ("guided_regex", r"[0-9]{2}-[a-z]{2}", lambda text: re.fullmatch(r"[0-9]{2}-[a-z]{2}", text)),
    ("guided_json", SCHEMAS["array of bounded integers"],
     lambda text: jsonschema.validate(json.loads(text), SCHEMAS["array of bounded integers"]) is None),
    ("guided_grammar", GBNF, lambda text: text in ("(yes)", "(no)")),
    ("structured_outputs", {"regex": "[A-Z]{3}"}, lambda text: re.fullmatch("[A-Z]{3}", text)),
    ("response_format", {"type": "json_object"}, lambda text: text.startswith("{")),
])
def test_vllm_guided_fields_on_completions(server, field, value, check):
    import requests
    r = requests.post(server.url + "/v1/completions", timeout=120, json={
        "model": server.model, "prompt": "Answer:", "n": 4, "seed": 2, "temperature": 1.0, "max_tokens": 40,
        field: value})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert check(choice["text"]), choice
        if field != "response_format":  # any JSON object: a random model rarely closes one
            assert choice["finish_reason"] == "stop", choice


@pytest.mark.parametrize("body,param", [
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"guided_json": {"type": "strin"}}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: nothing_here"}, "guided_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs.xml"),
    ({"guided_regex": "[a-z]+", "min_tokens": 3}, "min_tokens"),
])
def test_bad_constraints_are_400s_naming_the_field(server, body, param):
    import requests
    r = requests.post(server.url + "/v1/completions", timeout=60,
                      json={"model": server.model, "prompt": "x", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


def test_grammars_compile_in_the_prepare_pool_not_on_the_event_loop(server):
    import threading
    import requests
    async_engine = server.async_engine
    compile_structured_output = async_engine.compile_structured_output
    threads = []

    def recording(params):
        threads.append(threading.current_thread().name)
        return compile_structured_output(params)
    async_engine.compile_structured_output = recording
    try:
        r = requests.post(server.url + "/v1/completions", timeout=60, json={
            "model": server.model, "prompt": "x", "max_tokens": 8, "guided_regex": "[a-z]{1,4}"})
    finally:
        async_engine.compile_structured_output = compile_structured_output
    assert r.status_code == 200 and re.fullmatch("[a-z]{1,4}", r.json()["choices"][0]["text"])
    assert threads and all(name.startswith("jaxserve-prepare") for name in threads)


def test_a_grammar_whose_mask_fails_fails_only_its_request(engine):
    """Should computing one row's mask raise, that row allows nothing and its request ends with an
    error; the other grammar request of the same steps finishes as it would alone."""
    prompt = engine.tokenizer.encode("y")
    regex = StructuredOutputParams("regex", "[a-z]{2,6}", "guided_regex")
    good_params = SamplingParams(max_tokens=10, temperature=1.0, seed=5, structured_output=regex)
    alone = engine.generate([prompt], [good_params])[0].token_ids
    bad = engine.add_request("bad", prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=6,
                                                          structured_output=regex))
    good = engine.add_request("good", prompt, good_params)

    def broken(row):
        raise RuntimeError("injected mask failure")
    bad.grammar.fill_bitmask = broken
    bad.grammar.executor = good.grammar.executor = None  # row by row, as the fallback of the batched fill
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert outputs["bad"][-1].finish_reason == "error" and "structured output failed" in outputs["bad"][-1].error
    assert [t for o in outputs["good"] for t in o.new_token_ids] == alone
    assert engine.allocator.num_used_pages == 0

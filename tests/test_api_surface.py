"""The rest of the OpenAI / vLLM surface on the real engine (tiny random Llama with SmolLM2's
tokenizer, `tiny_chat_model_dir`): batched prompts, logit_bias, min_tokens, stop strings kept and
named, best_of, /tokenize and /detokenize, /v1/models/{id}, and a model named "org/name" loaded from
a Hugging Face cache laid out by the test."""
import json
import os
import shutil

import openai
import pytest
import requests

from jaxserve import environment
from jaxserve.commands import cli
from jaxserve.engine import Engine, EngineConfig
from serve.app import ServerConfig
from serve.prompts import encode_chat
from tests.test_server_engine import LiveServer

pytestmark = pytest.mark.slow  # servers on the tiny model: out of `make test-quick`

MODEL = "tiny-chat"
ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=64, page_size=8, num_pages=256, max_model_len=256,
              warmup=False)


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir):
    engine = Engine.from_model(tiny_chat_model_dir, EngineConfig(**ENGINE))
    live = LiveServer(engine, ServerConfig(served_model_names=(MODEL,), drain_timeout_s=2.0))
    live.tokenizer = engine.tokenizer
    live.eos_token_id = engine.tokenizer.eos_token_id
    yield live
    live.close()


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def greedy(server, prompt, max_tokens=8, **extra):
    """The greedy completion of one prompt (EOS ignored unless `extra` says otherwise)."""
    return client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                             extra_body={"ignore_eos": True, **extra})


def post(server, path, body):
    return requests.post(server.url + path, json=body, timeout=120)


@pytest.mark.parametrize("stream", [False, True])
def test_batched_prompts_one_choice_per_prompt_and_n(server, stream):
    prompts = ["The capital of France", "Once upon", [40, 41, 42, 43]]
    alone = [greedy(server, p, max_tokens=6) for p in prompts]
    body = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
            "stream": stream}
    texts, finish, usage = {}, {}, None
    if stream:
        body["stream_options"] = {"include_usage": True}
        with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=120) as r:
            for line in r.iter_lines():
                if not line or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[len(b"data: "):])
                for choice in chunk["choices"]:
                    texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                    finish[choice["index"]] = choice["finish_reason"] or finish.get(choice["index"])
                usage = chunk.get("usage") or usage
    else:
        response = post(server, "/v1/completions", body).json()
        texts = {c["index"]: c["text"] for c in response["choices"]}
        finish = {c["index"]: c["finish_reason"] for c in response["choices"]}
        usage = response["usage"]
    assert sorted(texts) == list(range(6))  # prompt i, choice j: index i * n + j
    for i, single in enumerate(alone):
        assert texts[2 * i] == texts[2 * i + 1] == single.choices[0].text, i
    assert set(finish.values()) == {"length"}
    assert usage["prompt_tokens"] == sum(a.usage.prompt_tokens for a in alone)  # each prompt once, not n times
    assert usage["completion_tokens"] == 6 * 6 and usage["total_tokens"] == usage["prompt_tokens"] + 36


def test_a_batch_refused_on_one_prompt_names_it_and_runs_nothing(server):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": ["fine", [1, 10**6]], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["message"].startswith("prompt 1: ")
    assert server.metric("jaxserve_kv_pages_used") == 0


def test_logit_bias_forces_and_bans_tokens(server):
    forced_id = server.tokenizer.encode(" Paris", add_special_tokens=False)[0]
    forced = greedy(server, "Hello", logit_bias={str(forced_id): 100})
    assert forced.choices[0].text == server.tokenizer.decode([forced_id] * 8)
    free = greedy(server, "Hello", max_tokens=1, logprobs=0)
    top = server.tokenizer.encode(free.choices[0].text, add_special_tokens=False)[0]
    banned = greedy(server, "Hello", max_tokens=1, logit_bias={str(top): -100})
    assert banned.choices[0].text != free.choices[0].text
    chat = client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=3, temperature=0.0, logit_bias={str(forced_id): 100})
    assert chat.choices[0].message.content == server.tokenizer.decode([forced_id] * 3)


def test_min_tokens_holds_back_eos(server):
    eos = str(server.eos_token_id)
    eager = client(server).completions.create(model=MODEL, prompt="Hi", max_tokens=20, temperature=0.0,
                                              logit_bias={eos: 100})
    assert (eager.choices[0].finish_reason, eager.usage.completion_tokens) == ("stop", 1)
    held = client(server).completions.create(model=MODEL, prompt="Hi", max_tokens=20, temperature=0.0,
                                             logit_bias={eos: 100}, extra_body={"min_tokens": 5})
    assert (held.choices[0].finish_reason, held.usage.completion_tokens) == ("stop", 6)  # 5 tokens, then EOS
    assert held.choices[0].model_extra["stop_reason"] is None  # EOS: no stop string or stop token id


def test_stop_strings_kept_on_request_and_named_in_stop_reason(server):
    free = greedy(server, "The quick brown fox", max_tokens=16).choices[0].text
    stop = next(free[i:i + 3] for i in range(2, len(free) - 3) if free[i:i + 3].strip() and free.find(free[i:i + 3]) == i)
    cut = free.index(stop)
    for include in (False, True):
        for stream in (False, True):
            kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=16, temperature=0.0, stop=[stop],
                          stream=stream, extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
            if stream:
                chunks = list(client(server).completions.create(**kwargs))
                text = "".join(c.choices[0].text for c in chunks)
                last = chunks[-1].choices[0]
            else:
                last = client(server).completions.create(**kwargs).choices[0]
                text = last.text
            assert text == free[:cut + (len(stop) if include else 0)], (include, stream)
            assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop
    ids = server.tokenizer.encode(free, add_special_tokens=False)
    by_token = greedy(server, "The quick brown fox", max_tokens=16, stop_token_ids=[ids[2]]).choices[0]
    assert by_token.finish_reason == "stop" and by_token.model_extra["stop_reason"] == ids[2]


def test_best_of_returns_the_candidates_with_the_highest_cumulative_logprob(server):
    body = {"model": MODEL, "prompt": "Tell me", "max_tokens": 6, "temperature": 1.0, "seed": 11,
            "ignore_eos": True}
    candidates = post(server, "/v1/completions", {**body, "n": 4, "logprobs": 0}).json()["choices"]
    scores = [sum(c["logprobs"]["token_logprobs"]) for c in candidates]
    assert len(set(c["text"] for c in candidates)) > 1  # the seeds differ: a real choice
    best = post(server, "/v1/completions", {**body, "n": 2, "best_of": 4}).json()
    ranked = sorted(range(4), key=lambda i: -scores[i])
    assert [c["text"] for c in best["choices"]] == [candidates[i]["text"] for i in ranked[:2]]
    assert [c["index"] for c in best["choices"]] == [0, 1] and best["choices"][0]["logprobs"] is None
    assert best["usage"]["completion_tokens"] == 4 * 6  # every candidate was generated
    r = post(server, "/v1/completions", {**body, "best_of": 2, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


def test_tokenize_and_detokenize_match_the_tokenizer(server):
    tokenizer = server.tokenizer
    text = "What is the capital of France?"
    r = post(server, "/tokenize", {"model": MODEL, "prompt": text}).json()
    assert r == {"tokens": tokenizer.encode(text), "count": len(tokenizer.encode(text)), "max_model_len": 256,
                 "token_strs": None}
    plain = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    assert plain["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert plain["token_strs"] == tokenizer.convert_ids_to_tokens(plain["tokens"])
    messages = [{"role": "user", "content": text}]
    chat = post(server, "/tokenize", {"model": MODEL, "messages": messages}).json()
    assert chat["tokens"] == encode_chat(tokenizer, messages)
    completion = client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert chat["count"] == completion.usage.prompt_tokens  # exactly what generation encodes
    back = post(server, "/detokenize", {"model": MODEL, "tokens": plain["tokens"]}).json()
    assert back == {"prompt": text}


def test_models_by_id(server):
    r = requests.get(server.url + f"/v1/models/{MODEL}", timeout=10)
    assert r.status_code == 200 and r.json()["id"] == MODEL and r.json()["max_model_len"] == 256
    assert client(server).models.retrieve(MODEL).id == MODEL
    missing = requests.get(server.url + "/v1/models/gpt-9", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client(server).models.retrieve("gpt-9")


# ---- --model=org/name from the local Hugging Face cache ------------------------------------------
def fake_hf_cache(root, repo_id, model_dir):
    """Lays out `model_dir`'s files as the Hugging Face hub cache does: a blob per file, the
    snapshot of revision `main` linking to them."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = os.path.join(root, "hub", "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", commit)
    os.makedirs(os.path.join(repo, "refs"))
    os.makedirs(os.path.join(repo, "blobs"))
    os.makedirs(snapshot)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(commit)
    for i, name in enumerate(sorted(os.listdir(model_dir))):
        blob = os.path.join(repo, "blobs", f"blob{i}")
        shutil.copyfile(os.path.join(model_dir, name), blob)
        os.symlink(os.path.relpath(blob, snapshot), os.path.join(snapshot, name))
    return snapshot


@pytest.fixture(scope="module")
def tiny_hf_folder(tmp_path_factory):
    """A tiny Hugging Face model folder (config.json, safetensors, SmolLM2's tokenizer files)."""
    from tests.tiny_models import copy_smollm2_tokenizer, make_tiny_hf_model

    folder = str(tmp_path_factory.mktemp("org_tiny"))
    make_tiny_hf_model(folder, vocab_size=49152, hidden_size=64, intermediate_size=128, head_dim=16)
    copy_smollm2_tokenizer(folder)
    return folder


def test_a_hub_id_loads_from_the_local_hf_cache(tiny_hf_folder, tmp_path, monkeypatch):
    from jaxserve.async_engine import build_async_engine

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "jaxserve"))
    fake_hf_cache(str(tmp_path / "hf"), "tiny-org/tiny-llama", tiny_hf_folder)
    live = LiveServer(build_async_engine("tiny-org/tiny-llama", **ENGINE))
    try:
        models = requests.get(live.url + "/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["tiny-org/tiny-llama"]  # served as vLLM would name it
        assert requests.get(live.url + "/v1/models/tiny-org/tiny-llama", timeout=10).status_code == 200
        c = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = c.completions.create(model="tiny-org/tiny-llama", prompt="Hi", max_tokens=3, temperature=0.0,
                                 extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
    finally:
        live.close()
    converted = os.listdir(tmp_path / "jaxserve" / "models")
    assert len(converted) == 1 and converted[0].startswith("tiny-org--tiny-llama-")  # converted once, in the cache


def test_a_hub_id_not_in_the_cache_is_a_clear_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "jaxserve"))
    assert cli.main(["jaxserve", "serve", "--model=tiny-org/absent", "--port=0"]) == 2
    error = capsys.readouterr().err
    assert "tiny-org/absent: no such file or directory, and not in the local Hugging Face cache" in error
    assert str(tmp_path / "hf") in error
    assert "never downloads" in error and "Traceback" not in error


def test_hub_ids_paths_and_served_names(tmp_path, monkeypatch):
    from checkpoints import default_model

    monkeypatch.chdir(tmp_path)
    assert default_model.is_hub_id("org/name") and default_model.served_model_name("org/name") == "org/name"
    os.makedirs("org/name")  # an existing path always wins
    assert not default_model.is_hub_id("org/name") and default_model.served_model_name("org/name") == "name"
    assert not default_model.is_hub_id("/abs/path") and not default_model.is_hub_id("a/b/c")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hubcache"))
    assert environment.hf_hub_cache() == str(tmp_path / "hubcache")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert environment.hf_hub_cache() == str(tmp_path / "home" / "hub")


def test_the_default_model_gets_its_model_cards_sampling_values(tmp_path, monkeypatch):
    from checkpoints import MARKER_FILE, default_model

    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    converted = tmp_path / "models" / "smollm2"
    converted.mkdir(parents=True)
    (converted / MARKER_FILE).write_text("{}")  # an existing conversion, from before generation configs
    assert default_model.resolve_model("smollm2") == str(converted)
    assert json.loads((converted / "generation_config.json").read_text())["temperature"] == 0.2
    assert default_model.model_sampling_defaults(str(converted)) == ({"temperature": 0.2, "top_p": 0.9}, [])
    (converted / "generation_config.json").write_text('{"temperature": 0.5}')  # never overwritten
    default_model.resolve_model("smollm2")
    assert default_model.model_sampling_defaults(str(converted)) == ({"temperature": 0.5}, [])
    (converted / "generation_config.json").write_text('{"temperature": 3, "top_k": 5, "top_p": null}')
    defaults, problems = default_model.model_sampling_defaults(str(converted))
    assert defaults == {"top_k": 5} and len(problems) == 1 and "temperature left out" in problems[0]

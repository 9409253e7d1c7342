"""lm-eval against a live server: a small local multiple-choice task through `local-completions`
(echo + logprobs + max_tokens 1: the prompt logprobs path) gives the per-choice loglikelihoods,
greedy flags and accuracy of lm-eval's own `hf` model on the same tiny weights, and a
generate_until task sent 4 prompts per request gives the hf model's greedy text."""
import json

import numpy as np
import pytest
import requests
import torch

from checkpoints.convert import convert_checkpoint
from jaxserve.engine import Engine, EngineConfig
from tests.test_server_engine import LiveServer
from tests.tiny_models import copy_smollm2_tokenizer, make_tiny_hf_model

import lm_eval  # noqa: E402  (the test extra installs it)

pytestmark = pytest.mark.slow  # lm-eval against a server: out of `make test-quick`

# Both sides compute in float32 (jax on the paged engine, torch in transformers); a loglikelihood
# sums a few token logprobs of magnitude ~10, measured within 1e-5 of each other. 1e-3 leaves room
# for other BLAS builds, far below the gaps between choices (~1).
LOGLIKELIHOOD_ATOL = 1e-3
WORDS = ["cat", "dog", "red", "blue", "sun", "moon", "tree", "river", "stone", "bird"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The same tiny random Llama as a Hugging Face folder (for lm-eval's hf model) and converted."""
    root = tmp_path_factory.mktemp("lm_eval")
    hf_dir, converted = str(root / "hf"), str(root / "converted")
    model = make_tiny_hf_model(hf_dir, vocab_size=49152, hidden_size=64, intermediate_size=128, head_dim=16, seed=3)
    with torch.no_grad():  # spread the logits: choices then differ by whole nats, not by rounding
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(hf_dir, safe_serialization=True)
    copy_smollm2_tokenizer(hf_dir)
    convert_checkpoint(hf_dir, converted)
    return hf_dir, converted


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """Two local tasks written as JSONL + YAML: tiny_mc (multiple choice) and tiny_gen (generate_until)."""
    root = tmp_path_factory.mktemp("tasks")
    rng = np.random.default_rng(0)
    with open(root / "mc.jsonl", "w") as f:
        for _ in range(12):
            choices = [" ".join(rng.choice(WORDS, int(rng.integers(1, 4)))) for _ in range(4)]
            f.write(json.dumps({"question": " ".join(rng.choice(WORDS, 6)), "choices": choices,
                                "answer": int(rng.integers(0, 4))}) + "\n")
    with open(root / "gen.jsonl", "w") as f:
        for _ in range(8):
            f.write(json.dumps({"question": " ".join(rng.choice(WORDS, 5)), "answer": "cat"}) + "\n")
    common = "test_split: test\ndoc_to_text: \"{{question}}\"\ndoc_to_target: \"{{answer}}\"\n"
    (root / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        f"{common}output_type: multiple_choice\ndoc_to_choice: \"{{{{choices}}}}\"\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    (root / "tiny_gen.yaml").write_text(
        f"task: tiny_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / 'gen.jsonl'}\n"
        f"{common}output_type: generate_until\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    return str(root)


def evaluate(model, model_args, tasks_dir, batch_size):
    from lm_eval.tasks import TaskManager
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["tiny_mc", "tiny_gen"],
                                   task_manager=TaskManager(include_path=tasks_dir), log_samples=True,
                                   batch_size=batch_size)


@pytest.fixture(scope="module")
def server(models):
    engine = Engine.from_model(models[1], EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, page_size=8,
                                                       num_pages=200, max_model_len=256, warmup=False))
    live = LiveServer(engine)
    live.model = engine.model_name
    yield live
    live.close()


def test_local_completions_equals_lm_evals_hf_model(models, tasks, server, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf_dir, _ = models
    ours = evaluate("local-completions", {
        "base_url": server.url + "/v1/completions", "model": server.model, "tokenizer_backend": "huggingface",
        "tokenizer": hf_dir, "num_concurrent": 1, "max_retries": 1}, tasks, batch_size=4)
    reference = evaluate("hf", {"pretrained": hf_dir, "dtype": "float32", "device": "cpu"}, tasks, batch_size=4)

    ours_mc, reference_mc = ours["samples"]["tiny_mc"], reference["samples"]["tiny_mc"]
    assert len(ours_mc) == len(reference_mc) == 12
    for a, b in zip(ours_mc, reference_mc):
        assert a["doc"] == b["doc"]
        (ll_a, greedy_a), (ll_b, greedy_b) = zip(*[r[0] for r in a["resps"]]), zip(*[r[0] for r in b["resps"]])
        np.testing.assert_allclose(ll_a, ll_b, atol=LOGLIKELIHOOD_ATOL, rtol=0)
        assert greedy_a == greedy_b
        assert np.argmax(ll_a) == np.argmax(ll_b)
    assert ours["results"]["tiny_mc"]["acc,none"] == reference["results"]["tiny_mc"]["acc,none"]

    ours_gen = [s["resps"][0][0] for s in ours["samples"]["tiny_gen"]]
    assert ours_gen == [s["resps"][0][0] for s in reference["samples"]["tiny_gen"]]
    assert all(ours_gen) and len(set(ours_gen)) > 1


def post(server, path, body):
    response = requests.post(server.url + path, json={"model": server.model, **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(server, body):
    with requests.post(server.url + "/v1/completions", json={"model": server.model, "stream": True, **body},
                       timeout=120, stream=True) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_echo_and_prompt_logprobs_shapes(server):
    """echo puts the prompt (text and logprobs, the first null) before the completion, streamed or
    not; prompt_logprobs (vLLM's) carries the same numbers with ranks; max_tokens 0 echoes alone."""
    prompt = "The cat sat on the"
    body = {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0.0,
            "prompt_logprobs": 2}
    whole = post(server, "/v1/completions", body)["choices"][0]
    num_prompt = len(whole["prompt_logprobs"])
    logprobs = whole["logprobs"]
    assert whole["text"].startswith(prompt) and len(logprobs["tokens"]) == num_prompt + 3
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert "".join(logprobs["tokens"][:num_prompt]) == prompt
    assert logprobs["text_offset"][num_prompt] == len(prompt)
    for i in range(1, num_prompt):
        entry = whole["prompt_logprobs"][i]
        token = logprobs["tokens"][i]
        own = [v for v in entry.values() if v["decoded_token"] == token]
        assert own and own[0]["logprob"] == logprobs["token_logprobs"][i]
        assert sorted(v["rank"] for v in entry.values())[:2] == [1, 2]  # the top 2, and the token's own rank
        assert max(logprobs["top_logprobs"][i].values()) == max(v["logprob"] for v in entry.values())
    chunks = streamed(server, body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert chunks[0]["choices"][0]["prompt_logprobs"] == whole["prompt_logprobs"]
    assert sum([(c["choices"][0]["logprobs"] or {"tokens": []})["tokens"] for c in chunks], []) == logprobs["tokens"]
    only_prompt = post(server, "/v1/completions", {"prompt": prompt, "echo": True, "max_tokens": 0})
    assert only_prompt["choices"][0]["text"] == prompt and only_prompt["usage"]["completion_tokens"] == 0
    assert only_prompt["choices"][0]["finish_reason"] == "length"
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                 "prompt_logprobs": 1})
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_lm_evals_remote_tokenizer_reads_tokenizer_info(models, server):
    """`tokenizer_backend=remote`: lm-eval's RemoteTokenizer probes /tokenizer_info, then encodes,
    decodes and applies the chat template as the model's own tokenizer does."""
    from transformers import AutoTokenizer

    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    assert check_remote_tokenizer_support(server.url + "/v1/completions")
    remote = RemoteTokenizer(server.url + "/v1/completions")
    local = AutoTokenizer.from_pretrained(models[0])
    text = "The cat sat on the mat. 1234 émoji 🤗"
    assert remote.encode(text) == local(text, add_special_tokens=False)["input_ids"]
    assert remote.decode(remote.encode(text)) == text
    assert (remote.eos_token, remote.bos_token) == (local.eos_token, local.bos_token)
    messages = [{"role": "user", "content": "hi"}]
    assert remote.apply_chat_template(messages) == local.apply_chat_template(messages, tokenize=False,
                                                                             add_generation_prompt=True)

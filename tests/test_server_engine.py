"""The server on the real engine (tiny random model, SmolLM2's tokenizer) through the openai client."""
import asyncio
import threading

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from checkpoints import default_model, load
from jaxserve.config import ModelConfig
from jaxserve.async_engine import AsyncEngine
from jaxserve.engine import Engine, EngineConfig
from jaxserve.models import weights
from serve.app import ServerConfig, create_app
from serve.server import start_server

pytestmark = pytest.mark.slow  # servers: out of `make test-quick`


class LiveServer:
    """A real engine + app on a loopback port, run by an event loop in a thread."""

    def __init__(self, engine: Engine, config: ServerConfig | None = None):
        self.async_engine = engine if isinstance(engine, AsyncEngine) else AsyncEngine(engine)
        self.loop = asyncio.new_event_loop()
        self.port = None
        ready = threading.Event()

        async def main():
            self.runner, self.port = await start_server(
                create_app(self.async_engine, config or ServerConfig(drain_timeout_s=2.0)), "127.0.0.1", 0)
            ready.set()

        self.thread = threading.Thread(target=lambda: (self.loop.run_until_complete(main()),
                                                       self.loop.run_forever()), daemon=True)
        self.thread.start()
        assert ready.wait(60)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def metric(self, name):
        text = requests.get(self.url + "/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    return sample.value
        raise KeyError(name)


@pytest.fixture(scope="module")
def server():
    tokenizer = load.load_tokenizer(default_model.resolve_model("smollm2"))
    config = ModelConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_layers=2,
                         num_q_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
                         eos_token_ids=(tokenizer.eos_token_id,))
    engine = Engine(config, weights.random_params(config, seed=3), tokenizer,
                    EngineConfig(max_num_seqs=32, max_num_batched_tokens=128, page_size=8, num_pages=600,
                                 max_model_len=256, warmup=False), model_name="tiny")  # no test here is about
    # warm-up (test_engine.py and test_speculative.py check no compilation after it): the shapes the
    # requests reach compile on first use, not all of them up front
    live = LiveServer(engine)
    yield live
    live.close()


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


PROMPTS = ["The quick brown fox", "Once upon a time", "def fibonacci(n):", "JAX is", "Paris is the capital of"]


def test_32_concurrent_greedy_streams_equal_each_alone(server):
    c = client(server)
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(32)]

    def run(prompt, stream):
        if not stream:
            r = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.0,
                                     extra_body={"ignore_eos": True})
            return r.choices[0].text
        parts = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.0,
                                     stream=True, extra_body={"ignore_eos": True})
        return "".join(ch.choices[0].text for ch in parts if ch.choices)

    alone = [run(p, False) for p in prompts]
    results = [None] * len(prompts)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run(prompts[i], True)))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == alone
    assert server.metric("jaxserve_kv_pages_used") == 0


def test_chat_streaming_and_usage(server):
    c = client(server)
    chunks = list(c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True}, temperature=0.0))
    assert chunks[-1].usage.completion_tokens == 5
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    full = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=5, temperature=0.0)
    assert full.choices[0].message.content == text
    assert full.usage.prompt_tokens > 5


def test_disconnect_mid_stream_aborts_and_frees_pages(server):
    import time
    with requests.post(server.url + "/v1/completions", stream=True, timeout=60, json={
            "model": "tiny", "prompt": "A long story:", "max_tokens": 200, "stream": True,
            "ignore_eos": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert first.startswith(b"data: ")
        assert server.metric("jaxserve_kv_pages_used") > 0
    deadline = time.time() + 20
    while server.metric("jaxserve_kv_pages_used") != 0 and time.time() < deadline:
        time.sleep(0.1)
    assert server.metric("jaxserve_kv_pages_used") == 0
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("body,status", [
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400),
    ({"model": "tiny", "prompt": "x", "top_p": 1.5}, 400),
    ({"model": "nope", "prompt": "x"}, 404),
    ({"model": "tiny", "prompt": "word " * 400}, 400),
    ({"model": "tiny", "messages": "not a list"}, 400),
])
def test_bad_requests_get_json_errors_and_server_stays_up(server, body, status):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = requests.post(server.url + path, json=body, timeout=30)
    assert r.status_code == status
    assert r.json()["error"]["message"]
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


def test_a_failed_step_ends_its_requests_with_an_error_and_the_server_goes_on(server):
    """A device fault fails the requests of that step only: later requests are served, /health
    and /metrics report it."""
    runner = server.async_engine.engine.runner
    run_step = runner.run_step

    def fault_once(*args):
        runner.run_step = run_step
        raise RuntimeError("injected device fault")
    runner.run_step = fault_once
    r = requests.post(server.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "fails", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 500 and "injected device fault" in r.json()["error"]["message"]
    health = requests.get(server.url + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["num_step_failures"] == 1
    assert health["last_step_error"] == "RuntimeError: injected device fault"
    assert server.metric("jaxserve_step_failures_total") == 1
    after = client(server).completions.create(model="tiny", prompt="works", max_tokens=4, temperature=0.0,
                                              extra_body={"ignore_eos": True})
    assert after.usage.completion_tokens == 4
    assert server.metric("jaxserve_kv_pages_used") == 0

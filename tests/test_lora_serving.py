"""Multi-LoRA through the engine and the server: greedy tokens of every adapter equal transformers +
peft's, with other adapters and base requests in the same steps, more adapters than slots
(--max_loras: the scheduler keeps at most that many running and the slots are swapped), prefix
caching keyed by the adapter, and adapters loaded and unloaded at run time through vLLM's routes.

A tiny random Llama (SmolLM2's tokenizer) gets three random peft adapters of ranks 4, 8 and 16
over different target sets, each made to change the output (checked).
"""
import copy
import json

import numpy as np
import pytest
import requests

from checkpoints.convert import convert_checkpoint
from jaxserve.config import EngineConfig
from jaxserve.setting_checks import LoRAModule
from jaxserve.core.request import SamplingParams
from jaxserve.engine import Engine
from serve.app import ServerConfig
from tests.test_server_engine import LiveServer
from tests.tiny_models import copy_smollm2_tokenizer, make_tiny_hf_model

pytestmark = pytest.mark.slow  # torch, peft and an engine

SEED = 5120
ADAPTERS = {  # name: (rank, alpha, LoraConfig fields)
    "attn8": (8, 16, dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])),
    "all16": (16, 8, dict(target_modules="all-linear", use_rslora=True)),
    "mlp4": (4, 4, dict(target_modules=["gate_proj", "up_proj", "down_proj"])),
}
MAX_TOKENS = 8
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, page_size=8, num_pages=200, max_model_len=128,
              warmup=False, enable_lora=True, max_loras=2, max_lora_rank=16)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(converted base folder, {name: adapter folder}, {name or None: the torch model})."""
    import torch
    from peft import LoraConfig, get_peft_model
    folder = tmp_path_factory.mktemp("lora_serving")
    base = make_tiny_hf_model(str(folder / "hf"), seed=SEED % 97, vocab_size=49152, hidden_size=64,
                              intermediate_size=128, head_dim=16)
    copy_smollm2_tokenizer(str(folder / "hf"))
    convert_checkpoint(str(folder / "hf"), str(folder / "converted"))
    paths, torch_models = {}, {None: base}
    for i, (name, (rank, alpha, fields)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(SEED + i)
        model = get_peft_model(copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=alpha, **fields)).eval()
        with torch.no_grad():  # peft starts B at zero: make every adapter change the output
            for parameter_name, p in model.named_parameters():
                if "lora_B" in parameter_name:
                    p.copy_(0.2 * torch.randn_like(p))
        paths[name] = str(folder / name)
        model.save_pretrained(paths[name], safe_serialization=True)
        torch_models[name] = model
    return str(folder / "converted"), paths, torch_models


def hf_greedy(model, prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
    """transformers' (+ peft's) greedy continuation of `prompt`, token by token."""
    import torch
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):]


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 49000, int(rng.integers(4, 30))).tolist() for _ in range(n)]


def test_mixed_adapters_and_base_requests_match_peft(models):
    base_dir, paths, torch_models = models
    engine = Engine.from_model(base_dir, EngineConfig(
        **ENGINE, lora_modules=tuple(LoRAModule(name, path) for name, path in paths.items())))
    names = [None, "attn8", "all16", "mlp4", "attn8", None, "mlp4", "all16", "all16", None]
    batch = prompts(SEED, len(names))
    expected = [hf_greedy(torch_models[name], prompt) for name, prompt in zip(names, batch)]
    first = batch[0]
    outputs = {name: hf_greedy(torch_models[name], first) for name in torch_models}
    assert len({tuple(t) for t in outputs.values()}) == len(outputs), \
        f"an adapter does not change the output (seed {SEED}): the test would prove nothing"
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, lora_name=name)
              for name in names]
    placed, place = [], engine.loras.place
    engine.loras.place = lambda names, in_use: placed.append(set(names)) or place(names, in_use)
    results = engine.generate(batch, params)
    assert [r.token_ids for r in results] == expected, f"seed {SEED}"
    # Three adapters over two slots: never more than two running at once, every one placed in
    # turn; two kept in host memory (--max_cpu_loras defaults to --max_loras): evicted ones reread.
    assert max(map(len, placed)) == 2 and set().union(*placed) == set(ADAPTERS)
    assert engine.loras.num_loads > 3 and len(engine.loras.slotted) == 2
    # The same prompt under every adapter and the base model, prefix caching on: each gets its own
    # pages (the cache key holds the adapter), so each still gets its own tokens.
    again = engine.generate([first] * 4, [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                                         lora_name=name) for name in torch_models])
    assert [r.token_ids for r in again] == [outputs[name] for name in torch_models], f"seed {SEED}"


def test_unknown_adapters_and_lora_settings_are_refused(models):
    from jaxserve.core.request import InvalidRequestError
    from jaxserve.settings import SettingError
    base_dir, paths, _ = models
    engine = Engine.from_model(base_dir, EngineConfig(**ENGINE, lora_modules=(f"attn8={paths['attn8']}",)))
    with pytest.raises(InvalidRequestError, match="The model `nope` does not exist"):
        engine.check_request([1, 2, 3], SamplingParams(lora_name="nope"))
    with pytest.raises(SettingError, match="--lora_modules needs --enable_lora"):
        EngineConfig(lora_modules=("a=/x",))
    with pytest.raises(SettingError, match="expected NAME=PATH"):
        EngineConfig(enable_lora=True, lora_modules=("nopath",))
    with pytest.raises(SettingError, match="more than once"):
        EngineConfig(enable_lora=True, lora_modules=("a=/x,a=/y",))
    with pytest.raises(SettingError, match="max_cpu_loras"):
        EngineConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(SettingError, match="num_scheduler_steps"):
        EngineConfig(enable_lora=True, num_scheduler_steps=4)
    modules = EngineConfig(enable_lora=True, lora_modules=(
        'a=/x,b=/y', json.dumps({"name": "c", "path": "/z", "base_model_name": "m"}))).lora_modules
    assert modules == (LoRAModule("a", "/x"), LoRAModule("b", "/y"), LoRAModule("c", "/z", "m"))


@pytest.fixture(scope="module")
def server(models):
    base_dir, paths, _ = models
    engine = Engine.from_model(base_dir, EngineConfig(**ENGINE, lora_modules=(f"attn8={paths['attn8']}",)))
    live = LiveServer(engine, ServerConfig(drain_timeout_s=2.0, allow_runtime_lora_updating=True))
    yield live
    live.close()


def completion(server, model: str, prompt: list[int], stream: bool = False) -> requests.Response:
    return requests.post(server.url + "/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "stream": stream}, timeout=120, stream=stream)


def streamed_text(response) -> str:
    text = []
    for line in response.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


def test_the_server_picks_the_adapter_by_model_and_loads_at_run_time(server, models):
    base_dir, paths, torch_models = models
    tokenizer = server.async_engine.tokenizer
    prompt = prompts(SEED + 1, 1)[0]
    text = lambda name: tokenizer.decode(hf_greedy(torch_models[name], prompt))  # noqa: E731
    base_name = server.async_engine.model_name
    listed = requests.get(server.url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in listed] == [base_name, "attn8"]
    assert listed[1]["parent"] == base_name and listed[1]["root"] == paths["attn8"]
    for name in (None, "attn8"):
        response = completion(server, name or base_name, prompt)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == text(name)
    assert completion(server, "all16", prompt).status_code == 404  # not loaded yet
    # Loaded at run time: served from the next request on, streaming too.
    response = requests.post(server.url + "/v1/load_lora_adapter",
                             json={"lora_name": "all16", "lora_path": paths["all16"]}, timeout=60)
    assert response.status_code == 200, response.text
    with completion(server, "all16", prompt, stream=True) as response:
        assert response.status_code == 200 and streamed_text(response) == text("all16")
    # Refusals: a name taken, a folder that is no adapter, a missing field; unloading an unknown name.
    for body, status in (({"lora_name": "all16", "lora_path": paths["all16"]}, 400),
                         ({"lora_name": "x", "lora_path": base_dir}, 400),
                         ({"lora_name": "x"}, 400)):
        response = requests.post(server.url + "/v1/load_lora_adapter", json=body, timeout=60)
        assert response.status_code == status and "error" in response.json(), (body, response.text)
    response = requests.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "x"}, timeout=10)
    assert response.status_code == 404, response.text
    response = requests.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "all16"}, timeout=10)
    assert response.status_code == 200, response.text
    response = completion(server, "all16", prompt)
    assert response.status_code == 404 and "does not exist" in response.json()["error"]["message"]
    metrics = requests.get(server.url + "/metrics", timeout=10).text
    assert 'jaxserve_lora_requests_total{lora_name="attn8",model_name=' in metrics
    assert 'max_lora="2"' in metrics and "jaxserve_lora_requests_info{" in metrics


def test_runtime_loading_is_off_unless_turned_on(models):
    base_dir, paths, _ = models
    engine = Engine.from_model(base_dir, EngineConfig(**ENGINE))
    live = LiveServer(engine)
    try:
        response = requests.post(live.url + "/v1/load_lora_adapter",
                                 json={"lora_name": "a", "lora_path": paths["attn8"]}, timeout=10)
        assert response.status_code == 404 and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in response.text
        for route in ("load", "unload"):  # the route is off whatever the body: not parsed first
            response = requests.post(f"{live.url}/v1/{route}_lora_adapter", data=b"{not json", timeout=10)
            assert response.status_code == 404 and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in response.text, route
    finally:
        live.close()


def test_the_planner_counts_the_slab(models):
    """`plan` and the engine's KV sizing count the slab jaxserve.models.lora allocates."""
    from checkpoints.load import load_config
    from jaxserve.models import lora
    from jaxserve.planning import memory
    config = load_config(models[0])
    cfg = EngineConfig(enable_lora=True, max_loras=3, max_lora_rank=32, dtype="float32", page_size=8,
                       max_model_len=128)
    assert memory.lora_slab_bytes(config, cfg) == lora.slab_bytes(config, 3, 32)
    budget = 2**30
    with_lora = memory.plan_engine(config, cfg, device_memory_bytes=budget, on_gpu=True)
    without = memory.plan_engine(config, EngineConfig(dtype="float32", page_size=8, max_model_len=128),
                                 device_memory_bytes=budget, on_gpu=True)
    assert with_lora.lora_slab_bytes == lora.slab_bytes(config, 3, 32) and without.lora_slab_bytes == 0
    assert with_lora.num_pages < without.num_pages


def test_generate_runs_each_line_with_its_adapter(models, tmp_path, capsys):
    """`jaxserve generate --enable_lora --lora_modules ...`: a line's "lora" picks its adapter (the
    tokens peft gives); an unknown one exits 2 naming the line, before anything runs."""
    from jaxserve.commands import cli
    from serve.prompts import encode_text
    base_dir, paths, torch_models = models
    batch = prompts(SEED + 2, 2)
    lines = [{"id": i, "prompt": "", "lora": name} for i, name in enumerate(("mlp4", "attn8"))]
    tokenizer = Engine.from_model(base_dir, EngineConfig(warmup=False, num_pages=16, page_size=8,
                                                         max_model_len=128)).tokenizer
    for line, ids in zip(lines, batch):
        line["prompt"] = tokenizer.decode(ids)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    flags = [f"--model={base_dir}", f"--input={inp}", f"--output={out}", "--enable_lora",
             f"--lora_modules=mlp4={paths['mlp4']},attn8={paths['attn8']}", "--max_loras=2", "--page_size=8",
             "--num_pages=64", "--max_model_len=128", f"--max_tokens={MAX_TOKENS}", "--ignore_eos", "--noprogress"]
    assert cli.main(["jaxserve", "generate", *flags]) == 0
    rows = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    encoded = [encode_text(tokenizer, line["prompt"]) for line in lines]  # as generate encodes them
    expected = [hf_greedy(torch_models[line["lora"]], ids) for line, ids in zip(lines, encoded)]
    assert [rows[line["id"]]["token_ids"] for line in lines] == expected, f"seed {SEED}"
    inp.write_text(json.dumps({"id": 9, "prompt": "x", "lora": "nope"}) + "\n")
    out.unlink()
    assert cli.main(["jaxserve", "generate", *flags]) == 2
    assert "id 9" in capsys.readouterr().err


def test_a_thousand_loads_and_unloads_beside_running_streams(server, models, tmp_path):
    """Hostile use of the run-time routes: a corrupt adapter and one whose config lies are 400s,
    and a thousand load/unload calls (every tenth adapter also used by a request) while two
    greedy streams run leave the streams' tokens unchanged and the server's memory flat."""
    import shutil
    import threading

    import psutil
    base_dir, paths, torch_models = models
    corrupt = tmp_path / "corrupt"
    shutil.copytree(paths["attn8"], corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    liar = tmp_path / "liar"
    shutil.copytree(paths["attn8"], liar)
    config = json.loads((liar / "adapter_config.json").read_text())
    (liar / "adapter_config.json").write_text(json.dumps({**config, "r": 4}))  # the tensors have rank 8
    for bad in (corrupt, liar, tmp_path / "missing"):
        response = requests.post(server.url + "/v1/load_lora_adapter",
                                 json={"lora_name": "bad", "lora_path": str(bad)}, timeout=30)
        assert response.status_code == 400 and "error" in response.json(), (bad, response.text)

    tokenizer = server.async_engine.tokenizer
    prompt = prompts(SEED + 3, 1)[0]
    expected = {name: tokenizer.decode(hf_greedy(torch_models[name], prompt, 48)) for name in (None, "attn8")}
    base_name = server.async_engine.model_name
    streamed, done = {}, threading.Event()

    def stream(name):
        with requests.post(server.url + "/v1/completions", json={
                "model": name or base_name, "prompt": prompt, "max_tokens": 48, "temperature": 0,
                "ignore_eos": True, "stream": True}, timeout=300, stream=True) as response:
            streamed[name] = streamed_text(response)

    threads = [threading.Thread(target=stream, args=(name,)) for name in expected]
    for thread in threads:
        thread.start()
    rss = psutil.Process().memory_info().rss
    for i in range(1000):
        response = requests.post(server.url + "/v1/load_lora_adapter",
                                 json={"lora_name": "churn", "lora_path": paths["mlp4"]}, timeout=30)
        assert response.status_code == 200, (i, response.text)
        if i % 10 == 0:
            assert completion(server, "churn", prompt[:4]).status_code == 200
        response = requests.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "churn"}, timeout=30)
        assert response.status_code == 200, (i, response.text)
        if i == 100:
            rss = psutil.Process().memory_info().rss  # once the caches (HTTP, compiled shapes) are warm
    grown = psutil.Process().memory_info().rss - rss
    for thread in threads:
        thread.join(300)
    assert streamed == expected, f"seed {SEED}"
    assert grown < 64 * 2**20, f"RSS grew {grown / 2**20:.1f} MiB over 900 load/unload calls"
    assert len(server.async_engine.engine.loras.slotted) <= 2


def test_ngram_speculation_and_int8_weights_under_adapters(models):
    """n-gram speculation's verification steps carry each row's slot at every position: the same
    greedy tokens as without it; over int8 base weights the adapters still change the output and
    speculation still gives the same tokens."""
    base_dir, paths, torch_models = models
    modules = tuple(LoRAModule(name, path) for name, path in paths.items())
    rng = np.random.default_rng(SEED + 4)
    motif = rng.integers(100, 49000, 6).tolist()
    batch = [motif * 4, prompts(SEED + 5, 1)[0], motif * 3 + [7, 8]]  # repetition: proposals get accepted
    names = ["attn8", "all16", None]
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, lora_name=n) for n in names]
    expected = [hf_greedy(torch_models[n], p, 16) for n, p in zip(names, batch)]
    engine_args = {**ENGINE, "max_loras": 3}
    for extra in ({}, {"quantization": "int8"}):
        plain = Engine.from_model(base_dir, EngineConfig(**engine_args, **extra, lora_modules=modules))
        speculating = Engine.from_model(base_dir, EngineConfig(**engine_args, **extra, lora_modules=modules,
                                                               speculative_method="ngram", num_speculative_tokens=3))
        tokens = [r.token_ids for r in plain.generate(batch, params)]
        assert [r.token_ids for r in speculating.generate(batch, params)] == tokens, f"{extra} seed {SEED}"
        assert speculating.scheduler.spec_stats.num_accepted_tokens > 0, "no proposal was accepted: proves nothing"
        if not extra:
            assert tokens == expected, f"seed {SEED}"
        else:
            base = [r.token_ids for r in plain.generate(batch, [SamplingParams(
                max_tokens=16, temperature=0.0, ignore_eos=True)] * 3)]
            assert tokens[0] != base[0] and tokens[1] != base[1], "int8: the adapters change nothing"


def run_to_end(engine) -> tuple[dict, dict]:
    """Steps until every request ended: ({request id: its last delta}, {request id: its tokens})."""
    last, tokens = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            last[out.request_id] = out
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return last, tokens


def test_an_unload_lets_admitted_requests_finish_and_an_unreadable_adapter_fails_only_its_own(models, tmp_path):
    import shutil
    base_dir, paths, torch_models = models
    attn8 = str(tmp_path / "attn8")
    shutil.copytree(paths["attn8"], attn8)
    # One slot and one adapter in host memory: attn8, read first, is evicted by mlp4 at the start.
    engine = Engine.from_model(base_dir, EngineConfig(**{**ENGINE, "max_loras": 1}, max_cpu_loras=1, lora_modules=(
        LoRAModule("attn8", attn8), LoRAModule("mlp4", paths["mlp4"]))))
    batch = prompts(SEED + 6, 3)
    greedy = lambda name: SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,  # noqa: E731
                                         lora_name=name)
    for i, name in enumerate(("mlp4", "attn8", None)):
        engine.add_request(f"r{i}", batch[i], greedy(name))
    engine.unload_lora_adapter("mlp4")  # r0 was admitted with it: it still runs with it
    shutil.rmtree(attn8)  # attn8 must be read again for r1, and cannot be
    last, tokens = run_to_end(engine)
    assert last["r1"].finish_reason == "error" and "'attn8' could not be read again" in last["r1"].error
    assert tokens["r0"] == hf_greedy(torch_models["mlp4"], batch[0]), f"seed {SEED}"
    assert tokens["r2"] == hf_greedy(torch_models[None], batch[2]), f"seed {SEED}"
    outputs = {r.request_id: r for r in engine.generate([batch[2]], [greedy(None)], request_ids=["again"])}
    assert outputs["again"].token_ids == hf_greedy(torch_models[None], batch[2])
    assert "mlp4" not in engine.loras and "attn8" not in engine.loras and not engine.loras.slotted
    with pytest.raises(ValueError, match="does not exist"):
        engine.check_request(batch[0], greedy("mlp4"))
    engine.load_lora_adapter("mlp4", paths["mlp4"])  # the name is free again once no request uses it
    result = engine.generate([batch[0]], [greedy("mlp4")])[0]
    assert result.token_ids == hf_greedy(torch_models["mlp4"], batch[0]), f"seed {SEED}"

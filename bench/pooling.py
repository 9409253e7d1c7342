"""Embedding speed: SmolLM2 served as an embedding model (--runner=pooling, last token, normalized)
against transformers in process, same run, same weights and inputs.

256 inputs of 64 random tokens (seeded; fresh ones each round, so no round hits the prefix cache
of an earlier one). transformers: the base model's last_hidden_state in
static batches of 32, the last token's row normalized. jaxserve: the same inputs through the engine
in process (`Engine.generate`, every input submitted at once), and through the server (a second
engine of the same config behind the app, stepped by the server's thread; 8 POST
/v1/embeddings of 32 token-id inputs each, sent together). Warm-ups excluded (one untimed pass
each); then `--rounds` rounds, each timing the three in turn (the order rotating), so that they
share whatever load the machine has; medians over the rounds, and each round's ratios. The
embeddings of both sides are compared (lowest cosine).

  python bench/pooling.py --out=bench/out/pooling.json
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from bench.hf_baseline import load_hf_model  # noqa: E402

NUM_INPUTS, INPUT_TOKENS, HF_BATCH = 256, 64, 32
SEED = 51


def hf_embeddings(model, inputs: np.ndarray) -> tuple[np.ndarray, float]:
    """transformers: static batches of HF_BATCH, the last row of last_hidden_state normalized."""
    import torch
    out, start = [], time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(inputs), HF_BATCH):
            hidden = model.model(torch.as_tensor(inputs[i:i + HF_BATCH])).last_hidden_state[:, -1]
            out.append(torch.nn.functional.normalize(hidden, dim=-1).numpy())
    return np.concatenate(out), time.perf_counter() - start


def engine_embeddings(engine, inputs: np.ndarray) -> tuple[np.ndarray, float]:
    from jaxserve.core.request import pooling_params
    from jaxserve.pooling.accumulate import finish_embedding
    start = time.perf_counter()
    results = engine.generate([list(map(int, ids)) for ids in inputs], pooling_params())
    seconds = time.perf_counter() - start
    return np.stack([finish_embedding(r.pooled, True) for r in results]), seconds


def server_embeddings(url: str, model_name: str, inputs: np.ndarray) -> tuple[np.ndarray, float]:
    import requests
    bodies = [{"model": model_name, "input": inputs[i:i + HF_BATCH].tolist()} for i in range(0, len(inputs), HF_BATCH)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda body: requests.post(url + "/v1/embeddings", json=body, timeout=600), bodies))
    seconds = time.perf_counter() - start
    vectors = [item["embedding"] for r in responses for item in r.json()["data"]]
    return np.asarray(vectors, np.float32), seconds


def start_server(engine) -> str:
    """The engine behind the app on a loopback port, in a thread with its own event loop."""
    from jaxserve.async_engine import AsyncEngine
    from serve.app import ServerConfig, create_app
    from serve.server import start_server as start_app
    loop = asyncio.new_event_loop()
    ready: concurrent.futures.Future = concurrent.futures.Future()

    async def main():
        _, port = await start_app(create_app(AsyncEngine(engine), ServerConfig(drain_timeout_s=1.0)), "127.0.0.1", 0)
        ready.set_result(port)

    threading.Thread(target=lambda: (loop.run_until_complete(main()), loop.run_forever()), daemon=True).start()
    return f"http://127.0.0.1:{ready.result(timeout=60)}"


def lowest_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.min(np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max_num_batched_tokens", type=int, default=2048)
    parser.add_argument("--max_num_prefill_seqs", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="jaxserve's --dtype (bfloat16 on the CPU: bfloat16 weights and prompt matmuls)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from checkpoints.default_model import resolve_model
    from jaxserve.config import EngineConfig
    from jaxserve.engine import Engine
    model_dir = resolve_model(args.model)
    inputs = np.random.default_rng(SEED).integers(100, 40000, (NUM_INPUTS, INPUT_TOKENS))
    config = EngineConfig(runner="pooling", pooler_config={"pooling_type": "LAST", "normalize": True},
                          max_num_seqs=64, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_num_prefill_seqs=args.max_num_prefill_seqs, max_model_len=128, dtype=args.dtype)
    start = time.perf_counter()
    engine = Engine.from_model(model_dir, config)
    load_s = time.perf_counter() - start
    hf_model, _ = load_hf_model(model_dir)
    url = start_server(Engine.from_model(model_dir, config))  # its own engine: the server's thread steps it
    engine_embeddings(engine, inputs[:HF_BATCH])  # one untimed pass each
    hf_embeddings(hf_model, inputs[:HF_BATCH])
    server_embeddings(url, engine.model_name, inputs[:HF_BATCH])
    sides = {"transformers": lambda inputs: hf_embeddings(hf_model, inputs),
             "in_process": lambda inputs: engine_embeddings(engine, inputs),
             "server": lambda inputs: server_embeddings(url, engine.model_name, inputs)}
    seconds = {name: [] for name in sides}
    vectors = {}
    for round_index in range(args.rounds):
        # Fresh inputs each round (the same for the three sides): no prefix-cache hit from an earlier round.
        inputs = np.random.default_rng([SEED, round_index]).integers(100, 40000, (NUM_INPUTS, INPUT_TOKENS))
        names = list(sides)[round_index % 3:] + list(sides)[:round_index % 3]
        for name in names:
            vectors[name], taken = sides[name](inputs)
            seconds[name].append(taken)
        print(f"round {round_index}: " + ", ".join(f"{n} {seconds[n][-1]:.2f} s" for n in sides), flush=True)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    result = {"machine": common.machine_line(common.machine_info(with_jax=True)), "load_average": common.load_average(),
              "inputs": NUM_INPUTS, "input_tokens": INPUT_TOKENS, "hf_batch": HF_BATCH,
              "engine": {"dtype": args.dtype, "max_num_batched_tokens": args.max_num_batched_tokens,
                         "max_num_prefill_seqs": args.max_num_prefill_seqs, "load_and_warmup_s": round(load_s, 1)},
              "seconds": {name: [round(v, 2) for v in values] for name, values in seconds.items()},
              "median_s": {name: round(v, 2) for name, v in median.items()},
              "in_process_ratio": round(median["in_process"] / median["transformers"], 3),
              "server_ratio": round(median["server"] / median["transformers"], 3),
              "round_ratios": [round(s / h, 3) for s, h in zip(seconds["server"], seconds["transformers"])],
              "lowest_cosine_in_process": lowest_cosine(vectors["in_process"], vectors["transformers"]),
              "lowest_cosine_server": lowest_cosine(vectors["server"], vectors["transformers"])}
    print(json.dumps(result, indent=2))
    if args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    os._exit(0)  # the server thread and the engine's threads end with the process


if __name__ == "__main__":
    main()

"""Multi-host serving (jaxserve.parallel.multihost) on this machine: what sending each step to the other
processes costs, and tokens/s for 1, 2 and 3 processes.

    .venv/bin/python bench/multihost.py [--out=bench/out/multihost.json] [--parts=transport,engine]

transport: N processes x 1 CPU device joined by jax.distributed on 127.0.0.1. Each step process 0
  sends a payload of S bytes to the others, through the distributed runtime's key-value store
  (jaxserve.parallel.multihost.StepChannel, what the engine uses) or `multihost_utils.broadcast_one_to_all`
  (a device collective), then every process runs a small jitted all-reduce over the global mesh
  (the lockstep that a real step imposes). The overhead of a transport is the median step time
  minus that of the same loop without sending.
engine: a random Llama of SmolLM2's size and shape (30 layers, 576 wide, 1536 MLP, vocabulary
  49152), but 12 query / 6 KV heads so that it splits over 2 and 3 devices (SmolLM2's 9 heads
  split over 3 only); greedy at TP = N over N processes (1 CPU device each; N = 1 is the plain
  single-process engine), 8 prompts x 32 tokens: one pass to compile the shapes it uses, then a
  timed pass. Output tokens/s, steps, and process 0's bytes and ms of packing + sending per step.

Every process is a subprocess of this script (the same file, --role=...), killed in a finally.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = (1024, 8 * 1024, 64 * 1024, 1024 * 1024)
PROMPT_LENGTHS = (5, 9, 17, 24, 33, 12, 7, 40)
MODEL_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_q_heads=12,
                   num_kv_heads=6, head_dim=48, tie=True)


def make_model(path: str) -> str:
    """The engine part's model, converted once into `path`."""
    if not os.path.exists(os.path.join(path, "config.json")):
        sys.path.insert(0, REPO)
        from checkpoints.convert import convert_checkpoint
        from tests.tiny_models import make_tiny_hf_model
        make_tiny_hf_model(path + ".hf", **MODEL_SHAPE)
        convert_checkpoint(path + ".hf", path, overwrite=True)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(args) -> None:
    from jaxserve.parallel import multihost
    multihost.join(multihost.JoinOptions(f"127.0.0.1:{args.port}", args.num_processes, args.process_id))


def _median_ms(samples) -> float:
    import numpy as np
    return float(np.median(samples) * 1000)


def transport_child(args) -> dict | None:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxserve.parallel import multihost, multihost_front

    _join(args)
    pid = args.process_id
    mesh = jax.make_mesh((jax.device_count(),), ("x",), devices=jax.devices())
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), np.ones(1, np.float32))
    reduce = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))

    def step():
        reduce(x).addressable_data(0).block_until_ready()

    def timed(body, steps):
        for _ in range(5):
            body()
        samples = []
        for _ in range(steps):
            start = time.perf_counter()
            body()
            samples.append(time.perf_counter() - start)
        return _median_ms(samples)

    channel = multihost.StepChannel()
    result = {"allreduce_only_ms": timed(step, args.steps)}
    for size in SIZES:
        payload = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
        data = payload.tobytes()

        def kv_step():
            if pid == 0:
                channel.send(data)
            else:
                assert len(channel.receive()) == size
            step()

        def broadcast_step():
            out = multihost_utils.broadcast_one_to_all(payload if pid == 0 else np.zeros_like(payload))
            assert out.shape == payload.shape
            step()
        result[str(size)] = {"kv_store_ms": timed(kv_step, args.steps),
                             "broadcast_ms": timed(broadcast_step, args.steps)}
    multihost_front.leave() if pid else time.sleep(2)
    return result if pid == 0 else None


def engine_child(args) -> dict | None:
    from jaxserve.config import EngineConfig
    from jaxserve.engine import Engine
    from jaxserve.parallel import multihost_front
    import numpy as np

    from jaxserve.core.request import SamplingParams

    if args.num_processes > 1:
        _join(args)
    cfg = EngineConfig(tensor_parallel_size=args.tp or args.num_processes, max_num_seqs=8, max_num_batched_tokens=128,
                       max_model_len=256, num_pages=80, warmup=False)
    engine = Engine.from_model(args.model, cfg)
    if args.process_id:
        multihost_front.follow(engine)
        multihost_front.leave()
        return None
    front = None
    if args.num_processes > 1:
        front = multihost_front.Front()
        front.attach(engine)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, MODEL_SHAPE["vocab_size"], n).tolist() for n in PROMPT_LENGTHS]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    engine.generate(prompts, params)  # compiles the shapes these steps use
    steps, sent, seconds = (front.num_steps, front.broadcast_bytes, front.broadcast_seconds) if front else (0, 0, 0.0)
    steps_before = engine.num_steps
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    out = {"processes": args.num_processes, "tp": cfg.tensor_parallel_size, "output_tokens": tokens,
           "seconds": round(elapsed, 3),
           "tokens_per_s": round(tokens / elapsed, 2), "steps": engine.num_steps - steps_before,
           "token_ids": [r.token_ids for r in results]}
    if front is not None:
        n = front.num_steps - steps
        out.update(send_bytes_per_step=round((front.broadcast_bytes - sent) / n),
                   send_ms_per_step=round(1000 * (front.broadcast_seconds - seconds) / n, 3))
        front.stop()
    return out


def run_job(role: str, num_processes: int, extra: list[str], timeout_s: float, devices: int = 1) -> dict:
    """Runs `num_processes` children of this script (`devices` CPU devices each); process 0's result."""
    port = _free_port()
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": REPO}
    procs = []
    try:
        for i in range(num_processes):
            procs.append(subprocess.Popen(
                [sys.executable, __file__, f"--role={role}", f"--num_processes={num_processes}", f"--process_id={i}",
                 f"--port={port}", *extra], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True))
        outputs = [p.communicate(timeout=timeout_s) for p in procs]
        for i, (p, (_, err)) in enumerate(zip(procs, outputs)):
            if p.returncode:
                raise RuntimeError(f"{role} process {i} of {num_processes} failed:\n{err[-3000:]}")
        line = next(l for l in outputs[0][0].splitlines() if l.startswith("RESULT "))
        return json.loads(line[len("RESULT "):])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", default=None)
    parser.add_argument("--num_processes", type=int, default=1)
    parser.add_argument("--process_id", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--parts", default="transport,engine")
    parser.add_argument("--model", default=os.path.join(REPO, "bench", "out", "multihost_model"))
    parser.add_argument("--tp", type=int, default=0, help="(engine child) TP size; default: the processes")
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "out", "multihost.json"))
    args = parser.parse_args()
    if args.role is not None:  # a child process
        result = (transport_child if args.role == "transport" else engine_child)(args)
        if result is not None:
            print("RESULT " + json.dumps(result), flush=True)
        return 0

    report = {"machine": f"{os.cpu_count()} cores, CPU devices, gloo between processes on 127.0.0.1"}
    parts = args.parts.split(",")
    if "transport" in parts:
        report["transport"] = {n: run_job("transport", n, [f"--steps={args.steps}"], 600) for n in (2, 3)}
        for n, result in report["transport"].items():
            print(f"{n} processes: all-reduce only {result['allreduce_only_ms']:.2f} ms/step")
            for size in SIZES:
                r = result[str(size)]
                print(f"  {size:>8} B: kv store +{r['kv_store_ms'] - result['allreduce_only_ms']:.2f} ms, "
                      f"broadcast_one_to_all +{r['broadcast_ms'] - result['allreduce_only_ms']:.2f} ms")
    if "engine" in parts:
        make_model(args.model)
        model = f"--model={args.model}"
        report["engine"] = {f"{n} processes, TP {n}": run_job("engine", n, [model], 900) for n in (1, 2, 3)}
        report["engine"].update({f"1 process, TP {n}": run_job("engine", 1, [model, f"--tp={n}"], 900, devices=n)
                                 for n in (2, 3)})
        reference = report["engine"]["1 processes, TP 1"]["token_ids"]
        for name, result in report["engine"].items():
            result["same_tokens_as_one_process_tp1"] = result.pop("token_ids") == reference
            result["ms_per_step"] = round(1000 * result["seconds"] / result["steps"], 1)
            print(name, json.dumps(result))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

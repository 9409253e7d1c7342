"""A cold start beside CPU-bound neighbours: how soon `jaxserve serve` is ready and serves.

From empty compilation and executable caches (a fresh $JAXSERVE_CACHE; the model already
converted and the CPU kernels built, both read from the usual cache), with `--burners`
CPU-bound processes running beside the server the whole time:
  1. launch `jaxserve serve` and poll /health until 200 (time to ready);
  2. at once, `--concurrency` greedy completions of `--max_tokens` tokens together (cold batch),
     and beside them one with a presence penalty and one with prompt logprobs (their shapes
     compile after ready: they wait for them, taken next);
  3. wait (at most --warm_timeout s from launch) until /health reports every warm-up shape
     compiled, then the same batch again (warm), still beside the neighbours;
while a thread times every /health call from launch to the end (its slowest answer is what a
liveness probe would see). Prints one JSON line; the figures go to bench/RESULTS.md ("Start
time beside CPU-bound processes").

    .venv/bin/python bench/start_under_load.py [--model=smollm2] [--burners=2] [--concurrency=8]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxserve import environment  # noqa: E402  (no jax)

BURNER = "while True: pass"


def _get(url: str, timeout: float = 30.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


# Requests whose shapes compile after ready (a sampler with penalties, the prompt-logprob function).
EXTRA_KINDS = {"presence_penalty": {"presence_penalty": 0.5}, "prompt_logprobs": {"prompt_logprobs": 1}}


def _complete(base: str, prompt: str, max_tokens: int, timeout: float, extra: dict | None = None) -> float | None:
    """Seconds of one greedy completion (with the `extra` fields); None when it took longer than
    `timeout` (the client gave up)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       **(extra or {})}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            payload = json.loads(response.read())
    except TimeoutError:
        return None
    assert payload["usage"]["completion_tokens"] == max_tokens, payload
    return time.perf_counter() - start


def _batch(base: str, concurrency: int, max_tokens: int, timeout: float) -> dict:
    """`concurrency` different completions sent together, with one of each EXTRA_KINDS beside
    them: the batch's wall time and each one's (`timed_out`: how many the client gave up on after
    `timeout` seconds), and each extra kind's seconds (None: timed out)."""
    prompts = [f"Question {i}: name a city in Europe and say why people visit it." for i in range(concurrency)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency + len(EXTRA_KINDS)) as pool:
        extras = {kind: pool.submit(_complete, base, "Tell me about Paris.", max_tokens, timeout, fields)
                  for kind, fields in EXTRA_KINDS.items()}
        each = list(pool.map(lambda p: _complete(base, p, max_tokens, timeout), prompts))
        wall = time.perf_counter() - start
        extra_s = {kind: future.result() for kind, future in extras.items()}
    done = sorted(s for s in each if s is not None)
    return {"wall_s": round(wall, 3), "timed_out": len(each) - len(done),
            "slowest_s": round(done[-1], 3) if done else None, "median_s": round(done[len(done) // 2], 3) if done else None,
            **{f"{kind}_s": None if s is None else round(s, 3) for kind, s in extra_s.items()}}


class HealthProbe:
    """Times GET /health every `interval` seconds on a thread of its own."""

    def __init__(self, base: str, interval: float = 0.2) -> None:
        self.base, self.interval = base, interval
        self.seconds: list[float] = []
        self.status = None
        self.body: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                self.status, self.body = _get(f"{self.base}/health")
                self.seconds.append(time.perf_counter() - start)
            except (urllib.error.URLError, ConnectionError, OSError):
                pass  # not listening yet
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _stop(server: subprocess.Popen, patience: float = 60.0) -> float | None:
    """Seconds from SIGTERM to the server's exit; None when it had not exited after `patience`
    seconds (then killed)."""
    start = time.perf_counter()
    server.terminate()
    try:
        server.wait(patience)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
        return None
    return round(time.perf_counter() - start, 1)


def run(args) -> dict:
    base = f"http://127.0.0.1:{args.port}"
    burners = [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(args.burners)]
    caches = tempfile.mkdtemp(prefix="jaxserve-cold-")
    usual = environment.cache_root()
    model = os.path.join(usual, "models", args.model) if args.model == "smollm2" else args.model
    env = {**os.environ, environment.CACHE: caches, "JAXSERVE_KERNEL_CACHE": os.path.join(usual, "cpu_kernels")}
    env.pop(environment.COMPILATION_CACHE, None)
    env.pop(environment.EXECUTABLES_CACHE, None)
    log = open(os.path.join(caches, "serve.log"), "w")
    launch = time.perf_counter()
    server = subprocess.Popen([args.jaxserve, "serve", f"--model={model}", f"--port={args.port}", *args.serve_flag],
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    probe = HealthProbe(base)
    try:
        while probe.status != 200:
            if server.poll() is not None:
                raise SystemExit(f"the server exited; see {log.name}")
            time.sleep(0.05)
        ready_s = time.perf_counter() - launch
        at_ready = dict(probe.body.get("warmup") or {})
        cold = _batch(base, args.concurrency, args.max_tokens, args.request_timeout)
        cold_done_s = time.perf_counter() - launch
        warm_s = warm = None
        while time.perf_counter() - launch < args.warm_timeout:
            warmup = probe.body.get("warmup") or {}
            if warmup.get("compiled") == warmup.get("total"):
                warm_s = time.perf_counter() - launch
                warm = _batch(base, args.concurrency, args.max_tokens, args.request_timeout)
                break
            time.sleep(0.2)
        at_end = dict(probe.body.get("warmup") or {})
    finally:
        probe.stop()
        stop_s = _stop(server)
        for burner in burners:
            burner.kill()
    return {"shutdown_s": stop_s, "model": args.model, "burners": args.burners, "concurrency": args.concurrency,
            "max_tokens": args.max_tokens, "ready_s": round(ready_s, 1), "warmup_at_ready": at_ready,
            "cold_batch": cold, "cold_batch_done_s": round(cold_done_s, 1),
            "warmup_done_s": None if warm_s is None else round(warm_s, 1), "warmup_at_end": at_end, "warm_batch": warm,
            "cold_over_warm": None if warm is None or cold["timed_out"] else round(cold["wall_s"] / warm["wall_s"], 2),
            "health_calls": len(probe.seconds), "health_slowest_s": round(max(probe.seconds), 3),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--port", type=int, default=8331)
    parser.add_argument("--burners", type=int, default=2, help="CPU-bound processes beside the server")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max_tokens", type=int, default=16)
    parser.add_argument("--jaxserve", default=os.path.join(os.path.dirname(sys.executable), "jaxserve"))
    parser.add_argument("--serve_flag", action="append", default=[], help="an extra flag of jaxserve serve")
    parser.add_argument("--request_timeout", type=float, default=300, help="a client's patience, in seconds")
    parser.add_argument("--warm_timeout", type=float, default=900,
                        help="seconds from launch to wait for the warm-up's end (then no warm batch)")
    print(json.dumps(run(parser.parse_args())))


if __name__ == "__main__":
    main()

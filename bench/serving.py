"""Serving load generator: streaming /v1/completions at several concurrency levels.

For each level, `--num_requests` requests (default 4 x concurrency, at least 8) are sent by that
many concurrent clients; each streams its completion (stream_options.include_usage) and the
client times the chunks. Reported per level: request throughput, output tokens/s, TTFT, TPOT,
ITL and end-to-end latency (mean, P50, P99, in ms), failed requests. JSON report, a printed table
and, when matplotlib is installed, a PNG of throughput and P99 TTFT against concurrency.

  python bench/serving.py --launch --model=smollm2 --out=bench/out/serving.json
  python bench/serving.py --url=http://127.0.0.1:8000 --concurrency=1,8 --prompts=random --input_len=256
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

CHAT_PROMPTS = [
    "Explain in simple terms how a refrigerator keeps food cold.",
    "Write a short poem about the first snow of winter.",
    "What are three tips for staying focused while studying?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do I make a simple tomato sauce for pasta?",
    "Describe the water cycle to a ten-year-old.",
    "What is the difference between a virus and a bacterium?",
    "Give me a packing list for a weekend camping trip.",
    "Why is the sky blue during the day and red at sunset?",
    "Write a friendly email inviting a colleague to lunch.",
    "List some good habits for writing clean Python code.",
    "What should I consider before adopting a dog?",
    "Explain what a prime number is, with examples.",
    "Tell me a short story about a robot who learns to paint.",
    "How does compound interest work?",
    "What are the main causes of ocean tides?",
]
RANDOM_TOKEN_RANGE = (100, 5000)  # inside the vocabulary of every Llama-family tokenizer


def build_prompts(kind: str, num: int, input_len: int, seed: int) -> list:
    """Chat prompts as text (cycled) or random token-id prompts of `input_len` tokens."""
    rng = random.Random(seed)
    if kind == "chat":
        return [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(num)]
    return [[rng.randrange(*RANDOM_TOKEN_RANGE) for _ in range(input_len)] for _ in range(num)]


async def stream_completion(session: aiohttp.ClientSession, url: str, prompt, max_tokens: int, *,
                            ignore_eos: bool = True, temperature: float = 0.0) -> dict:
    """One streaming completion. Returns its timings (seconds since its own start) and outcome:
    ok, error (message), completion_tokens, ttft, itl (gaps between text chunks), tpot, e2e."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    result = dict(ok=False, error=None, completion_tokens=0, ttft=None, itl=[], tpot=None, e2e=None,
                  finish_reason=None)
    start = time.perf_counter()
    chunk_times: list[float] = []
    done = False
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            text = await response.text()
            try:
                text = json.loads(text)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            result["error"] = f"HTTP {response.status}: {text}"
            return result
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                done = True
                break
            event = json.loads(payload)
            if "error" in event:
                result["error"] = f"error event: {event['error'].get('message')}"
                return result
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    chunk_times.append(time.perf_counter() - start)
                if choice.get("finish_reason"):
                    result["finish_reason"] = choice["finish_reason"]
            if event.get("usage"):
                result["completion_tokens"] = event["usage"]["completion_tokens"]
    result["e2e"] = time.perf_counter() - start
    if not done or result["finish_reason"] is None:
        result["error"] = "the stream ended without a finish_reason and [DONE]"
        return result
    result["ok"] = True
    if chunk_times:
        result["ttft"] = chunk_times[0]
        result["itl"] = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
        if result["completion_tokens"] > 1:
            result["tpot"] = (chunk_times[-1] - chunk_times[0]) / (result["completion_tokens"] - 1)
    return result


async def run_level(url: str, prompts: list, concurrency: int, max_tokens: int, timeout_s: float) -> dict:
    """Sends every prompt with `concurrency` clients; returns the level's summary."""
    results: list[dict] = []
    next_index = 0
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def client(session):
        nonlocal next_index
        while next_index < len(prompts):
            prompt = prompts[next_index]
            next_index += 1
            try:
                results.append(await stream_completion(session, url, prompt, max_tokens))
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                results.append(dict(ok=False, error=f"{type(e).__name__}: {e}", completion_tokens=0, itl=[]))

    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        duration = time.perf_counter() - start
    ok = [r for r in results if r["ok"]]
    output_tokens = sum(r["completion_tokens"] for r in ok)
    return dict(
        concurrency=concurrency, num_requests=len(results), completed=len(ok), failed=len(results) - len(ok),
        errors=sorted({r["error"] for r in results if not r["ok"]})[:5], duration_s=duration,
        request_throughput=len(ok) / duration, output_tokens=output_tokens,
        output_tokens_per_s=output_tokens / duration,
        ttft_ms=common.summarize([r["ttft"] for r in ok], 1e3),
        tpot_ms=common.summarize([r["tpot"] for r in ok], 1e3),
        itl_ms=common.summarize([gap for r in ok for gap in r["itl"]], 1e3),
        e2e_ms=common.summarize([r["e2e"] for r in ok], 1e3))


async def run_all(url: str, args) -> list[dict]:
    warmup = build_prompts(args.prompts, 1, min(args.input_len, 16), args.seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.timeout_s)) as session:
        await stream_completion(session, url, warmup[0], 2)  # not timed
    levels = []
    for concurrency in args.concurrency:
        num = args.num_requests or max(8, 4 * concurrency)
        prompts = build_prompts(args.prompts, num, args.input_len, args.seed + concurrency)
        level = await run_level(url, prompts, concurrency, args.output_len, args.timeout_s)
        print(f"concurrency {concurrency}: {level['completed']}/{level['num_requests']} ok, "
              f"{level['output_tokens_per_s']:.1f} output tok/s", file=sys.stderr, flush=True)
        levels.append(level)
    return levels


def print_table(levels: list[dict]) -> None:
    rows = []
    for lv in levels:
        row = {k: lv[k] for k in ("concurrency", "completed", "failed", "request_throughput", "output_tokens_per_s")}
        for metric in ("ttft", "tpot", "itl", "e2e"):
            for stat in ("mean", "p50", "p99"):
                row[f"{metric}_{stat}"] = lv[f"{metric}_ms"][stat]
        rows.append(row)
    columns = [("concurrency", "conc", "d"), ("completed", "ok", "d"), ("failed", "fail", "d"),
               ("request_throughput", "req/s", ".2f"), ("output_tokens_per_s", "out tok/s", ".1f")]
    for metric in ("ttft", "tpot", "itl", "e2e"):
        columns += [(f"{metric}_{s}", f"{metric.upper()} {s} ms", ".0f") for s in ("mean", "p50", "p99")]
    print(common.format_table(rows, columns))


def plot(levels: list[dict], path: str) -> str | None:
    """Output tokens/s and P99 TTFT against concurrency; None when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    xs = [lv["concurrency"] for lv in levels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(xs, [lv["output_tokens_per_s"] for lv in levels], marker="o")
    left.set(xlabel="concurrency", ylabel="output tokens/s", title="throughput")
    right.plot(xs, [lv["ttft_ms"]["p99"] for lv in levels], marker="o", color="tab:red")
    right.set(xlabel="concurrency", ylabel="ms", title="P99 time to first token")
    for ax in (left, right):
        ax.set_xticks(xs)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    target.add_argument("--launch", action="store_true", help="start `jaxserve serve` on a free loopback port")
    parser.add_argument("--model", default="smollm2", help="with --launch: the model to serve")
    parser.add_argument("--server_args", default="", help="with --launch: extra `jaxserve serve` flags")
    parser.add_argument("--concurrency", default="1,8,16,32", help="comma list of concurrency levels")
    parser.add_argument("--num_requests", type=int, default=0, help="per level (default 4 x concurrency, >= 8)")
    parser.add_argument("--prompts", choices=["chat", "random"], default="chat",
                        help="built-in chat prompts (text) or random token-id prompts of --input_len")
    parser.add_argument("--input_len", type=int, default=128, help="tokens per random prompt")
    parser.add_argument("--output_len", type=int, default=64, help="max_tokens (ignore_eos: all of them)")
    parser.add_argument("--timeout_s", type=float, default=600.0, help="per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON report path")
    parser.add_argument("--plot", default=None, help="PNG path (default: next to --out)")
    args = parser.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--concurrency must be a comma list of integers, got {args.concurrency!r}")
    if not args.concurrency or min(args.concurrency) < 1:
        parser.error("--concurrency levels must be >= 1")
    for name in ("input_len", "output_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    report = dict(machine=common.machine_info(), prompts=args.prompts, input_len=args.input_len,
                  output_len=args.output_len)
    try:
        if args.launch:
            with common.ServerProcess(args.model, shlex.split(args.server_args)) as server:
                print(f"server up on {server.url} after {server.start_seconds:.1f}s", file=sys.stderr, flush=True)
                report.update(server=dict(model=args.model, args=args.server_args, start_s=server.start_seconds))
                levels = asyncio.run(run_all(server.url, args))
        else:
            report.update(server=dict(url=args.url))
            levels = asyncio.run(run_all(args.url.rstrip("/"), args))
    except (RuntimeError, aiohttp.ClientError, asyncio.TimeoutError) as e:
        print(f"serving: {e}", file=sys.stderr)
        return 2
    report["machine_line"] = common.machine_line(report["machine"])
    report["levels"] = levels
    print(report["machine_line"])
    print_table(levels)
    common.write_json(args.out, report)
    plot_path = args.plot or (os.path.splitext(args.out)[0] + ".png" if args.out else None)
    if plot_path:
        written = plot(levels, plot_path)
        print(f"plot: {written}" if written else "plot skipped: matplotlib is not installed", file=sys.stderr)
    return 1 if any(lv["failed"] for lv in levels) else 0


if __name__ == "__main__":
    sys.exit(main())

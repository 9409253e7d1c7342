"""Soak test: minutes of mixed streaming load, with clients that disconnect mid-stream, against a
launched `jaxserve serve`; the server's RSS and `jaxserve_kv_pages_used` sampled every few seconds.

Passes (exit 0) when
  - every request completed, or was cut by its own client (a disconnect the server must abort);
  - memory is flat after warm-up: over the second half of the run the RSS grew by less than
    --rss_tolerance (median of the last fifth of the samples against the median of the first fifth);
  - the KV pages return to 0 (and no request is left running or waiting) once the load stops;
  - the server answered no 5xx, ended no request with an error, counted no failed engine step
    (/health num_step_failures), and wrote no "Traceback" to its log;
  - with --hostile_every_s, every hostile request (bench/hostile.py: bad sampling values, a 4 MB
    prompt, lone surrogates, malformed HTTP on a raw socket, half-open connections), sent one
    every that many seconds alongside the load, got its expected 4xx (half-open sockets: closed by
    the server).
Exit 1 otherwise; the JSON report says which check failed. It also holds the sampled time series
(`samples`: elapsed s, RSS MiB, KV pages used, requests running / waiting), the hostile requests by
kind and status, and the server log's WARNING / ERROR line and Traceback counts. The server's log
goes next to --out (`<out>.server.log`).

  python bench/soak.py --minutes=10 --model=smollm2 --out=bench/out/soak.json
  python bench/soak.py --minutes=30 --hostile_every_s=2 --out=bench/out/soak_hostile.json
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import re
import shlex
import sys
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from bench.hostile import Hostile  # noqa: E402
from jaxserve.benchmarks import client  # noqa: E402

CHAT_PROMPTS = [
    "Explain in simple terms how a refrigerator keeps food cold.",
    "Write a short poem about the first snow of winter.",
    "What are three tips for staying focused while studying?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do I make a simple tomato sauce for pasta?",
    "Describe the water cycle to a ten-year-old.",
    "What is the difference between a virus and a bacterium?",
    "Give me a packing list for a weekend camping trip.",
]
RANDOM_TOKEN_RANGE = (100, 5000)  # inside the vocabulary of every Llama-family tokenizer

CHAT_PROMPT_TOKENS = 64  # more than any built-in chat prompt takes
# Every sample carries the served model's name (model_name="..."); "unlabelled" means no other label.
_METRIC_LINE = re.compile(r'^(jaxserve_[a-z_]+)(?:\{model_name="[^"]*"\})?\s+([-+0-9.eE]+|NaN)$', re.MULTILINE)
_FINISHED_LINE = re.compile(r'^jaxserve_requests_finished(?:_total)?\{([^}]*)\}\s+([-+0-9.eE]+)$', re.MULTILINE)
_REASON_LABEL = re.compile(r'finish_reason="(\w+)"')
_HTTP_LINE = re.compile(r'^jaxserve_http_requests(?:_total)?\{([^}]*)\}\s+([-+0-9.eE]+)$', re.MULTILINE)
_STATUS_LABEL = re.compile(r'status="(\d+)"')
_LOG_LEVEL = re.compile(r"^\S+ \S+ (WARNING|ERROR|CRITICAL) (\S+): (.*)$")  # jaxserve serve's log format
DEFAULT_HEADER_TIMEOUT_S = 10.0  # jaxserve serve --header_timeout_s


def server_flag(server_args: str, name: str, default: float) -> float:
    """The value of `--name=value` (or `--name value`) in the server's flags, else `default`."""
    match = re.search(rf"--{name}(?:=|\s+)(\S+)", server_args)
    return float(match.group(1)) if match else default


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (psutil when installed, else /proc)."""
    try:
        import psutil
        return psutil.Process(pid).memory_info().rss
    except ImportError:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def scrape(session: aiohttp.ClientSession, url: str) -> dict:
    """`parse_metrics` of the server's /metrics."""
    async with session.get(url + "/metrics") as response:
        return parse_metrics(await response.text())


def parse_metrics(text: str) -> dict:
    """From /metrics' text: the unlabelled jaxserve_* samples (kv pages used, running, waiting, ...),
    finished requests by reason, HTTP responses by status (all routes) and the 5xx among them
    outside /health."""
    gauges = {name: float(value) for name, value in _METRIC_LINE.findall(text)}
    finished = {_REASON_LABEL.search(labels).group(1): float(value) for labels, value in _FINISHED_LINE.findall(text)
                if _REASON_LABEL.search(labels)}
    http_status: dict[str, float] = collections.Counter()
    http_5xx = 0.0  # server errors: every route's but /health's, whose 503 while warming up is its answer
    for labels, value in _HTTP_LINE.findall(text):
        status = _STATUS_LABEL.search(labels)
        code = status.group(1) if status else "?"
        http_status[code] += float(value)
        if code.startswith("5") and 'route="/health"' not in labels:
            http_5xx += float(value)
    return dict(gauges=gauges, finished=finished, http_status=dict(http_status), http_5xx=http_5xx)


def scan_server_log(path: str) -> dict:
    """WARNING / ERROR lines (with their most frequent messages, digits masked) and "Traceback"
    occurrences in the server's log (its stdout and stderr)."""
    levels: collections.Counter = collections.Counter()
    messages: collections.Counter = collections.Counter()
    tracebacks = 0
    with open(path, errors="replace") as f:
        for line in f:
            tracebacks += line.count("Traceback")
            match = _LOG_LEVEL.match(line.rstrip("\n"))
            if match:
                level, text = match.group(1), f"{match.group(2)}: {match.group(3)}"
            else:  # another format (a library's own handler, a Python warning)
                word = re.search(r"\b(CRITICAL|ERROR|WARNING)\b|\w+Warning:", line)
                if not word:
                    continue
                level, text = word.group(1) or "WARNING", line.strip()
            levels[level] += 1
            messages[f"{level} {re.sub(r'[0-9]+', 'N', text)[:120]}"] += 1
    return dict(path=path, warning_lines=levels["WARNING"], error_lines=levels["ERROR"] + levels["CRITICAL"],
                tracebacks=tracebacks, top_messages=dict(messages.most_common(10)))


class Soak:
    def __init__(self, url: str, pid: int, args):
        self.url, self.pid, self.args = url, pid, args
        self.rng = random.Random(args.seed)
        self.counts = dict(completed=0, disconnected=0, failed=0)
        self.errors: list[str] = []
        self.samples: list[dict] = []
        self.output_tokens = 0
        self.max_model_len: int | None = None  # read from /v1/models: requests must fit in it
        self.model = ""  # the served model's id, from /v1/models
        self.server_finished: dict[str, float] = {}  # the server's count of finished requests by reason
        self.server_http_status: dict[str, float] = {}
        self.server_5xx = 0.0
        self.hostile: Hostile | None = None
        self.health: dict = {}  # /health at the end (num_step_failures)

    def next_request(self) -> tuple[object, int, float | None]:
        """(prompt, max_tokens, seconds after which the client hangs up or None)."""
        a = self.args
        room = self.max_model_len or 1 << 30
        if self.rng.random() < 0.5:
            prompt = self.rng.choice(CHAT_PROMPTS)
            room -= CHAT_PROMPT_TOKENS
        else:
            length = min(self.rng.randint(a.min_input_len, a.max_input_len), room // 2)
            prompt = [self.rng.randrange(*RANDOM_TOKEN_RANGE) for _ in range(length)]
            room -= length
        max_tokens = max(1, min(self.rng.randint(a.min_output_len, a.max_output_len), room - 1))
        hang_up = self.rng.uniform(0.05, a.max_disconnect_s) if self.rng.random() < a.disconnect_fraction else None
        return prompt, max_tokens, hang_up

    async def client(self, session: aiohttp.ClientSession, deadline: float) -> None:
        while time.monotonic() < deadline:
            prompt, max_tokens, hang_up = self.next_request()
            spec = client.RequestSpec(prompt, len(prompt) if isinstance(prompt, list) else 0, max_tokens)
            body = client.request_body("completions", self.model, spec, temperature=0.0, ignore_eos=True)
            request = client.send(session, self.url + "/v1/completions", "completions", body, spec.prompt_len)
            try:
                record = await asyncio.wait_for(request, hang_up) if hang_up else await request
            except asyncio.TimeoutError:  # only wait_for's: the client's own timeout is kept in the record
                self.counts["disconnected"] += 1  # wait_for closed the connection mid-request
                continue
            if record.ok:
                self.counts["completed"] += 1
                self.output_tokens += record.usage_completion_tokens or 0
            else:
                self.counts["failed"] += 1
                if len(self.errors) < 10:
                    self.errors.append(record.error)

    async def sampler(self, session: aiohttp.ClientSession, start: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.sample(session, start)
            try:
                await asyncio.wait_for(stop.wait(), self.args.sample_s)
            except asyncio.TimeoutError:
                pass

    async def sample(self, session: aiohttp.ClientSession, start: float) -> dict:
        metrics = await scrape(session, self.url)
        gauges = metrics["gauges"]
        self.server_finished, self.server_5xx = metrics["finished"], metrics["http_5xx"]
        self.server_http_status = metrics["http_status"]
        sample = dict(t=time.monotonic() - start, rss_mib=rss_bytes(self.pid) / 2**20,
                      kv_pages_used=gauges.get("jaxserve_kv_pages_used"),
                      running=gauges.get("jaxserve_num_requests_running"),
                      waiting=gauges.get("jaxserve_num_requests_waiting"), **dict(self.counts))
        self.samples.append(sample)
        return sample

    async def hostile_loop(self, deadline: float) -> None:
        """One hostile request every --hostile_every_s until the deadline, then waits for them all."""
        while time.monotonic() + self.args.hostile_every_s < deadline:
            await asyncio.sleep(self.args.hostile_every_s)
            self.hostile.fire()
        await self.hostile.wait()

    async def run(self) -> dict:
        a = self.args
        timeout = aiohttp.ClientTimeout(total=a.request_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            async with session.get(self.url + "/v1/models") as response:
                served = (await response.json())["data"][0]
            self.model, self.max_model_len = served["id"], served.get("max_model_len")
            start = time.monotonic()
            deadline = start + 60 * a.minutes
            stop = asyncio.Event()
            sampler = asyncio.create_task(self.sampler(session, start, stop))
            load = [self.client(session, deadline) for _ in range(a.concurrency)]
            if a.hostile_every_s:
                self.hostile = Hostile(self.url, a.seed, self.max_model_len, server_flag(
                    a.server_args, "header_timeout_s", DEFAULT_HEADER_TIMEOUT_S))
                await self.hostile.__aenter__()
                load.append(self.hostile_loop(deadline))
            try:
                await asyncio.gather(*load)
            finally:
                if self.hostile:
                    await self.hostile.__aexit__(None, None, None)
            stop.set()
            await sampler
            final = await self.sample(session, start)
            settle_deadline = time.monotonic() + a.settle_s  # aborts are applied by the engine loop
            while (final["kv_pages_used"] or final["running"] or final["waiting"]) and \
                    time.monotonic() < settle_deadline:
                await asyncio.sleep(0.5)
                final = await self.sample(session, start)
            async with session.get(self.url + "/health") as response:
                self.health = await response.json()
        return self.verdict(final, time.monotonic() - start)

    def verdict(self, final: dict, duration: float) -> dict:
        a = self.args
        load = [s for s in self.samples if s["t"] <= 60 * a.minutes]
        second_half = [s["rss_mib"] for s in load if s["t"] >= 30 * a.minutes]
        k = max(1, len(second_half) // 5)
        rss_begin = common.percentile(second_half[:k], 50) if second_half else None
        rss_end = common.percentile(second_half[-k:], 50) if second_half else None
        growth = (rss_end - rss_begin) / rss_begin if second_half else None
        checks = {
            "no_failed_requests": self.counts["failed"] == 0,
            "requests_completed": self.counts["completed"] > 0,
            "memory_flat": growth is not None and len(second_half) >= 2 and growth < a.rss_tolerance,
            "kv_pages_returned": final["kv_pages_used"] == 0,
            "no_server_errors": not self.server_finished.get("error") and not self.server_5xx,
            "engine_idle": not final["running"] and not final["waiting"],
            "no_step_failures": not self.health.get("num_step_failures"),
        }
        if self.hostile:
            hostile = self.hostile.report()
            checks["hostile_answers_expected"] = hostile["sent"] > 0 and hostile["unexpected"] == 0
        return dict(passed=all(checks.values()), checks=checks, duration_s=duration, counts=dict(self.counts),
                    output_tokens=self.output_tokens, errors=self.errors, server_finished=self.server_finished,
                    server_http_status=self.server_http_status, server_http_5xx=self.server_5xx,
                    server_health=self.health, hostile=hostile if self.hostile else None,
                    rss_second_half_begin_mib=rss_begin,
                    rss_second_half_end_mib=rss_end, rss_growth=growth, rss_tolerance=a.rss_tolerance,
                    peak_kv_pages_used=max((s["kv_pages_used"] or 0) for s in self.samples),
                    final=final, samples=self.samples)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="duration of the load")
    parser.add_argument("--model", default="smollm2", help="the model to serve")
    parser.add_argument("--server_args", default="", help="extra `jaxserve serve` flags")
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent clients")
    parser.add_argument("--disconnect_fraction", type=float, default=0.25,
                        help="share of requests whose client hangs up mid-request")
    parser.add_argument("--max_disconnect_s", type=float, default=2.0, help="latest hang-up, seconds after sending")
    parser.add_argument("--min_input_len", type=int, default=8, help="random-token prompts: shortest")
    parser.add_argument("--max_input_len", type=int, default=96, help="random-token prompts: longest")
    parser.add_argument("--min_output_len", type=int, default=4)
    parser.add_argument("--max_output_len", type=int, default=64)
    parser.add_argument("--sample_s", type=float, default=3.0, help="seconds between RSS / metrics samples")
    parser.add_argument("--rss_tolerance", type=float, default=0.10, help="allowed RSS growth, second half")
    parser.add_argument("--settle_s", type=float, default=30.0, help="how long the KV pages may take to return")
    parser.add_argument("--request_timeout_s", type=float, default=600.0)
    parser.add_argument("--hostile_every_s", type=float, default=0.0,
                        help="send one hostile request (bench/hostile.py) every this many seconds; 0: none")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON report path")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.concurrency < 1 or args.sample_s <= 0 or args.hostile_every_s < 0:
        parser.error("--minutes and --sample_s must be > 0, --hostile_every_s >= 0 and --concurrency >= 1")
    if not 0 <= args.disconnect_fraction <= 1:
        parser.error("--disconnect_fraction must be in [0, 1]")
    if not 1 <= args.min_input_len <= args.max_input_len or not 1 <= args.min_output_len <= args.max_output_len:
        parser.error("the length ranges must satisfy 1 <= min <= max")
    return args


def _mib(value) -> str:
    return "-" if value is None else f"{value:.0f} MiB"


def _percent(value) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def every(samples: list[dict], step_s: float) -> list[dict]:
    """The first sample at or after each multiple of `step_s`, and the last one."""
    rows, next_t = [], 0.0
    for sample in samples:
        if sample["t"] >= next_t:
            rows.append(sample)
            next_t = (sample["t"] // step_s + 1) * step_s
    if samples and rows[-1] is not samples[-1]:
        rows.append(samples[-1])
    return rows


def print_details(report: dict, args) -> None:
    """The time series (about ten rows), the hostile requests by kind and the server log counts."""
    columns = [("t", "elapsed s", ".0f"), ("rss_mib", "RSS MiB", ".0f"), ("kv_pages_used", "KV pages", ".0f"),
               ("running", "running", ".0f"), ("waiting", "waiting", ".0f"), ("completed", "completed", "d"),
               ("disconnected", "disconnected", "d")]
    print(common.format_table(every(report["samples"], max(args.sample_s, 6 * args.minutes)), columns))
    if report["hostile"]:
        rows = [dict(kind=name, **{k: v for k, v in kind.items() if k != "statuses"},
                     statuses=", ".join(f"{status} x{n}" for status, n in kind["statuses"].items()))
                for name, kind in report["hostile"]["kinds"].items()]
        print(common.format_table(rows, [("kind", "hostile kind", "s"), ("sent", "sent", "d"),
                                         ("expected", "expected", "s"), ("statuses", "got", "s"),
                                         ("unexpected", "unexpected", "d"),
                                         ("close_s_max", "closed after (max s)", ".1f")]))
        for problem in report["hostile"]["problems"]:
            print(f"hostile: {problem}", file=sys.stderr)
    log = report["server_log"]
    print(f"server log {log['path']}: {log['warning_lines']} WARNING lines, {log['error_lines']} ERROR lines, "
          f"{log['tracebacks']} tracebacks")
    for message, n in log["top_messages"].items():
        print(f"  {n:6d} x {message}")


def main(argv=None) -> int:
    args = parse_args(argv)
    info = common.machine_info()
    log_path = os.path.splitext(args.out)[0] + ".server.log" if args.out else None
    try:
        with common.ServerProcess(args.model, shlex.split(args.server_args), log_path=log_path) as server:
            print(f"server up on {server.url} after {server.start_seconds:.1f}s; soaking {args.minutes} min",
                  file=sys.stderr, flush=True)
            report = asyncio.run(Soak(server.url, server.pid, args).run())
            exit_code = server.stop()
    except RuntimeError as e:
        print(f"soak: {e}", file=sys.stderr)
        return 2
    report.update(machine=info, machine_line=common.machine_line(info), model=args.model,
                  server_args=args.server_args, server_exit_code=exit_code, server_log=scan_server_log(server.log_path))
    report["checks"]["no_tracebacks"] = report["server_log"]["tracebacks"] == 0
    report["passed"] = all(report["checks"].values())
    c = report["counts"]
    print(report["machine_line"])
    print_details(report, args)
    print(f"{'PASSED' if report['passed'] else 'FAILED'}: {c['completed']} completed, {c['disconnected']} "
          f"disconnected, {c['failed']} failed in {report['duration_s']:.0f}s; RSS over the second half "
          f"{_mib(report['rss_second_half_begin_mib'])} -> {_mib(report['rss_second_half_end_mib'])} "
          f"({_percent(report['rss_growth'])}, tolerance {100 * args.rss_tolerance:.0f}%); KV pages at the end "
          f"{report['final']['kv_pages_used']} (peak {report['peak_kv_pages_used']})")
    for name, ok in report["checks"].items():
        if not ok:
            print(f"check failed: {name}", file=sys.stderr)
    for error in report["errors"]:
        print(f"error: {error}", file=sys.stderr)
    common.write_json(args.out, report)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

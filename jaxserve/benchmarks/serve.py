"""`jaxserve bench serve`: load an OpenAI-compatible server and report `vllm bench serve`'s metrics.

Against any server with /v1/completions or /v1/chat/completions (jaxserve, vLLM, llama.cpp's
server, ...): prompts from a dataset (jaxserve.benchmarks.datasets), sent at `--request_rate` with
`--burstiness` and at most `--max_concurrency` in flight (jaxserve.benchmarks.runner), each
streamed and timed on the client (client), summarized with vLLM's field names (results). A sweep
runs one level per `--sweep_max_concurrency` / `--sweep_request_rate` value and names the largest
that meets the `--goodput` SLOs (sweep), optionally with a PNG (plot) and the cost per million
output tokens. When the server's /metrics has `jaxserve_step_*` metrics, their change over the run
is kept as `server_step_metrics` (server_metrics). `--dataset_name=multiturn` holds conversations
instead: each turn's prompt repeats the conversation so far, and the TTFT of each turn index is
reported besides the run's figures (`_send_multiturn`).

Exit codes: 0 when requests completed, 1 when every request of a run failed (the first error is
printed), 2 for bad flags, a dataset that cannot be read, or a server that does not answer.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import math
import os
import random
import sys
import time
import urllib.parse

import aiohttp
from absl import flags
from tqdm import tqdm

from checkpoints import MARKER_FILE
from jaxserve import environment
from jaxserve.benchmarks import datasets, plot, results, runner, server_metrics, sweep
from jaxserve.benchmarks.client import ENDPOINTS, RequestSpec, ServerUnreachable, probe, request_body

PROG = "jaxserve bench serve"


def define_flags(fv: flags.FlagValues) -> None:
    """The flags, vLLM's `bench serve` names in absl's underscore form."""
    _define_target_flags(fv)
    _define_dataset_flags(fv)
    _define_load_flags(fv)
    _define_output_flags(fv)


def _define_target_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("base_url", "http://127.0.0.1:8000", "The server's root URL.", flag_values=fv)
    flags.DEFINE_enum("endpoint", "completions", list(ENDPOINTS), "completions -> /v1/completions, chat -> "
                      "/v1/chat/completions.", flag_values=fv)
    flags.DEFINE_string("model", None, "The model id sent in each request; default: the first id the server's "
                        "/v1/models lists.", flag_values=fv)
    flags.DEFINE_string("tokenizer", None, "A local model directory (converted or Hugging Face) or org/name in the "
                        "local Hugging Face cache (never downloaded), to count tokens and decode random prompts. "
                        "Default: the --model when it resolves locally, else none: then random prompts are sent as "
                        "token ids (completions only), prompt lengths of sharegpt/jsonl are whitespace word counts, "
                        "and output tokens come from the server's usage chunk (else the chunk count).",
                        flag_values=fv)
    flags.DEFINE_string("api_key", None, "Sent as `Authorization: Bearer KEY` when given.", flag_values=fv)
    flags.DEFINE_float("request_timeout_s", 6 * 3600.0, "Per request, as vLLM's 6 hours.", flag_values=fv)


def _define_dataset_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_enum("dataset_name", "random", ["random", "sharegpt", "jsonl", "multiturn"], "Where prompts come "
                      "from: random token ids, ShareGPT conversations, a JSONL file of {\"prompt\", "
                      "\"output_tokens\"} lines (--dataset_path), or multi-turn conversations of random token ids "
                      "(--multiturn_*).", flag_values=fv)
    flags.DEFINE_string("dataset_path", None, "The sharegpt or jsonl file.", flag_values=fv)
    flags.DEFINE_integer("num_prompts", 1000, "Requests per run (per level of a sweep).", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("random_input_len", 1024, "random: prompt tokens.", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("random_output_len", 128, "random: output tokens asked for.", lower_bound=1, flag_values=fv)
    flags.DEFINE_float("random_range_ratio", 0.0, "random: lengths uniform in [len*(1-r), len*(1+r)].",
                       flag_values=fv)
    flags.DEFINE_integer("random_prefix_len", 0, "random: tokens of a prefix shared by every prompt.",
                         lower_bound=0, flag_values=fv)
    flags.DEFINE_integer("random_vocab_size", 5000, "random without a tokenizer: ids are drawn from [100, N).",
                         lower_bound=101, flag_values=fv)
    flags.DEFINE_integer("sharegpt_output_len", None, "sharegpt/jsonl: output tokens for every prompt (default: "
                         "the reply's length for sharegpt; a jsonl line's output_tokens, else 128).",
                         lower_bound=1, flag_values=fv)
    _define_multiturn_flags(fv)
    flags.DEFINE_integer("seed", 0, "Seeds the dataset sample and the arrival times (a sweep's level i draws with seed + i).", flag_values=fv)


def _define_multiturn_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_integer("multiturn_conversations", 12, "multiturn: conversations, sent round-robin (every "
                         "conversation's turn 1, then every turn 2, ...), one request at a time unless "
                         "--max_concurrency is given (a conversation's turn still waits for its previous one).",
                         lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("multiturn_turns", 4, "multiturn: turns per conversation. Turn 1 is --random_input_len "
                         "random token ids (after --random_prefix_len shared ones); each later turn's prompt is the "
                         "previous prompt, the server's reply to it (its token ids) and --multiturn_turn_input_len "
                         "new random ids. Every turn asks --random_output_len tokens.", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("multiturn_turn_input_len", 100, "multiturn: new random token ids of each turn after the "
                         "first.", lower_bound=0, flag_values=fv)


def _define_load_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_float("request_rate", math.inf, "Requests per second; inf sends all at once.", flag_values=fv)
    flags.DEFINE_float("burstiness", 1.0, "Shape of the gamma-distributed gaps between arrivals (mean "
                       "1/request_rate): 1 is a Poisson process, lower is burstier.", flag_values=fv)
    flags.DEFINE_integer("max_concurrency", None, "At most this many requests in flight (default: no limit).",
                         lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("num_warmups", 0, "Requests sent and awaited before the timed run.", lower_bound=0,
                         flag_values=fv)
    flags.DEFINE_boolean("ignore_eos", None, "Ask the server to ignore EOS (vLLM's extension); default: true for "
                         "random, false otherwise.", flag_values=fv)
    flags.DEFINE_float("temperature", 0.0, "Sampling temperature sent.", flag_values=fv)
    flags.DEFINE_string("goodput", None, "SLOs as METRIC:MS pairs, e.g. ttft:800,tpot:80,e2el:10000 (metrics "
                        "ttft, tpot, e2el); request_goodput = requests/s that met every one.", flag_values=fv)
    flags.DEFINE_string("percentile_metrics", "ttft,tpot,itl,e2el", "Metrics whose statistics are reported.",
                        flag_values=fv)
    flags.DEFINE_string("metric_percentiles", "99", "Comma list of percentiles reported (pNN_ fields).",
                        flag_values=fv)
    flags.DEFINE_string("sweep_max_concurrency", None, "Comma list of levels, e.g. 1,8,16,32: one run each; "
                        f"max_concurrency_meeting_slo is {sweep.SLO_DEFINITION}.", flag_values=fv)
    flags.DEFINE_string("sweep_request_rate", None, "Comma list of request rates: one run each "
                        "(max_request_rate_meeting_slo, defined as for --sweep_max_concurrency).", flag_values=fv)
    flags.DEFINE_float("hour_usd", None, "The machine's price per hour: adds cost_per_million_output_tokens_usd "
                       "= hour_usd / 3600 / output_throughput * 1e6.", lower_bound=0.0, flag_values=fv)


def _define_output_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("result_json", None, "Write the result (a sweep: {levels, max_..._meeting_slo}) here.",
                        flag_values=fv)
    flags.DEFINE_boolean("save_detailed", False, "Add per-request ttfts, itls, e2els (s), input_lens, "
                         "output_lens and errors to the result.", flag_values=fv)
    flags.DEFINE_string("plot", None, "With a sweep: a PNG of output throughput vs P99 TTFT and tokens/s per user "
                        "vs total output tokens/s (needs matplotlib).", flag_values=fv)
    flags.DEFINE_boolean("disable_tqdm", False, "No progress bar.", flag_values=fv)


@dataclasses.dataclass(frozen=True)
class Settings:
    """The flags, checked and parsed."""

    slos: dict[str, float]
    metric_names: list[str]
    percentiles: list[float]
    sweep_kind: str | None  # "max_concurrency", "request_rate" or None (one run)
    levels: list[float]
    ignore_eos: bool


def _levels(text: str, kind: str) -> list[float]:
    try:
        levels = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--sweep_{kind}: {text!r} is not a comma list of numbers") from None
    if not levels or not all(v > 0 for v in levels):
        raise ValueError(f"--sweep_{kind}: levels must be > 0, got {text!r}")
    if kind == "max_concurrency" and not all(v.is_integer() for v in levels):
        raise ValueError(f"--sweep_max_concurrency: levels must be whole numbers, got {text!r}")
    return levels


def settings_from_flags(fv: flags.FlagValues) -> Settings:
    """Parses the flags that need it; ValueError with a message naming the flag."""
    url = urllib.parse.urlsplit(fv.base_url)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise ValueError(f"--base_url={fv.base_url} is not an http(s) URL (e.g. http://127.0.0.1:8000)")
    if fv.dataset_name in ("sharegpt", "jsonl") and not fv.dataset_path:
        raise ValueError(f"--dataset_name={fv.dataset_name} needs --dataset_path")
    _check_multiturn(fv)
    if not 0 <= fv.random_range_ratio < 1:
        raise ValueError(f"--random_range_ratio must be in [0, 1), got {fv.random_range_ratio}")
    if not fv.request_rate > 0 or not fv.burstiness > 0:
        raise ValueError("--request_rate and --burstiness must be > 0")
    if fv.sweep_max_concurrency and fv.sweep_request_rate:
        raise ValueError("give one of --sweep_max_concurrency or --sweep_request_rate")
    if fv.sweep_max_concurrency and fv.max_concurrency is not None:
        raise ValueError("give one of --max_concurrency or --sweep_max_concurrency")
    kind = "max_concurrency" if fv.sweep_max_concurrency else "request_rate" if fv.sweep_request_rate else None
    if fv.plot and kind is None:
        raise ValueError("--plot needs a sweep (--sweep_max_concurrency or --sweep_request_rate)")
    levels = _levels(fv[f"sweep_{kind}"].value, kind) if kind else []
    ignore_eos = fv.ignore_eos if fv.ignore_eos is not None else fv.dataset_name in ("random", "multiturn")
    return Settings(results.parse_goodput(fv.goodput), results.parse_metric_names(fv.percentile_metrics),
                    results.parse_percentiles(fv.metric_percentiles), kind, levels, ignore_eos)


def _check_multiturn(fv: flags.FlagValues) -> None:
    """The flags --dataset_name=multiturn does not go with (ValueError), and --multiturn_* without it."""
    if fv.dataset_name != "multiturn":
        given = [name for name in ("multiturn_conversations", "multiturn_turns", "multiturn_turn_input_len")
                 if fv[name].present]
        if given:
            raise ValueError(f"--{given[0]} needs --dataset_name=multiturn")
        return
    if fv.endpoint != "completions":
        raise ValueError("--dataset_name=multiturn sends token-id prompts, which only --endpoint=completions takes")
    if fv.sweep_max_concurrency or fv.sweep_request_rate:
        raise ValueError("--dataset_name=multiturn runs one level: no --sweep_max_concurrency or --sweep_request_rate")
    if not math.isinf(fv.request_rate):
        raise ValueError("--request_rate does not apply to --dataset_name=multiturn: each turn is sent as soon as "
                         "its previous turn has ended and fewer than --max_concurrency (default 1) are in flight")
    if fv["num_prompts"].present:
        raise ValueError("--num_prompts does not apply to --dataset_name=multiturn: it sends "
                         "--multiturn_conversations x --multiturn_turns requests")
    if fv.random_range_ratio:
        raise ValueError("--random_range_ratio does not apply to --dataset_name=multiturn: every turn has the "
                         "lengths its flags give")


def _hf_tokenizer(path: str):
    from transformers import AutoTokenizer  # transformers loads in seconds: only when a tokenizer is used
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many types for a folder without (good) tokenizer files
        raise ValueError(f"{path}: cannot load a tokenizer ({e})") from None


def load_tokenizer(name: str):
    """The tokenizer of a converted directory, a Hugging Face folder, "smollm2" once converted, or an
    org/name in the local Hugging Face cache; ValueError otherwise. Never downloads or converts."""
    from checkpoints import default_model, load  # the model registry: only when a tokenizer is looked up
    path = os.path.expanduser(name)
    if name.lower() == default_model.DEFAULT_MODEL and not os.path.exists(path):
        path = os.path.join(environment.cache_root(), "models", default_model.DEFAULT_MODEL)
    if os.path.isfile(os.path.join(path, MARKER_FILE)):
        tokenizer = load.load_tokenizer(path)
        if tokenizer is None:
            raise ValueError(f"{name}: the converted model has no tokenizer")
        return tokenizer
    if os.path.isdir(path):
        return _hf_tokenizer(path)
    if default_model.is_hub_id(name):
        return _hf_tokenizer(default_model.hub_snapshot(name))
    raise ValueError(f"{name}: not a model directory, a converted smollm2, or an org/name in the local "
                     "Hugging Face cache")


def _tokenizer(fv: flags.FlagValues, model: str):
    """(tokenizer or None, its name or None): --tokenizer must load; the --model default may not."""
    name = fv.tokenizer or model
    try:
        return load_tokenizer(name), name
    except ValueError as e:  # ConversionError is a ValueError
        if fv.tokenizer:
            raise ValueError(f"--tokenizer={fv.tokenizer}: {e}") from None
        return None, None


def build_samples(fv: flags.FlagValues, tokenizer, endpoint: str, level_index: int = 0) -> list[datasets.SampleRequest]:
    """The run's prompts from the dataset flags. Each level of a sweep draws its own (seed +
    level_index), so a later level does not find the earlier levels' prompts in the server's prefix
    cache; a jsonl file is sent as it is at every level."""
    seed = fv.seed + level_index
    if fv.dataset_name == "random":
        if tokenizer is None and endpoint == "chat":
            raise ValueError("random prompts on --endpoint=chat need a --tokenizer (without one they are "
                             "token ids, which only the completions endpoint takes)")
        return datasets.random_requests(fv.num_prompts, fv.random_input_len, fv.random_output_len,
                                        range_ratio=fv.random_range_ratio, seed=seed, tokenizer=tokenizer,
                                        vocab_size=fv.random_vocab_size, prefix_len=fv.random_prefix_len)
    if fv.dataset_name == "sharegpt":
        return datasets.sharegpt_requests(fv.dataset_path, fv.num_prompts, tokenizer=tokenizer,
                                          output_len=fv.sharegpt_output_len, seed=seed)
    return datasets.jsonl_requests(fv.dataset_path, fv.num_prompts, tokenizer=tokenizer,
                                   output_len=fv.sharegpt_output_len or 128)


@dataclasses.dataclass
class Target:
    """What every run of one invocation shares."""

    session: aiohttp.ClientSession
    base_url: str
    url: str
    model: str
    tokenizer: object
    tokenizer_id: str | None


def _count_tokens(tokenizer):
    if tokenizer is None:
        return None
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def _bodies(fv: flags.FlagValues, target: Target, settings: Settings, samples) -> list[dict]:
    return [request_body(fv.endpoint, target.model, RequestSpec(s.prompt, s.prompt_len, s.expected_output_len),
                         temperature=fv.temperature, ignore_eos=settings.ignore_eos) for s in samples]


async def _warm_up(fv: flags.FlagValues, target: Target, bodies: list[dict], max_concurrency: int | None) -> None:
    """--num_warmups requests (the run's own, cycled), awaited and not counted."""
    if fv.num_warmups:
        warm = [bodies[i % len(bodies)] for i in range(fv.num_warmups)]
        await runner.send_all(target.session, target.url, fv.endpoint, warm, [0] * len(warm),
                              [0.0] * len(warm), max_concurrency)


@dataclasses.dataclass
class _Sent:
    """What one timed run sent: the records in send order, its duration, /metrics around it."""

    records: list
    duration: float
    before: str | None
    after: str | None
    max_concurrency: int | None
    fields: dict = dataclasses.field(default_factory=dict)  # the dataset's own result fields
    detail: dict = dataclasses.field(default_factory=dict)  # and its own --save_detailed lists


async def _send_samples(fv: flags.FlagValues, target: Target, settings: Settings, max_concurrency: int | None,
                        request_rate: float, level_index: int) -> _Sent:
    """The single-request datasets: the samples sent at their arrival times."""
    samples = build_samples(fv, target.tokenizer, fv.endpoint, level_index)
    bodies = _bodies(fv, target, settings, samples)
    await _warm_up(fv, target, bodies, max_concurrency)
    before = await server_metrics.scrape(target.session, target.base_url)
    offsets = runner.arrival_offsets(len(bodies), request_rate, fv.burstiness, fv.seed)
    with tqdm(total=len(bodies), disable=fv.disable_tqdm, file=sys.stderr, desc="requests") as bar:
        records, duration = await runner.send_all(target.session, target.url, fv.endpoint, bodies,
                                                  [s.prompt_len for s in samples], offsets, max_concurrency,
                                                  on_done=bar.update)
    after = await server_metrics.scrape(target.session, target.base_url) if before is not None else None
    return _Sent(records, duration, before, after, max_concurrency)


def _turn_body(fv: flags.FlagValues, target: Target, settings: Settings, prompt: list[int], max_tokens: int) -> dict:
    body = request_body("completions", target.model, RequestSpec(prompt, len(prompt), max_tokens),
                        temperature=fv.temperature, ignore_eos=settings.ignore_eos)
    body["skip_special_tokens"] = False  # generated special tokens stay in the text (runner.ReplyTokens)
    return body


async def _send_multiturn(fv: flags.FlagValues, target: Target, settings: Settings, concurrency: int) -> _Sent:
    """--dataset_name=multiturn: the conversations, round-robin (runner.send_conversations).

    A reply enters the history as the token ids the server generated, so that the next turn's
    prompt starts with exactly the tokens whose KV the server computed (its prefix cache, or the
    host copy of evicted pages, can serve all of them). Token-id prompts go to the completions
    endpoint, and the ids come back where the server sends them: vLLM's `return_token_ids`
    (runner.TurnSender asks for it; jaxserve's server sends them). A server that refuses that field
    gets the reply's text tokenized again, by the local tokenizer or the server's /tokenize, with
    special tokens kept in the text (runner.ReplyTokens); `multiturn_history_source` counts which
    way each reply came, and `multiturn_retokenized_length_mismatches` the replies whose tokens again differ in number
    from those the server generated (their history then departs from the server's tokens)."""
    vocab = len(target.tokenizer) if target.tokenizer is not None else fv.random_vocab_size
    conversations = datasets.multiturn_conversations(
        fv.multiturn_conversations, fv.multiturn_turns, fv.random_input_len, fv.multiturn_turn_input_len,
        fv.random_output_len, seed=fv.seed, vocab_size=vocab, prefix_len=fv.random_prefix_len)
    send_turn = runner.TurnSender(target.session, target.url,
                                  lambda prompt, max_tokens: _turn_body(fv, target, settings, prompt, max_tokens))
    warm_rng = random.Random(f"multiturn-warmup:{fv.seed}")  # prompts of their own: none of the run's is cached
    for _ in range(fv.num_warmups):
        await send_turn(datasets.random_ids(warm_rng, fv.random_input_len, vocab), fv.random_output_len)
    before = await server_metrics.scrape(target.session, target.base_url)
    with tqdm(total=len(conversations) * fv.multiturn_turns, disable=fv.disable_tqdm, file=sys.stderr,
              desc="turns") as bar:
        turns, duration = await runner.send_conversations(
            conversations, send_turn, runner.ReplyTokens(target.session, target.base_url, target.model,
                                                         target.tokenizer), concurrency, on_done=bar.update)
    after = await server_metrics.scrape(target.session, target.base_url) if before is not None else None
    records = [turn.record for turn in turns]
    retokenized = [t for t in turns if t.history_source not in (None, "token_ids")]
    mismatches = sum(t.record.usage_completion_tokens not in (None, t.reply_len) for t in retokenized)
    if mismatches:
        print(f"{PROG}: {mismatches} of {len(retokenized)} replies tokenized again to another number of tokens "
              "than the server generated: those histories depart from the server's tokens", file=sys.stderr)
    fields = {"multiturn_conversations": len(conversations), "multiturn_turns": fv.multiturn_turns,
              "multiturn_turn_input_len": fv.multiturn_turn_input_len,
              **results.ttft_by_turn([t.turn for t in turns], records, fv.multiturn_turns, settings.percentiles),
              "multiturn_history_source": dict(collections.Counter(t.history_source for t in turns
                                                                   if t.history_source is not None)),
              "multiturn_retokenized_length_mismatches": mismatches}
    detail = {"conversations": [t.conversation for t in turns], "turns": [t.turn + 1 for t in turns]}
    return _Sent(records, duration, before, after, concurrency, fields, detail)


async def run_level(fv: flags.FlagValues, target: Target, settings: Settings, max_concurrency: int | None,
                    request_rate: float, level_index: int = 0) -> tuple[dict, list[results.RequestMetrics]]:
    """One timed run (the `level_index`-th of a sweep): (its result dict, the successful requests' metrics)."""
    if fv.dataset_name == "multiturn":
        sent = await _send_multiturn(fv, target, settings, max_concurrency or 1)
    else:
        sent = await _send_samples(fv, target, settings, max_concurrency, request_rate, level_index)
    count_tokens = _count_tokens(target.tokenizer)
    result, metrics = results.summarize(sent.records, sent.duration, percentile_metrics=settings.metric_names,
                                        percentiles=settings.percentiles, slos=settings.slos,
                                        count_tokens=count_tokens)
    input_source = ("token_ids" if fv.dataset_name == "multiturn" else "tokenizer" if target.tokenizer is not None
                    else "token_ids" if fv.dataset_name == "random" else "words")
    result.update(date=time.strftime("%Y%m%d-%H%M%S"), base_url=target.base_url, endpoint=fv.endpoint,
                  model_id=target.model, tokenizer_id=target.tokenizer_id, dataset_name=fv.dataset_name,
                  num_prompts=len(sent.records), request_rate="inf" if math.isinf(request_rate) else request_rate,
                  burstiness=fv.burstiness, max_concurrency=sent.max_concurrency, input_token_source=input_source)
    result.update(sent.fields)
    if fv.hour_usd is not None:
        result["cost_per_million_output_tokens_usd"] = sweep.cost_per_million_output_tokens(
            fv.hour_usd, result["output_throughput"])
    if settings.slos:
        result["goodput_slos_ms"] = dict(settings.slos)
    steps = server_metrics.step_metrics_delta(sent.before, sent.after)
    if steps is not None:
        result["server_step_metrics"] = steps
        bound = server_metrics.run_bound(steps)
        if bound is not None:
            result["server_bound"] = bound.to_dict()
    if fv.save_detailed:
        result.update(results.detailed(sent.records, count_tokens), **sent.detail)
    return result, metrics


async def _open_target(fv: flags.FlagValues, session: aiohttp.ClientSession) -> Target:
    """Probes the server (ServerUnreachable when down) and settles the model and tokenizer."""
    base_url = fv.base_url.rstrip("/")
    models = await probe(session, base_url)
    model = fv.model or (models[0] if models else None)
    if model is None:
        raise ValueError(f"{base_url}/v1/models lists no model: give --model")
    tokenizer, tokenizer_id = _tokenizer(fv, model)
    return Target(session, base_url, base_url + ENDPOINTS[fv.endpoint], model, tokenizer, tokenizer_id)


def _session(fv: flags.FlagValues) -> aiohttp.ClientSession:
    headers = {"Authorization": f"Bearer {fv.api_key}"} if fv.api_key else None
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=fv.request_timeout_s), headers=headers,
                                 connector=aiohttp.TCPConnector(limit=0))  # no cap: --max_concurrency decides


def _all_failed(result: dict) -> bool:
    return result["completed"] == 0


def _report_failures(result: dict, label: str = "") -> None:
    if result["failed"]:
        print(f"{PROG}: {label}{result['failed']} of {result['failed'] + result['completed']} requests failed; "
              f"the first: {result['first_error']}", file=sys.stderr)


async def _single(fv: flags.FlagValues, target: Target, settings: Settings) -> tuple[dict, int, list]:
    result, _ = await run_level(fv, target, settings, fv.max_concurrency, fv.request_rate)
    print(results.format_summary(result, settings.metric_names, settings.percentiles))
    _report_failures(result)
    return result, 1 if _all_failed(result) else 0, []


async def _sweep(fv: flags.FlagValues, target: Target, settings: Settings) -> tuple[dict, int, list[dict]]:
    """One run per level: (the sweep's document, the exit code, its table rows); prints the table."""
    kind, level_results, rows, passed = settings.sweep_kind, [], [], []
    for index, level in enumerate(settings.levels):
        concurrency = int(level) if kind == "max_concurrency" else fv.max_concurrency
        rate = level if kind == "request_rate" else fv.request_rate
        result, metrics = await run_level(fv, target, settings, concurrency, rate, index)
        result["level"] = int(level) if kind == "max_concurrency" else level
        level_results.append(result)
        rows.append(sweep.table_row(level, result, metrics))
        passed.append(sweep.level_meets_slos(result, metrics, settings.slos))
        _report_failures(result, f"{kind}={level:g}: ")
    best = sweep.best_level(settings.levels, passed)
    key = sweep.VERDICT_KEYS[kind]
    document = {"sweep": kind, "levels": level_results, key: int(best) if best is not None and kind ==
                "max_concurrency" else best, "slo_definition": sweep.SLO_DEFINITION,
                "goodput_slos_ms": dict(settings.slos)}
    print(sweep.format_table(kind, rows))
    verdict = f"{document[key]}" if settings.slos else "n/a (give --goodput)"
    print(f"{key}: {verdict}" + ("" if best is not None or not settings.slos else " (no level meets the SLOs)"))
    return document, 1 if any(_all_failed(r) for r in level_results) else 0, rows


def write_json(path: str, document: dict) -> None:
    """The result as strict JSON (no NaN/Infinity); OSError names the file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=2, allow_nan=False)
        f.write("\n")


async def _bench(fv: flags.FlagValues, settings: Settings) -> int:
    async with _session(fv) as session:
        target = await _open_target(fv, session)
        print(f"{PROG}: {target.url}, model {target.model}, tokenizer {target.tokenizer_id or 'none'}",
              file=sys.stderr)
        run_fn = _single if settings.sweep_kind is None else _sweep
        document, code, rows = await run_fn(fv, target, settings)
    if fv.result_json:
        write_json(fv.result_json, document)
    if fv.plot:  # after the JSON, so that a missing matplotlib loses no result
        title = f"{target.model} at {target.base_url}"
        print(f"plot: {plot.plot_sweep(rows, settings.sweep_kind, fv.plot, title=title)}", file=sys.stderr)
    return code


def run(fv: flags.FlagValues) -> int:
    """Runs the benchmark; see the module docstring for the exit codes."""
    try:
        settings = settings_from_flags(fv)
        return asyncio.run(_bench(fv, settings))
    except (ServerUnreachable, ValueError, OSError, plot.PlotError) as e:  # DatasetError is a ValueError
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130

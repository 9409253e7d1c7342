"""`jaxserve serve`: the OpenAI-compatible HTTP server (see serve/app.py for the routes)."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import sys

from absl import flags

from checkpoints import default_model
from jaxserve import environment
from jaxserve.commands import engine_flags, media_flags
from jaxserve.config import CPU_SERVE_LONG_PREFILL_TOKEN_THRESHOLD
from jaxserve.core.request import InvalidRequestError, check_sampling_defaults
from serve.app import STATE, ServerConfig, create_app
from serve.connections import ConnectionLimits
from serve.reasoning import REASONING_PARSERS
from serve import server as http_server
from serve.tool_parsers import TOOL_PARSERS
from serve.web_ui import parse_allowed_origins


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("host", "127.0.0.1", "address to bind (0.0.0.0 exposes the server to the network)",
                        flag_values=fv)
    flags.DEFINE_integer("port", 8000, "TCP port", lower_bound=0, upper_bound=65535, flag_values=fv)
    flags.DEFINE_string("api_key", None, f"require 'Authorization: Bearer <key>' on /v1 routes (default: "
                        f"${environment.API_KEY} when set)", flag_values=fv)
    flags.DEFINE_integer("max_body_bytes", 8 * 1024 * 1024, "largest request body accepted (413 above)",
                         lower_bound=1024, flag_values=fv)
    flags.DEFINE_float("drain_timeout_s", 30.0, "on SIGTERM, how long in-flight requests may run on",
                       lower_bound=0.0, flag_values=fv)
    flags.DEFINE_integer("retry_after_s", 1, "Retry-After of a 429 when the waiting queue is full", lower_bound=0,
                         flag_values=fv)
    flags.DEFINE_list("served_model_name", None, "model ids clients may send in 'model' (comma-separated; the "
                      "first is reported in responses and /v1/models). Default: the model's short name "
                      "(smollm2, or the last component of --model's path)", flag_values=fv)
    flags.DEFINE_integer("max_connections", 0, "open connections beyond which new ones get a 503 and are closed "
                         "(0: the open-file limit, raised to the hard limit, minus a reserve)", lower_bound=0,
                         flag_values=fv)
    flags.DEFINE_float("header_timeout_s", 10.0, "time a connection has to send a complete request line and "
                       "headers (closed after)", lower_bound=0.1, flag_values=fv)
    flags.DEFINE_float("body_timeout_s", 30.0, "time to receive a request body once its headers arrived (408 "
                       "after)", lower_bound=0.1, flag_values=fv)
    flags.DEFINE_float("keepalive_timeout_s", 30.0, "idle time before a keep-alive connection is closed",
                       lower_bound=0.1, flag_values=fv)
    flags.DEFINE_boolean("allow_runtime_lora_updating", False, "LoRA: answer POST /v1/load_lora_adapter and "
                         "/v1/unload_lora_adapter (also on with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, as vLLM)",
                         flag_values=fv)
    flags.DEFINE_boolean("no_web_ui", False, "do not serve the chat page at / (then / is a 404)", flag_values=fv)
    flags.DEFINE_list("allowed_origins", None, "origins (scheme://host[:port], comma-separated; * for any) whose "
                      "browser pages may call the /v1 routes (CORS). Default: none, same-origin only",
                      flag_values=fv)
    flags.register_validator("allowed_origins", _valid_origins, flag_values=fv)
    flags.DEFINE_string("generation_config", "auto", "where the sampling defaults of requests that omit a field "
                        "come from: 'auto' (the model's generation_config.json: temperature, top_p, top_k, min_p, "
                        "repetition_penalty, max_new_tokens), 'none' (jaxserve's: temperature 1, no truncation), "
                        "or a folder holding a generation_config.json", flag_values=fv)
    flags.register_validator("generation_config", _valid_generation_config, flag_values=fv)
    flags.DEFINE_string("default_sampling", None, "JSON object of sampling defaults over the generation config's, "
                        "e.g. '{\"temperature\": 0.7, \"top_p\": 0.9}' (fields: temperature, top_p, top_k, min_p, "
                        "repetition_penalty, presence_penalty, frequency_penalty, max_tokens)", flag_values=fv)
    flags.register_validator("default_sampling", _valid_default_sampling, flag_values=fv)
    flags.DEFINE_boolean("enable_auto_tool_choice", None, "tool_choice 'auto' (vLLM's flag): true requires a tool-call "
                         "format (--tool_call_parser or the one the chat template asks for; exit 2 without one), "
                         "false (--noenable_auto_tool_choice) refuses 'auto' with a 400. Default: 'auto' wherever "
                         "the chat template shows the model its tools", flag_values=fv)
    flags.DEFINE_enum("tool_call_parser", None, list(TOOL_PARSERS), "the tool-call format parsed from the "
                      "output under tool_choice 'auto' (vLLM's names: hermes for Qwen, llama3_json for Llama 3.x, "
                      "mistral). Default: the one the chat template asks for. Exit 2 on a template that does not "
                      "render tools", flag_values=fv)
    flags.DEFINE_enum("reasoning_parser", None, list(REASONING_PARSERS), "split the <think>...</think> part of chat "
                      "output into 'reasoning' (and 'reasoning_content') apart from 'content' (vLLM's names: qwen3, "
                      "deepseek_r1). Default: none, the output is all content", flag_values=fv)
    media_flags.define_media_flags(fv)
    flags.DEFINE_enum("log_level", "INFO", ["DEBUG", "INFO", "WARNING", "ERROR"], "logging level", flag_values=fv)
    engine_flags.define_engine_flags(fv)
    engine_flags.define_distributed_flags(fv)


def _valid_origins(values: list[str] | None) -> bool:
    if not values:
        return True
    try:
        parse_allowed_origins(values)
    except ValueError as e:
        raise flags.ValidationError(str(e)) from None
    return True


def _valid_generation_config(value: str) -> bool:
    if value not in ("auto", "none") and not os.path.isdir(os.path.expanduser(value)):
        raise flags.ValidationError(f"{value!r} is not 'auto', 'none' or a folder")
    return True


def _parse_default_sampling(value: str | None) -> dict:
    if not value:
        return {}
    try:
        return check_sampling_defaults(json.loads(value))
    except ValueError as e:  # JSONDecodeError and InvalidRequestError
        prefix = "not valid JSON: " if not isinstance(e, InvalidRequestError) else ""
        raise flags.ValidationError(f"{prefix}{e}") from None


def _valid_default_sampling(value: str | None) -> bool:
    _parse_default_sampling(value)
    return True


def sampling_defaults(fv: flags.FlagValues) -> tuple[dict, str]:
    """The server's sampling defaults (the generation config's, then --default_sampling's over
    them) and a line saying where they come from. Reads the model's converted directory."""

    defaults, sources = {}, []
    if fv.generation_config != "none":
        folder = default_model.resolve_model(fv.model) if fv.generation_config == "auto" else os.path.expanduser(fv.generation_config)
        defaults, problems = default_model.model_sampling_defaults(folder)
        for problem in problems:
            logging.getLogger(__name__).warning("%s", problem)
        if defaults:
            sources.append("the model's generation_config.json" if fv.generation_config == "auto"
                           else f"{fv.generation_config}/generation_config.json")
    overrides = _parse_default_sampling(fv.default_sampling)
    if overrides:
        sources.append("--default_sampling")
    defaults = {**defaults, **overrides}
    if not defaults:
        return {}, "sampling defaults: jaxserve's (temperature 1, top_p 1, no top_k)"
    return defaults, f"sampling defaults for fields a request omits: {json.dumps(defaults)} (from {', '.join(sources)})"


def serve_engine_kwargs(fv: flags.FlagValues) -> dict:
    """The engine flags, with serving's own default on the CPU: prefill beside decoding streams
    bounded (EngineConfig.long_prefill_token_threshold), so their tokens keep coming while a long
    prompt is prefilled. `generate` keeps the unbounded default: its figure is throughput."""
    from jaxserve.executor import device_setup  # loads jax: the command runs it after --help and the flags are done

    kwargs = engine_flags.engine_kwargs(fv)
    if "long_prefill_token_threshold" not in kwargs and not device_setup.on_gpu():
        kwargs["long_prefill_token_threshold"] = CPU_SERVE_LONG_PREFILL_TOKEN_THRESHOLD
    return kwargs


def _log_ready(fv: flags.FlagValues, port: int) -> None:
    """The line a user waits for: where the API (and the web page) answer."""
    host = "127.0.0.1" if fv.host in ("", "0.0.0.0", "::") else fv.host
    base = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    page = "" if fv.no_web_ui else f"; chat in a browser at {base}/"
    logging.getLogger(__name__).info("ready: the OpenAI API at %s/v1%s", base, page)


async def _log_ready_after_warmup(engine, fv: flags.FlagValues, port: int, poll_s: float = 0.2) -> None:
    """`_log_ready` once /health would answer 200: at once, or when the warm-up has compiled the
    shapes a first request needs (the server already listens and takes requests meanwhile)."""
    warmup = engine.health().get("warmup")
    if warmup is not None and not warmup["ready"]:
        logging.getLogger(__name__).info("listening on port %d while the warm-up compiles (/health: 503 until "
                                         "the first requests' shapes are ready)", port)
        while warmup is not None and not warmup["ready"]:
            if warmup.get("error"):
                return  # logged by the warm-up; /health says so
            await asyncio.sleep(poll_s)
            warmup = engine.health().get("warmup")
    _log_ready(fv, port)


def _log_chat_parsing(app) -> None:
    """One line on what tool_choice "auto" does, and which reasoning parser splits the output."""
    state = app[STATE]
    auto = state.auto_tools
    if auto.refusal is not None:
        line = f"tool_choice auto: refused ({auto.refusal})"
    elif auto.format is None:
        line = "tool_choice auto: plain content (the chat template asks for no tool-call format jaxserve parses)"
    else:
        line = f"tool_choice auto: {auto.format} tool calls parsed (from {auto.source})"
    logging.getLogger(__name__).info("%s; reasoning parser: %s", line, state.config.reasoning_parser or "none")


def run(fv: flags.FlagValues) -> int:
    logging.basicConfig(level=fv.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src.xla_bridge"):  # checkpoint-restore chatter, missing TPU plugin
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    # A multi-host job: every process joins; process 0 serves, the others follow its steps.
    join, exit_code = engine_flags.enter_job(fv, "serve")
    if exit_code is not None:
        return exit_code

    config = ServerConfig(
        api_key=fv.api_key or environment.api_key(),
        max_body_bytes=fv.max_body_bytes,
        drain_timeout_s=fv.drain_timeout_s,
        retry_after_s=fv.retry_after_s,
        served_model_names=tuple(name for name in fv.served_model_name or () if name),
        web_ui=not fv.no_web_ui,
        allowed_origins=parse_allowed_origins(fv.allowed_origins or ()),
        tool_call_parser=fv.tool_call_parser,
        enable_auto_tool_choice=fv.enable_auto_tool_choice,
        allow_runtime_lora_updating=fv.allow_runtime_lora_updating or environment.allow_runtime_lora_updating(),
        reasoning_parser=fv.reasoning_parser,
        media=media_flags.media_settings(fv),
    )

    limits = ConnectionLimits(max_connections=fv.max_connections or None, header_timeout_s=fv.header_timeout_s,
                              body_timeout_s=fv.body_timeout_s, keepalive_timeout_s=fv.keepalive_timeout_s)

    async def serve() -> int:
        from jaxserve.async_engine import build_async_engine  # loads jax: the command runs it after --help and the flags are done

        try:
            # The server listens while the warm-up compiles; /health says 503 until the shapes a
            # first request needs are ready (one process; a multi-host job warms up first).
            engine = build_async_engine(fv.model, **serve_engine_kwargs(fv), background_warmup=True)
            config.sampling_defaults, defaults_line = sampling_defaults(fv)
        except (ValueError, OSError) as e:
            print(f"jaxserve serve: cannot build the engine for {fv.model!r}: {e}", file=sys.stderr)
            return 2
        logging.getLogger(__name__).info("%s", defaults_line)
        front = None
        if join is not None:  # steps go to every process; a lost process fails the job loudly
            from jaxserve.parallel import multihost, multihost_front  # loads jax: the command runs it after --help and the flags are done
            try:
                front = multihost_front.Front(fv.step_timeout_s, fv.heartbeat_timeout_s)
                front.attach(engine)
            except ValueError as e:
                print(f"jaxserve serve: {e}", file=sys.stderr)
                return 2
            except multihost.MultiHostError as e:  # a process lost before the first step
                print(f"jaxserve serve: the multi-host job failed: {e}", file=sys.stderr)
                multihost.exit_now(1)
        try:
            app = create_app(engine, config)
        except ValueError as e:  # tool or reasoning flags the model's chat template cannot serve
            print(f"jaxserve serve: {e}", file=sys.stderr)
            return 2
        _log_chat_parsing(app)
        announcements = set()  # the task that logs the ready line (kept referenced until it ends)

        def _announce(engine, port: int) -> None:
            task = asyncio.get_running_loop().create_task(_log_ready_after_warmup(engine, fv, port))
            announcements.add(task)
            task.add_done_callback(announcements.discard)
        try:
            await http_server.serve_until_stopped(app, fv.host, fv.port, limits=limits, on_ready=lambda port: _announce(engine, port))
        except OSError as e:
            print(f"jaxserve serve: cannot listen on {fv.host}:{fv.port}: {e}", file=sys.stderr)
            return 1
        finally:  # after the drain: SIGTERM on process 0 stops the whole job
            if front is not None:
                front.stop()
        if front is not None and front.failure is not None:
            print(f"jaxserve serve: the multi-host job failed: {front.failure}", file=sys.stderr)
            multihost.exit_now(1)
        return 0

    try:
        return asyncio.run(serve())
    except KeyboardInterrupt:
        return 0

"""`jaxserve generate`: batch generation, JSONL prompts in, JSONL completions out.

Input lines: {"id": ..., "prompt": "..."} or {"id": ..., "messages": [{"role", "content"}]} (the
server's chat messages: a content is a string or a list of text and, for a vision-language model,
image parts `{"type": "image_url", "image_url": {"url": ...}}` in user messages; the URLs as the
server takes them, under the same media flags), with optional per-line "max_tokens",
"temperature", "top_p", "top_k", "seed", "stop", and "lora": the name of a LoRA adapter of
--lora_modules (with --enable_lora) the line runs with. Output lines: {"id", "text", "token_ids",
"finish_reason", "num_prompt_tokens", "num_output_tokens"}, written as requests finish (completion
order, not input order: match lines by id). Ids already in the output file are skipped, so an
interrupted run resumes.
With --runner=pooling each line's prompt is pooled instead (no per-line sampling fields): output
lines {"id", "embedding", "num_prompt_tokens"} (the model's dimensions and normalization), or a
classifier's {"id", "probs", "label", "num_prompt_tokens"} (docs/pooling.md).
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import numpy as np
from absl import flags
from tqdm import tqdm

from jaxserve.commands import engine_flags, media_flags
from jaxserve.core.engine_client import ImageService
from jaxserve.core.request import SamplingParams, check_sampling_params, pooling_params
from jaxserve.multimodal.image_processing import process_images
from jaxserve.multimodal.inputs import MultimodalInputs
from jaxserve.multimodal.media import MediaError, check_limits, load_image_refs
from jaxserve.pooling.accumulate import finish_embedding
from jaxserve.engine import Engine
from serve.images import MediaSettings
from serve.prompts import chat_text, encode_chat, encode_image_prompt, encode_text
from serve.protocol import ProtocolError, parse_messages

_LINE_OVERRIDES = {"max_tokens": int, "temperature": (int, float), "top_p": (int, float),
                   "top_k": int, "seed": int, "stop": (str, list), "lora": str}
_LINE_FIELDS = {"lora": "lora_name"}  # a line's key -> the SamplingParams field, where they differ


class InputError(ValueError):
    """A problem with the input file, reported with its line number."""


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("input", None, "JSONL file of prompts", flag_values=fv)
    flags.DEFINE_string("output", None, "JSONL file of completions, one line per input id, written in the order "
                        "requests finish, not input order (appended; ids already there are skipped)",
                        flag_values=fv)
    flags.DEFINE_boolean("progress", True, "show a progress bar", flag_values=fv)
    media_flags.define_media_flags(fv)
    engine_flags.define_engine_flags(fv)
    engine_flags.define_sampling_flags(fv)
    engine_flags.define_distributed_flags(fv)


def read_prompts(path: str) -> list[dict]:
    """Parses and validates every line before anything runs. A line with messages has them as the
    chat template takes them (serve.protocol.parse_messages), and their images' references under
    "images" (jaxserve.multimodal.media.ImageRef, loaded once the model is)."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file")
    items, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(item, dict):
                raise InputError(f"{where}: each line must be a JSON object")
            if "id" not in item or not isinstance(item["id"], (str, int)) or isinstance(item["id"], bool):
                raise InputError(f"{where}: 'id' (a string or an integer) is required")
            if item["id"] in seen:
                raise InputError(f"{where}: duplicate id {item['id']!r}")
            seen.add(item["id"])
            has_prompt, has_messages = "prompt" in item, "messages" in item
            if has_prompt == has_messages:
                raise InputError(f"{where}: give exactly one of 'prompt' or 'messages'")
            if has_prompt and not isinstance(item["prompt"], str):
                raise InputError(f"{where}: 'prompt' must be a string")
            if has_messages:
                try:
                    item["messages"], item["images"] = parse_messages(item["messages"])
                except ProtocolError as e:
                    raise InputError(f"{where}: {e}") from None
            for key, types in _LINE_OVERRIDES.items():
                if key in item and (not isinstance(item[key], types) or isinstance(item[key], bool)):
                    raise InputError(f"{where}: '{key}' has the wrong type ({type(item[key]).__name__})")
            items.append(item)
    return items


def done_ids(path: str) -> set:
    if not os.path.isfile(path):
        return set()
    ids = set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                ids.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut short by an interrupted run is redone
    return ids


def _percentiles(values: list[float]) -> str:
    if not values:
        return "n/a"
    p50, p90, p99 = np.percentile(values, [50, 90, 99]) * 1000
    return f"p50 {p50:.1f} ms, p90 {p90:.1f} ms, p99 {p99:.1f} ms"


def run(fv: flags.FlagValues) -> int:
    if not fv.input or not fv.output:
        print("jaxserve generate: --input and --output are required", file=sys.stderr)
        return 2
    # A multi-host job: every process joins; process 0 reads the input, the others follow it.
    join, exit_code = engine_flags.enter_job(fv, "generate", warmup=False)
    if exit_code is not None:
        return exit_code
    try:
        items = read_prompts(fv.input)
        base = engine_flags.sampling_kwargs(fv)
        params = []
        for item in items:
            sp = SamplingParams(**{**base, **{_LINE_FIELDS.get(k, k): item[k] for k in _LINE_OVERRIDES if k in item}})
            if fv.runner == "pooling":  # the prompt alone, pooled
                overrides = [k for k in _LINE_OVERRIDES if k in item]
                if overrides:
                    raise InputError(f"{fv.input}: id {item['id']!r}: '{overrides[0]}' does not apply to --runner=pooling")
                sp = pooling_params()
            try:
                if fv.runner != "pooling":  # early, before the model loads; all of check_request after
                    check_sampling_params(sp)
            except ValueError as e:
                raise InputError(f"{fv.input}: id {item['id']!r}: {e}") from None
            params.append(sp)
    except InputError as e:
        print(f"jaxserve generate: {e}", file=sys.stderr)
        return 2
    skip = done_ids(fv.output)
    todo = [(item, sp) for item, sp in zip(items, params) if item["id"] not in skip]
    if not todo and join is None:  # (multi-host: the others load the model too, then are told to stop)
        print(f"jaxserve generate: all {len(items)} ids are already in {fv.output}", file=sys.stderr)
        return 0

    try:
        # Offline: compile each step shape when first used instead of all of them up front, unless
        # saved executables are to be loaded or written (a warm-up does that).
        warmup = fv.executables is not None or fv.save_executables is not None
        batch_defaults = engine_flags.batch_defaults(fv) if join is None else {}  # (multi-host: every process's)
        engine = Engine.from_model(fv.model, engine_flags.engine_config(fv, warmup=warmup, **batch_defaults))
    except (ValueError, OSError) as e:
        print(f"jaxserve generate: cannot load {fv.model!r}: {e}", file=sys.stderr)
        return 2
    settings, service = media_flags.media_settings(fv), ImageService.of(engine)
    prompts, images = [], []
    for item, sp in todo:
        try:
            ids, multimodal = encode_line(engine.tokenizer, item, service, settings)
            engine.check_request(ids, sp, multimodal)
        except ValueError as e:  # MediaError, InvalidRequestError
            print(f"jaxserve generate: id {item['id']!r}: {e}", file=sys.stderr)
            return 2
        prompts.append(ids)
        images.append(multimodal)
    if join is not None:
        def batch():
            if not todo:
                print(f"jaxserve generate: all {len(items)} ids are already in {fv.output}", file=sys.stderr)
                return 0
            return _run_batch(engine, todo, prompts, images, fv)
        return engine_flags.run_front(engine, batch, "generate", fv)
    return _run_batch(engine, todo, prompts, images, fv)


def encode_line(tokenizer, item: dict, service: ImageService | None,
                settings: MediaSettings) -> tuple[list[int], MultimodalInputs | None]:
    """A line's prompt ids, and its images for the engine (None without images): loaded under the
    media flags, processed, and placed in the chat template's prompt as the server does
    (serve.prompts.encode_image_prompt). MediaError for images the model or the flags refuse."""
    if "prompt" in item:
        return encode_text(tokenizer, item["prompt"]), None
    if not item["images"]:
        return encode_chat(tokenizer, item["messages"]), None
    if service is None:
        raise MediaError("the model takes no images (a text model)")
    check_limits(item["images"], settings.limits)
    loaded = asyncio.run(load_image_refs(item["images"], settings.policy))
    processed = process_images(loaded, [ref.label for ref in item["images"]], service.processor)
    return encode_image_prompt(tokenizer, chat_text(tokenizer, item["messages"]), processed, service)


def _pooled_fields(pooler, result) -> dict:
    """A pooled line's result: the embedding, or a classifier's probabilities and label."""
    if pooler.classifier is not None:
        probs = [float(p) for p in result.pooled]
        return {"probs": probs, "label": pooler.classifier.labels[int(np.argmax(probs))]}
    return {"embedding": finish_embedding(result.pooled, pooler.normalize, pooler.dimensions).tolist()}


def _run_batch(engine, todo, prompts, images, fv) -> int:
    request_ids = [f"line-{i}" for i in range(len(todo))]
    item_of = {rid: item for rid, (item, _) in zip(request_ids, todo)}
    bar = tqdm(total=len(todo), unit="req", disable=not fv.progress, file=sys.stderr)
    start = time.monotonic()
    with open(fv.output, "a", encoding="utf-8") as out:
        def write(result):
            if engine.pooler is not None:
                out.write(json.dumps({"id": item_of[result.request_id]["id"], **_pooled_fields(engine.pooler, result),
                                      "num_prompt_tokens": len(result.prompt_token_ids)}) + "\n")
                out.flush()
                bar.update(1)
                return
            out.write(json.dumps({
                "id": item_of[result.request_id]["id"], "text": result.text,
                "token_ids": result.token_ids, "finish_reason": result.finish_reason,
                "num_prompt_tokens": len(result.prompt_token_ids),
                "num_output_tokens": len(result.token_ids)}, ensure_ascii=False) + "\n")
            out.flush()
            bar.update(1)

        results = engine.generate(prompts, [sp for _, sp in todo], request_ids=request_ids,
                                  on_finish=write, multimodal=images)
    bar.close()
    elapsed = time.monotonic() - start
    if engine.pooler is not None:
        tokens = sum(len(r.prompt_token_ids) for r in results)
        print(f"{len(results)} inputs pooled, {tokens} tokens in {elapsed:.1f}s: {tokens / elapsed:.1f} tokens/s",
              file=sys.stderr)
        return 0
    num_out = sum(len(r.token_ids) for r in results)
    print(f"{len(results)} requests, {num_out} output tokens in {elapsed:.1f}s: "
          f"{num_out / elapsed:.1f} output tokens/s", file=sys.stderr)
    print(f"TTFT {_percentiles([r.ttft for r in results if r.ttft is not None])}", file=sys.stderr)
    print(f"TPOT {_percentiles([r.tpot for r in results if r.tpot is not None])}", file=sys.stderr)
    stats = engine.stats()
    if stats.spec_verify_steps:
        rate = stats.spec_accepted_tokens / max(stats.spec_proposed_tokens, 1)
        print(f"speculative decoding: {stats.spec_accepted_tokens} of {stats.spec_proposed_tokens} proposed tokens "
              f"accepted ({rate:.1%}) in {stats.spec_verify_steps} verification steps; accepted by position "
              f"{list(stats.spec_accepted_per_position)}", file=sys.stderr)
    return 0

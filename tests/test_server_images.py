"""Images through the OpenAI server and `jaxserve generate` (issue 53, the host side), on the tiny
random Qwen2.5-VL of tests/tiny_vlms.py (its projector random too, so an image changes the answer).

- the shared encoding (serve.prompts.encode_image_prompt after serve.protocol.parse_messages and
  the media loader): prompt ids and pixels equal transformers' processor, Qwen and Gemma 3;
- a streamed chat completion with an image (data: and file:// URLs give the same answer, another
  image another one), usage counting the image tokens as /tokenize and the processor do; the
  Responses API's input_image;
- hostile input: each a 400 whose JSON body names the problem, nothing logged at ERROR, and a
  stream running meanwhile gets every token; a text model refuses images before any is loaded;
- `jaxserve generate` with image lines gives the server's greedy tokens; bad image lines exit 2.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import threading
import time

import numpy as np
import openai
import pytest
import requests

from checkpoints.load import load_tokenizer
from jaxserve.commands import cli
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core.engine_client import ImageService
from jaxserve.engine import Engine
from jaxserve.multimodal.image_processing import load_image_processor, process_images
from jaxserve.multimodal.media import MediaPolicy, load_image_refs, parse_limit_mm_per_prompt
from serve.app import ServerConfig
from serve.images import MediaSettings, ServerImages
from serve.prompts import chat_text, encode_image_prompt
from serve.protocol import ProtocolError, parse_chat_request, parse_messages
from tests.test_multimodal_media import png_header_only
from tests.test_server import FakeEngine
from tests.test_server import LiveServer as FakeServer
from tests.test_server_engine import LiveServer
from tests.tiny_vlms import convert_vlm, hf_generate, hf_processor, make_vlm, random_image

pytestmark = pytest.mark.slow  # builds torch models, converts them, serves one

MAX_MODEL_LEN = 200
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN, page_size=8, num_pages=128,
              max_logprobs=5, warmup=False)  # an image may take 64 - 3 tokens (one step's, less the decode rows)
GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}


def png(seed: int, width: int = 56, height: int = 56) -> bytes:
    buffer = io.BytesIO()
    random_image(seed, width, height).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts) -> dict:
    return {"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}


@pytest.fixture(scope="module")
def vlms(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """family -> (Hugging Face folder, converted folder)."""
    folders = {}
    for family in ("qwen", "gemma"):
        root = tmp_path_factory.mktemp(f"{family}_vlm")
        make_vlm(family, str(root / "hf"))
        convert_vlm(str(root / "hf"), str(root / "converted"))
        folders[family] = (str(root / "hf"), str(root / "converted"))
    return folders


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    (folder / "a.png").write_bytes(png(1, 112, 84))
    return folder


@pytest.fixture(scope="module")
def server(vlms, media_dir):
    engine = Engine.from_model(vlms["qwen"][1], EngineConfig(**ENGINE))
    media = MediaSettings(MediaPolicy.from_flags(None, str(media_dir)))
    live = LiveServer(engine, ServerConfig(drain_timeout_s=2.0, media=media))
    yield live
    live.close()


def post(live, path: str, body) -> requests.Response:
    return requests.post(live.url + path, json=body, timeout=60)


def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def reference_ids(vlms, family: str, messages: list[dict], images: list) -> list[int]:
    """transformers' processor's prompt ids for template messages ({"type": "image"} parts)."""
    processor = hf_processor(family, vlms[family][0])
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    return list(processor(text=[text], images=images or None)["input_ids"][0])


# ---- the shared encoding -------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen", "gemma"])
def test_the_shared_encoding_equals_transformers_processor(vlms, family):
    """Messages in the OpenAI shape, images in two turns (data: URLs): parse_messages, the loader,
    the processor and encode_image_prompt (what the server and the CLI run) give transformers'
    prompt ids and pixels, and MultimodalInputs with each image's span on its tokens."""
    hf, converted = vlms[family]
    images = [random_image(1, 112, 84), random_image(2, 56, 56)]
    messages, refs = parse_messages([user(image_part(data_url(png(1, 112, 84))), "What is this?"),
                                     {"role": "assistant", "content": "A picture."},
                                     user("And this one?", image_part(data_url(png(2))))])
    tokenizer = load_tokenizer(converted)
    service = ImageService(load_image_processor(converted), ModelConfig.from_json_file(f"{converted}/config.json"))
    loaded = asyncio.run(load_image_refs(refs, MediaPolicy()))
    processed = process_images(loaded, [ref.label for ref in refs], service.processor)
    ids, multimodal = encode_image_prompt(tokenizer, chat_text(tokenizer, messages), processed, service)
    assert ids == reference_ids(vlms, family, messages, images)
    reference = hf_processor(family, hf).image_processor(images=images[:1], return_tensors="np")["pixel_values"]
    np.testing.assert_array_equal(processed[0].pixel_values, reference[0] if family == "gemma" else reference)
    image_token = service.model_config.image_token_id
    assert [ids[i.offset:i.end] == [image_token] * i.num_tokens for i in multimodal.images] == [True, True]


# ---- the server ----------------------------------------------------------------------------------

def test_a_streamed_chat_completion_with_an_image(server, vlms, media_dir):
    """Streamed with usage: the image's tokens count in prompt_tokens (as /tokenize and
    transformers' processor count them); the same image as a file:// URL answers the same, another
    image (in an earlier turn too) answers otherwise."""
    def stream(messages):
        chunks = list(client(server).chat.completions.create(
            model=server.async_engine.model_name, messages=messages, stream=True,
            stream_options={"include_usage": True}, logprobs=True, top_logprobs=5, temperature=0,
            max_tokens=GREEDY["max_tokens"], extra_body={"ignore_eos": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        first = next(c.choices[0].logprobs.content[0] for c in chunks if c.choices and c.choices[0].logprobs)
        assert chunks[-1].usage.completion_tokens == GREEDY["max_tokens"]
        return text, {t.token: t.logprob for t in first.top_logprobs}, chunks[-1].usage.prompt_tokens

    question = "Describe the picture."
    as_data = [user(image_part(data_url(png(1, 112, 84))), question)]
    text, first, prompt_tokens = stream(as_data)
    expected = reference_ids(vlms, "qwen", [user({"type": "image"}, question)], [random_image(1, 112, 84)])
    image_token = server.async_engine.engine.model_config.image_token_id
    assert prompt_tokens == len(expected) and expected.count(image_token) == 12  # 112x84: 8x6 patches, merged 2x2
    tokenized = post(server, "/tokenize", {"messages": as_data}).json()
    assert tokenized["tokens"] == expected and tokenized["count"] == prompt_tokens
    assert stream([user(image_part(f"file://{media_dir}/a.png"), question)])[:2] == (text, first)
    other_text, other_first, _ = stream([user(image_part(data_url(png(2, 112, 84))), question)])
    assert other_first != first
    earlier_turn = [user(image_part(data_url(png(2))), "Remember this."), {"role": "assistant", "content": "Done."},
                    user(question)]
    assert stream(earlier_turn)[1] != first


def test_responses_input_image(server):
    body = {"model": server.async_engine.model_name, "max_output_tokens": 3, "temperature": 0,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Describe the picture."},
                                                   {"type": "input_image", "image_url": data_url(png(1, 112, 84))}]}]}
    response = post(server, "/v1/responses", body)
    assert response.status_code == 200, response.text
    chat = {"messages": [user("Describe the picture.", image_part(data_url(png(1, 112, 84))))]}
    assert response.json()["usage"]["input_tokens"] == post(server, "/tokenize", chat).json()["count"]


def many(count: int, seed: int = 3) -> list[dict]:
    return [image_part(data_url(png(seed))) for _ in range(count)]


SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="8" height="8"><rect width="8" height="8"/></svg>'
HOSTILE = {  # name: (messages, what the error message says, its param)
    "corrupt base64": ([user(image_part("data:image/png;base64,iVBORw0K@@@="), "hi")], "not valid base64",
                       "messages"),
    "truncated png": ([user(image_part(data_url(png(1)[:200])), "hi")], "corrupt or truncated", "messages"),
    "30000x30000 png": ([user(image_part(data_url(png_header_only(30000, 30000))), "hi")], "too large to decode",
                        "messages"),
    "svg": ([user(image_part(data_url(SVG, "image/svg+xml")), "hi")], "not an image in a supported format",
            "messages"),
    "loopback url": ([user(image_part("http://127.0.0.1:9/a.png"), "hi")], "--allowed_media_domains", "messages"),
    "unresolvable host": ([user(image_part("http://no-such-host.invalid/a.png"), "hi")], "--allowed_media_domains",
                          "messages"),
    "file outside the folder": ([user(image_part("file:///etc/passwd"), "hi")], "outside --allowed_local_media_path",
                                "messages"),
    "plain path": ([user(image_part("/etc/passwd"), "hi")], "data:, http(s):// or file://", "messages"),
    "no url": ([user({"type": "image_url", "image_url": {}}, "hi")], "an image part must be", "messages[0].content"),
    "image in a system message": ([{"role": "system", "content": many(1)}, user("hi")], "user messages only",
                                  "messages[0].content"),
    "64 images": ([user(*many(64), "hi")], "64 image(s) alone take 256", "messages"),  # early: none decoded
    # headers of 200x200 (49 tokens each) and no pixel data: the context is checked before decoding
    "5 image headers": ([user(*[image_part(data_url(png_header_only(200, 200)))] * 5)], "5 image(s) alone take 245",
                        "messages"),
    "1 image header": ([user(image_part(data_url(png_header_only(200, 200))))], "corrupt or truncated", "messages"),
    "40 images": ([user(*many(40), "hi")], "leaving no room for a completion", "messages"),  # the engine's check
    "an image over one step": ([user(image_part(data_url(png(4, 224, 224))), "hi")], "more than one step",
                               "messages"),
    "placeholder in the text": ([user(image_part(data_url(png(1))), "see <|image_pad|>")], "image placeholder",
                                "messages"),
}


def test_hostile_images_are_400s_naming_the_problem_and_hold_up_nothing(server, caplog):
    """Every request of HOSTILE while a text stream runs: a 400 with the problem in its JSON error,
    answered within seconds; the stream gets every token; nothing logged at ERROR."""
    done = {}

    def stream():
        chunks = client(server).chat.completions.create(
            model=server.async_engine.model_name, messages=[user("Tell me a story.")], stream=True,
            temperature=0, max_tokens=40, extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
        done["usage"] = list(chunks)[-1].usage
    thread = threading.Thread(target=stream)
    with caplog.at_level(logging.WARNING):
        thread.start()
        for name, (messages, says, param) in HOSTILE.items():
            start = time.monotonic()
            r = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
            assert r.status_code == 400, (name, r.text)
            error = r.json()["error"]
            assert says in error["message"] and error["param"] == param, (name, error)
            assert error["type"] == "invalid_request_error" and time.monotonic() - start < 10, name
        thread.join(120)
    assert done["usage"].completion_tokens == 40
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text


def test_the_image_limit_is_checked_before_any_image_loads(vlms):
    """--limit_mm_per_prompt: 3 images over a limit of 2 are refused before the (refused) URLs load."""
    request = parse_chat_request({"messages": [user(*[image_part("http://127.0.0.1:9/x.png")] * 3)]}, "m")
    service = ImageService(load_image_processor(vlms["qwen"][1]), None)
    images = ServerImages(service, MediaSettings(limits=parse_limit_mm_per_prompt('{"image": 2}')), "m", None)
    with pytest.raises(ProtocolError, match=r"image 3 of message 1: at most 2 image\(s\) per prompt .*"
                                            r"--limit_mm_per_prompt"):
        asyncio.run(images.load(request, MAX_MODEL_LEN))


def test_a_text_model_refuses_images_before_loading_them():
    """The FakeEngine is a text model: a 400 saying so for chat, Responses and /tokenize; the
    engine never sees the request."""
    live = FakeServer(FakeEngine(), ServerConfig())
    try:
        messages = [user(image_part("http://127.0.0.1:9/never-fetched.png"), "hi")]
        for path, body in [("/v1/chat/completions", {"messages": messages, "max_tokens": 2}),
                           ("/tokenize", {"messages": messages}),
                           ("/v1/responses", {"input": [{"role": "user", "content": [
                               {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]})]:
            status, _, body = live.request("POST", path, body)
            assert status == 400 and "takes no images" in body["error"]["message"], (path, body)
            assert body["error"]["param"] == ("input" if path == "/v1/responses" else "messages")
        assert live.engine.prompts == []
    finally:
        live.close()


# ---- jaxserve generate ---------------------------------------------------------------------------

def generate(model_dir, tmp_path, lines, *flags) -> int:
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return cli.main(["jaxserve", "generate", f"--model={model_dir}", f"--input={inp}",
                     f"--output={tmp_path / 'out.jsonl'}", "--noprogress", "--temperature=0",
                     f"--max_tokens={GREEDY['max_tokens']}", "--ignore_eos",
                     *[f"--{k}={v}" for k, v in ENGINE.items() if k != "warmup"], *flags])


def test_generate_with_images_gives_the_servers_greedy_tokens(server, vlms, media_dir, tmp_path):
    question = "Describe the picture."
    lines = [{"id": "data", "messages": [user(image_part(data_url(png(1, 112, 84))), question)]},
             {"id": "file", "messages": [user(question, image_part(f"file://{media_dir}/a.png"))]}]
    assert generate(vlms["qwen"][1], tmp_path, lines, f"--allowed_local_media_path={media_dir}") == 0
    rows = {row["id"]: row for row in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    for line in lines:
        answer = post(server, "/v1/chat/completions", {"messages": line["messages"], "logprobs": True,
                                                        "return_token_ids": True, **GREEDY}).json()
        assert rows[line["id"]]["token_ids"] == answer["choices"][0]["token_ids"], line["id"]
        assert rows[line["id"]]["num_prompt_tokens"] == answer["usage"]["prompt_tokens"]


@pytest.mark.parametrize("line, flags, says", [
    ({"messages": [{"role": "system", "content": many(1)}, user("hi")]}, [], "user messages only"),
    ({"messages": [user(image_part("file:///etc/hostname"), "hi")]}, [], "--allowed_local_media_path"),
    ({"messages": [user(*many(3), "hi")]}, ['--limit_mm_per_prompt={"image": 2}'], "--limit_mm_per_prompt"),
    ({"prompt": "hi"}, ["--limit_mm_per_prompt=[2]"], "--limit_mm_per_prompt"),
])
def test_generate_refuses_bad_image_lines_with_exit_2(vlms, tmp_path, capsys, line, flags, says):
    assert generate(vlms["qwen"][1], tmp_path, [{"id": 1, **line}], *flags) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("family", ["qwen", "gemma"])
def test_greedy_tokens_through_the_server_equal_transformers(vlms, family):
    """One image, two, the two swapped, and a text-only request, sent at once (so they share the
    engine's steps): each choice's token ids equal transformers' greedy generate on the processor's
    inputs, and the swapped images answer otherwise."""
    import concurrent.futures

    import transformers
    hf, converted = vlms[family]
    model_class = (transformers.Qwen2_5_VLForConditionalGeneration if family == "qwen"
                   else transformers.Gemma3ForConditionalGeneration)
    model = model_class.from_pretrained(hf, dtype="float32").eval()
    processor = hf_processor(family, hf)
    images = {"a": (1, 112, 84), "b": (2, 56, 56)}
    cases = {"a": "Describe the picture.", "ab": "What differs?", "ba": "What differs?", "": "Say hello."}

    def expected(order: str) -> list[int]:
        messages = [user(*[{"type": "image"} for _ in order], cases[order])]
        return hf_generate(model, processor, messages, [random_image(*images[i]) for i in order],
                           GREEDY["max_tokens"])[0]

    engine = Engine.from_model(converted, EngineConfig(**{**ENGINE, "max_num_batched_tokens": 32}))
    live = LiveServer(engine)
    try:
        def ask(order: str) -> list[int]:
            parts = [image_part(data_url(png(*images[i]))) for i in order] + [cases[order]]
            body = {"model": live.async_engine.model_name, "messages": [user(*parts)], "return_token_ids": True,
                    **GREEDY}
            response = post(live, "/v1/chat/completions", body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["token_ids"]

        with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
            ours = dict(zip(cases, pool.map(ask, cases)))
    finally:
        live.close()
    assert ours == {order: expected(order) for order in cases}, family
    assert ours["ab"] != ours["ba"]
    assert max(record.num_prefill_rows for record in engine.step_records) >= 2  # chunks of several requests in a step

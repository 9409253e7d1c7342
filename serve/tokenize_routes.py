"""vLLM's tokenizer routes: POST /tokenize and /detokenize, GET /tokenizer_info.

/tokenize encodes a prompt or chat messages exactly as generation would (serve.prompts), a chat's
images included: they are loaded and their tokens counted, as vLLM counts them (serve/images.py).
Parsing and tokenizing run in the server's prepare threads. No jax here.
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from aiohttp import web

from serve.prompts import check_prompt_chars, prompt_token_ids
from serve.protocol import GenerationRequest, parse_detokenize_request, parse_tokenize_request


def add_routes(app: web.Application, state: Callable[[web.Request], Any],
               read_body: Callable[[web.Request], Awaitable[bytes]], parse_json: Callable[[bytes], Any]) -> None:
    """Routes the tokenizer endpoints of `app`; `state(request)` is the server's ServerState (engine,
    model names, prepare threads, images), `read_body` reads a body, `parse_json` parses it (400s)."""
    async def handle_tokenize(request: web.Request) -> web.Response:
        server = state(request)
        raw = await read_body(request)
        loop = asyncio.get_running_loop()
        prompt, token_strs = await loop.run_in_executor(server.prepare_pool,
                                                        lambda: _parse_tokenize(server, parse_json(raw)))
        images = await server.images.load(prompt, server.engine.max_model_len) if prompt.images else None
        return web.json_response(await loop.run_in_executor(server.prepare_pool, _tokenize, server, prompt, token_strs,
                                                            images))

    async def handle_detokenize(request: web.Request) -> web.Response:
        server = state(request)
        raw = await read_body(request)
        return web.json_response(await asyncio.get_running_loop().run_in_executor(
            server.prepare_pool, lambda: _detokenize(server, parse_json(raw))))

    async def handle_tokenizer_info(request: web.Request) -> web.Response:
        return web.json_response(tokenizer_info(state(request)))

    app.router.add_post("/tokenize", handle_tokenize)
    app.router.add_post("/detokenize", handle_detokenize)
    app.router.add_get("/tokenizer_info", handle_tokenizer_info)


def _parse_tokenize(server, body: Any) -> tuple[GenerationRequest, bool]:
    """A /tokenize body -> (its prompt as a request, whether token strings were asked for)."""
    request, return_token_strs = parse_tokenize_request(body, server.model_names)
    check_prompt_chars(request, server.engine.max_model_len, server.max_token_chars)
    return request, return_token_strs


def _tokenize(server, request: GenerationRequest, return_token_strs: bool,
              images: list[bytes] | None) -> dict[str, Any]:
    """vLLM's /tokenize response: the ids generation would use for that prompt (with its images'
    tokens; `images` fetched by ServerImages.load)."""
    tokenizer = server.engine.tokenizer
    token_ids = server.images.prompt(tokenizer, request, images)[0] if images else prompt_token_ids(tokenizer, request)
    return {"count": len(token_ids), "max_model_len": server.engine.max_model_len, "tokens": token_ids,
            "token_strs": tokenizer.convert_ids_to_tokens(token_ids) if return_token_strs else None}


def _detokenize(server, body: Any) -> dict[str, Any]:
    tokenizer = server.engine.tokenizer
    return {"prompt": tokenizer.decode(parse_detokenize_request(body, server.model_names, len(tokenizer)))}


def tokenizer_info(server) -> dict[str, Any]:
    """vLLM's /tokenizer_info: what a client needs to tokenize as the server does (lm-eval's
    `tokenizer_backend=remote` reads the special tokens and the chat template, then calls
    /tokenize and /detokenize)."""
    tokenizer = server.engine.tokenizer
    template = getattr(tokenizer, "chat_template", None)
    return {"tokenizer_class": type(tokenizer).__name__, "model_max_length": server.engine.max_model_len,
            "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token,
            "unk_token": tokenizer.unk_token, "chat_template": template if isinstance(template, str) else None,
            "vocab_size": len(tokenizer), "add_bos_token": getattr(tokenizer, "add_bos_token", None)}

"""Prompt encoding (Hugging Face tokenizers): plain text, chat templates and prompts with images,
shared by the server and the CLI, and the server's cheap bound on a prompt's length before any
tokenizing.

`encode_text`, `encode_chat` and `encode_image_prompt` are the encodings themselves;
`prompt_token_ids` and `image_prompt` encode a parsed request's prompt exactly as generation (and
/tokenize) will, turning a chat template's refusal into a 400 naming the client's field. No jax here.
"""
from __future__ import annotations

from typing import Any, Sequence

import jinja2

from jaxserve.core.engine_client import ImageService
from jaxserve.multimodal.image_processing import ProcessedImage, expand_prompt
from jaxserve.multimodal.inputs import MultimodalInputs, prompt_images
from jaxserve.multimodal.media import MediaError
from serve.protocol import GenerationRequest, ProtocolError


def chat_text(tokenizer: Any, messages: list[dict], *, add_generation_prompt: bool = True,
              tools: list[dict] | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """`messages` under the model's chat template, generation prompt added. `tools` (OpenAI's
    function tools) go to the template, which describes them as it defines; `chat_template_kwargs`
    are more variables for it (e.g. Qwen3's `enable_thinking`). An image part ({"type": "image"})
    becomes the model's image placeholder, as the template writes it."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         tools=tools, **(chat_template_kwargs or {}))


def encode_chat(tokenizer: Any, messages: list[dict], *, add_generation_prompt: bool = True,
                add_special_tokens: bool = False, tools: list[dict] | None = None,
                chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of `chat_text` (the template writes the special tokens itself, so the tokenizer
    adds none by default: vLLM's)."""
    text = chat_text(tokenizer, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                     chat_template_kwargs=chat_template_kwargs)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def encode_image_prompt(tokenizer: Any, text: str, images: Sequence[ProcessedImage], service: ImageService, *,
                        add_special_tokens: bool = False) -> tuple[list[int], MultimodalInputs]:
    """A templated prompt with one image placeholder per image -> its token ids, each placeholder
    replaced by its image's tokens (transformers' processors' rule), and the prompt's
    MultimodalInputs for the engine. MediaError when the prompt's placeholders or image tokens do
    not match the images (a user's text that writes them, for one)."""
    expanded = expand_prompt(text, service.processor, [image.num_tokens for image in images])
    ids = list(tokenizer.encode(expanded, add_special_tokens=add_special_tokens))
    try:
        return ids, prompt_images(ids, images, service.model_config)
    except ValueError as e:  # image tokens written in the text, a video token (M-RoPE's refusal)
        raise MediaError(str(e)) from None


def encode_text(tokenizer: Any, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a plain prompt, with the tokenizer's own special tokens (e.g. BOS) by default."""
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def max_token_chars(tokenizer: Any) -> int:
    """Characters of the vocabulary's longest token, as the tokenizer stores it.

    For byte-level BPE a stored character is one byte of text, and every character of text is at
    least one byte, so a text of N characters has at least N / max_token_chars tokens: a bound
    that refuses an oversized prompt without tokenizing it."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max(len(t) for t in tokens if t is not None)


def num_prompt_chars(request: GenerationRequest, index: int = 0) -> int:
    """Characters of the client's text: prompt `index`, or the messages' contents (0 for token ids)."""
    if request.is_chat:
        return sum(_content_chars(m["content"]) + len(m.get("reasoning", "")) for m in request.messages)
    prompt = request.prompts[index]
    return len(prompt) if isinstance(prompt, str) else 0


def _content_chars(content: str | list[dict]) -> int:
    return len(content) if isinstance(content, str) else sum(len(part.get("text", "")) for part in content)


def check_prompt_chars(request: GenerationRequest, max_seq_len: int, max_token_chars: int) -> None:
    """Refuses, before any tokenizing, text that is longer than the context could hold even if
    every token were the vocabulary's longest (`max_token_chars` characters)."""
    for index in range(request.num_prompts):
        num_chars = num_prompt_chars(request, index)
        if num_chars > max_seq_len * max_token_chars:
            which = f"prompt {index} has" if request.num_prompts > 1 else "prompt has"
            raise ProtocolError(
                f"This model's maximum context length is {max_seq_len} tokens; the {which} {num_chars} "
                f"characters, which is at least {-(-num_chars // max_token_chars)} tokens (no token is longer "
                f"than {max_token_chars} characters)", param="messages" if request.is_chat else "prompt",
                code="context_length_exceeded")


def prompt_token_ids(tokenizer: Any, request: GenerationRequest, index: int = 0) -> list[int]:
    """The token ids of prompt `index`: the chat template for chat (with the generation prompt
    unless the client turned it off), else the tokenizer (with its special tokens, e.g. BOS,
    unless `add_special_tokens` is false) or the client's own ids."""
    if request.is_chat:
        text = _chat_request_text(tokenizer, request)
        return encode_text(tokenizer, text, add_special_tokens=request.add_special_tokens)
    prompt = request.prompts[index]
    if isinstance(prompt, str):
        return encode_text(tokenizer, prompt, add_special_tokens=request.add_special_tokens)
    return list(prompt)


def image_prompt(tokenizer: Any, request: GenerationRequest, images: Sequence[ProcessedImage],
                 service: ImageService) -> tuple[list[int], MultimodalInputs]:
    """A chat request with images (`request.images`, processed): its token ids, the image tokens
    included, and its MultimodalInputs (`encode_image_prompt`); a 400 naming `messages` when they
    do not match."""
    text = _chat_request_text(tokenizer, request)
    try:
        return encode_image_prompt(tokenizer, text, images, service, add_special_tokens=request.add_special_tokens)
    except MediaError as e:
        raise ProtocolError(str(e), param="messages") from None


# What a chat template may raise on a request's messages or variables (its raise_exception is a TemplateError).
_TEMPLATE_ERRORS = (ValueError, TypeError, ArithmeticError, LookupError, AttributeError, jinja2.TemplateError)


def _chat_request_text(tokenizer: Any, request: GenerationRequest, with_kwargs: bool = True) -> str:
    """The chat template's text; a template that refuses the request is a 400 naming
    `chat_template_kwargs` when the messages alone render, else `messages`."""
    kwargs = request.chat_template_kwargs if with_kwargs else None
    try:
        return chat_text(tokenizer, request.messages, add_generation_prompt=request.add_generation_prompt,
                         chat_template_kwargs=kwargs,
                         tools=request.tools.template_tools if request.tools is not None else None)
    except _TEMPLATE_ERRORS as e:
        error = e
    except RecursionError:
        raise ProtocolError("the messages are nested too deeply for the chat template", param="messages") from None
    if kwargs:
        try:
            _chat_request_text(tokenizer, request, with_kwargs=False)
        except ProtocolError:
            pass
        else:
            raise ProtocolError(f"the chat template rejected 'chat_template_kwargs': {error}",
                                param="chat_template_kwargs")
    raise ProtocolError(f"the chat template rejected the messages: {error}", param="messages")


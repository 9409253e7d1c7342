"""Image input on the server: a chat request's images loaded, checked and placed in its prompt for
a vision-language engine (vLLM's behaviour and flags, docs/api.md "Images").

jaxserve.multimodal does the work (media.py: fetching and decoding under the media flags;
image_processing.py: the model's processor; inputs.py: the engine's MultimodalInputs); this module
orders it for a request and turns every refusal into a 400 naming `messages`. Fetching is async on
the event loop. In the server's prepare threads: the images' sizes read from their headers, so the
context is checked before any pixel is decoded; then, in one thread per request, each image decoded
and processed in turn (one full-size image in memory at a time), the chat template's placeholders
expanded and the prompt tokenized. No jax here.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from concurrent.futures import Executor
from typing import Any

from jaxserve.core.engine_client import ImageService
from jaxserve.multimodal.image_processing import image_token_counts, process_images
from jaxserve.multimodal.inputs import MultimodalInputs
from jaxserve.multimodal.media import (MediaError, MediaPolicy, check_limits, decode_image, fetch_images, image_size,
                                       parse_limit_mm_per_prompt)
from serve.prompts import image_prompt
from serve.protocol import GenerationRequest, ProtocolError


@dataclasses.dataclass(frozen=True)
class MediaSettings:
    """The server's media flags: `--allowed_media_domains` and `--allowed_local_media_path` (the
    policy: where images may come from, and the bounds on their bytes and pixels) and
    `--limit_mm_per_prompt` (images per prompt; vLLM's default 999)."""
    policy: MediaPolicy = MediaPolicy()
    limits: Mapping[str, int] = dataclasses.field(default_factory=lambda: parse_limit_mm_per_prompt(None))


class ServerImages:
    """The images of a server's requests, for the engine's `image_service` (None: a text model)."""

    def __init__(self, service: ImageService | None, settings: MediaSettings, model_name: str,
                 executor: Executor | None) -> None:
        self.service = service
        self.settings = settings
        self.model_name = model_name
        self.executor = executor  # the prepare threads (None: the loop's default)

    async def load(self, request: GenerationRequest, max_model_len: int) -> list[bytes]:
        """The encoded bytes of `request.images`, after the cheap checks (the model takes images,
        the prompt holds no more than `--limit_mm_per_prompt`) and before any pixel is decoded the
        image tokens' count from the headers (they alone may not exceed the context). A 400 for an
        image that cannot be fetched or is not an image of a supported format and size."""
        if self.service is None:
            raise ProtocolError(f"the model `{self.model_name}` takes no images (a text model): send text only",
                                param="messages")
        try:
            check_limits(request.images, self.settings.limits)
            encoded = await fetch_images(request.images, self.settings.policy)
            num_tokens = await asyncio.get_running_loop().run_in_executor(
                self.executor, self._num_tokens, encoded, [ref.label for ref in request.images])
        except MediaError as e:
            raise ProtocolError(str(e), param="messages") from None
        if num_tokens > max_model_len:
            raise ProtocolError(f"This model's maximum context length is {max_model_len} tokens; the prompt's "
                                f"{len(encoded)} image(s) alone take {num_tokens}", param="messages",
                                code="context_length_exceeded")
        return encoded

    def _num_tokens(self, encoded: list[bytes], labels: list[str]) -> int:
        sizes = [image_size(data, label, self.settings.policy.max_image_pixels) for data, label in zip(encoded, labels)]
        return sum(image_token_counts(sizes, labels, self.service.processor))

    def prompt(self, tokenizer: Any, request: GenerationRequest,
               encoded: list[bytes]) -> tuple[list[int], MultimodalInputs]:
        """The request's prompt ids with each image's tokens, and its MultimodalInputs: each image
        (`load`'s bytes) decoded and processed in turn, then the chat template's placeholders
        expanded and the prompt tokenized (serve.prompts.image_prompt). For the prepare threads."""
        processed = []
        try:
            for data, ref in zip(encoded, request.images):
                image = decode_image(data, ref.label, self.settings.policy.max_image_pixels)
                processed += process_images([image], [ref.label], self.service.processor)
        except MediaError as e:
            raise ProtocolError(str(e), param="messages") from None
        return image_prompt(tokenizer, request, processed, self.service)

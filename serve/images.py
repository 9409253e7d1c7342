"""Image input on the server: a chat request's images loaded, checked and placed in its prompt for
a vision-language engine (vLLM's behaviour and flags, docs/api.md "Images").

jaxserve.multimodal does the work (media.py: loading under the media flags; image_processing.py:
the model's processor; inputs.py: the engine's MultimodalInputs); this module orders it for a
request and turns every refusal into a 400 naming `messages`. Fetching is async on the event loop;
decoding, processing, templating and tokenizing run in the server's prepare threads. No jax here.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from concurrent.futures import Executor
from typing import Any

from PIL import Image

from jaxserve.core.engine_client import ImageService
from jaxserve.multimodal.image_processing import image_token_counts, process_images
from jaxserve.multimodal.inputs import MultimodalInputs
from jaxserve.multimodal.media import MediaError, MediaPolicy, check_limits, load_image_refs, parse_limit_mm_per_prompt
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
                 executor: Executor) -> None:
        self.service = service
        self.settings = settings
        self.model_name = model_name
        self.executor = executor  # the prepare threads: images are decoded there

    async def load(self, request: GenerationRequest, max_model_len: int) -> list[Image.Image]:
        """`request.images` decoded (RGB), after the cheap checks: the model takes images, and the
        prompt holds no more than `--limit_mm_per_prompt`. A 400 for an image that cannot be
        loaded or decoded, or images whose tokens alone exceed the context (none is processed)."""
        if self.service is None:
            raise ProtocolError(f"the model `{self.model_name}` takes no images (a text model): send text only",
                                param="messages")
        labels = [ref.label for ref in request.images]
        try:
            check_limits(request.images, self.settings.limits)
            images = await load_image_refs(request.images, self.settings.policy, executor=self.executor)
            num_tokens = sum(image_token_counts(images, labels, self.service.processor))
        except MediaError as e:
            raise ProtocolError(str(e), param="messages") from None
        if num_tokens > max_model_len:
            raise ProtocolError(f"This model's maximum context length is {max_model_len} tokens; the prompt's "
                                f"{len(images)} image(s) alone take {num_tokens}", param="messages",
                                code="context_length_exceeded")
        return images

    def prompt(self, tokenizer: Any, request: GenerationRequest,
               images: list[Image.Image]) -> tuple[list[int], MultimodalInputs]:
        """The request's prompt ids with each image's tokens, and its MultimodalInputs: the images
        processed, the chat template's placeholders expanded, tokenized (serve.prompts.image_prompt).
        For the prepare threads."""
        try:
            processed = process_images(images, [ref.label for ref in request.images], self.service.processor)
        except MediaError as e:
            raise ProtocolError(str(e), param="messages") from None
        return image_prompt(tokenizer, request, processed, self.service)

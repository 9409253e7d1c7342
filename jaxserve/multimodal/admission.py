"""What a vision-language engine refuses: settings it is not served with (yet), and a request's
images that could never be computed (host side, no jax)."""
from __future__ import annotations

from typing import Sequence

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core.request import InvalidRequestError


def check_vision_settings(model_config: ModelConfig, cfg: EngineConfig, has_vision: bool) -> None:
    """ValueError for an engine of a vision-language model without its tower, or with a setting
    its image path does not support yet."""
    name = model_config.multimodal_architecture
    if not has_vision:
        raise ValueError(f"{name} needs its vision tower")
    refused = {"--tensor_parallel_size > 1": cfg.tensor_parallel_size > 1,
               "--data_parallel_size > 1": cfg.data_parallel_size > 1,
               "--speculative_method": cfg.speculative_method,
               "--num_scheduler_steps > 1": cfg.num_scheduler_steps > 1, "--enable_lora": cfg.enable_lora,
               "--runner=pooling": cfg.runner == "pooling"}
    for flag, used in refused.items():
        if used:
            raise ValueError(f"{flag} is not supported with a vision-language model ({name}) yet")


def check_prompt_images(prompt_token_ids: Sequence[int], multimodal, config: ModelConfig, model_name: str,
                        max_image_tokens: int) -> None:
    """InvalidRequestError (param "messages") unless the model takes images, each image's span is
    inside the prompt, over its image tokens, after the one before, and small enough for one
    step (`max_image_tokens`: jaxserve.core.encoder_cache.max_image_tokens)."""
    if not config.multimodal_architecture:
        raise InvalidRequestError(f"{model_name} is a text model ({config.architecture}): it takes no images",
                                  param="messages")
    end = 0
    for i, image in enumerate(multimodal.images):
        if image.offset < end or image.end > len(prompt_token_ids) or any(
                t != config.image_token_id for t in prompt_token_ids[image.offset:image.end]):
            raise InvalidRequestError(f"image {i}'s tokens are not where the prompt has them", param="messages")
        if image.num_tokens > max_image_tokens:
            raise InvalidRequestError(
                f"image {i} takes {image.num_tokens} tokens, more than one step can compute ({max_image_tokens}: "
                "--max_num_batched_tokens less the decode rows beside it); send a smaller image or raise "
                "--max_num_batched_tokens", param="messages")
        end = image.end

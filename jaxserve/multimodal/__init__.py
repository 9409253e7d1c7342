"""Image input for vision-language models, the host side (no jax): which images a chat request
refers to and loading them under the server's media flags (media.py), and turning each image into
the arrays and prompt tokens a model expects, equal to transformers' PIL image processors
(image_processing.py). Every refusal is a `MediaError`, which the server answers with HTTP 400."""
from jaxserve.multimodal.media import MediaError

__all__ = ["MediaError"]

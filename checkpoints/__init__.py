"""Checkpoint conversion (HF safetensors / GGUF -> orbax) and loading.

A converted model directory holds `config.json` (HF style), `params/` (orbax checkpoint of the
parameter pytree described in `checkpoints.layout`), the tokenizer files and `jaxserve.json`; a
vision-language model also `vision/` (its vision tower and projector) and its image processor's files.
"""

FORMAT_VERSION = 1
MARKER_FILE = "jaxserve.json"
PARAMS_DIR = "params"
VISION_DIR = "vision"  # a vision-language model's vision params (orbax), beside PARAMS_DIR


class ConversionError(ValueError):
    """A checkpoint that cannot be converted or loaded; the message names the file or tensor."""

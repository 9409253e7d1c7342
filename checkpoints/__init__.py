"""Checkpoint conversion (HF safetensors / GGUF -> orbax) and loading.

A converted model directory holds `config.json` (HF style), `params/` (orbax checkpoint of the
parameter pytree described in `checkpoints.layout`), the tokenizer files and `jaxserve.json`.
"""

FORMAT_VERSION = 1
MARKER_FILE = "jaxserve.json"
PARAMS_DIR = "params"


class ConversionError(ValueError):
    """A checkpoint that cannot be converted or loaded; the message names the file or tensor."""

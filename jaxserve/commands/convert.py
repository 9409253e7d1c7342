"""`jaxserve convert`: a Hugging Face folder or a GGUF file -> a jaxserve checkpoint directory."""
from __future__ import annotations

import sys
import time

from absl import flags

from checkpoints import ConversionError


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("source", None, "Hugging Face model folder (config.json + *.safetensors) or a "
                        ".gguf file.", flag_values=fv)
    flags.DEFINE_string("output", None, "Directory to create with the converted model.", flag_values=fv)
    flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"], "Stored weight dtype; default: "
                      "float32 for GGUF, the source's dtype for Hugging Face folders.", flag_values=fv)
    flags.DEFINE_boolean("overwrite", False, "Replace --output if it already exists.", flag_values=fv)
    flags.DEFINE_string("quantization", None, "Store the linear layers quantized: int8 (per output channel), "
                        "int4 (groups of 32 with a zero point), int8_g32|64|128, int4_g64|128, _zp for int8 with "
                        "a zero point, _sym for symmetric int4. GGUF Q8_0 / Q4_0 / Q4_1 tensors are copied "
                        "without a float round trip (int8: as int8_g32 / int8_g32 / int8_g32_zp when _zp is "
                        "asked; int4: - / int4_g32_sym / int4_g32).", flag_values=fv)


def run(fv: flags.FlagValues) -> int:
    if not fv.source or not fv.output:
        print("jaxserve convert: --source and --output are required", file=sys.stderr)
        return 2
    from checkpoints.convert import convert_checkpoint  # loads jax: the command runs it after --help and the flags are done
    from jaxserve.models import weights

    start = time.perf_counter()
    try:
        config = convert_checkpoint(fv.source, fv.output, dtype=fv.dtype, overwrite=fv.overwrite,
                                    quantization=fv.quantization)
    except ConversionError as e:
        print(f"jaxserve convert: {e}", file=sys.stderr)
        return 2
    print(f"converted {fv.source} -> {fv.output}: {config.architecture}, {config.num_layers} layers, "
          f"{weights.num_params(config) / 1e6:.1f}M parameters in {time.perf_counter() - start:.1f}s")
    return 0

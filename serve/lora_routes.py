"""vLLM's run-time LoRA routes: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
POST /v1/unload_lora_adapter {"lora_name"} (serve.app routes them here).

They answer only where run-time updates are on (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, or
--allow_runtime_lora_updating): otherwise 404 saying how to turn them on. A load reads and checks
the adapter before anything changes: an adapter that cannot be served is a 400 naming the
reason, and the adapters already served are untouched.
"""
from __future__ import annotations

from typing import Any

from checkpoints.lora_adapter import LoRAError
from jaxserve.core.engine_client import EngineClient
from jaxserve.core.lora_registry import LoRANotFoundError
from serve.protocol import ProtocolError

MAX_FIELD_CHARS = 4096


def check_route(*, allowed: bool, enabled: bool) -> None:
    """Before the body is read: ProtocolError 404 while run-time updates are off (`allowed`),
    400 when LoRA is off (`enabled`)."""
    if not allowed:
        raise ProtocolError("run-time LoRA loading is off: set VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in the server's "
                            "environment (or pass --allow_runtime_lora_updating)", status=404, code="not_found")
    if not enabled:
        raise ProtocolError("LoRA is not enabled: start the server with --enable_lora")


def lora_fields(body: Any, names: tuple[str, ...]) -> tuple[str, ...]:
    """The string fields `names` of a LoRA route's JSON body; ProtocolError 400 when one is not a
    non-empty string."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    values = []
    for name in names:
        value = body.get(name)
        if not isinstance(value, str) or not value or len(value) > MAX_FIELD_CHARS or "\x00" in value:
            raise ProtocolError(f"'{name}' must be a non-empty string of at most {MAX_FIELD_CHARS} characters",
                                param=name)
        values.append(value)
    return tuple(values)


async def load_adapter(engine: EngineClient, base_names: tuple[str, ...], name: str, path: str) -> str:
    """Serves the adapter in `path` as `name`; the success text, or ProtocolError 400."""
    if name in base_names:
        raise ProtocolError(f"'{name}' is the base model's name", param="lora_name")
    try:
        await engine.load_lora_adapter(name, path)
    except ValueError as e:  # LoRAError (the adapter itself), or the name taken
        raise ProtocolError(str(e), param="lora_path" if isinstance(e, LoRAError) else "lora_name") from None
    return f"Success: LoRA adapter '{name}' added successfully."


async def unload_adapter(engine: EngineClient, name: str) -> str:
    """Stops serving adapter `name`; the success text, or ProtocolError 404."""
    try:
        await engine.unload_lora_adapter(name)
    except LoRANotFoundError as e:
        raise ProtocolError(str(e), status=404, param="lora_name", code="model_not_found") from None
    return f"Success: LoRA adapter '{name}' removed successfully."

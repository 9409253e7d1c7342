"""What the server needs from an engine: the `EngineClient` protocol.

`serve.app.create_app` takes any object with these members. The one front that has them is
`jaxserve.async_engine.AsyncEngine`, over one engine core or data parallelism's replicas (each
stepping in its own thread, each request to the least busy), a multi-host job's too (behind its
executor); it satisfies the protocol structurally (tests/test_engine_client.py checks every member). Every member is
required: a front with nothing to add answers with the defined empty result (`health()` -> {}),
so the server never probes for one. No jax here.
"""
from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator, Callable, Protocol

from jaxserve.core.outputs import EngineStats, RequestOutput, StepRecord
from jaxserve.core.request import SamplingParams
from jaxserve.pooling.config import PoolerConfig


@dataclasses.dataclass(frozen=True)
class PoolingService:
    """What a pooling engine (--runner=pooling) serves: how its model pools, and the bounds of a
    pooling request's inputs (token ids below vocab_size, dimensions at most hidden_size)."""
    pooler: PoolerConfig
    hidden_size: int
    vocab_size: int
    max_inputs_per_request: int


@dataclasses.dataclass(frozen=True)
class ImageService:
    """What a vision-language engine needs with a prompt's images: the `processor` that turns each
    image into pixel arrays and a token count (jaxserve.multimodal.image_processing), and the
    `model_config` (jaxserve.config.ModelConfig: the image token id, M-RoPE's fields) that
    `jaxserve.multimodal.inputs.prompt_images` reads to place them in the prompt."""
    processor: Any
    model_config: Any

    @classmethod
    def of(cls, engine: Any) -> ImageService | None:
        """The service of an Engine (or data parallelism's replicas), or None for a text model."""
        return None if engine.image_processor is None else cls(engine.image_processor, engine.model_config)


class DeltaStream(Protocol):
    """The deltas of one admitted request, ending after its finished delta."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """The stream itself."""

    async def __anext__(self) -> RequestOutput:
        """The request's next delta; StopAsyncIteration after the finished one."""

    async def aclose(self) -> None:
        """Ends the stream; before the finished delta this aborts the request (its pages return).
        Calling it again, or after the end, does nothing."""


class EngineClient(Protocol):
    """The engine behind the OpenAI server (serve/app.py), as the event loop sees it."""

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (encode, decode, chat template, special tokens); the
        server tokenizes prompts with it in its own threads."""

    @property
    def model_name(self) -> str:
        """The served model's id, when the server is given no names of its own."""

    @property
    def max_model_len(self) -> int:
        """The context a request can really use: prompt plus output tokens."""

    @property
    def pooling(self) -> PoolingService | None:
        """What the engine pools (--runner=pooling: the server's embedding, score, rerank and classify
        routes), or None for a generating engine (the completion routes). A pooling engine's requests
        are `generate` calls with `jaxserve.core.request.pooling_params()`; each one's finished delta
        carries its pooled vector (RequestOutput.pooled)."""

    @property
    def image_service(self) -> ImageService | None:
        """What a vision-language model takes with image input (its image processor and config),
        or None when the engine takes no images (a text model): the server refuses a request
        with images then, before loading any."""

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine serves LoRA adapters (--enable_lora)."""

    def lora_modules(self) -> list:
        """The LoRA adapters served (jaxserve.core.lora_registry.LoRAModule: name, path, base
        model); [] without LoRA. A request picks one by naming it as its model."""

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Serves the PEFT adapter in folder `path` as `name` from the next request on; a
        ValueError (checkpoints.lora_adapter.LoRAError for the adapter itself) when it cannot be,
        and then nothing changes."""

    async def unload_lora_adapter(self, name: str) -> None:
        """Stops serving adapter `name` (its running requests finish with it); LoRANotFoundError
        (jaxserve.core.lora_registry) when no adapter has that name."""

    async def start(self) -> None:
        """Starts stepping (on the running event loop's behalf); requests are admitted after it."""

    async def shutdown(self) -> None:
        """Stops stepping: requests still running end with an error delta."""

    def is_alive(self) -> bool:
        """Whether the engine steps: False before `start`, after `shutdown`, or once it failed for
        good (a multi-host job that lost a process). /health answers 503 on False."""

    def health(self) -> dict[str, Any]:
        """What /health reports beyond liveness (JSON values: failed steps, the last one's error,
        a multi-host failure); {} when there is nothing to add."""

    def stats(self) -> EngineStats:
        """The engine's counters now (requests, pages, prefix cache): cheap, from any thread."""

    def add_step_listener(self, listener: Callable[[StepRecord], None]) -> None:
        """Calls `listener(record)` after every engine step that ran, on the engine's thread, the
        record priced against the roofline (its estimated bytes, FLOPs and utilization)."""

    def compile_structured_output(self, params: SamplingParams) -> None:
        """Compiles the params' structured-output grammar (InvalidRequestError if it cannot be
        used). Thread-safe: the server calls it from its prepare threads, so admission finds it
        compiled."""

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 multimodal: Any = None) -> DeltaStream:
        """Admits one request and returns the stream of its deltas. `multimodal`: the prompt's
        images (jaxserve.multimodal.inputs.MultimodalInputs, their tokens already in
        `prompt_token_ids`), or None. Admission happens here,
        synchronously: InvalidRequestError (a ValueError: the engine's admission check), another
        ValueError (a duplicate id), QueueFullError or EngineUnavailableError (not running, or a
        failed multi-host job) mean the engine never saw the request."""

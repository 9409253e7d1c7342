"""A prompt's pooled result from its chunks' partials, and an embedding's final form (host side, numpy).

The device pools each prefill chunk on its own (`jaxserve.pooling.poolers.chunk_partials`, or a
classifier's activated scores of each chunk's last row); a `PooledPrompt` per request takes them
in order, chunk by chunk, and once the prompt's last chunk is in gives the prompt's pooled vector:
the last chunk's (LAST, a classifier's scores), the first chunk's (CLS), or the sum of every
chunk's sums over the prompt's length (MEAN); a pooling engine keeps one per request in flight
(`PooledRequests`). `finish_embedding` then keeps a request's first
`dimensions` values (matryoshka) and normalizes, as the model's pooler config asks.
No jax here: the vectors are one per request, finished where the outputs are.
"""
from __future__ import annotations

import numpy as np

from jaxserve.pooling.config import PoolerConfig


class PooledPrompt:
    """The chunks of one prompt of `prompt_len` tokens, pooled as `pooling_type` (LAST, MEAN, CLS)."""

    def __init__(self, pooling_type: str, prompt_len: int):
        if pooling_type not in ("LAST", "MEAN", "CLS"):
            raise ValueError(f"unknown pooling type {pooling_type!r}")
        if prompt_len < 1:
            raise ValueError(f"a prompt to pool needs a token, got prompt_len {prompt_len}")
        self.pooling_type = pooling_type
        self.prompt_len = prompt_len
        self.tokens_seen = 0
        self._value: np.ndarray | None = None  # [D] float32: the running sum, or the kept row

    def add(self, partial: np.ndarray, start: int, num_tokens: int) -> None:
        """One chunk's partial [D] (its tokens `start` .. `start + num_tokens - 1` of the prompt)."""
        if start != self.tokens_seen or num_tokens < 1 or start + num_tokens > self.prompt_len:
            raise ValueError(f"chunk at {start} of {num_tokens} tokens: expected the next chunk at "
                             f"{self.tokens_seen} of a {self.prompt_len}-token prompt")
        partial = np.asarray(partial, np.float32)
        if self.pooling_type == "MEAN":
            self._value = partial.copy() if self._value is None else self._value + partial
        elif self.pooling_type == "LAST" or start == 0:
            self._value = partial.copy()
        self.tokens_seen += num_tokens

    def skip_cached(self, num_tokens: int) -> None:
        """The prompt's first `num_tokens` came from the prefix cache: their rows are never computed,
        which only LAST pooling (the last row alone) allows."""
        if self.pooling_type != "LAST" or self.tokens_seen or not 0 <= num_tokens < self.prompt_len:
            raise ValueError(f"{self.pooling_type} pooling of a {self.prompt_len}-token prompt cannot skip "
                             f"{num_tokens} cached tokens after {self.tokens_seen}")
        self.tokens_seen = num_tokens

    @property
    def done(self) -> bool:
        return self.tokens_seen == self.prompt_len

    def pooled(self) -> np.ndarray:
        """The prompt's pooled vector [D] float32, once every chunk is in."""
        if not self.done:
            raise ValueError(f"pooled after {self.tokens_seen} of {self.prompt_len} tokens")
        return self._value / self.prompt_len if self.pooling_type == "MEAN" else self._value


class PooledRequests:
    """A pooling engine's prompts in flight, by request id, each a PooledPrompt fed every step.

    A chunk that does not continue its prompt's last one starts the prompt over (the request was
    preempted and is recomputed from its first token, or from its cached prefix: LAST only)."""

    def __init__(self, pooling_type: str):
        self.pooling_type = pooling_type
        self._prompts: dict[str, PooledPrompt] = {}

    def add(self, request_id: str, prompt_len: int, start: int, num_tokens: int, partial: np.ndarray) -> None:
        """One chunk of a request's prompt (its tokens start .. start + num_tokens - 1) and its partial."""
        pooled = self._prompts.get(request_id)
        if pooled is None or pooled.tokens_seen != start:
            pooled = self._prompts[request_id] = PooledPrompt(self.pooling_type, prompt_len)
            if start:
                pooled.skip_cached(start)
        pooled.add(partial, start, num_tokens)

    def pop(self, request_id: str) -> np.ndarray | None:
        """The request's pooled vector once its whole prompt is in (None before); forgets the request."""
        pooled = self._prompts.pop(request_id, None)
        return pooled.pooled() if pooled is not None and pooled.done else None


def finish_embedding(pooled: np.ndarray, normalize: bool, dimensions: int | None = None) -> np.ndarray:
    """A pooled vector [D] -> the embedding [dimensions or D] float32: the first `dimensions`
    values (matryoshka), L2-normalized when `normalize` (so truncation renormalizes)."""
    vector = np.asarray(pooled, np.float32)
    if dimensions is not None:
        if not 0 < dimensions <= vector.shape[-1]:
            raise ValueError(f"dimensions {dimensions} not in [1, {vector.shape[-1]}]")
        vector = vector[..., :dimensions]
    if normalize:
        norm = np.linalg.norm(vector, axis=-1, keepdims=True)
        vector = vector / np.maximum(norm, 1e-12)  # torch.nn.functional.normalize's epsilon
    return vector.astype(np.float32)


def cosine_scores(queries: np.ndarray, documents: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of [N, D] and [N, D] embeddings -> [N] float32 (an embedding
    model's /score and /rerank)."""
    q = np.asarray(queries, np.float64)
    d = np.asarray(documents, np.float64)
    norms = np.maximum(np.linalg.norm(q, axis=-1) * np.linalg.norm(d, axis=-1), 1e-12)
    return (np.sum(q * d, axis=-1) / norms).astype(np.float32)


def engine_pooling(cfg, pooler: PoolerConfig | None) -> tuple:
    """(pooler, PooledRequests, prefix caching) of an engine of EngineConfig `cfg`: with
    --runner=pooling its pooler (default: last token, normalized) and the prompts it pools chunk by
    chunk, where only LAST pooling may take cached prefix pages (the others pool every token's
    row); else (None, None, as set)."""
    if cfg.runner != "pooling":
        return None, None, cfg.enable_prefix_caching
    pooler = pooler or PoolerConfig("LAST", True)
    return (pooler, PooledRequests(pooler.pooling_type),
            cfg.enable_prefix_caching and pooler.pooling_type == "LAST")

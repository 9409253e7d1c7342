"""The encoder cache: which rows of the device's image-embedding pool hold which image, and how a
prefill chunk is fitted around its images (host side, no jax).

The runner keeps one pool of image embeddings on the device, [num_rows, hidden] (row 0 is the
null row that text tokens point at); the vision encoder writes an image's embeddings into the
rows this cache gives it, and the step reads each image token's row (jaxserve.models.llama's
`image_embeddings`). Entries are keyed by the image's content hash, so a repeated image, a later
chunk or a recomputed (preempted) request finds its embeddings without encoding again; the least
recently used entries not needed by the step being planned make room for new ones.

`fit_chunk` applies the rules a chunk of a prompt with images follows:
- a chunk never ends inside an image's span (the span's tokens are computed in one step: Gemma 3's
  image tokens attend to each other both ways, and the encoder's output is needed only then), so a
  chunk that would is cut before the span; a chunk that starts inside a span (after a prefix-cache
  hit) must reach its end;
- every image the chunk covers has rows: cached, or reserved now and encoded by this step, within
  the step's encoder budget (tokens of images encoded per step).
"""
from __future__ import annotations

import collections
import dataclasses
from jaxserve.config import EngineConfig
from jaxserve.core.step import EncodeJob

NULL_ROW = 0


def max_image_tokens(config: EngineConfig) -> int:
    """The most tokens one image may take: a chunk holds a whole image, beside at most
    max_num_seqs - 1 decode rows (past long_prefill_token_threshold if it must: the scheduler
    lets an image a chunk starts in take the step's budget left)."""
    return config.max_num_batched_tokens - config.max_num_seqs + 1


def pool_rows(config: EngineConfig) -> int:
    """Rows of the image-embedding pool: the null row, room for the images of a step whose chunk
    starts inside one image and covers max_num_batched_tokens more, and as many again for reuse."""
    return 2 * config.max_num_batched_tokens + 1


class EncoderCache:
    """Rows 1 .. num_rows - 1 of the image-embedding pool, by image content hash."""

    def __init__(self, num_rows: int) -> None:
        if num_rows < 2:
            raise ValueError(f"the image-embedding pool needs at least 2 rows, got {num_rows}")
        self.num_rows = num_rows
        self._free: list[int] = list(range(num_rows - 1, 0, -1))
        self._entries: collections.OrderedDict[bytes, tuple[int, ...]] = collections.OrderedDict()  # LRU first
        self._pinned: set[bytes] = set()  # needed by the step being planned: never evicted for it
        self.num_hits = 0  # images found encoded
        self.num_encoded = 0  # images given rows to be encoded

    @property
    def num_free_rows(self) -> int:
        return len(self._free)

    def __contains__(self, content_hash: bytes) -> bool:
        return content_hash in self._entries

    def lookup(self, content_hash: bytes) -> tuple[int, ...] | None:
        """The rows of an encoded image (now the most recently used), or None."""
        rows = self._entries.get(content_hash)
        if rows is not None:
            self._entries.move_to_end(content_hash)
        return rows

    def reserve(self, content_hash: bytes, num_tokens: int) -> tuple[int, ...] | None:
        """Rows for a new image of `num_tokens` tokens, evicting the least recently used entries
        not pinned; None (nothing evicted) when they cannot be found."""
        evictable = sum(len(rows) for h, rows in self._entries.items() if h not in self._pinned)
        if len(self._free) + evictable < num_tokens:
            return None
        for victim in [h for h in self._entries if h not in self._pinned]:
            if len(self._free) >= num_tokens:
                break
            self._free.extend(self._entries.pop(victim))
        rows = tuple(self._free.pop() for _ in range(num_tokens))
        self._entries[content_hash] = rows
        self.num_encoded += 1
        return rows

    def pin(self, content_hash: bytes) -> None:
        self._pinned.add(content_hash)

    def unpin_all(self) -> None:
        """After a step is planned: every entry may be evicted again."""
        self._pinned.clear()

    def forget(self, hashes) -> None:
        """Drops the entries of `hashes` (reserved for a step that does not run: never encoded)."""
        for content_hash in hashes:
            self._free.extend(self._entries.pop(content_hash, ()))
            self._pinned.discard(content_hash)

    def clear(self) -> None:
        """Forgets every entry (after a failed step: its images may not be encoded, or the pool lost)."""
        self._free = list(range(self.num_rows - 1, 0, -1))
        self._entries.clear()
        self._pinned.clear()


@dataclasses.dataclass
class StepImages:
    """The images of the step being planned: the rows of every image its chunks cover, the
    encoder's jobs, and its encoder budget left (tokens)."""
    budget: int
    rows: dict[bytes, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    encode: list[EncodeJob] = dataclasses.field(default_factory=list)


def fit_chunk(multimodal, start: int, num_new: int, cache: EncoderCache, step: StepImages) -> int:
    """The longest chunk of at most `num_new` tokens from position `start` of a request with images
    (`multimodal`: its MultimodalInputs) that follows the module's rules; the images it covers get
    rows (recorded in `step`, pinned in `cache`; new ones as encoder jobs). 0: none fits now."""
    end = start + num_new
    for image in multimodal.images:
        if image.end <= start:
            continue
        if image.offset >= end:
            break
        if end < image.end:  # the chunk would end inside this span: end before it
            return max(image.offset - start, 0)
        rows = step.rows.get(image.content_hash) or cache.lookup(image.content_hash)
        if rows is not None:
            if image.content_hash not in step.rows:
                cache.num_hits += 1
        else:
            if image.num_tokens > step.budget:
                return max(image.offset - start, 0)
            rows = cache.reserve(image.content_hash, image.num_tokens)
            if rows is None:
                return max(image.offset - start, 0)
            step.encode.append(EncodeJob(image, rows))
            step.budget -= image.num_tokens
        cache.pin(image.content_hash)
        step.rows[image.content_hash] = rows
    return num_new


def chunk_image_rows(multimodal, start: int, stop: int, rows: dict[bytes, tuple[int, ...]]) -> tuple[int, ...] | None:
    """Each position's pool row for positions start .. stop - 1 (NULL_ROW for a text token), or
    None when none of them is an image's."""
    out = None
    for image in multimodal.images:
        lo, hi = max(image.offset, start), min(image.end, stop)
        if lo >= hi:
            continue
        out = out or [NULL_ROW] * (stop - start)
        out[lo - start:hi - start] = rows[image.content_hash][lo - image.offset:hi - image.offset]
    return None if out is None else tuple(out)


def chunk_key_limits(multimodal, start: int, stop: int) -> tuple[int, ...] | None:
    """Bidirectional image spans (Gemma 3): the highest key position each position start ..
    stop - 1 may see (its span's last position inside an image, else itself); None when no
    position of the chunk is an image's."""
    out = None
    for image in multimodal.images:
        lo, hi = max(image.offset, start), min(image.end, stop)
        if lo >= hi:
            continue
        out = out or list(range(start, stop))
        out[lo - start:hi - start] = [image.end - 1] * (hi - lo)
    return None if out is None else tuple(out)

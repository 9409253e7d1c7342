"""Host-side allocator of KV-cache pages with refcounts and automatic prefix caching.

Page 0 is the null page: padding slots point at it and it is never handed out. A full page whose
K/V are computed can be registered under a hash of its whole token prefix (a chain: the hash of
page i covers the hash of page i-1 and the tokens of page i), so requests sharing a prefix share
the pages by refcount. A registered page whose refcount drops to 0 stays cached (evictable, LRU)
until an allocation needs it. With KV offload (`kv_offload.OffloadTiers`) an evicted page's bytes
are kept in host memory under the same hash, and a prefix that continues there is restored into
fresh pages (`find_prefix`, `acquire_offloaded`) instead of being computed again.
"""
from __future__ import annotations

import array
import collections
import hashlib
import itertools
from typing import TYPE_CHECKING, Iterator, Sequence

if TYPE_CHECKING:
    from jaxserve.core.kv_offload import OffloadTiers
    from jaxserve.core.request import Request

NULL_PAGE = 0


def hash_page_tokens(parent_hash: bytes, page_token_ids: Sequence[int]) -> bytes:
    """Hash of one full page given the hash of the page before it (b"" for the first page)."""
    digest = hashlib.blake2b(parent_hash, digest_size=16)
    digest.update(array.array("q", page_token_ids).tobytes())
    return digest.digest()


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 offload: OffloadTiers | None = None) -> None:
        """A pool of `num_pages` pages (the null page included) of `page_size` tokens; `offload`:
        the tiers evicted prefix pages go to (needs prefix caching)."""
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        if offload is not None and not enable_prefix_caching:
            raise ValueError("KV offload keeps evicted prefix-cache pages: it needs prefix caching")
        self.offload = offload
        self._refcounts = [0] * num_pages
        # Popped from the end: pages come out as 1, 2, 3, ... on a fresh allocator.
        self._free_pages: list[int] = list(range(num_pages - 1, NULL_PAGE, -1))
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._hash_to_page: dict[bytes, int] = {}
        self._page_to_hash: dict[int, bytes] = {}
        self.num_prefix_queries_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_evictions = 0

    # ---- counts -------------------------------------------------------------------------------
    @property
    def num_usable_pages(self) -> int:
        """Pages requests can hold: the pool (`num_pages`, as everywhere) less the null page."""
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can get: never used, plus cached pages nobody holds."""
        return len(self._free_pages) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        return self.num_usable_pages - self.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        """Registered prefix pages, held or evictable."""
        return len(self._page_to_hash)

    @property
    def usage(self) -> float:
        return self.num_used_pages / self.num_usable_pages

    def num_pages_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def refcount(self, page_id: int) -> int:
        return self._refcounts[page_id]

    # ---- allocate / free ----------------------------------------------------------------------
    def can_allocate(self, num_new_pages: int) -> bool:
        return num_new_pages <= self.num_free_pages

    def allocate(self, num_new_pages: int) -> list[int]:
        """Returns `num_new_pages` fresh pages with refcount 1; evicts LRU cached pages if needed."""
        if not self.can_allocate(num_new_pages):
            raise RuntimeError(f"cannot allocate {num_new_pages} pages: only {self.num_free_pages} free")
        pages = []
        for _ in range(num_new_pages):
            if self._free_pages:
                page = self._free_pages.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                page_hash = self._page_to_hash.pop(page)
                del self._hash_to_page[page_hash]
                self.num_evictions += 1
                if self.offload is not None:
                    self.offload.offer(page, page_hash)
            self._refcounts[page] = 1
            pages.append(page)
        return pages

    def free(self, page_ids: Sequence[int]) -> None:
        """Drops one reference to each page, last page first (so a chain's tail is evicted first)."""
        for page in reversed(page_ids):
            if page == NULL_PAGE or not 0 < page < self.num_pages or self._refcounts[page] <= 0:
                raise ValueError(f"page {page} is not allocated")
            self._refcounts[page] -= 1
            if self._refcounts[page] == 0:
                if page in self._page_to_hash:
                    self._evictable[page] = None
                else:
                    self._free_pages.append(page)

    def free_request(self, request: Request) -> None:
        """Returns all pages of `request` and clears its page bookkeeping."""
        self.free(request.page_ids)
        request.page_ids = []
        request.page_hashes = []

    # ---- prefix caching -----------------------------------------------------------------------
    def _chain(self, token_ids: Sequence[int], salt: bytes) -> Iterator[bytes]:
        """The hashes of the full pages of `token_ids`, first page first, rooted at `salt`."""
        parent, ps = salt, self.page_size
        for start in range(0, len(token_ids) - ps + 1, ps):
            parent = hash_page_tokens(parent, token_ids[start:start + ps])
            yield parent

    def find_cached_prefix(self, token_ids: Sequence[int], salt: bytes = b"") -> list[int]:
        """The longest chain of cached full pages covering a prefix of `token_ids`; no side effects.
        `salt` roots the chain (a request's `prefix_salt`: its LoRA adapter's pages are its own)."""
        return self.find_prefix(token_ids, salt)[0]

    def find_prefix(self, token_ids: Sequence[int], salt: bytes = b"") -> tuple[list[int], list[bytes]]:
        """The device pages of `token_ids`' longest cached prefix (as find_cached_prefix), and the
        hashes of the full pages after them that the offload tiers hold (to `acquire_offloaded`);
        no side effects."""
        if not self.enable_prefix_caching:
            return [], []
        pages: list[int] = []
        hashes = self._chain(token_ids, salt)
        rest: list[bytes] = []
        for page_hash in hashes:
            page = self._hash_to_page.get(page_hash)
            if page is None:
                rest.append(page_hash)
                break
            pages.append(page)
        if self.offload is None or not rest:
            return pages, []
        return pages, self.offload.find(itertools.chain(rest, hashes))

    def num_free_pages_after_acquiring(self, cached_pages: Sequence[int]) -> int:
        """`num_free_pages` once `cached_pages` (from find_cached_prefix) are held."""
        return self.num_free_pages - sum(1 for page in cached_pages if self._refcounts[page] == 0)

    def match_prefix(self, token_ids: Sequence[int], salt: bytes = b"") -> list[int]:
        """Acquires (refcount + 1) the longest chain of cached full pages of `token_ids` (under `salt`)."""
        if not self.enable_prefix_caching:
            return []
        pages = self.find_cached_prefix(token_ids, salt)
        for page in pages:
            if self._refcounts[page] == 0:
                del self._evictable[page]
            self._refcounts[page] += 1
        self.num_prefix_queries_tokens += len(token_ids)
        self.num_prefix_hit_tokens += len(pages) * self.page_size
        if self.offload is not None:
            self.offload.counters.queried_pages += len(token_ids) // self.page_size - len(pages)
        return pages

    def acquire_offloaded(self, page_hashes: Sequence[bytes]) -> list[int]:
        """Fresh pages (refcount 1) for the offloaded pages of `page_hashes` (find_prefix's, right
        after the pages match_prefix acquired), registered under them and filled from the tiers
        before the step (the offload's transfers). Their sources are pinned first, so that the
        evictions this allocation causes cannot take them."""
        if not page_hashes:
            return []
        sources = self.offload.pin(page_hashes)
        pages = self.allocate(len(page_hashes))
        for page, page_hash in zip(pages, page_hashes):
            self._hash_to_page[page_hash] = page
            self._page_to_hash[page] = page_hash
        self.offload.restore(sources, pages)
        return pages

    def register_full_pages(self, request: Request) -> None:
        """Registers the request's full pages whose tokens are all computed.

        A page whose prefix is already cached under another page stays unregistered (it is freed
        normally); the request keeps its own copy.
        """
        if not self.enable_prefix_caching:
            return
        ps = self.page_size
        num_full = min(request.num_computed_tokens // ps, len(request.page_ids))
        start = len(request.page_hashes)
        if num_full <= start:
            return
        token_ids = request.prefix_key_ids(num_full * ps)  # an image's positions: its hash
        parent = request.page_hashes[-1] if start else request.prefix_salt
        for i in range(start, num_full):
            page = request.page_ids[i]
            page_hash = self._page_to_hash.get(page)
            if page_hash is None:
                page_hash = hash_page_tokens(parent, token_ids[i * ps:(i + 1) * ps])
                if page_hash not in self._hash_to_page:
                    self._hash_to_page[page_hash] = page
                    self._page_to_hash[page] = page_hash
            request.page_hashes.append(page_hash)
            parent = page_hash

    def reset_prefix_cache(self) -> None:
        """Forgets every cached page nobody holds (they become plain free pages)."""
        for page in self._evictable:
            del self._hash_to_page[self._page_to_hash.pop(page)]
            self._free_pages.append(page)
        self._evictable.clear()

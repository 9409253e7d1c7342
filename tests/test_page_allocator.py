import pytest

from jaxserve.core.page_allocator import NULL_PAGE, PageAllocator, hash_page_tokens
from jaxserve.core.request import Request


def computed_request(allocator, request_id, token_ids):
    """A request holding freshly allocated pages for all its tokens, all computed and registered."""
    request = Request(request_id, token_ids)
    request.page_ids = allocator.match_prefix(token_ids)
    request.page_ids += allocator.allocate(allocator.num_pages_for_tokens(len(token_ids)) - len(request.page_ids))
    request.num_computed_tokens = len(token_ids)
    allocator.register_full_pages(request)
    return request


def test_free_list_and_null_page():
    allocator = PageAllocator(num_pages=5, page_size=4, enable_prefix_caching=False)
    assert (allocator.num_usable_pages, allocator.num_free_pages, allocator.num_used_pages) == (4, 4, 0)
    pages = allocator.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4] and NULL_PAGE not in pages
    assert allocator.num_free_pages == 0 and allocator.num_used_pages == 4 and allocator.usage == 1.0
    assert not allocator.can_allocate(1) and allocator.can_allocate(0)
    with pytest.raises(RuntimeError, match="cannot allocate 1 pages"):
        allocator.allocate(1)
    allocator.free(pages)
    assert allocator.num_free_pages == 4 and allocator.num_used_pages == 0
    assert all(allocator.refcount(p) == 0 for p in range(5))


def test_free_errors():
    allocator = PageAllocator(num_pages=3, page_size=2, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="page 0 is not allocated"):
        allocator.free([NULL_PAGE])
    (page,) = allocator.allocate(1)
    allocator.free([page])
    with pytest.raises(ValueError, match=f"page {page} is not allocated"):
        allocator.free([page])
    with pytest.raises(ValueError, match="num_pages must be >= 2"):
        PageAllocator(num_pages=1, page_size=2)


def test_pages_for_tokens():
    allocator = PageAllocator(num_pages=3, page_size=4)
    assert [allocator.num_pages_for_tokens(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_hash_chain_depends_on_whole_prefix():
    first = hash_page_tokens(b"", [1, 2])
    assert hash_page_tokens(first, [3, 4]) != hash_page_tokens(hash_page_tokens(b"", [9, 9]), [3, 4])
    assert hash_page_tokens(first, [3, 4]) == hash_page_tokens(hash_page_tokens(b"", [1, 2]), [3, 4])


def test_prefix_pages_shared_by_refcount():
    allocator = PageAllocator(num_pages=10, page_size=4, enable_prefix_caching=True)
    system = list(range(100, 108))  # two full pages
    a = computed_request(allocator, "a", system + [1, 2, 3])
    assert allocator.num_cached_pages == 2  # the partial third page is not registered
    b = computed_request(allocator, "b", system + [4, 5, 6, 7, 8])
    assert b.page_ids[:2] == a.page_ids[:2] and b.page_ids[2] != a.page_ids[2]
    assert [allocator.refcount(p) for p in a.page_ids] == [2, 2, 1]
    assert allocator.num_prefix_hit_tokens == 8 and allocator.num_prefix_queries_tokens == 11 + 13
    assert allocator.num_used_pages == 5
    # The same page tokens after a different prefix do not match.
    assert allocator.find_cached_prefix([0, 0, 0, 0] + system[4:]) == []
    assert allocator.find_cached_prefix(system[:4] + [0, 0, 0, 0]) == a.page_ids[:1]
    shared_pages = a.page_ids[:2]
    allocator.free_request(a)
    allocator.free_request(b)
    assert b.page_ids == [] and b.page_hashes == []
    assert allocator.num_used_pages == 0 and allocator.num_free_pages == 9
    # Cached pages survive their owners and are found again.
    assert allocator.find_cached_prefix(system + [1]) == shared_pages
    assert len(allocator.find_cached_prefix(system + [4, 5, 6, 7])) == 3


def test_duplicate_page_is_not_registered_twice():
    allocator = PageAllocator(num_pages=6, page_size=2, enable_prefix_caching=True)
    a, b = Request("a", [1, 2, 3]), Request("b", [1, 2, 3])
    for request in (a, b):  # both admitted before either computed anything
        request.page_ids = allocator.allocate(2)
    for request in (a, b):
        request.num_computed_tokens = 3
        allocator.register_full_pages(request)
    assert allocator.num_cached_pages == 1
    assert allocator.find_cached_prefix([1, 2]) == [a.page_ids[0]]
    allocator.free_request(b)  # b's copy is a plain page again
    assert allocator.num_free_pages == 3 and allocator.num_cached_pages == 1


def test_lru_eviction_when_allocation_needs_pages():
    allocator = PageAllocator(num_pages=7, page_size=2, enable_prefix_caching=True)
    old = computed_request(allocator, "old", [1, 2, 3, 4])
    new = computed_request(allocator, "new", [5, 6, 7, 8])
    allocator.free_request(old)
    allocator.free_request(new)
    assert allocator.num_free_pages == 6 and allocator.num_cached_pages == 4
    # A hit refreshes the pages of "old": "new" becomes least recently used.
    again = computed_request(allocator, "again", [1, 2, 3, 4])
    allocator.free_request(again)
    pages = allocator.allocate(3)  # 2 never-used pages, then one eviction
    assert allocator.num_evictions == 1 and allocator.num_cached_pages == 3
    # The tail of the least recently used chain goes first; the head stays usable.
    assert len(allocator.find_cached_prefix([5, 6, 7, 8])) == 1
    assert len(allocator.find_cached_prefix([1, 2, 3, 4])) == 2
    allocator.free(pages)
    allocator.allocate(6)
    assert allocator.num_cached_pages == 0 and allocator.find_cached_prefix([1, 2, 3, 4]) == []


def test_held_cached_pages_are_not_evictable():
    allocator = PageAllocator(num_pages=4, page_size=2, enable_prefix_caching=True)
    held = computed_request(allocator, "held", [1, 2, 3, 4])
    assert allocator.num_free_pages == 1 and allocator.num_free_pages_after_acquiring(held.page_ids) == 1
    allocator.free_request(held)
    cached = allocator.find_cached_prefix([1, 2, 3, 4, 5])
    assert allocator.num_free_pages == 3 and allocator.num_free_pages_after_acquiring(cached) == 1
    assert allocator.match_prefix([1, 2, 3, 4, 5]) == cached
    assert allocator.allocate(1) not in cached and not allocator.can_allocate(1)


def test_prefix_caching_disabled():
    allocator = PageAllocator(num_pages=6, page_size=2, enable_prefix_caching=False)
    request = computed_request(allocator, "a", [1, 2, 3, 4])
    assert allocator.num_cached_pages == 0 and allocator.match_prefix([1, 2, 3, 4]) == []
    assert allocator.num_prefix_queries_tokens == 0
    allocator.free_request(request)
    assert allocator.num_free_pages == 5


def test_reset_prefix_cache():
    allocator = PageAllocator(num_pages=6, page_size=2, enable_prefix_caching=True)
    allocator.free_request(computed_request(allocator, "a", [1, 2, 3, 4]))
    held = computed_request(allocator, "b", [7, 8, 9])
    allocator.reset_prefix_cache()
    assert allocator.find_cached_prefix([1, 2]) == [] and allocator.find_cached_prefix([7, 8]) == held.page_ids[:1]
    assert allocator.num_free_pages == 3

"""KV offload's bookkeeping, host only (no jax): the tiers' blocks, pins and pending saves, and a
scheduler whose evicted prefix pages go to host (and disk) blocks and come back, checked by a
fake device that carries out every copy the way the runner's HostKVStore orders them."""
import random

import pytest

from jaxserve.core.kv_offload import DISK, HOST, KVTransfers, OffloadTiers
from jaxserve.core.page_allocator import PageAllocator
from jaxserve.core.request import Request, RequestStatus

from tests.test_page_allocator import computed_request
from tests.test_scheduler import FakeDevice, check_plan, greedy, make_scheduler, reference_output


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_a_saved_block_is_found_only_once_its_bytes_landed():
    tiers = OffloadTiers(num_host_blocks=2)
    tiers.offer(page=5, block_hash=h(1))
    assert tiers.find([h(1)]) == []  # pending: its bytes are still on the device
    transfers = tiers.take_transfers()
    assert transfers.saves == [(5, 0)] and not transfers.restores
    tiers.offer(page=6, block_hash=h(1))  # the same bytes are on their way: no second save
    assert not tiers.take_transfers()
    tiers.saves_landed(transfers)
    assert tiers.find([h(1), h(2)]) == [h(1)]
    assert tiers.counters.saved_pages == 1


def test_a_full_host_tier_of_pending_or_pinned_blocks_drops_the_page_and_hands_out_none():
    tiers = OffloadTiers(num_host_blocks=2)
    tiers.offer(1, h(1))
    tiers.offer(2, h(2))
    first = tiers.take_transfers()
    tiers.offer(3, h(3))  # both blocks pending
    assert not tiers.take_transfers() and tiers.counters.dropped_pages == 1
    tiers.saves_landed(first)
    sources = tiers.pin([h(1), h(2)])  # a restore reads both
    assert sources == [(HOST, 0), (HOST, 1)]
    tiers.offer(4, h(4))
    assert not tiers.take_transfers() and tiers.counters.dropped_pages == 2
    tiers.restore(sources, [7, 8])
    tiers.transfers_done(tiers.take_transfers())  # pins released
    tiers.offer(4, h(4))  # now the least recently used block (h(1)'s) is reused
    assert tiers.take_transfers().saves == [(4, 0)]
    assert tiers.find([h(1)]) == [] and tiers.find([h(2)]) == [h(2)]


def test_the_host_tier_spills_its_least_recently_used_block_to_disk_and_restores_from_there():
    tiers = OffloadTiers(num_host_blocks=1, num_disk_slots=2)
    tiers.offer(1, h(1))
    tiers.saves_landed(tiers.take_transfers())
    tiers.offer(2, h(2))  # block 0 is reused: h(1)'s bytes go to disk first
    transfers = tiers.take_transfers()
    assert transfers.spills == [(0, 0)] and transfers.saves == [(2, 0)]
    assert tiers.find([h(1)]) == []  # the spill has not run yet
    tiers.transfers_done(transfers)
    tiers.saves_landed(transfers)
    assert tiers.find([h(1), h(2)]) == [h(1), h(2)]
    sources = tiers.pin([h(1), h(2)])
    assert sources == [(DISK, 0), (HOST, 0)]
    tiers.restore(sources, [9, 10])
    assert tiers.take_transfers().restores == [(DISK, 0, 9), (HOST, 0, 10)]
    assert (tiers.counters.disk_hit_pages, tiers.counters.host_hit_pages, tiers.counters.spilled_pages) == (1, 1, 1)


def test_failed_transfers_give_their_blocks_back_and_release_their_pins():
    tiers = OffloadTiers(num_host_blocks=2, num_disk_slots=1)
    tiers.offer(1, h(1))
    tiers.saves_landed(tiers.take_transfers())
    tiers.offer(2, h(2))
    tiers.restore(tiers.pin([h(1)]), [3])
    transfers = tiers.take_transfers()
    tiers.transfers_failed(transfers)
    assert tiers.host.num_used == 1 and tiers.host.num_pending == 0
    assert tiers.find([h(1)]) == [h(1)] and tiers.find([h(2)]) == []
    tiers.offer(3, h(3))
    tiers.offer(4, h(4))  # h(1) is not pinned any more: evicted (spilled) for h(4)
    assert tiers.take_transfers().spills == [(0, 0)]


def test_the_allocator_offers_what_it_evicts_and_restores_a_continued_prefix_into_fresh_pages():
    tiers = OffloadTiers(num_host_blocks=8)
    allocator = PageAllocator(num_pages=4, page_size=2, offload=tiers)
    tokens = [3, 4, 5, 6, 7, 8]
    allocator.free_request(computed_request(allocator, "a", tokens))  # 3 cached pages, evictable
    allocator.allocate(3)  # evicts all three
    transfers = tiers.take_transfers()
    assert sorted(page for page, _ in transfers.saves) == [1, 2, 3]
    tiers.saves_landed(transfers)
    pages, offloaded = allocator.find_prefix(tokens + [9])
    assert pages == [] and len(offloaded) == 3
    allocator.free([1, 2, 3])
    restored = allocator.acquire_offloaded(offloaded)
    assert allocator.find_cached_prefix(tokens) == restored  # registered: shared from now on
    assert [page for _, _, page in tiers.take_transfers().restores] == restored


class OffloadingDevice(FakeDevice):
    """The fake device with KV offload: runs a step's copies as kv_transfer.HostKVStore does
    (spills, then the saves' gather, then restores, then the step; the saves land after it)."""

    def __init__(self, allocator, tiers):
        super().__init__(allocator)
        self.tiers = tiers
        self.host = [None] * tiers.host.num_blocks
        self.disk = [None] * (tiers.disk.num_blocks if tiers.disk else 0)

    def page(self, page):
        return self.slots[page * self.page_size:(page + 1) * self.page_size]

    def run(self, plan):
        transfers = self.tiers.take_transfers()
        for block, slot in transfers.spills:
            self.disk[slot] = self.host[block]
        gathered = [self.page(page) for page, _ in transfers.saves]
        for tier, block, page in transfers.restores:
            source = (self.host if tier == HOST else self.disk)[block]
            assert source is not None
            self.slots[page * self.page_size:(page + 1) * self.page_size] = source
        self.tiers.transfers_done(transfers)
        sampled = super().run(plan)
        for (_, block), data in zip(transfers.saves, gathered):
            self.host[block] = data
        self.tiers.saves_landed(transfers)
        return sampled


@pytest.mark.parametrize("num_host_blocks, num_disk_slots", [(64, 0), (6, 0), (6, 40), (1, 3)])
def test_multi_turn_conversations_evicted_between_turns_get_the_same_tokens(num_host_blocks, num_disk_slots):
    seed = num_host_blocks * 100 + num_disk_slots
    rng = random.Random(seed)
    scheduler = make_scheduler(num_pages=20, page_size=4, max_num_seqs=4, budget=12, max_prefill=2)
    tiers = OffloadTiers(num_host_blocks, num_disk_slots)
    scheduler.allocator.offload = tiers
    device = OffloadingDevice(scheduler.allocator, tiers)
    histories = [[rng.randrange(3, 1000) for _ in range(rng.randint(10, 30))] for _ in range(6)]
    for turn in range(4):
        requests = []
        for i, history in enumerate(histories):
            requests.append(Request(f"c{i}t{turn}", history, greedy(rng.randint(1, 6))))
            scheduler.add_request(requests[-1])
        while scheduler.has_unfinished():
            decoding_before = [r for r in scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
            plan = scheduler.schedule()
            check_plan(scheduler, plan, decoding_before)
            scheduler.update(plan, device.run(plan))
        for i, request in enumerate(requests):
            assert request.output_token_ids == reference_output(request.prompt_token_ids, request.params.max_tokens), \
                f"seed {seed}"
            histories[i] = histories[i] + request.output_token_ids + [rng.randrange(3, 1000) for _ in range(5)]
    counters = tiers.counters
    assert scheduler.num_preemptions > 0, f"seed {seed}"  # preempted requests' pages are offloaded too
    assert scheduler.allocator.num_used_pages == 0
    assert tiers.host.num_pending == 0 and not tiers.host._pins
    if num_host_blocks >= 6:
        assert counters.host_hit_pages + counters.disk_hit_pages > 0, f"seed {seed}"
    if num_disk_slots >= 40:
        assert counters.disk_hit_pages > 0 and counters.spilled_pages > 0, f"seed {seed}"


def test_an_aborted_request_gives_back_its_restored_pages_and_the_host_blocks_stay_cached():
    scheduler = make_scheduler(num_pages=12, page_size=4, max_num_seqs=2, budget=4, max_prefill=1)
    tiers = OffloadTiers(16)
    scheduler.allocator.offload = tiers
    device = OffloadingDevice(scheduler.allocator, tiers)
    prompt = list(range(3, 27))  # 6 pages
    first = Request("first", prompt, greedy(1))
    scheduler.add_request(first)
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        scheduler.update(plan, device.run(plan))
    filler = Request("filler", list(range(100, 140)), greedy(1))  # evicts the first prompt's pages
    scheduler.add_request(filler)
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        scheduler.update(plan, device.run(plan))
    assert tiers.host.num_used >= 5
    again = Request("again", prompt + [50, 51, 52, 53, 54], greedy(4))
    scheduler.add_request(again)
    plan = scheduler.schedule()
    assert again.num_computed_tokens > 0  # restored pages count as computed
    scheduler.update(plan, device.run(plan))
    assert again.status == RequestStatus.RUNNING and tiers.counters.host_hit_pages > 0
    scheduler.abort("again")
    assert scheduler.allocator.num_used_pages == 0
    assert not tiers.host._pins and tiers.host.num_pending == 0
    # The restored pages stay in the device's prefix cache, and the blocks in the host tier.
    assert scheduler.allocator.find_cached_prefix(prompt)
    assert tiers.find([]) == [] and tiers.host.num_used >= 5


def test_failed_copies_return_everything():
    tiers = OffloadTiers(4)
    allocator = PageAllocator(num_pages=3, page_size=2, offload=tiers)
    allocator.free_request(computed_request(allocator, "a", [3, 4, 5, 6]))
    allocator.allocate(2)
    transfers = tiers.take_transfers()
    tiers.transfers_failed(transfers)
    assert tiers.host.num_used == 0 and allocator.find_prefix([3, 4, 5, 6, 7]) == ([], [])
    assert isinstance(transfers, KVTransfers) and len(transfers.saves) == 2


def test_the_tiers_are_exported_as_metrics_only_when_offload_is_on():
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from jaxserve.core.outputs import EngineStats
    from serve.metrics import ServerMetrics

    def samples(**offload):
        stats = EngineStats(num_running=0, num_waiting=0, kv_pages_used=0, kv_pages_total=10, num_preemptions=0,
                            prefix_cache_queried_tokens=0, prefix_cache_hit_tokens=0, **offload)
        text = generate_latest(ServerMetrics(lambda: stats, "m").registry).decode()
        return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    assert not any("offload" in name or "external" in name for name, _ in samples())
    got = samples(kv_offload_host_pages_used=3, kv_offload_host_pages_total=8, kv_offload_queried_tokens=64,
                  kv_offload_host_hit_tokens=32, kv_offload_disk_hit_tokens=16, kv_offload_bytes_to_host=100,
                  kv_offload_bytes_to_device=200, kv_offload_bytes_to_disk=0, kv_offload_dropped_pages=2)
    assert got[("jaxserve_external_prefix_cache_queries_total", ())] == 64
    assert got[("jaxserve_external_prefix_cache_hits_total", ())] == 48
    assert got[("jaxserve_kv_offload_hits_total", (("tier", "host"),))] == 32
    assert ("jaxserve_kv_offload_hits_total", (("tier", "disk"),)) not in got  # no disk tier
    assert got[("jaxserve_kv_offload_pages_used", (("tier", "host"),))] == 3
    assert got[("jaxserve_kv_offload_pages_capacity", (("tier", "host"),))] == 8
    assert got[("jaxserve_kv_offload_bytes_total", (("direction", "to_device"),))] == 200
    assert got[("jaxserve_kv_offload_dropped_pages_total", ())] == 2


class RecordingRunner:
    """What KVOffload.build asks of a runner, recorded: (host bytes, disk path, disk bytes)."""

    def __init__(self):
        self.asked = None

    def enable_kv_offload(self, host_bytes, disk_path, disk_bytes):
        self.asked = (host_bytes, disk_path, disk_bytes)
        return host_bytes // 4096, disk_bytes // 4096, 4096


def test_kv_offload_is_built_only_where_it_can_work():
    from jaxserve.config import EngineConfig
    from jaxserve.core.kv_offload import GIB, KVOffload

    runner = RecordingRunner()
    assert KVOffload.build(EngineConfig(), runner, True, False, GIB) is None and runner.asked is None
    cfg = EngineConfig(kv_offloading_size=0.5, kv_offloading_disk_path="/d", kv_offloading_disk_size=1.0)
    offload = KVOffload.build(cfg, runner, True, False, GIB)
    assert runner.asked == (GIB // 2, "/d", GIB)
    assert (offload.tiers.host.num_blocks, offload.tiers.disk.num_blocks, offload.page_bytes) == (GIB // 8192,
                                                                                                GIB // 4096, 4096)
    for args, message in [((cfg, runner, False, False, GIB), "caches no prefixes"),
                          ((cfg, runner, True, True, GIB), "multi-host"),
                          ((cfg, runner, True, False, GIB // 4), "more host memory than is available"),
                          ((EngineConfig(kv_offloading_size=0.5, data_parallel_size=3), runner, True, False, GIB),
                           "for each of 3 replicas")]:
        with pytest.raises(ValueError, match=message):
            KVOffload.build(*args)

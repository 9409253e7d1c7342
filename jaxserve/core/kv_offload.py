"""KV offload's bookkeeping: the host tier (and an optional disk tier) under the prefix cache. No jax.

A full page the device prefix cache evicts (`PageAllocator.allocate` reuses it) is offered here
under its block hash; it gets a host block, and the step that reuses the page first copies the
page's bytes out (a *save*). A request whose prefix continues past the device's cached pages
into blocks held here gets fresh device pages filled from them before its step (a *restore*)
instead of computing them again. When the host tier is full its least recently used block goes
to the disk tier if there is one (a *spill*), else it is dropped.

`OffloadTiers` only decides: which block or slot holds which hash, and what must be copied where,
as one `KVTransfers` per step. The runner's `HostKVStore` (jaxserve.executor.kv_transfer) holds
the bytes and carries the transfers out; `KVOffload`, the engine's, runs them around each step
and reports back when they are done:

- spills and restores run before the step (`transfers_done` then releases what they pinned);
- saves are gathered on the device before the step and land in host memory after it
  (`saves_landed`): until then their blocks are *pending*, never found, never handed out again.

A block being read (a restore's or a spill's source) is pinned: it is not evicted meanwhile.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Iterable

log = logging.getLogger(__name__)

HOST, DISK = "host", "disk"
GIB = 1 << 30


@dataclasses.dataclass
class KVTransfers:
    """The copies one step needs, in the order the runner runs them."""
    spills: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (host block, disk slot)
    saves: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (device page, host block)
    restores: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)  # (HOST|DISK, block, device page)

    def __bool__(self) -> bool:
        return bool(self.spills or self.saves or self.restores)


class BlockPool:
    """One tier's blocks: hash -> block for the blocks whose bytes are there (least recently used
    first), blocks whose bytes are still on their way (pending), and read pins."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: 0, 1, 2, ...
        self._ready: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU first
        self._hash_of: dict[int, bytes] = {}  # every block in use: ready or pending
        self._pending: dict[bytes, int] = {}
        self._pins: collections.Counter[int] = collections.Counter()

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def holds(self, block_hash: bytes) -> bool:
        """Whether the hash is here or on its way here."""
        return block_hash in self._ready or block_hash in self._pending

    def find(self, block_hash: bytes) -> int | None:
        """The block holding the hash's bytes now (not a pending one); no side effects."""
        return self._ready.get(block_hash)

    def touch(self, block_hash: bytes) -> None:
        if block_hash in self._ready:
            self._ready.move_to_end(block_hash)

    def pin(self, block: int) -> None:
        self._pins[block] += 1
        self.touch(self._hash_of[block])

    def unpin(self, block: int) -> None:
        self._pins[block] -= 1
        if self._pins[block] <= 0:
            del self._pins[block]

    def reserve(self, block_hash: bytes) -> tuple[int, tuple[bytes, int] | None] | None:
        """A block for the hash's bytes, pending until `landed`: a free one, else the least
        recently used ready block nobody reads (returned as (hash, block) it held); None when
        every block is pending or pinned."""
        evicted = None
        if self._free:
            block = self._free.pop()
        else:
            victim = next((h for h, b in self._ready.items() if b not in self._pins), None)
            if victim is None:
                return None
            block = self._ready.pop(victim)
            evicted = (victim, block)
        self._hash_of[block] = block_hash
        self._pending[block_hash] = block
        return block, evicted

    def landed(self, block: int) -> None:
        """The bytes of a reserved block are there: it can be found from now on."""
        block_hash = self._hash_of[block]
        del self._pending[block_hash]
        self._ready[block_hash] = block

    def release(self, block: int) -> None:
        """Gives a block back (a failed save's): forgotten, free again."""
        block_hash = self._hash_of.pop(block)
        self._pending.pop(block_hash, None)
        if self._ready.get(block_hash) == block:
            del self._ready[block_hash]
        self._pins.pop(block, None)
        self._free.append(block)


@dataclasses.dataclass
class OffloadCounters:
    """What the tiers did, in pages (the engine's stats turn them into tokens and bytes)."""
    queried_pages: int = 0  # full prompt pages looked up here (past the device's cached ones)
    host_hit_pages: int = 0  # restored from the host tier
    disk_hit_pages: int = 0  # restored from the disk tier
    saved_pages: int = 0  # device -> host (landed)
    spilled_pages: int = 0  # host -> disk
    dropped_pages: int = 0  # evicted from the device with no host block free for them (all pending or pinned)


class OffloadTiers:
    """The host tier of `num_host_blocks` pages and, with `num_disk_slots`, the disk tier under it."""

    def __init__(self, num_host_blocks: int, num_disk_slots: int = 0) -> None:
        if num_host_blocks < 1:
            raise ValueError(f"the host tier needs at least one block, got {num_host_blocks}")
        self.host = BlockPool(num_host_blocks)
        self.disk = BlockPool(num_disk_slots) if num_disk_slots else None
        self.counters = OffloadCounters()
        self._transfers = KVTransfers()

    # ---- the device evicts, a request restores ---------------------------------------------
    def offer(self, page: int, block_hash: bytes) -> None:
        """The device prefix cache evicts `page` (registered under `block_hash`) to reuse it: its
        bytes are saved to a host block before the step that reuses it, unless a tier has them."""
        if self.host.holds(block_hash):
            self.host.touch(block_hash)
            return
        if self.disk is not None and self.disk.find(block_hash) is not None:
            self.disk.touch(block_hash)
            return
        reserved = self.host.reserve(block_hash)
        if reserved is None:
            self.counters.dropped_pages += 1
            return
        block, evicted = reserved
        if evicted is not None:
            self._spill(*evicted)
        self._transfers.saves.append((page, block))

    def _spill(self, block_hash: bytes, host_block: int) -> None:
        """The host tier evicts `host_block`: its bytes go to a disk slot first, if there is a
        disk tier with room and it does not hold them already."""
        if self.disk is None or self.disk.holds(block_hash):
            return
        reserved = self.disk.reserve(block_hash)
        if reserved is None:
            return
        slot, _ = reserved  # a disk slot evicted for it is simply forgotten
        self._transfers.spills.append((host_block, slot))

    def find(self, block_hashes: Iterable[bytes]) -> list[bytes]:
        """The longest run of `block_hashes`, from the first, whose bytes a tier holds now."""
        found = []
        for block_hash in block_hashes:
            if self.host.find(block_hash) is None and (self.disk is None or self.disk.find(block_hash) is None):
                break
            found.append(block_hash)
        return found

    def pin(self, block_hashes: Iterable[bytes]) -> list[tuple[str, int]]:
        """Pins the blocks of hashes `find` returned (host first, else disk), until
        `transfers_done`: (tier, block) of each."""
        sources = []
        for block_hash in block_hashes:
            block = self.host.find(block_hash)
            tier, pool = (HOST, self.host) if block is not None else (DISK, self.disk)
            block = pool.find(block_hash)
            pool.pin(block)
            sources.append((tier, block))
        return sources

    def restore(self, sources: list[tuple[str, int]], pages: list[int]) -> None:
        """Fills each device page from its pinned source before the step."""
        for (tier, block), page in zip(sources, pages):
            self._transfers.restores.append((tier, block, page))
            if tier == HOST:
                self.counters.host_hit_pages += 1
            else:
                self.counters.disk_hit_pages += 1

    # ---- the engine runs the copies ---------------------------------------------------------
    def take_transfers(self) -> KVTransfers:
        """The copies scheduled since the last call (the step's)."""
        transfers, self._transfers = self._transfers, KVTransfers()
        return transfers

    def transfers_done(self, transfers: KVTransfers) -> None:
        """The spills and restores have run: their disk slots hold the bytes, their sources are free to go."""
        for host_block, slot in transfers.spills:
            self.disk.landed(slot)
            self.counters.spilled_pages += 1
        for tier, block, _ in transfers.restores:
            (self.host if tier == HOST else self.disk).unpin(block)

    def saves_landed(self, transfers: KVTransfers) -> None:
        """The saves' bytes are in their host blocks."""
        for _, block in transfers.saves:
            self.host.landed(block)
            self.counters.saved_pages += 1

    def transfers_failed(self, transfers: KVTransfers) -> None:
        """The copies did not run (or not all): every block they wrote is given back and every pin released."""
        for _, slot in transfers.spills:
            self.disk.release(slot)
        for tier, block, _ in transfers.restores:
            (self.host if tier == HOST else self.disk).unpin(block)
        for _, block in transfers.saves:
            self.host.release(block)


class KVOffload:
    """The engine's KV offload: the tiers (given to the PageAllocator, which offers and restores
    pages) and the runner that holds their bytes, and each step's copies run around the step."""

    def __init__(self, tiers: OffloadTiers, runner, page_bytes: int, page_size: int) -> None:
        self.tiers, self.runner, self.page_bytes, self.page_size = tiers, runner, page_bytes, page_size

    @classmethod
    def build(cls, cfg, runner, prefix_caching: bool, multi_process: bool, host_memory_bytes: int) -> KVOffload | None:
        """The offload `cfg` asks for (None without --kv_offloading_size) over the runner's KV cache:
        ValueError naming the flags when it cannot be had (an engine caching no prefixes, a
        multi-host job, more than `host_memory_bytes` for all the data-parallel replicas, a tier too
        small or a disk tier that cannot be made: ModelRunner.enable_kv_offload)."""
        if cfg.kv_offloading_size is None:
            return None
        if not prefix_caching:
            raise ValueError("--kv_offloading_size keeps evicted prefix-cache pages, and this engine caches no "
                             "prefixes (a pooling runner pools every token's row unless --pooler_config pools the "
                             "LAST token)")
        if multi_process:
            raise ValueError("--kv_offloading_size does not combine with a multi-host job yet (each process would "
                             "need the same host tier)")
        host_bytes = int(cfg.kv_offloading_size * GIB)
        replicas = cfg.data_parallel_size  # each replica keeps a host tier of this size
        if host_bytes * replicas > host_memory_bytes:
            each = f" for each of {replicas} replicas (--data_parallel_size)" if replicas > 1 else ""
            raise ValueError(f"--kv_offloading_size={cfg.kv_offloading_size:g} GiB{each} is more host memory than is "
                             f"available now ({host_memory_bytes / GIB:.1f} GiB)")
        disk_bytes = int(cfg.kv_offloading_disk_size * GIB) if cfg.kv_offloading_disk_path else 0
        num_host, num_disk, page_bytes = runner.enable_kv_offload(host_bytes, cfg.kv_offloading_disk_path, disk_bytes)
        return cls(OffloadTiers(num_host, num_disk), runner, page_bytes, cfg.page_size)

    def start_copies(self) -> KVTransfers:
        """Runs the copies the last schedule asked for, before its step: spills and restores done,
        saves started (`finish_copies` after the step). On an exception every block and pin of
        them is given back, and it is raised again."""
        transfers = self.tiers.take_transfers()
        if not transfers:
            return transfers
        try:
            self.runner.start_kv_transfers(transfers)
        except Exception:
            self.runner.drop_kv_saves()
            self.tiers.transfers_failed(transfers)
            raise
        self.tiers.transfers_done(transfers)
        return transfers

    def finish_copies(self, transfers: KVTransfers) -> None:
        """After the step: its saves land in host memory (a failure only loses them, logged)."""
        if not transfers.saves:
            return
        try:
            self.runner.land_kv_saves()
        except Exception:
            log.exception("KV offload: copying %d evicted pages to host memory failed; they are not kept",
                          len(transfers.saves))
            self.runner.drop_kv_saves()
            self.tiers.transfers_failed(KVTransfers(saves=transfers.saves))
            return
        self.tiers.saves_landed(transfers)

    def stats(self) -> dict[str, int]:
        """EngineStats' kv_offload_* fields."""
        host, disk, counts, ps = self.tiers.host, self.tiers.disk, self.tiers.counters, self.page_size
        restored, page_bytes = counts.host_hit_pages + counts.disk_hit_pages, self.page_bytes
        return dict(
            kv_offload_host_pages_used=host.num_used, kv_offload_host_pages_total=host.num_blocks,
            kv_offload_disk_pages_used=disk.num_used if disk else 0,
            kv_offload_disk_pages_total=disk.num_blocks if disk else 0,
            kv_offload_queried_tokens=counts.queried_pages * ps, kv_offload_host_hit_tokens=counts.host_hit_pages * ps,
            kv_offload_disk_hit_tokens=counts.disk_hit_pages * ps,
            kv_offload_bytes_to_host=counts.saved_pages * page_bytes, kv_offload_bytes_to_device=restored * page_bytes,
            kv_offload_bytes_to_disk=counts.spilled_pages * page_bytes, kv_offload_dropped_pages=counts.dropped_pages)

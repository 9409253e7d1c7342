"""KV offload's bytes: the host tier's blocks (and the disk tier's file), and the copies one step
needs between them and the device's KV cache (`kv_offload.KVTransfers`, decided on the host).

Every leaf of the KV cache (K and V; an int8 cache's pages and scales) is
[num_layers * num_pages, page_size, ...]: page p of layer l is row l * num_pages + p. One page
of the pool, all layers of every leaf, is one block here: host leaf i is a numpy array
[num_blocks, num_layers, page_size, ...] in the cache's storage dtype (quantized pages go with
their scales, byte for byte). The disk tier is one such array per leaf in a memory-mapped file.

A step's copies run in this order, all before the step is dispatched:
1. spills, host -> disk (their host blocks may be overwritten by this step's saves);
2. saves: the evicted device pages gathered into a new device array (the step may overwrite
   the pages; the gather is ordered before it) whose copy to the host starts at once and lands
   in the host blocks after the step (`land_saves`), overlapping the step's compute;
3. restores: the source blocks stacked on the host, put on the device and scattered into their
   pages (the cache is donated: updated in place), ahead of the step that reads them.
Gathers and scatters pad their page count to a power of two (the null page fills), so they
compile a few times, not once per count.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.kv_offload import HOST, KVTransfers
from jaxserve.core.page_allocator import NULL_PAGE

MIN_TRANSFER_PAGES = 16  # the smallest padded page count of a gather or scatter
DISK_FILE_PREFIX = "jaxserve-kv-offload"  # the disk tier's files (unlinked once mapped)


def page_bytes(kv_cache, num_pages: int) -> int:
    """Bytes of one page of the pool, every layer and leaf (what one block holds)."""
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(kv_cache)) // num_pages


def _padded(count: int) -> int:
    return max(MIN_TRANSFER_PAGES, 1 << (count - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class _Leaf:
    num_layers: int
    block_shape: tuple[int, ...]  # [num_layers, page_size, ...]
    dtype: np.dtype


class HostKVStore:
    """The host tier's `num_host_blocks` blocks and the disk tier's `num_disk_slots` slots (a file
    per cache leaf under `disk_path`) for a KV cache of `num_pages` pages per layer."""

    def __init__(self, kv_cache, num_pages: int, num_host_blocks: int, disk_path: str | None = None,
                 num_disk_slots: int = 0) -> None:
        leaves, self._treedef = jax.tree_util.tree_flatten(kv_cache)
        self.num_pages = num_pages
        num_layers = leaves[0].shape[0] // num_pages
        self._leaves = [_Leaf(num_layers, (num_layers, *leaf.shape[1:]), np.dtype(leaf.dtype)) for leaf in leaves]
        # np.zeros maps untouched memory: a block costs RAM once a save lands in it.
        self.host = [np.zeros((num_host_blocks, *leaf.block_shape), leaf.dtype) for leaf in self._leaves]
        self.disk = []
        if num_disk_slots:
            self.disk = [_open_disk_file(disk_path, i, (num_disk_slots, *leaf.block_shape), leaf.dtype)
                         for i, leaf in enumerate(self._leaves)]
        self._shardings = jax.tree_util.tree_map(lambda leaf: leaf.sharding, kv_cache)
        self._gather = jax.jit(self._gather_pages)
        self._scatter = jax.jit(self._scatter_pages, donate_argnums=0, out_shardings=self._shardings)
        self._compiled: dict[tuple[str, int], object] = {}  # ("gather" | "scatter", padded count): `compile`'s
        self._pending: list[tuple[list[jax.Array], list[int]]] = []  # saves on their way: (gathered, blocks)

    # ---- the device functions -------------------------------------------------------------
    def _gather_pages(self, kv_cache, pages: jax.Array) -> list[jax.Array]:
        """pages [n] -> per leaf [n, num_layers, page_size, ...]."""
        out = []
        for leaf, spec in zip(jax.tree_util.tree_leaves(kv_cache), self._leaves):
            by_layer = leaf.reshape(spec.num_layers, self.num_pages, *leaf.shape[1:])
            out.append(jnp.swapaxes(by_layer[:, pages], 0, 1))
        return out

    def _scatter_pages(self, kv_cache, pages: jax.Array, blocks: list[jax.Array]):
        """Writes blocks (per leaf [n, num_layers, page_size, ...]) into `pages` [n]."""
        leaves = []
        for leaf, spec, data in zip(jax.tree_util.tree_leaves(kv_cache), self._leaves, blocks):
            by_layer = leaf.reshape(spec.num_layers, self.num_pages, *leaf.shape[1:])
            by_layer = by_layer.at[:, pages].set(jnp.swapaxes(data, 0, 1).astype(leaf.dtype))
            leaves.append(by_layer.reshape(leaf.shape))
        return jax.tree_util.tree_unflatten(self._treedef, leaves)

    # ---- one step's copies ----------------------------------------------------------------
    def start(self, kv_cache, transfers: KVTransfers):
        """Runs the spills and restores and starts the saves (see the module's docstring);
        returns the KV cache, restored pages written."""
        for host_block, slot in transfers.spills:
            for host, disk in zip(self.host, self.disk):
                disk[slot] = host[host_block]
        if transfers.saves:
            pages = _pad([page for page, _ in transfers.saves])
            gathered = self._compiled.get(("gather", len(pages)), self._gather)(kv_cache, pages)
            for array in gathered:
                array.copy_to_host_async()
            self._pending.append((gathered, [block for _, block in transfers.saves]))
        if transfers.restores:
            count = len(transfers.restores)
            blocks = []
            for i, leaf in enumerate(self._leaves):
                data = np.zeros((_padded(count), *leaf.block_shape), leaf.dtype)
                for j, (tier, block, _) in enumerate(transfers.restores):
                    data[j] = (self.host if tier == HOST else self.disk)[i][block]
                blocks.append(data)
            pages = _pad([page for _, _, page in transfers.restores])
            kv_cache = self._compiled.get(("scatter", len(pages)), self._scatter)(kv_cache, pages, blocks)
        return kv_cache

    def land_saves(self) -> None:
        """Copies the started saves' bytes into their host blocks (waits for them)."""
        pending, self._pending = self._pending, []
        for gathered, blocks in pending:
            for host, array in zip(self.host, jax.device_get(gathered)):
                host[blocks] = np.asarray(array)[:len(blocks)]

    def drop_saves(self) -> None:
        """Forgets the started saves (their blocks are given back by the host's bookkeeping)."""
        self._pending = []

    def compile(self, kv_cache) -> None:
        """Compiles the gather and the scatter for every padded page count, ahead of use."""
        for count in sorted({_padded(c) for c in range(1, self.num_pages + 1)}):
            pages = jax.ShapeDtypeStruct((count,), jnp.int32)
            self._compiled["gather", count] = self._gather.lower(kv_cache, pages).compile()
            data = [jax.ShapeDtypeStruct((count, *leaf.block_shape), leaf.dtype) for leaf in self._leaves]
            self._compiled["scatter", count] = self._scatter.lower(kv_cache, pages, data).compile()


def _pad(pages: list[int]) -> np.ndarray:
    padded = np.full(_padded(len(pages)), NULL_PAGE, np.int32)
    padded[:len(pages)] = pages
    return padded


def check_disk_tier(directory: str, num_bytes: int) -> None:
    """ValueError naming --kv_offloading_disk_path when the disk tier cannot be there: a folder
    that cannot be made or written, or less free space than `num_bytes`."""
    flag = f"--kv_offloading_disk_path={directory}"
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
        free = shutil.disk_usage(directory).free
    except OSError as e:
        raise ValueError(f"{flag}: cannot keep the disk tier there ({e.strerror or e})") from None
    if free < num_bytes:
        raise ValueError(f"{flag}: the disk tier needs {num_bytes / 2**30:.2f} GiB (--kv_offloading_disk_size) but "
                         f"only {free / 2**30:.2f} GiB is free there")


def _open_disk_file(directory: str, index: int, shape: tuple[int, ...], dtype: np.dtype) -> np.memmap:
    """A new memory-mapped file of `shape` under `directory` (check_disk_tier first), unlinked at
    once: the mapping keeps its bytes, and nothing is left behind when the process ends."""
    with tempfile.NamedTemporaryFile(dir=directory, prefix=f"{DISK_FILE_PREFIX}-{index}-", suffix=".bin") as file:
        return np.memmap(file.name, dtype=dtype, mode="w+", shape=shape)

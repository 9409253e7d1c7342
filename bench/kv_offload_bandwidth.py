"""KV offload's copies against the host link: bench/gpu_check.sh's `kv_offload` step.

On a KV cache of Llama-3-8B's shape (32 layers x 8 KV heads x head_dim 128, page size 16, bfloat16:
2 MiB a page, K and V; 257 pages) and a `HostKVStore` over it (jaxserve/executor/kv_transfer.py),
measures, each the median of several timed runs after an untimed one (the store's gathers and
scatters compiled first, `HostKVStore.compile`):

- the host link: `jax.device_put` of a pageable numpy buffer (as the store's restores put theirs)
  host -> device, and `np.asarray` of a fresh device array device -> host, the size of the largest
  copy below; also through a pinned host buffer (memory kind "pinned_host") where the device has
  one, for comparison;
- restores: `HostKVStore.start` with N restores (64 and 256 pages), then `jax.block_until_ready`
  on the cache: the blocks stacked on the host, put on the device and scattered into their pages;
- saves: `start` with N saves, then `land_saves`: the pages gathered, copied to the host and
  written into their host blocks;

each as GB/s (10^9 bytes, N pages' bytes over the seconds) and as its ratio to the host link's
bandwidth in the same direction (pageable). Check `round_trip`: 256 pages of pseudo-random bytes saved
into host blocks must equal the device's pages (read back by numpy alone), and those blocks
restored in reverse order into a cache refilled with other random bytes must equal the pages they
land in (a store that copies nothing differs). Check `every_figure`: each bandwidth measured and
positive, else unknown. Every figure is written to --out as measured
(bench/gpu_check_report.StepReport), each measurement in its own guard. A short table last.
`--small`: a tiny cache (2 layers x 2 heads x 16, page size 4) and 4- and 16-page copies, the
same code path, for the CPU dry run. Exit 1 when a check failed or differed.

    python3 bench/kv_offload_bandwidth.py --out=results.json [--small]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.gpu_check_report import StepReport, require_gpu  # noqa: E402
from jaxserve.config import ModelConfig  # noqa: E402
from jaxserve.core.kv_offload import HOST, KVTransfers  # noqa: E402
from jaxserve.executor import kv_transfer  # noqa: E402
from jaxserve.executor.kv_transfer import HostKVStore  # noqa: E402
from jaxserve.models import llama  # noqa: E402

# The KV shape of Llama-3-8B (the other fields do not change the cache).
FULL = dict(model=ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                              num_q_heads=32, num_kv_heads=8, head_dim=128),
            page_size=16, counts=(64, 256), repeats=5)
SMALL = dict(model=ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                               num_q_heads=4, num_kv_heads=2, head_dim=16),
             page_size=4, counts=(4, 16), repeats=3)
DTYPE = jnp.bfloat16
MIN_SECONDS = 1e-9  # a zero-copy transfer (the CPU's) still gives a finite rate


def gb_per_s(num_bytes: int, seconds: float) -> float:
    return num_bytes / max(seconds, MIN_SECONDS) / 1e9


def timed(run, repeats: int) -> list[float]:
    """Seconds of `repeats` calls of run() (which waits for its own work), after an untimed one."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


def host_link(num_bytes: int, repeats: int) -> dict:
    """Host -> device (`jax.device_put` of a pageable numpy buffer) and device -> host (`np.asarray`
    of a device array not read before: jax keeps an array's numpy copy once made)."""
    device = jax.devices()[0]
    host = np.ones(num_bytes // 4, np.uint32)  # written: no lazily mapped zero pages
    arrays = []

    def put():
        arrays.append(jax.device_put(host, device).block_until_ready())

    to_device = timed(put, repeats)
    fresh = iter(arrays)
    to_host = timed(lambda: np.asarray(next(fresh)), repeats)
    link = {"bytes": num_bytes, "repeats": repeats,
            "host_to_device_s": to_device, "device_to_host_s": to_host,
            "host_to_device_gb_per_s": gb_per_s(num_bytes, statistics.median(to_device)),
            "device_to_host_gb_per_s": gb_per_s(num_bytes, statistics.median(to_host))}
    del arrays
    return link


def pinned_host_link(num_bytes: int, repeats: int) -> dict:
    """The same copies from and to a pinned host buffer (memory kind "pinned_host"), where the
    device has one: what the store's pageable buffers leave on the table."""
    device = jax.devices()[0]
    kinds = {memory.kind for memory in device.addressable_memories()}
    if "pinned_host" not in kinds:
        return {"reason": f"the device has no pinned_host memory (only {sorted(kinds)})"}
    pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    source = jax.device_put(np.ones(num_bytes // 4, np.uint32), pinned).block_until_ready()
    arrays = []

    def put():
        arrays.append(jax.device_put(source, on_device).block_until_ready())

    to_device = timed(put, repeats)
    to_host = timed(lambda: jax.device_put(arrays[-1], pinned).block_until_ready(), repeats)
    return {"host_to_device_gb_per_s": gb_per_s(num_bytes, statistics.median(to_device)),
            "device_to_host_gb_per_s": gb_per_s(num_bytes, statistics.median(to_host)),
            "host_to_device_s": to_device, "device_to_host_s": to_host}


def random_fill(kv_cache, seed: int):
    """Every leaf of the cache refilled with pseudo-random bytes (a hash of the element's index and
    `seed`; distinct in every page), finite bfloat16 values: cheap to compile and to run."""
    leaves, treedef = jax.tree_util.tree_flatten(kv_cache)
    filled = [_hash_fill(jnp.uint32(seed * len(leaves) + i), leaf) for i, leaf in enumerate(leaves)]
    return jax.block_until_ready(jax.tree_util.tree_unflatten(treedef, filled))


@jax.jit
def _hash_fill(seed, like):
    assert like.dtype.itemsize == 2, like.dtype  # 16 bits of the hash an element
    h = jax.lax.iota(jnp.uint32, like.size) * jnp.uint32(0x9E3779B1) + seed * jnp.uint32(0x85EBCA77)
    h = (h ^ (h >> 15)) * jnp.uint32(0x2C1B3C6D)
    h = h ^ (h >> 12)
    bits = (h & 0xBFFF).astype(jnp.uint16)  # the exponent's top bit clear: never an infinity or a NaN
    return jax.lax.bitcast_convert_type(bits, like.dtype).reshape(like.shape)


def device_pages(kv_cache, num_pages: int, pages: list[int]) -> list[np.ndarray]:
    """Per leaf, the bytes of `pages` read back from the device: [len(pages), num_layers, page_size,
    ...] (page p of layer l is row l * num_pages + p of each leaf), as uint8, by numpy alone."""
    out = []
    for leaf in jax.tree_util.tree_leaves(kv_cache):
        array = np.asarray(leaf)
        by_layer = array.reshape(-1, num_pages, *array.shape[1:])
        out.append(np.ascontiguousarray(np.swapaxes(by_layer[:, pages], 0, 1)).view(np.uint8))
    return out


def equal_pages(a: list[np.ndarray], b: list[np.ndarray]) -> int:
    """How many pages (first axis) hold the same bytes in every leaf."""
    same = np.ones(len(a[0]), bool)
    for x, y in zip(a, b):
        same &= (x.reshape(len(x), -1) == y.reshape(len(y), -1)).all(axis=1)
    return int(same.sum())


def round_trip(store, kv_cache, num_pages: int, count: int) -> tuple[object, dict]:
    """Pages 1..count of random bytes saved into blocks 0..count-1, compared with the device's pages;
    the cache refilled with other random bytes, block b restored into page count - b (another page
    than its source), compared with the pages it landed in. Returns the cache and the check."""
    kv_cache = random_fill(kv_cache, seed=1)
    sources = list(range(1, count + 1))
    expected = device_pages(kv_cache, num_pages, sources)
    store.start(kv_cache, KVTransfers(saves=[(page, block) for block, page in enumerate(sources)]))
    store.land_saves()
    saved = [np.ascontiguousarray(host[:count]).view(np.uint8) for host in store.host]
    saved_equal = equal_pages(saved, expected)
    kv_cache = random_fill(kv_cache, seed=2)
    targets = [count - block for block in range(count)]
    kv_cache = store.start(kv_cache, KVTransfers(restores=[(HOST, block, page) for block, page in enumerate(targets)]))
    restored_equal = equal_pages(device_pages(kv_cache, num_pages, targets), saved)
    status = "ok" if saved_equal == restored_equal == count else "differ"
    check = {"status": status, "pages": count, "saved_pages_equal": saved_equal,
             "restored_pages_equal": restored_equal,
             "bytes_compared": 2 * count * kv_transfer.page_bytes(kv_cache, num_pages)}
    return kv_cache, check


def measure_restores(store, state: dict, count: int, page_bytes: int, repeats: int, link: dict) -> dict:
    transfers = KVTransfers(restores=[(HOST, block, 1 + block) for block in range(count)])

    def restore():
        state["kv"] = jax.block_until_ready(store.start(state["kv"], transfers))

    times = timed(restore, repeats)
    return row(count, page_bytes, times, link.get("host_to_device_gb_per_s"))


def measure_saves(store, state: dict, count: int, page_bytes: int, repeats: int, link: dict) -> dict:
    transfers = KVTransfers(saves=[(1 + block, block) for block in range(count)])

    def save():
        store.start(state["kv"], transfers)
        store.land_saves()

    times = timed(save, repeats)
    return row(count, page_bytes, times, link.get("device_to_host_gb_per_s"))


def row(count: int, page_bytes: int, times: list[float], link_gb_per_s: float | None) -> dict:
    rate = gb_per_s(count * page_bytes, statistics.median(times))
    return {"pages": count, "bytes": count * page_bytes, "seconds": statistics.median(times), "times_s": times,
            "gb_per_s": rate, "ratio_to_host_link": rate / link_gb_per_s if link_gb_per_s else None}


def every_figure(report: dict, counts) -> dict:
    """ok when every bandwidth was measured and is positive and finite, else unknown naming the missing."""
    link = report.get("host_link", {})
    figures = {f"host_link/{k}": link.get(k) for k in ("host_to_device_gb_per_s", "device_to_host_gb_per_s")}
    for kind in ("restore", "save"):
        rows = {r["pages"]: r for r in report.get(kind, [])}
        for count in counts:
            figures[f"{kind}/{count}"] = rows.get(count, {}).get("gb_per_s")
            figures[f"{kind}/{count}/ratio"] = rows.get(count, {}).get("ratio_to_host_link")
    missing = [k for k, v in figures.items() if not (isinstance(v, float) and math.isfinite(v) and v > 0)]
    if missing:
        return {"status": "unknown", "reason": f"not measured: {', '.join(missing)}"}
    return {"status": "ok", "figures": len(figures)}


def print_table(report: dict) -> None:
    print(f"kv_offload: {report['machine']}; page {report['page_bytes'] / 2**20:.3f} MiB "
          f"({report['shape']}), {report['num_pages']} pages")
    print(f"{'copy':<16}{'pages':>6}{'MiB':>9}{'GB/s':>10}{'vs link':>9}")
    link = report.get("host_link", {})
    for name, key in (("host->device", "host_to_device_gb_per_s"), ("device->host", "device_to_host_gb_per_s")):
        if key in link:
            print(f"{name:<16}{'-':>6}{link['bytes'] / 2**20:>9.2f}{link[key]:>10.2f}{1.0:>9.2f}")
    pinned = link.get("pinned", {})
    for name, key in (("pinned h->d", "host_to_device_gb_per_s"), ("pinned d->h", "device_to_host_gb_per_s")):
        if key in pinned:
            print(f"{name:<16}{'-':>6}{link['bytes'] / 2**20:>9.2f}{pinned[key]:>10.2f}"
                  f"{pinned[key] / link[key]:>9.2f}")
    for kind in ("restore", "save"):
        for r in report.get(kind, []):
            ratio = r["ratio_to_host_link"]
            print(f"{kind:<16}{r['pages']:>6}{r['bytes'] / 2**20:>9.2f}{r['gb_per_s']:>10.2f}"
                  f"{'?' if ratio is None else f'{ratio:.2f}':>9}")
    for name, check in report["checks"].items():
        print(f"{name}: {check['status']} " + ", ".join(f"{k}={v}" for k, v in check.items() if k != "status"))



def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON report")
    parser.add_argument("--small", action="store_true", help="a tiny cache and copies (the CPU dry run)")
    args = parser.parse_args(argv)
    require_gpu()
    size = SMALL if args.small else FULL
    config, page_size, counts, repeats = size["model"], size["page_size"], size["counts"], size["repeats"]
    num_pages = max(counts) + 1  # the null page, then one page per copied block
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", str(device))
    report = StepReport(args.out, machine=f"{kind}, jax {jax.__version__} ({jax.default_backend()})",
                        device=kind, jax_version=jax.__version__, backend=jax.default_backend(), small=args.small,
                        shape=f"{config.num_layers} layers x {page_size} tokens x {config.num_kv_heads} heads x "
                              f"{config.head_dim}, K and V, {jnp.dtype(DTYPE).name}",
                        num_pages=num_pages, counts=list(counts), repeats=repeats)
    kv_cache = llama.init_kv_cache(config, llama.KVCacheSpec(num_pages, page_size), DTYPE)
    page_bytes = report.put("page_bytes", kv_transfer.page_bytes(kv_cache, num_pages))
    store = HostKVStore(kv_cache, num_pages, num_host_blocks=max(counts))
    with report.phase("compile"):
        store.compile(kv_cache)
    with report.guard("host_link"), report.phase("host_link"):
        report.put("host_link", host_link(max(counts) * page_bytes, repeats))
    state = {"kv": kv_cache}
    with report.guard("round_trip"), report.phase("round_trip"):
        state["kv"], check = round_trip(store, state["kv"], num_pages, max(counts))
        report.check("round_trip", **check)
    link = report.get("host_link", {})
    for count in counts:
        with report.guard(f"restore/{count}"), report.phase(f"restore/{count}"):
            report.append("restore", measure_restores(store, state, count, page_bytes, repeats, link))
    for count in counts:
        with report.guard(f"save/{count}"), report.phase(f"save/{count}"):
            report.append("save", measure_saves(store, state, count, page_bytes, repeats, link))
    report.check("every_figure", **every_figure(report, counts))
    if "host_link" in report:  # last, a comparison only: its failure is a figure's error, not the step's
        with report.phase("pinned_host_link"):
            try:
                pinned = pinned_host_link(max(counts) * page_bytes, repeats)
            except Exception as error:  # noqa: BLE001  (e.g. a runtime without pinned transfers)
                pinned = {"error": f"{type(error).__name__}: {str(error)[:500]}"}
            report["host_link"]["pinned"] = pinned
    print_table(report)
    return report.exit_status()


if __name__ == "__main__":
    sys.exit(main())

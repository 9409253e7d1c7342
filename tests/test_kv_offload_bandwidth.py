"""bench/kv_offload_bandwidth.py (bench/gpu_check.sh's `kv_offload` step) in its --small mode on the
CPU: every figure measured and positive, the restored pages holding the saved bytes, and a store
that copies nothing (or restores into the wrong pages) failing its round-trip check."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a subprocess, and the store's gathers and scatters compiled twice

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

import kv_offload_bandwidth  # noqa: E402

from jaxserve.core.kv_offload import KVTransfers  # noqa: E402
from jaxserve.executor.kv_transfer import HostKVStore  # noqa: E402

COUNTS = kv_offload_bandwidth.SMALL["counts"]


def positive(value) -> bool:
    return isinstance(value, (int, float)) and value > 0 and value != float("inf")


def test_the_small_run_measures_every_figure_and_restores_the_saved_bytes(tmp_path):
    out = tmp_path / "kv_offload.json"
    env = {k: v for k, v in os.environ.items() if k not in ("GPU_CHECK_SUMMARY", "GPU_CHECK_STEP", "GPU_CHECK_MODE")}
    result = subprocess.run([sys.executable, "bench/kv_offload_bandwidth.py", "--small", "--out", str(out)], cwd=REPO,
                            env={**env, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    import jax

    assert report["machine"] == f"cpu, jax {jax.__version__} (cpu)" and report["small"]
    page_bytes = report["page_bytes"]
    assert page_bytes == 2 * 2 * 4 * 2 * 16 * 2  # K and V x layers x page x heads x head_dim x bfloat16
    link = report["host_link"]
    assert link["bytes"] == max(COUNTS) * page_bytes
    assert positive(link["host_to_device_gb_per_s"]) and positive(link["device_to_host_gb_per_s"])
    assert positive(link["pinned"]["host_to_device_gb_per_s"]) and positive(link["pinned"]["device_to_host_gb_per_s"])
    for kind in ("restore", "save"):
        rows = report[kind]
        assert [r["pages"] for r in rows] == list(COUNTS), rows
        for r in rows:
            assert r["bytes"] == r["pages"] * page_bytes and len(r["times_s"]) == report["repeats"]
            assert positive(r["seconds"]) and positive(r["gb_per_s"]) and positive(r["ratio_to_host_link"]), r
    link_key = {"restore": "host_to_device_gb_per_s", "save": "device_to_host_gb_per_s"}
    for kind, key in link_key.items():  # the ratio is against the same direction's link
        for r in report[kind]:
            assert abs(r["ratio_to_host_link"] - r["gb_per_s"] / link[key]) < 1e-9 * r["ratio_to_host_link"]
    trip = report["checks"]["round_trip"]
    pages = max(COUNTS)
    assert trip == {"status": "ok", "pages": pages, "saved_pages_equal": pages, "restored_pages_equal": pages,
                    "bytes_compared": 2 * pages * page_bytes}
    assert report["checks"]["every_figure"]["status"] == "ok"
    assert set(report["phase_s"]) >= {"compile", "host_link", "round_trip", "pinned_host_link"}
    assert "round_trip: ok" in result.stdout and "restore" in result.stdout  # the table


class CopiesNothing(HostKVStore):
    """A store whose copies do nothing: what a bandwidth benchmark that measures no copy would time."""

    def start(self, kv_cache, transfers: KVTransfers):
        return kv_cache

    def land_saves(self) -> None:
        pass


class RestoresIntoTheNextPage(HostKVStore):
    """A store that saves right but restores each block into the page after the one asked for."""

    def start(self, kv_cache, transfers: KVTransfers):
        shifted = [(tier, block, page % (self.num_pages - 1) + 1) for tier, block, page in transfers.restores]
        return super().start(kv_cache, KVTransfers(spills=transfers.spills, saves=transfers.saves, restores=shifted))


@pytest.mark.parametrize("store, saved_equal", [(CopiesNothing, 0), (RestoresIntoTheNextPage, max(COUNTS))])
def test_a_store_that_does_not_copy_the_bytes_where_asked_fails_the_round_trip(tmp_path, monkeypatch, store,
                                                                               saved_equal):
    for name in ("GPU_CHECK_SUMMARY", "GPU_CHECK_STEP", "GPU_CHECK_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(kv_offload_bandwidth, "HostKVStore", store)
    out = tmp_path / "kv_offload.json"
    assert kv_offload_bandwidth.main(["--small", "--out", str(out)]) == 1
    trip = json.loads(out.read_text())["checks"]["round_trip"]
    assert trip["status"] == "differ" and trip["saved_pages_equal"] == saved_equal, trip
    assert trip["restored_pages_equal"] == 0, trip

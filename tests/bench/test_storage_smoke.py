"""The storage benchmark end to end (quick settings, real pods): every section measured for every
transport that is installed, the summary's target keys present. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json

from cacheflow_bench import storage


def test_storage_benchmark_quick_run(tmp_path):
    assert storage.main(["--quick", "--out", str(tmp_path)]) == 0
    body = json.loads((tmp_path / "storage.json").read_text())
    transports = {"tcp", "nixl"} if importlib.util.find_spec("nixl") else {"tcp"}
    assert {r["transport"] for r in body["loads"]} == transports == {r["transport"] for r in body["raw"]}
    assert all(r["reads"] >= 3 and r["pod_cpu_s_per_gb"] > 0 and r["loader_cpu_s_per_gb"] > 0 for r in body["loads"])
    summary = body["summary"]
    for key in ("loader_gb_per_s_tcp", "cpu_s_per_gb_end_to_end_max", "memcpy_cpu_s_per_gb", "max_shaping_error",
                "idle_pod_cpu_share_max", "socket_ceiling_gb_per_s"):
        assert summary[key] is not None, key
    assert set(summary["idle_pod_cpu_share"]) == transports
    assert (tmp_path / "storage.md").read_text().startswith("# Storage data plane")
    assert (tmp_path / "storage.png").stat().st_size > 0

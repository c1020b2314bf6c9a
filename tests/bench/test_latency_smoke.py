"""The fixed-cost benchmark end to end (quick settings, a real local cluster): every service answers its
round trips, the lone restores restored the stored prefix (checked inside the bench), decode generated
tokens. No timing is asserted; the numbers are only checked to be measured."""

from __future__ import annotations

import json

from cacheflow_bench import latency


def test_latency_benchmark_quick_run(tmp_path):
    assert latency.main(["--quick", "--out", str(tmp_path)]) == 0
    body = json.loads((tmp_path / "latency.json").read_text())
    services = {r["service"] for r in body["round_trips"]}
    assert services == {"coordinator", "stage 0", "stage 1", "pod 0", "pod 1"}
    assert len(body["restores"]) == 3 and all(r["engine_s"] > 0 for r in body["restores"])
    summary = body["summary"]
    assert summary["http_round_trip_ms_max"] > 0 and summary["decode_ms_per_token"] > 0
    assert body["tls"]["setup"]["tls"] and summary["tls_decode_ms_per_token"] > 0  # the same, over TLS
    assert (tmp_path / "latency.md").read_text().startswith("# Fixed costs")

"""The chaos benchmark end to end (quick settings): a supervised local cluster on real processes loses a
pod and a worker and is abused, and every promise that is not about speed holds."""

from __future__ import annotations

import json

from cacheflow_bench import chaos


def test_chaos_quick_run_keeps_every_promise_but_speed(tmp_path):
    assert chaos.main(["--quick", "--out", str(tmp_path)]) == 0
    body = json.loads((tmp_path / "chaos.json").read_text())
    s = body["summary"]
    assert s["requests"] == 5 * 6
    assert s["wrong_answers"] == 0  # every answer equals the healthy cluster's
    assert s["pod_kill_failed_requests"] == 0  # a dead pod's chunks are recomputed
    assert s["failed_requests"] == s["failed_by_phase"]["worker_kill"]  # only the worker kill may fail requests ...
    assert s["failed_by_phase"]["worker_kill"] <= s["worker_kill_in_flight"]  # ... those in flight on it
    assert s["leaked_slots"] == 0 and s["bad_requests_not_refused"] == 0
    assert s["lockout_s"] == 0  # the legitimate tenant was never refused during the abuse
    assert s["worker_kill_recovery_s"] < chaos.RECOVERY_DEADLINE_S  # served again (how fast is the bench's)
    assert 0 <= s["max_rss_growth_mb"] < 256
    assert s["worker_api_attacks_sent"] > 0  # the workers were attacked directly ...
    assert s["worker_api_unauthenticated_accepted"] == 0 and s["worker_api_ungranted_accepted"] == 0  # ... in vain
    assert s["poisoned_answers"] == 0
    assert s["worker_routes_without_grant"] == 0 and s["grant_replay_accepted"] == 0
    assert all(n == 0 for cells in s["worker_route_cells"].values() for n in cells.values())  # every route x class
    assert body["phases"]["worker_attacks"]["replay_first_uses_refused"] == 0  # a replay's first use was real
    assert s["other_tenant_refused_while_one_fills_pool"] == 0 and body["phases"]["fill_pools"]["hog_requests_held"]
    assert s["slowloris_open_after_s"] < 30  # closed by the header timeout (5 s), within a generous bound
    assert (tmp_path / "chaos.md").read_text().startswith("# Chaos")

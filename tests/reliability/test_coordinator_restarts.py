"""A request that finds a stage down waits for it as long as the supervisor says it is restarting that
stage (up to a hard bound), not a fixed time: a local cluster under its supervisor, and a coordinator
whose fixed wait (1 s) is far shorter than any worker's restart (real processes, tiny model)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from cacheflow_services.local_cluster import LocalCluster
from cacheflow_services.supervisor import RESTARTS_FILE, RestartPolicy
from tests.reliability.coordinator_checks import local_file, post, second_coordinator, small_cluster, wait_for

MODEL = "tiny"


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    for cluster in small_cluster(tmp_path_factory):
        cluster.supervise(RestartPolicy(first_delay_s=0.5, max_attempts=3))
        yield cluster


def _body(seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    return {"model": MODEL, "prompt": [rng.randrange(1000) for _ in range(40)], "max_tokens": 2}


def _restarting(local: LocalCluster) -> dict[str, object]:
    state = local_file(local, RESTARTS_FILE)
    return json.loads(state.read_text()) if state.exists() else {}


def test_a_request_waits_for_a_stage_the_supervisor_is_restarting(local, tmp_path: Path):
    state = local_file(local, RESTARTS_FILE)
    impatient = second_coordinator(local, tmp_path, "--stage-wait-s", "1", "--restarts-file", str(state))
    try:
        assert post(impatient.url, local.token, "/v1/completions", _body(1)).status_code == 200
        assert _restarting(local) == {}  # every process running
        local.workers[1].kill()
        wait_for(lambda: "stage 1" in _restarting(local), "the supervisor restarting stage 1")
        r = post(impatient.url, local.token, "/v1/completions", _body(2))  # waits past 1 s: it is restarting
        assert r.status_code == 200, r.text
        wait_for(lambda: _restarting(local) == {}, "the restart over")
    finally:
        impatient.stop()

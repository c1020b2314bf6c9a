"""`cacheflow up`: fails early and in one line, profiles the model once, reports each process as it is
ready, and its `--demo` restores what its first request stored (real processes, tiny model)."""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any

import pytest

from cacheflow_services import profiling
from cacheflow_services.cli import main
from cacheflow_services.local_cluster import ClusterSpec
from cacheflow_services.local_process import ServiceStartError, reporting_ready, start_service
from cacheflow_services.up import with_profile


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CACHEFLOW_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _one_error_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("cacheflow: error: ") and "Traceback" not in err, err
    return err


def test_a_wrong_model_fails_before_anything_starts(cache, tmp_path, capsys):
    workdir = tmp_path / "cluster"
    assert main(["up", "--model", str(tmp_path / "nowhere"), "--port", "0", "--dir", str(workdir)]) == 2
    assert "is neither 'tiny'" in _one_error_line(capsys.readouterr().err)
    assert not workdir.exists() and not cache.exists()  # no pod, no worker, no profile


def test_a_port_in_use_fails_before_anything_starts(cache, tmp_path, capsys):
    workdir = tmp_path / "cluster"
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        assert main(["up", "--model", "tiny", "--port", str(port), "--dir", str(workdir)]) == 2
    assert f"port {port} (the coordinator's) is in use" in _one_error_line(capsys.readouterr().err)
    assert not workdir.exists() and not cache.exists()


def test_the_profile_is_measured_once_and_reused(tmp_path, monkeypatch, capsys):
    measured: list[str] = []

    class Saved:
        def save(self, path: Path) -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("{}")

    def fake_measure(model: str, **_: Any) -> Saved:
        measured.append(model)
        return Saved()

    monkeypatch.setattr(profiling, "measure", fake_measure)
    spec = ClusterSpec(model="tiny", threads_per_stage=1)
    first, second = with_profile(spec, tmp_path), with_profile(spec, tmp_path)
    assert measured == ["tiny"] and first.profile == second.profile and Path(first.profile).is_file()
    assert "measured before" in capsys.readouterr().out
    assert with_profile(ClusterSpec(model="tiny", profile="mine.json"), tmp_path).profile == "mine.json"
    assert measured == ["tiny"]  # a spec's own profile is used as it is


def test_a_service_that_cannot_start_says_so_in_one_line_with_its_log(tmp_path):
    log = tmp_path / "pod.log"
    with pytest.raises(ServiceStartError) as caught:
        start_service(["storage", "--token-file", str(tmp_path / "missing-tokens")], log)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("`cacheflow storage` exited (status 2) before it was ready")
    assert f"(its log: {log})" in message and "missing-tokens" in message


def test_up_demo_profiles_reports_each_process_and_restores_the_second_request(cache, tmp_path, capsys):
    workdir = tmp_path / "cluster"
    assert main(["up", "--model", "tiny", "--demo", "--demo-tokens", "300", "--port", "0",
                 "--dir", str(workdir)]) == 0
    out = capsys.readouterr().out
    assert "profiling tiny on this machine" in out and list(cache.glob("profile-quick-tiny-*.json"))
    for service in ("storage", "worker (stage 0)", "worker (stage 1)", "coordinator"):
        assert f"  {service} ready on port " in out, out
    assert "first (prefill, then stored) request, about 300 prompt tokens: prefilling it" in out
    second = next(line for line in out.splitlines() if line.startswith("second (restored): "))
    restored = re.search(r"(\d+) restored from storage \(policy cacheflow, stage modes (\w+), (\w+)\)", second)
    assert restored and int(restored[1]) > 0, second
    log = (workdir / "coordinator.log").read_text()
    assert " queued: tenant default, 300 prompt tokens" in log and " first token: TTFT " in log


def test_reporting_ready_tells_of_each_service_started_inside_it(tmp_path):
    from cacheflow_services.storage.launch import launch_pod

    seen: list[tuple[str, int]] = []
    with reporting_ready(lambda name, ready, seconds: seen.append((name, ready["http_port"]))):
        pod = launch_pod(tmp_path / "pod")
    try:
        launch_pod(tmp_path / "quiet").stop()  # outside the block: not reported
        assert seen == [("storage", pod.http_port)]
    finally:
        pod.stop()

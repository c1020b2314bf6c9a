"""Files written whole or not at all (`cacheflow_common.files`)."""

from __future__ import annotations

import os

import pytest

from cacheflow_common import files
from cacheflow_common.auth import GrantIssuer, GrantVerifier, ensure_cluster_secrets, read_secret


def test_a_write_replaces_the_file_whole_and_owner_only(tmp_path):
    path = tmp_path / "deep" / "state.json"
    files.write_atomically(path, "first")
    files.write_atomically(path, b"second")
    assert path.read_text() == "second"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert [p.name for p in path.parent.iterdir()] == ["state.json"]  # no temporary file left


def test_an_interrupted_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    files.write_atomically(path, "old")

    def crash(fd: int) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk gone"):
        files.write_atomically(path, "new, half written")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_secrets_interrupted_midway_are_made_whole_on_the_next_start(tmp_path, monkeypatch):
    real_fsync, calls = os.fsync, []

    def crash_on_the_last_file(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 3:
            raise OSError("killed")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", crash_on_the_last_file)
    with pytest.raises(OSError, match="killed"):
        ensure_cluster_secrets(tmp_path / "internal")
    monkeypatch.setattr(os, "fsync", real_fsync)
    directory = ensure_cluster_secrets(tmp_path / "internal")  # the next start: every file, and one key pair
    issuer = GrantIssuer.from_dir(directory, {})
    verifier = GrantVerifier(read_secret(directory / "grant-verify-key.pem", "key"))
    assert verifier.verify(issuer.issue("forward", stages=[0], request_id="r", tenant="t")).request_id == "r"

"""Storage pod configuration: what a deployment gets wrong is refused with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from cacheflow_common.errors import ConfigError
from cacheflow_services.cli import main
from cacheflow_services.storage.config import StorageConfig, read_token_file

TOKENS = {"a-long-enough-secret-token": "acme"}


def test_a_valid_config():
    cfg = StorageConfig(backend="memory", tokens=TOKENS, capacity_bytes=1 << 20)
    assert cfg.transport == "auto" and cfg.max_object_bytes == 256 << 20


@pytest.mark.parametrize(("fields", "reason"), [
    ({"backend": "s3"}, "unknown backend"),
    ({"backend": "filesystem"}, "needs a directory"),
    ({"backend": "redis"}, "needs a URL"),
    ({"backend": "redis", "redis_url": "redis://x:1/0", "capacity_bytes": 10}, "maxmemory"),
    ({"transport": "rdma"}, "unknown transport"),
    ({"tokens": {}}, "at least one bearer token"),
    ({"tokens": {"short": "acme"}}, "printable characters"),
    ({"tokens": {"a-long-enough-secret-token": "Bad.Tenant"}}, "bad tenant id"),
    ({"max_object_bytes": 0}, "must not be negative"),
])
def test_bad_configs(fields, reason):
    kwargs = {"backend": "memory", "tokens": TOKENS, **fields}
    with pytest.raises(ConfigError, match=reason):
        StorageConfig(**kwargs)


def test_token_file(tmp_path: Path):
    path = tmp_path / "tokens"
    path.write_text("# tenants\nacme a-long-enough-secret-token\n\nbeta another-long-secret-token  # comment\n")
    assert read_token_file(path) == {"a-long-enough-secret-token": "acme", "another-long-secret-token": "beta"}
    path.write_text("acme\n")
    with pytest.raises(ConfigError, match="expected 'tenant token'"):
        read_token_file(path)
    with pytest.raises(ConfigError, match="cannot read"):
        read_token_file(tmp_path / "missing")


def test_cli_reports_config_errors(tmp_path: Path, capsys):
    (tmp_path / "tokens").write_text("acme short\n")
    assert main(["storage", "--backend", "memory", "--token-file", str(tmp_path / "tokens")]) == 2
    assert "printable characters" in capsys.readouterr().err

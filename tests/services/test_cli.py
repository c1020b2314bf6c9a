"""The `cacheflow` command: profile writes a loadable profile; bad input and bad cluster specs get a clear error."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from cacheflow_common.auth import INTERNAL_TOKEN_FILE, SIGNING_KEY_FILE, VERIFY_KEY_FILE, ensure_cluster_secrets
from cacheflow_common.errors import ConfigError
from cacheflow_common.restore.profile import Profile
from cacheflow_services.cli import BENCHMARKS, configure_logging, main
from cacheflow_services.local_cluster import ClusterSpec


def _cacheflow(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cacheflow_services.cli", *args], capture_output=True, text=True,
                          timeout=600, check=False)


def test_profile_writes_a_profile(tmp_path):
    out = tmp_path / "profile.json"
    run = _cacheflow("profile", "--model", "tiny", "--chunk-size", "64", "--max-tokens", "256", "--threads", "2",
                     "--store", f"filesystem:{tmp_path / 'chunks'}", "--out", str(out))
    assert run.returncode == 0, run.stderr
    profile = Profile.load(out)
    assert profile.model_name == "tiny" and profile.chunk_size == 64 and len(profile.crossovers) == 3
    assert profile.costs.load.bytes_per_s > 0 and all(c.l_delta > 0 for c in profile.crossovers)


def test_bad_arguments_get_a_clear_error(tmp_path):
    run = _cacheflow("profile", "--model", str(tmp_path / "nowhere"))
    assert run.returncode == 2 and "neither 'tiny', 'qwen3-8b', 'smollm2' nor a directory" in run.stderr
    run = _cacheflow("profile", "--model", "tiny", "--store", "tape:x")
    assert run.returncode == 2 and "unknown store" in run.stderr


def test_a_cluster_spec_pins_each_stage_or_none(tmp_path):
    spec = tmp_path / "cluster.yaml"
    spec.write_text("stages: 2\nstage_cpus: ['0', '1']\n")
    assert ClusterSpec.load(spec).stage_cpus == ["0", "1"]
    spec.write_text("stages: 2\nstage_cpus: ['0']\n")
    with pytest.raises(ConfigError, match="1 CPU sets for 2 stages"):
        ClusterSpec.load(spec)


@pytest.mark.parametrize(("text", "error"), [
    ("stages: two\n", "stages must be an integer, not 'two'"),
    ('port: "eight thousand"\n', "port must be an integer, not 'eight thousand'"),
    ("rate_gbps: fast\n", "rate_gbps must be a number, not 'fast'"),
    ("tls: 1\n", "tls must be true or false, not 1"),
    ("pods: true\n", "pods must be an integer, not True"),
    ("stages: 2\nstage_cpus: [0, 1]\n", "stage_cpus[0] must be a string, not 0"),
    ("worker_args: --step-tokens 512\n", "worker_args must be a list of strings, not '--step-tokens 512'"),
])
def test_a_spec_value_of_the_wrong_type_is_one_line_naming_it(tmp_path, capsys, text, error):
    spec = tmp_path / "cluster.yaml"
    spec.write_text(text)
    assert main(["up", "--spec", str(spec), "--model", "tiny", "--dir", str(tmp_path / "cluster")]) == 2
    err = capsys.readouterr().err
    assert err == f"cacheflow: error: cluster spec {spec}: {error}\n"
    assert not (tmp_path / "cluster").exists()


def test_a_spec_port_out_of_range_is_refused_in_one_line(tmp_path, capsys):
    spec = tmp_path / "cluster.yaml"
    spec.write_text("port: 70000\n")
    assert main(["up", "--spec", str(spec), "--model", "tiny", "--dir", str(tmp_path / "cluster")]) == 2
    assert capsys.readouterr().err == "cacheflow: error: port must be 0 (any free one) to 65535, not 70000\n"


def test_a_spec_number_may_be_written_as_an_integer(tmp_path):
    spec = tmp_path / "cluster.yaml"
    spec.write_text("rate_gbps: 1\nbatch_window_ms: 5\nstages: 3\n")
    loaded = ClusterSpec.load(spec)
    assert loaded.rate_gbps == 1.0 and isinstance(loaded.rate_gbps, float) and loaded.stages == 3


UNKNOWN_MODEL = "model 'llama-7b' is neither 'tiny', 'qwen3-8b', 'smollm2' nor a directory with a config.json"


@pytest.mark.parametrize("argv", [
    ["demo", "--model", "llama-7b"],
    ["up", "--model", "llama-7b", "--port", "0"],
    ["profile", "--model", "llama-7b"],
    ["worker", "--model", "llama-7b", "--stage", "0", "--layers", "0:8", "--pods", "127.0.0.1:1",
     "--internal-token-file", "missing", "--grant-key-file", "missing"],
    ["coordinator", "--model", "llama-7b", "--stages", "http://127.0.0.1:1", "--pods", "127.0.0.1:1",
     "--pod-token-file", "missing", "--token-file", "missing", "--internal-token-file", "missing",
     "--grant-signing-key-file", "missing"],
    ["bench", "restore", "--models", "tiny,llama-7b", "--quick"],
], ids=lambda argv: argv[0] if argv[0] != "bench" else "bench-restore")
def test_an_unknown_model_is_refused_before_any_work(tmp_path, monkeypatch, capsys, argv):
    monkeypatch.setenv("CACHEFLOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    printed = capsys.readouterr()
    assert printed.err == f"cacheflow: error: {UNKNOWN_MODEL}\n"
    assert printed.out == ""  # nothing announced (no "profiling ..."), nothing measured
    assert list(tmp_path.iterdir()) == []  # no cache, no profile, no results


@pytest.fixture
def restored_logging():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_services_log_at_info_and_interactive_commands_show_no_library_info(restored_logging):
    configure_logging("coordinator", verbose=False)
    assert logging.getLogger("cacheflow_services.coordinator.service").isEnabledFor(logging.INFO)
    for command in ("demo", "up", "profile", "bench"):
        configure_logging(command, verbose=False)
        assert not logging.getLogger("matplotlib.font_manager").isEnabledFor(logging.INFO), command
    configure_logging("demo", verbose=True)
    assert logging.getLogger("cacheflow_services").isEnabledFor(logging.DEBUG)


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_each_benchmark_prints_its_own_help(name, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["bench", name, "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: cacheflow bench {name} ") and "--out" in out, out


def _coordinator_args(tmp_path) -> list[str]:
    tokens = tmp_path / "tokens"
    tokens.write_text("acme secret\n")
    secrets = ensure_cluster_secrets(tmp_path / "internal")
    return ["coordinator", "--stages", "http://127.0.0.1:1", "--pods", "127.0.0.1:1", "--pod-token-file", str(tokens),
            "--token-file", str(tokens), "--internal-token-file", str(secrets / INTERNAL_TOKEN_FILE),
            "--grant-signing-key-file", str(secrets / SIGNING_KEY_FILE)]


def test_a_coordinator_refuses_an_unknown_default_policy(tmp_path):
    run = _cacheflow(*_coordinator_args(tmp_path), "--policy", "fastest")
    assert run.returncode == 2 and "unknown policy 'fastest'" in run.stderr


def test_services_refuse_to_start_without_their_internal_credentials(tmp_path):
    args = _coordinator_args(tmp_path)
    empty = tmp_path / "empty"
    empty.write_text("")
    key = args.index("--grant-signing-key-file") + 1
    run = _cacheflow(*args[:key], str(tmp_path / "internal" / VERIFY_KEY_FILE), *args[key + 1 :])
    assert run.returncode == 2 and "Ed25519 private key" in run.stderr  # a verifying key cannot sign
    token = args.index("--internal-token-file") + 1
    run = _cacheflow(*args[:token], str(empty), *args[token + 1 :])
    assert run.returncode == 2 and "internal token file" in run.stderr and "is empty" in run.stderr
    run = _cacheflow("worker", "--stage", "0", "--layers", "0:8", "--pods", "127.0.0.1:1",
                     "--internal-token-file", str(tmp_path / "missing"), "--grant-key-file", str(empty))
    assert run.returncode == 2 and "cannot read the internal token file" in run.stderr

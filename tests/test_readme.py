"""Every code block of the README runs, or where it cannot run here, is checked, so the README stays honest.

* Python blocks run for real. Substituted, only where the README's value cannot work in a test: the
  model `smollm2` becomes `tiny` (the seeded random model: no conversion, seconds instead of minutes;
  the profile file the example names follows, `profile-tiny.json`), `/tmp/cacheflow-chunks` a temporary
  folder, the ClusterStore example's pod addresses and token two real storage pods on loopback, and
  the StageChain example's worker URLs two real tiny stage workers. `~` is a temporary home.
* Bash blocks: every `cacheflow ...` command is parsed by the real CLI parser, exact flags only (a
  renamed or misspelt flag fails here); the quick ones run for real (`printf ... > tokens.txt`, and
  `cacheflow profile ... --quick` on the tiny model). Every other command is in SKIPPED with the
  reason it does not run here (installs, `bash .ci/run` itself, long-running services, a Kubernetes
  cluster); a command in none of these fails the test until someone decides.
* The YAML block (a CacheFlowCluster) is validated against the CRD, and the vLLM command's connector
  settings are parsed by the connector's own config.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from pydantic import BaseModel

from cacheflow_common import stage_api
from cacheflow_common.engine import restore
from cacheflow_common.layer_split import balanced_split
from cacheflow_common.model.sources import load_model, model_config
from cacheflow_common.restore.save import compute_prefix_kv, make_job, save_prefix
from cacheflow_common.sched.policies import POLICIES
from cacheflow_services.cli import main
from cacheflow_services.storage.launch import LocalPod, launch_pod
from cacheflow_services.vllm_connector.config import ConnectorConfig
from cacheflow_services.worker.launch import LocalWorker, launch_stages
from tests.k8s.checks import parse_args, validate_cr

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```$", re.M | re.S)
SEPARATORS = {";", "&", "&&", "|", "||", "\n"}
REDIRECTS = {">", ">>", "<"}
RUN_FOR_REAL = {"profile", "secrets"}  # `cacheflow` subcommands quick enough to run here (on the tiny model)
PARSED_ONLY = {  # `cacheflow` subcommands that are parsed but not run, and why
    "demo": "minutes of SmolLM2 (tests/services/test_demo.py runs it on the tiny model)",
    "storage": "serves until stopped (tests/services start real pods)",
    "worker": "serves until stopped (the StageChain example below runs against real workers)",
    "up": "serves until stopped (tests/services/test_up.py runs `up --demo` on the tiny model)",
}
SKIPPED = {  # other commands in bash blocks, and why they do not run here
    "pip": "installs packages",
    "prometheus": "serves until stopped (tests/k8s/test_prometheus.py runs it against a local cluster)",
    "bash": "`bash .ci/run` is the whole CI (it runs these tests)",
    "curl": "needs `cacheflow up` serving on port 8000",
    "docker": "builds and pushes an image",
    "helm": "needs a Kubernetes cluster (tests/k8s renders the chart)",
    "kubectl": "needs a Kubernetes cluster",
    "vllm": "needs vLLM serving a model (its connector settings are checked below)",
    "python3": "creates vLLM's virtual environment",
    ".venv-vllm/bin/pip": "installs vLLM",
    ".venv-vllm/bin/python": "needs vLLM (tests/vllm drives it)",
}


@dataclass(frozen=True)
class Block:
    line: int  # where the block starts in the README
    lang: str
    code: str


def blocks(lang: str) -> list[Block]:
    text = README.read_text()
    return [Block(text[: m.start()].count("\n") + 1, m[2], textwrap.dedent(m[3])) for m in FENCE.finditer(text)
            if m[2] == lang]


def python_block(marker: str) -> Block:
    (found,) = [b for b in blocks("python") if marker in b.code]
    return found


def substituted(block: Block, replacements: dict[str, str]) -> str:
    """The block with each replacement made; every one must occur (or the README changed under the test)."""
    code = block.code
    for old, new in replacements.items():
        assert old in code, f"README.md:{block.line}: {old!r} not found; update this test"
        code = code.replace(old, new)
    return code


def run_python(block: Block, code: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    exec(compile(code, f"README.md:{block.line}", "exec"), namespace)
    return namespace


def _strip_comments(code: str) -> str:
    """Drop `# ...` comments outside quotes (shlex would swallow the newline that ends a command)."""
    out, quote, i = [], "", 0
    while i < len(code):
        ch = code[i]
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or code[i - 1] in " \t\n"):
            i = code.find("\n", i)  # the comment ends at its line's end (kept: it ends the command too)
            if i < 0:
                break
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def commands(code: str) -> Iterator[list[str]]:
    """The block's simple commands (argv, environment assignments dropped), split at ; & && | || and newlines."""
    lexer = shlex.shlex(_strip_comments(code.replace("\\\n", " ")), posix=True, punctuation_chars=";&|<>\n")
    lexer.whitespace = " \t\r"
    lexer.whitespace_split = True
    argv: list[str] = []
    tokens = iter(lexer)
    for token in tokens:
        if token.strip(" \n") in REDIRECTS:
            next(tokens)  # the file redirected to
        elif set(token) <= set(";&|\n"):
            yield from [argv] if argv else []
            argv = []
        elif argv or not re.fullmatch(r"[A-Z_]+=\S*", token):
            argv.append(token)
    yield from [argv] if argv else []


def bash_commands() -> list[tuple[int, list[str]]]:
    return [(b.line, argv) for b in blocks("bash") for argv in commands(b.code)]


def readme_cacheflow(subcommand: str) -> list[str]:
    (argv,) = [argv[1:] for _, argv in bash_commands() if argv[:2] == ["cacheflow", subcommand]]
    return argv


# ------------------------------------------------------------------------------------------ bash blocks
def test_every_bash_command_is_checked_run_or_skipped_with_a_reason():
    found = bash_commands()
    assert len(found) > 10
    for line, argv in found:
        if argv[0] == "cacheflow":
            assert argv[1] in RUN_FOR_REAL | set(PARSED_ONLY), f"README.md:{line}: decide how to check {argv}"
        else:
            assert argv[0] in {*SKIPPED, "printf"}, f"README.md:{line}: decide how to check {argv}"


@pytest.mark.parametrize(("line", "argv"), [c for c in bash_commands() if c[1][0] == "cacheflow"],
                         ids=lambda x: " ".join(x[:2]) if isinstance(x, list) else str(x))
def test_every_cacheflow_command_in_the_readme_parses(line, argv):
    parse_args(argv[1:])  # exact flags through the real parser: SystemExit on a renamed or misspelt one


def test_the_token_file_command_runs(tmp_path):
    (printf,) = [b for b in blocks("bash") if "printf" in b.code]
    line = next(text for text in printf.code.splitlines() if text.startswith("printf"))
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"  # `python`: this environment's
    subprocess.run(["bash", "-c", line], cwd=tmp_path, check=True, env={**os.environ, "PATH": path})
    tenant, token = (tmp_path / "tokens.txt").read_text().split()
    assert tenant == "acme" and len(token) >= 24


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A temporary home with the profile the README's `cacheflow profile` command writes (tiny model)."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(home))
        mp.delenv("CACHEFLOW_CACHE", raising=False)
        argv = [arg.replace("smollm2", "tiny") for arg in readme_cacheflow("profile")]
        assert main(argv) == 0  # runs for real
        yield home


def test_the_profile_command_writes_the_file_the_readme_names(home):
    assert (home / ".cache" / "cacheflow" / "profile-tiny.json").is_file()


# ------------------------------------------------------------------------------------------ python blocks
def test_every_python_block_has_a_test():
    assert len(blocks("python")) == 3  # the three below: a new block needs its own test


def test_the_python_example_restores_what_it_saved(home, tmp_path):
    block = python_block("Profile.load(")
    code = substituted(block, {'"smollm2"': '"tiny"', "profile-smollm2.json": "profile-tiny.json",
                               "/tmp/cacheflow-chunks": str(tmp_path / "chunks")})
    ns = run_python(block, code)
    result, model, job = ns["result"], ns["model"], ns["job"]
    assert result.kv.data.shape[3] == len(ns["token_ids"])
    assert set(result.sources()) <= {"computed", "loaded"}
    prefill = compute_prefix_kv(model, job)  # "equal to a full prefill's KV"
    # Exact where loaded (the saved bytes). Where computed, within the dtype's rounding: the adaptive policy
    # may go layer-wise (its L_delta comes from the profile measured here), and a layer over the whole
    # prefix at once rounds differently from the chunked prefill (bfloat16 where the CPU has AMX/AVX512-BF16).
    tol = 1e-4 if model.dtype == torch.float32 else 3e-2
    n = len(job.token_ids)
    for unit, source in enumerate(result.sources()):
        span = (slice(unit, unit + 1), slice(None), slice(None), slice(0, n)) if result.mode == "layer" else (
            slice(None), slice(None), slice(None), slice(job.keys[unit].token_start, job.keys[unit].token_end))
        got, want = result.kv.data[span], prefill.data[span]
        if source == "loaded":
            assert torch.equal(got, want), f"loaded {result.mode} unit {unit} differs from the saved bytes"
        else:
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@dataclass
class Cluster:
    pods: list[LocalPod]
    workers: list[LocalWorker]
    token: str
    workdir: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Two storage pods and two tiny stage workers on loopback, tenant acme (what the README's bash
    blocks start, on free ports)."""
    work = tmp_path_factory.mktemp("readme-cluster")
    first = launch_pod(work / "pod-0", tenants=("acme",))
    pods = [first, launch_pod(work / "pod-1", tokens=first.tokens)]
    token_file = work / "tokens.txt"
    token_file.write_text(f"acme {first.tokens['acme']}\n")
    (secrets_line,) = [argv for _, argv in bash_commands() if argv[:2] == ["cacheflow", "secrets"]]
    assert main([*secrets_line[1:-1], str(work / "internal")]) == 0  # the README's command, into this cluster
    workers: list[LocalWorker] = []
    try:
        workers = launch_stages(work, split=balanced_split(model_config("tiny").num_layers, 2),
                                pods=[f"pod-{i}=127.0.0.1:{p.data_port}" for i, p in enumerate(pods)],
                                secrets=work / "internal", model="tiny", policy="cacheflow")
        yield Cluster(pods, workers, first.tokens["acme"], work)
    finally:
        for w in workers:
            w.stop()
        for p in pods:
            p.stop()


def test_the_cluster_store_example_reaches_real_pods(cluster):
    block = python_block("ClusterStore(")
    code = substituted(block, {'token = "..."': f"token = {cluster.token!r}",
                               "pod-0=10.0.0.5:7400": f"pod-0=127.0.0.1:{cluster.pods[0].data_port}",
                               "pod-1=10.0.0.6:7400": f"pod-1=127.0.0.1:{cluster.pods[1].data_port}"})
    store = run_python(block, code)["store"]
    model = load_model("tiny", dtype=torch.float32)
    job = make_job(model, list(range(1, 97)), tenant="acme", chunk_size=32)
    save_prefix(model, job, store)  # "pass it to restore(...) / save_prefix(...)"
    assert restore(job, model=model, store=store, policy="load-only").sources() == ["loaded"] * 3


def test_the_stage_chain_example_generates_through_real_workers(cluster):
    block = python_block("StageChain(")
    code = substituted(block, {"http://127.0.0.1:7510": cluster.workers[0].url,
                               "http://127.0.0.1:7511": cluster.workers[1].url,
                               'Path("tokens.txt")': f"Path({str(cluster.workdir / 'tokens.txt')!r})",
                               'Path("internal")': f"Path({str(cluster.workdir / 'internal')!r})"})
    out = run_python(block, code)["out"]
    assert len(out.tokens) == 16 and out.ttft_s > 0


# ------------------------------------------------------------------------------------------ the rest
def test_the_cacheflowcluster_example_is_valid_for_the_crd():
    (block,) = blocks("yaml")
    resource = yaml.safe_load(block.code)
    assert resource["kind"] == "CacheFlowCluster"
    validate_cr(resource)


def test_the_vllm_command_names_the_connector_and_valid_settings():
    (argv,) = [argv for _, argv in bash_commands() if argv[:2] == ["vllm", "serve"]]
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    module = config["kv_connector_module_path"]
    assert (README.parent / "services" / (module.replace(".", "/") + ".py")).is_file()
    assert config["kv_connector"] == "CacheFlowConnector"
    ConnectorConfig.from_extra(config["kv_connector_extra_config"], served_model=argv[2])


def _region(name: str) -> str:
    """The README's lines between `<!-- name:begin -->` and `<!-- name:end -->`."""
    text = README.read_text()
    return text[text.index(f"<!-- {name}:begin -->"):text.index(f"<!-- {name}:end -->")]


def test_the_policy_table_is_every_registered_policy_with_its_own_summary():
    rows = re.findall(r"^\| `([a-z0-9-]+)` \| (.+) \|$", _region("policies"), re.M)
    assert dict(rows) == {name: policy.summary for name, policy in POLICIES.items()}


def test_the_control_messages_named_are_the_stage_protocols_messages():
    start = README.read_text().index("Control messages are")
    paragraph = README.read_text()[start:].split("\n\n")[0]
    named = set(re.findall(r"`([A-Z][A-Za-z]+)`", paragraph))
    doc = stage_api.__doc__ or ""
    calls = [line for line in doc.splitlines() if line.lstrip().startswith(("POST", "GET", "any"))]
    protocol = set(re.findall(r"\b([A-Z][a-z]+[A-Z][A-Za-z]+)\b", "\n".join(calls)))  # the docstring's calls
    assert named and protocol <= named
    assert all(issubclass(getattr(stage_api, name), BaseModel) for name in named)

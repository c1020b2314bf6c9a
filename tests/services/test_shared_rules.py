"""Rules in one place: the simulator plans every request in the mode a stage worker's engine, and a vLLM
pipeline rank's connector, restores it in, on every stage of every pipeline; without a profile the stage
worker, the vLLM connector and the library's `restore()` all fall back to Cake."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cacheflow_common.engine import restore
from cacheflow_common.engine.builder import RestoreBuilder
from cacheflow_common.engine.stage_restore import RestoreSpec
from cacheflow_common.layer_split import balanced_split
from cacheflow_common.model.transformer import Transformer
from cacheflow_common.restore.job import RestoreJob
from cacheflow_common.restore.profile import Crossover, Profile
from cacheflow_common.restore.save import make_job, save_prefix
from cacheflow_common.sched.policies import NO_PROFILE, POLICIES
from cacheflow_common.sim import ModelShape, SimConfig, TraceRequest, simulate
from cacheflow_common.store.memory import MemoryStore
from cacheflow_common.transport.pod_client import PodAddress
from cacheflow_services.vllm_connector import restorer
from cacheflow_services.vllm_connector.config import ConnectorConfig
from cacheflow_services.vllm_connector.worker import connector_policy
from cacheflow_services.worker.config import WorkerConfig, engine_settings
from tests.factories import TINY_COSTS, tiny_model

CHUNK = 32
LAYERS = 4
LINK_GBPS = 10.0
PREFIXES = (16, 64, 100, 256, 1024)  # tokens; 64: the case (layer-wise in the simulator, token-wise here)
L_DELTAS = (0, 128, 512)  # profiles: token-wise always, from 128 tokens, from 512 tokens


@pytest.fixture(scope="module")
def model() -> Transformer:
    return tiny_model(num_layers=LAYERS)


def _profile(l_delta: int) -> Profile:
    return Profile(model="fp", model_name="tiny", dtype="float32", chunk_size=CHUNK, threads=1, costs=TINY_COSTS,
                   crossovers=(Crossover(link_bytes_per_s=LINK_GBPS * 1e9 / 8, l_delta=l_delta),))


def _worker(policy: str, stage: int, split: list[range]) -> WorkerConfig:
    last = stage == len(split) - 1
    return WorkerConfig(stage=stage, layers=split[stage], last_stage=last, next_stage="" if last else "http://next",
                        pods=(PodAddress.parse("p0=127.0.0.1:1"),), policy=policy, chunk_size=CHUNK,
                        link_gbps=LINK_GBPS)


def _job(model: Transformer, n_tokens: int, layers: range) -> RestoreJob:
    ids = [i % model.config.vocab_size for i in range(n_tokens)]
    return make_job(model, ids, tenant="t", chunk_size=CHUNK, layers=layers)


def _engine_spec(model: Transformer, policy: str, n_tokens: int, profile: Profile | None, stage: int,
                 split: list[range]) -> RestoreSpec:
    """What stage `stage`'s engine restores the prefix with, from its own stored inputs."""
    builder = RestoreBuilder(engine_settings(_worker(policy, stage, split), profile), model, on_input=lambda: None)
    return builder.spec("r", _job(model, n_tokens, split[stage]), policy, input_mode="boundary", upstream=False,
                        delivers=False)


def _connector_mode(model: Transformer, policy: str, n_tokens: int, profile: Profile, stage: int,
                    split: list[range]) -> str:
    """The mode a vLLM rank holding split[stage] restores the prefix in (CacheFlow's runtime)."""
    cfg = ConnectorConfig(pods=("p0=127.0.0.1:1",), tenant="t", pod_token_file="", policy=policy, chunk_size=CHUNK,
                          runtime="cacheflow")
    settings = restorer.engine_settings(cfg, split[stage], profile, LINK_GBPS * 1e9 / 8, policy, num_layers=LAYERS,
                                        paged_attention=False)
    builder = RestoreBuilder(settings, model, on_input=lambda: None)
    return builder.spec("r", _job(model, n_tokens, split[stage]), policy, input_mode="boundary", upstream=False,
                        delivers=False).mode


def _simulated_mode(policy: str, n_tokens: int, profile: Profile, n_stages: int) -> str:
    shape = ModelShape(num_layers=LAYERS, kv_bytes_per_token_layer=1000)
    config = SimConfig.from_profile(profile, model=shape, link_gbps=LINK_GBPS, policy=policy, n_stages=n_stages,
                                    chunk_size=CHUNK)
    trace = [TraceRequest(request_id="r", arrival_s=0.0, input_length=n_tokens, cached_tokens=n_tokens)]
    return simulate(trace, config).requests[0].mode


@pytest.mark.parametrize("n_stages", [1, 2, 4])
@pytest.mark.parametrize("policy", POLICIES)
def test_the_simulator_plans_the_mode_every_stage_restores_in(model, policy, n_stages):
    split = balanced_split(LAYERS, n_stages)
    for l_delta in L_DELTAS:
        profile = _profile(l_delta)
        for n_tokens in PREFIXES:
            simulated = _simulated_mode(policy, n_tokens, profile, n_stages)
            restored = [_engine_spec(model, policy, n_tokens, profile, s, split).mode for s in range(n_stages)]
            ranks = [_connector_mode(model, policy, n_tokens, profile, s, split) for s in range(n_stages)]
            assert restored == ranks == [simulated] * n_stages, f"{n_tokens} tokens, L_delta {l_delta}"


def test_a_short_prefix_on_a_pipeline_stage_goes_token_wise_in_both(model):
    profile = _profile(128)
    assert _simulated_mode("cacheflow", 64, profile, 1) == "layer"
    assert _simulated_mode("cacheflow", 64, profile, 2) == "token"
    assert _engine_spec(model, "cacheflow", 64, profile, 1, balanced_split(LAYERS, 2)).mode == "token"


def _without_profile(policy: str) -> str:
    """The rule as the connector once wrote it: the CacheFlow policies need a profile, else Cake."""
    return "cake" if policy.startswith("cacheflow") else policy


@pytest.mark.parametrize("policy", POLICIES)
def test_without_a_profile_the_worker_the_connector_and_the_library_fall_back_alike(model, policy):
    expected = _without_profile(policy)
    reason = NO_PROFILE if expected != policy else ""
    worker = _engine_spec(model, policy, 2 * CHUNK, None, 0, balanced_split(LAYERS, 1))
    assert (worker.policy.name, worker.fallback) == (expected, reason)
    connector = ConnectorConfig(pods=("p0=127.0.0.1:1",), tenant="t", pod_token_file="", policy=policy,
                                runtime="cacheflow")
    assert connector_policy(connector, None)[0] == expected
    store, job = MemoryStore(), _job(model, 2 * CHUNK, range(LAYERS))
    save_prefix(model, job, store)
    result = restore(job, model=model, store=store, policy=policy)
    assert (result.policy, result.fallback) == (expected, reason)


@pytest.mark.parametrize("policy", ["cacheflow", "cacheflow-layer", "cake"])
def test_with_a_profile_every_path_keeps_the_policy_asked_for(model, policy):
    worker = _engine_spec(model, policy, 2 * CHUNK, _profile(0), 0, balanced_split(LAYERS, 1))
    assert (worker.policy.name, worker.fallback) == (policy, "")
    connector = ConnectorConfig(pods=("p0=127.0.0.1:1",), tenant="t", pod_token_file="", policy=policy,
                                profile="given", runtime="cacheflow")
    assert connector_policy(connector, _profile(0))[0] == policy
    token_wise = "cacheflow-token" if policy == "cacheflow-layer" else policy  # vLLM's model: token-wise only
    assert connector_policy(replace(connector, runtime="vllm"), _profile(0))[0] == token_wise

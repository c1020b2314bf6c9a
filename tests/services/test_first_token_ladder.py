"""The way to a completion's first token, without a cluster: the fallback ladder as data, the restore
steps down it (with the failures they count), the unreachable-stage retry, and a Completion that streams
the decodes after the first token and can be stopped at any point."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cacheflow_common.auth import GrantIssuer, ensure_cluster_secrets
from cacheflow_common.stage_api import RestoreSummary
from cacheflow_services.coordinator.admission import Ticket
from cacheflow_services.coordinator.chain_error import ChainError
from cacheflow_services.coordinator.completion import Completion
from cacheflow_services.coordinator.first_token import FirstToken, FirstTokenSequence, Plan
from cacheflow_services.coordinator.ladder import FIRST_TOKEN_LADDER, RESTORE_LADDER, Rung, climb, input_mode
from cacheflow_services.coordinator.metrics import CoordinatorMetrics
from cacheflow_services.coordinator.request import Request
from cacheflow_services.coordinator.restoring import PrefixRestore
from cacheflow_services.coordinator.stage_chain import Sampling, StageChain

CHUNK = 32
MISSING = ChainError(1, "no boundary activations", status=409, error="BoundaryMissingError")
CORRUPT = ChainError(1, "chunk 2 cannot be restored", status=500, error="RestoreError")
DOWN = ChainError(0, "unreachable (ConnectError)", unreachable=True)


def _walk(errors: dict[Rung, ChainError], ladder: tuple[Rung, ...] = FIRST_TOKEN_LADDER) -> list[Rung]:
    """The rungs tried, in order, when each rung in `errors` fails with its error."""
    tried: list[Rung] = []

    def attempt(rung: Rung) -> None:
        tried.append(rung)
        if rung in errors:
            raise errors[rung]

    climb(ladder, attempt)
    return tried


def test_the_first_token_ladder_goes_down_by_the_errors_each_rung_takes():
    boundary, pipelined, short_boundary, short_pipelined, whole = FIRST_TOKEN_LADDER
    assert _walk({}) == [boundary]
    assert _walk({boundary: MISSING}) == [boundary, pipelined]
    assert _walk({boundary: CORRUPT}) == [boundary, short_boundary]  # pipelined needs what boundary lacked
    assert _walk({boundary: MISSING, pipelined: CORRUPT}) == [boundary, pipelined, short_boundary]
    assert _walk({boundary: MISSING, pipelined: CORRUPT, short_boundary: MISSING, short_pipelined: CORRUPT}) == [
        boundary, pipelined, short_boundary, short_pipelined, whole]
    assert _walk({boundary: CORRUPT, short_boundary: CORRUPT}) == [boundary, short_boundary, whole]
    assert whole.input is None and short_boundary.prefix == "still-stored"


def test_an_unreachable_stage_or_a_stopped_request_goes_down_no_rung():
    with pytest.raises(ChainError) as failed:
        _walk({FIRST_TOKEN_LADDER[0]: DOWN})
    assert failed.value is DOWN
    tried: list[Rung] = []

    def attempt(rung: Rung) -> None:
        tried.append(rung)
        raise MISSING

    with pytest.raises(ChainError):
        climb(FIRST_TOKEN_LADDER, attempt, stopped=lambda: True)
    assert tried == [FIRST_TOKEN_LADDER[0]]


def test_a_held_restore_falls_back_to_pipelined_only():
    with pytest.raises(ChainError) as failed:
        _walk({RESTORE_LADDER[0]: CORRUPT}, RESTORE_LADDER)
    assert failed.value is CORRUPT
    assert input_mode("pipelined") == "pipelined"
    with pytest.raises(ValueError, match="unknown input mode"):
        input_mode("sideways")


class FakeChain:
    """Stage calls that fail as told, in order; what they were asked is kept."""

    def __init__(self, *failures: ChainError | None) -> None:
        self.failures = list(failures)
        self.restores: list[tuple[str, int]] = []
        self.released: list[str] = []
        self.prefills: list[int] = []

    def restore_as(self, input: str, request_id: str, token_ids: list[int], **_: Any) -> list[RestoreSummary]:
        self.restores.append((input, len(token_ids)))
        if failure := self.failures.pop(0) if self.failures else None:
            raise failure
        return [RestoreSummary(request_id=request_id, stage=s, input="boundary", policy="cake", mode="token",
                               elapsed_s=0.1, computed=1, loaded=1) for s in range(2)]

    def prefill(self, sampling: Any, token_ids: list[int], *, start: int) -> int:
        self.prefills.append(start)
        if failure := self.failures.pop(0) if self.failures else None:
            raise failure
        return 7

    def decode(self, sampling: Any, token: int, **_: Any) -> Iterator[int]:
        yield from (8, 9)

    def release(self, request_id: str, tenant: str) -> None:
        self.released.append(request_id)


class FakeIntake:
    def __init__(self, still_stored: int) -> None:
        self.left: list[Request] = []
        self._still_stored = still_stored

    def still_stored(self, request: Request) -> int:
        return self._still_stored

    def wait_turn(self, request: Request) -> bool:
        return not request.cancelled.is_set()

    def leave_slot(self, request: Request) -> None:
        self.left.append(request)


class FakeCluster:
    def __init__(self, chain: FakeChain) -> None:
        self.chain = chain
        self.down: list[int] = []
        self.waited = 0

    def mark_stage_down(self, stage: int) -> None:
        self.down.append(stage)

    def wait_for_stages(self, timeout_s: float) -> None:
        self.waited += 1


def _request(cached: int = 4 * CHUNK) -> Request:
    return Request(id="cmpl-test", tenant="t", token_ids=list(range(4 * CHUNK + 5)), cached_tokens=cached,
                   policy="", ticket=Ticket(), arrived=time.perf_counter(), lookup_s=0.0)


def _sequence(chain: FakeChain, still_stored: int = 0) -> tuple[Any, CoordinatorMetrics, Any]:
    metrics = CoordinatorMetrics()
    cluster: Any = FakeCluster(chain)
    intake: Any = FakeIntake(still_stored)
    model: Any = type("Model", (), {"stage_layers": (range(0, 2), range(2, 4))})()
    config: Any = type("Config", (), {"stage_wait_s": 0.0})()
    restore = PrefixRestore(cluster, model, intake, metrics)
    return FirstTokenSequence(config, cluster, intake, restore, metrics), metrics, cluster


def _failures(metrics: CoordinatorMetrics) -> dict[str, float]:
    return {s.labels["cause"]: s.value for m in metrics.failures.collect() for s in m.samples
            if s.name.endswith("_total") and s.value}


PLAN = Plan(max_new_tokens=3, temperature=0.0, seed=0, stop_ids=frozenset())


def test_a_restore_that_fails_is_shortened_to_what_is_still_stored_then_dropped():
    chain = FakeChain(CORRUPT, CORRUPT)
    sequence, metrics, _ = _sequence(chain, still_stored=2 * CHUNK)
    request = _request()
    first = sequence.run(request, PLAN)
    assert first is not None and first.token == 7 and list(first.decodes) == [8, 9]
    assert chain.restores == [("boundary", 4 * CHUNK), ("boundary", 2 * CHUNK)]
    assert chain.prefills == [0] and request.cached_tokens == 0 and request.stages == []
    assert _failures(metrics) == {"stage1:restore-shortened": 1.0, "stage1:restore-recomputed": 1.0}


def test_missing_boundaries_restore_pipelined_and_count_no_failure():
    chain = FakeChain(MISSING)
    sequence, metrics, _ = _sequence(chain)
    request = _request()
    assert sequence.run(request, PLAN) is not None
    assert chain.restores == [("boundary", 4 * CHUNK), ("pipelined", 4 * CHUNK)]
    assert chain.prefills == [4 * CHUNK] and len(request.stages) == 2 and _failures(metrics) == {}


def test_a_stage_unreachable_before_the_first_token_is_waited_for_once():
    chain = FakeChain(None, DOWN)  # restored, then the prefill finds stage 0 down; the second try succeeds
    sequence, _, cluster = _sequence(chain)
    request = _request()
    assert sequence.run(request, PLAN) is not None
    assert cluster.down == [0] and cluster.waited == 1 and chain.released == ["cmpl-test"]
    assert len(chain.restores) == 2 and len(chain.prefills) == 2
    again = FakeChain(DOWN, DOWN)
    sequence, _, cluster = _sequence(again)
    with pytest.raises(ChainError) as failed:
        sequence.run(_request(), PLAN)
    assert failed.value is DOWN and cluster.waited == 1  # one more try, not two


def test_the_slot_is_left_once_the_first_token_is_there_or_the_request_failed():
    sequence, _, _ = _sequence(FakeChain())
    request = _request(cached=0)  # nothing to restore: the prompt is prefilled whole
    assert sequence.run(request, PLAN) is not None and sequence.intake.left == [request]
    failing, _, _ = _sequence(FakeChain(CORRUPT))  # the prefill fails
    with pytest.raises(ChainError):
        failing.run(request, PLAN)
    assert failing.intake.left == [request]


def _completion(first: FirstToken | None) -> tuple[Completion, list[str]]:
    events: list[str] = []
    return Completion(lambda: first, stop=lambda: events.append("stop"),
                      finish=lambda failure: events.append(f"finish:{type(failure).__name__}")), events


def test_a_completion_streams_the_first_token_then_the_decodes_and_finishes_once():
    completion, events = _completion(FirstToken(7, iter([8, 9])))
    assert list(completion) == [7, 8, 9]
    assert list(completion) == [] and events == ["finish:NoneType"]


def test_a_completion_aborted_before_it_started_stops_its_request_and_one_aborted_between_tokens_finishes():
    never, events = _completion(FirstToken(7, iter([8])))
    never.abort()
    assert list(never) == [] and events == ["stop"]
    midway, events = _completion(FirstToken(7, iter([8, 9])))
    assert next(midway) == 7
    midway.abort()
    midway.abort()
    assert list(midway) == [] and events == ["finish:NoneType"]


def test_a_completion_that_fails_finishes_with_its_failure():
    def fail() -> FirstToken:
        raise CORRUPT

    events: list[str] = []
    completion = Completion(fail, stop=lambda: events.append("stop"),
                            finish=lambda failure: events.append(f"finish:{type(failure).__name__}"))
    with pytest.raises(ChainError):
        next(completion)
    assert events == ["finish:ChainError"]


def test_a_completion_aborted_while_another_thread_waits_stops_the_request_and_that_thread_ends_it():
    waiting, release = threading.Event(), threading.Event()

    def first() -> FirstToken:
        waiting.set()
        release.wait(10)
        return FirstToken(7, iter([8]))

    events: list[str] = []

    def stop() -> None:
        events.append("stop")
        release.set()

    completion = Completion(first, stop=stop,
                            finish=lambda failure: events.append(f"finish:{type(failure).__name__}"))
    reader = threading.Thread(target=lambda: events.append(f"read:{list(completion)}"))
    reader.start()
    assert waiting.wait(10)
    completion.abort()
    reader.join(10)
    assert events == ["stop", "finish:NoneType", "read:[]"]


@pytest.fixture
def chain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[StageChain, list[Sampling]]]:
    """A chain whose forwards answer with the position they were sent to (no workers)."""
    issuer = GrantIssuer.from_dir(ensure_cluster_secrets(tmp_path), {"t": "pod-token"})
    stages = StageChain([], issuer=issuer)
    forwards: list[Sampling] = []

    def forward(sampling: Sampling, start: int, token_ids: list[int]) -> int:
        forwards.append(sampling)
        return start

    monkeypatch.setattr(stages, "_forward", forward)
    yield stages, forwards  # the chain, and what each forward was sent with
    stages.close()


def test_the_chain_prefills_then_decodes_until_the_token_count_or_a_stop_token(chain):
    chain, forwards = chain
    assert list(chain.stream("r", [1, 2, 3], start=10, tenant="t", max_new_tokens=4)) == [10, 13, 14, 15]
    stopped = chain.stream("r", [1, 2, 3], start=10, tenant="t", max_new_tokens=4, stop_ids=frozenset({13}))
    assert list(stopped) == [10, 13]
    assert list(chain.stream("r", [1, 2, 3], start=10, tenant="t", max_new_tokens=1)) == [10]
    assert {(s.reserve_tokens, s.held) for s in forwards} == {(7, 20), (4, 17)}  # new tokens + generated

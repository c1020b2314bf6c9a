"""The coordinator-worker messages refuse what neither end could serve."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cacheflow_common.stage_api import ForwardMeta, RestoreRequest, RestoreSummary


@pytest.mark.parametrize("request_id", ["", "a/b", "x" * 129, "sp ace"])
def test_a_request_id_must_be_a_safe_name(request_id):
    with pytest.raises(ValidationError, match="request_id"):
        RestoreRequest(request_id=request_id, tenant="t", token_ids=[1])


def test_restore_and_forward_need_tokens_and_a_known_input():
    with pytest.raises(ValidationError):
        RestoreRequest(request_id="r", tenant="t", token_ids=[])
    with pytest.raises(ValidationError):
        RestoreRequest.model_validate({"request_id": "r", "tenant": "t", "token_ids": [1], "input": "psychic"})
    with pytest.raises(ValidationError):
        ForwardMeta(request_id="r", start=-1, token_ids=[1])
    for seed in (-1, 1 << 31):  # a sampler seeded with seed * 1_000_003 + position must fit in 64 bits
        with pytest.raises(ValidationError):
            ForwardMeta(request_id="r", start=0, token_ids=[1], seed=seed)


def test_a_summary_round_trips_through_json():
    summary = RestoreSummary(request_id="r", stage=1, input="boundary", policy="cake", mode="token", elapsed_s=0.5,
                             computed=2, loaded=3, misses={"absent": 1})
    assert RestoreSummary.model_validate_json(summary.model_dump_json()) == summary


def test_the_workers_booleans_are_strict_json_booleans():
    from pydantic import ValidationError

    from cacheflow_common.stage_api import DeliverMeta, ForwardMeta

    base = {"request_id": "r", "start": 0, "token_ids": [1]}
    assert ForwardMeta.model_validate({**base, "save": False}).save is False
    for lax in ("yes", 1, "true"):
        with pytest.raises(ValidationError):
            ForwardMeta.model_validate({**base, "save": lax})
        with pytest.raises(ValidationError):
            DeliverMeta.model_validate({"request_id": "r", "finished": lax})


def test_a_stage_error_is_read_back_typed_and_a_foreign_error_page_keeps_its_text():
    from cacheflow_common.stage_api import StageError

    relayed = StageError(error="ConnectError", detail="unreachable (http://s2)", hops=2, unreachable=True)
    assert StageError.of_response(502, relayed.model_dump_json().encode()) == relayed
    foreign = StageError.of_response(504, b"<html>Gateway Timeout</html>")
    assert (foreign.error, foreign.hops, foreign.unreachable) == ("", 0, False)
    assert "HTTP 504" in foreign.detail and "Gateway Timeout" in foreign.detail

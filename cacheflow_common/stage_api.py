"""The protocol between the coordinator and the stage workers: one set of typed messages, used by both ends.

The worker's HTTP API validates what it receives with these models and answers with them; the
coordinator's stage client (`cacheflow_services.coordinator.stage_chain`) builds its requests and reads the
answers with the same models, so a field renamed on one side fails on the other at once.

    POST /v1/restore   RestoreRequest  -> RestoreSummary
    POST /v1/forward   ForwardMeta (+ hidden states, a tensor frame) -> ForwardAnswer (the last stage's token)
    POST /v1/deliver   DeliverMeta (+ hidden states)                 -> {"ok": true}
    GET  /v1/info      -> WorkerInfo
    any 4xx or 5xx     -> StageError (which stage failed, how, and whether it could be reached)

Every call carries the cluster's internal token (`Authorization: Bearer`) and a grant in the
`X-CacheFlow-Grant` header (`cacheflow_common.auth`): the coordinator's signed word that it allows this
call (operation, stage, request, tenant, tokens), good once. A stage relays a forward's grant to the
next stage unchanged; a pipelined restore's deliveries carry the `deliver_grant` its restore call brought.

Pydantic, the services' validation library, is needed here (the `services` extra installs it).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, Field, StrictBool

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_PROMPT_TOKENS = 1 << 20
MAX_GRANT_CHARS = 4096
SEED_LIMIT = 1 << 31  # a sampler is seeded with seed * 1_000_003 + position: this keeps it within 64 bits
InputMode = Literal["boundary", "pipelined", "sequential"]


def _request_id(value: str) -> str:
    if not REQUEST_ID.fullmatch(value):
        raise ValueError("request_id: 1-128 characters of [A-Za-z0-9._:-]")
    return value


RequestId = Annotated[str, AfterValidator(_request_id)]


class RestoreRequest(BaseModel):
    """Restore a cached prefix on a stage's layers; the KV stays held for the request's later forwards."""

    request_id: RequestId
    tenant: str
    token_ids: list[int] = Field(min_length=1, max_length=MAX_PROMPT_TOKENS)
    input: InputMode = "boundary"
    reserve_tokens: int = Field(default=0, ge=0)  # room for the suffix and the tokens to generate
    policy: str = ""  # "": the worker's configured policy
    waited_s: float = Field(default=0.0, ge=0.0)  # since the request reached the coordinator (channel rankings
    # that weigh waiting count from then)
    # a grant for the deliveries to the next stage (a pipelined restore's, "" on the last stage)
    deliver_grant: str = Field(default="", max_length=MAX_GRANT_CHARS)


class RestoreSummary(BaseModel):
    """What one stage did for a restore."""

    request_id: str
    stage: int
    input: InputMode
    policy: str  # the policy actually used
    fallback: str = ""  # why it differs from the one asked for ("" when it does not)
    mode: Literal["token", "layer"]
    elapsed_s: float  # admitted to the engine -> the pointers met
    computed: int  # units recomputed
    loaded: int  # units loaded from storage
    misses: dict[str, int] = Field(default_factory=dict)  # loads that missed, by reason (recomputed)
    bytes_loaded: int = 0
    boundary_bytes_read: int = 0
    bytes_unused: int = 0  # of bytes_loaded, those no unit kept (a load that missed after reading part of its unit)
    predicted_recompute_s: float = 0.0  # the profile's seconds to compute every unit here (0: no profile)


class ForwardMeta(BaseModel):
    """New tokens of a request through the stage (a prompt's prefill, or one decode token)."""

    request_id: RequestId
    start: int = Field(ge=0)  # position of the first new token
    token_ids: list[int] = Field(min_length=1, max_length=MAX_PROMPT_TOKENS)
    tenant: str = ""
    reserve_tokens: int = Field(default=0, ge=0)
    save: StrictBool = True  # store whole chunks as they fill up (JSON true/false only)
    temperature: float = Field(default=0.0, ge=0.0)
    seed: int = Field(default=0, ge=0, lt=SEED_LIMIT)


class DeliverMeta(BaseModel):
    """The previous stage's output for one chunk of a pipelined restore, or the end of its deliveries."""

    request_id: str
    index: int = Field(default=0, ge=0)
    finished: StrictBool = False
    failure: str = ""


class BusyTotals(BaseModel):
    """Seconds the compute loop and each storage channel have been busy since the worker started."""

    uptime_s: float
    compute_s: float
    channels_s: list[float]


class WorkerInfo(BaseModel):
    stage: int
    layers: tuple[int, int]
    last_stage: bool
    model: str  # the model's fingerprint
    chunk_size: int
    dtype: str
    pool_blocks: int
    block_tokens: int
    vocab_size: int
    max_tokens: int
    policy: str
    step_tokens: int
    busy: BusyTotals
    kv_heads: int = 0  # the model's KV heads (0: not said; chunks split by heads are then not looked up)


class ForwardAnswer(BaseModel):
    """What a forward comes back with, from the last stage through every stage before it."""

    token: int  # the next token, sampled by the last stage


class StageError(BaseModel):
    """A stage's error answer. A stage that fails because one further down the pipeline did relays that
    stage's error with `hops` one higher, so the caller names the stage that failed, not the first on
    the way."""

    error: str  # the failing stage's error type, e.g. "BoundaryMissingError" ("" if it never answered)
    detail: str
    hops: int = Field(default=0, ge=0)  # 0: the answering stage failed; n: the stage n further down did
    unreachable: bool = False  # that stage could not be reached (down, or restarting)

    @classmethod
    def of_response(cls, status: int, body: bytes) -> StageError:
        """The error in an HTTP error answer; a body that is not one (a proxy's page) is kept as the detail."""
        try:
            return cls.model_validate_json(body)
        except ValueError:
            return cls(error="", detail=f"HTTP {status}: {body[:500].decode(errors='replace')}")

"""The OpenAI-compatible request bodies and responses (completions and chat completions).

CacheFlow extensions, all optional: `policy` (the restore policy: compute-only, load-only, cake,
cacheflow, ...), `save`, `ignore_eos`, `stop_token_ids`; every response carries a `cacheflow` object with
the request's TTFT, how many prompt tokens were restored from storage, its batch and per-stage restores.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field

from cacheflow_common.errors import CacheFlowError

MAX_PROMPT_TOKENS = 1 << 20


class SamplingBody(BaseModel):
    """What completions and chat completions share."""

    model: str
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    seed: int = 0
    stream: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    policy: str = ""
    save: bool = True  # store the new chunks (off: leave storage as it is, e.g. to replay a trace per policy)


class CompletionBody(SamplingBody):
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int = Field(default=16, ge=1)


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatBody(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def new_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 256


class RestoreBody(BaseModel):
    token_ids: list[int] | None = Field(default=None, min_length=1, max_length=MAX_PROMPT_TOKENS)
    prompt: str | None = None  # text, when the model has a tokenizer
    policy: str = ""


@dataclass
class Output:
    """What a completion produced so far; `text` is cut at a stop string."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    ttft_s: float = 0.0


def stop_strings(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else [s for s in (stop or []) if s]


def choice(kind: str, output: Output, *, delta: str | None = None, new_ids: list[int] | None = None,
           finished: bool = True) -> dict[str, Any]:
    """One `choices` entry; `delta` set: a streamed chunk's (with the `new_ids` it adds)."""
    reason = output.finish_reason if finished else None
    if kind == "chat":
        body = {"delta": {"content": delta}} if delta is not None else {
            "message": {"role": "assistant", "content": output.text}}
        return {"index": 0, **body, "finish_reason": reason}
    text, ids = (delta, new_ids) if delta is not None else (output.text, output.token_ids)
    return {"index": 0, "text": text, "token_ids": ids, "logprobs": None, "finish_reason": reason}


def response(kind: str, request_id: str, model: str, created: int, output: Output, prompt_tokens: int,
             extra: dict[str, Any]) -> dict[str, Any]:
    return {"id": request_id, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": created, "model": model, "choices": [choice(kind, output)],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(output.token_ids),
                      "total_tokens": prompt_tokens + len(output.token_ids)},
            "cacheflow": extra}


def sse(kind: str, request_id: str, model: str, created: int, deltas: Iterator[tuple[str, Output, bool]],
        extra: Callable[[Output], dict[str, Any]]) -> Iterator[str]:
    """Server-sent events of a streamed completion; `deltas` yields (new text, output so far, finished).

    A failure after the stream began (the status line is sent) becomes an `error` event before [DONE].
    """
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    sent = 0  # tokens streamed so far
    try:
        for delta, output, finished in deltas:
            new_ids, sent = output.token_ids[sent:], len(output.token_ids)
            chunk: dict[str, Any] = {"id": request_id, "object": obj, "created": created, "model": model,
                                     "choices": [choice(kind, output, delta=delta, new_ids=new_ids, finished=finished)]}
            if finished:
                chunk["cacheflow"] = extra(output)
            yield f"data: {json.dumps(chunk)}\n\n"
    except CacheFlowError as exc:
        yield f"data: {json.dumps({'error': {'message': str(exc), 'type': type(exc).__name__}})}\n\n"
    yield "data: [DONE]\n\n"


def now() -> int:
    return int(time.time())

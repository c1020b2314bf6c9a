"""The OpenAI-compatible request bodies and responses (completions and chat completions).

CacheFlow extensions, all optional: `policy` (the restore policy: compute-only, load-only, cake,
cacheflow, ...), `save`, `ignore_eos`, `stop_token_ids`; every response carries a `cacheflow` object with
the request's TTFT, how many prompt tokens were restored from storage, its batch and per-stage restores.
A stream takes `stream_options` (`include_usage`, and vLLM's `continuous_usage_stats`) as OpenAI and vLLM do.

What is not implemented is refused, not ignored (as vLLM refuses what it does not support): an OpenAI
field this server does not implement is accepted only at the value that asks for nothing (`n: 1`,
`logprobs: null`, ...), and any field it does not know is refused (400 naming it). Token ids are
strict integers (JSON `true` is not token 1) and booleans strict JSON booleans (`"yes"` or `1` is not
`true`), text must be valid Unicode (no lone surrogates), and a
seed lies in [0, 2**31) (the workers seed each position's sampler with seed * 1_000_003 + position,
which must stay a 64-bit integer).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    Tag,
    model_validator,
)
from pydantic_core import PydanticCustomError

from cacheflow_common.errors import CacheFlowError
from cacheflow_common.stage_api import SEED_LIMIT
from cacheflow_services.coordinator.errors import kind_of

MAX_PROMPT_TOKENS = 1 << 20


def _unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError("unicode", "not valid Unicode text: a lone surrogate ({bad}) at {at}",
                                  {"bad": repr(exc.object[exc.start : exc.end]), "at": exc.start}) from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]
TokenIds = list[StrictInt]
# text or token ids, told apart by the JSON type, so that an error names what is wrong with the one sent
Prompt = Annotated[Annotated[Text, Field(min_length=1), Tag("text")] |
                   Annotated[TokenIds, Field(min_length=1), Tag("token_ids")],
                   Discriminator(lambda v: "text" if isinstance(v, str) else "token_ids")]

# OpenAI (and vLLM) fields this server does not implement, with the values that ask for nothing (None
# always does); any other value is refused with the field's name.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (False,), "top_logprobs": (0,), "suffix": ("",),
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
    "top_p": (1,), "top_k": (-1, 0), "min_p": (0,), "min_tokens": (0,), "tools": ([],), "functions": ([],),
    "tool_choice": ("none",), "function_call": ("none",), "parallel_tool_calls": (True, False),
    "response_format": ({"type": "text"},),
}
IGNORED = frozenset({"user"})  # no effect on the output by design (OpenAI's abuse monitoring)


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    return value is None or any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`: `include_usage` adds a last chunk with the usage (and `usage: null` on the
    others); vLLM's `continuous_usage_stats` puts the usage so far on every chunk instead of null."""

    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class SamplingBody(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    seed: StrictInt = Field(default=0, ge=0, lt=SEED_LIMIT)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None  # only with stream: true (as OpenAI and vLLM refuse it otherwise)
    stop: Text | list[Text] | None = None
    stop_token_ids: TokenIds = Field(default_factory=list)
    ignore_eos: StrictBool = False
    policy: str = ""
    save: StrictBool = True  # store the new chunks (off: leave storage as it is, e.g. to replay a trace per policy)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        """Drop the unimplemented fields that ask for nothing; refuse the others, naming them."""
        if not isinstance(data, dict):
            return data
        for name in sorted(NEUTRAL.keys() & data.keys()):
            if not _neutral(data[name], NEUTRAL[name]):
                allowed = " or ".join(json.dumps(v) for v in (None, *NEUTRAL[name]))
                raise PydanticCustomError("unsupported", "{name} = {value} is not supported by this server "
                                          "(only {allowed})", {"name": name, "value": json.dumps(data[name])[:80],
                                                               "allowed": allowed})
        return {k: v for k, v in data.items() if k not in NEUTRAL and k not in IGNORED}

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> SamplingBody:
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError("stream_options", "stream_options is only allowed with stream: true", {})
        return self


class CompletionBody(SamplingBody):
    prompt: Prompt
    max_tokens: StrictInt = Field(default=16, ge=1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: Text


class ChatBody(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)

    def new_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 256


class RestoreBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token_ids: TokenIds | None = Field(default=None, min_length=1, max_length=MAX_PROMPT_TOKENS)
    prompt: Text | None = None  # text, when the model has a tokenizer
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
            "usage": usage(prompt_tokens, output), "cacheflow": extra}


def usage(prompt_tokens: int, output: Output) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": len(output.token_ids),
            "total_tokens": prompt_tokens + len(output.token_ids)}


@dataclass(frozen=True)
class StreamHead:
    """What every chunk of one streamed completion repeats, and what its usage needs."""

    kind: str
    request_id: str
    model: str
    created: int
    prompt_tokens: int
    options: StreamOptions | None = None

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def usage_of(self, output: Output) -> dict[str, int] | None:
        """A content chunk's `usage`: null, or the usage so far with `continuous_usage_stats`."""
        continuous = self.options is not None and self.options.continuous_usage_stats
        return usage(self.prompt_tokens, output) if continuous else None

    @property
    def include_usage(self) -> bool:
        return self.options is not None and self.options.include_usage


def sse(head: StreamHead, deltas: Iterator[tuple[str, Output, bool]],
        extra: Callable[[Output], dict[str, Any]]) -> Iterator[str]:
    """Server-sent events of a streamed completion; `deltas` yields (new text, output so far, finished).

    With `include_usage`, every chunk carries `usage` (null, or the usage so far with
    `continuous_usage_stats`) and one more chunk, with no choices and the usage, comes before [DONE], as
    OpenAI and vLLM send them. A failure after the stream began (the status line is sent) becomes an
    event with the error in OpenAI's envelope (`errors.py`, as a non-streamed answer has it) before [DONE].
    """
    sent = 0  # tokens streamed so far
    output = Output()
    try:
        for delta, output, finished in deltas:
            new_ids, sent = output.token_ids[sent:], len(output.token_ids)
            chunk = head.chunk([choice(head.kind, output, delta=delta, new_ids=new_ids, finished=finished)])
            if head.include_usage:
                chunk["usage"] = head.usage_of(output)
            if finished:
                chunk["cacheflow"] = extra(output)
            yield f"data: {json.dumps(chunk)}\n\n"
        if head.include_usage:
            yield f"data: {json.dumps({**head.chunk([]), 'usage': usage(head.prompt_tokens, output)})}\n\n"
    except CacheFlowError as exc:
        yield f"data: {json.dumps(kind_of(exc).body(str(exc)))}\n\n"
    yield "data: [DONE]\n\n"


def now() -> int:
    return int(time.time())

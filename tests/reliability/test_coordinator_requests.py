"""The coordinator refuses what it cannot serve with a 4xx and its reason, before the request holds a
batch slot, and a request abandoned by its client holds none either: real storage pods, stage workers
and coordinators (tiny model) on loopback. The test that kills a stage worker runs last."""

from __future__ import annotations

import json
import random
import secrets
import socket
from collections.abc import Iterator

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from cacheflow_services.coordinator.launch import LocalCoordinator
from cacheflow_services.coordinator.tokenizer import tokenizer_dir
from cacheflow_services.local_cluster import LocalCluster
from tests.reliability.coordinator_checks import (
    api_client,
    local_file,
    metric,
    post,
    samples,
    second_coordinator,
    small_cluster,
    wait_for,
)

CHUNK = 32
MAX_BATCH = 4
MODEL = "tiny"


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from small_cluster(tmp_path_factory, max_batch=MAX_BATCH)


@pytest.fixture(scope="module")
def client(local: LocalCluster) -> Iterator[httpx.Client]:
    yield from api_client(local)


GHOST_TOKEN = secrets.token_urlsafe(16)


@pytest.fixture(scope="module")
def texts(local: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCoordinator]:
    """A second coordinator with SmolLM2's tokenizer (text prompts) and a tenant, `ghost`, whose pod token
    the storage pods do not know."""
    workdir = tmp_path_factory.mktemp("texts")
    pod_tokens, api_tokens = workdir / "pod-tokens", workdir / "api-tokens"
    pod_tokens.write_text(local_file(local, "pod-tokens").read_text() + f"ghost {secrets.token_urlsafe(24)}\n")
    api_tokens.write_text(local_file(local, "api-tokens").read_text() + f"ghost {GHOST_TOKEN}\n")
    directory = tokenizer_dir("smollm2")
    assert directory is not None
    coordinator = second_coordinator(local, workdir, "--tokenizer", str(directory), pod_token_file=pod_tokens,
                                     token_file=api_tokens)
    yield coordinator
    coordinator.stop()


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def _body(**extra: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": _prompt(40, seed=1), "max_tokens": 2, **extra}


def _slots_free(url: str) -> bool:
    return metric(url, "cacheflow_coordinator_slots_held") == 0 and metric(url, "cacheflow_queue_depth") == 0


def test_more_refused_requests_than_slots_then_a_good_one_is_served(client, local):
    refused = [
        (_body(seed=10**14, temperature=0.7), "seed"),  # was a 502 blamed on a stage: the sampler's seed overflowed
        (_body(policy="fastest"), "unknown policy"),
        (_body(n=2), "n = 2 is not supported"),
        (_body(prompt=[1, True]), "prompt.token_ids.1"),
        (_body(max_tokens=10**6), "max_tokens"),
        (_body(stop_token_ids=[5, 4096]), "stop_token_ids: token id 4096 is out of the model's vocabulary"),
        (_body(stop_token_ids=[-1]), "stop_token_ids: token id -1 is out of the model's vocabulary"),
    ]
    for body, reason in refused:
        for _ in range(MAX_BATCH + 2):
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 400 and reason in r.json()["error"]["message"], (body, r.text)
    assert client.post("/v1/completions", json=_body()).status_code == 200
    assert _slots_free(local.coordinator.url)


def test_streamed_requests_whose_client_left_before_the_answer_hold_no_slot(client, local):
    body = json.dumps({"model": MODEL, "prompt": _prompt(200, seed=2), "max_tokens": 4, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {local.token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    port = int(local.coordinator.url.rsplit(":", 1)[1])
    for _ in range(MAX_BATCH + 2):  # each leaked slot would stay held: these alone would lock the coordinator up
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(head + body)  # and gone, before any answer
    r = client.post("/v1/completions", json=_body(), timeout=90)
    assert r.status_code == 200, r.text
    wait_for(lambda: _slots_free(local.coordinator.url), "every batch slot free again")


def test_a_seed_must_keep_the_samplers_seed_a_64_bit_integer(client):
    r = client.post("/v1/completions", json=_body(seed=1 << 31, temperature=0.7))
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    assert str(1 << 31) in r.json()["error"]["message"]
    assert client.post("/v1/completions", json=_body(seed=(1 << 31) - 1, temperature=0.7)).status_code == 200


@pytest.mark.parametrize(("refused", "field", "neutral"), [
    ({"n": 2}, "n = 2", {"n": 1}), ({"best_of": 3}, "best_of = 3", {"best_of": None}),
    ({"logprobs": 1}, "logprobs = 1", {"logprobs": None}), ({"echo": True}, "echo = true", {"echo": False}),
    ({"top_p": 0.5}, "top_p = 0.5", {"top_p": 1.0}), ({"suffix": "end"}, "suffix", {"suffix": None}),
    ({"presence_penalty": 0.5}, "presence_penalty", {"presence_penalty": 0}),
    ({"logit_bias": {"1": 5}}, "logit_bias", {"logit_bias": {}}),
    ({"stream_options": {"include_usage": True}}, "stream_options is only allowed with stream: true",
     {"stream_options": None}),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage",
     {"stream": True, "stream_options": {"include_usage": False}}),
    ({"stream": True, "stream_options": {"usage": True}}, "stream_options.usage", {"stream": True}),
    ({"frobnicate": 1}, "frobnicate", {"user": "someone"}),
    ({"stop_token_ids": [True]}, "stop_token_ids.0", {"stop_token_ids": [1]}),
    ({"max_tokens": True}, "max_tokens", {"max_tokens": 1}),
    ({"save": "yes"}, "save: Input should be a valid boolean", {"save": False}),
    ({"ignore_eos": 1}, "ignore_eos: Input should be a valid boolean", {"ignore_eos": True}),
    ({"stream": "false"}, "stream: Input should be a valid boolean", {"stream": False}),
])
def test_fields_this_server_does_not_implement_are_refused_by_name(client, refused, field, neutral):
    r = client.post("/v1/completions", json=_body(**refused))
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    assert client.post("/v1/completions", json=_body(**neutral)).status_code == 200  # asks for nothing: served


def test_booleans_are_not_token_ids_in_a_restore(client):
    r = client.post("/v1/restore", json={"token_ids": [1, 2, True]})
    assert r.status_code == 400 and "token_ids.2" in r.json()["error"]["message"], r.text


def test_a_body_over_the_limit_gets_413_naming_it_with_or_without_a_length(client):
    limit = 8 << 20  # the default
    big = json.dumps(_body(prompt=[1] * (limit // 2))).encode()  # 2 bytes per token id: over the limit
    declared = client.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert declared.status_code == 413 and str(limit) in declared.json()["error"]["message"], declared.text[:300]

    def chunked() -> Iterator[bytes]:
        for i in range(0, len(big), 1 << 16):
            yield big[i : i + (1 << 16)]

    streamed = client.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"})
    assert streamed.status_code == 413 and str(limit) in streamed.json()["error"]["message"], streamed.text[:300]
    assert client.post("/v1/completions", json=_body()).status_code == 200


def _status_of_headers_only(url: str, head: str) -> bytes:
    """The status line answered to a request's head alone: its body is declared but never sent."""
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head.encode())
        return s.recv(4096).split(b"\r\n", 1)[0]


@pytest.mark.parametrize("declared", [1000, 9 << 20])  # within the body limit (8 MiB), and over it
@pytest.mark.parametrize("authorization", ["", "Authorization: Bearer wrong\r\n"])
def test_no_token_is_a_401_before_any_of_the_body_is_read(local, declared, authorization):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{authorization}Content-Type: application/json\r\n"
            f"Content-Length: {declared}\r\n\r\n")
    assert _status_of_headers_only(local.coordinator.url, head) == b"HTTP/1.1 401 Unauthorized"


def test_no_token_with_a_malformed_body_is_a_401_and_a_token_makes_it_a_400(local):
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/restore"):
        r = post(local.coordinator.url, "wrong", path, content=b"{not json")
        assert r.status_code == 401 and r.json()["error"]["message"] == "missing or wrong bearer token", r.text
        assert r.headers["WWW-Authenticate"] == "Bearer"
        assert post(local.coordinator.url, local.token, path, content=b"{not json").status_code == 400


def test_a_lone_surrogate_in_text_is_a_400_with_the_reason(local, texts):
    for path, raw in [("/v1/completions", rb'{"model": "tiny", "prompt": "abc\ud800", "max_tokens": 2}'),
                      ("/v1/chat/completions",
                       rb'{"model": "tiny", "messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 2}')]:
        r = post(texts.url, local.token, path, content=raw)
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text


def test_a_text_too_long_for_the_context_is_refused_before_it_is_tokenized(local, texts):
    context = httpx.get(f"{texts.url}/v1/models", headers={"Authorization": f"Bearer {local.token}"}).json()
    max_tokens = context["data"][0]["max_model_len"]
    directory = tokenizer_dir("smollm2")
    assert directory is not None
    longest_piece = max(map(len, AutoTokenizer.from_pretrained(str(directory)).get_vocab()))  # no normalizer
    bound = max_tokens * longest_piece  # more characters than this need more tokens than the context holds
    r = post(texts.url, local.token, "/v1/completions", {"model": MODEL, "prompt": "a" * (bound + 1)})
    assert r.status_code == 400, r.text
    assert f"a text of {bound + 1} characters cannot fit" in r.json()["error"]["message"], r.text


def test_a_tenant_the_storage_pods_refuse_gets_403(texts):
    r = post(texts.url, GHOST_TOKEN, "/v1/completions", _body())
    assert r.status_code == 403 and "refuse tenant 'ghost'" in r.json()["error"]["message"], r.text
    assert _slots_free(texts.url)


def _sdk(url: str, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0, timeout=120.0)


def test_the_openai_sdk_streams_a_completion_with_its_usage_last(local):
    stream = _sdk(local.coordinator.url, local.token).completions.create(
        model=MODEL, prompt=_prompt(40, seed=4), max_tokens=3, stream=True, stream_options={"include_usage": True})
    *content, last = list(stream)
    assert content and all(c.usage is None and len(c.choices) == 1 for c in content), content
    assert content[-1].choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage is not None, last
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (40, 3, 43)


def test_the_openai_sdk_shows_the_servers_reason_on_a_400_a_401_and_a_404(local):
    sdk = _sdk(local.coordinator.url, local.token)
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model=MODEL, prompt=_prompt(40, seed=5), max_tokens=2, seed=1 << 31)
    assert "seed" in str(bad.value) and str(1 << 31) in bad.value.message, bad.value
    assert (bad.value.type, bad.value.code, bad.value.param) == ("invalid_request_error", "invalid_value", "seed")
    with pytest.raises(openai.BadRequestError) as unsupported:
        sdk.completions.create(model=MODEL, prompt=_prompt(40, seed=5), max_tokens=2, n=2)
    assert "n = 2 is not supported by this server" in str(unsupported.value)
    assert (unsupported.value.code, unsupported.value.param) == ("unsupported_value", "n")
    with pytest.raises(openai.AuthenticationError) as refused:
        _sdk(local.coordinator.url, "not-a-token").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert "missing or wrong bearer token" in str(refused.value), refused.value
    assert (refused.value.type, refused.value.code) == ("authentication_error", "invalid_api_key")
    with pytest.raises(openai.NotFoundError) as unknown:
        sdk.completions.create(model="gpt-4o", prompt=_prompt(40, seed=5), max_tokens=2)
    assert "'gpt-4o' is not served here" in str(unknown.value) and unknown.value.code == "model_not_found"


@pytest.mark.parametrize(("method", "path", "status", "code"), [
    ("GET", "/v1/restore/rst-nope", 404, "restore_not_found"),
    ("DELETE", "/v1/restore/rst-nope", 404, "restore_not_found"),
    ("POST", "/v1/restore", 400, "invalid_request"),  # neither token_ids nor prompt
    ("GET", "/v1/nowhere", 404, "unknown_url"),
    ("PUT", "/v1/completions", 405, "method_not_allowed"),
])
def test_the_restore_api_and_unknown_urls_answer_in_the_same_envelope(client, method, path, status, code):
    r = client.request(method, path, json={} if method == "POST" else None)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["code"] == code, error


def _series(url: str) -> list[str]:
    """The lines of the process's /metrics without their values: one per series, and the HELP/TYPE lines."""
    return [line.rsplit(" ", 1)[0] if not line.startswith("#") else line
            for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines()]


def test_unknown_restore_ids_and_paths_do_not_grow_the_metrics(client, local):
    url = local.coordinator.url
    wrong_token = {"Authorization": "Bearer wrong"}

    def refusals(n: int, salt: str) -> None:
        for i in range(n):
            assert client.get(f"/v1/restore/rst-{salt}{i}").status_code == 404
            assert client.delete(f"/v1/restore/rst-{salt}{i}").status_code == 404
        for i in range(max(1, n // 20)):
            assert client.get(f"/v1/no-such-{salt}{i}").status_code == 404
            assert httpx.get(f"{url}/v1/restore/rst-{salt}{i}", headers=wrong_token).status_code == 401
            assert httpx.get(f"{url}/v1/elsewhere-{salt}{i}", headers=wrong_token).status_code == 401

    refusals(1, "warm")  # each kind of refusal once: its series exist now
    before = _series(url)
    refusals(100, "x")
    after = _series(url)
    assert len(after) == len(before) and set(after) == set(before), sorted(set(after) ^ set(before))
    counted = {(labels["route"], labels["status"]): value
               for labels, value in samples(url, "cacheflow_requests_total")}
    assert counted[("/v1/restore/{restore_id}", "404")] >= 2 * 101  # counted, under the route's template
    assert counted[("/v1/restore/{restore_id}", "401")] >= 6 and counted[("unmatched", "401")] >= 6
    assert counted[("unmatched", "404")] >= 6


def _events(client: httpx.Client, body: dict[str, object]) -> list[str]:
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        return [e[len("data: "):] for e in r.iter_lines() if e.startswith("data: ")]


def test_a_stream_says_usage_null_on_every_chunk_but_the_last_or_the_usage_so_far_continuously(client):
    body = _body(max_tokens=3, stream=True, stream_options={"include_usage": True})
    *chunks, done = _events(client, body)
    usages = [json.loads(c)["usage"] for c in chunks]
    assert done == "[DONE]" and usages[:-1] == [None] * 4, chunks  # a chunk per token, then the finished one
    assert usages[-1] == {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43}
    continuous = _body(max_tokens=3, stream=True, stream_options={"include_usage": True,
                                                                  "continuous_usage_stats": True})
    usages = [json.loads(c)["usage"] for c in _events(client, continuous)[:-1]]
    assert [u["completion_tokens"] for u in usages] == [1, 2, 3, 3, 3], usages
    assert all(u["prompt_tokens"] == 40 and u["total_tokens"] == 40 + u["completion_tokens"] for u in usages)
    plain = [json.loads(c) for c in _events(client, _body(max_tokens=3, stream=True))[:-1]]
    assert all("usage" not in c for c in plain), plain  # not asked for: as before


def test_a_stage_that_dies_mid_request_is_the_stage_named(client, local):
    body = _body(prompt=_prompt(50, seed=3), max_tokens=4000, stream=True)
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = r.iter_lines()
        first = next(e for e in events if e.startswith("data: "))
        assert json.loads(first[len("data: "):])["choices"][0]["token_ids"]
        local.workers[1].kill()  # stage 0 is alive: it is what the coordinator calls, stage 1 is what failed
        errors = [json.loads(e[len("data: "):])["error"] for e in events
                  if e.startswith("data: ") and '"error"' in e]
    assert len(errors) == 1 and errors[0]["message"].startswith("stage 1: unreachable"), errors
    assert (errors[0]["type"], errors[0]["code"]) == ("server_error", "stage_failed")
    failures = {labels["cause"] for labels, value in samples(local.coordinator.url, "cacheflow_failures_total")
                if value}
    assert failures == {"stage1:unreachable"}, failures  # the stage that failed, and how

"""The cluster's internal credentials (`cacheflow_common.auth`): grants only the coordinator can make,
pod credentials only a tenant's token can make, both bounded in time."""

from __future__ import annotations

import base64
import dataclasses
import json
import time

import pytest

from cacheflow_common.auth import (
    GRANT_TTL_S,
    Grant,
    GrantError,
    GrantIssuer,
    GrantSigner,
    GrantVerifier,
    ensure_cluster_secrets,
    generate_signing_pair,
    input_digest,
    pod_credential,
    pod_credential_expiry,
    pod_credential_tenant,
    read_secret,
    tenant_of_token,
)
from cacheflow_common.errors import ConfigError
from cacheflow_services.http_limits import bearer_token
from cacheflow_services.worker.trust import SpentGrants


def _grant(**changes: object) -> Grant:
    base = Grant(op="restore", stages=(0, 1), request_id="r1", tenant="acme", digest=input_digest([1, 2, 3]),
                 nonce="n1", save=True, max_tokens=512, expires_at=time.time() + 60, pod_credential="")
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def keys() -> tuple[GrantSigner, GrantVerifier]:
    private, public = generate_signing_pair()
    return GrantSigner(private), GrantVerifier(public)


def test_a_signed_grant_verifies_to_what_was_signed(keys):
    signer, verifier = keys
    grant = _grant()
    assert verifier.verify(signer.sign(grant)) == grant


def test_a_grant_from_another_key_altered_expired_or_missing_is_refused(keys):
    signer, verifier = keys
    other = GrantSigner(generate_signing_pair()[0])
    with pytest.raises(GrantError, match="not signed"):
        verifier.verify(other.sign(_grant()))
    signature = signer.sign(_grant()).partition(".")[2]
    forged = json.dumps({**dataclasses.asdict(_grant()), "tenant": "victim"}, sort_keys=True,
                        separators=(",", ":")).encode()
    altered = base64.urlsafe_b64encode(forged).rstrip(b"=").decode() + "." + signature
    with pytest.raises(GrantError, match="not signed"):
        verifier.verify(altered)
    with pytest.raises(GrantError, match="expired"):
        verifier.verify(signer.sign(_grant(expires_at=time.time() - 3600)))
    with pytest.raises(GrantError, match="no grant"):
        verifier.verify("")
    with pytest.raises(GrantError):
        verifier.verify("not.a-grant")


def test_a_grant_is_for_one_operation_on_its_stages_for_one_request_of_one_tenant_and_its_tokens():
    grant = _grant()
    grant.allows("restore", 1)
    grant.check(request_id="r1", tenant="acme", digest=input_digest([1, 2, 3]))
    with pytest.raises(GrantError, match="not forward on stage 0"):
        grant.allows("forward", 0)
    with pytest.raises(GrantError, match="not restore on stage 2"):
        grant.allows("restore", 2)
    with pytest.raises(GrantError, match="not 'r2' of 'acme'"):
        grant.check(request_id="r2", tenant="acme", digest=grant.digest)
    with pytest.raises(GrantError):
        grant.check(request_id="r1", tenant="other", digest=grant.digest)
    for other in ([1, 2, 4], [1, 2]):
        with pytest.raises(GrantError, match="other tokens"):
            grant.check(request_id="r1", tenant="acme", digest=input_digest(other))
    with pytest.raises(GrantError, match="other tokens"):  # the same tokens with more room, or at another place
        grant.check(request_id="r1", tenant="acme", digest=input_digest([1, 2, 3], reserve=1))
    assert input_digest([1, 2, 3], start=4) != input_digest([1, 2, 3])


def test_a_grant_is_good_once_and_forgotten_only_after_it_expires():
    spent = SpentGrants()
    first, second = _grant(nonce="a"), _grant(nonce="b", expires_at=time.time() - 3600)
    spent.spend(first)
    with pytest.raises(GrantError, match="used before"):
        spent.spend(first)
    spent.spend(second)  # long expired (a verifier refuses it anyway): forgotten at the next spend
    spent.spend(_grant(nonce="c"))
    assert spent.spent(first) and not spent.spent(second) and len(spent) == 2


def test_a_verifying_key_cannot_sign_and_a_signing_key_is_not_a_verifying_key():
    private, public = generate_signing_pair()
    with pytest.raises(ConfigError, match="private key"):
        GrantSigner(public)
    with pytest.raises(ConfigError, match="public key"):
        GrantVerifier(private)


def test_a_pod_credential_names_its_tenant_only_for_a_holder_of_that_tenants_token():
    tokens = {"tok-acme": "acme", "tok-rival": "rival"}
    credential = pod_credential("acme", "tok-acme", time.time() + 60)
    assert pod_credential_tenant(credential, tokens) == "acme"
    assert pod_credential_tenant(credential, {"tok-rival": "rival"}) is None  # the pod does not know acme
    made_by_rival = pod_credential("acme", "tok-rival", time.time() + 60)  # rival's token, claiming acme
    assert pod_credential_tenant(made_by_rival, tokens) is None
    expired = pod_credential("acme", "tok-acme", time.time() - 3600)
    assert pod_credential_tenant(expired, tokens) is None
    assert pod_credential_tenant("tok-acme", tokens) is None  # a plain token is not a credential
    payload, _, mac = credential.partition(".")[2].partition(".")
    assert pod_credential_tenant(f"cfpod1.{payload}.{'0' * len(mac)}", tokens) is None
    assert pod_credential_expiry(credential) > time.time() + 59
    assert pod_credential_expiry("tok-acme") == float("inf")


def test_the_issuer_grants_a_fresh_pod_credential_for_the_requests_tenant(tmp_path):
    secrets = ensure_cluster_secrets(tmp_path / "internal")
    issuer = GrantIssuer.from_dir(secrets, {"acme": "tok-acme"})
    verifier = GrantVerifier(read_secret(secrets / "grant-verify-key.pem", "key"))
    grant = verifier.verify(issuer.issue("restore", stages=[1], request_id="r9", tenant="acme", max_tokens=100))
    assert (grant.op, grant.stages, grant.request_id, grant.tenant, grant.save, grant.max_tokens) == (
        "restore", (1,), "r9", "acme", False, 100)
    assert time.time() < grant.expires_at <= time.time() + GRANT_TTL_S  # one call's time, not minutes
    assert pod_credential_tenant(grant.pod_credential, {"tok-acme": "acme"}) == "acme"
    assert verifier.verify(issuer.issue("forward", stages=[0], request_id="r9", tenant="nobody")).pod_credential == ""
    again = verifier.verify(issuer.issue("restore", stages=[1], request_id="r9", tenant="acme", max_tokens=100))
    assert again.nonce != grant.nonce
    stream = verifier.verify(issuer.issue("deliver", stages=[1], request_id="r9", tenant="acme"))
    assert stream.expires_at > time.time() + GRANT_TTL_S  # a delivery grant lasts as long as its restore may
    with pytest.raises(ValueError, match="unknown operation"):
        issuer.issue("delete-everything", stages=[0])
    sent = bearer_token(issuer.headers["Authorization"])
    assert tenant_of_token({issuer.internal_token: "cluster"}, sent) == "cluster"


def test_cluster_secrets_are_made_once_private_and_kept(tmp_path):
    directory = ensure_cluster_secrets(tmp_path / "s")
    first = {p.name: p.read_bytes() for p in directory.iterdir()}
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in directory.iterdir())
    ensure_cluster_secrets(directory)
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == first


def test_a_bearer_header_names_a_tenant_only_by_its_exact_token():
    def tenant(authorization: str, known: str) -> str | None:
        return tenant_of_token({known: "t"}, bearer_token(authorization))

    assert tenant("Bearer abc", "abc") == "t"
    assert tenant("bearer abc", "abc") == "t"
    assert tenant("Bearer abcd", "abc") is None
    assert tenant("abc", "abc") is None
    assert tenant("", "") is None
    assert tenant("Bearer ", "") is None

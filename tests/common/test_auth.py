"""The cluster's internal credentials (`cacheflow_common.auth`): grants only the coordinator can make,
pod credentials only a tenant's token can make, both bounded in time."""

from __future__ import annotations

import base64
import dataclasses
import json
import time

import pytest

from cacheflow_common.auth import (
    Grant,
    GrantError,
    GrantIssuer,
    GrantSigner,
    GrantVerifier,
    ensure_cluster_secrets,
    generate_signing_pair,
    pod_credential,
    pod_credential_expiry,
    pod_credential_tenant,
    read_secret,
    tenant_of_token,
)
from cacheflow_common.errors import ConfigError
from cacheflow_services.http_limits import bearer_token


def _grant(**changes: object) -> Grant:
    base = Grant(request_id="r1", tenant="acme", save=True, max_tokens=512, expires_at=time.time() + 60,
                 pod_credential="")
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


def test_a_grant_is_for_one_request_of_one_tenant():
    grant = _grant()
    grant.check(request_id="r1", tenant="acme")
    with pytest.raises(GrantError, match="not 'r2' of 'acme'"):
        grant.check(request_id="r2", tenant="acme")
    with pytest.raises(GrantError):
        grant.check(request_id="r1", tenant="other")


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
    grant = verifier.verify(issuer.issue("r9", "acme", save=False, max_tokens=100))
    assert (grant.request_id, grant.tenant, grant.save, grant.max_tokens) == ("r9", "acme", False, 100)
    assert pod_credential_tenant(grant.pod_credential, {"tok-acme": "acme"}) == "acme"
    assert verifier.verify(issuer.issue("r9", "nobody", save=True, max_tokens=1)).pod_credential == ""
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

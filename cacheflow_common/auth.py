"""Trust between CacheFlow's own components (docs/architecture.md, "Zero trust inside the cluster").

Three credentials, each held only by the components that need it:

* **Internal token**: a random secret that every call from the coordinator to a stage worker, and from
  one stage worker to the next, carries as `Authorization: Bearer <token>`. Clients of the coordinator
  and storage pods never have it, so they cannot call a worker's API at all.
* **Grant**: the coordinator's word that it admitted one request for one tenant: (request id, tenant,
  whether it may save, the most tokens it may hold, expiry), signed with Ed25519. Only the coordinator
  holds the signing key; workers hold the verifying key, so a worker can check a grant but never make
  one. A worker does work for a tenant, and writes chunks under its keys, only on a grant that names
  the request and that tenant.
* **Pod credential**: inside the grant, a short-lived storage credential for that tenant,
  HMAC-SHA256 keyed by the tenant's storage token (which the pods hold). The pods verify it with that
  token; workers never hold any tenant's long-lived storage token, and a credential they saw expires.

Why signed grants over mTLS: mTLS authenticates *which component* calls, not *which tenant it may act
for on this request*; the poisoning this closes came from a caller that was allowed to name any
tenant. Grants carry that decision from the coordinator, where admission happens, to every hop.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from cacheflow_common.errors import ConfigError, GrantError
from cacheflow_common.files import write_atomically

INTERNAL_TOKEN_FILE = "internal-token"
SIGNING_KEY_FILE = "grant-signing-key.pem"  # the coordinator's only
VERIFY_KEY_FILE = "grant-verify-key.pem"  # the workers'
POD_CREDENTIAL_PREFIX = "cfpod1."
CLOCK_SKEW_S = 30.0  # an expiry this far in the past is still accepted (clocks of two pods differ)


def tenant_of_token(tokens: Mapping[str, str], token: str) -> str | None:
    """The tenant `token` names among `tokens` (token -> tenant), or None; every known token is compared,
    in constant time, so the time taken tells nothing of which one came close. An empty token is no one's."""
    found = None
    for known, tenant in tokens.items():
        if token and hmac.compare_digest(known.encode(), token.encode()):
            found = tenant
    return found


# ---------------------------------------------------------------------------------------------- grants
@dataclass(frozen=True, kw_only=True)
class Grant:
    request_id: str
    tenant: str
    save: bool  # the request may store chunks (under this tenant's keys)
    max_tokens: int  # prefix + suffix + new tokens the request may hold on a stage
    expires_at: float  # unix time
    pod_credential: str  # the tenant's short-lived storage credential ("" where no pod is touched)

    def check(self, *, request_id: str, tenant: str) -> None:
        """UnauthorizedError unless this grant is for `request_id` of `tenant`."""
        if self.request_id != request_id or self.tenant != tenant:
            raise GrantError(f"the grant is for request {self.request_id!r} of tenant {self.tenant!r}, "
                                    f"not {request_id!r} of {tenant!r}")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class GrantSigner:
    """The coordinator's half: makes grants (holds the private key)."""

    def __init__(self, private_pem: bytes) -> None:
        try:
            key = serialization.load_pem_private_key(private_pem, password=None)
        except (ValueError, TypeError):
            key = None
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigError("the grant signing key must be an Ed25519 private key (PEM)")
        self._key = key

    def sign(self, grant: Grant) -> str:
        """"<payload>.<signature>", both base64url; the payload is the grant as canonical JSON."""
        payload = json.dumps(asdict(grant), sort_keys=True, separators=(",", ":")).encode()
        return f"{_b64(payload)}.{_b64(self._key.sign(payload))}"


class GrantVerifier:
    """A worker's half: checks grants (holds only the public key)."""

    def __init__(self, public_pem: bytes) -> None:
        try:
            key = serialization.load_pem_public_key(public_pem)
        except (ValueError, TypeError):
            key = None
        if not isinstance(key, Ed25519PublicKey):
            raise ConfigError("the grant verifying key must be an Ed25519 public key (PEM)")
        self._key = key

    def verify(self, text: str, *, now: float | None = None) -> Grant:
        """The grant `text` stands for; UnauthorizedError if it is missing, forged, altered or expired."""
        if not text:
            raise GrantError("no grant: only the coordinator can ask a worker for work")
        payload_b64, _, signature_b64 = text.partition(".")
        try:
            payload = _unb64(payload_b64)
            self._key.verify(_unb64(signature_b64), payload)
            grant = Grant(**json.loads(payload))
        except (InvalidSignature, ValueError, TypeError) as exc:
            raise GrantError("the grant is not signed by this cluster's coordinator") from exc
        if grant.expires_at + CLOCK_SKEW_S < (time.time() if now is None else now):
            raise GrantError(f"the grant for request {grant.request_id!r} has expired")
        return grant


# ------------------------------------------------------------------------------------- pod credentials
def pod_credential(tenant: str, token: str, expires_at: float) -> str:
    """A storage credential for `tenant` until `expires_at`, verifiable by whoever holds its token."""
    payload = _b64(json.dumps({"t": tenant, "exp": int(expires_at)}, separators=(",", ":")).encode())
    mac = hmac.new(token.encode(), payload.encode(), hashlib.sha256).hexdigest()
    return f"{POD_CREDENTIAL_PREFIX}{payload}.{mac}"


def pod_credential_tenant(text: str, tenant_of_token: Mapping[str, str], *, now: float | None = None) -> str | None:
    """The tenant a pod credential is valid for now, or None (unknown tenant, bad MAC, expired).
    `tenant_of_token`: the pod's bearer tokens (token -> tenant); any of the tenant's tokens may have made it."""
    if not text.startswith(POD_CREDENTIAL_PREFIX):
        return None
    payload, _, mac = text[len(POD_CREDENTIAL_PREFIX):].partition(".")
    try:
        claims = json.loads(_unb64(payload))
        tenant, expires_at = str(claims["t"]), float(claims["exp"])
    except (ValueError, TypeError, KeyError):
        return None
    if expires_at + CLOCK_SKEW_S < (time.time() if now is None else now):
        return None
    matched = False
    for token, owner in tenant_of_token.items():
        expected = hmac.new(token.encode(), payload.encode(), hashlib.sha256).hexdigest()
        matched |= owner == tenant and hmac.compare_digest(expected.encode(), mac.encode())
    return tenant if matched else None


def pod_credential_expiry(text: str) -> float:
    """When a (verified) pod credential stops being valid, with the clock skew allowed; inf for a plain token."""
    if not text.startswith(POD_CREDENTIAL_PREFIX):
        return float("inf")
    payload = text[len(POD_CREDENTIAL_PREFIX):].partition(".")[0]
    return float(json.loads(_unb64(payload))["exp"]) + CLOCK_SKEW_S


# ------------------------------------------------------------------------------------- the issuer
@dataclass(frozen=True)
class GrantIssuer:
    """The coordinator's credentials towards the workers: the internal token, and grants it signs."""

    internal_token: str
    signer: GrantSigner
    pod_tokens: Mapping[str, str]  # tenant -> its storage token (pod credentials are made from it)
    ttl_s: float = 360.0  # a grant covers one call to a stage (the stage timeout) with room to spare

    @classmethod
    def from_files(cls, internal_token_file: Path | str, signing_key_file: Path | str,
                   pod_tokens: Mapping[str, str], *, ttl_s: float = 360.0) -> GrantIssuer:
        return cls(read_secret(internal_token_file, "internal token file").decode(),
                   GrantSigner(read_secret(signing_key_file, "grant signing key file")), dict(pod_tokens), ttl_s)

    @classmethod
    def from_dir(cls, directory: Path, pod_tokens: Mapping[str, str]) -> GrantIssuer:
        """From a directory `ensure_cluster_secrets` made (local clusters, tests, benchmarks)."""
        return cls.from_files(directory / INTERNAL_TOKEN_FILE, directory / SIGNING_KEY_FILE, pod_tokens)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.internal_token}"}

    def issue(self, request_id: str, tenant: str, *, save: bool, max_tokens: int) -> str:
        """A signed grant for one call about this request (with a fresh pod credential for its tenant)."""
        expires_at = time.time() + self.ttl_s
        token = self.pod_tokens.get(tenant)
        credential = pod_credential(tenant, token, expires_at) if token else ""
        return self.signer.sign(Grant(request_id=request_id, tenant=tenant, save=save, max_tokens=max_tokens,
                                      expires_at=expires_at, pod_credential=credential))


# ------------------------------------------------------------------------------------- the key material
def generate_signing_pair() -> tuple[bytes, bytes]:
    """A new Ed25519 pair as (private PEM, public PEM)."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return private, public


def new_cluster_secrets() -> dict[str, bytes]:
    """Every internal secret of one cluster, by file name (a Kubernetes Secret's keys, or files on disk)."""
    private, public = generate_signing_pair()
    return {INTERNAL_TOKEN_FILE: secrets.token_urlsafe(32).encode(), SIGNING_KEY_FILE: private,
            VERIFY_KEY_FILE: public}


def ensure_cluster_secrets(directory: Path) -> Path:
    """The cluster's internal secrets in `directory`, created once (mode 0600) and kept; returns it. Each
    file is written whole or not at all, so a start interrupted midway makes all three again next time."""
    directory.mkdir(parents=True, exist_ok=True)
    if not all((directory / name).is_file() for name in (INTERNAL_TOKEN_FILE, SIGNING_KEY_FILE, VERIFY_KEY_FILE)):
        for name, data in new_cluster_secrets().items():
            write_atomically(directory / name, data)
    return directory


def read_secret(path: Path | str, what: str) -> bytes:
    """A secret file's bytes (trailing whitespace stripped); ConfigError naming `what` if unreadable or empty."""
    try:
        data = Path(path).expanduser().read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc.strerror}") from None
    if not data:
        raise ConfigError(f"the {what} {path} is empty")
    return data

"""Trust between CacheFlow's own components (docs/architecture.md, "Zero trust inside the cluster").

Three credentials, each held only by the components that need it:

* **Internal token**: a random secret that every call from the coordinator to a stage worker, and from
  one stage worker to the next, carries as `Authorization: Bearer <token>`. Clients of the coordinator
  and storage pods never have it, so they cannot call a worker's API at all.
* **Grant**: the coordinator's word that it allows one call: (operation, the stages it may reach, request
  id, tenant, a digest of the token ids the call works on, a nonce, whether it may save, the most tokens
  it may hold, expiry), signed with Ed25519. Only the coordinator holds the signing key; workers hold
  the verifying key, so a worker can check a grant but never make one. A worker does work for a tenant,
  and writes chunks under its keys, only on a grant that names the operation, its stage, the request,
  the tenant and the very tokens asked for; it remembers each nonce until the grant expires, so a grant
  is used once (a delivery grant: one stream of deliveries). Grants live for one call (`GRANT_TTL_S`),
  a delivery grant for the restore it feeds.
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
import struct
import time
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from cacheflow_common.errors import ConfigError, GrantError
from cacheflow_common.files import write_atomically

INTERNAL_TOKEN_FILE = "internal-token"
SIGNING_KEY_FILE = "grant-signing-key.pem"  # the coordinator's only
VERIFY_KEY_FILE = "grant-verify-key.pem"  # the workers'
POD_CREDENTIAL_PREFIX = "cfpod1."
CLOCK_SKEW_S = 5.0  # an expiry this far in the past is still accepted (clocks of two pods differ)
GRANT_TTL_S = 30.0  # a grant is checked when its call arrives: it is sent the moment it is made
POD_CREDENTIAL_TTL_S = 360.0  # a worker's saves of a request run on after its calls: its pod credential lasts longer
GRANT_HEADER = "X-CacheFlow-Grant"  # every call to a worker's API carries its grant here
OPERATIONS = ("restore", "forward", "deliver", "read", "release", "info", "flush")


def tenant_of_token(tokens: Mapping[str, str], token: str) -> str | None:
    """The tenant `token` names among `tokens` (token -> tenant), or None; every known token is compared,
    in constant time, so the time taken tells nothing of which one came close. An empty token is no one's."""
    found = None
    for known, tenant in tokens.items():
        if token and hmac.compare_digest(known.encode(), token.encode()):
            found = tenant
    return found


# ---------------------------------------------------------------------------------------------- grants
def input_digest(token_ids: Sequence[int], *, start: int = 0, reserve: int = 0) -> str:
    """What a grant binds a call's input to: the token ids at `start`, and the room reserved beside them."""
    h = hashlib.blake2b(digest_size=16)
    h.update(struct.pack("<qq", start, reserve))
    h.update(array("q", token_ids).tobytes())
    return h.hexdigest()


@dataclass(frozen=True, kw_only=True)
class Grant:
    op: str  # one of OPERATIONS: what the call may do
    stages: tuple[int, ...]  # the stages it may do it on (a forward: every stage it passes)
    request_id: str  # "" for calls about no request (info, flush)
    tenant: str  # "" likewise
    digest: str  # `input_digest` of the call's tokens ("" where the call takes none)
    nonce: str  # single use: a worker refuses a nonce it has seen until the grant expires
    save: bool  # the request may store chunks (under this tenant's keys)
    max_tokens: int  # prefix + suffix + new tokens the request may hold on a stage
    expires_at: float  # unix time
    pod_credential: str  # the tenant's short-lived storage credential ("" where no pod is touched)

    def expired(self, now: float | None = None) -> bool:
        """Past its expiry at `now` (unix time; default: the clock's), beyond the clocks' skew."""
        return self.expires_at + CLOCK_SKEW_S < (time.time() if now is None else now)

    def allows(self, op: str, stage: int) -> None:
        """GrantError unless this grant is for `op` on `stage`."""
        if self.op != op or stage not in self.stages:
            raise GrantError(f"the grant is for {self.op} on stages {list(self.stages)}, not {op} on stage {stage}")

    def check(self, *, request_id: str, tenant: str, digest: str = "") -> None:
        """GrantError unless this grant is for `request_id` of `tenant`, over the input whose digest is `digest`."""
        if self.request_id != request_id or self.tenant != tenant:
            raise GrantError(f"the grant is for request {self.request_id!r} of tenant {self.tenant!r}, "
                             f"not {request_id!r} of {tenant!r}")
        if not hmac.compare_digest(self.digest, digest):
            raise GrantError(f"the grant for request {request_id!r} is for other tokens than those sent")


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
            fields = json.loads(payload)
            grant = Grant(**{**fields, "stages": tuple(int(s) for s in fields["stages"])})
        except (InvalidSignature, ValueError, TypeError, KeyError) as exc:
            raise GrantError("the grant is not signed by this cluster's coordinator") from exc
        if grant.expired(now):
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
    stream_ttl_s: float = 300.0  # a delivery grant lasts as long as the restore it feeds may (the stage timeout)

    @classmethod
    def from_files(cls, internal_token_file: Path | str, signing_key_file: Path | str,
                   pod_tokens: Mapping[str, str], *, stream_ttl_s: float = 300.0) -> GrantIssuer:
        return cls(read_secret(internal_token_file, "internal token file").decode(),
                   GrantSigner(read_secret(signing_key_file, "grant signing key file")), dict(pod_tokens),
                   stream_ttl_s)

    @classmethod
    def from_dir(cls, directory: Path, pod_tokens: Mapping[str, str]) -> GrantIssuer:
        """From a directory `ensure_cluster_secrets` made (local clusters, tests, benchmarks)."""
        return cls.from_files(directory / INTERNAL_TOKEN_FILE, directory / SIGNING_KEY_FILE, pod_tokens)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.internal_token}"}

    def issue(self, op: str, *, stages: Iterable[int], request_id: str = "", tenant: str = "", digest: str = "",
              save: bool = False, max_tokens: int = 0, ttl_s: float | None = None) -> str:
        """A signed grant for one call (`op` on `stages`), with a fresh pod credential for a tenant's work.
        `ttl_s`: how long it stays valid (default: `GRANT_TTL_S`, a delivery grant `stream_ttl_s`)."""
        if op not in OPERATIONS:
            raise ValueError(f"unknown operation {op!r}")
        now = time.time()
        ttl = ttl_s if ttl_s is not None else self.stream_ttl_s if op == "deliver" else GRANT_TTL_S
        token = self.pod_tokens.get(tenant)
        credential = pod_credential(tenant, token, now + POD_CREDENTIAL_TTL_S) if token else ""
        return self.signer.sign(Grant(op=op, stages=tuple(stages), request_id=request_id, tenant=tenant,
                                      digest=digest, nonce=secrets.token_urlsafe(12), save=save,
                                      max_tokens=max_tokens, expires_at=now + ttl, pod_credential=credential))

    def headers_for(self, op: str, **grant: Any) -> dict[str, str]:
        """The headers of one call: the internal token and a grant for it (`issue`'s arguments)."""
        return {**self.headers, GRANT_HEADER: self.issue(op, **grant)}


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

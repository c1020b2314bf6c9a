"""The cluster's internal Secret: the internal token and the grant key pair (cacheflow_common/auth.py).

Helm cannot derive an Ed25519 public key from a private one, so the operator makes the material itself, once:
`apply.ensure_internal_secret` creates this Secret when it is missing and never replaces it, so the token and
keys stay the same across reconciles and operator restarts. The pods mount only their items of it.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from cacheflow_common.auth import INTERNAL_TOKEN_FILE, SIGNING_KEY_FILE, VERIFY_KEY_FILE
from cacheflow_operator.manifests.common import internal_secret_name, metadata
from cacheflow_operator.spec import Cluster

COMPONENT = "internal-secret"
KEYS = (INTERNAL_TOKEN_FILE, SIGNING_KEY_FILE, VERIFY_KEY_FILE)


def internal_secret(c: Cluster, material: Mapping[str, bytes]) -> dict[str, Any]:
    """The Secret holding `material` ({file name: bytes}, as `auth.new_cluster_secrets()` makes it)."""
    if missing := sorted(set(KEYS) - set(material)):
        raise ValueError(f"internal secret material lacks {missing}")
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": metadata(c, internal_secret_name(c), COMPONENT),
            "data": {k: base64.b64encode(material[k]).decode() for k in KEYS}}

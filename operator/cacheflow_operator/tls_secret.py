"""The cluster's TLS Secret (`<name>-tls`): the cluster CA (ca.crt, ca.key) and the server certificate every
internal service presents (tls.crt, tls.key), for the names in `manifests.common.tls_hosts`.

The operator creates it when missing and renews the certificate `spec.tls.renewDays` before it expires
(at every reconcile and on a timer), keeping the CA, so clients that trust the CA never stop trusting
the servers; the services reload a renewed certificate from their mounted Secret without a restart
(`cacheflow_common.tls.TLSFiles.server_context`). Pods mount only ca.crt (clients) or ca.crt, tls.crt
and tls.key (servers): the CA's key stays in the Secret, read only by the operator.
"""

from __future__ import annotations

import base64
import datetime
from typing import Any

from cacheflow_common.tls import CA_FILE, CERT_FILE, KEY_FILE, cert_expires_at, issue_server_cert, new_ca
from cacheflow_operator.kube import Kube, KubeError, Ref
from cacheflow_operator.manifests.common import metadata, tls_hosts, tls_secret_name
from cacheflow_operator.spec import Cluster

CA_KEY_FILE = "ca.key"
COMPONENT = "tls-secret"


def _data(material: dict[str, bytes]) -> dict[str, str]:
    return {k: base64.b64encode(v).decode() for k, v in material.items()}


def tls_secret(c: Cluster) -> dict[str, Any]:
    """A new Secret: a new CA and a server certificate it signed."""
    ca_cert, ca_key = new_ca(f"cacheflow {c.namespace}/{c.name} CA")
    cert, key = issue_server_cert(ca_cert, ca_key, tls_hosts(c))
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": metadata(c, tls_secret_name(c), COMPONENT),
            "data": _data({CA_FILE: ca_cert, CA_KEY_FILE: ca_key, CERT_FILE: cert, KEY_FILE: key})}


def renewed(c: Cluster, data: dict[str, str], now: datetime.datetime) -> dict[str, str] | None:
    """The Secret's data with a new server certificate when the one it holds expires within `renewDays`
    (None: it is good for longer)."""
    cert = base64.b64decode(data[CERT_FILE])
    if cert_expires_at(cert) - now > datetime.timedelta(days=c.spec.tls.renew_days):
        return None
    ca_cert, ca_key = base64.b64decode(data[CA_FILE]), base64.b64decode(data[CA_KEY_FILE])
    new_cert, new_key = issue_server_cert(ca_cert, ca_key, tls_hosts(c))
    return _data({CERT_FILE: new_cert, KEY_FILE: new_key})


def ensure_tls_secret(kube: Kube, c: Cluster, now: datetime.datetime | None = None) -> str:
    """Create the TLS Secret if missing, renew its certificate if it is due; what was done ("" if nothing)."""
    if not c.spec.tls.enabled:
        return ""
    ref = Ref("v1", "Secret", c.namespace, tls_secret_name(c))
    have = kube.get(ref)
    if have is None:
        try:
            kube.create(tls_secret(c))
        except KubeError as exc:
            if exc.status == 409:  # created meanwhile: that one stands
                return ""
            raise
        return f"created {ref}"
    update = renewed(c, have.get("data") or {}, now or datetime.datetime.now(datetime.UTC))
    if update is None:
        return ""
    kube.patch(ref, {"data": update})
    return f"renewed the certificate in {ref}"

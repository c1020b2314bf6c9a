"""The operator's TLS Secret: a CA and a server certificate for the cluster's names; the certificate is renewed
before it expires under the same CA (so clients that trust the CA keep trusting the servers)."""

from __future__ import annotations

import base64
import datetime

from cryptography import x509

from cacheflow_operator.spec import Cluster
from cacheflow_operator.tls_secret import renewed, tls_secret


def _cluster() -> Cluster:
    return Cluster.from_resource({"metadata": {"name": "demo", "namespace": "ns", "uid": "u"}, "spec": {}})


def _cert(data: dict[str, str], key: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(base64.b64decode(data[key]))


def test_the_certificate_names_the_services_and_is_renewed_under_the_same_ca():
    c = _cluster()
    secret = tls_secret(c)
    data = secret["data"]
    assert secret["metadata"]["name"] == "demo-tls" and sorted(data) == ["ca.crt", "ca.key", "tls.crt", "tls.key"]
    names = _cert(data, "tls.crt").extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "*.ns.svc" in names.get_values_for_type(x509.DNSName)
    assert "*.demo-storage.ns.svc" in names.get_values_for_type(x509.DNSName)
    now = datetime.datetime.now(datetime.UTC)
    assert renewed(c, data, now) is None  # 90 days left: nothing to do
    update = renewed(c, data, now + datetime.timedelta(days=70))  # within renewDays (30) of its expiry
    assert update is not None and sorted(update) == ["tls.crt", "tls.key"]
    new = _cert(update, "tls.crt")
    new.verify_directly_issued_by(_cert(data, "ca.crt"))  # the kept CA signed it
    assert new.serial_number != _cert(data, "tls.crt").serial_number and update["tls.key"] != data["tls.key"]

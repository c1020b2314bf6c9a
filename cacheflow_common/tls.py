"""TLS on the cluster's internal hops (coordinator -> worker, worker -> worker, worker -> storage pod).

One cluster CA signs one server certificate that every internal service presents; clients verify it
against the CA (server authentication and encryption; who may call is still the internal token, the
grants and the pod credentials). The files: `ca.crt`, `tls.crt`, `tls.key` (a Kubernetes TLS Secret's
names), made by the operator in a cluster (rotated before they expire, the CA kept) and by
`cacheflow up --tls` on one machine. Loopback stays plain unless asked: TLS costs data-plane throughput.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from cacheflow_common.errors import ConfigError
from cacheflow_common.files import write_atomically

CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"
CA_DAYS, CERT_DAYS = 3650, 90  # the CA outlives many server certificates, so a rotation breaks no client
LOCAL_HOSTS = ("127.0.0.1", "localhost")
RELOAD_S = 60.0  # how often a server looks for a renewed certificate (a mounted Secret changes within minutes)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TLSFiles:
    ca: Path
    cert: Path
    key: Path

    @classmethod
    def in_dir(cls, directory: Path | str) -> TLSFiles:
        d = Path(directory).expanduser()
        return cls(d / CA_FILE, d / CERT_FILE, d / KEY_FILE)

    def server_context(self, *, reload_s: float = RELOAD_S) -> ssl.SSLContext:
        """What a server presents (its certificate and key), reloaded into the same context when the files
        change (checked every `reload_s`; a renewed certificate serves new connections without a restart)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load the TLS certificate {self.cert} and key {self.key}: {exc}") from None
        if reload_s > 0:
            threading.Thread(target=self._reload, args=(context, reload_s), name="tls-reload", daemon=True).start()
        return context

    def _reload(self, context: ssl.SSLContext, every_s: float) -> None:
        seen = self._stamp()
        while True:
            time.sleep(every_s)
            stamp = self._stamp()
            if stamp != seen:
                try:
                    context.load_cert_chain(self.cert, self.key)
                    seen = stamp
                    log.info("TLS certificate %s reloaded", self.cert)
                except (OSError, ssl.SSLError) as exc:  # half-written: the next look tries again
                    log.warning("TLS certificate %s not reloaded: %s", self.cert, exc)

    def _stamp(self) -> tuple[float, float]:
        try:
            return self.cert.stat().st_mtime, self.key.stat().st_mtime
        except OSError:
            return 0.0, 0.0

    def client_context(self) -> ssl.SSLContext:
        """What a client trusts: servers whose certificate the cluster CA signed, for the host it dialled."""
        try:
            context = ssl.create_default_context(cafile=str(self.ca))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load the cluster CA {self.ca}: {exc}") from None
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        return context


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def new_ca(common_name: str = "cacheflow cluster CA") -> tuple[bytes, bytes]:
    """A new CA as (certificate PEM, key PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def issue_server_cert(ca_cert: bytes, ca_key: bytes, hosts: Sequence[str], *, days: int = CERT_DAYS
                      ) -> tuple[bytes, bytes]:
    """A server certificate for `hosts` (DNS names, wildcards or IP addresses) signed by the CA, as
    (certificate PEM, key PEM)."""
    ca = x509.load_pem_x509_certificate(ca_cert)
    signer = serialization.load_pem_private_key(ca_key, password=None)
    if not isinstance(signer, ec.EllipticCurvePrivateKey):
        raise ConfigError("the cluster CA key must be an EC private key (PEM)")
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(hosts[0])).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(signer, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def cert_expires_at(cert: bytes) -> datetime.datetime:
    """When a certificate (PEM) stops being valid."""
    return x509.load_pem_x509_certificate(cert).not_valid_after_utc


def ensure_local_tls(directory: Path) -> TLSFiles:
    """A CA and a server certificate for loopback in `directory`, made once (mode 0600) and kept."""
    files = TLSFiles.in_dir(directory)
    if not all(p.is_file() for p in (files.ca, files.cert, files.key)):
        directory.mkdir(parents=True, exist_ok=True)
        ca_cert, ca_key = new_ca()
        cert, key = issue_server_cert(ca_cert, ca_key, LOCAL_HOSTS)
        for path, data in ((files.ca, ca_cert), (files.cert, cert), (files.key, key)):
            write_atomically(path, data)
    return files

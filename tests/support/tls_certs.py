"""A private certificate authority and server certificates made in the test (the `cryptography` package, which the
service depends on anyway), for Redis over TLS: nothing is read from the system's CA store or the network."""
from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from bench.local_redis import TlsFiles

LOOPBACK_NAMES = ("localhost", "127.0.0.1")  # what a test server's certificate is valid for


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())  # fast to make, unlike RSA, and every OpenSSL speaks it


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
    return path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return builder.not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(
        now + datetime.timedelta(days=1))


class CertificateAuthority:
    """A self-signed CA: `cert` is the PEM file a client trusts (ssl_ca_certs); server_files() signs servers."""

    def __init__(self, folder: Path, name: str):
        self.folder, self.name = folder, name
        folder.mkdir(parents=True, exist_ok=True)
        self._key = _key()
        subject = _name(f"{name} test CA")
        self._cert = _validity(x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                               .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
                               ).add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True
                               ).add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                                             crl_sign=True, content_commitment=False,
                                                             key_encipherment=False, data_encipherment=False,
                                                             key_agreement=False, encipher_only=False,
                                                             decipher_only=False), critical=True
                               ).sign(self._key, hashes.SHA256())
        self.cert = folder / f"{name}-ca.crt"
        self.cert.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def server_files(self, name: str, hosts=LOOPBACK_NAMES) -> TlsFiles:
        """A server certificate for `hosts` (DNS names or IP addresses) signed by this CA, its key, and this CA's
        certificate (what a Redis node checks its cluster peers and replicas against)."""
        import ipaddress

        def alt(h: str) -> x509.GeneralName:
            try:
                return x509.IPAddress(ipaddress.ip_address(h))
            except ValueError:
                return x509.DNSName(h)

        key = _key()
        cert = _validity(x509.CertificateBuilder().subject_name(_name(name)).issuer_name(self._cert.subject)
                         .public_key(key.public_key()).serial_number(x509.random_serial_number())
                         ).add_extension(x509.SubjectAlternativeName([alt(h) for h in hosts]), critical=False
                         ).add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True
                         # server AND client: a Redis Cluster node is its peers' TLS client on the cluster bus
                         ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                                ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
                         ).sign(self._key, hashes.SHA256())
        cert_path = self.folder / f"{name}.crt"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return TlsFiles(cert=str(cert_path), key=str(_write_key(key, self.folder / f"{name}.key")),
                        ca=str(self.cert))

"""Test certificates (``from tests.support_tls import TestCA``): a throwaway CA, generated with the
``cryptography`` library, that issues server / client certificates for 127.0.0.1 and localhost."""

from __future__ import annotations

import datetime
import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _names(dns_names: tuple[str, ...], ips: tuple[str, ...], loopback: bool) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    if loopback:
        names += [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    return names


def _write_key(path, key) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


class TestCA:
    """A self-signed CA that issues leaf certificates, all as PEM files under ``folder``
    (``file``: the CA certificate)."""

    __test__ = False  # not a pytest class

    def __init__(self, folder, name: str):
        self.folder, self.name = folder, name
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.file = folder / f"{name}.pem"
        self.file.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, cn: str, dns_names: tuple[str, ...] = (), *, ips: tuple[str, ...] = (),
              loopback: bool = True) -> tuple[str, str]:
        """(cert file, key file) of a leaf valid for ``dns_names``, ``ips`` and (``loopback``)
        127.0.0.1 and localhost, as server and client."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(self.cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName(_names(dns_names, ips, loopback)), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .sign(self.key, hashes.SHA256()))
        cert_file, key_file = self.folder / f"{cn}.crt", self.folder / f"{cn}.key"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key_file, key)
        return str(cert_file), str(key_file)

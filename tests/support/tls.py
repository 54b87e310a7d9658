"""A throwaway certificate authority for TLS tests: a CA, a server certificate for localhost and
127.0.0.1, and a client certificate, as PEM files (made with ``cryptography``)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Certs:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str  # a CA that signed nothing here


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())  # fmt: skip


def _ca(cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _leaf(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, cn: str, server: bool):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                              else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    )  # fmt: skip
    if server:
        san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def make_certs(directory: Path) -> Certs:
    pem = serialization.Encoding.PEM
    ca_key, ca_cert = _ca("pdserve test CA")
    _, other = _ca("someone else's CA")
    s_key, s_cert = _leaf(ca_key, ca_cert, "localhost", server=True)
    c_key, c_cert = _leaf(ca_key, ca_cert, "worker", server=False)
    d = directory
    return Certs(
        ca=_write(d / "ca.pem", ca_cert.public_bytes(pem)),
        server_cert=_write(d / "server.pem", s_cert.public_bytes(pem)),
        server_key=_write(d / "server.key", _key_pem(s_key)),
        client_cert=_write(d / "client.pem", c_cert.public_bytes(pem)),
        client_key=_write(d / "client.key", _key_pem(c_key)),
        other_ca=_write(d / "other-ca.pem", other.public_bytes(pem)),
    )

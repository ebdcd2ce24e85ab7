"""A self-signed gateway certificate, made once on the controller (``gateway.tls.self_signed``).

For the sandbox and internal networks without a CA of their own: the gateway role calls ``vllm-fleet tls
self-signed`` on the controller, which writes ``DEST/gateway.crt`` and ``DEST/gateway.key`` (0600) into the
secrets folder next to the inventory, then copies them to the gateway host. A certificate that is still valid
for more than ``RENEW_DAYS`` and names the same host names and addresses is kept (the run reports no change);
otherwise a new key and certificate replace it. Clients trust it by its file (``--cacert DEST/gateway.crt``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import json
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

VALID_DAYS = 397  # what browsers accept for a leaf certificate
RENEW_DAYS = 30
CERT_NAME = "gateway.crt"
KEY_NAME = "gateway.key"


@dataclass(frozen=True)
class Issued:
    certificate: Path
    key: Path
    changed: bool
    not_after: dt.datetime


def _names(cert: x509.Certificate) -> tuple[set[str], set[str]]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set(), set()
    return (
        set(san.get_values_for_type(x509.DNSName)),
        {str(a) for a in san.get_values_for_type(x509.IPAddress)},
    )


def _reusable(cert_path: Path, key_path: Path, dns: set[str], ips: set[str], now: dt.datetime) -> bool:
    if not (cert_path.is_file() and key_path.is_file()):
        return False
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except ValueError:
        return False
    same_key = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ) == key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    fresh = cert.not_valid_after_utc - now > dt.timedelta(days=RENEW_DAYS)
    return same_key and fresh and _names(cert) == (dns, ips)


def self_signed(dest: Path, names: list[str], addresses: list[str], now: dt.datetime | None = None) -> Issued:
    """The certificate and key for ``names`` (DNS) and ``addresses`` (IP) in ``dest``: kept when still
    good, else made anew (ECDSA P-256, SHA-256, serverAuth)."""
    now = now or dt.datetime.now(dt.UTC)
    ips: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    names = list(dict.fromkeys(names))
    for a in addresses:  # a host's address may be a DNS name: it goes with the names
        try:
            ips.append(ipaddress.ip_address(a))
        except ValueError:
            if a not in names:
                names.append(a)
    dns, ip_set = set(names), {str(a) for a in ips}
    if not names and not ips:
        raise ValueError("a certificate needs at least one host name or address")
    cert_path, key_path = dest / CERT_NAME, dest / KEY_NAME
    if _reusable(cert_path, key_path, dns, ip_set, now):
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        return Issued(cert_path, key_path, False, cert.not_valid_after_utc)
    dest.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, (names or addresses)[0])])
    san: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
    san += [x509.IPAddress(a) for a in ips]
    not_after = now + dt.timedelta(days=VALID_DAYS)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    # the key first, never readable by others, then the certificate: a reader never pairs a new certificate
    # with an old key
    tmp = key_path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    os.replace(tmp, key_path)
    ctmp = cert_path.with_suffix(".tmp")
    ctmp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    os.replace(ctmp, cert_path)
    return Issued(cert_path, key_path, True, not_after)


def _cmd(a: argparse.Namespace) -> int:
    try:
        got = self_signed(Path(a.dest), a.name, a.address)
    except ValueError as e:
        print(f"tls: {e}")
        return 2
    print(
        json.dumps(
            {
                "certificate": str(got.certificate),
                "key": str(got.key),
                "changed": got.changed,
                "not_after": got.not_after.isoformat(),
            }
        )
    )
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["self-signed"])
    p.add_argument("--dest", required=True, help="folder for gateway.crt and gateway.key (0600)")
    p.add_argument("--name", action="append", default=[], help="a DNS name it is valid for (repeatable)")
    p.add_argument("--address", action="append", default=[], help="an IP address (or a DNS name; repeatable)")
    p.set_defaults(handler=_cmd)

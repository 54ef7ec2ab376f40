"""`ferry certs`: a cluster CA, and node and client certificates signed by it.

Meant for a test or small cluster; a larger one brings its own PKI with the
same conventions. The role a certificate grants is its subject's
organizational unit:

- ``ferry-node``: an agent. Serves TLS (serverAuth) and calls peer agents
  (clientAuth); its subject alternative names are the host names and
  addresses peers dial, which a source checks against the target it was
  asked to move a job to.
- ``ferry-client``: a person or tool driving agents (clientAuth only).

Private keys are written 0600 and never overwritten.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from agent.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError

CA_CERT = "ca.pem"
CA_KEY = "ca-key.pem"
CA_DAYS = 3650
LEAF_DAYS = 397
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]{0,62}$")


class Role(Enum):
    NODE = "ferry-node"
    CLIENT = "ferry-client"


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path
    subject: str
    not_after: datetime.datetime


def _crypto():
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def self_signed(name: str, lifetime: datetime.timedelta):  # -> (EC key, x509.CertificateBuilder)
    """A new P-256 key and the start of a certificate it signs for itself: a CA of one, valid
    from 5 minutes ago (nodes' clocks differ a little) for `lifetime`. The caller adds its key
    usages and signs."""
    x509, _, _, ec, _, NameOID = _crypto()
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + lifetime)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
    )
    return key, builder


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise InvalidArgumentError(
            f"invalid certificate name {name!r}: letters, digits, '.' and '-', at most 63 characters",
            step="certs",
        )
    return name


def _write_new(path: Path, data: bytes, mode: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError as e:
        raise AlreadyExistsError(
            f"{path} exists; ferry never overwrites a key or certificate",
            step="certs",
            hint="remove it first, or use another --dir",
        ) from e
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def create_ca(directory: Path, name: str = "ferry cluster CA") -> Issued:
    """A new self-signed CA in directory (ca.pem, ca-key.pem)."""
    x509, hashes, serialization, _, _, _ = _crypto()
    directory.mkdir(parents=True, exist_ok=True)
    for f in (CA_CERT, CA_KEY):
        if (directory / f).exists():
            raise AlreadyExistsError(f"{directory / f} exists; a CA is created once", step="certs")
    key, builder = self_signed(name, datetime.timedelta(days=CA_DAYS))
    cert = (
        builder.add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_new(directory / CA_KEY, _key_pem(key, serialization), 0o600)
    _write_new(directory / CA_CERT, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return Issued(directory / CA_CERT, directory / CA_KEY, name, cert.not_valid_after_utc)


def issue(directory: Path, name: str, role: Role, hosts: list[str] = ()) -> Issued:  # type: ignore[assignment]
    """A certificate for `name` with `role`, signed by the CA in directory (NAME.pem, NAME-key.pem)."""
    x509, hashes, serialization, ec, EKU, NameOID = _crypto()
    check_name(name)
    if role is Role.NODE and not hosts:
        raise InvalidArgumentError(
            "a node certificate needs at least one --host: the names or addresses peers dial",
            step="certs",
        )
    ca_cert, ca_key = _load_ca(directory)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role.value),
            x509.NameAttribute(NameOID.COMMON_NAME, name),
        ]
    )
    now = datetime.datetime.now(datetime.timezone.utc)
    usages = [EKU.SERVER_AUTH, EKU.CLIENT_AUTH] if role is Role.NODE else [EKU.CLIENT_AUTH]
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(min(now + datetime.timedelta(days=LEAF_DAYS), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    sans = [_san(x509, h) for h in dict.fromkeys(hosts)]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    _write_new(directory / f"{name}-key.pem", _key_pem(key, serialization), 0o600)
    _write_new(directory / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return Issued(directory / f"{name}.pem", directory / f"{name}-key.pem", name, cert.not_valid_after_utc)


def role_of(subject_ou: str) -> Role | None:
    return next((r for r in Role if r.value == subject_ou), None)


def _san(x509, host: str):
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    if not re.fullmatch(r"[A-Za-z0-9*]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", host):
        raise InvalidArgumentError(f"--host {host!r} is neither an IP address nor a DNS name", step="certs")
    return x509.DNSName(host)


def _key_pem(key, serialization) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _load_ca(directory: Path):
    x509, _, serialization, _, _, _ = _crypto()
    try:
        cert = x509.load_pem_x509_certificate((directory / CA_CERT).read_bytes())
        key = serialization.load_pem_private_key((directory / CA_KEY).read_bytes(), password=None)
    except FileNotFoundError as e:
        raise NotFoundError(
            f"no CA in {directory} ({e.filename} is missing)",
            step="certs",
            hint=f"create one with `ferry certs ca --dir {directory}`",
        ) from e
    except ValueError as e:
        raise InvalidArgumentError(f"the CA in {directory} cannot be read: {e}", step="certs") from e
    return cert, key

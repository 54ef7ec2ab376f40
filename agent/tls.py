"""Mutual TLS: this process's certificate, gRPC credentials from it, and the caller's identity.

Certificates come from `ferry certs` (or any PKI with the same conventions):
a directory holding the cluster CA (`ca.pem`) and `NAME.pem` / `NAME-key.pem`.
The role a certificate grants is its subject's OU (see agent.certs).
"""

from __future__ import annotations

import functools
import os
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from agent.certs import CA_CERT, Role, role_of
from agent.errors import (
    FerryError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
)

DEFAULT_DIR = Path("/etc/ferry/tls")


def default_dir() -> Path:
    return Path(os.environ.get("FERRY_TLS_DIR") or DEFAULT_DIR)


@dataclass(frozen=True)
class Identity:
    """A certificate and key signed by the cluster CA, with the CA to check peers against."""

    name: str
    role: Role
    ca: bytes
    cert: bytes
    key: bytes
    directory: Path
    cert_path: Path
    key_path: Path

    def server_credentials(self) -> grpc.ServerCredentials:
        # The handshake itself demands a client certificate signed by the CA: a peer
        # without one never reaches an RPC. Roles are checked per call (agent.service.access).
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        # No target-name override: the server's certificate must name the host we dial.
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)


def load(directory: Path, name: str = "", want: Role | None = None) -> Identity:
    """NAME's certificate from directory; without a name, the only certificate there with a key."""
    if not directory.is_dir():
        raise NotFoundError(
            f"no TLS directory {directory}",
            step="tls",
            hint="create certificates with `ferry certs` and pass --tls-dir (or set FERRY_TLS_DIR)",
        )
    if not name:
        names = sorted(p.name[: -len("-key.pem")] for p in directory.glob("*-key.pem"))
        names = [n for n in names if n != "ca" and (directory / f"{n}.pem").exists()]
        if len(names) != 1:
            raise InvalidArgumentError(
                f"{directory} holds {len(names)} certificates with keys ({', '.join(names) or 'none'}); "
                "say which to use",
                step="tls",
                hint="pass --tls-name NAME (or set FERRY_TLS_NAME)",
            )
        name = names[0]
    files = {
        "ca": directory / CA_CERT,
        "cert": directory / f"{name}.pem",
        "key": directory / f"{name}-key.pem",
    }
    if missing := [str(p) for p in files.values() if not p.is_file()]:
        raise NotFoundError(
            f"TLS files missing: {', '.join(missing)}",
            step="tls",
            hint=f"issue them with `ferry certs node|client {name} --dir {directory}`",
        )
    data = {k: _read(p) for k, p in files.items()}
    role = cert_role(data["cert"])
    if role is None:
        raise InvalidArgumentError(
            f"{files['cert']} carries no ferry role (its subject OU is neither "
            f"{Role.NODE.value} nor {Role.CLIENT.value})",
            step="tls",
        )
    if want is not None and role is not want:
        raise InvalidArgumentError(
            f"{files['cert']} is a {role.value} certificate; this needs a {want.value} one", step="tls"
        )
    return Identity(
        cert_name(data["cert"]),
        role,
        data["ca"],
        data["cert"],
        data["key"],
        directory,
        files["cert"],
        files["key"],
    )


def _read(path: Path) -> bytes:
    """A TLS file's bytes; one we may not read (`ferry certs` writes keys 0600) is one line
    naming it, not a traceback."""
    try:
        return path.read_bytes()
    except PermissionError as e:
        raise PermissionDeniedError(
            f"cannot read {path}: permission denied (uid {os.geteuid()})",
            step="tls",
            hint="run as a user who may read it (root, for a node's key), or use a client certificate "
            "of your own: `ferry certs client NAME --dir DIR`, then --tls-dir DIR",
        ) from e
    except OSError as e:
        raise FerryError(f"cannot read {path}: {e.strerror or e}", step="tls") from e


@functools.lru_cache(maxsize=256)
def _subject(pem: bytes) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    subject = x509.load_pem_x509_certificate(pem).subject
    cn = subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ou = subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    return (str(cn[0].value) if cn else "", str(ou[0].value) if ou else "")


def cert_name(pem: bytes) -> str:
    return _subject(pem)[0]


def cert_role(pem: bytes) -> Role | None:
    return role_of(_subject(pem)[1])


def peer_certificate(context: grpc.ServicerContext) -> bytes | None:
    """The caller's certificate, verified against the CA by the TLS handshake (None without TLS)."""
    auth = context.auth_context() or {}
    if auth.get("transport_security_type") != [b"ssl"]:
        return None
    pems = auth.get("x509_pem_cert") or []
    return pems[0] if pems else None


#: What OpenSSL says when the server's first bytes are no TLS record (an HTTP/2 or other plaintext
#: server answers our ClientHello with its own bytes).
PLAINTEXT_ANSWERS = frozenset({"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"})


def diagnose(address: str, identity: Identity, timeout_s: float = 5.0) -> UnauthenticatedError | None:
    """Why a TLS connection to an agent failed, when the cause is a certificate.

    gRPC reports a refused handshake as a closed socket; a plain TLS handshake
    (and one read, which is when TLS 1.3 delivers the server's verdict on our
    certificate) tells a user which side's certificate is wrong.
    """
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=identity.ca.decode())
    ctx.set_alpn_protocols(["h2"])
    try:
        ctx.load_cert_chain(identity.cert_path, identity.key_path)
        with socket.create_connection((host, int(port)), timeout=timeout_s) as raw:
            try:
                with ctx.wrap_socket(raw, server_hostname=host) as s:
                    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
                    if not s.recv(1):  # a gRPC server that accepts us answers with its settings
                        raise ssl.SSLError("the connection was closed right after the handshake")
            except ssl.SSLCertVerificationError as e:
                return UnauthenticatedError(
                    f"agent {address} presented a certificate we do not accept: {e.verify_message}",
                    hint=f"its certificate must be signed by the CA in {identity.directory} and name {host}",
                )
            except ssl.SSLError as e:
                why = getattr(e, "reason", None) or e.args[0]
                if why in PLAINTEXT_ANSWERS:  # the bytes that came back were not TLS at all
                    return UnauthenticatedError(
                        f"{address} does not speak TLS ({why}): it is a plaintext agent (--insecure) "
                        "or not an agent at all",
                        hint="check the address, or reach a plaintext agent on loopback with --insecure",
                    )
                return UnauthenticatedError(
                    f"agent {address} refused our certificate ({identity.name}): {why}",
                    hint=f"use a certificate signed by that agent's cluster CA (ours: {identity.directory})",
                )
    except OSError:
        return None
    return None

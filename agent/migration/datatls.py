"""One-time TLS identities that bind the data connection between two CRIUs to one migration.

The job's memory travels on a TCP connection between the source's and the target's CRIU,
secured by CRIU's own TLS (GnuTLS), never through an agent. Each side makes a key and a
self-signed certificate for this migration only and hands the certificate to the other over
the agents' mutual-TLS gRPC link (PrepareRequest.data_cert, Lease.data_cert). Each CRIU
then trusts that one certificate and nothing else: only the peer that holds the lease's
other key can connect, a node certificate of the cluster cannot, and a key is worth nothing
once its migration ends. The trust thus comes from the cluster CA, through the link that
carried the certificates.

CRIU checks the peer against its own address unless told not to (--tls-no-cn-verify); a
pinned certificate makes that check redundant, so it is off.
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from agent import certs
from agent.criu.options import TlsFiles
from agent.errors import InvalidArgumentError

#: A one-time certificate outlives its migration's lease (600 s) by a wide margin, and no more.
VALID_FOR = datetime.timedelta(hours=2)


@dataclass(frozen=True)
class DataIdentity:
    cert_pem: bytes
    key_pem: bytes

    @classmethod
    def new(cls, name: str) -> DataIdentity:
        # Its own anchor: GnuTLS trusts it as a CA that signed itself.
        key, builder = certs.self_signed(name, VALID_FOR)
        cert = (
            builder.add_extension(
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
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(key, hashes.SHA256())
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return cls(cert.public_bytes(serialization.Encoding.PEM), key_pem)


def check_peer_cert(pem: bytes, who: str) -> None:
    """A peer's one-time certificate must at least parse: a bad one would fail inside CRIU."""
    try:
        x509.load_pem_x509_certificate(pem)
    except ValueError as e:
        raise InvalidArgumentError(f"{who}'s one-time data certificate does not parse: {e}") from None


#: One-time keys live in the staging root, each in a directory of its own named so: beside the
#: migrations' staging (never in one: the source sends its staging to the target, and a target's
#: staging holds images only), on the staging filesystem, which a restart of the agent sweeps.
KEYS_PREFIX = "keys-"


def sweep_keys(staging_root: Path) -> int:
    """Remove the keys an agent that stopped mid-move left behind (a killed agent closes nothing);
    their moves were resolved by recovery, and a CRIU reads its files only as it connects."""
    if not staging_root.is_dir():
        return 0
    stale = [d for d in staging_root.iterdir() if d.name.startswith(KEYS_PREFIX)]
    for d in stale:
        shutil.rmtree(d, ignore_errors=True)
    return len(stale)


class DataTls:
    """The files of one migration's data connection, in a private directory of their own in the
    staging root (`KEYS_PREFIX`), which `close()` removes."""

    def __init__(self, ours: DataIdentity, peer_cert: bytes, staging_root: Path) -> None:
        staging_root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix=KEYS_PREFIX, dir=staging_root))
        self.files = TlsFiles(self.dir / "peer.pem", self.dir / "ours.pem", self.dir / "ours-key.pem")
        for path, data in ((self.files.cacert, peer_cert), (self.files.cert, ours.cert_pem)):
            path.write_bytes(data)
        fd = os.open(self.files.key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(ours.key_pem)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

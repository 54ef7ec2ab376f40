"""One-time TLS identities for the CRIU-to-CRIU data connection (agent.migration.datatls)."""

from __future__ import annotations

import datetime
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from agent.errors import InvalidArgumentError
from agent.migration.datatls import KEYS_PREFIX, VALID_FOR, DataIdentity, DataTls, check_peer_cert, sweep_keys


def test_a_one_time_certificate_is_its_own_anchor_for_both_ends_and_short_lived() -> None:
    ident = DataIdentity.new("nodea m-1")
    cert = x509.load_pem_x509_certificate(ident.cert_pem)
    assert cert.subject == cert.issuer
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(eku)
    lifetime = cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
    assert VALID_FOR - datetime.timedelta(minutes=1) < lifetime <= VALID_FOR
    cert.verify_directly_issued_by(cert)  # signed by its own key
    assert DataIdentity.new("nodea m-1").cert_pem != ident.cert_pem  # a new key every time


def test_the_files_are_private_and_go_when_closed(tmp_path: Path) -> None:
    ours, peer = DataIdentity.new("a"), DataIdentity.new("b")
    tls = DataTls(ours, peer.cert_pem, tmp_path)
    assert tls.dir.parent == tmp_path and tls.dir.name.startswith(KEYS_PREFIX)  # beside staging, not in it
    assert stat.S_IMODE(tls.dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(tls.files.key.stat().st_mode) == 0o600
    assert tls.files.cacert.read_bytes() == peer.cert_pem and tls.files.cert.read_bytes() == ours.cert_pem
    tls.close()
    assert not tls.dir.exists()


def test_a_peer_certificate_that_does_not_parse_is_named() -> None:
    check_peer_cert(DataIdentity.new("b").cert_pem, "target nodeb")
    with pytest.raises(InvalidArgumentError, match="target nodeb's one-time data certificate"):
        check_peer_cert(b"not a certificate", "target nodeb")


def test_keys_a_stopped_agent_left_are_swept_and_nothing_else(tmp_path: Path) -> None:
    """A killed agent closes nothing: its keys would stay on the staging filesystem for good."""
    left = DataTls(DataIdentity.new("a"), DataIdentity.new("b").cert_pem, tmp_path)
    staging = tmp_path / "in-m1"
    staging.mkdir()
    assert sweep_keys(tmp_path) == 1
    assert not left.dir.exists() and staging.is_dir()
    assert sweep_keys(tmp_path / "nothing-here") == 0

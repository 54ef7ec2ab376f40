"""`ferry certs`: a CA and the certificates it signs, checked with the cryptography library."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agent import certs
from agent.cli import main as cli
from agent.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except Exception:
        return False
    return True


def test_ca_then_node_and_client_certificates(tmp_path: Path) -> None:
    ca = certs.create_ca(tmp_path)
    node = certs.issue(tmp_path, "node-a", certs.Role.NODE, ["node-a.example", "10.0.0.7", "127.0.0.1"])
    client = certs.issue(tmp_path, "alice", certs.Role.CLIENT)

    ca_cert = load(ca.cert)
    assert ca_cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    n, c = load(node.cert), load(client.cert)
    assert signed_by(n, ca_cert) and signed_by(c, ca_cert)
    assert not signed_by(n, c)
    assert n.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value == "ferry-node"
    assert c.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value == "ferry-client"
    assert certs.role_of("ferry-node") is certs.Role.NODE and certs.role_of("root") is None
    san = n.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["node-a.example"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("10.0.0.7"),
        ipaddress.ip_address("127.0.0.1"),
    ]
    eku = n.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert list(c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.CLIENT_AUTH
    ]
    for key in (ca.key, node.key, client.key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
        assert "PRIVATE KEY" in key.read_text()
    assert isinstance(load(node.cert).public_key(), ec.EllipticCurvePublicKey)
    assert n.not_valid_after_utc <= ca_cert.not_valid_after_utc


def test_nothing_is_ever_overwritten(tmp_path: Path) -> None:
    certs.create_ca(tmp_path)
    ca_before = (tmp_path / "ca-key.pem").read_bytes()
    with pytest.raises(AlreadyExistsError, match="a CA is created once"):
        certs.create_ca(tmp_path)
    certs.issue(tmp_path, "node-a", certs.Role.NODE, ["127.0.0.1"])
    key_before = (tmp_path / "node-a-key.pem").read_bytes()
    with pytest.raises(AlreadyExistsError, match="never overwrites"):
        certs.issue(tmp_path, "node-a", certs.Role.NODE, ["127.0.0.1"])
    assert (tmp_path / "ca-key.pem").read_bytes() == ca_before
    assert (tmp_path / "node-a-key.pem").read_bytes() == key_before


@pytest.mark.parametrize(
    ("name", "hosts", "match"),
    [
        ("../evil", ["h"], "invalid certificate name"),
        ("a/b", ["h"], "invalid certificate name"),
        ("node", [], "at least one --host"),
        ("node", ["bad host!"], "neither an IP address nor a DNS name"),
    ],
)
def test_bad_input_is_refused_and_writes_nothing(
    tmp_path: Path, name: str, hosts: list[str], match: str
) -> None:
    certs.create_ca(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(InvalidArgumentError, match=match):
        certs.issue(tmp_path, name, certs.Role.NODE, hosts)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_issuing_without_a_ca_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="ferry certs ca --dir"):
        certs.issue(tmp_path, "alice", certs.Role.CLIENT)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = str(tmp_path / "pki")
    assert cli.main(["certs", "ca", "--dir", d]) == 0
    assert cli.main(["certs", "node", "node-b", "--host", "127.0.0.1", "--dir", d, "--json"]) == 0
    out = capsys.readouterr().out
    assert '"subject": "node-b"' in out and "node-b-key.pem" in out
    assert cli.main(["certs", "client", "ops", "--dir", d]) == 0
    assert "ops.pem" in capsys.readouterr().out
    assert cli.main(["certs", "node", "node-c", "--dir", d]) == 2  # --host is required
    assert cli.main(["certs", "ca", "--dir", d]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") >= 1 and "ferry: certs: " in err and "Traceback" not in err

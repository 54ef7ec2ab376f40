"""Mutual TLS and roles, over real gRPC with certificates from `ferry certs` (agent.tls, service.access)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fakes import FakeCriu

from agent import certs, client, tls
from agent.errors import (
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
    UnavailableError,
)
from agent.rpc import pb
from agent.service import access
from agent.service.node import AgentNode
from agent.service.serve import create_server

S = grpc.StatusCode


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A cluster CA with a node (nodea, for 127.0.0.1), a second node, a client; and a foreign CA."""
    d = tmp_path_factory.mktemp("pki")
    ours, other, alone = d / "ours", d / "other", d / "alone"
    certs.create_ca(ours)
    certs.issue(ours, "nodea", certs.Role.NODE, ["127.0.0.1", "localhost"])
    certs.issue(ours, "nodeb", certs.Role.NODE, ["127.0.0.1"])
    certs.issue(ours, "elsewhere", certs.Role.NODE, ["10.9.9.9"])
    certs.issue(ours, "alice", certs.Role.CLIENT)
    certs.create_ca(other)
    certs.issue(other, "mallory", certs.Role.CLIENT)
    # A directory with one client certificate and the CA, as handed to a user.
    alone.mkdir()
    for name in ("ca.pem", "alice.pem", "alice-key.pem"):
        (alone / name).write_bytes((ours / name).read_bytes())
    return {"ours": ours, "other": other, "alone": alone}


@pytest.fixture
def tls_agent(pki: dict[str, Path], tmp_path: Path) -> Iterator[tuple[AgentNode, str]]:
    """An in-process agent serving mutual TLS as nodea on 127.0.0.1."""
    ident = tls.load(pki["ours"], "nodea", certs.Role.NODE)
    criu = FakeCriu("nodea")
    svc = AgentNode(tmp_path / "state", "nodea", tmp_path / "staging", criu=criu, dial=client.Dial(ident))
    server, port = create_server("127.0.0.1:0", svc, max_workers=4, identity=ident)
    server.start()
    yield svc, f"127.0.0.1:{port}"
    server.stop(None).wait()
    criu.cleanup()


def call(address: str, ident: tls.Identity | None, method: str, req: object) -> object:
    dial = client.Dial(ident, insecure=ident is None)
    try:
        return getattr(client.stub(address, dial), method)(req, timeout=10)
    except grpc.RpcError as e:
        raise client.from_rpc_error(e, address, method, dial) from e


def prepare_req(mid: str = "m1", source: str = "nodeb") -> pb.PrepareRequest:
    return pb.PrepareRequest(migration_id=mid, job="train", source_node=source, cwd="/", estimated_bytes=1)


# -- identities --------------------------------------------------------------------------


def test_load_picks_the_only_certificate_with_a_key(pki: dict[str, Path]) -> None:
    ident = tls.load(pki["alone"])
    assert (ident.name, ident.role) == ("alice", certs.Role.CLIENT)


def test_load_asks_which_when_several(pki: dict[str, Path]) -> None:
    with pytest.raises(InvalidArgumentError, match=r"holds 4 certificates with keys .*alice.*nodea"):
        tls.load(pki["ours"])


def test_load_refuses_the_wrong_role(pki: dict[str, Path]) -> None:
    with pytest.raises(InvalidArgumentError, match="ferry-client certificate; this needs a ferry-node"):
        tls.load(pki["ours"], "alice", certs.Role.NODE)


def test_load_names_missing_files(pki: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="no TLS directory"):
        tls.load(tmp_path / "nope")
    with pytest.raises(NotFoundError, match=r"bob\.pem.*bob-key\.pem"):
        tls.load(pki["ours"], "bob")


def test_an_unreadable_key_is_one_line_naming_the_file(
    pki: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A non-root `ferry ps --tls-dir DIR` whose key only root may read: not a traceback."""
    from agent.cli.main import main

    key = pki["alone"] / "alice-key.pem"
    read_bytes = Path.read_bytes

    def refuse(path: Path) -> bytes:
        if path == key:  # tests run as root, whom chmod would not stop
            raise PermissionError(13, "Permission denied", str(path))
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", refuse)
    with pytest.raises(PermissionDeniedError, match=rf"cannot read {key}: permission denied") as e:
        tls.load(pki["alone"])
    assert "--tls-dir" in e.value.hint
    monkeypatch.delenv("FERRY_INSECURE")
    assert main(["ps", "--agent", "127.0.0.1:1", "--tls-dir", str(pki["alone"])]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ferry: tls: cannot read") and str(key) in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_every_rpc_has_an_access_rule() -> None:
    methods = set(pb.DESCRIPTOR.services_by_name["Agent"].methods_by_name)
    assert methods == set(access.ALLOWED)


# -- the handshake -----------------------------------------------------------------------


def test_a_client_certificate_of_the_cluster_is_served(pki, tls_agent) -> None:
    _, address = tls_agent
    info = call(address, tls.load(pki["ours"], "alice"), "GetInfo", pb.GetInfoRequest())
    assert info.node_name == "nodea"  # type: ignore[attr-defined]


def test_no_certificate_is_refused_at_the_handshake(tls_agent) -> None:
    _, address = tls_agent
    creds = grpc.ssl_channel_credentials(tls_agent_ca(tls_agent))
    with grpc.secure_channel(address, creds) as ch, pytest.raises(grpc.RpcError) as ei:
        pb_stub(ch).ListJobs(pb.ListJobsRequest(), timeout=10)
    assert ei.value.code() is S.UNAVAILABLE  # gRPC's word for a refused handshake


def test_a_certificate_from_another_ca_is_unauthenticated(pki, tls_agent) -> None:
    _, address = tls_agent
    mallory = tls.load(pki["other"], "mallory")
    # Mallory trusts our CA for the server, but her own certificate is signed by hers.
    mallory = dataclasses.replace(mallory, ca=tls_agent_ca(tls_agent))
    with pytest.raises(UnauthenticatedError, match="refused our certificate \\(mallory\\)"):
        call(address, mallory, "ListJobs", pb.ListJobsRequest())


def test_an_agent_whose_certificate_does_not_name_the_host_is_refused(pki, tmp_path) -> None:
    """The source checks that the target's certificate names the address it was asked to use."""
    ident = tls.load(pki["ours"], "elsewhere", certs.Role.NODE)  # names 10.9.9.9 only
    svc = AgentNode(tmp_path / "s", "elsewhere", tmp_path / "st", criu=FakeCriu("x"), dial=client.Dial(ident))
    server, port = create_server("127.0.0.1:0", svc, max_workers=2, identity=ident)
    server.start()
    try:
        with pytest.raises(UnauthenticatedError, match="presented a certificate we do not accept"):
            call(f"127.0.0.1:{port}", tls.load(pki["ours"], "alice"), "GetInfo", pb.GetInfoRequest())
    finally:
        server.stop(None).wait()


def test_plaintext_to_a_tls_agent_fails(tls_agent) -> None:
    _, address = tls_agent
    with pytest.raises(UnavailableError, match="is unreachable"):
        call(address, None, "ListJobs", pb.ListJobsRequest())


def test_tls_to_a_plaintext_agent_says_the_server_does_not_speak_tls(pki, tmp_path) -> None:
    """Not "refused our certificate": our certificate is not the problem."""
    svc = AgentNode(tmp_path / "s", "nodea", tmp_path / "st", criu=FakeCriu("x"))
    server, port = create_server("127.0.0.1:0", svc, max_workers=2)  # --insecure
    server.start()
    try:
        with pytest.raises(UnauthenticatedError, match=r"does not speak TLS \(WRONG_VERSION_NUMBER\)") as ei:
            call(f"127.0.0.1:{port}", tls.load(pki["ours"], "alice"), "ListJobs", pb.ListJobsRequest())
        assert "refused our certificate" not in str(ei.value) and "--insecure" in str(ei.value)
    finally:
        server.stop(None).wait()


# -- roles -------------------------------------------------------------------------------


def test_a_client_may_not_speak_the_peer_protocol(pki, tls_agent, caplog) -> None:
    _, address = tls_agent
    caplog.set_level(logging.WARNING, logger="agent.service.access")
    with pytest.raises(PermissionDeniedError, match="client alice may not call Prepare"):
        call(address, tls.load(pki["ours"], "alice"), "Prepare", prepare_req())
    assert "refused Prepare to client alice" in caplog.text


def test_a_node_may_not_run_jobs(pki, tls_agent) -> None:
    _, address = tls_agent
    req = pb.RunRequest(name="x", command=["true"], cwd="/")
    with pytest.raises(PermissionDeniedError, match="node nodeb may not call Run"):
        call(address, tls.load(pki["ours"], "nodeb"), "Run", req)


def test_a_node_may_prepare_only_as_itself(pki, tls_agent) -> None:
    _, address = tls_agent
    nodeb = tls.load(pki["ours"], "nodeb")
    with pytest.raises(
        PermissionDeniedError, match="'nodeb' may not prepare a migration on behalf of 'nodez'"
    ):
        call(address, nodeb, "Prepare", prepare_req(source="nodez"))
    lease = call(address, nodeb, "Prepare", prepare_req())
    assert lease.node_name == "nodea"  # type: ignore[attr-defined]


def test_only_the_preparing_node_may_act_on_a_migration(pki, tls_agent) -> None:
    svc, address = tls_agent
    call(address, tls.load(pki["ours"], "nodeb"), "Prepare", prepare_req("m7"))
    other = tls.load(pki["ours"], "nodea")  # a valid node certificate, but not the one that prepared
    for method, req in [
        ("Abort", pb.AbortRequest(migration_id="m7", reason="hijack")),
        ("Commit", pb.CommitRequest(migration_id="m7")),
        ("GetMigration", pb.GetMigrationRequest(migration_id="m7")),
    ]:
        with pytest.raises(PermissionDeniedError, match="belongs to node 'nodeb'"):
            call(address, other, method, req)
    assert svc.targets.status("m7", "nodeb") == pb.TARGET_STATE_PREPARED


# -- helpers -----------------------------------------------------------------------------


def tls_agent_ca(agent: tuple[AgentNode, str]) -> bytes:
    svc, _ = agent
    assert svc.dial.identity is not None
    return svc.dial.identity.ca


def pb_stub(ch: grpc.Channel):
    from agent.rpc import pb_grpc

    return pb_grpc.AgentStub(ch)

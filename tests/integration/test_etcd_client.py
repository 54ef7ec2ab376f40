"""agent.coord.etcd against a real etcd over mutual TLS (agent.testing.etcd): keys, the
create-once race, leases and their loss, watches, refused certificates, a restarted server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import certs
from agent.coord.etcd import EtcdClient
from agent.errors import FerryError, NotFoundError, UnauthenticatedError, UnavailableError
from agent.testing.etcd import EtcdServer, have_etcd
from agent.testing.poll import wait_for

pytestmark = pytest.mark.skipif(
    not have_etcd(), reason="no etcd binary: `make etcd` installs Debian's etcd-server"
)


@pytest.fixture(scope="session", autouse=True)
def _criu_present() -> None:
    """Overrides the integration suite's CRIU check: these tests need etcd, not CRIU."""


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    certs.create_ca(d)
    certs.issue(d, "node-a", certs.Role.NODE, ["127.0.0.1"])
    return d


@pytest.fixture
def server(pki: Path, tmp_path: Path) -> Iterator[EtcdServer]:
    with EtcdServer(pki, data_dir=tmp_path / "etcd") as s:
        yield s


def connect(server: EtcdServer, pki: Path, name: str = "node-a", **kw: float) -> EtcdClient:
    read = lambda f: (pki / f).read_bytes()  # noqa: E731
    return EtcdClient([server.endpoint], read("ca.pem"), read(f"{name}.pem"), read(f"{name}-key.pem"), **kw)


@pytest.fixture
def client(server: EtcdServer, pki: Path) -> Iterator[EtcdClient]:
    with connect(server, pki) as c:
        yield c


def test_put_get_prefix_delete_and_swap(client: EtcdClient) -> None:
    client.put("/ferry/nodes/a", "1")
    client.put("/ferry/nodes/b", b"2")
    client.put("/ferry/nodesX", "not under the prefix")
    assert client.get("/ferry/nodes/a").value == b"1"  # type: ignore[union-attr]
    assert client.get("/ferry/none") is None
    assert [kv.key for kv in client.get_prefix("/ferry/nodes/")] == [b"/ferry/nodes/a", b"/ferry/nodes/b"]

    kv = client.get("/ferry/nodes/a")
    assert kv is not None
    assert client.compare_and_swap("/ferry/nodes/a", "3", kv.mod_revision)
    assert not client.compare_and_swap("/ferry/nodes/a", "4", kv.mod_revision)  # stale read
    assert client.get("/ferry/nodes/a").value == b"3"  # type: ignore[union-attr]

    assert client.delete("/ferry/nodes/", prefix=True) == 2
    assert client.get_prefix("/ferry/nodes/") == []


def test_of_eight_racing_creators_exactly_one_wins(server: EtcdServer, pki: Path) -> None:
    clients = [connect(server, pki) for _ in range(8)]
    start = threading.Barrier(len(clients))
    won: dict[int, bool] = {}

    def race(i: int) -> None:
        start.wait()
        won[i] = clients[i].create_if_absent("/ferry/spares/gpu0", f"claimer-{i}")

    threads = [threading.Thread(target=race, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    winners = [i for i, w in won.items() if w]
    assert len(won) == 8 and len(winners) == 1, won
    assert clients[0].get("/ferry/spares/gpu0").value == f"claimer-{winners[0]}".encode()  # type: ignore[union-attr]
    for c in clients:
        c.close()


def test_a_leases_keys_vanish_after_its_ttl_once_keep_alive_stops(client: EtcdClient) -> None:
    lease = client.grant(2)
    lost: list[FerryError] = []
    client.put("/ferry/alive/a", "up", lease=lease.id)
    keeper = client.keep_alive(lease, lost.append, interval_s=0.5)
    time.sleep(3)  # longer than the TTL: only the keep-alive holds the key
    assert client.get("/ferry/alive/a") is not None
    assert 0 < client.time_to_live(lease.id) <= 2
    keeper.stop()
    wait_for("the lease's key to expire", lambda: client.get("/ferry/alive/a") is None, timeout_s=6)
    assert client.time_to_live(lease.id) == -1
    assert lost == []  # stopped on purpose: not lost


def test_a_revoked_lease_is_reported_lost(client: EtcdClient) -> None:
    lease = client.grant(5)
    lost = threading.Event()
    errors: list[FerryError] = []
    keeper = client.keep_alive(lease, lambda e: (errors.append(e), lost.set()), interval_s=0.2)
    client.revoke(lease.id)  # as another node (or an operator) would
    assert lost.wait(5)
    assert isinstance(errors[0], NotFoundError) and "expired or was revoked" in str(errors[0])
    assert keeper.lost is errors[0]


def test_a_lease_that_cannot_be_renewed_is_lost_within_its_ttl(server: EtcdServer, pki: Path) -> None:
    client = connect(server, pki, timeout_s=1.0)
    lease = client.grant(2)
    lost = threading.Event()
    errors: list[FerryError] = []
    client.keep_alive(lease, lambda e: (errors.append(e), lost.set()), interval_s=0.5)
    server.kill()
    killed = time.monotonic()
    assert lost.wait(6), "the keep-alive never gave up on an unreachable etcd"
    # Within the TTL of the last renewal: a node fences itself before etcd drops its keys.
    assert time.monotonic() - killed <= 2.5
    assert isinstance(errors[0], UnavailableError)
    assert "not renewed for 2 s" in str(errors[0]) and server.endpoint in str(errors[0])
    client.close()


def test_a_watch_sees_a_put_and_a_delete(client: EtcdClient) -> None:
    watch = client.watch_prefix("/ferry/epochs/")
    client.put("/ferry/epochs/job1", "7")
    client.put("/ferry/other", "not watched")
    client.delete("/ferry/epochs/job1")
    first, second = watch.get(5), watch.get(5)
    assert first is not None and (first.kind, first.kv.key, first.kv.value) == (
        "put",
        b"/ferry/epochs/job1",
        b"7",
    )
    assert second is not None and (second.kind, second.kv.key) == ("delete", b"/ferry/epochs/job1")
    assert watch.revision == second.kv.mod_revision
    watch.cancel()
    assert watch.get(5) is None  # ended, not broken
    assert list(watch) == []


def test_a_client_without_a_certificate_is_refused(server: EtcdServer, pki: Path) -> None:
    c = EtcdClient([server.endpoint], (pki / "ca.pem").read_bytes(), timeout_s=2)
    with c, pytest.raises(UnauthenticatedError) as refused:
        c.put("/ferry/x", "1")
    text = str(refused.value)
    assert text.startswith(f"etcd put on {server.endpoint}: etcd refused the TLS handshake")
    assert "no client certificate" in text and "--trusted-ca-file" in text


def test_a_certificate_from_another_ca_is_refused(server: EtcdServer, tmp_path: Path, pki: Path) -> None:
    other = tmp_path / "other-pki"
    certs.create_ca(other)
    certs.issue(other, "mallory", certs.Role.NODE, ["127.0.0.1"])
    # Trusting our CA, presenting theirs: etcd refuses the client.
    (other / "ours.pem").write_bytes((pki / "ca.pem").read_bytes())
    read = lambda f: (other / f).read_bytes()  # noqa: E731
    c = EtcdClient([server.endpoint], read("ours.pem"), read("mallory.pem"), read("mallory-key.pem"))
    with c, pytest.raises(UnauthenticatedError, match="we sent a client certificate it accepts"):
        c.get("/ferry/x")
    # Trusting only theirs: we refuse etcd's certificate.
    c = EtcdClient([server.endpoint], read("ca.pem"), read("mallory.pem"), read("mallory-key.pem"))
    with c, pytest.raises(UnauthenticatedError) as refused:
        c.get("/ferry/x")
    assert f"etcd get on {server.endpoint}: etcd presented a certificate our CA does not accept" in str(
        refused.value
    )
    assert "CERTIFICATE_VERIFY_FAILED" in str(refused.value)


def test_a_restart_shorter_than_the_ttl_keeps_the_client_and_the_lease(
    server: EtcdServer, client: EtcdClient
) -> None:
    lease = client.grant(3)
    lost: list[FerryError] = []
    client.keep_alive(lease, lost.append, interval_s=0.5)
    client.put("/ferry/alive/a", "up", lease=lease.id)
    watch = client.watch_prefix("/ferry/")
    server.restart(down_s=1.0)
    assert client.get("/ferry/alive/a") is not None  # the next call works, on the same client
    client.put("/ferry/after", "restart")
    with pytest.raises(UnavailableError, match=f"etcd watch on {server.endpoint}"):
        watch.get(5)  # a watch breaks with its stream ...
    again = client.watch_prefix("/ferry/", start_revision=watch.revision + 1)
    seen = again.get(5)  # ... and resumes where it broke, missing nothing
    assert seen is not None and seen.kv.key == b"/ferry/after"
    time.sleep(4)  # past the TTL: the keep-alive carried on after the restart
    assert client.get("/ferry/alive/a") is not None
    assert lost == []


def test_an_unreachable_endpoint_names_itself_and_what_to_do(pki: Path) -> None:
    dead = EtcdServer(pki)  # never started: nothing listens on its port
    read = lambda f: (pki / f).read_bytes()  # noqa: E731
    with (
        EtcdClient(
            [dead.endpoint], read("ca.pem"), read("node-a.pem"), read("node-a-key.pem"), timeout_s=1
        ) as c,
        pytest.raises(UnavailableError) as down,
    ):
        c.get("/ferry/x")
    assert str(down.value).startswith(f"etcd get on {dead.endpoint}: etcd cannot be reached")
    assert f"check that etcd runs and listens on {dead.endpoint}" in str(down.value)
    dead.close()


def test_a_put_guarded_by_a_claim_lands_only_while_the_claim_holds_on_its_lease(client: EtcdClient) -> None:
    lease, other = client.grant(30), client.grant(30)
    client.put("/ferry/claim", "me", lease=lease.id)
    assert client.put_if_held("/ferry/claim", "me", lease.id, "/ferry/snap", "1")
    assert not client.put_if_held("/ferry/claim", "me", other.id, "/ferry/snap", "2")  # a later lease's
    assert not client.put_if_held("/ferry/claim", "you", lease.id, "/ferry/snap", "3")
    client.revoke(lease.id)
    assert not client.put_if_held("/ferry/claim", "me", lease.id, "/ferry/snap", "4")  # it went with it
    assert client.get("/ferry/snap").value == b"1"  # type: ignore[union-attr]

"""Real agents over mutual TLS with certificates from `ferry certs`, and the CLI as a remote client."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent import tls
from agent.client import Dial, PeerClients
from agent.errors import FerryError
from tests.integration.jobtools import assert_completed_exactly_once, run_training, wait_steps


@pytest.fixture
def pki(tmp_path: Path, agents) -> dict[str, Path]:
    """A cluster CA, node certificates for node-a and node-b (127.0.0.1), a client, and a stranger."""
    ours, other = tmp_path / "pki", tmp_path / "other-pki"

    def certs(*args: str) -> None:
        cmd = [sys.executable, "-m", "agent.cli.main", "certs", *args]
        subprocess.run(cmd, check=True, capture_output=True)

    certs("ca", "--dir", str(ours))
    for node in ("node-a", "node-b"):
        certs("node", node, "--host", "127.0.0.1", "--dir", str(ours))
    certs("client", "alice", "--dir", str(ours))
    certs("ca", "--dir", str(other))
    certs("client", "mallory", "--dir", str(other))
    (other / "ca.pem").write_bytes((ours / "ca.pem").read_bytes())  # she trusts our agents, not vice versa
    return {"ours": ours, "other": other}


def remote(agent, address: str, tls_dir: Path, name: str, cmd: str, *args: str):
    """`ferry CMD` from another machine: TCP with a certificate (options before `run`'s `--`)."""
    conn = ["--agent", address, "--tls-dir", str(tls_dir), "--tls-name", name]
    return agent.cli(cmd, *conn, *args, check=False)


def test_a_job_moves_between_agents_over_mutual_tls(agents, pki) -> None:
    a = agents("node-a", tls_dir=pki["ours"])
    b = agents("node-b", tls_dir=pki["ours"])
    run_training(a, "train", steps=40)
    wait_steps(a, "train", 5)
    out = a.cli("migrate", "train", "--to", b.address).stdout
    assert "moved node-a -> node-b" in out
    assert_completed_exactly_once(b, "train", steps=40)
    assert "mutual TLS as node-a" in a.log_path.read_text()


def test_remote_clients_need_a_certificate_with_the_right_role(agents, pki) -> None:
    a = agents("node-a", tls_dir=pki["ours"])

    p = remote(a, a.address, pki["ours"], "alice", "ps")
    assert p.returncode == 0, p.stderr
    assert "no jobs" in p.stdout

    p = remote(a, a.address, pki["other"], "mallory", "ps")
    assert p.returncode == 1
    assert "refused our certificate (mallory)" in p.stderr

    # A node certificate is for the peer protocol: it may not start jobs.
    p = remote(a, a.address, pki["ours"], "node-b", "run", "--name", "x", "--", "true")
    assert p.returncode == 1
    assert "node node-b may not call Run" in p.stderr
    assert "refused Run to node node-b" in a.log_path.read_text()

    p = a.cli("ps", "--agent", a.address, "--insecure", check=False)
    assert p.returncode == 1 and "is unreachable" in p.stderr  # plaintext never reaches a TLS agent

    assert [j["name"] for j in json.loads(a.cli("ps", "--json").stdout)] == []  # nothing ran


def test_an_agent_refuses_to_start_without_its_certificate(agents, pki, tmp_path) -> None:
    with pytest.raises(RuntimeError, match="ferry certs node node-c"):
        agents("node-c", tls_dir=pki["ours"])


def test_a_kept_channel_reaches_a_peer_agent_again_once_it_restarted(agents, pki) -> None:
    """An agent's small calls to a peer (pings, pace, a snapshot round's steps) go over one kept
    channel (client.PeerClients): while the peer agent is down they fail, and once it serves again
    on its address the same channel reaches it, without a new client."""
    b = agents("node-b", tls_dir=pki["ours"])
    peers = PeerClients(Dial(identity=tls.load(pki["ours"], "node-a")))
    try:
        kept = peers.get(b.address)
        assert peers.get(b.address) is kept, "one client per peer"
        assert kept.info(timeout_s=5).node_name == "node-b"
        b.stop()
        down = time.monotonic()
        while time.monotonic() - down < 3:
            with pytest.raises(FerryError):
                kept.info(timeout_s=0.5)
            time.sleep(0.2)
        b.start()
        t0 = time.monotonic()
        while True:
            try:
                assert kept.info(timeout_s=0.5).node_name == "node-b"
                break
            except FerryError:
                assert time.monotonic() - t0 < 2.5, "the kept channel stayed away from a restarted peer"
                time.sleep(0.05)
    finally:
        peers.close()

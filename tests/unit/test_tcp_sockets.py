"""A process tree's TCP connections as the drain before a cut reads them
(agent.migration.tcp_sockets): from the processes' own sockets, each once, only established TCP
ones, in flight while segments they sent await their acknowledgement."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from agent.migration import tcp_sockets


def test_an_established_connection_is_found_once_with_its_addresses() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    again = os.dup(client.fileno())  # one socket behind two fds: one connection
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.connect(("127.0.0.1", 9))
    try:
        here = f"127.0.0.1:{client.getsockname()[1]}"
        there = f"127.0.0.1:{listener.getsockname()[1]}"
        conns = tcp_sockets.connections([os.getpid()])
        mine = [c for c in conns if c.local == here]
        assert len(mine) == 1 and mine[0].peer == there
        assert not mine[0].in_flight  # loopback acknowledges at once
        # The accepted end is one too; the listener and the UDP socket are not connections.
        assert [c.peer for c in conns if c.local == there] == [here]
        assert all(c.local != f"127.0.0.1:{udp.getsockname()[1]}" for c in conns)
    finally:
        os.close(again)
        for s in (client, server, listener, udp):
            s.close()


def test_ipv6_addresses_are_bracketed() -> None:
    try:
        listener = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    client = socket.create_connection(("::1", listener.getsockname()[1]))
    server, _ = listener.accept()
    try:
        conns = {c.local: c for c in tcp_sockets.connections([os.getpid()])}
        here = f"[::1]:{client.getsockname()[1]}"
        assert conns[here].peer == f"[::1]:{listener.getsockname()[1]}"
    finally:
        for s in (client, server, listener):
            s.close()


def test_a_gone_root_raises_and_a_gone_child_is_skipped() -> None:
    with pytest.raises(OSError):
        tcp_sockets.connections([2**22 + 1])  # above pid_max's default: no such process
    assert isinstance(tcp_sockets.connections([os.getpid(), 2**22 + 1]), list)


# Run in a network namespace of its own: a connection over its loopback, which then goes down,
# so that what the client sends next is never acknowledged.
UNACKED = textwrap.dedent(
    """
    import json, os, socket, subprocess, time
    from agent.migration import tcp_sockets
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    before = tcp_sockets.in_flight([os.getpid()])
    subprocess.run(["ip", "link", "set", "lo", "down"], check=True)
    client.send(b"x" * 1000)
    time.sleep(0.05)
    print(json.dumps({"before": before, "after": tcp_sockets.in_flight([os.getpid()]),
                      "server": f"127.0.0.1:{server.getsockname()[1]}"}))
    """
)


@pytest.mark.skipif(os.geteuid() != 0, reason="a network namespace of its own needs root")
def test_bytes_sent_and_not_acknowledged_are_in_flight() -> None:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        ["unshare", "--net", sys.executable, "-c", UNACKED],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": repo},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    assert said["before"] == []
    # The client's bytes await the server's ACK; the server sent nothing, so it holds none.
    assert said["after"] == [said["server"]]


def test_sockets_found_once_are_asked_again_as_they_are_now() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    here = f"127.0.0.1:{client.getsockname()[1]}"
    try:
        with tcp_sockets.Sockets([os.getpid()]) as socks:
            assert here in {c.local for c in socks.connections()}
            late = socket.create_connection(listener.getsockname())  # after the look: not found
            server.shutdown(socket.SHUT_RDWR)  # the peer's FIN: no longer established
            time.sleep(0.05)
            assert here not in {c.local for c in socks.connections()}
            assert f"127.0.0.1:{late.getsockname()[1]}" not in {c.local for c in socks.connections()}
            late.close()
    finally:
        for s in (client, server, listener):
            s.close()


def test_an_fd_closed_since_the_listing_is_skipped_and_a_refused_duplicate_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    try:

        def closed(pidfd: int, fd: int) -> int:
            raise OSError(errno.EBADF, "pidfd_getfd: Bad file descriptor")

        monkeypatch.setattr(tcp_sockets, "getfd", closed)
        assert tcp_sockets.connections([os.getpid()]) == []

        def refused(pidfd: int, fd: int) -> int:
            raise OSError(errno.EPERM, "pidfd_getfd: Operation not permitted")

        monkeypatch.setattr(tcp_sockets, "getfd", refused)
        with pytest.raises(OSError, match="not permitted"):  # the drain says so, not "nothing held"
            tcp_sockets.connections([os.getpid()])
    finally:
        listener.close()

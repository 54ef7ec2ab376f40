"""What CRIU cannot dump, read from /proc of real processes that hold it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.criu.dumpable import ProcFs, obstacles, refuse_undumpable
from agent.errors import RefusedError

HOLDER = textwrap.dedent(
    """
    import ctypes, os, socket, sys
    kind = sys.argv[1]
    keep = []
    if kind == "io_uring":
        params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
        fd = ctypes.CDLL(None, use_errno=True).syscall(425, 4, params)
        if fd < 0:
            sys.exit(f"io_uring_setup: errno {ctypes.get_errno()}")
        keep.append(fd)
    elif kind == "vsock":
        keep.append(socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM))
    elif kind == "raw":
        keep.append(socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP))
    elif kind == "fine":
        keep += [socket.socket(), socket.socket(socket.AF_INET, socket.SOCK_DGRAM),
                 socket.socket(socket.AF_UNIX), socket.socket(socket.AF_INET, socket.SOCK_RAW, 1),
                 open("/dev/null"), open("/dev/urandom", "rb"), os.eventfd(0)]
    elif kind == "shm":
        keep.append(open(sys.argv[2], "w"))
    print("ready", flush=True)
    sys.stdin.read()
    """
)


@pytest.fixture
def holder() -> Iterator:
    procs: list[subprocess.Popen[str]] = []

    def start(kind: str, *args: str) -> int:
        p = subprocess.Popen(
            [sys.executable, "-c", HOLDER, kind, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(p)
        line = p.stdout.readline() if p.stdout else ""
        if line.strip() != "ready":
            p.wait(5)
            pytest.skip(f"this kernel offers no {kind}: {p.stderr.read().strip() if p.stderr else ''}")
        return p.pid

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_io_uring_is_an_obstacle_with_its_fix(holder) -> None:
    pid = holder("io_uring")
    found = obstacles([pid])
    assert [o.why for o in found] == ["CRIU cannot dump io_uring"]
    assert "anon_inode:[io_uring]" in found[0].what and "ferry run" in found[0].fix
    with pytest.raises(RefusedError) as ei:
        refuse_undumpable([pid], "nodea")
    assert ei.value.step == "prepare" and f"pid {pid} fd" in ei.value.cause
    assert "nothing was frozen" in ei.value.hint


def test_a_socket_family_criu_lacks_is_named(holder) -> None:
    pid = holder("vsock")
    assert [o.why for o in obstacles([pid])] == [
        "CRIU cannot dump a socket of family AF_VSOCK (only unix, inet, inet6, packet and netlink)"
    ]


@pytest.mark.skipif(os.geteuid() != 0, reason="raw sockets need root")
def test_a_raw_socket_other_than_icmp_is_named(holder) -> None:
    pid = holder("raw")
    assert [o.why for o in obstacles([pid])] == [
        "CRIU cannot dump a raw inet socket of protocol 17 (only ICMP)"
    ]


@pytest.mark.skipif(os.geteuid() != 0, reason="an ICMP raw socket needs root")
def test_what_criu_dumps_is_no_obstacle(holder) -> None:
    assert obstacles([holder("fine")]) == []


def test_host_shared_memory_is_an_obstacle_only_when_leaving_the_node(holder, tmp_path: Path) -> None:
    shm = Path("/dev/shm") / f"ferry-test-{os.getpid()}"
    try:
        pid = holder("shm", str(shm))
        found = obstacles([pid])  # the holder shares this process's mount namespace
        assert len(found) == 1 and "this node's shared memory" in found[0].why
        assert str(shm) in found[0].what
        refuse_undumpable([pid], "nodea", same_node=True)  # a checkpoint comes back here: fine
        assert obstacles([pid], ProcFs(), agent_mount_ns="mnt:[other]") == []  # its own /dev/shm
    finally:
        shm.unlink(missing_ok=True)


def test_an_unknown_character_device_is_named(tmp_path: Path) -> None:
    class Fake(ProcFs):
        def fds(self, pid: int) -> list[tuple[int, str, int, int]]:
            import stat

            return [
                (3, "/dev/kvm", stat.S_IFCHR | 0o600, os.makedev(10, 232)),
                (4, "/dev/null", stat.S_IFCHR, 259),
            ]

        def maps(self, pid: int) -> list[str]:
            return []

    found = obstacles([1], Fake(), agent_mount_ns="")
    assert [o.why for o in found] == ["CRIU cannot dump character device 10:232"]


def test_a_socket_that_cannot_be_duplicated_is_left_to_criu() -> None:
    class Gone(ProcFs):
        def fds(self, pid: int) -> list[tuple[int, str, int, int]]:
            return [(5, "socket:[123]", 0o140777, 0)]

    assert obstacles([2**22 + 7], Gone(), agent_mount_ns="") == []
    assert socket.AF_UNIX  # the family table imports cleanly

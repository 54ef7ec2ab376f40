"""What keeps a tree's written memory tracked between dumps: the userfaultfds a tracked dump
hands over (agent.criu.tracking), and the RPC answer that carries them (agent.criu.swrk).

Plain descriptors (pipes) stand in for userfaultfds here: what is under test is who holds them
and when they are closed; tests/integration/test_dirty_tracking.py dumps real processes."""

from __future__ import annotations

import os
import socket

import pytest

from agent.criu import swrk
from agent.criu import tracking as tracking_mod
from agent.criu.tracking import DirtyTrackers
from agent.criu_pb import rpc_pb2


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _fds(n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        r, w = os.pipe()
        os.close(w)
        out.append(r)
    return out


def test_a_trees_descriptors_are_kept_across_increments_and_closed_before_a_whole_dump(sleeper) -> None:
    child, _, _ = sleeper()
    t = DirtyTrackers()
    first, second = _fds(2), _fds(1)
    t.keep(child.pid, first)
    t.before_dump(child.pid, whole=False)  # an increment: what tracks the tree stays
    t.keep(child.pid, second)
    assert t.held(child.pid) == 3 and all(map(_is_open, first + second))
    t.before_dump(child.pid, whole=True)  # whole: tracking starts afresh, one descriptor a task
    assert t.held(child.pid) == 0 and not any(map(_is_open, first + second))


def test_an_ended_trees_descriptors_are_closed_at_the_next_dump_of_any_tree(sleeper) -> None:
    child, _, _ = sleeper()
    t = DirtyTrackers()
    fds = _fds(2)
    t.keep(child.pid, fds)
    child.kill()
    child.wait()
    t.before_dump(os.getpid(), whole=False)
    assert t.held(child.pid) == 0 and not any(map(_is_open, fds))


def test_a_reused_pid_is_another_tree(sleeper, monkeypatch: pytest.MonkeyPatch) -> None:
    child, _, _ = sleeper()
    t = DirtyTrackers()
    old = _fds(1)
    t.keep(child.pid, old)
    started = tracking_mod.procs.create_time(child.pid)
    monkeypatch.setattr(tracking_mod.procs, "create_time", lambda pid: started + 7.0)
    new = _fds(1)
    t.keep(child.pid, new)  # the PID now names a process that started later
    assert t.held(child.pid) == 1 and not _is_open(old[0]) and _is_open(new[0])
    t.close()
    assert not _is_open(new[0])


def test_a_tree_holding_too_many_is_tracked_afresh(sleeper, monkeypatch: pytest.MonkeyPatch) -> None:
    child, _, _ = sleeper()
    monkeypatch.setattr(tracking_mod, "MAX_FDS_PER_TREE", 3)
    t = DirtyTrackers()
    fds = _fds(4)
    t.keep(child.pid, fds[:3])
    assert t.held(child.pid) == 3
    t.keep(child.pid, fds[3:])
    assert t.held(child.pid) == 0 and not any(map(_is_open, fds))


def test_the_answer_and_the_descriptors_beside_it_are_read_together() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sent = _fds(2)
    resp = rpc_pb2.criu_resp(type=rpc_pb2.DUMP, success=True)
    socket.send_fds(theirs, [resp.SerializeToString()], sent)
    data, got = swrk.ask(ours, rpc_pb2.criu_req(type=rpc_pb2.DUMP), 5.0)
    assert rpc_pb2.criu_resp.FromString(data).success and len(got) == 2
    assert [os.fstat(a).st_ino for a in got] == [os.fstat(b).st_ino for b in sent]
    tracking_mod.close_fds(got + sent)
    ours.close()
    theirs.close()

"""The target's core (issue 27): slow work runs outside its protocol lock, so GetMigration (the
source's fencing query, 10 s deadline) answers at once; finished migrations leave its table; and
an ended local job's record goes only once the arriving job commits here."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fakes import FakeCriu, FakePageServer, is_dead
from test_migrate_target import MID, broken_stream, delivered, prepare_req, running_record, staged, state

from agent.errors import PermissionDeniedError
from agent.jobs import procs
from agent.jobs.record import JobKind, JobRecord, JobState
from agent.migration.journal import TARGET
from agent.migration.states import TargetState
from agent.migration.target import TargetMigrations
from agent.rpc import pb

#: How long a slow part takes to die here; GetMigration must answer well within SLOW_S.
SLOW_S = 3.0
ANSWER_S = 1.0


class SlowPageServer(FakePageServer):
    """A page server that takes SLOW_S to die (a CRIU stuck in a write to a full disk, say)."""

    killed = threading.Event()

    def kill(self) -> None:
        if not SlowPageServer.killed.is_set():  # slow once: a second kill finds it dead
            SlowPageServer.killed.set()
            time.sleep(SLOW_S)
        super().kill()


def answers_while(target: TargetMigrations, slow: threading.Event, act: Callable[[], None]) -> list[float]:
    """Run `act` in a thread; once `slow` is set (the slow part began), time status() calls."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            act()
        except BaseException as e:
            failed.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert slow.wait(10), "the slow part never began"
    took = []
    for _ in range(3):
        t0 = time.monotonic()
        state(target)
        took.append(time.monotonic() - t0)
    rec = target.journal.get(TARGET, MID)
    assert rec is not None and rec.state != "aborted", "aborted on disk before anything was gone"
    t.join(30)
    assert not t.is_alive()
    return took


def test_get_migration_answers_while_a_dropped_page_server_is_slow_to_die(
    target: TargetMigrations, fake_criu: FakeCriu, monkeypatch: pytest.MonkeyPatch
) -> None:
    SlowPageServer.killed = threading.Event()
    monkeypatch.setattr(
        fake_criu,
        "page_server",
        lambda images_dir, log_dir=None, *, address, tls: SlowPageServer(images_dir / "pages-65537.img"),
    )
    target.prepare(prepare_req())
    answers = target.stream_pages(iter([pb.PageData(migration_id=MID)]))
    next(answers)  # the page server listens: STREAMING
    assert state(target) == pb.TARGET_STATE_RECEIVING

    took = answers_while(target, SlowPageServer.killed, lambda: target.abort(MID, "the source gave up"))

    assert max(took) < ANSWER_S, took
    assert state(target) == pb.TARGET_STATE_ABORTED
    assert staged(target) == []  # the drop still removed everything, only outside the lock


class SlowNetwork:
    """A job network whose `ip link del` takes SLOW_S (a busy netlink, say)."""

    enabled = True

    def __init__(self) -> None:
        self.deleting = threading.Event()
        self.deleted: list[str] = []

    def delete(self, veth: str) -> None:
        self.deleting.set()
        time.sleep(SLOW_S)
        self.deleted.append(veth)


def test_get_migration_answers_while_a_failed_post_copy_ends_the_job_here(
    target: TargetMigrations, sleeper
) -> None:
    """The job's link goes and the job is killed outside the lock; meanwhile GetMigration must not
    say ABORTED (the source would resume while the copy here still lives), nor wait."""
    target.prepare(prepare_req(lazy=True))
    net = SlowNetwork()
    target.registry.network = net  # type: ignore[assignment]
    proc, _, _ = sleeper()
    rec = JobRecord(
        name="train",
        kind=JobKind.LAUNCHED,
        state=JobState.RUNNING,
        pid=proc.pid,
        command=["x"],
        cwd="/",
        veth="fv-train",
    )
    rec.pid_started = procs.create_time(proc.pid)
    target.registry.save(rec)
    seen: list[int] = []

    def restored_and_released() -> None:  # what a commit does while the stream waits
        _restored(target)

    def fail() -> None:
        list(target.stream_pages(broken_stream(MID, restored_and_released)))

    def watch() -> None:
        net.deleting.wait(10)
        seen.append(state(target))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    took = answers_while(target, net.deleting, fail)
    watcher.join(10)

    assert max(took) < ANSWER_S, took
    assert seen and seen[0] not in (pb.TARGET_STATE_ABORTED, pb.TARGET_STATE_UNKNOWN), seen
    proc.wait(10)
    assert is_dead(proc.pid) and net.deleted == ["fv-train"]
    assert target.registry.get("train").state is JobState.LOST
    assert state(target) == pb.TARGET_STATE_ABORTED


def _restored(target: TargetMigrations) -> None:
    """A post-copy migration restored and released, as a commit leaves it (the fake CRIU restores
    nothing lazily)."""
    target._incoming[MID].state = TargetState.POSTCOPY


# -- the table is pruned -------------------------------------------------------------------


def test_an_aborted_migration_leaves_the_table_and_the_journal_still_answers(
    target: TargetMigrations,
) -> None:
    target.prepare(prepare_req(), caller="nodea")
    target.abort(MID, "the source gave up", caller="nodea")
    assert MID not in target._incoming
    assert target.status(MID, "nodea") == pb.TARGET_STATE_ABORTED
    with pytest.raises(PermissionDeniedError):
        target.status(MID, "nodec")


def test_a_committed_migration_leaves_the_table_and_still_reads_running(
    target: TargetMigrations, tmp_path: Path
) -> None:
    delivered(target, tmp_path)
    target.commit(pb.CommitRequest(migration_id=MID))
    assert MID not in target._incoming
    assert state(target) == pb.TARGET_STATE_RUNNING


def test_expired_leases_leave_the_table(target: TargetMigrations) -> None:
    for i in range(5):
        target.prepare(prepare_req(f"m-{i}", f"job{i}"))
        target._incoming[f"m-{i}"].expires_at = 0
        target.expire()
    assert target._incoming == {}
    assert all(state(target, f"m-{i}") == pb.TARGET_STATE_ABORTED for i in range(5))


# -- an ended local job of the same name ---------------------------------------------------


def test_an_aborted_lease_costs_an_ended_job_of_the_same_name_nothing(target: TargetMigrations) -> None:
    target.registry.save(running_record("train", JobState.MOVED))
    (target.registry.job_dir("train") / "stdout.log").write_text("old output\n")
    target.prepare(prepare_req())
    target.abort(MID, "the source's dump failed")
    assert target.registry.get("train").state is JobState.MOVED
    assert (target.registry.job_dir("train") / "stdout.log").read_text() == "old output\n"


def test_an_expired_lease_costs_an_ended_job_of_the_same_name_nothing(target: TargetMigrations) -> None:
    target.registry.save(running_record("train", JobState.EXITED))
    (target.registry.job_dir("train") / "stdout.log").write_text("old output\n")
    target.prepare(prepare_req())
    target._incoming[MID].expires_at = 0
    target.expire()
    assert state(target) == pb.TARGET_STATE_ABORTED
    assert target.registry.get("train").state is JobState.EXITED
    assert (target.registry.job_dir("train") / "stdout.log").read_text() == "old output\n"

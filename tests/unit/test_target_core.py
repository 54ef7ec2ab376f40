"""The target's core (issue 27): slow work runs outside its protocol lock, so GetMigration (the
source's fencing query, 10 s deadline) answers at once; finished migrations leave its table; and
an ended local job's record goes only once the arriving job commits here."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fakes import FakeCriu, FakePageServer, dies
from test_migrate_target import MID, broken_stream, delivered, prepare_req, running_record, staged, state

from agent.criu.options import LOG_LEVEL
from agent.errors import PermissionDeniedError, RefusedError
from agent.jobs import procs
from agent.jobs.record import JobKind, JobRecord, JobState
from agent.migration import target as incoming
from agent.migration.fencing import FENCEABLE, TargetAnswer, ask_target
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
    assert target.effects.wait_background(10)  # the Abort answered before its drop was over
    assert state(target) == pb.TARGET_STATE_ABORTED
    assert staged(target) == []  # the drop still removed everything, only outside the lock


class BlockedPageServer(FakePageServer):
    """A page server whose death waits for its test to let it go: its drop's StopStream blocks."""

    entered = threading.Event()
    release = threading.Event()

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.entered, self.release = BlockedPageServer.entered, BlockedPageServer.release  # its test's

    def kill(self) -> None:
        self.entered.set()
        assert self.release.wait(10), "the test never let the page server die"
        super().kill()


@pytest.fixture
def blocked(
    target: TargetMigrations, fake_criu: FakeCriu, monkeypatch: pytest.MonkeyPatch
) -> Iterator[type[BlockedPageServer]]:
    """The target's page servers are blocked in their death until `release` is set."""
    BlockedPageServer.entered, BlockedPageServer.release = threading.Event(), threading.Event()
    monkeypatch.setattr(
        fake_criu,
        "page_server",
        lambda images_dir, log_dir=None, *, address, tls: BlockedPageServer(images_dir / "pages-65537.img"),
    )
    yield BlockedPageServer
    BlockedPageServer.release.set()  # a failed test leaves no drop blocked behind it
    target.effects.wait_background(10)


def streaming(target: TargetMigrations) -> Iterator[pb.PageData]:
    """Prepared, and its page server listening for the source's dump (STREAMING); returns the
    StreamPages answer, to be closed once the page server may die."""
    target.prepare(prepare_req())
    answers = target.stream_pages(iter([pb.PageData(migration_id=MID)]))
    next(answers)
    assert state(target) == pb.TARGET_STATE_RECEIVING
    return answers


class LocalPeer:
    """The target as a source's fencing (agent.migration.fencing.ask_target) asks it."""

    def __init__(self, target: TargetMigrations) -> None:
        self.target = target

    def status(self, mid: str) -> int:
        return self.target.status(mid)

    def abort(self, mid: str, reason: str) -> None:
        self.target.abort(mid, reason)


def test_abort_answers_once_dropping_is_journaled_and_the_drop_ends_on_its_own_thread(
    target: TargetMigrations, blocked: type[BlockedPageServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 27: an Abort whose page server is slow to die answers once DROPPING is durable (the
    source's deadline for it is 30 s; the death may take 40); what the migration holds is let go
    on the drop's own thread, and only then is it ABORTED."""
    released: list[str] = []
    monkeypatch.setattr(target.ledger, "release", released.append)
    answers = streaming(target)
    target._incoming[MID].lease_owner = owner = "the lease of the test"  # as one with GPUs holds

    t0 = time.monotonic()
    target.abort(MID, "the source's dump failed")
    took = time.monotonic() - t0

    assert blocked.entered.is_set() and not blocked.release.is_set()
    assert took < incoming.ABORT_WAIT_S + ANSWER_S, took
    # DROPPING on disk: never restored from here on; read as fenceable, and a fence is accepted.
    assert target.journal.get(TARGET, MID).state == "dropping"
    took = []
    for _ in range(3):
        t0 = time.monotonic()
        assert state(target) == pb.TARGET_STATE_PREPARED and state(target) in FENCEABLE
        took.append(time.monotonic() - t0)
    assert max(took) < ANSWER_S, took
    assert ask_target(LocalPeer(target), MID, fence="the source asks again") is TargetAnswer.FENCED  # type: ignore[arg-type]
    assert target.effects.background() == [MID]
    assert f"end {MID}" in {t.name for t in threading.enumerate()}
    # Until the drop is over it holds its staging, its lease and its slot (the same job is refused).
    assert f"in-{MID}" in staged(target) and released == []
    with pytest.raises(RefusedError, match="already coming in"):
        target.prepare(prepare_req("m-again"))

    blocked.release.set()
    assert target.effects.wait_background(10)
    assert target.journal.get(TARGET, MID).state == "aborted" and MID not in target._incoming
    assert state(target) == pb.TARGET_STATE_ABORTED
    assert staged(target) == [] and owner in released
    target.prepare(prepare_req("m-again"))  # its slot is free again
    answers.close()


def test_a_stopping_agent_waits_for_a_drop_an_abort_left_running(
    target: TargetMigrations, blocked: type[BlockedPageServer]
) -> None:
    answers = streaming(target)
    target.abort(MID, "the source gave up")
    stopping = threading.Thread(target=target.shutdown, daemon=True)
    stopping.start()
    stopping.join(0.3)
    assert stopping.is_alive(), "the agent stopped with a drop still running"
    assert target.journal.get(TARGET, MID).state == "dropping"
    blocked.release.set()
    stopping.join(10)
    assert not stopping.is_alive()
    assert state(target) == pb.TARGET_STATE_ABORTED and staged(target) == []
    answers.close()


def test_a_drop_the_agent_did_not_live_to_finish_is_ended_by_the_next_start(
    target: TargetMigrations, blocked: type[BlockedPageServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past its bound a stop leaves the drop DROPPING on disk; recovery removes its staging and
    journals ABORTED (the source, fenced already, resumed on the Abort's answer)."""
    monkeypatch.setattr(incoming, "DROPS_WAIT_S", 0.2)
    answers = streaming(target)
    target.abort(MID, "the source gave up")
    target.shutdown()
    assert target.journal.get(TARGET, MID).state == "dropping"

    done = target.recover()  # the next start reads the journal the stopped agent left

    assert done == [f"{MID}: agent restarted while dropping: dropped its dropping image"]
    assert target.journal.get(TARGET, MID).state == "aborted"
    assert not (target.staging_root / f"in-{MID}").exists()
    blocked.release.set()
    answers.close()


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
    handed_back: list[tuple[str, JobState, str]] = []
    target.registry.on_post_copy_lost = lambda r, node: handed_back.append((r.name, r.state, node))

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
    assert dies(proc.pid) and net.deleted == ["fv-train"]
    assert target.registry.get("train").state is JobState.LOST
    assert state(target) == pb.TARGET_STATE_ABORTED
    # Once killed, the member is handed back to the source's node (agent.coord.liveness).
    assert [(n, st) for n, st, _ in handed_back] == [("train", JobState.LOST)]
    assert handed_back[0][2], "the source's node is named"


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
    target: TargetMigrations, fake_criu: FakeCriu, tmp_path: Path
) -> None:
    target.restorer.chain_log_level = 2
    delivered(target, tmp_path)
    target.commit(pb.CommitRequest(migration_id=MID))
    assert MID not in target._incoming
    assert state(target) == pb.TARGET_STATE_RUNNING
    # A whole image, no snapshot's chain: CRIU logs everything, as for any other move.
    assert [r["log_level"] for r in fake_criu.restores] == [LOG_LEVEL]


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


def test_a_post_copy_whose_source_node_lost_its_lease_fails_at_once_and_its_copy_is_lost(
    target: TargetMigrations, sleeper
) -> None:
    """Its pages will not come, and the page stream would take gRPC's keepalive to say so: the
    copy here is killed (lost) and handed back to the source's node, and the source may resume."""
    target.prepare(prepare_req(lazy=True))
    proc, _, _ = sleeper()
    rec = JobRecord(
        name="train", kind=JobKind.LAUNCHED, state=JobState.RUNNING, pid=proc.pid, command=["x"], cwd="/"
    )
    rec.pid_started = procs.create_time(proc.pid)
    target.registry.save(rec)
    handed: list[str] = []
    target.registry.on_post_copy_lost = lambda r, node: handed.append(node)
    _restored(target)
    target.expire(lambda nodes: set())  # its source lives: nothing changes
    assert state(target) == pb.TARGET_STATE_POSTCOPY and handed == []
    target.expire(lambda nodes: nodes)
    proc.wait(10)
    job = target.registry.get("train")
    assert job.state is JobState.LOST and "has no lease in etcd" in job.note, job
    assert handed == ["nodea"] and state(target) == pb.TARGET_STATE_ABORTED


def test_a_migration_whose_source_node_lost_its_lease_is_dropped_before_its_commit_only(
    target: TargetMigrations, tmp_path: Path
) -> None:
    """With [coordination]: a source node etcd holds no lease for drops what waits on it at once
    (it still owns the job; a recovery may restore it here); a committed one is never touched."""
    delivered(target, tmp_path)  # VERIFIED, from nodea
    target.prepare(prepare_req("m-2", "job2", source_node="nodec"))
    asked: list[set[str]] = []

    def dead(nodes: set[str]) -> set[str]:
        asked.append(nodes)
        return nodes & {"nodec"}

    target.expire(dead)
    assert asked == [{"nodea", "nodec"}]
    assert state(target, "m-2") == pb.TARGET_STATE_ABORTED and state(target) == pb.TARGET_STATE_VERIFIED
    target.commit(pb.CommitRequest(migration_id=MID))
    target.expire(lambda nodes: nodes | {"nodea"})
    assert state(target) == pb.TARGET_STATE_RUNNING  # past its commit: the job is this node's

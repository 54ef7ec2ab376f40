"""The target's state table (agent.migration.target_table): its transitions journal under the
lock and return effects, in the order they must run, each safe to run again; the executor
(target_effects) ends a migration only once they ran; recovery finishes what a crash cut."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agent.jobs.record import JobKind, JobRecord, JobState
from agent.jobs.registry import JobRegistry
from agent.migration.datatls import DataIdentity, DataTls
from agent.migration.journal import TARGET, Journal
from agent.migration.states import TargetState
from agent.migration.target_effects import TargetEffects
from agent.migration.target_recovery import recover_incoming
from agent.migration.target_table import (
    CloseKeys,
    Ended,
    EndJob,
    Incoming,
    IncomingTable,
    RemoveStaging,
    StopStream,
)
from agent.rpc import pb

T = TargetState


class Ledger:
    def __init__(self) -> None:
        self.released: list[str] = []

    def release(self, owner: str) -> None:
        self.released.append(owner)


class Stream:
    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.killed: list[str] = []  # the journaled state each kill saw

    def kill(self) -> None:
        rec = self.journal.get(TARGET, "m1")
        self.killed.append(rec.state if rec else "")


@pytest.fixture
def table(tmp_path: Path) -> IncomingTable:
    return IncomingTable(Journal(tmp_path / "state"), Ledger())  # type: ignore[arg-type]


def incoming(tmp_path: Path, state: TargetState = T.PREPARED) -> Incoming:
    staging = tmp_path / "staging" / "in-m1"
    staging.mkdir(parents=True)
    (staging / "pages-1.img").write_bytes(b"x")
    return Incoming("m1", "train", "nodea", staging, 1 << 30, 0.0, state=state, lease_owner="lease m1")


def keys(tmp_path: Path) -> DataTls:
    return DataTls(DataIdentity.new("nodeb m1"), DataIdentity.new("nodea m1").cert_pem, tmp_path / "staging")


class _UnreadableRegistry:
    def get(self, job: str) -> object:
        raise OSError("job record unreadable")


def unkillable_postcopy(table: IncomingTable, tmp_path: Path) -> tuple[Incoming, TargetEffects, list[str]]:
    """A post-copy migration whose job here cannot be ended (its record cannot be read), its
    effects' executor, and the ends it reports."""
    ended: list[str] = []
    effects = TargetEffects(table, _UnreadableRegistry(), None, ended.append)  # type: ignore[arg-type]
    return incoming(tmp_path, T.POSTCOPY), effects, ended


def test_a_drop_journals_dropping_and_hands_out_what_it_holds_in_order(
    table: IncomingTable, tmp_path: Path
) -> None:
    inc, k = incoming(tmp_path), keys(tmp_path)
    stream = Stream(table.journal)
    with table.lock:
        table.add_locked(inc, k)
        table.streams["m1"] = stream  # type: ignore[assignment]
        effects = table.drop_locked(inc, "the source gave up")
    assert table.journal.get(TARGET, "m1").state == "dropping"
    assert T.DROPPING.wire == pb.TARGET_STATE_PREPARED  # as good as fenced: read as fenceable
    # The page server first (it may still write into staging), then the keys, then staging.
    assert effects == [StopStream(stream), CloseKeys(k), RemoveStaging(inc.staging)]  # type: ignore[arg-type]
    with table.lock:
        assert table.drop_locked(inc, "again") is None  # its dropper finishes it
    assert table.ledger.released == []  # its GPUs stay claimed until ABORTED


def test_the_executor_journals_aborted_only_after_the_effects_ran(
    table: IncomingTable, tmp_path: Path
) -> None:
    inc = incoming(tmp_path)
    stream = Stream(table.journal)
    ended: list[str] = []
    effects = TargetEffects(table, None, None, ended.append)  # type: ignore[arg-type]
    with table.lock:
        table.add_locked(inc, keys(tmp_path))
        table.streams["m1"] = stream  # type: ignore[assignment]
    assert effects.drop(inc, "lease expired")
    assert stream.killed == ["dropping"]
    assert not inc.staging.exists() and not list((tmp_path / "staging").glob("keys-*"))
    rec = table.journal.get(TARGET, "m1")
    assert rec.state == "aborted" and rec.note == "lease expired"
    assert ended == ["aborted"] and table.ledger.released == ["lease m1"]
    assert table.entries == {}  # finished: the journal answers for it
    assert not effects.drop(inc, "again") and ended == ["aborted"]


def test_effects_are_safe_to_run_twice(table: IncomingTable, tmp_path: Path) -> None:
    inc = incoming(tmp_path)
    with table.lock:
        table.add_locked(inc, keys(tmp_path))
        done = table.drop_locked(inc, "x")
    effects = TargetEffects(table, None, None, lambda r: None)  # type: ignore[arg-type]
    effects.run(done or [])
    effects.run(done or [])
    assert not inc.staging.exists()


def test_a_failed_post_copy_kills_the_job_before_anything_else(table: IncomingTable, tmp_path: Path) -> None:
    inc = incoming(tmp_path, T.POSTCOPY)
    with table.lock:
        table.add_locked(inc, None)
        effects = table.unwind_locked(inc, "pages stopped")
    assert effects[0] == EndJob("train", "nodea", "pages stopped")
    assert table.journal.get(TARGET, "m1").state == "unwinding"
    assert T.UNWINDING.wire == pb.TARGET_STATE_RESTORING  # a copy may live here: not fenceable


def test_a_copy_here_that_could_not_be_ended_is_never_said_aborted(
    table: IncomingTable, tmp_path: Path
) -> None:
    """Fail closed: the source resumes its own copy on ABORTED, so a post-copy whose job here could
    not be killed stays UNWINDING (read as RESTORING: the source holds) until a restart."""

    inc, effects, ended = unkillable_postcopy(table, tmp_path)
    with table.lock:
        table.add_locked(inc, None)
    effects.unwind(inc, "pages stopped")
    assert table.journal.get(TARGET, "m1").state == "unwinding"
    assert T.UNWINDING.wire == pb.TARGET_STATE_RESTORING
    assert ended == [] and table.ledger.released == []


def test_a_doomed_restore_is_unwound_by_its_commit(table: IncomingTable, tmp_path: Path) -> None:
    inc = incoming(tmp_path, T.RESTORING)
    with table.lock:
        table.add_locked(inc, None)
        table.doom_locked(inc, "the daemon died")
        assert inc.state is T.UNWINDING and inc.note == "the daemon died"
        # The commit owns the restore: it unwinds (restore_tree killed the tree; no EndJob).
        effects = table.unwind_locked(inc, "restore failed")
        assert effects == [RemoveStaging(inc.staging)]
        assert inc.note == "the daemon died"  # the cause, not its consequence
        assert table.aborted_locked(inc) == [Ended("aborted")]


def test_running_hands_out_the_staging_and_counts_the_move(table: IncomingTable, tmp_path: Path) -> None:
    inc = incoming(tmp_path, T.RESTORING)
    with table.lock:
        table.add_locked(inc, None)
        effects = table.set_locked(inc, T.RUNNING)
    assert RemoveStaging(inc.staging) in effects and effects[-1] == Ended("committed")
    assert table.entries == {} and table.ledger.released == ["lease m1"]
    with table.lock, pytest.raises(ValueError, match="through drop or unwind"):
        table.set_locked(incoming(tmp_path / "other"), T.ABORTED)


@pytest.mark.parametrize("ended", ["aborted", "running"])
def test_recovery_removes_the_staging_a_crash_left_after_the_end_was_journaled(
    table: IncomingTable, tmp_path: Path, ended: str
) -> None:
    inc = incoming(tmp_path, T.RESTORING)
    with table.lock:
        table.add_locked(inc, None)
    rec = table.journal.get(TARGET, "m1")
    rec.state = ended
    table.journal.save(rec)  # the agent died here, before its effects ran
    done = recover_incoming(table.journal, None)  # type: ignore[arg-type]
    assert not inc.staging.exists()
    assert done == [f"m1: removed the staging its {ended} migration left"]
    assert recover_incoming(table.journal, None) == []  # type: ignore[arg-type]


def test_recovery_unwinds_an_unwinding_migration_as_a_restore(table: IncomingTable, tmp_path: Path) -> None:
    from agent.jobs.registry import JobRegistry

    inc = incoming(tmp_path, T.RESTORING)
    with table.lock:
        table.add_locked(inc, None)
        table.doom_locked(inc, "the daemon died")
    done = recover_incoming(table.journal, JobRegistry(tmp_path / "state", "nodeb"))
    assert done == ["m1: agent restarted while unwinding: nothing ran"]
    assert table.journal.get(TARGET, "m1").state == "aborted" and not inc.staging.exists()


def test_a_copy_that_could_not_be_ended_on_its_own_thread_is_never_said_aborted(
    table: IncomingTable, tmp_path: Path
) -> None:
    """Fail closed off the caller's thread too (TargetEffects.finish_later): the unwinding's
    thread ends, and the migration stays UNWINDING."""

    inc, effects, ended = unkillable_postcopy(table, tmp_path)
    with table.lock:
        table.add_locked(inc, None)
        todo = table.unwind_locked(inc, "pages stopped")
    assert effects.finish_later(inc, todo, wait_s=10)  # its thread is over
    assert effects.background() == []
    assert table.journal.get(TARGET, "m1").state == "unwinding" and inc.state is T.UNWINDING
    assert ended == [] and table.ledger.released == [] and "m1" in table.entries


def test_an_end_already_owned_starts_no_thread(table: IncomingTable, tmp_path: Path) -> None:
    inc = incoming(tmp_path)
    effects = TargetEffects(table, None, None, lambda r: None)  # type: ignore[arg-type]
    with table.lock:
        table.add_locked(inc, None)
        table.drop_locked(inc, "the source gave up")
        again = table.drop_locked(inc, "again")
    assert not effects.finish_later(inc, again, wait_s=1)
    assert effects.background() == [] and table.journal.get(TARGET, "m1").state == "dropping"


def test_the_stop_stream_pause_point_holds_the_page_servers_death(
    tmp_path: Path, table: IncomingTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FERRY_PAUSE=target-stop-stream=SECONDS: a page server slow to die, for the tests."""
    monkeypatch.setenv("FERRY_PAUSE", "target-stop-stream=0.3")
    stream = Stream(table.journal)
    effects = TargetEffects(table, None, None, lambda r: None)  # type: ignore[arg-type]
    t0 = time.monotonic()
    assert effects.run([StopStream(stream)]) == []  # type: ignore[arg-type]
    assert time.monotonic() - t0 >= 0.3 and stream.killed == [""]


def test_recovery_ends_a_drop_the_agent_did_not_live_to_finish(table: IncomingTable, tmp_path: Path) -> None:
    inc = incoming(tmp_path)
    with table.lock:
        table.add_locked(inc, None)
        table.drop_locked(inc, "aborted by the source")  # its effects never ran: the agent stopped
    done = recover_incoming(table.journal, None)  # type: ignore[arg-type]
    assert done == ["m1: agent restarted while dropping: dropped its dropping image"]
    assert table.journal.get(TARGET, "m1").state == "aborted" and not inc.staging.exists()


@pytest.mark.parametrize(("exit_code", "lost"), [(139, True), (0, False)])
def test_a_copy_that_crashed_on_a_page_that_never_came_is_lost_not_exited_and_handed_back(
    table: IncomingTable, tmp_path: Path, exit_code: int, lost: bool
) -> None:
    """The source died mid post-copy; the copy here read a missing page and crashed before the
    stream's failure reached the target, so the registry took its end for an exit. That end was
    the move's failure (the group recovers the member: agent.coord.liveness); a copy that
    finished (status 0) read every page it needed and stays exited."""
    registry = JobRegistry(tmp_path / "reg", "node-g")
    registry.save(JobRecord("train", JobKind.LAUNCHED, JobState.RUNNING, 1, ["x"], "/", group="g"))
    registry.update("train", state=JobState.EXITED, exit_code=exit_code)
    handed: list[tuple[JobState, str]] = []
    registry.on_post_copy_lost = lambda rec, node: handed.append((rec.state, node))
    effects = TargetEffects(table, registry, None, lambda result: None)  # type: ignore[arg-type]
    effects.run([EndJob("train", "node-f", "the page stream broke off")])
    rec = registry.get("train")
    if lost:
        assert rec.state is JobState.LOST and "crashed on a page that never came" in rec.note
        assert handed == [(JobState.LOST, "node-f")]
    else:
        assert rec.state is JobState.EXITED and handed == []

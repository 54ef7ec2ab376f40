"""The migration journal and what an agent does with it after a restart (agent.migration.journal,
agent.migration.recovery, TargetMigrations.recover). Real processes stand in for frozen jobs; the
target agent is a scripted peer; the CUDA driver is the fake one (no GPU here)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from fake_cuda import CHECKPOINTED, GPU0, RUNNING, CudaWorld, fake_cuda_jobs
from fakes import SLEEP, FakeCriu, dies, is_dead, is_stopped, launched_record, wait_stopped

from agent.errors import FerryError, NotFoundError, RefusedError, UnavailableError
from agent.image import build_manifest
from agent.jobs.record import JobState
from agent.jobs.registry import JobRegistry
from agent.migration.journal import KEEP_FINISHED_S, SOURCE, TARGET, Journal, MigrationRecord
from agent.migration.recovery import SourceRecovery
from agent.migration.target import TargetMigrations
from agent.rpc import pb


class ScriptedTarget:
    """The target agent as a source sees it: answers status from a script, records aborts."""

    def __init__(self, state: int | None) -> None:
        self.state = state  # None: unreachable
        self.aborts: list[str] = []

    def status(self, mid: str) -> int:
        if self.state is None:
            raise UnavailableError("agent 127.0.0.1:1 is unreachable")
        return self.state

    def abort(self, mid: str, reason: str) -> None:
        if self.state is None:
            raise UnavailableError("agent 127.0.0.1:1 is unreachable")
        self.aborts.append(mid)
        if self.state != pb.TARGET_STATE_RUNNING:
            self.state = pb.TARGET_STATE_ABORTED


@pytest.fixture
def frozen(sleeper, registry: JobRegistry):
    """A job frozen mid-migration (SIGSTOPped, MIGRATING), as a crashed source agent leaves it."""

    def make(name: str = "train") -> subprocess.Popen[bytes]:
        proc, out, err = sleeper()
        rec = launched_record(name, proc, out, err)
        rec.state, rec.migration_id = JobState.MIGRATING, "m1"
        registry.save(rec)
        os.kill(proc.pid, signal.SIGSTOP)
        wait_stopped(proc.pid)
        return proc

    return make


def source_record(state: str, proc: subprocess.Popen[bytes], tmp_path: Path, **kw: object) -> MigrationRecord:
    staging = tmp_path / "out-m1"
    staging.mkdir(exist_ok=True)
    (staging / "pages-1.img").write_bytes(b"x")
    return MigrationRecord(
        "m1", SOURCE, "train", state, peer="127.0.0.1:1", staging=str(staging), pids=[proc.pid], **kw
    )


def recovery(registry: JobRegistry, journal: Journal, peer: ScriptedTarget, world: CudaWorld | None = None):
    cj, _ = fake_cuda_jobs(world or CudaWorld())
    return SourceRecovery(registry, journal, cj.driver, "nodea", lambda address: peer, cj.ledger)


# -- the journal ---------------------------------------------------------------------------


def test_journal_round_trip_and_atomic_files(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    rec = MigrationRecord("m1", SOURCE, "train", "dumping", pids=[10, 11])
    j.save(rec)
    assert j.get(SOURCE, "m1") == rec
    assert j.get(TARGET, "m1") is None
    assert [p.name for p in (tmp_path / "migrations").iterdir()] == ["source-m1.json"]  # no temp left
    assert oct((tmp_path / "migrations" / "source-m1.json").stat().st_mode & 0o777) == "0o600"


def test_journal_load_skips_garbage_and_prunes_old_finished_records(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    j.save(MigrationRecord("old", TARGET, "a", "aborted"))
    j.save(MigrationRecord("open", TARGET, "b", "receiving"))
    path = tmp_path / "migrations" / "target-old.json"
    data = json.loads(path.read_text())
    data["updated_at"] = time.time() - KEEP_FINISHED_S - 1
    path.write_text(json.dumps(data))
    (tmp_path / "migrations" / "target-bad.json").write_text("{not json")
    assert [r.migration_id for r in j.load(TARGET)] == ["open"]
    assert not path.exists()


# -- source side -----------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["preparing", "dumping", "transferring", "aborting"])
def test_a_source_restarted_before_commit_resumes_its_copy(state, frozen, registry, tmp_path) -> None:
    proc = frozen()
    journal = Journal(tmp_path / "state")
    rec = source_record(state, proc, tmp_path)
    journal.save(rec)
    peer = ScriptedTarget(pb.TARGET_STATE_RECEIVING)
    recovery(registry, journal, peer).recover()

    assert not is_stopped(proc.pid)
    job = registry.get("train")
    assert job.state is JobState.RUNNING and job.migration_id == ""
    assert "commit was never sent" in job.note and "resumed here" in job.note
    assert peer.aborts == ["m1"]  # the target is fenced
    assert journal.get(SOURCE, "m1").state == "aborted"
    assert not Path(rec.staging).exists()


def test_a_source_before_commit_resumes_even_if_the_target_is_unreachable(frozen, registry, tmp_path) -> None:
    proc = frozen()
    journal = Journal(tmp_path / "state")
    journal.save(source_record("transferring", proc, tmp_path))
    recovery(registry, journal, ScriptedTarget(None)).recover()
    assert not is_stopped(proc.pid)
    assert registry.get("train").state is JobState.RUNNING


def test_a_source_after_commit_ends_its_copy_when_the_target_runs_the_job(frozen, registry, tmp_path) -> None:
    proc = frozen()
    journal = Journal(tmp_path / "state")
    journal.save(source_record("restoring", proc, tmp_path))
    recovery(registry, journal, ScriptedTarget(pb.TARGET_STATE_RUNNING)).recover()
    deadline = time.monotonic() + 5  # SIGKILLed: gone (or a zombie) once the kernel has run it
    while not is_dead(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dies(proc.pid)
    job = registry.get("train")
    assert job.state is JobState.MOVED and job.moved_to == "127.0.0.1:1"
    assert journal.get(SOURCE, "m1").state == "committed"


@pytest.mark.parametrize(
    ("state", "target", "serves_s", "ended", "then"),
    [
        # Commit was never sent: no target will connect, so it ends at once, not after CRIU_WAIT_S.
        ("dumping", pb.TARGET_STATE_ABORTED, 600, -signal.SIGKILL, JobState.RUNNING),
        # The target pages the restored job's memory in: the page server is what the job now
        # runs on, so it is left to finish by itself, never killed.
        ("paging", pb.TARGET_STATE_RUNNING, 1, 0, JobState.MOVED),
    ],
)
def test_a_lazy_page_server_that_outlived_its_agent_ends_at_once_only_when_no_target_will_page(
    state, target, serves_s, ended, then, frozen, registry, tmp_path, monkeypatch
) -> None:
    """Post-copy: after the lazy dump its CRIU only serves pages (the journal says so)."""
    monkeypatch.setattr("agent.migration.recovery.CRIU_WAIT_S", 600.0)  # a wait would time out the test
    proc = frozen()
    server = subprocess.Popen([SLEEP, str(serves_s)])
    started = psutil.Process(server.pid).create_time()
    journal = Journal(tmp_path / "state")
    journal.save(
        source_record(state, proc, tmp_path, criu_pid=server.pid, criu_started=started, criu_serving=True)
    )
    recovery(registry, journal, ScriptedTarget(target)).recover()
    assert server.wait(10) == ended
    assert registry.get("train").state is then


def test_a_rebooted_source_whose_copy_is_gone_records_the_move(frozen, registry, tmp_path) -> None:
    """After a reboot the frozen copy is gone (the registry says LOST); the target runs the job:
    the record says MOVED, and the migration is settled."""
    proc = frozen()
    journal = Journal(tmp_path / "state")
    journal.save(source_record("restoring", proc, tmp_path))
    proc.kill()
    proc.wait(10)
    registry.update("train", state=JobState.LOST, note="its process ended while the agent was down")
    recovery(registry, journal, ScriptedTarget(pb.TARGET_STATE_RUNNING)).recover()
    job = registry.get("train")
    assert job.state is JobState.MOVED and job.moved_to == "127.0.0.1:1"
    assert journal.get(SOURCE, "m1").state == "committed"


def test_a_recovery_that_failed_at_start_is_tried_again(frozen, registry, tmp_path) -> None:
    proc = frozen()
    journal = Journal(tmp_path / "state")
    journal.save(source_record("restoring", proc, tmp_path))
    target = ScriptedTarget(pb.TARGET_STATE_RUNNING)
    rec = recovery(registry, journal, target)
    real = rec._finish
    rec._finish = lambda r, why: (_ for _ in ()).throw(OSError("disk hiccup"))  # type: ignore[method-assign]
    [line] = rec.recover()
    assert "recovery failed (disk hiccup); tried again" in line
    assert journal.get(SOURCE, "m1").state == "restoring"
    rec._finish = real  # type: ignore[method-assign]
    rec.poll()
    assert journal.get(SOURCE, "m1").state == "committed"
    assert registry.get("train").state is JobState.MOVED


@pytest.mark.parametrize("answer", [pb.TARGET_STATE_ABORTED, pb.TARGET_STATE_UNKNOWN])
def test_a_source_after_commit_resumes_when_the_target_does_not_run_it(answer, frozen, registry, tmp_path):
    proc = frozen()
    journal = Journal(tmp_path / "state")
    journal.save(source_record("restoring", proc, tmp_path))
    recovery(registry, journal, ScriptedTarget(answer)).recover()
    assert not is_stopped(proc.pid)
    assert registry.get("train").state is JobState.RUNNING


def test_a_target_that_never_started_restoring_is_fenced_then_the_copy_resumes(frozen, registry, tmp_path):
    proc = frozen()
    journal = Journal(tmp_path / "state")
    journal.save(source_record("restoring", proc, tmp_path))
    peer = ScriptedTarget(pb.TARGET_STATE_VERIFIED)
    recovery(registry, journal, peer).recover()
    assert peer.aborts == ["m1"]
    assert not is_stopped(proc.pid)


class RefusingTarget(ScriptedTarget):
    """A target that answers GetMigration with an error of its own, or refuses the fence."""

    def __init__(self, state: int | None, status_error: FerryError | None, abort_error: FerryError | None):
        super().__init__(state)
        self.status_error, self.abort_error = status_error, abort_error

    def status(self, mid: str) -> int:
        if self.status_error is not None:
            raise self.status_error
        return super().status(mid)

    def abort(self, mid: str, reason: str) -> None:
        if self.abort_error is not None:
            raise self.abort_error
        super().abort(mid, reason)


@pytest.mark.parametrize(
    ("state", "status_error", "abort_error"),
    [
        (pb.TARGET_STATE_RESTORING, FerryError("migration record m1 is unreadable"), None),
        (pb.TARGET_STATE_VERIFIED, None, RefusedError("migration m1 is restoring the job here")),
        (pb.TARGET_STATE_POSTCOPY, None, None),
        (pb.TARGET_STATE_UNSPECIFIED, None, None),
    ],
)
def test_recovery_holds_the_copy_on_anything_but_a_definite_answer(
    state, status_error, abort_error, frozen, registry, tmp_path
) -> None:
    """The same decision as the live source (agent.migration.fencing): an error, a refused fence
    or an unsettled restore is no answer."""
    proc = frozen()
    journal = Journal(tmp_path / "state")
    journal.save(source_record("restoring", proc, tmp_path))
    recovery(registry, journal, RefusingTarget(state, status_error, abort_error)).recover()
    assert is_stopped(proc.pid)
    assert journal.get(SOURCE, "m1").state == "unresolved"
    assert registry.get("train").state is JobState.MIGRATING


def test_no_answer_after_commit_keeps_the_copy_frozen_and_says_so(frozen, registry, tmp_path) -> None:
    proc = frozen()
    journal = Journal(tmp_path / "state")
    journal.save(source_record("restoring", proc, tmp_path))
    peer = ScriptedTarget(None)
    rec = recovery(registry, journal, peer)
    rec.recover()
    assert is_stopped(proc.pid)
    job = registry.get("train")
    assert job.state is JobState.MIGRATING
    assert job.note.startswith("UNRESOLVED") and "ferry resolve train --resume" in job.note
    assert journal.get(SOURCE, "m1").state == "unresolved"

    rec.poll()  # still no answer: nothing changes
    assert is_stopped(proc.pid)
    peer.state = pb.TARGET_STATE_ABORTED
    rec.poll()  # the target answers: settled without anyone typing anything
    assert not is_stopped(proc.pid)
    assert registry.get("train").state is JobState.RUNNING


@pytest.mark.parametrize(("action", "resumed"), [("resume", True), ("finish", False)])
def test_the_operator_settles_an_unresolved_migration(action, resumed, frozen, registry, tmp_path) -> None:
    proc = frozen()
    journal = Journal(tmp_path / "state")
    journal.save(source_record("unresolved", proc, tmp_path))
    r = recovery(registry, journal, ScriptedTarget(None))
    note = r.resolve("train", action)
    assert f"ferry resolve --{action}" in note
    if resumed:
        assert not is_stopped(proc.pid) and registry.get("train").state is JobState.RUNNING
    else:
        assert dies(proc.pid) and registry.get("train").state is JobState.MOVED


def test_resolve_refuses_a_migration_that_is_not_unresolved(frozen, registry, tmp_path) -> None:
    proc = frozen()
    journal = Journal(tmp_path / "state")
    journal.save(source_record("transferring", proc, tmp_path))
    r = recovery(registry, journal, ScriptedTarget(None))
    with pytest.raises(RefusedError, match="is transferring, still in progress"):
        r.resolve("train", "resume")
    with pytest.raises(NotFoundError, match="no job named 'other'"):
        r.resolve("other", "")
    assert is_stopped(proc.pid)


def test_a_resumed_cuda_job_gets_its_gpu_state_back(frozen, registry, tmp_path) -> None:
    proc = frozen()
    world = CudaWorld()
    world.add_cuda_process(proc.pid, [GPU0])
    world.procs[proc.pid].state = CHECKPOINTED
    journal = Journal(tmp_path / "state")
    journal.save(source_record("dumping", proc, tmp_path, cuda_pids=[proc.pid]))
    recovery(registry, journal, ScriptedTarget(None), world).recover()
    assert world.state(proc.pid) == RUNNING
    assert not is_stopped(proc.pid)


# -- target side -----------------------------------------------------------------------------


@pytest.fixture
def target(registry: JobRegistry, tmp_path: Path):
    criu = FakeCriu("nodeb")
    cj, _ = fake_cuda_jobs(CudaWorld(), "nodeb")
    journal = Journal(registry.root.parent)
    yield TargetMigrations(registry, criu, tmp_path / "tstaging", "nodeb", cj, journal, cj.ledger)
    criu.cleanup()


@pytest.mark.parametrize("state", ["prepared", "receiving", "verified"])
def test_a_restarted_target_drops_images_in_flight(state, target, tmp_path) -> None:
    staging = tmp_path / "tstaging" / "in-m1"
    staging.mkdir(parents=True)
    (staging / "pages-1.img").write_bytes(b"x")
    target.journal.save(MigrationRecord("m1", TARGET, "train", state, peer="nodea", staging=str(staging)))
    [line] = target.recover()
    assert f"agent restarted while {state}" in line
    assert not staging.exists()
    assert target.status("m1") == pb.TARGET_STATE_ABORTED


# postcopy: the job ran, but the pages it still lacked went with the agent's lazy-pages daemon.
@pytest.mark.parametrize("state", ["restoring", "postcopy"])
def test_a_restarted_target_kills_a_restore_it_did_not_see_finish(state, target, registry, tmp_path) -> None:
    job_dir = registry.job_dir("train")
    job_dir.mkdir(parents=True)
    with open(job_dir / "stdout.log", "ab") as out:  # what a restored job holds: our log
        restored = subprocess.Popen([SLEEP, "60"], stdout=out, start_new_session=True)
    bystander = subprocess.Popen([SLEEP, "60"], start_new_session=True)
    try:
        target.journal.save(MigrationRecord("m1", TARGET, "train", state, peer="nodea"))
        [line] = target.recover()
        assert "killed its half-finished restore (1 processes)" in line
        assert dies(restored.pid)
        assert bystander.poll() is None
        assert target.status("m1") == pb.TARGET_STATE_ABORTED
    finally:
        bystander.kill()
        bystander.wait()


def test_a_preempted_jobs_resume_cut_short_by_a_restart_waits_again(target, registry, tmp_path) -> None:
    """A resume journaled (kind resume) and cut short before its commit point: its restored copy
    is killed and the job is PREEMPTED again on its image (before: LOST, its image stranded)."""
    job_dir = registry.job_dir("scav")
    job_dir.mkdir(parents=True)
    with open(job_dir / "stdout.log", "ab") as out:
        restored = subprocess.Popen([SLEEP, "60"], stdout=out, start_new_session=True)
    try:
        rec = launched_record("scav", restored, job_dir / "stdout.log", job_dir / "stderr.log")
        registry.save(rec)  # what register_restored left: RUNNING, held
        image = tmp_path / "preempted" / "scav-1"
        target.journal.save(
            MigrationRecord("resume-1", TARGET, "scav", "restoring", kind="resume", image=str(image))
        )
        [line] = target.recover()
        assert "killed its half-finished restore (1 processes)" in line
        assert restored.wait(5) == -9
        job = registry.get("scav")
        assert job.state is JobState.PREEMPTED and job.checkpoint_dir == str(image)
    finally:
        restored.kill()
        restored.wait()


def test_a_restarted_target_leaves_finished_migrations_alone(target) -> None:
    target.journal.save(MigrationRecord("m1", TARGET, "train", "running", peer="nodea"))
    assert target.recover() == []
    assert target.status("m1") == pb.TARGET_STATE_RUNNING


@pytest.mark.parametrize("role", [TARGET, SOURCE])
def test_an_unreadable_record_stops_the_start_and_is_named(role, make_agent, tmp_path) -> None:
    """A corrupt record may be a held restore (target) or a frozen copy (source): never "no record"."""
    svc, _, _ = make_agent("nodez")
    path = svc.journal.root / f"{role}-m-corrupt.json"
    path.write_text('{"migration_id": "m-corrupt", "state": "restor')
    with pytest.raises(FerryError, match=r"unreadable: .*m-corrupt\.json") as err:
        svc.recover()
    assert "check the job on both nodes" in err.value.hint
    assert path.exists()  # left for the operator


@pytest.mark.parametrize(
    ("answer", "ends"), [(pb.TARGET_STATE_ABORTED, "aborted"), (pb.TARGET_STATE_RUNNING, "committed")]
)
def test_settling_removes_the_moves_one_time_key(answer, ends, frozen, registry, tmp_path) -> None:
    """A move left UNRESOLVED keeps its key for a CRIU that may still connect; whoever settles
    it removes the key (before, only an agent restart swept it)."""
    proc = frozen()
    keys = tmp_path / "staging" / "keys-abc"
    keys.mkdir(parents=True)
    (keys / "ours-key.pem").write_bytes(b"secret")
    journal = Journal(tmp_path / "state")
    journal.save(source_record("unresolved", proc, tmp_path, keys=str(keys)))
    recovery(registry, journal, ScriptedTarget(answer)).poll()
    assert journal.get(SOURCE, "m1").state == ends
    assert not keys.exists()


# -- local operations: `ferry checkpoint` and a preemption's suspend ------------------------


def local_record(state: str, proc: subprocess.Popen[bytes], image: Path, kind: str) -> MigrationRecord:
    return MigrationRecord("m1", SOURCE, "train", state, pids=[proc.pid], kind=kind, image=str(image))


def saved_image(registry: JobRegistry, image: Path) -> Path:
    image.mkdir()
    (image / "pages-1.img").write_bytes(b"p" * 4096)
    build_manifest(image, registry.get("train").spec(), "nodea")
    return image


@pytest.mark.parametrize("state", ["preparing", "dumping", "transferring", "aborting"])
@pytest.mark.parametrize("kind", ["checkpoint", "suspend"])
def test_a_local_operation_cut_short_before_its_image_held_the_job_resumes_it(
    state, kind, frozen, registry, tmp_path
) -> None:
    """Defect: `ferry checkpoint` and a preemption's suspend wrote no journal record, so an agent
    killed during one left the job MIGRATING and stopped for good (`ferry resolve`: "no unsettled
    migration")."""
    proc = frozen()
    journal = Journal(tmp_path / "state")
    journal.save(local_record(state, proc, saved_image(registry, tmp_path / "img"), kind))
    peer = ScriptedTarget(None)
    done = recovery(registry, journal, peer).recover()
    assert not is_stopped(proc.pid)
    assert registry.get("train").state is JobState.RUNNING
    assert journal.get(SOURCE, "m1").state == "aborted"
    assert peer.aborts == [] and "resumed here" in done[0]
    assert (tmp_path / "img" / "pages-1.img").exists(), "recovery never removes a local image"


@pytest.mark.parametrize(
    ("kind", "ends"), [("checkpoint", JobState.CHECKPOINTED), ("suspend", JobState.PREEMPTED)]
)
def test_a_local_operation_whose_image_holds_the_job_ends_the_copy_as_asked(
    kind, ends, frozen, registry, tmp_path
) -> None:
    proc = frozen()
    journal = Journal(tmp_path / "state")
    image = saved_image(registry, tmp_path / "img")
    journal.save(local_record("restoring", proc, image, kind))
    recovery(registry, journal, ScriptedTarget(None)).recover()
    assert dies(proc.pid)
    job = registry.get("train")
    assert job.state is ends and job.checkpoint_dir == str(image)
    assert journal.get(SOURCE, "m1").state == "committed"


def test_a_local_operation_whose_image_is_not_complete_resumes_the_copy(frozen, registry, tmp_path) -> None:
    proc = frozen()
    journal = Journal(tmp_path / "state")
    image = saved_image(registry, tmp_path / "img")
    (image / "pages-1.img").write_bytes(b"torn")  # its digest no longer matches
    journal.save(local_record("restoring", proc, image, "checkpoint"))
    recovery(registry, journal, ScriptedTarget(None)).recover()
    assert not is_stopped(proc.pid)
    assert registry.get("train").state is JobState.RUNNING


def test_the_housekeeping_poll_reads_only_records_that_may_be_open(tmp_path, registry, monkeypatch) -> None:
    """Defect: SourceRecovery.poll parsed every source record, finished ones included, every
    few seconds. A finished record unchanged since it was read is not read again."""
    journal = Journal(tmp_path / "state")
    for i in range(40):
        journal.save(MigrationRecord(f"done{i}", SOURCE, "train", "committed", peer="127.0.0.1:1"))
    journal.save(MigrationRecord("open1", SOURCE, "train", "unresolved", peer="127.0.0.1:1"))
    rec = recovery(registry, journal, ScriptedTarget(None))
    assert [r.migration_id for r in rec.open_records()] == ["open1"]

    reads: list[str] = []
    real = Path.read_bytes

    def counting(self: Path) -> bytes:
        reads.append(self.name)
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", counting)
    assert [r.migration_id for r in rec.open_records()] == ["open1"]
    assert reads == ["source-open1.json"]
    # A record that changes is read again, whatever it was before.
    journal.save(MigrationRecord("done3", SOURCE, "train", "unresolved", peer="127.0.0.1:1"))
    assert sorted(r.migration_id for r in rec.open_records()) == ["done3", "open1"]


def test_finished_source_records_are_pruned_after_their_keep_time(tmp_path) -> None:
    journal = Journal(tmp_path / "state")
    old = MigrationRecord("old", SOURCE, "train", "committed")
    journal.save(old)
    path = tmp_path / "state" / "migrations" / "source-old.json"
    data = json.loads(path.read_text())
    data["updated_at"] = time.time() - KEEP_FINISHED_S - 1
    path.write_text(json.dumps(data))
    journal.save(MigrationRecord("new", SOURCE, "train", "committed"))
    assert [r.migration_id for r in journal.load(SOURCE)] == ["new"]
    assert not path.exists()

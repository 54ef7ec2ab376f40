"""The source side of a migration (agent.migration.source.SourceMigration), a failure injected at every phase.

The job is a real `sleep` child; FakeCriu freezes it with SIGSTOP as CRIU's
--leave-stopped would, so "resumed" and "kept frozen" are checked on the
process itself as well as through the calls that were made.
"""

from __future__ import annotations

import contextlib
import types
from pathlib import Path

import grpc
import pytest
from fakes import (
    FAULT_CODES,
    PAGES_BYTES,
    FakeCriu,
    FakePeer,
    dies,
    is_dead,
    is_stopped,
    launched_record,
    node_parts,
    rpc_error,
    wait_for,
    wait_running,
)

from agent.errors import (
    CriuError,
    FerryError,
    InvalidArgumentError,
    MigrationAbortedError,
    NotFoundError,
    PermissionDeniedError,
    RefusedError,
    StepTimeoutError,
    TransferError,
    UnavailableError,
)
from agent.faults import InjectedFault
from agent.image import MANIFEST, STDERR_LOG, STDOUT_LOG
from agent.jobs import procs
from agent.jobs.record import JobRecord, JobState
from agent.jobs.registry import JobRegistry
from agent.migration import source as migrate
from agent.migration import source_postcopy
from agent.migration.model import Method, MigrationSpec, Progress
from agent.migration.peerwait import PeerWait
from agent.migration.source import SourceMigration
from agent.migration.states import MigrationState
from agent.rpc import pb
from agent.service.convert import peer_wait_pb

MID = "0123456789abcdef"


class Harness:
    """A job, its registry, a fake CRIU and a fake target, with every side effect recorded."""

    def __init__(
        self, tmp_path: Path, registry: JobRegistry, criu: FakeCriu, sleeper, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        self.proc, self.out, self.err = sleeper()
        self.pid = self.proc.pid
        self.registry = registry
        self.criu = criu
        self.peer = FakePeer(tmp_path / "target-staging")
        self.staging_root = tmp_path / "staging"
        self.events: list[Progress] = []
        cuda_jobs, journal = node_parts(registry, "nodea")
        #: What the agent hands every migration of its node: one CUDA side, one journal.
        self.parts = {"cuda_jobs": cuda_jobs, "journal": journal}
        registry.save(launched_record("train", self.proc, self.out, self.err))

        self.resumed: list[list[int]] = []
        real_resume = procs.resume

        def resume(pids: list[int]) -> None:
            self.resumed.append(list(pids))
            real_resume(pids)

        monkeypatch.setattr(procs, "resume", resume)

        self.killed: list[tuple[str, list[int]]] = []
        real_kill = registry.kill_tree

        def kill_tree(rec: JobRecord, pids: list[int]) -> None:
            self.killed.append((rec.name, list(pids)))
            real_kill(rec, pids)

        monkeypatch.setattr(registry, "kill_tree", kill_tree)
        # _ask_target sleeps 1 s between tries, post-copy's settling 0.5 s; the tests need not wait.
        self.slept: list[float] = []
        fake_time = types.SimpleNamespace(
            monotonic=migrate.time.monotonic, time=migrate.time.time, sleep=self.slept.append
        )
        for module in (migrate, source_postcopy):
            monkeypatch.setattr(module, "time", fake_time)

    def migration(
        self,
        job: str = "train",
        agent_id: str = "source-agent",
        method: Method = Method.PRE_COPY,
    ) -> SourceMigration:
        return SourceMigration(
            MigrationSpec.by(method, job, self.peer.address, MID),
            self.registry,
            self.criu,
            self.peer,
            self.staging_root,
            "nodea",
            agent_id,
            self.events.append,
            **self.parts,
        )

    @property
    def job(self) -> JobRecord:
        return self.registry.get("train")

    def phases_emitted(self) -> list[str]:
        out: list[str] = []
        for e in self.events:
            if not out or out[-1] != e.phase:
                out.append(e.phase)
        return out

    def assert_untouched(self) -> None:
        """A refusal before the freeze costs the job nothing."""
        assert self.criu.dumps == []
        assert self.job.state is JobState.RUNNING
        assert self.job.migration_id == ""
        assert not is_stopped(self.pid)
        assert self.killed == []
        assert not (self.staging_root / f"out-{MID}").exists()

    def assert_rolled_back(self, told: bool = True) -> None:
        """Aborted after the freeze: the source copy runs again, nothing left behind; the target
        was told to abort (`told`), unless it had said so itself."""
        assert self.job.state is JobState.RUNNING
        assert self.job.migration_id == ""
        assert "aborted" in self.job.note
        assert self.killed == []
        assert [m for m, _ in self.peer.aborts] == ([MID] if told else [])
        assert not (self.staging_root / f"out-{MID}").exists()
        wait_running(self.pid)


@pytest.fixture
def h(tmp_path, registry, fake_criu, sleeper, monkeypatch) -> Harness:
    """A target that grants the page stream, as every real one does."""
    monkeypatch.delenv("FERRY_FAULTS", raising=False)
    return Harness(tmp_path, registry, fake_criu, sleeper, monkeypatch)


@pytest.fixture
def staged(h: Harness) -> Harness:
    """A target that grants only the staged push: the memory travels as pages-1.img."""
    h.peer.page_stream = False
    return h


@pytest.fixture(params=["streamed", "staged"])
def either(request, h: Harness) -> Harness:
    h.peer.page_stream = request.param == "streamed"
    return h


# -- success -------------------------------------------------------------------------


def test_success_moves_the_job_and_kills_the_frozen_copy(either: Harness) -> None:
    h = either
    m = h.migration()
    result = m.run()

    assert m.state is MigrationState.COMMITTED
    job = h.job
    assert job.state is JobState.MOVED
    assert job.moved_to == h.peer.address
    assert job.moved_to_node == "nodeb"
    # The frozen tree is killed only after commit, and it is this job's tree.
    streamed = ["stream_pages"] if h.peer.page_stream else []
    assert h.peer.calls == ["info", "prepare", *streamed, "push", "commit"]
    assert len(h.killed) == 1
    name, pids = h.killed[0]
    assert name == "train" and pids[0] == h.pid
    assert dies(h.pid)
    assert h.resumed == []
    assert h.peer.aborts == []
    assert h.criu.dumps[0]["pid"] == h.pid

    assert result.target_node == "nodeb"
    assert result.image_bytes > PAGES_BYTES
    assert result.host_bytes == PAGES_BYTES
    for phase in ("prepare", "dump", "transfer", "commit", "target restore"):
        assert phase in result.phases, phase
    assert result.phases["target restore"] == pytest.approx(0.25)
    assert result.downtime_s >= 0
    assert result.frozen_s > 0
    assert result.total_s >= result.frozen_s
    assert not (h.staging_root / f"out-{MID}").exists()
    assert h.phases_emitted() == ["prepare", "dump", "transfer", "restore", "done"]


def test_a_job_that_is_no_group_member_reports_no_groups_pause(h: Harness) -> None:
    result = h.migration().run()
    assert (result.group_pause_s, result.group_pause_by) == (-1.0, "")
    assert "peer_wait" not in h.peer.calls


@pytest.mark.parametrize(
    "answer, pause, said",
    [
        (
            PeerWait(0.21, 4, 3, 1, 0, 10.0),
            0.81,
            "frozen 0.60 s, then the peers reached the job again 0.21 s after its release "
            "(3 of 4 connections; 1 silent for 10.0 s)",
        ),
        (
            PeerWait(10.0, 2, 1, 0, 1, 10.0),
            10.6,
            "at least: frozen 0.60 s, then the peers did not all reach the job within 10.0 s",
        ),
        (PeerWait(-1.0, 2, 0, 2, 0, 10.0), -1.0, "not measured: none of its 2 connections"),
        (UnavailableError("agent 127.0.0.1:7071 is unreachable"), -1.0, "not measured: the target did not"),
    ],
)
def test_a_group_members_move_reports_its_groups_pause_once_committed(
    h: Harness, answer: PeerWait | FerryError, pause: float, said: str
) -> None:
    """Frozen time plus the peers' wait after the release, as the target measured it; a measure
    that failed is only missing (agent.migration.peerwait)."""
    asked: list[tuple[str, float]] = []

    def peer_wait(migration_id: str, wait_s: float) -> pb.PeerWait:
        asked.append((migration_id, wait_s))
        if isinstance(answer, BaseException):
            raise answer
        return peer_wait_pb(answer)

    h.peer.peer_wait = peer_wait  # type: ignore[attr-defined]
    m = h.migration()
    m.run()
    m.result.frozen_s = 0.6
    m._group_pause()
    assert asked == [(MID, 12.0)]
    assert m.result.group_pause_s == pytest.approx(pause)
    assert m.result.group_pause_by.startswith(said), m.result.group_pause_by
    assert m.state is MigrationState.COMMITTED and h.job.state is JobState.MOVED
    assert h.events[-1].message.startswith("measuring how long its peers went without it")


def test_success_sends_a_complete_self_describing_image(either: Harness) -> None:
    h = either
    h.migration().run()

    m = h.peer.manifest
    assert m is not None
    names = {f.name for f in m.files}
    assert {"pstree.img", STDOUT_LOG, STDERR_LOG} <= names
    if h.peer.page_stream:  # the memory came over the page stream, and the manifest says what came
        assert "pages-1.img" not in names
        assert m.page_stream is not None and m.page_stream == h.peer.pages
        assert m.page_stream.bytes == PAGES_BYTES
    else:
        assert "pages-1.img" in names and m.page_stream is None
    assert "criu-dump.log" not in names  # local-only files never travel
    assert MANIFEST in h.peer.received
    assert h.peer.received[STDOUT_LOG] == h.out.read_bytes()
    assert m.job.name == "train"
    assert m.job.kind == "launched"
    assert m.job.migrations == 1
    assert m.job.stdout_path == str(h.out)
    assert m.source_node == "nodea"
    assert m.host_bytes == PAGES_BYTES
    assert m.criu_stats == {"frozen_time": 1234, "pages_written": 16}
    assert "dump" in m.timings


def test_prepare_tells_the_target_what_is_coming(h: Harness) -> None:
    h.migration().run()

    req = h.peer.prepare_req
    assert req is not None
    assert req.migration_id == MID
    assert req.job == "train"
    assert req.source_node == "nodea"
    assert req.kind == pb.JOB_KIND_LAUNCHED
    assert req.estimated_bytes > 0
    assert list(req.pids) == []  # a launched job has its own PID namespace
    # The job's own log files travel with the image; they are not asked of the target.
    assert str(h.out) not in req.paths and str(h.err) not in req.paths
    assert h.peer.commit_req is not None and h.peer.commit_req.migration_id == MID


def test_adopted_job_sends_its_host_pids(h: Harness, registry: JobRegistry, sleeper) -> None:
    proc, _, _ = sleeper()
    registry.adopt("adopted", proc.pid)
    spec = MigrationSpec("adopted", h.peer.address, MID)
    args = (spec, registry, h.criu, h.peer, h.staging_root, "nodea", "source-agent")
    SourceMigration(*args, **h.parts).run()

    assert h.peer.prepare_req.kind == pb.JOB_KIND_ADOPTED
    assert list(h.peer.prepare_req.pids) == [proc.pid]
    assert registry.get("adopted").state is JobState.MOVED
    assert h.criu.dumps[0]["shell_job"] is False  # its session leader is inside the tree


# -- refusals before anything is frozen ----------------------------------------------


def test_unreachable_target_is_a_refusal_that_costs_nothing(h: Harness) -> None:
    h.peer.fail["info"] = UnavailableError("agent 127.0.0.1:7071 is unreachable: connection refused")
    m = h.migration()
    with pytest.raises(RefusedError) as exc:
        m.run()

    assert h.peer.address in str(exc.value)
    assert "unreachable" in str(exc.value)
    assert exc.value.step == "prepare"
    assert h.peer.calls == ["info"]
    assert m.state is MigrationState.ABORTED
    h.assert_untouched()
    assert "migration refused" in h.job.note


def test_prepare_refused_by_the_target(h: Harness) -> None:
    h.peer.fail["prepare"] = RefusedError(
        "files the job uses are missing here: /data/shard-0", step="prepare", node="nodeb"
    )
    with pytest.raises(RefusedError) as exc:
        h.migration().run()

    assert "/data/shard-0" in str(exc.value)
    assert "nodeb" in str(exc.value)
    # Told to abort all the same: a Prepare that failed may have left a lease (its tombstone
    # also refuses a late copy of the same Prepare).
    assert h.peer.calls == ["info", "prepare", "abort"]
    h.assert_untouched()


def test_migration_to_itself_is_refused(h: Harness) -> None:
    h.peer.agent_id = "source-agent"
    with pytest.raises(InvalidArgumentError, match="is this agent"):
        h.migration(agent_id="source-agent").run()

    assert h.peer.calls == ["info"]
    h.assert_untouched()


def test_a_move_of_a_job_held_for_a_snapshot_round_says_so_and_when_to_ask_again(h: Harness) -> None:
    h.registry.begin_move("train", "snapshot-0123456789ab", "snapshot")
    with pytest.raises(RefusedError, match="held for a group snapshot round") as exc:
        h.migration().run()
    assert "ask again in a few seconds" in str(exc.value.hint)
    assert h.criu.dumps == [] and h.job.state is JobState.MIGRATING


def test_second_migration_of_a_moving_job_is_refused(h: Harness) -> None:
    h.registry.begin_move("train", "other-migration", "migration")
    with pytest.raises(RefusedError, match="already being moved") as exc:
        h.migration().run()

    assert "other-migration" in str(exc.value)
    assert h.peer.calls == []
    assert h.criu.dumps == []
    # The first migration's claim on the job is untouched.
    assert h.job.state is JobState.MIGRATING
    assert h.job.migration_id == "other-migration"


@pytest.mark.parametrize("state", [JobState.EXITED, JobState.MOVED, JobState.STOPPED])
def test_a_job_that_does_not_run_is_not_moved(h: Harness, state: JobState) -> None:
    if state is JobState.MOVED:  # only a move ends in MOVED
        h.registry.begin_move("train", "earlier-migration", "migration")
    h.registry.update("train", state=state)
    with pytest.raises(RefusedError, match=f"is {state.value}, not running"):
        h.migration().run()
    assert h.peer.calls == []
    assert h.criu.dumps == []


def test_unknown_job(h: Harness) -> None:
    with pytest.raises(NotFoundError, match="'nope'"):
        h.migration(job="nope").run()
    assert h.peer.calls == []


# -- failures after the freeze: the source copy resumes ------------------------------


def test_dump_failure_aborts_and_names_criu_and_its_log(h: Harness) -> None:
    h.criu.dump_error = CriuError(
        "dump", "task 42 has an unsupported file", log_path="/stage/criu-dump.log", node="nodea"
    )
    m = h.migration()
    with pytest.raises(MigrationAbortedError) as exc:
        m.run()

    msg = str(exc.value)
    assert "criu dump" in msg and "/stage/criu-dump.log" in msg
    assert "keeps running on nodea" in msg
    assert isinstance(exc.value.__cause__, CriuError)
    assert m.state is MigrationState.ABORTED
    assert "push" not in h.peer.calls
    h.assert_rolled_back()


def test_transfer_failure_aborts_and_resumes(h: Harness) -> None:
    h.peer.fail["push"] = TransferError("connection reset while streaming", step="transfer", node="nodeb")
    with pytest.raises(MigrationAbortedError, match="connection reset"):
        h.migration().run()

    assert h.resumed and h.resumed[0][0] == h.pid
    assert "commit" not in h.peer.calls
    h.assert_rolled_back()
    assert "while transferring" in h.job.note


def test_image_corrupted_in_transit_is_caught_by_the_digests(staged: Harness) -> None:
    h = staged

    def flip(chunk: pb.ImageChunk) -> pb.ImageChunk:
        if chunk.file == "pages-1.img":
            data = bytearray(chunk.data)
            data[100] ^= 0xFF
            chunk = pb.ImageChunk(
                migration_id=chunk.migration_id,
                file=chunk.file,
                data=bytes(data),
                last=chunk.last,
                sha256=chunk.sha256,
            )
        return chunk

    h.peer.mangle = flip
    with pytest.raises(MigrationAbortedError, match=r"digest mismatch for 'pages-1\.img'"):
        h.migration().run()

    assert "commit" not in h.peer.calls
    h.assert_rolled_back()


def test_a_failed_commit_resumes_only_once_the_target_confirms_it_does_not_run_the_job(h: Harness) -> None:
    h.peer.fail["commit"] = RefusedError("criu restore failed: pid 1 is taken", step="commit", node="nodeb")
    h.peer.status_answers = [pb.TARGET_STATE_ABORTED]
    m = h.migration()
    with pytest.raises(MigrationAbortedError, match="pid 1 is taken"):
        m.run()

    assert m.state is MigrationState.ABORTED
    # Whatever the error says, the commit reached the target: only its word decides.
    assert h.peer.calls[-2:] == ["commit", "status"]
    assert h.resumed and h.resumed[0][0] == h.pid
    h.assert_rolled_back(told=False)
    assert h.phases_emitted()[-1] == "abort"


@pytest.mark.parametrize(
    "no_answer",
    [
        UnavailableError("agent 127.0.0.1:7071 is unreachable", step="commit"),
        StepTimeoutError("agent 127.0.0.1:7071 did not answer in time", step="commit"),
    ],
)
def test_lost_commit_answer_but_target_runs_the_job_counts_as_committed(
    h: Harness, no_answer: FerryError
) -> None:
    h.peer.fail["commit"] = no_answer
    h.peer.status_answers = [pb.TARGET_STATE_RUNNING]
    m = h.migration()
    m.run()

    assert m.state is MigrationState.COMMITTED
    assert h.peer.calls[-2:] == ["commit", "status"]
    assert h.job.state is JobState.MOVED
    assert h.job.moved_to == h.peer.address
    assert h.killed and h.killed[0][1][0] == h.pid
    assert h.resumed == []
    assert h.peer.aborts == []


def test_status_answers_after_a_few_tries(h: Harness) -> None:
    down = UnavailableError("unreachable")
    h.peer.fail["commit"] = UnavailableError("unreachable")
    h.peer.status_answers = [down, down, pb.TARGET_STATE_RUNNING]
    h.migration().run()

    assert h.peer.calls.count("status") == 3
    assert h.slept == [1.0, 1.0]
    assert h.job.state is JobState.MOVED


@pytest.mark.parametrize("answer", [UnavailableError("unreachable"), pb.TARGET_STATE_RESTORING])
def test_commit_unresolved_keeps_the_job_frozen(h: Harness, answer: object) -> None:
    """No answer and no status (or the target still restoring): never resume blindly."""
    h.peer.fail["commit"] = UnavailableError("agent 127.0.0.1:7071 is unreachable", step="commit")
    h.peer.status_answers = [answer]  # type: ignore[list-item]
    m = h.migration()
    with pytest.raises(FerryError) as exc:
        m.run()

    assert not isinstance(exc.value, MigrationAbortedError)
    assert m.state is MigrationState.UNRESOLVED
    assert h.peer.address in str(exc.value)
    assert exc.value.step == "commit"
    assert h.peer.calls.count("status") == (5 if isinstance(answer, Exception) else 1)
    assert h.job.state is JobState.MIGRATING
    assert h.job.migration_id == MID
    assert h.peer.address in h.job.note
    assert h.resumed == []
    assert h.peer.aborts == []
    assert h.killed == []
    assert is_stopped(h.pid)


def test_unresolved_job_is_not_resumed_blindly_after_an_agent_restart(h: Harness, tmp_path: Path) -> None:
    h.peer.fail["commit"] = UnavailableError("unreachable")
    h.peer.status_answers = [UnavailableError("unreachable")]
    with pytest.raises(FerryError):
        h.migration().run()

    restarted = JobRegistry(tmp_path / "state", "nodea")
    assert restarted.get("train").state is JobState.MIGRATING
    assert is_stopped(h.pid)
    assert h.resumed == []


@pytest.mark.parametrize("answer", [pb.TARGET_STATE_UNKNOWN, pb.TARGET_STATE_ABORTED])
def test_lost_commit_answer_and_target_without_the_job_resumes(h: Harness, answer: int) -> None:
    h.peer.fail["commit"] = UnavailableError("unreachable")
    h.peer.status_answers = [answer]
    with pytest.raises(MigrationAbortedError, match="target confirmed it does not run the job"):
        h.migration().run()

    assert h.resumed and h.resumed[0][0] == h.pid
    h.assert_rolled_back(told=False)


def test_lost_commit_answer_and_target_not_yet_restoring_is_fenced_then_resumes(h: Harness) -> None:
    h.peer.fail["commit"] = UnavailableError("unreachable")
    h.peer.status_answers = [pb.TARGET_STATE_VERIFIED]
    with pytest.raises(MigrationAbortedError, match="target confirmed it does not run the job"):
        h.migration().run()
    assert h.peer.calls[-3:] == ["commit", "status", "abort"]  # fenced before the copy resumed
    assert h.resumed and h.resumed[0][0] == h.pid
    h.assert_rolled_back()


def test_lost_commit_answer_and_no_way_to_fence_the_target_keeps_the_job_frozen(h: Harness) -> None:
    """The commit may still be on its way: resuming without a confirmed abort could make two."""
    h.peer.fail["commit"] = UnavailableError("unreachable")
    h.peer.fail["abort"] = UnavailableError("unreachable")
    h.peer.status_answers = [pb.TARGET_STATE_VERIFIED]
    with pytest.raises(FerryError, match="UNRESOLVED"):
        h.migration().run()
    assert is_stopped(h.pid)
    assert h.resumed == []


#: Every way a Commit call can fail, as the client maps gRPC's codes (agent.client.from_rpc_error).
COMMIT_FAILURES = [
    FerryError("Cancelled"),  # CANCELLED, INTERNAL, UNKNOWN: the base error
    UnavailableError("agent 127.0.0.1:7071 is unreachable", step="commit"),
    StepTimeoutError("agent 127.0.0.1:7071 did not answer in time", step="commit"),
    RefusedError("migration is restoring", node="nodeb"),
    TransferError("the stream broke"),
    NotFoundError("no migration"),
    InvalidArgumentError("bad id"),
    PermissionDeniedError("not yours"),
]


@pytest.mark.parametrize("failure", COMMIT_FAILURES, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("target", [pb.TARGET_STATE_RESTORING, pb.TARGET_STATE_POSTCOPY])
def test_a_failed_commit_with_the_target_restoring_holds_the_copy_whatever_the_error(
    h: Harness, failure: FerryError, target: int
) -> None:
    """Defect: any Commit error but UNAVAILABLE/DEADLINE resumed the source without asking, even
    with the target restoring (a CANCELLED commit made two copies)."""
    h.peer.fail["commit"] = failure
    h.peer.fail["abort"] = RefusedError("migration is restoring the job here; it cannot be aborted")
    h.peer.status_answers = [target]
    m = h.migration()
    with pytest.raises(FerryError, match="UNRESOLVED") as exc:
        m.run()

    assert not isinstance(exc.value, MigrationAbortedError)
    assert m.state is MigrationState.UNRESOLVED
    assert "status" in h.peer.calls
    assert h.resumed == []
    assert h.killed == []
    assert is_stopped(h.pid)
    assert h.job.state is JobState.MIGRATING


@pytest.mark.parametrize(
    "status", [FerryError("migration record is unreadable"), PermissionDeniedError("not yours")]
)
def test_a_target_that_cannot_say_holds_the_copy(h: Harness, status: FerryError) -> None:
    """Defect: a deliberate error from GetMigration (an unreadable record) escaped into the abort
    path, which resumed the copy."""
    h.peer.fail["commit"] = UnavailableError("unreachable")
    h.peer.status_answers = [status]
    m = h.migration()
    with pytest.raises(FerryError, match="UNRESOLVED"):
        m.run()
    assert h.peer.calls.count("status") == 1  # a deliberate answer is not asked again at once
    assert m.state is MigrationState.UNRESOLVED
    assert h.resumed == []
    assert is_stopped(h.pid)


def test_a_refused_fence_holds_the_copy(h: Harness) -> None:
    """The target had not begun restoring when asked, but refused the abort: it has begun since."""
    h.peer.fail["commit"] = FerryError("Cancelled")
    h.peer.status_answers = [pb.TARGET_STATE_VERIFIED]
    h.peer.fail["abort"] = RefusedError("migration is restoring the job here; it cannot be aborted")
    m = h.migration()
    with pytest.raises(FerryError, match="UNRESOLVED"):
        m.run()
    assert m.state is MigrationState.UNRESOLVED
    assert h.resumed == []


def test_a_failure_after_the_commit_point_was_journaled_asks_before_resuming(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Anything that fails once RESTORING is journaled goes through the decision: held while the
    target may run the job."""
    monkeypatch.setenv("FERRY_FAULTS", "commit")
    h.peer.status_answers = [pb.TARGET_STATE_RESTORING]
    m = h.migration()
    with pytest.raises(FerryError, match="UNRESOLVED"):
        m.run()
    assert "commit" not in h.peer.calls and "status" in h.peer.calls
    assert m.state is MigrationState.UNRESOLVED
    assert is_stopped(h.pid)


def test_a_refusal_after_the_lease_releases_it_and_the_key_at_once(h: Harness) -> None:
    """Defect: the source refused after the target's lease (no post-copy offered here) without
    telling the target, which kept its slot, staging and GPUs for the lease's 600 s, and left
    its one-time key in the staging root."""
    h.peer.page_stream = True
    m = h.migration(method=Method.POST_COPY)
    m.spec = MigrationSpec(m.spec.job, m.spec.target, MID, lazy=True)  # asked for, not defaulted
    h.criu.lazy_blocker = ""  # this node could serve it; the fake target grants no post-copy
    with pytest.raises(RefusedError, match="does not offer post-copy"):
        m.run()
    assert h.peer.calls[-1] == "abort" and [a for a, _ in h.peer.aborts] == [MID]
    assert "after the lease" in h.peer.aborts[0][1]
    assert not list(h.staging_root.glob("keys-*")), "the one-time key outlived the refusal"
    h.assert_untouched()


def test_target_abort_failing_still_resumes_the_source(h: Harness) -> None:
    h.peer.fail["push"] = TransferError("stream broke")
    h.peer.fail["abort"] = UnavailableError("unreachable")
    with pytest.raises(MigrationAbortedError):
        h.migration().run()
    h.assert_rolled_back()


# -- the fault injector (FERRY_FAULTS) -----------------------------------------------


def test_fault_at_dump_fails_before_freezing(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_FAULTS", "dump")
    with pytest.raises(MigrationAbortedError, match="injected fault at 'dump'") as exc:
        h.migration().run()

    assert isinstance(exc.value.__cause__, InjectedFault)
    assert exc.value.step == "dump"
    assert h.criu.dumps == []
    assert "push" not in h.peer.calls
    h.assert_rolled_back()


def test_fault_at_transfer_resumes_the_frozen_copy(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_FAULTS", "transfer")
    with pytest.raises(MigrationAbortedError, match="injected fault at 'transfer'") as exc:
        h.migration().run()

    assert exc.value.step == "transfer"
    assert len(h.criu.dumps) == 1
    assert "push" not in h.peer.calls
    assert h.resumed and h.resumed[0][0] == h.pid
    h.assert_rolled_back()


def test_fault_at_commit_resumes_the_frozen_copy(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_FAULTS", "commit")
    with pytest.raises(MigrationAbortedError, match="injected fault at 'commit'"):
        h.migration().run()

    assert "push" in h.peer.calls and "commit" not in h.peer.calls
    # RESTORING was journaled: the copy resumes on the target's word (it has no record of the id).
    assert h.peer.calls[-1] == "status"
    h.assert_rolled_back(told=False)


def test_fault_at_prepare_is_a_refusal(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_FAULTS", " prepare , unrelated")
    with pytest.raises(InjectedFault, match="injected fault at 'prepare'"):
        h.migration().run()

    assert "prepare" not in h.peer.calls
    h.assert_untouched()


def test_unlisted_fault_points_do_not_fire(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_FAULTS", "target-restore,dumping")
    h.migration().run()
    assert h.job.state is JobState.MOVED


# -- known bugs (see the report; strict, so a fix turns these into failures to remove) ---


def test_os_error_after_the_freeze_still_resumes_the_job(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(rec: JobRecord, image_dir: Path) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(migrate, "copy_logs", no_space)
    with pytest.raises(MigrationAbortedError):
        h.migration().run()
    h.assert_rolled_back()


# -- the source refuses before anything is frozen ------------------------------------------------


def test_the_source_refuses_post_copy_it_cannot_serve(h: Harness) -> None:
    h.criu.lazy_blocker = "fs.pipe-max-size is 1048576"
    with pytest.raises(RefusedError, match=r"cannot serve post-copy from nodea: fs\.pipe-max-size"):
        h.migration(method=Method.POST_COPY).run()
    assert h.peer.calls == []
    h.assert_untouched()


def test_a_target_that_grants_no_post_copy_is_a_refusal(h: Harness) -> None:
    h.criu.lazy_blocker = ""
    with pytest.raises(RefusedError, match="does not offer post-copy"):
        h.migration(method=Method.POST_COPY).run()  # the fake target's lease has no `lazy`
    assert h.peer.prepare_req.lazy
    h.assert_untouched()


def test_the_default_moves_pre_copy_where_this_node_cannot_serve_post_copy(h: Harness) -> None:
    h.criu.lazy_blocker = "fs.pipe-max-size is 1048576"
    result = h.migration(method=Method.DEFAULT).run()
    assert not h.peer.prepare_req.lazy  # the target was asked for pre-copy
    assert result.method == (
        "pre-copy (post-copy unavailable: nodea cannot serve it: fs.pipe-max-size is 1048576)"
    )
    assert h.phases_emitted()[-1] == "done"


def test_the_default_moves_pre_copy_to_a_target_that_cannot_restore_lazily(h: Harness) -> None:
    h.criu.lazy_blocker = ""
    result = h.migration(method=Method.DEFAULT).run()  # the fake target's info has no post_copy
    assert not h.peer.prepare_req.lazy
    assert result.method.startswith("pre-copy (post-copy unavailable: target nodeb cannot restore lazily")


def test_the_default_asks_for_post_copy_where_both_nodes_can(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    h.criu.lazy_blocker = ""
    info = h.peer.info
    monkeypatch.setattr(h.peer, "info", lambda: pb.NodeInfo(**_fields(info()), post_copy=True))
    with pytest.raises(RefusedError, match="does not offer post-copy"):
        h.migration(method=Method.DEFAULT).run()  # the fake's lease grants none: a refusal, no fallback
    assert h.peer.prepare_req.lazy
    h.assert_untouched()


def test_an_explicit_method_is_what_the_result_names(h: Harness) -> None:
    assert h.migration(method=Method.PRE_COPY).run().method == "pre-copy"


def _fields(m: pb.NodeInfo) -> dict[str, object]:
    return {f.name: v for f, v in m.ListFields()}


def test_a_lazy_dump_that_went_eager_is_said_and_its_criu_logs_kept(h: Harness) -> None:
    m = h.migration(method=Method.POST_COPY)
    m.result.method = "post-copy"
    m._check_lazy(1 << 20)  # a few pages that cannot be lazy (the stacks): as it should be
    assert (m.result.method, m.keep_criu_logs) == ("post-copy", False)
    m._check_lazy(4_600_000_000)
    assert m.result.method == (
        "post-copy (CRIU dumped 4.60 GB of the memory eagerly instead of leaving it lazy)"
    )
    assert m.keep_criu_logs


# -- post-copy's settlement ------------------------------------------------------------


class _BrokenLazyDump:
    """A lazy dump whose page stream broke after the target resumed the job."""

    def wait(self, timeout_s: float) -> object:
        raise CriuError("lazy dump", "page transfer broke off", log_path=Path("/nonexistent"))


@pytest.mark.parametrize(
    ("answers", "state"),
    [
        ([FerryError("migration record is unreadable")], MigrationState.UNRESOLVED),
        ([UnavailableError("unreachable")], MigrationState.UNRESOLVED),
        ([pb.TARGET_STATE_POSTCOPY], MigrationState.UNRESOLVED),
        ([pb.TARGET_STATE_POSTCOPY, pb.TARGET_STATE_ABORTED], MigrationState.ABORTED),
        ([pb.TARGET_STATE_RUNNING], MigrationState.PAGING),  # all pages there: the move goes on
    ],
)
def test_a_broken_post_copy_is_settled_by_the_targets_word_and_never_left_paging(
    h: Harness, answers: list[object], state: MigrationState, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect: an error other than UNAVAILABLE from GetMigration after a broken post-copy left the
    job frozen in PAGING, which nothing settles until a restart."""
    h.peer.status_answers = answers  # type: ignore[assignment]
    m = h.migration()
    m.lazy_dump = _BrokenLazyDump()  # type: ignore[assignment]
    m.data.pages = types.SimpleNamespace(close=lambda: None)  # type: ignore[assignment]
    m._journal(state=MigrationState.PAGING.value)  # as if it got this far
    h.registry.begin_move("train", MID, "migration")
    procs.stop([h.pid])
    t = [0.0]  # a clock that moves only when slept on: POSTCOPY_SETTLE_S passes at once

    def sleep(s: float) -> None:
        t[0] += s

    clock = types.SimpleNamespace(monotonic=lambda: t[0], time=migrate.time.time, sleep=sleep)
    for module in (migrate, source_postcopy):  # _ask_target's tries, post-copy's settling
        monkeypatch.setattr(module, "time", clock)
    if state is MigrationState.PAGING:
        m._post_copy(h.job, [h.pid])
    else:
        with pytest.raises(FerryError):
            m._post_copy(h.job, [h.pid])
    assert m.state is state
    assert m.journal.get("source", MID).state == state.value
    if state is MigrationState.ABORTED:
        wait_running(h.pid)
    else:
        assert is_stopped(h.pid) and h.resumed == []


# -- every gRPC status at every call of a move ----------------------------------------------


@pytest.mark.parametrize("code", FAULT_CODES, ids=lambda c: c.name)
@pytest.mark.parametrize("call", ["info", "prepare", "stream_pages", "push", "commit", "abort", "status"])
@pytest.mark.parametrize("target", [pb.TARGET_STATE_RESTORING, pb.TARGET_STATE_ABORTED])
def test_any_status_at_any_call_ends_with_one_copy_or_a_held_one(
    h: Harness, call: str, code: grpc.StatusCode, target: int
) -> None:
    """Whatever a call answers, the move ends committed (the job moved), aborted (it runs here) or
    UNRESOLVED (frozen here, the target's word unknown): never resumed while the target may
    restore it, never stranded in between."""
    h.peer.fail[call] = rpc_error(code)
    h.peer.status_answers = [target]
    if call != "commit" and call != "status":
        h.peer.fail.setdefault("commit", rpc_error(grpc.StatusCode.UNAVAILABLE))
    m = h.migration()
    with contextlib.suppress(FerryError):
        m.run()
    assert m.state in (MigrationState.COMMITTED, MigrationState.ABORTED, MigrationState.UNRESOLVED)
    assert m.journal.get("source", MID).state == m.state.value
    if m.state is MigrationState.ABORTED:
        assert h.job.state is JobState.RUNNING
        wait_running(h.pid)
        # Resumed after the commit may have gone out only on the target's own "not here".
        assert "commit" not in h.peer.calls or target == pb.TARGET_STATE_ABORTED
    elif m.state is MigrationState.UNRESOLVED:
        assert h.job.state is JobState.MIGRATING and is_stopped(h.pid) and h.resumed == []
    else:
        assert h.job.state is JobState.MOVED
        wait_for(lambda: is_dead(h.pid), what=f"pid {h.pid} to die")  # SIGKILLed: gone at once, or soon

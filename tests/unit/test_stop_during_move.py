"""A stop asked for while the job moves is remembered and carried out where the move leaves it
(issue 28: a scheduler's cancel during a move was refused and lost)."""

from __future__ import annotations

import pytest
from fake_cuda import R
from fakes import wait_for
from test_migrate_cuda import MID, TwoNodes, nodes  # noqa: F401 - the fixture

from agent.errors import MigrationAbortedError, NotFoundError, PermissionDeniedError, UnavailableError
from agent.jobs.record import JobState
from agent.migration import stops
from agent.migration.journal import MigrationRecord
from agent.rpc import pb


def stop_when_committing(nodes: TwoNodes) -> None:  # noqa: F811
    """`ferry stop` arrives while the source waits for the target's Commit."""
    commit = nodes.target.commit

    def late_stop(req: pb.CommitRequest, caller: str = "") -> pb.CommitResponse:
        rec = nodes.src_reg.stop("train", timeout_s=2.0)
        assert rec.state is JobState.MIGRATING and rec.stop_grace_s == 2.0  # remembered, not refused
        return commit(req, caller)

    nodes.target.commit = late_stop  # type: ignore[method-assign]


def test_a_stop_during_a_move_that_commits_is_carried_out_on_the_target(nodes: TwoNodes) -> None:  # noqa: F811
    stop_when_committing(nodes)
    nodes.migration().run()
    assert nodes.job.state is JobState.MOVED
    assert "passed on to nodeb" in nodes.job.note
    wait_for(
        lambda: nodes.dst_reg.get("train").state is JobState.STOPPED, what="the job stopped on the target"
    )


def test_a_stop_during_a_move_that_aborts_stops_the_job_here(nodes: TwoNodes) -> None:  # noqa: F811
    stop_when_committing(nodes)
    nodes.dst_drv.fail_once["restore"] = R.CUDA_ERROR_OUT_OF_MEMORY  # the target cannot restore
    with pytest.raises(MigrationAbortedError):
        nodes.migration().run()
    wait_for(lambda: nodes.job.state is JobState.STOPPED, what="the resumed job stopped on the source")
    wait_for(lambda: nodes.proc.poll() is not None, what="its process ended")


@pytest.mark.parametrize("answers", [1, 3], ids=["after-a-retry", "never"])
def test_a_stop_is_retried_and_one_that_cannot_reach_the_target_says_where_to_stop_it(
    nodes: TwoNodes,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    answers: int,
) -> None:
    monkeypatch.setattr(stops, "RETRY_S", (0.0, 0.0, None))
    stop_when_committing(nodes)
    m = nodes.migration()
    real, tries = m.peer.stop_moved, []

    def flaky(mid: str, timeout_s: float) -> object:
        tries.append(mid)
        if len(tries) <= answers:
            raise UnavailableError("agent 127.0.0.1:7071 is unreachable")
        return real(mid, timeout_s)

    m.peer.stop_moved = flaky  # type: ignore[method-assign]
    m.run()
    assert nodes.job.state is JobState.MOVED
    if answers < 3:
        assert len(tries) == answers + 1 and "passed on to nodeb" in nodes.job.note
    else:
        assert len(tries) == 3
        assert "did not reach nodeb" in nodes.job.note and "ferry stop --agent" in nodes.job.note


def test_only_the_node_that_moved_a_job_may_stop_it_by_its_migration(nodes: TwoNodes) -> None:  # noqa: F811
    nodes.migration().run()
    rec = nodes.target.journal.get("target", MID)
    rec.peer_name = "nodea"
    nodes.target.journal.save(rec)
    with pytest.raises(PermissionDeniedError, match="belongs to node 'nodea'"):
        nodes.target.moved_here(MID, caller="mallory")
    assert nodes.target.moved_here(MID, caller="nodea") == "train"
    with pytest.raises(NotFoundError, match="no migration 0000000000000bad came to this node"):
        nodes.target.moved_here("0000000000000bad", caller="nodea")


def test_a_stop_passed_on_never_reaches_another_job_of_the_same_name(nodes: TwoNodes) -> None:  # noqa: F811
    """The moved job ended and a new one took its name: the migration no longer speaks for it."""
    nodes.migration().run()
    here = nodes.dst_reg.get("train")
    assert nodes.target.moved_here(MID) == "train"
    nodes.dst_reg.update("train", pid=here.pid + 100000)  # as if another job now held the name
    with pytest.raises(NotFoundError, match="is no longer the job of that name"):
        nodes.target.moved_here(MID)


def test_a_local_restore_cannot_be_stopped_by_a_peer(nodes: TwoNodes) -> None:  # noqa: F811
    rec = MigrationRecord("restore-1", "target", "train", "running", kind="restore")
    nodes.target.journal.save(rec)
    with pytest.raises(PermissionDeniedError, match="is a local restore here"):
        nodes.target.moved_here("restore-1", caller="nodea")

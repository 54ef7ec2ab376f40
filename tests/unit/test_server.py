"""Real in-process gRPC round trips (agent.service) with a fake CRIU: codes, messages, a whole migration."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fakes import PAGES_BYTES, SLEEP, dies, is_stopped, launched_record, wait_for
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent import __version__
from agent.jobs.record import JobState
from agent.migration import target as incoming
from agent.rpc import pb, pb_grpc

S = grpc.StatusCode


@pytest.fixture(autouse=True)
def _no_faults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FERRY_FAULTS", raising=False)
    monkeypatch.setattr(incoming, "RESUME_LOOK_S", 0.2)


def rpc_error(call, *args, **kw) -> grpc.RpcError:
    """The error a unary call (or the first read of a stream) ends with."""
    with pytest.raises(grpc.RpcError) as exc:
        result = call(*args, timeout=10, **kw)
        if isinstance(result, Iterator):
            list(result)
    err = exc.value
    assert err.code() is not S.UNKNOWN, err.details()
    return err


# -- node ----------------------------------------------------------------------------


def test_get_info(stub, agent) -> None:
    svc, _, _ = agent
    info = stub.GetInfo(pb.GetInfoRequest(), timeout=10)
    assert info.node_name == "nodea"
    assert info.version == __version__
    assert info.criu_version == "4.2.1"
    assert info.agent_id == svc.agent_id and re.fullmatch(r"[0-9a-f]{32}", info.agent_id)
    assert info.staging_dir == str(svc.staging_root)
    assert info.staging_free_bytes > 0


def test_get_info_reports_unusable_criu_instead_of_failing(stub, agent) -> None:
    agent[2].usable = False
    info = stub.GetInfo(pb.GetInfoRequest(), timeout=10)
    assert info.criu_version == "unusable: criu not found"


def test_two_agents_have_different_ids(make_agent) -> None:
    a, b = make_agent("n1")[0], make_agent("n2")[0]
    assert a.agent_id != b.agent_id


def test_health_service_serves(agent) -> None:
    with grpc.insecure_channel(agent[1]) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="ferry.v1.Agent"), timeout=10
        )
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


# -- jobs ----------------------------------------------------------------------------


def test_list_jobs(stub, agent, sleeper) -> None:
    assert list(stub.ListJobs(pb.ListJobsRequest(), timeout=10).jobs) == []
    proc, out, err = sleeper()
    agent[0].registry.save(launched_record("train", proc, out, err))

    jobs = list(stub.ListJobs(pb.ListJobsRequest(), timeout=10).jobs)
    assert [j.name for j in jobs] == ["train"]
    j = jobs[0]
    assert j.state == pb.JOB_STATE_RUNNING
    assert j.kind == pb.JOB_KIND_LAUNCHED
    assert j.pid == proc.pid
    assert j.node_name == "nodea"
    assert j.stdout_path == str(out)
    assert not j.has_exit_code


def test_run_carries_priority_and_policy_as_enums_with_their_defaults(stub, agent) -> None:
    def run(name: str, **kw: int) -> pb.Job:
        return stub.Run(pb.RunRequest(name=name, command=[SLEEP, "60"], cwd="/", **kw), timeout=30)

    try:
        plain = run("plain")  # UNSPECIFIED: normal priority, migrate off a degrading GPU
        assert (plain.priority_class, plain.degraded_policy) == (pb.PRIORITY_NORMAL, pb.ON_DEGRADED_MIGRATE)
        low = run("low", priority_class=pb.PRIORITY_LOW, degraded_policy=pb.ON_DEGRADED_ALERT)
        assert (low.priority_class, low.degraded_policy) == (pb.PRIORITY_LOW, pb.ON_DEGRADED_ALERT)
        rec = agent[0].registry.get("low")  # the record keeps the product's words
        assert (rec.priority, rec.on_degraded) == ("low", "alert")
        listed = {j.name: j for j in stub.ListJobs(pb.ListJobsRequest(), timeout=10).jobs}
        assert listed["low"].priority_class == pb.PRIORITY_LOW
    finally:
        for rec in agent[0].registry.list():
            if rec.state.active:
                agent[0].registry.stop(rec.name, 1)


def test_logs(stub, agent, sleeper) -> None:
    proc, out, err = sleeper()
    err.write_text("warning: lr is high\n")
    agent[0].registry.save(launched_record("train", proc, out, err))
    chunks = list(stub.Logs(pb.LogsRequest(name="train"), timeout=10))
    by_stream = {c.stream: c.data for c in chunks}
    assert by_stream[pb.LOG_STREAM_STDOUT] == out.read_bytes()
    assert by_stream[pb.LOG_STREAM_STDERR] == b"warning: lr is high\n"


def test_stop_job(stub, agent, sleeper) -> None:
    proc, out, err = sleeper()
    agent[0].registry.save(launched_record("train", proc, out, err))
    job = stub.StopJob(pb.StopJobRequest(name="train", timeout_s=5), timeout=30)
    assert job.state == pb.JOB_STATE_STOPPED
    assert dies(proc.pid)
    err = rpc_error(stub.StopJob, pb.StopJobRequest(name="train"))
    assert err.code() is S.FAILED_PRECONDITION
    assert "is stopped, not running" in err.details()


@pytest.mark.parametrize(
    ("method", "request_"),
    [
        ("StopJob", pb.StopJobRequest(name="nope")),
        ("Logs", pb.LogsRequest(name="nope")),
        ("Migrate", pb.MigrateRequest(name="nope", target="127.0.0.1:1")),
        ("Checkpoint", pb.CheckpointRequest(name="nope", out_dir="/tmp/ferry-unit-never")),
    ],
)
def test_unknown_job_is_not_found_and_named(stub, method: str, request_) -> None:
    err = rpc_error(getattr(stub, method), request_)
    assert err.code() is S.NOT_FOUND
    assert "'nope'" in err.details()
    assert "nodea" in err.details()
    assert "\n" not in err.details()


@pytest.mark.parametrize(
    ("method", "request_", "words"),
    [
        ("Run", pb.RunRequest(name="../evil", command=["true"]), "invalid job name"),
        ("Adopt", pb.AdoptRequest(name="ok", pid=1), "invalid --pid 1"),
        ("Adopt", pb.AdoptRequest(name="bad name", pid=2), "invalid job name"),
        ("Migrate", pb.MigrateRequest(name="train", target="nonsense"), "invalid agent address 'nonsense'"),
        ("Checkpoint", pb.CheckpointRequest(name="train", out_dir="relative/dir"), "absolute"),
        ("Restore", pb.RestoreRequest(image_dir="relative/dir"), "absolute"),
        ("Prepare", pb.PrepareRequest(migration_id="", job="train"), "needs a migration id"),
        (
            "Prepare",
            pb.PrepareRequest(migration_id="../x", job="train", source_node="a", cwd="/"),
            "invalid migration id",
        ),
    ],
)
def test_bad_input_is_invalid_argument(stub, method: str, request_, words: str) -> None:
    err = rpc_error(getattr(stub, method), request_)
    assert err.code() is S.INVALID_ARGUMENT
    assert words in err.details()


def test_adopt_of_a_missing_process_is_not_found(stub) -> None:
    pid = int(Path("/proc/sys/kernel/pid_max").read_text()) - 1
    err = rpc_error(stub.Adopt, pb.AdoptRequest(name="ghost", pid=pid))
    assert err.code() is S.NOT_FOUND
    assert str(pid) in err.details()


def test_restore_of_a_missing_image_is_not_found(stub, tmp_path: Path) -> None:
    err = rpc_error(stub.Restore, pb.RestoreRequest(image_dir=str(tmp_path / "no-such-image")))
    assert err.code() is S.NOT_FOUND
    assert "no-such-image" in err.details()


def test_restore_of_a_tampered_image_is_data_loss(stub, tmp_path: Path) -> None:
    d = tmp_path / "img"
    d.mkdir()
    (d / "manifest.json").write_text("{not json")
    err = rpc_error(stub.Restore, pb.RestoreRequest(image_dir=str(d)))
    assert err.code() is S.DATA_LOSS  # bad data, not a bad argument: the CLI exits 1
    assert "malformed manifest" in err.details()


# -- peer protocol -------------------------------------------------------------------


def test_peer_rpcs_on_an_unknown_migration(stub) -> None:
    for call, req in [
        (stub.Commit, pb.CommitRequest(migration_id="nope")),
    ]:
        err = rpc_error(call, req)
        assert err.code() is S.NOT_FOUND
        assert "'nope'" in err.details()
    status = stub.GetMigration(pb.GetMigrationRequest(migration_id="nope"), timeout=10)
    assert status.state == pb.TARGET_STATE_UNKNOWN
    # Aborting an id never prepared fences it: it can never be prepared afterwards.
    stub.Abort(pb.AbortRequest(migration_id="nope", reason="source gave up"), timeout=10)
    status = stub.GetMigration(pb.GetMigrationRequest(migration_id="nope"), timeout=10)
    assert status.state == pb.TARGET_STATE_ABORTED
    err = rpc_error(
        stub.Prepare, pb.PrepareRequest(migration_id="nope", job="train", source_node="a", cwd="/")
    )
    assert err.code() is S.FAILED_PRECONDITION
    assert "never reused" in err.details()


def test_push_image_errors(stub) -> None:
    err = rpc_error(stub.PushImage, iter([]))
    assert err.code() is S.INVALID_ARGUMENT

    stub.Prepare(
        pb.PrepareRequest(migration_id="m1", job="train", source_node="a", cwd="/", estimated_bytes=1),
        timeout=10,
    )
    bad = pb.ImageChunk(
        migration_id="m1",
        file="pages-1.img",
        data=b"abc",
        last=True,
        sha256=hashlib.sha256(b"abd").hexdigest(),
        files=[pb.ImageFile(name="pages-1.img", size=3)],
    )
    err = rpc_error(stub.PushImage, iter([bad]))
    assert err.code() is S.ABORTED
    assert "digest mismatch" in err.details()
    assert stub.GetMigration(pb.GetMigrationRequest(migration_id="m1"), timeout=10).state == (
        pb.TARGET_STATE_ABORTED
    )


def test_prepare_refusal_is_failed_precondition(stub) -> None:
    req = pb.PrepareRequest(
        migration_id="m1", job="train", source_node="a", cwd="/", paths=["/nonexistent-ferry/data"]
    )
    err = rpc_error(stub.Prepare, req)
    assert err.code() is S.FAILED_PRECONDITION
    assert "/nonexistent-ferry/data" in err.details()


# -- migrations through real RPCs ----------------------------------------------------


def test_migrate_to_an_unreachable_target_is_refused_and_costs_nothing(stub, agent, sleeper) -> None:
    svc, _, criu = agent
    proc, out, err = sleeper()
    svc.registry.save(launched_record("train", proc, out, err))
    e = rpc_error(stub.Migrate, pb.MigrateRequest(name="train", target="127.0.0.1:1"))
    assert e.code() is S.FAILED_PRECONDITION
    assert "127.0.0.1:1 is unreachable" in e.details()
    assert svc.registry.get("train").state is JobState.RUNNING
    assert criu.dumps == []
    assert not is_stopped(proc.pid)


def test_migrate_to_itself_is_refused(stub, agent, sleeper) -> None:
    svc, addr, criu = agent
    proc, out, err = sleeper()
    svc.registry.save(launched_record("train", proc, out, err))
    e = rpc_error(stub.Migrate, pb.MigrateRequest(name="train", target=addr))
    assert e.code() is S.INVALID_ARGUMENT
    assert "is this agent" in e.details()
    assert svc.registry.get("train").state is JobState.RUNNING
    assert criu.dumps == []


def test_migrate_between_two_agents(make_agent, sleeper) -> None:
    src, src_addr, src_criu = make_agent("nodea")
    dst, dst_addr, dst_criu = make_agent("nodeb")
    proc, out, err = sleeper()
    src.registry.save(launched_record("train", proc, out, err))

    with grpc.insecure_channel(src_addr) as ch:
        events = list(
            pb_grpc.AgentStub(ch).Migrate(pb.MigrateRequest(name="train", target=dst_addr), timeout=60)
        )

    phases = [e.phase for e in events]
    assert phases[0] == pb.PHASE_PREPARE
    assert phases[-1] == pb.PHASE_DONE
    assert pb.PHASE_DUMP in phases and pb.PHASE_TRANSFER in phases and pb.PHASE_RESTORE in phases
    r = events[-1].result
    assert (r.job, r.source_node, r.target_node, r.target) == ("train", "nodea", "nodeb", dst_addr)
    assert r.host_bytes == PAGES_BYTES
    assert r.image_bytes > PAGES_BYTES
    assert {"prepare", "dump", "transfer", "commit", "target restore"} <= {p.phase for p in r.phases}
    assert r.downtime_s >= r.frozen_s > 0  # the restored job ran on the target after its release
    assert r.downtime_by.startswith("CPU time: the job stopped at its freeze and ran again")

    moved = src.registry.get("train")
    assert moved.state is JobState.MOVED
    assert (moved.moved_to, moved.moved_to_node) == (dst_addr, "nodeb")
    assert dies(proc.pid)
    assert src_criu.dumps[0]["pid"] == proc.pid
    assert len(dst_criu.restores) == 1

    here = dst.registry.get("train")
    assert here.state is JobState.RUNNING
    assert here.pid == dst_criu.spawned[0]
    assert here.migrations == 1

    def logs() -> bytes:
        with grpc.insecure_channel(dst_addr) as ch:
            stub = pb_grpc.AgentStub(ch)
            return b"".join(c.data for c in stub.Logs(pb.LogsRequest(name="train"), timeout=10))

    assert logs().startswith(out.read_bytes())
    wait_for(lambda: b"restored\n" in logs(), what="the restored job's output on the target")


def test_followers_have_slots_of_their_own_and_never_starve_the_fencing_query(stub, agent) -> None:
    """Every follow slot taken: one more follower is refused at once with the limit, and the
    source's fencing query (GetMigration) and other calls still answer."""
    from agent.service.follow import FOLLOW_SLOTS

    streams = [stub.Events(pb.EventsRequest(follow=True, limit=1), timeout=30) for _ in range(FOLLOW_SLOTS)]
    try:
        agent[0].events.record("health", "a first event, so every follower has started")
        for s in streams:
            next(s)
        extra = stub.Events(pb.EventsRequest(follow=True, limit=1), timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            next(extra)
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"{FOLLOW_SLOTS} follow streams are open" in err.value.details()
        status = stub.GetMigration(pb.GetMigrationRequest(migration_id="m-unknown"), timeout=5)
        assert status.state == pb.TARGET_STATE_UNKNOWN
        assert stub.ListJobs(pb.ListJobsRequest(), timeout=5) is not None
    finally:
        for s in streams:
            s.cancel()

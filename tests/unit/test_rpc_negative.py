"""Bad input to every RPC of the Agent service, over real gRPC (agent.service.servicer) with a fake CRIU.

The agent serves plaintext on loopback, so access.py lets this caller ('loopback') call
everything: what comes back is the RPC's own answer. Every refusal must carry a specific status
code, never UNKNOWN or INTERNAL, and details that name the offending value or the problem.
Some cases here were bugs when written, fixed since: the agent accepted what it should
refuse, or answers INTERNAL.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fakes import SLEEP, launched_record, wait_for
from test_migrate_target import chunks_for, make_image

from agent.image import MANIFEST
from agent.jobs.record import JobKind, JobRecord, JobState
from agent.migration import target as incoming
from agent.rpc import pb

S = grpc.StatusCode
LONG = "n" * 300
#: Names no job may have: empty, a path, a space, too long.
BAD_NAMES = ["", "../x", "a b", LONG]
#: Ids no migration may have (1-64 letters, digits and '-').
BAD_IDS = ["", "../x", "a b", "a/b", "a.b", "a\0b", "m" * 65, LONG]
#: 64 characters that str.isalnum() accepts, 4 bytes each in UTF-8: 256 bytes, past NAME_MAX.
WIDE_ID = "\U0001d7d8" * 64  # MATHEMATICAL DOUBLE-STRUCK DIGIT ZERO


@pytest.fixture(autouse=True)
def _no_faults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FERRY_FAULTS", raising=False)
    monkeypatch.delenv("FERRY_PAUSE", raising=False)
    monkeypatch.setattr(incoming, "RESUME_LOOK_S", 0.2)


@pytest.fixture
def job(agent, sleeper) -> JobRecord:
    """A running launched job "train" (a `sleep 60` child) on the agent."""
    proc, out, err = sleeper()
    rec = launched_record("train", proc, out, err)
    agent[0].registry.save(rec)
    return rec


@pytest.fixture
def stubborn(agent, tmp_path: Path) -> Iterator[JobRecord]:
    """A running job "stubborn" whose process ignores SIGTERM; killed at teardown."""
    out, err = tmp_path / "stubborn.out", tmp_path / "stubborn.err"
    out.write_text("")
    err.write_text("")
    with open(out, "ab") as o, open(err, "ab") as e:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", f"trap '' TERM; echo ready; exec {SLEEP} 60"],
            stdin=subprocess.DEVNULL,
            stdout=o,
            stderr=e,
            start_new_session=True,
        )
    wait_for(lambda: out.read_text() == "ready\n", what="the stubborn job to start")
    rec = launched_record("stubborn", proc, out, err)
    agent[0].registry.save(rec)
    yield rec
    proc.kill()
    proc.wait(timeout=10)


def refused(call, request, code: grpc.StatusCode, *words: str, timeout: float = 10.0) -> grpc.RpcError:
    """The error a unary call (or a whole response stream) ends with: `code`, naming `words`."""
    with pytest.raises(grpc.RpcError) as exc:
        result = call(request, timeout=timeout)
        if isinstance(result, Iterator):
            list(result)
    err = exc.value
    got = f"{err.code().name}: {err.details()}"
    assert err.code() not in (S.UNKNOWN, S.INTERNAL), f"bad input answered {got}"
    assert err.code() is code, f"expected {code.name}, got {got}"
    for w in words:
        assert w in err.details(), f"{w!r} not named in {got}"
    return err


def free_pid() -> int:
    pid = int(Path("/proc/sys/kernel/pid_max").read_text()) - 1
    while os.path.exists(f"/proc/{pid}"):
        pid -= 1
    return pid


def prepare(stub, mid: str = "m1", job: str = "train", **kw: object) -> pb.Lease:
    fields: dict[str, object] = {"migration_id": mid, "job": job, "source_node": "nodea", "cwd": "/"}
    fields.update(kw)
    return stub.Prepare(pb.PrepareRequest(**fields), timeout=10)  # type: ignore[arg-type]


def state(stub, mid: str = "m1") -> int:
    return stub.GetMigration(pb.GetMigrationRequest(migration_id=mid), timeout=10).state


def with_manifest(chunks: list[pb.ImageChunk], raw: bytes) -> list[pb.ImageChunk]:
    """The stream with its manifest replaced (and its digest to match)."""
    assert chunks[-1].file == MANIFEST
    chunks[-1].data, chunks[-1].sha256 = raw, hashlib.sha256(raw).hexdigest()
    return chunks


def manifest_json(job: str = "train", **changes: object) -> bytes:
    m: dict[str, object] = {
        "version": 1,
        "job": {
            "name": job,
            "kind": "launched",
            "command": ["x"],
            "cwd": "/",
            "env": [],
            "stdout_path": "",
            "stderr_path": "",
            "pid": 1,
        },
        "source_node": "nodea",
        "files": [],
        "created_at": 0,
        "host_bytes": 0,
        "gpu_bytes": 0,
    }
    m.update(changes)
    return json.dumps(m).encode()


#: Manifests with a good digest that crash the agent (see test_intake_properties.KNOWN_BAD_MANIFESTS).
CRASHING_MANIFESTS = {
    "infinite host_bytes": manifest_json(host_bytes=float("inf")),
    "nested 100000 deep": b"[" * 100_000,
    "a file name that is a number": manifest_json(files=[{"name": 5, "size": 1, "sha256": "0" * 64}]),
    "a file name that is a list": manifest_json(files=[{"name": [1], "size": 1, "sha256": "0" * 64}]),
}


# -- RPCs without arguments ---------------------------------------------------------------------


def test_get_info_with_an_empty_request(stub) -> None:
    assert stub.GetInfo(pb.GetInfoRequest(), timeout=10).node_name == "nodea"


def test_list_gpus_with_an_empty_request(stub) -> None:
    inv = stub.ListGpus(pb.ListGpusRequest(), timeout=10)
    assert inv.nvml_available or inv.nvml_detail  # no NVML is an answer, with its reason


def test_list_jobs_with_an_empty_request(stub) -> None:
    assert list(stub.ListJobs(pb.ListJobsRequest(), timeout=10).jobs) == []


# -- arguments bad on their face: no state needed ----------------------------------------------

STATELESS = [
    *[
        ("Run", pb.RunRequest(name=n, command=["/bin/true"], cwd="/"), S.INVALID_ARGUMENT, repr(n))
        for n in BAD_NAMES
    ],
    ("Run", pb.RunRequest(name="ok", cwd="/"), S.INVALID_ARGUMENT, "no command given"),
    (
        "Run",
        pb.RunRequest(name="ok", command=["/bin/true"], cwd="/nonexistent-ferry/work"),
        S.INVALID_ARGUMENT,
        "'/nonexistent-ferry/work' does not exist",
    ),
    *[
        (
            "Run",
            pb.RunRequest(name="ok", command=["/bin/true"], cwd="/", env=[e]),
            S.INVALID_ARGUMENT,
            repr(e),
        )
        for e in ["NOEQUALS", "1X=y", "=y", "A B=c"]
    ],
    # Enum numbers this agent does not know (a newer client): refused, quoting the number.
    *[
        (
            "Run",
            pb.RunRequest(name="ok", command=["/bin/true"], cwd="/", priority_class=n),
            S.INVALID_ARGUMENT,
            f"unknown priority {n}: expected one of PRIORITY_NORMAL (1), PRIORITY_LOW (2)",
        )
        for n in [3, 99, -1]
    ],
    (
        "Run",
        pb.RunRequest(name="ok", command=["/bin/true"], cwd="/", degraded_policy=7),
        S.INVALID_ARGUMENT,
        "unknown on-degraded policy 7: expected one of ON_DEGRADED_MIGRATE (1), ON_DEGRADED_ALERT (2)",
    ),
    *[
        ("Adopt", pb.AdoptRequest(name=n, pid=12345), S.INVALID_ARGUMENT, f"invalid job name {n!r}")
        for n in BAD_NAMES
    ],
    *[
        ("Adopt", pb.AdoptRequest(name="ok", pid=p), S.INVALID_ARGUMENT, f"invalid --pid {p}")
        for p in [0, 1, -1, -(2**31)]
    ],
    *[("StopJob", pb.StopJobRequest(name=n), S.NOT_FOUND, repr(n)) for n in [*BAD_NAMES, "nope"]],
    *[("Logs", pb.LogsRequest(name=n), S.NOT_FOUND, repr(n)) for n in [*BAD_NAMES, "nope"]],
    *[
        (
            "Migrate",
            pb.MigrateRequest(name="train", target=t),
            S.INVALID_ARGUMENT,
            f"invalid agent address {t!r}",
        )
        for t in [
            "",
            "nonsense",
            "host:",
            ":7070",
            "127.0.0.1:0",
            "127.0.0.1:65536",
            "127.0.0.1:-1",
            "127.0.0.1:http",
            "127.0.0.1: 80",
            "[::1]",
        ]
    ],
    ("Migrate", pb.MigrateRequest(name="", target="127.0.0.1:1"), S.NOT_FOUND, "''"),
    ("Migrate", pb.MigrateRequest(name="nope", target="127.0.0.1:1"), S.NOT_FOUND, "'nope'"),
    *[
        (
            "Checkpoint",
            pb.CheckpointRequest(name="train", out_dir=d),
            S.INVALID_ARGUMENT,
            f"absolute directory path, got {d!r}",
        )
        for d in ["", "relative/dir", ".", "~/img"]
    ],
    ("Checkpoint", pb.CheckpointRequest(name="nope", out_dir="/tmp/ferry-never"), S.NOT_FOUND, "'nope'"),
    *[
        ("Restore", pb.RestoreRequest(image_dir=d), S.INVALID_ARGUMENT, f"absolute path, got {d!r}")
        for d in ["", "relative/dir", "."]
    ],
    *[
        (
            "Restore",
            pb.RestoreRequest(image_dir="/tmp/img", name=n),
            S.INVALID_ARGUMENT,
            f"invalid job name {n!r}",
        )
        for n in ["../x", "a b", LONG]
    ],
    (
        "Restore",
        pb.RestoreRequest(image_dir="/nonexistent-ferry/image"),
        S.NOT_FOUND,
        "/nonexistent-ferry/image",
    ),
    *[
        ("Resolve", pb.ResolveRequest(name=n), S.INVALID_ARGUMENT, f"invalid job name {n!r}")
        for n in BAD_NAMES
    ],
    *[
        (
            "Resolve",
            pb.ResolveRequest(name="train", resolution=n),
            S.INVALID_ARGUMENT,
            f"unknown resolve action {n}: expected one of RESOLVE_ACTION_ASK (1)",
        )
        for n in [4, 99, -1]
    ],
    ("Resolve", pb.ResolveRequest(name="nope"), S.NOT_FOUND, "'nope'"),
    ("Resolve", pb.ResolveRequest(name="nope", resolution=pb.RESOLVE_ACTION_RESUME), S.NOT_FOUND, "'nope'"),
    (
        "Prepare",
        pb.PrepareRequest(),
        S.INVALID_ARGUMENT,
        "needs a migration id, a job name and the source node",
    ),
    ("Prepare", pb.PrepareRequest(migration_id="m1", job="train"), S.INVALID_ARGUMENT, "source node"),
    ("Prepare", pb.PrepareRequest(migration_id="m1", source_node="a"), S.INVALID_ARGUMENT, "a job name"),
    *[
        (
            "Prepare",
            pb.PrepareRequest(migration_id=m, job="train", source_node="a", cwd="/"),
            S.INVALID_ARGUMENT,
            f"invalid migration id {m!r}",
        )
        for m in BAD_IDS
        if m
    ],
    *[
        (
            "Prepare",
            pb.PrepareRequest(migration_id="m1", job=n, source_node="a", cwd="/"),
            S.INVALID_ARGUMENT,
            f"invalid job name {n!r}",
        )
        for n in BAD_NAMES
        if n
    ],
    *[
        ("Commit", pb.CommitRequest(migration_id=m), S.INVALID_ARGUMENT, f"invalid migration id {m!r}")
        for m in BAD_IDS
    ],
    ("Commit", pb.CommitRequest(migration_id="nope"), S.NOT_FOUND, "'nope'"),
    *[
        (
            "Abort",
            pb.AbortRequest(migration_id=m, reason="x"),
            S.INVALID_ARGUMENT,
            f"invalid migration id {m!r}",
        )
        for m in BAD_IDS
    ],
    *[
        (
            "GetMigration",
            pb.GetMigrationRequest(migration_id=m),
            S.INVALID_ARGUMENT,
            f"invalid migration id {m!r}",
        )
        for m in BAD_IDS
    ],
]


@pytest.mark.parametrize(
    ("method", "request_", "code", "words"),
    STATELESS,
    ids=[f"{m}-{i}" for i, (m, *_) in enumerate(STATELESS)],
)
def test_bad_arguments(stub, method: str, request_, code: grpc.StatusCode, words: str) -> None:
    refused(getattr(stub, method), request_, code, words)


# -- Run ------------------------------------------------------------------------------------------


def test_run_refuses_a_name_an_active_job_holds(stub, job) -> None:
    req = pb.RunRequest(name="train", command=["/bin/true"], cwd="/")
    refused(stub.Run, req, S.ALREADY_EXISTS, "'train'", "running")


@pytest.mark.parametrize(
    "req",
    [
        pb.RunRequest(name="nul", command=["/bin/tr\0ue"], cwd="/"),
        pb.RunRequest(name="nul", command=["/bin/true", "a\0b"], cwd="/"),
        pb.RunRequest(name="nul", command=["/bin/true"], cwd="/", env=["A=b\0c"]),
    ],
    ids=["command", "argument", "env"],
)
def test_run_refuses_nul_bytes(stub, req) -> None:
    refused(stub.Run, req, S.INVALID_ARGUMENT, "null")


def test_run_refuses_a_relative_working_directory(stub) -> None:
    # Long enough to be seen started (a job that ends at once reads as "failed to start").
    req = pb.RunRequest(name="rel", command=["/bin/sh", "-c", "sleep 0.5"], cwd=".")
    refused(stub.Run, req, S.INVALID_ARGUMENT, "'.'")


# -- Adopt ----------------------------------------------------------------------------------------


def test_adopt_refuses_the_agent_itself(stub) -> None:
    pid = os.getpid()  # the agent runs in this process
    refused(stub.Adopt, pb.AdoptRequest(name="me", pid=pid), S.INVALID_ARGUMENT, f"--pid {pid}", "this agent")


def test_adopt_of_a_pid_that_does_not_exist(stub) -> None:
    pid = free_pid()
    refused(stub.Adopt, pb.AdoptRequest(name="ghost", pid=pid), S.NOT_FOUND, f"pid {pid}")
    big = 2**31 - 1
    refused(stub.Adopt, pb.AdoptRequest(name="ghost", pid=big), S.NOT_FOUND, f"pid {big}")


def test_adopt_refuses_a_pid_or_name_already_taken(stub, job) -> None:
    refused(
        stub.Adopt, pb.AdoptRequest(name="again", pid=job.pid), S.ALREADY_EXISTS, f"pid {job.pid}", "'train'"
    )
    refused(stub.Adopt, pb.AdoptRequest(name="train", pid=job.pid), S.ALREADY_EXISTS, "'train'")


# -- StopJob --------------------------------------------------------------------------------------


def test_stop_of_a_job_that_is_not_running(stub, agent) -> None:
    agent[0].registry.save(
        JobRecord(name="done", kind=JobKind.LAUNCHED, state=JobState.EXITED, pid=1, command=["x"], cwd="/")
    )
    refused(stub.StopJob, pb.StopJobRequest(name="done"), S.FAILED_PRECONDITION, "'done'", "exited")


@pytest.mark.parametrize("timeout_s", [-1.0, math.nan, math.inf], ids=["negative", "nan", "inf"])
def test_stop_refuses_an_absurd_timeout(stub, stubborn, timeout_s: float) -> None:
    req = pb.StopJobRequest(name="stubborn", timeout_s=timeout_s)
    refused(stub.StopJob, req, S.INVALID_ARGUMENT, "timeout", timeout=3.0)


# -- Logs -----------------------------------------------------------------------------------------


def test_logs_refuses_an_unknown_stream(stub, job) -> None:
    refused(stub.Logs, pb.LogsRequest(name="train", stream=9), S.INVALID_ARGUMENT, "stream", "9")


def test_logs_of_a_job_whose_log_file_is_gone(stub, job) -> None:
    Path(job.stdout_path).unlink()
    with pytest.raises(grpc.RpcError) as exc:
        list(stub.Logs(pb.LogsRequest(name="train"), timeout=10))
    assert exc.value.code() in (S.NOT_FOUND, S.FAILED_PRECONDITION), exc.value.details()
    assert job.stdout_path in exc.value.details()


# -- Migrate --------------------------------------------------------------------------------------


def test_migrate_refuses_a_target_it_may_not_dial(stub, job, agent) -> None:
    refused(
        stub.Migrate,
        pb.MigrateRequest(name="train", target="10.1.2.3:7070"),
        S.INVALID_ARGUMENT,
        "10.1.2.3:7070",
        "loopback",
    )
    refused(
        stub.Migrate, pb.MigrateRequest(name="train", target=agent[1]), S.INVALID_ARGUMENT, "is this agent"
    )
    assert agent[0].registry.get("train").state is JobState.RUNNING
    assert agent[2].dumps == []


@pytest.mark.parametrize(
    "target", ["127.0.0.1:\u00b2", "127.0.0.1:\u0668\u0660"], ids=["superscript", "arabic"]
)
def test_migrate_refuses_a_port_of_non_ascii_digits(stub, target: str) -> None:
    refused(
        stub.Migrate,
        pb.MigrateRequest(name="nope", target=target),
        S.INVALID_ARGUMENT,
        "invalid agent address",
    )


# -- Checkpoint -----------------------------------------------------------------------------------


def test_checkpoint_refuses_a_directory_that_is_not_empty(stub, job, agent, tmp_path: Path) -> None:
    out = tmp_path / "full"
    out.mkdir()
    (out / "something").write_text("x")
    req = pb.CheckpointRequest(name="train", out_dir=str(out))
    refused(stub.Checkpoint, req, S.INVALID_ARGUMENT, str(out), "not empty")
    assert agent[0].registry.get("train").state is JobState.RUNNING
    assert agent[2].dumps == []


def _bad_out_dirs(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "a-file").write_text("x")
    return {"a regular file": str(tmp_path / "a-file"), "a NUL byte": str(tmp_path / "img\0x")}


@pytest.mark.parametrize("what", ["a regular file", "a NUL byte"])
def test_a_checkpoint_refused_for_its_out_dir_leaves_the_job_running(
    stub, job, agent, tmp_path, what
) -> None:
    req = pb.CheckpointRequest(name="train", out_dir=_bad_out_dirs(tmp_path)[what])
    with pytest.raises(grpc.RpcError):
        list(stub.Checkpoint(req, timeout=10))
    assert agent[0].registry.get("train").state is JobState.RUNNING
    assert agent[2].dumps == []


@pytest.mark.parametrize("what", ["a regular file", "a NUL byte"])
def test_checkpoint_refuses_an_out_dir_it_cannot_use(stub, job, tmp_path, what) -> None:
    out = _bad_out_dirs(tmp_path)[what]
    refused(
        stub.Checkpoint, pb.CheckpointRequest(name="train", out_dir=out), S.INVALID_ARGUMENT, repr(out)[1:20]
    )


# -- Restore --------------------------------------------------------------------------------------


def test_restore_of_a_directory_without_a_manifest(stub, tmp_path: Path) -> None:
    d = tmp_path / "empty"
    d.mkdir()
    refused(stub.Restore, pb.RestoreRequest(image_dir=str(d)), S.DATA_LOSS, str(d), "not a ferry image")


def test_restore_of_a_file_instead_of_a_directory(stub, tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    refused(stub.Restore, pb.RestoreRequest(image_dir=str(f)), S.NOT_FOUND, str(f))


def test_restore_refuses_an_unsafe_name_in_the_manifest(stub, agent, tmp_path: Path) -> None:
    d = tmp_path / "img"
    d.mkdir()
    (d / MANIFEST).write_bytes(
        manifest_json(files=[{"name": "../etc/passwd", "size": 1, "sha256": "0" * 64}])
    )
    refused(
        stub.Restore,
        pb.RestoreRequest(image_dir=str(d)),
        S.DATA_LOSS,
        "unsafe file name",
        "'../etc/passwd'",
    )
    assert agent[2].restores == []


@pytest.mark.parametrize("what", list(CRASHING_MANIFESTS))
def test_restore_refuses_a_malformed_manifest(stub, agent, tmp_path: Path, what: str) -> None:
    d = tmp_path / "img"
    d.mkdir()
    (d / MANIFEST).write_bytes(CRASHING_MANIFESTS[what])
    refused(stub.Restore, pb.RestoreRequest(image_dir=str(d)), S.DATA_LOSS, "manifest")


# -- Resolve --------------------------------------------------------------------------------------


def test_resolve_of_a_job_without_an_unsettled_migration(stub, job) -> None:
    for how in pb.ResolveAction.values():  # UNSPECIFIED asks, as ASK does
        req = pb.ResolveRequest(name="train", resolution=how)
        refused(stub.Resolve, req, S.FAILED_PRECONDITION, "'train'", "no unsettled migration")


# -- Prepare --------------------------------------------------------------------------------------


def test_prepare_refusals_are_failed_precondition(stub) -> None:
    refused(
        stub.Prepare,
        pb.PrepareRequest(migration_id="m1", job="train", source_node="a", cwd="/nonexistent-ferry/work"),
        S.FAILED_PRECONDITION,
        "/nonexistent-ferry/work",
    )
    req = pb.PrepareRequest(
        migration_id="m1", job="train", source_node="a", cwd="/", paths=["/nonexistent-ferry/x"]
    )
    refused(stub.Prepare, req, S.FAILED_PRECONDITION, "/nonexistent-ferry/x")
    req = pb.PrepareRequest(migration_id="m1", job="train", source_node="a", cwd="/", pids=[os.getpid()])
    refused(stub.Prepare, req, S.FAILED_PRECONDITION, str(os.getpid()), "in use")
    req = pb.PrepareRequest(
        migration_id="m1", job="train", source_node="a", cwd="/", estimated_bytes=2**64 - 1
    )
    refused(stub.Prepare, req, S.FAILED_PRECONDITION, "MiB free")
    gpu = pb.GpuNeed(uuid="GPU-nope", name="NoSuchChip", memory_bytes=1 << 50)
    req = pb.PrepareRequest(migration_id="m1", job="train", source_node="a", cwd="/", gpus=[gpu])
    refused(stub.Prepare, req, S.FAILED_PRECONDITION, "nodea")
    assert state(stub) == pb.TARGET_STATE_UNKNOWN  # none of them left a lease


def test_prepare_refuses_a_job_that_runs_here_and_a_reused_id(stub, job) -> None:
    refused(
        stub.Prepare,
        pb.PrepareRequest(migration_id="m1", job="train", source_node="a", cwd="/"),
        S.ALREADY_EXISTS,
        "'train'",
    )
    prepare(stub, job="other")
    refused(
        stub.Prepare,
        pb.PrepareRequest(migration_id="m1", job="third", source_node="a", cwd="/"),
        S.FAILED_PRECONDITION,
        "m1",
        "never reused",
    )


@pytest.mark.parametrize(
    "fields",
    [{"cwd": "."}, {"cwd": "tests"}, {"paths": ["."]}],
    ids=["cwd-dot", "cwd-relative", "paths-relative"],
)
def test_prepare_refuses_relative_paths(stub, fields: dict[str, object]) -> None:
    req = pb.PrepareRequest(migration_id="m1", job="train", source_node="a", **({"cwd": "/"} | fields))  # type: ignore[arg-type]
    refused(stub.Prepare, req, S.INVALID_ARGUMENT, "absolute")


@pytest.mark.parametrize("pid", [-5, 0], ids=["negative", "zero"])
def test_prepare_refuses_impossible_pids(stub, pid: int) -> None:
    req = pb.PrepareRequest(
        migration_id="m1", job="train", source_node="a", cwd="/", pids=[pid], kind=pb.JOB_KIND_ADOPTED
    )
    refused(stub.Prepare, req, S.INVALID_ARGUMENT, str(pid))


WIDE_ID_REQUESTS = {
    "Prepare": pb.PrepareRequest(migration_id=WIDE_ID, job="train", source_node="a", cwd="/"),
    "Abort": pb.AbortRequest(migration_id=WIDE_ID, reason="x"),
    "Commit": pb.CommitRequest(migration_id=WIDE_ID),
    "GetMigration": pb.GetMigrationRequest(migration_id=WIDE_ID),
}


@pytest.mark.parametrize("method", [*WIDE_ID_REQUESTS, "PushImage"])
def test_a_migration_id_of_wide_characters_is_invalid(stub, method: str) -> None:
    if method == "PushImage":
        files = [pb.ImageFile(name="a.img", size=1)]
        req = iter([pb.ImageChunk(migration_id=WIDE_ID, file="a.img", data=b"x", files=files)])
    else:
        req = WIDE_ID_REQUESTS[method]
    refused(getattr(stub, method), req, S.INVALID_ARGUMENT, "invalid migration id")


# -- PushImage ------------------------------------------------------------------------------------


def test_push_of_an_empty_stream(stub) -> None:
    refused(stub.PushImage, iter([]), S.INVALID_ARGUMENT, "empty image stream")


@pytest.mark.parametrize(
    ("mid", "code", "words"),
    [
        ("", S.INVALID_ARGUMENT, "invalid migration id ''"),
        ("../x", S.INVALID_ARGUMENT, "invalid migration id '../x'"),
        ("m" * 65, S.INVALID_ARGUMENT, "invalid migration id"),
        ("nope", S.NOT_FOUND, "'nope'"),
    ],
)
def test_push_whose_first_chunk_names_no_usable_migration(stub, mid: str, code, words: str) -> None:
    chunk = pb.ImageChunk(
        migration_id=mid, file="core-1.img", data=b"x", files=[pb.ImageFile(name="core-1.img", size=1)]
    )
    refused(stub.PushImage, iter([chunk]), code, words)


def test_push_whose_first_chunk_has_no_file_list(stub, agent) -> None:
    prepare(stub)
    chunk = pb.ImageChunk(migration_id="m1", file="core-1.img", data=b"x", last=True)
    refused(stub.PushImage, iter([chunk]), S.ABORTED, "did not start with its file list")
    assert state(stub) == pb.TARGET_STATE_ABORTED  # the lease is gone, and its staging dir
    assert list(agent[0].staging_root.iterdir()) == []
    refused(stub.PushImage, iter([chunk]), S.FAILED_PRECONDITION, "m1", "aborted, not waiting")
    refused(stub.Commit, pb.CommitRequest(migration_id="m1"), S.FAILED_PRECONDITION, "no verified image")
    assert agent[2].restores == []


@pytest.mark.parametrize(
    ("files", "words"),
    [
        ([pb.ImageFile(name="../x", size=1)], "unsafe file name in image: '../x'"),
        ([pb.ImageFile(name="/etc/passwd", size=1)], "unsafe file name in image: '/etc/passwd'"),
        ([pb.ImageFile(name=MANIFEST, size=1)], "listed twice"),
        ([pb.ImageFile(name="a.img", size=1), pb.ImageFile(name="a.img", size=1)], "listed twice"),
        ([pb.ImageFile(name="a.img", size=2**64 - 1)], "the lease's cap is"),
    ],
    ids=["dotdot", "absolute", "manifest", "twice", "over-cap"],
)
def test_push_refuses_a_bad_file_list(stub, agent, files, words: str) -> None:
    prepare(stub)
    chunk = pb.ImageChunk(migration_id="m1", file="a.img", data=b"x", last=True, files=files)
    refused(stub.PushImage, iter([chunk]), S.ABORTED, words)
    assert state(stub) == pb.TARGET_STATE_ABORTED
    assert agent[2].restores == []


def test_push_of_another_jobs_image(stub, agent, tmp_path: Path) -> None:
    prepare(stub, job="other")
    refused(
        stub.PushImage,
        iter(chunks_for(make_image(tmp_path), mid="m1")),
        S.DATA_LOSS,
        "'train'",
        "'other'",
    )
    assert state(stub) == pb.TARGET_STATE_ABORTED


@pytest.mark.parametrize("what", ["infinite host_bytes", "nested 100000 deep", "a file name that is a list"])
def test_push_refuses_a_malformed_manifest(stub, agent, tmp_path: Path, what: str) -> None:
    prepare(stub)
    chunks = with_manifest(chunks_for(make_image(tmp_path), mid="m1"), CRASHING_MANIFESTS[what])
    refused(stub.PushImage, iter(chunks), S.ABORTED, "manifest")


# -- Commit, Abort, GetMigration ------------------------------------------------------------------


def test_commit_without_a_verified_image(stub, agent) -> None:
    prepare(stub)
    refused(
        stub.Commit, pb.CommitRequest(migration_id="m1"), S.FAILED_PRECONDITION, "m1", "no verified image"
    )
    stub.Abort(pb.AbortRequest(migration_id="m1", reason="test"), timeout=10)
    refused(
        stub.Commit, pb.CommitRequest(migration_id="m1"), S.FAILED_PRECONDITION, "m1", "no verified image"
    )
    assert agent[2].restores == []


def test_a_running_migration_cannot_be_aborted_pushed_or_committed_again(stub, agent, tmp_path: Path) -> None:
    prepare(stub)
    chunks = chunks_for(make_image(tmp_path, pages=4096), mid="m1")
    stub.PushImage(iter(chunks), timeout=30)
    stub.Commit(pb.CommitRequest(migration_id="m1"), timeout=30)
    assert state(stub) == pb.TARGET_STATE_RUNNING
    refused(
        stub.Abort,
        pb.AbortRequest(migration_id="m1", reason="late"),
        S.FAILED_PRECONDITION,
        "m1",
        "already runs",
    )
    refused(stub.PushImage, iter(chunks), S.FAILED_PRECONDITION, "m1", "running, not waiting")
    refused(stub.Commit, pb.CommitRequest(migration_id="m1"), S.FAILED_PRECONDITION, "no verified image")
    assert len(agent[2].restores) == 1


def test_get_migration_of_an_unknown_id_is_unknown(stub) -> None:
    assert state(stub, "nope") == pb.TARGET_STATE_UNKNOWN

"""The target side of a migration (agent.migration.source.TargetMigrations): leases, intake, restore, fencing.

Every image here is produced by transfer.send_image, the source's own sender,
and then damaged on purpose where a test needs it.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from fakes import FakeCriu, is_dead, wait_for

from agent.errors import (
    AlreadyExistsError,
    CriuError,
    FerryError,
    ImageError,
    InvalidArgumentError,
    NotFoundError,
    RefusedError,
    TransferError,
)
from agent.faults import InjectedFault
from agent.image import (
    MANIFEST,
    STDERR_LOG,
    STDOUT_LOG,
    FileEntry,
    JobSpec,
    Manifest,
    StreamDigest,
    host_bytes,
    verify,
)
from agent.jobs import procs
from agent.jobs.record import JobKind, JobRecord, JobState
from agent.migration import source as migrate
from agent.migration import target as incoming
from agent.migration.datatls import KEYS_PREFIX, DataIdentity
from agent.migration.states import TargetState
from agent.migration.target import TargetMigrations
from agent.migration.transfer import SendStats, send_image
from agent.rpc import pb

MID = "feedfacecafe0001"
SRC_OUT = "/var/lib/ferry/nodea/jobs/train/stdout.log"
SRC_ERR = "/var/lib/ferry/nodea/jobs/train/stderr.log"


#: The source's one-time certificate for the data connection, as every source sends one.
SOURCE_CERT = DataIdentity.new("nodea m-1").cert_pem


def prepare_req(mid: str = MID, job: str = "train", **kw: object) -> pb.PrepareRequest:
    fields: dict[str, object] = {
        "migration_id": mid,
        "job": job,
        "source_node": "nodea",
        "kind": pb.JOB_KIND_LAUNCHED,
        "estimated_bytes": 1 << 20,
        "cwd": "/",
        "data_cert": SOURCE_CERT,
    }
    fields.update(kw)
    return pb.PrepareRequest(**fields)  # type: ignore[arg-type]


def make_image(root: Path, job: str = "train", pages: int = 200_000) -> Path:
    """The files a source would have in its staging dir after dump and log copy."""
    d = root / f"src-image-{uuid.uuid4().hex[:8]}"
    d.mkdir(parents=True)
    (d / "inventory.img").write_bytes(b"inventory")
    (d / "core-1.img").write_bytes(b"core" * 64)
    (d / "pages-1.img").write_bytes(os.urandom(pages))
    (d / STDOUT_LOG).write_bytes(b"step 1 loss 0.9\nstep 2 loss 0.8\n")
    (d / STDERR_LOG).write_bytes(b"")
    return d


def chunks_for(
    image_dir: Path, mid: str = MID, job: str = "train", page_stream: StreamDigest | None = None
) -> list[pb.ImageChunk]:
    spec = JobSpec(
        name=job,
        kind="launched",
        command=["python", "train.py"],
        cwd="/",
        env=["SEED=1"],
        stdout_path=SRC_OUT,
        stderr_path=SRC_ERR,
        pid=1,
        migrations=1,
    )

    def manifest(entries: list[FileEntry]) -> Manifest:
        return Manifest(
            job=spec,
            source_node="nodea",
            files=entries,
            host_bytes=host_bytes(entries),
            page_stream=page_stream,
        )

    return list(send_image(mid, image_dir, manifest, SendStats()))


def staged(target: TargetMigrations) -> list[str]:
    root = target.staging_root
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def state(target: TargetMigrations, mid: str = MID) -> int:
    return target.status(mid)


def delivered(target: TargetMigrations, tmp_path: Path) -> list[pb.ImageChunk]:
    """Prepare, push a good image: the migration is VERIFIED."""
    target.prepare(prepare_req())
    chunks = chunks_for(make_image(tmp_path))
    target.push(iter(chunks))
    assert state(target) == pb.TARGET_STATE_VERIFIED
    return chunks


def replace(chunk: pb.ImageChunk, **changes: object) -> pb.ImageChunk:
    c = pb.ImageChunk()
    c.CopyFrom(chunk)
    for k, v in changes.items():
        setattr(c, k, v)
    return c


def running_record(name: str, state: JobState = JobState.RUNNING) -> JobRecord:
    return JobRecord(name=name, kind=JobKind.LAUNCHED, state=state, pid=os.getpid(), command=["x"], cwd="/")


def free_pid() -> int:
    pid = int(Path("/proc/sys/kernel/pid_max").read_text()) - 1
    while psutil.pid_exists(pid):
        pid -= 1
    return pid


# -- prepare -------------------------------------------------------------------------


def test_prepare_grants_a_lease(target: TargetMigrations) -> None:
    before = time.time()
    lease = target.prepare(prepare_req(pids=[free_pid()]))

    assert lease.migration_id == MID
    assert lease.node_name == "nodeb"
    assert lease.max_bytes >= 2 * (1 << 20)
    assert lease.expires_at > before
    staging, key = staged(target)
    assert staging == f"in-{MID}" and key.startswith(KEYS_PREFIX)  # the data connection's one-time key
    assert state(target) == pb.TARGET_STATE_PREPARED


def test_a_granted_lease_touches_the_memory_its_image_will_fill_before_it_answers(
    target: TargetMigrations,
) -> None:
    warmed: list[tuple[Path, int, str]] = []
    target.warm = lambda where, size: warmed.append((where, size, state(target))) or 0.01
    target.prepare(prepare_req(pids=[free_pid()], estimated_bytes=300 << 20))
    # Granted first (refused leases touch nothing), in the staging the image comes to.
    assert warmed == [(target.staging_root, 300 << 20, pb.TARGET_STATE_PREPARED)]
    with pytest.raises(RefusedError):
        target.prepare(prepare_req(mid="feedfacecafe0002", cwd="/nonexistent/x"))
    assert len(warmed) == 1


def test_prepare_names_every_missing_path(target: TargetMigrations, tmp_path: Path) -> None:
    present = tmp_path / "shared-data.bin"
    present.write_bytes(b"x")
    missing = ["/nonexistent-ferry/shard-0.bin", "/nonexistent-ferry/shard-1.bin"]
    with pytest.raises(RefusedError) as exc:
        target.prepare(prepare_req(paths=[str(present), *missing]))

    msg = str(exc.value)
    assert all(m in msg for m in missing)
    assert str(present) not in msg
    assert "nodeb" in msg and exc.value.step == "prepare"
    assert "shared storage" in msg
    assert staged(target) == []
    assert state(target) == pb.TARGET_STATE_UNKNOWN


def test_prepare_shortens_a_long_list_of_missing_paths(target: TargetMigrations) -> None:
    missing = [f"/nonexistent-ferry/f{i}" for i in range(8)]
    with pytest.raises(RefusedError, match="and 3 more") as exc:
        target.prepare(prepare_req(paths=missing))
    assert "/nonexistent-ferry/f4" in str(exc.value)
    assert "/nonexistent-ferry/f5" not in str(exc.value)


def test_prepare_refuses_a_missing_working_directory(target: TargetMigrations) -> None:
    with pytest.raises(RefusedError, match="/nonexistent-ferry/work"):
        target.prepare(prepare_req(cwd="/nonexistent-ferry/work"))
    assert staged(target) == []


def test_prepare_refuses_pids_in_use_for_an_adopted_job(target: TargetMigrations) -> None:
    me = os.getpid()
    with pytest.raises(RefusedError) as exc:
        target.prepare(prepare_req(kind=pb.JOB_KIND_ADOPTED, pids=[free_pid(), me]))
    assert str(me) in str(exc.value)
    assert "in use" in str(exc.value)
    assert staged(target) == []


def test_prepare_refuses_when_staging_is_too_small(
    target: TargetMigrations, monkeypatch: pytest.MonkeyPatch
) -> None:
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(migrate.shutil, "disk_usage", lambda p: usage(1 << 30, 1 << 30, 5 << 20))
    with pytest.raises(RefusedError) as exc:
        target.prepare(prepare_req(estimated_bytes=100 << 20))

    msg = str(exc.value)
    assert "5 MiB free" in msg and "120 MiB" in msg
    assert str(target.staging_root) in msg
    assert "--staging-dir" in msg
    assert staged(target) == []


def test_prepare_refuses_a_name_an_active_job_holds(target: TargetMigrations) -> None:
    target.registry.save(running_record("train"))
    with pytest.raises(AlreadyExistsError, match="'train' already exists here and is running"):
        target.prepare(prepare_req())
    assert staged(target) == []


def test_prepare_allows_the_name_of_a_finished_job(target: TargetMigrations) -> None:
    target.registry.save(running_record("train", JobState.MOVED))
    target.prepare(prepare_req())
    assert state(target) == pb.TARGET_STATE_PREPARED


def test_a_job_arriving_again_is_never_answered_by_its_old_moved_record(
    target: TargetMigrations, fake_criu: FakeCriu, tmp_path: Path
) -> None:
    # train moved away from here once; now it comes back. Once it commits here, and until its
    # restore registers it, `ps` and `logs` must not show the old "moved" record (nor its old
    # logs) as if it were the job. (Before the commit the old record stays: a lease that is
    # aborted must cost it nothing; test_target_core.py.)
    target.registry.save(running_record("train", JobState.MOVED))
    (target.registry.job_dir("train") / "stdout.log").write_text("old output\n")
    delivered(target, tmp_path)
    seen: list[object] = []

    def while_restoring() -> None:
        seen.append([r.name for r in target.registry.list()])
        seen.append((target.registry.job_dir("train") / "stdout.log").read_text())

    fake_criu.during_restore = while_restoring
    target.commit(pb.CommitRequest(migration_id=MID))
    assert seen[0] == []
    assert "old output" not in seen[1]  # the job dir holds the arriving job's logs only
    assert "old output" not in Path(target.registry.get("train").stdout_path).read_text()


def test_a_refused_prepare_keeps_the_old_record(target: TargetMigrations) -> None:
    target.registry.save(running_record("train", JobState.MOVED))
    with pytest.raises(RefusedError):
        target.prepare(prepare_req(cwd="/nonexistent-dir"))
    assert target.registry.get("train").state is JobState.MOVED


def test_prepare_refuses_without_usable_criu(target: TargetMigrations, fake_criu: FakeCriu) -> None:
    fake_criu.usable = False
    with pytest.raises(RefusedError, match="criu not found"):
        target.prepare(prepare_req())
    assert staged(target) == []


def test_prepare_limits_concurrent_incoming_migrations(target: TargetMigrations) -> None:
    target.prepare(prepare_req("m-1", "job1"))
    target.prepare(prepare_req("m-2", "job2"))
    with pytest.raises(RefusedError, match="2 migrations are already coming in"):
        target.prepare(prepare_req("m-3", "job3"))
    assert state(target, "m-3") == pb.TARGET_STATE_UNKNOWN

    target.abort("m-1", "source gave up")
    target.prepare(prepare_req("m-3", "job3"))
    assert state(target, "m-3") == pb.TARGET_STATE_PREPARED


@pytest.mark.parametrize("mid", ["../../etc", "a/b", "x" * 65, "id with spaces"])
def test_prepare_refuses_unsafe_migration_ids(target: TargetMigrations, tmp_path: Path, mid: str) -> None:
    before = {p.name for p in tmp_path.iterdir()}
    with pytest.raises(InvalidArgumentError, match="invalid migration id"):
        target.prepare(prepare_req(mid))
    assert staged(target) == []
    assert {p.name for p in tmp_path.iterdir()} - before <= {target.staging_root.name}


@pytest.mark.parametrize("missing", ["migration_id", "job"])
def test_prepare_needs_an_id_and_a_job(target: TargetMigrations, missing: str) -> None:
    with pytest.raises(InvalidArgumentError, match="needs a migration id, a job name and the source node"):
        target.prepare(prepare_req(**{missing: ""}))


def test_prepare_fault_point(target: TargetMigrations, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_FAULTS", "target-prepare")
    with pytest.raises(InjectedFault):
        target.prepare(prepare_req())
    assert staged(target) == []


# -- push ----------------------------------------------------------------------------


def test_push_of_a_good_image_is_verified(target: TargetMigrations, tmp_path: Path) -> None:
    src = make_image(tmp_path)
    target.prepare(prepare_req())
    chunks = chunks_for(src)
    resp = target.push(iter(chunks))

    assert resp.bytes == sum(len(c.data) for c in chunks)
    assert resp.files == 6  # five files and the manifest
    assert state(target) == pb.TARGET_STATE_VERIFIED
    staging = target.staging_root / f"in-{MID}"
    m = verify(staging)
    assert m.job.name == "train"
    for p in src.iterdir():
        assert (staging / p.name).read_bytes() == p.read_bytes()


def test_push_with_a_corrupted_chunk_is_refused_and_dropped(target: TargetMigrations, tmp_path: Path) -> None:
    target.prepare(prepare_req())
    chunks = chunks_for(make_image(tmp_path))
    i = next(i for i, c in enumerate(chunks) if c.file == "pages-1.img")
    data = bytearray(chunks[i].data)
    data[7] ^= 0x01
    chunks[i] = replace(chunks[i], data=bytes(data))

    with pytest.raises(TransferError, match=r"digest mismatch for 'pages-1\.img'") as exc:
        target.push(iter(chunks))
    assert exc.value.node == "nodeb"
    assert staged(target) == []
    assert state(target) == pb.TARGET_STATE_ABORTED
    with pytest.raises(RefusedError, match="no verified image"):
        target.commit(pb.CommitRequest(migration_id=MID))


def test_push_of_a_file_the_manifest_does_not_describe_is_refused(
    target: TargetMigrations, tmp_path: Path
) -> None:
    """A file replaced in transit together with its chunk digest still fails the manifest."""
    target.prepare(prepare_req())
    chunks = chunks_for(make_image(tmp_path))
    i = next(i for i, c in enumerate(chunks) if c.file == "core-1.img")
    evil = b"X" * len(chunks[i].data)  # same size as listed: only the manifest can tell
    chunks[i] = replace(chunks[i], data=evil, sha256=hashlib.sha256(evil).hexdigest())

    with pytest.raises(TransferError, match="do not match the manifest"):
        target.push(iter(chunks))
    assert staged(target) == []


def test_push_without_the_manifest_is_a_truncated_image(target: TargetMigrations, tmp_path: Path) -> None:
    target.prepare(prepare_req())
    chunks = chunks_for(make_image(tmp_path))
    assert chunks[-1].file == MANIFEST
    with pytest.raises(TransferError, match="truncated"):
        target.push(iter(chunks[:-1]))
    assert staged(target) == []
    assert state(target) == pb.TARGET_STATE_ABORTED


def test_push_cut_in_the_middle_of_a_file(target: TargetMigrations, tmp_path: Path) -> None:
    target.prepare(prepare_req())
    chunks = chunks_for(make_image(tmp_path, pages=3 << 20))  # pages-1.img spans several chunks
    pages = [i for i, c in enumerate(chunks) if c.file == "pages-1.img"]
    assert len(pages) > 1
    with pytest.raises(TransferError):
        target.push(iter(chunks[: pages[0] + 1]))
    assert staged(target) == []


def test_push_with_a_file_missing_its_last_chunk(target: TargetMigrations, tmp_path: Path) -> None:
    target.prepare(prepare_req())
    chunks = chunks_for(make_image(tmp_path, pages=3 << 20))
    last_page = max(i for i, c in enumerate(chunks) if c.file == "pages-1.img")
    with pytest.raises(TransferError, match="ended without its last chunk"):
        target.push(iter(chunks[:last_page] + chunks[last_page + 1 :]))
    assert staged(target) == []


def test_push_of_an_image_of_another_job_is_refused(target: TargetMigrations, tmp_path: Path) -> None:
    target.prepare(prepare_req(job="train"))
    with pytest.raises(ImageError, match="image is of job 'other'"):
        target.push(iter(chunks_for(make_image(tmp_path), job="other")))
    assert staged(target) == []


@pytest.mark.parametrize("kind", ["dotdot", "nested", "hidden", "absolute", "dotdot-only", "empty-later"])
def test_push_refuses_unsafe_file_names_and_writes_nothing_outside_staging(
    target: TargetMigrations, tmp_path: Path, kind: str
) -> None:
    target.prepare(prepare_req())
    tag = uuid.uuid4().hex[:8]
    outside = tmp_path / "outside"
    outside.mkdir()
    name = {
        "dotdot": f"../escaped-{tag}",
        "nested": f"{outside.name}/escaped-{tag}",
        "hidden": f".escaped-{tag}",
        "absolute": str(outside / f"escaped-{tag}"),
        "dotdot-only": "..",
        "empty-later": "",
    }[kind]
    payload = b"#!/bin/sh\nrm -rf /\n"
    good = pb.ImageChunk(
        migration_id=MID, file="core-1.img", data=b"x", last=True, sha256=hashlib.sha256(b"x").hexdigest()
    )
    bad = pb.ImageChunk(file=name, data=payload, last=True, sha256=hashlib.sha256(payload).hexdigest())

    with pytest.raises(TransferError):
        target.push(iter([good, bad]))

    assert staged(target) == []
    assert state(target) == pb.TARGET_STATE_ABORTED
    escaped = [p for p in tmp_path.rglob("*") if f"escaped-{tag}" in p.name]
    assert escaped == []
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "/abs"])
def test_push_refuses_an_unsafe_name_in_the_first_chunk(
    target: TargetMigrations, tmp_path: Path, name: str
) -> None:
    target.prepare(prepare_req())
    files = [pb.ImageFile(name=name, size=4)]
    chunk = pb.ImageChunk(migration_id=MID, file=name, data=b"evil", last=True, files=files)
    with pytest.raises(TransferError, match="unsafe file name"):
        target.push(iter([chunk]))
    assert staged(target) == []
    assert not (tmp_path / "x").exists()
    assert not (tmp_path / "tstaging" / "x").exists()


def test_push_refuses_a_file_sent_twice(target: TargetMigrations) -> None:
    target.prepare(prepare_req())
    sha = hashlib.sha256(b"x").hexdigest()
    files = [pb.ImageFile(name="core-1.img", size=1), pb.ImageFile(name="pages-1.img", size=1)]
    first = pb.ImageChunk(migration_id=MID, file="core-1.img", data=b"x", last=True, sha256=sha, files=files)
    other = pb.ImageChunk(file="pages-1.img", data=b"x", last=True, sha256=sha)
    again = pb.ImageChunk(file="core-1.img", data=b"x", last=True, sha256=sha)
    with pytest.raises(TransferError, match="sent twice"):
        target.push(iter([first, other, again]))
    assert staged(target) == []


def test_push_beyond_the_lease_cap_is_refused(target: TargetMigrations, tmp_path: Path) -> None:
    target.prepare(prepare_req())
    target._get(MID).max_bytes = 64 << 10  # the real floor is 1 GiB; a small cap keeps the test fast
    with pytest.raises(TransferError, match=r"lists \d+ bytes; the lease's cap is 65536"):
        target.push(iter(chunks_for(make_image(tmp_path, pages=200_000))))
    assert staged(target) == []
    assert state(target) == pb.TARGET_STATE_ABORTED


def test_push_for_an_unknown_migration(target: TargetMigrations, tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="no migration 'nope'"):
        target.push(iter(chunks_for(make_image(tmp_path), mid="nope")))
    assert staged(target) == []


def test_push_of_an_empty_stream(target: TargetMigrations) -> None:
    target.prepare(prepare_req())
    with pytest.raises(InvalidArgumentError, match="empty image stream"):
        target.push(iter([]))


def test_push_twice_is_refused(target: TargetMigrations, tmp_path: Path) -> None:
    chunks = delivered(target, tmp_path)
    with pytest.raises(RefusedError, match="is verified, not waiting for an image"):
        target.push(iter(chunks))
    assert state(target) == pb.TARGET_STATE_VERIFIED  # the verified image is kept


def test_push_after_the_lease_expired_is_refused(target: TargetMigrations, tmp_path: Path) -> None:
    target.prepare(prepare_req())
    target._get(MID).expires_at = time.time() - 1
    with pytest.raises(RefusedError, match=r"lease of migration \w+ expired"):
        target.push(iter(chunks_for(make_image(tmp_path))))


def test_push_fault_point_drops_the_image(
    target: TargetMigrations, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target.prepare(prepare_req())
    monkeypatch.setenv("FERRY_FAULTS", "target-transfer")
    with pytest.raises(InjectedFault):
        target.push(iter(chunks_for(make_image(tmp_path))))
    assert staged(target) == []
    assert state(target) == pb.TARGET_STATE_ABORTED


# -- commit, abort, status -----------------------------------------------------------


def test_commit_restores_a_verified_image(
    target: TargetMigrations, fake_criu: FakeCriu, tmp_path: Path
) -> None:
    delivered(target, tmp_path)
    resp = target.commit(pb.CommitRequest(migration_id=MID))

    assert fake_criu.spawned == [resp.pid]
    assert resp.node_name == "nodeb"
    assert [p.phase for p in resp.phases] == ["restore"]
    # The restored job ran (its CPU time grew) right after its release, and the answer came then.
    assert 0 <= resp.resumed_after_s < incoming.RESUME_LOOK_S
    assert resp.resumed_after_s <= resp.answered_after_s < 5
    assert state(target) == pb.TARGET_STATE_RUNNING
    assert staged(target) == []

    restore = fake_criu.restores[0]
    assert MANIFEST in restore["files"] and "pages-1.img" in restore["files"]
    # The job's fds to its logs (keyed by the source's paths) are re-pointed to our files.
    assert restore["keys"] == [SRC_OUT.lstrip("/"), SRC_ERR.lstrip("/")]
    assert restore["shell_job"] is False

    rec = target.registry.get("train")
    assert rec.state is JobState.RUNNING
    assert rec.pid == resp.pid
    assert rec.kind is JobKind.LAUNCHED
    assert rec.migrations == 1
    assert rec.command == ["python", "train.py"]
    assert "nodea" in rec.note
    job_dir = target.registry.job_dir("train")
    assert rec.stdout_path == str(job_dir / "stdout.log")
    out = Path(rec.stdout_path)
    assert out.read_text().startswith("step 1 loss 0.9\nstep 2 loss 0.8\n")  # the source's output came along
    wait_for(lambda: out.read_text().endswith("restored\n"), what="the restored job's output")  # it appends


def test_abort_of_a_running_migration_is_refused(
    target: TargetMigrations, fake_criu: FakeCriu, tmp_path: Path
) -> None:
    delivered(target, tmp_path)
    resp = target.commit(pb.CommitRequest(migration_id=MID))
    with pytest.raises(RefusedError, match="cannot be aborted"):
        target.abort(MID, "source changed its mind")
    assert state(target) == pb.TARGET_STATE_RUNNING
    assert not is_dead(resp.pid)
    assert target.registry.get("train").state is JobState.RUNNING


def test_commit_without_a_verified_image_is_refused(target: TargetMigrations, fake_criu: FakeCriu) -> None:
    target.prepare(prepare_req())
    with pytest.raises(RefusedError, match="no verified image"):
        target.commit(pb.CommitRequest(migration_id=MID))
    assert fake_criu.restores == []
    assert state(target) == pb.TARGET_STATE_PREPARED


def test_commit_of_an_unknown_migration(target: TargetMigrations) -> None:
    with pytest.raises(NotFoundError, match="no migration 'nope'"):
        target.commit(pb.CommitRequest(migration_id="nope"))


def test_commit_twice_restores_once(target: TargetMigrations, fake_criu: FakeCriu, tmp_path: Path) -> None:
    delivered(target, tmp_path)
    target.commit(pb.CommitRequest(migration_id=MID))
    with pytest.raises(RefusedError):
        target.commit(pb.CommitRequest(migration_id=MID))
    assert len(fake_criu.restores) == 1


def test_failed_restore_drops_the_migration(
    target: TargetMigrations, fake_criu: FakeCriu, tmp_path: Path
) -> None:
    delivered(target, tmp_path)
    fake_criu.restore_error = CriuError("restore", "pid 1 is busy", log_path="/x/criu-restore.log")
    with pytest.raises(CriuError, match=r"criu-restore\.log"):
        target.commit(pb.CommitRequest(migration_id=MID))

    assert state(target) == pb.TARGET_STATE_ABORTED
    assert staged(target) == []
    assert all(r.state is not JobState.RUNNING for r in target.registry.list())
    with pytest.raises(RefusedError):
        target.commit(pb.CommitRequest(migration_id=MID))


def test_restore_fault_point(
    target: TargetMigrations, fake_criu: FakeCriu, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    delivered(target, tmp_path)
    monkeypatch.setenv("FERRY_FAULTS", "target-restore")
    with pytest.raises(InjectedFault):
        target.commit(pb.CommitRequest(migration_id=MID))
    assert fake_criu.restores == []
    assert state(target) == pb.TARGET_STATE_ABORTED


def test_abort_of_a_prepared_migration_drops_it(target: TargetMigrations) -> None:
    target.prepare(prepare_req())
    target.abort(MID, "source dump failed")
    assert state(target) == pb.TARGET_STATE_ABORTED
    assert staged(target) == []


def test_abort_of_a_verified_migration_drops_the_image(target: TargetMigrations, tmp_path: Path) -> None:
    delivered(target, tmp_path)
    target.abort(MID, "source gave up")
    assert staged(target) == []
    with pytest.raises(RefusedError):
        target.commit(pb.CommitRequest(migration_id=MID))


def test_abort_of_an_unknown_migration_fences_its_id(target: TargetMigrations) -> None:
    target.abort("nope", "why not")
    assert target.status("nope") == pb.TARGET_STATE_ABORTED
    with pytest.raises(RefusedError, match="never reused"):
        target.prepare(prepare_req("nope"))


def test_status_of_an_unknown_migration(target: TargetMigrations) -> None:
    assert target.status("never-heard-of-it") == pb.TARGET_STATE_UNKNOWN


# -- known bugs (see the report; strict, so a fix turns these into failures to remove) ---


def test_prepare_twice_with_the_same_id_is_refused(target: TargetMigrations) -> None:
    target.prepare(prepare_req())
    with pytest.raises(RefusedError, match="already known"):
        target.prepare(prepare_req())
    assert state(target) == pb.TARGET_STATE_PREPARED


def test_expired_leases_do_not_block_new_migrations(target: TargetMigrations) -> None:
    target.prepare(prepare_req("m-1", "job1"))
    target.prepare(prepare_req("m-2", "job2"))
    for mid in ("m-1", "m-2"):
        target._get(mid).expires_at = time.time() - 1
    target.prepare(prepare_req("m-3", "job3"))
    assert state(target, "m-3") == pb.TARGET_STATE_PREPARED


def test_abort_while_restoring_is_refused(
    target: TargetMigrations, fake_criu: FakeCriu, tmp_path: Path
) -> None:
    delivered(target, tmp_path)
    seen: list[BaseException | None] = []

    def concurrent_abort() -> None:
        assert state(target) == pb.TARGET_STATE_RESTORING
        try:
            target.abort(MID, "source timed out")
            seen.append(None)
        except FerryError as e:
            seen.append(e)

    fake_criu.during_restore = concurrent_abort
    target.commit(pb.CommitRequest(migration_id=MID))
    assert isinstance(seen[0], RefusedError)


# -- the target ----------------------------------------------------------------------------------


def test_the_target_refuses_post_copy_without_userfaultfd(
    target: TargetMigrations, fake_criu: FakeCriu
) -> None:
    fake_criu.features.clear()
    with pytest.raises(RefusedError, match="userfaultfd"):
        target.prepare(prepare_req(lazy=True))
    assert staged(target) == []
    assert state(target) == pb.TARGET_STATE_UNKNOWN


def test_the_target_grants_post_copy_where_it_can(target: TargetMigrations) -> None:
    lease = target.prepare(prepare_req(lazy=True))
    assert lease.lazy and lease.page_stream
    assert not target.prepare(prepare_req("m-2", "other")).lazy  # only when asked


def test_a_post_copy_lease_without_its_page_stream_is_not_restored(target: TargetMigrations) -> None:
    target.prepare(prepare_req(lazy=True))
    inc = target._incoming[MID]
    inc.state, inc.manifest = TargetState.VERIFIED, object()  # type: ignore[assignment]
    with pytest.raises(RefusedError, match="no page stream"):
        target.commit(pb.CommitRequest(migration_id=MID))


def broken_stream(mid: str, before_break: Callable[[], None] = lambda: None) -> Iterator[pb.PageData]:
    yield pb.PageData(migration_id=mid)
    before_break()
    raise ConnectionResetError("the source's link went down")


def test_memory_that_stops_coming_kills_the_running_copy_first(target: TargetMigrations, sleeper) -> None:
    """Pages that never arrive would read as zeros: the job must not run on past that."""
    target.prepare(prepare_req(lazy=True))
    proc, _, _ = sleeper()
    rec = JobRecord(
        name="train", kind=JobKind.LAUNCHED, state=JobState.RUNNING, pid=proc.pid, command=["x"], cwd="/"
    )
    rec.pid_started = procs.create_time(proc.pid)
    target.registry.save(rec)

    def restored_and_released() -> None:  # what a commit does while the stream waits
        target._incoming[MID].state = TargetState.POSTCOPY

    with pytest.raises(FerryError, match="broke off"):
        list(target.stream_pages(broken_stream(MID, restored_and_released)))

    proc.wait(10)
    assert proc.returncode == -signal.SIGKILL and is_dead(proc.pid)
    job = target.registry.get("train")
    assert job.state is JobState.LOST and "post-copy from nodea failed" in job.note
    assert state(target) == pb.TARGET_STATE_ABORTED  # the source may resume its frozen copy
    assert staged(target) == []


def test_memory_that_stops_coming_after_the_job_ended_still_drops_the_migration(
    target: TargetMigrations, sleeper
) -> None:
    """The job ended here before the pages stopped (it read a missing page and crashed, say): that
    end was the move's failure, so its record says lost (its note how it ended), and the
    migration still ends ABORTED so the source resumes."""
    target.prepare(prepare_req(lazy=True))
    proc, _, _ = sleeper()
    rec = JobRecord(
        name="train", kind=JobKind.LAUNCHED, state=JobState.RUNNING, pid=proc.pid, command=["x"], cwd="/"
    )
    target.registry.save(rec)
    proc.kill()
    proc.wait(10)
    target.registry.update("train", state=JobState.EXITED, note="exited with status -9")

    def restored_and_released() -> None:
        target._incoming[MID].state = TargetState.POSTCOPY

    with pytest.raises(FerryError, match="broke off"):
        list(target.stream_pages(broken_stream(MID, restored_and_released)))
    job = target.registry.get("train")
    assert job.state is JobState.LOST and "crashed on a page that never came" in job.note, job
    assert state(target) == pb.TARGET_STATE_ABORTED
    assert target.ledger.promised() == set()


def test_an_abort_racing_the_push_is_a_transfer_failure_not_an_internal_error(
    target: TargetMigrations,
) -> None:
    """The source aborts while its push is still coming in (its own failure elsewhere): the push
    ends as a refused or failed transfer, never as "a bug in ferry"."""
    target.prepare(prepare_req())

    def chunks() -> Iterator[pb.ImageChunk]:
        yield pb.ImageChunk(migration_id=MID, file="core-1.img", data=b"x" * 10)
        target.abort(MID, "the source gave up")  # drops it: staging goes
        yield pb.ImageChunk(migration_id=MID, file="core-1.img", data=b"y" * 10, last=True)

    with pytest.raises(FerryError) as err:
        target.push(chunks())
    assert err.value.kind != "internal", err.value
    assert state(target) == pb.TARGET_STATE_ABORTED


def test_a_stream_broken_before_the_restore_drops_the_lease(target: TargetMigrations) -> None:
    target.prepare(prepare_req(lazy=True))
    with pytest.raises(FerryError, match="broke off"):
        list(target.stream_pages(broken_stream(MID)))
    assert state(target) == pb.TARGET_STATE_ABORTED
    assert staged(target) == []


def test_no_space_names_the_staging_area_even_once_it_was_dropped(tmp_path: Path) -> None:
    from agent.migration.staging import no_space

    gone = tmp_path / "staging" / "in-m1"  # dropped with the migration before the error is told
    e = no_space(gone, "nodeb")
    assert f"no space left in the staging area {gone} (" in str(e) and "--staging-dir" in str(e)


def test_a_push_into_a_full_staging_area_says_no_space(
    target: TargetMigrations, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent.migration import transfer

    target.prepare(prepare_req())
    chunks = chunks_for(make_image(tmp_path))

    def full(self, chunk) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transfer.Intake, "feed", full)
    with pytest.raises(TransferError, match=r"no space left in the staging area .*in-") as exc:
        target.push(iter(chunks))
    assert exc.value.node == "nodeb" and "--staging-dir" in str(exc.value)
    assert staged(target) == []
    assert state(target) == pb.TARGET_STATE_ABORTED


def test_a_job_whose_post_copy_still_brings_its_pages_is_said_arriving_until_they_are_all_in(
    target: TargetMigrations,
) -> None:
    """A snapshot round asks (agent.service.node): a dump of the job before every page came
    would save the ones that had not as zeros, and its restore would crash."""
    target.prepare(prepare_req(lazy=True))
    job = target._incoming[MID].job
    for state_ in (TargetState.RESTORING, TargetState.POSTCOPY):
        target._incoming[MID].state = state_
        assert f"is {state_.value}" in target.arriving(job) and MID in target.arriving(job)
    target._incoming[MID].state = TargetState.RUNNING
    assert target.arriving(job) == ""
    assert target.arriving("another-job") == ""

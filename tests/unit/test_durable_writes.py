"""Writes that must be on disk as the code believes: the image intake and the migration journal
write every byte even when os.write writes fewer, and job records are replaced atomically and
fsynced (file and directory), as the journal's are (agent.durable)."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from agent.gpus.quarantine import Quarantine
from agent.jobs.record import JobKind, JobRecord, JobState
from agent.jobs.registry import JobRegistry
from agent.migration.journal import TARGET, Journal, MigrationRecord
from agent.migration.transfer import Intake
from agent.rpc import pb

#: os.write may write fewer bytes than asked (a signal, quota, a pipe): these tests allow 7 a call.
SHORT = 7


@pytest.fixture
def short_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """os.write writes at most SHORT bytes a call and says so; returns the sizes it was asked for."""
    real = os.write
    asked: list[int] = []

    def short(fd: int, data: bytes | memoryview) -> int:
        asked.append(len(data))
        return real(fd, bytes(data[:SHORT]))

    monkeypatch.setattr(os, "write", short)
    return asked


def test_the_intake_writes_every_byte_its_digest_covers(tmp_path: Path, short_writes: list[int]) -> None:
    data = bytes(range(256)) * 4
    digest = hashlib.sha256(data).hexdigest()
    intake = Intake(tmp_path, max_bytes=1 << 20)
    intake.feed(
        pb.ImageChunk(
            migration_id="m1",
            file="pages-1.img",
            data=data[:500],
            files=[pb.ImageFile(name="pages-1.img", size=len(data))],
        )
    )
    intake.feed(pb.ImageChunk(file="pages-1.img", data=data[500:], last=True, sha256=digest))
    assert (tmp_path / "pages-1.img").read_bytes() == data
    assert intake.received["pages-1.img"].sha256 == digest
    assert max(short_writes) > SHORT  # the writes were indeed cut short


def test_a_journal_record_is_whole_after_short_writes(tmp_path: Path, short_writes: list[int]) -> None:
    journal = Journal(tmp_path)
    journal.save(MigrationRecord("m1", TARGET, "train", "restoring", peer="nodea", note="x" * 300))
    got = journal.get(TARGET, "m1")  # a torn record would raise here: "unreadable"
    assert got is not None and (got.state, got.note) == ("restoring", "x" * 300)


def durable_steps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Every fsync (of a file or a directory) and rename, in order, from now on."""
    steps: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        steps.append(("fsync", "dir" if stat.S_ISDIR(st.st_mode) else f"file of {st.st_size} bytes"))
        real_fsync(fd)

    def replace(src: str | Path, dst: str | Path) -> None:
        steps.append(("replace", f"{Path(src).name} -> {Path(dst).name}"))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return steps


def test_a_job_record_is_fsynced_and_renamed_into_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `Journal.save` does: the data on disk before the rename makes it visible, and the
    rename on disk (the directory fsynced) before save returns."""
    reg = JobRegistry(tmp_path / "state", "nodea")
    steps = durable_steps(monkeypatch)
    rec = JobRecord("train", JobKind.ADOPTED, JobState.EXITED, 1, ["x"], "/")
    reg.save(rec)
    size = (tmp_path / "state" / "jobs" / "train" / "job.json").stat().st_size
    assert steps == [
        ("fsync", f"file of {size} bytes"),
        ("replace", "job.json.tmp -> job.json"),
        ("fsync", "dir"),
    ]
    # It holds the job's command and environment: the agent's alone, as the journal's records are.
    assert stat.S_IMODE((tmp_path / "state" / "jobs" / "train" / "job.json").stat().st_mode) == 0o600


def test_a_quarantine_outlives_a_power_loss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad GPU quarantined must stay so after the node loses power: the file is fsynced and
    renamed into place, the directory fsynced, before `add` returns."""
    q = Quarantine(tmp_path)
    steps = durable_steps(monkeypatch)
    q.add("GPU-1", "Xid 79")
    assert [kind for kind, _ in steps] == ["fsync", "replace", "fsync"] and steps[-1] == ("fsync", "dir")

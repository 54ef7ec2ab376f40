"""Which CRIU line is quoted as the cause, and where CRIU's logs are kept."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from agent.criu.logs import CriuLogs, cause

DUMP_LOG = """\
(00.000011) Version: 4.2.1 (gitid 0)
(00.000190) Error (criu/crtools.c:1011): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted
Error (criu/util.c:642): execvp("iptables-save", ...) failed: No such file or directory
(00.119214) Error (criu/util.c:1723): iptables-save -V failed
Error: ipv4: Address already assigned.
(00.010000) Dumping processes (pid: 4242 comm: python)
(00.231000) Error (criu/files-ext.c:96): Can't dump file 11 of that type [0] (unknown anon_inode:[io_uring])
(00.231010) Error (criu/cr-dump.c:1656): Dump files (pid: 4242) failed with -1
(00.231500) Error (criu/cr-dump.c:2111): Dumping FAILED.
"""


def test_the_first_real_error_is_the_cause(tmp_path: Path) -> None:
    log = tmp_path / "criu-dump.log"
    log.write_text(DUMP_LOG)
    rpc = "rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted"
    assert cause(log, rpc) == (
        "Error (criu/files-ext.c:96): Can't dump file 11 of that type [0] (unknown anon_inode:[io_uring])"
    )


def test_a_harmless_rpc_message_is_never_the_cause(tmp_path: Path) -> None:
    log = tmp_path / "criu-dump.log"
    log.write_text(DUMP_LOG.splitlines(keepends=True)[1])
    assert cause(log, "rlimit: Can't setup RLIMIT_NOFILE for self") == ""
    assert cause(tmp_path / "missing.log", "Can't dump ghost file") == "Can't dump ghost file"


def test_only_summaries_quote_the_last_one(tmp_path: Path) -> None:
    log = tmp_path / "criu-restore.log"
    log.write_text("(00.1) Error (criu/cr-restore.c:2447): Restoring FAILED.\n")
    assert cause(log) == "Error (criu/cr-restore.c:2447): Restoring FAILED."


def test_logs_live_per_migration_and_are_dropped_on_success(tmp_path: Path) -> None:
    logs = CriuLogs(tmp_path)
    d = logs.dir_for("abc123")
    (d / "criu-dump.log").write_text("x")
    assert d == tmp_path / "criu-logs" / "abc123" and oct(d.stat().st_mode & 0o777) == "0o700"
    assert logs.dir_for("abc123") == d  # the same migration, the same place
    logs.done("abc123")
    assert not d.exists()


def test_failed_ones_are_kept_up_to_the_bound(tmp_path: Path) -> None:
    logs = CriuLogs(tmp_path, keep=3)
    now = time.time()
    for i in range(5):
        d = logs.dir_for(f"m{i}")
        os.utime(d, (now - 100 + i, now - 100 + i))
    assert sorted(p.name for p in (tmp_path / "criu-logs").iterdir()) == ["m2", "m3", "m4"]


@pytest.mark.parametrize("bad", ["", "../x", "a/b", ".hidden"])
def test_a_key_cannot_leave_the_directory(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError):
        CriuLogs(tmp_path).dir_for(bad)

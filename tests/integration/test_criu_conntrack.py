"""ferry's CRIU does not ask a job's netns that tracks no connection for its conntrack table
(native/criu/netns-conntrack.patch): each ask walked every bucket of the host's table, twice per
dump, while the job stood frozen. Every move and round restores such images (the other
integration tests); this one reads CRIU's own log of the dump."""

from __future__ import annotations

import sys
from pathlib import Path

from agent.criu.runner import Criu
from agent.jobs import procs
from tests.integration.jobtools import IDLE_LOOP, unshared


def test_a_netns_that_tracks_nothing_is_dumped_without_asking_for_its_conntrack_table(tmp_path: Path) -> None:
    with unshared(["--net"], [sys.executable, "-c", IDLE_LOOP]) as pid:
        images, logs = tmp_path / "img", tmp_path / "logs"
        images.mkdir()
        logs.mkdir()
        Criu().dump(
            pid,
            images,
            leave_running=True,
            leave_stopped=False,
            shell_job=True,
            log_dir=logs,
            log_level=4,
        )
        log = (logs / "criu-dump.log").read_text()
        assert "Dump NET namespace info" in log, "the job's own netns was not dumped"
        skipped = log.count("No tracked connection in this netns: nothing to dump")
        assert skipped == 2, f"its conntrack table was asked for {2 - skipped} time(s)"
        assert procs.alive(pid), "the dump left it running"

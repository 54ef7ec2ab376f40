"""ferry's CRIU does not ask a job's netns that tracks no connection for its conntrack table
(native/criu/netns-conntrack.patch): each ask walked every bucket of the host's table, twice per
dump, while the job stood frozen. Every move and round restores such images (the other
integration tests); this one reads CRIU's own log of the dump."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil

from agent.criu.runner import Criu
from agent.jobs import procs

LOOP = "import time\nwhile True: time.sleep(0.05)"


def test_a_netns_that_tracks_nothing_is_dumped_without_asking_for_its_conntrack_table(tmp_path: Path) -> None:
    # A session of its own, as every job ferry runs has: the runner's session leader may lie
    # outside this pid namespace (a container's), which CRIU refuses.
    ns = subprocess.Popen(
        ["unshare", "--net", "--fork", "--kill-child", sys.executable, "-c", LOOP], start_new_session=True
    )
    try:
        end = time.monotonic() + 10
        while not (kids := [c.pid for c in psutil.Process(ns.pid).children()]) and time.monotonic() < end:
            time.sleep(0.05)
        assert kids, "unshare started no child"
        images, logs = tmp_path / "img", tmp_path / "logs"
        images.mkdir()
        logs.mkdir()
        Criu().dump(
            kids[0],
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
        assert procs.alive(kids[0]), "the dump left it running"
    finally:
        ns.kill()
        ns.wait(10)

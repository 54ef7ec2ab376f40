"""The page stream against real CRIU: a dump whose memory goes through both relays into a
real `criu page-server`, then a restore from what the target side wrote.

The agents' gRPC link is left out (the call is the target relay in this process);
every other part is real. Migrations between real agents take this path by default
(tests/integration/test_migrate.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from agent import procs
from agent.criu import Criu
from agent.errors import CriuError, FerryError
from agent.image import PAGES_PREFIX
from agent.pagestream import SourceRelay, TargetRelay
from agent.rpc import pb

WORKLOAD = Path(__file__).resolve().parents[2] / "scripts" / "workloads" / "train_sized.py"


class InProcessCall:
    """A StreamPages call served by a TargetRelay in this process."""

    def __init__(self, relay: TargetRelay, requests: Iterable[pb.PageData]) -> None:
        self.relay = relay
        self.requests = iter(requests)
        assert next(self.requests).migration_id == "m1"

    def __iter__(self) -> Iterator[pb.PageData]:
        got = yield from self.relay.run(self.requests)
        yield pb.PageData(end=pb.PageStreamEnd(bytes=got.bytes, check=got.check))

    def cancel(self) -> None:
        self.relay.kill()


def start_job(tmp_path: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        job = subprocess.Popen(
            [sys.executable, str(WORKLOAD), "--gib", "0.05", "--width", "512"],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=tmp_path,
        )
    deadline = time.monotonic() + 60
    while b"step 2 " not in log.read_bytes():
        assert time.monotonic() < deadline and job.poll() is None, log.read_text()
        time.sleep(0.1)
    return job


def steps(log: Path) -> list[int]:
    return [int(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("step ")]


def test_memory_streamed_through_both_relays_restores_and_runs_on(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    log = tmp_path / "job.log"
    job = start_job(tmp_path, log)
    criu = Criu()
    target = TargetRelay(criu, dst, 1 << 34, "target")
    relay = SourceRelay(lambda reqs: InProcessCall(target, reqs), "m1", "source")
    restored = 0
    try:
        criu.dump(job.pid, src, leave_stopped=False, page_server_fd=relay.criu_fd)
        sent = relay.finish(60)
        job.wait(30)  # dumped and killed: reaped, so its pid is free for the restore
        before = steps(log)

        # The memory is on the target side only, and all of it arrived.
        assert not any(p.name.startswith(PAGES_PREFIX) for p in src.iterdir())
        pages = [p for p in dst.iterdir() if p.name.startswith(PAGES_PREFIX)]
        assert pages and sum(p.stat().st_size for p in pages) > 40 << 20
        assert sent.bytes >= sum(p.stat().st_size for p in pages)

        for p in src.iterdir():
            if not (dst / p.name).exists():
                (dst / p.name).write_bytes(p.read_bytes())
        restored = criu.restore(dst).pid
        deadline = time.monotonic() + 60
        while len(steps(log)) < len(before) + 3:
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        after = steps(log)
        assert after[: len(before)] == before
        assert after[len(before) :] == list(range(before[-1] + 1, after[-1] + 1))  # picked up where it was
    finally:
        for pid in (job.pid, restored):
            if pid and procs.alive(pid):
                procs.signal_all(procs.tree_pids(pid), signal.SIGKILL)
        if restored:
            os.waitpid(restored, 0)


def test_a_stream_cut_during_the_dump_fails_it_and_the_job_runs_on(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    log = tmp_path / "job.log"
    job = start_job(tmp_path, log)
    criu = Criu()
    target = TargetRelay(criu, dst, 1 << 20, "target")  # far too small: the target cuts it off
    relay = SourceRelay(lambda reqs: InProcessCall(target, reqs), "m1", "source")
    try:
        with pytest.raises(CriuError):
            criu.dump(job.pid, src, leave_stopped=False, page_server_fd=relay.criu_fd)
        with pytest.raises(FerryError, match="cap"):
            relay.finish(60)
        # CRIU gave up and left the job running, as a failed dump must.
        n = len(steps(log))
        deadline = time.monotonic() + 30
        while len(steps(log)) <= n:
            assert time.monotonic() < deadline and job.poll() is None
            time.sleep(0.1)
    finally:
        job.kill()
        job.wait()

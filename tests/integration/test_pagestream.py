"""The page stream against real CRIU: a dump whose memory goes over CRIU's own TLS, each end
trusting only the other's one-time certificate, into a real `criu page-server`, then a restore
from what the target side wrote.

The agents' gRPC link is left out (the control call is the target's side in this process);
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
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.criu.runner import Criu
from agent.errors import CriuError, FerryError
from agent.image import PAGES_PREFIX
from agent.jobs import procs
from agent.migration.datatls import DataIdentity, DataTls
from agent.migration.pagestream import SourcePages, TargetPages, sent_bytes
from agent.rpc import pb

WORKLOAD = Path(__file__).resolve().parents[2] / "scripts" / "workloads" / "train_sized.py"


class InProcessCall:
    """A StreamPages call served by a TargetPages in this process."""

    def __init__(self, pages: TargetPages, requests: Iterable[pb.PageData]) -> None:
        self.pages = pages
        self.requests = iter(requests)
        assert next(self.requests).migration_id == "m1"

    def __iter__(self) -> Iterator[pb.PageData]:
        got = yield from self.pages.run(self.requests)
        yield pb.PageData(end=pb.PageStreamEnd(bytes=got.bytes, check=got.check))

    def cancel(self) -> None:
        self.pages.kill()


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


@dataclass
class Move:
    """A running job, a criu, and the source's control of a page stream whose target side's
    page server writes into `dst`; `dump()` sends the job's memory there over TLS."""

    src: Path
    dst: Path
    log: Path
    job: subprocess.Popen[bytes]
    criu: Criu
    pages: SourcePages
    tls: DataTls
    target_cert: bytes

    def dump(self, tls: DataTls | None = None) -> int:
        """The dump (the job keeps running); returns the page bytes it says it sent."""
        server = self.pages.target_address("127.0.0.1")
        files = (tls or self.tls).files
        done = self.criu.dump(self.job.pid, self.src, leave_stopped=False, page_server=server, tls=files)
        return sent_bytes(done.stats)


def move(tmp_path: Path, cap: int) -> Move:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    log = tmp_path / "job.log"
    job = start_job(tmp_path, log)
    criu = Criu()
    source, target = DataIdentity.new("source m1"), DataIdentity.new("target m1")
    theirs = DataTls(target, source.cert_pem, tmp_path)
    pages = TargetPages(criu, dst, cap, "target", theirs.files, "127.0.0.1")
    ours = SourcePages(lambda reqs: InProcessCall(pages, reqs), "m1", "source")
    return Move(src, dst, log, job, criu, ours, DataTls(source, target.cert_pem, tmp_path), target.cert_pem)


def wait_for_steps(log: Path, more_than: int, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while len(done := steps(log)) <= more_than:
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.1)
    return done


def test_memory_streamed_through_both_relays_restores_and_runs_on(tmp_path: Path) -> None:
    m = move(tmp_path, 1 << 34)
    restored = 0
    try:
        sent = m.pages.finish(m.dump(), 60)
        m.job.wait(30)  # dumped and killed: reaped, so its pid is free for the restore
        before = steps(m.log)

        # The memory is on the target side only, and all of it arrived.
        assert not any(p.name.startswith(PAGES_PREFIX) for p in m.src.iterdir())
        pages = [p for p in m.dst.iterdir() if p.name.startswith(PAGES_PREFIX)]
        assert pages and sum(p.stat().st_size for p in pages) > 40 << 20
        assert sent.bytes == sum(p.stat().st_size for p in pages)

        for p in m.src.iterdir():
            if not (m.dst / p.name).exists():
                (m.dst / p.name).write_bytes(p.read_bytes())
        restored = m.criu.restore(m.dst).pid
        after = wait_for_steps(m.log, len(before) + 2, 60)
        assert after[: len(before)] == before
        assert after[len(before) :] == list(range(before[-1] + 1, after[-1] + 1))  # picked up where it was
    finally:
        for pid in (m.job.pid, restored):
            if pid and procs.alive(pid):
                procs.signal_all(procs.tree_pids(pid), signal.SIGKILL)
        if restored:
            os.waitpid(restored, 0)


def test_a_stream_cut_during_the_dump_fails_it_and_the_job_runs_on(tmp_path: Path) -> None:
    m = move(tmp_path, 1 << 20)  # far too small: the target cuts the stream off
    try:
        with pytest.raises(CriuError):
            m.dump()
        with pytest.raises(FerryError, match="cap"):
            m.pages.finish(0, 60)
        # CRIU gave up and left the job running, as a failed dump must.
        wait_for_steps(m.log, len(steps(m.log)), 30)
        assert m.job.poll() is None
    finally:
        m.job.kill()
        m.job.wait()


def test_a_dump_holding_another_key_is_refused_by_the_page_server(tmp_path: Path) -> None:
    """Only the holder of the lease's other one-time key may connect: a stranger's certificate
    (a node of the cluster, say) fails CRIU's TLS handshake, and the job runs on."""
    m = move(tmp_path, 1 << 34)
    stranger = DataTls(DataIdentity.new("stranger"), m.target_cert, tmp_path)
    try:
        with pytest.raises(CriuError):
            m.dump(stranger)
        with pytest.raises(FerryError):
            m.pages.finish(0, 60)
        assert not any(p.name.startswith(PAGES_PREFIX) for p in m.dst.iterdir())
        wait_for_steps(m.log, len(steps(m.log)), 30)
        assert m.job.poll() is None
    finally:
        stranger.close()
        m.job.kill()
        m.job.wait()

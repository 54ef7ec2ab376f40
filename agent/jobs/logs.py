"""Reading a job's agent-owned logs, once or following them while the job runs."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import BinaryIO

from agent.errors import InvalidArgumentError, NotFoundError
from agent.jobs.record import JobRecord

STDOUT, STDERR = "stdout", "stderr"
CHUNK = 1 << 16
#: How often a follower looks for new output while the job runs.
POLL_S = 0.1


def read_logs(
    rec: JobRecord,
    streams: list[str],
    follow: bool,
    active: Callable[[], bool],
    alive: Callable[[], bool],
) -> Iterator[tuple[str, bytes]]:
    """(stream, data) in the order written per stream. Following ends once `active()` (the job
    still runs) is false and what it wrote last is drained, or once `alive()` (the caller) is."""
    paths = [(STDOUT, rec.stdout_path), (STDERR, rec.stderr_path)]
    chosen = [(k, p) for k, p in paths if k in streams and p]
    if not chosen:
        raise InvalidArgumentError(f"job {rec.name!r} has no log files this agent can read")
    files: list[tuple[str, BinaryIO]] = []
    try:
        for kind, path in chosen:
            files.append((kind, open(path, "rb")))  # noqa: SIM115 - closed below
    except FileNotFoundError as e:
        for _, f in files:
            f.close()
        raise NotFoundError(f"job {rec.name!r}: its log {e.filename} is gone from this node") from e
    try:
        ended = not follow
        while alive():
            sent = False
            for kind, f in files:
                if data := f.read(CHUNK):
                    sent = True
                    yield kind, data
            if sent:
                continue
            if ended:
                return
            # One more pass after the job ends drains what it wrote last.
            ended = not active()
            if not ended:
                time.sleep(POLL_S)
    finally:
        for _, f in files:
            f.close()

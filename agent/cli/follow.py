"""Following a job's output wherever it runs: `ferry logs --follow` and `ferry run --attach`.

An agent ends a follow stream when the job no longer runs there. If it moved, the next agent's
copy of the logs starts with everything already printed (the image carries them), so the
follower skips what it has shown, per stream, and goes on there.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from agent.cli.calls import at, call, stream
from agent.errors import FerryError

#: How many moves one follower goes after (a loop of moves is a bug somewhere, not progress).
MAX_HOPS = 1000


@dataclass
class Followed:
    """Where the job was last seen, and what of its output has been printed."""

    agent: str
    job: Any = None
    #: Bytes printed, per stream, over every agent followed.
    printed: dict[int, int] = field(default_factory=dict)
    #: Bytes read from the current agent, per stream.
    read: dict[int, int] = field(default_factory=dict)


def find_job(args: argparse.Namespace, name: str) -> Any:
    from agent.errors import NotFoundError
    from agent.rpc import pb

    for j in call(args, "ListJobs", pb.ListJobsRequest(), 10).jobs:
        if j.name == name:
            return j
    raise NotFoundError(f"no job named {name!r} on {args.agent}", hint="see `ferry ps`")


def _print_new(f: Followed, chunk: Any) -> None:
    """Write the part of a chunk past what was printed from its stream."""
    from agent.rpc import pb

    seen = f.printed.get(chunk.stream, 0)
    start = f.read.get(chunk.stream, 0)
    end = f.read[chunk.stream] = start + len(chunk.data)
    if end <= seen:
        return
    data = chunk.data[max(0, seen - start) :]
    out = sys.stdout if chunk.stream == pb.LOG_STREAM_STDOUT else sys.stderr
    out.buffer.write(data)
    out.flush()
    f.printed[chunk.stream] = seen + len(data)


def follow(
    args: argparse.Namespace, name: str, after_moves: bool = True, into: Followed | None = None
) -> Followed:
    """Print the job's output until it ends; after a move, say where it went and (after_moves)
    follow it there. Returns (in `into`, if given) where it was last seen, with its final record."""
    from agent.rpc import pb

    f = into or Followed(agent=args.agent)
    for _ in range(MAX_HOPS):
        here = at(args, f.agent)
        f.read.clear()  # an agent's copy of the logs is read from its start
        for chunk in stream(here, "Logs", pb.LogsRequest(name=name, follow=True), None):
            _print_new(f, chunk)
        f.job = find_job(here, name)
        if f.job.state != pb.JOB_STATE_MOVED or not f.job.moved_to:
            return f
        where = f"{f.job.moved_to_node or 'another node'} ({f.job.moved_to})"
        if not after_moves:
            print(
                f"ferry: job {name} moved to {where}; follow it there: "
                f"ferry logs {name} --follow --agent {f.job.moved_to}",
                file=sys.stderr,
            )
            return f
        print(f"ferry: job {name} moved to {where}; following it there", file=sys.stderr, flush=True)
        try:
            find_job(at(args, f.job.moved_to), name)
        except FerryError as e:
            e.hint = e.hint or f"follow it there: ferry logs {name} --follow --agent {f.job.moved_to}"
            raise
        f.agent = f.job.moved_to
    raise FerryError(f"job {name} moved {MAX_HOPS} times while followed; stopped following")


def exit_status(job: Any) -> tuple[int, str]:
    """The exit status `ferry run --attach` ends with for the job's final record, and why."""
    from agent.rpc import pb

    if job.state == pb.JOB_STATE_EXITED and job.has_exit_code:
        code = job.exit_code
        # A job killed by signal N ends like a shell's child: 128 + N.
        return (128 - code if code < 0 else code), ""
    state = pb.JobState.Name(job.state).removeprefix("JOB_STATE_").lower()
    why = f"job {job.name} is {state} on {job.node_name}" + (f": {job.note}" if job.note else "")
    if job.state == pb.JOB_STATE_STOPPED:
        return 128 + signal.SIGTERM, why
    return 1, why


class StopOnSignal:
    """While attached, SIGTERM or SIGINT (a scheduler cancelling the step, Ctrl-C) stops the job
    wherever it runs now; the follower then prints its last output and exits with its status."""

    def __init__(self, args: argparse.Namespace, name: str, followed: Followed) -> None:
        self.args, self.name, self.followed = args, name, followed
        self.old: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.old[sig] = signal.signal(sig, self._stop)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.old.items():
            signal.signal(sig, handler)

    def _stop(self, signum: int, _frame: object) -> None:
        from agent.rpc import pb

        print(f"ferry: {signal.Signals(signum).name}: stopping job {self.name}", file=sys.stderr, flush=True)

        def stop() -> None:
            try:
                call(
                    at(self.args, self.followed.agent),
                    "StopJob",
                    pb.StopJobRequest(name=self.name, timeout_s=10),
                    40,
                )
            except FerryError as e:
                print(f"ferry: could not stop job {self.name}: {e}", file=sys.stderr, flush=True)

        # Not in the handler itself: the main thread is inside a gRPC stream read.
        threading.Thread(target=stop, name="stop-job", daemon=True).start()

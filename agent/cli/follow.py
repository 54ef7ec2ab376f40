"""Following a job's output wherever it runs: `ferry logs --follow` and `ferry run --attach`.

An agent ends a follow stream when the job no longer runs there. If it moved, the next agent's
copy of the logs starts with everything already printed (the image carries them), so the
follower skips what it has shown, per stream, and goes on there. The same skip resumes the
output after the agent was lost (restarted, crashed): the follower retries with back-off for
`--reconnect-s` and reads that agent's copy again, which is the same files.

A job that is stopped is recorded STOPPED at once, while its process may still run its SIGTERM
handler until the SIGKILL at the end of the grace; the follower reads on until the agent records
the process's end (its exit code), so what it reports is the job's real end.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from agent.cli.calls import at, call, stream
from agent.errors import FerryError, StepTimeoutError, UnavailableError

#: How many moves one follower goes after (a loop of moves is a bug somewhere, not progress).
MAX_HOPS = 1000
#: How long a follower retries an agent it lost before it gives up (`--reconnect-s`).
RECONNECT_S = 60.0
#: Back-off between attempts to reach a lost agent: the first wait, and the longest.
BACKOFF_S = (0.2, 2.0)
#: The grace an attached CLI's stop gives the job: SIGTERM, then SIGKILL this much later.
STOP_GRACE_S = 10.0
#: How long a stopped job's end (its exit code) is waited for once the agent says it is stopped.
STOP_END_WAIT_S = 60.0
#: While a stopped job ends: how often its record and its logs are read.
POLL_S = 0.5
#: The exit status when ferry cannot tell how the job ended and it may still run: its agent stayed
#: unreachable for --reconnect-s, or a stop's end was never recorded (ssh's code for "the remote
#: side's status is unknown"; a job may exit 255 too).
EXIT_END_UNKNOWN = 255

# Injected by the unit tests.
_clock = time.monotonic
_sleep = time.sleep


class EndUnknown(FerryError):
    """The job's end could not be learnt; it may still run. Exit status EXIT_END_UNKNOWN."""


@dataclass
class Followed:
    """Where the job was last seen, and what of its output has been printed."""

    agent: str
    job: Any = None
    #: Bytes printed, per stream, over every agent followed.
    printed: dict[int, int] = field(default_factory=dict)
    #: Bytes read from the current agent, per stream.
    read: dict[int, int] = field(default_factory=dict)
    #: The follower saw the job running (so a stop of it has a process to end).
    ran: bool = False


def find_job(args: argparse.Namespace, name: str) -> Any:
    from agent.errors import NotFoundError
    from agent.rpc import pb

    for j in call(args, "ListJobs", pb.ListJobsRequest(), 10).jobs:
        if j.name == name:
            return j
    raise NotFoundError(f"no job named {name!r} on {args.agent}", hint="see `ferry ps`")


def agent_lost(e: FerryError) -> bool:
    """The agent went away (stopped, crashed, restarting) or hangs, as opposed to answering no."""
    import grpc

    if isinstance(e, UnavailableError | StepTimeoutError):
        return True
    cause = e.__cause__
    return isinstance(cause, grpc.RpcError) and cause.code() is grpc.StatusCode.CANCELLED


def _why_lost(e: FerryError) -> str:
    import grpc

    from agent.client import unreachable_cause

    cause = e.__cause__
    if isinstance(cause, grpc.RpcError) and (detail := cause.details()):
        return unreachable_cause(str(detail))
    return e.cause


def reconnect_s(args: argparse.Namespace) -> tuple[float, str]:
    """The bound on retrying a lost agent, and the option that set it ("" for the default of a
    command line without one)."""
    value = getattr(args, "reconnect_s", None)
    if value is None:
        return RECONNECT_S, ""
    return max(0.0, float(value)), "--reconnect-s"


class Reconnect:
    """Retries of a lost agent, bounded: one line when it is lost, one when it is back."""

    def __init__(self, name: str, bound_s: float, option: str = "") -> None:
        self.name, self.bound_s, self.option = name, bound_s, option
        self.since: float | None = None
        self.delay = BACKOFF_S[0]

    def lost(self, agent: str, e: FerryError) -> None:
        """Wait before the next attempt; raise EndUnknown once the bound has passed."""
        now = _clock()
        if self.since is None:
            self.since, self.delay = now, BACKOFF_S[0]
            print(
                f"ferry: lost agent {agent} ({_why_lost(e)}); reconnecting for up to {self.bound_s:g} s",
                file=sys.stderr,
                flush=True,
            )
        left = self.since + self.bound_s - now
        if left <= 0:
            raise EndUnknown(
                f"agent {agent} unreachable for {self.bound_s:g} s"
                + (f" ({self.option})" if self.option else "")
                + f"; job {self.name} may still run there",
                hint=f"see `ferry ps --agent {agent}` once it is back",
            )
        _sleep(min(self.delay, left))
        self.delay = min(self.delay * 2, BACKOFF_S[1])

    def back(self, agent: str) -> None:
        if self.since is not None:
            print(
                f"ferry: agent {agent} is back after {_clock() - self.since:.1f} s; "
                f"following job {self.name} again",
                file=sys.stderr,
                flush=True,
            )
            self.since = None


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


def _read_logs(here: argparse.Namespace, f: Followed, name: str, follow: bool) -> None:
    """This agent's copy of the logs, from its start (what was printed is skipped); while the job
    runs there (follow), until it no longer does."""
    from agent.rpc import pb

    f.read.clear()
    for chunk in stream(here, "Logs", pb.LogsRequest(name=name, follow=follow), None):
        _print_new(f, chunk)


def running(job: Any) -> bool:
    from agent.rpc import pb

    return job.state in (pb.JOB_STATE_RUNNING, pb.JOB_STATE_MIGRATING)


def ending(job: Any, ran: bool) -> bool:
    """Stopped, but its process may still run (the grace before the SIGKILL): a launched job the
    follower saw running whose end the agent has not recorded yet. (An adopted job's exit code is
    never known; a job stopped while preempted had no process.)"""
    from agent.rpc import pb

    return (
        job.state == pb.JOB_STATE_STOPPED
        and not job.has_exit_code
        and job.kind != pb.JOB_KIND_ADOPTED
        and ran
    )


def follow(
    args: argparse.Namespace, name: str, after_moves: bool = True, into: Followed | None = None
) -> Followed:
    """Print the job's output until it ends; after a move, say where it went and (after_moves)
    follow it there. An agent lost meanwhile is retried for --reconnect-s (EndUnknown after
    that). Returns (in `into`, if given) where it was last seen, with its final record."""
    from agent.rpc import pb

    f = into or Followed(agent=args.agent)
    link = Reconnect(name, *reconnect_s(args))
    hops = 0
    hint = ""  # for an error of the agent the job just moved to
    stopped_since: float | None = None
    # An agent never reached (a wrong address, one not running) is an error at once, not a wait:
    # only one that answered about the job (here, or the Run call before) can be lost.
    reached = into is not None
    preempted = False  # said so already
    while True:
        here = at(args, f.agent)
        try:
            job = find_job(here, name)
            reached = True
            link.back(f.agent)
            f.ran = f.ran or running(job)
            _read_logs(here, f, name, follow=running(job))
            # Logs read after the record: all the output up to that record is printed. The stream
            # of a running job ends when it no longer runs here; a stopped one may still write.
            drained = not running(job)
            if running(job):
                job = find_job(here, name)
                drained = job.state != pb.JOB_STATE_STOPPED
        except FerryError as e:
            if not agent_lost(e) or not reached:
                if hint:
                    e.hint = e.hint or hint
                raise
            link.lost(f.agent, e)
            continue
        hint = ""
        f.job = job
        if job.state == pb.JOB_STATE_MOVED and job.moved_to:
            where = f"{job.moved_to_node or 'another node'} ({job.moved_to})"
            if not after_moves:
                print(
                    f"ferry: job {name} moved to {where}; follow it there: "
                    f"ferry logs {name} --follow --agent {job.moved_to}",
                    file=sys.stderr,
                )
                return f
            hops += 1
            if hops > MAX_HOPS:
                raise FerryError(f"job {name} moved {MAX_HOPS} times while followed; stopped following")
            print(f"ferry: job {name} moved to {where}; following it there", file=sys.stderr, flush=True)
            f.agent, stopped_since = job.moved_to, None
            hint = f"follow it there: ferry logs {name} --follow --agent {job.moved_to}"
            continue
        if running(job):  # the agent ended the stream early: read on, not in a tight loop
            _sleep(POLL_S)
            continue
        if job.state == pb.JOB_STATE_PREEMPTED:  # not its end: its agent resumes it by itself
            if not preempted:
                print(
                    f"ferry: job {name} is preempted on {job.node_name} (suspended for a higher-priority "
                    "job); it resumes there by itself once a GPU is free; waiting",
                    file=sys.stderr,
                    flush=True,
                )
            preempted = True
            _sleep(POLL_S)
            continue
        preempted = False
        if not drained:
            continue
        if not ending(job, f.ran):
            return f
        now = _clock()
        stopped_since = now if stopped_since is None else stopped_since
        if now - stopped_since > STOP_END_WAIT_S:
            raise EndUnknown(
                f"job {name} is stopped on {job.node_name}, but its agent has not recorded its end "
                f"in {STOP_END_WAIT_S:g} s; it may still run",
                hint=f"see `ferry ps --agent {f.agent}`",
            )
        _sleep(POLL_S)


def exit_status(job: Any) -> tuple[int, str]:
    """The exit status `ferry run --attach` ends with for the job's final record, and why."""
    from agent.rpc import pb

    state = pb.JobState.Name(job.state).removeprefix("JOB_STATE_").lower()
    ended = job.state in (pb.JOB_STATE_EXITED, pb.JOB_STATE_STOPPED)
    if ended and job.has_exit_code:
        code = job.exit_code
        # A job killed by signal N ends like a shell's child: 128 + N.
        code = 128 - code if code < 0 else code
        why = f"job {job.name} was stopped on {job.node_name}; exit status {code}"
        return code, (why if job.state == pb.JOB_STATE_STOPPED else "")
    why = f"job {job.name} is {state} on {job.node_name}" + (f": {job.note}" if job.note else "")
    if job.state == pb.JOB_STATE_STOPPED:
        return 128 + signal.SIGTERM, why
    if job.state == pb.JOB_STATE_EXITED:
        why += " (its exit status was not recorded: the agent did not start it, or restarted meanwhile)"
    return 1, why


class StopOnSignal:
    """While attached, SIGTERM or SIGINT (a scheduler cancelling the step, Ctrl-C) stops the job
    wherever it runs now (SIGTERM to it, SIGKILL after STOP_GRACE_S); the follower goes on until
    the job has ended and exits with its status. A second signal says it is still waiting; a third
    exits at once, with 128 + that signal, saying the job may still run.

    Entered before the job starts: a signal before `arm()` (the job not started yet) is acted
    on once it is."""

    def __init__(self, args: argparse.Namespace, name: str, followed: Followed) -> None:
        self.args, self.name, self.followed = args, name, followed
        self.old: dict[int, Any] = {}
        self.signals = 0
        self.armed = False
        self.done = threading.Event()

    def __enter__(self) -> StopOnSignal:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.old[sig] = signal.signal(sig, self._signalled)
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        for sig, handler in self.old.items():
            signal.signal(sig, handler)

    def arm(self) -> None:
        """The job exists: a stop can be asked for now."""
        self.armed = True
        if self.signals:
            self._start()

    def _signalled(self, signum: int, _frame: object) -> None:
        self.signals += 1
        sig = signal.Signals(signum).name
        if self.signals == 1:
            say(f"{sig}: stopping job {self.name}; waiting for it to end")
            if self.armed:
                self._start()
        elif self.signals == 2:
            say(
                f"{sig}: still waiting for job {self.name} to end (SIGKILL {STOP_GRACE_S:g} s after "
                "the stop); one more signal exits without waiting"
            )
        else:
            say(
                f"{sig}: exiting without waiting; job {self.name} may still run: "
                f"see `ferry ps --agent {self.followed.agent}`"
            )
            raise SystemExit(128 + signum)

    def _start(self) -> None:
        # Not in the handler itself: the main thread is inside a gRPC stream read.
        threading.Thread(target=self._stop, name="stop-job", daemon=True).start()

    def _stop(self) -> None:
        """Ask the agent that runs the job now; retried while that agent is lost or the job is
        moving (an agent that refuses a stop during a move: once the move has left it somewhere)."""
        from agent.rpc import pb

        req = pb.StopJobRequest(name=self.name, timeout_s=STOP_GRACE_S)
        said = ""
        while not self.done.is_set():
            here = at(self.args, self.followed.agent)
            try:
                call(here, "StopJob", req, STOP_GRACE_S + 30)
                return
            except FerryError as e:
                failed = e
            if not agent_lost(failed):
                try:
                    state = find_job(here, self.name).state
                except FerryError:
                    state = None
                if state not in (pb.JOB_STATE_MIGRATING, pb.JOB_STATE_MOVED, None):
                    if state == pb.JOB_STATE_RUNNING:
                        say(f"could not stop job {self.name}: {failed}")
                    return  # it ended, or was stopped: the follower waits for its end
                if state is not None and said != "moving":
                    said = "moving"
                    say(f"job {self.name} is being moved; stopping it where the move leaves it")
            self.done.wait(POLL_S)


def say(line: str) -> None:
    print(f"ferry: {line}", file=sys.stderr, flush=True)

"""`ferry logs --follow` and `ferry run --attach` (agent.cli.follow) against a scripted agent: a lost
agent retried within --reconnect-s and the output resumed once, a stopped job followed until its
recorded end, the exit statuses, and what each signal to an attached CLI does."""

from __future__ import annotations

import argparse
import signal
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from agent.cli import follow as fl
from agent.cli import main as cli
from agent.client import from_rpc_error
from agent.errors import FerryError, RefusedError
from agent.rpc import pb

OUT = pb.LOG_STREAM_STDOUT


class Clock:
    """Fake time: sleeping advances it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


class Scripted:
    """An agent whose answers are a script: each ListJobs and Logs call takes the next item of its
    list; an item is a value, an exception to raise, or (Logs) output then an exception."""

    def __init__(self, jobs: list[Any], logs: list[Any]) -> None:
        self.jobs, self.logs = jobs, logs
        self.calls: list[tuple[str, str]] = []

    def call(self, args: argparse.Namespace, method: str, req: Any, timeout: float) -> Any:
        self.calls.append((method, args.agent))
        assert method == "ListJobs", method
        item = self.jobs.pop(0) if len(self.jobs) > 1 else self.jobs[0]
        if isinstance(item, BaseException):
            raise item
        return pb.ListJobsResponse(jobs=[item])

    def stream(self, args: argparse.Namespace, method: str, req: Any, timeout: float | None) -> Iterator[Any]:
        self.calls.append((method, args.agent))
        item = self.logs.pop(0) if len(self.logs) > 1 else self.logs[0]
        data, error = item if isinstance(item, tuple) else (item, None)
        if isinstance(data, BaseException):
            raise data
        if data:
            yield pb.LogChunk(stream=OUT, data=data)
        if error is not None:
            raise error


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(fl, "_clock", c)
    monkeypatch.setattr(fl, "_sleep", c.sleep)
    return c


def agent(monkeypatch: pytest.MonkeyPatch, jobs: list[Any], logs: list[Any]) -> Scripted:
    s = Scripted(jobs, logs)
    monkeypatch.setattr(fl, "call", s.call)
    monkeypatch.setattr(fl, "stream", s.stream)
    return s


def job(state: int, code: int | None = None, kind: int = pb.JOB_KIND_LAUNCHED, **kw: Any) -> pb.Job:
    return pb.Job(
        name="j",
        node_name="a",
        state=state,
        kind=kind,
        exit_code=code or 0,
        has_exit_code=code is not None,
        **kw,
    )


def lost(
    code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE, address: str = "unix:/run/a.sock"
) -> FerryError:
    """What the CLI's calls raise when the agent goes away, as agent.client maps it."""

    class _E(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return code

        def details(self) -> str:
            return "Socket closed"

    e = _E()
    err = from_rpc_error(e, address, "Logs")
    err.__cause__ = e
    return err


def args(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(agent="unix:/run/a.sock", insecure=True, tls_dir=None, tls_name="", **kw)


RUNNING, EXITED, STOPPED = pb.JOB_STATE_RUNNING, pb.JOB_STATE_EXITED, pb.JOB_STATE_STOPPED


@pytest.mark.parametrize("how", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED])
def test_a_lost_agent_is_retried_and_the_output_resumes_where_it_was(monkeypatch, capfd, clock, how) -> None:
    a = agent(
        monkeypatch,
        jobs=[job(RUNNING), lost(), lost(), job(RUNNING), job(EXITED, 7)],
        logs=[(b"step 0\nstep 1\n", lost(how)), b"step 0\nstep 1\nstep 2\n"],
    )
    f = fl.follow(args(), "j")
    out, err = capfd.readouterr()
    assert out == "step 0\nstep 1\nstep 2\n"  # each line once: the agent's copy is read again, skipped
    assert err.count("ferry: lost agent unix:/run/a.sock (") == 1, err
    assert "reconnecting for up to 60 s" in err
    assert err.count("ferry: agent unix:/run/a.sock is back after ") == 1, err
    assert fl.exit_status(f.job) == (7, "")
    assert [m for m, _ in a.calls].count("Logs") == 2


def test_an_agent_lost_past_the_bound_ends_with_255_naming_it(monkeypatch, capfd, clock) -> None:
    agent(monkeypatch, jobs=[job(RUNNING), lost()], logs=[(b"step 0\n", lost())])
    start = clock.now
    code = cli.main(["logs", "--follow", "j", "--agent", "unix:/run/a.sock"])
    out, err = capfd.readouterr()
    assert code == fl.EXIT_END_UNKNOWN == 255
    assert 60 <= clock.now - start <= 62
    last = err.strip().splitlines()[-1]
    assert last.startswith("ferry: agent unix:/run/a.sock unreachable for 60 s"), err
    assert "may still run" in last
    assert out == "step 0\n"


def test_the_bound_is_reconnect_s(monkeypatch, capfd, clock) -> None:
    agent(monkeypatch, jobs=[job(RUNNING), lost()], logs=[lost()])
    with pytest.raises(fl.EndUnknown, match=r"unreachable for 5 s \(--reconnect-s\)"):
        fl.follow(args(reconnect_s=5.0), "j")
    assert clock.now - 1000.0 <= 5.5


def test_an_agent_never_reached_is_an_error_at_once(monkeypatch, clock) -> None:
    """A wrong address or an agent not running: no answer about the job ever came, so there is
    nothing to wait for."""
    agent(monkeypatch, jobs=[lost()], logs=[b""])
    with pytest.raises(FerryError, match="unreachable"):
        fl.follow(args(reconnect_s=5.0), "j")
    assert clock.now == 1000.0


def test_a_refusal_is_not_retried(monkeypatch, clock) -> None:
    agent(monkeypatch, jobs=[job(RUNNING)], logs=[RefusedError("nope")])
    with pytest.raises(RefusedError):
        fl.follow(args(), "j")
    assert clock.now == 1000.0


def test_a_stopped_job_is_followed_until_its_recorded_end(monkeypatch, capfd, clock) -> None:
    """STOPPED is recorded at the stop; the job's handler may print on until the process ends."""
    agent(
        monkeypatch,
        jobs=[job(RUNNING), job(STOPPED), job(STOPPED), job(STOPPED), job(STOPPED, 3)],
        logs=[
            b"step 0\n",
            b"step 0\nending\n",
            b"step 0\nending\nending\n",
            b"step 0\nending\nending\nlast\n",
        ],
    )
    f = fl.follow(args(), "j")
    out, _ = capfd.readouterr()
    assert out == "step 0\nending\nending\nlast\n"  # the logs read after the record of its end
    assert fl.exit_status(f.job) == (3, "job j was stopped on a; exit status 3")


def test_a_stop_whose_end_is_never_recorded_is_not_waited_for_forever(monkeypatch, clock) -> None:
    agent(monkeypatch, jobs=[job(RUNNING), job(STOPPED)], logs=[b""])
    with pytest.raises(fl.EndUnknown, match=r"has not recorded its end in 60 s; it may still run"):
        fl.follow(args(), "j")


@pytest.mark.parametrize(
    "first",
    [job(STOPPED, kind=pb.JOB_KIND_ADOPTED), job(STOPPED)],
    ids=["adopted: its code is never known", "stopped before it was followed"],
)
def test_a_stopped_job_without_a_process_to_wait_for_ends_at_once(monkeypatch, clock, first) -> None:
    jobs = [first] if first.kind == pb.JOB_KIND_LAUNCHED else [job(RUNNING, kind=pb.JOB_KIND_ADOPTED), first]
    agent(monkeypatch, jobs=jobs, logs=[b""])
    f = fl.follow(args(), "j")
    assert fl.exit_status(f.job)[0] == 143
    assert clock.now == 1000.0


@pytest.mark.parametrize(
    ("record", "code", "says"),
    [
        (job(EXITED, 0), 0, ""),
        (job(EXITED, 7), 7, ""),
        (job(EXITED, -15), 143, ""),
        (job(STOPPED, 3), 3, "job j was stopped on a; exit status 3"),
        (job(STOPPED, -9), 137, "job j was stopped on a; exit status 137"),
        (job(STOPPED, 137), 137, "job j was stopped on a; exit status 137"),
        (job(STOPPED), 143, "job j is stopped on a"),
        (job(EXITED), 1, "its exit status was not recorded"),
        (job(pb.JOB_STATE_LOST, note="gone"), 1, "job j is lost on a: gone"),
    ],
)
def test_exit_status(record: pb.Job, code: int, says: str) -> None:
    got, why = fl.exit_status(record)
    assert got == code
    assert says in why if says else why == ""


# -- signals to an attached CLI ------------------------------------------------------------


class Stops:
    """StopJob answers, in order; ListJobs answers the job's state."""

    def __init__(self, answers: list[Any], state: Callable[[], int]) -> None:
        self.answers, self.state = answers, state
        self.asked: list[str] = []

    def call(self, args: argparse.Namespace, method: str, req: Any, timeout: float) -> Any:
        if method == "ListJobs":
            return pb.ListJobsResponse(jobs=[job(self.state())])
        assert method == "StopJob" and req.timeout_s == fl.STOP_GRACE_S
        self.asked.append(args.agent)
        item = self.answers.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item


def stopper(monkeypatch: pytest.MonkeyPatch, stops: Stops) -> fl.StopOnSignal:
    monkeypatch.setattr(fl, "call", stops.call)
    monkeypatch.setattr(fl, "POLL_S", 0.01)
    s = fl.StopOnSignal(args(), "j", fl.Followed(agent="unix:/run/a.sock"))
    started: list[Any] = []
    monkeypatch.setattr(s, "_start", lambda: started.append(1) or s._stop())
    s.started = started  # type: ignore[attr-defined]
    return s


def test_each_signal_says_what_it_does_and_the_third_exits(monkeypatch, capfd) -> None:
    stops = Stops([job(STOPPED)], lambda: RUNNING)
    s = stopper(monkeypatch, stops)
    s.arm()
    s._signalled(signal.SIGTERM, None)
    assert stops.asked == ["unix:/run/a.sock"]
    s._signalled(signal.SIGINT, None)
    with pytest.raises(SystemExit) as exited:
        s._signalled(signal.SIGINT, None)
    assert exited.value.code == 130
    assert stops.asked == ["unix:/run/a.sock"]  # one stop only
    err = capfd.readouterr().err.splitlines()
    assert err == [
        "ferry: SIGTERM: stopping job j; waiting for it to end",
        "ferry: SIGINT: still waiting for job j to end (SIGKILL 10 s after the stop); "
        "one more signal exits without waiting",
        "ferry: SIGINT: exiting without waiting; job j may still run: "
        "see `ferry ps --agent unix:/run/a.sock`",
    ]


def test_a_signal_before_the_job_started_stops_it_once_it_has(monkeypatch, capfd) -> None:
    stops = Stops([job(STOPPED)], lambda: RUNNING)
    s = stopper(monkeypatch, stops)
    s._signalled(signal.SIGTERM, None)
    assert stops.asked == []
    s.arm()
    assert stops.asked == ["unix:/run/a.sock"]


def test_a_stop_refused_during_a_move_is_asked_again_where_the_job_went(monkeypatch, capfd) -> None:
    """An agent that refuses a stop while the job moves: asked again, of the agent that runs it."""
    s: fl.StopOnSignal
    states = iter([pb.JOB_STATE_MIGRATING, pb.JOB_STATE_MOVED])

    def state() -> int:
        got = next(states)
        if got == pb.JOB_STATE_MOVED:
            s.followed.agent = "10.0.0.2:7070"  # the follower went after it
        return got

    refused = RefusedError("job 'j' is being moved; stop it after the move")
    stops = Stops([refused, lost(), refused, job(STOPPED)], state)
    s = stopper(monkeypatch, stops)
    s.arm()
    s._signalled(signal.SIGTERM, None)
    assert stops.asked == ["unix:/run/a.sock", "unix:/run/a.sock", "unix:/run/a.sock", "10.0.0.2:7070"]
    err = capfd.readouterr().err
    assert err.count("job j is being moved; stopping it where the move leaves it") == 1, err


def test_a_stop_of_a_job_that_ended_meanwhile_is_not_retried(monkeypatch, capfd) -> None:
    stops = Stops([RefusedError("job 'j' is exited, not running")], lambda: EXITED)
    s = stopper(monkeypatch, stops)
    s.arm()
    s._signalled(signal.SIGTERM, None)
    assert len(stops.asked) == 1
    assert "could not stop" not in capfd.readouterr().err


def test_a_preempted_job_is_waited_for_not_taken_for_its_end(monkeypatch, capfd, clock) -> None:
    """Its agent resumes it by itself once a GPU is free: a scheduler's step must not end there."""
    preempted = pb.JOB_STATE_PREEMPTED
    agent(
        monkeypatch,
        jobs=[job(RUNNING), job(preempted), job(preempted), job(RUNNING), job(EXITED, 0)],
        logs=[b"step 0\n", b"step 0\n", b"step 0\nstep 1\n"],
    )
    f = fl.follow(args(), "j")
    out, err = capfd.readouterr()
    assert out == "step 0\nstep 1\n"
    assert err.count("is preempted on a") == 1 and "resumes there by itself" in err
    assert fl.exit_status(f.job) == (0, "")

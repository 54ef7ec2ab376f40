"""`ferry run --attach` against real agents: a signal stops the job and the CLI waits for its real
end (a job that ends by itself in its SIGTERM handler, one killed at the end of the grace), and an
agent restarted or killed under an attached CLI costs it nothing (docs/operations.md, "Launching
jobs from a scheduler")."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.jobs import procs
from agent.testing.localcluster import LocalAgent
from agent.testing.poll import wait_for
from tests.integration.jobtools import job as job_record

#: Prints a step every 0.05 s until a file named by argv[2] exists (or forever), then ends with
#: argv[1]; a SIGTERM handler per argv[3]: "trap" prints 20 more lines over 2 s, then a last
#: one, and exits 3; "ignore" ignores it; "none" leaves the default (it dies).
JOB = """\
import os, signal, sys, time
code, until, on_term = int(sys.argv[1]), sys.argv[2], sys.argv[3]
def trapped(*_):
    for i in range(20):
        print(f"ending {i}", flush=True)
        time.sleep(0.1)
    print("last line", flush=True)
    sys.exit(3)
if on_term == "trap":
    signal.signal(signal.SIGTERM, trapped)
elif on_term == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
i = 0
while not (until and os.path.exists(until)):
    print(f"step {i}", flush=True)
    i += 1
    time.sleep(0.05)
print("done", file=sys.stderr, flush=True)
sys.exit(code)
"""


class Background:
    """`ferry ARGS` against the agent's socket, in the background, its stdout and stderr in files."""

    def __init__(self, agent: LocalAgent, tmp: Path, label: str, *args: str) -> None:
        self.out, self.err = tmp / f"{label}.out", tmp / f"{label}.err"
        cmd = [*agent.ferry(), args[0], "--agent", f"unix:{agent.socket}", *args[1:]]
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=agent.env)

    def stdout(self) -> str:
        return self.out.read_text()

    def stderr(self) -> str:
        return self.err.read_text()

    def wait_out(self, pattern: str, timeout_s: float = 60) -> None:
        wait_for(
            f"{pattern!r} in the CLI's stdout",
            lambda: re.search(pattern, self.stdout(), re.M),
            timeout_s,
        )
        assert self.proc.poll() is None, self.stderr()

    def wait_err(self, text: str, timeout_s: float = 60) -> None:
        wait_for(f"{text!r} in the CLI's stderr", lambda: text in self.stderr(), timeout_s)

    def end(self, timeout_s: float = 60) -> int:
        try:
            return self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def attach(agent: LocalAgent, tmp: Path, name: str, code: int, until: str, on_term: str) -> Background:
    """`ferry run --attach` of JOB."""
    script = tmp / "job.py"
    script.write_text(JOB)
    args = [sys.executable, str(script), str(code), until, on_term]
    return Background(agent, tmp, name, "run", "--attach", "--name", name, "--", *args)


def steps(out: str) -> list[int]:
    return [int(m[1]) for m in re.finditer(r"^step (\d+)$", out, re.M)]


def test_a_signal_stops_the_job_and_the_cli_ends_with_it(agents, tmp_path: Path) -> None:
    """SIGINT to the CLI: the job gets SIGTERM, runs its handler for 2 s and exits 3; the CLI
    prints all of it and exits 3 only then. A second signal only says it is still waiting."""
    a = agents("a")
    job = attach(a, tmp_path, "trap", 0, "", "trap")
    job.wait_out(r"^step 5$")
    job.proc.send_signal(signal.SIGINT)
    asked = time.monotonic()
    job.wait_out(r"^ending 3$", 10)
    job.proc.send_signal(signal.SIGTERM)  # a second one: still waiting
    code = job.end()
    took = time.monotonic() - asked
    out, err = job.stdout(), job.stderr()
    assert code == 3, err
    assert out.rstrip().endswith("last line"), out[-300:]
    assert [f"ending {i}" for i in range(20)] == re.findall(r"^ending \d+$", out, re.M)
    assert steps(out) == list(range(len(steps(out))))
    assert took >= 2.0, f"the CLI ended {took:.1f} s after the signal, before the job's end"
    assert "ferry: SIGINT: stopping job trap; waiting for it to end" in err, err
    assert "ferry: SIGTERM: still waiting for job trap to end (SIGKILL 10 s after the stop)" in err, err
    assert "ferry: job trap was stopped on a; exit status 3" in err, err
    assert "Traceback" not in err, err


def test_a_job_that_ignores_sigterm_is_killed_after_the_grace(agents, tmp_path: Path) -> None:
    a = agents("a")
    job = attach(a, tmp_path, "stubborn", 0, "", "ignore")
    job.wait_out(r"^step 5$")
    job.proc.send_signal(signal.SIGTERM)
    asked = time.monotonic()
    code = job.end()
    took = time.monotonic() - asked
    out, err = job.stdout(), job.stderr()
    assert code == 137, err  # SIGKILL: 128 + 9
    assert took >= 9.5, f"the CLI ended {took:.1f} s after the signal, before the SIGKILL"
    # It printed what the job wrote during the grace: about 10 s of steps after the signal.
    assert len(steps(out)) > 150, out[-300:]
    assert steps(out) == list(range(len(steps(out))))
    assert "ferry: job stubborn was stopped on a; exit status 137" in err, err


def test_a_third_signal_exits_at_once_saying_the_job_may_still_run(agents, tmp_path: Path) -> None:
    a = agents("a")
    job = attach(a, tmp_path, "impatient", 0, "", "ignore")
    job.wait_out(r"^step 5$")
    for _ in range(2):
        job.proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
    job.wait_err("still waiting")
    job.proc.send_signal(signal.SIGINT)
    code = job.end(5)
    err = job.stderr()
    assert code == 130, err
    assert err.splitlines()[-1] == (
        "ferry: SIGINT: exiting without waiting; job impatient may still run: "
        f"see `ferry ps --agent unix:{a.socket}`"
    ), err
    rec = job_record(a, "impatient")
    assert rec["state"] == "stopped"  # the agent's stop goes on: SIGKILL at the grace's end
    # Not waited for here (the fixture kills running jobs only).
    procs.signal_all(procs.tree_pids(rec["pid"]), signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_the_attached_cli_outlives_an_agent_restart(agents, tmp_path: Path, sig: signal.Signals) -> None:
    """The agent is stopped (or killed) and started again under an attached CLI and a `logs
    --follow`: each says once that it lost the agent and once that it is back, prints every line
    once and ends when the job ends, the attached one with the job's status."""
    a = agents("a")
    until = tmp_path / "enough"
    job = attach(a, tmp_path, "steady", 7, str(until), "none")
    job.wait_out(r"^step 5$")
    follower = Background(a, tmp_path, "follower", "logs", "--follow", "steady")
    follower.wait_out(r"^step 5$")
    a.stop(sig)
    for p in (job, follower):
        p.wait_err(f"ferry: lost agent unix:{a.socket} (")
    time.sleep(1)  # a few attempts fail meanwhile
    assert job.proc.poll() is None, job.stderr()
    a.start()
    for p in (job, follower):
        p.wait_err(f"ferry: agent unix:{a.socket} is back after ")
    until.touch()
    code, followed = job.end(), follower.end()
    for p in (job, follower):
        out, err = p.stdout(), p.stderr()
        assert steps(out) == list(range(len(steps(out)))) and len(steps(out)) > 10, out[-300:]
        assert err.count("ferry: lost agent ") == 1, err
        assert err.count(" is back after ") == 1, err
        assert "reconnecting for up to 60 s" in err, err
        assert "\ndone\n" in err, err
        assert "Traceback" not in err, err
    assert job.stdout() == follower.stdout()
    assert followed == 0, follower.stderr()
    err = job.stderr()
    # A restarted agent is no longer the job's parent: it reads the status ferry-init's PID 1
    # recorded in the job's log directory.
    assert code == 7, err

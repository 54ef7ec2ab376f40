"""Helpers for integration tests: run the training workload under agents and check its output."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from agent.testing.localcluster import LocalAgent

REPO = Path(__file__).resolve().parents[2]
WORKLOAD = REPO / "scripts" / "workloads" / "train_mlp.py"

_REFERENCE: dict[tuple[str, ...], str] = {}


def train_args(steps: int, workers: int = 0, step_time: float = 0.1) -> list[str]:
    return ["--steps", str(steps), "--step-time", str(step_time), "--workers", str(workers)]


def reference_output(steps: int, workers: int = 0) -> str:
    """The output of the same training run, uninterrupted (cached per arguments)."""
    key = (str(steps), str(workers))
    if key not in _REFERENCE:
        _REFERENCE[key] = subprocess.run(
            [sys.executable, str(WORKLOAD), *train_args(steps, workers, step_time=0)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        ).stdout
    return _REFERENCE[key]


def reference_digest(steps: int, workers: int = 0) -> str:
    """The final digest of the same training run, uninterrupted."""
    return final_digest(reference_output(steps, workers))


def first_difference(log: str, reference: str) -> str:
    """The first step line where a run left the uninterrupted one, for a failure message."""
    ours = [ln for ln in log.splitlines() if ln.startswith("step ")]
    theirs = [ln for ln in reference.splitlines() if ln.startswith("step ")]
    for a, b in zip(ours, theirs, strict=False):
        if a != b:
            return f"first difference: {a!r} (uninterrupted: {b!r})"
    return "every step line matches"


def steps_in(log: str) -> list[int]:
    return [int(m[1]) for m in re.finditer(r"^step (\d+) ", log, re.M)]


def final_digest(log: str) -> str:
    m = re.search(r"^final digest (\w+)$", log, re.M)
    assert m, f"no final digest in output:\n{log[-500:]}"
    return m[1]


def start_adoptable(cmd: list[str], log: Path, stderr: int = subprocess.STDOUT) -> subprocess.Popen[bytes]:
    """A process ferry did not start, for `ferry adopt`: a session of its own, stdout to log."""
    with open(log, "wb") as f:
        return subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=stderr, start_new_session=True
        )


#: A process that only waits: what the CRIU tests dump.
IDLE_LOOP = "import time\nwhile True: time.sleep(0.05)"


@contextmanager
def unshared(namespaces: list[str], argv: list[str], timeout_s: float = 10) -> Iterator[int]:
    """The pid of `argv` (a Python program, or a shell that execs one) run by `unshare` in new
    `namespaces` (its options, "--net" ...), once it runs Python; killed at the end. A session
    of its own, as every job ferry runs has: the runner's session leader may lie outside this
    pid namespace (a container's), and CRIU refuses such a tree."""
    ns = subprocess.Popen(["unshare", *namespaces, "--fork", "--kill-child", *argv], start_new_session=True)
    try:
        end, pid = time.monotonic() + timeout_s, 0
        while time.monotonic() < end:
            kids = psutil.Process(ns.pid).children()
            if kids and kids[0].name().startswith("python"):
                pid = kids[0].pid
                break
            time.sleep(0.05)
        assert pid, f"`unshare {' '.join(namespaces)}` ran no Python within {timeout_s:g} s"
        yield pid
    finally:
        ns.kill()
        ns.wait(10)


def run_training(agent: LocalAgent, name: str, steps: int, workers: int = 0) -> None:
    agent.cli("run", "--name", name, "--", sys.executable, str(WORKLOAD), *train_args(steps, workers))


def wait_steps(agent: LocalAgent, name: str, n: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(steps_in(agent.cli("logs", name).stdout)) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"job {name} did not reach step {n} on {agent.node}")


def job(agent: LocalAgent, name: str) -> dict:
    jobs = {j["name"]: j for j in json.loads(agent.cli("ps", "--json").stdout)}
    assert name in jobs, f"{name} not in `ferry ps` of {agent.node}: {sorted(jobs)}"
    return jobs[name]


def wait_state(agent: LocalAgent, name: str, state: str, timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        j = job(agent, name)
        if j["state"] == state:
            return j
        time.sleep(0.2)
    raise AssertionError(f"job {name} on {agent.node} is {job(agent, name)['state']}, expected {state}")


def assert_completed_exactly_once(agent: LocalAgent, name: str, steps: int, workers: int = 0) -> None:
    """Finished with status 0, every step logged once and in order, digest as if never interrupted."""
    j = wait_state(agent, name, "exited")
    log = agent.cli("logs", name).stdout
    assert j["exit_code"] == 0, f"exit {j['exit_code']}; stderr:\n{agent.cli('logs', name).stderr[-2000:]}"
    assert steps_in(log) == list(range(steps))
    assert final_digest(log) == reference_digest(steps, workers), first_difference(
        log, reference_output(steps, workers)
    )


def on_own_node(
    setup: str, env: dict[str, str], *args: str, timeout_s: float = 600
) -> subprocess.CompletedProcess[str]:
    """Run bash `setup` (then `args` as its $0...) from the repository in private mount and network
    namespaces, a node of its own: what it mounts and the ports it takes vanish with it. The
    caller's FERRY_* variables are left out."""
    env = {k: v for k, v in env.items() if not k.startswith("FERRY_")}
    return subprocess.run(
        ["unshare", "--mount", "--net", "--fork", "bash", "-c", setup, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )

"""CUDA inside the small world ferry-init gives a launched job (native/ferry-init.c): its own PID
namespace, and with --private its own mount namespace (fresh /tmp, /dev/shm and /run, a /proc of
its PID namespace), with --netns its own network namespace, with --no-io-uring a seccomp filter.
Every launched job of the agent gets all of them.

On the first device check (an H200, driver 580), every launched CUDA job failed its first call
(cudaSetDevice: "OS call failed or operation not supported on this OS", error 304) while the same
binary ran outside ferry-init. Inside the PID namespace, /proc was then the node's: a process's
/proc/<getpid()> named another one (ferry-init --private now mounts the job's own). This test
runs the CUDA counter for one step under each part of the sandbox alone and under all of them,
and in a PID namespace with and without a /proc of its own, records which fail for the device
report, and asserts that CUDA works under the whole sandbox, as a job needs.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from agent.config import init_binary
from tests.gpu.devicetools import counter_cmd, record_note

#: name → how the counter is started: under ferry-init with these options, or (unshare) under
#: util-linux's unshare, which tells the PID namespace from the /proc mounted for it.
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "no sandbox": ("", []),
    "unshare --pid --fork (the node's /proc)": ("unshare", ["--pid", "--fork"]),
    "unshare --pid --fork --mount-proc (its own /proc)": ("unshare", ["--pid", "--fork", "--mount-proc"]),
    "ferry-init (PID namespace, the node's /proc)": ("ferry-init", []),
    "ferry-init --no-io-uring": ("ferry-init", ["--no-io-uring"]),
    "ferry-init --private": ("ferry-init", ["--private"]),
    "ferry-init --private --netns": ("ferry-init", ["--private", "--netns"]),
    "ferry-init, all, as a job gets them": ("ferry-init", ["--private", "--netns", "--no-io-uring"]),
}


def one_step(how: str, opts: list[str], logs: Path) -> str:
    """The answer: ok, or the failure in the counter's own words."""
    cmd = counter_cmd(1, mib=64, step_time=0.0)
    if how == "unshare":
        cmd = ["unshare", *opts, *cmd]
    elif how == "ferry-init":
        logs.mkdir(parents=True, exist_ok=True)
        for f in ("stdout.log", "stderr.log"):  # PID 1 opens them, as the agent leaves them
            (logs / f).touch()
        extra = ["--logs", str(logs)] if "--private" in opts else []
        cmd = [init_binary(), *opts, *extra, "--", *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False, cwd="/")
    err = p.stderr
    if (logs / "stderr.log").exists():
        err += (logs / "stderr.log").read_text(errors="replace")
    return "ok" if p.returncode == 0 else f"exit {p.returncode}: {err.strip()[-300:]}"


@pytest.mark.timeout(300)
def test_cuda_runs_inside_the_sandbox_a_launched_job_gets(tmp_path: Path) -> None:
    got = {
        name: one_step(how, opts, tmp_path / f"logs-{i}")
        for i, (name, (how, opts)) in enumerate(VARIANTS.items())
    }
    record_note("CUDA in ferry-init's sandbox, one step of the counter", **got)
    assert got["no sandbox"] == "ok", got
    assert got["ferry-init, all, as a job gets them"] == "ok", got

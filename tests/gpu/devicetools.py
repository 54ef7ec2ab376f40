"""Helpers of the GPU suite: the CUDA counter, where a job runs by GPU UUID, the figures and driver
facts the device check prints, and the plain word on a same-host restore that collides with its
frozen source. The agents are nodes of the multi-node bed (agent/testing/bed.py, tests/gpu's `bed`
fixture): what lies in a node's own /dev/shm, /run or /tmp is read through its agent's
/proc/PID/root."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from agent.testing.localcluster import LocalAgent
from tests.integration.jobtools import WORKLOAD, final_digest, job, steps_in, wait_state

REPO = Path(__file__).resolve().parents[2]
COUNTER = os.environ.get("FERRY_CUDA_COUNTER") or str(REPO / ".ferry" / "bin" / "cuda-counter")
#: Where each measured migration is appended as one JSON line (scripts/device_report.py prints
#: the table); set by scripts/device-check.sh.
FIGURES = os.environ.get("FERRY_DEVICE_FIGURES", "")
#: What a restore beside its frozen CUDA source would print if the driver's restore-thread channel
#: (set up through /proc) collided with the source's.
COLLISION = re.compile(r"Address already in use|restore[ -]thread|cuCheckpointProcessRestore", re.I)

_REFERENCE: dict[tuple[str, ...], str] = {}


def counter_cmd(steps: int, *extra: str, mib: int = 512, step_time: float = 0.1) -> list[str]:
    """The counter's command line; skips, with the loader's own words, when it cannot start here."""
    if not os.access(COUNTER, os.X_OK):
        pytest.skip(f"no CUDA counter at {COUNTER} (build it with `make native` where nvcc exists)")
    # An unknown option exits 2 once the binary has loaded, before any CUDA call.
    p = subprocess.run([COUNTER, "--no-such-option"], capture_output=True, text=True, timeout=30, check=False)
    if p.returncode != 2:
        pytest.skip(f"{COUNTER} cannot start on this host (exit {p.returncode}): {p.stderr.strip()[-400:]}")
    return [COUNTER, "--steps", str(steps), "--step-time", str(step_time), "--mib", str(mib), *extra]


def torch_cmd(steps: int, step_time: float = 0.1) -> list[str]:
    return [
        sys.executable,
        str(WORKLOAD),
        "--device",
        "cuda",
        "--steps",
        str(steps),
        "--step-time",
        str(step_time),
    ]


def reference(cmd: list[str]) -> str:
    """The output of the same job run straight through, without ferry (step time 0)."""
    key = tuple(cmd)
    if key not in _REFERENCE:
        fast = [*cmd]
        fast[fast.index("--step-time") + 1] = "0"
        p = subprocess.run(fast, capture_output=True, text=True, timeout=300, check=False)
        assert p.returncode == 0, f"reference run failed: {p.stderr[-2000:]}"
        _REFERENCE[key] = p.stdout
    return _REFERENCE[key]


def step_lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith("step ")]


def same_as_uninterrupted(agent: LocalAgent, name: str, cmd: list[str], steps: int) -> None:
    """Waits for the job to end; asserts it ran every step once and matches a straight run."""
    j = wait_state(agent, name, "exited", timeout_s=240)
    out = agent.cli("logs", name).stdout
    assert j["exit_code"] == 0, f"exit {j['exit_code']}; stderr:\n{agent.cli('logs', name).stderr[-2000:]}"
    assert steps_in(out) == list(range(steps))
    ref = reference(cmd)
    assert step_lines(out) == step_lines(ref)
    assert final_digest(out) == final_digest(ref)


def tree_pids(agent: LocalAgent, name: str) -> list[int]:
    """The host PIDs of the job's process tree (its init first)."""
    root = job(agent, name)["pid"]
    pids = [root]
    with contextlib.suppress(psutil.Error):
        pids += [c.pid for c in psutil.Process(root).children(recursive=True)]
    return pids


def gpus(agent: LocalAgent) -> list[dict]:
    """`ferry gpus --json`'s GPUs: uuid, memory, and the processes NVML lists on each."""
    return json.loads(agent.cli("gpus", "--json").stdout)["gpus"]


def gpu_of_job(agent: LocalAgent, name: str, timeout_s: float = 20) -> str:
    """The UUID of the one GPU on which NVML (`ferry gpus`) lists a process of the job's tree."""
    deadline = time.monotonic() + timeout_s
    while True:
        tree = set(tree_pids(agent, name))
        on = {g["uuid"] for g in gpus(agent) for p in g["processes"] if p["pid"] in tree}
        if len(on) == 1:
            return on.pop()
        if time.monotonic() >= deadline:
            raise AssertionError(f"job {name} on {agent.node}: NVML lists it on {sorted(on) or 'no GPU'}")
        time.sleep(0.5)


def on_node(agent: LocalAgent, path: Path) -> Path:
    """path as the agent sees it, from here: through /proc/PID/root when the agent runs in a mount
    namespace of its own (a bed node's /dev/shm, /run and /tmp are its own)."""
    if agent.proc is None or agent.proc.poll() is not None:
        return path
    return Path(f"/proc/{agent.proc.pid}/root") / path.relative_to("/")


def migrate(a: LocalAgent, b: LocalAgent, name: str) -> dict:
    """`ferry migrate --json` from a to b; a failure that looks like a same-host restore colliding
    with the frozen CUDA source is said plainly, as the limit docs/gpu.md names."""
    p = a.cli("migrate", name, "--to", b.address, "--json", check=False)
    if p.returncode == 0:
        return json.loads(p.stdout)
    hits = [p.stderr.strip()]
    for agent in (a, b):
        staged = on_node(agent, agent.staging_dir).rglob("*.log")
        for log in [agent.log_path, *agent.root.rglob("*.log"), *staged]:
            try:
                hits += [ln for ln in log.read_text(errors="replace").splitlines() if COLLISION.search(ln)]
            except OSError:
                continue
    if any(COLLISION.search(h) for h in hits):
        raise AssertionError(
            "same-host restore beside the frozen CUDA source collided (a limit of one-host tests, "
            "see docs/gpu.md): " + " | ".join(hits[:6])
        )
    raise AssertionError(f"migration failed: {p.stderr.strip()}")


def record(label: str, result: dict, *, bit_identical: bool, gpu: str) -> None:
    """One measured migration for the device report (and the test's own output)."""
    line = {"label": label, "gpu": gpu, "bit_identical": bit_identical, **result}
    print("figures:", json.dumps(line, sort_keys=True))
    if FIGURES:
        with open(FIGURES, "a") as f:
            f.write(json.dumps(line, sort_keys=True) + "\n")


def record_note(label: str, **facts: object) -> None:
    """A fact that is not a migration (what the driver answered, say) for the device report."""
    print("figures:", label, json.dumps(facts, sort_keys=True, default=str))
    if FIGURES:
        with open(FIGURES, "a") as f:
            f.write(json.dumps({"label": label, "note": facts}, sort_keys=True, default=str) + "\n")


def record_fact(label: str, *, fake: str, driver: str, agrees: bool, **measured: object) -> None:
    """What the unit tests' fake driver assumes, what the real driver answered, and whether they
    agree: the device report lists these under "driver facts (the fake's assumptions)"."""
    record_note(label, fake=fake, driver=driver, agrees=agrees, **measured)

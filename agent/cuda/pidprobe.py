"""Does NVML report PIDs as this agent sees them? A probe process with a CUDA context must be
listed by NVML under the PID the agent knows it by.

The NVIDIA driver reports host PIDs to NVML whatever PID namespace the caller is in. An agent
in a container of its own (no `hostPID`) then sees every CUDA job as "a CUDA context that NVML
lists on no GPU", and could never move one. That is a property of the node, so it is checked
once, by `ferry doctor`, by the device check, and when a job meets it, and said plainly.

    python -m agent.cuda.pidprobe     # prints the verdict; exit 0 match, 1 mismatch, 2 unknown
"""

from __future__ import annotations

import contextlib
import selectors
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from agent.compat import StrEnum
from agent.gpus.inventory import Nvml

#: The probe: a CUDA context on GPU 0 with a little memory (so NVML lists it), then it waits
#: for its stdin to close. It prints its own PID, which is the agent's view of it too.
PROBE_CODE = """
import os, sys
from cuda.bindings import driver as d
def ok(r, what):
    if int(r[0]) != 0:
        sys.exit(f"{what} failed: {r[0]}")
    return r[1] if len(r) > 1 else None
ok(d.cuInit(0), "cuInit")
dev = ok(d.cuDeviceGet(0), "cuDeviceGet")
ctx = ok(d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
ok(d.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
ok(d.cuMemAlloc(1 << 20), "cuMemAlloc")
print("ready", os.getpid(), flush=True)
sys.stdin.read()
"""
READY_TIMEOUT_S = 30.0
#: NVML may list a new context a moment after it exists.
LIST_TIMEOUT_S = 5.0


class PidVerdict(StrEnum):
    MATCH = "match"  # NVML lists the probe under the agent's PID for it
    MISMATCH = "mismatch"  # NVML lists processes, but not under the PIDs the agent knows
    UNKNOWN = "unknown"  # no probe could run (no GPU, no driver, no context): nothing said


@dataclass(frozen=True)
class PidProbe:
    verdict: PidVerdict
    detail: str

    @property
    def mismatch(self) -> bool:
        return self.verdict is PidVerdict.MISMATCH


MISMATCH_HINT = (
    "run the agent in the host's PID namespace (a container needs hostPID: true, or "
    "`docker run --pid=host`): NVML reports host PIDs"
)


def spawn_probe() -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", PROBE_CODE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def probe(
    nvml: Nvml,
    spawn: Callable[[], subprocess.Popen[str]] = spawn_probe,
    ready_timeout_s: float = READY_TIMEOUT_S,
    list_timeout_s: float = LIST_TIMEOUT_S,
) -> PidProbe:
    """Start the probe, wait for its context, and look for its PID in NVML's process lists."""
    inv = nvml.inventory()
    if not inv.available or not inv.gpus:
        return PidProbe(PidVerdict.UNKNOWN, f"no GPU to probe: {inv.detail or 'NVML lists none'}")
    try:
        proc = spawn()
    except OSError as e:
        return PidProbe(PidVerdict.UNKNOWN, f"the probe did not start: {e}")
    try:
        said = _ready_line(proc, ready_timeout_s)
        if not said.startswith("ready"):
            return PidProbe(PidVerdict.UNKNOWN, f"the probe made no CUDA context: {said}")
        deadline = time.monotonic() + list_timeout_s
        while True:
            usage = nvml.inventory().usage_by_pid()
            if proc.pid in usage:
                gpu = usage[proc.pid][0][0].uuid
                return PidProbe(PidVerdict.MATCH, f"NVML lists the probe (pid {proc.pid}) on {gpu}")
            if time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if not usage:
            return PidProbe(
                PidVerdict.UNKNOWN,
                f"the probe (pid {proc.pid}) holds a CUDA context but NVML lists no process",
            )
        listed = ", ".join(str(p) for p in sorted(usage)[:8])
        return PidProbe(
            PidVerdict.MISMATCH,
            f"NVML lists pids {listed} but not the probe's pid {proc.pid}: NVML reports PIDs of another "
            "PID namespace (the host's) than the agent's",
        )
    finally:
        _end(proc)


def _ready_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The probe's first line, or why there is none (it died, or said nothing in time)."""
    assert proc.stdout is not None and proc.stderr is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout_s):
        return f"no answer within {timeout_s:g} s"
    line = proc.stdout.readline().strip()
    if line:
        return line
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        return "it closed its output without an answer and did not exit within 5 s"
    err = proc.stderr.read().strip().splitlines()
    return f"it exited {proc.returncode}: {err[-1] if err else 'no message'}"


def _end(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired, ValueError, OSError):
        proc.communicate(timeout=5)


def main() -> int:
    result = probe(Nvml())
    print(f"nvml pids: {result.verdict.value}: {result.detail}")
    if result.mismatch:
        print(f"fix: {MISMATCH_HINT}")
    return {PidVerdict.MATCH: 0, PidVerdict.MISMATCH: 1, PidVerdict.UNKNOWN: 2}[result.verdict]


if __name__ == "__main__":
    sys.exit(main())

"""What the real CUDA checkpoint driver answers where the unit tests' fake (tests/unit/fake_cuda.py)
assumes: each test measures one assumption on a small PyTorch CUDA process and records, for the
device report's "driver facts (the fake's assumptions)", what the fake assumes, what the driver
answered, and whether they agree (devicetools.record_fact). A test asserts only what ferry needs
to be correct; a difference that ferry survives is recorded, not failed.

Every driver call runs in a child Python (`ask`) with a time bound, so a call that never returns
costs seconds, not the run's budget; every CUDA process is killed, its forked worker with it,
before the test ends.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.cuda.driver import NO_CONTEXT, NOT_SUPPORTED, UNDECODABLE
from agent.jobs.threadhold import held, threads
from tests.gpu.devicetools import REPO, record_fact

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed here"),
]

#: What the fake and ferry read as "no CUDA context" (agent.cuda.driver.CudaDriver.read_state).
NO_CONTEXT_CODES = (*NO_CONTEXT, NOT_SUPPORTED, UNDECODABLE)

#: A small CUDA process: 64 MiB on the GPU; with "fork", a child forked after CUDA init that makes
#: no CUDA call (as a DataLoader worker starts), reaped by the kernel when it ends (SIGCHLD
#: ignored: a worker killed first leaves no zombie). One JSON line at start, one per stdin line.
CHILD = r"""
import json, os, signal, sys, time
import torch
x = torch.arange(1 << 24, dtype=torch.float32, device="cuda")
torch.cuda.synchronize()
worker = 0
if sys.argv[1] == "fork":
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    worker = os.fork()
    if worker == 0:
        time.sleep(120)
        os._exit(0)
print(json.dumps({"pid": os.getpid(), "worker": worker, "sum": x.sum().item()}), flush=True)
for _ in sys.stdin:
    print(json.dumps({"sum": x.sum().item()}), flush=True)
"""

#: The driver calls, through ferry's own adapter, one JSON line per call as it returns.
ASK = r"""
import json, sys, time
from agent.cuda.driver import CudaDriver
driver = CudaDriver()
for name, pid in json.loads(sys.argv[1]):
    t = time.monotonic()
    out = {"call": name, "pid": pid}
    try:
        if name == "read_state":
            r = driver.read_state(pid)
            out.update(state=r.state.value if r.state else None, code=r.code, detail=r.detail)
        elif name == "restore_thread":
            out["tid"] = driver.restore_thread(pid)
        elif name == "lock":
            driver.lock(pid, 10.0)
        else:
            getattr(driver, name)(pid)
        out["ok"] = True
    except Exception as e:
        out.update(ok=False, error=f"{type(e).__name__}: {e}", code=getattr(e, "result", None))
    out["s"] = round(time.monotonic() - t, 3)
    print(json.dumps(out), flush=True)
"""


def ask(*calls: tuple[str, int], timeout_s: float = 20) -> list[dict]:
    """One answer per call, in order. A call that did not return within timeout_s (all of them
    together) is answered {"ok": False, "error": "no answer ..."}, and those after it were not made.
    The asking process never outlives this function."""
    p = subprocess.Popen(
        [sys.executable, "-c", ASK, json.dumps(calls)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    late = ""
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        late = f"no answer within {timeout_s:g} s"
    finally:
        if p.poll() is None:  # interrupted (the test's own timeout): the asker goes too
            p.kill()
            p.wait()
    said = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    for i, (name, pid) in enumerate(calls[len(said) :]):
        why = late or f"the asking process ended (exit {p.returncode}): {err.strip()[-300:]}"
        said.append({"call": name, "pid": pid, "ok": False, "error": why if i == 0 else "not asked"})
    return said


def ok(answers: list[dict]) -> bool:
    return bool(answers) and all(a.get("ok") for a in answers)


def said(answer: dict) -> str:
    """One answer in words."""
    if not answer.get("ok"):
        return answer.get("error", "?")
    if answer["call"] == "read_state":
        return f"{answer['state'] or 'no context'} ({answer['detail']}, {answer['s']} s)"
    if answer["call"] == "restore_thread":
        return f"tid {answer['tid']} ({answer['s']} s)"
    return f"ok ({answer['s']} s)"


class CudaChild:
    """The CUDA process of a test: started in a session of its own, killed with its worker."""

    def __init__(self, tmp_path: Path, fork: bool = False, timeout_s: float = 45) -> None:
        self.stderr = tmp_path / "cuda-child.log"
        with open(self.stderr, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", CHILD, "fork" if fork else "alone"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                start_new_session=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )
        try:
            first = self._line(timeout_s)
        except BaseException:
            self.kill()
            raise
        self.pid: int = first["pid"]
        self.worker: int = first["worker"]
        self.first_sum: float = first["sum"]

    def _line(self, timeout_s: float) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            tail = self.stderr.read_text(errors="replace").strip()[-800:]
            raise AssertionError(f"the CUDA process did not answer within {timeout_s:g} s: {tail}")
        return json.loads(line)

    def device_sum(self, timeout_s: float = 20) -> float:
        """The sum of its 64 MiB buffer, read from the GPU now."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("sum\n")
        self.proc.stdin.flush()
        return self._line(timeout_s)["sum"]

    def kill(self) -> None:
        """The worker first, which its parent (alive, SIGCHLD ignored) leaves to the kernel to reap,
        then the whole group."""
        worker = getattr(self, "worker", 0)
        if worker and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
            deadline = time.monotonic() + 5
            while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the worker too, if still there: the same group
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()


def nvidia_files(pid: int) -> dict[str, int]:
    """How many NVIDIA device files the process holds open and has mapped (what detection reads)."""
    fds = 0
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                fds += os.readlink(fd).startswith("/dev/nvidia")
    try:
        maps = sum("/dev/nvidia" in ln for ln in Path(f"/proc/{pid}/maps").read_text().splitlines())
    except OSError:
        maps = 0
    return {"open": fds, "mapped": maps}


_SOCK_TYPES = {"0001": "stream", "0002": "dgram", "0005": "seqpacket"}


def unix_sockets(pid: int) -> list[str]:
    """The process's unix sockets as /proc/PID/net/unix (its network namespace) lists them, matched
    by inode to its fds: "@name" (abstract), a path, or "unbound", with type and state."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[len("socket:[") : -1])
    found = []
    for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
        f = line.split(None, 7)
        if len(f) < 7 or f[6] not in inodes:
            continue
        state = {"01": "unconnected", "03": "connected"}.get(f[5], f"state {f[5]}")
        if int(f[3], 16) & 0x10000:  # __SO_ACCEPTCON
            state = "listening"
        found.append(f"{f[7] if len(f) > 7 else 'unbound'} ({_SOCK_TYPES.get(f[4], f[4])}, {state})")
    return sorted(found)


def task_names(pid: int) -> dict[int, str]:
    names = {}
    for tid in threads(pid):
        with contextlib.suppress(OSError):
            names[tid] = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    return names


def wait_stopped(pid: int, timeout_s: float = 10) -> None:
    """Until every thread of pid is in a group stop (state T)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = set()
        for tid in threads(pid):
            with contextlib.suppress(OSError, IndexError):
                states.add(Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0])
        if states == {"T"}:
            return
        assert time.monotonic() < deadline, f"pid {pid} did not stop: thread states {states}"
        time.sleep(0.02)


def test_a_forked_worker_has_no_cuda_state_of_its_own(tmp_path: Path) -> None:
    """A DataLoader worker forked from a CUDA process inherits its NVIDIA files but not its
    context. ferry asks the driver about every process holding those files (agent/cuda/jobs.py):
    the worker's get-state must read as "no context", or ferry would lock and checkpoint a process
    that has no CUDA state (or refuse every job with such workers)."""
    child = CudaChild(tmp_path, fork=True)
    try:
        parent, worker = ask(("read_state", child.pid), ("read_state", child.worker))
        files = {"parent": nvidia_files(child.pid), "worker": nvidia_files(child.worker)}
        no_context = bool(worker.get("ok")) and worker.get("state") is None
        record_fact(
            "forked DataLoader worker: get-state",
            fake="a child forked after CUDA init has no context: get-state answers INVALID_VALUE (1) by "
            "default, or NOT_INITIALIZED (3), NOT_SUPPORTED (801) or the bindings' ValueError, each read "
            "as 'no context'",
            driver=said(worker),
            agrees=no_context and worker.get("code") in NO_CONTEXT_CODES,
            parent=said(parent),
            nvidia_files=files,
        )
        assert parent.get("state") == "running", f"the CUDA process itself: {parent}"
        assert worker.get("ok"), f"get-state on a forked worker failed outright: {worker}"
        assert worker.get("state") is None, f"the driver gives the forked worker a CUDA state: {worker}"
    finally:
        child.kill()


def test_b_abstract_unix_sockets_of_a_cuda_process_through_checkpoint_and_restore(tmp_path: Path) -> None:
    """Whatever unix sockets a CUDA process holds, CRIU must carry (agent/criu/images.py skips the
    abstract ones when it makes socket directories). Abstract names live in the network namespace:
    a restored copy beside its frozen source in one namespace would collide, which is why the GPU
    suite gives every job its own. Asserted: the cycle lock, checkpoint, restore, unlock works in
    place and the device memory is read back whole; the sockets at each stage are recorded."""
    child = CudaChild(tmp_path)
    try:
        pid = child.pid
        seen = {"running": unix_sockets(pid)}
        frozen = ask(("lock", pid), ("checkpoint", pid))
        seen["checkpointed"] = unix_sockets(pid)
        back = ask(("restore", pid), ("unlock", pid), ("read_state", pid)) if ok(frozen) else []
        seen["restored and unlocked"] = unix_sockets(pid)
        total = child.device_sum() if ok(back) else None
        abstract = {stage: [s for s in socks if s.startswith("@")] for stage, socks in seen.items()}
        record_fact(
            "abstract unix sockets of a CUDA process",
            fake="none that matter: the fakes model no sockets; images.py skips abstract names and CRIU "
            "carries whatever there is",
            driver="; ".join(f"{stage}: {', '.join(a) or 'none'}" for stage, a in abstract.items()),
            agrees=not any(abstract.values()),
            unix_sockets=seen,
            calls={a["call"]: said(a) for a in [*frozen, *back]},
        )
        assert ok(frozen), frozen
        assert ok(back) and len(back) == 3, back
        assert back[-1]["state"] == "running", back
        assert total == child.first_sum, f"device memory after restore: sum {total}, before {child.first_sum}"
    finally:
        child.kill()


def test_c_the_restore_thread_is_named_while_the_checkpointed_process_is_stopped(tmp_path: Path) -> None:
    """A move's target asks for each CUDA process's restore thread while CRIU holds the restored
    tree stopped, then lets only that thread run during the CUDA restore (agent/migration/
    restore.py, agent/jobs/threadhold.py). Asserted: the driver answers then, with a thread of the
    process, and the restore under that hold works. Recorded: the thread's name and whether it is
    the last thread (the fake's choice), and what the driver names while the process runs."""
    child = CudaChild(tmp_path)
    try:
        pid = child.pid
        (running,) = ask(("restore_thread", pid))
        frozen = ask(("lock", pid), ("checkpoint", pid))
        assert ok(frozen), frozen
        os.kill(pid, signal.SIGSTOP)
        wait_stopped(pid)
        names = task_names(pid)
        stopped, state = ask(("restore_thread", pid), ("read_state", pid), timeout_s=30)
        tid = stopped.get("tid")
        last = max(names, default=0)
        record_fact(
            "restore thread of a stopped, checkpointed process",
            fake="answered while the process is SIGSTOPped; it is the process's last thread (highest TID)",
            driver=f"{said(stopped)}: "
            + (
                f"thread '{names[tid]}', {'the' if tid == last else 'not the'} highest TID of {len(names)}"
                if tid in names
                else "not a thread of the process"
            ),
            agrees=bool(stopped.get("ok")) and tid == last,
            while_running=said(running),
            same_as_while_running=running.get("tid") == tid,
            state_while_stopped=said(state),
            threads={str(t): n for t, n in names.items()},
        )
        assert stopped.get("ok"), f"no restore thread while stopped: {stopped}"
        assert tid in names, f"restore thread {tid} is not a thread of pid {pid}: {names}"

        with held([pid], {tid}):  # every thread in a ptrace stop but the restore thread
            (restored,) = ask(("restore", pid), timeout_s=30)
        os.kill(pid, signal.SIGCONT)
        unlocked, after = ask(("unlock", pid), ("read_state", pid)) if ok([restored]) else [restored] * 2
        total = child.device_sum() if after.get("state") == "running" else None
        record_fact(
            "CUDA restore while only the restore thread runs",
            fake="the restore needs only the restore thread to run (the fake checks that thread alone)",
            driver=f"restore {said(restored)}; unlock {said(unlocked)}; then {said(after)}",
            agrees=bool(restored["ok"] and unlocked["ok"]),
            device_sum_back=total == child.first_sum,
        )
        assert restored["ok"] and unlocked["ok"], (restored, unlocked)
        assert after["state"] == "running", after
        assert total == child.first_sum, f"device memory after restore: sum {total}, before {child.first_sum}"
    finally:
        child.kill()

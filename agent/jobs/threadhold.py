"""A restored tree held still while the CUDA driver's restore thread works in it.

CRIU restores a job stopped. Its CUDA state then comes back through a thread the driver keeps
inside each CUDA process (cuCheckpointProcessGetRestoreThreadId), which must run during the
restore. SIGCONT would let every thread run, so the job would make progress (compute, write
its logs, send from its address) before its node recorded this copy as the job's one. As
CRIU's own CUDA plugin does, the threads of each CUDA process are ptrace-seized instead; the
process is continued (its group stop ends, its threads stay in their ptrace stops) and only
the restore thread is let go, every signal blocked in it so that nothing stops it half-way.
`release()` stops it again, sends SIGSTOP and detaches: each thread takes the stop on its way
back to user space, so the tree is stopped as CRIU left it, and not one job instruction ran.

ptrace ties tracees to the tracing thread: a hold is taken and released on one thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import signal
import time
from collections.abc import Iterator

from agent.errors import FerryError

log = logging.getLogger(__name__)

PTRACE_CONT = 7
PTRACE_DETACH = 17
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_GETSIGMASK = 0x420A
PTRACE_SETSIGMASK = 0x420B
WALL = 0x40000000  # __WALL: wait for threads as well as processes
ALL_SIGNALS = (1 << 64) - 1  # the kernel leaves SIGKILL and SIGSTOP unblockable
#: How long a thread may take to report its stop (it is stopped or runs driver code: milliseconds).
STOP_WAIT_S = 10.0

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_libc.ptrace.restype = ctypes.c_long


class ThreadHoldError(FerryError):
    kind = "internal"


def _ptrace(request: int, tid: int, addr: int = 0, data: object = None) -> None:
    if _libc.ptrace(request, tid, addr or None, data) == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"ptrace({request:#x}, {tid}): {os.strerror(err)}")


def _sigmask(tid: int, new: int | None = None) -> int:
    """The thread's blocked signals (a tracee in a ptrace stop); set to `new` if given."""
    mask = ctypes.c_uint64(0 if new is None else new)
    request = PTRACE_GETSIGMASK if new is None else PTRACE_SETSIGMASK
    _ptrace(request, tid, ctypes.sizeof(mask), ctypes.byref(mask))
    return mask.value


def _wait_stop(tid: int, deadline: float) -> None:
    """Until the tracee reports a stop (bounded: a thread that never stops is named)."""
    while True:
        try:
            done, _status = os.waitpid(tid, WALL | os.WNOHANG)
        except ChildProcessError:
            return  # gone: nothing left to hold
        if done:
            return
        if time.monotonic() > deadline:
            raise ThreadHoldError(f"thread {tid} did not stop within {STOP_WAIT_S:.0f} s", step="restore")
        time.sleep(0.001)


def _let_run(tid: int) -> None:
    """PTRACE_CONT, again after each stop it reports at once (the notice that its group stop
    ended): until it has run a while without one."""
    for _ in range(100):
        _ptrace(PTRACE_CONT, tid)
        deadline = time.monotonic() + 0.02
        while time.monotonic() < deadline:
            done, _status = os.waitpid(tid, WALL | os.WNOHANG)
            if done:
                break
            time.sleep(0.001)
        else:
            return
    raise ThreadHoldError(f"thread {tid} keeps stopping; it cannot be let run", step="restore")


def threads(pid: int) -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except FileNotFoundError:
        return []


class ThreadHold:
    """The threads of `pids` seized and stopped, but for `running` (a restore thread each)."""

    def __init__(self, pids: list[int], running: set[int]) -> None:
        self.pids = pids
        self.seized: list[int] = []
        self.running: dict[int, int] = {}  # tid → its signal mask before the hold
        deadline = time.monotonic() + STOP_WAIT_S
        try:
            for pid in pids:
                for tid in threads(pid):
                    _ptrace(PTRACE_SEIZE, tid)
                    self.seized.append(tid)
                    _ptrace(PTRACE_INTERRUPT, tid)  # stopped or not, it reports a stop to us
                    _wait_stop(tid, deadline)
            if missing := running - set(self.seized):
                raise ThreadHoldError(
                    f"the CUDA restore thread(s) {sorted(missing)} are not threads of processes {pids}",
                    step="restore",
                )
            for pid in pids:  # its group stop ends; its threads stay in their ptrace stops
                os.kill(pid, signal.SIGCONT)
            for tid in sorted(running):
                self.running[tid] = _sigmask(tid)
                _sigmask(tid, ALL_SIGNALS)
                _let_run(tid)
        except BaseException:
            self.release()
            raise
        log.info("holding %d thread(s) of %s; %s run", len(self.seized), pids, sorted(self.running))

    def release(self) -> None:
        """Every thread back in a stop, detached: the tree stays stopped until SIGCONT."""
        deadline = time.monotonic() + STOP_WAIT_S
        for tid, mask in self.running.items():
            with contextlib.suppress(OSError, ThreadHoldError):
                _ptrace(PTRACE_INTERRUPT, tid)
                _wait_stop(tid, deadline)
                _sigmask(tid, mask)
        for pid in self.pids:  # also drops the SIGCONT the hold sent, if it is still pending
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        for tid in self.seized:
            try:  # SIGSTOP taken on its way out of the ptrace stop: the group stops, no code runs
                _ptrace(PTRACE_DETACH, tid, 0, signal.SIGSTOP)
            except OSError as e:
                if e.errno != errno.ESRCH:  # gone already
                    log.error("cannot detach thread %d: %s", tid, e)
        self.seized, self.running = [], {}


@contextlib.contextmanager
def held(pids: list[int], running: set[int]) -> Iterator[ThreadHold]:
    hold = ThreadHold(pids, running)
    try:
        yield hold
    finally:
        hold.release()

"""Every CUDA driver call with a bounded wait, and a durable note of each call that changes a
process's state while it is under way.

A checkpoint driver call blocks in the driver until the target process's restore thread has
done the work, and nothing in the API bounds it (only the lock takes a timeout). A wedged GPU
or a process that never lets its restore thread run would hang the move, the agent's graceful
stop and every later call with it. So each call runs on a worker thread and the caller waits
at most its bound (`Bounds`); past it the caller gets `CallTimedOut` and the process is
*stuck*: the call may still act on it, so every later call on that PID is refused at once
(not queued behind it) until the call returns, which is logged with its answer.

The calls that change a process's checkpoint state (lock, checkpoint, restore, unlock) are
journaled while in flight (`InFlight`: one durable file per call, written before the call and
removed once it returns). A file left by an agent that died names the call its death cut
short, the PID and when it began: recovery's undo reads each such process's state from the
driver (the move's journal says only that a call was under way), and the node records the
interrupted calls as events at start. get-state and the restore-thread query change nothing
and are not journaled.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from agent.durable import replace_file
from agent.errors import CudaCheckpointError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Our code for "the call did not return within its bound" (not a CUresult).
TIMED_OUT = -2
#: The calls that change a process's checkpoint state: journaled while in flight.
JOURNALED = frozenset({"lock", "checkpoint", "restore", "unlock"})


@dataclass(frozen=True)
class Bounds:
    """How long a caller waits for each driver call (`[cuda]` in the agent's config)."""

    #: checkpoint and restore copy a process's whole device memory (an H200 holds 141 GB).
    copy_s: float = 600.0
    #: Every other call: get-state, the restore-thread query, unlock, cuInit; a lock gets this
    #: on top of its own timeout, which the driver enforces.
    call_s: float = 60.0

    def of(self, action: str, lock_timeout_s: float = 0.0) -> float:
        if action in ("checkpoint", "restore"):
            return self.copy_s
        return self.call_s + (lock_timeout_s if action == "lock" else 0.0)


@dataclass(frozen=True)
class Interrupted:
    """A journaled call that an agent's death cut short."""

    pid: int
    action: str
    started: float  # wall-clock seconds
    node: str

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"CUDA {self.action} of pid {self.pid} (begun {when}) was in flight when the agent ended"


class InFlight:
    """The journal of state-changing driver calls under way: `<dir>/<pid>-<action>-<n>.json`.
    None as the directory keeps nothing (a tool that runs no moves)."""

    def __init__(self, directory: Path | None, node: str = "") -> None:
        self.dir = directory
        self.node = node
        self._seq = 0
        self._lock = threading.Lock()
        #: The files left by the agent that ran before this one, read before any call is made.
        self.left_over: list[Interrupted] = self._read_left_over()

    def _read_left_over(self) -> list[Interrupted]:
        if self.dir is None or not self.dir.is_dir():
            return []
        found = []
        for torn in self.dir.glob("*.json.tmp"):  # a record whose call was never made
            torn.unlink(missing_ok=True)
        for path in sorted(self.dir.glob("*.json")):
            try:
                raw = json.loads(path.read_text())
                pid, action, started = int(raw["pid"]), str(raw["action"]), float(raw["started"])
                found.append(Interrupted(pid, action, started, self.node))
            except (OSError, ValueError, KeyError, TypeError) as e:
                # Still evidence that some call was cut short: kept as such, never dropped silently.
                log.error("cuda: unreadable in-flight record %s (%s)", path, e)
                found.append(Interrupted(-1, f"call (unreadable record {path.name})", 0.0, self.node))
            path.unlink(missing_ok=True)
        return found

    def begin(self, pid: int, action: str) -> Path | None:
        if self.dir is None or action not in JOURNALED:
            return None
        with self._lock:
            self._seq += 1
            path = self.dir / f"{pid}-{action}-{os.getpid()}-{self._seq}.json"
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        record = {"pid": pid, "action": action, "started": time.time()}
        replace_file(path, json.dumps(record).encode())  # durable before the call is made
        return path

    @staticmethod
    def end(path: Path | None) -> None:
        if path is not None:
            path.unlink(missing_ok=True)  # losing this unlink only makes a restart say too much


class CallTimedOut(CudaCheckpointError):
    """A driver call that did not return within its bound; it may still act on the process."""

    def __init__(
        self, pid: int, action: str, cause: str, *, node: str = "", hint: str = "", refused: bool = False
    ) -> None:
        super().__init__(pid, action, TIMED_OUT, "no answer in time", node=node, hint=hint)
        self.cause = f"cuda {action} of pid {pid} {cause}"
        #: Never made: an earlier call on the process is still under way (else: this one is).
        self.refused = refused


class BoundedCalls:
    """Runs driver calls on worker threads and waits at most their bound (module docstring)."""

    def __init__(self, bounds: Bounds, in_flight: InFlight, node: str = "") -> None:
        self.bounds = bounds
        self.in_flight = in_flight
        self.node = node
        self._lock = threading.Lock()
        #: pid -> (action, monotonic start, the call's done-event): the call that ran past its bound.
        self._stuck: dict[int, tuple[str, float, threading.Event]] = {}
        self._then: dict[int, list[Callable[[], object]]] = {}  # pid -> what runs once it returns
        #: pid -> the thread running its `then`s: its own calls pass, everyone else's still wait.
        self._putting_back: dict[int, int] = {}

    def when_returned(self, pid: int, then: Callable[[], object]) -> None:
        """Run `then` once the call stuck on pid returns (at once if none is): how a freeze that
        gave up on a call puts the process back when the driver is done with it. Until it is done,
        no one else's call reaches the process."""
        with self._lock:
            if pid in self._stuck and pid not in self._putting_back:
                self._then.setdefault(pid, []).append(then)
                return
        _run_logged(then, pid)

    def stuck(self) -> dict[int, str]:
        """PID -> the call still under way on it past its bound."""
        with self._lock:
            return {pid: action for pid, (action, _, _) in self._stuck.items()}

    def run(self, pid: int, action: str, call: Callable[[], T], bound_s: float) -> T:
        with self._lock:
            if pid in self._stuck and self._putting_back.get(pid) != threading.get_ident():
                earlier, since, _ = self._stuck[pid]
                raise self._timed_out(
                    pid,
                    action,
                    f"refused: the driver's {earlier} call on it, begun "
                    f"{time.monotonic() - since:.0f} s ago, has not returned",
                    refused=True,
                )
        token = self.in_flight.begin(pid, action)
        done = threading.Event()
        outcome: dict[str, Any] = {}
        started = time.monotonic()

        def work() -> None:
            try:
                outcome["value"] = call()
            except BaseException as e:  # handed to the caller (or logged, if it gave up)
                outcome["error"] = e
            finally:
                InFlight.end(token)
                # Decided under the lock, as the caller decides: either it sees the call done, or
                # it marked the process stuck before this looks.
                with self._lock:
                    late = pid in self._stuck and self._stuck[pid][2] is done  # this call, not another
                    then = self._then.pop(pid, []) if late else []
                    if late:
                        self._putting_back[pid] = threading.get_ident()
                    done.set()
                if late:
                    log.error(
                        "cuda: %s of pid %d returned after %.0f s, long after its caller gave up: %s",
                        action,
                        pid,
                        time.monotonic() - started,
                        outcome.get("error", outcome.get("value")),
                    )
                    try:
                        for fn in then:  # still stuck for everyone else until they are done
                            _run_logged(fn, pid)
                    finally:
                        with self._lock:
                            self._stuck.pop(pid, None)
                            self._putting_back.pop(pid, None)

        threading.Thread(target=work, name=f"cuda-{action}-{pid}", daemon=True).start()
        if not done.wait(bound_s):
            with self._lock:
                gave_up = not done.is_set()
                if gave_up:
                    self._stuck[pid] = (action, started, done)
            if gave_up:
                cause = f"did not return within {bound_s:g} s; the call is still under way"
                raise self._timed_out(pid, action, cause)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def _timed_out(self, pid: int, action: str, cause: str, refused: bool = False) -> CallTimedOut:
        return CallTimedOut(
            pid,
            action,
            cause,
            refused=refused,
            node=self.node,
            hint=(
                "the GPU or its driver may be wedged (look for Xid errors in the kernel log and at "
                "`nvidia-smi`); the job's CUDA state is unknown until the call returns, so nothing "
                "else acts on the process; settle the move with `ferry resolve` once it has"
            ),
        )


def _run_logged(fn: Callable[[], object], pid: int) -> None:
    try:
        fn()
    except Exception:
        log.exception("cuda: putting pid %d back after its late call failed", pid)

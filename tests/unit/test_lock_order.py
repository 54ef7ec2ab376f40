"""The lock-order claims of docs/architecture.md ("Lock order"), checked on real code paths.

The section makes three claims that running code can refute:

1. no lock is held across a call to NVML, the CUDA driver or a peer, except
   `SourceRecovery._lock` (and, as the section says further down, a health pass's
   `HealthMonitor._pass_lock` across NVML);
2. where one lock is taken inside another, it follows the documented order
   (`SourceRecovery._lock` outermost, never inside another; `IncomingTable.lock` →
   `GpuLedger._lock` → `Quarantine._lock`; `HealthMonitor._pass_lock` → `HealthMonitor._lock`);
3. the independent locks (the registry's, self-healing's, the monitor's, the event
   log's, the PID probe's, the driver's init and call bookkeeping, the agent's moves) are never
   held while another listed lock is taken.

Two agents are built in process (AgentNode over the fake NVIDIA stack and FakeCriu, the
target served over gRPC on loopback), and each listed lock on them is swapped for a
`TrackedLock` that records, per thread, what is held and every nesting. The fakes at the
process's edges (the CUDA driver, NVML, the peer client) are wrapped from outside by a
`Boundary` that records any call made while the calling thread holds a tracked lock. Then
real paths run through them once (a module fixture, 2-3 s): a CUDA job's whole pre-copy
move, a target's prepare/abort/expire, `ferry run --gpu` refused by a quarantine and then
granted through the ledger, a health pass with `ferry gpus --clear`, a PID probe, and a source's
recovery of a move cut off mid-dump. The tests read what was recorded. Findings are recorded,
not raised, so no `except Exception` in the product can swallow one.

What running code cannot show (that GetMigration only reads under the table lock, that only decisions and
journal writes happen under it) is left to review.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fake_cuda import A100, CHECKPOINTED, GIB, GPU0, GPU1, CudaWorld, FakeGpu, fake_cuda_jobs
from fakes import SLEEP, FakeCriu, launched_record, wait_for, wait_stopped

from agent import client
from agent.cuda.calls import BoundedCalls, Bounds, InFlight
from agent.cuda.jobs import IN_FLIGHT_DIR
from agent.errors import RefusedError
from agent.health.monitor import HealthMonitor
from agent.jobs.record import JobState, OnDegraded, Priority
from agent.migration import target as incoming
from agent.migration.journal import SOURCE, MigrationRecord
from agent.migration.model import Method, MigrationResult
from agent.rpc import pb
from agent.service.node import AgentNode
from agent.service.serve import create_server
from agent.testing.fake_selftest import sound_selftest
from agent.testing.nvml_replay import FakeClock, ReplayNvml, Timeline

# -- the documented order --------------------------------------------------------------------

TABLE = "IncomingTable.lock"
LEDGER = "GpuLedger._lock"
QUARANTINE = "Quarantine._lock"
REGISTRY = "JobRegistry._lock"
RECOVERY = "SourceRecovery._lock"
HEALING = "SelfHealing._lock"
PASS = "HealthMonitor._pass_lock"
MONITOR = "HealthMonitor._lock"
EVENTS = "EventLog._lock"
PROBE = "CudaJobs._probe_lock"
INIT = "CudaDriver._init_lock"
CALLS = "BoundedCalls._lock"
IN_FLIGHT = "InFlight._lock"
MOVES = "AgentNode._moves_lock"
ALL_LOCKS = frozenset(
    {TABLE, LEDGER, QUARANTINE, REGISTRY, RECOVERY, HEALING, PASS, MONITOR, EVENTS, PROBE, INIT, CALLS}
    | {IN_FLIGHT, MOVES}
)

#: (held, taken): the only nestings the section allows (0 over any, 1 → 2 → 3, the monitor's pair).
ALLOWED = frozenset(
    {(TABLE, LEDGER), (TABLE, QUARANTINE), (LEDGER, QUARANTINE), (PASS, MONITOR)}
    | {(RECOVERY, lock) for lock in ALL_LOCKS - {RECOVERY}}
)
NVML, DRIVER, PEER = "NVML", "CUDA driver", "peer"
#: Boundary → locks the section lets be held across it.
EXEMPT = {NVML: {RECOVERY, PASS}, DRIVER: {RECOVERY}, PEER: {RECOVERY}}


# -- the checker -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    what: str  # "A -> B" for a nesting, the call for a boundary
    held: tuple[str, ...]  # the tracked locks the thread held
    stack: str

    def __str__(self) -> str:
        return f"{self.what} while holding {', '.join(self.held)}\n{self.stack}"


def _stack() -> str:
    """The caller's stack, ferry's frames and this file's (not pytest's, gRPC's or threading's)."""
    frames = [f for f in traceback.extract_stack()[:-3] if "site-packages" not in f.filename]
    frames = [f for f in frames if not f.filename.endswith("threading.py") and f.filename[0] != "<"]
    return "".join(traceback.format_list(frames[-14:]))


class Tracker:
    """Per thread, the tracked locks held; every nesting and boundary call, as seen."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._mu = threading.Lock()  # guards what is recorded; never tracked itself
        self.acquired: Counter[str] = Counter()
        self.nestings: dict[tuple[str, str], Finding] = {}  # every (held, taken) seen, first stack
        self.boundary_calls: Counter[str] = Counter()  # per boundary kind
        self.boundary: dict[tuple[str, tuple[str, ...]], Finding] = {}  # calls under a lock, first stack

    def held(self) -> list[TrackedLock]:
        if not hasattr(self._local, "held"):
            self._local.held = []
        return self._local.held

    def names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(lock.name for lock in self.held()))

    # Called by TrackedLock.
    def before(self, lock: TrackedLock) -> None:
        """About to take `lock`: one nesting per other lock this thread holds."""
        outer = [h for h in dict.fromkeys(self.held()) if h is not lock]  # re-entry is no nesting
        if not outer:
            return
        held = self.names()
        with self._mu:
            for h in outer:
                key = (h.name, lock.name)
                if key not in self.nestings:
                    self.nestings[key] = Finding(f"{h.name} -> {lock.name}", held, _stack())

    def took(self, lock: TrackedLock, times: int = 1) -> None:
        self.held().extend([lock] * times)
        with self._mu:
            self.acquired[lock.name] += 1

    def let_go(self, lock: TrackedLock, every: bool = False) -> int:
        held = self.held()
        n = held.count(lock)
        if every:
            held[:] = [h for h in held if h is not lock]
            return n
        if n:  # the innermost hold of it
            del held[len(held) - 1 - held[::-1].index(lock)]
        return 1

    def holds(self, lock: TrackedLock) -> bool:
        return lock in self.held()

    # Called by Boundary.
    def at_boundary(self, kind: str, call: str) -> None:
        held = tuple(n for n in self.names() if n not in EXEMPT[kind])
        with self._mu:
            self.boundary_calls[kind] += 1
            if held and (call, held) not in self.boundary:
                self.boundary[(call, held)] = Finding(f"{kind} call {call}", self.names(), _stack())

    # What the tests read.
    def nested(self) -> dict[tuple[str, str], Finding]:
        with self._mu:  # a copy: watcher threads may still take locks
            return dict(self.nestings)

    def violations(self) -> dict[tuple[str, str], Finding]:
        return {k: f for k, f in self.nested().items() if k not in ALLOWED}

    def calls_under_locks(self) -> dict[tuple[str, tuple[str, ...]], Finding]:
        with self._mu:
            return dict(self.boundary)


class TrackedLock:
    """threading.Lock / RLock (wrapping one) that tells a Tracker what it does; also a
    Condition's lock (`_is_owned`, `_release_save`, `_acquire_restore`), so a wait lets go."""

    def __init__(self, inner: Any, name: str, tracker: Tracker) -> None:
        self._inner = inner
        self.name = name
        self._tracker = tracker

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if blocking:  # a nesting counts before it may block: a deadlock would hide it
            self._tracker.before(self)
        ok = bool(self._inner.acquire(blocking, timeout))
        if ok:
            if not blocking:
                self._tracker.before(self)
            self._tracker.took(self)
        return ok

    def release(self) -> None:
        self._tracker.let_go(self)
        self._inner.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def locked(self) -> bool:
        if hasattr(self._inner, "locked"):
            return bool(self._inner.locked())
        if self._inner.acquire(False):  # an RLock before 3.13: held by another thread?
            self._inner.release()
            return False
        return True

    def _is_owned(self) -> bool:
        return self._tracker.holds(self)

    def _release_save(self) -> tuple[Any, int]:
        times = self._tracker.let_go(self, every=True)
        if hasattr(self._inner, "_release_save"):  # an RLock: all its levels at once
            return self._inner._release_save(), times
        self._inner.release()
        return None, times

    def _acquire_restore(self, saved: tuple[Any, int]) -> None:
        state, times = saved
        self._tracker.before(self)  # taken again after a wait: a nesting like any other
        if hasattr(self._inner, "_acquire_restore"):
            self._inner._acquire_restore(state)
        else:
            self._inner.acquire()
        self._tracker.took(self, times)

    def __repr__(self) -> str:
        return f"<TrackedLock {self.name} {self._inner!r}>"


_LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))


def track(obj: Any, attr: str, name: str, tracker: Tracker) -> TrackedLock:
    """Swap obj.attr (a Lock or RLock, or a Condition over a fresh RLock) for a tracked one."""
    lock = getattr(obj, attr)
    if isinstance(lock, threading.Condition):
        tracked = TrackedLock(threading.RLock(), name, tracker)
        setattr(obj, attr, threading.Condition(tracked))  # type: ignore[arg-type]
        return tracked
    assert isinstance(lock, _LOCK_TYPES), f"{name} is a {type(lock).__name__}, not a lock"
    tracked = TrackedLock(lock, name, tracker)
    setattr(obj, attr, tracked)
    return tracked


class Boundary:
    """A fake (or client) at the process's edge, wrapped from outside: every call whose name
    `is_call` accepts is recorded, with the locks its calling thread holds, then delegated."""

    def __init__(self, inner: Any, kind: str, tracker: Tracker, is_call: Callable[[str], bool]) -> None:
        self._inner, self._kind, self._tracker, self._is_call = inner, kind, tracker, is_call

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if isinstance(value, type) or not callable(value) or not self._is_call(name):
            return value  # constants, exception classes, argument types

        def checked(*args: Any, **kwargs: Any) -> Any:
            self._tracker.at_boundary(self._kind, name)
            return value(*args, **kwargs)

        return checked


def _nvml_call(name: str) -> bool:
    return name.startswith("nvml")


def _driver_call(name: str) -> bool:
    return name.startswith("cu")


def _peer_call(name: str) -> bool:
    return not name.startswith("_")


def instrument(node: AgentNode, tracker: Tracker, nvml_world: dict[str, Any]) -> None:
    """Track every listed lock of an agent and wrap its boundaries (after construction, before use)."""
    table = node.targets.table
    track(table, "lock", TABLE, tracker)
    table.changed = threading.Condition(table.lock)  # type: ignore[arg-type]  # over the tracked lock
    track(node.gpus, "_lock", LEDGER, tracker)
    assert node.gpus.quarantine is node.quarantine
    track(node.quarantine, "_lock", QUARANTINE, tracker)
    track(node.registry, "_lock", REGISTRY, tracker)
    track(node.recovery, "_lock", RECOVERY, tracker)
    track(node.healing, "_lock", HEALING, tracker)
    track(node.events, "_lock", EVENTS, tracker)
    track(node.cuda, "_probe_lock", PROBE, tracker)
    track(node.cuda.driver, "_init_lock", INIT, tracker)
    track(node.cuda.driver.calls, "_lock", CALLS, tracker)
    track(node.cuda.driver.calls.in_flight, "_lock", IN_FLIGHT, tracker)
    track(node, "_moves_lock", MOVES, tracker)
    # Health: a monitor over replayed NVML, built as the agent builds its own.
    nv = ReplayNvml.from_timeline(Timeline(nvml_world), FakeClock())
    node.monitor = HealthMonitor(
        Boundary(nv, NVML, tracker, _nvml_call), node=node.node, on_poll=node.healing.on_poll
    )
    track(node.monitor, "_pass_lock", PASS, tracker)
    track(node.monitor, "_lock", MONITOR, tracker)
    # The inventory's NVML and the CUDA driver (fake_cuda), wrapped from outside.
    node.cuda.nvml.module = Boundary(node.cuda.nvml.module, NVML, tracker, _nvml_call)
    # The fake driver is called on BoundedCalls' worker thread (where no lock may be held
    # either); its caller waits for the call, so the caller's locks are checked at the handover.
    driver = node.cuda.driver
    driver._driver = Boundary(driver._driver, DRIVER, tracker, _driver_call)
    run = driver.calls.run

    def handed_over(pid: int, action: str, call: Callable[[], Any], bound_s: float) -> Any:
        tracker.at_boundary(DRIVER, f"{action} (handed to BoundedCalls.run)")
        return run(pid, action, call, bound_s)

    driver.calls.run = handed_over  # type: ignore[method-assign]


# -- the scenario ----------------------------------------------------------------------------


def _nvml_world(*uuids: str) -> dict[str, Any]:
    return {"driver_version": "580.65.06", "gpus": [{"uuid": u, "name": "NVIDIA H200"} for u in uuids]}


def _sleeper(tmp: Path, name: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    out, err = tmp / f"{name}.out", tmp / f"{name}.err"
    out.write_text("step 1 loss 0.9\n")
    err.write_text("")
    with open(out, "ab") as o, open(err, "ab") as e:
        proc = subprocess.Popen(
            [SLEEP, "60"], stdin=subprocess.DEVNULL, stdout=o, stderr=e, start_new_session=True
        )
    return proc, out, err


@dataclass
class Run:
    tracker: Tracker
    result: MigrationResult
    lease_gpu: str  # where the target put the moved job's GPU
    refusal: str  # `ferry run --gpu` on a quarantined GPU


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    tmp = tmp_path_factory.mktemp("lockorder")
    tracker = Tracker()
    real_peer = client.PeerClient
    procs: list[subprocess.Popen[bytes]] = []
    criu: list[FakeCriu] = []
    with contextlib.ExitStack() as stack:
        mp = stack.enter_context(pytest.MonkeyPatch.context())
        mp.delenv("FERRY_FAULTS", raising=False)
        mp.setattr(incoming, "RESUME_LOOK_S", 0.2)
        # Every peer an agent dials (moves, recovery, healing) is checked at each call.
        mp.setattr(
            client,
            "PeerClient",
            lambda address, dial: Boundary(real_peer(address, dial), PEER, tracker, _peer_call),
        )

        def agent(node: str, world: CudaWorld, gpus: list[str]) -> AgentNode:
            c = FakeCriu(node)
            c.cuda_world = world
            criu.append(c)
            state = tmp / node / "state"

            def make_cuda(ledger: Any) -> Any:
                cuda_jobs = fake_cuda_jobs(world, node, ledger=ledger)[0]
                # Journaled in flight, as the agent's own (host_cuda_jobs): InFlight takes its lock.
                in_flight = InFlight(state / IN_FLIGHT_DIR, node)
                cuda_jobs.driver.calls = BoundedCalls(Bounds(), in_flight, node)
                return cuda_jobs

            svc = AgentNode(
                state, node, tmp / node / "staging", criu=c, make_cuda=make_cuda, selftest=sound_selftest
            )
            instrument(svc, tracker, _nvml_world(*gpus))
            return svc

        src_world = CudaWorld([FakeGpu(GPU0), FakeGpu(GPU1)])
        dst_world = CudaWorld([FakeGpu(A100, name="NVIDIA H200"), FakeGpu(GPU1)])
        src = agent("nodea", src_world, [GPU0, GPU1])
        dst = agent("nodeb", dst_world, [A100, GPU1])
        server, port = create_server("127.0.0.1:0", dst, max_workers=8)
        server.start()
        stack.callback(lambda: server.stop(None).wait())
        for c in criu:
            stack.callback(c.cleanup)
        stack.callback(lambda: [(p.kill(), p.wait(10)) for p in procs])
        dst_addr = f"127.0.0.1:{port}"

        # 1. A CUDA job's whole pre-copy move, through the target's quarantine in its ledger.
        proc, out, err = _sleeper(tmp, "train")
        procs.append(proc)
        src_world.add_cuda_process(proc.pid, [GPU0], bytes_per_gpu=GIB)
        src.registry.save(launched_record("train", proc, out, err))
        assert dst.gpus.quarantine_gpu(A100, "test: keep the move off it")
        items = list(src.migrate("train", dst_addr, Method.PRE_COPY))
        result = items[-1]
        assert isinstance(result, MigrationResult)
        assert src.registry.get("train").state is JobState.MOVED
        moved = dst_world.procs[dst.registry.get("train").pid]
        lease_gpu = moved.gpus[0]

        # 2. A target's admission, prepare, status, abort and expiry.
        need = pb.GpuNeed(uuid="GPU-x", name="NVIDIA H200", memory_bytes=GIB)
        req = pb.PrepareRequest(
            migration_id="aa01",
            job="other",
            source_node="nodea",
            estimated_bytes=1,
            gpus=[need],
            cuda_driver="580.65.06",
        )
        lease = dst.targets.prepare(req)
        assert [p.new_uuid for p in lease.gpu_map] == [GPU1]  # A100 stays quarantined
        assert dst.targets.status("aa01") == pb.TARGET_STATE_PREPARED
        dst.targets.abort("aa01", "test")
        wait_for(lambda: dst.targets.status("aa01") == pb.TARGET_STATE_ABORTED, what="aa01 aborted")
        dst.targets.expire()

        # 3. `ferry run --gpu`: refused on a quarantined GPU (read under the ledger's lock), then
        # granted through the ledger and launched under the registry's lock.
        assert src.gpus.quarantine_gpu(GPU1, "test")
        with pytest.raises(RefusedError) as refused:
            src.run_job("gpujob", [SLEEP, "60"], "/", [], Priority.NORMAL, OnDegraded.ALERT, [GPU1])
        src.run_job("gpujob", [SLEEP, "60"], "/", [], Priority.NORMAL, OnDegraded.ALERT, [GPU0])
        stack.callback(lambda: src.registry.stop("gpujob", 1))

        # 4. A health pass, and `ferry gpus --clear` (monitor, ledger, quarantine, healing, events).
        src.monitor.poll()
        g, entry = src.clear_gpu(GPU1)
        assert entry is not None and g is not None

        # 5. The PID probe (a CUDA process NVML does not list): refused, probed outside the lock.
        src_world.add_cuda_process(999_999, [], bytes_per_gpu=0)
        with pytest.raises(RefusedError, match="NVML lists it on no GPU"):
            src.cuda.inspect([999_999])

        # 6. Recovery of a move cut off mid-dump: the target is told to abort, the copy resumes.
        proc2, out2, err2 = _sleeper(tmp, "train2")
        procs.append(proc2)
        rec = launched_record("train2", proc2, out2, err2)
        rec.state, rec.migration_id = JobState.MIGRATING, "bb01"
        src.registry.save(rec)
        src_world.add_cuda_process(proc2.pid, [GPU0], bytes_per_gpu=GIB)
        src_world.procs[proc2.pid].state = CHECKPOINTED
        src.gpus.hold_frozen([proc2.pid], {GPU0: GIB})
        os.kill(proc2.pid, signal.SIGSTOP)
        wait_stopped(proc2.pid)
        src.journal.save(
            MigrationRecord(
                "bb01", SOURCE, "train2", "dumping", peer=dst_addr, pids=[proc2.pid], cuda_pids=[proc2.pid]
            )
        )
        assert src.recovery.recover() != []
        assert src.registry.get("train2").state is JobState.RUNNING
        assert src.gpus.frozen_bytes() == {}
        assert dst.targets.status("bb01") == pb.TARGET_STATE_ABORTED  # the tombstone

        yield Run(tracker, result, lease_gpu, str(refused.value))


def _report(findings: dict[Any, Finding]) -> str:
    return "\n\n".join(str(f) for f in findings.values())


# -- the checker works ---------------------------------------------------------------------


def test_the_checker_records_a_reversed_nesting_and_a_call_under_a_lock() -> None:
    tracker = Tracker()

    class Parts:
        table, ledger = threading.Lock(), threading.RLock()

    parts = Parts()
    table, ledger = track(parts, "table", TABLE, tracker), track(parts, "ledger", LEDGER, tracker)
    with table, ledger, ledger:  # the documented way round; an RLock re-entered
        pass
    assert tracker.violations() == {}
    with ledger, table:  # the wrong way round
        assert table.locked() and tracker.holds(table)
    assert list(tracker.violations()) == [(LEDGER, TABLE)]
    assert "test_lock_order.py" in tracker.violations()[(LEDGER, TABLE)].stack
    assert not table.locked() and tracker.held() == []

    # A Condition's wait lets go of its tracked lock, and takes it back.
    cond = threading.Condition(table)  # type: ignore[arg-type]
    with cond:
        assert cond.wait(0.01) is False
        assert tracker.names() == (TABLE,)
    assert tracker.held() == []

    peer = Boundary(_SilentPeer(), PEER, tracker, _peer_call)
    peer.status("m1")
    assert tracker.boundary == {}
    with ledger:
        peer.status("m1")
    assert [f.held for f in tracker.boundary.values()] == [(LEDGER,)]
    assert tracker.boundary_calls[PEER] == 2


class _SilentPeer:
    def status(self, mid: str) -> int:
        return pb.TARGET_STATE_UNKNOWN


# -- the claims --------------------------------------------------------------------------------


def test_the_paths_ran_and_every_listed_lock_was_taken(run: Run) -> None:
    assert run.result.gpu_bytes == GIB and run.lease_gpu == GPU1  # the quarantined A100 was avoided
    assert "is quarantined" in run.refusal
    never = ALL_LOCKS - set(run.tracker.acquired)
    assert not never, f"never taken: {sorted(never)}"
    for kind in (NVML, DRIVER, PEER):
        assert run.tracker.boundary_calls[kind] > 0, f"no {kind} call was checked"


def test_the_documented_nestings_happen(run: Run) -> None:
    """Not vacuous: the order the section gives is taken on these paths (the table over the
    quarantine is allowed but no path takes it)."""
    assert {(TABLE, LEDGER), (LEDGER, QUARANTINE), (PASS, MONITOR)} <= set(run.tracker.nested())


def test_nestings_follow_the_documented_order(run: Run) -> None:
    """Every nesting is recovery's over another, 1 -> 2 -> 3 or the monitor's pair; the
    independent locks nest nothing."""
    wrong = run.tracker.violations()
    assert not wrong, _report(wrong)


def test_prepare_decides_before_it_takes_the_table_lock(run: Run) -> None:
    """Every ledger decision reads the quarantine under the ledger's lock, so one made under
    the table's lock would show as the table over the quarantine: none is."""
    assert (TABLE, QUARANTINE) not in run.tracker.nested()


def test_no_boundary_call_is_made_under_a_lock(run: Run) -> None:
    """cuInit included: CudaDriver._init_lock guards the one-time import, not the call."""
    wrong = run.tracker.calls_under_locks()
    assert not wrong, _report(wrong)


def test_source_recovery_lock_is_the_outermost(run: Run) -> None:
    """Taken before the others (a settlement's rollback takes the registry's and the ledger's),
    never inside another."""
    nested = run.tracker.nested()
    inside = {k: f for k, f in nested.items() if k[1] == RECOVERY}
    assert not inside, _report(inside)
    assert {(RECOVERY, REGISTRY), (RECOVERY, LEDGER)} <= set(nested)  # the recovery path ran

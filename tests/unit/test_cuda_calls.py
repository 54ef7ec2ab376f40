"""Every CUDA driver call bounded in time and journaled while in flight (agent.cuda.calls).

The fake driver can make a call wait until the test lets it go (`FakeDriver.hang`), as a call
into a wedged driver does; the bounds here are fractions of a second so that a stuck call
shows without slowing the suite.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest
from fake_cuda import CHECKPOINTED, GPU0, LOCKED, RUNNING, CudaWorld, FakeDriver, FakeGpu, fake_cuda_jobs
from fakes import FakeCriu, wait_for, wait_running
from test_migrate_cuda import TwoNodes, nodes  # noqa: F401 - the fixture

from agent.cuda import driver as cuda
from agent.cuda.calls import BoundedCalls, Bounds, CallTimedOut, InFlight
from agent.cuda.driver import CudaDriver
from agent.errors import MigrationAbortedError
from agent.jobs.record import JobState
from agent.service.node import AgentNode
from agent.testing.fake_selftest import sound_selftest

PID = 4100
QUICK = Bounds(copy_s=0.3, call_s=0.3)


def calls_in(directory: Path | None, bounds: Bounds = QUICK) -> BoundedCalls:
    return BoundedCalls(bounds, InFlight(directory, "nodea"), "nodea")


def driver_with(tmp_path: Path) -> tuple[CudaDriver, FakeDriver, CudaWorld, Path]:
    world = CudaWorld([FakeGpu(GPU0)])
    world.add_cuda_process(PID, [GPU0])
    fake = FakeDriver(world)
    journal = tmp_path / "cuda-calls"
    return CudaDriver(fake, "nodea", calls=calls_in(journal)), fake, world, journal


def test_a_state_changing_call_is_journaled_while_in_flight_and_only_then(tmp_path: Path) -> None:
    drv, fake, _world, journal = driver_with(tmp_path)
    gate = fake.hang["lock"] = threading.Event()
    t = threading.Thread(target=drv.lock, args=(PID, 0.1))
    t.start()
    wait_for(lambda: any(journal.glob("*.json")), what="the lock's in-flight record")
    (record,) = journal.glob("*.json")
    assert json.loads(record.read_text())["action"] == "lock"
    assert json.loads(record.read_text())["pid"] == PID
    gate.set()
    t.join(5)
    assert list(journal.iterdir()) == []  # gone once the call returned
    assert drv.state(PID) is cuda.ProcessState.LOCKED
    assert list(journal.iterdir()) == []  # get-state changes nothing: never journaled


def test_a_call_past_its_bound_times_out_and_the_process_counts_as_stuck(tmp_path: Path, caplog) -> None:
    drv, fake, world, journal = driver_with(tmp_path)
    world.add_cuda_process(PID + 1, [GPU0])
    drv.lock(PID)
    gate = fake.hang["checkpoint"] = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(CallTimedOut) as ei:
        drv.checkpoint(PID)
    assert time.monotonic() - t0 < 2.0
    err = ei.value
    assert err.step == "cuda checkpoint" and err.node == "nodea" and err.pid == PID
    assert "did not return within 0.3 s" in str(err) and "Xid" in err.hint
    assert len(list(journal.glob("*.json"))) == 1  # still in flight: its record stays
    assert drv.calls.stuck() == {PID: "checkpoint"}

    # Nothing else acts on the stuck process; the call is not even made.
    made = len(fake.calls)
    with pytest.raises(CallTimedOut, match=r"refused: the driver's checkpoint call on it, begun \d+ s ago"):
        drv.state(PID)
    assert len(fake.calls) == made
    drv.lock(PID + 1)  # another process is not held up

    caplog.set_level(logging.ERROR, logger="agent.cuda.calls")
    gate.set()  # the driver finishes the call after all
    wait_for(lambda: not drv.calls.stuck(), what="the late return")
    assert world.state(PID) == CHECKPOINTED
    assert list(journal.glob("*.json")) == []
    assert any("returned after" in r.getMessage() for r in caplog.records)
    assert drv.state(PID) is cuda.ProcessState.CHECKPOINTED  # usable again


def test_errors_of_the_call_itself_reach_the_caller_unchanged(tmp_path: Path) -> None:
    drv, fake, _world, _journal = driver_with(tmp_path)
    fake.no_context = "undecodable"  # the bindings raise ValueError on the worker thread
    reading = drv.read_state(PID + 99)
    assert reading.state is None and reading.code == cuda.UNDECODABLE


def test_a_frozen_job_whose_checkpoint_hangs_is_put_back_when_the_call_returns(tmp_path: Path) -> None:
    drv, fake, world, _journal = driver_with(tmp_path)
    fake.hang["checkpoint"] = gate = threading.Event()
    with pytest.raises(CallTimedOut) as ei:
        cuda.freeze(drv, [PID], 1.0, {})
    assert "put back once the call returns" in ei.value.cause
    assert world.state(PID) == LOCKED  # the call has not acted yet
    gate.set()
    # The late checkpoint acts, then the freeze's deferred undo restores and unlocks.
    wait_for(lambda: world.state(PID) == RUNNING, what="the process put back after the late return")
    assert fake.actions()[-2:] == ["restore", "unlock"]


def test_records_left_by_an_agent_that_died_mid_call_are_read_once_at_start(tmp_path: Path) -> None:
    journal = tmp_path / "cuda-calls"
    before = InFlight(journal, "nodea")
    before.begin(PID, "checkpoint")  # the agent dies here: its record is never removed
    assert before.begin(PID, "get-state") is None  # read-only calls leave none
    (journal / "junk.json").write_text("{not json")
    (journal / "torn.json.tmp").write_text("{}")  # a record whose call was never made

    after = InFlight(journal, "nodea")
    found = {(c.pid, c.action) for c in after.left_over}
    assert (PID, "checkpoint") in found
    assert any(c.pid == -1 and "unreadable record junk.json" in c.action for c in after.left_over)
    assert len(after.left_over) == 2
    assert "CUDA checkpoint of pid 4100" in next(c for c in after.left_over if c.pid == PID).describe()
    assert list(journal.iterdir()) == []
    assert InFlight(journal, "nodea").left_over == []


def test_the_agent_records_an_interrupted_call_as_an_event(tmp_path: Path) -> None:
    state = tmp_path / "state"
    InFlight(state / "cuda-calls", "nodea").begin(PID, "restore")
    world = CudaWorld([FakeGpu(GPU0)])

    def make_cuda(ledger: object) -> object:
        return fake_cuda_jobs(world, ledger=ledger, calls=calls_in(state / "cuda-calls"))[0]

    node = AgentNode(
        state,
        "nodea",
        tmp_path / "staging",
        criu=FakeCriu("nodea"),
        make_cuda=make_cuda,
        selftest=sound_selftest,
    )
    alerts = [e.message for e in node.events.recent()]
    assert any("CUDA restore of pid 4100" in m and "was in flight when the agent ended" in m for m in alerts)


def test_a_move_whose_cuda_checkpoint_hangs_gives_up_in_bound_and_the_job_goes_on(
    nodes: TwoNodes,  # noqa: F811 - the fixture
) -> None:
    nodes.src_cuda.driver.calls = calls_in(None)
    gate = nodes.src_drv.hang["checkpoint"] = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(MigrationAbortedError, match=r"did not return within 0\.3 s"):
        nodes.migration().run()
    assert time.monotonic() - t0 < 10
    assert nodes.src_criu.dumps == []  # nothing was dumped: the job never left
    assert nodes.job.state is JobState.RUNNING
    gate.set()
    wait_for(lambda: nodes.src_world.state(nodes.pid) == RUNNING, what="CUDA put back after the late return")
    wait_running(nodes.pid)


def test_the_process_stays_refused_to_others_until_its_late_undo_is_done(tmp_path: Path) -> None:
    """The undo that runs after a late return owns the process: a new move's call made meanwhile
    must not reach it (the undo would then act on that move's process)."""
    drv, fake, _world, _journal = driver_with(tmp_path)
    drv.lock(PID)
    gate = fake.hang["checkpoint"] = threading.Event()
    with pytest.raises(CallTimedOut):
        drv.checkpoint(PID)
    in_undo, finish = threading.Event(), threading.Event()
    seen: list[object] = []

    def undo() -> None:
        seen.append(drv.state(PID))  # the undo's own calls pass
        in_undo.set()
        finish.wait(5)

    drv.calls.when_returned(PID, undo)
    gate.set()
    assert in_undo.wait(5) and seen == [cuda.ProcessState.CHECKPOINTED]
    with pytest.raises(CallTimedOut, match="refused"):
        drv.state(PID)  # anyone else's still waits
    finish.set()
    wait_for(lambda: not drv.calls.stuck(), what="the undo to finish")
    assert drv.state(PID) is cuda.ProcessState.CHECKPOINTED


def test_a_driver_that_does_not_say_what_it_can_do_is_asked_again(tmp_path: Path) -> None:
    """No answer is not "no checkpoint API": the probe is not cached, and once the driver
    answers the node can move CUDA jobs again."""
    world = CudaWorld([FakeGpu(GPU0)])
    fake = FakeDriver(world)
    real, gate = fake.cuGetProcAddress, threading.Event()
    fake.cuGetProcAddress = lambda *a: (gate.wait(), real(*a))[1]  # type: ignore[method-assign]
    drv = CudaDriver(fake, "nodea", calls=calls_in(None))
    first = drv.probe()
    assert not first.checkpoint and "did not say what it can do" in first.detail
    gate.set()
    wait_for(lambda: not drv.calls.stuck(), what="the late answer")
    assert drv.probe().checkpoint

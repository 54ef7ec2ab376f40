"""The state machines' tables, walked: every pair of states is allowed exactly when its table says,
every state is reachable and can end, and each docstring names every state of its machine."""

from __future__ import annotations

import itertools
import re

import pytest

from agent.compat import StrEnum
from agent.jobs.record import JOB_TRANSITIONS, JobKind, JobRecord, JobState
from agent.jobs.registry import JobRegistry
from agent.migration.states import (
    MAYBE_SENT,
    NOT_SENT,
    SOURCE_TRANSITIONS,
    TARGET_TRANSITIONS,
    CudaLeft,
    MigrationState,
    TargetState,
    cuda_left,
)
from agent.rpc import pb
from agent.statemachine import IllegalTransitionError, Transitions

MACHINES: list[tuple[type[StrEnum], Transitions, StrEnum]] = [
    (MigrationState, SOURCE_TRANSITIONS, MigrationState.PREPARING),
    (TargetState, TARGET_TRANSITIONS, TargetState.PREPARED),
    (JobState, JOB_TRANSITIONS, JobState.RUNNING),
]
IDS = [m[0].__name__ for m in MACHINES]


@pytest.mark.parametrize(("enum", "table", "start"), MACHINES, ids=IDS)
def test_every_pair_is_allowed_exactly_when_the_table_says(enum, table, start) -> None:
    assert set(table.table) == set(enum), "the table has a row for every state"
    for old, new in itertools.product(enum, enum):
        if new in table.table[old]:
            assert table.check(old, new, "x") is new
        else:
            illegal = f"{old.value} → {new.value} is not a transition"
            with pytest.raises(IllegalTransitionError, match=illegal):
                table.check(old, new, "x")


@pytest.mark.parametrize(("enum", "table", "start"), MACHINES, ids=IDS)
def test_every_state_is_reachable_and_every_path_can_end(enum, table, start) -> None:
    reached, todo = {start}, [start]
    while todo:
        for nxt in table.table[todo.pop()]:
            if nxt not in reached:
                reached.add(nxt)
                todo.append(nxt)
    # A preempted job is reached through CHECKPOINTED; a job record is created RUNNING.
    assert reached == set(enum)
    finals = {s for s in enum if table.final(s)}
    assert finals, "a machine with no final state never ends"
    for s in enum:
        seen, todo = {s}, [s]
        while todo:
            for nxt in table.table[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        assert seen & finals, f"{s.value} can never end"


@pytest.mark.parametrize(("enum", "table", "start"), MACHINES, ids=IDS)
def test_each_docstring_names_every_state(enum, table, start) -> None:
    doc = enum.__doc__ or ""
    missing = [s.name for s in enum if not re.search(rf"\b{s.name}\b", doc)]
    assert not missing, f"{enum.__name__}'s docstring does not name {missing}"


def test_recovery_sorts_every_open_source_state_one_way() -> None:
    finals = {s for s in MigrationState if SOURCE_TRANSITIONS.final(s)}
    assert NOT_SENT | MAYBE_SENT | finals == set(MigrationState)
    assert not NOT_SENT & MAYBE_SENT
    # Commit is sent only from RESTORING on: nothing before it may reach COMMITTED.
    for s in NOT_SENT:
        assert MigrationState.COMMITTED not in SOURCE_TRANSITIONS.table[s]


@pytest.mark.parametrize(
    ("state", "left"),
    [
        (MigrationState.PREPARING, CudaLeft.NONE),
        (MigrationState.LOCKING, CudaLeft.PARTLY),
        (MigrationState.LOCKED, CudaLeft.LOCKED),
        (MigrationState.CHECKPOINTING, CudaLeft.PARTLY),
        (MigrationState.CHECKPOINTED, CudaLeft.CHECKPOINTED),
        (MigrationState.DUMPING, CudaLeft.CHECKPOINTED),
        (MigrationState.TRANSFERRING, CudaLeft.CHECKPOINTED),
        (MigrationState.ABORTING, CudaLeft.PARTLY),
        (MigrationState.RESTORING, CudaLeft.CHECKPOINTED),
        (MigrationState.PAGING, CudaLeft.CHECKPOINTED),
        (MigrationState.UNRESOLVED, CudaLeft.CHECKPOINTED),
    ],
)
def test_the_journaled_state_says_how_far_the_cuda_freeze_got(state, left) -> None:
    assert cuda_left(state, has_cuda=True) is left
    assert cuda_left(state, has_cuda=False) is CudaLeft.NONE


def test_every_target_state_has_a_wire_value_that_fences_the_same_way() -> None:
    for s in TargetState:
        assert s.wire != pb.TARGET_STATE_UNSPECIFIED
    # What a source does with an answer depends only on it: "not restoring" stays "not restoring".
    before = {TargetState.PREPARED, TargetState.STREAMING, TargetState.STREAMED, TargetState.RECEIVING}
    assert {s.wire for s in before} <= {pb.TARGET_STATE_PREPARED, pb.TARGET_STATE_RECEIVING}
    assert {s for s in TargetState if not s.in_flight} == {TargetState.RUNNING, TargetState.ABORTED}


def test_the_registry_refuses_a_change_its_table_does_not_allow(registry: JobRegistry) -> None:
    registry.save(
        JobRecord(
            name="train", kind=JobKind.LAUNCHED, state=JobState.RUNNING, pid=999_999, command=["x"], cwd="/"
        )
    )
    with pytest.raises(IllegalTransitionError, match="job train: running → moved"):
        registry.update("train", state=JobState.MOVED)
    assert registry.get("train").state is JobState.RUNNING  # nothing changed
    registry.update("train", note="a note alone is no transition")
    registry.begin_move("train", "m1", "migration")
    assert registry.update("train", state=JobState.MOVED).state is JobState.MOVED
    with pytest.raises(IllegalTransitionError, match="moved → running"):
        registry.update("train", state=JobState.RUNNING)

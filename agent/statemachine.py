"""State machines written down: a table of allowed transitions that every change goes through.

ferry's machines (agent.migration.states for both sides of a migration, agent.jobs.record
for a job) are each one `str` Enum, its transitions in its docstring and in a Transitions
table. A change not in the table raises IllegalTransitionError: a bug, never a user's mistake.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Generic, TypeVar

from agent.compat import StrEnum
from agent.errors import FerryError

S = TypeVar("S", bound=StrEnum)


class IllegalTransitionError(FerryError):
    """A state change its machine does not allow (an internal error: a bug)."""

    kind = "internal"


class Transitions(Generic[S]):
    """A machine's table: state → the states it may go to. Final states go nowhere."""

    def __init__(self, name: str, table: Mapping[S, frozenset[S]]) -> None:
        self.name = name
        self.table = dict(table)

    def check(self, old: S, new: S, subject: str) -> S:
        nexts = self.table.get(old, frozenset())
        if new not in nexts:
            allowed = ", ".join(sorted(s.value for s in nexts)) or "nothing (final)"
            raise IllegalTransitionError(
                f"{self.name} {subject}: {old.value} → {new.value} is not a transition "
                f"(from {old.value}: {allowed})",
                hint="this is a bug in ferry; the agent's log has the details",
            )
        return new

    def final(self, state: S) -> bool:
        return not self.table.get(state)

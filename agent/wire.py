"""Closed sets on the wire: each of the product's enums and its proto enum, one table both ways.

Inside the agent a closed set is its Python enum; between processes it is a proto enum.
UNSPECIFIED (0) on input means the set's documented default, where it has one; a number this
agent does not know is INVALID_ARGUMENT, quoting it. Used by the servicer's converters and by
whatever reads a peer's messages (agent.health.placement).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from agent.errors import FerryError, InvalidArgumentError
from agent.health.verdicts import State
from agent.jobs.record import OnDegraded, Priority
from agent.migration.model import Method, Resolution
from agent.rpc import pb

E = TypeVar("E", bound=str)


@dataclass(frozen=True)
class EnumMap(Generic[E]):
    """One closed set both ways: the product's value <-> the proto enum's number."""

    what: str  # the set, as a message names it: "priority"
    enum: Any  # the generated enum wrapper (pb.Priority): its names for messages
    to_pb: Mapping[E, int]
    #: What UNSPECIFIED means on input; None: the set has no default and 0 is refused.
    default: E | None = None
    from_pb_table: Mapping[int, E] = field(init=False)

    def __post_init__(self) -> None:
        back = {n: v for v, n in self.to_pb.items()}
        assert len(back) == len(self.to_pb) and 0 not in back, f"{self.what}: not one-to-one"
        object.__setattr__(self, "from_pb_table", back)

    def pb(self, value: E | str) -> int:
        """The number for a value; records keep the words, which equal the enum's values."""
        try:
            return self.to_pb[value]  # type: ignore[index]
        except KeyError:
            words = ", ".join(repr(str(v)) for v in self.to_pb)
            raise FerryError(
                f"{self.what} {value!r} has no wire value: expected one of {words}",
                hint="a record written by another ferry version, or edited by hand",
            ) from None

    def shown(self, value: E | str) -> int:
        """The number for a value shown to a user, UNSPECIFIED for one this version does not know
        (a record edited by hand): one odd record must not break a whole listing."""
        return self.to_pb.get(value, 0)  # type: ignore[call-overload]

    def py(self, number: int) -> E:
        if number == 0 and self.default is not None:
            return self.default
        if (value := self.from_pb_table.get(number)) is not None:
            return value
        known = ", ".join(f"{self.enum.Name(n)} ({n})" for n in sorted(self.from_pb_table))
        got = f"no {self.what} (0, unspecified)" if number == 0 else f"unknown {self.what} {number}"
        raise InvalidArgumentError(
            f"{got}: expected one of {known}",
            hint="the sender and this agent may be different ferry versions",
        )


PRIORITIES: EnumMap[Priority] = EnumMap(
    "priority",
    pb.Priority,
    {Priority.NORMAL: pb.PRIORITY_NORMAL, Priority.LOW: pb.PRIORITY_LOW},
    default=Priority.NORMAL,
)
DEGRADED_POLICIES: EnumMap[OnDegraded] = EnumMap(
    "on-degraded policy",
    pb.OnDegraded,
    {OnDegraded.MIGRATE: pb.ON_DEGRADED_MIGRATE, OnDegraded.ALERT: pb.ON_DEGRADED_ALERT},
    default=OnDegraded.MIGRATE,
)
RESOLUTIONS: EnumMap[Resolution] = EnumMap(
    "resolve action",
    pb.ResolveAction,
    {
        Resolution.ASK: pb.RESOLVE_ACTION_ASK,
        Resolution.RESUME: pb.RESOLVE_ACTION_RESUME,
        Resolution.FINISH: pb.RESOLVE_ACTION_FINISH,
    },
    default=Resolution.ASK,
)
METHODS: EnumMap[Method] = EnumMap(
    "migration method",
    pb.MigrationMethod,
    {
        Method.PRE_COPY: pb.MIGRATION_METHOD_PRE_COPY,
        Method.POST_COPY: pb.MIGRATION_METHOD_POST_COPY,
        Method.STAGED: pb.MIGRATION_METHOD_STAGED,
    },
    default=Method.DEFAULT,
)
#: A GPU's state and an evidence's severity: a report always says which, so 0 has no meaning.
HEALTH_STATES: EnumMap[State] = EnumMap(
    "health state",
    pb.HealthState,
    {
        State.HEALTHY: pb.HEALTH_STATE_HEALTHY,
        State.DEGRADED: pb.HEALTH_STATE_DEGRADED,
        State.FAILING: pb.HEALTH_STATE_FAILING,
    },
)
#: Event kinds are the words agent.health.events records (a test holds every recorded kind here).
EVENT_KINDS: EnumMap[str] = EnumMap(
    "event kind",
    pb.EventKind,
    {
        "health": pb.EVENT_KIND_HEALTH,
        "decision": pb.EVENT_KIND_DECISION,
        "migration": pb.EVENT_KIND_MIGRATION,
        "preempt": pb.EVENT_KIND_PREEMPT,
        "resume": pb.EVENT_KIND_RESUME,
        "quarantine": pb.EVENT_KIND_QUARANTINE,
        "alert": pb.EVENT_KIND_ALERT,
        "straggler": pb.EVENT_KIND_STRAGGLER,
        "verify": pb.EVENT_KIND_VERIFY,
    },
)
ENUM_MAPS: tuple[EnumMap[Any], ...] = (
    PRIORITIES,
    DEGRADED_POLICIES,
    RESOLUTIONS,
    METHODS,
    HEALTH_STATES,
    EVENT_KINDS,
)

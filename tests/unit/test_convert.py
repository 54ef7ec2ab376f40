"""The wire's closed sets (agent.service.convert): every product value has its proto enum value and
back, UNSPECIFIED means the documented default, an unknown number is INVALID_ARGUMENT naming it, and
the CLI shows the product's own words."""

from __future__ import annotations

import ast
from pathlib import Path

import grpc
import pytest

from agent.cli import render
from agent.errors import FerryError, InvalidArgumentError
from agent.health.verdicts import Evidence, GpuHealth, State
from agent.jobs.record import JobKind, JobRecord, JobState, OnDegraded, Priority
from agent.migration.model import Method, Resolution
from agent.rpc import pb
from agent.service import convert
from agent.service.status import status_for
from agent.wire import (
    DEGRADED_POLICIES,
    ENUM_MAPS,
    EVENT_KINDS,
    HEALTH_STATES,
    METHODS,
    PRIORITIES,
    RESOLUTIONS,
    EnumMap,
)

#: Each map with every value the product has for it.
PRODUCT_VALUES: list[tuple[EnumMap, list[str]]] = [
    (PRIORITIES, list(Priority)),
    (DEGRADED_POLICIES, list(OnDegraded)),
    (RESOLUTIONS, list(Resolution)),
    (METHODS, [Method.PRE_COPY, Method.POST_COPY, Method.STAGED]),
    (HEALTH_STATES, list(State)),
    (
        EVENT_KINDS,
        [
            "health",
            "decision",
            "migration",
            "preempt",
            "resume",
            "quarantine",
            "alert",
            "straggler",
            "verify",
        ],
    ),
]


def test_every_enum_map_is_tested() -> None:
    assert {id(m) for m, _ in PRODUCT_VALUES} == {id(m) for m in ENUM_MAPS}


@pytest.mark.parametrize(("table", "values"), PRODUCT_VALUES, ids=lambda x: getattr(x, "what", ""))
def test_every_value_maps_and_round_trips(table: EnumMap, values: list[str]) -> None:
    assert set(table.to_pb) == set(values)  # no product value without a wire value
    for v in values:
        n = table.pb(v)
        assert n != 0 and n in table.enum.values(), (v, n)
        assert table.py(n) == v and type(table.py(n)) is type(v)
    # ... and no wire value without a product value.
    assert {n for n in table.enum.values() if n} == set(table.from_pb_table)


def test_a_migrate_request_says_its_method_or_an_older_client_says_it_with_booleans() -> None:
    def of(**kw: object) -> Method:
        return convert.method_of(pb.MigrateRequest(name="j", target="h:1", **kw))  # type: ignore[arg-type]

    assert of() is Method.DEFAULT
    assert of(lazy=True) is Method.POST_COPY and of(staged=True) is Method.STAGED
    assert of(method=pb.MIGRATION_METHOD_PRE_COPY, lazy=True) is Method.PRE_COPY  # the field wins
    with pytest.raises(InvalidArgumentError, match="exclude each other"):
        of(lazy=True, staged=True)
    with pytest.raises(InvalidArgumentError, match="unknown migration method 9"):
        of(method=9)


def test_unspecified_on_input_is_the_documented_default() -> None:
    assert PRIORITIES.py(pb.PRIORITY_UNSPECIFIED) is Priority.NORMAL
    assert DEGRADED_POLICIES.py(pb.ON_DEGRADED_UNSPECIFIED) is OnDegraded.MIGRATE
    assert RESOLUTIONS.py(pb.RESOLVE_ACTION_UNSPECIFIED) is Resolution.ASK  # ask the target
    assert METHODS.py(pb.MIGRATION_METHOD_DEFAULT) is Method.DEFAULT  # post-copy, else pre-copy
    # A health report always says which state: nothing is assumed for a GPU.
    with pytest.raises(InvalidArgumentError, match=r"no health state \(0, unspecified\)"):
        HEALTH_STATES.py(pb.HEALTH_STATE_UNSPECIFIED)
    with pytest.raises(InvalidArgumentError, match=r"no event kind \(0, unspecified\)"):
        EVENT_KINDS.py(pb.EVENT_KIND_UNSPECIFIED)


@pytest.mark.parametrize("table", ENUM_MAPS, ids=lambda m: m.what)
@pytest.mark.parametrize("number", [99, -1, 2**31 - 1])
def test_an_unknown_number_is_invalid_argument_quoting_it(table: EnumMap, number: int) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        table.py(number)
    assert str(e.value).startswith(f"unknown {table.what} {number}: expected one of ")
    first = min(table.from_pb_table)
    assert f"{table.enum.Name(first)} ({first})" in str(e.value)  # what it would take
    assert status_for(e.value)[0] is grpc.StatusCode.INVALID_ARGUMENT


def test_a_word_with_no_wire_value_is_a_ferry_error_naming_it() -> None:
    with pytest.raises(
        FerryError, match="priority 'urgent' has no wire value: expected one of 'normal', 'low'"
    ):
        PRIORITIES.pb("urgent")


def test_every_recorded_event_kind_has_a_wire_value() -> None:
    """Kinds are words in agent.health.events: each one the agent records must be in the table."""
    root = Path(convert.__file__).resolve().parents[1]
    kinds: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            f = node.func
            if f.attr == "record" and isinstance(f.value, ast.Attribute) and f.value.attr == "events":
                arg = node.args[0] if node.args else None
            elif f.attr == "_say_once" and len(node.args) > 3:
                arg = node.args[3]
            else:
                continue
            if isinstance(arg, ast.Name) and arg.id == "kind":
                continue  # _say_once passing its own argument on: its callers are checked
            assert isinstance(arg, ast.Constant), f"{path}:{node.lineno}: an event kind must be a literal"
            kinds.add(arg.value)
    assert kinds and kinds <= set(EVENT_KINDS.to_pb), kinds - set(EVENT_KINDS.to_pb)


def test_an_event_of_a_kind_no_table_knows_still_reaches_the_operator() -> None:
    from agent.health.events import Event

    e = convert.event_pb(Event("drain", "from another version", node="n"))
    assert (e.event_kind, e.message) == (pb.EVENT_KIND_UNSPECIFIED, "from another version")
    assert render.event_dict(e)["kind"] == ""


# -- what the CLI shows: the product's own words ---------------------------------------------------


@pytest.mark.parametrize(
    ("table", "words"),
    [
        (PRIORITIES, render.PRIORITY_WORDS),
        (DEGRADED_POLICIES, render.DEGRADED_POLICY_WORDS),
        (HEALTH_STATES, render.HEALTH_WORDS),
        (EVENT_KINDS, render.EVENT_KIND_WORDS),
    ],
    ids=lambda x: getattr(x, "what", ""),
)
def test_the_cli_renders_each_value_as_the_products_word(table: EnumMap, words: dict[int, str]) -> None:
    assert words == {n: str(v) for n, v in table.from_pb_table.items()}


def test_the_cli_sends_its_choices_as_the_enums() -> None:
    assert [render.priority_pb(p) for p in ("normal", "low")] == [pb.PRIORITY_NORMAL, pb.PRIORITY_LOW]
    assert render.degraded_policy_pb("alert") == pb.ON_DEGRADED_ALERT
    with pytest.raises(InvalidArgumentError, match="unknown priority 'high': expected normal or low"):
        render.priority_pb("high")
    assert render.priority_word(42) == "?" and render.priority_word(0) == ""


def test_a_job_and_a_health_report_keep_their_words_through_the_wire() -> None:
    rec = JobRecord(
        "j", JobKind.LAUNCHED, JobState.RUNNING, 1, ["x"], "/", priority="low", on_degraded="alert"
    )
    d = render.job_dict(convert.job_pb(rec, "n"))
    assert (d["priority"], d["on_degraded"]) == ("low", "alert")

    ev = Evidence("xid", State.FAILING, "XID 79", 5.0)
    g = GpuHealth("GPU-0", 0, "NVIDIA H200", State.FAILING, (ev,), 5.0, 6.0, {}, 1, 0, 1)

    class NoQuarantine:
        def get(self, uuid: str) -> None:
            return None

    from agent.health.healing import Holder

    msg = convert.health_pb(g, [Holder(rec, 7)], NoQuarantine(), set())  # type: ignore[arg-type]
    [gd] = render.health_dict(pb.HealthReport(nvml_available=True, gpus=[msg]))["gpus"]
    assert (gd["state"], gd["evidence"][0]["severity"]) == ("failing", "failing")
    assert gd["jobs"] == [{"name": "j", "priority": "low", "used_bytes": 7}]
    text = render.health_text(pb.HealthReport(node_name="n", nvml_available=True, gpus=[msg]))
    assert "FAILING" in text and "j (low)" in text and "GPU-0: failing: XID 79" in text

"""`[coordination]`: the timings are refused in the wrong order; doctor says what etcd is for."""

from __future__ import annotations

import socket

import pytest

from agent import agent_config
from agent.cli.doctor import _coordination_check
from agent.coord.config import CoordConfig
from agent.coord.liveness import LIVENESS, Liveness, Member
from agent.errors import InvalidArgumentError
from agent.statemachine import IllegalTransitionError


def test_the_defaults_leave_two_renewals_before_fencing_and_cover_the_fencing() -> None:
    c = CoordConfig(endpoints=("10.0.0.9:2379",)).check()
    assert c.lease_ttl_s - c.fence_margin_s >= 2 * c.renew_every_s
    assert c.fence_margin_s >= 1.0


@pytest.mark.parametrize(
    ("ttl", "margin", "every"), [(5, 1.5, 1.4), (3, 1.0, 0.8), (2, 1.0, 0.4), (9, 1.0, 3.0)]
)
def test_renewals_leave_two_and_a_round_trip_before_fencing_at_most_three_a_lease(
    ttl: int, margin: float, every: float
) -> None:
    c = CoordConfig(endpoints=("10.0.0.9:2379",), lease_ttl_s=ttl, fence_margin_s=margin).check()
    assert c.renew_every_s == pytest.approx(every)
    assert c.lease_ttl_s - c.fence_margin_s >= 2.5 * c.renew_every_s - 1e-9


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"lease_ttl_s": 1}, "below etcd's minimum"),
        ({"fence_margin_s": 0.2}, "does not cover fencing"),
        ({"lease_ttl_s": 3, "fence_margin_s": 2.5}, "less than two renewals"),
        ({"lease_ttl_s": 2, "fence_margin_s": 2.0}, "less than two renewals"),
        ({"endpoints": ("etcd",)}, "not HOST:PORT"),
        ({"prefix": "ferry"}, "must start and end with '/'"),
    ],
)
def test_timings_in_the_wrong_order_are_refused_naming_the_key(changes: dict, said: str) -> None:
    with pytest.raises(InvalidArgumentError, match=said):
        CoordConfig(**{"endpoints": ("10.0.0.9:2379",), **changes}).check()


def test_the_config_file_reads_coordination() -> None:
    cfg = agent_config.parse({"coordination": {"endpoints": ["10.0.0.9:2379"], "lease_ttl_s": 6}})
    assert cfg.coordination.endpoints == ("10.0.0.9:2379",) and cfg.coordination.lease_ttl_s == 6
    with pytest.raises(InvalidArgumentError, match="expected a list of strings"):
        agent_config.parse({"coordination": {"endpoints": "10.0.0.9:2379"}})
    with pytest.raises(InvalidArgumentError, match="unknown key 'ttl'"):
        agent_config.parse({"coordination": {"ttl": 3}})
    assert not agent_config.parse({}).coordination.enabled


def test_liveness_goes_only_where_its_table_says() -> None:
    assert LIVENESS.check(Liveness.FENCED, Liveness.LIVE, "n") is Liveness.LIVE
    with pytest.raises(IllegalTransitionError):
        LIVENESS.check(Liveness.CONNECTING, Liveness.FENCED, "n")  # nothing to fence without a lease
    assert LIVENESS.final(Liveness.STOPPED)


def test_a_member_key_round_trips() -> None:
    m = Member("g", "r1", "node-b", "10.0.0.2:7070", "10.77.1.2", "1")
    assert Member.parse("g", "r1", m.value().encode()) == m
    with pytest.raises(KeyError):
        Member.parse("g", "r1", b"{}")


def test_doctor_says_recovery_needs_etcd_and_whether_it_answers() -> None:
    off = _coordination_check(CoordConfig())
    assert not off.ok and not off.required and "automatic recovery after a node dies needs etcd" in off.detail
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        up = _coordination_check(CoordConfig(endpoints=(f"127.0.0.1:{port}",)))
    assert up.ok and "fenced 1.5 s before it could expire" in up.detail
    down = _coordination_check(CoordConfig(endpoints=(f"127.0.0.1:{port}",)))  # closed now
    assert not down.ok and "refused" in down.detail.lower()

"""The target chooser: which peer and GPU a job leaving a bad GPU goes to."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.agent_config import PeerSpec, load, parse
from agent.errors import InvalidArgumentError, RefusedError, UnavailableError
from agent.gpus.inventory import GpuNeed
from agent.health.placement import choose_target
from agent.rpc import pb
from agent.wire import HEALTH_STATES, PRIORITIES

H200, A100 = "NVIDIA H200", "NVIDIA A100"
GIB = 1 << 30
NEED = [GpuNeed("GPU-src", H200, 10 * GIB)]


def _num(table, value: str | int) -> int:
    """A word as the wire carries it; a number is sent as it is (what a peer of another version says)."""
    return value if isinstance(value, int) else table.pb(value)


def gpu(
    uuid: str, *, name: str = H200, free: int = 100 * GIB, state: str | int = "healthy", **kw: object
) -> pb.GpuHealth:
    holders = [
        pb.GpuHolder(job=j, priority_class=_num(PRIORITIES, p), used_bytes=u)
        for j, p, u in kw.pop("holders", [])  # type: ignore[attr-defined]
    ]
    return pb.GpuHealth(
        uuid=uuid,
        name=name,
        health_state=_num(HEALTH_STATES, state),
        memory_free=free,
        holders=holders,
        **kw,  # type: ignore[arg-type]
    )


def report(node: str, *gpus: pb.GpuHealth) -> pb.HealthReport:
    return pb.HealthReport(node_name=node, nvml_available=True, gpus=list(gpus))


def test_idle_spare_beats_idle_peer_listed_first():
    views = [
        (PeerSpec("b:1"), report("b", gpu("GPU-b0"))),
        (PeerSpec("s:1", spare=True), report("s", gpu("GPU-s0"))),
    ]
    p = choose_target(NEED, "normal", views)
    assert (p.node, p.gpus, p.preempt) == ("s", {"GPU-src": "GPU-s0"}, ())
    assert p.describe() == "idle GPU-s0 on spare node s"


def test_idle_peer_beats_preempting_on_a_spare():
    views = [
        (PeerSpec("s:1", spare=True), report("s", gpu("GPU-s0", holders=[("low", "low", GIB)]))),
        (PeerSpec("b:1"), report("b", gpu("GPU-b0"))),
    ]
    assert choose_target(NEED, "normal", views).node == "b"


def test_preempts_low_priority_job_when_no_gpu_is_idle():
    views = [
        (PeerSpec("s:1", spare=True), report("s", gpu("GPU-s0", free=0, holders=[("scav", "low", 80 * GIB)])))
    ]
    p = choose_target(NEED, "normal", views)
    assert p.preempt == ("scav",) and p.gpus == {"GPU-src": "GPU-s0"}
    assert "after suspending low-priority job scav" in p.describe()


def test_a_low_priority_job_never_preempts_another():
    views = [(PeerSpec("s:1", spare=True), report("s", gpu("GPU-s0", holders=[("scav", "low", GIB)])))]
    with pytest.raises(RefusedError, match="GPU-s0 is held by job scav"):
        choose_target(NEED, "low", views)


def test_refusal_names_every_peer_and_why():
    views = [
        (PeerSpec("q:1"), report("q", gpu("GPU-q0", quarantined=True, quarantine_reason="XID 79"))),
        (PeerSpec("d:1"), report("d", gpu("GPU-d0", state="degraded"))),
        (PeerSpec("n:1"), report("n", gpu("GPU-n0", holders=[("prod", "normal", GIB)]))),
        (PeerSpec("c:1"), report("c", gpu("GPU-c0", name=A100))),
        (PeerSpec("m:1"), report("m", gpu("GPU-m0", free=GIB))),
        (PeerSpec("h:1"), report("h", gpu("GPU-h0", held=True))),
        (PeerSpec("x:1"), UnavailableError("agent x:1 is unreachable")),
    ]
    with pytest.raises(RefusedError) as e:
        choose_target(NEED, "normal", views, node="a")
    msg = str(e.value)
    for part in (
        "q: GPU-q0 is quarantined (XID 79)",
        "d: GPU-d0 is degraded",
        "n: GPU-n0 is held by job prod",
        f"c: no {H200} (it has {A100})",
        "m: GPU-m0 has 1.0 GiB free, 10.0 GiB needed",
        "h: GPU-h0 is held for another incoming job",
        "x:1: agent x:1 is unreachable",
    ):
        assert part in msg
    assert msg.startswith("placement on a:")


def test_a_peer_state_this_agent_cannot_read_is_no_target():
    views = [
        (PeerSpec("u:1"), report("u", gpu("GPU-u0", state=9))),
        (PeerSpec("o:1"), report("o", gpu("GPU-o0", state=pb.HEALTH_STATE_UNSPECIFIED))),
    ]
    with pytest.raises(RefusedError) as e:
        choose_target(NEED, "normal", views)
    msg = str(e.value)
    assert "u: GPU-u0 has a state this agent cannot read (unknown health state 9: expected one of" in msg
    assert "o: GPU-o0 has a state this agent cannot read (no health state (0, unspecified)" in msg


def test_a_holder_whose_priority_cannot_be_read_is_never_preempted():
    for prio in (7, pb.PRIORITY_UNSPECIFIED):  # unknown, and unspecified (normal on input)
        views = [(PeerSpec("s:1"), report("s", gpu("GPU-s0", free=0, holders=[("who", prio, GIB)])))]
        with pytest.raises(RefusedError, match="GPU-s0 is held by job who"):
            choose_target(NEED, "normal", views)


def test_no_peers_configured_says_where_to_add_them():
    with pytest.raises(RefusedError, match="no peers are configured") as e:
        choose_target(NEED, "normal", [])
    assert "--config" in str(e.value)


def test_two_gpus_need_two_distinct_targets_on_one_peer():
    needs = [GpuNeed("GPU-x", H200, GIB), GpuNeed("GPU-y", H200, GIB)]
    one = [(PeerSpec("s:1", spare=True), report("s", gpu("GPU-s0")))]
    with pytest.raises(RefusedError):
        choose_target(needs, "normal", one)
    two = [(PeerSpec("s:1", spare=True), report("s", gpu("GPU-s0"), gpu("GPU-s1")))]
    assert sorted(choose_target(needs, "normal", two).gpus.values()) == ["GPU-s0", "GPU-s1"]


def test_config_file_peers_and_policy():
    cfg = parse(
        {
            "health": {"interval_s": 2},
            "policy": {"cooldown_s": 30, "max_moves": 2},
            "peers": [{"address": "10.0.0.2:7070", "spare": True}, {"address": "10.0.0.3:7070"}],
        }
    )
    assert cfg.peers == (PeerSpec("10.0.0.2:7070", True), PeerSpec("10.0.0.3:7070", False))
    assert (cfg.policy.cooldown_s, cfg.policy.max_moves, cfg.health.interval_s) == (30, 2, 2)


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"polcy": {}}, "unknown key 'polcy' in top level"),
        ({"policy": {"cooldown": 1}}, "unknown key 'cooldown' in \\[policy\\]"),
        ({"policy": {"max_moves": 1.5}}, "max_moves = 1.5"),
        ({"policy": {"cooldown_s": -1}}, "cooldown_s = -1"),
        ({"peers": [{"address": "nohost"}]}, "invalid agent address 'nohost'"),
        ({"peers": [{"address": "h:1", "spare": "yes"}]}, "spare true or false"),
        ({"peers": {"address": "h:1"}}, "array of tables"),
        ({"snapshots": {"full_every": 0}}, "full_every = 0 is not within 1 to 64"),
        ({"snapshots": {"incremental": "yes"}}, "incremental"),
        ({"snapshots": {"criu_log_level": 5}}, "criu_log_level = 5 is not within 0 to 4"),
    ],
)
def test_config_file_errors_name_the_key(raw, match):
    with pytest.raises(InvalidArgumentError, match=match):
        parse(raw)


def test_a_member_of_the_moving_jobs_own_group_is_never_preempted():
    """Suspending a rank of the same training job to make room for another of its ranks would stall
    the job it is made room for: such a holder counts as a normal one."""
    mate = pb.GpuHolder(job="llm-r2", priority_class=PRIORITIES.pb("low"), used_bytes=80 * GIB, group="llm")
    views = [(PeerSpec("s:1", spare=True), report("s", gpu("GPU-s0", free=0, holders=[])))]
    views[0][1].gpus[0].holders.append(mate)
    with pytest.raises(RefusedError, match="GPU-s0 is held by job llm-r2"):
        choose_target(NEED, "normal", views, group="llm")
    assert choose_target(NEED, "normal", views, group="other").preempt == ("llm-r2",)


def test_a_config_file_that_is_not_utf8_text_is_named_as_such_without_a_traceback(tmp_path):
    bad = tmp_path / "agent.toml"
    bad.write_bytes(b"[policy]\ncooldown_s = 1\n# \xff\xfe latin-1\n")
    with pytest.raises(InvalidArgumentError, match=r"agent\.toml is not UTF-8 text \(byte \d+") as ei:
        load(bad)
    assert ei.value.step == "config"


def test_a_config_file_that_never_ends_is_refused_at_once():
    """`--config /dev/zero` used to read forever."""
    with pytest.raises(InvalidArgumentError, match="larger than 1 MiB; not a config file"):
        load(Path("/dev/zero"))

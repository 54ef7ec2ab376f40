"""The job network's configuration, address choice and link names (the links themselves, the lock
and the announcement run for real on the bed: tests/integration/test_nodes.py)."""

from __future__ import annotations

import pytest

from agent.agent_config import parse
from agent.errors import InvalidArgumentError, RefusedError
from agent.jobs.network import JobNetwork, LinkLock, NetworkConfig, veth_name

CFG = {"bridge": "ferry0", "subnet": "10.77.0.0/16", "pool": "10.77.1.0/29", "gateway": "10.77.0.1"}


def test_the_network_table_is_read_and_checked() -> None:
    cfg = parse({"network": CFG}).network
    assert cfg.enabled and cfg.interface("10.77.1.5") == "10.77.1.5/16"
    assert cfg.covers("10.77.200.1") and not cfg.covers("10.78.0.1") and not cfg.covers("nonsense")
    assert not parse({}).network.enabled
    assert cfg.rto_min_ms == 10 and parse({"network": {**CFG, "rto_min_ms": 0}}).network.rto_min_ms == 0


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"pool": "10.78.1.0/24"}, "pool 10.78.1.0/24 is not inside subnet 10.77.0.0/16"),
        ({"subnet": "10.77.0.0/33"}, "subnet = '10.77.0.0/33' is not a network"),
        ({"gateway": "10.99.0.1"}, "gateway 10.99.0.1 is not inside subnet"),
        ({"bridge": "a bridge"}, "is not an interface name"),
        ({"bridge": ""}, "[network] bridge is missing"),
        ({"pool": 7}, "expected a string"),
        ({"rto_min_ms": 250}, "rto_min_ms = 250 is not within 0 to 200"),
        ({"rto_min_ms": -1}, "rto_min_ms = -1 is not valid: expected a whole number"),
    ],
)
def test_a_bad_network_table_names_its_key(change: dict, said: str) -> None:
    with pytest.raises(InvalidArgumentError) as ei:
        parse({"network": {**CFG, **change}})
    assert said in str(ei.value)


def test_the_lowest_free_address_not_answering_arp_is_given() -> None:
    net = JobNetwork(NetworkConfig(**CFG))
    answering = {"10.77.1.2"}
    got = net.allocate({"10.77.1.1"}, probe=lambda a: a in answering)
    assert got == "10.77.1.3"  # .1 held by a record, .2 answers ARP


def test_a_full_pool_is_a_refusal_with_the_fix() -> None:
    net = JobNetwork(NetworkConfig(**CFG))
    with pytest.raises(RefusedError, match="no free address left") as ei:
        net.allocate({f"10.77.1.{i}" for i in range(1, 7)}, probe=lambda a: False)
    assert "larger [network] pool" in ei.value.hint


def test_link_names_fit_an_interface_and_differ_per_key() -> None:
    names = {veth_name(f"node-a/job/{i}") for i in range(100)}
    assert len(names) == 100 and all(len(n) <= 15 and n.startswith("fj") for n in names)
    assert veth_name("x") == veth_name("x")


def test_a_job_on_the_nodes_network_has_no_lock_and_no_external_link() -> None:
    lock = LinkLock(JobNetwork(NetworkConfig(**CFG)), "")
    lock.engage()  # nothing to cut
    assert not lock.engaged and lock.external() == []
    net = JobNetwork(NetworkConfig(**CFG))
    assert LinkLock(net, "fjabc").external() == ["veth[eth0]:fjabc"]
    assert net.criu_restore_external("fjdef") == "veth[eth0]:fjdef"  # off the bridge until released


def test_the_bridge_mac_is_pinned_once_so_job_links_cannot_change_it(tmp_path, monkeypatch) -> None:
    """A bridge takes its lowest port MAC unless one was set: a job's link joining or leaving would
    change the MAC of the node's own address on it (seen on the bed: a node cut off for 30 s)."""
    bridge = tmp_path / "ferry0"
    (bridge / "bridge").mkdir(parents=True)
    (bridge / "address").write_text("62:bc:66:2a:98:8b\n")
    (bridge / "addr_assign_type").write_text("0\n")  # follows its ports
    net = JobNetwork(NetworkConfig(**CFG))
    monkeypatch.setattr(net, "sysfs", str(tmp_path))
    calls: list[tuple[str, ...]] = []
    monkeypatch.setattr(net, "_ip", lambda *args: calls.append(args))
    net.require_bridge()
    assert calls == [("link", "set", "dev", "ferry0", "address", "62:bc:66:2a:98:8b")]
    (bridge / "addr_assign_type").write_text("3\n")  # set by the user (as the call above did)
    net.require_bridge()
    assert len(calls) == 1
    with pytest.raises(RefusedError, match="bridge br9 does not exist"):
        JobNetwork(NetworkConfig(**{**CFG, "bridge": "br9"})).require_bridge()


def test_a_mac_is_read_in_the_calling_threads_namespace() -> None:
    """Read by ioctl, not from /sys (which shows the namespace sysfs was mounted in)."""
    from agent.jobs.network import _mac

    assert _mac("lo") == b"\0" * 6

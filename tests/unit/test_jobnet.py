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


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"pool": "10.78.1.0/24"}, "pool 10.78.1.0/24 is not inside subnet 10.77.0.0/16"),
        ({"subnet": "10.77.0.0/33"}, "subnet = '10.77.0.0/33' is not a network"),
        ({"gateway": "10.99.0.1"}, "gateway 10.99.0.1 is not inside subnet"),
        ({"bridge": "a bridge"}, "is not an interface name"),
        ({"bridge": ""}, "[network] bridge is missing"),
        ({"pool": 7}, "expected a string"),
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
    assert net.criu_restore_external("fjdef") == "veth[eth0]:fjdef@ferry0"

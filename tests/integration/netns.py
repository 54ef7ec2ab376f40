"""Two network namespaces joined by a veth pair: a link between two "nodes" a test can cut.

    with veth_link() as link:
        a = agents("node-a", prefix=link.prefix_a, host=link.addr_a, tls_dir=...)
        ...
        link.down()  # the cable is pulled: no FIN, no RST, packets just stop
        link.up()

Names are unique per use, so runs in parallel do not collide; everything is
removed on exit, even when the body fails. Processes started inside keep their
namespace alive until they end (deleting a namespace only drops its name).
"""

from __future__ import annotations

import contextlib
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and p.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({p.returncode}): {p.stderr.strip()}")
    return p


@dataclass(frozen=True)
class VethLink:
    ns_a: str
    ns_b: str
    dev_a: str  # the end inside ns_a
    dev_b: str  # the end inside ns_b
    addr_a: str
    addr_b: str

    @property
    def prefix_a(self) -> list[str]:
        """Command prefix that runs a program inside ns_a."""
        return ["ip", "netns", "exec", self.ns_a]

    @property
    def prefix_b(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns_b]

    def down(self) -> None:
        """Cut the link (ns_a's end): from here on packets between the two are silently lost."""
        _ip("-n", self.ns_a, "link", "set", self.dev_a, "down")

    def up(self) -> None:
        """Restore the link (its connected route comes back with it)."""
        _ip("-n", self.ns_a, "link", "set", self.dev_a, "up")


@contextlib.contextmanager
def veth_link(
    addr_a: str = "10.77.0.1", addr_b: str = "10.77.0.2", prefix_len: int = 24
) -> Iterator[VethLink]:
    """Create the two namespaces and the link; skip the test (with the reason) if this host cannot."""
    tag = secrets.token_hex(3)
    link = VethLink(
        ns_a=f"ferry-{tag}-a",
        ns_b=f"ferry-{tag}-b",
        dev_a=f"fy{tag}a",  # interface names: 15 characters at most
        dev_b=f"fy{tag}b",
        addr_a=addr_a,
        addr_b=addr_b,
    )
    made: list[str] = []
    try:
        try:
            p = _ip("netns", "add", link.ns_a, check=False)
        except OSError as e:
            pytest.skip(f"cannot create network namespaces (`ip netns add`): {e}")
        if p.returncode != 0:
            pytest.skip(f"cannot create network namespaces (`ip netns add` failed): {p.stderr.strip()}")
        made.append(link.ns_a)
        _ip("netns", "add", link.ns_b)
        made.append(link.ns_b)
        _ip("link", "add", link.dev_a, "type", "veth", "peer", "name", link.dev_b)
        made.append(link.dev_a)
        _ip("link", "set", link.dev_a, "netns", link.ns_a)
        _ip("link", "set", link.dev_b, "netns", link.ns_b)
        for ns, dev, addr in ((link.ns_a, link.dev_a, addr_a), (link.ns_b, link.dev_b, addr_b)):
            _ip("-n", ns, "addr", "add", f"{addr}/{prefix_len}", "dev", dev)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")
        yield link
    finally:
        # Deleting a namespace deletes the veth end in it, and with it the peer.
        for ns in reversed([n for n in made if n in (link.ns_a, link.ns_b)]):
            _ip("netns", "del", ns, check=False)
        if link.dev_a in made:  # still in the root namespace if moving it failed
            _ip("link", "del", link.dev_a, check=False)

"""A node that loses etcd fences its group members before its lease can expire (docs/recovery.md).

On the bed: etcd in a namespace of its own, node-a's agent holding a 3 s lease with a 1 s
fencing margin, a group member on node-a printing its wall time every 50 ms. node-a loses
etcd by a blackhole route in its namespace (its jobs and CLI are untouched). An `etcdctl
watch` from outside stamps the moment etcd expires node-a's lease.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import certs
from agent.testing.bed import ETCD_ADDR, Bed, BedAgent, coordination_config, node_bed
from agent.testing.etcd import have_etcd
from agent.testing.poll import wait_for

pytestmark = pytest.mark.skipif(
    not have_etcd(), reason="no etcd binary: `make etcd` installs Debian's etcd-server"
)

TICK = "import time\nwhile True:\n    print(f'{time.time():.3f}', flush=True)\n    time.sleep(0.05)\n"


class Etcdctl:
    """etcdctl from the bed's outside host, with a certificate of the cluster CA."""

    def __init__(self, bed: Bed) -> None:
        self.bed = bed
        if not (bed.pki / "tester.pem").exists():
            certs.issue(bed.pki, "tester", certs.Role.NODE, ["127.0.0.1"])
        self.args = [
            "etcdctl",
            f"--endpoints=https://{ETCD_ADDR}:2379",
            f"--cacert={bed.pki / certs.CA_CERT}",
            f"--cert={bed.pki / 'tester.pem'}",
            f"--key={bed.pki / 'tester-key.pem'}",
        ]

    def __call__(self, *args: str) -> str:
        p = self.bed.outside([*self.args, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = p.communicate(timeout=20)
        assert p.returncode == 0, f"etcdctl {' '.join(args)}: {err}"
        return out

    def deleted_at(self, key: str) -> list[float]:
        """Watch key from now; the list gets the wall time each DELETE of it is seen."""
        p = self.bed.outside([*self.args, "watch", key], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        seen, started = [], threading.Event()

        def read() -> None:
            assert p.stdout is not None
            started.set()
            for line in p.stdout:
                if line.strip() == "DELETE":
                    seen.append(time.time())
            p.wait()

        threading.Thread(target=read, daemon=True).start()
        started.wait(5)
        time.sleep(0.5)  # the watch is established
        self._watches = [*getattr(self, "_watches", []), p]
        return seen

    def close(self) -> None:
        for p in getattr(self, "_watches", []):
            p.kill()


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Bed, BedAgent, Etcdctl]]:
    with node_bed(Path(tmp_path_factory.mktemp("fence"))) as bed:
        bed.etcd()
        a = bed.node("node-a", config=coordination_config(ttl_s=3, margin_s=1.0))
        ctl = Etcdctl(bed)
        wait_for("node-a's key in etcd", lambda: "node-a" in ctl("get", "/ferry/nodes/node-a"), 20)
        try:
            yield bed, a, ctl
        finally:
            ctl.close()


def cut(a: BedAgent) -> None:
    subprocess.run(["ip", "-n", a.netns, "route", "add", "blackhole", f"{ETCD_ADDR}/32"], check=True)


def heal(a: BedAgent) -> None:
    subprocess.run(["ip", "-n", a.netns, "route", "del", "blackhole", f"{ETCD_ADDR}/32"], check=True)


def ticks(a: BedAgent, name: str) -> list[float]:
    return [float(x) for x in a.cli("logs", name).stdout.split()]


def events(a: BedAgent) -> list[dict]:
    return json.loads(a.cli("events", "--json").stdout)


def start_member(a: BedAgent, ctl: Etcdctl, name: str) -> None:
    a.cli("run", "--name", name, "--group", "g1", "--env", "RANK=0", "--", sys.executable, "-c", TICK)
    key = f"/ferry/groups/g1/members/{name}"
    wait_for(f"{name}'s member key", lambda: '"node": "node-a"' in ctl("get", key), 20)


def test_a_partitioned_node_fences_its_member_before_its_lease_expires_and_unfences_it_after(bed) -> None:
    _, a, ctl = bed
    start_member(a, ctl, "m0")
    expired = ctl.deleted_at("/ferry/nodes/node-a")
    cut(a)
    t_cut = time.time()
    try:
        wait_for("node-a's lease to expire", lambda: expired, 30)
        fenced = [e for e in events(a) if e["kind"] == "alert" and "fenced m0" in e["message"]]
        assert fenced, events(a)
        assert a.job("m0")["state"] == "fenced"
        before = ticks(a, "m0")
        time.sleep(1.0)
        assert ticks(a, "m0") == before, "a fenced member printed"
        # Fenced before etcd let the lease go: its last tick is before the expiry.
        assert t_cut < before[-1] < expired[0], (t_cut, before[-1], expired)
        print(f"last tick {before[-1] - t_cut:.2f} s after the cut, expiry {expired[0] - t_cut:.2f} s")
    finally:
        heal(a)
    wait_for("m0 unfenced", lambda: a.job("m0")["state"] == "running", 30)
    wait_for("m0 ticking again", lambda: ticks(a, "m0")[-1] > time.time() - 1, 10)
    assert any("unfenced" in e["message"] for e in events(a) if e["job"] == "m0")


def test_etcd_down_past_the_deadline_fences_and_its_return_unfences_without_an_expiry(bed) -> None:
    b, a, ctl = bed
    wait_for("m0 running", lambda: a.job("m0")["state"] == "running", 10)
    lease = ctl("get", "/ferry/nodes/node-a", "-w", "json")
    assert b.etcd_server is not None
    restarted = time.time()
    b.etcd_server.restart(down_s=3.0)
    wait_for("m0 unfenced after etcd came back", lambda: a.job("m0")["state"] == "running", 30)
    # The lease outlived the restart (etcd renews leases when it elects itself again).
    assert (
        json.loads(ctl("get", "/ferry/nodes/node-a", "-w", "json"))["kvs"][0]["lease"]
        == (json.loads(lease)["kvs"][0]["lease"])
    )
    since = [e["message"] for e in events(a) if e["time"] >= restarted and e["job"] in ("", "m0")]
    assert sum("fenced m0" in m for m in since) == 1, since  # fenced once, for the whole outage
    assert any(m.startswith("unfenced: etcd answered again") for m in since), since


def test_a_member_taken_over_while_fenced_ends_without_running_again(bed) -> None:
    _, a, ctl = bed
    start_member(a, ctl, "m1")
    expired = ctl.deleted_at("/ferry/nodes/node-a")
    cut(a)
    try:
        wait_for("m1 fenced", lambda: a.job("m1")["state"] == "fenced", 30)
        last = ticks(a, "m1")[-1]
        # A recovery acts only once the lease is gone (healed before, the lease lives on and
        # the member is unfenced: no one could have taken it over).
        wait_for("node-a's lease to expire", lambda: expired, 30)
        # What a recovery elsewhere does first: it takes the member's key for its own node.
        ctl("put", "/ferry/groups/g1/members/m1", json.dumps({"node": "node-b", "agent": "10.98.0.2:7070"}))
    finally:
        heal(a)
    wait_for("m1 ended", lambda: a.job("m1")["state"] == "stopped", 30)
    assert "node-b" in a.job("m1")["note"]
    assert ticks(a, "m1")[-1] == last, "the fenced copy ran again"
    assert "node-b" in ctl("get", "/ferry/groups/g1/members/m1")  # its key stays the new node's


def test_a_node_that_dies_shows_its_member_lost_on_the_survivors(bed) -> None:
    b, a, ctl = bed
    ctl("del", "/ferry/groups/g1/members/m1")  # the takeover above was played by hand
    node_b = b.node("node-b", config=coordination_config(ttl_s=3, margin_s=1.0))
    node_b.cli("run", "--name", "b1", "--group", "g1", "--env", "RANK=1", "--", sys.executable, "-c", TICK)
    wait_for("b1's member key", lambda: '"node": "node-b"' in ctl("get", "/ferry/groups/g1/members/b1"), 20)
    killed = time.time()
    b.power_off(node_b)

    def lost() -> list[dict]:
        return [e for e in events(a) if "member b1 (rank 1) on node node-b is lost" in e["message"]]

    wait_for("node-a to find b1 lost", lost, 30)
    print(f"b1 found lost {lost()[0]['time'] - killed:.2f} s after node-b died")
    ps = a.cli("ps", "--group", "g1").stdout
    row = next(line for line in ps.splitlines() if line.startswith("b1 "))
    assert "lost" in row and "node-b" in row and "is dead" in row, ps
    assert "group g1 is degraded: 1 member(s) on a dead node" in ps
    listed = {j["name"]: j for j in json.loads(a.cli("ps", "--group", "g1", "--json").stdout)}
    assert listed["b1"]["state"] == "lost" and listed["m0"]["state"] == "running"


def test_a_member_whose_agent_dies_stops_itself_before_the_lease_expires_and_the_next_agent_settles_it(
    bed,
) -> None:
    _, a, ctl = bed
    wait_for("m0 running", lambda: a.job("m0")["state"] == "running", 10)
    log = Path(a.job("m0")["stdout_path"])  # read directly: the agent will be gone
    expired = ctl.deleted_at("/ferry/nodes/node-a")
    a.stop(sig=signal.SIGKILL)  # the agent dies; the node and its jobs live on
    killed = time.time()
    wait_for("node-a's lease to expire", lambda: expired, 30)
    last = float(log.read_text().split()[-1])
    time.sleep(1.0)
    # Its PID 1's watchdog stopped it before etcd let the lease go, and it stays stopped.
    assert killed < last < expired[0], (killed, last, expired)
    assert float(log.read_text().split()[-1]) == last
    print(f"watchdog stop {last - killed:.2f} s after the agent died, expiry {expired[0] - killed:.2f} s")
    restarted = time.time()
    a.start()
    wait_for("m0 running again", lambda: a.job("m0")["state"] == "running", 30)
    said = [e["message"] for e in events(a) if e["time"] >= restarted]
    assert any(m.startswith("fenced m0: the agent started") for m in said), said
    assert any(m == "unfenced: its key in etcd still names this node" for m in said), said
    wait_for("m0 ticking again", lambda: ticks(a, "m0")[-1] > time.time() - 1, 10)


def test_a_member_frozen_while_its_node_loses_etcd_stays_frozen_and_its_key_settles_it(bed) -> None:
    """Fencing stops running members; a member frozen at the deadline (a checkpoint's dump here,
    a snapshot's hold or a move alike) is passed by. When its freeze ends after the lease is
    gone, it must not go on: a recovery may run it elsewhere by then. It stays frozen, fenced,
    and its key settles it once the node is back (here: another node's, so it ends)."""
    b, _, ctl = bed
    c = b.node(
        "node-c",
        env={"FERRY_PAUSE": "checkpoint-dumped=10"},  # frozen, dumped, for 10 s
        config=coordination_config(ttl_s=3, margin_s=1.0),
    )
    c.cli("run", "--name", "c1", "--group", "g1", "--env", "RANK=2", "--", sys.executable, "-c", TICK)
    wait_for("c1's member key", lambda: '"node": "node-c"' in ctl("get", "/ferry/groups/g1/members/c1"), 20)
    saved: list[subprocess.CompletedProcess[str]] = []
    saving = threading.Thread(
        target=lambda: saved.append(
            c.cli("checkpoint", "c1", "--out", "/tmp/c1.img", "--leave-running", check=False)
        )
    )
    saving.start()
    wait_for("c1 frozen for its checkpoint", lambda: saved or c.job("c1")["state"] == "migrating", 20)
    assert not saved, saved
    time.sleep(1.0)  # the dump is written: the pause holds it frozen
    last = ticks(c, "c1")[-1]
    expired = ctl.deleted_at("/ferry/nodes/node-c")
    cut(c)
    try:
        wait_for("node-c's lease to expire", lambda: expired, 30)
        # What a recovery elsewhere does first: it takes the member's key for its own node.
        ctl("put", "/ferry/groups/g1/members/c1", json.dumps({"node": "node-b", "agent": "10.98.0.2:7070"}))
        saving.join(60)
        assert saved and saved[0].returncode != 0, saved
        said = saved[0].stderr
        assert "stays frozen, fenced" in said and "no live lease" in said, said
        assert "Traceback" not in said, said
        assert c.job("c1")["state"] == "fenced"
        time.sleep(1.0)
        assert ticks(c, "c1")[-1] == last, "the frozen copy went on without a lease"
    finally:
        heal(c)
    wait_for("c1 ended", lambda: c.job("c1")["state"] == "stopped", 30)
    assert "node-b" in c.job("c1")["note"]
    assert ticks(c, "c1")[-1] == last, "the frozen copy ran again"

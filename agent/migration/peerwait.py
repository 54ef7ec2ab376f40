"""How long a moved member's peers went without it: its TCP connections, watched after its release.

A distributed job's peers lose a member at its freeze and have it back not at its release but
when their connections to it carry bytes again: a peer whose retransmissions backed off comes
back up to one backed-off timeout later (the stand-in, agent/jobs/standin.py, keeps that short).
So the target watches the restored job's established connections in its own network namespace
(`nsenter --net=/proc/PID/ns/net ss -tinH state established`), every POLL_S for WINDOW_S after
the release. A restored socket's counters start afresh, so each connection is compared with the
first look:
- the peer reached the job: `bytes_received` grew;
- the job reached the peer: `bytes_acked` grew, counted only for a connection that held
  unacknowledged bytes at the first look (bytes the job sends later say when it chose to send,
  not when its peer came back).
A connection's wait is the later of those that apply, and the measure is the longest over the
connections. One that carried nothing for the whole window is idle (a store connection between
collectives): left out, but counted. One whose held bytes stayed unacknowledged for the whole
window makes the wait at least the window. Connections to the job itself (loopback, its own
address) are not to peers and are not looked at.

Each time is that of the first look that saw the change, taken when the look returns: an upper
bound, by a look's interval and the look itself (two processes, about 5 ms on a 2-core VM). Bytes
that came before the first look are not told apart from the restored ones: such a connection
counts from its next bytes.

The results are kept in memory, by migration id (the last KEEP), for the source to ask for
(GetMigration with `peer_wait_s`): an agent restarted in between has none, and the source then
reports the group's pause as not measured.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import subprocess
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from agent.jobs.record import JobRecord
from agent.migration import tcp_sockets
from agent.migration.limits import is_distributed
from agent.rpc import pb

if TYPE_CHECKING:
    from agent.migration.model import Peer

log = logging.getLogger(__name__)

#: How long the connections are watched after the release: a connection quiet that long is idle.
WINDOW_S = 10.0
#: The interval between looks at first, when the peers come back.
POLL_S = 0.025
#: After this long a peer is late anyway: looks come every SLOW_POLL_S, to spare the node's CPUs
#: (each look starts two processes) for the job and its peers for the rest of the window.
SLOW_AFTER_S = 2.0
SLOW_POLL_S = 0.1
#: One look's bound.
LOOK_TIMEOUT_S = 2.0
#: How long a stopped job's kernel is given to have its sent bytes acknowledged before the cut.
DRAIN_S = 0.2
#: Measures kept for the sources to ask for.
KEEP = 64
#: How much longer than the window an asker may wait for a measure still being taken.
ASK_SLACK_S = 5.0

Key = tuple[str, str]


class Looks(Protocol):
    """A stopped job's sockets, asked again and again (agent.migration.tcp_sockets.Sockets)."""

    def in_flight(self) -> list[str]: ...

    def __enter__(self) -> Looks: ...

    def __exit__(self, *exc: object) -> None: ...


_COUNTER = re.compile(r"(?<![\w])(bytes_received|bytes_acked|unacked):(\d+)")


@dataclass(frozen=True)
class Conn:
    """One established connection as `ss -ti` shows it; a counter it omits is 0."""

    local: str
    peer: str
    received: int = 0  # bytes_received
    acked: int = 0  # bytes_acked
    unacked: int = 0  # segments sent and not yet acknowledged

    @property
    def key(self) -> Key:
        return (self.local, self.peer)


def parse_ss(text: str) -> list[Conn]:
    """`ss -tinH state established`: per connection a line `RECV-Q SEND-Q LOCAL PEER`, then an
    indented line of its counters. Raises ValueError, quoting it, on a line of another shape."""
    out: list[Conn] = []
    head: Key | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if line[0].isspace():  # the counters of the connection above
            if head is None:
                raise ValueError(f"`ss -ti` counters without a connection before them: {line.strip()!r}")
            found = {k: int(v) for k, v in _COUNTER.findall(line)}
            out.append(
                Conn(
                    *head,
                    found.get("bytes_received", 0),
                    found.get("bytes_acked", 0),
                    found.get("unacked", 0),
                )
            )
            head = None
            continue
        if head is not None:
            out.append(Conn(*head))
        fields = line.split()
        if fields and not fields[0].isdigit():  # a State column, when more than one state is asked
            fields = fields[1:]
        if len(fields) < 4 or not (fields[0].isdigit() and fields[1].isdigit()):
            raise ValueError(f"not a connection line of `ss -tinH state established`: {line!r}")
        head = (fields[2], fields[3])
    if head is not None:
        out.append(Conn(*head))
    return out


def host_of(address: str) -> str:
    """`10.0.0.1:80`, `[::1]:80`, `[fe80::1%eth0]:80`, `*:80` → the host alone."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.strip("[]").split("%", 1)[0]


def to_job_itself(peer: str, own: str) -> bool:
    """A connection whose other end is the job itself: loopback, or the job's own address."""
    host = host_of(peer)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or str(ip) == own.split("/", 1)[0]


@dataclass(frozen=True)
class PeerWait:
    """The measure. wait_s: the release to the last resumed connection's contact (<0: none
    resumed; the window when one stayed stuck); not_measured: why there is none ("" if there is)."""

    wait_s: float = -1.0
    connections: int = 0  # to other hosts, at the first look
    resumed: int = 0  # carried the peer's bytes, or had the job's held bytes acknowledged
    silent: int = 0  # carried nothing for the whole window
    stuck: int = 0  # held the job's bytes unacknowledged for the whole window
    window_s: float = 0.0
    not_measured: str = ""

    @property
    def measured(self) -> bool:
        return not self.not_measured and self.wait_s >= 0

    def words(self) -> str:
        """What it says, for the move's result ("not measured: ..." when it says nothing)."""
        if self.not_measured:
            return f"not measured: {self.not_measured}"
        n = self.connections
        if n == 0:
            return "not measured: the job had no connection to another host at its release"
        if self.resumed == 0 and self.stuck == 0:
            return f"not measured: none of its {n} connections carried bytes within {self.window_s:.1f} s"
        parts = [f"{self.resumed} of {n} connections"]
        if self.silent:
            parts.append(f"{self.silent} silent for {self.window_s:.1f} s")
        if self.stuck:
            return (
                f"the peers did not all reach the job within {self.window_s:.1f} s of its release: "
                f"{self.stuck} connection(s) held its bytes unacknowledged ({'; '.join(parts)})"
            )
        return f"the peers reached the job again {self.wait_s:.2f} s after its release ({'; '.join(parts)})"


class Tally:
    """The looks of one watch, in order; the first is the base every later one is compared with."""

    def __init__(self, first: list[Conn], own: str) -> None:
        self.base = {c.key: c for c in first if not to_job_itself(c.peer, own)}
        self.data: dict[Key, float] = {}  # when the peer's bytes first reached the job
        self.ack: dict[Key, float] = {}  # when the job's held bytes were first acknowledged
        self.elapsed = 0.0

    def see(self, t: float, conns: list[Conn]) -> None:
        """A look that returned t seconds after the release."""
        self.elapsed = max(self.elapsed, t)
        for c in conns:
            b = self.base.get(c.key)
            if b is None:  # opened after the release, or not to a peer
                continue
            if c.key not in self.data and c.received > b.received:
                self.data[c.key] = t
            if b.unacked and c.key not in self.ack and c.acked > b.acked:
                self.ack[c.key] = t

    def result(self, window_s: float) -> PeerWait:
        waits: list[float] = []
        silent = stuck = 0
        for key, b in self.base.items():
            if b.unacked and key not in self.ack:
                stuck += 1
            elif key in self.data or key in self.ack:
                waits.append(max(t for t in (self.data.get(key), self.ack.get(key)) if t is not None))
            else:
                silent += 1
        wait = window_s if stuck else max(waits, default=-1.0)
        return PeerWait(wait, len(self.base), len(waits), silent, stuck, window_s)


def watched(rec: JobRecord) -> bool:
    """A member of a distributed job with a job address: its peers reach it there, and the
    target measures how long they went without it (both sides ask this)."""
    return bool(rec.address) and is_distributed(rec)


def drain(
    pids: list[int],
    own: str,
    timeout_s: float = DRAIN_S,
    sockets: Callable[[list[int]], Looks] = tcp_sockets.Sockets,
) -> int:
    """Wait, at most timeout_s, until the stopped job's connections to its peers hold no sent and
    unacknowledged bytes; return how many still do. Its kernel still takes their ACKs: cut then,
    those bytes would wait on the restored socket's first retransmission timeout after the release
    (1 s, since a restored socket has no round-trip time to go by). `pids`: the job's stopped
    tree, root first; `sockets(pids)`: its TCP sockets, found once (the tree is stopped: its fds
    stay), whose `in_flight()` names the peers of those with bytes in flight now."""
    deadline = time.monotonic() + timeout_s
    try:
        with sockets(pids) as socks:
            while True:
                held = [peer for peer in socks.in_flight() if not to_job_itself(peer, own)]
                if not held or time.monotonic() >= deadline:
                    return len(held)
                time.sleep(0.005)
    except (OSError, ValueError) as e:
        log.info("job pid %d: its connections could not be read before the cut (%s)", pids[0], e)
        return -1


def look_ss(pid: int) -> str:
    """The established TCP connections in the network namespace of process pid."""
    cmd = ["nsenter", f"--net=/proc/{pid}/ns/net", "ss", "-tinH", "state", "established"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=LOOK_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise OSError(f"`{' '.join(cmd)}` exited {done.returncode}: {done.stderr.strip()[-300:]}")
    return done.stdout


@dataclass
class _Watch:
    done: threading.Event = field(default_factory=threading.Event)
    result: PeerWait | None = None


class PeerWaits:
    """The target's watches, by migration id: started after a release, asked for by the source."""

    def __init__(
        self,
        look: Callable[[int], str] = look_ss,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        window_s: float = WINDOW_S,
    ) -> None:
        self.look, self.clock, self.sleep, self.window_s = look, clock, sleep, window_s
        self._lock = threading.Lock()
        self._watches: OrderedDict[str, _Watch] = OrderedDict()

    def start(self, mid: str, pid: int, own: str, released: float) -> None:
        """Watch job pid's connections from now (`released`: the clock at its release) on a
        thread of its own; returns at once."""
        watch = _Watch()
        with self._lock:
            self._watches[mid] = watch
            while len(self._watches) > KEEP:
                self._watches.popitem(last=False)
        threading.Thread(
            target=self._watch, args=(mid, watch, pid, own, released), name=f"peerwait-{mid}", daemon=True
        ).start()

    def get(self, mid: str, wait_s: float) -> PeerWait | None:
        """The measure of migration mid, waiting up to wait_s (bounded) for one being taken; None
        when no watch of that id is kept here."""
        with self._lock:
            watch = self._watches.get(mid)
        if watch is None:
            return None
        if not watch.done.wait(max(0.0, min(wait_s, self.window_s + ASK_SLACK_S))):
            return PeerWait(
                not_measured=f"the target was still watching the connections after {wait_s:.1f} s"
            )
        assert watch.result is not None
        return watch.result

    def _watch(self, mid: str, watch: _Watch, pid: int, own: str, released: float) -> None:
        try:
            watch.result = self.measure(pid, own, released)
        except Exception as e:  # a measure never fails anything: it says why it is missing
            watch.result = PeerWait(not_measured=f"cannot see the job's connections: {e}")
        finally:
            watch.done.set()
        log.info("migration %s: the peers' wait: %s", mid, watch.result.words())

    def measure(self, pid: int, own: str, released: float) -> PeerWait:
        """Look until the window ends, or until the job's namespace is gone (its connections as
        last seen then stand, over the time watched)."""
        tally = Tally(parse_ss(self.look(pid)), own)
        tally.see(self.clock() - released, [])
        while (t := self.clock() - released) < self.window_s:
            self.sleep(POLL_S if t < SLOW_AFTER_S else SLOW_POLL_S)
            try:
                conns = parse_ss(self.look(pid))
            except (OSError, subprocess.SubprocessError) as e:
                log.info("job pid %d: its connections are no longer seen (%s); the watch ends", pid, e)
                return tally.result(tally.elapsed)
            tally.see(self.clock() - released, conns)
        return tally.result(self.window_s)


# -- the source's side -------------------------------------------------------------------------

#: How long a source waits for the target's measure: the window and some, from its commit answer
#: (the watch started at the release, before that answer).
ASK_WAIT_S = WINDOW_S + 2.0


def from_pb(m: pb.PeerWait) -> PeerWait:
    return PeerWait(m.wait_s, m.connections, m.resumed, m.silent, m.stuck, m.window_s, m.not_measured)


def ask(peer: Peer, mid: str, wait_s: float = ASK_WAIT_S) -> PeerWait:
    """The target's measure of migration mid (GetMigration with peer_wait_s); never raises: a
    failure is the measure's `not_measured`."""
    try:
        got = peer.peer_wait(mid, wait_s)
    except Exception as e:  # the move is done: its measure is only missing
        return PeerWait(not_measured=f"the target did not give it: {e}")
    if got is None:
        return PeerWait(not_measured="the target sent none (an agent that does not measure it)")
    return from_pb(got)

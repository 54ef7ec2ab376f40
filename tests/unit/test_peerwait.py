"""How long a moved member's peers went without it (agent.migration.peerwait): `ss -tinH` as it
really prints, the tally over a watch's looks, the watch on its thread, and the source's ask
(through the real GetMigration of an in-process agent too)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from agent import client
from agent.errors import UnavailableError
from agent.migration import peerwait
from agent.migration.journal import TARGET, MigrationRecord
from agent.migration.peerwait import Conn, PeerWait, PeerWaits, Tally, parse_ss
from agent.rpc import pb
from agent.service.convert import peer_wait_pb

JOB = "10.77.0.1"
HELD_CONN = ("10.77.0.1:40554", "10.77.0.2:29500")
IDLE_CONN = ("10.77.0.1:40560", "10.77.0.2:29500")

#: Two namespaces on a veth pair, the job's end at 10.77.0.1 (captured here with iproute2 6.1):
#: a connection carrying data whose peer's link was just set down (3 segments unacknowledged),
#: an idle one, and a loopback pair inside the job's namespace. ss pads its lines with spaces
#: (stripped here: the tests add them back).
HELD = (
    "0      3000   10.77.0.1:40554 10.77.0.2:29500\n"
    "\t bbr wscale:10,10 rto:408 backoff:1 rtt:0.02/0.011 ato:40 mss:1448 pmtu:1500 rcvmss:120"
    "0 advmss:1448 cwnd:1 bytes_sent:3700 bytes_acked:701 bytes_received:1200 segs_out:7 segs"
    "_in:3 data_segs_out:4 data_segs_in:1 bbr:(bw:5792000000bps,mrtt:0.002,pacing_gain:2.8867"
    "2,cwnd_gain:2.88672) send 579200000bps lastsnd:304 lastrcv:508 lastack:508 pacing_rate 1"
    "6552676248bps delivery_rate 5792000000bps delivered:2 app_limited busy:304ms unacked:3 l"
    "ost:3 rcv_space:14480 rcv_ssthresh:67408 minrtt:0.002 snd_wnd:65536\n"
    "0      0      10.77.0.1:40560 10.77.0.2:29500\n"
    "\t bbr wscale:10,10 rto:204 rtt:0.003/0.001 mss:1448 pmtu:1500 rcvmss:536 advmss:1448 cwn"
    "d:10 bytes_acked:1 segs_out:2 segs_in:1 bbr:(bw:0bps,mrtt:0.003,pacing_gain:1,cwnd_gain:"
    "1) send 38613333333bps lastsnd:508 lastrcv:508 lastack:508 pacing_rate 110351174336bps d"
    "elivered:1 app_limited rcv_space:14480 rcv_ssthresh:64088 minrtt:0.003 snd_wnd:65160\n"
    "0      0      127.0.0.1:42418 127.0.0.1:29501\n"
    "\t bbr wscale:10,10 rto:204 rtt:0.032/0.018 mss:32768 pmtu:65535 rcvmss:536 advmss:65483 "
    "cwnd:11 bytes_sent:40 bytes_acked:41 segs_out:3 segs_in:2 data_segs_out:1 bbr:(bw:436906"
    "56248bps,mrtt:0.006,pacing_gain:2.88672,cwnd_gain:2.88672) send 90112000000bps lastsnd:5"
    "08 lastrcv:508 lastack:508 pacing_rate 207930894200bps delivery_rate 43690666664bps deli"
    "vered:2 app_limited rcv_space:65495 rcv_ssthresh:65495 minrtt:0.006 snd_wnd:65536\n"
    "0      0      127.0.0.1:29501 127.0.0.1:42418\n"
    "\t bbr wscale:10,10 rto:204 rtt:0.017/0.008 ato:40 mss:32768 pmtu:65535 rcvmss:536 advmss"
    ":65483 cwnd:10 bytes_received:40 segs_out:1 segs_in:3 data_segs_in:1 bbr:(bw:0bps,mrtt:0"
    ".017) send 154202352941bps lastsnd:508 lastrcv:508 lastack:508 pacing_rate 440687409024b"
    "ps delivered:1 app_limited rcv_space:65483 rcv_ssthresh:65483 minrtt:0.017 snd_wnd:65536"
    "\n"
)

#: The same 1.5 s after the peer's link came back: its 500 bytes came, the 3000 were acknowledged.
AFTER = (
    "500    0      10.77.0.1:40554 10.77.0.2:29500\n"
    "\t bbr wscale:10,10 rto:900 rtt:99.642/199.254 ato:40 mss:1448 pmtu:1500 rcvmss:1200 advm"
    "ss:1448 cwnd:14 bytes_sent:5148 bytes_retrans:1448 bytes_acked:3701 bytes_received:1700 "
    "segs_out:9 segs_in:16 data_segs_out:5 data_segs_in:13 bbr:(bw:5792000000bps,mrtt:0.002,p"
    "acing_gain:2.88672,cwnd_gain:2.88672) send 1627587bps lastsnd:1016 lastrcv:1016 lastack:"
    "1004 pacing_rate 16552676248bps delivery_rate 5792000000bps delivered:6 app_limited busy"
    ":796ms retrans:0/1 dsack_dups:1 rcv_space:14480 rcv_ssthresh:75544 minrtt:0.002 snd_wnd:"
    "71680\n"
    "0      0      10.77.0.1:40560 10.77.0.2:29500\n"
    "\t bbr wscale:10,10 rto:204 rtt:0.003/0.001 mss:1448 pmtu:1500 rcvmss:536 advmss:1448 cwn"
    "d:10 bytes_acked:1 segs_out:2 segs_in:1 bbr:(bw:0bps,mrtt:0.003,pacing_gain:1,cwnd_gain:"
    "1) send 38613333333bps lastsnd:2016 lastrcv:2016 lastack:2016 pacing_rate 110351174336bp"
    "s delivered:1 app_limited rcv_space:14480 rcv_ssthresh:64088 minrtt:0.003 snd_wnd:65160\n"
    "0      0      127.0.0.1:42418 127.0.0.1:29501\n"
    "\t bbr wscale:10,10 rto:204 rtt:0.032/0.018 mss:32768 pmtu:65535 rcvmss:536 advmss:65483 "
    "cwnd:11 bytes_sent:40 bytes_acked:41 segs_out:3 segs_in:2 data_segs_out:1 bbr:(bw:436906"
    "56248bps,mrtt:0.006,pacing_gain:2.88672,cwnd_gain:2.88672) send 90112000000bps lastsnd:2"
    "016 lastrcv:2016 lastack:2016 pacing_rate 207930894200bps delivery_rate 43690666664bps d"
    "elivered:2 app_limited rcv_space:65495 rcv_ssthresh:65495 minrtt:0.006 snd_wnd:65536\n"
    "0      0      127.0.0.1:29501 127.0.0.1:42418\n"
    "\t bbr wscale:10,10 rto:204 rtt:0.017/0.008 ato:40 mss:32768 pmtu:65535 rcvmss:536 advmss"
    ":65483 cwnd:10 bytes_received:40 segs_out:1 segs_in:3 data_segs_in:1 bbr:(bw:0bps,mrtt:0"
    ".017) send 154202352941bps lastsnd:2016 lastrcv:2016 lastack:2016 pacing_rate 4406874090"
    "24bps delivered:1 app_limited rcv_space:65483 rcv_ssthresh:65483 minrtt:0.017 snd_wnd:65"
    "536\n"
)

#: Loopback, one namespace: counters that are 0 are left out (no bytes_received, no bytes_acked).
LOOPBACK = (
    "0      0      127.0.0.1:45311 127.0.0.1:38116\n"
    "\t bbr wscale:10,10 rto:200 rtt:0.003/0.001 mss:32768 pmtu:65535 rcvmss:536 advmss:65483 "
    "cwnd:10 segs_in:2 bbr:(bw:0bps,mrtt:0.003) send 873813333333bps lastsnd:4 lastrcv:4 last"
    "ack:4 pacing_rate 2497228785112bps delivered:1 app_limited rcv_space:65483 rcv_ssthresh:"
    "65483 minrtt:0.003 snd_wnd:65536\n"
    "0      0      127.0.0.1:45311 127.0.0.1:38110\n"
    "\t bbr wscale:10,10 rto:204 rtt:0.015/0.009 ato:40 mss:32768 pmtu:65535 rcvmss:5000 advms"
    "s:65483 cwnd:11 bytes_sent:300 bytes_acked:300 bytes_received:5000 segs_out:2 segs_in:4 "
    "data_segs_out:1 data_segs_in:1 bbr:(bw:262144000000bps,mrtt:0.001,pacing_gain:2.88672,cw"
    "nd_gain:2.88672) send 192238933333bps lastsnd:4 lastrcv:4 lastack:4 pacing_rate 74916864"
    "0000bps delivery_rate 262144000000bps delivered:2 app_limited rcv_space:65483 rcv_ssthre"
    "sh:107138 minrtt:0.001 snd_wnd:65536\n"
)


def padded(text: str) -> str:
    """As ss prints it: each counter line padded with spaces."""
    return "".join(
        line + " " * 37 + "\n" if line.startswith("\t") else line + "\n" for line in text.splitlines()
    )


# -- parsing ----------------------------------------------------------------------------------


def test_each_connection_is_its_addresses_and_counters() -> None:
    conns = parse_ss(padded(HELD))
    assert [c.key for c in conns] == [
        HELD_CONN,
        IDLE_CONN,
        ("127.0.0.1:42418", "127.0.0.1:29501"),
        ("127.0.0.1:29501", "127.0.0.1:42418"),
    ]
    held, idle, lo_out, lo_in = conns
    assert (held.received, held.acked, held.unacked) == (1200, 701, 3)
    # A counter ss leaves out is 0; bytes_acked counts the SYN.
    assert (idle.received, idle.acked, idle.unacked) == (0, 1, 0)
    assert (lo_out.received, lo_out.acked) == (0, 41)
    assert (lo_in.received, lo_in.acked) == (40, 0)


def test_the_counters_after_the_peer_came_back() -> None:
    held = parse_ss(AFTER)[0]
    assert held.key == HELD_CONN
    assert (held.received, held.acked, held.unacked) == (1700, 3701, 0)  # bytes_retrans is not acked


def test_loopback_connections_with_counters_left_out() -> None:
    first, second = parse_ss(LOOPBACK)
    assert first == Conn("127.0.0.1:45311", "127.0.0.1:38116", 0, 0, 0)
    assert (second.received, second.acked) == (5000, 300)


def test_nothing_established_is_no_connection() -> None:
    assert parse_ss("") == []


def test_a_state_column_is_skipped_and_a_connection_without_counters_kept() -> None:
    conns = parse_ss("ESTAB 0 0 10.0.0.1:1 10.0.0.2:2\nESTAB 0 0 10.0.0.1:3 10.0.0.2:4\n")
    assert [(c.key, c.received) for c in conns] == [
        (("10.0.0.1:1", "10.0.0.2:2"), 0),
        (("10.0.0.1:3", "10.0.0.2:4"), 0),
    ]


@pytest.mark.parametrize(
    "text, said",
    [
        ("Cannot open netns\n", "not a connection line"),
        ("0 0 10.0.0.1:1\n", "not a connection line"),
        ("\t bytes_received:5\n", "counters without a connection"),
    ],
)
def test_output_of_another_shape_is_refused_with_the_line(text: str, said: str) -> None:
    with pytest.raises(ValueError, match=said) as e:
        parse_ss(text)
    assert text.strip()[:10] in str(e.value)


@pytest.mark.parametrize(
    "peer, own, itself",
    [
        ("127.0.0.1:29500", JOB, True),
        ("[::1]:29500", JOB, True),
        ("[::ffff:127.0.0.1]:29500", JOB, True),
        ("10.77.0.1:29500", "10.77.0.1/24", True),  # its own address: a connection to itself
        ("[::ffff:10.77.0.1]:80", JOB, True),
        ("10.77.0.2:29500", JOB, False),
        ("[fe80::1%eth0]:80", JOB, False),
        ("*:80", JOB, False),
    ],
)
def test_connections_to_the_job_itself_are_not_to_peers(peer: str, own: str, itself: bool) -> None:
    assert peerwait.to_job_itself(peer, own) is itself


# -- the tally --------------------------------------------------------------------------------


def test_the_real_looks_measure_the_held_connection_and_count_the_idle_one() -> None:
    tally = Tally(parse_ss(HELD), JOB)
    tally.see(0.05, parse_ss(HELD))  # nothing yet
    tally.see(0.21, parse_ss(AFTER))
    w = tally.result(10.0)
    assert w == PeerWait(0.21, connections=2, resumed=1, silent=1, stuck=0, window_s=10.0)
    assert w.measured
    assert w.words() == (
        "the peers reached the job again 0.21 s after its release (1 of 2 connections; 1 silent for 10.0 s)"
    )


def conn(key: tuple[str, str], received: int = 0, acked: int = 1, unacked: int = 0) -> Conn:
    return Conn(*key, received, acked, unacked)


def test_a_connection_waits_for_the_later_of_its_peers_bytes_and_its_own_acknowledged() -> None:
    tally = Tally([conn(HELD_CONN, 100, 50, unacked=2)], JOB)
    tally.see(0.10, [conn(HELD_CONN, 180, 50, unacked=2)])  # the peer's bytes came
    tally.see(0.30, [conn(HELD_CONN, 180, 90)])  # then its own were acknowledged
    tally.see(0.50, [conn(HELD_CONN, 400, 200)])  # later ones change nothing
    assert tally.result(10.0).wait_s == 0.30


def test_acknowledged_bytes_count_only_where_the_job_held_some_at_the_first_look() -> None:
    """Bytes the job sends later say when it chose to send, not when its peer came back."""
    tally = Tally([conn(HELD_CONN, 100, 50), conn(IDLE_CONN)], JOB)
    tally.see(0.40, [conn(HELD_CONN, 100, 900), conn(IDLE_CONN, 0, 30)])
    w = tally.result(10.0)
    assert (w.wait_s, w.resumed, w.silent) == (-1.0, 0, 2)
    assert not w.measured
    assert w.words() == "not measured: none of its 2 connections carried bytes within 10.0 s"


def test_held_bytes_never_acknowledged_make_the_wait_the_whole_window() -> None:
    tally = Tally([conn(HELD_CONN, 100, 50, unacked=3), conn(IDLE_CONN, 0)], JOB)
    tally.see(0.2, [conn(HELD_CONN, 300, 50, unacked=3), conn(IDLE_CONN, 10)])  # bytes in, none acked
    w = tally.result(10.0)
    assert (w.wait_s, w.resumed, w.stuck) == (10.0, 1, 1)
    assert w.measured
    assert "did not all reach the job within 10.0 s" in w.words() and "1 connection(s)" in w.words()


def test_connections_opened_after_the_release_or_to_the_job_itself_are_not_looked_at() -> None:
    lo = ("127.0.0.1:1", "127.0.0.1:2")
    tally = Tally([conn(HELD_CONN), conn(lo)], JOB)
    new = ("10.77.0.1:5", "10.77.0.3:29500")
    tally.see(0.1, [conn(HELD_CONN, 10), conn(lo, 99), conn(new, 99)])
    assert tally.result(10.0) == PeerWait(0.1, 1, 1, 0, 0, 10.0)


def test_a_job_without_peer_connections_is_not_measured() -> None:
    w = Tally(parse_ss(LOOPBACK), "10.1.0.1").result(10.0)
    assert w.connections == 0 and not w.measured
    assert w.words() == "not measured: the job had no connection to another host at its release"


# -- the watch ---------------------------------------------------------------------------------


class Looks:
    """ss's answers in turn (an exception is raised), on a clock that each look (5 ms) and each
    sleep moves on."""

    def __init__(self, answers: list[str | BaseException], step: float = 0.005) -> None:
        self.answers = answers
        self.now = 100.0
        self.step = step
        self.pids: list[int] = []
        self.slept: list[tuple[float, float]] = []  # (since the release, how long)

    def look(self, pid: int) -> str:
        self.pids.append(pid)
        self.now += self.step
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def sleep(self, s: float) -> None:
        self.slept.append((self.now - 100.0, s))
        self.now += s

    def waits(self, window_s: float = 1.0) -> PeerWaits:
        return PeerWaits(self.look, lambda: self.now, self.sleep, window_s=window_s)


def test_a_watch_looks_in_the_jobs_namespace_until_the_window_ends() -> None:
    looks = Looks([HELD, HELD, HELD, AFTER])
    waits = looks.waits(window_s=3.0)
    waits.start("m1", 4242, JOB, released=100.0)
    w = waits.get("m1", 5.0)
    assert w is not None
    assert w.wait_s == pytest.approx(0.005 + 3 * 0.030)  # the fourth look: 25 ms apart, 5 ms each
    assert (w.connections, w.resumed, w.silent, w.window_s) == (2, 1, 1, 3.0)
    assert set(looks.pids) == {4242}
    # Every 25 ms while the peers come back, every 100 ms after 2 s, until the window ends.
    assert {s for t, s in looks.slept if t < peerwait.SLOW_AFTER_S} == {peerwait.POLL_S}
    assert {s for t, s in looks.slept if t >= peerwait.SLOW_AFTER_S} == {peerwait.SLOW_POLL_S}
    assert looks.now - 100.0 >= 3.0 > looks.slept[-1][0]


def test_a_job_gone_during_the_watch_ends_it_with_what_was_seen() -> None:
    looks = Looks([HELD, AFTER, OSError("nsenter: cannot open /proc/4242/ns/net")])
    waits = looks.waits()
    waits.start("m1", 4242, JOB, released=100.0)
    w = waits.get("m1", 5.0)
    assert w is not None and w.measured
    assert (w.wait_s, w.window_s) == (pytest.approx(0.035), pytest.approx(0.035))


def test_a_watch_that_cannot_look_says_why() -> None:
    waits = Looks([FileNotFoundError("nsenter")]).waits()
    waits.start("m1", 4242, JOB, released=100.0)
    w = waits.get("m1", 5.0)
    assert w is not None and not w.measured
    assert w.words() == "not measured: cannot see the job's connections: nsenter"


def test_an_unknown_id_has_no_measure_and_one_still_taken_says_so() -> None:
    gate = threading.Event()

    def slow(pid: int) -> str:
        gate.wait(10)
        return HELD

    waits = PeerWaits(slow, window_s=0.05)
    assert waits.get("nope", 1.0) is None
    waits.start("m1", 1, JOB, released=time.monotonic())
    w = waits.get("m1", 0.05)
    assert w is not None and w.words() == (
        "not measured: the target was still watching the connections after 0.1 s"
    )
    gate.set()
    later = waits.get("m1", 5.0)
    assert later is not None and later.not_measured == ""


def test_only_the_last_measures_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peerwait, "KEEP", 3)
    waits = Looks([""]).waits(window_s=0.0)
    for i in range(5):
        waits.start(f"m{i}", 1, JOB, 100.0)
    assert [waits.get(f"m{i}", 1.0) is None for i in range(5)] == [True, True, False, False, False]


def test_the_real_look_of_a_namespace_that_is_not_there_fails() -> None:
    with pytest.raises(OSError, match="exited"):
        peerwait.look_ss(2**22 + 12345)  # above any pid_max: no /proc entry


# -- the source's ask ------------------------------------------------------------------------------


class AskedPeer:
    def __init__(self, answer: pb.PeerWait | BaseException | None) -> None:
        self.answer = answer
        self.asked: list[tuple[str, float]] = []

    def peer_wait(self, migration_id: str, wait_s: float) -> pb.PeerWait | None:
        self.asked.append((migration_id, wait_s))
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def test_the_source_asks_for_the_measure_and_waits_the_window_and_some() -> None:
    measure = PeerWait(0.21, 4, 3, 1, 0, 10.0)
    peer = AskedPeer(peer_wait_pb(measure))
    assert peerwait.ask(peer, "m1") == measure
    assert peer.asked == [("m1", peerwait.WINDOW_S + 2.0)]


def test_a_failed_ask_is_a_missing_measure_not_an_error() -> None:
    peer = AskedPeer(UnavailableError("agent 10.0.0.2:7070 is unreachable: connection refused"))
    w = peerwait.ask(peer, "m1")
    assert not w.measured
    assert w.words() == (
        "not measured: the target did not give it: agent 10.0.0.2:7070 is unreachable: connection refused"
    )


def test_a_target_that_sends_no_measure_is_named() -> None:
    w = peerwait.ask(AskedPeer(None), "m1")
    assert w.words() == "not measured: the target sent none (an agent that does not measure it)"


def test_the_measure_crosses_the_wire_unchanged() -> None:
    for w in (
        PeerWait(0.5, 3, 2, 1, 0, 10.0),
        PeerWait(10.0, 2, 1, 0, 1, 10.0),
        PeerWait(not_measured="why"),
    ):
        assert peerwait.from_pb(peer_wait_pb(w)) == w


def test_getmigration_of_a_real_agent_waits_for_the_measure(agent) -> None:
    """PeerClient's way: GetMigration with peer_wait_s, on the agent's server."""
    svc, address, _ = agent
    svc.journal.save(MigrationRecord("m1", TARGET, "train", "running"))
    looks = Looks([HELD, HELD, AFTER])
    svc.targets.peer_waits.look, svc.targets.peer_waits.clock = looks.look, lambda: looks.now
    svc.targets.peer_waits.sleep, svc.targets.peer_waits.window_s = lambda s: time.sleep(0.01), 0.5
    svc.targets.peer_waits.start("m1", 4242, JOB, released=100.0)
    peer = client.PeerClient(address, client.Dial(insecure=True))
    w = peerwait.ask(peer, "m1", wait_s=5.0)
    assert (w.wait_s, w.resumed, w.silent) == (pytest.approx(0.015), 1, 1), w
    # The fencing query is unchanged: the state alone, at once.
    assert peer.status("m1") == pb.TARGET_STATE_RUNNING
    # A migration this node never saw, and one that came here without a watch.
    assert "no migration 'm2'" in peerwait.ask(peer, "m2", wait_s=1.0).words()
    svc.journal.save(MigrationRecord("m3", TARGET, "solo", "running"))
    assert "has no measure of migration m3" in peerwait.ask(peer, "m3", wait_s=1.0).words()


# -- the drain before the cut ------------------------------------------------------------------


def in_flight(ss_text: str) -> list[str]:
    """What tcp_sockets.Sockets.in_flight would say of the connections `ss -ti` shows."""
    return [c.peer for c in peerwait.parse_ss(ss_text) if c.unacked]


@dataclass
class Looked:
    """A stopped job's sockets as the drain sees them: each look the next of `texts`."""

    texts: Iterator[str]
    opened: int = 0
    closed: bool = False

    def __call__(self, pids: list[int]) -> Looked:
        assert pids == [4242]
        self.opened += 1
        return self

    def in_flight(self) -> list[str]:
        return in_flight(next(self.texts))

    def __enter__(self) -> Looked:
        return self

    def __exit__(self, *exc: object) -> None:
        self.closed = True


def test_the_drain_waits_until_the_held_bytes_are_acknowledged() -> None:
    looks = iter([HELD, HELD, AFTER])
    looked = Looked(looks)
    assert peerwait.drain([4242], JOB, timeout_s=5.0, sockets=looked) == 0
    assert next(looks, None) is None  # it looked until nothing was held, not longer
    assert looked.opened == 1 and looked.closed  # the stopped tree's sockets found once, let go


def test_the_drain_is_bounded_and_says_how_many_still_hold_bytes() -> None:
    t0 = time.monotonic()
    held = peerwait.drain([4242], JOB, timeout_s=0.05, sockets=Looked(itertools.repeat(HELD)))
    assert held == 1  # loopback not counted
    assert time.monotonic() - t0 < 1.0


def test_a_drain_that_cannot_look_goes_on_at_once() -> None:
    def fails(pids: list[int]) -> Looked:
        raise OSError("[Errno 2] No such file or directory: '/proc/4242/fd'")

    assert peerwait.drain([4242], JOB, timeout_s=5.0, sockets=fails) == -1

    class Gone(Looked):
        def in_flight(self) -> list[str]:
            raise OSError("[Errno 9] Bad file descriptor")

    gone = Gone(iter([]))
    assert peerwait.drain([4242], JOB, timeout_s=5.0, sockets=gone) == -1 and gone.closed

"""While a job's link is cut, a stand-in on the node's bridge tells its peers "host unreachable".

A peer with bytes in flight to a frozen member retransmits with exponential back-off (about
200 ms, then 400 ms, doubling up to 120 s): after a 4 s freeze its next try can be 3 s away,
and the peers' pause is the frozen time plus that wait. RFC 6069: an ICMP host-unreachable for
the segment a sender is retransmitting says the path, not congestion, lost it, and Linux
(tcp_ld_RTO_revert) then undoes one back-off step, retransmitting at once if the reverted timer
has already run out. So while the link is cut the stand-in answers each TCP segment that
carries data for the job's address with one: the peers keep retrying at their base timeout
and reach the job about that long after it runs again, wherever it runs. Giving up is not
brought forward (tcp_retries2 is counted in time since the first retransmission, not in tries),
and for an established connection the message is only a soft error. A SYN is never answered:
a connection being opened would fail at once instead of retrying until the job is back.

The job's own retransmissions need the same: a member whose drain ran out (a snapshot round cuts
its peers at about the same moment) is cut with bytes unacknowledged, and its kernel retries
them into its cut link, backing off too (a 0.6 s freeze put the next try 0.8 s past the
release). A second stand-in listens on the link's node end, cut off the bridge, and answers the
job's segments for its peers the same way, back into the link (`of_job`).

Opening a stand-in's socket and closing it take the kernel some milliseconds each (a packet
socket's promiscuous membership, the grace period its close waits for): tens of them on a busy
node, twice per freeze. So a snapshot opens them before its member stops, unarmed (they answer
nothing while the link carries the job), arms them at the cut, disarms them at the release and
closes them once the member runs again (agent.jobs.network.LinkLock).
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import socket
import struct
import threading
import time

log = logging.getLogger(__name__)

_ETH_P_IP = 0x0800
_SOL_PACKET = 263
_PACKET_ADD_MEMBERSHIP = 1
_PACKET_MR_PROMISC = 1
_PACKET_OUTGOING = 4
_SO_ATTACH_FILTER = 26
_ETH = 14
_TCP, _ICMP = 6, 1
_SYN, _FIN, _RST = 0x02, 0x01, 0x04
#: ICMP destination unreachable, code 1: host unreachable (the code RFC 6069 acts on).
_UNREACH, _HOST = 3, 1
#: Enough of a frame for an IPv4 header with options and a TCP header with options.
_SNAP = 14 + 60 + 60
#: No more answers than this a second, whatever arrives (the stand-in must never flood).
MAX_PER_S = 2000


#: Where in a frame the IPv4 destination and source addresses are.
_DST, _SRC = _ETH + 16, _ETH + 12


def _filter(address: bytes, at: int = _DST) -> bytes:
    """Classic BPF: IPv4 to `address` (from it, with at=_SRC), protocol TCP, the first _SNAP
    bytes; else nothing. The bridge carries every job's traffic: the kernel, not Python, drops
    what is not ours."""

    def op(code: int, jt: int, jf: int, k: int) -> bytes:
        return struct.pack("HBBI", code, jt, jf, k)

    return b"".join(
        [
            op(0x28, 0, 0, 12),  # ldh [12]: the EtherType
            op(0x15, 0, 5, _ETH_P_IP),  # jeq IPv4, else drop
            op(0x20, 0, 0, at),  # ld [at]: the IPv4 destination (or source)
            op(0x15, 0, 3, struct.unpack("!I", address)[0]),
            op(0x30, 0, 0, 23),  # ldb [23]: the IPv4 protocol
            op(0x15, 0, 1, _TCP),
            op(0x06, 0, 0, _SNAP),  # ret: keep the headers
            op(0x06, 0, 0, 0),  # ret 0: drop
        ]
    )


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def answer(frame: bytes) -> bytes | None:
    """The Ethernet frame that tells the sender of `frame` its destination is unreachable, or
    None for a frame that gets no answer (not TCP over IPv4, no data or FIN, a SYN or an RST)."""
    if len(frame) < _ETH + 20 or frame[12:14] != b"\x08\x00":
        return None
    ip = frame[_ETH:]
    ihl = (ip[0] & 0x0F) * 4
    if ip[0] >> 4 != 4 or ihl < 20 or ip[9] != _TCP or len(ip) < ihl + 20:
        return None
    tcp = ip[ihl:]
    flags, doff = tcp[13], (tcp[12] >> 4) * 4
    data_len = struct.unpack("!H", ip[2:4])[0] - ihl - doff
    if flags & (_SYN | _RST) or (data_len <= 0 and not flags & _FIN):
        return None
    quoted = ip[: ihl + 8]  # the header and the ports and sequence number: what TCP matches on
    icmp = struct.pack("!BBHI", _UNREACH, _HOST, 0, 0) + quoted
    icmp = icmp[:2] + struct.pack("!H", _checksum(icmp)) + icmp[4:]
    src, dst = ip[16:20], ip[12:16]  # from the segment's destination, to its sender
    hdr = struct.pack("!BBHHHBBH4s4s", 0x45, 0xC0, 20 + len(icmp), 0, 0, 64, _ICMP, 0, src, dst)
    hdr = hdr[:10] + struct.pack("!H", _checksum(hdr)) + hdr[12:]
    eth = frame[6:12] + frame[0:6] + b"\x08\x00"  # back to the sender, from the MAC it sent to
    return eth + hdr + icmp


class StandIn:
    """Answers for `address` on `bridge` from start() to stop(), on a thread of its own, in the
    network namespace of the thread that calls start() (the node's, where the bridge is).
    of_job: `bridge` is the job's cut link (its node end) and the segments answered are the
    job's own, sent from `address` to its peers; the answers go back into the link."""

    def __init__(self, bridge: str, address: str, of_job: bool = False) -> None:
        self.bridge, self.address, self.of_job = bridge, address, of_job
        self._at = _SRC if of_job else _DST
        self.answered = 0
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._wake: tuple[int, int] | None = None  # a pipe: stop() wakes the loop's select at once
        self._armed = False
        self._send_lock = threading.Lock()  # an answer is sent only while armed, checked under it

    def start(self, armed: bool = True) -> None:
        """Listen (and answer, once armed). Raises OSError if the bridge cannot be listened on
        (the caller goes on without it)."""
        sk = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_IP))
        try:
            prog = _filter(socket.inet_aton(self.address), self._at)
            buf = ctypes.create_string_buffer(prog)
            sk.setsockopt(
                socket.SOL_SOCKET, _SO_ATTACH_FILTER, struct.pack("HL", len(prog) // 8, ctypes.addressof(buf))
            )
            sk.bind((self.bridge, _ETH_P_IP))  # Python swaps this one itself
            # Cut off the bridge, the job's MAC is unknown there: frames for it are flooded, and
            # reach the bridge's own device only when it listens to everything. (On the job's
            # own link, its frames are for its peers' MACs: the same.)
            index = socket.if_nametoindex(self.bridge)
            mreq = struct.pack("iHH8s", index, _PACKET_MR_PROMISC, 0, b"")
            sk.setsockopt(_SOL_PACKET, _PACKET_ADD_MEMBERSHIP, mreq)
            sk.setblocking(False)
        except OSError:
            sk.close()
            raise
        self._sock = sk
        self._armed = armed
        self._wake = os.pipe()
        self._thread = threading.Thread(target=self._run, name=f"standin-{self.address}", daemon=True)
        self._thread.start()

    def arm(self) -> None:
        with self._send_lock:
            self._armed = True

    def disarm(self) -> None:
        """No answer is sent once this returns."""
        with self._send_lock:
            self._armed = False

    def retire(self) -> None:
        """Disarmed now; its socket and thread end on a thread of their own, the caller not
        waiting for the kernel's grace period."""
        self.disarm()
        threading.Thread(target=self.stop, name=f"standin-{self.address}-end", daemon=True).start()

    def stop(self) -> None:
        """Ends at once."""
        self.disarm()
        self._stop.set()
        if self._wake is not None:
            os.write(self._wake[1], b"x")
        if self._thread is not None:
            self._thread.join(5.0)
        if self._sock is not None:
            self._sock.close()  # drops the promiscuous membership with it
        if self._wake is not None:
            for fd in self._wake:
                os.close(fd)
            self._wake = None
        if self.answered:
            log.info(
                "stand-in for %s on %s: %d %s segments answered",
                self.address,
                self.bridge,
                self.answered,
                "job" if self.of_job else "peer",
            )

    def _run(self) -> None:
        sk, wake = self._sock, self._wake
        assert sk is not None and wake is not None
        second, sent = int(time.monotonic()), 0
        while not self._stop.is_set():
            if sk not in select.select([sk, wake[0]], [], [], 1.0)[0]:
                continue
            try:
                frame, addr = sk.recvfrom(_SNAP)
            except BlockingIOError:
                continue
            except OSError as e:  # retired, its link may be gone before its socket closes
                (log.warning if self._armed else log.debug)(
                    "stand-in for %s on %s ends: %s", self.address, self.bridge, e
                )
                return
            if addr[2] == _PACKET_OUTGOING or frame[self._at : self._at + 4] != socket.inet_aton(
                self.address
            ):
                continue
            reply = answer(frame)
            if reply is None:
                continue
            now = int(time.monotonic())
            second, sent = (now, 0) if now != second else (second, sent)
            if sent >= MAX_PER_S:
                continue
            with self._send_lock:
                if not self._armed:  # opened ahead of the cut, or past the release: the link carries
                    continue
                try:
                    sk.send(reply)
                    sent += 1
                    self.answered += 1
                except OSError as e:  # a full queue: the peer just backs off as it would have
                    log.debug("stand-in for %s: %s", self.address, e)

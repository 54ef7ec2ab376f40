"""The stand-in's answer to a peer's segment: an ICMP host-unreachable Linux will act on."""

from __future__ import annotations

import socket
import struct

from agent.jobs import standin

JOB, PEER = socket.inet_aton("10.98.2.1"), socket.inet_aton("10.98.1.1")
JOB_MAC, PEER_MAC = bytes.fromhex("02aabbccddee"), bytes.fromhex("021122334455")


def segment(flags: int = 0x18, payload: bytes = b"x" * 100, seq: int = 123456789) -> bytes:
    tcp = struct.pack("!HHIIBBHHH", 40000, 29500, seq, 42, 5 << 4, flags, 65535, 0, 0) + payload
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), 1, 0x4000, 64, 6, 0, PEER, JOB)
    ip = ip[:10] + struct.pack("!H", standin._checksum(ip)) + ip[12:]
    return JOB_MAC + PEER_MAC + b"\x08\x00" + ip + tcp


def test_a_data_segment_gets_host_unreachable_quoting_its_sequence_number() -> None:
    frame = segment(seq=0xDEADBEEF)
    reply = standin.answer(frame)
    assert reply is not None
    assert reply[:6] == PEER_MAC and reply[6:12] == JOB_MAC and reply[12:14] == b"\x08\x00"
    ip = reply[14:]
    assert ip[9] == 1 and ip[12:16] == JOB and ip[16:20] == PEER  # ICMP, from the job, to the peer
    assert standin._checksum(ip[:20]) == 0  # a header with its checksum sums to zero
    icmp = ip[20:]
    assert icmp[0] == 3 and icmp[1] == 1  # destination unreachable: host
    assert standin._checksum(icmp) == 0
    quoted = icmp[8:]
    assert quoted == frame[14 : 14 + 28]  # the peer's IP header and the first 8 bytes of TCP
    assert struct.unpack("!I", quoted[24:28])[0] == 0xDEADBEEF  # what tcp_ld_RTO_revert matches
    assert struct.unpack("!H", ip[2:4])[0] == len(ip)


def test_a_fin_is_answered_even_without_data() -> None:
    assert standin.answer(segment(flags=0x11, payload=b"")) is not None


def test_syn_rst_and_bare_acks_are_not_answered() -> None:
    assert standin.answer(segment(flags=0x02, payload=b"")) is None  # a connect would fail at once
    assert standin.answer(segment(flags=0x04, payload=b"")) is None
    assert standin.answer(segment(flags=0x10, payload=b"")) is None


def test_not_tcp_over_ipv4_is_not_answered() -> None:
    frame = segment()
    assert standin.answer(frame[:12] + b"\x86\xdd" + frame[14:]) is None  # IPv6 EtherType
    udp = bytearray(frame)
    udp[14 + 9] = 17
    assert standin.answer(bytes(udp)) is None
    assert standin.answer(frame[:30]) is None  # truncated


def test_the_kernel_filter_keeps_only_tcp_to_the_job() -> None:
    prog = standin._filter(JOB)
    ops = [struct.unpack("HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    # Every jump that fails lands on the final `ret 0`.
    for i, (code, _jt, jf, _k) in enumerate(ops):
        if code == 0x15:
            assert i + 1 + jf == len(ops) - 1
    assert ops[3][3] == struct.unpack("!I", JOB)[0]
    assert ops[-1] == (0x06, 0, 0, 0)


def test_the_job_side_filter_keeps_only_tcp_from_the_job() -> None:
    ops = [
        struct.unpack("HBBI", p)
        for p in (lambda b: [b[i : i + 8] for i in range(0, len(b), 8)])(standin._filter(JOB, standin._SRC))
    ]
    assert ops[2] == (0x20, 0, 0, 26)  # the IPv4 source of an Ethernet frame
    assert ops[3][3] == struct.unpack("!I", JOB)[0]
    assert struct.unpack("HBBI", standin._filter(JOB)[16:24]) == (0x20, 0, 0, 30)  # the destination


def test_the_jobs_own_segment_is_answered_back_to_it_as_if_from_its_peer() -> None:
    # The job's segment for its peer, as the link's node end sees it.
    tcp = struct.pack("!HHIIBBHHH", 29500, 40000, 77, 42, 5 << 4, 0x18, 65535, 0, 0) + b"y" * 10
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), 1, 0x4000, 64, 6, 0, JOB, PEER)
    frame = PEER_MAC + JOB_MAC + b"\x08\x00" + ip + tcp
    reply = standin.answer(frame)
    assert reply is not None
    assert reply[:6] == JOB_MAC and reply[6:12] == PEER_MAC  # into the link, to the job
    assert reply[14 + 12 : 14 + 16] == PEER and reply[14 + 16 : 14 + 20] == JOB

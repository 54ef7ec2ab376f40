"""The kernel's TCP tables as the drain before a cut reads them (agent.migration.tcp_table): the
addresses decoded, only established connections, and in flight only while the retransmission
timer runs; and on a live connection of this process."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from agent.migration import tcp_table

# Rows as Linux prints them on a little-endian host: a listener, an established connection with a
# segment in flight (timer 01), one idle (00), one whose peer's window is shut (probe timer 04).
TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:0277 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1150 1
   1: 0301620A:9C40 0101620A:7354 01 000003E8:00000000 01:00000014 00000000     0        0 2001 1
   2: 0301620A:9C41 0201620A:7354 01 00000000:00000000 00:00000000 00000000     0        0 2002 1
   3: 0301620A:9C42 0401620A:7354 01 00010000:00000000 04:000000C8 00000000     0        0 2003 1
"""
# The same, cut after the timer column (what the parser reads).
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr
   0: 0000000000000000FFFF00000301620A:9C43 0000000000000000FFFF00000101620A:7354 01 00000010:0 01:14
   1: 00000000000000000000000001000000:1F90 00000000000000000000000001000000:A000 01 00000000:0 00:00
"""


@pytest.mark.skipif(sys.byteorder != "little", reason="the rows above are a little-endian host's")
def test_established_rows_decode_and_only_the_retransmission_timer_means_in_flight() -> None:
    conns = tcp_table.parse(TCP)
    assert [(c.local, c.peer, c.in_flight) for c in conns] == [
        ("10.98.1.3:40000", "10.98.1.1:29524", True),
        ("10.98.1.3:40001", "10.98.1.2:29524", False),
        ("10.98.1.3:40002", "10.98.1.4:29524", False),  # a shut window: nothing sent is lost
    ]
    six = tcp_table.parse(TCP6)
    assert [(c.local, c.peer, c.in_flight) for c in six] == [
        ("[::ffff:10.98.1.3]:40003", "[::ffff:10.98.1.1]:29524", True),
        ("[::1]:8080", "[::1]:40960", False),
    ]


def test_a_row_of_another_shape_is_refused_quoting_it() -> None:
    with pytest.raises(ValueError, match="another shape"):
        tcp_table.parse(TCP.splitlines()[0] + "\n   0: 0100007F:0277 00000000:0000 01\n")


def test_a_live_connection_is_found_and_a_gone_process_raises() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    try:
        here = f"127.0.0.1:{client.getsockname()[1]}"
        conns = {c.local: c for c in tcp_table.connections(os.getpid())}
        assert here in conns and conns[here].peer == f"127.0.0.1:{listener.getsockname()[1]}"
        assert not conns[here].in_flight  # loopback acknowledges at once
    finally:
        for s in (client, server, listener):
            s.close()
    with pytest.raises(OSError):
        tcp_table.connections(2**22 + 1)  # above pid_max's default: no such process

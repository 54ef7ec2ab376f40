"""`make bench`, link case: ferry's data path against a raw TLS socket, on this machine, in one run.

ferry's data path is CRIU to CRIU over CRIU's TLS with one-time certificates (what a move
uses, agent/migration/pagestream.py): `criu dump` of a process holding --gib of memory it has
touched, sending to a `criu page-server` whose pages file is /dev/null. Source and sink are
pre-touched: the figure is the path's own rate, not the cost of memory the sink must back.
The raw TLS socket is two Python processes, one sending a touched buffer and one receiving
into one, over TLS 1.3 with the cipher CRIU's TLS chose (asked of a real page server). Both
run on loopback, one core a side. Needs root and CRIU (`make criu`).

The raw socket's clock runs from its first byte to the receiver's ack; the same span of the
dump, from its first page sent to its last, is read from the dump's log (CRIU stamps each
line). The ratio compares those two. The whole dump (start to exit, its freeze, parasite and
the rest of the image included) is reported beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

OUT = Path("bench-results") / "link.json"
GIB = 1 << 30
#: The page server names its pages file after the first pagemap id it is sent (CRIU counts a
#: page server's ids from 0x10000); these point at /dev/null.
SINK_IDS = range(0x10001, 0x10001 + 64)
#: A CRIU log line's stamp (seconds since CRIU started) and the page transfer's lines.
_STAMP = re.compile(rb"^\((\d+\.\d+)\) page-xfer: (Transferring pages:|Sending )", re.M)
#: The holder: touch every page, say so, wait.
HOLDER = """
import sys, time
buf = bytearray(int(sys.argv[1]))
for i in range(0, len(buf), 4096):
    buf[i] = 1
print("ready", flush=True)
time.sleep(3600)
"""
#: The raw TLS sender and receiver: argv is role, port, bytes, cert, key, peer cert.
RAW = r"""
import socket, ssl, sys, time
role, port, total, cert, key, peer = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7]
side = ssl.PROTOCOL_TLS_SERVER if role == "recv" else ssl.PROTOCOL_TLS_CLIENT
ctx = ssl.SSLContext(side)
ctx.minimum_version = ssl.TLSVersion.TLSv1_3
ctx.load_cert_chain(cert, key)
ctx.load_verify_locations(peer)
ctx.verify_mode = ssl.CERT_REQUIRED
ctx.check_hostname = False
buf = bytearray(16 << 20)
for i in range(0, len(buf), 4096):
    buf[i] = 1
if role == "recv":
    with socket.create_server(("127.0.0.1", port)) as srv:
        print("listening", flush=True)
        raw, _ = srv.accept()
        with ctx.wrap_socket(raw, server_side=True) as s:
            got, view = 0, memoryview(buf)
            while got < total and (n := s.recv_into(view)):
                got += n
            s.sendall(b"k")  # all in: the sender's clock stops
    print(got, flush=True)
else:
    with ctx.wrap_socket(socket.create_connection(("127.0.0.1", port))) as s:
        t = time.perf_counter()
        sent, view = 0, memoryview(buf)
        while sent < total:
            n = min(len(buf), total - sent)
            s.sendall(view[:n])
            sent += n
        s.recv(1)
        print(s.cipher()[0], time.perf_counter() - t, flush=True)
"""


class BenchError(Exception):
    pass


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def transfer_span_s(log: bytes) -> float | None:
    """Seconds from the dump's first page transfer to its last send, from its log's stamps."""
    stamps = [float(m[1]) for m in _STAMP.finditer(log)]
    return stamps[-1] - stamps[0] if len(stamps) > 1 and stamps[-1] > stamps[0] else None


def format_report(r: dict[str, Any]) -> str:
    lines = [
        f"link benchmark, {r['bytes'] / 1e9:.2f} GB on loopback, cipher {r['cipher']}",
        f"  ferry's data path (CRIU to CRIU, CRIU's TLS): {r['ferry_gbps']:.2f} GB/s "
        f"({r['ferry_s']:.2f} s, first page to last)",
        f"  the whole dump:                               {r['dump_gbps']:.2f} GB/s "
        f"({r['dump_s']:.2f} s, freeze and the rest of the image included)",
        f"  raw TLS socket (two processes, OpenSSL):      {r['raw_gbps']:.2f} GB/s ({r['raw_s']:.2f} s)",
        f"  ferry / raw: {r['ratio']:.2f} (whole dump / raw: {r['dump_ratio']:.2f})",
    ]
    return "\n".join(lines)


def criu_cipher(criu: str, tls: Any, port: int, work: Path) -> str:
    """The cipher a real CRIU page server picks, from a Python client offering the TLS 1.3 set."""
    from agent.criu.options import TlsFiles

    assert isinstance(tls, TlsFiles)
    server = subprocess.Popen(
        [
            criu,
            "page-server",
            "-D",
            str(work),
            "--address",
            "127.0.0.1",
            "--port",
            str(port),
            "-o",
            "probe.log",
            "--tls",
            "--tls-cacert",
            str(tls.cacert),
            "--tls-cert",
            str(tls.cert),
            "--tls-key",
            str(tls.key),
            "--tls-no-cn-verify",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        return _handshake(port, tls)
    finally:
        server.kill()
        server.wait()


def _handshake(port: int, server_tls: Any) -> str:
    # The client presents the certificate the page server pins (the "source's"), trusting its own.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.load_verify_locations(server_tls.cert)
    ctx.load_cert_chain(_PROBE["cert"], _PROBE["key"])
    deadline = time.monotonic() + 10
    while True:
        try:
            with ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=5)) as s:
                return s.cipher()[0]
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise BenchError("CRIU's page server did not listen within 10 s") from None
            time.sleep(0.05)


_PROBE: dict[str, str] = {}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if os.geteuid() != 0:
        raise BenchError("needs root: CRIU dumps a process")
    from agent import config
    from agent.criu.runner import DUMP_LOG, Criu, read_stats
    from agent.errors import FerryError
    from agent.migration.datatls import DataIdentity, DataTls
    from agent.migration.sockets import free_port

    try:
        criu_bin = config.criu_binary()
    except FerryError as e:
        raise BenchError(f"CRIU not found: {e}") from e
    nbytes = int(args.gib * GIB)
    root = Path(tempfile.mkdtemp(prefix="ferry-bench-link-", dir=args.workdir))
    src_id, dst_id = DataIdentity.new("source"), DataIdentity.new("target")
    src_tls, dst_tls = (
        DataTls(src_id, dst_id.cert_pem, root / "keys"),
        DataTls(dst_id, src_id.cert_pem, root / "keys"),
    )
    _PROBE.update(cert=str(src_tls.files.cert), key=str(src_tls.files.key))
    holder = None
    try:
        probe_dir = root / "probe"
        probe_dir.mkdir()
        cipher = criu_cipher(criu_bin, dst_tls.files, free_port("127.0.0.1"), probe_dir)
        # ferry's path: the holder's touched memory, dumped to a page server writing /dev/null.
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(nbytes)], stdout=subprocess.PIPE, start_new_session=True
        )
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != b"ready":
            raise BenchError("the memory holder did not start")
        src, sink = root / "src", root / "sink"
        src.mkdir()
        sink.mkdir()
        for i in SINK_IDS:
            (sink / f"pages-{i}.img").symlink_to("/dev/null")
        criu = Criu(criu_bin, node="bench")
        server = criu.page_server(sink, address="127.0.0.1", tls=dst_tls.files)
        t = time.perf_counter()
        done = criu.dump(
            holder.pid,
            src,
            leave_running=True,
            leave_stopped=False,
            shell_job=True,
            page_server=("127.0.0.1", server.port),
            tls=src_tls.files,
        )
        server.wait(600)
        dump_s = time.perf_counter() - t
        span = transfer_span_s((src / DUMP_LOG).read_bytes())
        if span is None:
            raise BenchError(f"no page transfer is logged in {src / DUMP_LOG}")
        stats = read_stats(src / "stats-dump", "dump") or done.stats
        sent = (stats.get("pages_written", 0)) * os.sysconf("SC_PAGE_SIZE")
        if sent < nbytes:
            raise BenchError(f"the dump sent {sent} bytes, less than the {nbytes} the holder touched")
        # The raw TLS socket: the same bytes, the same cipher family, one process a side.
        port = free_port("127.0.0.1")
        files = [str(dst_tls.files.cert), str(dst_tls.files.key), str(dst_tls.files.cacert)]
        recv = subprocess.Popen(
            [sys.executable, "-c", RAW, "recv", str(port), str(sent), *files],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert recv.stdout is not None
        recv.stdout.readline()
        send_files = [str(src_tls.files.cert), str(src_tls.files.key), str(src_tls.files.cacert)]
        out = subprocess.run(
            [sys.executable, "-c", RAW, "send", str(port), str(sent), *send_files],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        ).stdout.split()
        got = int(recv.stdout.readline())
        recv.wait(60)
        if got != sent:
            raise BenchError(f"the raw receiver got {got} bytes of {sent}")
        raw_cipher, raw_s = out[0], float(out[1])
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        src_tls.close()
        dst_tls.close()
        shutil.rmtree(root, ignore_errors=True)
    return {
        "bytes": sent,
        "cipher": cipher if cipher == raw_cipher else f"{cipher} (CRIU) / {raw_cipher} (raw)",
        # The path: first page to last, as the raw socket's clock runs from its first byte.
        "ferry_s": span,
        "ferry_gbps": sent / span / 1e9,
        # The whole dump, its freeze and the rest of the image included.
        "dump_s": dump_s,
        "dump_gbps": sent / dump_s / 1e9,
        "dump_ratio": ratio(sent / dump_s, sent / raw_s),
        "raw_s": raw_s,
        "raw_gbps": sent / raw_s / 1e9,
        "ratio": ratio(sent / span, sent / raw_s),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bench_link.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gib", type=float, default=2.0, help="GiB the source holds and sends (default 2)")
    p.add_argument("--json", type=Path, default=OUT, help=f"where to write the figures (default {OUT})")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()), help="scratch directory")
    args = p.parse_args(argv)
    try:
        r = run(args)
    except subprocess.CalledProcessError as e:
        print(f"bench_link: the raw TLS sender failed: {(e.stderr or '').strip()[-800:]}", file=sys.stderr)
        return 1
    except (BenchError, subprocess.SubprocessError) as e:
        print(f"bench_link: {e}", file=sys.stderr)
        return 1
    print(format_report(r))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(r, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

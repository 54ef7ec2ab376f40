"""Both ends of a line-echo TCP conversation, for moves of jobs that hold connections.

    python echo_peer.py serve --port P                      echo every line back, prefixed "echo "
    python echo_peer.py talk HOST:PORT --steps N [--step-time S] [--timeout T]

`serve` accepts one connection after another and echoes each line. `talk` connects once, and
each step sends "msg I", expects "echo msg I" back, and prints "step I rtt SECONDS"; at the
end it prints the largest gap between two answers and a digest of every answer, then exits 0.
A reset, a lost or a duplicated message ends it with status 1 and says which.
"""

from __future__ import annotations

import argparse
import hashlib
import socket
import socketserver
import sys
import time


class Echo(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        for line in self.rfile:
            self.wfile.write(b"echo " + line)
            self.wfile.flush()


def serve(port: int) -> int:
    socketserver.ThreadingTCPServer.allow_reuse_address = True
    with socketserver.ThreadingTCPServer(("0.0.0.0", port), Echo) as srv:
        print(f"listening on {port}", flush=True)
        srv.serve_forever()
    return 0


def talk(where: str, steps: int, step_time: float, timeout: float) -> int:
    host, port = where.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            sk = socket.create_connection((host, int(port)), timeout=timeout)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    answers = sk.makefile("rb")
    digest = hashlib.sha256()
    gap, last = 0.0, time.monotonic()
    for i in range(steps):
        t = time.monotonic()
        try:
            sk.sendall(f"msg {i}\n".encode())
            got = answers.readline()
        except OSError as e:
            print(f"connection broken at message {i}: {e}", flush=True)
            return 1
        if got != f"echo msg {i}\n".encode():
            print(f"message {i}: expected echo msg {i}, got {got!r}", flush=True)
            return 1
        now = time.monotonic()
        gap, last = max(gap, now - last), now
        digest.update(got)
        print(f"step {i} rtt {now - t:.4f}", flush=True)
        time.sleep(step_time)
    print(f"largest gap {gap:.3f}", flush=True)
    print(f"final digest {digest.hexdigest()[:16]}", flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("serve", help="echo lines back")
    s.add_argument("--port", type=int, required=True, help="TCP port to listen on")
    t = sub.add_parser("talk", help="send numbered lines and check their echoes")
    t.add_argument("where", help="HOST:PORT of the echo server")
    t.add_argument("--steps", type=int, default=100, help="how many messages")
    t.add_argument("--step-time", type=float, default=0.05, help="pause between messages (s)")
    t.add_argument("--timeout", type=float, default=120.0, help="socket timeout (s)")
    args = p.parse_args()
    if args.mode == "serve":
        return serve(args.port)
    return talk(args.where, args.steps, args.step_time, args.timeout)


if __name__ == "__main__":
    sys.exit(main())

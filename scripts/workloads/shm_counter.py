"""A job whose state lives in POSIX shared memory that a parent and its child share.

    python shm_counter.py --steps N [--step-time S]

The parent creates a segment in /dev/shm and forks a child; each step the child writes
step * step into the step's slot of the segment and tells the parent through a pipe, and the
parent checks the slot and prints "step I value V". At the end it prints the digest of the
whole segment. The output depends only on the arguments, so a moved run must print the same
lines as one left alone; a segment lost or swapped in a move shows as a wrong value.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import struct
import sys
import time
from multiprocessing import shared_memory


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50, help="how many steps")
    p.add_argument("--step-time", type=float, default=0.1, help="sleep per step (s)")
    args = p.parse_args()
    seg = shared_memory.SharedMemory(name=f"ferry-counter-{os.getpid()}", create=True, size=8 * args.steps)
    ask_r, ask_w = os.pipe()
    done_r, done_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(ask_w)
        os.close(done_r)
        with os.fdopen(ask_r, "rb", buffering=0) as ask, os.fdopen(done_w, "wb", buffering=0) as done:
            while len(raw := ask.read(4)) == 4:
                (i,) = struct.unpack("<I", raw)
                seg.buf[8 * i : 8 * i + 8] = struct.pack("<Q", i * i)
                done.write(raw)
        os._exit(0)
    os.close(ask_r)
    os.close(done_w)
    with os.fdopen(ask_w, "wb", buffering=0) as ask, os.fdopen(done_r, "rb", buffering=0) as done:
        for i in range(args.steps):
            ask.write(struct.pack("<I", i))
            assert done.read(4) == struct.pack("<I", i)
            (value,) = struct.unpack("<Q", bytes(seg.buf[8 * i : 8 * i + 8]))
            print(f"step {i} value {value}", flush=True)
            time.sleep(args.step_time)
    os.waitpid(child, 0)
    print(f"final digest {hashlib.sha256(bytes(seg.buf)).hexdigest()[:16]}", flush=True)
    seg.close()
    seg.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())

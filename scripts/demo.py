"""`make demo`: move a running, unmodified PyTorch training job between two agents.

Starts two agents on loopback, launches scripts/workloads/train_mlp.py under
the first, migrates it mid-run to the second with the CLI, lets it finish and
checks that it resumed at the next step and ended with the same parameter
digest as an uninterrupted run.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent import certs  # noqa: E402
from agent.testing.localcluster import LocalAgent  # noqa: E402
from agent.testing.poll import wait_for  # noqa: E402

WORKLOAD = REPO / "scripts" / "workloads" / "train_mlp.py"
STEPS = 60
ARGS = ["--steps", str(STEPS), "--step-time", "0.1", "--workers", "2"]


def say(text: str) -> None:
    print(f"\n== {text}", flush=True)


def steps_in(log: str) -> list[int]:
    return [int(m[1]) for m in re.finditer(r"^step (\d+) ", log, re.M)]


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="ferry-demo-"))
    pki = root / "pki"
    say("ferry certs: a cluster CA and a certificate per node")
    certs.create_ca(pki)
    for node in ("node-a", "node-b"):
        issued = certs.issue(pki, node, certs.Role.NODE, ["127.0.0.1"])
        print(f"{issued.cert} ({issued.subject}, valid until {issued.not_after:%Y-%m-%d})")
    a, b = LocalAgent(root, "node-a", tls_dir=pki), LocalAgent(root, "node-b", tls_dir=pki)
    try:
        say("starting two agents on loopback, speaking mutual TLS")
        a.start()
        b.start()
        print(f"node-a at {a.address}, node-b at {b.address} (state and logs under {root})")

        say("reference: the same training run, uninterrupted")
        ref = subprocess.run(
            [sys.executable, str(WORKLOAD), *ARGS[:2], "--step-time", "0", *ARGS[4:]],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        ref_digest = re.search(r"final digest (\w+)", ref)[1]  # type: ignore[index]
        print(f"uninterrupted final digest {ref_digest}")

        say(f"ferry run: {WORKLOAD.name} {' '.join(ARGS)} on node-a")
        print(a.cli("run", "--name", "train", "--", sys.executable, str(WORKLOAD), *ARGS).stdout.strip())
        wait_for("step 15", lambda: len(steps_in(a.cli("logs", "train").stdout)) >= 15, 120)
        print(a.cli("ps").stdout)

        say(f"ferry migrate train --to {b.address}")
        t = time.monotonic()
        moved = a.cli("migrate", "train", "--to", b.address)
        print(moved.stderr + moved.stdout, end="")
        print(f"(the command took {time.monotonic() - t:.2f} s)")

        say("after the move")
        print("node-a:\n" + a.cli("ps").stdout)
        print("node-b:\n" + b.cli("ps").stdout)
        wait_for("the job to finish on node-b", lambda: "exited" in b.cli("ps").stdout, 180)
        log = b.cli("logs", "train").stdout
        steps = steps_in(log)
        digest = re.search(r"final digest (\w+)", log)[1]  # type: ignore[index]
        print("node-b, after it finished:\n" + b.cli("ps").stdout)

        say("checks")
        ok_steps = steps == list(range(STEPS))
        ok_digest = digest == ref_digest
        print(f"every step logged exactly once, in order: {'yes' if ok_steps else 'NO'} ({len(steps)} steps)")
        print(f"final digest {digest}: {'matches' if ok_digest else 'DIFFERS FROM'} the uninterrupted run")
        if not (ok_steps and ok_digest):
            return 1
        print("\ndemo passed: the job moved mid-run and finished bit-identical to an uninterrupted run")
        return 0
    finally:
        for agent in (a, b):
            agent.stop()
            agent.cleanup()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except AssertionError as e:  # wait_for timed out: one line, not a traceback
        sys.exit(f"demo: {e}")

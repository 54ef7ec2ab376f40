"""`ferry restore` and `ferry checkpoint` refusing what would go wrong, with real agents and CRIU
(issue 28, defects 6 and 7): one image, one running copy unless `--as-copy`, a copy on the job
network at its own address, a manifest that is not the image's job refused; a checkpoint whose
--out cannot take the image refused before anything freezes, or named and cleaned up after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from agent.image import MANIFEST, read_manifest, restored, write_manifest
from agent.testing.bed import node_bed
from agent.testing.localcluster import LocalAgent
from agent.testing.poll import wait_for
from tests.integration.jobtools import job

#: A small job: a shell printing a counter (its image is well under a MiB of memory).
TICKS = "i=0; while :; do echo tick $i; i=$((i+1)); sleep 0.1; done"


def run_ticks(a: LocalAgent, name: str) -> None:
    a.cli("run", "--name", name, "--env", "MODE=refusals", "--", "sh", "-c", TICKS)
    ticks(a, name, 3)


def ticks(a: LocalAgent, name: str, n: int) -> None:
    wait_for(f"{n} ticks from {name}", lambda: a.cli("logs", name).stdout.count("tick") >= n, 30)


def still_ticking(a: LocalAgent, name: str) -> None:
    assert job(a, name)["state"] == "running"
    ticks(a, name, a.cli("logs", name).stdout.count("tick") + 2)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def mount(mnt: Path, options: str) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], check=True)


def test_one_image_runs_once_unless_a_copy_is_asked_for(agents, tmp_path: Path) -> None:
    a = agents("node-a")
    run_ticks(a, "ticks")
    image = tmp_path / "img"
    a.cli("checkpoint", "ticks", "--out", str(image), "--leave-running")

    p = a.cli("restore", str(image), "--name", "other", check=False)
    assert p.returncode == 1 and "job 'ticks', which image" in p.stderr and "still runs here" in p.stderr, (
        p.stderr
    )
    assert "--as-copy NAME" in p.stderr

    copy = json.loads(a.cli("restore", str(image), "--as-copy", "copy", "--json").stdout)
    assert copy["name"] == "copy" and "a second copy of job 'ticks'" in copy["note"]
    still_ticking(a, "copy")
    still_ticking(a, "ticks")  # two copies, as asked
    assert [(m.job, m.copy) for m in restored(image)] == [("copy", True)]

    a.cli("stop", "ticks")
    p = a.cli("restore", str(image), check=False)
    assert p.returncode == 1 and f"image {image} was already restored, as job 'copy' on node-a" in p.stderr
    assert "it is running here" in p.stderr, p.stderr


def test_a_manifest_that_is_not_its_images_job_is_refused(agents, tmp_path: Path) -> None:
    a = agents("node-a")
    run_ticks(a, "real")
    image = tmp_path / "img"
    a.cli("checkpoint", "real", "--out", str(image))
    manifest = image / MANIFEST
    original = manifest.read_bytes()

    d = json.loads(original)
    d["job"]["command"] = ["python", "innocent.py"]
    manifest.write_text(json.dumps(d))
    p = a.cli("restore", str(image), check=False)
    assert p.returncode == 1 and "job.command does not match its digest" in p.stderr, p.stderr

    manifest.write_bytes(original)
    m = read_manifest(image)
    write_manifest(image, replace(m, job=replace(m.job, cwd="/srv")))
    p = a.cli("restore", str(image), check=False)  # its digests agree: the restored job itself does not
    assert p.returncode == 1 and "job.cwd is '/srv', but the restored job runs in" in p.stderr, p.stderr
    assert job(a, "real")["state"] == "checkpointed"  # nothing ran, nothing recorded

    manifest.write_bytes(original)
    a.cli("restore", str(image))  # the real ferry-init's command, cwd and env match its manifest
    still_ticking(a, "real")


def test_a_checkpoint_to_a_read_only_out_is_refused_and_the_job_goes_on(agents, tmpfs: Path) -> None:
    mount(tmpfs, "ro,size=1m")
    a = agents("node-a")
    run_ticks(a, "ro")
    out = tmpfs / "img"

    p = a.cli("checkpoint", "ro", "--out", str(out), check=False)

    assert p.returncode == 1 and f"--out {out} is not writable (Read-only file system" in p.stderr, p.stderr
    assert "CRIU log" not in p.stderr  # before: a log in the read-only directory, which cannot exist
    still_ticking(a, "ro")


#: A job with 24 MiB of memory of its own, then a tick a tenth of a second.
BIG = """import time
b = bytearray(24 << 20)
b[::4096] = b"x" * (len(b) // 4096)
while True:
    print("tick", flush=True)
    time.sleep(0.1)
"""


def test_a_checkpoint_without_room_is_refused_with_the_numbers(agents, tmpfs: Path) -> None:
    mount(tmpfs, "size=2m,mode=0700")
    a = agents("node-a")
    a.cli("run", "--name", "big", "--", sys.executable, "-c", BIG)
    ticks(a, "big", 2)

    p = a.cli("checkpoint", "big", "--out", str(tmpfs / "img"), check=False)

    assert (
        p.returncode == 1 and f"--out {tmpfs / 'img'} has 2 MiB free, but the image needs about" in p.stderr
    )
    assert not (tmpfs / "img").exists() and job(a, "big")["state"] == "running"


def test_a_checkpoint_that_fills_its_out_is_named_and_leaves_nothing_there(agents, tmpfs: Path) -> None:
    mount(tmpfs, "size=8m,mode=0700")
    a = agents("node-a", env={"FERRY_PAUSE": "checkpoint=3"})
    run_ticks(a, "full")
    out = tmpfs / "img"
    cli = subprocess.Popen(
        [*a.ferry(), "checkpoint", "full", "--out", str(out), "--agent", f"unix:{a.socket}"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=a.env,
    )
    # Room was there when it was checked; something else takes it before the dump.
    wait_for("the pause", lambda: "pausing 3.0 s at 'checkpoint'" in a.log_path.read_text(), 30)
    st = os.statvfs(tmpfs)
    with open(tmpfs / "filler", "wb") as f:
        f.write(b"\1" * (st.f_bfree * st.f_frsize - (16 << 10)))
    _, err = cli.communicate(timeout=60)

    assert (
        cli.returncode == 1 and f"the --out filesystem is full: {out} has 0 MiB free now, 8 MiB when" in err
    ), err
    log = a.state_dir / "criu-logs"
    assert f"(CRIU log: {log}/checkpoint-" in err  # where CRIU could write it all
    logged = next(log.glob("checkpoint-*/criu-dump.log"))
    assert "No space left on device" in logged.read_text()
    assert "were removed" in err and not out.exists()  # its partial image: before, left there
    assert (tmpfs / "filler").exists()  # not the checkpoint's
    still_ticking(a, "full")


#: A job that answers each connection with the address it was reached at, as its namespace has it.
SERVER = """import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 7000))
s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(c.getsockname()[0].encode())
    c.close()
"""
#: From the outside host: what each address answers.
CLIENT = """import json, socket, sys
said = {}
for a in sys.argv[1:]:
    with socket.create_connection((a, 7000), timeout=5) as c:
        said[a] = c.recv(64).decode()
print(json.dumps(said))
"""


def test_a_copy_on_the_job_network_answers_at_its_own_address(tmp_path: Path) -> None:
    with node_bed(tmp_path) as bed:
        a = bed.node("node-a")
        a.cli("run", "--name", "net", "--", sys.executable, "-c", SERVER)
        a.wait_log("net", r"listening")
        image = bed.shared / "img"
        a.cli("checkpoint", "net", "--out", str(image), "--leave-running")

        copy = json.loads(a.cli("restore", str(image), "--as-copy", "netcopy", "--json").stdout)

        original = a.job("net")["address"]
        assert copy["address"] and copy["address"] != original, (copy, original)
        client = bed.outside(
            [sys.executable, "-c", CLIENT, original, copy["address"]], stdout=subprocess.PIPE
        )
        out, _ = client.communicate(timeout=30)
        # Each answers from its own namespace: the copy at its new address, the original unmoved.
        assert json.loads(out) == {original: original, copy["address"]: copy["address"]}
        neigh = bed.outside(["ip", "-j", "neigh", "show", "dev", "eth0"], stdout=subprocess.PIPE)
        macs = {n["dst"]: n.get("lladdr") for n in json.loads(neigh.communicate(timeout=10)[0] or "[]")}
        assert macs[original] != macs[copy["address"]], macs  # a MAC of its own, too

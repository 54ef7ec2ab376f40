"""ferry's CRIU links a job's tmpfs archive from the parent image when the tmpfs did not change
since that dump (native/criu/tmpfs-reuse.patch): each archive cost a `tar --gzip` (two execs)
with the job frozen, three or four of them per dump of a job started by `ferry run` (its /tmp,
/run and /dev/shm). What a rollback restores from such an image is tested with the rounds
(tests/integration/test_snapshots.py); this test reads the images a chain of dumps wrote."""

from __future__ import annotations

import os
import sys
import tarfile
from pathlib import Path

from agent.criu.runner import Criu
from agent.jobs import procs
from tests.integration.jobtools import IDLE_LOOP, unshared


def archives(image: Path) -> dict[str, os.stat_result]:
    return {p.name: p.stat() for p in image.glob("tmpfs-dev-*.tar.gz.img")}


def test_an_unchanged_tmpfs_is_linked_from_the_parent_image_and_a_changed_one_archived_again(
    tmp_path: Path,
) -> None:
    # A mount namespace with a tmpfs of its own at /tmp, /run and /dev/shm, what was mounted
    # there first detached, as ferry-init does (CRIU cannot dump an `ip netns` mount, which other
    # tests make under /run); its standard files opened there.
    mounts = "awk '{print $5}' /proc/self/mountinfo | grep -E '^/(run|tmp|dev/shm)(/|$)' | sort -r"
    detach = f'for m in $({mounts}); do umount -l "$m" 2>/dev/null; done; '
    fresh = " && ".join(f"mount -t tmpfs tmpfs {d}" for d in ("/tmp", "/run", "/dev/shm"))
    script = f"{detach}{detach}{fresh} && echo first > /tmp/a && exec {sys.executable} -c '{IDLE_LOOP}'"
    script += " </dev/null >/dev/null 2>&1"
    with unshared(["--mount", "--propagation", "private"], ["sh", "-c", script]) as pid:
        criu = Criu()
        images = [tmp_path / f"img{i}" for i in range(3)]

        def dump(i: int) -> dict[str, os.stat_result]:
            images[i].mkdir()
            logs = tmp_path / f"logs{i}"
            logs.mkdir()
            parent = os.path.relpath(images[i - 1], images[i]) if i else ""
            criu.dump(
                pid,
                images[i],
                leave_running=True,
                leave_stopped=False,
                shell_job=True,
                track_mem=True,
                parent_img=parent,
                log_dir=logs,
                log_level=4,
            )
            return archives(images[i])

        first, second = dump(0), dump(1)
        assert first and set(first) == set(second), (first, second)
        # Every tmpfs of the namespace unchanged: the same files, linked, not archived again.
        assert all(second[n].st_ino == first[n].st_ino for n in first), "an unchanged tmpfs archived again"
        assert "its archive is linked" in (tmp_path / "logs1" / "criu-dump.log").read_text()

        (Path(f"/proc/{pid}/root/tmp") / "b").write_text("second\n")
        third = dump(2)
        changed = [n for n in third if third[n].st_ino != second[n].st_ino]
        assert len(changed) == 1, "the tmpfs written to was not archived again (or others were)"
        with tarfile.open(images[2] / changed[0]) as tar:
            names = {m.name.removeprefix("./") for m in tar.getmembers()}
        assert {"a", "b"} <= names, names
        assert procs.alive(pid), "the dumps left it running"

"""`ferry checkpoint --out DIR` (and a suspend's directory): made and checked before anything
freezes (a file can be written there, and the image's estimate fits in what is free), a failure
for lack of room named as such, and what a failed checkpoint wrote there removed: only that."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
from pathlib import Path

from agent.errors import CriuError, FerryError, RefusedError
from agent.migration.staging import FULL_BYTES, free_bytes

log = logging.getLogger(__name__)

#: The file a checkpoint writes and removes to learn that --out takes files.
PROBE = ".ferry-write-probe"
#: strerror(ENOSPC), as CRIU logs it.
NO_SPACE = os.strerror(errno.ENOSPC)
#: How much of a failed dump's CRIU log is searched for it.
LOG_READ = 4 << 20


def mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"


class OutDir:
    """The directory a checkpoint writes its image into, as the checkpoint found it."""

    def __init__(self, path: Path, node: str) -> None:
        self.path = path
        self.node = node
        self.made: list[Path] = []  # directories the checkpoint created, outermost first
        self.before: set[str] | None = None  # names there when it began (None: not prepared)
        self.free = 0  # bytes free there before the dump
        self.need = 0  # the image's estimate

    def prepare(self, need: int) -> None:
        """Create it (0700: the job's memory) and its missing parents; refuse unless a file can be
        written there and `need` bytes (the image's estimate) are free."""
        missing: list[Path] = []
        p = self.path
        while not os.path.lexists(p) and p != p.parent:
            missing.append(p)
            p = p.parent
        creating = self.path
        try:
            for d in reversed(missing):
                creating = d
                d.mkdir(mode=0o700 if d == self.path else 0o777)
                self.made.append(d)
            creating = self.path / PROBE
            self.before = set(os.listdir(self.path))
            fd = os.open(creating, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            os.close(fd)
            os.unlink(creating)
        except OSError as e:
            self.remove()
            raise RefusedError(
                f"--out {self.path} is not writable ({e.strerror}: cannot create {creating})",
                step="checkpoint",
                node=self.node,
                hint="choose an --out directory on a filesystem this agent can write",
            ) from e
        self.free, self.need = free_bytes(self.path), need
        if self.free < need:
            self.remove()
            raise RefusedError(
                f"--out {self.path} has {mib(self.free)} free, but the image needs about {mib(need)} "
                "(the job's resident memory, its device memory and its logs)",
                step="checkpoint",
                node=self.node,
                hint="free space there, or choose an --out on a larger filesystem",
            )

    def failed(self, e: FerryError, exc: BaseException) -> FerryError:
        """The checkpoint's error, named for what it was when --out filled up: CRIU (or our own
        write) then only says that a write failed. Named so when the filesystem is full now (the
        failed image still on it), or a write failed for space and the image would not fit now."""
        if self.before is None or isinstance(e, RefusedError):
            return e
        try:
            now = free_bytes(self.path)
        except OSError:
            return e
        errnos = {getattr(exc, "errno", 0), e.errno if isinstance(e, CriuError) else 0}
        said = e.cause
        if isinstance(e, CriuError) and e.log_path:
            with contextlib.suppress(OSError), open(e.log_path, errors="replace") as f:
                said += f.read(LOG_READ)
        no_space = errno.ENOSPC in errnos or NO_SPACE in said
        if not (now < FULL_BYTES or (no_space and now < self.need)):
            return e
        e.cause = (
            f"the --out filesystem is full: {self.path} has {mib(now)} free now, {mib(self.free)} when "
            f"the checkpoint began, and the image needed more (estimated {mib(self.need)}); {e.cause}"
        )
        e.hint = "free space there, or choose an --out on a larger filesystem"
        return e

    def remove(self) -> str:
        """Remove what the checkpoint wrote: the names that were not there when it began, then the
        directories it made. Says what was removed, or what could not be."""
        gone: list[str] = []
        left: list[str] = []
        if self.before is not None and os.path.isdir(self.path):
            for name in sorted(set(os.listdir(self.path)) - self.before):
                p = self.path / name
                try:
                    if p.is_dir() and not p.is_symlink():
                        shutil.rmtree(p)
                    else:
                        p.unlink()
                    gone.append(name)
                except OSError as e:
                    left.append(f"{name} ({e.strerror})")
        for d in reversed(self.made):
            with contextlib.suppress(OSError):
                d.rmdir()
        self.made, self.before = [], None
        if left:
            log.warning("checkpoint: could not remove from %s: %s", self.path, ", ".join(left))
            return f"what it wrote in {self.path} could not all be removed: {', '.join(left)}"
        return f"the {len(gone)} file(s) it wrote in {self.path} were removed" if gone else ""

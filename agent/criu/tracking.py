"""The userfaultfds that keep a job's written memory tracked between its snapshots' dumps.

Where the kernel lacks soft-dirty, ferry's CRIU (native/criu/uffd-track.patch) tracks written
pages with userfaultfd write-protect: a tracked dump (`--track-mem`) opens a userfaultfd in each
task of the tree, registers the task's writable private mappings not yet registered with it,
write-protects every registered page, and hands the new descriptors over with its answer. The
kernel clears a page's protection at its first write; the next dump reads which pages are
unprotected (PAGEMAP_SCAN's PAGE_IS_WRITTEN) and carries only those.

Tracking lasts while the descriptors are held, and only here: closing one unregisters its
mappings, whose pages then all read as written, so a lost or closed descriptor only makes the
next dump carry more, never less. A whole dump (no parent) closes the tree's descriptors first,
so that it registers everything with one new descriptor a task and their count stays bounded by
the chain's length; those of a tree that ended, or whose root's PID now names another process,
are closed at the next dump.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass, field

from agent.jobs import procs

log = logging.getLogger(__name__)

#: A tree holding more than this many is tracked afresh (its descriptors closed): a chain of
#: `[snapshots] full_every` dumps of a tree of a few tasks stays far below it.
MAX_FDS_PER_TREE = 256


@dataclass
class _Tree:
    started: float  # its root's start (procs.create_time): a reused PID is another tree
    fds: list[int] = field(default_factory=list)


class DirtyTrackers:
    """Owns every tracking descriptor a dump handed over, by the root PID of the tree dumped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._trees: dict[int, _Tree] = {}

    def before_dump(self, root: int, whole: bool) -> None:
        """A tracked dump of `root`'s tree begins: forget the trees that ended, and with
        `whole` (no parent image), this one's descriptors too."""
        with self._lock:
            gone = [pid for pid, t in self._trees.items() if not procs.alive(pid, t.started)]
            if whole and root in self._trees:
                gone.append(root)
            closing = [self._trees.pop(pid) for pid in dict.fromkeys(gone)]
        for t in closing:
            close_fds(t.fds)

    def keep(self, root: int, fds: list[int]) -> None:
        """The descriptors a tracked dump of `root`'s tree handed over."""
        if not fds:
            return
        started = procs.create_time(root)
        with self._lock:
            t = self._trees.get(root)
            if t is None or t.started != started:
                stale, t = t, _Tree(started)
                self._trees[root] = t
                if stale is not None:
                    close_fds(stale.fds)
            t.fds.extend(fds)
            over = len(t.fds) > MAX_FDS_PER_TREE
            if over:
                self._trees.pop(root)
        if over:
            log.info("pid %d's written memory is tracked afresh: it held %d descriptors", root, len(t.fds))
            close_fds(t.fds)

    def held(self, root: int) -> int:
        """How many descriptors track `root`'s tree."""
        with self._lock:
            t = self._trees.get(root)
            return len(t.fds) if t is not None else 0

    def close(self) -> None:
        with self._lock:
            trees, self._trees = list(self._trees.values()), {}
        for t in trees:
            close_fds(t.fds)


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)

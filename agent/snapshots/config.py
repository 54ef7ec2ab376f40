"""`[snapshots]` in the agent's config: where a buddy keeps the images it holds, and the defaults
of `ferry protect`.

    [snapshots]
    dir = "/dev/shm/ferry-snapshots"   # memory: a tmpfs; a local disk where memory is short
    every_s = 300                      # `ferry protect GROUP` without --every
    hold_s = 60                        # a held member goes on by itself this long after its dump
    incremental = true                 # dumps after the first carry only what changed, where the
                                       # dirty memory is tracked (soft-dirty, or
                                       # userfaultfd write-protect: agent.criu.tracking)
    full_every = 32                    # ... and every 32nd is whole again (a chain's length)
    criu_log_level = 2                 # CRIU's log of a round's dump and of a restore from a
                                       # snapshot's chain: errors and warnings (4: everything,
                                       # to look into one that fails)
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.errors import InvalidArgumentError
from agent.image import MAX_CHAIN

#: A round shorter than this would leave the job frozen more than it runs.
MIN_EVERY_S = 1.0


@dataclass(frozen=True)
class SnapshotConfig:
    dir: str = "/dev/shm/ferry-snapshots"
    every_s: float = 300.0
    #: A member held for a round goes on by itself if no release comes this long after its dump
    #: ended: its coordinator is gone, and a job must never stay frozen for a snapshot.
    hold_s: float = 60.0
    #: Where the kernel tracks dirty memory, a member's next dump carries only the pages written
    #: since its last (CRIU's --track-mem, --prev-images-dir); elsewhere every dump is whole.
    incremental: bool = True
    #: A chain of increments is this long at most: a buddy keeps it, a restore reads all of it
    #: (a 64 MiB process's chain of 24 restored in 0.07 s, one whole image in 0.06 s; what a
    #: chain holds is bounded apart: member.CHAIN_MAX).
    full_every: int = 32
    #: CRIU's log level for a round's dumps, and for the restores that read a snapshot's chain
    #: (a rollback's, a recovery's, a chain move's). 2 (errors and warnings, which an error
    #: quotes) rather than the 4 of every other CRIU run: a round repeats every few seconds and
    #: its log goes once it succeeds, and the debug lines (some ten thousand for a PyTorch
    #: process) were 10-20 % of CRIU's part of the freeze; a restore from a chain of 14 logs
    #: 55,000 lines at 4, 20 % of its time (0.35-0.37 s against 0.29-0.32 s at 2;
    #: docs/performance.md).
    criu_log_level: int = 2

    def check(self) -> SnapshotConfig:
        if not self.dir.startswith("/"):
            raise InvalidArgumentError(f"[snapshots] dir = {self.dir!r} must be an absolute path")
        if self.every_s < MIN_EVERY_S:
            raise InvalidArgumentError(f"[snapshots] every_s = {self.every_s:g} is below {MIN_EVERY_S:g} s")
        if self.hold_s <= 0:
            raise InvalidArgumentError("[snapshots] hold_s must be above 0")
        if not 1 <= self.full_every <= MAX_CHAIN:
            raise InvalidArgumentError(
                f"[snapshots] full_every = {self.full_every} is not within 1 to {MAX_CHAIN}"
            )
        if not 0 <= self.criu_log_level <= 4:
            raise InvalidArgumentError(
                f"[snapshots] criu_log_level = {self.criu_log_level} is not within 0 to 4 (CRIU's -v)"
            )
        return self

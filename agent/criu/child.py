"""The CRIU processes ferry starts: bounded waits, a kill that reaps, and the timeout error.

Every wait on a CRIU child has a deadline. One that expires kills the child (a CRIU
left behind may hold the job frozen or half-restored) and becomes a StepTimeoutError
naming the step, the node, the images and CRIU's log: the log's last lines say what
CRIU was waiting for.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import subprocess
import tempfile
from pathlib import Path

from agent.errors import StepTimeoutError

log = logging.getLogger(__name__)

#: Once CRIU has answered (or hung up) it only cleans up and exits, in well under a second;
#: half a minute allows for a loaded node before it counts as stuck and is killed.
EXIT_WAIT_S = 30.0
#: SIGKILL acts at once unless the process sits in the kernel (a hung mount, D state): then
#: no wait helps, and it is logged and left.
KILL_WAIT_S = 10.0
HINT = (
    "the end of the CRIU log says what it was waiting for; check that the job still runs "
    "(`ferry ps`); if it is merely large, give the step more time"
)


def kill(proc: subprocess.Popen[bytes]) -> bool:
    """SIGKILL and reap it; False if it is still there after KILL_WAIT_S."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    try:
        proc.wait(KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        log.warning("CRIU (pid %d) survived SIGKILL for %.0f s: stuck in the kernel", proc.pid, KILL_WAIT_S)
        return False
    return True


def finish(proc: subprocess.Popen[bytes], timeout_s: float = EXIT_WAIT_S) -> int | None:
    """Its exit status once it exits on its own, or None if it had to be killed."""
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("CRIU (pid %d) did not exit within %.0f s; killed it", proc.pid, timeout_s)
        kill(proc)
        return None


def timed_out(
    proc: subprocess.Popen[bytes],
    op: str,
    what: str,
    *,
    node: str,
    images_dir: Path | str | None,
    log_path: Path | str,
    hint: str = HINT,
) -> StepTimeoutError:
    """Kill `proc` and say so: `what` ran out of time during CRIU's `op`."""
    gone = kill(proc)
    fate = "killed it" if gone else f"CRIU (pid {proc.pid}) did not die on SIGKILL"
    where = f"images: {images_dir}, " if images_dir else ""
    cause = f"{what}; {fate} ({where}CRIU log: {log_path})"
    return StepTimeoutError(cause, step=f"criu {op}", node=node, hint=hint)


@functools.cache
def no_plugins_dir() -> str:
    """An empty directory of ours for CRIU's plugin search.

    ferry drives the CUDA checkpoint itself. CRIU's own CUDA plugin (in
    /usr/lib/criu on some installs) would restore CUDA a second time, which
    fails, so CRIU never loads plugins from the system directory.
    """
    path = tempfile.mkdtemp(prefix="ferry-criu-no-plugins-")

    def remove() -> None:
        with contextlib.suppress(OSError):
            os.rmdir(path)

    atexit.register(remove)
    return path


def env() -> dict[str, str]:
    """The environment of every CRIU we start: ours, with no plugins."""
    return {**os.environ, "CRIU_LIBS_DIR": no_plugins_dir()}

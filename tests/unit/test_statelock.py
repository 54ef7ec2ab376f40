"""One agent per state directory (agent.service.statelock)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from agent.errors import RefusedError
from agent.service.statelock import lock_state_dir


def test_a_second_agent_on_the_same_state_directory_is_refused_with_the_holders_pid(tmp_path: Path) -> None:
    fd = lock_state_dir(tmp_path / "state", "nodea")
    try:
        with pytest.raises(RefusedError) as ei:
            lock_state_dir(tmp_path / "state", "nodea")
        err = ei.value
        assert f"another agent (pid {os.getpid()})" in err.cause and str(tmp_path / "state") in err.cause
        assert err.node == "nodea" and "--state-dir" in err.hint
        lock_state_dir(tmp_path / "other", "nodea")  # another directory is another agent's
    finally:
        os.close(fd)


def test_the_lock_dies_with_the_agent_not_with_its_jobs(tmp_path: Path) -> None:
    """A job started by the agent outlives it; it must not keep a restarted agent out."""
    fd = lock_state_dir(tmp_path / "state")
    job = subprocess.Popen(["sleep", "30"], close_fds=False)  # inherits what is inheritable
    try:
        os.close(fd)  # the agent ends
        os.close(lock_state_dir(tmp_path / "state"))  # a restarted agent takes it
    finally:
        job.kill()
        job.wait()

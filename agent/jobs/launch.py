"""Starting a job under ferry-init: finding its PID 1, ending a start that failed, and the
paths a job's fresh /tmp must keep or must not hide."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil

from agent.errors import InvalidArgumentError
from agent.jobs import procs


def wait_for_child(outer: subprocess.Popen[bytes], timeout_s: float = 5.0) -> int | None:
    """PID 1 of the new namespace is ferry-init's only child."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            kids = psutil.Process(outer.pid).children()
        except psutil.NoSuchProcess:
            return None
        if kids:
            return kids[0].pid
        if outer.poll() is not None:
            return None
        time.sleep(0.005)
    return None


def end_unstarted(outer: subprocess.Popen[bytes]) -> None:
    """A job that never ran: its init and everything under it."""
    for pid in reversed(procs.tree_pids(outer.pid)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        outer.wait(10)


def tmp_keeps(paths: list[str]) -> list[str]:
    """The top directories under /tmp that these paths need (symlink and target alike): ferry-init
    binds them into the job's fresh /tmp, so code, cwd and logs there stay visible."""
    keep: set[str] = set()
    for p in paths:
        if not p or not p.startswith("/"):
            continue
        for path in {os.path.abspath(p), os.path.realpath(p)}:
            parts = Path(path).parts
            if len(parts) > 2 and parts[1] == "tmp" and os.path.exists(path):
                keep.add(f"/tmp/{parts[2]}")
    return sorted(keep)


def refuse_hidden(path: str, what: str, node: str) -> None:
    if fresh := _hiding(path):
        raise InvalidArgumentError(
            f"the job's {what} {path} lies under {fresh}, which every job gets fresh",
            node=node,
            hint="use a directory on the node's disk or on shared storage",
        )


def _hiding(path: str) -> str:
    """The fresh directory of the job's that hides path, or '' (/tmp keeps what the job needs:
    tmp_keeps)."""
    real = os.path.realpath(path)
    return next((f for f in procs.FRESH[1:] if real == f or real.startswith(f + "/")), "")


def check_cwd(cwd: str, node: str) -> None:
    """The job's working directory must be a directory it can enter (ferry-init chdirs there)."""
    if not os.path.exists(cwd):
        raise InvalidArgumentError(f"working directory {cwd!r} does not exist", node=node)
    if not os.path.isdir(cwd):
        raise InvalidArgumentError(f"working directory {cwd!r} is not a directory", node=node)
    if not os.access(cwd, os.X_OK):
        raise InvalidArgumentError(f"working directory {cwd!r} cannot be entered", node=node)


def find_command(cmd: str, cwd: str, env: dict[str, str], node: str) -> str:
    """The program ferry-init will exec for `cmd`, looked up as its execvp does (a path, relative to
    the job's cwd, or a name on the job's PATH); refused before the job starts if there is none,
    rather than a job that is "running" and then exits 127."""
    if "/" in cmd:
        path = os.path.join(cwd, cmd)
        refuse_hidden(path, "command", node)
        if why := _not_runnable(path, cwd):
            raise InvalidArgumentError(f"cannot run {cmd}: {why}", node=node)
        return path
    search = env.get("PATH", os.defpath)
    for d in search.split(":"):
        path = os.path.join(cwd, d or ".", cmd)
        if not _not_runnable(path, cwd) and not _hiding(path):
            return path
    raise InvalidArgumentError(
        f"cannot run {cmd}: no such command on the job's PATH ({search})",
        node=node,
        hint="give its path, or the job's PATH with --env PATH=...",
    )


def _not_runnable(path: str, cwd: str) -> str:
    """Why exec would fail on path ('' if it would not, as far as can be told from outside)."""
    if not os.path.exists(path):
        return "a dangling symlink" if os.path.lexists(path) else "no such file"
    if os.path.isdir(path):
        return "it is a directory"
    if not os.access(path, os.X_OK):
        return "it is not executable (or lies on a noexec mount)"
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError as e:
        return e.strerror or str(e)
    if head.startswith(b"#!") and (words := head[2:].split(b"\n", 1)[0].split()):
        interpreter = os.fsdecode(words[0])
        if not os.path.exists(os.path.join(cwd, interpreter)):
            return f"its interpreter {interpreter} does not exist"
    return ""


def exit_words(code: int) -> str:
    """A job's end in words. ferry-init exits with 128+N for a job killed by signal N, as a shell
    does; a restored tree's own status (waitpid) is -N."""
    sig = -code if code < 0 else code - 128 if 128 < code < 128 + signal.NSIG else 0
    if not sig:
        return f"exited with status {code}"
    try:
        name = f" ({signal.Signals(sig).name})"
    except ValueError:
        name = ""
    return f"killed by signal {sig}{name}"


def fd_path(pid: int, fd: int) -> str:
    try:
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return ""
    return target if target.startswith("/") and os.path.isfile(target) else ""


def tail(path: Path, limit: int = 300) -> str:
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return "no output"
    return text[-limit:].replace("\n", " | ") or "no output"

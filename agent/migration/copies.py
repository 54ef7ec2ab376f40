"""One image, one running copy (`ferry restore`).

A restore is refused while the image's job runs on this node (or waits preempted here), and once
the image was restored: the image's record of its restores (`image.RESTORES`, written at each
restore's commit point) and this node's journal (a restore's `running` record names its image)
both say so. `ferry restore --as-copy NAME` asks for a second copy: it gets a name of its own and,
on a job network, an address of its own (`CheckedRestore` gives its restored namespace a new
address and MAC before its link joins the bridge, so it never answers for the original's).

Whatever is restored, the restored tree must be the job its manifest describes before anyone sees
it: a launched job's PID 1 (ferry-init) carries the job's command, cwd and `--env` in its own
memory, which the image's digests cover, so `ferry ps` never shows an edited manifest's command.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from agent.criu.runner import Criu, RestoreResult
from agent.errors import AlreadyExistsError, BusyError, FerryError, ImageError, InvalidArgumentError
from agent.image import JobSpec, Manifest, Restored, describes, mark_restored, restored
from agent.jobs.network import JobNetwork, carrying
from agent.jobs.record import JobKind, JobState
from agent.jobs.registry import JobRegistry
from agent.migration.journal import TARGET, Journal
from agent.migration.restore import kill_restored
from agent.migration.states import TargetState

log = logging.getLogger(__name__)

#: The journal's kind for `ferry restore` (a preempted job's resume is "resume").
KIND_RESTORE = "restore"
#: ferry-init's PID 1 runs as `ferry-init --as-pid1 [--no-io-uring] -- COMMAND...`.
PID1_FLAG = "--as-pid1"
#: Set by `ferry run --gpu` over any `--env` value, and remapped on restore.
_OVERRIDDEN = ("CUDA_VISIBLE_DEVICES",)


def image_key(image_dir: Path) -> str:
    """How the journal names an image: its real path."""
    return os.path.realpath(image_dir)


#: Images a restore is in progress for in this process, so that two cannot both pass the checks
#: below; the lock is bookkeeping only, never held while another is taken.
_RESTORING: set[str] = set()
_RESTORING_LOCK = threading.Lock()


@contextlib.contextmanager
def one_restore(image_dir: Path, node: str) -> Iterator[None]:
    """One restore of an image at a time on this node, from its checks to its commit point."""
    key = image_key(image_dir)
    with _RESTORING_LOCK:
        if key in _RESTORING:
            raise BusyError(
                f"another restore of image {image_dir} is in progress here",
                step="restore",
                node=node,
                hint="wait for it to finish (`ferry ps`)",
            )
        _RESTORING.add(key)
    try:
        yield
    finally:
        with _RESTORING_LOCK:
            _RESTORING.discard(key)


def refuse_duplicate(
    registry: JobRegistry, journal: Journal, image_dir: Path, m: Manifest, node: str
) -> None:
    """Refuse a restore that would run a second copy of the image's job: the job runs here (or
    waits preempted), or the image was restored before (here or, by its record, anywhere)."""
    spec = m.job
    own = " (the copy gets its own address on the job network)" if spec.address else ""
    copy = f"`ferry restore {image_dir} --as-copy NAME` runs a second copy{own}"
    for rec in registry.list():
        if not (rec.state.active or rec.state is JobState.PREEMPTED):
            continue
        if describes(spec, rec.name, rec.command, rec.cwd, rec.address):
            if rec.state is JobState.PREEMPTED:
                how = f"waits here preempted to resume from {rec.checkpoint_dir}"
            else:
                how = f"still runs here ({rec.state.value}, pid {rec.pid})"
            raise AlreadyExistsError(
                f"job {rec.name!r}, which image {image_dir} holds, {how}",
                step="restore",
                node=node,
                hint=f"stop it first, or {copy}",
            )
    seen = [(r.job, r.node, r.at) for r in restored(image_dir)]
    key = image_key(image_dir)
    for r in journal.load(TARGET, states=frozenset({TargetState.RUNNING.value})):
        if (
            r.kind == KIND_RESTORE
            and r.image == key
            and not any(j == r.job and n == node for j, n, _ in seen)
        ):
            seen.append((r.job, node, r.created_at))  # its record in the image is missing (read-only?)
    if not seen:
        return
    job, where, at = max(seen, key=lambda s: s[2])
    now = ""
    if where == node:
        with contextlib.suppress(FerryError):
            rec = registry.get(job)
            now = f"; it is {rec.state.value} here" + (f" (pid {rec.pid})" if rec.state.active else "")
    times = f" ({len(seen)} restores so far)" if len(seen) > 1 else ""
    raise AlreadyExistsError(
        f"image {image_dir} was already restored, as job {job!r} on {where} at {_when(at)}{now}{times}",
        step="restore",
        node=node,
        hint=f"restoring it again would run the job twice: {copy}",
    )


def mark(image_dir: Path, job: str, node: str, restore_id: str, copy: bool) -> None:
    """Add a restore past its commit point to the image's record of restores. Never raises: the
    job runs from here on, and this node's journal has the restore whatever befalls the record
    (an image on a read-only filesystem, say)."""
    try:
        mark_restored(image_dir, Restored(job, node, restore_id, time.time(), copy))
    except Exception as e:
        log.warning(
            "job %s: its restore is not recorded in %s (%s); this node's journal has it", job, image_dir, e
        )


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def copy_of(registry: JobRegistry, m: Manifest, name: str, node: str) -> tuple[Manifest, str]:
    """The manifest a second copy restores from, and the address it replaces ("" for a job on the
    node's network): the copy's own address, from this node's pool."""
    if not name:
        raise InvalidArgumentError(
            "a copy needs a name of its own: `ferry restore DIR --as-copy NAME`", node=node
        )
    old = m.job.address
    if not old:
        return m, ""
    net = carrying(registry.network, old, node, "restore")
    taken = {r.address for r in registry.list() if r.address and r.state is not JobState.EXITED}
    new = net.allocate(taken | {old})
    return replace(m, job=replace(m.job, address=new)), old


class CheckedRestore:
    """The Criu a `ferry restore` runs through (restore_tree takes it for the real one): once CRIU
    has restored the tree, still stopped and unregistered, it checks that the tree is the job the
    manifest describes and, for a copy, moves its namespace to the copy's address while its link
    is still down and off the bridge (`JobNetwork.readdress`). A tree that fails either is killed
    here."""

    def __init__(self, criu: Criu, spec: JobSpec, image_dir: Path, network: JobNetwork | None, old: str = ""):
        self.criu = criu
        self.spec = spec  # the copy's (its own address) or the image's
        self.image_dir = image_dir
        self.network = network
        self.old = old  # the address the copy gives up ("" unless a copy on a job network)

    @property
    def node(self) -> str:
        return self.criu.node

    def __getattr__(self, name: str) -> Any:
        return getattr(self.criu, name)

    def restore(self, images_dir: Path, **kw: Any) -> RestoreResult:
        res = self.criu.restore(images_dir, **kw)
        try:
            check_restored(res.pid, self.spec, self.image_dir, self.node)
            if self.old and self.network is not None:
                self.network.readdress(res.pid, self.old, self.spec.address)
        except BaseException:
            kill_restored(res.pid)
            raise
        return res


def pid1_facts(pid: int) -> tuple[list[str], str, list[str]] | None:
    """(command, cwd, environment) of ferry-init's PID 1 as its own memory has them, or None for
    a process that is not one (an adopted job's, a test's)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="surrogateescape") for a in f.read().split(b"\0")[:-1]]
        if "--" not in argv or PID1_FLAG not in argv[: argv.index("--")]:
            return None
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = [a.decode(errors="surrogateescape") for a in f.read().split(b"\0")[:-1]]
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None
    return argv[argv.index("--") + 1 :], cwd, env


def check_restored(pid: int, spec: JobSpec, image_dir: Path, node: str) -> None:
    """Refuse a restored launched job whose PID 1 runs another command, in another directory or
    without the `--env` values, than the manifest says (what the registry records and `ps` shows)."""
    if spec.kind != JobKind.LAUNCHED.value:
        return
    facts = pid1_facts(pid)
    if facts is None:
        return
    command, cwd, env = facts
    problem = ""
    if command != spec.command:
        problem = f"job.command is {spec.command!r}, but the restored job runs {command!r}"
    elif cwd not in (spec.cwd, os.path.realpath(spec.cwd)):
        problem = f"job.cwd is {spec.cwd!r}, but the restored job runs in {cwd!r}"
    elif missing := [kv for kv in spec.env if kv not in env and kv.partition("=")[0] not in _OVERRIDDEN]:
        problem = f"job.env has {missing[0]!r}, which the restored job's environment lacks"
    if problem:
        raise ImageError(
            f"{image_dir}: the manifest does not describe the job its image holds: {problem}",
            step="restore",
            node=node,
            hint="the manifest was edited: restore an unedited copy of the image",
        )

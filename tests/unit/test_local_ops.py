"""`ferry checkpoint` and `ferry restore` on one node (agent.migration.local, .copies, .outdir):
one image, one running copy unless a copy is asked for; a restored job is the one its manifest
describes; a checkpoint checks --out first, names a full filesystem, and removes what it wrote.
A fake CRIU stands in (tests/integration/test_local_refusals.py runs the real one)."""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from fake_cuda import GPU0, CudaWorld, fake_cuda_jobs
from fakes import SH, SLEEP, FakeCriu, dies, is_stopped, launched_record, wait_for, wait_stopped

from agent.agent_config import AgentConfig, PeerSpec
from agent.cli import main as cli
from agent.criu.runner import RestoreResult
from agent.cuda.jobs import CudaJobs
from agent.errors import (
    AlreadyExistsError,
    BusyError,
    CriuError,
    ImageError,
    InvalidArgumentError,
    RefusedError,
)
from agent.image import MANIFEST, RESTORES, build_manifest, read_manifest, restored, write_manifest
from agent.jobs.network import JobNetwork, NetworkConfig
from agent.jobs.record import JobState
from agent.jobs.registry import JobRegistry
from agent.migration import copies, local, outdir
from agent.migration.journal import SOURCE, TARGET, Journal
from agent.migration.local import checkpoint
from agent.migration.local_restore import restore_image
from agent.migration.model import MigrationResult


@dataclass
class Here:
    registry: JobRegistry
    criu: FakeCriu
    cj: CudaJobs
    journal: Journal
    pid: int  # the job "train" (a sleeper)
    tmp: Path

    def save(self, out: Path, leave_running: bool = False) -> MigrationResult:
        return checkpoint(
            self.registry,
            self.criu,
            "train",
            out,
            "nodea",
            leave_running,
            journal=self.journal,
            cuda_jobs=self.cj,
        )

    def restore(self, image: Path, name: str = "", as_copy: bool = False) -> Any:
        copy = {"as_copy": True} if as_copy else {}
        return restore_image(self.registry, self.criu, image, name, "nodea", self.cj, self.journal, **copy)


@pytest.fixture
def here(tmp_path: Path, sleeper, fake_criu: FakeCriu, registry: JobRegistry, monkeypatch) -> Here:
    """Job "train" running on nodea (a CPU job), with that node's journal."""
    monkeypatch.delenv("FERRY_FAULTS", raising=False)
    monkeypatch.delenv("FERRY_PAUSE", raising=False)
    cj, _ = fake_cuda_jobs(CudaWorld())
    proc, out, err = sleeper()
    registry.save(launched_record("train", proc, out, err))
    return Here(registry, fake_criu, cj, Journal(tmp_path / "state"), proc.pid, tmp_path)


def ended(h: Here, name: str) -> None:
    """The restored copy `name` ends by itself (the registry's watcher records it)."""
    os.kill(h.registry.get(name).pid, signal.SIGKILL)
    wait_for(lambda: not h.registry.get(name).state.active, what=f"job {name} to end")


# -- defect 6: one image, one running copy ---------------------------------------------------


def test_an_image_whose_job_still_runs_here_is_refused(here: Here) -> None:
    image = here.tmp / "img"
    here.save(image, leave_running=True)

    with pytest.raises(AlreadyExistsError) as ei:
        here.restore(image, "train2")  # before: a second copy, silently

    assert (
        f"job 'train', which image {image} holds, still runs here (running, pid {here.pid})" in ei.value.cause
    )
    assert "--as-copy NAME" in ei.value.hint and ei.value.step == "restore"
    assert here.criu.restores == []
    assert [j.name for j in here.registry.list()] == ["train"]


def test_an_image_restored_once_is_refused_the_second_time(here: Here) -> None:
    image = here.tmp / "img"
    here.save(image)  # the job ends here: the image holds it
    first = here.restore(image)
    marks = restored(image)
    assert [(m.job, m.node, m.copy) for m in marks] == [("train", "nodea", False)]
    assert marks[0].restore_id.startswith("restore-")

    with pytest.raises(AlreadyExistsError, match="still runs here"):
        here.restore(image, "again")  # while the restored copy runs: named as running
    ended(here, "train")
    with pytest.raises(AlreadyExistsError) as ei:
        here.restore(image, "again")  # and after it ended: the image was restored once

    assert f"image {image} was already restored, as job 'train' on nodea at " in ei.value.cause
    assert "it is exited here" in ei.value.cause and "--as-copy NAME" in ei.value.hint
    assert len(here.criu.restores) == 1 and first.name == "train"


def test_a_restore_logs_at_the_level_it_is_given_and_at_everything_by_default(here: Here) -> None:
    """A rollback's restore reads a snapshot's chain at [snapshots] criu_log_level (the agent
    passes it); `ferry restore` logs everything, to look into one that fails."""
    image = here.tmp / "img"
    here.save(image)
    here.restore(image)
    ended(here, "train")
    copy = restore_image(
        here.registry, here.criu, image, "second", "nodea", here.cj, here.journal, as_copy=True, log_level=2
    )
    assert copy.name == "second"
    assert [r["log_level"] for r in here.criu.restores] == [4, 2]


def test_an_image_that_cannot_keep_its_record_is_refused_by_the_journal(here: Here, monkeypatch) -> None:
    """A read-only image directory takes no record of its restores: this node's journal has them."""
    image = here.tmp / "img"
    here.save(image)

    def read_only(image_dir: Path, mark: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(image_dir / RESTORES))

    monkeypatch.setattr(copies, "mark_restored", read_only)
    here.restore(image)
    assert restored(image) == []
    ended(here, "train")

    with pytest.raises(AlreadyExistsError, match="was already restored, as job 'train' on nodea"):
        here.restore(image, "again")
    restores = [r for r in here.journal.load(TARGET) if r.kind == "restore"]
    assert [r.state for r in restores] == ["running"] and restores[0].image == str(image.resolve())


def test_as_copy_runs_a_second_copy_under_its_own_name(here: Here) -> None:
    image = here.tmp / "img"
    here.save(image, leave_running=True)

    copy = here.restore(image, "copy", as_copy=True)

    assert copy.name == "copy" and copy.state is JobState.RUNNING
    assert "a second copy of job 'train'" in copy.note
    assert here.registry.get("train").state is JobState.RUNNING and not is_stopped(here.pid)
    assert [(m.job, m.copy) for m in restored(image)] == [("copy", True)]
    assert here.restore(image, "copy2", as_copy=True).name == "copy2"  # asked for: each time


def test_two_restores_of_one_image_never_run_at_once(here: Here) -> None:
    """Both would pass the checks before either reached its commit point."""
    image = here.tmp / "img"
    here.save(image)
    with copies.one_restore(image, "nodea"), pytest.raises(BusyError, match="another restore of image"):
        here.restore(image, "again")
    assert here.criu.restores == []
    here.restore(image)  # once the other is over


def test_a_copy_needs_a_name_of_its_own(here: Here) -> None:
    image = here.tmp / "img"
    here.save(image, leave_running=True)
    with pytest.raises(InvalidArgumentError, match="--as-copy NAME"):
        here.restore(image, "", as_copy=True)
    with pytest.raises(AlreadyExistsError, match="'train' already exists here"):
        here.restore(image, "train", as_copy=True)  # the running job's name stays its own


@pytest.mark.parametrize(
    ("field", "value"),
    [("command", ["/bin/true"]), ("cwd", "/srv"), ("env", ["TOKEN=forged"]), ("name", "other")],
)
def test_an_edited_manifest_is_refused_at_restore_naming_the_field(
    here: Here, field: str, value: object
) -> None:
    image = here.tmp / "img"
    here.save(image)
    d = json.loads((image / MANIFEST).read_bytes())
    d["job"][field] = value
    (image / MANIFEST).write_text(json.dumps(d))

    with pytest.raises(ImageError) as ei:
        here.restore(image, "again")  # before: `ferry ps` showed the edited value

    assert f"job.{field} does not match its digest: the manifest was edited" in ei.value.cause
    assert here.criu.restores == []


# A restored launched job's PID 1 is ferry-init, which runs as `ferry-init --as-pid1 -- COMMAND`
# in the job's cwd and environment: its memory, which the image's digests cover, holds them.
PID1 = "while :; do sleep 1; done\n"


class Pid1Criu(FakeCriu):
    """Restores `command` in `cwd` under a PID 1 that looks as ferry-init's does."""

    def __init__(self, node: str, script: Path, command: list[str], cwd: str) -> None:
        super().__init__(node)
        self.script, self.command, self.cwd = script, command, cwd
        self.externals: list[list[str]] = []

    def restore(self, images_dir: Path, **kw: Any) -> RestoreResult:
        self.restores.append({"images_dir": images_dir})
        self.externals.append(list(kw.get("external") or []))
        line = f'cd "$0" && exec {SH} {self.script} --as-pid1 -- "$@"'
        pid = os.posix_spawn(SH, [SH, "-c", line, self.cwd, *self.command], dict(os.environ), setsid=True)
        self.spawned.append(pid)
        exec_done = lambda: b"--as-pid1" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")  # noqa: E731
        wait_for(exec_done, what="the fake PID 1")
        if kw.get("leave_stopped"):
            os.kill(pid, signal.SIGSTOP)
            wait_stopped(pid)
        return RestoreResult(pid=pid, stats={})


@pytest.fixture
def pid1(here: Here) -> Iterator[Pid1Criu]:
    script = here.tmp / "fake-init"
    script.write_text(PID1)
    criu = Pid1Criu("nodea", script, [SLEEP, "60"], "/")  # the job as launched_record made it
    here.criu = criu
    yield criu
    criu.cleanup()


def test_a_restored_job_that_is_its_manifests_runs(here: Here, pid1: Pid1Criu) -> None:
    image = here.tmp / "img"
    here.save(image)
    rec = here.restore(image)
    assert rec.command == [SLEEP, "60"] and rec.state is JobState.RUNNING


def test_a_manifest_forged_with_its_digests_is_refused_by_the_restored_job_itself(
    here: Here, pid1: Pid1Criu
) -> None:
    image = here.tmp / "img"
    here.save(image)
    m = read_manifest(image)
    write_manifest(image, replace(m, job=replace(m.job, command=["/usr/bin/innocent", "--epochs", "3"])))
    assert read_manifest(image).job.command[0] == "/usr/bin/innocent"  # its digests agree

    with pytest.raises(ImageError) as ei:
        here.restore(image, "forged")

    assert (
        "job.command is ['/usr/bin/innocent', '--epochs', '3'], but the restored job runs" in ei.value.cause
    )
    assert SLEEP in ei.value.cause
    assert dies(pid1.spawned[0])  # killed before anyone saw it
    assert [j.name for j in here.registry.list()] == ["train"]  # never recorded
    rec = next(r for r in here.journal.load(TARGET) if r.kind == "restore")
    assert rec.state == "aborted" and restored(image) == []


# -- a copy on a job network gets its own address -------------------------------------------

NET = {"bridge": "ferry0", "subnet": "10.77.0.0/16", "pool": "10.77.1.0/29", "gateway": "10.77.0.1"}


@dataclass
class OnNet:
    calls: Path  # each `ip` call's arguments, a line each
    announced: list[str]  # the addresses announced (gratuitous ARP)


@pytest.fixture
def on_net(here: Here, tmp_path: Path, monkeypatch) -> OnNet:
    """nodea has a job network (its `ip` a recorder), and "train" is on it at 10.77.1.1."""
    calls = tmp_path / "ip.calls"
    fake_ip = tmp_path / "ip"
    fake_ip.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    fake_ip.chmod(stat.S_IRWXU)
    sysfs = tmp_path / "sys"
    (sysfs / "ferry0" / "bridge").mkdir(parents=True)
    (sysfs / "ferry0" / "addr_assign_type").write_text("3\n")
    monkeypatch.setattr(JobNetwork, "sysfs", str(sysfs))
    monkeypatch.setattr(JobNetwork, "probe", lambda self, address: False)
    announced: list[str] = []
    monkeypatch.setattr(JobNetwork, "announce", lambda self, pid, address: announced.append(address))
    here.registry.network = JobNetwork(NetworkConfig(**NET), "nodea", ip=str(fake_ip))
    here.registry.update("train", address="10.77.1.1", veth="fjoriginal")
    return OnNet(calls, announced)


def test_a_restored_job_reaches_its_network_only_once_recorded_as_running(
    here: Here, pid1: Pid1Criu, on_net: OnNet, monkeypatch
) -> None:
    """CRIU restores the link down and off the bridge; it comes up there, and joins the bridge
    only after the commit point: a copy that never runs says nothing to the job's peers."""
    image = here.tmp / "img"
    here.save(image)
    on_net.calls.write_text("")
    joined: list[JobState] = []
    reconnect = JobNetwork.reconnect

    def recorded(self: JobNetwork, veth: str) -> None:
        joined.append(here.registry.get("train").state)
        reconnect(self, veth)

    monkeypatch.setattr(JobNetwork, "reconnect", recorded)
    going: list[bool] = []  # whether the job ran when it was announced
    announce = JobNetwork.announce

    def announced(self: JobNetwork, pid: int, address: str) -> None:
        going.append(not is_stopped(pid))
        announce(self, pid, address)

    monkeypatch.setattr(JobNetwork, "announce", announced)

    rec = here.restore(image)

    assert pid1.externals[0] == [f"veth[eth0]:{rec.veth}"]  # no @ferry0: CRIU leaves it off
    assert joined == [JobState.RUNNING]
    assert on_net.calls.read_text().splitlines() == [
        f"link set {rec.veth} up",  # off the bridge: its carrier, long before the release
        f"link set {rec.veth} master ferry0 up",
    ]
    assert on_net.announced == ["10.77.1.1"]
    assert going == [True]  # said once it runs: its two requests, 50 ms apart, are not its pause


def test_a_restored_job_whose_link_cannot_join_its_bridge_goes_on_and_says_so(
    here: Here, pid1: Pid1Criu, on_net: OnNet
) -> None:
    """Past the commit point the copy is the job's only one: stopped, it would be stranded."""
    image = here.tmp / "img"
    here.save(image)
    fake_ip = on_net.calls.parent / "ip"
    fake_ip.write_text(
        f'#!/bin/sh\necho "$*" >> {on_net.calls}\n'
        'case "$*" in *master*) echo "RTNETLINK answers: No such device" >&2; exit 2;; esac\n'
    )

    rec = here.restore(image)

    assert rec.state is JobState.RUNNING
    assert "its peers cannot reach it: its link could not join the bridge" in rec.note, rec.note
    assert "No such device" in rec.note
    wait_for(lambda: not is_stopped(rec.pid), what="the restored job to go on")


def test_a_copy_on_a_job_network_gets_its_own_address_before_its_link_joins(
    here: Here, pid1: Pid1Criu, on_net: OnNet
) -> None:
    calls, announced = on_net.calls, on_net.announced
    image = here.tmp / "img"
    here.save(image, leave_running=True)
    assert announced == ["10.77.1.1"]  # the original went on: it says where it is
    announced.clear()
    calls.write_text("")

    copy = here.restore(image, "copy", as_copy=True)

    assert copy.address == "10.77.1.2" and here.registry.get("train").address == "10.77.1.1"
    assert announced == ["10.77.1.2"]  # never the original's
    ext = pid1.externals[0]
    assert ext == [f"veth[eth0]:{copy.veth}"]  # restored off the bridge: no @ferry0
    said = calls.read_text().splitlines()
    mac = next(line for line in said if "eth0 address" in line).split()[-1]
    assert int(mac[:2], 16) & 3 == 2  # unicast, locally administered
    steps = [
        "addr del 10.77.1.1/16 dev eth0",
        "-6 addr flush dev eth0",
        "link set dev eth0 address ",  # a MAC of its own
        "addr add 10.77.1.2/16 dev eth0",
        "route replace default via 10.77.0.1",
        f"link set {copy.veth} up",
        f"link set {copy.veth} master ferry0",  # on the bridge once recorded (restore_tree)
    ]
    at = [next(i for i, line in enumerate(said) if line.startswith(s)) for s in steps]
    assert at == sorted(at), said


# -- a peer that runs the job (the CLI asks the agent's peers) ------------------------------


def test_the_cli_refuses_a_restore_while_a_peer_runs_the_job(tmp_path: Path, sleeper, capsys) -> None:
    from agent.service.node import AgentNode
    from agent.service.serve import create_server

    proc, out, err = sleeper()
    b = AgentNode(tmp_path / "b" / "state", "nodeb", tmp_path / "b" / "staging", criu=FakeCriu("nodeb"))
    b.registry.save(launched_record("train", proc, out, err))
    server_b, port_b = create_server("127.0.0.1:0", b, max_workers=4)
    server_b.start()
    config = AgentConfig(peers=(PeerSpec(f"127.0.0.1:{port_b}"),))
    criu_a = FakeCriu("nodea")
    a = AgentNode(tmp_path / "a" / "state", "nodea", tmp_path / "a" / "staging", criu=criu_a, config=config)
    server_a, port_a = create_server("127.0.0.1:0", a, max_workers=4)
    server_a.start()
    try:
        image = tmp_path / "img"
        image.mkdir()
        (image / "pages-1.img").write_bytes(b"memory")
        spec = launched_record("train", proc, out, err).spec()
        build_manifest(image, spec, "nodeb")

        code = cli.main(["restore", str(image), "--agent", f"127.0.0.1:{port_a}"])

        said = capsys.readouterr().err
        assert code == 1 and f"job 'train', which image {image} holds, still runs on nodeb" in said, said
        assert "--as-copy NAME" in said and criu_a.restores == []
    finally:
        server_a.stop(None).wait()
        server_b.stop(None).wait()


# -- defect 7: a checkpoint's --out -------------------------------------------------------------


def test_an_out_that_takes_no_files_is_refused_before_anything_freezes(here: Here, monkeypatch) -> None:
    real_open = os.open

    def read_only(path: Any, flags: int, mode: int = 0o777, **kw: Any) -> int:
        if str(path).endswith(outdir.PROBE):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(outdir.os, "open", read_only)
    image = here.tmp / "ro" / "img"

    with pytest.raises(RefusedError) as ei:
        here.save(image)

    assert f"--out {image} is not writable (Read-only file system" in ei.value.cause, ei.value.cause
    assert "criu" not in str(ei.value).lower()  # no CRIU log that cannot exist
    assert here.criu.dumps == [] and not is_stopped(here.pid)
    assert here.registry.get("train").state is JobState.RUNNING
    assert not (here.tmp / "ro").exists()  # the directories it made are gone


def test_an_out_without_room_for_the_image_is_refused_with_the_numbers(here: Here, monkeypatch) -> None:
    monkeypatch.setattr(outdir, "free_bytes", lambda path: 300 << 10)
    monkeypatch.setattr(local, "estimated_bytes", lambda rec, fp: 65 << 20)
    out = here.tmp / "small"
    out.mkdir()  # an existing empty directory stays

    with pytest.raises(RefusedError) as ei:
        here.save(out)

    assert f"--out {out} has 0 MiB free, but the image needs about 65 MiB" in ei.value.cause
    assert "larger filesystem" in ei.value.hint
    assert here.criu.dumps == [] and here.registry.get("train").state is JobState.RUNNING
    assert out.is_dir() and list(out.iterdir()) == []


class FullCriu(FakeCriu):
    """Its dump writes part of an image, then fails as CRIU does when the filesystem is full."""

    def dump(self, pid: int, images_dir: Path, **kw: Any) -> Any:
        self.dumps.append({"pid": pid, "images_dir": images_dir, "log_dir": kw.get("log_dir")})
        (images_dir / "core-1.img").write_bytes(b"core")
        (images_dir / "pages-1.img").write_bytes(b"\0" * 4096)
        log = kw["log_dir"] / "criu-dump.log"
        log.write_text("Error (criu/page-xfer.c:263): Unable to spice data: No space left on device\n")
        raise CriuError("dump", "Error (criu/page-xfer.c:263): Unable to spice data", log_path=str(log))


@pytest.mark.parametrize("existed", [False, True])
def test_a_full_out_is_named_and_what_the_checkpoint_wrote_is_removed(
    here: Here, existed: bool, monkeypatch
) -> None:
    here.criu = FullCriu("nodea")
    free = iter([8 << 20, 4 << 10])  # when checked; once CRIU failed, with its partial image there
    monkeypatch.setattr(outdir, "free_bytes", lambda path: next(free))
    parent = here.tmp / "mnt"
    parent.mkdir()
    (parent / "users-file").write_text("not the checkpoint's")
    out = parent / "img"
    if existed:
        out.mkdir()

    with pytest.raises(CriuError) as ei:
        here.save(out)

    e = ei.value
    full = f"the --out filesystem is full: {out} has 0 MiB free now, 8 MiB when the checkpoint began"
    assert e.cause.startswith(full + ", and the image needed more (estimated "), e.cause
    log = here.tmp / "state" / "criu-logs" / here.criu.dumps[0]["log_dir"].name / "criu-dump.log"
    assert f"(CRIU log: {log})" in e.cause and log.is_file()  # a log that exists, not in --out
    assert "the 2 file(s) it wrote in" in e.cause and "larger filesystem" in e.hint
    assert out.is_dir() == existed and (not existed or list(out.iterdir()) == [])
    assert (parent / "users-file").read_text() == "not the checkpoint's"
    assert here.registry.get("train").state is JobState.RUNNING and not is_stopped(here.pid)
    rec = next(r for r in here.journal.load(SOURCE) if r.kind == "checkpoint")
    assert rec.state == "aborted" and "the --out filesystem is full" in rec.note


def test_no_space_elsewhere_is_not_blamed_on_out(here: Here) -> None:
    """CRIU says ENOSPC, but --out has room for the image: the space ran out somewhere else."""
    here.criu = FullCriu("nodea")
    with pytest.raises(CriuError) as ei:
        here.save(here.tmp / "img")
    assert "--out filesystem" not in ei.value.cause
    assert "the 2 file(s) it wrote in" in ei.value.cause  # still removed: a failed image is no image


def test_criu_logs_a_checkpoint_in_the_state_directory_and_drops_it_once_saved(here: Here) -> None:
    image = here.tmp / "img"
    here.save(image, leave_running=True)
    log_dir = here.criu.dumps[0]["log_dir"]
    assert log_dir.parent == here.tmp / "state" / "criu-logs" and log_dir.name.startswith("checkpoint-")
    assert not log_dir.exists()  # saved: its logs are not needed
    assert read_manifest(image).image_id == log_dir.name  # which save this image is


def test_an_incremental_save_links_its_parent_and_names_it_where_the_kernel_tracks(here: Here) -> None:
    """A snapshot's save with --track-mem, then one over it (CRIU's --prev-images-dir, relative
    to the image): the second image is linked to the first and its manifest names it."""
    here.criu.features.add("mem_dirty_track")
    one, two = here.tmp / "g" / "1" / "train", here.tmp / "g" / "2" / "train"
    one.parent.mkdir(parents=True)
    two.parent.mkdir(parents=True)
    args = (here.registry, here.criu, "train", one, "nodea", True)
    checkpoint(*args, journal=here.journal, cuda_jobs=here.cj, track_mem=True)
    args = (here.registry, here.criu, "train", two, "nodea", True)
    checkpoint(*args, journal=here.journal, cuda_jobs=here.cj, track_mem=True, parent=one)
    assert [(d["track_mem"], d["parent_img"]) for d in here.criu.dumps] == [
        (True, ""),
        (True, "../../1/train"),
    ]
    assert read_manifest(two).parent == read_manifest(one).image_id != ""
    assert os.readlink(two / "parent") == "../../1/train"
    assert not is_stopped(here.pid)


def test_a_save_logs_at_criu_debug_level_unless_told_otherwise(here: Here) -> None:
    """Every CRIU run logs everything; a snapshot's save passes its round's level (the node
    service gives it [snapshots] criu_log_level)."""
    for k, level in enumerate((None, 2)):
        out = here.tmp / f"s{k}"
        more = {} if level is None else {"log_level": level}
        checkpoint(
            here.registry,
            here.criu,
            "train",
            out,
            "nodea",
            True,
            journal=here.journal,
            cuda_jobs=here.cj,
            **more,
        )
    assert [d["log_level"] for d in here.criu.dumps] == [4, 2]


def test_a_cuda_jobs_snapshot_is_whole_even_where_the_kernel_tracks(here: Here) -> None:
    """What a GPU writes into host memory (its DMA) goes through no page table, so no dirty
    tracking sees it: a CUDA job's save neither tracks nor is an increment, and says so."""
    world = CudaWorld()
    world.add_cuda_process(here.pid, [GPU0])
    here.cj, _ = fake_cuda_jobs(world)
    here.criu.features.add("mem_dirty_track")
    one, two = here.tmp / "g" / "1" / "train", here.tmp / "g" / "2" / "train"
    for d in (one, two):
        d.parent.mkdir(parents=True)
    checkpoint(here.registry, here.criu, "train", one, "nodea", True, journal=here.journal, cuda_jobs=here.cj)
    args = (here.registry, here.criu, "train", two, "nodea", True)
    checkpoint(*args, journal=here.journal, cuda_jobs=here.cj, track_mem=True, parent=one)
    assert [(d["track_mem"], d["parent_img"]) for d in here.criu.dumps] == [(False, ""), (False, "")]
    assert read_manifest(two).parent == "" and not (two / "parent").exists()


def test_tracking_dirty_memory_where_the_kernel_cannot_fails_the_save_and_the_job_goes_on(here: Here) -> None:
    out = here.tmp / "g" / "1" / "train"
    out.parent.mkdir(parents=True)
    args = (here.registry, here.criu, "train", out, "nodea", True)
    with pytest.raises(CriuError, match="Tracking memory is not available"):
        checkpoint(*args, journal=here.journal, cuda_jobs=here.cj, track_mem=True)
    assert here.registry.get("train").state is JobState.RUNNING and not is_stopped(here.pid)


def test_a_warm_up_touches_in_steps_and_stops_after_its_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent.migration import capture

    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(capture, "_touch", lambda fd, off, n: calls.append((off, n)))
    capture.warm_memory(tmp_path, 150 << 20)
    assert calls == [(0, 150 << 20)]  # unbounded: at once
    calls.clear()
    capture.warm_memory(tmp_path, 150 << 20, within_s=60)
    assert calls == [(0, 64 << 20), (64 << 20, 64 << 20), (128 << 20, 22 << 20)]
    calls.clear()
    capture.warm_memory(tmp_path, 150 << 20, within_s=0)
    assert calls == []
    assert list(tmp_path.iterdir()) == []  # its file never outlives it


def test_a_warm_up_writes_every_byte_it_touches(tmp_path: Path) -> None:
    """Written, not fallocated: a tmpfs gives fallocated pages without clearing them, so the
    memory behind them was never touched."""
    from agent.migration import capture

    path = tmp_path / "f"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.pwrite(fd, b"x" * 100, (9 << 20) - 50)
        capture._touch(fd, 1 << 20, 8 << 20)
        data = path.read_bytes()
    finally:
        os.close(fd)
    assert len(data) == (9 << 20) + 50
    assert data[: 1 << 20] == bytes(1 << 20)  # a hole before it reads as zeros
    assert data[1 << 20 : 9 << 20] == bytes(8 << 20)  # written over
    assert data[9 << 20 :] == b"x" * 50  # past it: untouched

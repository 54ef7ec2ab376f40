"""A CUDA job through the whole protocol, with the fake NVIDIA stack (fake_cuda) on both sides.

The source is a real SourceMigration, the target a real TargetMigrations
reached through an in-process peer, each with its own FakeCriu and, for two
nodes, its own CudaWorld: the job's CUDA state reaches the target only inside
the image, as it does on real hardware. Every failure must leave exactly one
running copy, with its device memory back on a GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_cuda import (
    A100,
    GIB,
    GPU0,
    GPU1,
    IMAGE_FILE,
    RUNNING,
    CudaWorld,
    FakeGpu,
    R,
    fake_cuda_jobs,
)
from fakes import FakeCriu, LocalPeer, dies, is_stopped, launched_record, wait_running

from agent import faults
from agent.cli import main as cli
from agent.cuda.jobs import CudaJobs
from agent.errors import CriuError, MigrationAbortedError, RefusedError
from agent.jobs.record import JobState
from agent.jobs.registry import JobRegistry
from agent.migration import capture
from agent.migration import target as incoming
from agent.migration.journal import SOURCE, Journal
from agent.migration.local import checkpoint
from agent.migration.local_restore import restore_image
from agent.migration.model import Method, MigrationResult, MigrationSpec
from agent.migration.source import SourceMigration
from agent.migration.target import TargetMigrations
from agent.rpc import pb
from agent.testing.fake_selftest import sound_selftest

MID = "feedc0de00000001"


class TwoNodes:
    def __init__(self, tmp_path: Path, sleeper, src_world: CudaWorld, dst_world: CudaWorld) -> None:
        self.proc, out, err = sleeper()
        self.pid = self.proc.pid
        self.src_world, self.dst_world = src_world, dst_world
        self.src_world.add_cuda_process(self.pid, [GPU0], bytes_per_gpu=2 * GIB, ns_pid=1)
        self.src_cuda, self.src_drv = fake_cuda_jobs(src_world, "nodea")
        self.dst_cuda, self.dst_drv = fake_cuda_jobs(dst_world, "nodeb")
        self.src_criu, self.dst_criu = FakeCriu("nodea"), FakeCriu("nodeb")
        self.src_criu.cuda_world, self.dst_criu.cuda_world = src_world, dst_world
        self.src_reg = JobRegistry(tmp_path / "a" / "state", "nodea")
        self.src_journal = Journal(tmp_path / "a" / "state")
        self.dst_reg = JobRegistry(tmp_path / "b" / "state", "nodeb")
        self.src_reg.save(launched_record("train", self.proc, out, err))
        self.target = TargetMigrations(
            self.dst_reg,
            self.dst_criu,
            tmp_path / "b" / "staging",
            "nodeb",
            self.dst_cuda,
            Journal(tmp_path / "b" / "state"),
            self.dst_cuda.ledger,
        )
        self.staging = tmp_path / "a" / "staging"

    def migration(self, method: Method = Method.PRE_COPY) -> SourceMigration:
        return SourceMigration(
            MigrationSpec.by(method, "train", LocalPeer.address, MID),
            self.src_reg,
            self.src_criu,
            LocalPeer(self.target),
            self.staging,
            "nodea",
            "source-agent",
            cuda_jobs=self.src_cuda,
            journal=self.src_journal,
        )

    @property
    def job(self):
        return self.src_reg.get("train")

    def cleanup(self) -> None:
        self.src_criu.cleanup()
        self.dst_criu.cleanup()


@pytest.fixture
def nodes(tmp_path, sleeper, monkeypatch) -> Iterator[TwoNodes]:
    monkeypatch.delenv("FERRY_FAULTS", raising=False)
    monkeypatch.setattr(incoming, "RESUME_LOOK_S", 0.2)
    n = TwoNodes(tmp_path, sleeper, CudaWorld([FakeGpu(GPU0)]), CudaWorld([FakeGpu(A100), FakeGpu(GPU1)]))
    n.dst_world.gpus[A100].name = "NVIDIA H200"  # two H200s on the target
    yield n
    n.cleanup()


def test_a_cuda_job_moves_onto_a_gpu_of_the_target(nodes: TwoNodes) -> None:
    result = nodes.migration().run()

    assert nodes.job.state is JobState.MOVED
    assert dies(nodes.pid)
    restored = nodes.dst_criu.spawned[0]
    proc = nodes.dst_world.procs[restored]
    assert proc.state == RUNNING and proc.gpus[0] in (A100, GPU1)
    assert nodes.dst_reg.get("train").pid == restored
    # Source: lock, then checkpoint, before CRIU; target: restore onto its GPU (only the driver's
    # restore thread let run), then unlock.
    assert nodes.src_drv.actions() == ["lock", "checkpoint"]
    assert nodes.dst_drv.actions() == ["restore-thread", "restore", "unlock"]
    assert nodes.dst_drv.restore_args == [{GPU0: proc.gpus[0]}]
    assert IMAGE_FILE in nodes.dst_criu.restores[0]["files"]
    assert result.gpu_bytes == 2 * GIB
    for phase in (
        "cuda lock",
        "cuda checkpoint",
        "dump",
        "pages",
        "target restore",
        "target cuda restore",
        "target cuda unlock",
    ):
        assert phase in result.phases, phase


def test_the_default_moves_a_cuda_job_pre_copy_even_where_both_nodes_serve_post_copy(
    nodes: TwoNodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    nodes.src_criu.lazy_blocker = ""
    monkeypatch.setattr(LocalPeer, "info", lambda self: pb.NodeInfo(node_name="nodeb", post_copy=True))
    result = nodes.migration(method=Method.DEFAULT).run()
    assert (
        result.method == "pre-copy (post-copy unavailable: a CUDA job's post-copy has not run on a GPU yet)"
    )
    assert nodes.job.state is JobState.MOVED


@pytest.mark.parametrize("staged", [False, True], ids=["streamed", "staged"])
def test_memory_streams_to_the_target_unless_the_migration_is_staged(nodes: TwoNodes, staged: bool) -> None:
    result = nodes.migration(Method.STAGED if staged else Method.PRE_COPY).run()

    assert nodes.src_criu.dumps[0]["streamed"] is not staged
    files = nodes.dst_criu.restores[0]["files"]
    # The page server's file when streamed; the source's own, copied, when staged.
    assert ("pages-65537.img" in files, "pages-1.img" in files) == (not staged, staged)
    assert ("pages" in result.phases) is not staged
    assert result.image_bytes > 0 and result.host_bytes > 0


def test_a_target_whose_page_server_fails_aborts_with_its_reason(nodes: TwoNodes) -> None:
    nodes.dst_criu.page_server_error = CriuError("page-server", "no room for a page server", node="nodeb")
    with pytest.raises(MigrationAbortedError, match="no room for a page server"):
        nodes.migration().run()
    assert nodes.job.state is JobState.RUNNING
    assert nodes.target.status(MID) == pb.TARGET_STATE_ABORTED


def test_the_lease_maps_the_gpu_and_the_manifest_counts_it(nodes: TwoNodes) -> None:
    seen: dict[str, object] = {}
    real_commit = nodes.target.commit

    def commit(req: pb.CommitRequest) -> pb.CommitResponse:
        inc = nodes.target._get(req.migration_id)
        seen["map"], seen["manifest"] = dict(inc.gpu_map), inc.manifest
        return real_commit(req)

    nodes.target.commit = commit  # type: ignore[method-assign]
    nodes.migration().run()
    m = seen["manifest"]
    assert m.gpu_bytes == 2 * GIB  # type: ignore[attr-defined]
    assert m.cuda.processes[0].ns_pid == 1 and m.cuda.gpus[0].uuid == GPU0  # type: ignore[attr-defined]
    assert list(seen["map"]) == [GPU0]  # type: ignore[arg-type]


def test_lock_timeout_aborts_before_anything_is_frozen(nodes: TwoNodes) -> None:
    nodes.src_drv.busy.add(nodes.pid)
    with pytest.raises(
        MigrationAbortedError, match=f"cuda lock of pid {nodes.pid} failed: CUDA_ERROR_NOT_READY"
    ):
        nodes.migration().run()
    assert nodes.src_criu.dumps == []
    assert nodes.src_world.state(nodes.pid) == RUNNING
    assert not is_stopped(nodes.pid)
    assert nodes.job.state is JobState.RUNNING and "aborted while cuda-locking" in nodes.job.note
    assert nodes.target.status(MID) == pb.TARGET_STATE_ABORTED


def test_a_restored_cuda_job_stays_stopped_until_its_commit_point(
    nodes: TwoNodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect: the target SIGCONTed the whole restored tree for the CUDA restore, so its threads
    ran before RUNNING was journaled. Only the driver's restore thread may run then."""
    seen: list[tuple[int, str]] = []
    real = faults.check

    def at_commit_point(point: str, node: str = "") -> None:
        if point == "target-restored":  # held, registered, RUNNING not yet journaled
            pid = nodes.dst_criu.spawned[0]
            seen.append((pid, "stopped" if is_stopped(pid) else "running"))
        real(point, node)

    monkeypatch.setattr(faults, "check", at_commit_point)
    nodes.migration().run()
    assert seen and seen[0][1] == "stopped", seen
    wait_running(seen[0][0])  # released at the commit point


def test_dump_failure_after_the_cuda_checkpoint_puts_cuda_back(nodes: TwoNodes) -> None:
    from agent.errors import CriuError

    nodes.src_criu.dump_error = CriuError("dump", "no space", node="nodea")
    with pytest.raises(MigrationAbortedError):
        nodes.migration().run()
    assert nodes.src_drv.actions() == ["lock", "checkpoint", "restore", "unlock"]
    assert nodes.src_drv.restore_args == [None]  # back onto its own GPU
    assert nodes.src_world.state(nodes.pid) == RUNNING
    assert nodes.job.state is JobState.RUNNING
    wait_running(nodes.pid)


def test_cuda_restore_failure_on_the_target_kills_the_copy_there_and_resumes_the_source(
    nodes: TwoNodes,
) -> None:
    nodes.dst_drv.fail_once["restore"] = R.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(MigrationAbortedError, match=r"cuda restore of pid .* CUDA_ERROR_OUT_OF_MEMORY"):
        nodes.migration().run()
    restored = nodes.dst_criu.spawned[0]
    assert dies(restored)  # no half-restored copy runs on the target
    assert nodes.target.status(MID) == pb.TARGET_STATE_ABORTED
    assert nodes.src_world.state(nodes.pid) == RUNNING and nodes.src_world.procs[nodes.pid].gpus == [GPU0]
    assert nodes.job.state is JobState.RUNNING
    wait_running(nodes.pid)


def test_a_refused_cuda_job_is_never_frozen(nodes: TwoNodes) -> None:
    nodes.src_world.threads[nodes.pid] = ["python", "NCCL Service 0"]
    with pytest.raises(RefusedError, match="has NCCL communicators"):
        nodes.migration().run()
    assert nodes.src_drv.actions() == [] and nodes.src_criu.dumps == []
    assert nodes.target.status(MID) == pb.TARGET_STATE_UNKNOWN  # never asked for a lease
    assert nodes.job.state is JobState.RUNNING and "refused" in nodes.job.note


def test_too_little_host_memory_for_the_device_memory_is_refused(nodes: TwoNodes, monkeypatch) -> None:
    monkeypatch.setattr(capture.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=GIB))
    with pytest.raises(RefusedError, match=r"holds 2\.0 GiB of GPU memory.*only 1\.0 GiB is available"):
        nodes.migration().run()
    assert nodes.src_drv.actions() == [] and nodes.target.status(MID) == pb.TARGET_STATE_UNKNOWN


def test_the_image_size_estimate_counts_device_memory(nodes: TwoNodes) -> None:
    seen: list[pb.PrepareRequest] = []
    real = nodes.target.prepare
    nodes.target.prepare = lambda req: (seen.append(req), real(req))[1]  # type: ignore[method-assign]
    nodes.migration().run()
    assert seen[0].estimated_bytes > 2 * GIB
    assert [(g.uuid, g.memory_bytes) for g in seen[0].gpus] == [(GPU0, 2 * GIB)]
    assert seen[0].cuda_driver == "580.65.06"


def test_managed_memory_fails_the_checkpoint_and_the_job_goes_on(nodes: TwoNodes) -> None:
    nodes.src_world.managed.add(nodes.pid)
    with pytest.raises(MigrationAbortedError) as ei:
        nodes.migration().run()
    assert "CUDA_ERROR_NOT_SUPPORTED" in str(ei.value) and "managed (UVM) memory" in str(ei.value)
    assert "the job keeps running on nodea" in str(ei.value)
    assert nodes.src_criu.dumps == []
    assert nodes.src_world.state(nodes.pid) == RUNNING
    assert nodes.src_drv.actions() == ["lock", "checkpoint", "unlock"]


def test_a_source_whose_cuda_cannot_be_resumed_says_so(nodes: TwoNodes) -> None:
    from agent.errors import CriuError

    nodes.src_criu.dump_error = CriuError("dump", "no space", node="nodea")
    nodes.src_drv.fail[("restore", nodes.pid)] = R.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(MigrationAbortedError) as ei:
        nodes.migration().run()
    msg = str(ei.value)
    assert "keeps running" not in msg
    assert "putting CUDA back failed" in msg and f"the driver now reports pid {nodes.pid} checkpointed" in msg
    assert "ferry stop" in msg  # what the operator can do
    assert f"the driver now reports pid {nodes.pid} checkpointed" in nodes.job.note


def test_a_second_incoming_job_is_not_promised_the_same_gpu(nodes: TwoNodes) -> None:
    need = pb.GpuNeed(uuid="GPU-x", name="NVIDIA H200", memory_bytes=GIB)

    def prepare(mid: str) -> pb.Lease:
        return nodes.target.prepare(
            pb.PrepareRequest(migration_id=mid, job=mid, source_node="nodea", estimated_bytes=1, gpus=[need])
        )

    first, second = prepare("aa01"), prepare("aa02")
    assert {first.gpu_map[0].new_uuid, second.gpu_map[0].new_uuid} == {A100, GPU1}
    with pytest.raises(RefusedError, match="is promised to another incoming job"):
        prepare("aa03")


def test_a_hanging_nvml_never_stalls_the_fencing_query(nodes: TwoNodes) -> None:
    """NVML is read before any lock: while a Prepare waits on it, GetMigration (the source's
    fencing query) of another migration still answers at once."""
    need = pb.GpuNeed(uuid="GPU-x", name="NVIDIA H200", memory_bytes=GIB)

    def prepare(mid: str) -> pb.Lease:
        return nodes.target.prepare(
            pb.PrepareRequest(migration_id=mid, job=mid, source_node="nodea", estimated_bytes=1, gpus=[need])
        )

    first = prepare("aa01")
    nvml = nodes.target.cuda.nvml
    real, entered, go = nvml.inventory, threading.Event(), threading.Event()

    def hanging() -> object:
        entered.set()
        go.wait(30)
        return real()

    nvml.inventory = hanging  # type: ignore[method-assign]
    t = threading.Thread(target=prepare, args=("aa02",))
    t.start()
    try:
        assert entered.wait(10)
        t0 = time.monotonic()
        assert nodes.target.status("aa01") == pb.TARGET_STATE_PREPARED
        assert time.monotonic() - t0 < 1.0
        assert nodes.target.ledger.promised() == {first.gpu_map[0].new_uuid}  # aa02 holds nothing yet
    finally:
        go.set()
        t.join(10)


def test_a_target_with_another_driver_version_refuses(nodes: TwoNodes) -> None:
    nodes.dst_world.driver_version = "580.99.01"
    with pytest.raises(RefusedError, match=r"checkpointed under NVIDIA driver 580\.65\.06"):
        nodes.migration().run()
    assert nodes.src_drv.actions() == []


def test_a_target_without_the_chip_refuses_in_prepare(nodes: TwoNodes) -> None:
    for g in nodes.dst_world.gpus.values():
        g.name = "NVIDIA A100-SXM4-80GB"
    with pytest.raises(RefusedError, match="no NVIDIA H200 here") as ei:
        nodes.migration().run()
    assert "prepare on nodeb" in str(ei.value)
    assert nodes.src_drv.actions() == [] and nodes.src_criu.dumps == []
    assert nodes.job.state is JobState.RUNNING


def test_two_agents_on_one_host_share_the_gpu(tmp_path, sleeper, monkeypatch) -> None:
    """The tests' two-node setup: the job's own memory on the only GPU is freed by its checkpoint."""
    monkeypatch.setattr(incoming, "RESUME_LOOK_S", 0.2)
    world = CudaWorld([FakeGpu(GPU0, total=3 * GIB)])
    n = TwoNodes(tmp_path, sleeper, world, world)
    try:
        n.migration().run()
        restored = n.dst_criu.spawned[0]
        assert world.procs[restored].state == RUNNING and world.procs[restored].gpus == [GPU0]
        assert n.dst_drv.restore_args == [None]  # same GPU: no remap needed
    finally:
        n.cleanup()


# -- suspend and resume on one node ------------------------------------------------------


def save_here(
    registry: JobRegistry, criu: FakeCriu, cj: CudaJobs, tmp_path: Path, leave_running: bool
) -> MigrationResult:
    """`ferry checkpoint train --out TMP/img` on this node, journaled in its state directory."""
    journal = Journal(tmp_path / "state")
    return checkpoint(
        registry, criu, "train", tmp_path / "img", "nodea", leave_running, journal=journal, cuda_jobs=cj
    )


def test_checkpoint_frees_the_gpu_and_restore_puts_the_job_back(
    tmp_path, sleeper, fake_criu, registry
) -> None:
    world = CudaWorld([FakeGpu(GPU0), FakeGpu(GPU1)])
    proc, out, err = sleeper()
    world.add_cuda_process(proc.pid, [GPU0], bytes_per_gpu=4 * GIB)
    cj, drv = fake_cuda_jobs(world)
    fake_criu.cuda_world = world
    registry.save(launched_record("train", proc, out, err))
    image = tmp_path / "img"

    res = save_here(registry, fake_criu, cj, tmp_path, leave_running=False)
    assert res.gpu_bytes == 4 * GIB and "cuda checkpoint" in res.phases
    assert registry.get("train").state is JobState.CHECKPOINTED
    assert world.used(GPU0) == 0  # suspended: its GPU is free for another job
    assert dies(proc.pid)

    world.gpus[GPU0].others[4242] = 140 * GIB  # meanwhile someone took GPU0
    rec = restore_image(registry, fake_criu, image, "train2", "nodea", cj, Journal(tmp_path / "state"))
    restored = world.procs[rec.pid]
    assert restored.state == RUNNING and restored.gpus == [GPU1]
    assert GPU1 in rec.note
    assert drv.actions() == ["lock", "checkpoint", "restore-thread", "restore", "unlock"]


def test_checkpoint_leave_running_resumes_cuda_in_place(tmp_path, sleeper, fake_criu, registry) -> None:
    world = CudaWorld([FakeGpu(GPU0)])
    proc, out, err = sleeper()
    world.add_cuda_process(proc.pid, [GPU0])
    cj, drv = fake_cuda_jobs(world)
    registry.save(launched_record("train", proc, out, err))
    save_here(registry, fake_criu, cj, tmp_path, leave_running=True)
    assert world.state(proc.pid) == RUNNING and registry.get("train").state is JobState.RUNNING
    assert drv.actions() == ["lock", "checkpoint", "restore", "unlock"]
    wait_running(proc.pid)


def test_a_gpu_member_held_for_a_snapshot_stays_checkpointed_until_released(
    tmp_path, sleeper, fake_criu, registry
) -> None:
    """A group snapshot's hold (agent.snapshots.member): while held, the member's CUDA state is
    checkpointed (its device memory in host memory, in the image's dump) and its calls blocked;
    once released it is restored and unlocked in place, on its own GPU."""
    world = CudaWorld([FakeGpu(GPU0)])
    proc, out, err = sleeper()
    world.add_cuda_process(proc.pid, [GPU0], bytes_per_gpu=4 * GIB)
    cj, drv = fake_cuda_jobs(world)
    registry.save(launched_record("train", proc, out, err))
    seen = []

    def hold(m) -> None:
        seen.append((world.state(proc.pid), drv.actions(), m.gpu_bytes, registry.get("train").state))

    res = checkpoint(
        registry,
        fake_criu,
        "train",
        tmp_path / "img",
        "nodea",
        True,
        journal=Journal(tmp_path / "state"),
        cuda_jobs=cj,
        hold=hold,
    )
    state, actions, gpu_bytes, job_state = seen[0]
    assert state != RUNNING and actions == ["lock", "checkpoint"] and gpu_bytes == 4 * GIB
    assert job_state is JobState.MIGRATING
    assert drv.actions() == ["lock", "checkpoint", "restore", "unlock"]
    assert world.state(proc.pid) == RUNNING and registry.get("train").state is JobState.RUNNING
    assert res.frozen_s > 0 and "cuda checkpoint" in res.phases
    rec = next(r for r in Journal(tmp_path / "state").load(SOURCE) if r.kind == "snapshot")
    assert rec.state == "aborted"  # journaled as a checkpoint that let the job go on
    wait_running(proc.pid)


def test_restore_refuses_when_no_gpu_fits(tmp_path, sleeper, fake_criu, registry) -> None:
    world = CudaWorld([FakeGpu(GPU0, total=16 * GIB)])
    proc, out, err = sleeper()
    world.add_cuda_process(proc.pid, [GPU0], bytes_per_gpu=8 * GIB)
    cj, _ = fake_cuda_jobs(world)
    fake_criu.cuda_world = world
    registry.save(launched_record("train", proc, out, err))
    save_here(registry, fake_criu, cj, tmp_path, leave_running=False)
    world.gpus[GPU0].others[1] = 10 * GIB
    with pytest.raises(RefusedError, match=r"has 6\.0 GiB free"):
        restore_image(
            registry, fake_criu, tmp_path / "img", "again", "nodea", cj, Journal(tmp_path / "state")
        )
    assert fake_criu.restores == []  # refused before CRIU ran


# -- the RPC and the CLI ------------------------------------------------------------------


@contextlib.contextmanager
def agent_over(tmp_path: Path, make_cuda: Callable[[Any], Any]) -> Iterator[str]:
    """An in-process agent whose CUDA side `make_cuda` builds around the agent's ledger; yields its
    address."""
    from agent.service.node import AgentNode
    from agent.service.serve import create_server

    criu = FakeCriu("nodea")
    svc = AgentNode(
        tmp_path / "state",
        "nodea",
        tmp_path / "staging",
        criu=criu,
        make_cuda=make_cuda,
        selftest=sound_selftest,
    )
    server, port = create_server("127.0.0.1:0", svc, max_workers=4)
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None).wait()


def test_list_gpus_over_grpc_and_ferry_gpus(tmp_path, capsys) -> None:
    world = CudaWorld([FakeGpu(GPU0, others={321: 5 * GIB}), FakeGpu(GPU1, mig=True)])
    with agent_over(
        tmp_path, lambda ledger: fake_cuda_jobs(world, custom_storage=True, ledger=ledger)[0]
    ) as address:
        assert cli.main(["gpus", "--agent", address]) == 0
        text = capsys.readouterr().out
        assert "NVIDIA driver 580.65.06, 2 GPU(s)" in text and "custom storage" in text
        assert GPU0 in text and "321 (5.0 GiB)" in text and "(MIG)" in text
        assert cli.main(["gpus", "--agent", address, "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
    assert d["cuda"]["checkpoint"] and d["gpus"][1]["mig"] and d["gpus"][0]["processes"][0]["pid"] == 321


def test_ferry_gpus_on_a_node_without_gpus(tmp_path, capsys) -> None:
    def no_gpus(ledger: object) -> object:
        cj, _ = fake_cuda_jobs(CudaWorld([]), library=False, ledger=ledger)
        cj.nvml.module.library = False
        return cj

    with agent_over(tmp_path, no_gpus) as address:
        assert cli.main(["gpus", "--agent", address]) == 0
    text = capsys.readouterr().out
    assert "no GPUs: NVML unavailable" in text and "CUDA checkpoint unavailable" in text


@pytest.fixture(autouse=True)
def _no_stray_children() -> Iterator[None]:
    yield
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass

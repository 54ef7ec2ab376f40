"""Finding a job's CUDA processes, refusing what the driver cannot checkpoint, choosing target GPUs.

The fakes stand for the NVIDIA stack (fake_cuda); a refusal must come before
any lock, so each refusal test also checks that the driver was never asked to
lock anything.
"""

from __future__ import annotations

import pytest
from fake_cuda import A100, GIB, GPU0, GPU1, H200, CudaWorld, FakeGpu, R, fake_cuda_jobs

from agent.cuda.jobs import CudaJobs, ProcView, host_pids, nccl_transports
from agent.errors import RefusedError
from agent.gpus.inventory import GpuNeed, Inventory, Nvml, choose
from agent.migration.rollback import undo_cuda
from agent.migration.states import CudaLeft

JOB = 5000


def decide(jobs: CudaJobs, needs: list[GpuNeed], driver_version: str = "") -> dict[str, str]:
    """What a GPU decision does with this CUDA side: read NVML, check the driver, then choose with
    the frozen jobs' memory counted (agent.migration.local_restore.claim_gpus)."""
    inv = jobs.nvml.inventory()
    jobs.check_restorable(inv, driver_version, True)
    return jobs.pick_gpus(needs, inv, frozen=jobs.ledger.frozen_bytes())


def world(*gpus: FakeGpu, driver: str = "580.65.06") -> CudaWorld:
    return CudaWorld(list(gpus) or [FakeGpu(GPU0), FakeGpu(GPU1)], driver_version=driver)


def test_a_cpu_job_never_touches_the_driver_or_nvml() -> None:
    w = world()
    jobs, drv = fake_cuda_jobs(w)
    assert jobs.inspect([JOB, JOB + 1]).processes == ()
    assert drv.calls == []
    assert jobs.nvml.module.inits == 0


def test_footprint_lists_processes_gpus_and_memory() -> None:
    w = world()
    w.add_cuda_process(JOB, [GPU0, GPU1], bytes_per_gpu=3 * GIB, ns_pid=1)
    jobs, drv = fake_cuda_jobs(w)
    fp = jobs.inspect([JOB])
    assert fp.pids == [JOB]
    assert fp.processes[0].ns_pid == 1 and fp.processes[0].gpus == (GPU0, GPU1)
    assert {g.uuid: g.memory_bytes for g in fp.gpus} == {GPU0: 3 * GIB, GPU1: 3 * GIB}
    assert fp.gpu_bytes == 6 * GIB and fp.driver_version == "580.65.06"
    section = fp.section()
    assert section is not None and section.processes[0].ns_pid == 1 and section.gpu_bytes == 6 * GIB
    assert drv.actions() == []  # inspecting locks nothing


def test_a_forked_worker_with_inherited_device_files_is_a_plain_process() -> None:
    w = world()
    w.add_cuda_process(JOB, [GPU0])
    w.device_files[JOB + 1] = ["/dev/nvidiactl", "/dev/nvidia0"]  # fork kept the fds, not the context
    jobs, _ = fake_cuda_jobs(w)
    assert jobs.inspect([JOB, JOB + 1]).pids == [JOB]


def test_nvml_sees_a_process_without_device_files_we_could_read() -> None:
    w = world()
    w.add_cuda_process(JOB, [GPU0])
    w.device_files[JOB] = []
    jobs, _ = fake_cuda_jobs(w)
    # /proc found nothing, so NVML is not even asked: only a process with device files is a candidate...
    assert jobs.inspect([JOB]).pids == []
    # ...unless another process of the tree opened the devices, which makes NVML's list count.
    w.device_files[JOB + 1] = ["/dev/nvidiactl"]
    assert jobs.inspect([JOB, JOB + 1]).pids == [JOB]


def refused(w: CudaWorld, pids: list[int], **kw: object) -> str:
    jobs, drv = fake_cuda_jobs(w, **kw)  # type: ignore[arg-type]
    before = {pid: p.state for pid, p in w.procs.items()}
    with pytest.raises(RefusedError) as ei:
        jobs.inspect(pids)
    assert drv.actions() == []  # refused before any lock
    assert {pid: p.state for pid, p in w.procs.items()} == before
    return str(ei.value)


def test_nvml_listing_a_process_the_driver_denies_is_refused() -> None:
    w = world()
    w.add_cuda_process(JOB, [GPU0])
    jobs, drv = fake_cuda_jobs(w)
    drv.fail[("get-state", JOB)] = R.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(RefusedError, match=f"NVML lists pid {JOB} on GPU {GPU0} but the driver"):
        jobs.inspect([JOB])


def test_device_mappings_alone_make_a_candidate() -> None:
    w = world()
    w.add_cuda_process(JOB, [GPU0])
    w.device_files[JOB] = []  # fds closed, the device is still mapped
    w.maps[JOB] = ["7f00-7f01 rw-s 00000000 00:05 7 /dev/nvidia0"]
    jobs, _ = fake_cuda_jobs(w)
    assert jobs.inspect([JOB]).pids == [JOB]


def test_mig_is_refused() -> None:
    w = world(FakeGpu(GPU0, mig=True))
    w.add_cuda_process(JOB, [GPU0])
    assert f"GPU {GPU0} runs in MIG mode" in refused(w, [JOB])


def test_an_mps_client_is_refused() -> None:
    w = world()
    w.add_cuda_process(JOB, [GPU0])
    w.mps_clients.add(JOB)
    assert f"pid {JOB} is an MPS client" in refused(w, [JOB])


def test_nccl_is_refused_by_thread_name_or_shm_segment() -> None:
    w = world()
    w.add_cuda_process(JOB, [GPU0])
    w.threads[JOB] = ["python", "NCCL Service 0"]
    assert f"pid {JOB} has NCCL communicators" in refused(w, [JOB])
    w.threads[JOB] = ["python"]
    w.maps[JOB] = ["7f00-7f01 rw-s 00000000 00:1a 3 /dev/shm/nccl-AbCd"]
    assert "NCCL" in refused(w, [JOB])


def test_several_cuda_processes_need_r610_for_ipc() -> None:
    w = world()
    w.add_cuda_process(JOB, [GPU0])
    w.add_cuda_process(JOB + 1, [GPU1], ns_pid=2)
    msg = refused(w, [JOB, JOB + 1])
    assert f"pids {JOB}, {JOB + 1}" in msg and "580.65.06" in msg and "r610" in msg
    w.driver_version = "610.20"
    jobs, _ = fake_cuda_jobs(w)
    assert jobs.inspect([JOB, JOB + 1]).pids == [JOB, JOB + 1]


def test_every_reason_is_named_at_once() -> None:
    w = world(FakeGpu(GPU0, mig=True))
    w.add_cuda_process(JOB, [GPU0])
    w.threads[JOB] = ["NCCL Progress"]
    msg = refused(w, [JOB])
    assert "MIG" in msg and "NCCL" in msg


def test_a_process_mid_checkpoint_is_refused() -> None:
    w = world()
    w.add_cuda_process(JOB, [GPU0])
    w.procs[JOB].state = 1
    assert "already in CUDA state locked" in refused(w, [JOB])


def test_an_old_driver_is_refused_before_anything() -> None:
    w = world()
    w.add_cuda_process(JOB, [GPU0])
    assert "no CUDA checkpoint support" in refused(w, [JOB], checkpoint_api=False)


def test_device_files_but_no_nvml_is_refused() -> None:
    w = world()
    w.add_cuda_process(JOB, [GPU0])
    jobs, _ = fake_cuda_jobs(w)
    jobs.nvml.module.library = False
    with pytest.raises(RefusedError, match="NVML cannot list this node's GPUs: NVML unavailable"):
        jobs.inspect([JOB])


# -- choosing GPUs on the target --------------------------------------------------------


def inventory(w: CudaWorld) -> Inventory:
    return Nvml(fake_cuda_jobs(w)[0].nvml.module).inventory()


def test_choose_prefers_an_idle_gpu_of_the_same_chip() -> None:
    w = world(FakeGpu(A100, name="NVIDIA A100"), FakeGpu(GPU0, others={77: 10 * GIB}), FakeGpu(GPU1))
    need = GpuNeed("GPU-src", H200, 20 * GIB)
    assert choose([need], inventory(w)) == {"GPU-src": GPU1}


def test_choose_maps_each_gpu_to_a_distinct_one_and_honours_reservations() -> None:
    w = world()
    needs = [GpuNeed("GPU-a", H200, GIB), GpuNeed("GPU-b", H200, GIB)]
    got = choose(needs, inventory(w))
    assert set(got.values()) == {GPU0, GPU1}
    with pytest.raises(RefusedError, match=f"{GPU0} is promised to another incoming job"):
        choose(needs, inventory(w), reserved={GPU0})


def test_choose_refuses_precisely_without_room_or_chip() -> None:
    w = world(FakeGpu(GPU0, total=80 * GIB, others={9: 70 * GIB}))
    with pytest.raises(RefusedError) as ei:
        choose([GpuNeed("GPU-src", H200, 20 * GIB)], inventory(w), node="nodeb")
    assert f"{GPU0} has 10.0 GiB free" in str(ei.value) and "20.0 GiB" in str(ei.value)
    assert "prepare on nodeb" in str(ei.value)
    with pytest.raises(RefusedError, match=r"no NVIDIA B200 here .*this node has NVIDIA H200"):
        choose([GpuNeed("GPU-src", "NVIDIA B200", GIB)], inventory(w))
    with pytest.raises(RefusedError, match="no usable GPU"):
        choose([GpuNeed("GPU-src", H200, GIB)], Inventory(False, "NVML unavailable"))


def test_memory_the_job_itself_holds_here_counts_as_free() -> None:
    """Two agents on one host: the job's own memory on the GPU is freed by its checkpoint."""
    w = world(FakeGpu(GPU0, total=80 * GIB))
    w.add_cuda_process(JOB, [GPU0], bytes_per_gpu=60 * GIB)
    need = GpuNeed(GPU0, H200, 60 * GIB)
    with pytest.raises(RefusedError):
        choose([need], inventory(w))
    assert choose([need], inventory(w), releasing={GPU0: 60 * GIB}) == {GPU0: GPU0}


def test_remapping_needs_r580_but_the_same_gpu_does_not() -> None:
    w = world(FakeGpu(GPU0), driver="570.86.10")
    jobs, _ = fake_cuda_jobs(w)
    assert decide(jobs, [GpuNeed(GPU0, H200, GIB)]) == {GPU0: GPU0}
    with pytest.raises(RefusedError, match="restoring onto other GPUs needs driver r580, this node has 570"):
        decide(jobs, [GpuNeed("GPU-elsewhere", H200, GIB)])


# -- after restore -----------------------------------------------------------------------


def test_host_pids_maps_job_pids_in_the_restored_tree() -> None:
    w = world()
    w.add_cuda_process(JOB, [GPU0], ns_pid=1)
    section = fake_cuda_jobs(w)[0].inspect([JOB]).section()
    assert section is not None
    w.ns_pids.update({9001: 1, 9002: 7})
    view = fake_cuda_jobs(w)[0].view
    assert host_pids(view, [9001, 9002], section) == [9001]
    with pytest.raises(Exception, match=r"lacks the CUDA processes with job PIDs \[1\]"):
        host_pids(view, [9002], section)


def test_real_procview_reads_this_process() -> None:
    import os

    v = ProcView()
    assert v.ns_pid(os.getpid()) > 0
    assert any("python" in ln or "[heap]" in ln for ln in v.maps(os.getpid()))
    assert v.thread_names(os.getpid())
    assert v.device_files(os.getpid())  # at least stdin/stdout


def test_choose_skips_mig_gpus_of_the_same_chip_and_prefers_the_jobs_own_gpu_when_released() -> None:
    w = world(FakeGpu(GPU0, mig=True), FakeGpu(GPU1))
    assert choose([GpuNeed("GPU-src", H200, GIB)], inventory(w)) == {"GPU-src": GPU1}
    w = world(FakeGpu(GPU0, others={1: 2 * GIB}), FakeGpu(GPU1, others={2: 1 * GIB}))
    # GPU0's processes are the job itself (releasing): it is as good as idle and has more room then.
    assert choose([GpuNeed(GPU0, H200, GIB)], inventory(w), releasing={GPU0: 2 * GIB}) == {GPU0: GPU0}


def test_the_largest_need_is_placed_first() -> None:
    w = world(FakeGpu(GPU0, total=10 * GIB), FakeGpu(GPU1, total=30 * GIB))
    needs = [GpuNeed("GPU-small", H200, 5 * GIB), GpuNeed("GPU-big", H200, 20 * GIB)]
    assert choose(needs, inventory(w)) == {"GPU-big": GPU1, "GPU-small": GPU0}


def test_a_different_driver_version_is_refused() -> None:
    w = world()
    jobs, _ = fake_cuda_jobs(w)
    with pytest.raises(
        RefusedError, match=r"checkpointed under NVIDIA driver 570\.1, this node runs 580\.65\.06"
    ):
        decide(jobs, [GpuNeed(GPU0, H200, GIB)], driver_version="570.1")
    assert decide(jobs, [GpuNeed(GPU0, H200, GIB)], driver_version="580.65.06")


def test_a_frozen_jobs_gpu_memory_is_held_until_released() -> None:
    w = world(FakeGpu(GPU0, total=10 * GIB))
    w.add_cuda_process(JOB, [GPU0], bytes_per_gpu=8 * GIB)
    jobs, _ = fake_cuda_jobs(w)
    fp = jobs.inspect([JOB])
    jobs.freeze(fp, {})
    assert w.used(GPU0) == 0  # NVML: free...
    with pytest.raises(RefusedError, match=r"has 2\.0 GiB free"):  # ...but promised to the frozen job
        decide(jobs, [GpuNeed("GPU-other", H200, 4 * GIB)])
    assert not undo_cuda(jobs.driver, fp.pids, CudaLeft.CHECKPOINTED)
    jobs.release(fp)
    w.procs.pop(JOB)  # the job moved away: its memory is really free
    assert decide(jobs, [GpuNeed("GPU-other", H200, 4 * GIB)]) == {"GPU-other": GPU0}


def test_nccl_refusals_name_the_transport_found() -> None:
    w = world()
    w.add_cuda_process(JOB, [GPU0])
    w.threads[JOB] = ["python", "NCCL Service 0"]
    assert "transport NET/Socket or P2P" in refused(w, [JOB])
    w.maps[JOB] = ["7f00-7f01 rw-s 00000000 00:1a 3 /dev/shm/nccl-AbCd"]
    said = refused(w, [JOB])
    assert "transport SHM: /dev/shm/nccl-* segments" in said and "docs/distributed.md" in said
    assert "transport NET/IB" in nccl_transports([], ["/dev/infiniband/uverbs0"])[0]

"""What the real NVIDIA stack documents, and ferry's answer to each, against fakes that now match it.

Each case comes from a source, not from the old fake: the cuda-bindings 13.5 docstrings (lock's
timeout is CUDA_ERROR_NOT_READY; get-state may answer NOT_SUPPORTED), cuda-python #561 (older
bindings raise ValueError for the undefined state of a failed get-state), cuda-checkpoint #44
(after a failed restore every later restore answers 304 and unlock ILLEGAL_STATE), NVIDIA's
README (managed memory: the driver "does not attempt to keep the process in a good state"), and
the driver's habit of reporting host PIDs to NVML whatever namespace asks.
"""

from __future__ import annotations

import pytest
from fake_cuda import (
    CHECKPOINTED,
    FAILED,
    GIB,
    GPU0,
    GPU1,
    RUNNING,
    CudaWorld,
    FakeDriver,
    FakeGpu,
    FakeNvml,
    R,
    fake_cuda_jobs,
    probe_in,
)

from agent.agent_config import parse
from agent.cli import doctor
from agent.cuda import driver as cuda
from agent.cuda import pidprobe
from agent.cuda.driver import CudaDriver, ProcessState
from agent.errors import CudaCheckpointError, InvalidArgumentError, RefusedError
from agent.gpus.inventory import Nvml
from agent.migration.rollback import undo_cuda
from agent.migration.states import CudaLeft

JOB = 6100


def world() -> CudaWorld:
    return CudaWorld([FakeGpu(GPU0), FakeGpu(GPU1)])


# -- get-state without a CUDA context ------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "code", "named"),
    [
        (R.CUDA_ERROR_INVALID_VALUE, 1, "CUDA_ERROR_INVALID_VALUE (1)"),
        (R.CUDA_ERROR_NOT_INITIALIZED, 3, "CUDA_ERROR_NOT_INITIALIZED (3)"),
        (R.CUDA_ERROR_NOT_SUPPORTED, 801, "CUDA_ERROR_NOT_SUPPORTED (801)"),
        ("undecodable", cuda.UNDECODABLE, "ValueError"),
    ],
)
def test_get_state_without_a_context_is_no_state_with_the_raw_answer(answer, code, named) -> None:
    fake = FakeDriver(world())
    fake.no_context = answer
    reading = CudaDriver(fake, "nodea").read_state(JOB)
    assert reading.state is None and reading.code == code and named in reading.detail


def test_get_state_not_supported_on_a_driver_without_the_api_is_the_driver_refusal() -> None:
    fake = FakeDriver(world(), checkpoint_api=False)
    with pytest.raises(CudaCheckpointError) as ei:
        CudaDriver(fake, "nodea").read_state(JOB)
    assert ei.value.result == 801 and "r570" in ei.value.hint


def test_an_unknown_state_value_is_an_error_not_a_guess() -> None:
    w = world()
    w.add_cuda_process(JOB, [GPU0])
    w.procs[JOB].state = 9
    fake = FakeDriver(w)
    fake.cuCheckpointProcessGetState = lambda pid: (R.CUDA_SUCCESS, 9)  # type: ignore[method-assign]
    with pytest.raises(CudaCheckpointError, match="unknown process state 9"):
        CudaDriver(fake, "nodea").read_state(JOB)


@pytest.mark.parametrize("answer", [R.CUDA_ERROR_NOT_SUPPORTED, "undecodable"])
def test_a_worker_without_a_context_is_still_a_plain_process(answer) -> None:
    w = world()
    w.add_cuda_process(JOB, [GPU0])
    w.device_files[JOB + 1] = ["/dev/nvidiactl", "/dev/nvidia0"]  # inherited across fork
    jobs, drv = fake_cuda_jobs(w)
    drv.no_context = answer
    assert jobs.inspect([JOB, JOB + 1]).pids == [JOB]


@pytest.mark.parametrize(
    ("answer", "named"), [(R.CUDA_ERROR_NOT_SUPPORTED, "(801)"), ("undecodable", "ValueError")]
)
def test_nvml_listing_a_pid_the_driver_denies_names_the_raw_answer(answer, named) -> None:
    w = world()
    w.add_cuda_process(JOB, [GPU0])
    jobs, drv = fake_cuda_jobs(w)
    drv.no_context = answer
    w.procs.pop(JOB)  # the driver forgets it, NVML still lists it (as another GPU's memory)
    w.gpus[GPU0].others[JOB] = GIB
    with pytest.raises(RefusedError) as ei:
        jobs.inspect([JOB])
    assert f"NVML lists pid {JOB}" in ei.value.cause and named in ei.value.cause
    assert drv.actions() == []


# -- the lock timeout ----------------------------------------------------------------------------


def test_a_busy_job_times_out_with_not_ready_and_the_freeze_leaves_it_running() -> None:
    w = world()
    w.add_cuda_process(JOB, [GPU0])
    fake = FakeDriver(w)
    fake.busy.add(JOB)
    with pytest.raises(CudaCheckpointError) as ei:
        cuda.freeze(CudaDriver(fake, "nodea"), [JOB], 0.5, {})
    assert ei.value.result == cuda.NOT_READY and "retry" in ei.value.hint
    assert w.state(JOB) == RUNNING and fake.actions() == ["lock"]  # nothing to undo


# -- a failed restore poisons the process (cuda-checkpoint #44) --------------------------------


def test_after_a_failed_restore_every_restore_answers_304_and_unlock_illegal_state() -> None:
    w = world()
    w.add_cuda_process(JOB, [GPU0])
    fake = FakeDriver(w)
    drv = CudaDriver(fake, "nodea")
    drv.lock(JOB)
    drv.checkpoint(JOB)
    fake.fail_once["restore"] = R.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(CudaCheckpointError, match=r"OUT_OF_MEMORY \(2\)"):
        drv.restore(JOB)
    with pytest.raises(CudaCheckpointError, match=r"OPERATING_SYSTEM \(304\)"):
        drv.restore(JOB)
    with pytest.raises(CudaCheckpointError, match=r"ILLEGAL_STATE \(401\)"):
        drv.unlock(JOB)
    assert w.state(JOB) == CHECKPOINTED


def test_an_undo_that_meets_304_reports_the_state_and_what_to_do() -> None:
    w = world()
    w.add_cuda_process(JOB, [GPU0])
    fake = FakeDriver(w)
    drv = CudaDriver(fake, "nodea")
    cuda.freeze(drv, [JOB], 1.0, {})
    fake.broken.add(JOB)  # an earlier restore failed
    report = undo_cuda(drv, [JOB], CudaLeft.CHECKPOINTED)
    assert report and "CUDA_ERROR_OPERATING_SYSTEM (304)" in report.summary()
    assert report.states == ((JOB, "checkpointed"),)
    assert f"the driver now reports pid {JOB} checkpointed" in report.summary()


def test_the_undo_reads_the_state_when_nobody_knows_it() -> None:
    w = world()
    w.add_cuda_process(JOB, [GPU0])
    w.add_cuda_process(JOB + 1, [GPU1])
    fake = FakeDriver(w)
    drv = CudaDriver(fake, "nodea")
    drv.lock(JOB)
    drv.checkpoint(JOB)
    drv.lock(JOB + 1)  # a crash between lock and checkpoint: recovery knows neither state
    assert not cuda.undo(drv, [JOB, JOB + 1, JOB + 2])  # JOB + 2: no context, nothing to do
    assert (w.state(JOB), w.state(JOB + 1)) == (RUNNING, RUNNING)


# -- managed memory ------------------------------------------------------------------------------


def test_managed_memory_left_locked_is_unlocked_and_the_job_runs() -> None:
    w = world()
    w.add_cuda_process(JOB, [GPU0])
    w.managed.add(JOB)
    fake = FakeDriver(w)
    with pytest.raises(CudaCheckpointError) as ei:
        cuda.freeze(CudaDriver(fake, "nodea"), [JOB], 1.0, {})
    assert ei.value.result == 801 and "managed (UVM) memory" in ei.value.hint
    assert "putting CUDA back failed" not in ei.value.cause
    assert w.state(JOB) == RUNNING


def test_managed_memory_left_failed_is_reported_as_failed_never_as_left_as_it_was() -> None:
    w = world()
    w.add_cuda_process(JOB, [GPU0])
    w.managed.add(JOB)
    fake = FakeDriver(w)
    fake.managed_leaves = FAILED
    with pytest.raises(CudaCheckpointError) as ei:
        cuda.freeze(CudaDriver(fake, "nodea"), [JOB], 1.0, {})
    cause = ei.value.cause
    assert f"pid {JOB} is failed, which the driver cannot undo" in cause
    assert f"the driver now reports pid {JOB} failed" in cause
    assert ei.value.hint == cuda.UNDO_HINT


# -- explicit GPU pairs --------------------------------------------------------------------------


def test_explicit_pairs_pass_identity_pairs_for_every_checkpointed_gpu() -> None:
    w = world()
    w.add_cuda_process(JOB, [GPU0, GPU1])
    fake = FakeDriver(w)
    drv = CudaDriver(fake, "nodea", explicit_gpu_pairs=True)
    drv.lock(JOB)
    drv.checkpoint(JOB)
    drv.restore(JOB, {GPU0: GPU0, GPU1: GPU1})
    assert fake.restore_args == [{GPU0: GPU0, GPU1: GPU1}]
    assert w.procs[JOB].gpus == [GPU0, GPU1]


def test_explicit_pairs_come_from_the_cuda_table_of_the_config() -> None:
    cfg = parse({"cuda": {"explicit_gpu_pairs": True, "lock_timeout_s": 5}})
    assert cfg.cuda.explicit_gpu_pairs is True and cfg.cuda.lock_timeout_s == 5.0
    with pytest.raises(InvalidArgumentError, match="expected true or false"):
        parse({"cuda": {"explicit_gpu_pairs": 1}})
    with pytest.raises(InvalidArgumentError, match="unknown key 'pairs'"):
        parse({"cuda": {"pairs": True}})


# -- NVML's PIDs against the agent's --------------------------------------------------------------


def test_the_probe_matches_when_nvml_reports_our_pids() -> None:
    w = world()
    result = probe_in(w)(Nvml(FakeNvml(w), "nodea"))
    assert result.verdict is pidprobe.PidVerdict.MATCH and GPU0 in result.detail


def test_the_probe_sees_host_pids_as_a_mismatch() -> None:
    w = world()
    result = probe_in(w)(Nvml(FakeNvml(w, host_pid_offset=400_000), "nodea"))
    assert result.mismatch
    assert "another PID namespace" in result.detail and "probe's pid" in result.detail


def test_a_probe_that_makes_no_context_says_nothing_about_pids() -> None:
    w = world()
    result = probe_in(w, makes_context=False)(Nvml(FakeNvml(w), "nodea"))
    assert result.verdict is pidprobe.PidVerdict.UNKNOWN and "CUDA_ERROR_NO_DEVICE" in result.detail


def test_no_gpu_means_no_probe() -> None:
    w = CudaWorld([])
    result = probe_in(w)(Nvml(FakeNvml(w), "nodea"))
    assert result.verdict is pidprobe.PidVerdict.UNKNOWN


def test_a_job_unlisted_because_of_host_pids_is_refused_with_that_reason() -> None:
    w = world()
    w.add_cuda_process(JOB, [GPU0])
    jobs, drv = fake_cuda_jobs(w, host_pid_offset=400_000)
    with pytest.raises(RefusedError) as ei:
        jobs.inspect([JOB])
    e = ei.value
    assert f"pid {JOB} has a CUDA context (driver state running) but NVML lists it on no GPU" in e.cause
    assert "another PID namespace" in e.cause and "hostPID" in e.hint
    assert drv.actions() == []
    assert jobs.nvml_pids() is jobs.nvml_pids()  # probed once


def test_doctor_shows_the_pid_check() -> None:
    w = world()
    nvml = Nvml(FakeNvml(w, host_pid_offset=400_000), "nodea")
    checks = {c.name: c for c in doctor._gpu_checks(nvml, CudaDriver(FakeDriver(w)), probe_in(w))}
    assert not checks["nvml pids"].ok and "hostPID" in checks["nvml pids"].fix
    w2 = world()
    nvml2 = Nvml(FakeNvml(w2), "nodea")
    checks2 = {c.name: c for c in doctor._gpu_checks(nvml2, CudaDriver(FakeDriver(w2)), probe_in(w2))}
    assert checks2["nvml pids"].ok


def test_state_reading_of_a_running_process() -> None:
    w = world()
    w.add_cuda_process(JOB, [GPU0])
    reading = CudaDriver(FakeDriver(w), "nodea").read_state(JOB)
    assert reading.state is ProcessState.RUNNING and reading.code == 0

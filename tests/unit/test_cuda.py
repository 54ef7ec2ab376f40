"""agent.cuda.driver against the fake driver: every transition of the checkpoint state machine, every error.

The fake (fake_cuda.FakeDriver) enforces the driver's rules, so these tests
also pin down that ferry calls the API in an order the real driver accepts.
"""

from __future__ import annotations

import pytest
from fake_cuda import (
    A100,
    CHECKPOINTED,
    FAILED,
    GPU0,
    GPU1,
    LOCKED,
    RUNNING,
    CudaWorld,
    FakeDriver,
    FakeGpu,
    R,
)

from agent.cuda import driver as cuda
from agent.cuda.driver import CudaDriver, ProcessState, uuid_bytes, uuid_text
from agent.errors import CudaCheckpointError, RefusedError
from agent.migration.rollback import undo_cuda
from agent.migration.states import CudaLeft

PID = 4100


def make(world: CudaWorld | None = None, **kw: object) -> tuple[CudaDriver, FakeDriver, CudaWorld]:
    w = world or CudaWorld([FakeGpu(GPU0), FakeGpu(GPU1)])
    w.add_cuda_process(PID, [GPU0])
    fake = FakeDriver(w, **kw)  # type: ignore[arg-type]
    return CudaDriver(fake, "nodea"), fake, w


def test_uuid_text_and_bytes_round_trip() -> None:
    raw = uuid_bytes(GPU1)
    assert len(raw) == 16 and raw[-1] == 1
    assert uuid_text(raw) == GPU1
    with pytest.raises(ValueError):
        uuid_bytes("GPU-1234")


def test_full_cycle_walks_the_state_machine() -> None:
    drv, fake, w = make()
    assert drv.state(PID) is ProcessState.RUNNING
    drv.lock(PID, 1.0)
    assert w.state(PID) == LOCKED and drv.state(PID) is ProcessState.LOCKED
    drv.checkpoint(PID)
    assert w.state(PID) == CHECKPOINTED
    assert w.used(GPU0) == 0  # the checkpoint released the GPU
    drv.restore(PID, None)
    assert w.state(PID) == LOCKED and w.procs[PID].gpus == [GPU0]
    drv.unlock(PID)
    assert w.state(PID) == RUNNING
    assert fake.actions() == ["lock", "checkpoint", "restore", "unlock"]
    assert drv.restore_thread(PID) == PID  # the fake's: the process's last thread (none here)


def test_restore_onto_another_gpu_passes_the_uuid_pairs() -> None:
    drv, fake, w = make()
    drv.lock(PID)
    drv.checkpoint(PID)
    drv.restore(PID, {GPU0: GPU1})
    assert fake.restore_args == [{GPU0: GPU1}]
    assert w.procs[PID].gpus == [GPU1]


def test_identity_map_restores_without_pairs() -> None:
    """Same GPUs: no pair list, so drivers without remap (r570) accept it."""
    drv, fake, _w = make()
    drv.lock(PID)
    drv.checkpoint(PID)
    drv.restore(PID, {GPU0: GPU0})
    assert fake.restore_args == [None]


def test_lock_timeout_names_pid_action_and_result_and_leaves_running() -> None:
    drv, fake, w = make()
    fake.busy.add(PID)
    with pytest.raises(CudaCheckpointError) as ei:
        drv.lock(PID, 0.25)
    e = ei.value
    assert (e.pid, e.action, e.result, e.result_name) == (PID, "lock", 600, "CUDA_ERROR_NOT_READY")
    assert "0.25 s" in e.hint and "retry" in e.hint and "nodea" in str(e)
    assert w.state(PID) == RUNNING


def test_a_lock_answering_cuda_error_timeout_is_a_timeout_too() -> None:
    drv, fake, _w = make()
    fake.fail["lock"] = R.CUDA_ERROR_TIMEOUT
    with pytest.raises(CudaCheckpointError) as ei:
        drv.lock(PID, 2.0)
    assert ei.value.result == 909 and "within 2 s" in ei.value.hint and "retry" in ei.value.hint


@pytest.mark.parametrize(
    ("call", "state"),
    [
        ("checkpoint", RUNNING),
        ("restore", RUNNING),
        ("unlock", RUNNING),
        ("lock", LOCKED),
        ("unlock", CHECKPOINTED),
    ],
)
def test_out_of_order_calls_are_illegal_state(call: str, state: int) -> None:
    drv, _fake, w = make()
    w.procs[PID].state = state
    with pytest.raises(CudaCheckpointError) as ei:
        getattr(drv, call)(PID)
    assert ei.value.result_name == "CUDA_ERROR_ILLEGAL_STATE"
    assert w.state(PID) == state


def test_failed_is_terminal() -> None:
    drv, fake, w = make()
    drv.lock(PID)
    fake.fail["checkpoint"] = R.CUDA_ERROR_OUT_OF_MEMORY
    fake.fail_terminal.add("checkpoint")
    with pytest.raises(CudaCheckpointError):
        drv.checkpoint(PID)
    assert drv.state(PID) is ProcessState.FAILED
    for call in ("lock", "checkpoint", "restore", "unlock"):
        with pytest.raises(CudaCheckpointError):
            getattr(drv, call)(PID)
    assert w.state(PID) == FAILED


def test_restore_map_must_cover_every_checkpointed_gpu() -> None:
    w = CudaWorld([FakeGpu(GPU0), FakeGpu(GPU1)])
    drv, _fake, _ = make(w)
    w.procs[PID].gpus = [GPU0, GPU1]
    drv.lock(PID)
    drv.checkpoint(PID)
    with pytest.raises(CudaCheckpointError) as ei:
        drv.restore(PID, {GPU0: GPU1})
    assert ei.value.result_name == "CUDA_ERROR_INVALID_VALUE"
    assert w.state(PID) == CHECKPOINTED  # still restorable
    drv.restore(PID, {GPU0: GPU1, GPU1: GPU0})
    assert w.procs[PID].gpus == [GPU1, GPU0]


def test_restore_needs_the_same_chip() -> None:
    w = CudaWorld([FakeGpu(GPU0), FakeGpu(A100, name="NVIDIA A100-SXM4-80GB")])
    drv, _fake, _ = make(w)
    drv.lock(PID)
    drv.checkpoint(PID)
    with pytest.raises(CudaCheckpointError) as ei:
        drv.restore(PID, {GPU0: A100})
    assert ei.value.result_name == "CUDA_ERROR_INVALID_DEVICE"


def test_not_a_cuda_process_has_no_state() -> None:
    drv, _fake, _w = make()
    assert drv.state(PID + 99) is None


def test_old_driver_is_not_supported_everywhere() -> None:
    drv, _fake, _w = make(checkpoint_api=False, cuda_version=12040)
    info = drv.probe()
    assert info.loaded and not info.checkpoint
    assert "12.4" in info.detail and "r570" in info.detail
    with pytest.raises(RefusedError, match="no CUDA checkpoint support"):
        drv.require_checkpoint()
    with pytest.raises(CudaCheckpointError) as ei:
        drv.state(PID)
    assert ei.value.result == cuda.NOT_SUPPORTED and "r570" in ei.value.hint
    with pytest.raises(CudaCheckpointError):
        drv.lock(PID)


def test_probe_reports_custom_storage() -> None:
    assert make(custom_storage=True)[0].probe().custom_storage
    info = make()[0].probe()
    assert info.checkpoint and not info.custom_storage and info.cuda_version == 13000


def test_no_driver_library_is_a_precise_refusal() -> None:
    drv, _fake, _w = make(library=False)
    info = drv.probe()
    assert not info.loaded and "cannot be loaded" in info.detail
    with pytest.raises(
        RefusedError, match="the job uses CUDA but the NVIDIA driver library cannot be loaded"
    ):
        drv.require_checkpoint()


def test_real_bindings_without_a_driver_probe_cleanly() -> None:
    """This machine has cuda-bindings but no libcuda: the real module must not crash the agent."""
    info = CudaDriver(node="nodea").probe()
    assert not info.loaded
    assert info.detail


# -- a whole job ------------------------------------------------------------------------


def two_procs() -> tuple[CudaDriver, FakeDriver, CudaWorld]:
    w = CudaWorld([FakeGpu(GPU0), FakeGpu(GPU1)], driver_version="610.10")
    fake = FakeDriver(w)
    w.add_cuda_process(1, [GPU0])
    w.add_cuda_process(2, [GPU1], ns_pid=2)
    return CudaDriver(fake, "nodea"), fake, w


def test_freeze_then_thaw_elsewhere_times_each_phase() -> None:
    drv, fake, w = two_procs()
    times: dict[str, float] = {}
    cuda.freeze(drv, [1, 2], 1.0, times)
    assert {w.state(1), w.state(2)} == {CHECKPOINTED}
    cuda.thaw(drv, [(1, {GPU0: GPU1}), (2, {GPU1: GPU0})], times)
    assert {w.state(1), w.state(2)} == {RUNNING}
    assert w.procs[1].gpus == [GPU1] and w.procs[2].gpus == [GPU0]
    assert set(times) == {"cuda lock", "cuda checkpoint", "cuda restore", "cuda unlock"}
    # Every process is locked before any is checkpointed.
    assert fake.actions()[:4] == ["lock", "lock", "checkpoint", "checkpoint"]


def test_freeze_lock_timeout_unlocks_the_ones_already_locked() -> None:
    drv, fake, w = two_procs()
    fake.busy.add(2)
    with pytest.raises(CudaCheckpointError, match="cuda lock of pid 2"):
        cuda.freeze(drv, [1, 2], 0.1, {})
    assert (w.state(1), w.state(2)) == (RUNNING, RUNNING)
    assert fake.actions() == ["lock", "lock", "unlock"]


def test_freeze_checkpoint_failure_restores_and_unlocks_the_rest() -> None:
    drv, fake, w = two_procs()
    fake.fail[("checkpoint", 2)] = R.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(
        CudaCheckpointError, match="cuda checkpoint of pid 2 failed: CUDA_ERROR_OUT_OF_MEMORY"
    ):
        cuda.freeze(drv, [1, 2], 1.0, {})
    assert (w.state(1), w.state(2)) == (RUNNING, RUNNING)
    assert w.procs[1].gpus == [GPU0]


def test_freeze_failure_that_cannot_be_undone_says_so() -> None:
    drv, fake, w = two_procs()
    fake.fail[("checkpoint", 2)] = R.CUDA_ERROR_OUT_OF_MEMORY
    fake.fail[("restore", 1)] = R.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(CudaCheckpointError) as ei:
        cuda.freeze(drv, [1, 2], 1.0, {})
    cause = ei.value.cause
    assert "putting CUDA back failed (pid 1:" in cause and "CUDA_ERROR_OUT_OF_MEMORY (2)" in cause
    assert "the driver now reports pid 1 checkpointed" in cause
    assert ei.value.hint == cuda.UNDO_HINT and "ferry stop" in ei.value.hint
    assert w.state(1) == CHECKPOINTED  # not unlocked: it was never restored


def test_unfreeze_resumes_in_place_and_reports_what_failed() -> None:
    drv, fake, w = two_procs()
    cuda.freeze(drv, [1, 2], 1.0, {})
    assert not undo_cuda(drv, [1, 2], CudaLeft.CHECKPOINTED)
    assert (w.state(1), w.state(2)) == (RUNNING, RUNNING)
    cuda.freeze(drv, [1, 2], 1.0, {})
    fake.fail[("restore", 2)] = R.CUDA_ERROR_OUT_OF_MEMORY
    report = undo_cuda(drv, [1, 2], CudaLeft.CHECKPOINTED)
    assert len(report.failures) == 1 and report.failures[0].startswith("pid 2:")
    assert report.states == ((2, "checkpointed"),)
    assert w.state(1) == RUNNING


def test_an_undo_from_the_journal_that_finds_a_process_further_on_reads_the_driver() -> None:
    """The journal says checkpointed, but an earlier resume that was cut short already restored
    pid 1 (LOCKED now): restoring it again fails, so the undo reads each state and unlocks it."""
    drv, _, w = two_procs()
    cuda.freeze(drv, [1, 2], 1.0, {})
    drv.restore(1, None)
    assert w.state(1) == LOCKED
    assert not undo_cuda(drv, [1, 2], CudaLeft.CHECKPOINTED)
    assert (w.state(1), w.state(2)) == (RUNNING, RUNNING)


def test_not_supported_on_a_capable_driver_points_at_managed_memory() -> None:
    drv, _fake, w = make()
    w.managed.add(PID)
    with pytest.raises(CudaCheckpointError) as ei:
        cuda.freeze(drv, [PID], 1.0, {})
    assert ei.value.result_name == "CUDA_ERROR_NOT_SUPPORTED"
    assert "managed (UVM) memory" in str(ei.value)
    assert w.state(PID) == RUNNING  # unlocked again


def test_freeze_undoes_on_any_exception() -> None:
    drv, fake, w = two_procs()

    def boom(pid: int, args: object) -> None:
        raise TypeError("bindings changed")

    fake.cuCheckpointProcessCheckpoint = boom  # type: ignore[method-assign]
    with pytest.raises(TypeError):
        cuda.freeze(drv, [1, 2], 1.0, {})
    assert (w.state(1), w.state(2)) == (RUNNING, RUNNING)


def test_an_unexpected_get_state_error_is_raised_not_taken_for_no_context() -> None:
    drv, fake, _w = make()
    fake.fail["get-state"] = R.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(CudaCheckpointError, match="get-state"):
        drv.state(PID)


def test_only_a_lock_timeout_gets_the_retry_hint() -> None:
    drv, _fake, w = make()
    w.procs[PID].state = LOCKED
    with pytest.raises(CudaCheckpointError) as ei:
        drv.lock(PID, 1.0)
    assert "within" not in ei.value.hint

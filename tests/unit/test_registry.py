"""The job registry's hold on names and GPUs (agent.jobs.registry): a restore never overwrites a job
that took its name meanwhile, and an unreadable record fails closed (its name and GPUs stay taken)."""

from __future__ import annotations

import json
import logging
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from fakes import FakeCriu, launched_record, wait_for

from agent.errors import AlreadyExistsError, RefusedError
from agent.gpus.ledger import GpuLedger
from agent.jobs.record import JobKind, JobRecord, JobState
from agent.jobs.registry import STATUS_FILE, JobRegistry, exit_status
from agent.service.node import AgentNode

Sleeper = Callable[[], tuple[subprocess.Popen[bytes], Path, Path]]


def test_a_restore_refuses_a_name_a_job_took_while_it_ran(registry: JobRegistry, sleeper: Sleeper) -> None:
    """restore_tree reserves the name before CRIU runs and registers after: a `ferry run` or adopt
    of that name in between keeps its record, and the restore is refused (restore_tree then kills
    the restored tree)."""
    restored, out, err = sleeper()
    registry.reserve_name("train")  # what restore_tree does first
    started, out2, err2 = sleeper()
    registry.save(launched_record("train", started, out2, err2))  # meanwhile, the same name
    spec = launched_record("train", restored, out, err).spec()
    with pytest.raises(AlreadyExistsError, match=r"job 'train' .*running") as e:
        registry.register_restored(spec, restored.pid, str(out), str(err), note="restored")
    assert e.value.node == "nodea"
    assert registry.get("train").pid == started.pid
    on_disk = JobRegistry(registry.root.parent, "nodea").get("train")
    assert on_disk.pid == started.pid


def test_a_resumed_job_replaces_its_own_preempted_record(registry: JobRegistry, sleeper: Sleeper) -> None:
    proc, out, err = sleeper()
    registry.save(
        JobRecord("train", JobKind.LAUNCHED, JobState.PREEMPTED, 1, ["x"], "/", checkpoint_dir="/img")
    )
    spec = launched_record("train", proc, out, err).spec()
    rec = registry.register_restored(spec, proc.pid, str(out), str(err), resuming=True, note="resumed")
    assert registry.get("train") is rec and rec.state is JobState.RUNNING and rec.pid == proc.pid


def _write_record(root: Path, name: str, text: str) -> Path:
    path = root / "jobs" / name / "job.json"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path


def _record_json(**changes: object) -> str:
    rec = JobRecord("train", JobKind.LAUNCHED, JobState.RUNNING, 1, ["x"], "/", gpus=["G1"], gpu_chip="H200")
    d = json.loads(rec.to_json())
    d.update(changes)
    return json.dumps(d, indent=2)


def test_an_unreadable_record_keeps_its_name_and_gpus(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _write_record(tmp_path, "train", _record_json(state="paused"))  # a state this agent does not know
    with caplog.at_level(logging.ERROR, logger="agent.jobs.registry"):
        reg = JobRegistry(tmp_path, "nodea")
    assert str(path) in caplog.text
    with pytest.raises(AlreadyExistsError, match=rf"{path}.*unreadable") as e:
        reg.reserve_name("train")
    assert e.value.hint
    ledger = GpuLedger(reg)
    assert "G1" in ledger.unavailable("other")
    assert "unreadable" in ledger.unavailable("other")["G1"]
    assert ledger.decide("a start", "other", lambda taken, _: (sorted(taken), [])) == ["G1"]


def test_a_torn_record_keeps_the_gpus_it_still_names(tmp_path: Path) -> None:
    text = _record_json()
    _write_record(tmp_path, "train", text[: text.index('"gpu_chip"')])  # cut after its GPUs
    ledger = GpuLedger(JobRegistry(tmp_path, "nodea"))
    assert "G1" in ledger.unavailable("other")


def test_a_record_whose_gpus_cannot_be_told_refuses_every_gpu_decision(tmp_path: Path) -> None:
    text = _record_json()
    path = _write_record(tmp_path, "train", text[: text.index('"priority"')])  # cut before its GPUs
    ledger = GpuLedger(JobRegistry(tmp_path, "nodea"))
    with pytest.raises(RefusedError, match=rf"{path}") as e:
        ledger.decide("the start of job b", "b", lambda taken, _: (None, ["G0"]))
    assert e.value.hint
    assert ledger.promised() == set()


def test_the_agent_reports_an_unreadable_record_as_an_event(tmp_path: Path) -> None:
    path = _write_record(tmp_path / "state", "train", "{not json")
    criu = FakeCriu("nodea")
    try:
        node = AgentNode(tmp_path / "state", "nodea", tmp_path / "staging", criu=criu)
        alerts = [e for e in node.events.recent(10) if e.kind == "alert"]
    finally:
        criu.cleanup()
    assert len(alerts) == 1 and alerts[0].job == "train" and str(path) in alerts[0].message


# -- a restart that is no longer the job's parent ------------------------------------------------


def test_a_job_that_ended_while_the_agent_was_down_keeps_the_status_its_pid1_recorded(
    registry: JobRegistry, sleeper: Sleeper
) -> None:
    proc, out, err = sleeper()
    rec = launched_record("train", proc, out, err)
    rec.private = True  # under ferry-init --private: its log directory is the agent's
    registry.save(rec)
    proc.kill()
    proc.wait()
    (out.parent / STATUS_FILE).write_text("7\n")  # what ferry-init's PID 1 writes at the end
    again = JobRegistry(registry.root.parent, "nodea").get("train")
    assert (again.state, again.exit_code) == (JobState.EXITED, 7)
    assert "exited with status 7 while the agent was down" in again.note


@pytest.mark.parametrize("recorded", [True, False], ids=["pid1-recorded", "pid1-killed-too"])
def test_a_stop_cut_short_by_a_restart_is_finished_and_its_end_recorded(
    registry: JobRegistry, sleeper: Sleeper, recorded: bool
) -> None:
    """Its SIGKILL comes at the end of the grace, counted from when the stop began; the end is
    recorded as 137 whether or not its PID 1 lived to write it."""
    proc, out, err = sleeper()
    rec = launched_record("train", proc, out, err)
    rec.state, rec.stop_grace_s, rec.private = JobState.STOPPED, 0.5, True
    registry.save(rec)  # the agent died during the grace; the job ignores SIGTERM
    if recorded:
        (out.parent / STATUS_FILE).write_text("137\n")  # what its PID 1 records once it is killed
    again = JobRegistry(registry.root.parent, "nodea")
    assert proc.wait(10) == -9  # SIGKILLed by the restarted agent
    wait_for(lambda: again.get("train").exit_code is not None, what="the stopped job's end recorded")
    assert again.get("train").state is JobState.STOPPED and again.get("train").exit_code == 137


def test_an_adopted_jobs_log_directory_is_never_read_or_cleaned_for_a_status(
    registry: JobRegistry, sleeper: Sleeper
) -> None:
    """Its logs sit in the user's directory: a file named exit-status there is the user's."""
    proc, out, err = sleeper()
    rec = launched_record("mine", proc, out, err)
    rec.kind = JobKind.ADOPTED
    users = out.parent / STATUS_FILE
    users.write_text("3\n")
    registry.save(rec)
    assert exit_status(rec) is None
    registry._watch(rec, proc.wait)  # as a restore of it would watch it
    proc.kill()
    wait_for(lambda: registry.get("mine").state is JobState.EXITED, what="its end recorded")
    assert users.read_text() == "3\n" and registry.get("mine").exit_code == -9


def test_a_child_reaped_by_another_waiter_still_has_its_end_recorded_from_its_pid1(
    registry: JobRegistry, sleeper: Sleeper
) -> None:
    """waitpid raises ChildProcessError when something else in the agent's process reaped the
    child first: the end is still recorded, with the status its PID 1 wrote."""
    proc, out, err = sleeper()
    rec = launched_record("train", proc, out, err)
    rec.private = True  # under ferry-init --private: its log directory is the agent's
    registry.save(rec)
    proc.kill()
    proc.wait()  # the other waiter

    def wait() -> int:
        (out.parent / STATUS_FILE).write_text("137\n")  # PID 1's record of the kill
        raise ChildProcessError(10, "No child processes")

    registry._watch(rec, wait)
    wait_for(lambda: registry.get("train").state is JobState.EXITED, what="its end recorded")
    assert registry.get("train").exit_code == 137

"""Agents killed during a local operation (`ferry checkpoint`, a preemption's suspend), then
restarted: each freeze is journaled like a move's, so recovery resumes the job, or ends it
as it asked once its image is complete. Never a job left MIGRATING and stopped."""

from __future__ import annotations

import subprocess
import sys

from tests.integration.jobtools import assert_completed_exactly_once, run_training, wait_state, wait_steps
from tests.integration.test_faults import (
    PAUSE_S,
    assert_no_copy,
    assert_nothing_frozen,
    assert_ran_once_after_restart,
    assert_resumed,
    kill,
    restart,
    wait_paused,
    wait_record,
)
from tests.integration.test_selfheal import run_on_gpu, wait_event, world, write_world


def checkpoint_in_background(agent, name: str, out: str, *flags: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "agent.cli.main", "checkpoint", name, "--agent", f"unix:{agent.socket}"]
    cmd += ["--out", out, *flags]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=agent.env)


def test_agent_killed_during_a_leave_running_checkpoint_resumes_the_job(agents, tmp_path):
    """Defect: the job stayed `migrating` and stopped after the restart, and `ferry resolve`
    said there was no unsettled migration."""
    a = agents("node-a", env={"FERRY_PAUSE": f"checkpoint-dumped={PAUSE_S}"})
    run_training(a, "ck", steps=60)
    wait_steps(a, "ck", 5)
    cli = checkpoint_in_background(a, "ck", str(tmp_path / "img"), "--leave-running")
    wait_paused(a, "checkpoint-dumped")
    assert wait_record(a, "source", ("transferring",))["kind"] == "checkpoint"
    kill(a)
    cli.communicate(timeout=60)
    assert cli.returncode != 0

    restart(a)
    assert_resumed(a, "ck", "checkpoint settled", "resumed here")
    assert wait_record(a, "source", ("aborted",))
    assert_ran_once_after_restart(a, "ck", steps=60)


def test_agent_killed_once_a_checkpoint_is_saved_ends_the_job_and_its_image_restores(agents, tmp_path):
    a = agents("node-a", env={"FERRY_PAUSE": f"checkpoint-saved={PAUSE_S}"})
    run_training(a, "cs", steps=60)
    wait_steps(a, "cs", 5)
    image = tmp_path / "img"
    cli = checkpoint_in_background(a, "cs", str(image))
    wait_paused(a, "checkpoint-saved")
    kill(a)
    cli.communicate(timeout=60)

    restart(a)
    saved = wait_state(a, "cs", "checkpointed")
    assert saved["checkpoint_dir"] == str(image), saved
    assert wait_record(a, "source", ("committed",))
    assert_no_copy(a, "cs")
    a.cli("restore", str(image), "--name", "cs2")
    assert_completed_exactly_once(a, "cs2", steps=60)


def test_agent_killed_during_a_preemptions_suspend_keeps_the_job_preempted_and_resumes_it(agents, tmp_path):
    """The spare's agent dies while it suspends its low-priority job for an incoming one: after
    its restart the job is PREEMPTED (its image complete), resumes once its GPU is free, and
    runs every step once."""
    telemetry = {n: tmp_path / f"{n}-nvml.json" for n in ("node-s", "node-a")}
    write_world(telemetry["node-s"], world("GPU-s0"))
    write_world(telemetry["node-a"], world("GPU-a0"))
    health = "[health]\ninterval_s = 0.3\necc_window_s = 600\n"
    (tmp_path / "s.toml").write_text(health)
    env = {"FERRY_HOUSEKEEPING_S": "1", "FERRY_PAUSE": f"checkpoint-saved={PAUSE_S}"}
    spare = agents("node-s", env=env, config=tmp_path / "s.toml", nvml_replay=telemetry["node-s"])
    (tmp_path / "a.toml").write_text(health + f'[[peers]]\naddress = "{spare.address}"\nspare = true\n')
    a = agents("node-a", env={"FERRY_HOUSEKEEPING_S": "1"}, config=tmp_path / "a.toml",
               nvml_replay=telemetry["node-a"])  # fmt: skip
    run_on_gpu(spare, "scavenger", "GPU-s0", 150, "--priority", "low")  # 15 s: still running when asked
    run_on_gpu(a, "train", "GPU-a0", steps=40)
    wait_steps(spare, "scavenger", 5)
    wait_steps(a, "train", 5)

    write_world(telemetry["node-a"], world("GPU-a0", remapped={"pending": True}))
    wait_paused(spare, "checkpoint-saved")
    assert wait_record(spare, "source", ("restoring",))["kind"] == "suspend"
    kill(spare)

    restart(spare)
    assert wait_record(spare, "source", ("committed",))
    wait_event(spare, "resume", "resumed preempted job scavenger on GPU-s0", timeout_s=180)
    assert_nothing_frozen("scavenger", spare)
    assert_completed_exactly_once(spare, "scavenger", steps=150)


def test_agent_killed_during_a_restore_leaves_no_copy_and_the_image_restores_again(agents, tmp_path):
    """`ferry restore` is journaled as a target's restore: a crash before its commit point leaves
    the held copy to recovery, which kills it (before, it stayed stopped and unrecorded)."""
    a = agents("node-a")
    run_training(a, "rs", steps=60)
    wait_steps(a, "rs", 5)
    image = tmp_path / "img"
    a.cli("checkpoint", "rs", "--out", str(image))
    a.stop()
    a.env["FERRY_PAUSE"] = f"restore-held={PAUSE_S}"
    a.start()
    cmd = [sys.executable, "-m", "agent.cli.main", "restore", str(image), "--name", "rs2"]
    cli = subprocess.Popen(
        [*cmd, "--agent", f"unix:{a.socket}"], stdout=subprocess.PIPE, text=True, env=a.env
    )
    wait_paused(a, "restore-held")
    assert wait_record(a, "target", ("restoring",))["kind"] == "restore"
    kill(a)
    cli.communicate(timeout=60)

    restart(a)
    rec = wait_record(a, "target", ("aborted",))
    assert "killed its half-finished restore" in rec["note"], rec
    assert_no_copy(a, "rs2")
    a.cli("restore", str(image), "--name", "rs3")
    assert_completed_exactly_once(a, "rs3", steps=60)

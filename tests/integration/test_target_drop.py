"""A target dropping a migration whose page server is slow to die (issue 27), between real agents.

FERRY_PAUSE=target-stop-stream holds the target's kill of the migration's page server (or
lazy-pages side). Meanwhile GetMigration answers at once (DROPPING reads as fenceable), the
source, told nothing it must wait for, resumes its job well before the pause ends (never
UNRESOLVED), and once the pause is over the target's record is ABORTED and its staging gone.
"""

from __future__ import annotations

import time

import pytest

from agent import client
from agent.rpc import pb
from agent.testing.localcluster import LocalAgent
from tests.integration.jobtools import job, run_training, wait_steps
from tests.integration.test_faults import finish, migrate_in_background, records, wait_paused, wait_record

#: How long the target's page server takes to die here; the source must be done well before.
PAUSE_S = 8.0
#: GetMigration's answer, from the source's side of the link, while the drop runs.
ANSWER_S = 1.0


def target_record(agent: LocalAgent) -> dict:
    recs = records(agent, "target")
    assert len(recs) == 1, recs
    return recs[0]


def ask(target: LocalAgent, mid: str) -> list[float]:
    """GetMigration as a source asks it (agent.client.PeerClient; these agents are --insecure),
    three times; returns how long each answer took, and checks it reads as fenceable."""
    peer = client.PeerClient(target.address, client.Dial(insecure=True))
    took = []
    for _ in range(3):
        t0 = time.monotonic()
        state = peer.status(mid)
        took.append(time.monotonic() - t0)
        assert state == pb.TARGET_STATE_PREPARED, f"a dropping migration read as {state}"
    return took


def drop_while_paused(a: LocalAgent, b: LocalAgent, name: str, method: str) -> None:
    run_training(a, name, steps=600)  # outlives the test; the fixture kills it
    wait_steps(a, name, 3)
    p = migrate_in_background(a, name, b, method)

    paused_at = wait_paused(b, "target-stop-stream", seconds=PAUSE_S)
    rec = target_record(b)
    mid = rec["migration_id"]
    assert rec["state"] == "dropping", rec
    took = ask(b, mid)
    print(f"GetMigration during the drop answered in {', '.join(f'{t * 1000:.0f} ms' for t in took)}")
    assert max(took) < ANSWER_S, took

    code, _, err = finish(p, timeout_s=60)
    ended = time.monotonic() - paused_at
    print(f"`ferry migrate` ended {ended:.1f} s into the {PAUSE_S:.0f} s pause")
    assert code == 1 and "keeps running on node-a" in err, err
    assert ended < PAUSE_S - 3, f"the source waited {ended:.1f} s for the target's drop"
    assert job(a, name)["state"] == "running"
    assert [r["state"] for r in records(a, "source")] == ["aborted"]
    assert target_record(b)["state"] == "dropping"  # the page server is still dying

    wait_record(b, "target", ("aborted",), timeout_s=PAUSE_S + 20)
    assert not (b.staging_dir / f"in-{mid}").exists()
    assert job(a, name)["state"] == "running"


def test_a_pre_copy_whose_source_failed_mid_dump_is_dropped_while_get_migration_answers(agents):
    """CRIU's own fault injection fails the source's dump while its pages stream to the target's
    page server. The source cancels its StreamPages, then aborts: whichever the target sees first
    drops the migration (usually the Abort; the post-copy test below has it always)."""
    a = agents("node-a", env={"CRIU_FAULT": "3"})  # "Dump VMA pages failure", mid-dump
    b = agents("node-b", env={"FERRY_PAUSE": f"target-stop-stream={PAUSE_S}"})
    drop_while_paused(a, b, "precopy", "--pre-copy")


@pytest.mark.usefixtures("lazy_pipes")
def test_a_fence_of_a_post_copy_answers_while_its_lazy_pages_side_is_slow_to_die(agents):
    """The source fails just before its commit: its fencing asks the target (VERIFIED) and
    aborts it; that Abort itself drops the migration, its lazy-pages side held by the pause, and
    must be answered before the source's deadline (30 s) turns it into UNRESOLVED."""
    a = agents("node-a", env={"FERRY_FAULTS": "commit"})
    b = agents("node-b", env={"FERRY_PAUSE": f"target-stop-stream={PAUSE_S}"})
    drop_while_paused(a, b, "postcopy", "--lazy")

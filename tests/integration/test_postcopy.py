"""Post-copy (`ferry migrate --post-copy`, also `--lazy`) between two real agents: CRIU lazy
pages over userfaultfd, the pages going CRIU to CRIU over TLS, StreamPages only controlling."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.integration.jobtools import (
    REPO,
    assert_completed_exactly_once,
    job,
    run_training,
    steps_in,
    wait_steps,
)

pytestmark = pytest.mark.usefixtures("lazy_pipes")


def test_job_resumes_on_the_target_before_its_memory_and_finishes_bit_identical(agents):
    a, b = agents("node-a"), agents("node-b")
    run_training(a, "lazy", steps=40)
    wait_steps(a, "lazy", 8)

    result = json.loads(a.cli("migrate", "lazy", "--to", b.address, "--lazy", "--json").stdout)

    assert result["target_node"] == "node-b"
    # The memory crossed after the commit, pulled by the target: the "pages" phase comes last.
    assert {"dump", "transfer", "commit", "pages"} <= set(result["phases_s"])
    assert result["host_bytes"] > 50 << 20
    assert job(a, "lazy")["state"] == "moved"
    assert_completed_exactly_once(b, "lazy", steps=40)


def test_a_transfer_broken_after_the_restore_kills_the_target_copy_and_the_source_goes_on(agents):
    a = agents("node-a")
    b = agents("node-b", env={"FERRY_FAULTS": "target-pages"})  # the stream breaks after 16 MiB
    run_training(a, "broken", steps=40)
    wait_steps(a, "broken", 5)
    before = len(steps_in(a.cli("logs", "broken").stdout))

    p = a.cli("migrate", "broken", "--to", b.address, "--lazy", check=False)

    assert p.returncode == 1, p.stdout
    assert "post-copy to node-b failed" in p.stderr and "keeps running on node-a" in p.stderr, p.stderr
    assert job(a, "broken")["state"] == "running"
    ps_b = {j["name"]: j for j in json.loads(b.cli("ps", "--json").stdout)}
    assert ps_b["broken"]["state"] == "lost" and "post-copy" in ps_b["broken"]["note"], ps_b  # killed there
    wait_steps(a, "broken", before + 3)
    assert_completed_exactly_once(a, "broken", steps=40)


def test_lazy_and_staged_together_are_refused_before_anything_happens(agents):
    a, b = agents("node-a"), agents("node-b")
    run_training(a, "both", steps=30)
    wait_steps(a, "both", 2)

    p = a.cli("migrate", "both", "--to", b.address, "--lazy", "--staged", check=False)

    assert p.returncode == 2 and "not allowed with argument" in p.stderr
    assert job(a, "both")["state"] == "running"


@pytest.mark.parametrize("fault", ["target-transfer", "target-restore"])
def test_a_failure_before_the_target_runs_the_job_resumes_the_source(agents, fault):
    """Before the commit point the lazy dump still holds the tree: it must let go before the resume."""
    a, b = agents("node-a"), agents("node-b", env={"FERRY_FAULTS": fault})
    run_training(a, "early", steps=30)
    wait_steps(a, "early", 5)
    before = len(steps_in(a.cli("logs", "early").stdout))

    p = a.cli("migrate", "early", "--to", b.address, "--lazy", check=False)

    assert p.returncode == 1 and "keeps running on node-a" in p.stderr, p.stderr
    assert "early" not in {j["name"] for j in json.loads(b.cli("ps", "--json").stdout)}
    wait_steps(a, "early", before + 3)
    assert_completed_exactly_once(a, "early", steps=30)


def test_a_thread_parked_on_a_page_aligned_stack_leaves_the_memory_lazy(agents, tmp_path):
    """CRIU 4.2.1 took every page of a process for stack once one of its threads had a page-aligned
    stack pointer, and dumped the whole memory eagerly (about 1 in 3 of the bench's 4 GiB moves);
    native/criu/data-path.patch compares pages. A pausing thread on an aligned stack makes it certain."""
    exe = tmp_path / "aligned_sp"
    subprocess.run(
        ["cc", "-O2", "-pthread", "-o", str(exe), str(REPO / "native/testprogs/aligned_sp.c")], check=True
    )
    a, b = agents("node-a"), agents("node-b")
    a.cli("run", "--name", "aligned", "--", str(exe), "128")
    wait_steps(a, "aligned", 3)

    result = json.loads(a.cli("migrate", "aligned", "--to", b.address, "--lazy", "--json").stdout)

    assert "eagerly" not in result["method"], result["method"]
    assert result["host_bytes"] > 128 << 20  # the memory crossed, lazily
    before = len(steps_in(b.cli("logs", "aligned").stdout))
    wait_steps(b, "aligned", before + 3)  # each step checks the whole memory
    assert "corrupt" not in b.cli("logs", "aligned").stdout

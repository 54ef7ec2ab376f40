"""The README's walkthrough runs as written: its shell block, command for command, from the
repository, on a node of its own (private mount and network namespaces: its /run,
/var/lib/ferry and /dev/shm are fresh, and ports 7070/7071 its own). However it ends (done,
failed, past its time, or the test's own timeout), its agents, their CRIU children and its jobs
end with it (agent.testing.localcluster.run_to_the_end)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from agent.testing.localcluster import run_to_the_end

REPO = Path(__file__).resolve().parents[2]
MARK = "<!-- walkthrough -->"


def walkthrough() -> str:
    text = (REPO / "README.md").read_text()
    m = re.search(re.escape(MARK) + r"\n```sh\n(.*?)\n```", text, re.S)
    assert m, f"README.md has no ```sh block after {MARK}"
    return m[1]


#: Below pytest's 180 s: the walkthrough takes about 50 s alone, and a run past this ends with its
#: output, its agents and their children killed (run_to_the_end), as does any other way it ends.
TIMEOUT_S = 170

#: A node of its own: what the walkthrough writes lands in tmpfs that vanish with the namespace.
NODE = """\
set -e
mount --make-rprivate /
# Only where the walkthrough writes: the repository itself may live under /var or /tmp.
mkdir -p /var/lib/ferry
for d in /run /var/lib/ferry /dev/shm; do mount -t tmpfs tmpfs "$d"; done
ip link set lo up
exec bash -e -o pipefail -x "$0"
"""


def test_the_readme_walkthrough_runs_as_written(tmp_path: Path) -> None:
    script = tmp_path / "walkthrough.sh"
    script.write_text(walkthrough() + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
    node = ["unshare", "--mount", "--net", "--fork", "bash", "-c", NODE, str(script)]
    try:
        p = run_to_the_end(node, TIMEOUT_S, cwd=REPO, env=env)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"ran past {TIMEOUT_S} s\n{e.stdout[-3000:]}\n{e.stderr[-5000:]}") from None
    out = p.stdout
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    assert re.search(r"^train\s+moved\b.*-> b \(127\.0\.0\.1:7071\)", out, re.M), out
    assert re.search(r"^train\s+running\b.*moved here from a", out, re.M), out
    assert re.search(r"^final digest [0-9a-f]{64}$", out, re.M), out
    assert "this host can migrate jobs" in out

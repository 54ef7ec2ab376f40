"""docs/slurm.md's recipe under a real Slurm: a one-node controller and daemon (Debian's slurmctld
and slurmd, `make test` installs them) and a ferry agent, on a node of their own (private mount
and network namespaces). A batch step that is `ferry run --attach` prints the job's output and
ends with its exit status, which Slurm records; `scancel` stops the job under ferry."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.integration.jobtools import on_own_node

REPO = Path(__file__).resolve().parents[2]

NODE = r"""
set -e
mount --make-rprivate /
mount -t tmpfs tmpfs /run  # the cluster's files go here: the repository may live under /var or /tmp
ip link set lo up
# getaddrinfo(AI_ADDRCONFIG), which slurmctld uses, wants one non-loopback address.
ip link add s0 type veth peer name s1; ip addr add 10.199.0.1/24 dev s0; ip link set s0 up; ip link set s1 up
H=$(hostname -s)
printf '127.0.0.1 localhost %s\n' "$H" > /run/hosts; mount --bind /run/hosts /etc/hosts
W=/run/slurm; mkdir -p $W/state $W/spool
cat > $W/slurm.conf <<CONF
ClusterName=ferrytest
SlurmctldHost=$H
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation=$W/state
SlurmdSpoolDir=$W/spool
SlurmctldPidFile=$W/ctld.pid
SlurmdPidFile=$W/d.pid
SlurmctldLogFile=$W/ctld.log
SlurmdLogFile=$W/d.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=20
NodeName=$H NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=main Nodes=$H Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=$W/slurm.conf
slurmctld -i
slurmd -N "$H"
ferry agent --listen 127.0.0.1:7070 --state-dir /run/ferry-state --node-name "$H" --insecure \
    2>/run/ferry-agent.log &
for i in $(seq 100); do
    sinfo -h -o %T 2>/dev/null | grep -qx idle && [ -S /run/ferry/agent.sock ] && break; sleep 0.2
done

# 1. A step that ends: its exit status is the job's.
cat > $W/train.sbatch <<JOB
#!/bin/bash
exec ferry run --attach --name "slurm-\${SLURM_JOB_ID}" -- $PY $COUNT 20 7
JOB
rc=0; sbatch --wait -o $W/train.out $W/train.sbatch || rc=$?
echo "sbatch-exit=$rc"
sed 's/^/out: /' $W/train.out
scontrol show job 1 | grep -o 'JobState=[A-Z]*\|ExitCode=[0-9:]*' | sed 's/^/slurm: /'

# 2. scancel: the step's SIGTERM stops the job under ferry.
cat > $W/long.sbatch <<JOB
#!/bin/bash
exec ferry run --attach --name "slurm-\${SLURM_JOB_ID}" -- $PY $COUNT 6000 0
JOB
sbatch -o $W/long.out $W/long.sbatch
for i in $(seq 150); do grep -q '^step 3$' $W/long.out 2>/dev/null && break; sleep 0.2; done
scancel 2
for i in $(seq 150); do ferry ps --json | grep -q '"state": "stopped"' && break; sleep 0.2; done
ferry ps | sed 's/^/ps: /'
# Slurm says COMPLETING until the batch script's processes are gone: wait for its final state.
for i in $(seq 150); do
    scontrol show job 2 | grep -q 'JobState=\(RUNNING\|COMPLETING\)' || break; sleep 0.2
done
sed 's/^/long: /' $W/long.out
scontrol show job 2 | grep -o 'JobState=[A-Z]*' | sed 's/^/slurm: /'
scontrol shutdown >/dev/null; kill %1; wait
"""


@pytest.fixture(scope="module", autouse=True)
def _slurm() -> None:
    missing = [t for t in ("slurmctld", "slurmd", "sbatch") if not shutil.which(t)]
    assert not missing, f"{missing} not installed: `make test` installs Slurm (Debian's slurmctld and slurmd)"


def test_a_slurm_batch_step_attached_to_a_ferry_job(tmp_path: Path) -> None:
    count = tmp_path / "count.py"
    count.write_text(
        "import sys, time\n"
        "for i in range(int(sys.argv[1])):\n"
        "    print(f'step {i}', flush=True)\n"
        "    time.sleep(0.1)\n"
        "sys.exit(int(sys.argv[2]))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env |= {"PY": sys.executable, "COUNT": str(count), "PATH": f"{REPO / '.venv' / 'bin'}:{env['PATH']}"}
    p = on_own_node(NODE, env, timeout_s=300)
    out = p.stdout
    assert p.returncode == 0, f"{out[-3000:]}\n{p.stderr[-3000:]}"
    # The step ran the job through ferry and ended with its status, as Slurm recorded.
    assert "sbatch-exit=7" in out, out
    assert re.findall(r"^out: (step \d+)$", out, re.M) == [f"step {i}" for i in range(20)], out
    assert "slurm: JobState=FAILED" in out and "slurm: ExitCode=7:0" in out, out
    # scancel reached the job under ferry, which stopped it; Slurm saw the step cancelled.
    assert re.search(r"^ps: slurm-2\s+stopped\b", out, re.M), out
    assert "ferry: SIGTERM: stopping job slurm-2" in out, out
    assert "slurm: JobState=CANCELLED" in out, out

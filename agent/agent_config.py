"""The agent's config file (`ferry agent --config FILE`, TOML): health thresholds, the
self-healing policy and the peers it may move jobs to.

    [health]              # agent.health.monitor.HealthConfig: thresholds and windows
    temperature_warn_c = 85

    [policy]              # PolicyConfig below
    cooldown_s = 600

    [stragglers]          # agent.health.stragglers.StragglerConfig: members' pace, the verdict
    window_s = 60

    [cuda]                # agent.cuda.jobs.CudaConfig: lock timeout, driver call bounds, GPU pairs
    lock_timeout_s = 30
    copy_timeout_s = 600  # a checkpoint or restore call (agent.cuda.calls)

    [network]             # agent.jobs.network.NetworkConfig: the job network (docs/networking.md)
    bridge = "ferry0"
    subnet = "10.77.0.0/16"
    pool = "10.77.1.0/24"

    [coordination]        # agent.coord.config.CoordConfig: etcd, leases and fencing
    endpoints = ["10.0.0.9:2379"]

    [snapshots]           # agent.snapshots.config.SnapshotConfig: group snapshots (ferry protect)
    dir = "/dev/shm/ferry-snapshots"

    [verify]              # agent.gpus.verify.VerifyConfig: GPU self-tests, the path probe
    selftest = "auto"

    [[peers]]             # other agents, in order of preference
    address = "10.0.0.2:7070"
    spare = true          # an idle node kept for jobs moving off failing GPUs

Every key is optional; an unknown key is an error, so a typo never silently leaves a default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.coord.config import CoordConfig
from agent.cuda.jobs import CudaConfig
from agent.errors import InvalidArgumentError
from agent.gpus.verify import VerifyConfig
from agent.health.monitor import HealthConfig
from agent.health.stragglers import ON_STRAGGLER, StragglerConfig
from agent.jobs.network import NetworkConfig
from agent.settings import from_table
from agent.snapshots.config import SnapshotConfig

#: `[cuda]` keys that must be above zero: each bounds a wait.
CUDA_POSITIVE = frozenset({"lock_timeout_s", "copy_timeout_s", "call_timeout_s"})


@dataclass(frozen=True)
class PolicyConfig:
    #: A job moved (or tried) by the agent is not moved again by it for this long.
    cooldown_s: float = 600.0
    #: At most this many automatic moves start per node within window_s (a storm guard:
    #: a bad sensor must not empty the node onto its peers).
    max_moves: int = 4
    window_s: float = 3600.0
    #: Failing GPUs: the one try gets this CUDA lock timeout, a GPU that hangs is not waited on.
    failing_lock_timeout_s: float = 5.0
    #: How long a peer has to answer for the cluster view.
    peer_timeout_s: float = 2.0
    #: A preempted job's GPUs are kept this long for the job that needed them.
    preempt_hold_s: float = 120.0
    #: A member that holds its group back (agent.health.stragglers): "alert" records it,
    #: "migrate" moves it to a peer with room (one member of a group at a time).
    on_straggler: str = "alert"


@dataclass(frozen=True)
class PeerSpec:
    address: str  # HOST:PORT of the peer's agent
    spare: bool = False


@dataclass(frozen=True)
class AgentConfig:
    health: HealthConfig = field(default_factory=HealthConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    peers: tuple[PeerSpec, ...] = ()
    cuda: CudaConfig = field(default_factory=CudaConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    coordination: CoordConfig = field(default_factory=CoordConfig)
    snapshots: SnapshotConfig = field(default_factory=SnapshotConfig)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    path: str = ""  # where it was read from ("" for the defaults)


def load(path: Path | None) -> AgentConfig:
    if path is None:
        return AgentConfig()
    import tomllib  # Python 3.11; only an agent given --config needs it

    try:
        raw = tomllib.loads(_read(path))
    except OSError as e:
        raise InvalidArgumentError(f"cannot read {path}: {e.strerror}", step="config") from e
    except UnicodeDecodeError as e:
        raise InvalidArgumentError(
            f"{path} is not UTF-8 text (byte {e.start}: {e.reason}); a config file is TOML", step="config"
        ) from e
    except tomllib.TOMLDecodeError as e:
        raise InvalidArgumentError(f"{path} is not valid TOML: {e}", step="config") from e
    try:
        return parse(raw, str(path))
    except InvalidArgumentError as e:
        e.cause = f"{path}: {e.cause}"
        raise e.at(step="config") from None


#: A config file is a few KiB; more is not one (and /dev/zero would never end).
MAX_CONFIG_BYTES = 1 << 20


def _read(path: Path) -> str:
    with open(path, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise InvalidArgumentError(
            f"{path} is larger than {MAX_CONFIG_BYTES >> 20} MiB; not a config file", step="config"
        )
    return data.decode("utf-8")


def parse(raw: Mapping[str, Any], where: str = "") -> AgentConfig:
    _known(
        raw,
        {"health", "policy", "peers", "cuda", "network", "coordination", "snapshots", "stragglers", "verify"},
        "top level",
    )
    health = HealthConfig.from_dict(_table(raw, "health"))
    policy = from_table(PolicyConfig, _table(raw, "policy"), "policy")
    if policy.on_straggler not in ON_STRAGGLER:
        raise InvalidArgumentError(
            f"[policy] on_straggler {policy.on_straggler!r} is not one of {', '.join(ON_STRAGGLER)}"
        )
    cuda = from_table(CudaConfig, _table(raw, "cuda"), "cuda", positive=CUDA_POSITIVE)
    peers_raw = raw.get("peers", [])
    if not isinstance(peers_raw, list):
        raise InvalidArgumentError("peers must be an array of tables ([[peers]])")
    network = from_table(NetworkConfig, _table(raw, "network"), "network").check()
    peers = tuple(_peer(p, i) for i, p in enumerate(peers_raw))
    coordination = from_table(CoordConfig, _table(raw, "coordination"), "coordination").check()
    snapshots = from_table(SnapshotConfig, _table(raw, "snapshots"), "snapshots").check()
    stragglers = from_table(StragglerConfig, _table(raw, "stragglers"), "stragglers").check()
    verify = from_table(VerifyConfig, _table(raw, "verify"), "verify").check()
    return AgentConfig(
        health, policy, peers, cuda, network, coordination, snapshots, stragglers, verify, where
    )


def _table(raw: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    t = raw.get(key, {})
    if not isinstance(t, Mapping):
        raise InvalidArgumentError(f"[{key}] must be a table")
    return t


def _known(d: Mapping[str, Any], known: set[str], where: str) -> None:
    if unknown := sorted(set(d) - known):
        raise InvalidArgumentError(
            f"unknown key {unknown[0]!r} in {where}; known: {', '.join(sorted(known))}"
        )


def _peer(p: Any, i: int) -> PeerSpec:
    from agent.client import split_address

    if not isinstance(p, Mapping):
        raise InvalidArgumentError(f"peers[{i}] must be a table with an address")
    _known(p, {"address", "spare"}, f"peers[{i}]")
    address, spare = p.get("address"), p.get("spare", False)
    if not isinstance(address, str) or not isinstance(spare, bool):
        raise InvalidArgumentError(f"peers[{i}]: address must be a string HOST:PORT and spare true or false")
    split_address(address)
    return PeerSpec(address, spare)

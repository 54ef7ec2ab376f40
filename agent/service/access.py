"""Who may call what. Every RPC of the agent is root-equivalent, so each names its callers.

Callers are told apart by how they came in:

- ``client``: a TLS peer with a ``ferry-client`` certificate (a person or tool);
- ``node``: a TLS peer with a ``ferry-node`` certificate (another agent);
- ``local``: the root-only unix socket (the local CLI);
- ``loopback``: plaintext on loopback, served only with ``--insecure`` (tests, demos).

A method missing from the table is refused to everyone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from agent import tls
from agent.certs import Role
from agent.errors import PermissionDeniedError, UnauthenticatedError

log = logging.getLogger(__name__)

USERS = frozenset({"client", "local", "loopback"})
PEERS = frozenset({"node", "loopback"})

#: RPC method → the callers allowed. Nodes get the peer protocol and GetInfo, nothing that
#: starts, stops or restores a job on request; clients get no peer protocol.
ALLOWED: dict[str, frozenset[str]] = {
    "GetInfo": USERS | PEERS,
    "ListGpus": USERS,
    "Run": USERS,
    "Adopt": USERS,
    "ListJobs": USERS,
    "StopJob": USERS,
    "ForgetJob": USERS,
    "Logs": USERS,
    "Migrate": USERS,
    "Checkpoint": USERS,
    "Restore": USERS,
    "Resolve": USERS,
    "Prepare": PEERS,
    "StreamPages": PEERS,
    "PushImage": PEERS,
    "Commit": PEERS,
    "Abort": PEERS,
    "GetMigration": PEERS,
    "StopMoved": PEERS,  # only the node that moved the job, checked against its migration
    # Peers read health to choose a target; preempting is part of moving a job in.
    "GetHealth": USERS | PEERS,
    # Peers compare their members' pace (the straggler watch); users see it (`ferry health --group`).
    "GetPace": USERS | PEERS,
    "Events": USERS,
    "ClearGpu": USERS,
    "Preempt": PEERS,
    "Protect": USERS,
    "TakeSnapshot": USERS,
    "ListProtections": USERS,
    # A round's coordinator is another agent; a member's image goes to its buddy.
    "SnapshotMember": PEERS,
    "StoreSnapshot": PEERS,
    "FetchSnapshot": PEERS,
    "Rollback": USERS,
    # A source measures its path to a target before a large move (agent.migration.probe).
    "ProbePath": PEERS,
}


#: Requests that change something on this node, logged with who made them.
AUDITED = frozenset(
    {
        "Run",
        "Adopt",
        "StopJob",
        "ForgetJob",
        "Migrate",
        "Checkpoint",
        "Restore",
        "Resolve",
        "Prepare",
        "Commit",
        "ClearGpu",
        "Preempt",
        "StopMoved",
        "Protect",
        "TakeSnapshot",
        "SnapshotMember",
        "Rollback",
    }
)


@dataclass(frozen=True)
class Caller:
    kind: str  # client | node | local | loopback
    name: str  # the certificate's common name; "" without TLS

    def __str__(self) -> str:
        return f"{self.kind} {self.name}".strip()


def identify(context: grpc.ServicerContext, insecure: bool) -> Caller:
    """The caller of this RPC, or UNAUTHENTICATED."""
    pem = tls.peer_certificate(context)
    peer = context.peer() or ""
    if pem is not None:
        role = tls.cert_role(pem)
        name = tls.cert_name(pem)
        if role is None:
            raise UnauthenticatedError(f"certificate {name!r} from {peer} carries no ferry role")
        return Caller("node" if role is Role.NODE else "client", name)
    if peer.startswith("unix:"):
        return Caller("local", "")
    if insecure and peer.startswith(("ipv4:127.", "ipv6:[::1]")):
        return Caller("loopback", "")
    raise UnauthenticatedError(f"{peer or 'a caller'} presented no client certificate")


def authorize(context: grpc.ServicerContext, method: str, insecure: bool, node: str) -> Caller:
    """Identify and check the caller; refusals are logged with who tried what."""
    try:
        caller = identify(context, insecure)
    except UnauthenticatedError as e:
        log.warning("refused %s: %s", method, e.cause)
        raise e.at(step=method, node=node) from None
    if caller.kind not in ALLOWED.get(method, frozenset()):
        log.warning("refused %s to %s (%s): not allowed for its role", method, caller, context.peer())
        raise PermissionDeniedError(
            f"{caller} may not call {method}",
            step=method,
            node=node,
            hint="peer RPCs need a ferry-node certificate, job commands a ferry-client one",
        )
    if method in AUDITED:
        log.info("%s requested by %s (%s)", method, caller, context.peer())
    return caller

"""Serving an agent: the listen policy, the gRPC server with its health and reflection
services, the local root-only socket, and a graceful stop that lets moves, restores and
preemptions in flight finish."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
import threading
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from agent import __version__, client, tls
from agent.agent_config import AgentConfig
from agent.errors import InvalidArgumentError
from agent.jobs.network import JobNetwork
from agent.migration.staging import private_dir
from agent.rpc import pb, pb_grpc
from agent.service import metrics
from agent.service.follow import CONTROL_WORKERS, FOLLOW_SLOTS, FollowSlots
from agent.service.node import AgentNode
from agent.service.servicer import AgentService
from agent.service.statelock import lock_state_dir

log = logging.getLogger(__name__)

#: How long a graceful stop waits for moves, restores and preemptions in flight.
DRAIN_S = 600.0


def check_listen(address: str, insecure: bool, identity: tls.Identity | None) -> None:
    host, _ = metrics.split_listen(address, "--listen")
    if insecure and identity is not None:
        raise InvalidArgumentError("--insecure and --tls-dir exclude each other: serve TLS or plaintext")
    if insecure and not client.is_loopback(host):
        raise InvalidArgumentError(f"--insecure serves plaintext only on loopback, not on {host}")
    if not insecure and identity is None:
        raise InvalidArgumentError(
            "serving on TCP needs this node's certificate (--tls-dir), or --insecure on loopback"
        )


def create_server(
    address: str,
    agent: AgentNode,
    max_workers: int = CONTROL_WORKERS,
    identity: tls.Identity | None = None,
    socket_path: Path | None = None,
    follow_slots: int = FOLLOW_SLOTS,
    health_servicer: health.HealthServicer | None = None,
) -> tuple[grpc.Server, int]:
    """Bind the agent, health and reflection services; port 0 picks a free port.

    TCP is mutual TLS with `identity`, else plaintext; `socket_path` adds the local
    root-only unix socket. The pool has `max_workers` threads for calls and `follow_slots`
    more that only follow streams may hold (agent.service.follow). `health_servicer`: the
    caller's, so a graceful stop can turn it to NOT_SERVING.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers + follow_slots, thread_name_prefix="rpc"),
        options=client.SERVER_OPTIONS,
    )
    pb_grpc.add_AgentServicer_to_server(AgentService(agent, FollowSlots(follow_slots)), server)
    if health_servicer is None:
        health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("ferry.v1.Agent", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        pb.DESCRIPTOR.services_by_name["Agent"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    try:
        if identity is not None:
            port = server.add_secure_port(address, identity.server_credentials())
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        raise InvalidArgumentError(
            f"cannot listen on {address}: {bind_error(address)}",
            hint="another process (another ferry agent?) may serve it: stop it, or pick another --listen",
        )
    if socket_path is not None:
        bind_local_socket(server, socket_path)
    return server, port


def bind_error(address: str) -> str:
    """Why gRPC could not bind `address`, from a plain bind of our own (gRPC only says it failed)."""
    host, port = client.split_address(address, listen=True)
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"cannot resolve {host}: {e.strerror}"
    family, kind, proto, _, sockaddr = infos[0]
    try:
        with socket.socket(family, kind, proto) as probe:
            probe.bind(sockaddr)
    except OSError as e:
        return e.strerror or str(e)
    return "gRPC could not bind it"


def bind_local_socket(server: grpc.Server, path: Path) -> None:
    """The local CLI's way in: a socket only root can open, in a directory only root can enter."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.is_socket():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # a previous agent's, left by a crash
        else:
            raise InvalidArgumentError(
                f"another agent serves on {path}", hint="give each agent on a host its own --socket"
            )
        finally:
            probe.close()
    elif path.exists() or path.is_symlink():
        raise InvalidArgumentError(f"--socket {path} exists and is not a socket; remove it or pick another")
    old = os.umask(0o177)
    try:
        if not server.add_insecure_port(f"unix:{path}"):
            raise InvalidArgumentError(f"cannot listen on unix socket {path}")
    finally:
        os.umask(old)
    os.chmod(path, 0o600)


def serve(
    address: str,
    state_dir: Path,
    node: str,
    staging_root: Path,
    insecure: bool,
    identity: tls.Identity | None = None,
    socket_path: Path | None = None,
    config: AgentConfig | None = None,
    metrics_listen: str = "",
) -> None:
    """Run until SIGTERM/SIGINT; then health says NOT_SERVING, and in-flight moves, restores and
    preemptions finish (or abort) before the agent exits."""
    check_listen(address, insecure, identity)
    if metrics_listen:
        metrics.check_listen(metrics_listen, identity)
    if identity is not None and identity.name != node:
        raise InvalidArgumentError(
            f"this node is {node!r} but its certificate names {identity.name!r}; peers check that they match",
            hint=f"pass --node-name {identity.name}, or issue a certificate for {node}",
        )
    if config is not None and config.network.enabled:  # not every `ferry run` failing later
        JobNetwork(config.network, node).check_bridge()
    lock_state_dir(state_dir, node)  # held until this process ends
    private_dir(staging_root, node)  # refuse a planted or shared staging dir before serving
    service = AgentNode(state_dir, node, staging_root, dial=client.Dial(identity, insecure), config=config)
    listen_host, _ = client.split_address(address, listen=True)
    if listen_host not in ("", "0.0.0.0", "::"):  # page servers listen where the agent does
        service.targets.data_host = listen_host
    health_servicer = health.HealthServicer()
    server, port = create_server(
        address, service, identity=identity, socket_path=socket_path, health_servicer=health_servicer
    )
    stop_metrics = None
    try:
        stop_metrics = service.metrics.serve(metrics_listen, identity) if metrics_listen else None
        if stop_metrics is not None:  # before "listening on", which tells a launcher the agent is up
            print(f"ferry agent: metrics on {service.metrics.address}/metrics", flush=True)
        service.recover()
        server.start()
    except BaseException:  # an agent that does not start leaves no socket for the next one to trip on
        server.stop(None)
        if socket_path is not None:
            socket_path.unlink(missing_ok=True)
        if stop_metrics is not None:
            stop_metrics()
        raise
    where = metrics.host_port(listen_host, port)
    mode = f"mutual TLS as {identity.name}" if identity else "plaintext (--insecure)"
    log.info(
        "ferry agent %s (node %s) listening on %s (%s), state in %s",
        __version__,
        node,
        where,
        mode,
        state_dir,
    )
    if socket_path is not None:
        log.info("local socket %s (root only)", socket_path)
    cfg = service.config
    spares = sum(p.spare for p in cfg.peers)
    log.info(
        "self-healing: %d peer(s) (%d spare) from %s; health every %g s",
        len(cfg.peers),
        spares,
        cfg.path or "no --config",
        cfg.health.interval_s,
    )
    if service.liveness is not None:
        service.liveness.start(where if listen_host not in ("", "0.0.0.0", "::") else f"{node}:{port}")
        log.info("coordination: etcd at %s", ", ".join(service.config.coordination.endpoints))
    service.protections.start()  # the groups it protected before a restart go on being protected
    print(f"ferry agent: node {node} listening on {where}", flush=True)
    # An agent that seems stuck tells where each thread is, without stopping (docs/operations.md).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    # First, so that balancers and probes stop sending work; the server itself still answers,
    # since sources in the middle of a move need Commit and GetMigration.
    health_servicer.enter_graceful_shutdown()
    service.healing.draining.set()  # no new automatic move or resume from here on
    service.protections.stop()  # no new round; a held member is waited for below
    log.info("stopping: waiting for in-flight migrations, restores and preemptions")
    if not service.wait_idle(timeout_s=DRAIN_S):
        log.warning("work in flight did not finish in %.0f s; stopping anyway", DRAIN_S)
    service.stop_housekeeping()
    if service.liveness is not None:  # its members fenced, its lease revoked: see NodeLiveness.stop
        service.liveness.stop()
    server.stop(grace=10).wait()
    if dropped := service.targets.shutdown():
        log.info("dropped %d incoming migration(s) that had not begun to restore, and their staging", dropped)
    if socket_path is not None:
        socket_path.unlink(missing_ok=True)
    if stop_metrics is not None:
        stop_metrics()
    log.info("stopped")

"""How a command reaches its agent: credentials for --agent, one call, or a stream. gRPC and the stubs
are imported on first use, so `ferry --help`, `certs`, `doctor` and `inspect` never load them."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any


def at(args: argparse.Namespace, agent: str) -> argparse.Namespace:
    """The same command's arguments, aimed at another agent."""
    return argparse.Namespace(**{**vars(args), "agent": agent})


def dial(args: argparse.Namespace) -> Any:
    """Credentials for --agent: none for the unix socket or --insecure, else our client certificate."""
    from agent import tls
    from agent.client import Dial, split_address

    if not args.agent.startswith("unix:"):
        split_address(args.agent)  # a bad --agent is named as such, before any TLS file is read
    if args.agent.startswith("unix:") or args.insecure:
        return Dial(insecure=args.insecure)
    return Dial(tls.load(args.tls_dir or tls.default_dir(), args.tls_name))


def call(args: argparse.Namespace, method: str, req: Any, timeout: float) -> Any:
    import grpc

    from agent.client import from_rpc_error, stub

    creds = dial(args)
    try:
        return getattr(stub(args.agent, creds), method)(req, timeout=timeout)
    except grpc.RpcError as e:
        raise from_rpc_error(e, args.agent, method, creds) from e


def stream(args: argparse.Namespace, method: str, req: Any, timeout: float | None) -> Iterator[Any]:
    import grpc

    from agent.client import from_rpc_error, stub

    creds = dial(args)
    try:
        yield from getattr(stub(args.agent, creds), method)(req, timeout=timeout)
    except grpc.RpcError as e:
        raise from_rpc_error(e, args.agent, method, creds) from e

"""The generated gRPC modules, with a clear error when they were not built."""

from __future__ import annotations

try:
    from ferry.v1 import agent_pb2 as pb
    from ferry.v1 import agent_pb2_grpc as pb_grpc
except ImportError as e:  # pragma: no cover - only without a build
    raise SystemExit(
        "ferry: the gRPC stubs are not generated (ferry/v1/agent_pb2.py is missing); run `make proto`"
    ) from e

__all__ = ["pb", "pb_grpc"]

"""The one mapping from ferry's errors to gRPC status, and the wrappers every RPC goes through."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import grpc

from agent.errors import FerryError
from agent.service import access

log = logging.getLogger(__name__)

STATUS_BY_KIND = {
    "not_found": grpc.StatusCode.NOT_FOUND,
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "already_exists": grpc.StatusCode.ALREADY_EXISTS,
    "deadline_exceeded": grpc.StatusCode.DEADLINE_EXCEEDED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "aborted": grpc.StatusCode.ABORTED,
    "internal": grpc.StatusCode.INTERNAL,
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "permission_denied": grpc.StatusCode.PERMISSION_DENIED,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "data_loss": grpc.StatusCode.DATA_LOSS,
}

F = TypeVar("F", bound=Callable[..., Any])


class Servicer(Protocol):
    node: str
    insecure: bool


def status_for(err: BaseException) -> tuple[grpc.StatusCode, str]:
    """Every error a user can see, as a status code and one line; never UNKNOWN."""
    if isinstance(err, FerryError):
        return STATUS_BY_KIND.get(err.kind, grpc.StatusCode.INTERNAL), str(err)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}: {err}; see the agent's log"


def _abort_with(context: grpc.ServicerContext, err: BaseException, node: str) -> None:
    if isinstance(err, FerryError):
        err.at(node=node)
    else:
        log.exception("unexpected error")
    code, msg = status_for(err)
    context.abort(code, msg)


def rpc(fn: F) -> F:
    """A unary-answer RPC: the caller is authorized first; every error becomes a status."""

    @functools.wraps(fn)
    def wrapper(self: Servicer, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            access.authorize(context, fn.__name__, self.insecure, self.node)
            return fn(self, request, context)
        except Exception as e:
            _abort_with(context, e, self.node)

    return wrapper  # type: ignore[return-value]


def stream_rpc(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(self: Servicer, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            access.authorize(context, fn.__name__, self.insecure, self.node)
            yield from fn(self, request, context)
        except Exception as e:
            _abort_with(context, e, self.node)

    return wrapper  # type: ignore[return-value]

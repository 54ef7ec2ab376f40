"""The exception tree (agent.errors) and its mapping to gRPC status codes and back."""

from __future__ import annotations

import inspect

import grpc
import pytest

from agent import client, errors, faults
from agent.client import from_rpc_error
from agent.cuda.calls import CallTimedOut
from agent.errors import (
    AlreadyExistsError,
    BusyError,
    CriuError,
    CudaCheckpointError,
    FerryError,
    ImageError,
    InvalidArgumentError,
    JobBusyError,
    MigrationAbortedError,
    NoFreeGpuError,
    NotFoundError,
    PermissionDeniedError,
    RefusedError,
    StepTimeoutError,
    TransferError,
    UnauthenticatedError,
    UnavailableError,
)
from agent.migration import source as migrate
from agent.service.status import STATUS_BY_KIND, status_for

S = grpc.StatusCode

EXPECTED = {
    FerryError: S.INTERNAL,
    NotFoundError: S.NOT_FOUND,
    InvalidArgumentError: S.INVALID_ARGUMENT,
    RefusedError: S.FAILED_PRECONDITION,
    NoFreeGpuError: S.FAILED_PRECONDITION,
    JobBusyError: S.FAILED_PRECONDITION,
    AlreadyExistsError: S.ALREADY_EXISTS,
    StepTimeoutError: S.DEADLINE_EXCEEDED,
    UnavailableError: S.UNAVAILABLE,
    CriuError: S.INTERNAL,
    ImageError: S.DATA_LOSS,
    TransferError: S.ABORTED,
    MigrationAbortedError: S.ABORTED,
    CudaCheckpointError: S.ABORTED,
    UnauthenticatedError: S.UNAUTHENTICATED,
    PermissionDeniedError: S.PERMISSION_DENIED,
    BusyError: S.RESOURCE_EXHAUSTED,
}


def _all_subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub, *_all_subclasses(sub)}
    return out


def _make(cls: type[FerryError]) -> FerryError:
    if cls is CriuError:
        return CriuError("dump", "no such task", log_path="/img/criu-dump.log", node="nodea")
    if cls is CudaCheckpointError:
        return CudaCheckpointError(42, "lock", 909, "CUDA_ERROR_TIMEOUT", node="nodea")
    if cls is CallTimedOut:
        return CallTimedOut(42, "checkpoint", "did not return within 600 s", node="nodea")
    return cls("something precise went wrong", step="transfer", node="nodea")


def test_every_error_class_in_errors_py_has_an_expected_code() -> None:
    """A new error class must be given a code here (and in the servicer) on purpose."""
    declared = {
        obj
        for _, obj in inspect.getmembers(errors, inspect.isclass)
        if issubclass(obj, FerryError) and obj.__module__ == errors.__name__
    }
    assert declared == set(EXPECTED)


@pytest.mark.parametrize("cls", list(EXPECTED), ids=lambda c: c.__name__)
def test_status_for_maps_each_error_to_its_code(cls: type[FerryError]) -> None:
    err = _make(cls)
    code, msg = status_for(err)
    assert code is EXPECTED[cls]
    assert code is not S.UNKNOWN
    assert msg == str(err)
    assert "nodea" in msg


def test_no_ferry_error_anywhere_maps_to_unknown() -> None:
    # Includes the ones declared outside errors.py (faults.InjectedFault, migrate._Unresolved).
    classes = _all_subclasses(FerryError) | {FerryError}
    assert faults.InjectedFault in classes and migrate._Unresolved in classes
    for cls in classes:
        assert cls.kind in STATUS_BY_KIND, cls
        err = _make(cls) if cls in EXPECTED or cls is CallTimedOut else cls("x")
        code, _ = status_for(err)
        assert code not in (S.UNKNOWN, S.OK), cls


def test_a_plain_exception_is_internal_with_a_message() -> None:
    code, msg = status_for(KeyError("job.json"))
    assert code is S.INTERNAL
    assert "KeyError" in msg and "job.json" in msg
    assert "agent's log" in msg


def test_an_os_error_is_internal_and_keeps_its_text() -> None:
    code, msg = status_for(FileExistsError(17, "File exists", "/stage/in-x"))
    assert code is S.INTERNAL
    assert "/stage/in-x" in msg


# -- the one line a user sees ----------------------------------------------------------


def test_str_names_step_node_cause_and_hint() -> None:
    e = RefusedError("pids [7] are in use", step="prepare", node="nodeb", hint="choose another target")
    assert str(e) == "prepare on nodeb: pids [7] are in use; choose another target"
    assert str(FerryError("plain")) == "plain"
    assert str(FerryError("c", node="n")) == "on n: c"


def test_at_fills_in_only_what_is_missing() -> None:
    e = TransferError("cut", step="transfer")
    assert e.at(step="commit", node="nodea") is e
    assert (e.step, e.node) == ("transfer", "nodea")
    e.at(node="other")
    assert e.node == "nodea"


def test_criu_error_names_the_operation_and_its_log() -> None:
    e = CriuError("restore", "pid 1 busy", log_path="/img/criu-restore.log", errno=16, node="nodeb")
    assert str(e) == "criu restore on nodeb: pid 1 busy (CRIU log: /img/criu-restore.log)"
    assert (e.op, e.errno, e.log_path, e.step) == ("restore", 16, "/img/criu-restore.log", "criu restore")


# -- and back: a remote agent's status as our error --------------------------------------


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (S.NOT_FOUND, NotFoundError),
        (S.INVALID_ARGUMENT, InvalidArgumentError),
        (S.FAILED_PRECONDITION, RefusedError),
        (S.ALREADY_EXISTS, AlreadyExistsError),
        (S.DEADLINE_EXCEEDED, StepTimeoutError),
        (S.UNAVAILABLE, UnavailableError),
        (S.ABORTED, TransferError),
        (S.RESOURCE_EXHAUSTED, BusyError),
        (S.DATA_LOSS, ImageError),
    ],
)
def test_from_rpc_error_maps_codes_back(code: grpc.StatusCode, cls: type[FerryError]) -> None:
    e = from_rpc_error(FakeRpcError(code, "prepare on nodeb: nope"), "127.0.0.1:7071", "prepare")
    assert type(e) is cls


@pytest.mark.parametrize("code", [S.INTERNAL, S.UNKNOWN, S.CANCELLED])
def test_from_rpc_error_other_codes_are_plain_ferry_errors(code: grpc.StatusCode) -> None:
    e = from_rpc_error(FakeRpcError(code, "boom"), "127.0.0.1:7071", "commit")
    assert type(e) is FerryError
    assert str(e) == "boom"


def test_from_rpc_error_keeps_the_remote_message_verbatim() -> None:
    remote = "prepare on nodeb: files the job uses are missing here: /data/x; put them on shared storage"
    e = from_rpc_error(FakeRpcError(S.FAILED_PRECONDITION, remote), "127.0.0.1:7071", "prepare")
    assert str(e) == remote  # not "prepare: prepare on nodeb: ..."


def test_from_rpc_error_unreachable_names_the_address() -> None:
    e = from_rpc_error(FakeRpcError(S.UNAVAILABLE, "connection refused"), "127.0.0.1:7071", "info")
    assert isinstance(e, UnavailableError)
    assert str(e) == "info: agent 127.0.0.1:7071 is unreachable: connection refused"


def test_from_rpc_error_deadline_names_the_address() -> None:
    e = from_rpc_error(FakeRpcError(S.DEADLINE_EXCEEDED, "Deadline Exceeded"), "127.0.0.1:7071", "commit")
    assert isinstance(e, StepTimeoutError)
    assert str(e) == "commit: agent 127.0.0.1:7071 did not answer in time"


def test_from_rpc_error_without_details_uses_the_code() -> None:
    e = from_rpc_error(FakeRpcError(S.NOT_FOUND, ""), "127.0.0.1:7071", "status")
    assert "NOT_FOUND" in str(e)


@pytest.mark.parametrize("cls", list(EXPECTED), ids=lambda c: c.__name__)
def test_a_code_survives_the_hop_between_agents(cls: type[FerryError]) -> None:
    """Source agent relays a target's error to the CLI: the status code must not change."""
    code, msg = status_for(_make(cls))
    relayed = from_rpc_error(FakeRpcError(code, msg), "127.0.0.1:7071", "commit")
    assert status_for(relayed)[0] is code


# -- addresses ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("addr", "want"),
    [("127.0.0.1:7070", ("127.0.0.1", 7070)), ("[::1]:80", ("::1", 80)), ("localhost:1", ("localhost", 1))],
)
def test_split_address(addr: str, want: tuple[str, int]) -> None:
    assert client.split_address(addr) == want


@pytest.mark.parametrize("addr", ["nonsense", "127.0.0.1", ":7070", "host:0", "host:65536", "host:x", ""])
def test_split_address_refuses_bad_addresses(addr: str) -> None:
    with pytest.raises(InvalidArgumentError, match="expected HOST:PORT"):
        client.split_address(addr)


@pytest.mark.parametrize(
    ("host", "loop"), [("127.0.0.1", True), ("127.9.9.9", True), ("::1", True), ("localhost", True),
                       ("10.0.0.1", False), ("example.com", False), ("0.0.0.0", False)]
)  # fmt: skip
def test_is_loopback(host: str, loop: bool) -> None:
    assert client.is_loopback(host) is loop


def test_channel_refuses_a_non_loopback_address() -> None:
    with pytest.raises(InvalidArgumentError, match=r"10\.0\.0\.5:7070 is not a loopback address"):
        client.channel("10.0.0.5:7070", client.Dial(insecure=True))


def test_channel_without_a_certificate_or_insecure_is_refused() -> None:
    with pytest.raises(UnauthenticatedError, match="no client certificate"):
        client.channel("10.0.0.5:7070", client.Dial())

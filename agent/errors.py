"""One exception tree for ferry; mapped to gRPC status codes only in the servicer.

Every error names the step that failed, the node it failed on, the cause and,
where one exists, what to do next. ``str(err)`` is the one line a user sees.
"""

from __future__ import annotations


class FerryError(Exception):
    """Base of every error ferry raises on purpose."""

    #: gRPC status code name used by the servicer (see server.STATUS_BY_KIND).
    kind = "internal"

    def __init__(self, cause: str, *, step: str = "", node: str = "", hint: str = "") -> None:
        super().__init__(cause)
        self.cause = cause
        self.step = step
        self.node = node
        self.hint = hint

    def __str__(self) -> str:
        where = " ".join(p for p in (self.step, f"on {self.node}" if self.node else "") if p)
        text = f"{where}: {self.cause}" if where else self.cause
        return f"{text}; {self.hint}" if self.hint else text

    def at(self, *, step: str = "", node: str = "") -> FerryError:
        """Fill in the step and node where the raiser did not know them."""
        self.step = self.step or step
        self.node = self.node or node
        return self


class NotFoundError(FerryError):
    kind = "not_found"


class InvalidArgumentError(FerryError):
    kind = "invalid_argument"


class RefusedError(FerryError):
    """A precondition does not hold; nothing was changed."""

    kind = "failed_precondition"


class JobBusyError(RefusedError):
    """The job is in another operation (a snapshot round, a checkpoint, a move): nothing was
    changed, and the same request may succeed once that ends."""


class NoFreeGpuError(RefusedError):
    """No GPU here can take the job now (all taken, held, quarantined or unhealthy): it may later."""


class AlreadyExistsError(FerryError):
    kind = "already_exists"


class StepTimeoutError(FerryError):
    kind = "deadline_exceeded"


class UnavailableError(FerryError):
    """A peer agent could not be reached."""

    kind = "unavailable"


class UnauthenticatedError(FerryError):
    """The caller (or the agent it dialled) has no certificate this cluster accepts."""

    kind = "unauthenticated"


class PermissionDeniedError(FerryError):
    """The caller is authenticated, but its role may not do this."""

    kind = "permission_denied"


class CriuError(FerryError):
    """CRIU failed; the log path says where to read why."""

    def __init__(
        self,
        op: str,
        cause: str,
        *,
        log_path: str = "",
        errno: int = 0,
        node: str = "",
        hint: str = "",
    ) -> None:
        if log_path:
            cause = f"{cause} (CRIU log: {log_path})"
        super().__init__(cause, step=f"criu {op}", node=node, hint=hint)
        self.op = op
        self.errno = errno
        self.log_path = log_path


class BusyError(FerryError):
    """The agent serves as many of these calls as it will at once; this one is refused, not queued."""

    kind = "resource_exhausted"


class ImageError(FerryError):
    """An image is missing, malformed or does not match its manifest: bad data, not a bad
    argument (exit status 1, not 2)."""

    kind = "data_loss"


class TransferError(FerryError):
    kind = "aborted"


class MigrationAbortedError(FerryError):
    """A migration failed and was rolled back: the job still runs on the source."""

    kind = "aborted"


class CudaCheckpointError(FerryError):
    """The CUDA driver refused or failed a checkpoint action on one process."""

    kind = "aborted"

    def __init__(
        self, pid: int, action: str, result: int, result_name: str, *, node: str = "", hint: str = ""
    ):
        super().__init__(
            f"cuda {action} of pid {pid} failed: {result_name} ({result})",
            step=f"cuda {action}",
            node=node,
            hint=hint,
        )
        self.pid = pid
        self.action = action
        self.result = result
        self.result_name = result_name


def as_ferry_error(exc: BaseException, step: str, node: str) -> FerryError:
    """Ours as is; anything else (an OSError on a full tmpfs, say) named by step and node."""
    if isinstance(exc, FerryError):
        return exc
    cause = f"{exc.strerror}: {exc.filename}" if isinstance(exc, OSError) and exc.strerror else repr(exc)
    err = FerryError(cause, step=step, node=node)
    err.__cause__ = exc
    return err

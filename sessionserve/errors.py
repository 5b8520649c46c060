"""Typed errors. Each message says what went wrong and what to change.

The HTTP layer maps these to OpenAI-style error bodies by `status_code`; Python callers catch them
by type. Programming errors inside the cache (a broken invariant) are `MemoryInvariantError`,
never one of the client-facing 4xx errors.
"""

from __future__ import annotations


class SessionServeError(Exception):
    """Base class; `status_code` is the HTTP status the API layer answers with.

    Picklable whatever a subclass's __init__ takes (errors cross Ray process boundaries).
    """

    status_code = 500
    error_type = "internal_error"
    retried_by_ingress = False  # a signal the ingress answers by re-sending the turn

    def __reduce__(self):
        return (_restore, (type(self), self.args, dict(self.__dict__)))


def _restore(cls: type[SessionServeError], args: tuple, state: dict) -> SessionServeError:
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


def unwrap(exc: BaseException) -> BaseException:
    """The original exception of one raised in a replica. Ray wraps it in a RayTaskError whose
    class also derives from the original's (so it *is* a SessionServeError) but whose str is
    the remote traceback: always take its `cause`, never its message."""
    for _ in range(5):
        cause = getattr(exc, "cause", None)
        if cause is None:
            if isinstance(exc, SessionServeError) or exc.__cause__ is None:
                break
            cause = exc.__cause__
        exc = cause
    return exc


class InvalidConfigError(SessionServeError, ValueError):
    status_code = 400
    error_type = "invalid_request_error"


class UnknownSessionError(SessionServeError, KeyError):
    status_code = 404
    error_type = "not_found_error"

    def __init__(self, session_id: str) -> None:
        super().__init__(
            f"session {session_id!r} does not exist (never opened, closed, or expired)"
        )
        self.session_id = session_id

    def __str__(self) -> str:  # KeyError would quote the message again
        return str(self.args[0])


class UnknownResponseError(SessionServeError):
    """A stored response (Responses API) that does not exist: never stored (`store: false`),
    deleted, or gone with its expired or deleted conversation."""

    status_code = 404
    error_type = "invalid_request_error"  # what OpenAI answers for an unknown response id

    def __init__(self, response_id: str, param: str | None = None) -> None:
        if param == "previous_response_id":
            message = f"Previous response with id {response_id!r} not found."
            self.code = "previous_response_not_found"
        else:
            message = f"No response found with id {response_id!r}."
            self.code = None
        super().__init__(
            f"{message} It was never stored (store: false), was deleted, or its "
            "conversation expired or was deleted."
        )
        self.param = param


class UnknownModelError(SessionServeError):
    status_code = 404
    error_type = "not_found_error"

    def __init__(self, model: str, served: str) -> None:
        super().__init__(f"the model {model!r} does not exist; this server serves {served!r}")
        self.param = "model"


class SessionExistsError(SessionServeError):
    status_code = 409
    error_type = "conflict_error"

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} is already open; close it or pick another id")
        self.session_id = session_id


class SessionBusyError(SessionServeError):
    """A second turn while one is in flight. Raised before anything is changed."""

    status_code = 409
    error_type = "conflict_error"

    def __init__(self, session_id: str, running_rid: str) -> None:
        super().__init__(
            f"session {session_id!r} already has a turn in flight (request {running_rid!r}); "
            "wait for it to finish or abort it before sending the next turn"
        )
        self.session_id = session_id
        self.running_rid = running_rid


class SessionClosingError(SessionServeError):
    status_code = 409
    error_type = "conflict_error"

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} is closing; open a new session")
        self.session_id = session_id


class TooManySessionsError(SessionServeError):
    status_code = 429
    error_type = "rate_limit_error"


class KVCacheFullError(SessionServeError):
    """Not enough KV slots even after evicting every evictable page and idle session."""

    status_code = 503
    error_type = "overloaded_error"


class DirectoryUnavailableError(SessionServeError):
    """The session directory did not answer in time (its actor is restarting or cannot be
    placed). Nothing was changed by this request; retry shortly."""

    status_code = 503
    error_type = "overloaded_error"


class RequestFailedError(SessionServeError):
    """This request alone failed on the replica (its sampling, stop check or finish raised);
    it was stopped, its KV freed, and the replica serves on. Retrying is safe."""

    status_code = 500
    error_type = "internal_error"


class EngineUnavailableError(SessionServeError):
    """The replica's engine thread is not running (it died or the replica is shutting down)."""

    status_code = 503
    error_type = "overloaded_error"


class NoFreeRowError(KVCacheFullError):
    """Every request row is in use (running requests plus session slots)."""


class DoubleFreeError(SessionServeError):
    """Freeing a slot, page or row that is not allocated: always a bug in the caller."""


class AppendOnlyViolationError(SessionServeError):
    """An append-mode turn whose input does not extend what the session holds: a bug upstream."""


class MemoryInvariantError(SessionServeError):
    """The memory checker found a lost or double-counted KV slot; the message has every term."""


class IncompatibleSnapshotError(SessionServeError):
    """A session's KV snapshot does not fit this replica's pools (another model, dtype or
    drafter): it cannot be restored here; the session re-prefills from its token log."""

    status_code = 409
    error_type = "conflict_error"


class SessionMovedError(SessionServeError):
    """The session was migrated to another replica after this call was routed here. The
    ingress re-routes the turn (the directory already names the new replica); a client sees
    this only if that keeps failing."""

    status_code = 503
    error_type = "overloaded_error"
    retried_by_ingress = True

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} moved to another replica; retry")
        self.session_id = session_id


class SessionLogNeededError(SessionServeError):
    """An append-mode turn reached a replica that does not hold its session (failover, a
    reclaimed slot) without the session's token log, which the ingress sends only on demand:
    it fetches the log from the directory and resends the turn. Raised before any work."""

    status_code = 503
    error_type = "overloaded_error"
    retried_by_ingress = True

    def __init__(self, session_id: str) -> None:
        super().__init__(
            f"session {session_id!r} is not held by this replica and its token log was not "
            "sent; retry"
        )
        self.session_id = session_id


class SessionNotPlacedError(SessionServeError):
    """A migration asked for a session that has not run a turn: no replica holds it yet."""

    status_code = 409
    error_type = "conflict_error"

    def __init__(self, session_id: str) -> None:
        super().__init__(
            f"session {session_id!r} has not run a turn yet: no replica holds it, nothing to move"
        )


class UnknownReplicaError(SessionServeError):
    """A call addressed to a replica that is not running (a wrong id, or it went away), or
    one it cannot take (it is stopping). `replica`: the one that refused, if any."""

    status_code = 409
    error_type = "conflict_error"

    def __init__(self, message: str, replica: str | None = None) -> None:
        super().__init__(message)
        self.replica = replica


class MigrationFailedError(SessionServeError):
    """A session could not be moved; it stays, intact, on its replica. Retrying is safe."""

    status_code = 503
    error_type = "overloaded_error"


class InvalidRequestError(SessionServeError, ValueError):
    """Bad input from a client; `param` names the offending field (OpenAI's error shape)."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextTooLongError(InvalidRequestError):
    pass

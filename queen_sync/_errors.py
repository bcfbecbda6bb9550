"""The exceptions queen_sync raises, one tree.

```
QueenError
├── LockError                      (name)
│   ├── LockNotHeldError           (holders) could not take it, or a guard/with without it
│   │   └── LockBusyError          (holders) somebody else holds it (singleton jobs, CLI)
│   └── LockLostError              (reason)  it was held and is gone
├── FencedOutError                 (presented, current) a sink refused a superseded token
├── RequestError, ValueError       (code)    the engine refused the request as malformed
├── UnsupportedOperationError      (capability) this engine cannot do that
└── EngineError                    could not get an answer
    ├── EngineUnavailableError     could not reach the engine
    ├── StoreReplacedError         (path) the store this client opened is gone or replaced
    ├── QueenHttpError             (status, code, reason, detail, retry_after)
    │   └── QueenHttpRequestError  a 400: also a RequestError, as on the embedded engines
    └── ProtocolError              (route) the answer is not what the route promises
```

Verdicts ("held by somebody else", "lost", "precondition failed") are never
exceptions: they come back as results. These are for failures.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

__all__ = [
    "EngineError",
    "EngineUnavailableError",
    "FencedOutError",
    "LockBusyError",
    "LockError",
    "LockLostError",
    "LockNotHeldError",
    "ProtocolError",
    "QueenError",
    "QueenHttpError",
    "QueenHttpRequestError",
    "RequestError",
    "StoreReplacedError",
    "UnsupportedOperationError",
]


class QueenError(Exception):
    """Base of every queen_sync error."""

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self._fields = fields
        for key, value in fields.items():
            setattr(self, key, value)

    def __reduce__(self) -> Any:
        return (_rebuild, (type(self), str(self), self._fields))

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self._fields.items())
        return f"{type(self).__name__}({str(self)!r}{extra})"


def _rebuild(cls: type[QueenError], message: str, fields: dict[str, Any]) -> QueenError:
    err = cls.__new__(cls)
    QueenError.__init__(err, message, **fields)
    return err


class LockError(QueenError):
    """Something about one lock name."""

    name: str


class LockNotHeldError(LockError):
    """The lock is not held by this handle: it could not be taken, or a guard needs it."""

    holders: Sequence[Any]

    def __init__(self, message: str, *, name: str, holders: Sequence[Any] = ()) -> None:
        super().__init__(message, name=name, holders=tuple(holders))


class LockBusyError(LockNotHeldError):
    """Somebody else holds the lock (a singleton job or command told to raise when busy)."""


class LockLostError(LockError):
    """The lock was held by this handle and is gone (``reason``: renew, guard, expired, closed)."""

    reason: Optional[str]
    token: Optional[int]

    def __init__(
        self, message: str, *, name: str, reason: Optional[str] = None, token: Optional[int] = None
    ) -> None:
        super().__init__(message, name=name, reason=reason, token=token)


class FencedOutError(QueenError):
    """A write presented a token older than one the sink already accepted."""

    presented: Optional[int]
    current: Optional[int]

    def __init__(
        self, message: str, *, presented: Optional[int], current: Optional[int], **fields: Any
    ) -> None:
        super().__init__(message, presented=presented, current=current, **fields)


class RequestError(QueenError, ValueError):
    """The request is malformed (``code`` says how, e.g. ``kv_bad_request``)."""

    code: str

    def __init__(self, message: str, *, code: str, **fields: Any) -> None:
        super().__init__(message, code=code, **fields)


class UnsupportedOperationError(QueenError):
    """The engine does not offer this operation (``capability`` names what is missing)."""

    capability: str

    def __init__(self, message: str, *, capability: str) -> None:
        super().__init__(message, capability=capability)


class EngineError(QueenError):
    """No usable answer came back from the engine.

    ``applied`` is False when the engine says nothing of the call was written (SQLite's
    busy, full or read-only file); None when that is not known (a lost answer).
    """

    applied: Optional[bool] = None


class EngineUnavailableError(EngineError):
    """The engine could not be reached (connection refused, timeout, database locked too long)."""


class StoreReplacedError(EngineError):
    """The store this client opened is no longer the one at its address (deleted, renamed over).

    Nothing this client holds can be kept: another process opening the address now starts
    a new store whose tokens begin again, so the renewer reports every lease lost at once.
    """

    path: str

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message, path=path)


class QueenHttpError(EngineError):
    """The broker (or a proxy in front of it) answered with an HTTP error status."""

    status: int
    code: Optional[str]
    reason: Optional[str]
    detail: Optional[str]
    retry_after: Optional[float]

    def __init__(
        self,
        message: str,
        *,
        status: int,
        code: Optional[str] = None,
        reason: Optional[str] = None,
        detail: Optional[str] = None,
        retry_after: Optional[float] = None,
    ) -> None:
        super().__init__(
            message, status=status, code=code, reason=reason, detail=detail, retry_after=retry_after
        )


# The bases type ``code`` as Optional[str] and str; a 400's code is always text ("http_400"
# when the body names none), so both readings hold.
class QueenHttpRequestError(QueenHttpError, RequestError):  # type: ignore[misc]
    """The broker refused the request as malformed (HTTP 400, ``code`` says how).

    A ``RequestError`` (and ``ValueError``), as the embedded engines raise for the same
    request, so one ``except`` serves every engine; a ``QueenHttpError`` for its status.
    """


class ProtocolError(EngineError):
    """The answer is not the JSON the route promises."""

    route: str

    def __init__(self, message: str, *, route: str) -> None:
        super().__init__(message, route=route)

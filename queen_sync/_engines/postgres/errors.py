"""Driver errors leave the PostgreSQL engine here: translated, and with every secret removed.

libpq quotes what it could not parse, so a password with a stray ``%`` comes back
inside the driver's message; any message may also carry a ``password=`` fragment
of a connection string. Every driver text that reaches a queen_sync error or a
log line passes ``redact`` first, and the driver exception itself is scrubbed,
since a traceback prints the chained cause too.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator, Optional
from urllib.parse import unquote

import psycopg
import psycopg_pool

from ..._errors import EngineError, EngineUnavailableError, QueenError
from ..base import split_userinfo

MASK = "***"

# A ``password=`` (or ``sslpassword=``) fragment in any quoting, and a URL's userinfo.
_FRAGMENT = re.compile(
    r"""(password\s*=\s*)('(?:[^'\\]|\\.)*'?|"(?:[^"\\]|\\.)*"?|[^\s&'";,]+)""", re.IGNORECASE)
_USERINFO = re.compile(r"(://[^:/?#@\s]*:)[^\s]*@")
_SECRET_KEYS = frozenset({"password", "sslpassword"})

# Every driver exception type this package catches, each translated by ``translate``.
CAUGHT_DRIVER_ERRORS: tuple[type[Exception], ...] = (
    psycopg.Error,
    psycopg.OperationalError,
    psycopg.errors.UniqueViolation,
    psycopg.errors.DeadlockDetected,
    psycopg.errors.SerializationFailure,
    psycopg.errors.DivisionByZero,
    psycopg.errors.UndefinedTable,
    psycopg.errors.LockNotAvailable,
    psycopg.errors.InsufficientPrivilege,
    psycopg_pool.PoolTimeout,
)

# Most specific first: the first matching class decides the queen_sync error. A full lock
# table or a statement timeout refuses THIS body (sending it again fails again): not an outage.
_TRANSLATIONS: tuple[tuple[type[Exception], type[QueenError], str], ...] = (
    (psycopg_pool.PoolClosed, EngineError, "the engine is closed"),
    (psycopg.errors.OutOfMemory, EngineError,
     "the server's lock table is full (max_locks_per_transaction): send fewer operations per "
     "call, or raise that setting"),
    (psycopg.errors.QueryCanceled, EngineError,
     "a statement ran past statement_timeout (or was cancelled)"),
    (psycopg_pool.PoolTimeout, EngineUnavailableError, "no connection became available"),
    (psycopg_pool.TooManyRequests, EngineUnavailableError, "too many callers are waiting"),
    (psycopg.errors.InsufficientPrivilege, EngineError, "the database user lacks a privilege"),
    (psycopg.OperationalError, EngineUnavailableError, "the database is unavailable"),
    (psycopg.InterfaceError, EngineError, "the driver failed"),
    (psycopg.Error, EngineError, "the database refused the request"),
)


def secrets_of(url: str) -> frozenset[str]:
    """The passwords written in a URL (address and query), as typed and percent-decoded.

    Read as plain text, not parsed, so a URL too malformed to parse still gives them up:
    the password libpq reads (up to the first ``@``), and also the one a person meant when
    an unescaped ``@`` or ``/`` in it would make libpq misread it (up to the last ``@``).
    """
    _, userinfo, _, rest = split_userinfo(url)
    found = {userinfo.partition(":")[2]}
    meant = url.partition("://")[2].rpartition("@")[0]
    if ":" in meant:
        found.add(meant.partition(":")[2])
    for query in (rest.partition("?")[2], url.partition("?")[2].partition("#")[0]):
        found.update(_query_secrets(query))
    found |= {unquote(s) for s in found} | {unquote(s.replace("+", " ")) for s in found}
    return frozenset(s for s in found if s)


def _query_secrets(query: str) -> Iterator[str]:
    """The values of the query's password fields, their keys read as libpq reads them
    (percent-decoded: ``pass%77ord`` is ``password``), in any case."""
    for field in query.split("&"):
        key, equals, value = field.partition("=")
        if equals and {unquote(key).lower(), unquote(key.replace("+", " ")).lower()} & _SECRET_KEYS:
            yield value


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` without these secrets, nor any URL password or ``password=`` fragment.

    A secret is masked where it stands on its own, not inside a longer word: a password
    ``a`` must not turn "failed" into "f***iled". What the driver echoes of a password
    comes quoted or in a URL, so it always stands on its own.
    """
    for secret in sorted(filter(None, secrets), key=len, reverse=True):
        text = _standing_alone(secret).sub(MASK, text)
    text = _USERINFO.sub(lambda m: m.group(1) + MASK + "@", text)
    return _FRAGMENT.sub(lambda m: m.group(1) + MASK, text)


def _standing_alone(secret: str) -> re.Pattern[str]:
    """``secret``, where no letter or digit continues it on either side."""
    start = r"(?<!\w)" if re.match(r"\w", secret[0]) else ""
    end = r"(?!\w)" if re.match(r"\w", secret[-1]) else ""
    return re.compile(start + re.escape(secret) + end)


def scrub(exc: BaseException, secrets: Iterable[str]) -> None:
    """Redact the text of ``exc`` and of the exceptions chained to it, in place."""
    chosen = tuple(secrets)
    seen: set[int] = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.args = tuple(redact(a, chosen) if isinstance(a, str) else a
                             for a in current.args)
        current = current.__cause__ or current.__context__


def detail_of(exc: BaseException, secrets: Iterable[str] = ()) -> str:
    """The driver's message, redacted (the exception is scrubbed too), or its type's name."""
    scrub(exc, secrets)
    return redact(str(exc), secrets).strip() or type(exc).__name__


_SIZED = (psycopg.errors.OutOfMemory, psycopg.errors.QueryCanceled)


def translate(exc: psycopg.Error, where: str, secrets: Iterable[str] = (),
              operations: int = 0) -> QueenError:
    """The queen_sync error for a driver error (``where`` names the store, without secrets).

    ``operations`` is the size of the body, named where the size may be the cause.
    """
    for driver_type, queen_type, summary in _TRANSLATIONS:
        if isinstance(exc, driver_type):
            if operations and isinstance(exc, _SIZED):
                summary += f", for a body of {operations} operations"
            return queen_type(f"PostgreSQL at {where}: {summary}: {detail_of(exc, secrets)}")
    raise TypeError(f"not a driver error: {type(exc).__name__}")  # pragma: no cover

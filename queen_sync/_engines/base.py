"""What every engine offers: the ``Engine`` base class, its capabilities and waiters."""

from __future__ import annotations

import abc
import contextlib
import math
import time
from dataclasses import dataclass, fields
from typing import Any, Iterator, Mapping, Protocol

from .._errors import UnsupportedOperationError


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do, so recipes and users can refuse one that lacks what they need.

    Attributes:
        fencing: tokens rise across release, expiry and restart; guarded writes are atomic.
        engine_clock_expiry: expiry is judged by one clock (the engine's), not each client's.
        queue_operations: transactions may push to and ack queues (the Queen broker only).
        wake_on_release: a waiter is woken when a permit is released, instead of polling.
        multi_host: clients on several machines can share it.
        user_table_fencing: a lease can fence writes to the user's own tables (``lock.fence``).
    """

    fencing: bool = True
    engine_clock_expiry: bool = True
    queue_operations: bool = False
    wake_on_release: bool = False
    multi_host: bool = False
    user_table_fencing: bool = False

    def require(self, *names: str, engine: str = "this engine") -> None:
        """Raise ``UnsupportedOperationError`` naming the first capability missing."""
        known = {f.name for f in fields(self)}
        for name in names:
            if name not in known:
                raise ValueError(f"unknown capability {name!r}; known: {sorted(known)}")
            if not getattr(self, name):
                raise UnsupportedOperationError(f"{engine} lacks {name}", capability=name)


class Waiter(Protocol):
    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds; True when woken by a release.

        It may return False early, when its turn came with no release seen (a waiter in
        line, see ``in_line``): the caller looks at the lock, then waits again.
        """


def in_line(waiter: Waiter) -> bool:
    """True while ``waiter`` waits behind another waiter of its name, in a line the engine
    keeps: its turn wakes it, so it need not poll, and its first wait returns at once when
    nobody is ahead. A waiter may leave the attribute out (an engine of the user's own).
    """
    return bool(getattr(waiter, "in_line", False))


class _Sleeper:
    def wait(self, timeout: float) -> bool:
        time.sleep(max(0.0, timeout))
        return False


class Engine(abc.ABC):
    """An engine answers the wire's bodies: ``call("locks"|"kv"|"transaction", body)``."""

    kind: str = "engine"
    capabilities: Capabilities = Capabilities()

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """Where it is, without credentials (safe to print and log)."""

    @property
    def store(self) -> str:
        """What tells stores apart: equal for two clients of one store, never for two stores.

        A permit of one store means nothing in another, whatever its token.
        """
        return self.url

    @abc.abstractmethod
    def call(self, route: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Send one body to ``route`` and return the engine's answer."""

    @contextlib.contextmanager
    def subscribe(self, name: str) -> Iterator[Waiter]:
        """A waiter woken when a permit of ``name`` is freed; plain sleeping by default."""
        yield _Sleeper()

    def fence(self, conn: Any, *, name: str, slot: int, token: int) -> None:
        """Inside ``conn``'s open transaction, hold the permit at ``token`` until it commits.

        Only engines with the ``user_table_fencing`` capability offer it.

        Raises:
            UnsupportedOperationError: this engine cannot fence writes to the user's tables.
        """
        raise UnsupportedOperationError(
            f"{self.kind} cannot fence writes to your own tables; use "
            "transaction().guard(lock) or lock.token", capability="user_table_fencing")

    def after_fork(self) -> None:  # noqa: B027 - a no-op suits an engine that owns nothing
        """Drop what the parent process owns (connections, sockets) in a forked child."""

    def close(self) -> None:  # noqa: B027 - a no-op suits an engine that owns nothing
        """Release the engine's resources."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"


def positive_seconds(value: Any, what: str = "timeout") -> float:
    """``value`` as seconds: a finite number above zero, else a ``TypeError``/``ValueError``.

    Infinity is refused: every engine call must stay bounded on the client side.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, got {value!r}")
    if not 0 < value < math.inf:
        raise ValueError(f"{what} must be positive and finite seconds, got {value!r}")
    return float(value)


def parse_timeout(timeout: Any, default: tuple[float, float]) -> tuple[float, float]:
    """``(connect, call)`` seconds from None (``default``), seconds, or a pair of them."""
    if timeout is None:
        return default
    pair = timeout if isinstance(timeout, (tuple, list)) else (timeout, timeout)
    if len(pair) != 2:
        raise TypeError(f"timeout must be seconds or a (connect, read) pair, got {timeout!r}")
    return positive_seconds(pair[0]), positive_seconds(pair[1])


_SECRET_PARAMS = frozenset({"password", "sslpassword", "token", "bearer_token"})


def split_userinfo(url: str) -> tuple[str, str, str, str]:
    """``url`` as ``(scheme://, userinfo, "@" or "", rest)``, cut where libpq cuts it.

    libpq ends the userinfo at the first ``@``, unless a ``/`` comes before any ``@``
    (then there is none); ``?`` and ``#`` are data in a password. Reading it any other
    way would show a password holding them, or hand libpq a different address.
    """
    head, sep, rest = url.partition("://")
    if not sep:
        return "", "", "", url
    ends = [i for i in (rest.find("@"), rest.find("/")) if i >= 0]
    if not ends or rest[min(ends)] != "@":
        return head + sep, "", "", rest
    at = min(ends)
    return head + sep, rest[:at], "@", rest[at + 1:]


def redact_url(url: str) -> str:
    """``url`` with any password (in the address or the query) replaced, for logs and reprs.

    Everything else is kept as written (several ``host:port`` pairs, escapes, ``#``).
    """
    from urllib.parse import unquote

    prefix, userinfo, at, rest = split_userinfo(url)
    user, colon, _ = userinfo.partition(":")
    address, mark, query = rest.partition("?")
    shown = [f"{field.partition('=')[0]}=***"
             if unquote(field.partition("=")[0]).lower() in _SECRET_PARAMS else field
             for field in query.split("&")] if mark else []
    return prefix + user + (":***" if colon else "") + at + address + mark + "&".join(shown)


def redact_url_for_error(url: str) -> str:
    """``url`` as an error refusing it may quote it: scheme, host and path only.

    A refused URL is malformed, so a secret may stand anywhere and bear no telltale name:
    everything up to its last ``@``, every query and fragment value and a port that is not a
    number are masked.
    """
    head, sep, rest = url.partition("://")
    if not sep:
        head, rest = "", url
    rest, hash_mark, fragment = rest.partition("#")
    rest, mark, query = rest.partition("?")
    _, at, address = rest.rpartition("@")
    authority, slash, path = address.partition("/") if sep else ("", "", address)
    host, colon, port = authority.rpartition(":")
    if colon and not port.isdigit() and not port.endswith("]"):  # "]": an IPv6 address
        authority = f"{host}:***"
    fields = [f"{f.partition('=')[0]}=***" if "=" in f else "***" for f in query.split("&")]
    return (head + sep + ("***@" if at else "") + authority + slash + path
            + mark + ("&".join(fields) if query else "") + hash_mark + ("***" if fragment else ""))

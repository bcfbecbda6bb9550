"""What the test brokers share: the routes answered by the embedded engine, faults, a ledger.

``BrokerCore`` answers ``POST /api/v1/{locks,kv,transaction}`` by handing the
body to an ``SqliteEngine`` (the embedded semantics, written once) and wrapping
what it answers or raises in the broker's HTTP envelopes:

- an answer: ``200`` with the answer; a transaction's queue riders (pushes, acks,
  timers) are checked, its KV part runs on the engine, and the riders are recorded
  (``broker.pushed()``, ``acked()``, ``timers()``) only when that committed;
- ``RequestError``: ``400 {"error": code, "reason": "invalid_request", "detail": ...}``;
- ``TypeError`` or ``ValueError``: ``400 {"error": "bad_request", "reason": "invalid_value"}``;
- ``UnsupportedOperationError``: ``501 {"error": "unsupported_operation", "reason": capability}``
  (the HTTP engine raises it back as ``UnsupportedOperationError``);
- ``EngineUnavailableError``: ``503 {"error": "unavailable", "reason": "store_busy"}``;
- anything else: ``500 {"error": "internal"}``.

A bad bearer token is ``401 {"error": "unauthorized"}``, an unknown path ``404``,
another method ``405``, a body that is not a JSON object ``400``.
"""

from __future__ import annotations

import abc
import contextlib
import json
import logging
import os
import random
import tempfile
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Sequence, TypeVar

from .._engines.sqlite import SqliteEngine
from .._errors import EngineUnavailableError, RequestError, UnsupportedOperationError
from .._ops import LOCKS_NS
from ._queues import QueueRecord, Riders

if TYPE_CHECKING:
    from .._client import Queen
    from .._handle.lock import Lock

log = logging.getLogger("queen_sync")

PATHS = {"/api/v1/locks": "locks", "/api/v1/kv": "kv", "/api/v1/transaction": "transaction"}
FAULT_KINDS = ("status", "timeout", "reset", "delay", "refuse")
JSON_HEADERS = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class Reply:
    """An HTTP answer: status, headers and body bytes."""

    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=lambda: dict(JSON_HEADERS))


def json_reply(status: int, answer: Any, headers: Optional[Mapping[str, str]] = None) -> Reply:
    body = json.dumps(answer, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return Reply(status, body, {**JSON_HEADERS, **(headers or {})})


def envelope(status: int, code: str, reason: str, detail: str) -> Reply:
    return json_reply(status, {"error": code, "reason": reason, "detail": detail})


@dataclass(frozen=True)
class Fault:
    """One injected fault. ``applied``: the call runs on the store before the fault hits."""

    kind: str
    route: Optional[str] = None
    status: int = 503
    body: Optional[bytes] = None
    headers: Mapping[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    applied: bool = False

    def reply(self) -> Reply:
        if self.body is not None:
            return Reply(self.status, self.body, {**JSON_HEADERS, **self.headers})
        return json_reply(self.status, {"error": f"injected_{self.status}",
                                        "reason": "injected", "detail": "an injected fault"},
                          self.headers)


_MAX_FAULT_SECONDS = 3600.0  # an hour: beyond it, a delay only hangs the test


@dataclass
class _Queued:
    fault: Fault
    left: int  # calls it has still to hit


def _check_fault(fault: Fault) -> None:
    """Refuse, when it is queued, a fault the broker could not inject when it comes."""
    seconds = fault.seconds
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or \
            not 0.0 <= seconds <= _MAX_FAULT_SECONDS:  # NaN fails this too
        raise ValueError(f"seconds must be a number within 0..{_MAX_FAULT_SECONDS:.0f}, "
                         f"got {seconds!r}")
    status = fault.status
    # A 2xx with a body of the test's own is a malformed answer, which a test may want.
    if isinstance(status, bool) or not isinstance(status, int) or not 200 <= status <= 599:
        raise ValueError(f"status must be an HTTP status within 200..599, got {status!r}")
    if fault.body is not None and not isinstance(fault.body, bytes):
        raise TypeError(f"body must be bytes or None, got {type(fault.body).__name__}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in fault.headers.items()):
        raise TypeError("headers must map str to str")
    if not isinstance(fault.applied, bool):
        raise TypeError(f"applied must be a bool, got {type(fault.applied).__name__}")


class FaultPlan:
    """Faults a test broker injects, in order: ``fail_next``, ``timeout_next`` ... or ``chaos``.

    Each ``*_next`` queues faults for the next ``n`` calls (of ``route``, when given).
    ``chaos(rate)`` hits a random ``rate`` of the calls the queue leaves alone.
    """

    def __init__(self, kinds: Sequence[str] = FAULT_KINDS) -> None:
        self._kinds = frozenset(kinds)
        self._lock = threading.Lock()
        self._queued: list[_Queued] = []  # in order
        self._rate = 0.0
        self._chaos_kinds: tuple[str, ...] = ()
        self._random = random.Random()
        self.injected: Counter[str] = Counter()

    def after_fork(self) -> None:
        """In a forked child: a lock of its own (a parent thread may have held this one)."""
        self._lock = threading.Lock()

    def _queue(self, n: int, fault: Fault) -> FaultPlan:
        if fault.kind not in self._kinds:
            raise ValueError(f"this broker cannot inject {fault.kind!r}; it can: "
                             f"{sorted(self._kinds)}")
        if fault.route is not None and fault.route not in PATHS.values():
            raise ValueError(f"unknown route {fault.route!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        _check_fault(fault)
        with self._lock:
            self._queued.append(_Queued(fault, n))  # a count, not n copies: n may be large
        return self

    def fail_next(self, n: int = 1, *, status: int = 503, body: Optional[bytes] = None,
                  headers: Optional[Mapping[str, str]] = None, route: Optional[str] = None,
                  applied: bool = False) -> FaultPlan:
        """Answer the next ``n`` calls with ``status`` (and ``body``: raw bytes, e.g. HTML)."""
        return self._queue(n, Fault("status", route, status, body, dict(headers or {}),
                                    applied=applied))

    def timeout_next(self, n: int = 1, *, seconds: float = 1.0, route: Optional[str] = None,
                     applied: bool = False) -> FaultPlan:
        """Answer nothing for ``seconds``, then drop the connection (the client times out)."""
        return self._queue(n, Fault("timeout", route, seconds=seconds, applied=applied))

    def reset_next(self, n: int = 1, *, route: Optional[str] = None,
                   applied: bool = False) -> FaultPlan:
        """Reset the connection instead of answering."""
        return self._queue(n, Fault("reset", route, applied=applied))

    def delay_next(self, n: int = 1, *, seconds: float = 0.1,
                   route: Optional[str] = None) -> FaultPlan:
        """Answer the next ``n`` calls correctly, but ``seconds`` late."""
        return self._queue(n, Fault("delay", route, seconds=seconds, applied=True))

    def refuse_next(self, n: int = 1, *, route: Optional[str] = None) -> FaultPlan:
        """Refuse the connection: the request provably never reaches the broker."""
        return self._queue(n, Fault("refuse", route))

    def chaos(self, rate: float, *, kinds: Sequence[str] = ("status", "timeout", "reset", "delay"),
              seed: Optional[int] = None) -> FaultPlan:
        """Hit a random ``rate`` (0..1) of calls with a fault of one of ``kinds``; 0 stops it."""
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be a number within 0..1, got {rate!r}")
        unknown = set(kinds) - self._kinds
        if unknown or not kinds:
            raise ValueError(f"kinds must be some of {sorted(self._kinds)}, got {list(kinds)}")
        with self._lock:
            self._rate, self._chaos_kinds = rate, tuple(kinds)
            self._random = random.Random(seed)
        return self

    def clear(self) -> None:
        """Forget every queued fault and stop chaos."""
        with self._lock:
            self._queued.clear()
            self._rate = 0.0

    def take(self, route: Optional[str]) -> Optional[Fault]:
        """The fault for this call, if any (the broker calls it once per request)."""
        with self._lock:
            for index, queued in enumerate(self._queued):
                fault = queued.fault
                if fault.route in (None, route):
                    queued.left -= 1
                    if not queued.left:
                        del self._queued[index]
                    self.injected[fault.kind] += 1
                    return fault
            if not self._rate or self._random.random() >= self._rate:
                return None
            fault = self._random_fault()
            self.injected[fault.kind] += 1
            return fault

    def _random_fault(self) -> Fault:
        kind = self._random.choice(self._chaos_kinds)
        applied = self._random.random() < 0.5
        if kind == "status":
            return Fault(kind, status=self._random.choice((500, 502, 503, 504)), applied=applied)
        if kind in ("timeout", "delay"):
            return Fault(kind, seconds=self._random.uniform(0.05, 0.3),
                         applied=applied or kind == "delay")
        return Fault(kind, applied=applied and kind == "reset")


class BrokerStopped(RuntimeError):
    """A call reached a broker stopped while it was in flight."""


def _clock_problem(clock: Callable[[], float]) -> Optional[str]:
    """What is wrong with the broker clock's reading now (None: a finite epoch time)."""
    try:
        now = clock()
    except Exception as exc:
        return f"the broker's clock raised {exc!r}"
    if isinstance(now, bool) or not isinstance(now, (int, float)) or not 0 <= now < 1e11:
        return f"the broker's clock read {now!r}, not epoch seconds"
    return None


# Every core of this process, given fresh locks in a forked child.
_CORES: weakref.WeakSet[BrokerCore] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for core in list(_CORES):
        core.after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class BrokerCore:
    """The routes, served from one SQLite file through the embedded engine."""

    def __init__(self, path: str, *, token: Optional[str] = None,
                 faults: Optional[FaultPlan] = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.clock = clock
        self.token = token
        self.faults = faults or FaultPlan()
        self.calls: Counter[str] = Counter()
        self._engine: Optional[SqliteEngine] = None
        self._mutex = threading.Lock()
        self._guarded: list[tuple[str, int]] = []
        self.queues = QueueRecord()
        _CORES.add(self)

    def after_fork(self) -> None:
        """In a forked child: locks of its own (a parent thread mid-call held them)."""
        self._mutex = threading.Lock()
        self.faults.after_fork()

    @property
    def engine(self) -> SqliteEngine:
        if self._engine is None:
            raise BrokerStopped("the broker is stopped")
        return self._engine

    def open(self) -> None:
        with self._mutex:
            if self._engine is None:
                self._engine = SqliteEngine(self.path, clock=self.clock)

    def close(self) -> None:
        with self._mutex:
            if self._engine is not None:
                self._engine.close()
                self._engine = None

    def route_of(self, path: str) -> Optional[str]:
        return PATHS.get(path.split("?", 1)[0])

    def answer(self, method: str, path: str, headers: Mapping[str, str], raw: bytes) -> Reply:
        """The reply to one request, with no fault."""
        route = self.route_of(path)
        if route is None:
            return envelope(404, "not_found", "no_route", f"no route {path}")
        if method != "POST":
            return envelope(405, "method_not_allowed", "post_only", f"{path} takes POST")
        refused = self._refuse_auth(headers)
        if refused is not None:
            return refused
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            body = None
        if not isinstance(body, dict):
            return envelope(400, "bad_request", "bad_json", "the body must be a JSON object")
        self.calls[route] += 1
        return self._run(route, body)

    def _refuse_auth(self, headers: Mapping[str, str]) -> Optional[Reply]:
        if self.token is None:
            return None
        given = {k.lower(): v for k, v in headers.items()}.get("authorization")
        if given == f"Bearer {self.token}":
            return None
        reason = "no_token" if given is None else "bad_token"
        return envelope(401, "unauthorized", reason, "a valid bearer token is required")

    def _run(self, route: str, body: dict[str, Any]) -> Reply:
        problem = _clock_problem(self.clock)
        if problem is not None:  # the test's broker is misbuilt: not the client's request
            log.error("test broker: %s", problem)
            return envelope(500, "internal", "broker_clock", problem)
        try:
            with self._mutex:
                if route == "transaction":
                    answer = self._transaction(body)
                else:
                    answer = self.engine.call(route, body)
        except BrokerStopped:
            raise  # stopped with this call in flight: it reaches nothing, as a stopped host
        except RequestError as exc:
            return envelope(400, exc.code, "invalid_request", str(exc))
        except (TypeError, ValueError) as exc:
            return envelope(400, "bad_request", "invalid_value", str(exc))
        except UnsupportedOperationError as exc:
            return envelope(501, "unsupported_operation", exc.capability, str(exc))
        except EngineUnavailableError as exc:
            return envelope(503, "unavailable", "store_busy", str(exc))
        except Exception as exc:
            log.exception("test broker: %s call failed", route)
            return envelope(500, "internal", type(exc).__name__, str(exc))
        return json_reply(200, answer)

    def _transaction(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The KV part on the engine; the queue riders recorded only if it committed.

        Both happen under the broker's mutex, so no reader sees one without the other.
        """
        riders = Riders.read(body)
        answer = self.engine.call("transaction", riders.kv_body)
        if not answer.get("success"):
            if riders.present and isinstance(answer.get("failedIndex"), int):
                answer["failedIndex"] += riders.before_kv
            return answer
        self._guarded.extend(_guards(body))
        if riders.present:
            # One flat list, as the broker answers: operations, then the kv rider, then timers.
            operations, timers = self.queues.apply(riders)
            flat = operations + [dict(r) for r in answer.get("kv", [])] + timers
            answer["results"] = [{**r, "index": i} for i, r in enumerate(flat)]
        return answer

    def expire(self, name: str, token: int, owner: Optional[str] = None) -> bool:
        """End the permit of ``name`` at ``token`` (of ``owner``, when given) now, as if its
        lease had run out."""
        with self._mutex, self.engine.storage.atomic() as txn:
            now = txn.now_ms()
            rows = txn.read_prefix(LOCKS_NS, name + "#", after=None, limit=4096, now_ms=now)
            for row in rows:
                value = row.value
                if row.version == token and (owner is None or (
                        isinstance(value, dict) and value.get("owner") == owner)):
                    row.expires_at = now
                    txn.write(row)
                    return True
        return False

    def assert_no_stale_writes(self) -> None:
        """Fail when a guarded transaction committed with a token older than one before it."""
        newest: dict[str, int] = {}
        for key, token in list(self._guarded):
            if token < newest.get(key, 0):
                raise AssertionError(
                    f"a guarded write on {key} committed with token {token} after one with "
                    f"token {newest[key]}: a superseded holder's write landed")
            newest[key] = token


def _guards(body: Mapping[str, Any]) -> list[tuple[str, int]]:
    return [(op["key"], op["expect"]) for op in body.get("kv") or []
            if op.get("op") == "check" and op.get("ns") == LOCKS_NS and op.get("required")]


_B = TypeVar("_B", bound="BrokerTools")


class BrokerTools(abc.ABC):
    """What both test brokers share: a store, faults, a client, a paused holder, the checks."""

    def __init__(self, path: Optional[str], *, token: Optional[str], kinds: Sequence[str],
                 prefix: str, clock: Callable[[], float] = time.time) -> None:
        if not callable(clock):  # refused before a temporary folder exists to leak
            raise TypeError(f"clock must be a callable returning epoch seconds, got {clock!r}")
        self._tmp: Optional[tempfile.TemporaryDirectory[str]] = None
        if path is None:
            self._tmp = tempfile.TemporaryDirectory(prefix=prefix)
            path = os.path.join(self._tmp.name, "broker.db")
        self.faults = FaultPlan(kinds)
        self._core = BrokerCore(path, token=token, faults=self.faults, clock=clock)
        self._store_removed = False

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The broker's URL, for ``Queen(url)``."""

    @property
    def core(self) -> BrokerCore:
        return self._core

    @property
    def path(self) -> str:
        """The SQLite file behind the broker."""
        return self._core.path

    @abc.abstractmethod
    def start(self: _B) -> _B:
        """Start answering; returns the broker."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop answering (the store is kept)."""

    def close(self) -> None:
        """Stop, and remove the temporary file if the broker made one."""
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
            self._store_removed = True

    def _refuse_if_removed(self) -> None:
        """A start after ``close()`` removed the broker's own store would begin a new one,
        its tokens starting again from 1, in a folder nothing removes."""
        if self._store_removed:
            raise RuntimeError("this broker was closed and its store removed: make another")

    def __enter__(self: _B) -> _B:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    @property
    def calls(self) -> Counter[str]:
        """Calls answered so far, by route (faults that never reached the store excluded)."""
        return self.core.calls

    def client(self, **options: Any) -> Queen:
        """A ``Queen`` on this broker; quick to give up, for tests (options override)."""
        from .._client import Queen

        settings: dict[str, Any] = {"timeout": (1.0, 2.0), "backoff": 0.01,
                                    "bearer_token": self.core.token, **options}
        return Queen(self.url, **settings)

    @contextlib.contextmanager
    def paused(self, lock: Lock) -> Iterator[None]:
        """While the block runs, ``lock``'s holder is "paused": its lease is over on the broker.

        Its renewals stop and the broker ends its permit now, as if the lifetime had
        run out while the process was frozen. The handle has not noticed: its own
        clock did not move, so it still believes it holds the lease and still hands
        out its old token. Anything it writes inside the block must be fenced out.
        When the block ends its renewals resume (and report the loss). A renew in flight
        lands before the pause begins.

        Raises:
            ValueError: ``lock`` is not held, or holds no permit on this broker (it is
                another store's): nothing would be paused.
        """
        if lock._token is None:
            raise ValueError(f"lock {lock.name!r} is not held: there is nothing to pause")
        renewer = lock._client.renewer
        renewer.unregister(lock)
        # A renew in flight lands first: its answer may carry a new token, or the loss.
        lock.await_renewal()
        token = lock._token
        # The owner, minted per handle, tells this broker's permit from another store's,
        # however the client spelled the broker's URL.
        if token is None or not self.core.expire(lock.name, token, lock.owner):
            if token is not None:
                renewer.register(lock)
            raise ValueError(
                f"lock {lock.name!r} is not held" if token is None else
                f"lock {lock.name!r} holds no permit on this broker (its client uses "
                f"{lock.engine_url}): there is nothing here to pause")
        try:
            yield
        finally:
            if lock._token is not None:
                renewer.register(lock)

    def assert_no_stale_writes(self) -> None:
        """Fail if a guarded transaction committed with a token older than one already seen."""
        self.core.assert_no_stale_writes()

    def pushed(self, queue: Optional[str] = None) -> list[dict[str, Any]]:
        """The messages committed transactions pushed (to ``queue``, when given), in order.

        Each is the item as sent: ``queue``, ``payload``, ``transactionId``, and
        ``partition``/``traceId`` when given. A bundle that did not commit pushed nothing.
        """
        return self.core.queues.pushed(queue)

    def acked(self) -> list[dict[str, Any]]:
        """The acks committed transactions carried, in order, as sent."""
        return self.core.queues.acked()

    def timers(self, queue: Optional[str] = None) -> list[dict[str, Any]]:
        """The timers scheduled and not cancelled (of ``queue``, when given), as sent."""
        return self.core.queues.timers(queue)

"""``FaultyEngine``: any engine, with faults a test scripts per route, before or after the call."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Union

from .._engines import engine_from_url
from .._engines.base import Engine, Waiter
from .._errors import EngineUnavailableError

Hook = Callable[[str, Mapping[str, Any]], None]
ErrorSpec = Union[BaseException, "type[BaseException]", None]

ROUTES = ("locks", "kv", "transaction")


@dataclass
class _Rule:
    """One scripted fault: what it does, which calls it hits, and how many are left."""

    kind: str
    action: Hook
    route: Optional[str]
    op: Optional[str]
    applied: bool
    left: Optional[int]  # None: every matching call, until ``clear``

    def matches(self, route: str, body: Mapping[str, Any]) -> bool:
        if self.route is not None and route != self.route:
            return False
        if self.op is None:
            return True
        operations = [*(body.get("operations") or ()), *(body.get("kv") or ())]
        return any(isinstance(o, Mapping) and o.get("op") == self.op for o in operations)


_MAX_DELAY = 3600.0  # an hour: beyond it, a delay only hangs the test


class FaultyEngine(Engine):
    """An engine that forwards every call to ``inner``, except the calls a test makes fail.

    Each ``*_next`` method scripts the next ``n`` calls (``n=None``: every call until
    ``clear``) of ``route`` and, when given, of bodies carrying an operation ``op``.
    ``applied=False`` acts before the call reaches ``inner`` (nothing is written);
    ``applied=True`` acts after ``inner`` answered (the write landed, then its answer
    was lost). A call takes the first scripted fault that matches it, in order.

    ```python
    import tempfile
    import queen_sync as qs
    from queen_sync.testing import FaultyEngine

    with tempfile.TemporaryDirectory() as folder:
        engine = FaultyEngine(f"sqlite:///{folder}/queen.db")
        with qs.Queen(engine=engine) as q:
            engine.fail_next(route="kv", applied=True)   # it lands; the answer is lost
            try:
                q.kv.incr("stats", "runs", forever=True)
            except qs.EngineUnavailableError:
                pass
            assert q.kv.get("stats", "runs")["value"] == 1
    ```

    Args:
        inner: the engine to wrap, or a URL to build one from (``sqlite://``, ...).
        **options: engine options for a URL, e.g. ``clock=`` (epoch seconds) for SQLite.

    Attributes:
        sent: calls made to this engine, by route, whatever a fault did to them.
        calls: calls ``inner`` answered, by route.
        injected: faults injected, by kind (``fail``, ``delay``, ``hook``).
    """

    def __init__(self, inner: Union[Engine, str], **options: Any) -> None:
        if isinstance(inner, str):
            inner = engine_from_url(inner, options)
        elif options:
            raise TypeError("options apply only when FaultyEngine builds the engine from a URL")
        if not isinstance(inner, Engine):
            raise TypeError(f"inner must be an Engine or a URL, got {type(inner).__name__}")
        self._inner = inner
        self.kind = inner.kind
        self.capabilities = inner.capabilities
        self.sent: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()
        self._rules: list[_Rule] = []
        self._mutex = threading.Lock()

    @property
    def inner(self) -> Engine:
        """The engine every call that is not failed before it reaches."""
        return self._inner

    @property
    def url(self) -> str:
        """The inner engine's URL (without credentials)."""
        return self._inner.url

    @property
    def store(self) -> str:
        """The inner engine's store: a faulty client's leases guard its writes there."""
        return self._inner.store

    # ---- scripting ---------------------------------------------------------------------

    def fail_next(self, n: Optional[int] = 1, *, error: ErrorSpec = None,
                  route: Optional[str] = None, op: Optional[str] = None,
                  applied: bool = False) -> FaultyEngine:
        """Raise ``error`` (an exception or its class; default ``EngineUnavailableError``)."""
        if error is not None and not _is_error(error):
            raise TypeError(f"error must be an exception or an exception class, got {error!r}")

        def fail(route: str, body: Mapping[str, Any]) -> None:
            raise _make(error, route)
        return self._add(_Rule("fail", fail, route, op, applied, _count(n)))

    def delay_next(self, n: Optional[int] = 1, *, seconds: float,
                   route: Optional[str] = None, op: Optional[str] = None,
                   applied: bool = False) -> FaultyEngine:
        """Sleep ``seconds`` (real time) before the call, or after it when ``applied``."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or \
                not 0 <= seconds <= _MAX_DELAY:  # NaN fails this too
            raise ValueError(f"seconds must be a number within 0..{_MAX_DELAY:.0f}, "
                             f"got {seconds!r}")
        return self._add(_Rule("delay", lambda route, body: time.sleep(seconds), route, op,
                               applied, _count(n)))

    def hook_next(self, n: Optional[int] = 1, *, hook: Hook, route: Optional[str] = None,
                  op: Optional[str] = None, applied: bool = False) -> FaultyEngine:
        """Call ``hook(route, body)`` before the call, or after it when ``applied``.

        What the hook raises is what the caller sees; it may also block, or move a clock.
        """
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {hook!r}")
        return self._add(_Rule("hook", hook, route, op, applied, _count(n)))

    def clear(self) -> None:
        """Forget every scripted fault: from now on each call goes straight to ``inner``."""
        with self._mutex:
            self._rules.clear()

    def _add(self, rule: _Rule) -> FaultyEngine:
        if rule.route is not None and rule.route not in ROUTES:
            raise ValueError(f"unknown route {rule.route!r}; routes: {list(ROUTES)}")
        with self._mutex:
            self._rules.append(rule)
        return self

    def _take(self, route: str, body: Mapping[str, Any]) -> Optional[_Rule]:
        with self._mutex:
            for index, rule in enumerate(self._rules):
                if not rule.matches(route, body):
                    continue
                if rule.left is not None:
                    rule.left -= 1
                    if rule.left == 0:
                        del self._rules[index]
                self.injected[rule.kind] += 1
                return rule
        return None

    # ---- the engine --------------------------------------------------------------------

    def call(self, route: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Forward one call to the inner engine, running the first scripted fault it matches."""
        rule = self._take(route, body)
        with self._mutex:
            self.sent[route] += 1
        if rule is not None and not rule.applied:
            rule.action(route, body)
        answer = self._inner.call(route, body)
        with self._mutex:
            self.calls[route] += 1
        if rule is not None and rule.applied:
            rule.action(route, body)
        return answer

    def left_strays(self) -> bool:
        """The inner engine's ``left_strays`` (an HTTP engine's resent calls), else False."""
        inner = getattr(self._inner, "left_strays", None)
        return bool(inner()) if inner is not None else False

    @contextlib.contextmanager
    def subscribe(self, name: str) -> Iterator[Waiter]:
        """The inner engine's release notifications for ``name`` (never faulted)."""
        with self._inner.subscribe(name) as waiter:
            yield waiter

    def fence(self, conn: Any, *, name: str, slot: int, token: int) -> None:
        """The inner engine's ``fence`` (never faulted)."""
        self._inner.fence(conn, name=name, slot=slot, token=token)

    def after_fork(self) -> None:
        """Let the inner engine drop what a forked child must not share."""
        self._inner.after_fork()

    def close(self) -> None:
        """Close the inner engine."""
        self._inner.close()

    def __repr__(self) -> str:
        return f"<FaultyEngine over {self._inner!r}>"


def _count(n: Optional[int]) -> Optional[int]:
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"n must be an int >= 1 or None (every call), got {n!r}")
    if n < 1:
        raise ValueError(f"n must be >= 1 (or None: every call), got {n!r}")
    return n


def _is_error(error: object) -> bool:
    return isinstance(error, BaseException) or (
        isinstance(error, type) and issubclass(error, BaseException))


def _make(error: ErrorSpec, route: str) -> BaseException:
    if error is None:
        return EngineUnavailableError(f"an injected fault on {route} (FaultyEngine)")
    if isinstance(error, BaseException):
        return error
    return error(f"an injected fault on {route} (FaultyEngine)")

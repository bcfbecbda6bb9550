"""An engine wrapper for the recipes' tests that counts the KV rows each call reads.

It wraps the real engine of any URL (SQLite, PostgreSQL, a LocalBroker), so a test can
see what a recipe costs in rows through the public ``Queen(engine=...)`` door.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping, TypeVar

import queen_sync as qs
from queen_sync._engines import engine_from_url

T = TypeVar("T")


def _rows_in(route: str, body: Mapping[str, Any], answer: Mapping[str, Any]) -> int:
    """How many stored rows the answer carried back (a read op's rows, a lock's holders)."""
    if route not in ("kv", "locks"):
        return 0  # transactions only write and check: they carry no rows back
    total = 0
    for op, result in zip(body.get("operations", []), answer.get("results", [])):
        if route == "locks":
            total += len(result.get("holders") or []) if op.get("op") == "get" else 0
        elif op.get("op") in ("getPrefix", "getMany"):
            total += len(result.get("rows") or [])
        elif op.get("op") == "get":
            total += 1 if result.get("found") else 0
    return total


class CountingEngine(qs.Engine):
    """Forwards every call to ``inner`` and counts the calls and the rows they read."""

    def __init__(self, url: str) -> None:
        self._inner = engine_from_url(url, {})
        self.kind = self._inner.kind
        self.capabilities = self._inner.capabilities
        self._mutex = threading.Lock()
        self.calls = 0
        self.rows_read = 0

    @property
    def url(self) -> str:
        return self._inner.url

    def call(self, route: str, body: Mapping[str, Any]) -> dict[str, Any]:
        answer = self._inner.call(route, body)
        with self._mutex:
            self.calls += 1
            self.rows_read += _rows_in(route, body, answer)
        return answer

    def measure(self, call: Callable[[], T]) -> tuple[T, int, int]:
        """``call()``'s result, and the engine calls and rows it took."""
        with self._mutex:
            self.calls = self.rows_read = 0
        result = call()
        with self._mutex:
            return result, self.calls, self.rows_read

    def subscribe(self, name: str) -> Any:
        return self._inner.subscribe(name)

    def after_fork(self) -> None:
        self._inner.after_fork()

    def close(self) -> None:
        self._inner.close()

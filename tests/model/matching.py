"""Comparing an engine's answer with the model's, where the two may legitimately differ.

Versions (tokens) are compared as an order-preserving one-to-one map, not as
numbers: the model mirrors the store-wide counter, but PostgreSQL draws from a
sequence that a rolled-back transaction does not rewind, so its numbers may skip.
What the wire promises is kept exactly: every new version exceeds every earlier
one, store-wide, and no two writes share one. A rolled-back call may name versions
in its answer (the failed op reports the row as it stood); they were never
committed, so their pairs are checked, then forgotten: SQLite issues those numbers
again, PostgreSQL never does, and the wire allows both.

Times (epoch ms) are compared exactly when the engine runs on the test's injected
clock. When it runs on its own clock (PostgreSQL's), the model's clock reads
``BASE + call number``, and every time the engine reports must equal one engine
instant per call plus the model's offset (a TTL): all rows written in one call
agree, offsets are right, and instants never run backwards.
"""

from __future__ import annotations

import bisect
from typing import Any, Optional

VERSION_KEYS = frozenset({"token", "version", "expect"})
TIME_KEYS = frozenset({"expiresAt", "updatedAt", "since", "renewedAt"})
OPAQUE_KEYS = frozenset({"value"})  # user data: compared as is, never translated

LEARNED_BASE = 1_000_000_000_000
LEARNED_SPAN = 1000  # calls per example; TTLs are whole seconds, so offsets are 1000s


class OrderMap:
    """A strictly increasing one-to-one map between two number spaces, learned pair by pair."""

    def __init__(self, *, strict: bool = True) -> None:
        self._strict = strict
        self._left: list[int] = []
        self._pairs: dict[int, int] = {}
        self._back: dict[int, int] = {}

    def forward(self, left: int) -> int:
        return self._pairs[left]

    def knows(self, left: int) -> bool:
        return left in self._pairs

    def snapshot(self) -> tuple[list[int], dict[int, int], dict[int, int]]:
        return list(self._left), dict(self._pairs), dict(self._back)

    def restore(self, saved: tuple[list[int], dict[int, int], dict[int, int]]) -> None:
        """Forget the pairs learned since ``snapshot``: they came from a call that was undone."""
        self._left, self._pairs, self._back = list(saved[0]), dict(saved[1]), dict(saved[2])

    def pair(self, left: int, right: int) -> Optional[str]:
        """None if ``left ~ right`` fits every pair so far (and is now known), else why not."""
        if left in self._pairs:
            known = self._pairs[left]
            return None if known == right else f"model {left} was engine {known}, now {right}"
        if self._strict and right in self._back:
            return f"engine {right} already stood for model {self._back[right]}, now {left}"
        at = bisect.bisect(self._left, left)
        below = self._pairs[self._left[at - 1]] if at else None
        above = self._pairs[self._left[at]] if at < len(self._left) else None
        if (below is not None and not self._above(right, below)) or (
                above is not None and not self._above(above, right)):
            return f"engine {right} for model {left} breaks the order (between {below}, {above})"
        self._left.insert(at, left)
        self._pairs[left] = right
        self._back.setdefault(right, left)
        return None

    def _above(self, high: int, low: int) -> bool:
        return high > low if self._strict else high >= low


class Clocks:
    """How the model's times relate to the engine's: ``exact`` or ``learned`` per call."""

    def __init__(self, exact: bool) -> None:
        self.exact = exact
        self._instants = OrderMap(strict=False)

    def pair(self, model_ms: int, engine_ms: int) -> Optional[str]:
        if self.exact:
            return None if model_ms == engine_ms else f"time {engine_ms} != model {model_ms}"
        call = (model_ms - LEARNED_BASE) % LEARNED_SPAN
        offset = model_ms - LEARNED_BASE - call
        problem = self._instants.pair(call, engine_ms - offset)
        return None if problem is None else f"time of call {call} + {offset} ms: {problem}"


class Matcher:
    """Walks a model answer and an engine answer side by side and lists their differences."""

    def __init__(self, versions: OrderMap, clocks: Clocks) -> None:
        self.versions = versions
        self.clocks = clocks

    def differences(self, model: Any, engine: Any) -> list[str]:
        found: list[str] = []
        self._walk(model, engine, "answer", found, translate=True)
        return found

    def _walk(self, model: Any, engine: Any, path: str, found: list[str], *,
              translate: bool) -> None:
        if isinstance(model, dict) and isinstance(engine, dict):
            if set(model) != set(engine):
                found.append(f"{path}: keys {sorted(engine)} != model {sorted(model)}")
            for key in sorted(set(model) & set(engine)):
                self._field(key, model[key], engine[key], f"{path}.{key}", found,
                            translate=translate and key not in OPAQUE_KEYS)
        elif isinstance(model, list) and isinstance(engine, list):
            if len(model) != len(engine):
                found.append(f"{path}: {len(engine)} items != model {len(model)}")
            for i, (m, e) in enumerate(zip(model, engine)):
                self._walk(m, e, f"{path}[{i}]", found, translate=translate)
        elif type(model) is not type(engine) or model != engine:
            found.append(f"{path}: {engine!r} != model {model!r}")

    def _field(self, key: str, model: Any, engine: Any, path: str, found: list[str], *,
               translate: bool) -> None:
        both_ints = _is_int(model) and _is_int(engine)
        if translate and both_ints and key in VERSION_KEYS:
            problem = self._version(model, engine)
        elif translate and both_ints and key in TIME_KEYS:
            problem = self.clocks.pair(model, engine)
        else:
            self._walk(model, engine, path, found, translate=translate)
            return
        if problem is not None:
            found.append(f"{path}: {problem}")

    def _version(self, model: int, engine: int) -> Optional[str]:
        if model == 0 or engine == 0:  # 0 means absent, in both spaces
            return None if model == engine else f"version {engine} != model {model}"
        return self.versions.pair(model, engine)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

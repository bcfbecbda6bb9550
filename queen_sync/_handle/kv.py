"""``q.kv``: the key/value wire, one builder per op and one call each."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any, Optional, Sequence

from .._durations import Duration, expiry_fields
from .._ops import KvOps

if TYPE_CHECKING:
    from .._results import Result
    from .caller import Caller

_UNSET: Any = ...


class KvOpBuilders:
    """``q.kv.op``: build KV ops (for ``batch`` and transactions) with friendly expiry arguments.

    Every write takes exactly one expiry: ``ttl`` (seconds, timedelta or ``"5m"``),
    ``ttl_seconds``, ``until`` (an aware datetime) or ``forever=True``.
    """

    get = staticmethod(KvOps.get)
    get_many = staticmethod(KvOps.get_many)
    get_prefix = staticmethod(KvOps.get_prefix)
    check = staticmethod(KvOps.check)

    @staticmethod
    def put(ns: str, key: str, value: Any, *, ttl: Optional[Duration] = None,
            ttl_seconds: Optional[int] = None, until: Optional[datetime] = None,
            forever: bool = False, expect: Any = _UNSET, required: bool = False) -> dict[str, Any]:
        expiry = expiry_fields(ttl=ttl, ttl_seconds=ttl_seconds, until=until, forever=forever)
        return KvOps.put(ns, key, value, expiry=expiry, expect=expect, required=required)

    @staticmethod
    def put_if_absent(ns: str, key: str, value: Any, *, ttl: Optional[Duration] = None,
                      ttl_seconds: Optional[int] = None, until: Optional[datetime] = None,
                      forever: bool = False, required: bool = False) -> dict[str, Any]:
        expiry = expiry_fields(ttl=ttl, ttl_seconds=ttl_seconds, until=until, forever=forever)
        return KvOps.put_if_absent(ns, key, value, expiry=expiry, required=required)

    @staticmethod
    def delete(ns: str, key: str, *, expect: Any = _UNSET, required: bool = False
               ) -> dict[str, Any]:
        return KvOps.delete(ns, key, expect=expect, required=required)

    @staticmethod
    def incr(ns: str, key: str, *, delta: float = 1, min: Optional[float] = None,
             max: Optional[float] = None, ttl: Optional[Duration] = None,
             ttl_seconds: Optional[int] = None, until: Optional[datetime] = None,
             forever: bool = False, required: bool = False) -> dict[str, Any]:
        expiry = expiry_fields(ttl=ttl, ttl_seconds=ttl_seconds, until=until, forever=forever)
        return KvOps.incr(ns, key, expiry=expiry, delta=delta, min=min, max=max,
                          required=required)


class Kv:
    """Key/value operations; each returns the wire's answer, truthy when applied/found."""

    op = KvOpBuilders

    def __init__(self, client: Caller) -> None:
        self._client = client

    def _one(self, op: dict[str, Any]) -> Result:
        return self._client.call_kv([op])[0]

    def batch(self, ops: Sequence[dict[str, Any]]) -> list[Result]:
        """Send several ops in one call; one answer per op, in order, each with its ``index``.

        Ops answer on their own, except that a ``required=True`` write that does not apply
        cancels the whole batch: nothing of it is written, and the ops after it are not
        run. Its answer keeps its own verdict (``reason``, ``version``, ``value``) plus
        ``failedIndex``; every other op answers ``{"index": i, "applied": False,
        "reason": "rolled_back", "failedIndex": k}``.
        """
        return self._client.call_kv(list(ops))

    def get(self, ns: str, key: str) -> Result:
        return self._one(KvOps.get(ns, key))

    def get_many(self, ns: str, keys: Sequence[str]) -> Result:
        return self._one(KvOps.get_many(ns, keys))

    def get_prefix(self, ns: str, prefix: str, *, after: Optional[str] = None,
                   limit: Optional[int] = None, keys_only: bool = False) -> Result:
        return self._one(KvOps.get_prefix(ns, prefix, after=after, limit=limit,
                                          keys_only=keys_only))

    def list_all(self, ns: str, prefix: str, *, keys_only: bool = False) -> list[dict[str, Any]]:
        """Every live row under ``prefix``, following ``nextAfter`` page by page."""
        rows: list[dict[str, Any]] = []
        after: Optional[str] = None
        while True:
            page = self.get_prefix(ns, prefix, after=after, limit=1000, keys_only=keys_only)
            rows.extend(page["rows"])
            if not page.get("truncated"):
                return rows
            after = page["nextAfter"]

    def put(self, ns: str, key: str, value: Any, *, ttl: Optional[Duration] = None,
            ttl_seconds: Optional[int] = None, until: Optional[datetime] = None,
            forever: bool = False, expect: Any = _UNSET, required: bool = False) -> Result:
        """Write ``value``; with ``expect``, only while the key is at that version."""
        return self._one(KvOpBuilders.put(ns, key, value, ttl=ttl, ttl_seconds=ttl_seconds,
                                          until=until, forever=forever, expect=expect,
                                          required=required))

    def put_if_absent(self, ns: str, key: str, value: Any, *, ttl: Optional[Duration] = None,
                      ttl_seconds: Optional[int] = None, until: Optional[datetime] = None,
                      forever: bool = False, required: bool = False) -> Result:
        """Write ``value`` only when no live row holds the key."""
        return self._one(KvOpBuilders.put_if_absent(
            ns, key, value, ttl=ttl, ttl_seconds=ttl_seconds, until=until, forever=forever,
            required=required))

    def delete(self, ns: str, key: str, *, expect: Any = _UNSET) -> Result:
        return self._one(KvOpBuilders.delete(ns, key, expect=expect))

    def incr(self, ns: str, key: str, *, delta: float = 1, min: Optional[float] = None,
             max: Optional[float] = None, ttl: Optional[Duration] = None,
             ttl_seconds: Optional[int] = None, until: Optional[datetime] = None,
             forever: bool = False, required: bool = False) -> Result:
        """Add ``delta``, refusing to pass ``min``/``max``; the expiry applies on creation."""
        return self._one(KvOpBuilders.incr(
            ns, key, delta=delta, min=min, max=max, ttl=ttl, ttl_seconds=ttl_seconds,
            until=until, forever=forever, required=required))

    def check(self, ns: str, key: str, *, expect: int) -> Result:
        return self._one(KvOps.check(ns, key, expect=expect))

    def once(self, ns: str, key: str, *, value: Any = True, ttl: Optional[Duration] = None,
             ttl_seconds: Optional[int] = None, until: Optional[datetime] = None,
             forever: bool = False) -> bool:
        """True the first time ``key`` is claimed within its lifetime, False after."""
        return bool(self.put_if_absent(ns, key, value, ttl=ttl, ttl_seconds=ttl_seconds,
                                       until=until, forever=forever))

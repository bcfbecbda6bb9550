"""``q.kv``: the key/value wire, one builder per op and one call each."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any, Optional, Sequence

from .._durations import Duration, expiry_fields
from .._errors import ProtocolError
from .._ops import MAX_PREFIX_LIMIT, KvOps, check_int

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
        """A ``put`` op with one expiry; with ``expect``, only over that version."""
        expiry = expiry_fields(ttl=ttl, ttl_seconds=ttl_seconds, until=until, forever=forever)
        return KvOps.put(ns, key, value, expiry=expiry, expect=expect, required=required)

    @staticmethod
    def put_if_absent(ns: str, key: str, value: Any, *, ttl: Optional[Duration] = None,
                      ttl_seconds: Optional[int] = None, until: Optional[datetime] = None,
                      forever: bool = False, required: bool = False) -> dict[str, Any]:
        """A ``putIfAbsent`` op with one expiry: written only where no live row is."""
        expiry = expiry_fields(ttl=ttl, ttl_seconds=ttl_seconds, until=until, forever=forever)
        return KvOps.put_if_absent(ns, key, value, expiry=expiry, required=required)

    @staticmethod
    def delete(ns: str, key: str, *, expect: Any = _UNSET, required: bool = False
               ) -> dict[str, Any]:
        """A ``delete`` op; with ``expect``, only when the row is at that version."""
        return KvOps.delete(ns, key, expect=expect, required=required)

    @staticmethod
    def incr(ns: str, key: str, *, delta: float = 1, min: Optional[float] = None,
             max: Optional[float] = None, ttl: Optional[Duration] = None,
             ttl_seconds: Optional[int] = None, until: Optional[datetime] = None,
             forever: bool = False, required: bool = False) -> dict[str, Any]:
        """An ``incr`` op with one expiry (applied when the row is created)."""
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

    def batch(self, operations: Sequence[dict[str, Any]]) -> list[Result]:
        """Send several ops in one call; one answer per op, in order, each with its ``index``.

        Ops answer on their own, except that a ``required=True`` write that does not apply
        cancels the whole batch: nothing of it is written, and the ops after it are not
        run. Its answer keeps its own ``reason``, with ``version`` and ``value`` of its key
        as committed (never a row the batch undid), plus ``failedIndex``; every other op
        answers ``{"index": i, "applied": False,
        "reason": "rolled_back", "failedIndex": k}``.
        """
        return self._client.call_kv(list(operations))

    def get(self, ns: str, key: str) -> Result:
        """Read one key: truthy when a live row was found.

        Returns:
            ``{"found": True, "key", "value", "version", "expiresAt", "updatedAt"}``, or
                ``{"found": False}`` when the key is absent or expired. A stored ``None``
                is found: ``{"found": True, "value": None}``.
        """
        return self._one(KvOps.get(ns, key))

    def get_many(self, ns: str, keys: Sequence[str]) -> Result:
        """Read up to 1000 keys of ``ns`` in one call, as one snapshot.

        Returns:
            ``{"rows": [...], "missing": [keys]}``: a row per live key (``key``, ``value``,
                ``version``, ``expiresAt``), the absent or expired keys in ``missing``;
                truthy when any row was found.
        """
        return self._one(KvOps.get_many(ns, keys))

    def get_prefix(self, ns: str, prefix: str, *, after: Optional[str] = None,
                   limit: Optional[int] = None, keys_only: bool = False) -> Result:
        """Read one page of the live rows whose key starts with ``prefix``, in key order.

        ``prefix`` is matched literally (``%`` and ``_`` are data). ``list_all`` follows
        the pages for you.

        Args:
            ns: The namespace.
            prefix: A non-empty key prefix.
            after: Start after this key (the previous page's ``nextAfter``).
            limit: Rows per page, at most 1000 (the embedded engines' default is 100).
            keys_only: Leave the values out of the rows.

        Returns:
            ``{"rows": [...], "truncated": bool, "nextAfter": key or None}``; truthy when
                the page holds any row.
        """
        return self._one(KvOps.get_prefix(ns, prefix, after=after, limit=limit,
                                          keys_only=keys_only))

    def list_all(self, ns: str, prefix: str, *, limit: Optional[int] = None,
                 keys_only: bool = False, max_rows: Optional[int] = None
                 ) -> list[dict[str, Any]]:
        """Every live row under ``prefix``, following ``nextAfter`` page by page.

        Each page is its own snapshot, so the whole walk is not one consistent listing.

        Args:
            limit: rows per page (1..1000; default 1000).
            max_rows: stop once this many rows are read (at least 1; default: no bound).

        Raises:
            ProtocolError: a page says it was truncated without a cursor past its rows,
                which could only be walked by asking for the same page again.
        """
        page_size = check_int(limit, "limit", low=1, high=MAX_PREFIX_LIMIT) if limit is not None \
            else MAX_PREFIX_LIMIT
        if max_rows is not None:
            check_int(max_rows, "max_rows", low=1)
        rows: list[dict[str, Any]] = []
        after: Optional[str] = None
        while max_rows is None or len(rows) < max_rows:
            wanted = page_size if max_rows is None else min(page_size, max_rows - len(rows))
            page = self.get_prefix(ns, prefix, after=after, limit=wanted, keys_only=keys_only)
            rows.extend(page["rows"])
            if not page.get("truncated"):
                break
            after = _cursor_past(page, after)
        return rows if max_rows is None else rows[:max_rows]

    def put(self, ns: str, key: str, value: Any, *, ttl: Optional[Duration] = None,
            ttl_seconds: Optional[int] = None, until: Optional[datetime] = None,
            forever: bool = False, expect: Any = _UNSET, required: bool = False) -> Result:
        """Write ``value``; with ``expect``, only while the key is at that version (0: absent)."""
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

    def delete(self, ns: str, key: str, *, expect: Any = _UNSET, required: bool = False
               ) -> Result:
        """Delete ``key``; with ``expect``, only while it is at that version (``0``: never)."""
        return self._one(KvOpBuilders.delete(ns, key, expect=expect, required=required))

    def incr(self, ns: str, key: str, *, delta: float = 1, min: Optional[float] = None,
             max: Optional[float] = None, ttl: Optional[Duration] = None,
             ttl_seconds: Optional[int] = None, until: Optional[datetime] = None,
             forever: bool = False, required: bool = False) -> Result:
        """Add ``delta``, refusing to pass ``min``/``max``; the expiry applies on creation."""
        return self._one(KvOpBuilders.incr(
            ns, key, delta=delta, min=min, max=max, ttl=ttl, ttl_seconds=ttl_seconds,
            until=until, forever=forever, required=required))

    def check(self, ns: str, key: str, *, expect: int, required: bool = False) -> Result:
        """Whether ``key`` is at version ``expect`` (``0``: absent); writes nothing."""
        return self._one(KvOps.check(ns, key, expect=expect, required=required))

    def once(self, ns: str, key: str, *, value: Any = True, ttl: Optional[Duration] = None,
             ttl_seconds: Optional[int] = None, until: Optional[datetime] = None,
             forever: bool = False) -> bool:
        """True the first time ``key`` is claimed within its lifetime, False after."""
        return bool(self.put_if_absent(ns, key, value, ttl=ttl, ttl_seconds=ttl_seconds,
                                       until=until, forever=forever))


def _cursor_past(page: Result, after: Optional[str]) -> str:
    """The truncated page's ``nextAfter``: a key, and not the cursor that asked for this page.

    Only equality is refused: the engine's key order need not be Python's.
    """
    cursor = page.get("nextAfter")
    if not isinstance(cursor, str) or not cursor or cursor == after:
        raise ProtocolError(f"getPrefix answered truncated with nextAfter {cursor!r} after "
                            f"{after!r}: there is no page past it to read", route="kv")
    return cursor

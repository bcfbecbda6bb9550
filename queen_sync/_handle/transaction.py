"""``q.transaction()``: KV writes that commit together, optionally guarded by locks.

Guards go first in the bundle. When a guard loses only because the lock's own
renewer changed the token in between (the row is still this handle's), nothing
committed, so the bundle is sent again with the new token. Any other lost guard
marks the lock lost (``guard``) and the failed answer is returned, not raised.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Optional

from typing_extensions import Concatenate, ParamSpec

from .._durations import Duration
from .._errors import LockNotHeldError
from .._results import Result
from .kv import KvOpBuilders
from .lock import Lock

if TYPE_CHECKING:
    from .caller import Caller

P = ParamSpec("P")
_GUARD_ATTEMPTS = 4


def _appending(build: Callable[P, dict[str, Any]]
               ) -> Callable[Concatenate[_BundleKv, P], Transaction]:
    """A bundle method taking exactly the builder's arguments, appending the op it builds."""

    def add(self: _BundleKv, /, *args: P.args, **kwargs: P.kwargs) -> Transaction:
        return self._txn._add(build(*args, **kwargs))

    add.__name__, add.__doc__ = build.__name__, build.__doc__
    return add


class _BundleKv:
    """``transaction().kv``: the write ops of ``q.kv``, each appended to the bundle."""

    def __init__(self, txn: Transaction) -> None:
        self._txn = txn

    # The keywords are the builders' own (one list of them), so a typo fails type checks.
    put = _appending(KvOpBuilders.put)
    put_if_absent = _appending(KvOpBuilders.put_if_absent)
    delete = _appending(KvOpBuilders.delete)
    incr = _appending(KvOpBuilders.incr)

    def check(self, ns: str, key: str, *, expect: int, required: bool = True) -> Transaction:
        return self._txn._add(KvOpBuilders.check(ns, key, expect=expect, required=required))

    def _reads(self, *_: Any, **__: Any) -> Transaction:
        raise ValueError("reads (get, get_many, get_prefix) cannot go inside a transaction; "
                         "read with q.kv first, then guard the write with check(expect=version)")

    get = get_many = get_prefix = _reads


class Transaction:
    """A bundle of guarded KV writes; build it, then ``commit()`` once."""

    def __init__(self, client: Caller) -> None:
        self._client = client
        self._guards: list[Lock] = []
        self._ops: list[dict[str, Any]] = []
        self.kv = _BundleKv(self)

    def _add(self, op: dict[str, Any]) -> Transaction:
        self._ops.append(op)
        return self

    def guard(self, lock: Lock) -> Transaction:
        """Commit only while ``lock`` is held by this handle at its current token.

        Raises:
            TypeError: ``lock`` is not a lock or semaphore handle (a name is not enough:
                the guard is this handle's token, read at commit).
        """
        if not isinstance(lock, Lock):
            raise TypeError(f"guard takes a Lock (from q.lock() or q.semaphore()), "
                            f"got {type(lock).__name__}")
        self._guards.append(lock)
        return self

    def once(self, ns: str, key: str, *, value: Any = True, ttl: Optional[Duration] = None,
             ttl_seconds: Optional[int] = None, until: Optional[datetime] = None,
             forever: bool = False) -> Transaction:
        """A required ``putIfAbsent``: the bundle commits only once within the lifetime."""
        return self._add(KvOpBuilders.put_if_absent(
            ns, key, value, ttl=ttl, ttl_seconds=ttl_seconds, until=until, forever=forever,
            required=True))

    def commit(self) -> Result:
        """Send the bundle; a lost precondition is RETURNED (a falsy result), not raised."""
        for lock in self._guards:
            if not lock.held:
                raise LockNotHeldError(f"cannot guard with lock {lock.name!r}: not held",
                                       name=lock.name)
        for _ in range(_GUARD_ATTEMPTS):
            guards = [lock.guard() for lock in self._guards]
            answer = self._client.call_transaction(
                {"operations": [], "requiredLeases": [], "kv": guards + self._ops})
            if answer.get("success") or answer.get("reason") != "kv_precondition":
                return answer
            index = int(answer.get("failedIndex", -1))
            if not 0 <= index < len(guards):
                return answer
            lock = self._guards[index]
            if not self._renewed_underneath(lock, answer, guards[index]["expect"]):
                lock.mark_lost("guard")
                return answer
        return answer

    @staticmethod
    def _renewed_underneath(lock: Lock, answer: Result, sent_token: int) -> bool:
        value = answer.get("value")
        mine = isinstance(value, dict) and value.get("owner") == lock.owner
        if answer.get("kvReason") != "version" or not mine:
            return False
        lock.await_renewal()  # let an in-flight renew land, then read the new token
        return lock.held and lock.token != sent_token

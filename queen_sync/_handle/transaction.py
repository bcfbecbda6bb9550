"""``q.transaction()``: writes, pushes, acks and timers that commit together, guarded by locks.

Guards go first in the KV rider. When a guard loses only because the lock's own
renewer changed the token in between (the row is still this handle's), nothing
committed, so the bundle is sent again with the new token. Any other lost guard
marks the lock lost (``guard``) and the failed answer is returned, not raised; every
other failure raises. Queue pushes, acks and timers exist only on a Queen broker;
their shapes are in ``queue_ops``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional

from typing_extensions import Concatenate, ParamSpec

from .._durations import Duration
from .._errors import (
    EngineError,
    LockNotHeldError,
    RequestError,
    UnsupportedOperationError,
)
from .._process import ProcessBound, forks
from .._results import Result
from . import queue_ops
from .kv import KvOpBuilders
from .lock import Lock

if TYPE_CHECKING:
    from .caller import Caller

P = ParamSpec("P")
_GUARD_ATTEMPTS = 4
_Rebuild = Optional[Callable[[], dict[str, Any]]]


def _appending(build: Callable[P, dict[str, Any]]
               ) -> Callable[Concatenate[_BundleKv, P], Transaction]:
    """A bundle method taking exactly the builder's arguments, appending the op it builds."""

    def add(self: _BundleKv, /, *args: P.args, **kwargs: P.kwargs) -> Transaction:
        return self._txn._add(build(*args, **kwargs), _rebuilder(build, *args, **kwargs))

    add.__name__, add.__doc__ = build.__name__, build.__doc__
    return add


def _rebuilder(build: Callable[P, dict[str, Any]], *args: P.args, **kwargs: P.kwargs
               ) -> _Rebuild:
    """Builds the op again at send time when its expiry is an instant (``until=``).

    The lifetime sent is what is left of it when the bundle goes out, not when the op
    was added; every other expiry is already a duration and does not age.
    """
    if kwargs.get("until") is None:
        return None
    return lambda: build(*args, **kwargs)


class _BundleKv:
    """``transaction().kv``: the writes and keyed reads of ``q.kv``, appended to the bundle.

    A read answers in the commit's ``kv`` list, as of its place in the bundle; it never
    fails the bundle, and it counts as one op in ``failedIndex``.
    """

    def __init__(self, txn: Transaction) -> None:
        self._txn = txn

    # The keywords are the builders' own (one list of them), so a typo fails type checks.
    get = _appending(KvOpBuilders.get)
    get_many = _appending(KvOpBuilders.get_many)
    put = _appending(KvOpBuilders.put)
    put_if_absent = _appending(KvOpBuilders.put_if_absent)
    delete = _appending(KvOpBuilders.delete)
    incr = _appending(KvOpBuilders.incr)

    def check(self, ns: str, key: str, *, expect: int, required: bool = True) -> Transaction:
        return self._txn._add(KvOpBuilders.check(ns, key, expect=expect, required=required),
                              None)

    def get_prefix(self, *_: Any, **__: Any) -> Transaction:
        """Refused: a prefix read's cost is not bounded by the caller, and a bundle holds
        the lock rows while it runs (the broker refuses it too)."""
        raise ValueError("get_prefix cannot go inside a transaction: its cost is unbounded; "
                         "read with q.kv.get_prefix first, or name the keys with get_many")


class _BundleQueue:
    """``transaction().queue(queue_name)``: ``.partition(p)`` then ``.push(items)``."""

    def __init__(self, txn: Transaction, queue_name: str) -> None:
        self._txn = txn
        self._name = queue_ops.check_text(queue_name, "queue name")
        self._partition: Optional[str] = None

    def partition(self, partition_key: str) -> _BundleQueue:
        self._partition = queue_ops.check_text(partition_key, "partition")
        return self

    def push(self, items: Any) -> Transaction:
        """Push ``items`` (a dict or a list of dicts) when the bundle commits.

        Each item's message is its ``data`` (else its ``payload``, else the dict itself);
        its ``transactionId`` is minted now when it has none, so a resent bundle carries
        the same ids.
        """
        return self._txn._add_operations([queue_ops.push_op(self._name, self._partition, items)])


class _BundleTimer:
    """``transaction().timer(queue)``: ``.key(k).payload(p).after_ms(n)`` then ``.schedule()``."""

    def __init__(self, txn: Transaction, queue: str) -> None:
        self._txn = txn
        self._queue = queue_ops.check_text(queue, "timer queue")
        self._key: Optional[str] = None
        self._payload: Any = None
        self._has_payload = False
        self._zstd = False
        self._delay_ms: Any = None
        self._delay: Any = None
        self._partition: Optional[str] = None
        self._id: Optional[str] = None

    def key(self, timer_key: str) -> _BundleTimer:
        self._key = queue_ops.check_text(timer_key, "timer key")
        return self

    def payload(self, payload: Any, *, zstd: bool = False) -> _BundleTimer:
        self._payload, self._has_payload, self._zstd = payload, True, bool(zstd)
        return self

    def after_ms(self, delay_ms: float) -> _BundleTimer:
        self._delay_ms = delay_ms
        return self

    def after(self, delay: timedelta) -> _BundleTimer:
        self._delay = delay
        return self

    def partition(self, partition: str) -> _BundleTimer:
        self._partition = queue_ops.check_text(partition, "partition")
        return self

    def txn(self, txn: str) -> _BundleTimer:
        self._id = queue_ops.check_text(txn, "txn")
        return self

    def schedule(self) -> Transaction:
        """Schedule the timer when the bundle commits (its delay counts from then)."""
        return self._txn._add_timer(self._op(reschedule=False))

    def reschedule(self) -> Transaction:
        """The same upsert as ``schedule``: a new timer under an existing key."""
        return self._txn._add_timer(self._op(reschedule=True))

    def cancel(self) -> Transaction:
        """Cancel the timer when the bundle commits."""
        return self._txn._add_timer(queue_ops.cancel_op(self._queue, self._key, txn=self._id))

    def _op(self, *, reschedule: bool) -> dict[str, Any]:
        if not self._has_payload:
            raise ValueError("a timer needs .payload(<data>)")
        return queue_ops.timer_op(self._queue, self._key, self._payload, delay_ms=self._delay_ms,
                                  delay=self._delay, partition=self._partition, txn=self._id,
                                  zstd=self._zstd, reschedule=reschedule)


class Transaction(ProcessBound):
    """A bundle of guarded KV writes, queue pushes, acks and timers; build it, then ``commit()``.

    Queue riders (``queue``, ``ack``, ``timer``) exist only on a Queen broker; on the
    embedded engines they raise ``UnsupportedOperationError`` when added.

    A bundle commits at most once: after a commit that applied it, or whose answer never
    came (a lost connection or an interrupt while it waited: it may have applied),
    committing it again or adding to it raises ``RequestError`` (``code ==
    "transaction_spent"``). A bundle that lost a precondition, or that the engine refused,
    applied nothing and may be committed again. A bundle belongs to the process that
    built it (``transaction_forked`` in a child).
    """

    _remake = "build another with q.transaction()"

    def __init__(self, client: Caller) -> None:
        self._client = client
        self._guards: list[Lock] = []
        self._operations: list[dict[str, Any]] = []
        self._leases: list[str] = []
        self._kv: list[tuple[dict[str, Any], _Rebuild]] = []
        self._timers: list[dict[str, Any]] = []
        # Held by a commit from its checks to its answer: a second thread's commit or add
        # waits, then finds the bundle spent rather than sending it again. Re-entrant, so
        # a signal handler on the holding thread is answered instead of waiting for itself.
        self._committing = threading.RLock()
        self._inside = 0  # calls of this bundle under way on the thread holding the lock
        self._generation = forks.generation
        self._spent: Optional[str] = None  # why it may not be sent again, once it is spent
        self.kv = _BundleKv(self)

    @contextlib.contextmanager
    def _alone(self) -> Iterator[None]:
        """This bundle to this call alone, refusing calls that waiting would never serve."""
        if self._generation != forks.generation:
            # Its parent may send it too (or was sending it at the fork, holding the lock).
            raise RequestError("this transaction was built in the parent process before "
                               "fork(): the parent may commit it too; build another with "
                               "q.transaction() in this process", code="transaction_forked")
        with self._committing:
            if self._inside:
                # A signal handler on the thread whose call it interrupted: that call
                # cannot go on until the handler returns.
                raise RequestError("this transaction is in use by this thread (called from "
                                   "a signal handler?): its outcome is not known yet",
                                   code="transaction_in_progress")
            self._inside += 1
            try:
                # Checked after counting: a handler that ran before it finds this call
                # under way, and a bundle it committed is found spent here.
                if self._spent is not None:
                    raise RequestError(f"this transaction {self._spent}: a bundle commits "
                                       "at most once; build another with q.transaction()",
                                       code="transaction_spent")
                yield
            finally:
                self._inside -= 1

    def _add(self, op: dict[str, Any], rebuild: _Rebuild = None) -> Transaction:
        with self._alone():
            self._kv.append((op, rebuild))
        return self

    def _add_operations(self, ops: list[dict[str, Any]]) -> Transaction:
        with self._alone():
            self._operations.extend(ops)
            self._leases.extend(op["leaseId"] for op in ops if "leaseId" in op)
        return self

    def _add_timer(self, op: dict[str, Any]) -> Transaction:
        with self._alone():
            self._timers.append(op)
        return self

    def _require_queues(self) -> None:
        engine = self._client.engine
        if not engine.capabilities.queue_operations:
            raise UnsupportedOperationError(
                f"the {engine.kind} engine cannot carry queue pushes, acks or timers: they "
                "exist only on a Queen broker (an http:// or https:// URL); its transactions "
                "are KV-only", capability="queue_operations")

    def queue(self, queue_name: str) -> _BundleQueue:
        """Push to ``queue_name`` in this bundle: ``.queue(q)[.partition(p)].push(items)``.

        Raises:
            UnsupportedOperationError: the engine is not a Queen broker.
        """
        self._require_queues()
        return _BundleQueue(self, queue_name)

    def ack(self, messages: Any, status: str = "completed",
            context: Optional[Mapping[str, Any]] = None) -> Transaction:
        """Ack ``messages`` (one message dict as popped, or a list) when the bundle commits.

        Each needs its ``transactionId`` (or ``id``) and ``partitionId``; a ``leaseId`` is
        sent with the ack and among the bundle's required leases. ``context`` takes
        ``consumer_group`` only.

        Raises:
            UnsupportedOperationError: the engine is not a Queen broker.
        """
        self._require_queues()
        return self._add_operations(queue_ops.ack_ops(messages, status, context))

    def timer(self, queue: str) -> _BundleTimer:
        """Schedule, reschedule or cancel a timer of ``queue`` in this bundle.

        Raises:
            UnsupportedOperationError: the engine is not a Queen broker.
        """
        self._require_queues()
        return _BundleTimer(self, queue)

    def guard(self, lock: Lock) -> Transaction:
        """Commit only while ``lock`` is held by this handle at its current token.

        Raises:
            TypeError: ``lock`` is not a lock or semaphore handle (a name is not enough:
                the guard is this handle's token, read at commit).
            RequestError: ``lock`` is a handle of another store (``code ==
                "guard_other_store"``): its token could match a permit there by chance.
            EngineError: a PostgreSQL client that has not connected yet could not read
                its store's identity (it connects for it, within its connect timeout).
        """
        if not isinstance(lock, Lock):
            raise TypeError(f"guard takes a Lock (from q.lock() or q.semaphore()), "
                            f"got {type(lock).__name__}")
        if lock.store != self._client.engine.store:
            raise RequestError(
                f"cannot guard with lock {lock.name!r}: it is a lease of another store "
                f"({lock.engine_url}) than this transaction's ({self._client.url})",
                code="guard_other_store")
        with self._alone():
            self._guards.append(lock)
        return self

    def once(self, ns: str, key: str, *, value: Any = True, ttl: Optional[Duration] = None,
             ttl_seconds: Optional[int] = None, until: Optional[datetime] = None,
             forever: bool = False) -> Transaction:
        """A required ``putIfAbsent``: the bundle commits only once within the lifetime."""
        build = KvOpBuilders.put_if_absent
        return self._add(
            build(ns, key, value, ttl=ttl, ttl_seconds=ttl_seconds, until=until,
                  forever=forever, required=True),
            _rebuilder(build, ns, key, value, ttl=ttl, ttl_seconds=ttl_seconds, until=until,
                       forever=forever, required=True))

    def commit(self) -> Result:
        """Send the bundle; a lost precondition is RETURNED (a falsy result), not raised.

        Raises:
            RequestError: the bundle is empty (``code == "empty_transaction"``), or the
                engine refused it for another reason than a lost precondition (``code``
                is the engine's error, e.g. an ack whose lease is over).
            LockNotHeldError: a guard's lock is not held by its handle.
            RequestError: the bundle is spent (``code == "transaction_spent"``): it was
                committed, or its commit ended without an answer and may have applied.
        """
        with self._alone():
            return self._commit_once()

    def _commit_once(self) -> Result:
        if not (self._operations or self._kv or self._timers or self._guards):
            raise RequestError("this transaction has nothing to commit: add a write, a push, "
                               "an ack, a timer or a guard first", code="empty_transaction")
        for lock in self._guards:
            if not lock.held:
                raise LockNotHeldError(f"cannot guard with lock {lock.name!r}: not held",
                                       name=lock.name)
        answer = self._send()
        if answer.get("success"):
            return answer
        if answer.get("reason") == "kv_precondition":  # a lost precondition applied nothing
            return answer
        raise _refusal(answer)

    def _body(self, guards: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {"operations": list(self._operations),
                                "requiredLeases": list(dict.fromkeys(self._leases))}
        # Left out when unused, as the official client does: a bundle without riders
        # puts the same bytes on the wire as one from before riders existed.
        if guards or self._kv:
            body["kv"] = guards + [rebuild() if rebuild else op for op, rebuild in self._kv]
        if self._timers:
            body["timers"] = list(self._timers)
        return body

    def _send(self) -> Result:
        answer = Result()
        for _ in range(_GUARD_ATTEMPTS):
            guards = [lock.guard() for lock in self._guards]
            answer = self._sent_once(self._body(guards))
            if answer.get("success") or answer.get("reason") != "kv_precondition":
                return answer
            at = self._failed_guard(answer)
            if at is None:
                return answer
            lock = self._guards[at]
            if not self._renewed_underneath(lock, answer, guards[at]["expect"]):
                lock.mark_lost("guard")
                return answer
        return answer

    def _sent_once(self, body: dict[str, Any]) -> Result:
        """The engine's answer to ``body``; the bundle is spent unless it says nothing applied.

        Without an answer (a lost connection, Ctrl-C, a signal's exception while waiting)
        it may have landed, and sent again it could apply twice. A refusal applied nothing.
        """
        self._spent = "was sent and its answer never came, so it may have applied"
        try:
            answer = self._client.call_transaction(body)
        except RequestError:  # refused as malformed (a broker's 400 too): nothing applied
            self._spent = None
            raise
        except EngineError as exc:
            if exc.applied is False:  # the engine says nothing of it was written
                self._spent = None
            raise
        self._spent = "is already committed" if answer.get("success") else None
        return answer

    def _failed_guard(self, answer: Result) -> Optional[int]:
        """Which guard lost, if one did: ``failedIndex`` counts items and acks first."""
        index = answer.get("failedIndex")
        if isinstance(index, bool) or not isinstance(index, int):
            return None
        at = index - queue_ops.flat_count(self._operations)
        return at if 0 <= at < len(self._guards) else None

    @staticmethod
    def _renewed_underneath(lock: Lock, answer: Result, sent_token: int) -> bool:
        """Whether the guard lost only to this handle's own renewal, now caught up with."""
        value = answer.get("value")
        mine = isinstance(value, dict) and value.get("owner") == lock.owner
        if answer.get("kvReason") != "version" or not mine:
            return False
        lock.await_renewal()  # let an in-flight renew land, then read the new token
        if lock.held and lock.token == sent_token:
            # Still this owner's row, moved by a late duplicate of an answered renew (a
            # resend over HTTP): renewing from the token held mints one the row is at.
            lock.renew()
        return lock.held and lock.token != sent_token


def _refusal(answer: Result) -> RequestError:
    """The error for a bundle the engine refused without naming a lost precondition."""
    code = answer.get("error") or answer.get("reason")
    code = code if isinstance(code, str) and code else "transaction_failed"
    detail = answer.get("detail")
    told = f": {detail}" if isinstance(detail, str) and detail else ""
    return RequestError(f"the engine refused the transaction ({code}){told}", code=code,
                        answer=dict(answer))

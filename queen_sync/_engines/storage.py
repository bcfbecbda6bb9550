"""The storage interface the embedded engines share.

The lock and key/value semantics (``embedded``) are written once over this
small interface; SQLite and PostgreSQL each provide it. A storage transaction is
one atomic step: everything read and written inside ``Storage.transaction()``
commits together or not at all, and no other writer interleaves (SQLite's
``BEGIN IMMEDIATE``; PostgreSQL row locks plus advisory locks on what the body touches).

The semantics validate a body before it runs, so they say what it touches (its
``Footprint``): PostgreSQL locks and prefetches exactly that, SQLite, whose file lock
covers everything, ignores it. Expiry has one contract: ``read`` and ``read_prefix``
both answer live rows only, judged at the ``now_ms`` the semantics pass, which is the
one instant the whole step is judged at.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, TypeVar

T = TypeVar("T")


# Slots: a renewal pass builds thousands, and each without a ``__dict__`` is one object
# the garbage collector tracks instead of two.
@dataclass(slots=True)
class Row:
    """One stored key. ``version`` is the store-wide counter value of its last write.

    Times are epoch milliseconds on the engine's clock; ``expires_at`` is ``None``
    for a row written ``forever``. ``prev_version`` is the token the last renew
    presented, kept so an owner's resent renew, and a release with that token, are
    recognised.
    """

    ns: str
    key: str
    value: Any
    version: int
    expires_at: Optional[int]
    created_at: int
    updated_at: int
    prev_version: Optional[int] = None

    def live_at(self, now_ms: int) -> bool:
        return self.expires_at is None or self.expires_at > now_ms


# Not frozen: a frozen dataclass sets each field through ``object.__setattr__``, which
# costs more than the rest of a lone lock call's bookkeeping; nothing writes one after.
@dataclass(slots=True)
class Footprint:
    """What one body touches, read off its validated operations before it runs.

    Attributes:
        names: the lock names whose permits its lock operations read or write.
        keys: the ``(namespace, key)`` pairs its key/value operations name (a prefix
            scan names none: it is reached while the body runs).
        mints: at most how many new versions it draws (acquires, renews, writes).
        only_releases: it is a locks body of releases alone, so losing its commit in a
            crash would only let the leases run out.
        operations: how many operations it holds (named in errors its size may cause).
        lone_lock_op: the body's operation when it is one lock operation, so a storage
            may answer it in one statement (the semantics still shape the answer).
        lock_ops: a locks body's validated operations, so a storage may answer a body
            of one kind (renews) in one statement per transaction (the semantics check it).
    """

    names: frozenset[str] = frozenset()
    keys: frozenset[tuple[str, str]] = frozenset()
    mints: int = 0
    only_releases: bool = False
    operations: int = 0
    lone_lock_op: Optional[Mapping[str, Any]] = field(default=None, compare=False)
    lock_ops: Sequence[Mapping[str, Any]] = field(default=(), compare=False)


def prefix_end(prefix: str) -> Optional[str]:
    """The least string above every string starting with ``prefix``, in code point order.

    Keys starting with ``prefix`` are exactly those in ``[prefix, prefix_end(prefix))``,
    so a prefix read is one bounded range of the key index (``None``: no upper bound).
    SQLite's binary collation and PostgreSQL's ``C`` collation both order by code point.
    """
    # Nearly always the last character just moves up one: every acquire reads a range.
    last = ord(prefix[-1]) + 1 if prefix else 0
    if last not in (0, 0xD800) and last <= 0x10FFFF:
        return prefix[:-1] + chr(last)
    chars = list(prefix)
    while chars:
        last = ord(chars.pop()) + 1
        if last == 0xD800:
            last = 0xE000  # surrogates cannot be stored in text
        if last <= 0x10FFFF:
            return "".join(chars) + chr(last)
    return None


class StorageTxn(Protocol):
    """What the semantics may do inside one atomic step.

    A transaction may also offer ``delete_live_at(ns, key, token, *, now_ms) -> bool``:
    delete the row if it is live at ``now_ms`` and ``token`` is its version or its
    ``prev_version``, answering whether it did. A release naming its slot then costs
    one statement instead of a read and a delete; without it the same rule reads first.

    And ``restamp(row) -> None``: store ``row``, a renewal of the row this step read at its
    key, which it changes only in ``version``, ``expires_at``, ``updated_at`` and
    ``prev_version``; the storage may leave the stored value as it is. Without it, the
    semantics ``write`` the row whole (``restamper``).
    """

    def now_ms(self) -> int:
        """The engine's clock, read once per step by the semantics."""

    def read(self, ns: str, key: str, *, now_ms: int) -> Optional[Row]:
        """The row at ``(ns, key)`` if it is live at ``now_ms``, else ``None``."""

    def read_prefix(
        self, ns: str, prefix: str, *, after: Optional[str], limit: int, now_ms: int
    ) -> Sequence[Row]:
        """Rows live at ``now_ms`` whose key starts with ``prefix`` (literally), after ``after``,
        in key order, at most ``limit`` of them."""

    def write(self, row: Row) -> None:
        """Insert or replace the row at ``(row.ns, row.key)``, expired or not."""

    def delete(self, ns: str, key: str) -> None:
        """Remove the row if present."""

    def freed(self, name: str) -> None:
        """A permit of lock ``name`` is freed by this step: wake its waiters once it commits."""

    def next_version(self) -> int:
        """Advance the store-wide high-water mark and return it; it never rewinds."""


def restamper(txn: StorageTxn) -> Callable[[Row], None]:
    """How ``txn`` stores a renewal: its ``restamp`` if it offers one, else its ``write``."""
    restamp: Optional[Callable[[Row], None]] = getattr(txn, "restamp", None)
    return txn.write if restamp is None else restamp


class Storage(Protocol):
    """A store of rows, opened once per client."""

    def transaction(self, footprint: Footprint, work: Callable[[StorageTxn], T]) -> T:
        """Run ``work`` as one atomic step and return what it returns.

        An exception from ``work`` rolls everything back and propagates. The storage may
        run ``work`` again from scratch on a new transaction (a lost race, a connection
        lost before COMMIT), so ``work`` acts on the store through its ``StorageTxn`` only.
        """

    def close(self) -> None:
        """Release the store's resources."""

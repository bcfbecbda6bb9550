"""The storage interface the embedded engines share.

The lock and key/value semantics (``_semantics``) are written once over this
small interface; SQLite and PostgreSQL each provide it. A storage transaction is
one atomic step: everything read and written inside ``Storage.transaction()``
commits together or not at all, and no other writer interleaves (SQLite's
``BEGIN IMMEDIATE``; PostgreSQL row locks plus a serialising advisory lock).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ContextManager, Optional, Protocol, Sequence


@dataclass
class Row:
    """One stored key. ``version`` is the store-wide counter value of its last write.

    Times are epoch milliseconds on the engine's clock; ``expires_at`` is ``None``
    for a row written ``forever``. ``prev_version`` is the version the row had
    before its last renew, kept so an owner's resent renew can be recognised.
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


class StorageConflict(Exception):
    """Raised by a storage write that lost a race it cannot wait out (answered as ``contended``)."""


class StorageTxn(Protocol):
    """What the semantics may do inside one atomic step."""

    def now_ms(self) -> int:
        """The engine's clock, read once per operation by the caller."""

    def read(self, ns: str, key: str) -> Optional[Row]:
        """The stored row, expired or not (the semantics judge expiry)."""

    def read_prefix(
        self, ns: str, prefix: str, *, after: Optional[str], limit: int, now_ms: int
    ) -> Sequence[Row]:
        """Live rows whose key starts with ``prefix`` (literally), after ``after``, in key order."""

    def write(self, row: Row) -> None:
        """Insert or replace the row at ``(row.ns, row.key)``."""

    def delete(self, ns: str, key: str) -> None:
        """Remove the row if present."""

    def next_version(self) -> int:
        """Advance the store-wide high-water mark and return it; it never rewinds."""


class Storage(Protocol):
    """A store of rows, opened once per client."""

    def transaction(self) -> ContextManager[StorageTxn]:
        """One atomic step; an exception inside rolls everything back and propagates."""

    def notify_released(self, names: Sequence[str]) -> None:
        """Wake waiters on these lock names (called after a commit that freed a permit)."""

    def close(self) -> None:
        """Release the store's resources."""

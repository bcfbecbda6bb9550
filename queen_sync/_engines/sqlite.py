"""The embedded default: one SQLite file shared by many processes on one machine.

WAL mode with a busy timeout, every call one ``BEGIN IMMEDIATE`` transaction (a lone
release is one guarded DELETE, its own transaction), so writers queue on the file lock
instead of racing. The store-wide version counter lives in its own row and only ever
rises, so tokens outlive every release, expiry, deletion and reopening of the file; a
step drawing many versions moves it once and stores where it reached at commit. With
``synchronous=NORMAL`` (the default) a process crash loses nothing; an OS crash or power
cut may lose the last commits, counter included: use ``?synchronous=full`` when a fence must
survive that.

POSIX drops every lock a process holds on a file when ANY descriptor of it is closed,
those SQLite holds for other clients of the file included, and a neighbour that then
finds no lock believes itself the last user and deletes the live WAL. So this process
opens an existing file with a descriptor of its own only as the anchor of its first
connection there, closed after its last (``sqlite_files.anchor_store``). For the same reason no
connection stays open across ``fork()`` (see ``_before_fork``). A client remembers which
file (device, inode) and which ``-wal`` and ``-shm`` it opened and refuses to go on with
others, and it refuses files another user could change (``sqlite_files``).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
import logging
import math
import os
import sqlite3
import tempfile
import threading
import time
import weakref
from typing import (
    Any,
    Callable,
    ClassVar,
    Iterator,
    Mapping,
    NoReturn,
    Optional,
    Sequence,
    TypeVar,
)
from urllib.parse import parse_qsl, unquote, urlsplit

from .._errors import (
    EngineError,
    EngineUnavailableError,
    RequestError,
    StoreReplacedError,
    UnsupportedOperationError,
)
from .._ops import LOCKS_NS, permit_key
from .base import Capabilities, Engine, Waiter, redact_url_for_error
from .embedded import EmbeddedSemantics
from .sqlite_files import (
    FileKey,
    SideFiles,
    anchor_store,
    changed_side_file,
    claim_side_files,
    refuse_moved_files,
    refuse_unsafe_store,
    release_anchor,
    side_files,
)
from .sqlite_wake import WakeChannel
from .storage import Footprint, Row, StorageTxn, prefix_end

log = logging.getLogger("queen_sync")

NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb", "smb2", "smb3", "smbfs", "ncpfs", "afs", "9p", "ceph",
    "glusterfs", "fuse.glusterfs", "lustre", "gpfs", "fuse.sshfs", "fuse.s3fs", "davfs",
    "fuse.rclone", "fuse.gcsfuse", "fuse.juicefs", "beegfs", "ocfs2", "gfs2",
})

_SCHEMA = """
CREATE TABLE IF NOT EXISTS queen_kv (
    ns TEXT NOT NULL,
    key TEXT NOT NULL,
    value TEXT NOT NULL,
    version INTEGER NOT NULL,
    expires_at INTEGER,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL,
    prev_version INTEGER,
    PRIMARY KEY (ns, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS queen_kv_value_expiry ON queen_kv (expires_at)
    WHERE expires_at IS NOT NULL AND ns <> '{locks}';
DROP INDEX IF EXISTS queen_kv_expiry;
CREATE TABLE IF NOT EXISTS queen_meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO queen_meta (name, value) VALUES ('version', 0);
""".replace("{locks}", LOCKS_NS)
# Every acquire, renew and release rewrites its permit's expiry, so an index over the
# permits' expiry costs each of them one more page: values keep theirs, and expired permits
# are swept by walking the locks' keys (``_SqliteTxn.sweep``). Stores made with the old
# index over every row lose it at their first opening by a client of this schema.
_SCHEMA_OBJECTS = ("queen_kv", "queen_kv_value_expiry", "queen_meta")
_OLD_INDEX = "queen_kv_expiry"
_SWEPT_PER_PASS = 256
SWEEP_VALUES = (
    "DELETE FROM queen_kv WHERE (ns, key) IN (SELECT ns, key FROM queen_kv"
    f" WHERE expires_at IS NOT NULL AND ns <> '{LOCKS_NS}' AND expires_at <= ?"
    f" LIMIT {_SWEPT_PER_PASS})")
_PERMITS_WINDOW_END = (
    "SELECT key FROM queen_kv WHERE ns = ? AND key > ? ORDER BY key"
    f" LIMIT 1 OFFSET {_SWEPT_PER_PASS - 1}")
_SWEEP_PERMITS_TO = ("DELETE FROM queen_kv WHERE ns = ? AND key > ? AND key <= ?"
                     " AND expires_at <= ?")
_SWEEP_PERMITS_TO_THE_END = "DELETE FROM queen_kv WHERE ns = ? AND key > ? AND expires_at <= ?"
_COLUMNS = "ns, key, value, version, expires_at, created_at, updated_at, prev_version"
_SWEEP_EVERY = 512
# Seconds close() waits for a call in flight to free the connection before it leaves the
# closing to a thread of its own: the client's budget may be spent already.
_CLOSE_WAIT = 0.2
# SQLite's own busy wait, per try, before a call gives the mutex up for a moment: a call
# waiting out another process's write must not keep a fork, or close(), of this process
# waiting behind it for the whole busy timeout.
_BUSY_SLICE = 0.05
_BUSY_PAUSE = 0.001  # between two tries, with the mutex free
_RETURNING = sqlite3.sqlite_version_info >= (3, 35, 0)  # UPDATE ... RETURNING, one statement
_T = TypeVar("_T")
# Made once: ``json.dumps`` with separators builds a new encoder at every call.
_encoder = json.JSONEncoder(separators=(",", ":"))
_encode = _encoder.encode
# ``encode`` builds its C encoder anew at every call; this one is built once. Without the
# circular-reference table it keeps no state between calls (a circular value overflows it).
_make_encoder = getattr(json.encoder, "c_make_encoder", None)  # None without the C module
_encode_fast = None if _make_encoder is None else _make_encoder(
    None, _encoder.default, json.encoder.encode_basestring_ascii, None, ":", ",", False, False,
    True)
_decode = json.JSONDecoder().decode
# The decoder's own scanner (typeshed does not declare the attribute every decoder has).
_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]
_SLOT_OPS = frozenset({"renew", "release"})
_KEYS_PER_READ = 500  # bound parameters per read of a batch's rows, below every SQLite's limit

# Held while this process creates a database file or opens a connection, so a new file's
# creating descriptor is closed before any connection of this process can lock that file.
_OPENING = threading.Lock()
# Held while a new storage connects and joins ``_LIVE``, so a fork sees every connection.
_REGISTERING = threading.Lock()
_get_ident = threading.get_ident


class _Holders:
    """Which thread holds ``_OPENING`` and ``_REGISTERING`` (None: none, as far as known).

    A fork from a signal handler runs in a thread that may hold either: waiting for it
    would never end.
    """

    opening: Optional[int] = None
    registering: Optional[int] = None


# A prefix read's statement by (resuming after a key, bounded above): made once, not per read.
_PREFIX_READS = {
    (resumed, bounded): f"SELECT {_COLUMNS} FROM queen_kv WHERE ns = ? AND key "
                        f"{'>' if resumed else '>='} ?{' AND key < ?' if bounded else ''}"
                        " AND (expires_at IS NULL OR expires_at > ?) ORDER BY key LIMIT ?"
    for resumed in (False, True) for bounded in (False, True)
}


def _identity(path: str) -> tuple[int, int, int]:
    """The file at ``path``: device, inode, and how many names it has."""
    info = os.stat(path)
    return info.st_dev, info.st_ino, info.st_nlink


def _encoded(value: Any) -> str:
    """``value`` as stored: the text ``_encode`` makes, made with the encoder built once."""
    if _encode_fast is None or isinstance(value, str):
        return _encode(value)
    try:
        return "".join(_encode_fast(value, 0))
    except Exception:  # whatever failed, ``_encode`` raises its own error for it
        return _encode(value)


def _decoded(text: str) -> Any:
    """A stored value. Nearly every text is this module's compact encoding, which the scanner
    reads whole without ``decode``'s two whitespace matches; any other text takes ``decode``."""
    try:
        value, end = _scan(text, 0)
    except StopIteration:
        return _decode(text)  # raises the error a malformed text deserves
    return value if end == len(text) else _decode(text)


def _row(record: Sequence[Any]) -> Row:
    ns, key, value, version, expires_at, created_at, updated_at, prev = record
    return Row(ns, key, _decoded(value), version, expires_at, created_at, updated_at, prev)


def _slot_keys(footprint: Footprint) -> list[str]:
    """The permit keys a batch's renews and releases name by slot, each once, in body order."""
    ops = footprint.lock_ops
    if len(ops) < 2:
        return []  # a lone op reads its one row as it goes
    keys = {permit_key(op["name"], op["slot"]): None for op in ops
            if "slot" in op and op["op"] in _SLOT_OPS}
    return list(keys)


def _read_keys(count: int) -> str:
    return f"SELECT {_COLUMNS} FROM queen_kv WHERE ns = ? AND key IN ({', '.join('?' * count)})"


class _SqliteTxn:
    def __init__(self, conn: sqlite3.Connection, clock: Callable[[], float]) -> None:
        self._conn = conn
        self._clock = clock
        self.freed_names: set[str] = set()
        self._drawn = 0  # the last version this step handed out; 0 before its first draw
        self._stored = 0  # what the counter's row holds inside this step

    def now_ms(self) -> int:
        return int(self._clock() * 1000)

    def read(self, ns: str, key: str, *, now_ms: int) -> Optional[Row]:
        record = self._conn.execute(
            f"SELECT {_COLUMNS} FROM queen_kv WHERE ns = ? AND key = ?"
            " AND (expires_at IS NULL OR expires_at > ?)", (ns, key, now_ms)
        ).fetchone()
        return _row(record) if record else None

    def read_prefix(
        self, ns: str, prefix: str, *, after: Optional[str], limit: int, now_ms: int
    ) -> Sequence[Row]:
        # One bounded range of the primary key: the rows of this prefix and no others.
        end = prefix_end(prefix)
        resumed = after is not None and after >= prefix
        start = after if resumed else prefix
        records = self._conn.execute(
            _PREFIX_READS[resumed, end is not None],
            (ns, start, now_ms, limit) if end is None else (ns, start, end, now_ms, limit),
        ).fetchall()
        return [_row(r) for r in records]

    def write(self, row: Row) -> None:
        self._conn.execute(
            f"INSERT OR REPLACE INTO queen_kv ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (row.ns, row.key, _encoded(row.value), row.version,
             row.expires_at, row.created_at, row.updated_at, row.prev_version),
        )

    def restamp(self, row: Row) -> None:
        """Store a renewal of the row read at its key in this step: its value is unchanged,
        so its stored text is left as it is, not encoded again."""
        if self._conn.execute(
            "UPDATE queen_kv SET version = ?, expires_at = ?, updated_at = ?, prev_version = ?"
            " WHERE ns = ? AND key = ?",
            (row.version, row.expires_at, row.updated_at, row.prev_version, row.ns, row.key),
        ).rowcount != 1:
            self.write(row)  # not there after all: the whole row, as ``write`` stores it

    def delete(self, ns: str, key: str) -> None:
        self._conn.execute("DELETE FROM queen_kv WHERE ns = ? AND key = ?", (ns, key))

    def freed(self, name: str) -> None:
        self.freed_names.add(name)

    def next_version(self) -> int:
        # The step holds the file's write lock, so nobody else draws until it ends: its first
        # draw moves the stored counter, later ones count on in memory, and ``commit`` stores
        # where they reached in the same transaction (a rollback undoes both, and then no
        # version of it was answered).
        if self._drawn:
            self._drawn += 1
            return self._drawn
        if _RETURNING:  # a lone acquire's one draw: one statement, no more
            (value,) = self._conn.execute(
                "UPDATE queen_meta SET value = value + 1 WHERE name = 'version' RETURNING value"
            ).fetchone()
            self._drawn = self._stored = int(value)
        else:
            self._drawn = self._stored = self._bump()
        return self._drawn

    def _bump(self) -> int:
        """The counter moved up one and read back, on an SQLite without RETURNING."""
        self._conn.execute("UPDATE queen_meta SET value = value + 1 WHERE name = 'version'")
        (value,) = self._conn.execute(
            "SELECT value FROM queen_meta WHERE name = 'version'"
        ).fetchone()
        return int(value)

    def _store_counter(self) -> None:
        """Write the last version drawn, guarded: a counter moved by anyone else inside this
        step would mean two steps drew at once, so nothing of it may commit."""
        if self._conn.execute(
            "UPDATE queen_meta SET value = ? WHERE name = 'version' AND value = ?",
            (self._drawn, self._stored),
        ).rowcount != 1:
            raise EngineError("the version counter of this SQLite database moved while a "
                              "step held its write lock; nothing of the step was written")
        self._stored = self._drawn

    def commit(self) -> None:
        if self._drawn != self._stored:
            self._store_counter()
        self._conn.execute("COMMIT")

    def sweep(self, now_ms: int, permits_after: str) -> str:
        """Delete expired values, and the expired permits of the next window of lock keys
        after ``permits_after``; where the next window begins ("" once past the last)."""
        conn = self._conn
        conn.execute(SWEEP_VALUES, (now_ms,))
        end = conn.execute(_PERMITS_WINDOW_END, (LOCKS_NS, permits_after)).fetchone()
        if end is None:
            conn.execute(_SWEEP_PERMITS_TO_THE_END, (LOCKS_NS, permits_after, now_ms))
            return ""
        conn.execute(_SWEEP_PERMITS_TO, (LOCKS_NS, permits_after, end[0], now_ms))
        return str(end[0])


class _LoneReleaseTxn(_SqliteTxn):
    """A lone release naming its slot: the semantics may delete its permit in one statement.

    Offered to a body of that one op only (a handle's every release): batches keep the
    general rule, and a test holds the two to the same answers and rows.
    """

    def delete_live_at(self, ns: str, key: str, token: int, *, now_ms: int) -> bool:
        """Delete the row at ``(ns, key)`` if it is live at ``now_ms`` and ``token`` is its
        version or its ``prev_version``; whether it did."""
        return self._conn.execute(
            "DELETE FROM queen_kv WHERE ns = ? AND key = ? AND (expires_at IS NULL OR "
            "expires_at > ?) AND (version = ? OR prev_version = ?)",
            (ns, key, now_ms, token, token)).rowcount == 1


class _BatchTxn(_SqliteTxn):
    """A batch naming slots (a renewer's tick, a client closing): the rows of those slots are
    read up front, a few statements for the whole body, and its reads of them answered
    from memory. Every write of the step passes through here and the step holds the
    write lock, so what is remembered stays what the file holds."""

    def __init__(self, conn: sqlite3.Connection, clock: Callable[[], float],
                 keys: Sequence[str]) -> None:
        super().__init__(conn, clock)
        rows: dict[str, Optional[Row]] = dict.fromkeys(keys)
        for start in range(0, len(keys), _KEYS_PER_READ):
            chunk = keys[start:start + _KEYS_PER_READ]
            for record in conn.execute(_read_keys(len(chunk)), (LOCKS_NS, *chunk)):
                rows[record[1]] = _row(record)
        self._rows = rows  # by key, in the permits' namespace; None: no row

    def read(self, ns: str, key: str, *, now_ms: int) -> Optional[Row]:
        if ns != LOCKS_NS or key not in self._rows:
            return super().read(ns, key, now_ms=now_ms)
        row = self._rows[key]
        return row if row is not None and row.live_at(now_ms) else None

    def write(self, row: Row) -> None:
        super().write(row)
        self._remember(row.ns, row.key, row)

    def restamp(self, row: Row) -> None:
        super().restamp(row)
        self._remember(row.ns, row.key, row)

    def delete(self, ns: str, key: str) -> None:
        super().delete(ns, key)
        self._remember(ns, key, None)

    def _remember(self, ns: str, key: str, row: Optional[Row]) -> None:
        if ns == LOCKS_NS and key in self._rows:
            self._rows[key] = row


class _NeedsWrite(Exception):
    """A step run read-only reached a write: it runs again, under the write lock."""


class _ReadOnlyTxn(_SqliteTxn):
    """A step that may only read: the first write it tries ends it (``_NeedsWrite``)."""

    def write(self, row: Row) -> None:
        raise _NeedsWrite

    def delete(self, ns: str, key: str) -> None:
        raise _NeedsWrite

    def freed(self, name: str) -> None:
        raise _NeedsWrite

    def next_version(self) -> int:
        raise _NeedsWrite

    def restamp(self, row: Row) -> None:
        raise _NeedsWrite


class _NeedsTransaction(Exception):
    """A step run as one statement reached another before it: it runs again, in a transaction."""


class _AloneTxn(_LoneReleaseTxn):
    """A lone release run outside a transaction: its one guarded DELETE commits by itself.

    Nothing else may run that way: any other statement, reached before the DELETE, ends the
    attempt (``_NeedsTransaction``, nothing written); reached after it, it is refused, as the
    DELETE has committed and the two would not be one step.
    """

    def __init__(self, conn: sqlite3.Connection, clock: Callable[[], float]) -> None:
        super().__init__(conn, clock)
        self._deleted = False

    def delete_live_at(self, ns: str, key: str, token: int, *, now_ms: int) -> bool:
        if self._deleted:
            self._refuse()
        self._deleted = True
        return super().delete_live_at(ns, key, token, now_ms=now_ms)

    def _refuse(self) -> NoReturn:
        if self._deleted:
            raise EngineError("an SQLite release reached a second statement after its DELETE "
                              "committed on its own; please report this")
        raise _NeedsTransaction

    def read(self, ns: str, key: str, *, now_ms: int) -> Optional[Row]:
        self._refuse()

    def read_prefix(self, ns: str, prefix: str, *, after: Optional[str], limit: int,
                    now_ms: int) -> Sequence[Row]:
        self._refuse()

    def write(self, row: Row) -> None:
        self._refuse()

    def restamp(self, row: Row) -> None:
        self._refuse()

    def delete(self, ns: str, key: str) -> None:
        self._refuse()

    def next_version(self) -> int:
        self._refuse()


class SqliteStorage:
    """``Storage`` over one SQLite file; one connection per process, used under a lock."""

    def __init__(
        self,
        path: str,
        *,
        busy_timeout: float = 30.0,
        synchronous: str = "normal",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self._busy_timeout = busy_timeout
        self._synchronous = synchronous
        self._clock = clock
        self._mutex = threading.Lock()
        self._closed = False
        self._calls = 0
        self._permits_swept_to = ""  # the lock key the next sweep's window starts after
        self._identity: Optional[tuple[int, int]] = None
        self._sides: SideFiles = ()
        self._anchor: Optional[FileKey] = None  # the file this client's connection anchors
        self._in_call: Optional[int] = None  # the thread inside a call, under the mutex
        with _REGISTERING:
            _Holders.registering = _get_ident()
            try:
                self._conn: Optional[sqlite3.Connection] = self._connect()
                _LIVE.add(self)
            finally:
                _Holders.registering = None
        self.wake = WakeChannel(os.path.realpath(path)) if WakeChannel.supported else None

    def _connect(self) -> sqlite3.Connection:
        self._safely(refuse_unsafe_store)
        # Switching a new file to WAL takes an exclusive lock, and SQLite answers "locked"
        # at once (without the busy handler) to a second opener racing for it, so retry.
        deadline = time.monotonic() + self._busy_timeout
        delay = 0.005
        with _translated(self.path):
            while True:
                try:
                    with _OPENING:
                        _Holders.opening = _get_ident()
                        try:
                            generation = _Fork.generation
                            conn = self._open_claimed()
                            _refuse_if_forked_since(generation, conn, self.path)
                        finally:
                            _Holders.opening = None
                    break
                except sqlite3.OperationalError as exc:
                    if "locked" not in str(exc) or time.monotonic() + delay > deadline:
                        raise
                time.sleep(delay)
                delay = min(delay * 2, 0.2)
        return conn

    def _open_claimed(self) -> sqlite3.Connection:
        """``_open`` on files only this user made, checked again once SQLite opened them.

        SQLite opens the ``-wal``, ``-shm`` and ``-journal`` by name, creating any that is
        missing, and reads what it finds: in a sticky shared folder another user could
        create one between the checks and the open. So none is left missing (each is
        claimed), and no other process may delete one meanwhile (the file is anchored).
        """
        if self._identity is not None and not os.path.lexists(self.path):
            self._check_identity()  # deleted since this client opened it: say so
        _refuse_a_file_cut_by_fork(self.path)
        key = self._safely(_anchored)
        try:
            claimed = self._safely(lambda path: claim_side_files(os.path.realpath(path)))
            conn = self._open()
            try:
                self._safely(lambda path: refuse_moved_files(os.path.realpath(path), key,
                                                             claimed))
                self._remember_identity(conn)
            except BaseException:
                conn.close()
                raise
        except BaseException:
            release_anchor(key)
            raise
        self._anchor = key
        return conn

    def _open(self) -> sqlite3.Connection:
        generation = _Fork.generation
        conn = sqlite3.connect(self.path, timeout=min(self._busy_timeout, _BUSY_SLICE),
                               isolation_level=None, check_same_thread=False)
        _refuse_if_forked_since(generation, conn, self.path)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(f"PRAGMA synchronous={self._synchronous.upper()}")
            # A write transaction would queue behind every other process's writes; a client
            # opening a file already set up (a forked child, say) needs none.
            if not _has_schema(conn):
                _make_schema(conn)
        except BaseException:
            _rollback(conn)
            conn.close()
            raise
        return conn

    def _safely(self, check: Callable[[str], _T]) -> _T:
        """``check(path)``, whose refusal on a reconnection means the store was tampered with."""
        try:
            return check(self.path)
        except UnsupportedOperationError as exc:
            if self._identity is None:
                raise
            # Unsafe only since this client first opened it: someone changed it meanwhile.
            raise StoreReplacedError(f"{exc}; its leases cannot be kept", path=self.path) from exc
        except OSError as exc:
            raise EngineUnavailableError(f"cannot check SQLite database {self.path}: {exc}"
                                         ) from exc

    def _remember_identity(self, conn: sqlite3.Connection) -> None:
        """Note which files were opened; a reopening (after a fork) must find the same one."""
        try:
            self._check_identity()
            self._sides = self._safely(side_files)
        except BaseException:
            conn.close()
            raise

    def _check_identity(self) -> None:
        """Refuse to go on when the path names another file, or a -wal/-shm was swapped."""
        problem = self._identity_problem()
        if problem is not None:
            raise StoreReplacedError(
                f"{problem} while this client used it: its leases cannot be kept, and a new "
                "client would start a new store", path=self.path)

    def _intact(self) -> bool:
        """Whether the file and its -wal and -shm are still those this client opened.

        The answer of nearly every call, found in the fewest steps; anything else is
        left to ``_identity_problem`` to name.
        """
        try:
            info = os.stat(self.path)
            if info.st_nlink != 1 or (info.st_dev, info.st_ino) != self._identity:
                return False
            for name, identity in self._sides:
                side = os.lstat(name)
                if (side.st_dev, side.st_ino) != identity:
                    return False
        except OSError:
            return False
        return True

    def _identity_problem(self) -> Optional[str]:
        if self._intact():
            return None
        try:
            now = _identity(self.path)
        except FileNotFoundError:
            return f"SQLite database {self.path} was deleted"
        except OSError as exc:
            raise EngineUnavailableError(f"cannot stat SQLite database {self.path}: {exc}") from exc
        if self._identity not in (None, now[:2]):
            return f"SQLite database {self.path} was replaced by another file"
        if now[2] > 1:
            return (f"SQLite database {self.path} got a second name (a hard link), whose "
                    "clients would keep a -wal of their own")
        self._identity = now[:2]
        changed = changed_side_file(self._sides)
        return None if changed is None else f"{changed} (of SQLite database {self.path})"

    def transaction(self, footprint: Footprint, work: Callable[[StorageTxn], _T]) -> _T:
        """Run ``work`` in one transaction; the file lock covers everything, so the footprint
        is not needed (but for refusing calls once closed)."""
        try:
            return self._transaction(footprint, work)
        finally:
            # A release that ran after close() opened the file again. Whichever call holds
            # the mutex now runs this same step as it ends, so none waits for another here.
            mutex = self._mutex  # the one taken is the one given back: a fork renews it
            if self._closed and self._conn is not None and mutex.acquire(blocking=False):
                try:
                    self._close_connection()
                finally:
                    mutex.release()

    def _transaction(self, footprint: Footprint, work: Callable[[StorageTxn], _T]) -> _T:
        """``_step``, tried again while another process's write keeps the file busy.

        Each try waits in SQLite for one slice at most, under the mutex; between tries the
        mutex is free, so a fork or a close of this process waits a slice, not the whole
        busy timeout. A busy try rolled back, so the step runs again from scratch.
        """
        deadline = 0.0
        while True:
            try:
                return self._step(footprint, work)
            except _Busy as busy:
                now = time.monotonic()
                if not deadline:
                    deadline = now + self._busy_timeout - _BUSY_SLICE  # one slice is spent
                if now >= deadline:
                    raise _translate(self.path, busy.error) from busy.error
            time.sleep(_BUSY_PAUSE)

    def _step(self, footprint: Footprint, work: Callable[[StorageTxn], _T]) -> _T:
        if self._likely_refused(footprint):
            try:
                return self._read_only(footprint, work)
            except _NeedsWrite:
                pass  # it can apply after all: run it again from scratch, under the write lock
        op = footprint.lone_lock_op
        if op is not None and op["op"] == "release" and "slot" in op and (
                (self._calls + 1) % _SWEEP_EVERY):  # the sweep's turn takes a transaction
            try:
                return self._alone(work)
            except _NeedsTransaction:
                pass  # nothing ran: the step runs again, in a transaction
        # The same step as ``atomic()``, written out: this is every call's path, and two
        # generator-based context managers per call cost more than the rest of it.
        with self._mutex:
            self._in_call = _get_ident()
            try:
                try:
                    txn, answer = self._write(footprint, work)
                except sqlite3.OperationalError as exc:
                    if not self._room_made(exc):
                        raise
                    txn, answer = self._write(footprint, work)  # once, into the room made
            except sqlite3.DatabaseError as exc:
                raise _failed(self.path, exc) from exc
            finally:
                self._in_call = None
        return self._woken(txn, answer)

    def _write(self, footprint: Footprint,
               work: Callable[[StorageTxn], _T]) -> tuple[_SqliteTxn, _T]:
        """``work`` in one ``BEGIN IMMEDIATE`` transaction, committed (the caller holds the
        mutex)."""
        self._refuse_if_closed(footprint)
        conn = self._connection()
        try:
            conn.execute("BEGIN IMMEDIATE")
            txn = self._txn(conn, footprint)
            answer = work(txn)
            self._refuse_if_closed(footprint)  # closed while it waited for the write lock
            self._commit(txn)
        except BaseException:
            _rollback(conn)
            raise
        return txn, answer

    def _room_made(self, exc: sqlite3.OperationalError) -> bool:
        """After a write found the disk full: whether a checkpoint emptied the log.

        SQLite checkpoints by itself only after a commit, once the log is long: a log that
        fills a small disk first would stay full while any client keeps the store open.
        Copied into the database (whose pages it mostly rewrites), the log starts over.
        """
        if not _is_full(exc) or self._conn is None:
            return False
        try:
            busy, logged, copied = self._conn.execute(
                "PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.DatabaseError:
            return False
        log.info("SQLite database %s found the disk full; a checkpoint copied %d of %d "
                 "log pages", self.path, copied, logged)
        return not busy and logged > 0 and copied == logged

    def _alone(self, work: Callable[[StorageTxn], _T]) -> _T:
        """A lone release as its one DELETE, which commits by itself (so without BEGIN and
        COMMIT), run once the file is found to be the one this client opened, as before
        every commit."""
        with self._mutex:
            self._in_call = _get_ident()
            try:
                conn = self._connection()
                if not self._intact():
                    self._check_identity()
                self._calls += 1
                try:
                    txn = _AloneTxn(conn, self._clock)
                    answer = work(txn)
                except sqlite3.OperationalError as exc:
                    if not self._room_made(exc):
                        raise
                    txn = _AloneTxn(conn, self._clock)  # once, into the room made
                    answer = work(txn)
            except sqlite3.DatabaseError as exc:
                raise _failed(self.path, exc) from exc
            finally:
                self._in_call = None
        return self._woken(txn, answer)

    def _woken(self, txn: _SqliteTxn, answer: _T) -> _T:
        """``answer``, once the waiters of every name the committed step freed are woken."""
        if txn.freed_names and self.wake is not None:
            self.wake.notify(sorted(txn.freed_names))
        return answer

    def _txn(self, conn: sqlite3.Connection, footprint: Footprint) -> _SqliteTxn:
        """The step's transaction object: the general one, or one a body's shape lets do less."""
        op = footprint.lone_lock_op
        if op is not None:  # a handle's every call: no batch to read ahead for
            release = op["op"] == "release" and "slot" in op
            return (_LoneReleaseTxn if release else _SqliteTxn)(conn, self._clock)
        keys = _slot_keys(footprint)
        return _BatchTxn(conn, self._clock, keys) if keys else _SqliteTxn(conn, self._clock)

    def _likely_refused(self, footprint: Footprint) -> bool:
        """Whether this step is an attempt of a waiter of this process on a lock it waits for.

        Such an attempt mostly finds the lock still held. Reading that without the write
        lock keeps it from queueing the holder's own calls behind it, under SQLite's
        millisecond busy sleeps.
        """
        return (self.wake is not None and footprint.mints > 0
                and self.wake.waiting_on(footprint.names))

    def _read_only(self, footprint: Footprint, work: Callable[[StorageTxn], _T]) -> _T:
        """Run ``work`` on a read snapshot, committing nothing; ``_NeedsWrite`` if it writes."""
        with self._mutex:
            self._in_call = _get_ident()
            try:
                self._refuse_if_closed(footprint)
                conn = self._connection()
                try:
                    conn.execute("BEGIN")  # deferred: a snapshot, and no write lock
                    answer = work(_ReadOnlyTxn(conn, self._clock))
                    self._check_identity()  # an answer from a replaced file would mislead
                finally:
                    _rollback(conn)
            except sqlite3.DatabaseError as exc:
                raise _failed(self.path, exc) from exc
            finally:
                self._in_call = None
        return answer

    @contextlib.contextmanager
    def atomic(self) -> Iterator[_SqliteTxn]:
        """One ``BEGIN IMMEDIATE`` transaction: committed when the block ends, else rolled back.

        Its BEGIN is tried again, with the mutex freed between tries, as every call is.
        """
        deadline = time.monotonic() + self._busy_timeout
        while True:
            with self._mutex, _translated(self.path):
                self._in_call = _get_ident()
                try:
                    self._refuse_if_closed(None)
                    conn = self._connection()
                    try:
                        # Inside the try: a Ctrl-C landing just after BEGIN must still roll
                        # back, or the write lock stays taken for every process on the file.
                        if _began(conn, deadline):
                            txn = _SqliteTxn(conn, self._clock)
                            yield txn
                            self._refuse_if_closed(None)
                            self._commit(txn)
                            return
                    except BaseException:
                        _rollback(conn)
                        raise
                finally:
                    self._in_call = None
            time.sleep(_BUSY_PAUSE)

    def _connection(self) -> sqlite3.Connection:
        """The open connection, made first if there is none (the caller holds the mutex)."""
        conn = self._conn
        if conn is None:
            conn = self._conn = self._connect()
        elif conn.in_transaction:  # a call whose rollback an interrupt cut short left it
            _rollback(conn)
        return conn

    def _refuse_if_closed(self, footprint: Optional[Footprint]) -> None:
        """Refuse a call, queued or waiting out another process's write while its client
        closed, that could take a permit: the client, closed, would never give it back.

        Releases still run (and the connection closes again after them): they only free.
        """
        if self._closed and (footprint is None or not footprint.only_releases):
            raise EngineError(f"the SQLite store {self.path} was closed by its client; the "
                              "call took no effect")

    def _commit(self, txn: _SqliteTxn) -> None:
        self._calls += 1
        if self._calls % _SWEEP_EVERY == 0:
            self._permits_swept_to = txn.sweep(txn.now_ms(), self._permits_swept_to)
        if not self._intact():  # a commit into an unlinked file would be seen by nobody
            self._check_identity()
        txn.commit()

    def after_fork(self) -> None:
        # The parent closed every connection before forking, so there is nothing to close
        # here. The child connects at its first call: opening now could wait for another
        # process's write inside os.fork() itself.
        self._conn = None
        self._mutex = threading.Lock()
        if self.wake is not None:
            self.wake.after_fork()

    def _disconnect(self) -> None:
        """Close the connection (the caller holds the mutex); the next call reconnects."""
        conn, self._conn = self._conn, None
        self._sides = ()  # the next connection may find new ones, made by SQLite itself
        anchor, self._anchor = self._anchor, None
        if conn is None:
            return
        # Not while another client of this process opens the file: closing it last, SQLite
        # here would delete the side files that client just claimed.
        with _OPENING:
            _Holders.opening = _get_ident()
            try:
                conn.close()
            finally:
                _Holders.opening = None
                if anchor is not None:
                    release_anchor(anchor)

    def close(self) -> None:
        # Marked first: a call queued on the mutex, or inside it, then takes no effect.
        self._closed = True
        # Closed before it leaves _LIVE, both under the mutex: a fork meanwhile waits for the
        # mutex, so it never carries this connection, half closed, into the child.
        mutex = self._mutex  # the one taken is the one given back: a fork renews it
        if mutex.acquire(timeout=_CLOSE_WAIT):
            try:
                self._close_connection()
            finally:
                mutex.release()
        else:
            # A call holds it: waiting out another process's write (SQLite's busy wait), or
            # this very thread's, cut into by a signal handler. Closed once that call ends.
            threading.Thread(target=self._close_when_free, name="queen_sync-sqlite-close",
                             daemon=True).start()
        if self.wake is not None:
            self.wake.close()

    def _close_when_free(self) -> None:
        with self._mutex:
            self._close_connection()

    def _close_connection(self) -> None:
        """Close the connection for good (the caller holds the mutex)."""
        self._in_call = _get_ident()  # a fork from a signal handler here must not wait
        try:
            self._disconnect()
            _LIVE.discard(self)
        finally:
            self._in_call = None


def _anchored(path: str) -> FileKey:
    """``anchor_store`` on the file ``path`` names; busy as SQLite says it, to be retried."""
    try:
        return anchor_store(os.path.realpath(path))
    except BlockingIOError as exc:  # another process is closing it, exclusively, for now
        raise sqlite3.OperationalError(f"database is locked ({exc.strerror})") from exc


def _has_schema(conn: sqlite3.Connection) -> bool:
    """Whether the store has this schema's objects and not the index it replaced."""
    return _schema_objects(conn) == set(_SCHEMA_OBJECTS)


def _schema_objects(conn: sqlite3.Connection) -> set[str]:
    names = (*_SCHEMA_OBJECTS, _OLD_INDEX)
    marks = ",".join("?" * len(names))
    return {name for (name,) in conn.execute(
        f"SELECT name FROM sqlite_master WHERE name IN ({marks})", names)}


def _make_schema(conn: sqlite3.Connection) -> None:
    """Make the schema, or move a store made with the old expiry index to the new one.

    A store made by an earlier release that this process may only read keeps its old
    index: every call works with it, only writes are slower, and reads must still answer.
    """
    try:
        conn.executescript("BEGIN IMMEDIATE;" + _SCHEMA + "COMMIT;")
    except sqlite3.OperationalError as exc:
        _rollback(conn)
        earlier = {"queen_kv", "queen_meta", _OLD_INDEX}
        if not (_is_read_only(exc) and earlier <= _schema_objects(conn)):
            raise


def _rollback(conn: sqlite3.Connection) -> None:
    """Roll back what is still open, keeping the error that caused it the one reported."""
    try:
        _rollback_once(conn)
    except BaseException:
        # A signal's exception (Ctrl-C, an application's handler) cut it short: the open
        # transaction would keep the file's write lock from every other process.
        _rollback_once(conn)
        raise


def _rollback_once(conn: sqlite3.Connection) -> None:
    # SQLite rolls back by itself on some errors (a full disk); a second ROLLBACK would then
    # fail and hide the cause. A rollback failing too leaves SQLite to undo it at next use.
    if conn.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")


_LIVE: weakref.WeakSet[SqliteStorage] = weakref.WeakSet()
_HELD_ACROSS_FORK: list[SqliteStorage] = []
# Storages the forking thread itself is inside a call of (a signal handler that forks),
# with their connections: those cross the fork open, so the child must never close them.
_CUT_ACROSS_FORK: list[tuple[SqliteStorage, Optional[sqlite3.Connection]]] = []


class _Fork:
    """What the fork hooks took, and what a child cannot use."""

    generation = 0  # how many forks this process is from the one that loaded the module
    took_registering = False
    took_opening = False
    kept_open: ClassVar[list[Optional[sqlite3.Connection]]] = []  # in a child: never closed
    unusable: ClassVar[set[tuple[int, int]]] = set()  # in a child: files (dev, inode) refused
    all_unusable = False  # in a child forked while its own thread was opening a file


def _before_fork() -> None:
    # SQLite keeps one in-memory record per file (its lock counts, the -shm mapping) for all
    # of a process's connections, and a child inherits it: the child's connections would
    # then trust locks only the parent holds, and the parent, once it closes, would believe
    # itself the last user and delete the WAL the child writes to. So no connection of ours
    # stays open across a fork: wait for any call in flight, close, reconnect at next use.
    # A call of the forking thread itself (a signal handler forking) cannot be waited for:
    # its store is left as it is, and the child refuses that file.
    me = _get_ident()
    cut_open = me in (_Holders.opening, _Holders.registering)
    _Fork.took_registering = _Holders.registering != me
    if _Fork.took_registering:
        _REGISTERING.acquire()
    for storage in list(_LIVE):
        if cut_open or storage._in_call == me:
            _CUT_ACROSS_FORK.append((storage, storage._conn))
            continue
        storage._mutex.acquire()
        _HELD_ACROSS_FORK.append(storage)
        try:
            storage._disconnect()
        except sqlite3.Error:
            log.warning("closing %s before fork failed", storage.path, exc_info=True)
    _Fork.took_opening = not cut_open
    if _Fork.took_opening:
        _OPENING.acquire()  # last: a call in flight may be (re)connecting under its mutex


def _after_fork_in_parent() -> None:
    if _Fork.took_opening:
        _OPENING.release()
    while _HELD_ACROSS_FORK:
        _HELD_ACROSS_FORK.pop()._mutex.release()
    del _CUT_ACROSS_FORK[:]
    if _Fork.took_registering:
        _REGISTERING.release()


def _after_fork_in_child() -> None:
    global _OPENING, _REGISTERING
    _Fork.generation += 1
    if not (_Fork.took_opening and _Fork.took_registering):
        # This thread held one of them in the parent, inside code the fork cut short.
        _Fork.all_unusable = True
        _OPENING, _REGISTERING = threading.Lock(), threading.Lock()
        _Holders.opening = _Holders.registering = None
    else:
        _OPENING.release()
        _REGISTERING.release()
    while _HELD_ACROSS_FORK:
        _HELD_ACROSS_FORK.pop()._mutex = threading.Lock()
    while _CUT_ACROSS_FORK:
        storage, conn = _CUT_ACROSS_FORK.pop()
        _Fork.kept_open.append(conn)
        if conn is not None:
            # The call the fork cut short resumes here too, on a connection whose locks are
            # the parent's: every statement it runs from now on is aborted before it writes.
            conn.set_progress_handler(_abort, 1)
        if storage._identity is not None:
            _Fork.unusable.add(storage._identity)
        storage._conn, storage._in_call, storage._mutex = None, None, threading.Lock()


def _abort() -> int:
    return 1


def _refuse_if_forked_since(generation: int, conn: sqlite3.Connection, path: str) -> None:
    """Refuse ``conn``, opened in the parent, when a fork cut in since: its locks are not ours.

    Only a fork from a signal handler, inside the opening, gets here; every statement
    the connection would run is aborted first, and it is never closed.
    """
    if generation != _Fork.generation:
        conn.set_progress_handler(_abort, 1)
        _Fork.kept_open.append(conn)
        raise EngineError(f"this process was forked while it opened SQLite database {path} "
                          "(from a signal handler, say): the connection is the parent's, and "
                          "this process cannot use the file safely")


def _refuse_a_file_cut_by_fork(path: str) -> None:
    """Refuse, in a child forked from inside a call on it, the file at ``path``."""
    if not (_Fork.all_unusable or _Fork.unusable):
        return
    try:
        info = os.stat(path)
    except OSError:
        return  # no such file yet: nothing of it came across the fork
    if _Fork.all_unusable or (info.st_dev, info.st_ino) in _Fork.unusable:
        raise EngineError(
            f"this process was forked from inside a call on SQLite database {path} (a signal "
            "handler that forked, say): SQLite's record of the file's locks came across the "
            "fork, so this process cannot use the file safely; fork outside such calls, or "
            "use the file from a process started afresh")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def _translated(path: str) -> Iterator[None]:
    """SQLite's exceptions become queen_sync's at the engine boundary."""
    try:
        yield
    except sqlite3.DatabaseError as exc:
        raise _translate(path, exc) from exc


class _Busy(Exception):
    """A try of a step found the file busy with another process's write, and rolled back."""

    def __init__(self, error: sqlite3.OperationalError) -> None:
        super().__init__(str(error))
        self.error = error


_SQLITE_BUSY = 5  # SQLite's primary result code, as ``_SQLITE_FULL`` below


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)  # set from Python 3.11
    if isinstance(code, int):
        return code & 0xFF == _SQLITE_BUSY
    return "database is locked" in str(exc)


def _began(conn: sqlite3.Connection, deadline: float) -> bool:
    """``BEGIN IMMEDIATE`` on ``conn``; False when the file stayed busy for a slice."""
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as exc:
        if not _is_busy(exc) or time.monotonic() >= deadline:
            raise
        return False
    return True


def _failed(path: str, exc: sqlite3.DatabaseError) -> Exception:
    """What a step raises for ``exc``: ``_Busy`` to be tried again, else the translation."""
    if isinstance(exc, sqlite3.OperationalError) and _is_busy(exc):
        return _Busy(exc)
    return _translate(path, exc)


def _translate(path: str, exc: sqlite3.DatabaseError) -> Exception:
    """The queen_sync error that SQLite's ``exc`` is, for the database at ``path``."""
    if not isinstance(exc, sqlite3.OperationalError):
        return EngineError(f"SQLite database {path} failed: {exc}")
    text = str(exc)
    # These three are answered before anything of the call is written (it rolls back).
    if _is_full(exc):
        return EngineError(f"SQLite database {path} cannot grow: {text}; nothing of this "
                           "call was written (free disk space, or raise max_page_count)",
                           applied=False)
    if "locked" in text or "busy" in text:
        return EngineUnavailableError(f"SQLite database {path} stayed locked: {text}",
                                      applied=False)
    if _is_read_only(exc):  # no outage: waiting never makes the file writable
        return EngineError(f"SQLite database {path} is read-only to this process: {text}; "
                           "nothing of this call was written (this user needs write access "
                           "to the file and its folder)", applied=False)
    return EngineUnavailableError(f"SQLite database {path} is unusable: {text}")


_SQLITE_FULL = 13  # SQLite's primary result code; ``sqlite3`` names it from Python 3.11 only
# SQLITE_IOERR_SHMSIZE: the -shm could not be extended, which on a full disk is how SQLite
# tells it (as "disk I/O error") when that file, not the log or the database, needs room.
_SQLITE_IOERR_SHMSIZE = 10 | (19 << 8)


_SQLITE_READONLY = 8


def _is_read_only(exc: sqlite3.OperationalError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)  # set from Python 3.11
    if isinstance(code, int):
        return code & 0xFF == _SQLITE_READONLY
    return "readonly database" in str(exc)


def _is_full(exc: sqlite3.OperationalError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)  # set from Python 3.11
    if isinstance(code, int):
        return code & 0xFF == _SQLITE_FULL or code == _SQLITE_IOERR_SHMSIZE
    return "database or disk is full" in str(exc)


def filesystem_type(path: str, mounts_file: str = "/proc/self/mounts") -> Optional[str]:
    """The type of the filesystem holding ``path`` (Linux), or None when unknown."""
    try:
        with open(mounts_file, encoding="utf-8") as handle:
            mounts = [line.split() for line in handle]
    except OSError:
        return None
    target = os.path.realpath(path)
    best, fstype = "", None
    for parts in mounts:
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, parts[2]
    return fstype


def refuse_network_filesystem(path: str, fstype: Optional[str]) -> None:
    if fstype is not None and fstype.lower() in NETWORK_FILESYSTEMS:
        raise UnsupportedOperationError(
            f"{path} is on a network filesystem ({fstype}), where SQLite's file locking is "
            "unreliable and two holders could both win. Put the file on a local disk, or use "
            "a postgresql:// URL or a Queen broker (http://...) to coordinate many machines.",
            capability="local_filesystem",
        )


def _prepare_file(path: str) -> None:
    """Create the folder (0700) and the file (0600) if missing, refusing network filesystems."""
    folder = os.path.dirname(path) or "."
    try:
        if not os.path.isdir(folder):
            os.makedirs(folder, mode=0o700, exist_ok=True)
        refuse_network_filesystem(path, filesystem_type(folder))
        refuse_unsafe_store(path)  # before creating anything in a folder others may change
        # Only a file that does not exist yet is opened: no client of this process can hold
        # locks on it, so closing the descriptor drops none.
        real = os.path.realpath(path)  # a checked symlink's target, made if missing
        with _OPENING, contextlib.suppress(FileExistsError):
            _Holders.opening = _get_ident()
            try:
                if not os.path.lexists(real):
                    _refuse_leftover_log(path, real)
                if not _link_new_store(real):
                    os.close(os.open(real, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
            finally:
                _Holders.opening = None
    except OSError as exc:
        raise EngineUnavailableError(f"cannot open SQLite database {path}: {exc}") from exc


def _refuse_leftover_log(path: str, real: str) -> None:
    """Refuse to make a store where a deleted one left its log (a ``-wal`` or ``-journal``
    with content): SQLite would replay it into the new file, which would start from part
    of the old store (old holders, a version counter behind tokens already handed out).

    A live store's log never outlives its database file: the file is made first.
    """
    for suffix in ("-wal", "-journal"):
        log_path = real + suffix
        with contextlib.suppress(FileNotFoundError):
            # Looked at again once a log is found: another process may have made the store
            # (then its log) since this one found no file.
            if os.lstat(log_path).st_size > 0 and not os.path.lexists(real):
                raise EngineError(
                    f"SQLite database {path} does not exist, but its {suffix} log "
                    f"{log_path} does: it is left from a database that was deleted, and "
                    "SQLite would replay it into a new one. Restore the database file, or "
                    f"remove {real}-wal, {real}-shm and {real}-journal (with no client open)")


def _link_new_store(path: str) -> bool:
    """Give ``path`` a finished store, schema and WAL mode in place, unless a file is there
    (``FileExistsError``); False where a nameless file cannot be made and linked (not Linux).

    A file that appears empty is switched to WAL by its first client, which needs SQLite's
    exclusive lock: clients anchor (``anchor_store``) only files already in WAL mode, as
    an anchor SQLite cannot see would stall the switch, so such a file is anchored only
    from its second opening on.
    """
    if os.path.lexists(path):
        raise FileExistsError(path)  # the usual case, answered before writing a new file
    tmpfile = getattr(os, "O_TMPFILE", None)
    if tmpfile is None or not os.path.isdir("/proc/self/fd"):
        return False
    try:
        fd = os.open(os.path.dirname(path), tmpfile | os.O_RDWR, 0o600)
    except OSError:
        return False  # a filesystem without nameless files
    try:
        os.fchmod(fd, 0o600)
        image = _store_image()
        while image:
            image = image[os.write(fd, image):]
        os.fsync(fd)
        _link_open_file(fd, path)  # fails if a file is there: nothing is replaced
    except FileExistsError:
        raise
    except OSError:
        return False  # not linkable here: an empty file, switched by its first client
    finally:
        os.close(fd)
    return True


def _link_open_file(fd: int, path: str) -> None:
    # Through the descriptor's name under /proc, followed: ``os.link`` follows a symlink
    # only when it is given a folder descriptor.
    fds = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(str(fd), path, src_dir_fd=fds, follow_symlinks=True)
    finally:
        os.close(fds)


@functools.lru_cache(maxsize=1)
def _store_image() -> bytes:
    """The bytes of a new, empty store in WAL mode, made once per process in a private folder."""
    with tempfile.TemporaryDirectory() as folder:
        made = os.path.join(folder, "store.db")
        conn = sqlite3.connect(made, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript("BEGIN IMMEDIATE;" + _SCHEMA + "COMMIT;")
        finally:
            conn.close()  # the last connection: everything is checkpointed into the file
        with open(made, "rb") as handle:
            return handle.read()


def path_from_url(url: str) -> tuple[str, dict[str, str]]:
    """``sqlite:///abs/path.db`` → ``/abs/path.db``; ``sqlite:rel.db`` → ``rel.db``."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise RequestError(f"sqlite URL {redact_url_for_error(url)!r} names a host; write "
                           "sqlite:///absolute/path.db", code="bad_url")
    path = os.path.expanduser(unquote(parts.path))
    if not path:
        raise RequestError(f"sqlite URL {redact_url_for_error(url)!r} has no path",
                           code="bad_url")
    # ``sqlite:///`` or ``.../dir/`` names a folder: refused before anything is created
    # there (``dir/`` would become a file named ``dir``).
    if os.path.basename(path) in ("", os.curdir, os.pardir) or os.path.isdir(path):
        raise RequestError(f"sqlite URL {redact_url_for_error(url)!r} names no database file "
                           "(it names a folder); write sqlite:///path/to/queen.db",
                           code="bad_url")
    return path, _url_options(url, parts.query)


_URL_OPTIONS = ("busy_timeout", "synchronous")
_SYNCHRONOUS = ("off", "normal", "full", "extra")


def _url_options(url: str, query: str) -> dict[str, str]:
    """The options of a sqlite URL's query, each known and given once.

    A misspelt option read as absent would leave the store at a durability or a wait
    its user did not choose, so it is refused like any other malformed URL.
    """
    found: dict[str, str] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key not in _URL_OPTIONS:
            # Named only when it is a near miss of an option: a query may carry a secret.
            near = difflib.get_close_matches(key, _URL_OPTIONS, n=1)
            which = f"{key!r} (did you mean {near[0]}?)" if near else "(not shown)"
            raise RequestError(f"sqlite URL {redact_url_for_error(url)!r}: unknown option "
                               f"{which}; the options are busy_timeout (seconds) and "
                               "synchronous (off, normal, full or extra)", code="bad_url")
        if key in found:
            raise RequestError(f"sqlite URL {redact_url_for_error(url)!r} gives {key} twice",
                               code="bad_url")
        found[key] = value
    return found


def _busy_timeout(value: Any) -> float:
    """``busy_timeout`` checked: a positive, finite number of seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"busy_timeout is a number of seconds, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"busy_timeout must be a positive, finite number of seconds, "
                         f"not {value!r}")
    return float(value)


def _options_from_query(url: str, query: dict[str, str]) -> dict[str, Any]:
    """The engine options a URL's query sets, refused as ``bad_url`` when malformed."""
    options: dict[str, Any] = {}
    if "synchronous" in query:
        if query["synchronous"].lower() not in _SYNCHRONOUS:
            raise RequestError(f"sqlite URL {redact_url_for_error(url)!r}: synchronous must "
                               "be off, normal, full or extra", code="bad_url")
        options["synchronous"] = query["synchronous"]
    if "busy_timeout" in query:
        try:
            options["busy_timeout"] = _busy_timeout(float(query["busy_timeout"]))
        except ValueError:
            raise RequestError(f"sqlite URL {redact_url_for_error(url)!r}: busy_timeout must "
                               "be a positive, finite number of seconds", code="bad_url") from None
    return options


class SqliteEngine(Engine):
    """The embedded engine: the wire's semantics on one local SQLite file."""

    kind = "sqlite"
    capabilities = Capabilities(wake_on_release=WakeChannel.supported)
    OPTIONS = frozenset({"timeout", "clock", "busy_timeout", "synchronous"})

    def __init__(
        self,
        path: str,
        *,
        busy_timeout: float = 30.0,
        synchronous: str = "normal",
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not isinstance(synchronous, str) or synchronous.lower() not in _SYNCHRONOUS:
            raise ValueError(f"synchronous must be off, normal, full or extra, not {synchronous!r}")
        busy_timeout = _busy_timeout(busy_timeout)
        self.path = os.path.abspath(path)
        _prepare_file(self.path)
        self.storage = SqliteStorage(self.path, busy_timeout=busy_timeout,
                                     synchronous=synchronous, clock=clock)
        self._semantics = EmbeddedSemantics(self.storage)

    @classmethod
    def from_url(cls, url: str, *, timeout: Any = None, **options: Any) -> SqliteEngine:
        """The engine for ``sqlite:///abs/path.db`` (``?synchronous=``, ``?busy_timeout=``).

        ``timeout`` (seconds) bounds how long a call waits for another process's write.
        """
        path, query = path_from_url(url)
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
                raise TypeError("timeout for the SQLite engine is a positive number of seconds")
            options.setdefault("busy_timeout", float(timeout))
        for option, value in _options_from_query(url, query).items():
            options.setdefault(option, value)
        return cls(path, **options)

    @property
    def url(self) -> str:
        return f"sqlite://{self.path}"

    @property
    def store(self) -> str:
        # One file under any spelling of its path (relative, through a symbolic link).
        return f"sqlite://{os.path.realpath(self.path)}"

    def call(self, route: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self._semantics.call(route, body)

    @contextlib.contextmanager
    def subscribe(self, name: str) -> Iterator[Waiter]:
        wake = self.storage.wake
        if wake is None:
            with super().subscribe(name) as sleeper:
                yield sleeper
            return
        with wake.subscribe(name) as waiter:
            yield waiter

    def after_fork(self) -> None:
        self.storage.after_fork()

    def close(self) -> None:
        self.storage.close()

"""The embedded default: one SQLite file shared by many processes on one machine.

WAL mode with a busy timeout, every call one ``BEGIN IMMEDIATE`` transaction, so
writers queue on the file lock instead of racing. The store-wide version counter
lives in its own row and only ever rises, so tokens outlive every release,
expiry, deletion and reopening of the file. With ``synchronous=NORMAL`` (the
default) a process crash loses nothing; an OS crash or power cut may lose the
last commits, counter included: use ``?synchronous=full`` when a fence must
survive that.

This process never opens the file with its own descriptors once it may exist: POSIX
drops every lock a process holds on a file when ANY descriptor of it is closed, those
SQLite holds for other clients of the file included, and a neighbour that then finds
no lock believes itself the last user and deletes the live WAL. A client remembers
which file (device, inode) it opened and refuses to go on with another one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence
from urllib.parse import parse_qs, unquote, urlsplit

from .._errors import (
    EngineError,
    EngineUnavailableError,
    RequestError,
    StoreReplacedError,
    UnsupportedOperationError,
)
from .base import Capabilities, Engine, Waiter
from .embedded import EmbeddedSemantics
from .sqlite_wake import WakeChannel
from .storage import Row

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
CREATE INDEX IF NOT EXISTS queen_kv_expiry ON queen_kv (expires_at) WHERE expires_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS queen_meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO queen_meta (name, value) VALUES ('version', 0);
"""

_SCHEMA_OBJECTS = ("queen_kv", "queen_kv_expiry", "queen_meta")
_COLUMNS = "ns, key, value, version, expires_at, created_at, updated_at, prev_version"
_SWEEP_EVERY = 512

# Held while this process creates a database file or opens a connection, so a new file's
# creating descriptor is closed before any connection of this process can lock that file.
_OPENING = threading.Lock()


def _identity(path: str) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_dev, info.st_ino


def _row(record: Sequence[Any]) -> Row:
    ns, key, value, version, expires_at, created_at, updated_at, prev = record
    return Row(ns, key, json.loads(value), version, expires_at, created_at, updated_at, prev)


class _SqliteTxn:
    def __init__(self, conn: sqlite3.Connection, clock: Callable[[], float]) -> None:
        self._conn = conn
        self._clock = clock

    def now_ms(self) -> int:
        return int(self._clock() * 1000)

    def read(self, ns: str, key: str) -> Optional[Row]:
        record = self._conn.execute(
            f"SELECT {_COLUMNS} FROM queen_kv WHERE ns = ? AND key = ?", (ns, key)
        ).fetchone()
        return _row(record) if record else None

    def read_prefix(
        self, ns: str, prefix: str, *, after: Optional[str], limit: int, now_ms: int
    ) -> Sequence[Row]:
        records = self._conn.execute(
            f"SELECT {_COLUMNS} FROM queen_kv WHERE ns = ? AND key >= ? AND key > ?"
            " AND substr(key, 1, ?) = ? AND (expires_at IS NULL OR expires_at > ?)"
            " ORDER BY key LIMIT ?",
            (ns, prefix, after or "", len(prefix), prefix, now_ms, limit),
        ).fetchall()
        return [_row(r) for r in records]

    def write(self, row: Row) -> None:
        self._conn.execute(
            f"INSERT OR REPLACE INTO queen_kv ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (row.ns, row.key, json.dumps(row.value, separators=(",", ":")), row.version,
             row.expires_at, row.created_at, row.updated_at, row.prev_version),
        )

    def delete(self, ns: str, key: str) -> None:
        self._conn.execute("DELETE FROM queen_kv WHERE ns = ? AND key = ?", (ns, key))

    def next_version(self) -> int:
        self._conn.execute("UPDATE queen_meta SET value = value + 1 WHERE name = 'version'")
        (value,) = self._conn.execute(
            "SELECT value FROM queen_meta WHERE name = 'version'"
        ).fetchone()
        return int(value)

    def sweep(self, now_ms: int) -> None:
        self._conn.execute(
            "DELETE FROM queen_kv WHERE (ns, key) IN (SELECT ns, key FROM queen_kv"
            " WHERE expires_at IS NOT NULL AND expires_at <= ? LIMIT 256)",
            (now_ms,),
        )


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
        self._calls = 0
        self._identity: Optional[tuple[int, int]] = None
        self._conn: Optional[sqlite3.Connection] = self._connect()
        self.wake = WakeChannel(os.path.realpath(path)) if WakeChannel.supported else None
        _LIVE.add(self)

    def _connect(self) -> sqlite3.Connection:
        # Switching a new file to WAL takes an exclusive lock, and SQLite answers "locked"
        # at once (without the busy handler) to a second opener racing for it, so retry.
        deadline = time.monotonic() + self._busy_timeout
        delay = 0.005
        with _translated(self.path):
            while True:
                try:
                    with _OPENING:
                        conn = self._open()
                    break
                except sqlite3.OperationalError as exc:
                    if "locked" not in str(exc) or time.monotonic() + delay > deadline:
                        raise
                time.sleep(delay)
                delay = min(delay * 2, 0.2)
        self._remember_identity(conn)
        return conn

    def _open(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=self._busy_timeout, isolation_level=None,
                               check_same_thread=False)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(f"PRAGMA synchronous={self._synchronous.upper()}")
            # A write transaction would queue behind every other process's writes; a client
            # opening a file already set up (a forked child, say) needs none.
            if not _has_schema(conn):
                conn.executescript("BEGIN IMMEDIATE;" + _SCHEMA + "COMMIT;")
        except BaseException:
            _rollback(conn)
            conn.close()
            raise
        return conn

    def _remember_identity(self, conn: sqlite3.Connection) -> None:
        """Note which file was opened; a reopening (after a fork) must find the same one."""
        try:
            self._check_identity()
        except BaseException:
            conn.close()
            raise

    def _check_identity(self) -> None:
        try:
            now = _identity(self.path)
        except FileNotFoundError:
            now = None
        except OSError as exc:
            raise EngineUnavailableError(f"cannot stat SQLite database {self.path}: {exc}") from exc
        if now is not None and self._identity in (None, now):
            self._identity = now
            return
        how = "deleted" if now is None else "replaced by another file"
        raise StoreReplacedError(
            f"SQLite database {self.path} was {how} while this client used it: its leases "
            "cannot be kept, and a new client would start a new store", path=self.path)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[_SqliteTxn]:
        with self._mutex, _translated(self.path):
            if self._conn is None:
                self._conn = self._connect()
            conn = self._conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                txn = _SqliteTxn(conn, self._clock)
                yield txn
                self._calls += 1
                if self._calls % _SWEEP_EVERY == 0:
                    txn.sweep(txn.now_ms())
                self._check_identity()  # a commit into an unlinked file would be seen by nobody
                conn.execute("COMMIT")
            except BaseException:
                _rollback(conn)
                raise

    def notify_released(self, names: Sequence[str]) -> None:
        if self.wake is not None:
            self.wake.notify(names)

    def after_fork(self) -> None:
        # Closing the parent's connection here could checkpoint or unlink the WAL under the
        # parent's feet (the child does not inherit its file locks), so keep it unclosed.
        # The child connects at its first call: opening now could wait for another
        # process's write inside os.fork() itself.
        if self._conn is not None:
            _ABANDONED.append(self._conn)
        self._conn = None
        self._mutex = threading.Lock()

    def close(self) -> None:
        _LIVE.discard(self)
        with self._mutex:
            if self._conn is not None:
                self._conn.close()
        if self.wake is not None:
            self.wake.close()


def _has_schema(conn: sqlite3.Connection) -> bool:
    marks = ",".join("?" * len(_SCHEMA_OBJECTS))
    (found,) = conn.execute(
        f"SELECT count(*) FROM sqlite_master WHERE name IN ({marks})", _SCHEMA_OBJECTS
    ).fetchone()
    return int(found) == len(_SCHEMA_OBJECTS)


def _rollback(conn: sqlite3.Connection) -> None:
    """Roll back what is still open, keeping the error that caused it the one reported."""
    # SQLite rolls back by itself on some errors (a full disk); a second ROLLBACK would then
    # fail and hide the cause. A rollback failing too leaves SQLite to undo it at next use.
    if conn.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")


_ABANDONED: list[sqlite3.Connection] = []
_LIVE: weakref.WeakSet[SqliteStorage] = weakref.WeakSet()
_HELD_ACROSS_FORK: list[SqliteStorage] = []


def _before_fork() -> None:
    # SQLite keeps one in-memory lock state per file for all of a process's connections, and
    # a child inherits it: forked mid-transaction (say, the renewer's), the child's new
    # connection believes the file locked and hangs. So a fork waits for any call in flight.
    for storage in list(_LIVE):
        storage._mutex.acquire()
        _HELD_ACROSS_FORK.append(storage)
    _OPENING.acquire()  # last: a call in flight may be (re)connecting under its mutex


def _after_fork_in_parent() -> None:
    _OPENING.release()
    while _HELD_ACROSS_FORK:
        _HELD_ACROSS_FORK.pop()._mutex.release()


def _after_fork_in_child() -> None:
    _OPENING.release()
    while _HELD_ACROSS_FORK:
        _HELD_ACROSS_FORK.pop()._mutex = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def _translated(path: str) -> Iterator[None]:
    """SQLite's exceptions become queen_sync's at the engine boundary."""
    try:
        yield
    except sqlite3.OperationalError as exc:
        text = str(exc)
        if _is_full(exc):
            raise EngineError(f"SQLite database {path} cannot grow: {text}; nothing of this "
                              "call was written (free disk space, or raise max_page_count)"
                              ) from exc
        if "locked" in text or "busy" in text:
            raise EngineUnavailableError(f"SQLite database {path} stayed locked: {text}") from exc
        raise EngineUnavailableError(f"SQLite database {path} is unusable: {text}") from exc
    except sqlite3.DatabaseError as exc:
        raise EngineError(f"SQLite database {path} failed: {exc}") from exc


_SQLITE_FULL = 13  # SQLite's primary result code; ``sqlite3`` names it from Python 3.11 only


def _is_full(exc: sqlite3.OperationalError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)  # set from Python 3.11
    if isinstance(code, int):
        return code & 0xFF == _SQLITE_FULL
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
        # Only a file that does not exist yet is opened: no client of this process can hold
        # locks on it, so closing the descriptor drops none.
        with _OPENING, contextlib.suppress(FileExistsError):
            os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as exc:
        raise EngineUnavailableError(f"cannot open SQLite database {path}: {exc}") from exc


def path_from_url(url: str) -> tuple[str, dict[str, str]]:
    """``sqlite:///abs/path.db`` → ``/abs/path.db``; ``sqlite:rel.db`` → ``rel.db``."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise RequestError(
            f"sqlite URL {url!r} names a host; write sqlite:///absolute/path.db", code="bad_url"
        )
    path = os.path.expanduser(unquote(parts.path))
    if not path:
        raise RequestError(f"sqlite URL {url!r} has no path", code="bad_url")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    return path, query


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
        if synchronous.lower() not in ("off", "normal", "full", "extra"):
            raise ValueError(f"synchronous must be off, normal, full or extra, not {synchronous!r}")
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
        if "synchronous" in query:
            options.setdefault("synchronous", query["synchronous"])
        if "busy_timeout" in query:
            options.setdefault("busy_timeout", float(query["busy_timeout"]))
        return cls(path, **options)

    @property
    def url(self) -> str:
        return f"sqlite://{self.path}"

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

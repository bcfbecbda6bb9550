"""Fenced batch export: partitions written under a lock, so a stale holder cannot win.

```python
import tempfile
import queen_sync as qs
from queen_sync.recipes.fenced_export import FencedDirectory, FencedExport

with qs.Queen() as q, tempfile.TemporaryDirectory() as out:
    export = FencedExport(q, "daily-sales", FencedDirectory(out), ttl="1m")
    report = export.run(["2024-01-01", "2024-01-02"], lambda day: f"sales for {day}\\n")
    print(report.written, report.skipped)        # ['2024-01-01', '2024-01-02'] []
    print(FencedDirectory(out).read("2024-01-01"))  # b'sales for 2024-01-01\\n'
    export.reset()                                # forget the progress (to export again)
```

A holder that pauses past its lease (a GC pause, a suspended VM) wakes up still
believing it holds the lock and goes on writing. Two things stop it from
overwriting the newer holder's work:

* every write carries the token the partition was produced under, and the sink
  refuses a token lower than the highest it has accepted (``FencedOutError``
  with the presented and current tokens);
* progress is checkpointed with a guarded transaction, so a new holder resumes
  after the partitions the old one finished, and a stale holder's checkpoint
  does not commit.

Sinks:
    ``FencedDirectory(path)`` keeps its token high-water mark as file names under
    ``.fence/`` created exclusively (never rewritten, never rewound). Each file is
    published as ``<name>@<token>`` by ``link`` from a complete temporary file, so
    a name never appears half-written; a newer token's version of a partition
    removes the older ones, and a version whose token was overtaken while it was
    being published is withdrawn by its writer. Readers take the highest version.

    ``FencedKv(q, ns)`` writes each partition as one key through
    ``q.transaction().guard(lock)``, so the check and the write are one atomic step.

    ``FencedTable(q, conn, "schema.table")`` (PostgreSQL only: the engine's
    ``user_table_fencing`` capability; other engines refuse it when it is built)
    upserts one row per partition of a table of your own, in one transaction on
    your psycopg connection that starts with ``lock.fence(conn)``: a replaced
    holder's write commits nothing, and a row never goes back to a lower token.

What it does not do: fence side effects outside the sink (an email sent, an API
called). Put those behind the same token, or make them idempotent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Protocol, Union, overload

from typing_extensions import deprecated

import queen_sync as qs
from queen_sync import Duration

from ._arbitration import require_arbitration
from ._callables import check_function
from ._client_arg import the_client
from ._fence_checks import check_name, check_token, current_token, fenced_out
from ._sql_sink import FencedTable

__all__ = ["ExportReport", "FencedDirectory", "FencedExport", "FencedKv", "FencedSink",
           "FencedTable"]

log = logging.getLogger("queen_sync.recipes")

_MAX_KEY_BYTES = 1024  # the longest KV key every engine accepts
_MAX_PARTITION_BYTES = 200  # the longest partition name (check_name)
# A read finding its version removed lists again: each removal means a newer one is there.
_READ_TRIES = 64

#: Where export progress is checkpointed: ``<export name>/<partition>`` per finished partition.
#: A partition name never contains ``/``, so the key's last ``/`` ends the export's name.
PROGRESS_NS = "queen-sync.export"


class FencedSink(Protocol):
    """Where ``FencedExport`` writes: refuses a write fenced below what it has accepted."""

    def write(self, name: str, data: Any, *, token: int,
              lock: Optional[qs.Lock] = None) -> object:
        """Store ``data`` as ``name``; raise ``FencedOutError`` if ``token`` is superseded."""


class FencedDirectory:
    """A directory that refuses writes fenced below the highest token it has accepted.

    Give each export (each lock name) a directory of its own: the mark is one for every
    name written here, and tokens of different locks come from one counter, so a second
    export writing into it would fence the first one out although it still holds its lock.

    Args:
        path: the directory (created if missing). ``.fence/`` and ``.tmp/`` inside it
            are the sink's own.
    """

    def __init__(self, path: Union[str, os.PathLike[str]]) -> None:
        self.path = Path(path)
        self._fence = self.path / ".fence"
        self._tmp = self.path / ".tmp"
        for folder in (self.path, self._fence, self._tmp):
            folder.mkdir(parents=True, exist_ok=True)

    def token(self) -> int:
        """The high-water mark: the highest token ever accepted (0 when none)."""
        return max((int(n) for n in os.listdir(self._fence) if n.isdigit()), default=0)

    def write(self, name: str, data: Any, *, token: int, lock: Optional[qs.Lock] = None) -> Path:
        """Publish ``data`` (bytes or str) as ``name`` under ``token``; returns the file.

        Raises:
            FencedOutError: ``token`` is below the high-water mark, before or while
                publishing (the file is then withdrawn).
            TypeError, ValueError: a bad name, token or data (before any I/O).
        """
        check_name(name)
        check_token(token)
        body = data.encode("utf-8") if isinstance(data, str) else data
        if not isinstance(body, bytes):
            raise TypeError(f"data must be bytes or str, got {type(data).__name__}")
        self._raise_mark(name, token)
        final = self.path / f"{name}@{token}"
        tmp = self._tmp / f"{name}@{token}.{secrets.token_hex(6)}"
        with open(tmp, "xb") as handle:
            handle.write(body)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(tmp, final)
        except FileExistsError:
            os.replace(tmp, final)  # the same holding rewrites its own version
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        # The mark may have risen while this version was being published: withdraw it.
        current = self.token()
        if current > token:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(final)
            raise fenced_out(name, token, current)
        self._drop_older(name, token)
        return final

    def _raise_mark(self, name: str, token: int) -> None:
        current = self.token()
        if token < current:
            raise fenced_out(name, token, current)
        if token > current:
            with contextlib.suppress(FileExistsError):
                os.close(os.open(self._fence / f"{token:020d}", os.O_CREAT | os.O_EXCL, 0o644))
        current = self.token()
        if token < current:
            raise fenced_out(name, token, current)

    def _drop_older(self, name: str, token: int) -> None:
        for older, version in self._versions(name):
            if version < token:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(older)

    def _versions(self, name: str) -> list[tuple[Path, int]]:
        found = []
        for entry in os.listdir(self.path):
            stem, _, tail = entry.rpartition("@")
            if stem == name and tail.isdigit():
                found.append((self.path / entry, int(tail)))
        return found

    def files(self) -> dict[str, tuple[int, Path]]:
        """Every name in the directory with its winning (highest-token) version.

        A writer publishing a newer version removes the older one, so a path listed here
        may be gone when opened: ``read(name)`` looks again.
        """
        best: dict[str, tuple[int, Path]] = {}
        for entry in os.listdir(self.path):
            stem, _, tail = entry.rpartition("@")
            if stem and tail.isdigit() and int(tail) > best.get(stem, (0, self.path))[0]:
                best[stem] = (int(tail), self.path / entry)
        return dict(sorted(best.items()))

    def read(self, name: str) -> bytes:
        """The winning version of ``name``.

        Raises:
            FileNotFoundError: nothing was ever published as ``name``.
        """
        check_name(name)
        for _ in range(_READ_TRIES):
            versions = self._versions(name)
            if not versions:
                raise FileNotFoundError(f"{name!r} was never published in {self.path}")
            try:
                return max(versions, key=lambda pair: pair[1])[0].read_bytes()
            except FileNotFoundError:
                continue  # a newer version was published, and this one removed, meanwhile
        raise FileNotFoundError(f"{name!r} in {self.path} was replaced by a newer version "
                                f"{_READ_TRIES} times while being read; read it again")

    def __repr__(self) -> str:
        return f"<FencedDirectory {str(self.path)!r} token={self.token()}>"


class FencedKv:
    """A KV namespace written through ``client.transaction().guard(lock)``: one key per partition.

    Args:
        client: the client (``q=`` is a deprecated spelling of this keyword).
        ns: the namespace to write into.
        prefix: prepended to every key (at most 824 UTF-8 bytes, no control characters).

    Raises:
        TypeError, ValueError: a bad client, namespace or prefix (``RequestError`` is a
            ``ValueError``), before any I/O.
    """

    @overload
    def __init__(self, client: qs.Queen, ns: str, *, prefix: str = "") -> None: ...

    @overload
    @deprecated("FencedKv(q=...) is deprecated: pass client=...")
    def __init__(self, *, q: qs.Queen, ns: str, prefix: str = "") -> None: ...

    def __init__(self, client: Optional[qs.Queen] = None, ns: Optional[str] = None, *,
                 prefix: str = "", q: Optional[qs.Queen] = None) -> None:
        self._q = the_client(client, q, "FencedKv")
        if not isinstance(ns, str):
            raise TypeError(f"the namespace ns must be a str, got {type(ns).__name__}")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        room = _MAX_KEY_BYTES - _MAX_PARTITION_BYTES
        if len(prefix.encode("utf-8", "surrogatepass")) > room:
            raise ValueError(f"prefix must be at most {room} UTF-8 bytes, so that every "
                             f"partition name fits in a key, got {prefix[:40]!r}...")
        op = self._q.kv.op
        op.get(ns, "p")  # checks the namespace as the store does (RequestError), no I/O
        try:
            op.get(ns, prefix + "p")
        except qs.RequestError as exc:
            raise ValueError(f"prefix {prefix[:40]!r} cannot start a key: {exc}") from exc
        self.ns = ns
        self.prefix = prefix

    def write(self, name: str, data: Any, *, token: int, lock: Optional[qs.Lock] = None) -> None:
        """Store ``data`` (JSON) at ``prefix + name`` if ``lock`` still holds its permit.

        ``name`` follows the rule of every fenced sink: 1..200 UTF-8 bytes, not starting
        with ``.``, without ``/``, ``\\``, NUL or another control character.

        Raises:
            FencedOutError: the lock's permit moved on (another holder) or is gone.
            TypeError: no ``lock`` given (the guard needs the handle, not just a token).
            TypeError, ValueError: a bad name or token (before any I/O).
        """
        if lock is None:
            raise TypeError("FencedKv.write needs lock= (its guard is checked in the store)")
        check_name(name)
        check_token(token)
        txn = self._q.transaction().guard(lock)
        txn.kv.put(self.ns, self.prefix + name, {"data": data, "token": token}, forever=True)
        _guarded_commit(self._q, txn, lock, token, what=f"{self.ns}/{self.prefix}{name}")

    def read(self, name: str) -> Any:
        """The data last stored as ``name`` (KeyError when there is none)."""
        answer = self._q.kv.get(self.ns, self.prefix + name)
        if not answer:
            raise KeyError(name)
        return answer["value"]["data"]


def _guarded_commit(q: qs.Queen, txn: qs.Transaction, lock: qs.Lock, token: int, *,
                    what: str) -> None:
    """Commit ``txn``; a lost guard (or a lock no longer held) is ``FencedOutError``."""
    try:
        answer = txn.commit()
    except qs.LockNotHeldError as exc:
        raise fenced_out(what, token, current_token(q, lock)) from exc
    if not answer:
        current = answer.get("version") if answer.get("failedIndex") == 0 else None
        raise fenced_out(what, token, current if current else current_token(q, lock))


def _partition_list(partitions: Any) -> list[str]:
    """``run``'s partitions, every name checked, refused whole before the lock is taken."""
    if isinstance(partitions, (str, bytes)):
        # A str iterates as its characters: "2024-01-01" would export "2", "0", ...
        raise TypeError(f"partitions must be an iterable of names, not one "
                        f"{type(partitions).__name__} ({partitions!r}); pass [{partitions!r}]")
    parts = [check_name(partition) for partition in partitions]
    twice = sorted(name for name, count in Counter(parts).items() if count > 1)
    if twice:
        raise ValueError(f"partitions {', '.join(map(repr, twice))} are listed more than once; "
                         "each partition is exported once per run")
    return parts


@dataclass(frozen=True)
class ExportReport:
    """What one ``FencedExport.run`` did."""

    acquired: bool
    written: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=dict)


class FencedExport:
    """Export partitions in order under the lock ``name``, resuming after finished ones.

    Args:
        client: the client (``q=`` is a deprecated spelling of this keyword).
        name: the export's name: its lock name and the key of its progress.
        sink: a ``FencedDirectory``, a ``FencedKv``, or anything with their ``write``.
        ttl: the lease's lifetime (renewed in the background while exporting).
        wait: how long ``run`` waits for the lock (default: one attempt).

    Raises:
        UnsupportedOperationError: the client's engine lacks ``fencing`` or
            ``engine_clock_expiry`` (``capability`` names which).
        TypeError, ValueError: a bad client, name, sink (no ``write`` method), ttl or
            wait, before any I/O.
    """

    @overload
    def __init__(self, client: qs.Queen, name: str, sink: FencedSink, *, ttl: Duration,
                 wait: Optional[Duration] = 0) -> None: ...

    @overload
    @deprecated("FencedExport(q=...) is deprecated: pass client=...")
    def __init__(self, *, q: qs.Queen, name: str, sink: FencedSink, ttl: Duration,
                 wait: Optional[Duration] = 0) -> None: ...

    def __init__(self, client: Optional[qs.Queen] = None, name: Optional[str] = None,
                 sink: Optional[FencedSink] = None, *, ttl: Duration,
                 wait: Optional[Duration] = 0, q: Optional[qs.Queen] = None) -> None:
        self._q = the_client(client, q, "FencedExport")
        require_arbitration(self._q, "FencedExport")
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        if sink is None or not callable(getattr(sink, "write", None)):
            raise TypeError("FencedExport() needs a sink with a write(name, data, *, token, "
                            f"lock) method (a FencedDirectory or a FencedKv), got {sink!r:.60}")
        self.name = name
        self.sink = sink
        self._lock_args: dict[str, Any] = {"ttl": ttl, "wait": wait}
        self._q.lock(name, ttl=ttl, wait=wait)  # validates name, ttl and wait before any I/O

    def finished(self) -> list[str]:
        """The partitions whose export was checkpointed, by any holder."""
        return [row["key"][len(self.name) + 1:] for row in self._progress()]

    def _progress(self) -> list[dict[str, Any]]:
        """This export's checkpoint rows (keys only), and none of another export's."""
        prefix = self.name + "/"
        rows = self._q.kv.list_all(PROGRESS_NS, prefix, keys_only=True)
        # A '/' after the prefix: the checkpoint of an export named within this one's
        # ("sales/eu" under "sales"), since a partition name has none.
        return [row for row in rows if "/" not in row["key"][len(prefix):]]

    def run(self, partitions: Iterable[str], produce: Callable[[str], Any]) -> ExportReport:
        """Take the lock, write ``produce(p)`` for each unfinished partition, release.

        Each partition is produced under the token current when it starts, written
        with that token, then checkpointed (guarded). Every partition name is checked
        before the lock is taken, by the rule every fenced sink shares (1..200 UTF-8
        bytes, not starting with ``.``, without ``/``, ``\\``, NUL or another control
        character).

        Returns:
            an ``ExportReport``; ``acquired`` is False when another holder has the lock.

        Raises:
            FencedOutError: a write or checkpoint was refused, or the lease was lost
                before a partition started (its ``__cause__``, a ``LockLostError``, says
                why): another holder may have taken over; stop rather than retry.
            TypeError: ``partitions`` is one str (or bytes), not a list of names; or
                ``produce`` is not callable, or is a generator or async function.
            TypeError, ValueError: a bad partition name, or one listed more than once
                (nothing was written).
        """
        parts = _partition_list(partitions)
        check_function(produce, "FencedExport.run()'s produce")
        lock = self._q.lock(self.name, **self._lock_args)
        if not lock.acquire():
            return ExportReport(acquired=False)
        report = ExportReport(acquired=True)
        try:
            done = set(self.finished())
            for partition in parts:
                if partition in done:
                    report.skipped.append(partition)
                    continue
                self._export_one(lock, partition, produce, report)
        finally:
            lock.release()
        return report

    def _export_one(self, lock: qs.Lock, partition: str, produce: Callable[[str], Any],
                    report: ExportReport) -> None:
        token = lock.token
        if token is None:
            token = self._still_held(lock, partition)
        data = produce(partition)
        self.sink.write(partition, data, token=token, lock=lock)
        txn = self._q.transaction().guard(lock)
        txn.kv.put(PROGRESS_NS, f"{self.name}/{partition}", {"token": token}, forever=True)
        _guarded_commit(self._q, txn, lock, token, what=f"progress of {self.name}/{partition}")
        report.written.append(partition)
        report.tokens[partition] = token
        log.info("export %r wrote %r with token %s", self.name, partition, token)

    def _still_held(self, lock: qs.Lock, partition: str) -> int:
        """The token of a lease found unheld before ``partition``, or the fenced-out error.

        A holder whose lease lapsed is fenced out, the error ``run`` promises; the
        ``LockLostError`` behind it (its ``__cause__``) says why.
        """
        what = f"{self.name}/{partition}"
        try:
            lock.check()
        except qs.LockLostError as exc:
            raise fenced_out(what, lock.last_token or 0, current_token(self._q, lock)) from exc
        token = lock.token  # renewed just as it was first read
        if token is None:
            raise fenced_out(what, lock.last_token or 0, current_token(self._q, lock))
        return token

    def reset(self) -> int:
        """Forget every checkpoint (the next run exports everything); returns how many."""
        rows = self._progress()
        for row in rows:
            self._q.kv.delete(PROGRESS_NS, row["key"])
        return len(rows)

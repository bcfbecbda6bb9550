"""A lone acquire, renew or get answered in ONE round trip: SQL decides, the semantics check.

The two-trip path (``txn``) reads the name's rows in one trip and writes in the
next, so the semantics can decide in between. Yet a plain acquire decides simply:
if every live permit of the name is someone else's at this limit and a slot is
free, the lowest free slot is taken with a token drawn after the name's lock; a
renew naming its slot renews the live permit there if the token is its holder's.
That much one statement can do (``scripted_sql``), sent with the name's advisory
lock as one implicit transaction that commits durably when the statement ends (one
pipeline of the two prepared statements, see ``pipeline``).

The statement also returns the name's rows as they stood before it. The semantics
then run on those rows exactly as on the two-trip path, and must arrive at the very
write the statement made (or, when it made none, at an answer that writes nothing:
held, already, a refused limit). An answer that needs a write the statement did not
make raises ``NotScripted`` and runs again on the two-trip path; nothing was
written. A write the semantics would not have made is a bug and raises loudly.

A connection lost while the script runs leaves it unknown whether it committed; the
storage then runs the body again, which is safe for an acquire since it names its
owner: the owner's permit, if granted, is answered again (``already``), and a renew
resent with the token it presented renews again (the token its last renew presented
still renews, from its owner).
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any, Mapping, Optional, Sequence

import psycopg

from ..._errors import EngineError
from ..._ops import LOCKS_NS, permit_key
from ..storage import Row
from . import pipeline
from .sql import Statement, Statements
from .txn import entity_of, lock_statements


class NotScripted(Exception):
    """The answer needs more than the statement did: the body runs on the two-trip path."""


def scriptable(op: Optional[Mapping[str, Any]]) -> bool:
    """Whether a lone lock op can be answered by one statement: an owned acquire, an owned
    renew naming its slot, a get.

    The statement commits as it ends, so a lost answer means the body runs again; only an
    owner's resend is recognised by the acquire and renew rules, hence the owner.
    """
    if op is None:
        return False
    owned = bool(op.get("owner"))
    return (op["op"] == "get" or (op["op"] == "acquire" and owned)
            or (op["op"] == "renew" and owned and "slot" in op))


def _number(cell: Optional[bytes]) -> Optional[int]:
    return None if cell is None else int(cell)


def _row(record: Sequence[Optional[bytes]], encoding: str) -> Row:
    """A row of the name from its columns as text (``_COLUMNS`` of ``scripted_sql``)."""
    ns, key, value, version, expires_at, created_at, updated_at, prev = record
    assert ns is not None and key is not None and value is not None  # NOT NULL columns
    assert version is not None and created_at is not None and updated_at is not None
    return Row(ns.decode(encoding), key.decode(encoding), json.loads(value.decode(encoding)),
               int(version), _number(expires_at), int(created_at), int(updated_at),
               _number(prev))


def _last_result(cur: psycopg.Cursor[Any], statements: Sequence[Statement]
                 ) -> list[tuple[Optional[bytes], ...]]:
    """Send statements as one pipeline; the rows the last one returned, as text."""
    results = pipeline.send(cur, statements)
    return results[-1]


def _permit_value(op: Mapping[str, Any]) -> dict[str, Any]:
    return {"owner": op["owner"], "limit": op.get("limit", 1)}


@functools.lru_cache(maxsize=1024)  # a handle acquires again and again as one owner
def _permit_json(owner: str, limit: int) -> str:
    """The permit's value as the storage writes it."""
    return json.dumps({"owner": owner, "limit": limit}, separators=(",", ":"))


def one_trip_script(sql: Statements, op: Mapping[str, Any]) -> list[Statement]:
    """The one trip that answers ``op``: the name's lock, then the statement whose rows answer."""
    name = op["name"]
    bounds = (LOCKS_NS, name + "#", name + "$")
    locks = lock_statements(sql, ["L" + name])
    ttl_ms = int(op.get("ttlSeconds", 0)) * 1000
    if op["op"] == "acquire":
        limit = op.get("limit", 1)
        value = _permit_json(op["owner"], limit)
        statement = sql.acquire_alone_scripted if limit == 1 else sql.acquire_scripted
        return [*locks, (statement, (*bounds, limit, op["owner"], value, ttl_ms))]
    if op["op"] == "renew":
        return [*locks, (sql.renew_scripted, (*bounds, permit_key(name, op["slot"]),
                                              op["token"], op.get("owner"), ttl_ms))]
    return [*locks, (sql.peek, bounds)]


class ScriptedTxn:
    """``StorageTxn`` answered from what one statement read and wrote, already committed.

    Args:
        cur: a cursor on the attempt's connection (no transaction open).
        sql: the schema's statements.
        op: the body's one lock operation (``scriptable``).
    """

    def __init__(self, cur: psycopg.Cursor[Any], sql: Statements, op: Mapping[str, Any]) -> None:
        name = op["name"]
        self._name = name
        self.unplanned: set[str] = set()
        sent = time.monotonic()
        records = _last_result(cur, one_trip_script(sql, op))
        encoding = cur.connection.info.encoding
        now, key, token = records[0][0], records[0][1], records[0][2]
        assert now is not None  # the clock is never NULL
        self._now = int(now)
        self.clock = (self._now, sent)  # the database's clock, and when it was asked
        rows = [_row(r[3:], encoding) for r in records if r[3] is not None]
        self._rows: dict[tuple[str, str], Optional[Row]] = {(r.ns, r.key): r for r in rows}
        self._made = None if key is None or token is None else self._written(
            op, key.decode(encoding), int(token))
        self._drawn = False
        self._wrote = False

    def _written(self, op: Mapping[str, Any], key: str, token: int) -> Row:
        """The row the statement wrote, as the semantics would have written it."""
        expires_at = self._now + int(op["ttlSeconds"]) * 1000
        if op["op"] == "acquire":
            return Row(LOCKS_NS, key, _permit_value(op), token, expires_at, self._now, self._now)
        old = self._rows[(LOCKS_NS, key)]
        assert old is not None  # the statement renewed a row it read
        return Row(LOCKS_NS, key, old.value, token, expires_at, old.created_at, self._now,
                   prev_version=op["token"])

    @property
    def wrote(self) -> bool:
        """Whether the statement wrote (and committed) a permit."""
        return self._made is not None

    def disagree(self, what: str) -> EngineError:
        return EngineError(
            f"PostgreSQL's one-statement call on {self._name!r} wrote {self._made} but the "
            f"semantics {what}; please report this (the permit stays until its TTL)",
            committed=0 if self._made is None else 1)

    def _need(self, what: str) -> NotScripted:
        if self._made is not None:
            raise self.disagree(what)
        return NotScripted(what)

    def now_ms(self) -> int:
        return self._now

    def read(self, ns: str, key: str, *, now_ms: int) -> Optional[Row]:
        if ns != LOCKS_NS or entity_of(ns, key) != "L" + self._name:
            raise self._need(f"read {ns}/{key}")
        row = self._rows.get((ns, key))
        return row if row is not None and row.live_at(now_ms) else None

    def read_prefix(self, ns: str, prefix: str, *, after: Optional[str], limit: int,
                    now_ms: int) -> list[Row]:
        if ns != LOCKS_NS or prefix != self._name + "#":
            raise self._need(f"scanned {ns}/{prefix}*")
        rows = [row for row in self._rows.values() if row is not None and row.live_at(now_ms)
                and row.key > (after or "")]
        return sorted(rows, key=lambda row: row.key)[:limit]

    def next_version(self) -> int:
        if self._made is None or self._drawn:
            raise self._need("drew a version")
        self._drawn = True
        return self._made.version

    def write(self, row: Row) -> None:
        if row != self._made or self._wrote:
            raise self._need(f"wrote {row}")
        self._wrote = True

    def delete(self, ns: str, key: str) -> None:
        raise self._need(f"deleted {ns}/{key}")

    def freed(self, name: str) -> None:
        raise self._need(f"freed {name!r}")

    def rows(self) -> dict[tuple[str, str], Optional[Row]]:
        """The name's rows as the statement left them (``None``: known absent)."""
        if self._made is None:
            return self._rows
        return {**self._rows, (self._made.ns, self._made.key): self._made}

    def commit_script(self) -> list[Statement]:
        """Nothing: the statement committed; only checks the semantics wrote what it did."""
        if self._made is not None and not self._wrote:
            raise self.disagree("wrote nothing")
        return []

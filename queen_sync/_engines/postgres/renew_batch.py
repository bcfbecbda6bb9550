"""A transaction of renews (a renewer's tick) answered in ONE round trip, checked by the semantics.

When every op of a body is a renew naming its slot and owner, each on a name of its
own, one statement (``scripted_sql``'s ``renew_many``) applies the renew rule to all
of them, sent with the names' advisory locks (sorted, one statement) as one implicit
transaction that commits when it ends. It returns each renew's slot row as it stood
before it, with the token it wrote there if it renewed it, and every row of the name
of each renew it refused (whose answer lists the name's holders).

As for a lone renew (``scripted``), the semantics then run on those rows and must
arrive at exactly the writes the statement made: a renew it refused is answered
from the rows read, a renew it made must be the one the semantics make, in order.
Anything else is a bug in one of the two copies of the rule and raises loudly.
Resending the body after a lost connection is safe: each renew names its owner, and
the token it presented still renews for its owner (it is the row's floor). A body too
big for one transaction travels as a pipeline of such transactions (``renew_ahead``),
each answered from its rows here.
"""

from __future__ import annotations

import json
import time
from typing import Any, Mapping, Optional, Sequence

import psycopg

from ..._errors import EngineError
from ..._ops import LOCKS_NS, permit_key
from ..storage import Row
from .scripted import NotScripted
from .sql import Statements, array_literal
from .txn import entity_of, lock_statements

_decoder = json.JSONDecoder()


def _parsed(text: str) -> Any:
    """A value from its stored JSON text (the statement sends the text, not the value).

    What this engine stores has no whitespace around it, so the decoder's scan alone
    reads it, at a third of a full decode's cost; anything else takes the full decode.
    """
    try:
        value, end = _decoder.raw_decode(text)
    except ValueError:
        return _decoder.decode(text)  # raises the decoder's own error if it is not JSON
    return value if end == len(text) else _decoder.decode(text)


def batch_of_renews(ops: Sequence[Mapping[str, Any]]) -> bool:
    """Whether one statement may answer these ops: two or more renews, each naming its
    slot and owner, with a lifetime, on names no other op of the body names."""
    return len(ops) > 1 and renews_of_own_names(ops)


def renews_of_own_names(ops: Sequence[Mapping[str, Any]]) -> bool:
    """Whether these ops are renews, each naming its slot and owner, with a lifetime, on
    names no other op of them names: what ``renew_many`` answers, one or many."""
    return all(
        op["op"] == "renew" and "slot" in op and op.get("owner") and "ttlSeconds" in op
        and not op.get("forever") for op in ops) and len({op["name"] for op in ops}) == len(ops)


def slot_keys(ops: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """The renews of a batch by the key of the slot each renews (what each reads)."""
    return {permit_key(op["name"], op["slot"]): op for op in ops}


def renewal_parameters(ops: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> tuple[str, ...]:
    """``renew_many``'s parameters for these renews (``keys``: their slot keys, in order)."""
    return (LOCKS_NS, array_literal(op["name"] for op in ops), array_literal(keys),
            array_literal(op["token"] for op in ops), array_literal(op["owner"] for op in ops),
            array_literal(int(op["ttlSeconds"]) * 1000 for op in ops))


class RenewedTxn:
    """``StorageTxn`` answered from what one statement read and wrote, already committed.

    Args:
        cur: a cursor on the attempt's connection (no transaction open).
        sql: the schema's statements.
        ops: the body's renews (``batch_of_renews``).
    """

    def __init__(self, cur: psycopg.Cursor[Any], sql: Statements,
                 ops: Sequence[Mapping[str, Any]]) -> None:
        by_key = slot_keys(ops)
        sent = time.monotonic()
        self._answer(by_key, self._send(cur, sql, ops, list(by_key)), sent)

    @classmethod
    def answering(cls, by_key: Mapping[str, Mapping[str, Any]], records: Sequence[Any],
                  sent: float) -> RenewedTxn:
        """The transaction of renews whose statement, sent at ``sent`` (``time.monotonic()``)
        and committed, returned ``records``; ``by_key``: its ops by slot key (``slot_keys``)."""
        txn = cls.__new__(cls)
        txn._answer(by_key, records, sent)
        return txn

    def _answer(self, by_key: Mapping[str, Mapping[str, Any]], records: Sequence[Any],
                sent: float) -> None:
        self.unplanned: set[str] = set()
        self._names = {op["name"] for op in by_key.values()}
        self._now = int(records[0][0])
        self.clock = (self._now, sent)  # the database's clock, and when it was asked
        self._rows: dict[tuple[str, str], Optional[Row]] = {}
        self._by_name: dict[str, list[Row]] = {}
        self._ops = by_key
        self._tokens: dict[str, int] = {}  # slot key -> the token the statement wrote there
        self._read(records)
        # Only a refused renew's name was read whole: a renewed one is its slot row alone.
        self._whole = {op["name"] for key, op in by_key.items() if key not in self._tokens}
        self._next: Optional[str] = None  # the key whose renewal the semantics are making
        self._written: dict[tuple[str, str], Row] = {}  # the rows they wrote, each checked

    def _read(self, records: Sequence[Any]) -> None:
        """The rows as they stood, by key and by name, and the tokens written.

        A tick reads thousands: no row is built here that the semantics do not read.
        """
        rows, by_name, tokens = self._rows, self._by_name, self._tokens
        for record in records:
            key = record[4]
            if key is None:
                continue  # the empty slot of a refused renew
            value = record[5]
            row = Row(record[3], key, None if value is None else _parsed(value), record[6],
                      record[7], record[8], record[9], record[10])
            rows[(record[3], key)] = row
            if record[1] is not None:
                tokens[key] = int(record[1])
            else:
                by_name.setdefault(record[2], []).append(row)

    @staticmethod
    def _send(cur: psycopg.Cursor[Any], sql: Statements, ops: Sequence[Mapping[str, Any]],
              keys: Sequence[str]) -> list[Any]:
        locks = lock_statements(sql, ["L" + op["name"] for op in ops])
        statements = [*locks, (sql.renew_many, renewal_parameters(ops, keys))]
        cur.execute("; ".join(q for q, _ in statements), [p for _, ps in statements for p in ps])
        while cur.nextset():
            pass
        return cur.fetchall()

    @property
    def wrote(self) -> bool:
        """Whether the statement wrote (and committed) a permit."""
        return bool(self._tokens)

    def disagree(self, what: str) -> EngineError:
        """The error for a statement the semantics would not have run: raised after it
        committed, so it says how many renewals it made (``committed``)."""
        return EngineError(
            f"PostgreSQL's one-statement renewal of {len(self._names)} leases renewed and "
            f"committed {len(self._tokens)} of them, but the semantics {what}; please report "
            "this (those renewals stand: resending them as the same owner renews them again)",
            committed=len(self._tokens))

    def _need(self, what: str) -> NotScripted:
        if self._tokens:
            raise self.disagree(what)
        return NotScripted(what)

    def now_ms(self) -> int:
        return self._now

    def read(self, ns: str, key: str, *, now_ms: int) -> Optional[Row]:
        if ns != LOCKS_NS or (key not in self._ops
                              and entity_of(ns, key)[1:] not in self._whole):
            raise self._need(f"read {ns}/{key}")
        # A renew reads its slot first: what it then writes must be what the statement did.
        self._next = key if key in self._tokens else None
        row = self._rows.get((ns, key))
        return row if row is not None and row.live_at(now_ms) else None

    def read_prefix(self, ns: str, prefix: str, *, after: Optional[str], limit: int,
                    now_ms: int) -> list[Row]:
        name = prefix[:-1]
        if ns != LOCKS_NS or not prefix.endswith("#") or name not in self._whole:
            raise self._need(f"scanned {ns}/{prefix}*")
        rows = [row for row in self._by_name.get(name, ())
                if row.live_at(now_ms) and row.key > (after or "")]
        return sorted(rows, key=lambda row: row.key)[:limit]

    def next_version(self) -> int:
        if self._next is None:
            raise self._need("drew a version")
        return self._tokens[self._next]

    def write(self, row: Row) -> None:
        key = self._next
        if key is None or not self._as_written(row, key) or (LOCKS_NS, key) in self._written:
            raise self._need(f"wrote {row}")
        self._written[(LOCKS_NS, key)] = row
        self._next = None

    def _as_written(self, row: Row, key: str) -> bool:
        """Whether ``row`` is exactly what the statement wrote at ``key``: its SET clause
        over the row it read (compared field by field: a tick builds no row to compare)."""
        old, op, now = self._rows[(LOCKS_NS, key)], self._ops[key], self._now
        assert old is not None  # the statement renewed a row it read
        # The very value object: the statement left the value as it was, and an equal one
        # would not do (1 == True, yet JSON tells them apart).
        return (row.ns == LOCKS_NS and row.key == key and row.value is old.value
                and row.version == self._tokens[key]
                and row.expires_at == now + int(op["ttlSeconds"]) * 1000
                and row.created_at == old.created_at and row.updated_at == now
                and row.prev_version == op["token"])

    def delete(self, ns: str, key: str) -> None:
        raise self._need(f"deleted {ns}/{key}")

    def freed(self, name: str) -> None:
        raise self._need(f"freed {name!r}")

    def rows(self) -> dict[tuple[str, str], Optional[Row]]:
        """The rows the statement read, as it left them (the renewed ones as written)."""
        return {**self._rows, **self._written}

    def commit_script(self) -> list[tuple[str, Sequence[Any]]]:
        """Nothing: the statement committed; only checks the semantics wrote what it did."""
        if len(self._written) != len(self._tokens):
            raise self.disagree(f"wrote {len(self._written)} of them")
        return []

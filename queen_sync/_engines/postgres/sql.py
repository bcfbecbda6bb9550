"""The SQL of the PostgreSQL storage, for one schema.

The statements a body runs are PREPAREd once per pooled connection and sent as
``EXECUTE name(...)``: parsing and planning them again on every call would cost
the server more than running them. A script made only of such forms goes as one
pipeline of Bind/Execute messages instead (``pipeline``). Statements that run
rarely, or on a connection that is not ours (the caller's, for ``fence``), are sent
as text.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Any, Iterable, Sequence

from ..._ops import LOCKS_NS
from .scripted_sql import scripted_statements

SCHEMA_VERSION = 1
COLUMNS = "ns, key, value, version, expires_at, created_at, updated_at, prev_version"
# A body that only releases need not wait for the disk: a release lost in a crash only
# lets the lease run out, and any later durable commit flushes it anyway.
ASYNC_COMMIT = "SET LOCAL synchronous_commit = off"
CLOCK = "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
# Every statement here reads keys by the primary key, a page in key order at most, so an
# ordered index scan is right whatever the statistics say. Before ANALYZE catches up with
# a fast-grown range the planner guesses it holds one row and would pick a bitmap scan
# that reads the whole range to sort out one page (80 ms, not 0.05, at 100,000 rows).
# The same guesses grow a batch's estimated cost with the store's size until JIT compiles
# it: from 100,000 rows, 60 ms for each renewal batch planned for its own arguments (the
# first five on a connection), a statement that runs in 5.
SESSION_PLANNER = "SET enable_bitmapscan = off; SET jit = off"
# The semantics take a name's advisory lock, then read its rows: each statement must see
# what committed before it. A stricter default (a database's, a role's, the URL's options)
# would read the snapshot taken as the lock was asked for, before the commits it waited out.
SESSION_ISOLATION = "SET default_transaction_isolation = 'read committed'"
_ROW_TYPES = "text, text, json, bigint, bigint, bigint, bigint, bigint"
# A row still exactly as remembered ($1-$7), and live or expired alike at the database's
# clock and at the estimate the body decided on ($8).
_GUARD_TYPES = "text, text, bigint, bigint, bigint, bigint, bigint, bigint"
_GUARDED = (
    "ns = $1 AND key = $2 AND version = $3 AND expires_at IS NOT DISTINCT FROM $4"
    " AND created_at = $5 AND updated_at = $6 AND prev_version IS NOT DISTINCT FROM $7"
    f" AND (expires_at IS NULL OR expires_at > ({CLOCK}))"
    " = (expires_at IS NULL OR expires_at > $8)")
_ROW_ARRAYS = ", ".join(f"{t}[]" for t in _ROW_TYPES.split(", "))
# At most this many rows' updates go in one statement: a transaction holds a bounded
# number of operations anyway, and a body of many key/value writes stays a few statements.
UPDATES_PER_STATEMENT = 512
# Past this many entities a body's entities are locked, and their rows fetched, by one
# unprepared statement over arrays.
FETCH_ONE_BY_ONE = 16
# Expired rows one sweep deletes at most.
SWEEP_BATCH = 256

Statement = tuple[str, Sequence[Any]]


def signed32(value: int) -> int:
    return value - (1 << 32) if value >= (1 << 31) else value


def array_literal(values: Iterable[Any]) -> str:
    """PostgreSQL's text form of an array of texts or integers (None: NULL).

    The driver would quote an array element by element, which costs more than the
    statement it feeds; this is the array's input syntax, built in one pass, that the
    driver then quotes once as a single literal. Inside double quotes only a backslash
    and a double quote need escaping.
    """
    items = values if isinstance(values, list) else list(values)
    if all(type(value) is str for value in items):
        joined = '","'.join(items)
        # When the separators hold every double quote and no text a backslash, no text
        # needs escaping: one join builds the array (a tick's keys and owners are such).
        if "\\" not in joined and joined.count('"') == 2 * len(items) - 2:
            return '{"' + joined + '"}'
    elif all(type(value) is int for value in items):
        return "{" + ",".join(map(str, items)) + "}"
    return "{" + ",".join(
        "NULL" if value is None else str(value) if isinstance(value, int)
        else '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        for value in items) + "}"


def channel_for(schema: str) -> str:
    """The LISTEN/NOTIFY channel of one schema (a short digest: channel names are capped)."""
    return "queen_sync_" + hashlib.sha256(schema.encode()).hexdigest()[:16]


def _execute(name: str, arity: int) -> str:
    return f"EXECUTE {name}({', '.join(['%s'] * arity)})" if arity else f"EXECUTE {name}"


class Statements:
    """The SQL of one schema (its name is validated by the engine, so quoting is safe).

    Attributes ending in a statement name hold ``EXECUTE`` forms with ``%s`` placeholders;
    ``prepare`` is the script that defines them on a new connection.
    """

    def __init__(self, schema: str) -> None:
        s = f'"{schema}"'
        kv = f"{s}.kv"
        seq = f"nextval('{s}.version'::regclass)"
        self.schema = schema
        self.lock_class = signed32(zlib.crc32(f"queen_sync:{schema}".encode()))
        self.channel = channel_for(schema)
        self.ddl = (
            f"CREATE SCHEMA IF NOT EXISTS {s};"
            f"CREATE TABLE IF NOT EXISTS {kv} ("
            ' ns text COLLATE "C" NOT NULL, key text COLLATE "C" NOT NULL, value json NOT NULL,'
            " version bigint NOT NULL, expires_at bigint, created_at bigint NOT NULL,"
            " updated_at bigint NOT NULL, prev_version bigint, PRIMARY KEY (ns, key));"
            f"CREATE INDEX IF NOT EXISTS kv_expiry ON {kv} (expires_at)"
            " WHERE expires_at IS NOT NULL;"
            f"CREATE SEQUENCE IF NOT EXISTS {s}.version AS bigint;"
            f"CREATE TABLE IF NOT EXISTS {s}.meta (name text PRIMARY KEY, value bigint NOT NULL);"
            f"INSERT INTO {s}.meta (name, value) VALUES ('schema', {SCHEMA_VERSION})"
            " ON CONFLICT (name) DO UPDATE SET value = GREATEST(meta.value, EXCLUDED.value)"
        )
        self.schema_version = f"SELECT value FROM {s}.meta WHERE name = 'schema'"
        # A random number drawn once per schema, with the database's own number: what
        # tells this store from another under any spelling of its URL. A copy of the
        # database (a template, a restore) keeps the first but never the second.
        self.store_id = (f"SELECT value, (SELECT oid FROM pg_database"
                         f" WHERE datname = current_database()) FROM {s}.meta"
                         " WHERE name = 'store'")
        # Tells servers apart (a restore elsewhere may reuse a database number); it needs
        # a privilege some roles lack, and is then left out.
        self.server_id = "SELECT system_identifier FROM pg_control_system()"
        self.new_store_id = (f"INSERT INTO {s}.meta (name, value) VALUES ('store', %s)"
                             " ON CONFLICT (name) DO NOTHING")
        self.migration_lock = "SELECT pg_advisory_xact_lock(%s, 0)"
        # The array comes sorted and a function scan yields it in order, so the locks are
        # taken in the one fixed order; were they not, a deadlock costs a retry, not safety.
        self.lock_many = ("SELECT count(pg_advisory_xact_lock(%s, k))"
                          " FROM unnest(%s::int[]) AS t(k)")
        self.fence = (
            f"SELECT 1 FROM {kv} WHERE ns = %s AND key = %s AND version = %s"
            f" AND (expires_at IS NULL OR expires_at > ({CLOCK})) FOR KEY SHARE"
        )
        self.expired = (
            f"WITH clock AS MATERIALIZED ({CLOCK} AS now) SELECT clock.now, e.ns, e.key"
            f" FROM clock LEFT JOIN LATERAL (SELECT ns, key FROM {kv}"
            f" WHERE expires_at <= clock.now LIMIT {SWEEP_BATCH}) AS e ON true"
        )
        # Rows of a name change only under its advisory lock: the one-statement calls
        # decide on the rows they read and rely on it. So the sweep tries each entity's
        # lock and passes over busy ones, and skips rows a fence holds, waiting for none.
        # Locked rows pass the join with ``free`` first, so a lock is tried before the row's.
        self.sweep = (
            "WITH e AS MATERIALIZED (SELECT * FROM unnest(%s::text[], %s::text[], %s::int[])"
            " AS e(ns, key, k)), free AS MATERIALIZED (SELECT k FROM (SELECT DISTINCT k FROM e)"
            " AS d WHERE pg_try_advisory_xact_lock(%s, k))"
            f" DELETE FROM {kv} WHERE (ns, key) IN (SELECT t.ns, t.key FROM e JOIN free USING (k)"
            f" JOIN {kv} AS t ON t.ns = e.ns AND t.key = e.key WHERE t.expires_at <= %s"
            " FOR UPDATE OF t SKIP LOCKED)"
        )
        self.read_prefix_unbounded = (
            f"SELECT {COLUMNS} FROM {kv} WHERE ns = %s AND key >= %s AND key > %s"
            " AND starts_with(key, %s) AND (expires_at IS NULL OR expires_at > %s)"
            " ORDER BY key LIMIT %s"
        )
        # One key range per entity, passed as arrays: a WHERE of N ORs costs the planner
        # O(N^2). Each range is an index scan of its own (OFFSET 0 keeps the subquery from
        # being flattened into a hash join, which would compare every row with every range).
        self.fetch_ranges = (
            f"SELECT k.* FROM unnest(%s::text[], %s::text[], %s::text[]) AS e(ns, lo, hi),"
            f" LATERAL (SELECT {COLUMNS} FROM {kv} WHERE ns = e.ns AND key >= e.lo"
            " AND key < e.hi OFFSET 0) AS k"
        )
        prepared = {
            "lock": ("int, int", "SELECT pg_advisory_xact_lock($1, $2)"),
            "draw0": ("", f"SELECT ({CLOCK}), ARRAY[]::bigint[]"),
            "draw1": ("", f"SELECT ({CLOCK}), ARRAY[{seq}]"),
            "drawn": ("int", f"SELECT ({CLOCK}), ARRAY(SELECT {seq} FROM generate_series(1, $1))"),
            "next_version": ("", f"SELECT {seq}"),
            "fetch_name": ("text, text, text", f"SELECT {COLUMNS} FROM {kv} WHERE ns = $1"
                           " AND key >= $2 AND key < $3"),
            "read": ("text, text", f"SELECT {COLUMNS} FROM {kv} WHERE ns = $1 AND key = $2"),
            "read_prefix": ("text, text, text, text, bigint, int",
                            f"SELECT {COLUMNS} FROM {kv} WHERE ns = $1 AND key >= $2"
                            " AND key < $3 AND key > $4 AND starts_with(key, $2)"
                            " AND (expires_at IS NULL OR expires_at > $5) ORDER BY key LIMIT $6"),
            # Divides by zero (failing the transaction) if the row vanished under its lock.
            "update": (_ROW_TYPES, f"WITH u AS (UPDATE {kv} SET value = COALESCE($3, value),"
                       " version = $4, expires_at = $5, created_at = $6, updated_at = $7,"
                       " prev_version = $8"
                       " WHERE ns = $1 AND key = $2 RETURNING 1) SELECT 1 / count(*) FROM u"),
            # Many rows' updates as one statement over arrays (see ``updates``). A NULL
            # value (never JSON null, which arrives as the text 'null') keeps the row's value.
            "update_many": (_ROW_ARRAYS, f"WITH u AS (UPDATE {kv} AS t"
                            " SET value = COALESCE(r.value, t.value),"
                            " version = r.version, expires_at = r.expires_at,"
                            " created_at = r.created_at, updated_at = r.updated_at,"
                            " prev_version = r.prev_version FROM unnest($1, $2, $3, $4, $5,"
                            f" $6, $7, $8) AS r({COLUMNS}) WHERE t.ns = r.ns AND t.key = r.key"
                            " RETURNING 1) SELECT 1 / (count(*) = cardinality($2))::int FROM u"),
            "insert": (_ROW_TYPES, f"INSERT INTO {kv} ({COLUMNS})"
                       " VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"),
            "delete_expired": ("text, text, bigint", f"DELETE FROM {kv} WHERE ns = $1"
                               " AND key = $2 AND expires_at <= $3"),
            "delete": ("text, text", f"DELETE FROM {kv} WHERE ns = $1 AND key = $2"),
            "notify": ("text, text", "SELECT pg_notify($1, $2)"),
            # Guards of a remembered read: divide by zero (failing the transaction) unless
            # the row is still as remembered, judged live or expired alike at both clocks.
            "guard_row": (_GUARD_TYPES, f"SELECT 1 / count(*) FROM {kv} WHERE {_GUARDED}"),
            # A guard and the delete of the row it guards, as one statement; and with the
            # NOTIFY of the name it frees ($9 the channel, $10 the name).
            "guarded_delete": (_GUARD_TYPES, f"WITH d AS (DELETE FROM {kv} WHERE {_GUARDED}"
                               " RETURNING 1) SELECT 1 / count(*) FROM d"),
            "guarded_delete_notify": (f"{_GUARD_TYPES}, text, text",
                                      f"WITH d AS (DELETE FROM {kv} WHERE {_GUARDED}"
                                      " RETURNING 1) SELECT 1 / count(*), pg_notify($9, $10)"
                                      " FROM d"),
            # ``ASYNC_COMMIT`` and an entity's lock in one statement, for a body of releases.
            "lock_no_wait": ("int, int", "SELECT set_config('synchronous_commit', 'off', true),"
                             " pg_advisory_xact_lock($1, $2)"),
            "guard_absent": ("text, text", f"SELECT 1 / (1 - count(*)) FROM {kv}"
                             " WHERE ns = $1 AND key = $2"),
        }
        prepared.update(scripted_statements(kv, seq))  # the one-trip lock calls
        # Each PREPARE apart too: a statement prepared by a script of them all would show
        # the whole script's first kilobyte as its text in pg_stat_activity.
        self.prepares = [f"PREPARE qs_{name}{f'({types})' if types else ''} AS {sql}"
                         for name, (types, sql) in prepared.items()]
        self.prepare = ";".join([*self.prepares, SESSION_PLANNER, SESSION_ISOLATION])
        for name, (types, _) in prepared.items():
            setattr(self, name, _execute(f"qs_{name}", len(types.split(",")) if types else 0))

    # EXECUTE forms, set in __init__ (declared for the type checker).
    lock: str
    draw0: str
    draw1: str
    drawn: str
    next_version: str
    fetch_name: str
    read: str
    read_prefix: str
    update: str
    update_many: str
    insert: str
    delete_expired: str
    delete: str
    notify: str
    guard_row: str
    guard_absent: str
    guarded_delete: str
    guarded_delete_notify: str
    lock_no_wait: str
    # The one-trip lock calls (``scripted_sql``).
    acquire_scripted: str
    acquire_alone_scripted: str
    renew_scripted: str
    renew_many: str
    peek: str

    def draw(self, versions: int) -> Statement:
        """The clock, and ``versions`` new versions (after the locks: above their holders')."""
        if versions == 0:
            return self.draw0, ()
        if versions == 1:
            return self.draw1, ()
        return self.drawn, (versions,)

    def updates(self, rows: Sequence[Sequence[Any]]) -> Statement:
        """One statement updating these rows (``update``'s parameters each, keys distinct).

        It divides by zero, failing the transaction, if any of them vanished under its lock.
        """
        if len(rows) == 1:
            return self.update, rows[0]
        return self.update_many, [array_literal(column) for column in zip(*rows)]

    def sweep_of(self, now: int, expired: Sequence[tuple[str, str]],
                 entity_keys: Sequence[int]) -> Statement:
        """The statement deleting these rows (``expired``'s, each with its entity's lock key)
        where they are still expired at ``now`` and nobody holds their entity or the row."""
        return self.sweep, (array_literal(ns for ns, _ in expired),
                            array_literal(key for _, key in expired),
                            array_literal(entity_keys), self.lock_class, now)

    def fetch(self, entities: Sequence[str]) -> list[Statement]:
        """Statements reading every row of these entities (lock names' permits, single keys)."""
        if len(entities) <= FETCH_ONE_BY_ONE:
            return [(self.fetch_name, (LOCKS_NS, e[1:] + "#", e[1:] + "$")) if e[0] == "L"
                    else (self.read, tuple(e[1:].split("/", 1))) for e in entities]
        return [self._fetch_all(entities)]

    def _fetch_all(self, entities: Iterable[str]) -> Statement:
        namespaces, lows, highs = [], [], []
        for entity in entities:
            if entity.startswith("L"):
                ns, low, high = LOCKS_NS, entity[1:] + "#", entity[1:] + "$"
            else:
                # Only the key itself lies in [key, key + "\x01"): text never holds "\x00".
                ns, low = entity[1:].split("/", 1)
                high = low + "\x01"
            namespaces.append(ns)
            lows.append(low)
            highs.append(high)
        return self.fetch_ranges, [array_literal(namespaces), array_literal(lows),
                                   array_literal(highs)]

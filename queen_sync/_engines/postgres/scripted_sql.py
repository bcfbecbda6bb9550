"""The statements of the one-trip lock calls (see ``scripted``), kept apart from ``sql``.

Each (a lone acquire, a lone renew naming its slot, a lone get, a batch of renews
each naming its slot and owner on a name of its own) answers with one
header per row: the database clock, the key and token it wrote (NULL when it wrote
nothing), then a row of the name as it stood BEFORE the statement (NULL columns
when the name has none), so the semantics can run on the rows it decided on.
"""

from __future__ import annotations

_CLOCK = "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint AS now"
_COLUMNS = "ns, key, value, version, expires_at, created_at, updated_at, prev_version"


def _acquire(kv: str, seq: str) -> str:
    """$1 ns, $2 the name's first key (``name#``), $3 its bound (``name$``), $4 limit,
    $5 owner, $6 the permit's value, $7 the lifetime in ms.

    It writes only when every live row of the name is one this limit's acquire would
    share without a question (a plain slot key, an object naming another owner as a
    string and this very limit) and a slot is free: then the semantics take the lowest
    free slot too. Anything else (the owner's own permit, a full name, odd rows) writes
    nothing and the semantics decide on the rows returned.
    """
    plain = (
        "live.key IN (SELECT $2 || s FROM generate_series(0, $4 - 1) AS s)"
        " AND json_typeof(live.value) = 'object'"
        " AND json_typeof(live.value -> 'owner') = 'string' AND live.value ->> 'owner' <> $5"
        " AND json_typeof(live.value -> 'limit') = 'number'"
        " AND live.value ->> 'limit' = $4::text")
    return (
        f"WITH clock AS MATERIALIZED ({_CLOCK}),"
        f" stored AS MATERIALIZED (SELECT {_COLUMNS} FROM {kv}"
        " WHERE ns = $1 AND key >= $2 AND key < $3),"
        " live AS (SELECT stored.* FROM stored, clock"
        " WHERE stored.expires_at IS NULL OR stored.expires_at > clock.now),"
        " free AS (SELECT min(slot) AS slot FROM generate_series(0, $4 - 1) AS slot"
        " WHERE NOT EXISTS (SELECT 1 FROM live WHERE live.key = $2 || slot)),"
        " chosen AS (SELECT free.slot FROM free WHERE free.slot IS NOT NULL"
        f" AND NOT EXISTS (SELECT 1 FROM live WHERE ({plain}) IS NOT TRUE)),"
        # The expired row in the chosen slot is deleted, not updated in place, so a
        # caller's FOR KEY SHARE fence on it makes this statement wait for its commit.
        f" gone AS (DELETE FROM {kv} AS old USING chosen, clock WHERE old.ns = $1"
        " AND old.key = $2 || chosen.slot AND old.expires_at <= clock.now RETURNING 1),"
        # Reading ``gone`` first makes the DELETE run before the INSERT.
        f" put AS (INSERT INTO {kv} ({_COLUMNS}) SELECT $1, $2 || chosen.slot, $6, {seq},"
        " clock.now + $7, clock.now, clock.now, NULL FROM chosen, clock"
        " WHERE (SELECT count(*) FROM gone) >= 0 RETURNING key, version)"
        " SELECT clock.now, put.key, put.version, stored.*"
        " FROM clock LEFT JOIN put ON true LEFT JOIN stored ON true"
    )


def _acquire_alone(kv: str, seq: str) -> str:
    """``_acquire`` for a limit of 1, its parameters the same: with one slot, the plain
    case is a name with no live row at all, and the slot taken is slot 0.

    The general statement costs the server a third more CPU (its slot series and the
    checks on every live row), and nearly every acquire has a limit of 1.
    """
    return (
        f"WITH clock AS MATERIALIZED ({_CLOCK}),"
        f" stored AS MATERIALIZED (SELECT {_COLUMNS} FROM {kv}"
        " WHERE ns = $1 AND key >= $2 AND key < $3),"
        " chosen AS (SELECT $2 || '0' AS key FROM clock WHERE NOT EXISTS (SELECT 1 FROM stored"
        " WHERE stored.expires_at IS NULL OR stored.expires_at > clock.now)),"
        f" gone AS (DELETE FROM {kv} AS old USING chosen, clock WHERE old.ns = $1"
        " AND old.key = chosen.key AND old.expires_at <= clock.now RETURNING 1),"
        f" put AS (INSERT INTO {kv} ({_COLUMNS}) SELECT $1, chosen.key, $6, {seq},"
        " clock.now + $7, clock.now, clock.now, NULL FROM chosen, clock"
        " WHERE (SELECT count(*) FROM gone) >= 0 RETURNING key, version)"
        " SELECT clock.now, put.key, put.version, stored.*"
        " FROM clock LEFT JOIN put ON true LEFT JOIN stored ON true"
    )


def _renew(kv: str, seq: str) -> str:
    """$1 ns, $2 the name's first key, $3 its bound, $4 the slot's key, $5 the token
    presented, $6 the owner (or NULL), $7 the lifetime in ms.

    It renews the live permit in that slot when the token is its current one (from its
    owner, or from anyone who does not say), or one its owner minted since the token its
    last renew presented; in place, as the two-trip path does, so a fence on the row
    does not hold up its holder's renewal.
    """
    owned = ("json_typeof(stored.value) = 'object'"
             " AND json_typeof(stored.value -> 'owner') = 'string'"
             " AND stored.value ->> 'owner' = $6")
    return (
        f"WITH clock AS MATERIALIZED ({_CLOCK}),"
        f" stored AS MATERIALIZED (SELECT {_COLUMNS} FROM {kv}"
        " WHERE ns = $1 AND key >= $2 AND key < $3),"
        " target AS (SELECT stored.key FROM stored, clock WHERE stored.key = $4"
        " AND (stored.expires_at IS NULL OR stored.expires_at > clock.now)"
        f" AND ((stored.version = $5 AND ($6 IS NULL OR ({owned})))"
        f" OR ($6 IS NOT NULL AND ({owned}) AND stored.prev_version <= $5"
        " AND $5 < stored.version))),"
        f" put AS (UPDATE {kv} AS permit SET version = {seq}, expires_at = clock.now + $7,"
        " updated_at = clock.now, prev_version = $5 FROM target, clock"
        " WHERE permit.ns = $1 AND permit.key = target.key"
        " RETURNING permit.key, permit.version)"
        " SELECT clock.now, put.key, put.version, stored.*"
        " FROM clock LEFT JOIN put ON true LEFT JOIN stored ON true"
    )


def _renew_many(kv: str, seq: str) -> str:
    """$1 ns, then arrays, one element per renew: $2 names (distinct), $3 slot keys,
    $4 tokens presented, $5 owners, $6 lifetimes in ms.

    ``_renew``'s rule for every op at once, each naming its owner, on a name of its own.
    Each renew's slot row is returned as it stood, after the name it was read for, with
    the token written to it if renewed; for a renew it refuses, every other row of the
    name too (the semantics answer it with the name's holders), and a row of NULL
    columns if the slot is empty. A tick renews nearly every lease, so the rest of a
    name is read only for the rare refusal.

    Nothing joins one array-sized set to another: the server plans a prepared statement
    as if its arrays held 10 elements, and such a join, planned as a loop in a loop,
    compares every renew of a batch with every other one.
    """
    columns = _COLUMNS.split(", ")
    # The value as its stored text: the driver's json loader costs more per row than the
    # rest of the row, and the renewal parses it itself (``renew_batch``).
    answered = ", ".join("value::text" if c == "value" else c for c in columns)
    renews = ("(s.expires_at IS NULL OR s.expires_at > (SELECT now FROM clock))"
              " AND json_typeof(s.value -> 'owner') = 'string' AND s.value ->> 'owner' = r.owner"
              " AND (s.version = r.token OR (s.prev_version <= r.token AND r.token < s.version))")
    return (
        f"WITH clock AS MATERIALIZED ({_CLOCK}),"
        " r AS (SELECT * FROM unnest($2::text[], $3::text[], $4::bigint[], $5::text[],"
        " $6::bigint[]) AS r(name, key, token, owner, ttl)),"
        # One index lookup per renew (OFFSET 0 keeps each a scan of its own, not a join
        # over the table); the rule is decided here, once, on the rows as they stood.
        " slot AS MATERIALIZED (SELECT r.name AS of_name, r.key AS slot_key, r.token, r.ttl,"
        f" {', '.join(f's.{c}' for c in columns)}, {renews} AS renews"
        f" FROM r LEFT JOIN LATERAL (SELECT {_COLUMNS} FROM {kv} WHERE ns = $1 AND key = r.key"
        " OFFSET 0) AS s ON true),"
        # The clock as a scalar subquery is read once; joined, it is rescanned per row.
        f" put AS (UPDATE {kv} AS permit SET version = {seq},"
        " expires_at = (SELECT now FROM clock) + slot.ttl,"
        " updated_at = (SELECT now FROM clock), prev_version = slot.token FROM slot"
        " WHERE slot.renews AND permit.ns = $1 AND permit.key = slot.key"
        f" RETURNING permit.version AS written, slot.of_name,"
        f" {', '.join(f'slot.{c}' for c in columns)}),"
        f" rest AS (SELECT slot.of_name, {', '.join(f'o.{c}' for c in columns)} FROM slot,"
        f" LATERAL (SELECT {_COLUMNS} FROM {kv} WHERE ns = $1 AND key >= slot.of_name || '#'"
        " AND key < slot.of_name || '$' AND key <> slot.slot_key OFFSET 0) AS o"
        " WHERE slot.renews IS NOT TRUE)"
        f" SELECT (SELECT now FROM clock), written, of_name, {answered} FROM put"
        f" UNION ALL SELECT (SELECT now FROM clock), NULL, of_name, {answered} FROM slot"
        " WHERE renews IS NOT TRUE"
        f" UNION ALL SELECT (SELECT now FROM clock), NULL, of_name, {answered} FROM rest"
    )


def _peek(kv: str) -> str:
    """$1 ns, $2 the name's first key, $3 its bound: the clock and the name's rows."""
    return (
        f"WITH clock AS MATERIALIZED ({_CLOCK})"
        " SELECT clock.now, NULL::text, NULL::bigint, stored.* FROM clock LEFT JOIN"
        f" (SELECT {_COLUMNS} FROM {kv} WHERE ns = $1 AND key >= $2 AND key < $3) AS stored"
        " ON true"
    )


def scripted_statements(kv: str, seq: str) -> dict[str, tuple[str, str]]:
    """The prepared statements of the one-trip calls: name -> (parameter types, SQL)."""
    return {
        "acquire_scripted": ("text, text, text, int, text, json, bigint", _acquire(kv, seq)),
        "acquire_alone_scripted": ("text, text, text, int, text, json, bigint",
                                   _acquire_alone(kv, seq)),
        "renew_scripted": ("text, text, text, text, bigint, text, bigint", _renew(kv, seq)),
        "renew_many": ("text, text[], text[], bigint[], text[], bigint[]",
                       _renew_many(kv, seq)),
        "peek": ("text, text, text", _peek(kv)),
        # ``SET LOCAL synchronous_commit = off`` as a function, which may be prepared and
        # sent in a pipeline (``pipeline``); it lasts until the implicit transaction ends.
        "synchronous_commit_off": ("", "SELECT set_config('synchronous_commit', 'off', true)"),
    }

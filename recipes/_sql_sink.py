"""A fenced sink that is a PostgreSQL table of the user's own (``FencedTable``).

Each write is one transaction on the user's connection: ``lock.fence(conn)`` first (the
lock's permit must still be at this holder's token, and stays share-locked until the
commit, so no new holder can take over halfway), then an upsert of the partition's row
with the token it was produced under. The row also refuses a token lower than the one it
already carries, as the directory sink does for its files.
"""

from __future__ import annotations

from typing import Any, Optional

import queen_sync as qs

from ._client_arg import check_client
from ._fence_checks import check_name, check_token, current_token, fenced_out

#: The capability an engine needs for this sink (PostgreSQL has it).
CAPABILITY = "user_table_fencing"


def _identifier(what: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__}")
    if not value or "\0" in value:
        raise ValueError(f"{what} {value!r} must be a non-empty name")
    return value


class FencedTable:
    """A table in the engine's PostgreSQL database, written only while the lock is held.

    Args:
        client: the client; its engine must offer ``user_table_fencing`` (PostgreSQL).
        conn: a psycopg 3 connection to the same database (one thread at a time). Each
            write is a transaction of its own, committed before it returns: one with a
            transaction open (psycopg opens one at the first statement unless the
            connection is in autocommit) is refused until that transaction ends.
        table: ``"name"`` or ``"schema.name"``, created by you, with a primary key or a
            unique constraint on the ``key`` column.
        key: the column of the partition's name (the primary key or a unique one).
        value: the column of its data (a dict or list is sent as JSON).
        token: the column of the token it was written under (``bigint``).

    Raises:
        UnsupportedOperationError: the engine lacks ``user_table_fencing`` (SQLite, the
            Queen broker): use ``FencedKv`` or ``FencedDirectory`` there.
        TypeError: ``client`` is not a ``queen_sync.Queen``.
        TypeError, ValueError: a bad table or column name (before any I/O).
    """

    def __init__(self, client: qs.Queen, conn: Any, table: str, *, key: str = "partition",
                 value: str = "data", token: str = "token") -> None:
        check_client(client, "FencedTable")
        if not client.capabilities.user_table_fencing:
            raise qs.UnsupportedOperationError(
                f"FencedTable needs an engine with {CAPABILITY} (PostgreSQL); "
                f"{client.url} has none: write through FencedKv or FencedDirectory instead",
                capability=CAPABILITY)
        from psycopg import sql  # the PostgreSQL engine's own driver, so it is installed

        parts = _identifier("table", table).split(".")
        columns = [_identifier(what, name) for what, name in
                   (("key", key), ("value", value), ("token", token))]
        self._q, self.conn, self.table = client, conn, table
        target = sql.Identifier(*parts)
        k, v, t = (sql.Identifier(name) for name in columns)
        # The WHERE keeps a row from going back to a lower token; RETURNING then says
        # whether the row was written at all.
        self._upsert = sql.SQL(
            "INSERT INTO {target} AS existing ({k}, {v}, {t}) VALUES (%s, %s, %s)"
            " ON CONFLICT ({k}) DO UPDATE SET {v} = excluded.{v}, {t} = excluded.{t}"
            " WHERE existing.{t} <= excluded.{t} RETURNING existing.{t}").format(
            target=target, k=k, v=v, t=t)
        self._select = sql.SQL("SELECT {k}, {t}, {v} FROM {target}").format(
            target=target, k=k, t=t, v=v)
        self._select_one = sql.SQL("SELECT {t}, {v} FROM {target} WHERE {k} = %s").format(
            target=target, k=k, t=t, v=v)

    def write(self, name: str, data: Any, *, token: int, lock: Optional[qs.Lock] = None) -> None:
        """Upsert ``name``'s row with ``data`` and ``token``, fenced by ``lock`` in one commit.

        Raises:
            FencedOutError: the lock's permit moved on or lapsed (nothing is written), or
                the row already carries a higher token.
            TypeError: no ``lock`` given (the fence needs the handle, not just a token).
            ValueError: ``conn`` has a transaction open (nothing is written).
        """
        check_name(name)
        check_token(token)
        if lock is None:
            raise TypeError("FencedTable.write needs lock= (its fence is checked in the database)")
        self._refuse_an_open_transaction(name)
        try:
            with self.conn.transaction():
                lock.fence(self.conn)
                written = self.conn.execute(self._upsert, (name, _param(data), token)).fetchone()
                if written is None:
                    raise fenced_out(f"{self.table}/{name}", token, self._row_token(name))
        except qs.LockLostError as exc:
            raise fenced_out(f"{self.table}/{name}", token, self._newer(name, lock)) from exc

    def _refuse_an_open_transaction(self, name: str) -> None:
        """Inside the caller's transaction the write would commit only with it: an export
        would checkpoint the partition as finished first (a rollback then loses it), and the
        fence would hold the lock's row until then, blocking its renewals and release."""
        from psycopg.pq import TransactionStatus

        status = self.conn.info.transaction_status
        if status != TransactionStatus.IDLE:
            raise ValueError(
                f"FencedTable cannot write {name!r}: its connection has a transaction open "
                f"({status.name}); each write commits on its own, so commit or roll back "
                "first, or use a connection in autocommit")

    def _newer(self, name: str, lock: qs.Lock) -> Optional[int]:
        """The token that superseded this write: the lock's holder now, else the row's."""
        holder = current_token(self._q, lock)
        if holder is not None:
            return holder
        with self.conn.transaction():
            return self._row_token(name)

    def _row_token(self, name: str) -> Optional[int]:
        found = self.conn.execute(self._select_one, (name,)).fetchone()
        return None if found is None else int(found[0])

    def read(self, name: str) -> Any:
        """The data last stored as ``name`` (KeyError when there is none)."""
        with self.conn.transaction():
            found = self.conn.execute(self._select_one, (check_name(name),)).fetchone()
        if found is None:
            raise KeyError(name)
        return found[1]

    def rows(self) -> dict[str, tuple[int, Any]]:
        """Every row as ``{name: (token, data)}``, by name."""
        with self.conn.transaction():
            found = self.conn.execute(self._select).fetchall()
        return {str(k): (int(t), v) for k, t, v in sorted(found, key=lambda row: str(row[0]))}

    def __repr__(self) -> str:
        return f"<FencedTable {self.table!r} on {self._q.url}>"


def _param(data: Any) -> Any:
    """``data`` as a query parameter: a dict or list goes as JSON, anything else as it is."""
    if isinstance(data, (dict, list)):
        from psycopg.types.json import Jsonb

        return Jsonb(data)
    return data

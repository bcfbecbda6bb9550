"""The array parameters PostgreSQL's statements take are built as array literals by hand.

``array_literal`` writes an array's input syntax in one pass (the driver's per-element
quoting costs more than the statements it feeds), with a fast path for texts that need
no escaping. Whatever the values, the server must read back exactly them.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pg_server import require_pg, shared_server

if not require_pg():
    pytest.importorskip("psycopg")
import psycopg

from queen_sync._engines.postgres.sql import array_literal

pytestmark = pytest.mark.timeout(120)
_SETTINGS = settings(max_examples=int(os.environ.get("QUEEN_SYNC_ARRAY_EXAMPLES", "200")),
                     deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# Text as PostgreSQL stores it (no NUL), leaning on what array syntax treats specially.
_TEXT = st.text(st.one_of(st.sampled_from('"\\{},; NULLnull\'\t'),
                          st.characters(codec="utf-8", blacklist_characters="\x00")),
                max_size=12)


@pytest.fixture(scope="module")
def conn() -> Iterator[psycopg.Connection[Any]]:
    with shared_server() as server, psycopg.connect(server.url, autocommit=True) as made:
        yield made


def _read_back(conn: psycopg.Connection[Any], literal: str, kind: str) -> Any:
    record = conn.execute(f"SELECT %s::{kind}[]", (literal,)).fetchone()
    assert record is not None
    return record[0]


class TestAnArrayLiteralReadsBackAsItsValues:
    @_SETTINGS
    @given(values=st.lists(_TEXT, max_size=8))
    def test_texts_of_any_characters(self, conn: psycopg.Connection[Any],
                                     values: list[str]) -> None:
        literal = array_literal(values)
        assert _read_back(conn, literal, "text") == values, f"{values!r} as {literal!r}"

    @_SETTINGS
    @given(values=st.lists(st.one_of(st.none(), _TEXT), max_size=8))
    def test_texts_and_nulls(self, conn: psycopg.Connection[Any],
                             values: list[Optional[str]]) -> None:
        literal = array_literal(iter(values))  # any iterable, not only a list
        assert _read_back(conn, literal, "text") == values, f"{values!r} as {literal!r}"

    @_SETTINGS
    @given(values=st.lists(st.one_of(st.none(), st.integers(-(2 ** 63), 2 ** 63 - 1)),
                           max_size=8))
    def test_integers_and_nulls(self, conn: psycopg.Connection[Any],
                                values: list[Optional[int]]) -> None:
        literal = array_literal(values)
        assert _read_back(conn, literal, "bigint") == values, f"{values!r} as {literal!r}"


"""The KV and lock surfaces as the official Queen client has them, on every engine.

``list_all(limit=, max_rows=)``, ``required=`` on ``check``/``delete``, ``expect=0`` on
``put``/``delete``, a public ``locks.release_all()``, and names, owners and keys with C1
control characters refused at the call.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import queen_sync as qs
from queen_sync._engines.base import Engine
from queen_sync.testing import FaultyEngine

NS = "app"


def _sent_prefix_pages(faults: FaultyEngine) -> list[Mapping[str, Any]]:
    """Record every getPrefix op sent through ``faults`` (the real engine still answers)."""
    sent: list[Mapping[str, Any]] = []

    def spy(route: str, body: Mapping[str, Any]) -> None:
        sent.extend(op for op in body.get("operations", []) if op.get("op") == "getPrefix")

    faults.hook_next(None, hook=spy)
    return sent


class TestListAll:
    def test_list_all_pages_by_limit_and_returns_every_row(
            self, faulty_q: qs.Queen, faults: FaultyEngine) -> None:
        q = faulty_q
        for i in range(7):
            q.kv.put(NS, f"p{i}", i, forever=True)
        sent = _sent_prefix_pages(faults)
        rows = q.kv.list_all(NS, "p", limit=3)
        assert [r["key"] for r in rows] == [f"p{i}" for i in range(7)], rows
        assert [op.get("limit") for op in sent] == [3, 3, 3], f"pages of 3 expected: {sent}"

    def test_max_rows_stops_the_walk_at_that_many_rows(
            self, faulty_q: qs.Queen, faults: FaultyEngine) -> None:
        q = faulty_q
        for i in range(7):
            q.kv.put(NS, f"p{i}", i, forever=True)
        sent = _sent_prefix_pages(faults)
        rows = q.kv.list_all(NS, "p", limit=3, max_rows=4)
        assert [r["key"] for r in rows] == ["p0", "p1", "p2", "p3"], rows
        assert len(sent) == 2, f"no page past the fourth row may be read: {sent}"

    @pytest.mark.parametrize(("kwargs", "error"), [
        ({"limit": 0}, ValueError), ({"limit": 1001}, ValueError), ({"limit": "5"}, TypeError),
        ({"max_rows": 0}, ValueError), ({"max_rows": True}, TypeError),
    ])
    def test_a_bad_limit_or_max_rows_is_refused_before_asking(
            self, faulty_q: qs.Queen, faults: FaultyEngine, kwargs: Any, error: type) -> None:
        sent = _sent_prefix_pages(faults)
        with pytest.raises(error):
            faulty_q.kv.list_all(NS, "p", **kwargs)
        assert not sent, "nothing may be sent for a bad argument"


class _Truncating(Engine):
    """An engine whose prefix pages claim more rows but give a cursor that cannot advance."""

    kind = "truncating"

    def __init__(self, next_after: Any) -> None:
        self.next_after = next_after
        self.pages = 0

    @property
    def url(self) -> str:
        return "truncating://"

    def call(self, route: str, body: Any) -> dict[str, Any]:
        self.pages += 1
        if self.pages > 5:
            raise AssertionError("list_all kept asking for the same page")
        rows = [{"key": "p1", "value": 1, "version": 1}]
        return {"results": [{"index": 0, "rows": rows, "truncated": True,
                             "nextAfter": self.next_after}]}


@pytest.mark.parametrize(("next_after", "pages"), [(None, 1), ("", 1), (7, 1), ("p1", 2)])
def test_a_truncated_page_without_a_cursor_past_it_is_a_protocol_error(
        next_after: Any, pages: int) -> None:
    engine = _Truncating(next_after)
    with qs.Queen(engine=engine, renew_thread=False) as q, \
            pytest.raises(qs.ProtocolError, match="nextAfter"):
        q.kv.list_all(NS, "p")
    assert engine.pages == pages, (
        f"it must stop at the first page that cannot advance ({pages}), read {engine.pages}")


class TestRequiredAndExpectZero:
    def test_check_and_delete_take_required(self, q: qs.Queen) -> None:
        version = q.kv.put(NS, "k", 1, forever=True)["version"]
        assert q.kv.check(NS, "k", expect=version, required=True), "the key is at that version"
        lost = q.kv.check(NS, "k", expect=version + 1000, required=True)
        assert not lost and lost["reason"] == "version", lost
        assert q.kv.delete(NS, "k", expect=version, required=True), "a matching delete applies"
        assert not q.kv.get(NS, "k"), "the key must be gone"

    def test_put_with_expect_zero_creates_only_an_absent_key(self, q: qs.Queen) -> None:
        created = q.kv.put(NS, "k", "first", forever=True, expect=0)
        assert created, f"expect=0 on an absent key must create it: {created}"
        second = q.kv.put(NS, "k", "second", forever=True, expect=0)
        assert not second and second["reason"] == "exists", second
        assert second["value"] == "first" and second["version"] == created["version"], second
        assert q.kv.get(NS, "k")["value"] == "first", "the losing put must write nothing"

    def test_delete_with_expect_zero_deletes_nothing(self, q: qs.Queen) -> None:
        absent = q.kv.delete(NS, "k", expect=0)
        assert not absent and absent["reason"] == "absent", absent
        version = q.kv.put(NS, "k", 1, forever=True)["version"]
        present = q.kv.delete(NS, "k", expect=0)
        assert not present and present["reason"] == "exists", present
        assert q.kv.get(NS, "k")["version"] == version, "a delete expecting absence kept the key"

    def test_a_negative_expect_is_still_refused(self, q: qs.Queen) -> None:
        with pytest.raises(ValueError):
            q.kv.put(NS, "k", 1, forever=True, expect=-1)
        with pytest.raises(ValueError):
            q.kv.delete(NS, "k", expect=-1)


class TestReleaseAll:
    def test_release_all_gives_back_every_permit_the_clients_handles_hold(
            self, q: qs.Queen) -> None:
        handles = [q.lock("a", ttl=30), q.lock("b", ttl=30), q.semaphore("pool", 3, ttl=30)]
        assert all(h.acquire() for h in handles)
        idle = q.lock("c", ttl=30)
        assert q.locks.release_all() == 3, "it counts the handles that held a permit"
        assert not any(h.held for h in handles) and not idle.held
        for name in ("a", "b", "pool"):
            assert not q.locks.get(name), f"{name} must be free after release_all"
        assert q.locks.release_all() == 0, "nothing is left to give back"
        assert handles[0].acquire(), "a handle can take its lock again afterwards"


C1 = st.characters(min_codepoint=0x80, max_codepoint=0x9F)


@pytest.fixture
def sq(sqlite_url: str) -> Iterator[qs.Queen]:
    with qs.Queen(sqlite_url, renew_thread=False) as client:
        yield client


class TestC1ControlCharacters:
    @settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(before=st.text(max_size=5).filter(lambda s: "#" not in s), c1=C1,
           after=st.text(max_size=5).filter(lambda s: "#" not in s))
    def test_a_c1_character_anywhere_is_refused_in_names_owners_and_keys(
            self, sq: qs.Queen, before: str, c1: str, after: str) -> None:
        text = before + c1 + after
        for make in (lambda: sq.lock(text, ttl=30), lambda: sq.lock("ok", ttl=30, owner=text),
                     lambda: sq.kv.put(NS, text, 1, forever=True),
                     lambda: sq.locks.acquire(text, ttl=30)):
            with pytest.raises(qs.RequestError, match="control character"):
                make()

    def test_a_raw_op_with_a_c1_name_is_refused_by_every_engine(self, q: qs.Queen) -> None:
        with pytest.raises(qs.RequestError, match="control character"):
            q.locks.batch([{"op": "acquire", "name": "job\x85", "ttlSeconds": 30}])
        with pytest.raises(qs.RequestError, match="control character"):
            q.kv.batch([{"op": "get", "ns": NS, "key": "k\x9f"}])

    def test_text_just_past_the_c1_block_is_still_a_valid_name(self, q: qs.Queen) -> None:
        assert q.lock("caf\u00e9 \u00a0job", ttl=30).acquire(), "U+00A0 and up are ordinary text"

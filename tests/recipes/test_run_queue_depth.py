"""The run queue's depth on every engine: a given run, pages, attempts and dead letters."""

from __future__ import annotations

import secrets
from typing import Any, Callable, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import queen_sync as qs
from queen_sync.recipes.run_queue import Claim, RunEntry, RunQueue

# Characters on both sides of '#' (a permit key's separator), so the claims' key order and
# the runs' key order differ wherever one id is a prefix of another.
IDS = st.text(alphabet=" !\"$ab~é", min_size=1, max_size=4)


def _fresh(q: qs.Queen, **options: Any) -> RunQueue:
    return RunQueue(q, f"d{secrets.token_hex(4)}", **options)


def _claim(runs: RunQueue, **how: Any) -> Claim:
    claim = runs.claim(ttl=30, **how)
    assert claim is not None, f"nothing was claimable with {how}"
    return claim


def _pages(read: Callable[[Optional[str]], Any]) -> list[Any]:
    """Everything a paged listing returns, following ``next_after`` to the end."""
    out: list[Any] = []
    after: Optional[str] = None
    for _ in range(1000):
        page = read(after)
        out += list(page)
        after = page.next_after
        if after is None:
            return out
    raise AssertionError("the listing never ended")


def _subsets(ids: set[str]) -> st.SearchStrategy[set[str]]:
    return st.sets(st.sampled_from(sorted(ids))) if ids else st.just(set())


class TestClaimingAGivenRun:
    def test_it_is_claimed_by_id_and_none_while_held_completed_or_unknown(
            self, q: qs.Queen) -> None:
        runs = _fresh(q)
        for run_id in ("a", "b", "c"):
            runs.submit(run_id, {"id": run_id})
        b = _claim(runs, run_id="b", holder="one")
        held = runs.claim(run_id="b", holder="two", ttl=30)
        b.complete("done")
        verdicts = (runs.claim(run_id="b", ttl=30), runs.claim(run_id="zz", ttl=30))
        first, second = _claim(runs), _claim(runs)

        assert (b.run_id, b.payload, b.attempt) == ("b", {"id": "b"}, 1), repr(b)
        assert held is None, f"a held run was claimed again: {held}"
        assert verdicts == (None, None), f"a completed or unknown run was claimed: {verdicts}"
        assert (first.run_id, second.run_id) == ("a", "c"), "the next claims did not skip b"


class TestSubmittingMany:
    def test_new_runs_are_added_and_known_ones_left_as_they_are(self, q: qs.Queen) -> None:
        runs = _fresh(q)
        runs.submit("old", {"v": 1})
        _claim(runs, run_id="old").complete("done")
        runs.submit("kept", {"v": 1})
        added = runs.submit_many({f"n{k:03d}": {"k": k} for k in range(150)})
        mixed = runs.submit_many([("old", {"v": 2}), ("kept", {"v": 2}), ("new", None)])
        with pytest.raises(ValueError):
            runs.submit_many([("fine", 1), ("bad#id", 2)])
        listed = {e.run_id: e.payload for e in runs.list()}

        assert (added, mixed) == (150, 1), f"added {added}, then {mixed}"
        assert len(listed) == 152 and listed["kept"] == {"v": 1}, "a known run was replaced"
        assert "old" not in listed and "fine" not in listed, f"pending: {sorted(listed)[:5]}"


class TestListingsArePaged:
    @settings(max_examples=15, deadline=None, suppress_health_check=[
        HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(ids=st.sets(IDS, min_size=1, max_size=12), data=st.data())
    def test_pages_of_any_size_list_each_run_once_in_order_with_the_right_claims(
            self, q: qs.Queen, ids: set[str], data: st.DataObject) -> None:
        runs = _fresh(q)
        for run_id in ids:
            runs.submit(run_id)
        held = data.draw(_subsets(ids), label="held")
        done = data.draw(_subsets(ids - held), label="done")
        claims = [_claim(runs, run_id=run_id) for run_id in sorted(held | done)]
        for claim in claims:
            if claim.run_id in done:
                claim.complete(claim.run_id)
        limit = data.draw(st.integers(1, 5), label="limit")
        claimed = data.draw(st.sampled_from([None, True, False]), label="claimed")
        listed: list[RunEntry] = _pages(
            lambda after: runs.list(claimed=claimed, limit=limit, after=after))
        results = _pages(lambda after: runs.results(limit=limit, after=after))
        for claim in claims:
            claim.release()

        pending = sorted(ids - done)
        expected = [r for r in pending if claimed is None or (r in held) == claimed]
        assert [e.run_id for e in listed] == expected, f"listed with limit {limit}"
        assert all(e.claimed == (e.run_id in held) for e in listed), f"claims: {listed}"
        assert results == sorted(done), f"results paged with limit {limit}: {results}"


class TestAttemptsAndDeadLetters:
    def test_each_claim_counts_and_the_claim_past_max_attempts_dead_letters_the_run(
            self, q: qs.Queen) -> None:
        runs = _fresh(q, max_attempts=2)
        runs.submit("early", {"n": 1})
        runs.submit("later")
        first = _claim(runs, run_id="early")
        first.checkpoint({"step": 1})
        first.release()
        second = _claim(runs, run_id="early")
        seen = runs.list(claimed=True)
        second.release()
        third = runs.claim(ttl=30)  # dead-letters "early" on the way, then takes "later"
        dead = runs.dead_letters()
        pending = [e.run_id for e in runs.list()]

        assert (first.attempt, second.attempt) == (1, 2), "attempts were not counted"
        assert [(e.run_id, e.attempts) for e in seen] == [("early", 2)], f"listed {seen}"
        assert third is not None and third.run_id == "later", f"the third claim took {third}"
        assert [(d.run_id, d.attempts, d.state) for d in dead] == [("early", 2, {"step": 1})], (
            f"dead letters: {dead}")
        assert pending == ["later"], f"a dead-lettered run is still pending: {pending}"
        assert not runs.submit("early"), "a dead-lettered run id was accepted again"

    def test_a_requeued_dead_letter_is_claimable_again_from_attempt_one(
            self, q: qs.Queen) -> None:
        runs = _fresh(q, max_attempts=1)
        runs.submit("early", {"n": 1})
        _claim(runs).release()
        assert runs.claim(ttl=30) is None, "the run past max_attempts was offered"
        assert runs.requeue("early") and not runs.requeue("early"), "requeue verdicts"
        again = _claim(runs)

        assert (again.run_id, again.attempt, again.payload) == ("early", 1, {"n": 1}), (
            repr(again))
        assert not runs.dead_letters(), "the requeued run is still a dead letter"


class TestBadPagingArgumentsAreRefused:
    @pytest.mark.parametrize("call, error", [
        (lambda r: r.list(limit=0), ValueError),
        (lambda r: r.list(limit=True), TypeError),
        (lambda r: r.results(after=""), ValueError),
        (lambda r: r.dead_letters(limit="3"), TypeError),
        (lambda r: r.claim(run_id="a#b", ttl=1), ValueError),
        (lambda r: RunQueue(r._q, "x", max_attempts=0), ValueError),
        (lambda r: RunQueue(r._q, "x", retention="forever"), ValueError),
    ])
    def test_each_raises_a_typed_error_before_any_io(
            self, sqlite_url: str, call: Callable[[RunQueue], Any], error: type) -> None:
        with qs.Queen(sqlite_url) as q, pytest.raises(error):
            call(RunQueue(q, "x"))

"""A run queue refuses bad arguments at the call that takes them, and loses no run to them."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import queen_sync as qs
from queen_sync.recipes.run_queue import Claim, RunQueue


async def _async_fn(claim: Claim) -> None:
    return None


def _generator_fn(claim: Claim) -> Iterator[int]:
    yield 1


class TestWorkWithAFunctionThatCannotRunARun:
    @pytest.mark.parametrize("fn", [None, "resize", 3, _async_fn, _generator_fn],
                             ids=["None", "str", "int", "async", "generator"])
    def test_is_refused_before_a_claim_so_no_attempt_is_spent(
            self, client: qs.Queen, fn: Any) -> None:
        runs = RunQueue(client, "jobs", max_attempts=1)
        runs.submit("r1", {"n": 1})
        with pytest.raises(TypeError, match="fn"):
            runs.work(fn, ttl=30)
        entries = [(e.run_id, e.attempts, e.claimed) for e in runs.list()]
        done = runs.work(lambda claim: claim.payload["n"], ttl=30)

        assert entries == [("r1", 0, False)], f"the refused call touched the run: {entries}"
        assert (done, list(runs.dead_letters())) == (1, []), (
            "the run was not completed by a good call after the refused one")


class TestWorkWithABadPollOrStop:
    @pytest.mark.parametrize("poll", [-1, 0, math.nan, math.inf, True, "soon", 1e12],
                             ids=str)
    def test_a_poll_that_is_not_a_positive_finite_duration_is_refused_at_the_call(
            self, client: qs.Queen, poll: Any) -> None:
        runs = RunQueue(client, "jobs")
        runs.submit("r1")
        runs.submit("r2")
        claimed = runs.claim(run_id="r2", ttl=30)  # held by another: work() must wait for it
        assert claimed is not None
        with pytest.raises((TypeError, ValueError), match="poll"):
            runs.work(lambda claim: None, ttl=30, poll=poll)
        entries = [(e.run_id, e.attempts) for e in runs.list()]
        claimed.release()

        assert entries == [("r1", 0), ("r2", 1)], f"the refused call took a run: {entries}"

    def test_a_poll_given_as_a_duration_is_taken(self, client: qs.Queen) -> None:
        runs = RunQueue(client, "jobs")
        runs.submit("r1")
        assert runs.work(lambda claim: None, ttl=30, poll="10ms") == 1, "the run was not done"

    def test_a_stop_that_is_not_an_event_is_refused_at_the_call(self, client: qs.Queen) -> None:
        runs = RunQueue(client, "jobs")
        runs.submit("r1")
        with pytest.raises(TypeError, match="stop"):
            runs.work(lambda claim: None, ttl=30, stop=True)  # type: ignore[arg-type]  # the mistake under test
        entries = [(e.run_id, e.attempts) for e in runs.list()]
        assert entries == [("r1", 0)], f"the refused call took a run: {entries}"


ids = st.text(alphabet="abc-1", min_size=1, max_size=6)


class TestSubmitManyWithRunIdsInsteadOfPairs:
    @settings(max_examples=25, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(run_ids=st.lists(ids, min_size=1, max_size=5, unique=True))
    def test_a_list_of_ids_is_refused_and_nothing_is_submitted(
            self, client: qs.Queen, run_ids: list[str]) -> None:
        runs = RunQueue(client, "jobs")
        with pytest.raises(TypeError, match=r"\(run_id, payload\)"):
            runs.submit_many(run_ids)  # type: ignore[arg-type]  # the mistake under test
        submitted = [entry.run_id for entry in runs.list()]
        assert submitted == [], f"ids {run_ids} were split into runs {submitted}"

    @pytest.mark.parametrize("runs_arg", ["ab", b"ab", [("a", 1), "bc"], [("a", 1, 2)], [3]],
                             ids=["str", "bytes", "a str among pairs", "a triple", "an int"])
    def test_other_shapes_that_are_not_pairs_are_refused_and_nothing_is_submitted(
            self, client: qs.Queen, runs_arg: Any) -> None:
        runs = RunQueue(client, "jobs")
        with pytest.raises(TypeError, match=r"\(run_id, payload\)"):
            runs.submit_many(runs_arg)
        assert not runs.list(), "a refused submit_many submitted runs"

    @pytest.mark.parametrize("make", [
        lambda: {"a": 1, "b": None},
        lambda: [("a", 1), ("b", None)],
        lambda: [["a", 1], ["b", None]],
        lambda: ((run_id, payload) for run_id, payload in [("a", 1), ("b", None)]),
        lambda: dict.fromkeys(["a", "b"]),
    ], ids=["dict", "tuples", "lists", "generator", "fromkeys"])
    def test_pairs_in_every_accepted_shape_are_submitted(
            self, client: qs.Queen, make: Callable[[], Any]) -> None:
        runs = RunQueue(client, "jobs")
        added = runs.submit_many(make())
        assert added == 2 and [e.run_id for e in runs.list()] == ["a", "b"], (
            f"submitted {added}: {runs.list()}")

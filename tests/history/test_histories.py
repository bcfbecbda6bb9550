"""Histories of real processes in every topology, under faults, judged by the checker.

The first class proves the checker can fail: each rule is fed a small hand-made
history that breaks it, and a property test feeds it correct serial histories.
The second runs a bounded history per engine (``QUEEN_SYNC_HISTORY_SECONDS`` runs
it longer; ``QUEEN_SYNC_HISTORY_SEED`` replays a seed's faults). The long soak is
``benchmarks/soak_histories.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import checker, driver
from .checker import GuardWrite, History, Observation, Section, SinkWrite

SECONDS = float(os.environ.get("QUEEN_SYNC_HISTORY_SECONDS", "10"))


def _section(sec: str, token: int, start: float, end: float, worker: str = "",
             lost: bool = False, name: str = "n", owner: str = "") -> Section:
    return Section(sec, worker or sec, name, token, start, end, lost, owner=owner or sec)


def _writes(*sections: Section) -> list[SinkWrite]:
    """One accepted sink write per section, in the given order, each reading the previous."""
    return [SinkWrite(i + 1, s.name, int(s.token or 0), s.sec, True, read=i, read_seq=i, before=i)
            for i, s in enumerate(sections)]


def _history(*sections: Section, **extra: object) -> History:
    history = History(sections=list(sections), sink=_writes(*sections),
                      observations=[Observation(s.sec, s.name, int(s.token or 0), s.start)
                                    for s in sections])
    for key, value in extra.items():
        setattr(history, key, value)
    return history


def _rules(history: History) -> set[str]:
    return {v.rule for v in checker.check(history)}


class TestTheCheckerFindsEachViolation:
    def test_a_correct_serial_history_has_no_violation(self) -> None:
        history = _history(_section("a", 1, 0.0, 1.0), _section("b", 2, 1.5, 2.0))
        assert checker.check(history) == [], "a correct history was reported as violating"

    def test_two_sections_entered_with_one_token_are_a_duplicate(self) -> None:
        history = _history(_section("a", 3, 0.0, 1.0), _section("b", 3, 2.0, 3.0))
        assert "duplicate_token" in _rules(history), "a duplicated token was not reported"

    def test_one_owner_going_on_with_its_lease_after_a_failed_release_is_no_duplicate(
            self) -> None:
        history = _history(_section("a", 3, 0.0, 1.0, owner="o"),
                           _section("b", 3, 2.0, 3.0, owner="o"))
        assert checker.check(history) == [], "a handle keeping its lease was reported"

    def test_a_token_below_one_seen_before_the_section_began_is_not_rising(self) -> None:
        history = _history(_section("a", 5, 0.0, 1.0), _section("b", 4, 2.0, 3.0))
        history.sink = []  # the sink would refuse the lower token: judge the tokens alone
        assert _rules(history) == {"token_not_rising"}, checker.check(history)

    def test_two_overlapping_writers_not_told_of_any_loss_overlap(self) -> None:
        history = _history(_section("a", 1, 0.0, 2.0), _section("b", 2, 1.0, 3.0))
        assert "overlap" in _rules(history), "two overlapping writers were not reported"

    def test_a_holder_told_it_lost_or_paused_by_the_driver_may_overlap(self) -> None:
        lost = _history(_section("a", 1, 0.0, 2.0, lost=True), _section("b", 2, 1.0, 3.0))
        paused = _history(_section("a", 1, 0.0, 2.0), _section("b", 2, 1.0, 3.0),
                          pauses={"a": [(0.5, 1.8)]})
        assert "overlap" not in _rules(lost), "an overlap by a holder told of its loss counted"
        assert "overlap" not in _rules(paused), "an overlap by a paused holder counted"

    def test_a_guarded_commit_accepted_inside_another_holders_section_is_reported(self) -> None:
        history = _history(_section("a", 1, 0.0, 2.0), _section("b", 2, 0.5, 0.9, lost=True))
        history.guards = [GuardWrite("b", "n", 2, True, 0.6, 0.7)]
        assert "guard_inside_other" in _rules(history), "a guard accepted inside a live hold"
        history.guards = [GuardWrite("b", "n", 2, False, 0.6, 0.7)]
        assert "guard_inside_other" not in _rules(history), "a REFUSED guard was reported"

    def test_a_sink_accepting_a_lower_token_after_a_higher_one_accepted_a_stale_write(self) -> None:
        history = _history(_section("a", 1, 0.0, 1.0), _section("b", 2, 2.0, 3.0))
        history.sink = [SinkWrite(1, "n", 2, "b", True), SinkWrite(2, "n", 1, "a", True)]
        assert "stale_write_accepted" in _rules(history), "a stale write accepted went unseen"

    def test_an_update_overwritten_by_a_live_holder_between_read_and_write_is_lost(self) -> None:
        history = _history(_section("a", 1, 0.0, 1.0), _section("b", 2, 2.0, 3.0))
        history.sink = [SinkWrite(1, "n", 1, "a", True, read=0, read_seq=0, before=0),
                        SinkWrite(2, "n", 2, "b", True, read=0, read_seq=0, before=1)]
        assert "lost_update" in _rules(history), "an overwritten update was not reported"
        history.sections[0] = _section("a", 1, 0.0, 1.0, lost=True)
        assert "lost_update" not in _rules(history), "a paused holder's stale update counted"

    def test_store_counters_that_disagree_or_miss_accepted_commits_are_lost_updates(self) -> None:
        history = _history(_section("a", 1, 0.0, 1.0))
        history.guards = [GuardWrite("a", "n", 1, True, 0.1, 0.2)] * 3
        history.counters = {"n": (3, 2)}
        assert "lost_update" in _rules(history), "rmw 2 beside incr 3 was not reported"
        history.counters = {"n": (2, 2)}
        assert "lost_update" in _rules(history), "3 accepted commits counted 2 went unseen"
        history.counters = {"n": (3, 3)}
        assert checker.check(history) == [], "matching counters were reported"

    def test_a_killed_section_ends_at_the_kill_and_worker_findings_are_reported(self) -> None:
        records = [
            {"k": "enter", "sec": "a", "w": "w1", "name": "n", "token": 1, "t": 1.0, "pid": 1},
            {"k": "error", "type": "ValueError", "msg": "boom", "t": 1.1, "pid": 1},
            {"k": "fork", "inherited": True, "t": 1.2, "pid": 2},
        ]
        history = checker.from_records(records, {"w1": [0.5, 4.0]})
        assert history.sections[0].end == 4.0 and not history.sections[0].closed, (
            f"a killed section should end at the kill after it began: {history.sections}")
        assert {v.rule for v in history.findings} == {"worker_error", "fork_inherited"}, (
            f"worker findings were not carried over: {history.findings}")

    def test_a_section_left_without_its_exit_record_ends_where_its_thread_entered_the_next(
        self,
    ) -> None:
        records: list[dict[str, Any]] = [
            {"k": "enter", "sec": "w1/7/3/1", "w": "w1", "name": "n", "token": None, "t": 1.0,
             "pid": 7},
            {"k": "enter", "sec": "w1/7/3/2", "w": "w1", "name": "n", "token": 5, "t": 2.0,
             "pid": 7},
            {"k": "exit", "sec": "w1/7/3/2", "w": "w1", "lost": False, "t": 2.5, "pid": 7},
            {"k": "enter", "sec": "w1/7/4/1", "w": "w1", "name": "n", "token": 6, "t": 1.5,
             "pid": 7},
        ]
        history = checker.from_records(records, {"w1": [9.0]})
        ends = {s.sec: s.end for s in history.sections}
        assert ends["w1/7/3/1"] == 2.0, f"it should end where its thread went on: {ends}"
        assert ends["w1/7/4/1"] == 9.0, f"another thread's section is not cut short: {ends}"

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.tuples(st.floats(0.01, 1.0), st.floats(0.0, 1.0), st.integers(1, 5),
                              st.booleans()), min_size=1, max_size=25))
    def test_any_serial_history_with_rising_tokens_passes(
            self, steps: list[tuple[float, float, int, bool]]) -> None:
        sections: list[Section] = []
        t, token = 0.0, 0
        for length, gap, bump, same_worker in steps:
            token += bump
            worker = "w" if same_worker else f"w{len(sections)}"
            sections.append(_section(f"s{len(sections)}", token, t, t + length, worker))
            t += length + gap + 0.001
        assert checker.check(_history(*sections)) == [], "a correct serial history failed"


@pytest.mark.realtime
@pytest.mark.parametrize("engine", ["sqlite", "postgres", "http"])
def test_histories_in_every_topology_under_faults_keep_every_invariant(
        engine: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    pg_url = str(request.getfixturevalue("pg_url")) if engine == "postgres" else None
    plan = driver.Plan(engine, SECONDS, driver.seed_from_env())
    with driver.open_store(engine, tmp_path, pg_url) as store:
        outcome = driver.run_history(plan, tmp_path, store)
    print("\n" + outcome.report())
    assert outcome.violations == [], outcome.report()
    assert outcome.ext_accepted > 0 and outcome.guard_accepted > 0, (
        f"nothing was written, so nothing was judged:\n{outcome.report()}")
    missing = set(plan.topologies) - set(outcome.per_topology)
    assert not missing, f"these topologies completed no critical section: {missing}"
    assert outcome.faults["kill"] + outcome.faults["stop"] > 0, "no fault was injected"

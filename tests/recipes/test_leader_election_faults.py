"""Leader election under faults: real candidate processes on one embedded SQLite file."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
from recipe_workers import FencedLog, Spawn, Worker

TTL = 1.0
RETRY = TTL / 3  # the renew interval, which is also the campaign's retry interval

pytestmark = pytest.mark.realtime


def _leader(candidates: list[Worker], after: float = 0.0) -> tuple[Worker, dict[str, Any]]:
    """The candidate elected after ``after`` (wall clock), waiting for one."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        for worker in candidates:
            elected = [e for e in worker.events("elected") if e["at"] > after]
            if elected:
                return worker, elected[-1]
        time.sleep(0.005)
    raise AssertionError(f"nobody was elected after {after}: "
                         f"{[w.events() for w in candidates]}")


def _wait_for_write(log: FencedLog, who: str, after: float = 0.0) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if any(w == who and ok and at > after for _, w, at, ok in log.rows()):
            return
        time.sleep(0.01)
    raise AssertionError(f"{who} never landed a write in the fenced log after {after}")


def assert_one_writer_at_a_time(log: FencedLog) -> list[tuple[int, str]]:
    """Accepted writes never interleave: tokens only rise, and each belongs to one candidate."""
    accepted = [(token, who) for token, who, _, ok in log.rows() if ok]
    tokens = [token for token, _ in accepted]
    assert tokens == sorted(tokens), f"an accepted write went back to a lower token: {tokens}"
    owner: dict[int, str] = {}
    for token, who in accepted:
        assert owner.setdefault(token, who) == who, f"token {token} landed for two candidates"
    return accepted


def _candidates(spawn: Spawn, tmp_path: Path, sqlite_url: str) -> tuple[list[Worker], FencedLog]:
    log = FencedLog(tmp_path / "fenced-log.db")
    workers = [spawn("candidate", me=f"c{n}", url=sqlite_url, name="leader", ttl=TTL,
                     log=str(log.path)) for n in range(3)]
    return workers, log


def _signal_the_leader(spawn: Spawn, tmp_path: Path, sqlite_url: str, sig: int) -> tuple[
        FencedLog, Worker, Worker, dict[str, Any], float]:
    """Three candidates; once the leader writes, ``sig`` it and wait for a successor's write.

    Returns the log, the signalled leader, its successor, the successor's election
    event, and when the signal was sent.
    """
    candidates, log = _candidates(spawn, tmp_path, sqlite_url)
    first, _ = _leader(candidates)
    _wait_for_write(log, first.name)
    signalled_at = first.signal(sig)
    second, elected = _leader([c for c in candidates if c is not first], after=signalled_at)
    _wait_for_write(log, second.name, after=signalled_at)
    return log, first, second, elected, signalled_at


class TestALeaderThatDies:
    def test_another_candidate_leads_within_ttl_plus_one_retry_interval_with_a_higher_token(
            self, spawn: Spawn, tmp_path: Path, sqlite_url: str) -> None:
        log, first, second, re_elected, killed_at = _signal_the_leader(
            spawn, tmp_path, sqlite_url, signal.SIGKILL)
        took = float(re_elected["at"]) - killed_at

        assert took <= TTL + RETRY, f"the successor took {took:.3f}s (> {TTL + RETRY:.3f}s)"
        old_tokens = [t for t, who, _, ok in log.rows() if who == first.name and ok]
        assert int(re_elected["token"]) > max(old_tokens), (
            f"successor token {re_elected['token']} is not above the dead leader's {old_tokens}")
        writers = {who for _, who in assert_one_writer_at_a_time(log)}
        assert writers == {first.name, second.name}, f"unexpected writers {writers}"


class TestALeaderPausedPastItsTtl:
    def test_its_late_writes_are_refused_and_it_reports_being_deposed(
            self, spawn: Spawn, tmp_path: Path, sqlite_url: str) -> None:
        log, paused, successor, _, _ = _signal_the_leader(
            spawn, tmp_path, sqlite_url, signal.SIGSTOP)
        resumed_at = paused.signal(signal.SIGCONT)

        refused = paused.wait_for("refused", where=lambda e: e["at"] > resumed_at)
        deposed = paused.wait_for("deposed", where=lambda e: e["at"] > resumed_at)
        assert refused["presented"] < refused["current"], f"refusal was not a fence: {refused}"
        assert deposed["reason"] == "expired", f"deposed for {deposed['reason']!r}"
        accepted = assert_one_writer_at_a_time(log)
        successor_first = next(i for i, (_, who) in enumerate(accepted) if who == successor.name)
        late = [who for _, who in accepted[successor_first:] if who == paused.name]
        assert not late, f"the paused leader landed {len(late)} write(s) after its successor"
        terms = len(paused.events("elected"))
        assert terms == len(paused.events("deposed")), "on_deposed did not fire once per term"

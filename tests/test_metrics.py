"""``q.metrics``: counters by outcome, the held gauge, timings, and the Prometheus text."""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest

import queen_sync as qs
from queen_sync.testing import FaultyEngine

OUTCOMES = {"acquired", "busy", "renewed", "renew_error", "lost_renew", "lost_guard",
            "lost_expired", "lost_closed", "released"}


def _counts(q: qs.Queen) -> dict[str, int]:
    counts: dict[str, int] = q.metrics.snapshot()["counts"]
    return counts


def _renew_now(q: qs.Queen, clock: Any, lock: qs.Lock) -> None:
    clock.advance(lock.renew_every + 0.01)
    q.renewer.tick()


class TestCounters:
    def test_acquire_busy_and_release_are_counted_and_held_follows(
            self, mq: qs.Queen, other: qs.Queen) -> None:
        mine = mq.lock("a", ttl="30s")
        assert mine.acquire()
        held_while = mq.metrics.snapshot()["held"]
        assert not other.lock("a", ttl="30s").acquire()
        mine.release()
        assert _counts(mq)["acquired"] == 1 and _counts(mq)["released"] == 1, _counts(mq)
        assert _counts(other)["busy"] == 1, _counts(other)
        assert held_while == 1 and mq.metrics.snapshot()["held"] == 0, "the held gauge"

    def test_every_outcome_has_a_counter_from_the_start(self, mq: qs.Queen) -> None:
        assert set(_counts(mq)) == OUTCOMES and not any(_counts(mq).values()), _counts(mq)

    def test_a_renew_counts_and_records_its_round_trip_and_margin(
            self, mq: qs.Queen, clock: Any) -> None:
        lock = mq.lock("a", ttl="30s")
        assert lock.acquire()
        _renew_now(mq, clock, lock)
        snap = mq.metrics.snapshot()
        assert snap["counts"]["renewed"] == 1, snap
        assert snap["renew_rtt_seconds"]["count"] == 1, snap
        expected_margin = lock.ttl - (lock.renew_every + 0.01)
        assert snap["renew_margin_min_seconds"] == pytest.approx(expected_margin), snap

    def test_a_failed_renew_counts_renew_error_not_a_loss(
            self, faulty_mq: qs.Queen, sqlite_faults: FaultyEngine, clock: Any) -> None:
        mq = faulty_mq
        lock = mq.lock("a", ttl="30s")
        assert lock.acquire()
        sqlite_faults.fail_next(None)  # an outage: every call fails until clear()
        _renew_now(mq, clock, lock)
        sqlite_faults.clear()
        counts = _counts(mq)
        assert counts["renew_error"] == 1 and counts["lost_renew"] == 0, counts
        assert lock.held and mq.metrics.snapshot()["held"] == 1, "an outage is not a loss"

    def test_losses_are_counted_by_reason(self, mq: qs.Queen, other: qs.Queen,
                                          clock: Any) -> None:
        renewed_away = mq.lock("renew", ttl="30s")
        expired = mq.lock("expire", ttl="30s", auto_renew=False)
        guarded = mq.lock("guard", ttl="30s", auto_renew=False)
        assert renewed_away.acquire() and expired.acquire() and guarded.acquire()
        assert renewed_away.token is not None and guarded.token is not None
        assert other.locks.release("renew", token=renewed_away.token)
        assert other.locks.release("guard", token=guarded.token)
        assert other.lock("guard", ttl="30s").acquire()
        _renew_now(mq, clock, renewed_away)
        mq.transaction().guard(guarded).kv.put("ns", "k", 1, ttl="1m").commit()
        clock.advance(31)
        mq.renewer.tick()
        counts = _counts(mq)
        assert (counts["lost_renew"], counts["lost_guard"], counts["lost_expired"]) == (1, 1, 1), \
            counts
        assert mq.metrics.snapshot()["held"] == 0, "lost leases leave the held gauge"


class TestTimings:
    def test_a_contended_acquire_records_its_wait(self, sqlite_url: str, other: qs.Queen) -> None:
        holder = other.lock("a", ttl="30s")
        assert holder.acquire()
        threading.Timer(0.2, holder.release).start()
        with qs.Queen(sqlite_url) as q:
            assert q.lock("a", ttl="30s").acquire(wait="5s")
            wait = q.metrics.snapshot()["acquire_wait_seconds"]
        assert wait["count"] == 1 and 0.15 <= wait["max"] < 5, wait

    def test_a_wait_that_runs_out_records_its_time_apart_from_successful_waits(
            self, sqlite_url: str, other: qs.Queen) -> None:
        assert other.lock("a", ttl="30s").acquire()
        with qs.Queen(sqlite_url) as q:
            assert not q.lock("a", ttl="30s").acquire(wait="0.2s")
            assert not q.lock("a", ttl="30s").acquire()  # no wait: a refusal, not a wait
            snap = q.metrics.snapshot()
        gave_up, waited = snap["acquire_gave_up_seconds"], snap["acquire_wait_seconds"]
        assert gave_up["count"] == 1 and 0.2 <= gave_up["max"] < 5, gave_up
        assert waited["count"] == 0, f"a wait that ran out is not a successful wait: {waited}"
        assert snap["counts"]["busy"] == 2, snap["counts"]


SAMPLE = re.compile(r'^(queen_sync_[a-z_]+)(\{outcome="[a-z_]+"\})? (NaN|[0-9.e+-]+)$')


class TestPrometheusText:
    def test_the_text_is_well_formed_and_every_sample_has_a_type(self, mq: qs.Queen) -> None:
        lock = mq.lock("a", ttl="30s")
        assert lock.acquire()
        text = mq.metrics.prometheus_text()
        typed = set(re.findall(r"^# TYPE (\S+) (?:counter|gauge|summary)$", text, re.M))
        helped = set(re.findall(r"^# HELP (\S+) \S", text, re.M))
        assert helped == typed, f"every family needs HELP and TYPE: {helped ^ typed}"
        samples = [line for line in text.splitlines() if not line.startswith("#")]
        for line in samples:
            match = SAMPLE.match(line)
            assert match, f"not a Prometheus sample line: {line!r}"
            family = re.sub(r"_(count|sum)$", "", match.group(1))
            assert match.group(1) in typed or family in typed, f"no TYPE for {line!r}"
        assert 'queen_sync_lock_events_total{outcome="acquired"} 1' in samples, text
        assert "queen_sync_held_leases 1" in samples, text
        assert text.endswith("\n"), "the exposition ends with a newline"

    def test_lock_names_never_become_labels_so_the_series_stay_the_same(
            self, mq: qs.Queen) -> None:
        before = [line.rsplit(" ", 1)[0] for line in mq.metrics.prometheus_text().splitlines()]
        for i in range(20):
            lock = mq.lock(f"customer-{i}-secret", ttl="30s")
            assert lock.acquire()
            lock.release()
        text = mq.metrics.prometheus_text()
        after = [line.rsplit(" ", 1)[0] for line in text.splitlines()]
        assert after == before, "the set of series must not grow with the workload"
        assert "customer" not in text, "lock names must never appear"

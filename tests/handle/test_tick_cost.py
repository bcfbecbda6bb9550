"""What one renew tick costs per lease: work done once per tick stays once, whatever it holds.

A tick of 10,000 leases must fit well inside their lifetime, so the clock and the shared
metrics are touched a fixed number of times per tick, not once per lease; the figures the
metrics report stay what per-lease counting gave.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import TracebackType
from typing import Optional

import pytest
from manual_clock import ManualClock

import queen_sync as qs
from queen_sync._metrics import Metrics


class CountingClock(ManualClock):
    """A manual clock that counts how often it is read."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def monotonic(self) -> float:
        self.reads += 1
        return self.now

    def wait(self, event: threading.Event, timeout: float) -> bool:
        # Until the call lands, however long it takes in real time: each wake-up before
        # then would read the clock once more, as many times as the machine is slow.
        return event.wait(5.0)


class CountingMutex:
    """A mutex that counts how often it is taken (it stands in for the metrics' own)."""

    def __init__(self) -> None:
        self._inner = threading.Lock()
        self.taken = 0

    def __enter__(self) -> bool:
        self.taken += 1
        return self._inner.__enter__()

    def __exit__(self, kind: Optional[type[BaseException]], error: Optional[BaseException],
                 trace: Optional[TracebackType]) -> None:
        self._inner.__exit__(kind, error, trace)


def holding(folder: str, clock: ManualClock, leases: int) -> tuple[qs.Queen, list[qs.Lock]]:
    q = qs.Queen("sqlite://" + os.path.join(folder, f"{leases}.db"), clock=clock,
                 renew_thread=False)
    locks = [q.lock(f"job-{i}", ttl=30) for i in range(leases)]
    assert all(lock.acquire() for lock in locks), "a fresh store must grant every lease"
    return q, locks


class TestOneTickOfManyLeases:
    @pytest.mark.parametrize("ticks", [1, 3])
    def test_reads_the_clock_as_few_times_for_200_leases_as_for_2(
        self, tmp_path: Path, ticks: int
    ) -> None:
        reads = {}
        for leases in (2, 200):
            clock = CountingClock()
            q, locks = holding(str(tmp_path), clock, leases)
            with q:
                for _ in range(ticks):
                    clock.advance(10.01)
                    before = clock.reads
                    q.renewer.tick()
                    reads[leases] = clock.reads - before
                assert all(lock.held for lock in locks), "every lease must have been renewed"
        # One read more at most: a call still running when the tick starts waiting for it
        # is waited for with a timeout counted from a reading (a quick one never is).
        assert reads[200] <= reads[2] + 1, (
            f"a tick read the clock {reads[2]} times for 2 leases and {reads[200]} times for "
            "200: it reads it per lease")

    def test_takes_the_metrics_mutex_as_often_for_200_leases_as_for_2(
        self, tmp_path: Path
    ) -> None:
        taken = {}
        for leases in (2, 200):
            clock = ManualClock()
            q, _ = holding(str(tmp_path), clock, leases)
            with q:
                mutex = CountingMutex()
                q.metrics._lock = mutex  # type: ignore[assignment]  # counted, same behaviour
                clock.advance(10.01)
                q.renewer.tick()
                taken[leases] = mutex.taken
        assert taken[200] == taken[2], (
            f"a tick updated the metrics {taken[2]} times for 2 leases and {taken[200]} times "
            "for 200: it updates them per lease")

    def test_counts_every_renewal_and_the_smallest_margin_as_per_lease_counting_did(
        self, tmp_path: Path
    ) -> None:
        clock = ManualClock()
        q, locks = holding(str(tmp_path), clock, 5)
        with q:
            clock.advance(4.0)
            late = q.lock("late", ttl=30)
            assert late.acquire(), "a fresh name must be granted"
            clock.advance(6.01)  # the first five are due; the late one is taken along
            q.renewer.tick()
            snapshot = q.metrics.snapshot()
            held = all(lock.held for lock in [*locks, late])
        assert snapshot["counts"]["renewed"] == 6, f"six renewals, counted: {snapshot}"
        # The earliest deadline a renew beat: the first five leases', 30 s after their send.
        assert snapshot["renew_margin_min_seconds"] == pytest.approx(30 - 10.01), (
            f"the smallest margin is the first leases': {snapshot}")
        assert held, "every lease must have been renewed"


class TestTheMetricsOfABatch:
    def test_a_batch_of_renewals_counts_them_and_keeps_the_smallest_margin(self) -> None:
        metrics = Metrics()
        metrics.margin(3.0)
        metrics.renewals(4, margin=2.5)
        metrics.renewals(2, margin=7.0)
        snapshot = metrics.snapshot()
        assert snapshot["counts"]["renewed"] == 6, f"4 + 2 renewals: {snapshot}"
        assert snapshot["renew_margin_min_seconds"] == 2.5, f"the smallest margin: {snapshot}"

    def test_a_batch_of_no_renewals_changes_nothing(self) -> None:
        metrics = Metrics()
        metrics.renewals(0, margin=1.0)
        snapshot = metrics.snapshot()
        assert snapshot["counts"]["renewed"] == 0, f"nothing renewed: {snapshot}"
        assert snapshot["renew_margin_min_seconds"] is None, f"no margin seen: {snapshot}"

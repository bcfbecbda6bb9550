"""``close()`` and ``release_all()`` give many leases back in a few calls, within the budget.

A client holding thousands of leases must not spend one engine call on each when it
closes (its budget runs out long before), and what it could not give back is told in
one line, not a traceback per lease.
"""

from __future__ import annotations

import logging
import math

import pytest

import queen_sync as qs
from queen_sync._handle.renewer import RELEASES_PER_CALL
from queen_sync._ops import LockOps
from queen_sync.testing import FaultyEngine


def _hold(q: qs.Queen, count: int, prefix: str = "held") -> list[qs.Lock]:
    locks = [q.lock(f"{prefix}-{i:05d}", ttl=3600) for i in range(count)]
    for lock in locks:
        assert lock.acquire(), f"{lock.name} should be free"
    return locks


def _still_held(url: str, names: list[str]) -> list[str]:
    """The names a fresh client of the same store finds held."""
    with qs.Queen(url) as other:
        held: list[str] = []
        for start in range(0, len(names), 500):
            chunk = names[start:start + 500]
            answers = other.locks.batch([LockOps.get(name) for name in chunk])
            held += [name for name, answer in zip(chunk, answers) if answer["held"]]
        return held


def _close_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "queen_sync" and r.levelno >= logging.WARNING]


class TestCloseReleasesInBatches:
    def test_close_of_a_client_holding_many_leases_releases_all_in_a_few_calls(
            self, engine_url: str) -> None:
        count = 1200
        engine = FaultyEngine(engine_url)
        q = qs.Queen(engine=engine, renew_thread=False)
        locks = _hold(q, count)
        before = engine.calls["locks"]
        q.close()
        calls = engine.calls["locks"] - before
        batches = math.ceil(count / RELEASES_PER_CALL)
        assert calls <= batches, (
            f"close() made {calls} engine calls for {count} leases: at most {batches} expected")
        assert not any(lock.held for lock in locks), "a handle still believes it holds"
        left = _still_held(engine_url, [lock.name for lock in locks])
        assert not left, f"{len(left)} leases still held after close(), e.g. {left[:3]}"

    def test_release_all_gives_every_lease_back_in_a_few_calls_and_keeps_the_client(
            self, sqlite_url: str) -> None:
        engine = FaultyEngine(sqlite_url)
        with qs.Queen(engine=engine, renew_thread=False) as q:
            locks = _hold(q, 600)
            before = engine.calls["locks"]
            assert q.locks.release_all() == 600, "release_all counts the handles that held"
            calls = engine.calls["locks"] - before
            assert calls <= math.ceil(600 / RELEASES_PER_CALL), f"{calls} calls for 600 leases"
            assert not _still_held(sqlite_url, [lock.name for lock in locks])
            assert locks[0].acquire(), "a handle stays usable after release_all()"

    def test_close_over_a_slow_engine_still_releases_every_lease_within_its_budget(
            self, sqlite_url: str) -> None:
        engine = FaultyEngine(sqlite_url)
        q = qs.Queen(engine=engine, renew_thread=False)
        locks = _hold(q, 300)
        engine.delay_next(None, seconds=0.05, route="locks", op="release")
        q.close(timeout=2.0)  # one call per lease would need 15 s
        left = _still_held(sqlite_url, [lock.name for lock in locks])
        assert not left, f"{len(left)} of 300 leases were left to expire"


class TestCloseReportsWhatItCouldNotRelease:
    def test_a_failing_engine_gets_one_summary_warning_and_no_traceback_per_lease(
            self, sqlite_url: str, caplog: pytest.LogCaptureFixture) -> None:
        engine = FaultyEngine(sqlite_url)
        q = qs.Queen(engine=engine, renew_thread=False)
        _hold(q, 40)
        engine.fail_next(None, route="locks", op="release")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="queen_sync"):
            q.close()
        warnings = _close_warnings(caplog)
        assert len(warnings) == 1, f"expected one summary line, got {len(warnings)}"
        assert warnings[0].exc_info is None, "the summary carries no traceback"
        message = warnings[0].getMessage()
        assert "40" in message and "expire" in message, message

    def test_one_failed_batch_is_counted_and_the_others_are_still_given_back(
            self, sqlite_url: str, caplog: pytest.LogCaptureFixture) -> None:
        engine = FaultyEngine(sqlite_url)
        q = qs.Queen(engine=engine, renew_thread=False)
        locks = _hold(q, 2 * RELEASES_PER_CALL + 10)
        engine.fail_next(1, route="locks", op="release")  # the first batch only
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="queen_sync"):
            q.close()
        (warning,) = _close_warnings(caplog)
        expected = f"{RELEASES_PER_CALL} of {len(locks)}"
        assert expected in warning.getMessage(), f"{expected!r} not in {warning.getMessage()!r}"
        left = _still_held(sqlite_url, [lock.name for lock in locks])
        assert len(left) == RELEASES_PER_CALL, f"{len(left)} held: only the failed batch should be"

    def test_a_handle_whose_batched_release_failed_retries_it_on_release(
            self, sqlite_url: str) -> None:
        engine = FaultyEngine(sqlite_url)
        with qs.Queen(engine=engine, renew_thread=False) as q:
            (lock,) = _hold(q, 1)
            engine.fail_next(route="locks", op="release")
            assert q.locks.release_all() == 1
            assert not lock.held, "a failed release leaves the handle not holding"
            assert lock.release(), "release() retries the failed one with its token"
            assert not _still_held(sqlite_url, [lock.name])

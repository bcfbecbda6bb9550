"""Acquires cut short by a caught Ctrl-C leave no trail on their client, however many.

Each plain acquire is listed in flight with a lock its attempt holds, so that ``close()``
waits for it. A KeyboardInterrupt can land where the unlisting never runs; the entry then
names a lock that is free. Such entries are forgotten before they pile up: a notebook whose
user presses Ctrl-C a thousand times must not keep a thousand entries, while an acquire
still running is never forgotten.
"""

from __future__ import annotations

import threading

from test_ctrl_c_in_a_plain_acquire import interrupted_at

import queen_sync as qs

SWEEPS = 12  # each sweep interrupts one acquire at every bookkeeping point in turn
BOUND = 64  # entries a client may keep for acquires that are gone, whatever the count


def sweep(q: qs.Queen, sweep_number: int) -> int:
    """Interrupt an acquire at each bookkeeping point; returns how many were interrupted."""
    for point in range(1, 2_000):
        lock = q.lock(f"job-{sweep_number}-{point}", ttl=60)
        if interrupted_at(point, lock.acquire) is None:
            return point - 1
    raise AssertionError("an acquire never ended within 2,000 points")


class TestAcquiresCutShortByCtrlC:
    def test_leave_a_bounded_number_of_entries_however_many_there_were(
            self, sqlite_url: str) -> None:
        with qs.Queen(sqlite_url, renew_thread=False) as q:
            interrupted = sum(sweep(q, n) for n in range(SWEEPS))
            left = len(q._flights)
            assert q._acquires == 0, "an acquire that is gone still counts as in flight"
        assert interrupted > BOUND, f"setup: only {interrupted} acquires were interrupted"
        assert left <= BOUND, (
            f"{interrupted} interrupted acquires left {left} entries (frames kept alive) "
            f"on their client; at most {BOUND} may stay")

    def test_never_forget_an_acquire_still_running_in_another_thread(
            self, sqlite_url: str) -> None:
        with qs.Queen(sqlite_url, renew_thread=False) as q:
            inside, leave = threading.Event(), threading.Event()

            def parked() -> None:  # an attempt held in flight, as a slow engine would
                flight = threading.Lock()
                with flight:
                    q._take_off(flight)
                    inside.set()
                    leave.wait(30)
                q._land(flight)

            worker = threading.Thread(target=parked, daemon=True)
            worker.start()
            assert inside.wait(10), "setup: the parked acquire never started"
            try:
                for n in range(SWEEPS):  # enough dead entries to make the client prune
                    sweep(q, n)
                assert q._acquires == 1, (
                    f"the acquire still running is counted {q._acquires} times, not once")
            finally:
                leave.set()
                worker.join(10)
            assert q._acquires == 0, "the acquire that landed still counts as in flight"

"""A handle's name and owner cannot change under a lease it holds.

The permit is the row of the name and owner it was taken with; a release, a renew and
``close()`` use the handle's name and owner of the moment. A change while the handle
holds (or is taking) a permit would leave that row to its lifetime, with nobody to give
it back, so the assignment is refused with ``LockError`` and changes nothing.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from manual_clock import ManualClock

import queen_sync as qs

_NAMES = st.sampled_from(["job", "other", "third"])
_OWNERS = st.sampled_from(["worker-1", "worker-2"])
_STEPS = st.lists(st.one_of(st.tuples(st.just("acquire"), st.none()),
                            st.tuples(st.just("release"), st.none()),
                            st.tuples(st.just("name"), _NAMES),
                            st.tuples(st.just("owner"), _OWNERS)), max_size=12)
_EXAMPLES = int(os.environ.get("QUEEN_SYNC_RENAME_EXAMPLES", "40"))


def _live_permits(q: qs.Queen) -> dict[str, list[str]]:
    """Every name tried here, with the owners of its live permits."""
    names = ("job", "other", "third", "renamed")
    return {name: sorted(h["owner"] for h in q.locks.get(name)["holders"]) for name in names}


class TestAssignmentsToAHeldHandle:
    @pytest.mark.parametrize("what", ["name", "owner"])
    def test_a_held_handle_refuses_the_change_and_keeps_its_lease(
        self, q: qs.Queen, what: str
    ) -> None:
        lock = q.lock("job", ttl=30, owner="worker-1")
        assert lock.acquire(), "a free store must grant the lease"
        with pytest.raises(qs.LockError, match="release it first"):
            setattr(lock, what, "renamed")
        assert (lock.name, lock.owner) == ("job", "worker-1"), "a refused change changed it"
        assert lock.held and lock.renew(), "the lease must be kept and renewable"
        assert lock.release(), "the permit must be given back under its own name"
        assert _live_permits(q) == {"job": [], "other": [], "third": [], "renamed": []}

    def test_a_block_whose_lease_was_given_back_inside_it_still_refuses(
        self, q: qs.Queen
    ) -> None:
        lock = q.lock("job", ttl=30)
        with lock:
            assert lock.release(), "an explicit release inside a block gives back at once"
            with pytest.raises(qs.LockError, match="release it first"):
                lock.name = "renamed"
        lock.name = "renamed"
        assert lock.name == "renamed", "outside every block a released handle may be renamed"

    def test_a_released_handle_takes_its_next_lease_under_the_new_name(
        self, q: qs.Queen
    ) -> None:
        lock = q.lock("job", ttl=30)
        assert lock.acquire() and lock.release(), "setup: a free lock, taken and given back"
        lock.name, lock.owner = "renamed", "worker-2"
        assert lock.acquire(), "a free store must grant the renamed handle"
        assert _live_permits(q)["renamed"] == ["worker-2"]
        assert lock.release(), "the new lease must be given back under the new name"
        assert _live_permits(q) == {"job": [], "other": [], "third": [], "renamed": []}


class TestNoStepSequenceLeavesAPermitBehind:
    @settings(max_examples=_EXAMPLES, deadline=None)
    @given(steps=_STEPS)
    def test_after_close_no_name_has_a_live_permit_whatever_was_renamed_when(
        self, steps: list[tuple[str, object]]
    ) -> None:
        with tempfile.TemporaryDirectory() as folder:
            url = "sqlite://" + os.path.join(folder, "q.db")
            with qs.Queen(url, clock=ManualClock(), renew_thread=False) as q:
                lock = q.lock("job", ttl=30, owner="worker-1")
                for step, value in steps:
                    held_before = lock.token is not None
                    if step == "acquire":
                        lock.acquire()
                    elif step == "release":
                        lock.release()
                    else:
                        before = getattr(lock, step)
                        try:
                            setattr(lock, step, value)
                        except qs.LockError:
                            assert held_before, f"{step} refused on a handle holding nothing"
                            assert getattr(lock, step) == before, "a refused change changed it"
                        else:
                            assert not held_before, f"{step} changed under a held lease"
                    live = _live_permits(q)
                    expected: dict[str, list[str]] = {name: [] for name in live}
                    if lock.token is not None:
                        expected[lock.name] = [lock.owner]
                    assert live == expected, f"after {step}: the store disagrees with the handle"
            with qs.Queen(url, clock=ManualClock(), renew_thread=False) as after:
                assert all(not owners for owners in _live_permits(after).values()), (
                    "close() left a permit")


class TestARenameRacingAnAcquire:
    def test_a_thread_renaming_while_another_takes_and_gives_back_leaves_nothing_held(
        self, sqlite_url: str
    ) -> None:
        with qs.Queen(sqlite_url) as q:
            lock = q.lock("job", ttl=30)
            stop = threading.Event()
            refused = [0]

            def rename() -> None:
                while not stop.is_set():
                    for name in ("other", "job"):
                        try:
                            lock.name = name
                        except qs.LockError:
                            refused[0] += 1
            renamer = threading.Thread(target=rename)
            # The renamer never waits, so each time the acquiring thread lets the GIL go (in
            # SQLite) it would wait a whole switch interval (5 ms) to get it back.
            switch = sys.getswitchinterval()
            sys.setswitchinterval(0.0001)
            renamer.start()
            try:
                for _ in range(800):
                    if lock.acquire():
                        lock.release()
            finally:
                stop.set()
                renamer.join()
                sys.setswitchinterval(switch)
            assert refused[0] > 0, "the race never met a held handle: the test shows nothing"
        with qs.Queen(sqlite_url) as after:
            live = _live_permits(after)
            assert all(not owners for owners in live.values()), f"permits left behind: {live}"

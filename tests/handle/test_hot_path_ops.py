"""The ops a handle sends on its hot path: checked once, and always the ones ``LockOps`` builds.

An acquire op is checked when first built for a name, owner, lifetime and limit, then
reused; a release op is checked once per name and copied with the token and slot of the
moment. Whatever changes between pairs, what reaches the engine is what ``LockOps`` would
build from the handle's state at that moment.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Mapping, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from manual_clock import ManualClock

import queen_sync as qs
from queen_sync._durations import wire_seconds
from queen_sync._ops import LockOps

_NAMES = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="#"),
                 min_size=1, max_size=8)
_CHANGES = st.lists(st.tuples(st.sampled_from(["ttl", "owner", "name", "none"]),
                              st.integers(3, 3600), _NAMES), max_size=5)


class _SentOps:
    """The lock ops a client's engine is sent, in order."""

    def __init__(self, q: qs.Queen) -> None:
        self.ops: list[dict[str, Any]] = []
        engine = q.engine
        call = engine.call

        def recording(route: str, body: Mapping[str, Any]) -> dict[str, Any]:
            if route == "locks":
                self.ops.extend(dict(op) for op in body["operations"])
            return call(route, body)
        engine.call = recording  # type: ignore[method-assign]


def _expected_acquire(lock: qs.Lock) -> dict[str, Any]:
    return LockOps.acquire(lock.name, ttl_seconds=wire_seconds(lock.ttl), owner=lock.owner,
                           limit=lock.limit if lock.limit > 1 else None)


def _change(lock: qs.Lock, what: str, seconds: int, text: str) -> None:
    if what == "ttl":
        lock.ttl = seconds
    elif what == "owner":
        lock.owner = text
    elif what == "name":
        lock.name = text


class TestOpsSentByPairs:
    @settings(max_examples=20, deadline=None)
    @given(name=_NAMES, limit=st.integers(1, 3), changes=_CHANGES)
    def test_each_acquire_and_release_sent_is_the_op_built_for_the_handle_at_that_moment(
        self, name: str, limit: int, changes: list[tuple[str, int, str]]
    ) -> None:
        with tempfile.TemporaryDirectory() as folder, \
                qs.Queen("sqlite://" + os.path.join(folder, "q.db"), clock=ManualClock(),
                         renew_thread=False) as mq:
            lock = mq.semaphore(name, limit, ttl=30) if limit > 1 else mq.lock(name, ttl=30)
            sent = _SentOps(mq)
            for what, seconds, text in [("none", 0, ""), *changes]:
                _change(lock, what, seconds, text)
                expected_acquire = _expected_acquire(lock)
                del sent.ops[:]
                assert lock.acquire(), f"a free store must grant {lock!r}"
                token, slot = lock.token, lock.slot
                assert token is not None and slot is not None, f"{lock!r} should hold"
                assert lock.release(), f"{lock!r} must be given back"
                expected_release = LockOps.release(lock.name, token=token, slot=slot)
                assert sent.ops == [expected_acquire, expected_release], (
                    f"after a change of {what}, the ops sent differ from those LockOps builds")


class TestOpsCheckedOnce:
    def test_a_handle_builds_its_acquire_op_once_per_name_owner_ttl_and_limit(
        self, mq: qs.Queen, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        built: list[str] = []
        build = LockOps.acquire

        def counting(name: str, *, ttl_seconds: int, owner: Optional[str] = None,
                     limit: Optional[int] = None) -> dict[str, Any]:
            built.append(name)
            return build(name, ttl_seconds=ttl_seconds, owner=owner, limit=limit)
        monkeypatch.setattr(LockOps, "acquire", staticmethod(counting))
        lock = mq.lock("job", ttl=30)
        for _ in range(3):
            assert lock.acquire() and lock.release(), "setup: a free lock, taken and given back"
        assert built == ["job"], f"three pairs built (and checked) the acquire op {len(built)}x"
        lock.ttl = 60
        assert lock.acquire() and lock.release(), "a free lock, taken and given back"
        assert built == ["job", "job"], "a new lifetime must build (and check) a new op"

    def test_a_handle_builds_its_release_op_once_per_name(
        self, mq: qs.Queen, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        built: list[str] = []
        build = LockOps.release

        def counting(name: str, *, token: int, slot: Optional[int] = None) -> dict[str, Any]:
            built.append(name)
            return build(name, token=token, slot=slot)
        monkeypatch.setattr(LockOps, "release", staticmethod(counting))
        lock = mq.lock("job", ttl=30)
        for _ in range(3):
            assert lock.acquire() and lock.release(), "setup: a free lock, taken and given back"
        assert built == ["job"], f"three pairs built (and checked) the release op {len(built)}x"

    def test_a_limit_set_to_garbage_is_refused_at_the_next_acquire_and_takes_nothing(
        self, mq: qs.Queen
    ) -> None:
        lock = mq.lock("job", ttl=30)
        assert lock.acquire() and lock.release(), "setup: a free lock, taken and given back"
        lock.limit = 0
        with pytest.raises(ValueError, match="limit"):
            lock.acquire()
        assert mq.locks.get("job").get("holders") == [], "a refused acquire must take nothing"


class TestForkGeneration:
    def test_the_fork_generation_moves_in_a_forked_child_and_stays_in_the_parent(self) -> None:
        from queen_sync import _process

        before = _process.forks.generation
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report its generation, then leave at once
            os.write(write, str(_process.forks.generation).encode())
            os._exit(0)
        os.close(write)
        child = int(os.read(read, 64).decode())
        os.close(read)
        os.waitpid(pid, 0)
        assert child == before + 1, f"a forked child's generation is {child}, not {before + 1}"
        assert _process.forks.generation == before, "the parent's generation must not move"

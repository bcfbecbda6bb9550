"""When ``acquire(wait=...)`` arms the engine's wake-up: only once a first attempt has failed.

Arming costs a socket (SQLite) or a LISTEN (PostgreSQL), so a free lock must not pay it.
Arming late opens a gap: a release landing between the failed attempt and the arming
wakes nobody, so the waiter must look again once armed instead of sleeping through it.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import pytest

import queen_sync as qs
from queen_sync._engines.base import Waiter


class _RecordingWaiter:
    """The engine's waiter, noting each time the handle sleeps on it."""

    def __init__(self, inner: Waiter, sleeps: list[float]) -> None:
        self._inner = inner
        self._sleeps = sleeps

    def wait(self, timeout: float) -> bool:
        self._sleeps.append(timeout)
        return self._inner.wait(timeout)


def _watch_subscriptions(q: qs.Queen, monkeypatch: pytest.MonkeyPatch,
                         on_arm: Callable[[], object] = lambda: None
                         ) -> tuple[list[str], list[float]]:
    """Record each arming of ``q``'s engine wake-up, and each sleep on it; ``on_arm`` runs first."""
    armed: list[str] = []
    sleeps: list[float] = []
    subscribe = q.engine.subscribe

    @contextlib.contextmanager
    def recording(name: str) -> Iterator[Waiter]:
        armed.append(name)
        on_arm()
        with subscribe(name) as waiter:
            yield _RecordingWaiter(waiter, sleeps)

    monkeypatch.setattr(q.engine, "subscribe", recording)
    return armed, sleeps


class TestArmingTheWakeUp:
    def test_waiting_for_a_free_lock_takes_it_without_arming_the_wake_up(
        self, sqlite_url: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        with qs.Queen(sqlite_url, renew_thread=False) as q:
            armed, _ = _watch_subscriptions(q, monkeypatch)
            lock = q.lock("free", ttl=30)
            assert lock.acquire(wait=5), "a free lock is taken at the first attempt"
            lock.release()
            assert armed == [], f"the wake-up was armed for a free lock: {armed}"

    def test_a_waiter_arms_the_wake_up_once_its_first_attempt_finds_the_lock_held(
        self, sqlite_url: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        with qs.Queen(sqlite_url, renew_thread=False) as q:
            holder = q.lock("busy", ttl=30)
            assert holder.acquire()
            armed, sleeps = _watch_subscriptions(q, monkeypatch)
            assert not q.lock("busy", ttl=30).acquire(wait=0.05), "the lock stays held"
            assert armed == ["busy"], f"a held lock must arm the wake-up once: {armed}"
            assert sleeps, "a waiter on a held lock sleeps on the wake-up between attempts"

    def test_a_release_between_the_failed_attempt_and_the_arming_is_not_slept_through(
        self, sqlite_url: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        with qs.Queen(sqlite_url, renew_thread=False) as q:
            holder = q.lock("gap", ttl=30)
            assert holder.acquire()
            # The holder lets go after the waiter's first attempt failed and before it armed:
            # no wake-up is sent to a socket not yet bound.
            armed, sleeps = _watch_subscriptions(q, monkeypatch, on_arm=holder.release)
            waiter = q.lock("gap", ttl=30)
            assert waiter.acquire(wait=30), "the waiter must take the lock freed in the gap"
            assert armed == ["gap"], f"the first attempt must have failed and armed: {armed}"
            assert sleeps == [], (
                f"the waiter slept {sleeps} s on a wake-up that had already happened: once "
                "armed it must look again before sleeping")

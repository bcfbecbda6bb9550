"""An engine that cannot arbitrate is refused, naming what it lacks, before anything is taken.

A lease is only worth its fencing token and its one clock: an engine declaring
``fencing=False`` or ``engine_clock_expiry=False`` cannot keep two holders' work
apart, so ``Lock`` and ``@singleton_job`` refuse it with ``UnsupportedOperationError``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterator, Mapping

import pytest

import queen_sync as qs
import queen_sync._default as default
from queen_sync._client import default_url
from queen_sync._engines import engine_from_url
from queen_sync._engines.base import Capabilities, Engine

MISSING = ["fencing", "engine_clock_expiry"]


class Declaring(Engine):
    """A real SQLite engine behind declared capabilities (what a third-party store might say)."""

    kind = "declaring"

    def __init__(self, url: str, capabilities: Capabilities) -> None:
        self._inner = engine_from_url(url, {})
        self.capabilities = capabilities
        self.sent: list[str] = []

    @property
    def url(self) -> str:
        return self._inner.url

    def call(self, route: str, body: Mapping[str, Any]) -> dict[str, Any]:
        self.sent.append(route)
        return self._inner.call(route, body)

    def close(self) -> None:
        self._inner.close()


def _client(url: str, **declared: bool) -> qs.Queen:
    engine = Declaring(url, replace(Capabilities(), **declared))
    return qs.Queen(engine=engine, renew_thread=False)


@pytest.fixture(params=MISSING)
def weak(request: pytest.FixtureRequest, sqlite_url: str) -> Iterator[tuple[qs.Queen, str]]:
    """A client whose engine lacks one capability a lease needs, and that capability's name."""
    with _client(sqlite_url, **{request.param: False}) as client:
        yield client, request.param


def _refused(caught: pytest.ExceptionInfo[qs.UnsupportedOperationError], missing: str) -> None:
    assert caught.value.capability == missing, repr(caught.value)
    assert missing in str(caught.value) and "declaring" in str(caught.value), str(caught.value)


class TestLock:
    @pytest.mark.parametrize("take", [
        lambda lock: lock.acquire(), lambda lock: lock.acquire(wait=1),
        lambda lock: lock.run(lambda: None), lambda lock: lock.__enter__(),
    ], ids=["acquire", "acquire_wait", "run", "with"])
    def test_a_lock_on_an_engine_that_cannot_arbitrate_is_refused_before_sending(
            self, weak: tuple[qs.Queen, str], take: Any) -> None:
        q, missing = weak
        lock = q.lock("job", ttl=30)
        with pytest.raises(qs.UnsupportedOperationError) as caught:
            take(lock)
        _refused(caught, missing)
        engine = q.engine
        assert isinstance(engine, Declaring), engine
        assert engine.sent == [], engine.sent
        assert not lock.held and not lock.in_block, repr(lock)

    def test_a_semaphore_is_refused_too(self, weak: tuple[qs.Queen, str]) -> None:
        q, missing = weak
        with pytest.raises(qs.UnsupportedOperationError) as caught:
            q.semaphore("pool", 3, ttl=30).acquire()
        _refused(caught, missing)

    def test_the_same_store_behind_full_capabilities_is_used(self, sqlite_url: str) -> None:
        with _client(sqlite_url) as q:
            assert q.lock("job", ttl=30).acquire(), "the refusal must come from the flags alone"


class TestSingletonJob:
    def test_a_job_given_such_a_client_is_refused_at_decoration(
            self, weak: tuple[qs.Queen, str]) -> None:
        q, missing = weak
        with pytest.raises(qs.UnsupportedOperationError) as caught:
            @qs.singleton_job("nightly", client=q)
            def nightly() -> int:
                raise AssertionError("the body must never run")
        _refused(caught, missing)

    def test_a_job_whose_client_cannot_arbitrate_is_refused_at_the_call(
            self, sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
        ran: list[int] = []

        @qs.singleton_job("nightly", ttl=30)
        def nightly() -> None:
            ran.append(1)

        with _client(sqlite_url, fencing=False) as q:
            # The default client is built from a URL; a declared engine can only be put in place.
            monkeypatch.setattr(default, "_client", q)
            monkeypatch.setattr(default, "_built_for", default_url())
            assert qs.default_client() is q
            with pytest.raises(qs.UnsupportedOperationError) as caught:
                nightly()
            assert caught.value.capability == "fencing", repr(caught.value)
        assert not ran, "the body must not run without a lease that can fence it"

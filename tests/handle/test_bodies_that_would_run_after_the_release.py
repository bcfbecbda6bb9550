"""A body that would run only after the lease is given back is refused at the call.

A generator function, a coroutine function or an async generator function called by
``Lock.run`` or a ``@singleton_job`` returns at once with nothing of its body run: the
lease would be released, and its body run later, unguarded, when someone iterates or
awaits it (and ``once_per`` would mark the period done). Refused before anything is
acquired, or, for a plain callable that returns such an object, before the release.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

import queen_sync as qs


def generator_body() -> Iterator[int]:
    yield 1


async def coroutine_body() -> int:
    return 1


async def async_generator_body() -> AsyncIterator[int]:
    yield 1


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "generator function": generator_body,
    "coroutine function": coroutine_body,
    "async generator function": async_generator_body,
    "partial of a generator function": functools.partial(generator_body),
}
# Plain callables whose call hands back a body not yet run.
RETURNING: dict[str, Callable[[], Any]] = {
    "generator": lambda: generator_body(),
    "coroutine": lambda: coroutine_body(),
    "async generator": lambda: async_generator_body(),
}


def holders(q: qs.Queen, name: str) -> list[Any]:
    return list(q.locks.get(name)["holders"])


class TestLockRun:
    @pytest.mark.parametrize("kind", sorted(FUNCTIONS))
    def test_refuses_a_function_whose_body_runs_later_before_acquiring(
        self, q: qs.Queen, kind: str
    ) -> None:
        lock = q.lock(f"later-{kind}", ttl=30)
        with pytest.raises(TypeError, match="after the lease"):
            lock.run(FUNCTIONS[kind])
        assert not lock.held and holders(q, lock.name) == []
        assert q.metrics.snapshot()["counts"]["acquired"] == 0

    @pytest.mark.parametrize("kind", sorted(RETURNING))
    def test_refuses_a_returned_body_not_yet_run_and_still_releases(
        self, q: qs.Queen, kind: str
    ) -> None:
        lock = q.lock(f"returned-{kind}", ttl=30)
        with pytest.raises(TypeError, match="after the lease"):
            lock.run(RETURNING[kind])
        assert not lock.held and holders(q, lock.name) == []

    def test_still_runs_a_plain_function_and_returns_its_value(self, q: qs.Queen) -> None:
        lock = q.lock("plain", ttl=30)
        assert lock.run(lambda: [1, 2]).value == [1, 2]


class TestSingletonJob:
    @pytest.mark.parametrize("kind", sorted(FUNCTIONS))
    def test_refuses_to_decorate_a_function_whose_body_runs_later(
        self, q: qs.Queen, kind: str
    ) -> None:
        with pytest.raises(TypeError, match="after the lease"):
            qs.singleton_job(f"job-{kind}", client=q)(FUNCTIONS[kind])

    def test_a_body_returned_not_yet_run_is_refused_and_its_period_not_marked_done(
        self, q: qs.Queen
    ) -> None:
        runs: list[int] = []

        @qs.singleton_job("daily-later", client=q, once_per="1d")
        def job() -> Any:
            runs.append(1)
            return generator_body()

        with pytest.raises(TypeError, match="after the lease"):
            job()
        with pytest.raises(TypeError, match="after the lease"):
            job()  # not skipped as done: the period was not recorded
        assert runs == [1, 1]
        assert holders(q, "daily-later") == []

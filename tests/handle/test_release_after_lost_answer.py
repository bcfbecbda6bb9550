"""A renew applied but whose answer was lost: the handle's release still frees the permit."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest
from manual_clock import ManualClock

import queen_sync as qs
from queen_sync.testing import LocalBroker

Arrange = Callable[[int], None]


class LostAnswers:
    """Wraps an SQLite client's engine: the next ``n`` lock calls apply, then raise."""

    def __init__(self, q: qs.Queen) -> None:
        self.left = 0
        self._real = q._engine.call
        q._engine.call = self._call  # type: ignore[method-assign]

    def _call(self, route: str, body: Any) -> Any:
        answer = self._real(route, body)
        if route == "locks" and self.left > 0:
            self.left -= 1
            raise qs.EngineUnavailableError("the answer was lost on the way back (simulated)")
        return answer


@pytest.fixture(params=["sqlite", "http"])
def lossy(request: pytest.FixtureRequest, tmp_path: Any,
          clock: ManualClock) -> Iterator[tuple[qs.Queen, Arrange]]:
    """A client on a manual clock and a way to lose the answers of its next n lock calls."""
    if request.param == "sqlite":
        q = qs.Queen("sqlite://" + str(tmp_path / "queen.db"), clock=clock, renew_thread=False)
        wrapper = LostAnswers(q)

        def arrange(n: int) -> None:
            wrapper.left = n
        yield q, arrange
        q.close()
        return
    with LocalBroker(str(tmp_path / "broker.db")) as broker:
        q = qs.Queen(broker.url, retries=0, clock=clock, renew_thread=False)

        def arrange(n: int) -> None:
            broker.faults.reset_next(n, route="locks", applied=True)
        yield q, arrange
        q.close()


@pytest.mark.parametrize("lost", [1, 2, 3])
def test_a_release_after_renews_whose_answers_were_lost_frees_the_permit(
    lossy: tuple[qs.Queen, Arrange], clock: ManualClock, lost: int
) -> None:
    q, arrange = lossy
    lock = q.lock("job", ttl=30)
    assert lock.acquire()
    known = lock.token
    arrange(lost)
    clock.advance(10.01)
    for _ in range(lost):
        q.renewer.tick()
        clock.advance(5.5)  # a failed renew is retried sooner than a third of the lifetime
    assert q.metrics.snapshot()["counts"]["renew_error"] == lost, q.metrics.snapshot()
    assert lock.token == known, "the handle cannot know a token whose answer it never got"
    assert lock.held and not lock.lost.is_set(), f"a lost answer is not a loss: {lock!r}"
    assert lock.release(), "release after a lost renew answer freed nothing"
    fresh = q.locks.acquire("job", ttl_seconds=30, owner="fresh")
    assert fresh, f"the permit stayed held after release: {fresh!r}"

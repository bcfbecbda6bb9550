"""A renew applied but whose answer was lost: the handle's release still frees the permit."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest
from manual_clock import ManualClock

import queen_sync as qs
from queen_sync.testing import FaultyEngine, LocalBroker

Arrange = Callable[[int], None]


@pytest.fixture(params=["sqlite", "http"])
def lossy(request: pytest.FixtureRequest, tmp_path: Any,
          clock: ManualClock) -> Iterator[tuple[qs.Queen, Arrange]]:
    """A client on a manual clock and a way to lose the answers of its next n lock calls."""
    if request.param == "sqlite":
        engine = FaultyEngine("sqlite://" + str(tmp_path / "queen.db"))
        q = qs.Queen(engine=engine, clock=clock, renew_thread=False)

        def arrange(n: int) -> None:
            engine.fail_next(n, route="locks", applied=True, error=qs.EngineUnavailableError(
                "the answer was lost on the way back (simulated)"))
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

"""Ctrl-C at any moment of a block leaves no permit stranded and no handle stuck."""

from __future__ import annotations

import _thread
import random
import threading
import time
from typing import Any, Iterator, Optional

import pytest

import queen_sync as qs
from queen_sync.testing import FaultyEngine, LocalBroker


@pytest.fixture
def q(sqlite_url: str) -> Iterator[qs.Queen]:
    client = qs.Queen(sqlite_url, renew_thread=False)
    yield client
    client.close()


def mine_on_engine(q: qs.Queen, lock: qs.Lock) -> list[Any]:
    return [h for h in q.locks.get(lock.name)["holders"] if h["owner"] == lock.owner]


def assert_clean(q: qs.Queen, lock: qs.Lock) -> None:
    assert not lock.in_block, f"the handle is stuck in a block: {lock!r}"
    assert not lock.held and lock not in q.renewer.held(), f"a lease is kept: {lock!r}"
    assert mine_on_engine(q, lock) == [], "a permit of this handle is stranded on the engine"


class TestInterruptedExit:
    @pytest.mark.parametrize("after", [False, True], ids=["before-sent", "after-applied"])
    def test_an_interrupt_during_the_exit_release_strands_no_permit(
        self, sqlite_faults: FaultyEngine, after: bool
    ) -> None:
        with qs.Queen(engine=sqlite_faults, renew_thread=False) as q:
            lock = q.lock("job", ttl=60)
            with pytest.raises(KeyboardInterrupt), lock:
                # Ctrl-C at the exit's release, before it is sent or once the engine applied it.
                sqlite_faults.fail_next(error=KeyboardInterrupt, route="locks", op="release",
                                        applied=after)
            assert sqlite_faults.injected["fail"] == 1, "setup: the release was not interrupted"
            assert_clean(q, lock)
            assert lock.acquire(), "the handle must be usable again"


class TestInterruptedEntry:
    def test_an_interrupt_just_after_the_acquire_keeps_no_lease(
            self, q: qs.Queen, monkeypatch: pytest.MonkeyPatch) -> None:
        lock = q.lock("job", ttl=60)
        real = q.renewer.register

        def register_then_interrupt(handle: qs.Lock) -> None:
            real(handle)
            raise KeyboardInterrupt  # Ctrl-C lands once the lease is taken and tracked

        monkeypatch.setattr(q.renewer, "register", register_then_interrupt)
        with pytest.raises(KeyboardInterrupt), lock:
            pytest.fail("the block must not run")
        monkeypatch.undo()
        assert_clean(q, lock)


def interrupt_blocks(lock: qs.Lock, delay: float, nested: bool) -> Optional[float]:
    """Loop ``with lock:`` until Ctrl-C arrives after ``delay``; the wall time it fired at."""
    fired: list[float] = []

    def interrupt() -> None:
        fired.append(time.time())
        _thread.interrupt_main()

    timer = threading.Timer(delay, interrupt)
    try:
        try:
            timer.start()
            until = time.monotonic() + 4 * delay + 0.05
            while time.monotonic() < until:
                with lock:
                    if nested:
                        with lock:
                            pass
        finally:
            timer.join()  # a late interrupt lands here, still inside the try
    except KeyboardInterrupt:
        return fired[0]
    return None


class TestInterruptFuzz:
    @pytest.mark.realtime
    # An HTTP call cut short by Ctrl-C leaves its socket for the collector to close.
    @pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
    @pytest.mark.parametrize("engine", ["sqlite", "http"])
    def test_interrupts_at_random_moments_leave_nothing_stranded_or_stuck(
        self, engine: str, sqlite_url: str
    ) -> None:
        rng = random.Random()
        seed = rng.randrange(1 << 30)
        rng.seed(seed)
        problems: list[str] = []
        with LocalBroker() as broker:
            url = sqlite_url if engine == "sqlite" else broker.url
            q = qs.Queen(url, renew_thread=False)
            ends = time.monotonic() + 3.0
            i = 0
            while time.monotonic() < ends:
                lock = q.lock(f"k{i}", ttl=60)
                i += 1
                nested = rng.random() < 0.5
                fired_at = interrupt_blocks(lock, rng.uniform(0.0, 0.02), nested)
                if fired_at is None:
                    continue
                problems += check(q, lock, f"round {i} nested={nested}", fired_at)
            q.close()
        assert i > 20, f"too few rounds ran ({i})"
        assert not problems, f"seed {seed}: {problems[:5]}"


def check(q: qs.Queen, lock: qs.Lock, where: str, fired_at: float) -> list[str]:
    problems = []
    if lock.in_block:
        problems.append(f"{where}: stuck in a block")
    if lock._token is not None:
        problems.append(f"{where}: lease kept with no block open")
    # Over HTTP a request cut short by Ctrl-C may still be applied by the broker after the
    # handle gave back what it could see (it expires by its TTL): only a permit granted
    # BEFORE the interrupt and left behind is stranded by the handle.
    granted_before = [h for h in mine_on_engine(q, lock) if h["since"] < fired_at * 1000]
    if granted_before:
        problems.append(f"{where}: permit stranded on the engine")
    return problems

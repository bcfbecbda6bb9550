"""Blocks on one handle nest (released at the OUTERMOST exit) and exclude other threads."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from typing import Any, Callable

import pytest
from manual_clock import ManualClock

import queen_sync as qs


def held_on_engine(q: qs.Queen, name: str) -> bool:
    return bool(q.locks.get(name))


class TestNesting:
    def test_a_nested_block_keeps_the_lease_until_the_outer_exits(self, mq: qs.Queen) -> None:
        lock = mq.lock("job", ttl=30)
        with lock:
            token = lock.token
            with lock:
                assert qs.current_lock() is lock
            assert lock.held and lock.token == token, f"the inner exit released: {lock!r}"
            assert held_on_engine(mq, "job"), "the engine no longer has the permit"
            assert qs.current_lock() is lock, "current_lock() lost the outer block"
        assert not lock.held and not held_on_engine(mq, "job"), "the outer exit must release"
        assert qs.current_lock() is None

    def test_run_inside_a_with_block_keeps_the_lease(self, mq: qs.Queen) -> None:
        lock = mq.lock("job", ttl=30)
        with lock:
            result = lock.run(lambda: lock.token)
            assert result.acquired, result
            assert lock.held and held_on_engine(mq, "job"), "run inside with released early"
        assert not held_on_engine(mq, "job")

    def test_current_lock_inside_a_singleton_job_body_does_not_release_it(
        self, mq: qs.Queen
    ) -> None:
        seen: list[bool] = []

        @qs.singleton_job("nightly", client=mq, on_lost="ignore")
        def job() -> None:
            lock = qs.current_lock()
            assert lock is not None
            with lock:  # a helper taking "the current lock" for its own step
                pass
            seen.append(lock.held and held_on_engine(mq, "nightly"))

        job()
        assert seen == [True], "the helper's block released the job's lease"
        assert not held_on_engine(mq, "nightly"), "the job must release when it returns"

    def test_an_explicit_release_inside_blocks_releases_now(self, mq: qs.Queen) -> None:
        lock = mq.lock("job", ttl=30)
        with lock, lock:
            assert lock.release(), "an explicit release must give the permit back"
            assert not held_on_engine(mq, "job")
        assert not lock.held, "the outer exit has nothing to release and raises nothing"

    def test_a_nested_block_after_a_loss_raises_and_takes_nothing(self, mq: qs.Queen) -> None:
        lock = mq.lock("job", ttl=30)
        with lock:
            mq.kv.delete("queen-locks", "job#0")
            assert not lock.renew() and lock.lost.is_set()
            with pytest.raises(qs.LockLostError) as raised, lock:
                pytest.fail("the inner block must not run on a lost lease")
            assert raised.value.reason == "renew", f"wrong reason: {raised.value!r}"
            assert lock.lost.is_set() and not lock.held, f"the loss was erased: {lock!r}"
            assert not held_on_engine(mq, "job"), "the nested entry took a new lease"
            assert qs.current_lock() is lock, "the failed entry unwound the outer block"
        assert lock._blocks == 0, "the entry count leaked"
        with lock:
            assert lock.held, "a new outermost block must take the lease again"

    def test_a_nested_block_past_the_deadline_reports_the_expiry(
        self, mq: qs.Queen, clock: ManualClock
    ) -> None:
        lock = mq.lock("job", ttl=30)
        with lock:
            clock.advance(31)  # the renewer has not looked yet
            with pytest.raises(qs.LockLostError) as raised, lock:
                pytest.fail("the inner block must not run on an expired lease")
            assert raised.value.reason == "expired", f"wrong reason: {raised.value!r}"
            assert lock.lost.is_set(), f"the outer block cannot learn of the loss: {lock!r}"

    def test_a_nested_block_after_an_explicit_release_takes_the_lease_again(
        self, mq: qs.Queen
    ) -> None:
        lock = mq.lock("job", ttl=30)
        with lock:
            assert lock.release(), "setup: the explicit release must give it back"
            with lock:
                assert lock.held, "a release is no loss: the nested block takes it again"
        assert not held_on_engine(mq, "job"), "the outermost exit must release"

    def test_a_failed_nested_entry_does_not_end_the_outer_block(self, mq: qs.Queen) -> None:
        lock = mq.lock("job", ttl=30)
        with lock:
            mq.kv.delete("queen-locks", "job#0")
            assert not lock.renew()
            assert mq.locks.acquire("job", ttl_seconds=30, owner="thief")
            with pytest.raises(qs.LockLostError), lock:
                pytest.fail("the inner block must not run")
            assert qs.current_lock() is lock, "the failed entry unwound the outer block"
        assert lock._blocks == 0, "the entry count leaked"


def inside_checker(lock: qs.Lock, rounds: int, enter: Callable[[], Any]) -> list[str]:
    """Threads enter ``lock`` ``rounds`` times each and record overlaps; returns problems."""
    inside: list[int] = []
    problems: list[str] = []
    guard = threading.Lock()

    def body() -> None:
        with guard:
            inside.append(threading.get_ident())
            if len(inside) > 1:
                problems.append(f"{len(inside)} threads inside together")
        time.sleep(random.random() * 0.002)
        with guard:
            inside.remove(threading.get_ident())

    def worker() -> None:
        for _ in range(rounds):
            try:
                enter_and_run(body)
            except BaseException as exc:  # a thread must report, not die silently
                problems.append(repr(exc))

    def enter_and_run(fn: Callable[[], None]) -> None:
        outcome = enter()
        outcome(fn)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return problems


class TestThreads:
    def test_threads_sharing_a_handle_never_are_inside_its_blocks_together(
        self, sqlite_url: str
    ) -> None:
        with qs.Queen(sqlite_url) as q:
            lock = q.lock("shared", ttl=30, wait=10)

            def enter() -> Callable[[Callable[[], None]], None]:
                def run(fn: Callable[[], None]) -> None:
                    with lock:
                        assert lock.held, "inside the block without the lease"
                        if random.random() < 0.5:  # the owner re-enters at random
                            assert lock.run(fn).acquired, "the owner could not re-enter"
                        else:
                            fn()
                        assert lock.held, "a nested exit released the lease"
                return run

            problems = inside_checker(lock, 25, enter)
            assert not problems, problems[:5]
            assert not lock.held and not held_on_engine(q, "shared")

    def test_threads_sharing_a_handle_never_are_inside_run_together(
        self, sqlite_url: str
    ) -> None:
        with qs.Queen(sqlite_url) as q:
            lock = q.lock("shared", ttl=30, wait=10)

            def enter() -> Callable[[Callable[[], None]], None]:
                def run(fn: Callable[[], None]) -> None:
                    assert lock.run(fn).acquired, "run gave up within its wait"
                return run

            problems = inside_checker(lock, 25, enter)
            assert not problems, problems[:5]

    def test_without_a_wait_another_threads_block_is_refused_clearly(
        self, mq: qs.Queen
    ) -> None:
        lock = mq.lock("shared", ttl=30)
        outcome: list[Any] = []
        with lock:
            def other() -> None:
                try:
                    with lock:
                        outcome.append("entered")
                except qs.LockNotHeldError as exc:
                    outcome.append(exc)
                outcome.append(lock.run(lambda: "ran"))

            thread = threading.Thread(target=other)
            thread.start()
            thread.join(5)
            assert lock.held, "the other thread's refusal released the owner's lease"
        assert isinstance(outcome[0], qs.LockNotHeldError), outcome
        assert "another thread" in str(outcome[0]), str(outcome[0])
        assert not outcome[1].acquired, f"run must report acquired=False: {outcome[1]!r}"

    def test_a_waiting_thread_gets_in_when_the_owner_leaves(self, sqlite_url: str) -> None:
        with qs.Queen(sqlite_url) as q:
            lock = q.lock("shared", ttl=30, wait=5)
            order: list[str] = []
            started = threading.Event()

            def other() -> None:
                started.set()
                with lock:
                    order.append("other")

            thread = threading.Thread(target=other)
            with lock:
                thread.start()
                started.wait(5)
                time.sleep(0.2)
                assert lock.acquire(), "acquire outside blocks stays idempotent"
                order.append("owner")
            thread.join(5)
            assert order == ["owner", "other"], order


class TestBlocksOutlivingTheirThread:
    def test_a_block_suspended_in_a_generator_and_closed_in_another_thread_is_counted_out(
        self, mq: qs.Queen
    ) -> None:
        lock = mq.lock("gen", ttl=30)

        def rows() -> Any:
            with lock:
                yield from range(10)

        items = rows()
        assert next(items) == 0
        closer = threading.Thread(target=items.close)
        closer.start()
        closer.join(5)
        assert not lock.in_block, "the block closed in another thread is still counted"
        assert qs.current_lock() is None, "this thread still sees the ended block as current"
        assert not held_on_engine(mq, "gen"), "the outermost exit must release"
        entered: list[bool] = []
        other = threading.Thread(target=lambda: entered.append(lock.run(lambda: True).acquired))
        other.start()
        other.join(5)
        assert entered == [True], "another thread is refused by a block that has ended"
        with lock:
            pass
        assert not held_on_engine(mq, "gen"), "a later block counted as nested, never released"

    def test_a_generator_dropped_in_another_thread_ends_its_block(self, mq: qs.Queen) -> None:
        lock = mq.lock("gen", ttl=30)

        def rows() -> Any:
            with lock:
                yield from range(10)

        box = [rows()]
        assert next(box[0]) == 0

        def consume() -> None:
            items = box.pop()
            next(items)
            del items  # the last reference goes here, in this thread

        worker = threading.Thread(target=consume)
        worker.start()
        worker.join(5)
        assert not lock.in_block and not held_on_engine(mq, "gen"), (
            f"the dropped generator's block stayed open: {lock!r}")

    @pytest.mark.parametrize("closed_in", ["another thread", "the new owner"])
    def test_a_dead_threads_block_closed_later_leaves_the_new_owners_block_alone(
        self, mq: qs.Queen, closed_in: str
    ) -> None:
        lock = mq.lock("stale", ttl=30)

        def suspended_inside() -> Any:
            with lock:
                yield

        stale = suspended_inside()
        starter = threading.Thread(target=next, args=(stale,))
        starter.start()
        starter.join(5)  # the thread ends with the generator suspended in its block
        inside, leave = threading.Event(), threading.Event()
        seen: list[Any] = []

        def new_owner() -> None:
            with lock:
                seen.append(lock.token)
                inside.set()
                if closed_in == "the new owner":
                    stale.close()
                leave.wait(5)
                seen.append((lock.in_block, lock.held, lock.token))

        owner = threading.Thread(target=new_owner)
        owner.start()
        assert inside.wait(5), "setup: the new owner did not get in"
        if closed_in == "another thread":
            stale.close()  # the old block's exit runs here, long after its thread ended
        try:
            assert lock.in_block and lock.held, (
                f"closing the dead thread's block counted out the new owner's: {lock!r}")
            rival = mq.lock("stale", ttl=30)
            assert not rival.acquire(), "a rival took the lock under the new owner's block"
            # wait=0: the handle is the new owner's.
            with pytest.raises(qs.LockNotHeldError, match="another thread"), lock:
                pass
        finally:
            leave.set()
            owner.join(5)
        assert seen[1] == (True, True, seen[0]), f"the new owner's block changed: {seen}"
        assert not lock.in_block and not held_on_engine(mq, "stale"), (
            "the new owner's exit must release")

    @pytest.mark.parametrize("entered_by", ["an ExitStack", "a wrapper class", "helper calls"])
    def test_a_dead_threads_block_entered_through_a_wrapper_leaves_the_new_owners_alone(
        self, mq: qs.Queen, entered_by: str
    ) -> None:
        lock = mq.lock("wrapped", ttl=30)

        class Wrapper:
            def __enter__(self) -> qs.Lock:
                return lock.__enter__()

            def __exit__(self, *exc_info: Any) -> None:
                lock.__exit__(*exc_info)

        def hold() -> None:
            lock.__enter__()

        def drop() -> None:
            lock.__exit__(None, None, None)

        def suspended_inside() -> Any:
            if entered_by == "an ExitStack":
                with contextlib.ExitStack() as stack:
                    stack.enter_context(lock)
                    yield
            elif entered_by == "a wrapper class":
                with Wrapper():
                    yield
            else:
                hold()
                try:
                    yield
                finally:
                    drop()

        stale = suspended_inside()
        starter = threading.Thread(target=next, args=(stale,))
        starter.start()
        starter.join(5)
        assert lock.held, "setup: the dead thread's block took the lease"
        inside, leave = threading.Event(), threading.Event()

        def new_owner() -> None:
            with lock:
                inside.set()
                leave.wait(5)

        owner = threading.Thread(target=new_owner)
        owner.start()
        assert inside.wait(5), "setup: the new owner did not get in"
        stale.close()  # the old block's exit, through the wrapper, long after its thread ended
        try:
            assert lock.in_block and lock.held, (
                f"the stale block's exit through {entered_by} counted out the new owner's: "
                f"{lock!r}")
            assert not mq.lock("wrapped", ttl=30).acquire(), (
                "a rival took the lock under the new owner's block")
        finally:
            leave.set()
            owner.join(5)
        assert not lock.in_block and not held_on_engine(mq, "wrapped"), (
            "the new owner's exit must release")

    @staticmethod
    def _layered(lock: qs.Lock, layers: int, longer: str) -> Any:
        """``lock`` behind ``layers`` wrappers whose ``longer`` side ("enter" or "exit")
        goes through a helper: one more frame a layer on that side than on the other."""

        class Layer:
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def __enter__(self) -> Layer:
                if longer == "enter":
                    self.open()
                else:
                    self.inner.__enter__()
                return self

            def open(self) -> None:
                self.inner.__enter__()

            def __exit__(self, *exc_info: Any) -> None:
                if longer == "exit":
                    self.close(*exc_info)
                else:
                    self.inner.__exit__(*exc_info)

            def close(self, *exc_info: Any) -> None:
                self.inner.__exit__(*exc_info)

        wrapped: Any = lock
        for _ in range(layers):
            wrapped = Layer(wrapped)
        return wrapped

    @pytest.mark.parametrize("layers", [1, 3, 5, 12])
    def test_a_stale_block_behind_wrappers_longer_on_exit_leaves_the_new_owner_alone(
        self, mq: qs.Queen, layers: int
    ) -> None:
        lock = mq.lock("deep", ttl=30)
        wrapped = self._layered(lock, layers, longer="exit")

        def suspended_inside() -> Any:
            with wrapped:
                yield

        stale = suspended_inside()
        starter = threading.Thread(target=next, args=(stale,))
        starter.start()
        starter.join(5)
        inside, leave = threading.Event(), threading.Event()

        def new_owner() -> None:
            with lock:
                inside.set()
                leave.wait(5)

        owner = threading.Thread(target=new_owner)
        owner.start()
        assert inside.wait(5), "setup: the new owner did not get in"
        stale.close()
        try:
            assert lock.in_block and lock.held, f"the stale exit counted out: {lock!r}"
            assert not mq.lock("deep", ttl=30).acquire(), "a rival took it under the new owner"
        finally:
            leave.set()
            owner.join(5)
        assert not lock.in_block and not held_on_engine(mq, "deep")

    @pytest.mark.parametrize("layers", [1, 3, 5, 12])
    def test_a_live_block_behind_wrappers_longer_on_entry_in_a_stale_generator_ends(
        self, mq: qs.Queen, layers: int
    ) -> None:
        lock = mq.lock("deep", ttl=30)
        wrapped = self._layered(lock, layers, longer="enter")

        def suspended_inside() -> Any:
            with lock:  # left open by the thread that ends
                yield
                with wrapped:  # after the takeover: a live block of its own
                    pass
                yield

        stale = suspended_inside()
        starter = threading.Thread(target=next, args=(stale,))
        starter.start()
        starter.join(5)
        with lock:  # takes the handle over, then leaves
            pass
        next(stale)
        assert not lock.in_block and not held_on_engine(mq, "deep"), (
            f"the live block's exit was taken for the stale one's: {lock!r}")
        assert qs.current_lock() is None
        stale.close()
        assert not lock.in_block and not held_on_engine(mq, "deep")

    def test_blocks_closed_out_of_order_leave_the_right_one_stale(self, mq: qs.Queen) -> None:
        lock = mq.lock("order", ttl=30)

        def suspended_inside() -> Any:
            with lock:
                yield

        first, second = suspended_inside(), suspended_inside()

        def open_both_close_the_first() -> None:
            next(first)
            next(second)
            first.close()  # the first block out first; the thread ends inside the second

        starter = threading.Thread(target=open_both_close_the_first)
        starter.start()
        starter.join(5)
        inside, leave = threading.Event(), threading.Event()

        def new_owner() -> None:
            with lock:
                inside.set()
                leave.wait(5)

        owner = threading.Thread(target=new_owner)
        owner.start()
        assert inside.wait(5), "setup: the new owner did not get in"
        second.close()
        try:
            assert lock.in_block and lock.held, f"the stale block's exit counted out: {lock!r}"
            assert not mq.lock("order", ttl=30).acquire(), "a rival took it under the new owner"
        finally:
            leave.set()
            owner.join(5)
        assert not lock.in_block and not held_on_engine(mq, "order")

    def test_a_block_nested_later_in_a_stale_generator_gives_its_lease_back(
        self, mq: qs.Queen
    ) -> None:
        lock = mq.lock("inner", ttl=30)
        steps: list[Any] = []

        def suspended_inside() -> Any:
            with lock:
                yield
                with lock:  # after the takeover: the outermost live block, a lease of its own
                    steps.append(lock.held)
                yield

        stale = suspended_inside()
        starter = threading.Thread(target=next, args=(stale,))
        starter.start()
        starter.join(5)
        with lock:  # takes the handle over, then leaves
            pass
        next(stale)
        assert steps == [True], steps
        assert not lock.in_block and not held_on_engine(mq, "inner"), (
            f"the inner block's lease outlived it: {lock!r}")
        stale.close()
        assert not lock.in_block and not held_on_engine(mq, "inner")

    def test_a_block_left_open_by_a_dead_thread_is_abandoned_when_another_enters(
        self, mq: qs.Queen
    ) -> None:
        lock = mq.lock("dead", ttl=30)
        tokens: list[Any] = []

        def enter_and_die() -> None:
            lock.__enter__()
            tokens.append(lock.token)

        thread = threading.Thread(target=enter_and_die)
        thread.start()
        thread.join(5)
        assert lock.held, "setup: the dead thread's block took the lease"
        with lock:
            assert lock.held and lock.token != tokens[0], (
                "the new block must hold a lease of its own, fencing the dead thread's out")
        assert not lock.in_block and not held_on_engine(mq, "dead"), (
            "the new block's exit must release: the dead thread's block is over")

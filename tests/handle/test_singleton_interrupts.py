"""A job stopped by its lost lease, or by Ctrl-C, leaves every handle its body used usable.

``@singleton_job(on_lost="interrupt")`` puts its own SIGINT handler in place while the
body runs. Whatever reaches it (the job's own interrupt, sent when the lease is lost,
or a real Ctrl-C) must respect the handles' interrupt holds: raised in the middle of a
block's entry or exit it would leave that lock's gate taken, and the next exit of the
lock would wait on it forever.

The point tests deliver the signal at every place CPython checks for one (see
``test_interrupt_points.py``: ``QUEEN_SYNC_INTERRUPT_POINTS`` makes them stricter) in
the handles' code and the job's own; the process test loses real leases under a real
renewer, ``QUEEN_SYNC_JOB_LOSS_ROUNDS`` times (default 10).
"""

from __future__ import annotations

import dis
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Iterator, Optional

import pytest
from manual_clock import ManualClock
from polling import wait_for

import queen_sync as qs
from queen_sync._front import singleton as _singleton

PACKAGE = Path(qs.__file__).parent
SCOPES = (str(PACKAGE / "_handle"), str(PACKAGE / "_front" / "singleton.py"))
MODE = os.environ.get("QUEEN_SYNC_INTERRUPT_POINTS", "checks")  # checks|lines|opcodes
ROUNDS = int(os.environ.get("QUEEN_SYNC_JOB_LOSS_ROUNDS", "10"))
MAX_POINTS = 20_000  # a round longer than this never ends: fail rather than spin
HANG = 3.0  # seconds after which a round is taken to be deadlocked
LOOP_BACK = dis.opmap.get("JUMP_BACKWARD", dis.opmap.get("JUMP_ABSOLUTE"))
SEND_SIGNAL = signal.pthread_kill  # the watchdog's, kept from the tests that record sends

Tracer = Callable[[FrameType, str, Any], Any]


class RoundHung(BaseException):
    """Raised in the main thread by the watchdog of a round that stopped moving.

    A BaseException: the handle's clean-up swallows an Exception raised in its release.
    """


@pytest.fixture
def q(sqlite_url: str) -> Iterator[qs.Queen]:
    with qs.Queen(sqlite_url, renew_thread=False) as client:
        yield client


@pytest.fixture
def signals_sent(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The job's interrupts, recorded instead of sent: the test delivers them itself."""
    sent: list[int] = []
    monkeypatch.setattr(signal, "pthread_kill", lambda ident, signum: sent.append(signum))
    return sent


def the_jobs_handler() -> Optional[Any]:
    """The SIGINT handler of a running job, or None when none is installed."""
    handler = signal.getsignal(signal.SIGINT)
    owner = getattr(handler, "__self__", None)
    return handler if isinstance(owner, _singleton._Interrupter) else None


def is_point(frame: FrameType, event: str) -> bool:
    """Whether CPython would check for a signal here, in the mode the test runs."""
    if event == "call" or (MODE == "opcodes" and event == "opcode"):
        return True
    if MODE == "lines":
        return event == "line"
    return event == "opcode" and frame.f_code.co_code[frame.f_lasti] == LOOP_BACK


def in_scope(frame: FrameType) -> bool:
    return frame.f_code.co_filename.startswith(SCOPES)


class Delivery:
    """SIGINT delivered at the ``point``-th check point seen while the job's handler is in."""

    def __init__(self, point: int, lost: bool) -> None:
        self.point = point
        self.lost = lost  # the job's own interrupt (True) or a real Ctrl-C (False)
        self.seen = 0
        self.where: Optional[str] = None
        self.sent = False

    def local(self, frame: FrameType, event: str, arg: Any) -> Optional[Tracer]:
        if self.where is not None:
            return None
        handler = the_jobs_handler()
        if handler is None or not is_point(frame, event):
            return self.local
        self.seen += 1
        if self.seen == self.point:
            self.where = (f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} "
                          f"{frame.f_code.co_name} ({event} @{frame.f_lasti})")
            self._deliver(handler, frame)
        return self.local

    def _deliver(self, handler: Any, frame: FrameType) -> None:
        if self.lost:
            handler.__self__._lost("renew")  # what the loss reaction does (its send recorded)
            self.sent = handler.__self__._pending
            if not self.sent:
                return  # the job's body had ended: a loss now sends nothing
        self.sent = True
        handler(signal.SIGINT, frame)

    def calls(self, frame: FrameType, event: str, arg: Any) -> Optional[Tracer]:
        if self.where is not None or not in_scope(frame):
            return None
        frame.f_trace_opcodes = MODE != "lines"
        return self.local(frame, event, arg)


def run_traced(delivery: Delivery, job: Callable[[], None]) -> str:
    """Run ``job`` with ``delivery`` traced: how it ended ("returned" or the exception's name)."""
    sys.settrace(delivery.calls)
    try:
        job()
    except (qs.LockLostError, KeyboardInterrupt, RoundHung) as exc:
        return type(exc).__name__
    finally:
        sys.settrace(None)
    return "returned"


def on_hang(signum: int, frame: Optional[FrameType]) -> None:
    raise RoundHung


class Watchdog:
    """Interrupts a deadlocked main thread with SIGUSR1, which nothing of ours defers."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._done.wait(HANG):
            assert self._main is not None
            SEND_SIGNAL(self._main, signal.SIGUSR1)

    def __enter__(self) -> Watchdog:
        self._previous = signal.signal(signal.SIGUSR1, on_hang)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._done.set()
        self._thread.join()
        signal.signal(signal.SIGUSR1, self._previous)


def a_job_using(q: qs.Queen, name: str, inner: qs.Lock) -> Callable[[], None]:
    """A job whose body enters ``inner``'s blocks: nested, and through ``run``."""
    @qs.singleton_job(name, ttl=60, client=q)
    def job() -> None:
        with inner, inner:
            pass
        assert inner.run(lambda: None).acquired, "setup: inner.run() did not acquire"

    def run() -> None:
        job()

    return run


def leftovers(q: qs.Queen, inner: qs.Lock, job_name: str) -> list[str]:
    found = []
    if inner.in_block or inner.held:
        found.append(f"the body's lock is still {inner!r}")
    if q.locks.get(inner.name)["holders"]:
        found.append("the body's lock has a permit stranded on the engine")
    if q.locks.get(job_name)["holders"]:
        found.append("the job's own lease was not released")
    if qs.current_lock() is not None:
        found.append(f"current_lock() is still {qs.current_lock()!r}")
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        found.append(f"SIGINT handler left as {signal.getsignal(signal.SIGINT)!r}")
    return found


def expected_end(delivery: Delivery) -> str:
    if delivery.where is None or not delivery.sent:
        return "returned"
    return "LockLostError" if delivery.lost else "KeyboardInterrupt"


def points_of_a_job(q: qs.Queen, lost: bool) -> tuple[int, list[str]]:
    """Replay a job once per check point, SIGINT delivered there: the points and problems."""
    problems: list[str] = []
    for point in range(1, MAX_POINTS):
        inner, name = q.lock(f"inner-{point}", ttl=60), f"job-{point}"
        delivery = Delivery(point, lost)
        with Watchdog():
            ended = run_traced(delivery, a_job_using(q, name, inner))
        if delivery.where is None and ended == "returned":
            return point, problems
        found = leftovers(q, inner, name) if ended != "RoundHung" else ["the job hung"]
        signal.signal(signal.SIGINT, signal.default_int_handler)  # rounds stay independent
        if ended != expected_end(delivery):
            found.append(f"the job ended in {ended}, not {expected_end(delivery)}")
        if not found and not inner.run(lambda: None).acquired:
            found.append("the body's lock could not be taken again")
        problems += [f"point {point} at {delivery.where}: {p}" for p in found]
        if ended == "RoundHung":
            break  # a handle is wedged: later rounds would only repeat it
    else:
        pytest.fail(f"a job never ended within {MAX_POINTS} points")
    return point, problems


class TestASignalAnywhereInAJob:
    def test_its_lost_lease_interrupting_it_anywhere_leaves_the_locks_its_body_used_free(
            self, q: qs.Queen, signals_sent: list[int]) -> None:
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, \
            "setup: the test needs Python's default SIGINT handler"
        points, problems = points_of_a_job(q, lost=True)
        assert points > 20 and signals_sent, f"setup: only {points} points traced"
        assert not problems, f"{len(problems)} problems, first ones:\n" + "\n".join(problems[:8])

    def test_a_ctrl_c_anywhere_in_it_stops_it_and_leaves_every_lock_free(
            self, q: qs.Queen, signals_sent: list[int]) -> None:
        points, problems = points_of_a_job(q, lost=False)
        assert points > 20, f"setup: only {points} points traced"
        assert not problems, f"{len(problems)} problems, first ones:\n" + "\n".join(problems[:8])


class TestALossAsTheBodyReturns:
    """The loss is driven by hand: a manual clock moved past a renew, the renewer ticked."""

    def lose(self, mq: qs.Queen, other: qs.Queen, clock: ManualClock) -> None:
        lock = qs.current_lock()
        assert lock is not None and lock.token is not None, "setup: the job holds no lease"
        assert other.locks.release(lock.name, token=lock.token), "setup: the release failed"
        clock.advance(lock.renew_every + 0.1)
        mq.renewer.tick()
        assert lock.lost.is_set(), "setup: the renewer did not see the loss"

    def test_a_loss_seen_before_the_body_returned_raises_lock_lost_error_not_its_value(
            self, mq: qs.Queen, other: qs.Queen, clock: ManualClock,
            signals_sent: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(_singleton, "LANDING_SECONDS", 0.05)  # recorded: it never lands

        @qs.singleton_job("job", ttl="30s", client=mq)
        def job() -> str:
            self.lose(mq, other, clock)
            wait_for(lambda: signals_sent, what="the loss reaction to send its interrupt")
            return "finished"

        with pytest.raises(qs.LockLostError) as caught:
            job()
        assert caught.value.reason == "renew" and caught.value.name == "job", caught.value
        assert "before it finished" in str(caught.value), str(caught.value)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, \
            f"SIGINT handler left as {signal.getsignal(signal.SIGINT)!r}"
        assert other.locks.get("job")["holders"] == [], "the job's lease must be released"

    def test_its_interrupt_landing_after_the_return_raises_nothing_after_the_job(
            self, mq: qs.Queen, other: qs.Queen, clock: ManualClock,
            monkeypatch: pytest.MonkeyPatch) -> None:
        send, timers = signal.pthread_kill, []

        def send_late(ident: int, signum: int) -> None:  # as a slow delivery of the signal
            timers.append(threading.Timer(0.02, send, (ident, signum)))
            timers[-1].start()

        monkeypatch.setattr(signal, "pthread_kill", send_late)
        monkeypatch.setattr(_singleton, "LANDING_SECONDS", 10.0)  # a loaded machine: be patient

        @qs.singleton_job("job", ttl="30s", client=mq)
        def job() -> str:
            self.lose(mq, other, clock)
            wait_for(lambda: timers, what="the loss reaction to send its interrupt")
            return "finished"

        ended: list[str] = []
        try:
            try:
                ended.append(f"returned {job()!r}")
            except qs.LockLostError:
                ended.append("LockLostError")
            for timer in timers:
                timer.join()
            time.sleep(0.05)  # a signal sent before the join lands by the end of this
        except KeyboardInterrupt:
            ended.append("KeyboardInterrupt after the job")
        assert ended == ["LockLostError"], f"the job ended in {ended}"


CHILD = r'''
import sys, threading, time
import queen_sync as qs

url, rounds = sys.argv[1], int(sys.argv[2])


def take_away_soon(other, name):
    """Release the job's lease as an operator would, once it is on the engine."""
    def take_away():
        for _ in range(1000):
            holders = other.locks.get(name)["holders"]
            if holders:
                other.locks.release(name, token=holders[0]["token"])
                return
            time.sleep(0.002)
    threading.Thread(target=take_away, daemon=True).start()


with qs.Queen(url) as q, qs.Queen(url) as other:
    for n in range(rounds):
        inner = q.lock(f"inner-{n}", ttl=30)

        @qs.singleton_job(f"job-{n}", ttl=1, client=q)
        def job():
            take_away_soon(other, f"job-{n}")
            with inner:  # taken once: the nested blocks only count in and out
                while True:
                    with inner:
                        pass

        try:
            job()
            ended = "returned"
        except qs.LockLostError:
            ended = "LockLostError"
        holders = other.locks.get(inner.name)["holders"]
        print(f"round {n}: {ended} inner holders={len(holders)} held={inner.held}", flush=True)
'''


class TestLostLeasesUnderARealRenewer:
    @pytest.mark.realtime
    def test_a_lost_job_leaves_the_locks_its_body_used_free_and_never_hangs(
            self, sqlite_url: str) -> None:
        child = subprocess.Popen([sys.executable, "-c", CHILD, sqlite_url, str(ROUNDS)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = child.communicate(timeout=10 + 3 * ROUNDS)
        except subprocess.TimeoutExpired:
            child.kill()
            out, err = child.communicate()
        rounds = out.splitlines()
        assert child.returncode != -signal.SIGKILL, (
            f"the job hung after {len(rounds)} of {ROUNDS} lost leases (a lock's exit "
            f"waiting on its own gate): {rounds[-2:]}")
        wrong = [line for line in out.splitlines()
                 if "LockLostError inner holders=0 held=False" not in line]
        assert child.returncode == 0 and not wrong and len(rounds) == ROUNDS, (
            f"exit {child.returncode}; rounds that did not end in LockLostError with the "
            f"body's lock free: {wrong}; stderr: {err[-800:]}")



class TestAJobLosingItsLeaseWithSigintBlocked:
    """A section that must not be cut short by a signal, or a program reading signals with
    sigwait: the loss still interrupts the job, and nothing of it reaches the program after."""

    def test_raises_lock_lost_error_and_no_keyboard_interrupt_after_the_job(
            self, mq: qs.Queen, other: qs.Queen, clock: ManualClock,
            monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(_singleton, "LANDING_SECONDS", 0.05)

        @qs.singleton_job("job", ttl="30s", client=mq)
        def job() -> str:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            lock = qs.current_lock()
            assert lock is not None and lock.token is not None, "setup: no lease held"
            assert other.locks.release(lock.name, token=lock.token), "setup: release failed"
            clock.advance(lock.renew_every + 0.1)
            mq.renewer.tick()
            assert lock.lost.is_set(), "setup: the renewer did not see the loss"
            for _ in range(200):  # the interrupt lands here, at a bytecode
                time.sleep(0.001)
            return "finished"

        ended: list[str] = []
        pending = False
        try:
            try:
                ended.append(f"returned {job()!r}")
            except qs.LockLostError:
                ended.append("LockLostError")
            pending = signal.SIGINT in signal.sigpending()
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            time.sleep(0.05)  # a pending SIGINT lands by the end of this
        except KeyboardInterrupt:
            ended.append("KeyboardInterrupt after the job")
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        assert ended == ["LockLostError"], (
            f"the job ended as {ended} (SIGINT pending at its end: {pending}): the loss's "
            "interrupt, sent while SIGINT was blocked, reached the program after the job")


class TestWhatTheBodyOfAJobLosingItsLeaseSees:
    """Inside the body the interrupt is a ``KeyboardInterrupt``, so a broad ``except
    Exception`` in the job cannot swallow it and go on without the lease; the call raises
    ``LockLostError`` in its place. Documented in the how-to and ``singleton_job``."""

    def test_a_keyboard_interrupt_no_except_exception_catches_and_the_caller_a_lock_lost_error(
            self, mq: qs.Queen, other: qs.Queen, clock: ManualClock) -> None:
        seen: list[str] = []

        @qs.singleton_job("job", ttl="30s", client=mq)
        def job() -> str:
            lock = qs.current_lock()
            assert lock is not None and lock.token is not None, "setup: no lease held"
            assert other.locks.release(lock.name, token=lock.token), "setup: release failed"
            clock.advance(lock.renew_every + 0.1)
            try:
                try:
                    mq.renewer.tick()
                    for _ in range(2000):  # the interrupt lands here
                        time.sleep(0.001)
                except Exception as exc:  # a job's broad handler
                    seen.append(f"swallowed {type(exc).__name__}")
            except BaseException as exc:
                seen.append(type(exc).__name__)
                raise
            return "finished"

        with pytest.raises(qs.LockLostError) as raised:
            job()
        assert seen == ["KeyboardInterrupt"], seen
        assert isinstance(raised.value.__cause__, KeyboardInterrupt), repr(raised.value.__cause__)

"""``close()`` keeps its promises when it is pressed: raced, interrupted, re-entered, stalled.

Its promises: once it returns, nothing this client was granted is held by anyone who
believes they hold it, and it returns within its budget (plus what one engine call in
flight takes to notice), whoever else calls it and whatever the engine is doing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
from test_process_life import acquiring_in_thread, gated_client

import queen_sync as qs
from queen_sync.testing import FaultyEngine

ROOT = Path(__file__).resolve().parents[2]


def held(url: str, name: str) -> bool:
    with qs.Queen(url) as observer:
        return bool(observer.locks.get(name)["held"])


@pytest.fixture
def write_lock_holder(sqlite_url: str) -> Iterator[Any]:
    """Starts another process that holds the SQLite file's write lock for some seconds."""
    started: list[subprocess.Popen[str]] = []

    def hold(seconds: float) -> None:
        path = sqlite_url[len("sqlite://"):]
        process = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
            import sqlite3, time
            db = sqlite3.connect({path!r}, isolation_level=None)
            db.execute("BEGIN IMMEDIATE")
            print("holding", flush=True)
            time.sleep({seconds})
            db.execute("COMMIT")
        """)], stdout=subprocess.PIPE, text=True)
        started.append(process)
        assert process.stdout is not None and process.stdout.readline().strip() == "holding"

    yield hold
    for process in started:
        process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()


class TestAnAcquireThatLandsAfterCloseGaveUpOnIt:
    def test_does_not_report_a_lease_nobody_renews(self, sqlite_url: str) -> None:
        q, granted, release = gated_client(sqlite_url)
        lock = q.lock("late", ttl=60)
        taking, outcome = acquiring_in_thread(lock)
        assert granted.wait(5), "setup: the acquire did not reach the engine"
        q.close(timeout=0.2)  # gives up waiting for the acquire in flight
        release.set()
        taking.join(5)
        assert outcome and outcome[0] is not True, (
            "acquire() returned True on a closed client: its lease is never renewed, and "
            "expires under a holder that believes it holds")
        assert isinstance(outcome[0], qs.QueenError) and "closed" in str(outcome[0])
        assert not lock.held


class TestTwoCloses:
    def test_the_second_returns_only_once_the_first_has_given_everything_back(
            self, sqlite_url: str) -> None:
        q, granted, release = gated_client(sqlite_url)
        kept = q.lock("kept", ttl=60)
        kept.acquire()
        late = q.lock("late", ttl=60)
        taking = threading.Thread(target=lambda: _quietly(late.acquire))
        taking.start()
        assert granted.wait(5), "setup: the acquire did not reach the engine"
        first = threading.Thread(target=q.close)
        first.start()
        time.sleep(0.1)  # the first close() is waiting for the acquire in flight
        threading.Timer(0.3, release.set).start()
        q.close()
        assert not held(sqlite_url, "kept"), "the second close() returned before the give-back"
        first.join(5)
        taking.join(5)

    def test_a_closing_that_failed_is_run_again_by_the_next_close(
            self, sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
        q = qs.Queen(sqlite_url)
        q.lock("kept", ttl=60).acquire()
        real_stop = q.renewer.stop

        def interrupted_stop(*args: Any, **kwargs: Any) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(q.renewer, "stop", interrupted_stop)
        with pytest.raises(KeyboardInterrupt):
            q.close()
        monkeypatch.setattr(q.renewer, "stop", real_stop)
        q.close()
        assert not held(sqlite_url, "kept"), (
            "the close() after an interrupted one gave nothing back")


class TestAReleaseThatLandsAfterCloseGaveUpOnIt:
    def test_gives_its_permit_back_and_leaves_no_descriptor_of_the_file_open(
            self, sqlite_url: str) -> None:
        """A release still in flight when close() returned opens the closed store again
        to give its permit back; the file is closed again after it, so the process keeps
        no descriptor (nor SQLite's locks on it) for a client it closed."""
        engine = FaultyEngine(sqlite_url)
        q = qs.Queen(engine=engine)
        lock = q.lock("late-release", ttl=60)
        assert lock.acquire()
        granted, go_on = threading.Event(), threading.Event()

        def hold(route: str, body: Any) -> None:
            granted.set()
            go_on.wait(5)

        engine.hook_next(None, hook=hold, op="release")
        releasing = threading.Thread(target=lambda: _quietly(lock.release), daemon=True)
        releasing.start()
        assert granted.wait(5), "setup: the release did not reach the engine"
        q.close(timeout=0.2)  # gives up waiting for the release in flight
        go_on.set()
        releasing.join(10)
        path = os.path.realpath(sqlite_url[len("sqlite://"):])
        open_ = _descriptors_of(path)
        assert open_ == [], f"the closed client still has the file open: {open_}"
        assert not held(sqlite_url, "late-release"), "the late release gave nothing back"


def _descriptors_of(path: str) -> list[str]:
    """This process's open descriptors on the database file or its side files."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target in (path, path + "-wal", path + "-shm"):
                found.append(f"{fd} -> {target}")
    return found


class TestCloseWhileAnotherProcessWrites:
    def test_returns_within_its_budget_and_the_acquire_in_flight_does_not_report_holding(
            self, sqlite_url: str, write_lock_holder: Any) -> None:
        q = qs.Queen(sqlite_url)
        write_lock_holder(6.0)
        taking, outcome = acquiring_in_thread(q.lock("in-flight", ttl=60))
        time.sleep(0.3)  # the acquire now waits for the write lock, inside SQLite
        began = time.monotonic()
        q.close(timeout=1.0)
        took = time.monotonic() - began
        taking.join(10)
        assert took < 3.5, f"close(timeout=1) took {took:.1f}s while another process wrote"
        assert outcome and outcome[0] is not True, "an acquire landing after close() held"

    def test_acquires_queued_behind_the_waiting_one_take_nothing_once_it_is_closed(
            self, sqlite_url: str, write_lock_holder: Any) -> None:
        """Calls of other threads queued on the store's mutex when close() returns run
        after it: each must find the store closed, not open it again and take a permit
        that its client, closed, then refuses to give back."""
        q = qs.Queen(sqlite_url)
        write_lock_holder(2.0)
        names = [f"queued-{i}" for i in range(4)]
        takers = [acquiring_in_thread(q.lock(name, ttl=60)) for name in names]
        time.sleep(0.3)  # one waits for the write lock inside SQLite, the others on the mutex
        q.close(timeout=0.5)
        for taking, outcome in takers:
            taking.join(10)
            assert outcome and outcome[0] is not True, "an acquire landing after close() held"
        time.sleep(0.2)
        left = [name for name in names if held(sqlite_url, name)]
        assert left == [], f"permits nobody holds, kept until their TTL: {left}"


class TestCloseFromASignalHandler:
    def test_returns_when_the_signal_lands_inside_an_engine_call_of_the_same_thread(
            self, tmp_path: Path) -> None:
        script = textwrap.dedent(f"""
            import signal, sys, threading, time
            import queen_sync as qs
            from queen_sync._engines import sqlite as sqlite_engine
            url = "sqlite://" + {str(tmp_path / "q.db")!r}
            q = qs.Queen(url)
            lock = q.lock("job", ttl=60)
            closed = []
            def on_term(signum, frame):
                q.close(timeout=1)
                closed.append(True)
            signal.signal(signal.SIGTERM, on_term)
            # The signal lands while the storage mutex is held: inside the step's commit.
            real_commit = sqlite_engine.SqliteStorage._commit
            def commit_then_signal(self, txn):
                real_commit(self, txn)
                if not closed:
                    signal.raise_signal(signal.SIGTERM)
            sqlite_engine.SqliteStorage._commit = commit_then_signal
            try:
                lock.acquire()
            except qs.QueenError:
                pass
            print("closed" if closed else "not closed", flush=True)
        """)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        try:
            done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                  timeout=30, env=env)
        except subprocess.TimeoutExpired:
            pytest.fail("close() from a signal handler deadlocked on the engine call it "
                        "interrupted")
        assert done.returncode == 0, done.stderr[-1500:]
        assert done.stdout.strip() == "closed", done.stdout + done.stderr[-800:]


class TestCloseFromASignalHandlerOnTheThreadItInterrupted:
    def test_returns_within_its_budget_and_the_closing_ends_once_that_thread_goes_on(
            self, sqlite_url: str) -> None:
        q = qs.Queen(sqlite_url)
        q.lock("job", ttl=60).acquire()
        returned: list[float] = []

        def on_signal(signum: int, frame: Any) -> None:
            began = time.monotonic()
            q.close(timeout=0.5)
            returned.append(time.monotonic() - began)

        previous = signal.signal(signal.SIGUSR1, on_signal)
        try:
            with q.renewer._mutex:  # held, as register() and unregister() hold it
                signal.raise_signal(signal.SIGUSR1)  # its handler runs here, on this thread
        finally:
            signal.signal(signal.SIGUSR1, previous)
        assert returned and returned[0] < 5, f"close() from the handler took {returned}"
        give_back_by = time.monotonic() + 10
        while held(sqlite_url, "job") and time.monotonic() < give_back_by:
            time.sleep(0.05)
        assert not held(sqlite_url, "job"), "the closing never gave the lease back"


class TestCtrlCWhileTheRenewerThreadStarts:
    def test_the_next_lease_still_gets_a_renewer(self, sqlite_url: str) -> None:
        q = qs.Queen(sqlite_url)
        _interrupt_the_first_renewer_start(
            q, lambda frame: frame.f_code is threading.Thread.start.__code__)
        second = q.lock("second", ttl=60)
        assert second.acquire()
        thread = q.renewer.thread
        assert thread is not None and thread.is_alive(), (
            "no renewer thread runs for a lease taken after a Ctrl-C cut one's start short")
        q.close()
        assert not held(sqlite_url, "second")


    def test_a_thread_the_interrupted_start_left_running_leaves_one_renewer(
            self, sqlite_url: str) -> None:
        """A Ctrl-C while start() waits for the new thread to report in leaves that thread
        running, unknown to the renewer: it must end, not tick beside the next one."""
        before = set(threading.enumerate())
        q = qs.Queen(sqlite_url)
        _interrupt_the_first_renewer_start(
            q, lambda frame: frame.f_code is threading.Event.wait.__code__
            and frame.f_back is not None
            and frame.f_back.f_code is threading.Thread.start.__code__)
        assert q.lock("second", ttl=60).acquire()

        def renewers() -> list[threading.Thread]:
            return [thread for thread in threading.enumerate() if thread not in before
                    and thread.name == "queen_sync-renewer" and thread.is_alive()]

        settle_by = time.monotonic() + 3
        while len(renewers()) > 1 and time.monotonic() < settle_by:
            time.sleep(0.05)
        running = renewers()
        q.close()
        assert len(running) == 1, f"{len(running)} renewer threads tick for one client"
        assert not held(sqlite_url, "second")

def _interrupt_the_first_renewer_start(q: qs.Queen, at: Callable[[Any], bool]) -> None:
    """A Ctrl-C at the first call ``at`` picks while a lease's acquire starts the renewer."""
    armed = [True]

    def tracer(frame: Any, event: str, arg: Any) -> Optional[Any]:
        if event == "call" and armed[0] and at(frame):
            armed[0] = False
            signal.default_int_handler(signal.SIGINT, frame)
        return None

    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            q.lock("first", ttl=60).acquire()
    finally:
        sys.settrace(None)
    assert not armed[0], "setup: the renewer thread's start was never reached"


def _quietly(call: Any) -> None:
    with contextlib.suppress(qs.QueenError):
        call()


"""``@singleton_job`` in one process: calling, busy, loss, once per period, default client."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

import queen_sync as qs
from queen_sync import _default
from queen_sync._front import singleton as _singleton


def _holders(q: qs.Queen, name: str) -> list[Any]:
    return list(q.locks.get(name).get("holders") or [])


class TestCalling:
    def test_the_wrapper_keeps_the_name_the_doc_the_arguments_and_the_value(
            self, client: qs.Queen) -> None:
        @qs.singleton_job("add", ttl="30s", client=client)
        def add(a: int, b: int = 1) -> int:
            """Add two numbers."""
            return a + b

        assert add(2, b=3) == 5, "the function's value must come back"
        assert add.__name__ == "add" and add.__doc__ == "Add two numbers."

    def test_inside_the_body_current_lock_is_the_held_lock(self, client: qs.Queen) -> None:
        seen: list[Optional[qs.Lock]] = []

        @qs.singleton_job("report", ttl="30s", client=client)
        def report() -> None:
            seen.append(qs.current_lock())

        report()
        lock = seen[0]
        assert lock is not None and lock.name == "report", seen
        assert qs.current_lock() is None, "outside the body there is no current lock"
        assert not lock.held and _holders(client, "report") == [], "released on return"

    def test_bind_passes_the_lock_first(self, client: qs.Queen) -> None:
        @qs.singleton_job("bound", ttl="30s", client=client, bind=True)
        def bound(lock: qs.Lock, x: int) -> tuple[bool, Optional[int], int]:
            return lock.held, lock.token, x

        held, token, x = bound(7) or (False, None, 0)
        assert held and token is not None and x == 7, (held, token, x)

    def test_it_works_on_methods(self, client: qs.Queen) -> None:
        class Reports:
            def __init__(self) -> None:
                self.runs = 0

            @qs.singleton_job("method", ttl="30s", client=client)
            def build(self, n: int) -> str:
                self.runs += n
                lock = qs.current_lock()
                return lock.name if lock else ""

        reports = Reports()
        assert reports.build(2) == "method" and reports.runs == 2, reports.runs

    def test_bare_use_names_the_lock_after_the_function(self, sqlite_url: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("QUEEN_URL", sqlite_url)

        @qs.singleton_job
        def nightly() -> str:
            lock = qs.current_lock()
            return lock.name if lock else ""

        name = nightly()
        assert name == f"{__name__}.{nightly.__qualname__}", name

    def test_the_lease_is_released_when_the_body_raises(self, client: qs.Queen) -> None:
        @qs.singleton_job("fails", ttl="30s", client=client)
        def fails() -> None:
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError, match="boom"):
            fails()
        assert _holders(client, "fails") == [], "the lease must be released on exception"


class TestBusy:
    def test_skip_returns_none_and_logs_owner_since_and_expiry(
            self, client: qs.Queen, other: qs.Queen, caplog: pytest.LogCaptureFixture) -> None:
        holder = other.lock("busy", ttl="30s")
        assert holder.acquire()

        @qs.singleton_job("busy", ttl="30s", client=client)
        def job() -> str:
            return "ran"

        with caplog.at_level(logging.INFO, logger="queen_sync"):
            assert job() is None, "a skipped call returns None"
        text = caplog.text
        assert holder.owner in text and "since" in text and "expires in" in text, text

    def test_raise_carries_the_holders(self, client: qs.Queen, other: qs.Queen) -> None:
        holder = other.lock("busy", ttl="30s")
        assert holder.acquire()

        @qs.singleton_job("busy", ttl="30s", on_busy="raise", client=client)
        def job() -> str:
            return "ran"

        with pytest.raises(qs.LockBusyError) as caught:
            job()
        assert [h.owner for h in caught.value.holders] == [holder.owner], caught.value.holders
        assert caught.value.name == "busy"

    def test_wait_runs_once_the_holder_lets_go(self, client: qs.Queen, other: qs.Queen) -> None:
        holder = other.lock("busy", ttl="30s")
        assert holder.acquire()
        threading.Timer(0.2, holder.release).start()

        @qs.singleton_job("busy", ttl="30s", on_busy="wait", wait="10s", client=client)
        def job() -> str:
            return "ran"

        started = time.monotonic()
        assert job() == "ran", "the waiting call must run once the lock is free"
        assert time.monotonic() - started < 5, "it must not wait the whole budget"

    def test_wait_that_runs_out_raises(self, client: qs.Queen, other: qs.Queen) -> None:
        assert other.lock("busy", ttl="30s").acquire()

        @qs.singleton_job("busy", ttl="30s", on_busy="wait", wait=0.2, client=client)
        def job() -> str:
            return "ran"

        with pytest.raises(qs.LockBusyError):
            job()


class TestBadArguments:
    @pytest.mark.parametrize(("kwargs", "error"), [
        ({"on_busy": "later"}, ValueError),
        ({"on_lost": "panic"}, ValueError),
        ({"on_busy": "wait"}, ValueError),
        ({"ttl": "soon"}, ValueError),
        ({"ttl": -1}, ValueError),
        ({"once_per": "daily"}, ValueError),
        ({"queen": "sqlite:///x.db"}, TypeError),
        ({"client": "sqlite:///x.db"}, TypeError),
        ({"bind": 1}, TypeError),
        ({"supervision": ""}, ValueError),
    ])
    def test_a_bad_argument_fails_at_decoration_before_any_io(
            self, kwargs: dict[str, Any], error: type[Exception], tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("QUEEN_URL", "sqlite://" + str(tmp_path / "untouched.db"))
        with pytest.raises(error):
            qs.singleton_job("job", **kwargs)
        assert not (tmp_path / "untouched.db").exists(), "nothing may be opened"

    def test_a_name_the_wire_refuses_fails_at_decoration(self) -> None:
        with pytest.raises(ValueError, match="#"):
            qs.singleton_job("a#b")


def _held_name() -> Optional[str]:
    lock = qs.current_lock()
    return None if lock is None else lock.name


class TestCallablesThatAreNotFunctions:
    """A partial or a callable object has no name of its own to give its lease."""

    @staticmethod
    def _callables() -> list[Any]:
        import functools

        class Report:
            def __call__(self, region: str) -> str:
                return f"report {region} under {_held_name()}"

        def report(kind: str, region: str) -> str:
            return f"{kind} {region} under {_held_name()}"

        return [functools.partial(report, "report"), Report()]

    @pytest.mark.parametrize("which", [0, 1], ids=["partial", "callable object"])
    def test_bare_use_asks_for_a_name(self, which: int) -> None:
        with pytest.raises(TypeError, match=r"singleton_job\(\"a-name\"\)"):
            qs.singleton_job(self._callables()[which])

    @pytest.mark.parametrize("which", [0, 1], ids=["partial", "callable object"])
    def test_with_a_name_it_runs_under_that_lease(self, client: qs.Queen, which: int) -> None:
        job = qs.singleton_job("reports", client=client)(self._callables()[which])
        assert job("eu") == "report eu under reports"
        assert _holders(client, "reports") == [], "the lease is released once the call returns"


class TestTheClientArgument:
    def test_client_names_the_client_the_job_runs_on(self, client: qs.Queen) -> None:
        @qs.singleton_job("on-client", ttl="30s", client=client)
        def job() -> Optional[qs.Lock]:
            return qs.current_lock()

        lock = job()
        assert lock is not None and lock.engine_url == client.url, "the job used client="

    def test_the_old_queen_keyword_still_works_and_says_it_is_deprecated(
            self, client: qs.Queen) -> None:
        with pytest.warns(DeprecationWarning, match="client=") as caught:
            @qs.singleton_job("on-queen", ttl="30s", queen=client)
            def job() -> int:
                return len(_holders(client, "on-queen"))

        assert caught[0].filename == __file__, "the warning points at the decorated line"
        assert job() == 1, "queen= is still the client the job runs on"

    def test_client_and_queen_together_are_refused(self, client: qs.Queen) -> None:
        with pytest.raises(TypeError, match="client="):
            qs.singleton_job("both", ttl="30s", client=client, queen=client)


class TestLoss:
    """Loss is driven by hand: a manual clock and the renewer ticked by the test."""

    def _lose(self, mq: qs.Queen, other: qs.Queen, clock: Any) -> qs.Lock:
        lock = qs.current_lock()
        assert lock is not None and lock.token is not None
        assert other.locks.release(lock.name, token=lock.token)
        clock.advance(lock.renew_every + 0.1)
        mq.renewer.tick()
        return lock

    def test_ignore_only_sets_lost_and_the_body_goes_on(self, mq: qs.Queen, other: qs.Queen,
                                                        clock: Any) -> None:
        @qs.singleton_job("job", ttl="30s", on_lost="ignore", client=mq)
        def job() -> tuple[bool, str]:
            lock = self._lose(mq, other, clock)
            return lock.lost.is_set(), "finished"

        assert job() == (True, "finished"), "the body must run to its end"

    def test_a_callable_is_called_with_the_lock(self, mq: qs.Queen, other: qs.Queen,
                                                clock: Any) -> None:
        called: list[qs.Lock] = []
        done = threading.Event()

        def on_lost(lock: qs.Lock) -> None:
            called.append(lock)
            done.set()

        @qs.singleton_job("job", ttl="30s", on_lost=on_lost, client=mq)
        def job() -> qs.Lock:
            lock = self._lose(mq, other, clock)
            assert done.wait(5), "the handler must be called"
            return lock

        lock = job()
        assert called == [lock] and lock is not None and lock.lost_reason == "renew", called

    def test_interrupt_outside_the_main_thread_logs_and_sets_lost(
            self, mq: qs.Queen, other: qs.Queen, clock: Any,
            caplog: pytest.LogCaptureFixture) -> None:
        @qs.singleton_job("job", ttl="30s", client=mq)
        def job() -> bool:
            lock = self._lose(mq, other, clock)
            deadline = time.monotonic() + 5
            while "cannot be interrupted" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.01)
            return lock.lost.is_set()

        results: list[Optional[bool]] = []
        with caplog.at_level(logging.WARNING, logger="queen_sync"):
            worker = threading.Thread(target=lambda: results.append(job()))
            worker.start()
            worker.join(10)
        assert results == [True], f"the body must finish with lost set: {results}"
        assert "cannot be interrupted" in caplog.text, caplog.text


class TestOncePerPeriod:
    def test_a_second_call_in_the_same_period_skips_saying_when_and_by_whom(
            self, client: qs.Queen, other: qs.Queen, caplog: pytest.LogCaptureFixture,
            monkeypatch: pytest.MonkeyPatch) -> None:
        now = [1_700_000_000.0]
        monkeypatch.setattr(_singleton, "_wall", lambda: now[0])
        runs: list[str] = []

        def make(q: qs.Queen) -> Any:
            @qs.singleton_job("daily", ttl="30s", once_per="1d", client=q)
            def daily() -> str:
                lock = qs.current_lock()
                runs.append(lock.owner if lock else "")
                return "ran"
            return daily

        here, there = make(client), make(other)
        assert here() == "ran", "the first call of the period runs"
        now[0] += 3600
        with caplog.at_level(logging.INFO, logger="queen_sync"):
            assert there() is None, "another host in the same period skips"
        assert len(runs) == 1 and runs[0] in caplog.text, caplog.text
        assert "already ran" in caplog.text and "2023-11-14" in caplog.text, caplog.text
        now[0] += 86400
        assert there() == "ran", "the next period runs again"
        assert len(runs) == 2

    def test_a_failed_run_is_not_recorded(self, client: qs.Queen,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(_singleton, "_wall", lambda: 1_700_000_000.0)
        attempts: list[int] = []

        @qs.singleton_job("flaky", ttl="30s", once_per="1h", client=client)
        def flaky() -> str:
            attempts.append(1)
            if len(attempts) == 1:
                raise RuntimeError("first attempt fails")
            return "ok"

        with pytest.raises(RuntimeError):
            flaky()
        assert flaky() == "ok" and flaky() is None, "retried after a failure, then done"
        assert len(attempts) == 2

    def test_the_completion_is_written_only_while_the_lease_is_held(
            self, client: qs.Queen, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(_singleton, "_wall", lambda: 1_700_000_000.0)

        @qs.singleton_job("fenced", ttl="30s", once_per="1h", client=client, on_lost="ignore")
        def fenced() -> str:
            lock = qs.current_lock()
            assert lock is not None and lock.token is not None
            assert client.locks.release("fenced", token=lock.token)
            lock.mark_lost("renew")  # what the renewer concludes at its next renew
            return "ran"

        assert fenced() == "ran"
        assert fenced() == "ran", "an unrecorded completion must not make the period done"


class TestDefaultClient:
    @pytest.fixture(autouse=True)
    def _fresh(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        monkeypatch.setattr(_default, "_client", None)
        yield
        client = _default._client
        if client is not None:
            client.close()

    def test_queen_none_uses_the_default_client_from_queen_url(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        url = "sqlite://" + str(tmp_path / "default.db")
        monkeypatch.setenv("QUEEN_URL", url)

        @qs.singleton_job("uses-default", ttl="30s")
        def job() -> str:
            return qs.default_client().url

        assert job() == url and (tmp_path / "default.db").exists(), "the default is QUEEN_URL"
        assert qs.default_client() is qs.default_client(), "one client per process"

    def test_the_default_client_follows_queen_url_and_survives_close(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("QUEEN_URL", "sqlite://" + str(tmp_path / "a.db"))
        first = qs.default_client()
        first.close()
        reopened = qs.default_client()
        assert reopened is not first and not reopened._closed, "a closed default is rebuilt"
        monkeypatch.setenv("QUEEN_URL", "sqlite://" + str(tmp_path / "b.db"))
        moved = qs.default_client()
        assert moved.url.endswith("b.db") and reopened._closed, "an idle old default is closed"


class TestBindOnAMethod:
    """``bind=True`` passes the lock first: on a method it would arrive as ``self``."""

    def test_a_method_is_refused_at_decoration_pointing_at_current_lock(
            self, client: qs.Queen) -> None:
        with pytest.raises(TypeError, match=r"current_lock\(\)"):
            class Job:
                # The type checker refuses it too; the test is what happens at run time.
                @qs.singleton_job("m", bind=True, client=client)  # type: ignore[arg-type]
                def run(self, lock: qs.Lock) -> None:  # type: ignore[misc]
                    pass

    def test_a_classmethod_body_is_refused_too(self, client: qs.Queen) -> None:
        with pytest.raises(TypeError, match=r"current_lock\(\)"):
            class Job:
                @classmethod
                @qs.singleton_job("m", bind=True, client=client)  # type: ignore[arg-type]
                def run(cls, lock: qs.Lock) -> None:  # type: ignore[misc]
                    pass

    def test_a_static_method_and_a_nested_function_take_the_lock(
            self, client: qs.Queen) -> None:
        class Job:
            @staticmethod
            @qs.singleton_job("s", bind=True, client=client)
            def run(lock: qs.Lock) -> Optional[str]:
                return lock.name

        def outer() -> Any:
            @qs.singleton_job("n", bind=True, client=client)
            def run(lock: qs.Lock) -> Optional[str]:
                return lock.name
            return run

        assert Job.run() == "s" and outer()() == "n"

    def test_a_method_without_bind_reads_the_lock_it_runs_under(self, client: qs.Queen) -> None:
        class Job:
            @qs.singleton_job("m", client=client)
            def run(self) -> Optional[str]:
                return _held_name()

        assert Job().run() == "m"


class TestAboveAStaticMethod:
    """``@singleton_job`` written above ``@staticmethod`` decorates the function inside it."""

    def test_the_method_gets_its_own_arguments_from_the_class_and_an_instance(
            self, client: qs.Queen) -> None:
        class Job:
            @qs.singleton_job("static-above", client=client)
            @staticmethod
            def run(*args: Any) -> Any:
                return args

        assert Job.run(1) == (1,), "called on the class"
        assert Job().run(1) == (1,), "called on an instance: no self passed in"

    def test_a_generator_inside_is_refused_at_decoration(self, client: qs.Queen) -> None:
        with pytest.raises(TypeError, match="generator"):
            class Job:
                @qs.singleton_job("static-gen", client=client)
                @staticmethod
                def run() -> Any:
                    yield 1

"""queen_sync.testing: the brokers users test against, their faults, and the stale-write checks."""

from __future__ import annotations

import contextlib
import logging
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import pytest
import requests

import queen_sync as qs
import queen_sync.testing as testing
from queen_sync._engines.base import Capabilities, Engine, Waiter
from queen_sync.testing import FakeBroker, FaultyEngine, LocalBroker, TokenLedger

HOWTO = Path(__file__).resolve().parent.parent / "docs" / "how-to" / "testing.md"


class TestThePublicSurface:
    def test_the_module_exports_exactly_the_kit(self) -> None:
        assert testing.__all__ == ["FakeBroker", "FaultPlan", "FaultyEngine", "LocalBroker",
                                   "TokenLedger"]
        assert testing.__all__ == sorted(testing.__all__), "__all__ is sorted"

    def test_importing_queen_sync_does_not_import_requests_or_the_kit(self) -> None:
        code = ("import sys, queen_sync; "
                "print(sorted(m for m in ('requests', 'responses', 'queen_sync.testing', "
                "'queen_sync._engines.http') if m in sys.modules))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout.strip()
        assert out == "[]", f"imported eagerly: {out}"


class TestFakeBroker:
    def test_it_answers_every_route_with_the_embedded_semantics(self, fake: FakeBroker) -> None:
        with fake.client() as q:
            lock = q.lock("job", ttl=30)
            assert lock.acquire() and not q.lock("job", ttl=30).acquire()
            put = q.kv.put("app", "k", 1, forever=True)
            answer = q.transaction().guard(lock).kv.put("app", "k", 2, forever=True,
                                                        expect=put["version"]).commit()
            assert answer and q.kv.get("app", "k")["value"] == 2, answer
        # acquire, the refused acquire, and the release at close
        assert dict(fake.calls) == {"locks": 3, "kv": 2, "transaction": 1}, dict(fake.calls)

    def test_a_call_to_a_host_nobody_serves_still_fails_while_it_runs(
            self, fake: FakeBroker) -> None:
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.post("http://elsewhere.test/api/v1/kv", json={}, timeout=1)

    def test_a_stopped_fake_unpatches_requests(self) -> None:
        broker = FakeBroker().start()
        broker.close()
        with qs.Queen(broker.url, timeout=0.2, retries=0) as q, \
                pytest.raises(qs.EngineUnavailableError):
            q.locks.get("job")

    def test_a_token_protected_fake_refuses_a_missing_token(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.delenv("QUEEN_TOKEN", raising=False)
        with FakeBroker(token="t") as broker:
            with qs.Queen(broker.url) as q, pytest.raises(qs.QueenHttpError) as caught:
                q.locks.get("job")
            assert (caught.value.status, caught.value.reason) == (401, "no_token")
            with broker.client() as q:
                assert not q.locks.get("job"), "the client of the broker carries its token"


class TestAFakeBrokerAcrossAFork:
    def test_a_child_forked_while_another_thread_calls_gets_its_answers(self) -> None:
        import os
        import threading

        with FakeBroker() as broker, broker.client() as q:
            q.kv.put("a", "b", 1, forever=True)
            stop = threading.Event()

            def hammer() -> None:
                while not stop.is_set():
                    q.kv.get("a", "b")

            caller = threading.Thread(target=hammer)
            caller.start()
            try:
                time.sleep(0.1)
                codes: list[Any] = []
                for _ in range(5):  # a fork lands mid-call, holding the broker's locks, often
                    pid = os.fork()
                    if pid == 0:  # the child: exit 0 once answered; killed below if it hangs
                        try:
                            with qs.Queen(broker.url, timeout=(1, 2)) as child:
                                os._exit(0 if child.kv.get("a", "b")["value"] == 1 else 3)
                        finally:
                            os._exit(4)
                    deadline = time.monotonic() + 10
                    while time.monotonic() < deadline:
                        done, status = os.waitpid(pid, os.WNOHANG)
                        if done:
                            codes.append(os.waitstatus_to_exitcode(status))
                            break
                        time.sleep(0.01)
                    else:
                        os.kill(pid, 9)
                        os.waitpid(pid, 0)
                        codes.append("hung")
            finally:
                stop.set()
                caller.join(5)
        assert codes == [0] * 5, f"forked children's calls to the broker: {codes}"


class TestFaultPlans:
    def test_faults_are_taken_in_order_and_only_by_their_route(self, fake: FakeBroker) -> None:
        fake.faults.fail_next(1, status=500, route="kv").fail_next(1, status=418, route="kv")
        with fake.client() as q:
            assert not q.locks.get("job"), "a kv fault leaves lock calls alone"
            with pytest.raises(qs.QueenHttpError) as first:
                q.kv.put("app", "k", 1, forever=True)
            with pytest.raises(qs.QueenHttpError) as second:
                q.kv.put("app", "k", 1, forever=True)
        assert (first.value.status, second.value.status) == (500, 418)
        assert fake.faults.injected["status"] == 2

    def test_a_delay_answers_correctly_but_late(self, fake: FakeBroker) -> None:
        import time

        fake.faults.delay_next(1, seconds=0.15)
        with fake.client() as q:
            started = time.monotonic()
            assert q.kv.incr("app", "n", forever=True)["value"] == 1
        assert time.monotonic() - started >= 0.15

    def test_chaos_hits_about_its_rate_and_clear_stops_it(self, fake: FakeBroker) -> None:
        fake.faults.chaos(0.3, kinds=("delay",), seed=1)
        for _ in range(200):
            fake.faults.take("kv")
        hits = fake.faults.injected["delay"]
        assert 40 <= hits <= 80, f"about 30% of 200 calls, got {hits}"
        fake.faults.clear()
        assert fake.faults.take("kv") is None

    @pytest.mark.parametrize("call", [
        lambda f: f.fail_next(0), lambda f: f.chaos(1.5), lambda f: f.chaos(0.1, kinds=()),
        lambda f: f.fail_next(1, route="queues"), lambda f: f.chaos(True),
        lambda f: f.chaos(float("nan")),
        lambda f: f.timeout_next(seconds=-1), lambda f: f.timeout_next(seconds=float("nan")),
        lambda f: f.delay_next(seconds=float("inf")), lambda f: f.delay_next(seconds=1e300),
        lambda f: f.delay_next(seconds="1"), lambda f: f.fail_next(status=99),
        lambda f: f.fail_next(status="abc"), lambda f: f.fail_next(status=True),
        lambda f: f.fail_next(body="text"), lambda f: f.fail_next(headers={"a": 1}),
        lambda f: f.fail_next(applied="yes"),
    ])
    def test_a_bad_fault_is_refused_when_queued_and_queues_nothing(
            self, fake: FakeBroker, call: Callable[[Any], Any]) -> None:
        with pytest.raises((ValueError, TypeError)):
            call(fake.faults)
        assert fake.faults.take("kv") is None, "the refused fault was queued all the same"
        with fake.client() as q:
            assert q.kv.incr("app", "n", forever=True)["value"] == 1, "the broker still answers"

    def test_a_fault_for_many_calls_hits_that_many_and_no_more(self, fake: FakeBroker) -> None:
        fake.faults.fail_next(3, status=500, route="kv")
        taken = [fake.faults.take("kv") for _ in range(4)]
        assert [t is not None for t in taken] == [True, True, True, False], taken

    def test_a_local_broker_cannot_fake_a_refused_connection(self) -> None:
        broker = LocalBroker()
        with pytest.raises(ValueError, match="refuse"):
            broker.faults.refuse_next(1)
        broker.close()


class TestLocalBroker:
    def test_a_restart_keeps_the_port_the_file_and_the_rising_tokens(self) -> None:
        with LocalBroker() as broker, broker.client() as q:
            url = broker.url
            first = q.locks.acquire("job", ttl_seconds=30, owner="a")
            broker.stop()
            assert not broker.running and "stopped" in repr(broker)
            broker.start()
            assert broker.url == url, "same port after a restart"
            assert q.locks.get("job")["holders"][0]["token"] == first["token"], "same file"
            q.locks.release("job", token=first["token"])
            assert q.locks.acquire("job", ttl_seconds=30, owner="b")["token"] > first["token"]

    def test_several_processes_share_one_local_broker(self) -> None:
        code = ("import sys, queen_sync as qs; q = qs.Queen(sys.argv[1]); "
                "print(q.kv.incr('app', 'n', forever=True)['value']); q.close()")
        with LocalBroker() as broker:
            procs = [subprocess.Popen([sys.executable, "-c", code, broker.url],
                                      stdout=subprocess.PIPE, text=True) for _ in range(3)]
            values = sorted(int(p.communicate(timeout=60)[0]) for p in procs)
        assert values == [1, 2, 3], f"three processes, one store: {values}"

    def test_a_temporary_file_is_removed_at_close(self) -> None:
        broker = LocalBroker().start()
        path = Path(broker.path)
        assert path.exists()
        broker.close()
        assert not path.exists(), "the broker's own temporary file is cleaned up"


class TestABrokerMisused:
    @pytest.mark.parametrize(("port", "error"), [
        (-1, ValueError), (70000, ValueError), ("8080", TypeError), (True, TypeError)])
    def test_a_bad_port_is_refused_when_the_broker_is_made(self, port: Any,
                                                          error: type[Exception]) -> None:
        with pytest.raises(error, match="port"):
            LocalBroker(port=port)

    def test_a_start_on_a_taken_port_leaves_nothing_open(self) -> None:
        import socket

        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            broker = LocalBroker(port=taken.getsockname()[1])
            with pytest.raises(OSError):
                broker.start()
            assert broker.core._engine is None, "the store stayed open after the failed start"
            broker.close()

    @pytest.mark.parametrize("kind", [FakeBroker, LocalBroker])
    def test_a_start_after_close_removed_its_store_is_refused(self, kind: Any) -> None:
        broker = kind()
        with broker, broker.client() as q:
            q.locks.acquire("job", ttl_seconds=30, owner="a")
        with pytest.raises(RuntimeError, match="closed"):
            broker.start()
        broker.close()


class TestABrokerStoppedOrMisbuilt:
    @pytest.mark.parametrize("kind", [FakeBroker, LocalBroker])
    def test_a_call_in_flight_when_the_broker_stops_reaches_nothing_and_logs_no_error(
            self, kind: Any, caplog: pytest.LogCaptureFixture) -> None:
        import threading

        broker = kind().start()
        try:
            with broker.client(timeout=(1, 2)) as q:
                broker.faults.delay_next(1, seconds=0.5, route="kv")
                outcome: list[BaseException] = []

                def call() -> None:
                    try:
                        q.kv.get("a", "b")
                    except BaseException as exc:
                        outcome.append(exc)

                caplog.set_level(logging.ERROR)
                caller = threading.Thread(target=call)
                caller.start()
                time.sleep(0.2)
                broker.stop()
                caller.join(10)
        finally:
            broker.close()
        assert outcome and isinstance(outcome[0], qs.EngineUnavailableError) and \
            not isinstance(outcome[0], qs.QueenHttpError), f"the call got: {outcome!r}"
        assert not [r for r in caplog.records if r.name == "queen_sync"], caplog.text

    @pytest.mark.parametrize("reading", [float("nan"), "x", float("inf"), -5.0, 1e30])
    def test_a_clock_that_reads_no_epoch_time_is_the_brokers_fault_not_the_request(
            self, reading: Any) -> None:
        with FakeBroker(clock=lambda: reading) as broker, broker.client() as q, \
                pytest.raises(qs.QueenHttpError) as caught:
            q.locks.get("x")
        assert caught.value.status == 500 and "clock" in str(caught.value), caught.value


class TestADelayPastTheReadTimeout:
    @pytest.mark.parametrize("kind", [FakeBroker, LocalBroker])
    def test_the_client_gives_up_at_its_timeout_and_the_call_lands_late_on_either_broker(
            self, kind: Any) -> None:
        with kind() as broker, broker.client(timeout=(1, 0.3), call_timeout=0.8,
                                            backoff=0) as q:
            broker.faults.delay_next(1, seconds=1.0, route="kv")
            started = time.monotonic()
            with pytest.raises(qs.EngineUnavailableError):
                q.kv.incr("app", "n", forever=True)
            gave_up = time.monotonic() - started
            time.sleep(1.2)
            landed = q.kv.get("app", "n")
        assert gave_up < 0.9, f"the client waited {gave_up:.2f}s past its 0.3s read timeout"
        assert landed and landed["value"] == 1, f"the delayed call did not land: {landed}"


class TestPausedHolders:
    def test_a_paused_holder_still_believes_but_its_guarded_write_is_fenced(
        self, fake: FakeBroker
    ) -> None:
        with fake.client() as q:
            old = q.lock("export", ttl=30)
            assert old.acquire()
            with fake.paused(old):
                assert old.held, "the paused handle has not noticed"
                new = q.lock("export", ttl=30)
                assert new.acquire(), "its permit is over on the broker"
                assert new.token is not None and old.token is not None
                assert new.token > old.token
                answer = q.transaction().guard(old).kv.put("out", "r", 1, forever=True).commit()
                assert not answer and answer["reason"] == "kv_precondition", answer
            assert old.lost.wait(2) and old.lost_reason in ("renew", "guard"), repr(old)
            assert not q.kv.get("out", "r"), "the stale write did not land"
        fake.assert_no_stale_writes()

    def test_pausing_a_lock_not_held_is_refused(self, fake: FakeBroker) -> None:
        with fake.client() as q, pytest.raises(ValueError, match="not held"), \
                fake.paused(q.lock("job", ttl=30)):
            pass

    def test_pausing_a_lock_of_another_store_is_refused_and_leaves_it_renewed(
        self, fake: FakeBroker, tmp_path: Path
    ) -> None:
        with qs.Queen(f"sqlite:///{tmp_path}/other.db", renew_thread=False) as other, \
                FakeBroker("http://other.test:6632") as another, \
                another.client() as broker_client:
            for client in (other, broker_client):
                lock = client.lock("job", ttl=30)
                assert lock.acquire()
                with pytest.raises(ValueError, match="no permit on this broker"), \
                        fake.paused(lock):
                    pass
                assert lock in client.renewer.held(), "its renewals did not resume"
                assert not client.lock("job", ttl=30).acquire(), "its permit was touched"
                lock.release()

    def test_a_lock_whose_client_spells_the_brokers_url_otherwise_is_paused(self) -> None:
        with LocalBroker() as broker, qs.Queen(broker.url.replace("127.0.0.1", "localhost"),
                                               renew_thread=False) as q:
            old = q.lock("export", ttl=30)
            assert old.acquire()
            with broker.paused(old):
                assert q.lock("export", ttl=30).acquire(), "its permit is over on the broker"

    def test_a_renew_in_flight_lands_before_the_pause_so_the_handle_notices_nothing(
        self, fake: FakeBroker
    ) -> None:
        with fake.client() as q:
            old = q.lock("export", ttl=3)  # renewed every second
            assert old.acquire()
            fake.faults.delay_next(1, seconds=0.5, route="locks")
            time.sleep(1.2)  # its renew has been sent, and waits in the delay
            with fake.paused(old):
                time.sleep(0.6)
                assert not old.lost.is_set() and old.token is not None, (
                    f"the handle noticed the pause: {old!r}")
                answer = q.transaction().guard(old).kv.put("out", "r", 1, forever=True).commit()
                assert not answer and answer["reason"] == "kv_precondition", answer
        fake.assert_no_stale_writes()

    def test_the_broker_check_fails_on_a_superseded_guarded_commit(self,
                                                                   fake: FakeBroker) -> None:
        fake.core._guarded.extend([("job#0", 9), ("job#0", 5)])
        with pytest.raises(AssertionError, match="token 5 after one with token 9"):
            fake.assert_no_stale_writes()


class EpochClock:
    """An epoch-seconds clock a test moves by hand, for a broker's or an engine's store."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Recording(Engine):
    """An engine that answers nothing but notes which of its methods were called."""

    kind = "recording"
    capabilities = Capabilities(multi_host=True)

    def __init__(self) -> None:
        self.seen: list[str] = []

    @property
    def url(self) -> str:
        return "recording://here"

    def call(self, route: str, body: Mapping[str, Any]) -> dict[str, Any]:
        self.seen.append(f"call {route}")
        return {"results": []}

    @contextlib.contextmanager
    def subscribe(self, name: str) -> Iterator[Waiter]:
        self.seen.append(f"subscribe {name}")
        with super().subscribe(name) as waiter:
            yield waiter

    def fence(self, conn: Any, *, name: str, slot: int, token: int) -> None:
        self.seen.append(f"fence {name} {slot} {token}")

    def after_fork(self) -> None:
        self.seen.append("after_fork")

    def close(self) -> None:
        self.seen.append("close")


@pytest.fixture
def faulty(tmp_path: Path) -> Iterator[tuple[FaultyEngine, qs.Queen]]:
    engine = FaultyEngine("sqlite://" + str(tmp_path / "queen.db"))
    with qs.Queen(engine=engine, renew_thread=False) as q:
        yield engine, q


def runs(q: qs.Queen) -> Any:
    row = q.kv.get("stats", "runs")
    return row["value"] if row else None


class TestFaultyEngine:
    def test_a_call_failed_before_it_reaches_the_engine_writes_nothing(
        self, faulty: tuple[FaultyEngine, qs.Queen]
    ) -> None:
        engine, q = faulty
        engine.fail_next(route="kv")
        with pytest.raises(qs.EngineUnavailableError, match="injected"):
            q.kv.incr("stats", "runs", forever=True)
        assert runs(q) is None, "a call failed before the engine must write nothing"
        assert engine.injected["fail"] == 1 and engine.calls["kv"] == 1, engine.calls

    def test_sent_counts_every_call_made_to_it_by_route_faulted_or_not(
        self, faulty: tuple[FaultyEngine, qs.Queen]
    ) -> None:
        engine, q = faulty
        engine.fail_next(route="locks")
        with pytest.raises(qs.EngineUnavailableError):
            q.locks.get("job")
        engine.fail_next(route="kv", applied=True)
        with pytest.raises(qs.EngineUnavailableError):
            q.kv.incr("stats", "runs", forever=True)
        assert runs(q) == 1
        assert engine.sent == {"locks": 1, "kv": 2}, f"every call counts as sent: {engine.sent}"
        assert engine.calls == {"kv": 2}, f"only the calls the inner one answered: {engine.calls}"

    def test_a_call_failed_after_it_was_applied_has_written_once(
        self, faulty: tuple[FaultyEngine, qs.Queen]
    ) -> None:
        engine, q = faulty
        engine.fail_next(route="kv", applied=True)
        with pytest.raises(qs.EngineUnavailableError):
            q.kv.incr("stats", "runs", forever=True)
        assert runs(q) == 1, "an applied call whose answer was lost has written, once"

    def test_the_given_exception_hits_only_calls_carrying_its_operation(
        self, faulty: tuple[FaultyEngine, qs.Queen]
    ) -> None:
        engine, q = faulty
        engine.fail_next(error=KeyboardInterrupt, op="acquire", applied=True)
        assert not q.locks.get("job"), "a call without an acquire is left alone"
        with pytest.raises(KeyboardInterrupt, match="injected"):
            q.locks.acquire("job", ttl_seconds=30, owner="me")
        assert q.locks.get("job")["held"], "applied: the acquire landed before the interrupt"
        assert q.locks.acquire("other", ttl_seconds=30, owner="me"), "the fault was used up"

    def test_an_exception_instance_is_raised_as_given(
        self, faulty: tuple[FaultyEngine, qs.Queen]
    ) -> None:
        engine, q = faulty
        error = qs.StoreReplacedError("replaced (simulated)", path="x.db")
        engine.fail_next(error=error)
        with pytest.raises(qs.StoreReplacedError) as caught:
            q.locks.get("job")
        assert caught.value is error

    def test_a_delay_answers_correctly_but_late(
        self, faulty: tuple[FaultyEngine, qs.Queen]
    ) -> None:
        engine, q = faulty
        engine.delay_next(seconds=0.15, route="kv")
        started = time.monotonic()
        assert q.kv.incr("stats", "runs", forever=True)["value"] == 1
        assert time.monotonic() - started >= 0.15, "the delay was not applied"
        assert engine.injected["delay"] == 1

    @pytest.mark.parametrize("applied", [False, True])
    def test_a_hook_runs_before_the_call_or_after_it_was_applied(
        self, faulty: tuple[FaultyEngine, qs.Queen], applied: bool
    ) -> None:
        engine, q = faulty
        seen: list[Any] = []

        def look(route: str, body: Mapping[str, Any]) -> None:
            seen.append(engine.inner.call("kv", {"operations": [
                {"op": "get", "ns": "stats", "key": "runs"}]})["results"][0].get("value"))
        engine.hook_next(hook=look, route="kv", op="incr", applied=applied)
        q.kv.incr("stats", "runs", forever=True)
        assert seen == ([1] if applied else [None]), f"the hook saw {seen}"

    def test_n_none_hits_every_matching_call_until_cleared(
        self, faulty: tuple[FaultyEngine, qs.Queen]
    ) -> None:
        engine, q = faulty
        engine.fail_next(None, route="kv")
        for _ in range(3):
            with pytest.raises(qs.EngineUnavailableError):
                q.kv.get("stats", "runs")
        engine.clear()
        assert runs(q) is None and engine.injected["fail"] == 3, engine.injected

    def test_faults_are_taken_in_order(self, faulty: tuple[FaultyEngine, qs.Queen]) -> None:
        engine, q = faulty
        engine.fail_next(error=ValueError).fail_next(error=qs.EngineUnavailableError)
        with pytest.raises(ValueError):
            q.kv.get("stats", "runs")
        with pytest.raises(qs.EngineUnavailableError):
            q.kv.get("stats", "runs")
        assert runs(q) is None, "both faults were used up"

    @pytest.mark.parametrize("script, error", [
        (lambda e: e.fail_next(0), ValueError),
        (lambda e: e.fail_next("1"), TypeError),
        (lambda e: e.fail_next(route="queues"), ValueError),
        (lambda e: e.fail_next(error="boom"), TypeError),
        (lambda e: e.delay_next(seconds=-1), ValueError),
        (lambda e: e.hook_next(hook=None), TypeError),
    ])
    def test_a_bad_script_is_refused_when_written(
        self, faulty: tuple[FaultyEngine, qs.Queen], script: Callable[[FaultyEngine], Any],
        error: type[Exception]
    ) -> None:
        engine, q = faulty
        with pytest.raises(error):
            script(engine)
        assert q.kv.incr("stats", "runs", forever=True)["value"] == 1, "nothing was scripted"

    def test_it_forwards_everything_else_to_the_engine_it_wraps(self) -> None:
        inner = Recording()
        engine = FaultyEngine(inner)
        assert (engine.url, engine.kind, engine.capabilities) == (
            inner.url, inner.kind, inner.capabilities)
        assert engine.inner is inner and "recording://here" in repr(engine)
        with engine.subscribe("job") as waiter:
            assert waiter.wait(0) is False
        engine.fence(None, name="job", slot=0, token=7)
        engine.call("locks", {"operations": []})
        engine.after_fork()
        engine.close()
        assert inner.seen == ["subscribe job", "fence job 0 7", "call locks", "after_fork",
                              "close"], inner.seen

    def test_options_are_refused_with_an_engine_and_a_non_engine_is_refused(self) -> None:
        with pytest.raises(TypeError, match="URL"):
            FaultyEngine(Recording(), clock=time.time)
        with pytest.raises(TypeError, match="Engine"):
            FaultyEngine(42)  # type: ignore[arg-type]


class TestAFaultyEngineOverHttp:
    @pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "faulty"])
    def test_a_stalled_acquire_landing_after_the_release_is_given_back_at_close(
            self, wrapped: bool) -> None:
        """The HTTP engine's clean-up of resent acquires works through the wrapper too."""
        with LocalBroker() as broker:
            options: dict[str, Any] = {"timeout": (1.0, 0.4), "call_timeout": 3, "backoff": 0.01}
            q = qs.Queen(engine=FaultyEngine(broker.url, **options)) if wrapped else \
                qs.Queen(broker.url, **options)
            lock = q.lock("job", ttl=30)
            broker.faults.delay_next(1, seconds=1.0, route="locks")  # it lands late
            assert lock.acquire(), "the resend is answered"
            assert lock.release()
            time.sleep(1.3)  # the stalled first acquire lands now: a permit for nobody
            q.close()
            with broker.client() as after:
                holders = after.locks.get("job")["holders"]
            assert holders == [], f"a stray permit outlived its client: {holders}"


class TestAFaultyEnginesArguments:
    @pytest.mark.parametrize("seconds", [-1, float("nan"), float("inf"), 1e300, True, "1"])
    def test_a_delay_that_could_not_be_slept_is_refused_when_scripted(
            self, faulty: tuple[FaultyEngine, qs.Queen], seconds: Any) -> None:
        engine, q = faulty
        with pytest.raises(ValueError, match="seconds"):
            engine.delay_next(seconds=seconds)
        assert q.kv.incr("app", "n", forever=True)["value"] == 1, "nothing was scripted"


class TestEngineClocks:
    @pytest.mark.parametrize("kind", [FakeBroker, LocalBroker])
    def test_a_lease_expires_when_the_broker_clock_passes_its_ttl(
        self, kind: Callable[..., Any]
    ) -> None:
        clock = EpochClock()
        with kind(clock=clock) as broker, broker.client(renew_thread=False) as q:
            assert q.lock("job", ttl=30, auto_renew=False).acquire()
            clock.advance(29)
            assert not q.lock("job", ttl=30).acquire(), "the lease ended before its TTL"
            clock.advance(2)
            assert q.lock("job", ttl=30).acquire(), "the broker's clock passed the TTL"

    def test_a_key_expires_when_the_broker_clock_passes_its_ttl(self) -> None:
        clock = EpochClock()
        with FakeBroker(clock=clock) as broker, broker.client() as q:
            q.kv.put("app", "k", 1, ttl=10)
            clock.advance(9)
            assert q.kv.get("app", "k"), "the key ended before its TTL"
            clock.advance(2)
            assert not q.kv.get("app", "k"), "the key outlived its TTL on the broker's clock"

    def test_an_sqlite_engine_built_from_a_url_takes_an_engine_clock(
        self, tmp_path: Path
    ) -> None:
        clock = EpochClock()
        engine = FaultyEngine("sqlite://" + str(tmp_path / "queen.db"), clock=clock)
        with qs.Queen(engine=engine, renew_thread=False) as q:
            assert q.locks.acquire("job", ttl_seconds=30, owner="a")
            clock.advance(31)
            assert q.locks.acquire("job", ttl_seconds=30, owner="b"), "the engine clock moved"

    @pytest.mark.parametrize("kind", [FakeBroker, LocalBroker])
    def test_a_clock_that_is_not_callable_is_refused(self, kind: Callable[..., Any]) -> None:
        with pytest.raises(TypeError, match="clock"):
            kind(clock=5)


class TestTokenLedger:
    def test_equal_and_rising_tokens_pass(self) -> None:
        ledger = TokenLedger()
        for token in (3, 3, 7, 7, 9):
            ledger.record(token)
        ledger.assert_no_stale_writes()
        assert ledger.tokens == [3, 3, 7, 7, 9]

    def test_a_lower_token_after_a_higher_one_fails_naming_both(self) -> None:
        ledger = TokenLedger()
        ledger.record(7, "new holder")
        ledger.record(3, "paused holder")
        with pytest.raises(AssertionError, match=r"token 3 \('paused holder'\) after token 7"):
            ledger.assert_no_stale_writes()

    @pytest.mark.parametrize("token", [None, "3", True, 2.0])
    def test_a_token_that_is_not_an_int_is_refused(self, token: object) -> None:
        with pytest.raises(TypeError):
            TokenLedger().record(token)  # type: ignore[arg-type]


def howto_samples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", HOWTO.read_text(encoding="utf-8"), re.S)


class TestTheHowTo:
    def test_the_page_has_its_samples(self) -> None:
        assert len(howto_samples()) == 9, "a sample was added or lost: update this count"

    @pytest.mark.parametrize("index", range(9))
    def test_each_sample_runs(self, index: int) -> None:
        sample = howto_samples()[index]
        exec(compile(sample, f"{HOWTO.name}[{index}]", "exec"), {"__name__": "howto"})

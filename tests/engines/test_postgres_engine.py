"""What is particular to the PostgreSQL engine: URLs, secrets, errors, schema, wake-up, fence."""

from __future__ import annotations

import ast
import contextlib
import logging
import multiprocessing
import os
import secrets
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, TypeVar, cast

import pg_server as server_helper
import pytest
from pg_server import PgServer, free_port, require_pg, shared_server
from polling import woken_within

if not require_pg():
    pytest.importorskip("psycopg")
import psycopg
import psycopg_pool
from pg_cuts import record_trips

import queen_sync as qs
from queen_sync._engines.base import Engine
from queen_sync._engines.embedded import kv_footprint, lock_footprint
from queen_sync._engines.postgres import engine as _postgres
from queen_sync._engines.postgres import errors as _postgres_errors
from queen_sync._engines.postgres import pool as _postgres_pool
from queen_sync._engines.postgres import storage as _postgres_storage
from queen_sync._engines.postgres import url as _postgres_url
from queen_sync._engines.postgres.engine import PostgresEngine
from queen_sync._engines.postgres.one_trip import GuardedTxn
from queen_sync._engines.storage import Footprint

pytestmark = pytest.mark.timeout(60)
CTX = multiprocessing.get_context("spawn")
E = TypeVar("E")


@pytest.fixture(scope="module")
def server() -> Iterator[PgServer]:
    with shared_server() as running:
        yield running


@pytest.fixture
def base_url(server: PgServer) -> str:
    return server.url


@pytest.fixture
def url(base_url: str) -> str:
    """A fresh, empty schema."""
    return f"{base_url}?schema=t_{secrets.token_hex(6)}"


@pytest.fixture
def engine(url: str) -> Iterator[PostgresEngine]:
    eng = PostgresEngine.from_url(url)
    yield eng
    eng.close()


def acquire(engine: PostgresEngine, name: str, owner: str, ttl: int = 30,
            limit: int = 1) -> dict[str, Any]:
    op = {"op": "acquire", "name": name, "ttlSeconds": ttl, "owner": owner}
    if limit > 1:
        op["limit"] = limit
    result: dict[str, Any] = engine.call("locks", {"operations": [op]})["results"][0]
    return result


def release(engine: Engine, name: str, answer: dict[str, Any]) -> dict[str, Any]:
    op = {"op": "release", "name": name, "token": answer["token"], "slot": answer["slot"]}
    result: dict[str, Any] = engine.call("locks", {"operations": [op]})["results"][0]
    return result


class TestUrlsAndSecrets:
    def test_the_password_shows_nowhere_in_the_url_or_repr(
            self, server: PgServer, engine: PostgresEngine) -> None:
        assert server.password not in engine.url, engine.url
        assert server.password not in repr(engine), repr(engine)
        assert "***" in engine.url and "schema=t_" in engine.url, engine.url

    def test_several_hosts_and_a_password_in_the_query_are_redacted(self) -> None:
        public = _postgres_url.public_url(
            "postgresql://app:s3cr3t@h1:5432,h2:5433/db?password=qu3ry&sslmode=disable")
        assert "s3cr3t" not in public and "qu3ry" not in public, public
        assert "h1:5432,h2:5433" in public and "sslmode=disable" in public, public

    def test_both_schemes_choose_this_engine_and_url_options_apply(self, base_url: str) -> None:
        for scheme in ("postgresql", "postgres"):
            url = scheme + base_url[len("postgresql"):] + "?schema=abc&pool_max_size=3&timeout=2"
            with qs.Queen(url) as q:
                assert q.engine.kind == "postgres", q.engine
                storage = q.engine.storage  # type: ignore[attr-defined]
                assert storage.sql.schema == "abc" and storage.sessions._sizes == (1, 3), storage

    @pytest.mark.parametrize("timeout", [0, -1, float("inf"), float("nan"), True, "5",
                                         (1, 2, 3)])
    def test_a_bad_timeout_is_refused_when_the_client_is_made(
            self, url: str, timeout: object) -> None:
        """One rule for every engine: positive, finite seconds, or a pair of them."""
        with pytest.raises((TypeError, ValueError), match="timeout must be"):
            PostgresEngine(url, timeout=timeout)

    def test_a_timeout_pair_sets_connecting_and_calling_apart(self, url: str) -> None:
        with contextlib.closing(PostgresEngine(url, timeout=(3, 7))) as engine:
            assert engine.storage.call_timeout == 7, engine.storage.call_timeout

    def test_the_constructor_honours_the_urls_own_options_as_from_url_does(
            self, base_url: str) -> None:
        url = base_url + "?schema=from_url&timeout=3&pool_max_size=2"
        with contextlib.closing(PostgresEngine(url)) as engine:
            assert engine.storage.sql.schema == "from_url", f"?schema= was ignored: {engine.url}"
            assert engine.storage.call_timeout == 3, engine.storage.call_timeout
            assert engine.storage.sessions._sizes == (1, 2), engine.storage.sessions._sizes
            assert "schema=from_url" in engine.url, engine.url
        with contextlib.closing(PostgresEngine(url, schema="chosen")) as engine:
            assert engine.storage.sql.schema == "chosen", "an explicit schema must win"

    def test_an_explicit_option_wins_over_the_url(self, base_url: str) -> None:
        engine = PostgresEngine.from_url(base_url + "?schema=abc", schema="other")
        assert engine.storage.sql.schema == "other", engine.url
        engine.close()

    @pytest.mark.parametrize("query", ["schema=Bad-Name", "schema=1x", "pool_max_size=many",
                                       "no_such_libpq_option=1", "schema=a&schema=b",
                                       "timeout=3&timeout=4", "timeout=nan", "timeout=-1"])
    def test_a_bad_url_option_is_refused_as_bad_url(self, base_url: str, query: str) -> None:
        with pytest.raises(qs.RequestError) as caught:
            PostgresEngine.from_url(f"{base_url}?{query}")
        assert caught.value.code == "bad_url", caught.value

    @pytest.mark.parametrize("options", ["-c%20statement_timeout%3D4321",
                                         "-c+statement_timeout%3D4321"])
    def test_libpq_options_holding_a_space_reach_the_server_as_written(
            self, url: str, options: str) -> None:
        # libpq decodes %20 to a space and leaves '+' alone; the second form is one '-c'
        # argument with a '+' in it, which the server rejects: what libpq itself would do.
        engine = PostgresEngine.from_url(f"{url}&options={options}")
        try:
            if "+" in options:
                with pytest.raises(qs.EngineError):
                    engine.call("locks", {"operations": [{"op": "get", "name": "x"}]})
                return
            with engine.storage.connect() as conn:
                shown = conn.execute("SHOW statement_timeout").fetchone()
            assert shown == ("4321ms",), f"the URL's statement_timeout did not apply: {shown}"
            answer = engine.call("locks", {"operations": [{"op": "get", "name": "x"}]})
            assert answer["results"][0]["held"] is False, answer
        finally:
            engine.close()

    def test_options_of_other_engines_are_refused(self, base_url: str) -> None:
        with pytest.raises(TypeError, match="headers"):
            qs.Queen(base_url, headers={"x": "y"})

    def test_a_wrong_password_is_unavailable_and_never_echoed(
            self, server: PgServer, caplog: pytest.LogCaptureFixture) -> None:
        wrong = "wr0ng-" + secrets.token_hex(4)
        url = server.url.replace(server.password, wrong)
        caplog.set_level(logging.DEBUG)
        with qs.Queen(url) as q, pytest.raises(qs.EngineUnavailableError) as caught:
            q.locks.get("x")
        shown = str(caught.value) + repr(caught.value) + caplog.text
        assert "password authentication failed" in str(caught.value), caught.value
        assert wrong not in shown and server.password not in shown, shown


class TestErrors:
    def test_every_driver_error_maps_to_the_most_specific_queen_sync_error(self) -> None:
        # Refusals of this body or this client, however the driver classifies them.
        refusals = {psycopg_pool.PoolClosed, psycopg.errors.OutOfMemory,
                    psycopg.errors.QueryCanceled}
        seen = 0
        for cls in _all_subclasses(psycopg.Error):
            exc = cls.__new__(cls)
            Exception.__init__(exc, "boom")
            err = _postgres_errors.translate(exc, "db")
            seen += 1
            if issubclass(cls, psycopg.OperationalError) and cls not in refusals:
                assert isinstance(err, qs.EngineUnavailableError), (cls, err)
            else:
                assert type(err) is qs.EngineError, (cls, err)
        assert seen > 200, f"only {seen} driver errors found: the walk is broken"

    def test_every_driver_exception_the_engine_catches_is_listed_and_mapped(self) -> None:
        listed = set(_postgres_storage.CAUGHT_DRIVER_ERRORS)
        for name in _caught_driver_names():
            cls = _resolve(name)
            assert cls in listed, f"{name} is caught but not in CAUGHT_DRIVER_ERRORS"
        for cls in listed:
            # Some of them are the pool's, not psycopg.Error: translate takes those too.
            exc = cast(psycopg.Error, cls("x"))
            assert isinstance(_postgres_errors.translate(exc, "db"), qs.QueenError), cls

    def test_an_unreachable_server_is_reported_quickly(self) -> None:
        url = f"postgresql://nobody:pw@127.0.0.1:{free_port()}/db?timeout=2"
        started = time.monotonic()
        with qs.Queen(url) as q, pytest.raises(qs.EngineUnavailableError, match="refused"):
            q.locks.get("x")
        assert time.monotonic() - started < 3, "an unreachable server must fail fast"

    def test_a_commit_whose_connection_died_is_unknown_not_retried(
            self, engine: PostgresEngine) -> None:
        class DeadConnection:
            closed = True

            def execute(self, *args: Any) -> None:
                raise psycopg.OperationalError("server closed the connection unexpectedly")

        class Txn:
            def commit_script(self) -> list[Any]:
                return [("COMMIT", ())]

        with pytest.raises(qs.EngineUnavailableError, match="unknown"):
            dead = DeadConnection()
            engine.storage._commit(_call(engine), dead, dead, Txn())  # type: ignore[arg-type]

    def test_a_missing_privilege_is_an_engine_error_not_unavailability(
            self, server: PgServer, url: str) -> None:
        with qs.Queen(url) as q:
            q.locks.get("made-by-the-owner")  # creates the schema as the superuser
        role = "weak_" + secrets.token_hex(3)
        with psycopg.connect(server.url, autocommit=True) as admin:
            admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'weakpw'")
        weak = url.replace(f"queen:{server.password}", f"{role}:weakpw")
        with qs.Queen(weak) as q, pytest.raises(qs.EngineError) as caught:
            q.locks.get("x")
        assert not isinstance(caught.value, qs.EngineUnavailableError), caught.value
        assert "privilege" in str(caught.value), caught.value


def _all_subclasses(cls: type[E]) -> set[type[E]]:
    found: set[type[E]] = set()
    for sub in cls.__subclasses__():
        found.add(sub)
        found |= _all_subclasses(sub)
    return found


def _caught_driver_names() -> set[str]:
    """Driver errors named in ``except`` clauses and ``suppress()`` calls of the engine."""
    names = set()
    for path in Path(_postgres.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            caught: list[ast.expr] = []
            if isinstance(node, ast.ExceptHandler) and node.type is not None:
                caught = [node.type]
            elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("suppress"):
                caught = list(node.args)
            for expr in (e for c in caught for e in ast.walk(c)):
                if isinstance(expr, ast.Attribute) and ast.unparse(expr).startswith("psycopg"):
                    names.add(ast.unparse(expr))
    names.update(f"psycopg.errors.{c.__name__}" for c in _postgres_storage._CONFLICTS)
    return {n for n in names if not any(n != m and m.startswith(n + ".") for m in names)}


def _resolve(dotted: str) -> type:
    modules = {"psycopg": psycopg, "psycopg_pool": psycopg_pool}
    head, *rest = dotted.split(".")
    obj: Any = modules[head]
    for part in rest:
        obj = getattr(obj, part)
    assert isinstance(obj, type), dotted
    return obj


def _create_and_acquire(url: str, name: str, results: Any) -> None:
    engine = PostgresEngine.from_url(url)
    try:
        answer = acquire(engine, name, owner=name)
        results.put((name, answer.get("acquired"), answer.get("token")))
    except Exception as exc:  # reported to the test, which fails with it
        results.put((name, False, repr(exc)))
    finally:
        engine.close()


class TestSchema:
    def test_four_processes_creating_the_schema_at_once_all_succeed(self, url: str) -> None:
        results = CTX.Queue()
        procs = [CTX.Process(target=_create_and_acquire, args=(url, f"p{i}", results))
                 for i in range(4)]
        for proc in procs:
            proc.start()
        answers = [results.get(timeout=30) for _ in procs]
        for proc in procs:
            proc.join(10)
        assert all(acquired for _, acquired, _ in answers), answers
        tokens = [token for _, _, token in answers]
        assert len(set(tokens)) == 4, f"tokens must be unique: {tokens}"

    def test_tokens_rise_across_reopening_the_engine(self, url: str) -> None:
        first = PostgresEngine.from_url(url)
        answers = [acquire(first, "job", "a") for _ in range(1)]
        release(first, "job", answers[0])
        put = first.call("kv", {"operations": [
            {"op": "put", "ns": "n", "key": "k", "value": 1, "forever": True}]})
        high = put["results"][0]["version"]
        first.close()
        second = PostgresEngine.from_url(url)
        again = acquire(second, "job", "b")
        second.close()
        assert again["token"] > high > answers[0]["token"], (answers, high, again)

    def test_expiry_is_judged_by_the_database_clock(
            self, server: PgServer, engine: PostgresEngine) -> None:
        with psycopg.connect(server.url) as conn:
            before = conn.execute("SELECT extract(epoch FROM clock_timestamp()) * 1000"
                                  ).fetchone()[0]  # type: ignore[index]
            answer = acquire(engine, "clock", "a", ttl=7)
            after = conn.execute("SELECT extract(epoch FROM clock_timestamp()) * 1000"
                                 ).fetchone()[0]  # type: ignore[index]
        holder = engine.call("locks", {"operations": [{"op": "get", "name": "clock"}]}
                             )["results"][0]["holders"][0]
        assert before - 1 <= holder["since"] <= after + 1, (before, holder, after)
        assert holder["expiresAt"] == holder["since"] + 7000, holder
        assert answer["acquired"], answer


class TestWakeUp:
    def test_a_release_on_another_connection_wakes_a_waiter_within_100ms(
            self, url: str, engine: PostgresEngine) -> None:
        other = PostgresEngine.from_url(url)
        held = acquire(other, "wake", "a")
        woke_at: list[float] = []
        with engine.subscribe("wake") as waiter:
            thread = threading.Thread(target=lambda: woke_at.append(
                time.monotonic() if woken_within(waiter, 5.0) else float("inf")))
            thread.start()
            time.sleep(0.05)
            released_at = time.monotonic()
            assert release(other, "wake", held) == {"released": True}
            thread.join(5.0)
        other.close()
        assert woke_at and woke_at[0] - released_at < 0.15, (
            f"woken {woke_at[0] - released_at:.3f}s after the release")

    def test_a_waiter_sleeps_through_another_names_release(
            self, engine: PostgresEngine) -> None:
        held = acquire(engine, "other-name", "a")
        with engine.subscribe("mine") as waiter:
            release(engine, "other-name", held)
            assert waiter.wait(0.2) is False, "woken by a release of a different name"

    def test_subscribing_while_the_server_is_unreachable_falls_back_to_polling(self) -> None:
        engine = PostgresEngine.from_url(f"postgresql://nobody:pw@127.0.0.1:{free_port()}/db")
        started = time.monotonic()
        for _ in range(3):
            with engine.subscribe("x") as waiter:
                assert waiter.wait(0.01) is False, "woken with no server to wake it"
        engine.close()
        assert time.monotonic() - started < 1.0, "subscribing waited for an absent server"

    def test_a_waiting_acquire_takes_the_lock_soon_after_it_is_released(self, url: str) -> None:
        with qs.Queen(url) as q1, qs.Queen(url) as q2:
            first = q1.lock("handoff", ttl="30s")
            assert first.acquire()
            timer = threading.Timer(0.3, first.release)
            timer.start()
            started = time.monotonic()
            second = q2.lock("handoff", ttl="30s")
            assert second.acquire(wait=5), "the waiter never got the lock"
            waited = time.monotonic() - started
            timer.join()
            second.release()
        assert 0.25 < waited < 0.6, f"hand-off took {waited:.3f}s after a 0.3s hold"


class TestFence:
    def test_a_fence_at_the_current_token_holds_off_the_release_until_commit(
            self, server: PgServer, engine: PostgresEngine) -> None:
        held = acquire(engine, "fenced", "a")
        done: list[dict[str, Any]] = []
        with psycopg.connect(server.url) as conn:
            engine.fence(conn, name="fenced", slot=held["slot"], token=held["token"])
            releaser = threading.Thread(target=lambda: done.append(release(engine, "fenced",
                                                                           held)))
            releaser.start()
            releaser.join(0.3)
            assert releaser.is_alive(), "the release went through an open fenced transaction"
            conn.commit()
        releaser.join(5.0)
        assert done == [{"released": True}], done

    def test_a_fence_does_not_hold_up_the_holders_renewal(
            self, server: PgServer, url: str) -> None:
        engine = PostgresEngine.from_url(url, timeout=2)
        held = acquire(engine, "renewing", "a")
        with psycopg.connect(server.url) as conn:
            engine.fence(conn, name="renewing", slot=held["slot"], token=held["token"])
            started = time.monotonic()
            renewed = engine.call("locks", {"operations": [
                {"op": "renew", "name": "renewing", "token": held["token"], "ttlSeconds": 30,
                 "owner": "a", "slot": held["slot"]}]})["results"][0]
            assert time.monotonic() - started < 1.0, "the renewal waited for the fence"
            conn.commit()
        engine.close()
        assert renewed["renewed"] and renewed["token"] > held["token"], renewed

    def test_a_stale_token_or_an_expired_permit_is_fenced_out(
            self, server: PgServer, engine: PostgresEngine) -> None:
        held = acquire(engine, "stale", "a")
        with psycopg.connect(server.url) as conn, pytest.raises(qs.LockLostError) as caught:
            engine.fence(conn, name="stale", slot=0, token=held["token"] - 1)
        assert (caught.value.reason, caught.value.token) == ("guard", held["token"] - 1)
        with psycopg.connect(server.url, autocommit=True) as admin:
            admin.execute(f"UPDATE {engine.storage.sql.schema}.kv SET expires_at = 1"
                          " WHERE key = 'stale#0'")
        with psycopg.connect(server.url) as conn, pytest.raises(qs.LockLostError):
            engine.fence(conn, name="stale", slot=0, token=held["token"])

    def test_a_fence_outside_a_transaction_is_refused(
            self, server: PgServer, engine: PostgresEngine) -> None:
        held = acquire(engine, "auto", "a")
        with psycopg.connect(server.url, autocommit=True) as conn, pytest.raises(
                qs.RequestError, match="transaction"):
            engine.fence(conn, name="auto", slot=0, token=held["token"])

    def test_lock_fence_through_the_public_api(self, server: PgServer, url: str) -> None:
        with qs.Queen(url) as q, psycopg.connect(server.url) as conn:
            lock = q.lock("public", ttl="30s")
            assert lock.acquire()
            with conn.transaction():
                lock.fence(conn)
            lock.release()
            with conn.transaction(), pytest.raises(qs.LockError):
                lock.fence(conn)


class TestConcurrency:
    def test_concurrent_semaphore_acquirers_take_distinct_lowest_slots(self, url: str) -> None:
        engines = [PostgresEngine.from_url(url) for _ in range(8)]
        barrier = threading.Barrier(8)
        answers: list[dict[str, Any]] = []

        def grab(engine: PostgresEngine, index: int) -> None:
            barrier.wait()
            answers.append(acquire(engine, "sem", f"o{index}", limit=4))

        threads = [threading.Thread(target=grab, args=(e, i)) for i, e in enumerate(engines)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        for engine in engines:
            engine.close()
        won = [a for a in answers if a["acquired"]]
        assert sorted(a["slot"] for a in won) == [0, 1, 2, 3], answers
        assert len({a["token"] for a in won}) == 4, answers

    def test_bodies_naming_the_same_keys_in_opposite_orders_finish(
            self, engine: PostgresEngine) -> None:
        keys = [f"k{i}" for i in range(100)]
        failures: list[BaseException] = []

        def bump(order: list[str]) -> None:
            try:
                for _ in range(20):
                    engine.call("kv", {"operations": [
                        {"op": "incr", "ns": "n", "key": k, "delta": 1, "forever": True}
                        for k in order]})
            except BaseException as exc:  # reported to the test below
                failures.append(exc)

        threads = [threading.Thread(target=bump, args=(order,))
                   for order in (keys, keys[::-1], keys, keys[::-1])]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        values = engine.call("kv", {"operations": [
            {"op": "getMany", "ns": "n", "keys": keys}]})["results"][0]["rows"]
        assert not failures, failures
        assert {row["value"] for row in values} == {80}, "every increment must land once"


class TestConnections:
    def test_a_lone_callers_calls_are_all_served_by_one_session(self, url: str) -> None:
        with contextlib.closing(PostgresEngine.from_url(url)) as engine:
            storage = engine.storage
            pids = set()
            for index in range(20):
                release(engine, "lone", acquire(engine, "lone", "a"))
                engine.call("kv", {"operations": [{"op": "get", "ns": "n", "key": str(index)}]})
                pids.add(_backend_pid(storage))
        assert len(pids) == 1, f"calls rotated through sessions {pids}"

    def test_the_kept_connection_goes_back_to_the_pool_now_and_then(
            self, url: str, monkeypatch: pytest.MonkeyPatch) -> None:
        """So the pool's own policies (max_lifetime, checks) still reach it."""
        monkeypatch.setattr(_postgres_pool, "_HOT_USES", 2)
        with contextlib.closing(PostgresEngine.from_url(url)) as engine:
            kept = []
            for _ in range(4):
                engine.call("locks", {"operations": [{"op": "get", "name": "n"}]})
                kept.append(engine.storage.sessions.has_hot)
        assert kept.count(True) == 2 and kept.count(False) == 2, kept

    def test_two_threads_on_a_one_connection_pool_never_connect_around_it(
            self, url: str) -> None:
        with contextlib.closing(PostgresEngine.from_url(url, pool_max_size=1)) as engine:
            acquire(engine, "warm", "a")
            storage = engine.storage
            real_connect, outside = storage.connect, []

            def counting_connect(**overrides: Any) -> Any:
                outside.append(overrides)
                return real_connect(**overrides)

            storage.connect = counting_connect  # type: ignore[method-assign]
            failures: list[BaseException] = []

            def calls(owner: str) -> None:
                try:
                    for _ in range(100):
                        release(engine, owner, acquire(engine, owner, owner))
                except BaseException as exc:  # reported below
                    failures.append(exc)

            threads = [threading.Thread(target=calls, args=(o,)) for o in ("a", "b")]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
        assert not failures, failures
        assert not outside, f"{len(outside)} calls gave up on the pool and connected directly"


class TestLifecycle:
    def test_a_forked_child_gets_its_own_sessions_and_leaves_the_parents_alone(
            self, url: str) -> None:
        with qs.Queen(url, pool_max_size=1) as q:
            storage = q.engine.storage  # type: ignore[attr-defined]
            lock = q.lock("parent", ttl="30s")
            assert lock.acquire()
            with q.engine.subscribe("parent"):
                pass  # a LISTEN session for the child to inherit too
            before = _backend_pid(storage)
            inherited = list(storage.connections)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
                pid = os.fork()
            if pid == 0:
                _child_after_fork(q, inherited)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, "the child's calls failed"
            after = _backend_pid(storage)
            assert before == after, "the parent's session was replaced: the child ended it"
            assert lock.held and q.locks.get("parent")["holders"][0]["owner"] == lock.owner

    def test_closing_the_client_leaves_no_thread_behind(self, url: str) -> None:
        before = set(threading.enumerate())
        q = qs.Queen(url)
        lock = q.lock("threads", ttl="30s")
        assert lock.acquire()
        with q.engine.subscribe("threads") as waiter:
            waiter.wait(0.01)
        q.close()
        deadline = time.monotonic() + 5
        while set(threading.enumerate()) - before and time.monotonic() < deadline:
            time.sleep(0.02)
        left = [t.name for t in set(threading.enumerate()) - before]
        assert not left, f"threads left behind: {left}"


def _backend_pid(storage: Any) -> int:
    """The server process behind the connection the storage's next call would use."""
    conn, pool = storage._checkout(_call(storage))
    try:
        return int(conn.execute("SELECT pg_backend_pid()").fetchone()[0])
    finally:
        storage.sessions.checkin(conn, pool)


def _call(engine_or_storage: Any) -> _postgres_storage.Call:
    """A call's attempts with the engine's timeout, for reaching the storage's steps directly."""
    storage = getattr(engine_or_storage, "storage", engine_or_storage)
    return _postgres_storage.Call(Footprint(), storage.where, storage.call_timeout)


def _child_after_fork(q: qs.Queen, inherited: list[Any]) -> None:
    """In a forked child: use the client, close the parent's copies, exit without cleanup."""
    code = 1
    try:
        holders = q.locks.get("parent")["holders"]
        for conn in inherited:
            conn.close()  # as garbage collection or exit would
        code = 0 if len(holders) == 1 else 2
    finally:
        os._exit(code)


class TestTheTestServer:
    def test_missing_binaries_skip_unless_ci_requires_postgres(
            self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(server_helper, "find_bin_dir", lambda: None)
        monkeypatch.delenv("QUEEN_SYNC_REQUIRE_PG", raising=False)
        with pytest.raises(pytest.skip.Exception):
            PgServer.start_new()
        monkeypatch.setenv("QUEEN_SYNC_REQUIRE_PG", "1")
        with pytest.raises(pytest.fail.Exception, match="QUEEN_SYNC_REQUIRE_PG"):
            PgServer.start_new()

    def test_the_server_runs_unprivileged_and_its_folder_goes_with_it(self) -> None:
        server = PgServer.start_new()
        pid_file = Path(server.data) / "postmaster.pid"
        try:
            assert pid_file.exists(), server.server_log()
            if os.geteuid() == 0:
                assert pid_file.stat().st_uid != 0, "the server runs as root"
        finally:
            server.destroy()
        assert not Path(server.root).exists(), "the server's folder was left behind"


class TestPlans:
    def test_a_body_mixing_a_release_with_an_acquire_commits_durably(self) -> None:
        release = {"op": "release", "name": "a", "token": 1}
        acquire = {"op": "acquire", "name": "b", "ttlSeconds": 5}
        assert lock_footprint([release]).only_releases is True
        for ops in ([release, acquire], [acquire, release], [acquire], []):
            assert lock_footprint(ops).only_releases is False, ops
        assert not kv_footprint([{"op": "delete", "ns": "n", "key": "k"}]).only_releases

    @pytest.mark.parametrize("body", [None, [], {"operations": "x"}, {"operations": [3, None]},
                                      {"operations": [{"op": "get", "ns": 1, "key": None}]}])
    def test_a_malformed_body_is_left_for_the_semantics_to_refuse(
            self, engine: PostgresEngine, body: Any) -> None:
        with pytest.raises((TypeError, ValueError)):
            engine.call("kv", body)


@pytest.fixture
def scripts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every body's script the engines send from now on, one entry per round trip.

    A pool's new connection PREPAREs its statements in the pool's own thread at any
    moment; that is not a body's trip, so it is left out.
    """
    return record_trips(monkeypatch)


def kv_table(url: str) -> str:
    return f'"{url.rsplit("schema=", 1)[1]}".kv'


class TestOneTripBodies:
    """A body reading only permits the client remembers, and deleting, is sent whole, guarded."""

    def test_a_release_after_the_clients_own_acquire_is_one_round_trip(
            self, url: str, engine: PostgresEngine, scripts: list[str]) -> None:
        held = acquire(engine, "one", "a")
        scripts.clear()
        assert release(engine, "one", held) == {"released": True}
        assert len(scripts) == 1, scripts
        assert "BEGIN" not in scripts[0], f"one implicit transaction: {scripts}"
        assert "qs_guarded_delete" in scripts[0], scripts
        with contextlib.closing(PostgresEngine.from_url(url)) as other:
            assert acquire(other, "one", "b")["acquired"], "the permit was not freed"

    def test_a_permit_taken_over_since_is_not_released_by_its_old_holder(
            self, server: PgServer, url: str, engine: PostgresEngine,
            scripts: list[str]) -> None:
        held = acquire(engine, "taken", "a")
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute(f"UPDATE {kv_table(url)} SET expires_at = 0")  # expired, unseen by a
        with contextlib.closing(PostgresEngine.from_url(url)) as other:
            successor = acquire(other, "taken", "b")
            scripts.clear()
            assert release(engine, "taken", held) == {"released": False, "reason": "lost"}
            assert len(scripts) == 3, f"a failed guard, then two trips: {scripts}"
            holders = other.call("locks", {"operations": [{"op": "get", "name": "taken"}]})
        assert [h["token"] for h in holders["results"][0]["holders"]] == [successor["token"]]

    @pytest.mark.parametrize("skew_ms", [600_000, -600_000])
    def test_expiry_of_a_remembered_row_is_judged_again_by_the_database_clock(
            self, engine: PostgresEngine, skew_ms: int) -> None:
        """Estimate the clock 10 min ahead: the permit looks expired; behind: it looks live."""
        held = acquire(engine, "judged", "a", ttl=1 if skew_ms < 0 else 30)
        if skew_ms < 0:
            time.sleep(1.1)  # the permit really expires, by the database's clock
        now = engine.storage._seen.estimated_now()
        assert now is not None, "the engine has read the database clock by now"
        engine.storage._seen.saw_clock((now + skew_ms, time.monotonic()))
        expected = {"released": True} if skew_ms > 0 else {"released": False, "reason": "lost"}
        assert release(engine, "judged", held) == expected

    def test_only_releases_take_one_trip_and_key_values_are_not_remembered(
            self, engine: PostgresEngine, scripts: list[str]) -> None:
        engine.call("kv", {"operations": [{"op": "put", "ns": "n", "key": "k", "value": 1,
                                           "forever": True}]})
        held = acquire(engine, "other", "a")
        scripts.clear()
        engine.call("kv", {"operations": [{"op": "get", "ns": "n", "key": "k"}]})
        engine.call("locks", {"operations": [{"op": "get", "name": "other"}]})
        check = {"op": "check", "ns": "queen-locks", "key": "other#0", "expect": held["token"]}
        engine.call("transaction", {"kv": [check]})
        # Two trips each for the key/value body and the transaction, one for the lone get.
        assert len(scripts) == 5 and "qs_guard" not in "".join(scripts), scripts
        assert list(engine.storage._seen._rows) == [("queen-locks", "other#0")], (
            "only lock permits are kept in memory")

    def test_whatever_a_guarded_body_concludes_short_of_its_guards_is_decided_again(
            self, engine: PostgresEngine) -> None:
        """An error or a rollback's answer drawn from remembered rows is never passed on."""
        guarded = GuardedTxn(engine.storage.sql, set(), engine.storage._seen, 0)
        failures = engine.storage._body_failures(_call(engine), None,  # type: ignore[arg-type]
                                                 [guarded])
        with pytest.raises(_postgres_storage.Conflict, match="two-trip path"), failures:
            raise ValueError("concluded from remembered rows")

    def test_a_connection_the_server_has_closed_gets_no_one_trip_release(
            self, server: PgServer) -> None:
        app = "closed_" + secrets.token_hex(4)
        url = f"{server.url}?application_name={app}"
        with contextlib.closing(PostgresEngine.from_url(url)) as engine:
            held = acquire(engine, "closed", "a")
            conns = [c for c in engine.storage.connections if not c.closed]
            assert server.terminate_backends(app) >= 1
            deadline = time.monotonic() + 5
            while not all(_postgres_storage._has_input(c) for c in conns):
                assert time.monotonic() < deadline, "the server never closed the sessions"
                time.sleep(0.01)
            assert release(engine, "closed", held) == {"released": True}


class TestReleasingWithThePreviousToken:
    """A renew applied but unanswered leaves the owner on its previous token."""

    @staticmethod
    def _renewed_unseen(engine: Any, name: str) -> dict[str, Any]:
        held = acquire(engine, name, "a")
        renew = {"op": "renew", "name": name, "token": held["token"], "slot": 0,
                 "owner": "a", "ttlSeconds": 30}
        assert engine.call("locks", {"operations": [renew]})["results"][0]["renewed"]
        return held  # the answer the owner saw last: the previous token

    def test_the_one_trip_release_answers_as_the_two_trip_path_and_the_reference_do(
            self, url: str, engine: PostgresEngine, scripts: list[str],
            tmp_path: Path) -> None:
        with qs.Queen(f"sqlite://{tmp_path / 'reference.db'}", renew_thread=False) as reference:
            expected = release(reference.engine, "r", self._renewed_unseen(reference.engine, "r"))
        previous = self._renewed_unseen(engine, "one")
        scripts.clear()
        one_trip = release(engine, "one", previous)
        assert any("qs_guarded_delete" in s for s in scripts), f"not the one-trip path: {scripts}"
        assert one_trip == expected, f"one trip {one_trip}, the reference engine {expected}"
        previous = self._renewed_unseen(engine, "two")
        with contextlib.closing(PostgresEngine.from_url(url)) as forgetful:
            scripts.clear()
            two_trip = release(forgetful, "two", previous)  # remembers nothing: two trips
            assert any(s.startswith("BEGIN") for s in scripts), f"not two trips: {scripts}"
        assert two_trip == expected, f"two trips {two_trip}, the reference engine {expected}"
        for name in ("one", "two"):
            state = engine.call("locks", {"operations": [{"op": "get", "name": name}]})
            assert state["results"][0]["held"] is not expected["released"], (name, state)

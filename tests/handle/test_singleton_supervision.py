"""``@singleton_job(..., supervision=...)``: status records in KV, and nothing when it is off."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator, Mapping

import pytest

import queen_sync as qs
from queen_sync._engines import engine_from_url
from queen_sync._engines.base import Engine, Waiter
from queen_sync._front import supervision as _supervision


class CountingEngine(Engine):
    """Passes every call to a real engine and remembers the route and op of each."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.capabilities = inner.capabilities
        self.calls: list[tuple[str, list[str]]] = []

    @property
    def url(self) -> str:
        return self.inner.url

    def call(self, route: str, body: Mapping[str, Any]) -> dict[str, Any]:
        ops = [op.get("op", "?") for op in body.get("operations", body.get("kv", []))]
        self.calls.append((route, ops))
        return self.inner.call(route, body)

    @contextlib.contextmanager
    def subscribe(self, name: str) -> Iterator[Waiter]:
        with self.inner.subscribe(name) as waiter:
            yield waiter

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
def counted(sqlite_url: str) -> Iterator[tuple[qs.Queen, CountingEngine]]:
    engine = CountingEngine(engine_from_url(sqlite_url, {}))
    with qs.Queen(engine=engine) as q:
        yield q, engine


def _records(q: qs.Queen, group: str) -> list[dict[str, Any]]:
    return [row["value"] for row in q.kv.list_all(_supervision.NAMESPACE, f"{group}/")]


class TestOff:
    def test_without_supervision_there_is_no_extra_thread_and_no_kv_traffic(
            self, counted: tuple[qs.Queen, CountingEngine]) -> None:
        q, engine = counted
        seen: list[set[str]] = []

        @qs.singleton_job("quiet", ttl="30s", client=q)
        def quiet() -> None:
            seen.append({t.name for t in threading.enumerate()})

        quiet()
        assert not any("supervisor" in name for name in seen[0]), seen
        assert [route for route, _ in engine.calls] == ["locks", "locks"], engine.calls
        assert [ops for _, ops in engine.calls] == [["acquire"], ["release"]], engine.calls


class TestOn:
    def test_a_running_job_publishes_its_status_and_a_final_stopped_record(
            self, counted: tuple[qs.Queen, CountingEngine]) -> None:
        q, _ = counted
        inside: list[list[dict[str, Any]]] = []

        @qs.singleton_job("etl", ttl="30s", client=q, supervision="nightly")
        def etl() -> None:
            deadline = time.monotonic() + 5
            while not _records(q, "nightly") and time.monotonic() < deadline:
                time.sleep(0.01)
            inside.append(_records(q, "nightly"))

        etl()
        after = _records(q, "nightly")
        running, stopped = inside[0][0], after[0]
        assert running["state"] == "running" and running["job"] == "etl", running
        assert {"instance", "host", "pid", "started", "last_completed", "runs_ok",
                "runs_failed"} <= set(running), running
        assert stopped["state"] == "stopped" and stopped["runs_ok"] == 1, stopped
        assert stopped["last_completed"] is not None and stopped["runs_failed"] == 0, stopped
        assert stopped["instance"] == running["instance"], "one instance id per process"

    def test_a_failed_run_is_counted(self, counted: tuple[qs.Queen, CountingEngine]) -> None:
        q, _ = counted

        @qs.singleton_job("etl", ttl="30s", client=q, supervision="nightly")
        def etl() -> None:
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError):
            etl()
        (record,) = _records(q, "nightly")
        assert record["runs_failed"] == 1 and record["runs_ok"] == 0, record

    def test_the_status_is_published_again_every_period_with_a_lifetime(
            self, counted: tuple[qs.Queen, CountingEngine],
            monkeypatch: pytest.MonkeyPatch) -> None:
        q, engine = counted
        monkeypatch.setattr(_supervision, "PUBLISH_EVERY", 0.05)

        @qs.singleton_job("etl", ttl="30s", client=q, supervision="nightly")
        def etl() -> None:
            time.sleep(0.3)

        etl()
        puts = [ops for route, ops in engine.calls if route == "kv" and ops == ["put"]]
        (key,) = [row["key"] for row in q.kv.list_all(_supervision.NAMESPACE, "nightly/")]
        expires = q.kv.get(_supervision.NAMESPACE, key)["expiresAt"]
        assert len(puts) >= 4, f"several running records, then stopped: {len(puts)} puts"
        assert expires is not None, "a record expires when its publisher vanishes"

    def test_a_failing_engine_never_reaches_the_job(self, counted: tuple[qs.Queen,
                                                                        CountingEngine],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
        q, _ = counted

        def broken(*_: Any, **__: Any) -> Any:
            raise qs.EngineUnavailableError("down")

        monkeypatch.setattr(q.kv, "put", broken)

        @qs.singleton_job("etl", ttl="30s", client=q, supervision="nightly")
        def etl() -> str:
            return "ran"

        assert etl() == "ran", "supervision is best effort"

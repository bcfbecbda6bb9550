"""``@singleton_job(..., supervision=...)``: status in the broker's supervisor contract.

The records are read back here the way the broker reads them: the ``head`` row of
``<group>/<instance>`` names a write and a chunk count, every ``chunk/NNNN`` row of
that write carries base64 of a slice of the JSON document, and the joined document
is a ``queen.consumer.status/v1``. The contract's names are spelled out literally,
so a change to the module cannot quietly change what the broker sees.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from typing import Any, Iterator, Mapping

import pytest

import queen_sync as qs
from queen_sync._front import supervision as _supervision
from queen_sync.testing import FaultyEngine, LocalBroker

NS = "queen-supervisor"
HEAD_FORMAT = "queen.supervisor.remote-status/v1"
SCHEMA = "queen.consumer.status/v1"


class CallLog:
    """The route and op names of every call made through a FaultyEngine, in order."""

    def __init__(self, engine: FaultyEngine) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        engine.hook_next(None, hook=self._note)

    def _note(self, route: str, body: Mapping[str, Any]) -> None:
        ops = [op.get("op", "?") for op in body.get("operations", body.get("kv", []))]
        self.calls.append((route, ops))


@pytest.fixture
def counted(sqlite_faults: FaultyEngine) -> Iterator[tuple[qs.Queen, CallLog]]:
    log = CallLog(sqlite_faults)
    with qs.Queen(engine=sqlite_faults) as q:
        yield q, log


def read_statuses(q: qs.Queen, group: str) -> dict[str, dict[str, Any]]:
    """Every instance's status document under ``group``, read as the broker's contract says."""
    heads = [row["key"] for row in q.kv.list_all(NS, f"{group}/")
             if row["key"].endswith("/head")]
    return {key.split("/")[1]: _read_one(q, key[:-len("head")]) for key in heads}


def _read_one(q: qs.Queen, slot: str) -> dict[str, Any]:
    head = q.kv.get(NS, slot + "head")
    assert head and head["expiresAt"] is not None, f"a head row with a lifetime: {head}"
    value = head["value"]
    assert value["format"] == HEAD_FORMAT, value
    assert isinstance(value["chunks"], int) and value["chunks"] >= 1, value
    pieces = []
    for index in range(value["chunks"]):
        chunk = q.kv.get(NS, f"{slot}chunk/{index:04d}")
        assert chunk and chunk["expiresAt"] is not None, f"chunk {index} is there: {chunk}"
        body = chunk["value"]
        assert body["write"] == value["write"] and body["index"] == index, (value, body)
        pieces.append(base64.b64decode(body["data"], validate=True))
    raw = b"".join(pieces)
    assert len(raw) == value["bytes"], f"head says {value['bytes']} bytes, chunks hold {len(raw)}"
    document: dict[str, Any] = json.loads(raw.decode("utf-8"))
    return document


def _wait_for(predicate: Any, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)


class TestOff:
    def test_without_supervision_there_is_no_extra_thread_and_no_kv_traffic(
            self, counted: tuple[qs.Queen, CallLog]) -> None:
        q, engine = counted
        seen: list[set[str]] = []

        @qs.singleton_job("quiet", ttl="30s", client=q)
        def quiet() -> None:
            seen.append({t.name for t in threading.enumerate()})

        quiet()
        assert not any("supervisor" in name for name in seen[0]), seen
        assert [route for route, _ in engine.calls] == ["locks", "locks"], engine.calls
        assert [ops for _, ops in engine.calls] == [["acquire"], ["release"]], engine.calls


class TestTheBrokersContract:
    """On every engine: what a finished and a running job leave for the broker to read."""

    @pytest.mark.parametrize("chunk_bytes", [None, 64], ids=["one-chunk", "many-chunks"])
    def test_a_finished_job_leaves_a_stopped_status_the_broker_can_read(
            self, q: qs.Queen, chunk_bytes: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        if chunk_bytes is not None:
            monkeypatch.setattr(_supervision, "CHUNK_BYTES", chunk_bytes)

        @qs.singleton_job("etl-nightly", ttl="30s", client=q, supervision="nightly")
        def etl() -> str:
            return "ran"

        before = int(time.time())
        assert etl() == "ran"
        ((instance, doc),) = read_statuses(q, "nightly").items()
        assert doc["schema"] == SCHEMA and doc["instance_id"] == instance, doc
        assert doc["engine"] == "python" and doc["execution_model"] == "singleton-job", doc
        assert doc["state"] == "stopped" and doc["configuration"] == {"heartbeat_timeout": 30}
        assert isinstance(doc["hostname"], str) and isinstance(doc["pid"], int), doc
        assert before <= doc["started_at_epoch"] <= doc["updated_at_epoch"], doc
        assert isinstance(doc["uptime_seconds"], int) and doc["uptime_seconds"] >= 0, doc
        (pool,) = doc["pool_status"]
        assert pool == {
            "name": "singleton", "queue": None, "namespace": None, "task": "etl-nightly",
            "consumer_group": None, "desired": 1, "running": 0, "busy": 0, "completed": 1,
            "failed": 0, "last_completed_at_epoch": pool["last_completed_at_epoch"],
            "oldest_inflight_seconds": None}, pool
        assert before <= pool["last_completed_at_epoch"] <= doc["updated_at_epoch"], pool

    def test_while_the_job_runs_its_status_says_running_and_busy(self, q: qs.Queen) -> None:
        inside: list[dict[str, dict[str, Any]]] = []

        @qs.singleton_job("etl", ttl="30s", client=q, supervision="nightly")
        def etl() -> None:
            _wait_for(lambda: read_statuses(q, "nightly"))
            inside.append(read_statuses(q, "nightly"))

        etl()
        ((instance, running),) = inside[0].items()
        (pool,) = running["pool_status"]
        assert running["state"] == "running", running
        assert (pool["running"], pool["busy"], pool["completed"]) == (1, 1, 0), pool
        assert isinstance(pool["oldest_inflight_seconds"], int), pool
        assert list(read_statuses(q, "nightly")) == [instance], "one instance id per process"

    def test_every_record_lives_sixty_seconds(self, q: qs.Queen) -> None:
        @qs.singleton_job("etl", ttl="30s", client=q, supervision="nightly")
        def etl() -> None:
            pass

        etl()
        rows = q.kv.list_all(NS, "nightly/")
        assert {row["key"].split("/", 2)[2] for row in rows} == {"head", "chunk/0000"}, rows
        for row in rows:
            got = q.kv.get(NS, row["key"])
            lifetime = (got["expiresAt"] - got["updatedAt"]) / 1000
            assert lifetime == pytest.approx(60, abs=1), f"{row['key']}: {lifetime} s"


class TestCounting:
    def test_runs_are_counted_on_one_instance_and_a_failed_run_as_failed(
            self, counted: tuple[qs.Queen, CallLog]) -> None:
        q, _ = counted
        fail = [False, True]

        @qs.singleton_job("etl", ttl="30s", client=q, supervision="nightly")
        def etl() -> None:
            if fail.pop(0):
                raise RuntimeError("boom")

        etl()
        with pytest.raises(RuntimeError):
            etl()
        ((_, doc),) = read_statuses(q, "nightly").items()
        (pool,) = doc["pool_status"]
        assert (pool["completed"], pool["failed"]) == (1, 1), pool
        assert doc["state"] == "stopped" and pool["running"] == 0, doc

    def test_the_status_is_published_again_every_period_in_one_batch(
            self, counted: tuple[qs.Queen, CallLog],
            monkeypatch: pytest.MonkeyPatch) -> None:
        q, engine = counted
        monkeypatch.setattr(_supervision, "PUBLISH_EVERY", 0.05)

        @qs.singleton_job("etl", ttl="30s", client=q, supervision="nightly")
        def etl() -> None:
            time.sleep(0.3)

        etl()
        writes = [ops for route, ops in engine.calls if route == "kv" and "put" in ops]
        assert len(writes) >= 4, f"several running records, then stopped: {len(writes)} writes"
        assert all(ops == ["put", "put"] for ops in writes), f"head and chunk together: {writes}"


class TestGroupNames:
    @pytest.mark.parametrize("group", [
        "", "coordination", "../other", "a/b", "trailing\n", "-lead", ".hidden", "x" * 256,
        "café", "with space"])
    def test_a_group_the_broker_refuses_fails_at_decoration(self, group: str) -> None:
        with pytest.raises(ValueError, match="supervision group"):
            qs.singleton_job("job", supervision=group)

    def test_a_group_that_is_not_text_is_a_type_error(self) -> None:
        with pytest.raises(TypeError, match="supervision"):
            qs.singleton_job("job", supervision=5)  # type: ignore[call-overload]  # the point

    @pytest.mark.parametrize("group", ["a", "Billing-prod.eu_1", "9" + "x" * 254,
                                       "coordination2"])
    def test_a_group_the_broker_accepts_is_accepted(self, group: str) -> None:
        qs.singleton_job("job", supervision=group)


class TestFailures:
    def test_a_failing_engine_never_reaches_the_job_and_is_logged_once(
            self, counted: tuple[qs.Queen, CallLog], monkeypatch: pytest.MonkeyPatch,
            caplog: pytest.LogCaptureFixture) -> None:
        q, _ = counted
        monkeypatch.setattr(_supervision, "PUBLISH_EVERY", 0.02)

        def broken(*_: Any, **__: Any) -> Any:
            raise qs.EngineUnavailableError("down")

        monkeypatch.setattr(q.kv, "batch", broken)

        @qs.singleton_job("etl", ttl="30s", client=q, supervision="nightly")
        def etl() -> str:
            time.sleep(0.15)
            return "ran"

        with caplog.at_level(logging.DEBUG, logger="queen_sync"):
            assert etl() == "ran", "supervision is best effort"
            assert etl() == "ran", "and stays so"
        warned = [r for r in caplog.records if "supervision" in r.getMessage()
                  and r.levelno >= logging.WARNING]
        assert len(warned) == 1, [r.getMessage() for r in warned]

    def test_a_stalled_engine_holds_the_job_up_at_most_two_seconds(self, tmp_path: Any) -> None:
        broker = LocalBroker(str(tmp_path / "broker.db")).start()
        try:
            with qs.Queen(broker.url, timeout=10) as q:
                @qs.singleton_job("etl", ttl="30s", client=q, supervision="nightly")
                def etl() -> str:
                    return "ran"

                broker.faults.delay_next(5, seconds=3, route="kv")
                started = time.monotonic()
                assert etl() == "ran"
                took = time.monotonic() - started
        finally:
            broker.close()
        assert took < 2.6, f"the job waited {took:.2f} s for its status writes"

    def test_a_write_still_in_flight_is_never_overtaken_by_the_next(
            self, counted: tuple[qs.Queen, CallLog], monkeypatch: pytest.MonkeyPatch,
            caplog: pytest.LogCaptureFixture) -> None:
        q, _ = counted
        monkeypatch.setattr(_supervision, "DEADLINE", 0.05)
        release = threading.Event()
        sent: list[list[dict[str, Any]]] = []
        real_batch = q.kv.batch

        def stalled(ops: list[dict[str, Any]]) -> Any:
            sent.append(ops)
            release.wait(5)
            return real_batch(ops)

        monkeypatch.setattr(q.kv, "batch", stalled)
        supervisor = _supervision.Supervisor("nightly", "etl")
        with caplog.at_level(logging.DEBUG, logger="queen_sync"):
            started = time.monotonic()
            supervisor.publish(q, "running")
            supervisor.publish(q, "stopped")
            took = time.monotonic() - started
        release.set()
        _wait_for(lambda: read_statuses(q, "nightly"))
        ((_, doc),) = read_statuses(q, "nightly").items()
        messages = " | ".join(r.getMessage() for r in caplog.records)
        assert took < 1, f"each write is waited for at most the deadline: {took:.2f} s"
        assert len(sent) == 1, f"the second write waits its turn by skipping: {len(sent)} sent"
        assert "longer than 0.05 s" in messages and "still in flight" in messages, messages
        assert doc["state"] == "running", "the stalled write landed, nothing overtook it"

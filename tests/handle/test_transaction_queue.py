"""Queue riders in guarded transactions: pushes, acks and timers beside the guards and KV ops.

The bodies are pinned to the bytes the official Queen client sends for the same bundle
(its JSON transaction body); ``failedIndex`` counts every pushed item and every ack
before the KV rider, whose first ops are the guards. The test brokers keep what they
were sent, so a test can show that a lost guard pushed nothing.
"""

from __future__ import annotations

import base64
import json
import re
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Iterator, Mapping

import pytest
from engine_factories import ENGINE_FACTORIES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import queen_sync as qs
from queen_sync._engines.http import encode_body
from queen_sync.testing import FakeBroker, FaultyEngine, LocalBroker

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@pytest.fixture
def fq(fake: FakeBroker) -> Iterator[qs.Queen]:
    """A client of ``fake`` (quick to give up, as ``fake.client()``) over a FaultyEngine."""
    engine = FaultyEngine(fake.url, timeout=(1.0, 2.0), backoff=0.01)
    with qs.Queen(engine=engine, renew_thread=False) as client:
        yield client


@pytest.fixture(params=["sqlite", "postgres"])
def embedded(request: pytest.FixtureRequest) -> Iterator[qs.Queen]:
    engine = FaultyEngine(ENGINE_FACTORIES[request.param](request))
    with qs.Queen(engine=engine, renew_thread=False) as client:
        yield client


def faults_of(q: qs.Queen) -> FaultyEngine:
    assert isinstance(q.engine, FaultyEngine), "the fixture builds the client over one"
    return q.engine


def capture(q: qs.Queen) -> list[dict[str, Any]]:
    """Every transaction body ``q`` sends from now on (as JSON carries it)."""
    sent: list[dict[str, Any]] = []

    def recording(route: str, body: Mapping[str, Any]) -> None:
        sent.append(json.loads(json.dumps(body)))

    faults_of(q).hook_next(None, hook=recording, route="transaction")
    return sent


def wire(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def b64_json(value: Any) -> str:
    """A timer payload as the official client encodes it: default ``json.dumps``, base64."""
    return base64.b64encode(json.dumps(value).encode("utf-8")).decode("ascii")


class TestTheBundleOnTheWire:
    def test_a_guarded_bundle_goes_out_in_the_official_clients_shape(
        self, fake: FakeBroker, fq: qs.Queen
    ) -> None:
        lock = fq.lock("daily-report", ttl=30)
        assert lock.acquire()
        sent = capture(fq)
        message = {"transactionId": "m-1", "partitionId": "p-9", "leaseId": "lease-1"}
        answer = (fq.transaction().guard(lock)
                  .queue("reports").partition("eu").push([
                      {"data": {"rows": 42}, "transactionId": "t-1"},
                      {"payload": None},
                      {"rows": 7}])
                  .ack(message, status="failed", context={"consumer_group": "billing"})
                  .kv.put("reports", "2026-11-30", {"rows": 42}, ttl_seconds=60)
                  .timer("reminders").key("report-due").payload({"day": "2026-11-30"})
                  .after_ms(250).txn("tx-1").schedule()
                  .commit())
        assert answer, answer
        minted = [item["transactionId"] for item in sent[0]["operations"][0]["items"][1:]]
        assert all(UUID.fullmatch(m) for m in minted), f"minted ids must be UUIDs: {minted}"
        expected = {
            "operations": [
                {"type": "push", "items": [
                    {"queue": "reports", "payload": {"rows": 42}, "transactionId": "t-1",
                     "partition": "eu"},
                    {"queue": "reports", "payload": None, "transactionId": minted[0],
                     "partition": "eu"},
                    {"queue": "reports", "payload": {"rows": 7}, "transactionId": minted[1],
                     "partition": "eu"}]},
                {"type": "ack", "transactionId": "m-1", "partitionId": "p-9",
                 "status": "failed", "consumerGroup": "billing", "leaseId": "lease-1"}],
            "requiredLeases": ["lease-1"],
            "kv": [lock.guard(),
                   {"op": "put", "ns": "reports", "key": "2026-11-30", "value": {"rows": 42},
                    "ttlSeconds": 60}],
            "timers": [{"op": "schedule", "queue": "reminders", "timerKey": "report-due",
                        "payload": b64_json({"day": "2026-11-30"}), "delayMs": 250,
                        "txn": "tx-1"}],
        }
        got = encode_body("transaction", sent[0])
        assert got == wire(expected), f"the bytes sent:\n{got!r}\nexpected:\n{wire(expected)!r}"

    def test_reads_in_a_bundle_go_out_in_the_official_clients_shape(
        self, fake: FakeBroker, fq: qs.Queen
    ) -> None:
        lock = fq.lock("daily-report", ttl=30)
        assert lock.acquire()
        sent = capture(fq)
        answer = (fq.transaction().guard(lock)
                  .kv.get("reports", "2026-11-30")
                  .kv.get_many("reports", ["2026-11-29", "2026-11-30"])
                  .queue("reports").push({"data": 1, "transactionId": "t-1"})
                  .commit())
        assert answer, answer
        expected = {
            "operations": [{"type": "push", "items": [
                {"queue": "reports", "payload": 1, "transactionId": "t-1"}]}],
            "requiredLeases": [],
            "kv": [lock.guard(),
                   {"op": "get", "ns": "reports", "key": "2026-11-30"},
                   {"op": "getMany", "ns": "reports", "keys": ["2026-11-29", "2026-11-30"]}],
        }
        got = encode_body("transaction", sent[0])
        assert got == wire(expected), f"the bytes sent:\n{got!r}\nexpected:\n{wire(expected)!r}"
        flat = [r.get("type") or ("read" if "found" in r or "rows" in r else "guard")
                for r in answer["results"]]
        assert flat == ["push", "guard", "read", "read"], f"reads answer after the push: {answer}"

    def test_a_bundle_without_guards_or_kv_ops_sends_no_kv_key(self, fq: qs.Queen) -> None:
        sent = capture(fq)
        assert fq.transaction().queue("reports").push({"transactionId": "t-1",
                                                       "data": 1}).commit()
        expected = {"operations": [{"type": "push", "items": [
            {"queue": "reports", "payload": 1, "transactionId": "t-1"}]}], "requiredLeases": []}
        assert encode_body("transaction", sent[0]) == wire(expected), sent[0]

    def test_the_official_keywords_name_the_queue_and_partition_of_a_push(
            self, fq: qs.Queen) -> None:
        sent = capture(fq)
        assert (fq.transaction().queue(queue_name="reports").partition(partition_key="eu")
                .push({"transactionId": "t-1", "data": 1}).commit())
        item = sent[0]["operations"][0]["items"][0]
        assert item["queue"] == "reports" and item["partition"] == "eu", item

    def test_a_trace_id_travels_only_when_it_is_a_uuid4(self, fq: qs.Queen) -> None:
        sent = capture(fq)
        trace = "0b7e2a36-5c4d-4f3e-9a1b-2c3d4e5f6a7b"
        assert (fq.transaction().queue("q")
                .push([{"data": 1, "transactionId": "a", "traceId": trace},
                       {"data": 2, "transactionId": "b", "traceId": "not-a-uuid"}]).commit())
        items = sent[0]["operations"][0]["items"]
        assert items[0]["traceId"] == trace and "traceId" not in items[1], items

    def test_rescheduling_and_cancelling_timers_ride_after_the_kv_ops(
        self, fake: FakeBroker, fq: qs.Queen
    ) -> None:
        sent = capture(fq)
        assert (fq.transaction().timer("t").key("k").payload("hi", zstd=True)
                .after(timedelta(seconds=1.5)).partition("p").txn("x").reschedule()
                .timer("t").key("gone").cancel()
                .commit())
        assert sent[0]["timers"] == [
            {"op": "reschedule", "queue": "t", "timerKey": "k", "payload": b64_json("hi"),
             "delayMs": 1500, "txn": "x", "partition": "p", "payloadZstd": True},
            {"op": "cancel", "queue": "t", "timerKey": "gone"}], sent[0]
        assert "kv" not in sent[0], "no kv rider was asked for"
        assert [t["timerKey"] for t in fake.timers("t")] == ["k"], fake.timers("t")


class TestTheFlatIndex:
    def test_a_lost_guard_after_pushes_and_acks_is_named_at_its_flat_index(
        self, fake: FakeBroker, fq: qs.Queen
    ) -> None:
        lock = fq.lock("job", ttl=30, auto_renew=False)
        assert lock.acquire()
        fq.kv.delete("queen-locks", "job#0")  # an operator's break-glass
        assert fq.locks.acquire("job", ttl_seconds=30, owner="intruder")
        answer = (fq.transaction().guard(lock)
                  .queue("reports").push([{"data": 1}, {"data": 2}, {"data": 3}])
                  .ack({"transactionId": "m", "partitionId": "p"})
                  .commit())
        assert not answer and answer["reason"] == "kv_precondition", answer
        assert answer["failedIndex"] == 4, f"3 items + 1 ack come before the guard: {answer}"
        assert lock.lost.is_set() and lock.lost_reason == "guard", repr(lock)
        assert fake.pushed() == [] and fake.acked() == [], "a lost guard pushes and acks nothing"

    def test_a_guard_lost_only_to_its_own_renewal_is_resent_behind_pushes(
        self, fake: FakeBroker, fq: qs.Queen
    ) -> None:
        lock = fq.lock("job", ttl=30, auto_renew=False)
        assert lock.acquire()
        expects: list[int] = []

        def renew_first(route: str, body: Mapping[str, Any]) -> None:
            if not expects:
                assert lock.renew(), "the renew underneath must succeed"
            expects.append(body["kv"][0]["expect"])

        faults_of(fq).hook_next(None, hook=renew_first, route="transaction")
        answer = fq.transaction().guard(lock).queue("reports").push([{"data": 1},
                                                                     {"data": 2}]).commit()
        assert answer, f"the bundle must commit on the renewed token: {answer}"
        assert len(expects) == 2 and expects[1] > expects[0], f"one resend: {expects}"
        assert not lock.lost.is_set(), "losing to our own renewal is not a loss"
        assert [m["payload"] for m in fake.pushed("reports")] == [1, 2], "pushed exactly once"

    @settings(max_examples=25, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(items=st.lists(st.integers(0, 3), max_size=3), acks=st.integers(0, 2),
           kv_before=st.integers(0, 2), reads=st.integers(0, 2), data=st.data())
    def test_a_lost_required_op_is_named_at_its_flat_index_and_nothing_lands(
        self, fake: FakeBroker, fq: qs.Queen, items: list[int], acks: int, kv_before: int,
        reads: int, data: st.DataObject
    ) -> None:
        fq.kv.put("gate", "taken", "x", forever=True)
        txn = fq.transaction()
        for count in items:
            txn.queue("q").push([{"data": n} for n in range(count)])
        for n in range(acks):
            txn.ack({"transactionId": f"m{n}", "partitionId": "p"})
        for n in range(kv_before):
            txn.kv.put("out", f"k{n}", n, forever=True)
        for n in range(reads):  # a read never fails a bundle, but it counts as one op
            if n % 2:
                txn.kv.get("out", f"k{n}")
            else:
                txn.kv.get_many("out", ["k0", "k1"])
        txn.kv.put_if_absent("gate", "taken", "y", forever=True, required=True)
        txn.kv.put("out", "after", 1, forever=True)
        if data.draw(st.booleans(), label="a timer rides too"):
            txn.timer("t").key("k").payload(1).after_ms(10).schedule()
        answer = txn.commit()
        expected = sum(items) + acks + kv_before + reads
        assert not answer and answer["failedIndex"] == expected, (expected, answer)
        assert fake.pushed() == [] and fake.acked() == [] and fake.timers() == [], \
            "a rolled-back bundle pushes, acks and schedules nothing"
        assert not fq.kv.get("out", "after") and not fq.kv.get("out", "k0"), "no kv write"


class TestTheHeadlineOverARealSocket:
    def test_the_guarded_push_commits_to_a_local_broker(self) -> None:
        with LocalBroker() as broker, broker.client() as q:
            lock = q.lock("daily-report", ttl=30)
            assert lock.acquire()
            done = (q.transaction().guard(lock)
                    .queue("reports").push([{"data": {"day": 1}}, {"data": {"day": 2}}])
                    .commit())
            assert done and done["success"] is True, done
            assert [m["payload"] for m in broker.pushed("reports")] == [{"day": 1}, {"day": 2}]
            assert broker.pushed("elsewhere") == [], "pushed() filters by queue"
            lock.release()

    def test_a_guarded_push_is_refused_and_pushes_nothing_once_the_lock_was_taken_over(
        self
    ) -> None:
        with LocalBroker() as broker, broker.client() as q:
            old = q.lock("daily-report", ttl=30)
            assert old.acquire()
            with broker.paused(old):
                new = q.lock("daily-report", ttl=30)
                assert new.acquire(), "the paused holder's permit is over on the broker"
                late = q.transaction().guard(old).queue("reports").push([{"data": 1}]).commit()
                assert not late and late["reason"] == "kv_precondition", late
                assert late["failedIndex"] == 1, f"one item before the guard: {late}"
            assert broker.pushed("reports") == [], "the superseded holder pushed nothing"
            assert old.lost.wait(2) and old.lost_reason in ("guard", "renew"), repr(old)
            assert q.transaction().guard(new).queue("reports").push([{"data": 2}]).commit()
            assert [m["payload"] for m in broker.pushed("reports")] == [2]
        broker.assert_no_stale_writes()


class TestTheHttpEngineResendsNoPush:
    def test_a_reset_after_the_broker_applied_the_bundle_is_not_resent(
        self, fake: FakeBroker, fq: qs.Queen
    ) -> None:
        fake.faults.reset_next(route="transaction", applied=True)
        with pytest.raises(qs.EngineUnavailableError):
            fq.transaction().queue("reports").push([{"data": 1}]).commit()
        assert len(fake.pushed("reports")) == 1, "the broker applied it once; no resend"

    def test_a_refused_connection_is_resent_and_pushes_once(
        self, fake: FakeBroker, fq: qs.Queen
    ) -> None:
        fake.faults.refuse_next(route="transaction")
        assert fq.transaction().queue("reports").push([{"data": 1}]).commit()
        assert len(fake.pushed("reports")) == 1, "provably unsent, so resent once"

    def test_a_message_sent_again_with_its_transaction_id_is_stored_once(
        self, fake: FakeBroker, fq: qs.Queen
    ) -> None:
        first = fq.transaction().queue("q").push({"data": 1, "transactionId": "t"}).commit()
        again = fq.transaction().queue("q").push({"data": 1, "transactionId": "t"}).commit()
        assert [r["status"] for r in first["results"] + again["results"]] == \
            ["queued", "duplicate"], (first, again)
        assert len(fake.pushed("q")) == 1, fake.pushed("q")


class TestTheTestBrokersCheckWhatTheyAreSent:
    @pytest.mark.parametrize("operation", [
        {"type": "push", "items": [{"payload": 1, "transactionId": "t"}]},
        {"type": "push", "items": [{"queue": "q", "transactionId": "t"}]},
        {"type": "ack", "transactionId": "t", "status": "completed"},
        {"type": "pop"},
    ], ids=["push-without-queue", "push-without-payload", "ack-without-partition",
            "unknown-type"])
    def test_a_malformed_queue_operation_is_a_400_and_commits_nothing(
        self, fake: FakeBroker, fq: qs.Queen, operation: dict[str, Any]
    ) -> None:
        body = {"operations": [operation], "requiredLeases": [],
                "kv": [{"op": "put", "ns": "out", "key": "k", "value": 1, "forever": True}]}
        with pytest.raises(qs.QueenHttpError) as caught:
            fq.engine.call("transaction", body)
        assert caught.value.status == 400, repr(caught.value)
        assert not fq.kv.get("out", "k") and fake.pushed() == [], "nothing of it landed"


class TestTheEmbeddedEnginesRefuseQueueRiders:
    @pytest.mark.parametrize("rider", [
        lambda t: t.queue("reports"), lambda t: t.ack({"transactionId": "m", "partitionId": "p"}),
        lambda t: t.timer("reminders"),
    ], ids=["queue", "ack", "timer"])
    def test_a_queue_rider_raises_naming_the_engine(
        self, embedded: qs.Queen, rider: Callable[[qs.Transaction], Any]
    ) -> None:
        with pytest.raises(qs.UnsupportedOperationError) as caught:
            rider(embedded.transaction())
        assert caught.value.capability == "queue_operations", repr(caught.value)
        assert embedded.engine.kind in str(caught.value), f"names the engine: {caught.value}"

    def test_a_timers_rider_sent_raw_is_refused_and_writes_nothing(
        self, embedded: qs.Queen
    ) -> None:
        body = {"operations": [], "requiredLeases": [],
                "kv": [{"op": "put", "ns": "out", "key": "k", "value": 1, "forever": True}],
                "timers": [{"op": "cancel", "queue": "t", "timerKey": "k"}]}
        with pytest.raises(qs.UnsupportedOperationError):
            embedded.engine.call("transaction", body)
        assert not embedded.kv.get("out", "k"), "the kv rider must not commit without its timer"


class TestCommit:
    def test_committing_an_empty_bundle_raises_before_sending(self, embedded: qs.Queen) -> None:
        sent = capture(embedded)
        with pytest.raises(qs.RequestError) as caught:
            embedded.transaction().commit()
        assert caught.value.code == "empty_transaction" and sent == [], repr(caught.value)

    def test_a_failure_other_than_a_lost_precondition_raises(self, fake: FakeBroker,
                                                             fq: qs.Queen) -> None:
        refusal = b'{"success":false,"error":"lease_expired"}'
        fake.faults.fail_next(status=200, body=refusal, route="transaction")
        with pytest.raises(qs.RequestError) as caught:
            fq.transaction().kv.put("out", "k", 1, forever=True).commit()
        assert caught.value.code == "lease_expired", repr(caught.value)
        assert "lease_expired" in str(caught.value), str(caught.value)

    def test_until_is_resolved_when_the_bundle_is_sent(
        self, embedded: qs.Queen, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from queen_sync import _durations

        shift = {"by": timedelta(0)}

        class Shifted(datetime):
            @classmethod
            def now(cls, tz: Any = None) -> Any:
                return datetime.now(tz) + shift["by"]

        monkeypatch.setattr(_durations, "datetime", Shifted)
        start = datetime.now(timezone.utc)
        until = Shifted(start.year, start.month, start.day, start.hour, start.minute,
                        start.second, tzinfo=timezone.utc) + timedelta(hours=1)
        txn = (embedded.transaction()
               .kv.put("out", "a", 1, until=until)
               .once("out", "b", until=until))
        shift["by"] = timedelta(minutes=20)  # the bundle took a while to assemble
        sent = capture(embedded)
        assert txn.commit()
        ttls = [op["ttlSeconds"] for op in sent[0]["kv"]]
        assert all(2390 <= t <= 2401 for t in ttls), f"40 minutes left at send: {ttls}"


class TestBadRidersFailAtTheCall:
    @pytest.mark.parametrize("build, error", [
        (lambda t: t.queue(""), ValueError),
        (lambda t: t.queue(7), TypeError),
        (lambda t: t.queue("q").partition(""), ValueError),
        (lambda t: t.queue("q").push(["not a dict"]), TypeError),
        (lambda t: t.queue("q").push([{"data": {1, 2}}]), TypeError),
        (lambda t: t.queue("q").push([{"data": 1, "transactionId": 5}]), TypeError),
        (lambda t: t.ack({"transactionId": "m"}), ValueError),
        (lambda t: t.ack({"partitionId": "p"}), ValueError),
        (lambda t: t.ack("m"), ValueError),
        (lambda t: t.ack({"id": "m", "partitionId": "p"}, status=""), ValueError),
        (lambda t: t.ack({"id": "m", "partitionId": "p"}, context={"consumerGroup": "g"}),
         ValueError),
        (lambda t: t.timer("t").payload(1).after_ms(5).schedule(), ValueError),
        (lambda t: t.timer("t").key("k").after_ms(5).schedule(), ValueError),
        (lambda t: t.timer("t").key("k").payload(1).schedule(), ValueError),
        (lambda t: t.timer("t").key("k").payload(1).after_ms(5).after(timedelta(1)).schedule(),
         ValueError),
        (lambda t: t.timer("t").key("k").payload(1).after_ms(True).schedule(), TypeError),
        (lambda t: t.timer("t").key("").cancel(), ValueError),
    ])
    def test_a_bad_rider_raises_a_typed_error_and_adds_nothing(
        self, fake: FakeBroker, fq: qs.Queen, build: Callable[[qs.Transaction], Any],
        error: type[Exception]
    ) -> None:
        txn = fq.transaction().kv.put("out", "k", 1, forever=True)
        with pytest.raises(error):
            build(txn)
        sent = capture(fq)
        assert txn.commit() and sent[0]["operations"] == [], "the bad rider left no trace"

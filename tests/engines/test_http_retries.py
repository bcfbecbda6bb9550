"""What the HTTP engine resends, and what it never resends (it could apply a call twice)."""

from __future__ import annotations

import time
from typing import Any, Iterator

import pytest
import requests

import queen_sync as qs
from queen_sync._engines.http_errors import _TRANSPORT, transport_error
from queen_sync.testing import FakeBroker


@pytest.fixture
def broker() -> Iterator[FakeBroker]:
    with FakeBroker() as fake:
        yield fake


@pytest.fixture
def q(broker: FakeBroker) -> Iterator[qs.Queen]:
    client = broker.client(backoff=0, renew_thread=False)
    yield client
    client.close()


def sent(q: qs.Queen) -> int:
    return int(q.engine.requests_sent)  # type: ignore[attr-defined]


class TestLockCallsAreResent:
    @pytest.mark.parametrize("inject", [
        lambda f: f.fail_next(1, status=503), lambda f: f.fail_next(1, status=502),
        lambda f: f.fail_next(1, status=504), lambda f: f.timeout_next(1),
        lambda f: f.reset_next(1), lambda f: f.refuse_next(1),
    ], ids=["503", "502", "504", "timeout", "reset", "refused"])
    def test_an_acquire_survives_one_failed_request(self, q: qs.Queen, broker: FakeBroker,
                                                    inject: Any) -> None:
        inject(broker.faults)
        lock = q.lock("job", ttl=30)
        assert lock.acquire(), "the resend must take the lock"
        assert sent(q) == 2, f"one failed request and one resend, got {sent(q)}"

    def test_an_acquire_applied_before_the_reset_answers_the_same_permit(
        self, q: qs.Queen, broker: FakeBroker
    ) -> None:
        broker.faults.reset_next(1, applied=True)
        lock = q.lock("job", ttl=30)
        assert lock.acquire()
        holders = q.locks.get("job")["holders"]
        assert [h["token"] for h in holders] == [lock.token], f"one permit, ours: {holders}"

    def test_a_renew_applied_before_the_timeout_keeps_the_lease(self, q: qs.Queen,
                                                                 broker: FakeBroker) -> None:
        lock = q.lock("job", ttl=30)
        assert lock.acquire()
        broker.faults.timeout_next(1, route="locks", applied=True)
        assert lock.renew(), "the owner's resent renew answers the renewed permit"
        assert q.locks.get("job")["holders"][0]["token"] == lock.token

    def test_the_budget_is_bounded_and_the_last_error_surfaces(self, q: qs.Queen,
                                                              broker: FakeBroker) -> None:
        broker.faults.fail_next(10, status=503)
        with pytest.raises(qs.QueenHttpError) as caught:
            q.locks.get("job")
        assert caught.value.status == 503 and sent(q) == 4, (repr(caught.value), sent(q))

    def test_an_owner_less_acquire_is_not_resent_after_it_may_have_been_applied(
        self, q: qs.Queen, broker: FakeBroker
    ) -> None:
        broker.faults.reset_next(1, applied=True)
        with pytest.raises(qs.EngineUnavailableError):
            q.locks.acquire("job", ttl_seconds=30)
        assert sent(q) == 1, "without an owner a resend would take a second permit"

    def test_kv_reads_are_resent(self, q: qs.Queen, broker: FakeBroker) -> None:
        q.kv.put("app", "k", 1, forever=True)
        broker.faults.timeout_next(1)
        assert q.kv.get("app", "k")["value"] == 1


class TestWritesAreNotResent:
    @pytest.mark.parametrize("inject, error", [
        (lambda f: f.fail_next(1, status=503, applied=True), qs.QueenHttpError),
        (lambda f: f.timeout_next(1, applied=True), qs.EngineUnavailableError),
        (lambda f: f.reset_next(1, applied=True), qs.EngineUnavailableError),
    ], ids=["503", "timeout", "reset"])
    def test_an_incr_that_may_have_landed_surfaces_and_lands_once(
        self, q: qs.Queen, broker: FakeBroker, inject: Any, error: type
    ) -> None:
        inject(broker.faults)
        with pytest.raises(error):
            q.kv.incr("app", "n", forever=True)
        assert sent(q) == 1, "a write that may have been applied is not resent"
        assert q.kv.get("app", "n")["value"] == 1, "applied exactly once"

    def test_a_guarded_transaction_that_may_have_landed_surfaces(self, q: qs.Queen,
                                                                 broker: FakeBroker) -> None:
        lock = q.lock("job", ttl=30)
        assert lock.acquire()
        broker.faults.reset_next(1, route="transaction", applied=True)
        with pytest.raises(qs.EngineUnavailableError):
            q.transaction().guard(lock).kv.incr("app", "n", forever=True).commit()
        assert q.kv.get("app", "n")["value"] == 1, "applied exactly once"

    def test_a_write_whose_connection_was_refused_is_resent(self, q: qs.Queen,
                                                            broker: FakeBroker) -> None:
        broker.faults.refuse_next(2)
        assert q.kv.incr("app", "n", forever=True)["value"] == 1
        assert sent(q) == 3, "two refused connections, then the write"


class TestRateLimits:
    def test_a_429_is_resent_after_its_retry_after_for_any_route(self, q: qs.Queen,
                                                                 broker: FakeBroker) -> None:
        broker.faults.fail_next(1, status=429, headers={"Retry-After": "0.2"},
                                body=b'{"error": "slow down", "code": "rate_limited"}')
        started = time.monotonic()
        assert q.kv.incr("app", "n", forever=True)["value"] == 1
        assert time.monotonic() - started >= 0.2, "Retry-After must be honoured"

    def test_a_proxys_429_envelope_is_read_and_the_attempts_are_bounded(
        self, q: qs.Queen, broker: FakeBroker
    ) -> None:
        broker.faults.fail_next(10, status=429, headers={"Retry-After": "0"},
                                body=b'{"error": "too many requests", "code": "rate_limited"}')
        with pytest.raises(qs.QueenHttpError) as caught:
            q.kv.put("app", "k", 1, forever=True)
        err = caught.value
        assert (err.status, err.code, err.detail) == (429, "rate_limited", "too many requests")
        assert err.retry_after == 0 and sent(q) == 4, (repr(err), sent(q))

    def test_a_retry_after_longer_than_the_engine_waits_surfaces_at_once(
        self, q: qs.Queen, broker: FakeBroker
    ) -> None:
        broker.faults.fail_next(1, status=429, headers={"Retry-After": "120"})
        with pytest.raises(qs.QueenHttpError) as caught:
            q.locks.get("job")
        assert caught.value.retry_after == 120 and sent(q) == 1, repr(caught.value)


class TestErrorsFromTheBroker:
    def test_a_broker_envelope_fills_code_reason_and_detail(self, q: qs.Queen,
                                                           broker: FakeBroker) -> None:
        broker.faults.fail_next(1, status=409, body=b'{"error": "kv_conflict", '
                                b'"reason": "cluster_moving", "detail": "try later"}')
        with pytest.raises(qs.QueenHttpError) as caught:
            q.kv.put("app", "k", 1, forever=True)
        err = caught.value
        assert (err.status, err.code, err.reason, err.detail) == (
            409, "kv_conflict", "cluster_moving", "try later"), repr(err)

    def test_queue_ops_on_a_broker_without_queues_raise_unsupported_operation(
        self, q: qs.Queen, broker: FakeBroker
    ) -> None:
        broker.faults.fail_next(1, status=501, body=b'{"error": "unsupported_operation", '
                                b'"reason": "queue_operations", "detail": "no queues here"}')
        with pytest.raises(qs.UnsupportedOperationError) as caught:
            q._call_transaction({"operations": [{"type": "push", "items": []}],
                                 "requiredLeases": [], "kv": []})
        assert caught.value.capability == "queue_operations", repr(caught.value)

    def test_errors_pickle_with_their_fields(self, q: qs.Queen, broker: FakeBroker) -> None:
        import pickle

        broker.faults.fail_next(1, status=400, body=b'{"error": "kv_bad_request"}')
        with pytest.raises(qs.QueenHttpError) as caught:
            q.kv.put("app", "k", 1, forever=True)
        again = pickle.loads(pickle.dumps(caught.value))
        assert (again.status, again.code) == (400, "kv_bad_request"), repr(again)


class TestTransportMapping:
    @pytest.mark.parametrize("kind", [kind for kind, _ in _TRANSPORT], ids=lambda k: k.__name__)
    def test_every_caught_requests_exception_maps_to_a_queen_error(self, kind: type) -> None:
        error = transport_error("kv", "http://b.test", kind("boom"))
        assert isinstance(error, qs.EngineError), f"{kind.__name__} -> {error!r}"
        assert isinstance(error.__cause__, requests.exceptions.RequestException), "chained"

    def test_every_requests_exception_class_is_covered(self) -> None:
        covered = tuple(kind for kind, _ in _TRANSPORT)
        names = [n for n in dir(requests.exceptions)
                 if isinstance(getattr(requests.exceptions, n), type)
                 and issubclass(getattr(requests.exceptions, n),
                                requests.exceptions.RequestException)]
        missing = [n for n in names if not issubclass(getattr(requests.exceptions, n), covered)]
        assert not missing, f"no mapping for {missing}"

"""Every HTTP call ends within its budget: resends, backoffs and Retry-After waits included."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import queen_sync as qs
from queen_sync.testing import LocalBroker

MARGIN = 0.25  # scheduling and the last socket's close on a loaded 2-core machine

pytestmark = pytest.mark.realtime


def sent(q: qs.Queen) -> int:
    return int(q.engine.requests_sent)  # type: ignore[attr-defined]


class TestTheWholeCallIsBounded:
    def test_a_call_whose_every_attempt_stalls_gives_up_within_its_timeout(
        self, broker: LocalBroker
    ) -> None:
        broker.faults.timeout_next(10, seconds=3.0)
        with broker.client(timeout=0.5, retries=3, backoff=0.01) as q:
            started = time.monotonic()
            with pytest.raises(qs.EngineUnavailableError):
                q.kv.get("app", "k")
            took = time.monotonic() - started
        assert took < 0.5 + MARGIN, (
            f"a 0.5 s timeout must bound the whole call, resends included; took {took:.2f}s "
            f"over {sent(q)} requests")

    def test_a_first_stalled_attempt_is_resent_when_the_call_timeout_leaves_room(
        self, broker: LocalBroker
    ) -> None:
        broker.faults.timeout_next(1, seconds=3.0)
        with broker.client(timeout=(0.2, 0.3), call_timeout=1.5, backoff=0.01) as q:
            started = time.monotonic()
            lock = q.lock("job", ttl=30)
            assert lock.acquire(), "the resend after the stalled attempt must take the lock"
            took = time.monotonic() - started
            assert sent(q) == 2, f"one stalled request and one resend, got {sent(q)}"
        assert took < 1.5, f"the call must fit its 1.5 s budget, took {took:.2f}s"

    def test_resends_stop_when_the_call_timeout_is_spent(self, broker: LocalBroker) -> None:
        broker.faults.timeout_next(10, seconds=3.0)
        with broker.client(timeout=(0.2, 0.4), call_timeout=1.0, retries=10, backoff=0.01) as q:
            started = time.monotonic()
            with pytest.raises(qs.EngineUnavailableError):
                q.locks.get("job")
            took = time.monotonic() - started
            attempts = sent(q)
        assert took < 1.0 + MARGIN, f"the 1 s call timeout must end the call, took {took:.2f}s"
        assert attempts == 3, f"0.4 s + 0.4 s + the 0.2 s left: 3 requests, got {attempts}"

    def test_an_answer_slower_than_what_is_left_is_not_waited_for(
        self, broker: LocalBroker
    ) -> None:
        broker.faults.delay_next(1, seconds=1.5)
        with broker.client(timeout=(0.2, 5.0), call_timeout=0.5, retries=0) as q:
            started = time.monotonic()
            with pytest.raises(qs.EngineUnavailableError):
                q.kv.get("app", "k")
            took = time.monotonic() - started
        assert took < 0.5 + MARGIN, (
            f"the socket's read timeout must be cut to the call's 0.5 s; took {took:.2f}s")

    def test_a_retry_after_past_the_call_timeout_surfaces_at_once(
        self, broker: LocalBroker
    ) -> None:
        broker.faults.fail_next(1, status=429, headers={"Retry-After": "3"},
                                body=b'{"error": "slow down", "code": "rate_limited"}')
        with broker.client(timeout=(0.2, 0.5), call_timeout=1.0) as q:
            started = time.monotonic()
            with pytest.raises(qs.QueenHttpError) as caught:
                q.kv.get("app", "k")
            took = time.monotonic() - started
        assert caught.value.status == 429, repr(caught.value)
        assert took < 0.5, f"sleeping 3 s past a 1 s budget is pointless; took {took:.2f}s"

    @pytest.mark.parametrize("call_timeout", [0, -1.0, float("nan"), True, "1s"])
    def test_a_bad_call_timeout_is_refused_when_the_client_is_made(
        self, broker: LocalBroker, call_timeout: object
    ) -> None:
        with pytest.raises((TypeError, ValueError), match="call_timeout must be"):
            qs.Queen(broker.url, call_timeout=call_timeout)

    @pytest.mark.parametrize("timeout", [0, float("inf"), float("nan"), True, "1", (1, 2, 3)])
    def test_a_bad_timeout_is_refused_when_the_client_is_made(
        self, broker: LocalBroker, timeout: object
    ) -> None:
        """An infinite socket timeout would leave a stalled broker's call unbounded."""
        with pytest.raises((TypeError, ValueError), match="timeout must be"):
            qs.Queen(broker.url, timeout=timeout)


_FAULT = st.sampled_from(["stall", "slow", "reset", "503", "429"])


class TestAnyMixOfFaults:
    @settings(max_examples=12, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(faults=st.lists(_FAULT, min_size=1, max_size=6),
           budget=st.sampled_from([0.3, 0.6]))
    def test_no_mix_of_faults_makes_a_call_outlast_its_budget(
        self, broker: LocalBroker, faults: list[str], budget: float
    ) -> None:
        broker.faults.clear()
        for fault in faults:
            _inject(broker, fault)
        with broker.client(timeout=(0.1, 0.2), call_timeout=budget, retries=5,
                           backoff=0.02) as q:
            started = time.monotonic()
            try:
                answer = q.kv.get("app", "k")
            except qs.EngineError:
                answer = None
            took = time.monotonic() - started
        broker.faults.clear()
        assert took < budget + MARGIN, (
            f"faults {faults} made a {budget}s call take {took:.2f}s (answer {answer!r})")


def _inject(broker: LocalBroker, fault: str) -> None:
    plan = broker.faults
    if fault == "stall":
        plan.timeout_next(1, seconds=1.0)
    elif fault == "slow":
        plan.delay_next(1, seconds=0.15)
    elif fault == "reset":
        plan.reset_next(1)
    elif fault == "503":
        plan.fail_next(1, status=503)
    else:
        plan.fail_next(1, status=429, headers={"Retry-After": "0.1"})

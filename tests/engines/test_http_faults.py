"""Faults over a real socket: a LocalBroker stopped, restarted, and answering badly."""

from __future__ import annotations

import socket
import time
from typing import Callable

import pytest

import queen_sync as qs
from queen_sync.testing import LocalBroker

HTML_502 = b"<html><head><title>502 Bad Gateway</title></head><body>nginx</body></html>"


def wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.realtime
class TestBrokerOutage:
    def test_a_broker_down_for_less_than_the_ttl_leaves_the_lease_alive(
        self, broker: LocalBroker
    ) -> None:
        with broker.client(timeout=(0.2, 0.5)) as q:
            lock = q.lock("job", ttl=2)
            assert lock.acquire()
            first = lock.token
            broker.stop()
            time.sleep(0.9)  # past a renewal (every 0.67 s), well within the 2 s lifetime
            assert q.metrics.snapshot()["counts"]["renew_error"] >= 1, "renewal was tried"
            broker.start()
            assert wait_for(lambda: (lock.token or 0) > (first or 0), 1.5), repr(lock)
            assert not lock.lost.is_set() and lock.held, f"the lease must survive: {lock!r}"
            holders = q.locks.get("job")["holders"]
            assert [(h["owner"], h["token"]) for h in holders] == [(lock.owner, lock.token)]

    def test_a_broker_down_for_longer_than_the_ttl_expires_the_lease(
        self, broker: LocalBroker
    ) -> None:
        with broker.client(timeout=(0.2, 0.5)) as q:
            lock = q.lock("job", ttl=1)
            assert lock.acquire()
            first = lock.token
            broker.stop()
            assert lock.lost.wait(2.0), "the handle must notice its deadline passed"
            assert lock.lost_reason == "expired" and not lock.held, repr(lock)
            broker.start()
            with broker.client() as other:
                rival = other.lock("job", ttl=30)
                assert rival.acquire(wait=2), "the expired permit is free"
                assert (rival.token or 0) > (first or 0), (first, rival.token)

    def test_calls_fail_over_to_the_next_broker(self, broker: LocalBroker) -> None:
        with qs.Queen(f"http://127.0.0.1:{closed_port()},{broker.url}", backoff=0) as q:
            assert q.kv.incr("app", "n", forever=True)["value"] == 1, "refused: safe to resend"
            assert q.kv.incr("app", "n", forever=True)["value"] == 2
            assert q.engine.requests_sent == 3, "the dead broker is not asked again"  # type: ignore[attr-defined]

    def test_a_stopped_broker_is_an_unavailable_engine(self, broker: LocalBroker) -> None:
        with broker.client(backoff=0) as q:
            broker.stop()
            with pytest.raises(qs.EngineUnavailableError, match="connection failed"):
                q.kv.put("app", "k", 1, forever=True)


class TestBadAnswers:
    def test_an_html_502_surfaces_with_its_status_once_resends_run_out(
        self, broker: LocalBroker
    ) -> None:
        broker.faults.fail_next(4, status=502, body=HTML_502,
                                headers={"Content-Type": "text/html"})
        with broker.client(backoff=0) as q, pytest.raises(qs.QueenHttpError) as caught:
            q.locks.get("job")
        err = caught.value
        assert (err.status, err.code) == (502, "http_502"), repr(err)
        assert "text/html" in str(err) and "502 Bad Gateway" in str(err), str(err)

    def test_an_html_502_on_a_write_surfaces_at_once(self, broker: LocalBroker) -> None:
        broker.faults.fail_next(1, status=502, body=HTML_502,
                                headers={"Content-Type": "text/html"})
        with broker.client() as q:
            with pytest.raises(qs.QueenHttpError) as caught:
                q.kv.put("app", "k", 1, forever=True)
            assert caught.value.status == 502 and q.engine.requests_sent == 1  # type: ignore[attr-defined]

    def test_truncated_json_is_a_protocol_error_naming_the_route(
        self, broker: LocalBroker
    ) -> None:
        broker.faults.fail_next(1, status=200, body=b'{"results": [{"found": tr')
        with broker.client() as q, pytest.raises(qs.ProtocolError) as caught:
            q.kv.get("app", "k")
        assert caught.value.route == "kv" and "not JSON" in str(caught.value), str(caught.value)
        assert "HTTP 200" in str(caught.value), str(caught.value)

    def test_a_results_list_of_the_wrong_length_is_a_protocol_error(
        self, broker: LocalBroker
    ) -> None:
        broker.faults.fail_next(1, status=200, body=b'{"results": []}')
        with broker.client() as q, pytest.raises(qs.ProtocolError) as caught:
            q.locks.get("job")
        assert caught.value.route == "locks" and "got results: 0" in str(caught.value)

    def test_a_wrong_token_is_a_401_with_the_brokers_code(self, tmp_path) -> None:  # type: ignore[no-untyped-def]
        with LocalBroker(str(tmp_path / "auth.db"), token="right") as broker:
            with broker.client(bearer_token="wrong") as q, \
                    pytest.raises(qs.QueenHttpError) as caught:
                q.locks.get("job")
            with broker.client() as q:
                assert not q.locks.get("job"), "the right token is let in"
        err = caught.value
        assert (err.status, err.code, err.reason) == (401, "unauthorized", "bad_token"), repr(err)
        assert "wrong" not in str(err), "the token is never echoed"

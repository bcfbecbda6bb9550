"""HTTPS end to end: a LocalBroker serving TLS on 127.0.0.1 with a test CA's certificate.

Verification is on by default, so a client that does not trust the CA is refused
at once with a typed error and applies nothing; trusting the CA by ``verify=``
or ``REQUESTS_CA_BUNDLE`` works, and the bearer token crosses only the encrypted
connection.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Iterator

import pytest
import trustme

import queen_sync as qs
from queen_sync.testing import LocalBroker

TOKEN = "tls-test-secret-token"


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def ca_bundle(ca: trustme.CA, tmp_path: Path) -> str:
    path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


@pytest.fixture
def broker(ca: trustme.CA, tmp_path: Path) -> Iterator[LocalBroker]:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    with LocalBroker(str(tmp_path / "broker.db"), token=TOKEN, tls=context) as local:
        yield local


def test_the_broker_serves_https(broker: LocalBroker) -> None:
    assert broker.url.startswith("https://127.0.0.1:"), broker.url


def test_a_client_trusting_the_ca_locks_over_tls(broker: LocalBroker, ca_bundle: str) -> None:
    with qs.Queen(broker.url, bearer_token=TOKEN, verify=ca_bundle) as q:
        lock = q.lock("job", ttl="30s")
        assert lock.acquire(), lock.holders
        holders = q.locks.get("job")["holders"]
        assert [h["token"] for h in holders] == [lock.token], holders
        assert lock.release()
        assert q.locks.get("job")["holders"] == []


def test_a_client_that_does_not_trust_the_certificate_is_refused_and_applies_nothing(
        broker: LocalBroker, ca_bundle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    with qs.Queen(broker.url, bearer_token=TOKEN) as untrusting:
        with pytest.raises(qs.EngineError) as caught:
            untrusting.lock("job", ttl="30s").acquire()
        sent = untrusting.engine.requests_sent  # type: ignore[attr-defined]
    message = str(caught.value)
    assert "TLS" in message and "verify=" in message, message
    assert not isinstance(caught.value, qs.EngineUnavailableError), (
        "a certificate that is not trusted is not an outage to retry")
    assert sent == 1, f"a TLS refusal must not be resent: {sent} requests"
    assert TOKEN not in message and TOKEN not in repr(caught.value), message
    with qs.Queen(broker.url, bearer_token=TOKEN, verify=ca_bundle) as trusting:
        assert trusting.locks.get("job")["holders"] == [], "the refused call applied something"


def test_the_ca_bundle_from_the_environment_is_trusted(
        broker: LocalBroker, ca_bundle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", ca_bundle)
    with qs.Queen(broker.url, bearer_token=TOKEN) as q:
        assert q.lock("job", ttl="30s").acquire()


def test_a_bad_bearer_token_over_tls_is_an_auth_error(broker: LocalBroker,
                                                      ca_bundle: str) -> None:
    q = qs.Queen(broker.url, bearer_token="wrong-token", verify=ca_bundle)
    with q, pytest.raises(qs.QueenHttpError) as caught:
        q.lock("job", ttl="30s").acquire()
    assert caught.value.status == 401, repr(caught.value)
    assert "wrong-token" not in str(caught.value), str(caught.value)

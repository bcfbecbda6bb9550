"""The HTTP engine sends exactly the bodies and headers of the wire (DESIGN §4).

Every request is caught by ``responses`` and answered by a real embedded engine,
so the handles behave as over a broker while each request's bytes are pinned.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Iterator

import pytest
import requests
import responses

import queen_sync as qs
from queen_sync._engines.sqlite import SqliteEngine

BASE = "http://broker.test:6632"
TOKEN = "s3cret-t0ken-value"


class Wire:
    """Records every request sent to BASE and answers it from an SQLite engine."""

    def __init__(self, engine: SqliteEngine) -> None:
        self.engine = engine
        self.sent: list[requests.PreparedRequest] = []

    def answer(self, request: requests.PreparedRequest) -> tuple[int, dict[str, str], str]:
        self.sent.append(request)
        route = (request.path_url or "").rsplit("/", 1)[-1]
        body = json.loads(request.body or b"{}")
        return 200, {"Content-Type": "application/json"}, json.dumps(self.engine.call(route,
                                                                                     body))

    def bodies(self) -> list[bytes]:
        return [r.body if isinstance(r.body, bytes) else str(r.body).encode() for r in self.sent]

    def last(self) -> bytes:
        return self.bodies()[-1]


@pytest.fixture
def wire(tmp_path: Any) -> Iterator[Wire]:
    engine = SqliteEngine(str(tmp_path / "wire.db"))
    recorder = Wire(engine)
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        for route in ("locks", "kv", "transaction"):
            mock.add_callback(responses.POST, f"{BASE}/api/v1/{route}", callback=recorder.answer)
        yield recorder
    engine.close()


@pytest.fixture
def client(wire: Wire) -> Iterator[qs.Queen]:
    q = qs.Queen(BASE, bearer_token=TOKEN, renew_thread=False)
    yield q
    q.close()


def body(*ops: dict[str, Any]) -> bytes:
    """The compact JSON a Queen client sends for these ops, in this key order."""
    return json.dumps({"operations": list(ops)}, separators=(",", ":")).encode()


class TestLockBodies:
    def test_a_lock_handle_acquires_with_its_owner_and_no_limit(self, client: qs.Queen,
                                                                wire: Wire) -> None:
        lock = client.lock("job", ttl=30)
        assert lock.acquire()
        expected = body({"op": "acquire", "name": "job", "ttlSeconds": 30, "owner": lock.owner})
        assert wire.last() == expected, f"acquire body: {wire.last()!r}"
        assert wire.sent[-1].url == f"{BASE}/api/v1/locks", wire.sent[-1].url

    def test_a_semaphore_handle_sends_its_limit(self, client: qs.Queen, wire: Wire) -> None:
        permit = client.semaphore("pool", 3, ttl="1m")
        assert permit.acquire()
        expected = body({"op": "acquire", "name": "pool", "ttlSeconds": 60,
                         "owner": permit.owner, "limit": 3})
        assert wire.last() == expected, f"semaphore acquire body: {wire.last()!r}"

    def test_a_fractional_lifetime_is_rounded_up_to_whole_seconds(self, client: qs.Queen,
                                                                 wire: Wire) -> None:
        assert client.lock("job", ttl=2.5).acquire()
        assert json.loads(wire.last())["operations"][0]["ttlSeconds"] == 3, wire.last()

    def test_renew_carries_slot_and_owner_and_release_carries_slot(self, client: qs.Queen,
                                                                    wire: Wire) -> None:
        lock = client.lock("job", ttl=30)
        assert lock.acquire()
        first = lock.token
        assert lock.renew()
        assert wire.last() == body({"op": "renew", "name": "job", "token": first,
                                    "ttlSeconds": 30, "slot": 0, "owner": lock.owner})
        second = lock.token
        assert lock.release()
        assert wire.last() == body({"op": "release", "name": "job", "token": second, "slot": 0})

    def test_the_stateless_wire_omits_every_optional_not_given(self, client: qs.Queen,
                                                               wire: Wire) -> None:
        grant = client.locks.acquire("job", ttl_seconds=5)
        client.locks.renew("job", token=grant["token"], ttl_seconds=5)
        client.locks.get("job")
        client.locks.release("job", token=grant["token"] + 1)
        assert wire.bodies()[-4:] == [
            body({"op": "acquire", "name": "job", "ttlSeconds": 5}),
            body({"op": "renew", "name": "job", "token": grant["token"], "ttlSeconds": 5}),
            body({"op": "get", "name": "job"}),
            body({"op": "release", "name": "job", "token": grant["token"] + 1}),
        ], wire.bodies()
        assert all(b"null" not in sent for sent in wire.bodies()), "no optional is sent as null"

    def test_the_renewer_renews_every_due_lease_in_one_request(self, client: qs.Queen,
                                                               wire: Wire, clock: Any) -> None:
        q = qs.Queen(BASE, renew_thread=False, clock=clock)
        locks = [q.lock(f"job-{i}", ttl=30) for i in range(3)]
        assert all(lock.acquire() for lock in locks)
        before = len(wire.sent)
        clock.advance(11)
        q.renewer.tick()
        ops = json.loads(wire.last())["operations"]
        assert len(wire.sent) == before + 1, "one request per tick"
        assert [op["name"] for op in ops] == ["job-0", "job-1", "job-2"], ops
        assert all(op["op"] == "renew" and "owner" in op and "slot" in op for op in ops), ops
        q.close()


class TestKvBodies:
    def test_each_kv_read_is_sent_as_built(self, client: qs.Queen, wire: Wire) -> None:
        client.kv.get("app", "k")
        client.kv.get_many("app", ["a", "b"])
        client.kv.get_prefix("app", "p")
        client.kv.get_prefix("app", "p", after="p1", limit=10, keys_only=True)
        assert wire.bodies() == [
            body({"op": "get", "ns": "app", "key": "k"}),
            body({"op": "getMany", "ns": "app", "keys": ["a", "b"]}),
            body({"op": "getPrefix", "ns": "app", "prefix": "p"}),
            body({"op": "getPrefix", "ns": "app", "prefix": "p", "after": "p1", "limit": 10,
                  "keysOnly": True}),
        ], wire.bodies()

    def test_each_kv_write_declares_one_expiry_and_only_the_options_given(
        self, client: qs.Queen, wire: Wire
    ) -> None:
        put = client.kv.put("app", "k", {"n": 1}, ttl="1h")
        client.kv.put("app", "k", "é", forever=True, expect=put["version"])
        client.kv.put_if_absent("app", "once", True, ttl_seconds=60)
        client.kv.incr("app", "n", delta=2, max=10, forever=True)
        client.kv.check("app", "k", expect=0)
        client.kv.delete("app", "k")
        assert wire.bodies() == [
            body({"op": "put", "ns": "app", "key": "k", "value": {"n": 1}, "ttlSeconds": 3600}),
            json.dumps({"operations": [{"op": "put", "ns": "app", "key": "k", "value": "é",
                                        "forever": True, "expect": put["version"]}]},
                       separators=(",", ":"), ensure_ascii=False).encode("utf-8"),
            body({"op": "putIfAbsent", "ns": "app", "key": "once", "value": True,
                  "ttlSeconds": 60}),
            body({"op": "incr", "ns": "app", "key": "n", "delta": 2, "forever": True,
                  "max": 10}),
            body({"op": "check", "ns": "app", "key": "k", "expect": 0}),
            body({"op": "delete", "ns": "app", "key": "k"}),
        ], wire.bodies()


class TestTransactionBodies:
    def test_the_guard_goes_first_in_kv_and_is_the_brokers_own_guard(self, client: qs.Queen,
                                                                      wire: Wire) -> None:
        lock = client.lock("job", ttl=30)
        assert lock.acquire()
        granted_guard = wire.engine.call(  # the broker's answer to the owner's resend
            "locks", {"operations": [{"op": "acquire", "name": "job", "ttlSeconds": 30,
                                      "owner": lock.owner}]})["results"][0]["guard"]
        answer = (client.transaction().guard(lock)
                  .kv.incr("out", "n", forever=True)
                  .kv.put("out", "last", "x", ttl_seconds=5, required=True)
                  .commit())
        assert answer, answer
        expected = {"operations": [], "requiredLeases": [], "kv": [
            granted_guard,
            {"op": "incr", "ns": "out", "key": "n", "delta": 1, "forever": True},
            {"op": "put", "ns": "out", "key": "last", "value": "x", "ttlSeconds": 5,
             "required": True},
        ]}
        assert wire.last() == json.dumps(expected, separators=(",", ":")).encode(), wire.last()
        assert wire.sent[-1].url == f"{BASE}/api/v1/transaction"


class TestHeaders:
    def test_every_call_carries_json_and_the_bearer_token(self, client: qs.Queen,
                                                          wire: Wire) -> None:
        client.locks.get("job")
        headers = wire.sent[-1].headers
        assert headers["Authorization"] == f"Bearer {TOKEN}", "the bearer header"
        assert headers["Content-Type"] == "application/json", headers
        assert headers["Accept"] == "application/json", headers

    def test_the_token_comes_from_queen_token_when_not_given(
        self, wire: Wire, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("QUEEN_TOKEN", "from-the-env")
        with qs.Queen(BASE) as q:
            q.kv.get("app", "k")
        assert wire.sent[-1].headers["Authorization"] == "Bearer from-the-env"

    def test_no_token_means_no_authorization_header(
        self, wire: Wire, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.delenv("QUEEN_TOKEN", raising=False)
        with qs.Queen(BASE) as q:
            q.kv.get("app", "k")
        assert "Authorization" not in wire.sent[-1].headers, wire.sent[-1].headers

    def test_a_netrc_entry_never_replaces_the_bearer_header(
        self, wire: Wire, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        netrc = tmp_path / ".netrc"
        netrc.write_text("machine broker.test login user password pw\n")
        netrc.chmod(0o600)
        monkeypatch.setenv("NETRC", str(netrc))
        with qs.Queen(BASE, bearer_token=TOKEN) as q:
            q.kv.get("app", "k")
        assert wire.sent[-1].headers["Authorization"] == f"Bearer {TOKEN}"

    def test_extra_headers_are_sent_on_every_call(self, wire: Wire) -> None:
        with qs.Queen(BASE, headers={"X-Tenant": "blue"}) as q:
            q.kv.get("app", "k")
            q.locks.get("job")
        assert [r.headers["X-Tenant"] for r in wire.sent] == ["blue", "blue"]


class TestTokenSecrecy:
    def test_the_token_is_in_no_repr_log_line_or_error(
        self, wire: Wire, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.DEBUG, logger="queen_sync")
        q = qs.Queen(f"{BASE},http://down.test:6632", bearer_token=TOKEN, backoff=0)
        seen = [repr(q), repr(q.engine), q.url, repr(vars(q.engine))]
        with responses.RequestsMock() as failing:
            failing.add(responses.POST, f"{BASE}/api/v1/kv", status=401,
                        json={"error": "unauthorized", "reason": "bad_token", "detail": "no"})
            with pytest.raises(qs.QueenHttpError) as caught:
                q.kv.put("app", "k", 1, forever=True)
        seen += [str(caught.value), repr(caught.value), caplog.text]
        q.close()
        assert caught.value.status == 401, repr(caught.value)
        leaks = [text for text in seen if TOKEN in text]
        assert not leaks, f"the token leaked into: {leaks}"

    def test_a_url_carrying_credentials_is_refused_without_echoing_them(self) -> None:
        with pytest.raises(qs.RequestError) as caught:
            qs.Queen("http://user:hunter2@broker.test:6632")
        assert caught.value.code == "bad_url" and "hunter2" not in str(caught.value)


class TestBadOptions:
    @pytest.mark.parametrize("options", [
        {"timeout": 0}, {"timeout": "5s"}, {"timeout": (1, 2, 3)}, {"headers": {"X": 1}},
        {"headers": {"X": "a\r\nb"}}, {"bearer_token": 123}, {"verify": "/no/such/ca.pem"},
        {"retries": -1}, {"backoff": -1}, {"verify": 3},
    ])
    def test_a_bad_option_is_refused_before_any_request(self, wire: Wire,
                                                        options: dict[str, Any]) -> None:
        with pytest.raises((TypeError, ValueError)):
            qs.Queen(BASE, **options)
        assert wire.sent == [], "nothing may be sent"

    @pytest.mark.parametrize("url", ["http://", "http://a:1,ftp://broker.test", "http://h:port",
                                     "http://h:1?x=1", "http://a:1,http:///x"])
    def test_a_bad_broker_url_is_a_named_bad_request(self, url: str) -> None:
        with pytest.raises(qs.RequestError) as caught:
            qs.Queen(url)
        assert caught.value.code == "bad_url", repr(caught.value)

    def test_the_engine_reports_its_kind_capabilities_and_urls(self) -> None:
        with qs.Queen(["http://a.test:6632/", "https://b.test"]) as q:
            assert q.engine.kind == "http" and q.url == "http://a.test:6632,https://b.test"
            caps = q.capabilities
            assert caps.queue_operations and caps.multi_host and not caps.wake_on_release

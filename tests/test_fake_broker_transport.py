"""``FakeBroker`` answers through a transport of its own: no ``responses``, no socket.

It works on a plain install (``responses`` is a test dependency of this project, not
of its users), answers every client of its URL whenever that client was made, and
leaves every other URL to the network as usual.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

import pytest
import requests
from pg_server import free_port

import queen_sync as qs
from queen_sync.testing import FakeBroker, LocalBroker

ROOT = Path(__file__).resolve().parents[1]

WITHOUT_RESPONSES = """
import sys
sys.modules["responses"] = None  # as on an install without it: importing it fails
from queen_sync.testing import FakeBroker
with FakeBroker() as broker, broker.client() as q:
    lock = q.lock("job", ttl=30)
    print(lock.acquire(), not q.lock("job", ttl=30).acquire(), lock.release())
"""


class TestAFakeBrokerOnAPlainInstall:
    def test_serves_a_lock_when_responses_cannot_be_imported(self) -> None:
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        done = subprocess.run([sys.executable, "-c", WITHOUT_RESPONSES], capture_output=True,
                              text=True, timeout=60, env={**os.environ, "PYTHONPATH": path})

        assert done.returncode == 0, f"FakeBroker failed without responses:\n{done.stderr}"
        assert done.stdout.split() == ["True", "True", "True"], done.stdout


class TestWhatAFakeBrokerAnswers:
    def test_a_client_made_before_the_broker_started_is_answered_too(self) -> None:
        broker = FakeBroker()
        with qs.Queen(broker.url, timeout=0.5, retries=0) as q:
            with broker:
                assert q.lock("job", ttl=30).acquire(), "an earlier client was not answered"
            with pytest.raises(qs.EngineUnavailableError):
                q.locks.get("job")  # stopped: its URL reaches nothing any more

    def test_other_urls_go_to_the_network_as_usual_while_it_runs(self, tmp_path: Path) -> None:
        with LocalBroker(str(tmp_path / "real.db")) as real, FakeBroker() as fake, \
                real.client() as on_real, fake.client() as on_fake:
            assert on_real.lock("job", ttl=30).acquire(), "the real broker was not reached"
            assert on_fake.lock("job", ttl=30).acquire(), "the fake shares the real's store"
            assert dict(real.calls) == {"locks": 1} and dict(fake.calls) == {"locks": 1}, (
                f"calls went to the wrong broker: real {real.calls}, fake {fake.calls}")

    def test_two_fakes_on_two_urls_answer_from_their_own_stores(self) -> None:
        with FakeBroker("http://a.test:1") as a, FakeBroker("http://b.test:1") as b, \
                a.client() as on_a, b.client() as on_b:
            assert on_a.lock("job", ttl=30).acquire() and on_b.lock("job", ttl=30).acquire(), (
                "two fakes shared one store")

    def test_a_url_that_only_begins_like_the_fakes_is_not_answered(self) -> None:
        with FakeBroker("http://queen.test:66") as broker, pytest.raises(
                requests.exceptions.ConnectionError):
            requests.post(broker.url + "32/api/v1/locks", json={"operations": []}, timeout=1)

    def test_a_second_fake_for_a_url_already_answered_is_refused_at_start(self) -> None:
        with FakeBroker() as first:
            second = FakeBroker(first.url)
            with pytest.raises(ValueError, match="already answers"):
                second.start()
            second.close()
            with first.client() as q:
                assert q.lock("job", ttl=30).acquire(), "the refusal stopped the first fake"

    def test_once_every_fake_stopped_requests_is_as_it_was_found(self) -> None:
        found = requests.Session.get_adapter
        with FakeBroker("http://a.test:1"):
            with FakeBroker("http://b.test:1"):
                pass
            assert requests.Session.get_adapter is not found, "a running fake was unhooked"
        assert requests.Session.get_adapter is found, "requests was left patched"

    def test_an_injected_refusal_and_reset_raise_what_requests_raises(self) -> None:
        with FakeBroker() as broker:
            broker.faults.refuse_next(1).reset_next(1)
            for _ in range(2):
                with pytest.raises(requests.exceptions.ConnectionError):
                    requests.post(broker.url + "/api/v1/locks", json={"operations": []},
                                  timeout=1)
            answer = requests.post(broker.url + "/api/v1/locks", json={"operations": []},
                                   timeout=1)
            assert answer.status_code == 200 and answer.json() == {"results": []}, answer.text


def _reach_the_network() -> None:
    """A call to a URL no fake answers, which must fail as the network fails."""
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.Session().get(f"http://127.0.0.1:{free_port()}/unrelated", timeout=2)


def _hook_both(fake_first: bool) -> tuple[FakeBroker, Any, Any]:
    """A running fake and another tool's patch of ``Session.get_adapter``, started in order."""
    fake = FakeBroker()
    other = mock.patch.object(requests.Session, "get_adapter", autospec=True,
                              side_effect=requests.Session.get_adapter)
    if fake_first:
        fake.start()
        return fake, other, other.start()
    patched = other.start()
    fake.start()
    return fake, other, patched


class TestAnotherToolHookingRequestsToo:
    """A fake shares ``Session.get_adapter`` with tools that patch it too (requests_mock)."""

    @pytest.fixture(autouse=True)
    def requests_as_found(self) -> Iterator[None]:
        """Puts ``get_adapter`` back after each test, so one failure does not spread."""
        found = requests.Session.get_adapter
        yield
        requests.Session.get_adapter = found  # type: ignore[method-assign]

    @pytest.mark.parametrize("fake_first", [True, False], ids=["fake first", "other first"])
    def test_the_fakes_stop_leaves_the_other_tools_hook_in_place(
            self, fake_first: bool) -> None:
        found = requests.Session.get_adapter
        fake, other, patched = _hook_both(fake_first)
        fake.close()
        now = requests.Session.get_adapter
        other.stop()
        assert now is patched, f"the fake's stop did not leave the other tool's hook: {now!r}"
        _reach_the_network()  # the hook the other tool handed back leaves at its first call
        assert requests.Session.get_adapter is found, (
            f"after both stopped, Session.get_adapter is {requests.Session.get_adapter!r}")

    @pytest.mark.parametrize("fake_first", [True, False], ids=["fake first", "other first"])
    @pytest.mark.parametrize("fake_stops_first", [True, False],
                             ids=["fake stops first", "other stops first"])
    def test_whatever_the_order_a_later_fake_answers_and_other_urls_reach_the_network(
            self, fake_first: bool, fake_stops_first: bool) -> None:
        found = requests.Session.get_adapter
        fake, other, _ = _hook_both(fake_first)
        stops = [fake.close, other.stop]
        for stop in stops if fake_stops_first else stops[::-1]:
            stop()
        with FakeBroker("http://later.test:1") as later, later.client() as q:
            assert q.lock("job", ttl=30).acquire(), "the later fake does not answer its URL"
            _reach_the_network()
        assert requests.Session.get_adapter is found, "requests was left patched"

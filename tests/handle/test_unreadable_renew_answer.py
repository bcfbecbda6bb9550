"""A renew answer that says "renewed" but names no usable permit fails its lease alone.

The engine did renew, so the handle treats it as a renew whose answer was lost: it keeps
the token it had, resends soon (a renew resent with the previous token renews), and
every other lease of the batch is renewed as usual, then and at every later tick.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import pytest
from manual_clock import ManualClock

import queen_sync as qs
from queen_sync._engines import engine_from_url
from queen_sync._engines.base import Engine

_MISSING = object()


class CorruptingEngine(Engine):
    """A real SQLite engine whose next renew answer for ``name`` has ``field`` set to ``value``."""

    kind = "sqlite"

    def __init__(self, url: str, name: str, field: str, value: object) -> None:
        self.inner = engine_from_url(url, {})
        self.capabilities = self.inner.capabilities
        self.name, self.field, self.value = name, field, value
        self.armed = False

    @property
    def url(self) -> str:
        return self.inner.url

    def call(self, route: str, body: Mapping[str, Any]) -> dict[str, Any]:
        answer = self.inner.call(route, body)
        if route == "locks" and self.armed:
            for op, result in zip(body["operations"], answer["results"]):
                if op["op"] == "renew" and op["name"] == self.name and result.get("renewed"):
                    self.armed = False
                    if self.value is _MISSING:
                        del result[self.field]
                    else:
                        result[self.field] = self.value
        return answer

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("field, value", [
    ("token", 0), ("token", -4), ("token", "soon"), ("token", None), ("token", 2.5),
    ("token", True), pytest.param("token", _MISSING, id="token-missing"), ("slot", 4096),
    ("slot", -1), ("slot", "0x"), pytest.param("slot", _MISSING, id="slot-missing"),
])
def test_a_renew_answer_naming_no_usable_permit_fails_that_lease_alone(
    tmp_path: Path, field: str, value: object
) -> None:
    clock = ManualClock()
    url = "sqlite://" + os.path.join(tmp_path, "q.db")
    engine = CorruptingEngine(url, "job-2", field, value)
    with qs.Queen(engine=engine, clock=clock, renew_thread=False) as q:
        locks = [q.lock(f"job-{i}", ttl=30) for i in range(5)]
        assert all(lock.acquire() for lock in locks), "a fresh store must grant every lease"
        broken = locks[2]
        before = {lock.name: lock.token for lock in locks}
        engine.armed = True
        clock.advance(10.01)
        q.renewer.tick()  # must not raise: one unreadable answer is that lease's failure
        assert not engine.armed, "the renew answer of job-2 was never corrupted"
        assert broken.held and broken.token == before["job-2"], (
            f"the lease with the unreadable answer must keep its token, unsure: {broken!r}")
        assert q.metrics.snapshot()["counts"]["renew_error"] == 1, "counted as one renew_error"
        for _ in range(4):  # it is resent soon; the whole batch keeps being renewed
            tokens = {lock.name: lock.token for lock in locks}
            clock.advance(10.01)
            q.renewer.tick()
            for lock in locks:
                old = tokens[lock.name]
                assert lock.held and lock.token is not None and old is not None \
                    and lock.token > old, f"{lock!r} was not renewed by a later tick"
        with qs.Queen(url) as other:
            permit = other.locks.get("job-2")["holders"][0]
        assert permit["token"] == broken.token and permit["owner"] == broken.owner, (
            f"the engine's permit {permit} is not the one the handle believes it holds")

"""A client holding many leases keeps every one of them through its renewer's ticks."""

from __future__ import annotations

from manual_clock import ManualClock

import queen_sync as qs
from queen_sync._ops import LockOps

LEASES = 1500


def _engine_tokens(q: qs.Queen, names: list[str]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for start in range(0, len(names), 500):
        chunk = names[start:start + 500]
        for name, answer in zip(chunk, q.locks.batch([LockOps.get(n) for n in chunk])):
            tokens[name] = [holder["token"] for holder in answer["holders"]]
    return tokens


class TestManyLeases:
    def test_every_lease_is_renewed_by_one_call_per_tick_and_the_engine_agrees(
            self, engine_url: str) -> None:
        # The engine's own clock is real, so the lifetime is long and only the local one moves.
        clock = ManualClock()
        with qs.Queen(engine_url, clock=clock, renew_thread=False) as q:
            locks = [q.lock(f"many-{i:05d}", ttl=3600) for i in range(LEASES)]
            for lock in locks:
                assert lock.acquire(), f"{lock.name} should be free"
            for tick in range(2):
                before = [lock.token for lock in locks]
                calls = q.renewer.calls
                clock.advance(1201)  # past a third of the lifetime: every lease is due
                q.renewer.tick()
                assert q.renewer.calls == calls + 1, f"tick {tick}: one call renews them all"
                lost = [lock.name for lock in locks if not lock.held]
                assert not lost, f"tick {tick}: {len(lost)} leases lost, e.g. {lost[:3]}"
                stale = [lock.name for lock, old in zip(locks, before)
                         if lock.token is None or old is None or lock.token <= old]
                assert not stale, f"tick {tick}: leases not renewed to a higher token: {stale[:3]}"
            engine = _engine_tokens(q, [lock.name for lock in locks])
            wrong = [lock.name for lock in locks if engine[lock.name] != [lock.token]]
            assert not wrong, f"the engine holds other tokens than the handles: {wrong[:3]}"

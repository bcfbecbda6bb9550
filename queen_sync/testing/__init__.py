"""Test your own code against a Queen broker without running one.

```python
from queen_sync.testing import FakeBroker

def test_only_one_copy_runs():
    with FakeBroker() as broker:
        q1, q2 = broker.client(), broker.client()
        assert q1.lock("report", ttl=30).acquire()
        assert not q2.lock("report", ttl=30).acquire()
        q1.close()
        q2.close()
```

- ``FakeBroker``: in-process (a ``requests`` transport of its own answers its URL),
  no socket; the fastest, and the place to inject faults into single calls.
- ``LocalBroker``: a real HTTP server on 127.0.0.1 on an ephemeral port, to cross
  a real socket, stop and restart "the broker", and share one store between
  several processes. A test and demo tool, not a production broker.
- ``broker.faults``: fail the next calls with a status, a timeout, a connection
  reset, a refused connection (FakeBroker only) or a delay; or a random share of
  all calls (``chaos``).
- ``FaultyEngine(engine_or_url)``: any engine (SQLite, PostgreSQL, HTTP) whose next
  calls fail, stall or run a hook, before they reach it or after they were applied;
  ``Queen(engine=FaultyEngine(...))``.
- ``clock=`` on either broker: the epoch-seconds clock its store judges expiry by, so
  a test moves time past a TTL instead of sleeping.
- ``broker.paused(lock)``: the holder's lease ends on the broker while its code
  goes on believing it holds it; what it writes in the block must be fenced out.
- ``broker.assert_no_stale_writes()`` for guarded transactions, and ``TokenLedger``
  for your own sink: fail when a write with a superseded token landed.
- ``broker.pushed(queue)``, ``broker.acked()``, ``broker.timers(queue)``: the queue
  riders committed transactions carried (a bundle whose guard lost carried none).

Both brokers answer every route with the semantics of the embedded engine (they
run it, on an SQLite file), so a test written against one passes against the
real broker's semantics too.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Optional

from ._core import FaultPlan
from ._fake import FakeBroker
from ._faulty import FaultyEngine
from ._local import LocalBroker

__all__ = ["FakeBroker", "FaultPlan", "FaultyEngine", "LocalBroker", "TokenLedger"]


@dataclass(frozen=True)
class _Write:
    token: int
    what: Any


class TokenLedger:
    """Your sink's record of the fencing tokens of the writes that landed, in order.

    ```python
    ledger = TokenLedger()

    def save(report, token):          # your sink, in a test
        db.write(report)
        ledger.record(token, report)

    ...                               # run the workload, with a paused holder
    ledger.assert_no_stale_writes()   # fails if a superseded holder's write landed
    ```

    A write may carry the same token as the one before (one holder writes many
    times); a LOWER token landing after a higher one is a stale write.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writes: list[_Write] = []

    def record(self, token: Optional[int], what: Any = None) -> None:
        """Note that a write carrying ``token`` landed (call it where the write lands)."""
        if isinstance(token, bool) or not isinstance(token, int):
            raise TypeError(f"token must be an int (lock.token read at write time), got {token!r}")
        with self._lock:
            self._writes.append(_Write(token, what))

    @property
    def tokens(self) -> list[int]:
        """The tokens of the writes that landed, in order."""
        with self._lock:
            return [w.token for w in self._writes]

    def assert_no_stale_writes(self) -> None:
        """Raise ``AssertionError`` naming the first write whose token was superseded."""
        with self._lock:
            writes = list(self._writes)
        highest: Optional[_Write] = None
        for write in writes:
            if highest is not None and write.token < highest.token:
                raise AssertionError(
                    f"a stale write landed: token {write.token} ({write.what!r}) after token "
                    f"{highest.token} ({highest.what!r})")
            if highest is None or write.token > highest.token:
                highest = write

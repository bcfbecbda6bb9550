"""queen_sync: synchronous leases with fencing tokens.

```python
import queen_sync as qs

with qs.Queen() as q:                        # an SQLite file in your state directory
    lock = q.lock("daily-report", ttl="2m")  # renewed in the background while held
    with lock:
        q.transaction().guard(lock).kv.put("reports", "today", {"rows": 42}, ttl="1d").commit()
```
"""

from __future__ import annotations

from ._client import Locks, Queen, connect
from ._default import default_client
from ._durations import Duration, parse_duration
from ._engines.base import Capabilities, Engine
from ._errors import (
    EngineError,
    EngineUnavailableError,
    FencedOutError,
    LockBusyError,
    LockError,
    LockLostError,
    LockNotHeldError,
    ProtocolError,
    QueenError,
    QueenHttpError,
    QueenHttpRequestError,
    RequestError,
    StoreReplacedError,
    UnsupportedOperationError,
)
from ._front.singleton import singleton_job
from ._handle.kv import Kv
from ._handle.lock import Lock, current_lock
from ._handle.transaction import Transaction
from ._metrics import Metrics
from ._results import Holder, Result, RunResult
from ._version import __version__

__all__ = [
    "Capabilities",
    "Duration",
    "Engine",
    "EngineError",
    "EngineUnavailableError",
    "FencedOutError",
    "Holder",
    "Kv",
    "Lock",
    "LockBusyError",
    "LockError",
    "LockLostError",
    "LockNotHeldError",
    "Locks",
    "Metrics",
    "ProtocolError",
    "Queen",
    "QueenError",
    "QueenHttpError",
    "QueenHttpRequestError",
    "RequestError",
    "Result",
    "RunResult",
    "StoreReplacedError",
    "Transaction",
    "UnsupportedOperationError",
    "__version__",
    "connect",
    "current_lock",
    "default_client",
    "parse_duration",
    "singleton_job",
]


def load_ipython_extension(ipython: object) -> None:
    """``%load_ext queen_sync``: register the ``%%lock NAME --ttl 10m`` cell magic."""
    from ._front.magic import register

    register(ipython)

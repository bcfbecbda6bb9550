"""What the test brokers keep of the queue riders of the transactions they committed.

A test broker runs no queues: it checks each push, ack and timer as a broker would
on receipt, and once the bundle's KV part (guards first) has committed it records
them, so a test can read back what landed, and see that a lost guard landed
nothing. A pushed item whose ``transactionId`` this queue already holds is answered
``duplicate`` and kept once, as the broker's deduplication does for a resent bundle.
Acks are recorded as sent, not matched to messages, and leases are not checked.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from .._errors import RequestError
from .._handle.queue_ops import check_queue_operation, check_timer_op, flat_count


@dataclass(frozen=True)
class Riders:
    """A transaction body split into its queue operations, timers and KV-only remainder."""

    operations: list[Mapping[str, Any]]
    timers: list[Mapping[str, Any]]
    kv_body: dict[str, Any]

    @classmethod
    def read(cls, body: Mapping[str, Any]) -> Riders:
        """Check the riders of ``body`` (``RequestError`` for a malformed one) and split them."""
        operations, timers = body.get("operations") or [], body.get("timers") or []
        if not isinstance(operations, list) or not isinstance(timers, list):
            raise RequestError("a transaction's operations and timers must be lists",
                               code="bad_request")
        for op in operations:
            check_queue_operation(op)
        for op in timers:
            check_timer_op(op)
        kv_body = {"operations": [], "requiredLeases": [], "kv": body.get("kv") or []}
        return cls(operations, timers, kv_body)

    @property
    def present(self) -> bool:
        return bool(self.operations or self.timers)

    @property
    def before_kv(self) -> int:
        """How many results the queue operations take ahead of the KV rider's."""
        return flat_count(self.operations)


@dataclass
class QueueRecord:
    """Pushed messages, acks and live timers, in the order they committed."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    acks: list[dict[str, Any]] = field(default_factory=list)
    live_timers: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def apply(self, riders: Riders) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Record a committed bundle's riders; the results of its operations, of its timers."""
        with self.lock:
            results: list[dict[str, Any]] = []
            for op in riders.operations:
                if op["type"] == "push":
                    results.extend(self._push(item) for item in op["items"])
                else:
                    self.acks.append(dict(op))
                    results.append({"type": "ack", "transactionId": op["transactionId"],
                                    "status": "acked"})
            return results, [self._timer(op) for op in riders.timers]

    def _push(self, item: Mapping[str, Any]) -> dict[str, Any]:
        seen = any(m["queue"] == item["queue"] and m["transactionId"] == item["transactionId"]
                   for m in self.messages)
        if not seen:
            self.messages.append(dict(item))
        return {"type": "push", "queue": item["queue"], "transactionId": item["transactionId"],
                "status": "duplicate" if seen else "queued"}

    def _timer(self, op: Mapping[str, Any]) -> dict[str, Any]:
        key = (op["queue"], op["timerKey"])
        if op["op"] == "cancel":
            gone = self.live_timers.pop(key, None)
            return {"op": "cancel", "timerKey": op["timerKey"],
                    "status": "cancelled" if gone is not None else "absent"}
        self.live_timers[key] = dict(op)
        return {"op": op["op"], "timerKey": op["timerKey"], "txn": op["txn"],
                "status": "scheduled"}

    def pushed(self, queue: Optional[str]) -> list[dict[str, Any]]:
        with self.lock:
            return [dict(m) for m in self.messages if queue is None or m["queue"] == queue]

    def acked(self) -> list[dict[str, Any]]:
        with self.lock:
            return [dict(a) for a in self.acks]

    def timers(self, queue: Optional[str]) -> list[dict[str, Any]]:
        with self.lock:
            return [dict(t) for (q, _), t in self.live_timers.items()
                    if queue is None or q == queue]

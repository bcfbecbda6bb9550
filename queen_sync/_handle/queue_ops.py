"""Queue riders of a transaction: pushed items, acks and timers, in the Queen broker's shapes.

The one place these ops are shaped and checked. They go out as the official Queen
client sends them in its JSON transaction body, field for field and in the same
order, so a bundle means the same to a broker whichever client built it:

- a push is ``{"type": "push", "items": [{queue, payload, transactionId, partition?,
  traceId?}]}``; an item's payload is its ``data``, else its ``payload``, else the
  whole dict; a missing ``transactionId`` is minted here (a UUID), so a resent
  bundle carries the same ids and the broker can drop the copy;
- an ack is ``{"type": "ack", transactionId, partitionId, status, consumerGroup?,
  leaseId?}``, and its lease also goes to the body's ``requiredLeases``;
- a timer is ``{op: "schedule"|"reschedule", queue, timerKey, payload (base64 of
  the JSON text), delayMs, txn, partition?, payloadZstd?}`` or ``{op: "cancel",
  queue, timerKey, txn?}``; it rides in the body's ``timers``, after the KV ops.

``failedIndex`` counts each pushed item and each ack first, then the KV ops, then
the timers (``flat_count``). The check functions are what the test brokers run on
what they receive, so a malformed rider is refused there as a broker would.
"""

from __future__ import annotations

import base64
import json
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, Optional

from .._errors import RequestError
from .._ops import check_value

TIMER_OPS = frozenset({"schedule", "reschedule", "cancel"})
ACK_CONTEXT_KEYS = frozenset({"consumer_group"})
_UUID4 = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}",
                    re.IGNORECASE)


def _bad(message: str) -> RequestError:
    return RequestError(message, code="bad_request")


def check_text(value: Any, what: str) -> str:
    """A non-empty str: ``TypeError`` for another type, ``ValueError`` when empty."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{what} must not be empty")
    return value


def mint_id() -> str:
    return str(uuid.uuid4())


def push_op(queue: str, partition: Optional[str], items: Any) -> dict[str, Any]:
    """One push of ``items`` (a dict or a list of dicts) to ``queue``."""
    check_text(queue, "queue name")
    if partition is not None:
        check_text(partition, "partition")
    batch = [items] if isinstance(items, Mapping) else items
    if not isinstance(batch, (list, tuple)):
        raise TypeError(f"push takes a dict or a list of dicts, got {type(items).__name__}")
    return {"type": "push", "items": [_item(queue, partition, item) for item in batch]}


def _item(queue: str, partition: Optional[str], item: Any) -> dict[str, Any]:
    if not isinstance(item, Mapping):
        raise TypeError(f"a pushed item must be a dict (its 'data' is the message), got "
                        f"{type(item).__name__}")
    if "data" in item:
        payload = item["data"]
    elif "payload" in item:
        payload = item["payload"]
    else:  # the dict is the message itself
        payload = dict(item)
    given = item.get("transactionId")
    shaped: dict[str, Any] = {"queue": queue, "payload": check_value(payload),
                              "transactionId": check_text(given, "transactionId")
                              if given else mint_id()}
    if partition is not None:
        shaped["partition"] = partition
    trace = item.get("traceId")
    # Only a UUID4 travels, as with the official client; anything else is left out.
    if isinstance(trace, str) and _UUID4.fullmatch(trace):
        shaped["traceId"] = trace
    return shaped


def ack_ops(messages: Any, status: str, context: Optional[Mapping[str, Any]]
            ) -> list[dict[str, Any]]:
    """One ack per message; each message is a dict as popped (transactionId, partitionId)."""
    check_text(status, "ack status")
    group = _consumer_group(context)
    batch = list(messages) if isinstance(messages, (list, tuple)) else [messages]
    return [_ack(message, status, group) for message in batch]


def _consumer_group(context: Optional[Mapping[str, Any]]) -> Optional[str]:
    if context is None:
        return None
    if not isinstance(context, Mapping):
        raise TypeError(f"context must be a dict, got {type(context).__name__}")
    # A misspelt key would ack in the default group without a word, so it is refused.
    unknown = sorted(set(context) - ACK_CONTEXT_KEYS)
    if unknown:
        raise ValueError(f"unknown ack context keys {unknown}; known: {sorted(ACK_CONTEXT_KEYS)}")
    group = context.get("consumer_group")
    return check_text(group, "consumer_group") if group else None


def _ack(message: Any, status: str, group: Optional[str]) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ValueError(f"an ack needs the message as popped (a dict with transactionId and "
                         f"partitionId), got {type(message).__name__}")
    transaction_id = message.get("transactionId") or message.get("id")
    if not transaction_id:
        raise ValueError("an acked message needs a transactionId (or id)")
    # Transaction ids are unique only within a partition: without it the wrong one is acked.
    if not message.get("partitionId"):
        raise ValueError("an acked message needs its partitionId")
    op: dict[str, Any] = {"type": "ack",
                          "transactionId": check_text(transaction_id, "transactionId"),
                          "partitionId": check_text(message["partitionId"], "partitionId"),
                          "status": status}
    if group is not None:
        op["consumerGroup"] = group
    lease = message.get("leaseId")
    if lease:
        op["leaseId"] = check_text(lease, "leaseId")
    return op


def encode_timer_payload(payload: Any) -> str:
    """Base64 of the payload's JSON text (bytes go as they are): what the timer delivers."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        raw = bytes(payload)
    else:
        raw = json.dumps(check_value(payload)).encode("utf-8")
    return base64.b64encode(raw).decode("ascii")


def delay_ms_of(delay_ms: Any, delay: Any) -> int:
    """The one wire field for a timer's delay, from ``after_ms(n)`` or ``after(timedelta)``."""
    if delay is not None and delay_ms is not None:
        raise ValueError("give a timer's delay once: after_ms(n) or after(timedelta)")
    if delay is not None:
        if not isinstance(delay, timedelta):
            raise TypeError(f"after() takes a timedelta, got {type(delay).__name__}; "
                            "use after_ms() for milliseconds")
        return math.floor(delay.total_seconds() * 1000)
    if delay_ms is None:
        raise ValueError("a timer needs a delay: after_ms(n) or after(timedelta); the broker "
                         "counts it from when it commits the bundle")
    if isinstance(delay_ms, bool) or not isinstance(delay_ms, (int, float)):
        raise TypeError(f"after_ms() takes a number of milliseconds, got "
                        f"{type(delay_ms).__name__}")
    if not math.isfinite(delay_ms):
        raise ValueError(f"after_ms() takes a finite number, got {delay_ms!r}")
    return int(delay_ms)


def timer_op(queue: str, key: Optional[str], payload: Any, *, delay_ms: Any, delay: Any,
             partition: Optional[str], txn: Optional[str], zstd: bool,
             reschedule: bool) -> dict[str, Any]:
    """A ``schedule`` (or ``reschedule``: the same upsert) of timer ``key`` on ``queue``."""
    check_text(queue, "timer queue")
    if key is None:
        raise ValueError("a timer needs .key(<timer key>)")
    op: dict[str, Any] = {"op": "reschedule" if reschedule else "schedule", "queue": queue,
                          "timerKey": check_text(key, "timer key"),
                          "payload": encode_timer_payload(payload),
                          "delayMs": delay_ms_of(delay_ms, delay),
                          "txn": check_text(txn, "txn") if txn is not None else mint_id()}
    if partition is not None:
        op["partition"] = check_text(partition, "partition")
    if zstd:
        op["payloadZstd"] = True
    return op


def cancel_op(queue: str, key: Optional[str], *, txn: Optional[str]) -> dict[str, Any]:
    check_text(queue, "timer queue")
    if key is None:
        raise ValueError("a timer needs .key(<timer key>)")
    op: dict[str, Any] = {"op": "cancel", "queue": queue, "timerKey": check_text(key, "timer key")}
    if txn is not None:
        op["txn"] = check_text(txn, "txn")
    return op


def flat_count(operations: Sequence[Mapping[str, Any]]) -> int:
    """Results the queue operations take before the KV rider's: one per item, one per ack."""
    return sum(len(op.get("items") or []) if op.get("type") == "push" else 1
               for op in operations)


# ---- what a broker checks on receipt ---------------------------------------------------------


def _field(op: Mapping[str, Any], name: str, where: str) -> str:
    value = op.get(name)
    if not isinstance(value, str) or not value:
        raise _bad(f"{where} needs {name} (a non-empty string), got {value!r}")
    return value


def check_queue_operation(op: Any) -> Mapping[str, Any]:
    """One entry of a transaction's ``operations``: a push or an ack, as shaped above."""
    if not isinstance(op, Mapping):
        raise _bad(f"a transaction operation must be an object, got {type(op).__name__}")
    if op.get("type") == "push":
        items = op.get("items")
        if not isinstance(items, list):
            raise _bad("a push needs an 'items' list")
        for item in items:
            if not isinstance(item, Mapping) or "payload" not in item:
                raise _bad(f"a pushed item needs a payload, got {item!r}")
            _field(item, "queue", "a pushed item")
            _field(item, "transactionId", "a pushed item")
        return op
    if op.get("type") == "ack":
        for name in ("transactionId", "partitionId", "status"):
            _field(op, name, "an ack")
        return op
    raise _bad(f"unknown transaction operation type {op.get('type')!r}; expected push or ack")


def check_timer_op(op: Any) -> Mapping[str, Any]:
    """One entry of a transaction's ``timers``."""
    if not isinstance(op, Mapping) or op.get("op") not in TIMER_OPS:
        raise _bad(f"a timer op must be one of {sorted(TIMER_OPS)}, got {op!r}")
    _field(op, "queue", "a timer op")
    _field(op, "timerKey", "a timer op")
    if op["op"] != "cancel":
        _field(op, "payload", "a timer op")
        _field(op, "txn", "a timer op")
        delay = op.get("delayMs")
        if isinstance(delay, bool) or not isinstance(delay, int):
            raise _bad(f"a timer op needs delayMs (an integer), got {delay!r}")
    return op

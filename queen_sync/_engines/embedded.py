"""The lock and KV semantics of the embedded engines, written once over ``Storage``.

Each call (one ``locks``, ``kv`` or ``transaction`` body) is validated whole, then
run as ONE storage transaction with the engine's clock read once, so expiry is
judged at a single instant. The storage is told what the body touches (its
``Footprint``, read off the validated ops), and which lock names a step freed.
Tokens are the store-wide version counter, which nothing clears: a token exceeds
every token issued before it, whatever was released, expired or deleted in between.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, TypeVar

from .._errors import RequestError, UnsupportedOperationError
from .._ops import (
    DEFAULT_PREFIX_LIMIT,
    LOCKS_NS,
    MAX_LIMIT,
    check_kv_op,
    check_lock_op,
    guard_op,
    mint_owner,
    permit_key,
    split_permit_key,
)
from .storage import Footprint, Row, Storage, StorageTxn, restamper


class _Rollback(Exception):
    """Raised inside a step to undo all of it; ``answer`` is what the call answers instead."""

    def __init__(self, answer: Any) -> None:
        super().__init__("transaction precondition lost")
        self.answer = answer


class _Step:
    """One storage transaction, with the clock read once: expiry is judged at one instant."""

    def __init__(self, txn: StorageTxn) -> None:
        self.txn = txn
        self.now = txn.now_ms()

    def live(self, ns: str, key: str) -> Optional[Row]:
        return self.txn.read(ns, key, now_ms=self.now)

    def expires_at(self, op: Mapping[str, Any]) -> Optional[int]:
        return None if op.get("forever") else self.now + int(op["ttlSeconds"]) * 1000

    def write(self, row: Row) -> None:
        self.txn.write(row)

    def delete(self, ns: str, key: str) -> None:
        # The one rule for waking waiters: deleting a permit row frees its lock name,
        # whether a release or a key/value delete on the permits namespace did it.
        self.txn.delete(ns, key)
        permit = split_permit_key(key) if ns == LOCKS_NS else None
        if permit is not None:
            self.txn.freed(permit[0])


class _KvStep(_Step):
    """A key/value step that keeps every key's row as it first read it.

    Every op reads its key before it writes it, so that first read is the row as committed
    before the call: what a rolled-back call reports, never a row it undid.
    """

    def __init__(self, txn: StorageTxn) -> None:
        super().__init__(txn)
        self.committed: dict[tuple[str, str], Optional[Row]] = {}

    def live(self, ns: str, key: str) -> Optional[Row]:
        row = self.txn.read(ns, key, now_ms=self.now)
        self.committed.setdefault((ns, key), row)
        return row


_S = TypeVar("_S", bound=_Step)


class EmbeddedSemantics:
    """Answers the wire's bodies from a ``Storage``; shared by the SQLite and PostgreSQL engines."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def call(self, route: str, body: Mapping[str, Any]) -> dict[str, Any]:
        if type(body) is not dict and not isinstance(body, Mapping):
            raise TypeError(f"a {route} body must be a dict, got {type(body).__name__}")
        if route == "locks":
            return self.locks(checked_lock_ops(_operations(body, route)))
        if route == "kv":
            ops = _operations(body, route)
            for op in ops:
                check_kv_op(op)
            return {"results": self._run(kv_footprint(ops), _KvStep,
                                         lambda step: _kv_results(step, ops))}
        if route == "transaction":
            kv_ops = _transaction_ops(body)
            return dict(self._run(kv_footprint(kv_ops), _KvStep,
                                  lambda step: _transaction(step, kv_ops)))
        raise RequestError(f"unknown route {route!r}", code="bad_request")

    def locks(self, checked: CheckedLockOps) -> dict[str, Any]:
        """A locks body whose ops were validated already: run as one step, not checked again."""
        ops = checked.ops
        if len(ops) == 1:
            # A handle's every acquire and release: the same rule, without a batch's loop.
            # Lock rules never roll a step back, so no ``_Rollback`` handling is needed.
            op = ops[0]
            rule = _LOCK_OPS[op["op"]]
            return {"results": self.storage.transaction(
                lock_footprint(ops), lambda txn: [rule(_Step(txn), op)])}
        return {"results": self._run(lock_footprint(ops), _Step,
                                     lambda step: [_LOCK_OPS[o["op"]](step, o) for o in ops])}

    def _run(self, footprint: Footprint, step: Callable[[StorageTxn], _S],
             work: Callable[[_S], Any]) -> Any:
        try:
            return self.storage.transaction(footprint, lambda txn: work(step(txn)))
        except _Rollback as rollback:
            return rollback.answer


_MINTING_LOCK_OPS = frozenset({"acquire", "renew"})
_MINTING_KV_OPS = frozenset({"put", "putIfAbsent", "incr"})
_KEYED_KV_OPS = frozenset({"get", "put", "putIfAbsent", "delete", "incr", "check"})


def lock_footprint(ops: Sequence[Mapping[str, Any]]) -> Footprint:
    """What a validated locks body touches: the permits of the names it names."""
    if len(ops) == 1:  # the common body, read off without a pass per field
        op = ops[0]
        kind = op["op"]
        return Footprint(names=frozenset((op["name"],)), mints=int(kind in _MINTING_LOCK_OPS),
                         only_releases=kind == "release", operations=1, lone_lock_op=op,
                         lock_ops=ops)
    return Footprint(
        names=frozenset(op["name"] for op in ops),
        mints=sum(op["op"] in _MINTING_LOCK_OPS for op in ops),
        only_releases=bool(ops) and all(op["op"] == "release" for op in ops),
        operations=len(ops), lone_lock_op=ops[0] if len(ops) == 1 else None, lock_ops=ops)


def kv_footprint(ops: Sequence[Mapping[str, Any]]) -> Footprint:
    """What validated key/value ops (a ``/kv`` batch, a transaction's ``kv``) touch."""
    keys: set[tuple[str, str]] = set()
    for op in ops:
        if op["op"] in _KEYED_KV_OPS:
            keys.add((op["ns"], op["key"]))
        elif op["op"] == "getMany":
            keys.update((op["ns"], key) for key in op["keys"])
    return Footprint(keys=frozenset(keys), mints=sum(op["op"] in _MINTING_KV_OPS for op in ops),
                     operations=len(ops))


@dataclass(frozen=True)
class CheckedLockOps:
    """A locks body's ops, each validated and every acquire given its owner.

    Made only by ``checked_lock_ops`` (and ``part``), so whatever holds one may run it, or
    a part of it, without validating it again.
    """

    ops: tuple[Mapping[str, Any], ...]

    def part(self, start: int, stop: int) -> CheckedLockOps:
        return CheckedLockOps(self.ops[start:stop])


def checked_lock_ops(ops: Sequence[Any]) -> CheckedLockOps:
    """Validate a locks body's ops (raising at the first bad one) and mint missing owners."""
    if len(ops) == 1:  # a handle's every call: no loop and no list to build
        return CheckedLockOps((_with_owner(check_lock_op(ops[0])),))
    # One pass: a tick's thousands of renews are each checked, and kept, in one step.
    return CheckedLockOps(tuple([_with_owner(check_lock_op(op)) for op in ops]))


def _with_owner(op: Mapping[str, Any]) -> Mapping[str, Any]:
    """An acquire with its owner minted before the step runs, so that every attempt of
    the step, and a storage answering it in SQL, name the same owner."""
    if op["op"] != "acquire" or op.get("owner"):
        return op
    return {**op, "owner": mint_owner()}


def _operations(body: Mapping[str, Any], route: str) -> Sequence[Any]:
    ops = body.get("operations")
    if not isinstance(ops, list):
        raise RequestError(f"a {route} body needs an 'operations' list", code="bad_request")
    return ops


def _transaction_ops(body: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
    queue_ops = body.get("operations") or []
    leases = body.get("requiredLeases") or []
    if queue_ops or leases or body.get("timers"):
        raise UnsupportedOperationError(
            "queue pushes, acks, timers and required leases exist only on a Queen broker "
            "(an http:// or https:// URL); the embedded engines run KV-only transactions",
            capability="queue_operations",
        )
    kv_ops = body.get("kv") or []
    if not isinstance(kv_ops, list):
        raise RequestError("a transaction's 'kv' must be a list", code="bad_request")
    return [check_kv_op(op, in_transaction=True) for op in kv_ops]


# ---- locks -------------------------------------------------------------------------------


def _slot_of(row: Row) -> Optional[int]:
    permit = split_permit_key(row.key)
    return permit[1] if permit is not None else None


def _owner_of(row: Row) -> Optional[str]:
    """The permit's owner; ``None`` for a row put there by hand that names none as text."""
    value = row.value
    owner = value.get("owner") if isinstance(value, dict) else None
    return owner if isinstance(owner, str) else None


def _permits(step: _Step, name: str) -> list[tuple[int, Row]]:
    rows = step.txn.read_prefix(LOCKS_NS, name + "#", after=None, limit=4 * MAX_LIMIT,
                                now_ms=step.now)
    if not rows:
        return []
    slotted = [(slot, row) for row in rows if (slot := _slot_of(row)) is not None]
    return sorted(slotted, key=lambda pair: pair[0])


def _holder(slot: int, row: Row) -> dict[str, Any]:
    return {
        "slot": slot,
        "owner": _owner_of(row),
        "token": row.version,
        "since": row.created_at,
        "expiresAt": row.expires_at,
        "renewedAt": row.updated_at,
    }


def _holders(permits: Sequence[tuple[int, Row]]) -> list[dict[str, Any]]:
    return [_holder(slot, row) for slot, row in permits]


def _limit_of(row: Row) -> Optional[int]:
    value = row.value
    limit = value.get("limit") if isinstance(value, dict) else None
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def _refuse_other_limits(name: str, limit: int, permits: Sequence[tuple[int, Row]]) -> None:
    # A lock and a semaphore on one name would each count only their own slots, so
    # neither would exclude the other. Rows that record no limit predate the check.
    for slot, row in permits:
        held = _limit_of(row)
        if held is not None and held != limit:
            raise RequestError(
                f"lock {name!r} is held with limit {held} (slot {slot}); an acquire with "
                f"limit {limit} cannot share the name: use one limit per name",
                code="lock_limit_mismatch")


def _acquire(step: _Step, op: Mapping[str, Any]) -> dict[str, Any]:
    name, limit = op["name"], op.get("limit", 1)
    owner = op.get("owner") or mint_owner()
    permits = _permits(step, name)
    _refuse_other_limits(name, limit, permits)
    for slot, row in permits:
        if _owner_of(row) == owner:
            return {"acquired": True, "slot": slot, "token": row.version, "owner": owner,
                    "guard": guard_op(name, slot, row.version), "already": True}
    taken = {slot for slot, _ in permits}
    free = next((s for s in range(limit) if s not in taken), None) if taken else 0
    if free is None:
        return {"acquired": False, "reason": "held", "holders": _holders(permits)}
    token = step.txn.next_version()
    step.write(Row(LOCKS_NS, permit_key(name, free), {"owner": owner, "limit": limit}, token,
                   step.expires_at(op), step.now, step.now))
    return {"acquired": True, "slot": free, "token": token, "owner": owner,
            "guard": guard_op(name, free, token)}


def _candidates(step: _Step, op: Mapping[str, Any]) -> list[tuple[int, Row]]:
    if "slot" in op:
        row = step.live(LOCKS_NS, permit_key(op["name"], op["slot"]))
        return [(op["slot"], row)] if row is not None else []
    return _permits(step, op["name"])


def _renews(row: Row, token: int, owner: Optional[str]) -> bool:
    """Whether a renew presenting ``token`` (from ``owner``, if it says) renews ``row``.

    The current token renews. The owner's tokens since the one its last renew presented
    renew too: that renew's answer, or the answer to a resend of it, may never have
    reached the owner, and a late duplicate may have moved the row past the answer it
    did adopt. Anyone else's old token is stale.
    """
    if token == row.version:
        return owner in (None, _owner_of(row))
    floor = row.prev_version
    return (owner is not None and owner == _owner_of(row) and floor is not None
            and floor <= token < row.version)


def _renew(step: _Step, op: Mapping[str, Any]) -> dict[str, Any]:
    token, owner = op["token"], op.get("owner")
    if "slot" in op:  # a handle's every renew: its one permit, read without a list
        slot = op["slot"]
        row = step.live(LOCKS_NS, permit_key(op["name"], slot))
        if row is not None and _renews(row, token, owner):
            return _renewed(step, op, slot, row)
    else:
        for slot, row in _permits(step, op["name"]):
            if _renews(row, token, owner):
                return _renewed(step, op, slot, row)
    return {"renewed": False, "reason": "lost", "holders": _holders(_permits(step, op["name"]))}


def _renewed(step: _Step, op: Mapping[str, Any], slot: int, row: Row) -> dict[str, Any]:
    # Renewing always mints, a resend too; what it presented is the owner's floor.
    new = step.txn.next_version()
    restamper(step.txn)(Row(row.ns, row.key, row.value, new, step.expires_at(op),
                            row.created_at, step.now, prev_version=op["token"]))
    return {"renewed": True, "slot": slot, "token": new,
            "guard": guard_op(op["name"], slot, new)}


def _release(step: _Step, op: Mapping[str, Any]) -> dict[str, Any]:
    at_slot = getattr(step.txn, "delete_live_at", None) if "slot" in op else None
    if at_slot is not None:
        # The rule below, for the one permit the op names, as one statement of the storage.
        if not at_slot(LOCKS_NS, permit_key(op["name"], op["slot"]), op["token"],
                       now_ms=step.now):
            return {"released": False, "reason": "lost"}
        step.txn.freed(op["name"])
        return {"released": True}
    for _slot, row in _candidates(step, op):
        # The token the last renew presented releases too: that renew's answer may never
        # have reached its owner, who would otherwise strand the permit until its TTL.
        if op["token"] in (row.version, row.prev_version):
            step.delete(row.ns, row.key)
            return {"released": True}
    return {"released": False, "reason": "lost"}


def _get_lock(step: _Step, op: Mapping[str, Any]) -> dict[str, Any]:
    holders = _holders(_permits(step, op["name"]))
    return {"held": bool(holders), "holders": holders}


_LOCK_OPS: dict[str, Callable[[_Step, Mapping[str, Any]], dict[str, Any]]] = {
    "acquire": _acquire,
    "renew": _renew,
    "release": _release,
    "get": _get_lock,
}


# ---- key/value ---------------------------------------------------------------------------


def _row_view(row: Row, *, with_value: bool = True) -> dict[str, Any]:
    view: dict[str, Any] = {"key": row.key}
    if with_value:
        view["value"] = _own_copy(row.value)
    view.update(version=row.version, expiresAt=row.expires_at, updatedAt=row.updated_at)
    return view


def _kv_get(step: _Step, op: Mapping[str, Any]) -> dict[str, Any]:
    row = step.live(op["ns"], op["key"])
    if row is None:
        return {"found": False, "key": op["key"]}
    return {"found": True, **_row_view(row)}


def _kv_get_many(step: _Step, op: Mapping[str, Any]) -> dict[str, Any]:
    rows, missing = [], []
    for key in op["keys"]:
        row = step.live(op["ns"], key)
        if row is None:
            missing.append(key)
        else:
            rows.append(_row_view(row))
    return {"rows": rows, "missing": missing}


def _kv_get_prefix(step: _Step, op: Mapping[str, Any]) -> dict[str, Any]:
    limit = op.get("limit", DEFAULT_PREFIX_LIMIT)
    rows = list(step.txn.read_prefix(op["ns"], op["prefix"], after=op.get("after"),
                                     limit=limit + 1, now_ms=step.now))
    truncated = len(rows) > limit
    rows = rows[:limit]
    return {
        "rows": [_row_view(r, with_value=not op.get("keysOnly")) for r in rows],
        "truncated": truncated,
        "nextAfter": rows[-1].key if truncated else None,
    }


def _lost(reason: str, row: Optional[Row]) -> dict[str, Any]:
    return {"applied": False, "reason": reason, "version": row.version if row else 0,
            "value": _own_copy(row.value) if row else None}


def _own_copy(value: Any) -> Any:
    """A stored JSON value for one answer: a row kept in memory (a bundle's earlier read)
    may answer several ops, and a caller changing one answer must change no other."""
    if isinstance(value, dict):
        return {key: _own_copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_own_copy(item) for item in value]
    return value


def _expect_fails(op: Mapping[str, Any], row: Optional[Row]) -> Optional[dict[str, Any]]:
    if "expect" not in op:
        return None
    if op["expect"] == 0:  # "must not exist": the loser is told it exists, as putIfAbsent is
        return None if row is None else _lost("exists", row)
    if row is None:
        return _lost("absent", None)
    if row.version != op["expect"]:
        return _lost("version", row)
    return None


def _store(step: _Step, op: Mapping[str, Any], value: Any, current: Optional[Row],
           expires_at: Optional[int]) -> int:
    version = step.txn.next_version()
    created = current.created_at if current is not None else step.now
    step.write(Row(op["ns"], op["key"], value, version, expires_at, created, step.now))
    return version


def _kv_put(step: _Step, op: Mapping[str, Any]) -> dict[str, Any]:
    row = step.live(op["ns"], op["key"])
    lost = _expect_fails(op, row)
    if lost is not None:
        return lost
    return _written(step, op, row)


def _written(step: _Step, op: Mapping[str, Any], current: Optional[Row]) -> dict[str, Any]:
    """Store a put's value; the answer carries it, as the broker's does.

    Both are the value as JSON keeps it (``{1: (2,)}`` is ``{"1": [2]}``), each a copy of
    its own: the caller may change its object after the call, and a read later in the
    same bundle may be answered from the row kept in memory.
    """
    text = _JSON_COPY.encode(op["value"])
    version = _store(step, op, json.loads(text), current, step.expires_at(op))
    return {"applied": True, "version": version, "value": json.loads(text)}


_JSON_COPY = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def _kv_put_if_absent(step: _Step, op: Mapping[str, Any]) -> dict[str, Any]:
    row = step.live(op["ns"], op["key"])
    if row is not None:
        return _lost("exists", row)
    return _written(step, op, None)


def _kv_delete(step: _Step, op: Mapping[str, Any]) -> dict[str, Any]:
    row = step.live(op["ns"], op["key"])
    if row is None:
        return _lost("absent", None)
    lost = _expect_fails(op, row)
    if lost is not None:
        return lost
    step.delete(op["ns"], op["key"])
    return {"applied": True}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _sum(op: Mapping[str, Any], base: Any, delta: Any) -> Any:
    """``base + delta``, refused whole when it is no finite number (JSON has none)."""
    try:
        value = base + delta
    except OverflowError:  # an integer too large for a float, added to a float
        value = math.inf
    if isinstance(value, float) and not math.isfinite(value):
        raise RequestError(
            f"incr of {op['ns']!r}/{op['key']!r} by {delta!r} would store no finite number "
            "(past the largest float)", code="kv_bad_request")
    return value


def _kv_incr(step: _Step, op: Mapping[str, Any]) -> dict[str, Any]:
    row = step.live(op["ns"], op["key"])
    if row is not None and not _is_number(row.value):
        return _lost("type", row)
    base = row.value if row is not None else 0
    value = _sum(op, base, op["delta"])
    if ("max" in op and value > op["max"]) or ("min" in op and value < op["min"]):
        return {"applied": False, "reason": "limit", "value": base,
                "version": row.version if row else 0}
    # The lifetime is set when the counter is created; later increments keep it.
    expires_at = row.expires_at if row is not None else step.expires_at(op)
    return {"applied": True, "value": value, "version": _store(step, op, value, row, expires_at)}


def _kv_check(step: _Step, op: Mapping[str, Any]) -> dict[str, Any]:
    row = step.live(op["ns"], op["key"])
    lost = _expect_fails(op, row)
    if lost is not None:
        return lost
    return {"applied": True, "version": row.version if row is not None else 0}


_KV_OPS: dict[str, Callable[[_Step, Mapping[str, Any]], dict[str, Any]]] = {
    "get": _kv_get,
    "getMany": _kv_get_many,
    "getPrefix": _kv_get_prefix,
    "put": _kv_put,
    "putIfAbsent": _kv_put_if_absent,
    "delete": _kv_delete,
    "incr": _kv_incr,
    "check": _kv_check,
}


def _as_committed(step: _KvStep, op: Mapping[str, Any], lost: dict[str, Any]) -> dict[str, Any]:
    """A lost required op's answer, its key's version and value as committed.

    Its call rolls back, so a row an earlier op of the call wrote never existed: reporting
    it would hand out a version the store may issue again, and a value nobody can read.
    """
    row = step.committed[(op["ns"], op["key"])]
    return {**lost, "version": row.version if row is not None else 0,
            "value": _own_copy(row.value) if row is not None else None}


def _kv_results(step: _KvStep, ops: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A ``/kv`` batch: ops answer on their own, unless a ``required`` one does not apply.

    Then nothing of the batch is written and the ops after it are not run; every
    answer still lines up with its op, so a caller can tell which one failed, and the
    failed one reports its key as committed.
    """
    results = []
    for index, op in enumerate(ops):
        result = {"index": index, **_KV_OPS[op["op"]](step, op)}
        if op.get("required") and result.get("applied") is False:
            failed = _as_committed(step, op, result)
            raise _Rollback([
                {**failed, "failedIndex": index} if i == index else
                {"index": i, "applied": False, "reason": "rolled_back", "failedIndex": index}
                for i in range(len(ops))
            ])
        results.append(result)
    return results


def _transaction(step: _KvStep, ops: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    results = []
    for index, op in enumerate(ops):
        result = _KV_OPS[op["op"]](step, op)
        if op.get("required") and not result["applied"]:
            failed = _as_committed(step, op, result)
            raise _Rollback({
                "success": False,
                "reason": "kv_precondition",
                "failedIndex": index,
                "kvReason": failed.get("reason"),
                "version": failed["version"],
                "value": failed["value"],
            })
        results.append({"index": index, **result})
    return {"success": True, "kv": results}

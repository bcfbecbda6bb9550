"""A reference model of the wire (DESIGN §2 and §4), small enough to check by reading.

``Reference.call(route, body, now_ms)`` answers one ``locks``, ``kv`` or
``transaction`` body the way every engine must, from a plain dict of entries
and one store-wide version counter. It is written from the wire's description,
not from an engine, so an engine that agrees with it agrees with the spec:

- a call is one atomic step at one instant ``now_ms`` (the engine's clock);
- an entry whose ``expires_at`` is not after ``now_ms`` is absent, whatever is stored;
- every write (a permit too) takes the next value of the one counter, which a
  rollback rewinds (nothing committed, so nothing was issued);
- a lock permit is the entry ``queen-locks``/``<name>#<slot>`` whose version is its token;
- a call the wire refuses (an acquire with another limit than a live permit of its
  name) answers ``{"error": code}`` and writes nothing, the rest of its body included.

Bodies are assumed valid: the model checks semantics, not argument validation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional, Sequence

LOCKS_NS = "queen-locks"
DEFAULT_PREFIX_LIMIT = 100

Answer = dict[str, Any]
Op = Mapping[str, Any]


@dataclass(frozen=True)
class Entry:
    """One stored key; times are epoch milliseconds on the engine's clock."""

    value: Any
    version: int
    expires_at: Optional[int]
    created_at: int
    updated_at: int
    prev_version: Optional[int] = None  # the token the last renew presented
    limit: Optional[int] = None  # a permit's: the limit it was acquired with


class _Rollback(Exception):
    def __init__(self, answer: Answer) -> None:
        super().__init__("rolled back")
        self.answer = answer


class _Refused(Exception):
    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


class Reference:
    """The whole store: entries by ``(ns, key)`` and the version high-water mark."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], Entry] = {}
        self.counter = 0
        self.now = 0
        self.rolled_back = False  # whether the last call was undone (its versions are void)
        self.committed: dict[tuple[str, str], Entry] = {}

    # ---- one call, one atomic step -----------------------------------------------------

    def call(self, route: str, body: Mapping[str, Any], now_ms: int) -> Answer:
        self.now, self.rolled_back = now_ms, False
        saved = (dict(self.entries), self.counter)
        self.committed = saved[0]  # what a rolled-back call reports its failed key as
        try:
            if route == "locks":
                return {"results": [self._lock_op(op) for op in body["operations"]]}
            if route == "kv":
                return self._kv_batch(body["operations"])
            if route == "transaction":
                return self._transaction(body.get("kv") or [])
        except _Rollback as rollback:
            self.entries, self.counter = saved
            self.rolled_back = True
            return rollback.answer
        except _Refused as refused:
            self.entries, self.counter = saved
            self.rolled_back = True
            return {"error": refused.code}
        raise ValueError(f"the model knows no route {route!r}")

    # ---- storage ----------------------------------------------------------------------

    def live(self, ns: str, key: str) -> Optional[Entry]:
        entry = self.entries.get((ns, key))
        if entry is None or (entry.expires_at is not None and entry.expires_at <= self.now):
            return None
        return entry

    def live_keys(self, ns: str, prefix: str) -> list[str]:
        """Live keys of ``ns`` starting with ``prefix``, in code point (UTF-8 byte) order."""
        keys = [k for (n, k) in self.entries if n == ns and k.startswith(prefix)]
        return sorted(k for k in keys if self.live(ns, k) is not None)

    def _mint(self) -> int:
        self.counter += 1
        return self.counter

    def _expiry(self, op: Op) -> Optional[int]:
        return None if op.get("forever") else self.now + int(op["ttlSeconds"]) * 1000

    # ---- locks ------------------------------------------------------------------------

    def permits(self, name: str) -> list[tuple[int, Entry]]:
        """The live permits of ``name`` by slot."""
        found = []
        for key in self.live_keys(LOCKS_NS, name + "#"):
            tail = key[len(name) + 1:]
            entry = self.live(LOCKS_NS, key)
            if tail.isdigit() and entry is not None:
                found.append((int(tail), entry))
        return sorted(found, key=lambda pair: pair[0])

    def limit_of(self, name: str) -> Optional[int]:
        """The limit the live permits of ``name`` were acquired with (one, or none live)."""
        limits = {entry.limit for _, entry in self.permits(name)}
        assert len(limits) <= 1, f"the model let {name!r} hold two limits: {limits}"
        return next(iter(limits), None)

    def holders(self, name: str) -> list[Answer]:
        return [{"slot": slot, "owner": e.value.get("owner"), "token": e.version,
                 "since": e.created_at, "expiresAt": e.expires_at, "renewedAt": e.updated_at}
                for slot, e in self.permits(name)]

    def _lock_op(self, op: Op) -> Answer:
        handlers: dict[str, Callable[[Op], Answer]] = {
            "acquire": self._acquire, "renew": self._renew, "release": self._release,
            "get": self._get_lock}
        return handlers[op["op"]](op)

    def _acquire(self, op: Op) -> Answer:
        name, owner, limit = op["name"], op["owner"], op.get("limit", 1)
        held = self.limit_of(name)
        if held is not None and held != limit:  # before anything, a resend included
            raise _Refused("lock_limit_mismatch")
        permits = self.permits(name)
        for slot, entry in permits:
            if entry.value.get("owner") == owner:  # a resent acquire: the same permit
                return {"acquired": True, "slot": slot, "token": entry.version, "owner": owner,
                        "guard": guard(name, slot, entry.version), "already": True}
        taken = {slot for slot, _ in permits}
        free = [slot for slot in range(limit) if slot not in taken]
        if not free:
            return {"acquired": False, "reason": "held", "holders": self.holders(name)}
        token = self._mint()
        self.entries[(LOCKS_NS, f"{name}#{free[0]}")] = Entry(
            {"owner": owner}, token, self._expiry(op), self.now, self.now, limit=limit)
        return {"acquired": True, "slot": free[0], "token": token, "owner": owner,
                "guard": guard(name, free[0], token)}

    def _candidates(self, op: Op) -> list[tuple[int, Entry]]:
        permits = self.permits(op["name"])
        return [p for p in permits if p[0] == op["slot"]] if "slot" in op else permits

    def _renew(self, op: Op) -> Answer:
        name, token, owner = op["name"], op["token"], op.get("owner")
        for slot, entry in self._candidates(op):
            mine = owner is not None and owner == entry.value.get("owner")
            current = entry.version == token and (owner is None or mine)
            # The owner's tokens from the one its last renew presented on: that renew's
            # answer, or a later one, may be lost, or overtaken by a late duplicate.
            floor = entry.prev_version
            unseen = mine and floor is not None and floor <= token < entry.version
            if current or unseen:  # renewing always mints, a resend too
                new = self._mint()
                self.entries[(LOCKS_NS, f"{name}#{slot}")] = replace(
                    entry, version=new, expires_at=self._expiry(op), updated_at=self.now,
                    prev_version=token)
                return {"renewed": True, "slot": slot, "token": new,
                        "guard": guard(name, slot, new)}
        return {"renewed": False, "reason": "lost", "holders": self.holders(name)}

    def _release(self, op: Op) -> Answer:
        # The token the last renew presented releases too: that renew's answer may never
        # have reached the owner.
        for slot, entry in self._candidates(op):
            if op["token"] in (entry.version, entry.prev_version):
                del self.entries[(LOCKS_NS, f"{op['name']}#{slot}")]
                return {"released": True}
        return {"released": False, "reason": "lost"}

    def _get_lock(self, op: Op) -> Answer:
        holders = self.holders(op["name"])
        return {"held": bool(holders), "holders": holders}

    # ---- key/value --------------------------------------------------------------------

    def _kv_op(self, op: Op) -> Answer:
        handlers: dict[str, Callable[[Op], Answer]] = {
            "get": self._get, "getMany": self._get_many, "getPrefix": self._get_prefix,
            "put": self._put, "putIfAbsent": self._put_if_absent, "delete": self._delete,
            "incr": self._incr, "check": self._check}
        return handlers[op["op"]](op)

    def _view(self, key: str, entry: Entry, *, with_value: bool = True) -> Answer:
        view: Answer = {"key": key}
        if with_value:
            view["value"] = entry.value
        view.update(version=entry.version, expiresAt=entry.expires_at,
                    updatedAt=entry.updated_at)
        return view

    def _get(self, op: Op) -> Answer:
        entry = self.live(op["ns"], op["key"])
        if entry is None:
            return {"found": False, "key": op["key"]}
        return {"found": True, **self._view(op["key"], entry)}

    def _get_many(self, op: Op) -> Answer:
        rows, missing = [], []
        for key in op["keys"]:
            entry = self.live(op["ns"], key)
            if entry is None:
                missing.append(key)
            else:
                rows.append(self._view(key, entry))
        return {"rows": rows, "missing": missing}

    def _get_prefix(self, op: Op) -> Answer:
        limit = op.get("limit", DEFAULT_PREFIX_LIMIT)
        after = op.get("after")
        keys = [k for k in self.live_keys(op["ns"], op["prefix"]) if after is None or k > after]
        page = keys[:limit]
        rows = []
        for key in page:
            entry = self.live(op["ns"], key)
            assert entry is not None
            rows.append(self._view(key, entry, with_value=not op.get("keysOnly")))
        truncated = len(keys) > limit
        return {"rows": rows, "truncated": truncated,
                "nextAfter": page[-1] if truncated else None}

    @staticmethod
    def _lost(reason: str, entry: Optional[Entry]) -> Answer:
        return {"applied": False, "reason": reason, "version": entry.version if entry else 0,
                "value": entry.value if entry else None}

    def _store(self, op: Op, value: Any, current: Optional[Entry],
               expires_at: Optional[int]) -> int:
        version = self._mint()
        created = current.created_at if current is not None else self.now
        self.entries[(op["ns"], op["key"])] = Entry(value, version, expires_at, created,
                                                    self.now)
        return version

    def _precondition(self, op: Op, entry: Optional[Entry]) -> Optional[Answer]:
        """Why ``expect`` does not hold (None when it does, or is not given)."""
        if "expect" not in op:
            return None
        if op["expect"] == 0:  # "must not exist"
            return None if entry is None else self._lost("exists", entry)
        if entry is None:  # expect never creates a key
            return self._lost("absent", None)
        return None if entry.version == op["expect"] else self._lost("version", entry)

    def _put(self, op: Op) -> Answer:
        entry = self.live(op["ns"], op["key"])
        lost = self._precondition(op, entry)
        if lost is not None:
            return lost
        return {"applied": True, "value": op["value"],
                "version": self._store(op, op["value"], entry, self._expiry(op))}

    def _put_if_absent(self, op: Op) -> Answer:
        entry = self.live(op["ns"], op["key"])
        if entry is not None:
            return self._lost("exists", entry)
        return {"applied": True, "value": op["value"],
                "version": self._store(op, op["value"], None, self._expiry(op))}

    def _delete(self, op: Op) -> Answer:
        entry = self.live(op["ns"], op["key"])
        if entry is None:
            return self._lost("absent", None)
        lost = self._precondition(op, entry)
        if lost is not None:
            return lost
        del self.entries[(op["ns"], op["key"])]
        return {"applied": True}

    def _incr(self, op: Op) -> Answer:
        entry = self.live(op["ns"], op["key"])
        if entry is not None and not is_number(entry.value):
            return self._lost("type", entry)
        base = entry.value if entry is not None else 0
        value = base + op["delta"]
        if ("max" in op and value > op["max"]) or ("min" in op and value < op["min"]):
            return {"applied": False, "reason": "limit", "value": base,
                    "version": entry.version if entry else 0}
        # A counter's lifetime is set when it is created; increments keep it.
        expires_at = entry.expires_at if entry is not None else self._expiry(op)
        return {"applied": True, "value": value,
                "version": self._store(op, value, entry, expires_at)}

    def _check(self, op: Op) -> Answer:
        entry = self.live(op["ns"], op["key"])
        lost = self._precondition(op, entry)
        if lost is not None:
            return lost
        return {"applied": True, "version": entry.version if entry is not None else 0}

    def _kv_batch(self, ops: Sequence[Op]) -> Answer:
        """Independent ops, unless a ``required`` one does not apply: then nothing does."""
        results = []
        for index, op in enumerate(ops):
            result = {"index": index, **self._kv_op(op)}
            if op.get("required") and not result["applied"]:
                result = self._as_committed(op, result)
                raise _Rollback({"results": [
                    {**result, "failedIndex": index} if i == index else
                    {"index": i, "applied": False, "reason": "rolled_back", "failedIndex": index}
                    for i in range(len(ops))]})
            results.append(result)
        return {"results": results}

    def _as_committed(self, op: Op, lost: Answer) -> Answer:
        """A lost required op's answer with its key's version and value as committed."""
        entry = self.committed.get((op["ns"], op["key"]))
        if entry is not None and entry.expires_at is not None and entry.expires_at <= self.now:
            entry = None
        return {**lost, "version": entry.version if entry else 0,
                "value": entry.value if entry else None}

    def _transaction(self, ops: Sequence[Op]) -> Answer:
        results = []
        for index, op in enumerate(ops):
            result = self._kv_op(op)
            if op.get("required") and not result["applied"]:
                result = self._as_committed(op, result)
                raise _Rollback({
                    "success": False, "reason": "kv_precondition", "failedIndex": index,
                    "kvReason": result.get("reason"), "version": result.get("version", 0),
                    "value": result.get("value")})
            results.append({"index": index, **result})
        return {"success": True, "kv": results}


def guard(name: str, slot: int, token: int) -> Answer:
    """The KV check that passes only while the permit is at ``token``."""
    return {"op": "check", "ns": LOCKS_NS, "key": f"{name}#{slot}", "expect": token,
            "required": True}


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)

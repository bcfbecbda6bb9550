"""Op builders: the one place a lock or KV operation is shaped and validated.

Every op that reaches an engine passes through ``check_lock_op``/``check_kv_op``,
whether a builder made it or a caller handed a raw dict to ``batch``. The
embedded engines run the same checks on what they receive, so a malformed op
is refused with the same error on every engine, before anything is written.

Names and keys:
- lock name: 1..256 UTF-8 bytes, no control characters (C0, DEL or C1), no ``#``;
- owner: 1..256 UTF-8 bytes, no control characters;
- namespace: 1..128 characters of ``A-Z a-z 0-9 . _ : -``, starting with a letter or digit;
- key: 1..1024 UTF-8 bytes, no control characters.

Values are JSON nested at most ``MAX_VALUE_DEPTH`` levels deep: every engine stores
and reads that back, while Python's own JSON codec fails somewhere short of a
thousand levels, and fails later, on the reading side, when the stack is deeper.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import socket
from collections.abc import Mapping
from typing import Any, Optional, Sequence

from ._durations import MAX_TTL_SECONDS
from ._errors import RequestError

LOCKS_NS = "queen-locks"
MAX_LIMIT = 1024
# Tokens and versions are 64-bit signed on every engine (PostgreSQL bigint, SQLite INTEGER).
MAX_TOKEN = (1 << 63) - 1
MAX_KEY_BYTES = 1024
MAX_KEYS = 1000
MAX_PREFIX_LIMIT = 1000
DEFAULT_PREFIX_LIMIT = 100
MAX_VALUE_DEPTH = 100

# C0, DEL and the C1 block (U+0080-U+009F), as the broker refuses them.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_NS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")

LOCK_OPS = frozenset({"acquire", "renew", "release", "get"})
KV_READ_OPS = frozenset({"get", "getMany", "getPrefix"})
KV_WRITE_OPS = frozenset({"put", "putIfAbsent", "delete", "incr", "check"})
# A bundle may read keys it names (their cost is the caller's to bound), never a prefix,
# as the broker rules: the bundle holds the lock rows while it runs.
KV_TRANSACTION_OPS = KV_WRITE_OPS | {"get", "getMany"}


def _lock_error(message: str) -> RequestError:
    return RequestError(message, code="lock_bad_request")


def _kv_error(message: str) -> RequestError:
    return RequestError(message, code="kv_bad_request")


def _text(value: Any, what: str, *, max_bytes: int, error: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__}")
    if not value:
        raise error(f"{what} must not be empty")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate: a byte of another encoding, escaped
        raise error(f"{what} {value!r} is not valid UTF-8") from None
    if size > max_bytes:
        raise error(f"{what} is longer than {max_bytes} UTF-8 bytes")
    if _CONTROL.search(value):
        raise error(f"{what} {value!r} contains a control character")
    return value


# Names and owners found valid, so that the op of every acquire and release (checked by
# its builder and again by the engine) skips the encoding and the scan. Only exact ``str``
# values are kept: they cannot change, and a subclass could answer ``==`` as it likes.
_GOOD_NAMES: dict[str, None] = {}
_GOOD_OWNERS: dict[str, None] = {}
# Entries; past it the cache starts again, so it never grows unbounded. Sized above the
# leases one client renews in a tick (10,000 names and as many owners): a smaller cache
# is cleared over and over during the tick and saves nothing.
_GOOD_MAX = 1 << 15


def _remember(good: dict[str, None], value: str) -> None:
    if type(value) is str:
        if len(good) >= _GOOD_MAX:
            good.clear()
        good[value] = None


def check_name(name: Any) -> str:
    if type(name) is str and name in _GOOD_NAMES:
        return name
    _text(name, "lock name", max_bytes=256, error=_lock_error)
    if "#" in name:
        raise _lock_error(f"lock name {name!r} contains '#', which separates name and slot")
    _remember(_GOOD_NAMES, name)
    return str.__str__(name)  # the text checked: a subclass's own __str__ may differ


def check_owner(owner: Any) -> str:
    if type(owner) is str and owner in _GOOD_OWNERS:
        return owner
    checked = _text(owner, "owner", max_bytes=256, error=_lock_error)
    _remember(_GOOD_OWNERS, checked)
    return str.__str__(checked)  # a plain str: a subclass could answer == as it likes


def mint_owner() -> str:
    """A fresh owner identity: ``host:pid:random``."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def check_int(value: Any, what: str, *, low: int, high: Optional[int] = None) -> int:
    """An int in ``low..high``; ``bool`` is never accepted as an int."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{what} must be {bound}, got {value}")
    return int(value)  # an int subclass comes back a plain int


def check_ns(ns: Any) -> str:
    if not isinstance(ns, str):
        raise TypeError(f"namespace must be a str, got {type(ns).__name__}")
    if not _NS.fullmatch(ns):
        raise _kv_error(
            f"namespace {ns!r} must be 1..128 characters of A-Z a-z 0-9 . _ : - "
            "starting with a letter or digit"
        )
    return ns


def check_key(key: Any) -> str:
    return _text(key, "key", max_bytes=MAX_KEY_BYTES, error=_kv_error)


def _shape_problem(value: Any, levels: int) -> Optional[str]:
    """Why ``value`` cannot be stored as given (None: it can), found in one walk.

    Walked without recursion, so that a value too deep for Python's stack is refused
    with a clear error instead of a RecursionError.
    """
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list, tuple)):
            if depth >= levels:
                return (f"value is nested deeper than {levels} levels of lists and objects, "
                        "which not every engine can read back")
            if isinstance(item, dict):
                clash = _colliding_key(item)
                if clash is not None:
                    return (f"value has two keys that are the same JSON key {clash!r} (JSON "
                            "keys are text): one of their values would be lost")
                children: Any = item.values()
            else:
                children = item
            stack.extend((child, depth + 1) for child in children)
    return None


_JSON_KEY_TYPES = (int, float, type(None))  # bool is an int: written true or false


def _colliding_key(obj: dict[Any, Any]) -> Optional[str]:
    """A JSON key two of ``obj``'s keys both become (a number and its text, ...), if any."""
    if all(type(k) is str for k in obj):  # the usual case: nothing to compare
        return None
    seen: set[str] = set()
    for key in obj:
        if isinstance(key, str):
            text = key
        elif isinstance(key, _JSON_KEY_TYPES):
            text = json.dumps(key)
        else:
            continue  # not a JSON key at all: the encoder refuses it with its type
        if text in seen:
            return text
        seen.add(text)
    return None


def check_value(value: Any) -> Any:
    """A JSON value; refused at the call if it cannot travel as JSON, is nested too deep,
    or has two keys that are one JSON key."""
    problem = _shape_problem(value, MAX_VALUE_DEPTH)
    if problem is not None:
        raise _kv_error(problem)
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"value must be JSON-serialisable: {exc}") from exc
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate: the wire is UTF-8 JSON
        raise _kv_error(f"value is not valid UTF-8 (a lone surrogate at index {exc.start} "
                        "of its JSON), so no engine can store it as sent") from None
    return value


def _ttl_field(op: Mapping[str, Any], *, required: bool) -> None:
    if "ttlSeconds" in op:
        check_int(op["ttlSeconds"], "ttlSeconds", low=1, high=MAX_TTL_SECONDS)
    elif required:
        raise _lock_error(f"{op.get('op')} needs ttlSeconds (a whole number > 0)")


def _expiry(op: Mapping[str, Any]) -> None:
    has_ttl = "ttlSeconds" in op
    forever = op.get("forever")
    if "forever" in op and forever is not True:
        raise _kv_error("forever must be true when given")
    if has_ttl == ("forever" in op):
        raise _kv_error(f"{op['op']} needs exactly one expiry: ttlSeconds or forever")
    if has_ttl:
        check_int(op["ttlSeconds"], "ttlSeconds", low=1, high=MAX_TTL_SECONDS)


def _expect(op: Mapping[str, Any], *, mandatory: bool = False) -> None:
    if "expect" not in op:
        if mandatory:
            raise _kv_error(f"{op['op']} needs expect (a version; 0 means absent)")
        return
    if op["expect"] is None:
        raise ValueError("expect=None is a caller bug: omit expect for an unconditional write")
    check_int(op["expect"], "expect", low=0, high=MAX_TOKEN)  # 0: the key must be absent


def _optional_bool(op: Mapping[str, Any], field: str) -> None:
    if field in op and not isinstance(op[field], bool):
        raise TypeError(f"{field} must be a bool, got {type(op[field]).__name__}")


def _number(value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        # JSON has no NaN or infinity: each engine would store or refuse them differently.
        raise ValueError(f"{what} must be a finite number, got {value!r}")


def check_lock_op(op: Any) -> Mapping[str, Any]:
    """Validate one op of ``POST /api/v1/locks``; raises TypeError or RequestError."""
    if type(op) is not dict and not isinstance(op, Mapping):  # a dict skips the ABC's check
        raise TypeError(f"a lock op must be a dict, got {type(op).__name__}")
    if type(op) is dict and _known_good(op):
        return op
    kind = op.get("op")
    if not isinstance(kind, str) or kind not in LOCK_OPS:
        raise _lock_error(f"unknown lock op {kind!r}; expected one of {sorted(LOCK_OPS)}")
    check_name(op.get("name"))
    if kind == "acquire":
        _ttl_field(op, required=True)
        if "owner" in op:
            check_owner(op["owner"])
        if "limit" in op:
            check_int(op["limit"], "limit", low=1, high=MAX_LIMIT)
    elif kind in ("renew", "release"):
        check_int(op.get("token"), "token", low=1, high=MAX_TOKEN)
        if "slot" in op:
            check_int(op["slot"], "slot", low=0, high=MAX_LIMIT - 1)
        if kind == "renew":
            _ttl_field(op, required=True)
            if "owner" in op:
                check_owner(op["owner"])
    return op


def _known_good(op: dict[str, Any]) -> bool:
    """Whether ``op`` is one ``check_lock_op`` accepts, judged in a few comparisons.

    Every acquire, renew and release a handle sends is a copy of an op checked when first
    built, so its name and owner are known good: only exact plain types, known names and
    owners and in-range numbers answer True; anything else takes the full check. Written
    out, without calls: a tick checks thousands of renews.
    """
    name, kind = op.get("name"), op.get("op")
    if type(name) is not str or name not in _GOOD_NAMES:
        return False
    if kind == "renew" or kind == "acquire":
        ttl = op.get("ttlSeconds")
        if type(ttl) is not int or not 1 <= ttl <= MAX_TTL_SECONDS:
            return False
        if "owner" in op:
            owner = op["owner"]
            if type(owner) is not str or owner not in _GOOD_OWNERS:
                return False
        if kind == "acquire":
            limit = op.get("limit", 1)
            return type(limit) is int and 1 <= limit <= MAX_LIMIT
    elif kind == "get":
        return True
    elif kind != "release":
        return False
    token, slot = op.get("token"), op.get("slot", 0)
    return (type(token) is int and 1 <= token <= MAX_TOKEN and type(slot) is int
            and 0 <= slot < MAX_LIMIT)


def check_kv_op(op: Any, *, in_transaction: bool = False) -> Mapping[str, Any]:
    """Validate one KV op; raises TypeError/ValueError or RequestError(kv_bad_request)."""
    if not isinstance(op, Mapping):
        raise TypeError(f"a KV op must be a dict, got {type(op).__name__}")
    kind = op.get("op")
    allowed = KV_TRANSACTION_OPS if in_transaction else KV_READ_OPS | KV_WRITE_OPS
    if not isinstance(kind, str) or kind not in allowed:
        where = "inside a transaction" if in_transaction else "on /kv"
        raise _kv_error(f"KV op {kind!r} is not allowed {where}; expected one of {sorted(allowed)}")
    check_ns(op.get("ns"))
    # Only a write can fail to apply and so cancel its batch; a read would carry it unused.
    if kind in KV_READ_OPS and "required" in op:
        raise _kv_error(f"{kind} cannot be required: only a write can gate its batch")
    _optional_bool(op, "required")
    if kind == "getMany":
        _check_keys(op.get("keys"))
        return op
    if kind == "getPrefix":
        _check_prefix_op(op)
        return op
    check_key(op.get("key"))
    if kind in ("put", "putIfAbsent"):
        if "value" not in op:
            raise _kv_error(f"{kind} needs a value")
        check_value(op["value"])
        _expiry(op)
    if kind in ("put", "delete", "check"):
        _expect(op, mandatory=kind == "check")
    if kind == "incr":
        _number(op.get("delta"), "delta")
        for bound in ("min", "max"):
            if bound in op:
                _number(op[bound], bound)
        _expiry(op)
    return op


def _check_keys(keys: Any) -> None:
    if not isinstance(keys, (list, tuple)):
        raise TypeError(f"keys must be a list of str, got {type(keys).__name__}")
    if len(keys) > MAX_KEYS:
        raise _kv_error(f"getMany takes at most {MAX_KEYS} keys, got {len(keys)}")
    for key in keys:
        check_key(key)


def _check_prefix_op(op: Mapping[str, Any]) -> None:
    prefix = op.get("prefix")
    _text(prefix, "prefix", max_bytes=MAX_KEY_BYTES, error=_kv_error)
    if "after" in op:
        check_key(op["after"])
    if "limit" in op:
        check_int(op["limit"], "limit", low=1, high=MAX_PREFIX_LIMIT)
    _optional_bool(op, "keysOnly")


def permit_key(name: str, slot: int) -> str:
    return f"{name}#{slot}"


_SLOT = re.compile(r"0|[1-9][0-9]{0,8}")


def split_permit_key(key: str) -> Optional[tuple[str, Optional[int]]]:
    """The lock name and slot of a permit key ``name#slot``; ``None`` when it holds no ``#``.

    Names never hold ``#``, so the last one splits. The slot is ``None`` when the tail is
    not one ``permit_key`` writes (a key put there through the KV wire, say): not a
    number in canonical form, or beyond every limit's slots.
    """
    name, sep, tail = key.rpartition("#")
    if not sep:
        return None
    slot = int(tail) if _SLOT.fullmatch(tail) else MAX_LIMIT
    return name, slot if slot < MAX_LIMIT else None


def guard_op(name: str, slot: int, token: int) -> dict[str, Any]:
    """The KV check that passes only while the permit is at this token."""
    return {"op": "check", "ns": LOCKS_NS, "key": permit_key(name, slot), "expect": token,
            "required": True}


class LockOps:
    """Builders for ``POST /api/v1/locks`` ops (optional fields are omitted, never null)."""

    @staticmethod
    def acquire(
        name: str, *, ttl_seconds: int, owner: Optional[str] = None, limit: Optional[int] = None
    ) -> dict[str, Any]:
        """An ``acquire`` op: take a free permit of ``name`` for ``ttl_seconds``."""
        op: dict[str, Any] = {"op": "acquire", "name": name, "ttlSeconds": ttl_seconds}
        if owner is not None:
            op["owner"] = owner
        if limit is not None:
            op["limit"] = limit
        return dict(check_lock_op(op))

    @staticmethod
    def renew(
        name: str,
        *,
        token: int,
        ttl_seconds: int,
        slot: Optional[int] = None,
        owner: Optional[str] = None,
    ) -> dict[str, Any]:
        """A ``renew`` op: extend the permit held at ``token``; the answer has a new token."""
        op: dict[str, Any] = {"op": "renew", "name": name, "token": token,
                              "ttlSeconds": ttl_seconds}
        if slot is not None:
            op["slot"] = slot
        if owner is not None:
            op["owner"] = owner
        return dict(check_lock_op(op))

    @staticmethod
    def release(name: str, *, token: int, slot: Optional[int] = None) -> dict[str, Any]:
        """A ``release`` op: give back the permit held at ``token``."""
        op: dict[str, Any] = {"op": "release", "name": name, "token": token}
        if slot is not None:
            op["slot"] = slot
        return dict(check_lock_op(op))

    @staticmethod
    def get(name: str) -> dict[str, Any]:
        """A lock ``get`` op: who holds ``name`` now."""
        return dict(check_lock_op({"op": "get", "name": name}))


def _flag(value: Any, what: str) -> bool:
    """A keyword flag, which must be a bool: read by its truth, ``"no"`` would mean yes."""
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be True or False, got {value!r}")
    return value


def _with_flags(op: dict[str, Any], *, expect: Any = ..., required: bool = False) -> dict[str, Any]:
    if expect is not ...:
        op["expect"] = expect
    if _flag(required, "required"):
        op["required"] = True
    return op


class KvOps:
    """Builders for KV ops: ``q.kv.op.put(...)`` and friends.

    ``expiry`` is the dict from ``expiry_fields`` (``ttlSeconds`` or ``forever``).
    ``expect`` left out means unconditional; ``expect=None`` is refused.
    """

    @staticmethod
    def get(ns: str, key: str) -> dict[str, Any]:
        """A ``get`` op: read one key."""
        return dict(check_kv_op({"op": "get", "ns": ns, "key": key}))

    @staticmethod
    def get_many(ns: str, keys: Sequence[str]) -> dict[str, Any]:
        """A ``getMany`` op: read up to 1000 keys as one snapshot."""
        if isinstance(keys, (str, bytes, Mapping)):
            # One str iterates as its characters: "config" would read c, o, n, f, i and g.
            raise TypeError(f"keys must be a list of str, not one {type(keys).__name__} "
                            f"({keys!r:.60}); pass [{keys!r:.60}]")
        return dict(check_kv_op({"op": "getMany", "ns": ns, "keys": list(keys)}))

    @staticmethod
    def get_prefix(
        ns: str,
        prefix: str,
        *,
        after: Optional[str] = None,
        limit: Optional[int] = None,
        keys_only: bool = False,
    ) -> dict[str, Any]:
        """A ``getPrefix`` op: one page of the live rows under ``prefix``, in key order."""
        op: dict[str, Any] = {"op": "getPrefix", "ns": ns, "prefix": prefix}
        if after is not None:
            op["after"] = after
        if limit is not None:
            op["limit"] = limit
        if _flag(keys_only, "keys_only"):
            op["keysOnly"] = True
        return dict(check_kv_op(op))

    @staticmethod
    def put(
        ns: str, key: str, value: Any, *, expiry: Mapping[str, Any], expect: Any = ...,
        required: bool = False,
    ) -> dict[str, Any]:
        """A ``put`` op: write ``value``; with ``expect``, only over that version."""
        op = {"op": "put", "ns": ns, "key": key, "value": value, **expiry}
        return dict(check_kv_op(_with_flags(op, expect=expect, required=required)))

    @staticmethod
    def put_if_absent(
        ns: str, key: str, value: Any, *, expiry: Mapping[str, Any], required: bool = False
    ) -> dict[str, Any]:
        """A ``putIfAbsent`` op: write ``value`` only where no live row is."""
        op = {"op": "putIfAbsent", "ns": ns, "key": key, "value": value, **expiry}
        return dict(check_kv_op(_with_flags(op, required=required)))

    @staticmethod
    def delete(ns: str, key: str, *, expect: Any = ..., required: bool = False) -> dict[str, Any]:
        """A ``delete`` op; with ``expect``, only when the row is at that version."""
        op = {"op": "delete", "ns": ns, "key": key}
        return dict(check_kv_op(_with_flags(op, expect=expect, required=required)))

    @staticmethod
    def incr(
        ns: str,
        key: str,
        *,
        expiry: Mapping[str, Any],
        delta: float = 1,
        min: Optional[float] = None,
        max: Optional[float] = None,
        required: bool = False,
    ) -> dict[str, Any]:
        """An ``incr`` op: add ``delta``, refused past ``min``/``max`` (nothing spent then)."""
        op: dict[str, Any] = {"op": "incr", "ns": ns, "key": key, "delta": delta, **expiry}
        if min is not None:
            op["min"] = min
        if max is not None:
            op["max"] = max
        return dict(check_kv_op(_with_flags(op, required=required)))

    @staticmethod
    def check(ns: str, key: str, *, expect: int, required: bool = False) -> dict[str, Any]:
        """A ``check`` op: applies only while ``key`` is at version ``expect`` (a guard)."""
        op = {"op": "check", "ns": ns, "key": key}
        return dict(check_kv_op(_with_flags(op, expect=expect, required=required)))

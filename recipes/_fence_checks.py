"""Checks every fenced sink shares: partition names, tokens, and the refusal they raise."""

from __future__ import annotations

import re
from typing import Any, Optional

import queen_sync as qs


def check_token(token: Any) -> int:
    if isinstance(token, bool) or not isinstance(token, int):
        raise TypeError(f"token must be an int (lock.token), got {type(token).__name__}")
    if token <= 0:
        raise ValueError(f"token must be > 0, got {token}")
    return int(token)


def current_token(q: qs.Queen, lock: qs.Lock) -> Optional[int]:
    holders = q.locks.get(lock.name).get("holders") or []
    return int(holders[0]["token"]) if holders else None


def fenced_out(what: str, presented: int, current: Optional[int]) -> qs.FencedOutError:
    now = f"now at token {current}" if current else "no longer held by anyone"
    return qs.FencedOutError(
        f"refusing the write of {what!r} fenced at token {presented}: the lock is {now}. "
        "Another holder took over; stop rather than retry.",
        presented=presented, current=current)


# C0, DEL and C1: what a KV key (the progress checkpoint's) and a lock name refuse.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def check_name(name: Any) -> str:
    """A partition name every sink and the progress key can store: refused whole up front,
    never halfway through a run."""
    if not isinstance(name, str):
        raise TypeError(f"a partition name must be a str, got {type(name).__name__}")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate: no file name, key or row can hold it
        raise ValueError(f"partition name {name!r} is not valid UTF-8") from None
    bad = (not name or name.startswith(".") or "/" in name or "\\" in name
           or _CONTROL.search(name) is not None or size > 200)
    if bad:
        raise ValueError(f"partition name {name!r} must be 1..200 bytes, not start with '.', "
                         "and contain no path separator or control character")
    return name

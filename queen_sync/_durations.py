"""Lifetimes: the one parser of durations and expiry arguments, and how times read as text."""

from __future__ import annotations

import math
import re
from datetime import datetime, timedelta, timezone
from typing import Any, Optional, Union

Duration = Union[int, float, timedelta, str]

# The longest lifetime any lease or key may have. Far longer and it overflows somewhere
# (SQLite's 64-bit milliseconds, the renewer's waits at a third of it, datetime's year
# 9999); ten years is inside every engine's range, so it is refused here instead.
MAX_TTL_SECONDS = 10 * 365 * 86400

# The shortest lifetime a lease may have. The renewer renews at a third of the lifetime, so
# a 10 ms lease would send hundreds of renews a second and expire before a slow call came
# back. Key/value expiry is data, not a lease: it has no minimum (the wire rounds it up).
MIN_TTL_SECONDS = 1.0

# The shortest renew interval a lease may ask for: how often the renewer renews the shortest
# lease by default (a third of it). A shorter one would bring the renew storm back that the
# minimum lifetime keeps out.
MIN_RENEW_EVERY_SECONDS = MIN_TTL_SECONDS / 3

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_UNIT_RANK = {"d": 0, "h": 1, "m": 2, "s": 3, "ms": 4}  # the order a duration is written in
# ASCII digits only: ``\d`` would take any script's digits, which no one types for seconds.
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+) *(ms|s|m|h|d) *", re.ASCII)
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?|[+-]?(?:inf|nan)",
                     re.ASCII | re.IGNORECASE)


def parse_duration(value: Duration, *, what: str = "duration") -> float:
    """Seconds in ``value``: a number of seconds, a ``timedelta`` or a string like ``"1h30m"``.

    A string is a number of seconds, or parts of ``d``, ``h``, ``m``, ``s`` and ``ms``, each
    unit at most once and largest first (``"1h 30m"``), so ``"5m5m"`` is refused, not 10
    minutes.

    Raises:
        TypeError: for a bool or a value of another type.
        ValueError: for a malformed string or a lifetime that is not positive.
    """
    seconds = _seconds(value, what)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{what} must be a positive, finite duration, got {value!r}")
    return seconds


def duration_or_zero(value: Duration, *, what: str = "duration") -> float:
    """``parse_duration``, except that zero in any spelling it reads (``0m0s``) is ``0.0``.

    For waits, where zero means "do not wait" rather than a lifetime that is over at once.
    """
    if _seconds(value, what) == 0:
        return 0.0
    return parse_duration(value, what=what)


def _seconds(value: Duration, what: str) -> float:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be seconds, a timedelta or a string like '30s', not a bool")
    if isinstance(value, (int, float)):
        return _as_float(value)
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, str):
        return _parse_text(value, what)
    kind = type(value).__name__
    raise TypeError(f"{what} must be seconds, a timedelta or a string like '30s', not {kind}")


def _as_float(value: float) -> float:
    try:
        return float(value)
    except OverflowError:  # an int too large for a float is simply too long
        return math.inf


def _parse_text(text: str, what: str) -> float:
    compact = text.strip()
    if _NUMBER.fullmatch(compact):
        return float(compact)
    pos, total, last_rank = 0, 0.0, -1
    # Each part matched where the last ended: a search from every position would make a
    # long run of digits without a unit quadratic.
    while pos < len(compact):
        match = _PART.match(compact, pos)
        if match is None or _UNIT_RANK[match.group(2)] <= last_rank:
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos, last_rank = match.end(), _UNIT_RANK[match.group(2)]
    if not compact or pos != len(compact):
        raise ValueError(f"{what}: {text!r} is not a duration (e.g. 30s, 5m, 1h30m)")
    return total


def seconds_text(seconds: Optional[float]) -> str:
    """Seconds left as ``55.0s`` (never below zero), or ``never`` for no expiry."""
    return "never" if seconds is None else f"{max(0.0, seconds):.1f}s"


def utc_text(epoch_ms: float) -> str:
    """An engine time (epoch milliseconds) as ``2024-05-01 12:00:01 UTC``."""
    moment = datetime.fromtimestamp(epoch_ms / 1000, tz=timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def wire_seconds(seconds: float) -> int:
    """Whole seconds for the wire, rounded UP so the engine never expires a lease early."""
    return max(1, math.ceil(seconds - 1e-9))


def _at_most_max(seconds: float, what: str, given: Any) -> float:
    if seconds > MAX_TTL_SECONDS:
        raise ValueError(
            f"{what} must be at most 10 years ({MAX_TTL_SECONDS} seconds), got {given!r}")
    return seconds


def lease_seconds(ttl: Duration, *, what: str = "ttl") -> float:
    """Seconds of a lease's lifetime: from ``MIN_TTL_SECONDS`` to ``MAX_TTL_SECONDS``.

    Raises:
        TypeError: for a value of the wrong type.
        ValueError: for a malformed duration, or one shorter than a second or longer than
            10 years.
    """
    seconds = _at_most_max(parse_duration(ttl, what=what), what, ttl)
    if seconds < MIN_TTL_SECONDS:
        raise ValueError(
            f"{what}: a lease must last at least {MIN_TTL_SECONDS:g} second, got {ttl!r} "
            "(it is renewed at a third of its lifetime)")
    return seconds


def renew_interval(renew_every: Optional[Duration], ttl: float) -> float:
    """Seconds between renewals of a ``ttl``-second lease: ``renew_every``, else a third of it.

    Raises:
        TypeError: for a value of the wrong type.
        ValueError: for a malformed duration, one below ``MIN_RENEW_EVERY_SECONDS``, or one
            not shorter than ``ttl``.
    """
    if renew_every is None:
        return ttl / 3
    seconds = parse_duration(renew_every, what="renew_every")
    if seconds < MIN_RENEW_EVERY_SECONDS:
        raise ValueError(
            f"renew_every must be at least {MIN_RENEW_EVERY_SECONDS:.3f}s (a third of the "
            f"shortest lease, {MIN_TTL_SECONDS:g}s), got {renew_every!r}")
    if seconds >= ttl:
        raise ValueError(f"renew_every ({seconds}s) must be shorter than ttl ({ttl}s)")
    return seconds


def lifetime(
    ttl: Optional[Duration], ttl_seconds: Optional[int], *, what: str = "ttl"
) -> float:
    """Seconds of a lease's lifetime, exactly one of ``ttl``/``ttl_seconds`` (no default).

    Raises:
        TypeError: for none or both of them, or a value of the wrong type.
        ValueError: for a lifetime shorter than a second or longer than 10 years.
    """
    if ttl is None or ttl_seconds is not None:  # whole seconds > 0 meet the minimum already
        return _one_lifetime(ttl, ttl_seconds, what)
    return lease_seconds(ttl, what=what)


def _one_lifetime(ttl: Optional[Duration], ttl_seconds: Optional[int], what: str) -> float:
    """Seconds of exactly one of ``ttl``/``ttl_seconds``, with no minimum beyond > 0."""
    if (ttl is None) == (ttl_seconds is None):
        raise TypeError(f"give exactly one of {what}= or {what}_seconds= (there is no default)")
    if ttl_seconds is not None:
        if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int):
            raise TypeError(f"{what}_seconds must be an int, got {type(ttl_seconds).__name__}")
        if ttl_seconds <= 0:
            raise ValueError(f"{what}_seconds must be > 0, got {ttl_seconds}")
        return float(_at_most_max(ttl_seconds, f"{what}_seconds", ttl_seconds))
    assert ttl is not None
    return _at_most_max(parse_duration(ttl, what=what), what, ttl)


def expiry_fields(
    *,
    ttl: Optional[Duration] = None,
    ttl_seconds: Optional[int] = None,
    until: Optional[datetime] = None,
    forever: bool = False,
) -> dict[str, Any]:
    """The wire's expiry for a KV write: ``{"ttlSeconds": n}`` or ``{"forever": True}``.

    Exactly one of ``ttl``, ``ttl_seconds``, ``until`` or ``forever=True``.
    """
    if not isinstance(forever, bool):
        raise TypeError("forever must be True or False")
    given = sum(x is not None for x in (ttl, ttl_seconds, until)) + int(forever)
    if given != 1:
        raise TypeError("give exactly one expiry: ttl=, ttl_seconds=, until= or forever=True")
    if forever:
        return {"forever": True}
    if until is not None:
        if not isinstance(until, datetime):
            raise TypeError(f"until must be a datetime, got {type(until).__name__}")
        if until.tzinfo is None:
            raise ValueError("until must be timezone-aware (e.g. datetime.now(timezone.utc))")
        seconds = (until - datetime.now(timezone.utc)).total_seconds()
        if seconds <= 0:
            raise ValueError(f"until must be in the future, got {until.isoformat()}")
        return {"ttlSeconds": wire_seconds(_at_most_max(seconds, "until", until.isoformat()))}
    return {"ttlSeconds": wire_seconds(_one_lifetime(ttl, ttl_seconds, "ttl"))}

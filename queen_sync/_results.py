"""Wire answers as dicts whose truth value is the verdict, and the typed views above them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Generic, Mapping, Optional, Sequence, TypeVar

from ._durations import seconds_text, utc_text
from ._errors import ProtocolError
from ._ops import MAX_LIMIT

T = TypeVar("T")

_VERDICTS = ("acquired", "renewed", "released", "applied", "found", "success", "held")


class Result(dict):  # type: ignore[type-arg]  # a plain JSON dict, keys are the wire's
    """The wire's answer, unchanged; ``bool(result)`` is its verdict.

    The verdict is the first of ``acquired``, ``renewed``, ``released``, ``applied``,
    ``found``, ``success``, ``held`` present; an answer with none of them (a
    ``getPrefix``/``getMany`` listing) is true when it holds any rows.
    """

    def __bool__(self) -> bool:
        for key in _VERDICTS:
            if key in self:
                return bool(self[key])
        return bool(self.get("rows"))

    def __repr__(self) -> str:
        return f"Result({dict.__repr__(self)})"


def describe_holders(holders: Sequence[Holder]) -> str:
    """``slot 0 held by OWNER since 2024-05-01 12:00:01 UTC, expires in 55.0s (token 7)``; ..."""
    if not holders:
        return "no holder reported"
    return "; ".join(
        f"slot {h.slot} held by {h.owner} since {utc_text(h.since)}, expires in "
        f"{seconds_text(h.expires_in)} (token {h.token})" for h in holders)


@dataclass(frozen=True)
class Holder:
    """One live permit, as the engine reports it (times are epoch milliseconds)."""

    slot: int
    owner: Optional[str]
    token: int
    since: int
    expires_at: Optional[int]
    renewed_at: int

    @classmethod
    def from_wire(cls, raw: Any) -> Holder:
        """Read one entry of a wire answer's ``holders`` list.

        Raises:
            ProtocolError: it is not an object of the fields ``get`` answers, typed as it does.
        """
        if not isinstance(raw, Mapping):
            raise _bad(f"a holder that is not an object: {_shown(raw)}")
        since = _count(raw, "since")
        owner, expires_at = raw.get("owner"), raw.get("expiresAt")
        if owner is not None and not isinstance(owner, str):
            raise _bad(f"a holder's owner {_shown(owner)} that is not text")
        if expires_at is not None and type(expires_at) is not int:
            raise _bad(f"a holder's expiresAt {_shown(expires_at)} that is not a whole number")
        return cls(slot=_slot(raw), owner=owner, token=_token(raw), since=since,
                   expires_at=expires_at,
                   renewed_at=_count(raw, "renewedAt") if "renewedAt" in raw else since)

    @property
    def expires_in(self) -> Optional[float]:
        """Seconds left by this machine's wall clock (an estimate: the engine's clock rules)."""
        if self.expires_at is None:
            return None
        return self.expires_at / 1000 - time.time()

    def describe(self) -> str:
        """One line for people: ``slot 0 held by OWNER (token 7, expires in 55.0s)``."""
        return (f"slot {self.slot} held by {self.owner} (token {self.token}, "
                f"expires in {seconds_text(self.expires_in)})")

    def _repr_html_(self) -> str:
        from ._notebook.html import holders_html

        return holders_html((self,))


class Holders(tuple[Holder, ...]):
    """A holder listing: a plain tuple of ``Holder`` that notebooks show as a table."""

    def _repr_html_(self) -> str:
        from ._notebook.html import holders_html

        return holders_html(self)


def holders_from_wire(raw: Any) -> tuple[Holder, ...]:
    """A lock answer's ``holders`` (absent: none).

    Raises:
        ProtocolError: it is not a list of holders (see ``Holder.from_wire``).
    """
    if raw is None:
        return Holders()
    if not isinstance(raw, list):
        raise _bad(f"holders that are not a list: {_shown(raw)}")
    return Holders(Holder.from_wire(h) for h in raw)


# ---- reading lock answers: the one place their shape is checked -------------------------
# A lease is only as safe as the token it is read as: a truthy "false" taken as acquired,
# or 7.9 taken as 7, would be a hold, or a fence, nobody granted.


def lock_verdict(answer: Mapping[str, Any], verdict: str) -> bool:
    """A lock answer's ``verdict`` (``acquired``, ``renewed``, ``released``, ``already``).

    Raises:
        ProtocolError: it is missing, or anything but true or false.
    """
    value = answer.get(verdict)
    if value is True or value is False:
        return value
    raise _bad(f"{verdict!r} of {_shown(value)}, not true or false")


def granted_permit(answer: Mapping[str, Any]) -> tuple[int, int]:
    """The token and slot an ``acquired`` or ``renewed`` answer names.

    Raises:
        ProtocolError: the token is not a whole number within ``1..2**63 - 1`` (true is
            not one), or the slot not one within ``0..MAX_LIMIT - 1``.
    """
    return _token(answer), _slot(answer)


# Tokens are stored as signed 64-bit integers: one above could never be presented back,
# and every later renew batch carrying it would be refused whole.
_MAX_TOKEN = 2**63 - 1


def _token(raw: Mapping[str, Any]) -> int:
    token = raw.get("token")
    if type(token) is not int or not 1 <= token <= _MAX_TOKEN:
        raise _bad(f"a token of {_shown(token)}, not a whole number 1..2**63-1")
    return token


def _slot(raw: Mapping[str, Any]) -> int:
    slot = raw.get("slot")
    if type(slot) is not int or not 0 <= slot < MAX_LIMIT:
        raise _bad(f"a slot of {_shown(slot)}, not a whole number 0..{MAX_LIMIT - 1}")
    return slot


def _count(raw: Mapping[str, Any], field: str) -> int:
    value = raw.get(field)
    if type(value) is not int:
        raise _bad(f"a holder's {field} of {_shown(value)}, not a whole number")
    return value


def _bad(what: str) -> ProtocolError:
    return ProtocolError(f"a locks answer with {what}", route="locks")


def _shown(value: Any) -> str:
    """``value`` for an error message, cut short: a broken answer may be any size."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class RunResult(Generic[T]):
    """What ``Lock.run`` returns: whether the lock was taken, and the function's value."""

    acquired: bool
    value: Optional[T] = None
    holders: tuple[Holder, ...] = ()

    def __getitem__(self, key: str) -> Any:
        if key in ("acquired", "value", "holders"):
            return getattr(self, key)
        raise KeyError(key)

    def __bool__(self) -> bool:
        return self.acquired

    def _repr_html_(self) -> str:
        from ._notebook.html import run_result_html

        return run_result_html(self)

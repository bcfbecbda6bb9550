"""Wire answers as dicts whose truth value is the verdict, and the typed views above them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Generic, Mapping, Optional, Sequence, TypeVar

from ._durations import seconds_text, utc_text

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
    def from_wire(cls, raw: Mapping[str, Any]) -> Holder:
        """Read one entry of a wire answer's ``holders`` list."""
        return cls(
            slot=int(raw["slot"]),
            owner=raw.get("owner"),
            token=int(raw["token"]),
            since=int(raw["since"]),
            expires_at=raw.get("expiresAt"),
            renewed_at=int(raw.get("renewedAt", raw["since"])),
        )

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


def holders_from_wire(raw: Optional[Sequence[Mapping[str, Any]]]) -> tuple[Holder, ...]:
    return Holders(Holder.from_wire(h) for h in raw or ())


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

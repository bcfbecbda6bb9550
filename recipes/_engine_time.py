"""Times the engines report (epoch milliseconds by the engine's clock) as aware datetimes."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Optional, overload


@overload
def utc(epoch_ms: int) -> datetime: ...


@overload
def utc(epoch_ms: None) -> None: ...


def utc(epoch_ms: Optional[int]) -> Optional[datetime]:
    """``epoch_ms`` as a UTC datetime; None stays None (a permit or record without it)."""
    return None if epoch_ms is None else datetime.fromtimestamp(epoch_ms / 1000, tz=timezone.utc)

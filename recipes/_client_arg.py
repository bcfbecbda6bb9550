"""The recipes' client argument: given first or as ``client=``, or by the old ``q=`` keyword."""

from __future__ import annotations

import warnings
from typing import Any, Optional

import queen_sync as qs


def check_client(client: Any, where: str) -> qs.Queen:
    """``client``, refused at construction unless it is a ``queen_sync.Queen``.

    A URL or another object would fail only at its first use, far from the mistake.
    """
    if not isinstance(client, qs.Queen):
        raise TypeError(f"{where}() needs a queen_sync.Queen as its client (its first "
                        f"argument), got {type(client).__name__}: {client!r:.60}")
    return client


def the_client(client: Optional[qs.Queen], q: Optional[qs.Queen], where: str) -> qs.Queen:
    """The client given first or as ``client=``, or by the deprecated keyword ``q=``."""
    if q is None:
        if client is None:
            raise TypeError(f"{where}() needs the client as its first argument (client=)")
        return check_client(client, where)
    if client is not None:
        raise TypeError(f"{where}() got both client and q=; pass only client")
    # Two frames up: the caller of the recipe's constructor, which is what needs changing.
    warnings.warn(f"{where}(q=...) is deprecated: pass client=... (or the client first)",
                  DeprecationWarning, stacklevel=3)
    return check_client(q, where)

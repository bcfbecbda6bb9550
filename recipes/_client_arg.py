"""The recipes' client argument: given first or as ``client=``, or by the old ``q=`` keyword."""

from __future__ import annotations

import warnings
from typing import Optional

import queen_sync as qs


def the_client(client: Optional[qs.Queen], q: Optional[qs.Queen], where: str) -> qs.Queen:
    """The client given first or as ``client=``, or by the deprecated keyword ``q=``."""
    if q is None:
        if client is None:
            raise TypeError(f"{where}() needs the client as its first argument (client=)")
        return client
    if client is not None:
        raise TypeError(f"{where}() got both client and q=; pass only client")
    # Two frames up: the caller of the recipe's constructor, which is what needs changing.
    warnings.warn(f"{where}(q=...) is deprecated: pass client=... (or the client first)",
                  DeprecationWarning, stacklevel=3)
    return q

"""Re-running a notebook cell: a new handle supersedes the kernel's own earlier one.

A cell such as ``lk = q.lock("retrain", ttl="10m"); lk.acquire()`` run twice
makes a second handle while the first (now unreachable, still renewed) holds the
permit, so the second would wait on its own kernel. Instead, when a handle
acquires inside an IPython cell, it first releases every earlier handle that

- is on the same engine URL (any client of this process) with the same name and limit,
- was acquired by this same thread in an EARLIER cell execution, and
- is not inside a ``with`` block, ``run`` or ``@singleton_job`` call right now,

with a warning naming the superseded owner. Outside IPython nothing changes:
two handles on one name contend as usual, in any thread.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from ._lock import Lock

log = logging.getLogger("queen_sync")


def cell_number() -> Optional[int]:
    """The running IPython cell's execution count, or None outside IPython (imports nothing)."""
    module = sys.modules.get("IPython")
    get_ipython = getattr(module, "get_ipython", None)
    shell = get_ipython() if get_ipython is not None else None
    count = getattr(shell, "execution_count", None)
    return count if isinstance(count, int) else None


def supersede_earlier(lock: Lock) -> None:
    """Release this thread's handles from earlier cells on ``lock``'s permits (see module doc)."""
    cell = cell_number()
    if cell is None:
        return
    from ._client import _CLIENTS

    me = threading.get_ident()
    for client in list(_CLIENTS):
        if client._closed or client.url != lock._client.url:
            continue
        for other in client.renewer.held():
            if (other is not lock and other.name == lock.name and other.limit == lock.limit
                    and other._taken_in == me and other._cell is not None
                    and other._cell != cell and not other._blocks):
                log.warning("lock %r: re-run cell %d supersedes the handle taken in cell %d "
                            "(owner %s), which is released", lock.name, cell, other._cell,
                            other.owner)
                other.release()

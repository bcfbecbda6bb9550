"""An interrupt that cuts a failed call's rollback short leaves no transaction open.

Ctrl-C, or an application's signal handler, raising as the SQLite engine begins to roll
back a call that failed leaves its connection inside ``BEGIN IMMEDIATE``: it keeps the
file's write lock, every later call of the client fails ("cannot start a transaction
within a transaction"), and other processes wait on the lock until they time out.
Cut inside the rollback, it is finished at once; cut at its very start, by the client's
next call.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any, Optional

import pytest

import queen_sync as qs

# An interrupt delivered at the start of one of these, as a signal lands at a function's
# first instruction; each is a step of a failed call's way out.
ROLLBACK_STEPS = ("_rollback", "_rollback_once")


def interrupt_at_start_of(names: tuple[str, ...]) -> Any:
    fired: list[str] = []

    def trace(frame: FrameType, event: str, arg: Any) -> Optional[Any]:
        if event == "call" and frame.f_code.co_name in names and not fired \
                and frame.f_code.co_filename.endswith("sqlite.py"):
            fired.append(frame.f_code.co_name)
            raise KeyboardInterrupt
        return None

    return trace, fired


class TestARollbackCutShortByAnInterrupt:
    @pytest.mark.parametrize("step", ROLLBACK_STEPS)
    def test_leaves_the_client_usable_and_the_file_writable_by_others(
        self, sqlite_url: str, step: str
    ) -> None:
        with qs.Queen(sqlite_url, renew_thread=False) as q, \
                qs.Queen(sqlite_url + "?busy_timeout=0.5", renew_thread=False) as other:
            q.kv.put("ns", "k", 1, forever=True)
            trace, fired = interrupt_at_start_of((step,))
            sys.settrace(trace)
            try:
                with pytest.raises(KeyboardInterrupt):
                    # A bundle whose check fails after its write ran: it rolls back.
                    q.transaction().kv.put("ns", "k2", 2, forever=True) \
                        .kv.check("ns", "k", expect=999).commit()
            finally:
                sys.settrace(None)
            assert fired == [step], "setup: the interrupt never landed"
            if step == "_rollback":
                # Cut before its first line, it did nothing: the client's next call rolls
                # back what it left open (until then the write lock is kept).
                assert q.locks.get("here")["holders"] == []
            assert other.lock("elsewhere", ttl=30).acquire(), \
                "another client could not write: the write lock was kept"
            assert q.lock("here", ttl=30).acquire()
            assert q.kv.get("ns", "k")["value"] == 1

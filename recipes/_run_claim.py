"""A worker's claim on one run: its fenced writes, and how a superseded claim is refused."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Optional

import queen_sync as qs

from ._live_state import NotCopied
from ._run_records import RUNS_NS

if TYPE_CHECKING:
    from .run_queue import RunQueue


class Claim(NotCopied):
    """This worker's claim on one run. Its writes are fenced; read ``fence`` at use time.

    ``attempt`` is this claim's place among the run's claims (1 for the first).
    """

    _remake = "hand over its run_id and let the other side claim it"

    def __init__(self, queue: RunQueue, run_id: str, payload: Any, state: Any,
                 holder: str, lock: qs.Lock, attempt: int = 1) -> None:
        self.run_id = run_id
        self.payload = payload
        self.state = state
        self.holder = holder
        self.lock = lock
        self.attempt = attempt
        self.done = False
        self._queue = queue
        self._last_fence = lock.token or 0

    @property
    def fence(self) -> int:
        """The claim's current fence (it rises at every renewal); the last one once lost."""
        token = self.lock.token
        if token is not None:
            self._last_fence = token
        return self._last_fence

    @property
    def held(self) -> bool:
        """True while the claim's lease is alive by this machine's clock."""
        return self.lock.held

    def checkpoint(self, state: Any) -> None:
        """Record ``state`` for this run (a later claimer sees it as ``claim.state``).

        Raises:
            FencedOutError: this claim was superseded or has expired.
        """
        txn = self._fenced_txn()
        txn.kv.put(RUNS_NS, self._queue._key("pending", self.run_id),
                   self._pending(state, self._record()), forever=True, required=True)
        self._commit(txn)
        self.state = state

    def complete(self, result: Any = None) -> None:
        """Record the run's result exactly once and take the run off the queue.

        Raises:
            FencedOutError: this claim was superseded, or the run was already completed.
        """
        queue = self._queue
        record = {"result": result, "holder": self.holder, "fence": self.fence,
                  "attempts": self.attempt}
        txn = self._fenced_txn()
        txn.kv.put_if_absent(RUNS_NS, queue._key("done", self.run_id), record,
                             ttl=queue.retention, required=True)
        txn.kv.delete(RUNS_NS, queue._key("pending", self.run_id), required=True)
        self._commit(txn)
        self.done = True
        self.lock.release()

    def release(self) -> bool:
        """Give the run back to the queue at once; False when the claim was already gone.

        The attempt still counts: a run given back is retaken as its next attempt.
        """
        if self.done or not self.lock.held:
            return self.lock.release()
        txn = self._queue._q.transaction().guard(self.lock)
        # A completion whose answer was lost may have landed: then nothing goes back.
        txn.kv.check(RUNS_NS, self._queue._key("done", self.run_id), expect=0, required=True)
        txn.kv.put(RUNS_NS, self._queue._key("pending", self.run_id),
                   self._pending(self.state, None), forever=True, required=True)
        with contextlib.suppress(qs.LockNotHeldError):  # expired meanwhile: nothing to undo
            txn.commit()
        return self.lock.release()

    def _pending(self, state: Any, claim: Optional[dict[str, Any]]) -> dict[str, Any]:
        return {"payload": self.payload, "attempts": self.attempt, "state": state,
                "claim": claim}

    def _record(self) -> dict[str, Any]:
        expires_ms = int((time.time() + self.lock.remaining) * 1000)
        return {"holder": self.holder, "fence": self.fence, "expiresAt": expires_ms}

    def _fenced_txn(self) -> qs.Transaction:
        if self.done:
            raise qs.FencedOutError(f"run {self.run_id!r} is already completed by this claim",
                                    presented=self.fence, current=self.fence,
                                    run_id=self.run_id)
        if not self.lock.held:
            raise self._fenced_out(None)
        return self._queue._q.transaction().guard(self.lock)

    def _commit(self, txn: qs.Transaction) -> None:
        try:
            answer = txn.commit()
        except qs.LockNotHeldError as exc:
            raise self._fenced_out(None) from exc
        if answer:
            return
        if answer.get("failedIndex") == 0:
            raise self._fenced_out(answer.get("version") or None)
        value = answer.get("value")
        done_fence = value.get("fence") if isinstance(value, dict) else None
        raise qs.FencedOutError(
            f"run {self.run_id!r} was already completed (fence {done_fence})",
            presented=self.fence, current=done_fence, run_id=self.run_id)

    def _fenced_out(self, current: Optional[int]) -> qs.FencedOutError:
        if current is None:
            current = self._queue._current_fence(self.run_id)
        now = f"claimed at {current}" if current else "no longer claimed by anyone"
        return qs.FencedOutError(
            f"refusing a write for run {self.run_id!r} fenced at {self.fence}: the run is now "
            f"{now}. Another worker took it over, so this one no longer holds it; stop the "
            "run rather than retrying (the claim is gone, not busy).",
            presented=self.fence, current=current, run_id=self.run_id)

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if not self.done:
            self.release()

    def __repr__(self) -> str:
        state = "completed" if self.done else ("held" if self.held else "lost")
        return (f"<Claim {self.run_id!r} fence={self.fence} attempt={self.attempt} {state} "
                f"holder={self.holder!r}>")

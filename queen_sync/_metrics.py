"""Counters and timings every client keeps, readable as a dict or as Prometheus text.

The label set is closed (outcomes only; lock names are never labels), so the
number of series stays the same whatever the workload.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

OUTCOMES = (
    "acquired", "busy", "renewed", "renew_error", "lost_renew", "lost_guard", "lost_expired",
    "lost_closed",
    "released",
)
TIMINGS = ("acquire_wait_seconds", "acquire_gave_up_seconds", "renew_rtt_seconds")
_TIMING_HELP = {
    "acquire_wait_seconds": "Time from asking to holding, per successful acquire (contention).",
    "acquire_gave_up_seconds": "Time spent by each acquire whose wait ran out while busy.",
    "renew_rtt_seconds": "Round trip of each batched renew call (engine health).",
}


class Metrics:
    """Thread-safe counters by outcome, a ``held`` gauge and timing summaries."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(OUTCOMES, 0)
        self._held = 0
        self._timings = {name: [0, 0.0, 0.0] for name in TIMINGS}  # count, sum, max
        self._min_margin: Optional[float] = None

    def count(self, outcome: str, n: int = 1) -> None:
        """Add ``n`` to the counter of ``outcome`` (one of ``OUTCOMES``)."""
        with self._lock:
            self._counts[outcome] += n

    def held(self, delta: int) -> None:
        """Move the ``held`` gauge (leases held now) by ``delta``; it never goes below 0."""
        with self._lock:
            self._held = max(0, self._held + delta)

    def released(self, *, held: bool) -> None:
        """One release call answered: counted, and out of the ``held`` gauge when it held."""
        with self._lock:
            self._counts["released"] += 1
            if held:
                self._held = max(0, self._held - 1)

    def acquired(self, waited: float) -> None:
        """One acquire took a lease after ``waited`` seconds: counted, held, timed at once."""
        with self._lock:
            self._counts["acquired"] += 1
            self._held += 1
            entry = self._timings["acquire_wait_seconds"]
            entry[0] += 1
            entry[1] += waited
            entry[2] = max(entry[2], waited)

    def observe(self, timing: str, seconds: float) -> None:
        """Record one duration of ``timing`` (one of ``TIMINGS``): its count, sum and max."""
        with self._lock:
            entry = self._timings[timing]
            entry[0] += 1
            entry[1] += seconds
            entry[2] = max(entry[2], seconds)

    def margin(self, seconds: float) -> None:
        """Seconds that were left before a deadline when a renew succeeded."""
        with self._lock:
            if self._min_margin is None or seconds < self._min_margin:
                self._min_margin = seconds

    def renewals(self, n: int, *, margin: float) -> None:
        """``n`` renews of one batch succeeded; ``margin``: the least time any had left.

        One update for the whole batch: a renewer's tick renews thousands of leases.
        """
        if n <= 0:
            return
        with self._lock:
            self._counts["renewed"] += n
            if self._min_margin is None or margin < self._min_margin:
                self._min_margin = margin

    def snapshot(self) -> dict[str, Any]:
        """A copy of every figure: counts, held, timings and the smallest renew margin."""
        with self._lock:
            return {
                "counts": dict(self._counts),
                "held": self._held,
                **{name: {"count": c, "sum": s, "max": m}
                   for name, (c, s, m) in self._timings.items()},
                "renew_margin_min_seconds": self._min_margin,
            }

    def prometheus_text(self) -> str:
        """The figures in the Prometheus text exposition format."""
        snap = self.snapshot()
        lines = [
            "# HELP queen_sync_lock_events_total Lock handle events by outcome.",
            "# TYPE queen_sync_lock_events_total counter",
        ]
        lines += [f'queen_sync_lock_events_total{{outcome="{k}"}} {v}'
                  for k, v in snap["counts"].items()]
        lines += [
            "# HELP queen_sync_held_leases Leases this client holds now.",
            "# TYPE queen_sync_held_leases gauge",
            f"queen_sync_held_leases {snap['held']}",
        ]
        for name in TIMINGS:
            metric = f"queen_sync_{name}"
            lines += [f"# HELP {metric} {_TIMING_HELP[name]}", f"# TYPE {metric} summary",
                      f"{metric}_count {snap[name]['count']}",
                      f"{metric}_sum {snap[name]['sum']:.6f}"]
        margin = snap["renew_margin_min_seconds"]
        lines += [
            "# HELP queen_sync_renew_margin_min_seconds Smallest time left before a deadline "
            "when a renew succeeded.",
            "# TYPE queen_sync_renew_margin_min_seconds gauge",
            f"queen_sync_renew_margin_min_seconds {'NaN' if margin is None else f'{margin:.6f}'}",
        ]
        return "\n".join(lines) + "\n"

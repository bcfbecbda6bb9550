"""HTML tables for notebooks: what ``_repr_html_`` of a lock, holders or a run result shows."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from .._durations import seconds_text, utc_text

if TYPE_CHECKING:
    from .._handle.lock import Lock
    from .._results import Holder, RunResult

_STYLE = "border-collapse:collapse;font-family:monospace"
# Cells are padded inline, since outside Jupyter (the docs site, an exported page) no
# stylesheet pads them and neighbouring cells would read as one word.
_CELL = "text-align:left;vertical-align:top;padding:2px 1.5em 2px 0"


def _table(caption: str, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    # Whitespace between cells renders as nothing, but keeps copied or extracted text apart.
    head = " ".join(f"<th style='{_CELL}'>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "\n<tr>" + " ".join(f"<td style='{_CELL}'>{html.escape(str(cell))}</td>" for cell in row)
        + "</tr>"
        for row in rows
    )
    return (f"<table style='{_STYLE}'><caption style='text-align:left'>{caption}</caption>"
            f"\n<tr>{head}</tr>{body}\n</table>")


def lock_html(lock: Lock) -> str:
    """Name, held, token, slot, owner, expires in (and the holders it last found busy)."""
    held = lock.held
    if held:
        state = "held"
    elif lock.lost.is_set():
        state = f"lost ({lock.lost_reason})"
    else:
        state = "not held"
    rows = [
        ("name", lock.name), ("held", state), ("token", lock.token), ("slot", lock.slot),
        ("owner", lock.owner), ("expires in", seconds_text(lock.remaining) if held else "-"),
        ("ttl", seconds_text(lock.ttl)),
    ]
    if lock.limit > 1:
        rows.append(("limit", lock.limit))
    table = _table(f"<b>Lock</b> {html.escape(lock.name)}", ("", ""), rows)
    if not held and lock.holders:
        table += holders_html(lock.holders)
    return table


def holders_html(holders: Sequence[Holder]) -> str:
    """One row per live permit: slot, owner, token, since, expires in."""
    if not holders:
        return "<p><i>no holder</i></p>"
    rows = [(h.slot, h.owner, h.token, utc_text(h.since), seconds_text(h.expires_in))
            for h in holders]
    return _table("<b>Holders</b>", ("slot", "owner", "token", "since", "expires in"), rows)


def run_result_html(result: RunResult[Any]) -> str:
    """Whether the lock was taken; the value, or who held it instead."""
    if result.acquired:
        return _table("<b>RunResult</b> acquired", ("", ""), [("value", repr(result.value))])
    return _table("<b>RunResult</b> busy", ("", ""), []) + holders_html(result.holders)

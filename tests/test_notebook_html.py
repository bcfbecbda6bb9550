"""The HTML tables of a lock, its holders and a run result read well with no stylesheet.

Jupyter's stylesheet pads table cells; a page without it (the docs site, an email, a
static export) shows the cells touching ("expires in600.0s"). The tables carry their
own padding, and whitespace between cells, so both a browser with no stylesheet and a
plain text extraction keep the words apart.
"""

from __future__ import annotations

import itertools
import time
from html.parser import HTMLParser

from hypothesis import given
from hypothesis import strategies as st

import queen_sync as qs
from queen_sync._notebook.html import holders_html, run_result_html


class Cells(HTMLParser):
    """Collects each cell's style and text, each row's cells, and all text as extracted."""

    def __init__(self) -> None:
        super().__init__()
        self.styles: list[str] = []
        self.rows: list[list[str]] = []
        self.text = ""
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self.styles.append(dict(attrs).get("style") or "")
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data: str) -> None:
        self.text += data
        if self._cell is not None:
            self._cell.append(data)


def parse(markup: str) -> Cells:
    cells = Cells()
    cells.feed(markup)
    cells.close()
    return cells


def assert_readable_without_a_stylesheet(markup: str) -> Cells:
    """Every cell padded inline, and a text extraction with whitespace between cells."""
    cells = parse(markup)
    assert cells.styles, f"no table cells in {markup}"
    unpadded = [style for style in cells.styles if "padding" not in style]
    assert not unpadded, f"{len(unpadded)} cells carry no padding of their own: {markup}"
    for row in cells.rows:
        texts = [text for text in row if text]
        for left, right in itertools.pairwise(texts):
            assert any(f"{left}{gap}{right}" in cells.text for gap in (" ", "\n", "\t")), (
                f"the extracted text runs {left!r} into {right!r}: "
                f"{cells.text!r}")
    return cells


class TestTablesReadWithoutAStylesheet:
    def test_a_held_locks_table_pads_its_cells_and_spaces_expires_in_from_its_value(
            self, client: qs.Queen) -> None:
        lock = client.lock("report", ttl="10m")
        assert lock.acquire(), "the lock was free"
        cells = assert_readable_without_a_stylesheet(lock._repr_html_())
        assert ["expires in", "600.0s"] in cells.rows or any(
            row[0] == "expires in" and row[1].endswith("s") for row in cells.rows), (
            f"no 'expires in' row: {cells.rows}")
        lock.release()

    def test_a_busy_locks_table_and_its_holders_read_the_same_way(
            self, client: qs.Queen, other: qs.Queen) -> None:
        with other.lock("report", ttl="1m"):
            busy = client.lock("report", ttl="1m")
            assert not busy.acquire(), "the lock was taken by the other client"
            assert_readable_without_a_stylesheet(busy._repr_html_())
            result = busy.run(lambda: None)
            assert not result.acquired, "run got a held lock"
            assert_readable_without_a_stylesheet(run_result_html(result))

    @given(owner=st.text(min_size=1, max_size=30), token=st.integers(1, 2**53),
           slot=st.integers(0, 1023), left=st.floats(0, 10**6))
    def test_any_holder_shows_its_values_escaped_padded_and_apart(
            self, owner: str, token: int, slot: int, left: float) -> None:
        now_ms = int(time.time() * 1000)
        holder = qs.Holder(slot=slot, owner=owner, token=token, since=now_ms,
                           expires_at=now_ms + int(left * 1000), renewed_at=now_ms)
        cells = assert_readable_without_a_stylesheet(holders_html((holder,)))
        values = cells.rows[1]
        assert values[:3] == [str(slot), owner, str(token)], (
            f"the row shows {values[:3]}, not slot/owner/token {slot}/{owner!r}/{token}")

    def test_the_checker_catches_cells_that_touch(self) -> None:
        touching = ("<table><tr><td style='padding:0 1em'>expires in</td>"
                    "<td style='padding:0 1em'>600.0s</td></tr></table>")
        try:
            assert_readable_without_a_stylesheet(touching)
        except AssertionError as exc:
            assert "runs 'expires in' into '600.0s'" in str(exc), f"wrong complaint: {exc}"
        else:
            raise AssertionError("cells with no whitespace between them passed")

"""Every notebook in notebooks/ is stored executed, runs top to bottom, and its outputs are current.

The docs site (``docs/recipes/`` links to these files) shows the stored outputs, so a
reader sees the plots without a kernel and the build executes nothing. Each notebook
therefore carries, in its metadata, a digest of the code it was executed from; a code
cell edited since makes its stored outputs stale, and the tests say so.

Each run uses its own temporary embedded SQLite file (``QUEEN_URL``), with no server,
from a temporary working directory, as a reader would run it after a fresh clone. The
fresh run's outputs must have the stored ones' shape: per code cell, the same kinds
of output (stdout, a PNG figure, an HTML table, a result). Outputs that depend on the
run (owners, tokens, timestamps, timings, the figures' pixels) differ from run to run;
the temporary folder's path is stored as ``/tmp/notebook`` so it does not.

Refresh the stored outputs after editing a notebook:
``QUEEN_NOTEBOOKS_REFRESH=1 python -m pytest tests/test_notebooks.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("0*.ipynb"))
BUDGET = 60.0
REFRESH = os.environ.get("QUEEN_NOTEBOOKS_REFRESH") == "1"
STORED_TMP = "/tmp/notebook"  # what the run's temporary folder reads as in stored outputs


def read_notebook(path: Path) -> Any:
    """The notebook at ``path``, as nbformat 4."""
    return nbformat.read(path, as_version=4)  # type: ignore[no-untyped-call]  # unannotated


def write_notebook(notebook: Any, path: Path) -> None:
    """Store ``notebook`` at ``path`` in nbformat's own layout."""
    nbformat.write(notebook, path)  # type: ignore[no-untyped-call]  # nbformat is unannotated


def code_digest(notebook: Any) -> str:
    """A digest of the notebook's code cells: what its outputs were computed from."""
    sources = [cell.source for cell in notebook.cells if cell.cell_type == "code"]
    return hashlib.sha256(json.dumps(sources).encode()).hexdigest()


def output_shape(notebook: Any) -> list[list[str]]:
    """Per code cell, the sorted kinds of output it shows (stderr left out).

    Streams split at arbitrary points, and log lines from background threads land on
    stderr when they happen, so the shape counts kinds, not outputs, and skips stderr.
    """
    shape = []
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        kinds = set()
        for out in cell.outputs:
            if out.output_type == "stream":
                if out.name == "stdout":
                    kinds.add("stdout")
            elif out.output_type == "error":
                kinds.add(f"error {out.ename}")
            else:
                kinds.update(f"{out.output_type} {mime}" for mime in out.get("data", {}))
        shape.append(sorted(kinds))
    return shape


def errors_in(notebook: Any) -> list[str]:
    """``cell N: Ename: value`` for every error output."""
    return [f"cell {i}: {out.ename}: {out.evalue}" for i, cell in enumerate(notebook.cells)
            if cell.cell_type == "code" for out in cell.outputs if out.output_type == "error"]


def stored_as(notebook: Any, original: Any, tmp_path: Path) -> Any:
    """The executed ``notebook`` as it is stored: original metadata, digest, stable paths."""
    text = nbformat.writes(notebook)  # type: ignore[no-untyped-call]  # nbformat is unannotated
    text = text.replace(str(tmp_path), STORED_TMP)
    stored = nbformat.reads(text, as_version=4)  # type: ignore[no-untyped-call]  # as above
    stored.metadata = original.metadata
    stored.metadata["queen_sync"] = {"executed_from": code_digest(original)}
    return stored


def test_the_six_recipe_notebooks_are_present_and_on_the_site() -> None:
    names = [path.stem for path in NOTEBOOKS]
    assert names == ["01-quickstart", "02-singleton-jobs", "03-leader-election",
                     "04-fenced-export", "05-claimed-run-queue", "06-notebook-locks"], (
        f"notebooks found: {names}")
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for path in NOTEBOOKS:
        page = ROOT / "docs" / "recipes" / path.name
        assert page.resolve() == path.resolve(), f"docs/recipes/{path.name} is not {path}"
        assert f"recipes/{path.name}" in nav, f"mkdocs.yml's nav does not list {path.name}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_notebook_is_stored_executed_from_its_current_code(path: Path) -> None:
    notebook = read_notebook(path)
    digest, current = notebook.metadata.get("queen_sync", {}).get("executed_from"), code_digest(
        notebook)
    assert digest == current, (
        f"{path.name}'s stored outputs were computed from other code: refresh them with "
        "QUEEN_NOTEBOOKS_REFRESH=1 python -m pytest tests/test_notebooks.py")
    counts = [cell.execution_count for cell in notebook.cells if cell.cell_type == "code"]
    assert counts == list(range(1, len(counts) + 1)), (
        f"{path.name} was not stored from one top-to-bottom run: execution counts {counts}")
    assert not errors_in(notebook), f"{path.name} is stored with errors: {errors_in(notebook)}"
    blank = [i for i, cell in enumerate(notebook.cells) if cell.cell_type == "code"
             and "plt." in cell.source
             and not any("image/png" in out.get("data", {}) for out in cell.outputs)]
    assert not blank, f"{path.name}'s plotting cells {blank} are stored without their figure"


def test_the_digest_changes_when_a_code_cell_does_and_not_for_prose() -> None:
    notebook = SimpleNamespace(cells=[SimpleNamespace(cell_type="markdown", source="# a"),
                                      SimpleNamespace(cell_type="code", source="x = 1")])
    before = code_digest(notebook)
    notebook.cells[0].source = "# a, reworded"
    assert code_digest(notebook) == before, "editing prose made the outputs stale"
    notebook.cells[1].source = "x = 2"
    assert code_digest(notebook) != before, "editing code left the outputs current"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_notebook_runs_top_to_bottom_within_a_minute_as_stored(
        path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUEEN_URL", "sqlite://" + str(tmp_path / "queen.db"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    # As on a fresh machine: matplotlib builds its font cache first, and logs that it did.
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "matplotlib"))
    original, notebook = read_notebook(path), read_notebook(path)
    client = NotebookClient(notebook, timeout=int(BUDGET), kernel_name="python3",
                            record_timing=False, resources={"metadata": {"path": str(tmp_path)}})
    started = time.monotonic()
    client.execute()
    took = time.monotonic() - started
    assert not errors_in(notebook), f"{path.name} raised: {errors_in(notebook)}"
    assert took < BUDGET, f"{path.name} took {took:.1f}s (budget {BUDGET:.0f}s)"
    if REFRESH:
        write_notebook(stored_as(notebook, original, tmp_path), path)
        return
    stored, fresh = output_shape(original), output_shape(notebook)
    differ = [f"code cell {i}: stored {s}, now {f}"
              for i, (s, f) in enumerate(zip(stored, fresh)) if s != f]
    assert not differ, (f"{path.name}'s stored outputs are stale in shape (refresh with "
                        "QUEEN_NOTEBOOKS_REFRESH=1):\n" + "\n".join(differ))

"""Every notebook in notebooks/ runs top to bottom under a real kernel, each within a minute.

Each runs on its own temporary embedded SQLite file (``QUEEN_URL``), with no server,
from a temporary working directory, as a reader would run it after a fresh clone.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("0*.ipynb"))
BUDGET = 60.0


def test_the_five_recipe_notebooks_are_present() -> None:
    names = [path.stem for path in NOTEBOOKS]
    assert names == ["01-quickstart", "02-singleton-jobs", "03-leader-election",
                     "04-fenced-export", "05-claimed-run-queue"], f"notebooks found: {names}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_notebook_is_stored_without_outputs(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    dirty = [i for i, cell in enumerate(notebook.cells)
             if cell.cell_type == "code" and (cell.outputs or cell.execution_count)]
    assert not dirty, f"{path.name} is stored with outputs in cells {dirty}: run nbstripout"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_notebook_runs_top_to_bottom_within_a_minute(
        path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUEEN_URL", "sqlite://" + str(tmp_path / "queen.db"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=int(BUDGET), kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    started = time.monotonic()
    client.execute()
    took = time.monotonic() - started
    errors = [out for cell in notebook.cells if cell.cell_type == "code"
              for out in cell.outputs if out.output_type == "error"]
    assert not errors, f"{path.name} raised: {errors}"
    assert took < BUDGET, f"{path.name} took {took:.1f}s (budget {BUDGET:.0f}s)"

"""The documentation site builds with ``--strict``, and every Python sample in it runs.

A ```` ```python ```` block in ``README.md`` or ``docs/**/*.md`` is executed unless the
line just above it is an HTML comment starting ``<!-- test: skip`` (say why in it, e.g.
``<!-- test: skip (why) -->``). The blocks of one page run in order, in one namespace,
in a fresh interpreter, on a temporary embedded SQLite file (``QUEEN_URL``), from a
temporary working directory. A block marked ``<!-- test: postgres -->`` runs instead
against the tests' real PostgreSQL server, with ``QUEEN_URL`` pointing at it. A block
using IPython magics (``%``/``%%`` lines) runs in an IPython shell.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
SKIP = "<!-- test: skip"
POSTGRES = "<!-- test: postgres"

RUNNER = r"""
import json, sys
blocks = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
shell = None
for label, code in blocks:
    if any(line.lstrip().startswith("%") for line in code.splitlines()):
        if shell is None:
            from IPython.core.interactiveshell import InteractiveShell
            shell = InteractiveShell.instance(user_ns=namespace)
        result = shell.run_cell(code)
        if not result.success:
            sys.exit(f"{label} failed")
    else:
        exec(compile(code, label, "exec"), namespace)
"""


def python_blocks(page: Path, marker: str = "") -> list[tuple[str, str]]:
    """The page's python blocks as ``(label, code)``: unmarked ones, or those with ``marker``."""
    text = page.read_text(encoding="utf-8")
    blocks = []
    for match in FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        marked = before.startswith("<!-- test:")
        if (marker and not before.startswith(marker)) or (not marker and marked):
            continue
        line = text.count("\n", 0, match.start()) + 2
        where = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
        blocks.append((f"{where}:{line}", match.group(1)))
    return blocks


def test_the_site_builds_with_strict(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site"),
         "--config-file", str(ROOT / "mkdocs.yml")],
        cwd=ROOT, capture_output=True, text=True, timeout=110,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    problems = [line for line in done.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert done.returncode == 0, f"mkdocs build --strict failed: {problems or done.stderr[-3000:]}"
    assert (tmp_path / "site" / "reference" / "api" / "index.html").exists(), "no API reference"


def test_the_block_finder_honours_the_skip_marker(tmp_path: Path) -> None:
    page = tmp_path / "probe.md"
    page.write_text("a\n\n```python\nx = 1\n```\n\n<!-- test: skip (why) -->\n"
                    "```python\ny = 2\n```\n")
    found = python_blocks(page)
    assert [code for _, code in found] == ["x = 1\n"], f"found {found}"


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_sample_on_the_page_runs(page: Path, tmp_path: Path) -> None:
    run_blocks(page, python_blocks(page), "sqlite://" + str(tmp_path / "queen.db"), tmp_path)


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p, POSTGRES)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_postgres_sample_on_the_page_runs_against_a_real_server(
    page: Path, tmp_path: Path, pg_url: str
) -> None:
    run_blocks(page, python_blocks(page, POSTGRES), pg_url, tmp_path)


def run_blocks(page: Path, blocks: list[tuple[str, str]], url: str, folder: Path) -> None:
    env = {**os.environ, "QUEEN_URL": url,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(blocks),
                          cwd=folder, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, f"a sample in {page.name} failed:\n{done.stderr[-3000:]}"

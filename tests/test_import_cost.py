"""``import queen_sync`` stays light: measured with ``python -X importtime``.

No HTTP, PostgreSQL or IPython package is imported until an engine or the magic
needs it, and neither are the command line, the magic or supervision modules.
"""

from __future__ import annotations

import re
import subprocess
import sys

HEAVY = ("requests", "urllib3", "psycopg", "psycopg_pool", "IPython", "asyncio")
LAZY = ("queen_sync._front.cli", "queen_sync._front.magic", "queen_sync._front.supervision",
        "queen_sync._engines.http", "queen_sync._engines.postgres.engine", "argparse",
        "subprocess")
BUDGET_MS = 300.0  # a few times what it costs on a loaded 2-core machine


def _importtime() -> dict[str, int]:
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", "import queen_sync"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    cumulative = {}
    for match in re.finditer(r"^import time:\s+\d+ \|\s+(\d+) \|\s*(\S+)$", done.stderr, re.M):
        cumulative[match.group(2)] = int(match.group(1))
    return cumulative


def test_importing_queen_sync_imports_no_driver_ipython_or_cli() -> None:
    imported = _importtime()
    assert "queen_sync" in imported, "importtime must report queen_sync"
    pulled = sorted(name for name in imported
                    if name.split(".")[0] in HEAVY or name in LAZY)
    assert pulled == [], f"import queen_sync pulled in {pulled}"


def test_importing_queen_sync_takes_a_fraction_of_a_second() -> None:
    best_ms = min(_importtime()["queen_sync"] for _ in range(3)) / 1000
    assert best_ms < BUDGET_MS, f"import queen_sync took {best_ms:.1f} ms (budget {BUDGET_MS})"

"""The history checker, run for longer per engine, printing its figures.

    python benchmarks/soak_histories.py [--seconds 120] [--engines sqlite,postgres,http]
                                        [--seed N] [--no-pg-restart]

Per engine: critical sections by topology, sink writes and guarded commits accepted
and refused, faults injected by kind, library errors seen, violations (must be 0),
the seed (``--seed`` or ``QUEEN_SYNC_HISTORY_SEED`` replays its faults) and the load
average. PostgreSQL runs on a server of its own, so the driver may restart it too.
Exits 1 when any engine's history has a violation.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # history, and pg_server for the driver

from history import driver  # noqa: E402  (needs the path above; the name pytest gives it)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="per engine")
    parser.add_argument("--engines", default="sqlite,postgres,http")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--no-pg-restart", action="store_true",
                        help="do not restart the PostgreSQL server among the faults")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else driver.seed_from_env()
    failed = False
    for engine in args.engines.split(","):
        plan = driver.Plan(engine, args.seconds, seed)
        own_pg = engine == "postgres" and not args.no_pg_restart
        if engine == "postgres" and args.no_pg_restart:
            plan = replace(plan, faults=tuple(f for f in plan.faults if f != "restart"))
        folder = Path(tempfile.mkdtemp(prefix=f"soak-{engine}-"))
        pg_url = _pg_url() if engine == "postgres" and not own_pg else None
        with driver.open_store(engine, folder, pg_url, own_pg=own_pg) as store:
            outcome = driver.run_history(plan, folder, store)
        print(outcome.report(), flush=True)
        if outcome.violations:
            failed = True
            print(f"  the records are kept in {folder}", flush=True)
        else:
            shutil.rmtree(folder, ignore_errors=True)
    return 1 if failed else 0


def _pg_url() -> str:
    """A server of the soak's own, kept for the run (no restarts asked for)."""
    from pg_server import PgServer

    server = PgServer.start_new()
    import atexit

    atexit.register(server.destroy)
    return server.url


if __name__ == "__main__":
    sys.exit(main())

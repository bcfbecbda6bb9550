"""The public surface is exactly what is intended, and importing it stays light."""

from __future__ import annotations

import subprocess
import sys

import queen_sync

INTENDED = {
    "Capabilities", "Duration", "Engine", "EngineError", "EngineUnavailableError", "FencedOutError",
    "Holder", "Kv", "Lock", "LockBusyError", "LockError", "LockLostError", "LockNotHeldError",
    "Locks", "Metrics", "ProtocolError", "Queen", "QueenError", "QueenHttpError",
    "QueenHttpRequestError",
    "RequestError", "Result", "RunResult", "StoreReplacedError", "Transaction",
    "UnsupportedOperationError",
    "__version__", "connect", "current_lock", "default_client", "parse_duration",
    "singleton_job",
}


def test_the_exports_are_exactly_the_intended_names_sorted() -> None:
    assert set(queen_sync.__all__) == INTENDED, set(queen_sync.__all__) ^ INTENDED
    assert queen_sync.__all__ == sorted(queen_sync.__all__), "keep __all__ sorted"
    for name in queen_sync.__all__:
        assert getattr(queen_sync, name, None) is not None, f"{name} is exported but missing"


def test_no_private_module_leaks_through_a_public_name() -> None:
    public = [n for n in dir(queen_sync) if not n.startswith("_")]
    modules = [n for n in public if type(getattr(queen_sync, n)).__name__ == "module"]
    # The two public subpackages; `recipes` appears once something imports queen_sync.recipes.
    assert set(modules) <= {"testing", "recipes"}, (
        f"private modules visible as public names: {modules}")


def test_the_package_is_typed() -> None:
    from importlib import resources

    assert resources.files("queen_sync").joinpath("py.typed").is_file()


def test_importing_queen_sync_loads_no_driver() -> None:
    code = ("import sys, queen_sync; "
            "print(sorted(m for m in ('requests', 'psycopg', 'IPython', 'sqlite3', 'psycopg_pool')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"import queen_sync pulled in: {out.stdout}"

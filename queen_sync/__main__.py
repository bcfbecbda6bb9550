"""``python -m queen_sync``: the ``queen-sync`` command line."""

from __future__ import annotations

from ._front.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

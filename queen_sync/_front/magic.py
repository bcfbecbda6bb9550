"""The ``%%lock`` cell magic (``%load_ext queen_sync``).

```
%%lock retrain --ttl 10m --wait 30s
train()            # runs only while this kernel holds "retrain"; the last value is shown
```

The cell runs under the lease (``queen_sync.current_lock()`` is the lock inside
it) and the lease is released when the cell ends, fails or is interrupted. When
somebody else holds it, the magic prints who instead and the cell does not run.
The client is ``queen_sync.default_client()``, or one built for ``--url`` and
closed after the cell. This module imports nothing from IPython: the shell is
handed in by ``load_ipython_extension``.
"""

from __future__ import annotations

import argparse
import ast
import linecache
import shlex
from typing import Any, NoReturn, Optional

from .._results import describe_holders
from .cli import mask_urls, option_first, ttl_arg, wait_arg

_USAGE_EXAMPLE = "%%lock retrain --ttl 10m --wait 30s"


class _LineRefused(Exception):
    """argparse refused the magic's line; ``run_locked_cell`` raises it as a ValueError."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # Masked as the command line masks them: a refused word may be an engine URL.
        raise _LineRefused(f"%%lock: {mask_urls(option_first(message))} (e.g. {_USAGE_EXAMPLE})")


def _parse_line(line: str) -> argparse.Namespace:
    refused = None
    try:
        return _parser().parse_args(shlex.split(line))
    except _LineRefused as exc:
        refused = str(exc)
    # Raised out here, so argparse's own error (which quotes the word) is not its context.
    raise ValueError(refused)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="%%lock", add_help=False,
                     description="Run the cell while holding the lease NAME.")
    parser.add_argument("name")
    parser.add_argument("--ttl", type=ttl_arg, default=600.0,
                        help="the lease's lifetime (default 10m)")
    parser.add_argument("--wait", type=wait_arg, default=0.0,
                        help="how long to wait when busy (default 0)")
    parser.add_argument("--limit", type=int, default=1, help="permits (a semaphore when > 1)")
    parser.add_argument("--url", default=None, help="engine URL (default: the default client)")
    return parser


def register(shell: Any) -> None:
    """Register ``%%lock`` on an IPython shell."""

    def lock(line: str, cell: str) -> Any:
        return run_locked_cell(shell, line, cell)

    shell.register_magic_function(lock, magic_kind="cell", magic_name="lock")


def run_locked_cell(shell: Any, line: str, cell: str) -> Any:
    """Parse ``line``, take the lease, run ``cell`` in the user's namespace, release.

    Returns:
        The value of the cell's last expression (IPython shows it), or None.

    Raises:
        ValueError: for a malformed line, before anything is sent.
    """
    args = _parse_line(line)
    ttl, wait = args.ttl, args.wait
    from .._client import Queen
    from .._default import default_client

    client = Queen(args.url) if args.url else default_client()
    try:
        if args.limit > 1:
            lock = client.semaphore(args.name, args.limit, ttl=ttl, wait=wait)
        else:
            lock = client.lock(args.name, ttl=ttl, wait=wait)
        outcome = lock.run(_execute, shell, cell)
    finally:
        if args.url:
            client.close()
    if not outcome.acquired:
        print(f"lock {args.name!r} is busy; the cell did not run: "
              f"{describe_holders(outcome.holders)}")
        return None
    if lock.lost.is_set():
        print(f"warning: lock {args.name!r} was lost while the cell ran ({lock.lost_reason})")
    return outcome.value


def _execute(shell: Any, cell: str) -> Optional[Any]:
    """Run the cell like IPython does (magics and ``!`` lines included); return its last value."""
    source = shell.transform_cell(cell)
    tree = ast.parse(source)
    last: Optional[ast.expr] = None
    final = tree.body[-1] if tree.body else None
    if isinstance(final, ast.Expr):
        tree.body.pop()
        last = final.value
    filename = f"<%%lock cell {abs(hash(source)):x}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = shell.user_ns
    exec(compile(tree, filename, "exec"), namespace)
    if last is None:
        return None
    return eval(compile(ast.Expression(last), filename, "eval"), namespace)

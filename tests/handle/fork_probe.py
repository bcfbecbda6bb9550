"""A script that forks children which make no call, for ``test_fork_touches_nothing.py``.

Run as ``python fork_probe.py URL PATTERN``. It opens a client, takes a lease, and says
``ready``; on each line read from stdin it does the next step and answers one line:

- ``fork``: forks a child the ``PATTERN`` way; the child waits until told to go, then
  ends without a call of its own. The parent answers ``forked`` once the fork hooks ran.
- ``go``: lets the child end, reaps it and answers ``reaped <exit status>``.
- ``first-call``: forks a child whose first call takes another lease; answers its report.

Patterns: ``os-exit`` (``os.fork()`` then ``os._exit``), ``interpreter-exit`` (the child
leaves through the interpreter's exit, so the exit hooks run) and ``pty-exec`` (how a
notebook's ``!cmd`` starts a command: ``pty.fork()``, then ``exec``). ``one-read`` is
``os-exit`` with one read of a lease in the child before it ends: the tests show with it
that their looks at the store do see a child's call.
"""

from __future__ import annotations

import json
import os
import pty
import sys
import warnings
from typing import Callable

import queen_sync as qs


def answer(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def fork_with(pattern: str, q: qs.Queen) -> tuple[int, int, int]:
    """Fork; in the child, wait for a byte on a pipe, then end as ``pattern`` says.

    Returns the child's pid, the pipe end that lets it go, and its terminal (or -1).
    """
    go_r, go_w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # a threaded parent, on 3.12+
        pid, terminal = pty.fork() if pattern == "pty-exec" else (os.fork(), -1)
    if pid != 0:
        os.close(go_r)
        return pid, go_w, terminal
    os.read(go_r, 1)
    if pattern == "one-read":
        q.locks.get("held-by-parent")
    if pattern == "pty-exec":
        os.execv("/bin/true", ["true"])
    if pattern == "interpreter-exit":
        raise SystemExit(0)  # unwinds to the interpreter, which runs the exit hooks
    os._exit(0)


def first_call_in_a_child(q: qs.Queen) -> dict[str, object]:
    """Fork a child whose first call takes another lease; return what it reported."""
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            lock = q.lock("child-own", ttl=30)
            report: dict[str, object] = {"took": lock.acquire(), "released": lock.release()}
        except BaseException as exc:  # the parent must see it, not hang
            report = {"error": repr(exc)}
        os.write(report_w, json.dumps(report).encode() + b"\n")
        os._exit(0)
    os.close(report_w)
    with os.fdopen(report_r) as reader:
        line = reader.readline()
    os.waitpid(pid, 0)
    found: dict[str, object] = json.loads(line) if line else {"error": "no report"}
    return found


def main(url: str, pattern: str) -> None:
    # A renewer thread, as in a notebook; with this TTL it renews long after the test.
    q = qs.Queen(url)
    lease = q.lock("held-by-parent", ttl=60)
    assert lease.acquire(), "the parent could not take its lease"
    # A waiter that gave up leaves the engine's wake-up channel open (PostgreSQL: a LISTEN
    # session), which the child inherits too.
    assert not q.lock("held-by-parent", ttl=60).acquire(wait=0.05), "two holders"
    child: tuple[int, int, int] = (0, -1, -1)
    steps: dict[str, Callable[[], str]] = {}

    def fork() -> str:
        nonlocal child
        child = fork_with(pattern, q)
        return "forked"

    def go() -> str:
        pid, go_w, terminal = child
        os.write(go_w, b"x")
        os.close(go_w)
        _, status = os.waitpid(pid, 0)
        if terminal >= 0:
            os.close(terminal)
        return f"reaped {status}"

    steps.update({"fork": fork, "go": go,
                  "first-call": lambda: json.dumps(first_call_in_a_child(q))})
    answer("ready")
    for line in sys.stdin:
        answer(steps[line.strip()]())
    lease.release()
    q.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

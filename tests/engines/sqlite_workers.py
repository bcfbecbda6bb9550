"""Other processes on one SQLite file, run as ``python sqlite_workers.py COMMAND ARGS...``.

Each command does one thing another process on the machine would do, prints one JSON
line, and exits, so the test process judges everything. Run as a script (not through
multiprocessing) so nothing of the test process, its file locks included, is inherited.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import queen_sync as qs


def acquire(url: str, name: str) -> dict[str, Any]:
    """Try ``name`` once; report whether it was taken, the token, and the holders' tokens."""
    with qs.Queen(url) as q:
        lock = q.lock(name, ttl=30)
        taken = lock.acquire()
        return {"acquired": taken, "token": lock.token,
                "holder_tokens": [h["token"] for h in q.locks.get(name)["holders"]]}


def touch(path: str) -> dict[str, Any]:
    """Open the file with plain ``sqlite3``, read, and close, as any tool on the file would."""
    conn = sqlite3.connect(path)
    try:
        conn.execute("SELECT count(*) FROM queen_kv").fetchone()
    finally:
        conn.close()
    return {"touched": True}


def try_touch(path: str) -> dict[str, Any]:
    """``touch``, reporting SQLite's refusal (it may find the files inconsistent) as data."""
    try:
        return touch(path)
    except sqlite3.Error as exc:
        return {"touched": False, "error": str(exc)}


def write_for(path: str, seconds: str) -> dict[str, Any]:
    """Hold the file's write lock for ``seconds``; print once it is held, again at the end."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    print(json.dumps({"writing": True}), flush=True)
    time.sleep(float(seconds))
    conn.execute("COMMIT")
    conn.close()
    return {"wrote": True}


def fork_during_write(url: str, path: str) -> dict[str, Any]:
    """Fork while another process holds the write lock; report how the child fared.

    The child measures how long ``os.fork()`` took to return to it (the after-fork
    handlers run inside it), then makes one call, which may wait for the writer.
    """
    q = qs.Queen(url)
    assert q.kv.put("app", "before", 1, forever=True)
    writer = subprocess.Popen([sys.executable, __file__, "write_for", path, "2.5"],
                              stdout=subprocess.PIPE, text=True)
    assert writer.stdout is not None and "writing" in writer.stdout.readline()
    read_end, write_end = os.pipe()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        report: dict[str, Any] = {"fork_seconds": time.monotonic() - started}
        report["first_call"] = bool(q.kv.put("app", "child", 1, forever=True))
        report["first_call_done_after"] = time.monotonic() - started
        with os.fdopen(write_end, "w") as pipe:
            pipe.write(json.dumps(report))
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        child: dict[str, Any] = json.loads(pipe.read() or "{}")
    os.waitpid(pid, 0)
    writer.wait(10)
    child["written"] = bool(q.kv.get("app", "child"))
    q.close()
    return child


def write_until_told(path: str, seconds: str) -> dict[str, Any]:
    """Hold the file's write lock until a line arrives on stdin, or ``seconds`` pass."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    print(json.dumps({"writing": True}), flush=True)
    told = select.select([sys.stdin], [], [], float(seconds))[0]
    conn.execute("COMMIT")
    conn.close()
    return {"released": "told" if told else "on its own"}


def fork_during_a_busy_wait(url: str, path: str) -> dict[str, Any]:
    """Fork while another thread's call waits out another process's write.

    Reports whether ``os.fork()`` returned while the writer still held the lock (it is
    told to let go only then), and how the waiting call, the child and the parent fared.
    """
    q = qs.Queen(url)
    assert q.kv.put("app", "before", 1, forever=True)
    writer = subprocess.Popen([sys.executable, __file__, "write_until_told", path, "6"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert writer.stdin is not None and writer.stdout is not None
    assert "writing" in writer.stdout.readline()
    waited: list[bool] = []
    waiter = threading.Thread(
        target=lambda: waited.append(bool(q.kv.put("app", "waiter", 1, forever=True))))
    waiter.start()
    time.sleep(0.4)  # the waiter is in its busy wait now
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        report = {"child_wrote": bool(q.kv.put("app", "child", 1, forever=True))}
        with os.fdopen(write_end, "w") as pipe:
            pipe.write(json.dumps(report))
        os._exit(0)
    with contextlib.suppress(BrokenPipeError):  # gone: it let go on its own, long ago
        writer.stdin.write("go\n")
        writer.stdin.flush()
    released = json.loads(writer.stdout.readline())["released"]
    writer.wait(10)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        child: dict[str, Any] = json.loads(pipe.read() or "{}")
    os.waitpid(pid, 0)
    waiter.join(30)
    stored = sorted(k for k in ("before", "waiter", "child") if q.kv.get("app", k))
    q.close()
    return {"writer_released": released, "waiter_wrote": waited == [True], **child,
            "stored": stored}


class _ForkAfterBegin:
    """A connection whose ``BEGIN IMMEDIATE`` is followed by a fork, as a signal handler
    landing there that forks (a supervisor's SIGCHLD, say) would do."""

    def __init__(self, conn: sqlite3.Connection, forked: list[int]) -> None:
        self._conn, self._forked = conn, forked

    def execute(self, sql: str, *args: Any) -> Any:
        answer = self._conn.execute(sql, *args)
        if sql == "BEGIN IMMEDIATE" and not self._forked:
            self._forked.append(os.fork())
        return answer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def fork_inside_a_call(url: str) -> dict[str, Any]:
    """Fork from inside this thread's own call, mid-transaction; report both sides.

    The child reports what a call of the inherited client and one of a new client raise:
    the parent's connection, open in its transaction, came across the fork.
    """
    signal.alarm(10)  # a deadlocked fork ends the worker, and the test, with a failure
    q = qs.Queen(url)
    assert q.kv.put("app", "before", 1, forever=True)
    storage = q.engine.storage  # type: ignore[attr-defined]
    forked: list[int] = []
    real = storage._conn
    storage._conn = _ForkAfterBegin(real, forked)
    read_end, write_end = os.pipe()
    resumed = _raised(lambda: q.kv.put("app", "parent", 1, forever=True))
    if forked and forked[0] == 0:
        os.close(read_end)
        report = {"resumed": resumed,
                  "inherited": _raised(lambda: q.kv.put("app", "c1", 1, forever=True)),
                  "fresh": _raised(lambda: qs.Queen(url).kv.put("app", "c2", 1, forever=True))}
        with os.fdopen(write_end, "w") as pipe:
            pipe.write(json.dumps(report))
        os._exit(0)
    storage._conn = real
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        child: dict[str, Any] = json.loads(pipe.read() or "{}")
    os.waitpid(forked[0], 0)
    after = bool(q.kv.put("app", "after", 1, forever=True))
    stored = sorted(k for k in ("before", "parent", "after", "c1", "c2") if q.kv.get("app", k))
    integrity = storage._conn.execute("PRAGMA integrity_check").fetchone()[0]
    q.close()
    return {"parent_resumed": resumed, "parent_after": after, "stored": stored,
            "integrity": integrity, **child}


def fork_inside_a_reconnect(url: str) -> dict[str, Any]:
    """Fork from inside this thread's reconnection to the file (its ``sqlite3.connect``)."""
    signal.alarm(10)  # a deadlocked fork ends the worker, and the test, with a failure
    q = qs.Queen(url)
    assert q.kv.put("app", "before", 1, forever=True)
    if os.fork() == 0:  # a first fork closes the connection: the next call reconnects
        os._exit(0)
    os.wait()
    connect = sqlite3.connect
    forked: list[int] = []

    def forking_connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn: sqlite3.Connection = connect(*args, **kwargs)
        if not forked:
            forked.append(os.fork())
        return conn
    sqlite3.connect = forking_connect  # type: ignore[assignment]
    read_end, write_end = os.pipe()
    resumed = _raised(lambda: q.kv.put("app", "parent", 1, forever=True))
    if forked[0] == 0:
        os.close(read_end)
        report = {"resumed": resumed,
                  "fresh": _raised(lambda: qs.Queen(url).kv.put("app", "c", 1, forever=True))}
        with os.fdopen(write_end, "w") as pipe:
            pipe.write(json.dumps(report))
        os._exit(0)
    sqlite3.connect = connect
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        child: dict[str, Any] = json.loads(pipe.read() or "{}")
    os.waitpid(forked[0], 0)
    stored = sorted(k for k in ("before", "parent", "c") if q.kv.get("app", k))
    q.close()
    return {"parent_resumed": resumed, "stored": stored, **child}


def _raised(call: Callable[[], Any]) -> str:
    try:
        answer = call()
    except Exception as exc:  # the report names whatever the call raised
        return type(exc).__name__ + ": " + str(exc)
    return f"nothing (answered {bool(answer)})"


def fork_after_replace(url: str, path: str, other: str) -> dict[str, Any]:
    """Rename ``other`` over the open store, then fork: what the child's first call raises."""
    q = qs.Queen(url)
    assert q.kv.put("app", "k", "original", forever=True)
    os.rename(other, path)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            q.kv.get("app", "k")
            raised = None
        except Exception as exc:  # the report names whatever the first call raised
            raised = type(exc).__name__
        with os.fdopen(write_end, "w") as pipe:
            pipe.write(json.dumps({"child_raised": raised}))
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        child: dict[str, Any] = json.loads(pipe.read() or "{}")
    os.waitpid(pid, 0)
    return child


def fork_holder_then_leave(url: str, how: str) -> dict[str, Any]:
    """Open a client, fork a child that takes ``L`` and keeps it renewed, then leave.

    The child prints ``{"holding": token}`` once it holds, and how it fared once stdin
    closes. This process leaves by ``how``: ``close`` (the client), ``exit`` (interpreter
    exit closes it) or ``kill`` (SIGKILL: nothing is closed).
    """
    q = qs.Queen(url)  # the constructor connects: that connection's state is what a fork copies
    ready, told = os.pipe()
    if os.fork() == 0:
        _hold_until_stdin_closes(q, told)
    os.close(told)
    os.read(ready, 1)
    if how == "close":
        q.close()
    elif how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    return {"left": how}


def _hold_until_stdin_closes(q: qs.Queen, told: int) -> None:
    lock = q.lock("L", ttl=1)
    taken = lock.acquire()
    print(json.dumps({"holding": lock.token if taken else None}), flush=True)
    os.write(told, b"!")
    sys.stdin.read()
    print(json.dumps({"held": lock.held, "lost": lock.lost.is_set(), "token": lock.token}),
          flush=True)
    os._exit(0)


COMMANDS: dict[str, Callable[..., Any]] = {
    "acquire": acquire, "fork_after_replace": fork_after_replace,
    "fork_during_a_busy_wait": fork_during_a_busy_wait, "fork_inside_a_call": fork_inside_a_call,
    "fork_inside_a_reconnect": fork_inside_a_reconnect, "fork_during_write": fork_during_write,
    "fork_holder_then_leave": fork_holder_then_leave, "touch": touch,
    "try_touch": try_touch, "write_for": write_for, "write_until_told": write_until_told}

if __name__ == "__main__":
    print(json.dumps(COMMANDS[sys.argv[1]](*sys.argv[2:])), flush=True)

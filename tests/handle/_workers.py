"""Worker functions for the real-process tests, importable by a ``spawn``-started child.

Each worker opens its own ``Queen`` client on the shared SQLite file, does one
scenario's part, and reports plain data (numbers, strings, lists) on a
``multiprocessing`` queue, so the test process judges everything.
"""

from __future__ import annotations

import faulthandler
import json
import os
import random
import signal
import threading
import time
from typing import Any, Optional

import queen_sync as qs
from queen_sync._engines.sqlite import SqliteEngine

NS = "procs"


def contend_with_guarded_incr(url: str, name: str, seconds: float, start_at: float,
                              results: Any) -> None:
    """Take ``name`` again and again for ``seconds``; while holding, commit guarded writes.

    Each commit bumps an ``incr`` counter AND a read-modify-write counter (read with
    ``q.kv.get``, written back with ``put``): only exclusion keeps the second one exact.
    Reports ``(pid, successful commits, refused commits)``.
    """
    q = qs.Queen(url)
    lock = q.lock(name, ttl=5)
    committed = refused = 0
    time.sleep(max(0.0, start_at - time.time()))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not lock.acquire(wait=1.0):
            continue
        try:
            seen = q.kv.get(NS, "rmw")
            current = seen["value"] if seen else 0
            answer = (q.transaction().guard(lock)
                      .kv.incr(NS, "counter", forever=True)
                      .kv.put(NS, "rmw", current + 1, forever=True)
                      .commit())
            if answer:
                committed += 1
            else:
                refused += 1
        finally:
            lock.release()
    q.close()
    results.put((os.getpid(), committed, refused))


def hold_semaphore_permits(url: str, name: str, limit: int, seconds: float, start_at: float,
                           results: Any) -> None:
    """Take one of ``limit`` permits again and again; report ``(pid, [(acq, rel, token)])``.

    The interval recorded lies INSIDE the engine's hold (after acquire returned, before
    release was sent), so an overlap seen here is an overlap the engine allowed.
    """
    q = qs.Queen(url)
    permit = q.semaphore(name, limit, ttl=5)
    rng = random.Random(os.getpid())
    intervals: list[tuple[float, float, int]] = []
    time.sleep(max(0.0, start_at - time.time()))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not permit.acquire(wait=2.0):
            continue
        acquired_at = time.time()
        token = permit.token
        time.sleep(rng.uniform(0.03, 0.12))
        released_at = time.time()
        permit.release()
        intervals.append((acquired_at, released_at, int(token or 0)))
        time.sleep(rng.uniform(0.0, 0.02))
    q.close()
    results.put((os.getpid(), intervals))


def hold_until_killed(url: str, name: str, ttl: float, results: Any) -> None:
    """Take ``name``, report ``("held", token)``, then keep it renewed until killed."""
    taken = _take_and_report(url, name, ttl, results)  # kept referenced while it sleeps
    while taken is not None:
        time.sleep(0.1)


def _take_and_report(url: str, name: str, ttl: float, results: Any
                     ) -> Optional[tuple[qs.Queen, qs.Lock]]:
    """Take ``name`` and report ``("held", token)``, or report ``("busy", None)``."""
    q = qs.Queen(url)
    lock = q.lock(name, ttl=ttl)
    if not lock.acquire(wait=5):
        results.put(("busy", None))
        return None
    results.put(("held", lock.token))
    return q, lock


def wait_then_take(url: str, name: str, ttl: float, wait: float, hold: float,
                   results: Any) -> None:
    """Report ``("waiting", time)``, wait for ``name``, report ``("took", time, token)``.

    Keeps it ``hold`` seconds, writing the fenced marker once, then releases.
    """
    q = qs.Queen(url)
    lock = q.lock(name, ttl=ttl)
    results.put(("waiting", time.time()))
    if not lock.acquire(wait=wait):
        results.put(("gave up", time.time(), None))
        q.close()
        return
    took_at = time.time()
    results.put(("took", took_at, lock.token))
    q.transaction().guard(lock).kv.put(NS, "winner", "successor", forever=True).commit()
    time.sleep(hold)
    lock.release()
    q.close()


def commit_after_pause(url: str, name: str, ttl: float, about_to_write: Any, results: Any) -> None:
    """Take ``name``; start a guarded commit and stall just before it reaches the engine.

    The stall is where the test SIGSTOPs this process, as a GC pause or a suspended
    laptop would hit it: after the handle's own checks, before the write. After
    SIGCONT the commit goes out with the token it was built with; report its answer
    and what the handle says about the loss.
    """
    taken = _take_and_report(url, name, ttl, results)
    if taken is None:
        return
    q, lock = taken
    engine = q.engine
    assert isinstance(engine, SqliteEngine), "the stall holds the SQLite storage's mutex"
    real_call = engine.call

    def stalled_call(route: str, body: Any) -> Any:
        if route == "transaction":
            # Holding the storage mutex keeps the renewer out of SQLite while the
            # SIGSTOP lands: a process stopped inside a write transaction would keep
            # the file's write lock and stall every other process, the test included.
            with engine.storage._mutex:
                about_to_write.set()
                time.sleep(1.5)  # the SIGSTOP lands in here
        return real_call(route, body)

    engine.call = stalled_call  # type: ignore[method-assign]  # the stall point of the test
    answer = q.transaction().guard(lock).kv.put(NS, "winner", "paused", forever=True).commit()
    lock.lost.wait(2.0)  # the loss may be recorded by the renewer thread just after
    results.put(("committed", json.dumps(dict(answer)), lock.lost.is_set(), lock.lost_reason,
                 lock.held, lock.token))
    q.close()


def fork_while_holding(url: str, results: Any) -> None:
    """Hold a lock, ``os.fork()``; the child checks it holds nothing and can lock on its own.

    Reports ``("child", {...})`` from the child (over a pipe, relayed here) and
    ``("parent", {...})`` from the parent after the child has exited.
    """
    q = qs.Queen(url)
    lock = q.lock("forked", ttl=1.5)
    if not lock.acquire():
        results.put(("busy", None))
        return
    token_before = lock.token
    calls_before = q.renewer.calls
    parent_thread = q.renewer.thread
    parent_owner = lock.owner
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read_end)
        report = _child_after_fork(q, lock, parent_thread, parent_owner)
        with os.fdopen(write_end, "w") as pipe:
            pipe.write(json.dumps(report))
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        child = json.loads(pipe.read() or "{}")
    _, status = os.waitpid(pid, 0)
    child["exit_status"] = status
    results.put(("child", child))
    holders = q.locks.get("forked")["holders"]
    results.put(("parent", {
        "held": lock.held, "lost": lock.lost.is_set(), "token_before": token_before,
        "token_after": lock.token, "renew_calls": q.renewer.calls - calls_before,
        "engine_owner": holders[0]["owner"] if holders else None, "owner": lock.owner,
    }))
    q.close()


def _child_after_fork(q: qs.Queen, lock: qs.Lock, parent_thread: Any,
                      parent_owner: str) -> dict[str, Any]:
    report: dict[str, Any] = {"held": lock.held, "token": lock.token,
                              "renewer_tracks": len(q.renewer.held())}
    own = q.lock("child-own", ttl=1.5)
    report["own_acquired"] = own.acquire()
    first_token = own.token
    time.sleep(2.0)  # past the lifetime: only the child's renewer can keep it
    report["own_held_after_ttl"] = own.held
    report["own_renewed"] = own.token is not None and own.token != first_token
    thread = q.renewer.thread
    report["own_renewer_alive"] = thread is not None and thread.is_alive()
    report["renewer_is_parents"] = thread is parent_thread
    holders = q.locks.get("forked")["holders"]
    report["forked_engine_owner"] = holders[0]["owner"] if holders else None
    report["parent_owner"] = parent_owner
    report["child_owner"] = lock.owner  # the inherited handle is another holder here
    q.close()  # releases the child's own lock only
    report["forked_still_held_after_child_close"] = _forked_held(q.url)
    return report


def _forked_held(url: str) -> bool:
    """Whether ``forked`` is held, read through a fresh client (the child's is closed)."""
    fresh = qs.Queen(url)
    try:
        return bool(fresh.locks.get("forked")["held"])
    finally:
        fresh.close()


# The parent's thread holds the write lock about four fifths of the time, and SQLite's
# busy handler polls rather than queues, so a child may wait for its first write well
# over a second on a loaded machine: the child's patience is that of a real client.
FORKED_CHILD_BUSY_TIMEOUT = 10.0
FORKED_CHILD_LIMIT = 15.0  # beyond its busy timeout: a child still running then is stuck


def fork_during_calls(url: str, forks: int, results: Any) -> None:
    """Fork ``forks`` times while other threads keep the engine busy; report child failures.

    One thread spins on key/value calls, one takes and gives back a lock, one waits on a
    lease this process holds (its wake-up armed), and the renewer renews that lease. Each
    child uses the engine on its own (see ``_child_calls``) and exits 0; a child that
    errs, or is still running after ``FORKED_CHILD_LIMIT``, fails, described by what it
    wrote (its error) or by its Python stacks, and no more children are forked. Reports
    ``("forks", [failure, ...], key/value calls of the parent)``.
    """
    q = qs.Queen(url, busy_timeout=FORKED_CHILD_BUSY_TIMEOUT)
    kept = q.lock("kept", ttl=3)
    assert kept.acquire(), "nobody else uses this store"
    stop = threading.Event()
    calls = [0]

    def keep_calling() -> None:
        while not stop.is_set():
            q.kv.incr(NS, "parent", forever=True)
            calls[0] += 1

    def keep_locking() -> None:
        spun = q.lock("spun", ttl=30)
        while not stop.is_set():
            if spun.acquire():
                spun.release()

    def keep_waiting() -> None:
        while not stop.is_set():
            q.lock("kept", ttl=30).acquire(wait=0.2)

    threads = [threading.Thread(target=work, daemon=True)
               for work in (keep_calling, keep_locking, keep_waiting)]
    for thread in threads:
        thread.start()
    time.sleep(0.1)
    failures: list[str] = []
    for index in range(forks):
        failure = _forked_child_failure(q, kept)
        if failure is not None:
            failures.append(f"child {index}: {failure}")
            break  # one is the verdict; more stuck children would only outlast the test
    stop.set()
    for thread in threads:
        thread.join(5)
    kept.release()
    results.put(("forks", failures, calls[0]))
    q.close()


def _child_calls(q: qs.Queen, kept: qs.Lock) -> None:
    """What a forked child does with its parent's client: holds nothing, can do anything."""
    if kept.held:
        raise AssertionError("the child believes it holds its parent's lease")
    q.kv.get(NS, "parent")
    own = q.lock("child-own", ttl=30)
    if not own.acquire(wait=FORKED_CHILD_BUSY_TIMEOUT):
        raise AssertionError(f"the child could not take a free lock: {own.holders}")
    own.release()
    q.kv.incr(NS, "children", forever=True)


def _forked_child_failure(q: qs.Queen, kept: qs.Lock) -> Optional[str]:
    """Fork a child that runs ``_child_calls``; None if it exits 0, else what went wrong."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        with os.fdopen(write_end, "w") as report:
            # A stuck child prints its stacks before the parent kills it.
            faulthandler.dump_traceback_later(FORKED_CHILD_LIMIT - 1.0, file=report)
            code = 0
            try:
                _child_calls(q, kept)
            except BaseException as exc:  # any error, Ctrl-C included, is this child's verdict
                report.write(f"{type(exc).__name__}: {exc}")
                code = 3
            faulthandler.cancel_dump_traceback_later()
            report.flush()
            os._exit(code)
    os.close(write_end)
    clean = _exited_cleanly(pid, FORKED_CHILD_LIMIT)
    with os.fdopen(read_end) as report:
        written = report.read().strip()
    if clean:
        return None
    return written or "exited non-zero and wrote nothing"


def _exited_cleanly(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status == 0
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return False

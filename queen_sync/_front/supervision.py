"""Supervision: a singleton job's status, published where the broker's Supervisors page reads it.

Off by default. With ``@singleton_job(..., supervision="nightly")`` each call that
runs the body starts one thread that publishes the job's status at once, every
10 s while the body runs, and once more (``stopped``) when it ends. The records
follow the broker's supervisor contract, in the KV namespace ``queen-supervisor``,
each with a 60 s lifetime so a vanished instance drops out by itself:

- ``<group>/<instance>/head``: ``{"format": "queen.supervisor.remote-status/v1",
  "write": <id of this write>, "chunks": n, "bytes": <length of the document>}``;
- ``<group>/<instance>/chunk/0000`` .. ``chunk/<n-1>``: ``{"write", "index", "data"}``,
  ``data`` being base64 of consecutive slices of the UTF-8 JSON document.

A reader takes the head, then every chunk carrying the same ``write``, decodes and
joins them. The head and its chunks go in one all-or-nothing KV batch. The
document is a ``queen.consumer.status/v1``; a job maps onto it as one pool named
``singleton`` whose task is the lock name: desired 1, running and busy 1 while a
run is in progress and 0 after, completed and failed counting runs. An instance
is one decorated job in one process, so its counters span that process's runs.

Publishing is best effort and serialized: each write is waited for at most 2 s
(a write still in flight after that makes the next one skip rather than overtake
it), the job waits at most 2 s in all when it ends, and a failure is logged once
until a write succeeds again. Nothing of it reaches the job.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Iterator, Optional

if TYPE_CHECKING:
    from .._client import Queen

log = logging.getLogger("queen_sync")

NAMESPACE = "queen-supervisor"
HEAD_FORMAT = "queen.supervisor.remote-status/v1"
SCHEMA = "queen.consumer.status/v1"
PUBLISH_EVERY = 10.0
HEARTBEAT_TIMEOUT = 30
RECORD_TTL_SECONDS = 60
DEADLINE = 2.0
CHUNK_BYTES = 45_000  # raw bytes per chunk: its base64 stays well inside one KV value
MAX_CHUNKS = 10_000  # chunk indexes are four digits
_GROUP = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
_RESERVED_GROUPS = ("coordination",)


def check_group(group: Any) -> str:
    """``group`` if the broker accepts it as a supervision group, else a TypeError/ValueError."""
    if not isinstance(group, str):
        raise TypeError(f"supervision must be a group name (str) or None, "
                        f"not {type(group).__name__}")
    if _GROUP.fullmatch(group) is None or group in _RESERVED_GROUPS:
        raise ValueError(f"supervision group {group!r} is not valid: it must be 1-255 of "
                         "A-Z a-z 0-9 . _ - starting with a letter or digit, and not "
                         "'coordination'")
    return group


def records(slot: str, document: dict[str, Any]) -> list[dict[str, Any]]:
    """The KV puts that publish ``document`` under ``slot`` (``<group>/<instance>``)."""
    raw = json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    pieces = [raw[at:at + CHUNK_BYTES] for at in range(0, len(raw), CHUNK_BYTES)] or [b""]
    if len(pieces) > MAX_CHUNKS:
        raise ValueError(f"a status of {len(raw)} bytes needs more than {MAX_CHUNKS} chunks")
    write = uuid.uuid4().hex
    head = {"format": HEAD_FORMAT, "write": write, "chunks": len(pieces), "bytes": len(raw)}
    ops = [_put(f"{slot}/head", head)]
    for index, piece in enumerate(pieces):
        data = base64.b64encode(piece).decode("ascii")
        ops.append(_put(f"{slot}/chunk/{index:04d}", {"write": write, "index": index,
                                                      "data": data}))
    return ops


def _put(key: str, value: dict[str, Any]) -> dict[str, Any]:
    # required: a head is never written without all of its chunks, nor chunks without it.
    return {"op": "put", "ns": NAMESPACE, "key": key, "value": value,
            "ttlSeconds": RECORD_TTL_SECONDS, "required": True}


class Supervisor:
    """One job's status in one process, and the thread that publishes it while the job runs."""

    def __init__(self, group: str, job: str) -> None:
        self.group = check_group(group)
        self.job = job
        self._mutex = threading.Lock()
        self._completed = 0
        self._failed = 0
        self._last_completed: Optional[int] = None
        self._busy_since: Optional[float] = None  # monotonic start of the run in progress
        self._in_flight = False
        self._warned = False
        self._pid = -1
        self._instance = ""
        self._started = 0
        self._started_monotonic = 0.0

    def _identity(self) -> str:
        """This process's instance id: a forked child is a new instance with fresh counters."""
        if self._pid != os.getpid():
            self._pid, self._instance = os.getpid(), uuid.uuid4().hex
            self._started, self._started_monotonic = int(time.time()), time.monotonic()
            self._completed = self._failed = 0
            self._last_completed = None
        return self._instance

    def document(self, state: str) -> dict[str, Any]:
        """The ``queen.consumer.status/v1`` document of this instance now."""
        with self._mutex:
            instance = self._identity()
            now = time.monotonic()
            busy = self._busy_since
            pool = {
                "name": "singleton", "queue": None, "namespace": None, "task": self.job,
                "consumer_group": None, "desired": 1, "running": int(busy is not None),
                "busy": int(busy is not None), "completed": self._completed,
                "failed": self._failed, "last_completed_at_epoch": self._last_completed,
                "oldest_inflight_seconds": None if busy is None else int(now - busy),
            }
            return {
                "schema": SCHEMA, "instance_id": instance, "engine": "python",
                "execution_model": "singleton-job", "hostname": socket.gethostname(),
                "pid": os.getpid(), "state": state, "updated_at_epoch": int(time.time()),
                "started_at_epoch": self._started,
                "uptime_seconds": int(now - self._started_monotonic),
                "configuration": {"heartbeat_timeout": HEARTBEAT_TIMEOUT},
                "pool_status": [pool],
            }

    @contextlib.contextmanager
    def running(self, client: Queen) -> Iterator[None]:
        """Publish ``running`` now and every ``PUBLISH_EVERY`` s, then one ``stopped`` record."""
        self._begin()
        stop = threading.Event()
        thread = threading.Thread(target=self._loop, args=(client, stop),
                                  name="queen_sync-supervisor", daemon=True)
        thread.start()
        ok = False
        try:
            yield
            ok = True
        finally:
            self._end(ok)
            stop.set()
            thread.join(DEADLINE)  # the whole wait at the end, whatever the writes do

    def _begin(self) -> None:
        with self._mutex:
            self._identity()
            self._busy_since = time.monotonic()

    def _end(self, ok: bool) -> None:
        with self._mutex:
            self._busy_since = None
            self._last_completed = int(time.time())
            if ok:
                self._completed += 1
            else:
                self._failed += 1

    def _loop(self, client: Queen, stop: threading.Event) -> None:
        self.publish(client, "running")
        while not stop.wait(PUBLISH_EVERY):
            self.publish(client, "running")
        self.publish(client, "stopped")

    def publish(self, client: Queen, state: str) -> None:
        """Write the status once, waiting at most ``DEADLINE``; never raises."""
        try:
            document = self.document(state)
            ops = records(f"{self.group}/{document['instance_id']}", document)
        except Exception as exc:
            self._failure(f"could not encode it: {exc}")
            return
        with self._mutex:
            if self._in_flight:
                self._failure_locked("the previous write is still in flight")
                return
            self._in_flight = True
        errors: list[str] = []
        writer = threading.Thread(target=self._write, args=(client, ops, errors),
                                  name="queen_sync-supervisor-write", daemon=True)
        writer.start()
        writer.join(DEADLINE)
        if writer.is_alive():
            self._failure(f"the write took longer than {DEADLINE:g} s")
        elif errors:
            self._failure(errors[0])
        else:
            with self._mutex:
                self._warned = False

    def _write(self, client: Queen, ops: list[dict[str, Any]], errors: list[str]) -> None:
        try:
            answers = client.kv.batch(ops)
            if not all(answer.get("applied") is True for answer in answers):
                errors.append(f"the engine did not apply it: {answers[0]}")
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            with self._mutex:
                self._in_flight = False

    def _failure(self, why: str) -> None:
        with self._mutex:
            self._failure_locked(why)

    def _failure_locked(self, why: str) -> None:
        # One warning per outage, not one every period: the job goes on either way.
        level = logging.DEBUG if self._warned else logging.WARNING
        self._warned = True
        log.log(level, "supervision: could not publish the status of job %r to group %r "
                "(%s); the job goes on", self.job, self.group, why)

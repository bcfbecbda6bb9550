"""Every engine answers random histories of bodies exactly as the reference model does.

A hypothesis state machine sends random lock, KV-batch and transaction bodies,
from several owners and through two clients of one store, resends bodies
unchanged, and moves the engine's clock. Tokens, owners and ``expect`` versions
are drawn mostly from what the model holds live, so the success paths run as
often as the lost ones; acquires sometimes name another limit than the name's
live permits have, which every engine must refuse whole. After every call it
compares the engine's answer with ``model.reference`` (see ``model.matching`` for
what may differ: version numbering, and times on an engine with its own clock),
then reads the whole store back and checks the lease invariants on the engine.

Engines and their clocks: SQLite and LocalBroker run on the test's clock
(``SqliteEngine(clock=)``, ``LocalBroker(clock=)``); PostgreSQL judges time by the
database, so there TTLs are hours long (nothing expires during an example) and the
clock rule is off.

``QUEEN_SYNC_MODEL_EXAMPLES=500`` runs many more examples than CI does.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional, TypeVar

import pytest
from hypothesis import HealthCheck, event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from model.matching import LEARNED_BASE, LEARNED_SPAN, Clocks, Matcher, OrderMap
from model.reference import LOCKS_NS, Entry, Reference

import queen_sync as qs
from queen_sync._engines.sqlite import SqliteEngine

T = TypeVar("T")
EXAMPLES = int(os.environ.get("QUEEN_SYNC_MODEL_EXAMPLES", "0")) or None
STEPS = 40
BOGUS = 10**9  # a token and version no store reaches in an example; the same in both spaces

LOCKS = {"job": 1, "pool": 3, "duo": 2, "名": 1}  # each name's usual limit
LIMITS = (1, 2, 3)  # an acquire sometimes says another: refused while the name is held
APP_NS = ("app", "app.2")
KEYS = ("a", "a%", "a_", "ab", "aB", "b", "é")
PREFIXES = ("a", "a%", "a_", "b", "é")
PERMIT_KEYS = tuple(f"{name}#{slot}" for name in LOCKS for slot in range(max(LIMITS)))
OWNERS = ("alice", "bob", "carol", "dave")  # one more than the largest limit: "held" happens
ACQUIRED_NAMES = ("pool", "pool", "duo", "duo", "job", "名")  # semaphores twice as often

_LEAVES = (st.none() | st.booleans() | st.integers(-3, 3)
           | st.sampled_from([0.5, -1.25, 2.0, 1e-7, 10**15, "", "x", "ünï", "null"]))
VALUES = st.recursive(_LEAVES, lambda inner: st.lists(inner, max_size=2)
                      | st.dictionaries(st.sampled_from(["a", "b", "owner"]), inner, max_size=2),
                      max_leaves=4)


class EngineClock:
    """The engine's epoch clock, moved by the test; quarter seconds stay exact in float."""

    def __init__(self) -> None:
        self.ms = 1_700_000_000_000

    def __call__(self) -> float:
        return self.ms / 1000


@dataclass
class Store:
    """A fresh store: two clients on it, its clock when injectable, the TTLs to draw."""

    clients: list[qs.Queen]
    clock: Optional[EngineClock]
    ttls: tuple[int, ...]
    refusal: type[qs.QueenError]  # what a refused call raises here
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        for client in self.clients:
            client.close()
        for cleanup in self.cleanups:
            cleanup()


StoreFactory = Callable[[], Store]
SHORT_TTLS = (1, 2, 30, 3600)


def _sqlite_stores(request: pytest.FixtureRequest) -> StoreFactory:
    def open_store() -> Store:
        folder = tempfile.mkdtemp(prefix="queen-model-")
        clock = EngineClock()
        path = os.path.join(folder, "queen.db")
        clients = [qs.Queen(engine=SqliteEngine(path, clock=clock), renew_thread=False)
                   for _ in range(2)]
        return Store(clients, clock, SHORT_TTLS, qs.RequestError,
                     [lambda: shutil.rmtree(folder)])

    return open_store


def _http_stores(request: pytest.FixtureRequest) -> StoreFactory:
    from queen_sync.testing import LocalBroker

    def open_store() -> Store:
        clock = EngineClock()
        broker = LocalBroker(clock=clock).start()
        clients = [qs.Queen(broker.url, renew_thread=False) for _ in range(2)]
        return Store(clients, clock, SHORT_TTLS, qs.RequestError, [broker.close])

    return open_store


def _postgres_stores(request: pytest.FixtureRequest) -> StoreFactory:
    base = str(request.getfixturevalue("pg_url"))

    def open_store() -> Store:
        schema = "t_model_" + secrets.token_hex(6)
        # The pool draws from ``random`` in its worker thread as it opens a connection, and
        # hypothesis fails a draw that ``random`` moved under. With no idle minimum, the
        # one connection a lone caller needs opens while its first call waits: here.
        clients = [qs.Queen(f"{base}?schema={schema}", renew_thread=False, pool_min_size=0)
                   for _ in range(2)]
        for client in clients:
            client.locks.get("warm-up")
        return Store(clients, None, (3600, 86400), qs.RequestError,
                     [lambda: _drop_schema(base, schema)])

    return open_store


def _drop_schema(url: str, schema: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


OPENERS: dict[str, Callable[[pytest.FixtureRequest], StoreFactory]] = {
    "sqlite": _sqlite_stores, "http": _http_stores, "postgres": _postgres_stores}


def _show(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class ModelMachine(RuleBasedStateMachine):
    """Drives one fresh store and the model with the same calls; any difference fails."""

    open_store: ClassVar[StoreFactory]

    def __init__(self) -> None:
        super().__init__()
        self.store = type(self).open_store()
        self.model = Reference()
        self.draft = self.model  # what the next op drawn will meet (see ``_drafting``)
        self.versions = OrderMap()
        self.versions.pair(BOGUS, BOGUS)
        self.matcher = Matcher(self.versions, Clocks(exact=self.store.clock is not None))
        self.calls = 0
        self.last: Optional[tuple[str, dict[str, Any]]] = None
        self.issued: dict[str, list[int]] = {name: [] for name in LOCKS}  # model tokens
        self.engine_tokens: dict[str, set[int]] = {name: set() for name in LOCKS}
        self.known_versions: list[int] = []

    def teardown(self) -> None:
        self.store.close()

    # ---- one call to both ---------------------------------------------------------------

    def _now(self) -> int:
        if self.store.clock is not None:
            return self.store.clock.ms
        assert self.calls < LEARNED_SPAN, "too many calls for the learned clock's encoding"
        return LEARNED_BASE + self.calls

    def _to_engine(self, value: Any, key: str = "") -> Any:
        if isinstance(value, dict):
            return {k: v if k == "value" else self._to_engine(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [self._to_engine(v, key) for v in value]
        if key in ("token", "expect") and isinstance(value, int) and value:
            return self.versions.forward(value)
        return value

    def _engine_call(self, client: qs.Queen, route: str, body: dict[str, Any]) -> Any:
        """The engine's answer; a refusal becomes ``{"error": code}``, as the model says it."""
        try:
            return self._engine_answer(client, route, body)
        except self.store.refusal as refusal:
            status = getattr(refusal, "status", 400)
            assert status == 400, f"a refused call is a 400, not {status}: {refusal}"
            return {"error": getattr(refusal, "code", None)}

    @staticmethod
    def _engine_answer(client: qs.Queen, route: str, body: dict[str, Any]) -> Any:
        if route == "locks":
            return {"results": [dict(r) for r in client.locks.batch(body["operations"])]}
        if route == "kv":
            return {"results": [dict(r) for r in client.kv.batch(body["operations"])]}
        return dict(client._call_transaction(body))

    def send(self, route: str, body: dict[str, Any], client: int = 0) -> tuple[Any, Any]:
        """Send ``body`` (in the model's numbers) to the engine and the model; compare."""
        engine_body = self._to_engine(body)
        expected = self.model.call(route, body, self._now())
        self.calls += 1
        answer = _owner_only(route, body, self._engine_call(self.store.clients[client], route,
                                                            engine_body))
        note(f"call {self.calls} (client {client}) {route} {_show(engine_body)}\n"
             f"    -> {_show(answer)}")
        saved = self.versions.snapshot()
        problems = self.matcher.differences(expected, answer)
        if self.model.rolled_back:
            self.versions.restore(saved)
        if problems:
            note(f"    model: {_show(expected)}")
        assert not problems, f"{route} answered unlike the model: " + "; ".join(problems)
        self._learn(route, body, expected, answer)
        for verdict in _verdicts(route, body, expected):
            # Path tags for hypothesis's statistics (pytest lists them for @given tests only,
            # not for this runner).
            event(verdict)
        return expected, answer

    def _learn(self, route: str, body: dict[str, Any], expected: Any, answer: Any) -> None:
        if not self.model.rolled_back:
            self.known_versions.extend(_versions_in(expected))
        if route != "locks" or "error" in expected:
            return
        for op, mine, theirs in zip(body["operations"], expected["results"],
                                    answer["results"]):
            if not (mine.get("acquired") or mine.get("renewed")):
                continue
            name, token = op["name"], theirs["token"]
            seen = self.engine_tokens[name]
            assert token in seen or all(token > t for t in seen), (
                f"lock {name!r} issued token {token} not above every earlier one {sorted(seen)}")
            seen.add(token)
            if mine["token"] not in self.issued[name]:
                self.issued[name].append(mine["token"])

    # ---- what to send --------------------------------------------------------------------
    # Most draws come from what the model says is live now, so renews, releases, guards
    # and expects mostly take their success paths; stale and made-up ones come less often.
    # Ops are drawn against a draft of the model that the body's earlier ops already ran
    # on, so a later op in a body sees the token an earlier renew in it returns.

    def _drafting(self) -> None:
        self.draft = copy.deepcopy(self.model)

    def _drafted(self, route: str, op: dict[str, Any]) -> dict[str, Any]:
        self.draft.call(route, {"operations": [op]}, self._now())
        return op

    def _known(self, *versions: Optional[int]) -> list[int]:
        """Those of ``versions`` an answer has named: one minted earlier in the body has no
        engine number yet, as a real client would not know it either."""
        return [v for v in versions if v is not None and self.versions.knows(v)]

    def _token(self, data: st.DataObject, name: str, permit: Optional[Entry]) -> int:
        """Mostly ``permit``'s token or the one its last renew presented; else one between
        them (a resend minted past it), older, or foreign."""
        current = self._known(permit.version) if permit is not None else []
        previous = self._known(permit.prev_version) if permit is not None else []
        floor, top = (permit.prev_version, permit.version) if permit is not None else (None, 0)
        between = [t for t in self.issued[name] if floor is not None and floor < t < top]
        older = [t for t in reversed(self.issued[name])
                 if t not in current + previous + between]
        foreign = [BOGUS, *(t for n, ts in self.issued.items() if n != name for t in ts)]
        return _weighted(data, "token", (12, current), (3, previous), (6, between),
                         (1, older), (1, foreign))

    def _usable(self, name: str) -> list[tuple[int, Entry]]:
        """The live permits of ``name`` whose token (or the one before it) an answer named."""
        return [(slot, entry) for slot, entry in self.draft.permits(name)
                if self._known(entry.version, entry.prev_version)]

    def _permit(self, data: st.DataObject, name: str) -> tuple[Optional[int], Optional[Entry]]:
        permits = self._usable(name)
        if not permits:
            return None, None
        slot, entry = data.draw(st.sampled_from(permits), label="permit")
        return slot, entry

    def _lock_op(self, data: st.DataObject) -> dict[str, Any]:
        held = [name for name in sorted(LOCKS) if self._usable(name)]
        kind = _weighted(data, "op", (6, ["acquire"]),
                         (6 if held else 1, ["renew", "renew", "release"]), (1, ["get"]))
        if kind == "acquire":
            return self._acquire_op(data)
        name = _weighted(data, "name", (6, held), (1, sorted(LOCKS)))
        op: dict[str, Any] = {"op": kind, "name": name}
        if kind == "get":
            return op
        slot, permit = self._permit(data, name)
        op["token"] = self._token(data, name, permit)
        unsaid: list[Optional[int]] = [None]
        slots: list[Optional[int]] = list(range(max(LIMITS) + 1))
        mine: list[Optional[int]] = [] if slot is None else [slot]
        chosen = _weighted(data, "slot", (4, unsaid), (4, mine), (1, slots))
        if chosen is not None:
            op["slot"] = chosen
        if kind == "renew":
            op["ttlSeconds"] = data.draw(st.sampled_from(self.store.ttls))
            holder = [] if permit is None else [permit.value["owner"]]
            owner = _weighted(data, "owner", (8, holder), (1, [None]), (1, list(OWNERS)))
            if owner is not None:
                op["owner"] = owner
        return op

    def _acquire_op(self, data: st.DataObject) -> dict[str, Any]:
        name = data.draw(st.sampled_from(ACQUIRED_NAMES), label="name")
        op: dict[str, Any] = {"op": "acquire", "name": name,
                              "ttlSeconds": data.draw(st.sampled_from(self.store.ttls)),
                              "owner": data.draw(st.sampled_from(OWNERS), label="owner")}
        limit = _weighted(data, "limit", (6, [LOCKS[name]]), (1, list(LIMITS)))
        if limit > 1 or data.draw(st.booleans(), label="say limit 1"):
            op["limit"] = limit
        return op

    def _expiry(self, data: st.DataObject) -> dict[str, Any]:
        ttl = data.draw(st.none() | st.sampled_from(self.store.ttls), label="ttl")
        return {"forever": True} if ttl is None else {"ttlSeconds": ttl}

    def _expect(self, data: st.DataObject, ns: str, key: str) -> int:
        """Mostly the key's current version (0 if it is absent), else an older or made-up one."""
        entry = self.draft.live(ns, key)
        current = self._known(entry.version) if entry is not None else []
        previous = self._known(entry.prev_version) if entry is not None else []
        older = list(dict.fromkeys(v for v in reversed(self.known_versions[-8:])
                                   if v not in current + previous))
        return _weighted(data, "expect", (12, current),
                         (12 if entry is None else 1, [0]),
                         (1, previous), (1, older), (1, [BOGUS]))

    def _kv_key(self, data: st.DataObject, *, permits: bool, live_first: bool) -> tuple[str, str]:
        spaces = [(ns, KEYS) for ns in APP_NS] + ([(LOCKS_NS, PERMIT_KEYS)] if permits else [])
        every = [(ns, key) for ns, keys in spaces for key in keys]
        live = [(ns, key) for ns, key in every if self.draft.live(ns, key) is not None]
        ns, key = _weighted(data, "key", (6 if live_first else 0, live), (1, every))
        return ns, key

    def _kv_write(self, data: st.DataObject, kinds: list[str]) -> dict[str, Any]:
        kind = data.draw(st.sampled_from(kinds), label="op")
        some_live = any(self.draft.live(ns, key) for ns in APP_NS for key in KEYS)
        expects = kind == "check" or (kind in ("put", "delete") and _weighted(
            data, "with expect", (3, [some_live]), (1, [True, False])))
        ns, key = self._kv_key(data, permits=kind == "check",
                               live_first=expects or kind == "delete")
        op: dict[str, Any] = {"op": kind, "ns": ns, "key": key}
        if kind in ("put", "putIfAbsent"):
            op.update(value=data.draw(VALUES, label="value"), **self._expiry(data))
        if kind == "incr":
            op.update(delta=data.draw(st.sampled_from([1, -1, 2, 0.5, -3])), **self._expiry(data))
            for bound in ("min", "max"):
                limit = data.draw(st.none() | st.sampled_from([-2, 0, 3, 5]), label=bound)
                if limit is not None:
                    op[bound] = limit
        if expects:
            op["expect"] = self._expect(data, ns, key)
        if data.draw(st.sampled_from([False, False, True]), label="required"):
            op["required"] = True
        return op

    def _kv_read(self, data: st.DataObject) -> dict[str, Any]:
        kind = data.draw(st.sampled_from(["get", "getMany", "getPrefix"]), label="op")
        ns = data.draw(st.sampled_from([*APP_NS, LOCKS_NS]), label="ns")
        keys = PERMIT_KEYS if ns == LOCKS_NS else KEYS
        if kind == "get":
            return {"op": "get", "ns": ns, "key": data.draw(st.sampled_from(keys))}
        if kind == "getMany":
            chosen = data.draw(st.lists(st.sampled_from(keys), min_size=1, max_size=3,
                                        unique=True))
            return {"op": "getMany", "ns": ns, "keys": chosen}
        prefixes = [f"{n}#" for n in LOCKS] if ns == LOCKS_NS else list(PREFIXES)
        op: dict[str, Any] = {"op": "getPrefix", "ns": ns,
                              "prefix": data.draw(st.sampled_from(prefixes))}
        options: list[tuple[str, st.SearchStrategy[Any]]] = [
            ("after", st.sampled_from(keys)), ("limit", st.integers(1, 3)),
            ("keysOnly", st.booleans())]
        for name, strategy in options:
            value = data.draw(st.none() | strategy, label=name)
            if value is not None:
                op[name] = value
        return op

    def _guard(self, data: st.DataObject) -> dict[str, Any]:
        live = [(name, slot) for name in sorted(LOCKS) for slot, _ in self._usable(name)]
        every = [(name, slot) for name in sorted(LOCKS) for slot in range(max(LIMITS))]
        name, slot = _weighted(data, "guarded permit", (6, live), (1, every))
        permit = self.draft.live(LOCKS_NS, f"{name}#{slot}")
        return {"op": "check", "ns": LOCKS_NS, "key": f"{name}#{slot}",
                "expect": self._token(data, name, permit), "required": True}

    # ---- rules ----------------------------------------------------------------------------

    @rule(data=st.data(), client=st.integers(0, 1))
    def lock_batch(self, data: st.DataObject, client: int) -> None:
        self._drafting()
        ops = [self._drafted("locks", self._lock_op(data))
               for _ in range(data.draw(st.integers(1, 3), label="ops"))]
        self._remember("locks", {"operations": ops}, client)

    @rule(data=st.data(), client=st.integers(0, 1))
    def kv_batch(self, data: st.DataObject, client: int) -> None:
        self._drafting()
        ops = []
        for _ in range(data.draw(st.integers(1, 4), label="ops")):
            read = data.draw(st.booleans(), label="read")
            op = self._kv_read(data) if read else self._kv_write(data, _KV_WRITES)
            ops.append(self._drafted("kv", op))
        self._remember("kv", {"operations": ops}, client)

    @rule(data=st.data(), client=st.integers(0, 1))
    def transaction(self, data: st.DataObject, client: int) -> None:
        self._drafting()
        held = any(self._usable(name) for name in LOCKS)
        count = _weighted(data, "guards", (4, [1, 2, 0] if held else [0]), (1, [0, 1, 2]))
        guards = [self._guard(data) for _ in range(count)]
        writes = [self._drafted("kv", self._kv_write(data, _KV_WRITES))
                  for _ in range(data.draw(st.integers(0, 3), label="writes"))]
        self._remember("transaction", {"operations": [], "kv": guards + writes}, client)

    @precondition(lambda self: self.last is not None)
    @rule(client=st.integers(0, 1))
    def resend_the_last_body(self, client: int) -> None:
        assert self.last is not None
        self.send(*self.last, client)

    @precondition(lambda self: self.store.clock is not None)
    @rule(seconds=st.sampled_from([0.25, 0.75, 1, 2, 5, 31]))
    def advance_the_engine_clock(self, seconds: float) -> None:
        assert self.store.clock is not None
        before = self.store.clock.ms
        self.store.clock.ms += int(seconds * 1000)
        note(f"engine clock +{seconds}s")
        lapsed = [e for (ns, _), e in self.model.entries.items() if ns == LOCKS_NS
                  and e.expires_at is not None and before < e.expires_at <= self.store.clock.ms]
        if any((e.limit or 1) > 1 for e in lapsed):
            event("a semaphore permit expires while held")

    def _remember(self, route: str, body: dict[str, Any], client: int) -> None:
        self.last = (route, body)
        self.send(route, body, client)

    # ---- invariants, read from the engine itself ------------------------------------------

    @invariant()
    def the_store_keeps_the_lease_invariants(self) -> None:
        _, locks = self.send("locks", {"operations": [{"op": "get", "name": n} for n in LOCKS]})
        every_token: list[int] = []
        for name, result in zip(LOCKS, locks["results"]):
            holders = result["holders"]
            slots = [h["slot"] for h in holders]
            every_token.extend(h["token"] for h in holders)
            limit = self.model.limit_of(name) or 0  # the one limit its live permits have
            assert len(holders) <= limit, f"{name!r} has more permits than its limit {limit}"
            assert len(set(slots)) == len(slots) and all(s < limit for s in slots), (
                f"{name!r} has a bad slot listing: {holders}")
            if limit > 1 and len(holders) == limit:
                event("a semaphore is full")
            self._assert_live(holders, f"a permit of {name!r}")
        assert len(set(every_token)) == len(every_token), f"two permits share a token: {locks}"
        reads = [{"op": "getMany", "ns": ns, "keys": list(KEYS)} for ns in APP_NS]
        _, kv = self.send("kv", {"operations": [
            *reads, {"op": "getMany", "ns": LOCKS_NS, "keys": list(PERMIT_KEYS)}]})
        for result in kv["results"]:
            self._assert_live(result["rows"], "a key/value row")

    def _assert_live(self, rows: list[dict[str, Any]], what: str) -> None:
        clock = self.store.clock
        if clock is None:  # nothing expires on the database clock within an example
            return
        expired = [r for r in rows if r["expiresAt"] is not None and r["expiresAt"] <= clock.ms]
        assert not expired, f"{what} is listed after its expiry at {clock.ms}: {expired}"


_KV_WRITES = ["put", "putIfAbsent", "delete", "incr", "check"]


def _owner_only(route: str, body: dict[str, Any], answer: Any) -> Any:
    """The answer with permit rows' values cut to their owner.

    A permit row's value may carry the engine's bookkeeping beside the owner (the
    lock's limit, say); what the wire promises a reader of ``queen-locks`` is the owner.
    """
    if route == "locks":
        return answer
    ops = body["operations"] if route == "kv" else body["kv"]
    results = answer["results"] if route == "kv" else answer.get("kv", [])
    for op, result in zip(ops, results):
        if op.get("ns") == LOCKS_NS:
            _cut(result)
            for row in result.get("rows", []):
                _cut(row)
    failed = answer.get("failedIndex")
    if route == "transaction" and isinstance(failed, int) and ops[failed].get("ns") == LOCKS_NS:
        _cut(answer)
    return answer


def _cut(holder: dict[str, Any]) -> None:
    value = holder.get("value")
    if isinstance(value, dict) and "owner" in value:
        holder["value"] = {"owner": value["owner"]}


def _weighted(data: st.DataObject, label: str, *pools: tuple[int, list[T]]) -> T:
    """An item of one of the non-empty ``pools``, each drawn as often as its weight says.

    The first pool is the one a shrunk example falls back to, so it is the likely one.
    """
    kinds = [i for i, (weight, pool) in enumerate(pools) if pool for _ in range(weight)]
    kind = data.draw(st.sampled_from(kinds), label=f"kind of {label}")
    return data.draw(st.sampled_from(pools[kind][1]), label=label)


def _verdicts(route: str, body: dict[str, Any], answer: Any) -> list[str]:
    if "error" in answer:
        return [f"{route}: refused ({answer['error']})"]
    if route == "transaction":
        return [f"transaction: {answer.get('kvReason') or 'success'}"]
    ops = body["operations"]
    return [f"{route} {op['op']}: {result.get('reason') or 'ok'}"
            for op, result in zip(ops, answer["results"])]


def _versions_in(answer: Any) -> list[int]:
    """The versions an answer names (user values left alone), in order."""
    if isinstance(answer, list):
        return [v for item in answer for v in _versions_in(item)]
    if not isinstance(answer, dict):
        return []
    found = []
    for key, value in answer.items():
        if key in ("version", "token") and isinstance(value, int) and value:
            found.append(value)
        elif key != "value":
            found.extend(_versions_in(value))
    return found


def _settings() -> settings:
    return settings(max_examples=EXAMPLES or 20, stateful_step_count=STEPS, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


_counter = itertools.count()


class TestTheEnginesAgreeWithTheModel:
    @pytest.mark.timeout(0 if EXAMPLES else 120)
    @pytest.mark.parametrize("kind", sorted(OPENERS))
    def test_every_answer_to_a_random_history_matches_the_reference_model(
            self, kind: str, request: pytest.FixtureRequest) -> None:
        machine = type(f"{kind.capitalize()}Machine{next(_counter)}", (ModelMachine,),
                       {"open_store": staticmethod(OPENERS[kind](request))})
        run_state_machine_as_test(machine, settings=_settings())


class TestTheMatcher:
    def test_renumbered_versions_that_keep_their_order_match(self) -> None:
        versions = OrderMap()
        for model, engine in [(1, 10), (3, 31), (2, 17)]:
            assert versions.pair(model, engine) is None, (model, engine)
        assert versions.forward(3) == 31, "a known pair is kept"

    def test_a_version_out_of_order_or_reused_is_a_difference(self) -> None:
        versions = OrderMap()
        assert versions.pair(1, 10) is None and versions.pair(2, 20) is None
        assert versions.pair(3, 15) is not None, "a later model version must be higher"
        assert versions.pair(3, 20) is not None, "two versions may not share an engine number"
        assert versions.pair(1, 11) is not None, "a version keeps its number"

    def test_times_on_the_engine_clock_must_agree_per_call(self) -> None:
        clocks = Clocks(exact=False)
        assert clocks.pair(LEARNED_BASE + 4, 5_000) is None
        assert clocks.pair(LEARNED_BASE + 4 + 30_000, 35_000) is None, "the same call, +30 s"
        assert clocks.pair(LEARNED_BASE + 4 + 30_000, 36_000) is not None, "a wrong offset"
        assert clocks.pair(LEARNED_BASE + 9, 4_000) is not None, "time ran backwards"

    def test_user_values_are_compared_as_they_are(self) -> None:
        matcher = Matcher(OrderMap(), Clocks(exact=True))
        assert matcher.differences({"value": {"version": 1}}, {"value": {"version": 7}}), (
            "a 'version' inside a user's value is data, not a version")
        assert matcher.differences({"value": 1}, {"value": 1.0}), "1 and 1.0 differ in JSON"
        assert matcher.differences({"value": 1}, {"value": True}), "1 and true differ"


class TestTheModel:
    def test_an_acquire_with_another_limit_refuses_its_whole_body_in_the_model(self) -> None:
        model = Reference()
        pool = {"op": "acquire", "name": "pool", "ttlSeconds": 30, "limit": 3}
        model.call("locks", {"operations": [{**pool, "owner": "alice"}]}, 0)
        answer = model.call("locks", {"operations": [
            {"op": "acquire", "name": "job", "ttlSeconds": 30, "owner": "bob"},
            {**pool, "owner": "bob", "limit": 2}]}, 1)
        assert answer == {"error": "lock_limit_mismatch"}, answer
        assert model.permits("job") == [] and model.counter == 1, (
            "a refused body writes nothing, the ops before the refusal included")
        again = model.call("locks", {"operations": [{**pool, "owner": "bob"}]}, 2)
        assert again["results"][0]["slot"] == 1, f"the same limit still shares: {again}"

"""The official Queen client's lock, KV and transaction surfaces, walked against ours.

Code moves between queen_sync and the official client (``queen-mq``, imported as
``queen``), so every public method and keyword of those surfaces must exist here with
the same meaning; ours may add more. The walk reads the official package's signatures
(it is only imported, never connected) and fails on a method or keyword we lack, or a
parameter that is positional there and not here. Where we differ on purpose, the
difference is in ``DIFFERENCES`` with the reason.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any, Callable, get_type_hints

import pytest

# The official client (queen-mq, in the test extra); imported by this test only.
import queen
import queen.builders.transaction_builder as official_txn
import queen.kv.ops as official_kv_ops

import queen_sync as qs
from queen_sync._handle.kv import KvOpBuilders

# (surface, method, keyword or None for the whole method) -> why ours differs on purpose.
DIFFERENCES: dict[tuple[str, str, Any], str] = {
    ("Queen", "lock", "limit"): (
        "the official lock() takes only limit=1 and points to semaphore(); ours has no "
        "limit at all: a lock is one permit, semaphore(name, limit) is the one with more"),
    ("Queen", "lock", "retry_min"): (
        "a waiting acquire backs off on its own (10 ms doubling to 1 s, with jitter) and "
        "is woken on release where the engine can; there is no retry knob"),
    ("Queen", "lock", "retry_max"): "as retry_min",
    ("Queen", "semaphore", "retry_min"): "as for lock()",
    ("Queen", "semaphore", "retry_max"): "as for lock()",
    ("Lock", "run", "wait"): (
        "ours is run(fn, *args, **kwargs): the extra arguments go to fn (which is not "
        "handed the lock: qs.current_lock() reads it), and the wait is the handle's wait="),
    ("KvOps", "expiry_fields", None): (
        "a helper, not an op builder; ours is queen_sync._durations.expiry_fields, and "
        "every builder takes the same four expiry spellings"),
    ("KvOps", "is_unset", None): "the builders' sentinel test; ours need no public sentinel",
    ("KvOps", "UNSET", None): "as is_unset",
}

# Gaps in files another change owns, kept visible here until that change closes them.
PENDING: dict[tuple[str, str, Any], str] = {}


def _ours() -> Iterator[dict[str, Any]]:
    """Our objects, from a client that is never used: the surfaces and their builders."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder, \
            qs.Queen("sqlite://" + folder + "/q.db", renew_thread=False) as q:
        txn = q.transaction()
        hints = get_type_hints(type(txn).queue), get_type_hints(type(txn).timer)
        yield {
            "Queen": q, "Locks": q.locks, "Lock": q.lock("walk", ttl=30), "Kv": q.kv,
            "KvOps": KvOpBuilders, "Transaction": txn, "TransactionKv": txn.kv,
            "TransactionQueue": hints[0]["return"], "TransactionTimer": hints[1]["return"],
        }


@pytest.fixture(scope="module")
def ours() -> Iterator[dict[str, Any]]:
    yield from _ours()


def _public(cls: type) -> list[str]:
    return sorted(name for name in vars(cls) if not name.startswith("_"))


# surface -> (the official class or module, the public names of it to walk)
OFFICIAL: dict[str, tuple[Any, list[str]]] = {
    "Queen": (queen.Queen, ["kv", "lock", "locks", "semaphore", "transaction"]),
    "Locks": (queen.Locks, _public(queen.Locks)),
    "Lock": (queen.Lock, [*_public(queen.Lock), "lost"]),  # lost is set in __init__
    "Kv": (queen.KV, _public(queen.KV)),
    "KvOps": (official_kv_ops, list(official_kv_ops.__all__)),
    "Transaction": (official_txn.TransactionBuilder, _public(official_txn.TransactionBuilder)),
    "TransactionKv": (official_txn.TransactionKvBuilder,
                      _public(official_txn.TransactionKvBuilder)),
    "TransactionQueue": (official_txn.TransactionQueueBuilder,
                         _public(official_txn.TransactionQueueBuilder)),
    "TransactionTimer": (official_txn.TransactionTimerBuilder,
                         _public(official_txn.TransactionTimerBuilder)),
}

# Official methods that take **options and hand them on: their keywords are the target's.
OFFICIAL_FORWARDS: dict[tuple[str, str], Callable[..., Any]] = {
    ("Queen", "lock"): queen.Lock.__init__,
    ("Queen", "semaphore"): queen.Lock.__init__,
    ("TransactionKv", "put"): official_kv_ops.put,
    ("TransactionKv", "put_if_absent"): official_kv_ops.put_if_absent,
    ("TransactionKv", "delete"): official_kv_ops.delete,
    ("TransactionKv", "check"): official_kv_ops.check,
    ("TransactionKv", "incr"): official_kv_ops.incr,
}
# Our bundle methods that take exactly a builder's arguments (typed through a ParamSpec, so
# their runtime signature is *args, **kwargs): their keywords are the builder's.
OUR_FORWARDS: dict[tuple[str, str], Callable[..., Any]] = {
    ("TransactionKv", name): getattr(KvOpBuilders, name)
    for name in ("get", "get_many", "put", "put_if_absent", "delete", "incr")
}
# Parameters of a forward target that the forwarding method fills itself.
FORWARD_FILLED = {"self", "locks", "name", "ns", "key", "value"}


def _params(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values()
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _official_params(surface: str, name: str, fn: Callable[..., Any]) -> list[inspect.Parameter]:
    target = OFFICIAL_FORWARDS.get((surface, name))
    if target is None:
        return _params(fn)
    own = _params(fn)
    forwarded = [p for p in _params(target) if p.name not in FORWARD_FILLED]
    return own + [p.replace(kind=p.KEYWORD_ONLY) for p in forwarded
                  if p.name not in {o.name for o in own}]


def _our_callable(obj: Any, name: str) -> Any:
    """Our member, read off the class when there is one (properties stay unevaluated)."""
    owner = obj if inspect.isclass(obj) or inspect.ismodule(obj) else type(obj)
    member = inspect.getattr_static(owner, name, None)
    if isinstance(member, (staticmethod, classmethod)):
        return getattr(owner, name)
    if member is None:
        return getattr(obj, name, None)
    return member


def differences_in(surface: str, official: Any, names: list[str], ours: Any) -> list[str]:
    """What the official surface has and ours lacks (minus the documented differences)."""
    found: list[str] = []
    for name in names:
        if (surface, name, None) in DIFFERENCES:
            continue
        theirs = inspect.getattr_static(official, name, None)
        mine = _our_callable(ours, name)
        if mine is None:
            found.append(f"{surface}.{name}: missing")
            continue
        if not inspect.isfunction(theirs) or not callable(mine) or isinstance(mine, property):
            continue
        found.extend(_keyword_gaps(surface, name, _official_params(surface, name, theirs),
                                   OUR_FORWARDS.get((surface, name), mine)))
    return found


def _keyword_gaps(surface: str, name: str, theirs: list[inspect.Parameter],
                  mine: Callable[..., Any]) -> list[str]:
    if {(surface, name, "*")} & (set(DIFFERENCES) | set(PENDING)):
        return []
    our_params = _params(mine)
    by_name = {p.name: p for p in our_params}
    positional = [p.name for p in our_params if p.kind != p.KEYWORD_ONLY]
    gaps = []
    for index, param in enumerate(theirs):
        if (surface, name, param.name) in DIFFERENCES or (surface, name, param.name) in PENDING:
            continue
        if param.name not in by_name:
            gaps.append(f"{surface}.{name}: no keyword {param.name!r}")
        elif param.kind != param.KEYWORD_ONLY and positional[index:index + 1] != [param.name]:
            gaps.append(f"{surface}.{name}: {param.name!r} is positional #{index} there, "
                        f"not here")
    return gaps


class TestTheWalk:
    def test_the_official_package_imports_without_a_broker(self) -> None:
        assert queen.__version__ == "2.6.0", (
            f"the walk is written against 2.6.0, not {queen.__version__}")

    @pytest.mark.parametrize("surface", sorted(OFFICIAL))
    def test_every_official_method_and_keyword_exists_here(self, surface: str,
                                                           ours: dict[str, Any]) -> None:
        official, names = OFFICIAL[surface]
        assert names, f"nothing found to walk on {official!r}: the official layout changed"
        gaps = differences_in(surface, official, names, ours[surface])
        assert not gaps, "missing here (add it, or document it in DIFFERENCES):\n" + "\n".join(gaps)

    def test_every_documented_difference_is_still_one(self, ours: dict[str, Any]) -> None:
        stale = []
        for surface, name, keyword in [*DIFFERENCES, *PENDING]:
            mine = OUR_FORWARDS.get((surface, name)) or _our_callable(ours[surface], name)
            if keyword is None:
                if mine is not None:
                    stale.append(f"{surface}.{name} exists here now")
            elif keyword == "*":
                if mine is None or _params(mine):
                    stale.append(f"{surface}.{name} is not a refusing *args method here now")
            elif mine is not None and keyword in {p.name for p in _params(mine)}:
                stale.append(f"{surface}.{name} takes {keyword!r} here now")
        assert not stale, "drop these from DIFFERENCES:\n" + "\n".join(stale)

    def test_our_bundle_methods_take_exactly_the_builders_arguments(
            self, ours: dict[str, Any]) -> None:
        for (surface, name), builder in OUR_FORWARDS.items():
            kinds = {p.kind for p in inspect.signature(getattr(ours[surface], name)).parameters
                     .values()}
            assert kinds <= {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}, (
                f"{surface}.{name} has its own signature now: walk it instead of {builder}")

    def test_the_walk_finds_a_missing_method_keyword_or_position(self) -> None:
        class Theirs:
            def put(self, ns: str, key: str, *, expect: int = 0) -> None: ...

            def get(self, ns: str) -> None: ...

        class Mine:
            def put(self, key: str, ns: str) -> None: ...

        gaps = differences_in("Probe", Theirs, ["get", "put"], Mine())
        assert gaps == ["Probe.get: missing", "Probe.put: 'ns' is positional #0 there, not here",
                        "Probe.put: 'key' is positional #1 there, not here",
                        "Probe.put: no keyword 'expect'"], gaps

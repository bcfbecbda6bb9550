"""The invariant checker of a recorded history: pure functions over plain records.

A history is what the workers recorded (critical sections, fenced writes), what
the external sink logged (every write it accepted or refused, in its own order),
what the driver did (pauses, kills) and the store's counters at the end. The rules:

- ``duplicate_token``: two owners entered critical sections on one name with one token;
- ``token_not_rising``: a section entered with a token not above one already seen
  (by another section of that name) before it started;
- ``overlap``: two sections of one name overlapping in time that both had a fenced
  write accepted, neither excused;
- ``guard_inside_other``: a guarded commit accepted while another holder, not
  excused, was inside its own section of that name;
- ``stale_write_accepted``: the sink accepted a token below one it had accepted;
- ``lost_update``: an accepted sink write overwrote an update made, between its
  read and its write, by a section that was not excused; or the store's guarded
  read-modify-write counter differs from its ``incr`` twin; or the store has fewer
  increments than the guarded commits the workers saw accepted;
- anything a worker or the driver reported as a finding (an unexpected exception,
  a forked child believing it held its parent's lease, a crashed worker).

A section is EXCUSED when its holder was told the lease was lost, or when the
driver paused its process during it: such a holder may overlap a successor, and
only the fence (its writes refused) protects the work.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional


@dataclass(frozen=True)
class Section:
    """One critical section: ``end`` is when the holder left it, or when it was killed."""

    sec: str
    worker: str
    name: str
    token: Optional[int]
    start: float
    end: float
    lost: bool = False
    closed: bool = True
    owner: str = ""


@dataclass(frozen=True)
class SinkWrite:
    """One row of the external sink's log, in the sink's own order (``seq``)."""

    seq: int
    name: str
    token: int
    sec: str
    accepted: bool
    read: int = 0
    read_seq: int = 0
    before: int = 0


@dataclass(frozen=True)
class GuardWrite:
    """A guarded commit: sent at ``sent``, answered (and recorded) at ``answered``."""

    sec: str
    name: str
    token: Optional[int]
    ok: bool
    sent: float
    answered: float


@dataclass(frozen=True)
class Observation:
    """A token a section saw at (no earlier than) ``at``."""

    sec: str
    name: str
    token: int
    at: float


@dataclass(frozen=True)
class Violation:
    rule: str
    detail: str


@dataclass
class History:
    sections: list[Section] = field(default_factory=list)
    sink: list[SinkWrite] = field(default_factory=list)
    guards: list[GuardWrite] = field(default_factory=list)
    observations: list[Observation] = field(default_factory=list)
    pauses: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    counters: dict[str, tuple[int, int]] = field(default_factory=dict)  # name: (incr, rmw)
    findings: list[Violation] = field(default_factory=list)


# ---- from records ----------------------------------------------------------------------------


def from_records(records: Iterable[dict[str, Any]], kills: dict[str, list[float]]) -> History:
    """Sections, guarded writes, token observations and findings from the workers' records.

    A section without an ``exit`` ends at its worker's first kill after it began, or at
    the next section its thread entered, whichever comes first, else at its last record
    (the worker stopped recording: that is a finding too).
    """
    history = History()
    enters: dict[str, dict[str, Any]] = {}
    exits: dict[str, dict[str, Any]] = {}
    last_seen: dict[str, float] = {}
    for r in records:
        kind = r["k"]
        if kind == "enter":
            enters[r["sec"]] = r
            if r.get("token") is not None:
                history.observations.append(Observation(r["sec"], r["name"], r["token"], r["t"]))
        elif kind == "exit":
            exits[r["sec"]] = r
        elif kind in ("ext", "guard"):
            last_seen[r["sec"]] = r["t"]
            if r.get("token") is not None:
                history.observations.append(Observation(r["sec"], r["name"], r["token"], r["t"]))
            if kind == "guard":
                history.guards.append(GuardWrite(r["sec"], r["name"], r.get("token"),
                                                 bool(r["ok"]), r["t0"], r["t"]))
        elif kind == "error":
            history.findings.append(Violation(
                "worker_error", f"pid {r['pid']}: {r['type']}: {r['msg']}"))
        elif kind == "fork" and r["inherited"]:
            history.findings.append(Violation(
                "fork_inherited", f"forked child {r['pid']} believed it held its parent's lease"))
    starts: dict[str, list[float]] = {}
    for sec, enter in enters.items():
        starts.setdefault(_thread_of(sec), []).append(enter["t"])
    for sec, enter in enters.items():
        later = [t for t in starts[_thread_of(sec)] if t > enter["t"]]
        kills_or_next = {w: [*ts, *later] for w, ts in kills.items()} if later else kills
        if later and enter["w"] not in kills_or_next:
            kills_or_next = {**kills_or_next, enter["w"]: later}
        history.sections.append(_section(enter, exits.get(sec), kills_or_next, last_seen))
    return history


def _thread_of(sec: str) -> str:
    """``worker/pid/thread/count`` -> ``worker/pid/thread``: sections of one thread never nest."""
    return sec.rsplit("/", 1)[0]


def _section(enter: dict[str, Any], exit_: Optional[dict[str, Any]],
             kills: dict[str, list[float]], last_seen: dict[str, float]) -> Section:
    start, worker = enter["t"], enter["w"]
    if exit_ is not None:
        return Section(enter["sec"], worker, enter["name"], enter.get("token"), start,
                       exit_["t"], bool(exit_["lost"]), owner=enter.get("owner", ""))
    killed = [t for t in kills.get(worker, []) if t >= start]
    end = min(killed) if killed else last_seen.get(enter["sec"], start)
    return Section(enter["sec"], worker, enter["name"], enter.get("token"), start, end,
                   closed=False, owner=enter.get("owner", ""))


# ---- the rules -------------------------------------------------------------------------------


def check(history: History) -> list[Violation]:
    """Every violation of the history, rule by rule (empty: the history is correct)."""
    excused = {s.sec for s in history.sections if is_excused(s, history.pauses)}
    return [*history.findings,
            *duplicate_tokens(history.sections),
            *tokens_not_rising(history.sections, history.observations),
            *overlaps(history, excused),
            *guards_inside_others(history, excused),
            *stale_writes(history.sink),
            *lost_sink_updates(history.sink, excused, {s.sec for s in history.sections}),
            *lost_store_updates(history)]


def is_excused(section: Section, pauses: dict[str, list[tuple[float, float]]]) -> bool:
    """Told it lost the lease, or paused by the driver while inside the section."""
    if section.lost:
        return True
    return any(t0 < section.end and t1 > section.start for t0, t1 in pauses.get(section.worker, []))


def duplicate_tokens(sections: list[Section]) -> list[Violation]:
    """One token entered by two owners. One owner may enter again with its token: a handle
    whose release failed keeps holding, and its next block goes on with the same lease."""
    owners: dict[tuple[str, int], set[str]] = defaultdict(set)
    for s in sections:
        if s.token is not None:
            owners[(s.name, s.token)].add(s.owner)
    return [Violation("duplicate_token", f"{n}: token {t} entered by owners {sorted(o)}")
            for (n, t), o in sorted(owners.items()) if len(o) > 1]


def tokens_not_rising(sections: list[Section], observations: list[Observation]
                      ) -> list[Violation]:
    """Each section's entry token must exceed every token of its name seen before it began
    (equal is the same lease going on, when the owner is the same)."""
    owner_of = {s.sec: s.owner for s in sections}
    found = []
    for name, group in _by_name(sections).items():
        seen = sorted((o.at, o.token, o.sec) for o in observations if o.name == name)
        times = [at for at, _, _ in seen]
        prefix = _prefix_top2([(token, sec) for _, token, sec in seen])
        for s in group:
            if s.token is None:
                continue
            i = bisect.bisect_left(times, s.start)
            rival = _other(prefix[i - 1], s.sec) if i else None
            if rival is None or rival[0] < s.token:
                continue
            if rival[0] == s.token and owner_of.get(rival[1]) == s.owner:
                continue
            found.append(Violation("token_not_rising",
                                   f"{name}: section {s.sec} entered with token {s.token} "
                                   f"after section {rival[1]} had seen token {rival[0]:g}"))
    return found


def _prefix_top2(items: list[tuple[float, str]]) -> list[list[tuple[float, str]]]:
    """For each prefix of ``(value, sec)`` items: the highest value, and the highest of
    another section (so a section is never compared with itself)."""
    out: list[list[tuple[float, str]]] = []
    best: list[tuple[float, str]] = []
    for item in items:
        merged = sorted([*best, item], reverse=True)
        best = [merged[0], *[m for m in merged[1:] if m[1] != merged[0][1]][:1]]
        out.append(best)
    return out


def _other(top: list[tuple[float, str]], sec: str) -> Optional[tuple[float, str]]:
    return next((item for item in top if item[1] != sec), None)


def overlaps(history: History, excused: set[str]) -> list[Violation]:
    """Sections with accepted writes, not excused, must not overlap on one name."""
    writers = {w.sec for w in history.sink if w.accepted} | {g.sec for g in history.guards if g.ok}
    found = []
    for name, group in _by_name(history.sections).items():
        latest: Optional[Section] = None
        for s in sorted(group, key=lambda s: s.start):
            if s.sec not in writers or s.sec in excused:
                continue
            if latest is not None and s.start < latest.end:
                found.append(Violation("overlap", f"{name}: {_span(latest)} and {_span(s)} "
                                                  "were both inside and both wrote"))
            if latest is None or s.end > latest.end:
                latest = s
    return found


def _span(s: Section) -> str:
    return (f"section {s.sec} (token {s.token}, {s.start:.3f}..{s.end:.3f}"
            f"{'' if s.closed else ', killed or cut off'})")


def guards_inside_others(history: History, excused: set[str]) -> list[Violation]:
    """A guarded commit accepted within another live holder's section broke the guard."""
    found = []
    for name, group in _by_name(history.sections).items():
        live = sorted((s for s in group if s.sec not in excused), key=lambda s: s.start)
        starts = [s.start for s in live]
        prefix = _prefix_top2([(s.end, s.sec) for s in live])
        for g in history.guards:
            if g.name != name or not g.ok:
                continue
            i = bisect.bisect_left(starts, g.sent)
            rival = _other(prefix[i - 1], g.sec) if i else None
            if rival is not None and rival[0] > g.answered:
                found.append(Violation("guard_inside_other",
                                       f"{name}: section {g.sec}'s guarded commit (token "
                                       f"{g.token}, sent at {g.sent:.3f}) was accepted inside "
                                       f"section {rival[1]}, not told of any loss"))
    return found


def stale_writes(sink: list[SinkWrite]) -> list[Violation]:
    found = []
    high: dict[str, int] = {}
    for w in sorted(sink, key=lambda w: w.seq):
        if not w.accepted:
            continue
        if w.token < high.get(w.name, 0):
            found.append(Violation("stale_write_accepted",
                                   f"{w.name}: write {w.seq} with token {w.token} accepted "
                                   f"after token {high[w.name]}"))
        high[w.name] = max(high.get(w.name, 0), w.token)
    return found


def lost_sink_updates(sink: list[SinkWrite], excused: set[str], known: set[str]
                      ) -> list[Violation]:
    """An accepted write that overwrote a live holder's update made after its read."""
    found = []
    accepted: dict[str, list[SinkWrite]] = defaultdict(list)
    for w in sorted(sink, key=lambda w: w.seq):
        if w.accepted:
            accepted[w.name].append(w)
    for name, writes in accepted.items():
        seqs = [w.seq for w in writes]
        for w in writes:
            if w.before == w.read:
                continue
            between = writes[bisect.bisect_right(seqs, w.read_seq):bisect.bisect_left(seqs, w.seq)]
            culprits = [b for b in between
                        if b.sec != w.sec and (b.sec not in excused or b.sec not in known)]
            if culprits:
                found.append(Violation("lost_update",
                                       f"{name}: sink write {w.seq} (section {w.sec}) read "
                                       f"{w.read} but overwrote {w.before}, written by "
                                       f"section {culprits[-1].sec}"))
    return found


def lost_store_updates(history: History) -> list[Violation]:
    found = []
    committed = Counter(g.name for g in history.guards if g.ok)
    for name, (incr, rmw) in sorted(history.counters.items()):
        if incr != rmw:
            found.append(Violation("lost_update", f"{name}: the guarded read-modify-write "
                                                  f"counter is {rmw}, its incr twin {incr}"))
        if incr < committed[name]:
            found.append(Violation("lost_update", f"{name}: {committed[name]} guarded commits "
                                                  f"were accepted but the store counts {incr}"))
    return found


def _by_name(sections: list[Section]) -> dict[str, list[Section]]:
    groups: dict[str, list[Section]] = defaultdict(list)
    for s in sections:
        groups[s.name].append(s)
    return groups

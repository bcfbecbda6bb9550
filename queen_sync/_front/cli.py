"""The ``queen-sync`` command line (also ``python -m queen_sync``).

``run`` is ``flock -n`` across hosts: it takes the lease, runs the command with
the lease in its environment, keeps the lease renewed while the command runs,
stops the command when the lease is lost, and releases the lease when the
command ends. ``holders``, ``release`` and ``ping`` are for operators.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import secrets
import shlex
import signal
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Optional, Sequence

from .._durations import (
    MIN_TTL_SECONDS,
    duration_or_zero,
    lease_seconds,
    parse_duration,
    utc_text,
)
from .._engines.base import redact_url_for_error
from .._errors import EngineError, QueenError, RequestError
from .._ops import MAX_LIMIT, MAX_TOKEN
from .._results import describe_holders
from .._version import __version__
from .cli_child import Child, StopRequested, StopSignals, hold_closed_stdio, relays_stdout
from .singleton import LOST_EXIT_CODE

if TYPE_CHECKING:
    from .._client import Queen
    from .._handle.lock import Lock
    from .._results import Holder

EX_BUSY = 75  # EX_TEMPFAIL: somebody else holds it, try again later
EX_UNAVAILABLE = 69  # EX_UNAVAILABLE: the engine could not be reached
EX_NOT_RELEASED = 1
EX_IOERR = 74  # EX_IOERR: stdout could not be written (closed, or a full disk)
EX_READER_GONE = 128 + 13  # what a shell reports for a tool that SIGPIPE ended, as `yes | head`

_EPILOG = """\
examples:
  queen-sync run daily-report --ttl 1m -- sh -c 'echo "holding with token $QUEEN_LOCK_TOKEN"'
  queen-sync holders daily-report --json
  queen-sync release daily-report --token 42
  queen-sync ping

The engine is --url, else $QUEEN_URL, else an SQLite file in the user's state
directory (~/.local/state/queen_sync/queen.db): sqlite:///path.db,
http(s)://host:6632 (a Queen broker) or postgresql://user@host/db.

exit codes: 0 ok (run: the command's own code; a command killed by signal N: 128+N),
  1 nothing released, 2 bad usage, 69 engine unreachable,
  75 busy (run, changeable with --busy-exit-code), 76 run: the lease was lost and the
  command was stopped, 126/127 run: the command could not be executed / was not found.
"""

_RUN_EPILOG = f"""\
examples:
  queen-sync run daily-report --ttl 1m -- sh -c 'echo "$QUEEN_LOCK_NAME token $QUEEN_LOCK_TOKEN"'
  queen-sync run nightly-etl --ttl 5m --wait 30s -- python -c "print('etl done')"
  queen-sync run crawler --limit 2 --ttl 30s -- sh -c 'echo "slot $QUEEN_LOCK_SLOT"'

The command gets QUEEN_LOCK_NAME, QUEEN_LOCK_OWNER, QUEEN_LOCK_TOKEN (the fencing
token when it started: hand it to sinks that refuse older tokens) and
QUEEN_LOCK_SLOT. It runs in its own process group; SIGINT, SIGTERM, SIGHUP and
SIGQUIT sent to queen-sync are forwarded to it; after a forwarded SIGTERM or SIGINT
the group gets SIGKILL if it is still running --grace later. When the lease is lost
the group gets SIGTERM, then SIGKILL after --grace. What the command leaves running
in its group when it exits gets SIGTERM, then SIGKILL after --grace, before the lease
is released (with a warning). If queen-sync itself is killed (kill -9, the OOM
killer), the group gets SIGKILL at once. If it is stopped (SIGSTOP, Ctrl-Z) the
command runs on unrenewed; once continued past the TTL it stops the command and exits
76. Processes that leave the group (setsid, a shell's job control: set -m) are beyond
reach. A failed final release only warns: the lease expires within its TTL. With --json
the last line of stdout is the run's result: name, acquired, owner, token, slot,
exit_code, held_seconds, lost, released and holders.

exit codes: the command's own (128+N when killed by signal N); {EX_BUSY} when the lease
is busy (--busy-exit-code), naming the holder on stderr; {LOST_EXIT_CODE} when the lease
was lost and the command was stopped; 126/127 when it could not be executed / found;
{EX_UNAVAILABLE} when the engine could not be reached.
"""

_HOLDERS_EPILOG = """\
examples:
  queen-sync holders daily-report
  queen-sync holders daily-report nightly-etl --json
"""

_RELEASE_EPILOG = """\
examples:
  queen-sync release daily-report --token 42
  queen-sync release crawler --token 57 --slot 1

Break-glass for operators: frees the permit held at that token (see `holders`).
A token that is neither the live one nor the one its last renew replaced releases nothing
(exit code 1).
"""

_PING_EPILOG = """\
examples:
  queen-sync ping
  queen-sync ping --json

Acquires and releases a probe lock, and prints the engine, its URL (without
credentials) and the round trip.
"""


class _Help(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30)


# A word argparse quotes in its message (a repr: escapes and the other quote inside it).
_QUOTED = re.compile(r"""'(?:[^'\\]|\\.)*'""" r'|"(?:[^"\\]|\\.)*"')
_URL_IN_TEXT = re.compile(r"""[^\s'"]*://[^\s'"]*""")
# One command-line word: a URL runs from its scheme (at the start or after ``=``) to the
# word's end, spaces and quotes included, since a password may hold them.
_URL_IN_WORD = re.compile(r"(?<![^=])[A-Za-z][A-Za-z0-9+.-]*://.*", re.S)
# A ``password=`` field of a key-value connection string, which holds no ``://`` to find:
# in a word, masked to the word's end (its quoting may hide where the password ends).
_PASSWORD_IN_WORD = re.compile(r"((?:ssl)?password\s*=\s*).*", re.I | re.S)
_PASSWORD_FIELD = re.compile(r"""((?:ssl)?password\s*=\s*)\S+""", re.I)


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line naming the option, as Unix tools print them; exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {mask_urls(option_first(message))}\n")


def mask_urls(text: str) -> str:
    """``text`` with every URL in it masked, for argparse's echo of a word it refused."""
    text = _QUOTED.sub(lambda found: _masked_quote(found.group()), text)
    text = _URL_IN_TEXT.sub(lambda found: redact_url_for_error(found.group()), text)
    return _PASSWORD_FIELD.sub(r"\1***", text)


def _masked_quote(span: str) -> str:
    """A quoted word of a message, masked as the word it is; it keeps its quotes."""
    return f"{span[0]}{_masked_word(span[1:-1], None)}{span[0]}"


def _masked_word(word: str, url: Optional[str]) -> str:
    """A command-line word as a usage error may echo it: the engine URL's secrets masked.

    A key-value connection string holds no ``://`` to find, so the ``--url`` value, whatever
    its form, is masked where it stands.
    """
    if url and url in word:
        shown = redact_url_for_error(url) if "://" in url else "***" if "=" in url else url
        return word.replace(url, shown)
    word = _URL_IN_WORD.sub(lambda found: redact_url_for_error(found.group()), word)
    return _PASSWORD_IN_WORD.sub(r"\1***", word)


def option_first(message: str) -> str:
    """``argument --ttl: X`` as ``--ttl: X``, and just ``X`` when X names the option itself."""
    found = re.fullmatch(r"argument (\S+): (.*)", message, re.S)
    if found is None:
        return message
    option, problem = found.groups()
    return problem if problem.startswith(option) else f"{option}: {problem}"


def duration_arg(what: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        return _duration(parse_duration, text, what)

    return parse


def ttl_arg(text: str) -> float:
    """A ``--ttl`` value: a lease's lifetime, refused below the minimum as every TTL is."""
    return _duration(lease_seconds, text, "--ttl")


def wait_arg(text: str) -> float:
    """A ``--wait`` value: a duration, or zero in any spelling the durations read for no wait."""
    return _duration(duration_or_zero, text, "--wait")


def _duration(read: Callable[..., float], text: str, what: str) -> float:
    """``read(text)``: seconds, or the usage error saying why ``text`` is refused."""
    try:
        return read(text, what=what)
    except (TypeError, ValueError) as exc:
        if _is_negative_duration(text):  # the same refusal as the number ``-5`` gets
            raise argparse.ArgumentTypeError(
                f"{what} must be a positive, finite duration, got {text!r}") from exc
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _is_negative_duration(text: str) -> bool:
    """Whether ``text`` is a minus before a duration, as ``-5s``: the durations have no sign."""
    unsigned = text.strip()
    if not unsigned.startswith("-"):
        return False
    try:
        parse_duration(unsigned[1:])
    except (TypeError, ValueError):
        return False
    return True


def _subcommand(words: list[str]) -> Optional[str]:
    """The first word that is neither an option nor ``--url``'s value: the subcommand."""
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word.startswith("-"):
            skip = word in ("--url", "--ur", "--u")  # its value is the next word
        else:
            return word
    return None


# The options that take a value, and a value that starts like a negative number.
_VALUE_OPTIONS = ("--ttl", "--wait", "--grace", "--limit", "--busy-exit-code", "--token",
                  "--slot")
_NEGATIVE_VALUE = re.compile(r"-\.?\d")


def _joined_negative_values(words: list[str]) -> list[str]:
    """``--ttl -5s`` as ``--ttl=-5s``, so that the value is refused for what it is.

    argparse takes a word starting with ``-`` (other than a plain number) for an option, and
    would say "expected one argument" instead.
    """
    joined: list[str] = []
    pending: Optional[str] = None
    for at, word in enumerate(words):
        if word == "--":  # what follows is names and a command, never options
            return joined + words[at:]
        if pending is not None and _NEGATIVE_VALUE.match(word):
            joined[-1] = f"{pending}={word}"
            pending = None
            continue
        joined.append(word)
        takes = [name for name in _VALUE_OPTIONS if len(word) > 2 and name.startswith(word)]
        pending = word if "=" not in word and len(takes) == 1 else None
    return joined


def _int(low: int, high: Optional[int] = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(
                f"must be {low}..{high}, got {value}" if high is not None
                else f"must be at least {low}, got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand (``--url``/``--json`` go before or after it)."""
    common = _Parser(add_help=False)
    common.add_argument("--url", default=argparse.SUPPRESS,
                        help="engine URL (default: $QUEEN_URL, else the embedded SQLite file)")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="machine-readable output")
    parser = _Parser(
        prog="queen-sync", parents=[common], formatter_class=_Help, epilog=_EPILOG,
        description="Leases with fencing tokens from the shell: run a command under a lock "
                    "shared across hosts, list and release holders, check the engine.")
    parser.add_argument("--version", action="version", version=f"queen-sync {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = commands.add_parser(
        "run", parents=[common], formatter_class=_Help, epilog=_RUN_EPILOG,
        usage="queen-sync run NAME [--ttl 5m] [--wait 30s] [--limit N] [--busy-exit-code 75] "
              "[--grace 10s] -- CMD [ARGS...]",
        help="run a command while holding a lease (like flock -n, across hosts)",
        description="Run CMD while holding the lease NAME; exit 75 at once when it is busy.")
    run.add_argument("name", metavar="NAME")
    run.add_argument("--ttl", type=ttl_arg, default=300.0,
                     help="lease lifetime, renewed at a third of it (default 5m, at least "
                          f"{MIN_TTL_SECONDS:g}s)")
    run.add_argument("--wait", type=wait_arg, default=0.0,
                     help="how long to wait for a busy lease (default 0: do not wait)")
    run.add_argument("--limit", type=_int(1, MAX_LIMIT), default=1,
                     help="permits of NAME (a semaphore when > 1; default 1)")
    run.add_argument("--busy-exit-code", type=_int(0, 255), default=EX_BUSY,
                     help=f"exit code when busy (default {EX_BUSY}, EX_TEMPFAIL)")
    run.add_argument("--grace", type=duration_arg("--grace"), default=10.0,
                     help="how long the command has to stop after a lost lease or a forwarded "
                          "SIGTERM/SIGINT before SIGKILL (default 10s)")
    holders = commands.add_parser(
        "holders", parents=[common], formatter_class=_Help, epilog=_HOLDERS_EPILOG,
        help="list who holds the named locks",
        description="List the live permits of each NAME: slot, owner, token, since, expires in.")
    holders.add_argument("names", metavar="NAME", nargs="+")
    release = commands.add_parser(
        "release", parents=[common], formatter_class=_Help, epilog=_RELEASE_EPILOG,
        help="release a permit by its token (break-glass)",
        description="Release the permit of NAME held at TOKEN.")
    release.add_argument("name", metavar="NAME")
    release.add_argument("--token", type=_int(1, MAX_TOKEN), required=True,
                         help="the holder's token")
    release.add_argument("--slot", type=_int(0, 1023), default=None, help="the permit's slot")
    commands.add_parser(
        "ping", parents=[common], formatter_class=_Help, epilog=_PING_EPILOG,
        help="check the engine: one acquire and release of a probe lock",
        description="Round-trip an acquire and a release on a probe lock.")
    return parser


_LOGGERS_SHOWN = ("queen_sync", "psycopg")


class _OneLine(logging.Formatter):
    """Log lines for an operator's terminal: an error's own message, never a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"queen-sync: {record.getMessage()}"
        if record.exc_info and record.exc_info[1] is not None:
            line += f" ({record.exc_info[1]})"
        return one_line(line)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the process exit code."""
    hold_closed_stdio()  # first: before anything opens a descriptor
    words = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in words and _subcommand(words[:words.index("--")]) == "run":
        cut = words.index("--")
        words, command = words[:cut], words[cut + 1:]
    parser = build_parser()
    words = _joined_negative_values(words)
    args, extra = parser.parse_known_args(words)
    if extra:
        shown = [_masked_word(word, getattr(args, "url", None)) for word in words]
        parser.error(_unrecognized(args.command, shown,
                                   [_masked_word(w, getattr(args, "url", None)) for w in extra],
                                   bool(command)))
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "run" and not command:
        parser.error("run needs the command after --, e.g. "
                     "queen-sync run daily-report --ttl 1m -- python job.py")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLine())
    # The driver's pool logs its connection failures too; with no handler of its own they
    # would reach Python's last-resort one, several lines and unprefixed.
    loggers = [logging.getLogger(name) for name in _LOGGERS_SHOWN]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        code = _dispatch(args, command)
        _flush_stdout()  # here, not at exit, so a reader that went away is seen here
        return code
    except _StdoutFailed as exc:
        _quiet_stdout()
        print(f"queen-sync: could not write to stdout: {exc}", file=sys.stderr)
        return EX_IOERR
    except RequestError as exc:  # before EngineError: a broker's 400 is both, and is ours
        return _failed(args, str(exc), 2)
    except EngineError as exc:
        return _failed(args, f"engine unavailable: {exc}", EX_UNAVAILABLE)
    except (QueenError, ValueError) as exc:  # e.g. a lock name the engine refuses
        return _failed(args, str(exc), 2)
    except BrokenPipeError:
        _quiet_stdout()
        return EX_READER_GONE
    except KeyboardInterrupt:
        return _failed(args, "interrupted (SIGINT)", 128 + signal.SIGINT)
    except StopRequested as stopped:  # it came before the run's lease was asked for
        return _failed(args, f"stopped ({signal.Signals(stopped.signum).name})",
                       128 + stopped.signum)
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def one_line(text: str) -> str:
    """``text`` on one line: a driver's several lines (libpq's hint) joined, none dropped."""
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def _failed(args: argparse.Namespace, message: str, code: int) -> int:
    """Say why on stderr; ``run --json`` still ends stdout with its result."""
    line = one_line(message)
    print(f"queen-sync: {line}", file=sys.stderr)
    if args.command == "run" and getattr(args, "json", False):
        _print_result(_run_json(args.name, code, error=line))
    return code


def _quiet_stdout() -> None:
    """Point stdout at /dev/null once its reader has gone, so the exit-time flush is silent."""
    if sys.stdout is None:  # started closed: nothing is buffered for it
        return
    with contextlib.suppress(OSError, ValueError):  # a stdout with no descriptor (a test's)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _unrecognized(subcommand: Optional[str], words: list[str], extra: list[str],
                  has_command: bool) -> str:
    """What argparse did not take: unknown options, or (for run) a command missing its --."""
    if all(word.startswith("-") for word in extra):
        plural = "s" if len(extra) > 1 else ""
        return f"unknown option{plural} for {subcommand or 'queen-sync'}: {shlex.join(extra)}"
    hint = _double_dash_hint(words, extra) if subcommand == "run" and not has_command else ""
    return f"unrecognized arguments: {shlex.join(extra)}{hint}"


def _double_dash_hint(words: list[str], extra: list[str]) -> str:
    """The line as it should have been: the words argparse did not take go after ``--``."""
    options, pending = [], list(extra)
    for word in words:
        if pending and word == pending[0]:
            pending.pop(0)
        else:
            options.append(word)
    return f"; put the command after --: queen-sync {shlex.join(options)} -- {shlex.join(extra)}"


def _dispatch(args: argparse.Namespace, command: list[str]) -> int:
    from .._client import Queen

    as_json = bool(getattr(args, "json", False))
    with Queen(getattr(args, "url", None)) as client:
        if args.command == "run":
            return _run(client, args, command, as_json)
        if args.command == "holders":
            return _holders(client, args.names, as_json)
        if args.command == "release":
            return _release(client, args.name, args.token, args.slot, as_json)
        return _ping(client, as_json)


# ---- run ------------------------------------------------------------------------------------


def _run(client: Queen, args: argparse.Namespace, command: list[str], as_json: bool) -> int:
    if args.limit > 1:
        lock = client.semaphore(args.name, args.limit, ttl=args.ttl)
    else:
        lock = client.lock(args.name, ttl=args.ttl)
    with StopSignals() as stops:
        try:
            acquired = lock.acquire(wait=args.wait)
            stops.held()
        except StopRequested as stopped:
            stops.held()
            return _stopped_taking(lock, stopped.signum, as_json)
        if not acquired:
            print(f"queen-sync: {args.name!r} is busy: {describe_holders(lock.holders)}",
                  file=sys.stderr)
            code = int(args.busy_exit_code)
            if as_json:
                _print_result(_run_json(lock.name, code, holders=[_holder_json(args.name, h)
                                                                  for h in lock.holders]))
            return code
        held: dict[str, Any] = {"acquired": True, "owner": lock.owner, "token": lock.token,
                                "slot": lock.slot}
        started = time.monotonic()
        try:
            child = Child(lock, command, args.grace, relay_stdout=as_json and relays_stdout())
            code = child.run(stops)
        finally:
            held["released"] = _final_release(lock)
    if as_json:
        _print_result(_run_json(lock.name, code, lost=lock.lost_reason,
                                held_seconds=round(time.monotonic() - started, 3), **held),
                      fresh_line=not child.stdout_ends_line)
    return code


def _stopped_taking(lock: Lock, signum: int, as_json: bool) -> int:
    """A stop signal cut the acquire (or its wait) short: nothing runs, nothing stays held."""
    released = _final_release(lock) if lock.held else False  # it landed just after the grant
    name = signal.Signals(signum).name
    why = f"{name} while taking the lease on {lock.name!r}; the command was not run"
    print(f"queen-sync: {why}", file=sys.stderr)
    code = 128 + signum
    if as_json:
        _print_result(_run_json(lock.name, code, released=released, error=why))
    return code


def _run_json(name: str, exit_code: int, **outcome: Any) -> dict[str, Any]:
    """A run's result: the same keys whatever the outcome (None where one does not apply)."""
    result = {"name": name, "acquired": False, "owner": None, "token": None, "slot": None,
              "exit_code": exit_code, "held_seconds": None, "lost": None,
              "released": False, "holders": [], "error": None}
    return result | outcome


def _print_result(result: dict[str, Any], fresh_line: bool = False) -> None:
    """A run's result line; a stdout that cannot take it changes nothing: the exit code stands.

    ``fresh_line``: the command's output ended mid-line, so a newline comes first.
    """
    try:
        if fresh_line:
            _emit("")
        _print_json(result)
    except BrokenPipeError:
        _quiet_stdout()
    except _StdoutFailed as exc:
        _quiet_stdout()
        print(f"queen-sync: warning: could not write the --json result to stdout: {exc}",
              file=sys.stderr)


def _final_release(lock: Lock) -> bool:
    """True when the engine took the lease back; a failure warns, keeping the exit code."""
    try:
        return lock.release()
    except EngineError as exc:
        # The command has run; turning its status into "engine unavailable" would make a
        # scheduler retry finished work. The lease ends on its own at its TTL anyway.
        print(f"queen-sync: warning: could not release the lease on {lock.name!r} "
              f"({one_line(str(exc))}); it will expire by itself within its {lock.ttl:g}s TTL",
              file=sys.stderr)
        return False


# ---- holders, release, ping -----------------------------------------------------------------


def _holder_json(name: str, holder: Holder) -> dict[str, Any]:
    expires_in = holder.expires_in
    return {"name": name, "slot": holder.slot, "owner": holder.owner, "token": holder.token,
            "since": utc_text(holder.since), "since_ms": holder.since,
            "expires_at_ms": holder.expires_at,
            "expires_in": None if expires_in is None else round(max(0.0, expires_in), 3)}


def _holders(client: Queen, names: list[str], as_json: bool) -> int:
    from .._results import holders_from_wire

    rows = [_holder_json(name, h) for name in names
            for h in holders_from_wire(client.locks.get(name).get("holders"))]
    if as_json:
        _print_json(rows)
        return 0
    header = ("NAME", "SLOT", "OWNER", "TOKEN", "SINCE", "EXPIRES IN")
    table = [header] + [
        (r["name"], str(r["slot"]), str(r["owner"]), str(r["token"]), r["since"],
         "never" if r["expires_in"] is None else f"{r['expires_in']:.1f}s") for r in rows]
    free = [name for name in names if not any(r["name"] == name for r in rows)]
    if rows:
        widths = [max(len(line[i]) for line in table) for i in range(len(header))]
        for line in table:
            _emit("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
    for name in free:
        _emit(f"{name}: free")
    return 0


def _release(client: Queen, name: str, token: int, slot: Optional[int], as_json: bool) -> int:
    answer = client.locks.release(name, token=token, slot=slot)
    if as_json:
        _print_json({"name": name, "token": token, **answer})
    elif answer:
        _emit(f"released {name!r} (token {token})")
    else:
        print(f"nothing released: token {token} is not a live permit of {name!r} "
              f"({answer.get('reason')})", file=sys.stderr)
    return 0 if answer else EX_NOT_RELEASED


def _ping(client: Queen, as_json: bool) -> int:
    probe = f"queen-sync.ping.{secrets.token_hex(4)}"
    started = time.perf_counter()
    answer = client.locks.acquire(probe, ttl_seconds=10)
    released = bool(answer) and bool(client.locks.release(probe, token=int(answer["token"]),
                                                          slot=answer.get("slot")))
    latency_ms = (time.perf_counter() - started) * 1000
    ok = bool(answer) and released
    if as_json:
        _print_json({"ok": ok, "engine": client.engine.kind, "url": client.url,
                     "latency_ms": round(latency_ms, 3)})
    else:
        verdict = "ok" if ok else "FAILED"
        _emit(f"{verdict}: {client.engine.kind} at {client.url}, acquire + release in "
              f"{latency_ms:.1f} ms")
    return 0 if ok else 1


def _print_json(value: Any) -> None:
    _emit(json.dumps(value, indent=None, sort_keys=True))


class _StdoutFailed(Exception):
    """stdout could not take a line (closed, or a full disk): one line on stderr, exit 74."""


def _emit(line: str) -> None:
    """``line`` on stdout, flushed, so a stdout that cannot take it fails here, typed."""
    if sys.stdout is None:  # started with it closed (``>&-``)
        raise _StdoutFailed("stdout is closed")
    try:
        print(line, flush=True)
    except BrokenPipeError:
        raise
    except (OSError, ValueError) as exc:  # ValueError: closed under us
        raise _StdoutFailed(getattr(exc, "strerror", None) or str(exc)) from exc


def _flush_stdout() -> None:
    if sys.stdout is None:
        return
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except (OSError, ValueError) as exc:
        raise _StdoutFailed(getattr(exc, "strerror", None) or str(exc)) from exc

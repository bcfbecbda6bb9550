"""Secrets in URLs never reach a log line, a repr, an error or the command line's stderr."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from pg_server import free_port

import queen_sync as qs
from queen_sync._engines.base import redact_url


@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql://app:s3cret@db:5432/q", "postgresql://app:***@db:5432/q"),
    ("postgresql://app:s3cret@h1:5432,h2:5433/q?sslmode=require",
     "postgresql://app:***@h1:5432,h2:5433/q?sslmode=require"),
    ("postgresql://app@db/q?password=s3cret&application_name=x",
     "postgresql://app@db/q?password=***&application_name=x"),
    ("https://user:s3cret@broker:6632", "https://user:***@broker:6632"),
    ("http://broker:6632", "http://broker:6632"),
])
def test_passwords_in_the_address_or_the_query_are_masked(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "s3cret" not in redact_url(url)


# Characters a user may type in a password inside a URL without changing where the
# address ends ('/', '?', '#', '@' would); '*' is the mask itself. '%' is added below.
_TYPED = st.characters(min_codepoint=0x21, max_codepoint=0x7E, blacklist_characters="/?#@*%&")
_BAD_ESCAPES = st.sampled_from(["%", "%z", "%zz", "%4", "%g1", "%%", "%2"])


@st.composite
def malformed_passwords(draw: st.DrawFn) -> str:
    """A password of 8+ characters holding a percent sign that is no valid escape."""
    text = draw(st.text(_TYPED, min_size=8, max_size=24))
    at = draw(st.integers(0, len(text)))
    return text[:at] + draw(_BAD_ESCAPES) + text[at:]


def _pg_url(password: str, where: str) -> str:
    port = free_port()  # nothing listens there: a URL libpq accepts fails fast
    if where == "address":
        return f"postgresql://app:{password}@127.0.0.1:{port}/db?timeout=2"
    return f"postgresql://app@127.0.0.1:{port}/db?timeout=2&password={password}"


class TestDriverMessages:
    @settings(max_examples=60, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(password=malformed_passwords(), where=st.sampled_from(["address", "query"]))
    def test_a_malformed_url_never_shows_its_password_in_errors_or_logs(
            self, caplog: pytest.LogCaptureFixture, password: str, where: str) -> None:
        pytest.importorskip("psycopg")
        caplog.clear()
        caplog.set_level(logging.DEBUG)
        with pytest.raises(qs.QueenError) as caught, qs.Queen(
                _pg_url(password, where), renew_thread=False) as q:
            q.locks.get("x")
        error = caught.value
        shown = [str(error), repr(error), caplog.text]
        cause = error.__cause__
        while cause is not None:  # a traceback prints the whole chain
            shown.append(str(cause))
            cause = cause.__cause__ or cause.__context__
        for text in shown:
            assert password not in text, f"the password {password!r} shows in: {text}"

    @settings(max_examples=30, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(password=st.text(_TYPED, min_size=8, max_size=24))
    def test_a_wellformed_url_never_shows_its_password_when_the_server_is_unreachable(
            self, caplog: pytest.LogCaptureFixture, password: str) -> None:
        pytest.importorskip("psycopg")
        caplog.clear()
        caplog.set_level(logging.DEBUG)
        url = _pg_url(quote(password, safe=""), "address")
        with pytest.raises(qs.EngineUnavailableError) as caught, qs.Queen(
                url, renew_thread=False) as q:
            q.locks.get("x")
        for text in (str(caught.value), repr(caught.value), caplog.text):
            assert password not in text and quote(password, safe="") not in text, text


@pytest.mark.parametrize("password", ["s3cr%zzet-x1", "hunter2%", "pa%4ss-word"])
def test_the_command_lines_stderr_never_shows_the_password(password: str) -> None:
    pytest.importorskip("psycopg")
    url = _pg_url(password, "address")
    env = {**os.environ, "QUEEN_URL": ""}
    done = subprocess.run([sys.executable, "-m", "queen_sync", "holders", "--url", url, "job"],
                          capture_output=True, text=True, timeout=30, env=env)
    assert done.returncode != 0, f"a malformed URL was accepted: {done}"
    assert "percent" in done.stderr, f"the cause is not named: {done.stderr!r}"
    assert password not in done.stderr + done.stdout, f"the password shows: {done.stderr!r}"


@pytest.mark.parametrize("text", [
    "connect failed: host=db password=s3cretpw user=app",
    "connect failed: host=db password='s3cret pw' user=app",
    "connect failed: host=db PASSWORD = \"s3cretpw\" user=app",
    "connect failed: host=db sslpassword='s3cr\\'etpw'",
    "bad URL postgresql://app:s3cretpw@db/x: nope",
    "bad URL postgresql://db/x?sslmode=disable&password=s3cretpw: nope",
])
def test_every_quoting_of_a_password_in_a_driver_message_is_masked(text: str) -> None:
    pytest.importorskip("psycopg")
    from queen_sync._engines.postgres.errors import redact

    shown = redact(text)
    assert "s3cr" not in shown and "etpw" not in shown, shown
    assert "***" in shown and shown.startswith(text[:10]), shown


# Every printable character a password may hold, typed into the URL as is: libpq reads the
# address's password up to the first '@' (the user name ends at the first ':'), unless a
# '/' comes first. '*' is left out as it is the mask itself.
_ANY_TYPED = st.characters(min_codepoint=0x21, max_codepoint=0x7E, blacklist_characters="*")
_LEAKY_ROLE = "leaky"


def _libpq_reading(url: str) -> dict[str, Any]:
    """What libpq reads from ``url`` (empty when it refuses it)."""
    from psycopg import Error, conninfo

    try:
        return conninfo.conninfo_to_dict(url)
    except (Error, UnicodeDecodeError):
        return {}


def _shown_by(error: BaseException) -> list[str]:
    """Every text a traceback of ``error`` prints: its own and its whole chain's."""
    shown: list[str] = []
    current: BaseException | None = error
    while current is not None and len(shown) < 10:
        shown += [str(current), repr(current)]
        current = current.__cause__ or current.__context__
    return shown


class TestPasswordsAsLibpqReadsThem:
    """A password typed into the address is masked exactly where libpq finds it."""

    @pytest.fixture(scope="class")
    def role(self, pg_url: str) -> str:
        psycopg = pytest.importorskip("psycopg")
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute(f"DROP ROLE IF EXISTS {_LEAKY_ROLE}")
            admin.execute(f"CREATE ROLE {_LEAKY_ROLE} LOGIN SUPERUSER")
        return pg_url

    @settings(max_examples=40, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(password=st.text(_ANY_TYPED, min_size=6, max_size=16).filter(
        lambda p: any(c in p for c in "?/#@:%") and p.strip("0123456789")))
    def test_any_typed_password_is_never_shown_and_connects_when_libpq_reads_it_whole(
            self, role: str, caplog: pytest.LogCaptureFixture, password: str) -> None:
        from psycopg import connect, sql

        host_port = role.rsplit("@", 1)[1].split("/", 1)[0]
        port = host_port.rpartition(":")[2]
        plain = f"postgresql://{_LEAKY_ROLE}:{password}@{host_port}/postgres"
        reading = _libpq_reading(plain)
        url = plain + "?schema=leaky&timeout=3"  # this engine's options, not libpq's
        read_whole = (reading.get("host"), reading.get("port"), reading.get("user"),
                      reading.get("dbname")) == ("127.0.0.1", port, _LEAKY_ROLE, "postgres")
        secret = reading.get("password", password) if read_whole else password
        with connect(role, autocommit=True) as admin:
            admin.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(
                sql.Identifier(_LEAKY_ROLE), sql.Literal(secret)))
        caplog.clear()
        caplog.set_level(logging.DEBUG)
        shown: list[str] = []
        try:
            with qs.Queen(url, renew_thread=False) as q:
                shown += [repr(q), q.url, str(q.engine.url)]
                answer = q.locks.get("x")
            assert read_whole, f"a URL libpq misreads was used: {reading}"
            assert answer["held"] is False, answer
        except qs.QueenError as error:
            assert not read_whole, f"a URL libpq reads whole failed: {error!r}"
            assert isinstance(error, qs.RequestError), f"not refused as a bad URL: {error!r}"
            assert error.code == "bad_url", error
            shown += _shown_by(error)
        for text in [*shown, caplog.text]:
            for typed in {password, secret}:
                assert typed not in text, f"the password {typed!r} shows in: {text}"

    @pytest.mark.parametrize("password", ["Sec?ret99", "pa#ss1-x", "a:b?c#d%41"])
    def test_the_command_line_connects_and_never_shows_a_password_with_url_characters(
            self, role: str, password: str) -> None:
        from psycopg import connect, sql

        host_port = role.rsplit("@", 1)[1].split("/", 1)[0]
        url = f"postgresql://{_LEAKY_ROLE}:{password}@{host_port}/postgres"
        secret = _libpq_reading(url)["password"]
        with connect(role, autocommit=True) as admin:
            admin.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(
                sql.Identifier(_LEAKY_ROLE), sql.Literal(secret)))
        env = {**os.environ, "QUEEN_URL": ""}
        done = subprocess.run([sys.executable, "-m", "queen_sync", "ping", "--json", "--url", url],
                              capture_output=True, text=True, timeout=30, env=env)
        assert done.returncode == 0, f"ping failed: {done.stderr!r}"
        for typed in (password, secret):
            assert typed not in done.stdout + done.stderr, f"the password shows: {done.stdout!r}"


# A password as pieces: tell-tale tokens (letters no message or address holds) between the
# characters that end a part of a URL or of its query. A token seen anywhere is a leak.
_TOKENS = st.text(st.sampled_from("QZXJ"), min_size=3, max_size=5)
_DELIMITERS = st.sampled_from([*"@?/&" * 3, *"#:%=,[] '\"", "%40", "%zz", "%2F"])
_TOKEN = re.compile(r"[QZXJ]{3,}")


@st.composite
def pieced_passwords(draw: st.DrawFn) -> str:
    """Tokens and delimiters taking turns: a cut after any delimiter leaves a token to show."""
    pairs = draw(st.lists(st.tuples(_DELIMITERS, _TOKENS), min_size=1, max_size=3))
    tail = draw(st.one_of(st.just(""), _DELIMITERS))
    return draw(_TOKENS) + "".join(delimiter + token for delimiter, token in pairs) + tail


def _pieced_url(shape: str, password: str) -> str:
    port = free_port()  # nothing listens there: a URL libpq accepts fails fast
    return {
        "address": f"postgresql://{_LEAKY_ROLE}:{password}@127.0.0.1:{port}/postgres?timeout=1",
        "no user": f"postgresql://:{password}@127.0.0.1:{port}/postgres?timeout=1",
        "ipv6": f"postgresql://{_LEAKY_ROLE}:{password}@[::1]:{port}/postgres?timeout=1",
        "hosts": f"postgresql://{_LEAKY_ROLE}:{password}@127.0.0.1:{port},[::1]:{port}/postgres"
                 "?timeout=1",
        "query": f"postgresql://{_LEAKY_ROLE}@127.0.0.1:{port}/postgres?timeout=1"
                 f"&password={password}",
    }[shape]


class TestNoPieceOfAPassword:
    """No piece of a password, however typed, shows in an error, a repr, a log line or the CLI."""

    @settings(max_examples=int(os.environ.get("QUEEN_SYNC_REDACTION_EXAMPLES", "150")),
              deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(password=pieced_passwords(),
           shape=st.sampled_from(["address", "no user", "ipv6", "hosts", "query"]))
    def test_no_piece_of_a_typed_password_shows_whether_the_url_is_used_or_refused(
            self, caplog: pytest.LogCaptureFixture, password: str, shape: str) -> None:
        pytest.importorskip("psycopg")
        url = _pieced_url(shape, password)
        caplog.clear()
        caplog.set_level(logging.DEBUG, logger="queen_sync")
        shown: list[str] = []
        refused = False
        try:
            with qs.Queen(url, renew_thread=False) as q:
                shown += [repr(q), q.url, str(q.engine.url)]
                q.locks.get("x")
        except qs.RequestError as error:
            assert error.code == "bad_url", f"{url}: refused, but not as a bad URL: {error!r}"
            refused, shown = True, shown + _shown_by(error)
        except qs.EngineUnavailableError as error:
            shown += _shown_by(error)
        # In the query, libpq's reading of '&' decides: the password ends at the first one.
        secret = password if refused or shape != "query" else password.partition("&")[0]
        for text in [*shown, caplog.text]:
            for token in _TOKEN.findall(secret):
                assert token not in text, f"{url}: a piece {token!r} of the password shows: {text}"

    @pytest.mark.parametrize("password", ["QZX@QZJ?", "@QZXJ?", "1/QZX?a=QZJ", "QZX@QZJ/x"])
    def test_the_command_line_names_no_piece_of_an_ambiguous_password(
            self, capsys: pytest.CaptureFixture[str], password: str) -> None:
        pytest.importorskip("psycopg")
        from queen_sync._front.cli import main

        url = _pieced_url("address", password)
        for command in (["ping", "--json"], ["holders", "job"]):
            capsys.readouterr()
            code = main(["--url", url, *command])
            out, err = capsys.readouterr()
            assert code == 2, f"{url}: an ambiguous URL is bad usage: exit {code}, {err!r}"
            for token in _TOKEN.findall(password):
                assert token not in out + err, f"{url}: {token!r} shows in: {out + err!r}"

    def test_a_password_from_the_environment_never_shows(
            self, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
        pytest.importorskip("psycopg")
        monkeypatch.setenv("PGPASSWORD", "QZXJ-from-env")
        caplog.set_level(logging.DEBUG, logger="queen_sync")
        url = f"postgresql://{_LEAKY_ROLE}@127.0.0.1:{free_port()}/postgres?timeout=1"
        with pytest.raises(qs.EngineUnavailableError) as caught, qs.Queen(
                url, renew_thread=False) as q:
            q.locks.get("x")
        for text in [*_shown_by(caught.value), caplog.text, repr(q)]:
            assert "QZXJ" not in text, f"PGPASSWORD shows in: {text}"

    @pytest.mark.parametrize("url", [
        "host=127.0.0.1 dbname=postgres password=QZXJ",
        "host=127.0.0.1 password='QZX JJJ' user=leaky",
        'password = "QZX\\"JJJ" host=127.0.0.1',
    ])
    def test_a_key_value_connection_string_is_refused_without_showing_its_password(
            self, capsys: pytest.CaptureFixture[str], url: str) -> None:
        from queen_sync._front.cli import main

        with pytest.raises(qs.RequestError) as refused:
            qs.Queen(url, renew_thread=False).close()
        assert main(["--url", url, "ping", "--json"]) == 2, "a connection string is bad usage"
        out, err = capsys.readouterr()
        for text in [*_shown_by(refused.value), out + err]:
            assert not _TOKEN.search(text), f"a piece of the password shows in: {text}"

    def test_the_postgres_engine_refuses_another_scheme_without_showing_its_password(
            self) -> None:
        pytest.importorskip("psycopg")
        from queen_sync._engines.postgres.engine import PostgresEngine

        with pytest.raises(qs.RequestError) as refused:
            PostgresEngine("postgresq://leaky:QZX@JJJ@127.0.0.1/postgres")
        for text in _shown_by(refused.value):
            assert not _TOKEN.search(text), f"a piece of the password shows in: {text}"


_WORDS = st.text(st.characters(whitelist_categories=("Ll", "Lu", "Nd")), min_size=1, max_size=6)


class TestMaskingInDriverText:
    """A password is masked wherever it stands on its own, and unrelated words are left alone."""

    @given(secret=st.text(_ANY_TYPED, min_size=1, max_size=12),
           before=st.text(max_size=12), after=st.text(max_size=12),
           quote=st.sampled_from(['"', "'", " ", ": ", "(", "\n"]))
    def test_a_password_standing_on_its_own_never_survives(
            self, secret: str, before: str, after: str, quote: str) -> None:
        from queen_sync._engines.postgres.errors import redact

        closing = {"(": ")", ": ": " "}.get(quote, quote)
        text = f"{before}{quote}{secret}{closing}{after}"
        shown = redact(text, {secret})
        assert f"{quote}{secret}{closing}" not in shown, f"{secret!r} survives in {shown!r}"

    @given(secret=_WORDS, word=_WORDS, other=_WORDS)
    def test_a_password_inside_a_longer_word_leaves_that_word_alone(
            self, secret: str, word: str, other: str) -> None:
        from queen_sync._engines.postgres.errors import redact

        assume(secret not in (word, other))
        text = f"connection {word}{secret}{other} failed: {word} {other}"
        assert redact(text, {secret}) == text, "an unrelated word was garbled"

    def test_a_one_letter_password_garbles_no_message(self) -> None:
        from queen_sync._engines.postgres.errors import redact

        text = 'connection failed: FATAL:  password authentication failed for user "app"'
        assert redact(text, {"a"}) == text, redact(text, {"a"})
        assert redact('bad port "a"', {"a"}) == 'bad port "***"'


# A secret typed where a URL may carry one: no character that would end that part early.
_SECRET = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E,
                                blacklist_characters="/?#@*%&:=,[]\\"),
                  min_size=5, max_size=17).map(
    # A prefix no message holds, so a secret is never a word of the error's own text
    # (a drawn "bearer_t" is a substring of "pass bearer_token=").
    lambda s: "Zq9" + s)
_QUERY_KEYS = st.sampled_from(["token", "access_token", "bearer_token", "key", "auth", "x"])


@st.composite
def urls_with_a_secret(draw: st.DrawFn) -> tuple[str, str]:
    """A URL every engine refuses, with a secret in its user, password, query, fragment or port."""
    secret, key = draw(_SECRET), draw(_QUERY_KEYS)
    scheme = draw(st.sampled_from(["http", "https", "sqlite"]))
    host = "/" if scheme == "sqlite" else "broker.example:6632/"
    shapes = [f"{scheme}://{secret}@{host}x.db", f"{scheme}://app:{secret}@{host}x.db",
              f"{scheme}://{host.rstrip('/')}/x.db?{key}={secret}",
              f"{scheme}://{host.rstrip('/')}/x.db?a=1&{key}={secret}#frag",
              f"{scheme}://{host.rstrip('/')}/x.db#{secret}"]
    if scheme == "sqlite":
        shapes = [s.replace("sqlite:///x.db", "sqlite://h/x.db") for s in shapes]
    else:
        shapes += [f"{scheme}://broker.example:{secret}/api",
                   f"http://good.example:6632,{scheme}://{secret}@bad.example:1"]
    return draw(st.sampled_from(shapes)), secret


class TestUrlErrors:
    """A refused URL is named in its error without its user part, password, query or fragment."""

    @settings(max_examples=150, deadline=None)
    @given(case=urls_with_a_secret())
    def test_no_secret_in_any_part_of_a_refused_url_reaches_its_error(
            self, case: tuple[str, str]) -> None:
        url, secret = case
        with pytest.raises(qs.RequestError) as refused:
            qs.Queen(url, renew_thread=False).close()
        assert refused.value.code == "bad_url", f"{url}: not refused as a bad URL: {refused.value}"
        for text in _shown_by(refused.value):
            assert secret not in text, f"{url}: the secret {secret!r} shows in: {text}"

    @settings(max_examples=40, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(case=urls_with_a_secret(), command=st.sampled_from([["ping"], ["holders", "job"]]))
    def test_the_command_lines_stderr_never_shows_a_secret_of_a_refused_url(
            self, capsys: pytest.CaptureFixture[str], case: tuple[str, str],
            command: list[str]) -> None:
        from queen_sync._front.cli import main

        url, secret = case
        capsys.readouterr()
        code = main(["--url", url, *command])
        out, err = capsys.readouterr()
        assert code == 2, f"{url}: a bad URL is bad usage: exit {code}, {err!r}"
        assert err.startswith("queen-sync: ") and err.count("\n") == 1, f"one line: {err!r}"
        assert secret not in out + err, f"{url}: the secret {secret!r} shows in: {err!r}"

    @pytest.mark.parametrize(("url", "shown"), [
        ("http://broker:6632/?token=s3cret", "'http://broker:6632/?token=***'"),
        ("https://broker:66x2/api", "'https://broker:***/api'"),
        ("sqlite://app:s3cret@/tmp/x.db", "'sqlite://***@/tmp/x.db'"),
    ])
    def test_the_error_still_shows_where_the_url_went_wrong(self, url: str, shown: str) -> None:
        with pytest.raises(qs.RequestError) as refused:
            qs.Queen(url, renew_thread=False).close()
        assert shown in str(refused.value), f"the URL is shown masked: {refused.value}"


def _usage_shapes(url: str) -> list[list[str]]:
    """Command lines argparse refuses, each with ``url`` where a typist may leave it."""
    return [["run", "j", "--url", url, "python", "job.py"],
            ["run", "j", f"--url={url}", "python", "job.py"],
            ["--url", url, "run", "j", "--ttl", "1m", "python", url],
            ["ping", url], [url, "ping"], ["holders", "--url", url, "--bogus", "x"],
            ["--ur", url, "run", "j", "sh", "-c", "true"]]


class TestUsageErrors:
    """A refused command line echoes its words, but never a secret a URL among them holds."""

    @settings(max_examples=60, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(secret=_SECRET, shape=st.integers(0, 6),
           form=st.sampled_from(["postgresql://app:{}@db:5432/q",
                                 "postgresql://db/q?sslmode=disable&password={}",
                                 "https://broker.example:6632/?token={}",
                                 "http://{}@broker.example:6632",
                                 "host=db user=app password={} dbname=q"]))
    # A quote in the user part, which the echo shell-quotes: found by a CI run.
    @example(secret="Zq90000'", shape=3, form="http://{}@broker.example:6632")
    @example(secret='Zq9ab"cd', shape=4, form="postgresql://app:{}@db:5432/q")
    def test_no_secret_of_a_url_reaches_a_usage_error(
            self, capsys: pytest.CaptureFixture[str], secret: str, shape: int,
            form: str) -> None:
        from queen_sync._front.cli import main

        argv = _usage_shapes(form.format(secret))[shape]
        capsys.readouterr()
        with pytest.raises(SystemExit) as stopped:
            main(argv)
        out, err = capsys.readouterr()
        assert stopped.value.code == 2, f"{argv}: bad usage exits 2: {stopped.value.code}, {err!r}"
        assert err.startswith("queen-sync: "), f"{argv}: a usage error is said: {err!r}"
        assert secret not in out + err, f"{argv}: the secret {secret!r} shows in: {err!r}"

    @pytest.mark.parametrize("password", ["ab'cdefgh", 'ab"cdefgh', "ab'c\"defgh"])
    @pytest.mark.parametrize("shape", range(7))
    def test_no_part_of_a_password_after_a_quote_in_it_is_shown(
            self, capsys: pytest.CaptureFixture[str], password: str, shape: int) -> None:
        from queen_sync._front.cli import main

        argv = _usage_shapes(f"postgresql://app:{password}@db:5432/q")[shape]
        capsys.readouterr()
        with pytest.raises(SystemExit):
            main(argv)
        err = capsys.readouterr().err
        assert "defgh" not in err, f"{argv}: the password's tail shows in: {err!r}"

    @pytest.mark.parametrize("secretive", [
        "postgresql://u:pw spZq9S3CRx@127.0.0.1:1/db", "postgresql://u:pw\nZq9S3CRx@127.0.0.1:1/db",
        "postgresql://u:pw\tZq9S3CRx@127.0.0.1:1/db", "http://127.0.0.1:1/?a=1 Zq9S3CRx",
        "postgresql://u:pw@127.0.0.1:1/db?password=a bZq9S3CRx",
        "host=db port=5432 password=pa\"Zq9S3CRx", "host=db password=\"Zq9S3CRx",
        "host=db password=ab'Zq9S3CRx", "host=db password='a\\' Zq9S3CRx'",
    ], ids=["space", "newline", "tab", "query space", "password query space",
            "kv inner double quote", "kv double quoted", "kv inner quote", "kv escaped quote"])
    @pytest.mark.parametrize("argv", [["{}", "ping"], ["ping", "{}"],
                                      ["run", "j", "--ttl", "{}", "--", "true"]],
                             ids=["before the command", "as a word", "as a value"])
    def test_a_secret_after_a_space_or_a_quote_in_a_misplaced_url_is_masked(
            self, capsys: pytest.CaptureFixture[str], secretive: str, argv: list[str]) -> None:
        from queen_sync._front.cli import main

        words = [secretive if word == "{}" else word for word in argv]
        capsys.readouterr()
        with pytest.raises(SystemExit):
            main(words)
        out, err = capsys.readouterr()
        assert "S3CRx" not in out + err, f"{words}: the secret shows in: {err!r}"

    def test_the_hint_still_shows_where_the_url_goes_with_its_password_masked(
            self, capsys: pytest.CaptureFixture[str]) -> None:
        from queen_sync._front.cli import main

        with pytest.raises(SystemExit):
            main(["run", "j", "--url", "postgresql://app:Zq9pw@db/q", "python", "job.py"])
        err = capsys.readouterr().err
        assert ("put the command after --: queen-sync run j --url 'postgresql://***@db/q'"
                " -- python job.py") in err, f"the fixed line, URL masked: {err!r}"


class _EchoingBroker:
    """A loopback HTTP server that answers every call with a body echoing its Authorization."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.status, self.content_type, self.template = 500, "text/plain", "{auth}"
        broker = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # the name http.server calls
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                auth = self.headers.get("Authorization") or ""
                body = broker.template.replace("{auth}", auth).replace(
                    "{auth_json}", json.dumps(auth)[1:-1]).replace(
                    "{auth_quoted}", quote(auth, safe="")).replace(
                    "{auth_slashes}", json.dumps(auth)[1:-1].replace("/", "\\/")).replace(
                    "{auth_quoted_lower}", re.sub("%[0-9A-F]{2}", lambda m: m.group().lower(),
                                                  quote(auth, safe="")))
                data = body.encode()
                self.send_response(broker.status)
                self.send_header("Content-Type", broker.content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def echoing_broker() -> Any:
    broker = _EchoingBroker()
    yield broker
    broker.close()


# RFC 6750's b64token characters, and long enough that no message holds it by chance.
_BEARER = st.text(st.sampled_from("ABCXYZabcxyz0123456789-._~+/"), min_size=10, max_size=40
                  ).map(lambda s: "Zq9" + s)
_ECHOES = [
    (500, "text/plain", "bad request from {auth}"),
    (400, "application/json", '{"error": "bad_request", "detail": "header was {auth}"}'),
    (403, "application/json", '{"error": "{auth_json}", "reason": "{auth_json}"}'),
    (401, "application/json", '{"code": "unauthorized", "error": "got {auth_json}"}'),
    (502, "text/html", "<p>{auth_quoted}</p>"),
    (501, "application/json",
     '{"error": "unsupported_operation", "reason": "{auth}", "detail": "{auth}"}'),
    (200, "text/plain", "not json {auth}"),
    (403, "application/json", '{"message": "rejected header {auth_slashes}"}'),
    (502, "text/html", "<p>{auth_quoted_lower}</p>"),
]


def _echoed_forms(token: str) -> list[str]:
    """The token as a broker may quote it: raw, percent-encoded, JSON-escaped."""
    quoted = quote(token, safe="")
    return [token, quoted, json.dumps(token)[1:-1], json.dumps(token)[1:-1].replace("/", "\\/"),
            re.sub("%[0-9A-F]{2}", lambda m: m.group().lower(), quoted)]


class TestABrokerThatEchoesTheBearerToken:
    """A proxy or broker that quotes the request's headers back never gets the token shown."""

    @settings(max_examples=40, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(token=_BEARER, echo=st.sampled_from(_ECHOES))
    def test_no_error_or_log_line_shows_the_token(
            self, echoing_broker: _EchoingBroker, caplog: pytest.LogCaptureFixture,
            token: str, echo: tuple[int, str, str]) -> None:
        echoing_broker.status, echoing_broker.content_type, echoing_broker.template = echo
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="queen_sync"), qs.Queen(
                echoing_broker.url, bearer_token=token, renew_thread=False, backoff=0,
                timeout=5) as q, pytest.raises(qs.QueenError) as failed:
            q.kv.get("ns", "x")
        error = failed.value
        shown = [*_shown_by(error), caplog.text,
                 *(str(getattr(error, key, "")) for key in ("detail", "reason", "code"))]
        for text in shown:
            for form in _echoed_forms(token):
                assert form not in text, f"{echo}: the token shows in: {text}"

    @pytest.mark.parametrize("echo", _ECHOES[-2:])
    def test_a_token_echoed_with_escaped_slashes_or_lowercase_escapes_is_masked(
            self, echoing_broker: _EchoingBroker, echo: tuple[int, str, str]) -> None:
        token = "Zq9abc/def+ghi/jkl=="
        echoing_broker.status, echoing_broker.content_type, echoing_broker.template = echo
        with qs.Queen(echoing_broker.url, bearer_token=token, renew_thread=False, backoff=0,
                      timeout=5) as q, pytest.raises(qs.QueenError) as failed:
            q.kv.get("ns", "x")
        for text in _shown_by(failed.value):
            assert not any(form in text for form in _echoed_forms(token)), text
            assert "Zq9abc" not in text, f"{echo}: the token shows in: {text}"

    def test_a_short_token_is_masked_where_it_stands_and_garbles_nothing_else(
            self, echoing_broker: _EchoingBroker) -> None:
        echoing_broker.status, echoing_broker.content_type = 500, "text/plain"
        echoing_broker.template = "a bad answer to {auth}"
        with qs.Queen(echoing_broker.url, bearer_token="a", renew_thread=False, backoff=0,
                      timeout=5) as q, pytest.raises(qs.QueenError) as failed:
            q.kv.get("ns", "x")
        assert "a bad answer to Bearer ***" in str(failed.value), str(failed.value)


class TestSpellingsThatHidAPassword:
    """A password keeps out of errors, reprs and output however its URL spells it: a query
    key percent-encoded, a query before the address's '@', a connection string whose
    password holds a ':', a URL echoed by the notebook magic, a token no header can carry."""

    @pytest.mark.parametrize("key", ["pass%77ord", "%70assword", "sslpass%77ord", "PASS%57ORD"])
    def test_a_percent_encoded_password_key_keeps_its_value_out_of_errors_and_output(
            self, capsys: pytest.CaptureFixture[str], key: str) -> None:
        pytest.importorskip("psycopg")
        from queen_sync._front.cli import main

        url = f"postgresql://app@127.0.0.1:{free_port()}/db?{key}=QZXJ%zzQZXJ"
        with pytest.raises(qs.QueenError) as caught, qs.Queen(url, renew_thread=False) as q:
            q.locks.get("x")
        capsys.readouterr()
        main(["--url", url, "ping"])
        out, err = capsys.readouterr()
        for text in [*_shown_by(caught.value), out + err]:
            assert not _TOKEN.search(text), f"a piece of the password shows in: {text}"

    @pytest.mark.parametrize("url", [
        "postgresql://localhost?password=QZXJQZXJ@127.0.0.1:1/postgres",
        "postgresql://localhost#password=QZXJQZXJ@127.0.0.1:1/postgres",
    ])
    def test_a_query_before_the_addresss_at_sign_is_refused_without_showing_it(
            self, capsys: pytest.CaptureFixture[str], url: str) -> None:
        pytest.importorskip("psycopg")
        from queen_sync._front.cli import main

        with pytest.raises(qs.RequestError) as refused:
            qs.Queen(url, renew_thread=False).close()
        assert refused.value.code == "bad_url", f"not refused as a bad URL: {refused.value}"
        assert main(["--url", url, "ping", "--json"]) == 2, "a misread URL is bad usage"
        out, err = capsys.readouterr()
        for text in [*_shown_by(refused.value), out + err]:
            assert not _TOKEN.search(text), f"a piece of the password shows in: {text}"

    @pytest.mark.parametrize("url", [
        "host=127.0.0.1 user=app password=QZXJ:QZXJ",
        "password=QZX:J host=db",
        "dbname=app password=qzxj:qzxj",
    ])
    def test_a_connection_string_with_a_colon_is_refused_without_showing_it(
            self, capsys: pytest.CaptureFixture[str], url: str) -> None:
        from queen_sync._front.cli import main

        with pytest.raises(qs.RequestError) as refused:
            qs.Queen(url, renew_thread=False).close()
        assert main(["--url", url, "ping"]) == 2, "a connection string is bad usage"
        out, err = capsys.readouterr()
        for text in [*_shown_by(refused.value), out + err]:
            assert not re.search("(?i)qzx", text), f"a piece of the password shows in: {text}"

    @pytest.mark.parametrize("line", [
        "job postgresql://app:QZXJQZXJ@db.internal/app",
        "job --ttl postgresql://app:QZXJQZXJ@db.internal/app",
        "job --url postgresql://app:QZXJQZXJ@db.internal/app --bogus",
    ])
    def test_the_notebook_magics_usage_errors_mask_a_url(self, line: str) -> None:
        from queen_sync._front.magic import run_locked_cell

        with pytest.raises(ValueError) as refused:
            run_locked_cell(None, line, "1")  # the line is parsed before anything is sent
        for text in _shown_by(refused.value):
            assert not _TOKEN.search(text), f"the password shows in: {text}"

    @pytest.mark.parametrize("token", ["s3cr\u20acT-QZXJ-1234", "QZXJ\u00e9\u0100abc"])
    def test_a_token_no_http_header_can_carry_is_refused_without_showing_it(
            self, token: str) -> None:
        with pytest.raises(ValueError) as refused:
            qs.Queen("http://127.0.0.1:1", bearer_token=token, renew_thread=False).close()
        for text in [*_shown_by(refused.value), repr(refused.value.args)]:
            assert "QZXJ" not in text, f"the token shows in: {text}"

    @pytest.mark.parametrize("value", [" QZXJ-key", "\tQZXJ-key", "QZXJ\u20ac-key"])
    def test_a_header_value_no_http_header_can_carry_is_refused_without_showing_it(
            self, value: str) -> None:
        with pytest.raises(ValueError) as refused:
            qs.Queen("http://127.0.0.1:1", headers={"X-Api-Key": value},
                     renew_thread=False).close()
        for text in [*_shown_by(refused.value), repr(refused.value.args)]:
            assert "QZXJ" not in text, f"the header's value shows in: {text}"

"""Secrets in URLs never reach a log line, a repr, an error or the command line's stderr."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, assume, given, settings
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


def _libpq_reading(url: str) -> dict[str, str]:
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
        plain = f"postgresql://{_LEAKY_ROLE}:{password}@{host_port}/postgres"
        reading = _libpq_reading(plain)
        url = plain + "?schema=leaky&timeout=3"  # this engine's options, not libpq's
        read_whole = reading.get("host") == "127.0.0.1" and reading.get("user") == _LEAKY_ROLE
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

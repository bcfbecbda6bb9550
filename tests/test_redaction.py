"""Secrets in URLs never reach a log line, a repr, an error or the command line's stderr."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
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

"""Secrets in URLs never reach a log line or a repr."""

from __future__ import annotations

import pytest

from queen_sync._engine import redact_url


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

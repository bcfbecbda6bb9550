"""Where ``Queen()`` keeps its SQLite file when no URL is given: platformdirs' state folder.

On Linux that is the path queen_sync has always used, so no user's leases move to a
second file; on macOS it is the platform's own folder.
"""

from __future__ import annotations

from pathlib import Path

import platformdirs
import pytest
from platformdirs.macos import MacOS

from queen_sync._client import default_url


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("QUEEN_URL", raising=False)
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


class TestTheDefaultDatabasePath:
    def test_on_linux_it_is_under_local_state_in_the_home_folder(self, home: Path) -> None:
        expected = home / ".local" / "state" / "queen_sync" / "queen.db"

        assert default_url() == f"sqlite://{expected}", default_url()

    def test_on_linux_it_follows_xdg_state_home_when_set(
        self, home: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("XDG_STATE_HOME", str(home / "elsewhere"))

        assert default_url() == f"sqlite://{home / 'elsewhere' / 'queen_sync' / 'queen.db'}"

    def test_an_empty_xdg_state_home_counts_as_unset(
        self, home: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("XDG_STATE_HOME", "")

        assert default_url() == f"sqlite://{home / '.local/state/queen_sync/queen.db'}"

    def test_on_macos_it_is_the_platforms_own_state_folder(
        self, home: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # platformdirs chooses its class by platform at import; this is the one it picks on
        # macOS, which reads only the home folder, so it runs the same here.
        monkeypatch.setattr(platformdirs, "PlatformDirs", MacOS)
        expected = home / "Library" / "Application Support" / "queen_sync" / "queen.db"

        assert default_url() == f"sqlite://{expected}", default_url()

    def test_queen_url_still_comes_first(
        self, home: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("QUEEN_URL", "sqlite:///tmp/chosen.db")

        assert default_url() == "sqlite:///tmp/chosen.db"

"""``queen-sync`` as a Unix tool: ``--version``, and one clear line for each kind of bad usage."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from cli_helpers import (
    Cli,
    cli_fixture,  # noqa: F401  # registers the ``cli`` fixture
)

from queen_sync import __version__
from queen_sync._front.cli import build_parser, main


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The exit code and stderr of ``queen-sync ARGV`` run in this process."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


@pytest.fixture
def engine_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the engine would be: a bad usage must never create it."""
    path = tmp_path / "never.db"
    monkeypatch.setenv("QUEEN_URL", "sqlite://" + str(path))
    return path


class TestVersion:
    def test_version_prints_the_program_and_the_package_version_and_exits_0(self,
                                                                           cli: Cli) -> None:
        done = cli.run("--version")
        assert done.returncode == 0, f"--version must exit 0: {done.returncode}, {done.stderr!r}"
        assert done.stdout == f"queen-sync {__version__}\n", (
            f"--version prints 'queen-sync X.Y.Z': {done.stdout!r}")


class TestAForgottenDoubleDash:
    def test_a_command_without_double_dash_gets_a_hint_showing_where_to_put_it(
            self, capsys: pytest.CaptureFixture[str], engine_file: Path) -> None:
        code, err = _usage_error(["run", "job", "--ttl", "1m", "python", "-c", "print(1)"],
                                 capsys)
        assert code == 2, f"a forgotten -- is bad usage: exit {code}, {err!r}"
        assert "unrecognized arguments: python -c 'print(1)'" in err, err
        fixed = "queen-sync run job --ttl 1m -- python -c 'print(1)'"
        assert f"put the command after --: {fixed}" in err, f"the hint must show the fix: {err!r}"
        assert len(err.splitlines()) == 1, f"one line, no usage dump: {err!r}"
        assert not engine_file.exists(), "bad usage must not open the engine"

    def test_the_suggested_command_is_accepted_as_it_is_shown(
            self, capsys: pytest.CaptureFixture[str], engine_file: Path) -> None:
        _, err = _usage_error(["--json", "run", "job", "sh", "-c", "echo $HOME", "--limit", "2"],
                              capsys)
        suggested = shlex.split(err.split("put the command after --: ", 1)[1])
        assert suggested == ["queen-sync", "--json", "run", "job", "--limit", "2", "--",
                             "sh", "-c", "echo $HOME"], f"the hint must be a working line: {err!r}"

    def test_unknown_options_before_the_double_dash_are_not_blamed_on_the_command(
            self, capsys: pytest.CaptureFixture[str], engine_file: Path) -> None:
        code, err = _usage_error(["run", "job", "--bogus", "--", "true"], capsys)
        assert code == 2 and "unknown option for run: --bogus" in err, err
        assert "put the command after" not in err, f"the command was after --: {err!r}"


class TestBadValues:
    @pytest.mark.parametrize(("argv", "message"), [
        (["run", "job", "--ttl", "10 parsecs", "--", "true"],
         "--ttl: '10 parsecs' is not a duration (e.g. 30s, 5m, 1h30m)"),
        (["run", "job", "--ttl", "500ms", "--", "true"],
         "--ttl: a lease must last at least 1 second, got '500ms'"),
        (["run", "job", "--grace", "soon", "--", "true"],
         "--grace: 'soon' is not a duration (e.g. 30s, 5m, 1h30m)"),
        (["release", "job", "--token", "abc"], "--token: 'abc' is not a whole number"),
        (["release", "job", "--token", "0"], "--token: must be 1..9223372036854775807, got 0"),
        (["release", "job", "--token", "1", "--slot", "x"], "--slot: 'x' is not a whole number"),
        (["run", "job", "--limit", "2k", "--", "true"], "--limit: '2k' is not a whole number"),
        (["run", "job", "--busy-exit-code", "300", "--", "true"],
         "--busy-exit-code: must be 0..255, got 300"),
    ])
    def test_a_bad_value_is_named_with_its_option_on_one_line_and_exits_2(
            self, capsys: pytest.CaptureFixture[str], engine_file: Path, argv: list[str],
            message: str) -> None:
        code, err = _usage_error(argv, capsys)
        assert code == 2, f"{argv}: bad usage exits 2, got {code}: {err!r}"
        assert message in err, f"{argv}: expected {message!r} in {err!r}"
        assert len(err.splitlines()) == 1, f"{argv}: one line, no usage dump: {err!r}"
        assert "invalid" not in err and "Traceback" not in err, f"{argv}: unclear: {err!r}"
        assert err.startswith("queen-sync"), f"{argv}: the line names the program: {err!r}"
        assert not engine_file.exists(), "bad usage must not open the engine"


class TestANegativeDuration:
    @pytest.mark.parametrize("option", ["--ttl", "--wait", "--grace"])
    @pytest.mark.parametrize(("spelling", "written"), [
        ("-5s", "separate"), ("-5s", "joined"), ("-1m30s", "separate"), ("-5", "separate"),
    ])
    def test_is_refused_as_not_positive_however_it_is_written(
            self, capsys: pytest.CaptureFixture[str], engine_file: Path, option: str,
            spelling: str, written: str) -> None:
        given = [option, spelling] if written == "separate" else [f"{option}={spelling}"]
        code, err = _usage_error(["run", "job", *given, "--", "true"], capsys)
        assert code == 2, f"{given}: bad usage exits 2, got {code}: {err!r}"
        assert err == (f"queen-sync run: {option} must be a positive, finite duration, "
                       f"got {spelling!r}\n"), f"{given}: it must say why, on one line: {err!r}"
        assert not engine_file.exists(), "bad usage must not open the engine"

    def test_a_word_that_is_not_a_duration_after_the_minus_is_still_not_a_duration(
            self, capsys: pytest.CaptureFixture[str], engine_file: Path) -> None:
        code, err = _usage_error(["run", "job", "--ttl=-soon", "--", "true"], capsys)
        assert code == 2 and "'-soon' is not a duration" in err, f"exit {code}: {err!r}"


class TestWordsAfterADoubleDash:
    @pytest.mark.parametrize("argv", [["holders", "--", "--ttl", "-5s"],
                                      ["release", "--token", "3", "--", "--slot", "-1"]])
    def test_are_never_joined_as_an_option_and_its_value(self, argv: list[str]) -> None:
        from queen_sync._front.cli import _joined_negative_values

        assert _joined_negative_values(argv) == argv, "words after -- are names, not options"

    def test_before_it_a_negative_value_is_still_joined(self) -> None:
        from queen_sync._front.cli import _joined_negative_values

        assert _joined_negative_values(["run", "j", "--ttl", "-5s", "--", "x"]) == [
            "run", "j", "--ttl=-5s", "--", "x"]


class TestANameThatIsRun:
    def test_is_a_name_and_the_words_after_its_double_dash_are_names_too(
            self, capsys: pytest.CaptureFixture[str], engine_file: Path) -> None:
        code = main(["--url", f"sqlite://{engine_file}", "holders", "a", "run", "--", "b", "c"])
        out = capsys.readouterr().out
        assert code == 0, out
        assert [line.split(":")[0] for line in out.splitlines()] == ["a", "run", "b", "c"], (
            f"every name is looked up: {out!r}")


class TestAZeroWait:
    @pytest.mark.parametrize("spelling", [
        "0", "0s", "0ms", "0.0", "00", "0m0s", "0h0m", "0d0h0m0s", "0.00m0s", "0 s", " 0m 0s ",
        "0e0", "-0", "0.s", ".0s",
    ])
    def test_every_spelling_of_zero_the_durations_read_means_no_wait(self,
                                                                     spelling: str) -> None:
        args = build_parser().parse_args(["run", "job", "--wait", spelling])
        assert args.wait == 0.0, f"--wait {spelling!r} must mean --wait 0, got {args.wait!r}"

    @pytest.mark.parametrize("spelling", ["0x", "0m0", "0..s", "s"])
    def test_a_zero_the_durations_do_not_read_is_refused(
            self, capsys: pytest.CaptureFixture[str], engine_file: Path, spelling: str) -> None:
        code, err = _usage_error(["run", "job", "--wait", spelling, "--", "true"], capsys)
        assert code == 2 and f"--wait: {spelling!r} is not a duration" in err, (
            f"{spelling!r}: exit {code}: {err!r}")

    def test_a_positive_wait_is_the_duration_it_spells(self) -> None:
        args = build_parser().parse_args(["run", "job", "--wait", "1m0.5s"])
        assert args.wait == 60.5, f"--wait 1m0.5s is 60.5 seconds, got {args.wait!r}"


class TestASqliteUrlThatNamesNoFile:
    @pytest.mark.parametrize("where", ["nothing", "a folder", "a folder with a slash",
                                       "a missing folder", "the current folder"])
    def test_is_bad_usage_saying_so_on_one_line(
            self, capsys: pytest.CaptureFixture[str], tmp_path: Path, where: str) -> None:
        url = {"nothing": "sqlite:///", "a folder": f"sqlite://{tmp_path}",
               "a folder with a slash": f"sqlite://{tmp_path}/",
               "a missing folder": f"sqlite://{tmp_path}/new/",
               "the current folder": f"sqlite://{tmp_path}/."}[where]
        code, err = _usage_error(["--url", url, "ping"], capsys)
        assert code == 2, f"{url}: a URL that names no file is bad usage, got {code}: {err!r}"
        assert err.startswith(f"queen-sync: sqlite URL '{url}' names no database file"), (
            f"{url}: it must say the URL names no database file: {err!r}")
        assert len(err.splitlines()) == 1, f"{url}: one line: {err!r}"
        assert sorted(tmp_path.iterdir()) == [], f"{url}: nothing may be created"

    def test_from_queen_url_is_refused_the_same_way(
            self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("QUEEN_URL", "sqlite:///")
        code, err = _usage_error(["holders", "job"], capsys)
        assert code == 2 and "names no database file" in err, f"exit {code}: {err!r}"

    def test_shows_no_secret_of_the_url(self, capsys: pytest.CaptureFixture[str]) -> None:
        code, err = _usage_error(["--url", "sqlite:///?busy_timeout=5#s3cr3t", "ping"], capsys)
        assert code == 2 and "names no database file" in err, f"exit {code}: {err!r}"
        assert "s3cr3t" not in err, f"the URL's secrets must be masked: {err!r}"

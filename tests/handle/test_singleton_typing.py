"""``@singleton_job`` keeps the decorated function's parameters; the value becomes Optional.

Checked by running mypy on a small program: every line marked ``# E`` must be
reported, and nothing else.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROGRAM = '''
from __future__ import annotations

from typing import Optional

from typing_extensions import assert_type

import queen_sync as qs


@qs.singleton_job("a", ttl="1m")
def add(a: int, b: str = "x") -> float:
    return 1.0


@qs.singleton_job
def bare(n: int) -> str:
    return ""


@qs.singleton_job("b", ttl="1m", bind=True)
def bound(lock: qs.Lock, n: int) -> bytes:
    return b""


class Jobs:
    @qs.singleton_job("c", ttl="1m")
    def method(self, n: int) -> int:
        return n


assert_type(add(1, b="y"), Optional[float])
assert_type(bare(3), Optional[str])
assert_type(bound(3), Optional[bytes])
assert_type(Jobs().method(2), Optional[int])
add("wrong")  # E: the parameters are checked
add(1, c=2)  # E: no unknown keyword
bound(qs.Lock, 3)  # E: the lock is passed by the wrapper, not the caller
Jobs().method()  # E: a method binds self and keeps the rest
'''


def test_the_wrapper_is_typed_with_the_functions_parameters(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-pretty", "--config-file", os.devnull,
         "--cache-dir", str(tmp_path / "cache"), str(program)],
        capture_output=True, text=True, timeout=110, cwd=tmp_path,
        env=dict(os.environ, MYPYPATH=str(REPO)), check=False)
    reported = {int(n) for n in re.findall(r"program\.py:(\d+): error", done.stdout)}
    expected = {n for n, line in enumerate(PROGRAM.splitlines(), 1) if "# E" in line}
    assert reported == expected, f"mypy reported lines {sorted(reported)}, expected " \
                                 f"{sorted(expected)}:\n{done.stdout}{done.stderr}"

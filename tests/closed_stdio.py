"""Programs that the tests run with stdin, stdout and stderr closed (``python prog.py >&-``,
as a daemon starts): they report to a file (``reporter``); ``run`` starts one and reads it."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
CLOSING = 'exec "$0" "$@" <&- >&- 2>&-'  # sh: the program starts with 0, 1 and 2 closed


def where(fd: int) -> str:
    """What ``fd`` of this process is (its ``/proc`` link), or "closed"."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "closed"


def reporter(path: str) -> Callable[..., None]:
    """A function that writes the repr of its arguments as a line of ``path`` (opened now: in a
    program started with 0 closed, on that number)."""
    out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC)

    def report(*items: Any) -> None:
        os.write(out, (repr(items) + "\n").encode())

    return report


def run(
    tmp_path: pathlib.Path, text: str, *args: str, timeout: float
) -> tuple[int, list[tuple[Any, ...]]]:
    """Run the program ``text`` (its ``argv[1]``: its report's path, then ``args``) with its
    standard streams closed; return its exit status and the lines it reported."""
    script, report = tmp_path / "prog.py", tmp_path / "report.txt"
    script.write_text(text)
    result = subprocess.run(
        ["sh", "-c", CLOSING, sys.executable, str(script), str(report), *args],
        cwd=tmp_path,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,
    )
    return result.returncode, [ast.literal_eval(line) for line in report.read_text().splitlines()]

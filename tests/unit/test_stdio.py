"""Tests of mpsched._stdio: the pool's fds kept off the numbers 0, 1 and 2.

Each case runs in a program started with stdin, stdout and stderr closed (this process's
own must stay as they are); it reports to a file.
"""

from __future__ import annotations

import pathlib

import pytest

from tests import closed_stdio

PROGRAM = """
import os, sys
from mpsched import _shm, _stdio
from tests.closed_stdio import reporter, where

report = reporter(sys.argv[1])  # on 0

with _stdio.stdio_held():  # 1 and 2 get /dev/null while held, closed again after
    report("held", [where(fd) for fd in (1, 2)], os.get_inheritable(1))
    r, w = os.pipe()
    report("made", r > 2 and w > 2)
report("after", [where(fd) for fd in (1, 2)])

r, w = os.pipe()  # lands on 1 and 2
moved = _stdio.above_stdio(r)
report("moved", moved > 2, where(moved) == where(w), where(r), os.get_inheritable(moved))
report("kept", _stdio.above_stdio(moved) == moved)
moved_w = _stdio.above_stdio(w)  # on 2, a standard stream's number too
report("moved 2", w, moved_w > 2, where(w))
os.close(moved_w)

# A received fd (spawn and forkserver children rebuild them so) on 1: moved above 2, and
# the closed numbers get /dev/null, inheritable as standard streams are.
class Received:
    def __init__(self, fd):
        self.fd = fd
    def detach(self):
        return self.fd
low = os.eventfd(0)
fd = _shm._own_received_fd(Received(low))
report("received", low, fd > 2, where(fd), [where(n) for n in (1, 2)], os.get_inheritable(1))
"""


@pytest.mark.timeout(60)
def test_the_pools_fds_go_above_the_standard_streams_and_leave_them_as_they_were(
    tmp_path: pathlib.Path,
) -> None:
    returncode, lines = closed_stdio.run(tmp_path, PROGRAM, timeout=30)
    assert returncode == 0, lines
    assert lines == [
        ("held", ["/dev/null", "/dev/null"], False),
        ("made", True),
        ("after", ["closed", "closed"]),
        ("moved", True, True, "closed", False),
        ("kept", True),
        ("moved 2", 2, True, "closed"),
        ("received", 1, True, "anon_inode:[eventfd]", ["/dev/null", "/dev/null"], True),
    ]


NESTED = """
import os, sys
from mpsched import _stdio
from tests.closed_stdio import reporter, where

report = reporter(sys.argv[1])  # on 0

with _stdio.stdio_held():  # a second Pool() starts (in another thread) while the first does
    with _stdio.stdio_held():
        report("inner", [where(fd) for fd in (1, 2)])
    report("outer", [where(fd) for fd in (1, 2)])
report("after", [where(fd) for fd in (1, 2)])
"""


@pytest.mark.timeout(60)
def test_pools_starting_at_once_close_the_stand_ins_that_the_first_opened(
    tmp_path: pathlib.Path,
) -> None:
    """Of overlapping ``stdio_held()`` calls, the first opens the stand-ins and the last closes
    them: a later one that reopened (found nothing closed, so remembered nothing) left 1 and 2
    on /dev/null for good, where the program had them closed (a mutation hunt found it)."""
    returncode, lines = closed_stdio.run(tmp_path, NESTED, timeout=30)
    assert returncode == 0, lines
    assert lines == [
        ("inner", ["/dev/null", "/dev/null"]),
        ("outer", ["/dev/null", "/dev/null"]),
        ("after", ["closed", "closed"]),
    ]

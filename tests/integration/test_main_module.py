"""Functions defined in the user's ``__main__`` module, under each start method.

Plain pickle serializes a ``__main__`` function by reference (``__main__.name``), and that name
resolves in the pool's process; in a worker it may not: under spawn and forkserver the worker's
``__main__`` is the main script run again as ``__mp_main__`` (its ``if __name__ == "__main__"``
block skipped), or nothing at all for ``python -c`` and notebooks; under fork it is a copy taken
when the zygote forked. The pool must still run such functions (by value, with cloudpickle).
Run as subprocesses, each with its own ``__main__``.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUN_DEADLINE = 45.0  # s for one script: a pool's start-up, a few tasks and its shutdown

SCRIPT = """
import os, sys
import mpsched

def top(x):  # module level: a spawned worker's __mp_main__ defines it too
    return x + 1

if __name__ == "__main__":
    def setup(value):  # only in the pool's process (a worker's re-run skips this block)
        os.environ["MPSCHED_TEST_SETUP"] = value

    with mpsched.Pool(2, start_method=sys.argv[1], initializer=setup, initargs=("done",)) as pool:
        def late(x):  # defined after the zygote (and, under fork, the workers) started
            return x * 10

        def late_parent(x):  # a task in a worker submits a child of a __main__ function
            return mpsched.submit(late, x).result() + 1

        def setup_seen():
            return os.environ.get("MPSCHED_TEST_SETUP")

        print("top", pool.submit(top, 1).result(timeout=20), flush=True)
        print("late", pool.submit(late, 2).result(timeout=20), flush=True)
        print("late again", pool.submit(late, 3).result(timeout=20), flush=True)
        print("nested", pool.submit(late_parent, 4).result(timeout=20), flush=True)
        print("setup", pool.submit(setup_seen).result(timeout=20), flush=True)
        print("map", list(pool.map(late, range(3))), flush=True)
"""

EXPECTED = ["top 2", "late 20", "late again 30", "nested 41", "setup done", "map [0, 10, 20]"]


def _run(argv: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess[str]:
    """Run a user's program to its end, with this checkout importable."""
    return subprocess.run(
        argv,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=RUN_DEADLINE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )


def _run_main(
    tmp_path: pathlib.Path, source: str, start_method: str, main: str = "script"
) -> subprocess.CompletedProcess[str]:
    """Run ``source`` as a user's script (``user_main.py``), or with ``main="dash-c"`` as
    ``python -c`` (no file to run again: what a notebook gives a spawned process), with
    ``start_method`` as its argument; it must end well."""
    if main == "script":
        script = tmp_path / "user_main.py"
        script.write_text(source)
        argv = [sys.executable, str(script), start_method]
    else:
        argv = [sys.executable, "-c", source, start_method]
    proc = _run(argv, tmp_path)
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.mark.timeout(60)
@pytest.mark.parametrize("main", ["script", "dash-c"])
@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_functions_defined_in_main_run_under_each_start_method(
    tmp_path: pathlib.Path, main: str, start_method: str
) -> None:
    proc = _run_main(tmp_path, SCRIPT, start_method, main)
    assert proc.stdout.splitlines() == EXPECTED, proc.stderr
    assert "leaked" not in proc.stderr, proc.stderr


# A worker's __main__ may hold an older function under a task's name: the one defined there before
# the script redefined it (fork: the zygote's copy; spawn and forkserver: the script run again).
# The worker must run the new body, while a function it holds unchanged stays its own (with the
# globals the initializer set in the worker). So must a function that a factory made again with
# other values in its closure (same code: it ran with the old values).
REDEFINED = """
import functools
import sys
import mpsched

def deco(fn):
    @functools.wraps(fn)
    def wrapper(x):  # the same code for every function it wraps
        return fn(x)
    return wrapper

@deco
def g(x):
    return x + 2

SEEN = "unset"

def set_seen(value):
    global SEEN
    SEEN = value

def seen():
    return SEEN

def f(x):
    return x + 1

def scaled(k):
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(x):  # the same code whatever k it was made with
            return fn(x) * k
        return wrapper
    return deco

def h(x):
    return SEEN * x

h = scaled(2)(h)

def m(x):
    return x

m = scaled(2)(m)

if __name__ == "__main__":
    with mpsched.Pool(
        1, start_method=sys.argv[1], initializer=set_seen, initargs=("worker",)
    ) as pool:
        print("seen", pool.submit(seen).result(timeout=20), flush=True)
        print("first", pool.submit(f, 1).result(timeout=20), flush=True)
        def f(x):  # a new body under the old name (a notebook cell run again)
            return x * 100
        print("redefined", pool.submit(f, 1).result(timeout=20), flush=True)
        print("map", list(pool.map(f, [1])), flush=True)
        print("decorated", pool.submit(g, 1).result(timeout=20), flush=True)
        @deco
        def g(x):
            return x * 1000
        print("decorated redefined", pool.submit(g, 1).result(timeout=20), flush=True)
        m = scaled(3)(m.__wrapped__)  # the workers' __main__.m: the same code, made with k=2
        print("made", pool.submit(h, 1).result(timeout=20), pool.submit(m, 1).result(timeout=20))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_a_redefined_main_function_runs_its_new_body(
    tmp_path: pathlib.Path, start_method: str
) -> None:
    proc = _run_main(tmp_path, REDEFINED, start_method)
    assert proc.stdout.splitlines() == [
        "seen worker",
        "first 2",
        "redefined 100",
        "map [100]",
        "decorated 3",
        "decorated redefined 1000",
        "made workerworker 3",
    ], proc.stderr


# An exception class of the main block travels by value (cloudpickle) as results do: plain
# pickle names it __main__.BlockError, which a worker's __main__ lacks (or holds as another
# class: a copy by value), and the task's error arrived as a RuntimeError saying so.
MAIN_EXCEPTION = """
import sys
import mpsched

if __name__ == "__main__":
    class BlockError(Exception):
        pass

    def fail():
        raise BlockError("from the main block")

    def fail_local():
        class LocalError(Exception):
            pass
        raise LocalError("local")

    with mpsched.Pool(1, start_method=sys.argv[1]) as pool:
        for fn in (fail, lambda: fail(), fail_local):
            try:
                pool.submit(fn).result(timeout=20)
            except Exception as exc:
                print(type(exc).__name__, isinstance(exc, BlockError), exc, flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_an_exception_class_of_the_main_block_reaches_the_caller(
    tmp_path: pathlib.Path, start_method: str
) -> None:
    proc = _run_main(tmp_path, MAIN_EXCEPTION, start_method)
    assert proc.stdout.splitlines() == [
        "BlockError True from the main block",
        "BlockError True from the main block",
        "LocalError False local",
    ], proc.stderr


# One part of a call or of a result that only cloudpickle can write (a lambda) sent the whole of
# it through cloudpickle, which copies every class and function of __main__ by value: an enum
# member or an instance of the script's own class then belonged to a copy of that class, in the
# worker (arguments) or in the caller (a result, under fork), and ``is``, ``==`` and
# ``isinstance`` said False, with no error (found in review). They now go as plain pickle's do.
MAIN_IDENTITY_BESIDE_A_LAMBDA = """
import enum
import sys
import mpsched

class Color(enum.Enum):
    RED = 1

class Shape:
    pass

def check(c, s, key=None):
    return c is Color.RED and isinstance(s, Shape)

def give(with_lambda):
    return Color.RED, Shape(), (lambda: 0) if with_lambda else None

if __name__ == "__main__":
    with mpsched.Pool(1, start_method=sys.argv[1]) as pool:
        print(pool.submit(check, Color.RED, Shape()).result(timeout=20),
              pool.submit(check, Color.RED, Shape(), key=lambda v: v).result(timeout=20),
              pool.submit(lambda: check(Color.RED, Shape())).result(timeout=20))
        for with_lambda in (False, True):
            c, s, _ = pool.submit(give, with_lambda).result(timeout=20)
            print(c is Color.RED and isinstance(s, Shape))
"""


# The copy by value of a function or class of the script's main block (``copy_by_value``, which
# a worker without that name loads) held a copy of every other class of __main__ it refers to:
# a base class, an enum it tests against, the class of an enum member it holds. Its arguments,
# pickled by name, were of the worker's own class, so ``is`` and ``isinstance`` said False, with
# no error (found in review). Under fork, a function defined after the pool started is such a
# copy too.
MAIN_BLOCK_COPIES_KEEP_IDENTITY = """
import enum
import sys
import mpsched

class Color(enum.Enum):
    RED = 1

class Base:
    pass

def is_base(b):
    return isinstance(b, Base)

def holds_red(obj):
    return obj.color is Color.RED

if __name__ == "__main__":
    class Child(Base):
        pass

    class Holder:
        color = Color.RED

    with mpsched.Pool(1, start_method=sys.argv[1]) as pool:
        def is_red(c):
            return c is Color.RED

        def is_red_base(b):
            return isinstance(b, Base) and type(b).__mro__[1] is Base

        print(pool.submit(is_red, Color.RED).result(timeout=20),
              list(pool.map(is_red, [Color.RED])) == [True],
              pool.submit(is_red_base, Child()).result(timeout=20),
              pool.submit(is_base, Child()).result(timeout=20),
              pool.submit(holds_red, Holder()).result(timeout=20))
"""


# A class of __main__ defined again after the pool started (a notebook's cell run again; here
# in the script's main block, and under ``python -c``, where only fork's workers have the name):
# its instances went by name, and the workers' class of that name, the old one, ran its old
# methods (found in review). They now go as the new class's copy.
REDEFINED_CLASS = """
import sys
import mpsched

class K:
    def v(self):
        return "old"

def call_v(k):
    return k.v()

def ident(o):
    return o

if __name__ == "__main__":
    with mpsched.Pool(1, start_method=sys.argv[1]) as pool:
        before = pool.submit(call_v, K()).result(timeout=20)
        class K:
            def v(self):
                return "new"
        print(before, pool.submit(call_v, K()).result(timeout=20),
              type(pool.submit(ident, K()).result(timeout=20)) is K)
"""


# Functions of __main__ that functools.lru_cache or functools.cache wrap: plain pickle writes the
# wrapper by name, so one of the main block failed in the workers of spawn and forkserver ("Can't
# get attribute"), and one defined again ran its old body (found in review). Their stand-in is
# the worker's wrapper if it wraps the same code, else a wrapper of a copy, made once per worker
# (its cache lasts across tasks) and reached by the copy's own recursive calls.
CACHED_FUNCTIONS = """
import functools
import sys
import mpsched

@functools.lru_cache(maxsize=None)
def version(x):
    return ("old", x)

if __name__ == "__main__":
    @functools.lru_cache(maxsize=None)
    def fib(n):
        return n if n < 2 else fib(n - 1) + fib(n - 2)

    @functools.cache
    def square(x):
        return x * x

    @functools.lru_cache(maxsize=None)
    def version(x):
        return ("new", x)

    def cached_in_worker():
        return fib.cache_info().currsize

    def apply(fn, x):
        return fn(x)

    with mpsched.Pool(1, start_method=sys.argv[1]) as pool:
        print(pool.submit(fib, 80).result(timeout=20),
              list(pool.map(square, [2, 3])),
              pool.submit(apply, square, 4).result(timeout=20),
              pool.submit(version, 1).result(timeout=20),
              pool.submit(cached_in_worker).result(timeout=20))
"""


# A main module that starts a thread as it is imported: spawn and forkserver run it again in the
# zygote, whose forks (the workers) keep any lock that thread holds at that moment held for ever
# (found in review: a task that took it hung; the stdlib's pools run the module afresh in each
# worker). The zygote says so before its first fork.
THREAD_AT_IMPORT = """
import sys
import threading
import mpsched

stop = threading.Event()
threading.Thread(target=stop.wait, name="refresher", daemon=True).start()

def ident(x):
    return x

if __name__ == "__main__":
    with mpsched.Pool(1, start_method=sys.argv[1]) as pool:
        print(pool.submit(ident, 1).result(timeout=20))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_zygote_that_an_import_left_with_threads_warns(
    tmp_path: pathlib.Path, start_method: str
) -> None:
    proc = _run_main(tmp_path, THREAD_AT_IMPORT, start_method)
    assert proc.stdout.splitlines() == ["1"], proc.stderr
    assert "the pool's zygote runs threads (refresher)" in proc.stderr, proc.stderr
    # Told, not raised: under -W error (which spawn passes on) the warning killed the zygote.
    script = tmp_path / "user_main.py"
    strict = _run([sys.executable, "-W", "error", str(script), start_method], tmp_path)
    assert (strict.returncode, strict.stdout) == (0, "1\n"), strict.stderr


# The working directory, sys.path and environment that the workers see: under forkserver and
# spawn those of the first task, as the pool's first workers start with it (a path added to
# sys.path after Pool(), and a module imported from it, failed in the workers; found in review);
# under fork those of Pool(), where the zygote and its first worker are forked. A variable removed
# after Pool() is gone for them too: the forkserver's zygote started with it (a mutation hunt found
# the removal unpinned).
STATE_AFTER_POOL = """
import os
import sys
import mpsched

def probe():
    try:
        import helper_after_pool
    except ImportError:
        found = False
    else:
        found = helper_after_pool.FOUND
    return (
        os.path.basename(os.getcwd()),
        os.environ.get("SET_AFTER_POOL"),
        found,
        os.environ.get("UNSET_AFTER_POOL"),
    )

if __name__ == "__main__":
    here = os.getcwd()
    os.environ["UNSET_AFTER_POOL"] = "yes"
    with mpsched.Pool(1, start_method=sys.argv[1]) as pool:
        os.mkdir("lib")
        with open(os.path.join("lib", "helper_after_pool.py"), "w") as module:
            module.write("FOUND = True")
        sys.path.insert(0, os.path.join(here, "lib"))
        os.mkdir("elsewhere")
        os.chdir("elsewhere")
        os.environ["SET_AFTER_POOL"] = "yes"
        del os.environ["UNSET_AFTER_POOL"]
        print(*pool.submit(probe).result(timeout=20))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_the_workers_see_the_directory_path_and_environment_of_the_first_task(
    tmp_path: pathlib.Path, start_method: str
) -> None:
    proc = _run_main(tmp_path, STATE_AFTER_POOL, start_method)
    if start_method == "fork":
        expected = f"{tmp_path.name} None False yes"
    else:
        expected = "elsewhere yes True None"
    assert proc.stdout.splitlines() == [expected], proc.stderr


# '' in sys.path (python -c, the REPL, a notebook) is the current directory, as here, then the
# directory the program started in: a module imported from that one before an os.chdir failed in
# the workers, which enter the new directory (found in review); a module of one name in both,
# imported after the chdir, must be the new directory's (a diff review).
STATE_AFTER_CHDIR = """
import os
import sys
import mpsched
import from_start_dir

os.chdir("elsewhere")
import from_new_dir
import in_both

with mpsched.Pool(1, start_method=sys.argv[1]) as pool:
    print(pool.submit(from_start_dir.where).result(timeout=20))
    print(pool.submit(from_new_dir.where).result(timeout=20))
    print(pool.submit(in_both.where).result(timeout=20))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_a_module_of_the_empty_path_entry_is_found_after_a_chdir(
    tmp_path: pathlib.Path, start_method: str
) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "from_start_dir.py").write_text("def where():\n    return 'start'\n")
    (tmp_path / "elsewhere" / "from_new_dir.py").write_text("def where():\n    return 'new'\n")
    (tmp_path / "in_both.py").write_text("def where():\n    return 'start'\n")
    (tmp_path / "elsewhere" / "in_both.py").write_text("def where():\n    return 'new'\n")
    proc = _run_main(tmp_path, STATE_AFTER_CHDIR, start_method, main="dash-c")
    assert proc.stdout.splitlines() == ["start", "new", "new"], proc.stderr


# A module that the main module imports makes a pool as it is imported: under spawn and forkserver
# the zygote imports the main module again, and with it that module, whose Pool() then failed
# inside multiprocessing with its advice to guard the main module, which was guarded (found in
# review). The zygote's error now names the module and the way out.
POOL_AT_IMPORT_MODULE = """
import sys
import mpsched
POOL = mpsched.Pool(1, start_method=sys.argv[1])
"""
POOL_AT_IMPORT_MAIN = """
import pool_at_import

if __name__ == "__main__":
    pool_at_import.POOL.submit(abs, -1).result(timeout=20)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_pool_made_by_a_module_the_main_module_imports_names_it(
    tmp_path: pathlib.Path, start_method: str
) -> None:
    (tmp_path / "pool_at_import.py").write_text(POOL_AT_IMPORT_MODULE)
    script = tmp_path / "user_main.py"
    script.write_text(POOL_AT_IMPORT_MAIN)
    proc = _run([sys.executable, str(script), start_method], tmp_path)
    assert proc.returncode != 0
    assert "mpsched.Pool() cannot start while multiprocessing starts this process" in proc.stderr, (
        proc.stderr
    )
    assert "module 'pool_at_import' makes a pool as it is imported" in proc.stderr, proc.stderr


# cloudpickle's copy of a class with __slots__ has no slots (it sets __slots__ as a plain
# attribute after creating the class), so its instances have a __dict__ and pickle their state
# as one; a worker's copy maps back to the caller's own slotted class, which cannot take that
# state: every result holding such an instance failed ("'S' object has no attribute
# '__dict__'"; found in review). The same for a class made in a function.
SLOTTED_COPIES = """
import dataclasses
import sys
import mpsched

def ident(o):
    return o

def local_class():
    class Local:
        __slots__ = ("x",)
        def __init__(self, x):
            self.x = x
    return Local

if __name__ == "__main__":
    @dataclasses.dataclass(slots=True)
    class S:
        x: int

    class T:
        __slots__ = ("x", "__weakref__")
        def __init__(self, x):
            self.x = x

    def make_s(x):
        return S(x)

    Local = local_class()
    with mpsched.Pool(1, start_method=sys.argv[1]) as pool:
        s = pool.submit(ident, S(1)).result(timeout=20)
        made = pool.submit(make_s, 2).result(timeout=20)
        t = pool.submit(ident, T(3)).result(timeout=20)
        local = pool.submit(ident, Local(4)).result(timeout=20)
        print(s == S(1), made == S(2), type(t) is T and t.x == 3,
              type(local) is Local and local.x == 4,
              pool.submit(lambda: hasattr(S(5), "__dict__")).result(timeout=20))
"""


# A typing.NamedTuple copied by value (of the main block, or made in a function) is remade
# through typing's metaclass, which refused the __slots__ that the copy of a slotted class is
# given (_serialize._with_slots): "Cannot overwrite NamedTuple attribute __slots__", as an
# argument, a result and a lambda's result alike (a pickling hunt).
TYPED_TUPLE_COPIES = """
import sys
import typing
import mpsched

def ident(o):
    return o

def local_tuple():
    class Local(typing.NamedTuple):
        x: int
    return Local

if __name__ == "__main__":
    class Point(typing.NamedTuple):
        x: int
        y: int = 0

    Local = local_tuple()
    with mpsched.Pool(1, start_method=sys.argv[1]) as pool:
        back = pool.submit(ident, Point(1, 2)).result(timeout=20)
        made = pool.submit(lambda: Point(3)).result(timeout=20)
        local = pool.submit(ident, Local(4)).result(timeout=20)
        print(back == Point(1, 2) and type(back) is Point, made == Point(3, 0),
              type(local) is Local and local.x == 4,
              pool.submit(ident, Point).result(timeout=20) is Point)
"""


# Classes in a cycle: the top-level A's method reads B of the main block, B's reads A. B's copy
# made first inside A's (a task using A's copy: here g, under spawn, where the workers lack B)
# copies A along, which is right there only; kept for later tasks, it made B's isinstance(x, A)
# of an argument A (the worker's own) say False after g, True without it (found in review).
CYCLE_ORDER = """
import sys
import mpsched

class A:
    def make_b(self):
        return B()

if __name__ == "__main__":
    class B:
        def check(self, x):
            return isinstance(x, A)

    def g():
        return type(A().make_b()).__name__

    def f(a):
        return B().check(a)

    with mpsched.Pool(1, start_method=sys.argv[1]) as pool:
        try:
            pool.submit(g).result(timeout=20)
        except NameError:  # the workers' own A reads their B: under spawn they have none
            pass
        print(pool.submit(f, A()).result(timeout=20))
"""


# What each script above prints, in each start method (and as ``python -c`` where the way the
# workers lack the main block's names matters).
SCRIPT_OUTPUTS = {
    "identity_beside_a_lambda": (MAIN_IDENTITY_BESIDE_A_LAMBDA, ["True True True", "True", "True"]),
    "copies_keep_identity": (MAIN_BLOCK_COPIES_KEEP_IDENTITY, ["True True True True True"]),
    "redefined_class": (REDEFINED_CLASS, ["old new True"]),
    "lru_cache": (CACHED_FUNCTIONS, ["23416728348467685 [4, 9] 16 ('new', 1) 81"]),
    "slotted": (SLOTTED_COPIES, ["True True True True False"]),
    "typed_tuples": (TYPED_TUPLE_COPIES, ["True True True True"]),
    "cycle_order": (CYCLE_ORDER, ["True"]),
}
SCRIPT_RUNS = [
    *((case, "script") for case in SCRIPT_OUTPUTS),
    ("redefined_class", "dash-c"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("case", "main"), SCRIPT_RUNS)
@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_a_main_script_sees_in_its_tasks_what_it_sees_itself(
    tmp_path: pathlib.Path, case: str, main: str, start_method: str
) -> None:
    source, expected = SCRIPT_OUTPUTS[case]
    proc = _run_main(tmp_path, source, start_method, main)
    assert proc.stdout.splitlines() == expected, proc.stderr


# A __main__ function the worker cannot name goes by value (_serialize.portable). Its copy by
# value, tabled and cached by every worker, held the function's globals as they were at its first
# submit: a later submit ran with those stale values, while map() (which carries a fresh copy per
# call) and the pool's own process saw the current ones. A rebound global now makes a fresh copy.
STALE_GLOBALS = """
import sys
import mpsched

if __name__ == "__main__":
    with mpsched.Pool(1, start_method=sys.argv[1]) as pool:
        factor = 1
        def scaled(x):
            return x * factor
        print("first", pool.submit(scaled, 1).result(timeout=20), flush=True)
        factor = 2
        print("submit", pool.submit(scaled, 1).result(timeout=20), flush=True)
        print("map", list(pool.map(scaled, [1])), flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_a_main_function_by_value_sees_its_current_globals(
    tmp_path: pathlib.Path, start_method: str
) -> None:
    proc = _run([sys.executable, "-c", STALE_GLOBALS, start_method], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["first 1", "submit 2", "map [2]"], proc.stdout


# Each way a task reaches a worker sees a global the script rebound: submit, schedule, a child
# submitted from a worker (its parent's copy carries the child function's copy, and that one's
# globals), and map; so does a method of a __main__ class a task uses. At module level, the
# worker's own __main__ may hold the functions (fork; spawn's run of the script again), with its
# own, stale, globals: the fresh copy must win over the name. A global rebound in a loop neither
# fills the function table nor goes stale.
REBOUND_GLOBALS = """
import sys
import time
import mpsched
from mpsched._function_cache import MAIN_RETABLE_MAX

factor = 1

def scaled(x):
    return x * factor

def nested(x):
    return mpsched.submit(scaled, x).result()

class Scaler:  # copied by value with its methods, and their globals
    def run(self, x):
        return x * factor

def method_user(x):
    return Scaler().run(x)

if __name__ == "__main__":
    with mpsched.Pool(1, start_method=sys.argv[1]) as pool:
        def calls():
            return [
                pool.submit(scaled, 1).result(timeout=20),
                pool.schedule("s", time.monotonic(), 0, scaled, 1).result(timeout=20),
                pool.submit(nested, 1).result(timeout=20),
                pool.submit(method_user, 1).result(timeout=20),
                *pool.map(scaled, [1]),
            ]
        print("first", *calls(), flush=True)
        factor = 2
        print("rebound", *calls(), flush=True)
        tabled = len(pool._views.functions)
        for factor in range(3, 43):
            got = calls()
            if got != [factor] * 5:
                print("stale", factor, got, flush=True)
        grown = len(pool._views.functions) - tabled
        print("table bounded", grown <= 3 * MAIN_RETABLE_MAX, flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("main", ["script", "dash-c"])
@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_a_rebound_global_reaches_every_kind_of_task(
    tmp_path: pathlib.Path, main: str, start_method: str
) -> None:
    proc = _run_main(tmp_path, REBOUND_GLOBALS, start_method, main)
    assert proc.stdout.splitlines() == [
        "first 1 1 1 1 1",
        "rebound 2 2 2 2 2",
        "table bounded True",
    ], proc.stderr


# Objects of __main__ in a task's arguments: an instance of a class of the main block (or of
# any class, under ``python -c``: a notebook's case; under fork, of one defined after the pool
# started) failed the task in the worker with "Can't get attribute", as in the stdlib's pools,
# because its class went by reference alone (_serialize.with_main_stand_ins). A class the worker
# has (the script's top level) must stay the worker's own, and a result must come back as an
# instance of the caller's class.
MAIN_ARGUMENTS = """
import enum, os, sys, time
from dataclasses import dataclass
import mpsched

@dataclass
class Top:  # module level: a spawned worker's __mp_main__ defines it too (not under -c)
    v: int

def is_top(t):  # the worker's own Top, if it has one, else the copy that came with it
    return isinstance(t, Top)

def ident(x):
    return x

def norm(p):
    return (p.x ** 2 + p.y ** 2) ** 0.5

def apply(fn, x):
    return fn(x)

def seen_by_initializer():
    return os.environ.get("MPSCHED_TEST_INIT")

def via_child(p):  # a child's argument: the copy the worker loaded, pickled for its peer
    return mpsched.submit(norm, p).result() + 1

if __name__ == "__main__":
    @dataclass
    class Point:
        x: float
        y: float

    class Color(enum.Enum):
        RED = 1

    class Outer:
        class Inner:
            def __init__(self, v):
                self.v = v

    def double(x):
        return 2 * x

    def remember(p):
        os.environ["MPSCHED_TEST_INIT"] = f"{type(p).__name__} {p.x} {p.y}"

    with mpsched.Pool(
        2, start_method=sys.argv[1], initializer=remember, initargs=(Point(5, 6),)
    ) as pool:
        class Late:  # defined after the zygote (and, under fork, the workers) started
            def __init__(self, v):
                self.v = v

        print("norm", pool.submit(norm, Point(3, 4)).result(timeout=20), flush=True)
        late = pool.submit(ident, Late(3)).result(timeout=20)
        print("late", type(late) is Late, late.v, flush=True)
        back = pool.submit(ident, Point(1, 2)).result(timeout=20)
        print("back", type(back) is Point, back == Point(1, 2), flush=True)
        print("enum", pool.submit(ident, Color.RED).result(timeout=20) is Color.RED, flush=True)
        inner = pool.submit(ident, Outer.Inner(7)).result(timeout=20)
        print("nested", type(inner) is Outer.Inner, inner.v, flush=True)
        print("function", pool.submit(apply, double, 21).result(timeout=20), flush=True)
        print("top", pool.submit(is_top, Top(1)).result(timeout=20), flush=True)
        print("map", list(pool.map(norm, [Point(3, 4), Point(6, 8)])), flush=True)
        due = pool.schedule("p", time.monotonic(), 0, norm, Point(5, 12))
        print("schedule", due.result(timeout=20), flush=True)
        print("initializer", pool.submit(seen_by_initializer).result(timeout=20), flush=True)
        print("child", pool.submit(via_child, Point(3, 4)).result(timeout=20), flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("main", ["script", "dash-c"])
@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_objects_of_main_in_arguments_reach_the_worker(
    tmp_path: pathlib.Path, main: str, start_method: str
) -> None:
    proc = _run_main(tmp_path, MAIN_ARGUMENTS, start_method, main)
    assert proc.stdout.splitlines() == [
        "norm 5.0",
        "late True 3",
        "back True True",
        "enum True",
        "nested True 7",
        "function 42",
        "top True",
        "map [5.0, 10.0]",
        "schedule 13.0",
        "initializer Point 5 6",
        "child 6.0",
    ], proc.stderr

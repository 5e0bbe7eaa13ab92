"""The codebase's own checks: the public API surface and its docstrings, the layering rule,
what the zygote imports, mypy --strict and ruff."""

from __future__ import annotations

import ast
import inspect
import pathlib
import subprocess
import sys

import pytest

import mpsched

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mpsched"

# Leaf modules may import only these from mpsched (see the layering rule in mpsched/__init__.py).
LEAVES = {
    "_constants",
    "_task",
    "_clock",
    "_heap",
    "_shm",
    "_shm_deque",
    "_payloads",
    "_protocol",
    "_wakeup",
    "_stdio",
}
LEAF_MAY_IMPORT = {"mpsched._constants", "mpsched._errors", "mpsched._task", "mpsched._stdio"}
# Leaves split into modules by role (the slot region, the slab): a leaf's parts import one another.
SLOT_PARTS = {"_shm_deque", "_slot_region", "_slot_repair", "_block_state"}
SLAB_PARTS = {"_payloads", "_slab_region", "_slab_repair", "_function_table"}


def test_all_is_a_tuple_of_public_reexports() -> None:
    assert isinstance(mpsched.__all__, tuple)
    assert list(mpsched.__all__) == sorted(mpsched.__all__)
    for name in mpsched.__all__:
        assert not name.startswith("_")
        assert hasattr(mpsched, name), name


def test_dir_lists_the_public_names() -> None:
    # Not this file's imports and helpers (it listed TYPE_CHECKING, atexit, sys, ...).
    names = dir(mpsched)
    assert set(mpsched.__all__) <= set(names)
    assert [name for name in names if not name.startswith("__")] == sorted(mpsched.__all__)


def test_every_public_name_and_method_has_a_docstring() -> None:
    # help() is how a user reads the API: a method mpsched defines (or overrides) without one
    # shows nothing, or the stdlib's text where the behaviour differs (Future.running).
    missing = []
    for name in mpsched.__all__:
        obj = getattr(mpsched, name)
        if not inspect.getdoc(obj):
            missing.append(name)
        if not inspect.isclass(obj):
            continue
        for attr, member in vars(obj).items():
            descriptor = isinstance(member, (property, classmethod, staticmethod))
            if attr.startswith("_") or not (callable(member) or descriptor):
                continue
            ours = (getattr(member, "__module__", None) or obj.__module__).startswith("mpsched")
            if ours and not member.__doc__:
                missing.append(f"{name}.{attr}")
    assert not missing, f"public names without a docstring: {missing}"


def test_leaf_modules_import_no_other_mpsched_module() -> None:
    for path in PACKAGE.glob("_*.py"):
        if path.stem not in LEAVES | SLOT_PARTS | SLAB_PARTS:
            continue
        may_import = LEAF_MAY_IMPORT
        for parts in (SLOT_PARTS, SLAB_PARTS):
            if path.stem in parts:
                may_import = may_import | {f"mpsched.{part}" for part in parts}
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            if module and module.startswith("mpsched"):
                assert module in may_import, f"{path.name} imports {module}"


# Imported by none of the modules the zygote loads: each costs the start-up of every pool (the
# zygote imports them before it forks the first worker) from ~2 ms (typing, traceback, ctypes)
# to ~10 ms (dataclasses, with inspect, ast and dis).
ZYGOTE_AVOIDS = {
    "typing",
    "ctypes",
    "dataclasses",
    "inspect",
    "traceback",
    "secrets",
    "hashlib",
    "concurrent.futures",
    "mpsched._pool",
    "mpsched._map",
    "mpsched._statistics",
    "mpsched._startup",
    "mpsched._lifecycle",
    "mpsched._coordinator",
    "mpsched._coord_state",
    "mpsched._coord_timed",
    "mpsched._coord_cancel",
    "mpsched._coord_collect",
    "mpsched._coord_dispatch",
    "mpsched._coord_recovery",
    "mpsched._coord_drain",
    "mpsched._pool_errors",
    "mpsched._task",
}


def test_the_zygote_imports_no_heavy_module() -> None:
    code = "import sys; before = set(sys.modules); import mpsched._zygote; "
    code += "print(' '.join(sorted(set(sys.modules) - before)))"
    result = _run([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    assert not set(result.stdout.split()) & ZYGOTE_AVOIDS


def test_the_zygote_creates_no_enum_class() -> None:
    # Each IntEnum class took ~0.35 ms to create, on every pool's start-up path (_constants).
    code = "import enum, sys; import mpsched._zygote; print(' '.join(sorted("
    code += "f'{m}.{n}' for m, mod in list(sys.modules.items()) if m.startswith('mpsched') "
    code += "for n, v in vars(mod).items() if isinstance(v, enum.EnumMeta) and v.__module__ == m)))"
    result = _run([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == []


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.timeout(600)
def test_mypy_strict_is_clean() -> None:
    result = _run([sys.executable, "-m", "mypy", "--strict", "mpsched"])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(120)
def test_ruff_is_clean() -> None:
    result = _run([sys.executable, "-m", "ruff", "check", "mpsched", "tests", "benchmarks"])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(120)
def test_user_code_of_the_public_api_type_checks() -> None:
    # tests/typing_cases.py: correct uses pass, each wrong one must raise the error its
    # ``type: ignore[code]`` names (an unused ignore fails). A few seconds (mypy, one file).
    args = [sys.executable, "-m", "mypy", "--strict", "--warn-unused-ignores"]
    result = _run([*args, "tests/typing_cases.py"])
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_futures_are_generic_at_run_time_too() -> None:
    # As concurrent.futures.Future[int]: annotations evaluated at run time (typing.get_type_hints,
    # pydantic, ...) must not fail on them.
    assert mpsched.Future[int].__origin__ is mpsched.Future
    assert mpsched.ChildFuture[int].__origin__ is mpsched.ChildFuture

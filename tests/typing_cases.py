"""User code of the public API, checked by mypy --strict in tests/test_quality.py (never run).

Correct uses must pass; each wrong one carries the ``# type: ignore[code]`` of the error mypy
must report there (``warn_unused_ignores``: an ignore with nothing to ignore is itself an error),
so that the API's types are seen to catch it.
"""

from __future__ import annotations

import concurrent.futures

import mpsched
from mpsched import Pol  # type: ignore[attr-defined]


def typo_in_a_module_attribute() -> None:
    mpsched.curent_task()  # type: ignore[attr-defined]
    mpsched.current_task()
    print(Pol)


def fib(n: int) -> int:
    return n if n < 2 else mpsched.submit(fib, n - 1).result() + fib(n - 2)


def spawns_children() -> list[int]:
    child: mpsched.ChildFuture[int] = mpsched.submit(fib, 5)
    mpsched.submit(fib, "5")  # type: ignore[arg-type]
    wrong: str = mpsched.submit(fib, 5).result()  # type: ignore[assignment]
    return [child.result(), len(wrong)]


def uses_a_pool() -> None:
    with mpsched.Pool(2) as pool:
        same: mpsched.Pool = pool
        future: mpsched.Future[int] = pool.submit(fib, 25)
        n: int = future.result()
        pool.submit(fib, "25")  # type: ignore[arg-type]
        pool.submit(fib)  # type: ignore[call-arg]
        pool.submit(fib, n=25)
        s: str = pool.submit(fib, 25).result()  # type: ignore[assignment]
        timed: mpsched.Future[int] = pool.schedule("id", 0.0, 0, fib, 25)
        pool.schedule("id", 0.0, 0, fib, "25")  # type: ignore[arg-type]
        submitter = pool.with_options(timeout=5, retries=2, overlap="skip", misfire="skip")
        opts: mpsched.TaskOptions = submitter.options
        pool.with_options(opts, every=1.0).schedule("tick", 0.0, 0, fib, 1)
        with_timeout: mpsched.Future[int] = submitter.submit(fib, 25)
        submitter.submit(fib, "25")  # type: ignore[arg-type]
        pool.with_options(overlap="bogus")  # type: ignore[arg-type]
        pool.with_options(misfire="late")  # type: ignore[arg-type]
        pool.with_options(retries="2")  # type: ignore[arg-type]
        pool.with_options(timout=5)  # type: ignore[call-arg]
        results = pool.map(fib, range(10), chunksize=2)
        squares: list[int] = list(results)
        results.close()  # to abandon a map (its docstring)
        names: list[str] = list(pool.map(fib, range(10)))  # type: ignore[arg-type]
        concurrent.futures.wait([future, timed, with_timeout])
        for done in concurrent.futures.as_completed([future, with_timeout]):
            first: int = done.result()
            print(first)
        print(same, n, s, squares, names)


def on_done(future: mpsched.Future[int]) -> None:
    print(future.result(), future.wait_done(0))


def on_a_str(future: mpsched.Future[str]) -> None:
    print(future.result())


def callbacks_get_the_pools_future() -> None:
    """A callback typed with ``mpsched.Future`` (what it is given) was refused: the stdlib's
    ``add_done_callback`` is typed for its own Future (a typing hunt)."""
    with mpsched.Pool(1) as pool:
        pool.submit(fib, 5).add_done_callback(on_done)
        pool.submit(fib, 5).add_done_callback(lambda f: print(f.wait_done(0)))
        pool.submit(fib, 5).add_done_callback(on_a_str)  # type: ignore[arg-type]


def knows_its_id() -> None:
    """``task_id`` was Any: assigned to anything (a typing hunt)."""
    ctx = mpsched.current_task()
    n: int = ctx.task_id  # type: ignore[assignment]
    key: object = ctx.task_id
    print(n, key, ctx.version + 1)


class MyPool(mpsched.Pool):
    pass


def subclass_enters_as_itself() -> MyPool:
    with MyPool(1) as pool:
        return pool

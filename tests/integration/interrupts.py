"""Ctrl-C at a chosen call: wrappers that raise a real SIGINT in the test's process, once,
right before or right after the wrapped call (as a Ctrl-C at the eval loop's check around
that call), shared by the interrupt tests."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any


def _armed_once() -> Callable[[], bool]:
    """True the first time it is called in the main thread of this process (the zygote and
    the workers forked by ``os.fork`` run the wrappers too, and must not signal)."""
    pid = os.getpid()
    armed = [True]

    def fire() -> bool:
        main = threading.current_thread() is threading.main_thread()
        if armed[0] and main and os.getpid() == pid:
            armed[0] = False
            return True
        return False

    return fire


def sigint_after(real: Callable[..., Any]) -> Callable[..., Any]:
    """``real``, then a SIGINT, once: a Ctrl-C at the check after that call returned."""
    fire = _armed_once()

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        if fire():
            signal.raise_signal(signal.SIGINT)
        return out

    return wrapper


def sigint_before(real: Callable[..., Any]) -> Callable[..., Any]:
    """A SIGINT, once, then ``real``: a Ctrl-C at the check before that call ran."""
    fire = _armed_once()

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if fire():
            signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)

    return wrapper

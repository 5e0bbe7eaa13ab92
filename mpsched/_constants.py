"""Named int constants: the message tags, block and header words and states that the wire
protocol and the shared-memory layout define.

Why not ``enum.IntEnum``: the zygote imports the modules that define them on the start-up path
of every pool, and creating an IntEnum class took ~0.35 ms each here; the seven of them were
~2.7 ms of the zygote's ~11 ms import in a forkserver child (median of 8, measured alternately
with enum's classes replaced by plain ones). A ``Constants`` subclass is a namespace of plain
ints that knows its names, for messages, and its values, to check what came off a socket. A
leaf module: it imports nothing.
"""

from __future__ import annotations

# typing.TYPE_CHECKING without importing typing at run time (why: mpsched/__init__.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import ClassVar


class Constants:
    """Base of a namespace of named ints: every public int class attribute is one."""

    _names: ClassVar[dict[int, str]] = {}

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        members = {n: v for n, v in vars(cls).items() if type(v) is int and n[0] != "_"}
        cls._names = {value: name for name, value in members.items()}
        if len(cls._names) != len(members):  # an enum would make one an alias of the other
            raise TypeError(f"{cls.__name__}: two constants share a value")

    @classmethod
    def name(cls, value: int) -> str:
        """The constant's name (for messages), or a description of a value that is none."""
        return cls._names.get(value, f"<not a {cls.__name__}: {value!r}>")

    @classmethod
    def check(cls, value: int) -> int:
        """``value`` if it is one of the constants; else ValueError, as an enum's lookup."""
        if value not in cls._names:
            raise ValueError(f"{value!r} is not a valid {cls.__name__}")
        return value

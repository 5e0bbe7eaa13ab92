"""ReadyQueue: the coordinator's due tasks that no worker has been handed yet.

Owns the order among due tasks: the highest priority first, then the order in which tasks
became due (FIFO within a priority). Each item carries when it became due (``_due_at``, a
``time.monotonic()`` time): a ``Pool.submit`` at its call; a timed version at its ``run_at``, or
at the call if that had passed (``Timing.schedule``). ``append`` (a submit) puts an item at the
back of its level; ``append_due`` (a timed version that the coordinator moves out of the heap,
some time after it became due) puts it behind the items of its level that became due no later,
so that the submits made meanwhile (the loop's wake-up delay: up to a GIL switch interval while
the caller submits) do not pass it. Within a level the items are in ``_due_at`` order, but for
``putback`` (taken back from inboxes, to the front) and aging promotions (to the back).

One deque per priority level plus a sorted list of the levels present: ``append`` and
``popleft`` are O(1) for the common case of a few levels (``append`` of a new level is O(levels)).
A level emptied by ``take`` or ``age`` is dropped at once, so a quiet pool holds no level.

Called from the coordinator thread and from user threads (``Pool.submit``), always under the
coordinator's lock. Items are futures (``_priority`` is the base priority, ``_due_at`` when the
task became due); a future withdrawn (cancelled) while queued stays in its deque and is skipped
by ``take``, so cancel is O(1); once the withdrawn ones outnumber the live ones (``_compact``),
they are dropped at once (amortized O(1) a cancel).

Membership is written on the future: ``_slot`` is ``QUEUED`` from ``append``/``putback`` until
``take``/``drain`` pops it (then -1), and ``QUEUED_WITHDRAWN`` once the coordinator withdrew it
while queued (``note_withdrawn``). ``_withdrawn_queued`` counts the items marked so, each counted
in when marked and out when popped, so ``live()`` (``statistics().pending``) is O(1) and the
count cannot drift: an item withdrawn without the mark would only count as live until popped.
(A scan of the queue under the coordinator's lock took ~40 ms with 10^6 due tasks queued, a
stall of every submit and dispatch at each poll of a progress display.)

Interrupts: ``append`` runs in the submitting thread, where a Ctrl-C's KeyboardInterrupt is
raised as a call returns. Each insert therefore comes last, after the stores that count the
item in. (Interrupted as ``level.append`` returned, the count missed the item: the queue
counted one item fewer than it held, so the last item queued behind it never went out, and a
map waiting on that chunk hung.) No interrupt can come between the stores and the insert,
because stores are not calls.

Aging (``age``): off unless the pool sets it. A task that has waited ``aging`` seconds since it
became due moves up one level, and one more per further ``aging`` seconds; a promoted task joins
the back of its new level. So strict priority order holds among tasks that became due less than
``aging`` seconds apart, and no task starves behind an endless stream of higher priorities.
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Iterable
from typing import Any

from mpsched._future import Future

# "No level": below every priority. Infinite, as priorities are ints of any size: -2**63
# left a task scheduled below it never taken, and the pool's drain waited for ever (a typing
# and options hunt).
NO_LEVEL = -math.inf
# A future's ``_slot`` while it is in the ready queue (an inbox's index is >= 0, -1 elsewhere;
# every reader of ``_slot`` asks only ``>= 0`` or ``< 0``).
QUEUED = -2
QUEUED_WITHDRAWN = -3  # ... and withdrawn while queued (see the module doc)
_ELSEWHERE = -1


# The ready queue drops its withdrawn items once they outnumber COMPACT_FACTOR times the live
# ones plus COMPACT_SLACK (items): the heap's rebuild bound (``_heap``), for the same reason.
COMPACT_FACTOR = 2
COMPACT_SLACK = 64

# The most levels a wait promotes a task by: a tiny ``aging`` (a subnormal float) made the
# ratio infinite, and int() of it raised OverflowError in the loop, which broke the pool (found
# in review). 2**53: past it, floats no longer tell the steps apart anyway.
MAX_AGED_LEVELS = 2**53


def aged_levels(waited: float, aging: float) -> int:
    """The levels a task that waited ``waited`` seconds has risen by, ``aging`` seconds each."""
    steps = waited / aging
    return int(steps) if steps < MAX_AGED_LEVELS else MAX_AGED_LEVELS


class ReadyQueue:
    __slots__ = ("_levels", "_order", "_withdrawn_queued", "size")

    def __init__(self) -> None:
        self._levels: dict[int, collections.deque[Future[Any]]] = {}
        self._order: list[int] = []  # priorities with a deque, ascending (the last is the top)
        self.size = 0  # items queued, withdrawn ones included until they are popped
        self._withdrawn_queued = 0  # items queued with _slot QUEUED_WITHDRAWN

    def __len__(self) -> int:
        return self.size

    def __bool__(self) -> bool:
        return self.size > 0

    def _level(self, priority: int) -> collections.deque[Future[Any]]:
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = collections.deque()
            bisect.insort(self._order, priority)
        return level

    def append(self, item: Future[Any], priority: int) -> None:
        """Queue ``item``, a live (not withdrawn) due task, behind its level."""
        level = self._levels.get(priority)  # the common case inline: one call per submit
        if level is None:
            level = self._level(priority)
        item._slot = QUEUED  # before the append: see "Interrupts" in the module doc
        self.size += 1
        level.append(item)

    def append_due(self, item: Future[Any], priority: int) -> None:
        """Queue ``item``, a live timed version that came out of the heap, behind the items of
        its level that became due no later than it (module doc)."""
        level = self._levels.get(priority)
        due_at = item._due_at
        passed = 0  # items at the back that became due after it: they go behind it
        for other in reversed(level or ()):
            if other._due_at <= due_at:
                break
            passed += 1
        if level is None or not passed:  # the latest of its level (released on time)
            self.append(item, priority)
            return
        item._slot = QUEUED
        self.size += 1
        level.insert(len(level) - passed, item)

    def putback(
        self, items: Iterable[Future[Any]], now: float = 0.0, aging: float | None = None
    ) -> None:
        """Return ``items`` (in their original order) to the front of their levels: they were
        taken before everything still queued there. With ``aging``, a level is the item's
        aged one at ``now`` (as ``age`` would have made it): taken back from an inbox at its
        base level, a low task that had waited there lost its aging each time a higher one
        came, and a stream of those kept it waiting for ever."""
        for item in reversed(list(items)):
            level = item._priority
            if aging is not None:
                level += aged_levels(now - item._due_at, aging)
            queue = self._level(level)
            if item._withdrawn:
                item._slot = QUEUED_WITHDRAWN
                self._withdrawn_queued += 1
            else:
                item._slot = QUEUED
            self.size += 1
            queue.appendleft(item)

    def note_withdrawn(self, item: Future[Any]) -> None:
        """The coordinator withdrew ``item`` (set ``_withdrawn``): if it is queued here, count
        it out of ``live()`` until ``take`` or ``drain`` pops it, or a compaction drops it."""
        if item._slot == QUEUED:
            item._slot = QUEUED_WITHDRAWN
            withdrawn = self._withdrawn_queued = self._withdrawn_queued + 1
            # withdrawn > COMPACT_FACTOR * live() + COMPACT_SLACK, without the call
            if withdrawn * (COMPACT_FACTOR + 1) > COMPACT_FACTOR * self.size + COMPACT_SLACK:
                self._compact()

    def _compact(self) -> None:
        """Drop the withdrawn items: while no inbox has room (busy workers), nothing pops
        them, and a loop of submits and cancels grew the queue without bound (500,000 cancelled
        futures held, 100 MiB: found by a review). Costs O(size) once per ``live() +
        COMPACT_SLACK`` withdrawals at least: O(1) a cancel, amortized. The dropped items keep
        ``_slot`` QUEUED_WITHDRAWN (read as "not in an inbox" elsewhere; nothing here reads
        it again). The new levels are built first and put in place by stores only, so that a
        Ctrl-C raised in the building leaves the queue as it was."""
        levels = {
            priority: collections.deque(item for item in level if item._slot != QUEUED_WITHDRAWN)
            for priority, level in self._levels.items()
        }
        size = sum(map(len, levels.values()))
        self._levels = levels
        self.size = size
        self._withdrawn_queued = 0

    def bottom_priority(self) -> float:
        """The lowest level with a deque (``NO_LEVEL`` if none); it may be one emptied since,
        which only ``take`` drops (from the top)."""
        return self._order[0] if self._order else NO_LEVEL

    def top_priority(self) -> int | None:
        order = self._order
        while order:
            top = order[-1]
            if self._levels[top]:
                return top
            del self._levels[top]
            order.pop()
        return None

    def take(self, n: int, floor: float = NO_LEVEL) -> tuple[list[Future[Any]], float]:
        """Up to ``n`` live (not withdrawn) items of levels ``floor`` and above, highest
        priority first, and the lowest level they came from (``NO_LEVEL`` if none)."""
        out: list[Future[Any]] = []
        lowest = NO_LEVEL
        levels = self._levels
        while len(out) < n:
            top = self.top_priority()
            if top is None or top < floor:
                break
            level = levels[top]
            while level and len(out) < n:
                item = level.popleft()
                self.size -= 1
                if item._slot == QUEUED_WITHDRAWN:
                    self._withdrawn_queued -= 1
                item._slot = _ELSEWHERE
                if not item._withdrawn:
                    out.append(item)
                    lowest = top
            if not level:  # emptied: dropped now, not at the next take (a quiet pool holds none)
                del levels[top]
                self._order.pop()
        return out, lowest

    def drain(self) -> list[Future[Any]]:
        """Every item, highest priority first; the queue is empty afterwards."""
        out: list[Future[Any]] = []
        for priority in reversed(self._order):
            out.extend(self._levels[priority])
        for item in out:
            item._slot = _ELSEWHERE
        # No call and no loop from here to the return, so no point where the eval loop raises
        # a Ctrl-C's KeyboardInterrupt: the queue is emptied only with the list returned
        # (emptied first, it left the items in no queue and nowhere else when interrupted).
        self._levels = {}
        self._order = []
        self.size = 0
        self._withdrawn_queued = 0
        return out

    def live(self) -> int:
        """Items queued and not withdrawn (``statistics().pending``), in O(1): see the module
        doc."""
        return self.size - self._withdrawn_queued

    def age(self, now: float, aging: float) -> int:
        """Move up the items that waited long enough (module doc); returns how many moved.

        Only level fronts are examined: within a level, items are in the order they became due,
        so a front that has not earned a promotion means that no item behind it has either
        (up to the at most ``aging`` seconds of disorder that promotions to the back add).
        Top level first: items promoted into one level in one pass go there in the order of the
        levels they come from, so a pass that comes late (a busy loop) does not put a lower
        priority ahead of a higher one that became due less than ``aging`` after it (it did,
        walking up from the bottom: found in review)."""
        moved = 0
        for priority in reversed(self._order.copy()):
            level = self._levels.get(priority)
            while level:
                item = level[0]
                target = item._priority + aged_levels(now - item._due_at, aging)
                if target <= priority:
                    break
                level.popleft()
                self._level(target).append(item)
                moved += 1
            if level is not None and not level:
                del self._levels[priority]
                self._order.remove(priority)
        return moved

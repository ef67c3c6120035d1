"""Time sources.

Every store samples ``now`` once per operation, after the aggregate write lock
is held, from the injected :class:`Clock`
(docs/decisions.md#now-is-sampled-once-after-the-lock). Tests use
:class:`SettableClock`; no test sleeps to make time pass
(docs/architecture.md#time).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "SettableClock", "SystemClock"]


@runtime_checkable
class Clock(Protocol):
    """A source of wall-clock time in epoch milliseconds (UTC)."""

    def now_ms(self) -> int:
        """Return the current time in whole milliseconds since the Unix epoch."""
        ...


class SystemClock:
    """The host's wall clock."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000


class SettableClock:
    """A clock that only moves when told to. Thread-safe.

    Args:
        now_ms: the initial time in epoch milliseconds.
    """

    def __init__(self, now_ms: int = 1_700_000_000_000) -> None:
        if now_ms < 0:
            raise ValueError("a clock cannot be set before the epoch")
        self._now = now_ms
        self._lock = threading.Lock()

    def now_ms(self) -> int:
        with self._lock:
            return self._now

    def set(self, now_ms: int) -> None:
        """Set the time to ``now_ms`` (may move backwards, like a stepped clock)."""
        with self._lock:
            self._now = now_ms

    def advance(self, delta_ms: int) -> int:
        """Move the time forward by ``delta_ms`` and return the new time."""
        with self._lock:
            self._now += delta_ms
            return self._now

"""(being written)"""

from __future__ import annotations

from agentkeep.clock import Clock
from agentkeep.db import Driver

__all__ = ["MaintenanceRepository"]


class MaintenanceRepository:
    """(being written)"""

    def __init__(self, driver: Driver, clock: Clock, *, writable: bool) -> None:
        self._db = driver
        self._clock = clock
        self._writable = writable

"""Units of work: one transaction, its connection, and the repositories bound to it.

A write unit (``store.write()``) begins with ``BEGIN IMMEDIATE`` on SQLite and
READ COMMITTED on Postgres; a read unit (``store.read()``) with a deferred
``BEGIN`` (one consistent snapshot for every SELECT in it). The unit commits
when its block exits normally and rolls back when it raises, so an error
raised from a write operation leaves nothing of the unit behind.

``uow.session`` is an ORM :class:`~sqlalchemy.orm.Session` joined to the same
transaction: a host application adds its own ORM rows through it and they
commit (or roll back) atomically with agentkeep's writes. It is created on
first use only; agentkeep's own repositories execute Core statements on
``uow.connection`` and never go through the ORM flush.
"""

from __future__ import annotations

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from agentkeep.clock import Clock
from agentkeep.runs.repository import RunRepository

__all__ = ["UnitOfWork"]


class UnitOfWork:
    """One transaction and the repositories bound to it.

    Attributes:
        connection: the SQLAlchemy connection, inside the unit's transaction.
        clock: the store's clock.
        writable: False for a read unit.
    """

    __slots__ = ("_runs", "_session", "clock", "connection", "writable")

    def __init__(self, connection: Connection, clock: Clock, *, writable: bool) -> None:
        self.connection = connection
        self.clock = clock
        self.writable = writable
        self._session: Session | None = None
        self._runs: RunRepository | None = None

    @property
    def session(self) -> Session:
        """An ORM session joined to this unit's transaction (created on first use).

        ``session.commit()`` inside the block only flushes; the unit commits
        the transaction when the block ends. A rollback of the session rolls
        the whole unit back.
        """
        if self._session is None:
            self._session = Session(
                bind=self.connection,
                join_transaction_mode="rollback_only",
                expire_on_commit=False,
            )
        return self._session

    @property
    def runs(self) -> RunRepository:
        """The run store's operations in this unit."""
        if self._runs is None:
            self._runs = RunRepository(self.connection, self.clock, writable=self.writable)
        return self._runs

    def _flush(self) -> None:
        """Flush the host's ORM changes before the transaction commits."""
        if self._session is not None:
            self._session.commit()
            self._session.close()

    def _discard(self) -> None:
        if self._session is not None:
            self._session.close()

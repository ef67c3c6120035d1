"""Units of work: one transaction and the repositories bound to it.

Two kinds, one set of repositories (so one implementation of every fence):

* :class:`UnitOfWork` (``store.write()`` / ``store.read()``) holds a
  SQLAlchemy :class:`~sqlalchemy.Connection` in its transaction and, on first
  use, an ORM :class:`~sqlalchemy.orm.Session` joined to it: a host
  application adds its own ORM rows through ``uow.session`` and they commit or
  roll back atomically with agentkeep's writes. A unit joined to the host's
  own transaction (``store.write(join=session_or_connection)``) is the same
  class on the host's connection, inside a SAVEPOINT, and never commits.
* :class:`Repositories` alone is the lean unit of a one-call operation
  (``store.runs.get(...)``): a pooled driver connection with its transaction
  opened and closed directly, without building a SQLAlchemy ``Connection``
  (that machinery costs more than the statement on SQLite;
  docs/architecture.md#the-lean-path).

A write unit begins with ``BEGIN IMMEDIATE`` on SQLite and READ COMMITTED on
Postgres (each write operation then takes its aggregate's advisory lock); a
read unit with a deferred ``BEGIN`` on SQLite and ``REPEATABLE READ READ
ONLY`` on Postgres, so every SELECT in it sees one snapshot. A unit commits
when its block exits normally and rolls back when it raises: an error raised
from a write operation leaves nothing of the unit behind.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from agentkeep.clock import Clock
from agentkeep.crypto import PayloadCodec
from agentkeep.db import Driver
from agentkeep.runs.repository import RunRepository
from agentkeep.runtime.domain import ReferenceDomain, RuntimeDomain
from agentkeep.runtime.repository import RuntimeRepository
from agentkeep.sessions.catalog import SessionCatalogRepository
from agentkeep.sessions.checkpoint_nodes import CheckpointNodeRepository
from agentkeep.sessions.commits import SessionCommitRepository
from agentkeep.sessions.leases import SessionLeaseRepository
from agentkeep.sessions.maintenance import MaintenanceRepository
from agentkeep.sessions.queue import QueuedWorkRepository
from agentkeep.sessions.turn_inputs import TurnInputRepository

__all__ = ["Repositories", "UnitOfWork"]


class Repositories:
    """The repositories of one transaction.

    Attributes:
        driver: the driver connection, inside the unit's transaction.
        clock: the store's clock.
        writable: False for a read unit (write operations then raise
            :class:`~agentkeep.errors.ReadOnlyUnitOfWork`).
        runtime_domain: the runtime store's domain rules.
        oauth_codec: the store's encryption at rest of the OAuth flow state (None: none).
        nested: True in a unit that may hold several operations or a
            caller that catches an operation's error (``store.write()``,
            ``store.call_write(fn)``): operations that can fail after writing
            then run in a SAVEPOINT, so a caught error leaves nothing behind
            (``db.atomic``). False in a one-call unit.
    """

    __slots__ = (
        "_catalog",
        "_checkpoint_nodes",
        "_leases",
        "_maintenance",
        "_queue",
        "_runs",
        "_runtime",
        "_commits",
        "_turn_inputs",
        "clock",
        "driver",
        "nested",
        "oauth_codec",
        "runtime_domain",
        "writable",
    )

    def __init__(
        self,
        driver: Driver,
        clock: Clock,
        *,
        writable: bool,
        runtime_domain: RuntimeDomain[Any] | None = None,
        nested: bool = False,
        oauth_codec: PayloadCodec | None = None,
    ) -> None:
        self.driver = driver
        self.clock = clock
        self.writable = writable
        self.runtime_domain: RuntimeDomain[Any] = (
            runtime_domain if runtime_domain is not None else ReferenceDomain()
        )
        self.nested = nested
        self.oauth_codec = oauth_codec
        self._runtime: RuntimeRepository | None = None
        self._runs: RunRepository | None = None
        self._leases: SessionLeaseRepository | None = None
        self._queue: QueuedWorkRepository | None = None
        self._turn_inputs: TurnInputRepository | None = None
        self._commits: SessionCommitRepository | None = None
        self._maintenance: MaintenanceRepository | None = None
        self._catalog: SessionCatalogRepository | None = None
        self._checkpoint_nodes: CheckpointNodeRepository | None = None

    @property
    def runs(self) -> RunRepository:
        """The run store's operations in this unit."""
        if self._runs is None:
            self._runs = RunRepository(
                self.driver, self.clock, writable=self.writable, nested=self.nested
            )
        return self._runs

    @property
    def leases(self) -> SessionLeaseRepository:
        """Session execution leases in this unit."""
        if self._leases is None:
            self._leases = SessionLeaseRepository(
                self.driver, self.clock, writable=self.writable, nested=self.nested
            )
        return self._leases

    @property
    def queue(self) -> QueuedWorkRepository:
        """Queued work of sessions in this unit."""
        if self._queue is None:
            self._queue = QueuedWorkRepository(
                self.driver, self.clock, writable=self.writable, nested=self.nested
            )
        return self._queue

    @property
    def commits(self) -> SessionCommitRepository:
        """Session commits and reads (head, graph, checkpoints, usage) in this unit."""
        if self._commits is None:
            self._commits = SessionCommitRepository(
                self.driver, self.clock, writable=self.writable, nested=self.nested
            )
        return self._commits

    @property
    def maintenance(self) -> MaintenanceRepository:
        """Tombstones, vacuum and blob GC in this unit."""
        if self._maintenance is None:
            self._maintenance = MaintenanceRepository(
                self.driver, self.clock, writable=self.writable, nested=self.nested
            )
        return self._maintenance

    @property
    def catalog(self) -> SessionCatalogRepository:
        """Session enumeration and whole-session deletion in this unit."""
        if self._catalog is None:
            self._catalog = SessionCatalogRepository(
                self.driver, self.clock, writable=self.writable, nested=self.nested
            )
        return self._catalog

    @property
    def checkpoint_nodes(self) -> CheckpointNodeRepository:
        """Checkpoint nodes (opaque bodies on the session graph) and pending writes in this unit."""
        if self._checkpoint_nodes is None:
            self._checkpoint_nodes = CheckpointNodeRepository(
                self.driver, self.clock, writable=self.writable, nested=self.nested
            )
        return self._checkpoint_nodes

    @property
    def runtime(self) -> RuntimeRepository:
        """The runtime store's operations in this unit (snapshots, boundaries, inputs, ...)."""
        if self._runtime is None:
            self._runtime = RuntimeRepository(
                self.driver,
                self.runtime_domain,
                writable=self.writable,
                nested=self.nested,
                oauth_codec=self.oauth_codec,
            )
        return self._runtime

    @property
    def turn_inputs(self) -> TurnInputRepository:
        """Pending turn inputs of sessions in this unit."""
        if self._turn_inputs is None:
            self._turn_inputs = TurnInputRepository(
                self.driver, self.clock, writable=self.writable, nested=self.nested
            )
        return self._turn_inputs


class UnitOfWork(Repositories):
    """A unit of work opened by ``store.write()`` or ``store.read()``.

    Attributes:
        connection: the SQLAlchemy connection, inside the unit's transaction
            (in a joined unit: the host's connection, inside the unit's
            SAVEPOINT).
    """

    __slots__ = ("_own_session", "_session", "connection")

    def __init__(
        self,
        connection: Connection,
        clock: Clock,
        *,
        writable: bool,
        runtime_domain: RuntimeDomain[Any] | None = None,
        driver: Driver | None = None,
        session: Session | None = None,
        oauth_codec: PayloadCodec | None = None,
    ) -> None:
        """Build the unit on ``connection`` (inside its transaction).

        Args:
            driver: the driver connection under ``connection``, built with the
                store's compile target (default: one built from the
                connection's dialect).
            session: the host's own Session, when the unit joined it: then
                ``uow.session`` is that Session and the unit never closes it.
        """
        super().__init__(
            driver if driver is not None else Driver.of(connection),
            clock,
            writable=writable,
            runtime_domain=runtime_domain,
            nested=True,
            oauth_codec=oauth_codec,
        )
        self.connection = connection
        self._session: Session | None = session
        self._own_session = session is None

    @property
    def session(self) -> Session:
        """An ORM session in this unit's transaction.

        In ``store.write()`` / ``store.read()`` it is created on first use,
        joined to the unit's transaction: ``session.commit()`` inside the block
        only flushes; the unit commits when the block ends; a rollback of the
        session rolls the whole unit back. In a unit joined to the host's
        Session it is that Session; joined to the host's Connection, a Session
        on that Connection whose rollback undoes the unit's SAVEPOINT only.
        """
        if self._session is None:
            self._session = Session(
                bind=self.connection,
                join_transaction_mode="rollback_only",
                expire_on_commit=False,
            )
        return self._session

    def _flush(self) -> None:
        """Flush the host's ORM changes before the transaction commits.

        And any write a repository left deferred (:meth:`Driver.defer`; each
        flushes its own before it returns: this only guards the rule).
        """
        self.driver.flush()
        if self._session is not None and self._own_session:
            self._session.commit()
            self._session.close()

    def _discard(self) -> None:
        if self._session is not None and self._own_session:
            self._session.close()

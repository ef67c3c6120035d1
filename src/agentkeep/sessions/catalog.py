"""The session catalog: enumerate sessions (paged, by prefix) and delete a session entirely.

A session has no registry row of its own: it exists while any session table
holds a row under its ``session_id`` (its lease, queued work, turn inputs,
head, graph nodes, usage ledger and its totals, turn commits, attachments,
metadata, pending writes). :meth:`SessionCatalogRepository.list_sessions` enumerates the
distinct ids over all of them; :meth:`SessionCatalogRepository.delete_session`
deletes every row of every session table under one id
(docs/sessions.md#the-session-catalog).

Blobs are content-addressed and shared between sessions, so deleting a
session never deletes a blob: the blobs only it named become unreachable and
the next blob GC (``store.maintenance.gc_unreachable``) collects them.

Statements are :class:`~agentkeep.statements.Statement` constants built from
:mod:`agentkeep.sessions.models`; the table list is :data:`SESSION_TABLES`,
so a new session-keyed table is added in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import bindparam as p
from sqlalchemy import delete, func, literal_column, select, union

from agentkeep.clock import Clock
from agentkeep.db import Driver, atomic
from agentkeep.errors import InvalidInput
from agentkeep.sessions.checkpoint_nodes import _check_str, check_text_id
from agentkeep.sessions.leases import begin_session_write
from agentkeep.sessions.models import (
    AttachmentManifestRow,
    GraphNodeRow,
    PendingTurnInputRow,
    PendingWriteRow,
    QueuedWorkBatchRow,
    RuntimeTurnCommitRow,
    SessionHeadRow,
    SessionLeaseRow,
    SessionMetaRow,
    UsageDeltaRow,
    UsageTotalRow,
)
from agentkeep.statements import Statement

__all__ = ["MAX_PAGE", "SESSION_TABLES", "SessionCatalogRepository", "SessionPage"]

#: Every table keyed by ``session_id`` (queued work items go with their batch:
#: ``ON DELETE CASCADE``). On SQLite the DELETEs run in this order, children
#: before what they hang off; on Postgres they are one statement, whose foreign
#: keys act at its end.
SESSION_TABLES: Final[tuple[type[Any], ...]] = (
    PendingWriteRow,
    GraphNodeRow,
    UsageDeltaRow,
    UsageTotalRow,
    RuntimeTurnCommitRow,
    AttachmentManifestRow,
    QueuedWorkBatchRow,
    PendingTurnInputRow,
    SessionMetaRow,
    SessionHeadRow,
    SessionLeaseRow,
)
#: The largest page :meth:`SessionCatalogRepository.list_sessions` returns.
MAX_PAGE: Final = 1000


def _matching(table: type[Any]) -> Any:
    column = table.session_id
    return select(column.label("session_id")).where(
        column > p("after"), func.substr(column, 1, p("plen")) == p("prefix")
    )


_IDS = union(*(_matching(t) for t in SESSION_TABLES)).subquery("ids")
_LIST: Final = Statement(
    select(_IDS.c.session_id).order_by(_IDS.c.session_id).limit(p("limit")),
    name="catalog.list_sessions",
)
_DELETE: Final = tuple(
    Statement(delete(t).where(t.session_id == p("sid")), name=f"catalog.delete.{t.__tablename__}")
    for t in SESSION_TABLES
)


def _delete_all(dialect: Any) -> Any:
    """Postgres: every DELETE of :data:`_DELETE` as a data-modifying CTE of one SELECT that
    returns the number of rows they deleted (one statement: one round trip on any driver).

    The CTEs all run on the statement's snapshot, taken after the caller's lock;
    the foreign keys (queued work items' ``ON DELETE CASCADE``) act at the end
    of the statement, when every row is gone. A refused DELETE fails the
    statement, and nothing of it is kept. Sent only on Postgres (SQLite has no
    data-modifying CTEs: there the DELETEs run one by one).
    """
    counts = [
        select(func.count())
        .select_from(
            delete(t)
            .where(t.session_id == p("sid"))
            .returning(literal_column("1"))
            .cte(f"deleted_{t.__tablename__}")
        )
        .scalar_subquery()
        for t in SESSION_TABLES
    ]
    total: Any = counts[0]
    for count in counts[1:]:
        total = total + count
    return select(total)


_DELETE_ALL: Final = Statement(_delete_all, name="catalog.delete_all")


@dataclass(frozen=True, slots=True)
class SessionPage:
    """One page of session ids, in ascending order.

    Attributes:
        session_ids: the ids of this page.
        next_after: pass it as ``after`` for the next page; None on the last page.
    """

    session_ids: list[str]
    next_after: str | None


class SessionCatalogRepository:
    """Session enumeration and deletion inside one unit of work (``uow.catalog``)."""

    def __init__(
        self, driver: Driver, clock: Clock, *, writable: bool, nested: bool = True
    ) -> None:
        self._db = driver
        self._clock = clock
        self._writable = writable
        self._nested = nested  # see db.atomic: False in a one-call unit

    def list_sessions(
        self, *, prefix: str = "", after: str | None = None, limit: int = 100
    ) -> SessionPage:
        """The ids of sessions that have any row, ascending, one page at a time.

        See docs/sessions.md#list_sessions.

        Args:
            prefix: only ids starting with it (compared exactly, case-sensitive,
                on both dialects).
            after: only ids after it (the previous page's ``next_after``).
            limit: the page size, 1..:data:`MAX_PAGE`.

        Returns:
            The page; ``next_after`` is None when no id can follow it.

        Raises:
            InvalidInput: ``prefix`` or ``after`` is not UTF-8 text without NUL
                (``after`` blank), or ``limit`` is not an int in range.
        """
        _check_str(prefix, "prefix")
        if after is not None:
            check_text_id(after, "after")
        if type(limit) is not int or not 1 <= limit <= MAX_PAGE:
            raise InvalidInput("limit", f"expected an int in 1..{MAX_PAGE}")
        params = {"after": after or "", "plen": len(prefix), "prefix": prefix, "limit": limit}
        ids = [str(sid) for (sid,) in self._db.execute(_LIST, params).fetchall()]
        return SessionPage(ids, ids[-1] if len(ids) == limit else None)

    def delete_session(self, session_id: str) -> int:
        """Delete every row of every session table under ``session_id``.

        See docs/sessions.md#delete_session.

        Takes the ``session:<id>`` write lock. Deletes, in one transaction,
        the session's pending writes, graph nodes, usage ledger and its
        totals, turn-commit
        records, attachments, queued work (its items by cascade), turn
        inputs, metadata, head and execution lease. A holder of the deleted
        lease fails its next fenced write with
        :class:`~agentkeep.errors.SessionExecutionLeaseExpired`. Blobs are
        not deleted: the ones only this session named are collected by the
        next blob GC. An unknown session deletes nothing. On Postgres the
        DELETEs are one statement (:data:`_DELETE_ALL`: a one-call delete is
        three round trips on every driver, ``BEGIN`` with the lock, the
        statement, ``COMMIT``); a DELETE the server refuses fails the call and
        the transaction keeps nothing of it.

        Returns:
            The number of rows deleted (queued work items not counted).

        Raises:
            InvalidInput: a blank or non-string session id; nothing is written.
            ReadOnlyUnitOfWork: inside ``store.read()``.
        """
        check_text_id(session_id, "session_id")
        db = self._db
        begin_session_write(db, self._clock, self._writable, session_id)
        params = {"sid": session_id}
        with atomic(db, self._nested):
            if db.postgres:  # one statement: one round trip
                return int(db.execute(_DELETE_ALL, params).fetchone()[0])
            # SQLite: the DELETEs one at a time, in this order, in the unit's transaction.
            return sum(int(db.execute(stmt, params).rowcount) for stmt in _DELETE)

"""What every part of the runtime repository shares: the write lock, phase-mapped errors, bytes.

:class:`RuntimeAccess` is one unit of work's access to the runtime tables.
The runtime repository (:class:`~agentkeep.runtime.repository.RuntimeRepository`)
creates one per unit and hands it to each of its parts
(:mod:`~agentkeep.runtime.snapshots`, :mod:`~agentkeep.runtime.boundaries`,
...) and to the shared steps, which are plain functions taking it
(``upsert_snapshot(access, runtime_id, data)``). It holds the unit's driver
connection and the :class:`~agentkeep.runtime.domain.RuntimeDomain`, and
owns the things no part hand-rolls:

* **The write lock** (:meth:`RuntimeAccess.begin_write`): every write
  operation takes the lock of the aggregate it touches first — ``runtime:<id>``,
  ``mob:<id>`` or the OAuth singleton — through
  :func:`agentkeep.db.lock_aggregate` (``BEGIN IMMEDIATE`` already is it on
  SQLite; ``pg_advisory_xact_lock`` on Postgres), so every read-check-write
  after it is race-free, including checks for rows that do not exist yet.
* **Errors by phase** (docs/runtime.md#errors,
  docs/decisions.md#errors-by-phase): a failing SELECT is
  :class:`~agentkeep.runtime.errors.ReadFailed`, a failing INSERT / UPDATE /
  DELETE (constraint violation, trigger abort) is
  :class:`~agentkeep.runtime.errors.WriteFailed`. A busy / lock-timeout error
  stays :class:`~agentkeep.errors.StoreBusy` inside the unit, so the one-call
  facade can retry the whole unit; the facade reports it as ``WriteFailed``
  (writes) or ``ReadFailed`` (reads) once the retries are spent.
* **Fences in SQL** (:meth:`RuntimeAccess.fenced`): a compare-and-set
  compares under the lock, then writes with ``UPDATE`` / ``DELETE ... WHERE``
  the value it compared, and checks the row count. Under the lock the fence
  always matches; a fence that matches nothing is
  :class:`~agentkeep.errors.ConcurrentModification` (a writer bypassed the
  lock: a bug signal, never retried). It is raised as itself — not mapped to
  ``WriteFailed`` — by ``uow.runtime`` and by the one-call facade.
* **Pipelined writes** (:meth:`RuntimeAccess.pipelined`, :meth:`RuntimeAccess.write`):
  inside the block, writes whose result is not needed are deferred and go
  out together, in one round trip, at the block's end or before the next
  statement. On psycopg they are pipelined (:meth:`agentkeep.db.Driver.defer`):
  a failing one is ``WriteFailed`` naming what it wrote, and the ones after
  it do not run. On asyncpg, which does not pipeline, they are merged into
  one statement (:func:`agentkeep.statements.merged_writes`): a failing one
  fails the statement, ``WriteFailed`` naming what the statement wrote, and
  none of its writes is kept. Elsewhere (SQLite, outside the block) each
  runs at once.
* **All or nothing** (:meth:`RuntimeAccess.atomic`): an operation that can
  fail after it has written (a duplicate receipt after the snapshot upsert, a
  trigger abort in the middle of a batch) runs inside a SAVEPOINT when it is
  part of a caller's ``store.write()`` unit, so a caught error leaves nothing
  of it behind; a one-call unit rolls back as a whole and needs none.

Payload columns are read through :func:`as_bytes`: a TEXT value in a payload
column (a SQLite file edited by hand; docs/runtime.md#common-rules) is returned
as its UTF-8 bytes. A fence binds the value as it was read instead
(:func:`stored_form`), so it matches a TEXT row too. The fences themselves live
with their operations (:mod:`~agentkeep.runtime.input_cas`,
:mod:`~agentkeep.runtime.snapshots`, :mod:`~agentkeep.runtime.mob`);
:func:`upsert_replacing` builds the unconditional last-writer-wins upserts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Final

from sqlalchemy.engine import Dialect

from agentkeep.crypto import PayloadCodec
from agentkeep.db import Driver, lock_aggregate
from agentkeep.db import atomic as db_atomic
from agentkeep.errors import (
    ConcurrentModification,
    DatabaseError,
    ReadOnlyUnitOfWork,
    StoreBusy,
)
from agentkeep.runtime.domain import ReferenceDomain, RuntimeDomain
from agentkeep.runtime.errors import ReadFailed, WriteFailed
from agentkeep.statements import (
    MERGED_WRITES_MAX,
    Statement,
    merged_params,
    merged_writes,
    upsert,
)

__all__ = [
    "OAUTH_SINGLETON_ID",
    "RuntimeAccess",
    "as_bytes",
    "payload_bytes",
    "stored_form",
    "upsert_replacing",
]

_NOTHING: Final = nullcontext()  # reusable: a block with nothing to set up

#: ``runtime_auth_oauth_flow_state.id`` of the one OAuth flow row (and its lock key).
OAUTH_SINGLETON_ID: Final = "auth_oauth_flow_state"


def upsert_replacing(
    dialect: Dialect,
    model: type[Any],
    values: Mapping[str, Any],
    *,
    key: Sequence[Any],
    replace: Sequence[str],
) -> Any:
    """``INSERT ... ON CONFLICT (key) DO UPDATE SET col = excluded.col`` for each of ``replace``.

    The last-writer-wins upsert of the runtime's payload rows, built from the
    model (use it inside a :class:`~agentkeep.statements.Statement` builder).
    """
    insert = upsert(dialect, model).values(**values)
    return insert.on_conflict_do_update(
        index_elements=list(key), set_={name: insert.excluded[name] for name in replace}
    )


def stored_form(value: Any) -> Any:
    """A payload as the driver returned it, in a form that binds back to the same value.

    ``memoryview`` (bytea on some drivers) becomes ``bytes``; ``bytes`` and
    ``str`` (a TEXT value in a SQLite BLOB column) stay as they are. A fence
    that compares in SQL binds this, so it matches the row it read, whatever
    the storage class: on SQLite a TEXT value never equals a BLOB parameter.
    """
    return bytes(value) if isinstance(value, memoryview) else value


def as_bytes(value: Any, *, table: str, key: str, column: str) -> bytes:
    """Return a payload column's value as ``bytes`` (see :func:`payload_bytes`).

    ``bytes`` are returned at once (the place is named only in an error).

    Raises:
        ReadFailed: the value is not bytes or text, naming table, key and column.
    """
    if type(value) is bytes:
        return value
    return payload_bytes(value, f"{table}[{key}].{column}")


def payload_bytes(value: Any, what: str) -> bytes:
    """Return a stored payload as ``bytes``.

    ``bytes`` / ``memoryview`` (BLOB, bytea) as is; ``str`` (a TEXT value in
    a SQLite BLOB column) as its UTF-8 bytes.

    Raises:
        ReadFailed: the value is neither (an INTEGER or REAL written by hand,
            or NULL): corrupt data fails loudly, naming ``what``.
    """
    if isinstance(value, bytes):
        return value
    if isinstance(value, memoryview | bytearray):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    raise ReadFailed(f"{what} is a {type(value).__name__}, not a BLOB or TEXT value")


def _answered(queue: list[str]) -> Callable[[Any], None]:
    """The check of a deferred write: it succeeded, so the next queued write is the pending one."""

    def check(_result: Any) -> None:
        if queue:
            del queue[0]

    return check


class RuntimeAccess:
    """One unit of work's access to the runtime tables: driver, domain, lock, statements.

    Attributes:
        db: the unit of work's driver connection, inside its transaction.
        domain: the domain rules (session codec, guards, intents, codecs).
        writable: False inside ``store.read()`` (writes raise ReadOnlyUnitOfWork).
        nested: True inside a caller's ``store.write()`` unit (operations that
            can fail after writing then run in a SAVEPOINT).
        oauth_codec: the store's encryption at rest of the OAuth flow state
            (None: stored as given; :mod:`~agentkeep.runtime.oauth`).
    """

    __slots__ = ("_merge", "_queue", "db", "domain", "nested", "oauth_codec", "writable")

    def __init__(
        self,
        driver: Driver,
        domain: RuntimeDomain[Any] | None = None,
        *,
        writable: bool,
        nested: bool = False,
        oauth_codec: PayloadCodec | None = None,
    ) -> None:
        self.db = driver
        self.domain: RuntimeDomain[Any] = domain if domain is not None else ReferenceDomain()
        self.writable = writable
        self.nested = nested
        self.oauth_codec = oauth_codec
        # Inside pipelined() on psycopg: what each deferred write not yet answered wrote, in order.
        self._queue: list[str] | None = None
        # Inside pipelined() on asyncpg: the writes not yet sent (statement, parameters, what).
        self._merge: list[tuple[Statement, Mapping[str, Any], str]] | None = None

    # -- the write lock ----------------------------------------------------

    def begin_write(self, namespace: int, key: str) -> None:
        """Take the write lock of one aggregate (a :class:`~agentkeep.db.LockNamespace`).

        Raises:
            ReadOnlyUnitOfWork: inside ``store.read()``.
            StoreBusy: the lock was not granted within the lock timeout (Postgres).
            WriteFailed: any other driver failure.
        """
        if not self.writable:
            raise ReadOnlyUnitOfWork("runtime store writes need store.write(), not store.read()")
        try:
            lock_aggregate(self.db, namespace, key)
        except StoreBusy:
            raise
        except DatabaseError as exc:
            raise WriteFailed(f"failed to take the {key} write lock: {exc}") from exc

    def atomic(self) -> AbstractContextManager[None]:
        """All of the block or none of it, also inside a caller's unit (see the module doc).

        A SAVEPOINT only where the unit may hold other work (``db.atomic``).
        In a one-call unit on a driver that does not pipeline (SQLite,
        asyncpg) there is nothing to do: the unit's rollback undoes the block,
        and no write of the driver's is ever deferred, so none has a check to
        run before an error the block raises (:meth:`Driver.deferred_first`).
        """
        if not self.nested and not self.db.pipelines:
            return _NOTHING
        return db_atomic(self.db, self.nested)

    def prefetching(self, reads: Sequence[tuple[Statement, Mapping[str, Any]]]) -> Any:
        """:meth:`Driver.prefetching` of ``reads`` (psycopg); nothing to do elsewhere."""
        return self.db.prefetching(reads) if self.db.pipelines else _NOTHING

    def pipelined(self) -> AbstractContextManager[None]:
        """Defer the block's :meth:`write` / :meth:`write_many` writes; send them at its end.

        On Postgres the writes go out in one round trip: at the end of the
        block, before the block's next statement (:meth:`select`, :meth:`dml`,
        ...), or before an error the block raises (so a failing write comes
        first, as if the writes had run one by one). psycopg pipelines them;
        asyncpg sends them as one statement of data-modifying CTEs
        (:func:`~agentkeep.statements.merged_writes`, at most
        :data:`~agentkeep.statements.MERGED_WRITES_MAX` writes a statement),
        so the block's writes must be independent: no two of them write the
        same row, none depends on another's effect. On SQLite nothing
        changes: each write runs when it is made. Use it inside
        :meth:`atomic` (a failing write rolls the operation back).

        Raises:
            WriteFailed: a deferred write failed (naming what it wrote; on
                asyncpg, what its statement wrote).
            StoreBusy: a busy / lock-timeout error (retryable).
            InvalidInput, PayloadTooLarge: a written value breaks the text
                rule or its limit (on asyncpg when the writes are sent).
        """
        if self._queue is not None or self._merge is not None:  # nested
            return _NOTHING
        if self.db.pipelines:
            return self._pipelined()
        if self.db.postgres:
            return self._merging()
        return _NOTHING

    @contextmanager
    def _pipelined(self) -> Iterator[None]:
        self._queue = []
        try:
            try:
                yield
            except Exception:
                self.flush()
                raise
            self.flush()
        finally:
            self._queue = None

    @contextmanager
    def _merging(self) -> Iterator[None]:
        self._merge = []
        try:
            try:
                yield
            except Exception:
                self.flush()
                raise
            self.flush()
        finally:
            self._merge = None

    def flush(self) -> None:
        """Send the writes deferred in :meth:`pipelined` (nothing queued: nothing sent).

        Raises:
            WriteFailed: one of them failed (naming the first that did not
                succeed; the ones after it did not run), or, on asyncpg, the
                statement they were merged into failed (naming what it
                wrote; none of it was kept).
            StoreBusy: a busy / lock-timeout error (retryable).
            InvalidInput, PayloadTooLarge: as :meth:`Driver.execute`, before
                anything is sent (asyncpg).
        """
        if self._merge:
            self._send_merged()
            return
        queue = self._queue
        if not queue:
            return
        try:
            self.db.flush()
        except StoreBusy:
            raise
        except DatabaseError as exc:
            # Every write answered (the error came after the last one, as psycopg
            # left pipeline mode): name the batch, not a write that succeeded.
            failed = queue[0] if queue else "the deferred writes"
            raise WriteFailed(f"failed to write {failed}: {exc}") from exc
        finally:
            queue.clear()

    def _send_merged(self) -> None:
        """Send the asyncpg queue: one write as it is, several as one merged statement."""
        merge = self._merge
        assert merge
        batch = list(merge)
        merge.clear()
        if len(batch) == 1:
            stmt, params, what = batch[0]
        else:
            stmt = merged_writes([one[0] for one in batch])
            params = merged_params([one[1] for one in batch])
            what = ", ".join(dict.fromkeys(one[2] for one in batch))
        try:
            self.db.execute(stmt, params)
        except StoreBusy:
            raise
        except DatabaseError as exc:
            raise WriteFailed(f"failed to write {what}: {exc}") from exc

    def write(self, stmt: Statement, params: Mapping[str, Any], what: str) -> None:
        """Run an INSERT / UPDATE / DELETE whose result is not needed (no row count, no rows).

        Inside :meth:`pipelined` it is deferred (see there); otherwise it is
        :meth:`dml`.

        Raises:
            WriteFailed: the statement (or an earlier deferred one) failed.
            StoreBusy: a busy / lock-timeout error (retryable).
        """
        merge = self._merge
        if merge is not None:  # asyncpg: sent with the others, merged
            if len(merge) == MERGED_WRITES_MAX:
                self._send_merged()
            merge.append((stmt, params, what))
            return
        queue = self._queue
        if queue is None or not self.db.pipelines:  # nothing is deferred: run it now
            self.dml(stmt, params, what)
            return
        queue.append(what)
        try:
            self.db.defer(stmt, params, _answered(queue))
        except StoreBusy:
            queue.clear()
            raise
        except DatabaseError as exc:  # run at once (SQLite, asyncpg), or an earlier one failed
            failed = queue[0]
            queue.clear()
            raise WriteFailed(f"failed to write {failed}: {exc}") from exc
        except BaseException:
            queue.clear()
            raise

    def write_many(self, stmt: Statement, params: Sequence[Mapping[str, Any]], what: str) -> None:
        """:meth:`write` once per parameter set (:meth:`dml_many` where nothing is deferred).

        Raises:
            WriteFailed: a row failed.
            StoreBusy: a busy / lock-timeout error (retryable).
        """
        if self._merge is None and (self._queue is None or not self.db.pipelines):
            self.dml_many(stmt, params, what, count=False)
            return
        for one in params:
            self.write(stmt, one, what)

    # -- statements, errors by phase -----------------------------------------

    def select(self, stmt: Statement, params: Mapping[str, Any], what: str) -> Any:
        """Run a SELECT; return the cursor.

        Raises:
            ReadFailed: the statement failed (``what`` says what was read).
            StoreBusy: a busy / lock-timeout error (retryable).
        """
        return self._run(stmt, params, ReadFailed, "read", what)

    def dml(self, stmt: Statement, params: Mapping[str, Any], what: str) -> Any:
        """Run an INSERT / UPDATE / DELETE; return the cursor (``rowcount``, ``RETURNING`` rows).

        Raises:
            WriteFailed: the statement failed: a constraint violation, a
                trigger abort (``what`` says what was written).
            StoreBusy: a busy / lock-timeout error (retryable).
        """
        return self._run(stmt, params, WriteFailed, "write", what)

    def fenced(self, stmt: Statement, params: Mapping[str, Any], what: str) -> None:
        """Run an UPDATE / DELETE fenced in SQL on what was read under the lock: one row.

        The statement's WHERE names the row and the value the operation read
        and compared under the write lock, so it changes exactly one row
        unless a writer that bypassed the lock changed it in between.

        Raises:
            ConcurrentModification: the fence matched no row (a bug signal,
                never retried; the caller's savepoint or unit undoes the rest).
            WriteFailed: the statement failed (a trigger abort).
            StoreBusy: a busy / lock-timeout error (retryable).
        """
        if self.dml(stmt, params, what).rowcount != 1:
            raise ConcurrentModification(f"{what} changed under the write lock")

    def dml_many(
        self,
        stmt: Statement,
        params: Sequence[Mapping[str, Any]],
        what: str,
        *,
        count: bool = True,
    ) -> int:
        """Run an INSERT / UPDATE / upsert once per parameter set, in one driver call.

        Args:
            count: False when the row count is not needed (an upsert): on
                asyncpg the batch is then one round trip
                (:meth:`Driver.executemany`), and the result is -1 there.

        Returns:
            The rows changed, summed over the parameter sets (exact for
            UPDATE / DELETE; meaningless for an upsert).

        Raises:
            WriteFailed: a row failed (``what`` says what was written).
            StoreBusy: a busy / lock-timeout error (retryable).
        """
        if self._queue or self._merge:
            self.flush()
        try:
            return self.db.executemany(stmt, params, count=count)
        except StoreBusy:
            raise
        except DatabaseError as exc:
            raise WriteFailed(f"failed to write {what}: {exc}") from exc

    def _run(
        self,
        stmt: Statement,
        params: Mapping[str, Any],
        error: type[ReadFailed] | type[WriteFailed],
        verb: str,
        what: str,
    ) -> Any:
        """Run ``stmt``; a failure is ``error("failed to <verb> <what>: ...")``."""
        if self._queue or self._merge:
            self.flush()
        try:
            return self.db.execute(stmt, params)
        except StoreBusy:
            raise
        except DatabaseError as exc:
            raise error(f"failed to {verb} {what}: {exc}") from exc

    def one_bytes(
        self, stmt: Statement, params: Mapping[str, Any], *, table: str, key: str, column: str
    ) -> bytes | None:
        """Run a one-column, at-most-one-row SELECT of a payload; None when no row."""
        row = self.select(stmt, params, f"{table}[{key}]").fetchone()
        if row is None:
            return None
        return as_bytes(row[0], table=table, key=key, column=column)

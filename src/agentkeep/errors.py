"""The typed error hierarchy of agentkeep.

Every error the package raises derives from :class:`AgentkeepError`. Errors
carry, as attributes, the ids a caller needs to act on them (the run id, the
table and column of a corrupt value, the two revisions of a schema mismatch).

Invariant kept by every store: an error raised from a write operation means
that nothing of that operation was written
(docs/decisions.md#a-typed-error-means-nothing-was-written).

Layout:

* generic families that any store raises: :class:`NotFound`,
  :class:`Duplicate`, :class:`InvalidInput`, :class:`CorruptData`,
  :class:`DatabaseError` (with the retryable :class:`StoreBusy`),
  :class:`ConcurrentModification`;
* schema errors raised when opening or migrating a database:
  :class:`SchemaError` and its subclasses;
* per-store errors, which also derive from their store's base
  (:class:`RunStoreError`, :class:`SessionStoreError`,
  :class:`RuntimeStoreError`), so a caller can catch either "any not-found"
  or "anything from the run store".

Every public error class of the package is defined here, under a name no
other class has; the most caught ones are also importable from ``agentkeep``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from agentkeep import observability

if TYPE_CHECKING:
    from agentkeep.legacy.report import LegacyV0634MigrationReport

__all__ = [
    "AgentkeepError",
    "AssigneeDescRequired",
    "AssigneeGenerationAhead",
    "AssigneeSlotRequired",
    "ClaimSuperseded",
    "CommitOutcomeUnknown",
    "ConcurrentModification",
    "ConnectionLost",
    "CorruptData",
    "DatabaseError",
    "DatabaseMissing",
    "DecryptionFailed",
    "DatabaseUnavailable",
    "Duplicate",
    "GenerationOverflow",
    "GuardRejected",
    "HeadRevisionConflict",
    "IdParseError",
    "InvalidInput",
    "InvalidInputStateBatchCas",
    "JoinedTransactionStale",
    "LegacyMigrationBlocked",
    "LegacySchemaMismatch",
    "MissingDependency",
    "NodeAlreadyExists",
    "NotFound",
    "OpsLifecycleEpochRetired",
    "PayloadTooLarge",
    "PendingTurnInputSourceKeyConflict",
    "QueuedWorkClaimSuperseded",
    "QueuedWorkSourceKeyConflict",
    "ReadFailed",
    "ReadOnlyUnitOfWork",
    "RunCorrupt",
    "RunDuplicate",
    "RunNotFound",
    "RunStoreError",
    "RuntimeInternalError",
    "RuntimeNotFound",
    "RuntimeStoreError",
    "RuntimeTurnCommitConflict",
    "SchemaBehind",
    "SchemaError",
    "SchemaNewer",
    "SessionBindingMismatch",
    "SessionCorrupt",
    "SessionExecutionLeaseExpired",
    "SessionKeyMismatch",
    "SessionLeaseHeld",
    "SessionSnapshotSuperseded",
    "SessionStoreError",
    "StoreBusy",
    "TransactionAborted",
    "TranscriptRevisionConflict",
    "TurnInputClaimSuperseded",
    "TurnInputDuplicate",
    "UnregisterFinalizationOutcomeUnknown",
    "UsageLedgerOverflow",
    "WriteFailed",
]


class AgentkeepError(Exception):
    """Base class of every error raised by agentkeep."""


def _refused(kind: str, error: AgentkeepError) -> None:
    """Log and count a fence or compare-and-set refusal where its error is created.

    Each refusal error is constructed once, at the fence that refused
    (docs/operations.md#logging): this is the one place each kind is recorded.
    """
    observability.refused(kind, "%s", error)


# --------------------------------------------------------------------------
# Generic families


class NotFound(AgentkeepError):
    """The addressed entity does not exist.

    Attributes:
        kind: what was looked for (``"run"``, ``"session"``, ...).
        key: the id that was not found.
    """

    def __init__(self, kind: str, key: str) -> None:
        self.kind = kind
        self.key = key
        super().__init__(f"{kind} not found: {key}")


class Duplicate(AgentkeepError):
    """An entity with the same id already exists.

    Attributes:
        kind: the entity kind.
        key: the duplicated id.
    """

    def __init__(self, kind: str, key: str) -> None:
        self.kind = kind
        self.key = key
        super().__init__(f"{kind} already exists: {key}")


class InvalidInput(AgentkeepError, ValueError):
    """An argument was refused before anything was written.

    Attributes:
        field: the argument (or field of an argument) that was refused.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"invalid {field}: {message}")


class PayloadTooLarge(InvalidInput):
    """A value to write is larger than the store's limit for it (:class:`agentkeep.Limits`).

    Raised before the unit of work commits (it is rolled back: nothing is
    written).

    Attributes:
        field: the column the value was to be written to.
        size: the value's size (characters for an id, else bytes).
        limit: the limit it exceeded.
        unit: ``"characters"`` or ``"bytes"``.
    """

    def __init__(self, field: str, size: int, limit: int, unit: str = "bytes") -> None:
        self.size = size
        self.limit = limit
        self.unit = unit
        super().__init__(field, f"{size} {unit} is over the limit of {limit} {unit}")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.field, self.size, self.limit, self.unit))


class IdParseError(InvalidInput):
    """A prefixed id (``R-…``, ``T-…``, ``ST-…``) did not parse.

    Attributes:
        id_kind: ``"run"``, ``"task"``, ``"step"``, ...
        expected: the required prefix.
        got: the refused text.
    """

    def __init__(self, id_kind: str, expected: str, got: str) -> None:
        self.id_kind = id_kind
        self.expected = expected
        self.got = got
        AgentkeepError.__init__(self, f"invalid {id_kind} id `{got}`: expected `{expected}` prefix")
        self.field = f"{id_kind}_id"


class CorruptData(AgentkeepError):
    """A stored value could not be decoded. Never read as empty or absent.

    Attributes:
        table: the table holding the value.
        key: the primary key of the row.
        column: the column that failed to decode.
        detail: what was wrong with it.
        field: the domain field the column holds (``current`` for
            ``current_json``); the message reads ``decode <field>: …``.
    """

    def __init__(
        self, table: str, key: str, column: str, detail: str, *, field: str | None = None
    ) -> None:
        self.table = table
        self.key = key
        self.column = column
        self.detail = detail
        self.field = field or column
        super().__init__(f"decode {self.field}: {table}.{column} of row {key!r}: {detail}")


class DatabaseError(AgentkeepError):
    """The database refused or failed a statement (driver error, lost connection)."""


class DatabaseMissing(DatabaseError):
    """A command that must not create a database was given a SQLite file that does not exist.

    Raised by the read-only commands (``agentkeep current``, ``check``,
    ``history``/``heads --indicate-current``) and by
    :func:`agentkeep.migrations.downgrade` and
    :func:`~agentkeep.migrations.stamp`: none of them creates the file a
    mistyped path would otherwise leave behind.

    Attributes:
        url: the database URL, password masked.
        path: the file that was looked for.
    """

    def __init__(self, url: str, path: str, command: str = "agentkeep upgrade") -> None:
        self.url = url
        self.path = path
        super().__init__(
            f"{url}: database file {path} does not exist (nothing was created; "
            f"create and migrate it with `{command}`)"
        )


class DatabaseUnavailable(DatabaseError):
    """The database could not be opened or reached; nothing was changed.

    Raised by :meth:`Store.open <agentkeep.Store.open>`, :meth:`AsyncStore.open
    <agentkeep.AsyncStore.open>`, :mod:`agentkeep.migrations` and the
    ``agentkeep`` command instead of the driver's error when a SQLite path is
    a directory, its directory does not exist, the file or its directory is
    read-only (a read-only file system, no permission), the file is not a
    SQLite database; or when the Postgres server refuses the connection (not
    running, unknown database, authentication). The driver's error is chained
    as ``__cause__``.

    Attributes:
        url: the database URL, password masked.
        path: the SQLite file (None for Postgres).
        reason: what is wrong, in words (the message repeats it).
    """

    def __init__(self, url: str, reason: str, path: str | None = None) -> None:
        self.url = url
        self.path = path
        self.reason = reason
        super().__init__(f"{url}: cannot open the database: {reason}")


class StoreBusy(DatabaseError):
    """A transient conflict: the unit of work may be retried as a whole.

    Raised for SQLite ``SQLITE_BUSY`` (database is locked, after the busy
    timeout) and Postgres serialization failure (40001), deadlock (40P01) and
    lock-not-available (55P03). The one-call store methods already retry these
    a bounded number of times before raising.
    """


class JoinedTransactionStale(StoreBusy):
    """SQLite: the host's transaction that a write unit joined cannot become a writer.

    Raised by ``store.write(join=...)`` when the host's transaction was begun
    deferred, has read a snapshot, and another connection has committed a
    write since (``SQLITE_BUSY_SNAPSHOT``): writing on that snapshot could act
    on stale reads, so nothing is written. Retrying the unit alone cannot
    succeed: roll the host's transaction back and run it again (it is a
    :class:`StoreBusy`), or begin the host's transactions ``IMMEDIATE`` so
    that they hold the write lock before they read.
    """


class ConnectionLost(StoreBusy):
    """The connection to the database was lost before the unit's COMMIT was sent.

    The server (or SQLite) discards a transaction whose connection is gone,
    so nothing of the unit was written, and running it again is safe: it is a
    :class:`StoreBusy`. One-call operations retry it on a new connection
    (within the busy timeout); a unit of work (``store.write()``) raises it.
    The dead connection is discarded, never returned to the pool.

    Attributes:
        only_this_connection: True when this one connection became unusable
            while the server is known to be up (it answered the refused
            statement, then the connection could not be rolled back), so the
            pool's other connections are kept; False (the default) for a
            disconnect, after which every connection the pool opened before
            it is replaced, as SQLAlchemy does (a server restart kills them all).
    """

    only_this_connection: bool = False


class CommitOutcomeUnknown(DatabaseError):
    """The COMMIT was sent but its answer was lost: the unit may or may not be applied.

    Raised when the connection breaks while COMMIT is in flight (a killed
    server backend, a network failure), and on SQLite when COMMIT fails and
    the transaction is gone all the same. Running a non-idempotent operation
    again could apply it twice: read back first. The idempotent one-call
    operations resolve it themselves by reading back (run creation, turn
    commits by hash, boundary receipts, enqueues by source key); the others,
    and units of work, raise it. So do the idempotent ones when the attempt
    that was to settle it fails on the database (busy, its connection lost,
    the database unavailable): that failure is its ``__cause__``.

    Attributes:
        operation: the one-call operation (``"runs.acquire_assignee"``),
            ``"unit of work"`` for ``store.write()``, or ``"transaction"``
            where the operation does not name itself.
        arguments: the operation's arguments by name (what identifies the
            write to read it back: the run id, session id, ...); empty for a
            unit of work.
    """

    def __init__(
        self, operation: str, arguments: dict[str, object] | None = None, detail: str = ""
    ) -> None:
        self.operation = operation
        self.arguments: dict[str, object] = dict(arguments or {})
        self.detail = detail
        super().__init__(
            f"{operation}: the outcome of its COMMIT is unknown (the connection was lost "
            f"before the answer arrived); read back before running it again"
            + (f": {detail}" if detail else "")
        )


class TransactionAborted(DatabaseError):
    """A write unit's transaction was already ended by the database: nothing of it was written.

    A statement that failed inside the unit (its error caught by the code in
    the block) leaves a Postgres transaction aborted, and a COMMIT of an
    aborted transaction rolls it back while psycopg and asyncpg report
    success; SQLite rolls the whole transaction back by itself on some errors
    (a trigger's ``RAISE(ROLLBACK, ...)``, a full disk, an I/O error), after
    which COMMIT has nothing to commit. Instead of acknowledging such a unit,
    agentkeep refuses it with this error: none of the unit's writes, those
    before the failed statement included, were stored. Let the error
    propagate (the unit rolls back), or run a statement that may fail in a
    savepoint (``uow.connection.begin_nested()``), whose failure leaves the
    rest of the unit intact.
    """


class ConcurrentModification(DatabaseError):
    """A row fence matched no row although the aggregate write lock was held.

    This is a bug signal (a writer that bypassed the lock), never a normal
    outcome; it is not retried.
    """

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        _refused("concurrent_modification", self)


class MissingDependency(AgentkeepError, ImportError):
    """An optional feature's package is not installed (the message names the extra).

    Also an :class:`ImportError`, so ``except ImportError`` keeps working.

    Attributes:
        package: the missing package (``"cryptography"``).
        extra: the agentkeep extra that installs it (``"crypto"``).
    """

    def __init__(self, feature: str, package: str, extra: str) -> None:
        self.package = package
        self.extra = extra
        super().__init__(f"{feature} needs the {package} package: pip install 'agentkeep[{extra}]'")


class ReadOnlyUnitOfWork(AgentkeepError):
    """A write operation was called inside ``store.read()``; use ``store.write()``."""


# --------------------------------------------------------------------------
# Schema


class SchemaError(AgentkeepError):
    """The database schema cannot be used by this version of agentkeep."""


class SchemaBehind(SchemaError):
    """The database is behind the code's migration head.

    Attributes:
        current: the revisions stamped in the database (empty if un-versioned).
        head: the revisions this code expects.
    """

    def __init__(self, current: Sequence[str], head: Sequence[str], hint: str) -> None:
        self.current = tuple(current)
        self.head = tuple(head)
        cur = ", ".join(self.current) or "none (un-versioned)"
        super().__init__(
            f"database schema is at revision {cur}, code expects {', '.join(self.head)}: {hint}"
        )


class SchemaNewer(SchemaError):
    """The database is stamped with a revision this code does not know.

    Attributes:
        current: the unknown revisions found in the database.
        head: the newest revisions this code knows.
    """

    def __init__(self, current: Sequence[str], head: Sequence[str]) -> None:
        self.current = tuple(current)
        self.head = tuple(head)
        super().__init__(
            f"database revision {', '.join(self.current)} is unknown to this code "
            f"(its head is {', '.join(self.head)}); it was probably written by a newer "
            "agentkeep: upgrade the package, nothing was changed"
        )


class LegacySchemaMismatch(SchemaError):
    """An un-versioned table matches none of the historical shapes.

    Nothing was written: no table, no index, no version stamp.

    Attributes:
        table: the legacy table that was inspected.
        closest: the name of the closest historical shape.
        differences: one line per difference from that shape.
    """

    def __init__(self, table: str, closest: str, differences: Sequence[str]) -> None:
        self.table = table
        self.closest = closest
        self.differences = tuple(differences)
        body = "; ".join(self.differences)
        super().__init__(
            f"un-versioned table {table!r} matches no known shape (closest: {closest}): "
            f"{body}. Nothing was modified."
        )


# --------------------------------------------------------------------------
# Run store (docs/runs.md#errors)


class RunStoreError(AgentkeepError):
    """Base class of every error raised by the run store."""


class RunNotFound(NotFound, RunStoreError):
    """``run not found: {id}``."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        super().__init__("run", run_id)


class RunDuplicate(Duplicate, RunStoreError):
    """``run already exists: {id}``."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        super().__init__("run", run_id)


class AssigneeSlotRequired(InvalidInput, RunStoreError):
    """``assignee slot is required``: the slot name was the empty string."""

    def __init__(self) -> None:
        self.field = "slot"
        AgentkeepError.__init__(self, "assignee slot is required")


class AssigneeDescRequired(InvalidInput, RunStoreError):
    """``assignee desc is required``: empty or White_Space-only desc (A9)."""

    def __init__(self) -> None:
        self.field = "desc"
        AgentkeepError.__init__(self, "assignee desc is required")


class AssigneeGenerationAhead(InvalidInput, RunStoreError):
    """A holder given to ``create`` carries a generation above the run's counter
    (rule A2, docs/runs.md#the-assignment-model).

    Attributes:
        slot: the first offending slot, in sorted order.
        gen: its generation.
        next_generation: the run's counter.
    """

    def __init__(self, slot: str, gen: int, next_generation: int) -> None:
        self.slot = slot
        self.gen = gen
        self.next_generation = next_generation
        self.field = "current"
        AgentkeepError.__init__(
            self,
            "assignee generation is ahead of the run's counter: "
            f"current['{slot}'].gen = {gen} > next_generation = {next_generation}",
        )


class RunCorrupt(CorruptData, RunStoreError):
    """A column of a ``runs`` row failed to decode (``decode <column>: …``)."""


class GenerationOverflow(RunStoreError):
    """The run's generation counter is at 2**63-1 and cannot advance (never wraps).

    Attributes:
        run_id: the run.
        next_generation: its counter.
    """

    def __init__(self, run_id: str, next_generation: int) -> None:
        self.run_id = run_id
        self.next_generation = next_generation
        super().__init__(
            f"run {run_id}: next_generation {next_generation} cannot advance past 2**63-1"
        )


# --------------------------------------------------------------------------
# Session store (docs/sessions.md#errors)


class SessionStoreError(AgentkeepError):
    """Base class of every error raised by the session store."""


class SessionExecutionLeaseExpired(SessionStoreError):
    """The presented fence is not the live lease of the session.

    The check is FENCE_OK (docs/sessions.md#named-predicates).

    Raised when the fence names another session, no lease row exists, the
    owner, token or generation differ, or the lease has expired. Nothing was
    written; the caller has lost the session and must stop working on it.

    Attributes:
        session_id: the session.
    """

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        super().__init__(f"session execution lease expired or superseded: {session_id}")
        _refused("lease_fence", self)


class SessionLeaseHeld(SessionStoreError):
    """Another owner holds the live execution lease of the session; nothing was written.

    Raised by writes guarded by a session's lease
    (:func:`agentkeep.sessions.leases.guard_session_write`, the checkpoint
    node and pending-write operations) when the caller presents no fence while
    a live lease is held, and by ``AgentkeepSaver.owning`` when the thread is
    owned by someone else. The holder's lease ends by release or by expiry
    (docs/sessions.md#execution-leases); retry after that.

    Attributes:
        session_id: the session whose lease is held.
        owner_id: the holder's owner id.
        expires_at_epoch_ms: when the holder's lease expires unless renewed.
    """

    def __init__(self, session_id: str, owner_id: str, expires_at_epoch_ms: int) -> None:
        self.session_id = session_id
        self.owner_id = owner_id
        self.expires_at_epoch_ms = expires_at_epoch_ms
        super().__init__(
            f"session {session_id} is owned by {owner_id!r} "
            f"(lease expires at {expires_at_epoch_ms} ms)"
        )


class ClaimSuperseded(SessionStoreError):
    """A completion does not name exactly the rows its claim still owns.

    Raised by the strict completion checks
    (docs/decisions.md#strict-claim-completion): the claim was re-claimed,
    abandoned or cancelled, or the completion lists other rows.

    Attributes:
        session_id: the session.
        claim_id: the claim.
    """

    _what = "claim"

    def __init__(self, session_id: str, claim_id: str) -> None:
        self.session_id = session_id
        self.claim_id = claim_id
        super().__init__(f"{self._what} superseded: {session_id} {claim_id}")
        _refused("claim_superseded", self)


class QueuedWorkClaimSuperseded(ClaimSuperseded):
    """A queued-work completion does not name exactly the rows its claim still owns."""

    _what = "queued-work claim"


class TurnInputClaimSuperseded(ClaimSuperseded):
    """A turn-input completion does not name exactly the rows its claim still owns."""

    _what = "turn-input claim"


class PendingTurnInputSourceKeyConflict(SessionStoreError):
    """A turn input with this source key exists with different content.

    Attributes:
        session_id: the session.
        source_key: the idempotency key.
        existing_input_id: the input already stored under it.
    """

    def __init__(self, session_id: str, source_key: str, existing_input_id: str) -> None:
        self.session_id = session_id
        self.source_key = source_key
        self.existing_input_id = existing_input_id
        super().__init__(
            f"turn input source key {source_key!r} of session {session_id} is already used "
            f"by {existing_input_id} with different content"
        )


class QueuedWorkSourceKeyConflict(SessionStoreError):
    """A queued batch with this source key exists with different content.

    Attributes:
        session_id: the session.
        source_key: the idempotency key.
        existing_batch_id: the batch already stored under it.
    """

    def __init__(self, session_id: str, source_key: str, existing_batch_id: str) -> None:
        self.session_id = session_id
        self.source_key = source_key
        self.existing_batch_id = existing_batch_id
        super().__init__(
            f"queued-work source key {source_key!r} of session {session_id} is already used "
            f"by {existing_batch_id} with different content"
        )


class TurnInputDuplicate(Duplicate, SessionStoreError):
    """A turn input with this explicit ``input_id`` already exists (in any session)."""

    def __init__(self, input_id: str) -> None:
        self.input_id = input_id
        super().__init__("turn input", input_id)


class SessionCorrupt(CorruptData, SessionStoreError):
    """A stored session-store value failed to decode (``decode <column>: …``)."""


class SessionBindingMismatch(SessionStoreError):
    """A commit carries something (an enqueued batch) for another session.

    Attributes:
        bound_session_id: the commit's session.
        attempted_session_id: the other session.
    """

    def __init__(self, bound_session_id: str, attempted_session_id: str) -> None:
        self.bound_session_id = bound_session_id
        self.attempted_session_id = attempted_session_id
        super().__init__(
            f"session binding mismatch: commit for {bound_session_id} carries "
            f"work for {attempted_session_id}"
        )


class UsageLedgerOverflow(InvalidInput, SessionStoreError):
    """A commit's usage deltas would take a merged token-ledger counter past ``2**63-1``.

    Refused (the commit writes nothing) so that the ledger stays exact and
    every later ``load_session`` can return it
    (docs/decisions.md#a-ledger-counter-never-passes-2-63-1).

    Attributes:
        session_id: the session.
        source: the ledger entry's source.
        model: the ledger entry's model.
        counter: the counter (``input_tokens``, ...).
    """

    def __init__(self, session_id: str, source: str, model: str, counter: str) -> None:
        self.session_id = session_id
        self.source = source
        self.model = model
        self.counter = counter
        super().__init__(
            "commit.usage_deltas",
            f"session {session_id!r}: the merged {counter} of ({source!r}, {model!r}) "
            "would exceed 2**63-1",
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.session_id, self.source, self.model, self.counter))


class RuntimeTurnCommitConflict(SessionStoreError):
    """The turn was already committed with a different hash (or the stamp names another session).

    Attributes:
        session_id: the stamp's session.
        turn_id: the turn.
    """

    def __init__(self, session_id: str, turn_id: str) -> None:
        self.session_id = session_id
        self.turn_id = turn_id
        super().__init__(f"turn {turn_id} of session {session_id} was committed differently")
        _refused("turn_commit", self)


class NodeAlreadyExists(Duplicate, SessionStoreError):
    """A commit inserts a graph node whose id the session already has (or twice).

    The original store surfaced the unique violation as a backend error;
    this store raises this typed error instead. Nothing of the commit
    persists.

    Attributes:
        session_id: the session.
        node_id: the duplicated node id.
    """

    def __init__(self, session_id: str, node_id: str) -> None:
        self.session_id = session_id
        self.node_id = node_id
        super().__init__("graph node", f"{session_id}/{node_id}")


class HeadRevisionConflict(SessionStoreError):
    """The session head is not at the expected revision (another commit won).

    Attributes:
        session_id: the session.
        expected: the revision the commit expected.
        actual: the revision found.
    """

    def __init__(self, session_id: str, expected: int | None, actual: int) -> None:
        self.session_id = session_id
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"head revision conflict on {session_id}: expected {expected}, found {actual}"
        )
        _refused("head_revision", self)


# --------------------------------------------------------------------------
# The runtime store
#
# Each class keeps the rendered text of the original store's variant
# (``Store write failed: {msg}``, ...) so that ``str(error)`` contains the
# inner message verbatim, and carries the ids a caller needs as attributes.
# GuardRejected is the one error the domain layer adds: a save-guard
# rejection. It is a WriteFailed, because the store reports every guard
# rejection as one; the boundary writers catch it where a rejection is a
# verdict (the supersession check) rather than a failure.


class RuntimeStoreError(AgentkeepError):
    """Base class of every error raised by the runtime store and its domain layer."""


class WriteFailed(RuntimeStoreError):
    """``Store write failed: {message}``; nothing of the operation was written.

    Raised for open/DDL/BEGIN/COMMIT/DML failures (constraint violations,
    trigger aborts), encode failures, a caller-supplied session that does not
    decode, save-guard rejections, compaction-outbox conflicts and the
    synthetic faults of unregister finalization.

    Attributes:
        message: the inner message.
    """

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(f"Store write failed: {message}")


class ReadFailed(RuntimeStoreError):
    """``Store read failed: {message}``.

    Raised for SELECT failures and for persisted rows that do not decode
    (fail-closed: a legacy, unversioned or corrupt row is never read as
    absent), and by the legacy migrator when it refuses to run.

    Attributes:
        message: the inner message.
    """

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(f"Store read failed: {message}")


class DecryptionFailed(ReadFailed):
    """A stored value that should be encrypted could not be decrypted; nothing was returned.

    Fail-closed (docs/runtime.md#oauth-flow-state): raised when reading the
    OAuth flow state (``load_auth_oauth_flow_snapshot``, and
    ``update_auth_oauth_flow_snapshot`` before it calls its callback, so
    nothing is written) when the store's ``oauth_codec`` refuses the stored
    value: a wrong key, a tampered or truncated value, or plain text stored
    before the codec was configured. Also raised when a store opened without
    a codec finds a value in :class:`~agentkeep.crypto.AesGcmCodec`'s format
    (the store was opened without its key), and by that codec's ``decode``
    on its own. Never read as absent, never returned as plain text.

    Attributes:
        what: the value (``table[key].column``; ``"payload"`` from a codec on its own).
        reason: why it could not be decrypted.
    """

    def __init__(self, what: str, reason: str) -> None:
        self.what = what
        self.reason = reason
        super().__init__(f"cannot decrypt {what}: {reason}")


class RuntimeNotFound(NotFound, RuntimeStoreError):
    """``Not found: {kind} {key}``.

    Raised by ``mark_compaction_projection_finalized`` when the outbox has no
    row at the projection's key (``kind`` is ``"compaction outbox rewrite"``,
    ``key`` the rewrite's revision).

    Attributes:
        kind: what was looked for.
        key: the id that was not found.
    """

    def __init__(self, kind: str, key: str) -> None:
        self.kind = kind
        self.key = key
        AgentkeepError.__init__(self, f"Not found: {kind} {key}")


class SessionKeyMismatch(RuntimeStoreError):
    """The snapshot's session id is not the session store key the caller supplied.

    Raised by ``atomic_apply*`` before any database access.

    Attributes:
        expected: the supplied session store key.
        actual: the session id carried by the snapshot.
    """

    def __init__(self, expected: str, actual: str) -> None:
        self.expected = expected
        self.actual = actual
        super().__init__(f"Session store key mismatch: expected {expected}, actual {actual}")


class SessionSnapshotSuperseded(RuntimeStoreError):
    """The durable head is a valid successor of the incoming snapshot.

    Raised by ``atomic_apply*`` when the forward save guard rejects the
    incoming snapshot and the reverse guard accepts the stored one; the
    receipt, outbox intents and input states of the boundary are not written.

    Attributes:
        runtime_id: the runtime.
    """

    def __init__(self, runtime_id: str) -> None:
        self.runtime_id = runtime_id
        super().__init__(
            f"Session snapshot for runtime '{runtime_id}' was superseded by the durable head"
        )
        _refused("snapshot_superseded", self)


class TranscriptRevisionConflict(RuntimeStoreError):
    """A transcript rewrite names a parent revision that is not the persisted one.

    Raised by the transcript-rewrite guard and so by
    ``commit_session_transcript_rewrite_snapshot``.

    Attributes:
        expected: the rewrite commit's parent revision.
        actual: the persisted session's revision.
    """

    def __init__(self, expected: str, actual: str) -> None:
        self.expected = expected
        self.actual = actual
        super().__init__(f"Transcript revision conflict: expected {expected}, actual {actual}")
        _refused("transcript_revision", self)


class OpsLifecycleEpochRetired(RuntimeStoreError):
    """An ops-lifecycle snapshot belongs to an epoch retired by unregister finalization.

    Raised by ``persist_ops_lifecycle`` and ``initialize_ops_lifecycle_if_absent``.

    Attributes:
        runtime_id: the runtime.
        epoch_id: the retired epoch.
    """

    def __init__(self, runtime_id: str, epoch_id: str) -> None:
        self.runtime_id = runtime_id
        self.epoch_id = epoch_id
        super().__init__(f"Ops lifecycle epoch {epoch_id} for runtime {runtime_id} is retired")
        _refused("ops_epoch_retired", self)


class UnregisterFinalizationOutcomeUnknown(RuntimeStoreError):
    """The COMMIT of an unregister finalization was not acknowledged and the re-read is ambiguous.

    Callers must retry the (idempotent) finalization and must never publish a
    compensating lifecycle rollback on this error.

    Attributes:
        message: the inner message.
    """

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(f"Unregister finalization outcome is unknown: {message}")


class RuntimeInternalError(RuntimeStoreError):
    """``Internal error: {message}``: a worker join failure or a migrator recovery failure.

    Attributes:
        message: the inner message.
    """

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(f"Internal error: {message}")


class InvalidInputStateBatchCas(InvalidInput, RuntimeStoreError):
    """The input-state batch compare-and-swap has an invalid shape .

    Raised before any database access when the expected and replacement
    lists differ in length, exceed ``MAX_INPUT_STATE_BATCH_CAS`` rows, repeat
    an input id, or name different input ids.

    Attributes:
        reason: what was wrong with the batch.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.field = "input_state_batch"
        AgentkeepError.__init__(self, f"Invalid input-state batch compare-and-swap: {reason}")


class GuardRejected(WriteFailed):
    """A save guard refused a session snapshot.

    Attributes:
        rule: ``"monotonicity"`` (the incoming transcript is shorter than the
            stored one), ``"continuity"`` (it does not continue the stored
            one), ``"coherence"`` (its history does not match its live
            transcript) or ``"rewrite"`` (a transcript rewrite is invalid).
        detail: what failed.
    """

    def __init__(self, rule: str, detail: str) -> None:
        self.rule = rule
        self.detail = detail
        super().__init__(f"transcript {rule} violation: {detail}")


class LegacyMigrationBlocked(ReadFailed):
    """An apply refused because at least one runtime is Blocked; nothing was written.

    The text is ``legacy migration blocked for runtime(s): A, B`` (ids joined
    by ", " in runtime id order); it is a ReadFailed, as in the original store.

    Attributes:
        runtime_ids: the blocked runtimes, in runtime id order.
        report: the preflight report (``applied`` False) that blocked the apply,
            with the detail of every Blocked item.
    """

    def __init__(self, report: LegacyV0634MigrationReport) -> None:
        self.report = report
        self.runtime_ids = report.blocked_runtime_ids()
        super().__init__(f"legacy migration blocked for runtime(s): {', '.join(self.runtime_ids)}")

"""Mob host bindings and revocation receipts (docs/runtime.md#mob-host-bindings).

Both tables are global (keyed by mob id, not runtime-scoped) and hold opaque
bytes. Every write takes the ``mob:<id>`` write lock first (``BEGIN
IMMEDIATE`` on SQLite, the mob's advisory lock on Postgres).

What lives here: the statements of both tables, the repository part
:class:`MobHostOps` (``uow.runtime.mob_hosts``), its one-call forms, and the
binding fences (:func:`replace_binding_if_stored`,
:func:`delete_binding_if_stored`, below).

Fences and outcomes:

* :meth:`MobHostOps.put_mob_host_binding_if_absent` inserts a binding only if
  the mob has none (True), and then deletes the mob's revocation receipt in
  the same transaction: a fresh binding supersedes the previous controller's
  revoke, so a delayed old revoke can never replay across the replacement.
  An existing binding: False, nothing written.
* :meth:`~MobHostOps.compare_and_put_mob_host_binding` and
  :meth:`~MobHostOps.delete_mob_host_binding` replace / delete the binding
  only if it holds exactly ``expected`` (True); an absent or different
  binding: False, nothing written. Delete writes no receipt.
* :meth:`~MobHostOps.revoke_mob_host_binding` deletes the binding if it holds
  exactly ``expected`` and stores the revocation receipt (replacing an older
  one) in the same transaction (True); otherwise False with nothing written.

Through these operations a mob never has both a binding and a receipt.

**TEXT-vs-BLOB: normalised** (docs/decisions.md#text-payloads-in-compare-and-set).
The original store compares the binding in SQL (``record_json = ?`` with a BLOB
parameter), which on SQLite never matches a value stored as TEXT (a file edited
by hand), so a compare-and-put on such a row would return False although its
bytes match. This port compares in application code instead: under the write
lock it reads the stored value, normalises it with
:func:`~agentkeep.runtime.access.as_bytes` (TEXT → its UTF-8 bytes) and
compares that with ``expected``; absent or different: False, nothing written.

**The fence** (:func:`replace_binding_if_stored`,
:func:`delete_binding_if_stored`): the write is fenced in SQL on the value
actually stored (``UPDATE`` / ``DELETE ... WHERE mob_id = :id AND
record_json = :stored``, bound as read, ``str`` or ``bytes``), so it matches
that row and nothing else; a TEXT-degraded row with matching text is
therefore replaced (rewritten as a BLOB), deleted or revoked like any other.
Under the lock the fence always matches one row. If it matches none (only a
writer that bypasses the lock can cause that) the call raises
:class:`~agentkeep.errors.ConcurrentModification` — a bug signal, not an
outcome — and nothing of it stays written. On Postgres (``bytea``) the two
comparisons are the same. :meth:`~MobHostOps.put_mob_host_binding_if_absent`
needs no compare: its ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` is its
fence, and "no row inserted" is its normal False.

Payloads must be ``bytes`` (``bytearray`` / ``memoryview`` are copied): a
``str`` would be stored as TEXT on SQLite. Anything else is
:class:`~agentkeep.errors.InvalidInput` before the database is touched.
"""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import bindparam as p
from sqlalchemy import delete, select, update

from agentkeep.arguments import check_methods
from agentkeep.db import LockNamespace
from agentkeep.errors import InvalidInput
from agentkeep.one_call import read
from agentkeep.runtime.access import RuntimeAccess, as_bytes, stored_form, upsert_replacing
from agentkeep.runtime.calls import RuntimeCallsBase
from agentkeep.runtime.models import MobHostBindingRow as Binding
from agentkeep.runtime.models import MobHostRevocationRow as Revocation
from agentkeep.statements import Statement, upsert

__all__ = [
    "MobHostCalls",
    "MobHostOps",
    "check_mob_id",
    "check_payload",
    "delete_binding_if_stored",
    "replace_binding_if_stored",
    "stored_binding",
]

_BINDINGS: Final = Binding.__tablename__
_REVOCATIONS: Final = Revocation.__tablename__

_BINDING_OF = Binding.mob_id == p("id")
_REVOCATION_OF = Revocation.mob_id == p("id")

_LOAD_BINDING: Final = Statement(
    select(Binding.record_json).where(_BINDING_OF), name="runtime.mob.binding.get"
)
_LIST_BINDINGS: Final = Statement(
    select(Binding.mob_id, Binding.record_json).order_by(Binding.mob_id),
    name="runtime.mob.binding.list",
)
_INSERT_BINDING: Final = Statement(
    lambda d: (
        upsert(d, Binding)
        .values(mob_id=p("id"), record_json=p("record"))
        .on_conflict_do_nothing(index_elements=[Binding.mob_id])
        .returning(Binding.mob_id)
    ),
    name="runtime.mob.binding.insert_if_absent",
)
_REPLACE_BINDING: Final = Statement(
    update(Binding)
    .values(record_json=p("next"))
    .where(_BINDING_OF, Binding.record_json == p("stored")),
    name="runtime.mob.binding.replace_if",
)
_DELETE_BINDING: Final = Statement(
    delete(Binding).where(_BINDING_OF, Binding.record_json == p("stored")),
    name="runtime.mob.binding.delete_if",
)
_LOAD_REVOCATION: Final = Statement(
    select(Revocation.receipt_json).where(_REVOCATION_OF), name="runtime.mob.revocation.get"
)
_LIST_REVOCATIONS: Final = Statement(
    select(Revocation.mob_id, Revocation.receipt_json).order_by(Revocation.mob_id),
    name="runtime.mob.revocation.list",
)
_UPSERT_REVOCATION: Final = Statement(
    lambda d: upsert_replacing(
        d,
        Revocation,
        {"mob_id": p("id"), "receipt_json": p("receipt")},
        key=[Revocation.mob_id],
        replace=["receipt_json"],
    ),
    name="runtime.mob.revocation.upsert",
)
_DELETE_REVOCATION: Final = Statement(
    delete(Revocation).where(_REVOCATION_OF), name="runtime.mob.revocation.delete"
)


def check_payload(value: Any, field: str) -> bytes:
    """Return an opaque payload as ``bytes``.

    Raises:
        InvalidInput: ``value`` is not ``bytes`` / ``bytearray`` / ``memoryview``.
    """
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise InvalidInput(field, f"must be bytes, got {type(value).__name__}")


def check_mob_id(mob_id: Any) -> str:
    """Return ``mob_id`` if it is a string (any string is a mob id).

    Raises:
        InvalidInput: ``mob_id`` is not a ``str``.
    """
    if not isinstance(mob_id, str):
        raise InvalidInput("mob_id", f"must be a str, got {type(mob_id).__name__}")
    return mob_id


def stored_binding(access: RuntimeAccess, mob_id: str) -> Any:
    """The mob's binding exactly as stored (bytes, or str for a TEXT-degraded row), or None.

    Raises:
        ReadFailed: the SELECT failed.
    """
    row = access.select(_LOAD_BINDING, {"id": mob_id}, f"{_BINDINGS}[{mob_id}]").fetchone()
    return None if row is None else stored_form(row[0])


def _binding_if(access: RuntimeAccess, mob_id: str, expected: bytes) -> Any:
    """The binding as stored if its bytes (TEXT as UTF-8) equal ``expected``, else None."""
    stored = stored_binding(access, mob_id)
    if stored is None:
        return None
    if as_bytes(stored, table=_BINDINGS, key=mob_id, column="record_json") != expected:
        return None
    return stored


def replace_binding_if_stored(
    access: RuntimeAccess, mob_id: str, stored: Any, next_record: bytes
) -> None:
    """The fence of compare-and-put: write ``next_record`` iff the binding still is ``stored``.

    Raises:
        ConcurrentModification: the binding no longer holds ``stored``.
        WriteFailed: the UPDATE failed.
    """
    access.fenced(
        _REPLACE_BINDING,
        {"id": mob_id, "next": next_record, "stored": stored},
        f"{_BINDINGS}[{mob_id}]",
    )


def delete_binding_if_stored(access: RuntimeAccess, mob_id: str, stored: Any) -> None:
    """The fence of delete and revoke: delete the binding iff it still is ``stored``.

    Raises:
        ConcurrentModification: the binding no longer holds ``stored``.
        WriteFailed: the DELETE failed.
    """
    access.fenced(_DELETE_BINDING, {"id": mob_id, "stored": stored}, f"{_BINDINGS}[{mob_id}]")


@check_methods
class MobHostOps:
    """Repository part (``uow.runtime.mob_hosts``): mob host bindings and revocation receipts."""

    __slots__ = ("_access",)

    def __init__(self, access: RuntimeAccess) -> None:
        self._access = access

    # -- reads -------------------------------------------------------------

    def load_mob_host_binding(self, mob_id: str) -> bytes | None:
        """Load a mob's binding record (a TEXT value as its UTF-8 bytes), or None.

        Raises:
            InvalidInput: ``mob_id`` is not a ``str``.
            ReadFailed: the SELECT failed, or the value is not bytes/text.
        """
        check_mob_id(mob_id)
        return self._access.one_bytes(
            _LOAD_BINDING, {"id": mob_id}, table=_BINDINGS, key=mob_id, column="record_json"
        )

    def list_mob_host_bindings(self) -> list[tuple[str, bytes]]:
        """Every ``(mob_id, record)``, ordered by mob id (byte order).

        Raises:
            ReadFailed: the SELECT failed, or a value is not bytes/text.
        """
        return self._list(_LIST_BINDINGS, _BINDINGS, "record_json")

    def load_mob_host_revocation(self, mob_id: str) -> bytes | None:
        """Load a mob's last revocation receipt, or None.

        Raises:
            InvalidInput: ``mob_id`` is not a ``str``.
            ReadFailed: the SELECT failed, or the value is not bytes/text.
        """
        check_mob_id(mob_id)
        return self._access.one_bytes(
            _LOAD_REVOCATION, {"id": mob_id}, table=_REVOCATIONS, key=mob_id, column="receipt_json"
        )

    def list_mob_host_revocations(self) -> list[tuple[str, bytes]]:
        """Every ``(mob_id, receipt)``, ordered by mob id (byte order).

        Raises:
            ReadFailed: the SELECT failed, or a value is not bytes/text.
        """
        return self._list(_LIST_REVOCATIONS, _REVOCATIONS, "receipt_json")

    def _list(self, stmt: Statement, table: str, column: str) -> list[tuple[str, bytes]]:
        rows = self._access.select(stmt, {}, table).fetchall()
        return [
            (mob_id, as_bytes(value, table=table, key=mob_id, column=column))
            for mob_id, value in rows
        ]

    # -- writes ------------------------------------------------------------

    def put_mob_host_binding_if_absent(self, mob_id: str, record: bytes) -> bool:
        """Insert the mob's binding if it has none; a new binding removes the revocation.

        Returns:
            True if inserted (the revocation receipt, if any, is deleted in
            the same transaction); False if a binding exists (nothing written).

        Raises:
            InvalidInput: ``mob_id`` is not a ``str`` or ``record`` not bytes.
            WriteFailed: a statement failed (nothing stays written).
        """
        check_mob_id(mob_id)
        record = check_payload(record, "record")
        self._access.begin_write(LockNamespace.MOB, mob_id)
        with self._access.atomic():
            inserted = self._access.dml(
                _INSERT_BINDING, {"id": mob_id, "record": record}, f"{_BINDINGS}[{mob_id}]"
            ).fetchone()
            if inserted is None:
                return False
            self._access.dml(_DELETE_REVOCATION, {"id": mob_id}, f"{_REVOCATIONS}[{mob_id}]")
        return True

    def compare_and_put_mob_host_binding(
        self, mob_id: str, expected: bytes, next_record: bytes
    ) -> bool:
        """Replace the mob's binding with ``next_record`` iff it holds exactly ``expected``.

        Returns:
            True if replaced; False if the binding is absent or differs
            (nothing written).

        Raises:
            InvalidInput: ``mob_id`` is not a ``str`` or a record not bytes.
            ReadFailed: the binding could not be read.
            WriteFailed: the UPDATE failed.
            ConcurrentModification: the binding changed between its locked
                read and the fenced UPDATE (a writer bypassed the lock).
        """
        check_mob_id(mob_id)
        expected = check_payload(expected, "expected")
        next_record = check_payload(next_record, "next_record")
        access = self._access
        access.begin_write(LockNamespace.MOB, mob_id)
        stored = _binding_if(access, mob_id, expected)
        if stored is None:
            return False
        replace_binding_if_stored(access, mob_id, stored, next_record)
        return True

    def delete_mob_host_binding(self, mob_id: str, expected: bytes) -> bool:
        """Delete the mob's binding iff it holds exactly ``expected`` (no receipt is written).

        Returns:
            True if deleted; False if the binding is absent or differs
            (nothing written).

        Raises:
            InvalidInput: ``mob_id`` is not a ``str`` or ``expected`` not bytes.
            ReadFailed: the binding could not be read.
            WriteFailed: the DELETE failed.
            ConcurrentModification: the binding changed between its locked
                read and the fenced DELETE (a writer bypassed the lock).
        """
        check_mob_id(mob_id)
        expected = check_payload(expected, "expected")
        access = self._access
        access.begin_write(LockNamespace.MOB, mob_id)
        stored = _binding_if(access, mob_id, expected)
        if stored is None:
            return False
        delete_binding_if_stored(access, mob_id, stored)
        return True

    def revoke_mob_host_binding(self, mob_id: str, expected_binding: bytes, receipt: bytes) -> bool:
        """Delete the binding iff it holds exactly ``expected_binding`` and store ``receipt``.

        The delete and the receipt are one atomic step; the receipt replaces
        any older receipt of the mob.

        Returns:
            True if revoked; False if the binding is absent or differs (no
            receipt is published, nothing written).

        Raises:
            InvalidInput: ``mob_id`` is not a ``str`` or a record not bytes.
            ReadFailed: the binding could not be read.
            WriteFailed: a statement failed (nothing stays written).
            ConcurrentModification: the binding changed between its locked
                read and the fenced DELETE (nothing stays written).
        """
        check_mob_id(mob_id)
        expected_binding = check_payload(expected_binding, "expected_binding")
        receipt = check_payload(receipt, "receipt")
        access = self._access
        access.begin_write(LockNamespace.MOB, mob_id)
        stored = _binding_if(access, mob_id, expected_binding)
        if stored is None:
            return False
        with access.atomic():
            delete_binding_if_stored(access, mob_id, stored)
            access.dml(
                _UPSERT_REVOCATION, {"id": mob_id, "receipt": receipt}, f"{_REVOCATIONS}[{mob_id}]"
            )
        return True


class MobHostCalls(RuntimeCallsBase):
    """One-call part: each mob-host operation in its own unit of work."""

    _repository = "runtime.mob_hosts"

    list_mob_host_bindings = read(MobHostOps.list_mob_host_bindings)
    list_mob_host_revocations = read(MobHostOps.list_mob_host_revocations)

    def load_mob_host_binding(self, mob_id: str) -> bytes | None:
        """One-call form of :meth:`MobHostOps.load_mob_host_binding`."""
        check_mob_id(mob_id)
        return self._read(lambda repo: repo.mob_hosts.load_mob_host_binding(mob_id))

    def load_mob_host_revocation(self, mob_id: str) -> bytes | None:
        """One-call form of :meth:`MobHostOps.load_mob_host_revocation`."""
        check_mob_id(mob_id)
        return self._read(lambda repo: repo.mob_hosts.load_mob_host_revocation(mob_id))

    def put_mob_host_binding_if_absent(self, mob_id: str, record: bytes) -> bool:
        """One-call form of :meth:`MobHostOps.put_mob_host_binding_if_absent`."""
        check_mob_id(mob_id)
        record = check_payload(record, "record")
        return self._write(
            lambda repo: repo.mob_hosts.put_mob_host_binding_if_absent(mob_id, record)
        )

    def compare_and_put_mob_host_binding(
        self, mob_id: str, expected: bytes, next_record: bytes
    ) -> bool:
        """One-call form of :meth:`MobHostOps.compare_and_put_mob_host_binding`."""
        check_mob_id(mob_id)
        expected = check_payload(expected, "expected")
        next_record = check_payload(next_record, "next_record")
        return self._write(
            lambda repo: repo.mob_hosts.compare_and_put_mob_host_binding(
                mob_id, expected, next_record
            )
        )

    def delete_mob_host_binding(self, mob_id: str, expected: bytes) -> bool:
        """One-call form of :meth:`MobHostOps.delete_mob_host_binding`."""
        check_mob_id(mob_id)
        expected = check_payload(expected, "expected")
        return self._write(lambda repo: repo.mob_hosts.delete_mob_host_binding(mob_id, expected))

    def revoke_mob_host_binding(self, mob_id: str, expected_binding: bytes, receipt: bytes) -> bool:
        """One-call form of :meth:`MobHostOps.revoke_mob_host_binding`."""
        check_mob_id(mob_id)
        expected_binding = check_payload(expected_binding, "expected_binding")
        receipt = check_payload(receipt, "receipt")
        return self._write(
            lambda repo: repo.mob_hosts.revoke_mob_host_binding(mob_id, expected_binding, receipt)
        )

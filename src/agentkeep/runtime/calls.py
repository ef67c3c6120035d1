"""The base of the runtime store's one-call facade (``store.runtime``).

Each ``store.runtime.<op>(...)`` runs the repository operation of the same
name in its own unit of work, retried as a whole on a transient busy error
(:meth:`agentkeep.Store.call_write`). Work that needs no database (decoding
a caller's snapshot, checking a batch's shape) runs *before* the unit opens,
so a refused call never waits for the write lock.

Errors keep the original store's variants (docs/runtime.md#errors,
docs/decisions.md#errors-by-phase): a busy / lock-timeout error that
outlasts the retries, or any driver failure outside a statement (connect,
``BEGIN``, ``COMMIT``), becomes :class:`~agentkeep.runtime.errors.WriteFailed`
for a write and :class:`~agentkeep.runtime.errors.ReadFailed` for a read
(the original error is chained as ``__cause__``). A compare-and-set fence
that matched no row although the write lock was held is
:class:`~agentkeep.errors.ConcurrentModification`, raised as itself (a bug
signal: a writer bypassed the lock; not retried, not a ``WriteFailed``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from agentkeep.errors import CommitOutcomeUnknown, ConcurrentModification, DatabaseError
from agentkeep.one_call import OneCalls
from agentkeep.runtime.domain import RuntimeDomain
from agentkeep.runtime.errors import ReadFailed, WriteFailed

if TYPE_CHECKING:
    from agentkeep.runtime.repository import RuntimeRepository

__all__ = ["RuntimeCallsBase"]

T = TypeVar("T")


class RuntimeCallsBase(OneCalls):
    """Runs one runtime repository call per unit of work, with the runtime's error variants.

    Pure forwarders are declared with :func:`agentkeep.one_call.read` /
    :func:`~agentkeep.one_call.write` on the part named by the class's
    ``_repository`` (``"runtime.snapshots"``, ...); runtime reads skip the
    snapshot transaction by default (each is one SELECT). Operations that
    refuse input or encode before the unit opens call :meth:`_write` /
    :meth:`_read` themselves.
    """

    _single_statement_reads = True

    def _call_write(self, fn: Callable[[Any], T]) -> T:
        try:
            return self._store._call_operation(fn)
        except (ConcurrentModification, CommitOutcomeUnknown):
            raise
        except DatabaseError as exc:
            raise WriteFailed(str(exc)) from exc

    def _call_read(self, fn: Callable[[Any], T], *, single_statement: bool) -> T:
        try:
            return self._store.call_read(fn, single_statement=single_statement)
        except DatabaseError as exc:
            raise ReadFailed(str(exc)) from exc

    @property
    def domain(self) -> RuntimeDomain[Any]:
        """The store's runtime domain rules."""
        return self._store.runtime_domain

    def _write(self, fn: Callable[[RuntimeRepository], T]) -> T:
        """Run ``fn(uow.runtime)`` in a one-call write unit, errors mapped as above."""
        return self._call_write(lambda repos: fn(repos.runtime))

    def _read(self, fn: Callable[[RuntimeRepository], T], *, single_statement: bool = True) -> T:
        """Run a read; every runtime read is one SELECT unless it says otherwise."""
        return self._call_read(lambda repos: fn(repos.runtime), single_statement=single_statement)

"""The runtime store's repository: every operation of spec runtime §2, in one namespace.

``uow.runtime`` (and, one call per unit, ``store.runtime``) is a
:class:`RuntimeRepository`. It is composed of one part per concern, each in
the module named for it, which holds that concern's statements, fences and
outcomes:

* :mod:`~agentkeep.runtime.snapshots` — session snapshots: commit (identical-bytes
  fast path), transcript rewrite, load, clear, replace/clear-if-current, quarantine;
* :mod:`~agentkeep.runtime.outbox` — the compaction-projection outbox: the
  insert-and-compare and replay checks every snapshot writer runs, the pending
  list, finalization;
* :mod:`~agentkeep.runtime.boundaries` — boundary commits (``atomic_apply*``)
  with the supersession verdict, and boundary receipts;
* :mod:`~agentkeep.runtime.inputs` — input states and their batch compare-and-swap;
* :mod:`~agentkeep.runtime.lifecycle` — machine lifecycle records, ops
  lifecycle snapshots and retired epochs;
* :mod:`~agentkeep.runtime.mob` — mob host bindings and revocations;
* :mod:`~agentkeep.runtime.oauth` — the OAuth flow singleton.

Unregister finalization (:mod:`~agentkeep.runtime.finalization`) owns its
transaction (it classifies an unacknowledged COMMIT on a fresh connection),
so it is a one-call operation only: ``store.runtime.commit_unregister_finalization``.

Choices where the spec is open (spec runtime §6 offers them):

* **Locks.** Every runtime-scoped write takes ``runtime:<id>``; mob
  operations ``mob:<id>``; the OAuth flow its singleton key — ``BEGIN
  IMMEDIATE`` on SQLite, ``pg_advisory_xact_lock`` under READ COMMITTED on
  Postgres (never SERIALIZABLE, never ``FOR UPDATE`` alone: absence checks
  need the lock).
* **Errors by phase**, as the seed: failing SELECTs are ``ReadFailed``,
  failing writes ``WriteFailed``; a busy database is retried as a whole unit
  and reported as ``WriteFailed`` / ``ReadFailed`` once the retries are spent.
  Refusals that need no database (undecodable snapshot, invalid intent, key
  mismatch, bad batch shape, non-UUID input id) are raised before the unit
  opens. Reads never create tables (the schema comes from migrations).
* **TEXT in payload columns** is read as its UTF-8 bytes everywhere; the mob
  binding compare-and-set compares after that normalisation (the seed's SQL
  comparison silently missed TEXT rows); the identical-bytes fast path keeps
  the seed's SQL comparison, so a TEXT row takes the slow path and is
  rewritten as a BLOB.
* **Units of work.** Inside ``store.write()``, an operation that can fail
  after writing runs in a SAVEPOINT, so a caught error leaves nothing of it.
* **Fault injection** is a per-call hook at named points, never global state.
* **Async**: every operation's cancellation waits for its thread (stricter
  than the seed, which hardens only unregister finalization).
* The outbox's pending list has an index (``runtime_0002``); the seed had none.
"""

from __future__ import annotations

from agentkeep.runtime.boundaries import BoundaryOps
from agentkeep.runtime.finalization import FinalizationOps
from agentkeep.runtime.mob import MobHostOps
from agentkeep.runtime.oauth import OAuthOps

__all__ = ["RuntimeRepository"]


class RuntimeRepository(BoundaryOps, FinalizationOps, MobHostOps, OAuthOps):
    """Every runtime-store operation of one unit of work (see the module docstring)."""

    __slots__ = ()

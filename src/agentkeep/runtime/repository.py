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

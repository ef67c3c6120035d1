"""``store.runtime``: the runtime store's operations, each in its own unit of work.

Composed of the one-call class of each concern module (``SnapshotCalls``,
``BoundaryCalls``, ...; see :mod:`agentkeep.runtime.repository` for the
map). Each runs, in its own unit, the operation of the repository part of
its concern (the pre-encoded ``apply_*`` form when it did work before the
unit opened); the parts and the fence modules hold the only implementation
of every fence. :mod:`agentkeep.runtime.calls` says how errors and retries
are reported (docs/runtime.md#errors; the one-call form in general:
docs/architecture.md#one-call-operations).
"""

from __future__ import annotations

import os

from sqlalchemy.engine import make_url

from agentkeep.runtime.boundaries import BoundaryCalls
from agentkeep.runtime.finalization import FinalizationCalls
from agentkeep.runtime.inputs import InputStateCalls
from agentkeep.runtime.lifecycle import LifecycleCalls
from agentkeep.runtime.mob import MobHostCalls
from agentkeep.runtime.oauth import OAuthCalls
from agentkeep.runtime.outbox import OutboxCalls
from agentkeep.runtime.snapshots import SnapshotCalls

__all__ = ["RuntimeCalls"]


class RuntimeCalls(
    BoundaryCalls,
    SnapshotCalls,
    OutboxCalls,
    InputStateCalls,
    LifecycleCalls,
    FinalizationCalls,
    MobHostCalls,
    OAuthCalls,
):
    """``store.runtime``: one call, one unit of work (see the module docstring)."""

    __slots__ = ()

    def auth_authority_key(self) -> str | None:
        """The identity of the database holding the OAuth flow state.

        See docs/runtime.md#auth_authority_key.

        Two handles on the same physical database agree on it:
        ``"sqlite:" + canonical path`` (symlinks and relative parts resolved;
        the path as given if that fails) and
        ``"postgresql://host:port/dbname"`` (never credentials), followed by
        ``"#<schema>"`` when the store keeps its tables in a namespace
        (``Store.open(..., schema=...)``), since two namespaces of one database
        hold two OAuth flow states. None for an in-memory SQLite database,
        which no other handle can share.
        """
        url = self._store.engine.url
        schema = self._store.schema
        suffix = f"#{schema}" if schema else ""
        if url.get_backend_name() == "sqlite":
            if self._store.memory or not url.database:
                return None
            try:
                path = os.path.realpath(url.database, strict=True)
            except OSError:
                path = url.database
            return f"sqlite:{path}{suffix}"
        u = make_url(url)
        host = f"{u.host or 'localhost'}:{u.port or 5432}"
        return f"postgresql://{host}/{u.database or ''}{suffix}"

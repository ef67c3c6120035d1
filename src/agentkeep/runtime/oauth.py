"""The OAuth login-flow singleton (docs/runtime.md#oauth-flow-state).

One global row (``id = 'auth_oauth_flow_state'``, not runtime-scoped) of
``runtime_auth_oauth_flow_state`` holds an opaque payload. Writes take the
OAuth write lock first (``BEGIN IMMEDIATE`` on SQLite, the OAuth advisory
lock on Postgres):

What lives here: the repository part :class:`OAuthOps` (``uow.runtime.oauth``),
its one-call forms and the two statements. There is no compare-and-set, so
no SQL fence: the OAuth write lock serialises every writer.

* :meth:`OAuthOps.persist_auth_oauth_flow_snapshot` upserts the payload
  unconditionally;
* :meth:`OAuthOps.update_auth_oauth_flow_snapshot` is a read-modify-write:
  under the lock it reads the current payload, calls ``update(current)`` and
  always writes what it returns (even if unchanged). Concurrent updaters are
  serialised, so no update is lost. If ``update`` raises, that exception
  propagates unchanged and nothing is written. The callback runs while the
  write lock is held: it must be quick and must not use the store.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from sqlalchemy import bindparam as p
from sqlalchemy import select

from agentkeep.db import LockNamespace
from agentkeep.one_call import read
from agentkeep.runtime.access import OAUTH_SINGLETON_ID, RuntimeAccess, upsert_replacing
from agentkeep.runtime.calls import RuntimeCallsBase
from agentkeep.runtime.mob import check_payload
from agentkeep.runtime.models import AuthOAuthFlowStateRow as Flow
from agentkeep.statements import Statement

__all__ = ["OAuthCalls", "OAuthOps", "OAuthFlowUpdate"]

#: ``update(current payload or None) -> next payload``.
OAuthFlowUpdate = Callable[[bytes | None], bytes]

_TABLE: Final = Flow.__tablename__

_LOAD: Final = Statement(
    select(Flow.state_json).where(Flow.id == p("id")), name="runtime.oauth.get"
)
_UPSERT: Final = Statement(
    lambda d: upsert_replacing(
        d, Flow, {"id": p("id"), "state_json": p("data")}, key=[Flow.id], replace=["state_json"]
    ),
    name="runtime.oauth.upsert",
)


class OAuthOps:
    """Repository part (``uow.runtime.oauth``): the OAuth flow singleton."""

    __slots__ = ("_access",)

    def __init__(self, access: RuntimeAccess) -> None:
        self._access = access

    def persist_auth_oauth_flow_snapshot(self, snapshot: bytes) -> None:
        """Store the OAuth flow payload unconditionally.

        Raises:
            InvalidInput: ``snapshot`` is not bytes (nothing written).
            WriteFailed: the upsert failed.
        """
        data = check_payload(snapshot, "snapshot")
        self._access.begin_write(LockNamespace.OAUTH, OAUTH_SINGLETON_ID)
        self._write_singleton(data)

    def load_auth_oauth_flow_snapshot(self) -> bytes | None:
        """Load the OAuth flow payload (a TEXT value as its UTF-8 bytes), or None.

        Raises:
            ReadFailed: the SELECT failed, or the value is not bytes/text.
        """
        return self._access.one_bytes(
            _LOAD,
            {"id": OAUTH_SINGLETON_ID},
            table=_TABLE,
            key=OAUTH_SINGLETON_ID,
            column="state_json",
        )

    def update_auth_oauth_flow_snapshot(self, update: OAuthFlowUpdate) -> None:
        """Replace the payload with ``update(current)`` under the OAuth write lock.

        Args:
            update: called once with the current payload (None if absent);
                returns the payload to store. It runs while the lock is held.

        Raises:
            Exception: whatever ``update`` raises, unchanged (nothing written).
            InvalidInput: ``update`` returned something other than bytes
                (nothing written).
            ReadFailed: the current payload could not be read.
            WriteFailed: the upsert failed.
        """
        self._access.begin_write(LockNamespace.OAUTH, OAUTH_SINGLETON_ID)
        current = self.load_auth_oauth_flow_snapshot()
        data = check_payload(update(current), "update result")
        self._write_singleton(data)

    def _write_singleton(self, data: bytes) -> None:
        self._access.dml(
            _UPSERT, {"id": OAUTH_SINGLETON_ID, "data": data}, f"{_TABLE}[{OAUTH_SINGLETON_ID}]"
        )


class _CallbackRaised(Exception):
    """Carries an exception of the caller's callback through the unit of work untouched."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class OAuthCalls(RuntimeCallsBase):
    """One-call part: each OAuth flow operation in its own unit of work."""

    _repository = "runtime.oauth"

    load_auth_oauth_flow_snapshot = read(OAuthOps.load_auth_oauth_flow_snapshot)

    def persist_auth_oauth_flow_snapshot(self, snapshot: bytes) -> None:
        """One-call form of :meth:`OAuthOps.persist_auth_oauth_flow_snapshot`."""
        data = check_payload(snapshot, "snapshot")
        self._write(lambda repo: repo.oauth.persist_auth_oauth_flow_snapshot(data))

    def update_auth_oauth_flow_snapshot(self, update: OAuthFlowUpdate) -> None:
        """One-call form of :meth:`OAuthOps.update_auth_oauth_flow_snapshot`.

        An exception raised by ``update`` reaches the caller unchanged: it is
        neither retried nor mapped to a store error. If the unit is retried
        after a busy error (before anything was written), ``update`` is called
        again with the payload read by the new attempt; only the last call's
        result is stored.
        """

        def guarded(current: bytes | None) -> bytes:
            try:
                return update(current)
            except Exception as exc:
                raise _CallbackRaised(exc) from exc

        failure: Exception | None = None
        try:
            self._write(lambda repo: repo.oauth.update_auth_oauth_flow_snapshot(guarded))
        except _CallbackRaised as carried:
            failure = carried.error
        if failure is not None:
            raise failure

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
* :meth:`OAuthOps.reencrypt_auth_oauth_flow_snapshot` rewrites the stored
  payload with the store's codec as it is now (migration from plain text,
  key rotation).

Encryption at rest (docs/runtime.md#oauth-flow-state): with the store's
``oauth_codec`` (a :class:`~agentkeep.crypto.PayloadCodec`), the column holds
``codec.encode(payload)`` and every read goes through ``codec.decode``; the
callers, the ``update`` callback included, see and give plain payloads only.
A stored value the codec refuses (a wrong key, a tampered value, plain text
stored before the codec was configured) raises
:class:`~agentkeep.errors.DecryptionFailed`: never returned, never read as
absent, and ``update`` writes nothing. Without a codec the payload is stored
as given, except that a value in :class:`~agentkeep.crypto.AesGcmCodec`'s
format is refused with the same error (the store was opened without its key).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from sqlalchemy import bindparam as p
from sqlalchemy import select

from agentkeep.arguments import check_methods
from agentkeep.crypto import looks_aes_gcm_encrypted
from agentkeep.db import LockNamespace
from agentkeep.errors import DecryptionFailed
from agentkeep.one_call import read
from agentkeep.runtime.access import OAUTH_SINGLETON_ID, RuntimeAccess, upsert_replacing
from agentkeep.runtime.calls import RuntimeCallsBase
from agentkeep.runtime.errors import WriteFailed
from agentkeep.runtime.mob import check_payload
from agentkeep.runtime.models import AuthOAuthFlowStateRow as Flow
from agentkeep.statements import Statement

__all__ = ["OAuthCalls", "OAuthOps", "OAuthFlowUpdate"]

#: ``update(current payload or None) -> next payload``.
OAuthFlowUpdate = Callable[[bytes | None], bytes]

_TABLE: Final = Flow.__tablename__
_WHAT: Final = f"{_TABLE}[{OAUTH_SINGLETON_ID}].state_json"

_LOAD: Final = Statement(
    select(Flow.state_json).where(Flow.id == p("id")), name="runtime.oauth.get"
)
_UPSERT: Final = Statement(
    lambda d: upsert_replacing(
        d, Flow, {"id": p("id"), "state_json": p("data")}, key=[Flow.id], replace=["state_json"]
    ),
    name="runtime.oauth.upsert",
)


@check_methods
class OAuthOps:
    """Repository part (``uow.runtime.oauth``): the OAuth flow singleton."""

    __slots__ = ("_access",)

    def __init__(self, access: RuntimeAccess) -> None:
        self._access = access

    def persist_auth_oauth_flow_snapshot(self, snapshot: bytes) -> None:
        """Store the OAuth flow payload unconditionally (encoded by the store's codec).

        Raises:
            InvalidInput: ``snapshot`` is not bytes (nothing written).
            WriteFailed: the upsert failed, or the codec failed to encode
                (nothing written).
        """
        data = check_payload(snapshot, "snapshot")
        self._access.begin_write(LockNamespace.OAUTH, OAUTH_SINGLETON_ID)
        self._write_singleton(data)

    def load_auth_oauth_flow_snapshot(self) -> bytes | None:
        """Load the OAuth flow payload (a TEXT value as its UTF-8 bytes), or None.

        With the store's codec, the decoded payload.

        Raises:
            DecryptionFailed: the codec refused the stored value, or (no
                codec) it is in AesGcmCodec's format.
            ReadFailed: the SELECT failed, or the value is not bytes/text.
        """
        return self._decode(self._load_stored())

    def reencrypt_auth_oauth_flow_snapshot(self) -> bool:
        """Rewrite the stored payload with the codec as it is now, under the OAuth write lock.

        The payload is decoded (with whatever the codec accepts: an old key,
        plain text with ``accept_plaintext``) and stored encoded again (with
        the current key). Without a codec the payload is stored as it is.

        Returns:
            True if a payload was rewritten, False if there is none.

        Raises:
            DecryptionFailed: the codec refused the stored value (nothing written).
            ReadFailed: the current payload could not be read.
            WriteFailed: the upsert or the encoding failed.
        """
        self._access.begin_write(LockNamespace.OAUTH, OAUTH_SINGLETON_ID)
        current = self.load_auth_oauth_flow_snapshot()
        if current is None:
            return False
        self._write_singleton(current)
        return True

    def update_auth_oauth_flow_snapshot(self, update: OAuthFlowUpdate) -> None:
        """Replace the payload with ``update(current)`` under the OAuth write lock.

        Args:
            update: called once with the current payload (None if absent);
                returns the payload to store. It runs while the lock is held.

        Raises:
            Exception: whatever ``update`` raises, unchanged (nothing written).
            InvalidInput: ``update`` returned something other than bytes
                (nothing written).
            DecryptionFailed: the codec refused the stored value; ``update``
                was not called and nothing was written.
            ReadFailed: the current payload could not be read.
            WriteFailed: the upsert or the encoding failed.
        """
        self._access.begin_write(LockNamespace.OAUTH, OAUTH_SINGLETON_ID)
        current = self.load_auth_oauth_flow_snapshot()
        data = check_payload(update(current), "update result")
        self._write_singleton(data)

    def _load_stored(self) -> bytes | None:
        return self._access.one_bytes(
            _LOAD,
            {"id": OAUTH_SINGLETON_ID},
            table=_TABLE,
            key=OAUTH_SINGLETON_ID,
            column="state_json",
        )

    def _decode(self, stored: bytes | None) -> bytes | None:
        """The payload of a stored value (the codec's decode; fail-closed)."""
        if stored is None:
            return None
        codec = self._access.oauth_codec
        if codec is None:
            if looks_aes_gcm_encrypted(stored):
                raise DecryptionFailed(
                    _WHAT,
                    "it is encrypted (AesGcmCodec format) and the store has no oauth_codec: "
                    "open the store with the codec and its key",
                )
            return stored
        try:
            plain = codec.decode(stored)
        except DecryptionFailed as exc:
            raise DecryptionFailed(_WHAT, exc.reason) from exc
        except Exception as exc:
            raise DecryptionFailed(_WHAT, f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(plain, bytes):
            raise DecryptionFailed(
                _WHAT, f"the codec's decode returned {type(plain).__name__}, not bytes"
            )
        return plain

    def _encode(self, plain: bytes) -> bytes:
        """The stored form of a payload (the codec's encode)."""
        codec = self._access.oauth_codec
        if codec is None:
            return plain
        try:
            stored = codec.encode(plain)
        except Exception as exc:
            raise WriteFailed(f"cannot encrypt {_WHAT}: {type(exc).__name__}: {exc}") from exc
        if not isinstance(stored, bytes):
            raise WriteFailed(
                f"cannot encrypt {_WHAT}: the codec's encode returned "
                f"{type(stored).__name__}, not bytes"
            )
        return stored

    def _write_singleton(self, data: bytes) -> None:
        self._access.dml(
            _UPSERT,
            {"id": OAUTH_SINGLETON_ID, "data": self._encode(data)},
            f"{_TABLE}[{OAUTH_SINGLETON_ID}]",
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

    def reencrypt_auth_oauth_flow_snapshot(self) -> bool:
        """One-call form of :meth:`OAuthOps.reencrypt_auth_oauth_flow_snapshot`."""
        return self._write(lambda repo: repo.oauth.reencrypt_auth_oauth_flow_snapshot())

"""Encryption at rest: the :class:`PayloadCodec` protocol and :class:`AesGcmCodec`.

A store opened with ``oauth_codec=`` (``Store.open``, ``AsyncStore.open``)
stores the OAuth flow state as ``codec.encode(payload)`` and reads it back
through ``codec.decode`` (docs/runtime.md#oauth-flow-state). Any object with
those two methods is a codec; :class:`AesGcmCodec` is the one agentkeep
ships, built on the ``cryptography`` package (extra ``agentkeep[crypto]``).

Stored format of :class:`AesGcmCodec` (version 1)::

    b"\\x00ak\\x01" | nonce (12 random bytes) | AES-GCM ciphertext and 16-byte tag

The 4-byte header (NUL, ``ak``, the format version) is authenticated as
associated data, so a value cannot be moved to another format version
unnoticed. The header is what tells a value this codec wrote from plain text
written before a codec was configured (a NUL never starts UTF-8 JSON text).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Final, Protocol

from agentkeep.errors import DecryptionFailed, InvalidInput, MissingDependency

__all__ = ["AESGCM_HEADER", "AesGcmCodec", "PayloadCodec", "looks_aes_gcm_encrypted"]

#: The first bytes of every value :class:`AesGcmCodec` writes: NUL, ``ak``, format version 1.
AESGCM_HEADER: Final = b"\x00ak\x01"
_PREFIX: Final = AESGCM_HEADER[:3]
_NONCE_BYTES: Final = 12
_TAG_BYTES: Final = 16
_KEY_BYTES: Final = frozenset({16, 24, 32})


class PayloadCodec(Protocol):
    """Turns a payload into its stored form and back (encryption at rest).

    ``decode(encode(plain)) == plain`` for every ``plain``. ``decode`` must
    raise (any exception) for a value it cannot authenticate; agentkeep then
    raises :class:`~agentkeep.errors.DecryptionFailed` with it chained, and
    never returns the stored bytes. ``encode`` may be randomised (a fresh
    nonce per call).
    """

    def encode(self, plain: bytes) -> bytes:
        """The stored form of ``plain``."""
        ...

    def decode(self, stored: bytes) -> bytes:
        """The payload of a stored value; raises for one that does not authenticate."""
        ...


def looks_aes_gcm_encrypted(stored: bytes) -> bool:
    """True if ``stored`` starts like a value :class:`AesGcmCodec` wrote (any format version)."""
    return stored.startswith(_PREFIX)


class AesGcmCodec:
    """AES-GCM (256, 192 or 128-bit key) with a random 96-bit nonce per value.

    Needs the ``cryptography`` package (``pip install 'agentkeep[crypto]'``).
    The key is the caller's: keep it out of the database (a secret manager,
    an environment variable); :meth:`generate_key` makes a new one.

    Args:
        key: the key new values are encrypted with (16, 24 or 32 bytes; 32
            recommended).
        old_keys: keys that may still decrypt stored values, tried after
            ``key`` (key rotation: give the new key as ``key`` and the old one
            here, re-encrypt, then drop it).
        accept_plaintext: decode returns a stored value without the header as
            it is, instead of refusing it. Only for migrating plain text
            written before the codec was configured: open with it, re-encrypt
            (``store.runtime.reencrypt_auth_oauth_flow_snapshot()``), then open
            without it. A value with the header is always authenticated.

    Raises:
        InvalidInput: a key that is not bytes of a valid AES key length.
        MissingDependency: ``cryptography`` is not installed (extra ``agentkeep[crypto]``).
    """

    __slots__ = ("_accept_plaintext", "_ciphers", "_invalid_tag")

    def __init__(
        self, key: bytes, *, old_keys: Sequence[bytes] = (), accept_plaintext: bool = False
    ) -> None:
        keys = [_check_key(key, "key")]
        if isinstance(old_keys, (bytes, str)) or not isinstance(old_keys, Sequence):
            raise InvalidInput("old_keys", "must be a sequence of keys (bytes)")
        keys += [_check_key(k, "old_keys") for k in old_keys]
        if type(accept_plaintext) is not bool:
            raise InvalidInput("accept_plaintext", "must be True or False")
        try:
            from cryptography.exceptions import InvalidTag
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError as exc:
            raise MissingDependency(
                "agentkeep.crypto.AesGcmCodec", "cryptography", "crypto"
            ) from exc
        self._ciphers: tuple[Any, ...] = tuple(AESGCM(k) for k in keys)
        self._invalid_tag: type[Exception] = InvalidTag
        self._accept_plaintext = accept_plaintext

    @staticmethod
    def generate_key() -> bytes:
        """A new random 256-bit key (32 bytes from the operating system's CSPRNG)."""
        return os.urandom(32)

    def encode(self, plain: bytes) -> bytes:
        """Encrypt ``plain`` with the current key under a fresh random nonce.

        Raises:
            InvalidInput: ``plain`` is not bytes.
        """
        if not isinstance(plain, bytes):
            raise InvalidInput("payload", f"expected bytes, not {type(plain).__name__}")
        nonce = os.urandom(_NONCE_BYTES)
        sealed: bytes = self._ciphers[0].encrypt(nonce, plain, AESGCM_HEADER)
        return AESGCM_HEADER + nonce + sealed

    def decode(self, stored: bytes) -> bytes:
        """Authenticate and decrypt ``stored`` with the current key, then each old key.

        Raises:
            DecryptionFailed: no key authenticates it (a wrong key, a tampered
                or truncated value), an unknown format version, or plain text
                (no header) without ``accept_plaintext``.
        """
        if not isinstance(stored, bytes):
            raise DecryptionFailed("payload", f"expected bytes, not {type(stored).__name__}")
        if not looks_aes_gcm_encrypted(stored):
            if self._accept_plaintext:
                return stored
            raise DecryptionFailed(
                "payload",
                "not encrypted (plain text stored before the codec was configured? "
                "migrate it with accept_plaintext=True, see docs/runtime.md#oauth-flow-state)",
            )
        if not stored.startswith(AESGCM_HEADER):
            raise DecryptionFailed("payload", f"unknown format version {stored[3:4]!r}")
        if len(stored) < len(AESGCM_HEADER) + _NONCE_BYTES + _TAG_BYTES:
            raise DecryptionFailed("payload", f"truncated ({len(stored)} bytes)")
        start = len(AESGCM_HEADER)
        nonce, sealed = stored[start : start + _NONCE_BYTES], stored[start + _NONCE_BYTES :]
        for cipher in self._ciphers:
            try:
                plain: bytes = cipher.decrypt(nonce, sealed, AESGCM_HEADER)
            except self._invalid_tag:
                continue
            return plain
        raise DecryptionFailed(
            "payload", "authentication failed (a wrong key, or the value was altered)"
        )

    def __repr__(self) -> str:
        old = len(self._ciphers) - 1
        return f"AesGcmCodec(<key>, old_keys=<{old}>, accept_plaintext={self._accept_plaintext})"


def _check_key(key: object, field: str) -> bytes:
    if not isinstance(key, bytes) or len(key) not in _KEY_BYTES:
        what = f"{len(key)} bytes" if isinstance(key, bytes) else type(key).__name__
        raise InvalidInput(field, f"an AES key is 16, 24 or 32 bytes, not {what}")
    return key

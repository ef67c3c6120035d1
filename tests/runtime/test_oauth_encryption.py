"""Encryption at rest of the OAuth flow state (docs/runtime.md#oauth-flow-state).

With ``oauth_codec=AesGcmCodec(key)`` the column holds ciphertext (checked
on the raw rows), callers and the ``update`` callback see plain payloads
only, and a value the codec refuses (a wrong key, a tampered or truncated
value, plain text stored before the codec) raises ``DecryptionFailed`` and
changes nothing. Plain text is migrated with ``accept_plaintext`` and
``reencrypt_auth_oauth_flow_snapshot``; keys rotate with ``old_keys``.
Without a codec the payload is stored as given, as before. Every test runs on
SQLite and Postgres.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

import agentkeep
from agentkeep import AsyncStore, DecryptionFailed, InvalidInput, ReadFailed, WriteFailed
from agentkeep.crypto import AESGCM_HEADER, AesGcmCodec, PayloadCodec
from agentkeep.store import Store
from tests.conftest import as_sync_url
from tests.support import raw_exec, raw_rows

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
TOKEN = b'{"refresh_token":"rt-secret-123","verifier":"v"}'

_TABLE = "runtime_auth_oauth_flow_state"


def stored(url: str) -> bytes | None:
    """The raw value of the OAuth flow row, as the database holds it."""
    rows = raw_rows(url, f"SELECT state_json FROM {_TABLE}")
    assert len(rows) <= 1
    return rows[0][0] if rows else None


def overwrite(url: str, value: bytes) -> None:
    raw_exec(url, f"UPDATE {_TABLE} SET state_json = :v", params={"v": value})


def test_roundtrip_stores_ciphertext_only(db_url: str) -> None:
    with Store.open(db_url, oauth_codec=AesGcmCodec(KEY)) as store:
        store.runtime.persist_auth_oauth_flow_snapshot(TOKEN)
        first = stored(db_url)
        assert first is not None and first.startswith(AESGCM_HEADER)
        assert TOKEN not in first and b"rt-secret-123" not in first
        assert store.runtime.load_auth_oauth_flow_snapshot() == TOKEN
        store.runtime.persist_auth_oauth_flow_snapshot(TOKEN)
        assert stored(db_url) != first  # a fresh nonce per write
        seen: list[bytes | None] = []

        def update(current: bytes | None) -> bytes:
            seen.append(current)
            return (current or b"") + b"+"

        store.runtime.update_auth_oauth_flow_snapshot(update)
        assert seen == [TOKEN]  # the callback sees plain text
        assert store.runtime.load_auth_oauth_flow_snapshot() == TOKEN + b"+"
        with store.write() as uow:
            uow.runtime.update_auth_oauth_flow_snapshot(lambda cur: (cur or b"") + b"!")
            assert uow.runtime.load_auth_oauth_flow_snapshot() == TOKEN + b"+!"
        raw = stored(db_url)
        assert raw is not None and TOKEN not in raw
        assert AesGcmCodec(KEY).decode(raw) == TOKEN + b"+!"


def test_update_on_an_empty_row_gets_none_and_stores_ciphertext(db_url: str) -> None:
    with Store.open(db_url, oauth_codec=AesGcmCodec(KEY)) as store:
        seen: list[bytes | None] = []
        store.runtime.update_auth_oauth_flow_snapshot(lambda cur: seen.append(cur) or TOKEN)
        assert seen == [None]
        assert store.runtime.reencrypt_auth_oauth_flow_snapshot() is True
        assert store.runtime.load_auth_oauth_flow_snapshot() == TOKEN
    raw = stored(db_url)
    assert raw is not None and raw.startswith(AESGCM_HEADER) and TOKEN not in raw


def _assert_refused_and_unchanged(store: Store, url: str, match: str) -> None:
    """Every read path raises DecryptionFailed; the update callback never runs; row unchanged."""
    before = stored(url)
    calls: list[bytes | None] = []

    def update(current: bytes | None) -> bytes:
        calls.append(current)
        return b"overwritten"

    with pytest.raises(DecryptionFailed, match=match) as raised:
        store.runtime.load_auth_oauth_flow_snapshot()
    assert isinstance(raised.value, ReadFailed)
    assert raised.value.what == f"{_TABLE}[auth_oauth_flow_state].state_json"
    with pytest.raises(DecryptionFailed, match=match):
        store.runtime.update_auth_oauth_flow_snapshot(update)
    with pytest.raises(DecryptionFailed, match=match), store.write() as uow:
        uow.runtime.update_auth_oauth_flow_snapshot(update)
    with pytest.raises(DecryptionFailed, match=match), store.read() as uow:
        uow.runtime.load_auth_oauth_flow_snapshot()
    with pytest.raises(DecryptionFailed, match=match):
        store.runtime.reencrypt_auth_oauth_flow_snapshot()
    assert calls == []
    assert stored(url) == before


def test_wrong_key_is_a_typed_error_and_changes_nothing(db_url: str) -> None:
    with Store.open(db_url, oauth_codec=AesGcmCodec(KEY)) as store:
        store.runtime.persist_auth_oauth_flow_snapshot(TOKEN)
    with Store.open(db_url, oauth_codec=AesGcmCodec(OTHER_KEY)) as wrong:
        _assert_refused_and_unchanged(wrong, db_url, "authentication failed")


@pytest.mark.parametrize(
    ("tamper", "match"),
    [
        (lambda v: v[:-1] + bytes([v[-1] ^ 0x01]), "authentication failed"),  # the tag
        (lambda v: v[:20] + bytes([v[20] ^ 0x80]) + v[21:], "authentication failed"),  # the text
        (lambda v: v[:4] + bytes([v[4] ^ 0x01]) + v[5:], "authentication failed"),  # the nonce
        (lambda v: v[:-1], "authentication failed"),  # one byte short
        (lambda v: v[:20], "truncated"),  # shorter than header, nonce and tag
        (lambda v: b"\x00ak\x02" + v[4:], "unknown format version"),
    ],
    ids=["tag", "ciphertext", "nonce", "shortened", "truncated", "version"],
)
def test_tampered_ciphertext_is_a_typed_error_and_changes_nothing(
    db_url: str, tamper: Any, match: str
) -> None:
    with Store.open(db_url, oauth_codec=AesGcmCodec(KEY)) as store:
        store.runtime.persist_auth_oauth_flow_snapshot(TOKEN)
        good = stored(db_url)
        assert good is not None
        overwrite(db_url, tamper(good))
        _assert_refused_and_unchanged(store, db_url, match)
        overwrite(db_url, good)
        assert store.runtime.load_auth_oauth_flow_snapshot() == TOKEN


def test_without_a_codec_the_payload_is_stored_as_given(store: Store, db_url: str) -> None:
    store.runtime.persist_auth_oauth_flow_snapshot(TOKEN)
    assert stored(db_url) == TOKEN
    store.runtime.update_auth_oauth_flow_snapshot(lambda cur: (cur or b"") + b"+")
    assert stored(db_url) == TOKEN + b"+"
    assert store.runtime.load_auth_oauth_flow_snapshot() == TOKEN + b"+"
    assert store.runtime.reencrypt_auth_oauth_flow_snapshot() is True
    assert stored(db_url) == TOKEN + b"+"


def test_plaintext_from_before_the_codec_is_refused_then_migrated(
    store: Store, db_url: str
) -> None:
    store.runtime.persist_auth_oauth_flow_snapshot(TOKEN)  # no codec yet
    with Store.open(db_url, oauth_codec=AesGcmCodec(KEY)) as strict:
        _assert_refused_and_unchanged(strict, db_url, "not encrypted")
    assert stored(db_url) == TOKEN
    with Store.open(db_url, oauth_codec=AesGcmCodec(KEY, accept_plaintext=True)) as migrating:
        assert migrating.runtime.load_auth_oauth_flow_snapshot() == TOKEN
        assert migrating.runtime.reencrypt_auth_oauth_flow_snapshot() is True
    raw = stored(db_url)
    assert raw is not None and raw.startswith(AESGCM_HEADER) and TOKEN not in raw
    with Store.open(db_url, oauth_codec=AesGcmCodec(KEY)) as strict:
        assert strict.runtime.load_auth_oauth_flow_snapshot() == TOKEN


def test_accept_plaintext_still_authenticates_ciphertext(db_url: str) -> None:
    with Store.open(db_url, oauth_codec=AesGcmCodec(KEY)) as store:
        store.runtime.persist_auth_oauth_flow_snapshot(TOKEN)
    lenient = AesGcmCodec(OTHER_KEY, accept_plaintext=True)
    with Store.open(db_url, oauth_codec=lenient) as wrong:
        _assert_refused_and_unchanged(wrong, db_url, "authentication failed")


def test_key_rotation_with_old_keys_and_reencrypt(db_url: str) -> None:
    with Store.open(db_url, oauth_codec=AesGcmCodec(OTHER_KEY)) as old:
        old.runtime.persist_auth_oauth_flow_snapshot(TOKEN)
    rotating = AesGcmCodec(KEY, old_keys=[OTHER_KEY])
    with Store.open(db_url, oauth_codec=rotating) as store:
        assert store.runtime.load_auth_oauth_flow_snapshot() == TOKEN
        assert store.runtime.reencrypt_auth_oauth_flow_snapshot() is True
    raw = stored(db_url)
    assert raw is not None
    assert AesGcmCodec(KEY).decode(raw) == TOKEN
    with pytest.raises(DecryptionFailed):
        AesGcmCodec(OTHER_KEY).decode(raw)


def test_a_store_without_the_codec_refuses_an_encrypted_row(db_url: str) -> None:
    with Store.open(db_url, oauth_codec=AesGcmCodec(KEY)) as store:
        store.runtime.persist_auth_oauth_flow_snapshot(TOKEN)
    with Store.open(db_url) as plain:
        _assert_refused_and_unchanged(plain, db_url, "no oauth_codec")


class _Reversing:
    """A caller's own codec: reversed bytes behind a marker (not encryption; a protocol test)."""

    def encode(self, plain: bytes) -> bytes:
        return b"REV:" + plain[::-1]

    def decode(self, stored: bytes) -> bytes:
        if not stored.startswith(b"REV:"):
            raise ValueError("no REV: marker")
        return stored[4:][::-1]


def test_a_callers_own_codec(db_url: str) -> None:
    codec: PayloadCodec = _Reversing()
    with Store.open(db_url, oauth_codec=codec) as store:
        store.runtime.persist_auth_oauth_flow_snapshot(b"abc")
        assert stored(db_url) == b"REV:cba"
        assert store.runtime.load_auth_oauth_flow_snapshot() == b"abc"
        overwrite(db_url, b"garbage")
        with pytest.raises(DecryptionFailed, match="ValueError: no REV: marker") as raised:
            store.runtime.load_auth_oauth_flow_snapshot()
        assert isinstance(raised.value.__cause__, ValueError)
        assert stored(db_url) == b"garbage"


class _Broken:
    def __init__(self, encode: Any, decode: Any) -> None:
        self._encode, self._decode = encode, decode

    def encode(self, plain: bytes) -> bytes:
        return self._encode(plain)

    def decode(self, stored: bytes) -> bytes:
        return self._decode(stored)


def _boom(_: bytes) -> bytes:
    raise RuntimeError("codec down")


def test_codec_failures_are_typed_and_write_nothing(store: Store, db_url: str) -> None:
    store.runtime.persist_auth_oauth_flow_snapshot(b"before")
    failing_encode = _Broken(_boom, lambda s: s)
    with Store.open(db_url, oauth_codec=failing_encode) as s:
        with pytest.raises(WriteFailed, match="codec down"):
            s.runtime.persist_auth_oauth_flow_snapshot(b"new")
        with pytest.raises(WriteFailed, match="codec down"):
            s.runtime.update_auth_oauth_flow_snapshot(lambda cur: b"new")
        with pytest.raises(WriteFailed, match="codec down"), s.write() as uow:
            uow.runtime.persist_auth_oauth_flow_snapshot(b"new")
    text_encode = _Broken(lambda p: "text", lambda s: s)
    with Store.open(db_url, oauth_codec=text_encode) as s:
        with pytest.raises(WriteFailed, match="not bytes"):
            s.runtime.persist_auth_oauth_flow_snapshot(b"new")
    assert stored(db_url) == b"before"
    text_decode = _Broken(lambda p: p, lambda s: "text")
    with Store.open(db_url, oauth_codec=text_decode) as s:
        _assert_refused_and_unchanged(s, db_url, "returned str, not bytes")
    failing_decode = _Broken(lambda p: p, _boom)
    with Store.open(db_url, oauth_codec=failing_decode) as s:
        _assert_refused_and_unchanged(s, db_url, "RuntimeError: codec down")


def test_a_non_codec_is_refused_at_open(db_url: str) -> None:
    bad: Any = object()
    with pytest.raises(InvalidInput, match="oauth_codec"):
        Store.open(db_url, oauth_codec=bad)
    with pytest.raises(InvalidInput, match="oauth_codec"):
        asyncio.run(AsyncStore.open(db_url, oauth_codec=bad))
    with pytest.raises(InvalidInput, match="oauth_codec"):
        Store.open(db_url, oauth_codec=KEY)  # type: ignore[arg-type]


def test_host_engine_store_takes_the_codec(db_url: str) -> None:
    engine = agentkeep.create_engine(db_url)
    try:
        store = Store(engine, oauth_codec=AesGcmCodec(KEY))
        store.runtime.persist_auth_oauth_flow_snapshot(TOKEN)
        assert store.runtime.load_auth_oauth_flow_snapshot() == TOKEN
    finally:
        engine.dispose()
    raw = stored(db_url)
    assert raw is not None and TOKEN not in raw


def test_async_store_encrypts(async_url: str) -> None:
    sync_url = as_sync_url(async_url)

    async def run() -> tuple[bytes | None, bytes | None]:
        astore = await AsyncStore.open(async_url, oauth_codec=AesGcmCodec(KEY))
        try:
            await astore.runtime.persist_auth_oauth_flow_snapshot(TOKEN)
            await astore.runtime.update_auth_oauth_flow_snapshot(lambda cur: (cur or b"") + b"+")
            async with astore.write() as uow:
                await uow.runtime.update_auth_oauth_flow_snapshot(lambda cur: (cur or b"") + b"!")
            return (
                await astore.runtime.load_auth_oauth_flow_snapshot(),
                stored(sync_url),
            )
        finally:
            await astore.close()

    loaded, raw = asyncio.run(run())
    assert loaded == TOKEN + b"+!"
    assert raw is not None and raw.startswith(AESGCM_HEADER) and TOKEN not in raw


def test_concurrent_encrypted_increments_lose_nothing(db_url: str) -> None:
    """The OAuth write lock still serialises updaters when each decodes and re-encrypts."""
    n_threads, k = 4, 5
    barrier = threading.Barrier(n_threads, timeout=60)
    errors: list[BaseException] = []

    def increment(current: bytes | None) -> bytes:
        return str(int(current or b"0") + 1).encode()

    def worker() -> None:
        try:
            with Store.open(db_url, oauth_codec=AesGcmCodec(KEY)) as own:
                barrier.wait()
                for _ in range(k):
                    own.runtime.update_auth_oauth_flow_snapshot(increment)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    with Store.open(db_url, oauth_codec=AesGcmCodec(KEY)) as store:
        assert store.runtime.load_auth_oauth_flow_snapshot() == str(n_threads * k).encode()
    raw = stored(db_url)
    assert raw is not None and raw.startswith(AESGCM_HEADER)


# -- the codec on its own ---------------------------------------------------


def test_codec_roundtrip_and_format() -> None:
    codec = AesGcmCodec(KEY)
    for plain in (b"", b"x", TOKEN, bytes(range(256)) * 10):
        sealed = codec.encode(plain)
        assert sealed.startswith(AESGCM_HEADER)
        assert len(sealed) == len(AESGCM_HEADER) + 12 + len(plain) + 16
        assert codec.decode(sealed) == plain
    assert codec.encode(TOKEN) != codec.encode(TOKEN)
    assert len(AesGcmCodec.generate_key()) == 32
    assert AesGcmCodec.generate_key() != AesGcmCodec.generate_key()
    for size in (16, 24):
        short = AesGcmCodec(bytes(size))
        assert short.decode(short.encode(TOKEN)) == TOKEN
    assert "00010203" not in repr(codec) and repr(KEY) not in repr(codec)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"key": b"short"}, "key"),
        ({"key": "k" * 32}, "key"),
        ({"key": bytearray(32)}, "key"),
        ({"key": KEY, "old_keys": KEY}, "old_keys"),
        ({"key": KEY, "old_keys": [b"short"]}, "old_keys"),
        ({"key": KEY, "accept_plaintext": 1}, "accept_plaintext"),
    ],
)
def test_codec_refuses_bad_keys(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidInput) as raised:
        AesGcmCodec(**kwargs)
    assert raised.value.field == field


def test_codec_decode_refuses_non_bytes_and_encode_refuses_non_bytes() -> None:
    codec = AesGcmCodec(KEY)
    bad: Any = "text"
    with pytest.raises(DecryptionFailed):
        codec.decode(bad)
    with pytest.raises(InvalidInput):
        codec.encode(bad)

"""Mob host bindings and revocations (spec runtime §1.10–§1.11, §2.31–§2.38).

Seed tests #41 (insert, CAS, delete, list) and #42 (revoke is atomic and
durable across a reopen; a fresh bind supersedes the receipt); spec §5.2
item 23 pinned as *normalised* (CAS / delete / revoke on a TEXT-degraded
SQLite row succeed and rewrite it as a BLOB); races between spawned processes
for each fence (put-if-absent, compare-and-put, revoke: exactly one winner);
bad input. Every test runs on SQLite and Postgres.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from agentkeep.errors import InvalidInput, ReadOnlyUnitOfWork
from agentkeep.store import Store

from .support import race_processes, raw_exec, raw_rows

MOB_A, MOB_B, MOB_R = "mob-a", "mob-b", "mob-r"


def _tables(url: str) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    return (
        raw_rows(url, "SELECT mob_id, record_json FROM runtime_mob_host_bindings ORDER BY 1"),
        raw_rows(url, "SELECT mob_id, receipt_json FROM runtime_mob_host_revocations ORDER BY 1"),
    )


def test_bindings_insert_cas_delete_and_list(store: Store) -> None:  # #41
    rt = store.runtime
    # 1. empty table
    assert rt.load_mob_host_binding(MOB_A) is None
    assert rt.list_mob_host_bindings() == []
    assert rt.compare_and_put_mob_host_binding(MOB_A, b"old", b"new") is False
    assert rt.delete_mob_host_binding(MOB_A, b"old") is False
    assert rt.list_mob_host_bindings() == []
    # 2. put if absent
    assert rt.put_mob_host_binding_if_absent(MOB_A, b"record-1") is True
    assert rt.put_mob_host_binding_if_absent(MOB_A, b"record-other") is False
    assert rt.load_mob_host_binding(MOB_A) == b"record-1"
    # 3. compare and put
    assert rt.compare_and_put_mob_host_binding(MOB_A, b"stale", b"record-2") is False
    assert rt.load_mob_host_binding(MOB_A) == b"record-1"
    assert rt.compare_and_put_mob_host_binding(MOB_A, b"record-1", b"record-2") is True
    # 4. list
    assert rt.put_mob_host_binding_if_absent(MOB_B, b"record-b") is True
    assert rt.list_mob_host_bindings() == [(MOB_A, b"record-2"), (MOB_B, b"record-b")]
    # 5. delete (no receipt)
    assert rt.delete_mob_host_binding(MOB_A, b"stale") is False
    assert rt.delete_mob_host_binding(MOB_A, b"record-2") is True
    assert rt.load_mob_host_binding(MOB_A) is None
    assert rt.list_mob_host_revocations() == []


def test_revoke_is_atomic_durable_and_fresh_bind_supersedes_receipt(db_url: str) -> None:  # #42
    with Store.open(db_url) as store:
        rt = store.runtime
        assert rt.put_mob_host_binding_if_absent(MOB_R, b"binding-v1") is True
        before = _tables(db_url)
        assert rt.revoke_mob_host_binding(MOB_R, b"stale", b"receipt-v1") is False
        assert _tables(db_url) == before  # nothing written, no receipt
        assert rt.load_mob_host_binding(MOB_R) == b"binding-v1"
        assert rt.load_mob_host_revocation(MOB_R) is None
        assert rt.revoke_mob_host_binding(MOB_R, b"binding-v1", b"receipt-v1") is True
        assert rt.load_mob_host_binding(MOB_R) is None
        assert rt.list_mob_host_revocations() == [(MOB_R, b"receipt-v1")]
    with Store.open(db_url) as store:  # reopen
        rt = store.runtime
        assert rt.load_mob_host_binding(MOB_R) is None
        assert rt.load_mob_host_revocation(MOB_R) == b"receipt-v1"
        # A revoked mob has no binding: compare-and-put fails (I9).
        assert rt.compare_and_put_mob_host_binding(MOB_R, b"binding-v1", b"x") is False
        assert rt.put_mob_host_binding_if_absent(MOB_R, b"binding-v2") is True
        assert rt.load_mob_host_revocation(MOB_R) is None
        assert rt.load_mob_host_binding(MOB_R) == b"binding-v2"


def test_revoke_replaces_an_older_receipt_and_existing_binding_keeps_receipt(
    store: Store, db_url: str
) -> None:
    rt = store.runtime
    assert rt.put_mob_host_binding_if_absent(MOB_R, b"v1")
    assert rt.revoke_mob_host_binding(MOB_R, b"v1", b"receipt-1")
    # A put that does not insert leaves the receipt alone.
    assert rt.put_mob_host_binding_if_absent(MOB_R, b"v2")
    with store.write() as uow:
        assert uow.runtime.revoke_mob_host_binding(MOB_R, b"v2", b"receipt-2") is True
    assert rt.load_mob_host_revocation(MOB_R) == b"receipt-2"
    raw_exec(
        db_url,
        "INSERT INTO runtime_mob_host_bindings (mob_id, record_json) VALUES (:m, :r)",
        params={"m": MOB_R, "r": b"direct"},
    )
    assert rt.put_mob_host_binding_if_absent(MOB_R, b"v3") is False
    assert rt.load_mob_host_revocation(MOB_R) == b"receipt-2"


def test_uow_forms_share_the_transaction(store: Store) -> None:
    with store.write() as uow:
        assert uow.runtime.put_mob_host_binding_if_absent(MOB_A, b"r1") is True
        assert uow.runtime.compare_and_put_mob_host_binding(MOB_A, b"r1", b"r2") is True
        assert uow.runtime.load_mob_host_binding(MOB_A) == b"r2"
    with pytest.raises(RuntimeError), store.write() as uow:
        assert uow.runtime.revoke_mob_host_binding(MOB_A, b"r2", b"receipt") is True
        raise RuntimeError("caller aborts its unit")
    assert store.runtime.load_mob_host_binding(MOB_A) == b"r2"
    assert store.runtime.load_mob_host_revocation(MOB_A) is None
    with store.read() as uow, pytest.raises(ReadOnlyUnitOfWork):
        uow.runtime.delete_mob_host_binding(MOB_A, b"r2")


def test_bad_input_is_refused_and_changes_nothing(store: Store, db_url: str) -> None:
    assert store.runtime.put_mob_host_binding_if_absent(MOB_A, b"r1")
    before = _tables(db_url)
    bad: Any = "r1"  # str, not bytes
    calls: list[Callable[[Any], Any]] = [
        lambda rt: rt.put_mob_host_binding_if_absent(MOB_B, bad),
        lambda rt: rt.compare_and_put_mob_host_binding(MOB_A, bad, b"r2"),
        lambda rt: rt.compare_and_put_mob_host_binding(MOB_A, b"r1", bad),
        lambda rt: rt.delete_mob_host_binding(MOB_A, bad),
        lambda rt: rt.revoke_mob_host_binding(MOB_A, b"r1", bad),
        lambda rt: rt.revoke_mob_host_binding(MOB_A, bad, b"receipt"),
        lambda rt: rt.load_mob_host_binding(7),
        lambda rt: rt.put_mob_host_binding_if_absent(None, b"r"),
    ]
    for call in calls:
        with pytest.raises(InvalidInput):
            call(store.runtime)
        with pytest.raises(InvalidInput), store.write() as uow:
            call(uow.runtime)
    assert _tables(db_url) == before
    # bytearray / memoryview are accepted as bytes.
    views: tuple[Any, Any] = (bytearray(b"r1"), memoryview(b"r2"))
    assert store.runtime.compare_and_put_mob_host_binding(MOB_A, *views)
    assert store.runtime.load_mob_host_binding(MOB_A) == b"r2"


def test_list_orders_by_mob_id_bytewise(store: Store) -> None:
    ids = ["b", "B", "a", "_", "Z-1", "z", "é", "a b"]
    for m in ids:
        assert store.runtime.put_mob_host_binding_if_absent(m, m.encode())
        assert store.runtime.revoke_mob_host_binding(m, m.encode(), b"r-" + m.encode())
        assert store.runtime.put_mob_host_binding_if_absent(m, m.encode())
    expected = sorted(ids, key=lambda s: s.encode())
    assert [m for m, _ in store.runtime.list_mob_host_bindings()] == expected
    assert store.runtime.list_mob_host_revocations() == []


# --------------------------------------------------------------------------
# TEXT-vs-BLOB (§0.3, §5.2 item 23): normalised


def _degrade(url: str, mob_id: str) -> None:
    raw_exec(
        url,
        "UPDATE runtime_mob_host_bindings SET record_json = CAST(record_json AS TEXT) "
        "WHERE mob_id = :m",
        params={"m": mob_id},
    )
    assert raw_rows(
        url,
        "SELECT typeof(record_json) FROM runtime_mob_host_bindings WHERE mob_id = :m",
        {"m": mob_id},
    ) == [("text",)]


def _typeof(url: str, table: str, column: str, mob_id: str) -> list[tuple[Any, ...]]:
    return raw_rows(url, f"SELECT typeof({column}) FROM {table} WHERE mob_id = :m", {"m": mob_id})


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_sqlite_text_degraded_binding_is_compared_normalised(store: Store, db_url: str) -> None:
    rt = store.runtime
    for mob in ("mob-cas", "mob-del", "mob-rev", "mob-stale"):
        assert rt.put_mob_host_binding_if_absent(mob, b"record-1")
        _degrade(db_url, mob)
        assert rt.load_mob_host_binding(mob) == b"record-1"
    # A mismatch is still a mismatch.
    assert rt.compare_and_put_mob_host_binding("mob-stale", b"record-X", b"record-2") is False
    assert rt.delete_mob_host_binding("mob-stale", b"record-X") is False
    assert rt.revoke_mob_host_binding("mob-stale", b"record-X", b"receipt") is False
    assert _typeof(db_url, "runtime_mob_host_bindings", "record_json", "mob-stale") == [("text",)]
    # Matching text: compare-and-put succeeds and rewrites the row as a BLOB.
    assert rt.compare_and_put_mob_host_binding("mob-cas", b"record-1", b"record-2") is True
    assert rt.load_mob_host_binding("mob-cas") == b"record-2"
    assert _typeof(db_url, "runtime_mob_host_bindings", "record_json", "mob-cas") == [("blob",)]
    assert rt.delete_mob_host_binding("mob-del", b"record-1") is True
    assert rt.load_mob_host_binding("mob-del") is None
    assert rt.revoke_mob_host_binding("mob-rev", b"record-1", b"receipt") is True
    assert rt.load_mob_host_binding("mob-rev") is None
    assert rt.load_mob_host_revocation("mob-rev") == b"receipt"
    assert _typeof(db_url, "runtime_mob_host_revocations", "receipt_json", "mob-rev") == [("blob",)]


# --------------------------------------------------------------------------
# Races between processes: every fence has exactly one winner


@pytest.mark.slow
def test_put_if_absent_from_many_processes_has_one_winner(store: Store, db_url: str) -> None:
    mobs = [f"mob-put-{n}" for n in range(8)]
    for m in mobs[::2]:  # half of them carry an old receipt the winner must remove
        assert store.runtime.put_mob_host_binding_if_absent(m, b"old")
        assert store.runtime.revoke_mob_host_binding(m, b"old", b"old-receipt")
    results = race_processes(db_url, "body_mob_put", 4, {"mobs": mobs})
    for n, m in enumerate(mobs):
        verdicts = [racer[n] for racer in results]
        assert verdicts.count(True) == 1, verdicts
        winner = verdicts.index(True)
        assert store.runtime.load_mob_host_binding(m) == f"record-{winner}".encode()
        assert store.runtime.load_mob_host_revocation(m) is None


@pytest.mark.slow
def test_compare_and_put_from_many_processes_has_one_winner(store: Store, db_url: str) -> None:
    mobs = [f"mob-cas-{n}" for n in range(8)]
    for m in mobs:
        assert store.runtime.put_mob_host_binding_if_absent(m, b"old")
    results = race_processes(db_url, "body_mob_cas", 4, {"mobs": mobs, "old": b"old"})
    for n, m in enumerate(mobs):
        verdicts = [racer[n] for racer in results]
        assert verdicts.count(True) == 1, verdicts
        assert store.runtime.load_mob_host_binding(m) == f"record-{verdicts.index(True)}".encode()


@pytest.mark.slow
def test_revoke_from_many_processes_has_one_winner(store: Store, db_url: str) -> None:
    mobs = [f"mob-rev-{n}" for n in range(8)]
    for m in mobs:
        assert store.runtime.put_mob_host_binding_if_absent(m, b"old")
    results = race_processes(db_url, "body_mob_revoke", 4, {"mobs": mobs, "old": b"old"})
    for n, m in enumerate(mobs):
        verdicts = [racer[n] for racer in results]
        assert verdicts.count(True) == 1, verdicts
        assert store.runtime.load_mob_host_binding(m) is None
        assert store.runtime.load_mob_host_revocation(m) == (
            f"receipt-{verdicts.index(True)}".encode()
        )

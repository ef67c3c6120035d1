"""Adoption of un-versioned legacy ``runs`` files (spec runs §1.2, §1.5–1.7, §5.1).

SQLite only: legacy files exist only as SQLite files written by the original
Rust store (no Postgres database predates agentkeep). The files are built
with the ``sqlite3`` module in rollback-journal mode, as the original wrote them.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentkeep import db
from agentkeep import migrations as migrate
from agentkeep.errors import LegacySchemaMismatch
from agentkeep.runs.adoption import detect_runs_revision
from agentkeep.runs.domain import UNSET, Assignee, RunStatus
from agentkeep.store import Store

from . import _legacy as L
from ._alembic_cli import run_alembic

HEAD_COLUMNS = {n for n, _ in L.FULL_COLUMNS} | {"seq"}


def url_of(path: Path) -> str:
    return f"sqlite:///{path}"


def detected_revision(path: Path, scratch: Path) -> str | None:
    """What the adopter would stamp, read from a copy in a rolled-back transaction."""
    shutil.copyfile(path, scratch)
    engine = db.create_engine(url_of(scratch))
    try:
        with db.write_engine(engine).connect() as conn:
            trans = conn.begin()
            try:
                return detect_runs_revision(conn)
            finally:
                trans.rollback()
    finally:
        engine.dispose()


def index_columns(path: Path, name: str) -> list[str]:
    return [r[2] for r in L.query(path, f"PRAGMA index_info({name})")]


def rows_by_id(path: Path) -> dict[str, dict[str, Any]]:
    conn = sqlite3.connect(path)
    conn.row_factory = sqlite3.Row
    try:
        return {r["id"]: dict(r) for r in conn.execute("SELECT * FROM runs")}
    finally:
        conn.close()


# ----------------------------------------------------------------------------
# Every historical shape, both column orders, with and without the index


@pytest.mark.parametrize("index", [True, False], ids=["with_index", "no_index"])
@pytest.mark.parametrize("order", ["fresh", "altered"])
@pytest.mark.parametrize("shape", list(L.SHAPES))
def test_legacy_shape_is_adopted(tmp_path: Path, shape: str, order: str, index: bool) -> None:
    path = tmp_path / "legacy.db"
    L.build_legacy(path, shape, order=order, index=index)
    url = url_of(path)
    # The fixture really has the shape, order and index it claims.
    want_cols = list(L.shape_columns(shape))
    if order == "altered":
        n_added, _ = L.SHAPES[shape]
        want_cols = list(L.L0_COLUMNS) + list(L.ADDED_ORDER[:n_added])
    assert L.columns(path) == want_cols
    assert ("ix_runs_task_id" in L.names(path)) is index
    assert migrate.VERSION_TABLE not in L.names(path)
    rowid_order = [r[0] for r in L.query(path, "SELECT id FROM runs ORDER BY rowid")]
    before = rows_by_id(path)

    expected_rev = L.SHAPES[shape][1]
    assert detected_revision(path, tmp_path / "scratch.db") == expected_rev

    assert migrate.upgrade(url) == migrate.head_revisions()

    assert migrate.current(url) == migrate.head_revisions()
    assert migrate.check(url) == []
    assert set(L.columns(path)) == HEAD_COLUMNS
    assert index_columns(path, "ix_runs_task_id") == ["task_id", "created_at"]
    assert L.query(path, f"SELECT version_num FROM {migrate.VERSION_TABLE}") == [
        migrate.head_revisions()
    ]

    after = rows_by_id(path)
    assert set(after) == set(before)
    for run_id, old in before.items():
        new = after[run_id]
        for col in L.L0_COLUMNS:  # every original value kept verbatim
            assert new[col] == old[col], (run_id, col)
        assert new["degradations_json"] == "[]"
        assert new["input_json"] is None
        assert new["current_json"] is None
        assert new["next_generation"] == 0
    # seq order is the previous rowid order.
    assert [r[0] for r in L.query(path, "SELECT id FROM runs ORDER BY seq")] == rowid_order
    seqs = [r[0] for r in L.query(path, "SELECT seq FROM runs")]
    assert None not in seqs and len(set(seqs)) == len(seqs)

    with Store.open(url) as store:
        for row in L.L0_ROWS:
            rec = store.runs.get(row["id"])
            assert rec.status == RunStatus(json.loads(row["status"]))
            assert rec.created_at == row["created_at"]
            assert rec.updated_at == row["updated_at"]
            assert rec.task_id == row["task_id"]
            assert rec.operator_sid == row["operator_sid"]
            assert rec.degradations == ()
            assert rec.input_json is None
            assert rec.current == {}
            assert rec.next_generation == 0
            want_result = (
                UNSET if row["result_ref_json"] is None else json.loads(row["result_ref_json"])
            )
            assert rec.result_ref == want_result
        assert [str(e.step_id) for e in store.runs.get("R-c").step_entries] == ["ST-1"]
        assert [str(r.id) for r in store.runs.list_by_task("T-1")] == ["R-c", "R-a"]
        assert store.runs.acquire_assignee("R-a", "main", "S-op", "worker") == (1, None)
        rec = store.runs.get("R-a")
        assert rec.next_generation == 1
        assert rec.current == {"main": Assignee(op="S-op", desc="worker", gen=1)}


def test_l3_values_written_by_the_original_are_kept(tmp_path: Path) -> None:
    """An L3 row that holds a slot keeps its holder and G; acquire continues from G."""
    path = tmp_path / "legacy.db"
    L.build_legacy(path, "L3", order="fresh", index=True)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(
        "INSERT INTO runs (id, task_id, status, step_entries_json, degradations_json,"
        " current_json, next_generation, input_json, created_at, updated_at)"
        " VALUES ('R-e', 'T-9', '\"running\"', '[]', '[]',"
        ' \'{"main":{"op":"S-x","desc":"w","gen":2}}\', 2, \'opaque {\', 300, 301)'
    )
    conn.close()
    migrate.upgrade(url_of(path))
    with Store.open(url_of(path)) as store:
        rec = store.runs.get("R-e")
        assert rec.input_json == "opaque {"
        assert rec.next_generation == 2
        assert rec.current == {"main": Assignee(op="S-x", desc="w", gen=2)}
        gen, previous = store.runs.acquire_assignee("R-e", "main", "S-y", "w2")
        assert (gen, previous) == (3, Assignee(op="S-x", desc="w", gen=2))


# ----------------------------------------------------------------------------
# Refusals: nothing written, file byte-for-byte unchanged


def _l3(**replace: str) -> list[tuple[str, str]]:
    return [(n, replace.get(n, d)) for n, d in L.FULL_COLUMNS]


def _build_refused(path: Path, case: str) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        if case == "core_column_missing":
            conn.execute(L.create_table_sql([c for c in _l3() if c[0] != "operator_sid"]))
        elif case == "extra_column":
            conn.execute(L.create_table_sql([*_l3(), ("extra", "TEXT")]))
        elif case == "wrong_type":
            conn.execute(L.create_table_sql(_l3(created_at="TEXT NOT NULL")))
        elif case == "nullable_degradations":
            cols = [(n, L.DECL[n]) for n in L.shape_columns("L1")]
            cols = [(n, "TEXT DEFAULT '[]'" if n == "degradations_json" else d) for n, d in cols]
            conn.execute(L.create_table_sql(cols))
        elif case == "wrong_default":
            conn.execute(L.create_table_sql(_l3(next_generation="INTEGER NOT NULL DEFAULT 1")))
        elif case == "without_rowid":
            conn.execute(L.create_table_sql(_l3(), suffix=" WITHOUT ROWID"))
        elif case == "view":
            conn.execute(L.create_table_sql(_l3()).replace("runs (", "runs_data (", 1))
            conn.execute("CREATE VIEW runs AS SELECT * FROM runs_data")
        elif case == "index_wrong_columns":
            conn.execute(L.create_table_sql(_l3()))
            conn.execute("CREATE INDEX ix_runs_task_id ON runs(task_id)")
        elif case == "non_prefix_subset":
            cols = [(n, L.DECL[n]) for n, _ in L.FULL_COLUMNS]
            conn.execute(
                L.create_table_sql([c for c in cols if c[0] in (*L.L0_COLUMNS, "input_json")])
            )
        else:
            raise ValueError(case)
        target = "runs_data" if case == "view" else "runs"
        present = {r[1] for r in conn.execute(f"PRAGMA table_info({target})")}
        for row in L.L0_ROWS:
            r = {k: v for k, v in row.items() if k in present}
            if case == "wrong_type":
                r["created_at"] = str(r["created_at"])
            cols = ", ".join(r)
            conn.execute(
                f"INSERT INTO {target} ({cols}) VALUES ({', '.join('?' for _ in r)})",
                tuple(r.values()),
            )
    finally:
        conn.close()


#: case -> words the error message must contain (it names the differences).
REFUSALS: dict[str, tuple[str, ...]] = {
    "core_column_missing": ("missing", "operator_sid"),
    "extra_column": ("unexpected", "extra"),
    "wrong_type": ("created_at", "TEXT", "INTEGER"),
    "nullable_degradations": ("degradations_json", "nullable"),
    "wrong_default": ("next_generation", "default"),
    "without_rowid": ("WITHOUT ROWID",),
    "view": ("view",),
    "index_wrong_columns": ("ix_runs_task_id", "created_at"),
    "non_prefix_subset": ("missing columns",),
}

#: case -> the shapes that may be reported as closest (fewest differing columns).
#: L0 + input_json is one column from L2 (missing degradations_json) and one from
#: L0 (unexpected input_json), but three from L3.
CLOSEST: dict[str, tuple[str, ...]] = {
    "core_column_missing": ("L3",),
    "extra_column": ("L3",),
    "wrong_type": ("L3",),
    "nullable_degradations": ("L1",),
    "wrong_default": ("L3",),
    "index_wrong_columns": ("L3",),
    "non_prefix_subset": ("L0", "L2"),
}


def _via_upgrade(url: str) -> str:
    with pytest.raises(LegacySchemaMismatch) as info:
        migrate.upgrade(url)
    return _checked_message(info.value)


def _via_store_open(url: str) -> str:
    with pytest.raises(LegacySchemaMismatch) as info:
        Store.open(url, migrate=True)
    return _checked_message(info.value)


def _via_alembic_cli(url: str) -> str:
    proc = run_alembic("upgrade", "head", url=url)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "LegacySchemaMismatch" in proc.stderr
    assert "Nothing was modified" in proc.stderr
    return proc.stderr


def _checked_message(exc: LegacySchemaMismatch) -> str:
    assert exc.table == "runs"
    assert exc.differences
    assert "Nothing was modified" in str(exc)
    return str(exc)


ENTRY_POINTS: dict[str, Callable[[str], str]] = {
    "upgrade": _via_upgrade,
    "store_open_migrate": _via_store_open,
    "alembic_cli": _via_alembic_cli,
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("case", list(REFUSALS))
def test_unknown_shape_is_refused_and_file_untouched(tmp_path: Path, case: str, entry: str) -> None:
    path = tmp_path / "legacy.db"
    _build_refused(path, case)
    before = L.snapshot(path)
    assert before["journal_mode"] == "delete"

    message = ENTRY_POINTS[entry](url_of(path))

    L.assert_unchanged(path, before)
    assert migrate.VERSION_TABLE not in L.names(path)
    for word in REFUSALS[case]:
        assert word in message, (word, message)


@pytest.mark.parametrize("case", list(CLOSEST))
def test_refusal_names_the_closest_shape(tmp_path: Path, case: str) -> None:
    """Spec §1.7: the message names the closest shape (fewest differing columns)."""
    path = tmp_path / "legacy.db"
    _build_refused(path, case)
    with pytest.raises(LegacySchemaMismatch) as info:
        migrate.upgrade(url_of(path))
    assert info.value.closest in CLOSEST[case], str(info.value)
    assert f"closest: {info.value.closest})" in str(info.value)


# ----------------------------------------------------------------------------
# Version table states, fresh files, idempotence


def test_empty_version_table_is_treated_as_unversioned(tmp_path: Path) -> None:
    path = tmp_path / "legacy.db"
    L.build_legacy(path, "L2", order="altered", index=True)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(
        f"CREATE TABLE {migrate.VERSION_TABLE} (version_num VARCHAR(32) NOT NULL, "
        f"CONSTRAINT {migrate.VERSION_TABLE}_pkc PRIMARY KEY (version_num))"
    )
    conn.close()
    before = rows_by_id(path)
    assert migrate.current(url_of(path)) == ()

    assert migrate.upgrade(url_of(path)) == migrate.head_revisions()

    assert migrate.check(url_of(path)) == []
    after = rows_by_id(path)
    assert {k: {c: v[c] for c in L.L0_COLUMNS} for k, v in after.items()} == {
        k: {c: v[c] for c in L.L0_COLUMNS} for k, v in before.items()
    }
    assert all(r["degradations_json"] == "[]" and r["seq"] is not None for r in after.values())


RUN_TRACE_SQL = (
    "CREATE TABLE run_trace (run_id TEXT NOT NULL, seq INTEGER NOT NULL, payload TEXT, "
    "PRIMARY KEY(run_id, seq))"
)


def _empty_file(path: Path) -> None:
    path.write_bytes(b"")


def _trace_only_file(path: Path) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(RUN_TRACE_SQL)
    conn.executemany(
        "INSERT INTO run_trace VALUES (?, ?, ?)",
        [("R-1", 1, '{"e":1}'), ("R-1", 2, None), ("R-2", 1, "x")],
    )
    conn.close()


def _open_store_migrating(url: str) -> None:
    Store.open(url, migrate=True).close()


@pytest.mark.parametrize("entry", [migrate.upgrade, _open_store_migrating], ids=["upgrade", "open"])
@pytest.mark.parametrize("make", [_empty_file, _trace_only_file], ids=["empty", "trace_only"])
def test_file_without_runs_gets_runs_created(
    tmp_path: Path, make: Callable[[Path], None], entry: Callable[[str], object]
) -> None:
    path = tmp_path / "shared.db"
    make(path)
    trace_before = (
        L.query(path, "SELECT sql FROM sqlite_master WHERE name = 'run_trace'"),
        L.query(path, "SELECT run_id, seq, payload FROM run_trace ORDER BY run_id, seq")
        if "run_trace" in L.names(path)
        else None,
    )

    entry(url_of(path))

    assert migrate.current(url_of(path)) == migrate.head_revisions()
    assert migrate.check(url_of(path)) == []
    assert set(L.columns(path)) == HEAD_COLUMNS
    assert L.query(path, "SELECT COUNT(*) FROM runs") == [(0,)]
    trace_after = (
        L.query(path, "SELECT sql FROM sqlite_master WHERE name = 'run_trace'"),
        L.query(path, "SELECT run_id, seq, payload FROM run_trace ORDER BY run_id, seq")
        if "run_trace" in L.names(path)
        else None,
    )
    assert trace_after == trace_before
    with Store.open(url_of(path)) as store:
        assert store.runs.list_by_task("T-1") == []


def test_opening_a_head_database_twice_is_a_noop(tmp_path: Path) -> None:
    path = tmp_path / "legacy.db"
    L.build_legacy(path, "L1", order="fresh", index=False)
    Store.open(url_of(path), migrate=True).close()
    first = L.snapshot(path)
    assert first["journal_mode"] == "wal"

    Store.open(url_of(path), migrate=True).close()
    L.assert_unchanged(path, first)
    Store.open(url_of(path)).close()
    L.assert_unchanged(path, first)
    assert migrate.upgrade(url_of(path)) == migrate.head_revisions()
    L.assert_unchanged(path, first)


# ----------------------------------------------------------------------------
# Rollback of a failure after the stamp


def _fail_verification(monkeypatch: pytest.MonkeyPatch, path: Path) -> type[BaseException]:
    """The final drift check (after stamp and every revision) raises."""

    class Injected(RuntimeError):
        pass

    def boom(conn: object) -> list[str]:
        raise Injected("injected failure after the stamp")

    monkeypatch.setattr(migrate, "_drift", boom)
    return Injected


def _conflicting_index(monkeypatch: pytest.MonkeyPatch, path: Path) -> type[BaseException]:
    """runs_0006 cannot create ux_runs_seq: a foreign table already has an index of that name."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("CREATE TABLE host_table (x INTEGER)")
    conn.execute("CREATE INDEX ux_runs_seq ON host_table(x)")
    conn.close()
    return Exception


@pytest.mark.parametrize("inject", [_fail_verification, _conflicting_index])
def test_failure_after_stamp_rolls_everything_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inject: Callable[..., type[BaseException]]
) -> None:
    path = tmp_path / "legacy.db"
    L.build_legacy(path, "L2", order="altered", index=False)
    error = inject(monkeypatch, path)
    before = L.snapshot(path)
    assert before["journal_mode"] == "delete"
    # The failure really comes after adoption: the shape is accepted and stamped first.
    assert detected_revision(path, tmp_path / "scratch.db") == "runs_0003"

    with pytest.raises(error) as info:
        migrate.upgrade(url_of(path))
    assert not isinstance(info.value, LegacySchemaMismatch)
    if inject is _conflicting_index:
        assert "ux_runs_seq" in str(info.value)

    L.assert_unchanged(path, before)
    assert migrate.VERSION_TABLE not in L.names(path)
    assert migrate.current(url_of(path)) == ()

    if inject is _fail_verification:  # with the fault gone, the same file adopts cleanly
        monkeypatch.undo()
        assert migrate.upgrade(url_of(path)) == migrate.head_revisions()
        assert migrate.check(url_of(path)) == []

"""Synthetic v0.6.34 databases for the legacy-migrator tests (spec runtime §4 test 43).

The seed's fixture files are not published, only their names; these are
equivalents in the legacy shapes of §2.39, as the exact compact bytes
v0.6.34 stored (no trailing newline). The runtime tables use the §1.14 DDL
(Postgres: BYTEA for BLOB, BIGINT for INTEGER) plus the session store's
``sessions`` table of §1.13.

:class:`LegacyDb` is a raw handle on one such database (SQLite file or a
fresh Postgres database): committed statements with ``?`` placeholders,
payloads read back as bytes, and a full-content snapshot for "unchanged"
assertions.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo
from sqlalchemy.engine import make_url

from agentkeep.legacy.migrator import LegacyV0634MigrationDisposition
from agentkeep.runtime.domain import (
    MachineLifecycleCommit,
    ReferenceDomain,
    Session,
    StoredInputState,
)

#: The reference codec (the migrator's; expected decoder messages come from it too).
DOMAIN = ReferenceDomain()
#: The dispositions a migration report's items carry.
D = LegacyV0634MigrationDisposition

SESSION_ID = "018f0000-0000-7000-8000-000000000001"
RUNTIME_ID = f"rt:session:{SESSION_ID}"
INPUT_ID = "018f0000-0000-7000-8000-000000000002"
RUN_ID = "018f0000-0000-7000-8000-000000000003"
AUDIT = "runtime_legacy_v0_6_34_audit"
APPEND_ONLY = "legacy migration audit rows are append-only"
#: What a raw statement refused by the database raises, on either backend.
DB_ERRORS = (sqlite3.Error, psycopg.Error)


def compact(value: Any) -> bytes:
    """``serde_json::to_vec`` style: compact, keys in the given order."""
    return json.dumps(value, separators=(",", ":")).encode()


def session_snapshot(session_id: str = SESSION_ID) -> bytes:
    """A persisted session (current reference format) with one user message."""
    return DOMAIN.encode_session(Session.new(session_id).with_message("user", "hello"))


RUNTIME_STATE = b'"idle"'


def input_state(
    input_id: str = INPUT_ID, *, state: str = "consumed", outcome: Any = None, **extra: Any
) -> dict[str, Any]:
    """A v0.6.34 input-state row (consumed by default), as a JSON object."""
    value: dict[str, Any] = {
        "input_id": input_id,
        "current_state": state,
        "policy": {"version": 1, "decision": {"apply_mode": "stage_run_start"}},
        "terminal_outcome": {"outcome_type": "consumed"} if outcome is None else outcome,
        "durability": "durable",
        "idempotency_key": "idem-1",
        "attempt_count": 1,
        "recovery_count": 2,
        "history": [
            {"timestamp": "2024-05-01T10:00:00Z", "from": "accepted", "to": "queued"},
            {
                "timestamp": "2024-05-01T10:00:01.5Z",
                "from": "applied_pending_consumption",
                "to": "consumed",
                "reason": "run completed",
            },
        ],
        "last_run_id": RUN_ID,
        "last_boundary_sequence": 1,
        "created_at": "2024-05-01T10:00:00Z",
        "updated_at": "2024-05-01T10:00:01.5Z",
    }
    value.update(extra)
    return value


INPUT_STATE_CONSUMED = compact(input_state())


def receipt(run_id: str = RUN_ID, sequence: int = 1, **extra: Any) -> dict[str, Any]:
    """A v0.6.34 run boundary receipt."""
    value: dict[str, Any] = {
        "run_id": run_id,
        "boundary": "run_start",
        "contributing_input_ids": [INPUT_ID],
        "conversation_digest": "sha256:" + "ab" * 32,
        "message_count": 1,
        "sequence": sequence,
    }
    value.update(extra)
    return value


BOUNDARY_RECEIPT = compact(receipt())


def ops(**changes: Any) -> dict[str, Any]:
    """An empty v0.6.34 ops snapshot; ``changes`` patch authority_state/cursors keys."""
    authority: dict[str, Any] = {
        "operations": {},
        "completed_order": [],
        "max_completed": 256,
        "max_concurrent": None,
        "active_count": 0,
        "wait_request_id": None,
        "wait_operation_ids": [],
        "next_completion_seq": 0,
    }
    cursors = {"agent_applied_cursor": 0, "runtime_observed_seq": 0, "runtime_last_injected_seq": 0}
    value: dict[str, Any] = {
        "epoch_id": "epoch-018f0000",
        "authority_state": authority,
        "operation_specs": {},
        "completion_entries": [],
        "cursors": cursors,
    }
    for key, val in changes.items():
        if key in authority:
            authority[key] = val
        elif key in cursors:
            cursors[key] = val
        else:
            value[key] = val
    return value


OPS_LIFECYCLE_EMPTY = compact(ops())


def current_input_state() -> StoredInputState:
    """A current-format accepted input (a fresh id), as test 45 writes it."""
    return StoredInputState.new_accepted()


def current_lifecycle() -> bytes:
    """A current lifecycle record (the migrator reports it Current)."""
    return DOMAIN.encode_lifecycle(MachineLifecycleCommit(runtime_state="idle"))


SESSION_ROW = (SESSION_ID, 1714557600000, 1714557601500, 1, 42, '{"title":"legacy"}')

LEGACY_TABLES = (
    "runtime_input_states",
    "runtime_boundary_receipts",
    "runtime_session_snapshots",
    "runtime_states",
    "runtime_ops_lifecycle",
)

_DDL = {
    "runtime_input_states": "CREATE TABLE runtime_input_states (runtime_id TEXT NOT NULL, "
    "input_id TEXT NOT NULL, state_json BLOB NOT NULL, PRIMARY KEY (runtime_id, input_id))",
    "runtime_boundary_receipts": "CREATE TABLE runtime_boundary_receipts (runtime_id TEXT "
    "NOT NULL, run_id TEXT NOT NULL, sequence INTEGER NOT NULL, receipt_json BLOB NOT NULL, "
    "PRIMARY KEY (runtime_id, run_id, sequence))",
    "runtime_session_snapshots": "CREATE TABLE runtime_session_snapshots (runtime_id TEXT "
    "PRIMARY KEY, session_snapshot BLOB NOT NULL)",
    "runtime_states": "CREATE TABLE runtime_states (runtime_id TEXT PRIMARY KEY, "
    "runtime_state_json BLOB NOT NULL)",
    "runtime_ops_lifecycle": "CREATE TABLE runtime_ops_lifecycle (runtime_id TEXT PRIMARY KEY, "
    "state_json BLOB NOT NULL)",
    "sessions": "CREATE TABLE sessions (session_id TEXT PRIMARY KEY, created_at_ms INTEGER "
    "NOT NULL, updated_at_ms INTEGER NOT NULL, message_count INTEGER NOT NULL, total_tokens "
    "INTEGER NOT NULL, metadata_json TEXT NOT NULL, session_json BLOB NOT NULL)",
}

_KEYS = {
    "runtime_input_states": "runtime_id, input_id",
    "runtime_boundary_receipts": "runtime_id, run_id, sequence",
    "runtime_session_snapshots": "runtime_id",
    "runtime_states": "runtime_id",
    "runtime_ops_lifecycle": "runtime_id",
    "sessions": "session_id",
    AUDIT: "runtime_id, table_name, row_key",
}


def _norm(value: Any) -> Any:
    return bytes(value) if isinstance(value, memoryview | bytearray) else value


class LegacyDb:
    """A raw handle on one legacy database of ``backend`` ("sqlite" or "postgres").

    Attributes:
        target: what the tests pass to the migrator (a path or a Postgres URL).
        url: the SQLAlchemy URL of the same database.
    """

    def __init__(self, backend: str, target: str, url: str) -> None:
        self.backend = backend
        self.target = target
        self.url = url

    @property
    def path(self) -> Path:
        assert self.backend == "sqlite"
        return Path(self.target)

    def connect(self) -> Any:
        """A new raw DBAPI connection in autocommit mode (sqlite3 or psycopg)."""
        if self.backend == "sqlite":
            return sqlite3.connect(self.target, isolation_level=None, timeout=5)
        u = make_url(self.url)
        info = make_conninfo(
            host=u.host, port=u.port, user=u.username, password=u.password, dbname=u.database
        )
        return psycopg.connect(info, autocommit=True)

    def hold(self, statements: Sequence[str]) -> Any:
        """A new connection that ran ``statements`` inside an open transaction (not committed).

        SQLite statements run in autocommit mode, so the first should be a ``BEGIN ...``;
        Postgres opens the transaction implicitly.
        """
        conn = self.connect()
        if self.backend == "postgres":
            conn.autocommit = False
        for statement in statements:
            cursor = conn.execute(statement)
            if statement.lstrip().upper().startswith("SELECT"):
                cursor.fetchall()
        return conn

    def sql(self, text: str) -> str:
        return text if self.backend == "sqlite" else text.replace("?", "%s")

    def execute(self, text: str, params: Sequence[Any] = ()) -> int:
        """Run one statement (committed); return its row count."""
        conn = self.connect()
        try:
            return int(conn.execute(self.sql(text), tuple(params)).rowcount)
        finally:
            conn.close()

    def executemany(self, text: str, rows: Iterable[Sequence[Any]]) -> None:
        """Run one statement per row, all in one committed transaction."""
        conn = self.connect()
        try:
            if self.backend == "sqlite":
                conn.execute("BEGIN")
                conn.executemany(text, [tuple(r) for r in rows])
                conn.execute("COMMIT")
            else:
                with conn.transaction():
                    conn.cursor().executemany(self.sql(text), [tuple(r) for r in rows])
        finally:
            conn.close()

    def query(self, text: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        conn = self.connect()
        try:
            rows = conn.execute(self.sql(text), tuple(params)).fetchall()
            return [tuple(_norm(v) for v in r) for r in rows]
        finally:
            conn.close()

    def tables(self) -> set[str]:
        if self.backend == "sqlite":
            rows = self.query("SELECT name FROM sqlite_master WHERE type = 'table'")
        else:
            rows = self.query("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")
        return {r[0] for r in rows}

    def schema_objects(self) -> set[tuple[str, str]]:
        """Every table, trigger, index and (Postgres) function name: DDL leaves a trace here."""
        if self.backend == "sqlite":
            return {(t, n) for t, n in self.query("SELECT type, name FROM sqlite_master")}
        rows = self.query(
            "SELECT 'rel', relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = current_schema() UNION ALL SELECT 'trigger', tgname FROM pg_trigger "
            "WHERE NOT tgisinternal UNION ALL SELECT 'function', proname FROM pg_proc p "
            "JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = current_schema()"
        )
        return {(t, n) for t, n in rows}

    def payload(self, table: str, column: str, **where: Any) -> bytes | None:
        cond = " AND ".join(f"{k} = ?" for k in where)
        rows = self.query(f"SELECT {column} FROM {table} WHERE {cond}", tuple(where.values()))
        assert len(rows) <= 1
        return None if not rows else _payload_bytes(rows[0][0])

    def lifecycle(self, runtime_id: str = RUNTIME_ID) -> bytes | None:
        return self.payload("runtime_states", "runtime_state_json", runtime_id=runtime_id)

    def audit_original(self, runtime_id: str, table_name: str, row_key: str) -> bytes | None:
        return self.payload(
            AUDIT, "original_record", runtime_id=runtime_id, table_name=table_name, row_key=row_key
        )

    def snapshot(self) -> dict[str, list[tuple[Any, ...]]]:
        """Every row of every table (payloads as bytes), in key order."""
        out: dict[str, list[tuple[Any, ...]]] = {}
        for table in sorted(self.tables()):
            order = _KEYS.get(table, "1")
            out[table] = self.query(f"SELECT * FROM {table} ORDER BY {order}")
        return out

    def file_digest(self) -> str:
        """SHA-256 of the SQLite database file (not its -wal/-shm side files)."""
        return hashlib.sha256(self.path.read_bytes()).hexdigest()


def _payload_bytes(value: Any) -> Any:
    return value.encode() if isinstance(value, str) else value


def create_schema(
    db: LegacyDb, tables: Iterable[str] = LEGACY_TABLES, *, sessions: bool = True
) -> None:
    """Create the given legacy tables (and the foreign ``sessions`` table)."""
    names = list(tables) + (["sessions"] if sessions else [])
    conn = db.connect()
    try:
        for name in names:
            ddl = _DDL[name]
            if db.backend == "postgres":
                ddl = ddl.replace("BLOB", "BYTEA").replace("INTEGER", "BIGINT")
            conn.execute(ddl)
    finally:
        conn.close()


class _Default:
    """Marker: "the fixture row" (None means "no row")."""


FIXTURE: Any = _Default()


def insert_runtime(
    db: LegacyDb,
    runtime_id: str = RUNTIME_ID,
    *,
    lifecycle: bytes | None = RUNTIME_STATE,
    snapshot: bytes | None = FIXTURE,
    inputs: Sequence[tuple[str, bytes]] = FIXTURE,
    receipts: Sequence[tuple[str, int, bytes]] = FIXTURE,
    ops_record: bytes | None = OPS_LIFECYCLE_EMPTY,
) -> None:
    """Insert one runtime's legacy rows; ``None`` (or an empty list) leaves a row out.

    By default the fixture runtime gets test 43's snapshot, input and receipt;
    any other runtime gets none of them.
    """
    fixture = runtime_id == RUNTIME_ID
    if snapshot is FIXTURE:
        snapshot = session_snapshot() if fixture else None
    if inputs is FIXTURE:
        inputs = [(INPUT_ID, INPUT_STATE_CONSUMED)] if fixture else []
    if receipts is FIXTURE:
        receipts = [(RUN_ID, 1, BOUNDARY_RECEIPT)] if fixture else []
    if lifecycle is not None:
        db.execute(
            "INSERT INTO runtime_states (runtime_id, runtime_state_json) VALUES (?, ?)",
            (runtime_id, lifecycle),
        )
    if snapshot is not None:
        db.execute(
            "INSERT INTO runtime_session_snapshots (runtime_id, session_snapshot) VALUES (?, ?)",
            (runtime_id, snapshot),
        )
    for input_id, state in inputs:
        db.execute(
            "INSERT INTO runtime_input_states (runtime_id, input_id, state_json) VALUES (?, ?, ?)",
            (runtime_id, input_id, state),
        )
    for run_id, sequence, payload in receipts:
        db.execute(
            "INSERT INTO runtime_boundary_receipts (runtime_id, run_id, sequence, receipt_json) "
            "VALUES (?, ?, ?, ?)",
            (runtime_id, run_id, sequence, payload),
        )
    if ops_record is not None:
        db.execute(
            "INSERT INTO runtime_ops_lifecycle (runtime_id, state_json) VALUES (?, ?)",
            (runtime_id, ops_record),
        )


def build_complete_v0_6_34(db: LegacyDb) -> None:
    """Test 43's database: schema, the ``sessions`` row and the fixture runtime."""
    create_schema(db)
    db.execute(
        "INSERT INTO sessions (session_id, created_at_ms, updated_at_ms, message_count, "
        "total_tokens, metadata_json, session_json) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (*SESSION_ROW, session_snapshot()),
    )
    insert_runtime(db)


def many_input_id(i: int) -> str:
    return f"018f0000-0000-7000-9000-{i:012d}"


def many_runtime_id(i: int) -> str:
    return f"rt:bulk:{i:05d}"


def insert_many_runtimes(db: LegacyDb, count: int) -> list[str]:
    """Insert ``count`` migratable runtimes (lifecycle, one consumed input, empty ops)."""
    ids = [many_runtime_id(i) for i in range(count)]
    db.executemany(
        "INSERT INTO runtime_states (runtime_id, runtime_state_json) VALUES (?, ?)",
        [(rid, RUNTIME_STATE) for rid in ids],
    )
    db.executemany(
        "INSERT INTO runtime_input_states (runtime_id, input_id, state_json) VALUES (?, ?, ?)",
        [
            (rid, many_input_id(i), compact(input_state(many_input_id(i))))
            for i, rid in enumerate(ids)
        ],
    )
    db.executemany(
        "INSERT INTO runtime_ops_lifecycle (runtime_id, state_json) VALUES (?, ?)",
        [(rid, OPS_LIFECYCLE_EMPTY) for rid in ids],
    )
    return ids


def set_wal(db: LegacyDb) -> None:
    """Switch a SQLite fixture file to WAL mode (what the upstream store did)."""
    conn = db.connect()
    try:
        assert conn.execute("PRAGMA journal_mode = WAL").fetchone()[0] == "wal"
    finally:
        conn.close()


@contextmanager
def held(conn: Any) -> Iterator[Any]:
    """Yield ``conn`` and close it afterwards (rolling back anything open)."""
    try:
        yield conn
    finally:
        conn.close()

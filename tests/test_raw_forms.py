"""Statements psycopg would parse again at every run go through its raw cursor.

psycopg converts a named query (``%(name)s``) to Postgres's ``$n`` form and
caches the conversion only for queries of at most 4,096 bytes and 50
parameters; a longer one (the turn commit's checking statement, the full
commit's writes) was parsed again at every run (~80 µs for the checking
statement). Such a statement also compiles to a ``$n`` form
(``Compiled.raw``), which ``Driver`` sends through psycopg's ``RawCursor``
(``AsyncRawCursor`` in an async pipeline): nothing is converted per call.
Checked here by counting psycopg's uncached conversions, not by timing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy.dialects.postgresql import psycopg as pg_psycopg

from agentkeep.aio import AsyncStore
from agentkeep.sessions import commits
from agentkeep.sessions.domain import Acquired, LeaseOwnerIdentity
from agentkeep.sessions.records import (
    AppendNodes,
    HydratedSessionCheckpoint,
    RuntimeCommit,
    SessionNodeRecord,
    TokenUsage,
    UsageDelta,
)
from agentkeep.statements import CompileTarget, Statement
from agentkeep.store import Store
from tests.conftest import as_async_url

OWNER = LeaseOwnerIdentity(owner_id="owner-raw", incarnation_id="inc-raw")
SID = "sess-raw"


def test_only_statements_psycopg_would_reparse_have_a_raw_form() -> None:
    named = CompileTarget.of(pg_psycopg.dialect())
    package = [s for s in Statement.registry if not s.name.startswith("test.")]
    with_raw = [s for s in package if s.compiled(named).raw is not None]
    assert with_raw, "no statement is over psycopg's cache limits"
    for stmt in package:
        form = stmt.compiled(named)
        big = len(form.sql.encode()) > 4096
        if form.raw is None:
            assert not big, stmt.name
            continue
        assert form.raw.names is not None and "$1" in form.raw.sql, stmt.name
        assert "%(" not in form.raw.sql, stmt.name
    turn = commits._checked_turn_statement(3, 1, 1, 2, True, True, False).compiled(named)
    assert turn.raw is not None


def _commit(turn: int, lease: Any) -> RuntimeCommit:
    nodes = tuple(
        SessionNodeRecord(
            node_id=f"n{turn}-{k}",
            parent_node_id=f"n{turn}-{k - 1}" if k else (f"n{turn - 1}-2" if turn else None),
            payload={"k": k},
        )
        for k in range(3)
    )
    return RuntimeCommit(
        session_id=SID,
        expected_head_revision=turn,
        session_execution_lease=lease,
        graph=AppendNodes(nodes=nodes, leaf_node_id=nodes[-1].node_id),
        checkpoint=HydratedSessionCheckpoint(turn_state={"turn": turn}),
        usage_deltas=(
            UsageDelta(source="s", model="m", usage=TokenUsage(input_tokens=1)),
            UsageDelta(source="s", model="m", usage=TokenUsage(output_tokens=2)),
        ),
    )


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts psycopg's uncached query conversions (named queries over its cache limits)."""
    from psycopg import _queries

    seen: list[int] = []
    original = _queries._query2pg_nocache

    def counted(query: bytes, encoding: str) -> Any:
        seen.append(len(query))
        return original(query, encoding)

    monkeypatch.setattr(_queries, "_query2pg_nocache", counted)
    return seen


def test_turn_commits_on_psycopg_convert_no_query_per_call(
    pg_url: str, conversions: list[int]
) -> None:
    with Store.open(pg_url) as store:
        got = store.leases.try_claim_session_execution_lease(SID, OWNER, 600_000)
        assert isinstance(got, Acquired)
        for turn in range(8):  # the full commit, then checking ones
            result = store.commits.commit_runtime_state(_commit(turn, got.lease))
            assert result.head_revision == turn + 1
        loaded = store.commits.load_session(SID)
    assert loaded is not None and len(loaded.graph.nodes) == 24
    assert loaded.token_ledger[0].usage.input_tokens == 8
    assert conversions == []


def test_turn_commits_on_async_psycopg_convert_no_query_per_call(
    pg_url: str, conversions: list[int]
) -> None:
    async def scenario() -> int:
        astore = await AsyncStore.open(as_async_url(pg_url, "psycopg_async"))
        try:
            got = await astore.leases.try_claim_session_execution_lease(SID, OWNER, 600_000)
            assert isinstance(got, Acquired)
            for turn in range(8):
                await astore.commits.commit_runtime_state(_commit(turn, got.lease))
            loaded = await astore.commits.load_session(SID)
            assert loaded is not None
            return len(loaded.graph.nodes)
        finally:
            await astore.close()

    assert asyncio.run(scenario()) == 24
    assert conversions == []


def test_an_async_psycopg_store_after_a_sync_one_sends_its_long_statements_itself(
    pg_url: str,
) -> None:
    """Sync and async psycopg engines share one compile target (the same dialect name,
    driver name and server version); the raw cursor is taken by the connection, so a
    long statement run alone on the async adapter after a sync store compiled it stays
    the adapter's (the raw cursor there was a sync one: ``AttributeError``)."""
    with Store.open(pg_url) as store:  # a sync engine's target first
        got = store.leases.try_claim_session_execution_lease(SID, OWNER, 600_000)
        assert isinstance(got, Acquired)
        store.commits.commit_runtime_state(_commit(0, got.lease))
        store.maintenance.tombstone_nodes(SID, ["n0-2"])

    async def scenario() -> None:
        astore = await AsyncStore.open(as_async_url(pg_url, "psycopg_async"))
        try:
            await astore.maintenance.tombstone_nodes(SID, ["n0-1"])
        finally:
            await astore.close()

    asyncio.run(scenario())
    with Store.open(pg_url) as store:
        loaded = store.commits.load_session(SID)
    assert loaded is not None and [n.node_id for n in loaded.graph.nodes] == ["n0-0"]

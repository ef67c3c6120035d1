"""``sessions_0004``: the ledger totals table, backfilled from existing usage rows.

The backfill is the merge ``load_session`` computed before the revision
(``merge_token_ledger`` over the rows a load could decode, in ``seq`` order),
per session; the commit then keeps adding to it. A session whose sum would
pass ``2**63-1`` fails the upgrade and leaves the database where it was.
"""

from __future__ import annotations

from typing import Any

import pytest

from agentkeep import migrations as migrate
from agentkeep.errors import AgentkeepError
from agentkeep.sessions.commits import merge_token_ledger
from agentkeep.sessions.domain import Acquired, LeaseOwnerIdentity
from agentkeep.sessions.records import (
    HeadScope,
    RuntimeCommit,
    TokenUsage,
    UsageDelta,
    UsageLedgerEntry,
)
from agentkeep.store import Store
from tests.support import raw_exec, raw_rows

BEFORE = "merge_0004"  # everything but sessions_0004
FIELDS = (
    "input_tokens",
    "output_tokens",
    "cache_read_input_tokens",
    "cache_write_input_tokens",
    "reasoning_output_tokens",
)
INSERT = (
    "INSERT INTO usage_deltas (session_id, source, model, " + ", ".join(FIELDS) + ") "
    "VALUES (:sid, :source, :model, :i, :o, :cr, :cw, :r)"
)

# (session, source, model, counters): zero-total and reasoning-only rows, a
# corrupt (negative) row, interleaved pairs and two sessions.
ROWS: list[tuple[str, str, str, tuple[int, ...]]] = [
    ("s1", "agent", "m1", (0, 0, 0, 0, 7)),  # reasoning only: not in the ledger
    ("s1", "tool", "m2", (1, 2, 3, 4, 5)),
    ("s2", "agent", "m1", (10, 0, 0, 0, 0)),
    ("s1", "agent", "m1", (5, 0, 0, 0, 1)),
    ("s1", "tool", "m2", (-1, 9, 9, 9, 9)),  # undecodable: a load skipped it
    ("s1", "tool", "m2", (1, 1, 1, 1, 1)),
    ("s1", "agent", "m1", (0, 0, 0, 0, 0)),
    ("s2", "agent", "m1", (2**62, 0, 0, 0, 0)),
]


def expected(sid: str) -> tuple[UsageLedgerEntry, ...]:
    return merge_token_ledger(
        [
            UsageLedgerEntry(
                source=source,
                model=model,
                usage=TokenUsage(**dict(zip(FIELDS, counts, strict=True))),
            )
            for s, source, model, counts in ROWS
            if s == sid and min(counts) >= 0
        ]
    )


def insert(url: str, rows: list[tuple[str, str, str, tuple[int, ...]]]) -> None:
    for sid, source, model, (i, o, cr, cw, r) in rows:
        params: dict[str, Any] = dict(
            sid=sid, source=source, model=model, i=i, o=o, cr=cr, cw=cw, r=r
        )
        raw_exec(url, INSERT, params=params)


def test_existing_usage_is_backfilled_then_kept_by_the_commit(fresh_url: str) -> None:
    migrate.upgrade(fresh_url, BEFORE)
    insert(fresh_url, ROWS)
    migrate.upgrade(fresh_url)
    assert migrate.check(fresh_url) == []

    stored = raw_rows(
        fresh_url,
        "SELECT session_id, source, model, ordinal FROM session_usage_totals "
        "ORDER BY session_id, ordinal",
    )
    assert stored == [("s1", "tool", "m2", 0), ("s1", "agent", "m1", 1), ("s2", "agent", "m1", 0)]

    owner = LeaseOwnerIdentity(owner_id="o", incarnation_id="i")
    with Store.open(fresh_url) as store:
        for sid in ("s1", "s2"):
            got = store.leases.try_claim_session_execution_lease(sid, owner, 10**9)
            assert isinstance(got, Acquired)
            delta = UsageDelta(source="agent", model="m1", usage=TokenUsage(output_tokens=3))
            store.commits.commit_runtime_state(
                RuntimeCommit(
                    session_id=sid, session_execution_lease=got.lease, usage_deltas=(delta,)
                )
            )
            read = store.commits.load_session(sid, HeadScope())
            assert read is not None
            want = list(expected(sid))
            k = next(i for i, e in enumerate(want) if e.source == "agent")
            usage = want[k].usage.model_copy(
                update={"output_tokens": want[k].usage.output_tokens + 3}
            )
            want[k] = want[k].model_copy(update={"usage": usage})
            assert read.token_ledger == tuple(want)


def test_an_overflowing_sum_fails_the_upgrade_and_changes_nothing(fresh_url: str) -> None:
    migrate.upgrade(fresh_url, BEFORE)
    big = 2**63 - 1
    insert(fresh_url, [("s", "a", "m", (big, 0, 0, 0, 0)), ("s", "a", "m", (1, 0, 0, 0, 0))])
    with pytest.raises(AgentkeepError):
        migrate.upgrade(fresh_url)
    assert migrate.current(fresh_url) == (BEFORE,)
    assert len(raw_rows(fresh_url, "SELECT seq FROM usage_deltas")) == 2

"""Every exception a public one-call operation raises is typed, and a raising call writes nothing.

A property suite over every public operation of ``store.runs``,
``store.leases``, ``store.queue``, ``store.turn_inputs``, ``store.commits``,
``store.maintenance``, ``store.runtime``, ``store.catalog`` and
``store.checkpoint_nodes``, enumerated from the facade
objects (a new operation is covered without editing this file; one whose
parameter type has no plausible values here fails
:func:`test_every_parameter_has_plausible_values`).

Each operation is called with arguments drawn by hypothesis, per category:

* ``valid``: plausible values only (the seeded ids, values of the right
  type, missing ids, stale fences): the ordinary refusals;
* ``numbers``: an integer parameter gets a huge (2**63, 2**64, 2**70),
  negative or NaN/inf value;
* ``text``: a string parameter gets random unicode with lone surrogates and
  NUL (also behind a valid id prefix, so it reaches the database);
* ``types``: one parameter gets a value of a wrong Python type (dict, list,
  None, bytes, float, bool, str, int).

Asserted for every call: it returns, or raises an
:class:`~agentkeep.errors.AgentkeepError` or pydantic's ``ValidationError``;
and a call that raised changed nothing (a fingerprint of every agentkeep
table, row counts and a hash of the rows, is equal before and after).

The quick variant runs 8 derandomized examples per operation and category
on both backends (about 1.5 min for both); ``test_error_types_long`` (slow)
runs 60 random ones, shrinking failures. Every case must pass: the text rule
(:mod:`agentkeep.text`) and the argument check (:mod:`agentkeep.arguments`)
type what used to escape as ``UnicodeEncodeError`` / ``AttributeError``.

Each test seeds ids of its own (a run, a session with a live lease, a queued
batch, a turn input, a claim of each, a head commit, a runtime with a
snapshot, a receipt and an input state, a mob binding).
"""

from __future__ import annotations

import hashlib
import inspect
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import pydantic
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, create_engine, text

from agentkeep import migrations
from agentkeep.base import load_all_models, table_applies
from agentkeep.clock import SettableClock
from agentkeep.errors import AgentkeepError
from agentkeep.runs.domain import (
    DegradationEntry,
    RunListFilter,
    RunRecord,
    RunStatus,
    StepEntry,
)
from agentkeep.runtime import (
    MachineLifecycleCommit,
    Message,
    OpsSnapshot,
    Session,
    UnregisterFinalizationCommit,
    issue_delete_ops_finalization_authority,
)
from agentkeep.sessions.checkpoint_nodes import PendingWrite
from agentkeep.sessions.domain import (
    Acquired,
    CheckpointKind,
    ClaimBoundary,
    InputIdTarget,
    LeaseOwnerIdentity,
    NextTurnIngress,
    PendingTurnInputDraft,
    QueuedWorkClaim,
    QueuedWorkDraft,
    QueuedWorkPayload,
    SessionExecutionLease,
    SourceKeyTarget,
    TurnInputClaim,
)
from agentkeep.sessions.records import (
    ActivePathScope,
    AppendNodes,
    BlobProfile,
    FullGraphScope,
    HydratedSessionCheckpoint,
    RuntimeCommit,
    SessionMeta,
    SessionNodeRecord,
    TurnCommitStamp,
    UnchangedGraph,
)
from agentkeep.store import Store
from tests.conftest import BACKENDS, create_pg_database, drop_pg_database, require_postgres
from tests.runtime.builders import (
    accepted_input,
    encode,
    idle_lifecycle,
    input_record,
    receipt,
    unbacked_intent,
    user_session,
)

T0: Final = 1_700_000_000_000
A: Final = LeaseOwnerIdentity(owner_id="owner-A", incarnation_id="inc-A")
B: Final = LeaseOwnerIdentity(owner_id="owner-B", incarnation_id="inc-B")
TTL: Final = 3_600_000

#: The facades whose public callables are the one-call operations.
FACADES: Final = (
    "runs",
    "leases",
    "queue",
    "turn_inputs",
    "commits",
    "maintenance",
    "runtime",
    "catalog",
    "checkpoint_nodes",
)
#: Keyword-only test hooks (documented as such): left at their defaults.
HOOKS: Final = frozenset({"probe", "fault_hook"})
CATEGORIES: Final = ("valid", "numbers", "text", "types")


# --------------------------------------------------------------------------
# The operations


def _operations(store: Store) -> dict[str, Callable[..., Any]]:
    """``"runs.get" -> store.runs.get`` for every public operation of every facade."""
    ops: dict[str, Callable[..., Any]] = {}
    for facade_name in FACADES:
        facade = getattr(store, facade_name)
        for name in dir(type(facade)):
            if name.startswith("_"):
                continue
            if isinstance(inspect.getattr_static(type(facade), name), property):
                continue
            member = getattr(facade, name)
            if callable(member):
                ops[f"{facade_name}.{name}"] = member
    return ops


def _parameters(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values() if p.name not in HOOKS]


with Store.open("sqlite://") as _probe_store:
    OPERATIONS: Final = {
        name: [(p.name, str(p.annotation), p.kind) for p in _parameters(fn)]
        for name, fn in _operations(_probe_store).items()
    }


def _kinds(annotation: str) -> list[str]:
    """The alternatives of an annotation string (``"bytes | None"`` -> bytes, None)."""
    depth, part, parts = 0, "", []
    for ch in annotation.replace(" ", ""):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "|" and depth == 0:
            parts.append(part)
            part = ""
        else:
            part += ch
    return [*parts, part]


_SEQUENCE = re.compile(r"^(?:Sequence|list|tuple)\[(.*)\]$")


def _numeric(annotation: str) -> bool:
    return "int" in _kinds(annotation)


def _textual(annotation: str) -> bool:
    kinds = _kinds(annotation)
    return "str" in kinds or "Sequence[str]" in kinds


def _applies(op: str, category: str) -> bool:
    params = OPERATIONS[op]
    if category == "valid":
        return True
    if category == "numbers":
        return any(_numeric(a) for _, a, _ in params)
    if category == "text":
        return any(_textual(a) for _, a, _ in params)
    return bool(params)


# --------------------------------------------------------------------------
# Seeded state and plausible values


class Fresh:
    """A plausible value made anew for every call (a new id, a new record)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make

    def __repr__(self) -> str:
        return "Fresh(...)"


def _resolve(value: Any) -> Any:
    if isinstance(value, Fresh):
        return value.make()
    if isinstance(value, list):
        return [_resolve(v) for v in value]
    return value


@dataclass
class Seed:
    """The ids of one test's seeded rows."""

    run: str
    sid: str
    rt: str
    mob: str
    fence: SessionExecutionLease
    batch_id: str
    input_id: str
    qclaim: QueuedWorkClaim
    tclaim: TurnInputClaim
    session: Session
    receipt_run: str


def _seed(store: Store) -> Seed:
    n = uuid.uuid4().hex[:10]
    run, sid, rt, mob = f"R-{n}", f"sess-{n}", f"rt-{n}", f"mob-{n}"
    store.runs.create(RunRecord.new(run, "T-1", created_at=T0 // 1000))
    store.runs.acquire_assignee(run, "planner", "S-worker-1", "writes a plan")
    got = store.leases.try_claim_session_execution_lease(sid, A, TTL)
    assert isinstance(got, Acquired)
    fence = got.lease

    def batch(body: int) -> QueuedWorkDraft:
        return QueuedWorkDraft(
            session_id=sid, payloads=(QueuedWorkPayload(kind="user_input", body=body),)
        )

    store.queue.enqueue_queued_work(batch(1))
    qclaim = store.queue.claim_ready_queued_work(sid, fence, A, ClaimBoundary.IDLE, 1)
    assert qclaim is not None
    batch_id = store.queue.enqueue_queued_work(batch(2)).batch_id
    draft = PendingTurnInputDraft(session_id=sid, ingress=NextTurnIngress(), input={"n": 1})
    store.turn_inputs.enqueue_pending_turn_input(draft)
    tclaim = store.turn_inputs.claim_next_turn_inputs(sid, fence, A, 1)
    assert tclaim is not None
    input_id = store.turn_inputs.enqueue_pending_turn_input(draft).input_id
    node = SessionNodeRecord(node_id="n1", parent_node_id=None, timestamp=1, payload={"n": 1})
    store.commits.commit_runtime_state(
        RuntimeCommit(
            session_id=sid,
            expected_head_revision=0,
            session_execution_lease=fence,
            graph=AppendNodes(nodes=(node,), leaf_node_id="n1"),
            checkpoint=HydratedSessionCheckpoint(turn_state={"turn": 1}),
        )
    )
    store.commits.save_session_meta(
        SessionMeta(session_id=sid, session_name="seeded", created_at="2024-01-01", model="m")
    )
    session = user_session("hello")
    boundary = receipt(1)
    store.runtime.atomic_apply(rt, encode(session), boundary, [input_record()], session.id)
    store.runtime.persist_ops_lifecycle(rt, OpsSnapshot(epoch_id="epoch-1"))
    store.runtime.put_mob_host_binding_if_absent(mob, b"binding-1")
    store.runtime.persist_auth_oauth_flow_snapshot(b"flow-1")
    return Seed(
        run, sid, rt, mob, fence, batch_id, input_id, qclaim, tclaim, session, boundary.run_id
    )


def _by_name(seed: Seed) -> dict[str, list[Any]]:
    """Plausible values of ``str``, ``int`` and ``bytes`` parameters, by parameter name."""
    snapshots = [encode(seed.session), encode(user_session("other"))]
    mob_records = [b"binding-1", b"binding-2"]
    return {
        "run_id": [seed.run, seed.receipt_run, "R-missing"],
        "task_id": ["T-1", "T-missing"],
        "slot": ["planner", "critic"],
        "op": ["S-worker-2"],
        "desc": ["writes a plan"],
        "value": ['{"a": 1}', "not json"],
        "session_id": [seed.sid, "sess-missing"],
        "batch_id": [seed.batch_id, "batch-missing"],
        "batch_ids": [seed.batch_id, "batch-missing"],
        "node_ids": ["n1", "n-missing"],
        "turn_id": ["turn-1"],
        "node_id": ["n1", "n-missing"],
        "runtime_id": [seed.rt, "rt-missing"],
        "input_id": [seed.input_id],
        "mob_id": [seed.mob, "mob-missing"],
        "session_store_key": [seed.session.id, None],
        "expected_gen": [0, 1, 2],
        "ttl_ms": [1_000, TTL],
        "max_batches": [1, 5],
        "max_inputs": [1, 5],
        "sequence": [1, 2],
        "session_snapshot": snapshots,
        "expected_current": snapshots,
        "replacement": snapshots,
        "expected": mob_records,
        "expected_binding": mob_records,
        "next_record": mob_records,
        "record": mob_records,
        "receipt": [b"revocation-1"],
        "snapshot": [b"flow-2"],
        # the session catalog and checkpoint nodes
        "prefix": ["sess-", ""],
        "after": ["sess-"],
        "limit": [1, 100],
        "body": [b"checkpoint", b"\x00\xff"],
        "node_json": ['{"type": "msgpack"}'],
        "parent_node_id": ["n1"],
        "lease_session_id": [seed.sid],
        "renew_ms": [TTL],
        "task_path": ["", "p"],
        "run_ids": [seed.run, "R-missing"],
        "before": ["n2"],
        "source_session_id": [seed.sid, "sess-missing"],
        "target_session_id": [f"{seed.sid}-copy"],
    }


def _by_type(seed: Seed) -> dict[str, list[Any]]:
    """Plausible values by annotation (model, enum or sequence type name)."""
    stale = seed.fence.model_copy(update={"lease_token": "stale-token"})
    rewritten, transcript = user_session("a", "b").rewrite(
        0, 2, [Message(role="assistant", content="summary")], actor="actor", compaction=False
    )
    del rewritten
    return {
        "RunRecord": [
            Fresh(lambda: RunRecord.new(f"R-{uuid.uuid4().hex[:8]}", "T-1", created_at=1)),
            RunRecord.new(seed.run, "T-1", created_at=1),
        ],
        "RunStatus": list(RunStatus),
        "StepEntry": [StepEntry(step_id="ST-1", at=1)],
        "DegradationEntry": [DegradationEntry(tool="t", error="e", fallback="f", at=1)],
        "RunListFilter": [RunListFilter(), RunListFilter(task_id="T-1", limit=2)],
        "LeaseFence": [seed.fence, stale],
        "LeaseOwnerIdentity": [A, B],
        "QueuedWorkClaim": [seed.qclaim],
        "QueuedWorkCompletion": [seed.qclaim.completion()],
        "TurnInputClaim": [seed.tclaim],
        "TurnInputCompletion": [seed.tclaim.completion()],
        "ClaimBoundary": list(ClaimBoundary),
        "CheckpointKind": list(CheckpointKind),
        "BlobProfile": list(BlobProfile),
        "CancelTarget": [InputIdTarget(input_id=seed.input_id), SourceKeyTarget(source_key="k")],
        "QueuedWorkDraft": [
            Fresh(
                lambda: QueuedWorkDraft(
                    session_id=seed.sid,
                    source_key=uuid.uuid4().hex,
                    payloads=(QueuedWorkPayload(kind="user_input", body=3),),
                )
            )
        ],
        "PendingTurnInputDraft": [
            PendingTurnInputDraft(session_id=seed.sid, ingress=NextTurnIngress(), input=[1])
        ],
        "RuntimeCommit": [
            Fresh(
                lambda: RuntimeCommit(
                    session_id=seed.sid,
                    expected_head_revision=None,
                    session_execution_lease=seed.fence,
                    graph=UnchangedGraph(leaf_node_id=None),
                    checkpoint=HydratedSessionCheckpoint(turn_state={"turn": 2}),
                    turn_commit=TurnCommitStamp(
                        session_id=seed.sid, turn_id=uuid.uuid4().hex, turn_commit_hash="h"
                    ),
                )
            )
        ],
        "LoadScope": [FullGraphScope(), ActivePathScope(leaf_node_id=None)],
        "SessionMeta": [
            SessionMeta(session_id=seed.sid, session_name="renamed", created_at="x", model="m")
        ],
        "RunBoundaryReceipt": [Fresh(lambda: receipt(1))],
        "InputStatePersistenceRecord": [Fresh(input_record)],
        "StoredInputState": [Fresh(accepted_input)],
        "InputStateRecord": [Fresh(input_record), Fresh(accepted_input)],
        "MachineLifecycleCommit": [idle_lifecycle(), MachineLifecycleCommit(runtime_state="idle")],
        "TranscriptCommit": [transcript],
        "UnregisterFinalizationCommit": [
            UnregisterFinalizationCommit(
                lifecycle=idle_lifecycle(),
                input_states=(input_record(),),
                retired_ops_epoch="epoch-1",
                authority=issue_delete_ops_finalization_authority(),
            )
        ],
        "OpsSnapshot": [OpsSnapshot(epoch_id="epoch-1"), OpsSnapshot(epoch_id="epoch-2")],
        "ProjectionId": [unbacked_intent(seed.session.id).projection],
        "OAuthFlowUpdate": [lambda current: (current or b"") + b"+"],
        "PendingWrite": [
            PendingWrite(0, "messages", "msgpack", b"v"),
            PendingWrite(-1, "__error__", "msgpack", b"e"),
        ],
        "bool": [True, False],
        "object": [{"ok": True}, [1, "two"], "text", 3, None],
        "None": [None],
    }


@dataclass
class Pools:
    """The plausible values of one test's seed, by parameter name and by type."""

    names: dict[str, list[Any]]
    types: dict[str, list[Any]]

    @classmethod
    def of(cls, seed: Seed) -> Pools:
        return cls(_by_name(seed), _by_type(seed))


def _plausible(pools: Pools, name: str, annotation: str) -> list[Any]:
    """Plausible values for parameter ``name: annotation`` (empty: unknown)."""
    out: list[Any] = []
    for kind in _kinds(annotation):
        if kind in ("str", "int", "bytes"):
            out += pools.names.get(name, [])
            continue
        seq = _SEQUENCE.match(kind)
        if seq:
            inner = [v for k in _kinds(seq.group(1)) for v in _plausible(pools, name, k)]
            if inner:
                out += [[], inner[:1], inner[:2]]
            continue
        out += pools.types.get(kind, [])
    return out


# --------------------------------------------------------------------------
# Hostile values

EVIL_CHARS: Final = ["\x00", "\ud800", "\udbff", "\udc00", "\udfff"]
EVIL_TEXT: Final = st.one_of(
    st.sampled_from(["\x00", "a\x00b", "\ud800", "x\udfffy", "\ud83d\x00"]),
    st.text(st.one_of(st.characters(), st.sampled_from(EVIL_CHARS)), min_size=1, max_size=16),
).filter(lambda s: any(c in s for c in EVIL_CHARS))
#: Ids with a prefix rule: the hostile text follows a valid prefix so that it gets past it.
PREFIXES: Final = {"run_id": "R-", "task_id": "T-", "op": "S-"}
EVIL_NUMBERS: Final = st.sampled_from(
    [2**63, 2**64, 2**70, -(2**70), -(2**63) - 1, -1, float("nan"), float("inf"), -float("inf")]
)
WRONG_TYPES: Final = st.sampled_from(
    [{}, {"a": 1}, [], [1, "x"], (), None, b"", b"\x00\xff", 0.5, float("nan"), True, "text", 7]
)


def _accepts(annotation: str, value: Any) -> bool:
    """True when ``value`` has a type ``annotation`` accepts (not a wrong type)."""
    kinds = _kinds(annotation)
    if "object" in kinds or "Any" in kinds:
        return True
    if value is None:
        return "None" in kinds
    if isinstance(value, bool):
        return "bool" in kinds
    for kind, types in (("str", str), ("int", int), ("bytes", bytes), ("float", float)):
        if kind in kinds and isinstance(value, types):
            return True
    return isinstance(value, (list, tuple)) and any(_SEQUENCE.match(k) for k in kinds) and not value


def _arguments(
    data: st.DataObject, pools: Pools, params: list[tuple[str, str, Any]], category: str
) -> dict[str, Any]:
    """One call's arguments: plausible values, one hostile one for the category."""
    chosen: str | None = None
    if category != "valid":
        eligible = [
            n
            for n, a, _ in params
            if category == "types"
            or (category == "numbers" and _numeric(a))
            or (category == "text" and _textual(a))
        ]
        chosen = data.draw(st.sampled_from(eligible), label="hostile parameter")
    args: dict[str, Any] = {}
    for name, annotation, _ in params:
        if name != chosen:
            pool = _plausible(pools, name, annotation)
            args[name] = _resolve(data.draw(st.sampled_from(pool), label=name))
            continue
        if category == "numbers":
            args[name] = data.draw(EVIL_NUMBERS, label=name)
        elif category == "text":
            evil = data.draw(EVIL_TEXT, label=name)
            if data.draw(st.booleans(), label="after a valid prefix"):
                evil = PREFIXES.get(name, "") + evil
            args[name] = [evil] if "Sequence[str]" in _kinds(annotation) else evil
        else:
            args[name] = data.draw(
                WRONG_TYPES.filter(lambda v, a=annotation: not _accepts(a, v)), label=name
            )
    return args


# --------------------------------------------------------------------------
# The databases and the fingerprint


@dataclass
class Target:
    store: Store
    observer: Engine
    tables: list[str]
    #: SQLite: the last fingerprint, keyed by the observer connection and its
    #: ``PRAGMA data_version`` then (see :func:`fingerprint`).
    last: tuple[tuple[int, int], dict[str, tuple[int, str]]] | None = None


@pytest.fixture(scope="module", params=BACKENDS)
def target(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Target]:
    """A migrated database of the backend, with a store on a fixed clock, for the module."""
    backend = request.param
    if backend == "postgres":
        require_postgres()
        url = create_pg_database("agentkeep_errtypes")
    else:
        url = f"sqlite:///{tmp_path_factory.mktemp('errtypes') / 'agentkeep.db'}"
    migrations.upgrade(url)
    store = Store.open(url, clock=SettableClock(T0))
    observer = create_engine(url)  # a plain engine (no agentkeep hooks), pooled: one connection
    dialect = "postgresql" if backend == "postgres" else "sqlite"
    tables = [t.name for t in load_all_models().sorted_tables if table_applies(t, dialect)]
    try:
        yield Target(store, observer, tables)
    finally:
        store.close()
        observer.dispose()
        if backend == "postgres":
            drop_pg_database(url)


def fingerprint(target: Target) -> dict[str, tuple[int, str]]:
    """Every agentkeep table: its row count and a hash of its rows (sorted), as stored.

    Postgres hashes server-side, every table in one statement; SQLite reads the rows.
    """
    with target.observer.connect() as conn:
        if conn.dialect.name == "postgresql":
            sql = " UNION ALL ".join(
                f"SELECT '{t}', count(*), md5(coalesce(string_agg(r::text, '|' "
                f"ORDER BY r::text), '')) FROM \"{t}\" r"
                for t in target.tables
            )
            return {t: (int(n), str(h)) for t, n, h in conn.execute(text(sql))}
        # PRAGMA data_version changes (for this connection) exactly when another
        # connection commits a change to the file: while it is the same, the rows
        # are the ones last hashed, and reading them all again (the suite's
        # costliest step, as the module's file grows) would give the same result.
        raw = conn.connection.dbapi_connection
        version = conn.execute(text("PRAGMA data_version")).scalar_one()
        key = (id(raw), int(version))
        if target.last is not None and target.last[0] == key:
            return dict(target.last[1])
        out: dict[str, tuple[int, str]] = {}
        for table in target.tables:
            rows = conn.execute(text(f'SELECT * FROM "{table}"')).all()
            plain = sorted(repr(tuple(r)) for r in rows)
            out[table] = (len(rows), hashlib.sha256("\n".join(plain).encode()).hexdigest())
        target.last = (key, out)
        return dict(out)


# --------------------------------------------------------------------------
# The property


def _check(target: Target, op: str, category: str, *, max_examples: int, quick: bool) -> None:
    pools = Pools.of(_seed(target.store))
    fn = _operations(target.store)[op]
    params = OPERATIONS[op]

    @settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=quick,
        database=None,
        # The quick variant reports the first failing example as found (no shrinking).
        phases=(Phase.explicit, Phase.reuse, Phase.generate) if quick else tuple(Phase),
        report_multiple_bugs=not quick,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(data=st.data())
    def call_once(data: st.DataObject) -> None:
        args = _arguments(data, pools, params, category)
        positional = [args[n] for n, _, k in params if k is not inspect.Parameter.KEYWORD_ONLY]
        keywords = {n: args[n] for n, _, k in params if k is inspect.Parameter.KEYWORD_ONLY}
        before = fingerprint(target)
        try:
            fn(*positional, **keywords)
        except (AgentkeepError, pydantic.ValidationError):
            after = fingerprint(target)
            changed = sorted(t for t in before if before[t] != after[t])
            assert not changed, f"{op} raised but changed {changed}"
        except Exception as exc:
            raise AssertionError(
                f"{op}({args!r}) raised {type(exc).__module__}.{type(exc).__name__}: {exc}"
            ) from exc

    call_once()


def _cases() -> list[Any]:
    cases = []
    for op in sorted(OPERATIONS):
        for category in CATEGORIES:
            if not _applies(op, category):
                continue
            cases.append(pytest.param(op, category, id=f"{op}-{category}"))
    return cases


@pytest.mark.parametrize(("op", "category"), _cases())
def test_error_types(target: Target, op: str, category: str) -> None:
    _check(target, op, category, max_examples=8, quick=True)


@pytest.mark.slow
@pytest.mark.parametrize(("op", "category"), _cases())
def test_error_types_long(target: Target, op: str, category: str) -> None:
    _check(target, op, category, max_examples=60, quick=False)


def test_every_parameter_has_plausible_values(target: Target) -> None:
    """A new operation (or parameter type) needs plausible values here to be covered."""
    pools = Pools.of(_seed(target.store))
    missing = [
        f"{op}({name}: {annotation})"
        for op, params in OPERATIONS.items()
        for name, annotation, _ in params
        if not _plausible(pools, name, annotation)
    ]
    assert not missing, missing
    assert len(OPERATIONS) > 80  # every facade was enumerated


def test_the_fingerprint_sees_every_kind_of_write(target: Target) -> None:
    """The "nothing written" check can fail: an insert, an update and a delete each change it."""
    seed = _seed(target.store)
    before = fingerprint(target)
    target.store.runs.update_status(seed.run, RunStatus.RUNNING)
    updated = fingerprint(target)
    assert [t for t in before if before[t] != updated[t]] == ["runs"]
    target.store.runtime.persist_auth_oauth_flow_snapshot(b"flow-changed")
    target.store.runs.delete(seed.run)
    after = fingerprint(target)
    assert after["runs"][0] == updated["runs"][0] - 1
    assert after["runtime_auth_oauth_flow_state"] != updated["runtime_auth_oauth_flow_state"]

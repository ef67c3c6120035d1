"""A model-based state machine of leases, queued work and turn inputs (sessions §2.5–2.7, §3, §5.1).

Hypothesis drives random sequences of the coordination operations against a
real store (both backends; ``Store.open`` from the backend's URL inside the
machine, one :class:`SettableClock` per run) next to a small in-memory model,
on two sessions with four owner identities:

* ``A`` and ``B`` are :class:`LocalProcess` owners on one host and boot, so a
  reclaim between them asks the injected probe; ``A_OPAQUE`` is ``A``'s owner
  and incarnation with ``Opaque`` liveness (same incarnation: liveness is
  ignored); ``C`` is ``Opaque``.
* Lease rules: try_claim, reclaim (probe drawn: gone / alive / unknown), renew,
  release, advance the clock.
* Queued work: enqueue (session commands, turn work, rarely a mixed batch; slot,
  merge and delivery policies; ``available_at`` around now; source keys reused
  with the same or changed content), claim the leading session command, claim
  ready turn work (Idle or ActiveTurnCheckpoint, ``max_batches`` 0–4), claim by
  batch ids (any order, duplicates, foreign and deleted ids), abandon, complete
  (exact ids, reordered, and wrong lists that must be refused), cancel.
* Turn inputs: enqueue (ActiveTurn / NextTurn, derived or explicit ids,
  source keys), claim active / next, abandon, complete (exact or wrong),
  cancel targets, suffix cancel, recover stale accepted claims.

Each run opens with one initialize step (also compared call by call): both
sessions leased, a few batches and inputs, a round of claims, often a new
generation (those claims go stale) with a second round, recoveries and a
completion of each kind — so that 30 steps reach the deep states.

The model predicts every outcome exactly — the value (claims, ids, tokens,
counters, snapshots), ``None``, ``Busy`` vs ``Acquired``, or the typed error —
using the domain selection functions (:func:`select_leading_session_command`,
:func:`select_turn_work_claim_prefix`, ``admits_checkpoint``) as the spec of
which rows a claim takes. After every step the full observable state is
compared: the lease (``get_session_execution_lease`` and the raw generation),
``list_queued_work`` / ``list_pending_queued_work``, ``list_turn_inputs`` /
``list_pending_turn_inputs``; and invariants I-1, I-2, I-4, I-5, I-6, I-7
and I-10 are asserted on the store's answers. I-3 (a typed error writes
nothing) follows from the full comparison after every refused call.

Where the module docstrings settle what the spec leaves open, the model follows
them: strict completion (set equality, no duplicates; order irrelevant),
queued-work source-key conflicts, the submitted ingress for turn-input
idempotency, claims returning pre-update batches but post-update inputs, and
the fenced stale-claim recovery.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import text

from agentkeep.clock import SettableClock
from agentkeep.errors import (
    AgentkeepError,
    InvalidInput,
    PendingTurnInputSourceKeyConflict,
    QueuedWorkClaimSuperseded,
    QueuedWorkSourceKeyConflict,
    SessionCorrupt,
    SessionExecutionLeaseExpired,
    TurnInputClaimSuperseded,
    TurnInputDuplicate,
)
from agentkeep.sessions.domain import (
    MAX_I64,
    Acquired,
    ActiveTurnIngress,
    ActiveTurnMode,
    AlreadyCancelled,
    AlreadyClaimed,
    AlreadyCompleted,
    AnchorNotFound,
    Busy,
    Cancelled,
    CancelOutcome,
    CancelResult,
    CancelTarget,
    CheckpointKind,
    ClaimBoundary,
    ClaimDiagnostics,
    DeliveryPolicy,
    InputIdTarget,
    LeaseFence,
    LeaseOwnerIdentity,
    LocalProcess,
    MergeKey,
    MinBoundary,
    NextTurnIngress,
    NextTurnMode,
    NotFoundOutcome,
    Opaque,
    PendingTurnInput,
    PendingTurnInputDraft,
    QueuedWorkBatch,
    QueuedWorkClaim,
    QueuedWorkClass,
    QueuedWorkDraft,
    QueuedWorkItem,
    QueuedWorkPayload,
    SessionExecutionLease,
    SlotPolicy,
    SourceKeyTarget,
    SuffixOutcomes,
    TurnInputClaim,
    TurnInputState,
    claim_lease_token,
    same_incarnation,
    select_leading_session_command,
    select_turn_work_claim_prefix,
)
from agentkeep.sessions.liveness import ProcessProbe, ProcessState
from agentkeep.store import Store

T0 = 1_700_000_000_000
SCAN_SLACK = 32

HOST, BOOT = "host-1", "boot-1"
A = LeaseOwnerIdentity(
    owner_id="owner-a",
    incarnation_id="inc-a",
    liveness=LocalProcess(host_id=HOST, boot_id=BOOT, pid=101, process_start="1001"),
)
A_OPAQUE = LeaseOwnerIdentity(owner_id="owner-a", incarnation_id="inc-a", liveness=Opaque())
B = LeaseOwnerIdentity(
    owner_id="owner-b",
    incarnation_id="inc-b",
    liveness=LocalProcess(host_id=HOST, boot_id=BOOT, pid=202, process_start="2002"),
)
C = LeaseOwnerIdentity(owner_id="owner-c", incarnation_id="inc-c")
OWNERS = (A, A_OPAQUE, B, C)

# The first value of each list is what Hypothesis draws most: make it the productive one.
TTLS = st.sampled_from([120_000, 5_000, 1_000, 100, 1, 0, 120_000, 30_000])
#: Batch classes: a mixed batch fails every scanned claim of its session until cancelled (rare).
KLASSES = ["turn"] * 12 + ["command"] * 6 + ["mixed"] + ["turn"] * 12 + ["command"] * 6
OFTEN = st.sampled_from([True, True, False])
MAXES = st.sampled_from([2, 1, 4, 3, 0])  # max_batches / max_inputs
ADVANCES = st.sampled_from([1, 50, 100, 999, 1_000, 5_000, 40_000, 200_000])
QUEUE_KEYS = ("qk0", "qk1", "qk2")
INPUT_KEYS = ("tk0", "tk1", "tk2")
TURNS = ("t1", "t2")
BODIES = st.one_of(
    st.none(),
    st.integers(0, 3),
    st.sampled_from(["x", "y"]),
    st.fixed_dictionaries({"n": st.integers(0, 2), "s": st.sampled_from(["a", "b"])}),
)
MERGE_KEYS = (
    MergeKey.of_group("g1"),
    MergeKey.payload_default(),
    MergeKey.never(),
    MergeKey.of_group("g2"),
)

#: Set by the test function before the machine runs: the backend's migrated database.
_URL: str | None = None

T = TypeVar("T")
Outcome = tuple[str, Any]


def attempt(fn: Callable[[], T]) -> Outcome:
    """``("ok", value)`` or ``("err", <typed error class>)``."""
    try:
        return ("ok", fn())
    except AgentkeepError as exc:
        return ("err", type(exc))


@dataclass(frozen=True)
class LeaseRow:
    """The model's ``session_execution_leases`` row."""

    owner: LeaseOwnerIdentity | None
    token: str | None
    fencing: int
    claimed_at: int
    expires: int


def definitely_dead(holder: LeaseOwnerIdentity, claimant: LeaseOwnerIdentity, probe: str) -> bool:
    """§4.14 with the probe's answer: both LocalProcess, same host and boot, holder gone."""
    h, c = holder.liveness, claimant.liveness
    return (
        isinstance(h, LocalProcess)
        and isinstance(c, LocalProcess)
        and h.host_id == c.host_id
        and h.boot_id == c.boot_id
        and probe == "gone"
    )


def fixed_probe(answer: str) -> ProcessProbe:
    """An injected process probe that always answers ``answer``."""
    assert answer in ("gone", "alive", "unknown")

    def probe(pid: int, process_start: str) -> ProcessState:
        return answer  # type: ignore[return-value]  # checked above

    return probe


def sat(n: int) -> int:
    return min(n, MAX_I64)


class SessionStoreMachine(RuleBasedStateMachine):
    """The store under test next to the model; compared after every step."""

    def __init__(self) -> None:
        super().__init__()
        assert _URL is not None, "the test function sets _URL before running the machine"
        self.clock = SettableClock(T0)
        self.store = Store.open(_URL, clock=self.clock)
        tag = uuid.uuid4().hex[:10]  # fresh sessions and explicit ids per run (one db per test)
        self.sids = (f"sm-{tag}-s0", f"sm-{tag}-s1")
        self.explicit_ids = tuple(f"in-{tag}-{k}" for k in range(3))
        self.lease: dict[str, LeaseRow | None] = {s: None for s in self.sids}
        self.fences: dict[str, list[SessionExecutionLease]] = {s: [] for s in self.sids}
        self.batches: dict[str, list[QueuedWorkBatch]] = {s: [] for s in self.sids}
        self.inputs: dict[str, list[PendingTurnInput]] = {s: [] for s in self.sids}
        self.deleted_batch_ids: list[str] = []
        self.queue_drafts: list[QueuedWorkDraft] = []
        self.input_drafts: list[PendingTurnInputDraft] = []
        self.qclaims: list[QueuedWorkClaim] = []
        self.tclaims: list[TurnInputClaim] = []
        self.last_batch_seq = 0
        self.last_input_seq = 0
        self.seen_fencing: dict[str, int] = {}
        self.seen_counter: dict[str, int] = {}

    def teardown(self) -> None:
        self.store.close()

    # ------------------------------------------------------------------ model helpers

    @property
    def now(self) -> int:
        return self.clock.now_ms()

    def check(self, op: str, got: Outcome, expected: Outcome) -> None:
        assert got == expected, f"{op}:\n  store: {got!r}\n  model: {expected!r}"

    def live_row(self, sid: str) -> LeaseRow | None:
        row = self.lease[sid]
        if row is None or row.token is None or not row.expires > self.now:
            return None
        return row

    def holder(self, sid: str) -> SessionExecutionLease | None:
        """The stored lease as ``get_session_execution_lease`` shows it (live or expired)."""
        row = self.lease[sid]
        if row is None or row.token is None:
            return None
        assert row.owner is not None
        return SessionExecutionLease(
            session_id=sid,
            owner=row.owner,
            lease_token=row.token,
            fencing_token=row.fencing,
            claimed_at_epoch_ms=row.claimed_at,
            expires_at_epoch_ms=row.expires,
        )

    def fence_ok(self, sid: str, fence: LeaseFence) -> bool:
        """FENCE_OK (§0.4) in the model."""
        row = self.lease[sid]
        return (
            fence.session_id == sid
            and row is not None
            and row.owner is not None
            and same_incarnation(row.owner, fence.owner)
            and row.token == fence.lease_token
            and row.fencing == fence.fencing_token
            and row.expires > self.now
        )

    def claim_live(self, sid: str, token: str | None, generation: int) -> bool:
        """CLAIM_LIVE (§0.4): claimed under the generation of a live lease."""
        row = self.live_row(sid)
        return token is not None and row is not None and row.fencing == generation

    def acquire(self, sid: str, owner: LeaseOwnerIdentity, ttl: int) -> LeaseRow:
        """§2.5.1: generation + 1, the plain-text token, ``expires = now + ttl``."""
        row = self.lease[sid]
        fencing = sat((0 if row is None else row.fencing) + 1)
        now = self.now
        token = f"{sid}:{owner.owner_id}:{owner.incarnation_id}:{now}:{fencing}"
        return LeaseRow(owner, token, fencing, now, sat(now + ttl))

    def lease_of(self, sid: str, row: LeaseRow, owner: LeaseOwnerIdentity) -> SessionExecutionLease:
        assert row.token is not None
        return SessionExecutionLease(
            session_id=sid,
            owner=owner,
            lease_token=row.token,
            fencing_token=row.fencing,
            claimed_at_epoch_ms=row.claimed_at,
            expires_at_epoch_ms=row.expires,
        )

    def draw_fence(
        self, data: st.DataObject, sid: str, *, rarely_current: bool = False
    ) -> LeaseFence:
        """Mostly the session's current holder; else a lease seen, the other session's, or bogus."""
        other = self.sids[1 - self.sids.index(sid)]
        kinds = ["current"] * 5 + ["known", "known", "other", "bogus"]
        if rarely_current:  # release: keep leases around long enough to be used
            kinds = ["known", "bogus", "known", "other", "current"]
        kind = data.draw(st.sampled_from(kinds))
        current = self.holder(sid)
        if kind == "current" and current is not None:
            return current
        if kind in ("current", "known") and self.fences[sid]:
            return data.draw(st.sampled_from(self.fences[sid][::-1]))
        if kind == "other" and self.holder(other) is not None:
            held = self.holder(other)
            assert held is not None
            return held
        return LeaseFence(
            session_id=sid,
            owner=data.draw(st.sampled_from(OWNERS)),
            lease_token="not-a-lease-token",
            fencing_token=data.draw(st.integers(0, 3)),
        )

    def draw_claim_owner(self, data: st.DataObject, fence: LeaseFence) -> LeaseOwnerIdentity:
        return data.draw(st.sampled_from([fence.owner, fence.owner, fence.owner, *OWNERS]))

    # ------------------------------------------------------------------ a busy start

    @initialize(
        data=st.data(),
        owners=st.lists(st.sampled_from(OWNERS), min_size=2, max_size=2),
        n_batches=st.sampled_from([4, 3, 5, 2, 1, 0]),
        n_inputs=st.sampled_from([4, 3, 5, 2, 1, 0]),
    )
    def start(
        self,
        data: st.DataObject,
        owners: list[LeaseOwnerIdentity],
        n_batches: int,
        n_inputs: int,
    ) -> None:
        """Both sessions leased (120 s), some batches, inputs and claims, often a new generation."""
        for sid, owner in zip(self.sids, owners, strict=True):
            self.do_try_claim(sid, owner, 120_000)
        for _ in range(n_batches):
            self.do_enqueue_batch(self.draw_queue_draft(data))
        for _ in range(n_inputs):
            self.do_enqueue_input(self.draw_input_draft(data))
        # Claims from the start, so that completion, abandon, cancel and recovery meet them;
        # often a new generation at once (those claims go stale) and a second round of claims.
        self.claims_round(data)
        if data.draw(OFTEN):
            self.clock.advance(120_000)
            for sid in self.sids:
                self.do_try_claim(sid, data.draw(st.sampled_from(OWNERS)), 120_000)
            if data.draw(OFTEN):
                self.claims_round(data)
            for sid in self.sids:
                if data.draw(OFTEN):
                    holder = self.holder(sid)
                    assert holder is not None
                    self.do_recover(sid, holder)
        # And a completion of each kind, right or wrong, under a session's current lease.
        if data.draw(OFTEN) and self.qclaims:
            claim = self.draw_queue_claim(data)
            holder = self.holder(claim.session_id)
            assert holder is not None
            self.do_complete_queue(data, claim, holder)
        if data.draw(OFTEN) and self.tclaims:
            tclaim = self.draw_input_claim(data)
            holder = self.holder(tclaim.session_id)
            assert holder is not None
            self.do_complete_inputs(data, tclaim, holder)

    def claims_round(self, data: st.DataObject) -> None:
        for sid in self.sids:
            fence = self.holder(sid)
            assert fence is not None
            if data.draw(OFTEN):
                self.do_claim_leading(sid, fence, fence.owner)
            if data.draw(OFTEN):
                self.do_claim_ready(sid, fence, fence.owner, ClaimBoundary.IDLE, 2)
            if data.draw(OFTEN):
                turn = data.draw(st.sampled_from(TURNS))
                mode = ActiveTurnMode(turn_id=turn, checkpoint=CheckpointKind.BEFORE_COMPLETION)
                self.do_claim_inputs(sid, fence, fence.owner, mode, 2)
            if data.draw(OFTEN):
                self.do_claim_inputs(sid, fence, fence.owner, NextTurnMode(), 1)

    # ------------------------------------------------------------------ leases

    @rule(data=st.data(), owner=st.sampled_from(OWNERS), ttl=TTLS)
    def try_claim(self, data: st.DataObject, owner: LeaseOwnerIdentity, ttl: int) -> None:
        self.do_try_claim(data.draw(st.sampled_from(self.sids)), owner, ttl)

    def do_try_claim(self, sid: str, owner: LeaseOwnerIdentity, ttl: int) -> None:
        row = self.lease[sid]
        live = self.live_row(sid)
        new_row = row
        if live is not None:
            holder = self.holder(sid)
            assert live.owner is not None and holder is not None
            if not same_incarnation(live.owner, owner):
                expected: Any = Busy(holder=holder)
            else:  # self-extension: token, generation, claimed_at and stored owner unchanged
                new_row = replace(live, expires=sat(self.now + ttl))
                expected = Acquired(lease=self.lease_of(sid, new_row, owner))
        else:
            new_row = self.acquire(sid, owner, ttl)
            expected = Acquired(lease=self.lease_of(sid, new_row, owner))
        got = attempt(lambda: self.store.leases.try_claim_session_execution_lease(sid, owner, ttl))
        self.check("try_claim", got, ("ok", expected))
        self.lease[sid] = new_row
        if isinstance(expected, Acquired):
            self.fences[sid].append(expected.lease)

    @rule(
        data=st.data(),
        owner=st.sampled_from(OWNERS),
        ttl=TTLS,
        probe=st.sampled_from(["gone", "gone", "alive", "unknown"]),
    )
    def reclaim(self, data: st.DataObject, owner: LeaseOwnerIdentity, ttl: int, probe: str) -> None:
        sid = data.draw(st.sampled_from(self.sids))
        observed = self.draw_fence(data, sid)
        live = self.live_row(sid)
        new_row = self.lease[sid]
        if live is None:  # absent, released or expired: a plain acquisition
            new_row = self.acquire(sid, owner, ttl)
            expected: Any = Acquired(lease=self.lease_of(sid, new_row, owner))
        else:
            holder = self.holder(sid)
            assert holder is not None
            if (
                observed.session_id == sid
                and same_incarnation(holder.owner, observed.owner)
                and holder.lease_token == observed.lease_token
                and holder.fencing_token == observed.fencing_token
                and definitely_dead(holder.owner, owner, probe)
            ):
                new_row = self.acquire(sid, owner, ttl)
                expected = Acquired(lease=self.lease_of(sid, new_row, owner))
            else:
                expected = Busy(holder=holder)
        got = attempt(
            lambda: self.store.leases.reclaim_session_execution_lease(
                sid,
                owner,
                observed,
                ttl,
                probe=fixed_probe(probe),
            )
        )
        self.check("reclaim", got, ("ok", expected))
        self.lease[sid] = new_row
        if isinstance(expected, Acquired):
            self.fences[sid].append(expected.lease)

    @rule(data=st.data(), ttl=TTLS)
    def renew(self, data: st.DataObject, ttl: int) -> None:
        fence = self.draw_fence(data, data.draw(st.sampled_from(self.sids)))
        sid = fence.session_id
        row = self.lease[sid]
        if self.fence_ok(sid, fence):
            assert row is not None
            renewed = replace(row, expires=sat(self.now + ttl))
            new_row: LeaseRow | None = renewed
            expected: Outcome = ("ok", self.lease_of(sid, renewed, fence.owner))
        else:
            new_row, expected = row, ("err", SessionExecutionLeaseExpired)
        got = attempt(lambda: self.store.leases.renew_session_execution_lease(fence, ttl))
        self.check("renew", got, expected)
        self.lease[sid] = new_row
        if expected[0] == "ok":
            self.fences[sid].append(expected[1])

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        fence = self.draw_fence(data, data.draw(st.sampled_from(self.sids)), rarely_current=True)
        sid = fence.session_id
        row = self.lease[sid]
        if (
            row is not None
            and row.owner is not None
            and row.owner.owner_id == fence.owner.owner_id
            and row.owner.incarnation_id == fence.owner.incarnation_id
            and row.token == fence.lease_token
            and row.fencing == fence.fencing_token
        ):  # no expiry check; the generation is kept
            self.lease[sid] = LeaseRow(None, None, row.fencing, 0, 0)
        got = attempt(lambda: self.store.leases.release_session_execution_lease(fence))
        self.check("release", got, ("ok", None))

    @rule(delta=ADVANCES)
    def advance_clock(self, delta: int) -> None:
        self.clock.advance(delta)

    # ------------------------------------------------------------------ queued work

    def draw_queue_draft(self, data: st.DataObject) -> QueuedWorkDraft:
        mode = data.draw(st.sampled_from(["fresh"] * 4 + ["same", "changed"]))
        keyed = [d for d in self.queue_drafts if d.source_key is not None]
        if mode != "fresh" and keyed:
            old = data.draw(st.sampled_from(keyed))
            if mode == "same":
                return old
            change = data.draw(st.sampled_from(["available_at", "payload", "slot", "merge"]))
            if change == "available_at":
                return old.model_copy(update={"available_at_ms": old.available_at_ms + 1})
            if change == "payload":
                first = old.payloads[0]
                body = {"changed": first.body}
                return old.model_copy(
                    update={"payloads": (first.model_copy(update={"body": body}),)}
                )
            if change == "slot":
                flipped = (
                    SlotPolicy.JOIN
                    if old.slot_policy is SlotPolicy.EXCLUSIVE
                    else SlotPolicy.EXCLUSIVE
                )
                return old.model_copy(update={"slot_policy": flipped})
            merge = data.draw(st.sampled_from([k for k in MERGE_KEYS if k != old.merge_key]))
            return old.model_copy(update={"merge_key": merge})
        klass = data.draw(st.sampled_from(KLASSES))
        if klass == "command":
            payloads = [QueuedWorkPayload(kind="session_command", body=data.draw(BODIES))]
        elif klass == "turn":
            kinds = data.draw(
                st.lists(st.sampled_from(["user_input", "process_wake"]), min_size=1, max_size=2)
            )
            payloads = [QueuedWorkPayload(kind=k, body=data.draw(BODIES)) for k in kinds]
        else:
            payloads = [
                QueuedWorkPayload(kind="session_command", body=None),
                QueuedWorkPayload(kind="user_input", body=data.draw(BODIES)),
            ]
        offset = data.draw(st.sampled_from([0, -100, 0, 0, 0, 50, 1_000]))
        return QueuedWorkDraft(
            session_id=data.draw(st.sampled_from(self.sids)),
            source_key=data.draw(st.sampled_from([None, None, *QUEUE_KEYS])),
            delivery_policy=data.draw(st.sampled_from(list(DeliveryPolicy))),
            slot_policy=data.draw(
                st.sampled_from([SlotPolicy.JOIN, SlotPolicy.EXCLUSIVE, SlotPolicy.JOIN])
            ),
            merge_key=data.draw(st.sampled_from(MERGE_KEYS)),
            available_at_ms=max(0, self.now + offset),
            payloads=tuple(payloads),
        )

    @rule(data=st.data())
    def enqueue_batch(self, data: st.DataObject) -> None:
        self.do_enqueue_batch(self.draw_queue_draft(data))

    def do_enqueue_batch(self, draft: QueuedWorkDraft) -> None:
        sid = draft.session_id
        existing = [
            b
            for b in self.batches[sid]
            if draft.source_key is not None and b.source_key == draft.source_key
        ]
        got = attempt(lambda: self.store.queue.enqueue_queued_work(draft))
        if existing:
            old = existing[0]
            same = (
                old.delivery_policy == draft.delivery_policy
                and old.slot_policy == draft.slot_policy
                and old.merge_key == draft.merge_key
                and old.available_at_ms == draft.available_at_ms
                and [i.payload for i in old.items] == list(draft.payloads)
            )
            expected: Outcome = ("ok", old) if same else ("err", QueuedWorkSourceKeyConflict)
            self.check("enqueue_batch (known source key)", got, expected)
            return
        assert got[0] == "ok", f"enqueue_batch: {got!r}"
        stored: QueuedWorkBatch = got[1]
        bid = stored.batch_id
        assert bid.startswith("qwb:") and len(bid) == 4 + 64
        assert bid not in self.all_batch_ids(), "a batch id was minted twice"
        assert stored.enqueue_seq > self.last_batch_seq, "enqueue_seq went backwards"
        self.last_batch_seq = stored.enqueue_seq
        expected_batch = QueuedWorkBatch(
            enqueue_seq=stored.enqueue_seq,
            batch_id=bid,
            session_id=sid,
            source_key=draft.source_key,
            delivery_policy=draft.delivery_policy,
            slot_policy=draft.slot_policy,
            merge_key=draft.merge_key,
            available_at_ms=draft.available_at_ms,
            enqueued_at_ms=self.now,
            claim_id=None,
            claim_owner=None,
            claim_token=None,
            claim_fencing_token=0,
            claim_session_lease_generation=0,
            items=tuple(
                QueuedWorkItem(item_index=i, item_id=f"{bid}:item:{i}", payload=p)
                for i, p in enumerate(draft.payloads)
            ),
        )
        self.check("enqueue_batch", got, ("ok", expected_batch))
        self.batches[sid].append(expected_batch)
        self.queue_drafts.append(draft)

    def all_batch_ids(self) -> list[str]:
        return [b.batch_id for s in self.sids for b in self.batches[s]] + self.deleted_batch_ids

    def scan(self, sid: str, generation: int, limit: int) -> list[QueuedWorkBatch]:
        """The claim scan: READY and CLAIMABLE rows by enqueue_seq, ``limit`` at most."""
        rows = [
            b
            for b in self.batches[sid]
            if b.available_at_ms <= self.now
            and (b.claim_token is None or b.claim_session_lease_generation != generation)
        ]
        return rows[:limit]

    def stamp_batches(
        self, sid: str, owner: LeaseOwnerIdentity, generation: int, selected: list[QueuedWorkBatch]
    ) -> QueuedWorkClaim:
        """§2.6.2: derive the claim from the head, stamp every selected row (model update)."""
        head = selected[0]
        fencing = sat(head.claim_fencing_token + 1)
        claim_id = f"qwc:{head.enqueue_seq}:{fencing}"
        token = claim_lease_token(sid, owner, claim_id, self.now)
        claim = QueuedWorkClaim(
            session_id=sid,
            claim_id=claim_id,
            owner=owner,
            lease_token=token,
            fencing_token=fencing,
            session_lease_generation=generation,
            batches=tuple(selected),
        )
        ids = {b.batch_id for b in selected}
        self.batches[sid] = [
            b.model_copy(
                update={
                    "claim_id": claim_id,
                    "claim_owner": owner,
                    "claim_token": token,
                    "claim_fencing_token": sat(b.claim_fencing_token + 1),
                    "claim_session_lease_generation": generation,
                }
            )
            if b.batch_id in ids
            else b
            for b in self.batches[sid]
        ]
        return claim

    def settle_queue_claim(
        self,
        op: str,
        sid: str,
        got: Outcome,
        expected: Outcome,
        claim: QueuedWorkClaim | None,
        before: list[QueuedWorkBatch],
    ) -> None:
        """Compare, and on a claim check I-4/I-6 before the model keeps the stamped rows."""
        if got != expected:
            self.batches[sid] = before
        self.check(op, got, expected)
        if claim is not None:
            live = self.live_row(sid)
            assert live is not None and live.fencing == claim.session_lease_generation  # I-6
            for b in claim.batches:  # I-6: never re-claimed by its own generation
                assert (
                    b.claim_token is None
                    or b.claim_session_lease_generation != claim.session_lease_generation
                )
            self.qclaims.append(claim)

    @rule(data=st.data())
    def claim_leading_session_command(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(self.sids))
        fence = self.draw_fence(data, sid)
        self.do_claim_leading(sid, fence, self.draw_claim_owner(data, fence))

    def do_claim_leading(self, sid: str, fence: LeaseFence, owner: LeaseOwnerIdentity) -> None:
        before = self.batches[sid]
        claim = None
        if not self.fence_ok(sid, fence):
            expected: Outcome = ("err", SessionExecutionLeaseExpired)
        else:
            candidates = self.scan(sid, fence.fencing_token, 1 + SCAN_SLACK)
            if any(b.work_class() is None for b in candidates):
                expected = ("err", SessionCorrupt)
            elif select_leading_session_command(candidates) == 0:
                expected = ("ok", None)
            else:
                claim = self.stamp_batches(sid, owner, fence.fencing_token, candidates[:1])
                expected = ("ok", claim)
        got = attempt(
            lambda: self.store.queue.claim_leading_ready_session_command(sid, fence, owner)
        )
        self.settle_queue_claim("claim_leading_session_command", sid, got, expected, claim, before)

    @rule(
        data=st.data(),
        boundary=st.sampled_from(list(ClaimBoundary)),
        max_batches=MAXES,
    )
    def claim_ready_work(
        self, data: st.DataObject, boundary: ClaimBoundary, max_batches: int
    ) -> None:
        sid = data.draw(st.sampled_from(self.sids))
        fence = self.draw_fence(data, sid)
        self.do_claim_ready(sid, fence, self.draw_claim_owner(data, fence), boundary, max_batches)

    def do_claim_ready(
        self,
        sid: str,
        fence: LeaseFence,
        owner: LeaseOwnerIdentity,
        boundary: ClaimBoundary,
        max_batches: int,
    ) -> None:
        before = self.batches[sid]
        claim = None
        if max_batches == 0:  # None at once: no lease check
            expected: Outcome = ("ok", None)
        elif not self.fence_ok(sid, fence):
            expected = ("err", SessionExecutionLeaseExpired)
        else:
            candidates = self.scan(sid, fence.fencing_token, max_batches + SCAN_SLACK)
            n = select_turn_work_claim_prefix(candidates, boundary, max_batches)
            if any(b.work_class() is None for b in candidates):
                expected = ("err", SessionCorrupt)
            elif n == 0:
                expected = ("ok", None)
            else:
                claim = self.stamp_batches(sid, owner, fence.fencing_token, candidates[:n])
                expected = ("ok", claim)
        got = attempt(
            lambda: self.store.queue.claim_ready_queued_work(
                sid, fence, owner, boundary, max_batches
            )
        )
        self.settle_queue_claim("claim_ready_work", sid, got, expected, claim, before)

    @rule(data=st.data(), boundary=st.sampled_from(list(ClaimBoundary)))
    def claim_by_batch_ids(self, data: st.DataObject, boundary: ClaimBoundary) -> None:
        sid = data.draw(st.sampled_from(self.sids))
        fence = self.draw_fence(data, sid)
        owner = self.draw_claim_owner(data, fence)
        likely = [  # biased towards ids that can be claimed; the model decides, not the bias
            b.batch_id
            for b in self.batches[sid]
            if b.work_class() is QueuedWorkClass.TURN_WORK
            and not self.claim_live(sid, b.claim_token, b.claim_session_lease_generation)
        ]
        pool = likely * 4 + [b.batch_id for b in self.batches[sid]] + self.all_batch_ids()
        pool.append("qwb:none")
        n_ids = data.draw(st.sampled_from([1, 1, 2, 1, 3, 0]))
        ids = [data.draw(st.sampled_from(pool)) for _ in range(n_ids)]
        before = self.batches[sid]
        claim = None
        if not ids:  # None at once: no lease check
            expected: Outcome = ("ok", None)
        elif not self.fence_ok(sid, fence):
            expected = ("err", SessionExecutionLeaseExpired)
        else:
            generation = fence.fencing_token
            ready = {b.batch_id: b for b in self.scan(sid, generation, len(self.batches[sid]))}
            candidates = [ready[i] for i in ids if i in ready]
            if (
                len(candidates) != len(ids)  # absent, foreign, future or claimed by this generation
                or any(c.work_class() is not QueuedWorkClass.TURN_WORK for c in candidates)
                or select_turn_work_claim_prefix(candidates, boundary, len(ids)) != len(ids)
                or len(set(ids)) != len(ids)  # the second stamp of a row fails its fence
            ):
                expected = ("ok", None)
            else:
                claim = self.stamp_batches(sid, owner, generation, candidates)
                expected = ("ok", claim)
        got = attempt(
            lambda: self.store.queue.claim_ready_queued_work_by_batch_ids(
                sid, fence, owner, boundary, ids
            )
        )
        self.settle_queue_claim("claim_by_batch_ids", sid, got, expected, claim, before)

    @precondition(lambda self: self.qclaims)
    @rule(data=st.data(), as_completion=st.booleans())
    def abandon_queue_claim(self, data: st.DataObject, as_completion: bool) -> None:
        claim = self.draw_queue_claim(data)
        sid = claim.session_id
        self.batches[sid] = [
            b.model_copy(
                update={
                    "claim_id": None,
                    "claim_owner": None,
                    "claim_token": None,
                    "claim_session_lease_generation": 0,
                }
            )
            if (b.claim_id, b.claim_token) == (claim.claim_id, claim.lease_token)
            else b
            for b in self.batches[sid]
        ]
        arg = claim.completion() if as_completion else claim
        got = attempt(lambda: self.store.queue.abandon_queued_work_claim(arg))
        self.check("abandon_queue_claim", got, ("ok", None))

    def wrong_ids(
        self, data: st.DataObject, ids: tuple[str, ...], foreign: list[str]
    ) -> tuple[str, ...]:
        """Exact, reordered, or a wrong list a strict completion refuses.

        ``swapped`` and ``duplicated`` keep the count right: a count-only check
        (the seed's, §4.7) would accept them.
        """
        how = data.draw(
            st.sampled_from(
                ["exact", "swapped", "exact", "duplicated", "reversed", "missing", "extra"]
            )
        )
        other = data.draw(st.sampled_from([*foreign, "not-an-id"]))
        if how == "reversed":
            return tuple(reversed(ids))
        if how == "swapped":
            return (*ids[:-1], other)
        if how == "duplicated":
            return (*ids[:-1], ids[0]) if len(ids) > 1 else (*ids, ids[0])
        if how == "missing":  # an empty list is refused as invalid input
            return ids[1:] if len(ids) > 1 or data.draw(st.booleans()) else (other,)
        if how == "extra":
            return (*ids, other)
        return ids

    def draw_queue_claim(self, data: st.DataObject) -> QueuedWorkClaim:
        """Recent claims first, and claims that still own rows more often than stale ones."""
        owning = [
            c
            for c in self.qclaims
            if any(
                (b.claim_id, b.claim_token) == (c.claim_id, c.lease_token)
                for b in self.batches[c.session_id]
            )
        ]
        return data.draw(st.sampled_from(owning[::-1] * 3 + self.qclaims[::-1]))

    def draw_input_claim(self, data: st.DataObject) -> TurnInputClaim:
        """Recent claims first, and claims that still own rows more often than stale ones."""
        owning = [
            c
            for c in self.tclaims
            if any(
                (i.claim_id, i.claim_token) == (c.claim_id, c.lease_token)
                for i in self.inputs[c.session_id]
            )
        ]
        return data.draw(st.sampled_from(owning[::-1] * 3 + self.tclaims[::-1]))

    @precondition(lambda self: self.qclaims)
    @rule(data=st.data())
    def complete_queue_claim(self, data: st.DataObject) -> None:
        claim = self.draw_queue_claim(data)
        self.do_complete_queue(data, claim, self.draw_fence(data, claim.session_id))

    def do_complete_queue(
        self, data: st.DataObject, claim: QueuedWorkClaim, fence: LeaseFence
    ) -> None:
        own = tuple(b.batch_id for b in claim.batches)
        ids = self.wrong_ids(data, own, [i for i in self.all_batch_ids() if i not in own])
        completion = claim.completion().model_copy(update={"batch_ids": ids})
        fsid = fence.session_id
        if not ids:
            expected: Outcome = ("err", InvalidInput)
        elif not self.fence_ok(fsid, fence):
            expected = ("err", SessionExecutionLeaseExpired)
        elif completion.session_id != fsid:
            expected = ("err", QueuedWorkClaimSuperseded)
        else:
            owned = {
                b.batch_id
                for b in self.batches[fsid]
                if (b.claim_id, b.claim_token) == (claim.claim_id, claim.lease_token)
            }
            if len(set(ids)) != len(ids) or set(ids) != owned:
                expected = ("err", QueuedWorkClaimSuperseded)
            else:
                expected = ("ok", None)
        got = attempt(lambda: self.store.queue.complete_queued_work_claim(fence, completion))
        self.check("complete_queue_claim", got, expected)
        if expected == ("ok", None):
            self.batches[fsid] = [b for b in self.batches[fsid] if b.batch_id not in ids]
            self.deleted_batch_ids.extend(ids)

    @rule(data=st.data())
    def cancel_batch(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(self.sids))
        pool = [b.batch_id for b in self.batches[sid]] * 3 + self.all_batch_ids() + ["qwb:none"]
        bid = data.draw(st.sampled_from(pool))
        found = [b for b in self.batches[sid] if b.batch_id == bid]
        expected: Outcome = ("ok", None)
        if found and not self.claim_live(
            sid, found[0].claim_token, found[0].claim_session_lease_generation
        ):
            expected = ("ok", found[0])
        got = attempt(lambda: self.store.queue.cancel_queued_work_batch(sid, bid))
        self.check("cancel_batch", got, expected)
        if expected[1] is not None:
            self.batches[sid] = [b for b in self.batches[sid] if b.batch_id != bid]
            self.deleted_batch_ids.append(bid)

    # ------------------------------------------------------------------ turn inputs

    def draw_input_draft(self, data: st.DataObject) -> PendingTurnInputDraft:
        mode = data.draw(st.sampled_from(["fresh"] * 4 + ["same", "changed"]))
        keyed = [d for d in self.input_drafts if d.source_key is not None]
        if mode != "fresh" and keyed:
            old = data.draw(st.sampled_from(keyed))
            if mode == "same":  # an explicit id may differ: only ingress and input are compared
                return old.model_copy(
                    update={"input_id": data.draw(st.sampled_from([old.input_id, None]))}
                )
            if data.draw(st.booleans()):
                return old.model_copy(update={"input": {"changed": old.input}})
            flipped = (
                NextTurnIngress()
                if isinstance(old.ingress, ActiveTurnIngress)
                else ActiveTurnIngress(turn_id="t1")
            )
            return old.model_copy(update={"ingress": flipped})
        if data.draw(OFTEN):
            ingress: ActiveTurnIngress | NextTurnIngress = ActiveTurnIngress(
                turn_id=data.draw(st.sampled_from(TURNS)),
                min_boundary=data.draw(st.sampled_from(list(MinBoundary))),
            )
        else:
            ingress = NextTurnIngress()
        return PendingTurnInputDraft(
            session_id=data.draw(st.sampled_from(self.sids)),
            input_id=data.draw(st.sampled_from([None, None, None, *self.explicit_ids])),
            source_key=data.draw(st.sampled_from([None, None, *INPUT_KEYS])),
            ingress=ingress,
            input=data.draw(BODIES),
        )

    def all_inputs(self) -> list[PendingTurnInput]:
        return [i for s in self.sids for i in self.inputs[s]]

    @rule(data=st.data())
    def enqueue_input(self, data: st.DataObject) -> None:
        self.do_enqueue_input(self.draw_input_draft(data))

    def do_enqueue_input(self, draft: PendingTurnInputDraft) -> None:
        sid = draft.session_id
        existing = [
            i
            for i in self.inputs[sid]
            if draft.source_key is not None and i.source_key == draft.source_key
        ]
        got = attempt(lambda: self.store.turn_inputs.enqueue_pending_turn_input(draft))
        if existing:
            old = existing[0]
            same = old.submitted_ingress == draft.ingress and old.input == draft.input
            expected: Outcome = ("ok", old) if same else ("err", PendingTurnInputSourceKeyConflict)
            self.check("enqueue_input (known source key)", got, expected)
            return
        if draft.input_id is not None and draft.input_id in {i.input_id for i in self.all_inputs()}:
            self.check("enqueue_input (explicit id taken)", got, ("err", TurnInputDuplicate))
            return
        assert got[0] == "ok", f"enqueue_input: {got!r}"
        stored: PendingTurnInput = got[1]
        if draft.input_id is None:
            assert stored.input_id.startswith("ti:") and len(stored.input_id) == 3 + 64
            assert stored.input_id not in {i.input_id for i in self.all_inputs()}
        assert stored.enqueue_seq > self.last_input_seq, "enqueue_seq went backwards"
        self.last_input_seq = stored.enqueue_seq
        state = (
            TurnInputState.PENDING_ACTIVE
            if isinstance(draft.ingress, ActiveTurnIngress)
            else TurnInputState.DEFERRED_NEXT_TURN
        )
        expected_input = PendingTurnInput(
            enqueue_seq=stored.enqueue_seq,
            input_id=draft.input_id or stored.input_id,
            session_id=sid,
            source_key=draft.source_key,
            ingress=draft.ingress,
            submitted_ingress=draft.ingress,
            state=state,
            input=draft.input,
            enqueued_at_ms=self.now,
            claim_id=None,
            claim_owner=None,
            claim_token=None,
            claim_fencing_token=0,
            claim_session_lease_generation=0,
        )
        self.check("enqueue_input", got, ("ok", expected_input))
        self.inputs[sid].append(expected_input)
        self.input_drafts.append(draft)

    def claim_inputs(
        self, data: st.DataObject, mode: ActiveTurnMode | NextTurnMode, max_inputs: int
    ) -> None:
        sid = data.draw(st.sampled_from(self.sids))
        fence = self.draw_fence(data, sid)
        self.do_claim_inputs(sid, fence, self.draw_claim_owner(data, fence), mode, max_inputs)

    def do_claim_inputs(
        self,
        sid: str,
        fence: LeaseFence,
        owner: LeaseOwnerIdentity,
        mode: ActiveTurnMode | NextTurnMode,
        max_inputs: int,
    ) -> None:
        active = isinstance(mode, ActiveTurnMode)
        claim = None
        if max_inputs == 0:  # None at once: no lease check
            expected: Outcome = ("ok", None)
        elif not self.fence_ok(sid, fence):
            expected = ("err", SessionExecutionLeaseExpired)
        else:
            gen = fence.fencing_token
            wanted = TurnInputState.PENDING_ACTIVE if active else TurnInputState.DEFERRED_NEXT_TURN
            window = [
                i
                for i in self.inputs[sid]
                if i.state is wanted
                and (i.claim_token is None or i.claim_session_lease_generation != gen)
            ][: max_inputs + SCAN_SLACK]
            selected = [
                i
                for i in window
                if not isinstance(mode, ActiveTurnMode)
                or (
                    isinstance(i.ingress, ActiveTurnIngress)
                    and i.ingress.turn_id == mode.turn_id
                    and i.ingress.admits_checkpoint(mode.checkpoint)
                )
            ][:max_inputs]
            if not selected:
                expected = ("ok", None)
            else:
                head = selected[0]
                fencing = sat(head.claim_fencing_token + 1)
                claim_id = f"tic:{head.enqueue_seq}:{fencing}"
                token = claim_lease_token(sid, owner, claim_id, self.now)
                stamped = [
                    i.model_copy(
                        update={
                            "state": TurnInputState.ACCEPTED if active else i.state,
                            "claim_id": claim_id,
                            "claim_owner": owner,
                            "claim_token": token,
                            "claim_fencing_token": sat(i.claim_fencing_token + 1),
                            "claim_session_lease_generation": gen,
                        }
                    )
                    for i in selected
                ]
                claim = TurnInputClaim(
                    session_id=sid,
                    claim_id=claim_id,
                    owner=owner,
                    lease_token=token,
                    fencing_token=fencing,
                    session_lease_generation=gen,
                    mode=mode,
                    inputs=tuple(stamped),
                )
                expected = ("ok", claim)
        got = attempt(
            lambda: (
                self.store.turn_inputs.claim_active_turn_inputs(
                    sid, fence, owner, mode.turn_id, mode.checkpoint, max_inputs
                )
                if isinstance(mode, ActiveTurnMode)
                else self.store.turn_inputs.claim_next_turn_inputs(sid, fence, owner, max_inputs)
            )
        )
        self.check(f"claim_{mode.kind}_inputs", got, expected)
        if claim is not None:
            by_id = {i.input_id: i for i in claim.inputs}
            self.inputs[sid] = [by_id.get(i.input_id, i) for i in self.inputs[sid]]
            live = self.live_row(sid)
            assert live is not None and live.fencing == claim.session_lease_generation  # I-6
            self.tclaims.append(claim)

    @rule(
        data=st.data(),
        turn_id=st.sampled_from(TURNS),
        checkpoint=st.sampled_from(list(CheckpointKind)),
        max_inputs=MAXES,
    )
    def claim_active_inputs(
        self, data: st.DataObject, turn_id: str, checkpoint: CheckpointKind, max_inputs: int
    ) -> None:
        self.claim_inputs(data, ActiveTurnMode(turn_id=turn_id, checkpoint=checkpoint), max_inputs)

    @rule(data=st.data(), max_inputs=MAXES)
    def claim_next_inputs(self, data: st.DataObject, max_inputs: int) -> None:
        self.claim_inputs(data, NextTurnMode(), max_inputs)

    @precondition(lambda self: self.tclaims)
    @rule(data=st.data())
    def abandon_input_claim(self, data: st.DataObject) -> None:
        claim = self.draw_input_claim(data)
        sid = claim.session_id
        restored = (
            TurnInputState.PENDING_ACTIVE
            if isinstance(claim.mode, ActiveTurnMode)
            else TurnInputState.DEFERRED_NEXT_TURN
        )
        self.inputs[sid] = [
            i.model_copy(
                update={
                    "state": restored if i.state is TurnInputState.ACCEPTED else i.state,
                    "claim_id": None,
                    "claim_owner": None,
                    "claim_token": None,
                    "claim_session_lease_generation": 0,
                }
            )
            if (i.claim_id, i.claim_token) == (claim.claim_id, claim.lease_token)
            else i
            for i in self.inputs[sid]
        ]
        got = attempt(lambda: self.store.turn_inputs.abandon_turn_input_claim(claim))
        self.check("abandon_input_claim", got, ("ok", None))

    @precondition(lambda self: self.tclaims)
    @rule(data=st.data())
    def complete_input_claim(self, data: st.DataObject) -> None:
        claim = self.draw_input_claim(data)
        self.do_complete_inputs(data, claim, self.draw_fence(data, claim.session_id))

    def do_complete_inputs(
        self, data: st.DataObject, claim: TurnInputClaim, fence: LeaseFence
    ) -> None:
        own = tuple(i.input_id for i in claim.inputs)
        ids = self.wrong_ids(
            data, own, [i.input_id for i in self.all_inputs() if i.input_id not in own]
        )
        completion = claim.completion().model_copy(update={"input_ids": ids})
        fsid = fence.session_id
        if not ids:
            expected: Outcome = ("err", InvalidInput)
        elif not self.fence_ok(fsid, fence):
            expected = ("err", SessionExecutionLeaseExpired)
        elif completion.session_id != fsid:
            expected = ("err", TurnInputClaimSuperseded)
        else:
            owned = {
                i.input_id
                for i in self.inputs[fsid]
                if (i.claim_id, i.claim_token) == (claim.claim_id, claim.lease_token)
            }
            if len(set(ids)) != len(ids) or set(ids) != owned:
                expected = ("err", TurnInputClaimSuperseded)
            else:
                expected = ("ok", None)
        got = attempt(lambda: self.store.turn_inputs.complete_turn_input_claim(fence, completion))
        self.check("complete_input_claim", got, expected)
        if expected == ("ok", None):
            self.inputs[fsid] = [
                i.model_copy(
                    update={
                        "state": TurnInputState.COMPLETED,
                        "claim_id": None,
                        "claim_owner": None,
                        "claim_token": None,
                        "claim_session_lease_generation": 0,
                    }
                )
                if i.input_id in ids
                else i
                for i in self.inputs[fsid]
            ]

    def draw_target(self, data: st.DataObject, sid: str) -> CancelTarget:
        if data.draw(st.booleans()):
            return SourceKeyTarget(source_key=data.draw(st.sampled_from([*INPUT_KEYS, "tk-none"])))
        pool = [i.input_id for i in self.inputs[sid]] * 3 + [i.input_id for i in self.all_inputs()]
        return InputIdTarget(input_id=data.draw(st.sampled_from([*pool, "ti:none"])))

    def find_target(self, sid: str, target: CancelTarget) -> PendingTurnInput | None:
        for i in self.inputs[sid]:
            if isinstance(target, InputIdTarget) and i.input_id == target.input_id:
                return i
            if isinstance(target, SourceKeyTarget) and i.source_key == target.source_key:
                return i
        return None

    def cancel_row(self, sid: str, item: PendingTurnInput) -> CancelOutcome:
        """The row-cancel rule (§2.7.3), applied to the model."""
        if item.state is TurnInputState.CANCELLED:
            return AlreadyCancelled(input=item)
        if item.state is TurnInputState.COMPLETED:
            return AlreadyCompleted(input=item)
        if item.state is TurnInputState.ACCEPTED or self.claim_live(
            sid, item.claim_token, item.claim_session_lease_generation
        ):
            diagnostics = None
            if item.claim_token is not None or item.state is TurnInputState.ACCEPTED:
                diagnostics = ClaimDiagnostics(
                    state=item.state,
                    claim_id=item.claim_id,
                    claim_owner=item.claim_owner,
                    claim_fencing_token=item.claim_fencing_token,
                    claim_session_lease_generation=item.claim_session_lease_generation,
                )
            return AlreadyClaimed(claim=diagnostics, input=item)
        cancelled = item.model_copy(
            update={
                "state": TurnInputState.CANCELLED,
                "claim_id": None,
                "claim_owner": None,
                "claim_token": None,
                "claim_session_lease_generation": 0,
            }
        )
        self.inputs[sid] = [
            cancelled if i.input_id == item.input_id else i for i in self.inputs[sid]
        ]
        return Cancelled(input=cancelled)

    @rule(data=st.data())
    def cancel_inputs(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(self.sids))
        count = data.draw(st.sampled_from([1, 2, 3, 0]))
        chosen = [self.draw_target(data, sid) for _ in range(count)]
        before = self.inputs[sid]
        results = []
        for target in chosen:
            item = self.find_target(sid, target)
            outcome = NotFoundOutcome() if item is None else self.cancel_row(sid, item)
            results.append(CancelResult(target=target, outcome=outcome))
        got = attempt(lambda: self.store.turn_inputs.cancel_pending_turn_inputs(sid, chosen))
        if got != ("ok", results):
            self.inputs[sid] = before
        self.check("cancel_inputs", got, ("ok", results))

    @rule(data=st.data())
    def cancel_input_suffix(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(self.sids))
        anchor = self.draw_target(data, sid)
        before = self.inputs[sid]
        head = self.find_target(sid, anchor)
        if head is None:
            expected: Any = AnchorNotFound(anchor=anchor)
        else:
            suffix = [i for i in self.inputs[sid] if i.enqueue_seq >= head.enqueue_seq]
            expected = SuffixOutcomes(
                anchor=anchor, outcomes=tuple(self.cancel_row(sid, i) for i in suffix)
            )
        got = attempt(lambda: self.store.turn_inputs.cancel_pending_turn_input_suffix(sid, anchor))
        if got != ("ok", expected):
            self.inputs[sid] = before
        self.check("cancel_input_suffix", got, ("ok", expected))

    @rule(data=st.data())
    def recover_stale_inputs(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(self.sids))
        self.do_recover(sid, self.draw_fence(data, sid))

    def do_recover(self, sid: str, fence: LeaseFence) -> None:
        if not self.fence_ok(sid, fence):
            expected: Outcome = ("err", SessionExecutionLeaseExpired)
            recovered: list[PendingTurnInput] = []
        else:
            recovered = [
                i.model_copy(
                    update={
                        "state": TurnInputState.PENDING_ACTIVE,
                        "claim_id": None,
                        "claim_owner": None,
                        "claim_token": None,
                        "claim_session_lease_generation": 0,
                    }
                )
                for i in self.inputs[sid]
                if i.state is TurnInputState.ACCEPTED
                and i.claim_session_lease_generation != fence.fencing_token
            ]
            expected = ("ok", recovered)
        got = attempt(lambda: self.store.turn_inputs.recover_stale_turn_input_claims(sid, fence))
        self.check("recover_stale_inputs", got, expected)
        by_id = {i.input_id: i for i in recovered}
        self.inputs[sid] = [by_id.get(i.input_id, i) for i in self.inputs[sid]]

    # ------------------------------------------------------------------ after every step

    @invariant()
    def store_matches_model(self) -> None:
        now = self.now
        with self.store.read() as uow:
            for sid in self.sids:
                lease = uow.leases.get_session_execution_lease(sid)
                raw_fencing = uow.connection.execute(
                    text(
                        "SELECT lease_fencing_token FROM session_execution_leases "
                        "WHERE session_id = :s"
                    ),
                    {"s": sid},
                ).scalar_one_or_none()
                batches = uow.queue.list_queued_work(sid)
                pending_batches = uow.queue.list_pending_queued_work(sid)
                inputs = uow.turn_inputs.list_turn_inputs(sid)
                pending_inputs = uow.turn_inputs.list_pending_turn_inputs(sid)
                # I-2: of every lease ever handed out for the session, at most one passes FENCE_OK.
                passing = []
                for fence in self.fences[sid]:
                    try:
                        uow.leases.ensure_session_execution_lease(fence)
                    except SessionExecutionLeaseExpired:
                        continue
                    passing.append(fence)

                # ---- the model, compared
                row = self.lease[sid]
                assert lease == self.holder(sid), f"lease of {sid}"
                assert raw_fencing == (None if row is None else row.fencing), f"generation of {sid}"
                assert batches == self.batches[sid], f"list_queued_work({sid})"
                assert pending_batches == [
                    b
                    for b in self.batches[sid]
                    if not self.claim_live(sid, b.claim_token, b.claim_session_lease_generation)
                ], f"list_pending_queued_work({sid})"
                assert inputs == self.inputs[sid], f"list_turn_inputs({sid})"
                assert pending_inputs == [
                    i
                    for i in self.inputs[sid]
                    if i.state in (TurnInputState.PENDING_ACTIVE, TurnInputState.DEFERRED_NEXT_TURN)
                    and not self.claim_live(sid, i.claim_token, i.claim_session_lease_generation)
                ], f"list_pending_turn_inputs({sid})"

                # ---- invariants on the store's answers
                live = self.live_row(sid)
                assert len({(f.lease_token, f.fencing_token) for f in passing}) <= 1  # I-2
                assert {(f.lease_token, f.fencing_token) for f in passing} == (
                    set() if live is None else {(live.token, live.fencing)}
                )
                if raw_fencing is not None:  # I-1: never decreases
                    assert raw_fencing >= self.seen_fencing.get(sid, 0)
                    self.seen_fencing[sid] = raw_fencing
                generation = 0 if raw_fencing is None else raw_fencing
                rows: list[QueuedWorkBatch | PendingTurnInput] = [*batches, *inputs]
                for r in rows:
                    key = r.batch_id if isinstance(r, QueuedWorkBatch) else r.input_id
                    assert r.claim_fencing_token >= self.seen_counter.get(key, 0)  # I-5
                    self.seen_counter[key] = r.claim_fencing_token
                    if r.claim_token is None:
                        assert (r.claim_id, r.claim_owner, r.claim_session_lease_generation) == (
                            None,
                            None,
                            0,
                        )
                    else:
                        assert r.claim_id is not None and r.claim_owner is not None
                        assert 1 <= r.claim_session_lease_generation <= generation  # I-6
                        assert r.claim_fencing_token >= 1
                for i in inputs:
                    if i.state is TurnInputState.ACCEPTED:
                        assert i.claim_token is not None, "an accepted input without a claim"
                    if i.state in (TurnInputState.COMPLETED, TurnInputState.CANCELLED):
                        assert i.claim_token is None
                # I-4 / I-7: rows only ever leave a claim; a claim is one (id, token, generation).
                for c in self.qclaims:
                    if c.session_id == sid:
                        holding = {
                            b.batch_id
                            for b in batches
                            if (b.claim_id, b.claim_token) == (c.claim_id, c.lease_token)
                        }
                        assert holding <= {b.batch_id for b in c.batches}
                for tc in self.tclaims:
                    if tc.session_id == sid:
                        holding = {
                            i.input_id
                            for i in inputs
                            if (i.claim_id, i.claim_token) == (tc.claim_id, tc.lease_token)
                        }
                        assert holding <= {i.input_id for i in tc.inputs}
                by_claim: dict[str, set[tuple[Any, ...]]] = {}
                for r in rows:
                    if r.claim_id is not None:
                        by_claim.setdefault(r.claim_id, set()).add(
                            (r.claim_token, r.claim_session_lease_generation)
                        )
                assert all(len(v) == 1 for v in by_claim.values())
                # I-10: one queued batch and one turn input per (session, source_key).
                for keys in ([b.source_key for b in batches], [i.source_key for i in inputs]):
                    counts = Counter(k for k in keys if k is not None)
                    assert all(n == 1 for n in counts.values()), counts
        assert now == self.now


SETTINGS = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
    ],
)


@pytest.mark.slow
def test_store_matches_the_model_after_every_step(db_url: str) -> None:
    """40 random runs of ≤ 30 steps; the store agrees with the model after every step.

    Decisions of spec/README.md the model encodes: strict claim completion
    (exact set, no duplicates; the seed compared counts), queued-work source-key
    conflicts (the seed returned the first batch), derived ids with random bits
    (only their shape and uniqueness are checked), ``now`` sampled after the
    lock, and the fenced recovery of stale accepted inputs.
    """
    global _URL
    _URL = db_url
    try:
        run_state_machine_as_test(SessionStoreMachine, settings=SETTINGS)
    finally:
        _URL = None

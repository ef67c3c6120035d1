"""A hammer: 8 spawned worker processes on 8 sessions while a feeder enqueues (both backends).

Each worker opens its own :class:`Store` (system clock), waits until every
worker and the feeder are ready (a barrier), and loops: at least
``MIN_ITERATIONS`` times whatever the clock says, then on until
``ITERATIONS`` or ``LOOP_SECONDS`` after that common start. Each iteration:
pick a random session;
``try_claim`` with a 300 ms ttl (on ``Busy`` sometimes ``reclaim`` with an
always-"gone" probe against the observed holder, which takes a *live* holder
over); claim ready queued work, the leading session command, next-turn and
active-turn inputs, or recover stale accepted inputs; then abandon or complete
each claim with its fence — sometimes after sleeping past the ttl, so the lease
lapses and another worker may take the session; then release. A
:class:`~agentkeep.errors.SessionExecutionLeaseExpired` or a ``…Superseded``
completion is a normal outcome for a worker that lost its lease. The parent
runs a feeder thread that enqueues batches and inputs while the workers run,
from the same start.

The clock only cuts the run short; it never decides a check. The checks that
it was a real contest (enough acquisitions, every session taken, both kinds
of work completed, some ``Busy``) count on the ``MIN_ITERATIONS`` each worker
always runs, however slow a loaded machine makes it.

Every worker logs each acquisition (session, generation, token, store time,
wall times), each claim (id, token, generation, rows with their per-row claim
ordinal), each abandon, recovery and successful completion. Afterwards:

* generations per session are distinct, exactly ``1..n`` (+1 per
  acquisition, I-1), ordered like the store times of the acquisitions, and the
  last one is the stored one;
* every claim and every successful completion used the live generation: no
  acquisition of a later generation had happened before the call started, and
  the completing lease had not expired by then; a completion names exactly
  its claim's rows;
* no row was completed twice, no two successful completions share a row;
  every enqueued batch is either completed or still stored, every input is
  completed (in the log and in the database) or still waiting — none lost;
* per row, the logged claims have ordinals ``1..k`` (I-5); a later claim has
  the same generation only if the earlier one was abandoned, else a higher one
  (I-6: two claims never held a row live at once); a completed claim is the
  row's last;
* in the database: a row with a claim token has a claim id, owner and a
  generation ≥ 1, and its claim is the last one logged for the row;
  ``claim_fencing_token`` is at least (here: exactly) the number of logged
  claims of the row; rows of one claim id share one token and generation.
"""

from __future__ import annotations

import random
import threading
import time
import traceback
import uuid
from collections import Counter, defaultdict
from typing import Any

import pytest
from sqlalchemy import text

from agentkeep.errors import (
    QueuedWorkClaimSuperseded,
    SessionExecutionLeaseExpired,
    TurnInputClaimSuperseded,
)
from agentkeep.sessions.domain import (
    Acquired,
    ActiveTurnIngress,
    Busy,
    CheckpointKind,
    ClaimBoundary,
    DeliveryPolicy,
    LeaseOwnerIdentity,
    MergeKey,
    MinBoundary,
    NextTurnIngress,
    PendingTurnInputDraft,
    QueuedWorkClaim,
    QueuedWorkDraft,
    QueuedWorkPayload,
    SessionExecutionLease,
    SlotPolicy,
    TurnInputClaim,
)
from agentkeep.sessions.liveness import ProcessState, capture_liveness
from agentkeep.store import Store
from tests.racing import SPAWN, run_processes, wait_ready

N_WORKERS = 8
SIDS = tuple(f"hammer-{k}" for k in range(8))
TTL_MS = 300
ITERATIONS = 200  # per worker at most; each iteration makes about four store calls
MIN_ITERATIONS = 25  # per worker at least, however long they take
LOOP_SECONDS = 25.0  # past the minimum, a worker stops this long after the common start
FEED_BATCHES = 320
FEED_INPUTS = 320
JOIN_TIMEOUT_S = 180.0  # once every worker is ready

Log = dict[str, list[Any]]


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


def _gone(pid: int, process_start: str) -> ProcessState:
    """The injected probe: every holder is "gone", so a reclaim takes a live holder over."""
    return "gone"


# --------------------------------------------------------------------------
# The worker (module level: spawned children import it)


def _claim_rows(claim: QueuedWorkClaim | TurnInputClaim) -> list[tuple[str, int]]:
    """(row id, per-row claim ordinal): batches are pre-claim snapshots, inputs post-claim rows."""
    if isinstance(claim, QueuedWorkClaim):
        return [(b.batch_id, b.claim_fencing_token + 1) for b in claim.batches]
    return [(i.input_id, i.claim_fencing_token) for i in claim.inputs]


def _claim_once(
    store: Store, rng: random.Random, sid: str, lease: SessionExecutionLease
) -> tuple[str, QueuedWorkClaim | TurnInputClaim | list[str] | None]:
    op = rng.choice(["ready", "ready", "leading", "next", "active", "active", "recover"])
    owner = lease.owner
    if op == "ready":
        boundary = rng.choice(list(ClaimBoundary))
        return op, store.queue.claim_ready_queued_work(
            sid, lease, owner, boundary, rng.randint(1, 3)
        )
    if op == "leading":
        return op, store.queue.claim_leading_ready_session_command(sid, lease, owner)
    if op == "next":
        return op, store.turn_inputs.claim_next_turn_inputs(sid, lease, owner, rng.randint(1, 3))
    if op == "active":
        checkpoint = rng.choice(list(CheckpointKind))
        return op, store.turn_inputs.claim_active_turn_inputs(
            sid, lease, owner, "T", checkpoint, rng.randint(1, 3)
        )
    recovered = store.turn_inputs.recover_stale_turn_input_claims(sid, lease)
    return op, [i.input_id for i in recovered]


def _think(rng: random.Random) -> None:
    """Sometimes pause a little, so that other workers interleave (and take leases over)."""
    if rng.random() < 0.3:
        time.sleep(rng.uniform(0.0, 0.03))


def _episode(
    store: Store, rng: random.Random, me: int, owner: LeaseOwnerIdentity, log: Log
) -> None:
    sid = rng.choice(SIDS)
    t0 = wall_ms()
    got = store.leases.try_claim_session_execution_lease(sid, owner, TTL_MS)
    log["calls"].append("try_claim")
    kind = "try_claim"
    if isinstance(got, Busy) and rng.random() < 0.5:
        t0 = wall_ms()
        got = store.leases.reclaim_session_execution_lease(
            sid, owner, got.holder, TTL_MS, probe=_gone
        )
        kind = "reclaim"
        log["calls"].append("reclaim")
    if isinstance(got, Busy):
        log["busy"].append(sid)
        return
    assert isinstance(got, Acquired)
    lease = got.lease
    log["acquired"].append(
        {
            "sid": sid,
            "worker": me,
            "kind": kind,
            "fencing": lease.fencing_token,
            "token": lease.lease_token,
            "claimed_at": lease.claimed_at_epoch_ms,
            "expires": lease.expires_at_epoch_ms,
            "t0": t0,
            "t1": wall_ms(),
        }
    )
    claims: list[QueuedWorkClaim | TurnInputClaim] = []
    for _ in range(rng.randint(1, 3)):
        _think(rng)
        t0 = wall_ms()
        log["calls"].append("claim")
        try:
            op, result = _claim_once(store, rng, sid, lease)
        except SessionExecutionLeaseExpired:
            log["claim_expired"].append(sid)
            break
        if isinstance(result, list):
            log["recovered"].append(
                {"sid": sid, "gen": lease.fencing_token, "ids": result, "t0": t0, "t1": wall_ms()}
            )
        elif result is not None:
            claims.append(result)
            log["claims"].append(
                {
                    "kind": "q" if isinstance(result, QueuedWorkClaim) else "t",
                    "op": op,
                    "sid": sid,
                    "worker": me,
                    "claim_id": result.claim_id,
                    "token": result.lease_token,
                    "gen": result.session_lease_generation,
                    "fence_gen": lease.fencing_token,
                    "rows": _claim_rows(result),
                    "t0": t0,
                    "t1": wall_ms(),
                }
            )
    if claims and rng.random() < 0.08:  # let the lease lapse: another worker may take it
        time.sleep((TTL_MS + 40) / 1000)
        log["lapses"].append(sid)
    for claim in claims:
        _think(rng)
        t0 = wall_ms()
        entry = {
            "kind": "q" if isinstance(claim, QueuedWorkClaim) else "t",
            "sid": sid,
            "worker": me,
            "claim_id": claim.claim_id,
            "token": claim.lease_token,
            "gen": claim.session_lease_generation,
            "fence_gen": lease.fencing_token,
            "lease_token": lease.lease_token,
            "lease_expires": lease.expires_at_epoch_ms,
            "rows": [r for r, _ in _claim_rows(claim)],
            "t0": t0,
        }
        if rng.random() < 0.25:
            log["calls"].append("abandon")
            if isinstance(claim, QueuedWorkClaim):
                store.queue.abandon_queued_work_claim(claim)
            else:
                store.turn_inputs.abandon_turn_input_claim(claim)
            log["abandons"].append({**entry, "t1": wall_ms()})
            continue
        log["calls"].append("complete")
        try:
            if isinstance(claim, QueuedWorkClaim):
                store.queue.complete_queued_work_claim(lease, claim.completion())
            else:
                store.turn_inputs.complete_turn_input_claim(lease, claim.completion())
        except SessionExecutionLeaseExpired:
            log["complete_expired"].append(claim.claim_id)
            continue
        except (QueuedWorkClaimSuperseded, TurnInputClaimSuperseded):
            log["complete_superseded"].append(claim.claim_id)
            continue
        log["completed"].append({**entry, "t1": wall_ms()})
    store.leases.release_session_execution_lease(lease)
    log["calls"].append("release")
    log["released"].append(sid)


def _worker(url: str, me: int, seed: int, ready: Any) -> Log:
    """Worker ``me``: open a Store, wait for everyone at ``ready``, then loop (module doc)."""
    log: Log = defaultdict(list)
    try:
        rng = random.Random(seed)
        owner = LeaseOwnerIdentity(
            owner_id=f"worker-{me}",
            incarnation_id=f"worker-{me}-{uuid.uuid4().hex[:8]}",
            liveness=capture_liveness(),
        )
        with Store.open(url) as store:
            wait_ready(ready)
            deadline = time.monotonic() + LOOP_SECONDS  # from the common start
            for n in range(ITERATIONS):
                if n >= MIN_ITERATIONS and time.monotonic() > deadline:
                    break
                _episode(store, rng, me, owner, log)
    except BaseException:
        ready.abort()  # nobody waits for a worker that will never be ready
        raise
    return dict(log)


# --------------------------------------------------------------------------
# The feeder (a thread of the parent, its own Store)


def _feed(
    url: str, ready: Any, stop: threading.Event, out: dict[str, list[Any]], errors: list[str]
) -> None:
    rng = random.Random(7)
    try:
        with Store.open(url) as store:
            wait_ready(ready)
            n_batches = n_inputs = 0
            while not stop.is_set() and (n_batches < FEED_BATCHES or n_inputs < FEED_INPUTS):
                sid = rng.choice(SIDS)
                if n_batches < FEED_BATCHES and (n_inputs >= FEED_INPUTS or rng.random() < 0.5):
                    command = rng.random() < 0.2
                    joins = not command and rng.random() < 0.5
                    draft = QueuedWorkDraft(
                        session_id=sid,
                        delivery_policy=rng.choice(list(DeliveryPolicy)),
                        slot_policy=SlotPolicy.JOIN if joins else SlotPolicy.EXCLUSIVE,
                        merge_key=MergeKey.of_group(rng.choice("gh"))
                        if joins
                        else MergeKey.never(),
                        available_at_ms=wall_ms() + rng.choice([0, 0, 0, 150]),
                        payloads=(
                            QueuedWorkPayload(
                                kind="session_command" if command else "user_input",
                                body={"n": n_batches},
                            ),
                        ),
                    )
                    batch = store.queue.enqueue_queued_work(draft)
                    out["batches"].append((sid, batch.batch_id))
                    n_batches += 1
                else:
                    ingress: ActiveTurnIngress | NextTurnIngress = (
                        ActiveTurnIngress(turn_id="T", min_boundary=rng.choice(list(MinBoundary)))
                        if rng.random() < 0.5
                        else NextTurnIngress()
                    )
                    item = store.turn_inputs.enqueue_pending_turn_input(
                        PendingTurnInputDraft(
                            session_id=sid, ingress=ingress, input={"m": n_inputs}
                        )
                    )
                    out["inputs"].append((sid, item.input_id))
                    n_inputs += 1
                time.sleep(0.005)
    except BaseException:  # noqa: BLE001 - re-raised by the test
        ready.abort()
        errors.append(traceback.format_exc())


# --------------------------------------------------------------------------
# The checks


def _merge(logs: list[Log]) -> Log:
    merged: Log = defaultdict(list)
    for log in logs:
        for key, values in log.items():
            merged[key].extend(values)
    return merged


def _check_generations(log: Log, stored: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
    """I-1: per session, distinct generations 1..n in store-time order; the last is stored."""
    by_sid: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for a in log["acquired"]:
        by_sid[a["sid"]].append(a)
    for sid, acqs in by_sid.items():
        acqs.sort(key=lambda a: a["fencing"])
        gens = [a["fencing"] for a in acqs]
        assert gens == list(range(1, len(gens) + 1)), f"{sid}: generations {gens}"
        assert len({a["token"] for a in acqs}) == len(acqs), f"{sid}: a lease token twice"
        for a, b in zip(acqs, acqs[1:], strict=False):
            assert a["claimed_at"] <= b["claimed_at"], f"{sid}: gen {b['fencing']} acquired earlier"
            assert b["t1"] >= a["t0"], (
                f"{sid}: gen {b['fencing']} returned before gen {a['fencing']}"
            )
        assert stored[sid] == gens[-1], f"{sid}: stored generation {stored[sid]} != {gens[-1]}"
    return by_sid


def _superseded_before(acqs: list[dict[str, Any]], gen: int, t0: int) -> list[int]:
    """Generations above ``gen`` acquired (store time) before a call that started at ``t0``."""
    return [a["fencing"] for a in acqs if a["fencing"] > gen and a["claimed_at"] < t0]


def _check_live_generation(log: Log, acqs: dict[str, list[dict[str, Any]]]) -> None:
    for c in log["claims"]:
        assert c["gen"] == c["fence_gen"], c
        assert not _superseded_before(acqs[c["sid"]], c["gen"], c["t0"]), f"stale claim {c}"
    for d in log["completed"]:
        assert d["gen"] == d["fence_gen"], d
        assert not _superseded_before(acqs[d["sid"]], d["fence_gen"], d["t0"]), (
            f"completed with a superseded fence: {d}"
        )
        assert d["lease_expires"] > d["t0"], f"completed after the lease expired: {d}"


def _check_rows(
    log: Log, fed: dict[str, list[Any]], batches: dict[str, Any], inputs: dict[str, Any]
) -> Counter[str]:
    """Completions, lost rows, per-row claim chains, stored claim columns."""
    claims = {(c["claim_id"], c["token"]): c for c in log["claims"]}
    assert len(claims) == len(log["claims"]), "two claims with one id and token"
    completed_rows = Counter(r for d in log["completed"] for r in d["rows"])
    twice = [r for r, n in completed_rows.items() if n > 1]
    assert not twice, f"rows completed twice: {twice[:5]}"
    for d in log["completed"]:
        c = claims[(d["claim_id"], d["token"])]
        assert [r for r, _ in c["rows"]] == d["rows"]

    # None lost: completed xor stored for batches; completed in log <=> in db for inputs.
    fed_batches = {bid for _, bid in fed["batches"]}
    fed_inputs = {iid for _, iid in fed["inputs"]}
    assert set(batches) <= fed_batches, "a stored batch nobody enqueued"
    assert set(inputs) == fed_inputs, "an input was lost (or appeared)"
    for bid in fed_batches:
        assert (bid in completed_rows) != (bid in batches), (
            f"batch {bid} lost or kept after completion"
        )
    for iid in fed_inputs:
        done = inputs[iid]["state"] == "completed"
        assert done == (iid in completed_rows), f"input {iid}: {inputs[iid]['state']}"

    # Per-row claim chains (I-5, I-6): two claims never held a row live at once.
    chains: dict[str, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    for c in log["claims"]:
        for row, ordinal in c["rows"]:
            chains[row].append((ordinal, c))
    abandoned = {(a["claim_id"], a["token"]) for a in log["abandons"]}
    done = {(d["claim_id"], d["token"]) for d in log["completed"]}
    for row, chain in chains.items():
        chain.sort(key=lambda e: e[0])
        assert [o for o, _ in chain] == list(range(1, len(chain) + 1)), f"{row}: ordinals"
        for (_, a), (_, b) in zip(chain, chain[1:], strict=False):
            key = (a["claim_id"], a["token"])
            assert key not in done, f"{row}: claimed again after its completion"
            if b["gen"] == a["gen"]:
                assert key in abandoned, f"{row}: re-claimed by generation {a['gen']} while live"
            else:
                assert b["gen"] > a["gen"], f"{row}: generation went back {a['gen']} -> {b['gen']}"

    # In-db consistency of the claim columns.
    tokens_of_claim: dict[str, set[tuple[str, int]]] = defaultdict(set)
    for row_id, r in [*batches.items(), *inputs.items()]:
        chain = chains.get(row_id, [])
        assert r["claim_fencing_token"] >= len(chain), f"{row_id}: counter below its claims"
        assert r["claim_fencing_token"] == len(chain), f"{row_id}: a claim was not logged"
        if r["claim_token"] is None:
            assert r["claim_id"] is None and r["claim_session_lease_generation"] == 0, r
            assert r["claim_owner_id"] is None, r
            assert r.get("state") != "accepted", f"{row_id}: accepted without a claim"
            continue
        assert r["claim_id"] is not None and r["claim_owner_id"] is not None, r
        assert r["claim_session_lease_generation"] >= 1, r
        last = chain[-1][1]
        assert (r["claim_id"], r["claim_token"]) == (last["claim_id"], last["token"]), row_id
        assert r["claim_session_lease_generation"] == last["gen"], row_id
        tokens_of_claim[r["claim_id"]].add((r["claim_token"], r["claim_session_lease_generation"]))
    assert all(len(v) == 1 for v in tokens_of_claim.values())
    return completed_rows


def _stored(store: Store) -> tuple[dict[str, int], dict[str, Any], dict[str, Any]]:
    cols = (
        "claim_id, claim_owner_id, claim_token, claim_fencing_token, "
        "claim_session_lease_generation, session_id"
    )
    with store.read() as uow:
        leases = uow.connection.execute(
            text("SELECT session_id, lease_fencing_token FROM session_execution_leases")
        ).all()
        batches = uow.connection.execute(
            text(f"SELECT batch_id, {cols} FROM queued_work_batches")
        ).mappings()
        batch_rows = {r["batch_id"]: dict(r) for r in batches if r["session_id"] in SIDS}
        inputs = uow.connection.execute(
            text(f"SELECT input_id, state, {cols} FROM pending_turn_inputs")
        ).mappings()
        input_rows = {r["input_id"]: dict(r) for r in inputs if r["session_id"] in SIDS}
    return {s: f for s, f in leases if s in SIDS}, batch_rows, input_rows


@pytest.mark.slow
def test_hammer_eight_workers_eight_sessions(db_url: str, backend: str) -> None:
    """8 spawned workers × 8 sessions with a concurrent feeder; fencing holds throughout."""
    ready = SPAWN.Barrier(N_WORKERS + 1)  # the workers and the feeder
    fed: dict[str, list[Any]] = defaultdict(list)
    feed_errors: list[str] = []
    stop = threading.Event()
    feeder = threading.Thread(
        target=_feed, args=(db_url, ready, stop, fed, feed_errors), daemon=True
    )
    started = time.monotonic()
    feeder.start()
    try:
        results = run_processes(
            [(_worker, (db_url, i, 1000 + i, ready)) for i in range(N_WORKERS)], JOIN_TIMEOUT_S
        )
    finally:
        stop.set()
        feeder.join(JOIN_TIMEOUT_S)
    assert not feeder.is_alive(), "the feeder hung"
    assert not feed_errors, feed_errors[0]
    log = _merge(results)

    with Store.open(db_url) as store:
        stored_gens, batches, inputs = _stored(store)
    acqs = _check_generations(log, stored_gens)
    _check_live_generation(log, acqs)
    completed = _check_rows(log, fed, batches, inputs)

    # It was a real contest, not a procession.
    counts = {k: len(v) for k, v in log.items() if k != "calls"}
    calls = Counter(log["calls"])
    print(
        f"\n[{backend}] {time.monotonic() - started:.1f}s: {sum(calls.values())} worker calls "
        f"{dict(sorted(calls.items()))}, {len(fed['batches'])} batches and "
        f"{len(fed['inputs'])} inputs fed, {len(completed)} rows completed; "
        f"outcomes {dict(sorted(counts.items()))}"
    )
    assert counts.get("acquired", 0) >= 50
    assert len({a["sid"] for a in log["acquired"]}) == len(SIDS)
    assert {c["kind"] for c in log["completed"]} == {"q", "t"}
    assert counts.get("busy", 0) > 0, "no worker ever met another's lease"
    # A completion under a live fence of the claim's own generation can never be superseded:
    # nothing else re-claims, recovers or cancels rows of the live generation.
    assert counts.get("complete_superseded", 0) == 0, log["complete_superseded"][:5]

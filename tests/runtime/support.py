"""Shared helpers of the runtime store tests: fixtures-as-functions, raw SQL, triggers, racers.

* :func:`accepted` / :func:`replacement_records`: the seed's ``input_state()``
  and ``replacement_records(expected, n)`` fixtures (spec runtime §4).
* :func:`raw_exec`, :func:`raw_rows` (from :mod:`tests.support`),
  :func:`raw_snapshot`: SQL straight on the database (setup of corrupt or
  legacy rows, and assertions on what is really stored).
* :func:`abort_trigger`: a ``BEFORE INSERT/UPDATE/DELETE`` trigger that aborts
  (SQLite ``RAISE(ABORT)``; Postgres a plpgsql function), always dropped on
  exit. Tests that install one use a fresh database on Postgres.
* :func:`race_processes`: ``n`` ``spawn``-ed processes (:mod:`tests.racing`),
  each with its own :class:`~agentkeep.store.Store`, lined up on a barrier
  before every round; the bodies below are module-level so the children can
  import them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Final

from sqlalchemy import create_engine

from agentkeep.runtime.domain import InputStatePersistenceRecord, OpsSnapshot, StoredInputState
from agentkeep.store import Store
from tests import racing
from tests.support import raw_exec, raw_rows

RT: Final = "runtime-1"
#: A runtime id nothing is stored under: ``runtime_state(url, NOTHING)`` is "no rows at all".
NOTHING: Final = "nothing-stored"


# --------------------------------------------------------------------------
# Seed fixtures


def accepted(n: int) -> list[StoredInputState]:
    """``n`` new accepted input states with random ids (recovery_count 0)."""
    return [StoredInputState.new_accepted() for _ in range(n)]


def replacement_records(
    expected: Sequence[StoredInputState], n: int
) -> list[InputStatePersistenceRecord]:
    """The same rows with ``recovery_count = n``, as machine-authorized records."""
    return [
        InputStatePersistenceRecord.from_machine_snapshot(s.with_recovery_count(n))
        for s in expected
    ]


def recovery_counts(store: Store, runtime_id: str) -> dict[str, int]:
    """``input_id -> recovery_count`` of every stored input of the runtime."""
    return {s.input_id: s.recovery_count for s in store.runtime.load_input_states(runtime_id)}


# --------------------------------------------------------------------------
# Raw SQL


def raw_snapshot(url: str, data: bytes, runtime_id: str = RT) -> None:
    """Store ``data`` as the runtime's session snapshot, bypassing every check."""
    raw_exec(
        url,
        "INSERT INTO runtime_session_snapshots (runtime_id, session_snapshot) VALUES (:rt, :d)",
        params={"rt": runtime_id, "d": data},
    )


def input_bytes(url: str, runtime_id: str) -> dict[str, Any]:
    """``input_id -> state_json`` as stored, for one runtime."""
    rows = raw_rows(
        url,
        "SELECT input_id, state_json FROM runtime_input_states WHERE runtime_id = :rt",
        {"rt": runtime_id},
    )
    return {r[0]: r[1] for r in rows}


@contextmanager
def abort_trigger(
    url: str, backend: str, table: str, event: str, *, when_input_id: str | None = None
) -> Iterator[None]:
    """Install a ``BEFORE <event>`` row trigger on ``table`` that aborts; drop it on exit.

    Args:
        url: the database.
        backend: ``"sqlite"`` or ``"postgres"``.
        table: the table.
        event: ``INSERT``, ``UPDATE`` or ``DELETE``.
        when_input_id: abort only when ``NEW.input_id`` is this id.
    """
    name = f"ak_test_abort_{event.lower()}"
    row = "OLD" if event == "DELETE" else "NEW"
    eng = create_engine(url)
    try:
        with eng.begin() as conn:
            if backend == "sqlite":
                when = f" WHEN {row}.input_id = '{when_input_id}'" if when_input_id else ""
                conn.exec_driver_sql(
                    f"CREATE TRIGGER {name} BEFORE {event} ON {table} FOR EACH ROW{when} "
                    "BEGIN SELECT RAISE(ABORT, 'test trigger abort'); END"
                )
            else:
                when = f" WHEN ({row}.input_id = '{when_input_id}')" if when_input_id else ""
                conn.exec_driver_sql(
                    f"CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS "
                    "$$ BEGIN RAISE EXCEPTION 'test trigger abort'; END $$"
                )
                conn.exec_driver_sql(
                    f"CREATE TRIGGER {name} BEFORE {event} ON {table} FOR EACH ROW{when} "
                    f"EXECUTE FUNCTION {name}()"
                )
        yield
    finally:
        with eng.begin() as conn:
            conn.exec_driver_sql(
                f"DROP TRIGGER IF EXISTS {name}"
                if backend == "sqlite"
                else f"DROP TRIGGER IF EXISTS {name} ON {table}"
            )
            if backend != "sqlite":
                conn.exec_driver_sql(f"DROP FUNCTION IF EXISTS {name}()")
        eng.dispose()


# --------------------------------------------------------------------------
# Process racers


def race_processes(url: str, body: str, n: int, params: dict[str, Any]) -> list[Any]:
    """Run this module's ``body(store, i, barrier, params)`` in ``n`` spawned processes.

    Each process opens its own Store on ``url``; a body waits on the barrier
    before each round, so the racers of a round start together. Returns their
    results in racer order (see :mod:`tests.racing`).
    """
    return racing.race_processes(racing.Racing(processes=n), url, globals()[body], params)


def body_input_cas(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[str]:
    """Per round: CAS the round's expected rows to ``recovery_count = i + 1``."""
    out = []
    for runtime_id, expected in p["rounds"]:
        replacements = replacement_records(expected, i + 1)
        barrier.wait()
        outcome = store.runtime.compare_and_swap_input_states_atomically(
            runtime_id, expected, replacements
        )
        out.append(str(outcome))
    return out


def body_ops_init(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[str]:
    """Per round: initialize the runtime's ops with this racer's own epoch."""
    out = []
    for n, runtime_id in enumerate(p["runtimes"]):
        candidate = OpsSnapshot(epoch_id=f"epoch-{n}-racer-{i}", payload={"racer": i})
        barrier.wait()
        out.append(store.runtime.initialize_ops_lifecycle_if_absent(runtime_id, candidate).epoch_id)
    return out


def body_mob_put(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[bool]:
    """Per round: put_if_absent this racer's record."""
    out = []
    for mob_id in p["mobs"]:
        barrier.wait()
        out.append(store.runtime.put_mob_host_binding_if_absent(mob_id, f"record-{i}".encode()))
    return out


def body_mob_cas(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[bool]:
    """Per round: compare_and_put from the shared old record to this racer's record."""
    out = []
    for mob_id in p["mobs"]:
        barrier.wait()
        out.append(
            store.runtime.compare_and_put_mob_host_binding(mob_id, p["old"], f"record-{i}".encode())
        )
    return out


def body_mob_revoke(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[bool]:
    """Per round: revoke the shared binding with this racer's receipt."""
    out = []
    for mob_id in p["mobs"]:
        barrier.wait()
        out.append(store.runtime.revoke_mob_host_binding(mob_id, p["old"], f"receipt-{i}".encode()))
    return out


def increment(current: bytes | None) -> bytes:
    """OAuth update callback: the payload is a decimal counter."""
    return str(int(current or b"0") + 1).encode()


def body_oauth_increment(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> None:
    """Start together, then increment the OAuth counter ``p["k"]`` times."""
    barrier.wait()
    for _ in range(p["k"]):
        store.runtime.update_auth_oauth_flow_snapshot(increment)

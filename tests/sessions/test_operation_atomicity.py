"""An operation that fails after some of its writes leaves none of them, in every kind of unit.

``db.atomic``: in a one-call unit (``store.queue.enqueue_queued_work(...)``) the
operation's error rolls the whole unit back, so no SAVEPOINT is sent; where the
unit may hold other work, or a caller that catches the error and still commits
(``store.write()``, ``store.call_write(fn)``), the operation runs in a SAVEPOINT.
The failure injected here is a size limit: the batch row is written, then its
second item is refused (``PayloadTooLarge``, raised when that INSERT is about to
run).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text

from agentkeep import Store
from agentkeep.db import Driver
from agentkeep.errors import PayloadTooLarge
from agentkeep.limits import Limits
from agentkeep.sessions.domain import QueuedWorkDraft, QueuedWorkPayload

SID = "S-atomic"


@pytest.fixture
def small_store(db_url: str) -> Iterator[Store]:
    s = Store.open(db_url, limits=Limits(max_payload_bytes=200))
    yield s
    s.close()


@pytest.fixture
def savepoints(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the SAVEPOINTs repositories open (``Driver.savepoint``)."""
    opened: list[int] = []
    real = Driver.savepoint

    def counting(self: Driver) -> Any:
        opened.append(1)
        return real(self)

    monkeypatch.setattr(Driver, "savepoint", counting)
    return opened


def _draft(second_body: str) -> QueuedWorkDraft:
    return QueuedWorkDraft(
        session_id=SID,
        payloads=(
            QueuedWorkPayload(kind="user_input", body="small"),
            QueuedWorkPayload(kind="user_input", body=second_body),
        ),
    )


def _rows(store: Store) -> tuple[int, int]:
    with store.read() as uow:
        batches = uow.connection.execute(text("SELECT count(*) FROM queued_work_batches")).scalar()
        items = uow.connection.execute(text("SELECT count(*) FROM queued_work_items")).scalar()
    return int(batches or 0), int(items or 0)


def test_one_call_sends_no_savepoint_and_a_failure_leaves_nothing(
    small_store: Store, savepoints: list[int]
) -> None:
    small_store.queue.enqueue_queued_work(_draft("fits"))
    assert savepoints == []
    assert _rows(small_store) == (1, 2)
    with pytest.raises(PayloadTooLarge):
        small_store.queue.enqueue_queued_work(_draft("x" * 400))
    assert savepoints == []
    assert _rows(small_store) == (1, 2)


def test_call_write_keeps_the_savepoint_so_a_caught_failure_leaves_nothing(
    small_store: Store, savepoints: list[int]
) -> None:
    caught: list[BaseException] = []

    def fn(r: Any) -> None:
        try:
            r.queue.enqueue_queued_work(_draft("x" * 400))
        except PayloadTooLarge as exc:
            caught.append(exc)
        r.queue.enqueue_queued_work(_draft("fits"))

    small_store.call_write(fn)
    assert len(caught) == 1
    assert len(savepoints) == 2
    assert _rows(small_store) == (1, 2)  # only the second batch


def test_a_write_unit_keeps_the_savepoint_so_a_caught_failure_leaves_nothing(
    small_store: Store, savepoints: list[int]
) -> None:
    with small_store.write() as uow:
        with pytest.raises(PayloadTooLarge):
            uow.queue.enqueue_queued_work(_draft("x" * 400))
        uow.queue.enqueue_queued_work(_draft("fits"))
    assert len(savepoints) == 2
    assert _rows(small_store) == (1, 2)

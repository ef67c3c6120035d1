"""The direct encoders of input states and receipts write the general encoding's bytes.

:func:`~agentkeep.runtime.records.encode_input_state` and
:func:`~agentkeep.runtime.receipts.encode_receipt` write the common value
(ASCII text, no details, ...) directly instead of ``model_dump`` + the
canonical JSON walk. Every value, common or not, must encode to exactly the
bytes of ``canonical_bytes(value.model_dump(mode="json"))``, and the common
ones must take the direct path (else this test would prove nothing).
No database: pure functions.
"""

from __future__ import annotations

import uuid
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from agentkeep.runtime.receipts import RunBoundaryReceipt, _plain_receipt, encode_receipt
from agentkeep.runtime.records import StoredInputState, _plain_input_state, encode_input_state
from agentkeep.strict_json import canonical_bytes

# Text with what JSON escapes (quote, backslash, control characters, DEL) and non-ASCII.
_TEXT = st.text(
    alphabet=st.sampled_from(
        [
            "a",
            "Z",
            "0",
            " ",
            '"',
            "\\",
            "\n",
            "\t",
            "\x00",
            "\x1f",
            "\x7f",
            "/",
            "é",
            "€",
            "😀",
            "\u2028",
        ]
    ),
    min_size=1,
    max_size=12,
)
_UUIDS = st.builds(lambda n: str(uuid.UUID(int=n)), st.integers(0, 2**128 - 1))
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63) | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=6,
)


def _general(value: StoredInputState | RunBoundaryReceipt) -> bytes:
    return canonical_bytes(value.model_dump(mode="json"))


@settings(max_examples=300, deadline=None)
@given(
    input_id=_UUIDS,
    current=_TEXT,
    count=st.integers(0, 2**63 - 1),
    outcome=st.none() | _TEXT | _JSON,
    details=st.just({}) | st.dictionaries(_TEXT, _JSON, max_size=2),
)
def test_input_state_bytes_equal_the_general_encoding(
    input_id: str, current: str, count: int, outcome: Any, details: dict[str, Any]
) -> None:
    state = StoredInputState(
        input_id=input_id,
        current_state=current,
        recovery_count=count,
        terminal_outcome=outcome,
        details=details,
    )
    assert encode_input_state(state) == _general(state)
    common = (
        current.isascii()
        and not details
        and (outcome is None or (type(outcome) is str and outcome.isascii()))
    )
    assert (_plain_input_state(state) is not None) == common


@settings(max_examples=300, deadline=None)
@given(
    run_id=_UUIDS,
    boundary=_TEXT,
    ids=st.lists(_UUIDS, max_size=4).map(tuple),
    digest=st.none() | _TEXT,
    count=st.integers(0, 2**63 - 1),
    sequence=st.integers(0, 2**64 - 1),
)
def test_receipt_bytes_equal_the_general_encoding(
    run_id: str,
    boundary: str,
    ids: tuple[str, ...],
    digest: str | None,
    count: int,
    sequence: int,
) -> None:
    receipt = RunBoundaryReceipt(
        run_id=run_id,
        boundary=boundary,
        contributing_input_ids=ids,
        conversation_digest=digest,
        message_count=count,
        sequence=sequence,
    )
    assert encode_receipt(receipt) == _general(receipt)
    common = boundary.isascii() and (digest is None or digest.isascii())
    assert (_plain_receipt(receipt) is not None) == common


def test_a_subclass_takes_the_general_path() -> None:
    """A subclass may add fields: only the exact classes are written directly."""

    class Tagged(StoredInputState):
        pass

    state = Tagged(input_id=str(uuid.uuid4()), current_state="accepted")
    assert _plain_input_state(state) is None
    assert encode_input_state(state) == _general(state)

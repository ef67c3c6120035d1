"""The one-call argument check (agentkeep.arguments): which values each kind of annotation
takes and refuses, whichever form of test it is compiled to (one ``isinstance`` for a
union of plain classes, a per-item test in C for a sequence of one class, the general
tests otherwise)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pytest

from agentkeep.arguments import argument_check
from agentkeep.errors import InvalidInput


@dataclass(frozen=True)
class Rec:
    n: int


@dataclass(frozen=True)
class Other:
    s: str


class SubRec(Rec):
    pass


def op(
    one: Rec,
    either: Rec | Other,
    maybe: Rec | None,
    recs: Sequence[Rec],
    mixed: Sequence[Rec | Other],
    numbered: Rec | int,
    data: bytes | Rec,
    mode: Literal["a", "b"] | Rec,
) -> None:
    """An operation with one parameter of each kind of checked annotation."""


GOOD: dict[str, Any] = {
    "one": Rec(1),
    "either": Other("x"),
    "maybe": None,
    "recs": [Rec(1), SubRec(2)],
    "mixed": (Rec(1), Other("y")),
    "numbered": 3,
    "data": memoryview(b"ab"),
    "mode": "b",
}

# (parameter, a value it takes, a value it refuses, the field the refusal names)
CASES = [
    ("one", SubRec(1), Other("x"), "one"),
    ("either", Rec(1), {"n": 1}, "either"),
    ("maybe", Rec(1), Other("x"), "maybe"),
    ("recs", (), [Rec(1), Other("x")], "recs[1]"),
    ("recs", [SubRec(1)], "not a list", "recs"),
    ("mixed", [Other("x"), Rec(2)], [Rec(1), Rec(2), 3], "mixed[2]"),
    ("numbered", Rec(1), True, "numbered"),
    ("data", bytearray(b"x"), "text", "data"),
    ("mode", Rec(1), "c", "mode"),
]


def test_good_arguments_pass() -> None:
    check = argument_check(op)
    check(**GOOD)
    check(*GOOD.values())


@pytest.mark.parametrize(("param", "taken", "refused", "field"), CASES)
def test_each_annotation_takes_and_refuses_what_it_says(
    param: str, taken: object, refused: object, field: str
) -> None:
    check = argument_check(op)
    check(**{**GOOD, param: taken})
    with pytest.raises(InvalidInput) as caught:
        check(**{**GOOD, param: refused})
    assert caught.value.field == field
    positional = [refused if name == param else value for name, value in GOOD.items()]
    with pytest.raises(InvalidInput) as caught:
        check(*positional)
    assert caught.value.field == field

"""Pydantic records built from values the store already checked, without validating them again.

A record the store makes from a decoded row, or from values it wrote itself,
holds values that validation would keep as they are. Building it through
``cls(**fields)`` or ``model_construct`` spends most of the time on work that
changes nothing; :func:`fill` sets the instance's slots directly. Each use is
checked once, at import, against what pydantic itself builds
(:func:`checked_builder`; the run store's codec checks its own sample): a
pydantic that builds anything else gets validation instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, TypeVar

from pydantic import BaseModel

__all__ = [
    "checked_builder",
    "fill",
    "new_record",
    "set_dict",
    "set_extra",
    "set_fields_set",
    "set_private",
]

_M = TypeVar("_M", bound=BaseModel)

# A pydantic model's instance slots, set through their descriptors (one C call
# each, cheaper than object.__setattr__ with a name). Public for a hot loop that
# inlines :func:`fill` (the run store's step-log decode).
set_dict: Final = BaseModel.__dict__["__dict__"].__set__
set_fields_set: Final = BaseModel.__dict__["__pydantic_fields_set__"].__set__
set_extra: Final = BaseModel.__dict__["__pydantic_extra__"].__set__
set_private: Final = BaseModel.__dict__["__pydantic_private__"].__set__
new_record: Final = object.__new__


def fill(cls: type[_M], values: dict[str, Any]) -> _M:
    """What ``cls(**values)`` builds when ``values`` holds every field, in declared order,
    each as validation would keep it: ``values`` becomes the record's ``__dict__``.

    Only for values already checked, and only where a check at import showed
    that this pydantic builds the same (:func:`checked_builder`).
    """
    record = new_record(cls)
    set_dict(record, values)
    set_fields_set(record, set(values))
    set_extra(record, None)
    set_private(record, None)
    return record


def checked_builder(cls: type[_M], probe: dict[str, Any]) -> Callable[..., _M]:
    """A constructor of ``cls`` for values already checked, without pydantic validation.

    The constructor takes **every** field of ``cls`` by keyword, in declared
    order, each a value validation would keep as it is (the store checked
    it: a decoded row, a validated record's field, a value the store built
    itself); it builds what ``cls(**fields)`` builds (the same ``__dict__``,
    every field set, no extra or private state) without the validator's
    call, at a third of ``model_construct``'s cost. ``probe`` (every field)
    is built both ways once, here: when this pydantic builds anything else,
    the constructor is ``cls`` itself (validation).
    """

    def build(**fields: Any) -> _M:
        return fill(cls, fields)

    fast, slow = build(**probe), cls(**probe)
    same = (
        list(probe) == list(cls.model_fields)
        and fast == slow
        and list(fast.__dict__) == list(slow.__dict__)
        and fast.model_fields_set == slow.model_fields_set
        and fast.__pydantic_extra__ == slow.__pydantic_extra__
        and fast.__pydantic_private__ == slow.__pydantic_private__
        and fast.model_dump() == slow.model_dump()
        and repr(fast) == repr(slow)
    )
    return build if same else cls

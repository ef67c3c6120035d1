"""The argument check of every one-call operation: each argument has its parameter's type.

A value of the wrong Python type (a dict where a record is expected, a list
where bytes are) would otherwise fail deep inside an operation with an
``AttributeError`` or ``TypeError``, possibly after a statement ran. Every
one-call operation (``store.runs.get``, ``store.runtime.atomic_apply``, ...,
and so the :class:`~agentkeep.AsyncStore` operations that run them) checks
its arguments against its own annotations first, in one place:
:class:`agentkeep.one_call.OneCalls` wraps every public method of a facade
class (:func:`check_methods`) and every :func:`~agentkeep.one_call.read` /
:func:`~agentkeep.one_call.write` forwarder with :func:`argument_check`, which
raises :class:`~agentkeep.errors.InvalidInput` naming the parameter before
anything runs. The runtime repository's parts (``uow.runtime.<op>`` inside a
unit of work) are decorated with :func:`check_methods` too.

What is checked, from the annotation (resolved once per operation):

* a class (``bytes``, a record model): ``isinstance``; ``bytes`` also takes
  ``bytearray`` and ``memoryview`` (the operations copy them);
* ``X | Y`` / ``Optional[X]``: any alternative; ``Annotated[X, ...]``: ``X``;
* ``Sequence[X]`` / ``list[X]`` / ``tuple[X, ...]``: a list or tuple (never
  a ``str`` or ``bytes``) of ``X``;
* ``Callable[...]``: ``callable``; ``Literal[...]``: one of the values;
* ``object``, ``Any``, type variables, protocols and anything else: not checked;
* scalars (``str``, ``int``, ``float``, ``bool``, enums, and unions of them
  with ``None``): not checked here. The operations check them themselves, with
  errors more specific than a type mismatch (an id's format
  (:class:`~agentkeep.errors.IdParseError`), a missing slot
  (:class:`~agentkeep.errors.AssigneeSlotRequired`), an integer's range
  (:func:`agentkeep.bounds.check_u63`)), which this check must not pre-empt.

Values are not validated here (ranges, id formats, text rules): the
operations and :mod:`agentkeep.text` do that.
"""

from __future__ import annotations

import collections.abc
import enum
import functools
import inspect
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from agentkeep.errors import InvalidInput

__all__ = ["argument_check", "check_methods", "checked", "no_check"]

T = TypeVar("T")
C = TypeVar("C", bound=type)

Check = Callable[[object], bool]


_SCALARS = (str, int, float, bool, enum.Enum, type(None))


def _scalar(annotation: Any) -> bool:
    """Whether ``annotation`` is a scalar (or a union of scalars): left to the operation."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _scalar(typing.get_args(annotation)[0])
    if origin is typing.Union or origin is types.UnionType:
        return all(_scalar(a) for a in typing.get_args(annotation))
    return isinstance(annotation, type) and issubclass(annotation, _SCALARS)


def _predicate(annotation: Any) -> Check | None:
    """A type test for ``annotation``, or None when it is not checked."""
    if _scalar(annotation):
        return None
    return _test(annotation)


def _test(annotation: Any) -> Check | None:
    """A type test for ``annotation`` (scalars too: inside a union with a record)."""
    if annotation is Any or annotation is object or isinstance(annotation, typing.TypeVar):
        return None
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _predicate(args[0])
    if origin is typing.Union or origin is types.UnionType:
        alternatives = [_test(a) for a in args]
        if any(p is None for p in alternatives):
            return None
        union = _plain_classes(annotation)
        if union is not None:  # one isinstance call, no generator
            members = union
            return lambda v: isinstance(v, members)
        checks = tuple(p for p in alternatives if p is not None)
        return lambda v: any(p(v) for p in checks)
    if origin is typing.Literal:
        allowed = args
        return lambda v: any(v == a and type(v) is type(a) for a in allowed)
    if origin in (collections.abc.Callable,):
        return callable
    if origin in (collections.abc.Sequence, list, tuple):
        inner_args = [a for a in args if a is not Ellipsis]
        inner = _predicate(inner_args[0]) if len(inner_args) == 1 else None
        if inner is None:
            return lambda v: isinstance(v, (list, tuple))
        classes = _plain_classes(inner_args[0])
        if classes is not None and len(classes) == 1:
            # The class's own instance test, mapped in C: no generator frame per item.
            instance = classes[0].__instancecheck__
            return lambda v: isinstance(v, (list, tuple)) and all(map(instance, v))
        return lambda v: isinstance(v, (list, tuple)) and all(inner(x) for x in v)
    if annotation is type(None):
        return lambda v: v is None
    if not isinstance(annotation, type) or getattr(annotation, "_is_protocol", False):
        return None
    return _class_check(annotation)


def _sequence_item(annotation: Any) -> tuple[Any, Check] | None:
    """The item annotation and its test of a ``Sequence[X]`` annotation (also inside
    ``Annotated`` or a union), or None."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _sequence_item(args[0])
    if origin is typing.Union or origin is types.UnionType:
        for alternative in args:
            found = _sequence_item(alternative)
            if found is not None:
                return found
        return None
    if origin in (collections.abc.Sequence, list, tuple):
        inner = [a for a in args if a is not Ellipsis]
        if len(inner) == 1:
            check = _predicate(inner[0])
            if check is not None:
                return inner[0], check
    return None


def _plain_classes(annotation: Any) -> tuple[type, ...] | None:
    """The classes ``annotation`` (a class or a union of them) is tested against with
    ``isinstance`` alone, or None where its test is anything else.

    ``int`` (which refuses ``bool``), ``bytes`` (which takes any buffer),
    ``object`` and protocols have tests of their own: None for them.
    """
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        found: list[type] = []
        for alternative in typing.get_args(annotation):
            classes = _plain_classes(alternative)
            if classes is None:
                return None
            found.extend(classes)
        return tuple(found)
    if (
        isinstance(annotation, type)
        and annotation not in (int, bytes, object)
        and not getattr(annotation, "_is_protocol", False)
    ):
        return (annotation,)
    return None


def _class_check(cls: type) -> Check:
    if cls is bytes:
        return lambda v: isinstance(v, (bytes, bytearray, memoryview))
    if cls is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    return lambda v: isinstance(v, cls)


def _describe(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "").replace("collections.abc.", "")


def _hints(fn: Callable[..., Any], params: list[inspect.Parameter]) -> dict[str, Any]:
    """The resolved annotations of ``fn``; one by one when some cannot be resolved."""
    try:
        return typing.get_type_hints(fn, include_extras=True)
    except Exception:  # noqa: BLE001 - e.g. a name imported only for type checking
        pass
    hints: dict[str, Any] = {}
    namespace = getattr(inspect.unwrap(fn), "__globals__", {})
    for p in params:
        annotation = p.annotation
        if annotation is inspect.Parameter.empty:
            continue
        try:
            hints[p.name] = (
                eval(annotation, namespace) if isinstance(annotation, str) else annotation  # noqa: S307
            )
        except Exception:  # noqa: BLE001, S112 - this one stays unchecked
            continue
    return hints


def argument_check(fn: Callable[..., Any], *, skip_first: bool = False) -> Callable[..., None]:
    """A function ``check(*args, **kwargs)`` that refuses arguments of the wrong type for ``fn``.

    Args:
        fn: the function whose annotations are applied.
        skip_first: ``fn`` is a method called unbound (skip ``self``).

    The check raises :class:`~agentkeep.errors.InvalidInput` (field: the
    parameter's name). Parameters whose annotation cannot be resolved are
    not checked; arguments that do not bind are left to the call (which
    raises ``TypeError`` as Python does). When no parameter is checked (all
    scalars) the check is :func:`no_check`, which a hot caller may skip.
    """
    params = list(inspect.signature(fn).parameters.values())
    hints = _hints(fn, params)
    if skip_first:
        params = params[1:]
    positional: list[tuple[str, Check | None, Any]] = []
    named: dict[str, tuple[Check, Any]] = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        annotation = hints.get(p.name)
        check = _predicate(annotation) if p.name in hints else None
        if p.kind is not p.KEYWORD_ONLY:
            positional.append((p.name, check, annotation))
        if check is not None:
            named[p.name] = (check, annotation)

    def refuse(name: str, annotation: Any, value: object) -> InvalidInput:
        item = _sequence_item(annotation)
        if item is not None and isinstance(value, (list, tuple)):
            item_annotation, item_check = item
            for i, x in enumerate(value):  # name the first item of the wrong type
                if not item_check(x):
                    return InvalidInput(
                        f"{name}[{i}]",
                        f"expected {_describe(item_annotation)}, got {type(x).__name__}",
                    )
        return InvalidInput(name, f"expected {_describe(annotation)}, got {type(value).__name__}")

    if not named:  # no parameter is checked: the shared no-op (callers may skip it)
        return no_check

    def check_arguments(*args: Any, **kwargs: Any) -> None:
        for (name, check, annotation), value in zip(positional, args, strict=False):
            if check is not None and not check(value):
                raise refuse(name, annotation, value)
        for name, value in kwargs.items():
            entry = named.get(name)
            if entry is not None and not entry[0](value):
                raise refuse(name, entry[1], value)

    return check_arguments


def no_check(*args: Any, **kwargs: Any) -> None:
    """The check of a function none of whose parameters is checked (see :func:`argument_check`)."""


def checked(method: Callable[..., T]) -> Callable[..., T]:
    """``method`` (a method: its first parameter is ``self``) with its arguments checked first.

    The check is built on the first call (annotations are resolved late:
    modules imported for type checking only are loaded by then).
    """
    checks: list[Callable[..., None]] = []

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> T:
        if not checks:
            checks.append(argument_check(method, skip_first=True))
        checks[0](*args, **kwargs)
        return method(self, *args, **kwargs)

    return call


def check_methods(cls: C) -> C:
    """Give every public method defined in ``cls`` the argument check (:func:`checked`)."""
    for name, member in list(vars(cls).items()):
        if not name.startswith("_") and inspect.isfunction(member):
            setattr(cls, name, checked(member))
    return cls

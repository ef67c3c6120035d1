"""One-call forms of repository methods, declared once and typed from the repository.

``store.runs.get(run_id)`` runs :meth:`RunRepository.get` in a unit of work of
its own (:meth:`agentkeep.Store.call_read` / :meth:`~agentkeep.Store.call_write`:
a lean unit on a pooled driver connection, retried as a whole on a transient
busy error). Instead of a hand-written method per operation that only
forwards, a facade class declares each forwarder in one line::

    class RunCalls(OneCalls):
        _repository = "runs"                   # the attribute of the unit's repositories
        get = read(RunRepository.get)          # store.runs.get(run_id) -> RunRecord
        create = write(RunRepository.create)

:func:`write` and :func:`read` are typed with the repository method's own
signature (a ``ParamSpec``), so ``store.runs.get`` has the signature
``(run_id: str) -> RunRecord`` for mypy and IDEs, and the repository
method's docstring for ``help()``. The one-call method is built on first
access and kept on the facade instance, so a call costs what a hand-written
forwarder costs.

Operations that do more than forward (a refusal before the unit opens, an
error mapping, auto-GC after a commit) stay ordinary methods of the facade.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, overload

if TYPE_CHECKING:
    from agentkeep.store import Store

__all__ = ["OneCalls", "read", "write"]

P = ParamSpec("P")
T = TypeVar("T")


class OneCalls:
    """Base of a facade whose methods each run one repository call in its own unit.

    Subclasses set :attr:`_repository` to the name of the repository on a
    unit (``"runs"``, ``"leases"``, ...) and declare their forwarders with
    :func:`read` and :func:`write`.
    """

    #: The attribute of :class:`~agentkeep.unit_of_work.Repositories` to call into.
    _repository: str = ""

    def __init__(self, store: Store) -> None:
        self._store = store


class _Forwarder(Generic[P, T]):
    """A descriptor that becomes the one-call form of ``method`` on a facade instance."""

    __slots__ = ("_kind", "_method", "_name", "_signature")

    def __init__(self, method: Callable[Concatenate[Any, P], T], kind: str) -> None:
        self._method = method
        self._kind = kind
        self._name = method.__name__
        self._signature: inspect.Signature | None = None

    def __set_name__(self, owner: type[OneCalls], name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, owner: type[OneCalls]) -> _Forwarder[P, T]: ...

    @overload
    def __get__(self, obj: OneCalls, owner: type[OneCalls]) -> Callable[P, T]: ...

    def __get__(
        self, obj: OneCalls | None, owner: type[OneCalls]
    ) -> _Forwarder[P, T] | Callable[P, T]:
        if obj is None:
            return self
        bound = self._bind(obj)
        # A non-data descriptor: the instance attribute shadows it from now on.
        obj.__dict__[self._name] = bound
        return bound

    def __call__(self, obj: OneCalls, /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Call the one-call form on ``obj`` (``RunCalls.get(store.runs, run_id)``)."""
        method: Callable[P, T] = getattr(obj, self._name)
        return method(*args, **kwargs)

    def _bind(self, obj: OneCalls) -> Callable[P, T]:
        method = self._method
        repository = type(obj)._repository
        store = obj._store
        if self._kind == "write":
            run = store.call_write

            def call(*args: P.args, **kwargs: P.kwargs) -> T:
                return run(lambda r: method(getattr(r, repository), *args, **kwargs))

        else:
            single = self._kind == "read1"
            run_read = store.call_read

            def call(*args: P.args, **kwargs: P.kwargs) -> T:
                return run_read(
                    lambda r: method(getattr(r, repository), *args, **kwargs),
                    single_statement=single,
                )

        functools.update_wrapper(call, method)
        if self._signature is None:  # the method's signature without ``self``
            sig = inspect.signature(method)
            self._signature = sig.replace(parameters=list(sig.parameters.values())[1:])
        call.__signature__ = self._signature  # type: ignore[attr-defined]
        return call


def write(method: Callable[Concatenate[Any, P], T]) -> _Forwarder[P, T]:
    """The one-call form of a repository write: its own write unit, retried when busy."""
    return _Forwarder(method, "write")


def read(
    method: Callable[Concatenate[Any, P], T], *, single_statement: bool = False
) -> _Forwarder[P, T]:
    """The one-call form of a repository read: its own read unit (one snapshot).

    Args:
        method: the repository method.
        single_statement: the method runs exactly one SELECT, so the unit
            skips the explicit snapshot transaction (see
            :meth:`agentkeep.Store.call_read`).
    """
    return _Forwarder(method, "read1" if single_statement else "read")

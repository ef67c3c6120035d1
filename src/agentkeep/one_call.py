"""One-call forms of repository methods, declared once and typed from the repository.

``store.runs.get(run_id)`` runs :meth:`RunRepository.get` in a unit of work of
its own (:meth:`agentkeep.Store.call_read` / ``Store._call_operation``, the form of
:meth:`~agentkeep.Store.call_write` for one operation whose error ends the unit:
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

``_repository`` may be a dotted path (``"runtime.inputs"``: the input-state
part of the runtime repository); each forwarder uses the path of the class
that declares it, so a facade composed of several such classes by
inheritance (``store.runtime``) reaches each part. A facade that reports
errors its own way overrides :meth:`OneCalls._call_write` /
:meth:`OneCalls._call_read` (the runtime store maps driver failures to
``WriteFailed`` / ``ReadFailed`` there).

Operations that do more than forward (a refusal before the unit opens, an
encode done once outside the unit, auto-GC after a commit) stay ordinary
methods of the facade. See docs/architecture.md#one-call-operations.
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, Final, Generic, ParamSpec, TypeVar, overload

from agentkeep import observability
from agentkeep.arguments import argument_check, check_methods, no_check
from agentkeep.errors import CommitOutcomeUnknown, ConcurrentModification, DatabaseError

if TYPE_CHECKING:
    from agentkeep.store import Store

__all__ = [
    "OneCalls",
    "Rerun",
    "Resolver",
    "leaves_unknown",
    "named_outcome",
    "read",
    "rerun",
    "still_unknown",
    "write",
]

P = ParamSpec("P")
T = TypeVar("T")

#: How a write's one-call form settles a :class:`~agentkeep.errors.CommitOutcomeUnknown`:
#: called as ``resolver(facade, again, *args, **kwargs)`` where ``again()`` runs the
#: operation once more in a new unit; returns the operation's result or raises.
Resolver = Callable[..., Any]


class Rerun:
    """A resolver that runs the operation again: for operations whose second run returns
    the stored outcome, or does what the first did not (a lease claim by the same owner,
    a release, an idempotent put).

    ``inconclusive``: answers of that second run that do not settle the first,
    because they may have become true after the first committed (a write
    guarded by a session lease: the lease may have changed hands, or
    expired, in between). The one-call form raises
    :class:`~agentkeep.errors.CommitOutcomeUnknown` over them.
    """

    __slots__ = ("inconclusive",)

    def __init__(self, inconclusive: tuple[type[Exception], ...] = ()) -> None:
        self.inconclusive = inconclusive

    def __call__(self, facade: Any, again: Callable[[], T], *args: Any, **kwargs: Any) -> T:
        return again()


#: Run the operation again; every answer of that run settles the first.
rerun: Final = Rerun()


def named_outcome(
    exc: CommitOutcomeUnknown,
    operation: str,
    signature: inspect.Signature,
    args: Any,
    kwargs: Any,
    first: CommitOutcomeUnknown | None = None,
) -> CommitOutcomeUnknown:
    """``exc`` naming ``operation`` and its arguments (bound to ``signature``).

    ``first``: the unknown outcome a resolver was settling; its detail (the
    driver's message) is kept when the resolver's own error has none.
    """
    try:
        arguments = dict(signature.bind(*args, **kwargs).arguments)
    except TypeError:
        arguments = {"args": args, "kwargs": kwargs}
    detail = exc.detail or (first.detail if first is not None else "")
    named = CommitOutcomeUnknown(operation, arguments, detail)
    named.__cause__ = exc
    return named


def leaves_unknown(error: BaseException, inconclusive: tuple[type[Exception], ...] = ()) -> bool:
    """True when ``error``, raised by the attempt that was to settle a lost COMMIT answer,
    leaves the first attempt's outcome unknown.

    A database failure of that attempt (busy, its connection lost before it
    committed, the database unavailable; in the runtime store the
    ``WriteFailed`` / ``ReadFailed`` raised over one) says nothing of what
    the first attempt left: it may still have committed, so this is True.
    It is also True for an error of one of the ``inconclusive`` kinds
    (:class:`Rerun`). Anything else is False: the operation's own answer
    (a typed refusal) settles it, and :class:`ConcurrentModification`, a
    bug signal, is raised as it is. A second :class:`CommitOutcomeUnknown`
    is not judged here (the callers name it themselves).
    """
    if isinstance(error, inconclusive):
        return True
    cause = error if isinstance(error, DatabaseError) else error.__cause__
    return isinstance(cause, DatabaseError) and not isinstance(
        cause, (CommitOutcomeUnknown, ConcurrentModification)
    )


def still_unknown(
    first: CommitOutcomeUnknown,
    error: BaseException,
    operation: str | None = None,
    arguments: dict[str, object] | None = None,
) -> CommitOutcomeUnknown:
    """The unknown outcome ``first``, still unknown because settling it failed with ``error``.

    Names ``operation`` and ``arguments`` (default: ``first``'s); its detail
    is ``first``'s followed by ``error``. Raise it ``from error``.
    """
    reason = f"running it again to settle it failed: {type(error).__name__}: {error}"
    return CommitOutcomeUnknown(
        first.operation if operation is None else operation,
        first.arguments if arguments is None else arguments,
        f"{first.detail}; {reason}" if first.detail else reason,
    )


class OneCalls:
    """Base of a facade whose methods each run one repository call in its own unit.

    Subclasses set :attr:`_repository` to the name of the repository on a
    unit (``"runs"``, ``"leases"``, ...) and declare their forwarders with
    :func:`read` and :func:`write`.
    """

    #: The attribute (or dotted path) of :class:`~agentkeep.unit_of_work.Repositories`
    #: to call into.
    _repository: str = ""
    #: Default of :func:`read`'s ``single_statement`` for this facade's reads.
    _single_statement_reads: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Check the arguments of, then trace, the public methods a facade class defines.

        Every public method gets the argument check
        (:func:`agentkeep.arguments.check_methods`). Each also becomes one
        public operation named ``<repository>.<method>``
        (:func:`agentkeep.observability.traced`; unchanged without
        OpenTelemetry). The forwarders get both when they are bound.
        """
        super().__init_subclass__(**kwargs)
        check_methods(cls)
        if not observability.INSTALLED:
            return
        root = (cls.__dict__.get("_repository") or cls._repository).split(".")[0] or cls.__name__
        for name, value in list(cls.__dict__.items()):
            if name.startswith("_") or not inspect.isfunction(value):
                continue
            setattr(cls, name, observability.traced(f"{root}.{name}", value))

    def __init__(self, store: Store) -> None:
        self._store = store

    def _call_write(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(repositories)`` in a one-call write unit (``Store._call_operation``)."""
        return self._store._call_operation(fn)

    def _call_read(self, fn: Callable[[Any], T], *, single_statement: bool) -> T:
        """Run ``fn(repositories)`` in a one-call read unit (:meth:`Store.call_read`)."""
        return self._store.call_read(fn, single_statement=single_statement)


class _Forwarder(Generic[P, T]):
    """A descriptor that becomes the one-call form of ``method`` on a facade instance."""

    __slots__ = (
        "_kind",
        "_method",
        "_name",
        "_operation",
        "_path",
        "_resolve",
        "_signature",
        "_single",
    )

    def __init__(
        self,
        method: Callable[Concatenate[Any, P], T],
        kind: str,
        single: bool | None = None,
        resolve: Resolver | None = None,
    ) -> None:
        self._method = method
        self._kind = kind
        self._single = single
        self._resolve = resolve
        self._name = method.__name__
        self._operation = method.__name__
        self._path: Callable[[Any], Any] | None = None
        self._signature: inspect.Signature | None = None

    def __set_name__(self, owner: type[OneCalls], name: str) -> None:
        self._name = name
        path = owner.__dict__.get("_repository") or owner._repository
        if not path:
            raise TypeError(f"{owner.__name__}.{name}: the facade class sets no _repository")
        self._path = operator.attrgetter(path)
        self._operation = f"{path.split('.')[0]}.{name}"
        if self._single is None:
            self._single = bool(owner._single_statement_reads)

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
        part = self._path
        assert part is not None  # set by __set_name__
        if self._signature is None:  # the method's signature without ``self``
            sig = inspect.signature(method)
            self._signature = sig.replace(parameters=list(sig.parameters.values())[1:])
        signature = self._signature
        check = argument_check(method, skip_first=True)
        checking = check is not no_check
        store = obj._store
        if self._kind == "write":
            # A facade that does not report errors its own way calls the store itself.
            run = obj._call_write
            direct = type(obj)._call_write is OneCalls._call_write
            resolve = self._resolve
            operation = self._operation

            def call(*args: P.args, **kwargs: P.kwargs) -> T:
                if checking:
                    check(*args, **kwargs)

                def once() -> T:
                    if direct:
                        return store._call_operation(lambda r: method(part(r), *args, **kwargs))
                    return run(lambda r: method(part(r), *args, **kwargs))

                try:
                    return once()
                except CommitOutcomeUnknown as exc:
                    if resolve is None:
                        raise named_outcome(exc, operation, signature, args, kwargs) from exc
                    unknown = exc
                try:
                    result: T = resolve(obj, once, *args, **kwargs)
                    observability.commit_outcome_resolved(operation, "replayed")
                    return result
                except CommitOutcomeUnknown as again:
                    raise named_outcome(
                        again, operation, signature, args, kwargs, unknown
                    ) from unknown
                except Exception as failed:
                    if not leaves_unknown(failed, getattr(resolve, "inconclusive", ())):
                        raise
                    named = named_outcome(unknown, operation, signature, args, kwargs)
                    raise still_unknown(named, failed) from failed

        else:
            single = bool(self._single)
            run_read = obj._call_read
            direct_read = type(obj)._call_read is OneCalls._call_read

            def call(*args: P.args, **kwargs: P.kwargs) -> T:
                if checking:
                    check(*args, **kwargs)
                if direct_read:
                    return store.call_read(
                        lambda r: method(part(r), *args, **kwargs), single_statement=single
                    )
                return run_read(lambda r: method(part(r), *args, **kwargs), single_statement=single)

        functools.update_wrapper(call, method)
        call.__signature__ = signature  # type: ignore[attr-defined]
        return observability.traced(self._operation, call)


def write(
    method: Callable[Concatenate[Any, P], T], *, resolve: Resolver | None = None
) -> _Forwarder[P, T]:
    """The one-call form of a repository write: its own write unit, retried when busy.

    When the COMMIT's answer is lost (:class:`~agentkeep.errors.CommitOutcomeUnknown`),
    an idempotent operation declared with ``resolve`` settles it itself (once: a
    second unknown outcome is raised); any other raises it, naming the
    operation (``"runs.acquire_assignee"``) and its arguments.
    """
    return _Forwarder(method, "write", resolve=resolve)


def read(
    method: Callable[Concatenate[Any, P], T], *, single_statement: bool | None = None
) -> _Forwarder[P, T]:
    """The one-call form of a repository read: its own read unit (one snapshot).

    Args:
        method: the repository method.
        single_statement: the method runs exactly one SELECT, so the unit
            skips the explicit snapshot transaction (see
            :meth:`agentkeep.Store.call_read`). Default: the facade class's
            ``_single_statement_reads``.
    """
    return _Forwarder(method, "read", single_statement)

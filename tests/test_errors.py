"""Every public error class lives in ``agentkeep.errors`` under a unique name.

* every class deriving from :class:`~agentkeep.errors.AgentkeepError`, wherever
  the package defines or re-exports it, is the object ``agentkeep.errors``
  holds under its ``__name__``, and ``agentkeep`` exports it too;
* no two error classes share a name (``agentkeep.runs.NotFound`` and
  ``agentkeep.runtime.NotFound`` were once two classes named like the generic
  ``agentkeep.NotFound``).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import agentkeep
import agentkeep.errors as errors
from agentkeep.errors import AgentkeepError


def _error_classes() -> dict[int, type[AgentkeepError]]:
    found: dict[int, type[AgentkeepError]] = {}
    for info in pkgutil.walk_packages(agentkeep.__path__, "agentkeep."):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if inspect.isclass(value) and issubclass(value, AgentkeepError):
                found[id(value)] = value
    return found


def test_every_error_class_is_in_agentkeep_errors_under_its_own_name() -> None:
    classes = _error_classes().values()
    assert len(classes) > 40
    misplaced = [
        f"{c.__module__}.{c.__qualname__}"
        for c in classes
        if getattr(errors, c.__name__, None) is not c
    ]
    assert not misplaced, misplaced
    names = [c.__name__ for c in classes]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_every_error_class_is_exported_from_agentkeep() -> None:
    for cls in _error_classes().values():
        assert getattr(agentkeep, cls.__name__) is cls, cls.__name__
        assert cls.__name__ in agentkeep.__all__
        assert cls.__name__ in errors.__all__


def test_the_errors_users_catch_most_are_at_the_top_level() -> None:
    from agentkeep import (  # noqa: F401 - the import is the test
        ConcurrentModification,
        HeadRevisionConflict,
        QueuedWorkClaimSuperseded,
        SessionExecutionLeaseExpired,
        StoreBusy,
        TurnInputClaimSuperseded,
        WriteFailed,
    )

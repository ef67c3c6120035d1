"""Shared value encodings, kept importable under their first names.

The JSON rules now live in :mod:`agentkeep.strict_json` (the strict decoder,
the canonical encoder and the value check); this module re-binds the names
other modules imported from here, so they keep working:
:data:`JSON_MAX_DEPTH`, :func:`canonical_json` (sorted keys, compact, UTF-8
as is, no NaN; raises a ``ValueError`` for a value that is not JSON) and
:func:`json_value_problem`.
"""

from __future__ import annotations

from agentkeep.strict_json import JSON_MAX_DEPTH, canonical_json, json_value_problem

__all__ = ["JSON_MAX_DEPTH", "canonical_json", "json_value_problem"]

"""The version of `trainer-memcb estimate --json`'s documents.

Every document the command prints (the what-if, the model-states plan, the step plan, the
evaluation plan) carries it under `schema`.
"""

from __future__ import annotations

from typing import Any, Dict

__all__ = ["ESTIMATE_SCHEMA", "with_schema"]

# Raised whenever the documents change shape (a key added, removed or renamed, a type changed).
ESTIMATE_SCHEMA = "trainer-memcb/estimate/1"


def with_schema(document: Dict[str, Any]) -> Dict[str, Any]:
    """The document with its `schema` key (a new dict: the plan's own is not changed)."""
    return {"schema": ESTIMATE_SCHEMA, **document}

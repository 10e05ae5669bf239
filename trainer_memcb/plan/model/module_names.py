"""A tensor-parallel plan's module names matched against a model's, as torch's `parallelize_module`
reads them (`*` for any one part of the dotted name)."""

from __future__ import annotations

import fnmatch

__all__ = ["matches_module"]


def matches_module(pattern: str, name: str) -> bool:
    """Whether a plan's module name (`*` for any one part, as `parallelize_module` reads it)
    names the module `name`."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(fnmatch.fnmatch(part, want) for part, want in zip(parts, wanted))

"""A model's `forward` replaced on the instance, and put back.

The probes wrap `model.forward` by setting an instance attribute, so that the class (and every other
instance) is untouched. Putting it back means restoring the attribute that was there, or deleting
ours so that the class's forward applies again; and only if the attribute is still ours: a wrapper
someone set on top of it stays, with ours inside it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NO_INSTANCE_FORWARD", "instance_forward", "put_back_forward"]

# What `instance_forward` returns when the instance has no `forward` of its own.
NO_INSTANCE_FORWARD = object()


def instance_forward(model: Any) -> Any:
    """The `forward` set on `model` itself, or `NO_INSTANCE_FORWARD` (the class's applies)."""
    return model.__dict__.get("forward", NO_INSTANCE_FORWARD)


def put_back_forward(model: Any, wrapper: Any, replaced: Any) -> bool:
    """Undo `model.forward = wrapper`, which replaced `replaced` (`NO_INSTANCE_FORWARD`: nothing), if
    `model.forward` is still `wrapper`. Returns whether it was."""
    if model.__dict__.get("forward", NO_INSTANCE_FORWARD) is not wrapper:
        return False
    if replaced is NO_INSTANCE_FORWARD:
        del model.__dict__["forward"]
    else:
        model.__dict__["forward"] = replaced
    return True

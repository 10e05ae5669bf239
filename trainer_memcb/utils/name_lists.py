"""One rule for every constructor argument that names some of a fixed set of things.

`breakdown=`, `what_if=`, `eval_keys=` and `train_keys=` all take names from a list the package
knows. They read the same way, so that what works for one works for all:

- a list or tuple of names, `("key", "dtype")`;
- one comma-separated string, `"key,dtype"` (spaces around a name are dropped);
- None, `()` or `""`: none;
- a name given twice counts once (the first place it appears keeps its order);
- anything else (a number, a dict, a set, a name not in the list) is a `ValueError` that names the
  bad value and the allowed names.
"""

from __future__ import annotations

from typing import Any, Iterable, Tuple

__all__ = ["name_list"]


def name_list(value: Any, argument: str, allowed: Iterable[str]) -> Tuple[str, ...]:
    """The names `value` gives, checked against `allowed`, in order, each once.

    Args:
        value: what the user passed (see the module's docstring for the forms taken).
        argument: the argument's name, for the error message.
        allowed: the names that may be given.

    Raises:
        ValueError: naming the bad value and the allowed names.

    Examples:
        >>> name_list("key, dtype,key", "breakdown", ["device", "dtype", "key"])
        ('key', 'dtype')
        >>> name_list(None, "breakdown", ["device", "dtype", "key"])
        ()
    """
    allowed = sorted(set(allowed))
    if value is None:
        return ()
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, (list, tuple)):  # a number, a dict (whose keys would pass), a set (no order)
        raise ValueError(f"{argument}={value!r}: expected some of {allowed} (a list or tuple, or one "
                         "comma-separated string), or None for none")
    items = list(value)
    chosen = []
    for item in items:
        name = item.strip() if isinstance(item, str) else item
        if name == "":
            continue
        if not isinstance(name, str) or name not in allowed:
            raise ValueError(f"{argument}={name!r} is not one of {allowed}")
        chosen.append(name)
    return tuple(dict.fromkeys(chosen))

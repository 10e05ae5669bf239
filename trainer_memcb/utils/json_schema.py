"""JSON Schema (draft 2020-12) of a dataclass's JSON form, read from its fields and type hints.

One function per question: what a type hint allows in JSON (`type_schema`), and what object a
dataclass becomes (`object_schema`): one property per field, each required, and no other key
(`additionalProperties: false`), so that a key added to the class or renamed fails validation of
a schema made before.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Dict, Iterable, Mapping, Optional

__all__ = ["JSON_SCHEMA_DIALECT", "object_schema", "type_schema"]

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

_SCALARS = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}


def type_schema(hint: Any, defs: Dict[str, Any]) -> Dict[str, Any]:
    """The schema of what a value of type `hint` is in JSON (as `dataclasses.asdict` and
    `json.dump` write it); a dataclass is described once in `defs` and referred to by name.

    Examples:
        >>> type_schema(Optional[int], {})
        {'type': ['integer', 'null']}
        >>> type_schema(Dict[str, int], {})
        {'type': 'object', 'additionalProperties': {'type': 'integer'}}
        >>> type_schema(typing.Tuple[int, ...], {})
        {'type': 'array', 'items': {'type': 'integer'}}

    Raises:
        TypeError: a hint with no JSON form here (a set, a callable, a class that is not a dataclass).
    """
    if hint is Any:
        return {}
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    if dataclasses.is_dataclass(hint):
        if hint.__name__ not in defs:
            defs[hint.__name__] = {}  # taken before its fields are read: a class that holds itself ends
            defs[hint.__name__] = object_schema(hint, defs)
        return {"$ref": f"#/$defs/{hint.__name__}"}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is getattr(types, "UnionType", None):  # Optional[int], int | None
        options = [type_schema(arg, defs) for arg in args]
        if all(set(option) == {"type"} and isinstance(option["type"], str) for option in options):
            return {"type": [option["type"] for option in options]}  # Optional[int]: ["integer", "null"]
        return {"anyOf": options}
    if origin in (list, tuple) and (origin is list or (len(args) == 2 and args[1] is Ellipsis)):
        return {"type": "array", "items": type_schema(args[0], defs)} if args else {"type": "array"}
    if origin is tuple:  # a fixed length, one type per place
        return {"type": "array", "prefixItems": [type_schema(arg, defs) for arg in args], "items": False,
                "minItems": len(args)}
    if origin is dict:
        if args and args[0] is not str:
            raise TypeError(f"{hint}: a JSON object's keys are strings")
        values = type_schema(args[1], defs) if args else {}
        return {"type": "object", "additionalProperties": values} if values else {"type": "object"}
    if hint in (list, tuple):
        return {"type": "array"}
    if hint is dict:
        return {"type": "object"}
    raise TypeError(f"{hint!r} has no JSON form here")


def object_schema(cls: Any, defs: Dict[str, Any], *, leave_out: Iterable[str] = (),
                  properties: Iterable[str] = (), extra: Optional[Mapping[str, Any]] = None,
                  optional: Iterable[str] = (), description: Optional[str] = None) -> Dict[str, Any]:
    """The schema of a dataclass's JSON form: one property per field, typed by its hint.

    Args:
        cls: the dataclass.
        defs: where the dataclasses its fields hold are described (`$defs`).
        leave_out: fields its JSON form does not hold.
        properties: properties of the class (`@property`) its JSON form holds too, typed by their
            return hints.
        extra: keys its JSON form adds -> their type hints.
        optional: keys written only sometimes (left out of `required`); every other key is required.
        description: the schema's description; by default the first line of the class's docstring.

    Raises:
        ValueError: a name in `leave_out`, `properties` or `optional` that the class does not have.
    """
    fields = {field.name: field for field in dataclasses.fields(cls)}
    left_out = set(leave_out)
    unknown = left_out - set(fields)
    hints = typing.get_type_hints(cls)
    keys: Dict[str, Any] = {name: hints[name] for name in fields if name not in left_out}
    for name in properties:
        member = getattr(cls, name, None)
        if not isinstance(member, property):
            unknown.add(name)
            continue
        keys[name] = typing.get_type_hints(member.fget)["return"]
    keys.update(extra or {})
    not_required = set(optional)
    unknown |= not_required - set(keys)
    if unknown:
        raise ValueError(f"{cls.__name__} has no {', '.join(sorted(unknown))}")
    if description is None:
        description = (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ").strip()
    schema: Dict[str, Any] = {"title": cls.__name__}
    if description:
        schema["description"] = description
    schema.update({"type": "object", "properties": {name: type_schema(hint, defs) for name, hint in keys.items()},
                   "required": [name for name in keys if name not in not_required],
                   "additionalProperties": False})
    return schema

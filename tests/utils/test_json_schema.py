"""`trainer_memcb.utils.json_schema`: a dataclass's JSON form described from its fields and hints."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import jsonschema
import pytest

from trainer_memcb.utils.json_schema import JSON_SCHEMA_DIALECT, object_schema, type_schema


@dataclass(frozen=True)
class Part:
    """A part.

    More words, not in the description."""

    name: str
    size_bytes: Optional[int]


@dataclass(frozen=True)
class Whole:
    """A whole of parts."""

    parts: List[Part]
    shape: Tuple[int, ...]
    pair: Tuple[int, str]
    by_key: Dict[str, int] = field(default_factory=dict)
    anything: Any = None
    ratio: Optional[float] = None
    cache: Optional[object] = None  # not written

    @property
    def total_bytes(self) -> int:
        return sum(part.size_bytes or 0 for part in self.parts)

    def to_dict(self) -> Dict[str, Any]:
        document = {**dataclasses.asdict(self), "total_bytes": self.total_bytes, "kind": "whole"}
        del document["cache"]
        return document


def whole_schema() -> Dict[str, Any]:
    defs: Dict[str, Any] = {}
    schema = object_schema(Whole, defs, leave_out=["cache"], properties=["total_bytes"], extra={"kind": str})
    return {"$schema": JSON_SCHEMA_DIALECT, **schema, "$defs": defs}


def test_each_field_is_a_required_property_typed_by_its_hint():
    schema = whole_schema()
    assert schema["title"] == "Whole" and schema["description"] == "A whole of parts."
    assert schema["properties"] == {
        "parts": {"type": "array", "items": {"$ref": "#/$defs/Part"}},
        "shape": {"type": "array", "items": {"type": "integer"}},
        "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False,
                 "minItems": 2},
        "by_key": {"type": "object", "additionalProperties": {"type": "integer"}},
        "anything": {},
        "ratio": {"type": ["number", "null"]},
        "total_bytes": {"type": "integer"},
        "kind": {"type": "string"},
    }
    assert schema["required"] == list(schema["properties"]) and schema["additionalProperties"] is False
    assert schema["$defs"]["Part"] == {
        "title": "Part", "description": "A part.", "type": "object",
        "properties": {"name": {"type": "string"}, "size_bytes": {"type": ["integer", "null"]}},
        "required": ["name", "size_bytes"], "additionalProperties": False}


def test_the_json_form_validates_and_a_new_or_missing_key_does_not():
    validator = jsonschema.Draft202012Validator(whole_schema())
    whole = Whole([Part("a", 4), Part("b", None)], (2, 3), (1, "x"), {"k": 1}, [1, "y"])
    document = json.loads(json.dumps(whole.to_dict()))  # as printed: tuples become lists
    validator.validate(document)
    assert not validator.is_valid({**document, "new_bytes": 1})
    assert not validator.is_valid({**document, "parts": [{"name": "a", "size_bytes": 4, "new": 1}]})
    assert not validator.is_valid({key: value for key, value in document.items() if key != "ratio"})
    assert not validator.is_valid({**document, "pair": [1, "x", 2]})


def test_a_name_the_class_does_not_have_or_a_type_without_json_is_refused():
    with pytest.raises(ValueError, match="Whole has no nothing"):
        object_schema(Whole, {}, leave_out=["nothing"])
    with pytest.raises(ValueError, match="Whole has no to_dict"):
        object_schema(Whole, {}, properties=["to_dict"])
    with pytest.raises(ValueError, match="Whole has no absent"):
        object_schema(Whole, {}, optional=["absent"])
    with pytest.raises(TypeError, match="has no JSON form"):
        type_schema(Set[int], {})
    with pytest.raises(TypeError, match="keys are strings"):
        type_schema(Dict[int, int], {})


def test_a_key_written_only_sometimes_is_named_but_not_required():
    schema = object_schema(Part, {}, extra={"note": Optional[str]}, optional=["note"])
    assert schema["required"] == ["name", "size_bytes"] and "note" in schema["properties"]

"""How YAML files and the command line spell a field's value, read as the field's type before
pydantic judges it; and whether a value fits a type.

    spell("1e-3", float)                       # 0.001   (PyYAML reads 1e-3, no dot, as text)
    spell("0.5,0.6", tuple[float, float])      # [0.5, 0.6]
    spell("None", int | None)                  # None
    fits(0, Annotated[int, Field(ge=1)])       # True: an int, only out of range

The schema is validated by pydantic in strict JSON mode (opd/config/loader.py), the rules of a
YAML file: an int field takes only an int, a bool only true/false, a tuple a list.  Pydantic's lax
mode would also take what a YAML file should not ("3" for an int, 1 for a bool, 2.0 for an int),
so the few spellings a user may write for a type are read here, by the field's type, and
everything else is left to pydantic: `1e-3` as text for a float, `None` / `~` for null, `0.5,0.6`
for a tuple, an int for a str.  The `min..max` spelling of a span is the type's own validator
(`span`, loader.py), as is every range.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import ConfigDict, TypeAdapter, ValidationError

STRICT = ConfigDict(strict=True, extra="forbid")
"""Pydantic's config of a schema: strict types, unknown keys refused."""

RANGE_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")
"""Pydantic's error types of a value of the right type outside its range."""

NOT_JSON = "\x00not a value of the field's type"
"""Stands for a value no field type takes (NaN, a date): a mapping, or a string for a mapping."""
_NONE_WORDS = ("None", "none", "null", "~")


@functools.cache
def adapter(tp: Any) -> TypeAdapter:
    """Pydantic's validator of type `tp` (a schema root carries its own config, `strict_schema`)."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if getattr(tp, "__pydantic_config__", None) is not STRICT:
            raise TypeError(f"{tp.__name__} is not a schema root: decorate it @strict_schema")
        return TypeAdapter(tp)
    return TypeAdapter(tp, config=STRICT)


def to_json(value: Any) -> str:
    """JSON text of a spelled tree (values JSON cannot hold are only left where any value goes)."""
    return json.dumps(value, default=repr)


def fits(value: Any, tp: Any) -> bool:
    """Whether `value` (spelled) is of type `tp`, in its range or not."""
    try:
        adapter(tp).validate_json(to_json(value))
        return True
    except ValidationError as e:
        return any(err["type"] in RANGE_ERRORS for err in e.errors())


def parse_scalar(raw: str) -> Any:
    """An override's value as YAML reads it (`null`, `true`, `1e-3`, `[0.9, 0.99]`), else the text."""
    try:
        return yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        return raw


def spell(value: Any, tp: Any) -> Any:
    """`value` with the YAML / command-line spellings of type `tp` read as that type; values
    that are not such a spelling come back as they are (pydantic judges them)."""
    if get_origin(tp) is Annotated:
        return spell(value, get_args(tp)[0])
    origin, args = get_origin(tp), get_args(tp)
    if tp is not Any and ((isinstance(value, float) and math.isnan(value))
                          or not isinstance(value, (type(None), bool, int, float, str, list,
                                                    tuple, dict))):
        return NOT_JSON if origin is dict or tp is dict else {NOT_JSON: repr(value)}
    if origin in (Union, types.UnionType):
        if type(None) in args and isinstance(value, str) and value in _NONE_WORDS:
            return None
        for a in args:
            if a is not type(None) and fits(value, a):
                return value
        for a in args:
            out = spell(value, a)
            if out is not value and fits(out, a):
                return out
        return value
    if tp is float and isinstance(value, str):     # PyYAML reads 1e-3 (no dot) as text
        try:
            out = float(value)
        except ValueError:
            return value
        return value if math.isnan(out) else out
    if tp is str and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if origin in (tuple, list):
        if origin is tuple and isinstance(value, str) and "," in value:
            value = [parse_scalar(v.strip()) for v in value.split(",")]
        if isinstance(value, (list, tuple)):
            return [spell(v, a) for v, a in zip(value, items(tp, len(value)))]
    return value


def items(tp: Any, n: int) -> list[Any]:
    """The item types of `n` values of a tuple or list type (Any past a fixed tuple's end)."""
    args = get_args(tp)
    if get_origin(tp) is list or args[-1:] == (Ellipsis,):
        return [args[0]] * n
    return list(args) + [Any] * (n - len(args))


def accepts_str(tp: Any) -> bool:
    """Whether a field of type `tp` takes text (so an override's raw text may be its value)."""
    if tp is str or tp is Any:
        return True
    origin = get_origin(tp)
    if origin is Annotated:
        return accepts_str(get_args(tp)[0])
    if origin is Literal:
        return any(isinstance(a, str) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return any(accepts_str(a) for a in get_args(tp))
    return False

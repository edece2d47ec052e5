"""Dataclass schemas filled from YAML trees, validated by pydantic, errors worded as one line.

    tree = {"rollout": {"window": "abc"}}
    build(RunConfig, tree)          # ConfigError: rollout.window='abc': expected int or 'auto'
    build(RunConfig, {"rollout": {"windw": 3}})
                                    # ConfigError: unknown config key 'rollout.windw'; did you mean 'rollout.window'?

A schema is a tree of stdlib dataclasses (fields with docstrings; a field may also hold a list of
them, e.g. `distill.phases`) whose root is decorated `@strict_schema`.  Pydantic does the
validating: `build` validates a nested dict against the root with `pydantic.TypeAdapter` in
strict JSON mode, the rules of a YAML file (an int field takes only an int, a float field an int
or a float, a bool only true/false, a tuple a list, a section a mapping; unknown keys refused,
`extra="forbid"`).  A range is the type's: `Annotated[int, Field(ge=1)]`, also inside a tuple or
a union; a "min..max" pair is a type with its validator (`min_max`); the rules between fields are
the root's `model_validator`s, which raise ConfigError.  Before pydantic, the few spellings YAML
and the command line allow are read as the field's type (opd/config/spelling.py).

Pydantic says which key failed and how (`loc`, error type); this module words it as one line
naming the dotted key and the value as written (`describe`, `_first_problem`), and names the
closest valid key of an unknown one (`unknown_key`).  Of several problems the one met first in
the file is reported.  Dotted `key=value` overrides: opd/config/overrides.py.

Why pydantic (and not OmegaConf), and why the schema stays stdlib dataclasses:
docs/ARCHITECTURE.md, "Key decisions", Config.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

from pydantic import BeforeValidator, ValidationError, with_config

from opd.config.spelling import (RANGE_ERRORS, STRICT, adapter, fits, items, spell,
                                 to_json)


class ConfigError(ValueError):
    """A configuration a user wrote is invalid; the message is one line naming key and value."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


strict_schema = with_config(STRICT)
"""Decorator of a schema's root dataclass: strict types, unknown keys refused (nested sections
take the root's config)."""


def choices(names: Any) -> Any:
    """`Literal[...]` of the names in `names` (a registry: a dict's keys or a tuple), so a
    field's allowed values are read from the registry that owns them."""
    return Literal[tuple(names)]


_MIN_MAX = re.compile(r"^\s*(\d+)\s*\.\.\s*(\d+)\s*$")


def read_min_max(value: Any) -> Any:
    """A (min, max) pair as written: "2..6" -> (2, 6), [2, 6] -> (2, 6); anything else as it is."""
    if isinstance(value, str) and (m := _MIN_MAX.match(value)):
        return int(m.group(1)), int(m.group(2))
    return tuple(value) if isinstance(value, list) else value


def min_max(item: Any) -> Any:
    """The type of a (min, max) pair of `item`, also written "min..max" (`rollout.num_workers`)."""
    return Annotated[tuple[item, item], BeforeValidator(read_min_max)]


def is_min_max(tp: Any) -> bool:
    return get_origin(tp) is Annotated and any(
        isinstance(m, BeforeValidator) and m.func is read_min_max for m in get_args(tp)[1:])


def bounds(tp: Any) -> dict[str, float]:
    """The range of a field's type as keywords ({"ge": 0.0, "lt": 1.0}): the first
    `Annotated[..., Field(...)]` constraints in it (also of a tuple's items or a union's member)."""
    if get_origin(tp) is Annotated:
        out = {k: getattr(c, k) for m in get_args(tp)[1:] for c in getattr(m, "metadata", [m])
               for k in ("ge", "gt", "le", "lt") if getattr(c, k, None) is not None}
        return out or bounds(get_args(tp)[0])
    for a in get_args(tp):
        if b := bounds(a):
            return b
    return {}


# ---- the schema ------------------------------------------------------------------------------

@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """A section's field types, with their `Annotated` ranges."""
    return get_type_hints(cls, include_extras=True)


@functools.cache
def fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def is_section(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp) and isinstance(tp, type)


def section_items(tp: Any) -> type | None:
    """The section type of a list of sections (`list[Phase]`, `tuple[Phase, ...]`), else None."""
    args = get_args(tp)
    if get_origin(tp) in (list, tuple) and args and is_section(args[0]) \
            and (get_origin(tp) is list or args[1:] == (Ellipsis,)):
        return args[0]
    return None


def dotted(path: tuple) -> str:
    """A key path as the messages name it: ("distill", "phases", 1, "lam") -> distill.phases[1].lam."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + str(part)
    return out


@functools.cache
def all_keys(root: type, prefix: str = "") -> tuple[str, ...]:
    """Every dotted key of the schema (sections and leaves)."""
    out: list[str] = []
    for name in fields(root):
        out.append(prefix + name)
        if is_section(hints(root)[name]):
            out.extend(all_keys(hints(root)[name], prefix + name + "."))
    return tuple(out)


def unknown_key(root: type, full_key: str, cls: type, prefix: str, part: str, rest: list[str],
                what: str = "config") -> ConfigError:
    """Unknown-key error naming the full key and the closest valid one (also in another
    section: rollout.lr -> learner.lr / pretrain.lr)."""
    names = list(fields(cls)) if is_section(cls) else list(cls)
    close = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
    suggestion = None
    keys = all_keys(root) if is_section(root) else ()
    if close:
        suggestion = prefix + close[0] + "".join("." + r for r in rest)
        if suggestion not in keys and not _is_under_dict(root, suggestion):
            suggestion = prefix + close[0]
    else:
        leaf = rest[-1] if rest else part
        pool = [k for k in keys if "." in k]
        match = difflib.get_close_matches(leaf, sorted({k.rsplit(".", 1)[1] for k in pool}),
                                          n=1, cutoff=0.8)
        if match:
            suggestion = "' or '".join(k for k in pool if k.rsplit(".", 1)[1] == match[0])
    where = f"'{prefix[:-1]}'" if prefix else f"the {what}"
    hint = (f"did you mean '{suggestion}'?" if suggestion
            else f"valid keys in {where}: {', '.join(names)}")
    return ConfigError(f"unknown {what} key '{full_key}'; {hint}", full_key)


def _is_under_dict(root: type, key: str) -> bool:
    cls: Any = root
    for part in key.split("."):
        hint = hints(cls).get(part) if is_section(cls) else None
        if hint is None:
            return False
        if get_origin(hint) is dict:
            return True
        cls = hint
    return False


# ---- building a dataclass tree ---------------------------------------------------------------

def _spell_section(cls: type, tree: dict, free: dict, path: tuple) -> dict:
    out = {}
    for name, value in tree.items():
        name = str(name)
        tp = hints(cls).get(name)
        if tp is None:
            out[name] = value
        elif is_section(tp):
            if value is None:
                value = {}
            out[name] = (_spell_section(tp, value, free, (*path, name)) if isinstance(value, dict)
                         else repr(value))
        elif get_origin(tp) is dict and isinstance(value, dict):
            free[(*path, name)] = dict(value)          # free-form: kept as written
            out[name] = {}
        elif section_items(tp) is not None and isinstance(value, list):
            item = section_items(tp)
            out[name] = [_spell_section(item, v, free, (*path, name, i)) if isinstance(v, dict)
                         else repr(v) for i, v in enumerate(value)]
        else:
            out[name] = spell(value, tp)
    return out


def build(cls: type, tree: Any, what: str = "config", context: dict | None = None) -> Any:
    """Instantiate schema root `cls` from a partial nested dict; every key and value checked.
    Raises ConfigError naming the first bad key in the tree's order.  `context` goes to the
    root's model validators (pydantic's validation context).  Free-form `dict` fields are kept
    as written and set after validation: a model validator sees them empty."""
    if not isinstance(tree, dict):
        raise ConfigError(f"'the {what}' must be a mapping of keys, got {tree!r}")
    free: dict[tuple, dict] = {}
    spelled = _spell_section(cls, tree, free, ())
    try:
        obj = adapter(cls).validate_json(to_json(spelled), context=context)
        problems: dict[tuple, list[dict]] = {}
    except ValidationError as e:
        obj, problems = None, {}
        for err in e.errors():
            if isinstance(rule := (err.get("ctx") or {}).get("error"), ConfigError):
                raise rule from None                # a model validator's: the fields are valid
            problems.setdefault(_error_key(cls, err["loc"]), []).append(err)
    _first_problem(cls, cls, tree, spelled, problems, (), what)
    if problems:                     # not met in the tree (should not happen): name it anyway
        loc, errs = next(iter(problems.items()))
        raise ConfigError(f"{dotted(loc)}: {errs[0]['msg']}", dotted(loc))
    for path, value in free.items():
        node = obj
        for name in path[:-1]:
            node = node[name] if isinstance(name, int) else getattr(node, name)
        setattr(node, path[-1], value)
    return obj


def _error_key(cls: type, loc: tuple) -> tuple:
    """The key path of a pydantic error location (union member tags and tuple indices
    dropped; the index into a list of sections kept as an int)."""
    out: list[str | int] = []
    parts = iter(loc)
    for part in parts:
        out.append(str(part))
        tp = hints(cls).get(str(part)) if is_section(cls) else None
        if section_items(tp) is not None:
            index = next(parts, None)
            if not isinstance(index, int):
                break
            out.append(index)
            tp = section_items(tp)
        if not is_section(tp):
            break
        cls = tp
    return tuple(out)


def _first_problem(root: type, cls: type, raw: dict, spelled: dict, problems: dict,
                   path: tuple, what: str) -> None:
    prefix = dotted(path) + "." if path else ""
    for name, value in raw.items():
        name = str(name)
        key, at = prefix + name, (*path, name)
        tp = hints(cls).get(name)
        errs = problems.pop(at, None)
        if tp is None:
            raise unknown_key(root, key, cls, prefix, name, [], what)
        if (item := section_items(tp)) is not None:
            if errs or not isinstance(value, list):
                raise ConfigError(f"{key}={value!r}: expected a list of mappings with keys "
                                  f"{', '.join(fields(item))}", key)
            for i, v in enumerate(value):
                if not isinstance(v, dict):
                    raise ConfigError(f"'{key}[{i}]' must be a mapping of keys, got {v!r}",
                                      f"{key}[{i}]")
                _first_problem(root, item, v, spelled[name][i], problems, (*at, i), what)
            continue
        if is_section(tp):
            if errs:
                raise ConfigError(f"'{key}' must be a mapping of keys, got {value!r}", key)
            if isinstance(value, dict):
                _first_problem(root, tp, value, spelled[name], problems, at, what)
            continue
        if not errs:
            continue
        if any(err["type"] in RANGE_ERRORS for err in errs):
            raise _out_of_range(key, tp, value, spelled[name])
        if get_origin(tp) is Literal:
            raise ConfigError(f"{key}={value!r}: must be one of "
                              + ", ".join(repr(a) for a in get_args(tp)), key)
        raise ConfigError(f"{key}={value!r}: expected {describe(tp)}", key)


def describe(tp: Any) -> str:
    """A type as the error messages name it: `int`, `a list of 2 floats`, `one of 'a', 'b'`."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return describe(args[0]) + (" or a 'min..max' string" if is_min_max(tp) else "")
    if tp is type(None):
        return "null"
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if origin is Literal:
        return repr(args[0]) if len(args) == 1 else "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple:
        names = [describe(a) for a in args if a is not Ellipsis]
        n = "" if Ellipsis in args else f"{len(args)} "
        return (f"a list of {n}{names[0]}s" if len(set(names)) == 1
                else f"a list of {n}" + " / ".join(names))
    if origin is list:
        return "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    return {bool: "bool (true/false)", int: "int", float: "float", str: "str"}.get(tp, repr(tp))


def _out_of_range(key: str, tp: Any, raw: Any, spelled: Any) -> ConfigError:
    """The error of a value outside its type's range, shown as the user wrote it (a list as
    read: an int item of a float field as a float)."""
    b = bounds(tp)
    shown = _show(_as_read(spelled, tp)) if isinstance(raw, (list, tuple)) else repr(raw)
    ops = [(">=", "ge"), (">", "gt"), ("<=", "le"), ("<", "lt")]
    rng = " and ".join(f"{op} {b[k]:g}" for op, k in ops if k in b)
    return ConfigError(f"{key}={shown}: must be {rng}", key)


def _as_read(value: Any, tp: Any) -> Any:
    origin = get_origin(tp)
    if origin is Annotated:
        return _as_read(value, get_args(tp)[0])
    if origin in (Union, types.UnionType):
        member = next((a for a in get_args(tp) if fits(value, a)), Any)
        return _as_read(value, member)
    if isinstance(value, (list, tuple)) and origin in (list, tuple):
        return [_as_read(v, a) for v, a in zip(value, items(tp, len(value)))]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value)

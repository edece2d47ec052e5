"""Dataclass schemas filled from YAML trees and dotted `key=value` overrides, validated by pydantic.

    tree = {"rollout": {"window": "abc"}}
    build(RunConfig, tree)          # ConfigError: rollout.window='abc': expected int
    set_override(RunConfig, tree, "rollout.windw", "3")
                                    # ConfigError: unknown config key 'rollout.windw'; did you mean 'rollout.window'?

A schema is a tree of stdlib dataclasses (fields with docstrings, `bounded(...)` ranges; a
field may also hold a list of them, e.g. `distill.phases`) whose root is decorated
`@strict_schema`.  `build` validates a nested dict against it with
`pydantic.TypeAdapter` in strict JSON mode, the rules of a YAML file: an int field takes only
an int, a float field an int or a float, a bool only true/false, a tuple a list, a section a
mapping, and unknown keys are refused (`extra="forbid"`).  Before that, the few spellings that
YAML and the command line allow are read as the field's type (`1e-3`, which PyYAML reads as
text, for a float; `None`/`~` for null; `2..6` and `0.5,0.6` for a tuple; an int for a str).
Pydantic says which key failed and how (`loc`, error type); this module words it as one line
naming the dotted key and the value as written, and checks the `bounded` ranges.  Of several
problems the one met first in the file is reported.

Why pydantic (and not OmegaConf), and why the schema stays stdlib dataclasses:
docs/ARCHITECTURE.md, "Key decisions", Config.

Over 400 lines: the schema walk, the spellings, the wording of every pydantic error and the
dotted overrides are one concept (a key and its value as the user wrote them) and share their
helpers; split, each half would import the other's internals.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import re
import types
from dataclasses import field
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml
from pydantic import ConfigDict, TypeAdapter, ValidationError, with_config


class ConfigError(ValueError):
    """A configuration a user wrote is invalid; the message is one line naming key and value."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


STRICT = ConfigDict(strict=True, extra="forbid")
strict_schema = with_config(STRICT)
"""Decorator of a schema's root dataclass: strict types, unknown keys refused (nested sections
take the root's config)."""


def bounded(default: Any, *, ge: float | None = None, gt: float | None = None,
            le: float | None = None, lt: float | None = None, span: bool = False,
            factory: bool = False) -> Any:
    """A dataclass field with a numeric range, checked on load (also for each tuple or list
    element).  span=True also accepts a string "min..max" for a `tuple[int, int]` member
    (parsed to (min, max)); factory=True: `default` is a default_factory."""
    meta: dict[str, Any] = {"bounds": {k: v for k, v in dict(ge=ge, gt=gt, le=le, lt=lt).items()
                                       if v is not None}}
    if span:
        meta["span"] = True
    if factory:
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


def choices(names: Any) -> Any:
    """`Literal[...]` of the names in `names` (a registry: a dict's keys or a tuple), so a
    field's allowed values are read from the registry that owns them."""
    return Literal[tuple(names)]


# ---- the schema ------------------------------------------------------------------------------

@functools.cache
def hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


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

@functools.cache
def _adapter(tp: Any) -> TypeAdapter:
    if is_section(tp):
        if getattr(tp, "__pydantic_config__", None) is not STRICT:
            raise TypeError(f"{tp.__name__} is not a schema root: decorate it @strict_schema")
        return TypeAdapter(tp)
    return TypeAdapter(tp, config=STRICT)


_NOT_JSON = "\x00not a value of the field's type"
"""Stands for a value no field type takes (NaN, a date): a mapping, or a string for a mapping."""
_NONE_WORDS = ("None", "none", "null", "~")
_SPAN = re.compile(r"^\s*(\d+)\s*\.\.\s*(\d+)\s*$")


def _json(value: Any) -> str:
    """JSON text of a spelled tree (values JSON cannot hold are only left where any value goes)."""
    return json.dumps(value, default=repr)


def spell(value: Any, tp: Any, meta: Any = None) -> Any:
    """`value` with the YAML / command-line spellings of type `tp` read as that type; values
    that are not such a spelling come back as they are (pydantic judges them)."""
    meta = meta or {}
    origin, args = get_origin(tp), get_args(tp)
    if tp is not Any and ((isinstance(value, float) and math.isnan(value))
                          or not isinstance(value, (type(None), bool, int, float, str, list,
                                                    tuple, dict))):
        return _NOT_JSON if origin is dict or tp is dict else {_NOT_JSON: repr(value)}
    if origin in (Union, types.UnionType):
        if type(None) in args and isinstance(value, str) and value in _NONE_WORDS:
            return None
        for a in args:
            if a is not type(None) and valid_value(value, a):
                return value
        for a in args:
            out = spell(value, a, meta)
            if out is not value and valid_value(out, a):
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
        if origin is tuple and isinstance(value, str):
            m = _SPAN.match(value)
            if meta.get("span") and m:
                value = [int(m.group(1)), int(m.group(2))]
            elif "," in value:
                value = [parse_scalar(v.strip()) for v in value.split(",")]
        if isinstance(value, (list, tuple)):
            items = [args[0]] * len(value) if (origin is list or args[-1:] == (Ellipsis,)) \
                else list(args) + [Any] * (len(value) - len(args))
            return [spell(v, a, meta) for v, a in zip(value, items)]
    return value


def valid_value(value: Any, tp: Any) -> bool:
    """Whether `value` (spelled) is a valid value of type `tp`."""
    try:
        _adapter(tp).validate_json(_json(value))
        return True
    except ValidationError:
        return False


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
            out[name] = spell(value, tp, fields(cls)[name].metadata)
    return out


def build(cls: type, tree: Any, what: str = "config") -> Any:
    """Instantiate schema root `cls` from a partial nested dict; every key and value checked.
    Raises ConfigError naming the first bad key in the tree's order."""
    if not isinstance(tree, dict):
        raise ConfigError(f"'the {what}' must be a mapping of keys, got {tree!r}")
    free: dict[tuple, dict] = {}
    spelled = _spell_section(cls, tree, free, ())
    try:
        obj = _adapter(cls).validate_json(_json(spelled))
        problems: dict[tuple, dict] = {}
    except ValidationError as e:
        obj, problems = None, {}
        for err in e.errors():
            problems.setdefault(_error_key(cls, err["loc"]), err)
    _first_problem(cls, cls, tree, spelled, problems, (), what)
    if problems:                     # not met in the tree (should not happen): name it anyway
        loc, err = next(iter(problems.items()))
        raise ConfigError(f"{dotted(loc)}: {err['msg']}", dotted(loc))
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
        err = problems.pop(at, None)
        if tp is None:
            raise unknown_key(root, key, cls, prefix, name, [], what)
        if (item := section_items(tp)) is not None:
            if err is not None or not isinstance(value, list):
                raise ConfigError(f"{key}={value!r}: expected a list of mappings with keys "
                                  f"{', '.join(fields(item))}", key)
            for i, v in enumerate(value):
                if not isinstance(v, dict):
                    raise ConfigError(f"'{key}[{i}]' must be a mapping of keys, got {v!r}",
                                      f"{key}[{i}]")
                _first_problem(root, item, v, spelled[name][i], problems, (*at, i), what)
            continue
        if is_section(tp):
            if err is not None:
                raise ConfigError(f"'{key}' must be a mapping of keys, got {value!r}", key)
            if isinstance(value, dict):
                _first_problem(root, tp, value, spelled[name], problems, at, what)
            continue
        meta = fields(cls)[name].metadata
        if err is not None:
            if get_origin(tp) is Literal:
                raise ConfigError(f"{key}={value!r}: must be one of "
                                  + ", ".join(repr(a) for a in get_args(tp)), key)
            raise ConfigError(f"{key}={value!r}: expected {describe(tp, meta)}", key)
        if meta.get("bounds"):
            check_range(key, _adapter(tp).validate_json(_json(spelled[name])), value, meta)


def describe(tp: Any, meta: Any = None) -> str:
    """A type as the error messages name it: `int`, `a list of 2 floats`, `one of 'a', 'b'`."""
    meta = meta or {}
    origin, args = get_origin(tp), get_args(tp)
    if tp is type(None):
        return "null"
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a, meta) for a in args)
    if origin is Literal:
        return repr(args[0]) if len(args) == 1 else "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple:
        items = [a for a in args if a is not Ellipsis]
        n = "" if Ellipsis in args else f"{len(args)} "
        inner = (f"a list of {n}{describe(items[0], meta)}s" if len(set(items)) == 1
                 else f"a list of {n}" + " / ".join(describe(a, meta) for a in items))
        return inner + (" or a 'min..max' string" if meta.get("span") else "")
    if origin is list:
        return "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    return {bool: "bool (true/false)", int: "int", float: "float", str: "str"}.get(tp, repr(tp))


def check_range(key: str, value: Any, raw: Any, meta: Any) -> None:
    """Range check of a validated value against its `bounded` range; the message shows the
    value as the user wrote it (a list as validated)."""
    bounds = meta.get("bounds") or {}
    for x in value if isinstance(value, (list, tuple)) else (value,):
        if not isinstance(x, (int, float)) or isinstance(x, bool):
            continue
        ok = (("ge" not in bounds or x >= bounds["ge"]) and ("gt" not in bounds or x > bounds["gt"])
              and ("le" not in bounds or x <= bounds["le"]) and ("lt" not in bounds or x < bounds["lt"]))
        if not ok:
            shown = _show(value) if isinstance(raw, (list, tuple)) else repr(raw)
            ops = [(">=", "ge"), (">", "gt"), ("<=", "le"), ("<", "lt")]
            rng = " and ".join(f"{op} {bounds[k]:g}" for op, k in ops if k in bounds)
            raise ConfigError(f"{key}={shown}: must be {rng}", key)


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value)


# ---- dotted overrides ------------------------------------------------------------------------

def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` merged over `base`, mapping by mapping (a new dict; the inputs are not changed)."""
    out = dict(base)
    for k, v in top.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_scalar(raw: str) -> Any:
    """An override's value as YAML reads it (`null`, `true`, `1e-3`, `[0.9, 0.99]`), else the text."""
    try:
        return yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        return raw


def set_overrides(root: type, tree: dict[str, Any], overrides: list[str] | tuple[str, ...],
                    what: str = "config") -> None:
    """Set each `section.key=value` of `overrides` in `tree`, in order (later ones win)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like section.key=value, "
                              f"e.g. rollout.window=8")
        set_override(root, tree, key.strip(), raw.strip(), what)


def _default(f: dataclasses.Field) -> Any:
    """A field's default as tree values (sections as dicts): what an override indexes into when
    the preset leaves the field out (`distill.phases.1.lam=0.5` over the built-in schedule)."""
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if isinstance(value, (list, tuple)):
        return [dataclasses.asdict(x) if dataclasses.is_dataclass(x) else x for x in value]
    return value


def set_override(root: type, tree: dict[str, Any], key: str, raw: str, what: str = "config") -> None:
    """Set tree[a][b]... = value for key "a.b...", checking the path against the schema."""
    parts = key.split(".")
    cls: Any = root
    node = tree
    skip = False
    for i, part in enumerate(parts):
        if skip:                             # the index of a list of sections, already taken
            skip = False
            continue
        prefix = ".".join(parts[:i]) + ("." if i else "")
        last = i == len(parts) - 1
        if part not in fields(cls):
            raise unknown_key(root, key, cls, prefix, part, parts[i + 1:], what)
        tp = hints(cls)[part]
        if section_items(tp) is not None and not last:   # distill.phases.1.lam=0.5
            items, index = node.get(part, _default(fields(cls)[part])), parts[i + 1]
            if not isinstance(items, list) or not index.isdigit() or int(index) >= len(items) \
                    or i + 2 >= len(parts):
                n = len(items) if isinstance(items, list) else 0
                whole = f"{prefix}{part}=[{{...}}, ...]"
                if n == 0:                       # no entry to index: only the whole list
                    raise ConfigError(f"{key}: {prefix}{part} is empty, so it has no entry "
                                      f"{index}; set the whole list as {whole}", key)
                raise ConfigError(f"{key}: {prefix}{part} holds {n} entries; set one's key as "
                                  f"{prefix}{part}.N.KEY=VALUE with 0 <= N < {n}, or the whole "
                                  f"list as {whole}", key)
            node[part] = items = [dict(x) if isinstance(x, dict) else x for x in items]
            node, cls, skip = items[int(index)], section_items(tp), True
            continue
        if is_section(tp):
            if last:
                value = parse_scalar(raw)
                if not isinstance(value, dict):
                    sub = next(iter(fields(tp)))
                    raise ConfigError(f"'{key}' is a section; set one of its keys, e.g. "
                                      f"{key}.{sub}=...", key)
                node[part] = deep_merge(node.get(part) or {}, value)
                return
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise ConfigError(f"'{prefix}{part}' must be a mapping of keys", prefix + part)
            cls = tp
            continue
        if last:
            node[part] = _override_value(raw, tp, fields(cls)[part].metadata)
            return
        if get_origin(tp) is dict:  # free-form options: a.b.opt=value
            for j, sub in enumerate(parts[i:-1], start=i):
                node = node.setdefault(sub, {})
                if not isinstance(node, dict):
                    where = ".".join(parts[:j + 1])
                    raise ConfigError(f"'{where}' holds {node!r}, not a mapping; cannot set {key}",
                                      where)
            node[parts[-1]] = parse_scalar(raw)
            return
        raise ConfigError(f"'{prefix}{part}' is a value, not a section; set {prefix}{part}=VALUE",
                          prefix + part)


def _override_value(raw: str, tp: Any, meta: Any) -> Any:
    """YAML-parse an override; a field that takes text gets the raw text if the parse does not
    fit (run.name=1.10 stays "1.10", not 1.1)."""
    value = parse_scalar(raw)
    if value is None or isinstance(value, str) or not _accepts_str(tp):
        return value
    return value if valid_value(spell(value, tp, meta), tp) else raw


def _accepts_str(tp: Any) -> bool:
    if tp is str or tp is Any:
        return True
    origin = get_origin(tp)
    if origin is Literal:
        return any(isinstance(a, str) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return any(_accepts_str(a) for a in get_args(tp))
    return False

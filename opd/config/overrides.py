"""Dotted `key=value` overrides set into a config tree, each key checked against the schema.

    set_override(RunConfig, tree, "rollout.window", "8")     # tree["rollout"]["window"] = 8
    set_override(RunConfig, tree, "rollout.windw", "3")
        # ConfigError: unknown config key 'rollout.windw'; did you mean 'rollout.window'?

A value is read as YAML reads it (`null`, `true`, `1e-3`, `[0.9, 0.99]`), but for a field that
takes text, where the text is kept when the YAML value does not fit (`run.name=1.10` stays
"1.10").  A key may reach into a list of sections (`distill.phases.1.lam=0.5`, over the
built-in list when the preset leaves it out), set a whole section as a mapping
(`data={batch_size: 2}`), or set an entry of a free-form mapping
(`distill.objective_options.gate=0.25`).  The tree is then validated as a whole
(opd/config/loader.py `build`); only the path is checked here, so that a wrong key is named as
written.  Pydantic has no dotted overrides of its own (pydantic-settings' CLI parses flags, not
these keys, and would not word the errors as the loader does).
"""
from __future__ import annotations

import dataclasses
from typing import Any, get_origin

from opd.config.loader import ConfigError, fields, hints, is_section, section_items, unknown_key
from opd.config.spelling import accepts_str, fits, parse_scalar, spell


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` merged over `base`, mapping by mapping (a new dict; the inputs are not changed)."""
    out = dict(base)
    for k, v in top.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


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
            node[part] = _override_value(raw, tp)
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


def _override_value(raw: str, tp: Any) -> Any:
    """YAML-parse an override; a field that takes text gets the raw text if the parse does not
    fit (run.name=1.10 stays "1.10", not 1.1)."""
    value = parse_scalar(raw)
    if value is None or isinstance(value, str) or not accepts_str(tp):
        return value
    return value if fits(spell(value, tp), tp) else raw

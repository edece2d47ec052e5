"""Config files: where presets live, how one extends another, and the resolved config written
back as YAML (and hashed, for cache keys).

    path = resolve_preset("tiny")                   # configs/tiny.yaml
    tree = read_preset(path)                        # its mapping, merged over its `extends:`
    config_to_yaml(cfg)                             # what `load_config` reads back as cfg
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

import yaml

from opd.config.loader import ConfigError
from opd.config.overrides import deep_merge

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
"""The repository's preset directory: `--config tiny` means `CONFIG_DIR / "tiny.yaml"`."""

EXTENDS_KEY = "extends"
"""Top-level preset key naming a base preset that the file is merged over."""

NOT_PRESETS = {"cluster"}


def available_presets() -> list[str]:
    """Preset names in CONFIG_DIR (cluster.yaml is the Ray autoscaler's file, not a preset)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if p.stem not in NOT_PRESETS)


def resolve_preset(name: str | Path) -> Path:
    """`tiny`, `tiny.yaml`, `configs/tiny.yaml` or any existing path -> the preset file."""
    p = Path(name).expanduser()
    if p.is_file():
        return p
    candidates = []
    if p.parent == Path(".") or p.parent.name == "configs":
        candidates = [CONFIG_DIR / p.name, CONFIG_DIR / f"{p.name}.yaml"]
    for c in candidates:
        if c.is_file():
            return c
    raise ConfigError(f"config {str(name)!r} not found (looked for {p}"
                      + "".join(f", {c}" for c in candidates)
                      + f"); available presets: {', '.join(available_presets()) or 'none'}")


def read_preset(path: Path, resolve: Callable[[str], Path] = resolve_preset,
                of: str = "sections", seen: tuple[Path, ...] = (),
                merge: Callable[[dict, dict], dict] = deep_merge) -> dict[str, Any]:
    """Parse a preset file, merging it (`merge(base, top)`) over the preset named by its
    `extends:` key (a file beside it, or a name `resolve` finds)."""
    if path.resolve() in seen:
        raise ConfigError(f"{path}: '{EXTENDS_KEY}' cycle: "
                          + " -> ".join(str(s) for s in (*seen, path.resolve())))
    try:
        tree = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {' '.join(str(e).split())}") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: a preset must be a mapping of {of}, got {type(tree).__name__}")
    base_name = tree.pop(EXTENDS_KEY, None)
    if base_name is None:
        return tree
    base = path.parent / str(base_name)
    base = base if base.is_file() else resolve(str(base_name))
    return merge(read_preset(base, resolve, of, (*seen, path.resolve()), merge), tree)


def config_to_dict(obj: Any) -> Any:
    """Nested plain dict of a config (tuples become lists), safe for YAML / JSON / Ray."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: config_to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): config_to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [config_to_dict(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


class _Dumper(yaml.SafeDumper):
    """Block-style mappings, flow-style lists (`betas: [0.9, 0.95]`)."""


_Dumper.add_representer(
    list, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))


def config_to_yaml(cfg: Any) -> str:
    """The resolved config as YAML; `load_config` of this text gives the same config back."""
    return yaml.dump(config_to_dict(cfg), Dumper=_Dumper, sort_keys=False)


def save_config(cfg: Any, path: str | Path) -> Path:
    """Write the resolved config (YAML) to `path`, creating parent directories; whole or not
    at all (written beside it, then renamed), so a crash while a resume rewrites a run's
    config.yaml cannot leave it cut short."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.name}.part")
    try:
        part.write_text(config_to_yaml(cfg))
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
    return path


def config_hash(obj: Any, length: int = 12) -> str:
    """Stable short hex hash of a dataclass or dict (key order and tuple/list do not matter)."""
    text = json.dumps(config_to_dict(obj), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]

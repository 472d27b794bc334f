"""Config files and overrides to one plain dict: YAML files merged left to right (a file may list
parents under ``defaults:``), then ``key=value`` overrides, ``${}`` interpolation resolved. A file
that is not valid YAML names its line and column; a path-valued key is set as written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

# Override keys whose values are paths: set as the string given, never through omegaconf.
LITERAL_KEYS = frozenset({"model.path", "model.tokenizer", "model.generation_config"})


class ConfigError(ValueError):
    """A config key or value is wrong; the message names the dotted key."""


def load_yaml(path: Path, seen: tuple[Path, ...] = ()) -> DictConfig:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path in seen:
        raise ConfigError(f"config defaults cycle through {path}")
    try:
        cfg = OmegaConf.load(path)
    except yaml.MarkedYAMLError as e:  # a syntax error: where it is, 1-based as editors count
        mark = e.problem_mark
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{at}: invalid YAML: {e.problem or e.context}") from None
    except (OmegaConfBaseException, yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: {e}") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    parents = cfg.pop("defaults", None) or []
    merged = OmegaConf.create()
    for parent in parents:
        merged = OmegaConf.merge(merged, load_yaml(path.parent / str(parent), (*seen, path)))
    return OmegaConf.merge(merged, cfg)  # type: ignore[return-value]


def merge_config(
    files: list[str | Path] | str | Path | None = None,
    overrides: list[str] | None = None,
    base: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``base`` < YAML files (with their ``defaults:`` parents) < dotlist ``overrides``, resolved
    to plain containers but not validated (a recipe may split off its own section first)."""
    if isinstance(files, str | Path):
        files = [files]
    cfg = OmegaConf.create(base or {})
    for f in files or []:
        cfg = OmegaConf.merge(cfg, load_yaml(Path(f)))
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value")
    # Paths are taken as written: never parsed or interpolated (a `${x}` in a file name).
    literal = [o for o in overrides or [] if o.partition("=")[0].strip() in LITERAL_KEYS]
    rest = [o for o in overrides or [] if o not in literal]
    try:
        if rest:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(rest))
        data = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"config: {e}") from e
    for item in literal:
        key, _, value = item.partition("=")
        section, _, name = key.strip().partition(".")
        data.setdefault(section, {})[name] = value  # type: ignore[union-attr]
    return data  # type: ignore[return-value]

"""The shipped presets: engine.yaml lists every config key with its default; all ship as data."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf
from pydantic import BaseModel

from hyloop.framework.config import CONFIG_DIR, EngineConfig, load_config

ENGINE_YAML = CONFIG_DIR / "engine.yaml"
REPO = Path(__file__).resolve().parents[3]


def schema_leaves(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, default)`` of every leaf field of the config schema, sections walked."""
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from schema_leaves(ann, f"{key}.")
        else:
            yield key, field.get_default(call_default_factory=True)


def yaml_leaves(node: Any, prefix: str = "") -> Iterator[str]:
    for name, value in node.items():
        if isinstance(value, dict) and value:
            yield from yaml_leaves(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def raw_engine_yaml() -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.load(ENGINE_YAML))  # type: ignore[return-value]


def test_engine_yaml_lists_every_schema_key_with_its_default() -> None:
    raw = raw_engine_yaml()
    missing, wrong = [], []
    for key, default in schema_leaves(EngineConfig):
        node: Any = raw
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                missing.append(key)
                break
            node = node[part]
        else:
            if node != default:
                wrong.append(f"{key}: {node!r} in engine.yaml, default {default!r}")
    assert not missing, f"keys of EngineConfig missing from {ENGINE_YAML}: {missing}"
    assert not wrong, f"engine.yaml values that are not the defaults: {wrong}"
    schema = {key for key, _ in schema_leaves(EngineConfig)}
    assert set(yaml_leaves(raw)) == schema


def test_loading_engine_yaml_gives_the_default_config() -> None:
    assert load_config(ENGINE_YAML) == EngineConfig()


def test_every_engine_yaml_key_has_a_comment() -> None:
    leaf = re.compile(r"^\s*(\w+):\s*(\S.*)$")  # `key: value ...`, not a section header
    bare = [
        m.group(1)
        for line in ENGINE_YAML.read_text().splitlines()
        if (m := leaf.match(line)) and "#" not in m.group(2)
    ]
    assert not bare, f"keys without a comment in engine.yaml: {bare}"


@pytest.mark.parametrize("name", ["models/smollm2.yaml"])
def test_model_presets_load(name: str) -> None:
    load_config(CONFIG_DIR / name)


def test_presets_are_package_data() -> None:
    """Every preset sits inside the package and matches pyproject's package-data globs, so an
    installed (non-editable) hyloop carries it."""
    package = CONFIG_DIR.parent
    assert (package / "__init__.py").is_file()
    presets = set(CONFIG_DIR.rglob("*.yaml"))
    assert {CONFIG_DIR / "engine.yaml", CONFIG_DIR / "recipes/graph_vs_eager.yaml"} <= presets
    pyproject = REPO / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip("not a source checkout")
    globs = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["hyloop"]
    shipped = {p for g in globs for p in package.glob(g)}
    assert presets <= shipped

"""Features stay behind their seams: the tree core and the model layers name none, and a
model's sliding window is read from its contract alone."""

from __future__ import annotations

import re
from pathlib import Path

from hyloop.models.arch.gemma3 import Gemma3CausalLM
from hyloop.models.contract import place_kv_layers
from hyloop.models.layers.attention import PagedAttention

PACKAGE = Path(__file__).resolve().parents[2] / "hyloop"
# torch's own GELU argument, not a hyloop feature
TORCH_WORDS = re.compile(r'approximate="tanh"')


def words(path: Path, pattern: str) -> list[str]:
    text = TORCH_WORDS.sub("", path.read_text())
    return [f"{path.name}:{m.group(0)}" for m in re.finditer(pattern, text, re.IGNORECASE)]


def test_the_tree_core_names_no_feature() -> None:
    assert words(PACKAGE / "cache" / "tree.py", r"approximate|\w*swa\w*|window") == []


def test_the_model_layers_name_no_feature() -> None:
    pattern = r"approximate|\w*swa\w*|window|sliding|structured|penalt|grammar|reuse|blend"
    found = [
        w for p in sorted((PACKAGE / "models" / "layers").rglob("*.py")) for w in words(p, pattern)
    ]
    assert found == []


def test_the_layers_see_the_contracts_windows() -> None:
    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "sliding_window": 7,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    }
    model = Gemma3CausalLM(config)
    assert model.contract.kv_windows == (7, None, 7) and model.contract.sliding_window == 7
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    assert [a.view.window for a in layers] == [7, None, 7]
    assert [a.view.layer for a in layers] == [0, 1, 2]  # one full pool
    assert place_kv_layers(model, model.contract.kv_windows, own_pool=True) == (1, 2)
    assert [(a.view.layer, a.view.own_pool) for a in layers] == [(0, True), (0, False), (1, True)]

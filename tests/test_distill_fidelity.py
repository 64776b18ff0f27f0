"""The reference's data, batching and loss, reproduced: a local copy of a gated source, unpacked conversations,
and the reference's loss normalisation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distill.data import DataError, check_sources, load_source
from distill.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_token(tmp_path, monkeypatch):
    import huggingface_hub

    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    assert huggingface_hub.get_token() is None


def test_a_local_copy_of_a_gated_source_needs_no_token(no_token, tmp_path):
    """The GPU recipes mark LMSYS-Chat-1M gated; pointing that source at a local file (a copy made once, on a
    machine with a login) reads it without a token, while the hub name itself is still refused."""
    rows = [
        {
            "conversation_id": str(i),
            "conversation": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}],
        }
        for i in range(3)
    ]
    local = tmp_path / "lmsys.jsonl"
    local.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe_path = ROOT / "recipes" / "swiftkv_llama3.1_8b.yaml"
    gated = [i for i, s in enumerate(load_recipe(recipe_path).data.sources) if s.gated]
    assert gated, "the recipe no longer has a gated source"
    recipe = load_recipe(recipe_path, [f"data.sources.{gated[0]}.path={local}"])
    source = recipe.data.sources[gated[0]]
    assert source.gated and source.format == "lmsys"
    check_sources(recipe.data)
    assert [r["conversation_id"] for r in load_source(source)] == ["0", "1", "2"]

    missing = load_recipe(recipe_path, [f"data.sources.{gated[0]}.path={tmp_path / 'gone.jsonl'}"])
    with pytest.raises(DataError, match=r"^data file .*gone\.jsonl not found \(to resolve"):
        check_sources(missing.data)
    with pytest.raises(DataError, match=r"lmsys/lmsys-chat-1m.*gated.*hf auth login"):
        check_sources(load_recipe(recipe_path).data)

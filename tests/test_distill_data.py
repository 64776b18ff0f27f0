"""Recipe validation, chat rendering and masking, packing."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from distill.data import DataError, build_datasets, pack, render_conversation
from distill.recipe import RecipeError, load_recipe

RECIPE = """
output_dir: out/x
model: {source: /nowhere, swiftkv: {fraction: 0.5}}
data: {sources: [{path: sharegpt}], seq_len: 64}
train: {max_steps: 3}
"""


@pytest.fixture
def recipe_file(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE)
    return path


def test_recipe_loads_with_overrides(recipe_file):
    r = load_recipe(recipe_file, ["train.max_steps=7", "optim.lr=1e-3", "data.sources.0.max_samples=5"])
    assert (r.train.max_steps, r.optim.lr, r.data.sources[0].max_samples) == (7, 1e-3, 5)
    assert r.loss.temperature == 2.0 and r.optim.betas == (0.9, 0.999)  # paper defaults


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["train.max_step=3"], ["recipe error: train.max_step: unknown key"]),
        (["optim.lr=fast"], ["recipe error: optim.lr: Input should be a valid number"]),
        (
            ["train.max_step=3", "loss.temperature=-1"],
            [
                "recipe error: loss.temperature: Input should be greater than 0",
                "recipe error: train.max_step: unknown key",
            ],
        ),
        (
            ["model.swiftkv.num_key_value_layers=3"],
            ["set exactly one of swiftkv.num_key_value_layers and swiftkv.fraction"],
        ),
        (["train.max_steps"], ["override 'train.max_steps' is not key=value"]),
    ],
)
def test_recipe_errors_name_every_problem(recipe_file, overrides, expected):
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe_file, overrides)
    lines = str(e.value).splitlines()
    assert len(lines) == len(expected)
    for want in expected:
        assert any(want in line for line in lines), (want, lines)


def test_recipe_file_errors(tmp_path):
    with pytest.raises(RecipeError, match="not found"):
        load_recipe(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("a: [1, 2\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(tmp_path / "bad.yaml")


def test_assistant_mask_covers_exactly_the_assistant_turns(smollm2):
    tok = AutoTokenizer.from_pretrained(smollm2)
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye."},
    ]
    out = render_conversation(messages, tok)
    counted = [t for t, c in zip(out["input_ids"], out["counted"], strict=True) if c]
    text = tok.decode(counted)
    assert text == "Hello there!<|im_end|>\nGoodbye.<|im_end|>\n"
    assert tok.decode(out["input_ids"]) == tok.apply_chat_template(messages, tokenize=False)
    everything = render_conversation(messages, tok, loss_on="all")
    assert all(everything["counted"])


def test_pack_restarts_positions_and_shifts_the_mask():
    samples = [
        {"input_ids": [5, 6, 7], "counted": [0, 1, 1]},
        {"input_ids": [8, 9], "counted": [0, 1]},
        {"input_ids": [1, 2, 3, 4, 5, 6], "counted": [1] * 6},
    ]
    rows = pack(samples, seq_len=6, pad_id=0)
    assert rows["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0], [1, 2, 3, 4, 5, 6]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]
    assert rows["loss_mask"].tolist() == [[1, 1, 0, 1, 0, 0], [1, 1, 1, 1, 1, 0]]
    unpacked = pack(samples, seq_len=6, pad_id=0, packing=False)
    assert unpacked["input_ids"].shape == (3, 6)
    cut_off = {"input_ids": list(range(10)), "counted": [0] * 7 + [1] * 3}  # the reply starts past seq_len
    assert pack([cut_off], seq_len=6, pad_id=0)["input_ids"].shape == (0, 6)


def test_packed_rows_attend_within_their_sample():
    from conftest import tiny_base

    from swiftkv.convert import to_swiftkv

    model = to_swiftkv(tiny_base("llama"), 3, 1)
    a, b = torch.randint(3, 128, (1, 5)), torch.randint(3, 128, (1, 4))
    packed = torch.cat([a, b], 1)
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]])
    with torch.no_grad():
        _, student, _, _ = model.model.teacher_student_hidden(packed, position_ids=pos)
        _, alone, _, _ = model.model.teacher_student_hidden(b)
    torch.testing.assert_close(student[:, 5:], alone, atol=1e-5, rtol=0)


def test_build_datasets_and_its_errors(tiny_chat_model, chat_data, tmp_path, recipe_file):
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    recipe = load_recipe(
        recipe_file, [f"data.sources.0.path={chat_data}", "data.holdout=0.1", "data.seq_len=128"]
    )
    train, held = build_datasets(recipe.data, tok, max_positions=512)
    assert train["input_ids"].shape[1] == 128 and held["input_ids"].shape[0] >= 1
    assert train["loss_mask"].sum() > 0
    too_long = load_recipe(recipe_file, [f"data.sources.0.path={chat_data}", "data.seq_len=1024"])
    with pytest.raises(DataError, match="exceeds the model's max_position_embeddings=512"):
        build_datasets(too_long.data, tok, max_positions=512)
    with pytest.raises(DataError, match="not found"):
        build_datasets(load_recipe(recipe_file, [f"data.sources.0.path={tmp_path / 'nope.jsonl'}"]).data, tok)
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"conversations": [{"from": "human", "value": "only a question"}]}\n')
    with pytest.raises(DataError, match="empty after filtering"):
        build_datasets(load_recipe(recipe_file, [f"data.sources.0.path={empty}"]).data, tok)


def test_shipped_recipes_validate():
    from pathlib import Path

    recipes = sorted(Path(__file__).resolve().parents[1].glob("recipes/*.yaml"))
    assert len(recipes) >= 4
    for path in recipes:
        load_recipe(path)


def test_instruction_records_become_conversations(smollm2):
    from distill.data import _tokenize
    from distill.recipe import DataSource

    tok = AutoTokenizer.from_pretrained(smollm2)
    out = _tokenize(
        {"system_prompt": "Be brief.", "question": "2+2?", "response": "4"},
        tok,
        DataSource(path="x"),
        "assistant",
    )
    assert (
        tok.decode([t for t, c in zip(out["input_ids"], out["counted"], strict=True) if c]) == "4<|im_end|>\n"
    )

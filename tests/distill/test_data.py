"""Recipe validation, chat rendering and masking, packing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from helpers import ROOT
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


@pytest.mark.smollm2
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
    from helpers.models import tiny_base

    from swiftkv.convert import to_swiftkv

    model = to_swiftkv(tiny_base("llama"), 3, 1)
    a, b = torch.randint(3, 128, (1, 5)), torch.randint(3, 128, (1, 4))
    packed = torch.cat([a, b], 1)
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]])
    with torch.no_grad():
        _, student, _, _ = model.model.teacher_student_hidden(packed, position_ids=pos)
        _, alone, _, _ = model.model.teacher_student_hidden(b)
    torch.testing.assert_close(student[:, 5:], alone, atol=1e-5, rtol=0)


@pytest.mark.smollm2
def test_build_datasets_and_its_errors(tiny_chat_model, chat_data, tmp_path, recipe_file):
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    recipe = load_recipe(
        recipe_file, [f"data.sources.0.path={chat_data}", "data.holdout=0.1", "data.seq_len=128"]
    )
    train, held = build_datasets(recipe.data, tok, max_positions=512)
    assert train["input_ids"][:].shape[1] == 128 and len(held) >= 1
    assert train["loss_mask"][:].sum() > 0
    too_long = load_recipe(recipe_file, [f"data.sources.0.path={chat_data}", "data.seq_len=1024"])
    with pytest.raises(DataError, match="exceeds the model's max_position_embeddings=512"):
        build_datasets(too_long.data, tok, max_positions=512)
    with pytest.raises(DataError, match="not found"):
        build_datasets(load_recipe(recipe_file, [f"data.sources.0.path={tmp_path / 'nope.jsonl'}"]).data, tok)
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"conversations": [{"from": "human", "value": "only a question"}]}\n')
    with pytest.raises(DataError, match="yields no trainable sample"):
        build_datasets(load_recipe(recipe_file, [f"data.sources.0.path={empty}"]).data, tok)


def test_shipped_recipes_validate():

    recipes = sorted(ROOT.glob("recipes/*.yaml"))
    assert len(recipes) >= 4
    for path in recipes:
        load_recipe(path)


# --- data by real schema (issue 17): fixtures in exactly the hub datasets' column layouts ---------------------

MODERATION = {
    "categories": {"harassment": False, "hate": False, "sexual": False, "violence": False},
    "category_scores": {"harassment": 0.001, "hate": 0.0, "sexual": 0.002, "violence": 0.0},
    "flagged": False,
}
REPLIES = [f"Reply number {i}: the answer is {i * 7}." for i in range(6)]
LAYOUT_RECORDS = {
    # Open-Orca/OpenOrca: id, system_prompt (often empty), question, response
    "openorca": [
        {"id": f"niv.{i}", "system_prompt": "Be brief." if i % 2 else "", "question": f"Q{i}?", "response": r}
        for i, r in enumerate(REPLIES)
    ],
    # nvidia/AceMath-Instruct-Training-Data: messages holds only the user turn; the reply is `answer`
    "acemath": [
        {"messages": [{"role": "user", "content": f"Solve {i} + {i}."}], "answer": r}
        for i, r in enumerate(REPLIES)
    ],
    # lmsys/lmsys-chat-1m: conversation (role/content) plus metadata columns
    "lmsys": [
        {
            "conversation_id": f"c{i}",
            "model": "vicuna-13b",
            "conversation": [{"content": f"Hi {i}", "role": "user"}, {"content": r, "role": "assistant"}],
            "turn": 1,
            "language": "English",
            "openai_moderation": [MODERATION, MODERATION],
            "redacted": False,
        }
        for i, r in enumerate(REPLIES)
    ],
    "messages": [
        {"messages": [{"role": "user", "content": f"Tell me {i}"}, {"role": "assistant", "content": r}]}
        for i, r in enumerate(REPLIES)
    ],
    "sharegpt": [
        {
            "id": f"s{i}",
            "conversations": [{"from": "human", "value": f"Hey {i}"}, {"from": "gpt", "value": r}],
        }
        for i, r in enumerate(REPLIES)
    ],
}
SUFFIX = {
    "openorca": ".jsonl",
    "acemath": ".parquet",
    "lmsys": ".parquet",
    "messages": ".jsonl",
    "sharegpt": ".jsonl",
}


def write_records(path, records):
    import json

    import datasets

    if path.suffix == ".parquet":
        datasets.Dataset.from_list(records).to_parquet(str(path))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def data_recipe(recipe_file, tmp_path, sources, *overrides):
    import json

    return load_recipe(
        recipe_file,
        [
            f"data.sources={json.dumps(sources)}",
            "data.holdout=0",
            "data.packing=false",
            f"data.cache_dir={tmp_path / 'cache'}",
            *overrides,
        ],
    )


def counted_texts(rows, tok) -> list[str]:
    """The text of the tokens each row's loss counts (position t counts token t+1)."""
    ids, mask = rows["input_ids"][:], rows["loss_mask"][:]
    return [tok.decode(i[1:][m[:-1].bool()]) for i, m in zip(ids, mask, strict=True)]


@pytest.mark.smollm2
@pytest.mark.parametrize("layout", sorted(LAYOUT_RECORDS))
@pytest.mark.parametrize("named", [False, True], ids=["detected", "named"])
def test_each_real_layout_trains_on_exactly_its_replies(smollm2, recipe_file, tmp_path, layout, named):
    tok = AutoTokenizer.from_pretrained(smollm2)
    path = write_records(tmp_path / f"{layout}{SUFFIX[layout]}", LAYOUT_RECORDS[layout])
    source = {"path": str(path), **({"format": layout} if named else {})}
    train, _ = build_datasets(data_recipe(recipe_file, tmp_path, [source]).data, tok)
    assert sorted(counted_texts(train, tok)) == sorted(f"{r}<|im_end|>\n" for r in REPLIES)


@pytest.mark.smollm2
def test_openorca_system_prompt_is_rendered_when_present(smollm2, recipe_file, tmp_path):
    tok = AutoTokenizer.from_pretrained(smollm2)
    path = write_records(tmp_path / "orca.jsonl", LAYOUT_RECORDS["openorca"][:2])
    train, _ = build_datasets(data_recipe(recipe_file, tmp_path, [{"path": str(path)}]).data, tok)
    texts = [tok.decode(ids) for ids in train["input_ids"][:]]
    assert sum("Be brief." in t for t in texts) == 1


@pytest.mark.smollm2
def test_unknown_layout_fails_at_once_naming_source_and_columns(smollm2, recipe_file, tmp_path):
    tok = AutoTokenizer.from_pretrained(smollm2)
    path = write_records(tmp_path / "pc.jsonl", [{"prompt": "2+2?", "completion": "4"}] * 3)
    with pytest.raises(DataError) as e:
        build_datasets(data_recipe(recipe_file, tmp_path, [{"path": str(path)}]).data, tok)
    msg = str(e.value)
    assert str(path) in msg and "completion" in msg and "prompt" in msg and "to resolve" in msg
    assert len(msg.splitlines()) == 1
    # a named layout whose columns are missing says which it reads and which it saw
    named = data_recipe(recipe_file, tmp_path, [{"path": str(path), "format": "acemath"}])
    with pytest.raises(DataError, match=r"format acemath reads columns messages, answer.*prompt, completion"):
        build_datasets(named.data, tok)


@pytest.mark.smollm2
def test_source_without_trainable_rows_fails_before_the_others_are_tokenized(
    smollm2, recipe_file, tmp_path, chat_data
):
    tok = AutoTokenizer.from_pretrained(smollm2)
    questions = write_records(
        tmp_path / "questions.parquet",
        [{"messages": [{"role": "user", "content": f"Q{i}"}]} for i in range(5)],
    )
    recipe = data_recipe(recipe_file, tmp_path, [{"path": str(chat_data)}, {"path": str(questions)}])
    with pytest.raises(DataError) as e:
        build_datasets(recipe.data, tok)
    msg = str(e.value)
    assert str(questions) in msg and "messages" in msg and str(chat_data) not in msg
    assert not list((tmp_path / "cache").rglob("cache-*.arrow")), "a source was tokenized before the check"


def test_gated_source_without_a_login_is_refused_before_loading(recipe_file, tmp_path, monkeypatch):
    import huggingface_hub

    from distill.data import check_sources

    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    assert huggingface_hub.get_token() is None
    gated = {"path": "lmsys/lmsys-chat-1m", "format": "lmsys", "gated": True}
    recipe = data_recipe(recipe_file, tmp_path, [gated])
    with pytest.raises(DataError, match=r"lmsys/lmsys-chat-1m.*gated.*to resolve.*hf auth login"):
        build_datasets(recipe.data, tokenizer=None)  # refused before the tokenizer or the hub is touched
    monkeypatch.setenv("HF_TOKEN", "hf_fake")
    check_sources(recipe.data)  # a configured token passes the check


def reference_pack(samples, seq_len: int, pad_id: int, packing: bool = True) -> dict[str, list]:
    """The list-based packing this pipeline had before it moved to ``datasets`` (kept as the reference)."""
    rows, ids, pos, mask = [], [], [], []

    def flush():
        fill = seq_len - len(ids)
        rows.append((ids + [pad_id] * fill, pos + list(range(fill)), mask + [0] * fill))

    for sample in samples:
        s_ids, counted = sample["input_ids"][:seq_len], sample["counted"][:seq_len]
        if not any(counted[1:]):
            continue
        if ids and (not packing or len(ids) + len(s_ids) > seq_len):
            flush()
            ids, pos, mask = [], [], []
        ids += s_ids
        pos += list(range(len(s_ids)))
        mask += counted[1:] + [0]
    if ids:
        flush()
    return {k: [list(r[j]) for r in rows] for j, k in enumerate(("input_ids", "position_ids", "loss_mask"))}


def random_samples(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(1, 90, (1,), generator=g))
        counted = (torch.rand(length, generator=g) < 0.6).int().tolist()
        out.append({"input_ids": torch.randint(3, 1000, (length,), generator=g).tolist(), "counted": counted})
    return out


@pytest.mark.parametrize("packing", [True, False])
def test_datasets_packing_gives_the_rows_of_the_list_packing(packing):
    import datasets

    from distill.data import PACK_BATCH, pack_dataset

    samples = random_samples(PACK_BATCH // 4)  # one map batch: exactly the old rows
    rows = pack_dataset(datasets.Dataset.from_list(samples), seq_len=64, pad_id=0, packing=packing)
    want = reference_pack(samples, 64, 0, packing)
    for k in want:
        assert rows[k][:].tolist() == want[k], k
    assert rows[0]["input_ids"].dtype == torch.long
    # the in-memory form (held-out rows of eval.quality) is the same packing
    assert pack(samples, 64, 0, packing)["input_ids"].tolist() == want["input_ids"]


def test_datasets_packing_across_map_batches_keeps_every_sample_whole():
    import datasets

    from distill.data import PACK_BATCH, pack_dataset

    samples = random_samples(PACK_BATCH * 2 + 123, seed=1)
    rows = pack_dataset(datasets.Dataset.from_list(samples), seq_len=64, pad_id=0)
    want = reference_pack(samples, 64, 0)

    def segments(ids_rows, pos_rows):  # the samples of each row, split where position ids restart
        out = []
        for ids, pos in zip(ids_rows, pos_rows, strict=True):
            starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
            out += [tuple(ids[a:b]) for a, b in itertools.pairwise(starts)]
        return out

    got_segments = segments(rows["input_ids"][:].tolist(), rows["position_ids"][:].tolist())
    want_segments = segments(want["input_ids"], want["position_ids"])
    real = lambda segs: [s for s in segs if any(s)]  # noqa: E731 (padding segments are all zeros)
    assert real(got_segments) == real(want_segments)  # same samples, same order, none split
    assert len(want["input_ids"]) <= len(rows) <= len(want["input_ids"]) + 3  # <= 1 extra row per batch


@pytest.mark.slow
@pytest.mark.smollm2
def test_tokenizing_runs_once_and_other_processes_load_it_from_the_cache(
    smollm2, recipe_file, tmp_path, chat_data
):
    import subprocess
    import sys

    tok = AutoTokenizer.from_pretrained(smollm2)
    recipe = data_recipe(
        recipe_file, tmp_path, [{"path": str(chat_data)}], "data.num_proc=2", "data.packing=true"
    )
    train, _ = build_datasets(recipe.data, tok)
    files = sorted((tmp_path / "cache").rglob("cache-*.arrow"))
    assert any("of_00002" in f.name for f in files)  # tokenized by 2 worker processes
    child = f"""
from transformers import AutoTokenizer
from distill.data import build_datasets
from distill.recipe import DataSection
import json
data = DataSection.model_validate(json.loads({recipe.data.model_dump_json()!r}))
train, _ = build_datasets(data, AutoTokenizer.from_pretrained({str(smollm2)!r}))
print(json.dumps(train["input_ids"][:].tolist()))
"""
    out = subprocess.run(
        [sys.executable, "-c", child],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert sorted((tmp_path / "cache").rglob("cache-*.arrow")) == files  # nothing recomputed
    import json

    assert json.loads(out.stdout.splitlines()[-1]) == train["input_ids"][:].tolist()
    serial = data_recipe(
        recipe_file,
        tmp_path,
        [{"path": str(chat_data)}],
        f"data.cache_dir={tmp_path / 'c1'}",
        "data.packing=true",
    )
    assert build_datasets(serial.data, tok)[0]["input_ids"][:].tolist() == train["input_ids"][:].tolist()


@pytest.mark.smollm2
def test_source_stats_count_samples_and_assistant_tokens(smollm2, tmp_path):
    from distill.data import render_conversation, source_stats
    from distill.recipe import DataSource
    from toolkit.assets import to_messages

    tok = AutoTokenizer.from_pretrained(smollm2)
    records = LAYOUT_RECORDS["lmsys"] + [
        {**LAYOUT_RECORDS["lmsys"][0], "conversation": [{"content": "?", "role": "user"}]}
    ]
    path = write_records(tmp_path / "lmsys.parquet", records)
    stats = source_stats(DataSource(path=str(path)), tok, rows=5)
    want = [render_conversation(to_messages(r["conversation"]), tok) for r in records[:5]]
    assert stats["format"] == "lmsys" and stats["rows"] == 5 and stats["samples"] == 5
    assert stats["assistant_tokens"] == sum(sum(w["counted"][1:]) for w in want)
    assert stats["tokens"] == sum(len(w["input_ids"]) for w in want)
    assert "conversation_id" in stats["columns"]
    assert (
        source_stats(DataSource(path=str(path)), tok, rows=100)["samples"] == 6
    )  # the question-only row is not


def test_recipe_data_fields_are_validated(recipe_file):
    r = load_recipe(recipe_file)
    assert (r.data.sources[0].format, r.data.sources[0].gated, r.data.tokenize_timeout_minutes) == (
        "auto",
        False,
        120,
    )
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe_file, ["data.sources.0.format=alpaca"])
    for name in ("auto", "sharegpt", "messages", "openorca", "acemath", "lmsys", "text"):
        assert f"'{name}'" in str(e.value)


def test_gpu_recipes_read_each_source_by_its_layout():

    for path in sorted(ROOT.glob("recipes/swiftkv_*b.yaml")):
        sources = {s.path: s for s in load_recipe(path).data.sources}
        assert sources["Open-Orca/OpenOrca"].format == "openorca"
        assert sources["nvidia/AceMath-Instruct-Training-Data"].format == "acemath"
        assert sources["lmsys/lmsys-chat-1m"].format == "lmsys" and sources["lmsys/lmsys-chat-1m"].gated
        assert "gated" in path.read_text() and "login" in path.read_text()


@pytest.mark.smollm2
def test_plain_text_counts_every_token(smollm2, recipe_file, tmp_path):
    tok = AutoTokenizer.from_pretrained(smollm2)
    path = tmp_path / "notes.txt"
    path.write_text("The first line of notes.\n\nThe second one, longer than the first.\n")
    train, _ = build_datasets(data_recipe(recipe_file, tmp_path, [{"path": str(path)}]).data, tok)
    lines = [line for line in path.read_text().splitlines() if line]
    want = sorted(len(tok(line, add_special_tokens=False)["input_ids"]) - 1 for line in lines)
    assert sorted(train["loss_mask"][:].sum(1).tolist()) == want  # every token but the first is predicted


def test_long_reply_cuts_after_the_last_reply_past_the_prompt_length():
    """One sample per conversation: cut after the last reply that starts at min_prompt or later (before the
    cut), only that reply counted, at most max_reply tokens of it."""
    from distill.data import long_reply

    counted = np.array([0] * 5 + [1] * 4 + [0] * 6 + [1] * 5 + [0] * 3 + [1] * 2, dtype=np.int8)
    ids = np.arange(len(counted))
    got_ids, got = long_reply(ids, counted, min_prompt=10)
    assert got.tolist() == [0] * 23 + [1] * 2 and got_ids.tolist() == list(range(25))
    got_ids, got = long_reply(ids, counted, min_prompt=10, max_len=22)  # the last reply starts past the cut
    assert got.tolist() == [0] * 15 + [1] * 5 and len(got_ids) == 20
    _, got = long_reply(ids, counted, min_prompt=10, max_reply=3, max_len=22)
    assert got.tolist() == [0] * 15 + [1] * 3
    _, got = long_reply(ids, counted, min_prompt=3, max_len=12)  # a reply cut by max_len keeps what fits
    assert got.tolist() == [0] * 5 + [1] * 4
    assert long_reply(ids, counted, min_prompt=24) is None


def test_recipe_refuses_a_long_prompt_source_that_cannot_fit():
    from distill.recipe import DataSection

    with pytest.raises(
        ValueError, match="min_prompt_tokens=600 leaves no room for a reply within 512 tokens"
    ):
        DataSection(sources=[{"path": "sharegpt", "min_prompt_tokens": 600}], seq_len=512)
    with pytest.raises(ValueError, match="max_tokens=1024 exceeds seq_len=512"):
        DataSection(sources=[{"path": "sharegpt", "max_tokens": 1024}], seq_len=512)
    with pytest.raises(ValueError, match="max_reply_tokens needs min_prompt_tokens > 0"):
        DataSection(sources=[{"path": "sharegpt", "max_reply_tokens": 8}], seq_len=512)

"""Every entry point that reads a model folder refuses a bad one the same way: exit status 2, nothing on
stdout, ONE stderr line naming the problem and (after "to resolve") the fix, and nothing written anywhere.

The defects are those a user meets: a corrupt ``config.json``, a truncated weights file (an interrupted
download), a missing tokenizer, and a folder of another model family.  Each command runs in-process through
its ``main(argv)``; the model folder is a tiny random chat model built in the test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.chat import CONVERSATIONS, byte_tokenizer, save_chat_model
from transformers import GPT2Config, GPT2LMHeadModel

from distill.__main__ import main as distill_main
from eval.cli import main as eval_main
from kvcompress.cli import main as kvcompress_main
from swiftkv.cli import main as swiftkv_main

M, OUT, RECIPE, DATA = "{model}", "{out}", "{recipe}", "{data}"
ENTRY_POINTS = {
    "swiftkv convert": (swiftkv_main, ["convert", M, OUT, "--swiftkv-fraction", "0.5"]),
    "swiftkv info": (swiftkv_main, ["info", M]),
    "swiftkv kvcompress calibrate": (
        kvcompress_main,
        ["calibrate", M, "--out", OUT, "--data", DATA, "--limit", "2"],
    ),
    "distill": (distill_main, [RECIPE]),
    "distill check": (distill_main, ["check", RECIPE]),
    "eval run": (eval_main, ["run", M, "--out", OUT, "--quick"]),
    "eval quality": (eval_main, ["quality", M, "--data", DATA]),
    "eval harness": (eval_main, ["harness", M, "--tasks", "sharegpt_ppl", "--tasks-dir", OUT]),
    "eval vllm-args": (eval_main, ["vllm-args", M]),
}


def corrupt_config(model: Path) -> None:
    (model / "config.json").write_text('{"model_type": "llama", ')


def truncated_weights(model: Path) -> None:
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def missing_tokenizer(model: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (model / name).unlink(missing_ok=True)


def other_family(model: Path) -> None:
    for path in model.iterdir():
        path.unlink()
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=259)).save_pretrained(model)
    byte_tokenizer().save_pretrained(model)


# defect -> (prepare the folder, what the line must name)
DEFECTS = {
    "corrupt config.json": (corrupt_config, "config.json is corrupt (Expecting"),
    "truncated weights": (truncated_weights, "model.safetensors is corrupt or truncated"),
    "missing tokenizer": (missing_tokenizer, "has no tokenizer"),
    "another model family": (other_family, "is a 'gpt2' checkpoint, a family this command does not support"),
}
# `swiftkv info` prints the layout from config.json: it needs no tokenizer
NOT_APPLICABLE = {("swiftkv info", "missing tokenizer")}
CASES = [(e, d) for e in ENTRY_POINTS for d in DEFECTS if (e, d) not in NOT_APPLICABLE]


def snapshot(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


@pytest.mark.parametrize(("entry", "defect"), CASES, ids=[f"{e}: {d}" for e, d in CASES])
def test_bad_checkpoint_is_refused_in_one_line(entry, defect, tmp_path, capsys):
    model = save_chat_model(tmp_path / "model")
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        json.dumps(
            {
                "output_dir": str(tmp_path / "out"),
                "model": {"source": str(model), "swiftkv": {"fraction": 0.5}},
                "data": {"sources": [{"path": str(data)}], "seq_len": 64},
            }
        )
    )
    prepare, problem = DEFECTS[defect]
    prepare(model)
    before = snapshot(tmp_path)
    main, argv = ENTRY_POINTS[entry]
    values = {"model": model, "out": tmp_path / "out", "recipe": recipe, "data": data}
    capsys.readouterr()
    code = main([a.format(**values) for a in argv])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert out == "" and err.startswith("error: ") and err.count("\n") == 1, err
    assert problem in err and "(to resolve, " in err, err
    assert snapshot(tmp_path) == before, "something was written"

"""A user's own model end to end, without network: a Hub id found in a local cache that huggingface_hub's own
functions wrote (``HF_HUB_OFFLINE=1``), converted and distilled into publishable folders (card, licence
files, provenance with the source's id and revision), the distillation's TensorBoard events read back with
TensorBoard's own reader, and the one-line refusals of ids that cannot be used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT
from helpers.chat import CARD, LICENCES, save_chat_model
from helpers.hub import HUB_REPO as REPO
from helpers.hub import add_to_cache
from huggingface_hub import ModelCard, scan_cache_dir
from safetensors import safe_open

from distill.__main__ import main as distill_main
from distill.recipe import TRACKERS
from toolkit.checkpoint import CheckpointError, open_checkpoint


def offline_env(home: Path) -> dict:
    return {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def test_hub_ids_resolve_offline_from_the_cache(hub, tmp_path):
    home, commit = hub
    (repo,) = scan_cache_dir(home / "hub").repos  # the library reads the layout back as one model
    assert (repo.repo_id, [r.commit_hash for r in repo.revisions], set(repo.refs)) == (
        REPO,
        [commit],
        {"main"},
    )
    snapshot = home / "hub" / "models--acme--tiny-chat" / "snapshots" / commit
    for name in (REPO, f"{REPO}@{commit}"):
        checkpoint = open_checkpoint(name)
        assert (checkpoint.path, checkpoint.repo_id, checkpoint.revision) == (snapshot, REPO, commit)
        assert checkpoint.provenance()["source_id"] == REPO and checkpoint.config["model_type"] == "llama"


@pytest.mark.parametrize(
    "problem, message",
    [
        ("missing", "model acme/missing is not in the Hugging Face cache"),
        ("incomplete", "the cached copy of acme/partial in"),
    ],
)
def test_unusable_ids_are_refused_in_one_line(hub, tmp_path, problem, message):
    home, _ = hub
    if (
        problem == "incomplete"
    ):  # an interrupted download: the tree lists the weights, the snapshot lacks them
        add_to_cache(home / "hub", "acme/partial", tmp_path / "upload", skip=("model.safetensors",))
    with pytest.raises(CheckpointError) as info:
        open_checkpoint("acme/missing" if problem == "missing" else "acme/partial")
    text = str(info.value)
    assert text.startswith(message) and "\n" not in text and "(to resolve, " in text
    assert "hf download acme/" in text


def test_convert_a_hub_id_writes_card_licences_and_provenance(hub, tmp_path):
    home, commit = hub
    dst = tmp_path / "tiny-swiftkv50"
    cmd = [sys.executable, "-m", "toolkit", "convert", REPO, str(dst), "--swiftkv-fraction", "0.5"]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=offline_env(home), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    with safe_open(tmp_path / "upload" / "model.safetensors", framework="pt") as f:
        n = len(list(f.keys()))
    assert "convert: 100%" in result.stderr and f"{n}/{n}" in result.stderr  # the progress bar, over tensors
    check_card(dst, commit, "`swiftkv convert` with num_key_value_layers 3 of 6")
    provenance = json.loads((dst / "provenance.json").read_text())
    assert (provenance["source_id"], provenance["source_revision"]) == (REPO, commit)


def check_card(folder: Path, commit: str, made_by: str) -> ModelCard:
    card = ModelCard.load(folder / "README.md")
    assert card.text.lstrip().splitlines()[0] == f"# {REPO}, SwiftKV 50%"  # not the folder's name
    assert card.data.base_model == REPO and card.data.license == "llama3.1"
    assert card.data.library_name == "transformers" and "swiftkv" in card.data.tags
    assert f"`{REPO}` (revision `{commit}`)" in card.text and made_by in card.text
    assert CARD.splitlines()[-1] not in card.text  # the base model's own card is not copied
    assert "| 6 | 3 | 3..5 (3, 50%) | 1 |" in card.text  # the layout table
    for name, text in LICENCES.items():
        assert (folder / name).read_text() == text and f"`{name}`" in card.text
    return card


def test_distill_a_hub_id_publishable_and_tracked_in_tensorboard(hub, chat_data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    home, commit = hub
    out = tmp_path / "run"
    recipe = {
        "output_dir": str(out),
        "model": {"source": REPO, "swiftkv": {"fraction": 0.5}},
        "data": {"sources": [{"path": str(chat_data)}], "seq_len": 64, "holdout": 0.1},
        "loss": {"chunk_tokens": 32},
        "train": {"micro_batch_size": 2, "max_steps": 4},
        "checkpoint": {"every_steps": 4},
        "log": {"every_steps": 1, "eval_every_steps": 2, "eval_batches": 2, "report_to": ["tensorboard"]},
    }
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))
    cmd = [sys.executable, "-m", "distill", str(tmp_path / "recipe.yaml")]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=offline_env(home), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]

    final = json.loads((out / "final_metrics.json").read_text())
    card = check_card(out / "model", commit, "`python -m distill`")
    assert "```yaml" in card.text and "source: acme/tiny-chat" in card.text  # the recipe
    assert f"| kl | {final['eval_kl']:.4g} |" in card.text  # the held-out quality of the export
    check_card(out / "converted", commit, "`swiftkv convert`")
    provenance = json.loads((out / "model" / "provenance.json").read_text())
    assert (provenance["stage"], provenance["source_id"], provenance["source_revision"]) == (
        "distill",
        REPO,
        commit,
    )

    # every number of log.jsonl reached TensorBoard, at its step (read back with TensorBoard's own reader)
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(out / "trackers" / out.name))
    events.Reload()
    for tag in ("loss", "eval_kl", "lr"):
        logged = [(r["step"], r[tag]) for r in records if tag in r]
        assert len(logged) >= 2, tag
        read = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in read] == [s for s, _ in logged], tag
        assert [v for _, v in read] == pytest.approx([v for _, v in logged], rel=1e-6), tag
    (hparams,) = (out / "trackers" / out.name).glob("*/hparams.yml")
    assert "optim.lr: 0.0002" in hparams.read_text()


def test_tracker_names_are_accelerates_and_a_missing_one_is_refused(tmp_path, chat_data, capsys):
    from accelerate.tracking import get_available_trackers
    from accelerate.utils import LoggerType

    assert set(TRACKERS.__args__) == set(LoggerType.list()) - {"all"}
    missing = next(
        (t for t in TRACKERS.__args__ if t not in {str(a) for a in get_available_trackers()}), None
    )
    if missing is None:
        pytest.skip("every tracker is installed here")
    model = save_chat_model(tmp_path / "model", card=False)
    recipe = {
        "output_dir": str(tmp_path / "out"),
        "model": {"source": str(model), "swiftkv": {"fraction": 0.5}},
        "data": {"sources": [{"path": str(chat_data)}], "seq_len": 64},
        "log": {"report_to": [missing]},
    }
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))
    capsys.readouterr()
    assert distill_main([str(tmp_path / "recipe.yaml")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(
        f"error: log.report_to names {missing}, not installed here (to resolve, `pip install"
    )
    assert not (tmp_path / "out").exists()


def test_distill_check_reads_a_hub_id_from_the_cache(hub, chat_data, tmp_path, capsys):
    recipe = {
        "output_dir": str(tmp_path / "out"),
        "model": {"source": REPO, "swiftkv": {"fraction": 0.5}},
        "data": {"sources": [{"path": str(chat_data)}], "seq_len": 64},
    }
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))
    capsys.readouterr()
    assert distill_main(["check", str(tmp_path / "recipe.yaml"), "--gpu-memory", "1"]) == 0
    out = capsys.readouterr().out
    assert (
        "valid" in out and "tokenizer " in out and str(chat_data) in out
    )  # its rows, tokenized by the model's

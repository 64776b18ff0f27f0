"""Elastic resume: a checkpoint of N processes continues on M with the global batch kept (distill.elastic)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers.chat import save_chat_model
from helpers.distill_runs import (
    REFERENCE,
    distill,
    launched,
    losses,
    refused,
    resume_matches,
    start_from,
    tree,
    write_recipe,
)

from distill.elastic import ResumeError, elastic_checkpoint, world_state
from distill.recipe import load_recipe
from distill.train import fingerprint, resume_point


def recipe_file(tmp_path: Path, *overrides: str, source: Path | None = None, **train) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(
        json.dumps(
            {
                "output_dir": str(tmp_path / "out"),
                "model": {"source": str(source or tmp_path / "missing")},
                "data": {"sources": [{"path": "d"}]},
                "train": {"micro_batch_size": 2, **train},
            }
        )
    )
    return path


def fake_checkpoint(path: Path, processes: int, grad_accum: int, stage: int = 0, over: tuple = ()) -> Path:
    """A complete checkpoint's trainer_state.json as ``save_checkpoint`` writes it (no weights)."""
    recipe = load_recipe(path, list(over))
    ckpt = Path(recipe.output_dir) / "checkpoints" / "step_4"
    ckpt.mkdir(parents=True)
    state = {
        "step": 4,
        "fingerprint": fingerprint(recipe),
        **world_state(recipe, processes, grad_accum, stage),
    }
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    return ckpt


@pytest.mark.parametrize(
    ("saved", "now", "expected"),
    [((2, 1), 1, 2), ((1, 4), 2, 2), ((4, 1), 2, 2), ((2, 3), 2, 3), ((2, 3), 6, 1), ((1, 1), 1, 1)],
)
def test_the_global_batch_is_kept_by_rescaling_grad_accum(tmp_path, saved, now, expected):
    """(processes, grad_accum) of the checkpoint -> grad_accum on ``now`` processes; the recipe's own
    grad_accum (1 here) only applies to a fresh start."""
    path = recipe_file(tmp_path)
    ckpt = fake_checkpoint(path, *saved)
    resume = resume_point(load_recipe(path), now, 0)
    assert (resume.checkpoint, resume.step, resume.grad_accum) == (ckpt, 4, expected)
    assert resume.elastic == (saved[0] != now)
    if resume.elastic:
        assert resume.describe() == (
            f"converted checkpoint {ckpt} from {saved[0]} to {now} processes "
            f"(grad_accum {saved[1]} -> {expected}, global batch kept)"
        )


def test_a_fresh_start_uses_the_recipe_grad_accum(tmp_path):
    resume = resume_point(load_recipe(recipe_file(tmp_path, grad_accum=3)), 4, 2)
    assert (resume.checkpoint, resume.step, resume.grad_accum, resume.elastic) == (None, 0, 3, False)


@pytest.mark.parametrize(
    ("over", "now", "message"),
    [
        (
            (),
            4,
            "global batch of 6 sequences, which 4 processes x micro_batch_size 2 do not divide; to resolve, "
            "launch with one of [1, 3] processes",
        ),
        (
            ("comm.hook=managed",),
            1,
            "comm hook's per-rank residuals do not carry over to another world size; "
            "to resolve, launch with 3 processes, or drop the comm section",
        ),
    ],
)
def test_a_world_size_that_cannot_continue_is_refused(tmp_path, over, now, message):
    path = recipe_file(tmp_path)
    fake_checkpoint(path, 3, 1, over=over)
    with pytest.raises(ResumeError) as err:
        resume_point(load_recipe(path, list(over)), now, 0)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_checkpoint_of_the_older_format_is_refused_in_one_line(tmp_path):
    """trainer_state.json from before checkpoints recorded their launch: a ResumeError naming what is missing,
    not a KeyError."""
    path = recipe_file(tmp_path)
    state_file = fake_checkpoint(path, 2, 1) / "trainer_state.json"
    state = json.loads(state_file.read_text())
    for key in ("global_batch", "zero_stage"):
        del state[key]
    state_file.write_text(json.dumps(state))
    with pytest.raises(ResumeError) as err:
        resume_point(load_recipe(path), 2, 0)
    assert "does not record global_batch, zero_stage (an older format); to resolve" in str(err.value)
    assert "\n" not in str(err.value)


def test_another_zero_stage_is_refused_by_name_before_any_work(tmp_path, capsys):
    """A ZeRO-2 checkpoint relaunched without DeepSpeed: one line, exit 2, nothing written (the data source
    does not even exist: the check comes before conversion, data and model)."""
    path = recipe_file(tmp_path, source=save_chat_model(tmp_path / "model"))
    out = fake_checkpoint(path, 2, 1, stage=2).parents[1]
    before = tree(out)
    error = refused(capsys, path)
    assert "was written with DeepSpeed ZeRO-2, this launch runs no DeepSpeed" in error
    assert tree(out) == before


def test_the_elastic_folder_links_the_state_and_leaves_out_per_rank_hook_state(tmp_path):
    """Without DeepSpeed: every file hard-linked (no copy of the weights), the comm hook's custom object (the
    second one) left out, written once and reused."""
    ckpt = tmp_path / "step_4"
    ckpt.mkdir()
    names = ["model.safetensors", "optimizer.bin", "custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl"]
    for name in [*names, "random_states_0.pkl", "trainer_state.json"]:
        (ckpt / name).write_bytes(name.encode())
    dst = elastic_checkpoint(ckpt)
    assert dst == ckpt / "elastic" and not (ckpt / ".elastic.tmp").exists()
    assert sorted(p.name for p in dst.iterdir()) == sorted(
        set(names + ["random_states_0.pkl", "trainer_state.json"]) - {"custom_checkpoint_1.pkl"}
    )
    assert all(os.path.samefile(dst / p.name, ckpt / p.name) for p in dst.iterdir())
    (dst / "model.safetensors").unlink()
    assert elastic_checkpoint(ckpt) == dst and not (dst / "model.safetensors").exists()  # not redone


@pytest.mark.smollm2
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["plain", "cpu_2proc_zero2"])
def test_one_to_two_to_one_process_matches_a_run_that_never_changed_size(
    tiny_chat_model, chat_data, distill_reference, tmp_path, backend
):
    """A 1-process run with grad_accum 2 (checkpoints at 2, 4, 6) is the reference: the session's shared one
    without DeepSpeed, its own under ZeRO-2.  Its step-2 checkpoint continues on 2 processes (grad_accum 1;
    DDP, or ZeRO through the universal checkpoint), and that run's step-4 checkpoint continues on 1 process
    again: every logged loss and the final held-out KL equal the reference's (same rows in every global
    batch, the step's mean loss over its micro-batches).  ZeRO-3 runs the chain the other way round, 2 -> 1 ->
    2 processes, in test_train.py."""
    config = None if backend == "plain" else backend

    def on(processes: int, recipe: Path) -> str:
        """Run the recipe to its end on ``processes`` ranks; its output."""
        if config is None and processes == 1:
            return distill(recipe)
        return launched(tmp_path, config, recipe, processes=processes).output()

    reference = distill_reference
    if config is not None:
        reference = tmp_path / "reference"
        on(1, write_recipe(tmp_path, tiny_chat_model, chat_data, reference, **REFERENCE))
    assert len(losses(reference)) == 6

    two = tmp_path / "two"
    start_from(reference, 2, two)
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, two, **REFERENCE)
    resume_matches(on(2, recipe), two, reference, 2, (1, 2))
    state = json.loads((two / "checkpoints" / "step_4" / "trainer_state.json").read_text())
    assert (state["num_processes"], state["grad_accum"], state["global_batch"]) == (2, 1, 4)

    one = tmp_path / "one"
    start_from(two, 4, one)
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, one, **REFERENCE)
    resume_matches(on(1, recipe), one, reference, 4, (2, 1))

"""Real distillation runs on a tiny model: single process, kill-and-resume, 2-process DeepSpeed ZeRO-2/3 (ZeRO-3
also elastic: 2 -> 1 -> 2 processes, killed inside a checkpoint write) and DDP with a managed comm hook."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.chat import conversations
from helpers.distill_runs import (
    REFERENCE,
    check_export,
    complete_checkpoints,
    distill,
    final_kl,
    held_out_kl_falls,
    held_out_metrics,
    killed_at,
    launched,
    losses,
    records,
    refused,
    resume_matches,
    start_from,
    tree,
    write_recipe,
)
from helpers.models import tiny_base
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import swiftkv.convert
from distill.objective import DistillationObjective
from distill.recipe import Recipe, RecipeError, load_recipe
from distill.train import fingerprint, select_trainable
from swiftkv.convert import to_swiftkv

SCAR = "checkpoint.scar={fraction: 1.0, every_steps: 1, block_bytes: 4096}"


def assert_losses_match(out: Path, reference: dict[int, float], steps, rel: float = 1e-6) -> None:
    resumed = losses(out)
    for step in steps:
        assert resumed[step] == pytest.approx(reference[step], rel=rel, abs=rel / 10), step


@pytest.mark.smollm2
@pytest.mark.slow
def test_single_process_run_kill_and_resume(tiny_chat_model, chat_data, distill_reference, tmp_path, capsys):
    """The shared reference run trains and exports only SwiftKV weights, which reproduce its held-out metrics.
    SIGKILL before step 4's scheduler step, then a resume with SCAR switched on: from the full checkpoint of
    step 2 (the running checkpoint starts after it) with the reference's losses; other SCAR block settings are
    then refused in one line.  SIGKILL inside step 4's checkpoint write: the partial folder is skipped, the
    resume from step 2 reproduces the reference; a checkpoint from another recipe is refused by name."""
    reference = losses(distill_reference)
    assert sorted(reference) == [1, 2, 3, 4, 5, 6] and held_out_kl_falls(distill_reference)
    check_export(distill_reference.parent / "recipe-reference.yaml", tiny_chat_model, distill_reference)

    out = tmp_path / "mid-step"
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, out, **REFERENCE)
    killed_at(tmp_path, "step:4", "-m", "distill", recipe)
    assert complete_checkpoints(out) == ["step_2"] and not (out / "model").exists()
    assert max(losses(out)) == 3  # step 3 was logged, nothing of step 4
    text = distill(recipe, SCAR)
    assert f"resumed from {out / 'checkpoints' / 'step_2'} at step 2" in text
    assert "resumed running checkpoint" not in text
    assert_losses_match(out, reference, range(3, 7))
    manifest = json.loads((out / "scar" / "rank_00000" / "manifest.json").read_text())
    assert manifest["step"] == 6

    (out / "model").rename(out / "model-1")
    other = "checkpoint.scar={fraction: 1.0, every_steps: 1, block_bytes: 256}"
    error = refused(capsys, recipe, other, "train.max_steps=8", alone=False)
    assert "block" in error and not (out / "model").exists()

    out = tmp_path / "mid-checkpoint"
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, out, **REFERENCE)
    killed_at(tmp_path, "checkpoint:4", "-m", "distill", recipe)
    assert complete_checkpoints(out) == ["step_2"] and (out / "checkpoints" / ".step_4.tmp").is_dir()
    assert not (out / "model").exists()
    assert f"resumed from {out / 'checkpoints' / 'step_2'} at step 2" in distill(recipe)
    assert_losses_match(out, reference, range(3, 7))

    # a checkpoint from another recipe is refused by name, before any training
    before = tree(out)
    error = refused(capsys, recipe, "data.seq_len=96")
    assert "was written by a different recipe (differs in: data)" in error and tree(out) == before


@pytest.mark.smollm2
@pytest.mark.slow
def test_two_process_zero3_partitioned_elastic_kill_and_resume(tiny_chat_model, tmp_path, capsys):
    """Every parameter a ZeRO-3 partition from load on (zero3_init_flag, persistence threshold 0), with the
    least-squares init fitted layer by layer on those partitions, grad_accum 4 and gradient checkpointing:
    held-out metrics in the run equal a single process's on the exported weights; resuming without DeepSpeed
    is refused.  That run is the reference of an elastic chain: its step-2 checkpoint continues on 1 process
    (grad_accum 8, through the universal checkpoint), whose step-4 checkpoint continues on 2 processes again,
    which are SIGKILLed inside step 6's checkpoint write and resume from their own step-5 checkpoint (the same
    world size): every loss and the final held-out KL equal the reference's."""
    settings = dict(init="lstsq", every=2, keep=3, grad_accum=4, gradient_checkpointing=True)
    zero3 = dict(processes=2, config="cpu_2proc_zero3")
    # 108 training rows (54 micro-batches): the 6 steps of 8 micro-batches stay inside one epoch, so no step
    # is cut short at an epoch's end
    chat_data = tmp_path / "chats.jsonl"
    chat_data.write_text("".join(json.dumps(c) + "\n" for c in conversations(120)))
    out = tmp_path / "zero3"
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, out, **settings)
    launched(
        tmp_path, "cpu_2proc_zero3", recipe, "log.eval_every_steps=2", target=["tests/helpers/zero3_run.py"]
    )
    partitioning = json.loads((out / "partitioning.json").read_text())
    assert partitioning["parameters"] > 50 and partitioning["not_partitioned"] == []
    reference = losses(out)
    assert len(reference) == 6
    evals = [r for r in records(out) if "eval_kl" in r]
    assert [r["step"] for r in evals] == [0, 2, 4, 6]  # the last one is the final evaluation
    assert [r["train_tokens"] for r in evals] == [
        r["step"] * 64 * 2 * 4 * 2 for r in evals
    ]  # seq x batch x accum x ranks
    # the fit alone removes most of the KL the copy init has; training then goes on from there
    assert held_out_metrics(recipe, out / "converted")[0] > 3 * evals[0]["eval_kl"]
    assert final_kl(out) < evals[0]["eval_kl"]
    check_export(recipe, tiny_chat_model, out)

    before = tree(out)
    error = refused(capsys, recipe, "log.eval_every_steps=2")
    assert "was written with DeepSpeed ZeRO-3, this launch runs no DeepSpeed" in error
    assert tree(out) == before

    one = tmp_path / "one"  # 2 -> 1 process
    start_from(out, 2, one)
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, one, **settings)
    job = launched(tmp_path, "cpu_2proc_zero3", recipe, processes=1)
    resume_matches(job.output(), one, out, 2, (2, 4))
    state = json.loads((one / "checkpoints" / "step_4" / "trainer_state.json").read_text())
    assert (state["num_processes"], state["grad_accum"], state["global_batch"]) == (1, 8, 16)

    two = tmp_path / "two"  # 1 -> 2 processes, checkpoints every step, killed inside step 6's
    start_from(one, 4, two)
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, two, **{**settings, "every": 1})
    job = killed_at(tmp_path, "checkpoint:6", "-m", "distill", recipe, **zero3)
    assert "converted checkpoint" in job.output() and "(grad_accum 8 -> 4" in job.output()
    assert (
        complete_checkpoints(two) == ["step_4", "step_5"] and (two / "checkpoints" / ".step_6.tmp").is_dir()
    )
    assert_losses_match(two, reference, [5], rel=1e-5)
    job = launched(tmp_path, "cpu_2proc_zero3", recipe)
    assert f"resumed from {two / 'checkpoints' / 'step_5'} at step 5" in job.output()
    assert "converted checkpoint" not in job.output()  # the same world size: ZeRO-3's own checkpoint
    assert_losses_match(two, reference, [5, 6], rel=1e-5)
    assert final_kl(two) == pytest.approx(final_kl(out), rel=1e-5)


@pytest.mark.smollm2
@pytest.mark.slow
def test_two_process_zero2_lora_bf16(tiny_chat_model, chat_data, tmp_path):
    """LoRA on the SwiftKV projections, bf16 mixed precision and gradient checkpointing under ZeRO-2: the run
    trains (held-out KL falls) and exports the merged model."""
    out = tmp_path / "lora"
    recipe = write_recipe(
        tmp_path,
        tiny_chat_model,
        chat_data,
        out,
        trainable="lora",
        mixed_precision="bf16",
        grad_accum=4,
        gradient_checkpointing=True,
    )
    launched(tmp_path, "cpu_2proc_zero2", recipe, "optim.lr=1e-2")
    assert len(losses(out)) == 6 and held_out_kl_falls(out)
    exported = load_file(out / "model" / "model.safetensors")
    assert not any("lora" in k for k in exported)
    start = to_swiftkv(AutoModelForCausalLM.from_pretrained(tiny_chat_model), 3, 1).state_dict()
    changed = {k for k, v in exported.items() if not torch.equal(v.float(), start[k].to(v.dtype).float())}
    assert changed and all("swiftkv" in k for k in changed)


@pytest.mark.smollm2
@pytest.mark.slow
def test_two_process_ddp_with_managed_communication_and_adarevision(tiny_chat_model, chat_data, tmp_path):
    """A managed comm hook (10% of the blocks) with AdaRevision on 2 DDP processes: the logged bytes stay under
    the budget's share, and the export (one replica) changed SwiftKV weights only (not all of them: in 6
    steps some blocks never go out) and reproduces the run's held-out metrics."""
    out = tmp_path / "ddp"
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, out)
    overrides = [
        "comm.hook=managed",
        "comm.budget=0.1",
        "comm.priority=relative-magnitude",
        "optim.type=adarevision",
        "optim.lr=0.05",
    ]
    launched(tmp_path, None, recipe, *overrides)
    logged = [r for r in records(out) if "comm_byte_ratio" in r]
    assert len(logged) == 6 and all(r["comm_byte_ratio"] < 0.2 for r in logged)
    check_export(recipe, tiny_chat_model, out, every_one=False)


@pytest.mark.parametrize("trainable", ["swiftkv", "lora"])
def test_gradient_checkpointing_recomputes_and_gives_the_same_gradients(trainable):
    """Shared lower layers (frozen, run once) and the student's upper layers under transformers' checkpointing:
    the upper layers really run again in backward, and every trainable gradient is unchanged."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (2, 40), generator=gen)
    pos = torch.arange(40).repeat(2, 1)
    mask = (torch.rand(2, 40, generator=gen) > 0.3).long()
    grads, calls = [], []
    for checkpointing in (False, True):
        recipe = Recipe.model_validate(
            {
                "output_dir": "unused",
                "model": {"source": "unused"},
                "data": {"sources": [{"path": "unused"}]},
                "loss": {"chunk_tokens": 16},
                "train": {"trainable": trainable, "gradient_checkpointing": checkpointing},
            }
        )
        model = to_swiftkv(tiny_base("llama", initializer_range=0.2), 3, 1)
        model.set_mode("student")
        torch.manual_seed(1)
        model = select_trainable(model, recipe)
        with torch.no_grad():  # LoRA's B starts at zero, which would leave A without a gradient
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
        objective = DistillationObjective(model, recipe.loss).train()
        mlp = objective.causal_lm.model.layers[-1].mlp
        calls.append(0)
        mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(-1, calls[-1] + 1))
        objective(ids, pos, mask)["loss"].backward()
        grads.append({n: p.grad for n, p in objective.named_parameters() if p.requires_grad})
    # teacher, the student on each sample's scored rows, then their recompute in backward
    assert calls == [3, 5]
    assert grads[0].keys() == grads[1].keys() and all(g is not None for g in grads[1].values())
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_trainable_all_is_refused_at_validation(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(
        json.dumps({"output_dir": "x", "model": {"source": "m"}, "data": {"sources": [{"path": "d"}]}})
    )
    with pytest.raises(RecipeError) as err:
        load_recipe(path, ["train.trainable=all"])
    assert str(err.value) == (
        "recipe error: train.trainable: trainable=all would train against a moving teacher (teacher and student "
        "share the live weights); use trainable=swiftkv or trainable=lora"
    )


@pytest.mark.parametrize(
    ("override", "which"),
    [("data.loss_on=all", "data.loss_on: all"), ("data.sources.0.format=text", "sources.0")],
)
def test_exact_kv_window_without_replies_is_refused_at_validation(tmp_path, override, which):
    """Every position of a loss_on: all or text sample counts, so every one is exact: the SwiftKV K/V projections
    and norm_swiftkv would get no gradient; refused with a window, accepted without."""
    path = tmp_path / "recipe.yaml"
    path.write_text(
        json.dumps({"output_dir": "x", "model": {"source": "m"}, "data": {"sources": [{"path": "d"}]}})
    )
    with pytest.raises(RecipeError, match=f"model.exact_kv_window=4 needs replies after a prompt.*{which}"):
        load_recipe(path, ["model.exact_kv_window=4", override])
    load_recipe(path, ["model.exact_kv_window=0", override])


def test_resume_fingerprint_ignores_how_the_data_is_built(tmp_path):
    """More tokenizer processes, another cache folder or a longer timeout still resume; other data does not."""
    path = tmp_path / "recipe.yaml"
    path.write_text(
        json.dumps(
            {
                "output_dir": str(tmp_path / "o"),
                "model": {"source": "m"},
                "data": {"sources": [{"path": "d"}]},
            }
        )
    )
    base = fingerprint(load_recipe(path))
    runtime = ["data.num_proc=7", f"data.cache_dir={tmp_path}", "data.tokenize_timeout_minutes=600"]
    assert fingerprint(load_recipe(path, runtime)) == base
    assert fingerprint(load_recipe(path, ["data.seq_len=64"])) != base


@pytest.mark.smollm2
def test_exact_kv_window_trains_in_the_served_regime_and_is_saved(
    tiny_chat_model, chat_data, tmp_path, capsys
):
    """model.exact_kv_window: the run's exported checkpoint carries the window, and its held-out metrics (which
    the trainer computes with the served positions exact) are those of that checkpoint reloaded; AcrossKV
    groups are refused in one line before any work, for a conversion and for a given SwiftKV source."""
    out = tmp_path / "exact"
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, out, max_steps=2)
    distill(recipe, "model.exact_kv_window=4")
    for folder in ("converted", "model"):  # the run starts and ends in the regime it trains in
        assert json.loads((out / folder / "config.json").read_text())["exact_kv_window"] == 4
    assert held_out_metrics(recipe, out / "model")[0] == pytest.approx(final_kl(out), rel=1e-4)
    with pytest.raises(RecipeError, match="exact_kv_window=4 needs swiftkv.group_size=1"):
        load_recipe(recipe, ["model.exact_kv_window=4", "model.swiftkv.group_size=3"])
    grouped = tmp_path / "grouped"
    swiftkv.convert.convert(tiny_chat_model, grouped, num_key_value_layers=3, group_size=3)
    error = refused(
        capsys, recipe, f"model.source={grouped}", "model.exact_kv_window=4", f"output_dir={tmp_path}/g"
    )
    assert "has AcrossKV groups of 3" in error


@pytest.mark.smollm2
def test_a_fresh_conversion_as_source_takes_the_recipes_init_and_is_held_to_its_layout(
    tiny_chat_model, chat_data, tmp_path, capsys
):
    """The main job converts in a stage of its own and trains that conversion: the trainer starts it exactly
    as a conversion of its own (the recipe's least-squares init applies: the same held-out KL at step 0, far
    from the copies'), and refuses one whose layout differs from model.swiftkv in one line, before any work."""
    start = {}
    for name, init in (("itself", "lstsq"), ("copies", "copy")):
        out = tmp_path / name
        distill(write_recipe(tmp_path, tiny_chat_model, chat_data, out, init=init, max_steps=1))
        start[name] = records(out)[0]["eval_kl"]
    converted = swiftkv.convert.convert(tiny_chat_model, tmp_path / "conversion", num_key_value_layers=3)
    given = write_recipe(tmp_path, converted, chat_data, tmp_path / "given", init="lstsq", max_steps=1)
    distill(given)
    assert records(tmp_path / "given")[0]["eval_kl"] == pytest.approx(start["itself"], rel=1e-5)
    assert start["itself"] < 0.9 * start["copies"] and not (tmp_path / "given" / "converted").exists()
    error = refused(capsys, given, "model.swiftkv.num_key_value_layers=4", f"output_dir={tmp_path}/x")
    assert error == (
        f"error: model.source {converted} has num_key_value_layers 3 and group size 1, but model.swiftkv asks "
        "for 4 and 1 (to resolve, convert with the recipe's layout or change model.swiftkv)"
    )

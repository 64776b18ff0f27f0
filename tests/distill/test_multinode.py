"""Several nodes, for real, on one machine: two "nodes" of one process each, each started by
recipes/slurm/node.sh (what srun runs on every node: node-local caches, then accelerate's standard multi-node
launcher with the node's rank), ZeRO-3 over gloo, a shared output folder, against the same run on one node of
two processes.  Kills happen at fault points the ranks wait at (helpers/faults.py), never by timing."""

from __future__ import annotations

import json
import re
from contextlib import closing
from pathlib import Path
from socket import socket

import pytest
from helpers.distill_runs import losses, write_recipe
from helpers.faults import PY, WRAPPER, Job, reserve_port

CONFIG = "recipes/accelerate/cpu_2nodes_zero3.yaml"
SETTINGS = dict(every=2, keep=2, schedule="linear", grad_accum=2, gradient_checkpointing=True)


def node(tmp: Path, rank: int, nodes: int, per_node: int, port: socket, recipe: Path, at=None, **env) -> Job:
    """Node ``rank``: node.sh with the variables srun and the sbatch script set, its own local folder
    (datasets cache and TMPDIR, unless ``env`` names a shared cache), ``swiftkv distill RECIPE`` under the
    fault-point wrapper on each of its ``per_node`` ranks."""
    target = [str(WRAPPER), "-m", "distill", str(recipe)]
    job = Job.command(tmp / f"node{rank}", ["bash", "recipes/slurm/node.sh", CONFIG, *target], port)
    job.ranks = list(range(rank * per_node, (rank + 1) * per_node))
    job.env.pop("HF_DATASETS_CACHE", None)
    job.env.update(
        PYTHON=PY,
        SLURM_NODEID=str(rank),
        SLURM_NNODES=str(nodes),
        GPUS_PER_NODE=str(per_node),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port.getsockname()[1]),
        NODE_LOCAL_DIR=str(job.folder / "local"),
        **({"FAULT_AT": at} if at else {}),
        **env,
    )
    return job


def tokenized(job: Job, rank: int) -> bool:
    """Whether ``rank`` ran the tokenizing map (datasets shows its progress bar only when it computes; a rank
    that finds the cache loads it silently)."""
    return "tokenizing " in job.output(rank, "err")


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


@pytest.mark.smollm2
@pytest.mark.slow
def test_two_nodes_equal_one_node_and_resume_after_a_node_is_killed(tiny_chat_model, chat_data, tmp_path):
    # the reference: one node of two processes, one datasets cache
    ref_out = tmp_path / "one-node"
    ref_recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, ref_out, **SETTINGS)
    with closing(reserve_port()) as port, node(tmp_path / "ref", 0, 1, 2, port, ref_recipe) as ref:
        ref.finish()
    reference = losses(ref_out)
    assert sorted(reference) == [1, 2, 3, 4, 5, 6]
    shared_message = "tokenized by the main process (the datasets cache is shared by every rank)"
    assert shared_message in ref.output(0, "out") and tokenized(ref, 0) and not tokenized(ref, 1)

    # two nodes of one process, node-local caches and temp folders, one shared output folder; node 1's rank
    # stops inside step 4's checkpoint write (its part written; the save ends with a collective, so node 0's
    # rank is past its own part, at the barrier before the rename) and node 1 is SIGKILLed there
    out = tmp_path / "two-nodes"
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, out, **SETTINGS)
    with closing(reserve_port()) as port:
        with (
            node(tmp_path, 0, 2, 1, port, recipe) as node0,
            node(tmp_path, 1, 2, 1, port, recipe, "checkpoint:4") as node1,
        ):
            node1.kill_at_point()
            node0.finish(
                expect=1
            )  # its collective fails on the lost peer, instead of waiting for the timeout
    assert re.search(r"Connection (reset|closed) by peer", node0.output(0, "err"))  # gloo's words for it
    assert "tokenized by each node's main process (node-local datasets caches)" in node0.output(0, "out")
    assert tokenized(node0, 0) and tokenized(node1, 1)  # each into its own cache
    for job in (node0, node1):
        assert list((job.folder / "local" / "hf-datasets").rglob("cache-*.arrow"))
    killed = losses(out)
    assert sorted(killed) == [1, 2, 3, 4] and all(killed[s] == reference[s] for s in killed), (
        killed,
        reference,
    )
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [".step_4.tmp", "step_2"]

    # both nodes again, now sharing one datasets cache (a shared filesystem): tokenized once, by the main
    # process; resumed from the last complete checkpoint, bit-equal to one node
    shared = {"HF_DATASETS_CACHE": str(tmp_path / "shared-cache")}
    with closing(reserve_port()) as port:
        with (
            node(tmp_path, 0, 2, 1, port, recipe, **shared) as node0,
            node(tmp_path, 1, 2, 1, port, recipe, **shared) as node1,
        ):
            node0.finish()
            node1.finish()
    assert f"resumed from {ckpts / 'step_2'} at step 2" in node0.output(0, "out")
    assert shared_message in node0.output(0, "out") and tokenized(node0, 0) and not tokenized(node1, 1)
    resumed = losses(out)
    assert all(resumed[s] == reference[s] for s in (3, 4, 5, 6)), (resumed, reference)
    metrics = [json.loads((o / "final_metrics.json").read_text())["eval_kl"] for o in (out, ref_out)]
    assert metrics[0] == metrics[1]

    # checkpoints and the export written once, into the shared folder, as the one-node run wrote them
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_4", "step_6"]
    for name in ("checkpoints/step_4", "checkpoints/step_6", "model"):
        assert files(out / name) == files(ref_out / name), name
    weights = "model/model.safetensors"
    assert (out / weights).read_bytes() == (ref_out / weights).read_bytes()
    for job in (node0, node1):
        assert not [
            p for p in (job.folder / "local").rglob("*") if "step_" in p.name or p.suffix == ".safetensors"
        ]

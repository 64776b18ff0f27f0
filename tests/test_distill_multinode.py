"""Several nodes, for real, on one machine: two "nodes" of one process each, each started by
recipes/slurm/node.sh (what srun runs on every node: node-local caches, then accelerate's standard multi-node
launcher with the node's rank), ZeRO-3 over gloo, a shared output folder, against the same run on one node of
two processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
CONFIG = "recipes/accelerate/cpu_2nodes_zero3.yaml"
SCRIPT = "tests/distill_multinode_run.py"


def reserve_port() -> socket.socket:
    """A 127.0.0.1 port held for the whole launch: bound with SO_REUSEADDR and not listening, so no other bind
    on this machine takes it, while the rendezvous store (which binds with SO_REUSEADDR) can listen on it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def write_recipe(tmp_path: Path, model: Path, data: Path, out: Path) -> Path:
    recipe = {
        "output_dir": str(out),
        "model": {"source": str(model), "swiftkv": {"num_key_value_layers": 3, "group_size": 1}},
        "data": {"sources": [{"path": str(data)}], "seq_len": 64, "holdout": 0.1},
        "loss": {"chunk_tokens": 32},
        "optim": {"lr": 3e-3, "warmup_ratio": 0.0, "schedule": "constant"},
        "train": {"micro_batch_size": 2, "grad_accum": 2, "max_steps": 6, "gradient_checkpointing": True},
        "checkpoint": {"every_steps": 2, "keep": 2},
        "log": {"every_steps": 1, "eval_batches": 100},
    }
    path = tmp_path / f"recipe-{out.name}.yaml"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    return path


def process_groups(root: int) -> set[int]:
    """The process groups of ``root`` and of every process below it (torch's launcher starts each rank in a
    session of its own), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    groups, todo = set(), [root]
    while todo:
        pid = todo.pop()
        with contextlib.suppress(ProcessLookupError):
            groups.add(os.getpgid(pid))
        todo += children.get(pid, [])
    return groups - {os.getpgid(0)}


class Node:
    """One "node": recipes/slurm/node.sh in a session of its own, with its own local folder (datasets cache
    and TMPDIR) and its output in files."""

    def __init__(self, tmp: Path, rank: int, nodes: int, per_node: int, port: int, args: list[str], **env):
        self.local = tmp / f"node{rank}"
        self.local.mkdir(parents=True, exist_ok=True)
        self.env = {
            **{k: v for k, v in os.environ.items() if k != "HF_DATASETS_CACHE"},
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
            "PYTHON": PY,
            "PYTHONPATH": str(ROOT),  # this checkout's packages for the script, whatever is installed
            "SLURM_NODEID": str(rank),
            "SLURM_NNODES": str(nodes),
            "GPUS_PER_NODE": str(per_node),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "NODE_LOCAL_DIR": str(self.local),
            **env,
        }
        self.cmd = ["bash", "recipes/slurm/node.sh", CONFIG, SCRIPT, *args]
        self.proc: subprocess.Popen | None = None

    def start(self) -> Node:
        with open(self.local / "stdout", "ab") as out, open(self.local / "stderr", "ab") as err:
            self.proc = subprocess.Popen(
                self.cmd, cwd=ROOT, env=self.env, stdout=out, stderr=err, start_new_session=True
            )
        return self

    def stderr(self) -> str:
        return (self.local / "stderr").read_text(errors="replace")

    def wait(self, timeout: float = 900) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(
                f"node {self.env['SLURM_NODEID']} still running after {timeout:.0f} s:\n{self.stderr()[-3000:]}"
            )

    def kill(self) -> None:
        """SIGKILL this node: its launcher's process group and every rank's."""
        if self.proc is not None and self.proc.poll() is None:
            for group in process_groups(self.proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, signal.SIGKILL)
            self.proc.wait()


@contextlib.contextmanager
def launch(tmp: Path, nodes: int, per_node: int, args: list[str], **env):
    """Start ``nodes`` nodes of ``per_node`` processes on one held port; on leaving, kill whatever is left."""
    port = reserve_port()
    started = [
        Node(tmp, r, nodes, per_node, port.getsockname()[1], args, **env).start() for r in range(nodes)
    ]
    try:
        yield started
    finally:
        for node in started:
            node.kill()
        port.close()


def run(tmp: Path, nodes: int, per_node: int, args: list[str], **env) -> list[Node]:
    with launch(tmp, nodes, per_node, args, **env) as started:
        for node in started:
            assert node.wait() == 0, node.stderr()[-3000:]
    return started


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def losses(out: Path) -> dict[int, tuple[float, float, float]]:
    return {r["step"]: (r["loss"], r["kl"], r["mse"]) for r in records(out) if "loss" in r}


def files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def tokenized(node: Node) -> bool:
    """Whether this node's ranks ran the tokenizing map (datasets shows its progress bar only when it computes;
    a rank that finds the cache loads it silently)."""
    return "tokenizing " in node.stderr()


@pytest.mark.smollm2
@pytest.mark.slow
def test_two_nodes_equal_one_node_and_resume_after_a_node_is_killed(tiny_chat_model, chat_data, tmp_path):
    # the reference: one node, two processes, one datasets cache
    ref_out = tmp_path / "one-node"
    ref_recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, ref_out)
    (ref,) = run(tmp_path / "one-node-launch", 1, 2, [str(ref_recipe)])
    reference = losses(ref_out)
    assert sorted(reference) == [1, 2, 3, 4, 5, 6]
    assert (
        "tokenized by the main process (the datasets cache is shared by every rank)"
        in ref.stderr() + (ref.local / "stdout").read_text()
    )

    # two nodes, one process each, node-local caches and temp folders, one shared output folder; every rank
    # stops inside step 4's checkpoint write (its part written, the folder not yet renamed complete)
    out = tmp_path / "two-nodes"
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, out)
    faults = tmp_path / "faults"
    faults.mkdir()
    with launch(
        tmp_path / "two-nodes-launch", 2, 1, [str(recipe)], FAULT_AT=".step_4.tmp", FAULT_DIR=str(faults)
    ) as (
        node0,
        node1,
    ):
        deadline = time.monotonic() + 900
        while not all((faults / f"reached-{r}").exists() for r in (0, 1)):
            for node in (node0, node1):
                assert node.proc.poll() is None, (
                    f"a node ended before the fault point:\n{node.stderr()[-3000:]}"
                )
            assert time.monotonic() < deadline, "the ranks did not reach the fault point"
            time.sleep(0.05)
        node1.kill()  # node 1 is lost
        (faults / "release").touch()  # node 0 goes on, into the next collective, with its peer gone
        assert node0.wait(timeout=300) != 0, "node 0 finished without its peer"
    # data: each node tokenized into its own cache (no node read another's), and the losses up to the kill
    # are bit-equal to one node's
    assert tokenized(node0) and tokenized(node1)
    for node in (node0, node1):
        assert list((node.local / "hf-datasets").rglob("cache-*.arrow")), (
            "no tokenized data in the node's cache"
        )
    killed = losses(out)
    assert sorted(killed) == [1, 2, 3, 4]
    assert all(killed[s] == reference[s] for s in killed), (killed, reference)
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [".step_4.tmp", "step_2"]

    # both nodes again, this time with one datasets cache that both see (a shared filesystem): the run
    # tokenizes once, on the main process, and resumes from the last complete checkpoint
    shared = tmp_path / "shared-cache"
    node0, node1 = run(tmp_path / "resume-launch", 2, 1, [str(recipe)], HF_DATASETS_CACHE=str(shared))
    text = node0.stderr() + (node0.local / "stdout").read_text()
    assert f"resumed from {ckpts / 'step_2'} at step 2" in text
    assert "tokenized by the main process (the datasets cache is shared by every rank)" in text
    assert tokenized(node0) and not tokenized(node1)
    resumed = losses(out)
    assert all(resumed[s] == reference[s] for s in (3, 4, 5, 6)), (resumed, reference)
    final = json.loads((out / "final_metrics.json").read_text())
    assert final["eval_kl"] == json.loads((ref_out / "final_metrics.json").read_text())["eval_kl"]

    # checkpoints and the export written once, into the shared folder, as the one-node run wrote them
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_4", "step_6"]
    for name in ("checkpoints/step_4", "checkpoints/step_6", "model"):
        assert files(out / name).keys() == files(ref_out / name).keys(), name
    weights = "model/model.safetensors"
    assert (out / weights).read_bytes() == (ref_out / weights).read_bytes()
    for node in (node0, node1):
        assert not [p for p in node.local.rglob("*") if "step_" in p.name or p.name == "model.safetensors"]

"""The prioritized running checkpoint (SCAR) of one rank, and partial recovery from it.

Every ``every_steps`` steps ``maybe_save`` writes blocks worth ``fraction`` of the bytes of this rank's blocks
(parameter values plus optimizer state), so that at ``ScarConfig.equal_budget`` it writes as many bytes per
step as a full checkpoint.  The policy orders the blocks and the save writes the longest prefix of that order
that fits the budget; what is left carries over to the next save (at most one block's bytes), so a large
block is written late rather than never, and the long-run bytes per step match the budget exactly.
Orders: SCAR's max-change, by ``||x - x_saved||^2`` per byte in the optimizer's metric (see ``select`` and
``change_norms``), round-robin, or random.
Blocks that have no valid saved copy (first save, a corrupt file) or whose copy lacks optimizer state the
live block has now (saved before the optimizer's first step) are always written, outside the order.
So the checkpoint always holds every block, each at the step it was last written.  ``recover(lost)`` reads
only the lost blocks (checksums verified) back into the live parameters and optimizer state and leaves every
other value untouched; ``recover()`` restores all blocks (a full loss).

Each rank owns one folder ``<directory>/rank_<r>`` and the tensors it is given: under DDP a share of the
replicated parameters (``owned_by_rank``), under ZeRO its optimizer partition (``zero_partitions``).  The
last saved values are kept in host memory to rank blocks by change, as in the paper.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from .blocks import PARAM, Block, block_nbytes, block_payload, make_blocks, restore_payload
from .config import ScarConfig
from .store import (
    MANIFEST,
    CorruptBlockError,
    read_block,
    read_manifest,
    remove_unreferenced,
    write_block,
    write_manifest,
)


class RunningCheckpoint:
    """Running checkpoint of the named tensors ``params`` (and their ``optimizer`` state) of one rank."""

    def __init__(
        self,
        directory: str | Path,
        params: Mapping[str, torch.Tensor],
        config: ScarConfig,
        optimizer: torch.optim.Optimizer | None = None,
        rank: int = 0,
        resume: bool = True,
    ):
        """``resume=False`` (a run that starts from scratch) discards what the folder holds."""
        self.config = config
        self.folder = Path(directory) / f"rank_{rank:05d}"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.params = dict(params)
        self.optimizer = optimizer
        self.blocks: list[Block] = make_blocks(self.params, config)
        self._index = {b.id: i for i, b in enumerate(self.blocks)}
        self.saved: dict[str, torch.Tensor] = {}  # block id -> values at its last save (host memory)
        self.entries: dict[str, dict] = {}  # block id -> manifest entry of its latest valid file
        self.cursor = 0  # round-robin position
        self.credit = 0  # bytes of budget left over from earlier saves
        self.version = 0  # number of completed saves
        self.step: int | None = None  # step of the last completed save (from the manifest on resume)
        self.corrupt: set[str] = set()  # blocks the manifest names whose file is missing or damaged
        self.bytes_written = 0
        if not resume:
            (self.folder / MANIFEST).unlink(missing_ok=True)  # first: the old state is gone as a whole
        self._open()

    def _open(self) -> None:
        """Load an existing manifest (resume after a restart) and the last saved values it names."""
        manifest = read_manifest(self.folder)
        remove_unreferenced(self.folder, manifest)
        if manifest is None:
            return
        unknown = sorted(set(manifest["blocks"]) - set(self._index))
        if unknown:
            raise ValueError(
                f"running checkpoint {self.folder} holds blocks this run does not have ({unknown[0]}, ...); "
                "to resolve, use the same parameters and block settings, or a new folder"
            )
        self.cursor, self.credit, self.version = manifest["cursor"], manifest["credit"], manifest["version"]
        self.step = manifest["step"]
        for bid, entry in manifest["blocks"].items():
            try:
                payload = read_block(self.folder, entry)
            except CorruptBlockError:
                self.corrupt.add(bid)
                continue  # no valid copy: written first at the next save
            self._check_shape(self.blocks[self._index[bid]], payload)
            self.saved[bid], self.entries[bid] = payload[PARAM], entry

    def _check_shape(self, block: Block, payload: Mapping[str, torch.Tensor]) -> None:
        expected = tuple(block.rows(self.params[block.name]).shape)
        if tuple(payload[PARAM].shape) != expected:
            raise ValueError(
                f"running checkpoint block {block.id} has shape {tuple(payload[PARAM].shape)}, the run has "
                f"{expected}; to resolve, use the same parameters and block settings, or a new folder"
            )

    def _state(self, name: str) -> dict | None:
        return None if self.optimizer is None else self.optimizer.state[self.params[name]]

    def change_norms(self) -> dict[str, float]:
        """``||x - x_saved||`` per block in the optimizer's metric; infinite for blocks without a saved copy.

        SCAR's bound is in the norm the iteration contracts in.  Plain SGD steps along the gradient: the
        Euclidean norm.  An Adam-family optimizer (state ``exp_avg_sq`` = v) is gradient descent
        preconditioned by ``1/sqrt(v)``, which contracts in the norm weighted by ``sqrt(v)``: each element's
        change counts ``v ** (1/4)`` times, so a small move of a parameter with large gradients counts more."""
        norms = {}
        for b in self.blocks:
            saved = self.saved.get(b.id)
            if saved is None:
                norms[b.id] = math.inf
                continue
            change = b.rows(self.params[b.name].detach()).to("cpu", torch.float32) - saved.float()
            second_moment = (self._state(b.name) or {}).get("exp_avg_sq")
            if isinstance(second_moment, torch.Tensor) and second_moment.shape == self.params[b.name].shape:
                change *= b.rows(second_moment).to("cpu", torch.float32).pow(0.25)
            norms[b.id] = torch.linalg.vector_norm(change).item()
        return norms

    def block_bytes(self) -> dict[str, int]:
        """Payload bytes per block with the optimizer state as it is now (Adam's appears at its first step)."""
        return {b.id: block_nbytes(b, self.params[b.name], self._state(b.name)) for b in self.blocks}

    def select(self, step: int) -> list[str]:
        """The blocks the running save at ``step`` writes: unsaved ones (no copy, or a copy of another payload
        size: optimizer state has appeared since), then the longest prefix of the policy's order that fits
        the byte budget (this save's share plus the credit left over).

        Max-change orders by ``||x - x_saved||^2`` per byte.  SCAR's bound grows with the norm of the
        perturbation a recovery causes, ``||delta||^2 = sum over lost blocks of ||x_b - x_saved_b||^2``; saving
        block b removes its term at the cost of its bytes, so under a byte budget the largest squared change
        per byte first is the greedy knapsack order.  With equal-size blocks (the paper's setting) it is the
        paper's rule: the largest change first."""
        sizes = self.block_bytes()
        unsaved = [
            b.id for b in self.blocks if self.entries.get(b.id, {}).get("payload_bytes") != sizes[b.id]
        ]
        share = round(self.config.fraction * sum(sizes.values()))  # whole bytes: 1/3 of 240 is 80
        budget = self.credit + share - sum(sizes[b] for b in unsaved)
        pending = set(unsaved)
        candidates = [b.id for b in self.blocks if b.id not in pending]
        if self.config.select == "max-change":
            norms = self.change_norms()
            order = sorted(candidates, key=lambda bid: -(norms[bid] ** 2) / max(1, sizes[bid]))
        elif self.config.select == "round-robin":
            start = self.cursor % max(1, len(candidates))
            order = candidates[start:] + candidates[:start]
        else:
            gen = torch.Generator().manual_seed(self.config.seed * 1_000_003 + step)
            order = [candidates[i] for i in torch.randperm(len(candidates), generator=gen).tolist()]
        chosen = []
        for bid in order:
            if sizes[bid] > budget:
                self.credit = max(0, budget)  # saved up for the block that did not fit; no overdraft
                break
            chosen.append(bid)
            budget -= sizes[bid]
        else:
            self.credit = 0  # every block written: nothing waits for the rest of the budget
        if self.config.select == "round-robin" and candidates:
            self.cursor = (start + len(chosen)) % len(candidates)
        return unsaved + sorted(chosen, key=self._index.__getitem__)

    def maybe_save(self, step: int) -> list[str]:
        """Write the running save due at ``step`` (and any block without a valid copy); return the block ids."""
        if step % self.config.every_steps and len(self.entries) == len(self.blocks):
            return []
        if step % self.config.every_steps:
            return self.save(step, [b.id for b in self.blocks if b.id not in self.entries])
        return self.save(step, self.select(step))

    @torch.no_grad()
    def save(self, step: int, block_ids: Iterable[str] | None = None) -> list[str]:
        """Write the given blocks (default: all) durably, then the manifest; return the block ids written."""
        ids = [b.id for b in self.blocks] if block_ids is None else list(block_ids)
        written, values = {}, {}
        for bid in ids:
            block = self.blocks[self._index[bid]]
            payload = block_payload(block, self.params[block.name], self._state(block.name))
            entry = write_block(
                self.folder, f"{self._index[bid]:06d}.v{self.version + 1}.safetensors", payload
            )
            payload_bytes = sum(t.numel() * t.element_size() for t in payload.values())
            written[bid] = {**entry, "step": step, "payload_bytes": payload_bytes}
            values[bid] = payload[PARAM]
        superseded = [self.entries[bid]["file"] for bid in ids if bid in self.entries]
        self.entries.update(written)
        self.version, self.step = self.version + 1, step
        self.corrupt -= set(ids)
        write_manifest(
            self.folder,
            {
                "step": step,
                "version": self.version,
                "cursor": self.cursor,
                "credit": self.credit,
                "blocks": self.entries,
            },
        )
        for name in superseded:
            (self.folder / name).unlink(missing_ok=True)
        self.saved.update(values)
        self.bytes_written += sum(e["bytes"] for e in written.values())
        return ids

    def resolve(self, names: Iterable[str]) -> list[Block]:
        """Blocks named by block ids or parameter names (a parameter name means all its blocks)."""
        by_name: dict[str, list[Block]] = {}
        for b in self.blocks:
            by_name.setdefault(b.name, []).append(b)
        out: dict[str, Block] = {}
        for name in names:
            if name in self._index:
                out[name] = self.blocks[self._index[name]]
            elif name in by_name:
                out.update((b.id, b) for b in by_name[name])
            else:
                raise ValueError(
                    f"unknown block or parameter {name!r}; to resolve, pass ids from RunningCheckpoint.blocks"
                )
        return sorted(out.values(), key=lambda b: self._index[b.id])

    @torch.no_grad()
    def recover(self, lost: Iterable[str] | None = None, newer_than: int | None = None) -> list[str]:
        """Restore the lost blocks (default: all) from their latest saved copy, parameters and optimizer
        state, in place; every other value stays as it is.  ``newer_than=S`` keeps only blocks saved after
        step S (on top of a full checkpoint of step S).  Return the restored block ids."""
        blocks = self.blocks if lost is None else self.resolve(lost)
        if newer_than is not None:
            blocks = [
                b for b in blocks if b.id not in self.entries or self.entries[b.id]["step"] > newer_than
            ]
        missing = [b.id for b in blocks if b.id not in self.entries]
        if missing:
            raise CorruptBlockError(
                f"{len(missing)} lost block(s) have no valid saved copy ({missing[0]}, ...); "
                "to resolve, restore them from the last full checkpoint"
            )
        counts: dict[str, int] = {}
        for b in blocks:
            counts[b.name] = counts.get(b.name, 0) + 1
        total = {name: sum(b.name == name for b in self.blocks) for name in counts}
        for b in blocks:
            payload = read_block(self.folder, self.entries[b.id])
            self._check_shape(b, payload)
            whole = counts[b.name] == total[b.name]
            restore_payload(b, payload, self.params[b.name], self._state(b.name), whole)
            self.saved[b.id] = payload[PARAM]
        return [b.id for b in blocks]

    def resume_onto(self, full_step: int) -> list[str]:
        """On top of a full checkpoint of ``full_step`` (already loaded into the live tensors), move every
        block saved after it to its newest copy; return the blocks that would have had one but whose file
        is missing or damaged (they keep the full checkpoint's values)."""
        newer = [bid for bid, entry in self.entries.items() if entry["step"] > full_step]
        self.recover(newer)
        return sorted(self.corrupt, key=self._index.__getitem__)

    def detect_corrupt(self) -> set[str]:
        """Blocks whose saved copy is missing, truncated or fails its checksum (re-reads every file)."""
        bad = set()
        for b in self.blocks:
            try:
                read_block(self.folder, self.entries[b.id])
            except (KeyError, CorruptBlockError):
                bad.add(b.id)
        return bad

    def detect_nonfinite(self) -> set[str]:
        """Live blocks holding NaN or infinite values (a fault signal for ``recover``)."""
        return {b.id for b in self.blocks if not torch.isfinite(b.rows(self.params[b.name].detach())).all()}


@torch.no_grad()
def advance_step_counters(optimizer: torch.optim.Optimizer, counters: Mapping[int, object], by: int) -> None:
    """Set each parameter's optimizer step counter (Adam's ``step``) to its value in ``counters`` (from
    ``step_counters`` before a recovery) plus ``by`` steps: after a resume at a later step than the full
    checkpoint, every block's bias correction is that of the resumed step."""
    for index, param in enumerate(p for g in optimizer.param_groups for p in g["params"]):
        state = optimizer.state.get(param, {})
        if index not in counters or "step" not in state:
            continue
        value, current = counters[index] + by, state["step"]
        if isinstance(current, torch.Tensor):  # keep the live counter's kind (a tensor, maybe on a device)
            state["step"] = torch.as_tensor(value, dtype=current.dtype).to(current.device)
        else:
            state["step"] = value.item() if isinstance(value, torch.Tensor) else value


def step_counters(optimizer: torch.optim.Optimizer) -> dict[int, object]:
    """Each parameter's optimizer step counter, by position in the parameter groups (copies)."""
    out = {}
    for index, param in enumerate(p for g in optimizer.param_groups for p in g["params"]):
        step = optimizer.state.get(param, {}).get("step")
        if step is not None:
            out[index] = step.clone() if isinstance(step, torch.Tensor) else step
    return out


def owners(named: Iterable[tuple[str, torch.Tensor]], world_size: int) -> dict[str, int]:
    """Under DDP every rank holds every parameter: a balanced owner per tensor (largest first, to the least
    loaded rank), the same on every rank, so that each block is written by exactly one rank."""
    load = [0] * world_size
    out = {}
    for name, tensor in sorted(named, key=lambda item: (-item[1].numel(), item[0])):
        out[name] = min(range(world_size), key=load.__getitem__)
        load[out[name]] += tensor.numel()
    return out


def owned_by_rank(
    named: Iterable[tuple[str, torch.Tensor]], rank: int, world_size: int
) -> dict[str, torch.Tensor]:
    """The tensors this rank checkpoints under DDP (see ``owners``)."""
    named = list(named)
    owner = owners(named, world_size)
    return {name: tensor for name, tensor in named if owner[name] == rank}


@torch.no_grad()
def broadcast_from_owners(
    named: Iterable[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer | None = None
) -> None:
    """After a DDP recovery each owner restored its own tensors: copy them (and their optimizer state
    tensors) to every replica.  Collective: every rank calls it with the same tensors."""
    import torch.distributed as dist

    tensors = dict(named)
    for name, rank in owners(tensors.items(), dist.get_world_size()).items():
        tensor = tensors[name]
        dist.broadcast(tensor, src=rank)
        state = optimizer.state[tensor] if optimizer is not None else {}
        for key in sorted(k for k, v in state.items() if isinstance(v, torch.Tensor)):
            dist.broadcast(state[key], src=rank)

"""Local (layer-wise) distillation of the SwiftKV projections, before the global KD.

The least-squares init (``swiftkv.lstsq_init``) fits each later layer's keys and values token by token, but what
the layer passes on is its attention output, and there the fitted K/V are still far off (on SmolLM2 at 50%,
relative attention-output errors of 0.2-0.5 in most later layers after the fit).  This stage trains every
group's ``q_proj_swiftkv`` (each member) and ``k/v_proj_swiftkv`` (the leader) so that the SwiftKV attention
reproduces the teacher's attention output of each member layer,

    min  sum_j ||o_proj(attn(q'_j(x_j), k'(h), v'(h))) - o_proj(attn(q_j(x_j), k_j(x_j), v_j(x_j)))||^2 / ||target||^2

on the teacher's own inputs ``x_j`` and ``h = norm_swiftkv(x_l)``: no backward through the stack or the
vocabulary, so a step costs a few attention blocks instead of the whole model and the LM head.  Groups are
independent and run one after the other, streaming the calibration rows' hidden states layer by layer (kept on
the host, like the least-squares fit), so only one group's weights are ever on the device; under ZeRO-3 they
are gathered for the group and rank 0's result is kept.  Every rank trains on its own rows and the gradients are
averaged across ranks, so all ranks hold the same weights.  A group whose calibration error does not fall keeps
its starting weights.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from swiftkv.lstsq_init import Batch, is_distributed, on_device, sum_across_ranks


def _trainable(model: nn.Module, leader: int, members: list[int]) -> dict[str, nn.Linear]:
    """The projections one group trains, by their module path under ``model.model.layers``."""
    layers = model.model.layers
    projs = {
        f"{leader}.k": layers[leader].self_attn.k_proj_swiftkv,
        f"{leader}.v": layers[leader].self_attn.v_proj_swiftkv,
    }
    projs.update({f"{j}.q": layers[j].self_attn.q_proj_swiftkv for j in members})
    return projs


class _Group:
    """One AcrossKV group's calibration data (per batch: h, each member's normed input and teacher attention
    output, all on the host) and its loss for given projection weights."""

    def __init__(self, model: nn.Module, leader: int, members: list[int], prepared: list, h: list) -> None:
        self.model, self.leader, self.members = model, leader, members
        self.rows = [
            {"prepared": p, "h": hi, "normed": [], "target": []} for p, hi in zip(prepared, h, strict=True)
        ]

    def record(self, i: int, normed: torch.Tensor, target: torch.Tensor) -> None:
        """Batch ``i``'s next member: its teacher's normed input and attention output (kept on the host)."""
        self.rows[i]["normed"].append(normed.cpu())
        self.rows[i]["target"].append(target.cpu())

    def loss(
        self, i: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]], device
    ) -> torch.Tensor:
        layers, row = self.model.model.layers, self.rows[i]
        prepared = row["prepared"]
        lead = layers[self.leader].self_attn
        h = row["h"].to(device)
        key = nn.functional.linear(h, *weights[f"{self.leader}.k"])
        value = nn.functional.linear(h, *weights[f"{self.leader}.v"])
        kv = lead.swiftkv_key_value(key, value, prepared.position_embeddings)
        total = h.new_zeros(())
        for j, normed, target in zip(self.members, row["normed"], row["target"], strict=True):
            w, b = weights[f"{j}.q"]
            params = {"q_proj_swiftkv.weight": w} | ({"q_proj_swiftkv.bias": b} if b is not None else {})
            out = functional_call(
                layers[j].self_attn,
                params,
                (normed.to(device), prepared.position_embeddings, prepared.attention_mask),
                {"swiftkv_kv": kv},
                strict=False,
            )[0]
            target = target.to(device)
            total = total + (out - target).pow(2).sum() / target.pow(2).sum().clamp(min=1e-30)
        return total / len(self.members)


def _mean_loss(group: _Group, weights, device) -> float:
    with torch.no_grad():
        total = torch.tensor(
            [sum(group.loss(i, weights, device).item() for i in range(len(group.rows))), len(group.rows)],
            dtype=torch.float64,
        )
    sum_across_ranks(total)
    return (total[0] / total[1].clamp(min=1)).item()


def _train_group(
    group: _Group, projs: dict[str, nn.Linear], steps: int, lr: float, device
) -> tuple[float, float]:
    """Adam on the group's projections (copies, written back only if the calibration error fell)."""
    start = {
        k: (p.weight.detach().clone(), None if p.bias is None else p.bias.detach().clone())
        for k, p in projs.items()
    }
    weights = {
        k: tuple(None if t is None else t.clone().requires_grad_(True) for t in wb) for k, wb in start.items()
    }
    params = [t for wb in weights.values() for t in wb if t is not None]
    optimizer = torch.optim.Adam(params, lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    before = _mean_loss(group, start, device)
    for step in range(steps):
        loss = group.loss(step % len(group.rows), weights, device)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if is_distributed():
            for p in params:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        optimizer.step()
        schedule.step()
    after = _mean_loss(group, weights, device)
    chosen = weights if after < before else start
    with torch.no_grad():
        for k, proj in projs.items():
            proj.weight.copy_(chosen[k][0])
            if proj.bias is not None:
                proj.bias.copy_(chosen[k][1])
    return before, min(before, after)


def distill_locally(
    model: nn.Module,
    batches: Iterable[Batch],
    steps: int,
    lr: float,
    device: torch.device | str | None = None,
) -> dict[str, float]:
    """Train each SwiftKV group's projections for ``steps`` Adam steps (cosine-decayed ``lr``, cycling over
    ``batches``) to reproduce its layers' teacher attention outputs; returns the mean relative attention-output
    error over groups before and after, the calibration tokens and the seconds taken."""
    t0 = time.perf_counter()
    base, config = model.model, model.config
    l, g, num_layers = config.num_key_value_layers, config.key_value_group_size, config.num_hidden_layers
    if l >= num_layers or steps == 0:
        return {"tokens": 0}
    device = torch.device(device) if device is not None else next(model.parameters()).device
    batches = [{k: v for k, v in b.items() if k in ("input_ids", "position_ids")} for b in batches]
    with torch.no_grad():
        with on_device([base.embed_tokens], device):
            hidden = [base.embed_tokens(b["input_ids"].to(device)).cpu() for b in batches]
        prepared = []
        for b, x in zip(batches, hidden, strict=True):
            pos = b.get("position_ids")
            prepared.append(
                base._prepare(
                    None, None, None if pos is None else pos.to(device), None, x.to(device), False, x.shape[1]
                )
            )
        for j in range(l):
            with on_device([base.layers[j]], device):
                hidden = [
                    base._run([base.layers[j]], x.to(device), p).cpu()
                    for x, p in zip(hidden, prepared, strict=True)
                ]
        with on_device([base.norm_swiftkv], device):
            h = [base.norm_swiftkv(x.to(device)).cpu() for x in hidden]
    errors, tokens = [], sum(x.shape[0] * x.shape[1] for x in hidden)
    for leader in range(l, num_layers, g):
        members = list(range(leader, min(leader + g, num_layers)))
        group = _Group(model, leader, members, prepared, h)
        for j in members:  # the members' teacher inputs and attention outputs, then the teacher's next hidden
            layer = base.layers[j]
            with torch.no_grad(), on_device([layer], device):
                for i, (x, p) in enumerate(zip(hidden, prepared, strict=True)):
                    x = x.to(device)
                    normed = layer.input_layernorm(x)
                    group.record(
                        i, normed, layer.self_attn(normed, p.position_embeddings, p.attention_mask)[0]
                    )
                    hidden[i] = base._run([layer], x, p).cpu()
        modules = [base.layers[j] for j in members]
        with on_device(modules, device, modify=True):
            errors.append(_train_group(group, _trainable(model, leader, members), steps, lr, device))
    return {
        "tokens": tokens,
        "attention_error_before": sum(b for b, _ in errors) / len(errors),
        "attention_error_after": sum(a for _, a in errors) / len(errors),
        "seconds": time.perf_counter() - t0,
    }

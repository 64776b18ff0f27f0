"""Least-squares initialization of the SwiftKV K/V projections from the teacher's own keys and values.

Conversion starts every ``k/v_proj_swiftkv`` as a copy (or group mean) of the layer's original projection, which
is applied to ``norm_swiftkv(x_l)`` instead of the layer's own input: far from what the layer used to see.  A
closed form does much better before any training: with ``h = norm_swiftkv(x_l)`` and the teacher's pre-RoPE
keys ``k_j = k_proj_j(norm_j(x_j))`` of every layer ``j`` in a group on calibration tokens, the leader's new
projection is the ridge solution

    W_k = argmin_W  sum_j ||h W^T - k_j||^2 + lambda ||W||^2   (the same for values; an intercept for biases)

which is the least-squares fit to the group's mean key.  Keys are linear in ``h`` before RoPE, so this is the
exact minimizer of the pre-RoPE key error; distillation then fine-tunes what the error on logits asks for.  One
teacher forward over a few thousand tokens and one (H+1)x(H+1) solve per projection.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

Batch = Mapping[str, torch.Tensor]  # input_ids, and optionally position_ids / attention_mask


class _Moments:
    """Running H^T H and H^T Y (float64) of a least-squares problem with shared inputs H."""

    def __init__(self, features: int, bias: bool, device: torch.device) -> None:
        self.bias = bias
        self.hth = torch.zeros(features + bias, features + bias, dtype=torch.float64, device=device)
        self.hty: dict[str, torch.Tensor] = {}
        self.tokens = 0

    def features(self, h: torch.Tensor) -> torch.Tensor:
        h = h.reshape(-1, h.shape[-1]).double()
        return torch.cat([h, h.new_ones(len(h), 1)], dim=1) if self.bias else h

    def add_inputs(self, h: torch.Tensor) -> None:
        self.hth += h.T @ h
        self.tokens += len(h)

    def add_targets(self, name: str, h: torch.Tensor, y: torch.Tensor) -> None:
        moment = h.T @ y.reshape(len(h), -1).double()
        self.hty[name] = self.hty[name] + moment if name in self.hty else moment

    def solve(self, ridge: float) -> dict[str, torch.Tensor]:
        """Ridge solutions ``{name: (in+bias, out)}``; lambda is ``ridge`` x the mean diagonal of H^T H."""
        eye = torch.eye(len(self.hth), dtype=torch.float64, device=self.hth.device)
        system = self.hth + ridge * self.hth.diagonal().mean() * eye
        return {name: torch.linalg.solve(system, hty) for name, hty in self.hty.items()}


@torch.no_grad()
def fit_swiftkv_kv(model: nn.Module, batches: Iterable[Batch], ridge: float = 1e-3) -> dict[str, float]:
    """Set every group leader's ``k_proj_swiftkv``/``v_proj_swiftkv`` to the ridge fit of its group's teacher
    keys/values on ``batches``; ``model`` is a SwiftKV causal LM (left in the mode it was in).

    Returns the calibration token count and the relative key/value error of the copy initialization and of
    the fit on those tokens (sum over projections of ||h W^T - y||^2 / ||y||^2 averaged).  Runs on the
    model's device; batches are moved there."""
    base = model.model
    config = model.config
    l, g, num_layers = config.num_key_value_layers, config.key_value_group_size, config.num_hidden_layers
    if l >= num_layers:
        return {"tokens": 0}
    leaders = base.kv_leaders
    has_bias = leaders[0].k_proj_swiftkv.bias is not None
    device = leaders[0].k_proj_swiftkv.weight.device
    moments = _Moments(config.hidden_size, has_bias, device)
    captured: dict[str, torch.Tensor] = {}

    def keep(name: str):
        return lambda _module, _args, output: captured.__setitem__(name, output)

    hooks = [
        base.layers[l].register_forward_pre_hook(
            lambda _m, args, kwargs: captured.__setitem__(
                "x_l", args[0] if args else kwargs["hidden_states"]
            ),
            with_kwargs=True,
        )
    ]
    for j in range(l, num_layers):
        attn = base.layers[j].self_attn
        hooks += [
            attn.k_proj.register_forward_hook(keep(f"k{j}")),
            attn.v_proj.register_forward_hook(keep(f"v{j}")),
        ]
    was_student, was_training = bool(config.swiftkv), model.training
    model.set_mode("teacher")
    model.eval()
    sums = {"target": 0.0, "copy": 0.0}
    try:
        for batch in batches:
            inputs = ("input_ids", "position_ids", "attention_mask")
            base(**{k: v.to(device) for k, v in batch.items() if k in inputs}, use_cache=False)
            normed = base.norm_swiftkv(captured["x_l"])
            h = moments.features(normed)
            moments.add_inputs(h)
            for index, attn in enumerate(leaders):
                for kind in "kv":
                    group = range(l + index * g, min(l + (index + 1) * g, num_layers))
                    target = sum(captured[f"{kind}{j}"] for j in group) / len(group)
                    moments.add_targets(f"{kind}{index}", h, target)
                    copy = getattr(attn, f"{kind}_proj_swiftkv")(normed)
                    sums["target"] += target.double().square().sum().item()
                    sums["copy"] += (copy - target).double().square().sum().item()
    finally:
        for hook in hooks:
            hook.remove()
    solutions = moments.solve(ridge)
    residual = 0.0
    for index, attn in enumerate(leaders):
        for kind in "kv":
            proj = getattr(attn, f"{kind}_proj_swiftkv")
            solution = solutions[f"{kind}{index}"]
            proj.weight.copy_(solution[: config.hidden_size].T.to(proj.weight.dtype))
            if has_bias:
                proj.bias.copy_(solution[-1].to(proj.bias.dtype))
            # ||HW - Y||^2 = Y^T Y - 2 W^T H^T Y + W^T H^T H W, summed over outputs; Y^T Y is in sums["target"]
            hty = moments.hty[f"{kind}{index}"]
            residual += (-2 * (solution * hty).sum() + (solution * (moments.hth @ solution)).sum()).item()
    model.set_mode("student" if was_student else "teacher")
    model.train(was_training)
    target = max(sums["target"], 1e-30)
    return {
        "tokens": moments.tokens,
        "copy_relative_error": sums["copy"] / target,
        "fit_relative_error": (sums["target"] + residual) / target,
    }

"""Least-squares initialization of the SwiftKV K/V projections from the teacher's own keys and values.

Conversion starts every ``k/v_proj_swiftkv`` as a copy (or group mean) of the layer's original projection, which
is applied to ``norm_swiftkv(x_l)`` instead of the layer's own input: far from what the layer used to see.  A
closed form does much better before any training: with ``h = norm_swiftkv(x_l)`` and the teacher's pre-RoPE
keys ``k_j = k_proj_j(norm_j(x_j))`` of every layer ``j`` in a group on calibration tokens, the leader's new
projection is the ridge solution

    W_k = argmin_W  sum_j ||h W^T - k_j||^2 + lambda ||W||^2   (the same for values; an intercept for biases)

which is the least-squares fit to the group's mean key.  Keys are linear in ``h`` before RoPE, so this is the
exact minimizer of the pre-RoPE key error; distillation then fine-tunes what the error on logits asks for.

The fit runs layer by layer, so it never needs more than one layer's weights on the compute device: the
calibration batches' hidden states are kept on the host, and each layer in turn is brought to the device
(gathered with ``deepspeed.zero.GatheredParameters`` when its parameters are ZeRO-3 partitions, else moved
there and back), applied to every batch, and released.  H^T H is complete after layer l; each group's H^T Y is
accumulated over its layers and solved as soon as the group ends.  Peak device memory beyond one layer:
H^T H and its LU factor, (d+1)^2 float64 each, plus H^T Y for one group's K and V, (d+1) x d_kv float64 each,
plus one batch of activations.  Under ``torch.distributed`` every rank fits on its own batches and the moments
are summed across ranks (every rank must call this, with the same model).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

Batch = Mapping[str, torch.Tensor]  # input_ids, and optionally position_ids


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def sum_across_ranks(t: torch.Tensor) -> torch.Tensor:
    if is_distributed():
        dist.all_reduce(t)
    return t


@contextlib.contextmanager
def on_device(modules: list[nn.Module], device: torch.device, modify: bool = False) -> Iterator[None]:
    """The modules' full weights on ``device`` for the duration: gathered ZeRO-3 partitions (``modify``: rank
    0's in-place edits are kept), or a temporary move of each module that lives elsewhere."""
    params = [p for m in modules for p in m.parameters()]
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=0 if modify else None):
            yield
        return
    homes = [next(m.parameters()).device for m in modules]
    for m in modules:
        m.to(device)
    try:
        yield
    finally:
        for m, home in zip(modules, homes, strict=True):
            m.to(home)


class _Fit:
    """Running H^T H (shared by every projection) and one group's H^T Y, float64, and the ridge solves."""

    def __init__(self, features: int, bias: bool, device: torch.device) -> None:
        self.bias = bias
        self.hth = torch.zeros(features + bias, features + bias, dtype=torch.float64, device=device)
        self.hty: dict[str, torch.Tensor] = {}
        self.copy: dict[str, torch.Tensor] = {}  # the leader's current projections, shaped like a solution
        self.lu = None

    def features(self, h: torch.Tensor) -> torch.Tensor:
        h = h.reshape(-1, h.shape[-1]).double()
        return torch.cat([h, h.new_ones(len(h), 1)], dim=1) if self.bias else h

    def keep_copy(self, kind: str, proj: nn.Linear) -> None:
        weight = proj.weight.T.double()
        self.copy[kind] = torch.cat([weight, proj.bias.double()[None]]) if self.bias else weight

    def add_target(self, kind: str, h: torch.Tensor, y: torch.Tensor, scale: float) -> None:
        moment = h.T @ (y.reshape(len(h), -1).double() * scale)
        self.hty[kind] = self.hty[kind] + moment if kind in self.hty else moment

    def factor(self, ridge: float) -> None:
        """Sum H^T H across ranks and factor H^T H + lambda I; lambda is ``ridge`` x its mean diagonal."""
        sum_across_ranks(self.hth)
        eye = torch.eye(len(self.hth), dtype=torch.float64, device=self.hth.device)
        self.lu = torch.linalg.lu_factor(self.hth + ridge * self.hth.diagonal().mean() * eye)

    def _excess(self, w: torch.Tensor, hty: torch.Tensor) -> float:
        """-2 W.H^T Y + W.H^T H W: the mean squared residual over the group minus its mean ||Y||^2."""
        return (-2 * (w * hty).sum() + (w * (self.hth @ w)).sum()).item()

    def solve(self, kind: str) -> tuple[torch.Tensor, float, float]:
        """This group's ridge solution ``(in+bias, out)`` for ``kind`` and the excess error of the fit and of
        the copy initialization; the group's moments are then dropped."""
        hty = sum_across_ranks(self.hty.pop(kind))
        solution = torch.linalg.lu_solve(*self.lu, hty)
        if is_distributed():  # every rank writes the same solution, bit for bit
            dist.broadcast(solution, 0)
        return solution, self._excess(solution, hty), self._excess(self.copy.pop(kind), hty)


@torch.no_grad()
def fit_swiftkv_kv(
    model: nn.Module, batches: Iterable[Batch], ridge: float = 1e-3, device: torch.device | str | None = None
) -> dict[str, float]:
    """Set every group leader's ``k_proj_swiftkv``/``v_proj_swiftkv`` to the ridge fit of its group's teacher
    keys/values on ``batches``; ``model`` is a SwiftKV causal LM (its mode is not changed: the fit runs the
    original layers directly).

    ``device``: where each layer runs (default: where the model's first parameter lives); the model itself
    stays where it is.  Returns the calibration token count and the relative K/V error of the copy
    initialization and of the fit, sum_j ||h W^T - y_j||^2 / sum_j ||y_j||^2 over every layer j >= l."""
    base, config = model.model, model.config
    l, g, num_layers = config.num_key_value_layers, config.key_value_group_size, config.num_hidden_layers
    if l >= num_layers:
        return {"tokens": 0}
    device = torch.device(device) if device is not None else next(model.parameters()).device
    fit = _Fit(config.hidden_size, base.kv_leaders[0].k_proj_swiftkv.bias is not None, device)
    batches = [{k: v for k, v in b.items() if k in ("input_ids", "position_ids")} for b in batches]
    with on_device([base.embed_tokens], device):
        hidden = [base.embed_tokens(b["input_ids"].to(device)).cpu() for b in batches]
    normed: list[torch.Tensor] = []  # norm_swiftkv(x_l) per batch
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # tokens, sum_j ||y_j||^2
    errors = {"fit": 0.0, "copy": 0.0}
    for j in range(num_layers):
        layer, leader = base.layers[j], l + (j - l) // g * g
        members = min(g, num_layers - leader)
        modules = [layer, base.norm_swiftkv] if j == l else [layer]
        with on_device(modules, device):
            if j >= l and j == leader:
                for kind in "kv":
                    fit.keep_copy(kind, getattr(layer.self_attn, f"{kind}_proj_swiftkv"))
            for i, batch in enumerate(batches):
                x = hidden[i].to(device)
                if j == l:
                    normed.append(base.norm_swiftkv(x).cpu())
                if j >= l:
                    features = fit.features(normed[i].to(device))
                    if j == l:
                        fit.hth += features.T @ features
                        sums[0] += len(features)
                    normed_j = layer.input_layernorm(x)
                    for kind in "kv":
                        target = getattr(layer.self_attn, f"{kind}_proj")(normed_j)
                        fit.add_target(kind, features, target, 1.0 / members)
                        sums[1] += target.double().square().sum()
                if j < num_layers - 1:
                    pos = batch.get("position_ids")
                    prepared = base._prepare(None, None, pos, None, x, False, x.shape[1])
                    hidden[i] = base._run([layer], x, prepared).cpu()
        if j == l:
            fit.factor(ridge)
        if j >= l and j == min(leader + g, num_layers) - 1:  # the group's last layer: solve and write
            for name, excess in _write_group(fit, base.layers[leader].self_attn, device).items():
                errors[name] += members * excess
    sum_across_ranks(sums)
    energy = max(sums[1].item(), 1e-30)
    return {
        "tokens": int(sums[0].item()),
        "copy_relative_error": 1.0 + errors["copy"] / energy,
        "fit_relative_error": 1.0 + errors["fit"] / energy,
    }


def _write_group(fit: _Fit, leader: nn.Module, device: torch.device) -> dict[str, float]:
    """Solve one group's K and V, write them into its leader's projections, return the excess errors."""
    excess = {"fit": 0.0, "copy": 0.0}
    projs = [leader.k_proj_swiftkv, leader.v_proj_swiftkv]
    with on_device(projs, device, modify=True):
        for kind, proj in zip("kv", projs, strict=True):
            solution, fitted, copied = fit.solve(kind)
            excess["fit"], excess["copy"] = excess["fit"] + fitted, excess["copy"] + copied
            proj.weight.copy_(solution[: proj.in_features].T.to(proj.weight.dtype))
            if proj.bias is not None:
                proj.bias.copy_(solution[-1].to(proj.bias.dtype))
    return excess

"""Least-squares K/V initialization: the fitted projections are the least-squares solution computed
independently from the teacher's hidden states, they lower the K/V error and the held-out teacher-student KL,
and nothing but the SwiftKV K/V projections changes."""

from __future__ import annotations

import pytest
import torch
from helpers.models import teacher_student_kl, tiny_base, token_batches

from swiftkv.convert import to_swiftkv
from swiftkv.lstsq_init import fit_swiftkv_kv


def independent_solution(model, data, kind: str, group: range) -> torch.Tensor:
    """[W | b] fitted by torch.linalg.lstsq on features/targets recomputed from output_hidden_states."""
    base, l = model.model, model.config.num_key_value_layers
    model.set_mode("teacher")
    features, targets = [], []
    with torch.no_grad():
        for batch in data:
            hidden = model(**batch, output_hidden_states=True).hidden_states
            features.append(base.norm_swiftkv(hidden[l]).reshape(-1, model.config.hidden_size))
            ys = [
                getattr(base.layers[j].self_attn, f"{kind}_proj")(base.layers[j].input_layernorm(hidden[j]))
                for j in group
            ]
            targets.append((sum(ys) / len(ys)).reshape(len(features[-1]), -1))
    h, y = torch.cat(features).double(), torch.cat(targets).double()
    if base.layers[l].self_attn.k_proj.bias is not None:
        h = torch.cat([h, h.new_ones(len(h), 1)], dim=1)
    model.set_mode("student")
    return torch.linalg.lstsq(h, y).solution


@pytest.mark.parametrize("family, group_size", [("llama", 1), ("qwen2", 3)])
def test_fit_is_the_least_squares_solution(family, group_size):
    model = to_swiftkv(tiny_base(family, initializer_range=0.2), 3, group_size).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    held_out = token_batches(seed=1)
    kl_before = teacher_student_kl(model, held_out)
    stats = fit_swiftkv_kv(model, token_batches(seed=0), ridge=0.0)
    assert stats["tokens"] == 3 * 2 * 96
    assert stats["fit_relative_error"] < stats["copy_relative_error"]
    assert model.config.swiftkv and not model.training  # student mode and eval flag restored
    l, g, layers, hidden = 3, group_size, model.config.num_hidden_layers, model.config.hidden_size
    for leader in range(l, layers, g):
        attn = model.model.layers[leader].self_attn
        for kind in "kv":
            solution = independent_solution(
                model, token_batches(seed=0), kind, range(leader, min(leader + g, layers))
            )
            proj = getattr(attn, f"{kind}_proj_swiftkv")
            torch.testing.assert_close(proj.weight.double(), solution[:hidden].T, rtol=1e-4, atol=1e-5)
            if proj.bias is not None:
                torch.testing.assert_close(proj.bias.double(), solution[hidden], rtol=1e-4, atol=1e-5)
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all("k_proj_swiftkv" in k or "v_proj_swiftkv" in k for k in changed)
    # one K/V for a group of three different random layers can only match their mean: a small gain there
    assert teacher_student_kl(model, held_out) < (0.8 if group_size == 1 else 1.0) * kl_before

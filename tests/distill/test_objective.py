"""The loss: chunked = plain, shared lower layers = two separate passes (value and gradients)."""

from __future__ import annotations

import pytest
import torch
from helpers.models import tiny_base
from torch import nn

from distill.objective import DistillationObjective, agreement_metrics, kd_loss, metrics_from_sums
from distill.recipe import LossSection
from swiftkv.convert import to_swiftkv


def test_chunked_kd_loss_equals_plain():
    torch.manual_seed(0)
    head = nn.Linear(16, 50, bias=False)
    student = torch.randn(2, 9, 16, requires_grad=True)
    teacher = torch.randn(2, 9, 16)
    mask = (torch.rand(2, 9) > 0.3).long()
    values, grads = [], []
    for chunk in (4, 1000):
        student.grad, head.weight.grad = None, None
        loss = kd_loss(student, teacher, head, mask, temperature=2.0, chunk_tokens=chunk)
        loss.backward()
        values.append(loss.detach())
        grads.append((student.grad.clone(), head.weight.grad.clone()))
    torch.testing.assert_close(values[0], values[1])
    torch.testing.assert_close(grads[0], grads[1])
    # by hand: T^2 * mean KL(t||s) at T over counted tokens
    s = torch.log_softmax(head(student) / 2, -1)[mask.bool()]
    t = torch.log_softmax(head(teacher) / 2, -1)[mask.bool()]
    torch.testing.assert_close(values[1], 4 * (t.exp() * (t - s)).sum(-1).mean())


def test_agreement_metrics_perplexities_equal_cross_entropy():
    """The held-out perplexities the trainer logs are exp(mean next-token cross-entropy) over counted tokens,
    whatever the chunking."""
    torch.manual_seed(0)
    head = nn.Linear(16, 50, bias=False)
    student, teacher = torch.randn(2, 9, 16), torch.randn(2, 9, 16)
    ids = torch.randint(0, 50, (2, 9))
    mask = (torch.rand(2, 9) > 0.3).long()
    mask[:, -1] = 0
    got = [metrics_from_sums(agreement_metrics(student, teacher, head, mask, c, ids)) for c in (4, 1000)]
    assert got[0] == pytest.approx(got[1])
    for side, hidden in (("student", student), ("teacher", teacher)):
        ce = nn.functional.cross_entropy(head(hidden[:, :-1]).transpose(1, 2), ids[:, 1:], reduction="none")
        expected = ce[mask[:, :-1].bool()].mean().exp()
        assert got[0][f"ppl_{side}"] == pytest.approx(expected.item(), rel=1e-5)
    assert got[0]["tokens"] == int(mask.sum())


def test_kd_loss_is_zero_when_student_equals_teacher():
    head = nn.Linear(8, 20)
    x = torch.randn(1, 5, 8)
    assert kd_loss(x, x, head, torch.ones(1, 5)).abs() < 1e-6


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_shared_lower_layers_equals_two_passes(family):
    model = to_swiftkv(tiny_base(family), 3, 1)
    for name in model.swiftkv_parameter_names():  # make the paths differ, as during training
        model.get_parameter(name).data.add_(0.05 * torch.randn_like(model.get_parameter(name)))
    for name, p in model.named_parameters():
        p.requires_grad_(name in model.swiftkv_parameter_names())
    ids = torch.randint(3, 128, (2, 12))
    pos = torch.arange(12).expand(2, -1)
    mask = (torch.rand(2, 12) > 0.2).long()
    results = []
    for shared in (True, False):
        objective = DistillationObjective(model, LossSection(chunk_tokens=7), shared_lower_layers=shared)
        model.zero_grad()
        out = objective(ids, pos, mask)
        out["loss"].backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((out["kl"], out["mse"], grads))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-5, rtol=1e-4)
    for name, grad in results[0][2].items():
        torch.testing.assert_close(grad, results[1][2][name], atol=1e-5, rtol=1e-3)
    assert results[0][0] > 0 and all(g.abs().sum() > 0 for g in results[0][2].values())


@pytest.mark.parametrize("shared", [True, False])
def test_exact_kv_student_trains_on_the_served_positions(shared):
    """With exact_kv_window W, the student's K/V are exact at the loss-counted positions and the W - 1 before
    each reply (exact_kv_positions), in both paths: its KL is the one of the reference student with that mask by
    hand, and differs from the plain student's."""
    from helpers.reference import student_logits

    from swiftkv.modeling_swiftkv import exact_kv_positions

    model = to_swiftkv(tiny_base("llama"), 2, 1)
    for name in model.swiftkv_parameter_names():
        model.get_parameter(name).data.add_(0.05 * torch.randn_like(model.get_parameter(name)))
    ids = torch.randint(3, 128, (1, 14), generator=torch.Generator().manual_seed(5))
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5]])  # two packed samples
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0]])
    loss = LossSection(temperature=1.0, mse_weight=0.0)
    objective = DistillationObjective(model, loss, shared_lower_layers=shared).eval()
    with torch.no_grad():
        plain = objective(ids, pos, mask)["kl"]
        model.config.exact_kv_window = 2
        got = objective(ids, pos, mask)["kl"]
        exact = exact_kv_positions(mask, pos, 2)
        assert exact.int().tolist() == [[0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 0]]
        # the reference runs one sample at a time (its positions restart at 0 without packing)
        kl = []
        for part in (slice(0, 8), slice(8, 14)):
            model.set_mode("teacher")
            teacher = model(ids[:, part]).logits.log_softmax(-1)
            model.set_mode("student")
            student = student_logits(model, ids[:, part], None, exact[:, part]).log_softmax(-1)
            counted = mask[:, part].bool()
            kl.append((teacher.exp() * (teacher - student)).sum(-1)[counted])
    torch.testing.assert_close(got, torch.cat(kl).mean(), atol=1e-5, rtol=1e-4)
    assert (got - plain).abs() > 1e-3


def test_last_replies_keep_each_samples_last_reply():
    from distill.objective import last_replies

    # two packed samples: replies at 2-3 and 6-7 in the first, 10-11 in the second; padding after
    loss = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0]])
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 0]])
    assert last_replies(loss, pos).int().tolist() == [[0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 0]]
    # a reply that runs into the next sample's first position is two runs
    loss = torch.tensor([[1, 1, 1, 1]])
    pos = torch.tensor([[0, 1, 0, 1]])
    assert last_replies(loss, pos).int().tolist() == [[1, 1, 1, 1]]
    loss = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 0]])
    pos = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])
    assert last_replies(loss, pos).int().tolist() == [[0, 0, 1, 1], [0, 0, 0, 0]]


@pytest.mark.parametrize("replies", ["last", "all"])
def test_exact_kv_replies_score_each_reply_in_a_served_regime(replies):
    """Every reply the loss counts is scored as some served request would produce it: with ``last`` only each
    sample's last reply counts (exact K/V on it and the W - 1 tokens before it, the history SwiftKV: a request
    without a prefix-cache hit); an earlier reply, whose own tokens carry SwiftKV K/V there, is history, not
    scored.  With ``all`` every reply counts, each exact (a chat continued in its own cache)."""
    from helpers.reference import student_logits

    from swiftkv.modeling_swiftkv import exact_kv_positions

    model = to_swiftkv(tiny_base("llama"), 2, 1)
    for name in model.swiftkv_parameter_names():
        model.get_parameter(name).data.add_(0.05 * torch.randn_like(model.get_parameter(name)))
    ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(6))
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5]])  # two packed samples
    mask = torch.tensor([[0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0]])  # replies 2-3 and 7-8; 12-14
    last = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0]])
    scored = last if replies == "last" else mask
    loss = LossSection(temperature=1.0, mse_weight=0.0, exact_kv_replies=replies)
    model.config.exact_kv_window = 2
    objective = DistillationObjective(model, loss).eval()
    with torch.no_grad():
        got = objective(ids, pos, mask)["kl"]
        exact = exact_kv_positions(scored, pos, 2)
        kl = []
        for part in (slice(0, 10), slice(10, 16)):
            model.set_mode("teacher")
            teacher = model(ids[:, part]).logits.log_softmax(-1)
            model.set_mode("student")
            student = student_logits(model, ids[:, part], None, exact[:, part]).log_softmax(-1)
            kl.append((teacher.exp() * (teacher - student)).sum(-1)[scored[:, part].bool()])
    torch.testing.assert_close(got, torch.cat(kl).mean(), atol=1e-5, rtol=1e-4)
